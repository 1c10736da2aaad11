/* For glibc_heap_test.cc: collector/glibc_heap.c's walk over one heap laid out in this process's
 * memory or another's, read as the collector reads a process's (process_vm_readv). C, as the
 * collector's internal headers are. */
#define _GNU_SOURCE
#include "glibc_heap_probe.h"

#include <stdlib.h>

#include "roots_internal.h"

size_t hd_probe_glibc_heap(int pid, const hd_probe_mapping *maps, size_t map_count, bool unrecorded,
                           const uint64_t *blocks, size_t block_count, hd_probe_range *roots,
                           size_t max_roots, hd_probe_range *glibc, size_t *glibc_count) {
  static char brk_path[] = "[heap]", anonymous[] = "";
  mapping *m = calloc(map_count ? map_count : 1, sizeof *m);
  if (m == NULL) return SIZE_MAX;
  bool brk = false;
  for (size_t i = 0; i < map_count; i++) {
    m[i] = (mapping){.start = maps[i].start,
                     .end = maps[i].end,
                     .perms = "rw-p",
                     .path = maps[i].brk ? brk_path : anonymous};
    brk = brk || maps[i].brk;
  }
  gather g = {.maps = m, .map_count = map_count, .brk_heap = brk, .blocks_mapped = true};
  hd_live_block *live = calloc(block_count ? block_count : 1, sizeof *live);
  if (live == NULL) {
    free(m);
    return SIZE_MAX;
  }
  for (size_t i = 0; i < block_count; i++) live[i].address = blocks[i];
  uint64_t *addresses = hd_roots_sorted_addresses(live, block_count);
  free(live);
  if (addresses == NULL) {
    free(m);
    return SIZE_MAX;
  }
  hd_roots_glibc_heaps((pid_t)pid, &g, addresses, block_count, unrecorded);
  free(addresses);
  size_t n = 0;
  for (size_t i = 0; i < g.root_count; i++) {
    if (g.roots[i].kind != heapdump_client_RootKind_ROOT_KIND_UNRECORDED) continue;
    if (n < max_roots) roots[n] = (hd_probe_range){g.roots[i].start, g.roots[i].end};
    n++;
  }
  *glibc_count = 0;
  for (size_t i = 0; i < g.glibc.count && i < 16; i++) {
    glibc[(*glibc_count)++] = (hd_probe_range){g.glibc.items[i].start, g.glibc.items[i].end};
  }
  const bool failed = g.out_of_memory;
  free(g.roots);
  free(g.glibc.items);
  free(m);
  return failed ? SIZE_MAX : n;
}
