/* The report (see report.h): the live allocations of each process by stack trace first, merged
 * into groups (sites, stacks or threads), each named by its heaviest stack, written as text or
 * JSON. The stacks themselves as text, and folded stacks, are stack_text.c's. */
#define _GNU_SOURCE /* qsort_r */
#include "heapdump/tools/report.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/tools/demangle.h"
#include "heapdump/tools/reach.h"
#include "heapdump/tools/sites.h"
#include "heapdump/tools/util.h"

typedef hd_trace_totals trace_totals;

typedef hd_report_group group;

/* Sites the peak line lists under the report's summary (--sort peak lists them all). */
#define PEAK_SITES_SHOWN 5

static void live_totals(const hd_snapshot *s, uint64_t *bytes, uint64_t *blocks) {
  for (size_t i = 0; i < s->allocation_count; i++) {
    *bytes += s->allocations[i].size;
    *blocks += s->allocations[i].count;
  }
}

/* The live totals of each stack trace, of the allocations of one category (categories NULL:
 * of all). */
static trace_totals *totals_by_trace(const hd_snapshot *s, const uint8_t *categories,
                                     int category) {
  trace_totals *t = calloc(s->stack_trace_count ? s->stack_trace_count : 1, sizeof *t);
  if (t == NULL) return NULL;
  for (size_t i = 0; i < s->stack_trace_count; i++) t[i].oldest = INT64_MAX;
  for (size_t i = 0; i < s->allocation_count; i++) {
    if (categories != NULL && categories[i] != category) continue;
    const hd_snapshot_allocation *a = &s->allocations[i];
    const hd_snapshot_stack_trace *trace = hd_snapshot_find_stack_trace(s, a->stack_trace_key);
    if (trace == NULL) continue; /* the reassembler refuses such snapshots */
    trace_totals *tt = &t[trace - s->stack_traces];
    tt->live_bytes += a->size;
    tt->live_blocks += a->count; /* an element may stand for several blocks (a pprof sample) */
    if (a->timestamp < tt->oldest) tt->oldest = a->timestamp;
  }
  return t;
}

hd_trace_totals *hd_trace_totals_of(const hd_snapshot *s) { return totals_by_trace(s, NULL, -1); }

/* The groups' order under sort (a const hd_report_sort *): heaviest first, ties by live bytes
 * and blocks, then by name. */
static int compare_groups(const void *a, const void *b, void *sort) {
  const group *x = a, *y = b;
  if (x->category != y->category) return x->category < y->category ? -1 : 1;
  switch (*(const hd_report_sort *)sort) {
    case HD_REPORT_SORT_ALLOCATED:
      if (x->allocated_bytes != y->allocated_bytes)
        return x->allocated_bytes > y->allocated_bytes ? -1 : 1;
      break;
    case HD_REPORT_SORT_TEMPORARY:
      if (x->temporary_blocks != y->temporary_blocks)
        return x->temporary_blocks > y->temporary_blocks ? -1 : 1;
      break;
    case HD_REPORT_SORT_PEAK:
      if (x->peak_bytes != y->peak_bytes) return x->peak_bytes > y->peak_bytes ? -1 : 1;
      break;
    case HD_REPORT_SORT_LIVE: break;
  }
  if (x->live_bytes != y->live_bytes) return x->live_bytes > y->live_bytes ? -1 : 1;
  if (x->live_blocks != y->live_blocks) return x->live_blocks > y->live_blocks ? -1 : 1;
  return strcmp(x->name, y->name);
}

/* Groups are few (one per site, stack or thread): a linear lookup by name keeps this simple, and
 * names are computed once per stack trace, not per allocation. */
typedef struct group_list {
  group *items;
  size_t count, capacity;
} group_list;

static group *group_for(group_list *l, const char *name, int category) {
  for (size_t i = 0; i < l->count; i++) {
    if (l->items[i].category == category && strcmp(l->items[i].name, name) == 0) {
      return &l->items[i];
    }
  }
  if (l->count == l->capacity) {
    size_t capacity = l->capacity ? 2 * l->capacity : 64;
    group *items = realloc(l->items, capacity * sizeof *items);
    if (items == NULL) return NULL;
    l->items = items;
    l->capacity = capacity;
  }
  group *g = &l->items[l->count++];
  memset(g, 0, sizeof *g);
  snprintf(g->name, sizeof g->name, "%s", name);
  g->category = category;
  g->oldest = INT64_MAX;
  g->module = "";
  g->heaviest_trace = SIZE_MAX;
  return g;
}

static void add_trace(group *g, const hd_snapshot_stack_trace *trace, size_t index,
                      const trace_totals *tt, bool with_counters) {
  g->live_bytes += tt->live_bytes;
  g->live_blocks += tt->live_blocks;
  if (tt->oldest < g->oldest) g->oldest = tt->oldest;
  if (with_counters && trace->has_counters) {
    g->has_counters = true;
    g->allocated_bytes += trace->allocated_bytes;
    g->allocated_blocks += trace->allocated_blocks;
    g->has_temporary |= trace->has_temporary;
    g->temporary_blocks += trace->temporary_blocks;
    g->peak_bytes += trace->peak_bytes;
    g->peak_blocks += trace->peak_blocks;
  }
  if (g->heaviest_trace == SIZE_MAX || tt->live_bytes > g->heaviest_bytes) {
    g->heaviest_trace = index;
    g->heaviest_bytes = tt->live_bytes;
  }
}

/* The groups of one category's allocations (categories NULL: of all, category -1). */
static HD_MUST_CHECK int add_groups(const hd_snapshot *s, const hd_report_options *o,
                                    const uint8_t *categories, int category, group_list *l,
                                    size_t *trace_group) {
  trace_totals *totals = totals_by_trace(s, categories, category);
  if (totals == NULL) return -ENOMEM;
  int rc = 0;
  if (o->by == HD_REPORT_BY_THREAD) {
    for (size_t i = 0; i < s->allocation_count && rc == 0; i++) {
      if (categories != NULL && categories[i] != category) continue;
      const hd_snapshot_allocation *a = &s->allocations[i];
      const hd_snapshot_thread *t = hd_snapshot_find_thread(s, a->thread_info_key);
      char name[64];
      snprintf(name, sizeof name, "%s[%" PRIu64 "]", t ? t->name : "?", t ? t->koid : 0);
      group *g = group_for(l, name, category);
      if (g == NULL) {
        rc = -ENOMEM;
        break;
      }
      g->live_bytes += a->size;
      g->live_blocks += a->count;
      if (a->timestamp < g->oldest) g->oldest = a->timestamp;
      const hd_snapshot_stack_trace *trace = hd_snapshot_find_stack_trace(s, a->stack_trace_key);
      /* The thread's heaviest stack is the one with the most live bytes overall among its
       * allocations; good enough to point at what the thread keeps alive. */
      if (trace != NULL) {
        size_t index = (size_t)(trace - s->stack_traces);
        if (g->heaviest_trace == SIZE_MAX || totals[index].live_bytes > g->heaviest_bytes) {
          g->heaviest_trace = index;
          g->heaviest_bytes = totals[index].live_bytes;
        }
      }
    }
  } else {
    for (size_t i = 0; i < s->stack_trace_count && rc == 0; i++) {
      const hd_snapshot_stack_trace *trace = &s->stack_traces[i];
      /* Sorted by what was allocated, a site that holds nothing now is as much the answer. */
      const bool counted =
          categories == NULL && (o->sort != HD_REPORT_SORT_LIVE || o->freed_groups_too) &&
          trace->has_counters &&
          (o->sort == HD_REPORT_SORT_PEAK ? trace->peak_blocks > 0 : trace->allocated_blocks > 0);
      if (totals[i].live_blocks == 0 && !counted) continue;
      char name[512], site[480];
      if (o->short_names) {
        hd_site_short_name(o->symbolizer, s, trace, site, sizeof site);
      } else {
        hd_site_name(o->symbolizer, s, trace, site, sizeof site);
      }
      if (o->by == HD_REPORT_BY_STACK) {
        snprintf(name, sizeof name, "%s (stack %" PRIu64 ")", site, trace->key);
      } else {
        snprintf(name, sizeof name, "%s", site);
      }
      group *g = group_for(l, name, category);
      if (g == NULL) {
        rc = -ENOMEM;
        break;
      }
      g->module = hd_site_module(o->symbolizer, s, trace);
      if (trace_group != NULL) trace_group[i] = (size_t)(g - l->items);
      /* A trace's cumulative counters cannot be split by category: a leak report leaves them
       * out. */
      add_trace(g, trace, i, &totals[i], categories == NULL);
    }
  }
  free(totals);
  return rc;
}

static int compare_group_pointers(const void *a, const void *b, void *sort) {
  return compare_groups(*(const group *const *)a, *(const group *const *)b, sort);
}

/* Sorts the groups into the report's order; trace_group's entries (group indices) follow them. */
static HD_MUST_CHECK int sort_groups(group_list *l, hd_report_sort sort, size_t *trace_group,
                                     size_t traces) {
  if (l->count == 0) return 0;
  if (trace_group == NULL) {
    qsort_r(l->items, l->count, sizeof *l->items, compare_groups, &sort);
    return 0;
  }
  const group **order = malloc(l->count * sizeof *order);
  group *sorted = malloc(l->count * sizeof *sorted);
  size_t *moved_to = malloc(l->count * sizeof *moved_to);
  int rc = order == NULL || sorted == NULL || moved_to == NULL ? -ENOMEM : 0;
  if (rc == 0) {
    for (size_t k = 0; k < l->count; k++) order[k] = &l->items[k];
    qsort_r(order, l->count, sizeof *order, compare_group_pointers, &sort);
    for (size_t k = 0; k < l->count; k++) {
      sorted[k] = *order[k];
      moved_to[order[k] - l->items] = k;
    }
    for (size_t t = 0; t < traces; t++) {
      if (trace_group[t] != SIZE_MAX) trace_group[t] = moved_to[trace_group[t]];
    }
    free(l->items);
    l->items = sorted;
    l->capacity = l->count;
    sorted = NULL;
  }
  free(order);
  free(sorted);
  free(moved_to);
  return rc;
}

/* Groups by site, stack or thread; by category first where the snapshot has roots
 * (categories: per allocation, or NULL). trace_group (nullable): which group each trace went to. */
static HD_MUST_CHECK int build_groups(const hd_snapshot *s, const hd_report_options *o,
                                      const uint8_t *categories, group_list *out,
                                      size_t *trace_group) {
  group_list l = {0};
  int rc = 0;
  for (size_t t = 0; trace_group != NULL && t < s->stack_trace_count; t++)
    trace_group[t] = SIZE_MAX;
  if (categories == NULL) {
    rc = add_groups(s, o, NULL, -1, &l, trace_group);
  } else {
    for (int c = 0; c < HD_REACH_CATEGORIES && rc == 0; c++) {
      rc = add_groups(s, o, categories, c, &l, trace_group);
    }
  }
  if (rc == 0) rc = sort_groups(&l, o->sort, trace_group, s->stack_trace_count);
  if (rc != 0) {
    free(l.items);
    return rc;
  }
  *out = l;
  return 0;
}

int hd_report_groups(const hd_snapshot *s, const hd_report_options *o, const uint8_t *categories,
                     hd_report_group **groups, size_t *count, size_t *trace_group) {
  group_list l = {0};
  int rc = build_groups(s, o, categories, &l, trace_group);
  *groups = rc == 0 ? l.items : NULL;
  *count = rc == 0 ? l.count : 0;
  return rc;
}

/* ---- text ---- */

static const char *group_kind(hd_report_by by) {
  switch (by) {
    case HD_REPORT_BY_STACK: return "STACK";
    case HD_REPORT_BY_THREAD: return "THREAD";
    case HD_REPORT_BY_SITE: break;
  }
  return "SITE";
}

/* What a leak check found, per category: from the groups (every allocation is in one). */
typedef struct leak_summary {
  uint64_t bytes[HD_REACH_CATEGORIES], blocks[HD_REACH_CATEGORIES];
  size_t groups[HD_REACH_CATEGORIES];
  size_t blocks_without_contents;
  uint64_t unconfirmed_bytes, unconfirmed_blocks; /* lost in the last scan only */
} leak_summary;

/* "12.3s" ago at now_ns, or "-". */
static void age_text(const group *g, uint64_t now_ns, char *out, size_t size) {
  if (g->oldest == INT64_MAX || g->oldest < 0 || (uint64_t)g->oldest > now_ns) {
    snprintf(out, size, "-");
  } else {
    snprintf(out, size, "%.1fs", (double)(now_ns - (uint64_t)g->oldest) / 1e9);
  }
}

/* The roots the collector could not read (RootRegion.not_read): their bytes and regions. */
static void roots_not_read(const hd_snapshot *s, uint64_t *bytes, size_t *regions) {
  *bytes = 0;
  *regions = 0;
  for (size_t i = 0; i < s->root_count; i++) {
    if (!s->roots[i].not_read) continue;
    *bytes += s->roots[i].size;
    (*regions)++;
  }
}

/* Whether the blocks the process did not record were scanned (roots of kind UNRECORDED). */
static bool scanned_unrecorded_blocks(const hd_snapshot *s) {
  for (size_t i = 0; i < s->root_count; i++) {
    if (s->roots[i].kind == heapdump_client_RootKind_ROOT_KIND_UNRECORDED) return true;
  }
  return false;
}

const char *hd_report_leak_scope_note(const hd_snapshot *s) {
  const bool sampled = s->has_stats && s->stats.has_sample_bytes,
             armed = s->has_stats && s->stats.has_unattributed_bytes;
#define UNRECORDED_SCANNED                                                                        \
  ": the blocks not recorded were scanned as roots, found by glibc's own headers (with the free " \
  "ones it keeps cached), so a lost block that only they point to may be counted as reachable"
#define CONFIRM "; confirm a leak with a run that records every block"
  if ((sampled || armed) && scanned_unrecorded_blocks(s)) {
    return sampled ? "sampled recording" UNRECORDED_SCANNED CONFIRM
                   : "armed process" UNRECORDED_SCANNED;
  }
  if (sampled) {
    return "sampled recording: only the recorded blocks were scanned, so a recorded block that "
           "only unrecorded blocks point to is counted as lost" CONFIRM;
  }
#undef UNRECORDED_SCANNED
#undef CONFIRM
  if (armed) {
    return "armed process: the blocks allocated before it was armed were not scanned, so a "
           "recorded block that only they point to is counted as lost";
  }
  return NULL;
}

static void summarize(const group_list *l, leak_summary *sum) {
  for (size_t i = 0; i < l->count; i++) {
    const group *g = &l->items[i];
    if (g->category < 0) continue;
    sum->bytes[g->category] += g->live_bytes;
    sum->blocks[g->category] += g->live_blocks;
    sum->groups[g->category]++;
  }
}

static const char *const kCategoryTitles[HD_REACH_CATEGORIES] = {
    "DEFINITELY LOST", "INDIRECTLY LOST", "POSSIBLY LOST", "STILL REACHABLE"};

static void print_group_text(FILE *out, const hd_snapshot *s, const hd_report_options *o,
                             const group *g) {
  if (g->heaviest_trace == SIZE_MAX) return;
  const hd_snapshot_stack_trace *trace = &s->stack_traces[g->heaviest_trace];
  size_t first = o->by == HD_REPORT_BY_SITE ? hd_site_frame(o->symbolizer, s, trace) : 0;
  hd_report_frames_text(out, o->symbolizer, s, trace, first, o->max_frames);
}

/* A leak check, as valgrind's: the lost blocks' groups, category by category, then one line for
 * what was reached (its groups too with show_reachable). */
static void write_leaks_text(const hd_snapshot *s, const hd_report_options *o, const group_list *l,
                             const leak_summary *sum, FILE *out) {
  fprintf(out, "leak check: ");
  for (int c = 0; c < HD_REACH_CATEGORIES; c++) {
    fprintf(out, "%s%" PRIu64 " bytes in %" PRIu64 " blocks %s", c ? ", " : "", sum->bytes[c],
            sum->blocks[c], hd_reach_category_name((hd_reach_category)c));
  }
  fputc('\n', out);
  const char *scope = hd_report_leak_scope_note(s);
  if (scope != NULL) fprintf(out, "note: %s\n", scope);
  if (sum->blocks_without_contents > 0) {
    fprintf(out,
            "note: %zu blocks had no contents in the snapshot (over its size limit, or freed "
            "while it was read): what only they point to is counted as lost\n",
            sum->blocks_without_contents);
  }
  uint64_t unread_bytes;
  size_t unread_regions;
  roots_not_read(s, &unread_bytes, &unread_regions);
  if (unread_regions > 0) {
    fprintf(out,
            "warning: %" PRIu64
            " bytes of roots in %zu regions were not read (the snapshot's "
            "contents limit, or more mappings than the collector reads): blocks reachable only "
            "from them are counted as lost, so the verdict is uncertain\n",
            unread_bytes, unread_regions);
  }
  if (s->has_stats && s->stats.mapping_records_lost > 0) {
    fprintf(out,
            "warning: the process could not record %" PRIu64
            " of its allocator's or heapdump's "
            "mappings: some of that memory may have been scanned as the program's, hiding leaks\n",
            s->stats.mapping_records_lost);
  }
  if (sum->unconfirmed_blocks > 0) {
    fprintf(out,
            "note: %" PRIu64 " bytes in %" PRIu64
            " blocks were lost in the last scan only, not "
            "in the one before: not reported (a pointer in flight, or a leak younger than the "
            "interval; the next check tells)\n",
            sum->unconfirmed_bytes, sum->unconfirmed_blocks);
  }
  size_t first = 0;
  for (int c = 0; c < HD_REACH_CATEGORIES; c++) {
    size_t count = sum->groups[c];
    bool details = c <= HD_INDIRECTLY_LOST || o->show_reachable;
    if (count > 0 && details) {
      fprintf(out, "%s\n%14s %12s", kCategoryTitles[c], "BYTES", "BLOCKS");
      if (o->now_ns) fprintf(out, " %10s", "OLDEST");
      fprintf(out, "  %s\n", group_kind(o->by));
      size_t shown = o->top && o->top < count ? o->top : count;
      for (size_t i = first; i < first + shown; i++) {
        const group *g = &l->items[i];
        fprintf(out, "%14" PRIu64 " %12" PRIu64, g->live_bytes, g->live_blocks);
        if (o->now_ns) {
          char age[32];
          age_text(g, o->now_ns, age, sizeof age);
          fprintf(out, " %10s", age);
        }
        fprintf(out, "  %s\n", g->name);
        print_group_text(out, s, o, g);
      }
      if (shown < count) fprintf(out, "... %zu more (use --top 0 for all)\n", count - shown);
    }
    first += count;
  }
  if (!o->show_reachable && (sum->blocks[HD_POSSIBLY_LOST] || sum->blocks[HD_STILL_REACHABLE])) {
    fprintf(out,
            "possibly lost: %" PRIu64 " bytes in %" PRIu64 " blocks; still reachable: %" PRIu64
            " bytes in %" PRIu64 " blocks (--show-reachable lists them)\n",
            sum->bytes[HD_POSSIBLY_LOST], sum->blocks[HD_POSSIBLY_LOST],
            sum->bytes[HD_STILL_REACHABLE], sum->blocks[HD_STILL_REACHABLE]);
  }
}

/* The allocation wrappers the sites skipped (heapdump/tools/sites.h): which functions were not
 * named as sites, and why. */
static void write_alloc_fns_text(const hd_report_options *o, FILE *out) {
  const hd_alloc_fns *fns = o->symbolizer ? hd_symbolizer_alloc_fns(o->symbolizer) : NULL;
  if (fns == NULL || fns->applied_count == 0) return;
  fputs("allocation wrappers taken for the allocator (the sites are their callers):", out);
  const char *separator = " ";
  for (int builtin = 0; builtin < 2; builtin++) {
    size_t shown = 0;
    for (size_t i = 0; i < fns->applied_count; i++) {
      if (fns->applied[i].builtin != (builtin == 1)) continue;
      fprintf(out, "%s%s", shown ? ", " : separator, fns->applied[i].name);
      shown++;
    }
    if (shown == 0) continue;
    fputs(builtin ? " (built in; --no-builtin-alloc-fns makes them sites)" : " (--alloc-fn)", out);
    separator = "; ";
  }
  fputc('\n', out);
}

static void write_alloc_fns_json(const hd_report_options *o, FILE *out) {
  const hd_alloc_fns *fns = o->symbolizer ? hd_symbolizer_alloc_fns(o->symbolizer) : NULL;
  fputs(",\"alloc_fns\":[", out);
  for (size_t i = 0; fns != NULL && i < fns->applied_count; i++) {
    fputs(i ? ",{\"name\":" : "{\"name\":", out);
    hd_json_string(out, fns->applied[i].name);
    fprintf(out, ",\"builtin\":%s}", fns->applied[i].builtin ? "true" : "false");
  }
  fputc(']', out);
}

/* Where the process's resident memory was (ResidentMemory): the allocator's part split into
 * the live blocks as requested, heapdump's tags and the allocator's own. */
static void write_resident_text(const hd_snapshot *s, uint64_t live_bytes, FILE *out) {
  if (!s->has_resident) return;
  const heapdump_client_ResidentMemory *m = &s->resident;
  fprintf(out, "resident %" PRIu64 " bytes: allocator %" PRIu64, m->resident_bytes,
          m->allocator_bytes);
  if (live_bytes <= m->allocator_bytes && m->tag_bytes <= m->allocator_bytes - live_bytes) {
    fprintf(out,
            " (live blocks as requested %" PRIu64 ", heapdump's tags %" PRIu64
            ", the allocator's own %" PRIu64 ")",
            live_bytes, m->tag_bytes, m->allocator_bytes - live_bytes - m->tag_bytes);
  } else {
    /* Pages of a block the program has not touched yet are not resident. */
    fprintf(out,
            " (less than the live blocks as requested, %" PRIu64 ", and heapdump's tags, %" PRIu64
            ": some of their pages were never touched)",
            live_bytes, m->tag_bytes);
  }
  fprintf(out, ", heapdump %" PRIu64 ", other anonymous memory %" PRIu64 ", files %" PRIu64 "\n",
          m->heapdump_bytes, m->other_anonymous_bytes, m->file_bytes);
}

void hd_report_resident_json(const hd_snapshot *s, FILE *out) {
  if (!s->has_resident) return;
  const heapdump_client_ResidentMemory *m = &s->resident;
  fprintf(out,
          ",\"resident\":{\"bytes\":%" PRIu64 ",\"allocator\":%" PRIu64 ",\"heapdump\":%" PRIu64
          ",\"other_anonymous\":%" PRIu64 ",\"files\":%" PRIu64 ",\"tags\":%" PRIu64 "}",
          m->resident_bytes, m->allocator_bytes, m->heapdump_bytes, m->other_anonymous_bytes,
          m->file_bytes, m->tag_bytes);
}

/* The temporary blocks of every trace; false if no trace counted them. */
static bool temporary_total(const hd_snapshot *s, uint64_t *blocks) {
  bool counted = false;
  *blocks = 0;
  for (size_t i = 0; i < s->stack_trace_count; i++) {
    counted |= s->stack_traces[i].has_temporary;
    *blocks += s->stack_traces[i].temporary_blocks;
  }
  return counted;
}

/* How many of the snapshot's stack traces have counts read unsettled (StackTraceCounters). */
static size_t unsettled_traces(const hd_snapshot *s) {
  size_t n = 0;
  for (size_t i = 0; i < s->stack_trace_count; i++) n += s->stack_traces[i].counts_unsettled;
  return n;
}

/* A process's line of totals, what was lost recording it, and its timeline. */
static void write_text_summary(const hd_snapshot *s, const hd_report_options *o, FILE *out) {
  uint64_t live_bytes = 0, live_blocks = 0, temporary = 0;
  live_totals(s, &live_bytes, &live_blocks);
  const bool has_temporary = temporary_total(s, &temporary);
  if (s->pid != 0) {
    fprintf(out, "%s[%" PRIu64 "]: ", s->process_name, s->pid);
  } else if (s->process_name[0]) {
    fprintf(out, "%s: ", s->process_name); /* e.g. read from a profile that does not say */
  }
  fprintf(out, "%" PRIu64 " live blocks, %" PRIu64 " live bytes", live_blocks, live_bytes);
  if (s->has_stats) {
    const heapdump_client_ProcessStats *st = &s->stats;
    fprintf(out, "; since start %" PRIu64 " blocks and %" PRIu64 " bytes allocated",
            st->blocks_allocated, st->bytes_allocated);
    if (has_temporary) fprintf(out, " (%" PRIu64 " blocks temporary)", temporary);
    fprintf(out, ", %" PRIu64 " blocks freed; peak %" PRIu64 " live bytes", st->blocks_freed,
            st->peak_live_bytes);
  }
  fputc('\n', out);
  if (s->has_stats && s->stats.has_sample_bytes) {
    fprintf(out,
            "sampled: one block recorded per %" PRIu64
            " bytes allocated on average, each counted as the blocks it stands for: every "
            "count of blocks and bytes is an estimate\n",
            s->stats.sample_bytes);
  }
  if (s->has_stats && s->stats.has_unattributed_bytes) {
    const bool disarmed = s->stats.has_recording &&
                          s->stats.recording == heapdump_client_RecordingState_RECORDING_DISARMED;
    fprintf(out,
            "armed: the blocks allocated since the process was armed are recorded%s; %" PRIu64
            " more live bytes, allocated before (or while disarmed), are attributed to no site "
            "(glibc's count, headers included): %" PRIu64 " live bytes in all\n",
            disarmed ? " (it is disarmed now: none since)" : "", s->stats.unattributed_bytes,
            live_bytes + s->stats.unattributed_bytes);
  }
  write_resident_text(s, live_bytes, out);
  if (s->has_stats && (s->stats.dropped_allocations || s->stats.dropped_stack_traces ||
                       s->stats.dropped_resources)) {
    fprintf(
        out,
        "warning: the process ran out of recording memory (HEAPDUMP_MAX_MEMORY): %" PRIu64
        " allocations, %" PRIu64 " stack traces and %" PRIu64 " other records were not recorded\n",
        s->stats.dropped_allocations, s->stats.dropped_stack_traces, s->stats.dropped_resources);
  }
  /* A few are usual (allocations of the loader's start-up code); a share worth noting says
   * how many traces may be short or, in code without frame pointers, wrong past such a frame. */
  if (s->has_stats && s->stats.stacks_beyond_cfi > 0 &&
      s->stats.stacks_beyond_cfi >= s->stats.blocks_allocated / 100) {
    fprintf(out,
            "note: %" PRIu64 " of %" PRIu64
            " stacks pass through code without call-frame "
            "information (JIT code, hand-written assembly, modules without .eh_frame_hdr): "
            "unwound there by frame pointers, or cut short\n",
            s->stats.stacks_beyond_cfi, s->stats.blocks_allocated);
  }
  if (s->has_stats && s->stats.unwind_tables_refused > 0) {
    fprintf(out,
            "note: %" PRIu64
            " loaded module(s) had inconsistent unwind tables (.eh_frame_hdr or .eh_frame), "
            "which were not used: stacks through them are unwound by frame pointers, or cut "
            "short\n",
            s->stats.unwind_tables_refused);
  }
  const size_t unsettled = unsettled_traces(s);
  if (unsettled > 0) {
    fprintf(out,
            "warning: the allocation counts of %zu stack trace(s) were read while a thread of "
            "the process stayed inside a change of them (stopped by a debugger or a signal?): "
            "they may be off by that thread's share\n",
            unsettled);
  }
  /* A heap overflow in the program: worth saying every time it is seen. */
  if (s->has_stats && s->stats.writes_past_block_end > 0) {
    fprintf(out,
            "warning: the program wrote past the end of %" PRIu64
            " freed block(s) (heap overflow), which may still show as live if overwritten 5 "
            "bytes or more past their end; run it under AddressSanitizer or valgrind to find "
            "where\n",
            s->stats.writes_past_block_end);
  }
  write_alloc_fns_text(o, out);
  if (s->sample_count > 0) {
    size_t peak = 0;
    for (size_t i = 1; i < s->sample_count; i++) {
      if (s->samples[i].live_bytes > s->samples[peak].live_bytes) peak = i;
    }
    const int64_t start = s->samples[0].timestamp;
    fprintf(
        out,
        "timeline: %zu samples over %.1f s; most live: %" PRIu64
        " bytes at %.1f s (the "
        "HTML report draws it)\n",
        s->sample_count, ((double)s->samples[s->sample_count - 1].timestamp - (double)start) / 1e9,
        s->samples[peak].live_bytes, ((double)s->samples[peak].timestamp - (double)start) / 1e9);
  }
}

/* Sites (or stacks) by what they held at the peak mark. */
static void write_peak_table(const hd_snapshot *s, const hd_report_options *o, const group_list *l,
                             FILE *out) {
  fprintf(out, "%14s %12s %14s %12s  %s\n", "PEAK BYTES", "PEAK BLOCKS", "LIVE BYTES",
          "LIVE BLOCKS", group_kind(o->by));
  size_t shown = o->top && o->top < l->count ? o->top : l->count;
  for (size_t i = 0; i < shown; i++) {
    const group *g = &l->items[i];
    fprintf(out, "%14" PRIu64 " %12" PRIu64 " %14" PRIu64 " %12" PRIu64 "  %s\n", g->peak_bytes,
            g->peak_blocks, g->live_bytes, g->live_blocks, g->name);
    print_group_text(out, s, o, g);
  }
  if (shown < l->count) fprintf(out, "... %zu more (use --top 0 for all)\n", l->count - shown);
}

/* Seconds from the start of the snapshot's timeline (or from its earliest block) to t. */
static double seconds_into(const hd_snapshot *s, int64_t t) {
  int64_t start = s->sample_count > 0 ? s->samples[0].timestamp : t;
  for (size_t i = 0; s->sample_count == 0 && i < s->allocation_count; i++) {
    if (s->allocations[i].timestamp < start) start = s->allocations[i].timestamp;
  }
  return t > start ? ((double)t - (double)start) / 1e9 : 0.0;
}

/* The peak mark's line and, unless the table below is sorted by it, the sites that held the
 * most then. */
static void write_peak_text(const hd_snapshot *s, const hd_report_options *o, FILE *out) {
  if (!s->has_stats || !s->stats.has_peak_mark_time) return;
  const heapdump_client_ProcessStats *st = &s->stats;
  fprintf(out,
          "peak: %" PRIu64 " live bytes in %" PRIu64
          " blocks at %.2f s (marked within 1%% of the highest, %" PRIu64 " bytes)",
          st->peak_mark_bytes, st->peak_mark_blocks, seconds_into(s, st->peak_mark_time),
          st->peak_live_bytes);
  if (o->sort == HD_REPORT_SORT_PEAK || st->peak_mark_blocks == 0) {
    fputc('\n', out);
    return;
  }
  hd_report_options by_peak = *o;
  by_peak.sort = HD_REPORT_SORT_PEAK;
  by_peak.by = HD_REPORT_BY_SITE;
  group_list l = {0};
  if (build_groups(s, &by_peak, NULL, &l, NULL) != 0) {
    fputs("\n", out);
    return;
  }
  /* Lines that do not look like a table's rows: scripts that read the tables above by their
   * columns are not misled by these. */
  fputs("; the sites that held the most then:\n", out);
  for (size_t i = 0; i < l.count && i < PEAK_SITES_SHOWN && l.items[i].peak_bytes > 0; i++) {
    fprintf(out, "  %s: %" PRIu64 " bytes in %" PRIu64 " blocks\n", l.items[i].name,
            l.items[i].peak_bytes, l.items[i].peak_blocks);
  }
  if (l.count > PEAK_SITES_SHOWN && l.items[PEAK_SITES_SHOWN].peak_bytes > 0)
    fputs("  ... (--sort peak lists them all)\n", out);
  free(l.items);
}

/* The table of groups by live bytes (or by what the sort says). */
static void write_groups_text(const hd_snapshot *s, const hd_report_options *o, const group_list *l,
                              FILE *out) {
  if (l->count == 0) return;
  if (o->sort == HD_REPORT_SORT_PEAK) {
    write_peak_table(s, o, l, out);
    return;
  }
  bool by_thread = o->by == HD_REPORT_BY_THREAD;
  fprintf(out, "%14s %12s %14s %12s %12s  %s\n", "LIVE BYTES", "LIVE BLOCKS",
          by_thread ? "" : "ALLOC BYTES", by_thread ? "" : "ALLOC BLOCKS",
          by_thread ? "" : "TEMPORARY", group_kind(o->by));
  size_t shown = o->top && o->top < l->count ? o->top : l->count;
  for (size_t i = 0; i < shown; i++) {
    const group *g = &l->items[i];
    char ab[32] = "-", an[32] = "-", tn[32] = "-";
    if (g->has_counters) {
      snprintf(ab, sizeof ab, "%" PRIu64, g->allocated_bytes);
      snprintf(an, sizeof an, "%" PRIu64, g->allocated_blocks);
      if (g->has_temporary) snprintf(tn, sizeof tn, "%" PRIu64, g->temporary_blocks);
    } else if (by_thread) {
      ab[0] = an[0] = tn[0] = '\0';
    }
    fprintf(out, "%14" PRIu64 " %12" PRIu64 " %14s %12s %12s  %s\n", g->live_bytes, g->live_blocks,
            ab, an, tn, g->name);
    print_group_text(out, s, o, g);
  }
  if (shown < l->count) fprintf(out, "... %zu more (use --top 0 for all)\n", l->count - shown);
}

/* The summary, then what is live (or lost), then what was live at the peak: a table sorted by
 * the peak comes under its line. */
static void write_text(const hd_snapshot *s, const hd_report_options *o, const group_list *l,
                       const leak_summary *leaks, FILE *out) {
  write_text_summary(s, o, out);
  if (o->sort == HD_REPORT_SORT_PEAK) write_peak_text(s, o, out);
  if (leaks != NULL) {
    write_leaks_text(s, o, l, leaks, out);
  } else {
    write_groups_text(s, o, l, out);
  }
  if (o->sort != HD_REPORT_SORT_PEAK) write_peak_text(s, o, out);
}

/* ---- JSON ---- */

size_t hd_utf8_sequence(const unsigned char *s) {
  if (s[0] < 0x80) return 1;
  const size_t n = s[0] >= 0xf0 && s[0] <= 0xf4 ? 4 : s[0] >= 0xe0 ? 3 : s[0] >= 0xc2 ? 2 : 0;
  if (n == 0 || (n == 3 && s[0] > 0xef)) return 0;
  for (size_t i = 1; i < n; i++) {
    if ((s[i] & 0xc0) != 0x80) return 0; /* a NUL ends the check before any read past it */
  }
  if ((s[0] == 0xe0 && s[1] < 0xa0) || (s[0] == 0xed && s[1] > 0x9f) ||
      (s[0] == 0xf0 && s[1] < 0x90) || (s[0] == 0xf4 && s[1] > 0x8f)) {
    return 0; /* overlong, a surrogate, or past U+10FFFF */
  }
  return n;
}

/* Names come from the programs (process, thread and snapshot names, symbols): bytes that are not
 * UTF-8 are replaced, since a JSON reader refuses the whole document over one of them. */
static void json_string(FILE *out, const char *s, bool markup) {
  fputc('"', out);
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p;) {
    const size_t n = hd_utf8_sequence(p);
    if (n == 0) {
      fputs(HD_UTF8_REPLACEMENT, out);
      p++;
      continue;
    }
    if (*p == '"' || *p == '\\') {
      fprintf(out, "\\%c", *p);
    } else if (*p < 0x20 || *p == 0x7f || (markup && (*p == '<' || *p == '>' || *p == '&'))) {
      fprintf(out, "\\u%04x", *p);
    } else {
      fwrite(p, 1, n, out);
    }
    p += n;
  }
  fputc('"', out);
}

void hd_json_string(FILE *out, const char *s) { json_string(out, s, false); }

void hd_json_string_in_html(FILE *out, const char *s) { json_string(out, s, true); }

void hd_report_frames_json(FILE *out, hd_symbolizer *sym, const hd_snapshot *s,
                           const hd_snapshot_stack_trace *trace, size_t first, size_t max_frames) {
  fputs("[", out);
  bool comma = false;
  size_t shown = 0;
  for (size_t i = first; i < trace->count && (max_frames == 0 || shown < max_frames);
       i++, shown++) {
    hd_location_info loc;
    uint64_t address = trace->addresses[i];
    hd_locate(sym, s, address, true, &loc);
    size_t n = loc.frame_count ? loc.frame_count : 1;
    for (size_t f = 0; f < n; f++) {
      const hd_source_frame *fr = loc.frame_count ? &loc.frames[f] : NULL;
      fprintf(out, "%s{\"address\":\"0x%" PRIx64 "\",\"module\":", comma ? "," : "", address);
      hd_json_string(out, loc.module);
      fprintf(out, ",\"module_offset\":\"0x%" PRIx64 "\",\"function\":", loc.module_offset);
      if (fr && fr->function) {
        hd_json_string(out, hd_demangle(fr->function));
      } else {
        fputs("null", out);
      }
      fputs(",\"file\":", out);
      if (fr && fr->file) {
        hd_json_string(out, fr->file);
      } else {
        fputs("null", out);
      }
      fprintf(out, ",\"line\":%" PRIu32 ",\"inlined\":%s}", fr ? fr->line : 0,
              f + 1 < n ? "true" : "false");
      comma = true;
    }
  }
  fputs("]", out);
}

static void write_json(const hd_snapshot *s, const hd_report_options *o, const group_list *l,
                       const leak_summary *leaks, FILE *out) {
  uint64_t live_bytes = 0, live_blocks = 0, temporary = 0;
  live_totals(s, &live_bytes, &live_blocks);
  const bool has_temporary = temporary_total(s, &temporary);
  const bool with_peak = hd_snapshot_has_peak(s);
  fputs("{\"process_name\":", out);
  hd_json_string(out, s->process_name);
  fprintf(out, ",\"pid\":%" PRIu64 ",\"live_blocks\":%" PRIu64 ",\"live_bytes\":%" PRIu64, s->pid,
          live_blocks, live_bytes);
  const size_t unsettled = unsettled_traces(s);
  if (unsettled > 0) fprintf(out, ",\"unsettled_traces\":%zu", unsettled);
  if (s->has_stats) {
    const heapdump_client_ProcessStats *st = &s->stats;
    fprintf(out,
            ",\"stats\":{\"blocks_allocated\":%" PRIu64 ",\"bytes_allocated\":%" PRIu64
            ",\"blocks_freed\":%" PRIu64 ",\"bytes_freed\":%" PRIu64 ",\"peak_live_bytes\":%" PRIu64
            ",\"dropped_allocations\":%" PRIu64 ",\"dropped_stack_traces\":%" PRIu64
            ",\"dropped_resources\":%" PRIu64 ",\"stacks_beyond_cfi\":%" PRIu64
            ",\"writes_past_block_end\":%" PRIu64 ",\"mapping_records_lost\":%" PRIu64
            ",\"unwind_tables_refused\":%" PRIu64,
            st->blocks_allocated, st->bytes_allocated, st->blocks_freed, st->bytes_freed,
            st->peak_live_bytes, st->dropped_allocations, st->dropped_stack_traces,
            st->dropped_resources, st->stacks_beyond_cfi, st->writes_past_block_end,
            st->mapping_records_lost, st->unwind_tables_refused);
    if (has_temporary) fprintf(out, ",\"temporary_blocks\":%" PRIu64, temporary);
    if (st->has_sample_bytes) fprintf(out, ",\"sample_bytes\":%" PRIu64, st->sample_bytes);
    if (st->has_unattributed_bytes) {
      const bool disarmed =
          st->has_recording && st->recording == heapdump_client_RecordingState_RECORDING_DISARMED;
      fprintf(out, ",\"recording\":\"%s\",\"unattributed_bytes\":%" PRIu64,
              disarmed ? "disarmed" : "armed", st->unattributed_bytes);
    }
    if (st->has_peak_mark_time) {
      fprintf(out, ",\"peak_mark\":{\"at_s\":%.3f,\"bytes\":%" PRIu64 ",\"blocks\":%" PRIu64 "}",
              seconds_into(s, st->peak_mark_time), st->peak_mark_bytes, st->peak_mark_blocks);
    }
    fputc('}', out);
  }
  hd_report_resident_json(s, out);
  if (leaks != NULL) {
    fputs(",\"leak_summary\":{", out);
    for (int c = 0; c < HD_REACH_CATEGORIES; c++) {
      fprintf(out, "%s\"%s\":{\"bytes\":%" PRIu64 ",\"blocks\":%" PRIu64 "}", c ? "," : "",
              hd_reach_category_name((hd_reach_category)c), leaks->bytes[c], leaks->blocks[c]);
    }
    fprintf(out, ",\"unconfirmed\":{\"bytes\":%" PRIu64 ",\"blocks\":%" PRIu64 "}",
            leaks->unconfirmed_bytes, leaks->unconfirmed_blocks);
    uint64_t unread_bytes;
    size_t unread_regions;
    roots_not_read(s, &unread_bytes, &unread_regions);
    fprintf(out, ",\"blocks_without_contents\":%zu", leaks->blocks_without_contents);
    fprintf(out, ",\"roots_not_read\":{\"bytes\":%" PRIu64 ",\"regions\":%zu}", unread_bytes,
            unread_regions);
    const char *scope = hd_report_leak_scope_note(s);
    if (scope != NULL) fprintf(out, ",\"scope_note\":\"%s\"", scope); /* nothing to escape */
    fputc('}', out);
  }
  write_alloc_fns_json(o, out);
  fprintf(out, ",\"by\":\"%s\",\"sort\":\"%s\",\"groups\":[",
          o->by == HD_REPORT_BY_SITE    ? "site"
          : o->by == HD_REPORT_BY_STACK ? "stack"
                                        : "thread",
          hd_report_sort_name(o->sort));
  size_t shown = o->top && o->top < l->count ? o->top : l->count;
  for (size_t i = 0; i < shown; i++) {
    const group *g = &l->items[i];
    fputs(i ? ",{\"name\":" : "{\"name\":", out);
    hd_json_string(out, g->name);
    if (g->category >= 0) {
      fprintf(out, ",\"category\":\"%s\"", hd_reach_category_name((hd_reach_category)g->category));
    }
    fputs(",\"module\":", out);
    hd_json_string(out, g->module);
    fprintf(out, ",\"live_bytes\":%" PRIu64 ",\"live_blocks\":%" PRIu64, g->live_bytes,
            g->live_blocks);
    if (o->now_ns && g->oldest != INT64_MAX && g->oldest >= 0 && (uint64_t)g->oldest <= o->now_ns) {
      fprintf(out, ",\"oldest_age_s\":%.3f", (double)(o->now_ns - (uint64_t)g->oldest) / 1e9);
    }
    if (g->has_counters) {
      fprintf(out, ",\"allocated_bytes\":%" PRIu64 ",\"allocated_blocks\":%" PRIu64,
              g->allocated_bytes, g->allocated_blocks);
      if (g->has_temporary) fprintf(out, ",\"temporary_blocks\":%" PRIu64, g->temporary_blocks);
      if (with_peak) {
        fprintf(out, ",\"peak_bytes\":%" PRIu64 ",\"peak_blocks\":%" PRIu64, g->peak_bytes,
                g->peak_blocks);
      }
    }
    fputs(",\"frames\":", out);
    if (g->heaviest_trace != SIZE_MAX) {
      const hd_snapshot_stack_trace *trace = &s->stack_traces[g->heaviest_trace];
      size_t first = o->by == HD_REPORT_BY_SITE ? hd_site_frame(o->symbolizer, s, trace) : 0;
      hd_report_frames_json(out, o->symbolizer, s, trace, first, o->max_frames);
      /* The frames the walk recorded, and whether the limit cut it (the root is missing). */
      fprintf(out, ",\"trace_frames\":%zu,\"truncated\":%s", trace->count,
              trace->truncated ? "true" : "false");
    } else {
      fputs("[],\"trace_frames\":0,\"truncated\":false", out);
    }
    fputs("}", out);
  }
  fprintf(out, "],\"groups_total\":%zu}", l->count);
}

const char *hd_report_sort_name(hd_report_sort sort) {
  switch (sort) {
    case HD_REPORT_SORT_ALLOCATED: return "allocated";
    case HD_REPORT_SORT_TEMPORARY: return "temporary";
    case HD_REPORT_SORT_PEAK: return "peak";
    case HD_REPORT_SORT_LIVE: break;
  }
  return "live";
}

int hd_report_write(const hd_reassembler *r, const hd_report_options *o, FILE *out, char *error,
                    size_t error_size) {
  if (o->sort != HD_REPORT_SORT_LIVE && o->by == HD_REPORT_BY_THREAD) {
    return hd_tool_fail(error, error_size, -EINVAL,
                        "--sort %s needs --by site or stack: what a stack allocated is not kept "
                        "per thread",
                        hd_report_sort_name(o->sort));
  }
  errno = 0;
  if (o->json) fputs("{\"processes\":[", out);
  for (size_t i = 0; i < r->snapshot_count; i++) {
    const hd_snapshot *s = r->snapshots[i];
    /* A snapshot with roots gets its leak check, unless the caller did it. */
    const uint8_t *categories = o->categories != NULL ? o->categories[i] : NULL;
    uint8_t *classified = NULL;
    leak_summary leaks = {0};
    if (categories != NULL) {
      for (size_t k = 0; k < s->allocation_count; k++) {
        if (categories[k] >= HD_REACH_CATEGORIES) {
          leaks.unconfirmed_bytes += s->allocations[k].size;
          leaks.unconfirmed_blocks += s->allocations[k].count;
        }
      }
    } else if (o->sort == HD_REPORT_SORT_LIVE && hd_reach_possible(s)) {
      /* Sorted by what was allocated, the report answers what churns, not what leaks: the
       * counters cannot be split by leak category. */
      classified = malloc(s->allocation_count ? s->allocation_count : 1);
      if (classified == NULL ||
          hd_reach_classify(s, classified, &leaks.blocks_without_contents) != 0) {
        free(classified);
        return hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
      }
      categories = classified;
    }
    uint64_t temporary;
    if (o->sort == HD_REPORT_SORT_TEMPORARY && !temporary_total(s, &temporary)) {
      free(classified);
      return hd_tool_fail(error, error_size, -EINVAL,
                          "--sort temporary: %s[%" PRIu64
                          "] has no count of temporary allocations (a pprof profile, or a file "
                          "from an older heapdump, keeps none)",
                          s->process_name, s->pid);
    }
    if (o->sort == HD_REPORT_SORT_PEAK && !hd_snapshot_has_peak(s)) {
      free(classified);
      return hd_tool_fail(error, error_size, -EINVAL,
                          "--sort peak: %s[%" PRIu64
                          "] says nothing of its peak (a file from an older heapdump, or a "
                          "snapshot read while the process marked a new peak)",
                          s->process_name, s->pid);
    }
    group_list l = {0};
    int rc = build_groups(s, o, categories, &l, NULL);
    const leak_summary *with_leaks = categories != NULL ? &leaks : NULL;
    free(classified);
    if (rc != 0) return hd_tool_fail(error, error_size, rc, "out of memory");
    if (with_leaks != NULL) summarize(&l, &leaks);
    if (o->json) {
      if (i) fputc(',', out);
      write_json(s, o, &l, with_leaks, out);
    } else {
      if (i) fputc('\n', out);
      write_text(s, o, &l, with_leaks, out);
    }
    free(l.items);
  }
  if (o->json) fputs("]}\n", out);
  if (fflush(out) != 0 || ferror(out)) {
    int err = errno ? errno : EIO;
    return hd_tool_fail(error, error_size, -err, "cannot write the report: %s", strerror(err));
  }
  return 0;
}
