/* The heapdump collector as a library: what heapdump-collector runs as a daemon, and what
 * `heapdump run` embeds when no daemon answers.
 *
 * Usage: hd_collector_create() binds the socket and loads stored snapshots; hd_collector_run()
 * serves until hd_collector_stop() (async-signal-safe) is called from a signal handler or another
 * thread; hd_collector_destroy() frees everything. Functions return 0 or a negative errno value. */
#ifndef HEAPDUMP_COLLECTOR_H
#define HEAPDUMP_COLLECTOR_H

#include <stdbool.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/contract/names.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hd_collector hd_collector;

/* HD_EXIT_SNAPSHOT_NAME and HD_EXEC_SNAPSHOT_NAME name the snapshots the collector stores by
 * itself (contract/names.h). */

enum hd_log_level { HD_LOG_ERROR = 0, HD_LOG_WARN = 1, HD_LOG_INFO = 2, HD_LOG_DEBUG = 3 };

typedef struct hd_collector_options {
  const char *socket_path;       /* NULL: hd_default_socket_path() */
  const char *storage_dir;       /* NULL: $XDG_STATE_HOME/heapdump, else ~/.local/state/heapdump */
  uint32_t max_stored;           /* stored snapshots kept per uid; 0 = no limit */
  uint64_t max_storage_bytes;    /* bytes of stored snapshots kept per uid; 0 = no limit */
  int log_level;                 /* enum hd_log_level; messages go to stderr */
  uint32_t idle_timeout_seconds; /* client connections idle longer are closed; 0 = default */
  uint32_t read_timeout_seconds; /* a process's table not read by then fails; 0 = default */
  /* Bytes of block contents one process's snapshot carries at most; 0 = no limit. */
  uint64_t max_contents_bytes;
  /* How often each process's statistics are sampled for its memory-over-time series; 0 =
   * default. no_sampling: none (snapshots then carry only the moments of the process's stored
   * snapshots and their own). */
  uint32_t sample_interval_ms;
  bool no_sampling;
  /* Triggers, checked at every sample: a snapshot named HD_TRIGGER_SNAPSHOT_NAME is stored when
   * a process's live bytes reach trigger_live_bytes (0: never), or trigger_limit_percent of its
   * cgroup's memory limit (0: never), whichever is lower; again only once they have fallen
   * below nine tenths of it. */
  uint64_t trigger_live_bytes;
  uint32_t trigger_limit_percent;
} hd_collector_options;

#define HD_DEFAULT_SAMPLE_INTERVAL_MS 100

#define HD_DEFAULT_IDLE_TIMEOUT_SECONDS 60
#define HD_DEFAULT_READ_TIMEOUT_SECONDS 10
#define HD_DEFAULT_MAX_CONTENTS_BYTES (UINT64_C(1) << 30)

/* The socket path clients and instrumented processes use: $HEAPDUMP_SOCKET, else
 * $XDG_RUNTIME_DIR/heapdump/collector.sock, else /tmp/heapdump-$UID/collector.sock. Writes at most
 * size bytes; returns 0 or -ENAMETOOLONG. */
HD_MUST_CHECK int hd_default_socket_path(char *out, unsigned long size);

/* What the collector still owes, for a caller that must not stop it before every exit snapshot
 * is stored: processes it serves that still run (up to 16 of them named in `running_list`),
 * processes that exited and whose exit it has not handled yet, and exit snapshots queued or
 * being stored. */
typedef struct hd_collector_census {
  unsigned running, exited_unhandled, exits_pending;
  struct {
    uint32_t pid;
    char name[HD_NAME_SIZE];
  } running_list[16];
} hd_collector_census;
void hd_collector_take_census(hd_collector *c, hd_collector_census *out);

HD_MUST_CHECK int hd_collector_create(const hd_collector_options *options, hd_collector **out);
HD_MUST_CHECK int hd_collector_run(hd_collector *c);
void hd_collector_stop(hd_collector *c);
void hd_collector_destroy(hd_collector *c);

#ifdef __cplusplus
}
#endif
#endif
