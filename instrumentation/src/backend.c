/* Where the real memory comes from: jemalloc's non-standard API (default; sized frees, size
 * classes computed without a lookup) or glibc's __libc_* entry points
 * (HEAPDUMP_ALLOCATOR=system). Every entry marks the
 * thread as inside the allocator, so that a signal handler interrupting it is not let back in. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "runtime.h"

/* jemalloc's non-standard API, from the jemalloc linked into this library, whose public names
 * are renamed hd_je_* (private_jemalloc.py) so that nothing of it is the program's: the names
 * mallocx, sdallocx... are libheapdump.so's own exports, for programs that call them. */
void *hd_je_mallocx(size_t size, int flags);
void *hd_je_malloc(size_t size);
void *hd_je_calloc(size_t n, size_t size);
size_t hd_je_xallocx(void *ptr, size_t size, size_t extra, int flags);
void hd_je_dallocx(void *ptr, int flags);
void hd_je_sdallocx(void *ptr, size_t size, int flags);
size_t hd_je_sallocx(const void *ptr, int flags);
size_t hd_je_nallocx(size_t size, int flags);
void *hd_je_rallocx(void *ptr, size_t size, int flags);

void *__libc_memalign(size_t align, size_t size); /* the others: runtime.h */

/* glibc's own malloc_usable_size, not ours nor jemalloc's (both come before it in the lookup
 * order): asked for by glibc's base symbol version on x86-64. Looked up at init so that no later
 * call (possibly from a signal handler) runs the dynamic linker. */
#if !defined(__x86_64__)
#error "heapdump runs on x86-64 only (contract/include/heapdump/contract/shm_layout.h)"
#endif
#define HD_GLIBC_BASE_VERSION "GLIBC_2.2.5"

/* A glibc chunk's size word, just before the block: the chunk's size, header and padding
 * included, in all but its low three bits (flags; 2 = mapped by itself). */
static size_t chunk_size_word(const void *p) { return ((const size_t *)p)[-1]; }
#define HD_CHUNK_MMAPPED ((size_t)2)
#define HD_CHUNK_FLAGS ((size_t)7)

/* What glibc's malloc_usable_size answers (its musable()), from the chunk's size word: for the
 * blocks the lookup below may allocate itself, before it has an answer, or if it finds none. */
static size_t usable_from_chunk_header(void *p) {
  const size_t size_word = chunk_size_word(p);
  const size_t chunk = size_word & ~HD_CHUNK_FLAGS;
  return (size_word & HD_CHUNK_MMAPPED) ? chunk - 2 * sizeof(size_t) : chunk - sizeof(size_t);
}
static size_t (*g_libc_usable)(void *) = usable_from_chunk_header;

int hd_use_system;

/* ---- jemalloc's memory, known exactly to a leak check ----
 *
 * A leak check takes the process's writable memory as roots, except the allocator's (which
 * holds the blocks, free or not, and jemalloc's metadata pointing at them). jemalloc maps its
 * memory through the functions below: private_jemalloc.py renames its imports of mmap and munmap
 * to them, and of sbrk to one that always fails (jemalloc then never extends the program break,
 * which stays the program's). Each range jemalloc maps or unmaps is recorded in the resources
 * table (HD_MAPPING_ALLOCATOR). jemalloc maps rarely (it keeps what it mapped and grows its
 * reserve geometrically), so this costs the allocation path one load.
 *
 * Code inside jemalloc may hold jemalloc's locks, which a forking thread takes after the
 * resources lock (the fork handlers): it must not wait for the resources lock, nor for anything
 * a waiter for it holds. So it only puts the change in `g_ring`, a bounded queue of many
 * producers (a sequence number per slot tells whose turn it is: free for the producer of index
 * i when it is i, ready for the consumer when it is i + 1), and the changes are written into the
 * table by hd_backend_publish_mappings, from where no lock is held: the next allocation's hook,
 * the drain of a signal handler's work, a snapshot copy, the fork handler, the end of init. An
 * unmapping is queued before its system call, so that a later mapping of the same range, by
 * any thread, comes after it in the queue. */
#define RING_SLOTS 64u
static struct ring_slot {
  /* Atomic: the sequence number less the slot's own index, so that the zeroed slots are free for
   * the first lap before any constructor runs (jemalloc may map from another library's). */
  uint64_t seq;
  uint64_t start, size;
  bool mapped;
} g_ring[RING_SLOTS];
static uint64_t g_ring_enqueue;       /* atomic: the next index a producer takes */
static uint64_t g_ring_dequeue;       /* the next index to publish, under g_publish_lock */
static uint64_t g_ring_lost;          /* atomic: changes the full queue could not take */
uint32_t hd_backend_mappings_waiting; /* atomic: a change is queued */
static pthread_mutex_t g_publish_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t slot_seq(uint64_t index) {
  return __atomic_load_n(&g_ring[index % RING_SLOTS].seq, __ATOMIC_ACQUIRE) + index % RING_SLOTS;
}

static void set_slot_seq(uint64_t index, uint64_t seq) {
  __atomic_store_n(&g_ring[index % RING_SLOTS].seq, seq - index % RING_SLOTS, __ATOMIC_RELEASE);
}

static void queue_mapping(void *start, size_t size, bool mapped) {
  uint64_t pos = __atomic_load_n(&g_ring_enqueue, __ATOMIC_RELAXED);
  struct ring_slot *slot;
  for (;;) {
    slot = &g_ring[pos % RING_SLOTS];
    const uint64_t seq = slot_seq(pos);
    if (seq == pos) {
      if (__atomic_compare_exchange_n(&g_ring_enqueue, &pos, pos + 1, true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
        break;
      }
    } else if ((int64_t)(seq - pos) < 0) { /* a lap behind: full */
      __atomic_fetch_add(&g_ring_lost, 1, __ATOMIC_RELAXED);
      __atomic_store_n(&hd_backend_mappings_waiting, 1, __ATOMIC_RELEASE);
      return;
    } else {
      pos = __atomic_load_n(&g_ring_enqueue, __ATOMIC_RELAXED);
    }
  }
  slot->start = (uint64_t)(uintptr_t)start;
  slot->size = size;
  slot->mapped = mapped;
  set_slot_seq(pos, pos + 1);
  __atomic_store_n(&hd_backend_mappings_waiting, 1, __ATOMIC_RELEASE);
}

void *hd_je_mmap(void *addr, size_t size, int prot, int flags, int fd, off_t offset);
void *hd_je_mmap(void *addr, size_t size, int prot, int flags, int fd, off_t offset) {
  void *p = mmap(addr, size, prot, flags, fd, offset);
  if (p != MAP_FAILED) queue_mapping(p, size, true);
  return p;
}

int hd_je_munmap(void *addr, size_t size);
int hd_je_munmap(void *addr, size_t size) {
  queue_mapping(addr, size, false);
  const int rc = munmap(addr, size);
  if (rc != 0) queue_mapping(addr, size, true); /* it stays jemalloc's */
  return rc;
}

void *hd_je_sbrk(intptr_t increment);
void *hd_je_sbrk(intptr_t increment) {
  (void)increment;
  errno = ENOMEM;
  return (void *)-1;
}

void hd_backend_publish_mappings(void) {
  if (!hd_tables_made()) return;
  hd_res_table *t = &hd_live_res;
  pthread_mutex_lock(&g_publish_lock);
  __atomic_store_n(&hd_backend_mappings_waiting, 0, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_SEQ_CST); /* a change queued from now on sets it again */
  pthread_mutex_lock(&t->lock);
  for (;;) {
    const struct ring_slot *slot = &g_ring[g_ring_dequeue % RING_SLOTS];
    if (slot_seq(g_ring_dequeue) != g_ring_dequeue + 1) break;
    (void)hd_res_add_mapping_locked(t, HD_MAPPING_ALLOCATOR, slot->mapped, slot->start, slot->size);
    set_slot_seq(g_ring_dequeue, g_ring_dequeue + RING_SLOTS);
    g_ring_dequeue++;
  }
  const uint64_t lost = __atomic_exchange_n(&g_ring_lost, 0, __ATOMIC_RELAXED);
  __atomic_fetch_add(&t->hdr->mapping_records_lost, lost, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&t->lock);
  pthread_mutex_unlock(&g_publish_lock);
}

void hd_backend_after_fork_child(void) {
  /* Only the forking thread exists here; it published every change before the fork. A slot
   * another thread had taken but not filled will never be: the queue starts afresh. */
  pthread_mutex_init(&g_publish_lock, NULL);
  const uint64_t pos = __atomic_load_n(&g_ring_enqueue, __ATOMIC_RELAXED);
  for (uint64_t i = 0; i < RING_SLOTS; i++) set_slot_seq(pos + i, pos + i);
  g_ring_dequeue = pos;
}

/* glibc guarantees alignof(max_align_t) == 16 for every block; jemalloc's 8-byte size class
 * is only 8-aligned, so smaller requests take its 16-byte class (sized frees round alike). */
/* What the backend is asked for: the program's size and the block's tag (record.c), which sits
 * at the end of the usable size. SIZE_MAX, which no allocator grants, if that overflows. */
static inline size_t tagged(size_t size) {
  size_t bytes;
  return __builtin_add_overflow(size, HD_TAG_BYTES, &bytes) ? SIZE_MAX : bytes;
}

static inline size_t jemalloc_size(size_t size) { return size < 16 ? 16 : size; }

/* glibc serves a request of 32 MiB or more (its largest mmap threshold) with a plain mmap, so
 * the kernel's overcommit policy decides it: in the default heuristic mode a request beyond RAM
 * plus swap fails with ENOMEM. jemalloc maps with MAP_NORESERVE when the kernel overcommits,
 * which that policy never refuses: malloc(64 TiB) would succeed, and a program relying on the
 * failure (Python's MemoryError for bytearray(10**12)) would run the machine out of memory
 * instead. So the jemalloc backend puts such a request to the kernel as glibc would, with a
 * mapping released at once (two syscalls, beside the page faults a block that big costs). */
static const size_t kGlibcMmapThresholdMax = (size_t)32 << 20;

__attribute__((noinline, cold)) static bool kernel_grants(size_t bytes) {
  if (bytes > PTRDIFF_MAX) return false;
  void *probe = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (probe == MAP_FAILED) return false;
  munmap(probe, bytes);
  return true;
}

static inline bool granted_as_by_glibc(size_t size, size_t align) {
  size_t bytes;
  if (__builtin_add_overflow(size, align, &bytes)) return false;
  return HD_LIKELY(bytes < kGlibcMmapThresholdMax) || kernel_grants(bytes);
}

/* jemalloc's size class of each small request (alignment 0), as nallocx answers it, by
 * request size in steps of 8: read at init, so that an allocation learns its block's usable size
 * (where its tag goes) from a table rather than from nallocx's computation on every call. */
#define SMALL_CLASS_MAX 4096
static uint16_t g_small_class[SMALL_CLASS_MAX / 8 + 1];

static void read_small_classes(void) {
  for (size_t i = 0; i <= SMALL_CLASS_MAX / 8; i++) {
    const size_t cls = hd_je_nallocx(i == 0 ? 16 : i * 8, 0);
    /* A class the table cannot hold leaves the whole table unused (nallocx answers instead). */
    if (cls == 0 || cls > UINT16_MAX || cls < i * 8) {
      g_small_class[0] = 0;
      return;
    }
    g_small_class[i] = (uint16_t)cls;
  }
}

/* The usable size of a block mallocx gave for `size` (at least 16) with no alignment. */
static inline size_t jemalloc_class(size_t size) {
  if (HD_LIKELY(size <= SMALL_CLASS_MAX && g_small_class[0] != 0))
    return g_small_class[(size + 7) / 8];
  return hd_je_nallocx(size, 0);
}

void hd_backend_init(bool want_system) {
  /* Marked as inside the allocator, so that whatever the lookup would allocate (glibc's dl
   * functions only do to report an error) fails. */
  hd_backend_enter();
  size_t (*libc_usable)(void *) =
      (size_t(*)(void *))dlvsym(RTLD_NEXT, "malloc_usable_size", HD_GLIBC_BASE_VERSION);
  hd_backend_leave();
  if (libc_usable != NULL) g_libc_usable = libc_usable;
  hd_use_system = want_system;
  if (!want_system) {
    /* Its first call also sets jemalloc up (its constructor is taken out of the archive:
     * private_jemalloc.py), which registers jemalloc's fork handlers before lifecycle.c
     * registers the library's: at a fork the library's prepare, which takes the resources
     * lock, then runs before jemalloc's takes jemalloc's locks (the order at the top). */
    hd_backend_enter();
    read_small_classes();
    hd_backend_leave();
  }
}

void *hd_backend_alloc(size_t size, unsigned lg_align, bool zero, size_t *usable) {
  void *p = NULL;
  size = tagged(size);
  hd_backend_enter();
  if (!hd_use_system) {
    if (granted_as_by_glibc(size, lg_align ? (size_t)1 << lg_align : 0)) {
      /* Unaligned requests take jemalloc's malloc and calloc, whose fast paths mallocx lacks. */
      if (lg_align == 0)
        p = zero ? hd_je_calloc(1, jemalloc_size(size)) : hd_je_malloc(jemalloc_size(size));
      else
        p = hd_je_mallocx(jemalloc_size(size), (int)lg_align | (zero ? HD_MALLOCX_ZERO : 0));
      /* The size class, computed: what sallocx would answer after a lookup of the block. */
      if (p) {
        *usable = lg_align == 0 ? jemalloc_class(jemalloc_size(size))
                                : hd_je_nallocx(jemalloc_size(size), (int)lg_align);
      }
    }
  } else {
    if (lg_align == 0) {
      p = zero ? __libc_calloc(1, size) : __libc_malloc(size);
    } else {
      p = __libc_memalign((size_t)1 << lg_align, size);
      if (p && zero) memset(p, 0, size);
    }
    if (p) *usable = g_libc_usable(p); /* the chunk's header, in the line just written */
  }
  hd_backend_leave();
  return p;
}

void hd_backend_free(void *p, size_t size_hint, unsigned lg_align) {
  hd_backend_enter();
  if (hd_use_system)
    __libc_free(p);
  else if (size_hint && lg_align == 0)
    hd_je_sdallocx(p, jemalloc_size(tagged(size_hint)), 0);
  else
    hd_je_dallocx(p, 0);
  hd_backend_leave();
}

void *hd_backend_realloc(void *p, size_t size) {
  size = tagged(size);
  hd_backend_enter();
  void *q = hd_use_system                  ? __libc_realloc(p, size)
            : granted_as_by_glibc(size, 0) ? hd_je_rallocx(p, jemalloc_size(size), 0)
                                           : NULL;
  hd_backend_leave();
  return q;
}

size_t hd_backend_usable(void *p) {
  hd_backend_enter();
  size_t n = !hd_use_system ? hd_je_sallocx(p, 0) : g_libc_usable(p);
  hd_backend_leave();
  return n;
}

/* In-place resize for the jemalloc backend: done only if p then has exactly the size class of
 * size (so a later sized free with `size` is valid). */
size_t hd_backend_resize_in_place(void *p, size_t size) {
  size = tagged(size);
  hd_backend_enter();
  size_t cls = hd_je_nallocx(jemalloc_size(size), 0);
  bool ok = cls != 0 && hd_je_xallocx(p, jemalloc_size(size), 0, 0) == cls;
  hd_backend_leave();
  return ok ? cls : 0;
}

size_t hd_backend_size_class(size_t size, unsigned lg_align) {
  if (hd_use_system) return size; /* glibc cannot say before it allocates */
  size = tagged(size);
  hd_backend_enter();
  const size_t cls = hd_je_nallocx(jemalloc_size(size), (int)lg_align);
  hd_backend_leave();
  return cls > HD_TAG_BYTES ? cls - HD_TAG_BYTES : 0;
}

bool hd_backend_grants(size_t size) {
  if (hd_use_system) return true; /* glibc decides in its realloc */
  size = tagged(size);
  hd_backend_enter();
  bool ok = hd_je_nallocx(jemalloc_size(size), 0) != 0 && granted_as_by_glibc(size, 0);
  hd_backend_leave();
  return ok;
}

/* ---- glibc's calls for blocks without a tag, as if the library were not there: a dormant
 * library's aligned calls and those made while it is being armed or has a request to act on,
 * and sampling's on glibc from inside a hook. The thread is marked as inside the allocator, so
 * that a signal handler that interrupts one neither arms the library nor enters glibc again. */

void *hd_backend_alloc_untagged(size_t size, unsigned lg_align, bool zero) {
  hd_backend_enter();
  void *p = lg_align != 0 ? __libc_memalign((size_t)1 << lg_align, size)
            : zero        ? __libc_calloc(1, size)
                          : __libc_malloc(size);
  if (p && zero && lg_align != 0) memset(p, 0, size);
  hd_backend_leave();
  return p;
}

void *hd_backend_realloc_untagged(void *p, size_t size) {
  hd_backend_enter();
  void *q = __libc_realloc(p, size);
  hd_backend_leave();
  return q;
}

size_t hd_backend_usable_untagged(void *p) { return g_libc_usable(p); }

/* What glibc's statistics (mallinfo2: uordblks + hblkhd) count for a block of the system
 * backend: its chunk, header and padding included. */
size_t hd_backend_footprint(void *p) { return chunk_size_word(p) & ~HD_CHUNK_FLAGS; }
