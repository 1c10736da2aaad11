/* Fuzz target: a raw snapshot file (docs/file-format.md) as `heapdump report` and `convert` read
 * it (tools/lib/rawfile.c), into the reassembler. A damaged file must give an error message,
 * never a crash. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/rawfile.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  FILE *in = fmemopen((void *)data, size, "rb");
  if (in == NULL) return 0; /* fmemopen refuses an empty buffer */
  hd_reassembler reassembler;
  hd_reassembler_init(&reassembler);
  char error[256] = "";
  if (hd_raw_read(in, &reassembler, error, sizeof error) != 0 && error[0] == '\0') abort();
  hd_reassembler_destroy(&reassembler);
  fclose(in);
  return 0;
}
