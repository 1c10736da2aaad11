/* Hostile-memory reader of the heapdump tables: copy with relaxed atomic loads, validate,
 * then use. Implements the reader half of the protocol in shm_layout.h (steps R1-R3). */
#define _GNU_SOURCE
#include "table_reader.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "heapdump/contract/cpu.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/contract/shm_layout.h"
#include "heapdump/contract/stack_codec.h"

#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
/* A slot whose writer keeps it changing (or holds it, e.g. preempted on a loaded machine) is
 * retried for up to kSlotPatienceNs; only a slot stuck longer than that fails the snapshot, so a
 * hostile table cannot hang the reader and a busy one does not fail it. */
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
    case HD_READ_ERR_TIMED_OUT:
      return "live snapshot failed: the table stayed locked past the read time limit";
    case HD_READ_ERR_STOPPED: return "stopped";
  }
  return "unknown status";
}

static HD_MUST_CHECK hd_read_status map_fd(int fd, const uint8_t **base, uint64_t *size) {
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
static HD_MUST_CHECK hd_read_status map_table(int fd, uint64_t magic, void *header,
                                              size_t header_size, const uint8_t **base,
                                              uint64_t *size) {
  hd_read_status st = map_fd(fd, base, size);
  if (st != HD_READ_OK) return st;
  copy_words(header, *base, header_size);
  uint64_t found_magic;
  uint32_t found_version;
  memcpy(&found_magic, header, sizeof found_magic);
  memcpy(&found_version, (const uint8_t *)header + 8, sizeof found_version);
  if (found_magic != magic)
    st = HD_READ_ERR_BAD_MAGIC;
  else if (found_version != HD_LAYOUT_VERSION)
    st = HD_READ_ERR_BAD_VERSION;
  if (st != HD_READ_OK) munmap((void *)*base, *size);
  return st;
}

/* ------------------------------------------------------------------ allocations */

struct hd_alloc_reader {
  const uint8_t *base;
  uint64_t size;
  hd_alloc_header h; /* validated private copy of the immutable fields */
  int fd;            /* the memfd opened again, to find its holes (SEEK_DATA); -1 if it could
                        not be */
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
      h.seq_slots != HD_SEQ_SLOTS || h.nodes_per_slot != HD_NODES_PER_SLOT ||
      h.total_size != size || h.node_capacity >= UINT32_MAX || h.seq_offset < sizeof(h) ||
      (h.seq_offset | h.nodes_offset) % 8 ||
      !range_ok(h.seq_offset, (uint64_t)HD_SEQ_SLOTS * 4, size) ||
      h.nodes_offset < h.seq_offset + (uint64_t)HD_SEQ_SLOTS * 4 ||
      !range_ok(h.nodes_offset, (uint64_t)h.node_capacity * sizeof(hd_alloc_node), size))
    st = HD_READ_ERR_BAD_SIZE;
  hd_alloc_reader *r = reader_or_unmap(&st, base, size, sizeof *r);
  if (r == NULL) return st;
  /* Opened again, not duplicated: a duplicate would share the caller's file offset, which
   * SEEK_DATA moves. */
  char path[48];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  r->fd = open(path, O_RDONLY | O_CLOEXEC); /* -1 (no /proc): every node is read */
  r->base = base;
  r->size = size;
  r->h = h;
  *out = r;
  return HD_READ_OK;
}

void hd_alloc_reader_close(hd_alloc_reader *r) {
  if (!r) return;
  munmap((void *)r->base, r->size);
  if (r->fd >= 0) close(r->fd);
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
  out->total_size = r->size;
  out->snapshot_peak_mark = LOAD(&h->snapshot_peak_mark);
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

/* Room for cap blocks, grown at least twofold. */
static bool reserve(block_vec *bv, size_t cap) {
  if (cap <= bv->cap) return true;
  if (cap < bv->cap * 2) cap = bv->cap * 2;
  hd_live_block *v = realloc(bv->v, cap * sizeof(*v));
  if (!v) return false;
  bv->v = v;
  bv->cap = cap;
  return true;
}

/* Nodes ever handed out, bounded by the capacity whatever the header claims: no live record is
 * in a node past it. */
static uint64_t high_water_now(const hd_alloc_reader *r) {
  uint64_t high_water = LOAD(&((const hd_alloc_header *)r->base)->node_high_water);
  return high_water < r->h.node_capacity ? high_water : r->h.node_capacity;
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
static HD_MUST_CHECK hd_read_status keep_waiting(const hd_read_limits *limits,
                                                 uint64_t give_up_at) {
  const uint64_t now = monotonic_ns();
  if (limits != NULL && limits->stop != NULL && limits->stop(limits->stop_ctx))
    return HD_READ_ERR_STOPPED;
  if (limits != NULL && limits->deadline_ns != 0 && now > limits->deadline_ns)
    return HD_READ_ERR_TIMED_OUT;
  return now > give_up_at ? HD_READ_ERR_BUSY : HD_READ_OK;
}

/* Copies the live nodes [first, end) of one slot as a seqlock reader (R1-R3): again while a
 * writer changes the slot, until a copy is stable. */
static HD_MUST_CHECK hd_read_status copy_run(const hd_alloc_reader *r, uint32_t first, uint32_t end,
                                             block_vec *bv, hd_read_limits *limits) {
  const uint32_t *seq = (const uint32_t *)(r->base + r->h.seq_offset) + hd_node_slot(first);
  const hd_alloc_node *nodes = (const hd_alloc_node *)(r->base + r->h.nodes_offset);
  const bool final = limits != NULL && limits->final;
  uint64_t give_up_at = 0;
  hd_read_status waited;
  for (unsigned attempt = 0;; attempt++) {
    if (attempt == 16) give_up_at = monotonic_ns() + kSlotPatienceNs;
    if (attempt > 16 && attempt % 64 == 0 &&
        (waited = keep_waiting(limits, give_up_at)) != HD_READ_OK) {
      return waited;
    }
    const uint32_t s1 = __atomic_load_n(seq, __ATOMIC_ACQUIRE); /* R1, pairs with W3 */
    if ((s1 & 1) && !final) {
      backoff(attempt);
      continue;
    }
    const size_t mark = bv->n;
    for (uint32_t i = first; i < end; i++) { /* R2 */
      const hd_alloc_node *n = &nodes[i];
      const uint64_t address_word = LOAD(&n->address_word);
      if (hd_node_address(address_word) == 0) continue; /* free (no block is at address 0) */
      const uint64_t time_word = LOAD(&n->time_word);
      bv->v[bv->n] = (hd_live_block){
          .address = hd_node_address(address_word),
          .size = hd_node_size(LOAD(&n->size_low), address_word),
          .timestamp = hd_node_timestamp(time_word, r->h.time_base),
          .thread_key = LOAD(&n->thread_key),
          .stack_key = LOAD(&n->stack_key),
          .flags = hd_node_align_log2(time_word),
      };
      bv->n++;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* R3 */
    if (LOAD(seq) == s1) return HD_READ_OK;
    bv->n = mark; /* a writer changed the slot: copy the run again */
    backoff(attempt);
  }
}

/* A copied block and where it stands in the copy, for settling doubles. */
typedef struct {
  uint64_t address, timestamp;
  size_t at;
} copied_at;

static int cmp_copied_at(const void *a, const void *b) {
  const copied_at *x = a, *y = b;
  if (x->address != y->address) return x->address < y->address ? -1 : 1;
  if (x->timestamp != y->timestamp) return x->timestamp < y->timestamp ? -1 : 1;
  return x->at < y->at ? -1 : x->at > y->at;
}

/* array (*cap elements of elem bytes, n in use) with room for one more: itself, or doubled;
 * NULL (array untouched) if out of memory. */
static void *room_for_one(void *array, size_t *cap, size_t n, size_t elem) {
  if (n < *cap) return array;
  const size_t grown_cap = *cap ? *cap * 2 : 256;
  void *grown = realloc(array, grown_cap * elem);
  if (grown != NULL) *cap = grown_cap;
  return grown;
}

static uint64_t mix_address(uint64_t address) {
  uint64_t h = address * UINT64_C(0x9E3779B97F4A7C15);
  return h ^ (h >> 29);
}

static int cmp_address(const void *a, const void *b) {
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Sorts addresses[0..n) and drops repeats; the count kept. A sorted array rather than a hash
 * set: a hostile table picks its addresses, and could pile them onto one run of a hash set. */
static size_t sort_unique(uint64_t *addresses, size_t n) {
  if (n == 0) return 0;
  qsort(addresses, n, sizeof *addresses, cmp_address);
  size_t kept = 1;
  for (size_t i = 1; i < n; i++) {
    if (addresses[i] != addresses[kept - 1]) addresses[kept++] = addresses[i];
  }
  return kept;
}

/* Of an address copied twice, keeps the newer record (the older is dropped). An honest table's
 * copy meets an address twice only when a block freed while the copy ran was allocated again at
 * its address in a later node; a hostile one anyhow. Every address goes through a Bloom filter
 * of two bits in sixteen per block (in a cache-sized array, where a set of every address would
 * miss the caches at each insert); only the addresses the filter may have seen before, a few
 * percent, are looked at exactly. */
static bool settle_doubles(block_vec *bv) {
  if (bv->n < 2) return true;
  uint64_t bits = 1 << 16;
  while (bits < 16 * (uint64_t)bv->n) bits *= 2;
  uint64_t *bloom = calloc(bits / 64, sizeof *bloom);
  size_t maybe_n = 0, maybe_cap = 0;
  uint64_t *maybe_list = NULL;
  bool ok = bloom != NULL;
  for (size_t k = 0; ok && k < bv->n; k++) {
    const uint64_t h = mix_address(bv->v[k].address);
    const uint64_t b1 = h & (bits - 1), b2 = (h >> 32) & (bits - 1);
    const bool seen = (bloom[b1 / 64] >> (b1 % 64) & 1) && (bloom[b2 / 64] >> (b2 % 64) & 1);
    bloom[b1 / 64] |= UINT64_C(1) << (b1 % 64);
    bloom[b2 / 64] |= UINT64_C(1) << (b2 % 64);
    if (!seen) continue;
    uint64_t *grown = room_for_one(maybe_list, &maybe_cap, maybe_n, sizeof *maybe_list);
    ok = grown != NULL;
    if (ok) (maybe_list = grown)[maybe_n++] = bv->v[k].address;
  }
  free(bloom);
  if (ok) maybe_n = sort_unique(maybe_list, maybe_n);
  if (!ok || maybe_n == 0) {
    free(maybe_list);
    return ok;
  }
  /* Every copy of an address the filter may have seen twice, then the doubles among them. */
  copied_at *suspects = NULL;
  size_t suspects_n = 0, suspects_cap = 0;
  for (size_t k = 0; ok && k < bv->n; k++) {
    if (!bsearch(&bv->v[k].address, maybe_list, maybe_n, sizeof *maybe_list, cmp_address)) continue;
    copied_at *grown = room_for_one(suspects, &suspects_cap, suspects_n, sizeof *suspects);
    ok = grown != NULL;
    if (ok) (suspects = grown)[suspects_n++] = (copied_at){bv->v[k].address, bv->v[k].timestamp, k};
  }
  free(maybe_list);
  if (ok && suspects_n > 1) {
    qsort(suspects, suspects_n, sizeof *suspects, cmp_copied_at);
    size_t doubles = 0;
    for (size_t i = 0; i + 1 < suspects_n; i++) {
      if (suspects[i].address != suspects[i + 1].address) continue;
      bv->v[suspects[i].at].address = 0; /* the older of two; addresses are never 0 */
      doubles++;
    }
    if (doubles > 0) {
      size_t kept = 0;
      for (size_t k = 0; k < bv->n; k++) {
        if (bv->v[k].address != 0) bv->v[kept++] = bv->v[k];
      }
      bv->n = kept;
    }
  }
  free(suspects);
  return ok;
}

hd_read_status hd_alloc_reader_snapshot_unordered(hd_alloc_reader *r, hd_read_limits *limits,
                                                  hd_live_block **blocks, size_t *count) {
  if (!r || !blocks || !count) return HD_READ_ERR_ARG;
  *blocks = NULL;
  *count = 0;
  /* Nodes handed out later hold blocks allocated after the copy began: none is missed that was
   * live during the whole copy. */
  const uint64_t high_water = high_water_now(r);
  block_vec bv = {0};
  if (!reserve(&bv, 1)) return HD_READ_ERR_NO_MEMORY;
  hd_read_status st = HD_READ_OK;
  /* Pages of the memfd never written hold no live node; reading them would make the kernel
   * commit them, so a table claiming more nodes than it wrote could make its reader commit the
   * memfd's whole size. Only the memfd's data is read. */
  const uint64_t node_bytes = sizeof(hd_alloc_node), nodes_at = r->h.nodes_offset;
  uint64_t first = 0;
  while (first < high_water && st == HD_READ_OK) {
    uint64_t from = first, to = high_water;
    const off_t at_first = (off_t)(nodes_at + first * node_bytes);
    const off_t data = r->fd < 0 ? -1 : lseek(r->fd, at_first, SEEK_DATA);
    if (data < 0 && r->fd >= 0 && errno == ENXIO) break; /* no data past this point */
    const off_t hole = data < 0 ? -1 : lseek(r->fd, data, SEEK_HOLE);
    if (hole >= 0) { /* else no map of the holes: every node is read */
      /* The nodes in [data, hole), from the start of the run holding the first (a run's slot
       * guards all of it). Pages hold whole nodes. */
      from = ((uint64_t)data - nodes_at) / node_bytes / HD_NODES_PER_SLOT * HD_NODES_PER_SLOT;
      to = ((uint64_t)hole - nodes_at) / node_bytes;
      if (from < first) from = first;
      if (to > high_water) to = high_water;
    }
    if (from >= to) break;
    /* Room for what these pages can hold, not for what the header claims: a table's own
     * high-water mark costs its reader nothing past the data written. */
    if (!reserve(&bv, bv.n + (to - from))) {
      st = HD_READ_ERR_NO_MEMORY;
      break;
    }
    for (uint64_t at = from; at < to && st == HD_READ_OK; at += HD_NODES_PER_SLOT) {
      const uint64_t run_end = at + HD_NODES_PER_SLOT < to ? at + HD_NODES_PER_SLOT : to;
      st = copy_run(r, (uint32_t)at, (uint32_t)run_end, &bv, limits);
    }
    first = (to + HD_NODES_PER_SLOT - 1) / HD_NODES_PER_SLOT * HD_NODES_PER_SLOT;
  }
  if (st == HD_READ_OK && !settle_doubles(&bv)) st = HD_READ_ERR_NO_MEMORY;
  if (st != HD_READ_OK) {
    free(bv.v);
    return st;
  }
  *blocks = bv.v;
  *count = bv.n;
  return HD_READ_OK;
}

hd_read_status hd_alloc_reader_snapshot(hd_alloc_reader *r, hd_live_block **blocks, size_t *count) {
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

uint64_t hd_res_reader_sample_bytes(const hd_res_reader *r) {
  if (!r) return 0;
  const uint64_t n = LOAD(&((const hd_res_header *)r->base)->sample_bytes);
  return n > HD_MAX_SAMPLE_BYTES ? HD_MAX_SAMPLE_BYTES : n;
}

uint32_t hd_res_reader_arm_state(const hd_res_reader *r) {
  if (!r) return HD_ARM_FROM_START;
  const uint32_t state = LOAD(&((const hd_res_header *)r->base)->arm_state);
  return state == HD_ARM_ARMED || state == HD_ARM_DISARMED ? state : HD_ARM_FROM_START;
}

uint32_t hd_res_reader_arm_generation(const hd_res_reader *r) {
  return r ? __atomic_load_n(&((const hd_res_header *)r->base)->arm_generation, __ATOMIC_ACQUIRE)
           : 0;
}

static uint64_t published_end(const hd_res_reader *r);
static HD_MUST_CHECK hd_read_status record_at(const hd_res_reader *r, uint64_t off, uint64_t end,
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
  out->stacks_beyond_cfi = LOAD(&h->stacks_beyond_cfi);
  out->writes_past_block_end = LOAD(&h->overwritten_tags);
  out->mapping_records_lost = LOAD(&h->mapping_records_lost);
  out->unwind_tables_refused = LOAD(&h->unwind_tables_refused);
  out->peak_mark = LOAD(&h->peak_mark);
  out->peak_mark_bytes = LOAD(&h->peak_mark_bytes);
  out->start_time_ns = LOAD(&h->start_time_ns);
  out->sample_bytes = hd_res_reader_sample_bytes(r);
  out->arm_state = hd_res_reader_arm_state(r);
  const int64_t unattributed = (int64_t)LOAD(&h->unattributed_bytes);
  out->unattributed_bytes =
      out->arm_state == HD_ARM_FROM_START || unattributed < 0 ? 0 : (uint64_t)unattributed;
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
  out->live_blocks =
      out->blocks_allocated >= out->blocks_freed ? out->blocks_allocated - out->blocks_freed : 0;
  out->live_bytes =
      out->bytes_allocated >= out->bytes_freed ? out->bytes_allocated - out->bytes_freed : 0;
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
static HD_MUST_CHECK hd_read_status record_at(const hd_res_reader *r, uint64_t off, uint64_t end,
                                              hd_rec_header *hdr) {
  if (off < r->records_offset || off % 8 || off + sizeof(*hdr) > end) return HD_READ_ERR_NOT_FOUND;
  copy_words(hdr, r->base + off, sizeof(*hdr));
  if (hdr->size < sizeof(*hdr) || hdr->size % 8 || hdr->size > end - off)
    return HD_READ_ERR_CORRUPT;
  return HD_READ_OK;
}

/* How long reads of trace counts wait in all for threads changing the key of an entry holding
 * the trace (a few stores, unless the thread was preempted there): one read without an index,
 * every read through one index (a snapshot's). Past it, a read gives its last round, in which
 * that entry's blocks may be counted twice or not at all, marked unsettled. */
static const uint64_t kPendingPatienceNs = 1000000000u;

/* The counters record at off, or NULL if there is none (a corrupt link). */
static const hd_rec_counters *counters_at(const hd_res_reader *r, uint64_t off, uint64_t end) {
  hd_rec_header hdr;
  if (record_at(r, off, end, &hdr) != HD_READ_OK || hdr.type != HD_REC_COUNTERS ||
      hdr.size < sizeof(hd_rec_counters))
    return NULL;
  return (const hd_rec_counters *)(r->base + off);
}

/* One entry of the seqlock reads below: its seq into *seq_sum and, if add is given and the
 * entry holds key, its counts into *add (false if it is mid-change: the trace's record may hold
 * its counts already, or not yet). */
static inline bool visit_entry(const hd_pending_trace *e, uint32_t key, uint64_t *seq_sum,
                               hd_trace_counters *add) {
  const uint32_t seq = __atomic_load_n(&e->seq, __ATOMIC_ACQUIRE);
  *seq_sum += seq;
  if (add == NULL || __atomic_load_n(&e->stack_key, __ATOMIC_ACQUIRE) != key) return true;
  add->allocated_blocks += LOAD(&e->alloc_blocks);
  add->allocated_bytes += LOAD(&e->alloc_bytes);
  add->temporary_blocks += LOAD(&e->temporary_blocks);
  return (seq & 1) == 0;
}

/* Where a read of trace key looks: the index's entries that held it, or, without an index,
 * key's slot in every counters record from head down (each link at least a record below the
 * last, so the walk ends; it stops at a corrupt one). */
typedef struct pending_scope {
  const hd_res_reader *r;
  const hd_pending_index *index;
  uint64_t head, end;
  size_t first, last; /* the index's entries for key: [first, last) */
} pending_scope;

struct hd_pending_index {
  const uint8_t *base;   /* of the reader it was made from: its offsets are into that table */
  uint64_t wait_left_ns; /* what its reads may still wait (kPendingPatienceNs in all) */
  size_t count;
  struct {
    uint32_t key;
    uint32_t entry; /* offset of the hd_pending_trace in the table */
  } at[];
};

static bool walk_pending(const pending_scope *scope, uint32_t key, uint64_t *seq_sum,
                         hd_trace_counters *add) {
  bool settled = true;
  *seq_sum = 0;
  if (scope->index != NULL) {
    for (size_t i = scope->first; i < scope->last; i++) {
      const uint8_t *at = scope->r->base + scope->index->at[i].entry;
      settled &= visit_entry((const hd_pending_trace *)at, key, seq_sum, add);
    }
    return settled;
  }
  const uint32_t slot = hd_pending_slot(key);
  for (uint64_t off = scope->head; off != 0;) {
    const hd_rec_counters *c = counters_at(scope->r, off, scope->end);
    if (c == NULL) break;
    settled &= visit_entry(&c->pending[slot], key, seq_sum, add);
    const uint64_t next = LOAD(&c->next);
    off = next + sizeof(hd_rec_counters) <= off ? next : 0;
  }
  return settled;
}

static int cmp_index_key(const void *a, const void *b) {
  const uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return x < y ? -1 : x > y;
}

hd_pending_index *hd_res_reader_pending_index(const hd_res_reader *r) {
  if (r == NULL) return NULL;
  const uint64_t head =
      __atomic_load_n(&((const hd_res_header *)r->base)->counters_head, __ATOMIC_ACQUIRE);
  const uint64_t end = published_end(r);
  size_t records = 0;
  for (uint64_t off = head; off != 0; records++) {
    const hd_rec_counters *c = counters_at(r, off, end);
    if (c == NULL) break;
    const uint64_t next = LOAD(&c->next);
    off = next + sizeof(hd_rec_counters) <= off ? next : 0;
  }
  hd_pending_index *index =
      malloc(sizeof(*index) + records * HD_PENDING_TRACES * sizeof(index->at[0]));
  if (index == NULL) return NULL;
  index->base = r->base;
  index->wait_left_ns = kPendingPatienceNs;
  index->count = 0;
  for (uint64_t off = head; off != 0 && records-- > 0;) {
    const hd_rec_counters *c = counters_at(r, off, end);
    if (c == NULL) break;
    for (uint32_t i = 0; i < HD_PENDING_TRACES; i++) {
      const uint32_t key = __atomic_load_n(&c->pending[i].stack_key, __ATOMIC_ACQUIRE);
      if (key == 0) continue;
      index->at[index->count].key = key;
      index->at[index->count].entry = (uint32_t)((const uint8_t *)&c->pending[i] - r->base);
      index->count++;
    }
    const uint64_t next = LOAD(&c->next);
    off = next + sizeof(hd_rec_counters) <= off ? next : 0;
  }
  qsort(index->at, index->count, sizeof(index->at[0]), cmp_index_key);
  return index;
}

void hd_pending_index_free(hd_pending_index *index) { free(index); }

/* A trace's counters: its record's plus the threads' entries holding it, read as a seqlock
 * reader of those entries (shm_layout.h, hd_rec_counters): the entries, then the record, then
 * the entries' seq again; an entry that changed its key in between (which moves its counts into
 * the record) sends the read round again (seqs only grow, so their sum tells). The second walk
 * visits the same entries: one that took the trace since holds only what was allocated after
 * the read began (with an index, after the index was made). Keeps no state: readers share an
 * hd_res_reader. */
static void read_trace_counters(const hd_res_reader *r, hd_pending_index *index, uint32_t key,
                                hd_trace_counters *out) {
  const hd_rec_stack *live = (const hd_rec_stack *)(r->base + key);
  if (index != NULL && index->base != r->base) index = NULL; /* another table's */
  pending_scope scope = {.r = r, .index = index};
  if (index != NULL) {
    size_t lo = 0, hi = index->count;
    while (lo < hi) { /* the first entry whose key is not below key */
      const size_t mid = lo + (hi - lo) / 2;
      if (index->at[mid].key < key)
        lo = mid + 1;
      else
        hi = mid;
    }
    scope.first = scope.last = lo;
    while (scope.last < index->count && index->at[scope.last].key == key) scope.last++;
  }
  uint64_t waiting_since = 0;
  const uint64_t patience = index != NULL ? index->wait_left_ns : kPendingPatienceNs;
  for (unsigned attempt = 0;; attempt++) {
    scope.head =
        __atomic_load_n(&((const hd_res_header *)r->base)->counters_head, __ATOMIC_ACQUIRE);
    /* After the head: a record the head names is published below this end. */
    scope.end = published_end(r);
    hd_trace_counters sum = {0};
    uint64_t seq_before, seq_after;
    bool settled = walk_pending(&scope, key, &seq_before, &sum);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    sum.allocated_blocks += LOAD(&live->alloc_blocks);
    sum.allocated_bytes += LOAD(&live->alloc_bytes);
    sum.temporary_blocks += LOAD(&live->temporary_blocks);
    sum.peak_freed_blocks = LOAD(&live->peak_freed_blocks);
    sum.peak_freed_bytes = LOAD(&live->peak_freed_bytes);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    (void)walk_pending(&scope, key, &seq_after, NULL);
    *out = sum;
    if (settled && seq_after == seq_before) break;
    if (attempt == 16) waiting_since = monotonic_ns();
    if (attempt >= 16 && monotonic_ns() - waiting_since >= patience) {
      out->unsettled = true;
      break;
    }
    backoff(attempt);
  }
  if (index != NULL && waiting_since != 0) {
    const uint64_t waited = monotonic_ns() - waiting_since;
    index->wait_left_ns = waited < index->wait_left_ns ? index->wait_left_ns - waited : 0;
  }
}

hd_read_status hd_res_reader_stack(hd_res_reader *r, uint32_t key, uint64_t *frames, size_t max,
                                   size_t *count, hd_trace_counters *counters, bool *truncated) {
  return hd_res_reader_stack_indexed(r, NULL, key, frames, max, count, counters, truncated);
}

hd_read_status hd_res_reader_stack_indexed(hd_res_reader *r, hd_pending_index *index, uint32_t key,
                                           uint64_t *frames, size_t max, size_t *count,
                                           hd_trace_counters *counters, bool *truncated) {
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
  if (counters) read_trace_counters(r, index, key, counters);
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
        out->u.thread_roots = (hd_thread_roots){.tid = rec.tid,
                                                .stack_lo = rec.stack_lo,
                                                .stack_hi = rec.stack_hi,
                                                .thread_pointer = rec.thread_pointer};
        return HD_READ_OK;
      }
      case HD_REC_MAPPING: {
        if (hdr.size < sizeof(hd_rec_mapping)) return HD_READ_ERR_CORRUPT;
        hd_rec_mapping rec = {0};
        copy_words(&rec, r->base + off, sizeof(rec));
        out->type = HD_ENTRY_MAPPING;
        out->u.mapping = (hd_mapping_change){
            .kind = rec.kind, .mapped = rec.mapped != 0, .start = rec.start, .size = rec.size};
        return HD_READ_OK;
      }
      default: continue; /* unknown record kinds of newer writers are skipped */
    }
  }
}
