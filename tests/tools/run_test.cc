// `heapdump run` in the workflows users put it in: commands that exec (env, nice, sh -c 'exec',
// wrapper scripts, version-manager shims), builds with `make -j`, shell pipelines, commands that
// never load the library. Everything runs through bash, as typed in a terminal, with both the
// collector run embeds and a daemon; the workflows that race are repeated.
#include <dirent.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "client.h"
#include "process.h"

namespace {

using hdtest::RemoveWhenPassed;
using hdtest::ShellOutput;
using hdtest::TempDir;

double Now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

std::vector<std::string> ListDir(const std::string &path) {
  std::vector<std::string> names;
  if (DIR *d = opendir(path.c_str())) {
    while (dirent *e = readdir(d)) {
      if (e->d_name[0] != '.') names.push_back(e->d_name);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// "cc1.4242.exit.7.pb.gz" -> "cc1.exit": what a file in a run's directory is, pid and id aside.
std::string Kind(const std::string &file) {
  std::smatch m;
  if (!std::regex_match(file, m, std::regex(R"((.+)\.[0-9]+\.([a-z-]+)\.[0-9]+\.pb\.gz)"))) {
    return "?" + file;
  }
  return m[1].str() + "." + m[2].str();
}

std::vector<std::string> Kinds(const std::vector<std::string> &files) {
  std::vector<std::string> kinds;
  for (const auto &f : files) kinds.push_back(Kind(f));
  std::sort(kinds.begin(), kinds.end());
  return kinds;
}

class RunTest : public ::testing::TestWithParam<bool> {
 protected:
  std::string dir = TempDir("run");
  RemoveWhenPassed cleanup{dir};
  std::string tmp = dir + "/tmp";
  hdtest::Collector daemon{dir + "/daemon"};

  bool WithDaemon() const { return GetParam(); }
  void SetUp() override {
    ASSERT_EQ(mkdir(tmp.c_str(), 0700), 0);
    ASSERT_EQ(mkdir(daemon.dir.c_str(), 0700), 0);
    if (WithDaemon()) daemon.Start();
  }
  // bash in the test's directory; `heapdump` is on PATH, with this test's collector socket
  // (nothing listens there without the daemon: run embeds its own).
  ShellOutput Shell(const std::string &script) {
    return hdtest::RunShell(script, dir,
                            {"PATH=" + dir + "/bin:" + std::string(HD_BIN_DIRS) + ":/usr/bin:/bin",
                             "HEAPDUMP_SOCKET=" + daemon.socket, "TMPDIR=" + tmp, "HOME=" + dir,
                             std::string("LEAK_CHILD=") + HD_LEAK_CHILD,
                             std::string("STATIC_CHILD=") + HD_STATIC_CHILD});
  }
  std::vector<hdtest::Stored> Stored() {
    return WithDaemon() ? hdtest::List(daemon.socket).items : std::vector<hdtest::Stored>{};
  }
};

// Every exec chain users put in front of a program: the report and the output are of the pid's
// last program, named with what it was exec'd from; the command's status is passed on.
TEST_P(RunTest, FollowsTheCommandAcrossExec) {
  ASSERT_EQ(mkdir((dir + "/bin").c_str(), 0755), 0);
  ASSERT_EQ(mkdir((dir + "/versions").c_str(), 0755), 0);
  // A wrapper script, and a version-manager shim (pyenv's kind: a script on PATH that finds the
  // real program and execs it) whose target is itself an exec'ing script.
  std::ofstream(dir + "/wrap.sh") << "#!/bin/sh\nexport WRAPPED=1\nexec \"$@\"\n";
  std::ofstream(dir + "/versions/leak_child") << "#!/bin/bash\nexec \"$LEAK_CHILD\" \"$@\"\n";
  std::ofstream(dir + "/bin/leak_child")
      << "#!/usr/bin/env bash\nset -e\nexec \"$(dirname \"$0\")/../versions/leak_child\" \"$@\"\n";
  ASSERT_EQ(Shell("chmod +x wrap.sh versions/leak_child bin/leak_child").status, 0);
  const std::vector<std::pair<std::string, std::string>> chains = {
      {"env FOO=1 \"$LEAK_CHILD\"", "env"},
      {"nice \"$LEAK_CHILD\"", "nice"},
      {"sh -c 'exec \"$LEAK_CHILD\"'", "sh"},
      {"./wrap.sh \"$LEAK_CHILD\"", "wrap.sh"},
      // The shim: env runs bash on the script, which execs bash on the next one, which execs the
      // program; a script's process is named after the script.
      {"leak_child", "leak_child"},
  };
  for (const auto &[chain, first] : chains) {
    SCOPED_TRACE(chain);
    uint32_t before = Stored().size();
    ShellOutput o =
        Shell("heapdump run --show-reachable -o out.pb.gz -- " + chain + " || echo status=$?\n");
    EXPECT_NE(o.out.find("status=3"), std::string::npos) << o.out;
    // The leak check of the last program, classified: it went through its exit path.
    EXPECT_NE(o.out.find("\nleak check: "), std::string::npos) << o.out;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(
        o.out, m,
        std::regex(
            R"(heapdump: leak_child\[([0-9]+)\] \(exec'd from ([^)]+)\) exited with status 3)")))
        << o.out;
    EXPECT_EQ(m[2].str(), first) << o.out;
    EXPECT_NE(o.out.find("leak_small"), std::string::npos) << o.out;
    EXPECT_EQ(o.out.find("did not load"), std::string::npos) << o.out;
    std::string pid = m[1].str();
    if (WithDaemon()) {
      // The daemon keeps the earlier programs' snapshots as "exec", the last one's as "exit"
      // (which the last program stores from its exit path, so it may be stored before the exec
      // snapshot of the program before it).
      auto items = Stored();
      std::string of_pid;
      int execs = 0, exits = 0;
      for (size_t i = before; i < items.size(); i++) {
        if (std::to_string(items[i].pid) != pid) continue;
        of_pid += items[i].name + " ";
        execs += items[i].name == "exec";
        exits += items[i].name == "exit";
      }
      EXPECT_GE(execs, 1) << of_pid;
      EXPECT_EQ(exits, 1) << of_pid;
      EXPECT_EQ(execs + exits, static_cast<int>(std::count(of_pid.begin(), of_pid.end(), ' ')))
          << of_pid;
    } else {
      // The earlier programs' snapshots are in the run's directory.
      auto files = ListDir(dir + "/out.d");
      EXPECT_TRUE(std::any_of(files.begin(), files.end(), [&](const std::string &f) {
        return f.find("." + pid + ".exec.") != std::string::npos;
      }));
    }
    Shell("rm -rf out.pb.gz out.d");
  }
}

// A static program cannot load the library: said as soon as it exits, not after a long wait.
TEST_P(RunTest, ACommandThatNeverRegistersIsReportedAtOnce) {
  double start = Now();
  ShellOutput o = Shell("heapdump run -- \"$STATIC_CHILD\" || echo status=$?\n");
  double took = Now() - start;
  EXPECT_NE(o.out.find("status=4"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("did not load libheapdump.so"), std::string::npos) << o.out;
  // The daemon is asked (GetProcessState) whether the command registered.
  EXPECT_LT(took, 3.0) << o.out;
}

// --children chooses the descendants profiled; --interval snapshots cover exactly those.
TEST_P(RunTest, ChildrenChoosesWhichDescendantsAreProfiled) {
  ShellOutput none = Shell(
      "heapdump run --children=none -o none.pb.gz -- "
      "bash -c '\"$LEAK_CHILD\" | cat' || true\n"
      "ls none.d 2>/dev/null | wc -l\n");
  EXPECT_NE(none.out.find("heapdump: bash["), std::string::npos) << none.out;
  EXPECT_EQ(none.out.find("child process"), std::string::npos) << none.out;
  EXPECT_EQ(none.out.substr(none.out.size() - 2), "0\n") << none.out;

  ShellOutput o = Shell(
      "heapdump run --children=cat --interval 0.3 -o out.heapdump -- "
      "bash -c 'sleep 1.5 | cat'\n"
      "ls out.d 2>/dev/null || true\n");
  ASSERT_EQ(o.status, 0) << o.out;
  // The interval snapshot holds the chosen program alone: not the shell, not sleep.
  std::string report = Shell("heapdump report out.2.heapdump --top 1\n").out;
  EXPECT_TRUE(std::regex_search(report, std::regex(R"((^|\n)cat\[[0-9]+\]: )"))) << report;
  EXPECT_EQ(report.find("bash["), std::string::npos) << report;
  EXPECT_EQ(report.find("sleep["), std::string::npos) << report;
  if (!WithDaemon()) {
    EXPECT_TRUE(std::regex_search(o.out, std::regex(R"(\ncat\.[0-9]+\.exit\.[0-9]+\.heapdump\n)")))
        << o.out;
    EXPECT_EQ(o.out.find("sleep."), std::string::npos) << o.out;
    EXPECT_NE(o.out.find("1 child process: 1 snapshot in out.d/"), std::string::npos) << o.out;
  }
}

INSTANTIATE_TEST_SUITE_P(Collectors, RunTest, ::testing::Values(false, true),
                         [](const auto &info) { return info.param ? "daemon" : "embedded"; });

// The workflows whose children end in a race with the command's own exit, repeated: every
// process that registered has its exit snapshot written, in the run's directory, every time.
class RunChildrenTest : public ::testing::Test {
 protected:
  std::string dir = TempDir("children");
  RemoveWhenPassed cleanup{dir};
  ShellOutput Shell(const std::string &script) {
    return hdtest::RunShell(script, dir,
                            {"PATH=" + std::string(HD_BIN_DIRS) + ":/usr/bin:/bin",
                             "HEAPDUMP_SOCKET=" + dir + "/none.sock", "TMPDIR=" + dir,
                             "HOME=" + dir, std::string("LEAK_CHILD=") + HD_LEAK_CHILD});
  }
  void Repeat(const std::string &setup, const std::string &command, int runs) {
    std::vector<std::string> expected = WithDaemonKinds(setup, command);
    ASSERT_GE(expected.size(), 3u);
    for (int i = 0; i < runs; i++) {
      SCOPED_TRACE("run " + std::to_string(i));
      std::string out = "r" + std::to_string(i);
      ShellOutput o = Shell(setup + "heapdump run -o " + out + ".pb.gz -- " + command + "\n");
      ASSERT_EQ(o.status, 0) << o.out;
      auto files = ListDir(dir + "/" + out + ".d");
      EXPECT_EQ(Kinds(files), expected) << o.out;
      EXPECT_EQ(o.out.find("heapdump: lost "), std::string::npos)
          << o.out;  // processes still running
      size_t children = 0;
      for (const auto &k : expected) children += k.size() > 5 && k.substr(k.size() - 5) == ".exit";
      EXPECT_NE(o.out.find(std::to_string(children) + " child processes"), std::string::npos)
          << o.out;
      EXPECT_NE(o.out.find(std::to_string(files.size()) + " snapshots in " + out + ".d/"),
                std::string::npos)
          << o.out;
    }
  }
  // The kinds of snapshot ("cc1.exit") a daemon stores for one run of `command`, the command's
  // own exit snapshot aside: what every run with the embedded collector must write too.
  std::vector<std::string> WithDaemonKinds(const std::string &setup, const std::string &command) {
    hdtest::Collector daemon(dir + "/daemon");
    EXPECT_EQ(mkdir(daemon.dir.c_str(), 0700), 0);
    daemon.Start();
    ShellOutput o = Shell(setup + "HEAPDUMP_SOCKET=" + daemon.socket +
                          " heapdump run -o d.pb.gz -- " + command + " 2>&1\n");
    std::smatch m;
    EXPECT_TRUE(std::regex_search(o.out, m, std::regex(R"(heapdump: [^ ]+\[([0-9]+)\])"))) << o.out;
    std::string main_pid = m[1].str();
    // The daemon stores the children's exit snapshots as it sees them exit, which may be after
    // `run` returned; stopped, it stores every one it has seen or that exited meanwhile before
    // it leaves, and started again on the same storage it lists them all.
    daemon.Stop();
    daemon.Start();
    std::vector<std::string> kinds;
    for (const auto &s : hdtest::List(daemon.socket).items) {
      if (std::to_string(s.pid) == main_pid && s.name == "exit") continue;
      kinds.push_back(s.process_name + "." + s.name);
    }
    std::sort(kinds.begin(), kinds.end());
    daemon.Stop();
    rmdir(daemon.dir.c_str());
    return kinds;
  }
};

TEST_F(RunChildrenTest, MakeJ2KeepsEveryCompilerAndLinkerSnapshot) {
  std::ofstream(dir + "/a.c") << "int a(void) { return 1; }\n";
  std::ofstream(dir + "/b.c") << "int b(void) { return 2; }\n";
  std::ofstream(dir + "/main.c")
      << "int a(void);\nint b(void);\nint main(void) { return a() + b() - 3; }\n";
  std::ofstream(dir + "/Makefile") << "prog: a.o b.o main.o\n\tcc -o prog a.o b.o main.o\n"
                                      "%.o: %.c\n\tcc -c -o $@ $<\n";
  Repeat("rm -f *.o prog\n", "make -s -j2", 20);
}

TEST_F(RunChildrenTest, AFourStagePipelineKeepsEveryStage) {
  Repeat("", "bash -c '\"$LEAK_CHILD\" | cat | sort | wc -l'", 20);
}

}  // namespace
