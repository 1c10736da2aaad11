// Processes that hold their locks, die inside the library or forge what they send, and clients
// that stop answering: each test is one way such a peer could stall the collector, or make it
// serve what is not so, shown against a real collector and real processes under LD_PRELOAD.
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "harness.h"
#include "heapdump/contract/names.h"
#include "heapdump/heapdump.h"
#include "heapdump_process.bindings.h"

namespace hdtest {
namespace {

class HostileTest : public ::testing::Test {
 protected:
  std::string dir = TempDir("hostile");
  RemoveWhenPassed cleanup{dir};
  Collector collector{dir};
};

size_t CountStored(const std::string &socket, const std::string &name) {
  size_t n = 0;
  for (const Stored &s : List(socket).items) n += s.name == name;
  return n;
}

// Whether the process is blocked receiving on a socket: waiting for the collector's answer.
bool WaitingForAnswer(pid_t pid) {
  return ReadFile("/proc/" + std::to_string(pid) + "/syscall")
             .rfind(std::to_string(SYS_recvmsg) + " ", 0) == 0;
}

ProcessStatus FinalState(const std::string &socket, pid_t pid) {
  ProcessStatus state;
  for (int i = 0; i < 1000; i++) {
    state = GetProcessState(socket, pid);
    if (state.state != heapdump_client_ProcessState_PROCESS_STATE_RUNNING &&
        state.state != heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_PENDING) {
      break;
    }
    usleep(20000);
  }
  return state;
}

// Holds one sequence slot of a table after another, each just under the reader's patience for
// one slot, the next taken before the last is let go: a reader waiting on it would wait for
// every slot the table's nodes use in turn.
class LockWalker {
 public:
  explicit LockWalker(const MappedTable &table) : table_(table) {
    const uint64_t used =
        (table.header->node_high_water + HD_NODES_PER_SLOT - 1) / HD_NODES_PER_SLOT;
    slots_ = std::min<uint64_t>(std::max<uint64_t>(used, 2), HD_SEQ_SLOTS);
    table_.SetSlotLocked(0, true);  // before any reader starts, which is far quicker than a thread
    thread_ = std::thread([this] {
      uint64_t slot = 0;
      while (!done_) {
        for (int i = 0; i < 80 && !done_; i++) usleep(10000);
        table_.SetSlotLocked((slot + 1) % slots_, true);
        table_.SetSlotLocked(slot, false);
        slot = (slot + 1) % slots_;
      }
      table_.SetSlotLocked(slot, false);
    });
  }
  ~LockWalker() {
    done_ = true;
    thread_.join();
  }

 private:
  const MappedTable &table_;
  uint64_t slots_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// A named snapshot whose store outlasts the library's 2 s connection timeouts (the collector is
// stopped while the program waits) is stored once, and the program told it is stored; with a
// shorter HEAPDUMP_SNAPSHOT_TIMEOUT the program is told there was no answer, and it is still
// stored once. It used to be sent again on a new connection and stored twice.
TEST_F(HostileTest, ASlowStoreIsStoredOnceAndTheProgramToldTheTruth) {
  collector.Start();
  ChildOptions impatient;
  impatient.env = {"HEAPDUMP_SNAPSHOT_TIMEOUT=1"};
  Child child(collector.socket, nullptr);
  Child hasty(collector.socket, impatient);
  ASSERT_EQ(kill(collector.pid, SIGSTOP), 0);
  child.program->Send("snapshot slow");
  hasty.program->Send("snapshot hasty");
  EXPECT_TRUE(
      WaitUntil([&] { return WaitingForAnswer(child.pid) && WaitingForAnswer(hasty.pid); }));
  EXPECT_EQ(hasty.program->ReadLine(), "stored " + std::to_string(HEAPDUMP_ERROR_NO_ANSWER));
  sleep(3);
  ASSERT_EQ(kill(collector.pid, SIGCONT), 0);
  EXPECT_EQ(child.program->ReadLine(), "stored 0");
  EXPECT_TRUE(WaitUntil([&] { return CountStored(collector.socket, "hasty") == 1; }));
  // The late answer is not taken for the next request's.
  EXPECT_EQ(hasty.Snapshot("after"), 0);
  EXPECT_EQ(CountStored(collector.socket, "slow"), 1u);
  EXPECT_EQ(CountStored(collector.socket, "hasty"), 1u) << collector.Log();
  child.Finish();
  hasty.Finish();
}

// A process that sent its registration and was killed and reaped before the collector read it
// (its pid may name another process by then) is not taken in: without a pidfd the collector
// would serve whatever process has that pid next under its name.
TEST_F(HostileTest, AProcessGoneBeforeItsRegistrationIsReadIsNotTakenIn) {
  collector.Start();
  ASSERT_EQ(kill(collector.pid, SIGSTOP), 0);
  Program program({HD_CHILD}, InstrumentedEnv(collector.socket));
  const pid_t pid = program.pid;
  EXPECT_TRUE(WaitUntil([&] { return WaitingForAnswer(pid); }));
  program.Kill();
  ASSERT_EQ(kill(collector.pid, SIGCONT), 0);
  const std::string refused = "pid " + std::to_string(pid) + ": refused: cannot watch its exit";
  EXPECT_TRUE(WaitUntil([&] { return collector.Log().find(refused) != std::string::npos; }))
      << collector.Log();
  EXPECT_EQ(collector.Log().find("[" + std::to_string(pid) + "]"), std::string::npos)
      << collector.Log();
  EXPECT_EQ(GetProcessState(collector.socket, pid).state,
            heapdump_client_ProcessState_PROCESS_STATE_UNKNOWN);
}

// The process's own end of its snapshot sink, taken from it with pidfd_getfd: the unnamed one of
// its sockets (the registry connection's peer is the collector's socket).
int TakeSink(pid_t pid) {
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) return -1;
  int sink = -1;
  for (int fd = 3; fd < 1024 && sink < 0; fd++) {
    char target[64] = "";
    std::string link = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
    if (readlink(link.c_str(), target, sizeof target - 1) <= 0 ||
        strncmp(target, "socket:", 7) != 0)
      continue;
    int taken = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
    if (taken < 0) continue;
    struct sockaddr_un peer = {};
    socklen_t len = sizeof peer;
    if (getpeername(taken, reinterpret_cast<sockaddr *>(&peer), &len) == 0 &&
        len <= sizeof(sa_family_t)) {
      sink = taken;
    } else {
      close(taken);
    }
  }
  close(pidfd);
  return sink;
}

// A copy of a process's table (the memfd called `name`) in a memfd of our own, as a forger would
// make it: edit changes its bytes, then it is sealed with seals.
int CopyTable(pid_t pid, const std::string &name, int seals,
              const std::function<void(char *)> &edit) {
  int live = OpenTable(pid, name);
  struct stat st;
  if (live < 0 || fstat(live, &st) != 0) return -1;
  int copy = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  std::vector<char> bytes(static_cast<size_t>(st.st_size));
  bool ok =
      copy >= 0 && pread(live, bytes.data(), bytes.size(), 0) == static_cast<ssize_t>(bytes.size());
  close(live);
  edit(bytes.data());
  ok = ok && pwrite(copy, bytes.data(), bytes.size(), 0) == static_cast<ssize_t>(bytes.size()) &&
       fcntl(copy, F_ADD_SEALS, seals) == 0;
  if (!ok && copy >= 0) close(copy);
  return ok ? copy : -1;
}

// A copy of a process's allocations table, its header's flags and pid set.
int CopyTable(pid_t pid, uint32_t flags, uint32_t table_pid, int seals) {
  return CopyTable(pid, HD_MEMFD_ALLOCATIONS, seals, [&](char *bytes) {
    auto *header = reinterpret_cast<hd_alloc_header *>(bytes);
    header->flags = flags;
    header->pid = table_pid;
  });
}

// What the collector answers a StoreNamedSnapshot sent on sink: the snapshot id, or -error.
int64_t Store(int sink, const char *name, int table) {
  heapdump_process_SnapshotSinkStoreNamedSnapshotRequest req =
      heapdump_process_SnapshotSinkStoreNamedSnapshotRequest_init_zero;
  req.has_name = req.has_allocations_snapshot = true;
  snprintf(req.name, sizeof req.name, "%s", name);
  req.allocations_snapshot = {true, 0};
  heapdump_process_SnapshotSinkStoreNamedSnapshotResponse resp =
      heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_init_zero;
  auto msg = std::make_unique<hd_message>();
  hd_status status =
      hd_fidl_snapshot_sink_store_named_snapshot(sink, msg.get(), &req, &table, 1, &resp);
  close(table);
  EXPECT_EQ(status, HD_OK) << hd_status_str(status);
  if (status != HD_OK) return -1000;
  return resp.has_error ? -static_cast<int64_t>(resp.error) : resp.snapshot_id;
}

// A descriptor of the same file, read-only.
int ReadOnly(int fd) {
  int ro = open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_CLOEXEC);
  close(fd);
  return ro;
}

// The collector only reads a process's tables, and refuses descriptors it could write them
// through, however good the tables: this test registers itself with copies of a child's tables.
TEST_F(HostileTest, TablesHandedOverWritableAreRefused) {
  collector.Start();
  ChildOptions small;
  small.env = {"HEAPDUMP_MAX_MEMORY=8M"};
  Child child(collector.socket, small);
  const uint32_t self = static_cast<uint32_t>(getpid());
  const int seals = F_SEAL_SHRINK | F_SEAL_GROW;
  auto register_with = [&](int alloc, int res) {
    int sink[2];
    EXPECT_EQ(hd_channel_pair(sink), HD_OK);
    int fd = -1;
    EXPECT_EQ(hd_channel_connect(collector.socket.c_str(), &fd), HD_OK);
    heapdump_process_RegistryRegisterRequest req =
        heapdump_process_RegistryRegisterRequest_init_zero;
    req.has_protocol_version = req.has_layout_version = req.has_pid = true;
    req.protocol_version = heapdump_process_Version_PROTOCOL_VERSION;
    req.layout_version = HD_LAYOUT_VERSION;
    req.pid = self;
    req.has_allocations_table = req.has_resources_table = req.has_snapshot_sink = true;
    req.allocations_table = {true, 0};
    req.resources_table = {true, 1};
    req.snapshot_sink = {true, 2};
    const int fds[3] = {alloc, res, sink[1]};
    heapdump_process_RegistryRegisterResponse resp =
        heapdump_process_RegistryRegisterResponse_init_zero;
    auto msg = std::make_unique<hd_message>();
    EXPECT_EQ(hd_fidl_registry_register(fd, msg.get(), &req, fds, 3, &resp), HD_OK);
    for (int f : {alloc, res, sink[1]}) close(f);
    return std::make_pair(resp.has_error ? static_cast<int>(resp.error) : 0,
                          std::array<int, 2>{fd, sink[0]});
  };
  auto alloc_copy = [&] { return CopyTable(child.pid, 0, self, seals); };
  auto res_copy = [&] {
    return CopyTable(child.pid, HD_MEMFD_RESOURCES, seals,
                     [&](char *bytes) { reinterpret_cast<hd_res_header *>(bytes)->pid = self; });
  };
  auto writable = register_with(alloc_copy(), res_copy());
  EXPECT_EQ(writable.first, heapdump_process_RegistryError_BAD_TABLE);
  EXPECT_NE(collector.Log().find("handed over writable"), std::string::npos) << collector.Log();
  auto read_only = register_with(ReadOnly(alloc_copy()), ReadOnly(res_copy()));
  EXPECT_EQ(read_only.first, 0) << collector.Log();
  EXPECT_EQ(GetProcessState(collector.socket, getpid()).state,
            heapdump_client_ProcessState_PROCESS_STATE_RUNNING);
  for (const auto &connection : {writable.second, read_only.second}) {
    for (int fd : connection) close(fd);
  }
  child.Finish();
}

// What the collector answers a Reattach this process sends for `pid`, naming the allocations
// table `table`: 0, or the RegistryError.
int Reattach(const std::string &socket, uint64_t pid, const struct stat &table) {
  int sink[2];
  EXPECT_EQ(hd_channel_pair(sink), HD_OK);
  int fd = -1;
  EXPECT_EQ(hd_channel_connect(socket.c_str(), &fd), HD_OK);
  heapdump_process_RegistryReattachRequest req = heapdump_process_RegistryReattachRequest_init_zero;
  req.has_protocol_version = req.has_layout_version = req.has_pid = true;
  req.protocol_version = heapdump_process_Version_PROTOCOL_VERSION;
  req.layout_version = HD_LAYOUT_VERSION;
  req.pid = pid;
  req.has_allocations_table_device = req.has_allocations_table_inode = true;
  req.allocations_table_device = table.st_dev;
  req.allocations_table_inode = table.st_ino;
  req.has_snapshot_sink = true;
  req.snapshot_sink = {true, 0};
  heapdump_process_RegistryReattachResponse resp =
      heapdump_process_RegistryReattachResponse_init_zero;
  auto msg = std::make_unique<hd_message>();
  EXPECT_EQ(hd_fidl_registry_reattach(fd, msg.get(), &req, &sink[1], 1, &resp), HD_OK);
  for (int f : {fd, sink[0], sink[1]}) close(f);
  return resp.has_error ? static_cast<int>(resp.error) : 0;
}

// A registered process that closed every descriptor gets a new sink by naming the table it
// registered (ForkRegister.TheProgramsOwnDescriptorsAreNeverTouched). Another process cannot
// take that sink: not by naming the table, nor by claiming the process's pid.
TEST_F(HostileTest, OnlyTheRegisteredProcessReattaches) {
  collector.Start();
  Child child(collector.socket, ChildOptions{});
  int table = OpenTable(child.pid, HD_MEMFD_ALLOCATIONS);
  ASSERT_GE(table, 0);
  struct stat st;
  ASSERT_EQ(fstat(table, &st), 0);
  close(table);
  EXPECT_EQ(Reattach(collector.socket, static_cast<uint64_t>(getpid()), st),
            heapdump_process_RegistryError_NOT_REGISTERED);
  EXPECT_EQ(Reattach(collector.socket, static_cast<uint64_t>(child.pid), st),
            heapdump_process_RegistryError_NOT_ALLOWED);
  EXPECT_NE(collector.Log().find("refused to reattach"), std::string::npos) << collector.Log();
  EXPECT_EQ(collector.Log().find("reattached"), std::string::npos) << collector.Log();
  EXPECT_EQ(GetProcessState(collector.socket, child.pid).state,
            heapdump_client_ProcessState_PROCESS_STATE_RUNNING);
  child.Finish();
}

// What the collector answers a ReportArmFailure this process sends for `pid`: 0, or the
// RegistryError. Without `what`, the request lacks a required field.
int ReportArmFailure(const std::string &socket, uint64_t pid, uint64_t generation,
                     const char *what) {
  int fd = -1;
  EXPECT_EQ(hd_channel_connect(socket.c_str(), &fd), HD_OK);
  heapdump_process_RegistryReportArmFailureRequest req =
      heapdump_process_RegistryReportArmFailureRequest_init_zero;
  req.has_protocol_version = req.has_layout_version = req.has_pid = true;
  req.protocol_version = heapdump_process_Version_PROTOCOL_VERSION;
  req.layout_version = HD_LAYOUT_VERSION;
  req.pid = pid;
  req.has_arm_generation = req.has_error_number = true;
  req.arm_generation = generation;
  req.error_number = ENOMEM;
  req.has_what = what != nullptr;
  if (what != nullptr) snprintf(req.what, sizeof req.what, "%s", what);
  heapdump_process_RegistryReportArmFailureResponse resp =
      heapdump_process_RegistryReportArmFailureResponse_init_zero;
  auto msg = std::make_unique<hd_message>();
  EXPECT_EQ(hd_fidl_registry_report_arm_failure(fd, msg.get(), &req, nullptr, 0, &resp), HD_OK);
  close(fd);
  return resp.has_error ? static_cast<int>(resp.error) : 0;
}

// A process reports only its own failure to arm, whole; what it says reaches a client's
// terminal with its control characters (an escape sequence here) replaced.
TEST_F(HostileTest, OnlyAProcessItselfReportsThatItCouldNotArm) {
  collector.Start();
  Child child(collector.socket, ChildOptions{});
  EXPECT_EQ(ReportArmFailure(collector.socket, static_cast<uint64_t>(child.pid), 4, "its table"),
            heapdump_process_RegistryError_NOT_ALLOWED);
  EXPECT_FALSE(GetProcessState(collector.socket, child.pid).has_arm_failure);
  EXPECT_EQ(ReportArmFailure(collector.socket, static_cast<uint64_t>(getpid()), 4, nullptr),
            heapdump_process_RegistryError_MISSING_FIELD);
  EXPECT_FALSE(GetProcessState(collector.socket, getpid()).has_arm_failure);
  EXPECT_EQ(ReportArmFailure(collector.socket, static_cast<uint64_t>(getpid()), 6,
                             "its \x1b]0;owned\x07table"),
            0);
  const ProcessStatus st = GetProcessState(collector.socket, getpid());
  EXPECT_TRUE(st.has_arm_failure);
  EXPECT_EQ(st.arm_failure_generation, 6u);
  EXPECT_EQ(st.arm_failure, "making its ?]0;owned?table: " + std::string(strerror(ENOMEM)));
  EXPECT_NE(collector.Log().find("could not arm (it stays dormant)"), std::string::npos)
      << collector.Log();
  child.Finish();
}

// The named-snapshot worker reads a process's copy without waiting for any lock, so the copy
// must be one that cannot change: sealed against writing, marked a snapshot copy, of the
// process that sends it. A forged one used to be read (and waited on) like a live table.
TEST_F(HostileTest, NamedSnapshotTablesMustBeSealedCopiesOfTheirSender) {
  collector.Start();
  ChildOptions small;
  small.env = {"HEAPDUMP_MAX_MEMORY=8M"};
  Child child(collector.socket, small);
  int sink = TakeSink(child.pid);
  ASSERT_GE(sink, 0) << "cannot take the process's snapshot sink";
  struct timeval patience = {20, 0};
  setsockopt(sink, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience);
  const int frozen = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW;
  const uint32_t pid = static_cast<uint32_t>(child.pid);
  const int64_t invalid = -static_cast<int64_t>(heapdump_process_StoreError_INVALID_SNAPSHOT);
  EXPECT_EQ(Store(sink, "unsealed",
                  CopyTable(child.pid, HD_ALLOC_FLAG_SNAPSHOT, pid, F_SEAL_SHRINK | F_SEAL_GROW)),
            invalid);
  EXPECT_EQ(Store(sink, "live", CopyTable(child.pid, 0, pid, frozen)), invalid);
  EXPECT_EQ(Store(sink, "others", CopyTable(child.pid, HD_ALLOC_FLAG_SNAPSHOT, pid + 1, frozen)),
            invalid);
  const std::string log = collector.Log();
  EXPECT_NE(log.find("not sealed against writing"), std::string::npos) << log;
  EXPECT_NE(log.find("a live table, not a snapshot copy"), std::string::npos) << log;
  EXPECT_NE(log.find("another process's table"), std::string::npos) << log;
  // Made as the library makes it, the same copy is stored, with the process's blocks.
  const int64_t id =
      Store(sink, "proper", CopyTable(child.pid, HD_ALLOC_FLAG_SNAPSHOT, pid, frozen));
  ASSERT_GT(id, 0);
  auto proper = Download(collector.socket, static_cast<uint32_t>(id));
  ASSERT_EQ(proper->status, HD_OK) << proper->ra.error;
  EXPECT_EQ(Blocks(proper->only(), 100, "alpha_leaks").in_function, 10u);
  EXPECT_EQ(CountStored(collector.socket, "unsealed") + CountStored(collector.socket, "live") +
                CountStored(collector.socket, "others"),
            0u);
  close(sink);
  child.Kill();
}

// A process has one named snapshot stored at a time: what it pipelines on its sink while one is
// being stored is refused at once (BUSY), so that its flood cannot delay other processes' stores
// behind its own. Another process stores meanwhile.
TEST_F(HostileTest, AProcessStoresOneNamedSnapshotAtATime) {
  collector.Start();
  Workload flooder(collector.socket, {"many", "300000"}, false, {"HEAPDUMP_MAX_MEMORY=64M"});
  Child healthy(collector.socket, nullptr);
  int sink = TakeSink(flooder.pid);
  ASSERT_GE(sink, 0);
  struct timeval patience = {30, 0};
  setsockopt(sink, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience);
  const int copy =
      CopyTable(flooder.pid, HD_ALLOC_FLAG_SNAPSHOT, static_cast<uint32_t>(flooder.pid),
                F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW);
  ASSERT_GE(copy, 0);
  enum { kRequests = 10 };
  auto msg = std::make_unique<hd_message>();
  for (int i = 0; i < kRequests; i++) {
    heapdump_process_SnapshotSinkStoreNamedSnapshotRequest req =
        heapdump_process_SnapshotSinkStoreNamedSnapshotRequest_init_zero;
    req.has_name = req.has_allocations_snapshot = true;
    snprintf(req.name, sizeof req.name, "flood-%d", i);
    req.allocations_snapshot = {true, 0};
    ASSERT_EQ(
        hd_message_encode(msg.get(), static_cast<uint32_t>(i + 1), 0,
                          HD_ORDINAL_SNAPSHOT_SINK_STORE_NAMED_SNAPSHOT,
                          &heapdump_process_SnapshotSinkStoreNamedSnapshotRequest_msg, &req, 1),
        HD_OK);
    ASSERT_EQ(hd_message_send(sink, msg.get(), &copy, 1), HD_OK);
  }
  close(copy);
  EXPECT_EQ(healthy.Snapshot("meanwhile"), 0);
  int stored = 0, busy = 0;
  for (int i = 0; i < kRequests; i++) {
    ASSERT_EQ(hd_message_recv(sink, msg.get()), HD_OK) << "answer " << i;
    heapdump_process_SnapshotSinkStoreNamedSnapshotResponse resp =
        heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_init_zero;
    ASSERT_EQ(hd_message_decode_body(
                  msg.get(), &heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_msg, &resp),
              HD_OK);
    stored += !resp.has_error;
    busy += resp.has_error && resp.error == heapdump_process_StoreError_BUSY;
  }
  EXPECT_GE(stored, 1);
  EXPECT_GE(busy, 1) << collector.Log();
  EXPECT_EQ(stored + busy, kRequests);
  EXPECT_EQ(CountStored(collector.socket, "meanwhile"), 1u);
  close(sink);
  flooder.program->Kill();
  healthy.Finish();
}

// A process killed while it held a slot lock (the OOM killer's case, when users need the exit
// snapshot most) leaves the lock held for good; its table cannot change any more and is read as
// it was left. Its exit snapshot used to fail: "table kept changing".
TEST_F(HostileTest, AProcessKilledInsideTheLibraryKeepsItsExitSnapshot) {
  collector.Start();
  Child victim(collector.socket, nullptr, /*exit_snapshot=*/true);
  const pid_t pid = victim.pid;
  {
    MappedTable table(pid);
    ASSERT_TRUE(table.ok());
    for (uint64_t slot = 0; slot < HD_SEQ_SLOTS; slot += 3) table.SetSlotLocked(slot, true);
  }
  victim.Kill();
  ProcessStatus exited = FinalState(collector.socket, pid);
  ASSERT_EQ(exited.state, heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_STORED)
      << collector.Log();
  auto snapshot = Download(collector.socket, exited.exit_snapshot_id);
  ASSERT_EQ(snapshot->status, HD_OK) << snapshot->ra.error;
  EXPECT_EQ(Blocks(snapshot->only(), 100, "alpha_leaks").in_function, 10u);
  EXPECT_EQ(Blocks(snapshot->only(), 200, "worker_leaks").in_function, 5u);
}

// The same, the way it happens: programs killed with SIGKILL while four threads allocate and
// free without pause. Every one gets its exit snapshot.
TEST_F(HostileTest, ProgramsKilledWhileAllocatingAllGetTheirExitSnapshots) {
  collector.Start();
  for (int round = 0; round < 6; round++) {
    Workload workload(collector.socket, {"churn", dir + "/kept"}, /*exit_snapshot=*/true);
    usleep(100000 + 50000 * round);
    workload.program->Kill();
    ProcessStatus exited = FinalState(collector.socket, workload.pid);
    EXPECT_EQ(exited.state, heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_STORED)
        << "round " << round << ":\n"
        << collector.Log();
  }
}

// A process that keeps its slot locks held fails its own snapshot once the read timeout is
// spent, and only its own: other processes' live and named snapshots go on meanwhile. (Its
// nodes use two slots or more, each held 0.8 s: a reader needs more than the 1 s timeout.)
TEST_F(HostileTest, HeldLocksCostOnlyTheirOwnSnapshotAndOnlyTheReadTimeout) {
  collector.args = {"--read-timeout", "1"};
  collector.Start();
  Child healthy(collector.socket, nullptr);
  Child victim(collector.socket, nullptr);
  MappedTable table(victim.pid);
  ASSERT_TRUE(table.ok());
  std::unique_ptr<Result> held;
  {
    LockWalker walker(table);
    std::thread reader([&] {
      auto selector = ByPid(victim.pid);
      held = TakeLiveSnapshot(collector.socket, &selector);
    });
    auto selector = ByPid(healthy.pid);
    auto fine = TakeLiveSnapshot(collector.socket, &selector);
    EXPECT_EQ(fine->status, HD_OK) << fine->ra.error;
    EXPECT_EQ(Blocks(fine->only(), 100, "alpha_leaks").in_function, 10u);
    EXPECT_EQ(healthy.Snapshot("meanwhile"), 0);
    reader.join();
  }
  EXPECT_EQ(held->error, Error(heapdump_client_CollectorError_LIVE_SNAPSHOT_FAILED));
  EXPECT_NE(collector.Log().find("stayed locked past the read time limit"), std::string::npos)
      << collector.Log();
  EXPECT_EQ(CountStored(collector.socket, "meanwhile"), 1u);
  victim.Kill();
  healthy.Finish();
}

// A thread stopped inside a change of its share of a trace's counts (its entry's seq odd, as the
// writer leaves it mid-change) costs a snapshot one second of patience, not the snapshot: the
// trace's counts come marked unsettled, the log says so, and the next snapshot after the thread
// finished its change is settled again.
TEST_F(HostileTest, AThreadStoppedInsideACountsChangeCostsOneSecondAndIsSaidSo) {
  collector.Start();
  Child child(collector.socket, nullptr);
  const int fd = OpenTable(child.pid, HD_MEMFD_RESOURCES);
  ASSERT_GE(fd, 0);
  struct stat st;
  ASSERT_EQ(fstat(fd, &st), 0);
  const size_t size = static_cast<size_t>(st.st_size);
  void *map = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(map, MAP_FAILED);
  char *base = static_cast<char *>(map);
  const auto *header = reinterpret_cast<const hd_res_header *>(base);
  hd_pending_trace *held = nullptr;
  for (uint32_t at = __atomic_load_n(&header->counters_head, __ATOMIC_ACQUIRE);
       at != 0 && held == nullptr;) {
    auto *record = reinterpret_cast<hd_rec_counters *>(base + at);
    for (hd_pending_trace &e : record->pending) {
      if (held == nullptr && e.stack_key != 0 && e.alloc_blocks > 0) held = &e;
    }
    at = record->next;
  }
  ASSERT_NE(held, nullptr) << "no thread holds counts of a trace of its own";
  const uint32_t key = held->stack_key;
  // A live snapshot of the child, kept in *result; the held trace's counts in it, or null.
  auto counts_now = [&](std::unique_ptr<Result> *result) -> const hd_snapshot_stack_trace * {
    auto selector = ByPid(child.pid);
    *result = TakeLiveSnapshot(collector.socket, &selector);
    EXPECT_EQ((*result)->status, HD_OK) << (*result)->ra.error;
    const hd_snapshot *s = (*result)->only();
    for (size_t i = 0; s != nullptr && i < s->stack_trace_count; i++) {
      if (s->stack_traces[i].key == key && s->stack_traces[i].has_counters)
        return &s->stack_traces[i];
    }
    return nullptr;
  };
  std::unique_ptr<Result> settled, waited, after;
  const hd_snapshot_stack_trace *before = counts_now(&settled);
  ASSERT_NE(before, nullptr);
  EXPECT_FALSE(before->counts_unsettled);
  EXPECT_GE(before->allocated_blocks, held->alloc_blocks);

  __atomic_fetch_add(&held->seq, 1, __ATOMIC_SEQ_CST);  // the thread stops mid-change
  const auto start = std::chrono::steady_clock::now();
  const hd_snapshot_stack_trace *during = counts_now(&waited);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_NE(during, nullptr);
  EXPECT_TRUE(during->counts_unsettled);
  EXPECT_GE(seconds, 0.9);
  EXPECT_NE(collector.Log().find("sent marked unsettled"), std::string::npos) << collector.Log();
  const std::vector<std::string> env = {"HEAPDUMP_SOCKET=" + collector.socket, "PATH=/usr/bin:/bin",
                                        "HOME=" + dir};
  const std::string cli = HD_CLI;
  const std::string pid = std::to_string(child.pid);
  ShellOutput stored =
      RunShell(cli + " snapshot --pid " + pid + " -o unsettled.heapdump", dir, env);
  EXPECT_EQ(stored.status, 0) << stored.out;

  __atomic_fetch_add(&held->seq, 1, __ATOMIC_SEQ_CST);  // and finishes it
  const hd_snapshot_stack_trace *settled_again = counts_now(&after);
  ASSERT_NE(settled_again, nullptr);
  EXPECT_FALSE(settled_again->counts_unsettled);
  EXPECT_EQ(settled_again->allocated_blocks, before->allocated_blocks);
  const std::string warning = "warning: the allocation counts of 1 stack trace(s) were read while";
  ShellOutput report = RunShell(cli + " report unsettled.heapdump", dir, env);
  EXPECT_EQ(report.status, 0) << report.out;
  EXPECT_NE(report.out.find(warning), std::string::npos) << report.out;
  report = RunShell(cli + " report unsettled.heapdump --json", dir, env);
  EXPECT_NE(report.out.find("\"unsettled_traces\":1,"), std::string::npos) << report.out;
  ASSERT_EQ(RunShell(cli + " snapshot --pid " + pid + " -o settled.heapdump", dir, env).status, 0);
  report = RunShell(cli + " report settled.heapdump", dir, env);
  EXPECT_EQ(report.out.find("warning: the allocation counts"), std::string::npos) << report.out;
  munmap(map, size);
  child.Finish();
}

// A multi-process snapshot with one process that keeps its locks held carries the others whole,
// and that one as a header saying why it could not be read: the stream is not failed for all.
TEST_F(HostileTest, AProcessThatCannotBeReadLeavesTheOthersInAMultiProcessSnapshot) {
  collector.args = {"--read-timeout", "1"};
  collector.Start();
  Child healthy(collector.socket, nullptr);
  Child victim(collector.socket, nullptr);
  MappedTable table(victim.pid);
  ASSERT_TRUE(table.ok());
  std::unique_ptr<Result> all;
  {
    LockWalker walker(table);
    all = TakeLiveSnapshot(collector.socket, nullptr, false, /*multi=*/true);
  }
  ASSERT_EQ(all->status, HD_OK) << all->ra.error;
  EXPECT_EQ(all->error, 0u);
  size_t read = 0, unread = 0;
  for (size_t i = 0; i < all->ra.snapshot_count; i++) {
    const hd_snapshot *s = all->ra.snapshots[i];
    if (s->pid == static_cast<uint64_t>(victim.pid)) {
      unread++;
      EXPECT_NE(std::string(s->not_read).find("could not be read"), std::string::npos)
          << s->not_read;
      EXPECT_EQ(s->allocation_count, 0u);
    } else if (s->pid == static_cast<uint64_t>(healthy.pid)) {
      read++;
      EXPECT_STREQ(s->not_read, "");
      EXPECT_EQ(Blocks(s, 100, "alpha_leaks").in_function, 10u);
    }
  }
  EXPECT_EQ(read, 1u);
  EXPECT_EQ(unread, 1u);
  victim.Kill();
  healthy.Finish();
}

// The heapdump command, run as the docs show, when one of the processes asked for cannot be read:
// `snapshot --all` and `leaks --all` write the others, name that one on stderr with why, and exit
// with status 8 (docs/tools.md).
TEST_F(HostileTest, TheCommandWritesWhatItReadAndExitsWithStatusEight) {
  collector.args = {"--read-timeout", "1"};
  collector.Start();
  Child healthy(collector.socket, nullptr);
  Child victim(collector.socket, nullptr);
  MappedTable table(victim.pid);
  ASSERT_TRUE(table.ok());
  const std::vector<std::string> env = {"HEAPDUMP_SOCKET=" + collector.socket, "PATH=/usr/bin:/bin",
                                        "HOME=" + dir};
  const std::string cli = HD_CLI;
  const std::string unread = "could not read snapshot_child[" + std::to_string(victim.pid) + "]";
  const std::string reported = "[" + std::to_string(healthy.pid) + "]";
  ShellOutput snapshot, leaks, report;
  table.SetSlotLocked(0, true);  // as a writer stopped in the middle of a change would
  snapshot = RunShell(cli + " snapshot --all -o all.pb.gz", dir, env);
  leaks = RunShell(cli + " leaks --all -o leaks.txt", dir, env);
  table.SetSlotLocked(0, false);
  EXPECT_EQ(snapshot.status, 8) << snapshot.out;
  EXPECT_NE(snapshot.out.find(unread), std::string::npos) << snapshot.out;
  EXPECT_NE(snapshot.out.find("1 of 2 processes could not be read"), std::string::npos)
      << snapshot.out;
  report = RunShell(cli + " report all.pb.gz", dir, env);
  EXPECT_EQ(report.status, 0) << report.out;
  EXPECT_NE(report.out.find(reported), std::string::npos) << report.out;
  EXPECT_NE(report.out.find("alpha_leaks"), std::string::npos) << report.out;
  EXPECT_EQ(report.out.find("[" + std::to_string(victim.pid) + "]"), std::string::npos)
      << report.out;
  EXPECT_EQ(leaks.status, 8) << leaks.out;
  EXPECT_NE(leaks.out.find(unread), std::string::npos) << leaks.out;
  const std::string written = ReadFile(dir + "/leaks.txt");
  EXPECT_NE(written.find(reported), std::string::npos) << written;
  EXPECT_EQ(written.find("[" + std::to_string(victim.pid) + "]"), std::string::npos) << written;
  victim.Kill();
  healthy.Finish();
}

// SIGTERM stops a collector whose reader a process keeps waiting, long before the read timeout.
TEST_F(HostileTest, StoppingDoesNotWaitForAProcessThatHoldsItsLocks) {
  collector.args = {"--read-timeout", "600"};
  collector.Start();
  Child victim(collector.socket, nullptr);
  MappedTable table(victim.pid);
  ASSERT_TRUE(table.ok());
  LockWalker walker(table);
  std::thread reader([&] {
    auto selector = ByPid(victim.pid);
    (void)TakeLiveSnapshot(collector.socket, &selector);
  });
  sleep(1);
  ASSERT_EQ(kill(collector.pid, SIGTERM), 0);
  int status = 0;
  bool stopped =
      WaitUntil([&] { return waitpid(collector.pid, &status, WNOHANG) == collector.pid; }, 30);
  if (!stopped) {
    kill(collector.pid, SIGKILL);
    waitpid(collector.pid, &status, 0);
  }
  collector.pid = -1;
  reader.join();
  EXPECT_TRUE(stopped) << collector.Log();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  victim.Kill();
}

// A client that takes a snapshot and never acknowledges its batches holds up nobody: another
// snapshot of the same process is served while the first still waits for its client.
TEST_F(HostileTest, AClientThatNeverAcknowledgesHoldsUpNoOtherReader) {
  collector.Start();
  Workload workload(collector.socket, {"many", "200000"});
  Call silent(collector.socket);
  auto selector = ByPid(workload.pid);
  ASSERT_EQ(RequestLiveSnapshot(silent, &selector), HD_OK);
  struct pollfd batches = {silent.ends[0], POLLIN, 0};
  ASSERT_EQ(poll(&batches, 1, 20000), 1) << "no batch for the silent client";
  auto served = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(served->status, HD_OK) << served->ra.error;
  EXPECT_GE(Blocks(served->only(), 32, "").blocks, 200000u);
  // The silent client's stream is still open, waiting for it: the second reader did not wait
  // for that stream to time out.
  struct pollfd hangup = {silent.ends[0], POLLRDHUP, 0};
  EXPECT_EQ(poll(&hangup, 1, 0), 0) << "the silent client was cut off before the second snapshot";
  workload.program->Kill();
}

// A field of /proc/PID/status, e.g. "Threads".
size_t StatusField(pid_t pid, const std::string &field) {
  const std::string status = ReadFile("/proc/" + std::to_string(pid) + "/status");
  const size_t at = status.find("\n" + field + ":");
  return at == std::string::npos ? 0 : strtoul(status.c_str() + at + field.size() + 2, nullptr, 10);
}

// The thread count once it has stopped changing (stream threads end just after their client has
// its answer).
size_t SettledThreadCount(pid_t pid) {
  return hdtest::Settled([pid] { return StatusField(pid, "Threads"); });
}

// User and system CPU time the process has used, in seconds.
double CpuSeconds(pid_t pid) {
  const std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  const size_t after_name = stat.rfind(')');
  unsigned long utime = 0, stime = 0;
  if (after_name == std::string::npos ||
      sscanf(stat.c_str() + after_name + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu",
             &utime, &stime) != 2) {
    return -1;
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Snapshot requests whose clients never read (each stream then waits for its client's answer)
// run on at most 32 stream threads, the rest waiting their turn; once the clients are gone the
// collector is back to its threads and descriptors. It used to start a thread per request.
// Five clients flood: one client alone gets only its share (8 threads).
TEST_F(HostileTest, AFloodOfSnapshotRequestsRunsOnBoundedThreads) {
  collector.Start();
  Child child(collector.socket, nullptr);
  const size_t threads_before = SettledThreadCount(collector.pid);
  const size_t fds_before = collector.SettledFdCount();
  auto selector = ByPid(child.pid);
  std::vector<int> receivers;
  for (int client = 0; client < 5; client++) {
    for (int i = 0; i < 60; i++) {
      Call call(collector.socket, kAnotherClient);
      ASSERT_EQ(RequestLiveSnapshot(call, &selector), HD_OK);
      receivers.push_back(dup(call.ends[0]));
    }
  }
  size_t most = 0;
  (void)WaitUntil(
      [&] {
        most = std::max(most, StatusField(collector.pid, "Threads"));
        return false;
      },
      3);
  EXPECT_GE(most, threads_before + 32) << "the flood did not take every stream thread";
  EXPECT_LE(most, threads_before + 32);
  for (int fd : receivers) close(fd);
  EXPECT_TRUE(
      WaitUntil([&] { return StatusField(collector.pid, "Threads") == threads_before; }, 60));
  EXPECT_EQ(collector.SettledFdCount(), fds_before);
  auto served = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(served->status, HD_OK) << served->ra.error;
  EXPECT_EQ(Blocks(served->only(), 100, "alpha_leaks").in_function, 10u);
  child.Finish();
}

// The number in each of the collector's log lines that contain `before` then a number.
unsigned SumLogged(const std::string &log, const std::string &before) {
  unsigned sum = 0;
  for (size_t at = log.find(before); at != std::string::npos; at = log.find(before, at + 1)) {
    sum += static_cast<unsigned>(atoi(log.c_str() + at + before.size()));
  }
  return sum;
}

// One client's flood of requests it never reads takes its share of the stream threads, not all
// of them: another client's snapshot is served at once, while every stream of the flood still
// waits for its client (for 60 s). It used to wait behind the whole flood (300 requests, 32 at a
// time, 60 s each).
TEST_F(HostileTest, AFloodFromOneClientDoesNotDelayAnother) {
  collector.Start();
  Child child(collector.socket, nullptr);
  const size_t threads_before = SettledThreadCount(collector.pid);
  auto selector = ByPid(child.pid);
  std::vector<int> receivers;
  for (int i = 0; i < 300; i++) {
    Call call(collector.socket);
    ASSERT_EQ(RequestLiveSnapshot(call, &selector), HD_OK);
    receivers.push_back(dup(call.ends[0]));
  }
  EXPECT_TRUE(
      WaitUntil([&] { return StatusField(collector.pid, "Threads") == threads_before + 8; }, 10))
      << StatusField(collector.pid, "Threads") << " threads, " << threads_before << " before";
  Call other(collector.socket, kAnotherClient);
  ASSERT_EQ(RequestLiveSnapshot(other, &selector), HD_OK);
  struct timeval patience = {20, 0};  // a third of the flood's first wait
  ASSERT_EQ(setsockopt(other.ends[0], SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience), 0);
  Result served;
  ASSERT_EQ(hd_snapshot_receive(other.ends[0], false, &served.ra, &served.error), HD_OK);
  ASSERT_EQ(served.error, 0u);
  ASSERT_EQ(hd_reassembler_finish(&served.ra), HD_OK);
  EXPECT_EQ(Blocks(served.only(), 100, "alpha_leaks").in_function, 10u);
  // (The other client's stream thread may not have ended yet.)
  EXPECT_GE(StatusField(collector.pid, "Threads"), threads_before + 8)
      << "the flood's streams are no longer waiting: the test proves nothing";
  for (int fd : receivers) close(fd);
  EXPECT_TRUE(
      WaitUntil([&] { return StatusField(collector.pid, "Threads") == threads_before; }, 60));
  child.Finish();
}

// Requests from one client, on one connection: each with a receiver of its own, which the test
// keeps (never reading it).
std::vector<int> RequestMany(Call *call, const heapdump_client_ProcessSelector *selector,
                             int count) {
  std::vector<int> receivers;
  for (int i = 0; i < count; i++) {
    if (call->ends[0] < 0) {
      EXPECT_EQ(hd_channel_pair(call->ends), HD_OK);
    }
    EXPECT_EQ(RequestLiveSnapshot(*call, selector), HD_OK);
    receivers.push_back(call->ends[0]);
    call->ends[0] = -1;
  }
  return receivers;
}

// When threads come free, a client with nothing running goes before another client's backlog,
// older as it may be: four clients hold every thread (8 streams each, never read); a fifth
// queues 20 requests, then a sixth one; one of the four goes away, and of the 8 threads that
// frees, the sixth client gets one at once rather than after the fifth's 20.
TEST_F(HostileTest, AClientWithNothingRunningGoesBeforeAnothersBacklog) {
  collector.Start();
  Child child(collector.socket, nullptr);
  const size_t threads_before = SettledThreadCount(collector.pid);
  auto selector = ByPid(child.pid);
  std::vector<std::unique_ptr<Call>> holders;
  std::vector<std::vector<int>> held;
  for (int i = 0; i < 4; i++) {
    holders.push_back(std::make_unique<Call>(collector.socket, kAnotherClient));
    held.push_back(RequestMany(holders.back().get(), &selector, 8));
  }
  ASSERT_TRUE(
      WaitUntil([&] { return StatusField(collector.pid, "Threads") == threads_before + 32; }, 10));
  // Each request read before the next client's (the collector holds its connection and each
  // request's receiver), so that the queue holds the backlog first. Counted once the streams
  // have settled: a snapshot being made holds files of /proc open for a moment.
  const size_t fds_held = collector.SettledFdCount();
  Call backlog(collector.socket, kAnotherClient);
  const std::vector<int> queued = RequestMany(&backlog, &selector, 20);
  ASSERT_TRUE(WaitUntil([&] { return collector.Fds().size() == fds_held + 21; }, 10));
  Call other(collector.socket, kAnotherClient);
  ASSERT_EQ(RequestLiveSnapshot(other, &selector), HD_OK);
  ASSERT_TRUE(WaitUntil([&] { return collector.Fds().size() == fds_held + 23; }, 10));
  for (int fd : held[0]) close(fd);
  struct timeval patience = {20, 0};  // a third of the held streams' wait
  ASSERT_EQ(setsockopt(other.ends[0], SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience), 0);
  Result served;
  ASSERT_EQ(hd_snapshot_receive(other.ends[0], false, &served.ra, &served.error), HD_OK);
  ASSERT_EQ(served.error, 0u);
  ASSERT_EQ(hd_reassembler_finish(&served.ra), HD_OK);
  EXPECT_EQ(Blocks(served.only(), 100, "alpha_leaks").in_function, 10u);
  for (size_t i = 1; i < held.size(); i++) {
    for (int fd : held[i]) close(fd);
  }
  for (int fd : queued) close(fd);
  EXPECT_TRUE(
      WaitUntil([&] { return StatusField(collector.pid, "Threads") == threads_before; }, 60));
  child.Finish();
}

// A full queue (1,024 waiting requests) makes room for a new client's request by refusing the
// newest request of the client that queued the most: one client's flood cannot lock others out.
TEST_F(HostileTest, AFullQueueRefusesTheGreediestClientNotANewOne) {
  struct rlimit files;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &files), 0);
  if (files.rlim_max < 4096) GTEST_SKIP() << "needs 4096 descriptors";
  const struct rlimit before = files;
  files.rlim_cur = files.rlim_max;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &files), 0);
  collector.Start();
  Child child(collector.socket, nullptr);
  const size_t fds_before = collector.SettledFdCount();
  auto selector = ByPid(child.pid);
  std::vector<int> receivers;
  for (int i = 0; i < 8 + 1024 + 16; i++) {  // its share running, a full queue, 16 refused
    Call call(collector.socket);
    ASSERT_EQ(RequestLiveSnapshot(call, &selector), HD_OK);
    receivers.push_back(dup(call.ends[0]));
  }
  // Every request read: the collector holds the receivers of those it took.
  ASSERT_TRUE(WaitUntil([&] { return collector.Fds().size() == fds_before + 8 + 1024; }, 20))
      << collector.Fds().size() << " descriptors, " << fds_before << " before";
  Call other(collector.socket, kAnotherClient);
  ASSERT_EQ(RequestLiveSnapshot(other, &selector), HD_OK);
  struct timeval patience = {20, 0};
  ASSERT_EQ(setsockopt(other.ends[0], SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience), 0);
  Result served;
  ASSERT_EQ(hd_snapshot_receive(other.ends[0], false, &served.ra, &served.error), HD_OK);
  ASSERT_EQ(served.error, 0u);
  EXPECT_NE(collector.Log().find("too many snapshot requests at once; dropping one of pid " +
                                 std::to_string(getpid())),
            std::string::npos)
      << collector.Log().substr(0, 4096);
  for (int fd : receivers) close(fd);
  child.Finish();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &before), 0);
}

// Requests whose client has gone (here: it hung up every receiver while its requests waited for
// a stream thread) are dropped without reading any table: 3,000 requests from dead clients used
// to delay another client by 33 s while each was read and sent to nobody.
TEST_F(HostileTest, RequestsOfAClientThatHasGoneAreDroppedUnserved) {
  collector.Start();
  Child child(collector.socket, nullptr);
  const size_t threads_before = SettledThreadCount(collector.pid);
  const size_t fds_before = collector.SettledFdCount();
  auto selector = ByPid(child.pid);
  auto request = [&](size_t count) {
    std::vector<int> receivers;
    for (size_t i = 0; i < count; i++) {
      Call call(collector.socket);
      EXPECT_EQ(RequestLiveSnapshot(call, &selector), HD_OK);
      receivers.push_back(dup(call.ends[0]));
    }
    return receivers;
  };
  // Its share of the threads, each stream waiting for the client's answer; then requests that
  // wait for a thread.
  const std::vector<int> running = request(8);
  ASSERT_TRUE(
      WaitUntil([&] { return StatusField(collector.pid, "Threads") == threads_before + 8; }, 10));
  const std::vector<int> queued = request(192);
  // Every request read: the collector holds each one's receiver.
  ASSERT_TRUE(WaitUntil([&] { return collector.Fds().size() == fds_before + 200; }, 10));
  // The client goes: the queued requests' receivers first, so that none is open when a
  // running stream ends and its thread looks for the next.
  for (int fd : queued) close(fd);
  for (int fd : running) close(fd);
  const std::string kDropped = "dropped ";
  EXPECT_TRUE(WaitUntil([&] { return SumLogged(collector.Log(), kDropped) == 192; }, 30))
      << collector.Log();
  EXPECT_TRUE(
      WaitUntil([&] { return StatusField(collector.pid, "Threads") == threads_before; }, 60));
  EXPECT_EQ(collector.SettledFdCount(), fds_before);
  auto served = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(served->status, HD_OK) << served->ra.error;
  child.Finish();
}

// Idle clients holding every descriptor the collector may open do not lock others out until
// the idle timeout (60 s): out of descriptors, the collector closes the client connection idle
// the longest and serves the new one.
TEST_F(HostileTest, IdleClientsHoldingEveryDescriptorLockNobodyOut) {
  collector.Start();
  struct rlimit normal;
  ASSERT_EQ(prlimit(collector.pid, RLIMIT_NOFILE, nullptr, &normal), 0);
  struct rlimit tight = {collector.SettledFdCount() + 16, normal.rlim_max};
  ASSERT_EQ(prlimit(collector.pid, RLIMIT_NOFILE, &tight, nullptr), 0);
  std::vector<int> idle;
  for (int i = 0; i < 40; i++) {
    int fd = -1;
    ASSERT_EQ(hd_channel_connect(collector.socket.c_str(), &fd), HD_OK);
    idle.push_back(fd);
  }
  usleep(300000);  // idle for longer than the 100 ms a connection gets to say what it is
  for (int i = 0; i < 5; i++) {
    Listing listing = List(collector.socket);
    EXPECT_EQ(listing.status, HD_OK);
    EXPECT_EQ(listing.error, 0u);
  }
  EXPECT_NE(collector.Log().find("out of descriptors: closing a connection"), std::string::npos)
      << collector.Log();
  ASSERT_EQ(prlimit(collector.pid, RLIMIT_NOFILE, &normal, nullptr), 0);
  for (int fd : idle) close(fd);
}

// Out of descriptors, the collector neither spins on the connection it cannot accept nor floods
// its log: it pauses accepting, and takes the waiting clients once descriptors are back. It used
// to spin at full CPU, writing 210 MB of log in 5 s.
TEST_F(HostileTest, RunningOutOfDescriptorsNeitherSpinsNorFloodsTheLog) {
  collector.Start();
  struct rlimit normal;
  ASSERT_EQ(prlimit(collector.pid, RLIMIT_NOFILE, nullptr, &normal), 0);
  struct rlimit tight = {collector.SettledFdCount(), normal.rlim_max};
  ASSERT_EQ(prlimit(collector.pid, RLIMIT_NOFILE, &tight, nullptr), 0);
  std::vector<int> waiting;
  for (int i = 0; i < 20; i++) {
    int fd = -1;
    ASSERT_EQ(hd_channel_connect(collector.socket.c_str(), &fd), HD_OK);
    waiting.push_back(fd);
  }
  const double cpu_before = CpuSeconds(collector.pid);
  const size_t log_before = collector.Log().size();
  sleep(3);
  EXPECT_LT(CpuSeconds(collector.pid) - cpu_before, 0.5) << "the collector spun on accept";
  EXPECT_LT(collector.Log().size() - log_before, 4096u) << collector.Log().substr(log_before, 4096);
  EXPECT_NE(collector.Log().find(std::string("accept failed: ") + strerror(EMFILE)),
            std::string::npos)
      << collector.Log();
  ASSERT_EQ(prlimit(collector.pid, RLIMIT_NOFILE, &normal, nullptr), 0);
  Listing listing = List(collector.socket);
  EXPECT_EQ(listing.status, HD_OK);
  EXPECT_EQ(listing.error, 0u);
  for (int fd : waiting) close(fd);
}

// A table that claims its blocks are far bigger than they are (here every block claims 64 KiB, so
// the claims overlap) would make a snapshot with contents carry many times the process's memory;
// the collector's total (--max-contents-bytes) bounds what one process's snapshot carries.
TEST_F(HostileTest, ContentsAreBoundedWhateverTheTableClaims) {
  collector.args = {"--max-contents-bytes", "200000"};
  collector.Start();
  Child victim(collector.socket, nullptr);
  {
    MappedTable table(victim.pid);
    ASSERT_TRUE(table.ok());
    for (uint32_t link = 1; link <= table.header->node_high_water; link++) {
      hd_alloc_node *node = table.Node(link);
      const uint64_t address_word = __atomic_load_n(&node->address_word, __ATOMIC_RELAXED);
      if (address_word == 0) continue;
      __atomic_store_n(&node->size_low, 64u << 10, __ATOMIC_RELAXED);
      __atomic_store_n(&node->address_word, hd_node_address(address_word), __ATOMIC_RELAXED);
    }
  }
  auto selector = ByPid(victim.pid);
  auto result = TakeLiveSnapshot(collector.socket, &selector, /*with_contents=*/true);
  ASSERT_EQ(result->status, HD_OK) << result->ra.error;
  ASSERT_NE(result->only(), nullptr);
  uint64_t carried = 0;
  for (size_t i = 0; i < result->only()->block_count; i++)
    carried += result->only()->blocks[i].size;
  EXPECT_LE(carried, 200000u);
  EXPECT_GT(carried, 0u) << "no claimed block could be read: the bound went untested";
  EXPECT_NE(collector.Log().find("cut at 200000 bytes"), std::string::npos) << collector.Log();
  victim.Kill();  // its allocator would believe the sizes
}

// Runs body in a thread, again and again, until stop.
class Loop {
 public:
  Loop(std::atomic<bool> &stop, std::function<void()> body)
      : thread_([&stop, body = std::move(body)] {
          while (!stop) body();
        }) {}
  ~Loop() { thread_.join(); }

 private:
  std::thread thread_;
};

// HEAPDUMP_SOAK_SECONDS of everything above at once (60 unless set): a process holding its locks,
// one with a cycle in its table, programs killed while they allocate, garbage, datagram channel
// ends, silent and vanishing clients and request floods, beside a program that is snapshotted,
// stores named snapshots and is listed all along. Every normal request succeeds throughout, and
// afterwards the collector is back to the threads and descriptors it had, its memory near it.
TEST_F(HostileTest, SoakOfHostileAndNormalLoadLeavesNoTrace) {
  const char *seconds_env = getenv("HEAPDUMP_SOAK_SECONDS");
  const int seconds = seconds_env != nullptr ? atoi(seconds_env) : 60;
  collector.args = {"--read-timeout", "2"};
  collector.Start();
  Child healthy(collector.socket, nullptr);
  auto healthy_selector = ByPid(healthy.pid);
  // Warm up: the first snapshots and listings size the collector's allocator arenas.
  for (int i = 0; i < 5; i++) {
    ASSERT_EQ(TakeLiveSnapshot(collector.socket, &healthy_selector)->error, 0u);
    ASSERT_EQ(List(collector.socket).status, HD_OK);
  }
  const size_t threads_before = SettledThreadCount(collector.pid);
  const size_t fds_before = collector.SettledFdCount();
  const size_t rss_before_kb = StatusField(collector.pid, "VmRSS");

  Child locker(collector.socket, nullptr);
  Child cyclic(collector.socket, nullptr);
  auto locker_table = std::make_unique<MappedTable>(locker.pid);
  auto cyclic_table = std::make_unique<MappedTable>(cyclic.pid);
  ASSERT_TRUE(locker_table->ok() && cyclic_table->ok());
  // Every live node of this one claims the first one's address, as no honest writer leaves it.
  uint64_t one_address = 0;
  for (uint32_t link = 1; link <= cyclic_table->header->node_high_water; link++) {
    hd_alloc_node *node = cyclic_table->Node(link);
    const uint64_t address_word = __atomic_load_n(&node->address_word, __ATOMIC_RELAXED);
    if (address_word == 0) continue;
    if (one_address == 0) one_address = address_word;
    __atomic_store_n(&node->address_word, one_address, __ATOMIC_RELAXED);
  }
  std::atomic<bool> stop{false};
  std::atomic<size_t> normal_failures{0}, normal_requests{0};
  {
    LockWalker walker(*locker_table);
    const std::string socket = collector.socket;
    Loop normal_snapshots(stop, [&] {
      auto r = TakeLiveSnapshot(socket, &healthy_selector);
      normal_requests++;
      if (r->status != HD_OK || r->error != 0 ||
          Blocks(r->only(), 100, "alpha_leaks").in_function != 10) {
        normal_failures++;
      }
    });
    Loop normal_listings(stop, [&] {
      normal_requests++;
      if (List(socket).status != HD_OK) normal_failures++;
      usleep(50000);
    });
    Loop hostile_tables(stop, [&] {
      auto locked = ByPid(locker.pid), looped = ByPid(cyclic.pid);
      (void)TakeLiveSnapshot(socket, &locked);
      (void)TakeLiveSnapshot(socket, &looped, /*with_contents=*/true);
    });
    Loop killed_programs(stop, [&] {
      Workload workload(socket, {"churn", dir + "/kept"}, /*exit_snapshot=*/true);
      usleep(200000);
      workload.program->Kill();
    });
    Loop hostile_clients(stop, [&] {
      std::mt19937 rng(static_cast<unsigned>(normal_requests.load()));
      std::vector<int> held;
      for (int i = 0; i < 50; i++) {
        int fd = -1;
        if (hd_channel_connect(socket.c_str(), &fd) != HD_OK) continue;
        switch (rng() % 4) {
          case 0: {  // garbage
            std::vector<uint8_t> junk(1 + rng() % 200);
            for (uint8_t &b : junk) b = static_cast<uint8_t>(rng());
            (void)!send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
            break;
          }
          case 1: {  // a datagram socket as the receiver
            int ends[2];
            if (socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, ends) != 0) break;
            heapdump_client_CollectorTakeLiveSnapshotRequest req =
                heapdump_client_CollectorTakeLiveSnapshotRequest_init_zero;
            req.has_receiver = true;
            req.receiver = {true, 0};
            auto msg = std::make_unique<hd_message>();
            hd_status sent = hd_fidl_collector_take_live_snapshot(fd, msg.get(), &req, &ends[1], 1);
            (void)sent;  // the collector may have closed the connection already
            close(ends[0]);
            close(ends[1]);
            break;
          }
          case 2: {  // a request whose client never reads, held a while, or gone at once
            Call call(socket, kAnotherClient);
            if (RequestLiveSnapshot(call, &healthy_selector) == HD_OK && rng() % 2 == 0)
              held.push_back(dup(call.ends[0]));
            break;
          }
          default:  // says nothing
            held.push_back(dup(fd));
        }
        close(fd);
      }
      usleep(500000);
      for (int fd : held) close(fd);
    });
    sleep(static_cast<unsigned>(seconds));
    stop = true;
  }
  EXPECT_GT(normal_requests.load(), 0u);
  EXPECT_EQ(normal_failures.load(), 0u) << "of " << normal_requests.load() << " normal requests";
  locker_table.reset();
  cyclic_table.reset();
  locker.Kill();
  cyclic.Kill();
  EXPECT_TRUE(
      WaitUntil([&] { return StatusField(collector.pid, "Threads") == threads_before; }, 60))
      << StatusField(collector.pid, "Threads") << " threads, " << threads_before << " before";
  EXPECT_EQ(collector.SettledFdCount(), fds_before);
  const size_t rss_after_kb = StatusField(collector.pid, "VmRSS");
#ifndef HD_COLLECTOR_SANITIZED  // a sanitizer's quarantine keeps freed memory resident on purpose
  EXPECT_LT(rss_after_kb, rss_before_kb + 32 * 1024) << rss_before_kb << " KiB before";
#endif
  printf("soak: %zu normal requests in %d s; collector RSS %zu KiB before, %zu KiB after\n",
         normal_requests.load(), seconds, rss_before_kb, rss_after_kb);
  ASSERT_EQ(TakeLiveSnapshot(collector.socket, &healthy_selector)->error, 0u);
  healthy.Finish();
}

}  // namespace
}  // namespace hdtest
