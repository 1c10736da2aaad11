/* What the collector answers: the handlers of every protocol it serves (Registry and
 * SnapshotSink for instrumented processes; Collector and StoredSnapshotIterator for clients),
 * and the dispatch of one message by what its connection is. Slow work leaves from here: streams
 * to the stream threads, storing to the storage workers. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "collector_internal.h"
#include "connections.h"
#include "heapdump/contract/must_check.h"
#include "heapdump_client.bindings.h"
#include "heapdump_process.bindings.h"

/* ---- Registry and SnapshotSink ---- */

typedef struct handler_ctx {
  hd_collector *c;
  conn *k;
  bool close_after; /* the request was refused: drop the connection */
} handler_ctx;

/* A reply is encoded into the request's buffer, which forgets the request's descriptors: every
 * reply first closes those the handler did not take. */
static HD_MUST_CHECK hd_status reply_register(handler_ctx *h, hd_message *msg,
                                              heapdump_process_RegistryError error) {
  hd_message_close_fds(msg);
  heapdump_process_RegistryRegisterResponse resp =
      heapdump_process_RegistryRegisterResponse_init_zero;
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

/* What a Register or Reattach request claims about its sender. */
typedef struct claims {
  bool has_protocol_version, has_layout_version, has_pid;
  uint32_t protocol_version, layout_version;
  uint64_t pid;
} claims;

#define CLAIMS_OF(req)                                                              \
  ((claims){(req)->has_protocol_version, (req)->has_layout_version, (req)->has_pid, \
            (req)->protocol_version, (req)->layout_version, (req)->pid})

/* Checks the versions and the pid the process claims; UNSPECIFIED if they hold. A process in a
 * container's PID namespace knows itself by another pid than ours: the kernel tells both
 * (NSpid), so its claim is checked, not trusted. */
static heapdump_process_RegistryError check_claims(hd_collector *c, pid_t pid, claims req,
                                                   pid_t *own_pid) {
  if (!req.has_protocol_version ||
      req.protocol_version != heapdump_process_Version_PROTOCOL_VERSION ||
      !req.has_layout_version || req.layout_version != HD_LAYOUT_VERSION) {
    hd_log(c, HD_LOG_WARN, "pid %u: unsupported protocol %u / layout %u", (unsigned)pid,
           req.protocol_version, req.layout_version);
    return heapdump_process_RegistryError_UNSUPPORTED_VERSION;
  }
  *own_pid = req.has_pid && req.pid != (uint64_t)pid ? hd_own_pid(pid) : pid;
  if (!req.has_pid || *own_pid <= 0 || req.pid != (uint64_t)*own_pid) {
    hd_log(c, HD_LOG_WARN, "pid %u tried to register pid %llu", (unsigned)pid,
           (unsigned long long)req.pid);
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
  if (refused != NULL)
    hd_log(c, HD_LOG_WARN, "pid %u: refused tables: %s", (unsigned)reg->pid, refused);
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

static HD_MUST_CHECK hd_status on_register(void *ctx, hd_message *msg,
                                           heapdump_process_RegistryRegisterRequest *req) {
  handler_ctx *h = ctx;
  hd_collector *c = h->c;
  registration reg = {.pid = h->k->peer.pid, .sink_fd = -1, .pidfd = -1};
  if (h->k->kind != CONN_NEW) {
    return reply_register(h, msg, heapdump_process_RegistryError_NOT_ALLOWED);
  }
  heapdump_process_RegistryError refused = check_claims(c, reg.pid, CLAIMS_OF(req), &reg.own_pid);
  if (refused != heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED) {
    return reply_register(h, msg, refused);
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
  /* Only shown, never parsed: any bytes will do (nanopb ended the string within its bound). */
  if (req->has_command_line && req->command_line[0] != '\0')
    p->command_line = strdup(req->command_line);
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
  (void)hd_conn_add(c, reg.sink_fd, CONN_SINK, hd_process_retain(entry), &h->k->peer);
  char own[48] = "";
  if (reg.own_pid != reg.pid) {
    snprintf(own, sizeof own, " (pid %u in its PID namespace)", (unsigned)reg.own_pid);
  }
  hd_log(c, HD_LOG_INFO, "registered %s[%u]%s%s%s", name, (unsigned)reg.pid, own,
         exit_snapshot ? " (exit snapshot on)" : "", absorbed ? ", merged with its entry" : "");
  return reply_register(h, msg, heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED);
}

static HD_MUST_CHECK hd_status reply_reattach(handler_ctx *h, hd_message *msg,
                                              heapdump_process_RegistryError error) {
  hd_message_close_fds(msg);
  heapdump_process_RegistryReattachResponse resp =
      heapdump_process_RegistryReattachResponse_init_zero;
  resp.has_protocol_version = true;
  resp.protocol_version = heapdump_process_Version_PROTOCOL_VERSION;
  if (error != heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED) {
    resp.has_error = true;
    resp.error = error;
    h->close_after = true;
  }
  uint32_t txid = msg->txid;
  return hd_fidl_registry_reattach_reply(h->k->fd, msg, txid, &resp);
}

/* A registered process that closed every descriptor, ours included, asks for a new sink. It
 * proves who it is by its pid (SO_PEERCRED) and the identity of the allocations table it
 * registered, which only that image of the process knows and whose descriptor we hold. */
static HD_MUST_CHECK hd_status on_reattach(void *ctx, hd_message *msg,
                                           heapdump_process_RegistryReattachRequest *req) {
  handler_ctx *h = ctx;
  hd_collector *c = h->c;
  const pid_t pid = h->k->peer.pid;
  pid_t own_pid;
  if (h->k->kind != CONN_NEW) {
    return reply_reattach(h, msg, heapdump_process_RegistryError_NOT_ALLOWED);
  }
  heapdump_process_RegistryError refused = check_claims(c, pid, CLAIMS_OF(req), &own_pid);
  if (refused != heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED) {
    return reply_reattach(h, msg, refused);
  }
  if (!req->has_allocations_table_device || !req->has_allocations_table_inode) {
    return reply_reattach(h, msg, heapdump_process_RegistryError_MISSING_FIELD);
  }
  int sink_fd = hd_message_take_channel(msg, &req->snapshot_sink);
  if (sink_fd < 0) {
    return reply_reattach(h, msg, heapdump_process_RegistryError_MISSING_FIELD);
  }
  hd_process *entry = hd_process_find(c, pid, (dev_t)req->allocations_table_device,
                                      (ino_t)req->allocations_table_inode, h->k->peer.uid);
  if (entry == NULL) {
    close(sink_fd);
    hd_log(c, HD_LOG_WARN, "pid %u: refused to reattach: no such registered process",
           (unsigned)pid);
    return reply_reattach(h, msg, heapdump_process_RegistryError_NOT_REGISTERED);
  }
  h->k->kind = CONN_REGISTRY;
  h->k->process = entry;
  if (!hd_conn_add(c, sink_fd, CONN_SINK, hd_process_retain(entry), &h->k->peer)) {
    return reply_reattach(h, msg, heapdump_process_RegistryError_NOT_ALLOWED);
  }
  hd_log(c, HD_LOG_INFO, "reattached %s[%u]", entry->name, (unsigned)pid);
  return reply_reattach(h, msg, heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED);
}

/* A dormant process says why it could not arm; kept for the client that waits for the arming. */
static HD_MUST_CHECK hd_status on_report_arm_failure(
    void *ctx, hd_message *msg, heapdump_process_RegistryReportArmFailureRequest *req) {
  handler_ctx *h = ctx;
  pid_t own_pid;
  heapdump_process_RegistryError error =
      h->k->kind != CONN_NEW ? heapdump_process_RegistryError_NOT_ALLOWED
                             : check_claims(h->c, h->k->peer.pid, CLAIMS_OF(req), &own_pid);
  if (error == heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED &&
      (!req->has_arm_generation || !req->has_what || !req->has_error_number)) {
    error = heapdump_process_RegistryError_MISSING_FIELD;
  }
  if (error == heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED) {
    hd_arming_note_failure(h->c, h->k->peer.pid, h->k->peer.uid, req->arm_generation, req->what,
                           req->error_number);
  }
  hd_message_close_fds(msg);
  heapdump_process_RegistryReportArmFailureResponse resp =
      heapdump_process_RegistryReportArmFailureResponse_init_zero;
  resp.has_protocol_version = true;
  resp.protocol_version = heapdump_process_Version_PROTOCOL_VERSION;
  resp.has_error = error != heapdump_process_RegistryError_REGISTRY_ERROR_UNSPECIFIED;
  resp.error = error;
  h->close_after = true; /* the only message of its connection */
  uint32_t txid = msg->txid;
  return hd_fidl_registry_report_arm_failure_reply(h->k->fd, msg, txid, &resp);
}

static HD_MUST_CHECK hd_status reply_store(handler_ctx *h, hd_message *msg,
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
static HD_MUST_CHECK hd_status on_store_named_snapshot(
    void *ctx, hd_message *msg, heapdump_process_SnapshotSinkStoreNamedSnapshotRequest *req) {
  handler_ctx *h = ctx;
  int fd = hd_message_take_fd(msg, &req->allocations_snapshot);
  if (!hd_fd_is_memfd(fd, NULL)) {
    close(fd);
    return reply_store(h, msg, heapdump_process_StoreError_INVALID_SNAPSHOT);
  }
  int reply_fd = fcntl(h->k->fd, F_DUPFD_CLOEXEC, 0);
  int queued = reply_fd < 0 ? -EMFILE
                            : hd_queue_named_snapshot(
                                  h->c, h->k->process, req->has_name ? req->name : "", fd,
                                  req->has_exit_with_contents && req->exit_with_contents, reply_fd,
                                  msg->txid);
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
  job->peer_pid = h->k->peer.pid;
  return job;
}

static HD_MUST_CHECK hd_status on_take_live_snapshot(
    void *ctx, hd_message *msg, heapdump_client_CollectorTakeLiveSnapshotRequest *req) {
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

static HD_MUST_CHECK hd_status on_download(
    void *ctx, hd_message *msg, heapdump_client_CollectorDownloadStoredSnapshotRequest *req) {
  hd_status status;
  hd_stream_job *job = new_stream_job(ctx, msg, &req->receiver, &status);
  if (job == NULL) return status;
  job->stored = true;
  job->stored_id = req->has_snapshot_id ? req->snapshot_id : 0;
  hd_start_stream(job);
  return HD_OK;
}

static HD_MUST_CHECK hd_status on_list(void *ctx, hd_message *msg,
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
  if (!hd_conn_add(h->c, fd, CONN_ITERATOR, NULL, &h->k->peer)) {
    free(listing.items);
    return HD_OK;
  }
  conn *iterator = &h->c->conns->items[h->c->conns->count - 1];
  iterator->listing = listing;
  iterator->listing_error = error;
  return HD_OK;
}

static HD_MUST_CHECK hd_status
on_delete(void *ctx, hd_message *msg, heapdump_client_CollectorDeleteStoredSnapshotRequest *req) {
  handler_ctx *h = ctx;
  h->k->kind = CONN_CLIENT;
  hd_message_close_fds(msg);
  heapdump_client_CollectorDeleteStoredSnapshotResult result =
      heapdump_client_CollectorDeleteStoredSnapshotResult_init_zero;
  const int rc =
      req->has_snapshot_id ? hd_storage_delete(h->c, req->snapshot_id, h->k->peer.uid) : -ENOENT;
  if (rc == 0) {
    result.which_result = heapdump_client_CollectorDeleteStoredSnapshotResult_response_tag;
  } else {
    result.which_result = heapdump_client_CollectorDeleteStoredSnapshotResult_err_tag;
    result.result.err = rc == -ENOENT ? heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND
                                      : heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_DELETED;
  }
  uint32_t txid = msg->txid;
  return hd_fidl_collector_delete_stored_snapshot_reply(h->k->fd, msg, txid, &result);
}

static HD_MUST_CHECK hd_status on_get_process_state(
    void *ctx, hd_message *msg, heapdump_client_CollectorGetProcessStateRequest *req) {
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

static HD_MUST_CHECK hd_status on_arm_process(void *ctx, hd_message *msg,
                                              heapdump_client_CollectorArmProcessRequest *req) {
  handler_ctx *h = ctx;
  h->k->kind = CONN_CLIENT;
  hd_message_close_fds(msg);
  heapdump_client_CollectorArmProcessResult result =
      heapdump_client_CollectorArmProcessResult_init_zero;
  heapdump_client_CollectorError err = heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH;
  uint64_t generation = 0;
  if (req->has_process_koid && req->process_koid != 0 && req->process_koid <= INT32_MAX &&
      req->has_recording) {
    err = hd_arming_request(h->c, (pid_t)req->process_koid, h->k->peer.uid, req->recording,
                            req->has_sample_bytes, req->sample_bytes, &generation);
  }
  if (err == heapdump_client_CollectorError_COLLECTOR_ERROR_UNSPECIFIED) {
    result.which_result = heapdump_client_CollectorArmProcessResult_response_tag;
    result.result.response.has_generation = true;
    result.result.response.generation = generation;
  } else {
    result.which_result = heapdump_client_CollectorArmProcessResult_err_tag;
    result.result.err = err;
  }
  uint32_t txid = msg->txid;
  return hd_fidl_collector_arm_process_reply(h->k->fd, msg, txid, &result);
}

static HD_MUST_CHECK hd_status
on_get_next(void *ctx, hd_message *msg, heapdump_client_StoredSnapshotIteratorGetNextRequest *req) {
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

static const hd_fidl_registry_server registry_server = {
    .register_ = on_register, .reattach = on_reattach, .report_arm_failure = on_report_arm_failure};
static const hd_fidl_snapshot_sink_server sink_server = {.store_named_snapshot =
                                                             on_store_named_snapshot};
static const hd_fidl_collector_server collector_server = {
    .take_live_snapshot = on_take_live_snapshot,
    .list_stored_snapshots = on_list,
    .download_stored_snapshot = on_download,
    .delete_stored_snapshot = on_delete,
    .get_process_state = on_get_process_state,
    .arm_process = on_arm_process};
static const hd_fidl_stored_snapshot_iterator_server iterator_server = {.get_next = on_get_next};

bool hd_serve_connection(hd_collector *c, size_t index) {
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
      case CONN_CLIENT: status = hd_fidl_collector_dispatch(&collector_server, &h, msg); break;
      case CONN_SINK: status = hd_fidl_snapshot_sink_dispatch(&sink_server, &h, msg); break;
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
