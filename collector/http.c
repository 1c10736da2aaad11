/* The collector over HTTP (heapdump-collector --http): Prometheus metrics, Go's pprof heap
 * profile paths per process, a Prometheus HTTP service-discovery document that makes each
 * process its own scrape target, and the stored snapshots. libmicrohttpd serves it, one thread
 * per connection up to a limit, beside the Unix socket: a profile is taken by a stream job like
 * a client's (one client, this process, in the stream scheduler's fair order), received and
 * written as pprof on the connection's thread, so HTTP readers never hold up the poll thread.
 * Metrics come from the counters the resources tables keep: no table walk per scrape. Block
 * contents and roots never leave over HTTP. See docs/fleet.md. */
#define _GNU_SOURCE
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "collector_internal.h"
#include "heapdump/fidl/channel.h"
#include "heapdump/tools/listing.h"
#include "heapdump/tools/pprof.h"
#include "heapdump/tools/report.h"
#include "heapdump/tools/symbolize.h"

/* Limits: connections at once (each has a thread while it lasts), per client address, how long
 * a connection may sit idle, and the memory one request's headers may take (a bigger request
 * is answered 431 by libmicrohttpd). */
#define MAX_CONNECTIONS 64
#define MAX_CONNECTIONS_PER_ADDRESS 16
#define CONNECTION_TIMEOUT_SECONDS 30
#define REQUEST_MEMORY_BYTES (32 * 1024)
#define MAX_TOKEN_BYTES 4096
/* Profiles made at once: each holds its snapshot in the collector's memory while it is written
 * (about 90 MB at 10^6 blocks), so more requests wait their turn, up to PROFILE_WAIT_SECONDS. */
#define MAX_PROFILES_AT_ONCE 2
#define PROFILE_WAIT_SECONDS 60

struct hd_http {
  hd_collector *c;
  struct MHD_Daemon *daemon;
  char token[MAX_TOKEN_BYTES + 1]; /* "": no token needed */
  size_t token_size;
  char address[128]; /* as given: the targets of the discovery document without a Host */
  sem_t profiles;    /* MAX_PROFILES_AT_ONCE */
  /* The pprof writer's symbol caches (the demangler's) are one per process: profiles are
   * received side by side, written one at a time. */
  pthread_mutex_t write_lock;
  /* The channels profiles are being received on, for a stop to cut off (-1: none). */
  pthread_mutex_t receiving_lock;
  int receiving[MAX_PROFILES_AT_ONCE];
  atomic_bool stopping;
};

/* ---- the address and the token ---- */

static bool is_loopback(const struct sockaddr *a) {
  if (a->sa_family == AF_INET) {
    return (ntohl(((const struct sockaddr_in *)a)->sin_addr.s_addr) >> 24) == 127;
  }
  if (a->sa_family == AF_INET6) {
    const struct in6_addr *v6 = &((const struct sockaddr_in6 *)a)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(v6) && v6->s6_addr[12] == 127;
  }
  return false;
}

/* ADDR:PORT ([v6]:PORT for IPv6; a host name is resolved) into *out. */
static int parse_address(const char *text, struct sockaddr_storage *out, socklen_t *len,
                         char *error, size_t error_size) {
  char host[128];
  const char *colon = strrchr(text, ':');
  if (colon == NULL || colon[1] == '\0' || (size_t)(colon - text) >= sizeof host) {
    snprintf(error, error_size, "--http %s: give ADDRESS:PORT (e.g. 127.0.0.1:9464)", text);
    return -EINVAL;
  }
  snprintf(host, sizeof host, "%.*s", (int)(colon - text), text);
  char *h = host;
  size_t n = strlen(h);
  if (n >= 2 && h[0] == '[' && h[n - 1] == ']') {
    h[n - 1] = '\0';
    h++;
  }
  struct addrinfo hints = {
      .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV | AI_PASSIVE};
  struct addrinfo *found = NULL;
  const int rc = getaddrinfo(h[0] ? h : NULL, colon + 1, &hints, &found);
  if (rc != 0 || found == NULL) {
    snprintf(error, error_size, "--http %s: %s", text, rc ? gai_strerror(rc) : "no address");
    return -EINVAL;
  }
  memcpy(out, found->ai_addr, found->ai_addrlen);
  *len = found->ai_addrlen;
  freeaddrinfo(found);
  return 0;
}

/* The token: the file's first line, without its line end. */
static int read_token(hd_http *h, const char *path, char *error, size_t error_size) {
  FILE *f = fopen(path, "re");
  if (f == NULL) {
    snprintf(error, error_size, "--http-token-file %s: %s", path, strerror(errno));
    return -errno;
  }
  char line[MAX_TOKEN_BYTES + 2];
  const bool got = fgets(line, sizeof line, f) != NULL;
  fclose(f);
  size_t n = got ? strcspn(line, "\r\n") : 0;
  line[n] = '\0';
  if (n == 0 || n > MAX_TOKEN_BYTES) {
    snprintf(error, error_size, "--http-token-file %s: %s", path,
             n == 0 ? "no token on its first line" : "the token is longer than 4096 bytes");
    return -EINVAL;
  }
  memcpy(h->token, line, n + 1);
  h->token_size = n;
  return 0;
}

/* Whether the request carries "Authorization: Bearer TOKEN": compared in time independent of
 * where the first difference is. */
static bool authorized(const hd_http *h, struct MHD_Connection *conn) {
  if (h->token_size == 0) return true;
  const char *given = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
  if (given == NULL || strncmp(given, "Bearer ", 7) != 0) return false;
  given += 7;
  const size_t given_size = strlen(given);
  unsigned char diff = given_size != h->token_size;
  for (size_t i = 0; i < h->token_size; i++) {
    diff |= (unsigned char)h->token[i] ^ (unsigned char)(i < given_size ? given[i] : 0);
  }
  return diff == 0;
}

/* ---- responses ---- */

static enum MHD_Result respond(struct MHD_Connection *conn, unsigned status, const char *type,
                               char *body, size_t size) {
  struct MHD_Response *r = MHD_create_response_from_buffer(size, body, MHD_RESPMEM_MUST_FREE);
  if (r == NULL) {
    free(body);
    return MHD_NO;
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  if (status == MHD_HTTP_UNAUTHORIZED) {
    MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
  }
  if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
    MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  const enum MHD_Result queued = MHD_queue_response(conn, status, r);
  MHD_destroy_response(r);
  return queued;
}

/* A one-line plain-text answer (errors: what went wrong, for the person or the scraper's log). */
static enum MHD_Result respond_line(struct MHD_Connection *conn, unsigned status, const char *fmt,
                                    ...) __attribute__((format(printf, 3, 4)));
static enum MHD_Result respond_line(struct MHD_Connection *conn, unsigned status, const char *fmt,
                                    ...) {
  char *line = NULL;
  va_list ap;
  va_start(ap, fmt);
  int n = vasprintf(&line, fmt, ap);
  va_end(ap);
  if (n < 0) return MHD_NO;
  char *body = realloc(line, (size_t)n + 2);
  if (body == NULL) {
    free(line);
    return MHD_NO;
  }
  body[n] = '\n';
  body[n + 1] = '\0';
  return respond(conn, status, "text/plain; charset=utf-8", body, (size_t)n + 1);
}

/* A document written into a memory stream. */
typedef struct document {
  char *bytes;
  size_t size;
  FILE *f;
} document;

static bool document_open(document *d) {
  *d = (document){0};
  d->f = open_memstream(&d->bytes, &d->size);
  return d->f != NULL;
}

static enum MHD_Result document_send(document *d, struct MHD_Connection *conn, const char *type) {
  if (fclose(d->f) != 0) {
    free(d->bytes);
    return MHD_NO;
  }
  return respond(conn, MHD_HTTP_OK, type, d->bytes, d->size);
}

/* ---- which processes ---- */

/* The live processes a request of view may see (selector NULL: all), retained into a malloc'ed
 * array; NULL (count 0) when none or out of memory. */
static hd_process **select_processes(hd_collector *c, uid_t view,
                                     const heapdump_client_ProcessSelector *sel, size_t *count) {
  *count = 0;
  hd_process **list = malloc(HD_MAX_PROCESSES * sizeof *list);
  if (list == NULL) return NULL;
  (void)hd_select_processes(c, view, sel != NULL, sel, true, list, count);
  if (*count == 0) {
    free(list);
    return NULL;
  }
  return list;
}

static void release_processes(hd_process **list, size_t count) {
  for (size_t i = 0; i < count; i++) hd_process_release(list[i]);
  free(list);
}

/* A decimal pid (1 to INT32_MAX); 0 if text is not one. */
static pid_t parse_pid(const char *text, size_t length) {
  if (length == 0 || length > 10) return 0;
  uint64_t v = 0;
  for (size_t i = 0; i < length; i++) {
    if (text[i] < '0' || text[i] > '9') return 0;
    v = v * 10 + (uint64_t)(text[i] - '0');
  }
  return v > 0 && v <= INT32_MAX ? (pid_t)v : 0;
}

/* ---- /metrics ---- */

/* A label value in the exposition format: backslash, double quote and line feed escaped, bytes
 * that are not UTF-8 replaced. */
static void put_label_value(FILE *f, const char *text) {
  for (const unsigned char *s = (const unsigned char *)text; *s;) {
    const size_t n = hd_utf8_sequence(s);
    if (n == 0) {
      fputs(HD_UTF8_REPLACEMENT, f);
      s++;
      continue;
    }
    if (*s == '\\' || *s == '"') {
      fputc('\\', f);
      fputc(*s, f);
    } else if (*s == '\n') {
      fputs("\\n", f);
    } else {
      fwrite(s, 1, n, f);
    }
    s += n;
  }
}

typedef struct process_metric {
  const char *name, *type, *help;
  size_t offset; /* in hd_table_stats */
} process_metric;

#define STAT(field) offsetof(hd_table_stats, field)
static const process_metric kProcessMetrics[] = {
    {"heapdump_live_bytes", "gauge", "Bytes in the blocks the process has live.", STAT(live_bytes)},
    {"heapdump_live_blocks", "gauge", "Blocks the process has live.", STAT(live_blocks)},
    {"heapdump_peak_live_bytes", "gauge", "The most bytes the process has had live at once.",
     STAT(peak_live_bytes)},
    {"heapdump_allocated_bytes_total", "counter", "Bytes allocated since the process started.",
     STAT(bytes_allocated)},
    {"heapdump_allocated_blocks_total", "counter", "Blocks allocated since the process started.",
     STAT(blocks_allocated)},
    {"heapdump_freed_bytes_total", "counter", "Bytes freed since the process started.",
     STAT(bytes_freed)},
    {"heapdump_freed_blocks_total", "counter", "Blocks freed since the process started.",
     STAT(blocks_freed)},
    {"heapdump_dropped_allocations_total", "counter",
     "Allocations not recorded: the allocations table was full.", STAT(dropped_allocations)},
    {"heapdump_dropped_stack_traces_total", "counter",
     "Allocations recorded without their stack trace: the resources table was full.",
     STAT(dropped_stack_traces)},
    {"heapdump_dropped_resources_total", "counter",
     "Thread names and modules not recorded: the resources table was full.",
     STAT(dropped_resources)},
    {"heapdump_writes_past_block_end_total", "counter",
     "Frees of blocks the program had written past the end of.", STAT(writes_past_block_end)},
    {"heapdump_unwind_tables_refused", "gauge",
     "Modules whose unwind tables were inconsistent (unwound by frame pointers).",
     STAT(unwind_tables_refused)},
    {"heapdump_sample_bytes", "gauge",
     "Mean bytes allocated between two recorded blocks (0: every block recorded); when not 0, "
     "every other heapdump_ value of the process is an estimate.",
     STAT(sample_bytes)},
    {"heapdump_recording", "gauge",
     "When the process records its blocks: 0 since it started, 1 since it was armed (the dormant "
     "library, heapdump arm), 2 none since it was disarmed.",
     STAT(arm_state)},
    {"heapdump_unattributed_bytes", "gauge",
     "Live bytes allocated before the process was armed (or while it was disarmed), attributed "
     "to no stack trace: an estimate from glibc's statistics; 0 for a process recording since "
     "it started.",
     STAT(unattributed_bytes)},
};

static void put_labels(FILE *f, const hd_process *p) {
  fprintf(f, "{pid=\"%d\",process=\"", (int)p->pid);
  put_label_value(f, p->name);
  fputs("\"}", f);
}

/* The process metrics of the processes given, each family once with its HELP and TYPE. */
static void put_process_metrics(FILE *f, hd_process **list, size_t count) {
  hd_table_stats *stats = calloc(count ? count : 1, sizeof *stats);
  bool *ok = calloc(count ? count : 1, sizeof *ok);
  if (stats == NULL || ok == NULL) {
    free(stats);
    free(ok);
    return;
  }
  for (size_t i = 0; i < count; i++)
    ok[i] = hd_res_reader_stats(list[i]->res, &stats[i]) == HD_READ_OK;
  for (size_t m = 0; m < sizeof kProcessMetrics / sizeof kProcessMetrics[0]; m++) {
    const process_metric *pm = &kProcessMetrics[m];
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", pm->name, pm->help, pm->name, pm->type);
    for (size_t i = 0; i < count; i++) {
      if (!ok[i]) continue; /* a table that cannot be read says nothing rather than zeros */
      fputs(pm->name, f);
      put_labels(f, list[i]);
      fprintf(f, " %" PRIu64 "\n", *(const uint64_t *)((const char *)&stats[i] + pm->offset));
    }
  }
  free(stats);
  free(ok);
}

static void put_collector_metrics(FILE *f, hd_collector *c, size_t processes) {
  pthread_mutex_lock(&c->lock);
  const size_t stored = c->stored_count;
  uint64_t stored_bytes = 0;
  for (size_t i = 0; i < c->stored_count; i++) stored_bytes += c->stored[i].bytes;
  pthread_mutex_unlock(&c->lock);
  fprintf(f,
          "# HELP heapdump_collector_processes Instrumented processes the collector serves.\n"
          "# TYPE heapdump_collector_processes gauge\n"
          "heapdump_collector_processes %zu\n"
          "# HELP heapdump_collector_stored_snapshots Snapshots the collector has stored.\n"
          "# TYPE heapdump_collector_stored_snapshots gauge\n"
          "heapdump_collector_stored_snapshots %zu\n"
          "# HELP heapdump_collector_storage_bytes Bytes the stored snapshots take on disk.\n"
          "# TYPE heapdump_collector_storage_bytes gauge\n"
          "heapdump_collector_storage_bytes %" PRIu64
          "\n"
          "# HELP heapdump_collector_snapshots_served_total Snapshot streams served, live or "
          "stored.\n"
          "# TYPE heapdump_collector_snapshots_served_total counter\n"
          "heapdump_collector_snapshots_served_total{kind=\"live\"} %" PRIuFAST64
          "\n"
          "heapdump_collector_snapshots_served_total{kind=\"stored\"} %" PRIuFAST64
          "\n"
          "# HELP heapdump_collector_errors_total Warnings and errors the collector logged "
          "(refused requests, processes it could not read, failed stores).\n"
          "# TYPE heapdump_collector_errors_total counter\n"
          "heapdump_collector_errors_total %" PRIuFAST64 "\n",
          processes, stored, stored_bytes, atomic_load(&c->live_streams_served),
          atomic_load(&c->stored_streams_served), atomic_load(&c->warnings_logged));
}

static enum MHD_Result serve_metrics(hd_http *h, struct MHD_Connection *conn, uid_t view,
                                     pid_t only) {
  heapdump_client_ProcessSelector by_pid = {
      .which_selector = heapdump_client_ProcessSelector_by_koid_tag,
      .selector.by_koid = (uint64_t)only};
  size_t count;
  hd_process **list = select_processes(h->c, view, only ? &by_pid : NULL, &count);
  if (only != 0 && count == 0) {
    return respond_line(conn, MHD_HTTP_NOT_FOUND, "no process %d is profiled here", (int)only);
  }
  document d;
  if (!document_open(&d)) {
    release_processes(list, count);
    return MHD_NO;
  }
  put_process_metrics(d.f, list, count);
  if (only == 0 && view == 0) put_collector_metrics(d.f, h->c, count);
  release_processes(list, count);
  return document_send(&d, conn, "text/plain; version=0.0.4; charset=utf-8");
}

/* ---- profiles ---- */

/* Puts a channel being received on where a stop finds it; the slot's index. A stop that came
 * first has cut off the others already: this one is cut off at once. */
static int claim_receiving(hd_http *h, int fd) {
  pthread_mutex_lock(&h->receiving_lock);
  int slot = 0;
  while (slot < MAX_PROFILES_AT_ONCE - 1 && h->receiving[slot] >= 0) slot++;
  h->receiving[slot] = fd;
  const bool stopping = atomic_load(&h->stopping);
  pthread_mutex_unlock(&h->receiving_lock);
  if (stopping) shutdown(fd, SHUT_RDWR);
  return slot;
}

static void release_receiving(hd_http *h, int slot) {
  pthread_mutex_lock(&h->receiving_lock);
  h->receiving[slot] = -1;
  pthread_mutex_unlock(&h->receiving_lock);
}

/* Takes a live snapshot of pid (stored false) or reads stored snapshot id into r, as a client
 * would; 0, or an HTTP status with a line in why. */
static unsigned receive_snapshot(hd_http *h, uid_t view, bool stored, pid_t pid, uint32_t id,
                                 hd_reassembler *r, char *why, size_t why_size) {
  int ends[2];
  hd_stream_job *job = calloc(1, sizeof *job);
  if (job == NULL || hd_channel_pair(ends) != HD_OK) {
    free(job);
    snprintf(why, why_size, "out of resources");
    return MHD_HTTP_SERVICE_UNAVAILABLE;
  }
  job->c = h->c;
  job->receiver = ends[1];
  job->peer_uid = view;
  job->peer_pid = getpid(); /* all of HTTP is one client of the fair scheduler */
  job->stored = stored;
  job->stored_id = id;
  job->multi_process = !stored; /* each process comes with its header: name, pid, why unread */
  job->has_selector = !stored;
  job->selector = (heapdump_client_ProcessSelector){
      .which_selector = heapdump_client_ProcessSelector_by_koid_tag,
      .selector.by_koid = (uint64_t)pid};
  if (stored) {
    /* A stored snapshot may carry block contents: kept on disk while it is read, never sent. */
    int spill = open(P_tmpdir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (spill >= 0) hd_reassembler_spill_contents(r, spill);
  }
  const int slot = claim_receiving(h, ends[0]);
  hd_start_stream(job);
  uint32_t error = 0;
  hd_status status = hd_snapshot_receive(ends[0], !stored, r, &error);
  release_receiving(h, slot);
  close(ends[0]);
  if (status == HD_OK && error == 0) status = hd_reassembler_finish(r);
  if (error == heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND) {
    snprintf(why, why_size, "no stored snapshot %u", id);
    return MHD_HTTP_NOT_FOUND;
  }
  if (error == heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH) {
    snprintf(why, why_size, "no process %d is profiled here", (int)pid);
    return MHD_HTTP_NOT_FOUND;
  }
  if (status != HD_OK || error != 0 || r->snapshot_count != 1) {
    snprintf(why, why_size, "the snapshot failed: %s",
             error != 0 ? "the collector could not take it"
                        : (r->error[0] ? r->error : hd_status_str(status)));
    return MHD_HTTP_SERVICE_UNAVAILABLE;
  }
  if (r->snapshots[0]->not_read[0] != '\0') {
    snprintf(why, why_size, "process %d could not be read: %s", (int)pid,
             r->snapshots[0]->not_read);
    return MHD_HTTP_SERVICE_UNAVAILABLE;
  }
  return 0;
}

/* Writes r as Go's heap profile into a memory file, its default sample type `sample`; the
 * descriptor, or -1 with why. */
static int write_profile(hd_http *h, const hd_reassembler *r, hd_pprof_sample sample, char *why,
                         size_t why_size) {
  int fd = memfd_create("heapdump-profile", MFD_CLOEXEC);
  int dup_fd = fd >= 0 ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
  FILE *out = dup_fd >= 0 ? fdopen(dup_fd, "w") : NULL;
  if (out == NULL) {
    if (dup_fd >= 0) close(dup_fd);
    if (fd >= 0) close(fd);
    snprintf(why, why_size, "cannot make the profile: %s", strerror(errno));
    return -1;
  }
  /* A root collector reads the modules an unprivileged process names: only files that process
   * could not have written. */
  const hd_symbolizer_options trust = {.trusted_files_only = geteuid() == 0};
  hd_symbolizer *symbolizer = NULL;
  char error[256] = "";
  pthread_mutex_lock(&h->write_lock);
  if (hd_symbolizer_create(&trust, &symbolizer) != 0) symbolizer = NULL;
  hd_pprof_options options = {
      .symbolizer = symbolizer, .default_sample = sample, .go_order = true, .final_symbols = true};
  int rc = hd_pprof_write(r, &options, out, error, sizeof error);
  if (symbolizer != NULL) hd_symbolizer_destroy(symbolizer);
  pthread_mutex_unlock(&h->write_lock);
  if (fclose(out) != 0 && rc == 0) rc = -EIO;
  if (rc != 0) {
    close(fd);
    snprintf(why, why_size, "cannot make the profile: %s", error[0] ? error : strerror(-rc));
    return -1;
  }
  return fd;
}

static enum MHD_Result serve_profile(hd_http *h, struct MHD_Connection *conn, uid_t view,
                                     bool stored, pid_t pid, uint32_t id, const char *filename) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += PROFILE_WAIT_SECONDS;
  int waited;
  while ((waited = sem_timedwait(&h->profiles, &until)) != 0 && errno == EINTR) continue;
  if (waited != 0) {
    return respond_line(conn, MHD_HTTP_SERVICE_UNAVAILABLE,
                        "too many profiles are being made: try again later");
  }
  if (atomic_load(&h->stopping)) {
    sem_post(&h->profiles);
    return respond_line(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "the collector is stopping");
  }
  hd_reassembler r;
  hd_reassembler_init(&r);
  char why[400];
  unsigned status = receive_snapshot(h, view, stored, pid, id, &r, why, sizeof why);
  /* As in Go: the same profile, whose default sample type is what is live for `heap` and what
   * was ever allocated for `allocs`. */
  const hd_pprof_sample sample =
      strcmp(filename, "allocs") == 0 ? HD_PPROF_ALLOC_SPACE : HD_PPROF_INUSE_SPACE;
  if (status == 0 && atomic_load(&h->stopping)) {
    snprintf(why, sizeof why, "the collector is stopping");
    status = MHD_HTTP_SERVICE_UNAVAILABLE;
  }
  int fd = status == 0 ? write_profile(h, &r, sample, why, sizeof why) : -1;
  hd_reassembler_destroy(&r);
  sem_post(&h->profiles);
  if (status != 0) return respond_line(conn, status, "%s", why);
  if (fd < 0) return respond_line(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "%s", why);
  const off_t size = lseek(fd, 0, SEEK_END);
  struct MHD_Response *resp = size >= 0 ? MHD_create_response_from_fd((size_t)size, fd) : NULL;
  if (resp == NULL) {
    close(fd);
    return MHD_NO;
  }
  char disposition[96];
  snprintf(disposition, sizeof disposition, "attachment; filename=\"%s\"", filename);
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/octet-stream");
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_DISPOSITION, disposition);
  const enum MHD_Result queued = MHD_queue_response(conn, MHD_HTTP_OK, resp);
  MHD_destroy_response(resp);
  return queued;
}

/* /debug/pprof/heap or /allocs without a process in the path: ?pid=PID, else the only process. */
static enum MHD_Result serve_plain_profile(hd_http *h, struct MHD_Connection *conn, uid_t view,
                                           const char *filename) {
  const char *arg = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "pid");
  if (arg != NULL) {
    const pid_t pid = parse_pid(arg, strlen(arg));
    if (pid == 0) return respond_line(conn, MHD_HTTP_BAD_REQUEST, "bad pid: %s", arg);
    return serve_profile(h, conn, view, false, pid, 0, filename);
  }
  size_t count;
  hd_process **list = select_processes(h->c, view, NULL, &count);
  const pid_t only = count == 1 ? list[0]->pid : 0;
  release_processes(list, count);
  if (count == 0) return respond_line(conn, MHD_HTTP_NOT_FOUND, "no process is profiled here");
  if (only == 0) {
    return respond_line(conn, MHD_HTTP_BAD_REQUEST,
                        "%zu processes are profiled here: add ?pid=PID (see /debug/pprof/)", count);
  }
  return serve_profile(h, conn, view, false, only, 0, filename);
}

/* The pid of the only live process called name; 0 with a response queued otherwise. */
static pid_t pid_of_name(hd_http *h, struct MHD_Connection *conn, uid_t view, const char *name,
                         enum MHD_Result *queued) {
  heapdump_client_ProcessSelector by_name = {.which_selector =
                                                 heapdump_client_ProcessSelector_by_name_tag};
  if (strlen(name) >= sizeof by_name.selector.by_name) {
    *queued = respond_line(conn, MHD_HTTP_NOT_FOUND, "no process is called that");
    return 0;
  }
  snprintf(by_name.selector.by_name, sizeof by_name.selector.by_name, "%s", name);
  size_t count;
  hd_process **list = select_processes(h->c, view, &by_name, &count);
  const pid_t pid = count == 1 ? list[0]->pid : 0;
  release_processes(list, count);
  if (count == 0) {
    *queued = respond_line(conn, MHD_HTTP_NOT_FOUND, "no process called %s is profiled here", name);
  } else if (count > 1) {
    *queued = respond_line(conn, MHD_HTTP_CONFLICT,
                           "%zu processes are called %s: use /process/PID/ (see /debug/pprof/)",
                           count, name);
  }
  return pid;
}

/* ---- documents ---- */

static void put_html_text(FILE *f, const char *s) {
  for (; *s; s++) {
    switch (*s) {
      case '<': fputs("&lt;", f); break;
      case '>': fputs("&gt;", f); break;
      case '&': fputs("&amp;", f); break;
      case '"': fputs("&quot;", f); break;
      default: fputc(*s, f);
    }
  }
}

static enum MHD_Result serve_index(hd_http *h, struct MHD_Connection *conn, uid_t view) {
  size_t count;
  hd_process **list = select_processes(h->c, view, NULL, &count);
  document d;
  if (!document_open(&d)) {
    release_processes(list, count);
    return MHD_NO;
  }
  fputs(
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>heapdump</title></head>"
      "<body>\n<h1>Profiled processes</h1>\n<table>\n"
      "<tr><th>pid</th><th>process</th><th>profiles</th><th>metrics</th></tr>\n",
      d.f);
  for (size_t i = 0; i < count; i++) {
    const int pid = (int)list[i]->pid;
    fprintf(d.f, "<tr><td>%d</td><td>", pid);
    put_html_text(d.f, list[i]->name);
    fprintf(d.f,
            "</td><td><a href=\"/process/%d/debug/pprof/heap\">heap</a> "
            "<a href=\"/process/%d/debug/pprof/allocs\">allocs</a></td>"
            "<td><a href=\"/process/%d/metrics\">metrics</a></td></tr>\n",
            pid, pid, pid);
  }
  fputs(
      "</table>\n<p><a href=\"/metrics\">/metrics</a> · <a href=\"/targets\">/targets</a> "
      "(Prometheus HTTP service discovery) · <a href=\"/api/v1/snapshots\">stored "
      "snapshots</a></p>\n</body></html>\n",
      d.f);
  release_processes(list, count);
  return document_send(&d, conn, "text/html; charset=utf-8");
}

/* Prometheus's HTTP service discovery: one target group per process, all at this address (the
 * Host the scraper reached us by), each with its own paths. */
static enum MHD_Result serve_targets(hd_http *h, struct MHD_Connection *conn, uid_t view) {
  const char *host = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Host");
  if (host == NULL || host[0] == '\0') host = h->address;
  size_t count;
  hd_process **list = select_processes(h->c, view, NULL, &count);
  document d;
  if (!document_open(&d)) {
    release_processes(list, count);
    return MHD_NO;
  }
  fputc('[', d.f);
  for (size_t i = 0; i < count; i++) {
    const int pid = (int)list[i]->pid;
    fputs(i ? ",{\"targets\":[" : "{\"targets\":[", d.f);
    hd_json_string(d.f, host);
    fprintf(d.f,
            "],\"labels\":{\"__metrics_path__\":\"/process/%d/metrics\","
            "\"__profile_path_prefix__\":\"/process/%d\",\"pid\":\"%d\",\"process\":",
            pid, pid, pid);
    hd_json_string(d.f, list[i]->name);
    fputs(",\"service_name\":", d.f);
    hd_json_string(d.f, list[i]->name);
    fputs("}}", d.f);
  }
  fputs("]\n", d.f);
  release_processes(list, count);
  return document_send(&d, conn, "application/json");
}

static enum MHD_Result serve_snapshot_list(hd_http *h, struct MHD_Connection *conn, uid_t view) {
  hd_stored_list listing = {0};
  if (hd_storage_list(h->c, view, NULL, &listing) != 0) return MHD_NO;
  hd_listing_item *items = calloc(listing.count ? listing.count : 1, sizeof *items);
  document d;
  if (items == NULL || !document_open(&d)) {
    free(items);
    free(listing.items);
    return MHD_NO;
  }
  for (size_t i = 0; i < listing.count; i++) {
    const hd_stored_snapshot_info *s = &listing.items[i];
    hd_listing_item *out = &items[i];
    *out = (hd_listing_item){.id = s->id,
                             .pid = s->pid,
                             .has_totals = s->taken_at_unix_ns != 0,
                             .taken_at_unix_ns = s->taken_at_unix_ns,
                             .live_bytes = s->live_bytes,
                             .live_blocks = s->live_blocks,
                             .stored_bytes = s->bytes};
    snprintf(out->name, sizeof out->name, "%s", s->name);
    snprintf(out->process_name, sizeof out->process_name, "%s", s->process_name);
  }
  hd_listing_write_json(d.f, items, listing.count);
  free(items);
  free(listing.items);
  return document_send(&d, conn, "application/json");
}

/* ---- routing ---- */

/* The profile a path under a process's prefix names ("/debug/pprof/heap" or ".../allocs"), as
 * the file name it is served under; NULL if none. */
static const char *profile_of(const char *rest) {
  if (strcmp(rest, "/debug/pprof/heap") == 0) return "heap";
  if (strcmp(rest, "/debug/pprof/allocs") == 0) return "allocs";
  return NULL;
}

static enum MHD_Result route(hd_http *h, struct MHD_Connection *conn, uid_t view, const char *url) {
  if (strcmp(url, "/metrics") == 0) return serve_metrics(h, conn, view, 0);
  if (strcmp(url, "/") == 0 || strcmp(url, "/debug/pprof/") == 0 ||
      strcmp(url, "/debug/pprof") == 0) {
    return serve_index(h, conn, view);
  }
  if (strcmp(url, "/targets") == 0) return serve_targets(h, conn, view);
  const char *profile = profile_of(url);
  if (profile != NULL) return serve_plain_profile(h, conn, view, profile);
  if (strcmp(url, "/api/v1/snapshots") == 0) return serve_snapshot_list(h, conn, view);
  if (strncmp(url, "/api/v1/snapshots/", 18) == 0) {
    const char *digits = url + 18;
    const pid_t id = parse_pid(digits, strlen(digits)); /* ids are positive 32-bit numbers too */
    if (id == 0) return respond_line(conn, MHD_HTTP_NOT_FOUND, "no stored snapshot %s", digits);
    return serve_profile(h, conn, view, true, 0, (uint32_t)id, "heap");
  }
  if (strncmp(url, "/process/", 9) == 0 || strncmp(url, "/name/", 6) == 0) {
    const bool by_name = url[1] == 'n';
    const char *key = url + (by_name ? 6 : 9);
    const char *slash = strchr(key, '/');
    const char *rest = slash != NULL ? slash : "";
    if (strcmp(rest, "/metrics") != 0 && profile_of(rest) == NULL) {
      return respond_line(conn, MHD_HTTP_NOT_FOUND,
                          "not a path of this collector (see /debug/pprof/)");
    }
    pid_t pid;
    enum MHD_Result queued = MHD_NO;
    if (by_name) {
      char name[HD_NAME_SIZE + 1];
      const size_t n = (size_t)(rest - key);
      if (n == 0 || n >= sizeof name) {
        return respond_line(conn, MHD_HTTP_NOT_FOUND, "no process is called that");
      }
      snprintf(name, sizeof name, "%.*s", (int)n, key);
      if ((pid = pid_of_name(h, conn, view, name, &queued)) == 0) return queued;
    } else if ((pid = parse_pid(key, (size_t)(rest - key))) == 0) {
      return respond_line(conn, MHD_HTTP_NOT_FOUND, "not a pid: %.*s", (int)(rest - key), key);
    }
    if (strcmp(rest, "/metrics") == 0) return serve_metrics(h, conn, view, pid);
    return serve_profile(h, conn, view, false, pid, 0, profile_of(rest));
  }
  return respond_line(conn, MHD_HTTP_NOT_FOUND, "not a path of this collector (see /debug/pprof/)");
}

/* The address of a TCP socket as /proc/net/tcp{,6} prints it: the address words as stored, in
 * hex, then the port. */
static bool proc_net_address(const struct sockaddr_storage *a, char *out, size_t size) {
  if (a->ss_family == AF_INET) {
    const struct sockaddr_in *v4 = (const struct sockaddr_in *)a;
    return snprintf(out, size, "%08X:%04X", v4->sin_addr.s_addr, ntohs(v4->sin_port)) > 0;
  }
  if (a->ss_family == AF_INET6) {
    const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)a;
    uint32_t w[4];
    memcpy(w, &v6->sin6_addr, sizeof w);
    return snprintf(out, size, "%08X%08X%08X%08X:%04X", w[0], w[1], w[2], w[3],
                    ntohs(v6->sin6_port)) > 0;
  }
  return false;
}

/* The user owning the client's end of a loopback connection: the kernel lists both ends of it,
 * with their owners, in /proc/net/tcp{,6}. -1 if it cannot be told. */
static long client_uid(struct MHD_Connection *conn) {
  const union MHD_ConnectionInfo *info =
      MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
  struct sockaddr_storage ours, theirs;
  socklen_t ours_size = sizeof ours, theirs_size = sizeof theirs;
  char want_local[64], want_remote[64];
  if (info == NULL || getsockname(info->connect_fd, (struct sockaddr *)&ours, &ours_size) != 0 ||
      getpeername(info->connect_fd, (struct sockaddr *)&theirs, &theirs_size) != 0 ||
      !proc_net_address(&theirs, want_local, sizeof want_local) ||
      !proc_net_address(&ours, want_remote, sizeof want_remote)) {
    return -1;
  }
  FILE *f = fopen(theirs.ss_family == AF_INET6 ? "/proc/net/tcp6" : "/proc/net/tcp", "re");
  if (f == NULL) return -1;
  long uid = -1;
  char line[512], local[64], remote[64];
  unsigned owner;
  while (uid < 0 && fgets(line, sizeof line, f) != NULL) {
    if (sscanf(line, " %*u: %63s %63s %*x %*x:%*x %*x:%*x %*x %u", local, remote, &owner) == 3 &&
        strcasecmp(local, want_local) == 0 && strcasecmp(remote, want_remote) == 0) {
      uid = (long)owner;
    }
  }
  fclose(f);
  return uid;
}

/* Whether a Host header names the loopback interface ("localhost", 127.x.y.z or [::1], with or
 * without a port): a page of another site that a browser was made to send here (DNS rebinding)
 * names that site. */
static bool loopback_host(const char *host) {
  if (host == NULL) return true; /* HTTP/1.0 */
  size_t n = strcspn(host, ":");
  if (host[0] == '[') n = strcspn(host, "]") + 1;
  return (n == 9 && strncmp(host, "localhost", 9) == 0) ||
         (n == 5 && strncmp(host, "[::1]", 5) == 0) ||
         (n >= 9 && strncmp(host, "127.", 4) == 0 && strspn(host, "0123456789.") == n);
}

/* Who a request may read as: the uid whose processes and snapshots it sees (0: all), or false
 * (with the reason) if none. A bearer of the token sees what the collector serves. Without a
 * token (loopback only) the client is known by the owner of its socket, and sees what it would
 * see on the Unix socket: a root collector shows each user their own processes; another
 * collector serves its own user and root, and nobody else. */
static bool request_view(const hd_http *h, struct MHD_Connection *conn, uid_t *view,
                         const char **refused) {
  if (h->token_size != 0) {
    *view = 0;
    return true;
  }
  if (!loopback_host(MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Host"))) {
    *refused = "without a token, only requests to a loopback host name are served";
    return false;
  }
  const long uid = client_uid(conn);
  const uid_t self = geteuid();
  if (uid >= 0 && self == 0) {
    *view = (uid_t)uid;
    return true;
  }
  if (uid == 0 || (uid > 0 && (uid_t)uid == self)) {
    *view = 0;
    return true;
  }
  *refused =
      "without a token, only the collector's own user and root may read it (see "
      "--http-token-file)";
  return false;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **state) {
  (void)version, (void)upload, (void)upload_size;
  hd_http *h = cls;
  /* Every answer is given at the headers: this API takes no request body, so one is never read
   * (libmicrohttpd then closes the connection after the answer). */
  static int seen;
  *state = &seen;
  if (!authorized(h, conn)) {
    return respond_line(conn, MHD_HTTP_UNAUTHORIZED, "a bearer token is needed");
  }
  if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
    return respond_line(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET is served");
  }
  uid_t view;
  const char *refused = NULL;
  if (!request_view(h, conn, &view, &refused)) {
    return respond_line(conn, MHD_HTTP_FORBIDDEN, "%s", refused);
  }
  if (atomic_load(&h->stopping) || atomic_load(&h->c->stop_requested)) {
    return respond_line(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "the collector is stopping");
  }
  return route(h, conn, view, url);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
  hd_http *h = cls;
  char line[256];
  vsnprintf(line, sizeof line, fmt, ap);
  line[strcspn(line, "\n")] = '\0';
  hd_log(h->c, HD_LOG_DEBUG, "http: %s", line);
}

static void destroy(hd_http *h) {
  sem_destroy(&h->profiles);
  pthread_mutex_destroy(&h->write_lock);
  pthread_mutex_destroy(&h->receiving_lock);
  explicit_bzero(h->token, sizeof h->token);
  free(h);
}

int hd_http_start(hd_collector *c, const char *address, const char *token_file, hd_http **out,
                  char *error, size_t error_size) {
  *out = NULL;
  hd_http *h = calloc(1, sizeof *h);
  if (h == NULL) return -ENOMEM;
  h->c = c;
  sem_init(&h->profiles, 0, MAX_PROFILES_AT_ONCE);
  pthread_mutex_init(&h->write_lock, NULL);
  pthread_mutex_init(&h->receiving_lock, NULL);
  for (int i = 0; i < MAX_PROFILES_AT_ONCE; i++) h->receiving[i] = -1;
  atomic_init(&h->stopping, false);
  snprintf(h->address, sizeof h->address, "%s", address);
  struct sockaddr_storage where;
  socklen_t where_size;
  int rc = parse_address(address, &where, &where_size, error, error_size);
  if (rc == 0 && token_file != NULL) rc = read_token(h, token_file, error, error_size);
  if (rc == 0 && token_file == NULL && !is_loopback((const struct sockaddr *)&where)) {
    snprintf(error, error_size,
             "--http %s is not a loopback address: give --http-token-file FILE, whose token "
             "every request must then bear",
             address);
    rc = -EPERM;
  }
  if (rc != 0) {
    destroy(h);
    return rc;
  }
  unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                   MHD_USE_ERROR_LOG;
  if (where.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
  /* Its threads take no signal: the daemon's handlers run on the threads that expect them. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  h->daemon = MHD_start_daemon(
      flags, 0, NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&where,
      MHD_OPTION_CONNECTION_LIMIT, (unsigned)MAX_CONNECTIONS, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
      (unsigned)MAX_CONNECTIONS_PER_ADDRESS, MHD_OPTION_CONNECTION_TIMEOUT,
      (unsigned)CONNECTION_TIMEOUT_SECONDS, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
      (size_t)REQUEST_MEMORY_BYTES, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h, MHD_OPTION_END);
  const int start_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (h->daemon == NULL) {
    snprintf(error, error_size, "--http %s: cannot listen there (%s)", address,
             start_errno ? strerror(start_errno) : "libmicrohttpd refused");
    destroy(h);
    return -EADDRNOTAVAIL;
  }
  /* Port 0 lets the system choose: the log and the discovery document tell the one it chose. */
  const union MHD_DaemonInfo *bound = MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_BIND_PORT);
  const char *port = strrchr(address, ':');
  if (bound != NULL && port != NULL && strcmp(port, ":0") == 0) {
    snprintf(h->address, sizeof h->address, "%.*s:%u", (int)(port - address), address,
             (unsigned)bound->port);
  }
  hd_log(c, HD_LOG_INFO, "serving HTTP on %s%s", h->address,
         h->token_size ? " (bearer token required)" : "");
  *out = h;
  return 0;
}

void hd_http_stop(hd_http *h) {
  if (h == NULL) return;
  /* Requests in flight end now rather than when their snapshots would: the channels they
   * receive on are cut, and those waiting for their turn are woken to see the stop. */
  atomic_store(&h->stopping, true);
  pthread_mutex_lock(&h->receiving_lock);
  for (int i = 0; i < MAX_PROFILES_AT_ONCE; i++) {
    if (h->receiving[i] >= 0) shutdown(h->receiving[i], SHUT_RDWR);
  }
  pthread_mutex_unlock(&h->receiving_lock);
  for (int i = 0; i < MAX_CONNECTIONS; i++) sem_post(&h->profiles);
  MHD_stop_daemon(h->daemon);
  destroy(h);
}
