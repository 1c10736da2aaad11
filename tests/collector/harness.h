// What the collector tests share: a real heapdump-collector daemon in a temporary directory, real
// programs under LD_PRELOAD, and clients speaking the protocol through the generated bindings.
#ifndef HEAPDUMP_TESTS_COLLECTOR_HARNESS_H
#define HEAPDUMP_TESTS_COLLECTOR_HARNESS_H

#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

extern "C" {
#include "heapdump/fidl/channel.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump_client.bindings.h"
}

namespace hdtest {

constexpr uid_t kSameUser = static_cast<uid_t>(-1);

std::string TempDir();
// Removes a test's directory at the end of the test if it passed (kept to look at if it failed).
// Declare it right after the directory, before what runs in it.
struct RemoveWhenPassed {
  const std::string &path;
  ~RemoveWhenPassed();
};
// Polls pred every 20 ms for up to `seconds`; true as soon as it holds.
bool WaitUntil(const std::function<bool()> &pred, double seconds = 20);
std::string ReadFile(const std::string &path);
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
  std::string Log() const { return ReadFile(log); }
};

// A program with piped stdin and stdout.
struct Program {
  pid_t pid = -1;
  int in = -1;
  FILE *out = nullptr;

  // With want_pid, only a child that got that pid runs argv (others are reaped and retried);
  // pid stays -1 if it could not be had.
  Program(const std::vector<std::string> &argv, const std::vector<std::string> &env,
          uid_t uid = kSameUser, gid_t gid = 0, pid_t want_pid = 0);
  ~Program();
  std::string ReadLine();
  void Send(const std::string &line);
  // Closes its stdin and reaps it; returns the wait status.
  int Finish();
  void Kill();
};

// The environment that instruments a program for the collector at socket.
std::vector<std::string> InstrumentedEnv(const std::string &socket, bool exit_snapshot = false);

struct ChildOptions {
  const char *snapshot_name = nullptr;  // stored at start when set
  bool exit_snapshot = false;
  std::vector<std::string> env;  // extra NAME=VALUE
  uid_t uid = kSameUser;
  gid_t gid = 0;
  std::string path = HD_CHILD;  // e.g. a link to it, for another process name
  pid_t pid = 0;                // when set, this pid (set up through ns_last_pid: root only)
  std::function<void(pid_t)> after_fork;  // runs before waiting for "ready"
};

// snapshot_child under LD_PRELOAD, stopped after "ready" until Finish().
struct Child {
  std::unique_ptr<Program> program;
  pid_t pid = -1;
  int snapshot_rc = 0;
  Child(const std::string &socket, const ChildOptions &options);
  Child(const std::string &socket, const char *snapshot_name, bool exit_snapshot = false);
  // Stores a named snapshot now; returns heapdump_take_named_snapshot's result.
  int Snapshot(const std::string &name);
  // Frees the worker's blocks and exits; expects status 0.
  void Finish();
  void Kill();
};

// heap_workload under LD_PRELOAD; the constructor returns once it printed "ready <pid>".
struct Workload {
  std::unique_ptr<Program> program;
  pid_t pid = -1;
  Workload(const std::string &socket, const std::vector<std::string> &args,
           bool exit_snapshot = false, std::vector<std::string> extra_env = {});
};

struct Result {
  hd_status status = HD_OK;
  uint32_t error = 0;
  hd_reassembler ra;
  Result() { hd_reassembler_init(&ra); }
  ~Result() { hd_reassembler_destroy(&ra); }
  const hd_snapshot *only() const { return ra.snapshot_count == 1 ? ra.snapshots[0] : nullptr; }
};

// A connection to the collector plus a fresh channel pair: ends[1] is passed with a request.
struct Call {
  int fd = -1;
  int ends[2] = {-1, -1};
  explicit Call(const std::string &socket);
  void SentTheirEnd();
  ~Call();
};

std::unique_ptr<Result> TakeLiveSnapshot(const std::string &socket,
                                         const heapdump_client_ProcessSelector *selector,
                                         bool with_contents = false, bool multi = false);
std::unique_ptr<Result> Download(const std::string &socket, uint32_t id);

struct Stored {
  uint32_t id;
  std::string name, process_name;
  uint64_t pid;
};
struct Listing {
  hd_status status = HD_OK;
  uint32_t error = 0;  // StoredSnapshotIteratorGetNextResult.err
  std::vector<Stored> items;
};
Listing List(const std::string &socket, const heapdump_client_ProcessSelector *selector = nullptr);
// The id of the only stored snapshot called name, or 0.
uint32_t StoredId(const Listing &listing, const std::string &name);

heapdump_client_ProcessSelector ByPid(pid_t pid);
heapdump_client_ProcessSelector ByName(const char *name);
// A selector with no variant this collector knows.
heapdump_client_ProcessSelector UnknownSelector();

// Blocks of a given size, and how many have a frame in `function` of binary (none if empty).
struct Site {
  size_t blocks = 0;
  size_t in_function = 0;
  std::string thread;
};
Site Blocks(const hd_snapshot *s, uint64_t size, const std::string &function,
            const std::string &binary = HD_CHILD);
// The function of `binary` a program address falls in, via the snapshot's regions ("" if none).
std::string FunctionAt(const hd_snapshot *s, uint64_t address, const std::string &binary);

constexpr uint32_t Error(heapdump_client_CollectorError e) { return static_cast<uint32_t>(e); }

}  // namespace hdtest

#endif
