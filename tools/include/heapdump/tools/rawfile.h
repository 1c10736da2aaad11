/* The raw snapshot file: heapdump's own lossless format, the snapshot elements as the collector
 * sends them, written and read as a stream (docs/file-format.md):
 *
 *   "HEAPDUMP" (8 bytes), u32 version (1), u32 flags (bit 0: multi-process), then records, each a
 *   u32 length and that many bytes of a SnapshotReceiver.Batch request body, ending the way the
 *   wire stream ends: with an empty batch (multi-process: each process's batches end with one, and
 *   one more ends the file). All integers little-endian. */
#ifndef HEAPDUMP_TOOLS_RAWFILE_H
#define HEAPDUMP_TOOLS_RAWFILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/snapshot.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HD_RAW_VERSION 1u
/* The file's first 8 bytes, which tell it from other inputs. */
#define HD_RAW_MAGIC "HEAPDUMP"
#define HD_RAW_MAGIC_SIZE 8
#define HD_RAW_FLAG_MULTI_PROCESS 1u

/* True if r holds a multi-process snapshot (its snapshots came with SnapshotHeaders). */
bool hd_raw_is_multi_process(const hd_reassembler *r);

/* Whether raw files carry the elements of kind tag (a SnapshotElement oneof tag): each kind the
 * protocol has must be written, or it is lost from every raw file. */
bool hd_raw_writes_element(pb_size_t tag);

/* Writes every snapshot of r. Returns 0, or a negative errno value with a message in error. */
HD_MUST_CHECK int hd_raw_write(const hd_reassembler *r, FILE *out, char *error, size_t error_size);

/* Reads a whole raw file into r (initialized by the caller) and checks it with
 * hd_reassembler_finish. Returns 0, -EINVAL for a file that is not a raw snapshot, is of a newer
 * version, or is truncated or corrupt, or another negative errno value; error says what. */
HD_MUST_CHECK int hd_raw_read(FILE *in, hd_reassembler *r, char *error, size_t error_size);

#ifdef __cplusplus
}
#endif
#endif
