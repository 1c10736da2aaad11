#include "harness.h"
#include "listener.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

extern "C" {
#include <pb_decode.h>
}

namespace hdtest {

std::string TempDir() {
  char tmpl[] = "/tmp/hd-collector-test-XXXXXX";
  return mkdtemp(tmpl);
}

RemoveWhenPassed::~RemoveWhenPassed() {
  if (::testing::Test::HasFailure()) {
    fprintf(stderr, "kept %s\n", path.c_str());
    return;
  }
  auto remove_one = [](const char *file, const struct stat *, int, struct FTW *) {
    return remove(file);
  };
  nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
}

bool WaitUntil(const std::function<bool()> &pred, double seconds) {
  for (int i = 0; i < seconds * 50; i++) {
    if (pred()) return true;
    usleep(20000);
  }
  return pred();
}

std::string ReadFile(const std::string &path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool BecomeUser(uid_t uid, gid_t gid) {
  return setgroups(0, nullptr) == 0 && setgid(gid) == 0 && setuid(uid) == 0;
}

namespace {

std::vector<char *> CStrings(const std::vector<std::string> &strings) {
  std::vector<char *> out;
  for (const std::string &s : strings) out.push_back(const_cast<char *>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

}  // namespace

Collector::Collector(const std::string &base) : dir(base) {
  socket = dir + "/run/collector.sock";
  storage = dir + "/state";
  log = dir + "/collector.log";
}

// A clean stop, checked: in the sanitizer build LeakSanitizer then checks the daemon for leaks.
Collector::~Collector() { Stop(SIGTERM); }

void Collector::Start() {
  std::vector<std::string> argv = {HD_COLLECTOR, "--foreground", "--socket", socket, "--storage",
                                   storage, "--log-level", "debug"};
  argv.insert(argv.end(), args.begin(), args.end());
  pid = fork();
  if (pid == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) dup2(fd, 2);
    for (const std::string &e : env) putenv(const_cast<char *>(e.c_str()));
    if (uid != kSameUser && !BecomeUser(uid, gid)) _exit(126);
    execv(HD_COLLECTOR, CStrings(argv).data());
    _exit(127);
  }
  bool listening = WaitForListener(socket, pid);
  if (!listening) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    pid = -1;
  }
  ASSERT_TRUE(listening) << "collector did not start:\n" << Log();
}

void Collector::Stop(int sig) {
  if (pid <= 0) return;
  kill(pid, sig);
  int status = 0;
  waitpid(pid, &status, 0);
  if (sig == SIGTERM) {
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "collector status " << status << ":\n" << Log();
  }
  pid = -1;
}

size_t Collector::SettledFdCount() const {
  size_t count = Fds().size();
  for (int same = 0, i = 0; same < 10 && i < 500; i++) {
    usleep(50000);
    size_t now = Fds().size();
    same = now == count ? same + 1 : 0;
    count = now;
  }
  return count;
}

std::vector<std::string> Collector::Fds() const {
  std::string path = "/proc/" + std::to_string(pid) + "/fd";
  std::vector<std::string> fds;
  if (DIR *d = opendir(path.c_str())) {
    while (struct dirent *e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      char target[256];
      ssize_t n = readlink((path + "/" + e->d_name).c_str(), target, sizeof target - 1);
      size_t length = n > 0 ? static_cast<size_t>(n) : 0;
      fds.push_back(std::string(e->d_name) + " -> " + std::string(target, length));
    }
    closedir(d);
  }
  return fds;
}

// Makes the next fork likely to get pid: the kernel hands out ns_last_pid + 1 next.
static bool AimNextPid(pid_t pid) {
  int fd = open("/proc/sys/kernel/ns_last_pid", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::string text = std::to_string(pid - 1);
  bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  return ok;
}

Program::Program(const std::vector<std::string> &argv, const std::vector<std::string> &env,
                 uid_t uid, gid_t gid, pid_t want_pid) {
  int to_child[2], from_child[2];
  EXPECT_EQ(pipe2(to_child, O_CLOEXEC), 0);
  EXPECT_EQ(pipe2(from_child, O_CLOEXEC), 0);
  for (int attempt = 0; attempt < 1000; attempt++) {
    if (want_pid != 0 && !AimNextPid(want_pid)) break;
    pid = fork();
    if (pid == 0) {
      if (want_pid != 0 && getpid() != want_pid) _exit(0);
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      for (const std::string &e : env) putenv(const_cast<char *>(e.c_str()));
      if (uid != kSameUser && !BecomeUser(uid, gid)) _exit(126);
      execv(argv[0].c_str(), CStrings(argv).data());
      _exit(127);
    }
    if (want_pid == 0 || pid == want_pid) break;
    waitpid(pid, nullptr, 0);  // another process took the pid first
    pid = -1;
  }
  close(to_child[0]);
  close(from_child[1]);
  in = to_child[1];
  out = fdopen(from_child[0], "r");
}

Program::~Program() {
  Kill();
  if (in >= 0) close(in);
  if (out != nullptr) fclose(out);
}

std::string Program::ReadLine() {
  char line[256];
  if (fgets(line, sizeof line, out) == nullptr) return "";
  line[strcspn(line, "\n")] = '\0';
  return line;
}

void Program::Send(const std::string &line) {
  std::string text = line + "\n";
  EXPECT_EQ(write(in, text.data(), text.size()), static_cast<ssize_t>(text.size()));
}

int Program::Finish() {
  if (in >= 0) close(in);
  in = -1;
  int status = -1;
  if (pid > 0) waitpid(pid, &status, 0);
  pid = -1;
  return status;
}

void Program::Kill() {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  pid = -1;
}

std::vector<std::string> InstrumentedEnv(const std::string &socket, bool exit_snapshot) {
  std::vector<std::string> env = {std::string("LD_PRELOAD=") + HD_PRELOAD_LIB,
                                  "HEAPDUMP_SOCKET=" + socket};
  if (exit_snapshot) env.push_back("HEAPDUMP_EXIT_SNAPSHOT=1");
  return env;
}

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

Call::Call(const std::string &socket) {
  EXPECT_EQ(hd_channel_connect(socket.c_str(), &fd), HD_OK);
  EXPECT_EQ(hd_channel_pair(ends), HD_OK);
}

void Call::SentTheirEnd() {
  close(ends[1]);
  ends[1] = -1;
}

Call::~Call() {
  for (int f : {fd, ends[0], ends[1]}) {
    if (f >= 0) close(f);
  }
}

std::unique_ptr<Result> TakeLiveSnapshot(const std::string &socket,
                                         const heapdump_client_ProcessSelector *selector,
                                         bool with_contents, bool multi) {
  auto result = std::make_unique<Result>();
  Call call(socket);
  heapdump_client_CollectorTakeLiveSnapshotRequest req =
      heapdump_client_CollectorTakeLiveSnapshotRequest_init_zero;
  if (selector != nullptr) {
    req.has_process_selector = true;
    req.process_selector = *selector;
  }
  req.has_receiver = true;
  req.receiver = {true, 0};
  req.has_with_contents = req.has_multi_process = true;
  req.with_contents = with_contents;
  req.multi_process = multi;
  auto msg = std::make_unique<hd_message>();
  EXPECT_EQ(hd_collector_take_live_snapshot(call.fd, msg.get(), &req, &call.ends[1], 1), HD_OK);
  call.SentTheirEnd();
  result->status = hd_snapshot_receive(call.ends[0], multi, &result->ra, &result->error);
  if (result->status == HD_OK && result->error == 0) {
    result->status = hd_reassembler_finish(&result->ra);
  }
  return result;
}

std::unique_ptr<Result> Download(const std::string &socket, uint32_t id) {
  auto result = std::make_unique<Result>();
  Call call(socket);
  auto msg = std::make_unique<hd_message>();
  heapdump_client_CollectorDownloadStoredSnapshotRequest req =
      heapdump_client_CollectorDownloadStoredSnapshotRequest_init_zero;
  req.has_snapshot_id = req.has_receiver = true;
  req.snapshot_id = id;
  req.receiver = {true, 0};
  EXPECT_EQ(hd_collector_download_stored_snapshot(call.fd, msg.get(), &req, &call.ends[1], 1),
            HD_OK);
  call.SentTheirEnd();
  result->status = hd_snapshot_receive(call.ends[0], false, &result->ra, &result->error);
  if (result->status == HD_OK && result->error == 0) {
    result->status = hd_reassembler_finish(&result->ra);
  }
  return result;
}

namespace {

bool DecodeStored(pb_istream_t *stream, const pb_field_t *, void **arg) {
  heapdump_client_StoredSnapshot s = heapdump_client_StoredSnapshot_init_zero;
  if (!pb_decode(stream, heapdump_client_StoredSnapshot_fields, &s)) return false;
  static_cast<std::vector<Stored> *>(*arg)->push_back(
      {s.snapshot_id, s.snapshot_name, s.process_name, s.process_koid});
  return true;
}

bool PrepareResponse(pb_istream_t *, const pb_field_t *field, void **arg) {
  if (field->tag == heapdump_client_StoredSnapshotIteratorGetNextResult_response_tag) {
    auto *response =
        static_cast<heapdump_client_StoredSnapshotIteratorGetNextResponse *>(field->pData);
    response->batch.arg = *arg;
    response->batch.funcs.decode = DecodeStored;
  }
  return true;
}

}  // namespace

Listing List(const std::string &socket, const heapdump_client_ProcessSelector *selector) {
  Listing listing;
  Call call(socket);
  auto msg = std::make_unique<hd_message>();
  heapdump_client_CollectorListStoredSnapshotsRequest req =
      heapdump_client_CollectorListStoredSnapshotsRequest_init_zero;
  req.has_iterator = true;
  req.iterator = {true, 0};
  if (selector != nullptr) {
    req.has_process_selector = true;
    req.process_selector = *selector;
  }
  EXPECT_EQ(hd_collector_list_stored_snapshots(call.fd, msg.get(), &req, &call.ends[1], 1), HD_OK);
  call.SentTheirEnd();
  for (;;) {
    heapdump_client_StoredSnapshotIteratorGetNextRequest next =
        heapdump_client_StoredSnapshotIteratorGetNextRequest_init_zero;
    heapdump_client_StoredSnapshotIteratorGetNextResult result =
        heapdump_client_StoredSnapshotIteratorGetNextResult_init_zero;
    size_t before = listing.items.size();
    result.cb_result.arg = &listing.items;
    result.cb_result.funcs.decode = PrepareResponse;
    listing.status = hd_stored_snapshot_iterator_get_next(call.ends[0], msg.get(), &next, nullptr,
                                                          0, &result);
    if (listing.status != HD_OK) break;
    if (result.which_result == heapdump_client_StoredSnapshotIteratorGetNextResult_err_tag) {
      listing.error = static_cast<uint32_t>(result.result.err);
      break;
    }
    if (listing.items.size() == before) break;
  }
  return listing;
}

uint32_t StoredId(const Listing &listing, const std::string &name) {
  uint32_t id = 0;
  int found = 0;
  for (const Stored &s : listing.items) {
    if (s.name == name) {
      id = s.id;
      found++;
    }
  }
  return found == 1 ? id : 0;
}

heapdump_client_ProcessSelector ByPid(pid_t pid) {
  heapdump_client_ProcessSelector s = heapdump_client_ProcessSelector_init_zero;
  s.which_selector = heapdump_client_ProcessSelector_by_koid_tag;
  s.selector.by_koid = static_cast<uint64_t>(pid);
  return s;
}

heapdump_client_ProcessSelector ByName(const char *name) {
  heapdump_client_ProcessSelector s = heapdump_client_ProcessSelector_init_zero;
  s.which_selector = heapdump_client_ProcessSelector_by_name_tag;
  snprintf(s.selector.by_name, sizeof s.selector.by_name, "%s", name);
  return s;
}

heapdump_client_ProcessSelector UnknownSelector() {
  // Encoded as an empty ProcessSelector: present, with no variant set.
  heapdump_client_ProcessSelector s = heapdump_client_ProcessSelector_init_zero;
  return s;
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

}  // namespace hdtest
