/* Reachability roots of a process (RootRegion elements): the memory outside its heap from which
 * it can reach its blocks, read with process_vm_readv like block contents. The collector only
 * gathers them; the tools scan them (heapdump/tools/reach.h). */
#ifndef HEAPDUMP_COLLECTOR_ROOTS_H
#define HEAPDUMP_COLLECTOR_ROOTS_H

#include <stdint.h>

#include "collector_internal.h"
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
 *   the mapping around it, which holds its static TLS and thread control block.
 * Only readable private mappings are read, and regions never overlap. At most max_total bytes
 * (0: no limit; *cut says so); a region over HD_ROOT_MAX_REGION is left out. Returns HD_OK or the writer's error; a region that cannot be read
 * (unmapped meanwhile) is left out. */
/* A region bigger than this (a huge .bss, say) is left out rather than read into one buffer. */
#define HD_ROOT_MAX_REGION (256u << 20)

hd_status hd_add_roots(hd_process *p, uint64_t max_total, bool *cut, hd_batch_writer *w);

#ifdef __cplusplus
}
#endif
#endif
