/* The receiver side of a snapshot stream: a reassembler that accepts elements in any order,
 * concatenates chunked stack traces and block contents, and checks the result (duplicates,
 * reassembled sizes, dangling references). The result is an in-memory model of each snapshot.
 * Unlike the rest of fidl/, this allocates: it runs in clients (tools, tests), never in a
 * profiled process. */
#ifndef HEAPDUMP_FIDL_SNAPSHOT_H
#define HEAPDUMP_FIDL_SNAPSHOT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/contract/names.h"
#include "heapdump/fidl/batch.h"
#include "heapdump/fidl/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A u64 -> index map (open addressing, linear probing), zero-initialized when empty. Used by the
 * reassembler's indexes and by the writers that need one. */
typedef struct hd_u64_map {
  uint64_t *keys;
  size_t *slots; /* index + 1; 0 = empty */
  size_t capacity;
  size_t count;
} hd_u64_map;

bool hd_u64_map_find(const hd_u64_map *m, uint64_t key, size_t *index);
/* Inserts a key known to be absent; false when out of memory (the map is unchanged). */
bool hd_u64_map_put(hd_u64_map *m, uint64_t key, size_t index);
void hd_u64_map_free(hd_u64_map *m);

/* One block, or count blocks aggregated (size is their total): a pprof sample, or a sampled
 * block standing for the count blocks of its size it estimates (ProcessStats.sample_bytes). */
typedef struct hd_snapshot_allocation {
  uint64_t address, size, stack_trace_key, thread_info_key, count;
  int64_t timestamp;
} hd_snapshot_allocation;

/* The size of the block at the allocation's address (hd_snapshot_block_size). */

#define HD_TRUNCATED_FRAME_PREFIX "... truncated at "
#define HD_TRUNCATED_FRAME_FORMAT HD_TRUNCATED_FRAME_PREFIX "%zu frames"
/* The one frame of the sample a pprof profile of an armed process holds its unattributed bytes
 * in (ProcessStats.unattributed_bytes: live, allocated before arming), so that its totals are
 * the process's. */
#define HD_UNATTRIBUTED_FRAME "(unattributed: allocated before arming or while disarmed)"

typedef struct hd_snapshot_stack_trace {
  uint64_t key;
  uint64_t *addresses; /* leaf first */
  size_t count;
  /* Cut at the process's frame limit: the root-most frames are missing. Outputs show a frame
   * named HD_TRUNCATED_FRAME_FORMAT (with count) where they would be. */
  bool truncated;
  bool has_counters; /* StackTraceCounters seen */
  uint64_t allocated_blocks, allocated_bytes;
  /* Of the allocated blocks, those their thread freed before it allocated or freed anything
   * else, when has_temporary (the counters of a pprof profile or of an older file have none). */
  bool has_temporary;
  uint64_t temporary_blocks;
  /* Blocks and bytes of this trace live at the process's peak mark: meaningful when the
   * snapshot's stats have has_peak_mark_time (0 for a trace with none live then). */
  uint64_t peak_blocks, peak_bytes;
  /* The counts were read while a thread stayed inside a change of its share of them: they may
   * be off by that share (StackTraceCounters.unsettled). */
  bool counts_unsettled;
} hd_snapshot_stack_trace;

typedef struct hd_snapshot_thread {
  uint64_t key, koid;
  char name[HD_NAME_SIZE];
} hd_snapshot_thread;

typedef struct hd_snapshot_region {
  uint64_t address, size, file_offset, vaddr;
  uint8_t build_id[32];
  size_t build_id_size;
  char *name;
} hd_snapshot_region;

typedef struct hd_snapshot_block {
  uint64_t address;
  uint8_t *bytes; /* spilled contents (hd_reassembler_spill_contents): NULL until finished */
  size_t size;
  uint64_t spill_offset; /* spilled contents: where they are in the file */
} hd_snapshot_block;

/* Memory outside the heap the program reaches its blocks from (RootRegion): its bytes are
 * contents.bytes (contents.size == size once finished), or none for a root not read. */
typedef struct hd_snapshot_root {
  uint64_t address, size;
  heapdump_client_RootKind kind;
  uint64_t thread_koid; /* STACK, TLS */
  char *name;           /* DATA: the module's path; "" otherwise */
  bool not_read;        /* a root the collector did not read (RootRegion.not_read) */
  hd_snapshot_block contents;
} hd_snapshot_root;

/* One source-level frame. */
typedef struct hd_source_frame {
  /* The linkage (mangled) name when the compiler recorded one, else the source name; what the
   * tools print is demangled (heapdump/tools/demangle.h). NULL if unknown. */
  const char *function;
  const char *file; /* NULL if unknown */
  uint32_t line;    /* 0 if unknown */
  uint32_t column;  /* 0 if unknown */
} hd_source_frame;

/* The source frames of a program address known without symbolizing it: read from a symbolized
 * pprof profile, whose binaries may be gone. */
typedef struct hd_snapshot_known_location {
  uint64_t address;
  hd_source_frame *frames; /* innermost inlined frame first; strings owned by the snapshot */
  size_t frame_count;
} hd_snapshot_known_location;

typedef struct hd_snapshot {
  bool has_header;
  bool has_stats;
  heapdump_client_ProcessStats stats;
  bool has_resident; /* ResidentMemory seen */
  heapdump_client_ResidentMemory resident;
  char process_name[HD_NAME_SIZE];
  uint64_t pid;
  char *command_line; /* from the SnapshotHeader (live snapshots); NULL if it has none */
  /* From the SnapshotHeader: why the process could not be read ("": it was); such a snapshot
   * holds nothing else. */
  char not_read[160];
  hd_snapshot_allocation *allocations;
  size_t allocation_count, allocation_capacity;
  hd_snapshot_stack_trace *stack_traces;
  size_t stack_trace_count, stack_trace_capacity;
  hd_snapshot_thread *threads;
  size_t thread_count, thread_capacity;
  hd_snapshot_region *regions;
  size_t region_count, region_capacity;
  hd_snapshot_block *blocks;
  size_t block_count, block_capacity;
  hd_snapshot_known_location *known_locations;
  size_t known_location_count, known_location_capacity;
  hd_snapshot_root *roots; /* in the order they came */
  size_t root_count, root_capacity;
  /* The process's memory over time up to the snapshot (StatsSample), in the order they came:
   * time order from the collector. */
  heapdump_client_StatsSample *samples;
  size_t sample_count, sample_capacity;
  hd_u64_map allocation_index, stack_trace_index, thread_index, region_index, block_index;
  hd_u64_map known_location_index, root_index;
  /* Block and root bytes live in the reassembler's spill mapping, not the heap. */
  bool blocks_spilled;
} hd_snapshot;

struct hd_reassembler;
/* Called by hd_snapshot_receive after each batch, e.g. to show a progress line. */
typedef void (*hd_progress_fn)(void *ctx, const struct hd_reassembler *r);

typedef struct hd_reassembler {
  hd_snapshot **snapshots; /* one per SnapshotHeader, or a single one without headers */
  size_t snapshot_count, snapshot_capacity;
  size_t unknown_elements;                   /* variants this version does not know (skipped) */
  char error[160];                           /* what went wrong, for messages */
  uint64_t batches_received, bytes_received; /* counted by hd_snapshot_receive */
  hd_progress_fn progress;                   /* optional */
  void *progress_ctx;
  /* Block contents go to spill_fd instead of memory (hd_reassembler_spill_contents). */
  bool spilling;
  int spill_fd;
  uint64_t spill_end;
  void *spill_map; /* after hd_reassembler_finish: the file, read-only */
} hd_reassembler;

void hd_reassembler_init(hd_reassembler *r);
void hd_reassembler_destroy(hd_reassembler *r);
/* Drops every snapshot keep() says no to (for a caller that asked for more processes than it
 * wants). */
void hd_reassembler_keep(hd_reassembler *r, bool (*keep)(const hd_snapshot *s, void *ctx),
                         void *ctx);
/* Keeps block contents in the file fd (taken: an unlinked temporary file) rather than in memory,
 * so that a snapshot with contents may be larger than memory; hd_reassembler_finish maps the
 * file read-only and points each block's bytes into it. Call before adding elements. */
void hd_reassembler_spill_contents(hd_reassembler *r, int fd);
/* Adds one element (an hd_element_fn: pass the reassembler as ctx). */
HD_MUST_CHECK hd_status hd_reassembler_add(void *reassembler, const hd_element *e);
/* Checks every snapshot: each block's reassembled size equals its allocation's size and each
 * allocation's stack trace and thread exist. */
HD_MUST_CHECK hd_status hd_reassembler_finish(hd_reassembler *r);

/* Serves SnapshotReceiver on channel until the stream ends, acknowledging every batch and adding
 * its elements to r. multi_process must match the request: then the stream is a sequence of
 * (header batch, element batches, empty batch) ended by one more empty batch. On ReportError,
 * returns HD_OK with *error set (else *error is 0). Does not call hd_reassembler_finish. */
HD_MUST_CHECK hd_status hd_snapshot_receive(int channel, bool multi_process, hd_reassembler *r,
                                            uint32_t *error);

const hd_snapshot_allocation *hd_snapshot_find_allocation(const hd_snapshot *s, uint64_t address);
const hd_snapshot_stack_trace *hd_snapshot_find_stack_trace(const hd_snapshot *s, uint64_t key);
/* Whether the stack traces' peak_blocks and peak_bytes say what was live at the peak mark: a
 * snapshot from the collector when its stats have the mark (without it, the mark moved while
 * it was read, and those values mean nothing), a pprof profile (no stats) when some trace has
 * them. */
bool hd_snapshot_has_peak(const hd_snapshot *s);
/* The size of the block at an allocation's address: what its contents hold, and what a leak
 * check scans. Its size, or in a sampled snapshot (stats.sample_bytes) its size divided by its
 * count, the blocks it stands for. */
static inline uint64_t hd_snapshot_block_size(const hd_snapshot *s,
                                              const hd_snapshot_allocation *a) {
  return s->has_stats && s->stats.has_sample_bytes && a->count > 1 ? a->size / a->count : a->size;
}
const hd_snapshot_thread *hd_snapshot_find_thread(const hd_snapshot *s, uint64_t key);
const hd_snapshot_block *hd_snapshot_find_block(const hd_snapshot *s, uint64_t address);
const hd_snapshot_root *hd_snapshot_find_root(const hd_snapshot *s, uint64_t address);
/* Records the frames of a program address (copied); HD_ERR_REASSEMBLY if it has some already. */
HD_MUST_CHECK hd_status hd_snapshot_add_known_location(hd_snapshot *s, uint64_t address,
                                                       const hd_source_frame *frames, size_t count);
const hd_snapshot_known_location *hd_snapshot_find_known_location(const hd_snapshot *s,
                                                                  uint64_t address);

#ifdef __cplusplus
}
#endif
#endif
