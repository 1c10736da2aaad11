/* heapdump-collector: the daemon instrumented processes register with and clients ask for
 * snapshots.
 *
 * Detaching forks before the collector exists: its threads (storage workers) must be created in
 * the process that serves, since a fork keeps only the thread that called it. The parent waits
 * until the daemon listens, so "started" means "reachable", and reports its pid or its error. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "heapdump/collector.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/contract/names.h"
#include "heapdump/heapdump.h"
#include "http.h"

/* Defaults of the storage caps: a daemon left running for weeks must not fill the disk. */
#define DEFAULT_MAX_STORED 1000
#define DEFAULT_MAX_STORAGE_BYTES ((uint64_t)1 << 30)
/* A log bigger than this at start-up is moved aside (one old generation is kept). */
#define LOG_ROTATE_BYTES ((off_t)16 << 20)
/* How long --stop waits for the daemon to finish its stored snapshots and exit. */
#define STOP_WAIT_SECONDS 15

static hd_collector *volatile running;
/* A stop asked for before the collector could serve: it stops as soon as it can. */
static volatile sig_atomic_t stop_early;

static void on_signal(int sig) {
  (void)sig;
  hd_collector *c = running;
  if (c != NULL) {
    hd_collector_stop(c);
  } else {
    stop_early = 1;
  }
}

/* Bounds of --sample-interval: below 10 ms the series would fill in seconds and be thinned at
 * once; above a minute it says little. */
#define MIN_SAMPLE_INTERVAL_MS 10
#define MAX_SAMPLE_INTERVAL_MS 60000

static void usage(FILE *out) {
  fprintf(out,
          "usage: heapdump-collector [--socket PATH] [--storage DIR] [--max-stored N]\n"
          "                          [--max-storage-bytes B] [--foreground] [--log-file FILE]\n"
          "                          [--log-level L] [--idle-timeout S] [--read-timeout S]\n"
          "                          [--max-contents-bytes B] [--sample-interval MS]\n"
          "                          [--trigger-live-bytes B] [--trigger-limit-percent P]\n"
          "                          [--http ADDR:PORT [--http-token-file FILE]]\n"
          "       heapdump-collector --stop [--socket PATH]\n"
          "\n"
          "Serves heap snapshots of processes running with libheapdump.so preloaded. It detaches\n"
          "once it listens, prints its pid, and writes it to a pid file beside the socket\n"
          "(collector.sock -> collector.pid).\n"
          "  --socket PATH          listen here (default: $HEAPDUMP_SOCKET, else\n"
          "                         $XDG_RUNTIME_DIR/heapdump/collector.sock, else\n"
          "                         /tmp/heapdump-$UID/collector.sock)\n"
          "  --storage DIR          stored snapshots (default: $XDG_STATE_HOME/heapdump, else\n"
          "                         ~/.local/state/heapdump)\n"
          "  --max-stored N         keep at most N stored snapshots of each user, evicting\n"
          "                         their oldest (default %d; 0: no limit)\n"
          "  --max-storage-bytes B  keep at most B bytes of stored snapshots of each user\n"
          "                         (default %llu, 1 GiB; 0: no limit)\n"
          "  --foreground           stay attached; logs go to stderr (for systemd and terminals)\n"
          "  --log-file FILE        write the log here (default when detached: beside the socket,\n"
          "                         collector.sock -> collector.log)\n"
          "  --log-level L          error, warn, info (default) or debug\n"
          "  --idle-timeout S       close client connections and listings idle for S seconds\n"
          "                         (default %d; a second when connections run short)\n"
          "  --read-timeout S       give up reading a process's table after S seconds (its\n"
          "                         snapshot fails; default %d)\n"
          "  --max-contents-bytes B at most B bytes of block contents per process in a\n"
          "                         snapshot with contents; later blocks go without (default\n"
          "                         %llu, 1 GiB; 0: no limit)\n"
          "  --sample-interval MS   sample each process's live and total bytes and blocks every\n"
          "                         MS milliseconds (%d to %d; default %d; 0: never): the\n"
          "                         memory-over-time series its snapshots carry\n"
          "  --trigger-live-bytes B store a snapshot named \"" HD_TRIGGER_SNAPSHOT_NAME
          "\" of a\n"
          "                         process whose live bytes reach B, checked at every sample;\n"
          "                         again once they fell below 9/10 of B (default 0: never)\n"
          "  --trigger-limit-percent P  the same at P%% of the memory limit of the process's\n"
          "                         cgroup (1 to 100; the lower threshold wins; default 0: never)\n"
          "  --http ADDR:PORT       also serve over HTTP: Prometheus /metrics, pprof heap\n"
          "                         profiles at /debug/pprof/heap and per process, /targets\n"
          "                         for service discovery (docs/fleet.md). Off by default\n"
          "  --http-token-file FILE every HTTP request must bear this file's token\n"
          "                         (Authorization: Bearer); needed unless ADDR is loopback\n"
          "  --stop                 stop the collector at the socket: SIGTERM to the pid in its\n"
          "                         pid file, then wait until it has exited (up to %d s)\n"
          "  --version              print the version\n",
          DEFAULT_MAX_STORED, (unsigned long long)DEFAULT_MAX_STORAGE_BYTES,
          HD_DEFAULT_IDLE_TIMEOUT_SECONDS, HD_DEFAULT_READ_TIMEOUT_SECONDS,
          (unsigned long long)HD_DEFAULT_MAX_CONTENTS_BYTES, MIN_SAMPLE_INTERVAL_MS,
          MAX_SAMPLE_INTERVAL_MS, HD_DEFAULT_SAMPLE_INTERVAL_MS, STOP_WAIT_SECONDS);
}

/* A decimal count in [0, max]: no sign, no suffix, no overflow. */
static bool parse_count(const char *text, unsigned long long max, unsigned long long *out) {
  if (text[0] < '0' || text[0] > '9') return false;
  char *end;
  errno = 0;
  *out = strtoull(text, &end, 10);
  return errno == 0 && *end == '\0' && *out <= max;
}

static HD_MUST_CHECK int parse_level(const char *s) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; i++) {
    if (strcmp(s, names[i]) == 0) return i;
  }
  return -1;
}

/* The daemon changes to "/": relative paths given on the command line are made absolute first. */
static bool make_absolute(const char *path, char *out, size_t size) {
  if (path[0] == '/') return snprintf(out, size, "%s", path) < (int)size;
  char cwd[PATH_MAX];
  if (getcwd(cwd, sizeof cwd) == NULL) return false;
  return snprintf(out, size, "%s/%s", cwd, path) < (int)size;
}

/* FILE beside the socket: its name without a ".sock" suffix, then ext (collector.sock ->
 * collector.pid). */
static bool beside_socket(const char *socket_path, const char *ext, char *out, size_t size) {
  size_t n = strlen(socket_path);
  if (n > 5 && strcmp(socket_path + n - 5, ".sock") == 0) n -= 5;
  return snprintf(out, size, "%.*s%s", (int)n, socket_path, ext) < (int)size;
}

/* ---- the pid file ---- */

/* The daemon holds an exclusive lock on its pid file for as long as it runs, so a pid file
 * nobody holds is stale, whatever pid it names (pids are reused). */
static HD_MUST_CHECK int pid_file_create(const char *path) {
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    fprintf(stderr, "heapdump-collector: cannot create the pid file %s: %s\n", path,
            strerror(errno));
    return -1;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    fprintf(stderr, "heapdump-collector: %s is held by another collector\n", path);
    close(fd);
    return -1;
  }
  char text[32];
  int n = snprintf(text, sizeof text, "%d\n", (int)getpid());
  if (ftruncate(fd, 0) != 0 || pwrite(fd, text, (size_t)n, 0) != n) {
    fprintf(stderr, "heapdump-collector: cannot write the pid file %s: %s\n", path,
            strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

static void pid_file_remove(const char *path, int fd) {
  if (fd < 0) return;
  unlink(path); /* before the lock goes: no window where another daemon's file is unlinked */
  close(fd);
}

static HD_MUST_CHECK int stop_daemon(const char *socket_path) {
  char pid_path[PATH_MAX];
  if (!beside_socket(socket_path, ".pid", pid_path, sizeof pid_path)) return 2;
  int fd = open(pid_path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    fprintf(stderr, "heapdump-collector: no collector is running for %s (no pid file %s)\n",
            socket_path, pid_path);
    return 3;
  }
  if (flock(fd, LOCK_SH | LOCK_NB) == 0) {
    fprintf(stderr, "heapdump-collector: no collector is running for %s (stale pid file %s)\n",
            socket_path, pid_path);
    close(fd);
    return 3;
  }
  char text[32] = {0};
  ssize_t n = pread(fd, text, sizeof text - 1, 0);
  long pid = n > 0 ? strtol(text, NULL, 10) : 0;
  int pidfd = pid > 0 ? (int)syscall(SYS_pidfd_open, (pid_t)pid, 0) : -1;
  /* The lock still held after pidfd_open: the pidfd names the daemon, not a reused pid. */
  bool held = flock(fd, LOCK_SH | LOCK_NB) != 0;
  close(fd);
  if (pidfd < 0 || !held) {
    if (pidfd >= 0) close(pidfd);
    fprintf(stderr, "heapdump-collector: the collector for %s has just exited\n", socket_path);
    return 0;
  }
  if (syscall(SYS_pidfd_send_signal, pidfd, SIGTERM, NULL, 0) != 0) {
    fprintf(stderr, "heapdump-collector: cannot signal pid %ld: %s\n", pid, strerror(errno));
    close(pidfd);
    return errno == EPERM ? 6 : 1;
  }
  struct pollfd p = {.fd = pidfd, .events = POLLIN};
  int ready;
  do {
    ready = poll(&p, 1, STOP_WAIT_SECONDS * 1000);
  } while (ready < 0 && errno == EINTR);
  close(pidfd);
  if (ready <= 0) {
    fprintf(stderr, "heapdump-collector: pid %ld did not exit within %d s\n", pid,
            STOP_WAIT_SECONDS);
    return 1;
  }
  printf("heapdump-collector: stopped pid %ld\n", pid);
  return 0;
}

/* ---- detaching ---- */

/* Opens the log, moving a big one aside first. */
static HD_MUST_CHECK int open_log(const char *path) {
  struct stat st;
  if (stat(path, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > LOG_ROTATE_BYTES) {
    char old[PATH_MAX + 8];
    snprintf(old, sizeof old, "%s.old", path);
    rename(path, old);
  }
  int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    fprintf(stderr, "heapdump-collector: cannot open the log file %s: %s\n", path, strerror(errno));
  }
  return fd;
}

/* Appends what start_log holds to fd, and closes start_log. */
static void copy_start_log(int start_log, int fd) {
  if (start_log < 0) return;
  char buf[4096];
  ssize_t n;
  off_t offset = 0;
  while (fd >= 0 && (n = pread(start_log, buf, sizeof buf, offset)) > 0) {
    if (write(fd, buf, (size_t)n) != n) break;
    offset += n;
  }
  close(start_log);
}

/* Forks; the parent waits for the daemon's word and exits with 0 (it listens: its pid is
 * printed) or 1 (it failed: it printed why). Returns in the daemon with *ready_fd to write its
 * pid to once it listens. */
static void detach(int *ready_fd) {
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) {
    fprintf(stderr, "heapdump-collector: cannot detach: %s\n", strerror(errno));
    exit(1);
  }
  fflush(NULL);
  pid_t child = fork();
  if (child < 0) {
    fprintf(stderr, "heapdump-collector: cannot detach: %s\n", strerror(errno));
    exit(1);
  }
  if (child == 0) {
    close(pipefd[0]);
    setsid();
    *ready_fd = pipefd[1];
    return;
  }
  close(pipefd[1]);
  int pid = 0;
  ssize_t n;
  do {
    n = read(pipefd[0], &pid, sizeof pid);
  } while (n < 0 && errno == EINTR);
  if (n == (ssize_t)sizeof pid) exit(0);
  int status;
  while (waitpid(child, &status, 0) < 0 && errno == EINTR) continue;
  exit(1);
}

/* The daemon's last step before serving: stdio away from the terminal, the parent told. */
static void finish_detaching(int ready_fd, int log_fd, const char *socket_path,
                             const char *log_path) {
  int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null_fd >= 0) {
    dup2(null_fd, STDIN_FILENO);
    close(null_fd);
  }
  printf("heapdump-collector: pid %d, listening on %s, log %s\n", (int)getpid(), socket_path,
         log_path);
  fflush(stdout);
  dup2(log_fd, STDOUT_FILENO);
  dup2(log_fd, STDERR_FILENO);
  if (chdir("/") != 0) { /* keeps no directory busy; every path is absolute by now */
  }
  int pid = (int)getpid();
  if (write(ready_fd, &pid, sizeof pid) != (ssize_t)sizeof pid) { /* the parent is gone */
  }
  close(ready_fd);
}

/* A size limit option's bytes (0: no limit); false (and said why) otherwise. */
static bool parse_bytes(const char *option, const char *text, uint64_t *out) {
  unsigned long long bytes;
  if (!parse_count(text, UINT64_MAX, &bytes)) {
    fprintf(stderr, "heapdump-collector: bad --%s: %s (bytes, 0 for no limit)\n", option, text);
    return false;
  }
  *out = bytes;
  return true;
}

/* A timeout option's whole seconds, 1 to max; false (and said why) otherwise. */
static bool parse_seconds(const char *option, const char *text, unsigned max, uint32_t *out) {
  unsigned long long seconds;
  if (!parse_count(text, max, &seconds) || seconds == 0) {
    fprintf(stderr, "heapdump-collector: bad --%s: %s (seconds, 1 to %u)\n", option, text, max);
    return false;
  }
  *out = (uint32_t)seconds;
  return true;
}

/* The command line, parsed. */
typedef struct arguments {
  hd_collector_options options;
  bool foreground, stop;
  const char *log_file, *socket, *storage; /* NULL: not given */
  const char *http, *http_token_file;      /* NULL: not given */
} arguments;

/* parse_args's answer when the daemon goes on. */
#define CONTINUE (-1)

/* --sample-interval's value into o; false (said on stderr) if it is not one. */
static bool parse_sample_interval(const char *text, hd_collector_options *o) {
  unsigned long long ms;
  if (!parse_count(text, MAX_SAMPLE_INTERVAL_MS, &ms) || (ms != 0 && ms < MIN_SAMPLE_INTERVAL_MS)) {
    fprintf(stderr,
            "heapdump-collector: bad --sample-interval: %s (milliseconds, %d to %d; 0: never)\n",
            text, MIN_SAMPLE_INTERVAL_MS, MAX_SAMPLE_INTERVAL_MS);
    return false;
  }
  o->sample_interval_ms = (uint32_t)ms;
  o->no_sampling = ms == 0;
  return true;
}

/* Parses the command line into *a; CONTINUE, or the exit code to end with now (a usage error,
 * --help, --version). */
static HD_MUST_CHECK int parse_args(int argc, char **argv, arguments *a) {
  *a = (arguments){.options = {.log_level = HD_LOG_INFO,
                               .max_stored = DEFAULT_MAX_STORED,
                               .max_storage_bytes = DEFAULT_MAX_STORAGE_BYTES,
                               .max_contents_bytes = HD_DEFAULT_MAX_CONTENTS_BYTES}};
  static const struct option longopts[] = {{"socket", required_argument, 0, 's'},
                                           {"storage", required_argument, 0, 'd'},
                                           {"max-stored", required_argument, 0, 'n'},
                                           {"max-storage-bytes", required_argument, 0, 'b'},
                                           {"foreground", no_argument, 0, 'f'},
                                           {"log-level", required_argument, 0, 'l'},
                                           {"log-file", required_argument, 0, 'L'},
                                           {"stop", no_argument, 0, 'S'},
                                           {"version", no_argument, 0, 'V'},
                                           {"help", no_argument, 0, 'h'},
                                           {"idle-timeout", required_argument, 0, 'i'},
                                           {"read-timeout", required_argument, 0, 'r'},
                                           {"max-contents-bytes", required_argument, 0, 'c'},
                                           {"sample-interval", required_argument, 0, 'I'},
                                           {"http", required_argument, 0, 'H'},
                                           {"http-token-file", required_argument, 0, 'T'},
                                           {"trigger-live-bytes", required_argument, 0, 'B'},
                                           {"trigger-limit-percent", required_argument, 0, 'P'},
                                           {0, 0, 0, 0}};
  int opt;
  unsigned long long count;
  while ((opt = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    switch (opt) {
      case 's': a->socket = optarg; break;
      case 'd': a->storage = optarg; break;
      case 'n':
        if (!parse_count(optarg, UINT32_MAX, &count)) {
          fprintf(stderr, "heapdump-collector: bad --max-stored: %s (a count, 0 for no limit)\n",
                  optarg);
          return 2;
        }
        a->options.max_stored = (uint32_t)count;
        break;
      case 'b':
        if (!parse_bytes("max-storage-bytes", optarg, &a->options.max_storage_bytes)) return 2;
        break;
      case 'i':
        if (!parse_seconds("idle-timeout", optarg, 86400, &a->options.idle_timeout_seconds))
          return 2;
        break;
      case 'r':
        if (!parse_seconds("read-timeout", optarg, 3600, &a->options.read_timeout_seconds))
          return 2;
        break;
      case 'c':
        if (!parse_bytes("max-contents-bytes", optarg, &a->options.max_contents_bytes)) return 2;
        break;
      case 'I':
        if (!parse_sample_interval(optarg, &a->options)) return 2;
        break;
      case 'B':
        if (!parse_bytes("trigger-live-bytes", optarg, &a->options.trigger_live_bytes)) return 2;
        break;
      case 'P':
        if (!parse_count(optarg, 100, &count)) {
          fprintf(stderr,
                  "heapdump-collector: bad --trigger-limit-percent: %s (1 to 100; 0: never)\n",
                  optarg);
          return 2;
        }
        a->options.trigger_limit_percent = (uint32_t)count;
        break;
      case 'H': a->http = optarg; break;
      case 'T': a->http_token_file = optarg; break;
      case 'f': a->foreground = true; break;
      case 'L': a->log_file = optarg; break;
      case 'S': a->stop = true; break;
      case 'l':
        a->options.log_level = parse_level(optarg);
        if (a->options.log_level < 0) {
          fprintf(stderr, "heapdump-collector: bad --log-level: %s\n", optarg);
          return 2;
        }
        break;
      case 'V': printf("heapdump-collector %s\n", HEAPDUMP_VERSION_STRING); return 0;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (optind != argc) {
    usage(stderr);
    return 2;
  }
  if (a->http_token_file != NULL && a->http == NULL) {
    fprintf(stderr, "heapdump-collector: --http-token-file needs --http\n");
    return 2;
  }
  if ((a->options.trigger_live_bytes != 0 || a->options.trigger_limit_percent != 0) &&
      a->options.no_sampling) {
    fprintf(stderr,
            "heapdump-collector: a trigger is checked at every sample: it needs "
            "--sample-interval above 0\n");
    return 2;
  }
  return CONTINUE;
}

/* Signals and limits of the daemon process. Before the socket exists: a SIGTERM the moment a
 * client sees it listening must stop the collector cleanly (socket and pid file removed), not
 * kill it. */
static void prepare_process(void) {
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  /* A file-size limit (ulimit -f) must fail a store with EFBIG, not kill the daemon. */
  signal(SIGXFSZ, SIG_IGN);
  /* Connections, processes (a pidfd each) and queued streams hold a descriptor apiece, a few
   * thousand at most: the usual soft limit of 1024 is raised towards the hard one. */
  struct rlimit files;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < 65536 &&
      files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max < 65536 ? files.rlim_max : 65536;
    (void)setrlimit(RLIMIT_NOFILE, &files); /* best effort: the old limit still works */
  }
}

/* The daemon's files, absolute: "" for one not given (storage: the default; log: none). */
typedef struct daemon_paths {
  char socket[PATH_MAX], storage[PATH_MAX], log[PATH_MAX], pid[PATH_MAX];
} daemon_paths;

/* Makes the paths of the command line absolute and derives the others from the socket's.
 * Returns CONTINUE, or 2 (said on stderr) for a path too long. */
static HD_MUST_CHECK int resolve_paths(const arguments *a, daemon_paths *p) {
  memset(p, 0, sizeof *p);
  if (a->socket != NULL) {
    if (!make_absolute(a->socket, p->socket, sizeof p->socket)) {
      fprintf(stderr, "heapdump-collector: --socket path too long\n");
      return 2;
    }
  } else if (hd_default_socket_path(p->socket, sizeof p->socket) != 0) {
    fprintf(stderr, "heapdump-collector: the default socket path is too long\n");
    return 2;
  }
  if (a->stop) return CONTINUE; /* only the socket matters */
  if (a->storage != NULL && !make_absolute(a->storage, p->storage, sizeof p->storage)) {
    fprintf(stderr, "heapdump-collector: --storage path too long\n");
    return 2;
  }
  if (!beside_socket(p->socket, ".pid", p->pid, sizeof p->pid) ||
      (a->log_file != NULL && !make_absolute(a->log_file, p->log, sizeof p->log)) ||
      (a->log_file == NULL && !a->foreground &&
       !beside_socket(p->socket, ".log", p->log, sizeof p->log))) {
    fprintf(stderr, "heapdump-collector: path too long\n");
    return 2;
  }
  return CONTINUE;
}

int main(int argc, char **argv) {
  /* A snapshot's copies and buffers are large and short-lived, made by threads that come and
   * go. glibc raises its mmap threshold to the largest block freed so far and then serves such
   * blocks from the thread's arena, which keeps them after they are freed: in 20 s of the
   * hostile soak test the collector's resident memory grew from 2.4 to 12.3 MB, several MB in
   * each of its threads' arenas. A fixed threshold (the default's value) keeps every large block
   * mapped, and returned when freed: 2.3 to 3.9 MB. */
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  arguments args;
  const int parsed = parse_args(argc, argv, &args);
  if (parsed != CONTINUE) return parsed;
  hd_collector_options options = args.options;
  const bool foreground = args.foreground;
  daemon_paths paths;
  const int resolved = resolve_paths(&args, &paths);
  if (resolved != CONTINUE) return resolved;
  if (args.stop) return stop_daemon(paths.socket);
  char *const socket_path = paths.socket, *const log_path = paths.log, *const pid_path = paths.pid;
  if (paths.storage[0] != '\0') options.storage_dir = paths.storage;
  options.socket_path = socket_path;

  int ready_fd = -1, terminal_fd = -1, start_log = -1;
  if (!foreground) {
    detach(&ready_fd);
    /* What the collector logs while it starts goes to its log file, which lives in the socket's
     * directory that starting creates: held in memory until then, and shown on the terminal
     * instead if starting fails. */
    terminal_fd = fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 3);
    start_log = memfd_create("heapdump-collector-start", MFD_CLOEXEC);
    if (terminal_fd >= 0 && start_log >= 0) dup2(start_log, STDERR_FILENO);
  }
  prepare_process();
  hd_collector *c;
  int rc = hd_collector_create(&options, &c);
  hd_http *http = NULL;
  char http_error[512] = "";
  const int http_rc =
      rc == 0 && args.http != NULL
          ? hd_http_start(c, args.http, args.http_token_file, &http, http_error, sizeof http_error)
          : 0;
  if (terminal_fd >= 0) {
    fflush(stderr);
    dup2(terminal_fd, STDERR_FILENO);
    close(terminal_fd);
  }
  if (rc != 0) {
    copy_start_log(start_log, STDERR_FILENO);
    fprintf(stderr, "heapdump-collector: cannot start: %s\n", strerror(-rc));
    return 1;
  }
  if (http_rc != 0) {
    copy_start_log(start_log, STDERR_FILENO);
    fprintf(stderr, "heapdump-collector: cannot start: %s\n", http_error);
    hd_collector_destroy(c);
    return 1;
  }
  int log_fd = log_path[0] ? open_log(log_path) : -1;
  copy_start_log(start_log, log_fd);
  int pid_fd = log_path[0] && log_fd < 0 ? -1 : pid_file_create(pid_path);
  if (pid_fd < 0) {
    if (log_fd >= 0) close(log_fd);
    hd_http_stop(http);
    hd_collector_destroy(c);
    return 1;
  }
  if (!foreground) {
    finish_detaching(ready_fd, log_fd, socket_path, log_path);
  } else if (log_fd >= 0) {
    dup2(log_fd, STDERR_FILENO);
  }
  if (log_fd >= 0) close(log_fd);
  running = c;
  if (stop_early) hd_collector_stop(c);
  rc = hd_collector_run(c);
  running = NULL;
  hd_http_stop(http); /* before the collector its requests use */
  hd_collector_destroy(c);
  pid_file_remove(pid_path, pid_fd);
  return rc == 0 ? 0 : 1;
}
