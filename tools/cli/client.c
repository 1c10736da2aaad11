/* The heapdump command as a client of the collector: TakeLiveSnapshot, ListStoredSnapshots and
 * DownloadStoredSnapshot through the generated bindings, with the collector's errors turned into
 * messages that say what to do. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pb_decode.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/channel.h"
#include "heapdump_client.bindings.h"

int cli_timed_out(const cli_options *o, const char *what) {
  cli_error(
      "the collector at %s did not %s within %g s: it is stopped, stuck, or not a heapdump "
      "collector (--timeout changes the wait)",
      o->socket, what, o->timeout);
  return EXIT_TIMEOUT;
}

/* A channel end of ours that waits on the collector at most o->timeout per message. */
static HD_MUST_CHECK int new_channel(const cli_options *o, int ends[2]) {
  if (hd_channel_pair(ends) != HD_OK) {
    cli_error("cannot create a channel: %s", strerror(errno));
    return EXIT_FAILURE_;
  }
  if (hd_channel_set_timeout(ends[0], o->timeout) != HD_OK) {
    close(ends[0]);
    close(ends[1]);
    cli_error("cannot set a timeout on a channel: %s", strerror(errno));
    return EXIT_FAILURE_;
  }
  return 0;
}

/* The collector socket named by HEAPDUMP_SOCKET in process pid's environment, into out; false if
 * it names none, or the one at `ours`, or no socket. */
static bool socket_of(const char *pid, const char *ours, char *out, size_t size) {
  char path[64], env[65536];
  snprintf(path, sizeof path, "/proc/%s/environ", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = read(fd, env, sizeof env - 1);
  close(fd);
  if (n <= 0) return false;
  env[n] = '\0';
  static const char kName[] = "HEAPDUMP_SOCKET=";
  for (const char *e = env; e < env + n; e += strlen(e) + 1) {
    struct stat st;
    if (strncmp(e, kName, sizeof kName - 1) == 0 && strcmp(e + sizeof kName - 1, ours) != 0 &&
        stat(e + sizeof kName - 1, &st) == 0 && S_ISSOCK(st.st_mode)) {
      snprintf(out, size, "%s", e + sizeof kName - 1);
      return true;
    }
  }
  return false;
}

/* A process of the user's that the request names (by pid, by name, or any when neither) and
 * that another collector serves: typically a program under `heapdump run`, whose own collector
 * is on a private socket. Its name[pid] and that socket; false if there is none. */
static bool served_elsewhere(const cli_options *o, char *who, size_t who_size, char *socket,
                             size_t socket_size) {
  DIR *d = opendir("/proc");
  if (d == NULL) return false;
  bool found = false;
  for (struct dirent *e; !found && (e = readdir(d)) != NULL;) {
    char *end;
    unsigned long pid = strtoul(e->d_name, &end, 10);
    if (*end != '\0' || pid == 0 || (o->has_pid && pid != o->pid)) continue;
    char path[64], comm[32] = "";
    snprintf(path, sizeof path, "/proc/%lu/comm", pid);
    FILE *f = fopen(path, "re");
    if (f == NULL) continue;
    if (fgets(comm, sizeof comm, f) != NULL) comm[strcspn(comm, "\n")] = '\0';
    fclose(f);
    if (o->name != NULL && strcmp(comm, o->name) != 0) continue;
    found = socket_of(e->d_name, o->socket, socket, socket_size);
    if (found) snprintf(who, who_size, "%s[%lu]", comm, pid);
  }
  closedir(d);
  return found;
}

int cli_connect(const cli_options *o, int *fd) {
  errno = 0;
  hd_status status = hd_channel_connect_timeout(o->socket, o->timeout, fd);
  if (status == HD_OK) return 0;
  if (status == HD_ERR_TIMED_OUT) return cli_timed_out(o, "accept the connection");
  int err = errno;
  if (err == EACCES || err == EPERM) {
    cli_error("permission denied connecting to the collector at %s", o->socket);
    return EXIT_PERMISSION;
  }
  char who[64], other[108];
  if (served_elsewhere(o, who, sizeof who, other, sizeof other)) {
    cli_error(
        "no collector is running at %s (%s).\n"
        "%s is served by another collector, at %s (`heapdump run` starts its own when none "
        "runs): give --socket %s, or start `heapdump-collector` before the program.",
        o->socket, err ? strerror(err) : hd_status_str(status), who, other, other);
    return EXIT_NO_COLLECTOR;
  }
  cli_error(
      "no collector is running at %s (%s).\n"
      "Start one with `heapdump-collector` (it serves that socket), or profile a program "
      "with `heapdump run -- PROGRAM`, which starts its own.",
      o->socket, err ? strerror(err) : hd_status_str(status));
  return EXIT_NO_COLLECTOR;
}

/* One request to the collector: the connection, a message buffer for the request and its
 * answer, and the channel that goes with the request, if any (end 1 is sent; -1 once closed). */
typedef struct collector_call {
  int fd;
  int ends[2];
  hd_message *msg;
} collector_call;

/* Closes the channel's end that went with the request: the collector holds its own copy. */
static void call_sent(collector_call *k) {
  if (k->ends[1] >= 0) close(k->ends[1]);
  k->ends[1] = -1;
}

static void call_close(collector_call *k) {
  call_sent(k);
  if (k->ends[0] >= 0) close(k->ends[0]);
  close(k->fd);
  free(k->msg);
}

/* Connects and readies a call, with a channel when with_channel; a call whose answer comes on
 * the connection itself waits for it at most o->timeout when timed. Reports its own errors;
 * returns 0 or an exit code. */
static HD_MUST_CHECK int call_open(const cli_options *o, bool with_channel, bool timed,
                                   collector_call *k) {
  *k = (collector_call){.fd = -1, .ends = {-1, -1}};
  int rc = cli_connect(o, &k->fd);
  if (rc != 0) return rc;
  if (timed && hd_channel_set_timeout(k->fd, o->timeout) != HD_OK) {
    cli_error("cannot set a timeout on a channel: %s", strerror(errno));
    rc = EXIT_FAILURE_;
  }
  if (rc == 0 && with_channel && (rc = new_channel(o, k->ends)) != 0) {
    k->ends[0] = k->ends[1] = -1; /* new_channel closed what it made */
  }
  if (rc == 0 && (k->msg = malloc(sizeof *k->msg)) == NULL) {
    cli_error("out of memory");
    rc = EXIT_FAILURE_;
  }
  if (rc != 0) call_close(k);
  return rc;
}

static void selector_from(const cli_options *o, uint64_t pid, bool *has,
                          heapdump_client_ProcessSelector *s) {
  *s = (heapdump_client_ProcessSelector)heapdump_client_ProcessSelector_init_zero;
  *has = true;
  if (pid != 0) {
    s->which_selector = heapdump_client_ProcessSelector_by_koid_tag;
    s->selector.by_koid = pid;
  } else if (o->name != NULL) {
    s->which_selector = heapdump_client_ProcessSelector_by_name_tag;
    snprintf(s->selector.by_name, sizeof s->selector.by_name, "%s", o->name);
  } else {
    *has = false;
  }
}

static const char *selector_text(const cli_options *o, uint64_t pid, char *buf, size_t size) {
  if (pid != 0) {
    snprintf(buf, size, "pid %" PRIu64, pid);
  } else if (o->name != NULL) {
    snprintf(buf, size, "name '%s'", o->name);
  } else {
    snprintf(buf, size, "any process");
  }
  return buf;
}

typedef enum request_kind { LIVE, DOWNLOAD } request_kind;

/* Sends the request with a fresh receiver channel and receives the stream into r. */
static HD_MUST_CHECK int request_snapshot(const cli_options *o, request_kind kind, uint64_t pid,
                                          bool multi, uint32_t id, hd_reassembler *r,
                                          uint32_t *error) {
  collector_call k;
  int rc = call_open(o, true, false, &k);
  if (rc != 0) return rc;
  hd_status status;
  if (kind == LIVE) {
    heapdump_client_CollectorTakeLiveSnapshotRequest req =
        heapdump_client_CollectorTakeLiveSnapshotRequest_init_zero;
    selector_from(o, pid, &req.has_process_selector, &req.process_selector);
    req.has_receiver = true;
    req.receiver = (heapdump_client_Handle){.has_index = true, .index = 0};
    req.has_with_contents = req.has_multi_process = true;
    req.with_contents = o->contents;
    req.multi_process = multi;
    status = hd_fidl_collector_take_live_snapshot(k.fd, k.msg, &req, &k.ends[1], 1);
  } else {
    heapdump_client_CollectorDownloadStoredSnapshotRequest req =
        heapdump_client_CollectorDownloadStoredSnapshotRequest_init_zero;
    req.has_snapshot_id = req.has_receiver = true;
    req.snapshot_id = id;
    req.receiver = (heapdump_client_Handle){.has_index = true, .index = 0};
    status = hd_fidl_collector_download_stored_snapshot(k.fd, k.msg, &req, &k.ends[1], 1);
  }
  call_sent(&k);
  if (status == HD_OK && kind == LIVE && o->contents) cli_spill_contents(r);
  if (status == HD_OK) {
    cli_progress_attach(r);
    status = hd_snapshot_receive(k.ends[0], multi, r, error);
    cli_progress_done(r);
    if (status == HD_OK && *error == 0) status = hd_reassembler_finish(r);
  }
  call_close(&k);
  if (status == HD_ERR_TIMED_OUT) return cli_timed_out(o, "send the next part of the snapshot");
  if (status != HD_OK) {
    if (status == HD_ERR_REASSEMBLY || status == HD_ERR_DECODE) {
      cli_error("the collector sent a malformed snapshot: %s",
                r->error[0] ? r->error : hd_status_str(status));
    } else {
      cli_error("the snapshot stream failed: %s", hd_status_str(status));
    }
    return EXIT_FAILURE_;
  }
  return 0;
}

/* Live snapshots are always requested as multi-process streams: each process then comes with its
 * header (name and pid), which the outputs show, and a selector matching several processes is
 * answered with all of them, so an ambiguous name can be reported with its candidates at no
 * extra cost. */
static bool was_read(const hd_snapshot *s, void *ctx) {
  (void)ctx;
  return s->not_read[0] == '\0';
}

/* Says which processes the collector could not read, and why, and takes them out of r. */
static int drop_unread(hd_reassembler *r) {
  size_t unread = 0;
  for (size_t i = 0; i < r->snapshot_count; i++) {
    const hd_snapshot *s = r->snapshots[i];
    if (was_read(s, NULL)) continue;
    cli_error("could not read %s[%" PRIu64 "]: %s", s->process_name, s->pid, s->not_read);
    unread++;
  }
  if (unread == 0) return 0;
  const size_t asked = r->snapshot_count;
  hd_reassembler_keep(r, was_read, NULL);
  if (r->snapshot_count == 0) return EXIT_FAILURE_;
  cli_error("%zu of %zu processes could not be read; the others are written", unread, asked);
  return EXIT_PARTIAL;
}

int cli_take_live_snapshot(const cli_options *o, uint64_t pid, hd_reassembler *r) {
  uint32_t error = 0;
  int rc = request_snapshot(o, LIVE, pid, true, 0, r, &error);
  if (rc != 0) return rc;
  char what[96];
  selector_text(o, pid, what, sizeof what);
  if (error == 0 && r->snapshot_count == 0) {
    error = heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH;
  }
  if (error == 0 && r->snapshot_count > 1 && !o->all) {
    cli_error("%s matches %zu processes: pick one with --pid, or take them all with --all", what,
              r->snapshot_count);
    fprintf(cli_stderr(), "matching processes:\n");
    for (size_t i = 0; i < r->snapshot_count; i++) {
      fprintf(cli_stderr(), "  %s[%" PRIu64 "]\n", r->snapshots[i]->process_name,
              r->snapshots[i]->pid);
    }
    return EXIT_AMBIGUOUS;
  }
  if (error == 0) return drop_unread(r);
  switch (error) {
    case heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH: {
      char who[64], other[108];
      if (served_elsewhere(o, who, sizeof who, other, sizeof other)) {
        cli_error(
            "no process the collector at %s serves matches %s.\n"
            "%s is served by another collector, at %s: give --socket %s.",
            o->socket, what, who, other, other);
        return EXIT_NOT_FOUND;
      }
      cli_error(
          "no instrumented process of yours matches %s.\n"
          "Programs are instrumented when started with `heapdump run` or with "
          "LD_PRELOAD=libheapdump.so.",
          what);
      return EXIT_NOT_FOUND;
    }
    case heapdump_client_CollectorError_PROCESS_SELECTOR_UNSUPPORTED:
      cli_error("the collector does not support selecting by %s", what);
      return EXIT_FAILURE_;
    case heapdump_client_CollectorError_LIVE_SNAPSHOT_FAILED:
      cli_error("the collector could not read the recording of %s (see its log)", what);
      return EXIT_FAILURE_;
    default: cli_error("the collector reported error %" PRIu32, error); return EXIT_FAILURE_;
  }
}

int cli_download(const cli_options *o, const cli_stored *meta, hd_reassembler *r) {
  uint32_t error = 0;
  int rc = request_snapshot(o, DOWNLOAD, 0, false, meta->id, r, &error);
  if (rc != 0) return rc;
  /* A stored snapshot streams as one process without a header; the listing knows which process
   * it was, and giving it its header keeps that in every output, raw files included. */
  if (error == 0 && r->snapshot_count == 1) {
    hd_snapshot *s = r->snapshots[0];
    s->has_header = true;
    snprintf(s->process_name, sizeof s->process_name, "%s", meta->process_name);
    s->pid = meta->pid;
  }
  if (error == heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND) {
    cli_error("no stored snapshot has id %" PRIu32 " (`heapdump list` shows them)", meta->id);
    return EXIT_NOT_FOUND;
  }
  if (error != 0) {
    cli_error("the collector reported error %" PRIu32, error);
    return EXIT_FAILURE_;
  }
  return 0;
}

typedef struct list_state {
  cli_stored *items;
  size_t count, capacity;
  size_t in_response; /* entries decoded from the current response */
  bool failed;
} list_state;

static bool decode_stored(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  list_state *st = *arg;
  heapdump_client_StoredSnapshot s = heapdump_client_StoredSnapshot_init_zero;
  if (!pb_decode(stream, heapdump_client_StoredSnapshot_fields, &s)) return false;
  if (st->count == st->capacity) {
    size_t capacity = st->capacity ? 2 * st->capacity : 64;
    cli_stored *items = realloc(st->items, capacity * sizeof *items);
    if (items == NULL) {
      st->failed = true;
      return false;
    }
    st->items = items;
    st->capacity = capacity;
  }
  cli_stored *out = &st->items[st->count++];
  *out = (cli_stored){
      .id = s.snapshot_id,
      .pid = s.process_koid,
      .has_totals = s.has_taken_at_unix_ns,
      .taken_at_unix_ns = s.taken_at_unix_ns,
      .live_bytes = s.live_bytes,
      .live_blocks = s.live_blocks,
      .stored_bytes = s.stored_bytes,
  };
  snprintf(out->name, sizeof out->name, "%s", s.snapshot_name);
  snprintf(out->process_name, sizeof out->process_name, "%s", s.process_name);
  st->in_response++;
  return true;
}

static bool decode_result(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)stream;
  if (field->tag == heapdump_client_StoredSnapshotIteratorGetNextResult_response_tag) {
    heapdump_client_StoredSnapshotIteratorGetNextResponse *response = field->pData;
    response->batch.arg = *arg;
    response->batch.funcs.decode = decode_stored;
  }
  return true;
}

int cli_list(const cli_options *o, cli_stored **out, size_t *count) {
  collector_call k;
  int rc = call_open(o, true, false, &k);
  if (rc != 0) return rc;
  list_state st = {0};
  heapdump_client_CollectorListStoredSnapshotsRequest req =
      heapdump_client_CollectorListStoredSnapshotsRequest_init_zero;
  req.has_iterator = true;
  req.iterator = (heapdump_client_Handle){.has_index = true, .index = 0};
  selector_from(o, o->has_pid ? o->pid : 0, &req.has_process_selector, &req.process_selector);
  hd_status status = hd_fidl_collector_list_stored_snapshots(k.fd, k.msg, &req, &k.ends[1], 1);
  call_sent(&k);
  while (status == HD_OK) {
    heapdump_client_StoredSnapshotIteratorGetNextRequest next =
        heapdump_client_StoredSnapshotIteratorGetNextRequest_init_zero;
    heapdump_client_StoredSnapshotIteratorGetNextResult result =
        heapdump_client_StoredSnapshotIteratorGetNextResult_init_zero;
    result.cb_result.arg = &st;
    result.cb_result.funcs.decode = decode_result;
    st.in_response = 0;
    status = hd_fidl_stored_snapshot_iterator_get_next(k.ends[0], k.msg, &next, NULL, 0, &result);
    if (status == HD_OK &&
        result.which_result == heapdump_client_StoredSnapshotIteratorGetNextResult_err_tag) {
      /* A selector that matches no process is an empty listing, not a failure. */
      if (result.result.err == heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH) break;
      cli_error("the collector refused the listing (error %d)", (int)result.result.err);
      free(st.items);
      call_close(&k);
      return EXIT_FAILURE_;
    }
    if (status == HD_OK && st.in_response == 0) break;
  }
  call_close(&k);
  if (status == HD_ERR_TIMED_OUT) {
    free(st.items);
    return cli_timed_out(o, "answer the listing");
  }
  if (status != HD_OK) {
    free(st.items);
    cli_error("listing stored snapshots failed: %s",
              st.failed ? "out of memory" : hd_status_str(status));
    return EXIT_FAILURE_;
  }
  *out = st.items;
  *count = st.count;
  return 0;
}

int cli_delete(const cli_options *o, uint32_t id) {
  collector_call k;
  int rc = call_open(o, false, true, &k);
  if (rc != 0) return rc;
  heapdump_client_CollectorDeleteStoredSnapshotResult result =
      heapdump_client_CollectorDeleteStoredSnapshotResult_init_zero;
  heapdump_client_CollectorDeleteStoredSnapshotRequest req = {.has_snapshot_id = true,
                                                              .snapshot_id = id};
  hd_status status = hd_fidl_collector_delete_stored_snapshot(k.fd, k.msg, &req, NULL, 0, &result);
  call_close(&k);
  if (status == HD_ERR_TIMED_OUT) return cli_timed_out(o, "answer the deletion");
  if (status != HD_OK) {
    cli_error("deleting snapshot %" PRIu32 " failed: %s", id, hd_status_str(status));
    return EXIT_FAILURE_;
  }
  if (result.which_result == heapdump_client_CollectorDeleteStoredSnapshotResult_err_tag &&
      result.result.err == heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_DELETED) {
    cli_error("snapshot %" PRIu32
              " is still stored: the collector could not remove its file "
              "(read-only storage? its log says why)",
              id);
    return EXIT_FAILURE_;
  }
  if (result.which_result == heapdump_client_CollectorDeleteStoredSnapshotResult_err_tag) {
    cli_error("no stored snapshot %" PRIu32 " (see `heapdump list`)", id);
    return EXIT_NOT_FOUND;
  }
  return 0;
}

int cli_arm_process(const cli_options *o, uint64_t pid, bool recording, bool has_sample_bytes,
                    uint64_t sample_bytes, uint64_t *generation) {
  collector_call k;
  int rc = call_open(o, false, true, &k);
  if (rc != 0) return rc;
  heapdump_client_CollectorArmProcessResult result =
      heapdump_client_CollectorArmProcessResult_init_zero;
  heapdump_client_CollectorArmProcessRequest req = {.has_process_koid = true,
                                                    .process_koid = pid,
                                                    .has_recording = true,
                                                    .recording = recording,
                                                    .has_sample_bytes = has_sample_bytes,
                                                    .sample_bytes = sample_bytes};
  hd_status status = hd_fidl_collector_arm_process(k.fd, k.msg, &req, NULL, 0, &result);
  call_close(&k);
  const char *verb = recording ? "arm" : "disarm";
  if (status == HD_ERR_TIMED_OUT) return cli_timed_out(o, recording ? "arm" : "disarm");
  if (status != HD_OK) {
    cli_error("%s: the collector failed: %s", verb, hd_status_str(status));
    return EXIT_FAILURE_;
  }
  if (result.which_result == heapdump_client_CollectorArmProcessResult_response_tag) {
    *generation = result.result.response.generation;
    return 0;
  }
  switch (result.result.err) {
    case heapdump_client_CollectorError_PROCESS_NOT_DORMANT:
      cli_error("%s: process %" PRIu64
                " does not run the dormant library of this collector: start it with "
                "HEAPDUMP_DORMANT=1 and LD_PRELOAD (or from /etc/ld.so.preload), with this "
                "collector's socket and as its user (set-user-ID programs never arm)",
                verb, pid);
      return EXIT_NOT_FOUND;
    case heapdump_client_CollectorError_PERMISSION_DENIED:
      cli_error("%s: process %" PRIu64 " is another user's (only root arms anyone's)", verb, pid);
      return EXIT_PERMISSION;
    case heapdump_client_CollectorError_ARM_PAGE_FULL:
      cli_error("%s: the collector's arm page is full: every slot names a running process", verb);
      return EXIT_FAILURE_;
    case heapdump_client_CollectorError_SAMPLE_RATE_FIXED:
      cli_error("%s: process %" PRIu64
                " was armed at another --sample-bytes, which stays its rate until it exits",
                verb, pid);
      return EXIT_USAGE;
    case heapdump_client_CollectorError_PROCESS_NOT_ARMED:
      cli_error("%s: process %" PRIu64 " was never armed", verb, pid);
      return EXIT_NOT_FOUND;
    default: cli_error("%s: no process %" PRIu64, verb, pid); return EXIT_NOT_FOUND;
  }
}

int cli_process_state(const cli_options *o, uint64_t pid,
                      heapdump_client_CollectorGetProcessStateResponse *out) {
  collector_call k;
  int rc = call_open(o, false, true, &k);
  if (rc != 0) return rc;
  heapdump_client_CollectorGetProcessStateResult result =
      heapdump_client_CollectorGetProcessStateResult_init_zero;
  heapdump_client_CollectorGetProcessStateRequest req = {.has_process_koid = true,
                                                         .process_koid = pid};
  hd_status status = hd_fidl_collector_get_process_state(k.fd, k.msg, &req, NULL, 0, &result);
  call_close(&k);
  /* Quiet: the caller falls back to waiting when the collector cannot say. */
  if (status == HD_ERR_TIMED_OUT) return EXIT_TIMEOUT;
  if (status != HD_OK ||
      result.which_result != heapdump_client_CollectorGetProcessStateResult_response_tag) {
    return EXIT_FAILURE_;
  }
  *out = result.result.response;
  return 0;
}
