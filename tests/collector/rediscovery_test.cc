// Start order does not matter: a collector started after a program, or restarted while it runs,
// finds it through /proc; a later registration of the same process is merged with what was
// found; a pid reused by another program is not confused with the one that had it.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include <gtest/gtest.h>

#include "harness.h"

namespace hdtest {
namespace {

class RediscoveryTest : public ::testing::Test {
 protected:
  std::string dir = TempDir();
  RemoveWhenPassed cleanup{dir};
  Collector collector{dir};

  std::unique_ptr<Result> ByPidSnapshot(pid_t pid, bool multi = false) {
    auto selector = ByPid(pid);
    return TakeLiveSnapshot(collector.socket, &selector, false, multi);
  }
  size_t CountIn(const std::string &text, const std::string &what) {
    size_t count = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1))
      count++;
    return count;
  }
  size_t ExitSnapshots(pid_t pid) {
    size_t count = 0;
    for (const Stored &s : List(collector.socket).items) {
      count += s.name == "exit" && s.pid == static_cast<uint64_t>(pid);
    }
    return count;
  }
};

void ExpectKnownHeap(const Result &result) {
  ASSERT_EQ(result.status, HD_OK) << result.ra.error;
  ASSERT_EQ(result.error, 0u);
  const hd_snapshot *s = result.only();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(Blocks(s, 100, "alpha_leaks").in_function, 10u);
  Site worker = Blocks(s, 200, "worker_leaks");
  EXPECT_EQ(worker.in_function, 5u);
  EXPECT_EQ(worker.thread, "hd-worker");
}

TEST_F(RediscoveryTest, ProgramStartedBeforeTheCollectorIsFound) {
  Child child(collector.socket, "early");
  EXPECT_EQ(child.snapshot_rc, -3);  // HEAPDUMP_ERROR_NO_COLLECTOR: nobody to register with
  collector.Start();
  ExpectKnownHeap(*ByPidSnapshot(child.pid));
  auto by_name = ByName("snapshot_child");
  ExpectKnownHeap(*TakeLiveSnapshot(collector.socket, &by_name));
  EXPECT_EQ(CountIn(collector.Log(), "found snapshot_child[" + std::to_string(child.pid) + "]"),
            1u);

  // Storing a snapshot registers the program: the same process, so still one entry.
  EXPECT_EQ(child.Snapshot("later"), 0);
  EXPECT_NE(collector.Log().find("merged with its entry"), std::string::npos);
  auto multi = ByPidSnapshot(child.pid, true);
  ASSERT_EQ(multi->status, HD_OK) << multi->ra.error;
  EXPECT_EQ(multi->ra.snapshot_count, 1u);
  auto all = TakeLiveSnapshot(collector.socket, nullptr, false, true);
  ASSERT_EQ(all->status, HD_OK) << all->ra.error;
  EXPECT_EQ(all->ra.snapshot_count, 1u);
  EXPECT_NE(StoredId(List(collector.socket), "later"), 0u);

  child.Finish();
  EXPECT_TRUE(WaitUntil([&] {
    return ByPidSnapshot(child.pid)->error ==
           Error(heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH);
  })) << "the exit was not noticed";
}

TEST_F(RediscoveryTest, FoundProgramGetsItsExitSnapshot) {
  Child child(collector.socket, nullptr, true);
  collector.Start();
  ExpectKnownHeap(*ByPidSnapshot(child.pid));
  child.Finish();
  ASSERT_TRUE(WaitUntil([&] { return ExitSnapshots(child.pid) == 1; })) << collector.Log();
  auto at_exit = Download(collector.socket, StoredId(List(collector.socket), "exit"));
  ASSERT_EQ(at_exit->status, HD_OK) << at_exit->ra.error;
  EXPECT_EQ(Blocks(at_exit->only(), 100, "alpha_leaks").in_function, 10u);
  EXPECT_EQ(Blocks(at_exit->only(), 200, "worker_leaks").blocks, 0u);
}

TEST_F(RediscoveryTest, RestartedCollectorFindsTheRunningProgram) {
  collector.Start();
  Child child(collector.socket, nullptr, true);  // registers with the first collector
  ExpectKnownHeap(*ByPidSnapshot(child.pid));
  for (int sig : {SIGKILL, SIGTERM}) {
    collector.Stop(sig);
    collector.Start();
    SCOPED_TRACE(sig == SIGKILL ? "after kill -9" : "after SIGTERM");
    ExpectKnownHeap(*ByPidSnapshot(child.pid));
  }
  // Its registry connection is dead: storing a snapshot registers again, merged with the entry
  // the scan made.
  EXPECT_EQ(child.Snapshot("after-restarts"), 0);
  auto multi = ByPidSnapshot(child.pid, true);
  ASSERT_EQ(multi->status, HD_OK) << multi->ra.error;
  EXPECT_EQ(multi->ra.snapshot_count, 1u);
  // Neither shutdown took an exit snapshot of the running program; its real exit does, once.
  EXPECT_EQ(ExitSnapshots(child.pid), 0u);
  child.Finish();
  ASSERT_TRUE(WaitUntil([&] { return ExitSnapshots(child.pid) == 1; })) << collector.Log();
}

TEST_F(RediscoveryTest, RescanFindsAProgramWhoseRegistrationTimedOut) {
  collector.Start();
  ASSERT_EQ(kill(collector.pid, SIGSTOP), 0);
  // The program connects, gets no answer within its 2 s and goes on unregistered.
  Child child(collector.socket, nullptr);
  ASSERT_EQ(kill(collector.pid, SIGCONT), 0);
  // The last scan was at start, over a second ago: this request rescans first.
  ExpectKnownHeap(*ByPidSnapshot(child.pid));
  EXPECT_NE(collector.Log().find("found snapshot_child[" + std::to_string(child.pid) + "]"),
            std::string::npos);
  child.Finish();
}

TEST_F(RediscoveryTest, ProgramOfAnotherCollectorIsLeftAlone) {
  Child other(dir + "/elsewhere.sock", nullptr);
  collector.Start();
  EXPECT_EQ(ByPidSnapshot(other.pid)->error,
            Error(heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH));
  EXPECT_NE(collector.Log().find("pid " + std::to_string(other.pid) +
                                 " is instrumented for another collector's socket"),
            std::string::npos);
  other.Finish();
}

// A link of /proc/PID/fd naming one of libheapdump.so's memfds.
bool HasHeapdumpTables(pid_t pid) {
  std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  bool found = false;
  if (DIR *d = opendir(dir.c_str())) {
    while (struct dirent *e = readdir(d)) {
      char target[256];
      ssize_t n = readlink((dir + "/" + e->d_name).c_str(), target, sizeof target - 1);
      if (n <= 0) continue;
      found |= std::string(target, static_cast<size_t>(n)).rfind("/memfd:heapdump-", 0) == 0;
    }
    closedir(d);
  }
  return found;
}

TEST_F(RediscoveryTest, CollectorDoesNotAdoptItself) {
#ifdef HD_COLLECTOR_SANITIZED
  GTEST_SKIP() << "a sanitized collector cannot run under LD_PRELOAD=libheapdump.so";
#endif
  collector.env = InstrumentedEnv(collector.socket);
  collector.Start();
  ASSERT_TRUE(HasHeapdumpTables(collector.pid)) << "the collector is not instrumented";
  EXPECT_EQ(TakeLiveSnapshot(collector.socket, nullptr)->error,
            Error(heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH));
  EXPECT_EQ(List(collector.socket).status, HD_OK);
}

TEST_F(RediscoveryTest, PidReusedByAnotherProgramIsNotConfused) {
  if (geteuid() != 0 || access("/proc/sys/kernel/ns_last_pid", W_OK) != 0) {
    GTEST_SKIP() << "needs root and a writable /proc/sys/kernel/ns_last_pid to reuse a pid";
  }
  collector.Start();
  pid_t pid;
  {
    Workload first(collector.socket, {"many", "1000"}, true);
    pid = first.pid;
    // Exits while the collector is stopped: when it resumes, the pid is already someone else's.
    ASSERT_EQ(kill(collector.pid, SIGSTOP), 0);
    first.program->Kill();
  }
  ChildOptions options;
  options.pid = pid;
  options.after_fork = [&](pid_t) { kill(collector.pid, SIGCONT); };
  Child second(collector.socket, options);
  kill(collector.pid, SIGCONT);
  if (second.pid != pid) GTEST_SKIP() << "could not get pid " << pid << " again";
  // The pid now means the second program only.
  auto live = ByPidSnapshot(pid, true);
  ASSERT_EQ(live->status, HD_OK) << live->ra.error;
  ASSERT_EQ(live->ra.snapshot_count, 1u);
  const hd_snapshot *s = live->ra.snapshots[0];
  EXPECT_EQ(Blocks(s, 100, "alpha_leaks").in_function, 10u);
  EXPECT_LT(Blocks(s, 32, "").blocks, 1000u);
  // The first program's exit snapshot has its own heap, and is taken once.
  ASSERT_TRUE(WaitUntil([&] { return ExitSnapshots(pid) == 1; })) << collector.Log();
  auto at_exit = Download(collector.socket, StoredId(List(collector.socket), "exit"));
  ASSERT_EQ(at_exit->status, HD_OK) << at_exit->ra.error;
  EXPECT_GE(Blocks(at_exit->only(), 32, "").blocks, 1000u);
  EXPECT_EQ(Blocks(at_exit->only(), 100, "alpha_leaks").blocks, 0u);
  second.Finish();
  EXPECT_EQ(ExitSnapshots(pid), 1u);
}

}  // namespace
}  // namespace hdtest
