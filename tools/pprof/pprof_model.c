/* The pprof writer's model (pprof_model.h): the snapshots' strings, functions, symbolized
 * locations, mappings and per-trace totals, built before the profile is encoded. */
#include "pprof_model.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "heapdump/tools/demangle.h"
#include "heapdump/tools/sites.h"

int hd_pprof_fail(writer *w, int status, const char *fmt, ...) {
  if (w->status != 0) return w->status;
  w->status = status;
  if (w->error != NULL && w->error_size > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->error, w->error_size, fmt, ap);
    va_end(ap);
  }
  return status;
}

int hd_pprof_out_of_memory(writer *w) {
  return hd_pprof_fail(w, -ENOMEM, "out of memory while writing the profile");
}

/* The index of text in the string table, added if new; -1 if out of memory. */
static int64_t intern(writer *w, const char *text) {
  uint64_t hash = hd_fnv1a(HD_FNV1A_BASIS, text, strlen(text));
  size_t first;
  bool seen_hash = hd_u64_map_find(&w->string_by_hash, hash, &first);
  if (seen_hash) {
    for (size_t i = first + 1; i != 0; i = w->strings[i - 1].next) {
      if (strcmp(w->strings[i - 1].text, text) == 0) return (int64_t)(i - 1);
    }
  }
  if (!HD_RESERVE(w->strings, w->string_count, w->string_capacity)) return -1;
  size_t index = w->string_count;
  string_entry entry = {strdup(text), 0};
  if (entry.text == NULL) return -1;
  if (seen_hash) {
    entry.next = w->strings[first].next;
    w->strings[first].next = index + 1;
  } else if (!hd_u64_map_put(&w->string_by_hash, hash, index)) {
    free(entry.text);
    return -1;
  }
  w->strings[index] = entry;
  w->string_count++;
  return (int64_t)index;
}

/* The id of the Function with this key, added if new; 0 if out of memory. */
static uint64_t function_id(writer *w, function_key key) {
  uint64_t hash = hd_fnv1a(HD_FNV1A_BASIS ^ 1, &key, sizeof key);
  size_t first;
  bool seen_hash = hd_u64_map_find(&w->function_by_hash, hash, &first);
  if (seen_hash) {
    for (size_t i = first + 1; i != 0; i = w->functions[i - 1].next) {
      const function_key *f = &w->functions[i - 1].key;
      if (f->name == key.name && f->system_name == key.system_name && f->filename == key.filename) {
        return i;
      }
    }
  }
  if (!HD_RESERVE(w->functions, w->function_count, w->function_capacity)) return 0;
  size_t index = w->function_count;
  function_entry entry = {key, 0};
  if (seen_hash) {
    entry.next = w->functions[first].next;
    w->functions[first].next = index + 1;
  } else if (!hd_u64_map_put(&w->function_by_hash, hash, index)) {
    return 0;
  }
  w->functions[index] = entry;
  w->function_count++;
  return index + 1;
}

/* ---- building the model ---- */

static HD_MUST_CHECK int intern_well_known(writer *w) {
  static const char *const kSampleTypes[kSampleTypeCount] = {
      "inuse_objects", "inuse_space", "alloc_objects", "alloc_space", "peak_objects", "peak_space"};
  well_known *k = &w->known;
  /* profile.proto requires string_table[0] == "". */
  if (intern(w, "") != 0) return hd_pprof_out_of_memory(w);
  for (int i = 0; i < kSampleTypeCount; i++) {
    if ((k->sample_types[i] = intern(w, kSampleTypes[i])) < 0) return hd_pprof_out_of_memory(w);
  }
  struct {
    int64_t *index;
    const char *text;
  } const strings[] = {
      {&k->count, "count"},     {&k->bytes, "bytes"},
      {&k->space, "space"},     {&k->nanoseconds, "nanoseconds"},
      {&k->address, "address"}, {&k->timestamp, "timestamp"},
      {&k->thread, "thread"},   {&k->process_name, "process_name"},
      {&k->pid, "pid"},         {&k->alloc_fn, "alloc_fn"},
  };
  for (size_t i = 0; i < sizeof strings / sizeof strings[0]; i++) {
    if ((*strings[i].index = intern(w, strings[i].text)) < 0) return hd_pprof_out_of_memory(w);
  }
  return 0;
}

/* The values of trace t of process p from the caller (trace_values), else its totals. */
bool hd_pprof_trace_values(const writer *w, const process *p, size_t t,
                           int64_t values[kSampleTypeCount]) {
  if (w->options.trace_values != NULL) {
    return w->options.trace_values(w->options.trace_values_ctx, (size_t)(p - w->processes), t,
                                   values);
  }
  const hd_snapshot_stack_trace *trace = &p->snapshot->stack_traces[t];
  const trace_total *total = &p->totals[t];
  values[0] = (int64_t)total->blocks;
  values[1] = (int64_t)total->bytes;
  values[2] = trace->has_counters ? (int64_t)trace->allocated_blocks : 0;
  values[3] = trace->has_counters ? (int64_t)trace->allocated_bytes : 0;
  values[4] = p->has_peak ? (int64_t)trace->peak_blocks : 0;
  values[5] = p->has_peak ? (int64_t)trace->peak_bytes : 0;
  return total->referenced ||
         (trace->has_counters && (trace->allocated_blocks != 0 || trace->allocated_bytes != 0));
}

static bool trace_used(const writer *w, const process *p, size_t t) {
  int64_t values[kSampleTypeCount];
  return hd_pprof_trace_values(w, p, t, values);
}

/* Sums the live blocks of each stack trace, checking every reference the samples will follow. */
static HD_MUST_CHECK int add_totals(writer *w, process *p) {
  const hd_snapshot *s = p->snapshot;
  p->has_peak = hd_snapshot_has_peak(s);
  p->totals = calloc(s->stack_trace_count ? s->stack_trace_count : 1, sizeof *p->totals);
  if (p->totals == NULL) return hd_pprof_out_of_memory(w);
  for (size_t i = 0; i < s->allocation_count; i++) {
    const hd_snapshot_allocation *a = &s->allocations[i];
    const hd_snapshot_stack_trace *t = hd_snapshot_find_stack_trace(s, a->stack_trace_key);
    if (t == NULL) {
      return hd_pprof_fail(w, -EINVAL,
                           "allocation at 0x%" PRIx64 " refers to unknown stack trace %" PRIu64,
                           a->address, a->stack_trace_key);
    }
    if (w->options.tags && hd_snapshot_find_thread(s, a->thread_info_key) == NULL) {
      return hd_pprof_fail(w, -EINVAL,
                           "allocation at 0x%" PRIx64 " refers to unknown thread %" PRIu64,
                           a->address, a->thread_info_key);
    }
    trace_total *total = &p->totals[t - s->stack_traces];
    total->blocks += a->count;
    total->bytes += a->size;
    total->referenced = true;
  }
  return 0;
}

static int compare_region_refs(const void *a, const void *b) {
  const region_ref *x = a, *y = b;
  return x->address < y->address ? -1 : x->address > y->address;
}

static HD_MUST_CHECK int add_mappings(writer *w, process *p) {
  const hd_snapshot *s = p->snapshot;
  p->regions = malloc((s->region_count ? s->region_count : 1) * sizeof *p->regions);
  if (p->regions == NULL) return hd_pprof_out_of_memory(w);
  p->first_mapping = w->mapping_count;
  for (size_t i = 0; i < s->region_count; i++) {
    const hd_snapshot_region *g = &s->regions[i];
    p->regions[i] = (region_ref){g->address, i};
    char hex[2 * sizeof g->build_id + 1] = "";
    for (size_t b = 0; b < g->build_id_size && b < sizeof g->build_id; b++) {
      snprintf(hex + 2 * b, 3, "%02x", g->build_id[b]);
    }
    mapping *m = &w->mappings[w->mapping_count++];
    *m = (mapping){
        .region = g, .filename = intern(w, g->name ? g->name : ""), .build_id = intern(w, hex)};
    if (m->filename < 0 || m->build_id < 0) return hd_pprof_out_of_memory(w);
  }
  qsort(p->regions, s->region_count, sizeof *p->regions, compare_region_refs);
  return 0;
}

/* The id of the Mapping whose region holds address, or 0. */
static uint64_t mapping_of(const process *p, uint64_t address) {
  const hd_snapshot *s = p->snapshot;
  size_t lo = 0, hi = s->region_count; /* first region starting above address */
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (p->regions[mid].address <= address) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == 0) return 0;
  size_t index = p->regions[lo - 1].index;
  const hd_snapshot_region *g = &s->regions[index];
  if (address - g->address >= g->size) return 0;
  return p->first_mapping + index + 1;
}

/* Adds the source frames of a location as Lines (and their Functions). */
static HD_MUST_CHECK int symbolize_location(writer *w, const process *p, location *loc) {
  hd_location_info info;
  hd_symbolize(w->options.symbolizer, p->snapshot, loc->address, loc->is_return_address, &info);
  loc->first_line = w->line_count;
  mapping *m = loc->mapping_id ? &w->mappings[loc->mapping_id - 1] : NULL;
  /* At a site, the standard library's code inlined into the program's function (a
   * std::string constructor calling into libstdc++) would be the leaf, and pprof's flat
   * column would name it rather than the site the report names. */
  size_t first = 0;
  while (loc->is_site && first + 1 < info.frame_count &&
         hd_is_std_library_name(info.frames[first].function)) {
    first++;
  }
  for (size_t i = first; i < info.frame_count; i++) {
    const hd_source_frame *frame = &info.frames[i];
    if (frame->function == NULL && frame->file == NULL) continue;
    /* The readable name, and the linker's as system_name (pprof shows name, and keeps
     * system_name for tools that look symbols up). A line known without its function (debug
     * info but no name) still needs a Function. */
    int64_t name = intern(w, frame->function ? hd_demangle(frame->function) : "??");
    int64_t system_name = intern(w, frame->function ? frame->function : "??");
    int64_t file = frame->file ? intern(w, frame->file) : 0;
    if (name < 0 || system_name < 0 || file < 0) return hd_pprof_out_of_memory(w);
    uint64_t id = function_id(w, (function_key){name, system_name, file});
    if (id == 0 || !HD_RESERVE(w->lines, w->line_count, w->line_capacity))
      return hd_pprof_out_of_memory(w);
    w->lines[w->line_count++] = (line_entry){id, frame->line, frame->column};
    if (m != NULL) {
      m->has_functions |= frame->function != NULL;
      m->has_filenames |= frame->file != NULL;
      m->has_line_numbers |= frame->line != 0;
      /* A line number comes from DWARF, and the symbolizer expands inlined calls wherever it
       * reads DWARF: the absence of inline frames is then a fact. */
      m->has_inline_frames |= frame->line != 0;
    }
  }
  loc->line_count = w->line_count - loc->first_line;
  return 0;
}

/* A location with no address, mapping or source: one Line naming what it stands for. Returns its
 * id, or 0 when out of memory. */
static uint64_t add_stand_in_location(writer *w, const char *text) {
  int64_t name = intern(w, text);
  if (name < 0) return 0;
  uint64_t function = function_id(w, (function_key){name, name, 0});
  if (function == 0 || !HD_RESERVE(w->lines, w->line_count, w->line_capacity) ||
      !HD_RESERVE(w->locations, w->location_count, w->location_capacity)) {
    return 0;
  }
  w->lines[w->line_count] = (line_entry){function, 0, 0};
  w->locations[w->location_count++] =
      (location){.stand_in = true, .first_line = w->line_count++, .line_count = 1};
  return w->location_count;
}

/* pprof drops samples without locations, so an empty stack trace (the unwinder found no frame)
 * gets one location standing for "no stack". */
static HD_MUST_CHECK int add_no_stack_location(writer *w) {
  w->no_stack_location = add_stand_in_location(w, "(no stack)");
  return w->no_stack_location != 0 ? 0 : hd_pprof_out_of_memory(w);
}

/* A trace cut at the process's frame limit ends (at its root) in a location saying so, shared by
 * every trace cut at the same count: in a flame graph they meet under one root. */
static HD_MUST_CHECK int add_truncation_location(writer *w, size_t frames) {
  size_t index;
  if (hd_u64_map_find(&w->truncation_location, frames, &index)) return 0;
  char text[64];
  snprintf(text, sizeof text, HD_TRUNCATED_FRAME_FORMAT, frames);
  uint64_t id = add_stand_in_location(w, text);
  if (id == 0 || !hd_u64_map_put(&w->truncation_location, frames, id - 1))
    return hd_pprof_out_of_memory(w);
  return 0;
}

/* The unattributed bytes of p its profile carries in a sample of their own, or 0. A diff
 * profile has none: its values are the caller's, per trace. */
uint64_t hd_pprof_unattributed_bytes(const writer *w, const process *p) {
  const hd_snapshot *s = p->snapshot;
  if (w->options.trace_values != NULL || !s->has_stats || !s->stats.has_unattributed_bytes) {
    return 0;
  }
  return s->stats.unattributed_bytes;
}

static HD_MUST_CHECK int add_locations(writer *w, process *p) {
  const hd_snapshot *s = p->snapshot;
  size_t first_new = w->location_count;
  if (hd_pprof_unattributed_bytes(w, p) > 0 && w->unattributed_location == 0) {
    w->unattributed_location = add_stand_in_location(w, HD_UNATTRIBUTED_FRAME);
    if (w->unattributed_location == 0) return hd_pprof_out_of_memory(w);
  }
  for (size_t t = 0; t < s->stack_trace_count; t++) {
    const hd_snapshot_stack_trace *trace = &s->stack_traces[t];
    if (!trace_used(w, p, t)) continue;
    if (trace->count == 0 && w->no_stack_location == 0) {
      int status = add_no_stack_location(w);
      if (status != 0) return status;
    }
    if (trace->truncated && trace->count > 0) {
      int status = add_truncation_location(w, trace->count);
      if (status != 0) return status;
    }
    /* A sample starts at the allocation site, as the report's sites do: the allocator's own
     * frames (operator new, the malloc family, checked wrappers) and the standard library's
     * are left out, so that the flat column of `pprof -top` names the code that asked for the
     * memory rather than operator new. */
    const char *wrapper;
    p->totals[t].site = hd_site_frame_wrapper(w->options.symbolizer, s, trace, &wrapper);
    /* The wrapper's frames are left out like the allocator's; the sample says which it was. */
    if (wrapper != NULL &&
        (p->totals[t].wrapper = intern(w, hd_demangle_without_parameters(wrapper))) < 0) {
      return hd_pprof_out_of_memory(w);
    }
    for (size_t f = p->totals[t].site; f < trace->count; f++) {
      uint64_t address = trace->addresses[f];
      size_t index;
      if (!hd_u64_map_find(&p->location_by_address, address, &index)) {
        if (!HD_RESERVE(w->locations, w->location_count, w->location_capacity)) {
          return hd_pprof_out_of_memory(w);
        }
        index = w->location_count++;
        w->locations[index] = (location){.address = address, .mapping_id = mapping_of(p, address)};
        if (!hd_u64_map_put(&p->location_by_address, address, index))
          return hd_pprof_out_of_memory(w);
      }
      /* Every frame is a return address, the instruction after a call: the instrumentation
       * leaves its own frames out, so even the leaf is where the call to the allocator returns. */
      w->locations[index].is_return_address = true;
      w->locations[index].is_site |= f == p->totals[t].site;
    }
  }
  if (w->options.symbolizer == NULL) return 0;
  for (size_t i = first_new; i < w->location_count; i++) {
    if (w->locations[i].stand_in) continue;
    int status = symbolize_location(w, p, &w->locations[i]);
    if (status != 0) return status;
  }
  return 0;
}

/* Adds a comment line to the profile; 0, or -1 when out of memory. */
static int add_comment(writer *w, const char *comment) {
  const int64_t index = intern(w, comment);
  if (index < 0 || !HD_RESERVE(w->comments, w->comment_count, w->comment_capacity)) return -1;
  w->comments[w->comment_count++] = (uint64_t)index;
  return 0;
}

static HD_MUST_CHECK int add_labels_and_comments(writer *w, process *p) {
  const hd_snapshot *s = p->snapshot;
  if (w->label_processes && (p->name = intern(w, s->process_name)) < 0)
    return hd_pprof_out_of_memory(w);
  if (w->options.tags) {
    p->thread_labels = calloc(s->thread_count ? s->thread_count : 1, sizeof *p->thread_labels);
    if (p->thread_labels == NULL) return hd_pprof_out_of_memory(w);
    for (size_t i = 0; i < s->thread_count; i++) {
      char label[64];
      snprintf(label, sizeof label, "%s[%" PRIu64 "]", s->threads[i].name, s->threads[i].koid);
      if ((p->thread_labels[i] = intern(w, label)) < 0) return hd_pprof_out_of_memory(w);
    }
  }
  const heapdump_client_ProcessStats *st = &s->stats;
  char who[64] = "";
  if (s->has_header) snprintf(who, sizeof who, "%s[%" PRIu64 "]: ", s->process_name, s->pid);
  if (s->has_stats &&
      (st->dropped_allocations || st->dropped_stack_traces || st->dropped_resources)) {
    char comment[256];
    snprintf(comment, sizeof comment,
             "%sincomplete: the instrumentation's tables were full, %" PRIu64
             " allocations, %" PRIu64 " stack traces and %" PRIu64 " other records are missing",
             who, st->dropped_allocations, st->dropped_stack_traces, st->dropped_resources);
    if (add_comment(w, comment) != 0) return hd_pprof_out_of_memory(w);
  }
  /* Values are already the estimates (as Go's runtime writes its sampled heap profiles): the
   * period says the rate to readers that show it, the comment that they are estimates. */
  if (s->has_stats && st->has_sample_bytes) {
    char comment[256];
    snprintf(comment, sizeof comment,
             "%ssampled: one block recorded per %" PRIu64
             " bytes allocated on average; every value is an estimate",
             who, st->sample_bytes);
    if (add_comment(w, comment) != 0) return hd_pprof_out_of_memory(w);
    if (st->sample_bytes > w->sample_bytes) w->sample_bytes = st->sample_bytes;
  }
  if (s->has_stats && st->has_unattributed_bytes) {
    /* A diff profile has no such sample: its values are per trace. */
    const bool sampled = hd_pprof_unattributed_bytes(w, p) > 0;
    char comment[256];
    snprintf(comment, sizeof comment,
             "%sarmed: only blocks allocated while the process recorded have their stacks; "
             "%" PRIu64 " more live bytes (glibc's count, headers included) are in %s",
             who, st->unattributed_bytes, sampled ? "the sample " HD_UNATTRIBUTED_FRAME : "none");
    if (add_comment(w, comment) != 0) return hd_pprof_out_of_memory(w);
  }
  return 0;
}

/* Some readers (profile ingesters) refuse a Location without a Mapping: the locations no region
 * holds (stand-ins for "no stack" and truncation; addresses outside every module) share one
 * Mapping that spans no memory, named for what it is. It has no file to symbolize from, and
 * says so (has_functions), so that pprof does not look for one. */
static HD_MUST_CHECK int add_unmapped_mapping(writer *w) {
  mapping *m = &w->mappings[w->mapping_count];
  bool used = false;
  for (size_t i = 0; i < w->location_count; i++) {
    location *loc = &w->locations[i];
    if (loc->mapping_id != 0) continue;
    loc->mapping_id = w->mapping_count + 1;
    used = true;
  }
  if (!used) return 0;
  *m = (mapping){.filename = intern(w, HD_PPROF_UNMAPPED), .has_functions = true};
  if (m->filename < 0) return hd_pprof_out_of_memory(w);
  w->mapping_count++;
  return 0;
}

HD_MUST_CHECK int hd_pprof_build_model(writer *w) {
  const hd_reassembler *r = w->r;
  int status = intern_well_known(w);
  if (status != 0) return status;
  size_t region_count = 0;
  for (size_t i = 0; i < r->snapshot_count; i++) {
    if (r->snapshots[i] == NULL) return hd_pprof_fail(w, -EINVAL, "snapshot %zu is missing", i);
    region_count += r->snapshots[i]->region_count;
    w->label_processes |= r->snapshots[i]->has_header;
  }
  w->processes = calloc(r->snapshot_count ? r->snapshot_count : 1, sizeof *w->processes);
  w->mappings = calloc(region_count + 1, sizeof *w->mappings); /* + the stand-ins' mapping */
  if (w->processes == NULL || w->mappings == NULL) return hd_pprof_out_of_memory(w);
  for (size_t i = 0; i < r->snapshot_count; i++) {
    process *p = &w->processes[w->process_count++];
    p->snapshot = r->snapshots[i];
    if ((status = add_totals(w, p)) != 0 || (status = add_mappings(w, p)) != 0 ||
        (status = add_locations(w, p)) != 0 || (status = add_labels_and_comments(w, p)) != 0) {
      return status;
    }
  }
  return add_unmapped_mapping(w);
}

void hd_pprof_free_model(writer *w) {
  for (size_t i = 0; i < w->process_count; i++) {
    process *p = &w->processes[i];
    hd_u64_map_free(&p->location_by_address);
    free(p->regions);
    free(p->totals);
    free(p->thread_labels);
  }
  free(w->processes);
  for (size_t i = 0; i < w->string_count; i++) free(w->strings[i].text);
  free(w->strings);
  hd_u64_map_free(&w->string_by_hash);
  free(w->functions);
  hd_u64_map_free(&w->function_by_hash);
  hd_u64_map_free(&w->truncation_location);
  free(w->locations);
  free(w->lines);
  free(w->mappings);
  free(w->comments);
  free(w->stack);
}
