/* The calls besides the allocation family that the library interposes, only to notice what
 * its records depend on: modules loaded and unloaded (dlopen, dlclose: executable regions and
 * the unwinder's module list) and threads renamed (prctl, pthread_setname_np). Each forwards to
 * the real call first. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include "raw_syscall.h"
#include "runtime.h"
#include "stack.h"

#define EXPORT __attribute__((visibility("default")))

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
  const bool counted = hd_stack_modules_closing();
  int rc = real ? real(handle) : -1;
  hd_stack_modules_closed(counted);
  hd_rescan_regions();
  return rc;
}

/* Thread names: renames bump a generation that each thread compares (one load) before using
 * its cached thread info, so no allocation makes a syscall to learn its thread's name. */
EXPORT int prctl(int option, ...) {
  va_list ap;
  va_start(ap, option);
  unsigned long a2 = va_arg(ap, unsigned long), a3 = va_arg(ap, unsigned long),
                a4 = va_arg(ap, unsigned long), a5 = va_arg(ap, unsigned long);
  va_end(ap);
  long rc = hd_raw_syscall6(SYS_prctl, option, (long)a2, (long)a3, (long)a4, (long)a5, 0);
  if (rc < 0 && rc > -4096) { /* glibc's convention */
    errno = (int)-rc;
    return -1;
  }
  if (option == PR_SET_NAME) hd_note_rename();
  return (int)rc;
}

EXPORT int pthread_setname_np(pthread_t thread, const char *name) {
  static int (*real)(pthread_t, const char *);
  if (!real) real = (int (*)(pthread_t, const char *))dlsym(RTLD_NEXT, "pthread_setname_np");
  int rc = real ? real(thread, name) : ENOSYS;
  if (rc == 0) hd_note_rename();
  return rc;
}
