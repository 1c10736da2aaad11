/* Names, limits and rules every heapdump process must agree on: the library inside a profiled
 * program, the collector (which finds programs it did not start by these names), and the
 * heapdump command (which sets them up for `run`). Each is defined here once; docs/tools.md and
 * docs/instrumentation.md describe them for users. */
#ifndef HEAPDUMP_CONTRACT_NAMES_H
#define HEAPDUMP_CONTRACT_NAMES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include "heapdump/contract/must_check.h"

/* The names of the library's memfds, as /proc/PID/fd shows them ("/memfd:NAME (deleted)"): the
 * collector rediscovers a process's tables by them after a restart. */
#define HD_MEMFD_ALLOCATIONS "heapdump-allocations"
#define HD_MEMFD_RESOURCES "heapdump-resources"
#define HD_MEMFD_SNAPSHOT "heapdump-snapshot" /* a named snapshot's frozen copy */

/* The environment. */
#define HD_ENV_SOCKET "HEAPDUMP_SOCKET"               /* the collector's socket */
#define HD_ENV_RUNTIME_DIR "XDG_RUNTIME_DIR"          /* where the default socket is */
#define HD_ENV_EXIT_SNAPSHOT "HEAPDUMP_EXIT_SNAPSHOT" /* 1: a snapshot is stored at exit */
/* With an exit snapshot: 1 (every process) or a pid (that process only; `heapdump run` sets its
 * command's) stores it from its exit path with contents and roots, a leak check; 0: never. */
#define HD_ENV_EXIT_CONTENTS "HEAPDUMP_EXIT_CONTENTS"
#define HD_ENV_PROFILE_ONLY "HEAPDUMP_PROFILE_ONLY"       /* `run --children`: which programs */
#define HD_ENV_PROFILE_ROOT "HEAPDUMP_PROFILE_ROOT"       /* the pid `run` started */
#define HD_ENV_FOLLOW_CHILDREN "HEAPDUMP_FOLLOW_CHILDREN" /* 0: exec'd children unprofiled */
#define HD_ENV_ALLOCATOR "HEAPDUMP_ALLOCATOR"             /* jemalloc (default) or system */
#define HD_ENV_UNWIND "HEAPDUMP_UNWIND"                   /* the unwinder */
#define HD_ENV_MAX_FRAMES "HEAPDUMP_MAX_FRAMES"
#define HD_ENV_MAX_MEMORY "HEAPDUMP_MAX_MEMORY" /* the tables' shared memory */
#define HD_ENV_CLOCK "HEAPDUMP_CLOCK"
/* mean bytes between recorded blocks (sampled recording); unset or 0: every block */
#define HD_ENV_SAMPLE_BYTES "HEAPDUMP_SAMPLE_BYTES"
#define HD_ENV_SNAPSHOT_TIMEOUT "HEAPDUMP_SNAPSHOT_TIMEOUT"
/* 1: the library stays dormant (forwards to glibc, records nothing) until a collector arms it
 * (`heapdump arm`); 0: records from the start even when /etc/ld.so.preload loaded it. */
#define HD_ENV_DORMANT "HEAPDUMP_DORMANT"
#define HD_ENV_LIBRARY "HEAPDUMP_LIBRARY" /* the library `run` preloads */

/* The names of the snapshots the collector stores by itself, for processes registered with exit
 * snapshots on: their live blocks when they exited, and when they exec'd another program (the
 * new image registers anew under the same pid, and gets its own exit snapshot). */
#define HD_EXIT_SNAPSHOT_NAME "exit"
#define HD_EXEC_SNAPSHOT_NAME "exec"
/* What the collector names a snapshot its trigger stored (heapdump-collector --trigger-*). */
#define HD_TRIGGER_SNAPSHOT_NAME "over-threshold"

/* The longest process or snapshot name, in bytes (the protocol's MAX_NAME_LENGTH and the public
 * API's HEAPDUMP_SNAPSHOT_NAME_MAX, both checked against it where they meet), and the buffer
 * that holds one with its NUL. */
#define HD_NAME_MAX 32
#define HD_NAME_SIZE (HD_NAME_MAX + 1)

/* The kernel keeps at most this many bytes of a process's name (/proc/PID/comm); names compare
 * on as many. */
#define HD_COMM_MAX 15

#define HD_STRINGIFY_(x) #x
#define HD_STRINGIFY(x) HD_STRINGIFY_(x) /* HD_STRINGIFY(HD_NAME_MAX) is "32", for messages */

/* Whether the process named name is in a comma-separated list of program names (`run
 * --children`, HEAPDUMP_PROFILE_ONLY): both compared as the kernel keeps names, on their first
 * HD_COMM_MAX bytes, so a list may give a name in full. */
static inline bool hd_comm_listed(const char *list, const char *name) {
  const size_t len = strnlen(name, HD_COMM_MAX);
  for (const char *p = list; *p;) {
    const size_t n = strcspn(p, ",");
    const size_t compared = n < HD_COMM_MAX ? n : HD_COMM_MAX;
    if (n > 0 && compared == len && strncmp(p, name, compared) == 0) return true;
    p += n;
    if (*p == ',') p++;
  }
  return false;
}

/* Appends s to the string of *length bytes in out (size bytes); false, out cut, if it does not
 * fit. Paths are built without printf: a dormant process builds them at every start, and
 * printf's code would be pages of libc it otherwise never touches, each a page fault. */
static inline bool hd_path_append(char *out, size_t size, size_t *length, const char *s) {
  const size_t n = strlen(s);
  if (size == 0 || *length + n >= size) {
    if (size > 0) out[*length < size ? *length : size - 1] = '\0';
    return false;
  }
  memcpy(out + *length, s, n + 1);
  *length += n;
  return true;
}

/* The collector's socket path, the same in every process: $HEAPDUMP_SOCKET when set and not
 * empty, else $XDG_RUNTIME_DIR/heapdump/collector.sock when that is an absolute path, else
 * /tmp/heapdump-UID/collector.sock. The caller passes the variables' values (NULL when unset:
 * the collector reads another process's environment) and the real uid, or NULL where it is not
 * known (only the last rule needs it). Returns 0, -1 when the uid is needed and not given, or -2
 * when the path does not fit in size bytes. */
static HD_MUST_CHECK inline int hd_socket_path(const char *socket, const char *runtime_dir,
                                               const unsigned *uid, char *out, size_t size) {
  size_t length = 0;
  bool fits;
  if (socket != NULL && socket[0] != '\0') {
    fits = hd_path_append(out, size, &length, socket);
  } else if (runtime_dir != NULL && runtime_dir[0] == '/') {
    fits = hd_path_append(out, size, &length, runtime_dir) &&
           hd_path_append(out, size, &length, "/heapdump/collector.sock");
  } else if (uid != NULL) {
    char digits[16], *d = digits + sizeof digits;
    *--d = '\0';
    unsigned v = *uid;
    do {
      *--d = (char)('0' + v % 10);
      v /= 10;
    } while (v != 0);
    fits = hd_path_append(out, size, &length, "/tmp/heapdump-") &&
           hd_path_append(out, size, &length, d) &&
           hd_path_append(out, size, &length, "/collector.sock");
  } else {
    return -1;
  }
  return fits ? 0 : -2;
}

#endif /* HEAPDUMP_CONTRACT_NAMES_H */
