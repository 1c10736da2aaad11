/* Where a process's resident memory is (roots.h, hd_add_resident_memory): the Rss of each of its
 * mappings (/proc/PID/smaps), given to whoever the mapping is: the allocator and heapdump as the
 * process recorded their memory (the same records a leak check uses to tell the program's
 * memory from theirs), the program's other anonymous memory, files. The kernel merges adjacent
 * anonymous mappings, so one of its mappings may hold the allocator's memory and the program's:
 * such a mapping is split by its resident pages (/proc/PID/pagemap). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "roots.h"
#include "roots_internal.h"

#define PAGEMAP_BATCH 4096u

typedef struct parts {
  uint64_t total, allocator, heapdump, other_anonymous, files;
} parts;

/* The first range of s that ends past start (s->count if none): ranges are sorted and
 * disjoint, so their ends are sorted too. */
static size_t first_past(const range_set *s, uint64_t start) {
  size_t lo = 0, hi = s->count;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (s->items[mid].end <= start) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/* Bytes of [start, end) in s. */
static uint64_t overlap(const range_set *s, uint64_t start, uint64_t end) {
  uint64_t bytes = 0;
  for (size_t i = first_past(s, start); i < s->count && s->items[i].start < end; i++) {
    const uint64_t lo = s->items[i].start > start ? s->items[i].start : start;
    const uint64_t hi = s->items[i].end < end ? s->items[i].end : end;
    if (lo < hi) bytes += hi - lo;
  }
  return bytes;
}

/* Resident bytes of [start, end) (present pages, as Rss counts them); false if the pagemap
 * cannot tell, or the snapshot's bound on pages looked up is spent. */
static bool resident_bytes(gather *g, uint64_t *entries, uint64_t start, uint64_t end,
                           uint64_t *bytes) {
  const uint64_t first = start / PAGE_SIZE_BYTES,
                 last = (end + PAGE_SIZE_BYTES - 1) / PAGE_SIZE_BYTES;
  if (g->pagemap_fd < 0 || end - start > g->pagemap_left) return false;
  g->pagemap_left -= end - start;
  uint64_t pages = 0;
  for (uint64_t page = first; page < last;) {
    const uint64_t n = last - page < PAGEMAP_BATCH ? last - page : PAGEMAP_BATCH;
    if (pread(g->pagemap_fd, entries, n * sizeof *entries, (off_t)(page * sizeof *entries)) !=
        (ssize_t)(n * sizeof *entries))
      return false;
    for (uint64_t i = 0; i < n; i++) pages += entries[i] >> 63;
    page += n;
  }
  *bytes = pages * PAGE_SIZE_BYTES;
  return true;
}

/* The resident bytes of the parts of [start, end) that s holds: by the pagemap, else in
 * proportion to their share of the mapping's rss. */
static uint64_t resident_overlap(gather *g, uint64_t *entries, const range_set *s, uint64_t start,
                                 uint64_t end, uint64_t rss) {
  uint64_t total = 0;
  for (size_t i = first_past(s, start); i < s->count && s->items[i].start < end; i++) {
    const uint64_t lo = s->items[i].start > start ? s->items[i].start : start;
    const uint64_t hi = s->items[i].end < end ? s->items[i].end : end;
    if (lo >= hi) continue;
    uint64_t bytes;
    if (!resident_bytes(g, entries, lo, hi, &bytes)) {
      bytes = (uint64_t)((double)rss * (double)(hi - lo) / (double)(end - start));
    }
    total += bytes;
  }
  return total < rss ? total : rss;
}

/* Whether a mapping's path names private anonymous memory: none, or the kernel's names for the
 * break's heap, stacks and named anonymous mappings ([anon:...]); not shared memory
 * ([anon_shmem:...], counted with files as the kernel counts it), nor its vdso and the like. */
static bool anonymous(const char *path) {
  return path[0] == '\0' || strcmp(path, "[heap]") == 0 || strncmp(path, "[stack", 6) == 0 ||
         strncmp(path, "[anon:", 6) == 0;
}

/* Gives one mapping's rss to whoever it is. */
static void classify(gather *g, uint64_t *entries, const uint64_t *addresses, size_t address_count,
                     uint64_t start, uint64_t end, const char *path, uint64_t rss, parts *out) {
  out->total += rss;
  if (strncmp(path, "/memfd:heapdump-", 16) == 0) {
    out->heapdump += rss; /* the tables */
    return;
  }
  const bool anon = anonymous(path);
  /* glibc's: the break's heap, its arenas and mapped blocks, which it does not record. A kernel
   * mapping that merged one of them with the program's own anonymous memory is counted whole
   * (docs/tools.md says so). */
  if ((g->brk_heap && strcmp(path, "[heap]") == 0) ||
      (g->blocks_mapped && anon && hd_roots_holds_block(addresses, address_count, start, end))) {
    out->allocator += rss;
    return;
  }
  uint64_t *rest = anon ? &out->other_anonymous : &out->files;
  const uint64_t size = end - start;
  const uint64_t in_allocator = overlap(&g->allocator, start, end);
  const uint64_t in_heapdump = overlap(&g->heapdump, start, end);
  if (in_allocator == size || in_heapdump == size) {
    *(in_allocator == size ? &out->allocator : &out->heapdump) += rss;
    return;
  }
  uint64_t allocator = 0, heapdump = 0;
  if (in_allocator > 0 && rss > 0) {
    allocator = resident_overlap(g, entries, &g->allocator, start, end, rss);
  }
  if (in_heapdump > 0 && rss > allocator) {
    heapdump = resident_overlap(g, entries, &g->heapdump, start, end, rss - allocator);
  }
  out->allocator += allocator;
  out->heapdump += heapdump;
  *rest += rss - allocator - heapdump;
}

/* Reads /proc/PID/smaps into out; false if it cannot be read whole. */
static bool read_smaps(hd_process *p, gather *g, const uint64_t *addresses, size_t address_count,
                       parts *out) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/smaps", (int)p->pid);
  FILE *f = fopen(path, "re");
  if (f == NULL) return false;
  uint64_t *entries = malloc(PAGEMAP_BATCH * sizeof *entries);
  char *line = NULL;
  size_t line_size = 0;
  bool open_mapping = false, ok = entries != NULL;
  uint64_t start = 0, end = 0, rss = 0;
  size_t mappings = 0;
  char *name = NULL;
  while (ok && getline(&line, &line_size, f) > 0) {
    uint64_t lo, hi;
    int name_at = 0;
    if (sscanf(line, "%" SCNx64 "-%" SCNx64 " %*s %*s %*s %*s %n", &lo, &hi, &name_at) == 2 &&
        name_at > 0) {
      if (open_mapping) classify(g, entries, addresses, address_count, start, end, name, rss, out);
      if (++mappings > MAX_MAPPINGS) { /* the same bound as the roots': no partial answer */
        ok = false;
        break;
      }
      free(name);
      name = strdup(line + name_at);
      if (name == NULL) {
        ok = false;
        break;
      }
      name[strcspn(name, "\n")] = '\0';
      start = lo;
      end = hi;
      rss = 0;
      open_mapping = lo < hi;
      continue;
    }
    uint64_t kib;
    if (sscanf(line, "Rss: %" SCNu64 " kB", &kib) == 1) rss = kib * 1024;
  }
  if (ok && open_mapping)
    classify(g, entries, addresses, address_count, start, end, name, rss, out);
  ok = ok && !ferror(f) && out->total > 0;
  free(name);
  free(line);
  free(entries);
  fclose(f);
  return ok;
}

static int compare_u64(const void *a, const void *b) {
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Every block carries its tag, recorded or not: sampled, the blocks the recorded ones stand for
 * (an estimate, as every count of such a process); sampled on glibc, the recorded ones alone. */
static uint64_t tag_bytes(hd_process *p, const hd_live_block *blocks, size_t block_count) {
  hd_alloc_table_info info;
  if (hd_alloc_reader_info(p->alloc, &info) == HD_READ_OK &&
      (info.flags & HD_ALLOC_FLAG_UNRECORDED_UNTAGGED)) {
    return block_count * HD_TAG_BYTES;
  }
  const uint64_t sample_bytes = hd_res_reader_sample_bytes(p->res);
  uint64_t tags = 0;
  for (size_t i = 0; i < block_count; i++) {
    tags += hd_sample_weight(blocks[i].address, blocks[i].timestamp, blocks[i].size, sample_bytes);
  }
  return tags * HD_TAG_BYTES;
}

hd_status hd_add_resident_memory(hd_process *p, const hd_live_block *blocks, size_t block_count,
                                 hd_batch_writer *w) {
  if (!hd_process_alive(p)) return HD_OK;
  gather g = {.pagemap_fd = -1};
  hd_roots_read_records(p, &g);
  uint64_t *addresses = NULL;
  if (!g.out_of_memory && g.blocks_mapped && block_count > 0) {
    addresses = malloc(block_count * sizeof *addresses);
    if (addresses != NULL) {
      for (size_t i = 0; i < block_count; i++) addresses[i] = blocks[i].address;
      qsort(addresses, block_count, sizeof *addresses, compare_u64);
    }
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/pagemap", (int)p->pid);
  g.pagemap_fd = open(path, O_RDONLY | O_CLOEXEC);
  g.pagemap_left = MAX_PAGEMAP_SPAN;
  parts out = {0};
  const bool known = !g.out_of_memory && !g.records_cut &&
                     (addresses != NULL || !g.blocks_mapped || block_count == 0) &&
                     read_smaps(p, &g, addresses, addresses ? block_count : 0, &out);
  if (g.pagemap_fd >= 0) close(g.pagemap_fd);
  free(addresses);
  free(g.threads);
  free(g.allocator.items);
  free(g.heapdump.items);
  /* A process that exited meanwhile, or whose records could not all be read: no breakdown
   * rather than a wrong one. */
  if (!known || !hd_process_alive(p)) return HD_OK;
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_resident_memory_tag;
  e.element.resident_memory =
      (heapdump_client_ResidentMemory){.has_resident_bytes = true,
                                       .resident_bytes = out.total,
                                       .has_allocator_bytes = true,
                                       .allocator_bytes = out.allocator,
                                       .has_heapdump_bytes = true,
                                       .heapdump_bytes = out.heapdump,
                                       .has_other_anonymous_bytes = true,
                                       .other_anonymous_bytes = out.other_anonymous,
                                       .has_file_bytes = true,
                                       .file_bytes = out.files,
                                       .has_tag_bytes = true,
                                       .tag_bytes = tag_bytes(p, blocks, block_count)};
  return hd_batch_add(w, &e);
}
