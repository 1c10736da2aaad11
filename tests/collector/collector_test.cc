// End-to-end tests: a real heapdump-collector daemon, real programs under LD_PRELOAD, snapshots
// taken through the generated bindings and checked element by element.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

extern "C" {
#include <pb_decode.h>
}

extern "C" {
#include "heapdump/fidl/channel.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump_client.bindings.h"
}

namespace {

std::string TempDir() {
  char tmpl[] = "/tmp/hd-collector-test-XXXXXX";
  return mkdtemp(tmpl);
}

// Waits until something accepts connections at path (a stale socket file does not count).
bool WaitForListener(const std::string &path, pid_t owner) {
  for (int i = 0; i < 400; i++) {
    int fd;
    if (hd_channel_connect(path.c_str(), &fd) == HD_OK) {
      close(fd);
      return true;
    }
    if (waitpid(owner, nullptr, WNOHANG) == owner) return false;
    usleep(25000);
  }
  return false;
}

struct Collector {
  std::string dir, socket, storage;
  pid_t pid = -1;
  explicit Collector(const std::string &base) : dir(base) {
    socket = dir + "/run/collector.sock";
    storage = dir + "/state";
  }
  void Start() {
    pid = fork();
    if (pid == 0) {
      execl(HD_COLLECTOR, HD_COLLECTOR, "--foreground", "--socket", socket.c_str(), "--storage",
            storage.c_str(), "--log-level", "warn", (char *)nullptr);
      _exit(127);
    }
    ASSERT_TRUE(WaitForListener(socket, pid)) << "collector did not start";
  }
  void Stop(int sig = SIGTERM) {
    if (pid <= 0) return;
    kill(pid, sig);
    int status = 0;
    waitpid(pid, &status, 0);
    if (sig == SIGTERM) {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    pid = -1;
  }
  ~Collector() { Stop(SIGKILL); }
};

// A snapshot_child under LD_PRELOAD, stopped at "ready" until Finish().
struct Child {
  pid_t pid = -1;
  int in = -1;  // its stdin
  int snapshot_rc = 0;
  Child(const std::string &socket, const char *snapshot_name, bool exit_snapshot = false) {
    int to_child[2], from_child[2];
    EXPECT_EQ(pipe(to_child), 0);
    EXPECT_EQ(pipe(from_child), 0);
    pid = fork();
    if (pid == 0) {
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      setenv("LD_PRELOAD", HD_PRELOAD_LIB, 1);
      setenv("HEAPDUMP_SOCKET", socket.c_str(), 1);
      if (exit_snapshot) setenv("HEAPDUMP_EXIT_SNAPSHOT", "1", 1);
      execl(HD_CHILD, HD_CHILD, snapshot_name, (char *)nullptr);
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    in = to_child[1];
    FILE *out = fdopen(from_child[0], "r");
    int reported = 0;
    EXPECT_EQ(fscanf(out, "ready %d %d", &reported, &snapshot_rc), 2);
    EXPECT_EQ(reported, pid);
    fclose(out);
  }
  void Finish() {
    if (pid <= 0) return;
    EXPECT_EQ(write(in, "go\n", 3), 3);
    close(in);
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    pid = -1;
  }
  ~Child() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

struct Result {
  hd_status status = HD_OK;
  uint32_t error = 0;
  hd_reassembler ra;
  Result() { hd_reassembler_init(&ra); }
  ~Result() { hd_reassembler_destroy(&ra); }
  const hd_snapshot *only() const { return ra.snapshot_count == 1 ? ra.snapshots[0] : nullptr; }
};

// A connection to the collector plus a fresh channel pair: ends[1] is passed with a request.
struct Call {
  int fd = -1;
  int ends[2] = {-1, -1};
  explicit Call(const std::string &socket) {
    EXPECT_EQ(hd_channel_connect(socket.c_str(), &fd), HD_OK);
    EXPECT_EQ(hd_channel_pair(ends), HD_OK);
  }
  void SentTheirEnd() {
    close(ends[1]);
    ends[1] = -1;
  }
  ~Call() {
    for (int f : {fd, ends[0], ends[1]}) {
      if (f >= 0) close(f);
    }
  }
};

std::unique_ptr<Result> TakeLiveSnapshot(const std::string &socket,
                                         const heapdump_client_ProcessSelector *selector,
                                         bool with_contents = false, bool multi = false) {
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

heapdump_client_ProcessSelector ByPid(pid_t pid) {
  heapdump_client_ProcessSelector s = heapdump_client_ProcessSelector_init_zero;
  s.which_selector = heapdump_client_ProcessSelector_by_koid_tag;
  s.selector.by_koid = static_cast<uint64_t>(pid);
  return s;
}

heapdump_client_ProcessSelector ByName(const char *name) {
  heapdump_client_ProcessSelector s = heapdump_client_ProcessSelector_init_zero;
  s.which_selector = heapdump_client_ProcessSelector_by_name_tag;
  strcpy(s.selector.by_name, name);
  return s;
}

// Function symbols of the child binary (file addresses), from nm.
std::map<std::string, std::pair<uint64_t, uint64_t>> ChildSymbols() {
  std::map<std::string, std::pair<uint64_t, uint64_t>> symbols;
  FILE *p = popen("nm -S --defined-only " HD_CHILD, "r");
  char line[512];
  while (fgets(line, sizeof line, p)) {
    unsigned long long value, size;
    char type, name[400];
    if (sscanf(line, "%llx %llx %c %399s", &value, &size, &type, name) == 4) {
      symbols[name] = {value, value + size};
    }
  }
  pclose(p);
  return symbols;
}

// The function of the child binary a program address falls in, via the snapshot's regions.
std::string FunctionAt(const hd_snapshot *s, uint64_t address,
                       const std::map<std::string, std::pair<uint64_t, uint64_t>> &symbols) {
  for (size_t i = 0; i < s->region_count; i++) {
    const hd_snapshot_region &r = s->regions[i];
    if (address < r.address || address >= r.address + r.size) continue;
    if (std::string(r.name).find("snapshot_child") == std::string::npos) return "";
    uint64_t file_address = address - r.address + r.vaddr;
    for (const auto &[name, range] : symbols) {
      if (file_address >= range.first && file_address < range.second) return name;
    }
  }
  return "";
}

// Blocks of a given size, grouped by whether some frame of their stack is in `function`.
struct Site {
  size_t blocks = 0;
  size_t in_function = 0;
  std::string thread;
};

Site Blocks(const hd_snapshot *s, uint64_t size, const std::string &function) {
  auto symbols = ChildSymbols();
  Site site;
  for (size_t i = 0; i < s->allocation_count; i++) {
    const hd_snapshot_allocation &a = s->allocations[i];
    if (a.size != size) continue;
    site.blocks++;
    const hd_snapshot_stack_trace *t = hd_snapshot_find_stack_trace(s, a.stack_trace_key);
    for (size_t f = 0; t != nullptr && f < t->count; f++) {
      // Return addresses point after the call: look up address - 1 for every frame but the leaf.
      if (FunctionAt(s, t->addresses[f] - (f > 0), symbols) == function) {
        site.in_function++;
        break;
      }
    }
    site.thread = hd_snapshot_find_thread(s, a.thread_info_key)->name;
  }
  return site;
}

class CollectorTest : public ::testing::Test {
 protected:
  std::string dir = TempDir();
  Collector collector{dir};
  void SetUp() override { collector.Start(); }
};

TEST_F(CollectorTest, LiveSnapshotHasTheKnownAllocations) {
  Child child(collector.socket, nullptr);
  auto selector = ByPid(child.pid);
  auto result = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(result->status, HD_OK) << result->ra.error;
  ASSERT_EQ(result->error, 0u);
  const hd_snapshot *s = result->only();
  ASSERT_NE(s, nullptr);
  EXPECT_FALSE(s->has_header);
  Site alpha = Blocks(s, 100, "alpha_leaks");
  EXPECT_EQ(alpha.blocks, 10u);
  EXPECT_EQ(alpha.in_function, 10u);
  EXPECT_EQ(alpha.thread, "snapshot_child");
  Site worker = Blocks(s, 200, "worker_leaks");
  EXPECT_EQ(worker.blocks, 5u);
  EXPECT_EQ(worker.in_function, 5u);
  EXPECT_EQ(worker.thread, "hd-worker");
  ASSERT_TRUE(s->has_stats);
  EXPECT_EQ(s->stats.live_blocks, s->allocation_count);
  // Every trace referenced got its cumulative counters.
  for (size_t i = 0; i < s->stack_trace_count; i++) {
    if (s->stack_traces[i].count > 0) {
      EXPECT_TRUE(s->stack_traces[i].has_counters);
    }
  }
  child.Finish();
}

TEST_F(CollectorTest, ContentsAreTheBlocksBytes) {
  Child child(collector.socket, nullptr);
  auto selector = ByName("snapshot_child");
  auto result = TakeLiveSnapshot(collector.socket, &selector, true);
  ASSERT_EQ(result->status, HD_OK) << result->ra.error;
  const hd_snapshot *s = result->only();
  ASSERT_NE(s, nullptr);
  size_t checked = 0;
  for (size_t i = 0; i < s->allocation_count; i++) {
    const hd_snapshot_allocation &a = s->allocations[i];
    if (a.size != 100 && a.size != 200) continue;
    const hd_snapshot_block *b = hd_snapshot_find_block(s, a.address);
    ASSERT_NE(b, nullptr);
    ASSERT_EQ(b->size, a.size);
    EXPECT_EQ(std::string(reinterpret_cast<char *>(b->bytes), b->size),
              std::string(a.size, a.size == 100 ? 'A' : 'W'));
    checked++;
  }
  EXPECT_EQ(checked, 15u);
  child.Finish();
}

TEST_F(CollectorTest, SelectorErrors) {
  auto none = ByPid(1);  // init is never instrumented by this test
  EXPECT_EQ(TakeLiveSnapshot(collector.socket, &none)->error,
            static_cast<uint32_t>(heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH));
  Child a(collector.socket, nullptr), b(collector.socket, nullptr);
  auto name = ByName("snapshot_child");
  EXPECT_EQ(TakeLiveSnapshot(collector.socket, &name)->error,
            static_cast<uint32_t>(heapdump_client_CollectorError_PROCESS_SELECTOR_AMBIGUOUS));
  auto multi = TakeLiveSnapshot(collector.socket, &name, false, true);
  ASSERT_EQ(multi->status, HD_OK) << multi->ra.error;
  ASSERT_EQ(multi->ra.snapshot_count, 2u);
  for (size_t i = 0; i < 2; i++) {
    const hd_snapshot *s = multi->ra.snapshots[i];
    EXPECT_TRUE(s->has_header);
    EXPECT_STREQ(s->process_name, "snapshot_child");
    EXPECT_TRUE(s->pid == static_cast<uint64_t>(a.pid) || s->pid == static_cast<uint64_t>(b.pid));
    EXPECT_EQ(Blocks(s, 100, "alpha_leaks").in_function, 10u);
  }
  a.Finish();
  b.Finish();
}

// Lists the stored snapshots through ListStoredSnapshots + GetNext.
std::vector<std::pair<uint32_t, std::string>> List(const std::string &socket) {
  Call call(socket);
  auto msg = std::make_unique<hd_message>();
  heapdump_client_CollectorListStoredSnapshotsRequest req =
      heapdump_client_CollectorListStoredSnapshotsRequest_init_zero;
  req.has_iterator = true;
  req.iterator = {true, 0};
  EXPECT_EQ(hd_collector_list_stored_snapshots(call.fd, msg.get(), &req, &call.ends[1], 1), HD_OK);
  call.SentTheirEnd();
  std::vector<std::pair<uint32_t, std::string>> out;
  for (;;) {
    heapdump_client_StoredSnapshotIteratorGetNextRequest next =
        heapdump_client_StoredSnapshotIteratorGetNextRequest_init_zero;
    heapdump_client_StoredSnapshotIteratorGetNextResult result =
        heapdump_client_StoredSnapshotIteratorGetNextResult_init_zero;
    size_t before = out.size();
    result.cb_result.arg = &out;
    result.cb_result.funcs.decode = [](pb_istream_t *, const pb_field_t *field, void **arg) {
      if (field->tag == heapdump_client_StoredSnapshotIteratorGetNextResult_response_tag) {
        auto *response = static_cast<heapdump_client_StoredSnapshotIteratorGetNextResponse *>(field->pData);
        response->batch.arg = *arg;
        response->batch.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
          heapdump_client_StoredSnapshot s = heapdump_client_StoredSnapshot_init_zero;
          if (!pb_decode(stream, heapdump_client_StoredSnapshot_fields, &s)) return false;
          static_cast<std::vector<std::pair<uint32_t, std::string>> *>(*arg)->emplace_back(
              s.snapshot_id, s.snapshot_name);
          return true;
        };
      }
      return true;
    };
    EXPECT_EQ(hd_stored_snapshot_iterator_get_next(call.ends[0], msg.get(), &next, nullptr, 0,
                                                   &result),
              HD_OK);
    if (out.size() == before) break;
  }
  return out;
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
  if (result->status == HD_OK && result->error == 0) result->status = hd_reassembler_finish(&result->ra);
  return result;
}

TEST_F(CollectorTest, NamedAndExitSnapshotsSurviveRestartAndKill) {
  uint32_t named_id = 0, exit_id = 0;
  {
    Child child(collector.socket, "checkpoint", true);
    EXPECT_EQ(child.snapshot_rc, 0);
    child.Finish();  // frees the worker's blocks, then exits: the exit snapshot has alpha's only
  }
  // The exit snapshot is stored when the collector notices the exit.
  for (int i = 0; i < 200 && List(collector.socket).size() < 2; i++) usleep(25000);
  auto listed = List(collector.socket);
  ASSERT_EQ(listed.size(), 2u);
  for (auto &[id, name] : listed) (name == "checkpoint" ? named_id : exit_id) = id;
  ASSERT_NE(named_id, 0u);
  ASSERT_NE(exit_id, 0u);
  EXPECT_NE(named_id, exit_id);

  auto check = [&](const char *when) {
    auto named = Download(collector.socket, named_id);
    ASSERT_EQ(named->status, HD_OK) << when << ": " << named->ra.error;
    EXPECT_EQ(Blocks(named->only(), 100, "alpha_leaks").in_function, 10u) << when;
    EXPECT_EQ(Blocks(named->only(), 200, "worker_leaks").in_function, 5u) << when;
    auto at_exit = Download(collector.socket, exit_id);
    ASSERT_EQ(at_exit->status, HD_OK) << when << ": " << at_exit->ra.error;
    EXPECT_EQ(Blocks(at_exit->only(), 100, "alpha_leaks").in_function, 10u) << when;
    EXPECT_EQ(Blocks(at_exit->only(), 200, "worker_leaks").blocks, 0u) << when;
    EXPECT_EQ(Download(collector.socket, 999999)->error,
              static_cast<uint32_t>(heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND));
  };
  check("before restart");
  collector.Stop(SIGTERM);
  collector.Start();
  check("after restart");
  collector.Stop(SIGKILL);
  collector.Start();
  check("after kill -9");
  // Ids are never reused: a new snapshot gets a higher id than both.
  Child again(collector.socket, "again");
  EXPECT_EQ(again.snapshot_rc, 0);
  uint32_t newest = 0;
  for (auto &[id, name] : List(collector.socket)) newest = std::max(newest, id);
  EXPECT_GT(newest, std::max(named_id, exit_id));
  again.Finish();
}

TEST_F(CollectorTest, NoCollectorLeavesTheProgramWorking) {
  Child child(dir + "/nowhere.sock", "lost");
  EXPECT_EQ(child.snapshot_rc, -3);  // HEAPDUMP_ERROR_NO_COLLECTOR
  child.Finish();
}

}  // namespace
