/* What the two tables' writers (alloc_table.c, res_table.c) share: a sealed, mapped memfd, the
 * clock, and shorthands for relaxed atomics. Private to instrumentation/src. */
#ifndef HEAPDUMP_INSTRUMENTATION_TABLE_MEMORY_H
#define HEAPDUMP_INSTRUMENTATION_TABLE_MEMORY_H

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "heapdump/contract/must_check.h"
#include "tables.h"

#define PAGE 4096u
#define ALIGN_UP(x, a) (((x) + (a)-1) & ~((uint64_t)(a)-1))
#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define HD_UNLIKELY_T(x) __builtin_expect(!!(x), 0)

static HD_MUST_CHECK inline int hd_table_memfd(const char *name, uint64_t size, void **map,
                                               hd_owned_fd *out) {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -errno;
  if (ftruncate(fd, (off_t)size) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    int e = -errno;
    close(fd);
    return e;
  }
  if (!hd_owned_fd_take(fd, out)) return -EBADF;
  void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, out->fd, 0);
  if (m == MAP_FAILED) {
    int e = -errno;
    hd_owned_fd_close(out);
    return e;
  }
  *map = m;
  return 0;
}

static inline uint64_t hd_table_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#endif /* HEAPDUMP_INSTRUMENTATION_TABLE_MEMORY_H */
