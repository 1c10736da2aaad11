/* glibc's memory among the process's mappings, and the blocks glibc holds that the process did
 * not record, as reachability roots (roots_internal.h).
 *
 * A process that records on glibc but not every block (sampled, or armed after it started) holds
 * live blocks the collector has no record of, and a recorded block only they point to would look
 * lost: at one block in 4 KiB sampled, nearly every recorded node of a tree. glibc's own chunk
 * headers say where its blocks are: a chunk starts with the previous chunk's size (a word the
 * previous chunk may use while in use) and its own size, whose low three bits are flags; the
 * next chunk's PREV_INUSE bit says whether a chunk is in use, and a free chunk's size is
 * repeated in the next chunk's first word. In each heap that holds recorded blocks — the program
 * break's (the main arena), and a thread arena's heaps (64 MiB aligned, a heap_info header
 * first, the arena's malloc_state after it in an arena's first heap) — the walk starts at the
 * heap's first chunk, where glibc puts it (checked: its chain of sizes must land on the chunk of
 * the heap's first recorded block), and adds every run of in-use chunks holding no recorded
 * block as one root (kind UNRECORDED).
 *
 * Wherever it cannot tell, it errs toward scanning: chunks glibc's thread caches and fast bins
 * hold are free but marked in use, so their stale bytes are scanned; a chunk marked free whose
 * size the next chunk does not repeat (read while the process changed it) is scanned; a heap's
 * start where the first chunk is not where glibc puts it, and the rest of a heap where a size
 * makes no sense, are scanned whole. That can make a lost block look reachable; a reachable one
 * looks lost only where the process changed its heap while it was read.
 *
 * The heap is the process's, so hostile: every size is checked against the heap's bounds and
 * each step moves forward. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include "roots_internal.h"

#define CHUNK_HEADER 16u
#define MIN_CHUNK 32u
#define PREV_INUSE 1u
#define IS_MMAPPED 2u
#define SIZE_FLAGS 7u
/* glibc's HEAP_MAX_SIZE on 64-bit (twice the largest mmap threshold): a thread arena's heap
 * starts at an address aligned to it, with its heap_info: arena, previous heap, size,
 * mprotected size, then (glibc 2.35 on) the page size, padded to 48 bytes (32 before). */
#define ARENA_HEAP_ALIGN ((uint64_t)64 << 20)
#define HEAP_INFO_BYTES 48u
#define HEAP_INFO_BYTES_OLD 32u
/* sizeof(struct malloc_state), glibc 2.27 to 2.39, after an arena's first heap_info. */
#define MALLOC_STATE_BYTES 2200u
/* The window of the heap read at once. */
#define WINDOW_BYTES ((uint64_t)1 << 20)
/* The aligned addresses of one mapping looked at for a thread arena's heap (4 GiB of them). */
#define MAX_HEAP_PROBES 64u
/* Past this many roots the rest of a heap is one root (MAX_ROOTS in program_mappings.c keeps
 * room for the program's mappings). */
#define MAX_HEAP_ROOTS (1u << 19)

typedef struct heap_reader {
  pid_t pid;
  uint64_t lo, hi;  /* the heap's bounds */
  bool hi_is_end;   /* hi is where the heap ends (not a mapping's end that cut it short) */
  uint64_t at, len; /* the window's */
  uint8_t *window;
} heap_reader;

static bool word_at(heap_reader *r, uint64_t address, uint64_t *out) {
  if (address < r->lo || address > r->hi - 8) return false;
  if (address < r->at || address + 8 > r->at + r->len) {
    const uint64_t len = r->hi - address < WINDOW_BYTES ? r->hi - address : WINDOW_BYTES;
    if (!hd_roots_read_remote(r->pid, address, r->window, len)) return false;
    r->at = address;
    r->len = len;
  }
  memcpy(out, r->window + (address - r->at), sizeof *out);
  return true;
}

/* The size of the chunk at c; 0 where no chunk of an arena can be (too small, misaligned, past
 * the heap, mmapped). */
static uint64_t chunk_size(heap_reader *r, uint64_t c) {
  uint64_t word;
  if (c > r->hi - CHUNK_HEADER || !word_at(r, c + 8, &word)) return 0;
  const uint64_t size = word & ~(uint64_t)SIZE_FLAGS;
  if ((word & IS_MMAPPED) || size < MIN_CHUNK || size % 16 != 0 || size > r->hi - c) return 0;
  return size;
}

/* Whether the chain of chunk sizes from c lands on target. */
static bool chain_lands_on(heap_reader *r, uint64_t c, uint64_t target) {
  uint64_t size;
  while (c < target && (size = chunk_size(r, c)) != 0) c += size;
  return c == target;
}

/* Whether the chunk at c, of size bytes, is in use: the next chunk's PREV_INUSE bit, unless the
 * chunk is the heap's last (the top chunk, free, where the heap's end is known) or a free
 * chunk's size is not repeated in the next chunk's first word as glibc writes it (then it was
 * read mid-change). What cannot be read is taken as in use. */
static bool in_use(heap_reader *r, uint64_t c, uint64_t size) {
  const uint64_t next = c + size;
  uint64_t next_size, footer;
  if (next > r->hi - CHUNK_HEADER) return !r->hi_is_end;
  if (!word_at(r, next + 8, &next_size) || (next_size & PREV_INUSE)) return true;
  return !word_at(r, next, &footer) || footer != size;
}

static void add_unrecorded(gather *g, uint64_t start, uint64_t end, const char *name) {
  hd_roots_add_root(g, start, end, heapdump_client_RootKind_ROOT_KIND_UNRECORDED, 0, name);
}

/* Walks the heap [r->lo, r->hi) from `first`, where glibc puts its first chunk; blocks: the
 * recorded blocks' addresses in it, sorted. What lies before the first chunk (an arena's
 * header: its bins) is scanned whole. */
static void walk_heap(gather *g, heap_reader *r, uint64_t first, const uint64_t *blocks,
                      size_t count, const char *name) {
  r->at = r->len = 0;
  while (count > 0 && blocks[0] < r->lo + CHUNK_HEADER) { /* no chunk header below it */
    blocks++;
    count--;
  }
  /* The first recorded block's chunk must be on the chain from the first chunk; if it is not
   * (another glibc's layout, or that block freed meanwhile), the walk starts at it. */
  const bool guessed = count == 0 || (first <= blocks[0] - CHUNK_HEADER &&
                                      chain_lands_on(r, first, blocks[0] - CHUNK_HEADER));
  if (!guessed) first = blocks[0] - CHUNK_HEADER;
  /* Up to that block's chunk's first word, which the chunk before it may use. */
  if (first > r->lo) add_unrecorded(g, r->lo, guessed ? first : first + 8, name);
  uint64_t c = first, run = 0, size;
  size_t b = 0;
  while (g->root_count < MAX_HEAP_ROOTS && (size = chunk_size(r, c)) != 0) {
    while (b < count && blocks[b] < c + CHUNK_HEADER) b++;
    const bool recorded = b < count && blocks[b] == c + CHUNK_HEADER;
    if (in_use(r, c, size) && !recorded) {
      if (run == 0) run = c + CHUNK_HEADER;
    } else if (run != 0) {
      add_unrecorded(g, run, c + 8, name); /* c's first word is the run's last chunk's */
      run = 0;
    }
    c += size;
  }
  if (run != 0) add_unrecorded(g, run, c + 8 < r->hi ? c + 8 : r->hi, name);
  /* Past the top chunk (zeros up to the heap's end), or where the walk lost its way. */
  if (c < r->hi && !g->out_of_memory) add_unrecorded(g, c, r->hi, name);
}

/* Whether a thread arena's heap starts at `heap` (its heap_info read in one go, checked
 * against how glibc links them); its size, and where glibc put its first chunk. */
static bool arena_heap_at(pid_t pid, uint64_t heap, uint64_t *size, uint64_t *first) {
  uint64_t info[5]; /* ar_ptr, prev, size, mprotect_size, pagesize */
  if (!hd_roots_read_remote(pid, heap, info, sizeof info)) return false;
  const uint64_t header = info[0] % ARENA_HEAP_ALIGN;
  if (header != HEAP_INFO_BYTES && header != HEAP_INFO_BYTES_OLD) return false;
  /* The page size (huge pages with glibc.malloc.hugetlb): a power of two, 4 KiB to 1 GiB. */
  if (header == HEAP_INFO_BYTES && (info[4] < PAGE_SIZE_BYTES || info[4] > ((uint64_t)1 << 30) ||
                                    (info[4] & (info[4] - 1)) != 0)) {
    return false;
  }
  const bool first_of_arena = info[0] == heap + header;
  if (first_of_arena ? info[1] != 0
                     : info[1] == 0 || info[1] % ARENA_HEAP_ALIGN != 0 || info[1] == heap) {
    return false;
  }
  if (info[2] <= header || info[2] % PAGE_SIZE_BYTES != 0 || info[2] > ARENA_HEAP_ALIGN ||
      info[3] < info[2]) {
    return false;
  }
  *size = info[2];
  *first =
      first_of_arena ? (heap + header + MALLOC_STATE_BYTES + 15) & ~(uint64_t)15 : heap + header;
  return true;
}

/* Whether [start, end) of a recorded block mmapped on its own is read from its chunk header
 * (the chunk's first word is the mapping's offset before it, for an aligned block). */
static bool mmapped_chunk(pid_t pid, const mapping *m, uint64_t block, uint64_t *start,
                          uint64_t *end) {
  uint64_t header[2];
  if (block < m->start + CHUNK_HEADER ||
      !hd_roots_read_remote(pid, block - CHUNK_HEADER, header, sizeof header) ||
      !(header[1] & IS_MMAPPED)) {
    return false;
  }
  const uint64_t chunk = block - CHUNK_HEADER, size = header[1] & ~(uint64_t)SIZE_FLAGS;
  if (header[0] > chunk - m->start || size > m->end - chunk) return false;
  *start = chunk - header[0];
  *end = chunk + size;
  return *start % PAGE_SIZE_BYTES == 0 && *end % PAGE_SIZE_BYTES == 0;
}

void hd_roots_glibc_heaps(pid_t pid, gather *g, const uint64_t *addresses, size_t block_count,
                          bool unrecorded) {
  heap_reader r = {.pid = pid, .window = malloc(WINDOW_BYTES)};
  if (r.window == NULL) {
    g->out_of_memory = true;
    return;
  }
  for (size_t i = 0; i < g->map_count && !g->out_of_memory; i++) {
    const mapping *m = &g->maps[i];
    if (m->perms[0] != 'r' || m->perms[1] != 'w' || m->perms[3] != 'p' || m->end <= m->start) {
      continue;
    }
    if (strcmp(m->path, "[heap]") == 0) {
      /* One heap, however many pieces the kernel shows it in (mlock, mprotect split it). */
      r.lo = m->start;
      r.hi = m->end;
      while (i + 1 < g->map_count && strcmp(g->maps[i + 1].path, "[heap]") == 0 &&
             g->maps[i + 1].start == r.hi && g->maps[i + 1].perms[0] == 'r') {
        r.hi = g->maps[++i].end;
      }
      r.hi_is_end = true;
      const size_t lo = hd_roots_first_at_or_after(addresses, block_count, r.lo);
      const size_t hi = hd_roots_first_at_or_after(addresses, block_count, r.hi);
      if (g->brk_heap && unrecorded)
        walk_heap(g, &r, (r.lo + 15) & ~(uint64_t)15, addresses + lo, hi - lo, m->path);
      continue;
    }
    const size_t from = hd_roots_first_at_or_after(addresses, block_count, m->start);
    const size_t to = hd_roots_first_at_or_after(addresses, block_count, m->end);
    /* A mapping that holds no recorded block is the program's, whole, as it was. */
    if (!g->blocks_mapped || m->path[0] != '\0' || from == to) continue;
    /* The thread-arena heaps in it (several when the kernel merged their mappings, some
     * perhaps emptied), then its recorded blocks mmapped on their own: what is left of the
     * mapping is the program's (an interpreter's arenas may share a mapping with glibc's). */
    range_set heaps = {0};
    unsigned probed = 0;
    for (uint64_t heap = (m->start + ARENA_HEAP_ALIGN - 1) & ~(ARENA_HEAP_ALIGN - 1);
         heap >= m->start && heap < m->end && probed < MAX_HEAP_PROBES && !g->out_of_memory;
         heap += ARENA_HEAP_ALIGN, probed++) {
      uint64_t size, first;
      if (!arena_heap_at(pid, heap, &size, &first)) continue;
      r.lo = heap;
      r.hi_is_end = size <= m->end - heap;
      r.hi = r.hi_is_end ? heap + size : m->end; /* it may have grown since the maps were read */
      if (!hd_range_set_add(&heaps, r.lo, r.hi) || !hd_range_set_add(&g->glibc, r.lo, r.hi)) {
        g->out_of_memory = true;
        break;
      }
      if (!unrecorded) continue;
      const size_t lo = hd_roots_first_at_or_after(addresses, block_count, r.lo);
      const size_t hi = hd_roots_first_at_or_after(addresses, block_count, r.hi);
      walk_heap(g, &r, first, addresses + lo, hi - lo, m->path);
    }
    size_t h = 0;
    for (size_t k = from; k < to && !g->out_of_memory; k++) {
      while (h < heaps.count && heaps.items[h].end <= addresses[k]) h++;
      if (h < heaps.count && heaps.items[h].start <= addresses[k]) continue;
      uint64_t start, end;
      if (mmapped_chunk(pid, m, addresses[k], &start, &end) &&
          !hd_range_set_add(&g->glibc, start, end)) {
        g->out_of_memory = true;
      }
    }
    free(heaps.items);
  }
  free(r.window);
}
