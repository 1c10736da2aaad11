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
#include "client.h"
#include "heapdump/contract/shm_layout.h"
#include "process.h"

namespace hdtest {

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

// A process's memfd named `name` (through /proc: same user or root), opened for reading and
// writing; -1 if it has none.
int OpenTable(pid_t pid, const std::string &name);

// A process's live allocations table mapped read-write, as a hostile or dying writer sees it.
struct MappedTable {
  explicit MappedTable(pid_t pid);
  ~MappedTable();
  MappedTable(const MappedTable &) = delete;
  MappedTable &operator=(const MappedTable &) = delete;
  bool ok() const { return header != nullptr; }
  uint32_t *Seq(uint64_t slot) const;
  hd_alloc_node *Node(uint32_t link) const;  // link = node index + 1
  // Locks or unlocks a sequence slot the way a writer does.
  void SetSlotLocked(uint64_t slot, bool locked) const;
  hd_alloc_header *header = nullptr;
  size_t size = 0;
};

}  // namespace hdtest

#endif
