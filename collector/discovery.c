/* Rediscovery: finds instrumented processes that are not registered with this collector (started
 * before it, or while it was down, or whose registration failed) by their memfds.
 *
 * libheapdump.so keeps its two tables open as memfds named heapdump-allocations and
 * heapdump-resources (instrumentation/src/lifecycle.c). A scan walks /proc/PID/fd of every
 * process this collector may serve (its own uid, every uid when root), and adopts a process
 * whose links name exactly one table of each kind, and whose own socket path (computed from its
 * environment as the library computes it) is this collector's: a process belongs to the
 * collector it would register with. The tables are opened read-only through /proc/PID/fd/N and
 * validated like a registration's, plus their header pid: a forked child still holding its
 * parent's tables, or a parent in the middle of fork() holding copies, is left for a later scan.
 * The process's exit is watched with a pidfd, opened before the tables are checked one last time
 * through /proc, so the pidfd cannot name a later process that reused the pid. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "collector_internal.h"

#define SCAN_INTERVAL_NS 1000000000u
/* /proc/PID/environ is bounded by the kernel's argument limit; this is well above it. */
#define MAX_ENVIRON_BYTES (16u << 20)

static const char kAllocationsName[] = HD_MEMFD_ALLOCATIONS;
static const char kResourcesName[] = HD_MEMFD_RESOURCES;

pid_t hd_own_pid(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "re");
  if (f == NULL) return -1;
  char line[256];
  pid_t own = pid; /* a kernel without NSpid (before 4.1) has no PID namespaces to tell */
  bool found = false;
  while (!found && fgets(line, sizeof line, f) != NULL) {
    if (strncmp(line, "NSpid:", 6) != 0) continue;
    found = true;
    /* Outermost (ours, when we run in the initial namespace) first, innermost last. */
    char *rest = NULL;
    for (char *field = strtok_r(line + 6, " \t\n", &rest); field != NULL;
         field = strtok_r(NULL, " \t\n", &rest)) {
      own = (pid_t)atoi(field);
    }
  }
  fclose(f);
  return own > 0 ? own : -1;
}

int hd_pidfd_open(pid_t pid) {
#ifdef SYS_pidfd_open
  return (int)syscall(SYS_pidfd_open, pid, 0); /* always close-on-exec */
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

/* A link target of /proc/PID/fd/N naming a memfd called `name` (any memfd if name is NULL):
 * "/memfd:NAME (deleted)". */
static bool link_names_memfd(const char *target, const char *name) {
  static const char prefix[] = "/memfd:";
  if (strncmp(target, prefix, sizeof prefix - 1) != 0) return false;
  if (name == NULL) return true;
  const char *rest = target + sizeof prefix - 1;
  size_t len = strlen(name);
  return strncmp(rest, name, len) == 0 &&
         (rest[len] == '\0' || strcmp(rest + len, " (deleted)") == 0);
}

bool hd_fd_is_memfd(int fd, const char *name) {
  char link[64], target[256];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof target - 1);
  if (n <= 0) return false;
  target[n] = '\0';
  return link_names_memfd(target, name);
}

hd_tables_verdict hd_open_process_tables(int alloc_fd, int res_fd, bool by_name, pid_t own_pid,
                                         hd_alloc_reader **alloc, hd_res_reader **res,
                                         struct stat *table, const char **why) {
  *alloc = NULL;
  *res = NULL;
  hd_read_status rs = HD_READ_OK;
  hd_alloc_table_info info;
  hd_tables_verdict verdict = HD_TABLES_OK;
  if (!hd_fd_is_memfd(alloc_fd, by_name ? kAllocationsName : NULL) ||
      !hd_fd_is_memfd(res_fd, by_name ? kResourcesName : NULL)) {
    verdict = HD_TABLES_NOT_MEMFDS;
    *why = by_name ? "its descriptors are not its tables (any more)" : "not memfds";
  } else if ((fcntl(alloc_fd, F_GETFL) & O_ACCMODE) != O_RDONLY ||
             (fcntl(res_fd, F_GETFL) & O_ACCMODE) != O_RDONLY) {
    verdict = HD_TABLES_WRITABLE;
    *why = "handed over writable (they must be read-only)";
  } else if ((rs = hd_alloc_reader_open(alloc_fd, alloc)) != HD_READ_OK ||
             (rs = hd_res_reader_open(res_fd, res)) != HD_READ_OK) {
    verdict = HD_TABLES_UNREADABLE;
    *why = hd_read_status_str(rs);
  } else if (hd_alloc_reader_info(*alloc, &info) != HD_READ_OK || info.pid != (uint32_t)own_pid ||
             hd_res_reader_pid(*res) != (uint32_t)own_pid) {
    verdict = HD_TABLES_OTHER_PROCESS;
    *why = "the tables are another process's";
  } else if (fstat(alloc_fd, table) != 0) {
    verdict = HD_TABLES_NO_IDENTITY;
    *why = "cannot stat the allocations table";
  }
  if (verdict != HD_TABLES_OK) {
    hd_alloc_reader_close(*alloc);
    hd_res_reader_close(*res);
    *alloc = NULL;
    *res = NULL;
  }
  return verdict;
}

int hd_socket_identity(const char *path, const char *cwd, char *out, size_t size) {
  char absolute[PATH_MAX + 128];
  char here[PATH_MAX];
  if (path[0] != '/') {
    if (cwd == NULL) cwd = getcwd(here, sizeof here);
    if (cwd == NULL) return -errno;
    if (snprintf(absolute, sizeof absolute, "%s/%s", cwd, path) >= (int)sizeof absolute) {
      return -ENAMETOOLONG;
    }
  } else if (snprintf(absolute, sizeof absolute, "%s", path) >= (int)sizeof absolute) {
    return -ENAMETOOLONG;
  }
  /* The directory resolved (symbolic links, "..") when it exists; the name as it is. */
  char *slash = strrchr(absolute, '/');
  *slash = '\0';
  char resolved[PATH_MAX];
  const char *dir =
      realpath(absolute[0] != '\0' ? absolute : "/", resolved) != NULL ? resolved : absolute;
  int n = snprintf(out, size, "%s/%s", strcmp(dir, "/") == 0 ? "" : dir, slash + 1);
  return n < 0 || (size_t)n >= size ? -ENAMETOOLONG : 0;
}

/* The whole of /proc/PID/<name>, NUL-terminated (the terminator is not counted in *size). */
static char *read_proc_file(pid_t pid, const char *name, size_t max, size_t *size) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, name);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NULL;
  size_t capacity = 4096, used = 0;
  char *buf = malloc(capacity + 1);
  while (buf != NULL) {
    if (used == capacity) {
      if (capacity >= max) break;
      char *grown = realloc(buf, capacity * 2 + 1);
      if (grown == NULL) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = grown;
      capacity *= 2;
    }
    ssize_t n = read(fd, buf + used, capacity - used);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      free(buf);
      buf = NULL;
    }
    if (n <= 0) break;
    used += (size_t)n;
  }
  close(fd);
  if (buf != NULL) {
    buf[used] = '\0';
    *size = used;
  }
  return buf;
}

/* The value of variable `name` in an environ block (NUL-separated NAME=VALUE entries). */
static const char *env_value(const char *env, size_t size, const char *name) {
  size_t len = strlen(name);
  for (size_t at = 0; at < size; at += strlen(env + at) + 1) {
    if (strncmp(env + at, name, len) == 0 && env[at + len] == '=') return env + at + len + 1;
  }
  return NULL;
}

static bool real_uid_of(pid_t pid, unsigned *uid) {
  size_t size;
  char *status = read_proc_file(pid, "status", 1 << 16, &size);
  if (status == NULL) return false;
  const char *line = strstr(status, "\nUid:");
  bool ok = line != NULL && sscanf(line + 5, "%u", uid) == 1;
  free(status);
  return ok;
}

/* Whether the process would register with this collector: the socket path libheapdump.so
 * computes from the process's environment (instrumentation/src/registration.c) is ours. */
static bool would_register_here(hd_collector *c, pid_t pid, const char *env, size_t env_size) {
  char path[PATH_MAX];
  unsigned uid;
  const bool uid_known = real_uid_of(pid, &uid);
  if (hd_socket_path(env_value(env, env_size, HD_ENV_SOCKET),
                     env_value(env, env_size, HD_ENV_RUNTIME_DIR), uid_known ? &uid : NULL, path,
                     sizeof path) != 0)
    return false;
  char cwd_link[64], cwd[PATH_MAX];
  snprintf(cwd_link, sizeof cwd_link, "/proc/%d/cwd", (int)pid);
  ssize_t n = readlink(cwd_link, cwd, sizeof cwd - 1);
  if (n <= 0 && path[0] != '/') return false;
  cwd[n > 0 ? n : 0] = '\0';
  char identity[sizeof c->socket_identity];
  return hd_socket_identity(path, cwd, identity, sizeof identity) == 0 &&
         strcmp(identity, c->socket_identity) == 0;
}

/* The fd numbers of the process's two tables; false unless there is exactly one of each. */
static bool find_tables(pid_t pid, int *alloc_fd, int *res_fd) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  if (d == NULL) return false;
  int allocations = 0, resources = 0;
  struct dirent *entry;
  while ((entry = readdir(d)) != NULL) {
    if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
    char target[256];
    ssize_t n = readlinkat(dirfd(d), entry->d_name, target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (link_names_memfd(target, kAllocationsName)) {
      allocations++;
      *alloc_fd = atoi(entry->d_name);
    } else if (link_names_memfd(target, kResourcesName)) {
      resources++;
      *res_fd = atoi(entry->d_name);
    }
  }
  closedir(d);
  return allocations == 1 && resources == 1;
}

static bool same_file(const struct stat *a, const struct stat *b) {
  return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

/* Opens, validates and watches the tables of pid; adds the process to the live set. */
static void adopt(hd_collector *c, pid_t pid, uid_t uid, int alloc_num, int res_num,
                  bool exit_snapshot) {
  char alloc_path[64], res_path[64];
  snprintf(alloc_path, sizeof alloc_path, "/proc/%d/fd/%d", (int)pid, alloc_num);
  snprintf(res_path, sizeof res_path, "/proc/%d/fd/%d", (int)pid, res_num);
  int alloc_fd = open(alloc_path, O_RDONLY | O_CLOEXEC);
  int res_fd = open(res_path, O_RDONLY | O_CLOEXEC);
  hd_alloc_reader *alloc = NULL;
  hd_res_reader *res = NULL;
  struct stat table, again;
  int pidfd = -1;
  pid_t own_pid = -1;
  hd_tables_verdict verdict;
  const char *refused = NULL; /* why, for the log */
  bool expected = false;      /* a refusal that is no sign of a hostile or broken process */
  if (alloc_fd < 0 || res_fd < 0) {
    refused = "its tables are gone";
    expected = true;
  } else if ((own_pid = hd_own_pid(pid)) <= 0) {
    refused = "it exited";
    expected = true;
  } else if ((verdict = hd_open_process_tables(alloc_fd, res_fd, true, own_pid, &alloc, &res,
                                               &table, &refused)) != HD_TABLES_OK) {
    /* Its descriptors changed, or it is a fork child still holding its parent's tables. */
    expected = verdict == HD_TABLES_NOT_MEMFDS || verdict == HD_TABLES_OTHER_PROCESS;
  } else if ((pidfd = hd_pidfd_open(pid)) < 0) {
    refused = "cannot watch its exit (pidfd_open failed)";
  } else if (stat(alloc_path, &again) != 0 || !same_file(&table, &again)) {
    refused = "it exited";
    expected = true;
  }
  if (alloc_fd >= 0) close(alloc_fd);
  if (res_fd >= 0) close(res_fd);
  if (refused != NULL) {
    hd_log(c, expected ? HD_LOG_DEBUG : HD_LOG_WARN, "not adopting pid %u: %s", (unsigned)pid,
           refused);
    hd_alloc_reader_close(alloc);
    hd_res_reader_close(res);
    if (pidfd >= 0) close(pidfd);
    return;
  }
  char name[HD_NAME_SIZE];
  if (!hd_read_process_name(pid, name, sizeof name)) {
    snprintf(name, sizeof name, "pid%u", (unsigned)pid);
  }
  hd_process *p = hd_process_new(pid, own_pid, uid, name, exit_snapshot, table.st_dev, table.st_ino,
                                 pidfd, alloc, res);
  if (p == NULL) {
    hd_alloc_reader_close(alloc);
    hd_res_reader_close(res);
    close(pidfd);
    return;
  }
  bool absorbed;
  hd_process *entry = hd_live_set_add(c, p, false, &absorbed);
  if (entry == NULL) {
    hd_log(c, HD_LOG_WARN, "not adopting %s[%u]: too many processes", name, (unsigned)pid);
    return;
  }
  if (!absorbed) {
    hd_log(c, HD_LOG_INFO, "found %s[%u], which did not register%s", name, (unsigned)pid,
           exit_snapshot ? " (exit snapshot on)" : "");
    hd_wake_poll_thread(c); /* to watch its pidfd */
  }
  hd_process_release(entry);
}

static void examine(hd_collector *c, pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d", (int)pid);
  struct stat owner;
  if (stat(path, &owner) != 0) return;
  uid_t self = getuid();
  if (self != 0 && owner.st_uid != self) return;
  int alloc_num = -1, res_num = -1;
  if (!find_tables(pid, &alloc_num, &res_num)) return;
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, alloc_num);
  struct stat table;
  if (stat(path, &table) != 0 || hd_process_known(c, pid, table.st_dev, table.st_ino)) return;
  size_t env_size;
  char *env = read_proc_file(pid, "environ", MAX_ENVIRON_BYTES, &env_size);
  if (env == NULL) return;
  bool ours = would_register_here(c, pid, env, env_size);
  const char *exit_option = env_value(env, env_size, HD_ENV_EXIT_SNAPSHOT);
  bool exit_snapshot = exit_option != NULL && strcmp(exit_option, "1") == 0;
  free(env);
  if (!ours) {
    hd_log(c, HD_LOG_DEBUG, "pid %u is instrumented for another collector's socket", (unsigned)pid);
    return;
  }
  adopt(c, pid, owner.st_uid, alloc_num, res_num, exit_snapshot);
}

static void scan(hd_collector *c) {
  DIR *proc = opendir("/proc");
  if (proc == NULL) {
    hd_log(c, HD_LOG_WARN, "cannot scan /proc for instrumented processes: %s", strerror(errno));
    return;
  }
  pid_t self = getpid();
  struct dirent *entry;
  while ((entry = readdir(proc)) != NULL) {
    char *end;
    long pid = strtol(entry->d_name, &end, 10);
    if (*end != '\0' || pid <= 0 || pid > INT_MAX || pid == self) continue;
    examine(c, (pid_t)pid);
  }
  closedir(proc);
}

void hd_discover_processes(hd_collector *c, bool force) {
  pthread_mutex_lock(&c->scan_lock);
  uint64_t now = hd_monotonic_ns();
  if (force || !c->scanned || now - c->last_scan_ns >= SCAN_INTERVAL_NS) {
    /* Dated from its start: a process that appeared during the scan may have been missed. */
    c->last_scan_ns = now;
    c->scanned = true;
    scan(c);
  }
  pthread_mutex_unlock(&c->scan_lock);
}
