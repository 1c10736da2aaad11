/* Leak categories by a conservative pointer scan (see reach.h), in three passes over the heap:
 * chains of start pointers from the roots (still reachable), then any pointer from the roots and
 * what is reached (possibly lost), then, among what is left, which blocks other lost blocks point
 * to (indirectly lost) and which none does (definitely lost). Each block's contents are scanned
 * at most once per pass. */
#include "heapdump/tools/reach.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include "heapdump/contract/must_check.h"

enum { UNREACHED = 0, POSSIBLE = 1, REACHABLE = 2 };
enum { UNDECIDED = 0, LEADER = 1, MEMBER = 2 }; /* lost blocks: definitely / indirectly */

const char *hd_reach_category_name(hd_reach_category c) {
  switch (c) {
    case HD_DEFINITELY_LOST: return "definitely_lost";
    case HD_INDIRECTLY_LOST: return "indirectly_lost";
    case HD_POSSIBLY_LOST: return "possibly_lost";
    case HD_STILL_REACHABLE:
    case HD_REACH_CATEGORIES: break;
  }
  return "still_reachable";
}

bool hd_reach_possible(const hd_snapshot *s) { return s->root_count > 0; }

/* The live blocks by address, for finding the block a word points into. */
typedef struct heap_index {
  uint64_t *starts, *ends; /* sorted by start */
  size_t *allocation;      /* the allocation index of each */
  size_t count;
  uint64_t lowest, highest; /* no block outside [lowest, highest) */
} heap_index;

typedef struct scan {
  const hd_snapshot *s;
  heap_index heap;
  const uint8_t **bytes; /* per allocation: its contents, or NULL */
  uint8_t *state;        /* per allocation: UNREACHED, POSSIBLE, REACHABLE */
  uint8_t *lost;         /* per allocation, among the unreached: UNDECIDED, LEADER, MEMBER */
  size_t leader;         /* pass 3: the lost block whose group is being claimed */
  size_t *stack;         /* work list of allocation indices */
  size_t depth;
} scan;

static int compare_u64_pairs(const void *a, const void *b) {
  const uint64_t *x = a, *y = b;
  return x[0] < y[0] ? -1 : x[0] > y[0];
}

static HD_MUST_CHECK int build_index(const hd_snapshot *s, heap_index *h) {
  size_t n = s->allocation_count;
  uint64_t *pairs = malloc((n ? n : 1) * 2 * sizeof *pairs);
  h->starts = malloc((n ? n : 1) * sizeof *h->starts);
  h->ends = malloc((n ? n : 1) * sizeof *h->ends);
  h->allocation = malloc((n ? n : 1) * sizeof *h->allocation);
  if (pairs == NULL || h->starts == NULL || h->ends == NULL || h->allocation == NULL) {
    free(pairs);
    return -ENOMEM;
  }
  for (size_t i = 0; i < n; i++) {
    pairs[2 * i] = s->allocations[i].address;
    pairs[2 * i + 1] = i;
  }
  if (n > 1) qsort(pairs, n, 2 * sizeof *pairs, compare_u64_pairs);
  h->count = n;
  h->lowest = UINT64_MAX;
  h->highest = 0;
  for (size_t k = 0; k < n; k++) {
    const hd_snapshot_allocation *a = &s->allocations[pairs[2 * k + 1]];
    h->starts[k] = a->address;
    /* A zero-size block is pointed to only by its address. */
    const uint64_t size = hd_snapshot_block_size(s, a);
    h->ends[k] = size > UINT64_MAX - a->address ? UINT64_MAX : a->address + (size ? size : 1);
    h->allocation[k] = (size_t)pairs[2 * k + 1];
    if (h->starts[k] < h->lowest) h->lowest = h->starts[k];
    if (h->ends[k] > h->highest) h->highest = h->ends[k];
  }
  free(pairs);
  return 0;
}

/* The allocation whose block holds address v, or SIZE_MAX; *start: v is its first byte. */
static size_t find_block(const heap_index *h, uint64_t v, bool *start) {
  if (v < h->lowest || v >= h->highest) return SIZE_MAX;
  size_t lo = 0, hi = h->count;
  while (lo < hi) { /* the first block starting after v */
    size_t mid = lo + (hi - lo) / 2;
    if (h->starts[mid] <= v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == 0 || v >= h->ends[lo - 1]) return SIZE_MAX;
  *start = v == h->starts[lo - 1];
  return h->allocation[lo - 1];
}

/* glibc's dynamic thread vector: the thread control block points 16 bytes into it, past its
 * count of entries (the block holds that count plus 2 entries of 16 bytes). Valgrind needs a
 * suppression for it; a pointer of this exact shape is taken as a start pointer. */
static bool is_thread_vector(const scan *sc, size_t allocation, uint64_t v) {
  const hd_snapshot_allocation *a = &sc->s->allocations[allocation];
  const uint8_t *bytes = sc->bytes[allocation];
  const uint64_t size = hd_snapshot_block_size(sc->s, a);
  if (bytes == NULL || v != a->address + 16 || size < 48 || size % 16 != 0) return false;
  uint64_t count;
  memcpy(&count, bytes, 8);
  return count == size / 16 - 2;
}

/* Calls visit(sc, allocation, is_start) for every word of [bytes, bytes + size), at address,
 * that points into a live block. Words are the 8-byte aligned ones. */
#define FOR_EACH_POINTER(sc, address, bytes, size, visit)                     \
  do {                                                                        \
    uint64_t skip_ = (8 - ((address)&7)) & 7;                                 \
    for (uint64_t off_ = skip_; (size) >= 8 && off_ <= (size)-8; off_ += 8) { \
      uint64_t v_;                                                            \
      memcpy(&v_, (bytes) + off_, 8);                                         \
      bool start_;                                                            \
      size_t target_ = find_block(&(sc)->heap, v_, &start_);                  \
      if (target_ != SIZE_MAX) {                                              \
        visit((sc), target_, start_ || is_thread_vector((sc), target_, v_));  \
      }                                                                       \
    }                                                                         \
  } while (0)

static void push(scan *sc, size_t allocation) { sc->stack[sc->depth++] = allocation; }

/* Pass 1: start pointers make a block reachable. */
static void reach_by_start(scan *sc, size_t target, bool start) {
  if (start && sc->state[target] != REACHABLE) {
    sc->state[target] = REACHABLE;
    push(sc, target);
  }
}

/* Pass 2: any pointer into an unreached block makes it possibly lost. */
static void reach_by_any(scan *sc, size_t target, bool start) {
  (void)start;
  if (sc->state[target] == UNREACHED) {
    sc->state[target] = POSSIBLE;
    push(sc, target);
  }
}

static void scan_block(scan *sc, size_t i, void (*visit)(scan *, size_t, bool)) {
  const uint8_t *bytes = sc->bytes[i];
  if (bytes == NULL) return;
  uint64_t address = sc->s->allocations[i].address,
           size = hd_snapshot_block_size(sc->s, &sc->s->allocations[i]);
  FOR_EACH_POINTER(sc, address, bytes, size, visit);
}

static void drain(scan *sc, void (*visit)(scan *, size_t, bool)) {
  while (sc->depth > 0) scan_block(sc, sc->stack[--sc->depth], visit);
}

static void scan_roots(scan *sc, void (*visit)(scan *, size_t, bool)) {
  for (size_t r = 0; r < sc->s->root_count; r++) {
    const hd_snapshot_root *root = &sc->s->roots[r];
    if (root->contents.bytes == NULL) continue;
    uint64_t size = root->contents.size;
    FOR_EACH_POINTER(sc, root->address, root->contents.bytes, size, visit);
    drain(sc, visit);
  }
}

/* Pass 3, from lost block sc->leader: every lost block it reaches is indirectly lost, a leader
 * found on the way included (something lost points to it, after all); the members of that
 * leader's group are members already, so the walk stops there. */
static void claim_member(scan *sc, size_t target, bool start) {
  (void)start;
  if (target == sc->leader || sc->state[target] != UNREACHED) return;
  if (sc->lost[target] == UNDECIDED) {
    sc->lost[target] = MEMBER;
    push(sc, target);
  } else if (sc->lost[target] == LEADER) {
    sc->lost[target] = MEMBER;
  }
}

int hd_reach_classify(const hd_snapshot *s, uint8_t *categories, size_t *blocks_without_contents) {
  if (!hd_reach_possible(s)) return -EINVAL;
  size_t n = s->allocation_count;
  scan sc = {.s = s};
  sc.lost = calloc(n ? n : 1, 1);
  sc.bytes = calloc(n ? n : 1, sizeof *sc.bytes);
  sc.state = calloc(n ? n : 1, 1);
  sc.stack = malloc((n ? n : 1) * sizeof *sc.stack);
  int rc = sc.lost && sc.bytes && sc.state && sc.stack ? build_index(s, &sc.heap) : -ENOMEM;
  if (rc == 0) {
    size_t missing = 0;
    for (size_t i = 0; i < n; i++) {
      const hd_snapshot_block *b = hd_snapshot_find_block(s, s->allocations[i].address);
      const uint64_t size = hd_snapshot_block_size(s, &s->allocations[i]);
      sc.bytes[i] = b != NULL && b->size == size ? b->bytes : NULL;
      missing += sc.bytes[i] == NULL && size >= 8;
    }
    if (blocks_without_contents != NULL) *blocks_without_contents = missing;
    scan_roots(&sc, reach_by_start);
    /* Possibly lost: reached from the roots or a reachable block through an interior pointer,
     * then anything such a block points to that nothing else reached. */
    scan_roots(&sc, reach_by_any);
    for (size_t i = 0; i < n; i++) {
      if (sc.state[i] == REACHABLE) {
        scan_block(&sc, i, reach_by_any);
        drain(&sc, reach_by_any);
      }
    }
    for (size_t k = 0; k < n; k++) { /* in address order: the same answer every time */
      size_t i = sc.heap.allocation[k];
      if (sc.state[i] != UNREACHED || sc.lost[i] != UNDECIDED) continue;
      sc.lost[i] = LEADER;
      sc.leader = i;
      push(&sc, i);
      drain(&sc, claim_member);
    }
    for (size_t i = 0; i < n; i++) {
      categories[i] = sc.state[i] == REACHABLE  ? HD_STILL_REACHABLE
                      : sc.state[i] == POSSIBLE ? HD_POSSIBLY_LOST
                      : sc.lost[i] == LEADER    ? HD_DEFINITELY_LOST
                                                : HD_INDIRECTLY_LOST;
    }
  }
  free(sc.heap.starts);
  free(sc.heap.ends);
  free(sc.heap.allocation);
  free(sc.bytes);
  free(sc.state);
  free(sc.stack);
  free(sc.lost);
  return rc;
}
