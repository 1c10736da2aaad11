/* Hostile-memory reader of the heapdump tables: copy with relaxed atomic loads, validate,
 * then use. Implements the reader half of the protocol in shm_layout.h (steps R1-R3). */
#define _GNU_SOURCE
#include "table_reader.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <time.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "heapdump/contract/cpu.h"
#include "heapdump/contract/shm_layout.h"
#include "heapdump/contract/stack_codec.h"

#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
/* A slot whose writer keeps it changing (or holds it, e.g. preempted on a loaded machine) is
 * retried for up to kSlotPatienceNs; only a slot stuck longer than that fails the snapshot, so a
 * hostile table cannot hang the reader and a busy one does not fail it. */
enum { kMaxRestarts = 64 };
static const uint64_t kSlotPatienceNs = 1000000000u;

const char *hd_read_status_str(hd_read_status s) {
  switch (s) {
    case HD_READ_OK: return "ok";
    case HD_READ_END: return "end";
    case HD_READ_ERR_ARG: return "invalid argument";
    case HD_READ_ERR_SYSTEM: return "system error";
    case HD_READ_ERR_BAD_MAGIC: return "bad magic";
    case HD_READ_ERR_BAD_VERSION: return "unsupported layout version";
    case HD_READ_ERR_BAD_SIZE: return "header does not fit the memfd";
    case HD_READ_ERR_NOT_SEALED: return "memfd not sealed against shrinking";
    case HD_READ_ERR_CORRUPT: return "live snapshot failed: corrupt table";
    case HD_READ_ERR_BUSY: return "live snapshot failed: table kept changing";
    case HD_READ_ERR_NOT_FOUND: return "no such record";
    case HD_READ_ERR_NO_SPACE: return "buffer too small";
    case HD_READ_ERR_NO_MEMORY: return "out of memory";
    case HD_READ_ERR_TIMED_OUT: return "live snapshot failed: the table stayed locked past the read time limit";
    case HD_READ_ERR_STOPPED: return "stopped";
  }
  return "unknown status";
}

static hd_read_status map_fd(int fd, const uint8_t **base, uint64_t *size) {
  if (fd < 0) return HD_READ_ERR_ARG;
  struct stat st;
  if (fstat(fd, &st) != 0) return HD_READ_ERR_SYSTEM;
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) return HD_READ_ERR_NOT_SEALED;
  if (st.st_size < 4096 || (uint64_t)st.st_size > HD_MAX_TABLE_BYTES) return HD_READ_ERR_BAD_SIZE;
  void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) return HD_READ_ERR_SYSTEM;
  *base = m;
  *size = (uint64_t)st.st_size;
  return HD_READ_OK;
}

/* Copy of a shared range with relaxed 8-byte loads (the writer may be storing meanwhile). */
static void copy_words(void *dst, const void *src, size_t bytes) {
  const uint64_t *s = src;
  uint64_t *d = dst;
  for (size_t i = 0; i < bytes / 8; i++) d[i] = LOAD(&s[i]);
}

/* Maps a table and copies its header, whose magic and layout version come first in both tables
 * (pinned in the layout header); on any error nothing stays mapped. */
static hd_read_status map_table(int fd, uint64_t magic, void *header, size_t header_size,
                                const uint8_t **base, uint64_t *size) {
  hd_read_status st = map_fd(fd, base, size);
  if (st != HD_READ_OK) return st;
  copy_words(header, *base, header_size);
  uint64_t found_magic;
  uint32_t found_version;
  memcpy(&found_magic, header, sizeof found_magic);
  memcpy(&found_version, (const uint8_t *)header + 8, sizeof found_version);
  if (found_magic != magic) st = HD_READ_ERR_BAD_MAGIC;
  else if (found_version != HD_LAYOUT_VERSION) st = HD_READ_ERR_BAD_VERSION;
  if (st != HD_READ_OK) munmap((void *)*base, *size);
  return st;
}

/* ------------------------------------------------------------------ allocations */

struct hd_alloc_reader {
  const uint8_t *base;
  uint64_t size;
  hd_alloc_header h; /* validated private copy of the immutable fields */
};

static bool range_ok(uint64_t off, uint64_t len, uint64_t size) {
  return off <= size && len <= size - off;
}

/* A zeroed reader of reader_size bytes for a mapped table whose header passed (*st OK); NULL
 * otherwise, or out of memory (*st says which), with the table unmapped. */
static void *reader_or_unmap(hd_read_status *st, const uint8_t *base, uint64_t size,
                             size_t reader_size) {
  void *r = *st == HD_READ_OK ? calloc(1, reader_size) : NULL;
  if (*st == HD_READ_OK && r == NULL) *st = HD_READ_ERR_NO_MEMORY;
  if (*st != HD_READ_OK) munmap((void *)base, size);
  return r;
}

hd_read_status hd_alloc_reader_open(int fd, hd_alloc_reader **out) {
  if (!out) return HD_READ_ERR_ARG;
  *out = NULL;
  const uint8_t *base;
  uint64_t size;
  hd_alloc_header h = {0};
  hd_read_status st = map_table(fd, HD_ALLOC_MAGIC, &h, sizeof h, &base, &size);
  if (st != HD_READ_OK) return st;
  if (h.header_size != sizeof(h) || h.node_size != sizeof(hd_alloc_node) ||
           h.seq_slots != HD_SEQ_SLOTS || h.total_size != size || h.max_bucket_log2 > 31 ||
           h.max_bucket_log2 < HD_MIN_BUCKET_LOG2 || h.node_capacity >= UINT32_MAX ||
           h.seq_offset < sizeof(h) || (h.seq_offset | h.buckets_offset | h.nodes_offset) % 8 ||
           !range_ok(h.seq_offset, (uint64_t)HD_SEQ_SLOTS * 4, size) ||
           h.buckets_offset < h.seq_offset + (uint64_t)HD_SEQ_SLOTS * 4 ||
           !range_ok(h.buckets_offset, (uint64_t)4 << h.max_bucket_log2, size) ||
           h.nodes_offset < h.buckets_offset + ((uint64_t)4 << h.max_bucket_log2) ||
           !range_ok(h.nodes_offset, (uint64_t)h.node_capacity * sizeof(hd_alloc_node), size))
    st = HD_READ_ERR_BAD_SIZE;
  hd_alloc_reader *r = reader_or_unmap(&st, base, size, sizeof *r);
  if (r == NULL) return st;
  r->base = base;
  r->size = size;
  r->h = h;
  *out = r;
  return HD_READ_OK;
}

void hd_alloc_reader_close(hd_alloc_reader *r) {
  if (!r) return;
  munmap((void *)r->base, r->size);
  free(r);
}

void hd_alloc_reader_release_pages(hd_alloc_reader *r) {
  if (r) (void)madvise((void *)r->base, r->size, MADV_DONTNEED); /* advice only: no error path */
}

hd_read_status hd_alloc_reader_info(hd_alloc_reader *r, hd_alloc_table_info *out) {
  if (!r || !out) return HD_READ_ERR_ARG;
  const hd_alloc_header *h = (const hd_alloc_header *)r->base;
  out->pid = LOAD(&h->pid);
  out->flags = LOAD(&h->flags);
  out->node_capacity = r->h.node_capacity;
  out->node_high_water = LOAD(&h->node_high_water);
  out->bucket_log2 = LOAD(&h->bucket_log2);
  out->total_size = r->size;
  return HD_READ_OK;
}

static int cmp_block(const void *a, const void *b) {
  uint64_t x = ((const hd_live_block *)a)->address, y = ((const hd_live_block *)b)->address;
  return x < y ? -1 : x > y;
}

typedef struct {
  hd_live_block *v;
  size_t n, cap;
} block_vec;

static bool reserve(block_vec *bv, size_t cap) {
  if (cap <= bv->cap) return true;
  hd_live_block *v = realloc(bv->v, cap * sizeof(*v));
  if (!v) return false;
  bv->v = v;
  bv->cap = cap;
  return true;
}

static bool push(block_vec *bv, const hd_live_block *b) {
  if (bv->n == bv->cap && !reserve(bv, bv->cap ? bv->cap * 2 : 1024)) return false;
  bv->v[bv->n++] = *b;
  return true;
}

/* Nodes ever handed out. No consistent link points past it, which bounds a copy by what the
 * process itself wrote, whatever its header claims about the capacity. */
static uint64_t high_water_now(const hd_alloc_reader *r) {
  uint64_t high_water = LOAD(&((const hd_alloc_header *)r->base)->node_high_water);
  return high_water < r->h.node_capacity ? high_water : r->h.node_capacity;
}

/* How many blocks one pass may copy before it is abandoned: the live set (at most the high-water
 * mark) plus a margin for nodes that writers free behind the walk and link again ahead of it. */
static size_t pass_limit(const hd_alloc_reader *r) {
  uint64_t high_water = high_water_now(r);
  uint64_t limit = high_water + high_water / 2 + 4096;
  return (size_t)(limit < r->h.node_capacity ? limit : r->h.node_capacity);
}

/* Room for the whole live set up front, so that the copy is not moved as it grows: every live
 * node is below the high-water mark, plus a margin for nodes handed out during the walk. Pages
 * of the reservation that are never written cost no memory. */
static size_t expected_blocks(const hd_alloc_reader *r) {
  uint64_t high_water = high_water_now(r);
  uint64_t expected = high_water + high_water / 16 + 1024;
  return (size_t)(expected < r->h.node_capacity ? expected : r->h.node_capacity);
}

/* Equal addresses hash to the same bucket and a node found in any other bucket is refused, so a
 * duplicate can only be within one chain. Chains are short (the writer keeps about two nodes per
 * bucket); a long one, which only a hostile writer makes, is sorted. */
static bool chain_has_duplicate(hd_live_block *chain, size_t n) {
  enum { kShortChain = 16 };
  if (n <= kShortChain) {
    for (size_t i = 1; i < n; i++) {
      for (size_t j = 0; j < i; j++) {
        if (chain[i].address == chain[j].address) return true;
      }
    }
    return false;
  }
  qsort(chain, n, sizeof(*chain), cmp_block);
  for (size_t i = 1; i < n; i++) {
    if (chain[i].address == chain[i - 1].address) return true;
  }
  return false;
}

static uint64_t monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Spins briefly, then yields, then sleeps, so a preempted writer gets the CPU back. */
static void backoff(unsigned attempt) {
  if (attempt < 16) {
    hd_cpu_relax();
  } else if (attempt < 256) {
    sched_yield();
  } else {
    struct timespec pause = {0, 20000};
    nanosleep(&pause, NULL);
  }
}

/* Checked while waiting for a writer: HD_READ_OK to go on waiting, or why not. */
static hd_read_status keep_waiting(const hd_read_limits *limits, uint64_t give_up_at) {
  const uint64_t now = monotonic_ns();
  if (limits != NULL && limits->stop != NULL && limits->stop(limits->stop_ctx)) return HD_READ_ERR_STOPPED;
  if (limits != NULL && limits->deadline_ns != 0 && now > limits->deadline_ns) return HD_READ_ERR_TIMED_OUT;
  return now > give_up_at ? HD_READ_ERR_BUSY : HD_READ_OK;
}

/* Waits out a doubling in progress (for up to kSlotPatienceNs, like a busy slot) rather than
 * count it as a restart: one doubling of a big table outlasts many quick retries. Only passes
 * that a doubling invalidated count, and a table doubles at most 31 times. *resize_seq: the
 * (even) value the pass starts from. */
static hd_read_status wait_out_doubling(const hd_alloc_header *h, hd_read_limits *limits,
                                        uint32_t *resize_seq) {
  uint32_t rs = __atomic_load_n(&h->resize_seq, __ATOMIC_ACQUIRE);
  if (limits != NULL && limits->final && (rs & 1)) {
    return HD_READ_ERR_CORRUPT; /* its writer died doubling it: the buckets are half moved */
  }
  uint64_t give_up_at = 0;
  hd_read_status waited;
  for (unsigned wait = 0; rs & 1; wait++) {
    if (wait == 16) give_up_at = monotonic_ns() + kSlotPatienceNs;
    if (wait > 16 && wait % 64 == 0 && (waited = keep_waiting(limits, give_up_at)) != HD_READ_OK) {
      return waited;
    }
    backoff(wait);
    rs = __atomic_load_n(&h->resize_seq, __ATOMIC_ACQUIRE);
  }
  *resize_seq = rs;
  return HD_READ_OK;
}

/* One pass over the buckets, copying every chain into bv. */
typedef struct copy_pass {
  const hd_alloc_reader *r;
  const hd_alloc_header *h;
  const uint32_t *seq, *buckets;
  const hd_alloc_node *nodes;
  uint32_t log2;
  uint64_t bucket_count;
  uint64_t high_water; /* refreshed when a link points past it */
  size_t limit;        /* pass_limit, refreshed when reached */
  block_vec *bv;
  /* resized: the bucket array changed under the pass; overfull: the pass copied more blocks
   * than the table can hold, which only churn (or a hostile writer) explains. Either restarts. */
  bool resized, overfull;
} copy_pass;

static hd_read_status begin_pass(const hd_alloc_reader *r, block_vec *bv, copy_pass *p) {
  const hd_alloc_header *h = (const hd_alloc_header *)r->base;
  const uint32_t log2 = LOAD(&h->bucket_log2);
  if (log2 < HD_MIN_BUCKET_LOG2 || log2 > r->h.max_bucket_log2) return HD_READ_ERR_CORRUPT;
  bv->n = 0;
  *p = (copy_pass){
      .r = r,
      .h = h,
      .seq = (const uint32_t *)(r->base + r->h.seq_offset),
      .buckets = (const uint32_t *)(r->base + r->h.buckets_offset),
      .nodes = (const hd_alloc_node *)(r->base + r->h.nodes_offset),
      .log2 = log2,
      .bucket_count = (uint64_t)1 << log2,
      .high_water = high_water_now(r),
      .limit = pass_limit(r),
      .bv = bv,
  };
  return HD_READ_OK;
}

/* Appends the chain of bucket b to the pass's copy. *bad when no writer could have left it so
 * (a node never handed out, a cycle, a node in another bucket, an address twice); may set
 * p->overfull. False only when out of memory. */
static bool copy_chain(copy_pass *p, uint64_t b, bool *bad) {
  const size_t chain_start = p->bv->n;
  /* Brent's cycle detection: a chain that returns to a node is caught within twice its length,
   * at no memory cost, however many nodes the header claims. */
  uint32_t tortoise = HD_LINK_NONE;
  uint64_t power = 1, lambda = 0;
  for (uint32_t link = LOAD(&p->buckets[b]); link != HD_LINK_NONE;) {
    if (link > p->high_water) p->high_water = high_water_now(p->r); /* a writer took nodes since */
    if (link > p->high_water || link == tortoise) {
      *bad = true; /* a node never handed out, or a cycle */
      return true;
    }
    if (++lambda == power) {
      tortoise = link;
      power *= 2;
      lambda = 0;
    }
    if (p->bv->n >= p->limit && (p->limit = pass_limit(p->r), p->bv->n >= p->limit)) {
      p->overfull = true;
      return true;
    }
    const hd_alloc_node *n = &p->nodes[link - 1];
    const uint64_t address_word = LOAD(&n->address_word), time_word = LOAD(&n->time_word);
    hd_live_block blk = {
        .address = hd_node_address(address_word),
        .size = hd_node_size(LOAD(&n->size_low), address_word),
        .timestamp = hd_node_timestamp(time_word, p->r->h.time_base),
        .thread_key = LOAD(&n->thread_key),
        .stack_key = LOAD(&n->stack_key),
        .flags = hd_node_align_log2(time_word),
    };
    if ((hd_alloc_hash(blk.address) & (p->bucket_count - 1)) != b) {
      *bad = true; /* node in the wrong bucket */
      return true;
    }
    if (!push(p->bv, &blk)) return false;
    link = LOAD(&n->next);
  }
  const size_t chain_length = p->bv->n - chain_start;
  if (chain_length > 1 && chain_has_duplicate(p->bv->v + chain_start, chain_length)) *bad = true;
  return true;
}

/* Copies the buckets of one sequence slot as a seqlock reader: again while a writer changes the
 * slot, until a copy is stable. HD_READ_OK also when the pass must restart (p->resized or
 * p->overfull); otherwise why the snapshot fails. */
static hd_read_status copy_slot(copy_pass *p, uint64_t slot, hd_read_limits *limits) {
  const bool final = limits != NULL && limits->final;
  uint64_t give_up_at = 0;
  hd_read_status waited;
  for (unsigned attempt = 0;; attempt++) {
    if (attempt == 16) give_up_at = monotonic_ns() + kSlotPatienceNs;
    if (attempt > 16 && attempt % 64 == 0 && (waited = keep_waiting(limits, give_up_at)) != HD_READ_OK) {
      return waited;
    }
    uint32_t s1 = __atomic_load_n(&p->seq[slot], __ATOMIC_ACQUIRE); /* R1, pairs with W3 */
    const bool left_locked = final && (s1 & 1);
    if ((s1 & 1) && !left_locked) {
      backoff(attempt);
      continue;
    }
    const size_t mark = p->bv->n;
    bool bad = false;
    if (LOAD(&p->h->bucket_log2) != p->log2) p->resized = true;
    for (uint64_t b = slot; b < p->bucket_count && !bad && !p->resized && !p->overfull;
         b += HD_SEQ_SLOTS) {
      if (!copy_chain(p, b, &bad)) return HD_READ_ERR_NO_MEMORY;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* R3 */
    uint32_t s2 = LOAD(&p->seq[slot]);
    if (p->resized || p->overfull) return HD_READ_OK;
    if (s1 == s2) {
      if (bad && left_locked) {
        p->bv->n = mark; /* its writer died mid-update: the rest of the table is still whole */
        limits->torn_slots++;
      } else if (bad) {
        return HD_READ_ERR_CORRUPT; /* stable and still inconsistent */
      }
      return HD_READ_OK;
    }
    p->bv->n = mark; /* a writer changed the slot: retry it */
    backoff(attempt);
  }
}

hd_read_status hd_alloc_reader_snapshot_unordered(hd_alloc_reader *r, hd_read_limits *limits,
                                                  hd_live_block **blocks, size_t *count) {
  if (!r || !blocks || !count) return HD_READ_ERR_ARG;
  if (limits != NULL) limits->torn_slots = 0;
  *blocks = NULL;
  *count = 0;
  const hd_alloc_header *h = (const hd_alloc_header *)r->base;
  block_vec bv = {0};
  if (!reserve(&bv, expected_blocks(r))) return HD_READ_ERR_NO_MEMORY;
  hd_read_status st = HD_READ_ERR_BUSY;
  for (unsigned restart = 0; restart < kMaxRestarts; restart++) {
    uint32_t resize_seq;
    copy_pass p;
    if (restart > 0 && (st = keep_waiting(limits, UINT64_MAX)) != HD_READ_OK) break;
    if ((st = wait_out_doubling(h, limits, &resize_seq)) != HD_READ_OK) break;
    if ((st = begin_pass(r, &bv, &p)) != HD_READ_OK) break;
    const uint64_t slots = p.bucket_count < HD_SEQ_SLOTS ? p.bucket_count : HD_SEQ_SLOTS;
    for (uint64_t slot = 0; slot < slots && st == HD_READ_OK && !p.resized && !p.overfull; slot++) {
      st = copy_slot(&p, slot, limits);
    }
    if (st != HD_READ_OK) break;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (p.resized || p.overfull || LOAD(&h->resize_seq) != resize_seq ||
        LOAD(&h->bucket_log2) != p.log2) {
      st = HD_READ_ERR_BUSY;
      continue;
    }
    *blocks = bv.v;
    *count = bv.n;
    return HD_READ_OK;
  }
  free(bv.v);
  return st;
}

hd_read_status hd_alloc_reader_snapshot(hd_alloc_reader *r, hd_live_block **blocks,
                                        size_t *count) {
  hd_read_status st = hd_alloc_reader_snapshot_unordered(r, NULL, blocks, count);
  if (st == HD_READ_OK && *count > 1) qsort(*blocks, *count, sizeof(**blocks), cmp_block);
  return st;
}

/* ------------------------------------------------------------------ resources */

struct hd_res_reader {
  const uint8_t *base;
  uint64_t size;
  uint64_t records_offset;
  uint32_t pid;
};

hd_read_status hd_res_reader_open(int fd, hd_res_reader **out) {
  if (!out) return HD_READ_ERR_ARG;
  *out = NULL;
  const uint8_t *base;
  uint64_t size;
  hd_res_header h = {0};
  hd_read_status st = map_table(fd, HD_RES_MAGIC, &h, sizeof h, &base, &size);
  if (st != HD_READ_OK) return st;
  if (h.header_size != sizeof(h) || h.total_size != size || size > UINT32_MAX ||
           h.records_offset < sizeof(h) || h.records_offset % 8 || h.records_offset > size)
    st = HD_READ_ERR_BAD_SIZE;
  hd_res_reader *r = reader_or_unmap(&st, base, size, sizeof *r);
  if (r == NULL) return st;
  r->base = base;
  r->size = size;
  r->records_offset = h.records_offset;
  r->pid = h.pid;
  *out = r;
  return HD_READ_OK;
}

void hd_res_reader_close(hd_res_reader *r) {
  if (!r) return;
  munmap((void *)r->base, r->size);
  free(r);
}

uint32_t hd_res_reader_pid(const hd_res_reader *r) { return r ? r->pid : 0; }

static uint64_t published_end(const hd_res_reader *r);
static hd_read_status record_at(const hd_res_reader *r, uint64_t off, uint64_t end,
                                hd_rec_header *hdr);

hd_read_status hd_res_reader_stats(hd_res_reader *r, hd_table_stats *out) {
  if (!r || !out) return HD_READ_ERR_ARG;
  const hd_res_header *h = (const hd_res_header *)r->base;
  const hd_stats_block *s = &h->stats;
  memset(out, 0, sizeof(*out));
  /* Acquire pairs with the writer's release store of the newest counters record. */
  uint64_t off = __atomic_load_n(&h->counters_head, __ATOMIC_ACQUIRE);
  out->blocks_freed = LOAD(&s->blocks_freed); /* freed first: live never negative */
  out->bytes_freed = LOAD(&s->bytes_freed);
  out->blocks_allocated = LOAD(&s->blocks_allocated);
  out->bytes_allocated = LOAD(&s->bytes_allocated);
  out->peak_live_bytes = LOAD(&s->peak_live_bytes);
  out->dropped_allocations = LOAD(&s->dropped_allocations);
  out->dropped_stack_traces = LOAD(&s->dropped_stack_traces);
  out->dropped_resources = LOAD(&s->dropped_resources);
  out->stacks_left_to_libunwind = LOAD(&h->stacks_left_to_libunwind);
  /* The per-thread counters records, newest first: each link must point to a valid counters
   * record strictly below the current one, so a corrupt list ends instead of looping. */
  uint64_t end = published_end(r);
  while (off != 0) {
    hd_rec_header hdr;
    if (record_at(r, off, end, &hdr) != HD_READ_OK || hdr.type != HD_REC_COUNTERS ||
        hdr.size < sizeof(hd_rec_counters))
      return HD_READ_ERR_CORRUPT;
    hd_rec_counters c = {0};
    copy_words(&c, r->base + off, sizeof(c));
    out->blocks_freed += c.blocks_freed;
    out->bytes_freed += c.bytes_freed;
    out->blocks_allocated += c.blocks_allocated;
    out->bytes_allocated += c.bytes_allocated;
    if (c.next >= off) return HD_READ_ERR_CORRUPT;
    off = c.next;
  }
  out->live_blocks = out->blocks_allocated >= out->blocks_freed
                         ? out->blocks_allocated - out->blocks_freed : 0;
  out->live_bytes = out->bytes_allocated >= out->bytes_freed
                        ? out->bytes_allocated - out->bytes_freed : 0;
  /* Threads hold back small shares of the live bytes from the peak (see heapdump.h). */
  if (out->peak_live_bytes < out->live_bytes) out->peak_live_bytes = out->live_bytes;
  return HD_READ_OK;
}

static uint64_t published_end(const hd_res_reader *r) {
  /* Acquire pairs with the writer's release store of `used`. */
  uint64_t used = __atomic_load_n(&((const hd_res_header *)r->base)->used, __ATOMIC_ACQUIRE);
  return used > r->size ? r->size : used;
}

/* Validates the record header at off and copies `want` bytes of it into dst. */
static hd_read_status record_at(const hd_res_reader *r, uint64_t off, uint64_t end,
                                hd_rec_header *hdr) {
  if (off < r->records_offset || off % 8 || off + sizeof(*hdr) > end) return HD_READ_ERR_NOT_FOUND;
  copy_words(hdr, r->base + off, sizeof(*hdr));
  if (hdr->size < sizeof(*hdr) || hdr->size % 8 || hdr->size > end - off) return HD_READ_ERR_CORRUPT;
  return HD_READ_OK;
}

hd_read_status hd_res_reader_stack(hd_res_reader *r, uint32_t key, uint64_t *frames, size_t max,
                                   size_t *count, uint64_t *alloc_blocks,
                                   uint64_t *alloc_bytes, bool *truncated) {
  if (!r || !count || (max && !frames)) return HD_READ_ERR_ARG;
  *count = 0;
  uint64_t end = published_end(r);
  hd_rec_header hdr = {0};
  hd_read_status st = record_at(r, key, end, &hdr);
  if (st != HD_READ_OK) return st == HD_READ_ERR_CORRUPT ? HD_READ_ERR_NOT_FOUND : st;
  if (hdr.type != HD_REC_STACK || hdr.size < sizeof(hd_rec_stack)) return HD_READ_ERR_NOT_FOUND;
  hd_rec_stack rec = {0};
  copy_words(&rec, r->base + key, sizeof(rec));
  if (rec.frame_count > HD_MAX_FRAMES || rec.encoded_len > hdr.size - sizeof(rec))
    return HD_READ_ERR_CORRUPT;
  uint8_t enc[HD_MAX_FRAMES * HD_STACK_CODEC_MAX_FRAME_BYTES + 8] = {0};
  if (rec.encoded_len > sizeof(enc)) return HD_READ_ERR_CORRUPT;
  copy_words(enc, r->base + key + sizeof(rec), (rec.encoded_len + 7) & ~7u);
  if (!hd_stack_decode(enc, rec.encoded_len, rec.frame_count, frames,
                       max < HD_MAX_FRAMES ? (unsigned)max : HD_MAX_FRAMES))
    return HD_READ_ERR_CORRUPT;
  const hd_rec_stack *live = (const hd_rec_stack *)(r->base + key);
  if (alloc_blocks) *alloc_blocks = LOAD(&live->alloc_blocks);
  if (alloc_bytes) *alloc_bytes = LOAD(&live->alloc_bytes);
  if (truncated) *truncated = (rec.flags & HD_STACK_TRUNCATED) != 0;
  *count = rec.frame_count;
  return rec.frame_count > max ? HD_READ_ERR_NO_SPACE : HD_READ_OK;
}

static void thread_from(const hd_res_reader *r, uint64_t off, hd_thread_info *out) {
  hd_rec_thread rec = {0};
  copy_words(&rec, r->base + off, sizeof(rec));
  out->key = (uint32_t)off;
  out->tid = rec.tid;
  out->timestamp = rec.timestamp;
  memcpy(out->name, rec.name, sizeof(out->name));
  out->name[sizeof(out->name) - 1] = 0;
}

hd_read_status hd_res_reader_thread(hd_res_reader *r, uint32_t key, hd_thread_info *out) {
  if (!r || !out) return HD_READ_ERR_ARG;
  hd_rec_header hdr = {0};
  hd_read_status st = record_at(r, key, published_end(r), &hdr);
  if (st != HD_READ_OK) return HD_READ_ERR_NOT_FOUND;
  if (hdr.type != HD_REC_THREAD || hdr.size < sizeof(hd_rec_thread)) return HD_READ_ERR_NOT_FOUND;
  thread_from(r, key, out);
  return HD_READ_OK;
}

hd_read_status hd_res_reader_next(hd_res_reader *r, uint64_t *cursor, hd_res_entry *out) {
  if (!r || !cursor || !out) return HD_READ_ERR_ARG;
  uint64_t end = published_end(r);
  for (;;) {
    uint64_t off = *cursor ? *cursor : r->records_offset;
    if (off >= end) return HD_READ_END;
    hd_rec_header hdr = {0};
    hd_read_status st = record_at(r, off, end, &hdr);
    if (st != HD_READ_OK) return HD_READ_ERR_CORRUPT;
    *cursor = off + hdr.size; /* size >= 8: strictly increasing, so the walk terminates */
    memset(out, 0, sizeof(*out));
    out->key = (uint32_t)off;
    switch (hdr.type) {
      case HD_REC_STACK:
        if (hdr.size < sizeof(hd_rec_stack)) return HD_READ_ERR_CORRUPT;
        out->type = HD_ENTRY_STACK;
        return HD_READ_OK;
      case HD_REC_THREAD:
        if (hdr.size < sizeof(hd_rec_thread)) return HD_READ_ERR_CORRUPT;
        out->type = HD_ENTRY_THREAD;
        thread_from(r, off, &out->u.thread);
        return HD_READ_OK;
      case HD_REC_REGION: {
        if (hdr.size < sizeof(hd_rec_region)) return HD_READ_ERR_CORRUPT;
        hd_rec_region rec = {0};
        copy_words(&rec, r->base + off, sizeof(rec));
        if (rec.build_id_len > HD_MAX_BUILD_ID || rec.name_len >= HD_REGION_NAME_MAX ||
            rec.name_len > hdr.size - sizeof(rec))
          return HD_READ_ERR_CORRUPT;
        hd_region *g = &out->u.region;
        out->type = HD_ENTRY_REGION;
        g->key = (uint32_t)off;
        g->address = rec.address;
        g->size = rec.size;
        g->file_offset = rec.file_offset;
        g->vaddr = rec.vaddr;
        memcpy(g->build_id, rec.build_id, rec.build_id_len);
        g->build_id_len = rec.build_id_len;
        char tmp[HD_REGION_NAME_MAX + 8] = {0};
        copy_words(tmp, r->base + off + sizeof(rec), (rec.name_len + 7u) & ~7u);
        memcpy(g->name, tmp, rec.name_len);
        g->name[rec.name_len] = 0;
        return HD_READ_OK;
      }
      case HD_REC_THREAD_ROOTS: {
        if (hdr.size < sizeof(hd_rec_thread_roots)) return HD_READ_ERR_CORRUPT;
        hd_rec_thread_roots rec = {0};
        copy_words(&rec, r->base + off, sizeof(rec));
        out->type = HD_ENTRY_THREAD_ROOTS;
        out->u.thread_roots = (hd_thread_roots){.tid = rec.tid, .stack_lo = rec.stack_lo,
                                                .stack_hi = rec.stack_hi,
                                                .thread_pointer = rec.thread_pointer};
        return HD_READ_OK;
      }
      default:
        continue; /* unknown record kinds of newer writers are skipped */
    }
  }
}
