// A program under LD_PRELOAD forks while other threads hold the library's locks; the child must
// register with a real heapdump-collector as a process of its own, with its own live set (the
// parent's at the fork, plus its own blocks), and the parent must stay registered with its own.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "client.h"
#include "heapdump/heapdump.h"
#include "process.h"

namespace {

// How many blocks of `size` the only snapshot of r has; -1 if it has not exactly one.
int CountSize(const hdtest::Result &r, uint64_t size) {
  const hd_snapshot *s = r.only();
  if (s == nullptr) return -1;
  int n = 0;
  for (size_t i = 0; i < s->allocation_count; i++) n += s->allocations[i].size == size;
  return n;
}

std::unique_ptr<hdtest::Result> TakeLiveSnapshot(const std::string &socket, pid_t pid) {
  heapdump_client_ProcessSelector selector = hdtest::ByPid(pid);
  return hdtest::TakeLiveSnapshot(socket, &selector);
}

struct Config {
  const char *name;
  const char *allocator;
};

// Each test has a collector of its own; child.cc runs under LD_PRELOAD with the backend under
// test (Env()), registering with it.
class ForkRegister : public ::testing::TestWithParam<Config> {
 protected:
  std::string dir = hdtest::TempDir("fork-register");
  hdtest::RemoveWhenPassed remove{dir};
  hdtest::Collector collector{dir};
  void SetUp() override { collector.Start(); }
  void ForkAndCompare(const std::vector<std::string> &env);
  std::vector<std::string> Env() const {
    auto env = hdtest::InstrumentedEnv(collector.socket);
    env.push_back(std::string("HEAPDUMP_ALLOCATOR=") + GetParam().allocator);
    return env;
  }
};

// fork-register with the environment given (NAME=VALUE) beside the library's.
void ForkRegister::ForkAndCompare(const std::vector<std::string> &env) {
  int to_child[2], from_child[2];
  ASSERT_EQ(pipe2(to_child, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(from_child, O_CLOEXEC), 0);
  pid_t parent = fork();
  if (parent == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    setenv("LD_PRELOAD", HD_PRELOAD_LIB, 1);
    setenv("HEAPDUMP_SOCKET", collector.socket.c_str(), 1);
    setenv("HEAPDUMP_ALLOCATOR", GetParam().allocator, 1);
    for (const std::string &e : env) putenv(strdup(e.c_str()));
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
    auto child = TakeLiveSnapshot(collector.socket, forked);
    ASSERT_EQ(child->status, HD_OK) << child->ra.error;
    ASSERT_EQ(child->error, 0u) << "the collector does not know the fork child";
    EXPECT_EQ(CountSize(*child, 8811), 1);  // inherited from the parent's live set
    EXPECT_EQ(CountSize(*child, 8822), 1);  // its own
    EXPECT_EQ(CountSize(*child, 8833), 0);  // the parent's, after the fork
    // The child's counters start from what it inherited: the blocks (and, sampled, the blocks
    // they stand for) its snapshot shows.
    const hd_snapshot *s = child->ra.snapshots[0];
    ASSERT_TRUE(s->has_stats);
    uint64_t blocks = 0, bytes = 0;
    for (size_t i = 0; i < s->allocation_count; i++) {
      blocks += s->allocations[i].count;
      bytes += s->allocations[i].size;
    }
    EXPECT_EQ(s->stats.live_blocks, blocks);
    EXPECT_EQ(s->stats.live_bytes, bytes);

    auto original = TakeLiveSnapshot(collector.socket, parent);
    ASSERT_EQ(original->status, HD_OK) << original->ra.error;
    ASSERT_EQ(original->error, 0u);
    EXPECT_EQ(CountSize(*original, 8811), 1);
    EXPECT_EQ(CountSize(*original, 8822), 0);
    EXPECT_EQ(CountSize(*original, 8833), 1);
  }

  close(to_child[1]);  // both processes wait for end of file on this pipe
  while ((n = read(from_child[0], buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  close(from_child[0]);
  int status = 0;
  ASSERT_EQ(waitpid(parent, &status, 0), parent);
  EXPECT_GT(forked, 0) << out;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << ": " << out;
}

TEST_P(ForkRegister, ChildRegistersAsANewProcessWithItsOwnLiveSet) { ForkAndCompare({}); }

// Sampled (every block of the test's sizes is recorded at this rate, small ones are weighted):
// the child's counters are the estimates its inherited blocks stand for.
TEST_P(ForkRegister, ASampledChildStartsFromTheEstimatesItInherits) {
  ForkAndCompare({"HEAPDUMP_SAMPLE_BYTES=256"});
}

// A daemon closes every descriptor after start (close_range) and opens its own files, which get
// the numbers the library's descriptors had. Neither a named snapshot nor a fork child may close,
// write, send or reuse them; the collector, which holds its own copies of the tables, still
// serves the process and takes it back (Reattach) for its named snapshot.
TEST_P(ForkRegister, TheProgramsOwnDescriptorsAreNeverTouched) {
  hdtest::Program program({HD_CHILD, "foreign-fds", dir}, Env());
  ASSERT_EQ(program.ReadLine(), "closed");
  program.Send("");  // one byte: the program reads one, then waits for the end of its stdin
  EXPECT_EQ(program.ReadLine(), "snapshot 0") << collector.Log();
  ASSERT_EQ(program.ReadLine(), "done");
  auto live = TakeLiveSnapshot(collector.socket, program.pid);
  ASSERT_EQ(live->status, HD_OK) << live->ra.error;
  ASSERT_EQ(live->error, 0u);
  EXPECT_EQ(CountSize(*live, 7711), 1);
  int status = program.Finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  for (int i = 0; i < 8; i++) {
    EXPECT_EQ(hdtest::ReadFile(dir + "/log_" + std::to_string(i)), "child\nparent\n") << i;
  }
  const uint32_t id = hdtest::StoredId(hdtest::List(collector.socket), "after-close");
  ASSERT_NE(id, 0u) << collector.Log();
  auto stored = hdtest::Download(collector.socket, id);
  ASSERT_EQ(stored->status, HD_OK) << stored->ra.error;
  EXPECT_EQ(CountSize(*stored, 7711), 1);
  EXPECT_NE(collector.Log().find("reattached"), std::string::npos) << collector.Log();
}

// A collector that does not hold the tables of a process that closed them (it started, or
// restarted, after the close) cannot take it back: the named snapshot fails as without a
// collector, and the program runs on.
TEST_P(ForkRegister, AProcessThatClosedItsTablesIsNotTakenBackByANewCollector) {
  hdtest::Program program({HD_CHILD, "foreign-fds", dir}, Env());
  ASSERT_EQ(program.ReadLine(), "closed");
  collector.Stop();
  collector.Start();
  program.Send("");  // one byte: the program reads one, then waits for the end of its stdin
  EXPECT_EQ(program.ReadLine(), "snapshot " + std::to_string(HEAPDUMP_ERROR_NO_COLLECTOR));
  ASSERT_EQ(program.ReadLine(), "done");
  int status = program.Finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  for (int i = 0; i < 8; i++) {
    EXPECT_EQ(hdtest::ReadFile(dir + "/log_" + std::to_string(i)), "child\nparent\n") << i;
  }
  EXPECT_NE(collector.Log().find("refused to reattach"), std::string::npos) << collector.Log();
  EXPECT_EQ(hdtest::StoredId(hdtest::List(collector.socket), "after-close"), 0u);
}

// libunwind's validation pipe, re-created when the program closed it, never reads from, writes
// into or closes the program's files, even where they took the pipe's numbers.
TEST_P(ForkRegister, TheUnwinderNeverTouchesTheProgramsFiles) {
  hdtest::Program program({HD_CHILD, "unwinder-fds", dir}, Env());
  EXPECT_EQ(program.ReadLine(), "intact");
  int status = program.Finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// Threads cancelled (pthread_cancel) while they store named snapshots leave the API usable: a
// cancelled call used to leave the registration lock held, and every later call hung.
TEST_P(ForkRegister, CancellingASnapshottingThreadLeavesTheApiUsable) {
  hdtest::Program program({HD_CHILD, "cancel"}, Env());
  EXPECT_EQ(program.ReadLine(), "snapshot 0");
  int status = program.Finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_NE(hdtest::StoredId(hdtest::List(collector.socket), "after-cancel"), 0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, ForkRegister,
                         ::testing::Values(Config{"jemalloc", "jemalloc"},
                                           Config{"system", "system"}),
                         [](const ::testing::TestParamInfo<Config> &i) {
                           return std::string(i.param.name);
                         });

}  // namespace
