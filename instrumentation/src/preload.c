/* The LD_PRELOAD shim of the allocation family: guard, forward to the backend, record. Nothing
 * else lives here. A call made while this thread is already inside the library (its own code, or
 * a signal handler that interrupted a hook) takes the nested path of runtime.h instead; a dormant
 * library (dormant.c) forwards to glibc and does nothing else. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "runtime.h"

#define EXPORT __attribute__((visibility("default")))

static inline bool is_pow2(size_t x) { return x && !(x & (x - 1)); }

/* Inside the library's code, a hook, or the real allocator (a signal handler's allocation there
 * must fail, its free wait). */
static inline bool nested(void) { return HD_UNLIKELY(hd_thread_busy()); }

/* Sampling on glibc: the block is chosen first; one left out is glibc's own, without a tag. */
static inline void *sampled_alloc(size_t size, unsigned lg_align, bool zero) {
  const hd_record_choice choice = hd_choose(size);
  if (HD_LIKELY(choice == HD_SAMPLED_OUT)) {
    hd_sampled_out_forget_last();
    return lg_align == 0 && !zero ? hd_glibc_malloc(size)
                                  : hd_backend_alloc_untagged(size, lg_align, zero);
  }
  size_t usable;
  void *p = hd_backend_alloc(size, lg_align, zero, &usable);
  if (p != NULL) hd_record_chosen(p, size, lg_align, usable, choice);
  return p;
}

/* An allocation of a library that records (READY or OFF). */
static void *record_hook(size_t size, unsigned lg_align, bool zero) {
  if (nested()) return hd_nested_alloc(size, lg_align, zero);
  hd_hook_enter();
  void *p;
  if (HD_UNLIKELY(hd_sampled_out_untagged)) {
    p = sampled_alloc(size, lg_align, zero);
  } else {
    size_t usable;
    p = hd_backend_alloc(size, lg_align, zero, &usable);
    if (HD_LIKELY(p != NULL)) hd_record_alloc(p, size, lg_align, usable);
  }
  if (HD_UNLIKELY(p == NULL)) errno = ENOMEM;
  hd_hook_leave(); /* keeps errno */
  return p;
}

/* Not recording (yet): initialising, dormant, being armed; a dormant allocation may arm first,
 * and then it is the first recorded. */
__attribute__((noinline)) static void *alloc_not_ready(size_t size, unsigned lg_align, bool zero) {
  if (hd_forwards(hd_hook_state(true))) return hd_backend_alloc_untagged(size, lg_align, zero);
  return record_hook(size, lg_align, zero);
}

static inline void *alloc_hook(size_t size, unsigned lg_align, bool zero) {
  if (HD_UNLIKELY(__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) < HD_STATE_READY))
    return alloc_not_ready(size, lg_align, zero);
  return record_hook(size, lg_align, zero);
}

/* memalign semantics shared by memalign, aligned_alloc, valloc, pvalloc (as glibc 2.36). */
static void *aligned_hook(size_t align, size_t size) {
  if (align <= 16) return alloc_hook(size, 0, false);
  if (align > SIZE_MAX / 2 + 1) {
    errno = EINVAL;
    return NULL;
  }
  if (!is_pow2(align)) align = (size_t)1 << (64 - __builtin_clzl(align));
  return alloc_hook(size, (unsigned)__builtin_ctzl(align), false);
}

/* malloc's and free's whole body, which realloc shares without a call through the PLT. Always
 * inlined, even unoptimised: a glibc call they make unmarked is the exported function's own
 * (the signal storm test tells such calls from the library's marked ones by the caller). */
__attribute__((always_inline)) static inline void *malloc_inline(size_t size) {
  /* The dormant library's whole work: one compare, then glibc's own malloc, called last. First,
   * as it is the whole work of every process of a host that preloads the library, and a
   * sampled malloc's work is many times that compare. A signal handler interrupting that call
   * never arms (dormant.c). */
  if (hd_dormant_passes()) return __libc_malloc(size);
  /* A block sampling leaves out: the filter, the countdown, then glibc's own malloc, called
   * last. */
  if (HD_LIKELY(hd_sampled_out_malloc(hd_filter_now(), size))) {
    hd_sampled_out_forget_last();
    return __libc_malloc(size);
  }
  return alloc_hook(size, 0, false);
}

EXPORT void *malloc(size_t size) { return malloc_inline(size); }

EXPORT void *calloc(size_t n, size_t size) {
  size_t total;
  if (__builtin_mul_overflow(n, size, &total)) {
    errno = ENOMEM;
    return NULL;
  }
  /* A block sampling leaves out, or a dormant library: glibc's own calloc, called last (as
   * malloc). */
  const uint32_t filter = hd_filter_now();
  if (HD_LIKELY(hd_sampled_out_malloc(filter, total))) {
    hd_sampled_out_forget_last();
    return __libc_calloc(n, size);
  }
  if (hd_dormant_passes()) return __libc_calloc(n, size);
  return alloc_hook(total, 0, true);
}

/* A free of a library that records (but of a block sampling left out), is being armed, or is
 * initialising. */
__attribute__((noinline)) static void free_hook(void *p) {
  const int state = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE);
  if (HD_UNLIKELY(state < HD_STATE_READY) &&
      (hd_forwards(state) || hd_forwards(hd_hook_state(false)))) {
    hd_glibc_free(p);
    return;
  }
  if (nested()) {
    hd_nested_free(p);
    return;
  }
  hd_hook_enter();
  if (!HD_UNLIKELY(hd_sampled_out_untagged) || !hd_free_if_untagged(p)) hd_free_recorded(p);
  hd_hook_leave();
}

__attribute__((always_inline)) static inline void free_inline(void *p) {
  const uint32_t filter = hd_filter_now();
  /* Dormant, as the dormant malloc: one compare, then glibc's own free, called last; before the
   * test for NULL, which glibc makes anyway, so that a dormant free is a load, a compare and the
   * jump. (Being armed, marked: a handler that interrupts it once the process records must not
   * enter glibc again.) */
  if (HD_UNLIKELY(filter == HD_FILTER_DORMANT)) {
    __libc_free(p);
    return;
  }
  if (!p) return;
  /* A block sampling left out (its bucket holds no tag): glibc's own free, called last. */
  if (HD_LIKELY(hd_sampled_out_free(filter, p))) {
    hd_sampled_out_forget_last();
    __libc_free(p);
    return;
  }
  free_hook(p);
}

EXPORT void free(void *p) { free_inline(p); }

/* C23: the size/alignment hints are not trusted; the recorded size is used instead. */
EXPORT void free_sized(void *p, size_t size) {
  (void)size;
  free(p);
}

EXPORT void free_aligned_sized(void *p, size_t align, size_t size) {
  (void)align;
  (void)size;
  free(p);
}

/* realloc of a block (p not NULL, size not 0) that is not glibc's alone. */
__attribute__((noinline)) static void *realloc_hook(void *p, size_t size) {
  /* A dormant realloc may arm, as an allocation. */
  if (HD_UNLIKELY(hd_forwards(hd_hook_state(true)))) return hd_backend_realloc_untagged(p, size);
  if (nested()) return hd_nested_realloc(p, size);
  hd_hook_enter();
  void *q = hd_realloc_recorded(p, size);
  hd_hook_leave(); /* keeps errno */
  return q;
}

EXPORT void *realloc(void *p, size_t size) {
  if (!p) return malloc_inline(size);
  if (size == 0) { /* glibc: frees and returns NULL */
    free_inline(p);
    return NULL;
  }
  /* A block without a tag to a size sampling leaves out, or a dormant library: glibc's own
   * realloc, called last (as malloc). */
  const uint32_t filter = hd_filter_now();
  if (HD_LIKELY(hd_sampled_out_realloc(filter, p, size))) {
    hd_sampled_out_forget_last();
    return __libc_realloc(p, size);
  }
  if (hd_dormant_passes()) return __libc_realloc(p, size);
  return realloc_hook(p, size);
}

EXPORT void *reallocarray(void *p, size_t n, size_t size) {
  size_t total;
  if (__builtin_mul_overflow(n, size, &total)) {
    errno = ENOMEM;
    return NULL;
  }
  return realloc(p, total);
}

EXPORT int posix_memalign(void **out, size_t align, size_t size) {
  if (align % sizeof(void *) != 0 || !is_pow2(align)) return EINVAL;
  int saved = errno;
  void *p = align <= 16 ? alloc_hook(size, 0, false)
                        : alloc_hook(size, (unsigned)__builtin_ctzl(align), false);
  errno = saved;
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}

EXPORT void *aligned_alloc(size_t align, size_t size) { return aligned_hook(align, size); }
EXPORT void *memalign(size_t align, size_t size) { return aligned_hook(align, size); }
EXPORT void *valloc(size_t size) { return aligned_hook((size_t)getpagesize(), size); }

EXPORT void *pvalloc(size_t size) {
  size_t page = (size_t)getpagesize(), rounded;
  if (__builtin_add_overflow(size, page - 1, &rounded)) {
    errno = ENOMEM;
    return NULL;
  }
  rounded &= ~(page - 1);
  return aligned_hook(page, rounded ? rounded : page);
}

EXPORT size_t malloc_usable_size(void *p) {
  if (!p) return 0;
  if (HD_UNLIKELY(hd_forwards(hd_hook_state(false)))) return hd_backend_usable_untagged(p);
  return hd_program_usable(p);
}

/* jemalloc's non-standard API, for the programs that call it themselves: folly does, once it
 * sees jemalloc serving malloc, as it does under the default backend. Their blocks are recorded
 * like malloc's, the sizes they are told are the program's (each block keeps its tag past
 * them), any size the program was told is valid in a sized free, and a block from either API
 * may be freed through the other. Arena and tcache flags are not honoured. */
static unsigned mallocx_lg_align(int flags) {
  const unsigned lg_align = (unsigned)flags & HD_MALLOCX_LG_ALIGN_MASK;
  return lg_align <= 4 ? 0 : lg_align; /* every block is 16-byte aligned */
}

EXPORT void *mallocx(size_t size, int flags) {
  return alloc_hook(size, mallocx_lg_align(flags), (flags & HD_MALLOCX_ZERO) != 0);
}

EXPORT void *rallocx(void *p, size_t size, int flags) {
  const unsigned lg_align = mallocx_lg_align(flags);
  const bool zero = (flags & HD_MALLOCX_ZERO) != 0;
  /* Size 0 is undefined for rallocx; realloc would free the block and answer NULL, which here
   * means that the block was left as it was. */
  if (lg_align == 0 && !zero) return realloc(p, size ? size : 1);
  /* Only a new block is aligned so, or zeroed past the old block's bytes. */
  void *q = alloc_hook(size, lg_align, zero);
  if (!q) return NULL;
  const size_t old_size = malloc_usable_size(p); /* the program's part of the block */
  memcpy(q, p, old_size < size ? old_size : size);
  free(p);
  return q;
}

/* Never resizes: the answer, the block's size as it is, tells a caller asking for more that the
 * block could not grow in place, as jemalloc's may answer. */
EXPORT size_t xallocx(void *p, size_t size, size_t extra, int flags) {
  (void)size;
  (void)extra;
  (void)flags;
  return malloc_usable_size(p);
}

EXPORT size_t sallocx(const void *p, int flags) {
  (void)flags;
  return malloc_usable_size((void *)p);
}

EXPORT size_t nallocx(size_t size, int flags) {
  hd_ensure_init();
  return hd_backend_size_class(size, mallocx_lg_align(flags));
}

EXPORT void dallocx(void *p, int flags) {
  (void)flags;
  free(p);
}

/* The size is not trusted, as for free_sized: the block's own is used. */
EXPORT void sdallocx(void *p, size_t size, int flags) {
  (void)size;
  (void)flags;
  free(p);
}
