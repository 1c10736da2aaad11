/* For glibc_heap_test.cc: collector/glibc_heap.c's walk over one heap laid out in this process's
 * memory, read as the collector reads a process's (process_vm_readv of this pid). C, as the
 * collector's internal headers are. */
#define _GNU_SOURCE
#include "glibc_heap_probe.h"

#include <stdlib.h>
#include <unistd.h>

#include "roots_internal.h"

size_t hd_probe_glibc_heap(const void *heap, size_t size, bool main_arena, bool unrecorded,
                           const uint64_t *blocks, size_t block_count, hd_probe_range *roots,
                           size_t max_roots, hd_probe_range *glibc, size_t *glibc_count) {
  char path[16] = "[heap]";
  if (!main_arena) path[0] = '\0';
  mapping m = {.start = (uint64_t)(uintptr_t)heap,
               .end = (uint64_t)(uintptr_t)heap + size,
               .perms = "rw-p",
               .path = path};
  gather g = {.maps = &m, .map_count = 1, .brk_heap = main_arena, .blocks_mapped = !main_arena};
  hd_live_block *live = calloc(block_count ? block_count : 1, sizeof *live);
  if (live == NULL) return SIZE_MAX;
  for (size_t i = 0; i < block_count; i++) live[i].address = blocks[i];
  hd_roots_glibc_heaps(getpid(), &g, live, block_count, unrecorded);
  free(live);
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
  return failed ? SIZE_MAX : n;
}
