/* Reachability roots of a process (RootRegion elements): the memory outside its heap from which
 * it can reach its blocks, read with process_vm_readv like block contents. The collector only
 * gathers them; the tools scan them (heapdump/tools/reach.h). */
#ifndef HEAPDUMP_COLLECTOR_ROOTS_H
#define HEAPDUMP_COLLECTOR_ROOTS_H

#include <stdint.h>

#include "collector_internal.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/batch.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Adds p's roots to w, each with its bytes:
 * - DATA: every loaded module's writable segments (PT_LOAD with PF_W, from its program headers
 *   in the process's memory: .data, .bss, relro), or its writable file mappings where its
 *   headers cannot be read;
 * - STACK: per thread, from its stack pointer up to the top of its
 *   stack, where /proc/PID/task/TID/syscall shows it (a thread blocked in a system call), else
 *   the whole stack the thread recorded (hd_rec_thread_roots); a thread neither blocked nor
 *   recorded has no stack root;
 * - TLS: per recorded thread whose thread pointer is not inside its stack (the main thread's):
 *   the mapping around it, which holds its static TLS and thread control block;
 * - MAPPING: every other writable mapping (private or shared) that is neither a thread's stack
 *   nor the kernel's, less the allocator's memory and heapdump's own as the process recorded
 *   them (hd_rec_mapping: jemalloc's mappings; with glibc, the break's heap and the mappings
 *   that hold live blocks, which are `blocks`); of a mapping over 1 MiB, the runs of its resident
 *   pages (/proc/PID/pagemap), within bounds on the mappings and pages looked at.
 * Regions never overlap and are read in pieces of at most 64 MiB. At most max_total bytes are
 * read (0: no limit): what is past it, what cannot be read and what the bounds left out are sent
 * as roots not read (RootRegion.not_read, without contents), and *cut says so. Returns HD_OK
 * or the writer's error. */
HD_MUST_CHECK hd_status hd_add_roots(hd_process *p, const hd_live_block *blocks, size_t block_count,
                                     uint64_t max_total, bool *cut, hd_batch_writer *w);

/* Adds p's ResidentMemory: its resident bytes (the Rss of every mapping in /proc/PID/smaps) as
 * the allocator's (its recorded mappings; with glibc, the break's heap and the anonymous
 * mappings that hold one of `blocks`), heapdump's (its tables and recorded memory), other
 * anonymous memory and file-backed memory, a kernel mapping that holds several of them split by
 * its resident pages (/proc/PID/pagemap). Nothing when p has exited or its memory cannot be
 * read whole. Returns HD_OK or the writer's error. */
HD_MUST_CHECK hd_status hd_add_resident_memory(hd_process *p, const hd_live_block *blocks,
                                               size_t block_count, hd_batch_writer *w);

#ifdef __cplusplus
}
#endif
#endif
