// The collector daemon as users run it: started without options (it detaches), found through
// its default socket and pid file, stopped with --stop, run by its systemd unit, installed with
// `cmake --install`. The README's quick start runs here verbatim, through bash.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "client.h"
#include "listener.h"
#include "process.h"

namespace {

using hdtest::ReadFile;
using hdtest::RemoveWhenPassed;
using hdtest::TempDir;
using hdtest::WaitUntil;

using Output = hdtest::ShellOutput;

double Now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

// The daemons detach from the shells that start them; this test is their subreaper, so they
// become its children, and one that exited is reaped here rather than seen as a zombie.
bool Alive(pid_t pid) {
  if (pid <= 0) return false;
  waitpid(pid, nullptr, WNOHANG);
  return kill(pid, 0) == 0;
}

// A user's shell: HOME and XDG_RUNTIME_DIR inside the test's directory, the two programs on
// PATH, no HEAPDUMP_SOCKET (the default socket is used). stdout and stderr together.
class DaemonTest : public ::testing::Test {
 protected:
  std::string dir = TempDir("daemon");
  RemoveWhenPassed cleanup{dir};
  std::string home = dir + "/home", runtime = dir + "/xdg", bin = dir + "/bin";
  std::string socket = runtime + "/heapdump/collector.sock";
  std::string pid_file = runtime + "/heapdump/collector.pid";

  void SetUp() override {
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    ASSERT_EQ(mkdir(home.c_str(), 0700), 0);
    ASSERT_EQ(mkdir(runtime.c_str(), 0700), 0);
    ASSERT_EQ(mkdir(bin.c_str(), 0755), 0);
    ASSERT_EQ(symlink(HD_CLI, (bin + "/heapdump").c_str()), 0);
    ASSERT_EQ(symlink(HD_COLLECTOR, (bin + "/heapdump-collector").c_str()), 0);
  }
  void TearDown() override {
    pid_t pid = DaemonPid();
    if (pid != getpid() && Alive(pid)) kill(pid, SIGKILL);  // no daemon outlives a failed test
  }
  pid_t DaemonPid() const { return atoi(ReadFile(pid_file).c_str()); }

  Output Shell(const std::string &script) const {
    return hdtest::RunShell(
        script, dir,
        {"HOME=" + home, "XDG_RUNTIME_DIR=" + runtime, "PATH=" + bin + ":/usr/bin:/bin",
         std::string("LIB=") + HD_PRELOAD_LIB, std::string("LEAKY=") + HD_LEAKY,
         std::string("LEAK_CHILD=") + HD_LEAK_CHILD, std::string("REACH=") + HD_REACH_CHILD});
  }
};

// A snapshot whose file the collector cannot remove (its storage went read-only) is reported
// as not deleted and stays stored and listed, rather than coming back after a restart; once the
// storage is writable again it deletes. The read-only storage is a read-only bind mount in a
// mount namespace of the test's own, so this needs root.
TEST_F(DaemonTest, ADeleteTheStorageRefusesKeepsTheSnapshot) {
  if (geteuid() != 0 || system("unshare -m true 2>/dev/null") != 0) {
    GTEST_SKIP() << "needs root and mount namespaces, for a read-only bind mount";
  }
  Output o = Shell(
      "unshare -m bash -e -c '\n"
      "mkdir -m 700 st && mount --bind st st\n"
      "heapdump-collector --storage \"$PWD/st\"\n"
      "heapdump run -o out.heapdump -- \"$LEAK_CHILD\" >/dev/null 2>&1 || true\n"
      "mount -o remount,bind,ro st\n"
      "heapdump delete 1 || echo \"delete status $?\"\n"
      "heapdump list\n"
      "mount -o remount,bind,rw st\n"
      "heapdump delete 1\n"
      "heapdump list\n"
      "heapdump-collector --stop\n"
      "'\n");
  ASSERT_EQ(o.status, 0) << o.out;
  EXPECT_NE(o.out.find("heapdump: snapshot 1 is still stored: the collector could not remove its "
                       "file"),
            std::string::npos)
      << o.out;
  EXPECT_NE(o.out.find("delete status 1"), std::string::npos) << o.out;
  EXPECT_TRUE(std::regex_search(o.out, std::regex(R"(delete status 1\n(.*\n)*1 +exit +)")))
      << "still listed: " << o.out;
  EXPECT_NE(o.out.find("deleted 1 snapshot\n"), std::string::npos) << o.out;
}

// The README's "With a collector daemon" lines as written, with the demo program as the server
// (it stores a named snapshot through the API) and `sleep` as a program that keeps running.
TEST_F(DaemonTest, ReadmeQuickStartWorksWithTheDetachedDaemon) {
  Output o = Shell(
      "heapdump-collector\n"
      "heapdump run -- \"$LEAKY\"\n"
      "LD_PRELOAD=$LIB sleep 30 &\n"
      "for i in $(seq 100); do heapdump list >/dev/null && "
      "  heapdump snapshot --name sleep -o now.pb.gz 2>/dev/null && break; sleep 0.1; done\n"
      "heapdump snapshot --name sleep --contents -o now.dartheap\n"
      "heapdump list; heapdump download 1 -o stored.pb.gz\n"
      "kill %1\n");
  ASSERT_EQ(o.status, 0) << o.out;
  // The daemon detached and said where it is; its pid file names a live process.
  EXPECT_NE(o.out.find("heapdump-collector: pid "), std::string::npos) << o.out;
  pid_t pid = DaemonPid();
  ASSERT_TRUE(Alive(pid)) << o.out;
  // The API's named snapshot reached it, and so did the exit snapshot, each stored.
  EXPECT_NE(o.out.find("heapdump_take_named_snapshot(\"after-build\") = 0"), std::string::npos)
      << o.out;
  EXPECT_TRUE(std::regex_search(o.out, std::regex(R"(\n1 +after-build +leaky\[)"))) << o.out;
  EXPECT_TRUE(std::regex_search(o.out, std::regex(R"(\n2 +exit +leaky\[)"))) << o.out;
  EXPECT_NE(o.out.find("leaky["), std::string::npos) << o.out;
  EXPECT_EQ(o.out.find("did not load"), std::string::npos) << o.out;
  struct stat st;
  EXPECT_EQ(stat((dir + "/now.dartheap").c_str(), &st), 0) << o.out;
  EXPECT_EQ(stat((dir + "/stored.pb.gz").c_str(), &st), 0) << o.out;
  // It logs to the documented file, not to the terminal that started it.
  std::string log = ReadFile(runtime + "/heapdump/collector.log");
  EXPECT_NE(log.find("stored snapshot 2 \"exit\" of leaky"), std::string::npos) << log;

  double start = Now();
  Output stop = Shell("heapdump-collector --stop\n");
  EXPECT_EQ(stop.status, 0) << stop.out;
  EXPECT_LT(Now() - start, 5.0);
  EXPECT_FALSE(Alive(pid));
  EXPECT_NE(access(pid_file.c_str(), F_OK), 0) << "pid file left behind";
  EXPECT_NE(access(socket.c_str(), F_OK), 0) << "socket left behind";
  // Stopping again: nothing runs, a distinct status.
  EXPECT_EQ(Shell("heapdump-collector --stop\n").status, 3);
}

// The README's "Using it" blocks, line by line as written, with a program and a server in the
// places of ./your-program and ./your-server (the server starts the demo program, which stores
// a named snapshot, then stays; its sleep must not hold the test's output pipe open). Only the
// snapshot line is retried until the server registered, as a person would; `go tool pprof` is not
// run (Go is not a dependency).
TEST_F(DaemonTest, ReadmeUsingItRunsAsWritten) {
  std::string readme = ReadFile(std::string(HD_SOURCE_DIR) + "/README.md");
  size_t start = readme.find("## Using it\n");
  ASSERT_NE(start, std::string::npos);
  std::string section = readme.substr(start, readme.find("\n## ", start + 1) - start);
  std::string script = "trap 'kill %1 2>/dev/null || true' EXIT\n";
  std::istringstream lines(section);
  int commands = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("    ", 0) != 0) continue;
    line = std::regex_replace(line.substr(4), std::regex(" +#.*"), "");
    if (line.rfind("go tool pprof", 0) == 0) continue;
    commands++;
    if (line.find("heapdump snapshot") == 0) {
      script += "for i in $(seq 100); do " + line + " 2>/dev/null && break; sleep 0.1; done\n";
    }
    // run passes on its command's status, and your-program exits with 3.
    script += line + (line.find("heapdump run") == 0 ? " || test $? = 3" : "") + "\n";
  }
  ASSERT_EQ(commands, 10) << section;
  ASSERT_EQ(Shell("mkdir -p build-release/instrumentation\n"
                  "ln -s \"$LIB\" build-release/instrumentation/libheapdump.so\n"
                  "cp \"$LEAK_CHILD\" your-program\n"
                  "printf '#!/bin/sh\\nexec 2>/dev/null\\n\"$LEAKY\"\\nsleep 30 >/dev/null\\n' > "
                  "your-server\n"
                  "chmod +x your-server\n")
                .status,
            0);
  Output o = Shell(script);
  EXPECT_EQ(o.status, 0) << script << o.out;
  EXPECT_TRUE(
      std::regex_search(o.out, std::regex(R"(your-program\[[0-9]+\] exited with status 3)")))
      << o.out;
  EXPECT_TRUE(std::regex_search(o.out, std::regex(R"(\n1 +after-build +leaky\[)"))) << o.out;
  EXPECT_NE(o.out.find("deleted 1 snapshot\n"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("\nleak check: "), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("heapdump-collector: stopped pid"), std::string::npos) << o.out;
  // The daemon's terminal shows its one line; what it logs while starting is in its log.
  EXPECT_EQ(o.out.find("info: listening"), std::string::npos) << o.out;
  struct stat st;
  EXPECT_EQ(stat((dir + "/now.dartheap").c_str(), &st), 0) << o.out;
  EXPECT_EQ(stat((dir + "/stored.pb.gz").c_str(), &st), 0) << o.out;
  const std::string report = ReadFile(dir + "/report.html"), now = ReadFile(dir + "/now.html");
  EXPECT_NE(report.find("\"name\":\"your-program\""), std::string::npos) << o.out;
  EXPECT_NE(now.find("\"name\":\"your-server\""), std::string::npos) << o.out;
}

// docs/tools.md's "Finding a slow leak in a server" lines as written, with a server that grows
// one site and churns another for about 7 s in the place of ./my-server (a copy of the program
// under that name, so that its process is called my-server). Its `heapdump leaks` line asks a
// collector daemon about the server running again, this time under LD_PRELOAD.
TEST_F(DaemonTest, DocsSlowLeakWorkflowRunsAsWritten) {
  std::string doc = ReadFile(std::string(HD_SOURCE_DIR) + "/docs/tools.md");
  size_t start = doc.find("#### Finding a slow leak in a server\n");
  ASSERT_NE(start, std::string::npos);
  std::string section = doc.substr(start, doc.find("\n#", start + 1) - start);
  std::string script = "set -e\n";
  std::istringstream lines(section);
  int commands = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("    ", 0) != 0) continue;
    line = std::regex_replace(line.substr(4), std::regex(" +#.*"), "");
    commands++;
    if (line.rfind("go tool pprof", 0) == 0) {
      script += "if command -v go >/dev/null; then " + line + "; fi\n";
    } else if (line.rfind("heapdump leaks", 0) == 0) {
      script +=
          "heapdump-collector\nLD_PRELOAD=$LIB ./my-server > /dev/null 2>&1 &\n"
          "for i in $(seq 100); do "
          "heapdump snapshot --name my-server -o probe.pb.gz 2>/dev/null && break; "
          "sleep 0.1; done\n" +
          line + "\nwait\nheapdump-collector --stop\n";
    } else {
      script += line + "\n";
    }
  }
  ASSERT_EQ(commands, 5) << section;
  ASSERT_EQ(
      Shell(std::string("mkdir srv && cp ") + HD_GROWTH_CHILD +
            " srv/my-server\nprintf '#!/bin/sh\\nexec \"$PWD/srv/my-server\" serve 45 150\\n' "
            "> my-server\nchmod +x my-server\n")
          .status,
      0);
  Output o = Shell(script);
  ASSERT_EQ(o.status, 0) << script << o.out;
  // The growing site leads, by whole requests (10 blocks of 1000 bytes); the churning one
  // replaced its blocks without growing.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      o.out, m,
      std::regex(
          R"(SITE\n +\+([0-9]+) +\+([0-9]+) +([0-9]+) +([0-9]+) +0 +0  remember_request\n)")))
      << o.out;
  EXPECT_GT(std::stol(m[1]), 0) << o.out;
  EXPECT_EQ(std::stol(m[1]), std::stol(m[3])) << o.out;
  EXPECT_EQ(std::stol(m[1]), 1000 * std::stol(m[2])) << o.out;
  EXPECT_TRUE(std::regex_search(
      o.out,
      std::regex(R"(\n +[-+][0-9]+ +[-+][0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+  churn_buffers\n)")))
      << o.out;
  // The server keeps what it grows in a cache: still reachable, nothing lost.
  EXPECT_TRUE(std::regex_search(
      o.out, std::regex(R"(my-server\[[0-9]+\]: .*\n(resident .*\n)?(timeline: .*\n)?)"
                        R"(leak check: 0 bytes in 0 blocks )"
                        R"(definitely_lost, 0 bytes in 0 blocks indirectly_lost)")))
      << o.out;
  struct stat st;
  EXPECT_EQ(stat((dir + "/growth.pb.gz").c_str(), &st), 0) << o.out;
  if (system("command -v go >/dev/null 2>&1") == 0) {
    EXPECT_TRUE(
        std::regex_search(o.out, std::regex(R"(\n +[0-9.]+[kK]?B +[0-9.]+% .*remember_request\n)")))
        << o.out;
  }
}

// The heapdump lines of docs/tools.md's part that starts at `heading` (up to the next line
// starting with `until`), indented by `indent` spaces, as a script run with the detached daemon
// and a program with a known heap (tests/tools/reach_child.cc) as my-server, waiting for its
// stdin to close. *commands: how many lines were taken.
std::string WithReachServer(const std::string &heading, const std::string &until, size_t indent,
                            int *commands) {
  std::string doc = ReadFile(std::string(HD_SOURCE_DIR) + "/docs/tools.md");
  size_t start = doc.find(heading);
  if (start == std::string::npos) return "";
  std::string section = doc.substr(start, doc.find(until, start + 1) - start);
  std::string script =
      "set -e\nheapdump-collector\ncp \"$REACH\" my-server\nmkfifo server.in\n"
      "LD_PRELOAD=$LIB ./my-server < server.in > server.out 2>&1 &\n"
      "exec 4> server.in\n"  // the server runs until this closes
      "for i in $(seq 100); do grep -q ready server.out && break; sleep 0.1; done\n";
  std::istringstream lines(section);
  *commands = 0;
  const std::string prefix = std::string(indent, ' ') + "heapdump ";
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(prefix, 0) != 0) continue;
    script += std::regex_replace(line.substr(indent), std::regex(" +#.*"), "") + "\n";
    (*commands)++;
  }
  return script + "exec 4>&-\nwait\nheapdump-collector --stop\n";
}

// docs/tools.md's leak check lines (under `report`) as written.
TEST_F(DaemonTest, DocsLeakCheckRunsAsWritten) {
  int commands = 0;
  std::string script = WithReachServer("- **Leak check.**", "\n- ", 6, &commands);
  ASSERT_EQ(commands, 3) << script;
  Output o = Shell(script);
  ASSERT_EQ(o.status, 0) << script << o.out;
  EXPECT_NE(o.out.find("leak check: 3064 bytes in 2 blocks definitely_lost, 3315 bytes in 7 blocks "
                       "indirectly_lost"),
            std::string::npos)
      << o.out;
  EXPECT_TRUE(
      std::regex_search(o.out, std::regex(R"(DEFINITELY LOST\n(.*\n)* +64 +1  leak_basket\(\))")))
      << o.out;
  EXPECT_TRUE(
      std::regex_search(o.out, std::regex(R"(STILL REACHABLE\n(.*\n)* +4100 +1  keep_global\(\))")))
      << o.out;
}

// docs/tools.md's `heapdump leaks` lines as written.
TEST_F(DaemonTest, DocsLeaksRunsAsWritten) {
  int commands = 0;
  std::string script = WithReachServer("### `heapdump leaks", "\n#", 4, &commands);
  ASSERT_EQ(commands, 2) << script;
  Output o = Shell(script);
  ASSERT_EQ(o.status, 0) << script << o.out;
  EXPECT_TRUE(std::regex_search(
      o.out, std::regex(R"(DEFINITELY LOST\n(.*\n)* +64 +1 +[0-9.]+s  leak_basket\n)")))
      << o.out;
  EXPECT_NE(o.out.find("{\"name\":\"leak_basket\",\"category\":\"definitely_lost\","),
            std::string::npos)
      << o.out;
}

// docs/tools.md's `heapdump convert` lines as written, of a snapshot of a running server.
TEST_F(DaemonTest, DocsConvertRunsAsWritten) {
  int commands = 0;
  std::string script = WithReachServer("### `heapdump convert", "\n#", 4, &commands);
  ASSERT_EQ(commands, 3) << script;
  script.insert(script.find("heapdump convert"),
                "heapdump snapshot --name my-server --contents -o now.heapdump\n");
  Output o = Shell(script + "gzip -t now.pb.gz\nhead -c 8 now.dartheap | od -c\ncat now.folded\n");
  ASSERT_EQ(o.status, 0) << script << o.out;
  EXPECT_NE(o.out.find("wrote now.pb.gz"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("wrote now.dartheap"), std::string::npos) << o.out;
  // Each folded line: a stack, root first, and its live bytes.
  EXPECT_TRUE(std::regex_search(o.out, std::regex(R"(\n[^\n ]*;leak_basket[^\n ]* 64\n)")))
      << o.out;
}

// The CLI's memory for a snapshot with contents is a small multiple of the snapshot, whatever
// the format: the contents go through a temporary file, not RAM (a 5 MB process's contents
// snapshot once took 1.05 GB). python3 holds 64 MiB in 65,536 blocks of 1 KiB; each command's
// peak RSS is its own (measured by python3 around that one command).
TEST_F(DaemonTest, ASnapshotWithContentsTakesMemoryOfItsOwnSize) {
  const std::string measure =
      "peak() { python3 -c 'import resource, subprocess, sys\n"
      "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
      "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)' \"$@\"; }\n";
  Output o = Shell("set -e\nheapdump-collector\nmkfifo hold.in\n" + measure +
                   "LD_PRELOAD=$LIB python3 -c 'import sys\n"
                   "kept = [bytes(1024) for _ in range(65536)]\n"
                   "print(\"ready\", flush=True)\nsys.stdin.read()' < hold.in > hold.out &\n"
                   "exec 4> hold.in\n"
                   "for i in $(seq 100); do grep -q ready hold.out && break; sleep 0.1; done\n"
                   "echo raw $(peak heapdump snapshot --pid $! --contents -o now.heapdump)\n"
                   "echo dartheap $(peak heapdump snapshot --pid $! --contents -o now.dartheap)\n"
                   "echo leaks $(peak heapdump leaks --pid $!)\n"
                   "echo report $(peak heapdump report now.heapdump)\n"
                   "echo size $(stat -c %s now.heapdump)\n"
                   "exec 4>&-\nwait\nheapdump-collector --stop\n");
  ASSERT_EQ(o.status, 0) << o.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(o.out, m, std::regex(R"(size ([0-9]+))"))) << o.out;
  EXPECT_GT(std::stoull(m[1].str()), 64ull << 20) << "the snapshot carries the contents";
  for (const char *command : {"raw", "dartheap", "leaks", "report"}) {
    ASSERT_TRUE(std::regex_search(o.out, m, std::regex(std::string(command) + " ([0-9]+)\n")))
        << command << "\n"
        << o.out;
    const unsigned long long peak_kb = std::stoull(m[1].str());
    printf("%s: peak RSS %llu KiB for 64 MiB of contents\n", command, peak_kb);
#ifndef HD_TOOLS_SANITIZED  // a sanitizer's shadow and quarantine are memory of their own
    EXPECT_LT(peak_kb, 3 * 64 * 1024 + 64 * 1024) << command << "\n" << o.out;
#endif
  }
}

// docs/tools.md's HTML report lines as written: `run --html` with the detached daemon (the demo
// program as ./my-program), `snapshot -o now.html` of a running server, and `report` and `diff`
// of the files the slow-leak workflow writes (made first, with a growing server). Each page
// holds its snapshot's data; what the browser shows of them is cli_test's.
TEST_F(DaemonTest, DocsHtmlReportRunsAsWritten) {
  ASSERT_EQ(Shell(std::string("cp \"$LEAKY\" my-program\nmkdir srv && cp ") + HD_GROWTH_CHILD +
                  " srv/growth\nheapdump run --interval 0.2 -o server.heapdump -- srv/growth "
                  "serve 40 50 > /dev/null 2>&1\n")
                .status,
            0);
  int commands = 0;
  std::string script = WithReachServer("### The HTML report", "\n#", 4, &commands);
  ASSERT_EQ(commands, 4) << script;
  Output o = Shell(script);
  ASSERT_EQ(o.status, 0) << script << o.out;
  for (const auto &[page, process] :
       std::vector<std::pair<std::string, std::string>>{{"report.html", "my-program"},
                                                        {"now.html", "my-server"},
                                                        {"server.html", "growth"},
                                                        {"growth.html", "growth"}}) {
    const std::string html = ReadFile(dir + "/" + page);
    EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u) << page;
    EXPECT_NE(html.find("\"format\":\"heapdump-html\""), std::string::npos) << page;
    EXPECT_NE(html.find("\"name\":\"" + process + "\""), std::string::npos) << page;
    EXPECT_NE(html.find("\"t_ms\":["), std::string::npos) << page << ": a timeline";
  }
  EXPECT_NE(ReadFile(dir + "/growth.html").find("\"kind\":\"diff\""), std::string::npos);
  EXPECT_NE(ReadFile(dir + "/report.html").find("\"command_line\":\"./my-program\""),
            std::string::npos);
  EXPECT_NE(ReadFile(dir + "/report.html").find("\"definitely_lost\":{\"bytes\":56,"),
            std::string::npos)
      << "the demo's leak check";
}

TEST_F(DaemonTest, StartReportsErrorsOnTheTerminalAndAStalePidFileIsNotTrusted) {
  ASSERT_EQ(Shell("heapdump-collector\n").status, 0);
  pid_t pid = DaemonPid();
  // A second one refuses, saying why, on the terminal.
  Output again = Shell("heapdump-collector\n");
  EXPECT_EQ(again.status, 1) << again.out;
  EXPECT_NE(again.out.find("already listening"), std::string::npos) << again.out;
  EXPECT_TRUE(Alive(pid));
  ASSERT_EQ(Shell("heapdump-collector --stop\n").status, 0);
  // A pid file nobody holds (a daemon killed with SIGKILL leaves one) names no collector, even
  // when its pid is alive: this test's own.
  std::ofstream(pid_file) << getpid() << "\n";
  Output stale = Shell("heapdump-collector --stop\n");
  EXPECT_EQ(stale.status, 3) << stale.out;
  EXPECT_NE(stale.out.find("stale"), std::string::npos) << stale.out;
}

// SIGTERM ends the daemon within a few seconds even while a client that never acknowledges a
// batch holds a snapshot stream open.
TEST_F(DaemonTest, StopDoesNotWaitForAStalledClient) {
  ASSERT_EQ(Shell("heapdump-collector\n").status, 0);
  pid_t pid = DaemonPid();
  hdtest::Program server({"/bin/sleep", "30"}, hdtest::InstrumentedEnv(socket));
  auto by_pid = hdtest::ByPid(server.pid);
  ASSERT_TRUE(WaitUntil([&] { return hdtest::TakeLiveSnapshot(socket, &by_pid)->only(); }));
  hdtest::Call stalled(socket);
  heapdump_client_CollectorTakeLiveSnapshotRequest req =
      heapdump_client_CollectorTakeLiveSnapshotRequest_init_zero;
  req.has_process_selector = true;
  req.process_selector = by_pid;
  req.has_receiver = true;
  req.receiver = {true, 0};
  hd_message msg;
  ASSERT_EQ(hd_fidl_collector_take_live_snapshot(stalled.fd, &msg, &req, &stalled.ends[1], 1),
            HD_OK);
  stalled.SentTheirEnd();
  usleep(300 * 1000);  // the first batch is sent and waits for an acknowledgement never given
  double start = Now();
  Output stop = Shell("heapdump-collector --stop\n");
  EXPECT_EQ(stop.status, 0) << stop.out;
  EXPECT_LT(Now() - start, 6.0) << stop.out;
  EXPECT_FALSE(Alive(pid));
  server.Kill();
}

// A collector that accepted the connection but never answers (here: stopped with SIGSTOP, and a
// socket that listens but is no collector) makes every call give up with status 7 after
// --timeout, and instrumented programs go on after their bounded waits.
TEST_F(DaemonTest, NothingHangsOnACollectorThatDoesNotAnswer) {
  ASSERT_EQ(Shell("heapdump-collector\n").status, 0);
  pid_t pid = DaemonPid();
  ASSERT_EQ(Shell("heapdump run -- \"$LEAK_CHILD\" || true\n").status, 0);  // stores snapshot 1
  ASSERT_EQ(kill(pid, SIGSTOP), 0);
  for (const char *call : {"list", "snapshot --pid 1", "download 1 -o x.pb.gz", "list --json"}) {
    double start = Now();
    Output o = Shell(std::string("heapdump ") + call + " --timeout 1\n");
    EXPECT_EQ(o.status, 7) << call << ": " << o.out;
    EXPECT_NE(o.out.find("did not"), std::string::npos) << call << ": " << o.out;
    EXPECT_LT(Now() - start, 5.0) << call;
  }
  double start = Now();  // the default timeout
  EXPECT_EQ(Shell("heapdump list\n").status, 7);
  EXPECT_LT(Now() - start, 15.0);
  // The library's waits are bounded too: the program runs, its named snapshot fails.
  start = Now();
  Output leaky = Shell("LD_PRELOAD=$LIB \"$LEAKY\"\n");
  EXPECT_EQ(leaky.status, 0) << leaky.out;
  EXPECT_NE(leaky.out.find("heapdump_take_named_snapshot(\"after-build\") = -3"), std::string::npos)
      << leaky.out;
  EXPECT_LT(Now() - start, 30.0);
  ASSERT_EQ(kill(pid, SIGCONT), 0);
  EXPECT_EQ(Shell("heapdump list --timeout 1\n").status, 0);
  EXPECT_EQ(Shell("heapdump-collector --stop\n").status, 0);

  // Something else listens at the socket and never accepts.
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", socket.c_str());
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr *>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  start = Now();
  Output o = Shell("heapdump list --timeout 1 || echo status=$?\n");
  EXPECT_NE(o.out.find("status=7"), std::string::npos) << o.out;
  EXPECT_LT(Now() - start, 5.0);
  close(fd);
}

// The systemd user unit shipped in the tree, run as systemd would: its ExecStart with %t
// expanded, in the foreground; SIGTERM (systemd's stop) ends it cleanly.
TEST_F(DaemonTest, SystemdUnitServesTheDefaultSocket) {
  std::string unit =
      ReadFile(std::string(HD_SOURCE_DIR) + "/collector/systemd/heapdump-collector.service");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(unit, m, std::regex("\nExecStart=(\\S+)( [^\n]*)\n"))) << unit;
  EXPECT_EQ(m[1].str(), "/usr/local/bin/heapdump-collector");
  std::string args = std::regex_replace(m[2].str(), std::regex("%t"), runtime);
  Output o =
      Shell("heapdump-collector" + args +
            " &\n"
            "for i in $(seq 100); do heapdump list >/dev/null 2>&1 && break; sleep 0.1; done\n"
            "heapdump run -- \"$LEAK_CHILD\" || true\n"
            "heapdump list\n"
            "kill -TERM %1; wait %1\n");
  EXPECT_EQ(o.status, 0) << o.out;
  EXPECT_TRUE(std::regex_search(o.out, std::regex(R"(\n1 +exit +leak_child\[)"))) << o.out;
  EXPECT_NE(access(socket.c_str(), F_OK), 0);
}

#ifdef HD_CMAKE_COMMAND
// The documented install step, then the installed programs used from the install tree only.
TEST_F(DaemonTest, InstalledTreeRunsAndShipsTheUnit) {
  std::string prefix = dir + "/prefix";
  std::string install = std::string(HD_CMAKE_COMMAND) + " --install " + HD_BUILD_DIR +
                        " --prefix " + prefix + " >/dev/null\n";
  Output o = Shell(install + "PATH=" + prefix +
                   "/bin:/usr/bin:/bin\n"
                   "heapdump run --show-reachable -- \"$LEAK_CHILD\" || test $? = 3\n"
                   "grep ExecStart " +
                   prefix + "/share/systemd/user/heapdump-collector.service\n");
  EXPECT_EQ(o.status, 0) << o.out;
  EXPECT_NE(o.out.find("leak_small"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("\nleak check: "), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("ExecStart=" + prefix + "/bin/heapdump-collector --foreground"),
            std::string::npos)
      << o.out;
}
#endif

}  // namespace
