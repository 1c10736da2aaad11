/* What changed between two snapshots of one process (heapdump diff): per site or stack, the bytes
 * and blocks added (live in the newer snapshot, not in the base), removed (live in the base, freed
 * since) and the net change, sorted by net growth; or, for pprof, one sample per stack with the
 * net change of its values. */
#ifndef HEAPDUMP_TOOLS_DIFF_H
#define HEAPDUMP_TOOLS_DIFF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/report.h"
#include "heapdump/tools/symbolize.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hd_diff hd_diff;

/* Compares base with next. Their processes are paired by pid (a single process on each side is
 * paired whatever its pid: two runs of one program); a process on one side only is compared with
 * nothing. Stacks are the same stack when every frame is at the same offset of the same module,
 * so the sides need not share an address space. Blocks are matched by address and allocation
 * timestamp where both sides record blocks one by one (raw snapshots, pprof with tags); otherwise
 * (pprof profiles of totals) a group's added and removed are its net change. by: site or stack
 * (-EINVAL for thread: threads of two snapshots do not pair up). symbolizer may be NULL. Returns
 * 0 or a negative errno value with a message in error. */
HD_MUST_CHECK int hd_diff_create(const hd_reassembler *base, const hd_reassembler *next,
                                 hd_symbolizer *symbolizer, hd_report_by by, hd_diff **out,
                                 char *error, size_t error_size);
void hd_diff_destroy(hd_diff *d);

/* The text or JSON report: per process pair, the totals before and after, then the groups that
 * changed (top: how many; 0 = all), each with the frames of its most changed stack (max_frames;
 * 0 = all). JSON keeps the shape of the report's: {"processes":[{..., "groups":[{"name",
 * "module", "bytes_delta", "blocks_delta", "bytes_added", ...}]}]}. */
HD_MUST_CHECK int hd_diff_write_report(const hd_diff *d, size_t top, size_t max_frames, bool json,
                                       FILE *out, char *error, size_t error_size);

/* For hd_pprof_write: the snapshots the profile is written from (the newer side's, then the
 * base's) and, as its trace_values callback (ctx: the hd_diff), the net change of each stack:
 * written once, at the newer side's trace where the stack is on both sides. */
const hd_reassembler *hd_diff_profile_snapshots(const hd_diff *d);
bool hd_diff_trace_values(void *d, size_t snapshot, size_t trace, int64_t values[4]);

/* For the HTML page, of the same snapshots: which process pair a snapshot is of (the page shows
 * a pair as one process), and how one stack changed — written once, at the newer side's trace
 * where the stack is on both sides (false: leave the trace out). Added and removed are the
 * blocks matched one by one where both sides record them, else the net change's sign. */
typedef struct hd_diff_change {
  int64_t delta_bytes, delta_blocks;
  uint64_t added_bytes, added_blocks, removed_bytes, removed_blocks;
  /* Blocks were matched one by one; else added and removed are only the net change's sign, and
   * a sum of stacks must take them from the summed net change, as the report's groups do. */
  bool blocks_matched;
} hd_diff_change;
size_t hd_diff_profile_pair(const hd_diff *d, size_t snapshot);
/* The BASE side of that pair (NULL: the process is only in NEW). */
const hd_snapshot *hd_diff_base_of(const hd_diff *d, size_t snapshot);
/* Added and removed of a change whose blocks were not matched: the net change's sign. */
void hd_diff_net_split(hd_diff_change *c);
bool hd_diff_stack_change(const hd_diff *d, size_t snapshot, size_t trace, hd_diff_change *out);

#ifdef __cplusplus
}
#endif
#endif
