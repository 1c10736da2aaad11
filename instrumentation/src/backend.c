/* Where the real memory comes from: jemalloc's non-standard API (default; sized frees, no dlsym
 * bootstrap) or glibc's __libc_* entry points (HEAPDUMP_ALLOCATOR=system). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "runtime.h"

/* jemalloc's non-standard API (libjemalloc.so.2); flag values are part of its ABI. */
void *mallocx(size_t size, int flags);
size_t xallocx(void *ptr, size_t size, size_t extra, int flags);
void dallocx(void *ptr, int flags);
void sdallocx(void *ptr, size_t size, int flags);
size_t sallocx(const void *ptr, int flags);
size_t nallocx(size_t size, int flags);
#define HD_MALLOCX_ZERO 0x40

void *__libc_malloc(size_t size);
void *__libc_calloc(size_t n, size_t size);
void *__libc_memalign(size_t align, size_t size);
void __libc_free(void *p);

void *hd_backend_alloc(size_t size, unsigned lg_align, bool zero) {
  if (hd_use_system) {
    if (lg_align == 0) return zero ? __libc_calloc(1, size) : __libc_malloc(size);
    void *p = __libc_memalign((size_t)1 << lg_align, size);
    if (p && zero) memset(p, 0, size);
    return p;
  }
  return mallocx(size ? size : 1, (int)lg_align | (zero ? HD_MALLOCX_ZERO : 0));
}

void hd_backend_free(void *p, size_t size_hint, unsigned lg_align) {
  if (hd_use_system) __libc_free(p);
  else if (size_hint && lg_align == 0) sdallocx(p, size_hint, 0);
  else dallocx(p, 0);
}

size_t hd_backend_usable(void *p) {
  if (!hd_use_system) return sallocx(p, 0);
  static size_t (*real)(void *);
  size_t (*f)(void *) = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
  if (!f) { /* once; glibc's own (versioned) definition, not ours nor jemalloc's */
    f = (size_t(*)(void *))dlvsym(RTLD_NEXT, "malloc_usable_size", "GLIBC_2.2.5");
    __atomic_store_n(&real, f, __ATOMIC_RELEASE);
  }
  return f ? f(p) : 0;
}

/* In-place resize for the jemalloc backend: true if p now has exactly the size class of size
 * (so a later sized free with `size` is valid). */
bool hd_backend_resize_in_place(void *p, size_t size) {
  size_t cls = nallocx(size, 0);
  return cls != 0 && xallocx(p, size, 0, 0) == cls;
}

size_t hd_backend_class(size_t size) { return hd_use_system ? size : nallocx(size ? size : 1, 0); }
