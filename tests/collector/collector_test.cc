// End-to-end tests: a real heapdump-collector daemon, real programs under LD_PRELOAD, snapshots
// taken through the generated bindings and checked element by element.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "harness.h"
#include "heapdump/contract/shm_layout.h"

namespace hdtest {
namespace {

class CollectorTest : public ::testing::Test {
 protected:
  std::string dir = TempDir();
  RemoveWhenPassed cleanup{dir};
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
            Error(heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH));
  EXPECT_EQ(TakeLiveSnapshot(collector.socket, nullptr)->error,
            Error(heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH));
  auto unknown = UnknownSelector();
  EXPECT_EQ(TakeLiveSnapshot(collector.socket, &unknown)->error,
            Error(heapdump_client_CollectorError_PROCESS_SELECTOR_UNSUPPORTED));
  Child a(collector.socket, nullptr), b(collector.socket, nullptr);
  auto name = ByName("snapshot_child");
  EXPECT_EQ(TakeLiveSnapshot(collector.socket, &name)->error,
            Error(heapdump_client_CollectorError_PROCESS_SELECTOR_AMBIGUOUS));
  EXPECT_EQ(TakeLiveSnapshot(collector.socket, nullptr)->error,
            Error(heapdump_client_CollectorError_PROCESS_SELECTOR_AMBIGUOUS));
  EXPECT_EQ(TakeLiveSnapshot(collector.socket, &unknown, false, true)->error,
            Error(heapdump_client_CollectorError_PROCESS_SELECTOR_UNSUPPORTED));
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
  EXPECT_NE(multi->ra.snapshots[0]->pid, multi->ra.snapshots[1]->pid);
  a.Finish();
  b.Finish();
}

// The same program started under another name (its /proc/PID/comm is the link's name).
std::string OtherName(const std::string &dir) {
  std::string path = dir + "/other_child";
  EXPECT_EQ(symlink(HD_CHILD, path.c_str()), 0);
  return path;
}

TEST_F(CollectorTest, MultiProcessSnapshotHasOneSnapshotPerProcess) {
  ChildOptions other;
  other.path = OtherName(dir);
  Child a(collector.socket, nullptr);
  Child b(collector.socket, other);
  auto multi = TakeLiveSnapshot(collector.socket, nullptr, false, true);
  ASSERT_EQ(multi->status, HD_OK) << multi->ra.error;
  ASSERT_EQ(multi->ra.snapshot_count, 2u);
  std::map<uint64_t, std::string> seen;
  for (size_t i = 0; i < 2; i++) {
    const hd_snapshot *s = multi->ra.snapshots[i];
    ASSERT_TRUE(s->has_header);
    seen[s->pid] = s->process_name;
    // Each snapshot holds its own process's heap, and nothing of the other's.
    EXPECT_EQ(Blocks(s, 100, "alpha_leaks").in_function, 10u);
    EXPECT_EQ(Blocks(s, 200, "worker_leaks").in_function, 5u);
    EXPECT_EQ(s->stats.live_blocks, s->allocation_count);
  }
  EXPECT_EQ(seen[static_cast<uint64_t>(a.pid)], "snapshot_child");
  EXPECT_EQ(seen[static_cast<uint64_t>(b.pid)], "other_child");
  // A name picks one of them, without headers.
  auto by_name = ByName("other_child");
  auto single = TakeLiveSnapshot(collector.socket, &by_name);
  ASSERT_EQ(single->status, HD_OK) << single->ra.error;
  ASSERT_NE(single->only(), nullptr);
  EXPECT_FALSE(single->only()->has_header);
  a.Finish();
  b.Finish();
}

TEST_F(CollectorTest, DeepStacksAndHugeBlocksArriveWhole) {
  const size_t kBig = 5u << 20;
  Workload workload(collector.socket, {"deep", "300", std::to_string(kBig)});
  auto selector = ByPid(workload.pid);
  auto result = TakeLiveSnapshot(collector.socket, &selector, true);
  ASSERT_EQ(result->status, HD_OK) << result->ra.error;
  const hd_snapshot *s = result->only();
  ASSERT_NE(s, nullptr);
  const hd_snapshot_allocation *deep = nullptr, *big = nullptr;
  for (size_t i = 0; i < s->allocation_count; i++) {
    if (s->allocations[i].size == 64) deep = &s->allocations[i];
    if (s->allocations[i].size == kBig) big = &s->allocations[i];
  }
  ASSERT_NE(deep, nullptr);
  ASSERT_NE(big, nullptr);
  // 300 calls deep: the trace is cut at the instrumentation's limit, every frame in recurse().
  const hd_snapshot_stack_trace *trace = hd_snapshot_find_stack_trace(s, deep->stack_trace_key);
  ASSERT_NE(trace, nullptr);
  EXPECT_EQ(trace->count, static_cast<size_t>(HD_MAX_FRAMES));
  for (size_t f = 0; f < trace->count; f++) {
    EXPECT_EQ(FunctionAt(s, trace->addresses[f] - (f > 0), HD_WORKLOAD), "recurse")
        << "frame " << f;
  }
  // The big block came in many chunks and was put together byte for byte.
  const hd_snapshot_block *contents = hd_snapshot_find_block(s, big->address);
  ASSERT_NE(contents, nullptr);
  ASSERT_EQ(contents->size, kBig);
  size_t wrong = 0;
  for (size_t i = 0; i < kBig; i++) wrong += contents->bytes[i] != static_cast<uint8_t>(i * 7);
  EXPECT_EQ(wrong, 0u);
  EXPECT_GT(result->ra.batches_received, kBig / HD_MAX_MESSAGE_BYTES);
  const hd_snapshot_stack_trace *big_trace = hd_snapshot_find_stack_trace(s, big->stack_trace_key);
  ASSERT_NE(big_trace, nullptr);
  ASSERT_GT(big_trace->count, 0u);
  EXPECT_EQ(FunctionAt(s, big_trace->addresses[0], HD_WORKLOAD), "allocate_big");
}

// The kernel's Rss of a process (/proc/PID/smaps_rollup), in bytes.
uint64_t RollupRss(pid_t pid) {
  const std::string rollup = hdtest::ReadFile("/proc/" + std::to_string(pid) + "/smaps_rollup");
  const size_t at = rollup.find("\nRss:");
  return at == std::string::npos ? 0 : std::stoull(rollup.substr(at + 5)) * 1024;
}

// Where the resident memory of a process is, with either allocator: 48 MiB of written blocks
// in the allocator's part, 24 MiB the program mapped and wrote in the other anonymous memory,
// heapdump's tables in its own; the parts add up to the kernel's count.
TEST_F(CollectorTest, ResidentMemoryIsSplitByWhoseItIs) {
  constexpr uint64_t kMiB = 1 << 20, kBlocks = 48, kMapped = 24;
  for (const char *allocator : {"jemalloc", "system"}) {
    SCOPED_TRACE(allocator);
    Workload workload(collector.socket,
                      {"resident", std::to_string(kBlocks), std::to_string(kMapped)}, false,
                      {std::string("HEAPDUMP_ALLOCATOR=") + allocator});
    auto selector = ByPid(workload.pid);
    const uint64_t before = RollupRss(workload.pid);
    auto result = TakeLiveSnapshot(collector.socket, &selector);
    const uint64_t after = RollupRss(workload.pid);
    ASSERT_EQ(result->status, HD_OK) << result->ra.error;
    const hd_snapshot *s = result->only();
    ASSERT_NE(s, nullptr);
    ASSERT_TRUE(s->has_resident);
    const heapdump_client_ResidentMemory &m = s->resident;
    EXPECT_EQ(m.allocator_bytes + m.heapdump_bytes + m.other_anonymous_bytes + m.file_bytes,
              m.resident_bytes);
    // The process does nothing while it is read: the same count as the kernel's, give or take
    // the pages reading it touched.
    EXPECT_GE(m.resident_bytes + kMiB, std::min(before, after));
    EXPECT_LE(m.resident_bytes, std::max(before, after) + kMiB);
    EXPECT_GE(m.allocator_bytes, kBlocks * kMiB);
    EXPECT_LT(m.other_anonymous_bytes, (kMapped + 8) * kMiB);
    if (std::string(allocator) == "jemalloc") {
      EXPECT_LT(m.allocator_bytes, (kBlocks + 16) * kMiB);
      EXPECT_GE(m.other_anonymous_bytes, kMapped * kMiB);
    } else {
      // glibc's mappings are known by the blocks they hold: one the kernel merged with the
      // program's counts whole as the allocator's (docs/tools.md).
      EXPECT_LT(m.allocator_bytes, (kBlocks + kMapped + 16) * kMiB);
      EXPECT_GE(m.allocator_bytes + m.other_anonymous_bytes, (kBlocks + kMapped) * kMiB);
    }
    EXPECT_GT(m.heapdump_bytes, 0u);
    EXPECT_GT(m.file_bytes, 0u);
    EXPECT_EQ(m.tag_bytes, s->allocation_count * HD_TAG_BYTES);
  }
}

TEST_F(CollectorTest, ManySmallBlocksSpanManyBatches) {
  const size_t kBlocks = 200000;
  Workload workload(collector.socket, {"many", std::to_string(kBlocks)});
  auto selector = ByPid(workload.pid);
  auto result = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(result->status, HD_OK) << result->ra.error;
  const hd_snapshot *s = result->only();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(Blocks(s, 32, "").blocks, kBlocks);
  EXPECT_GT(result->ra.batches_received, 10u);
}

// The collector keeps HD_BATCH_WINDOW batches unanswered (one: each batch is acknowledged before
// the next): a client may read that many before answering any, answer them in any order, and the
// stream then goes on. (A collector that waited for fewer answers would leave a read waiting: the
// receive timeout turns that into a failure.)
TEST_F(CollectorTest, BatchesInFlightMayBeAnsweredLaterAndInAnyOrder) {
  const size_t kBlocks = 50000;
  Workload workload(collector.socket, {"many", std::to_string(kBlocks)});
  Call call(collector.socket);
  const heapdump_client_ProcessSelector selector = ByPid(workload.pid);
  ASSERT_EQ(RequestLiveSnapshot(call, &selector), HD_OK);
  auto msg = std::make_unique<hd_message>();
  struct timeval guard = {60, 0};
  ASSERT_EQ(setsockopt(call.ends[0], SOL_SOCKET, SO_RCVTIMEO, &guard, sizeof guard), 0);
  Result result;
  auto reader = std::make_unique<hd_batch_reader>();
  hd_batch_reader_init(reader.get(), hd_reassembler_add, &result.ra);
  std::vector<uint32_t> unanswered;
  for (unsigned i = 0; i < HD_BATCH_WINDOW; i++) {
    ASSERT_EQ(hd_message_recv(call.ends[0], msg.get()), HD_OK) << "batch " << i;
    ASSERT_EQ(msg->ordinal, HD_ORDINAL_SNAPSHOT_RECEIVER_BATCH);
    ASSERT_EQ(hd_batch_reader_decode(reader.get(), msg.get()), HD_OK);
    ASSERT_GT(reader->element_count, 0u);
    unanswered.push_back(msg->txid);
  }
  heapdump_client_Empty empty = heapdump_client_Empty_init_zero;
  for (auto it = unanswered.rbegin(); it != unanswered.rend(); ++it) {
    ASSERT_EQ(hd_fidl_snapshot_receiver_batch_reply(call.ends[0], msg.get(), *it, &empty), HD_OK);
  }
  ASSERT_EQ(hd_snapshot_receive(call.ends[0], false, &result.ra, &result.error), HD_OK);
  EXPECT_EQ(result.error, 0u);
  ASSERT_EQ(hd_reassembler_finish(&result.ra), HD_OK) << result.ra.error;
  ASSERT_NE(result.only(), nullptr);
  EXPECT_EQ(Blocks(result.only(), 32, "").blocks, kBlocks);
}

// A table whose writer broke the protocol (here every live node claims one address) gives a
// snapshot of what it holds: the copy neither fails nor crashes the collector, and the other
// process is unaffected.
TEST_F(CollectorTest, ATableRecordingOneAddressEverywhereIsCopiedAsItIs) {
  Child healthy(collector.socket, nullptr);
  ChildOptions small;
  small.env = {"HEAPDUMP_MAX_MEMORY=8M"};
  Child victim(collector.socket, small);
  MappedTable table(victim.pid);
  ASSERT_TRUE(table.ok());
  uint64_t claimed = 0, one_address = 0;
  for (uint32_t link = 1; link <= table.header->node_high_water; link++) {
    hd_alloc_node *node = table.Node(link);
    const uint64_t address_word = __atomic_load_n(&node->address_word, __ATOMIC_RELAXED);
    if (address_word == 0) continue;
    if (one_address == 0) one_address = address_word;
    __atomic_store_n(&node->address_word, one_address, __ATOMIC_RELAXED);
    claimed++;
  }
  ASSERT_GT(claimed, 10u);
  auto selector = ByPid(victim.pid);
  auto result = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(result->status, HD_OK) << result->ra.error;
  EXPECT_EQ(result->error, 0u);
  auto healthy_selector = ByPid(healthy.pid);
  auto fine = TakeLiveSnapshot(collector.socket, &healthy_selector);
  ASSERT_EQ(fine->status, HD_OK) << fine->ra.error;
  EXPECT_EQ(fine->error, 0u);
  EXPECT_EQ(Blocks(fine->only(), 100, "alpha_leaks").in_function, 10u);
  victim.Kill();  // its own frees would no longer find their records
  healthy.Finish();
}

// A process whose table claims every node of its (default, large) tables was handed out: the
// copy reads only the pages the process wrote, so the collector commits none of the rest.
TEST_F(CollectorTest, AHighWaterMarkPastWhatWasWrittenCostsTheCollectorNothing) {
  Child healthy(collector.socket, nullptr);
  Child victim(collector.socket, nullptr);
  MappedTable table(victim.pid);
  ASSERT_TRUE(table.ok());
  ASSERT_GT(table.header->node_capacity, 1000000u)
      << "the default tables, whose capacity dwarfs the live set";
  __atomic_store_n(&table.header->node_high_water, table.header->node_capacity, __ATOMIC_RELAXED);

  collector.ResetPeakRss();
  const size_t peak_before_kb = collector.PeakRssKb();
  auto selector = ByPid(victim.pid);
  auto result = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(result->status, HD_OK) << result->ra.error;
  EXPECT_EQ(result->error, 0u);
  EXPECT_LT(collector.PeakRssKb(), peak_before_kb + 32 * 1024);
  auto healthy_selector = ByPid(healthy.pid);
  auto fine = TakeLiveSnapshot(collector.socket, &healthy_selector);
  ASSERT_EQ(fine->status, HD_OK) << fine->ra.error;
  EXPECT_EQ(Blocks(fine->only(), 100, "alpha_leaks").in_function, 10u);
  victim.Kill();
  healthy.Finish();
}

TEST_F(CollectorTest, NamedAndExitSnapshotsSurviveRestartAndKill) {
  uint32_t named_id = 0, exit_id = 0;
  {
    Child child(collector.socket, "checkpoint", true);
    EXPECT_EQ(child.snapshot_rc, 0);
    child.Finish();  // frees the worker's blocks, then exits: the exit snapshot has alpha's only
  }
  // The exit snapshot is stored when the collector notices the exit.
  ASSERT_TRUE(WaitUntil([&] { return List(collector.socket).items.size() >= 2; }));
  auto listed = List(collector.socket);
  ASSERT_EQ(listed.items.size(), 2u);
  named_id = StoredId(listed, "checkpoint");
  exit_id = StoredId(listed, "exit");
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
              Error(heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND));
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
  for (const Stored &s : List(collector.socket).items) newest = std::max(newest, s.id);
  EXPECT_GT(newest, std::max(named_id, exit_id));
  again.Finish();
}

TEST_F(CollectorTest, ListingFiltersBySelector) {
  ChildOptions other;
  other.path = OtherName(dir);
  other.snapshot_name = "from-other";
  Child a(collector.socket, "from-a"), b(collector.socket, "from-b");
  Child o(collector.socket, other);
  EXPECT_EQ(o.Snapshot("again-other"), 0);

  auto all = List(collector.socket);
  ASSERT_EQ(all.status, HD_OK);
  EXPECT_EQ(all.items.size(), 4u);

  auto by_name = ByName("other_child");
  auto named = List(collector.socket, &by_name);
  ASSERT_EQ(named.status, HD_OK);
  std::set<std::string> names;
  for (const Stored &s : named.items) {
    names.insert(s.name);
    EXPECT_EQ(s.process_name, "other_child");
    EXPECT_EQ(s.pid, static_cast<uint64_t>(o.pid));
  }
  EXPECT_EQ(names, (std::set<std::string>{"from-other", "again-other"}));

  auto by_pid = ByPid(a.pid);
  auto of_a = List(collector.socket, &by_pid);
  ASSERT_EQ(of_a.items.size(), 1u);
  EXPECT_EQ(of_a.items[0].name, "from-a");
  EXPECT_EQ(of_a.items[0].process_name, "snapshot_child");

  auto nobody = ByName("no-such-process");
  auto empty = List(collector.socket, &nobody);
  EXPECT_EQ(empty.status, HD_OK);
  EXPECT_EQ(empty.error, 0u);
  EXPECT_TRUE(empty.items.empty());

  auto unknown = UnknownSelector();
  auto refused = List(collector.socket, &unknown);
  EXPECT_EQ(refused.status, HD_OK);
  EXPECT_EQ(refused.error, Error(heapdump_client_CollectorError_PROCESS_SELECTOR_UNSUPPORTED));
  EXPECT_TRUE(refused.items.empty());
  a.Finish();
  b.Finish();
  o.Finish();
}

TEST_F(CollectorTest, ExitSnapshotPendingAtShutdownIsStored) {
  const size_t kBlocks = 300000;
  pid_t pid;
  {
    Workload workload(collector.socket, {"many", std::to_string(kBlocks)}, true);
    pid = workload.pid;
    int status = workload.program->Finish();
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  // At once: the exit is noticed, or its snapshot is being written, or still queued.
  collector.Stop(SIGTERM);
  collector.Start();
  auto listing = List(collector.socket);
  uint32_t id = StoredId(listing, "exit");
  ASSERT_NE(id, 0u) << collector.Log();
  for (const Stored &s : listing.items) EXPECT_EQ(s.pid, static_cast<uint64_t>(pid));
  auto at_exit = Download(collector.socket, id);
  ASSERT_EQ(at_exit->status, HD_OK) << at_exit->ra.error;
  EXPECT_EQ(Blocks(at_exit->only(), 32, "").blocks, kBlocks);
}

TEST(CollectorOptions, BadValuesAreRefusedWithAMessage) {
  std::string dir = TempDir();
  RemoveWhenPassed cleanup{dir};
  for (std::string option :
       {"--max-stored", "--max-storage-bytes", "--log-level", "--sample-interval"}) {
    for (std::string value : {"", "-1", "99999999999999999999999", "12x", "loud", "5"}) {
      if (value == "5" && option != "--sample-interval") continue;  // below its 10 ms
      if (option == "--log-level" && value != "loud") continue;
      std::string command = std::string(HD_COLLECTOR) + " --foreground --socket " + dir +
                            "/s.sock --storage " + dir + "/state " + option + " '" + value +
                            "' 2>" + dir + "/err";
      int status = system(command.c_str());
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << command;
      EXPECT_NE(ReadFile(dir + "/err").find("bad " + option + ": " + value), std::string::npos)
          << command;
    }
  }
  EXPECT_NE(access((dir + "/s.sock").c_str(), F_OK), 0);  // it never started
}

TEST_F(CollectorTest, NoCollectorLeavesTheProgramWorking) {
  Child child(dir + "/nowhere.sock", "lost");
  EXPECT_EQ(child.snapshot_rc, -3);  // HEAPDUMP_ERROR_NO_COLLECTOR
  child.Finish();
}

// A process in a container's PID namespace knows itself by another pid than the one the collector
// sees. It registers (the kernel's NSpid confirms the pid it claims), stores named snapshots and
// is served under the collector's pid for it. It used to be refused, and told no collector ran.
TEST_F(CollectorTest, AProcessInAChildPidNamespaceIsServed) {
  if (system("unshare --pid --fork true >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "cannot create a PID namespace here (needs CAP_SYS_ADMIN)";
  }
  Program program({"/usr/bin/unshare", "--pid", "--fork", HD_CHILD, "contained"},
                  InstrumentedEnv(collector.socket));
  EXPECT_EQ(program.ReadLine(), "ready 1 0");  // pid 1 in its namespace; its snapshot stored
  Listing listing = List(collector.socket);
  pid_t outer = 0;
  for (const Stored &s : listing.items) {
    if (s.name == "contained") outer = static_cast<pid_t>(s.pid);
  }
  ASSERT_GT(outer, 1) << collector.Log();
  auto contained = Download(collector.socket, StoredId(listing, "contained"));
  ASSERT_EQ(contained->status, HD_OK) << contained->ra.error;
  EXPECT_EQ(Blocks(contained->only(), 100, "alpha_leaks").in_function, 10u);
  auto selector = ByPid(outer);
  auto live = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(live->status, HD_OK) << live->ra.error;
  ASSERT_EQ(live->error, 0u) << collector.Log();
  EXPECT_EQ(Blocks(live->only(), 200, "worker_leaks").in_function, 5u);
  EXPECT_NE(collector.Log().find("(pid 1 in its PID namespace)"), std::string::npos)
      << collector.Log();
  int status = program.Finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace
}  // namespace hdtest
