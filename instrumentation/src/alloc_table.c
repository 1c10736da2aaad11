/* Writer side of the allocations table: the node array of live blocks, each node under its
 * slot's seqlock (heapdump/contract/shm_layout.h). */
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
#include "heapdump/contract/dcheck.h"
#include "heapdump/contract/stack_codec.h"
#include "table_memory.h"

static const uint64_t kSeqOffset = PAGE;
static const uint64_t kSeqBytes = HD_SEQ_SLOTS * sizeof(uint32_t);

static uint64_t nodes_offset(void) { return ALIGN_UP(kSeqOffset + kSeqBytes, PAGE); }

uint64_t hd_alloc_table_bytes_for(uint64_t nodes) {
  return nodes_offset() + ALIGN_UP((nodes ? nodes : 1) * sizeof(hd_alloc_node), PAGE);
}

int hd_alloc_table_create(hd_alloc_table *t, uint64_t max_bytes, const char *memfd_name) {
  memset(t, 0, sizeof(*t));
  t->memfd = HD_OWNED_FD_NONE;
  uint64_t min = hd_alloc_table_bytes_for(1024);
  if (max_bytes < min) max_bytes = min;
  if (max_bytes > HD_MAX_TABLE_BYTES) max_bytes = HD_MAX_TABLE_BYTES;
  max_bytes = ALIGN_UP(max_bytes, PAGE);
  uint64_t capacity = (max_bytes - nodes_offset()) / sizeof(hd_alloc_node);
  if (capacity > UINT32_MAX - 1) capacity = UINT32_MAX - 1;
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
  h->nodes_per_slot = HD_NODES_PER_SLOT;
  h->node_capacity = (uint32_t)capacity;
  h->seq_offset = kSeqOffset;
  h->nodes_offset = nodes_offset();
  h->pid = (uint32_t)getpid();
  t->seq = (uint32_t *)((uint8_t *)m + h->seq_offset);
  t->nodes = (hd_alloc_node *)((uint8_t *)m + h->nodes_offset);
  t->free_top = HD_NO_NODE_LINK;
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
    if (!(s & 1) &&
        __atomic_compare_exchange_n(seq, &s, s + 1, true, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
      __atomic_thread_fence(__ATOMIC_RELEASE); /* odd value before the data stores */
      return;
    }
    if (attempt < kSlotSpins)
      hd_cpu_relax();
    else if (s & 1)
      slot_sleep(t, seq, s);
  }
}

/* W3: seqlock write end, publishes the data stores. */
static void slot_unlock(hd_alloc_table *t, uint32_t *seq) {
  HD_DCHECK(LOAD(seq) & 1); /* odd: locked, by us */
  __atomic_store_n(seq, LOAD(seq) + 1, __ATOMIC_RELEASE);
  if (HD_UNLIKELY_T(LOAD(&t->slot_sleepers) != 0))
    syscall(SYS_futex, seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static uint32_t *slot_of(const hd_alloc_table *t, uint32_t idx) {
  return &t->seq[hd_node_slot(idx)];
}

/* Nodes taken from the never-used range at once by a thread with a cache: one slot's worth, so
 * that the nodes a thread writes share their slots with no other thread's. */
#define HIGH_WATER_BATCH HD_NODES_PER_SLOT

/* The shared free list's first node, taken; HD_NO_NODE if it is empty. Lock-free (the tag in
 * free_top's high half defeats ABA), so a signal handler may take one too. */
static uint32_t free_list_pop(hd_alloc_table *t) {
  uint64_t top = __atomic_load_n(&t->free_top, __ATOMIC_ACQUIRE);
  while ((uint32_t)top != HD_NO_NODE_LINK) {
    uint32_t idx = (uint32_t)top - 1;
    uint64_t next = LOAD(&t->nodes[idx].next);
    uint64_t desired = (((top >> 32) + 1) << 32) | next;
    if (__atomic_compare_exchange_n(&t->free_top, &top, desired, true, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      return idx;
  }
  return HD_NO_NODE;
}

/* Takes never-used nodes: up to the end of the slot the high-water mark is in if batch (so that
 * a thread's batch shares its slot with no other thread's, even after single nodes were taken),
 * else one. The first, *got of them in all; HD_NO_NODE if none is left. */
static uint32_t high_water_take(hd_alloc_table *t, bool batch, uint32_t *got) {
  uint32_t hw = LOAD(&t->hdr->node_high_water);
  do {
    if (hw >= t->hdr->node_capacity) return HD_NO_NODE;
    const uint32_t want = batch ? HIGH_WATER_BATCH - hw % HIGH_WATER_BATCH : 1;
    *got = t->hdr->node_capacity - hw < want ? t->hdr->node_capacity - hw : want;
  } while (!__atomic_compare_exchange_n(&t->hdr->node_high_water, &hw, hw + *got, true,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED));
  return hw;
}

static uint32_t node_alloc(hd_alloc_table *t, hd_writer_thread *w) {
  if (w && w->node_count) return w->nodes[--w->node_count];
  uint32_t idx = free_list_pop(t), got;
  if (idx != HD_NO_NODE) return idx;
  idx = high_water_take(t, w && !w->retired, &got);
  if (idx == HD_NO_NODE) return idx;
  /* A batch is taken only for a writer whose cache has room for the rest of it: a batch is at
   * most a slot's nodes, and the cache was empty. */
  HD_DCHECK(got == 1 || (w != NULL && w->node_count == 0 && got - 1 <= HD_THREAD_NODE_CACHE));
  for (uint32_t i = got - 1; i > 0; i--) w->nodes[w->node_count++] = idx + i;
  return idx;
}

uint32_t hd_alloc_table_reserve(hd_alloc_table *t) {
  uint32_t idx = free_list_pop(t), got;
  return idx != HD_NO_NODE ? idx : high_water_take(t, false, &got);
}

/* Pushes the list first..last (linked through next) onto the shared free list. */
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

/* W2 of an insert or replace: the payload, then the address word, which is what makes the node
 * live. */
static void node_write(const hd_alloc_table *t, hd_alloc_node *n, const hd_alloc_info *i) {
  STORE(&n->thread_key, i->thread_key);
  STORE(&n->stack_key, i->stack_key);
  STORE(&n->size_low, (uint32_t)i->size);
  STORE(&n->time_word, hd_node_time_word(i->timestamp, t->hdr->time_base, i->flags));
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

static void node_write_locked(hd_alloc_table *t, uint32_t idx, const hd_alloc_info *info) {
  uint32_t *seq = slot_of(t, idx);
  slot_lock(t, seq);
  HD_DCHECK(LOAD(&t->nodes[idx].address_word) == 0); /* a node is written once while free */
  node_write(t, &t->nodes[idx], info);
  slot_unlock(t, seq);
}

hd_insert_result hd_alloc_table_insert(hd_alloc_table *t, hd_writer_thread *w,
                                       const hd_alloc_info *info, uint32_t *index) {
  if (HD_UNLIKELY_T(!hd_node_representable(info->address, info->size)))
    return HD_INSERT_UNREPRESENTABLE;
  uint32_t idx = node_alloc(t, w);
  if (idx == HD_NO_NODE) return HD_INSERT_FULL;
  node_write_locked(t, idx, info);
  *index = idx;
  return HD_INSERT_NEW;
}

bool hd_alloc_table_fill(hd_alloc_table *t, hd_writer_thread *w, uint32_t index,
                         const hd_alloc_info *info) {
  if (!hd_node_representable(info->address, info->size) || info->address == 0) {
    node_free(t, w, index);
    return false;
  }
  node_write_locked(t, index, info);
  return true;
}

void hd_alloc_table_release(hd_alloc_table *t, uint32_t index) { free_list_push(t, index, index); }

bool hd_alloc_table_erase(hd_alloc_table *t, hd_writer_thread *w, uint32_t index, uint64_t address,
                          hd_alloc_info *out) {
  if (index >= LOAD(&t->hdr->node_high_water)) return false;
  hd_alloc_node *n = &t->nodes[index];
  uint32_t *seq = slot_of(t, index);
  slot_lock(t, seq);
  if (hd_node_address(LOAD(&n->address_word)) != address || address == 0) {
    slot_unlock(t, seq);
    return false;
  }
  if (out) node_read(t, n, out);
  STORE(&n->address_word, 0);
  slot_unlock(t, seq);
  node_free(t, w, index);
  return true;
}

bool hd_alloc_table_replace(hd_alloc_table *t, uint32_t index, const hd_alloc_info *info,
                            hd_alloc_info *old) {
  if (!hd_node_representable(info->address, info->size) || info->address == 0 ||
      index >= LOAD(&t->hdr->node_high_water)) {
    return false;
  }
  hd_alloc_node *n = &t->nodes[index];
  uint32_t *seq = slot_of(t, index);
  slot_lock(t, seq);
  if (hd_node_address(LOAD(&n->address_word)) != info->address) {
    slot_unlock(t, seq);
    return false;
  }
  if (old) node_read(t, n, old);
  node_write(t, n, info);
  slot_unlock(t, seq);
  return true;
}

static void lock_slots(hd_alloc_table *t) {
  for (uint32_t s = 0; s < HD_SEQ_SLOTS; s++) slot_lock(t, &t->seq[s]);
}

static void unlock_slots(hd_alloc_table *t) {
  for (uint32_t s = 0; s < HD_SEQ_SLOTS; s++) slot_unlock(t, &t->seq[s]);
}

void hd_alloc_table_lock_all(hd_alloc_table *t) {
  pthread_mutex_lock(&t->world_lock);
  lock_slots(t);
}

void hd_alloc_table_unlock_all(hd_alloc_table *t) {
  unlock_slots(t);
  pthread_mutex_unlock(&t->world_lock);
}

int hd_alloc_table_clone_locked(const hd_alloc_table *src, hd_alloc_table *dst, uint64_t max_bytes,
                                const char *memfd_name) {
  /* Node indices are kept: a process's blocks carry them. */
  const uint32_t high_water = LOAD(&src->hdr->node_high_water);
  if (max_bytes == 0) max_bytes = hd_alloc_table_bytes_for(high_water);
  int rc = hd_alloc_table_create(dst, max_bytes, memfd_name);
  if (rc != 0) return rc;
  hd_alloc_header *h = dst->hdr;
  if (high_water > h->node_capacity) {
    hd_alloc_table_destroy(dst);
    return -ENOSPC;
  }
  h->time_base = src->hdr->time_base;
  h->flags |= src->hdr->flags & HD_ALLOC_FLAG_UNRECORDED_UNTAGGED;
  for (uint32_t idx = 0; idx < high_water; idx++) {
    const hd_alloc_node *s = &src->nodes[idx];
    hd_alloc_node *d = &dst->nodes[idx];
    d->address_word = LOAD(&s->address_word);
    if (d->address_word == 0) continue;
    d->thread_key = LOAD(&s->thread_key);
    d->stack_key = LOAD(&s->stack_key);
    d->size_low = LOAD(&s->size_low);
    d->time_word = LOAD(&s->time_word);
  }
  /* Free nodes go to the copy's shared free list (the threads whose caches held some do not
   * exist in a fork child, and a snapshot copy is never written). */
  for (uint32_t idx = high_water; idx-- > 0;) {
    if (dst->nodes[idx].address_word != 0) continue;
    dst->nodes[idx].next = (uint32_t)dst->free_top;
    dst->free_top = idx + 1;
  }
  h->node_high_water = high_water;
  __atomic_thread_fence(__ATOMIC_RELEASE);
  return 0;
}

void hd_alloc_table_sum_locked(const hd_alloc_table *t, uint64_t sample_bytes, uint64_t *blocks,
                               uint64_t *bytes) {
  *blocks = *bytes = 0;
  const uint32_t high_water = LOAD(&t->hdr->node_high_water);
  for (uint32_t idx = 0; idx < high_water; idx++) {
    const hd_alloc_node *n = &t->nodes[idx];
    const uint64_t address_word = LOAD(&n->address_word);
    if (address_word == 0) continue;
    const uint64_t size = hd_node_size(LOAD(&n->size_low), address_word);
    const uint64_t k = hd_sample_weight(hd_node_address(address_word),
                                        hd_node_timestamp(LOAD(&n->time_word), t->hdr->time_base),
                                        size, sample_bytes);
    *blocks += k;
    *bytes += k * size;
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
