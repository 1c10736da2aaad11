/* dartheap output: the Dart VM heap snapshot format, as DevTools and the Dart SDK's reader read it
 * (the mapping: tools/dartheap/README.md). Object 1 is the root; every live block is one object
 * whose class is its allocation site; with block contents, references come from a conservative
 * scan of the blocks' pointer-sized words. */
#ifndef HEAPDUMP_TOOLS_DARTHEAP_H
#define HEAPDUMP_TOOLS_DARTHEAP_H

#include <stdio.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/symbolize.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hd_dartheap_options {
  hd_symbolizer *symbolizer; /* NULL: sites named module+0xoffset */
  const char *name;          /* the graph's name; NULL: "process (pid N)", "N processes" or
                                "heapdump" */
} hd_dartheap_options;

/* Writes the snapshots of r (all processes in one graph for a multi-process snapshot) to out and
 * flushes it. options may be NULL. The same snapshots give the same bytes, whatever order their
 * blocks arrived in. Returns 0, or a negative errno value with a message in error:
 * -EOVERFLOW if the graph would have 2^31 objects or references or more (the limit of
 * JavaScript readers), -EINVAL if a block's contents do not match its size, -ENOMEM, or the
 * errno of a failed write. */
HD_MUST_CHECK int hd_dartheap_write(const hd_reassembler *r, const hd_dartheap_options *options,
                                    FILE *out, char *error, size_t error_size);

#ifdef __cplusplus
}
#endif
#endif
