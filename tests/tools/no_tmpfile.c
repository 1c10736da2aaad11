/* For dormant_test: a file system without unnamed temporary files (overlayfs before Linux 6.6,
 * NFS, 9p), preloaded ahead of libheapdump.so: openat with O_TMPFILE fails as it does there. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <sys/types.h>

typedef int (*openat_fn)(int, const char *, int, ...);

int openat(int dir_fd, const char *path, int flags, ...) {
  static openat_fn real;
  if (real == NULL) real = (openat_fn)dlsym(RTLD_NEXT, "openat");
  mode_t mode = 0;
  if ((flags & O_CREAT) != 0 || (flags & O_TMPFILE) == O_TMPFILE) {
    va_list ap;
    va_start(ap, flags);
    mode = va_arg(ap, mode_t);
    va_end(ap);
  }
  if ((flags & O_TMPFILE) == O_TMPFILE) {
    errno = EOPNOTSUPP;
    return -1;
  }
  return real(dir_fd, path, flags, mode);
}
