/* See owned_fd.h. Off the hot path: used when tables, connections and snapshots are made. */
#define _GNU_SOURCE
#include "owned_fd.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

/* The lowest number a library descriptor takes. Programs get the lowest free number, so ours
 * stay clear of the files they open. Half the soft limit, up to 512: above that the kernel
 * would grow the program's descriptor table (8 bytes per slot) only for us. */
static int high_floor(void) {
  struct rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur < 64) return 3;
  rlim_t half = limit.rlim_cur / 2;
  return half > 512 ? 512 : (int)half;
}

int hd_fd_move_high(int fd) {
  int floor = high_floor();
  if (fd < 0 || fd >= floor) return fd;
  int high = fcntl(fd, F_DUPFD_CLOEXEC, floor);
  if (high < 0) return fd;
  close(fd);
  return high;
}

bool hd_owned_fd_take(int fd, hd_owned_fd *out) {
  *out = HD_OWNED_FD_NONE;
  if (fd < 0) return false;
  fd = hd_fd_move_high(fd); /* if the high range is full it keeps its number, still identified */
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return false;
  }
  *out = (hd_owned_fd){.fd = fd, .dev = st.st_dev, .ino = st.st_ino};
  return true;
}

bool hd_owned_fd_valid(const hd_owned_fd *owned) {
  struct stat st;
  return owned->fd >= 0 && fstat(owned->fd, &st) == 0 && st.st_dev == owned->dev &&
         st.st_ino == owned->ino;
}

void hd_owned_fd_close(hd_owned_fd *owned) {
  if (hd_owned_fd_valid(owned)) close(owned->fd);
  *owned = HD_OWNED_FD_NONE;
}
