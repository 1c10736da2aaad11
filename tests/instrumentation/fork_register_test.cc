// A program under LD_PRELOAD forks while other threads hold the library's locks; the child must
// register with a real heapdump-collector as a process of its own, with its own live set (the
// parent's at the fork, plus its own blocks), and the parent must stay registered with its own.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include <gtest/gtest.h>

extern "C" {
#include "heapdump/fidl/channel.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump_client.bindings.h"
}
#include "listener.h"

namespace {

class CollectorProcess {
 public:
  CollectorProcess() {
    char tmpl[] = "/tmp/hd-fork-register-XXXXXX";
    dir_ = mkdtemp(tmpl);
    socket_ = dir_ + "/collector.sock";
    pid_ = fork();
    if (pid_ == 0) {
      std::string storage = dir_ + "/state";
      execl(HD_COLLECTOR, HD_COLLECTOR, "--foreground", "--socket", socket_.c_str(), "--storage",
            storage.c_str(), "--log-level", "warn", (char *)nullptr);
      _exit(127);
    }
  }
  ~CollectorProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  bool Ready() const { return pid_ > 0 && hdtest::WaitForListener(socket_, pid_); }
  const std::string &socket() const { return socket_; }

 private:
  std::string dir_, socket_;
  pid_t pid_ = -1;
};

struct Snapshot {
  hd_status status = HD_OK;
  uint32_t error = 0;
  hd_reassembler ra;
  Snapshot() { hd_reassembler_init(&ra); }
  ~Snapshot() { hd_reassembler_destroy(&ra); }
  int CountSize(uint64_t size) const {
    if (ra.snapshot_count != 1) return -1;
    int n = 0;
    const hd_snapshot *s = ra.snapshots[0];
    for (size_t i = 0; i < s->allocation_count; i++) n += s->allocations[i].size == size;
    return n;
  }
};

// The live snapshot of process `pid`, taken by the collector over its client protocol.
std::unique_ptr<Snapshot> TakeLiveSnapshot(const std::string &socket, pid_t pid) {
  auto out = std::make_unique<Snapshot>();
  int fd = -1, ends[2] = {-1, -1};
  if (hd_channel_connect(socket.c_str(), &fd) != HD_OK || hd_channel_pair(ends) != HD_OK) {
    out->status = HD_ERR_IO;
    if (fd >= 0) close(fd);
    return out;
  }
  heapdump_client_CollectorTakeLiveSnapshotRequest req =
      heapdump_client_CollectorTakeLiveSnapshotRequest_init_zero;
  req.has_process_selector = true;
  req.process_selector.which_selector = heapdump_client_ProcessSelector_by_koid_tag;
  req.process_selector.selector.by_koid = static_cast<uint64_t>(pid);
  req.has_receiver = true;
  req.receiver = {true, 0};
  auto msg = std::make_unique<hd_message>();
  out->status = hd_collector_take_live_snapshot(fd, msg.get(), &req, &ends[1], 1);
  close(ends[1]);
  if (out->status == HD_OK) out->status = hd_snapshot_receive(ends[0], false, &out->ra, &out->error);
  if (out->status == HD_OK && out->error == 0) out->status = hd_reassembler_finish(&out->ra);
  close(ends[0]);
  close(fd);
  return out;
}

struct Config {
  const char *name;
  const char *allocator;
};

class ForkRegister : public ::testing::TestWithParam<Config> {};

TEST_P(ForkRegister, ChildRegistersAsANewProcessWithItsOwnLiveSet) {
  CollectorProcess collector;
  ASSERT_TRUE(collector.Ready()) << "collector did not start";

  int to_child[2], from_child[2];
  ASSERT_EQ(pipe2(to_child, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(from_child, O_CLOEXEC), 0);
  pid_t parent = fork();
  if (parent == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    setenv("LD_PRELOAD", HD_PRELOAD_LIB, 1);
    setenv("HEAPDUMP_SOCKET", collector.socket().c_str(), 1);
    setenv("HEAPDUMP_ALLOCATOR", GetParam().allocator, 1);
    execl(HD_CHILD, HD_CHILD, "fork-register", (char *)nullptr);
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  std::string out;
  char buf[512];
  ssize_t n;
  while (out.find("ready\n") == std::string::npos &&
         (n = read(from_child[0], buf, sizeof(buf))) > 0)
    out.append(buf, static_cast<size_t>(n));
  int forked = 0;
  const size_t at = out.find("forked ");
  if (at != std::string::npos) forked = atoi(out.c_str() + at + 7);

  if (forked > 0 && out.find("ready\n") != std::string::npos) {
    auto child = TakeLiveSnapshot(collector.socket(), forked);
    ASSERT_EQ(child->status, HD_OK) << child->ra.error;
    ASSERT_EQ(child->error, 0u) << "the collector does not know the fork child";
    EXPECT_EQ(child->CountSize(8811), 1);  // inherited from the parent's live set
    EXPECT_EQ(child->CountSize(8822), 1);  // its own
    EXPECT_EQ(child->CountSize(8833), 0);  // the parent's, after the fork
    ASSERT_TRUE(child->ra.snapshots[0]->has_stats);
    EXPECT_EQ(child->ra.snapshots[0]->stats.live_blocks, child->ra.snapshots[0]->allocation_count);

    auto original = TakeLiveSnapshot(collector.socket(), parent);
    ASSERT_EQ(original->status, HD_OK) << original->ra.error;
    ASSERT_EQ(original->error, 0u);
    EXPECT_EQ(original->CountSize(8811), 1);
    EXPECT_EQ(original->CountSize(8822), 0);
    EXPECT_EQ(original->CountSize(8833), 1);
  }

  close(to_child[1]);  // both processes wait for end of file on this pipe
  while ((n = read(from_child[0], buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  close(from_child[0]);
  int status = 0;
  ASSERT_EQ(waitpid(parent, &status, 0), parent);
  EXPECT_GT(forked, 0) << out;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << ": " << out;
}

INSTANTIATE_TEST_SUITE_P(Backends, ForkRegister,
                         ::testing::Values(Config{"jemalloc", "jemalloc"},
                                           Config{"system", "system"}),
                         [](const ::testing::TestParamInfo<Config> &i) {
                           return std::string(i.param.name);
                         });

}  // namespace
