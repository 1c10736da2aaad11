// A client of the collector for the end-to-end tests: the protocol's calls through the generated
// bindings, each on a fresh connection, with their results reassembled.
#ifndef HEAPDUMP_TESTS_COMMON_CLIENT_H
#define HEAPDUMP_TESTS_COMMON_CLIENT_H

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

extern "C" {
#include "heapdump/fidl/channel.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump_client.bindings.h"
}

namespace hdtest {

struct Result {
  hd_status status = HD_OK;
  uint32_t error = 0;
  hd_reassembler ra;
  Result() { hd_reassembler_init(&ra); }
  ~Result() { hd_reassembler_destroy(&ra); }
  const hd_snapshot *only() const { return ra.snapshot_count == 1 ? ra.snapshots[0] : nullptr; }
};

// A connection to the collector plus a fresh channel pair: ends[1] is passed with a request.
// The collector tells clients apart by the process that connected (SO_PEERCRED): a Call made
// with kAnotherClient is connected by a child forked for the connect alone, so that its
// requests are another client's than this process's.
enum AnotherClient { kAnotherClient };
struct Call {
  int fd = -1;
  int ends[2] = {-1, -1};
  explicit Call(const std::string &socket);
  Call(const std::string &socket, AnotherClient);
  void SentTheirEnd();
  ~Call();
};

// Sends TakeLiveSnapshot on call, handing over call.ends[1] as the receiver, and leaves the
// batches on call.ends[0] for the caller to read (or, for a test of a silent client, not).
hd_status RequestLiveSnapshot(Call &call, const heapdump_client_ProcessSelector *selector,
                              bool with_contents = false, bool multi = false);
std::unique_ptr<Result> TakeLiveSnapshot(const std::string &socket,
                                         const heapdump_client_ProcessSelector *selector,
                                         bool with_contents = false, bool multi = false);
std::unique_ptr<Result> Download(const std::string &socket, uint32_t id);

struct Stored {
  uint32_t id = 0;
  std::string name, process_name;
  uint64_t pid = 0;
  bool has_totals = false;  // taken_at_unix_ns, live_bytes and live_blocks all present
  uint64_t taken_at_unix_ns = 0, live_bytes = 0, live_blocks = 0, stored_bytes = 0;
};
struct Listing {
  hd_status status = HD_OK;
  uint32_t error = 0;  // StoredSnapshotIteratorGetNextResult.err
  std::vector<Stored> items;
};
Listing List(const std::string &socket, const heapdump_client_ProcessSelector *selector = nullptr);
// A two-way call's transport status and, when the collector refused, its CollectorError.
struct CallResult {
  hd_status status = HD_OK;
  uint32_t error = 0;
};
CallResult Delete(const std::string &socket, uint32_t id);

struct ProcessStatus {
  hd_status status = HD_OK;
  uint32_t error = 0;
  heapdump_client_ProcessState state = heapdump_client_ProcessState_PROCESS_STATE_UNSPECIFIED;
  uint32_t exit_snapshot_id = 0;
  std::string process_name;
  bool has_arm_failure = false;
  std::string arm_failure;
  uint64_t arm_failure_generation = 0;
};
ProcessStatus GetProcessState(const std::string &socket, pid_t pid);

// The id of the only stored snapshot called name, or 0.
uint32_t StoredId(const Listing &listing, const std::string &name);

heapdump_client_ProcessSelector ByPid(pid_t pid);
heapdump_client_ProcessSelector ByName(const char *name);
// A selector with no variant this collector knows.
heapdump_client_ProcessSelector UnknownSelector();

constexpr uint32_t Error(heapdump_client_CollectorError e) { return static_cast<uint32_t>(e); }

}  // namespace hdtest

#endif
