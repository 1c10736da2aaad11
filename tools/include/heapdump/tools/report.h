/* Human-facing outputs of a snapshot: the report (top allocation sites, stacks or threads by live
 * bytes, as text or JSON) and folded stacks for flame graph tools. */
#ifndef HEAPDUMP_TOOLS_REPORT_H
#define HEAPDUMP_TOOLS_REPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/symbolize.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum hd_report_by {
  HD_REPORT_BY_SITE = 0, /* the allocation site: the first frame outside the allocator */
  HD_REPORT_BY_STACK,    /* each distinct stack trace */
  HD_REPORT_BY_THREAD,   /* the allocating thread */
} hd_report_by;

/* What orders the groups (the report lists the heaviest first). */
typedef enum hd_report_sort {
  HD_REPORT_SORT_LIVE = 0,  /* live bytes; only groups with live blocks are listed */
  HD_REPORT_SORT_ALLOCATED, /* bytes allocated since start; groups with nothing live too */
  HD_REPORT_SORT_TEMPORARY, /* temporary blocks (freed by their thread before it allocated or
                               freed anything else); groups with nothing live too */
  HD_REPORT_SORT_PEAK,      /* bytes live at the peak mark; groups with nothing live now too */
} hd_report_sort;

typedef struct hd_report_options {
  hd_symbolizer *symbolizer; /* NULL: addresses as module+0xoffset */
  hd_report_by by;
  hd_report_sort sort; /* by site or stack only: a trace's counters are not kept per thread */
  /* By site or stack, without a leak check: also the groups whose blocks were all freed (what
   * --sort allocated and temporary list anyway). */
  bool freed_groups_too;
  size_t top;        /* groups shown per process; 0 = all */
  size_t max_frames; /* frames shown per group; 0 = all */
  bool json;
  /* A snapshot with roots is reported as a leak check (heapdump/tools/reach.h): groups by
   * category, then site; the text lists the lost ones, and possibly lost and still reachable in
   * one line, unless show_reachable. */
  bool show_reachable;
  /* A leak check of a live program (heapdump leaks): per snapshot of r, the category of each of
   * its allocations (an hd_reach_category), or HD_REACH_CATEGORIES for a block left out of the
   * report (lost in the last scan only: counted as unconfirmed). NULL: snapshots with roots are
   * classified here. */
  uint8_t *const *categories;
  /* Non-zero: each group shows the age of its oldest block at this CLOCK_MONOTONIC time (text
   * OLDEST, JSON oldest_age_s). */
  uint64_t now_ns;
  /* Sites are named without a demangled name's parameter list ("shop::make_basket"). */
  bool short_names;
} hd_report_options;

/* What a snapshot's live blocks add up to per stack trace: an array parallel to its stack traces
 * (calloc'd: free() it; NULL when out of memory). */
typedef struct hd_trace_totals {
  uint64_t live_bytes, live_blocks;
  int64_t oldest; /* the earliest allocation timestamp, INT64_MAX if none */
} hd_trace_totals;
hd_trace_totals *hd_trace_totals_of(const hd_snapshot *s);

/* One line of the report: a site, stack or thread (and leak category) with its totals. */
typedef struct hd_report_group {
  char name[512];
  int category; /* an hd_reach_category, or -1 when the snapshot has no roots */
  const char *module;
  uint64_t live_bytes, live_blocks;
  uint64_t allocated_bytes, allocated_blocks; /* of its traces' counters, when has_counters */
  uint64_t temporary_blocks;                  /* the same, when has_temporary */
  uint64_t peak_bytes, peak_blocks; /* live at the peak mark (when the snapshot has one) */
  int64_t oldest;                   /* the earliest allocation timestamp of its blocks */
  bool has_counters, has_temporary;
  size_t heaviest_trace; /* index into the snapshot's stack traces, or SIZE_MAX */
  uint64_t heaviest_bytes;
} hd_report_group;

/* The groups the report shows for s, in its order: by category first when categories (one per
 * allocation, as hd_reach_classify gives them) is not NULL. free() *groups. trace_group
 * (nullable; one entry per stack trace of s): by site or stack, the group each trace is in
 * (with categories, the last category it has blocks of), SIZE_MAX for a trace in none. 0 or
 * -ENOMEM. */
HD_MUST_CHECK int hd_report_groups(const hd_snapshot *s, const hd_report_options *o,
                                   const uint8_t *categories, hd_report_group **groups,
                                   size_t *count, size_t *trace_group);

/* What a leak check of s could not see, for a process that does not record every block
 * (sampled, or armed): one sentence, as the text report's note, the JSON's
 * leak_summary.scope_note and the HTML page's leak section give it; NULL for one that records
 * every block since start. */
const char *hd_report_leak_scope_note(const hd_snapshot *s);

/* ,"resident":{...} of s's ResidentMemory (nothing if it has none), as the JSON report and the
 * HTML page give it. */
void hd_report_resident_json(const hd_snapshot *s, FILE *out);

/* "live", "allocated", "temporary" or "peak". */
const char *hd_report_sort_name(hd_report_sort sort);

/* Returns 0, or a negative errno value with a message in error. */
HD_MUST_CHECK int hd_report_write(const hd_reassembler *r, const hd_report_options *options,
                                  FILE *out, char *error, size_t error_size);

/* One line per stack trace, root first: "frame;frame;...;leaf live_bytes" (a multi-process
 * snapshot starts each line with "process[pid]"). Inlined frames are expanded. */
HD_MUST_CHECK int hd_folded_write(const hd_reassembler *r, hd_symbolizer *symbolizer, FILE *out,
                                  char *error, size_t error_size);

/* The frames of trace from index first (at most max_frames; 0: all), inlined frames expanded, as
 * the report shows them: indented "at function (file:line)" lines, or a JSON array of
 * {address, module, module_offset, function, file, line, inlined} objects. */
void hd_report_frames_text(FILE *out, hd_symbolizer *symbolizer, const hd_snapshot *s,
                           const hd_snapshot_stack_trace *trace, size_t first, size_t max_frames);
void hd_report_frames_json(FILE *out, hd_symbolizer *symbolizer, const hd_snapshot *s,
                           const hd_snapshot_stack_trace *trace, size_t first, size_t max_frames);

/* Writes s as a JSON string literal (quotes and control characters escaped, bytes that are not
 * UTF-8 replaced by U+FFFD). */
void hd_json_string(FILE *out, const char *s);
/* The same, safe inside an HTML <script> element too: '<', '>' and '&' are escaped as well, so
 * no name from a binary can close the element or be read as markup. */
void hd_json_string_in_html(FILE *out, const char *s);

/* The length of the valid UTF-8 sequence at s (1 to 4), or 0 if the bytes there are not one
 * (overlong forms, surrogates and code points past U+10FFFF are not); s is NUL-terminated. */
size_t hd_utf8_sequence(const unsigned char *s);
/* U+FFFD, which stands for what is not UTF-8. */
#define HD_UTF8_REPLACEMENT "\xef\xbf\xbd"

#ifdef __cplusplus
}
#endif
#endif
