/* The pprof writer's model (pprof_model.c builds it, pprof.c encodes it): what has to be known
 * before the profile is written, because the profile refers to it by index or id. Private to
 * tools/pprof. */
#ifndef HEAPDUMP_TOOLS_PPROF_MODEL_H
#define HEAPDUMP_TOOLS_PPROF_MODEL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <zlib.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/tools/pprof.h"
#include "heapdump/tools/util.h"

/* inuse_objects, inuse_space, alloc_objects, alloc_space, and where the snapshots have a peak
 * mark, peak_objects, peak_space (writer.sample_type_count says which). */
enum { kSampleTypeCount = 6, kPeaklessSampleTypes = 4, kMaxLabels = 8 };

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
  uint64_t mapping_id; /* the unmapped locations' Mapping where no executable region holds it */
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
  region_ref *regions;  /* sorted by address */
  size_t first_mapping; /* writer.mappings[first_mapping + i] is snapshot->regions[i] */
  trace_total *totals;
  int64_t *thread_labels; /* tags: string index of "name[tid]", indexed like snapshot->threads */
  int64_t name;           /* string index of the process name */
  bool has_peak;          /* hd_snapshot_has_peak, asked once: it may look at every trace */
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
  /* The largest sampling interval of the snapshots (ProcessStats.sample_bytes), the profile's
   * period; 0: every block recorded (period 1). */
  uint64_t sample_bytes;
  well_known known;
  int sample_type_count;          /* kPeakless... or kSampleTypeCount: the profile's sample types */
  uint64_t no_stack_location;     /* id of the stand-in for empty stack traces; 0 until needed */
  uint64_t unattributed_location; /* id of HD_UNATTRIBUTED_FRAME's stand-in; 0 until needed */
  hd_u64_map truncation_location; /* frame count -> index of "... truncated at N frames" */
  uint64_t *stack;                /* location ids of the sample being written */
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
int hd_pprof_fail(writer *w, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int hd_pprof_out_of_memory(writer *w);

/* The values of trace t of process p from the caller (options.trace_values), else its totals;
 * false if the trace has none to show. */
bool hd_pprof_trace_values(const writer *w, const process *p, size_t t,
                           int64_t values[kSampleTypeCount]);

/* The unattributed bytes of p (live, allocated before the process was armed) its profile carries
 * in a sample whose one frame is HD_UNATTRIBUTED_FRAME, or 0 (none, or a diff profile). */
uint64_t hd_pprof_unattributed_bytes(const writer *w, const process *p);

/* Builds the model of w->r: strings, functions, locations, mappings, totals. Returns 0 or the
 * negative errno of hd_pprof_fail. */
HD_MUST_CHECK int hd_pprof_build_model(writer *w);
void hd_pprof_free_model(writer *w);

#endif
