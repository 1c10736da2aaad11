/* Registration with the collector (heapdump.process.Registry) and the hand-over of named
 * snapshots (SnapshotSink). Runs off the hot path: at start, after fork in the child, and when
 * the program stores a snapshot. A missing collector is normal: the program keeps recording and
 * registers the next time it stores a snapshot; a collector started later also finds it by
 * scanning /proc (see docs/architecture.md). A program that closed every descriptor, ours too,
 * reattaches to the collector that holds its tables (Registry.Reattach).
 *
 * Locking: g_lock serialises everything here; the message buffer is static so that nothing here
 * allocates (this code also runs in a forked child before exec). */
#define _GNU_SOURCE
#include "registration.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/contract/names.h"
#include "heapdump/contract/shm_layout.h"
#include "heapdump/fidl/channel.h"
#include "heapdump_process.bindings.h"
#include "runtime.h"

/* How long the program waits for the collector to accept it before going on without it. */
#define REPLY_TIMEOUT_MS 2000
/* How long a named snapshot waits, once the collector has it, for the answer that it is stored:
 * storing a big table takes its time, and a request the collector has is never sent again. */
#define DEFAULT_STORE_TIMEOUT_S 30
#define MAX_STORE_TIMEOUT_S 3600

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static hd_message g_msg;
/* Kept open: a collector without pidfds sees the process exit when the registry closes. */
static hd_owned_fd g_registry = HD_OWNED_FD_NONE;
static hd_owned_fd g_sink = HD_OWNED_FD_NONE;

/* Forgets the connection; closes only what is still ours (the program may have closed it and
 * reused the numbers). */
static void disconnect(void) {
  hd_owned_fd_close(&g_registry);
  hd_owned_fd_close(&g_sink);
}

static void set_timeouts(int fd, unsigned receive_ms, unsigned send_ms) {
  struct timeval rcv = {receive_ms / 1000, (receive_ms % 1000) * 1000};
  struct timeval snd = {send_ms / 1000, (send_ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &rcv, sizeof rcv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &snd, sizeof snd);
}

static void set_timeout(int fd) { set_timeouts(fd, REPLY_TIMEOUT_MS, REPLY_TIMEOUT_MS); }

/* HEAPDUMP_SNAPSHOT_TIMEOUT, in whole seconds (1 to MAX_STORE_TIMEOUT_S). */
static unsigned store_timeout_ms(void) {
  const char *v = getenv(HD_ENV_SNAPSHOT_TIMEOUT);
  char *end;
  unsigned long s = v != NULL ? strtoul(v, &end, 10) : 0;
  if (v == NULL || end == v || *end != '\0' || s < 1 || s > MAX_STORE_TIMEOUT_S) {
    s = DEFAULT_STORE_TIMEOUT_S;
  }
  return (unsigned)s * 1000;
}

static bool env_is_one(const char *name) {
  const char *v = getenv(name);
  return v != NULL && strcmp(v, "1") == 0;
}

bool hd_exit_with_contents_wanted(void) {
  const char *v = getenv(HD_ENV_EXIT_CONTENTS);
  if (!env_is_one(HD_ENV_EXIT_SNAPSHOT) || v == NULL) return false;
  if (strcmp(v, "1") == 0) return true;
  char *end;
  long pid = strtol(v, &end, 10);
  return *end == '\0' && pid > 1 && pid == (long)getpid();
}

/* A read-only descriptor of one of our tables, through /proc (a memfd cannot be opened read-only
 * otherwise): the collector only reads, and refuses tables it could write. */
static bool reopen_read_only(const hd_owned_fd *table, hd_owned_fd *out) {
  char path[48];
  snprintf(path, sizeof path, "/proc/self/fd/%d", table->fd);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 || !hd_owned_fd_take(fd, out)) return false;
  if (out->dev != table->dev || out->ino != table->ino) { /* the number changed hands meanwhile */
    hd_owned_fd_close(out);
    return false;
  }
  return true;
}

/* Our command line, arguments joined by spaces; false if it cannot be read. */
static bool read_command_line(char *out, size_t size) {
  int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = read(fd, out, size - 1);
  close(fd);
  if (n <= 0) return false;
  while (n > 0 && out[n - 1] == '\0') n--;
  for (ssize_t i = 0; i < n; i++) {
    if (out[i] == '\0') out[i] = ' ';
  }
  out[n] = '\0';
  return n > 0;
}

/* Connects to the collector's socket, into *registry (its replies timed). */
static bool connect_to_collector(hd_owned_fd *registry) {
  char path[108]; /* sun_path: a longer path would name another socket */
  const unsigned uid = (unsigned)getuid();
  if (hd_socket_path(getenv(HD_ENV_SOCKET), getenv(HD_ENV_RUNTIME_DIR), &uid, path, sizeof path) !=
      0)
    return false;
  int connected;
  if (hd_channel_connect_timeout(path, REPLY_TIMEOUT_MS / 1000.0, &connected) != HD_OK)
    return false;
  if (!hd_owned_fd_take(connected, registry)) return false;
  set_timeout(registry->fd);
  return true;
}

/* Connects to the collector and makes the channel of a snapshot sink: the connection and our end
 * of the sink into *registry and *sink_end, the end to send into *sink_peer. Called with g_lock
 * held. */
static bool connect_with_sink(hd_owned_fd *registry, hd_owned_fd *sink_end, int *sink_peer) {
  int sink[2];
  if (!connect_to_collector(registry)) return false;
  if (hd_channel_pair(sink) != HD_OK) {
    hd_owned_fd_close(registry);
    return false;
  }
  if (!hd_owned_fd_take(sink[0], sink_end)) {
    close(sink[1]);
    hd_owned_fd_close(registry);
    return false;
  }
  *sink_peer = sink[1];
  set_timeout(sink_end->fd);
  return true;
}

/* Keeps the connection if the collector took the process, else closes it. */
static bool keep_if_accepted(bool accepted, hd_owned_fd *registry, hd_owned_fd *sink_end) {
  if (!accepted) {
    hd_owned_fd_close(registry);
    hd_owned_fd_close(sink_end);
    return false;
  }
  g_registry = *registry;
  g_sink = *sink_end;
  return true;
}

/* Registers on the connection *registry, handing over the read-only tables and the sink's end
 * sink_peer (closed here). Called with g_lock held. */
static bool hand_over(hd_owned_fd *registry, hd_owned_fd *sink_end, int sink_peer,
                      const hd_owned_fd *alloc, const hd_owned_fd *res) {
  /* Static, not on the stack: it holds the 4 KiB command line, and g_lock is held. */
  static heapdump_process_RegistryRegisterRequest req;
  req =
      (heapdump_process_RegistryRegisterRequest)heapdump_process_RegistryRegisterRequest_init_zero;
  req.has_command_line = read_command_line(req.command_line, sizeof req.command_line);
  req.has_protocol_version = req.has_layout_version = req.has_pid = req.has_process_name = true;
  req.protocol_version = heapdump_process_Version_PROTOCOL_VERSION;
  req.layout_version = HD_LAYOUT_VERSION;
  req.pid = (uint64_t)getpid();
  char name[17] = "";
  prctl(PR_GET_NAME, name, 0, 0, 0);
  snprintf(req.process_name, sizeof req.process_name, "%s", name);
  req.has_allocations_table = req.has_resources_table = req.has_snapshot_sink = true;
  req.allocations_table = (heapdump_client_Handle){.has_index = true, .index = 0};
  req.resources_table = (heapdump_client_Handle){.has_index = true, .index = 1};
  req.snapshot_sink = (heapdump_client_Handle){.has_index = true, .index = 2};
  req.has_exit_snapshot = true;
  req.exit_snapshot = env_is_one(HD_ENV_EXIT_SNAPSHOT);
  int fds[3] = {alloc->fd, res->fd, sink_peer};
  heapdump_process_RegistryRegisterResponse resp =
      heapdump_process_RegistryRegisterResponse_init_zero;
  hd_status status = hd_fidl_registry_register(registry->fd, &g_msg, &req, fds, 3, &resp);
  close(sink_peer);
  return keep_if_accepted(status == HD_OK && !resp.has_error, registry, sink_end);
}

/* Asks the collector that holds our tables for a new sink, naming the allocations table we
 * registered by its identity (we hold no descriptor of it any more). Called with g_lock held. */
static bool reattach(const hd_owned_fd *alloc) {
  hd_owned_fd registry, sink_end;
  int sink_peer;
  if (!connect_with_sink(&registry, &sink_end, &sink_peer)) return false;
  heapdump_process_RegistryReattachRequest req = heapdump_process_RegistryReattachRequest_init_zero;
  req.has_protocol_version = req.has_layout_version = req.has_pid = true;
  req.protocol_version = heapdump_process_Version_PROTOCOL_VERSION;
  req.layout_version = HD_LAYOUT_VERSION;
  req.pid = (uint64_t)getpid();
  req.has_allocations_table_device = req.has_allocations_table_inode = true;
  req.allocations_table_device = (uint64_t)alloc->dev;
  req.allocations_table_inode = (uint64_t)alloc->ino;
  req.has_snapshot_sink = true;
  req.snapshot_sink = (heapdump_client_Handle){.has_index = true, .index = 0};
  heapdump_process_RegistryReattachResponse resp =
      heapdump_process_RegistryReattachResponse_init_zero;
  hd_status status = hd_fidl_registry_reattach(registry.fd, &g_msg, &req, &sink_peer, 1, &resp);
  close(sink_peer);
  return keep_if_accepted(status == HD_OK && !resp.has_error, &registry, &sink_end);
}

/* Called with g_lock held. */
static bool register_locked(void) {
  if (hd_owned_fd_valid(&g_registry) && hd_owned_fd_valid(&g_sink)) return true;
  disconnect();
  hd_owned_fd alloc_rw, res_rw, alloc, res;
  hd_instrumentation_tables(&alloc_rw, &res_rw);
  if (alloc_rw.fd < 0) return false; /* not recording */
  /* Tables the program closed (close_range) cannot be handed over again, nor can their numbers,
   * which may be the program's files now. The mappings still record, and a collector that holds
   * the tables since we registered takes us back by their identity. */
  if (!hd_owned_fd_valid(&alloc_rw) || !hd_owned_fd_valid(&res_rw)) return reattach(&alloc_rw);
  /* Connected first: where no collector listens, a failed connect is then all this costs (a
   * shell loop of 300 /bin/true, sampled and preloaded, 0.95x of reopening the tables first). */
  hd_owned_fd registry, sink_end;
  int sink_peer;
  if (!connect_with_sink(&registry, &sink_end, &sink_peer)) return false;
  bool registered = false;
  if (reopen_read_only(&alloc_rw, &alloc)) {
    if (reopen_read_only(&res_rw, &res)) {
      registered = hand_over(&registry, &sink_end, sink_peer, &alloc, &res);
      sink_peer = -1;
      hd_owned_fd_close(&res);
    }
    hd_owned_fd_close(&alloc);
  }
  if (sink_peer >= 0) { /* not handed over */
    close(sink_peer);
    hd_owned_fd_close(&registry);
    hd_owned_fd_close(&sink_end);
  }
  return registered;
}

void hd_register_with_collector(void) {
  hd_tls.guard++;
  pthread_mutex_lock(&g_lock);
  (void)register_locked();
  pthread_mutex_unlock(&g_lock);
  hd_tls.guard--;
}

void hd_report_arm_failure(uint64_t generation, const hd_arm_failure *failed) {
  hd_tls.guard++;
  pthread_mutex_lock(&g_lock);
  hd_owned_fd registry;
  /* Out of descriptors (EMFILE), the report cannot leave either: the client then times out. */
  if (connect_to_collector(&registry)) {
    heapdump_process_RegistryReportArmFailureRequest req =
        heapdump_process_RegistryReportArmFailureRequest_init_zero;
    req.has_protocol_version = req.has_layout_version = req.has_pid = true;
    req.protocol_version = heapdump_process_Version_PROTOCOL_VERSION;
    req.layout_version = HD_LAYOUT_VERSION;
    req.pid = (uint64_t)getpid();
    req.has_arm_generation = req.has_what = req.has_error_number = true;
    req.arm_generation = generation;
    snprintf(req.what, sizeof req.what, "its %s (%" PRIu64 " MiB)", failed->table,
             failed->bytes >> 20);
    req.error_number = failed->error;
    heapdump_process_RegistryReportArmFailureResponse resp =
        heapdump_process_RegistryReportArmFailureResponse_init_zero;
    /* Nothing to do about a report that did not arrive: the client then times out. */
    const hd_status ignored =
        hd_fidl_registry_report_arm_failure(registry.fd, &g_msg, &req, NULL, 0, &resp);
    (void)ignored;
    hd_owned_fd_close(&registry);
  }
  pthread_mutex_unlock(&g_lock);
  hd_tls.guard--;
}

void hd_registration_after_fork_child(void) {
  /* Another thread of the parent may have held the lock: it does not exist here. */
  pthread_mutex_init(&g_lock, NULL);
  disconnect(); /* the parent's connection is the parent's */
  hd_register_with_collector();
}

/* One try on the registered sink. *sent tells whether the request left: a request the collector
 * received is never sent again, or a slow store would be stored twice. */
static HD_MUST_CHECK int store_on_sink(const char *name, int snapshot_fd, bool exit_with_contents,
                                       bool *sent) {
  heapdump_process_SnapshotSinkStoreNamedSnapshotRequest req =
      heapdump_process_SnapshotSinkStoreNamedSnapshotRequest_init_zero;
  req.has_name = req.has_allocations_snapshot = true;
  req.has_exit_with_contents = exit_with_contents;
  req.exit_with_contents = exit_with_contents;
  snprintf(req.name, sizeof req.name, "%s", name);
  req.allocations_snapshot = (heapdump_client_Handle){.has_index = true, .index = 0};
  const uint32_t txid = hd_next_txid();
  *sent = false;
  if (hd_message_encode(&g_msg, txid, 0, HD_ORDINAL_SNAPSHOT_SINK_STORE_NAMED_SNAPSHOT,
                        &heapdump_process_SnapshotSinkStoreNamedSnapshotRequest_msg, &req,
                        1) != HD_OK) {
    return HEAPDUMP_ERROR_INVALID_ARGUMENT;
  }
  if (hd_message_send(g_sink.fd, &g_msg, &snapshot_fd, 1) != HD_OK)
    return HEAPDUMP_ERROR_NO_COLLECTOR;
  *sent = true;
  set_timeouts(g_sink.fd, store_timeout_ms(), REPLY_TIMEOUT_MS);
  heapdump_process_SnapshotSinkStoreNamedSnapshotResponse resp =
      heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_init_zero;
  hd_status status = hd_message_await_reply(g_sink.fd, &g_msg, txid,
                                            HD_ORDINAL_SNAPSHOT_SINK_STORE_NAMED_SNAPSHOT);
  if (status == HD_OK) {
    status = hd_message_decode_body(
        &g_msg, &heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_msg, &resp);
  }
  set_timeout(g_sink.fd);
  if (status == HD_ERR_TIMED_OUT) return HEAPDUMP_ERROR_NO_ANSWER;
  if (status != HD_OK) return HEAPDUMP_ERROR_NO_COLLECTOR;
  return resp.has_error ? HEAPDUMP_ERROR_COLLECTOR_REFUSED : HEAPDUMP_OK;
}

int hd_store_named_snapshot(const char *name, const hd_owned_fd *memfd, bool exit_with_contents) {
  hd_tls.guard++;
  pthread_mutex_lock(&g_lock);
  int rc = HEAPDUMP_ERROR_NO_COLLECTOR;
  /* Two tries: the collector may have restarted since we registered (the old connection fails
   * before the request leaves). */
  for (int attempt = 0; attempt < 2 && rc == HEAPDUMP_ERROR_NO_COLLECTOR; attempt++) {
    if (!register_locked() || !hd_owned_fd_valid(memfd)) break;
    bool sent;
    rc = store_on_sink(name, memfd->fd, exit_with_contents, &sent);
    /* After no answer, a late one would be taken for the answer to the next request. */
    if (rc == HEAPDUMP_ERROR_NO_COLLECTOR || rc == HEAPDUMP_ERROR_NO_ANSWER) disconnect();
    if (sent) break;
  }
  pthread_mutex_unlock(&g_lock);
  hd_tls.guard--;
  return rc;
}
