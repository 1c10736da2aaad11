/* Writer side of the allocations table: the slot-seqlock hash table of live blocks
 * (heapdump/contract/shm_layout.h). */
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
#include "table_memory.h"

static const uint64_t kSeqOffset = PAGE;
static const uint64_t kSeqBytes = HD_SEQ_SLOTS * sizeof(uint32_t);

/* Geometry for a table of `total` bytes: the largest node count whose worst-case bucket array
 * (a bucket per node handed out, at most) still fits. */
static void geometry(uint64_t total, uint32_t *bucket_log2, uint32_t *capacity) {
  uint64_t fixed = kSeqOffset + kSeqBytes;
  uint64_t cap = total > fixed ? (total - fixed) / sizeof(hd_alloc_node) : 0;
  uint32_t log2 = HD_MIN_BUCKET_LOG2;
  for (int iter = 0; iter < 4; iter++) {
    log2 = HD_MIN_BUCKET_LOG2;
    while (((uint64_t)1 << log2) < cap && log2 < 31) log2++;
    uint64_t bucket_bytes = ALIGN_UP(((uint64_t)4 << log2), PAGE);
    cap = total > fixed + bucket_bytes ? (total - fixed - bucket_bytes) / sizeof(hd_alloc_node) : 0;
  }
  if (cap > UINT32_MAX - 1) cap = UINT32_MAX - 1;
  *bucket_log2 = log2;
  *capacity = (uint32_t)cap;
}

uint64_t hd_alloc_table_bytes_for(uint64_t nodes) {
  uint32_t log2 = HD_MIN_BUCKET_LOG2;
  while (((uint64_t)1 << log2) < nodes && log2 < 31) log2++;
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
  void *m = NULL;
  int rc = hd_table_memfd(memfd_name, max_bytes, &m, &t->memfd);
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

void hd_alloc_table_precommit(hd_alloc_table *t) {
  hd_precommit_area_init(&t->nodes_area, t->nodes,
                         (uint64_t)t->hdr->node_capacity * sizeof(hd_alloc_node));
  hd_precommit_area_init(&t->buckets_area, t->buckets, (uint64_t)4 << t->hdr->max_bucket_log2);
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
  hd_precommit_need(&t->nodes_area, (uint64_t)(hw + got) * sizeof(hd_alloc_node));
  /* The next doubling writes a bucket array twice the size: its pages are asked for when the
   * nodes reach seven eighths of the count that triggers it (maybe_grow), late enough that
   * few heaps stop growing in between, early enough for the helper to be done before. */
  uint32_t log2 = LOAD(&t->hdr->bucket_log2);
  if ((uint64_t)(hw + got) * 8 > (uint64_t)7 << log2) {
    uint64_t next_bytes = (uint64_t)8 << log2;
    /* need() asks for HD_PRECOMMIT_AHEAD past the end it is given: this asks for the array. */
    if (next_bytes > HD_PRECOMMIT_AHEAD) hd_precommit_need(&t->buckets_area, next_bytes - HD_PRECOMMIT_AHEAD);
  }
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
void hd_alloc_cache_spill(hd_alloc_table *t, hd_writer_thread *w, uint32_t n) {
  for (uint32_t i = 0; i + 1 < n; i++) STORE(&t->nodes[w->nodes[i]].next, w->nodes[i + 1] + 1);
  free_list_push(t, w->nodes[0], w->nodes[n - 1]);
  memmove(w->nodes, w->nodes + n, (w->node_count - n) * sizeof(w->nodes[0]));
  w->node_count -= n;
}

static void node_free(hd_alloc_table *t, hd_writer_thread *w, uint32_t idx) {
  if (w && !w->retired) {
    if (w->node_count == HD_THREAD_NODE_CACHE) hd_alloc_cache_spill(t, w, HD_THREAD_NODE_CACHE / 2);
    w->nodes[w->node_count++] = idx;
    return;
  }
  free_list_push(t, idx, idx);
}

/* Everything but the address word, which is what marks a node as linked (see maybe_grow). */
static void node_write_payload(const hd_alloc_table *t, hd_alloc_node *n, const hd_alloc_info *i) {
  STORE(&n->thread_key, i->thread_key);
  STORE(&n->stack_key, i->stack_key);
  STORE(&n->size_low, (uint32_t)i->size);
  STORE(&n->time_word, hd_node_time_word(i->timestamp, t->hdr->time_base, i->flags));
}

static void node_write(const hd_alloc_table *t, hd_alloc_node *n, const hd_alloc_info *i) {
  node_write_payload(t, n, i);
  STORE(&n->address_word, hd_node_address_word(i->address, i->size));
}

static void node_read(const hd_alloc_table *t, const hd_alloc_node *n, hd_alloc_info *i) {
  const uint64_t address_word = LOAD(&n->address_word), time_word = LOAD(&n->time_word);
  i->thread_key = LOAD(&n->thread_key);
  i->stack_key = LOAD(&n->stack_key);
  i->flags = hd_node_align_log2(time_word);
  i->address = hd_node_address(address_word);
  i->size = hd_node_size(LOAD(&n->size_low), address_word);
  i->timestamp = hd_node_timestamp(time_word, t->hdr->time_base);
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
 * a node is linked exactly when its address word is non-zero (an insert stores it only when it
 * links the node, under its slot lock, and an erase clears it when it unlinks), and
 * every slot lock is held here. Following the old chains instead visits the nodes in hash
 * order, a cache and TLB miss per node: a pause of tens of milliseconds for every allocating
 * thread at a million blocks. Free nodes are not touched (their `next` belongs to the free
 * list, which node_alloc pops without a slot lock). */
static void maybe_grow(hd_alloc_table *t) {
  hd_alloc_header *h = t->hdr;
  if (pthread_mutex_trylock(&t->world_lock) != 0) return; /* someone else is at it */
  uint32_t log2 = LOAD(&h->bucket_log2);
  if (log2 >= h->max_bucket_log2 || LOAD(&h->node_high_water) <= ((uint64_t)1 << log2)) {
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
    uint64_t address_word = LOAD(&n->address_word);
    if (address_word == 0) continue;
    uint32_t *head = &t->buckets[hd_alloc_hash(hd_node_address(address_word)) & mask];
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
  if (HD_UNLIKELY_T(!hd_node_representable(info->address, info->size))) return HD_INSERT_UNREPRESENTABLE;
  uint32_t idx = node_alloc(t, w);
  if (idx == UINT32_MAX) return HD_INSERT_FULL;
  hd_alloc_node *node = &t->nodes[idx];
  /* The node may have been unlinked from another slot a moment ago, with a reader still copying
   * it. That reader must see the slot's sequence change if it sees the new payload: C11 gives
   * that only through a release fence before these stores (the unlock's release store orders
   * the stores before it, not after). On x86 it costs nothing; it stops the compiler only. */
  __atomic_thread_fence(__ATOMIC_RELEASE);
  node_write_payload(t, node, info); /* not reachable yet; the address is stored when linked */
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
      if (hd_node_address(LOAD(&n->address_word)) == info->address) {
        if (replaced) node_read(t, n, replaced);
        node_write(t, n, info);
        slot_unlock(t, seq);
        node_free(t, w, idx);
        return HD_INSERT_REPLACED;
      }
    }
  }
  STORE(&node->next, head);
  STORE(&node->address_word, hd_node_address_word(info->address, info->size));
  STORE(&t->buckets[b], idx + 1);
  slot_unlock(t, seq);
  /* Live blocks never outnumber the nodes handed out, so the bucket array follows the
   * high-water mark: two loads of rarely written header fields, no shared live count. */
  if (HD_UNLIKELY_T(LOAD(&t->hdr->node_high_water) > ((uint64_t)1 << LOAD(&t->hdr->bucket_log2))))
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
    if (hd_node_address(LOAD(&n->address_word)) == address) {
      if (out) node_read(t, n, out);
      STORE(prev, LOAD(&n->next));
      STORE(&n->address_word, 0); /* unlinked (see maybe_grow) */
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
  if (!hd_node_representable(info->address, info->size)) return false;
  uint32_t *seq;
  uint32_t b = lock_bucket(t, hd_alloc_hash(info->address), &seq);
  for (uint32_t link = LOAD(&t->buckets[b]); link != HD_LINK_NONE;
       link = LOAD(&t->nodes[link - 1].next)) {
    hd_alloc_node *n = &t->nodes[link - 1];
    if (hd_node_address(LOAD(&n->address_word)) == info->address) {
      if (old) node_read(t, n, old);
      node_write(t, n, info);
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
  h->time_base = src->hdr->time_base;
  uint32_t log2 = HD_MIN_BUCKET_LOG2;
  while (((uint64_t)1 << log2) < live && log2 < h->max_bucket_log2) log2++;
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
      node_read(src, &src->nodes[link - 1], &info);
      hd_alloc_node *n = &dst->nodes[count];
      node_write(dst, n, &info);
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
      const hd_alloc_node *n = &t->nodes[link - 1];
      *bytes += hd_node_size(LOAD(&n->size_low), LOAD(&n->address_word));
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
