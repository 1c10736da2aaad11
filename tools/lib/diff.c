/* heapdump diff (see diff.h). Each process pair is compared stack by stack first: a stack of the
 * newer side and one of the base are the same when their frames are at the same module offsets,
 * found through a hash of the frames and confirmed frame by frame. Sites (or stacks) then sum
 * their stacks' changes, as the report's groups sum their live totals. */
#include "heapdump/tools/diff.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/tools/sites.h"
#include "heapdump/tools/util.h"

enum { BASE = 0, NEXT = 1, SIDES = 2 };

/* What one stack trace of one side holds and how it changed. */
typedef struct side_trace {
  bool used; /* live blocks, or counters: it takes part */
  uint64_t live_bytes, live_blocks;
  /* Blocks matched one by one: on the newer side the blocks the base did not have (added), on
   * the base side those gone from the newer one (removed). */
  uint64_t changed_bytes, changed_blocks;
  uint64_t stack_hash;
  size_t same_hash; /* next trace of this side with the same stack_hash, or SIZE_MAX */
  size_t peer;      /* the same stack on the other side, or SIZE_MAX */
  size_t group;
} side_trace;

typedef struct diff_group {
  char name[512];
  const char *module;
  uint64_t live_bytes[SIDES], live_blocks[SIDES];
  uint64_t added_bytes, added_blocks, removed_bytes, removed_blocks;
  bool has_counters[SIDES];
  uint64_t allocated_bytes[SIDES], allocated_blocks[SIDES];
  /* The stack whose frames are shown: the one that changed most. */
  int shown_side;
  size_t shown_trace;
  uint64_t shown_weight;
  size_t same_hash; /* next group with the same name hash, or SIZE_MAX */
  bool changed;
} diff_group;

typedef struct process_pair {
  const hd_snapshot *side[SIDES];
  side_trace *traces[SIDES];
  bool blocks_matched; /* both sides record blocks one by one */
  uint64_t live_bytes[SIDES], live_blocks[SIDES];
  diff_group *groups;
  size_t group_count, group_capacity, changed_count;
  hd_u64_map group_by_hash;
} process_pair;

struct hd_diff {
  hd_symbolizer *symbolizer;
  hd_report_by by;
  process_pair *pairs;
  size_t pair_count;
  /* For the pprof writer: the snapshots of both sides, and which pair and side each is. */
  hd_reassembler profile;
  size_t *profile_pair;
  int *profile_side;
};

/* The side of a process that one snapshot lacks: nothing live, no stacks. */
static const hd_snapshot kNoProcess;

static int64_t delta(uint64_t before, uint64_t after) { return (int64_t)(after - before); }

/* Where frame i of trace is, as a stack's identity across address spaces: its module and offset
 * (the address itself where no region holds it). */
static void frame_identity(const hd_snapshot *s, const hd_snapshot_stack_trace *trace, size_t i,
                           const char **module, uint64_t *offset) {
  hd_location_info loc;
  hd_locate(NULL, s, trace->addresses[i], true, &loc);
  *module = loc.region != NULL ? loc.module : "";
  *offset = loc.region != NULL ? loc.module_offset : trace->addresses[i];
}

static uint64_t stack_hash(const hd_snapshot *s, const hd_snapshot_stack_trace *trace) {
  uint64_t h = hd_fnv1a(HD_FNV1A_BASIS, &trace->count, sizeof trace->count);
  h = hd_fnv1a(h, &trace->truncated, sizeof trace->truncated);
  for (size_t i = 0; i < trace->count; i++) {
    const char *module;
    uint64_t offset;
    frame_identity(s, trace, i, &module, &offset);
    h = hd_fnv1a(h, module, strlen(module) + 1);
    h = hd_fnv1a(h, &offset, sizeof offset);
  }
  return h;
}

static bool same_stack(const hd_snapshot *a, const hd_snapshot_stack_trace *ta,
                       const hd_snapshot *b, const hd_snapshot_stack_trace *tb) {
  if (ta->count != tb->count || ta->truncated != tb->truncated) return false;
  for (size_t i = 0; i < ta->count; i++) {
    const char *ma, *mb;
    uint64_t oa, ob;
    frame_identity(a, ta, i, &ma, &oa);
    frame_identity(b, tb, i, &mb, &ob);
    if (oa != ob || strcmp(ma, mb) != 0) return false;
  }
  return true;
}

/* Blocks can be matched one by one only if every allocation element is one block at its real
 * address (a pprof profile without tags has one element per stack, at a stand-in address with
 * the top bit set); in a sampled snapshot an element of count k is one recorded block. */
static bool records_blocks(const hd_snapshot *s) {
  const bool sampled = s->has_stats && s->stats.has_sample_bytes;
  for (size_t i = 0; i < s->allocation_count; i++) {
    if ((s->allocations[i].count != 1 && !sampled) || (s->allocations[i].address >> 63) != 0)
      return false;
  }
  return true;
}

/* The same block on the other side: same address, allocated at the same moment, same size. */
static bool block_on(const hd_snapshot *other, const hd_snapshot_allocation *a) {
  const hd_snapshot_allocation *b = hd_snapshot_find_allocation(other, a->address);
  return b != NULL && b->timestamp == a->timestamp && b->size == a->size;
}

static HD_MUST_CHECK int add_side_totals(process_pair *p, int side) {
  const hd_snapshot *s = p->side[side];
  const hd_snapshot *other = p->side[side ^ 1];
  side_trace *traces = calloc(s->stack_trace_count ? s->stack_trace_count : 1, sizeof *traces);
  if (traces == NULL) return -ENOMEM;
  p->traces[side] = traces;
  for (size_t i = 0; i < s->allocation_count; i++) {
    const hd_snapshot_allocation *a = &s->allocations[i];
    p->live_bytes[side] += a->size;
    p->live_blocks[side] += a->count;
    const hd_snapshot_stack_trace *trace = hd_snapshot_find_stack_trace(s, a->stack_trace_key);
    if (trace == NULL) continue; /* the reassembler refuses such snapshots */
    side_trace *st = &traces[trace - s->stack_traces];
    st->used = true;
    st->live_bytes += a->size;
    st->live_blocks += a->count;
    if (p->blocks_matched && !block_on(other, a)) {
      st->changed_bytes += a->size;
      st->changed_blocks += a->count;
    }
  }
  for (size_t t = 0; t < s->stack_trace_count; t++) {
    const hd_snapshot_stack_trace *trace = &s->stack_traces[t];
    if (trace->has_counters && (trace->allocated_blocks != 0 || trace->allocated_bytes != 0)) {
      traces[t].used = true;
    }
    traces[t].same_hash = traces[t].peer = traces[t].group = SIZE_MAX;
    if (traces[t].used) traces[t].stack_hash = stack_hash(s, trace);
  }
  return 0;
}

/* Pairs each used base stack with the same stack of the newer side. */
static HD_MUST_CHECK int match_stacks(process_pair *p) {
  const hd_snapshot *next = p->side[NEXT], *base = p->side[BASE];
  hd_u64_map first_by_hash = {0};
  for (size_t t = 0; t < next->stack_trace_count; t++) {
    side_trace *st = &p->traces[NEXT][t];
    if (!st->used) continue;
    size_t first;
    if (hd_u64_map_find(&first_by_hash, st->stack_hash, &first)) {
      st->same_hash = p->traces[NEXT][first].same_hash;
      p->traces[NEXT][first].same_hash = t;
    } else if (!hd_u64_map_put(&first_by_hash, st->stack_hash, t)) {
      hd_u64_map_free(&first_by_hash);
      return -ENOMEM;
    }
  }
  for (size_t t = 0; t < base->stack_trace_count; t++) {
    side_trace *st = &p->traces[BASE][t];
    size_t n;
    if (!st->used || !hd_u64_map_find(&first_by_hash, st->stack_hash, &n)) continue;
    for (; n != SIZE_MAX; n = p->traces[NEXT][n].same_hash) {
      if (p->traces[NEXT][n].peer == SIZE_MAX &&
          same_stack(base, &base->stack_traces[t], next, &next->stack_traces[n])) {
        st->peer = n;
        p->traces[NEXT][n].peer = t;
        break;
      }
    }
  }
  hd_u64_map_free(&first_by_hash);
  return 0;
}

static diff_group *group_named(process_pair *p, const char *name, size_t *index) {
  uint64_t h = hd_fnv1a(HD_FNV1A_BASIS, name, strlen(name));
  size_t i;
  bool known = hd_u64_map_find(&p->group_by_hash, h, &i);
  for (size_t g = known ? i : SIZE_MAX; g != SIZE_MAX; g = p->groups[g].same_hash) {
    if (strcmp(p->groups[g].name, name) == 0) {
      *index = g;
      return &p->groups[g];
    }
  }
  if (!HD_RESERVE(p->groups, p->group_count, p->group_capacity)) return NULL;
  size_t g = p->group_count++;
  diff_group *group = &p->groups[g];
  memset(group, 0, sizeof *group);
  snprintf(group->name, sizeof group->name, "%s", name);
  group->module = "";
  group->shown_trace = SIZE_MAX;
  group->same_hash = SIZE_MAX;
  if (known) {
    group->same_hash = p->groups[i].same_hash;
    p->groups[i].same_hash = g;
  } else if (!hd_u64_map_put(&p->group_by_hash, h, g)) {
    return NULL;
  }
  *index = g;
  return group;
}

static void add_to_group(process_pair *p, diff_group *g, int side, size_t t) {
  const hd_snapshot_stack_trace *trace = &p->side[side]->stack_traces[t];
  const side_trace *st = &p->traces[side][t];
  g->live_bytes[side] += st->live_bytes;
  g->live_blocks[side] += st->live_blocks;
  if (side == NEXT) {
    g->added_bytes += st->changed_bytes;
    g->added_blocks += st->changed_blocks;
  } else {
    g->removed_bytes += st->changed_bytes;
    g->removed_blocks += st->changed_blocks;
  }
  if (trace->has_counters) {
    g->has_counters[side] = true;
    g->allocated_bytes[side] += trace->allocated_bytes;
    g->allocated_blocks[side] += trace->allocated_blocks;
  }
  uint64_t weight = p->blocks_matched ? st->changed_bytes : st->live_bytes;
  if (g->shown_trace == SIZE_MAX || weight > g->shown_weight) {
    g->shown_side = side;
    g->shown_trace = t;
    g->shown_weight = weight;
  }
}

static HD_MUST_CHECK int build_groups(const hd_diff *d, process_pair *p) {
  for (int side = NEXT; side >= BASE; side--) {
    const hd_snapshot *s = p->side[side];
    for (size_t t = 0; t < s->stack_trace_count; t++) {
      side_trace *st = &p->traces[side][t];
      if (!st->used) continue;
      const hd_snapshot_stack_trace *trace = &s->stack_traces[t];
      size_t g;
      if (side == BASE && d->by == HD_REPORT_BY_STACK && st->peer != SIZE_MAX) {
        g = p->traces[NEXT][st->peer].group; /* the same stack: the newer side named it */
      } else {
        char site[480], name[512];
        hd_site_name(d->symbolizer, s, trace, site, sizeof site);
        if (d->by == HD_REPORT_BY_STACK) {
          snprintf(name, sizeof name, "%s (%sstack %" PRIu64 ")", site, side == BASE ? "base " : "",
                   trace->key);
        } else {
          snprintf(name, sizeof name, "%s", site);
        }
        diff_group *group = group_named(p, name, &g);
        if (group == NULL) return -ENOMEM;
        group->module = hd_site_module(d->symbolizer, s, trace);
      }
      st->group = g;
      add_to_group(p, &p->groups[g], side, t);
    }
  }
  for (size_t i = 0; i < p->group_count; i++) {
    diff_group *g = &p->groups[i];
    if (!p->blocks_matched) { /* only totals: the net change is all there is to tell */
      hd_diff_change net = {.delta_bytes = delta(g->live_bytes[BASE], g->live_bytes[NEXT]),
                            .delta_blocks = delta(g->live_blocks[BASE], g->live_blocks[NEXT])};
      hd_diff_net_split(&net);
      g->added_bytes = net.added_bytes;
      g->removed_bytes = net.removed_bytes;
      g->added_blocks = net.added_blocks;
      g->removed_blocks = net.removed_blocks;
    }
    bool allocated =
        g->has_counters[NEXT] && (g->allocated_bytes[NEXT] != g->allocated_bytes[BASE] ||
                                  g->allocated_blocks[NEXT] != g->allocated_blocks[BASE]);
    g->changed =
        g->added_bytes || g->added_blocks || g->removed_bytes || g->removed_blocks || allocated;
  }
  return 0;
}

/* Changed groups first, by net growth in bytes, then blocks, then what was added. */
static int compare_groups(const void *a, const void *b) {
  const diff_group *x = a, *y = b;
  if (x->changed != y->changed) return x->changed ? -1 : 1;
  int64_t bx = delta(x->live_bytes[BASE], x->live_bytes[NEXT]);
  int64_t by = delta(y->live_bytes[BASE], y->live_bytes[NEXT]);
  if (bx != by) return bx > by ? -1 : 1;
  int64_t nx = delta(x->live_blocks[BASE], x->live_blocks[NEXT]);
  int64_t ny = delta(y->live_blocks[BASE], y->live_blocks[NEXT]);
  if (nx != ny) return nx > ny ? -1 : 1;
  if (x->added_bytes != y->added_bytes) return x->added_bytes > y->added_bytes ? -1 : 1;
  return strcmp(x->name, y->name);
}

static int compare_pair(hd_diff *d, process_pair *p) {
  p->blocks_matched = records_blocks(p->side[BASE]) && records_blocks(p->side[NEXT]);
  int rc;
  if ((rc = add_side_totals(p, BASE)) != 0 || (rc = add_side_totals(p, NEXT)) != 0 ||
      (rc = match_stacks(p)) != 0 || (rc = build_groups(d, p)) != 0) {
    return rc;
  }
  /* Sorting moves groups: the stacks' group indices are not needed past this point. */
  if (p->group_count > 0) qsort(p->groups, p->group_count, sizeof *p->groups, compare_groups);
  while (p->changed_count < p->group_count && p->groups[p->changed_count].changed) {
    p->changed_count++;
  }
  return 0;
}

static bool add_pair(hd_diff *d, const hd_snapshot *base, const hd_snapshot *next) {
  process_pair *pairs = realloc(d->pairs, (d->pair_count + 1) * sizeof *pairs);
  if (pairs == NULL) return false;
  d->pairs = pairs;
  process_pair *p = &d->pairs[d->pair_count++];
  memset(p, 0, sizeof *p);
  p->side[BASE] = base != NULL ? base : &kNoProcess;
  p->side[NEXT] = next != NULL ? next : &kNoProcess;
  return true;
}

/* A single process on each side is one pair whatever the pids; otherwise pids pair them. */
static bool pair_processes(hd_diff *d, const hd_reassembler *base, const hd_reassembler *next) {
  if (base->snapshot_count == 1 && next->snapshot_count == 1) {
    return add_pair(d, base->snapshots[0], next->snapshots[0]);
  }
  bool *paired = calloc(base->snapshot_count + 1, sizeof *paired);
  if (paired == NULL) return false;
  bool ok = true;
  for (size_t n = 0; n < next->snapshot_count && ok; n++) {
    const hd_snapshot *match = NULL;
    for (size_t b = 0; b < base->snapshot_count && match == NULL; b++) {
      if (!paired[b] && base->snapshots[b]->pid == next->snapshots[n]->pid) {
        paired[b] = true;
        match = base->snapshots[b];
      }
    }
    ok = add_pair(d, match, next->snapshots[n]);
  }
  for (size_t b = 0; b < base->snapshot_count && ok; b++) {
    if (!paired[b]) ok = add_pair(d, base->snapshots[b], NULL);
  }
  free(paired);
  return ok;
}

static bool add_profile_snapshot(hd_diff *d, size_t pair, int side) {
  const hd_snapshot *s = d->pairs[pair].side[side];
  if (s == &kNoProcess) return true;
  size_t n = d->profile.snapshot_count;
  hd_snapshot **snapshots = realloc(d->profile.snapshots, (n + 1) * sizeof *snapshots);
  size_t *pairs = realloc(d->profile_pair, (n + 1) * sizeof *pairs);
  if (snapshots != NULL) d->profile.snapshots = snapshots;
  if (pairs != NULL) d->profile_pair = pairs;
  int *sides = realloc(d->profile_side, (n + 1) * sizeof *sides);
  if (sides != NULL) d->profile_side = sides;
  if (snapshots == NULL || pairs == NULL || sides == NULL) return false;
  /* The writer only reads them; the snapshots stay the callers'. */
  d->profile.snapshots[n] = (hd_snapshot *)s;
  d->profile_pair[n] = pair;
  d->profile_side[n] = side;
  d->profile.snapshot_count = n + 1;
  return true;
}

int hd_diff_create(const hd_reassembler *base, const hd_reassembler *next,
                   hd_symbolizer *symbolizer, hd_report_by by, hd_diff **out, char *error,
                   size_t error_size) {
  *out = NULL;
  if (by == HD_REPORT_BY_THREAD) {
    return hd_tool_fail(error, error_size, -EINVAL,
                        "a diff groups by site or stack: the threads of two snapshots do not pair "
                        "up");
  }
  hd_diff *d = calloc(1, sizeof *d);
  if (d == NULL) return hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
  d->symbolizer = symbolizer;
  d->by = by;
  hd_reassembler_init(&d->profile);
  bool ok = pair_processes(d, base, next);
  for (size_t i = 0; ok && i < d->pair_count; i++) ok = compare_pair(d, &d->pairs[i]) == 0;
  for (int side = NEXT; side >= BASE; side--) {
    for (size_t i = 0; ok && i < d->pair_count; i++) ok = add_profile_snapshot(d, i, side);
  }
  if (!ok) {
    hd_diff_destroy(d);
    return hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
  }
  *out = d;
  return 0;
}

void hd_diff_destroy(hd_diff *d) {
  if (d == NULL) return;
  for (size_t i = 0; i < d->pair_count; i++) {
    free(d->pairs[i].traces[BASE]);
    free(d->pairs[i].traces[NEXT]);
    free(d->pairs[i].groups);
    hd_u64_map_free(&d->pairs[i].group_by_hash);
  }
  free(d->pairs);
  free(d->profile.snapshots); /* pointers only: not hd_reassembler_destroy */
  free(d->profile_pair);
  free(d->profile_side);
  free(d);
}

/* ---- report ---- */

static const char *process_label(const hd_snapshot *s, char *out, size_t size) {
  if (s == &kNoProcess) {
    snprintf(out, size, "(none)");
  } else if (s->pid != 0) {
    snprintf(out, size, "%s[%" PRIu64 "]", s->process_name, s->pid);
  } else {
    snprintf(out, size, "%s", s->process_name[0] ? s->process_name : "(process)");
  }
  return out;
}

static size_t first_frame(const hd_diff *d, const hd_snapshot *s,
                          const hd_snapshot_stack_trace *trace) {
  return d->by == HD_REPORT_BY_SITE ? hd_site_frame(d->symbolizer, s, trace) : 0;
}

static void write_pair_text(const hd_diff *d, const process_pair *p, size_t top, size_t max_frames,
                            FILE *out) {
  char next[300], base[300];
  process_label(p->side[NEXT], next, sizeof next);
  process_label(p->side[BASE], base, sizeof base);
  if (p->side[BASE] == &kNoProcess) {
    fprintf(out, "%s (not in the base snapshot)", next);
  } else if (p->side[NEXT] == &kNoProcess) {
    fprintf(out, "%s (not in the newer snapshot)", base);
  } else if (strcmp(next, base) != 0) {
    fprintf(out, "%s (base: %s)", next, base);
  } else {
    fputs(next, out);
  }
  fprintf(out,
          ": live bytes %" PRIu64 " -> %" PRIu64 " (%+" PRId64 "), live blocks %" PRIu64
          " -> %" PRIu64 " (%+" PRId64 ")\n",
          p->live_bytes[BASE], p->live_bytes[NEXT], delta(p->live_bytes[BASE], p->live_bytes[NEXT]),
          p->live_blocks[BASE], p->live_blocks[NEXT],
          delta(p->live_blocks[BASE], p->live_blocks[NEXT]));
  if (!p->blocks_matched) {
    fputs(
        "note: a snapshot without its blocks one by one (a pprof profile written without "
        "--tags): added and removed are each group's net change\n",
        out);
  }
  const char *kind = d->by == HD_REPORT_BY_STACK ? "STACK" : "SITE";
  if (p->changed_count == 0) {
    fprintf(out, "no %s changed\n", d->by == HD_REPORT_BY_STACK ? "stack" : "site");
    return;
  }
  fprintf(out, "%14s %12s %14s %12s %14s %14s  %s\n", "NET BYTES", "NET BLOCKS", "ADDED BYTES",
          "ADDED BLOCKS", "REMOVED BYTES", "REMOVED BLOCKS", kind);
  size_t shown = top && top < p->changed_count ? top : p->changed_count;
  for (size_t i = 0; i < shown; i++) {
    const diff_group *g = &p->groups[i];
    fprintf(out,
            "%+14" PRId64 " %+12" PRId64 " %14" PRIu64 " %12" PRIu64 " %14" PRIu64 " %14" PRIu64
            "  %s\n",
            delta(g->live_bytes[BASE], g->live_bytes[NEXT]),
            delta(g->live_blocks[BASE], g->live_blocks[NEXT]), g->added_bytes, g->added_blocks,
            g->removed_bytes, g->removed_blocks, g->name);
    const hd_snapshot *s = p->side[g->shown_side];
    const hd_snapshot_stack_trace *trace = &s->stack_traces[g->shown_trace];
    hd_report_frames_text(out, d->symbolizer, s, trace, first_frame(d, s, trace), max_frames);
  }
  if (shown < p->changed_count) {
    fprintf(out, "... %zu more (use --top 0 for all)\n", p->changed_count - shown);
  }
  size_t unchanged = p->group_count - p->changed_count;
  if (unchanged > 0) {
    fprintf(out, "%zu %s%s unchanged\n", unchanged, d->by == HD_REPORT_BY_STACK ? "stack" : "site",
            unchanged == 1 ? "" : "s");
  }
}

static void json_side(FILE *out, const char *key, const process_pair *p, int side) {
  const hd_snapshot *s = p->side[side];
  fprintf(out, ",\"%s\":{\"process_name\":", key);
  hd_json_string(out, s->process_name);
  fprintf(out,
          ",\"pid\":%" PRIu64 ",\"present\":%s,\"live_bytes\":%" PRIu64 ",\"live_blocks\":%" PRIu64
          "}",
          s->pid, s == &kNoProcess ? "false" : "true", p->live_bytes[side], p->live_blocks[side]);
}

static void write_pair_json(const hd_diff *d, const process_pair *p, size_t top, size_t max_frames,
                            FILE *out) {
  const hd_snapshot *named = p->side[NEXT] != &kNoProcess ? p->side[NEXT] : p->side[BASE];
  fputs("{\"process_name\":", out);
  hd_json_string(out, named->process_name);
  fprintf(out, ",\"pid\":%" PRIu64, named->pid);
  json_side(out, "base", p, BASE);
  json_side(out, "new", p, NEXT);
  fprintf(out,
          ",\"live_bytes_delta\":%" PRId64 ",\"live_blocks_delta\":%" PRId64
          ",\"blocks_matched\":%s,\"by\":\"%s\",\"groups\":[",
          delta(p->live_bytes[BASE], p->live_bytes[NEXT]),
          delta(p->live_blocks[BASE], p->live_blocks[NEXT]), p->blocks_matched ? "true" : "false",
          d->by == HD_REPORT_BY_STACK ? "stack" : "site");
  size_t shown = top && top < p->changed_count ? top : p->changed_count;
  for (size_t i = 0; i < shown; i++) {
    const diff_group *g = &p->groups[i];
    fputs(i ? ",{\"name\":" : "{\"name\":", out);
    hd_json_string(out, g->name);
    fputs(",\"module\":", out);
    hd_json_string(out, g->module);
    fprintf(out,
            ",\"bytes_delta\":%" PRId64 ",\"blocks_delta\":%" PRId64 ",\"bytes_added\":%" PRIu64
            ",\"blocks_added\":%" PRIu64 ",\"bytes_removed\":%" PRIu64
            ",\"blocks_removed\":%" PRIu64 ",\"live_bytes\":%" PRIu64 ",\"live_blocks\":%" PRIu64
            ",\"base_live_bytes\":%" PRIu64 ",\"base_live_blocks\":%" PRIu64,
            delta(g->live_bytes[BASE], g->live_bytes[NEXT]),
            delta(g->live_blocks[BASE], g->live_blocks[NEXT]), g->added_bytes, g->added_blocks,
            g->removed_bytes, g->removed_blocks, g->live_bytes[NEXT], g->live_blocks[NEXT],
            g->live_bytes[BASE], g->live_blocks[BASE]);
    if (g->has_counters[NEXT]) {
      /* The cumulative counters of the stacks: what was allocated between the snapshots. */
      fprintf(out, ",\"allocated_bytes_delta\":%" PRId64 ",\"allocated_blocks_delta\":%" PRId64,
              delta(g->allocated_bytes[BASE], g->allocated_bytes[NEXT]),
              delta(g->allocated_blocks[BASE], g->allocated_blocks[NEXT]));
    }
    const hd_snapshot *s = p->side[g->shown_side];
    const hd_snapshot_stack_trace *trace = &s->stack_traces[g->shown_trace];
    fputs(",\"frames\":", out);
    hd_report_frames_json(out, d->symbolizer, s, trace, first_frame(d, s, trace), max_frames);
    fprintf(out, ",\"trace_frames\":%zu,\"truncated\":%s}", trace->count,
            trace->truncated ? "true" : "false");
  }
  fprintf(out, "],\"groups_total\":%zu,\"groups_unchanged\":%zu}", p->changed_count,
          p->group_count - p->changed_count);
}

int hd_diff_write_report(const hd_diff *d, size_t top, size_t max_frames, bool json, FILE *out,
                         char *error, size_t error_size) {
  errno = 0;
  if (json) fputs("{\"processes\":[", out);
  for (size_t i = 0; i < d->pair_count; i++) {
    if (i) fputc(json ? ',' : '\n', out);
    if (json) {
      write_pair_json(d, &d->pairs[i], top, max_frames, out);
    } else {
      write_pair_text(d, &d->pairs[i], top, max_frames, out);
    }
  }
  if (json) fputs("]}\n", out);
  if (fflush(out) != 0 || ferror(out)) {
    int err = errno ? errno : EIO;
    return hd_tool_fail(error, error_size, -err, "cannot write the diff: %s", strerror(err));
  }
  return 0;
}

/* ---- pprof ---- */

const hd_reassembler *hd_diff_profile_snapshots(const hd_diff *d) { return &d->profile; }

const hd_snapshot *hd_diff_base_of(const hd_diff *d, size_t snapshot) {
  return d->pairs[d->profile_pair[snapshot]].side[BASE];
}

bool hd_diff_trace_values(void *ctx, size_t snapshot, size_t trace, int64_t values[4]) {
  const hd_diff *d = ctx;
  const process_pair *p = &d->pairs[d->profile_pair[snapshot]];
  int side = d->profile_side[snapshot];
  const side_trace *st = &p->traces[side][trace];
  if (!st->used) return false;
  if (side == BASE) {
    if (st->peer != SIZE_MAX) return false; /* written with its peer, as one change */
    /* Gone from the newer side: its live blocks were freed. Its counters cannot go down, and
     * the newer side has none for it: nothing was allocated there since. */
    values[0] = -(int64_t)st->live_blocks;
    values[1] = -(int64_t)st->live_bytes;
    values[2] = values[3] = 0;
  } else {
    const hd_snapshot_stack_trace *t = &p->side[NEXT]->stack_traces[trace];
    const side_trace *peer = st->peer != SIZE_MAX ? &p->traces[BASE][st->peer] : NULL;
    const hd_snapshot_stack_trace *bt =
        peer != NULL ? &p->side[BASE]->stack_traces[st->peer] : NULL;
    values[0] = delta(peer ? peer->live_blocks : 0, st->live_blocks);
    values[1] = delta(peer ? peer->live_bytes : 0, st->live_bytes);
    values[2] = t->has_counters
                    ? delta(bt && bt->has_counters ? bt->allocated_blocks : 0, t->allocated_blocks)
                    : 0;
    values[3] = t->has_counters
                    ? delta(bt && bt->has_counters ? bt->allocated_bytes : 0, t->allocated_bytes)
                    : 0;
  }
  return values[0] != 0 || values[1] != 0 || values[2] != 0 || values[3] != 0;
}

/* ---- the HTML page ---- */

size_t hd_diff_profile_pair(const hd_diff *d, size_t snapshot) { return d->profile_pair[snapshot]; }

void hd_diff_net_split(hd_diff_change *c) {
  /* In unsigned arithmetic: a crafted file's change may be INT64_MIN, which cannot be negated. */
  c->added_bytes = c->delta_bytes > 0 ? (uint64_t)c->delta_bytes : 0;
  c->added_blocks = c->delta_blocks > 0 ? (uint64_t)c->delta_blocks : 0;
  c->removed_bytes = c->delta_bytes < 0 ? 0 - (uint64_t)c->delta_bytes : 0;
  c->removed_blocks = c->delta_blocks < 0 ? 0 - (uint64_t)c->delta_blocks : 0;
}

bool hd_diff_stack_change(const hd_diff *d, size_t snapshot, size_t trace, hd_diff_change *out) {
  const process_pair *p = &d->pairs[d->profile_pair[snapshot]];
  const int side = d->profile_side[snapshot];
  const side_trace *st = &p->traces[side][trace];
  if (!st->used) return false;
  if (side == BASE && st->peer != SIZE_MAX) return false; /* written with its peer */
  const side_trace *base = side == BASE           ? st
                           : st->peer != SIZE_MAX ? &p->traces[BASE][st->peer]
                                                  : NULL;
  const side_trace *next = side == NEXT ? st : NULL;
  *out = (hd_diff_change){
      .delta_bytes = delta(base ? base->live_bytes : 0, next ? next->live_bytes : 0),
      .delta_blocks = delta(base ? base->live_blocks : 0, next ? next->live_blocks : 0),
      .blocks_matched = p->blocks_matched};
  if (p->blocks_matched) {
    out->added_bytes = next ? next->changed_bytes : 0;
    out->added_blocks = next ? next->changed_blocks : 0;
    out->removed_bytes = base ? base->changed_bytes : 0;
    out->removed_blocks = base ? base->changed_blocks : 0;
  } else {
    hd_diff_net_split(out);
  }
  return out->delta_bytes != 0 || out->delta_blocks != 0 || out->added_blocks != 0 ||
         out->removed_blocks != 0;
}
