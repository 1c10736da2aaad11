/* Reading a heap profile in pprof's format back into the snapshot model (see pprof.h), so that
 * `heapdump report` and `convert` take the files `run` and `snapshot` write by default.
 *
 * A profile keeps less than a raw snapshot: per stack trace its live and cumulative totals (per
 * block only with --tags), no timestamps or thread names without tags, and each Location's names
 * as they were resolved where the profile was written. So each sample becomes one Allocation
 * standing for its inuse_objects blocks (with --tags: the block itself, at its address), its
 * alloc values become the trace's StackTraceCounters, and every symbolized Location becomes a
 * known location of the snapshot: its names are used as they are, whatever binaries are here. */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <pb_decode.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "gunzip.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/tools/pprof.h"
#include "heapdump/tools/util.h"
#include "profile.pb.h"

/* A profile bigger than this once decompressed is refused rather than read into memory. */
#define MAX_PROFILE_BYTES ((size_t)1 << 30)

typedef struct u64_list {
  uint64_t *items;
  size_t count, capacity;
} u64_list;

typedef struct sample {
  size_t first_location, location_count; /* in profile.sample_locations */
  size_t first_value, value_count;       /* in profile.sample_values */
  size_t first_label, label_count;       /* in profile.labels */
} sample;

typedef struct location {
  perftools_profiles_Location fields;
  size_t first_line, line_count; /* in profile.lines */
} location;

typedef struct profile {
  char **strings;
  size_t string_count, string_capacity;
  perftools_profiles_ValueType *sample_types;
  size_t sample_type_count, sample_type_capacity;
  sample *samples;
  size_t sample_count, sample_capacity;
  u64_list sample_locations;
  u64_list sample_values; /* int64 values, as their varints decode */
  perftools_profiles_Label *labels;
  size_t label_count, label_capacity;
  perftools_profiles_Mapping *mappings;
  size_t mapping_count, mapping_capacity;
  location *locations;
  size_t location_count, location_capacity;
  perftools_profiles_Line *lines;
  size_t line_count, line_capacity;
  perftools_profiles_Function *functions;
  size_t function_count, function_capacity;
  bool out_of_memory;
  hd_u64_map location_index, mapping_index, function_index;
} profile;

static void profile_free(profile *p) {
  for (size_t i = 0; i < p->string_count; i++) free(p->strings[i]);
  free(p->strings);
  free(p->sample_types);
  free(p->samples);
  free(p->sample_locations.items);
  free(p->sample_values.items);
  free(p->labels);
  free(p->mappings);
  free(p->locations);
  free(p->lines);
  free(p->functions);
  hd_u64_map_free(&p->location_index);
  hd_u64_map_free(&p->mapping_index);
  hd_u64_map_free(&p->function_index);
}

/* ---- decoding: every repeated field through a callback ---- */

static bool decode_string(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  profile *p = *arg;
  char *text = malloc(stream->bytes_left + 1);
  if (text == NULL || !HD_RESERVE(p->strings, p->string_count, p->string_capacity)) {
    free(text);
    p->out_of_memory = true;
    return false;
  }
  size_t n = stream->bytes_left;
  if (!pb_read(stream, (pb_byte_t *)text, n)) {
    free(text);
    return false;
  }
  text[n] = '\0';
  p->strings[p->string_count++] = text;
  return true;
}

/* A repeated varint field, packed (all in one call) or not (one call each). */
static bool decode_u64s(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  u64_list *list = *arg;
  while (stream->bytes_left > 0) {
    uint64_t v;
    if (!pb_decode_varint(stream, &v)) return false;
    if (!HD_RESERVE(list->items, list->count, list->capacity)) return false;
    list->items[list->count++] = v;
  }
  return true;
}

static bool decode_sample_type(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  profile *p = *arg;
  perftools_profiles_ValueType t = perftools_profiles_ValueType_init_zero;
  if (!pb_decode(stream, perftools_profiles_ValueType_fields, &t)) return false;
  if (!HD_RESERVE(p->sample_types, p->sample_type_count, p->sample_type_capacity)) {
    p->out_of_memory = true;
    return false;
  }
  p->sample_types[p->sample_type_count++] = t;
  return true;
}

static bool decode_label(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  profile *p = *arg;
  perftools_profiles_Label l = perftools_profiles_Label_init_zero;
  if (!pb_decode(stream, perftools_profiles_Label_fields, &l)) return false;
  if (!HD_RESERVE(p->labels, p->label_count, p->label_capacity)) {
    p->out_of_memory = true;
    return false;
  }
  p->labels[p->label_count++] = l;
  return true;
}

static bool decode_sample(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  profile *p = *arg;
  if (!HD_RESERVE(p->samples, p->sample_count, p->sample_capacity)) {
    p->out_of_memory = true;
    return false;
  }
  sample *s = &p->samples[p->sample_count];
  s->first_location = p->sample_locations.count;
  s->first_value = p->sample_values.count;
  s->first_label = p->label_count;
  perftools_profiles_Sample message = perftools_profiles_Sample_init_zero;
  message.location_id = (pb_callback_t){{.decode = decode_u64s}, &p->sample_locations};
  message.value = (pb_callback_t){{.decode = decode_u64s}, &p->sample_values};
  message.label = (pb_callback_t){{.decode = decode_label}, p};
  if (!pb_decode(stream, perftools_profiles_Sample_fields, &message)) return false;
  s->location_count = p->sample_locations.count - s->first_location;
  s->value_count = p->sample_values.count - s->first_value;
  s->label_count = p->label_count - s->first_label;
  p->sample_count++;
  return true;
}

static bool decode_mapping(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  profile *p = *arg;
  perftools_profiles_Mapping m = perftools_profiles_Mapping_init_zero;
  if (!pb_decode(stream, perftools_profiles_Mapping_fields, &m)) return false;
  if (!HD_RESERVE(p->mappings, p->mapping_count, p->mapping_capacity)) {
    p->out_of_memory = true;
    return false;
  }
  p->mappings[p->mapping_count++] = m;
  return true;
}

static bool decode_line(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  profile *p = *arg;
  perftools_profiles_Line l = perftools_profiles_Line_init_zero;
  if (!pb_decode(stream, perftools_profiles_Line_fields, &l)) return false;
  if (!HD_RESERVE(p->lines, p->line_count, p->line_capacity)) {
    p->out_of_memory = true;
    return false;
  }
  p->lines[p->line_count++] = l;
  return true;
}

static bool decode_location(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  profile *p = *arg;
  if (!HD_RESERVE(p->locations, p->location_count, p->location_capacity)) {
    p->out_of_memory = true;
    return false;
  }
  location *l = &p->locations[p->location_count];
  l->first_line = p->line_count;
  l->fields = (perftools_profiles_Location)perftools_profiles_Location_init_zero;
  l->fields.line = (pb_callback_t){{.decode = decode_line}, p};
  if (!pb_decode(stream, perftools_profiles_Location_fields, &l->fields)) return false;
  l->line_count = p->line_count - l->first_line;
  p->location_count++;
  return true;
}

static bool decode_function(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  profile *p = *arg;
  perftools_profiles_Function f = perftools_profiles_Function_init_zero;
  if (!pb_decode(stream, perftools_profiles_Function_fields, &f)) return false;
  if (!HD_RESERVE(p->functions, p->function_count, p->function_capacity)) {
    p->out_of_memory = true;
    return false;
  }
  p->functions[p->function_count++] = f;
  return true;
}

/* ---- building the snapshot ---- */

static const char *str(const profile *p, int64_t index) {
  return index > 0 && (uint64_t)index < p->string_count ? p->strings[index] : "";
}

/* The index of the sample type called name, or -1. */
static long sample_type(const profile *p, const char *name) {
  for (size_t i = 0; i < p->sample_type_count; i++) {
    if (strcmp(str(p, p->sample_types[i].type), name) == 0) return (long)i;
  }
  return -1;
}

static int64_t value_of(const profile *p, const sample *s, long type) {
  return type >= 0 && (size_t)type < s->value_count
             ? (int64_t)p->sample_values.items[s->first_value + type]
             : 0;
}

static const perftools_profiles_Label *label(const profile *p, const sample *s, const char *key) {
  for (size_t i = 0; i < s->label_count; i++) {
    const perftools_profiles_Label *l = &p->labels[s->first_label + i];
    if (strcmp(str(p, l->key), key) == 0) return l;
  }
  return NULL;
}

static bool index_by_id(hd_u64_map *map, const void *items, size_t count, size_t item_size,
                        size_t id_offset) {
  for (size_t i = 0; i < count; i++) {
    uint64_t id;
    memcpy(&id, (const char *)items + i * item_size + id_offset, sizeof id);
    size_t existing;
    if (id != 0 && !hd_u64_map_find(map, id, &existing) && !hd_u64_map_put(map, id, i)) {
      return false;
    }
  }
  return true;
}

typedef struct builder {
  const profile *p;
  hd_reassembler *r;
  long inuse_objects, inuse_space, alloc_objects, alloc_space, peak_objects, peak_space;
  char *error;
  size_t error_size;
} builder;

static HD_MUST_CHECK hd_status add(builder *b, const heapdump_client_SnapshotElement *e,
                                   const uint64_t *addresses, size_t count) {
  hd_element element = {.element = e, .addresses = addresses, .address_count = count};
  return hd_reassembler_add(b->r, &element);
}

/* The name of a stand-in location of the writer's (no address, one line), or NULL. */
static const char *stand_in_name(const profile *p, const location *l) {
  if (l->fields.address != 0 || l->line_count != 1) return NULL;
  size_t f;
  if (!hd_u64_map_find(&p->function_index, p->lines[l->first_line].function_id, &f)) return NULL;
  return str(p, p->functions[f].name);
}

/* "... truncated at N frames": the stand-in location the writer roots cut traces at. */
static bool is_truncation_marker(const profile *p, const location *l) {
  const char *name = stand_in_name(p, l);
  return name != NULL &&
         strncmp(name, HD_TRUNCATED_FRAME_PREFIX, strlen(HD_TRUNCATED_FRAME_PREFIX)) == 0;
}

/* The sample of an armed process's unattributed bytes: their blocks are not known, so it is
 * not read as an allocation (a raw file keeps the figure, as ProcessStats.unattributed_bytes). */
static bool is_unattributed_sample(const profile *p, const sample *s) {
  if (s->location_count != 1) return false;
  size_t index;
  if (!hd_u64_map_find(&p->location_index, p->sample_locations.items[s->first_location], &index))
    return false;
  const char *name = stand_in_name(p, &p->locations[index]);
  return name != NULL && strcmp(name, HD_UNATTRIBUTED_FRAME) == 0;
}

/* Which process a sample belongs to: its process_name and pid labels (a multi-process profile),
 * else the one process of the profile. */
static bool same_process(const profile *p, const sample *a, const sample *b) {
  const perftools_profiles_Label *an = label(p, a, "process_name"),
                                 *bn = label(p, b, "process_name");
  const perftools_profiles_Label *ap = label(p, a, "pid"), *bp = label(p, b, "pid");
  return strcmp(an ? str(p, an->str) : "", bn ? str(p, bn->str) : "") == 0 &&
         (ap ? ap->num : 0) == (bp ? bp->num : 0);
}

static bool same_locations(const profile *p, const sample *a, const sample *b) {
  return a->location_count == b->location_count &&
         memcmp(&p->sample_locations.items[a->first_location],
                &p->sample_locations.items[b->first_location],
                a->location_count * sizeof(uint64_t)) == 0;
}

static uint64_t hash_locations(const profile *p, const sample *s) {
  uint64_t h = 0x9E3779B97F4A7C15u ^ s->location_count;
  for (size_t k = 0; k < s->location_count; k++) {
    h = (h ^ p->sample_locations.items[s->first_location + k]) * 0xff51afd7ed558ccdu;
    h ^= h >> 32;
  }
  return h;
}

/* A stack trace of the snapshot: the samples with its locations share it. */
typedef struct trace {
  size_t first_sample; /* its key is first_sample + 1 */
  uint64_t alloc_objects, alloc_space, peak_objects, peak_space;
} trace;

/* What one process's samples build up. Samples with the same locations share one stack trace (a
 * tagged profile has one sample per block, and one more per trace with its cumulative values). */
typedef struct process_state {
  hd_u64_map regions_sent, threads, trace_by_hash;
  trace *traces;
  size_t trace_count, trace_capacity;
  size_t thread_count;
  /* Scratch for the trace being added: its addresses and their Locations. */
  uint64_t *addresses;
  const location **locations;
  size_t address_capacity;
} process_state;

static void process_state_free(process_state *ps) {
  hd_u64_map_free(&ps->regions_sent);
  hd_u64_map_free(&ps->threads);
  hd_u64_map_free(&ps->trace_by_hash);
  free(ps->traces);
  free(ps->addresses);
  free(ps->locations);
}

/* The mapping's ExecutableRegion, once per process. */
static HD_MUST_CHECK hd_status add_region(builder *b, process_state *ps, uint64_t mapping_id) {
  const profile *p = b->p;
  size_t m;
  if (mapping_id == 0 || hd_u64_map_find(&ps->regions_sent, mapping_id, &m) ||
      !hd_u64_map_find(&p->mapping_index, mapping_id, &m)) {
    return HD_OK;
  }
  const perftools_profiles_Mapping *mp = &p->mappings[m];
  /* A mapping that spans no memory (the one heapdump gives the locations no module holds) is no
   * region: written again, the profile gets it back from the locations it holds. */
  if (mp->memory_limit <= mp->memory_start) return HD_OK;
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_executable_region_tag;
  heapdump_client_ExecutableRegion *g = &e.element.executable_region;
  *g = (heapdump_client_ExecutableRegion){.has_address = true,
                                          .address = mp->memory_start,
                                          .has_size = true,
                                          .size = mp->memory_limit - mp->memory_start,
                                          .has_file_offset = true,
                                          .file_offset = mp->file_offset,
                                          .has_vaddr = true,
                                          .vaddr = mp->file_offset,
                                          .has_name = true};
  snprintf(g->name, sizeof g->name, "%s", str(p, mp->filename));
  const char *hex = str(p, mp->build_id);
  size_t n = strlen(hex) / 2;
  if (n > 0 && n <= sizeof g->build_id.value.bytes) {
    g->has_build_id = true;
    g->build_id.value.size = (pb_size_t)n;
    for (size_t h = 0; h < n; h++) {
      unsigned byte = 0;
      sscanf(hex + 2 * h, "%2x", &byte);
      g->build_id.value.bytes[h] = (uint8_t)byte;
    }
  }
  hd_status status = add(b, &e, NULL, 0);
  if (status == HD_OK && !hd_u64_map_put(&ps->regions_sent, mapping_id, m)) {
    status = HD_ERR_NO_MEMORY;
  }
  return status;
}

/* The names a symbolized Location carries, as a known location of the snapshot. */
static HD_MUST_CHECK hd_status add_known_location(builder *b, const location *l) {
  const profile *p = b->p;
  hd_snapshot *snap = b->r->snapshots[b->r->snapshot_count - 1];
  if (l->line_count == 0 || hd_snapshot_find_known_location(snap, l->fields.address) != NULL) {
    return HD_OK;
  }
  hd_source_frame frames[64];
  size_t n = 0;
  for (size_t f = 0; f < l->line_count && n < 64; f++) {
    const perftools_profiles_Line *line = &p->lines[l->first_line + f];
    size_t fi;
    if (!hd_u64_map_find(&p->function_index, line->function_id, &fi)) continue;
    const perftools_profiles_Function *fn = &p->functions[fi];
    /* The mangled name when the profile has it: the reports demangle what they show. */
    const char *name = str(p, fn->system_name)[0] ? str(p, fn->system_name) : str(p, fn->name);
    frames[n++] = (hd_source_frame){
        .function = name[0] ? name : NULL,
        .file = str(p, fn->filename)[0] ? str(p, fn->filename) : NULL,
        .line = line->line > 0 && line->line <= UINT32_MAX ? (uint32_t)line->line : 0,
        .column = line->column > 0 && line->column <= UINT32_MAX ? (uint32_t)line->column : 0};
  }
  return n > 0 ? hd_snapshot_add_known_location(snap, l->fields.address, frames, n) : HD_OK;
}

/* The stack trace of sample i (new: its locations have not been seen in this process), with the
 * regions and names its locations bring. Its key is i + 1. */
static HD_MUST_CHECK int add_trace(builder *b, process_state *ps, size_t i, hd_status *status) {
  const profile *p = b->p;
  const sample *s = &p->samples[i];
  if (s->location_count > ps->address_capacity) {
    uint64_t *addresses = realloc(ps->addresses, s->location_count * sizeof *addresses);
    if (addresses != NULL) ps->addresses = addresses;
    const location **locations = realloc(ps->locations, s->location_count * sizeof *locations);
    if (locations != NULL) ps->locations = locations;
    if (addresses == NULL || locations == NULL) {
      *status = HD_ERR_NO_MEMORY;
      return 0;
    }
    ps->address_capacity = s->location_count;
  }
  size_t count = 0;
  bool truncated = false;
  for (size_t k = 0; k < s->location_count && *status == HD_OK; k++) {
    size_t index;
    uint64_t id = p->sample_locations.items[s->first_location + k];
    if (!hd_u64_map_find(&p->location_index, id, &index)) {
      return hd_tool_fail(b->error, b->error_size, -EINVAL,
                          "sample %zu refers to unknown location %" PRIu64, i, id);
    }
    const location *l = &p->locations[index];
    if (is_truncation_marker(p, l)) {
      truncated = true;
    } else if (l->fields.address != 0) { /* 0: "(no stack)", the stand-in of an empty trace */
      ps->locations[count] = l;
      ps->addresses[count++] = l->fields.address;
      *status = add_region(b, ps, l->fields.mapping_id);
    }
  }
  if (*status != HD_OK) return 0;
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_stack_trace_tag;
  e.element.stack_trace = (heapdump_client_StackTrace){.has_stack_trace_key = true,
                                                       .stack_trace_key = i + 1,
                                                       .has_truncated = truncated,
                                                       .truncated = truncated};
  *status = add(b, &e, ps->addresses, count);
  /* After the trace: its element made sure the process's snapshot exists. */
  for (size_t k = 0; k < count && *status == HD_OK; k++) {
    *status = add_known_location(b, ps->locations[k]);
  }
  return 0;
}

/* The key of the ThreadInfo naming a sample's thread: with --tags its "name[tid]" label, without
 * one "(unknown)" thread. */
static HD_MUST_CHECK hd_status thread_of(builder *b, process_state *ps, const sample *s,
                                         uint64_t *key) {
  const profile *p = b->p;
  const perftools_profiles_Label *thread = label(p, s, "thread");
  uint64_t name_index = thread != NULL && thread->str > 0 ? (uint64_t)thread->str : 0;
  size_t found;
  if (hd_u64_map_find(&ps->threads, name_index, &found)) {
    *key = found;
    return HD_OK;
  }
  *key = ++ps->thread_count;
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_thread_info_tag;
  heapdump_client_ThreadInfo *ti = &e.element.thread_info;
  *ti = (heapdump_client_ThreadInfo){
      .has_thread_info_key = true, .thread_info_key = *key, .has_name = true};
  const char *text = name_index ? str(p, thread->str) : "(unknown)";
  const char *open = strrchr(text, '[');
  unsigned long long tid;
  if (open != NULL && sscanf(open, "[%llu]", &tid) == 1) {
    ti->has_koid = true;
    ti->koid = tid;
    snprintf(ti->name, sizeof ti->name, "%.*s", (int)(open - text), text);
  } else {
    snprintf(ti->name, sizeof ti->name, "%s", text);
  }
  hd_status status = add(b, &e, NULL, 0);
  if (status == HD_OK && !hd_u64_map_put(&ps->threads, name_index, *key)) {
    status = HD_ERR_NO_MEMORY;
  }
  return status;
}

/* Sample i: its trace (once), its cumulative values, and an allocation for its live blocks. */
static HD_MUST_CHECK int add_sample(builder *b, process_state *ps, size_t i, hd_status *status) {
  const profile *p = b->p;
  const sample *s = &p->samples[i];
  uint64_t hash = hash_locations(p, s);
  size_t t;
  if (!hd_u64_map_find(&ps->trace_by_hash, hash, &t) ||
      !same_locations(p, &p->samples[ps->traces[t].first_sample], s)) {
    if (!HD_RESERVE(ps->traces, ps->trace_count, ps->trace_capacity)) {
      *status = HD_ERR_NO_MEMORY;
      return 0;
    }
    t = ps->trace_count++;
    ps->traces[t] = (trace){.first_sample = i};
    size_t other;
    /* A hash collision with another stack leaves this one out of the map: still its own. */
    if (!hd_u64_map_find(&ps->trace_by_hash, hash, &other) &&
        !hd_u64_map_put(&ps->trace_by_hash, hash, t)) {
      *status = HD_ERR_NO_MEMORY;
      return 0;
    }
    int rc = add_trace(b, ps, i, status);
    if (rc != 0 || *status != HD_OK) return rc;
  }
  int64_t alloc_objects = value_of(p, s, b->alloc_objects),
          alloc_space = value_of(p, s, b->alloc_space);
  if (alloc_objects > 0) ps->traces[t].alloc_objects += (uint64_t)alloc_objects;
  if (alloc_space > 0) ps->traces[t].alloc_space += (uint64_t)alloc_space;
  int64_t peak_objects = value_of(p, s, b->peak_objects),
          peak_space = value_of(p, s, b->peak_space);
  if (peak_objects > 0) ps->traces[t].peak_objects += (uint64_t)peak_objects;
  if (peak_space > 0) ps->traces[t].peak_space += (uint64_t)peak_space;
  int64_t objects = value_of(p, s, b->inuse_objects), space = value_of(p, s, b->inuse_space);
  if (objects <= 0 && space <= 0) return 0;
  uint64_t thread_key;
  if ((*status = thread_of(b, ps, s, &thread_key)) != HD_OK) return 0;
  const perftools_profiles_Label *address = label(p, s, "address");
  const perftools_profiles_Label *timestamp = label(p, s, "timestamp");
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_allocation_tag;
  e.element.allocation = (heapdump_client_Allocation){
      /* Without tags a sample has no address: one no program can have stands in. */
      .has_address = true,
      .address = address != NULL ? (uint64_t)address->num : (UINT64_C(1) << 63) | i,
      .has_size = true,
      .size = space > 0 ? (uint64_t)space : 0,
      .has_stack_trace_key = true,
      .stack_trace_key = ps->traces[t].first_sample + 1,
      .has_timestamp = timestamp != NULL,
      .timestamp = timestamp ? timestamp->num : 0,
      .has_thread_info_key = true,
      .thread_info_key = thread_key,
      .has_count = true,
      .count = objects > 0 ? (uint64_t)objects : 0};
  *status = add(b, &e, NULL, 0);
  return 0;
}

/* One process: the samples like samples[first] (done[] marks those handled). */
static HD_MUST_CHECK int add_process(builder *b, size_t first, bool *done, bool multi) {
  const profile *p = b->p;
  const sample *lead = &p->samples[first];
  hd_status status = HD_OK;
  if (multi) {
    const perftools_profiles_Label *name = label(p, lead, "process_name"),
                                   *pid = label(p, lead, "pid");
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_snapshot_header_tag;
    e.element.snapshot_header = (heapdump_client_SnapshotHeader){
        .has_process_name = true,
        .has_process_koid = true,
        .process_koid = pid && pid->num > 0 ? (uint64_t)pid->num : 0};
    snprintf(e.element.snapshot_header.process_name, sizeof e.element.snapshot_header.process_name,
             "%s", name ? str(p, name->str) : "");
    status = add(b, &e, NULL, 0);
  }
  process_state ps = {0};
  int rc = 0;
  for (size_t i = first; i < p->sample_count && status == HD_OK && rc == 0; i++) {
    if (done[i] || !same_process(p, lead, &p->samples[i])) continue;
    done[i] = true;
    if (!is_unattributed_sample(p, &p->samples[i])) rc = add_sample(b, &ps, i, &status);
  }
  /* The cumulative values, once per trace, when the profile has them. */
  for (size_t t = 0; t < ps.trace_count && status == HD_OK && rc == 0 &&
                     (b->alloc_objects >= 0 || b->alloc_space >= 0);
       t++) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_stack_trace_counters_tag;
    e.element.stack_trace_counters =
        (heapdump_client_StackTraceCounters){.has_stack_trace_key = true,
                                             .stack_trace_key = ps.traces[t].first_sample + 1,
                                             .has_allocated_blocks = true,
                                             .allocated_blocks = ps.traces[t].alloc_objects,
                                             .has_allocated_bytes = true,
                                             .allocated_bytes = ps.traces[t].alloc_space,
                                             .has_peak_blocks = ps.traces[t].peak_objects != 0,
                                             .peak_blocks = ps.traces[t].peak_objects,
                                             .has_peak_bytes = ps.traces[t].peak_objects != 0,
                                             .peak_bytes = ps.traces[t].peak_space};
    status = add(b, &e, NULL, 0);
  }
  process_state_free(&ps);
  if (rc != 0) return rc;
  if (status != HD_OK) {
    return hd_tool_fail(b->error, b->error_size, status == HD_ERR_NO_MEMORY ? -ENOMEM : -EINVAL,
                        "%s", b->r->error[0] ? b->r->error : hd_status_str(status));
  }
  return 0;
}

int hd_pprof_read(const uint8_t *data, size_t size, const char *fallback_name,
                  uint64_t fallback_pid, hd_reassembler *r, char *error, size_t error_size) {
  uint8_t *bytes = NULL;
  size_t length = 0;
  int rc = hd_gunzip(data, size, MAX_PROFILE_BYTES, &bytes, &length, error, error_size);
  if (rc != 0) return rc;
  profile p = {0};
  perftools_profiles_Profile message = perftools_profiles_Profile_init_zero;
  message.sample_type = (pb_callback_t){{.decode = decode_sample_type}, &p};
  message.sample = (pb_callback_t){{.decode = decode_sample}, &p};
  message.mapping = (pb_callback_t){{.decode = decode_mapping}, &p};
  message.location = (pb_callback_t){{.decode = decode_location}, &p};
  message.function = (pb_callback_t){{.decode = decode_function}, &p};
  message.string_table = (pb_callback_t){{.decode = decode_string}, &p};
  pb_istream_t in = pb_istream_from_buffer(bytes, length);
  bool decoded = pb_decode(&in, perftools_profiles_Profile_fields, &message);
  free(bytes);
  if (!decoded) {
    rc = p.out_of_memory ? hd_tool_fail(error, error_size, -ENOMEM, "out of memory")
                         : hd_tool_fail(error, error_size, -EBADMSG, "not a pprof profile (%s)",
                                        PB_GET_ERROR(&in));
    profile_free(&p);
    return rc;
  }
  builder b = {.p = &p,
               .r = r,
               .error = error,
               .error_size = error_size,
               .inuse_objects = sample_type(&p, "inuse_objects"),
               .inuse_space = sample_type(&p, "inuse_space"),
               .alloc_objects = sample_type(&p, "alloc_objects"),
               .alloc_space = sample_type(&p, "alloc_space"),
               .peak_objects = sample_type(&p, "peak_objects"),
               .peak_space = sample_type(&p, "peak_space")};
  if (b.inuse_space < 0 && b.alloc_space < 0) {
    char types[200] = "";
    for (size_t i = 0; i < p.sample_type_count; i++) {
      size_t used = strlen(types);
      snprintf(types + used, sizeof types - used, "%s%s", i ? ", " : "",
               str(&p, p.sample_types[i].type));
    }
    profile_free(&p);
    return hd_tool_fail(
        error, error_size, -EINVAL,
        "not a heap profile: its sample types are %s, not inuse_space or alloc_space",
        types[0] ? types : "none");
  }
  bool *done = calloc(p.sample_count ? p.sample_count : 1, sizeof *done);
  if (done == NULL ||
      !index_by_id(&p.location_index, p.locations, p.location_count, sizeof *p.locations,
                   offsetof(location, fields) + offsetof(perftools_profiles_Location, id)) ||
      !index_by_id(&p.mapping_index, p.mappings, p.mapping_count, sizeof *p.mappings,
                   offsetof(perftools_profiles_Mapping, id)) ||
      !index_by_id(&p.function_index, p.functions, p.function_count, sizeof *p.functions,
                   offsetof(perftools_profiles_Function, id))) {
    free(done);
    profile_free(&p);
    return hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
  }
  bool multi = false;
  for (size_t i = 0; i < p.sample_count && !multi; i++) {
    multi = label(&p, &p.samples[i], "process_name") != NULL;
  }
  for (size_t i = 0; i < p.sample_count && rc == 0; i++) {
    if (!done[i]) rc = add_process(&b, i, done, multi);
  }
  /* A single process's profile does not name it: the caller (e.g. from the file's name) does. */
  if (rc == 0 && !multi && r->snapshot_count == 1) {
    snprintf(r->snapshots[0]->process_name, sizeof r->snapshots[0]->process_name, "%s",
             fallback_name != NULL ? fallback_name : "");
    r->snapshots[0]->pid = fallback_pid;
  }
  if (rc == 0 && hd_reassembler_finish(r) != HD_OK) {
    rc = hd_tool_fail(error, error_size, -EINVAL, "inconsistent profile: %s", r->error);
  }
  free(done);
  profile_free(&p);
  return rc;
}
