/* The hot path: what one allocation, free or realloc records (its stack trace, thread and
 * time, in a node of the allocations table) and the block's tag, which says which node records
 * the block. Called by the shim (preload.c) with the thread marked as inside a hook. */
#define _GNU_SOURCE
#include "runtime.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "stack.h"

/* Re-reads this thread's name: at its first allocation, after a rename seen by the prctl and
 * pthread_setname_np hooks, and every HD_NAME_RECHECK_ALLOCATIONS allocations (renames through
 * /proc/self/task/TID/comm reach no hook). A full table keeps the old key until the next read. */
__attribute__((noinline)) static uint32_t refresh_thread_key(uint32_t gen) {
  hd_tls.name_gen = gen;
  hd_tls.name_countdown = HD_NAME_RECHECK_ALLOCATIONS;
  char name[HD_THREAD_NAME_MAX] = {0};
  if (hd_tls.tid == 0) hd_tls.tid = (uint32_t)syscall(SYS_gettid);
  syscall(SYS_prctl, PR_GET_NAME, name, 0, 0, 0); /* not prctl(): we interpose it */
  name[HD_THREAD_NAME_MAX - 1] = 0;
  if (hd_tls.writer.counters_key == 0 && !hd_tls.writer.retired &&
      hd_res_attach_counters(&hd_live_res, &hd_tls.writer)) {
    hd_watch_thread_exit();
  }
  if (hd_tls.thread_key == 0) {
    /* Once per thread: where its stack and TLS are, roots of a leak check. */
    uintptr_t lo = 0, hi = 0;
    if (!hd_thread_stack(&lo, &hi)) lo = hi = 0;
    hd_res_add_thread_roots(&hd_live_res, hd_tls.tid, lo, hi, (uint64_t)__builtin_thread_pointer());
  }
  if (hd_tls.thread_key == 0 || strcmp(name, hd_tls.name) != 0) {
    uint32_t key = hd_res_add_thread(&hd_live_res, hd_tls.tid, name, hd_now_ns());
    if (key != 0) {
      hd_tls.thread_key = key;
      memcpy(hd_tls.name, name, sizeof(name));
    }
  }
  return hd_tls.thread_key;
}

static uint32_t current_thread_key(void) {
  uint32_t gen = __atomic_load_n(&hd_name_generation, __ATOMIC_RELAXED);
  if (HD_LIKELY(hd_tls.name_countdown != 0 && hd_tls.name_gen == gen)) {
    hd_tls.name_countdown--;
    return hd_tls.thread_key;
  }
  return refresh_thread_key(gen);
}

/* The key of a trace, through this thread's cache of recently used ones. */
static uint32_t trace_key(const uint64_t *frames, unsigned n, unsigned flags) {
  hd_trace_print print = hd_trace_fingerprint(frames, n, flags);
  hd_trace_cache_entry *e = &hd_tls.traces[print.lo & (HD_TRACE_CACHE_ENTRIES - 1)];
  if (e->key != 0 && e->print_lo == print.lo && e->print_hi == (uint32_t)(print.hi >> 32))
    return e->key;
  uint32_t key = hd_res_intern_stack_print(&hd_live_res, frames, n, flags, print);
  if (key != 0) {
    e->key = key;
    e->print_lo = print.lo;
    e->print_hi = (uint32_t)(print.hi >> 32);
  }
  return key;
}

static void make_info(hd_alloc_info *info, void *p, size_t size, unsigned lg_align) {
  uint64_t frames[HD_MAX_FRAMES];
  bool truncated;
  uint32_t *known_key;
  unsigned n = hd_capture_stack(frames, false, &truncated, &known_key);
  info->address = (uint64_t)(uintptr_t)p;
  info->size = size;
  /* A reused trace comes with the key interned for it last time: no fingerprint, no lookup. */
  if (known_key != NULL && *known_key != 0) {
    info->stack_key = *known_key;
  } else {
    info->stack_key = trace_key(frames, n, truncated ? HD_STACK_TRUNCATED : 0);
    if (known_key != NULL) *known_key = info->stack_key;
  }
  info->thread_key = current_thread_key();
  info->timestamp = hd_res_timestamp_after_mark(&hd_live_res, hd_now_ns());
  info->flags = lg_align & HD_NODE_ALIGN_MASK;
  /* No lock is held here, and the capture above is where a hook spends most of its time, so
   * where signal handlers are most likely to have queued work: apply it now, not only at the
   * end of the hook, so that a signal storm fills the queue less. */
  if (HD_UNLIKELY(__atomic_load_n(&hd_tls.pending_count, __ATOMIC_RELAXED) != 0))
    hd_drain_pending();
}

/* ---- sampled recording (HEAPDUMP_SAMPLE_BYTES, hd_sample_weight) */

/* The next of this thread's random numbers (xorshift64*), seeded at its first use. */
static uint64_t next_random(void) {
  uint64_t x = hd_tls.sample_random;
  if (HD_UNLIKELY(x == 0)) {
    if (hd_tls.tid == 0) hd_tls.tid = (uint32_t)syscall(SYS_gettid);
    x = (hd_now_ns() ^ (uint64_t)hd_tls.tid << 32 ^ (uint64_t)(uintptr_t)&hd_tls) | 1; /* never 0 */
  }
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  hd_tls.sample_random = x;
  return x * UINT64_C(0x2545F4914F6CDD1D);
}

/* ln(u) for 0 < u <= 1 without libm: u = m 2^e with 1/2 <= m < 1, and ln m = 2 atanh(t) with
 * t = (m - 1) / (m + 1), |t| <= 1/3, whose series has converged to a double's precision by
 * t^41. */
static double log_unit(double u) {
  int e = 0;
  while (u < 0.5) {
    u *= 2;
    e--;
  }
  const double t = (u - 1) / (u + 1), t2 = t * t;
  double power = t, sum = 0;
  for (int i = 1; i <= 41; i += 2) {
    sum += power / i;
    power *= t2;
  }
  return 2 * sum + e * 0.69314718055994530942;
}

/* Bytes until the next recorded block: exponential of mean hd_sample_bytes, at least 1. */
static int64_t draw_sample_interval(void) {
  const double u = (double)((next_random() >> 11) + 1) * (1.0 / 9007199254740992.0); /* (0, 1] */
  const double bytes = -log_unit(u) * (double)hd_sample_bytes;
  return bytes < 1 ? 1 : bytes > 9e18 ? INT64_MAX : (int64_t)bytes;
}

uint32_t hd_record_filter;

/* Paused: left out. Sampled: left out while this thread's countdown of bytes to its next sample
 * point has not run out; the allocation that uses it up is recorded, and a new interval is
 * drawn (the process is memoryless, so where the point fell inside the block does not matter).
 * A process that was armed comes here at every allocation, to see the collector's requests. */
hd_record_choice hd_choose_slow(size_t size) {
  hd_arm_poll(); /* an armed process's next request */
  const uint32_t filter = __atomic_load_n(&hd_record_filter, __ATOMIC_RELAXED);
  if (filter & HD_FILTER_PAUSED) return HD_UNATTRIBUTED;
  if (!(filter & HD_FILTER_SAMPLED)) return HD_RECORD;
  if (HD_UNLIKELY(hd_tls.sample_countdown == 0))
    hd_tls.sample_countdown = draw_sample_interval(); /* the thread's first */
  if (HD_LIKELY(hd_countdown_leaves_out(size))) return HD_SAMPLED_OUT;
  hd_tls.sample_countdown = draw_sample_interval();
  return HD_RECORD;
}

/* The blocks a recorded block stands for: 1, or its sampling weight. */
static uint64_t blocks_of(const hd_alloc_info *info) {
  return hd_sample_weight(info->address, info->timestamp, info->size, hd_sample_bytes);
}

/* ---- the block's tag */

/* The last HD_TAG_BYTES of every block's usable size, past what the program asked for (the
 * backend allocates that much more, and malloc_usable_size answers that much less): a check of
 * the link against the block's address, then the link (node index + 1, 0 = not recorded,
 * TAG_FREED once freed) of the node that records the block. A free finds its node from the tag,
 * so the table needs no index.
 *
 * The check catches a program that wrote past its block onto the tag; the overwrite is counted.
 * The link comes last, so an overwrite of up to four bytes (a string's terminator one past its
 * end) leaves it whole, and the free still finds its node: the table erases a node only if it
 * records this very address, so a link the program changed erases nothing. Then, and only then,
 * the block's record stays in the table (it shows as live), so that every free costs the same
 * whatever the program wrote. */
typedef struct block_tag {
  uint32_t check;
  uint32_t link;
} block_tag;

/* The link of a freed block: no node has it (a table holds fewer than 2^32 - 2), so a second free
 * of the block, which finds it with a valid check, is a double free. */
#define TAG_FREED UINT32_MAX
/* The link of a block allocated while recording was paused: not recorded, its bytes counted as
 * unattributed until it is freed. */
#define TAG_UNATTRIBUTED (UINT32_MAX - 1)

/* Set once a dormant process is armed, or at init for sampling on glibc: blocks without a tag
 * (allocated before arming; left out by sampling) may be freed from now on. A tag whose check
 * fails is then most likely one of those (its bytes are the program's), and is counted as an
 * overwrite only if its link does find the block's node. */
static bool g_untagged_blocks;
/* Blocks without a tag are from before arming, their bytes counted as unattributed until freed
 * (not so those sampling left out: take_record). */
static bool g_untagged_unattributed;
bool hd_sampled_out_untagged;

static void add_unattributed(int64_t bytes) {
  __atomic_fetch_add(&hd_live_res.hdr->unattributed_bytes, (uint64_t)bytes, __ATOMIC_RELAXED);
}

static uint32_t tag_check(uint64_t address, uint32_t link) {
  uint64_t h = (address ^ ((uint64_t)link << 32) ^ UINT64_C(0x2545F4914F6CDD1D)) *
               UINT64_C(0x9E3779B97F4A7C15);
  return (uint32_t)(h >> 32);
}

static block_tag *tag_at(void *p, size_t usable) {
  return (block_tag *)((char *)p + usable - HD_TAG_BYTES);
}

static bool tag_valid(const void *p, block_tag tag) {
  return tag.check == tag_check((uint64_t)(uintptr_t)p, tag.link);
}

/* A tag of ours. Where every block has one, the check decides. Where sampling leaves blocks
 * without one, their ends are the program's bytes, which pass the check about once in 2^32
 * reads: there the link must also be one a tag of ours holds (none, or a node handed out; freed
 * marks fail their check in that mode), which leaves about one in 2^64. */
static bool tag_ours(const void *p, block_tag tag) {
  if (!tag_valid(p, tag)) return false;
  if (!hd_sampled_out_untagged || tag.link == 0) return true;
  return hd_live_alloc.hdr != NULL &&
         tag.link - 1 < __atomic_load_n(&hd_live_alloc.hdr->node_high_water, __ATOMIC_RELAXED);
}

/* ---- which blocks carry a tag, where sampling leaves most without one ----
 *
 * A count per bucket of addresses of the blocks that carry a valid tag: moved when a tag is
 * written where none was and when one is made to fail its check. A free whose bucket holds 0
 * knows the block has no tag (so no record) without touching it. Saturated counts stay: their
 * buckets only ever take the longer path. */
uint8_t hd_tagged_count[HD_TAGGED_BUCKETS];

static void tagged_move(const void *p, int delta) {
  uint8_t *count = &hd_tagged_count[hd_tagged_bucket(p)];
  uint8_t old = __atomic_load_n(count, __ATOMIC_RELAXED);
  do {
    if (old == UINT8_MAX || (delta < 0 && old == 0)) return;
  } while (!__atomic_compare_exchange_n(count, &old, (uint8_t)(old + delta), true, __ATOMIC_RELEASE,
                                        __ATOMIC_RELAXED));
}

static void tag_write(void *p, size_t usable, uint32_t link) {
  block_tag *tag = tag_at(p, usable);
  if (hd_sampled_out_untagged && !tag_ours(p, *tag)) tagged_move(p, +1);
  tag->link = link;
  tag->check = tag_check((uint64_t)(uintptr_t)p, link);
}

/* usable: the block's usable size where the caller has it, which spares the lookup. */
void hd_tag_set_at(void *p, size_t usable, uint32_t index) {
  tag_write(p, usable, index == HD_NO_NODE ? 0 : index + 1);
}

void hd_tag_set(void *p, uint32_t index) { hd_tag_set_at(p, hd_backend_usable(p), index); }

void hd_leave_out(void *p, size_t usable, hd_record_choice choice) {
  if (choice != HD_UNATTRIBUTED) {
    hd_tag_set_at(p, usable, HD_NO_NODE);
    return;
  }
  tag_write(p, usable, TAG_UNATTRIBUTED);
  add_unattributed((int64_t)hd_backend_footprint(p));
}

void hd_note_untagged_blocks(void) {
  g_untagged_blocks = true;
  g_untagged_unattributed = true;
}

void hd_note_sampled_out_untagged(void) {
  g_untagged_blocks = true;
  hd_sampled_out_untagged = true;
}

/* A block freed twice: the program's heap is corrupt from here on (the allocator would hand the
 * block out twice), so it ends as glibc ends it, with a message and SIGABRT. */
__attribute__((noreturn, cold)) static void double_free(const char *call, void *p) {
  char message[160];
  const int n =
      snprintf(message, sizeof message,
               "%s: double free detected (heapdump: block %p was freed before)\n", call, p);
  if (n > 0 && write(STDERR_FILENO, message, (size_t)n) < 0) {
  }
  abort();
}

/* The node recording block p (of the usable size given), or HD_NO_NODE if it is not recorded;
 * call names the program's call, for a double free. *unattributed: the block's bytes are counted
 * as unattributed if it has no record (a block of a paused process, or one without a tag). */
static uint32_t node_of_at(void *p, size_t usable, const char *call, bool *unattributed) {
  const block_tag tag = *tag_at(p, usable);
  const uint64_t address = (uint64_t)(uintptr_t)p;
  if (HD_LIKELY(tag.check == tag_check(address, tag.link))) {
    if (HD_UNLIKELY(tag.link >= TAG_UNATTRIBUTED)) {
      /* A block without a tag may end in what reads as a freed block's tag. */
      if (tag.link == TAG_FREED && !g_untagged_blocks) double_free(call, p);
      *unattributed = true;
      return HD_NO_NODE;
    }
    return tag.link == 0 ? HD_NO_NODE : tag.link - 1;
  }
  if (g_untagged_blocks)
    *unattributed = true;
  else
    hd_res_count_overwritten_tag(&hd_live_res);
  return tag.link == 0 || tag.link >= TAG_UNATTRIBUTED ? HD_NO_NODE : tag.link - 1;
}

/* Marks block p freed, before it goes back to the allocator. Where sampling leaves blocks
 * untagged, glibc may hand the same chunk out again for one, whose end would still read as this
 * valid tag (malloc_usable_size would then answer 8 bytes short): the mark fails the check. */
static void tag_freed(void *p, size_t usable) {
  block_tag *tag = tag_at(p, usable);
  if (hd_sampled_out_untagged && tag_ours(p, *tag)) tagged_move(p, -1);
  tag->link = TAG_FREED;
  tag->check = tag_check((uint64_t)(uintptr_t)p, TAG_FREED) ^ (uint32_t)hd_sampled_out_untagged;
}

uint64_t hd_tag_clear(void *p) {
  if (!hd_sampled_out_untagged || !hd_tagged_maybe(p)) return 0;
  /* Only a tag of ours: the end of a block without one is the program's, still live. */
  const size_t usable = hd_backend_usable(p);
  const block_tag tag = *tag_at(p, usable);
  if (!tag_ours(p, tag)) return 0;
  tag_freed(p, usable);
  uint64_t saved;
  memcpy(&saved, &tag, sizeof saved);
  return saved;
}

void hd_tag_restore(void *p, uint64_t saved) {
  if (saved == 0) return;
  block_tag tag;
  memcpy(&tag, &saved, sizeof tag);
  tag_write(p, hd_backend_usable(p), tag.link);
}

static uint32_t node_of(void *p, const char *call) {
  bool unattributed = false; /* only the system backend, not this caller's, has such blocks */
  return node_of_at(p, hd_backend_usable(p), call, &unattributed);
}

/* Records info in a node; the node, or HD_NO_NODE if the table could not (counted). */
static uint32_t insert_info(const hd_alloc_info *info) {
  hd_writer_thread *w = &hd_tls.writer;
  uint32_t index;
  /* An allocation even if it cannot be recorded: the block before it is not the latest. */
  w->last_alloc_address = info->address;
  if (hd_alloc_table_insert(&hd_live_alloc, w, info, &index) != HD_INSERT_NEW) {
    hd_res_count_drop(&hd_live_res, offsetof(hd_stats_block, dropped_allocations));
    return HD_NO_NODE;
  }
  const uint64_t blocks = blocks_of(info);
  hd_res_count_alloc(&hd_live_res, w, info->stack_key, blocks, blocks * info->size,
                     info->timestamp);
  return index;
}

/* A recorded block (old) is being freed by this thread, whose latest allocation before this
 * moment was at last_alloc_address (0 once the thread freed anything after it): a temporary
 * allocation if that was this very block: freed with no allocation nor free in between, as
 * profilers usually define it, but per thread rather than across the process (a thread's
 * sequence is what the code shows). */
static void count_if_temporary(const hd_alloc_info *old, uint64_t blocks,
                               uint64_t last_alloc_address) {
  /* The thread check keeps out a block of this address that another thread allocated after
   * this thread's block was freed elsewhere. */
  if (old->address != last_alloc_address || old->thread_key != hd_tls.thread_key) return;
  hd_res_count_temporary(&hd_live_res, &hd_tls.writer, old->stack_key, blocks);
}

/* Counts the free of a recorded block whose record was taken out (old). */
static void count_freed(const hd_alloc_info *old, uint64_t last_alloc_address) {
  const uint64_t blocks = blocks_of(old);
  hd_res_count_free(&hd_live_res, &hd_tls.writer, blocks, blocks * old->size, old->stack_key,
                    old->timestamp);
  count_if_temporary(old, blocks, last_alloc_address);
}

/* Whether the tables take new blocks; if not, p is tagged as not recorded. */
static inline bool recording_now(void *p, size_t usable) {
  hd_backend_publish_waiting_mappings(); /* what the allocator may have mapped for p */
  if (HD_UNLIKELY(__atomic_load_n(&hd_state, __ATOMIC_RELAXED) != HD_STATE_READY)) {
    hd_tag_set_at(p, usable, HD_NO_NODE);
    return false;
  }
  return true;
}

static inline void record_as(void *p, size_t size, unsigned lg_align, size_t usable,
                             hd_record_choice choice) {
  if (choice != HD_RECORD) {
    hd_tls.writer.last_alloc_address = (uint64_t)(uintptr_t)p; /* see count_if_temporary */
    hd_leave_out(p, usable, choice);
    return;
  }
  hd_alloc_info info;
  make_info(&info, p, size, lg_align);
  hd_tag_set_at(p, usable, insert_info(&info));
}

void hd_record_alloc(void *p, size_t size, unsigned lg_align, size_t usable) {
  if (recording_now(p, usable)) record_as(p, size, lg_align, usable, hd_choose(size));
}

void hd_record_chosen(void *p, size_t size, unsigned lg_align, size_t usable,
                      hd_record_choice choice) {
  if (recording_now(p, usable)) record_as(p, size, lg_align, usable, choice);
}

/* Takes the record of block p (of the usable size given) out of the table, uncounted; true and
 * *old filled if it had one. *unattributed: it had none, and its bytes are counted as
 * unattributed (the caller takes them off once the block is gone). */
__attribute__((always_inline)) static inline bool take_record(void *p, size_t usable,
                                                              const char *call, hd_alloc_info *old,
                                                              bool *unattributed) {
  *unattributed = false;
  if (__atomic_load_n(&hd_state, __ATOMIC_RELAXED) != HD_STATE_READY) return false;
  const uint32_t index = node_of_at(p, usable, call, unattributed);
  if (index != HD_NO_NODE &&
      hd_alloc_table_erase(&hd_live_alloc, &hd_tls.writer, index, (uint64_t)(uintptr_t)p, old)) {
    if (HD_UNLIKELY(*unattributed)) hd_res_count_overwritten_tag(&hd_live_res); /* see above */
    *unattributed = false;
    return true;
  }
  /* Without a tag and without a record: from before arming, or left out by sampling (whose
   * bytes the sampled blocks' weights stand for). */
  if (!g_untagged_unattributed) *unattributed = false;
  return false;
}

size_t hd_program_usable(void *p) {
  const size_t usable = hd_backend_usable(p);
  if (HD_LIKELY(!g_untagged_blocks)) return usable - HD_TAG_BYTES;
  if (hd_sampled_out_untagged && !hd_tagged_maybe(p)) return usable;
  /* Armed late, or sampled on glibc: a block without a tag of ours is all the program's. */
  return tag_ours(p, *tag_at(p, usable)) ? usable - HD_TAG_BYTES : usable;
}

/* last_alloc_address: this thread's latest allocation before the free (see
 * count_if_temporary). */
static void free_recorded_at(void *p, size_t usable, const char *call,
                             uint64_t last_alloc_address) {
  hd_alloc_info old;
  bool unattributed;
  /* Erased before the block goes back: its address cannot be reused while still recorded. */
  const bool recorded = take_record(p, usable, call, &old, &unattributed);
  if (HD_UNLIKELY(unattributed)) add_unattributed(-(int64_t)hd_backend_footprint(p));
  tag_freed(p, usable);
  hd_tls.writer.last_alloc_address = 0;
  if (recorded) {
    count_freed(&old, last_alloc_address);
    hd_backend_free(p, old.size ? old.size : 1, old.flags & HD_NODE_ALIGN_MASK);
    return;
  }
  /* Unrecorded (sampled out, or from before recording): its usable size is its size class, a
   * valid size for a sized free, which spares the allocator a second lookup. */
  hd_backend_free(p, usable - HD_TAG_BYTES, 0);
}

/* Whether link (a tag's, its check not trusted) names a node that records block p now. Read
 * without the slot's lock: only p's free, which is this caller's, erases that record. */
static bool link_records(const void *p, uint32_t link) {
  return __atomic_load_n(&hd_state, __ATOMIC_RELAXED) == HD_STATE_READY && link != 0 &&
         link - 1 < __atomic_load_n(&hd_live_alloc.hdr->node_high_water, __ATOMIC_RELAXED) &&
         hd_node_address(__atomic_load_n(&hd_live_alloc.nodes[link - 1].address_word,
                                         __ATOMIC_RELAXED)) == (uint64_t)(uintptr_t)p;
}

/* Sampling on glibc: block p (of the usable size given) has no tag of ours and no record, so
 * all of it is the program's. */
static bool untagged_unrecorded(void *p, size_t usable) {
  const block_tag tag = *tag_at(p, usable);
  if (tag_ours(p, tag)) return false;
  /* A recorded block whose check the program overwrote: its link may still find its node. */
  return !link_records(p, tag.link);
}

bool hd_free_if_untagged(void *p) {
  if (!untagged_unrecorded(p, hd_backend_usable(p))) return false;
  hd_sampled_out_forget_last();
  hd_glibc_free(p); /* glibc's free, as the backend's */
  return true;
}

void hd_free_recorded(void *p) {
  free_recorded_at(p, hd_backend_usable(p), "free()", hd_tls.writer.last_alloc_address);
}

/* Sampling on glibc, a block without a tag: glibc's realloc alone while the new size is left
 * out by sampling (the common case), else a new tagged block, recorded, and the old one freed. */
static void *realloc_untagged(void *p, size_t size) {
  const hd_record_choice choice = hd_choose(size);
  if (HD_LIKELY(choice == HD_SAMPLED_OUT)) {
    hd_sampled_out_forget_last();
    void *q = hd_backend_realloc_untagged(p, size);
    if (q == NULL) errno = ENOMEM;
    return q;
  }
  size_t usable;
  void *q = hd_backend_alloc(size, 0, false, &usable);
  if (q == NULL) {
    errno = ENOMEM;
    return NULL;
  }
  const size_t old_usable = hd_backend_usable(p); /* all the program's: no tag */
  memcpy(q, p, old_usable < size ? old_usable : size);
  hd_record_chosen(q, size, 0, usable, choice);
  hd_glibc_free(p);
  return q;
}

void *hd_realloc_recorded(void *p, size_t size) {
  bool on = __atomic_load_n(&hd_state, __ATOMIC_RELAXED) == HD_STATE_READY;
  if (hd_use_system) {
    if (hd_sampled_out_untagged &&
        (!hd_tagged_maybe(p) || untagged_unrecorded(p, hd_backend_usable(p)))) {
      return realloc_untagged(p, size);
    }
    /* glibc decides in place vs moving inside realloc: the record is taken out first (so a
     * moved-from address never stays recorded) and restored if realloc fails. */
    hd_alloc_info old;
    bool unattributed;
    const bool had = take_record(p, hd_backend_usable(p), "realloc()", &old, &unattributed);
    const size_t footprint = unattributed ? hd_backend_footprint(p) : 0;
    const uint64_t tag = hd_tag_clear(p); /* glibc frees p if it moves the block */
    void *q = hd_backend_realloc(p, size);
    if (!q) {
      /* p is unchanged: recorded again under a new node (its counters never moved), or marked
       * as not recorded (and counted freed) if the table cannot take it again. A block without
       * a tag of ours keeps its end as it was (it may be the program's own bytes). */
      if (had) {
        uint32_t again = HD_NO_NODE;
        if (hd_alloc_table_insert(&hd_live_alloc, &hd_tls.writer, &old, &again) != HD_INSERT_NEW)
          count_freed(&old, 0);
        hd_tag_set(p, again); /* a recorded block has room for its tag */
      } else {
        hd_tag_restore(p, tag);
      }
      errno = ENOMEM;
      return NULL;
    }
    if (unattributed) add_unattributed(-(int64_t)footprint);
    if (had) count_freed(&old, hd_tls.writer.last_alloc_address);
    hd_record_alloc(q, size, 0, hd_backend_usable(q));
    return q;
  }
  if (!hd_backend_grants(size)) {
    errno = ENOMEM;
    return NULL;
  }
  /* The tag moves with the block's end: read it before the resize. */
  const uint32_t index = on ? node_of(p, "realloc()") : HD_NO_NODE;
  /* Read before make_info, which may apply what a signal handler queued. */
  const uint64_t last_alloc_address = hd_tls.writer.last_alloc_address;
  const size_t resized_usable = hd_backend_resize_in_place(p, size);
  if (resized_usable != 0) {
    if (!on) {
      hd_tag_set_at(p, resized_usable, HD_NO_NODE);
      return p;
    }
    hd_alloc_info info, old;
    const hd_record_choice choice = hd_choose(size);
    if (choice != HD_RECORD) {
      /* The block of the new size is not sampled: its old record, if any, goes. */
      if (index != HD_NO_NODE &&
          hd_alloc_table_erase(&hd_live_alloc, &hd_tls.writer, index, (uint64_t)(uintptr_t)p, &old))
        count_freed(&old, last_alloc_address);
      hd_tls.writer.last_alloc_address = (uint64_t)(uintptr_t)p;
      hd_leave_out(p, resized_usable, choice);
      return p;
    }
    /* Same address: one record rewritten in one critical section. */
    make_info(&info, p, size, 0);
    if (index != HD_NO_NODE && hd_alloc_table_replace(&hd_live_alloc, index, &info, &old)) {
      count_freed(&old, last_alloc_address);
      const uint64_t blocks = blocks_of(&info);
      hd_res_count_alloc(&hd_live_res, &hd_tls.writer, info.stack_key, blocks, blocks * size,
                         info.timestamp);
      hd_tls.writer.last_alloc_address = info.address;
      hd_tag_set_at(p, resized_usable, index);
    } else {
      /* Not recorded, or its new size cannot be: its old record must not outlive it. */
      if (index != HD_NO_NODE &&
          hd_alloc_table_erase(&hd_live_alloc, &hd_tls.writer, index, info.address, &old))
        count_freed(&old, last_alloc_address);
      hd_tag_set_at(p, resized_usable, insert_info(&info));
    }
    return p;
  }
  size_t usable;
  void *q = hd_backend_alloc(size, 0, false, &usable);
  if (!q) {
    errno = ENOMEM;
    return NULL;
  }
  const size_t old_usable = hd_backend_usable(p);
  const size_t old_size = old_usable - HD_TAG_BYTES;
  memcpy(q, p, old_size < size ? old_size : size);
  /* A realloc is the old block's free, then the new block's allocation. */
  hd_record_alloc(q, size, 0, usable); /* new block recorded before the old one is released */
  free_recorded_at(p, old_usable, "realloc()", last_alloc_address);
  hd_tls.writer.last_alloc_address = (uint64_t)(uintptr_t)q; /* the realloc's last event */
  return q;
}
