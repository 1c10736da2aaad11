/* Opening the arm page's file (contract/arm_page.h), creating it when it does not exist yet.
 *
 * Whoever comes first makes it: the collector at its start, or a dormant process started before
 * any collector ran (a service started at boot ahead of the collector's own unit, /run being
 * emptied at every boot). Either way the file is created complete — a temporary file, filled,
 * then linked into place — so nobody maps a short or half-written page, and a second creator
 * racing the first finds the first one's file and uses it. A process that made the page maps the
 * same inode the collector opens later, which is all arming needs.
 *
 * Everything is relative to the directory's descriptor, opened by the caller without following
 * a symbolic link and checked: a directory swapped for a link after the check cannot redirect
 * the file. Needs _GNU_SOURCE (O_TMPFILE) before the first system header. No allocation: the
 * library calls it from its initialisation. */
#ifndef HEAPDUMP_CONTRACT_ARM_PAGE_FILE_H
#define HEAPDUMP_CONTRACT_ARM_PAGE_FILE_H

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "heapdump/contract/arm_page.h"
#include "heapdump/contract/must_check.h"

/* The directory of the arm page at `path` opened (O_DIRECTORY, never through a symbolic link;
 * with make, first made private whatever the umask, as the collector makes its socket's), and
 * in *name the page's name in it. A descriptor, or -errno. */
static HD_MUST_CHECK inline int hd_arm_page_dir_open(const char *path, bool make,
                                                     const char **name) {
  char dir[128]; /* a socket's path fits in sun_path's 108 bytes */
  const char *slash = strrchr(path, '/');
  *name = slash != NULL ? slash + 1 : path;
  const size_t length = slash == NULL ? 0 : slash == path ? 1 : (size_t)(slash - path);
  if (length >= sizeof dir) return -ENAMETOOLONG;
  if (length == 0) {
    dir[0] = '.';
    dir[1] = '\0';
  } else {
    memcpy(dir, path, length);
    dir[length] = '\0';
  }
  /* Opened first: it is there at nearly every start of a dormant process, and a mkdir that
   * fails costs a syscall there. */
  int fd = openat(AT_FDCWD, dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT && make) {
    if (mkdir(dir, 0700) == 0) (void)chmod(dir, 0700); /* a umask of 0477: unreadable */
    fd = openat(AT_FDCWD, dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  }
  return fd >= 0 ? fd : -errno;
}

/* The start of a temporary page's name. A creator links it to the page's name, then unlinks it,
 * within its one call; one found older than HD_ARM_PAGE_TEMPORARY_ABANDONED seconds was left by a
 * creator killed midway, and the collector removes it. */
#define HD_ARM_PAGE_TEMPORARY ".arm-page"
#define HD_ARM_PAGE_TEMPORARY_ABANDONED 60

/* hd_arm_page_file_open, which tries again at most tries_left times when another creator's page
 * or the loss of its own temporary gets in the way. */
static HD_MUST_CHECK inline int hd_arm_page_file_open_try(int dir_fd, const char *name, int access,
                                                          int tries_left) {
  int fd = openat(dir_fd, name, access | O_CLOEXEC | O_NOFOLLOW);
  if (fd >= 0 || errno != ENOENT) return fd >= 0 ? fd : -errno;
  /* An unnamed file; where the file system has none (overlayfs before Linux 6.6, NFS), a named
   * one, linked to the page's name once filled, then unnamed again. Its name is this process's
   * pid and the clock's nanoseconds: processes of other pid namespaces may share the pid. */
  char temporary[64] = "";
  fd = openat(dir_fd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0644);
  for (int tries = 0; fd < 0 && tries < 4; tries++) {
    if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL && errno != EEXIST) break;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    snprintf(temporary, sizeof temporary, HD_ARM_PAGE_TEMPORARY ".%ld.%lld.%ld", (long)getpid(),
             (long long)now.tv_sec, now.tv_nsec);
    fd = openat(dir_fd, temporary, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0644);
  }
  if (fd < 0) return -errno;
  /* Zeros but for the magic and version: every slot free, generation 0. */
  const uint32_t head[2] = {HD_ARM_PAGE_MAGIC, HD_ARM_PAGE_VERSION};
  char proc_path[64];
  snprintf(proc_path, sizeof proc_path, "/proc/self/fd/%d", fd);
  const bool linked =
      ftruncate(fd, HD_ARM_PAGE_BYTES) == 0 &&
      pwrite(fd, head, sizeof head, 0) == (ssize_t)sizeof head && fchmod(fd, 0644) == 0 &&
      (temporary[0] != '\0' ? linkat(dir_fd, temporary, dir_fd, name, 0)
                            : linkat(AT_FDCWD, proc_path, dir_fd, name, AT_SYMLINK_FOLLOW)) == 0;
  const int err = errno;
  if (temporary[0] != '\0') (void)unlinkat(dir_fd, temporary, 0);
  if (!linked) {
    close(fd);
    /* Another creator linked its page first: use that one. Or this creator, stopped for a
     * minute before linking, had its temporary taken for abandoned: make another. */
    const bool again = err == EEXIST || (err == ENOENT && temporary[0] != '\0');
    return again && tries_left > 0 ? hd_arm_page_file_open_try(dir_fd, name, access, tries_left - 1)
                                   : -err;
  }
  return fd;
}

/* The arm page file `name` in directory dir_fd, opened with access (O_RDONLY or O_RDWR;
 * O_CLOEXEC, never through a symbolic link), or created mode 0644, initialised, and opened
 * read-write when it does not exist. A descriptor, or -errno. */
static HD_MUST_CHECK inline int hd_arm_page_file_open(int dir_fd, const char *name, int access) {
  return hd_arm_page_file_open_try(dir_fd, name, access, 4);
}

#endif /* HEAPDUMP_CONTRACT_ARM_PAGE_FILE_H */
