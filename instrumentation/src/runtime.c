/* Recording runtime of libheapdump.so: lazy allocation-free init, configuration from the
 * environment, what gets recorded per allocation/free/realloc, fork handling, snapshot copy
 * and the public API. */
#define _GNU_SOURCE
#include "runtime.h"

#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "heapdump/contract/names.h"
#include "heapdump/heapdump.h"
#include "regions.h"
#include "registration.h"
#include "stack.h"

_Static_assert(HD_NAME_MAX == HEAPDUMP_SNAPSHOT_NAME_MAX, "a named snapshot's name is a protocol name");

__thread hd_thread_state hd_tls __attribute__((tls_model("initial-exec")));
int hd_state;
int hd_use_system;
uint32_t hd_name_generation;

/* Live tables; replaced only in the fork child (single-threaded then). */
static hd_alloc_table g_alloc;
static hd_res_table g_res;
static char g_exe_name[HD_REGION_NAME_MAX];
static int g_follow_children = 1;
/* Its destructor hands a thread's writer state back when the thread exits. */
static pthread_key_t g_thread_exit_key;
static bool g_thread_exit_key_made;

extern char **environ;
extern const ElfW(Ehdr) __ehdr_start; /* this module's ELF header, set by the static linker */

/* ------------------------------------------------------------------ configuration */

static const char *early_getenv(const char *name);

/* `heapdump run --children` chooses which of its command's descendants are profiled:
 * HEAPDUMP_PROFILE_ROOT is the command's pid (profiled whatever program it runs, across exec)
 * and HEAPDUMP_PROFILE_ONLY the programs profiled among its descendants, comma-separated ("":
 * none). A process not chosen keeps the library in LD_PRELOAD for its own children but records
 * nothing and never registers. */
static bool program_selected(pid_t pid) {
  const char *only = early_getenv(HD_ENV_PROFILE_ONLY);
  if (only == NULL) return true;
  const char *root = early_getenv(HD_ENV_PROFILE_ROOT);
  if (root != NULL && strtol(root, NULL, 10) == (long)pid) return true;
  char comm[HD_COMM_MAX + 1] = {0};
  syscall(SYS_prctl, PR_GET_NAME, comm, 0, 0, 0); /* not prctl(): we interpose it */
  return hd_comm_listed(only, comm);
}

/* getenv that works before libc has set `environ` (the first malloc may come from ld.so):
 * falls back to a raw read of /proc/self/environ into a static buffer. No allocation. */
static const char *early_getenv(const char *name) {
  static char buf[65536];
  static size_t len;
  static int loaded;
  size_t nl = strlen(name);
  if (environ) {
    for (char **e = environ; *e; e++)
      if (strncmp(*e, name, nl) == 0 && (*e)[nl] == '=') return *e + nl + 1;
    return NULL;
  }
  if (!loaded) {
    loaded = 1;
    int fd = (int)syscall(SYS_openat, AT_FDCWD, "/proc/self/environ", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      ssize_t n;
      while (len < sizeof(buf) - 1 &&
             (n = syscall(SYS_read, fd, buf + len, sizeof(buf) - 1 - len)) > 0)
        len += (size_t)n;
      syscall(SYS_close, fd);
    }
  }
  for (size_t i = 0; i < len; i += strlen(buf + i) + 1)
    if (strncmp(buf + i, name, nl) == 0 && buf[i + nl] == '=') return buf + i + nl + 1;
  return NULL;
}

static uint64_t parse_size(const char *s, uint64_t dflt) {
  if (!s || !*s) return dflt;
  uint64_t v = 0;
  for (; *s >= '0' && *s <= '9'; s++) v = v * 10 + (uint64_t)(*s - '0');
  switch (*s) {
    case 'k': case 'K': v <<= 10; break;
    case 'm': case 'M': v <<= 20; break;
    case 'g': case 'G': v <<= 30; break;
    default: break;
  }
  return v ? v : dflt;
}

/* CLOCK_MONOTONIC_COARSE by default: the same clock as CLOCK_MONOTONIC, read without the TSC,
 * to the kernel tick (1-4 ms); a tenth of the cost of a precise read, which was about a tenth
 * of the whole hook. HEAPDUMP_CLOCK=precise restores nanoseconds. */
static clockid_t g_clock = CLOCK_MONOTONIC_COARSE;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(g_clock, &ts); /* vDSO: no syscall */
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Text range of this module, whose frames are dropped from the top of every trace. */
static void own_text_range(uintptr_t *lo, uintptr_t *hi) {
  const ElfW(Ehdr) *eh = &__ehdr_start;
  const ElfW(Phdr) *ph = (const ElfW(Phdr) *)((const char *)eh + eh->e_phoff);
  uintptr_t base = (uintptr_t)eh;
  *lo = *hi = 0;
  for (int i = 0; i < eh->e_phnum; i++) {
    if (ph[i].p_type == PT_LOAD && (ph[i].p_flags & PF_X)) {
      *lo = base + ph[i].p_vaddr;
      *hi = *lo + ph[i].p_memsz;
    }
  }
}

void hd_init_slow(void) {
  if (hd_tls.guard) return; /* nested inside init: the backend is already chosen */
  /* Guard first: a signal handler allocating right after the state change below must forward,
   * not wait for an init that cannot finish until the handler returns. */
  hd_tls.guard++;
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  int expected = HD_STATE_UNINIT;
  if (!__atomic_compare_exchange_n(&hd_state, &expected, HD_STATE_INITIALIZING, false,
                                   __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    hd_tls.guard--;
    /* Sleeps rather than yields: under real-time scheduling a yield never lets a lower-priority
     * initialising thread run. Start-up only, so a plain sleep is precise enough. */
    while (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) == HD_STATE_INITIALIZING) {
      struct timespec pause = {0, 50000};
      nanosleep(&pause, NULL);
    }
    return;
  }
  const char *a = early_getenv(HD_ENV_ALLOCATOR);
  hd_backend_init(a && strcmp(a, "system") == 0);
  const char *u = early_getenv(HD_ENV_UNWIND);
  int method = HD_UNWIND_CFI;
  if (u != NULL && strcmp(u, "fp") == 0) method = HD_UNWIND_FP;
  if (u != NULL && strcmp(u, "libunwind") == 0) method = HD_UNWIND_LIBUNWIND;
  if (u != NULL && strcmp(u, "compare") == 0) method = HD_UNWIND_COMPARE;
  unsigned max_frames = (unsigned)parse_size(early_getenv(HD_ENV_MAX_FRAMES), HD_MAX_FRAMES);
  uint64_t max_mem = parse_size(early_getenv(HD_ENV_MAX_MEMORY), (uint64_t)1 << 30);
  const char *clock = early_getenv(HD_ENV_CLOCK);
  if (clock && strcmp(clock, "precise") == 0) g_clock = CLOCK_MONOTONIC;
  const char *f = early_getenv(HD_ENV_FOLLOW_CHILDREN);
  g_follow_children = !(f && strcmp(f, "0") == 0);
  uintptr_t lo, hi;
  own_text_range(&lo, &hi);
  int state = HD_STATE_OFF;
  if (!program_selected(getpid())) {
    /* not chosen: stay off, tables never created */
  } else if (hd_alloc_table_create(&g_alloc, max_mem / 4 * 3, HD_MEMFD_ALLOCATIONS) == 0) {
    /* Nodes keep their time as an offset from this: no allocation is timed before it. */
    g_alloc.hdr->time_base = now_ns();
    if (hd_res_table_create(&g_res, max_mem / 4, HD_MEMFD_RESOURCES) == 0) {
      hd_stack_configure(method, max_frames, lo, hi);
      state = HD_STATE_READY;
    } else {
      hd_alloc_table_destroy(&g_alloc);
    }
  }
  hd_tls.guard--;
  __atomic_store_n(&hd_state, state, __ATOMIC_RELEASE);
}

/* ------------------------------------------------------------------ recording */

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
      hd_res_attach_counters(&g_res, &hd_tls.writer) && g_thread_exit_key_made) {
    hd_tls.guard++; /* pthread_setspecific may allocate */
    pthread_setspecific(g_thread_exit_key, &hd_tls);
    hd_tls.guard--;
  }
  if (hd_tls.thread_key == 0) {
    /* Once per thread: where its stack and TLS are, roots of a leak check. */
    uintptr_t lo = 0, hi = 0;
    if (!hd_thread_stack(&lo, &hi)) lo = hi = 0;
    hd_res_add_thread_roots(&g_res, hd_tls.tid, lo, hi, (uint64_t)__builtin_thread_pointer());
  }
  if (hd_tls.thread_key == 0 || strcmp(name, hd_tls.name) != 0) {
    uint32_t key = hd_res_add_thread(&g_res, hd_tls.tid, name, now_ns());
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
  uint32_t key = hd_res_intern_stack_print(&g_res, frames, n, flags, print);
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
  info->timestamp = now_ns();
  info->flags = lg_align & HD_NODE_ALIGN_MASK;
  /* No lock is held here, and the capture above is where a hook spends most of its time, so
   * where signal handlers are most likely to have queued work: apply it now, not only at the
   * end of the hook, so that a signal storm fills the queue less. */
  if (HD_UNLIKELY(__atomic_load_n(&hd_tls.pending_count, __ATOMIC_RELAXED) != 0))
    hd_drain_pending();
}

/* ------------------------------------------------------------------ the block's tag */

/* The last HD_TAG_BYTES of every block's usable size, past what the program asked for (the
 * backend allocates that much more, and malloc_usable_size answers that much less): the link
 * (node index + 1, 0 = not recorded) of the node that records the block, and a check of the link
 * against the block's address. A free finds its node from the tag, so the table needs no index.
 * The check catches a program that wrote past its block onto the tag: that free then finds its
 * node by a scan, and the overwrite is counted. */
typedef struct block_tag {
  uint32_t link;
  uint32_t check;
} block_tag;

static uint32_t tag_check(uint64_t address, uint32_t link) {
  uint64_t h = (address ^ ((uint64_t)link << 32) ^ UINT64_C(0x2545F4914F6CDD1D)) *
               UINT64_C(0x9E3779B97F4A7C15);
  return (uint32_t)(h >> 32);
}

static block_tag *tag_at(void *p, size_t usable) {
  return (block_tag *)((char *)p + usable - HD_TAG_BYTES);
}

/* usable: the block's usable size where the caller has it, which spares the lookup. */
static void tag_set_at(void *p, size_t usable, uint32_t index) {
  block_tag *tag = tag_at(p, usable);
  tag->link = index == HD_NO_NODE ? 0 : index + 1;
  tag->check = tag_check((uint64_t)(uintptr_t)p, tag->link);
}

static void tag_set(void *p, uint32_t index) { tag_set_at(p, hd_backend_usable(p), index); }

/* The node recording block p (of the usable size given), or HD_NO_NODE if it is not recorded. */
static uint32_t node_of_at(void *p, size_t usable) {
  const block_tag tag = *tag_at(p, usable);
  const uint64_t address = (uint64_t)(uintptr_t)p;
  if (HD_LIKELY(tag.check == tag_check(address, tag.link))) {
    return tag.link == 0 ? HD_NO_NODE : tag.link - 1;
  }
  hd_res_count_overwritten_tag(&g_res);
  return hd_alloc_table_find(&g_alloc, address);
}

static uint32_t node_of(void *p) { return node_of_at(p, hd_backend_usable(p)); }

/* Records info in a node; the node, or HD_NO_NODE if the table could not (counted). */
static uint32_t insert_info(const hd_alloc_info *info) {
  hd_writer_thread *w = &hd_tls.writer;
  uint32_t index;
  if (hd_alloc_table_insert(&g_alloc, w, info, &index) != HD_INSERT_NEW) {
    hd_res_count_drop(&g_res, offsetof(hd_stats_block, dropped_allocations));
    return HD_NO_NODE;
  }
  hd_res_count_alloc(&g_res, w, info->stack_key, info->size);
  return index;
}

void hd_record_alloc(void *p, size_t size, unsigned lg_align, size_t usable) {
  if (HD_UNLIKELY(__atomic_load_n(&hd_state, __ATOMIC_RELAXED) != HD_STATE_READY)) {
    tag_set_at(p, usable, HD_NO_NODE);
    return;
  }
  hd_alloc_info info;
  make_info(&info, p, size, lg_align);
  tag_set_at(p, usable, insert_info(&info));
}

/* Takes the record of block p (of the usable size given) out of the table, uncounted; true and
 * *old filled if it had one. */
static bool take_record(void *p, size_t usable, hd_alloc_info *old) {
  if (__atomic_load_n(&hd_state, __ATOMIC_RELAXED) != HD_STATE_READY) return false;
  const uint32_t index = node_of_at(p, usable);
  return index != HD_NO_NODE &&
         hd_alloc_table_erase(&g_alloc, &hd_tls.writer, index, (uint64_t)(uintptr_t)p, old);
}

static void free_recorded_at(void *p, size_t usable) {
  hd_alloc_info old;
  /* Erased before the block goes back: its address cannot be reused while still recorded. */
  if (take_record(p, usable, &old)) {
    hd_res_count_free(&g_res, &hd_tls.writer, old.size);
    hd_backend_free(p, old.size ? old.size : 1, old.flags & HD_NODE_ALIGN_MASK);
    return;
  }
  hd_backend_free(p, 0, 0);
}

void hd_free_recorded(void *p) { free_recorded_at(p, hd_backend_usable(p)); }

void *hd_realloc_recorded(void *p, size_t size) {
  bool on = __atomic_load_n(&hd_state, __ATOMIC_RELAXED) == HD_STATE_READY;
  if (hd_use_system) {
    /* glibc decides in place vs moving inside realloc: the record is taken out first (so a
     * moved-from address never stays recorded) and restored if realloc fails. */
    hd_alloc_info old;
    const bool had = take_record(p, hd_backend_usable(p), &old);
    void *q = hd_backend_realloc(p, size);
    if (!q) {
      /* p is unchanged: recorded again under a new node (its counters never moved), or marked
       * as not recorded (and counted freed) if the table cannot take it again. */
      uint32_t again = HD_NO_NODE;
      if (had && hd_alloc_table_insert(&g_alloc, &hd_tls.writer, &old, &again) != HD_INSERT_NEW)
        hd_res_count_free(&g_res, &hd_tls.writer, old.size);
      tag_set(p, again);
      errno = ENOMEM;
      return NULL;
    }
    if (had) hd_res_count_free(&g_res, &hd_tls.writer, old.size);
    hd_record_alloc(q, size, 0, hd_backend_usable(q));
    return q;
  }
  if (!hd_backend_grants(size)) {
    errno = ENOMEM;
    return NULL;
  }
  /* The tag moves with the block's end: read it before the resize. */
  const uint32_t index = on ? node_of(p) : HD_NO_NODE;
  const size_t resized_usable = hd_backend_resize_in_place(p, size);
  if (resized_usable != 0) {
    if (!on) {
      tag_set_at(p, resized_usable, HD_NO_NODE);
      return p;
    }
    /* Same address: one record rewritten in one critical section. */
    hd_alloc_info info, old;
    make_info(&info, p, size, 0);
    if (index != HD_NO_NODE && hd_alloc_table_replace(&g_alloc, index, &info, &old)) {
      hd_res_count_free(&g_res, &hd_tls.writer, old.size);
      hd_res_count_alloc(&g_res, &hd_tls.writer, info.stack_key, size);
      tag_set_at(p, resized_usable, index);
    } else {
      /* Not recorded, or its new size cannot be: its old record must not outlive it. */
      if (index != HD_NO_NODE &&
          hd_alloc_table_erase(&g_alloc, &hd_tls.writer, index, info.address, &old)) {
        hd_res_count_free(&g_res, &hd_tls.writer, old.size);
      }
      tag_set_at(p, resized_usable, insert_info(&info));
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
  hd_record_alloc(q, size, 0, usable); /* new block recorded before the old one is released */
  free_recorded_at(p, old_usable);
  return q;
}

/* ------------------------------------------------------------------ nested calls */

/* Queues op for the interrupted hook; false if the queue is full. The slot is claimed with one
 * atomic add, so a handler interrupting this one (a second signal) claims another slot. */
static bool queue_pending(const hd_pending_op *op) {
  uint32_t i = __atomic_fetch_add(&hd_tls.pending_count, 1, __ATOMIC_RELAXED);
  if (i >= HD_PENDING_MAX) return false;
  hd_tls.pending[i] = *op;
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  return true;
}

/* From a signal handler inside a hook: the block is real already; its record waits. The trace
 * is taken here (the handler's own stack), unless that cannot be done safely. Its node is
 * reserved and written in its tag now, while the handler still owns the block: by the time the
 * record is written, the program may have freed the block, whose tag must then not be touched. */
static void defer_record(void *p, size_t size, unsigned lg_align, size_t usable) {
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return;
  hd_pending_op op = {.ptr = p, .size = size, .lg_align = lg_align & HD_NODE_ALIGN_MASK,
                      .thread_key = hd_tls.thread_key, .timestamp = now_ns(),
                      .node = hd_alloc_table_reserve(&g_alloc)};
  if (op.node == HD_NO_NODE) {
    hd_res_count_drop(&g_res, offsetof(hd_stats_block, dropped_allocations));
    return;
  }
  tag_set_at(p, usable, op.node);
  uint64_t frames[HD_MAX_FRAMES];
  bool truncated;
  unsigned n = hd_capture_stack(frames, true, &truncated, NULL);
  if (n > 0) {
    op.stack_key = hd_res_intern_stack_nowait(&g_res, frames, n, truncated ? HD_STACK_TRUNCATED : 0);
  }
  if (!queue_pending(&op)) {
    tag_set_at(p, usable, HD_NO_NODE);
    hd_alloc_table_release(&g_alloc, op.node);
    hd_res_count_drop(&g_res, offsetof(hd_stats_block, dropped_allocations));
  }
}

void *hd_nested_alloc(size_t size, unsigned lg_align, bool zero) {
  if (hd_tls.in_backend) {
    errno = ENOMEM;
    return NULL;
  }
  size_t usable;
  void *p = hd_backend_alloc(size, lg_align, zero, &usable);
  if (!p) {
    errno = ENOMEM;
    return NULL;
  }
  tag_set_at(p, usable, HD_NO_NODE); /* unless a record is queued */
  if (!hd_tls.guard) defer_record(p, size, lg_align, usable);
  return p;
}

void hd_nested_free(void *p) {
  if (hd_tls.guard && !hd_tls.in_backend) {
    hd_backend_free(p, 0, 0);
    return;
  }
  /* Erasing now could wait for a slot lock the interrupted hook holds; freeing before the erase
   * would let another thread get the address while it is still recorded. Both wait. */
  hd_pending_op op = {.ptr = p, .is_free = 1};
  if (queue_pending(&op)) return;
  /* Queue full: the block is not returned (leaked), so that its record, if it has one, stays
   * true: a free that erased nothing would leave a record of a block the allocator hands out
   * again, and with no index over addresses nothing would find that record later. */
}

void *hd_nested_realloc(void *p, size_t size) {
  if (hd_tls.in_backend) {
    errno = ENOMEM;
    return NULL;
  }
  if (hd_tls.guard) {
    void *q = hd_backend_realloc(p, size);
    if (!q) errno = ENOMEM;
    else tag_set(q, HD_NO_NODE);
    return q;
  }
  /* Always moves: the old block's record can only be dropped later, with its free. */
  void *q = hd_nested_alloc(size, 0, false);
  if (!q) return NULL;
  size_t old_usable = hd_backend_usable(p) - HD_TAG_BYTES;
  memcpy(q, p, old_usable < size ? old_usable : size);
  hd_nested_free(p);
  return q;
}

void hd_drain_pending(void) {
  int saved_errno = errno;
  uint32_t done = 0;
  for (;;) {
    uint32_t n = __atomic_load_n(&hd_tls.pending_count, __ATOMIC_RELAXED);
    for (; done < n && done < HD_PENDING_MAX; done++) {
      hd_pending_op op = hd_tls.pending[done];
      __atomic_signal_fence(__ATOMIC_SEQ_CST);
      if (op.is_free) {
        hd_free_recorded(op.ptr);
      } else if (__atomic_load_n(&hd_state, __ATOMIC_RELAXED) == HD_STATE_READY) {
        /* The block's tag already names op.node; the block itself may be gone. */
        hd_alloc_info info = {.address = (uint64_t)(uintptr_t)op.ptr, .size = op.size,
                              .timestamp = op.timestamp, .thread_key = op.thread_key,
                              .stack_key = op.stack_key, .flags = op.lg_align};
        if (hd_alloc_table_fill(&g_alloc, &hd_tls.writer, op.node, &info)) {
          hd_res_count_alloc(&g_res, &hd_tls.writer, info.stack_key, info.size);
        } else {
          hd_res_count_drop(&g_res, offsetof(hd_stats_block, dropped_allocations));
        }
      }
    }
    /* Fails if a handler queued more meanwhile: those are applied in the next round. */
    if (__atomic_compare_exchange_n(&hd_tls.pending_count, &n, 0, false, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED))
      break;
  }
  errno = saved_errno;
}

void hd_note_rename(void) { __atomic_fetch_add(&hd_name_generation, 1, __ATOMIC_RELAXED); }

void hd_count_beyond_cfi(void) { hd_res_count_beyond_cfi(&g_res); }

void hd_rescan_regions(void) {
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return;
  hd_tls.guard++;
  hd_regions_scan(&g_res, g_exe_name);
  hd_stack_modules_changed();
  hd_tls.guard--;
}

void hd_instrumentation_tables(hd_owned_fd *alloc, hd_owned_fd *res) {
  bool on = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) == HD_STATE_READY;
  *alloc = on ? g_alloc.memfd : HD_OWNED_FD_NONE;
  *res = on ? g_res.memfd : HD_OWNED_FD_NONE;
}

int hd_snapshot_copy_live(hd_owned_fd *out) {
  if (!out) return -EINVAL;
  *out = HD_OWNED_FD_NONE;
  hd_ensure_init();
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return -ENODEV;
  hd_tls.guard++;
  hd_alloc_table snap;
  hd_alloc_table_lock_all(&g_alloc);
  int rc = hd_alloc_table_clone_locked(&g_alloc, &snap, 0, HD_MEMFD_SNAPSHOT);
  hd_alloc_table_unlock_all(&g_alloc);
  if (rc == 0) {
    rc = hd_alloc_table_freeze(&snap);
    if (rc == 0) *out = snap.memfd;
    else hd_alloc_table_destroy(&snap);
  }
  hd_tls.guard--;
  return rc;
}

/* ------------------------------------------------------------------ fork */

/* The tables are MAP_SHARED: after fork parent and child would write the same memory. So the
 * prepare handler (all writers stopped) copies both tables into new memfds; the child adopts
 * them (its live set equals the parent's at the fork) and the parent drops them. */
static hd_alloc_table g_fork_alloc;
static hd_res_table g_fork_res;
static int g_fork_locked, g_fork_copied;

static void fork_prepare(void) {
  g_fork_locked = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) == HD_STATE_READY;
  if (!g_fork_locked) return;
  hd_tls.guard++;
  pthread_mutex_lock(&g_res.lock);
  hd_alloc_table_lock_all(&g_alloc);
  g_fork_copied = 0;
  /* A child not chosen for profiling gets no copy, and so stops recording (fork_child). Its pid
   * is not known yet, but it is not the root: only its program (ours) decides. */
  if (program_selected(0) &&
      hd_alloc_table_clone_locked(&g_alloc, &g_fork_alloc, g_alloc.size, HD_MEMFD_ALLOCATIONS) == 0) {
    if (hd_res_table_clone_locked(&g_res, &g_fork_res, HD_MEMFD_RESOURCES) == 0) {
      uint64_t live_blocks, live_bytes;
      hd_alloc_table_sum_locked(&g_fork_alloc, &live_blocks, &live_bytes);
      hd_res_reconcile_live(&g_fork_res, live_blocks, live_bytes);
      g_fork_copied = 1;
    } else {
      hd_alloc_table_destroy(&g_fork_alloc);
    }
  }
}

static void fork_parent(void) {
  if (!g_fork_locked) return;
  hd_alloc_table_unlock_all(&g_alloc);
  pthread_mutex_unlock(&g_res.lock);
  if (g_fork_copied) {
    hd_alloc_table_destroy(&g_fork_alloc);
    hd_res_table_destroy(&g_fork_res);
  }
  hd_tls.guard--;
}

static void fork_child(void) {
  if (!g_fork_locked) return;
  hd_stack_after_fork_child();
  hd_regions_after_fork_child();
  if (g_fork_copied) {
    hd_alloc_table old_alloc = g_alloc;
    hd_res_table old_res = g_res;
    hd_res_table_adopt_index(&g_fork_res, &old_res);
    g_alloc = g_fork_alloc;
    g_res = g_fork_res;
    pthread_mutex_init(&g_alloc.world_lock, NULL);
    pthread_mutex_init(&g_res.lock, NULL);
    g_alloc.hdr->pid = (uint32_t)getpid(); /* the copies were made by the parent */
    g_res.hdr->pid = (uint32_t)getpid();
    /* Our mappings of the parent's memfds; the parent keeps its own. */
    hd_alloc_table_destroy(&old_alloc);
    hd_res_table_destroy(&old_res);
  } else {
    /* Not chosen, or could not copy: stop recording rather than write into the parent's
     * tables. */
    __atomic_store_n(&hd_state, HD_STATE_OFF, __ATOMIC_RELEASE);
  }
  /* The cached free nodes were numbered in the parent's table; the counters record is copied. */
  hd_tls.writer.node_count = 0;
  hd_tls.writer.live_delta = 0;
  hd_tls.tid = 0; /* new tid: the next allocation records a new thread info */
  hd_tls.thread_key = 0;
  hd_tls.name_countdown = 0;
  hd_tls.guard--;
  if (g_fork_copied) hd_registration_after_fork_child();
}

/* ------------------------------------------------------------------ start-up */

/* Runs at thread exit after the thread's TLS destructors (C++ thread_local ones included) but
 * before its last frees by libc; those take the shared paths. */
static void thread_exit(void *arg) {
  (void)arg;
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return;
  hd_tls.guard++;
  hd_writer_thread_retire(&g_alloc, &g_res, &hd_tls.writer);
  hd_tls.guard--;
}

static void strip_from_ld_preload(void) {
  const char *pre = getenv("LD_PRELOAD");
  Dl_info di;
  if (!pre || !dladdr((void *)&hd_init_slow, &di) || !di.dli_fname) return;
  const char *self = strrchr(di.dli_fname, '/');
  self = self ? self + 1 : di.dli_fname;
  char out[4096];
  size_t o = 0;
  for (const char *p = pre; *p;) {
    size_t n = strcspn(p, " :");
    const char *base = p;
    for (const char *q = p; q < p + n; q++)
      if (*q == '/') base = q + 1;
    bool ours = n > 0 && (size_t)(p + n - base) == strlen(self) && strncmp(base, self, strlen(self)) == 0;
    if (n > 0 && !ours && o + n + 2 < sizeof(out)) {
      if (o) out[o++] = ':';
      memcpy(out + o, p, n);
      o += n;
    }
    p += n;
    if (*p) p++;
  }
  out[o] = 0;
  if (o) setenv("LD_PRELOAD", out, 1);
  else unsetenv("LD_PRELOAD");
}

/* exit() runs its handlers last-registered first, and this one is registered before the C
 * library registers the loader's finalizer (our constructor runs before the program starts):
 * it runs after the program's atexit handlers and every static destructor. Registered without
 * a DSO handle, so that finalizing this library does not run it early. */
extern int __cxa_atexit(void (*fn)(void *), void *arg, void *dso_handle);

/* The exit snapshot, stored from the exit path with contents and roots (a leak check) while
 * this thread waits for the collector, bounded by the snapshot timeout; without a collector,
 * or if it fails, the collector's own exit snapshot (without contents) is what remains. */
static void exit_leak_check(void *unused) {
  (void)unused;
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return;
  if (!hd_exit_with_contents_wanted()) return; /* a fork child of the command, say */
  hd_owned_fd memfd;
  if (hd_snapshot_copy_live(&memfd) != 0) return;
  int rc = hd_store_named_snapshot(HD_EXIT_SNAPSHOT_NAME, &memfd, true);
  (void)rc;
  hd_owned_fd_close(&memfd);
}

__attribute__((constructor)) static void hd_constructor(void) {
  hd_ensure_init();
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return;
  hd_tls.guard++;
  ssize_t n = readlink("/proc/self/exe", g_exe_name, sizeof(g_exe_name) - 1);
  g_exe_name[n > 0 ? n : 0] = 0;
  pthread_atfork(fork_prepare, fork_parent, fork_child);
  g_thread_exit_key_made = pthread_key_create(&g_thread_exit_key, thread_exit) == 0;
  hd_tls.guard--;
  if (!g_follow_children) strip_from_ld_preload();
  hd_tls.guard++; /* what loading libunwind allocates is the library's own */
  hd_stack_start();
  hd_tls.guard--;
  hd_rescan_regions();
  hd_register_with_collector();
  if (hd_exit_with_contents_wanted()) __cxa_atexit(exit_leak_check, NULL, NULL);
}

/* ------------------------------------------------------------------ public API */

/* The size of struct heapdump_stats in heapdump 0.1, whose programs call heapdump_get_stats. */
#define STATS_V1_SIZE 64
_Static_assert(offsetof(struct heapdump_stats, dropped_allocations) + 8 == STATS_V1_SIZE,
               "fields are only ever added at the end of struct heapdump_stats");

__attribute__((visibility("default"))) int heapdump_get_stats_sized(struct heapdump_stats *out,
                                                                     size_t size) {
  if (!out || size < STATS_V1_SIZE) return HEAPDUMP_ERROR_INVALID_ARGUMENT;
  memset(out, 0, size); /* a newer caller's fields this library does not know are zero */
  hd_ensure_init();
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return HEAPDUMP_ERROR_NOT_RECORDING;
  hd_stats_block s;
  hd_res_read_stats(&g_res, &s);
  struct heapdump_stats now = {
      .blocks_allocated = s.blocks_allocated,
      .bytes_allocated = s.bytes_allocated,
      .blocks_freed = s.blocks_freed,
      .bytes_freed = s.bytes_freed,
      .peak_live_bytes = s.peak_live_bytes,
      .dropped_allocations = s.dropped_allocations,
  };
  /* The counters are read one by one while other threads move them: a free counted after its
   * allocation was read would make the difference wrap below zero. */
  now.live_blocks = now.blocks_allocated > now.blocks_freed ? now.blocks_allocated - now.blocks_freed : 0;
  now.live_bytes = now.bytes_allocated > now.bytes_freed ? now.bytes_allocated - now.bytes_freed : 0;
  if (now.peak_live_bytes < now.live_bytes) now.peak_live_bytes = now.live_bytes;
  memcpy(out, &now, size < sizeof now ? size : sizeof now); /* only what an older caller knows */
  return HEAPDUMP_OK;
}

/* The entry point of programs built against heapdump 0.1's header, where heapdump_get_stats was
 * a function (now a macro passing the struct's size). */
#undef heapdump_get_stats
__attribute__((visibility("default"))) int heapdump_get_stats(struct heapdump_stats *out);
int heapdump_get_stats(struct heapdump_stats *out) { return heapdump_get_stats_sized(out, STATS_V1_SIZE); }

__attribute__((visibility("default"))) int heapdump_take_named_snapshot(const char *name) {
  if (!name || !*name || strlen(name) > HEAPDUMP_SNAPSHOT_NAME_MAX) return HEAPDUMP_ERROR_INVALID_ARGUMENT;
  /* Cancelled inside (at a socket call), the thread would leave the registration lock held and
   * every later call of any thread would hang: the call runs to its end, like one system call,
   * and a pending cancellation acts at the caller's next cancellation point. */
  int cancel_state;
  pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cancel_state);
  hd_owned_fd memfd;
  int rc = hd_snapshot_copy_live(&memfd);
  if (rc == 0) {
    rc = hd_store_named_snapshot(name, &memfd, false);
    hd_owned_fd_close(&memfd);
  } else {
    rc = rc == -ENODEV ? HEAPDUMP_ERROR_NOT_RECORDING : HEAPDUMP_ERROR_NO_MEMORY;
  }
  pthread_setcancelstate(cancel_state, NULL);
  return rc;
}
