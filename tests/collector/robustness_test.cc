// Hostile and broken peers: thousands of malformed messages, unexpected descriptors, calls out of
// order, half-open connections, clients that vanish mid-stream, a target killed mid-snapshot and
// a burst of connections. Afterwards the collector still serves a normal snapshot and holds no
// more descriptors than before (it leaks none; its memory is checked by LeakSanitizer in the
// sanitizer build, where it exits non-zero on a leak).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "harness.h"
#include "heapdump/contract/names.h"
#include "heapdump/contract/shm_layout.h"

extern "C" {
#include "heapdump_process.bindings.h"
}

namespace hdtest {
namespace {

using Bytes = std::vector<uint8_t>;

int Connect(const std::string &socket) {
  int fd = -1;
  EXPECT_EQ(hd_channel_connect(socket.c_str(), &fd), HD_OK);
  return fd;
}

// Sends a datagram with descriptors; the collector may already have closed the connection.
void SendRaw(int fd, const Bytes &bytes, const std::vector<int> &fds = {}) {
  struct iovec iov = {const_cast<uint8_t *>(bytes.data()), bytes.size()};
  struct msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * (fds.empty() ? 1 : fds.size())));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  (void)sendmsg(fd, &msg, MSG_NOSIGNAL);
}

// True once the peer closed fd (whatever it sent before is read and dropped).
bool ClosedByPeer(int fd) {
  for (int i = 0; i < 1000; i++) {
    struct pollfd pfd = {fd, POLLIN, 0};
    if (poll(&pfd, 1, 10000) <= 0) return false;
    char buf[65536];
    ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN)) return true;
  }
  return false;
}

Bytes Header(uint32_t txid, uint8_t flags0, uint8_t flags1, uint8_t magic, uint64_t ordinal) {
  Bytes h(16);
  memcpy(h.data(), &txid, 4);
  h[4] = flags0;
  h[5] = flags1;
  h[7] = magic;
  memcpy(h.data() + 8, &ordinal, 8);
  return h;
}

Bytes Random(std::mt19937 &rng, size_t size) {
  Bytes b(size);
  for (uint8_t &x : b) x = static_cast<uint8_t>(rng());
  return b;
}

Bytes Concat(Bytes a, const Bytes &b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The bytes of a well-formed message, as the bindings encode it.
template <typename T>
Bytes Encoded(uint64_t ordinal, const pb_msgdesc_t *desc, const T &body, size_t fd_count,
              uint32_t txid = 0) {
  auto msg = std::make_unique<hd_message>();
  hd_message_init(msg.get());
  EXPECT_EQ(hd_message_encode(msg.get(), txid, 0, ordinal, desc, &body, fd_count), HD_OK);
  return Bytes(msg->bytes, msg->bytes + msg->size);
}

Bytes TakeLiveSnapshotRequest(pid_t pid, bool with_contents = false) {
  heapdump_client_CollectorTakeLiveSnapshotRequest req =
      heapdump_client_CollectorTakeLiveSnapshotRequest_init_zero;
  if (pid > 0) {
    req.has_process_selector = true;
    req.process_selector = ByPid(pid);
  }
  req.has_receiver = true;
  req.receiver = {true, 0};
  req.has_with_contents = true;
  req.with_contents = with_contents;
  return Encoded(HD_ORDINAL_COLLECTOR_TAKE_LIVE_SNAPSHOT,
                 heapdump_client_CollectorTakeLiveSnapshotRequest_fields, req, 1);
}

Bytes RegisterRequest(pid_t pid) {
  heapdump_process_RegistryRegisterRequest req = heapdump_process_RegistryRegisterRequest_init_zero;
  req.has_protocol_version = req.has_layout_version = req.has_pid = req.has_process_name = true;
  req.protocol_version = heapdump_process_Version_PROTOCOL_VERSION;
  req.layout_version = HD_LAYOUT_VERSION;
  req.pid = static_cast<uint64_t>(pid);
  strcpy(req.process_name, "hostile");
  req.has_allocations_table = req.has_resources_table = req.has_snapshot_sink = true;
  req.allocations_table = {true, 0};
  req.resources_table = {true, 1};
  req.snapshot_sink = {true, 2};
  return Encoded(HD_ORDINAL_REGISTRY_REGISTER, heapdump_process_RegistryRegisterRequest_fields, req,
                 3, hd_next_txid());
}

// A memfd of 8 KiB holding `fill`, handed over read-only as tables must be: right kind of
// descriptor, wrong contents.
int GarbageMemfd(uint8_t fill, bool seal) {
  int fd = memfd_create(HD_MEMFD_ALLOCATIONS, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  Bytes page(8192, fill);
  EXPECT_EQ(write(fd, page.data(), page.size()), static_cast<ssize_t>(page.size()));
  if (seal) {
    EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  }
  int read_only = open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(read_only, 0);
  close(fd);
  return read_only;
}

class RobustnessTest : public ::testing::Test {
 protected:
  std::string dir = TempDir();
  RemoveWhenPassed cleanup{dir};
  Collector collector{dir};
  void SetUp() override { collector.Start(); }
};

TEST_F(RobustnessTest, HostilePeersLeaveTheCollectorServingAndLeakFree) {
  Child child(collector.socket, nullptr);
  ASSERT_EQ(TakeLiveSnapshot(collector.socket, nullptr)->status, HD_OK);
  const size_t baseline = collector.SettledFdCount();

  int file = open((dir + "/a-regular-file").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(file, 0);
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  const uint32_t seed = 20240917;
  std::mt19937 rng(seed);
  SCOPED_TRACE("seed " + std::to_string(seed));

  // Every message here is refused with the connection closed (checked for every tenth).
  const int kMessages = 3000;
  for (int i = 0; i < kMessages; i++) {
    int fd = Connect(collector.socket);
    ASSERT_GE(fd, 0);
    Bytes msg;
    std::vector<int> fds;
    switch (i % 16) {
      case 0: msg = Random(rng, rng() % 64); break;
      case 1: msg = Random(rng, 16 + rng() % 4000); break;
      case 2: msg = Random(rng, 1 + rng() % 15); break;  // shorter than a header
      case 3:                                            // no method has this ordinal
        msg = Concat(Header(0, 0, 0, 1, 0x10000 + rng() % 0xffffff), Random(rng, rng() % 100));
        break;
      case 4:
        msg = Concat(Header(0, 0, 0, static_cast<uint8_t>(2 + rng() % 250), 0x101), {});
        break;
      case 5: msg = Header(0, 0, static_cast<uint8_t>(1 + rng() % 255), 1, 0x101); break;
      case 6: msg = Header(0, 1, 0, 1, 0x101); break;  // a response where a request is due
      case 7:  // a known method with a body that does not decode
        msg = Concat(Header(0, 0, 0, 1, 0x101 + rng() % 3), Random(rng, 1 + rng() % 300));
        break;
      case 8:
        msg = Concat(Header(hd_next_txid(), 0, 0, 1, 0x401), Random(rng, 1 + rng() % 300));
        break;
      case 9: msg = Random(rng, HD_MAX_MESSAGE_BYTES + 1 + rng() % 100000); break;
      case 10: msg = TakeLiveSnapshotRequest(child.pid); break;  // its receiver is missing
      case 11:  // one descriptor more than the handles name
        msg = TakeLiveSnapshotRequest(child.pid);
        fds = {pair[0], file};
        break;
      case 12:  // descriptors of the wrong kinds as tables
        msg = RegisterRequest(getpid());
        fds = i % 32 == 12 ? std::vector<int>{file, file, pair[0]}
                           : std::vector<int>{pair[0], pair[1], file};
        break;
      case 13: {  // memfds, but not tables: garbage, unsealed, or someone else's pid
        int a = GarbageMemfd(static_cast<uint8_t>(rng()), i % 3 != 0);
        int b = GarbageMemfd(0, true);
        msg = RegisterRequest(i % 5 == 0 ? 1 : getpid());
        fds = {a, b, pair[1]};
        SendRaw(fd, msg, fds);
        close(a);
        close(b);
        msg.clear();
        break;
      }
      case 14:  // calls of the other protocols, on the collector's socket
        msg = Header(hd_next_txid(), 0, 0, 1, i % 3 == 0 ? 0x201 : i % 3 == 1 ? 0x301 : 0x501);
        break;
      case 15: {  // more descriptors than a message may carry
        msg = TakeLiveSnapshotRequest(child.pid);
        fds.assign(HD_MAX_MESSAGE_FDS + 1, file);
        break;
      }
    }
    if (!msg.empty() || i % 16 == 0) SendRaw(fd, msg, fds);
    if (i % 10 == 0) {
      EXPECT_TRUE(ClosedByPeer(fd)) << "message " << i << " kind " << i % 16;
    }
    close(fd);
  }

  // Out of order on one connection: a Register after a request, and receivers that are a
  // regular file or a stream socket.
  for (int i = 0; i < 50; i++) {
    int fd = Connect(collector.socket);
    int ends[2];
    ASSERT_EQ(hd_channel_pair(ends), HD_OK);
    SendRaw(fd, TakeLiveSnapshotRequest(1), {ends[1]});
    close(ends[1]);
    Result answer;
    EXPECT_EQ(hd_snapshot_receive(ends[0], false, &answer.ra, &answer.error), HD_OK);
    EXPECT_EQ(answer.error, Error(heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH));
    close(ends[0]);
    SendRaw(fd, RegisterRequest(getpid()), {file, file, file});
    EXPECT_TRUE(ClosedByPeer(fd));
    close(fd);
    fd = Connect(collector.socket);
    SendRaw(fd, TakeLiveSnapshotRequest(child.pid), {i % 2 ? file : pair[0]});
    SendRaw(fd, TakeLiveSnapshotRequest(child.pid), {pair[0]});
    close(fd);
  }
  close(pair[0]);
  close(pair[1]);
  close(file);

  // Misbehaving receivers and iterators: wrong answers, no answers, garbage.
  for (int i = 0; i < 40; i++) {
    int fd = Connect(collector.socket);
    int ends[2];
    ASSERT_EQ(hd_channel_pair(ends), HD_OK);
    if (i % 2 == 0) {
      SendRaw(fd, TakeLiveSnapshotRequest(child.pid, true), {ends[1]});
      char buf[65536];
      ssize_t n = recv(ends[0], buf, sizeof buf, 0);  // the first batch
      ASSERT_GT(n, 16);
      uint32_t txid;
      memcpy(&txid, buf, 4);
      // (txid + 1 may be the next batch's, already in flight: txid - 1 never was this channel's.)
      Bytes reply = i % 6 == 0   ? Header(txid - 1, 1, 0, 1, 0x201)  // another transaction's
                    : i % 6 == 2 ? Header(txid, 1, 0, 1, 0x202)      // another method's
                                 : Random(rng, 1 + rng() % 40);
      SendRaw(ends[0], reply);
    } else {
      heapdump_client_CollectorListStoredSnapshotsRequest req =
          heapdump_client_CollectorListStoredSnapshotsRequest_init_zero;
      req.has_iterator = true;
      req.iterator = {true, 0};
      SendRaw(fd,
              Encoded(HD_ORDINAL_COLLECTOR_LIST_STORED_SNAPSHOTS,
                      heapdump_client_CollectorListStoredSnapshotsRequest_fields, req, 1),
              {ends[1]});
      // GetNext as a one-way message, then garbage.
      SendRaw(ends[0], i % 4 == 1 ? Header(0, 0, 0, 1, 0x301) : Random(rng, 1 + rng() % 64));
    }
    close(ends[1]);
    EXPECT_TRUE(ClosedByPeer(ends[0])) << "misbehaving peer " << i;
    close(ends[0]);
    close(fd);
  }

  // Half-open connections: connected and silent, or with the write side shut.
  std::vector<int> idle;
  for (int i = 0; i < 100; i++) {
    idle.push_back(Connect(collector.socket));
    if (i % 2) shutdown(idle.back(), SHUT_WR);
  }

  // Clients that disconnect mid-stream, and a target killed mid-snapshot.
  {
    Workload big(collector.socket, {"many", "200000"});
    for (int i = 0; i < 20; i++) {
      int fd = Connect(collector.socket);
      int ends[2];
      ASSERT_EQ(hd_channel_pair(ends), HD_OK);
      SendRaw(fd, TakeLiveSnapshotRequest(big.pid, i % 2 == 0), {ends[1]});
      close(ends[1]);
      char buf[65536];
      EXPECT_GT(recv(ends[0], buf, sizeof buf, 0), 16);
      close(ends[0]);
      close(fd);
    }
    auto selector = ByPid(big.pid);
    auto result = std::make_unique<Result>();
    Call call(collector.socket);
    heapdump_client_CollectorTakeLiveSnapshotRequest req =
        heapdump_client_CollectorTakeLiveSnapshotRequest_init_zero;
    req.has_process_selector = req.has_receiver = req.has_with_contents = true;
    req.process_selector = selector;
    req.receiver = {true, 0};
    req.with_contents = true;
    auto msg = std::make_unique<hd_message>();
    ASSERT_EQ(hd_fidl_collector_take_live_snapshot(call.fd, msg.get(), &req, &call.ends[1], 1),
              HD_OK);
    call.SentTheirEnd();
    pid_t target = big.pid;
    result->ra.progress_ctx = &target;
    result->ra.progress = [](void *ctx, const hd_reassembler *r) {
      pid_t *victim = static_cast<pid_t *>(ctx);
      if (r->batches_received == 3 && *victim > 0) kill(*victim, SIGKILL);
    };
    result->status = hd_snapshot_receive(call.ends[0], false, &result->ra, &result->error);
    // The tables stay mapped: the stream ends normally; blocks unreadable after the kill are
    // left out whole, never sent short.
    EXPECT_EQ(result->status, HD_OK) << hd_status_str(result->status);
    EXPECT_EQ(result->error, 0u);
    EXPECT_EQ(hd_reassembler_finish(&result->ra), HD_OK) << result->ra.error;
    ASSERT_NE(result->only(), nullptr);
    EXPECT_EQ(Blocks(result->only(), 32, "").blocks, 200000u);
    EXPECT_LT(result->only()->block_count, 200000u);
  }

  // A burst of connections at once, each answered.
  std::vector<std::pair<int, int>> burst;
  for (int i = 0; i < 300; i++) {
    int fd = Connect(collector.socket);
    int ends[2];
    ASSERT_EQ(hd_channel_pair(ends), HD_OK);
    SendRaw(fd, TakeLiveSnapshotRequest(1), {ends[1]});
    close(ends[1]);
    burst.emplace_back(fd, ends[0]);
  }
  // Answered as they come: at most 32 run at once (the rest wait for a stream thread), and each
  // running one waits for its client's answer.
  while (!burst.empty()) {
    std::vector<struct pollfd> ready;
    for (auto [fd, receiver] : burst) ready.push_back({receiver, POLLIN, 0});
    ASSERT_GT(poll(ready.data(), ready.size(), 30000), 0) << burst.size() << " requests unanswered";
    for (size_t i = ready.size(); i-- > 0;) {
      if (ready[i].revents == 0) continue;
      Result result;
      result.status = hd_snapshot_receive(burst[i].second, false, &result.ra, &result.error);
      EXPECT_EQ(result.status, HD_OK);
      EXPECT_EQ(result.error, Error(heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH));
      close(burst[i].second);
      close(burst[i].first);
      burst.erase(burst.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  for (int fd : idle) close(fd);

  // Still serving, and back to the descriptors it had.
  auto selector = ByPid(child.pid);
  auto normal = TakeLiveSnapshot(collector.socket, &selector, true);
  ASSERT_EQ(normal->status, HD_OK) << normal->ra.error;
  ASSERT_EQ(normal->error, 0u);
  EXPECT_EQ(Blocks(normal->only(), 100, "alpha_leaks").in_function, 10u);
  EXPECT_EQ(Blocks(normal->only(), 200, "worker_leaks").in_function, 5u);
  EXPECT_TRUE(WaitUntil([&] { return collector.Fds().size() == baseline; }, 30));
  std::string now;
  for (const std::string &fd : collector.Fds()) now += fd + "\n";
  EXPECT_EQ(collector.SettledFdCount(), baseline) << "descriptors now:\n" << now;
  child.Finish();
  collector.Stop(SIGTERM);  // exits 0: no crash, and in the sanitizer build no leak
}

// Listings, live snapshots and downloads whose channel end is not a channel (a datagram socket,
// whose peer's close goes unnoticed) are refused at once: 1,100 of them from clients that then
// vanish used to fill every connection slot, locking out all later clients and processes.
TEST_F(RobustnessTest, ChannelEndsThatAreNotChannelsAreRefused) {
  const size_t baseline = collector.SettledFdCount();
  for (int i = 0; i < 1100; i++) {
    int fd = Connect(collector.socket);
    ASSERT_GE(fd, 0);
    int ends[2];
    ASSERT_EQ(socketpair(AF_UNIX, (i % 3 == 2 ? SOCK_STREAM : SOCK_DGRAM) | SOCK_CLOEXEC, 0, ends),
              0);
    if (i % 3 == 0) {
      heapdump_client_CollectorListStoredSnapshotsRequest req =
          heapdump_client_CollectorListStoredSnapshotsRequest_init_zero;
      req.has_iterator = true;
      req.iterator = {true, 0};
      SendRaw(fd,
              Encoded(HD_ORDINAL_COLLECTOR_LIST_STORED_SNAPSHOTS,
                      heapdump_client_CollectorListStoredSnapshotsRequest_fields, req, 1),
              {ends[1]});
    } else {
      SendRaw(fd, TakeLiveSnapshotRequest(0), {ends[1]});
    }
    close(ends[1]);
    close(ends[0]);
    close(fd);
  }
  EXPECT_EQ(collector.SettledFdCount(), baseline) << collector.Log();
  // Logged, but not 1,100 times: a warning a peer can provoke at will is rate-limited (20 lines of
  // one kind per 10 s; the run may straddle two windows).
  const std::string log = collector.Log();
  size_t logged = 0;
  for (size_t at = log.find("is not a channel"); at != std::string::npos;
       at = log.find("is not a channel", at + 1)) {
    logged++;
  }
  EXPECT_GE(logged, 1u);
  EXPECT_LE(logged, 40u);
  Child child(collector.socket, "after-datagrams");  // a process still registers and stores
  EXPECT_EQ(child.snapshot_rc, 0);
  EXPECT_NE(StoredId(List(collector.socket), "after-datagrams"), 0u);
  child.Finish();
}

// Connections that never say anything, and clients that stop talking, are closed after the idle
// timeout; a registered process's connections are not, however idle.
TEST_F(RobustnessTest, IdleClientConnectionsAreClosed) {
  collector.Stop();
  collector.args = {"--idle-timeout", "1"};
  collector.Start();
  Child child(collector.socket, nullptr);
  const size_t baseline = collector.SettledFdCount();
  std::vector<int> silent;
  for (int i = 0; i < 20; i++) silent.push_back(Connect(collector.socket));
  ASSERT_TRUE(WaitUntil([&] { return collector.Fds().size() >= baseline + 20; }, 5));
  EXPECT_TRUE(WaitUntil([&] { return collector.Fds().size() == baseline; }, 10)) << collector.Log();
  for (int fd : silent) EXPECT_TRUE(ClosedByPeer(fd));
  for (int fd : silent) close(fd);
  auto selector = ByPid(child.pid);
  auto live = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(live->status, HD_OK) << live->ra.error;
  EXPECT_EQ(live->error, 0u);
  child.Finish();
}

// The daemon's SIGTERM handler stops the collector it runs; were it run on a storage thread while
// the main thread tears that collector down, it would touch a freed collector (TSan saw the race).
// So every thread but the main one blocks the signals the daemon handles.
TEST_F(RobustnessTest, OnlyTheMainThreadTakesTheStopSignals) {
  const std::string tasks = "/proc/" + std::to_string(collector.pid) + "/task";
  std::vector<std::string> helpers;
  // The storage workers, two of them (under load, a moment may pass before both are listed).
  EXPECT_TRUE(WaitUntil(
      [&] {
        helpers.clear();
        for (const std::string &tid : Glob(tasks, "")) {
          if (tid[0] != '.' && tid != std::to_string(collector.pid)) helpers.push_back(tid);
        }
        return helpers.size() >= 2;
      },
      10))
      << helpers.size() << " threads besides the main one";
  for (const std::string &tid : helpers) {
    std::string blocked;
    for (const std::string &line : Lines(ReadFile(tasks + "/" + tid + "/status"))) {
      if (line.rfind("SigBlk:", 0) == 0) blocked = line.substr(7);
    }
    if (blocked.empty()) continue;  // gone since it was listed
    const unsigned long long mask = std::stoull(blocked, nullptr, 16);
    EXPECT_TRUE(mask & (1ull << (SIGTERM - 1))) << tid << " does not block SIGTERM: " << blocked;
    EXPECT_TRUE(mask & (1ull << (SIGINT - 1))) << tid << " does not block SIGINT: " << blocked;
  }
}

// Clients that fill three quarters of the connection table are closed once idle for a second,
// whatever the idle timeout: a new client is still served.
TEST_F(RobustnessTest, CrowdingClientsLeaveRoomForNewOnes) {
  const size_t baseline = collector.SettledFdCount();
  std::vector<int> crowd;
  for (int i = 0; i < 800; i++) {
    int fd = Connect(collector.socket);
    if (fd < 0) break;  // the test's own descriptor limit
    crowd.push_back(fd);
  }
  ASSERT_GE(crowd.size(), 768u) << "needs 800 descriptors";
  ASSERT_TRUE(WaitUntil([&] { return collector.Fds().size() <= baseline + 1; }, 15))
      << collector.Fds().size();
  EXPECT_EQ(List(collector.socket).items.size(), 0u);
  for (int fd : crowd) close(fd);
}

}  // namespace
}  // namespace hdtest
