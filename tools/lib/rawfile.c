/* The raw snapshot file (see rawfile.h and docs/file-format.md). Writing re-encodes the
 * reassembled model through the same batch writer the collector uses, so a raw file is exactly
 * what a receiver would have been sent; reading feeds each batch to a reassembler as a receiver
 * does, so the same checks apply to files and to streams. */
#include "heapdump/tools/rawfile.h"

#include <errno.h>
#include <pb_decode.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/batch.h"
#include "heapdump/tools/util.h"

static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

bool hd_raw_is_multi_process(const hd_reassembler *r) {
  return r->snapshot_count > 0 && r->snapshots[0]->has_header;
}

/* ---- writing ---- */

typedef struct file_sink {
  FILE *out;
  int error; /* errno of the first failed write */
} file_sink;

static HD_MUST_CHECK hd_status write_record(void *ctx, const uint8_t *body, size_t size) {
  file_sink *sink = ctx;
  uint8_t length[4];
  put_u32(length, (uint32_t)size);
  if (fwrite(length, 1, sizeof length, sink->out) != sizeof length ||
      (size > 0 && fwrite(body, 1, size, sink->out) != size)) {
    sink->error = errno ? errno : EIO;
    return HD_ERR_IO;
  }
  return HD_OK;
}

static heapdump_client_SnapshotElement element_of(pb_size_t tag) {
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = tag;
  return e;
}

static HD_MUST_CHECK hd_status write_header(const hd_snapshot *s, hd_batch_writer *w) {
  if (!s->has_header) return HD_OK;
  heapdump_client_SnapshotElement e =
      element_of(heapdump_client_SnapshotElement_snapshot_header_tag);
  heapdump_client_SnapshotHeader *h = &e.element.snapshot_header;
  h->has_process_name = h->has_process_koid = true;
  snprintf(h->process_name, sizeof h->process_name, "%s", s->process_name);
  h->process_koid = s->pid;
  if (s->command_line != NULL) {
    h->has_command_line = true;
    snprintf(h->command_line, sizeof h->command_line, "%s", s->command_line);
  }
  if (s->not_read[0] != '\0') {
    h->has_not_read = true;
    snprintf(h->not_read, sizeof h->not_read, "%s", s->not_read);
  }
  hd_status status = hd_batch_add(w, &e);
  /* The header travels alone in its batch, as the collector sends it. */
  return status == HD_OK ? hd_batch_flush(w) : status;
}

static HD_MUST_CHECK hd_status write_threads(const hd_snapshot *s, hd_batch_writer *w) {
  hd_status status = HD_OK;
  for (size_t i = 0; i < s->thread_count && status == HD_OK; i++) {
    const hd_snapshot_thread *t = &s->threads[i];
    heapdump_client_SnapshotElement e = element_of(heapdump_client_SnapshotElement_thread_info_tag);
    heapdump_client_ThreadInfo *ti = &e.element.thread_info;
    ti->has_thread_info_key = ti->has_koid = ti->has_name = true;
    ti->thread_info_key = t->key;
    ti->koid = t->koid;
    snprintf(ti->name, sizeof ti->name, "%s", t->name);
    status = hd_batch_add(w, &e);
  }
  return status;
}

/* Each stack trace, followed by its counters where it has them. */
static HD_MUST_CHECK hd_status write_traces(const hd_snapshot *s, hd_batch_writer *w) {
  hd_status status = HD_OK;
  for (size_t i = 0; i < s->stack_trace_count && status == HD_OK; i++) {
    const hd_snapshot_stack_trace *t = &s->stack_traces[i];
    status = hd_batch_add_stack_trace(w, t->key, t->addresses, t->count, t->truncated);
    if (status != HD_OK || !t->has_counters) continue;
    heapdump_client_SnapshotElement e =
        element_of(heapdump_client_SnapshotElement_stack_trace_counters_tag);
    e.element.stack_trace_counters =
        (heapdump_client_StackTraceCounters){.has_stack_trace_key = true,
                                             .stack_trace_key = t->key,
                                             .has_allocated_blocks = true,
                                             .allocated_blocks = t->allocated_blocks,
                                             .has_allocated_bytes = true,
                                             .allocated_bytes = t->allocated_bytes,
                                             .has_temporary_blocks = t->has_temporary,
                                             .temporary_blocks = t->temporary_blocks,
                                             .has_peak_blocks = t->peak_blocks != 0,
                                             .peak_blocks = t->peak_blocks,
                                             .has_peak_bytes = t->peak_blocks != 0,
                                             .peak_bytes = t->peak_bytes,
                                             .has_unsettled = t->counts_unsettled,
                                             .unsettled = t->counts_unsettled};
    status = hd_batch_add(w, &e);
  }
  return status;
}

static HD_MUST_CHECK hd_status write_regions(const hd_snapshot *s, hd_batch_writer *w) {
  hd_status status = HD_OK;
  for (size_t i = 0; i < s->region_count && status == HD_OK; i++) {
    const hd_snapshot_region *g = &s->regions[i];
    status = hd_batch_add_executable_region(w, g->address, g->size, g->file_offset, g->vaddr,
                                            g->build_id, g->build_id_size, g->name ? g->name : "");
  }
  return status;
}

static HD_MUST_CHECK hd_status write_allocations(const hd_snapshot *s, hd_batch_writer *w) {
  hd_status status = HD_OK;
  for (size_t i = 0; i < s->allocation_count && status == HD_OK; i++) {
    const hd_snapshot_allocation *a = &s->allocations[i];
    heapdump_client_SnapshotElement e = element_of(heapdump_client_SnapshotElement_allocation_tag);
    e.element.allocation = (heapdump_client_Allocation){.has_address = true,
                                                        .address = a->address,
                                                        .has_size = true,
                                                        .size = a->size,
                                                        .has_stack_trace_key = true,
                                                        .stack_trace_key = a->stack_trace_key,
                                                        .has_timestamp = true,
                                                        .timestamp = a->timestamp,
                                                        .has_thread_info_key = true,
                                                        .thread_info_key = a->thread_info_key,
                                                        .has_count = a->count != 0,
                                                        .count = a->count};
    status = hd_batch_add(w, &e);
  }
  return status;
}

static HD_MUST_CHECK hd_status write_stats(const hd_snapshot *s, hd_batch_writer *w) {
  if (!s->has_stats) return HD_OK;
  heapdump_client_SnapshotElement e = element_of(heapdump_client_SnapshotElement_process_stats_tag);
  e.element.process_stats = s->stats;
  return hd_batch_add(w, &e);
}

static HD_MUST_CHECK hd_status write_resident(const hd_snapshot *s, hd_batch_writer *w) {
  if (!s->has_resident) return HD_OK;
  heapdump_client_SnapshotElement e =
      element_of(heapdump_client_SnapshotElement_resident_memory_tag);
  e.element.resident_memory = s->resident;
  return hd_batch_add(w, &e);
}

static HD_MUST_CHECK hd_status write_samples(const hd_snapshot *s, hd_batch_writer *w) {
  hd_status status = HD_OK;
  for (size_t i = 0; i < s->sample_count && status == HD_OK; i++) {
    heapdump_client_SnapshotElement e =
        element_of(heapdump_client_SnapshotElement_stats_sample_tag);
    e.element.stats_sample = s->samples[i];
    status = hd_batch_add(w, &e);
  }
  return status;
}

static HD_MUST_CHECK hd_status write_roots(const hd_snapshot *s, hd_batch_writer *w) {
  hd_status status = HD_OK;
  for (size_t i = 0; i < s->root_count && status == HD_OK; i++) {
    const hd_snapshot_root *g = &s->roots[i];
    heapdump_client_RootRegion region = {.has_address = true,
                                         .address = g->address,
                                         .has_size = true,
                                         .size = g->size,
                                         .has_kind = true,
                                         .kind = g->kind,
                                         .has_thread_koid = g->thread_koid != 0,
                                         .thread_koid = g->thread_koid,
                                         .has_name = g->name[0] != '\0',
                                         .has_not_read = g->not_read,
                                         .not_read = g->not_read};
    snprintf(region.name, sizeof region.name, "%s", g->name);
    status = hd_batch_add_root_region(w, &region, g->contents.bytes, g->contents.size);
  }
  return status;
}

static HD_MUST_CHECK hd_status write_contents(const hd_snapshot *s, hd_batch_writer *w) {
  hd_status status = HD_OK;
  for (size_t i = 0; i < s->block_count && status == HD_OK; i++) {
    const hd_snapshot_block *b = &s->blocks[i];
    status = hd_batch_add_block_contents(w, b->address, b->bytes, b->size);
  }
  return status;
}

/* Every kind of SnapshotElement, with what writes a snapshot's elements of that kind, in the
 * order they are written: the header first, the contents last. A kind without a row would be
 * dropped from raw files without a word: hd_raw_writes_element lets the tests check that every
 * kind the protocol has is here. */
static const struct {
  hd_status (*write)(const hd_snapshot *s, hd_batch_writer *w);
  pb_size_t tags[2]; /* the kinds it writes (0: none) */
} kElementWriters[] = {
    {write_header, {heapdump_client_SnapshotElement_snapshot_header_tag}},
    {write_threads, {heapdump_client_SnapshotElement_thread_info_tag}},
    {write_traces,
     {heapdump_client_SnapshotElement_stack_trace_tag,
      heapdump_client_SnapshotElement_stack_trace_counters_tag}},
    {write_regions, {heapdump_client_SnapshotElement_executable_region_tag}},
    {write_allocations, {heapdump_client_SnapshotElement_allocation_tag}},
    {write_stats, {heapdump_client_SnapshotElement_process_stats_tag}},
    {write_resident, {heapdump_client_SnapshotElement_resident_memory_tag}},
    {write_samples, {heapdump_client_SnapshotElement_stats_sample_tag}},
    {write_roots, {heapdump_client_SnapshotElement_root_region_tag}},
    {write_contents, {heapdump_client_SnapshotElement_block_contents_tag}},
};

bool hd_raw_writes_element(pb_size_t tag) {
  for (size_t i = 0; i < sizeof kElementWriters / sizeof kElementWriters[0]; i++) {
    for (size_t k = 0; k < 2; k++) {
      if (tag != 0 && kElementWriters[i].tags[k] == tag) return true;
    }
  }
  return false;
}

static HD_MUST_CHECK hd_status write_snapshot(const hd_snapshot *s, hd_batch_writer *w) {
  hd_status status = HD_OK;
  for (size_t i = 0; i < sizeof kElementWriters / sizeof kElementWriters[0] && status == HD_OK;
       i++) {
    status = kElementWriters[i].write(s, w);
  }
  return status;
}

int hd_raw_write(const hd_reassembler *r, FILE *out, char *error, size_t error_size) {
  bool multi = hd_raw_is_multi_process(r);
  uint8_t header[16];
  memcpy(header, HD_RAW_MAGIC, HD_RAW_MAGIC_SIZE);
  put_u32(header + 8, HD_RAW_VERSION);
  put_u32(header + 12, multi ? HD_RAW_FLAG_MULTI_PROCESS : 0);
  file_sink sink = {out, 0};
  hd_batch_writer *w = malloc(sizeof *w);
  if (w == NULL) return hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
  hd_status status = HD_OK;
  errno = 0;
  if (fwrite(header, 1, sizeof header, out) != sizeof header) {
    sink.error = errno ? errno : EIO;
    status = HD_ERR_IO;
  }
  hd_batch_writer_init(w, write_record, &sink);
  for (size_t i = 0; i < r->snapshot_count && status == HD_OK; i++) {
    status = write_snapshot(r->snapshots[i], w);
    if (status == HD_OK && multi) status = hd_batch_end(w);
  }
  if (status == HD_OK) status = hd_batch_end(w);
  free(w);
  if (status == HD_OK && fflush(out) != 0) {
    sink.error = errno ? errno : EIO;
    status = HD_ERR_IO;
  }
  if (status != HD_OK) {
    int err = sink.error ? sink.error : EIO;
    return hd_tool_fail(error, error_size, -err, "cannot write the raw snapshot: %s",
                        sink.error ? strerror(err) : hd_status_str(status));
  }
  return 0;
}

/* ---- reading ---- */

enum stream_state { IN_PROCESS, BETWEEN_PROCESSES, ENDED };

/* Reads and checks the file header; *multi from its flags. */
static HD_MUST_CHECK int read_raw_header(FILE *in, bool *multi, char *error, size_t error_size) {
  uint8_t header[16];
  size_t n = fread(header, 1, sizeof header, in);
  if (n != sizeof header || memcmp(header, HD_RAW_MAGIC, HD_RAW_MAGIC_SIZE) != 0) {
    if (ferror(in)) return hd_tool_fail(error, error_size, -EIO, "read error: %s", strerror(errno));
    return hd_tool_fail(error, error_size, -EINVAL, "not a heapdump raw snapshot (bad magic)");
  }
  uint32_t version = get_u32(header + 8), flags = get_u32(header + 12);
  if (version != HD_RAW_VERSION) {
    return hd_tool_fail(error, error_size, -EINVAL,
                        "raw snapshot version %u is not supported (this heapdump reads version %u)",
                        version, HD_RAW_VERSION);
  }
  if (flags & ~HD_RAW_FLAG_MULTI_PROCESS) {
    return hd_tool_fail(error, error_size, -EINVAL, "raw snapshot has unknown flags 0x%x", flags);
  }
  *multi = flags & HD_RAW_FLAG_MULTI_PROCESS;
  return 0;
}

/* Reads record number `record` (a length, then a batch body of that length) into body; *size
 * its length, 0 for the empty batch that ends a process or the stream. */
static HD_MUST_CHECK int read_record(FILE *in, uint64_t record, uint8_t *body, uint32_t *size,
                                     char *error, size_t error_size) {
  uint8_t length[4];
  if (fread(length, 1, sizeof length, in) != sizeof length) {
    return ferror(in)
               ? hd_tool_fail(error, error_size, -EIO, "read error: %s", strerror(errno))
               : hd_tool_fail(error, error_size, -EINVAL,
                              "truncated raw snapshot: the stream ends before its last batch");
  }
  *size = get_u32(length);
  if (*size > HD_BATCH_CAPACITY) {
    return hd_tool_fail(error, error_size, -EINVAL,
                        "corrupt raw snapshot: batch %llu claims %u bytes",
                        (unsigned long long)record, *size);
  }
  if (fread(body, 1, *size, in) != *size) {
    return hd_tool_fail(error, error_size, -EINVAL,
                        "truncated raw snapshot: batch %llu is cut short",
                        (unsigned long long)record);
  }
  return 0;
}

/* Decodes one batch body into the reassembler through reader. */
static HD_MUST_CHECK int decode_record(hd_batch_reader *reader, hd_reassembler *r, uint64_t record,
                                       const uint8_t *body, uint32_t size, char *error,
                                       size_t error_size) {
  heapdump_client_SnapshotReceiverBatchRequest request =
      heapdump_client_SnapshotReceiverBatchRequest_init_zero;
  hd_batch_reader_prepare(reader, &request);
  reader->status = HD_OK;
  pb_istream_t stream = pb_istream_from_buffer(body, size);
  if (!pb_decode(&stream, heapdump_client_SnapshotReceiverBatchRequest_fields, &request)) {
    return hd_tool_fail(error, error_size, -EINVAL, "corrupt raw snapshot: batch %llu: %s",
                        (unsigned long long)record,
                        reader->status != HD_OK && r->error[0] ? r->error : PB_GET_ERROR(&stream));
  }
  return 0;
}

int hd_raw_read(FILE *in, hd_reassembler *r, char *error, size_t error_size) {
  bool multi = false;
  int rc = read_raw_header(in, &multi, error, error_size);
  if (rc != 0) return rc;
  uint8_t *body = malloc(HD_BATCH_CAPACITY);
  hd_batch_reader *reader = malloc(sizeof *reader);
  if (body == NULL || reader == NULL) {
    free(body);
    free(reader);
    return hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
  }
  hd_batch_reader_init(reader, hd_reassembler_add, r);
  enum stream_state state = multi ? BETWEEN_PROCESSES : IN_PROCESS;
  for (uint64_t record = 0; rc == 0 && state != ENDED; record++) {
    uint32_t size = 0;
    if ((rc = read_record(in, record, body, &size, error, error_size)) != 0) break;
    if (size == 0) {
      state = (multi && state == IN_PROCESS) ? BETWEEN_PROCESSES : ENDED;
      continue;
    }
    const size_t snapshots_before = r->snapshot_count;
    if ((rc = decode_record(reader, r, record, body, size, error, error_size)) != 0) break;
    if (multi && state == BETWEEN_PROCESSES) {
      if (r->snapshot_count != snapshots_before + 1) {
        rc = hd_tool_fail(error, error_size, -EINVAL,
                          "corrupt raw snapshot: batch %llu should start a process with its header",
                          (unsigned long long)record);
      }
      state = IN_PROCESS;
    }
  }
  if (rc == 0 && fgetc(in) != EOF) {
    rc = hd_tool_fail(error, error_size, -EINVAL,
                      "corrupt raw snapshot: data after the end of the stream");
  }
  if (rc == 0 && hd_reassembler_finish(r) != HD_OK) {
    rc = hd_tool_fail(error, error_size, -EINVAL, "corrupt raw snapshot: %s", r->error);
  }
  free(body);
  free(reader);
  return rc;
}
