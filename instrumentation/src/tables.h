/* Writer side of the shared-memory tables (layout: heapdump/contract/shm_layout.h):
 * alloc_table.c and res_table.c. Runs inside
 * the profiled process; no function here allocates heap memory or takes the loader lock.
 * Error convention: int-returning functions give 0 or a negative errno; insert gives an enum. */
#ifndef HEAPDUMP_INSTRUMENTATION_TABLES_H
#define HEAPDUMP_INSTRUMENTATION_TABLES_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/contract/shm_layout.h"
#include "owned_fd.h"

/* One live block as the writer sees it (what a node holds, unpacked). */
typedef struct hd_alloc_info {
  uint64_t address;
  uint64_t size;
  uint64_t timestamp;
  uint32_t thread_key;
  uint32_t stack_key;
  uint32_t flags;
} hd_alloc_info;

/* Free nodes a thread keeps for itself: most frees and allocations then touch no shared free
 * list. Bounded, and handed back when the thread exits. */
#define HD_THREAD_NODE_CACHE 32u
/* A thread adds its share of the live bytes to the process total (from which the peak is
 * taken) when the total may reach a new peak, or when its share drifts this far. */
#define HD_LIVE_DELTA_FLUSH ((int64_t)64 << 10)

/* The writer state one thread keeps for itself (in its TLS). Only that thread touches it, so
 * nothing in it needs an atomic instruction; functions take NULL where there is no thread. */
typedef struct hd_writer_thread {
  uint32_t counters_key; /* this thread's HD_REC_COUNTERS record, 0 = none (header base used) */
  uint32_t node_count;   /* entries of `nodes` in use */
  int64_t live_delta;    /* bytes allocated minus freed not yet added to the process total */
  bool retired;          /* the thread is exiting: shared paths only from now on */
  /* Allocations whose trace found another in its counters record's entry (res_table.c,
   * hd_res_count_alloc): every HD_PENDING_EVICT_EVERY-th takes the entry over. */
  uint32_t pending_misses;
  /* The address of this thread's latest recorded allocation, until the thread frees anything:
   * a free of it then is a temporary allocation (record.c, count_if_temporary). */
  uint64_t last_alloc_address;
  uint32_t nodes[HD_THREAD_NODE_CACHE]; /* free node indices owned by this thread */
} hd_writer_thread;

#define HD_NO_NODE UINT32_MAX /* "no node" where a node index is expected */
#define HD_NO_NODE_LINK 0u    /* end of the free list; its links are index + 1 */

typedef struct hd_alloc_table {
  hd_alloc_header *hdr; /* shared, read-write mapping of memfd */
  uint32_t *seq;        /* slot sequence counters / writer spinlocks */
  hd_alloc_node *nodes;
  uint64_t size; /* mapping size == memfd size */
  hd_owned_fd memfd;
  uint32_t slot_sleepers; /* threads asleep on a slot lock (alloc_table.c, slot_lock) */
  /* Private to the writer. free_top: Treiber stack of free nodes, (tag << 32) | link; the link
   * of a free node is kept in its shared `next` field, which readers ignore. */
  uint64_t free_top;
  /* Held by whoever locks the whole table (snapshot copy, fork).
   * Lock order: resources table lock -> world_lock -> slot locks in increasing order. */
  pthread_mutex_t world_lock;
} hd_alloc_table;

typedef enum hd_insert_result {
  HD_INSERT_NEW = 0,             /* a new record was written */
  HD_INSERT_FULL = 2,            /* no node left: nothing recorded */
  HD_INSERT_UNREPRESENTABLE = 3, /* an address or size a node cannot hold: nothing recorded */
} hd_insert_result;

/* Creates a sealed, sparse memfd of about max_bytes (clamped to a minimum) and maps it, with a
 * time_base of 0 (set it before the first insert). Returns 0 or -errno. */
int hd_alloc_table_create(hd_alloc_table *t, uint64_t max_bytes,
                          const char *memfd_name) HD_MUST_CHECK;
/* Unmaps and closes. */
void hd_alloc_table_destroy(hd_alloc_table *t);
/* Bytes a table needs to hold `nodes` nodes (for exact-size snapshot copies). */
uint64_t hd_alloc_table_bytes_for(uint64_t nodes);

/* Records info in a node of its own; HD_INSERT_NEW and *index set, or why not. w: the calling
 * thread's state, or NULL. */
hd_insert_result hd_alloc_table_insert(hd_alloc_table *t, hd_writer_thread *w,
                                       const hd_alloc_info *info, uint32_t *index) HD_MUST_CHECK;
/* A node taken for a record to come, HD_NO_NODE if none is left. Lock-free and without
 * syscalls: for signal handlers, which cannot take a slot lock (the hook they interrupted may
 * hold it). The record is written later by hd_alloc_table_fill, or the node given back by
 * hd_alloc_table_release (also safe in a handler). */
uint32_t hd_alloc_table_reserve(hd_alloc_table *t);
/* Records info in the reserved node index; false (and the node given back) if info cannot be
 * recorded. */
bool hd_alloc_table_fill(hd_alloc_table *t, hd_writer_thread *w, uint32_t index,
                         const hd_alloc_info *info) HD_MUST_CHECK;
void hd_alloc_table_release(hd_alloc_table *t, uint32_t index);
/* Erases the record of address from node index; true and *out filled (if non-NULL) if that node
 * held it. */
bool hd_alloc_table_erase(hd_alloc_table *t, hd_writer_thread *w, uint32_t index, uint64_t address,
                          hd_alloc_info *out) HD_MUST_CHECK;
/* Rewrites the record of info->address in node index in one critical section (in-place
 * realloc); true and *old filled (if non-NULL) if that node held it (false, and nothing changed,
 * if the new size cannot be recorded). */
bool hd_alloc_table_replace(hd_alloc_table *t, uint32_t index, const hd_alloc_info *info,
                            hd_alloc_info *old) HD_MUST_CHECK;

/* Stops every writer (world_lock + every slot lock); pair with unlock_all. */
void hd_alloc_table_lock_all(hd_alloc_table *t);
void hd_alloc_table_unlock_all(hd_alloc_table *t);
/* With src locked: creates dst (a new memfd of max_bytes, or exactly big enough when
 * max_bytes == 0) holding a copy of every live record of src, in the same nodes. Returns 0 or
 * -errno. */
HD_MUST_CHECK int hd_alloc_table_clone_locked(const hd_alloc_table *src, hd_alloc_table *dst,
                                              uint64_t max_bytes,
                                              const char *memfd_name) HD_MUST_CHECK;
/* With t locked (or private): the number and total requested size of the blocks its live
 * records stand for (each weighted by hd_sample_weight at sample_bytes; 0: each one block). */
void hd_alloc_table_sum_locked(const hd_alloc_table *t, uint64_t sample_bytes, uint64_t *blocks,
                               uint64_t *bytes);
/* Hands n of the thread's cached free nodes back to the table's shared free list. */
void hd_alloc_cache_spill(hd_alloc_table *t, hd_writer_thread *w, uint32_t n);
/* Turns t into a frozen snapshot: sets HD_ALLOC_FLAG_SNAPSHOT, unmaps, seals F_SEAL_WRITE too.
 * The memfd stays open (t->memfd); returns 0 or -errno. */
int hd_alloc_table_freeze(hd_alloc_table *t) HD_MUST_CHECK;

/* ---- resources table ---- */
typedef struct hd_res_table {
  hd_res_header *hdr;
  uint8_t *base;
  uint64_t size;
  hd_owned_fd memfd;
  pthread_mutex_t lock; /* serialises appends; see lock order above */
  /* Private dedup index of stack records (atomic pointer, see hd_dedup_index). */
  struct hd_dedup_index *dedup;
  uint64_t dedup_count;     /* under lock */
  uint64_t dedup_max_slots; /* the index doubles up to this */
  uint32_t counters_pool;   /* under lock: counters records of exited threads, linked through
                               writer_private */
  int64_t live_bytes;       /* atomic; process total of the threads' flushed live_delta */
  /* The peak mark, on a line of its own: every allocation and free reads peak_mark_end_ns, and
   * only a new mark (rare: each is 1% above the last) writes them. peak_mark_end_ns: the first
   * CLOCK_MONOTONIC time past the mark's units (0 before the first mark), so that "allocated by
   * the mark" (hd_peak_allocated_by) is one comparison: timestamp < peak_mark_end_ns. */
  uint64_t peak_mark_end_ns __attribute__((aligned(64))); /* atomic */
  uint64_t peak_mark;                                     /* atomic; the header's copy */
  uint64_t peak_mark_bytes;                               /* atomic; the header's copy */
  uint64_t start_time_ns;                                 /* the header's */
  uint32_t marking; /* atomic: a thread is setting a mark (the others do not wait) */
  /* atomic: a fork's prepare handler is copying the table; counters records' entries keep
   * their keys meanwhile (hd_res_fork_gate_close) */
  uint32_t fork_gate;
} hd_res_table;

int hd_res_table_create(hd_res_table *t, uint64_t max_bytes, const char *memfd_name) HD_MUST_CHECK;
void hd_res_table_destroy(hd_res_table *t);
/* With src->lock held (and its fork gate closed): a new table (new memfd, same size) with the
 * same records and counters but no dedup index; after fork the child moves its copy of src's index
 * over with hd_res_table_adopt_index (keys are offsets, identical in both). Returns 0 or -errno. */
int hd_res_table_clone_locked(const hd_res_table *src, hd_res_table *dst,
                              const char *memfd_name) HD_MUST_CHECK;
void hd_res_table_adopt_index(hd_res_table *dst, hd_res_table *src);

/* What identifies a trace besides its frames, as one number to seed its hashes with: its frame
 * count and its HD_STACK_* flags. */
static inline unsigned hd_trace_seed(unsigned count, unsigned flags) { return count | flags << 16; }

/* A 128-bit fingerprint of a trace (its frames, count and flags): what identifies a trace in
 * the dedup index and in the threads' caches of recent traces. 96 of its bits are compared
 * (all of lo, the high half of hi): two different traces are taken for one with a probability
 * of about n^2 / 2^97 for n distinct traces, under 10^-18 for a million. */
typedef struct hd_trace_print {
  uint64_t lo, hi;
} hd_trace_print;

/* The high and low halves of a 64x64-bit product folded together: one multiply mixes two
 * words, so a 64-frame trace is fingerprinted in 32 dependent steps per lane. */
static inline uint64_t hd_fold_mul(uint64_t a, uint64_t b) {
  __uint128_t p = (__uint128_t)a * b;
  return (uint64_t)p ^ (uint64_t)(p >> 64);
}

/* Two independent lanes, each over every frame, each 64 bits: the lanes run in parallel.
 * Inline: the hooks fingerprint every trace they did not reuse. */
static inline hd_trace_print hd_trace_fingerprint(const uint64_t *frames, unsigned count,
                                                  unsigned flags) {
  uint64_t seed = hd_trace_seed(count, flags);
  uint64_t a = UINT64_C(0x243F6A8885A308D3) ^ seed, b = UINT64_C(0x13198A2E03707344) ^ (seed << 32);
  unsigned i = 0;
  for (; i + 1 < count; i += 2) {
    uint64_t f0 = frames[i], f1 = frames[i + 1];
    a = hd_fold_mul(a ^ f0, UINT64_C(0xA0761D6478BD642F) ^ f1);
    b = hd_fold_mul(b ^ f1, UINT64_C(0xE7037ED1A0B428DB) ^ f0);
  }
  if (i < count) {
    a = hd_fold_mul(a ^ frames[i], UINT64_C(0x8EBC6AF09C88C6E3));
    b = hd_fold_mul(b ^ frames[i], UINT64_C(0x589965CC75374CC3));
  }
  return (hd_trace_print){hd_fold_mul(a, UINT64_C(0x1D8E4E27C47D124F)),
                          hd_fold_mul(b, UINT64_C(0x9E3779B97F4A7C15))};
}

/* Returns the key of the (deduplicated) trace, or 0 if the table is full (counted). flags:
 * HD_STACK_* (part of the trace's identity). */
uint32_t hd_res_intern_stack(hd_res_table *t, const uint64_t *frames, unsigned count,
                             unsigned flags);
/* Same, with the trace's fingerprint already computed (hd_trace_fingerprint); count is at
 * most HD_MAX_FRAMES. */
uint32_t hd_res_intern_stack_print(hd_res_table *t, const uint64_t *frames, unsigned count,
                                   unsigned flags, hd_trace_print print);
/* Same, for signal handlers: a trace not yet stored whose lock is taken (possibly by the code
 * the handler interrupted) gets key 0, counted as dropped, instead of waiting. */
uint32_t hd_res_intern_stack_nowait(hd_res_table *t, const uint64_t *frames, unsigned count,
                                    unsigned flags);
uint32_t hd_res_add_thread(hd_res_table *t, uint32_t tid, const char *name, uint64_t timestamp);
/* Records that [start, start + size) was mapped or unmapped (hd_rec_mapping, kind HD_MAPPING_*);
 * false if the table is full (counted in the header's mapping_records_lost). The _locked form
 * is for a caller that holds t->lock. */
bool hd_res_add_mapping(hd_res_table *t, uint32_t kind, bool mapped, uint64_t start, uint64_t size);
bool hd_res_add_mapping_locked(hd_res_table *t, uint32_t kind, bool mapped, uint64_t start,
                               uint64_t size);
/* The thread's stack bounds and thread pointer (hd_rec_thread_roots); 0 if the table is full. */
uint32_t hd_res_add_thread_roots(hd_res_table *t, uint32_t tid, uint64_t stack_lo,
                                 uint64_t stack_hi, uint64_t thread_pointer);
typedef struct hd_region_info {
  uint64_t address, size, file_offset, vaddr;
  uint8_t build_id[HD_MAX_BUILD_ID];
  unsigned build_id_len;
  const char *name;
} hd_region_info;
uint32_t hd_res_add_region(hd_res_table *t, const hd_region_info *r);

/* Gives w a counters record of its own (reused from an exited thread if one is free); false if
 * the table is full, and w keeps counting into the header's base. */
bool hd_res_attach_counters(hd_res_table *t, hd_writer_thread *w);
/* Statistics and per-trace counters: no lock; with w's counters record, no locked instruction
 * either while the trace is one of those the record holds counts of (hd_pending_trace), except
 * the trace's two counts of blocks live at the peak mark (a free of such a block) and (rarely)
 * the peak. w may be NULL. */
/* blocks, bytes: what the block stands for (1 and its size, or a sampled block's
 * hd_sample_weight k and k times its size). timestamp: the block's (hd_alloc_info, never 0); the
 * one that sets a new peak mark gives it its time. */
void hd_res_count_alloc(hd_res_table *t, hd_writer_thread *w, uint32_t stack_key, uint64_t blocks,
                        uint64_t bytes, uint64_t timestamp);
/* blocks, bytes: as the allocation counted them; stack_key, timestamp: the freed block's (a
 * block allocated by the peak mark is counted in its trace's peak_freed_*). */
void hd_res_count_free(hd_res_table *t, hd_writer_thread *w, uint64_t blocks, uint64_t bytes,
                       uint32_t stack_key, uint64_t timestamp);
/* A new block's timestamp: now, or just after the peak mark if now is not later by the mark's
 * units (a coarse clock can read the same tick), so that no block allocated after a mark counts
 * as live at it. */
static inline uint64_t hd_res_timestamp_after_mark(const hd_res_table *t, uint64_t now) {
  const uint64_t after = __atomic_load_n(&t->peak_mark_end_ns, __ATOMIC_RELAXED);
  return now < after ? after : now;
}
/* A block of trace stack_key was freed by its thread before that thread allocated or freed
 * anything else. */
void hd_res_count_temporary(hd_res_table *t, const hd_writer_thread *w, uint32_t stack_key,
                            uint64_t blocks);
/* Around the copy of t by a fork's prepare handler (t->lock held): no thread changes a counters
 * record's keys between them. self, if not NULL, is the forking thread, whose record is not
 * waited for: false if it is in the middle of a change (a signal handler forked from inside
 * one), and then a copy would be wrong. */
bool hd_res_fork_gate_close(hd_res_table *t, const hd_writer_thread *self) HD_MUST_CHECK;
void hd_res_fork_gate_open(hd_res_table *t);
void hd_res_count_drop(hd_res_table *t, size_t field_offset_in_stats);
/* One more stack our unwinder could not describe by call-frame information alone
 * (hd_res_header.stacks_beyond_cfi). */
void hd_res_count_beyond_cfi(hd_res_table *t);
/* One more free of a block whose tag the program had overwritten (hd_res_header.overwritten_tags).
 */
void hd_res_count_overwritten_tag(hd_res_table *t);
/* Publishes how many loaded modules' unwind tables were refused (unwind_tables_refused). */
void hd_res_set_unwind_tables_refused(hd_res_table *t, unsigned modules);
/* The process statistics: header base plus every thread's counters (see shm_layout.h). */
void hd_res_read_stats(const hd_res_table *t, hd_stats_block *out);
/* At thread exit: its live share joins the total, its free nodes and counters record go back
 * for other threads; w is retired (later calls from the thread use the shared paths). */
void hd_writer_thread_retire(hd_alloc_table *a, hd_res_table *r, hd_writer_thread *w);
/* Makes the statistics of a private copy agree with the live set it goes with: the counters
 * are updated outside the table locks, so a copy can miss updates that threads were about to
 * make (and in a fork child never will). Sets the freed counters (raising the allocated ones
 * if needed) so that allocated - freed equals the live set. */
void hd_res_reconcile_live(hd_res_table *t, uint64_t live_blocks, uint64_t live_bytes);

#endif /* HEAPDUMP_INSTRUMENTATION_TABLES_H */
