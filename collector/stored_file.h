/* A stored snapshot's file, read back: its summary (listings, start-up scan) and its batches
 * (downloads). Everything here treats the file as untrusted: a damaged or planted file gives an
 * error, never a crash (tests/fuzz/fuzz_stored.c). The writer is storage.c.
 *
 * File layout (little-endian): HD_STORED_MAGIC, u32 uid, u32 metadata length (at most
 * HD_STORED_META_MAX), a StoredSnapshot message, then the snapshot's batches as they are sent on
 * the wire: u32 length (at most HD_BATCH_CAPACITY), Batch body. */
#ifndef HEAPDUMP_COLLECTOR_STORED_FILE_H
#define HEAPDUMP_COLLECTOR_STORED_FILE_H

#include <stdint.h>
#include <sys/types.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/contract/names.h"
#include "heapdump/fidl/batch.h"

#define HD_STORED_MAGIC "HDSNAP01" /* 8 bytes, no NUL */
#define HD_STORED_META_MAX 512u

typedef struct hd_stored_snapshot_info {
  uint32_t id;
  char name[HD_NAME_SIZE];
  char process_name[HD_NAME_SIZE];
  uint64_t pid;
  uid_t uid;
  uint64_t bytes;            /* the file's size */
  uint64_t taken_at_unix_ns; /* 0: unknown (stored by an older collector) */
  uint64_t live_bytes, live_blocks;
} hd_stored_snapshot_info;

/* The summary of the stored file open at fd (read with pread: the offset is left alone), after
 * checking its header, its metadata and that its records tile the file exactly. 0, -EINVAL for
 * a file that is not a whole stored snapshot, or -errno. */
HD_MUST_CHECK int hd_stored_file_info(int fd, hd_stored_snapshot_info *info);

/* Forwards every batch of the stored file open at fd (from its start) to w. 0; -EIO for a
 * damaged file; -EPIPE when w fails (the client went away); -ENOMEM. */
HD_MUST_CHECK int hd_stored_file_stream(int fd, hd_batch_writer *w);

#endif /* HEAPDUMP_COLLECTOR_STORED_FILE_H */
