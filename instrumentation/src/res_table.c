/* Writer side of the resources table: the append-only log of stack traces, thread infos,
 * executable regions and per-thread counters (heapdump/contract/shm_layout.h). */
#define _GNU_SOURCE
#include "tables.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "heapdump/contract/cpu.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/contract/stack_codec.h"
#include "table_memory.h"

/* Private dedup index of stack records, keyed by the traces' fingerprints (hd_trace_print):
 * a lookup compares a slot's 12 bytes of fingerprint, never the record's frames, so finding a
 * trace already stored touches one slot and neither encodes the frames nor reads the record.
 * Open addressing on print.lo, at most half full. A slot is written once, under the table lock:
 * its fingerprint first, then its key with a release store (key 0 = empty); lock-free probes
 * load the key with acquire before reading the fingerprint. It starts small and doubles (a
 * program with few traces should not pay for the index a huge one needs). A lock-free reader may
 * still be probing an older index: those stay mapped until the table is destroyed (together no
 * bigger than the current one); a miss there only sends the reader to the locked path, which
 * uses the current index. */
typedef struct hd_dedup_slot {
  uint64_t print_lo;
  uint32_t print_hi; /* the high half of print.hi */
  uint32_t key;
} hd_dedup_slot;

typedef struct hd_dedup_index {
  struct hd_dedup_index *older;
  uint64_t mask;
  uint64_t bytes;
  hd_dedup_slot slots[];
} hd_dedup_index;

/* Small at first: each new trace lands on a random page of the index, so a large first index
 * costs a page fault per trace until its pages are all touched (a sampled process records few
 * traces); doubling copies the index (a few microseconds at these sizes), and the older ones
 * stay for probes already reading them. */
#define DEDUP_INITIAL_SLOTS 1024u

static hd_dedup_index *dedup_new(uint64_t slots) {
  uint64_t bytes = ALIGN_UP(sizeof(hd_dedup_index) + slots * sizeof(hd_dedup_slot), PAGE);
  void *m =
      mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return NULL;
  hd_dedup_index *d = m;
  d->mask = slots - 1;
  d->bytes = bytes;
  return d;
}

static void dedup_free_all(hd_dedup_index *d) {
  while (d) {
    hd_dedup_index *older = d->older;
    munmap(d, d->bytes);
    d = older;
  }
}

static HD_MUST_CHECK int res_create(hd_res_table *t, uint64_t max_bytes, const char *memfd_name,
                                    bool index) {
  memset(t, 0, sizeof(*t));
  t->memfd = HD_OWNED_FD_NONE;
  if (max_bytes < 64 * 1024) max_bytes = 64 * 1024;
  if (max_bytes > UINT32_MAX - PAGE) max_bytes = UINT32_MAX - PAGE; /* keys are u32 offsets */
  max_bytes = ALIGN_UP(max_bytes, PAGE);
  /* At most one stack record per 40 bytes, and the index at most half full. */
  t->dedup_max_slots = 1024;
  while (t->dedup_max_slots < 2 * (max_bytes / 40)) t->dedup_max_slots <<= 1;
  if (index) {
    t->dedup = dedup_new(t->dedup_max_slots < DEDUP_INITIAL_SLOTS ? t->dedup_max_slots
                                                                  : DEDUP_INITIAL_SLOTS);
    if (!t->dedup) return -ENOMEM;
  }
  void *m = NULL;
  int rc = hd_table_memfd(memfd_name, max_bytes, &m, &t->memfd);
  if (rc != 0) {
    dedup_free_all(t->dedup);
    t->dedup = NULL;
    return rc;
  }
  t->size = max_bytes;
  t->base = m;
  t->hdr = m;
  hd_res_header *h = t->hdr;
  h->magic = HD_RES_MAGIC;
  h->version = HD_LAYOUT_VERSION;
  h->header_size = sizeof(*h);
  h->total_size = max_bytes;
  h->records_offset = ALIGN_UP(sizeof(*h), 64);
  h->pid = (uint32_t)getpid();
  h->start_time_ns = hd_table_now_ns();
  t->start_time_ns = h->start_time_ns;
  __atomic_store_n(&h->used, h->records_offset, __ATOMIC_RELEASE);
  pthread_mutex_init(&t->lock, NULL);
  return 0;
}

int hd_res_table_create(hd_res_table *t, uint64_t max_bytes, const char *memfd_name) {
  int rc = res_create(t, max_bytes, memfd_name, true);
  if (rc == 0) {
    (void)hd_res_add_mapping(t, HD_MAPPING_HEAPDUMP, true, (uint64_t)(uintptr_t)t->dedup,
                             t->dedup->bytes);
  }
  return rc;
}

void hd_res_table_destroy(hd_res_table *t) {
  if (t->base) munmap(t->base, t->size);
  dedup_free_all(t->dedup);
  hd_owned_fd_close(&t->memfd);
  t->base = NULL;
  t->hdr = NULL;
  t->dedup = NULL;
}

int hd_res_table_clone_locked(const hd_res_table *src, hd_res_table *dst, const char *memfd_name) {
  int rc = res_create(dst, src->size, memfd_name, false);
  if (rc != 0) return rc;
  uint64_t used = __atomic_load_n(&src->hdr->used, __ATOMIC_ACQUIRE);
  /* Word by word, atomically: other threads go on adding to their counters (the lock keeps out
   * only appends; the fork gate, changes of entries' keys). Records are 8-aligned. */
  const uint64_t *from = (const uint64_t *)src->base;
  uint64_t *to = (uint64_t *)dst->base;
  for (uint64_t i = 0; i < used / 8; i++) to[i] = LOAD(&from[i]);
  /* Under the fork gate, an odd seq the copy caught is a change that backed out before it
   * began (pending_change_begin): its entry is whole, and no thread of the copy will end it. */
  for (uint32_t off = LOAD(&dst->hdr->counters_head); off != 0;) {
    hd_rec_counters *c = (hd_rec_counters *)(dst->base + off);
    for (uint32_t i = 0; i < HD_PENDING_TRACES; i++) c->pending[i].seq &= ~1u;
    off = c->next;
  }
  dst->hdr->pid = (uint32_t)getpid();
  dst->live_bytes = LOAD(&src->live_bytes);
  /* The copies of the mark from the header copied above (a thread may have been setting a mark
   * in src: the header is what readers of dst go by). */
  dst->start_time_ns = dst->hdr->start_time_ns;
  dst->peak_mark = LOAD(&dst->hdr->peak_mark);
  dst->peak_mark_bytes = LOAD(&dst->hdr->peak_mark_bytes);
  dst->peak_mark_end_ns =
      dst->peak_mark == 0
          ? 0
          : dst->start_time_ns + ((hd_peak_mark_value(dst->peak_mark) + 1) << HD_PEAK_TIME_SHIFT);
  dst->dedup_count = src->dedup_count;
  dst->counters_pool = src->counters_pool;
  return 0;
}

void hd_res_table_adopt_index(hd_res_table *dst, hd_res_table *src) {
  dst->dedup = src->dedup;
  dst->dedup_max_slots = src->dedup_max_slots;
  src->dedup = NULL;
}

/* Appends a zeroed record of `size` bytes (multiple of 8) under t->lock; returns its offset or
 * 0 when full. The caller fills it and then calls publish(). */
static uint32_t reserve(hd_res_table *t, uint32_t size) {
  uint64_t used = LOAD(&t->hdr->used);
  if (used + size > t->size) return 0;
  return (uint32_t)used;
}

static void publish(hd_res_table *t, uint32_t off, uint32_t size) {
  /* Release: the record bytes happen-before any reader that loads the new `used`. */
  __atomic_store_n(&t->hdr->used, (uint64_t)off + size, __ATOMIC_RELEASE);
}

bool hd_res_add_mapping_locked(hd_res_table *t, uint32_t kind, bool mapped, uint64_t start,
                               uint64_t size) {
  uint32_t off = reserve(t, sizeof(hd_rec_mapping));
  if (off == 0) {
    __atomic_fetch_add(&t->hdr->mapping_records_lost, 1, __ATOMIC_RELAXED);
    return false;
  }
  hd_rec_mapping *r = (hd_rec_mapping *)(t->base + off);
  r->h.type = HD_REC_MAPPING;
  r->h.size = sizeof(*r);
  r->kind = kind;
  r->mapped = mapped;
  r->start = start;
  r->size = size;
  publish(t, off, sizeof(*r));
  return true;
}

bool hd_res_add_mapping(hd_res_table *t, uint32_t kind, bool mapped, uint64_t start,
                        uint64_t size) {
  pthread_mutex_lock(&t->lock);
  const bool added = hd_res_add_mapping_locked(t, kind, mapped, start, size);
  pthread_mutex_unlock(&t->lock);
  return added;
}

/* Under the lock: doubles the index; false when it is at its maximum or memory is short. */
static bool dedup_grow(hd_res_table *t) {
  hd_dedup_index *old = t->dedup;
  uint64_t slots = (old->mask + 1) * 2;
  if (slots > t->dedup_max_slots) return false;
  hd_dedup_index *d = dedup_new(slots);
  if (!d) return false;
  /* heapdump's own memory: a leak check does not take it for the program's. */
  (void)hd_res_add_mapping_locked(t, HD_MAPPING_HEAPDUMP, true, (uint64_t)(uintptr_t)d, d->bytes);
  for (uint64_t i = 0; i <= old->mask; i++) {
    const hd_dedup_slot *e = &old->slots[i];
    if (e->key == 0) continue;
    uint64_t j = e->print_lo & d->mask;
    while (d->slots[j].key != 0) j = (j + 1) & d->mask;
    d->slots[j] = *e;
  }
  d->older = old;
  __atomic_store_n(&t->dedup, d, __ATOMIC_RELEASE);
  return true;
}

static bool slot_holds(const hd_dedup_slot *s, hd_trace_print print) {
  return s->print_lo == print.lo && s->print_hi == (uint32_t)(print.hi >> 32);
}

/* The key stored under print in d, or 0 with *empty the slot where it would go. A slot's key is
 * loaded (acquire) before its fingerprint, which a lock-free probe needs: the key is published
 * with a release store after the fingerprint, and the record before both. */
static uint32_t probe(const hd_dedup_index *d, hd_trace_print print, uint64_t *empty) {
  for (uint64_t i = print.lo & d->mask;; i = (i + 1) & d->mask) {
    const uint32_t key = __atomic_load_n(&d->slots[i].key, __ATOMIC_ACQUIRE);
    if (key == 0) {
      *empty = i;
      return 0;
    }
    if (slot_holds(&d->slots[i], print)) return key;
  }
}

static uint32_t intern_stack(hd_res_table *t, const uint64_t *frames, unsigned count,
                             unsigned flags, hd_trace_print print, bool may_wait) {
  uint64_t i;
  uint32_t key = probe(__atomic_load_n(&t->dedup, __ATOMIC_ACQUIRE), print, &i); /* lock-free */
  if (key != 0) return key;
  if (!may_wait) {
    if (pthread_mutex_trylock(&t->lock) != 0) {
      __atomic_fetch_add(&t->hdr->stats.dropped_stack_traces, 1, __ATOMIC_RELAXED);
      return 0;
    }
  } else {
    pthread_mutex_lock(&t->lock);
  }
  hd_dedup_index *idx = t->dedup; /* the current index: stored meanwhile, or where it goes */
  key = probe(idx, print, &i);
  if (key != 0) {
    pthread_mutex_unlock(&t->lock);
    return key;
  }
  if ((t->dedup_count + 1) * 2 > idx->mask + 1) {
    if (!dedup_grow(t)) {
      pthread_mutex_unlock(&t->lock);
      __atomic_fetch_add(&t->hdr->stats.dropped_stack_traces, 1, __ATOMIC_RELAXED);
      return 0;
    }
    idx = t->dedup;
    (void)probe(idx, print, &i);
  }
  uint8_t enc[HD_MAX_FRAMES * HD_STACK_CODEC_MAX_FRAME_BYTES];
  size_t len = hd_stack_encode(frames, count, enc);
  uint32_t size = (uint32_t)ALIGN_UP(sizeof(hd_rec_stack) + len, 8);
  uint32_t off = reserve(t, size);
  if (off == 0) {
    pthread_mutex_unlock(&t->lock);
    __atomic_fetch_add(&t->hdr->stats.dropped_stack_traces, 1, __ATOMIC_RELAXED);
    return 0;
  }
  hd_rec_stack *r = (hd_rec_stack *)(t->base + off);
  r->h.type = HD_REC_STACK;
  r->h.size = size;
  r->frame_count = (uint16_t)count;
  r->flags = (uint16_t)flags;
  r->encoded_len = (uint32_t)len;
  memcpy(r + 1, enc, len);
  publish(t, off, size);
  t->dedup_count++;
  idx->slots[i].print_lo = print.lo;
  idx->slots[i].print_hi = (uint32_t)(print.hi >> 32);
  __atomic_store_n(&idx->slots[i].key, off, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&t->lock);
  return off;
}

uint32_t hd_res_intern_stack(hd_res_table *t, const uint64_t *frames, unsigned count,
                             unsigned flags) {
  if (count > HD_MAX_FRAMES) count = HD_MAX_FRAMES;
  return intern_stack(t, frames, count, flags, hd_trace_fingerprint(frames, count, flags), true);
}

uint32_t hd_res_intern_stack_print(hd_res_table *t, const uint64_t *frames, unsigned count,
                                   unsigned flags, hd_trace_print print) {
  return intern_stack(t, frames, count, flags, print, true);
}

uint32_t hd_res_intern_stack_nowait(hd_res_table *t, const uint64_t *frames, unsigned count,
                                    unsigned flags) {
  if (count > HD_MAX_FRAMES) count = HD_MAX_FRAMES;
  return intern_stack(t, frames, count, flags, hd_trace_fingerprint(frames, count, flags), false);
}

uint32_t hd_res_add_thread(hd_res_table *t, uint32_t tid, const char *name, uint64_t timestamp) {
  pthread_mutex_lock(&t->lock);
  uint32_t off = reserve(t, sizeof(hd_rec_thread));
  if (off != 0) {
    hd_rec_thread *r = (hd_rec_thread *)(t->base + off);
    r->h.type = HD_REC_THREAD;
    r->h.size = sizeof(*r);
    r->tid = tid;
    r->timestamp = timestamp;
    strncpy(r->name, name ? name : "", sizeof(r->name) - 1);
    publish(t, off, sizeof(*r));
  }
  pthread_mutex_unlock(&t->lock);
  if (off == 0) __atomic_fetch_add(&t->hdr->stats.dropped_resources, 1, __ATOMIC_RELAXED);
  return off;
}

uint32_t hd_res_add_thread_roots(hd_res_table *t, uint32_t tid, uint64_t stack_lo,
                                 uint64_t stack_hi, uint64_t thread_pointer) {
  pthread_mutex_lock(&t->lock);
  uint32_t off = reserve(t, sizeof(hd_rec_thread_roots));
  if (off != 0) {
    hd_rec_thread_roots *r = (hd_rec_thread_roots *)(t->base + off);
    r->h.type = HD_REC_THREAD_ROOTS;
    r->h.size = sizeof(*r);
    r->tid = tid;
    r->stack_lo = stack_lo;
    r->stack_hi = stack_hi;
    r->thread_pointer = thread_pointer;
    publish(t, off, sizeof(*r));
  }
  pthread_mutex_unlock(&t->lock);
  if (off == 0) __atomic_fetch_add(&t->hdr->stats.dropped_resources, 1, __ATOMIC_RELAXED);
  return off;
}

uint32_t hd_res_add_region(hd_res_table *t, const hd_region_info *ri) {
  size_t name_len = ri->name ? strnlen(ri->name, HD_REGION_NAME_MAX - 1) : 0;
  uint32_t size = (uint32_t)ALIGN_UP(sizeof(hd_rec_region) + name_len, 8);
  pthread_mutex_lock(&t->lock);
  uint32_t off = reserve(t, size);
  if (off != 0) {
    hd_rec_region *r = (hd_rec_region *)(t->base + off);
    r->h.type = HD_REC_REGION;
    r->h.size = size;
    r->address = ri->address;
    r->size = ri->size;
    r->file_offset = ri->file_offset;
    r->vaddr = ri->vaddr;
    unsigned bl = ri->build_id_len > HD_MAX_BUILD_ID ? HD_MAX_BUILD_ID : ri->build_id_len;
    memcpy(r->build_id, ri->build_id, bl);
    r->build_id_len = (uint8_t)bl;
    r->name_len = (uint16_t)name_len;
    memcpy(r + 1, ri->name, name_len);
    publish(t, off, size);
  }
  pthread_mutex_unlock(&t->lock);
  if (off == 0) __atomic_fetch_add(&t->hdr->stats.dropped_resources, 1, __ATOMIC_RELAXED);
  return off;
}

bool hd_res_attach_counters(hd_res_table *t, hd_writer_thread *w) {
  if (w->counters_key != 0 || w->retired) return w->counters_key != 0;
  pthread_mutex_lock(&t->lock);
  uint32_t off = t->counters_pool;
  if (off != 0) {
    /* The previous owner's last counts happen-before this via the lock. */
    t->counters_pool = ((hd_rec_counters *)(t->base + off))->writer_private;
  } else if ((off = reserve(t, sizeof(hd_rec_counters))) != 0) {
    hd_rec_counters *r = (hd_rec_counters *)(t->base + off);
    r->h.type = HD_REC_COUNTERS;
    r->h.size = sizeof(*r);
    r->next = LOAD(&t->hdr->counters_head);
    publish(t, off, sizeof(*r));
    __atomic_store_n(&t->hdr->counters_head, off, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&t->lock);
  if (off == 0) __atomic_fetch_add(&t->hdr->stats.dropped_resources, 1, __ATOMIC_RELAXED);
  w->counters_key = off;
  return off != 0;
}

/* The single writer of a counter: a plain load and store, atomic only so readers see no tear. */
static inline void counter_add(uint64_t *c, uint64_t n) { STORE(c, LOAD(c) + n); }

static hd_rec_counters *own_counters(hd_res_table *t, const hd_writer_thread *w) {
  return w && w->counters_key ? (hd_rec_counters *)(t->base + w->counters_key) : NULL;
}

/* The live bytes rose to live, from an allocation at timestamp: a new peak mark if that is 1%
 * past the last one. A thread that finds another setting a mark leaves it to that one (their
 * values differ by what is in flight). */
static void mark_peak(hd_res_table *t, uint64_t live, uint64_t timestamp) {
  uint32_t idle = 0;
  if (!__atomic_compare_exchange_n(&t->marking, &idle, 1, false, __ATOMIC_ACQUIRE,
                                   __ATOMIC_RELAXED))
    return;
  const uint64_t last_bytes = LOAD(&t->peak_mark_bytes);
  if (live > last_bytes + last_bytes / 100) {
    const uint64_t last = LOAD(&t->peak_mark);
    uint64_t number = hd_peak_mark_number(last) % 0xffffu + 1; /* 1..65535, never 0 */
    uint64_t units = hd_peak_time_units(timestamp, t->start_time_ns);
    /* Marks only move forward in time, even if this block's clock read lags the last mark. */
    if (units < hd_peak_mark_value(last)) units = hd_peak_mark_value(last);
    const uint64_t mark = number << 48 | units;
    STORE(&t->peak_mark_bytes, live);
    STORE(&t->peak_mark, mark);
    /* Release: a thread that sees the new end sees the new mark's number (count_free). */
    __atomic_store_n(&t->peak_mark_end_ns, t->start_time_ns + ((units + 1) << HD_PEAK_TIME_SHIFT),
                     __ATOMIC_RELEASE);
    STORE(&t->hdr->peak_mark_bytes, live);
    STORE(&t->hdr->peak_mark, mark);
  }
  __atomic_store_n(&t->marking, 0, __ATOMIC_RELEASE);
}

/* Whether mark number a is later than b (numbers wrap past 65535 to 1, and marks are never
 * far apart in number where a count could lag). */
static bool later_mark(uint32_t a, uint32_t b) { return a != b && (uint16_t)(a - b) < 0x8000; }

/* A block of trace stack_key allocated by the peak mark `number` is freed: one more in the
 * trace's count of blocks live at the mark and freed since. A count of an older mark starts
 * over; a count already of a later mark (another thread's free saw it first) takes the block
 * too: allocated by the older mark, it was allocated by the later one, and freed after both. */
static void add_to_mark(uint64_t *count, uint32_t number, uint64_t n) {
  uint64_t old = LOAD(count), next;
  const uint32_t have = hd_peak_mark_number(old);
  if (have == number || later_mark(have, number)) {
    __atomic_fetch_add(count, n, __ATOMIC_RELAXED);
    return;
  }
  do {
    const uint32_t now = hd_peak_mark_number(old);
    next = now == number || later_mark(now, number) ? old + n : (uint64_t)number << 48 | n;
  } while (
      !__atomic_compare_exchange_n(count, &old, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}

/* A block of trace stack_key that was live at the peak mark is freed. Out of line: most frees
 * are not of such blocks, and their path stays free of the registers this one needs. */
__attribute__((noinline, cold)) static void count_freed_since_mark(hd_res_table *t,
                                                                   uint32_t stack_key,
                                                                   uint64_t blocks,
                                                                   uint64_t bytes) {
  const uint64_t mark = LOAD(&t->peak_mark);
  hd_rec_stack *r = (hd_rec_stack *)(t->base + stack_key);
  add_to_mark(&r->peak_freed_blocks, hd_peak_mark_number(mark), blocks);
  add_to_mark(&r->peak_freed_bytes, hd_peak_mark_number(mark), bytes);
}

/* Moves the process's live bytes by delta and raises the peak. A thread holds back its share
 * while the total cannot be at a new peak because of it (so a single thread's peak is exact;
 * with several, each holds back less than HD_LIVE_DELTA_FLUSH). alloc_timestamp: the block's
 * if this is an allocation, which may set a peak mark at its time; 0 for a free, which never
 * does (a thread's held-back share can make its free raise the total, but the free has no
 * moment of its own to mark: the next allocation marks). */
static void add_live(hd_res_table *t, hd_writer_thread *w, int64_t delta,
                     uint64_t alloc_timestamp) {
  hd_stats_block *s = &t->hdr->stats;
  int64_t d = delta;
  if (w && !w->retired) {
    d += w->live_delta;
    bool may_peak = d > 0 && (uint64_t)(LOAD(&t->live_bytes) + d) > LOAD(&s->peak_live_bytes);
    if (!may_peak && d < HD_LIVE_DELTA_FLUSH && d > -HD_LIVE_DELTA_FLUSH) {
      w->live_delta = d;
      return;
    }
    w->live_delta = 0;
  }
  int64_t live = __atomic_add_fetch(&t->live_bytes, d, __ATOMIC_RELAXED);
  if (d <= 0 || live <= 0) return;
  uint64_t peak = LOAD(&s->peak_live_bytes);
  while ((uint64_t)live > peak &&
         !__atomic_compare_exchange_n(&s->peak_live_bytes, &peak, (uint64_t)live, true,
                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  const uint64_t last_bytes = LOAD(&t->peak_mark_bytes);
  if (alloc_timestamp != 0 && (uint64_t)live > last_bytes + last_bytes / 100)
    mark_peak(t, (uint64_t)live, alloc_timestamp);
}

/* ---- a thread's pending trace counts (hd_pending_trace, shm_layout.h) */

/* A trace that finds its entry held by another counts straight into its record, and only every
 * so many such allocations of the thread's take the entry over: so entries stay with the traces
 * a thread repeats, and a thread whose traces vary (a compiler's) changes keys rarely, each
 * change being dearer than the locked adds it saves (a full fence, three adds). */
#define HD_PENDING_EVICT_EVERY 8

static void add_to_trace(hd_res_table *t, uint32_t stack_key, uint64_t alloc_blocks,
                         uint64_t alloc_bytes, uint64_t temporary_blocks) {
  hd_rec_stack *r = (hd_rec_stack *)(t->base + stack_key);
  if (alloc_blocks) __atomic_fetch_add(&r->alloc_blocks, alloc_blocks, __ATOMIC_RELAXED);
  if (alloc_bytes) __atomic_fetch_add(&r->alloc_bytes, alloc_bytes, __ATOMIC_RELAXED);
  if (temporary_blocks)
    __atomic_fetch_add(&r->temporary_blocks, temporary_blocks, __ATOMIC_RELAXED);
}

/* Waits while *word is set (odd_only: while it is odd), spinning briefly and then yielding: the
 * thread waited for may need this CPU (a fork copies the tables meanwhile, which takes a while
 * in a big process). */
static void wait_while_odd_or_set(const uint32_t *word, bool odd_only) {
  for (unsigned spins = 0;; spins++) {
    const uint32_t value = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if (odd_only ? !(value & 1) : value == 0) return;
    if (spins < 64)
      hd_cpu_relax();
    else
      sched_yield();
  }
}

/* Opens e's seqlock for a change of key: odd. Not while a fork's prepare handler copies the
 * table (hd_res_fork_gate_close): the odd value and the gate are each stored before the other's
 * load (a full fence on both sides), so either this thread sees the gate and waits with the
 * seqlock even, or the handler sees it odd and waits for it to end. Returns the odd value. */
static uint32_t pending_change_begin(hd_res_table *t, hd_pending_trace *e) {
  uint32_t seq = e->seq;
  for (;;) {
    STORE(&e->seq, seq + 1);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!HD_UNLIKELY_T(__atomic_load_n(&t->fork_gate, __ATOMIC_RELAXED))) return seq + 1;
    seq += 2;
    __atomic_store_n(&e->seq, seq, __ATOMIC_RELEASE);
    wait_while_odd_or_set(&t->fork_gate, false);
  }
}

/* Entry e now holds stack_key (0: empty) with no counts; what it held is added to its trace's
 * record. */
static void pending_rekey(hd_res_table *t, hd_pending_trace *e, uint32_t stack_key) {
  const uint32_t seq = pending_change_begin(t, e);
  if (e->stack_key != 0)
    add_to_trace(t, e->stack_key, e->alloc_blocks, e->alloc_bytes, e->temporary_blocks);
  STORE(&e->alloc_blocks, 0);
  STORE(&e->alloc_bytes, 0);
  STORE(&e->temporary_blocks, 0);
  /* After the counts: a reader that finds the new key (acquire) finds them zero. */
  __atomic_store_n(&e->stack_key, stack_key, __ATOMIC_RELEASE);
  __atomic_store_n(&e->seq, seq + 1, __ATOMIC_RELEASE);
}

bool hd_res_fork_gate_close(hd_res_table *t, const hd_writer_thread *self) {
  __atomic_store_n(&t->fork_gate, 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  bool own_settled = true;
  for (uint32_t off = __atomic_load_n(&t->hdr->counters_head, __ATOMIC_ACQUIRE); off != 0;) {
    const hd_rec_counters *c = (const hd_rec_counters *)(t->base + off);
    /* Its own record is odd only if a signal handler forks from inside a change of this
     * thread's: waiting would hang, and the copy would count that entry twice or not at all. */
    const bool own = self != NULL && off == self->counters_key;
    for (uint32_t i = 0; i < HD_PENDING_TRACES; i++) {
      if (own)
        own_settled &= !(__atomic_load_n(&c->pending[i].seq, __ATOMIC_RELAXED) & 1);
      else
        wait_while_odd_or_set(&c->pending[i].seq, true);
    }
    off = c->next;
  }
  return own_settled;
}

void hd_res_fork_gate_open(hd_res_table *t) {
  __atomic_store_n(&t->fork_gate, 0, __ATOMIC_RELEASE);
}

/* The entry of counters record c (NULL: none) that may hold trace stack_key's counts. */
static inline hd_pending_trace *entry_for(hd_rec_counters *c, uint32_t stack_key) {
  return c ? &c->pending[hd_pending_slot(stack_key)] : NULL;
}

/* hd_res_count_alloc where the thread's entry does not hold the trace already (or the thread
 * has no counters record, or the block no trace). */
__attribute__((noinline)) static void count_alloc_slow(hd_res_table *t, hd_writer_thread *w,
                                                       uint32_t stack_key, uint64_t blocks,
                                                       uint64_t bytes, uint64_t timestamp) {
  hd_rec_counters *c = own_counters(t, w);
  if (stack_key != 0) {
    hd_pending_trace *e = entry_for(c, stack_key);
    if (e == NULL || (e->stack_key != 0 && ++w->pending_misses % HD_PENDING_EVICT_EVERY != 0)) {
      add_to_trace(t, stack_key, blocks, bytes, 0);
    } else {
      pending_rekey(t, e, stack_key);
      counter_add(&e->alloc_blocks, blocks);
      counter_add(&e->alloc_bytes, bytes);
    }
  }
  if (c) {
    counter_add(&c->blocks_allocated, blocks);
    counter_add(&c->bytes_allocated, bytes);
  } else {
    __atomic_fetch_add(&t->hdr->stats.blocks_allocated, blocks, __ATOMIC_RELAXED);
    __atomic_fetch_add(&t->hdr->stats.bytes_allocated, bytes, __ATOMIC_RELAXED);
  }
  add_live(t, w, (int64_t)bytes, timestamp);
}

void hd_res_count_alloc(hd_res_table *t, hd_writer_thread *w, uint32_t stack_key, uint64_t blocks,
                        uint64_t bytes, uint64_t timestamp) {
  hd_rec_counters *c = own_counters(t, w);
  hd_pending_trace *e = entry_for(c, stack_key);
  /* The slow path is a tail call: this one needs no frame. */
  if (HD_UNLIKELY_T(e == NULL || stack_key == 0 || e->stack_key != stack_key)) {
    count_alloc_slow(t, w, stack_key, blocks, bytes, timestamp);
    return;
  }
  counter_add(&e->alloc_blocks, blocks);
  counter_add(&e->alloc_bytes, bytes);
  counter_add(&c->blocks_allocated, blocks);
  counter_add(&c->bytes_allocated, bytes);
  add_live(t, w, (int64_t)bytes, timestamp);
}

void hd_res_count_free(hd_res_table *t, hd_writer_thread *w, uint64_t blocks, uint64_t bytes,
                       uint32_t stack_key, uint64_t timestamp) {
  /* Allocated by the mark (hd_peak_allocated_by), in one comparison. A mark set since the end
   * was read is later: the block was allocated by it too. */
  if (timestamp < __atomic_load_n(&t->peak_mark_end_ns, __ATOMIC_ACQUIRE) && stack_key != 0)
    count_freed_since_mark(t, stack_key, blocks, bytes);
  hd_rec_counters *c = own_counters(t, w);
  if (c) {
    counter_add(&c->blocks_freed, blocks);
    counter_add(&c->bytes_freed, bytes);
  } else {
    __atomic_fetch_add(&t->hdr->stats.blocks_freed, blocks, __ATOMIC_RELAXED);
    __atomic_fetch_add(&t->hdr->stats.bytes_freed, bytes, __ATOMIC_RELAXED);
  }
  add_live(t, w, -(int64_t)bytes, 0); /* last: a tail call */
}

void hd_res_count_temporary(hd_res_table *t, const hd_writer_thread *w, uint32_t stack_key,
                            uint64_t blocks) {
  if (stack_key == 0) return;
  hd_rec_counters *c = own_counters(t, w);
  hd_pending_trace *e = entry_for(c, stack_key);
  /* Its allocation was this thread's latest: its entry most likely holds it still. */
  if (e != NULL && e->stack_key == stack_key)
    counter_add(&e->temporary_blocks, blocks);
  else
    add_to_trace(t, stack_key, 0, 0, blocks);
}

void hd_res_read_stats(const hd_res_table *t, hd_stats_block *out) {
  const hd_stats_block *s = &t->hdr->stats;
  out->blocks_allocated = LOAD(&s->blocks_allocated);
  out->bytes_allocated = LOAD(&s->bytes_allocated);
  out->blocks_freed = LOAD(&s->blocks_freed);
  out->bytes_freed = LOAD(&s->bytes_freed);
  out->peak_live_bytes = LOAD(&s->peak_live_bytes);
  out->dropped_allocations = LOAD(&s->dropped_allocations);
  out->dropped_stack_traces = LOAD(&s->dropped_stack_traces);
  out->dropped_resources = LOAD(&s->dropped_resources);
  for (uint32_t off = __atomic_load_n(&t->hdr->counters_head, __ATOMIC_ACQUIRE); off != 0;) {
    const hd_rec_counters *c = (const hd_rec_counters *)(t->base + off);
    out->blocks_allocated += LOAD(&c->blocks_allocated);
    out->bytes_allocated += LOAD(&c->bytes_allocated);
    out->blocks_freed += LOAD(&c->blocks_freed);
    out->bytes_freed += LOAD(&c->bytes_freed);
    off = c->next;
  }
}

void hd_writer_thread_retire(hd_alloc_table *a, hd_res_table *r, hd_writer_thread *w) {
  if (w->retired) return;
  if (w->live_delta != 0) __atomic_add_fetch(&r->live_bytes, w->live_delta, __ATOMIC_RELAXED);
  w->live_delta = 0;
  if (w->node_count != 0) hd_alloc_cache_spill(a, w, w->node_count);
  if (w->counters_key != 0) {
    /* Handed over empty: its next owner's first allocations rekey no entry of this one's. */
    hd_rec_counters *c = own_counters(r, w);
    for (uint32_t i = 0; i < HD_PENDING_TRACES; i++)
      if (c->pending[i].stack_key != 0) pending_rekey(r, &c->pending[i], 0);
    pthread_mutex_lock(&r->lock);
    ((hd_rec_counters *)(r->base + w->counters_key))->writer_private = r->counters_pool;
    r->counters_pool = w->counters_key;
    pthread_mutex_unlock(&r->lock);
    w->counters_key = 0;
  }
  w->retired = true;
}

void hd_res_reconcile_live(hd_res_table *t, uint64_t live_blocks, uint64_t live_bytes) {
  hd_stats_block now;
  hd_res_read_stats(t, &now);
  uint64_t blocks = now.blocks_allocated < live_blocks ? live_blocks : now.blocks_allocated;
  uint64_t bytes = now.bytes_allocated < live_bytes ? live_bytes : now.bytes_allocated;
  /* Only the base is written: the threads' records keep their counts; unsigned wrap-around
   * makes base + sum come out right even when the base has to go "below zero". */
  hd_stats_block *s = &t->hdr->stats;
  STORE(&s->blocks_allocated, LOAD(&s->blocks_allocated) + (blocks - now.blocks_allocated));
  STORE(&s->bytes_allocated, LOAD(&s->bytes_allocated) + (bytes - now.bytes_allocated));
  STORE(&s->blocks_freed, LOAD(&s->blocks_freed) + ((blocks - live_blocks) - now.blocks_freed));
  STORE(&s->bytes_freed, LOAD(&s->bytes_freed) + ((bytes - live_bytes) - now.bytes_freed));
  if (LOAD(&s->peak_live_bytes) < live_bytes) STORE(&s->peak_live_bytes, live_bytes);
  STORE(&t->live_bytes, (int64_t)live_bytes);
}

void hd_res_count_beyond_cfi(hd_res_table *t) {
  __atomic_fetch_add(&t->hdr->stacks_beyond_cfi, 1, __ATOMIC_RELAXED);
}

void hd_res_set_unwind_tables_refused(hd_res_table *t, unsigned modules) {
  __atomic_store_n(&t->hdr->unwind_tables_refused, modules, __ATOMIC_RELAXED);
}

void hd_res_count_overwritten_tag(hd_res_table *t) {
  __atomic_fetch_add(&t->hdr->overwritten_tags, 1, __ATOMIC_RELAXED);
}

void hd_res_count_drop(hd_res_table *t, size_t field_offset_in_stats) {
  uint64_t *f = (uint64_t *)((uint8_t *)&t->hdr->stats + field_offset_in_stats);
  __atomic_fetch_add(f, 1, __ATOMIC_RELAXED);
}
