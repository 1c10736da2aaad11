/* collector/glibc_heap.c's walk over a heap in this process's own memory (glibc_heap_probe.c). */
#ifndef HEAPDUMP_TESTS_COLLECTOR_GLIBC_HEAP_PROBE_H
#define HEAPDUMP_TESTS_COLLECTOR_GLIBC_HEAP_PROBE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hd_probe_range {
  uint64_t start, end;
} hd_probe_range;

/* A mapping of the process: rw-p, the program break's heap ("[heap]") or anonymous. */
typedef struct hd_probe_mapping {
  uint64_t start, end;
  bool brk;
} hd_probe_mapping;

/* Walks the mappings of process pid (sorted by address) as the collector walks a glibc heap's,
 * with the recorded blocks' addresses given (sorted); with unrecorded, the roots it adds (all,
 * counted; the first max_roots copied); the glibc ranges it found (at most 16). SIZE_MAX if it
 * ran out of memory. */
size_t hd_probe_glibc_heap(int pid, const hd_probe_mapping *maps, size_t map_count, bool unrecorded,
                           const uint64_t *blocks, size_t block_count, hd_probe_range *roots,
                           size_t max_roots, hd_probe_range *glibc, size_t *glibc_count);

#ifdef __cplusplus
}
#endif

#endif
