/* The collector: a poll loop that accepts connections on one socket, tells registry connections
 * (instrumented processes) from client connections by their first message, watches the exit of
 * every live process through its pidfd, and hands all slow work elsewhere: snapshot streams to
 * stream threads (a bounded pool), storing snapshots to the storage workers. So a slow client or
 * a big snapshot never delays anyone else. The live set it keeps is in live_set.c.
 *
 * Locking: `lock` protects the live set, the stored-snapshot list and next_id. Process entries
 * are reference-counted: a stream or a queued exit snapshot keeps the tables of a process mapped
 * after it has exited. */
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
#include "contents.h"
#include "heapdump_client.bindings.h"
#include "heapdump_process.bindings.h"

#define MAX_CONNECTIONS 1024

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
    fprintf(stderr, "heapdump-collector %02d:%02d:%02d %s: (%u more lines like the next were left out)\n",
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

/* ---- connections ---- */

enum conn_kind { CONN_NEW, CONN_REGISTRY, CONN_SINK, CONN_CLIENT, CONN_ITERATOR };

typedef struct conn {
  int fd;
  enum conn_kind kind;
  struct ucred peer;
  hd_process *process;    /* CONN_REGISTRY, CONN_SINK */
  hd_stored_list listing; /* CONN_ITERATOR: a copy of the matching snapshots */
  heapdump_client_CollectorError listing_error; /* CONN_ITERATOR: answered instead */
  uint64_t last_active_ns; /* when it was accepted or last sent a message */
} conn;

struct conn_table {
  conn items[MAX_CONNECTIONS];
  size_t count;
};

/* Adds a connection served by the poll loop; takes fd and the reference to process. */
static bool add_conn(hd_collector *c, int fd, enum conn_kind kind, hd_process *process,
                     const struct ucred *peer) {
  if (c->conns->count == MAX_CONNECTIONS) {
    hd_log(c, HD_LOG_WARN, "too many connections; refusing one");
    close(fd);
    hd_process_release(process);
    return false;
  }
  int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK); /* a peer that stops reading cannot block the loop */
  conn *k = &c->conns->items[c->conns->count++];
  memset(k, 0, sizeof *k);
  k->fd = fd;
  k->kind = kind;
  k->process = process;
  k->last_active_ns = hd_monotonic_ns();
  if (peer != NULL) k->peer = *peer;
  return true;
}

static void close_conn(hd_collector *c, size_t index) {
  conn *k = &c->conns->items[index];
  close(k->fd);
  if (k->process != NULL) hd_process_release(k->process);
  free(k->listing.items);
  c->conns->items[index] = c->conns->items[--c->conns->count];
}

/* Clients, iterators and connections that have not said what they are come and go; registry
 * and sink connections live as long as their process, idle or not. */
static bool may_idle_out(const conn *k) {
  return k->kind == CONN_NEW || k->kind == CONN_CLIENT || k->kind == CONN_ITERATOR;
}

/* Closes client connections idle for longer than the idle timeout, or, once the table is three
 * quarters full, for longer than a second: idle or abandoned clients never lock out new clients
 * and processes. Returns whether any connection may still idle out (the loop then wakes up to
 * look again). */
static bool close_idle_connections(hd_collector *c) {
  const uint64_t now = hd_monotonic_ns();
  const bool crowded = c->conns->count >= MAX_CONNECTIONS / 4 * 3;
  const uint64_t limit = crowded ? 1000000000u : c->idle_timeout_ns;
  bool any = false;
  for (size_t i = c->conns->count; i-- > 0;) {
    conn *k = &c->conns->items[i];
    if (!may_idle_out(k)) continue;
    if (now - k->last_active_ns > limit) {
      hd_log(c, HD_LOG_DEBUG, "closing a connection of pid %u idle for %llu s", (unsigned)k->peer.pid,
             (unsigned long long)((now - k->last_active_ns) / 1000000000u));
      close_conn(c, i);
    } else {
      any = true;
    }
  }
  return any;
}

/* ---- Registry ---- */

typedef struct handler_ctx {
  hd_collector *c;
  conn *k;
  bool close_after; /* the request was refused: drop the connection */
} handler_ctx;

/* A reply is encoded into the request's buffer, which forgets the request's descriptors: every
 * reply first closes those the handler did not take. */
static hd_status reply_register(handler_ctx *h, hd_message *msg,
                                heapdump_process_RegistryError error) {
  hd_message_close_fds(msg);
  heapdump_process_RegistryRegisterResponse resp = heapdump_process_RegistryRegisterResponse_init_zero;
  resp.has_protocol_version = true;
  resp.protocol_version = heapdump_process_Version_PROTOCOL_VERSION;
  if (error != heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED) {
    resp.has_error = true;
    resp.error = error;
    h->close_after = true;
  }
  uint32_t txid = msg->txid;
  return hd_fidl_registry_register_reply(h->k->fd, msg, txid, &resp);
}

/* Whether the peer of a connection is still there (it waits for our answer until it exits). */
static bool peer_connected(int fd) {
  struct pollfd pfd = {.fd = fd, .events = POLLRDHUP};
  return poll(&pfd, 1, 0) == 0;
}

/* What a registration brings, until the live set takes it. */
typedef struct registration {
  pid_t pid, own_pid;
  int sink_fd, pidfd;
  hd_alloc_reader *alloc;
  hd_res_reader *res;
  struct stat table; /* the allocations table's identity */
} registration;

static void drop_registration(registration *reg) {
  if (reg->pidfd >= 0) close(reg->pidfd);
  if (reg->sink_fd >= 0) close(reg->sink_fd);
  hd_alloc_reader_close(reg->alloc);
  hd_res_reader_close(reg->res);
}

/* Checks the versions and the pid the process claims; UNSPECIFIED if they hold. A process in a
 * container's PID namespace knows itself by another pid than ours: the kernel tells both
 * (NSpid), so its claim is checked, not trusted. */
static heapdump_process_RegistryError check_claims(hd_collector *c, pid_t pid,
                                                   const heapdump_process_RegistryRegisterRequest *req,
                                                   pid_t *own_pid) {
  if (!req->has_protocol_version || req->protocol_version != heapdump_process_Version_PROTOCOL_VERSION ||
      !req->has_layout_version || req->layout_version != HD_LAYOUT_VERSION) {
    hd_log(c, HD_LOG_WARN, "pid %u: unsupported protocol %u / layout %u", (unsigned)pid,
           req->protocol_version, req->layout_version);
    return heapdump_process_RegistryError_UNSUPPORTED_VERSION;
  }
  *own_pid = req->has_pid && req->pid != (uint64_t)pid ? hd_own_pid(pid) : pid;
  if (!req->has_pid || *own_pid <= 0 || req->pid != (uint64_t)*own_pid) {
    hd_log(c, HD_LOG_WARN, "pid %u tried to register pid %llu", (unsigned)pid,
           (unsigned long long)req->pid);
    return heapdump_process_RegistryError_NOT_ALLOWED;
  }
  return heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED;
}

/* Takes the tables and the sink out of the message and checks them; false (logged) if refused. */
static bool take_tables(hd_collector *c, hd_message *msg,
                        heapdump_process_RegistryRegisterRequest *req, registration *reg) {
  int alloc_fd = hd_message_take_fd(msg, &req->allocations_table);
  int res_fd = hd_message_take_fd(msg, &req->resources_table);
  reg->sink_fd = hd_message_take_channel(msg, &req->snapshot_sink);
  const char *refused = NULL;
  if (reg->sink_fd < 0) {
    refused = "the snapshot sink is not a channel";
  } else {
    (void)hd_open_process_tables(alloc_fd, res_fd, false, reg->own_pid, &reg->alloc, &reg->res,
                                 &reg->table, &refused);
  }
  close(alloc_fd);
  close(res_fd);
  if (refused != NULL) hd_log(c, HD_LOG_WARN, "pid %u: refused tables: %s", (unsigned)reg->pid, refused);
  return refused == NULL;
}

/* The name the process gives, else its /proc/PID/comm, else "pidN". */
static void registered_name(const heapdump_process_RegistryRegisterRequest *req, pid_t pid,
                            char name[HD_NAME_SIZE]) {
  if (req->has_process_name && req->process_name[0] != '\0') {
    snprintf(name, HD_NAME_SIZE, "%s", req->process_name);
  } else if (!hd_read_process_name(pid, name, HD_NAME_SIZE)) {
    snprintf(name, HD_NAME_SIZE, "pid%u", (unsigned)pid);
  }
}

static hd_status on_register(void *ctx, hd_message *msg,
                             heapdump_process_RegistryRegisterRequest *req) {
  handler_ctx *h = ctx;
  hd_collector *c = h->c;
  registration reg = {.pid = h->k->peer.pid, .sink_fd = -1, .pidfd = -1};
  if (h->k->kind != CONN_NEW) {
    return reply_register(h, msg, heapdump_process_RegistryError_NOT_ALLOWED);
  }
  heapdump_process_RegistryError claims = check_claims(c, reg.pid, req, &reg.own_pid);
  if (claims != heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED) {
    return reply_register(h, msg, claims);
  }
  if (!take_tables(c, msg, req, &reg)) {
    drop_registration(&reg);
    return reply_register(h, msg, heapdump_process_RegistryError_BAD_TABLE);
  }
  /* Opened while the peer still waits for our answer, the pidfd names that very process. Without
   * one, the pid may already name another process, whose memory would be served under this
   * one's name: no pidfd, no registration. */
  reg.pidfd = hd_pidfd_open(reg.pid);
  if (reg.pidfd < 0) {
    hd_log(c, HD_LOG_WARN, "pid %u: refused: cannot watch its exit (pidfd_open: %s)",
           (unsigned)reg.pid, strerror(errno));
    drop_registration(&reg);
    return reply_register(h, msg, heapdump_process_RegistryError_NOT_ALLOWED);
  }
  if (!peer_connected(h->k->fd)) {
    drop_registration(&reg);
    h->close_after = true;
    return HD_OK;
  }
  char name[HD_NAME_SIZE];
  registered_name(req, reg.pid, name);
  bool exit_snapshot = req->has_exit_snapshot && req->exit_snapshot;
  hd_process *p = hd_process_new(reg.pid, reg.own_pid, h->k->peer.uid, name, exit_snapshot,
                                 reg.table.st_dev, reg.table.st_ino, reg.pidfd, reg.alloc, reg.res);
  if (p == NULL) {
    drop_registration(&reg);
    return HD_ERR_NO_MEMORY;
  }
  bool absorbed;
  hd_process *entry = hd_live_set_add(c, p, true, &absorbed);
  if (entry == NULL) {
    hd_log(c, HD_LOG_WARN, "pid %u: too many processes", (unsigned)reg.pid);
    close(reg.sink_fd);
    return reply_register(h, msg, heapdump_process_RegistryError_NOT_ALLOWED);
  }
  h->k->kind = CONN_REGISTRY;
  h->k->process = entry;
  /* Without room for its sink the process is still served; its named snapshots fail. */
  (void)add_conn(c, reg.sink_fd, CONN_SINK, hd_process_retain(entry), &h->k->peer);
  char own[48] = "";
  if (reg.own_pid != reg.pid) {
    snprintf(own, sizeof own, " (pid %u in its PID namespace)", (unsigned)reg.own_pid);
  }
  hd_log(c, HD_LOG_INFO, "registered %s[%u]%s%s%s", name, (unsigned)reg.pid, own,
         exit_snapshot ? " (exit snapshot on)" : "", absorbed ? ", merged with its entry" : "");
  return reply_register(h, msg, heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED);
}

static hd_status reply_store(handler_ctx *h, hd_message *msg,
                             heapdump_process_StoreError error) {
  hd_message_close_fds(msg);
  heapdump_process_SnapshotSinkStoreNamedSnapshotResponse resp =
      heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_init_zero;
  resp.has_error = true;
  resp.error = error;
  uint32_t txid = msg->txid;
  return hd_fidl_snapshot_sink_store_named_snapshot_reply(h->k->fd, msg, txid, &resp);
}

/* Checked here, stored and answered by the storage worker. */
static hd_status on_store_named_snapshot(void *ctx, hd_message *msg,
                                         heapdump_process_SnapshotSinkStoreNamedSnapshotRequest *req) {
  handler_ctx *h = ctx;
  int fd = hd_message_take_fd(msg, &req->allocations_snapshot);
  if (!hd_fd_is_memfd(fd, NULL)) {
    close(fd);
    return reply_store(h, msg, heapdump_process_StoreError_INVALID_SNAPSHOT);
  }
  int reply_fd = fcntl(h->k->fd, F_DUPFD_CLOEXEC, 0);
  int queued = reply_fd < 0 ? -EMFILE
                            : hd_queue_named_snapshot(h->c, h->k->process, req->has_name ? req->name : "",
                                                      fd, reply_fd, msg->txid);
  if (queued != 0) {
    if (reply_fd >= 0) close(reply_fd);
    close(fd);
    if (queued == -EBUSY) {
      hd_log(h->c, HD_LOG_WARN, "%s[%u]: refused a named snapshot: one is still being stored",
             h->k->process->name, (unsigned)h->k->process->pid);
      return reply_store(h, msg, heapdump_process_StoreError_BUSY);
    }
    return reply_store(h, msg, heapdump_process_StoreError_STORAGE_FAILED);
  }
  return HD_OK;
}

/* ---- Collector (clients) ---- */

/* A stream job for a client request that streams to the receiver its handle names; NULL, with
 * *status set, if there is none to stream to. */
static hd_stream_job *new_stream_job(handler_ctx *h, hd_message *msg,
                                     const heapdump_client_Handle *receiver, hd_status *status) {
  h->k->kind = CONN_CLIENT;
  int receiver_fd = hd_message_take_channel(msg, receiver);
  if (receiver_fd < 0) {
    hd_log(h->c, HD_LOG_WARN, "pid %u: request refused: its receiver is not a channel",
           (unsigned)h->k->peer.pid);
    *status = HD_ERR_UNEXPECTED_FD;
    return NULL;
  }
  hd_stream_job *job = calloc(1, sizeof *job);
  if (job == NULL) {
    close(receiver_fd);
    *status = HD_ERR_NO_MEMORY;
    return NULL;
  }
  job->c = h->c;
  job->receiver = receiver_fd;
  job->peer_uid = h->k->peer.uid;
  return job;
}

static hd_status on_take_live_snapshot(void *ctx, hd_message *msg,
                                       heapdump_client_CollectorTakeLiveSnapshotRequest *req) {
  hd_status status;
  hd_stream_job *job = new_stream_job(ctx, msg, &req->receiver, &status);
  if (job == NULL) return status;
  job->with_contents = req->has_with_contents && req->with_contents;
  job->multi_process = req->has_multi_process && req->multi_process;
  job->has_selector = req->has_process_selector;
  job->selector = req->process_selector;
  hd_start_stream(job);
  return HD_OK;
}

static hd_status on_download(void *ctx, hd_message *msg,
                             heapdump_client_CollectorDownloadStoredSnapshotRequest *req) {
  hd_status status;
  hd_stream_job *job = new_stream_job(ctx, msg, &req->receiver, &status);
  if (job == NULL) return status;
  job->stored = true;
  job->stored_id = req->has_snapshot_id ? req->snapshot_id : 0;
  hd_start_stream(job);
  return HD_OK;
}

static hd_status on_list(void *ctx, hd_message *msg,
                         heapdump_client_CollectorListStoredSnapshotsRequest *req) {
  handler_ctx *h = ctx;
  h->k->kind = CONN_CLIENT;
  int fd = hd_message_take_channel(msg, &req->iterator);
  if (fd < 0) {
    hd_log(h->c, HD_LOG_WARN, "pid %u: listing refused: its iterator is not a channel",
           (unsigned)h->k->peer.pid);
    return HD_OK;
  }
  /* Processes found now are watched, so that their exit snapshots are taken. */
  hd_queue_discovery(h->c);
  hd_stored_list listing = {0};
  heapdump_client_CollectorError error = heapdump_client_CollectorError_COLLECTOR_ERROR_UNSPECIFIED;
  if (req->has_process_selector &&
      req->process_selector.which_selector != heapdump_client_ProcessSelector_by_name_tag &&
      req->process_selector.which_selector != heapdump_client_ProcessSelector_by_koid_tag) {
    error = heapdump_client_CollectorError_PROCESS_SELECTOR_UNSUPPORTED;
  } else if (hd_storage_list(h->c, h->k->peer.uid,
                             req->has_process_selector ? &req->process_selector : NULL,
                             &listing) != 0) {
    close(fd); /* out of memory: the client sees the iterator close */
    return HD_OK;
  }
  if (!add_conn(h->c, fd, CONN_ITERATOR, NULL, &h->k->peer)) {
    free(listing.items);
    return HD_OK;
  }
  conn *iterator = &h->c->conns->items[h->c->conns->count - 1];
  iterator->listing = listing;
  iterator->listing_error = error;
  return HD_OK;
}

static hd_status on_delete(void *ctx, hd_message *msg,
                           heapdump_client_CollectorDeleteStoredSnapshotRequest *req) {
  handler_ctx *h = ctx;
  h->k->kind = CONN_CLIENT;
  hd_message_close_fds(msg);
  heapdump_client_CollectorDeleteStoredSnapshotResult result =
      heapdump_client_CollectorDeleteStoredSnapshotResult_init_zero;
  if (req->has_snapshot_id && hd_storage_delete(h->c, req->snapshot_id, h->k->peer.uid) == 0) {
    result.which_result = heapdump_client_CollectorDeleteStoredSnapshotResult_response_tag;
  } else {
    result.which_result = heapdump_client_CollectorDeleteStoredSnapshotResult_err_tag;
    result.result.err = heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND;
  }
  uint32_t txid = msg->txid;
  return hd_fidl_collector_delete_stored_snapshot_reply(h->k->fd, msg, txid, &result);
}

static hd_status on_get_process_state(void *ctx, hd_message *msg,
                                      heapdump_client_CollectorGetProcessStateRequest *req) {
  handler_ctx *h = ctx;
  h->k->kind = CONN_CLIENT;
  hd_message_close_fds(msg);
  heapdump_client_CollectorGetProcessStateResult result =
      heapdump_client_CollectorGetProcessStateResult_init_zero;
  if (!req->has_process_koid || req->process_koid == 0 || req->process_koid > INT32_MAX) {
    result.which_result = heapdump_client_CollectorGetProcessStateResult_err_tag;
    result.result.err = heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH;
  } else {
    result.which_result = heapdump_client_CollectorGetProcessStateResult_response_tag;
    result.result.response = hd_process_state(h->c, (pid_t)req->process_koid, h->k->peer.uid);
  }
  uint32_t txid = msg->txid;
  return hd_fidl_collector_get_process_state_reply(h->k->fd, msg, txid, &result);
}

static hd_status on_get_next(void *ctx, hd_message *msg,
                             heapdump_client_StoredSnapshotIteratorGetNextRequest *req) {
  (void)req;
  handler_ctx *h = ctx;
  hd_message_close_fds(msg);
  if (h->k->listing_error == heapdump_client_CollectorError_COLLECTOR_ERROR_UNSPECIFIED) {
    return hd_storage_send_page(h->k->fd, msg, &h->k->listing);
  }
  heapdump_client_StoredSnapshotIteratorGetNextResult result =
      heapdump_client_StoredSnapshotIteratorGetNextResult_init_zero;
  result.which_result = heapdump_client_StoredSnapshotIteratorGetNextResult_err_tag;
  result.result.err = h->k->listing_error;
  uint32_t txid = msg->txid;
  return hd_fidl_stored_snapshot_iterator_get_next_reply(h->k->fd, msg, txid, &result);
}

static const hd_fidl_registry_server registry_server = {.register_ = on_register};
static const hd_fidl_snapshot_sink_server sink_server = {.store_named_snapshot = on_store_named_snapshot};
static const hd_fidl_collector_server collector_server = {
    .take_live_snapshot = on_take_live_snapshot,
    .list_stored_snapshots = on_list,
    .download_stored_snapshot = on_download,
    .delete_stored_snapshot = on_delete,
    .get_process_state = on_get_process_state};
static const hd_fidl_stored_snapshot_iterator_server iterator_server = {.get_next = on_get_next};

/* Handles one readable connection; returns false if it must be closed. */
static bool serve(hd_collector *c, size_t index) {
  int fd = c->conns->items[index].fd;
  hd_message *msg = c->scratch;
  hd_status status = hd_message_recv(fd, msg);
  if (status == HD_ERR_PEER_CLOSED) return false;
  c->conns->items[index].last_active_ns = hd_monotonic_ns();
  handler_ctx h = {c, &c->conns->items[index], false};
  enum conn_kind kind = h.k->kind;
  if (status == HD_OK) {
    switch (kind) {
      case CONN_NEW:
        status = hd_fidl_registry_dispatch(&registry_server, &h, msg);
        if (status == HD_ERR_UNKNOWN_ORDINAL) {
          status = hd_fidl_collector_dispatch(&collector_server, &h, msg);
        }
        break;
      case CONN_CLIENT:
        status = hd_fidl_collector_dispatch(&collector_server, &h, msg);
        break;
      case CONN_SINK:
        status = hd_fidl_snapshot_sink_dispatch(&sink_server, &h, msg);
        break;
      case CONN_ITERATOR:
        status = hd_fidl_stored_snapshot_iterator_dispatch(&iterator_server, &h, msg);
        break;
      case CONN_REGISTRY:
        status = HD_ERR_UNEXPECTED_MESSAGE; /* nothing follows a registration */
        break;
    }
  }
  hd_message_close_fds(msg);
  if (status != HD_OK) {
    hd_log(c, HD_LOG_WARN, "closing connection of pid %u: %s",
           (unsigned)c->conns->items[index].peer.pid, hd_status_str(status));
    return false;
  }
  return !h.close_after;
}

/* Accepts every pending connection. Out of descriptors (or memory), the connection stays in the
 * backlog and the socket stays readable: the poll thread then leaves it alone for a while
 * (50 ms, doubling up to a second while it lasts) rather than spin on it. */
static void accept_connections(hd_collector *c) {
  for (;;) {
    int fd = accept4(c->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      const int error = errno;
      c->accept_backoff_ns = c->accept_backoff_ns == 0 ? 50000000u : c->accept_backoff_ns * 2;
      if (c->accept_backoff_ns > 1000000000u) c->accept_backoff_ns = 1000000000u;
      c->accept_paused_until_ns = hd_monotonic_ns() + c->accept_backoff_ns;
      hd_log(c, HD_LOG_WARN, "accept failed: %s; new connections wait %llu ms", strerror(error),
             (unsigned long long)(c->accept_backoff_ns / 1000000u));
      return;
    }
    c->accept_backoff_ns = 0;
    struct ucred peer;
    socklen_t len = sizeof peer;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) {
      close(fd);
      continue;
    }
    if (peer.uid != getuid() && peer.uid != 0) {
      hd_log(c, HD_LOG_WARN, "refused connection from uid %u (pid %u)", (unsigned)peer.uid,
             (unsigned)peer.pid);
      close(fd);
      continue;
    }
    add_conn(c, fd, CONN_NEW, NULL, &peer);
  }
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
  if (rc == 0 && hd_channel_listen(c->socket_path, 128, &c->listen_fd) != HD_OK) {
    rc = -errno;
    hd_log(c, HD_LOG_ERROR, "cannot listen on %s: %s", c->socket_path, strerror(errno));
  }
  if (rc == 0 && fcntl(c->listen_fd, F_SETFL, fcntl(c->listen_fd, F_GETFL) | O_NONBLOCK) != 0) {
    rc = -errno;
  }
  if (rc == 0) rc = hd_worker_start(c);
  if (rc != 0) {
    hd_collector_destroy(c);
    return rc;
  }
  hd_log(c, HD_LOG_INFO, "listening on %s, storing snapshots in %s", c->socket_path, c->storage_dir);
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

/* The live processes, retained, into out (HD_MAX_PROCESSES entries). */
static size_t watched_processes(hd_collector *c, hd_process **out) {
  size_t n = 0;
  pthread_mutex_lock(&c->lock);
  for (size_t i = 0; i < c->process_count; i++) out[n++] = hd_process_retain(c->processes[i]);
  pthread_mutex_unlock(&c->lock);
  return n;
}

int hd_collector_run(hd_collector *c) {
  struct pollfd *fds = calloc(2 + MAX_CONNECTIONS + HD_MAX_PROCESSES, sizeof *fds);
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
    size_t w = watched_processes(c, watched);
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
        if (!serve(c, i)) close_conn(c, i);
      }
      for (size_t i = 0; i < w; i++) {
        if (fds[2 + n + i].revents) hd_process_exited(c, watched[i]);
      }
      if (fds[1].revents & POLLIN) accept_connections(c);
    }
    idle_watch = close_idle_connections(c);
    for (size_t i = 0; i < w; i++) hd_process_release(watched[i]);
    if (rc != 0) break;
  }
  /* Processes that exited just before the stop still get their exit snapshots. */
  size_t w = watched_processes(c, watched);
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
    while (c->conns->count > 0) close_conn(c, c->conns->count - 1);
  }
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
