/* Where the real memory comes from: jemalloc's non-standard API (default; sized frees, no dlsym
 * bootstrap) or glibc's __libc_* entry points (HEAPDUMP_ALLOCATOR=system). Every entry marks the
 * thread as inside the allocator, so that a signal handler interrupting it is not let back in. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "runtime.h"

/* jemalloc's non-standard API (libjemalloc.so.2); flag values are part of its ABI. */
void *mallocx(size_t size, int flags);
void *rallocx(void *ptr, size_t size, int flags);
size_t xallocx(void *ptr, size_t size, size_t extra, int flags);
void dallocx(void *ptr, int flags);
void sdallocx(void *ptr, size_t size, int flags);
size_t sallocx(const void *ptr, int flags);
size_t nallocx(size_t size, int flags);
#define HD_MALLOCX_ZERO 0x40

void *__libc_malloc(size_t size);
void *__libc_calloc(size_t n, size_t size);
void *__libc_memalign(size_t align, size_t size);
void *__libc_realloc(void *p, size_t size);
void __libc_free(void *p);

/* glibc's own malloc_usable_size, not ours nor jemalloc's (both come before it in the lookup
 * order): asked for by glibc's base symbol version, which differs per architecture. Looked up
 * at init so that no later call (possibly from a signal handler) runs the dynamic linker. */
#if defined(__x86_64__)
#define HD_GLIBC_BASE_VERSION "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define HD_GLIBC_BASE_VERSION "GLIBC_2.17"
#else
#error "heapdump supports x86-64 and aarch64 (see shm_layout.h)"
#endif
static size_t (*g_libc_usable)(void *);

static inline void enter(void) {
  hd_tls.in_backend++;
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

static inline void leave(void) {
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  hd_tls.in_backend--;
}

void hd_backend_init(void) {
  if (hd_use_system)
    g_libc_usable = (size_t(*)(void *))dlvsym(RTLD_NEXT, "malloc_usable_size", HD_GLIBC_BASE_VERSION);
}

void *hd_backend_alloc(size_t size, unsigned lg_align, bool zero) {
  void *p;
  enter();
  if (!hd_use_system) {
    p = mallocx(size ? size : 1, (int)lg_align | (zero ? HD_MALLOCX_ZERO : 0));
  } else if (lg_align == 0) {
    p = zero ? __libc_calloc(1, size) : __libc_malloc(size);
  } else {
    p = __libc_memalign((size_t)1 << lg_align, size);
    if (p && zero) memset(p, 0, size);
  }
  leave();
  return p;
}

void hd_backend_free(void *p, size_t size_hint, unsigned lg_align) {
  enter();
  if (hd_use_system) __libc_free(p);
  else if (size_hint && lg_align == 0) sdallocx(p, size_hint, 0);
  else dallocx(p, 0);
  leave();
}

void *hd_backend_realloc(void *p, size_t size) {
  enter();
  void *q = hd_use_system ? __libc_realloc(p, size) : rallocx(p, size, 0);
  leave();
  return q;
}

size_t hd_backend_usable(void *p) {
  enter();
  size_t n = !hd_use_system ? sallocx(p, 0) : g_libc_usable ? g_libc_usable(p) : 0;
  leave();
  return n;
}

/* In-place resize for the jemalloc backend: true if p now has exactly the size class of size
 * (so a later sized free with `size` is valid). */
bool hd_backend_resize_in_place(void *p, size_t size) {
  enter();
  size_t cls = nallocx(size, 0);
  bool ok = cls != 0 && xallocx(p, size, 0, 0) == cls;
  leave();
  return ok;
}

size_t hd_backend_class(size_t size) {
  if (hd_use_system) return size;
  enter();
  size_t cls = nallocx(size ? size : 1, 0);
  leave();
  return cls;
}
