/* Counts the process's calls of dl_iterate_phdr, which take the loader's lock. Preloaded ahead of
 * libheapdump.so, so that the library's calls come here first; the program under test reads the
 * count with hd_test_loader_calls (unwind_child.cc, mode `loader`). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stddef.h>

typedef int (*iterate_fn)(int (*)(struct dl_phdr_info *, size_t, void *), void *);

static iterate_fn g_real;
static unsigned long g_calls;

int dl_iterate_phdr(int (*callback)(struct dl_phdr_info *, size_t, void *), void *data) {
  iterate_fn real = __atomic_load_n(&g_real, __ATOMIC_ACQUIRE);
  if (real == NULL) {
    real = (iterate_fn)dlsym(RTLD_NEXT, "dl_iterate_phdr");
    __atomic_store_n(&g_real, real, __ATOMIC_RELEASE);
  }
  __atomic_fetch_add(&g_calls, 1, __ATOMIC_RELAXED);
  return real(callback, data);
}

unsigned long hd_test_loader_calls(void) { return __atomic_load_n(&g_calls, __ATOMIC_RELAXED); }
