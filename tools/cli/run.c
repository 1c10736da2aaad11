/* `heapdump run`: runs a command with the instrumentation preloaded and exit snapshots on, then
 * writes its exit snapshot (what was still live: the leaks) and prints a short report.
 *
 * The exit snapshot is stored by a collector: the one answering at the socket if any, else one
 * embedded in this process for the run, on a private socket with private storage (so two runs
 * never share one, and nothing is left behind: every snapshot it stored is written out as a file
 * before it goes). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "heapdump/collector.h"
#include "heapdump/fidl/channel.h"

#define EXIT_SNAPSHOT_NAME "exit"
/* How long the exit snapshot may take to be stored after the command exits. */
#define EXIT_SNAPSHOT_WAIT_SECONDS 30

static bool is_file(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* libheapdump.so: $HEAPDUMP_LIBRARY, else beside this executable or in an installed lib dir,
 * else where this build put it. */
static bool find_library(char *out, size_t size) {
  const char *env = getenv("HEAPDUMP_LIBRARY");
  if (env != NULL && env[0] != '\0') {
    if (!is_file(env) || realpath(env, out) == NULL) return false;
    return true;
  }
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash != NULL) *slash = '\0';
    static const char *const kRelative[] = {
        "libheapdump.so",
        "../lib/heapdump/libheapdump.so",
        "../lib/libheapdump.so",
        "../instrumentation/libheapdump.so",
        "../../instrumentation/libheapdump.so",
    };
    for (size_t i = 0; i < sizeof kRelative / sizeof kRelative[0]; i++) {
      char candidate[PATH_MAX + 64];
      snprintf(candidate, sizeof candidate, "%s/%s", exe, kRelative[i]);
      if (is_file(candidate) && realpath(candidate, out) != NULL) return true;
    }
  }
#ifdef HD_BUILD_PRELOAD_LIB
  if (is_file(HD_BUILD_PRELOAD_LIB) && snprintf(out, size, "%s", HD_BUILD_PRELOAD_LIB) < (int)size) {
    return true;
  }
#endif
  (void)size;
  return false;
}

/* ---- the embedded collector ---- */

typedef struct embedded {
  char dir[64];
  char socket[128];
  char storage[128];
  hd_collector *collector;
  pthread_t thread;
  bool running;
} embedded;

static void *serve(void *arg) {
  embedded *e = arg;
  int rc = hd_collector_run(e->collector);
  if (rc != 0) cli_error("the embedded collector stopped: %s", strerror(-rc));
  return NULL;
}

static int embedded_start(embedded *e) {
  memset(e, 0, sizeof *e);
  const char *tmp = getenv("TMPDIR");
  snprintf(e->dir, sizeof e->dir, "%s/heapdump-run-XXXXXX",
           tmp != NULL && tmp[0] && strlen(tmp) < 32 ? tmp : "/tmp");
  if (mkdtemp(e->dir) == NULL) {
    cli_error("cannot create a directory for the embedded collector: %s", strerror(errno));
    return -1;
  }
  snprintf(e->socket, sizeof e->socket, "%s/collector.sock", e->dir);
  snprintf(e->storage, sizeof e->storage, "%s/state", e->dir);
  hd_collector_options options = {.socket_path = e->socket,
                                  .storage_dir = e->storage,
                                  .log_level = HD_LOG_WARN};
  int rc = hd_collector_create(&options, &e->collector);
  if (rc != 0) {
    cli_error("cannot start the embedded collector: %s", strerror(-rc));
    rmdir(e->dir);
    return -1;
  }
  if (pthread_create(&e->thread, NULL, serve, e) != 0) {
    cli_error("cannot start the embedded collector's thread");
    hd_collector_destroy(e->collector);
    rmdir(e->dir);
    return -1;
  }
  e->running = true;
  return 0;
}

static void remove_tree(const char *path) {
  DIR *d = opendir(path);
  if (d != NULL) {
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL) {
      if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0) continue;
      char child[512];
      snprintf(child, sizeof child, "%s/%s", path, entry->d_name);
      if (entry->d_type == DT_DIR) {
        remove_tree(child);
      } else {
        unlink(child);
      }
    }
    closedir(d);
  }
  rmdir(path);
}

static void embedded_stop(embedded *e) {
  if (!e->running) return;
  hd_collector_stop(e->collector);
  pthread_join(e->thread, NULL);
  hd_collector_destroy(e->collector);
  remove_tree(e->dir);
  e->running = false;
}

/* ---- the command ---- */

static volatile sig_atomic_t g_child = 0;

static void forward_signal(int sig) {
  if (g_child > 0) kill((pid_t)g_child, sig);
}

/* Starts argv with the instrumentation. Reports exec failures through a close-on-exec pipe, so
 * "command not found" is told apart from a command that ran and failed. */
static pid_t spawn(char **argv, const char *library, const char *socket, int *exec_errno) {
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) return -1;
  pid_t pid = fork();
  if (pid < 0) {
    close(pipefd[0]);
    close(pipefd[1]);
    return -1;
  }
  if (pid == 0) {
    close(pipefd[0]);
    signal(SIGINT, SIG_DFL);
    signal(SIGQUIT, SIG_DFL);
    const char *old = getenv("LD_PRELOAD");
    char preload[PATH_MAX * 2 + 2];
    if (old != NULL && old[0] != '\0') {
      snprintf(preload, sizeof preload, "%s:%s", library, old);
    } else {
      snprintf(preload, sizeof preload, "%s", library);
    }
    setenv("LD_PRELOAD", preload, 1);
    setenv("HEAPDUMP_SOCKET", socket, 1);
    setenv("HEAPDUMP_EXIT_SNAPSHOT", "1", 1);
    execvp(argv[0], argv);
    int err = errno;
    if (write(pipefd[1], &err, sizeof err) != (ssize_t)sizeof err) _exit(127);
    _exit(err == ENOENT ? 127 : 126);
  }
  close(pipefd[1]);
  *exec_errno = 0;
  ssize_t n;
  do {
    n = read(pipefd[0], exec_errno, sizeof *exec_errno);
  } while (n < 0 && errno == EINTR);
  if (n != (ssize_t)sizeof *exec_errno) *exec_errno = 0;
  close(pipefd[0]);
  return pid;
}

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_seconds(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* Output names: the given --output (its stem for the extra files), else heapdump.NAME.PID. */
static void output_path(const cli_options *o, cli_format f, const char *process, uint64_t pid,
                        const char *suffix, char *out, size_t size) {
  if (o->output != NULL && suffix == NULL) {
    snprintf(out, size, "%s", o->output);
    return;
  }
  char stem[4096];
  if (o->output != NULL) {
    snprintf(stem, sizeof stem, "%s", o->output);
    const char *ext = cli_format_extension(f);
    size_t n = strlen(stem), m = strlen(ext);
    if (n > m && strcmp(stem + n - m, ext) == 0) stem[n - m] = '\0';
  } else {
    char name[40];
    cli_safe_name(name, sizeof name, process);
    snprintf(stem, sizeof stem, "heapdump.%s.%" PRIu64, name, pid);
  }
  snprintf(out, size, "%s%s%s%s", stem, suffix ? "." : "", suffix ? suffix : "",
           cli_format_extension(f));
}

static int write_file(const cli_options *o, const hd_reassembler *r, cli_format f,
                      const char *path) {
  cli_output out;
  int rc = cli_output_open(&out, path);
  if (rc != 0) return rc;
  rc = cli_write(o, r, f, &out);
  if (rc != 0) {
    cli_output_abort(&out);
    return rc;
  }
  return cli_output_commit(&out);
}

static void interval_snapshot(const cli_options *o, pid_t pid, unsigned seq, cli_format f,
                              bool *warned) {
  hd_reassembler r;
  hd_reassembler_init(&r);
  cli_options live = *o;
  live.all = false;
  live.name = NULL;
  /* The command may not have registered yet, or already be exiting: one line says so below. */
  cli_quiet = true;
  int rc = cli_take_live_snapshot(&live, (uint64_t)pid, &r);
  cli_quiet = false;
  if (rc == 0 && r.snapshot_count == 1) {
    char suffix[32], path[4200];
    snprintf(suffix, sizeof suffix, "%u", seq);
    const hd_snapshot *s = r.snapshots[0];
    output_path(o, f, s->process_name[0] ? s->process_name : "process", (uint64_t)pid, suffix,
                path, sizeof path);
    if (write_file(o, &r, f, path) == 0) fprintf(stderr, "heapdump: wrote %s\n", path);
  } else if (!*warned) {
    *warned = true;
    fprintf(stderr, "heapdump: live snapshot %u of pid %d failed (not registered yet?)\n", seq,
            (int)pid);
  }
  hd_reassembler_destroy(&r);
}

/* Waits for the command, taking interval snapshots meanwhile. Returns its wait status. */
static int wait_for(const cli_options *o, pid_t pid, cli_format f) {
  int status = 0;
  if (o->interval <= 0) {
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return status;
  }
  double next = now_seconds() + o->interval;
  unsigned seq = 0;
  bool warned = false;
  for (;;) {
    pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid || (done < 0 && errno != EINTR)) return status;
    if (now_seconds() >= next) {
      interval_snapshot(o, pid, ++seq, f, &warned);
      next = now_seconds() + o->interval;
    }
    sleep_seconds(0.02);
  }
}

static int find_stored(const cli_options *o, uint32_t after, pid_t pid, cli_stored **items,
                       size_t *count, const cli_stored **exit_snapshot) {
  cli_options all = *o;
  all.has_pid = false;
  all.name = NULL;
  *items = NULL;
  *count = 0;
  *exit_snapshot = NULL;
  int rc = cli_list(&all, items, count);
  if (rc != 0) return rc;
  for (size_t i = 0; i < *count; i++) {
    const cli_stored *s = &(*items)[i];
    if (s->id > after && s->pid == (uint64_t)pid && strcmp(s->name, EXIT_SNAPSHOT_NAME) == 0) {
      *exit_snapshot = s;
    }
  }
  return 0;
}

static uint32_t newest_id(const cli_options *o) {
  cli_stored *items = NULL;
  size_t count = 0;
  uint32_t newest = 0;
  if (cli_list(o, &items, &count) == 0) {
    for (size_t i = 0; i < count; i++) {
      if (items[i].id > newest) newest = items[i].id;
    }
  }
  free(items);
  return newest;
}

static void print_report(const cli_options *o, const hd_reassembler *r, const char *command,
                         pid_t pid, int status) {
  if (WIFEXITED(status)) {
    fprintf(stderr, "\nheapdump: %s[%d] exited with status %d. Still live at exit:\n", command,
            (int)pid, WEXITSTATUS(status));
  } else {
    fprintf(stderr, "\nheapdump: %s[%d] was killed by signal %d. Still live at exit:\n", command,
            (int)pid, WTERMSIG(status));
  }
  cli_options report = *o;
  report.json = false;
  report.by = HD_REPORT_BY_SITE;
  report.top = 10;
  report.max_frames = 4; /* short: the full stacks are in the written snapshot */
  cli_output out = {.file = stderr, .is_stdout = true};
  snprintf(out.path, sizeof out.path, "(stderr)");
  if (cli_write(&report, r, FORMAT_TEXT, &out) != 0) return;
  fflush(stderr);
}

/* Writes the other snapshots the embedded collector stored (named snapshots, exit snapshots of
 * the command's children): its storage is about to go. */
static void save_others(const cli_options *o, const cli_stored *items, size_t count,
                        const cli_stored *main_exit, cli_format f) {
  for (size_t i = 0; i < count; i++) {
    const cli_stored *s = &items[i];
    if (s == main_exit) continue;
    hd_reassembler r;
    hd_reassembler_init(&r);
    if (cli_download(o, s, &r) == 0) {
      char path[4200];
      bool is_exit = strcmp(s->name, EXIT_SNAPSHOT_NAME) == 0;
      cli_options named = *o;
      named.output = NULL;
      output_path(&named, f, s->process_name, s->pid, is_exit ? NULL : s->name, path, sizeof path);
      if (write_file(o, &r, f, path) == 0) {
        fprintf(stderr, "heapdump: wrote %s (%s snapshot of %s[%" PRIu64 "])\n", path,
                is_exit ? "exit" : s->name, s->process_name, s->pid);
      }
    }
    hd_reassembler_destroy(&r);
  }
}

int cmd_run(cli_options *o, int argc, char **argv) {
  if (argc == 0) {
    cli_error("run: no command given (usage: heapdump run [OPTIONS] -- COMMAND [ARGS...])");
    return EXIT_USAGE;
  }
  char library[PATH_MAX];
  if (!find_library(library, sizeof library)) {
    cli_error("cannot find libheapdump.so (set HEAPDUMP_LIBRARY to its path)");
    return EXIT_RUN_FAILED;
  }
  cli_format f = cli_output_format(o, o->output, FORMAT_PPROF);
  if (o->output != NULL && strcmp(o->output, "-") != 0) {
    cli_output probe;
    int rc = cli_output_open(&probe, o->output);
    if (rc != 0) return EXIT_RUN_FAILED;
    cli_output_abort(&probe);
  }

  embedded e = {0};
  int probe_fd;
  errno = 0;
  if (hd_channel_connect(o->socket, &probe_fd) == HD_OK) {
    close(probe_fd);
  } else {
    if (embedded_start(&e) != 0) return EXIT_RUN_FAILED;
    o->socket = e.socket;
  }
  uint32_t baseline = e.running ? 0 : newest_id(o);

  int exec_errno = 0;
  pid_t pid = spawn(argv, library, o->socket, &exec_errno);
  if (pid < 0) {
    cli_error("cannot start %s: %s", argv[0], strerror(errno));
    embedded_stop(&e);
    return EXIT_RUN_FAILED;
  }
  /* The terminal sends ^C to the command too; heapdump stays to collect what it leaves. */
  struct sigaction ignore = {.sa_handler = SIG_IGN}, forward = {.sa_handler = forward_signal};
  struct sigaction old_int, old_quit, old_term, old_hup;
  sigaction(SIGINT, &ignore, &old_int);
  sigaction(SIGQUIT, &ignore, &old_quit);
  g_child = pid;
  sigaction(SIGTERM, &forward, &old_term);
  sigaction(SIGHUP, &forward, &old_hup);

  int status = wait_for(o, pid, f);
  int command_rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (exec_errno != 0) {
    cli_error("cannot run %s: %s", argv[0], strerror(exec_errno));
    embedded_stop(&e);
    return command_rc;
  }

  cli_stored *items = NULL;
  size_t count = 0;
  const cli_stored *exit_snapshot = NULL;
  double deadline = now_seconds() + EXIT_SNAPSHOT_WAIT_SECONDS;
  bool told = false;
  double started = now_seconds();
  for (;;) {
    free(items);
    if (find_stored(o, baseline, pid, &items, &count, &exit_snapshot) != 0) break;
    if (exit_snapshot != NULL || now_seconds() > deadline) break;
    if (!told && now_seconds() - started > 2) {
      fprintf(stderr, "heapdump: waiting for the exit snapshot of %s[%d]...\n", argv[0], (int)pid);
      told = true;
    }
    sleep_seconds(0.05);
  }
  if (exit_snapshot == NULL) {
    cli_error("no exit snapshot of %s[%d] arrived: the command did not load libheapdump.so "
              "(statically linked, setuid, or LD_PRELOAD removed?)",
              argv[0], (int)pid);
  } else {
    hd_reassembler r;
    hd_reassembler_init(&r);
    if (cli_download(o, exit_snapshot, &r) == 0) {
      char path[4200];
      output_path(o, f, exit_snapshot->process_name, (uint64_t)pid, NULL, path, sizeof path);
      bool to_stdout = strcmp(path, "-") == 0;
      if (write_file(o, &r, f, path) == 0 && !to_stdout) {
        fprintf(stderr, "heapdump: wrote %s\n", path);
      }
      print_report(o, &r, exit_snapshot->process_name, pid, status);
    }
    hd_reassembler_destroy(&r);
  }
  if (e.running) save_others(o, items, count, exit_snapshot, f);
  free(items);
  embedded_stop(&e);
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGQUIT, &old_quit, NULL);
  sigaction(SIGTERM, &old_term, NULL);
  sigaction(SIGHUP, &old_hup, NULL);
  return command_rc;
}
