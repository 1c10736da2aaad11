/* hd_snapshot_client: takes one live snapshot of a process through a running collector and
 * reports how long it took end to end (connect to the final empty batch), how many bytes came
 * over the wire and how many elements of each kind. Elements are decoded and counted, not
 * reassembled: the benchmark measures the collector and the transport, not a client's model.
 *
 * Output, one line: elapsed_ns=… wire_bytes=… batches=… allocations=… stack_traces=…
 * thread_infos=… regions=… block_contents=… contents_bytes=… root_regions=… other=…
 * With --leak-check (and --contents) the snapshot is also reassembled and classified as
 * `heapdump report` does, adding leak_check_ns=… (the classification alone) and the blocks of
 * each category: definitely_lost=… indirectly_lost=… possibly_lost=… still_reachable=… */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "heapdump/fidl/batch.h"
#include "heapdump/fidl/channel.h"
#include "heapdump/fidl/message.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/reach.h"
#include "heapdump_client.bindings.h"

typedef struct counts {
  uint64_t wire_bytes, batches;
  uint64_t allocations, stack_traces, thread_infos, regions, block_contents, contents_bytes,
      root_regions, other;
  hd_reassembler *model; /* --leak-check: the snapshot, reassembled */
  uint32_t error;        /* from ReportError, 0 if none */
  bool ended;
  hd_batch_reader *reader;
  int channel;
} counts;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static hd_status count_element(void *ctx, const hd_element *e) {
  counts *c = ctx;
  switch (e->element->which_element) {
    case heapdump_client_SnapshotElement_allocation_tag: c->allocations++; break;
    case heapdump_client_SnapshotElement_stack_trace_tag: c->stack_traces++; break;
    case heapdump_client_SnapshotElement_thread_info_tag: c->thread_infos++; break;
    case heapdump_client_SnapshotElement_executable_region_tag: c->regions++; break;
    case heapdump_client_SnapshotElement_block_contents_tag:
      c->block_contents++;
      c->contents_bytes += e->contents_size;
      break;
    case heapdump_client_SnapshotElement_root_region_tag: c->root_regions++; break;
    default: c->other++; break;
  }
  return c->model != NULL ? hd_reassembler_add(c->model, e) : HD_OK;
}

/* Classifies the reassembled snapshot; prints the time the classification alone took and the
 * blocks of each category. */
static int classify_blocks(hd_reassembler *model) {
  if (hd_reassembler_finish(model) != HD_OK || model->snapshot_count != 1) {
    fprintf(stderr, "hd_snapshot_client: the snapshot does not reassemble: %s\n", model->error);
    return 1;
  }
  const hd_snapshot *s = model->snapshots[0];
  uint8_t *categories = malloc(s->allocation_count + 1);
  uint64_t start = now_ns();
  int rc = categories != NULL ? hd_reach_classify(s, categories, NULL) : -ENOMEM;
  uint64_t took = now_ns() - start;
  if (rc != 0) {
    fprintf(stderr, "hd_snapshot_client: leak check: %s\n", strerror(-rc));
    free(categories);
    return 1;
  }
  uint64_t blocks[HD_REACH_CATEGORIES] = {0};
  for (size_t i = 0; i < s->allocation_count; i++) blocks[categories[i]]++;
  free(categories);
  printf(" leak_check_ns=%" PRIu64 " definitely_lost=%" PRIu64 " indirectly_lost=%" PRIu64
         " possibly_lost=%" PRIu64 " still_reachable=%" PRIu64,
         took, blocks[HD_DEFINITELY_LOST], blocks[HD_INDIRECTLY_LOST], blocks[HD_POSSIBLY_LOST],
         blocks[HD_STILL_REACHABLE]);
  return 0;
}

static void prepare_batch(void *ctx, heapdump_client_SnapshotReceiverBatchRequest *req) {
  counts *c = ctx;
  hd_batch_reader_prepare(c->reader, req);
}

static hd_status on_batch(void *ctx, hd_message *msg,
                          heapdump_client_SnapshotReceiverBatchRequest *req) {
  (void)req;
  counts *c = ctx;
  c->batches++;
  c->wire_bytes += msg->size;
  if (c->reader->element_count == 0) c->ended = true;
  heapdump_client_Empty empty = heapdump_client_Empty_init_zero;
  return hd_fidl_snapshot_receiver_batch_reply(c->channel, msg, msg->txid, &empty);
}

static hd_status on_report_error(void *ctx, hd_message *msg,
                                 heapdump_client_SnapshotReceiverReportErrorRequest *req) {
  counts *c = ctx;
  c->wire_bytes += msg->size;
  c->error = req->has_error ? (uint32_t)req->error : UINT32_MAX;
  c->ended = true;
  heapdump_client_Empty empty = heapdump_client_Empty_init_zero;
  return hd_fidl_snapshot_receiver_report_error_reply(c->channel, msg, msg->txid, &empty);
}

static void usage(FILE *out) {
  fprintf(out,
          "usage: hd_snapshot_client --socket PATH --pid PID [--contents]\n"
          "  --socket PATH  the collector's socket\n"
          "  --pid PID      the process to snapshot (a registered one)\n"
          "  --contents     ask for every block's bytes too\n"
          "  --leak-check   classify the blocks as heapdump report does (with --contents)\n");
}

int main(int argc, char **argv) {
  static const struct option longopts[] = {
      {"socket", required_argument, 0, 's'}, {"pid", required_argument, 0, 'p'},
      {"contents", no_argument, 0, 'c'},     {"leak-check", no_argument, 0, 'l'},
      {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
  const char *socket_path = NULL;
  unsigned long pid = 0;
  bool contents = false, leak_check = false;
  int opt;
  char *end;
  while ((opt = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    switch (opt) {
      case 's': socket_path = optarg; break;
      case 'p':
        errno = 0;
        pid = strtoul(optarg, &end, 10);
        if (errno != 0 || *end != '\0') pid = 0;
        break;
      case 'c': contents = true; break;
      case 'l': leak_check = true; break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (socket_path == NULL || pid == 0 || optind != argc) {
    usage(stderr);
    return 2;
  }

  hd_message *msg = malloc(sizeof *msg);
  hd_batch_reader *reader = malloc(sizeof *reader);
  if (msg == NULL || reader == NULL) {
    fprintf(stderr, "hd_snapshot_client: out of memory\n");
    return 1;
  }
  counts c = {.reader = reader};
  if (leak_check) {
    c.model = calloc(1, sizeof *c.model);
    if (c.model == NULL) {
      fprintf(stderr, "hd_snapshot_client: out of memory\n");
      return 1;
    }
    hd_reassembler_init(c.model);
  }
  hd_batch_reader_init(reader, count_element, &c);

  uint64_t start = now_ns();
  int collector_fd, ends[2];
  hd_status status = hd_channel_connect(socket_path, &collector_fd);
  if (status != HD_OK) {
    fprintf(stderr, "hd_snapshot_client: connect %s: %s\n", socket_path, hd_status_str(status));
    return 1;
  }
  status = hd_channel_pair(ends);
  if (status != HD_OK) {
    fprintf(stderr, "hd_snapshot_client: socketpair: %s\n", hd_status_str(status));
    return 1;
  }
  heapdump_client_CollectorTakeLiveSnapshotRequest req =
      heapdump_client_CollectorTakeLiveSnapshotRequest_init_zero;
  req.has_process_selector = true;
  req.process_selector.which_selector = heapdump_client_ProcessSelector_by_koid_tag;
  req.process_selector.selector.by_koid = pid;
  req.has_receiver = true;
  req.receiver.has_index = true;
  req.receiver.index = 0;
  req.has_with_contents = true;
  req.with_contents = contents;
  status = hd_fidl_collector_take_live_snapshot(collector_fd, msg, &req, &ends[1], 1);
  close(ends[1]);
  if (status != HD_OK) {
    fprintf(stderr, "hd_snapshot_client: TakeLiveSnapshot: %s\n", hd_status_str(status));
    return 1;
  }
  c.channel = ends[0];
  const hd_fidl_snapshot_receiver_server server = {
      .batch_prepare = prepare_batch, .batch = on_batch, .report_error = on_report_error};
  while (status == HD_OK && !c.ended) {
    status = hd_message_recv(ends[0], msg);
    if (status == HD_OK) status = hd_fidl_snapshot_receiver_dispatch(&server, &c, msg);
  }
  uint64_t elapsed = now_ns() - start;
  close(ends[0]);
  close(collector_fd);
  if (status != HD_OK) {
    fprintf(stderr, "hd_snapshot_client: stream: %s\n", hd_status_str(status));
    return 1;
  }
  if (c.error != 0) {
    fprintf(stderr, "hd_snapshot_client: the collector reported error %" PRIu32 "\n", c.error);
    return 1;
  }
  printf("elapsed_ns=%" PRIu64 " wire_bytes=%" PRIu64 " batches=%" PRIu64 " allocations=%" PRIu64
         " stack_traces=%" PRIu64 " thread_infos=%" PRIu64 " regions=%" PRIu64
         " block_contents=%" PRIu64 " contents_bytes=%" PRIu64 " root_regions=%" PRIu64
         " other=%" PRIu64,
         elapsed, c.wire_bytes, c.batches, c.allocations, c.stack_traces, c.thread_infos, c.regions,
         c.block_contents, c.contents_bytes, c.root_regions, c.other);
  if (c.model != NULL) {
    int rc = classify_blocks(c.model);
    hd_reassembler_destroy(c.model);
    free(c.model);
    if (rc != 0) return 1;
  }
  printf("\n");
  free(msg);
  free(reader);
  return 0;
}
