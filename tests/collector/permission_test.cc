// Who may talk to the collector and what they see: a client of another uid is refused (checked
// with SO_PEERCRED, whatever the socket's file permissions), and a client that is not root sees
// only its own uid's processes and stored snapshots. Needs root to switch users.
#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "harness.h"

namespace hdtest {
namespace {

struct User {
  uid_t uid = 0;
  gid_t gid = 0;
};

// Runs body in a child process switched to user; returns its exit code (body's result), or -1.
int RunAs(const User &user, const std::function<int()> &body) {
  pid_t pid = fork();
  if (pid == 0) {
    if (!BecomeUser(user.uid, user.gid)) _exit(126);
    _exit(body());
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class PermissionTest : public ::testing::Test {
 protected:
  std::string dir = TempDir();
  RemoveWhenPassed cleanup{dir};
  Collector collector{dir};
  User nobody;

  void SetUp() override {
    if (geteuid() != 0)
      GTEST_SKIP() << "permission tests need root, to run a client as another user";
    struct passwd *pw = getpwnam("nobody");
    if (pw == nullptr) GTEST_SKIP() << "no user 'nobody' to switch to";
    nobody = {pw->pw_uid, pw->pw_gid};
    // The programs must be reachable by nobody: the build tree may be in a private directory.
    int reachable = RunAs(nobody, [] {
      return access(HD_COLLECTOR, X_OK) == 0 && access(HD_CHILD, X_OK) == 0 &&
             access(HD_PRELOAD_LIB, R_OK) == 0;
    });
    if (reachable != 1) GTEST_SKIP() << "the build tree is not readable by user nobody";
    ASSERT_EQ(chmod(dir.c_str(), 0755), 0);
  }
};

TEST_F(PermissionTest, ClientOfAnotherUidIsRefused) {
  collector.Start();
  // Let nobody reach the socket file: only the collector's own check stands in the way.
  ASSERT_EQ(chmod((dir + "/run").c_str(), 0755), 0);
  ASSERT_EQ(chmod(collector.socket.c_str(), 0777), 0);
  Child child(collector.socket, nullptr);
  std::string socket = collector.socket;
  pid_t target = child.pid;
  int outcome = RunAs(nobody, [&] {
    int fd;
    if (hd_channel_connect(socket.c_str(), &fd) != HD_OK) return 10;  // could not even connect
    int ends[2];
    if (hd_channel_pair(ends) != HD_OK) return 11;
    heapdump_client_CollectorTakeLiveSnapshotRequest req =
        heapdump_client_CollectorTakeLiveSnapshotRequest_init_zero;
    req.has_process_selector = req.has_receiver = true;
    req.process_selector = ByPid(target);
    req.receiver = {true, 0};
    hd_message msg;
    // The collector may already have closed the connection, failing the send: refused too.
    hd_status sent = hd_fidl_collector_take_live_snapshot(fd, &msg, &req, &ends[1], 1);
    close(ends[1]);
    Result result;
    hd_status status = hd_snapshot_receive(ends[0], false, &result.ra, &result.error);
    // Refused: the request is never served, the receiver closes without a batch or an error.
    bool served = sent == HD_OK && (status != HD_ERR_PEER_CLOSED || result.ra.batches_received > 0);
    return served ? 1 : 0;
  });
  EXPECT_EQ(outcome, 0);
  EXPECT_NE(collector.Log().find("refused connection from uid " + std::to_string(nobody.uid)),
            std::string::npos);
  // The owner is still served.
  auto selector = ByPid(child.pid);
  auto result = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(result->status, HD_OK) << result->ra.error;
  EXPECT_EQ(result->error, 0u);
  child.Finish();
}

// A root collector given a storage directory that another user made (in /tmp, say) refuses it:
// that user could otherwise plant links there and have root overwrite any file through them.
TEST_F(PermissionTest, AStorageDirectoryOfAnotherUserIsRefused) {
  const std::string shared = dir + "/tmp", planted = shared + "/planted",
                    victim = dir + "/root-only";
  ASSERT_EQ(mkdir(shared.c_str(), 0700), 0);
  ASSERT_EQ(chmod(shared.c_str(), 01777), 0);  // as /tmp is
  WriteFile(victim, "root's");
  ASSERT_EQ(chmod(victim.c_str(), 0600), 0);
  const std::string link_target = victim;
  ASSERT_EQ(
      RunAs(nobody,
            [&] {
              if (mkdir(planted.c_str(), 0700) != 0) return 1;
              return symlink(link_target.c_str(), (planted + "/next-id.tmp").c_str()) == 0 ? 0 : 2;
            }),
      0);
  ShellOutput refused = RunShell("exec timeout 20 '" HD_COLLECTOR "' --foreground --socket '" +
                                     dir + "/run/c.sock' --storage '" + planted + "'",
                                 dir, {"PATH=/usr/bin:/bin"});
  EXPECT_NE(refused.status, 0) << refused.out;
  EXPECT_NE(refused.out.find("storage directory " + planted + " must be owned by uid 0"),
            std::string::npos)
      << refused.out;
  EXPECT_EQ(ReadFile(victim), "root's");
}

TEST_F(PermissionTest, ClientSeesOnlyItsOwnUidsProcessesAndSnapshots) {
  // A collector of nobody's, with root's program and nobody's program registered.
  ASSERT_EQ(chown(dir.c_str(), nobody.uid, nobody.gid), 0);
  collector.uid = nobody.uid;
  collector.gid = nobody.gid;
  collector.Start();
  ChildOptions as_nobody;
  as_nobody.uid = nobody.uid;
  as_nobody.gid = nobody.gid;
  as_nobody.snapshot_name = "nobodys";
  Child theirs(collector.socket, as_nobody);
  Child roots(collector.socket, "roots");
  ASSERT_EQ(theirs.snapshot_rc, 0);
  ASSERT_EQ(roots.snapshot_rc, 0);
  uint32_t roots_id = StoredId(List(collector.socket), "roots");
  ASSERT_NE(roots_id, 0u);

  std::string socket = collector.socket;
  pid_t their_pid = theirs.pid, root_pid = roots.pid;
  int outcome = RunAs(nobody, [&] {
    // Without a selector, only its own process matches: no ambiguity.
    auto any = TakeLiveSnapshot(socket, nullptr, false, true);
    if (any->status != HD_OK || any->ra.snapshot_count != 1 ||
        any->ra.snapshots[0]->pid != static_cast<uint64_t>(their_pid)) {
      return 1;
    }
    auto selector = ByPid(root_pid);
    if (TakeLiveSnapshot(socket, &selector)->error !=
        Error(heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH)) {
      return 2;
    }
    Listing listing = List(socket);
    if (listing.items.size() != 1 || listing.items[0].name != "nobodys") return 3;
    if (Download(socket, roots_id)->error !=
        Error(heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND)) {
      return 4;
    }
    // Nor delete it, nor learn whether root's process runs.
    if (Delete(socket, roots_id).error !=
        Error(heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND)) {
      return 5;
    }
    if (GetProcessState(socket, root_pid).state !=
            heapdump_client_ProcessState_PROCESS_STATE_UNKNOWN ||
        GetProcessState(socket, their_pid).state !=
            heapdump_client_ProcessState_PROCESS_STATE_RUNNING) {
      return 6;
    }
    return 0;
  });
  EXPECT_EQ(outcome, 0) << collector.Log();
  // Root sees both.
  auto all = TakeLiveSnapshot(collector.socket, nullptr, false, true);
  ASSERT_EQ(all->status, HD_OK) << all->ra.error;
  EXPECT_EQ(all->ra.snapshot_count, 2u);
  EXPECT_EQ(List(collector.socket).items.size(), 2u);
  auto root_snapshot = Download(collector.socket, roots_id);
  ASSERT_EQ(root_snapshot->status, HD_OK) << root_snapshot->ra.error;
  EXPECT_EQ(Blocks(root_snapshot->only(), 100, "alpha_leaks").in_function, 10u);
  theirs.Finish();
  roots.Finish();
}

// A root collector adopts the processes of every user that point at its socket, and stores their
// exit snapshots. Retention limits hold for each user on its own: another user's exiting
// processes evict only that user's snapshots, never root's.
TEST_F(PermissionTest, RetentionLimitsHoldForEachUserOnItsOwn) {
  collector.args = {"--max-stored", "2"};
  collector.Start();
  Child roots(collector.socket, "root-1");
  ASSERT_EQ(roots.snapshot_rc, 0);
  ASSERT_EQ(roots.Snapshot("root-2"), 0);
  for (int i = 0; i < 3; i++) {
    ChildOptions as_nobody;
    as_nobody.uid = nobody.uid;
    as_nobody.gid = nobody.gid;
    as_nobody.exit_snapshot = true;
    Child theirs(collector.socket, as_nobody);
    // A live snapshot rescans /proc (at most once a second), and the collector adopts it.
    const pid_t pid = theirs.pid;
    auto selector = ByPid(pid);
    ASSERT_TRUE(WaitUntil([&] {
      return TakeLiveSnapshot(collector.socket, &selector)->error == 0;
    })) << collector.Log();
    theirs.Finish();
    ASSERT_TRUE(WaitUntil([&] {
      return GetProcessState(collector.socket, pid).state ==
             heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_STORED;
    })) << collector.Log();
  }
  Listing listing = List(collector.socket);
  size_t exits = 0;
  for (const Stored &s : listing.items) exits += s.name == "exit";
  EXPECT_EQ(exits, 2u);
  EXPECT_NE(StoredId(listing, "root-1"), 0u) << collector.Log();
  EXPECT_NE(StoredId(listing, "root-2"), 0u);
  roots.Finish();
}

}  // namespace
}  // namespace hdtest
