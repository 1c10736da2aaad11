/* The HTML report: one self-contained page (no network, no server) with a snapshot's memory over
 * time, an icicle flame graph, the sites of the text report and the leak check, for a browser.
 * The page's script and the charting libraries are built into the heapdump command; only the
 * data changes from page to page, aggregated per stack trace (never per block), so a snapshot of
 * millions of blocks makes a page the size of its distinct stacks. */
#ifndef HEAPDUMP_TOOLS_HTML_H
#define HEAPDUMP_TOOLS_HTML_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/diff.h"
#include "heapdump/tools/report.h"
#include "heapdump/tools/symbolize.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hd_html_options {
  hd_symbolizer *symbolizer; /* NULL: addresses as module+0xoffset */
  const char *source;        /* what the page was made from, for its header ("" if NULL) */
  /* The command line of process command_pid, where the caller knows it (heapdump run). */
  const char *command_line;
  uint64_t command_pid;
  /* As hd_report_options.categories: a caller's leak check (heapdump leaks); NULL: snapshots
   * with roots are classified here. */
  uint8_t *const *categories;
  /* A diff's page: r is then hd_diff_profile_snapshots(diff), and the flame graph and table show
   * each stack's change (net, added, removed) instead of its totals. */
  const hd_diff *diff;
  /* What the flame graph and the sites table show first (a snapshot's page). */
  hd_report_sort sort;
} hd_html_options;

/* Writes the page of r's snapshots (one process selector entry each). 0, or a negative errno
 * value with a message in error. */
HD_MUST_CHECK int hd_html_write(const hd_reassembler *r, const hd_html_options *options, FILE *out,
                                char *error, size_t error_size);

#ifdef __cplusplus
}
#endif
#endif
