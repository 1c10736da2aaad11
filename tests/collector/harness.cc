#include "harness.h"

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

}  // namespace hdtest
