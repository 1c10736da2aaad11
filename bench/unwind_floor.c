/* libhd_unwind_floor.so: what walking the stack at every allocation costs by itself.
 *
 * Preloaded into a program, it calls libunwind's unw_backtrace (per-thread caching, up to the
 * 80 frames libheapdump.so asks for: 64 plus its own) at every malloc, calloc, realloc and
 * aligned allocation, then hands the call to glibc's allocator. It records nothing, and free
 * and everything else are glibc's own. bench/run runs it beside the profilers: the floor under
 * any profiler that unwinds every allocation with libunwind, heapdump and heaptrack included. */
#define _GNU_SOURCE
#define UNW_LOCAL_ONLY
#include <errno.h>
#include <libunwind.h>
#include <stddef.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))
#define FLOOR_FRAMES 80

extern void *__libc_malloc(size_t size);
extern void *__libc_calloc(size_t count, size_t size);
extern void *__libc_realloc(void *p, size_t size);
extern void *__libc_memalign(size_t align, size_t size);

static __thread int t_walking; /* libunwind's own first-use allocations are not walked */
static int g_walked;

/* Lets a program (hd_microbench) check that the floor is what it runs under. */
EXPORT int hd_unwind_floor_active(void) { return __atomic_load_n(&g_walked, __ATOMIC_RELAXED); }

__attribute__((constructor)) static void configure(void) {
  unw_set_caching_policy(unw_local_addr_space, UNW_CACHE_PER_THREAD);
}

static void walk(void) {
  if (t_walking) return;
  t_walking = 1;
  void *ips[FLOOR_FRAMES];
  int frames = unw_backtrace(ips, FLOOR_FRAMES);
  /* The walk's result must look used, or it could be dropped. */
  __asm__ volatile("" : : "r"(frames), "r"(ips) : "memory");
  if (!__atomic_load_n(&g_walked, __ATOMIC_RELAXED)) __atomic_store_n(&g_walked, 1, __ATOMIC_RELAXED);
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
