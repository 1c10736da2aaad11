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

#include "heapdump/tools/demangle.h"
#include "heapdump/tools/sites.h"
#include "heapdump/tools/util.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <pb_encode.h>
#include <zlib.h>

#include "profile.pb.h"
#include "heapdump/contract/must_check.h"

enum { kSampleTypeCount = 4, kMaxLabels = 8 };

/* ---- the model kept in memory while writing ---- */

/* Entries of the two deduplicated tables (strings, functions): a map goes from a hash to the
 * first entry with that hash; the others with the same hash follow through `next`. */
typedef struct string_entry {
  char *text;
  size_t next; /* index + 1 of the next entry with the same hash; 0 = none */
} string_entry;

typedef struct function_key {
  int64_t name, system_name, filename; /* string indices */
} function_key;

typedef struct function_entry {
  function_key key;
  size_t next;
} function_entry;

typedef struct line_entry {
  uint64_t function_id;
  int64_t line, column;
} line_entry;

typedef struct location {
  uint64_t address;
  uint64_t mapping_id; /* 0: no executable region holds the address */
  bool is_return_address;
  bool is_site;  /* the allocation site of some trace: its inlined std:: frames are left out */
  bool stand_in; /* no address: one Line names what it stands for ("(no stack)", truncation) */
  size_t first_line, line_count; /* in writer.lines */
} location;

/* One per executable region, in process order then region order: id = index + 1. */
typedef struct mapping {
  const hd_snapshot_region *region;
  int64_t filename, build_id;
  bool has_functions, has_filenames, has_line_numbers, has_inline_frames;
} mapping;

typedef struct region_ref {
  uint64_t address;
  size_t index;
} region_ref;

/* What the live blocks of one stack trace add up to; indexed like hd_snapshot.stack_traces. */
typedef struct trace_total {
  uint64_t blocks, bytes;
  bool referenced; /* by at least one allocation */
  size_t site;     /* the first frame a sample shows (see add_locations) */
  int64_t wrapper; /* string index of the allocation wrapper the site called, 0: none */
} trace_total;

typedef struct process {
  const hd_snapshot *snapshot;
  hd_u64_map location_by_address;
  region_ref *regions; /* sorted by address */
  size_t first_mapping; /* writer.mappings[first_mapping + i] is snapshot->regions[i] */
  trace_total *totals;
  int64_t *thread_labels; /* tags: string index of "name[tid]", indexed like snapshot->threads */
  int64_t name;           /* string index of the process name */
} process;

/* String indices interned first, so that the fields written after the string table
 * (period_type, default_sample_type) can refer to them. */
typedef struct well_known {
  int64_t sample_types[kSampleTypeCount];
  int64_t count, bytes, space, nanoseconds;
  int64_t address, timestamp, thread, process_name, pid, alloc_fn;
} well_known;

typedef struct writer {
  const hd_reassembler *r;
  hd_pprof_options options;
  bool label_processes; /* a multi-process stream: samples carry process_name and pid */
  process *processes;
  size_t process_count;
  string_entry *strings;
  size_t string_count, string_capacity;
  hd_u64_map string_by_hash;
  function_entry *functions; /* id = index + 1 */
  size_t function_count, function_capacity;
  hd_u64_map function_by_hash;
  location *locations; /* id = index + 1 */
  size_t location_count, location_capacity;
  line_entry *lines;
  size_t line_count, line_capacity;
  mapping *mappings;
  size_t mapping_count;
  uint64_t *comments; /* string indices */
  size_t comment_count, comment_capacity;
  well_known known;
  uint64_t no_stack_location; /* id of the stand-in for empty stack traces; 0 until needed */
  hd_u64_map truncation_location; /* frame count -> index of "... truncated at N frames" */
  uint64_t *stack;            /* location ids of the sample being written */
  size_t stack_capacity;

  FILE *out;
  z_stream z;
  bool z_ready;
  int status; /* 0, or the negative errno of the first failure */
  char *error;
  size_t error_size;
  uint8_t compressed[1 << 16];
} writer;

/* Records the writer's first failure (w->status keeps it: a caller may go on and let the end of
 * the write report it) and returns it. */
static int fail(writer *w, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(writer *w, int status, const char *fmt, ...) {
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

static int out_of_memory(writer *w) {
  return fail(w, -ENOMEM, "out of memory while writing the profile");
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
      if (f->name == key.name && f->system_name == key.system_name &&
          f->filename == key.filename) {
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
  static const char *const kSampleTypes[kSampleTypeCount] = {"inuse_objects", "inuse_space",
                                                             "alloc_objects", "alloc_space"};
  well_known *k = &w->known;
  /* profile.proto requires string_table[0] == "". */
  if (intern(w, "") != 0) return out_of_memory(w);
  for (int i = 0; i < kSampleTypeCount; i++) {
    if ((k->sample_types[i] = intern(w, kSampleTypes[i])) < 0) return out_of_memory(w);
  }
  struct {
    int64_t *index;
    const char *text;
  } const strings[] = {
      {&k->count, "count"},         {&k->bytes, "bytes"},         {&k->space, "space"},
      {&k->nanoseconds, "nanoseconds"}, {&k->address, "address"}, {&k->timestamp, "timestamp"},
      {&k->thread, "thread"},       {&k->process_name, "process_name"}, {&k->pid, "pid"},
      {&k->alloc_fn, "alloc_fn"},
  };
  for (size_t i = 0; i < sizeof strings / sizeof strings[0]; i++) {
    if ((*strings[i].index = intern(w, strings[i].text)) < 0) return out_of_memory(w);
  }
  return 0;
}

/* The values of trace t of process p from the caller (trace_values), else its totals. */
static bool trace_values(const writer *w, const process *p, size_t t,
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
  return total->referenced ||
         (trace->has_counters && (trace->allocated_blocks != 0 || trace->allocated_bytes != 0));
}

static bool trace_used(const writer *w, const process *p, size_t t) {
  int64_t values[kSampleTypeCount];
  return trace_values(w, p, t, values);
}

/* Sums the live blocks of each stack trace, checking every reference the samples will follow. */
static HD_MUST_CHECK int add_totals(writer *w, process *p) {
  const hd_snapshot *s = p->snapshot;
  p->totals = calloc(s->stack_trace_count ? s->stack_trace_count : 1, sizeof *p->totals);
  if (p->totals == NULL) return out_of_memory(w);
  for (size_t i = 0; i < s->allocation_count; i++) {
    const hd_snapshot_allocation *a = &s->allocations[i];
    const hd_snapshot_stack_trace *t = hd_snapshot_find_stack_trace(s, a->stack_trace_key);
    if (t == NULL) {
      return fail(w, -EINVAL, "allocation at 0x%" PRIx64 " refers to unknown stack trace %" PRIu64,
                  a->address, a->stack_trace_key);
    }
    if (w->options.tags && hd_snapshot_find_thread(s, a->thread_info_key) == NULL) {
      return fail(w, -EINVAL, "allocation at 0x%" PRIx64 " refers to unknown thread %" PRIu64,
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
  if (p->regions == NULL) return out_of_memory(w);
  p->first_mapping = w->mapping_count;
  for (size_t i = 0; i < s->region_count; i++) {
    const hd_snapshot_region *g = &s->regions[i];
    p->regions[i] = (region_ref){g->address, i};
    char hex[2 * sizeof g->build_id + 1] = "";
    for (size_t b = 0; b < g->build_id_size && b < sizeof g->build_id; b++) {
      snprintf(hex + 2 * b, 3, "%02x", g->build_id[b]);
    }
    mapping *m = &w->mappings[w->mapping_count++];
    *m = (mapping){.region = g, .filename = intern(w, g->name ? g->name : ""),
                   .build_id = intern(w, hex)};
    if (m->filename < 0 || m->build_id < 0) return out_of_memory(w);
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
    if (name < 0 || system_name < 0 || file < 0) return out_of_memory(w);
    uint64_t id = function_id(w, (function_key){name, system_name, file});
    if (id == 0 || !HD_RESERVE(w->lines, w->line_count, w->line_capacity)) return out_of_memory(w);
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
  return w->no_stack_location != 0 ? 0 : out_of_memory(w);
}

/* A trace cut at the process's frame limit ends (at its root) in a location saying so, shared by
 * every trace cut at the same count: in a flame graph they meet under one root. */
static HD_MUST_CHECK int add_truncation_location(writer *w, size_t frames) {
  size_t index;
  if (hd_u64_map_find(&w->truncation_location, frames, &index)) return 0;
  char text[64];
  snprintf(text, sizeof text, HD_TRUNCATED_FRAME_FORMAT, frames);
  uint64_t id = add_stand_in_location(w, text);
  if (id == 0 || !hd_u64_map_put(&w->truncation_location, frames, id - 1)) return out_of_memory(w);
  return 0;
}

static HD_MUST_CHECK int add_locations(writer *w, process *p) {
  const hd_snapshot *s = p->snapshot;
  size_t first_new = w->location_count;
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
    if (wrapper != NULL && (p->totals[t].wrapper = intern(w, hd_demangle_without_parameters(wrapper))) < 0) {
      return out_of_memory(w);
    }
    for (size_t f = p->totals[t].site; f < trace->count; f++) {
      uint64_t address = trace->addresses[f];
      size_t index;
      if (!hd_u64_map_find(&p->location_by_address, address, &index)) {
        if (!HD_RESERVE(w->locations, w->location_count, w->location_capacity)) {
          return out_of_memory(w);
        }
        index = w->location_count++;
        w->locations[index] = (location){.address = address,
                                         .mapping_id = mapping_of(p, address)};
        if (!hd_u64_map_put(&p->location_by_address, address, index)) return out_of_memory(w);
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

static HD_MUST_CHECK int add_labels_and_comments(writer *w, process *p) {
  const hd_snapshot *s = p->snapshot;
  if (w->label_processes && (p->name = intern(w, s->process_name)) < 0) return out_of_memory(w);
  if (w->options.tags) {
    p->thread_labels = calloc(s->thread_count ? s->thread_count : 1, sizeof *p->thread_labels);
    if (p->thread_labels == NULL) return out_of_memory(w);
    for (size_t i = 0; i < s->thread_count; i++) {
      char label[64];
      snprintf(label, sizeof label, "%s[%" PRIu64 "]", s->threads[i].name, s->threads[i].koid);
      if ((p->thread_labels[i] = intern(w, label)) < 0) return out_of_memory(w);
    }
  }
  const heapdump_client_ProcessStats *st = &s->stats;
  if (s->has_stats &&
      (st->dropped_allocations || st->dropped_stack_traces || st->dropped_resources)) {
    char comment[256];
    char who[64] = "";
    if (s->has_header) snprintf(who, sizeof who, "%s[%" PRIu64 "]: ", s->process_name, s->pid);
    snprintf(comment, sizeof comment,
             "%sincomplete: the instrumentation's tables were full, %" PRIu64
             " allocations, %" PRIu64 " stack traces and %" PRIu64 " other records are missing",
             who, st->dropped_allocations, st->dropped_stack_traces, st->dropped_resources);
    int64_t index = intern(w, comment);
    if (index < 0 || !HD_RESERVE(w->comments, w->comment_count, w->comment_capacity)) {
      return out_of_memory(w);
    }
    w->comments[w->comment_count++] = (uint64_t)index;
  }
  return 0;
}

static HD_MUST_CHECK int build_model(writer *w) {
  const hd_reassembler *r = w->r;
  int status = intern_well_known(w);
  if (status != 0) return status;
  size_t region_count = 0;
  for (size_t i = 0; i < r->snapshot_count; i++) {
    if (r->snapshots[i] == NULL) return fail(w, -EINVAL, "snapshot %zu is missing", i);
    region_count += r->snapshots[i]->region_count;
    w->label_processes |= r->snapshots[i]->has_header;
  }
  w->processes = calloc(r->snapshot_count ? r->snapshot_count : 1, sizeof *w->processes);
  w->mappings = calloc(region_count ? region_count : 1, sizeof *w->mappings);
  if (w->processes == NULL || w->mappings == NULL) return out_of_memory(w);
  for (size_t i = 0; i < r->snapshot_count; i++) {
    process *p = &w->processes[w->process_count++];
    p->snapshot = r->snapshots[i];
    if ((status = add_totals(w, p)) != 0 || (status = add_mappings(w, p)) != 0 ||
        (status = add_locations(w, p)) != 0 || (status = add_labels_and_comments(w, p)) != 0) {
      return status;
    }
  }
  return 0;
}

static void free_model(writer *w) {
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

/* ---- the compressed output stream ---- */

static int io_error(writer *w) {
  int err = errno ? errno : EIO;
  return fail(w, -err, "writing the profile: %s", strerror(err));
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
        fail(w, -EIO, "compressing the profile failed");
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
    if (rc == Z_STREAM_ERROR) return fail(w, -EIO, "compressing the profile failed");
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

static bool write_sample(pb_ostream_t *stream, const pb_field_t *field, writer *w,
                         const process *p, const hd_snapshot_stack_trace *trace,
                         const uint64_t values[kSampleTypeCount], label_list *labels) {
  bool truncated = trace->truncated && trace->count > 0;
  const size_t first = p->totals[trace - p->snapshot->stack_traces].site;
  size_t depth = trace->count ? trace->count - first + truncated : 1;
  if (depth > w->stack_capacity) {
    uint64_t *bigger = realloc(w->stack, depth * sizeof *bigger);
    if (bigger == NULL) {
      out_of_memory(w);
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
  if (w->label_processes) {
    add_label(labels, w->known.process_name, p->name, 0, 0);
    add_label(labels, w->known.pid, 0, (int64_t)p->snapshot->pid, 0);
  }
  packed_u64 stack = {w->stack, depth};
  packed_u64 value = {values, kSampleTypeCount};
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

/* Per block: its live values and labels. The cumulative counters belong to a stack trace, not to
 * a block, so they go into one more sample per stack trace, without block labels. */
static bool write_tagged_samples(pb_ostream_t *stream, const pb_field_t *field, writer *w,
                                 const process *p) {
  const hd_snapshot *s = p->snapshot;
  for (size_t i = 0; i < s->allocation_count; i++) {
    const hd_snapshot_allocation *a = &s->allocations[i];
    const hd_snapshot_stack_trace *trace = hd_snapshot_find_stack_trace(s, a->stack_trace_key);
    const hd_snapshot_thread *thread = hd_snapshot_find_thread(s, a->thread_info_key);
    const uint64_t values[kSampleTypeCount] = {a->count, a->size, 0, 0};
    label_list labels = {.count = 0};
    add_label(&labels, w->known.address, 0, (int64_t)a->address, 0);
    add_label(&labels, w->known.bytes, 0, (int64_t)a->size, w->known.bytes);
    add_label(&labels, w->known.timestamp, 0, a->timestamp, w->known.nanoseconds);
    add_label(&labels, w->known.thread, p->thread_labels[thread - s->threads], 0, 0);
    if (!write_sample(stream, field, w, p, trace, values, &labels)) return false;
  }
  for (size_t t = 0; t < s->stack_trace_count; t++) {
    const hd_snapshot_stack_trace *trace = &s->stack_traces[t];
    if (!trace->has_counters || (trace->allocated_blocks == 0 && trace->allocated_bytes == 0)) {
      continue;
    }
    const uint64_t values[kSampleTypeCount] = {0, 0, trace->allocated_blocks,
                                               trace->allocated_bytes};
    label_list labels = {.count = 0};
    if (!write_sample(stream, field, w, p, trace, values, &labels)) return false;
  }
  return true;
}

static bool encode_samples(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  writer *w = *arg;
  for (size_t i = 0; i < w->process_count; i++) {
    const process *p = &w->processes[i];
    if (w->options.tags) {
      if (!write_tagged_samples(stream, field, w, p)) return false;
      continue;
    }
    const hd_snapshot *s = p->snapshot;
    for (size_t t = 0; t < s->stack_trace_count; t++) {
      int64_t values[kSampleTypeCount];
      if (!trace_values(w, p, t, values)) continue;
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
  for (int i = 0; i < kSampleTypeCount; i++) {
    /* inuse_objects, inuse_space, alloc_objects, alloc_space: counts, then bytes. */
    perftools_profiles_ValueType type = {w->known.sample_types[i],
                                         i % 2 == 0 ? w->known.count : w->known.bytes};
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
    perftools_profiles_Mapping out = {
        .id = i + 1,
        .memory_start = m->region->address,
        .memory_limit = m->region->address + m->region->size,
        .file_offset = m->region->file_offset,
        .filename = m->filename,
        .build_id = m->build_id,
        .has_functions = m->has_functions,
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
    case HD_PPROF_INUSE_OBJECTS:
      return w->known.sample_types[0];
    case HD_PPROF_INUSE_SPACE:
      return w->known.sample_types[1];
    case HD_PPROF_ALLOC_OBJECTS:
      return w->known.sample_types[2];
    case HD_PPROF_ALLOC_SPACE:
      return w->known.sample_types[3];
  }
  return -1;
}

static bool known_sample_type(hd_pprof_sample sample) {
  switch (sample) {
    case HD_PPROF_INUSE_SPACE:
    case HD_PPROF_INUSE_OBJECTS:
    case HD_PPROF_ALLOC_SPACE:
    case HD_PPROF_ALLOC_OBJECTS:
      return true;
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
  /* Every allocation is recorded: one event is one byte allocated. */
  profile.has_period_type = true;
  profile.period_type = (perftools_profiles_ValueType){w->known.space, w->known.bytes};
  profile.period = 1;
  profile.default_sample_type = sample_type_index(w);

  pb_ostream_t stream = {.callback = write_compressed, .state = w, .max_size = SIZE_MAX};
  if (!pb_encode(&stream, perftools_profiles_Profile_fields, &profile)) {
    return fail(w, -EIO, "encoding the profile: %s", PB_GET_ERROR(&stream));
  }
  return finish_output(w);
}

int hd_pprof_write(const hd_reassembler *r, const hd_pprof_options *options, FILE *out,
                   char *error, size_t error_size) {
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
    status = fail(w, -EINVAL, "no snapshot or no output to write the profile to");
  } else if (options != NULL && !known_sample_type(options->default_sample)) {
    status = fail(w, -EINVAL, "unknown pprof sample type %d", (int)options->default_sample);
  } else if (options != NULL && options->tags && options->trace_values != NULL) {
    status = fail(w, -EINVAL, "per-block samples (tags) cannot have caller-given values");
  } else {
    w->r = r;
    w->out = out;
    if (options != NULL) w->options = *options;
    status = build_model(w);
    if (status == 0) {
      /* gzip framing: windowBits 15 plus 16. */
      int rc = deflateInit2(&w->z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8,
                            Z_DEFAULT_STRATEGY);
      if (rc != Z_OK) {
        status = fail(w, rc == Z_MEM_ERROR ? -ENOMEM : -EIO,
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
  free_model(w);
  free(w);
  return status;
}
