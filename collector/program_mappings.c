/* Roots in the memory a program mapped itself (roots_internal.h): its writable mappings that are
 * not a module's data, a thread's stack, the allocator's or heapdump's, read whole when small
 * and by their resident pages (/proc/PID/pagemap) when large; and what is not the program's,
 * taken out of every root. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "roots_internal.h"

/* Where the residency of a mapping is looked up, 8 bytes per page; runs of resident pages
 * closer than this are read as one (a page not resident reads as zeros, the zero page). */
#define PAGEMAP_BATCH 4096u
#define RUN_GAP_PAGES 16u
/* The most roots one snapshot keeps: past it, program mappings are sent as not read. */
#define MAX_ROOTS (1u << 20)

/* A stack of a thread: of a live one, or one a thread recorded (glibc keeps the stacks of exited
 * threads for the next ones: their dead frames are not roots). */
static bool thread_stack(const gather *g, const mapping *m) {
  for (size_t i = 0; i < g->live_count; i++) {
    if (g->live[i].lo < m->end && g->live[i].hi > m->start) return true;
  }
  for (size_t i = 0; i < g->thread_count; i++) {
    if (g->threads[i].stack_lo < m->end && g->threads[i].stack_hi > m->start) return true;
  }
  return false;
}

size_t hd_roots_first_at_or_after(const uint64_t *addresses, size_t count, uint64_t start) {
  size_t lo = 0, hi = count;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (addresses[mid] < start) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

bool hd_roots_holds_block(const uint64_t *addresses, size_t count, uint64_t start, uint64_t end) {
  const size_t at = hd_roots_first_at_or_after(addresses, count, start);
  return at < count && addresses[at] < end;
}

/* [start, end) of a program mapping, as roots: whole if small, else the runs of its resident
 * pages (/proc/PID/pagemap), within the snapshot's bound on the address space looked up. */
static void add_resident(gather *g, uint64_t *entries, uint64_t start, uint64_t end,
                         const char *name) {
  const heapdump_client_RootKind kind = heapdump_client_RootKind_ROOT_KIND_MAPPING;
  if (g->root_count >= MAX_ROOTS) {
    hd_roots_add_root_as(g, start, end, kind, 0, name, true);
    return;
  }
  if (end - start <= READ_WHOLE_MAX) {
    hd_roots_add_root(g, start, end, kind, 0, name);
    return;
  }
  if (g->pagemap_fd < 0 || entries == NULL || end - start > g->pagemap_left) {
    hd_roots_add_root_as(g, start, end, kind, 0, name, true);
    return;
  }
  g->pagemap_left -= end - start;
  uint64_t run_start = 0, run_end = 0; /* run_end == 0: no run open */
  for (uint64_t page = start / PAGE_SIZE_BYTES; page < end / PAGE_SIZE_BYTES;) {
    const uint64_t n =
        end / PAGE_SIZE_BYTES - page < PAGEMAP_BATCH ? end / PAGE_SIZE_BYTES - page : PAGEMAP_BATCH;
    if (pread(g->pagemap_fd, entries, n * sizeof *entries, (off_t)(page * sizeof *entries)) !=
        (ssize_t)(n * sizeof *entries)) {
      if (run_end != 0) hd_roots_add_root(g, run_start, run_end, kind, 0, name);
      hd_roots_add_root_as(g, page * PAGE_SIZE_BYTES, end, kind, 0, name, true);
      return;
    }
    for (uint64_t i = 0; i < n; i++) {
      const bool resident = (entries[i] >> 62) != 0; /* present, or swapped out */
      if (!resident) continue;
      const uint64_t at = (page + i) * PAGE_SIZE_BYTES;
      if (run_end != 0 && at - run_end <= RUN_GAP_PAGES * PAGE_SIZE_BYTES) {
        run_end = at + PAGE_SIZE_BYTES;
        continue;
      }
      if (run_end != 0) hd_roots_add_root(g, run_start, run_end, kind, 0, name);
      run_start = at;
      run_end = at + PAGE_SIZE_BYTES;
    }
    page += n;
  }
  if (run_end != 0) hd_roots_add_root(g, run_start, run_end, kind, 0, name);
}

/* Every writable mapping that is neither a module's data, a thread's stack, the allocator's nor
 * heapdump's own: memory the program mapped itself, which may hold the only pointers to its
 * blocks (a garbage-collected heap, an interpreter's arenas). `taken` holds the roots found so
 * far; addresses are the live blocks' (for an allocator whose mappings are known only by the
 * blocks they hold). */
void hd_roots_add_program_mappings(hd_process *p, gather *g, const range_set *taken,
                                   const uint64_t *addresses, size_t address_count) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/pagemap", (int)p->pid);
  g->pagemap_fd = open(path, O_RDONLY | O_CLOEXEC);
  g->pagemap_left = MAX_PAGEMAP_SPAN;
  uint64_t *entries = malloc(PAGEMAP_BATCH * sizeof *entries);
  range_set pieces = {0};
  for (size_t i = 0; i < g->map_count && !g->out_of_memory; i++) {
    const mapping *m = &g->maps[i];
    if (m->perms[0] != 'r' || m->perms[1] != 'w' || m->end <= m->start) continue;
    /* The kernel's own ([stack], [vvar], [vdso], [vsyscall]); but the break's heap and named
     * anonymous mappings are the program's. */
    const bool heap = strcmp(m->path, "[heap]") == 0;
    if (m->path[0] == '[' && !heap && strncmp(m->path, "[anon:", 6) != 0) continue;
    if ((heap && g->brk_heap) || thread_stack(g, m)) continue;
    pieces.count = 0;
    if (!hd_range_set_add(&pieces, m->start, m->end)) {
      g->out_of_memory = true;
      break;
    }
    const range_set *not_program[] = {taken, &g->allocator, &g->heapdump, &g->glibc};
    for (size_t k = 0; k < sizeof not_program / sizeof *not_program; k++) {
      for (size_t r = 0; r < not_program[k]->count; r++) {
        const range x = not_program[k]->items[r];
        if (x.start < m->end && x.end > m->start && !hd_range_set_remove(&pieces, x.start, x.end)) {
          g->out_of_memory = true;
        }
      }
    }
    for (size_t k = 0; k < pieces.count; k++) {
      /* glibc's memory that glibc_heap.c could not place: the allocator's, as a whole; but where
       * the process does not record every block, its unrecorded blocks may be in it. */
      if (g->blocks_mapped && !g->unrecorded &&
          hd_roots_holds_block(addresses, address_count, pieces.items[k].start,
                               pieces.items[k].end)) {
        continue;
      }
      add_resident(g, entries, pieces.items[k].start, pieces.items[k].end, m->path);
    }
  }
  free(pieces.items);
  free(entries);
  if (g->pagemap_fd >= 0) close(g->pagemap_fd);
  g->pagemap_fd = -1;
  if (g->maps_cut) {
    hd_roots_add_root_as(g, g->maps_cut_start, g->maps_cut_start + g->maps_cut_bytes,
                         heapdump_client_RootKind_ROOT_KIND_MAPPING, 0, "", true);
  }
}

/* Removes from the roots (sorted, disjoint) what is not the program's: the allocator's memory,
 * heapdump's own, and heapdump's static TLS in each thread (its part of a TLS root, or of a stack
 * root where a thread's TLS lies at the top of its stack). */
void hd_roots_remove_not_the_programs(gather *g) {
  range_set out = {0};
  for (size_t i = 0; i < g->allocator.count; i++) {
    if (!hd_range_set_add(&out, g->allocator.items[i].start, g->allocator.items[i].end)) goto fail;
  }
  for (size_t i = 0; i < g->heapdump.count; i++) {
    if (!hd_range_set_add(&out, g->heapdump.items[i].start, g->heapdump.items[i].end)) goto fail;
  }
  for (size_t t = 0; t < g->thread_count; t++) {
    const uint64_t tp = g->threads[t].thread_pointer;
    for (size_t k = 0; tp != 0 && k < g->heapdump_tls_count; k++) {
      const uint64_t start = tp + g->heapdump_tls[k].offset, size = g->heapdump_tls[k].size;
      if (size > 0 && size < (1u << 24) && start + size > start &&
          !hd_range_set_add(&out, start, start + size)) {
        goto fail;
      }
    }
  }
  if (out.count == 0) goto done;
  root *kept = NULL;
  size_t kept_count = 0, kept_capacity = 0;
  for (size_t i = 0; i < g->root_count; i++) {
    root r = g->roots[i];
    uint64_t at = r.start;
    for (size_t k = 0; k < out.count && at < r.end; k++) {
      const range x = out.items[k];
      if (x.end <= at || x.start >= r.end) continue;
      if (x.start > at) {
        if (!hd_roots_grow((void **)&kept, kept_count, &kept_capacity, sizeof *kept))
          goto fail_kept;
        kept[kept_count] = r;
        kept[kept_count].start = at;
        kept[kept_count++].end = x.start;
      }
      at = x.end;
    }
    if (at < r.end) {
      if (!hd_roots_grow((void **)&kept, kept_count, &kept_capacity, sizeof *kept)) goto fail_kept;
      kept[kept_count] = r;
      kept[kept_count++].start = at;
    }
  }
  free(g->roots);
  g->roots = kept;
  g->root_count = kept_count;
  g->root_capacity = kept_capacity;
  goto done;
fail_kept:
  free(kept);
fail:
  g->out_of_memory = true;
done:
  free(out.items);
}
