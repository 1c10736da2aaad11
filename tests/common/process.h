// Processes the end-to-end tests run for real: a heapdump-collector daemon in a temporary
// directory, and programs with piped stdin and stdout, optionally under LD_PRELOAD. Built with
// HD_COLLECTOR and HD_PRELOAD_LIB (the paths of the daemon and of libheapdump.so) defined.
#ifndef HEAPDUMP_TESTS_COMMON_PROCESS_H
#define HEAPDUMP_TESTS_COMMON_PROCESS_H

#include <sys/types.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace hdtest {

constexpr uid_t kSameUser = static_cast<uid_t>(-1);

// A new directory /tmp/hd-PREFIX-XXXXXX.
std::string TempDir(const std::string &prefix = "test");
// Removes a test's directory at the end of the test if it passed (kept to look at if it failed).
// Declare it right after the directory, before what runs in it.
struct RemoveWhenPassed {
  const std::string &path;
  ~RemoveWhenPassed();
};
// Polls pred every 20 ms for up to `seconds`; true as soon as it holds.
bool WaitUntil(const std::function<bool()> &pred, double seconds = 20);
// A count once it has stopped moving (the same for half a second; at most 25 s): of a daemon's
// descriptors or threads after the work that changed them.
size_t Settled(const std::function<size_t()> &count);
std::string ReadFile(const std::string &path);
void WriteFile(const std::string &path, const std::string &bytes);
bool Exists(const std::string &path);
// The lines of text, without their newlines.
std::vector<std::string> Lines(const std::string &text);
// The names of the files in dir that start with prefix.
std::vector<std::string> Glob(const std::string &dir, const std::string &prefix);
// Switches the calling process (a fork child) to uid and its primary group; false on failure.
bool BecomeUser(uid_t uid, gid_t gid);

// A heapdump-collector daemon; its stderr goes to `log` (appended across restarts).
struct Collector {
  std::string dir, socket, storage, log;
  std::vector<std::string> args;  // extra options, e.g. {"--max-stored", "2"}
  std::vector<std::string> env;   // extra NAME=VALUE for its environment
  uid_t uid = kSameUser;          // run as this user (with gid) when set
  gid_t gid = 0;
  pid_t pid = -1;

  explicit Collector(const std::string &base);
  ~Collector();
  // Starts it and waits until it accepts connections.
  void Start();
  // Signals it and reaps it; after SIGTERM it must exit with status 0.
  void Stop(int sig = 15);
  // Its open descriptors, "N -> target".
  std::vector<std::string> Fds() const;
  // The descriptor count once it has stopped changing (connections just closed by a client,
  // streams just finished, are gone by then).
  size_t SettledFdCount() const;
  // Its peak resident set (VmHWM) in KiB since it started or since the last ResetPeakRss().
  size_t PeakRssKb() const;
  void ResetPeakRss() const;
  std::string Log() const { return ReadFile(log); }
};

// Asks for a Program whose environment is exactly the env given (not the test's plus env) and
// that inherits no descriptor beyond its stdin and stdout: what it opens is then all its own.
struct Isolated {};

// A program with piped stdin and stdout.
struct Program {
  pid_t pid = -1;
  int in = -1;
  FILE *out = nullptr;

  // The test's environment plus env. With want_pid, only a child that got that pid runs argv
  // (others are reaped and retried); pid stays -1 if it could not be had.
  Program(const std::vector<std::string> &argv, const std::vector<std::string> &env,
          uid_t uid = kSameUser, gid_t gid = 0, pid_t want_pid = 0);
  Program(Isolated, const std::vector<std::string> &argv, const std::vector<std::string> &env);
  ~Program();
  std::string ReadLine();
  // Its output up to and including the line `line` (or all of it, if that never comes).
  std::string ReadThrough(const std::string &line);
  void Send(const std::string &line);
  // Closes its stdin, reads the rest of its output into *rest (if given) and reaps it; returns
  // the wait status.
  int Finish(std::string *rest = nullptr);
  void Kill();

 private:
  void Start(const std::vector<std::string> &argv, const std::vector<std::string> &env,
             bool isolated, uid_t uid, gid_t gid, pid_t want_pid);
};

// What a shell script printed (stdout and stderr together) and its exit status (128+N if a
// signal N ended it).
struct ShellOutput {
  int status = -1;
  std::string out;
};
// Runs script with `bash -e` in cwd with exactly the environment env (NAME=VALUE), as a user's
// shell would run the lines of the documentation.
ShellOutput RunShell(const std::string &script, const std::string &cwd,
                     const std::vector<std::string> &env);

// A TCP port nothing listens on now, on 127.0.0.1 (for a server the test starts, which must be
// told one); -1, with a failed expectation, if none could be had.
int FreePort();

// The environment that instruments a program for the collector at socket.
std::vector<std::string> InstrumentedEnv(const std::string &socket, bool exit_snapshot = false);

}  // namespace hdtest

#endif
