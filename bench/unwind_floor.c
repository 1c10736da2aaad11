/* libhd_unwind_floor.so: what walking the stack at every allocation costs by itself.
 *
 * Preloaded into a program, it walks the stack at every malloc, calloc, realloc and aligned
 * allocation, then hands the call to glibc's allocator. It records nothing, and free and
 * everything else are glibc's own. bench/run runs it beside the profilers:
 * - by default with libunwind's unw_backtrace (per-thread caching, up to the 80 frames
 *   libheapdump.so asks for: 64 plus its own): the floor under any profiler that unwinds every
 *   allocation with libunwind, heaptrack included;
 * - with HD_UNWIND_FLOOR=cfi with heapdump's own unwinder (instrumentation/src/cfi_*.c, with its
 *   validated trace reuse, up to 65 frames): the floor under heapdump's default recording. */
#define _GNU_SOURCE
#define UNW_LOCAL_ONLY
#include <errno.h>
#include <libunwind.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cfi.h"

#define EXPORT __attribute__((visibility("default")))
#define FLOOR_FRAMES 80
#define CFI_FRAMES 65

extern void *__libc_malloc(size_t size);
extern void *__libc_calloc(size_t count, size_t size);
extern void *__libc_realloc(void *p, size_t size);
extern void *__libc_memalign(size_t align, size_t size);

static __thread int t_walking; /* the unwinders' own first-use allocations are not walked */
static int g_walked;
static int g_cfi; /* HD_UNWIND_FLOOR=cfi */
static __thread hd_cfi_bounds t_bounds;
static __thread hd_cfi_memos t_memos;

/* Lets a program (hd_microbench) check that the floor is what it runs under. */
EXPORT int hd_unwind_floor_active(void) { return __atomic_load_n(&g_walked, __ATOMIC_RELAXED); }

__attribute__((constructor)) static void configure(void) {
  const char *unwinder = getenv("HD_UNWIND_FLOOR");
  g_cfi = unwinder != NULL && strcmp(unwinder, "cfi") == 0;
  if (g_cfi) {
    hd_cfi_modules_changed();
  } else {
    unw_set_caching_policy(unw_local_addr_space, UNW_CACHE_PER_THREAD);
  }
}

/* Inlined into each entry point, so that its frame is the one the program called: the walk
 * starts at the program's return address, as libheapdump.so's does. */
__attribute__((always_inline)) static inline void walk(void) {
  if (t_walking) return;
  t_walking = 1;
  uint64_t frames[FLOOR_FRAMES];
  unsigned count = 0;
  if (g_cfi) {
    if (t_bounds.count == 0) {
      t_bounds.count = 1; /* the thread's stack, once, as libheapdump.so finds it */
      (void)hd_cfi_thread_stack(&t_bounds.lo[0], &t_bounds.hi[0]);
    }
    const uintptr_t *fp = (const uintptr_t *)__builtin_frame_address(0);
    bool reused, joined, by_frame_pointer;
    uint32_t *known_key;
    (void)hd_cfi_backtrace(&t_bounds, fp[1], (uintptr_t)(fp + 2), fp[0], true, frames, CFI_FRAMES,
                           &count, &t_memos, &reused, &joined, &by_frame_pointer, &known_key);
  } else {
    count = (unsigned)unw_backtrace((void **)frames, FLOOR_FRAMES);
  }
  /* The walk's result must look used, or it could be dropped. */
  __asm__ volatile("" : : "r"(count), "r"(frames) : "memory");
  if (!__atomic_load_n(&g_walked, __ATOMIC_RELAXED))
    __atomic_store_n(&g_walked, 1, __ATOMIC_RELAXED);
  t_walking = 0;
}

EXPORT void *malloc(size_t size) {
  walk();
  return __libc_malloc(size);
}

EXPORT void *calloc(size_t count, size_t size) {
  walk();
  return __libc_calloc(count, size);
}

EXPORT void *realloc(void *p, size_t size) {
  walk();
  return __libc_realloc(p, size);
}

EXPORT void *memalign(size_t align, size_t size) {
  walk();
  return __libc_memalign(align, size);
}

EXPORT void *aligned_alloc(size_t align, size_t size) {
  walk();
  return __libc_memalign(align, size);
}

EXPORT int posix_memalign(void **out, size_t align, size_t size) {
  if (align < sizeof(void *) || (align & (align - 1)) != 0) return EINVAL;
  walk();
  void *p = __libc_memalign(align, size);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
