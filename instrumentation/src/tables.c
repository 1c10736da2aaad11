/* Writer side of the allocations and resources tables: memfd creation and sealing, the
 * slot-seqlock hash table of live blocks, and the append-only resources log. */
#define _GNU_SOURCE
#include "tables.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "heapdump/contract/cpu.h"
#include "heapdump/contract/stack_codec.h"

#define PAGE 4096u
#define ALIGN_UP(x, a) (((x) + (a) - 1) & ~((uint64_t)(a) - 1))
#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define HD_UNLIKELY_T(x) __builtin_expect(!!(x), 0)

static int make_memfd(const char *name, uint64_t size, void **map, hd_owned_fd *out) {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -errno;
  if (ftruncate(fd, (off_t)size) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    int e = -errno;
    close(fd);
    return e;
  }
  if (!hd_owned_fd_take(fd, out)) return -EBADF;
  void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, out->fd, 0);
  if (m == MAP_FAILED) {
    int e = -errno;
    hd_owned_fd_close(out);
    return e;
  }
  *map = m;
  return 0;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ allocations table */

static const uint64_t kSeqOffset = PAGE;
static const uint64_t kSeqBytes = HD_SEQ_SLOTS * sizeof(uint32_t);

/* Geometry for a table of `total` bytes: the largest node count whose worst-case bucket array
 * (load factor 2 at the last doubling, so capacity/2 buckets) still fits. */
static void geometry(uint64_t total, uint32_t *bucket_log2, uint32_t *capacity) {
  uint64_t fixed = kSeqOffset + kSeqBytes;
  uint64_t cap = total > fixed ? (total - fixed) / sizeof(hd_alloc_node) : 0;
  uint32_t log2 = HD_MIN_BUCKET_LOG2;
  for (int iter = 0; iter < 4; iter++) {
    log2 = HD_MIN_BUCKET_LOG2;
    while (((uint64_t)1 << log2) * 2 < cap && log2 < 31) log2++;
    uint64_t bucket_bytes = ALIGN_UP(((uint64_t)4 << log2), PAGE);
    cap = total > fixed + bucket_bytes ? (total - fixed - bucket_bytes) / sizeof(hd_alloc_node) : 0;
  }
  if (cap > UINT32_MAX - 1) cap = UINT32_MAX - 1;
  *bucket_log2 = log2;
  *capacity = (uint32_t)cap;
}

uint64_t hd_alloc_table_bytes_for(uint64_t nodes) {
  uint32_t log2 = HD_MIN_BUCKET_LOG2;
  while (((uint64_t)1 << log2) * 2 < nodes && log2 < 31) log2++;
  return kSeqOffset + kSeqBytes + ALIGN_UP(((uint64_t)4 << log2), PAGE) +
         ALIGN_UP((nodes ? nodes : 1) * sizeof(hd_alloc_node), PAGE);
}

int hd_alloc_table_create(hd_alloc_table *t, uint64_t max_bytes, const char *memfd_name) {
  memset(t, 0, sizeof(*t));
  t->memfd = HD_OWNED_FD_NONE;
  uint64_t min = hd_alloc_table_bytes_for(1024);
  if (max_bytes < min) max_bytes = min;
  if (max_bytes > HD_MAX_TABLE_BYTES) max_bytes = HD_MAX_TABLE_BYTES;
  max_bytes = ALIGN_UP(max_bytes, PAGE);
  uint32_t max_log2, capacity;
  geometry(max_bytes, &max_log2, &capacity);
  void *m;
  int rc = make_memfd(memfd_name, max_bytes, &m, &t->memfd);
  if (rc != 0) return rc;
  t->size = max_bytes;
  t->hdr = m;
  hd_alloc_header *h = t->hdr;
  h->magic = HD_ALLOC_MAGIC;
  h->version = HD_LAYOUT_VERSION;
  h->header_size = sizeof(*h);
  h->total_size = max_bytes;
  h->node_size = sizeof(hd_alloc_node);
  h->seq_slots = HD_SEQ_SLOTS;
  h->max_bucket_log2 = max_log2;
  h->bucket_log2 = HD_MIN_BUCKET_LOG2;
  h->node_capacity = capacity;
  h->seq_offset = kSeqOffset;
  h->buckets_offset = kSeqOffset + kSeqBytes;
  h->nodes_offset = h->buckets_offset + ALIGN_UP(((uint64_t)4 << max_log2), PAGE);
  h->pid = (uint32_t)getpid();
  t->seq = (uint32_t *)((uint8_t *)m + h->seq_offset);
  t->buckets = (uint32_t *)((uint8_t *)m + h->buckets_offset);
  t->nodes = (hd_alloc_node *)((uint8_t *)m + h->nodes_offset);
  t->free_top = HD_LINK_NONE;
  pthread_mutex_init(&t->world_lock, NULL);
  /* Publishes the header before the fd can be handed to anybody. */
  __atomic_thread_fence(__ATOMIC_RELEASE);
  return 0;
}

void hd_alloc_table_destroy(hd_alloc_table *t) {
  if (t->hdr) munmap(t->hdr, t->size);
  hd_owned_fd_close(&t->memfd);
  t->hdr = NULL;
}

/* A slot lock is held for tens of nanoseconds, so a waiter spins first. Past that, its holder
 * was preempted, and the waiter sleeps on the slot's word: spinning or sched_yield() would never
 * let a lower-priority holder run again under real-time scheduling (SCHED_FIFO threads on one
 * CPU hang for good). The unlocker wakes sleepers when the table has any; its check is not
 * fenced against the sleeper's (a fence on every unlock would cost the hot path), so a wake-up
 * can be missed, and a sleeper gives up after kSlotSleepNs and looks again. */
enum { kSlotSpins = 128 };
static const long kSlotSleepNs = 200000;

static void slot_sleep(hd_alloc_table *t, uint32_t *seq, uint32_t held) {
  __atomic_fetch_add(&t->slot_sleepers, 1, __ATOMIC_SEQ_CST);
  struct timespec timeout = {0, kSlotSleepNs};
  /* Returns at once if the word no longer holds `held` (unlocked meanwhile). */
  syscall(SYS_futex, seq, FUTEX_WAIT_PRIVATE, held, &timeout, NULL, 0);
  __atomic_fetch_sub(&t->slot_sleepers, 1, __ATOMIC_RELAXED);
}

/* W1: slot lock = seqlock write begin. */
static void slot_lock(hd_alloc_table *t, uint32_t *seq) {
  for (unsigned attempt = 0;; attempt++) {
    uint32_t s = LOAD(seq);
    if (!(s & 1) && __atomic_compare_exchange_n(seq, &s, s + 1, true, __ATOMIC_ACQUIRE,
                                                __ATOMIC_RELAXED)) {
      __atomic_thread_fence(__ATOMIC_RELEASE); /* odd value before the data stores */
      return;
    }
    if (attempt < kSlotSpins) hd_cpu_relax();
    else if (s & 1) slot_sleep(t, seq, s);
  }
}

/* W3: seqlock write end, publishes the data stores. */
static void slot_unlock(hd_alloc_table *t, uint32_t *seq) {
  __atomic_store_n(seq, LOAD(seq) + 1, __ATOMIC_RELEASE);
  if (HD_UNLIKELY_T(LOAD(&t->slot_sleepers) != 0))
    syscall(SYS_futex, seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Locks the slot of address's bucket at the current bucket count; returns the bucket. */
static uint32_t lock_bucket(hd_alloc_table *t, uint64_t hash, uint32_t **seq_out) {
  for (;;) {
    uint32_t log2 = LOAD(&t->hdr->bucket_log2);
    uint32_t b = (uint32_t)(hash & (((uint64_t)1 << log2) - 1));
    uint32_t *seq = &t->seq[b & (HD_SEQ_SLOTS - 1)];
    slot_lock(t, seq);
    if (LOAD(&t->hdr->bucket_log2) == log2) {
      *seq_out = seq;
      return b;
    }
    slot_unlock(t, seq); /* doubled meanwhile */
  }
}

/* Nodes taken from the never-used range at once by a thread with a cache. */
#define HIGH_WATER_BATCH 16u

static uint32_t node_alloc(hd_alloc_table *t, hd_writer_thread *w) {
  if (w && w->node_count) return w->nodes[--w->node_count];
  uint64_t top = __atomic_load_n(&t->free_top, __ATOMIC_ACQUIRE);
  while ((uint32_t)top != HD_LINK_NONE) {
    uint32_t idx = (uint32_t)top - 1;
    uint64_t next = LOAD(&t->nodes[idx].next);
    uint64_t desired = (((top >> 32) + 1) << 32) | next;
    if (__atomic_compare_exchange_n(&t->free_top, &top, desired, true, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      return idx;
  }
  uint32_t want = w && !w->retired ? HIGH_WATER_BATCH : 1;
  uint32_t hw = LOAD(&t->hdr->node_high_water), got;
  do {
    if (hw >= t->hdr->node_capacity) return UINT32_MAX;
    got = t->hdr->node_capacity - hw < want ? t->hdr->node_capacity - hw : want;
  } while (!__atomic_compare_exchange_n(&t->hdr->node_high_water, &hw, hw + got, true,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED));
  for (uint32_t i = got - 1; i > 0; i--) w->nodes[w->node_count++] = hw + i;
  return hw;
}

/* Pushes the chain first..last (linked through next) onto the shared free list. */
static void free_list_push(hd_alloc_table *t, uint32_t first, uint32_t last) {
  uint64_t top = __atomic_load_n(&t->free_top, __ATOMIC_RELAXED);
  uint64_t desired;
  do {
    STORE(&t->nodes[last].next, (uint32_t)top);
    desired = (((top >> 32) + 1) << 32) | (first + 1);
  } while (!__atomic_compare_exchange_n(&t->free_top, &top, desired, true, __ATOMIC_RELEASE,
                                        __ATOMIC_RELAXED));
}

/* Hands n nodes from the bottom of w's cache to the shared free list in one push. */
static void cache_spill(hd_alloc_table *t, hd_writer_thread *w, uint32_t n) {
  for (uint32_t i = 0; i + 1 < n; i++) STORE(&t->nodes[w->nodes[i]].next, w->nodes[i + 1] + 1);
  free_list_push(t, w->nodes[0], w->nodes[n - 1]);
  memmove(w->nodes, w->nodes + n, (w->node_count - n) * sizeof(w->nodes[0]));
  w->node_count -= n;
}

static void node_free(hd_alloc_table *t, hd_writer_thread *w, uint32_t idx) {
  if (w && !w->retired) {
    if (w->node_count == HD_THREAD_NODE_CACHE) cache_spill(t, w, HD_THREAD_NODE_CACHE / 2);
    w->nodes[w->node_count++] = idx;
    return;
  }
  free_list_push(t, idx, idx);
}

/* Everything but the address, which is what marks a node as linked (see maybe_grow). */
static void node_write_payload(hd_alloc_node *n, const hd_alloc_info *i) {
  STORE(&n->thread_key, i->thread_key);
  STORE(&n->stack_key, i->stack_key);
  STORE(&n->flags, i->flags);
  STORE(&n->size, i->size);
  STORE(&n->timestamp, i->timestamp);
}

static void node_write(hd_alloc_node *n, const hd_alloc_info *i) {
  node_write_payload(n, i);
  STORE(&n->address, i->address);
}

static void node_read(const hd_alloc_node *n, hd_alloc_info *i) {
  i->thread_key = LOAD(&n->thread_key);
  i->stack_key = LOAD(&n->stack_key);
  i->flags = LOAD(&n->flags);
  i->address = LOAD(&n->address);
  i->size = LOAD(&n->size);
  i->timestamp = LOAD(&n->timestamp);
}

static void lock_slots(hd_alloc_table *t, uint32_t log2) {
  uint64_t n = (uint64_t)1 << log2;
  if (n > HD_SEQ_SLOTS) n = HD_SEQ_SLOTS;
  for (uint64_t s = 0; s < n; s++) slot_lock(t, &t->seq[s]);
}

static void unlock_slots(hd_alloc_table *t, uint32_t log2) {
  uint64_t n = (uint64_t)1 << log2;
  if (n > HD_SEQ_SLOTS) n = HD_SEQ_SLOTS;
  for (uint64_t s = 0; s < n; s++) slot_unlock(t, &t->seq[s]);
}

/* Doubles the bucket array. The chains are rebuilt from the node array, read in index order:
 * a node is linked exactly when its address is non-zero (an insert stores the address only
 * when it links the node, under its slot lock, and an erase clears it when it unlinks), and
 * every slot lock is held here. Following the old chains instead visits the nodes in hash
 * order, a cache and TLB miss per node: a pause of tens of milliseconds for every allocating
 * thread at a million blocks. Free nodes are not touched (their `next` belongs to the free
 * list, which node_alloc pops without a slot lock). */
static void maybe_grow(hd_alloc_table *t) {
  hd_alloc_header *h = t->hdr;
  if (pthread_mutex_trylock(&t->world_lock) != 0) return; /* someone else is at it */
  uint32_t log2 = LOAD(&h->bucket_log2);
  if (log2 >= h->max_bucket_log2 || LOAD(&h->node_high_water) <= ((uint64_t)2 << log2)) {
    pthread_mutex_unlock(&t->world_lock);
    return;
  }
  lock_slots(t, log2 + 1);
  STORE(&h->resize_seq, LOAD(&h->resize_seq) + 1);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  const uint64_t new_n = (uint64_t)2 << log2, mask = new_n - 1;
  /* Emptied with atomic stores like every other shared word: readers may be reading them (and
   * will discard what they read, as resize_seq is odd). */
  for (uint64_t b = 0; b < new_n; b++) STORE(&t->buckets[b], HD_LINK_NONE);
  /* Nodes past this high-water mark were handed out after the locks were taken, so are not
   * linked yet. */
  const uint32_t high_water = LOAD(&h->node_high_water);
  for (uint32_t idx = 0; idx < high_water; idx++) {
    hd_alloc_node *n = &t->nodes[idx];
    uint64_t address = LOAD(&n->address);
    if (address == 0) continue;
    uint32_t *head = &t->buckets[hd_alloc_hash(address) & mask];
    STORE(&n->next, LOAD(head));
    STORE(head, idx + 1);
  }
  STORE(&h->bucket_log2, log2 + 1);
  __atomic_store_n(&h->resize_seq, LOAD(&h->resize_seq) + 1, __ATOMIC_RELEASE);
  unlock_slots(t, log2 + 1);
  pthread_mutex_unlock(&t->world_lock);
}

void hd_alloc_table_note_lost_free(hd_alloc_table *t) {
  __atomic_store_n(&t->lost_frees, 1, __ATOMIC_RELAXED);
}

hd_insert_result hd_alloc_table_insert(hd_alloc_table *t, hd_writer_thread *w,
                                       const hd_alloc_info *info, hd_alloc_info *replaced) {
  uint32_t idx = node_alloc(t, w);
  if (idx == UINT32_MAX) return HD_INSERT_FULL;
  hd_alloc_node *node = &t->nodes[idx];
  /* The node may have been unlinked from another slot a moment ago, with a reader still copying
   * it. That reader must see the slot's sequence change if it sees the new payload: C11 gives
   * that only through a release fence before these stores (the unlock's release store orders
   * the stores before it, not after). On x86 it costs nothing; it stops the compiler only. */
  __atomic_thread_fence(__ATOMIC_RELEASE);
  node_write_payload(node, info); /* not reachable yet; the address is stored when linked */
  uint64_t hash = hd_alloc_hash(info->address);
  uint32_t *seq;
  uint32_t b = lock_bucket(t, hash, &seq);
  uint32_t head = LOAD(&t->buckets[b]);
  /* A live address is recorded once: the allocator cannot hand out an address whose free has
   * not been erased first, unless a free was lost. Only then is the chain worth a walk (each
   * node on it is a likely cache miss in a big table). */
  if (HD_UNLIKELY_T(LOAD(&t->lost_frees))) {
    for (uint32_t link = head; link != HD_LINK_NONE; link = LOAD(&t->nodes[link - 1].next)) {
      hd_alloc_node *n = &t->nodes[link - 1];
      if (LOAD(&n->address) == info->address) {
        if (replaced) node_read(n, replaced);
        node_write(n, info);
        slot_unlock(t, seq);
        node_free(t, w, idx);
        return HD_INSERT_REPLACED;
      }
    }
  }
  STORE(&node->next, head);
  STORE(&node->address, info->address);
  STORE(&t->buckets[b], idx + 1);
  slot_unlock(t, seq);
  /* Live blocks never outnumber the nodes handed out, so the bucket array follows the
   * high-water mark: two loads of rarely written header fields, no shared live count. */
  if (HD_UNLIKELY_T(LOAD(&t->hdr->node_high_water) > ((uint64_t)2 << LOAD(&t->hdr->bucket_log2))))
    maybe_grow(t);
  return HD_INSERT_NEW;
}

bool hd_alloc_table_erase(hd_alloc_table *t, hd_writer_thread *w, uint64_t address,
                          hd_alloc_info *out) {
  uint32_t *seq;
  uint32_t b = lock_bucket(t, hd_alloc_hash(address), &seq);
  uint32_t *prev = &t->buckets[b];
  for (uint32_t link = LOAD(prev); link != HD_LINK_NONE; link = LOAD(prev)) {
    hd_alloc_node *n = &t->nodes[link - 1];
    if (LOAD(&n->address) == address) {
      if (out) node_read(n, out);
      STORE(prev, LOAD(&n->next));
      STORE(&n->address, 0); /* unlinked (see maybe_grow) */
      slot_unlock(t, seq);
      node_free(t, w, link - 1);
      return true;
    }
    prev = &n->next;
  }
  slot_unlock(t, seq);
  return false;
}

bool hd_alloc_table_replace(hd_alloc_table *t, const hd_alloc_info *info, hd_alloc_info *old) {
  uint32_t *seq;
  uint32_t b = lock_bucket(t, hd_alloc_hash(info->address), &seq);
  for (uint32_t link = LOAD(&t->buckets[b]); link != HD_LINK_NONE;
       link = LOAD(&t->nodes[link - 1].next)) {
    hd_alloc_node *n = &t->nodes[link - 1];
    if (LOAD(&n->address) == info->address) {
      if (old) node_read(n, old);
      node_write(n, info);
      slot_unlock(t, seq);
      return true;
    }
  }
  slot_unlock(t, seq);
  return false;
}

void hd_alloc_table_lock_all(hd_alloc_table *t) {
  pthread_mutex_lock(&t->world_lock);
  lock_slots(t, LOAD(&t->hdr->bucket_log2));
}

void hd_alloc_table_unlock_all(hd_alloc_table *t) {
  unlock_slots(t, LOAD(&t->hdr->bucket_log2));
  pthread_mutex_unlock(&t->world_lock);
}

int hd_alloc_table_clone_locked(const hd_alloc_table *src, hd_alloc_table *dst, uint64_t max_bytes,
                                const char *memfd_name) {
  /* Live blocks are at most the nodes ever handed out; the copy is sparse beyond what it uses. */
  uint64_t live = LOAD(&src->hdr->node_high_water);
  if (max_bytes == 0) max_bytes = hd_alloc_table_bytes_for(live);
  int rc = hd_alloc_table_create(dst, max_bytes, memfd_name);
  if (rc != 0) return rc;
  hd_alloc_header *h = dst->hdr;
  uint32_t log2 = HD_MIN_BUCKET_LOG2;
  while (((uint64_t)2 << log2) < live && log2 < h->max_bucket_log2) log2++;
  h->bucket_log2 = log2;
  uint64_t mask = ((uint64_t)1 << log2) - 1;
  uint32_t count = 0;
  uint64_t src_buckets = (uint64_t)1 << LOAD(&src->hdr->bucket_log2);
  for (uint64_t b = 0; b < src_buckets; b++) {
    for (uint32_t link = LOAD(&src->buckets[b]); link != HD_LINK_NONE;
         link = LOAD(&src->nodes[link - 1].next)) {
      if (count >= h->node_capacity) {
        hd_alloc_table_destroy(dst);
        return -ENOSPC;
      }
      hd_alloc_info info;
      node_read(&src->nodes[link - 1], &info);
      hd_alloc_node *n = &dst->nodes[count];
      node_write(n, &info);
      uint64_t nb = hd_alloc_hash(info.address) & mask;
      n->next = dst->buckets[nb];
      dst->buckets[nb] = ++count;
    }
  }
  h->node_high_water = count;
  __atomic_thread_fence(__ATOMIC_RELEASE);
  return 0;
}

void hd_alloc_table_sum_locked(const hd_alloc_table *t, uint64_t *blocks, uint64_t *bytes) {
  *blocks = *bytes = 0;
  uint64_t n = (uint64_t)1 << LOAD(&t->hdr->bucket_log2);
  for (uint64_t b = 0; b < n; b++) {
    for (uint32_t link = LOAD(&t->buckets[b]); link != HD_LINK_NONE;
         link = LOAD(&t->nodes[link - 1].next)) {
      ++*blocks;
      *bytes += LOAD(&t->nodes[link - 1].size);
    }
  }
}

int hd_alloc_table_freeze(hd_alloc_table *t) {
  t->hdr->flags |= HD_ALLOC_FLAG_SNAPSHOT;
  munmap(t->hdr, t->size);
  t->hdr = NULL;
  if (!hd_owned_fd_valid(&t->memfd)) return -EBADF; /* the program closed it meanwhile */
  if (fcntl(t->memfd.fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SEAL) != 0) return -errno;
  return 0;
}

/* ------------------------------------------------------------------ resources table */

/* Private dedup index of stack records: open addressing, slot = (hash >> 32) << 32 | key, 0 =
 * empty; at most half full. Written under the table lock with release stores, probed lock-free
 * with acquire loads. It starts small and doubles (a program with few traces should not pay for
 * the index a huge one needs). A lock-free reader may still be probing an older index: those
 * stay mapped until the table is destroyed (together no bigger than the current one); a miss
 * there only sends the reader to the locked path, which uses the current index. */
typedef struct hd_dedup_index {
  struct hd_dedup_index *older;
  uint64_t mask;
  uint64_t bytes;
  uint64_t slots[];
} hd_dedup_index;

#define DEDUP_INITIAL_SLOTS (64u << 10)

static hd_dedup_index *dedup_new(uint64_t slots) {
  uint64_t bytes = ALIGN_UP(sizeof(hd_dedup_index) + slots * sizeof(uint64_t), PAGE);
  void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
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

static int res_create(hd_res_table *t, uint64_t max_bytes, const char *memfd_name, bool index) {
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
  void *m;
  int rc = make_memfd(memfd_name, max_bytes, &m, &t->memfd);
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
  h->start_time_ns = now_ns();
  __atomic_store_n(&h->used, h->records_offset, __ATOMIC_RELEASE);
  pthread_mutex_init(&t->lock, NULL);
  return 0;
}

int hd_res_table_create(hd_res_table *t, uint64_t max_bytes, const char *memfd_name) {
  return res_create(t, max_bytes, memfd_name, true);
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
  memcpy(dst->base, src->base, used);
  dst->hdr->pid = (uint32_t)getpid();
  dst->live_bytes = LOAD(&src->live_bytes);
  dst->dedup_count = src->dedup_count;
  dst->counters_pool = src->counters_pool;
  return 0;
}

void hd_res_table_adopt_index(hd_res_table *dst, hd_res_table *src) {
  dst->dedup = src->dedup;
  dst->dedup_max_slots = src->dedup_max_slots;
  src->dedup = NULL;
}

static uint64_t hash_bytes(const uint8_t *p, size_t n, unsigned count) {
  uint64_t h = 0x243F6A8885A308D3u ^ (n * 0x9E3779B97F4A7C15u) ^ count;
  while (n >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    h = (h ^ w) * 0xff51afd7ed558ccdu;
    h ^= h >> 32;
    p += 8;
    n -= 8;
  }
  uint64_t w = 0;
  memcpy(&w, p, n);
  h = (h ^ w) * 0xc4ceb9fe1a85ec53u;
  return h ^ (h >> 29);
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

/* Under the lock: doubles the index; false when it is at its maximum or memory is short. */
static bool dedup_grow(hd_res_table *t) {
  hd_dedup_index *old = t->dedup;
  uint64_t slots = (old->mask + 1) * 2;
  if (slots > t->dedup_max_slots) return false;
  hd_dedup_index *d = dedup_new(slots);
  if (!d) return false;
  for (uint64_t i = 0; i <= old->mask; i++) {
    uint64_t e = old->slots[i];
    if (e == 0) continue;
    /* The slot keeps only the hash's high half: the position comes from the record. */
    const hd_rec_stack *r = (const hd_rec_stack *)(t->base + (uint32_t)e);
    uint64_t j = hash_bytes((const uint8_t *)(r + 1), r->encoded_len,
                            hd_trace_seed(r->frame_count, r->flags)) & d->mask;
    while (d->slots[j] != 0) j = (j + 1) & d->mask;
    d->slots[j] = e;
  }
  d->older = old;
  __atomic_store_n(&t->dedup, d, __ATOMIC_RELEASE);
  return true;
}

static bool stack_equal(const hd_res_table *t, uint32_t key, const uint8_t *enc, size_t len,
                        unsigned count, unsigned flags) {
  const hd_rec_stack *r = (const hd_rec_stack *)(t->base + key);
  return r->frame_count == count && r->flags == flags && r->encoded_len == len &&
         memcmp((const uint8_t *)(r + 1), enc, len) == 0;
}

static uint32_t intern_stack(hd_res_table *t, const uint64_t *frames, unsigned count,
                             unsigned flags, bool may_wait) {
  uint8_t enc[HD_MAX_FRAMES * HD_STACK_CODEC_MAX_FRAME_BYTES];
  if (count > HD_MAX_FRAMES) count = HD_MAX_FRAMES;
  size_t len = hd_stack_encode(frames, count, enc);
  uint64_t h = hash_bytes(enc, len, hd_trace_seed(count, flags));
  uint32_t tag = (uint32_t)(h >> 32);
  /* Lock-free lookup: entries are published with release stores after their records. */
  const hd_dedup_index *d = __atomic_load_n(&t->dedup, __ATOMIC_ACQUIRE);
  for (uint64_t i = h & d->mask;; i = (i + 1) & d->mask) {
    uint64_t e = __atomic_load_n(&d->slots[i], __ATOMIC_ACQUIRE);
    if (e == 0) break;
    if ((uint32_t)(e >> 32) == tag && stack_equal(t, (uint32_t)e, enc, len, count, flags))
      return (uint32_t)e;
  }
  if (!may_wait) {
    if (pthread_mutex_trylock(&t->lock) != 0) {
      __atomic_fetch_add(&t->hdr->stats.dropped_stack_traces, 1, __ATOMIC_RELAXED);
      return 0;
    }
  } else {
    pthread_mutex_lock(&t->lock);
  }
  hd_dedup_index *idx = t->dedup;
  uint64_t i = h & idx->mask;
  for (;; i = (i + 1) & idx->mask) {
    uint64_t e = LOAD(&idx->slots[i]);
    if (e == 0) break;
    if ((uint32_t)(e >> 32) == tag && stack_equal(t, (uint32_t)e, enc, len, count, flags)) {
      pthread_mutex_unlock(&t->lock);
      return (uint32_t)e;
    }
  }
  if ((t->dedup_count + 1) * 2 > idx->mask + 1) {
    if (!dedup_grow(t)) {
      pthread_mutex_unlock(&t->lock);
      __atomic_fetch_add(&t->hdr->stats.dropped_stack_traces, 1, __ATOMIC_RELAXED);
      return 0;
    }
    idx = t->dedup;
    for (i = h & idx->mask; idx->slots[i] != 0; i = (i + 1) & idx->mask) {
    }
  }
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
  __atomic_store_n(&idx->slots[i], ((uint64_t)tag << 32) | off, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&t->lock);
  return off;
}

uint32_t hd_res_intern_stack(hd_res_table *t, const uint64_t *frames, unsigned count,
                             unsigned flags) {
  return intern_stack(t, frames, count, flags, true);
}

uint32_t hd_res_intern_stack_nowait(hd_res_table *t, const uint64_t *frames, unsigned count,
                                    unsigned flags) {
  return intern_stack(t, frames, count, flags, false);
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

/* Moves the process's live bytes by delta and raises the peak. A thread holds back its share
 * while the total cannot be at a new peak because of it (so a single thread's peak is exact;
 * with several, each holds back less than HD_LIVE_DELTA_FLUSH). */
static void add_live(hd_res_table *t, hd_writer_thread *w, int64_t delta) {
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
  while ((uint64_t)live > peak && !__atomic_compare_exchange_n(&s->peak_live_bytes, &peak,
                                                               (uint64_t)live, true,
                                                               __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

void hd_res_count_alloc(hd_res_table *t, hd_writer_thread *w, uint32_t stack_key, uint64_t size) {
  if (stack_key != 0) {
    hd_rec_stack *r = (hd_rec_stack *)(t->base + stack_key);
    __atomic_fetch_add(&r->alloc_blocks, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r->alloc_bytes, size, __ATOMIC_RELAXED);
  }
  hd_rec_counters *c = own_counters(t, w);
  if (c) {
    counter_add(&c->blocks_allocated, 1);
    counter_add(&c->bytes_allocated, size);
  } else {
    __atomic_fetch_add(&t->hdr->stats.blocks_allocated, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&t->hdr->stats.bytes_allocated, size, __ATOMIC_RELAXED);
  }
  add_live(t, w, (int64_t)size);
}

void hd_res_count_free(hd_res_table *t, hd_writer_thread *w, uint64_t size) {
  hd_rec_counters *c = own_counters(t, w);
  if (c) {
    counter_add(&c->blocks_freed, 1);
    counter_add(&c->bytes_freed, size);
  } else {
    __atomic_fetch_add(&t->hdr->stats.blocks_freed, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&t->hdr->stats.bytes_freed, size, __ATOMIC_RELAXED);
  }
  add_live(t, w, -(int64_t)size);
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
  if (w->node_count != 0) cache_spill(a, w, w->node_count);
  if (w->counters_key != 0) {
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

void hd_res_count_drop(hd_res_table *t, size_t field_offset_in_stats) {
  uint64_t *f = (uint64_t *)((uint8_t *)&t->hdr->stats + field_offset_in_stats);
  __atomic_fetch_add(f, 1, __ATOMIC_RELAXED);
}
