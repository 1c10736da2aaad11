/* Fuzz target: a raw snapshot file (docs/file-format.md) as `heapdump report` and `convert` read
 * it (tools/lib/rawfile.c), into the reassembler, then the leak check `report` runs on a snapshot
 * with roots (tools/lib/reach.c). A damaged file must give an error message, never a crash; any
 * heap a file describes (overlapping blocks, pointers anywhere) is classified. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/rawfile.h"
#include "heapdump/tools/reach.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  FILE *in = fmemopen((void *)data, size, "rb");
  if (in == NULL) return 0; /* fmemopen refuses an empty buffer */
  hd_reassembler reassembler;
  hd_reassembler_init(&reassembler);
  char error[256] = "";
  int rc = hd_raw_read(in, &reassembler, error, sizeof error);
  if (rc != 0 && error[0] == '\0') abort();
  for (size_t i = 0; rc == 0 && i < reassembler.snapshot_count; i++) {
    const hd_snapshot *s = reassembler.snapshots[i];
    if (!hd_reach_possible(s)) continue;
    uint8_t *categories = malloc(s->allocation_count + 1);
    if (categories != NULL && hd_reach_classify(s, categories, NULL) == 0) {
      for (size_t k = 0; k < s->allocation_count; k++) {
        if (categories[k] >= HD_REACH_CATEGORIES) abort();
      }
    }
    free(categories);
  }
  hd_reassembler_destroy(&reassembler);
  fclose(in);
  return 0;
}
