/* The collector: a poll loop that accepts connections on one socket, tells registry connections
 * (instrumented processes) from client connections by their first message, and hands every
 * snapshot stream to a worker thread of its own, so that a slow client never delays anyone else.
 *
 * Locking: `lock` protects the process list, the stored-snapshot list and next_id. Process
 * entries are reference-counted: a stream keeps the tables of a process mapped after it exits. */
#define _GNU_SOURCE
#include "heapdump/collector.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "collector_internal.h"
#include "heapdump_client.bindings.h"
#include "heapdump_process.bindings.h"

#define MAX_CONNECTIONS 1024

void hd_log(hd_collector *c, int level, const char *fmt, ...) {
  if (level > c->log_level) return;
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
  fprintf(stderr, "heapdump-collector %02d:%02d:%02d %s: %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
          names[level], line);
}

int hd_default_socket_path(char *out, unsigned long size) {
  const char *env = getenv("HEAPDUMP_SOCKET");
  int n;
  if (env != NULL && env[0] != '\0') {
    n = snprintf(out, size, "%s", env);
  } else if (getenv("XDG_RUNTIME_DIR") != NULL && getenv("XDG_RUNTIME_DIR")[0] == '/') {
    n = snprintf(out, size, "%s/heapdump/collector.sock", getenv("XDG_RUNTIME_DIR"));
  } else {
    n = snprintf(out, size, "/tmp/heapdump-%u/collector.sock", (unsigned)getuid());
  }
  return (n < 0 || (unsigned long)n >= size) ? -ENAMETOOLONG : 0;
}

/* Creates the socket's directory 0700, or checks that an existing one is ours and private, so
 * no other user can plant or replace the socket. */
static int prepare_socket_dir(hd_collector *c, const char *socket_path) {
  char dir[sizeof c->socket_path];
  snprintf(dir, sizeof dir, "%s", socket_path);
  char *slash = strrchr(dir, '/');
  if (slash == NULL || slash == dir) return 0;
  *slash = '\0';
  if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
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

/* ---- processes ---- */

void hd_process_release(hd_process *p) {
  if (p == NULL || atomic_fetch_sub(&p->refs, 1) != 1) return;
  hd_alloc_reader_close(p->alloc);
  hd_res_reader_close(p->res);
  free(p);
}

static hd_process *process_retain(hd_process *p) {
  atomic_fetch_add(&p->refs, 1);
  return p;
}

/* ---- connections ---- */

enum conn_kind { CONN_NEW, CONN_REGISTRY, CONN_SINK, CONN_CLIENT, CONN_ITERATOR };

typedef struct conn {
  int fd;
  enum conn_kind kind;
  struct ucred peer;
  hd_process *process;           /* CONN_REGISTRY, CONN_SINK */
  hd_stored_list listing;        /* CONN_ITERATOR: a copy of the matching snapshots */
} conn;

struct conn_table {
  conn items[MAX_CONNECTIONS];
  size_t count;
};

static bool add_conn(hd_collector *c, int fd, enum conn_kind kind, hd_process *process,
                     const struct ucred *peer) {
  if (c->conns->count == MAX_CONNECTIONS) {
    hd_log(c, HD_LOG_WARN, "too many connections; refusing one");
    close(fd);
    return false;
  }
  int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK); /* a peer that stops reading cannot block the loop */
  conn *k = &c->conns->items[c->conns->count++];
  memset(k, 0, sizeof *k);
  k->fd = fd;
  k->kind = kind;
  k->process = process;
  if (peer != NULL) k->peer = *peer;
  return true;
}

/* A process leaves the live set when both its registry connection and its sink are gone. */
static void process_connection_closed(hd_collector *c, hd_process *p) {
  pthread_mutex_lock(&c->lock);
  p->open_channels--;
  bool exited = p->open_channels == 0 && p->live;
  if (exited) {
    p->live = false;
    for (size_t i = 0; i < c->process_count; i++) {
      if (c->processes[i] == p) {
        c->processes[i] = c->processes[--c->process_count];
        break;
      }
    }
  }
  pthread_mutex_unlock(&c->lock);
  if (exited) {
    hd_log(c, HD_LOG_INFO, "process %s[%u] exited", p->name, (unsigned)p->pid);
    if (p->exit_snapshot) hd_store_exit_snapshot(c, p);
    hd_process_release(p); /* the live set's reference */
  }
}

static void close_conn(hd_collector *c, size_t index) {
  conn *k = &c->conns->items[index];
  close(k->fd);
  if (k->process != NULL) {
    process_connection_closed(c, k->process);
    hd_process_release(k->process);
  }
  free(k->listing.items);
  c->conns->items[index] = c->conns->items[--c->conns->count];
}

/* ---- Registry ---- */

typedef struct handler_ctx {
  hd_collector *c;
  conn *k;
  bool close_after; /* the request was refused: drop the connection */
} handler_ctx;

static bool read_proc_name(pid_t pid, char *out, size_t size) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/comm", (int)pid);
  FILE *f = fopen(path, "re");
  if (f == NULL) return false;
  bool ok = fgets(out, (int)size, f) != NULL;
  fclose(f);
  if (ok) out[strcspn(out, "\n")] = '\0';
  return ok;
}

/* A memfd, not a file or device someone passed to make us map it. */
static bool is_memfd(int fd) {
  char link[64], target[128];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof target - 1);
  if (n <= 0) return false;
  target[n] = '\0';
  return strncmp(target, "/memfd:", 7) == 0;
}

static hd_status reply_register(handler_ctx *h, hd_message *msg,
                                heapdump_process_RegistryError error) {
  heapdump_process_RegistryRegisterResponse resp = heapdump_process_RegistryRegisterResponse_init_zero;
  resp.has_protocol_version = true;
  resp.protocol_version = heapdump_process_Version_PROTOCOL_VERSION;
  if (error != heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED) {
    resp.has_error = true;
    resp.error = error;
    h->close_after = true;
  }
  uint32_t txid = msg->txid;
  return hd_registry_register_reply(h->k->fd, msg, txid, &resp);
}

static hd_status on_register(void *ctx, hd_message *msg,
                             heapdump_process_RegistryRegisterRequest *req) {
  handler_ctx *h = ctx;
  hd_collector *c = h->c;
  if (h->k->kind != CONN_NEW) {
    return reply_register(h, msg, heapdump_process_RegistryError_NOT_ALLOWED);
  }
  if (!req->has_protocol_version || req->protocol_version != heapdump_process_Version_PROTOCOL_VERSION ||
      !req->has_layout_version || req->layout_version != HD_LAYOUT_VERSION) {
    hd_log(c, HD_LOG_WARN, "pid %u: unsupported protocol %u / layout %u", (unsigned)h->k->peer.pid,
           req->protocol_version, req->layout_version);
    return reply_register(h, msg, heapdump_process_RegistryError_UNSUPPORTED_VERSION);
  }
  if (!req->has_pid || req->pid != (uint64_t)h->k->peer.pid) {
    hd_log(c, HD_LOG_WARN, "pid %u tried to register pid %llu", (unsigned)h->k->peer.pid,
           (unsigned long long)req->pid);
    return reply_register(h, msg, heapdump_process_RegistryError_NOT_ALLOWED);
  }
  int alloc_fd = hd_message_take_fd(msg, &req->allocations_table);
  int res_fd = hd_message_take_fd(msg, &req->resources_table);
  int sink_fd = hd_message_take_fd(msg, &req->snapshot_sink);
  hd_process *p = calloc(1, sizeof *p);
  heapdump_process_RegistryError error = heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED;
  hd_read_status rs = HD_READ_OK;
  if (p == NULL) {
    error = heapdump_process_RegistryError_BAD_TABLE;
  } else if (!is_memfd(alloc_fd) || !is_memfd(res_fd)) {
    error = heapdump_process_RegistryError_BAD_TABLE;
  } else if ((rs = hd_alloc_reader_open(alloc_fd, &p->alloc)) != HD_READ_OK ||
             (rs = hd_res_reader_open(res_fd, &p->res)) != HD_READ_OK) {
    error = heapdump_process_RegistryError_BAD_TABLE;
  }
  close(alloc_fd);
  close(res_fd);
  if (error != heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED) {
    hd_log(c, HD_LOG_WARN, "pid %u: refused tables: %s", (unsigned)h->k->peer.pid,
           rs != HD_READ_OK ? hd_read_status_str(rs) : "not memfds");
    close(sink_fd);
    if (p != NULL) {
      hd_alloc_reader_close(p->alloc);
      hd_res_reader_close(p->res);
      free(p);
    }
    return reply_register(h, msg, error);
  }
  atomic_init(&p->refs, 1); /* the live set's reference */
  pthread_mutex_init(&p->read_lock, NULL);
  p->pid = (pid_t)req->pid;
  p->uid = h->k->peer.uid;
  p->exit_snapshot = req->has_exit_snapshot && req->exit_snapshot;
  p->live = true;
  if (req->has_process_name && req->process_name[0] != '\0') {
    snprintf(p->name, sizeof p->name, "%s", req->process_name);
  } else if (!read_proc_name(p->pid, p->name, sizeof p->name)) {
    snprintf(p->name, sizeof p->name, "pid%u", (unsigned)p->pid);
  }
  hd_status status = reply_register(h, msg, error);
  if (status != HD_OK) {
    close(sink_fd);
    hd_process_release(p);
    return status;
  }
  pthread_mutex_lock(&c->lock);
  bool duplicate = false;
  for (size_t i = 0; i < c->process_count; i++) duplicate |= c->processes[i]->pid == p->pid;
  if (!duplicate && c->process_count < HD_MAX_PROCESSES) {
    c->processes[c->process_count++] = p;
    p->open_channels = 2;
  }
  pthread_mutex_unlock(&c->lock);
  if (p->open_channels == 0) {
    hd_log(c, HD_LOG_WARN, "pid %u registered twice (or too many processes)", (unsigned)p->pid);
    close(sink_fd);
    hd_process_release(p);
    h->close_after = true;
    return HD_OK;
  }
  h->k->kind = CONN_REGISTRY;
  h->k->process = process_retain(p);
  if (add_conn(c, sink_fd, CONN_SINK, process_retain(p), NULL)) {
    c->conns->items[c->conns->count - 1].peer = h->k->peer;
  } else {
    process_connection_closed(c, p);
    hd_process_release(p);
  }
  hd_log(c, HD_LOG_INFO, "registered %s[%u]%s", p->name, (unsigned)p->pid,
         p->exit_snapshot ? " (exit snapshot on)" : "");
  return HD_OK;
}

static hd_status on_store_named_snapshot(void *ctx, hd_message *msg,
                                         heapdump_process_SnapshotSinkStoreNamedSnapshotRequest *req) {
  handler_ctx *h = ctx;
  int fd = hd_message_take_fd(msg, &req->allocations_snapshot);
  heapdump_process_SnapshotSinkStoreNamedSnapshotResponse resp =
      heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_init_zero;
  uint32_t id = 0;
  int rc = is_memfd(fd) ? hd_store_named_snapshot(h->c, h->k->process, req->has_name ? req->name : "",
                                                  fd, &id)
                        : -EINVAL;
  close(fd);
  if (rc == 0) {
    resp.has_snapshot_id = true;
    resp.snapshot_id = id;
  } else {
    resp.has_error = true;
    resp.error = rc == -EINVAL ? heapdump_process_StoreError_INVALID_SNAPSHOT
                               : heapdump_process_StoreError_STORAGE_FAILED;
  }
  uint32_t txid = msg->txid;
  return hd_snapshot_sink_store_named_snapshot_reply(h->k->fd, msg, txid, &resp);
}

/* ---- Collector (clients) ---- */

/* Processes matching a selector that this peer may see. The caller releases the references. */
static heapdump_client_CollectorError select_processes(hd_collector *c, const struct ucred *peer,
                                                       bool has_selector,
                                                       const heapdump_client_ProcessSelector *sel,
                                                       bool multi, hd_process **out,
                                                       size_t *count) {
  *count = 0;
  if (has_selector && sel->which_selector != heapdump_client_ProcessSelector_by_name_tag &&
      sel->which_selector != heapdump_client_ProcessSelector_by_koid_tag) {
    return heapdump_client_CollectorError_PROCESS_SELECTOR_UNSUPPORTED;
  }
  pthread_mutex_lock(&c->lock);
  for (size_t i = 0; i < c->process_count; i++) {
    hd_process *p = c->processes[i];
    if (peer->uid != 0 && p->uid != peer->uid) continue;
    if (has_selector && sel->which_selector == heapdump_client_ProcessSelector_by_name_tag &&
        strcmp(p->name, sel->selector.by_name) != 0) {
      continue;
    }
    if (has_selector && sel->which_selector == heapdump_client_ProcessSelector_by_koid_tag &&
        (uint64_t)p->pid != sel->selector.by_koid) {
      continue;
    }
    out[(*count)++] = process_retain(p);
  }
  pthread_mutex_unlock(&c->lock);
  if (*count == 0) return heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH;
  if (*count > 1 && !multi) {
    for (size_t i = 0; i < *count; i++) hd_process_release(out[i]);
    *count = 0;
    return heapdump_client_CollectorError_PROCESS_SELECTOR_AMBIGUOUS;
  }
  return heapdump_client_CollectorError_COLLECTOR_ERROR_UNSPECIFIED;
}

/* A stream job for a client request that streams to the receiver its handle names. */
static hd_stream_job *new_stream_job(handler_ctx *h, hd_message *msg,
                                     const heapdump_client_Handle *receiver) {
  h->k->kind = CONN_CLIENT;
  hd_stream_job *job = calloc(1, sizeof *job);
  if (job == NULL) return NULL;
  job->c = h->c;
  job->receiver = hd_message_take_fd(msg, receiver);
  job->peer_uid = h->k->peer.uid;
  return job;
}

static hd_status on_take_live_snapshot(void *ctx, hd_message *msg,
                                       heapdump_client_CollectorTakeLiveSnapshotRequest *req) {
  handler_ctx *h = ctx;
  hd_stream_job *job = new_stream_job(h, msg, &req->receiver);
  if (job == NULL) return HD_ERR_NO_MEMORY;
  job->with_contents = req->has_with_contents && req->with_contents;
  job->multi_process = req->has_multi_process && req->multi_process;
  job->error = select_processes(h->c, &h->k->peer, req->has_process_selector,
                                &req->process_selector, job->multi_process, job->processes,
                                &job->process_count);
  hd_start_stream(job);
  return HD_OK;
}

static hd_status on_download(void *ctx, hd_message *msg,
                             heapdump_client_CollectorDownloadStoredSnapshotRequest *req) {
  hd_stream_job *job = new_stream_job(ctx, msg, &req->receiver);
  if (job == NULL) return HD_ERR_NO_MEMORY;
  job->stored = true;
  job->stored_id = req->has_snapshot_id ? req->snapshot_id : 0;
  hd_start_stream(job);
  return HD_OK;
}

static hd_status on_list(void *ctx, hd_message *msg,
                         heapdump_client_CollectorListStoredSnapshotsRequest *req) {
  handler_ctx *h = ctx;
  h->k->kind = CONN_CLIENT;
  int fd = hd_message_take_fd(msg, &req->iterator);
  if (req->has_process_selector &&
      req->process_selector.which_selector != heapdump_client_ProcessSelector_by_name_tag &&
      req->process_selector.which_selector != heapdump_client_ProcessSelector_by_koid_tag) {
    close(fd); /* nothing to list for a selector we do not understand */
    return HD_OK;
  }
  hd_stored_list listing = {0};
  if (hd_storage_list(h->c, h->k->peer.uid, req->has_process_selector ? &req->process_selector : NULL,
                      &listing) != 0 ||
      !add_conn(h->c, fd, CONN_ITERATOR, NULL, &h->k->peer)) {
    free(listing.items);
    close(fd);
    return HD_OK;
  }
  h->c->conns->items[h->c->conns->count - 1].listing = listing;
  return HD_OK;
}

static hd_status on_get_next(void *ctx, hd_message *msg,
                             heapdump_client_StoredSnapshotIteratorGetNextRequest *req) {
  (void)req;
  handler_ctx *h = ctx;
  return hd_storage_send_page(h->k->fd, msg, &h->k->listing);
}

static const hd_registry_server registry_server = {.register_ = on_register};
static const hd_snapshot_sink_server sink_server = {.store_named_snapshot = on_store_named_snapshot};
static const hd_collector_server collector_server = {
    .take_live_snapshot = on_take_live_snapshot,
    .list_stored_snapshots = on_list,
    .download_stored_snapshot = on_download};
static const hd_stored_snapshot_iterator_server iterator_server = {.get_next = on_get_next};

/* Handles one readable connection; returns false if it must be closed. */
static bool serve(hd_collector *c, size_t index) {
  int fd = c->conns->items[index].fd;
  hd_message *msg = c->scratch;
  hd_status status = hd_message_recv(fd, msg);
  if (status == HD_ERR_PEER_CLOSED) return false;
  handler_ctx h = {c, &c->conns->items[index], false};
  enum conn_kind kind = h.k->kind;
  if (status == HD_OK) {
    switch (kind) {
      case CONN_NEW:
        status = hd_registry_dispatch(&registry_server, &h, msg);
        if (status == HD_ERR_UNKNOWN_ORDINAL) status = hd_collector_dispatch(&collector_server, &h, msg);
        break;
      case CONN_CLIENT:
        status = hd_collector_dispatch(&collector_server, &h, msg);
        break;
      case CONN_SINK:
        status = hd_snapshot_sink_dispatch(&sink_server, &h, msg);
        break;
      case CONN_ITERATOR:
        status = hd_stored_snapshot_iterator_dispatch(&iterator_server, &h, msg);
        break;
      case CONN_REGISTRY:
        status = HD_ERR_UNEXPECTED_MESSAGE; /* nothing follows a registration */
        break;
    }
  }
  hd_message_close_fds(msg);
  if (status != HD_OK) {
    hd_log(c, HD_LOG_WARN, "closing connection of pid %u: %s", (unsigned)c->conns->items[index].peer.pid,
           hd_status_str(status));
    return false;
  }
  return !h.close_after;
}

static void accept_connection(hd_collector *c) {
  int fd = accept4(c->listen_fd, NULL, NULL, SOCK_CLOEXEC);
  if (fd < 0) return;
  struct ucred peer;
  socklen_t len = sizeof peer;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) {
    close(fd);
    return;
  }
  if (peer.uid != getuid() && peer.uid != 0) {
    hd_log(c, HD_LOG_WARN, "refused connection from uid %u (pid %u)", (unsigned)peer.uid,
           (unsigned)peer.pid);
    close(fd);
    return;
  }
  add_conn(c, fd, CONN_NEW, NULL, &peer);
}

/* ---- lifecycle ---- */

int hd_collector_create(const hd_collector_options *options, hd_collector **out) {
  hd_collector *c = calloc(1, sizeof *c);
  if (c == NULL) return -ENOMEM;
  c->conns = calloc(1, sizeof *c->conns);
  c->scratch = malloc(sizeof *c->scratch);
  if (c->conns == NULL || c->scratch == NULL) {
    hd_collector_destroy(c);
    return -ENOMEM;
  }
  c->listen_fd = -1;
  c->wake[0] = c->wake[1] = -1;
  c->log_level = options->log_level;
  c->max_stored = options->max_stored;
  c->max_storage_bytes = options->max_storage_bytes;
  pthread_mutex_init(&c->lock, NULL);
  pthread_cond_init(&c->streams_done, NULL);
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
  if (rc == 0 && hd_channel_listen(c->socket_path, 128, &c->listen_fd) != HD_OK) {
    rc = -errno;
    hd_log(c, HD_LOG_ERROR, "cannot listen on %s: %s", c->socket_path, strerror(errno));
  }
  if (rc != 0) {
    hd_collector_destroy(c);
    return rc;
  }
  hd_log(c, HD_LOG_INFO, "listening on %s, storing snapshots in %s", c->socket_path, c->storage_dir);
  *out = c;
  return 0;
}

void hd_collector_stop(hd_collector *c) {
  char byte = 1;
  ssize_t n = write(c->wake[1], &byte, 1); /* async-signal-safe */
  (void)n;
}

int hd_collector_run(hd_collector *c) {
  struct pollfd *fds = calloc(MAX_CONNECTIONS + 2, sizeof *fds);
  if (fds == NULL) return -ENOMEM;
  bool stopping = false;
  while (!stopping) {
    size_t n = c->conns->count;
    fds[0] = (struct pollfd){.fd = c->wake[0], .events = POLLIN};
    fds[1] = (struct pollfd){.fd = c->listen_fd, .events = POLLIN};
    for (size_t i = 0; i < n; i++) fds[2 + i] = (struct pollfd){.fd = c->conns->items[i].fd, .events = POLLIN};
    if (poll(fds, n + 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents) stopping = true;
    /* Walk backwards: closing swaps the last connection into the closed one's place. */
    for (size_t i = n; i-- > 0;) {
      if (fds[2 + i].revents == 0) continue;
      size_t index = i;
      if (index >= c->conns->count || c->conns->items[index].fd != fds[2 + i].fd) continue;
      if (!serve(c, index)) close_conn(c, index);
    }
    if (fds[1].revents & POLLIN) accept_connection(c);
  }
  free(fds);
  hd_log(c, HD_LOG_INFO, "shutting down");
  return 0;
}

void hd_collector_destroy(hd_collector *c) {
  if (c == NULL) return;
  if (c->conns != NULL) {
    while (c->conns->count > 0) close_conn(c, c->conns->count - 1);
  }
  hd_wait_streams(c);
  pthread_mutex_lock(&c->lock);
  while (c->process_count > 0) hd_process_release(c->processes[--c->process_count]);
  pthread_mutex_unlock(&c->lock);
  if (c->listen_fd >= 0) {
    close(c->listen_fd);
    unlink(c->socket_path);
  }
  if (c->wake[0] >= 0) close(c->wake[0]);
  if (c->wake[1] >= 0) close(c->wake[1]);
  hd_storage_close(c);
  free(c->conns);
  free(c->scratch);
  pthread_mutex_destroy(&c->lock);
  pthread_cond_destroy(&c->streams_done);
  free(c);
}
