/* pprof output (see pprof.h, and README.md beside this file for the mapping).
 *
 * A profile.proto message is the concatenation of its top-level fields, so the profile is written
 * by one pb_encode of a Profile whose repeated fields are callbacks that walk the snapshots and
 * emit one Sample, Mapping, Location, Function or string at a time into a deflate stream. Kept in
 * memory is only what has to be known before it is written: the string table (everything refers
 * to strings by index), one Location per distinct address with its symbolized lines (samples
 * refer to locations by id), the Functions, and the live totals per stack trace. Samples are
 * produced while they are written and never stored. */
#include "heapdump/tools/pprof.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <pb_encode.h>

#include "pprof_model.h"
#include "profile.pb.h"

/* ---- the compressed output stream ---- */

static int io_error(writer *w) {
  int err = errno ? errno : EIO;
  return hd_pprof_fail(w, -err, "writing the profile: %s", strerror(err));
}

static bool drain(writer *w) {
  size_t size = sizeof w->compressed - w->z.avail_out;
  if (size > 0) {
    errno = 0;
    if (fwrite(w->compressed, 1, size, w->out) != size) {
      io_error(w);
      return false;
    }
  }
  w->z.next_out = w->compressed;
  w->z.avail_out = sizeof w->compressed;
  return true;
}

static bool write_compressed(pb_ostream_t *stream, const pb_byte_t *buf, size_t count) {
  writer *w = stream->state;
  while (count > 0) {
    uInt chunk = count > (1u << 30) ? (1u << 30) : (uInt)count;
    w->z.next_in = (Bytef *)buf;
    w->z.avail_in = chunk;
    while (w->z.avail_in > 0) {
      if (deflate(&w->z, Z_NO_FLUSH) == Z_STREAM_ERROR) {
        hd_pprof_fail(w, -EIO, "compressing the profile failed");
        return false;
      }
      if (w->z.avail_out == 0 && !drain(w)) return false;
    }
    buf += chunk;
    count -= chunk;
  }
  return true;
}

static HD_MUST_CHECK int finish_output(writer *w) {
  for (;;) {
    int rc = deflate(&w->z, Z_FINISH);
    if (rc == Z_STREAM_ERROR) return hd_pprof_fail(w, -EIO, "compressing the profile failed");
    if (!drain(w)) return w->status;
    if (rc == Z_STREAM_END) break;
  }
  errno = 0;
  if (fflush(w->out) != 0 || ferror(w->out)) return io_error(w);
  return 0;
}

/* ---- encoding: the callbacks of the Profile's repeated fields ---- */

typedef struct packed_u64 {
  const uint64_t *values;
  size_t count;
} packed_u64;

/* A packed repeated varint field (uint64, or int64 as its two's complement). */
static bool encode_packed(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const packed_u64 *p = *arg;
  if (p->count == 0) return true;
  pb_ostream_t sizing = PB_OSTREAM_SIZING;
  for (size_t i = 0; i < p->count; i++) {
    if (!pb_encode_varint(&sizing, p->values[i])) return false;
  }
  if (!pb_encode_tag(stream, PB_WT_STRING, field->tag) ||
      !pb_encode_varint(stream, sizing.bytes_written)) {
    return false;
  }
  for (size_t i = 0; i < p->count; i++) {
    if (!pb_encode_varint(stream, p->values[i])) return false;
  }
  return true;
}

typedef struct label_list {
  perftools_profiles_Label labels[kMaxLabels];
  size_t count;
} label_list;

static bool encode_labels(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const label_list *list = *arg;
  for (size_t i = 0; i < list->count; i++) {
    if (!pb_encode_tag_for_field(stream, field) ||
        !pb_encode_submessage(stream, perftools_profiles_Label_fields, &list->labels[i])) {
      return false;
    }
  }
  return true;
}

static void add_label(label_list *list, int64_t key, int64_t str, int64_t num, int64_t unit) {
  list->labels[list->count++] = (perftools_profiles_Label){key, str, num, unit};
}

/* In a multi-process profile, which process a sample is of. */
static void add_process_labels(label_list *labels, const writer *w, const process *p) {
  if (!w->label_processes) return;
  add_label(labels, w->known.process_name, p->name, 0, 0);
  add_label(labels, w->known.pid, 0, (int64_t)p->snapshot->pid, 0);
}

/* Which of our sample types (inuse_objects, inuse_space, alloc_objects, alloc_space, then the
 * peak's) goes at position i of the profile. */
static int type_at(const writer *w, int i) {
  return w->options.go_order && i < kPeaklessSampleTypes ? (i + 2) % kPeaklessSampleTypes : i;
}

/* One Sample: its location ids (leaf first), its values in our order, its labels. */
static bool encode_sample(pb_ostream_t *stream, const pb_field_t *field, const writer *w,
                          const uint64_t *locations, size_t depth,
                          const uint64_t values[kSampleTypeCount], label_list *labels) {
  packed_u64 stack = {locations, depth};
  uint64_t ordered[kSampleTypeCount];
  for (int v = 0; v < w->sample_type_count; v++) ordered[v] = values[type_at(w, v)];
  packed_u64 value = {ordered, (size_t)w->sample_type_count};
  perftools_profiles_Sample sample = perftools_profiles_Sample_init_zero;
  sample.location_id.funcs.encode = encode_packed;
  sample.location_id.arg = &stack;
  sample.value.funcs.encode = encode_packed;
  sample.value.arg = &value;
  sample.label.funcs.encode = encode_labels;
  sample.label.arg = labels;
  return pb_encode_tag_for_field(stream, field) &&
         pb_encode_submessage(stream, perftools_profiles_Sample_fields, &sample);
}

static bool write_sample(pb_ostream_t *stream, const pb_field_t *field, writer *w, const process *p,
                         const hd_snapshot_stack_trace *trace,
                         const uint64_t values[kSampleTypeCount], label_list *labels) {
  bool truncated = trace->truncated && trace->count > 0;
  const size_t first = p->totals[trace - p->snapshot->stack_traces].site;
  size_t depth = trace->count ? trace->count - first + truncated : 1;
  if (depth > w->stack_capacity) {
    uint64_t *bigger = realloc(w->stack, depth * sizeof *bigger);
    if (bigger == NULL) {
      hd_pprof_out_of_memory(w);
      return false;
    }
    w->stack = bigger;
    w->stack_capacity = depth;
  }
  w->stack[0] = w->no_stack_location;
  for (size_t f = first; f < trace->count; f++) {
    size_t index = 0;
    /* Every address of a sampled trace from its site on got its Location in add_locations. */
    hd_u64_map_find(&p->location_by_address, trace->addresses[f], &index);
    w->stack[f - first] = index + 1;
  }
  if (truncated) {
    size_t index = 0;
    hd_u64_map_find(&w->truncation_location, trace->count, &index);
    w->stack[trace->count - first] = index + 1;
  }
  const int64_t wrapper = p->totals[trace - p->snapshot->stack_traces].wrapper;
  if (wrapper > 0) add_label(labels, w->known.alloc_fn, wrapper, 0, 0);
  add_process_labels(labels, w, p);
  return encode_sample(stream, field, w, w->stack, depth, values, labels);
}

/* The sample of p's unattributed bytes (hd_pprof_unattributed_bytes), if it has any: live space
 * without objects (how many blocks they are is not known), at the stand-in frame alone. */
static bool write_unattributed_sample(pb_ostream_t *stream, const pb_field_t *field, writer *w,
                                      const process *p) {
  const uint64_t bytes = hd_pprof_unattributed_bytes(w, p);
  if (bytes == 0) return true;
  label_list labels = {.count = 0};
  add_process_labels(&labels, w, p);
  const uint64_t values[kSampleTypeCount] = {0, bytes, 0, 0, 0, 0};
  return encode_sample(stream, field, w, &w->unattributed_location, 1, values, &labels);
}

/* Per block: its live values and labels. The cumulative counters belong to a stack trace, not to
 * a block, so they go into one more sample per stack trace, without block labels. */
static bool write_tagged_samples(pb_ostream_t *stream, const pb_field_t *field, writer *w,
                                 const process *p) {
  const hd_snapshot *s = p->snapshot;
  for (size_t i = 0; i < s->allocation_count; i++) {
    const hd_snapshot_allocation *a = &s->allocations[i];
    const hd_snapshot_stack_trace *trace = hd_snapshot_find_stack_trace(s, a->stack_trace_key);
    const hd_snapshot_thread *thread = hd_snapshot_find_thread(s, a->thread_info_key);
    const uint64_t values[kSampleTypeCount] = {a->count, a->size, 0, 0, 0, 0};
    label_list labels = {.count = 0};
    add_label(&labels, w->known.address, 0, (int64_t)a->address, 0);
    /* The object's size, as Go's label means it (a sampled block's own, not its estimate). */
    add_label(&labels, w->known.bytes, 0, (int64_t)hd_snapshot_block_size(s, a), w->known.bytes);
    add_label(&labels, w->known.timestamp, 0, a->timestamp, w->known.nanoseconds);
    add_label(&labels, w->known.thread, p->thread_labels[thread - s->threads], 0, 0);
    if (!write_sample(stream, field, w, p, trace, values, &labels)) return false;
  }
  for (size_t t = 0; t < s->stack_trace_count; t++) {
    const hd_snapshot_stack_trace *trace = &s->stack_traces[t];
    if (!trace->has_counters || (trace->allocated_blocks == 0 && trace->allocated_bytes == 0)) {
      continue;
    }
    const uint64_t values[kSampleTypeCount] = {0,
                                               0,
                                               trace->allocated_blocks,
                                               trace->allocated_bytes,
                                               p->has_peak ? trace->peak_blocks : 0,
                                               p->has_peak ? trace->peak_bytes : 0};
    label_list labels = {.count = 0};
    if (!write_sample(stream, field, w, p, trace, values, &labels)) return false;
  }
  return true;
}

static bool encode_samples(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  writer *w = *arg;
  for (size_t i = 0; i < w->process_count; i++) {
    const process *p = &w->processes[i];
    if (!write_unattributed_sample(stream, field, w, p)) return false;
    if (w->options.tags) {
      if (!write_tagged_samples(stream, field, w, p)) return false;
      continue;
    }
    const hd_snapshot *s = p->snapshot;
    for (size_t t = 0; t < s->stack_trace_count; t++) {
      int64_t values[kSampleTypeCount] = {0};
      if (!hd_pprof_trace_values(w, p, t, values)) continue;
      uint64_t encoded[kSampleTypeCount]; /* int64 values are varints of their two's complement */
      for (int v = 0; v < kSampleTypeCount; v++) encoded[v] = (uint64_t)values[v];
      label_list labels = {.count = 0};
      if (!write_sample(stream, field, w, p, &s->stack_traces[t], encoded, &labels)) return false;
    }
  }
  return true;
}

static bool encode_sample_types(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const writer *w = *arg;
  for (int i = 0; i < w->sample_type_count; i++) {
    /* Pairs of counts, then bytes. */
    const int t = type_at(w, i);
    perftools_profiles_ValueType type = {w->known.sample_types[t],
                                         t % 2 == 0 ? w->known.count : w->known.bytes};
    if (!pb_encode_tag_for_field(stream, field) ||
        !pb_encode_submessage(stream, perftools_profiles_ValueType_fields, &type)) {
      return false;
    }
  }
  return true;
}

static bool encode_mappings(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const writer *w = *arg;
  for (size_t i = 0; i < w->mapping_count; i++) {
    const mapping *m = &w->mappings[i];
    const hd_snapshot_region *g = m->region; /* NULL: the unmapped locations' */
    perftools_profiles_Mapping out = {
        .id = i + 1,
        .memory_start = g ? g->address : 0,
        .memory_limit = g ? g->address + g->size : 0,
        .file_offset = g ? g->file_offset : 0,
        .filename = m->filename,
        .build_id = m->build_id,
        .has_functions = m->has_functions || w->options.final_symbols,
        .has_filenames = m->has_filenames,
        .has_line_numbers = m->has_line_numbers,
        .has_inline_frames = m->has_inline_frames,
    };
    if (!pb_encode_tag_for_field(stream, field) ||
        !pb_encode_submessage(stream, perftools_profiles_Mapping_fields, &out)) {
      return false;
    }
  }
  return true;
}

typedef struct line_slice {
  const line_entry *lines;
  size_t count;
} line_slice;

static bool encode_lines(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const line_slice *slice = *arg;
  for (size_t i = 0; i < slice->count; i++) {
    const line_entry *l = &slice->lines[i];
    perftools_profiles_Line out = {l->function_id, l->line, l->column};
    if (!pb_encode_tag_for_field(stream, field) ||
        !pb_encode_submessage(stream, perftools_profiles_Line_fields, &out)) {
      return false;
    }
  }
  return true;
}

static bool encode_locations(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const writer *w = *arg;
  for (size_t i = 0; i < w->location_count; i++) {
    const location *loc = &w->locations[i];
    perftools_profiles_Location out = perftools_profiles_Location_init_zero;
    out.id = i + 1;
    out.mapping_id = loc->mapping_id;
    out.address = loc->address;
    line_slice lines = {NULL, 0};
    if (loc->line_count > 0) {
      lines = (line_slice){&w->lines[loc->first_line], loc->line_count};
      out.line.funcs.encode = encode_lines;
      out.line.arg = &lines;
    }
    if (!pb_encode_tag_for_field(stream, field) ||
        !pb_encode_submessage(stream, perftools_profiles_Location_fields, &out)) {
      return false;
    }
  }
  return true;
}

static bool encode_functions(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const writer *w = *arg;
  for (size_t i = 0; i < w->function_count; i++) {
    const function_key *f = &w->functions[i].key;
    perftools_profiles_Function out = {
        .id = i + 1, .name = f->name, .system_name = f->system_name, .filename = f->filename};
    if (!pb_encode_tag_for_field(stream, field) ||
        !pb_encode_submessage(stream, perftools_profiles_Function_fields, &out)) {
      return false;
    }
  }
  return true;
}

static bool encode_strings(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const writer *w = *arg;
  for (size_t i = 0; i < w->string_count; i++) {
    const char *text = w->strings[i].text;
    if (!pb_encode_tag_for_field(stream, field) ||
        !pb_encode_string(stream, (const pb_byte_t *)text, strlen(text))) {
      return false;
    }
  }
  return true;
}

static int64_t sample_type_index(const writer *w) {
  switch (w->options.default_sample) {
    case HD_PPROF_INUSE_OBJECTS: return w->known.sample_types[0];
    case HD_PPROF_INUSE_SPACE: return w->known.sample_types[1];
    case HD_PPROF_ALLOC_OBJECTS: return w->known.sample_types[2];
    case HD_PPROF_ALLOC_SPACE: return w->known.sample_types[3];
    case HD_PPROF_PEAK_OBJECTS: return w->known.sample_types[4];
    case HD_PPROF_PEAK_SPACE: return w->known.sample_types[5];
  }
  return -1;
}

static bool known_sample_type(hd_pprof_sample sample) {
  switch (sample) {
    case HD_PPROF_INUSE_SPACE:
    case HD_PPROF_INUSE_OBJECTS:
    case HD_PPROF_ALLOC_SPACE:
    case HD_PPROF_ALLOC_OBJECTS:
    case HD_PPROF_PEAK_SPACE:
    case HD_PPROF_PEAK_OBJECTS: return true;
  }
  return false;
}

static HD_MUST_CHECK int write_profile(writer *w) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  packed_u64 comments = {w->comments, w->comment_count};
  perftools_profiles_Profile profile = perftools_profiles_Profile_init_zero;
  profile.sample_type = (pb_callback_t){{.encode = encode_sample_types}, w};
  profile.sample = (pb_callback_t){{.encode = encode_samples}, w};
  profile.mapping = (pb_callback_t){{.encode = encode_mappings}, w};
  profile.location = (pb_callback_t){{.encode = encode_locations}, w};
  profile.function = (pb_callback_t){{.encode = encode_functions}, w};
  profile.string_table = (pb_callback_t){{.encode = encode_strings}, w};
  profile.comment = (pb_callback_t){{.encode = encode_packed}, &comments};
  profile.time_nanos = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
  /* One event per byte allocated when every block is recorded; sampled, the mean interval. */
  profile.has_period_type = true;
  profile.period_type = (perftools_profiles_ValueType){w->known.space, w->known.bytes};
  profile.period = w->sample_bytes ? (int64_t)w->sample_bytes : 1;
  profile.default_sample_type = sample_type_index(w);

  pb_ostream_t stream = {.callback = write_compressed, .state = w, .max_size = SIZE_MAX};
  if (!pb_encode(&stream, perftools_profiles_Profile_fields, &profile)) {
    return hd_pprof_fail(w, -EIO, "encoding the profile: %s", PB_GET_ERROR(&stream));
  }
  return finish_output(w);
}

int hd_pprof_write(const hd_reassembler *r, const hd_pprof_options *options, FILE *out, char *error,
                   size_t error_size) {
  if (error != NULL && error_size > 0) error[0] = '\0';
  writer *w = calloc(1, sizeof *w);
  if (w == NULL) {
    if (error != NULL && error_size > 0) {
      snprintf(error, error_size, "out of memory while writing the profile");
    }
    return -ENOMEM;
  }
  w->error = error;
  w->error_size = error_size;
  int status;
  if (r == NULL || out == NULL) {
    status = hd_pprof_fail(w, -EINVAL, "no snapshot or no output to write the profile to");
  } else if (options != NULL && !known_sample_type(options->default_sample)) {
    status =
        hd_pprof_fail(w, -EINVAL, "unknown pprof sample type %d", (int)options->default_sample);
  } else if (options != NULL && options->tags && options->trace_values != NULL) {
    status = hd_pprof_fail(w, -EINVAL, "per-block samples (tags) cannot have caller-given values");
  } else {
    w->r = r;
    w->out = out;
    if (options != NULL) w->options = *options;
    /* What was live at the peak mark: where some snapshot knows it and the values are the
     * snapshots' own; not in the shape of Go's heap profiles, whose scrapers expect its four. */
    w->sample_type_count = kPeaklessSampleTypes;
    for (size_t i = 0;
         i < r->snapshot_count && w->options.trace_values == NULL && !w->options.go_order; i++) {
      if (hd_snapshot_has_peak(r->snapshots[i])) w->sample_type_count = kSampleTypeCount;
    }
    const bool peak_sample = w->options.default_sample == HD_PPROF_PEAK_SPACE ||
                             w->options.default_sample == HD_PPROF_PEAK_OBJECTS;
    status = peak_sample && w->sample_type_count < kSampleTypeCount
                 ? hd_pprof_fail(w, -EINVAL,
                                 "--sample-index %s: this profile says nothing of the peak (a "
                                 "diff, Go's order, or a snapshot without a peak mark)",
                                 w->options.default_sample == HD_PPROF_PEAK_SPACE ? "peak_space"
                                                                                  : "peak_objects")
                 : hd_pprof_build_model(w);
    if (status == 0) {
      /* gzip framing: windowBits 15 plus 16. */
      int rc =
          deflateInit2(&w->z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
      if (rc != Z_OK) {
        status = hd_pprof_fail(w, rc == Z_MEM_ERROR ? -ENOMEM : -EIO,
                               "cannot start compressing the profile: %s", zError(rc));
      } else {
        w->z_ready = true;
        w->z.next_out = w->compressed;
        w->z.avail_out = sizeof w->compressed;
        status = write_profile(w);
      }
    }
  }
  if (w->z_ready) deflateEnd(&w->z);
  hd_pprof_free_model(w);
  free(w);
  return status;
}
