#include "harness.h"
#include "heapdump/contract/names.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include <gtest/gtest.h>

namespace hdtest {

Child::Child(const std::string &socket, const ChildOptions &options) {
  std::vector<std::string> env = InstrumentedEnv(socket, options.exit_snapshot);
  env.insert(env.end(), options.env.begin(), options.env.end());
  std::vector<std::string> argv = {options.path};
  if (options.snapshot_name != nullptr) argv.push_back(options.snapshot_name);
  program = std::make_unique<Program>(argv, env, options.uid, options.gid, options.pid);
  pid = program->pid;
  if (pid <= 0) {
    if (options.pid == 0) ADD_FAILURE() << "could not start " << options.path;
    return;  // a wanted pid that could not be had is for the caller to judge
  }
  if (options.after_fork) options.after_fork(pid);
  int reported = 0;
  std::string ready = program->ReadLine();
  EXPECT_EQ(sscanf(ready.c_str(), "ready %d %d", &reported, &snapshot_rc), 2) << ready;
  EXPECT_EQ(reported, pid);
}

static ChildOptions Named(const char *snapshot_name, bool exit_snapshot) {
  ChildOptions options;
  options.snapshot_name = snapshot_name;
  options.exit_snapshot = exit_snapshot;
  return options;
}

Child::Child(const std::string &socket, const char *snapshot_name, bool exit_snapshot)
    : Child(socket, Named(snapshot_name, exit_snapshot)) {}

int Child::Snapshot(const std::string &name) {
  program->Send("snapshot " + name);
  int rc = -1000;
  std::string answer = program->ReadLine();
  EXPECT_EQ(sscanf(answer.c_str(), "stored %d", &rc), 1) << answer;
  return rc;
}

void Child::Finish() {
  if (program->pid <= 0) return;
  program->Send("go");
  int status = program->Finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

void Child::Kill() { program->Kill(); }

Workload::Workload(const std::string &socket, const std::vector<std::string> &args,
                   bool exit_snapshot, std::vector<std::string> extra_env) {
  std::vector<std::string> env = InstrumentedEnv(socket, exit_snapshot);
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<std::string> argv = {HD_WORKLOAD};
  argv.insert(argv.end(), args.begin(), args.end());
  program = std::make_unique<Program>(argv, env);
  int reported = 0;
  std::string ready = program->ReadLine();
  EXPECT_EQ(sscanf(ready.c_str(), "ready %d", &reported), 1) << ready;
  EXPECT_EQ(reported, program->pid);
  pid = program->pid;
}

namespace {

using Symbols = std::map<std::string, std::pair<uint64_t, uint64_t>>;

// Function symbols of a binary (file addresses), from nm.
const Symbols &SymbolsOf(const std::string &binary) {
  static std::map<std::string, Symbols> cache;
  auto it = cache.find(binary);
  if (it != cache.end()) return it->second;
  Symbols &symbols = cache[binary];
  FILE *p = popen(("nm -S --defined-only " + binary).c_str(), "r");
  char line[512];
  while (p != nullptr && fgets(line, sizeof line, p)) {
    unsigned long long value, size;
    char type, name[400];
    if (sscanf(line, "%llx %llx %c %399s", &value, &size, &type, name) == 4) {
      symbols[name] = {value, value + size};
    }
  }
  if (p != nullptr) pclose(p);
  return symbols;
}

std::string BaseName(const std::string &path) { return path.substr(path.rfind('/') + 1); }

}  // namespace

std::string FunctionAt(const hd_snapshot *s, uint64_t address, const std::string &binary) {
  const Symbols &symbols = SymbolsOf(binary);
  for (size_t i = 0; i < s->region_count; i++) {
    const hd_snapshot_region &r = s->regions[i];
    if (address < r.address || address >= r.address + r.size) continue;
    if (r.name == nullptr || BaseName(r.name) != BaseName(binary)) return "";
    uint64_t file_address = address - r.address + r.vaddr;
    for (const auto &[name, range] : symbols) {
      if (file_address >= range.first && file_address < range.second) return name;
    }
  }
  return "";
}

Site Blocks(const hd_snapshot *s, uint64_t size, const std::string &function,
            const std::string &binary) {
  Site site;
  for (size_t i = 0; s != nullptr && i < s->allocation_count; i++) {
    const hd_snapshot_allocation &a = s->allocations[i];
    if (a.size != size) continue;
    site.blocks++;
    const hd_snapshot_stack_trace *t = hd_snapshot_find_stack_trace(s, a.stack_trace_key);
    for (size_t f = 0; t != nullptr && !function.empty() && f < t->count; f++) {
      // Return addresses point after the call: look up address - 1 for every frame but the leaf.
      if (FunctionAt(s, t->addresses[f] - (f > 0), binary) == function) {
        site.in_function++;
        break;
      }
    }
    const hd_snapshot_thread *thread = hd_snapshot_find_thread(s, a.thread_info_key);
    if (thread != nullptr) site.thread = thread->name;
  }
  return site;
}

int OpenTable(pid_t pid, const std::string &name) {
  std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  int found = -1;
  DIR *d = opendir(dir.c_str());
  while (d != nullptr && found < 0) {
    struct dirent *e = readdir(d);
    if (e == nullptr) break;
    char target[256];
    ssize_t n = readlink((dir + "/" + e->d_name).c_str(), target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (std::string(target).rfind("/memfd:" + name + " ", 0) == 0) {
      found = open((dir + "/" + e->d_name).c_str(), O_RDWR | O_CLOEXEC);
    }
  }
  if (d != nullptr) closedir(d);
  return found;
}

MappedTable::MappedTable(pid_t pid) {
  int fd = OpenTable(pid, HD_MEMFD_ALLOCATIONS);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) {
    ADD_FAILURE() << "no allocations table in process " << pid;
    if (fd >= 0) close(fd);
    return;
  }
  void *map =
      mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    ADD_FAILURE() << "cannot map the allocations table of process " << pid;
    return;
  }
  header = static_cast<hd_alloc_header *>(map);
  size = static_cast<size_t>(st.st_size);
}

MappedTable::~MappedTable() {
  if (header != nullptr) munmap(header, size);
}

uint32_t *MappedTable::Seq(uint64_t slot) const {
  return reinterpret_cast<uint32_t *>(reinterpret_cast<char *>(header) + header->seq_offset) + slot;
}

hd_alloc_node *MappedTable::Node(uint32_t link) const {
  return reinterpret_cast<hd_alloc_node *>(reinterpret_cast<char *>(header) +
                                           header->nodes_offset) +
         (link - 1);
}

void MappedTable::SetSlotLocked(uint64_t slot, bool locked) const {
  uint32_t *seq = Seq(slot);
  if (((__atomic_load_n(seq, __ATOMIC_ACQUIRE) & 1) != 0) != locked) {
    __atomic_add_fetch(seq, 1, __ATOMIC_RELEASE);
  }
}

}  // namespace hdtest
