/* Internals shared by the collector's files: the collector, the live set of instrumented
 * processes, stream jobs, the storage worker and the stored-snapshot catalogue.
 *
 * Threads: the poll thread (hd_collector_run) serves every connection and watches process exits;
 * snapshot streams run on stream threads, at most HD_MAX_STREAM_THREADS (stream.c); the storage
 * workers (worker.c)
 * write named snapshots (one thread) and exit snapshots (another, which also rescans /proc when a
 * listing asks for it) to disk. */
#ifndef HEAPDUMP_COLLECTOR_INTERNAL_H
#define HEAPDUMP_COLLECTOR_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "heapdump/collector.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/contract/names.h"
#include "heapdump/contract/shm_layout.h"
#include "heapdump/fidl/batch.h"
#include "heapdump_client.pb.h"
#include "series.h"
#include "stored_file.h"
#include "table_reader.h"

#define HD_MAX_PROCESSES 1024

/* An instrumented process, found by its registration or by a scan of /proc. Reference-counted:
 * a stream or a pending exit snapshot keeps the tables mapped after the process has exited. */
typedef struct hd_process {
  atomic_int refs;
  pid_t pid; /* in the collector's PID namespace */
  /* The pid the process knows itself by, in its own PID namespace (a container's): what its
   * tables and its named snapshots carry. pid itself unless it runs in a child namespace. */
  pid_t own_pid;
  uid_t uid;
  /* The allocations memfd's inode: what tells a registration of a process already found by a
   * scan (same inode) from a new process that reuses a pid (another inode). */
  dev_t table_dev;
  ino_t table_ino;
  /* Watched by the poll thread: readable once the process has exited. Every entry has one: a
   * process whose pidfd cannot be opened (it has exited, and its pid may name another process
   * by now) is never taken in. */
  int pidfd;
  hd_alloc_reader *alloc;
  hd_res_reader *res;
  char name[HD_NAME_SIZE];
  /* Protected by hd_collector.lock. */
  bool exit_snapshot;
  bool live;                  /* in the live set */
  uint64_t exit_record;       /* its hd_exit_record's seq once it has left the live set */
  bool named_store_pending;   /* protected by the storage worker's lock: one store at a time */
  bool trigger_store_pending; /* the same for the trigger's stores (sampler.c) */
  /* Protected by hd_collector.lock: the exit snapshot it stored itself from its exit path, with
   * contents (0: none), which stands for the one the collector would take when it exits. */
  uint32_t exit_stored_id;
  hd_series series; /* its memory over time, sampled by the sampler thread (sampler.c) */
  /* The trigger (sampler.c). Sync: the sampler thread only. */
  bool trigger_fired;      /* stored over the threshold; again once below 9/10 of it */
  bool memory_limit_known; /* memory_limit read (once: a cgroup's limit rarely moves) */
  uint64_t memory_limit;   /* its cgroup's memory limit, 0: none */
  /* What the process gave as its command line when it registered (NULL: none, e.g. found by a
   * scan of /proc). Set before the entry is shared, or under hd_collector.lock when a
   * registration completes an entry a scan found; read under that lock. */
  char *command_line;
} hd_process;

/* Why a dormant process could not arm (Registry.ReportArmFailure), for GetProcessState: the
 * client waiting for the arming says so rather than time out. The last HD_ARM_FAILURES, a ring. */
#define HD_ARM_FAILURES 64
typedef struct hd_arm_failure_record {
  pid_t pid; /* 0: an empty slot */
  uid_t uid;
  uint64_t start_ticks; /* tells the process from a later one of its pid */
  uint64_t generation;  /* the arm page's, of the request it failed on */
  char text[160];       /* "making its allocations table (768 MiB): Cannot allocate memory" */
} hd_arm_failure_record;

/* What the collector remembers of a process that left the live set, for GetProcessState: a
 * client that waits for an exit snapshot learns at once that none will come. */
#define HD_EXIT_RECORDS 4096
typedef struct hd_exit_record {
  uint64_t seq; /* 0: an empty slot; else slot = seq % HD_EXIT_RECORDS */
  pid_t pid;
  uid_t uid;
  char name[HD_NAME_SIZE];
  heapdump_client_ProcessState state;
  uint32_t snapshot_id;
} hd_exit_record;

typedef struct hd_stored_list {
  hd_stored_snapshot_info *items;
  size_t count, next;
} hd_stored_list;

struct conn_table;
struct hd_worker;

/* How many lines one log message format may write (see hd_log). */
#define HD_LOG_BURST 20
#define HD_LOG_WINDOW_NS 10000000000u
#define HD_LOG_FORMATS 64
typedef struct hd_log_budget {
  const char *fmt; /* the format string's address: one per call site */
  uint64_t window_start_ns;
  unsigned lines, left_out;
} hd_log_budget;

/* Sync: each field says what guards it. "Fixed" fields are set by hd_collector_create before
 * any thread starts and only read until hd_collector_destroy, which runs after every thread of
 * the collector has been joined (the poll thread, in `heapdump run`, by its caller). Lock order:
 * scan_lock, lock, the worker's lock; log_lock innermost. */
struct hd_collector {
  char socket_path[108]; /* Sync: fixed */
  /* socket_path made absolute with its directory resolved: what a found process's own socket
   * path must equal for the process to be ours. Sync: fixed */
  char socket_identity[4096];
  char storage_dir[4096]; /* Sync: fixed (in log messages only) */
  /* The storage directory, verified ours and private when opened: every file in it is reached
   * relative to this descriptor, never by a path that a rename could redirect. Sync: fixed */
  int storage_fd;
  int listen_fd; /* Sync: fixed; accepted on by the poll thread only */
  /* A byte makes the poll thread look again at the stop flag and the live set. Sync: fixed;
   * wake[1] written by any thread or signal handler, wake[0] read by the poll thread only. */
  int wake[2];
  /* Accepting pauses while descriptors run out. Sync: the poll thread only. */
  uint64_t accept_paused_until_ns, accept_backoff_ns;
  atomic_bool stop_requested;                /* Sync: atomic */
  int log_level;                             /* Sync: fixed */
  pthread_mutex_t log_lock;                  /* guards log_budgets; taken last */
  hd_log_budget log_budgets[HD_LOG_FORMATS]; /* Sync: log_lock */
  uint32_t max_stored;                       /* Sync: fixed */
  uint64_t max_storage_bytes;                /* Sync: fixed */
  uint64_t idle_timeout_ns; /* client connections idle longer are closed. Sync: fixed */
  uint64_t read_timeout_ns; /* a process's table not read by then fails its snapshot. Sync: fixed */
  uint64_t max_contents_bytes; /* of block contents in one process's snapshot; 0: no limit.
                                * Sync: fixed */
  pthread_mutex_t lock; /* guards the live set, the stored list, the streams and the exit records */
  hd_process *processes[HD_MAX_PROCESSES]; /* the live set; each entry holds one reference.
                                            * Sync: lock */
  size_t process_count;                    /* Sync: lock */
  /* Oldest first. Sync: lock (hd_collector_create and destroy fill and empty it alone). */
  hd_stored_snapshot_info *stored;
  size_t stored_count, stored_capacity; /* Sync: as stored */
  uint32_t next_id;                     /* Sync: as stored */
  int active_streams;                   /* running and queued. Sync: lock */
  struct hd_stream_job *streams;        /* running and queued, so a stop can cut their clients off.
                                         * Sync: lock */
  int stream_threads;                   /* at most HD_MAX_STREAM_THREADS. Sync: lock */
  struct hd_stream_job *stream_queue;   /* waiting for a stream thread, oldest first. Sync: lock */
  int queued_streams;                   /* at most HD_MAX_QUEUED_STREAMS. Sync: lock */
  pthread_cond_t streams_done;          /* waited on with lock */
  pthread_mutex_t scan_lock; /* one /proc scan at a time; guards last_scan_ns and scanned */
  uint64_t last_scan_ns;     /* Sync: scan_lock */
  bool scanned;              /* Sync: scan_lock */
  /* HD_EXIT_RECORDS of them, a ring. Sync: the pointer fixed, the records lock. */
  hd_exit_record *exit_records;
  uint64_t exit_seq; /* the last record's seq. Sync: lock */
  /* Sync: fixed while the workers run (set before they start, cleared after they are joined). */
  struct hd_worker *worker;
  struct hd_sampler *sampler;     /* NULL when sampling is off. Sync: as worker */
  uint64_t sample_interval_ns;    /* Sync: fixed */
  uint64_t trigger_live_bytes;    /* hd_collector_options. Sync: fixed */
  uint32_t trigger_limit_percent; /* hd_collector_options. Sync: fixed */
  /* Sync: the pointer fixed; the table the poll thread's only (connections.h). */
  struct conn_table *conns;
  hd_message *scratch; /* Sync: the poll thread only */
  /* The arm page (arming.c), NULL if it could not be opened; its file's identity, which a
   * dormant process's /proc/PID/maps shows. Sync: the pointer fixed; written by the poll thread
   * only. */
  struct hd_arm_page *arm_page;
  dev_t arm_page_dev;
  ino_t arm_page_ino;
  hd_arm_failure_record arm_failures[HD_ARM_FAILURES]; /* Sync: lock */
  size_t arm_failures_next;                            /* Sync: lock */
  /* What the collector did, for its metrics (http.c). Sync: atomic */
  atomic_uint_fast64_t live_streams_served, stored_streams_served, warnings_logged;
};

/* Writes a log line at level. Warnings and errors are limited per format string (HD_LOG_BURST
 * lines per HD_LOG_WINDOW_NS), so pass a literal format, never a computed one. */
void hd_log(hd_collector *c, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
uint64_t hd_monotonic_ns(void);
/* pthread_create for the collector's own threads (stream and storage threads), started with
 * every signal blocked: a signal is then always handled by a thread of the program that embeds
 * the collector, never by one of ours, so a handler can never race with the collector's
 * teardown on another thread (e.g. the daemon's handler and hd_collector_destroy). */
HD_MUST_CHECK int hd_start_thread(pthread_t *thread, const pthread_attr_t *attr,
                                  void *(*run)(void *), void *arg);
/* Wakes the poll thread (async-signal-safe). */
void hd_wake_poll_thread(hd_collector *c);

/* ---- processes (collector.c) ---- */

/* A new entry with one reference, owning alloc, res and pidfd. NULL when out of memory: then
 * nothing is taken. */
hd_process *hd_process_new(pid_t pid, pid_t own_pid, uid_t uid, const char *name,
                           bool exit_snapshot, dev_t table_dev, ino_t table_ino, int pidfd,
                           hd_alloc_reader *alloc, hd_res_reader *res);
hd_process *hd_process_retain(hd_process *p);
void hd_process_release(hd_process *p);
/* False once the process has exited. */
bool hd_process_alive(const hd_process *p);
/* Whether the live set holds this process (same pid and same allocations memfd). */
bool hd_process_known(hd_collector *c, pid_t pid, dev_t table_dev, ino_t table_ino);
/* The live, running entry of this process (same pid and allocations memfd) seen by uid (0 sees
 * every process), retained for the caller; NULL if there is none. */
hd_process *hd_process_find(hd_collector *c, pid_t pid, dev_t table_dev, ino_t table_ino,
                            uid_t uid);
/* Puts p (whose reference the live set takes over) into the live set. A live entry for the same
 * process (same pid and allocations memfd) absorbs it instead: it takes, from a registration
 * (which knows best, unlike a scan of /proc), the exit-snapshot option; p is released and
 * *absorbed set. An entry of an earlier process with
 * the same pid leaves the live set as exited. Returns the live entry, retained for the caller,
 * or NULL if the live set is full (p is released). */
hd_process *hd_live_set_add(hd_collector *c, hd_process *p, bool registration, bool *absorbed);
/* Takes p out of the live set (once): logs the exit and queues its exit snapshot if wanted. */
void hd_process_exited(hd_collector *c, hd_process *p);
/* The live processes matching a selector that a peer of uid may see, retained, into out
 * (HD_MAX_PROCESSES entries). */
heapdump_client_CollectorError hd_select_processes(hd_collector *c, uid_t uid, bool has_selector,
                                                   const heapdump_client_ProcessSelector *sel,
                                                   bool multi, hd_process **out, size_t *count);
/* The protocol's name for a table's hd_res_header.arm_state. */
static inline heapdump_client_RecordingState hd_recording_state(uint32_t arm_state) {
  return arm_state == HD_ARM_ARMED      ? heapdump_client_RecordingState_RECORDING_ARMED
         : arm_state == HD_ARM_DISARMED ? heapdump_client_RecordingState_RECORDING_DISARMED
                                        : heapdump_client_RecordingState_RECORDING_FROM_START;
}

/* Where process pid stands (GetProcessState), as uid (0 sees every process) may know it: from
 * the live set, else from the record of recent exits. */
heapdump_client_CollectorGetProcessStateResponse hd_process_state(hd_collector *c, pid_t pid,
                                                                  uid_t uid);
/* The live processes, retained, into out (HD_MAX_PROCESSES entries); returns how many. */
size_t hd_live_processes(hd_collector *c, hd_process **out);
/* cgroup.c: the lowest memory limit on the cgroup path of pid (v2 or v1), 0 if none. */
uint64_t hd_cgroup_memory_limit(pid_t pid);
/* Reads /proc/PID/comm into out. */
bool hd_read_process_name(pid_t pid, char *out, size_t size);

/* ---- rediscovery (discovery.c) ---- */

/* Whether fd is a memfd named `name` (any memfd if name is NULL), per its /proc link. */
bool hd_fd_is_memfd(int fd, const char *name);
/* The pid that process pid (of our PID namespace) has in its own, innermost PID namespace, from
 * the NSpid line of /proc/PID/status (pid itself where the kernel has none); -1 if unknown. */
pid_t hd_own_pid(pid_t pid);
/* pidfd_open(2): a descriptor readable once pid has exited; -1 with errno on failure. */
HD_MUST_CHECK int hd_pidfd_open(pid_t pid);

/* What a process's two tables must be before the collector serves them, checked alike whether
 * the process registered or was rediscovered: read-only memfds (with the library's names when
 * by_name), readable as tables of this layout (hd_*_reader_open), both written by own_pid (the
 * process's pid in its own PID namespace). */
typedef enum hd_tables_verdict {
  HD_TABLES_OK,
  HD_TABLES_NOT_MEMFDS,    /* not memfds, or not named as the library names its tables */
  HD_TABLES_WRITABLE,      /* handed over writable */
  HD_TABLES_UNREADABLE,    /* the readers refused them: *why says how */
  HD_TABLES_OTHER_PROCESS, /* another process's tables (inherited across fork, or forged) */
  HD_TABLES_NO_IDENTITY,   /* fstat failed */
} hd_tables_verdict;
/* On HD_TABLES_OK the caller owns *alloc and *res, and *table is the allocations table's
 * identity; otherwise nothing is left open and *why says what failed, for the log. The
 * descriptors stay the caller's. */
hd_tables_verdict hd_open_process_tables(int alloc_fd, int res_fd, bool by_name, pid_t own_pid,
                                         hd_alloc_reader **alloc, hd_res_reader **res,
                                         struct stat *table, const char **why);
/* A socket path made absolute (relative paths against cwd, or ours if cwd is NULL) with its
 * directory resolved, so that two spellings of one socket compare equal. 0 or -errno. */
HD_MUST_CHECK int hd_socket_identity(const char *path, const char *cwd, char *out, size_t size);

/* Finds instrumented processes this collector serves that are not in the live set: those
 * started before it, or while it was down, or whose registration failed. Scans at most once a
 * second unless force; concurrent callers wait for the scan in progress. */
void hd_discover_processes(hd_collector *c, bool force);

/* ---- streams (stream.c) ---- */

/* Snapshot streams run on at most HD_MAX_STREAM_THREADS threads; up to HD_MAX_QUEUED_STREAMS more
 * requests wait for one, and any beyond are refused (their receiver is closed): a flood of
 * requests costs bounded threads and descriptors. Service is fair between clients (the process
 * that sent the request): one client runs at most HD_STREAMS_PER_CLIENT streams, a free thread
 * takes the oldest request of the client running the fewest (below that share), and a full queue
 * refuses the newest request of the client that queued the most; so a client's wait is bounded by
 * its own requests, not by another's flood. A request whose client has gone (its receiver hung up)
 * is dropped, not served. */
#define HD_MAX_STREAM_THREADS 32
#define HD_MAX_QUEUED_STREAMS 1024
#define HD_STREAMS_PER_CLIENT 8

typedef struct hd_stream_job {
  hd_collector *c;
  struct hd_stream_job *next, *prev; /* in c->streams until it ends */
  struct hd_stream_job *queue_next;  /* in c->stream_queue while it waits for a thread */
  int receiver;
  uid_t peer_uid;
  pid_t peer_pid; /* the client, for fair service */
  bool running;   /* on a stream thread (else queued) */
  bool stored;    /* DownloadStoredSnapshot, else TakeLiveSnapshot */
  uint32_t stored_id;
  bool with_contents, multi_process, has_selector;
  heapdump_client_ProcessSelector selector;
} hd_stream_job;

/* Takes ownership of job; runs it on a stream thread, at once or once one is free. */
void hd_start_stream(hd_stream_job *job);
/* Waits for the running streams: a short grace to finish, then their clients are cut off (a
 * stopping collector must not wait on a client's pace). */
void hd_wait_streams(hd_collector *c);
/* Writes the elements of one process's snapshot: the live table when snapshot_alloc is NULL, else
 * a frozen copy (verified sealed). Readers never wait for each other, only for the process's
 * writers, and for at most the read timeout. Returns 0, or -EIO if the tables are corrupt,
 * unreadable or kept locked. */
typedef struct hd_snapshot_totals {
  uint64_t live_bytes, live_blocks;
} hd_snapshot_totals;
/* `name` names the snapshot's own moment, the last of the process's series it carries ("live"
 * for a live snapshot); *moment (nullable) gets that moment, which a stored snapshot's caller
 * remembers in the series once it is stored (hd_series_remember). */
HD_MUST_CHECK int hd_produce_snapshot(hd_collector *c, hd_process *p,
                                      hd_alloc_reader *snapshot_alloc, const char *name,
                                      bool with_contents, hd_batch_writer *w,
                                      hd_snapshot_totals *totals, hd_series_moment *moment);

/* Records the outcome of p's last snapshot: stored as snapshot_id, or (ok false) not stored. */
void hd_exit_record_finish(hd_collector *c, const hd_process *p, bool ok, uint32_t snapshot_id);

/* ---- the storage workers (worker.c) ---- */

HD_MUST_CHECK int hd_worker_start(hd_collector *c);
/* Returns once every queued job is done. */
void hd_worker_stop(hd_collector *c);
/* Queues p's exit snapshot (p is retained by the queue). */
/* Counts an exit snapshot as pending: called under hd_collector.lock in the same critical
 * section that takes its process out of the live set, so a census never misses it. */
void hd_worker_reserve_exit(hd_collector *c);
/* Queues p's exit snapshot (reserved before) under name; p is retained by the queue. */
void hd_queue_exit_snapshot(hd_collector *c, hd_process *p, const char *name);
/* Exit snapshots queued or being stored. */
unsigned hd_worker_exits_pending(hd_collector *c);
/* Queues storing a named snapshot from `memfd` (taken) and answering StoreNamedSnapshot with
 * `txid` on `reply_fd` (taken). A process has one store queued or running at a time: -EBUSY
 * while it has; -ENOMEM if it could not be queued. Nothing is taken on error. */
HD_MUST_CHECK int hd_queue_named_snapshot(hd_collector *c, hd_process *p, const char *name,
                                          int memfd, bool exit_with_contents, int reply_fd,
                                          uint32_t txid);
/* Queues storing a snapshot of p's live table named HD_TRIGGER_SNAPSHOT_NAME, answered to no
 * one; one at a time per process (-EBUSY), apart from the process's own (named, exit). */
HD_MUST_CHECK int hd_queue_trigger_snapshot(hd_collector *c, hd_process *p);
/* Queues a rescan of /proc (rate-limited like every scan), unless one is already queued. */
void hd_queue_discovery(hd_collector *c);

/* ---- sampling (sampler.c) ---- */

/* Starts the thread that samples every live process's statistics each sample interval into its
 * series (nothing when the interval is 0). */
HD_MUST_CHECK int hd_sampler_start(hd_collector *c);
void hd_sampler_stop(hd_collector *c);

/* ---- storage (storage.c) ---- */

HD_MUST_CHECK int hd_storage_open(hd_collector *c, const char *dir);

/* ---- arming.c: the arm page ---- */

/* Opens (creating it if needed) and maps the arm page beside the socket; -errno, logged. */
int hd_arming_open(hd_collector *c);
void hd_arming_close(hd_collector *c);
/* Asks process pid to record (at sample_bytes when given, else at the rate it was armed at
 * before) or to stop recording new blocks, for a client of uid peer_uid;
 * COLLECTOR_ERROR_UNSPECIFIED once published, else why not. Poll thread only. */
heapdump_client_CollectorError hd_arming_request(hd_collector *c, pid_t pid, uid_t peer_uid,
                                                 bool recording, bool has_sample_bytes,
                                                 uint64_t sample_bytes, uint64_t *generation);
/* Keeps why process pid (of uid) could not act on the request of that generation (what it
 * could not make, and the errno), and logs it. */
void hd_arming_note_failure(hd_collector *c, pid_t pid, uid_t uid, uint64_t generation,
                            const char *what, int error);
/* Fills out's arm_failure with the last failure process pid reported, if it is still that
 * process and uid may see it (0: anyone's). */
void hd_arming_failure_of(hd_collector *c, pid_t pid, uid_t uid,
                          heapdump_client_CollectorGetProcessStateResponse *out);
void hd_storage_close(hd_collector *c);
/* Stores a snapshot of p named `name`: from the frozen allocations copy `memfd` (borrowed), or,
 * if memfd < 0, from p's tables as they are now; with_contents: with the blocks' contents and
 * the roots, read from the process. 0, -EINVAL (bad table) or -EIO. */
HD_MUST_CHECK int hd_store_snapshot(hd_collector *c, hd_process *p, const char *name, int memfd,
                                    bool with_contents, uint32_t *id);
HD_MUST_CHECK int hd_storage_list(hd_collector *c, uid_t uid,
                                  const heapdump_client_ProcessSelector *selector,
                                  hd_stored_list *out);
HD_MUST_CHECK hd_status hd_storage_send_page(int fd, hd_message *msg, hd_stored_list *listing);
/* Streams stored snapshot id to w (without the final empty batch). -ENOENT if unknown or not
 * visible to uid. */
HD_MUST_CHECK int hd_storage_stream(hd_collector *c, uint32_t id, uid_t uid, hd_batch_writer *w);
/* Deletes stored snapshot id; -ENOENT if unknown or not visible to uid (0 sees all). */
HD_MUST_CHECK int hd_storage_delete(hd_collector *c, uint32_t id, uid_t uid);

#endif
