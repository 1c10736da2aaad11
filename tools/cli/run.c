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
#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/channel.h"
#include "heapdump/tools/reach.h"

/* How long the exit snapshots may take to be stored after the command exits (a 10^7-block
 * process takes seconds). */
#define EXIT_SNAPSHOT_WAIT_SECONDS 30
/* With a daemon too old to say whether the command registered, how long to wait for its exit
 * snapshot. */
#define DAEMON_EXIT_WAIT_SECONDS 10
/* How long processes of the run still running when the command exited get to exit. */
#define CHILD_GRACE_SECONDS 2
/* Child processes listed by peak live bytes after the report. */
#define TOP_CHILDREN 5

static volatile sig_atomic_t g_child = 0;

static void forward_signal(int sig) {
  if (g_child > 0) kill((pid_t)g_child, sig);
}

/* Starts argv with the instrumentation. Reports exec failures through a close-on-exec pipe, so
 * "command not found" is told apart from a command that ran and failed. */
static pid_t spawn(char **argv, const char *library, const char *socket, const char *children,
                   const char *sample_bytes, bool leak_check, int *exec_errno) {
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
    setenv(HD_ENV_SOCKET, socket, 1);
    setenv(HD_ENV_EXIT_SNAPSHOT, "1", 1);
    if (sample_bytes != NULL) setenv(HD_ENV_SAMPLE_BYTES, sample_bytes, 1);
    setenv(HD_ENV_DORMANT, "0", 1); /* run records from the start, whatever the caller set */
    /* The command (across its execs, not its children) stores its exit snapshot itself, with
     * contents and roots: a leak check. HEAPDUMP_EXIT_CONTENTS in the environment decides
     * otherwise (0: off). */
    if (!leak_check) {
      setenv(HD_ENV_EXIT_CONTENTS, "0", 1);
    } else if (getenv(HD_ENV_EXIT_CONTENTS) == NULL) {
      char self[24];
      snprintf(self, sizeof self, "%d", (int)getpid());
      setenv(HD_ENV_EXIT_CONTENTS, self, 1);
    }
    /* --children: see the library's program_selected(). */
    if (children == NULL || strcmp(children, "all") == 0) {
      unsetenv(HD_ENV_PROFILE_ONLY);
      unsetenv(HD_ENV_PROFILE_ROOT);
    } else {
      char root[24];
      snprintf(root, sizeof root, "%d", (int)getpid());
      setenv(HD_ENV_PROFILE_ROOT, root, 1);
      setenv(HD_ENV_PROFILE_ONLY, strcmp(children, "none") == 0 ? "" : children, 1);
    }
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

static HD_MUST_CHECK int write_file(const cli_options *o, const hd_reassembler *r, cli_format f,
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

/* The parent of pid from /proc, 0 if gone. */
static pid_t parent_of(pid_t pid) {
  char path[64], text[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, text, sizeof text - 1);
  close(fd);
  if (n <= 0) return 0;
  text[n] = '\0';
  const char *after_name = strrchr(text, ')'); /* the name may hold spaces and parentheses */
  int ppid = 0;
  if (after_name == NULL || sscanf(after_name + 1, " %*c %d", &ppid) != 1) return 0;
  return (pid_t)ppid;
}

typedef struct interval_scope {
  const cli_options *o;
  pid_t root;
  bool embedded; /* every process of the embedded collector is one of the run's */
} interval_scope;

/* The processes --children selects: the command's pid (with "all" and "none", or when its name
 * is listed) and its descendants (all of them with "all", the listed ones with a list). */
static bool in_interval_scope(const hd_snapshot *s, void *ctx) {
  const interval_scope *scope = ctx;
  const char *spec = scope->o->children != NULL ? scope->o->children : "all";
  bool all = strcmp(spec, "all") == 0, none = strcmp(spec, "none") == 0;
  if (s->pid == (uint64_t)scope->root) return all || none || hd_comm_listed(spec, s->process_name);
  if (none || (!all && !hd_comm_listed(spec, s->process_name))) return false;
  if (scope->embedded) return true;
  pid_t p = (pid_t)s->pid;
  for (int depth = 0; depth < 64 && p > 1; depth++) {
    p = parent_of(p);
    if (p == scope->root) return true;
  }
  return false;
}

/* One live snapshot of every process in scope, in one multi-process file FILE-STEM.SEQ.EXT. */
static void interval_snapshot(const cli_options *o, pid_t pid, const char *command, bool embedded,
                              unsigned seq, cli_format f, bool *warned) {
  hd_reassembler r;
  hd_reassembler_init(&r);
  cli_options live = *o;
  live.all = true;
  live.name = NULL;
  live.has_pid = false;
  /* The command may not have registered yet, or already be exiting: one line says so below. */
  cli_quiet = true;
  int rc = cli_take_live_snapshot(&live, 0, &r);
  cli_quiet = false;
  if (rc == EXIT_PARTIAL) rc = 0; /* what could be read is written */
  interval_scope scope = {o, pid, embedded};
  if (rc == 0) hd_reassembler_keep(&r, in_interval_scope, &scope);
  if (rc == 0 && r.snapshot_count > 0) {
    char suffix[32], path[4200];
    snprintf(suffix, sizeof suffix, "%u", seq);
    /* Named after the command, like the exit snapshot, whichever processes it holds. */
    const char *name = strrchr(command, '/') ? strrchr(command, '/') + 1 : command;
    for (size_t i = 0; i < r.snapshot_count; i++) {
      if (r.snapshots[i]->pid == (uint64_t)pid) name = r.snapshots[i]->process_name;
    }
    output_path(o, f, name, (uint64_t)pid, suffix, path, sizeof path);
    if (write_file(o, &r, f, path) == 0) {
      fprintf(cli_stderr(), "heapdump: wrote %s (%zu process%s)\n", path, r.snapshot_count,
              r.snapshot_count == 1 ? "" : "es");
    }
  } else if (!*warned) {
    *warned = true;
    fprintf(cli_stderr(),
            "heapdump: live snapshot %u of %d and its children failed (none registered "
            "yet?)\n",
            seq, (int)pid);
  }
  hd_reassembler_destroy(&r);
}

/* Waits for the command, taking interval snapshots meanwhile. Returns its wait status. */
static HD_MUST_CHECK int wait_for(const cli_options *o, pid_t pid, const char *command,
                                  bool embedded, cli_format f) {
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
      interval_snapshot(o, pid, command, embedded, ++seq, f, &warned);
      next = now_seconds() + o->interval;
    }
    sleep_seconds(0.02);
  }
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

/* What the collector stored for this run: the snapshots after `baseline`. */
typedef struct run_results {
  cli_stored *items;
  size_t count;
  const cli_stored *main_exit; /* the exit snapshot of the command's last image */
  const cli_stored *exec_from; /* the first image of the command's pid, when it exec'd */
} run_results;

static HD_MUST_CHECK int collect_results(const cli_options *o, uint32_t baseline, pid_t pid,
                                         run_results *out) {
  cli_options all = *o;
  all.has_pid = false;
  all.name = NULL;
  cli_stored *items = NULL;
  size_t count = 0;
  int rc = cli_list(&all, &items, &count);
  if (rc != 0) return rc;
  free(out->items);
  *out = (run_results){0};
  for (size_t i = 0; i < count; i++) {
    if (items[i].id > baseline) items[out->count++] = items[i];
  }
  out->items = items;
  for (size_t i = 0; i < out->count; i++) {
    const cli_stored *s = &items[i];
    if (s->pid != (uint64_t)pid) continue;
    if (strcmp(s->name, HD_EXIT_SNAPSHOT_NAME) == 0) out->main_exit = s;
    if (strcmp(s->name, HD_EXEC_SNAPSHOT_NAME) == 0 && out->exec_from == NULL) out->exec_from = s;
  }
  return 0;
}

/* The embedded collector: waits until every process of the run that exited has its exit
 * snapshot stored. Processes still running get CHILD_GRACE_SECONDS to exit; those that do not
 * are left in *census (they are reported as lost). */
static void settle_embedded(cli_embedded *e, hd_collector_census *census) {
  double grace_end = now_seconds() + CHILD_GRACE_SECONDS;
  double deadline = now_seconds() + EXIT_SNAPSHOT_WAIT_SECONDS;
  bool told = false;
  for (;;) {
    hd_collector_take_census(e->collector, census);
    bool storing = census->exited_unhandled > 0 || census->exits_pending > 0;
    if (!storing && (census->running == 0 || now_seconds() > grace_end)) return;
    if (now_seconds() > deadline) return;
    if (storing && !told && now_seconds() - (deadline - EXIT_SNAPSHOT_WAIT_SECONDS) > 2) {
      fprintf(cli_stderr(), "heapdump: storing the exit snapshots of %u process(es)...\n",
              census->exited_unhandled + census->exits_pending);
      told = true;
    }
    sleep_seconds(0.01);
  }
}

/* A daemon: waits until the exit snapshot of the command's pid is stored, asking the daemon where
 * the process stands, so that a command that never registered is reported at once. Returns why
 * no exit snapshot came, or NULL. */
static const char *wait_for_daemon(const cli_options *o, uint32_t baseline, pid_t pid,
                                   const char *command, run_results *results) {
  static const char kNotLoaded[] =
      "the command did not load libheapdump.so (statically linked, "
      "setuid, or LD_PRELOAD removed?)";
  double started = now_seconds(), limit = EXIT_SNAPSHOT_WAIT_SECONDS;
  bool told = false;
  for (;;) {
    /* The state first, then the listing: a snapshot stored in between is in the listing. */
    heapdump_client_CollectorGetProcessStateResponse state;
    const bool known = cli_process_state(o, (uint64_t)pid, &state) == 0;
    if (collect_results(o, baseline, pid, results) != 0) return "the collector's listing failed";
    /* The last image stores its exit snapshot itself; an earlier image's exec snapshot may
     * still be on its way (the daemon reports the pid pending until it is stored). */
    if (results->main_exit != NULL &&
        (!known ||
         state.state != heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_PENDING)) {
      return NULL;
    }
    if (!known) {
      limit = DAEMON_EXIT_WAIT_SECONDS;
    } else if (state.state != heapdump_client_ProcessState_PROCESS_STATE_RUNNING &&
               state.state != heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_PENDING) {
      /* Settled: what the listing shows now is all there will be. */
      if (collect_results(o, baseline, pid, results) != 0) return "the collector's listing failed";
      if (results->main_exit != NULL) return NULL;
      switch (state.state) {
        case heapdump_client_ProcessState_PROCESS_STATE_UNKNOWN: return kNotLoaded;
        case heapdump_client_ProcessState_PROCESS_STATE_EXITED_WITHOUT_SNAPSHOT:
          return "the collector could not store it (its log says why)";
        default:
          return "it was stored, then deleted or evicted at once (see the collector's "
                 "--max-stored and --max-storage-bytes)";
      }
    }
    if (now_seconds() - started > limit) {
      if (results->main_exit != NULL) return NULL; /* the exec snapshot is late: report without */
      return limit == DAEMON_EXIT_WAIT_SECONDS ? kNotLoaded : "the collector is still storing it";
    }
    if (!told && now_seconds() - started > 2) {
      fprintf(cli_stderr(), "heapdump: waiting for the exit snapshot of %s[%d]...\n", command,
              (int)pid);
      told = true;
    }
    sleep_seconds(0.02);
  }
}

static void print_report(const cli_options *o, const hd_reassembler *r, const run_results *res,
                         pid_t pid, int status) {
  char from[64] = "";
  if (res->exec_from != NULL) {
    snprintf(from, sizeof from, " (exec'd from %s)", res->exec_from->process_name);
  }
  if (WIFEXITED(status)) {
    fprintf(cli_stderr(), "\nheapdump: %s[%d]%s exited with status %d. Still live at exit:\n",
            res->main_exit->process_name, (int)pid, from, WEXITSTATUS(status));
  } else {
    fprintf(cli_stderr(), "\nheapdump: %s[%d]%s was killed by signal %d. Still live at exit:\n",
            res->main_exit->process_name, (int)pid, from, WTERMSIG(status));
  }
  /* Without roots the blocks cannot be classified: only a process that went through its exit
   * path stored them. */
  bool classified = r->snapshot_count > 0 && hd_reach_possible(r->snapshots[0]);
  const char *contents = getenv(HD_ENV_EXIT_CONTENTS);
  bool wanted = !o->no_leak_check && (contents == NULL || strcmp(contents, "0") != 0);
  if (!classified && wanted) {
    fprintf(cli_stderr(),
            "heapdump: no leak check: %s, so the exit snapshot has no contents and what was live "
            "is not classified\n",
            !WIFEXITED(status) ? "a signal ended the process before its exit path"
                               : "the process did not store its exit snapshot itself (it left "
                                 "through _exit or exec, or the collector could not read it)");
  }
  cli_options report = *o;
  report.json = false;
  report.by = HD_REPORT_BY_SITE;
  report.top = 10;
  report.max_frames = 4; /* short: the full stacks are in the written snapshot */
  cli_output out = {.file = cli_stderr(), .is_stdout = true};
  snprintf(out.path, sizeof out.path, "(stderr)");
  if (cli_write(&report, r, FORMAT_TEXT, &out) != 0) return;
  fflush(cli_stderr());
}

/* The run's directory for the snapshots of other processes: --children-dir, else the output's
 * stem with ".d" (heapdump.make.4242.d). Created on first use. */
static bool children_dir(const cli_options *o, cli_format f, const char *main_name, pid_t pid,
                         char *out, size_t size) {
  if (o->children_dir != NULL) {
    snprintf(out, size, "%s", o->children_dir);
  } else {
    char stem[4200];
    output_path(o, f, main_name, (uint64_t)pid, "d", stem, sizeof stem);
    size_t n = strlen(stem), m = strlen(cli_format_extension(f));
    if (n > m) stem[n - m] = '\0';
    snprintf(out, size, "%s", stem);
  }
  if (mkdir(out, 0777) != 0 && errno != EEXIST) {
    cli_error("cannot create %s: %s", out, strerror(errno));
    return false;
  }
  return true;
}

typedef struct child_peak {
  const cli_stored *snapshot;
  uint64_t peak;
  char path[4400];
} child_peak;

static int by_peak_descending(const void *a, const void *b) {
  const child_peak *x = a, *y = b;
  return x->peak < y->peak ? 1 : x->peak > y->peak ? -1 : 0;
}

/* What save_others wrote, for its summary. */
typedef struct others_tally {
  char dir[4200]; /* the run's directory for other processes' snapshots, once made */
  child_peak *children;
  size_t child_count, exec_images, files, failed;
} others_tally;

/* Downloads stored snapshot s and writes it where save_others says; false if it stops there
 * (the run's directory cannot be made). */
static bool save_other(const cli_options *o, const cli_stored *s, pid_t pid, cli_format f,
                       const char *main_name, others_tally *t) {
  const bool is_exit = strcmp(s->name, HD_EXIT_SNAPSHOT_NAME) == 0;
  const bool is_exec = strcmp(s->name, HD_EXEC_SNAPSHOT_NAME) == 0;
  const bool ours = s->pid == (uint64_t)pid && !is_exit && !is_exec;
  if (!ours && t->dir[0] == '\0' && !children_dir(o, f, main_name, pid, t->dir, sizeof t->dir)) {
    return false;
  }
  hd_reassembler r;
  hd_reassembler_init(&r);
  char path[4400]; /* the directory, then a name of bounded parts */
  if (ours) {
    cli_options named = *o;
    named.output = NULL;
    output_path(&named, f, s->process_name, s->pid, s->name, path, sizeof path);
  } else {
    char name[40], snap[40];
    cli_safe_name(name, sizeof name, s->process_name);
    cli_safe_name(snap, sizeof snap, s->name);
    snprintf(path, sizeof path, "%s/%s.%" PRIu64 ".%s.%" PRIu32 "%s", t->dir, name, s->pid, snap,
             s->id, cli_format_extension(f));
  }
  if (cli_download(o, s, &r) != 0 || write_file(o, &r, f, path) != 0) {
    t->failed++;
    hd_reassembler_destroy(&r);
    return true;
  }
  t->files++;
  if (ours || o->verbose) {
    fprintf(cli_stderr(), "heapdump: wrote %s (%s snapshot of %s[%" PRIu64 "])\n", path, s->name,
            s->process_name, s->pid);
  }
  if (is_exec && s->pid == (uint64_t)pid) t->exec_images++;
  if (!ours && is_exit && s->pid != (uint64_t)pid) {
    child_peak *c = &t->children[t->child_count++];
    c->snapshot = s;
    const hd_snapshot *snapshot = r.snapshot_count == 1 ? r.snapshots[0] : NULL;
    c->peak = snapshot && snapshot->has_stats ? snapshot->stats.peak_live_bytes : 0;
    snprintf(c->path, sizeof c->path, "%s", path);
  }
  hd_reassembler_destroy(&r);
  return true;
}

/* One line of what was saved, a line per process lost (still running), the top children. */
static void summarize_others(const others_tally *t, const hd_collector_census *census) {
  const unsigned lost = census != NULL ? census->running : 0;
  const size_t processes = t->child_count + lost;
  if (t->dir[0] != '\0' || lost > 0) {
    char images[64] = "";
    if (t->exec_images > 0) {
      snprintf(images, sizeof images, " and %zu program%s it exec'd away from", t->exec_images,
               t->exec_images == 1 ? "" : "s");
    }
    fprintf(cli_stderr(), "heapdump: %zu child process%s%s: %zu snapshot%s in %s/%s\n", processes,
            processes == 1 ? "" : "es", images, t->files, t->files == 1 ? "" : "s",
            t->dir[0] ? t->dir : ".", t->failed ? " (some could not be written: see above)" : "");
  }
  for (unsigned i = 0; i < lost; i++) {
    if (i < sizeof census->running_list / sizeof census->running_list[0]) {
      fprintf(cli_stderr(), "heapdump: lost %s[%u]: still running %d s after the command exited\n",
              census->running_list[i].name, census->running_list[i].pid, CHILD_GRACE_SECONDS);
    } else {
      fprintf(cli_stderr(), "heapdump: lost %u more still running\n", lost - i);
      break;
    }
  }
  if (t->child_count == 0) return;
  qsort(t->children, t->child_count, sizeof *t->children, by_peak_descending);
  const size_t top = t->child_count < TOP_CHILDREN ? t->child_count : TOP_CHILDREN;
  fprintf(cli_stderr(), "\nheapdump: top child processes by peak live bytes:\n");
  for (size_t i = 0; i < top; i++) {
    char who[64];
    snprintf(who, sizeof who, "%s[%" PRIu64 "]", t->children[i].snapshot->process_name,
             t->children[i].snapshot->pid);
    fprintf(cli_stderr(), "  %14" PRIu64 "  %-28s %s\n", t->children[i].peak, who,
            t->children[i].path);
  }
}

/* Writes the other snapshots the embedded collector stored, before its storage goes: the
 * command's own named snapshots beside the output, everything of other processes (and of
 * images the command exec'd away from) in the run's directory, under names made unique by the
 * snapshot id. Prints one summary line, the files with --verbose, and the top children by peak
 * live bytes. */
static void save_others(const cli_options *run_options, const run_results *res, pid_t pid,
                        cli_format f, const hd_collector_census *census) {
  cli_options others = *run_options;
  others.source = "snapshot stored during heapdump run";
  const cli_options *o = &others;
  others_tally t = {.children = calloc(res->count + 1, sizeof *t.children)};
  const char *main_name = res->main_exit ? res->main_exit->process_name : "process";
  for (size_t i = 0; i < res->count && t.children != NULL; i++) {
    const cli_stored *s = &res->items[i];
    if (s != res->main_exit && !save_other(o, s, pid, f, main_name, &t)) break;
  }
  summarize_others(&t, census);
  free(t.children);
}

/* The terminal sends ^C to the command too; heapdump stays to collect what it leaves, and
 * passes SIGTERM and SIGHUP on to the command. */
typedef struct signal_guard {
  struct sigaction old_int, old_quit, old_term, old_hup;
} signal_guard;

static void guard_signals(signal_guard *g) {
  struct sigaction ignore = {.sa_handler = SIG_IGN}, forward = {.sa_handler = forward_signal};
  sigaction(SIGINT, &ignore, &g->old_int);
  sigaction(SIGQUIT, &ignore, &g->old_quit);
  sigaction(SIGTERM, &forward, &g->old_term);
  sigaction(SIGHUP, &forward, &g->old_hup);
}

static void restore_signals(const signal_guard *g) {
  sigaction(SIGINT, &g->old_int, NULL);
  sigaction(SIGQUIT, &g->old_quit, NULL);
  sigaction(SIGTERM, &g->old_term, NULL);
  sigaction(SIGHUP, &g->old_hup, NULL);
}

/* Downloads the command's exit snapshot, writes it in format f and prints the report. */
static void write_exit_snapshot(const cli_options *run_options, const run_results *results,
                                pid_t pid, cli_format f, int status) {
  cli_options exit_options = *run_options;
  exit_options.source = "exit snapshot (heapdump run)";
  const cli_options *o = &exit_options;
  hd_reassembler r;
  hd_reassembler_init(&r);
  if (cli_download(o, results->main_exit, &r) == 0) {
    char path[4200];
    output_path(o, f, results->main_exit->process_name, (uint64_t)pid, NULL, path, sizeof path);
    if (write_file(o, &r, f, path) == 0) fprintf(cli_stderr(), "heapdump: wrote %s\n", path);
    if (o->html_output != NULL && write_file(o, &r, FORMAT_HTML, o->html_output) == 0) {
      fprintf(cli_stderr(), "heapdump: wrote %s\n", o->html_output);
    }
    print_report(o, &r, results, pid, status);
  }
  hd_reassembler_destroy(&r);
}

/* argv as a shell would take it back: an argument with a character the shell treats specially
 * goes in single quotes, a single quote in it as '\''. Cut at size. */
static void join_command_line(int argc, char **argv, char *out, size_t size) {
  size_t used = 0;
  const size_t room = size - 1;
  for (int i = 0; i < argc && used < room; i++) {
    const char *a = argv[i];
    const bool quote = a[0] == '\0' || strpbrk(a, " \t\n'\"\\$`*?;&|<>()[]{}~#!") != NULL;
    if (i && used < room) out[used++] = ' ';
    if (quote && used < room) out[used++] = '\'';
    for (; *a && used < room; a++) {
      if (quote && *a == '\'') {
        for (const char *q = "'\\''"; *q && used < room; q++) out[used++] = *q;
      } else {
        out[used++] = *a;
      }
    }
    if (quote && used < room) out[used++] = '\'';
  }
  out[used] = '\0';
}

int cmd_run(cli_options *o, int argc, char **argv) {
  if (argc > 0 && strcmp(argv[0], "--") == 0) { /* heapdump run -- -- COMMAND */
    argc--;
    argv++;
  }
  if (argc == 0) {
    cli_error("run: no command given (usage: heapdump run [OPTIONS] -- COMMAND [ARGS...])");
    return EXIT_USAGE;
  }
  char library[PATH_MAX];
  if (!cli_find_library(library, sizeof library)) {
    cli_error("cannot find libheapdump.so (set HEAPDUMP_LIBRARY to its path)");
    return EXIT_RUN_FAILED;
  }
  cli_format f = cli_output_format(o, o->output, FORMAT_PPROF);
  if (cli_probe_output(o) != 0) return EXIT_RUN_FAILED;
  /* The page too is checked before the command runs, not found unwritable after. */
  cli_options page = *o;
  page.output = o->html_output;
  if (cli_probe_output(&page) != 0) return EXIT_RUN_FAILED;

  cli_embedded e = {0};
  int probe_fd;
  errno = 0;
  if (hd_channel_connect(o->socket, &probe_fd) == HD_OK) {
    close(probe_fd);
  } else {
    if (cli_embedded_start(&e) != 0) return EXIT_RUN_FAILED;
    o->socket = e.socket;
  }
  uint32_t baseline = e.running ? 0 : newest_id(o);

  int exec_errno = 0;
  pid_t pid =
      spawn(argv, library, o->socket, o->children, o->sample_bytes, !o->no_leak_check, &exec_errno);
  if (pid < 0) {
    cli_error("cannot start %s: %s", argv[0], strerror(errno));
    cli_embedded_stop(&e);
    return EXIT_RUN_FAILED;
  }
  g_child = pid;
  char command_line[4096];
  join_command_line(argc, argv, command_line, sizeof command_line);
  o->command_line = command_line;
  o->command_pid = (uint64_t)pid;
  o->source = "live snapshot (heapdump run --interval)";
  signal_guard signals;
  guard_signals(&signals);

  int status = wait_for(o, pid, argv[0], e.running, f);
  int command_rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (exec_errno != 0) {
    cli_error("cannot run %s: %s", argv[0], strerror(exec_errno));
    cli_embedded_stop(&e);
    return command_rc;
  }

  run_results results = {0};
  hd_collector_census census;
  const char *missing =
      "the command did not load libheapdump.so (statically linked, setuid, or "
      "LD_PRELOAD removed?)";
  if (e.running) {
    settle_embedded(&e, &census);
    /* A listing that fails has said why; its results stay empty, which is reported below. */
    if (collect_results(o, baseline, pid, &results) != 0) results.main_exit = NULL;
  } else {
    missing = wait_for_daemon(o, baseline, pid, argv[0], &results);
  }
  if (results.main_exit == NULL) {
    cli_error("no exit snapshot of %s[%d]: %s", argv[0], (int)pid,
              missing != NULL ? missing : "it was not stored");
  } else {
    write_exit_snapshot(o, &results, pid, f, status);
  }
  if (e.running) save_others(o, &results, pid, f, &census);
  free(results.items);
  cli_embedded_stop(&e);
  restore_signals(&signals);
  return command_rc;
}
