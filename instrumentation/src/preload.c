/* The LD_PRELOAD shim: guard, forward to the backend, record. Nothing else lives here.
 * A call made while this thread is already inside the library (its own code, or a signal handler
 * that interrupted a hook) takes the nested path of runtime.h instead. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "owned_fd.h"
#include "runtime.h"
#include "stack.h"

#define EXPORT __attribute__((visibility("default")))

static inline bool is_pow2(size_t x) { return x && !(x & (x - 1)); }

static inline bool nested(void) { return HD_UNLIKELY((hd_tls.guard | hd_tls.in_hook) != 0); }

static void *alloc_hook(size_t size, unsigned lg_align, bool zero) {
  hd_ensure_init();
  if (nested()) return hd_nested_alloc(size, lg_align, zero);
  hd_hook_enter();
  void *p = hd_backend_alloc(size, lg_align, zero);
  if (HD_LIKELY(p != NULL)) hd_record_alloc(p, size, lg_align);
  else errno = ENOMEM;
  hd_hook_leave(); /* keeps errno */
  return p;
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

EXPORT void *malloc(size_t size) { return alloc_hook(size, 0, false); }

EXPORT void *calloc(size_t n, size_t size) {
  size_t total;
  if (__builtin_mul_overflow(n, size, &total)) {
    errno = ENOMEM;
    return NULL;
  }
  return alloc_hook(total, 0, true);
}

EXPORT void free(void *p) {
  if (!p) return;
  hd_ensure_init();
  if (nested()) {
    hd_nested_free(p);
    return;
  }
  hd_hook_enter();
  hd_free_recorded(p);
  hd_hook_leave();
}

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

EXPORT void *realloc(void *p, size_t size) {
  if (!p) return malloc(size);
  if (size == 0) { /* glibc: frees and returns NULL */
    free(p);
    return NULL;
  }
  hd_ensure_init();
  if (nested()) return hd_nested_realloc(p, size);
  hd_hook_enter();
  void *q = hd_realloc_recorded(p, size);
  hd_hook_leave(); /* keeps errno */
  return q;
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
  hd_ensure_init();
  return hd_backend_usable(p);
}

/* Module changes: rescan executable regions after the loader is done (loader lock released).
 * The real functions are looked up once, off the allocation path. */
EXPORT void *dlopen(const char *file, int mode) {
  static void *(*real)(const char *, int);
  if (!real) real = (void *(*)(const char *, int))dlsym(RTLD_NEXT, "dlopen");
  void *h = real ? real(file, mode) : NULL;
  if (h) hd_rescan_regions();
  return h;
}

EXPORT int dlclose(void *handle) {
  static int (*real)(void *);
  if (!real) real = (int (*)(void *))dlsym(RTLD_NEXT, "dlclose");
  int rc = real ? real(handle) : -1;
  hd_rescan_regions();
  return rc;
}

/* libunwind validates the addresses it reads by writing them to a pipe that it creates on its
 * first walk, and re-creates (closing the old numbers) whenever a read from it fails. A program
 * that closes every descriptor and opens its own files would get those numbers: libunwind would
 * then read from, write into and close the program's files. So inside our capture the pipe is
 * the library's: moved to high numbers and remembered by identity, and there read, write and
 * close act only on its two ends while they are still that pipe; anything else fails with EBADF
 * (an address that cannot be validated ends the trace there). Calls from anywhere else go
 * straight to glibc, after one thread-local test. */
static hd_owned_fd g_unwind_pipe[2] = {HD_OWNED_FD_NONE, HD_OWNED_FD_NONE};
static int g_unwind_pipe_lock; /* libunwind's own pipe is shared by every thread */

static void unwind_pipe_lock(void) {
  while (__atomic_exchange_n(&g_unwind_pipe_lock, 1, __ATOMIC_ACQUIRE)) __builtin_ia32_pause();
}

static void unwind_pipe_unlock(void) { __atomic_store_n(&g_unwind_pipe_lock, 0, __ATOMIC_RELEASE); }

/* Whether fd is still the given end of the unwinder's pipe; forget: it is being closed. */
static bool is_unwind_pipe(int fd, int end, bool forget) {
  unwind_pipe_lock();
  bool ours = false;
  for (int i = 0; i < 2; i++) {
    if ((end < 0 || end == i) && g_unwind_pipe[i].fd == fd && fd >= 0) {
      ours = hd_owned_fd_valid(&g_unwind_pipe[i]);
      if (forget) g_unwind_pipe[i] = HD_OWNED_FD_NONE;
    }
  }
  unwind_pipe_unlock();
  return ours;
}

/* A call made by libunwind itself while this thread unwinds (a signal handler of the program
 * that interrupted the capture makes its own calls, which go through). */
static inline bool libunwind_call(void *return_address) {
  return hd_called_from_unwinder((uintptr_t)return_address);
}

extern int __close(int fd);
extern ssize_t __read(int fd, void *buf, size_t n);
extern ssize_t __write(int fd, const void *buf, size_t n);

EXPORT int pipe2(int fds[2], int flags) {
  int rc = (int)syscall(SYS_pipe2, fds, flags);
  if (HD_UNLIKELY(hd_tls.in_unwind != 0) && rc == 0 &&
      hd_called_from_unwinder((uintptr_t)__builtin_return_address(0))) {
    hd_owned_fd ends[2];
    if (!hd_owned_fd_take(fds[0], &ends[0])) {
      (void)__close(fds[1]);
      errno = EMFILE;
      return -1;
    }
    if (!hd_owned_fd_take(fds[1], &ends[1])) {
      hd_owned_fd_close(&ends[0]);
      errno = EMFILE;
      return -1;
    }
    fds[0] = ends[0].fd;
    fds[1] = ends[1].fd;
    unwind_pipe_lock();
    g_unwind_pipe[0] = ends[0];
    g_unwind_pipe[1] = ends[1];
    unwind_pipe_unlock();
  }
  return rc;
}

EXPORT int close(int fd) {
  if (HD_UNLIKELY(hd_tls.in_unwind != 0) && libunwind_call(__builtin_return_address(0)) &&
      !is_unwind_pipe(fd, -1, true)) {
    errno = EBADF;
    return -1;
  }
  return __close(fd);
}

EXPORT ssize_t read(int fd, void *buf, size_t n) {
  if (HD_UNLIKELY(hd_tls.in_unwind != 0) && libunwind_call(__builtin_return_address(0)) &&
      !is_unwind_pipe(fd, 0, false)) {
    errno = EBADF;
    return -1;
  }
  return __read(fd, buf, n);
}

EXPORT ssize_t write(int fd, const void *buf, size_t n) {
  if (HD_UNLIKELY(hd_tls.in_unwind != 0) && libunwind_call(__builtin_return_address(0)) &&
      !is_unwind_pipe(fd, 1, false)) {
    errno = EBADF;
    return -1;
  }
  return __write(fd, buf, n);
}

/* Thread names: renames bump a generation that each thread compares (one load) before using
 * its cached thread info, so no allocation makes a syscall to learn its thread's name. */
EXPORT int prctl(int option, ...) {
  va_list ap;
  va_start(ap, option);
  unsigned long a2 = va_arg(ap, unsigned long), a3 = va_arg(ap, unsigned long),
                a4 = va_arg(ap, unsigned long), a5 = va_arg(ap, unsigned long);
  va_end(ap);
  long rc = syscall(SYS_prctl, option, a2, a3, a4, a5);
  if (option == PR_SET_NAME && rc == 0) hd_note_rename();
  return (int)rc;
}

EXPORT int pthread_setname_np(pthread_t thread, const char *name) {
  static int (*real)(pthread_t, const char *);
  if (!real) real = (int (*)(pthread_t, const char *))dlsym(RTLD_NEXT, "pthread_setname_np");
  int rc = real ? real(thread, name) : ENOSYS;
  if (rc == 0) hd_note_rename();
  return rc;
}
