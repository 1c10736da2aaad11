/* Block contents read from another process in few calls: blocks are sorted by address, blocks
 * closer than HD_CONTENTS_MAX_GAP bytes are read as one range, and one process_vm_readv reads up
 * to HD_CONTENTS_MAX_RANGES ranges or HD_CONTENTS_BUFFER_BYTES bytes into one reused buffer, with
 * one liveness check per call rather than per block. */
#ifndef HEAPDUMP_COLLECTOR_CONTENTS_H
#define HEAPDUMP_COLLECTOR_CONTENTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/status.h"
#include "table_reader.h"

#ifdef __cplusplus
extern "C" {
#endif

/* IOV_MAX, the most iovecs one process_vm_readv takes. */
#define HD_CONTENTS_MAX_RANGES 1024u
/* Bytes read per call; a larger block is read alone into a buffer of its own size. */
#define HD_CONTENTS_BUFFER_BYTES (1u << 20)
/* Blocks at most this far apart are read as one range with the bytes between them: copying a
 * kilobyte costs the kernel less than pinning a page for one more iovec, and a gap below a page
 * only touches the pages of the two blocks, which are mapped. */
#define HD_CONTENTS_MAX_GAP 1024u

/* False once the process behind pidfd has exited; true when pidfd is -1 (no pidfd to tell). */
bool hd_pidfd_alive(int pidfd);

/* Called with the bytes of one block, read whole; they are valid only during the call. */
typedef hd_status (*hd_contents_fn)(void *ctx, uint64_t address, const uint8_t *bytes,
                                    uint64_t size);

/* Reads the blocks of blocks[0..count) from process pid and calls fn for each block read whole,
 * in address order. Skipped: blocks of size 0 or over max_block, and blocks that cannot be read
 * whole (freed and unmapped since the table was read; a range that comes back short is read again
 * block by block). Bytes are passed on only if pidfd shows the process alive after they were
 * read: an exit comes before any reuse of the pid, so they were its own. A process that has
 * exited, or may not be read, ends the reading. At most max_total bytes are passed on (0: no
 * limit; a table can claim blocks that overlap, each as big as max_block): the blocks past it,
 * in address order, go without, and *cut (nullable) says so. blocks is the working memory of the
 * sort, so its contents are undefined afterwards. Returns HD_OK or fn's error; without memory
 * for the buffer, contents (best effort) are not read. */
HD_MUST_CHECK hd_status hd_read_block_contents(pid_t pid, int pidfd, hd_live_block *blocks,
                                               size_t count, uint64_t max_block, uint64_t max_total,
                                               bool *cut, hd_contents_fn fn, void *ctx);

#ifdef __cplusplus
}
#endif
#endif
