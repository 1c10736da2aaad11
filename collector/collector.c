/* The collector: a poll loop that accepts connections on one socket, tells registry connections
 * (instrumented processes) from client connections by their first message, watches the exit of
 * every live process through its pidfd, and hands all slow work elsewhere: snapshot streams to
 * stream threads (a bounded pool), storing snapshots to the storage workers. So a slow client or
 * a big snapshot never delays anyone else. This file holds the collector's lifecycle and its
 * poll loop; the connection table is in connections.c, what each message is answered with in
 * handlers.c, the live set in live_set.c.
 *
 * Locking: what guards each field of struct hd_collector is its "Sync:" note
 * (collector_internal.h); the order is scan_lock, then lock, then the worker's lock, with
 * log_lock innermost. Process entries are reference-counted: a stream or a queued exit snapshot
 * keeps the tables of a process mapped after it has exited. */
#define _GNU_SOURCE
#include "heapdump/collector.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "collector_internal.h"
#include "connections.h"
#include "heapdump/contract/must_check.h"

/* Warnings and errors are what a hostile or broken peer provokes at will (refused connections,
 * failed accepts, bad tables): each message format gets at most LOG_BURST lines per
 * LOG_WINDOW_NS, and the first line of a later window says how many were left out. Whether a
 * line may be written; *left_out: lines of this format dropped in the window that just ended. */
static bool log_budget_allows(hd_collector *c, const char *fmt, unsigned *left_out) {
  const uint64_t now = hd_monotonic_ns();
  *left_out = 0;
  pthread_mutex_lock(&c->log_lock);
  hd_log_budget *b = NULL, *oldest = &c->log_budgets[0];
  for (size_t i = 0; i < HD_LOG_FORMATS && b == NULL; i++) {
    hd_log_budget *x = &c->log_budgets[i];
    if (x->fmt == fmt || x->fmt == NULL) b = x;
    if (x->window_start_ns < oldest->window_start_ns) oldest = x;
  }
  if (b == NULL) {
    b = oldest; /* more formats than slots: the stalest is forgotten */
    *b = (hd_log_budget){0};
  }
  if (b->fmt == NULL || now - b->window_start_ns >= HD_LOG_WINDOW_NS) {
    *left_out = b->left_out;
    *b = (hd_log_budget){.fmt = fmt, .window_start_ns = now};
  }
  bool allowed = b->lines < HD_LOG_BURST;
  if (allowed) {
    b->lines++;
  } else {
    b->left_out++;
  }
  pthread_mutex_unlock(&c->log_lock);
  return allowed;
}

void hd_log(hd_collector *c, int level, const char *fmt, ...) {
  if (level <= HD_LOG_WARN) atomic_fetch_add(&c->warnings_logged, 1);
  if (level > c->log_level) return;
  unsigned left_out = 0;
  if (level <= HD_LOG_WARN && !log_budget_allows(c, fmt, &left_out)) return;
  static const char *names[] = {"error", "warn", "info", "debug"};
  char line[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  localtime_r(&ts.tv_sec, &tm);
  if (left_out > 0) {
    fprintf(stderr,
            "heapdump-collector %02d:%02d:%02d %s: (%u more lines like the next were left out)\n",
            tm.tm_hour, tm.tm_min, tm.tm_sec, names[level], left_out);
  }
  fprintf(stderr, "heapdump-collector %02d:%02d:%02d %s: %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
          names[level], line);
}

uint64_t hd_monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int hd_start_thread(pthread_t *thread, const pthread_attr_t *attr, void *(*run)(void *),
                    void *arg) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  const int rc = pthread_create(thread, attr, run, arg);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return rc;
}

void hd_wake_poll_thread(hd_collector *c) {
  char byte = 1;
  ssize_t n = write(c->wake[1], &byte, 1); /* a full pipe already wakes it */
  (void)n;
}

int hd_default_socket_path(char *out, unsigned long size) {
  const unsigned uid = (unsigned)getuid();
  return hd_socket_path(getenv(HD_ENV_SOCKET), getenv(HD_ENV_RUNTIME_DIR), &uid, out, size) == 0
             ? 0
             : -ENAMETOOLONG;
}

/* Creates the socket's directory 0700, or checks that an existing one is ours and private, so
 * no other user can plant or replace the socket. */
static HD_MUST_CHECK int prepare_socket_dir(hd_collector *c, const char *socket_path) {
  char dir[sizeof c->socket_path];
  snprintf(dir, sizeof dir, "%s", socket_path);
  char *slash = strrchr(dir, '/');
  if (slash == NULL || slash == dir) return 0;
  *slash = '\0';
  if (mkdir(dir, 0700) == 0) {
    (void)chmod(dir, 0700); /* private whatever the umask (0277 would leave it 0500) */
  } else if (errno != EEXIST) {
    hd_log(c, HD_LOG_ERROR, "cannot create %s: %s", dir, strerror(errno));
    return -errno;
  }
  struct stat st;
  if (lstat(dir, &st) != 0) return -errno;
  if (!S_ISDIR(st.st_mode) || st.st_uid != getuid() || (st.st_mode & 077) != 0) {
    hd_log(c, HD_LOG_ERROR,
           "%s must be a directory owned by uid %u with mode 0700 (it is uid %u, mode %o)", dir,
           (unsigned)getuid(), (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777));
    return -EPERM;
  }
  return 0;
}

/* ---- lifecycle ---- */

int hd_collector_create(const hd_collector_options *options, hd_collector **out) {
  hd_collector *c = calloc(1, sizeof *c);
  if (c == NULL) return -ENOMEM;
  pthread_mutex_init(&c->lock, NULL);
  pthread_mutex_init(&c->scan_lock, NULL);
  pthread_mutex_init(&c->log_lock, NULL);
  pthread_cond_init(&c->streams_done, NULL);
  atomic_init(&c->stop_requested, false);
  c->listen_fd = -1;
  c->storage_fd = -1;
  c->wake[0] = c->wake[1] = -1;
  c->conns = calloc(1, sizeof *c->conns);
  c->scratch = malloc(sizeof *c->scratch);
  c->exit_records = calloc(HD_EXIT_RECORDS, sizeof *c->exit_records);
  if (c->conns == NULL || c->scratch == NULL || c->exit_records == NULL) {
    hd_collector_destroy(c);
    return -ENOMEM;
  }
  c->log_level = options->log_level;
  c->max_stored = options->max_stored;
  c->max_storage_bytes = options->max_storage_bytes;
  c->idle_timeout_ns = (uint64_t)(options->idle_timeout_seconds ? options->idle_timeout_seconds
                                                                : HD_DEFAULT_IDLE_TIMEOUT_SECONDS) *
                       1000000000u;
  c->max_contents_bytes = options->max_contents_bytes;
  c->sample_interval_ns = options->no_sampling ? 0
                                               : (uint64_t)(options->sample_interval_ms
                                                                ? options->sample_interval_ms
                                                                : HD_DEFAULT_SAMPLE_INTERVAL_MS) *
                                                     1000000u;
  c->trigger_live_bytes = options->trigger_live_bytes;
  c->trigger_limit_percent = options->trigger_limit_percent;
  c->read_timeout_ns = (uint64_t)(options->read_timeout_seconds ? options->read_timeout_seconds
                                                                : HD_DEFAULT_READ_TIMEOUT_SECONDS) *
                       1000000000u;
  int rc = 0;
  if (options->socket_path != NULL) {
    if (snprintf(c->socket_path, sizeof c->socket_path, "%s", options->socket_path) >=
        (int)sizeof c->socket_path) {
      rc = -ENAMETOOLONG;
    }
  } else {
    rc = hd_default_socket_path(c->socket_path, sizeof c->socket_path);
  }
  if (rc == 0) rc = hd_storage_open(c, options->storage_dir);
  if (rc == 0) rc = prepare_socket_dir(c, c->socket_path);
  if (rc == 0) {
    rc = hd_socket_identity(c->socket_path, NULL, c->socket_identity, sizeof c->socket_identity);
  }
  if (rc == 0 && pipe2(c->wake, O_CLOEXEC | O_NONBLOCK) != 0) rc = -errno;
  if (rc == 0) {
    /* Another collector already serving this socket must not lose it to us. */
    int probe;
    if (hd_channel_connect(c->socket_path, &probe) == HD_OK) {
      close(probe);
      hd_log(c, HD_LOG_ERROR, "a collector is already listening on %s", c->socket_path);
      rc = -EADDRINUSE;
    }
  }
  /* Before listening: whoever can connect finds the page ready (an older layout's replaced).
   * Without it the collector still serves everything else: dormant processes then cannot be
   * armed (ArmProcess says so). */
  if (rc == 0) (void)hd_arming_open(c);
  if (rc == 0 && hd_channel_listen(c->socket_path, 128, &c->listen_fd) != HD_OK) {
    rc = -errno;
    hd_log(c, HD_LOG_ERROR, "cannot listen on %s: %s", c->socket_path, strerror(errno));
  }
  if (rc == 0 && fcntl(c->listen_fd, F_SETFL, fcntl(c->listen_fd, F_GETFL) | O_NONBLOCK) != 0) {
    rc = -errno;
  }
  if (rc == 0) rc = hd_worker_start(c);
  if (rc == 0) rc = hd_sampler_start(c);
  if (rc != 0) {
    hd_collector_destroy(c);
    return rc;
  }
  hd_log(c, HD_LOG_INFO, "listening on %s, storing snapshots in %s", c->socket_path,
         c->storage_dir);
  /* After listen: a process starting now either registers (and is merged) or is found here. */
  hd_discover_processes(c, true);
  *out = c;
  return 0;
}

void hd_collector_stop(hd_collector *c) {
  atomic_store(&c->stop_requested, true); /* lock-free, so async-signal-safe */
  hd_wake_poll_thread(c);
}

void hd_collector_take_census(hd_collector *c, hd_collector_census *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&c->lock);
  for (size_t i = 0; i < c->process_count; i++) {
    const hd_process *p = c->processes[i];
    if (hd_process_alive(p)) {
      if (out->running < sizeof out->running_list / sizeof out->running_list[0]) {
        out->running_list[out->running].pid = (uint32_t)p->pid;
        snprintf(out->running_list[out->running].name, sizeof out->running_list[0].name, "%s",
                 p->name);
      }
      out->running++;
    } else {
      out->exited_unhandled++;
    }
  }
  out->exits_pending = hd_worker_exits_pending(c); /* under the lock: see hd_worker_reserve_exit */
  pthread_mutex_unlock(&c->lock);
}

size_t hd_live_processes(hd_collector *c, hd_process **out) {
  size_t n = 0;
  pthread_mutex_lock(&c->lock);
  for (size_t i = 0; i < c->process_count; i++) out[n++] = hd_process_retain(c->processes[i]);
  pthread_mutex_unlock(&c->lock);
  return n;
}

int hd_collector_run(hd_collector *c) {
  struct pollfd *fds = calloc(2 + HD_MAX_CONNECTIONS + HD_MAX_PROCESSES, sizeof *fds);
  hd_process **watched = calloc(HD_MAX_PROCESSES, sizeof *watched);
  if (fds == NULL || watched == NULL) {
    free(fds);
    free(watched);
    return -ENOMEM;
  }
  int rc = 0;
  bool idle_watch = false;
  while (!atomic_load(&c->stop_requested)) {
    size_t n = c->conns->count;
    fds[0] = (struct pollfd){.fd = c->wake[0], .events = POLLIN};
    /* While accepting is paused, the listening socket is left out (a negative fd is ignored). */
    const uint64_t now = hd_monotonic_ns();
    const bool accept_paused = now < c->accept_paused_until_ns;
    fds[1] = (struct pollfd){.fd = accept_paused ? -1 : c->listen_fd, .events = POLLIN};
    for (size_t i = 0; i < n; i++) {
      fds[2 + i] = (struct pollfd){.fd = c->conns->items[i].fd, .events = POLLIN};
    }
    size_t w = hd_live_processes(c, watched);
    for (size_t i = 0; i < w; i++) {
      fds[2 + n + i] = (struct pollfd){.fd = watched[i]->pidfd, .events = POLLIN};
    }
    int timeout_ms = idle_watch ? 1000 : -1;
    if (accept_paused) {
      const int pause_ms = (int)((c->accept_paused_until_ns - now) / 1000000u) + 1;
      if (timeout_ms < 0 || pause_ms < timeout_ms) timeout_ms = pause_ms;
    }
    int ready = poll(fds, 2 + n + w, timeout_ms);
    if (ready < 0 && errno != EINTR) {
      rc = -errno;
      hd_log(c, HD_LOG_ERROR, "poll failed: %s", strerror(errno));
    }
    if (ready > 0) {
      if (fds[0].revents) {
        char drain[64];
        while (read(c->wake[0], drain, sizeof drain) > 0) continue;
      }
      /* Walk backwards: closing swaps the last connection into the closed one's place. */
      for (size_t i = n; i-- > 0;) {
        if (fds[2 + i].revents == 0) continue;
        if (i >= c->conns->count || c->conns->items[i].fd != fds[2 + i].fd) continue;
        if (!hd_serve_connection(c, i)) hd_conn_close(c, i);
      }
      for (size_t i = 0; i < w; i++) {
        if (fds[2 + n + i].revents) hd_process_exited(c, watched[i]);
      }
      if (fds[1].revents & POLLIN) hd_accept_connections(c);
    }
    idle_watch = hd_close_idle_connections(c);
    for (size_t i = 0; i < w; i++) hd_process_release(watched[i]);
    if (rc != 0) break;
  }
  /* Processes that exited just before the stop still get their exit snapshots. */
  size_t w = hd_live_processes(c, watched);
  for (size_t i = 0; i < w; i++) {
    if (!hd_process_alive(watched[i])) hd_process_exited(c, watched[i]);
    hd_process_release(watched[i]);
  }
  free(fds);
  free(watched);
  hd_log(c, HD_LOG_INFO, "shutting down");
  return rc;
}

void hd_collector_destroy(hd_collector *c) {
  if (c == NULL) return;
  if (c->conns != NULL) {
    while (c->conns->count > 0) hd_conn_close(c, c->conns->count - 1);
  }
  hd_sampler_stop(c);
  hd_wait_streams(c);
  hd_worker_stop(c); /* after the streams, and it finishes the queued exit snapshots */
  pthread_mutex_lock(&c->lock);
  while (c->process_count > 0) {
    hd_process *p = c->processes[--c->process_count];
    p->live = false;
    hd_process_release(p);
  }
  pthread_mutex_unlock(&c->lock);
  if (c->listen_fd >= 0) {
    close(c->listen_fd);
    unlink(c->socket_path);
  }
  if (c->wake[0] >= 0) close(c->wake[0]);
  if (c->wake[1] >= 0) close(c->wake[1]);
  hd_arming_close(c);
  hd_storage_close(c);
  free(c->conns);
  free(c->scratch);
  free(c->exit_records);
  pthread_mutex_destroy(&c->lock);
  pthread_mutex_destroy(&c->scan_lock);
  pthread_mutex_destroy(&c->log_lock);
  pthread_cond_destroy(&c->streams_done);
  free(c);
}
