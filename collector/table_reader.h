/* Reader of the heapdump shared-memory tables (layout: heapdump/contract/shm_layout.h), used by
 * the collector and by tests. Runs outside the profiled process and treats the tables as
 * hostile: everything is copied, then bounds-checked; corruption yields HD_READ_ERR_CORRUPT,
 * never a crash or an unbounded loop.
 *
 * Error convention: every fallible function returns hd_read_status; HD_READ_OK (0) is success,
 * HD_READ_END (1) ends an iteration, negative values are errors. Such functions are
 * warn_unused_result. A reader keeps no state after it is opened: several threads may read
 * through one reader at once. */
#ifndef HEAPDUMP_COLLECTOR_TABLE_READER_H
#define HEAPDUMP_COLLECTOR_TABLE_READER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum hd_read_status {
  HD_READ_OK = 0,
  HD_READ_END = 1,              /* iteration finished */
  HD_READ_ERR_ARG = -1,         /* NULL pointer or invalid argument */
  HD_READ_ERR_SYSTEM = -2,      /* fstat/mmap/fcntl failed; errno is set */
  HD_READ_ERR_BAD_MAGIC = -3,   /* not a heapdump table of the expected kind */
  HD_READ_ERR_BAD_VERSION = -4, /* layout version this reader does not know */
  HD_READ_ERR_BAD_SIZE = -5,    /* header sizes/offsets do not fit the memfd */
  HD_READ_ERR_NOT_SEALED = -6,  /* memfd lacks F_SEAL_SHRINK: could shrink under us */
  HD_READ_ERR_CORRUPT = -7,     /* LIVE_SNAPSHOT_FAILED: inconsistent contents */
  HD_READ_ERR_BUSY = -8,        /* LIVE_SNAPSHOT_FAILED: writers kept a slot changing/locked */
  HD_READ_ERR_NOT_FOUND = -9,   /* key does not name a record of that kind */
  HD_READ_ERR_NO_SPACE = -10,   /* caller's buffer too small (partial result returned) */
  HD_READ_ERR_NO_MEMORY = -11,
  HD_READ_ERR_TIMED_OUT = -12, /* LIVE_SNAPSHOT_FAILED: not done by hd_read_limits.deadline_ns */
  HD_READ_ERR_STOPPED = -13,   /* hd_read_limits.stop said to give up */
} hd_read_status;

/* Static string naming a status. */
const char *hd_read_status_str(hd_read_status s);

/* ---- allocations table ---- */
typedef struct hd_alloc_reader hd_alloc_reader;

typedef struct hd_live_block {
  uint64_t address;
  uint64_t size;       /* requested size */
  uint64_t timestamp;  /* CLOCK_MONOTONIC ns */
  uint32_t thread_key; /* resources key, 0 = unknown */
  uint32_t stack_key;  /* resources key, 0 = unknown (trace dropped) */
  uint32_t flags;      /* low 8 bits: log2 of requested alignment */
  uint32_t reserved;
} hd_live_block;

typedef struct hd_alloc_table_info {
  uint32_t pid;
  uint32_t flags; /* HD_ALLOC_FLAG_SNAPSHOT for a frozen copy */
  uint32_t node_capacity;
  uint32_t node_high_water;
  uint64_t total_size;
  uint64_t snapshot_peak_mark; /* a frozen copy: the peak mark it goes with (0: none) */
} hd_alloc_table_info;

/* Maps fd read-only (the fd is not kept; close it when you like) and validates the header. */
hd_read_status hd_alloc_reader_open(int fd, hd_alloc_reader **out) HD_MUST_CHECK;
void hd_alloc_reader_close(hd_alloc_reader *r);
hd_read_status hd_alloc_reader_info(hd_alloc_reader *r, hd_alloc_table_info *out) HD_MUST_CHECK;
/* Drops this process's page-table entries for the mapping (MADV_DONTNEED). The table itself
 * lives in the memfd and is untouched; the next read faults the pages back in. A collector
 * calls it after a snapshot, so that a table it has read does not stay counted in its own
 * resident memory for the life of the process (about 40 MiB at 10^6 live blocks). */
void hd_alloc_reader_release_pages(hd_alloc_reader *r);
/* What bounds one copy of the live set, so that no writer can hold its reader for long. */
typedef struct hd_read_limits {
  /* CLOCK_MONOTONIC time by which the copy gives up (HD_READ_ERR_TIMED_OUT); 0: none beyond
   * the patience of one second for each slot a writer holds. */
  uint64_t deadline_ns;
  /* Nullable; asked while waiting for a slot: true gives up (HD_READ_ERR_STOPPED). */
  bool (*stop)(void *ctx);
  void *stop_ctx;
  /* Nothing writes the table any more (its process has exited, or it is a sealed copy): slots
   * are read as they were left, without waiting for a lock nobody will release. */
  bool final;
} hd_read_limits;

/* Consistent copy of the live set without stopping the writer (see the layout header):
 * every block live during the whole call appears exactly once, no block freed before the call
 * appears, and no two blocks have the same address (of an address met in several nodes, only
 * the newest record is kept, even from a table that breaks the protocol).
 * *blocks is malloc'd, in table order (no order a caller can use); free() it. On error *blocks
 * is NULL. limits may be NULL (no bounds beyond the per-slot patience). */
HD_MUST_CHECK hd_read_status hd_alloc_reader_snapshot_unordered(hd_alloc_reader *r,
                                                                hd_read_limits *limits,
                                                                hd_live_block **blocks,
                                                                size_t *count) HD_MUST_CHECK;
/* The same copy, sorted by address. */
HD_MUST_CHECK hd_read_status hd_alloc_reader_snapshot(hd_alloc_reader *r, hd_live_block **blocks,
                                                      size_t *count) HD_MUST_CHECK;

/* ---- resources table ---- */
typedef struct hd_res_reader hd_res_reader;

typedef struct hd_table_stats {
  uint64_t blocks_allocated, bytes_allocated, blocks_freed, bytes_freed;
  uint64_t live_blocks, live_bytes, peak_live_bytes;
  uint64_t dropped_allocations, dropped_stack_traces, dropped_resources;
  uint64_t stacks_beyond_cfi;
  uint64_t writes_past_block_end; /* frees whose block's tag the program had overwritten */
  uint64_t mapping_records_lost;  /* hd_rec_mapping records the writer could not write */
  uint64_t unwind_tables_refused; /* modules whose unwind tables were inconsistent */
  /* The latest peak mark (hd_res_header.peak_mark; 0: none) and the live bytes then, and the
   * time the marks count from (a block allocated at t is "by the mark" when
   * hd_peak_allocated_by(t, start_time_ns, peak_mark)). */
  uint64_t peak_mark, peak_mark_bytes, start_time_ns;
  uint64_t sample_bytes;       /* hd_res_reader_sample_bytes */
  uint64_t arm_state;          /* hd_res_reader_arm_state (64 bits: a metric, http.c) */
  uint64_t unattributed_bytes; /* hd_res_header.unattributed_bytes, a negative value as 0 */
} hd_table_stats;

typedef struct hd_thread_info {
  uint32_t key;
  uint32_t tid;
  uint64_t timestamp;
  char name[16]; /* always NUL-terminated */
} hd_thread_info;

typedef struct hd_region {
  uint32_t key;
  uint64_t address, size, file_offset, vaddr;
  uint8_t build_id[32];
  uint32_t build_id_len;
  char name[4096]; /* always NUL-terminated */
} hd_region;

/* Where a thread's stack and TLS are (as the process recorded them: to be checked). */
typedef struct hd_thread_roots {
  uint32_t tid;
  uint64_t stack_lo, stack_hi, thread_pointer;
} hd_thread_roots;

/* Memory that is not the program's (hd_rec_mapping; as the process recorded it). */
typedef struct hd_mapping_change {
  uint32_t kind; /* HD_MAPPING_* */
  bool mapped;
  uint64_t start, size;
} hd_mapping_change;

enum {
  HD_ENTRY_STACK = 1,
  HD_ENTRY_THREAD = 2,
  HD_ENTRY_REGION = 3,
  HD_ENTRY_THREAD_ROOTS = 4,
  HD_ENTRY_MAPPING = 5,
};
typedef struct hd_res_entry {
  int type;     /* HD_ENTRY_* */
  uint32_t key; /* for HD_ENTRY_STACK, pass to hd_res_reader_stack */
  union {
    hd_thread_info thread;
    hd_region region;
    hd_thread_roots thread_roots;
    hd_mapping_change mapping;
  } u;
} hd_res_entry;

hd_read_status hd_res_reader_open(int fd, hd_res_reader **out) HD_MUST_CHECK;
void hd_res_reader_close(hd_res_reader *r);
uint32_t hd_res_reader_pid(const hd_res_reader *r);
/* The table's hd_res_header.sample_bytes (0: every block recorded), at most HD_MAX_SAMPLE_BYTES
 * whatever the process wrote, so that a block's weight times its size cannot overflow. */
uint64_t hd_res_reader_sample_bytes(const hd_res_reader *r);
/* The table's hd_res_header.arm_state (HD_ARM_*); an unknown value as HD_ARM_FROM_START. */
uint32_t hd_res_reader_arm_state(const hd_res_reader *r);
/* The table's hd_res_header.arm_generation. */
uint32_t hd_res_reader_arm_generation(const hd_res_reader *r);
/* Statistics (each counter read atomically; together approximate). */
hd_read_status hd_res_reader_stats(hd_res_reader *r, hd_table_stats *out) HD_MUST_CHECK;
/* A trace's cumulative counters. */
typedef struct hd_trace_counters {
  uint64_t allocated_blocks, allocated_bytes;
  /* freed by their thread before it allocated or freed anything else */
  uint64_t temporary_blocks;
  /* blocks and bytes live at a peak mark and freed since, each tagged with that mark's number
   * (hd_peak_mark_number; a count whose mark is not the latest is 0) */
  uint64_t peak_freed_blocks, peak_freed_bytes;
  /* A thread was changing an entry of this trace's counts for longer than the reads could wait
   * (hd_res_reader_stack_indexed): the three counts above may be off by that entry's. */
  bool unsettled;
} hd_trace_counters;
/* Decodes the trace `key` into frames[0..max) (return addresses, innermost first).
 * *count = frames in the trace; HD_READ_ERR_NO_SPACE if more than max (first max filled).
 * counters (nullable): the trace's cumulative counters. truncated (nullable): the library's
 * walk was cut at its frame limit. */
HD_MUST_CHECK hd_read_status hd_res_reader_stack(hd_res_reader *r, uint32_t key, uint64_t *frames,
                                                 size_t max, size_t *count,
                                                 hd_trace_counters *counters,
                                                 bool *truncated) HD_MUST_CHECK;
/* The threads' entries of trace counts (shm_layout.h, hd_pending_trace) by trace, as they were
 * when it was made: a reader of many traces' counters (a snapshot, after it read the live blocks)
 * makes one, and each read then visits the entries that held its trace instead of one entry of
 * every thread's counters record. It also holds what the reads through it may wait, in all,
 * for threads changing entries (1 s): so it is one reader's at a time. NULL if out of memory. */
typedef struct hd_pending_index hd_pending_index;
hd_pending_index *hd_res_reader_pending_index(const hd_res_reader *r);
void hd_pending_index_free(hd_pending_index *index);
/* hd_res_reader_stack, the counters read through index (NULL: as hd_res_reader_stack, whose
 * read waits up to 1 s for a thread changing an entry): an entry that took the trace after the
 * index was made is not counted (what it holds was allocated since). */
HD_MUST_CHECK hd_read_status hd_res_reader_stack_indexed(hd_res_reader *r, hd_pending_index *index,
                                                         uint32_t key, uint64_t *frames, size_t max,
                                                         size_t *count, hd_trace_counters *counters,
                                                         bool *truncated) HD_MUST_CHECK;
HD_MUST_CHECK hd_read_status hd_res_reader_thread(hd_res_reader *r, uint32_t key,
                                                  hd_thread_info *out) HD_MUST_CHECK;
/* Iterates all records in order; *cursor starts at 0. Returns HD_READ_END after the last. */
HD_MUST_CHECK hd_read_status hd_res_reader_next(hd_res_reader *r, uint64_t *cursor,
                                                hd_res_entry *out) HD_MUST_CHECK;

#ifdef __cplusplus
}
#endif

#endif /* HEAPDUMP_COLLECTOR_TABLE_READER_H */
