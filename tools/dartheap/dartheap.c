/* dartheap output (see dartheap.h and README.md): the live blocks of one or more snapshots as the
 * object graph of a Dart VM heap snapshot, so DevTools' memory views work on a native heap.
 *
 * The whole graph is built before the first byte is written, because the format puts the total
 * reference count ahead of the objects. Memory is O(blocks + references): block contents are
 * scanned in place, never copied. */
#include "heapdump/tools/dartheap.h"

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/tools/sites.h"
#include "heapdump/tools/util.h"
#include "names.h"

/* JavaScript readers of the format (graphexplorer, DevTools compiled to JavaScript) decode
 * varints with 32-bit bitwise operators, so every count and object id stays below 2^31. */
#define DART_COUNT_LIMIT ((uint64_t)1 << 31)

#define POINTER_SIZE 8

/* Object ids: 1 is the root; blocks follow, snapshot by snapshot, each sorted by address. */
#define ROOT_ID 1u

/* The root's class: "Root" with an empty library, which DevTools takes for the root. */
#define ROOT_CLASS_ID 1u

/* ---- classes: one per (library, site name) ---- */

typedef struct dart_class {
  char *name;
  char *library_name;
  char *library_uri;
} dart_class;

typedef struct class_table {
  dart_class *classes; /* classes[i] has class id i + 1 */
  size_t count, capacity;
  uint32_t *slots; /* open addressing over (library, name); class id, 0 = empty */
  size_t slot_capacity;
} class_table;

static uint64_t class_key_hash(const char *library, const char *name) {
  /* The separator keeps ("ab", "c") and ("a", "bc") apart. */
  return hd_fnv1a(hd_fnv1a(HD_FNV1A_BASIS, library, strlen(library)) * 31 + 1, name, strlen(name));
}

static void class_table_free(class_table *t) {
  for (size_t i = 0; i < t->count; i++) {
    free(t->classes[i].name);
    free(t->classes[i].library_name);
    free(t->classes[i].library_uri);
  }
  free(t->classes);
  free(t->slots);
  memset(t, 0, sizeof *t);
}

static bool class_slots_grow(class_table *t) {
  size_t capacity = t->slot_capacity ? t->slot_capacity * 2 : 256;
  uint32_t *slots = calloc(capacity, sizeof *slots);
  if (slots == NULL) return false;
  for (size_t i = 0; i < t->count; i++) {
    const dart_class *c = &t->classes[i];
    size_t s = class_key_hash(c->library_name, c->name) & (capacity - 1);
    while (slots[s] != 0) s = (s + 1) & (capacity - 1);
    slots[s] = (uint32_t)(i + 1);
  }
  free(t->slots);
  t->slots = slots;
  t->slot_capacity = capacity;
  return true;
}

/* The id of the class (library, name), added if new; 0 if out of memory. uri is used only when
 * the class is new. */
static uint32_t class_intern(class_table *t, const char *library, const char *uri,
                             const char *name) {
  if ((t->count + 1) * 2 > t->slot_capacity && !class_slots_grow(t)) return 0;
  size_t s = class_key_hash(library, name) & (t->slot_capacity - 1);
  for (; t->slots[s] != 0; s = (s + 1) & (t->slot_capacity - 1)) {
    const dart_class *c = &t->classes[t->slots[s] - 1];
    if (strcmp(c->library_name, library) == 0 && strcmp(c->name, name) == 0) return t->slots[s];
  }
  if (t->count == t->capacity) {
    size_t capacity = t->capacity ? t->capacity * 2 : 64;
    dart_class *grown = realloc(t->classes, capacity * sizeof *grown);
    if (grown == NULL) return 0;
    t->classes = grown;
    t->capacity = capacity;
  }
  dart_class *c = &t->classes[t->count];
  c->name = strdup(name);
  c->library_name = strdup(library);
  c->library_uri = strdup(uri);
  if (c->name == NULL || c->library_name == NULL || c->library_uri == NULL) {
    free(c->name);
    free(c->library_name);
    free(c->library_uri);
    return 0;
  }
  t->count++;
  t->slots[s] = (uint32_t)t->count;
  return (uint32_t)t->count;
}

/* ---- the graph ---- */

typedef struct graph {
  const hd_reassembler *r;
  hd_symbolizer *symbolizer;
  bool per_process_libraries;
  uint32_t object_count; /* including the root; ids 1..object_count */
  /* Indexed by object id; entry 0 is unused, and the root has no allocation. */
  const hd_snapshot_allocation **allocation;
  uint32_t *class_of;
  uint32_t *hash;
  /* References in CSR form: object id's are edges[edge_start[id] .. edge_start[id + 1]). */
  uint32_t *edge_start;
  uint32_t *edges;
  size_t edge_count, edge_capacity;
  uint32_t *root_refs;
  size_t root_ref_count;
  class_table classes;
} graph;

static void graph_free(graph *g) {
  free(g->allocation);
  free(g->class_of);
  free(g->hash);
  free(g->edge_start);
  free(g->edges);
  free(g->root_refs);
  class_table_free(&g->classes);
}

typedef struct sort_entry {
  uint64_t address;
  const hd_snapshot_allocation *allocation;
} sort_entry;

static int by_address(const void *a, const void *b) {
  const sort_entry *x = a, *y = b;
  return x->address < y->address ? -1 : x->address > y->address;
}

/* Assigns object ids: the root, then each snapshot's blocks in address order, so the output does
 * not depend on the order the blocks arrived in. */
static HD_MUST_CHECK int assign_ids(graph *g, char *error, size_t error_size) {
  uint64_t total = 1;
  for (size_t k = 0; k < g->r->snapshot_count; k++) total += g->r->snapshots[k]->allocation_count;
  if (total >= DART_COUNT_LIMIT) {
    return hd_tool_fail(
        error, error_size, -EOVERFLOW, "%llu blocks: the dartheap format holds at most %llu",
        (unsigned long long)(total - 1), (unsigned long long)(DART_COUNT_LIMIT - 2));
  }
  g->object_count = (uint32_t)total;
  size_t n = (size_t)total + 1;
  g->allocation = calloc(n, sizeof *g->allocation);
  g->class_of = calloc(n, sizeof *g->class_of);
  g->hash = calloc(n, sizeof *g->hash);
  g->edge_start = calloc(n + 1, sizeof *g->edge_start);
  if (!g->allocation || !g->class_of || !g->hash || !g->edge_start) {
    return hd_tool_fail(error, error_size, -ENOMEM, "out of memory for %zu objects", n);
  }
  uint32_t next = ROOT_ID + 1;
  for (size_t k = 0; k < g->r->snapshot_count; k++) {
    const hd_snapshot *s = g->r->snapshots[k];
    if (s->allocation_count == 0) continue;
    sort_entry *sorted = malloc(s->allocation_count * sizeof *sorted);
    if (sorted == NULL)
      return hd_tool_fail(error, error_size, -ENOMEM, "out of memory sorting blocks");
    for (size_t i = 0; i < s->allocation_count; i++) {
      sorted[i] = (sort_entry){s->allocations[i].address, &s->allocations[i]};
    }
    qsort(sorted, s->allocation_count, sizeof *sorted, by_address);
    for (size_t i = 0; i < s->allocation_count; i++, next++) {
      g->allocation[next] = sorted[i].allocation;
    }
    free(sorted);
  }
  return 0;
}

/* ---- classes of the blocks ---- */

enum { kSiteNameSize = 4096 };

/* The class of the blocks allocated at trace's site in snapshot s: named by the site, in the
 * site's module's library (one per process in a multi-process graph). 0 if out of memory. */
static uint32_t site_class(graph *g, const hd_snapshot *s, const hd_snapshot_stack_trace *trace,
                           char *name) {
  char process[40];
  hd_dart_package_part(s->process_name, process, sizeof process);
  hd_site_name(g->symbolizer, s, trace, name, kSiteNameSize);
  const char *module = hd_site_module(g->symbolizer, s, trace);
  if (module == NULL || module[0] == 0) module = "(no module)";
  char *library = NULL, *uri = NULL;
  char *module_uri = hd_dart_uri_encode(module), *process_uri = hd_dart_uri_encode(process);
  if (module_uri != NULL && process_uri != NULL) {
    unsigned long long pid = s->pid;
    if (g->per_process_libraries) {
      library = hd_dart_format("package:%s.%llu/%s", process, pid, module);
      uri = hd_dart_format("package:%s.%llu/%s", process_uri, pid, module_uri);
    } else {
      library = hd_dart_format("package:%s", module);
      uri = hd_dart_format("package:%s", module_uri);
    }
  }
  uint32_t class_id = library && uri ? class_intern(&g->classes, library, uri, name) : 0;
  free(module_uri);
  free(process_uri);
  free(library);
  free(uri);
  return class_id;
}

static HD_MUST_CHECK int assign_classes(graph *g, char *error, size_t error_size) {
  if (class_intern(&g->classes, "", "", "Root") != ROOT_CLASS_ID) {
    return hd_tool_fail(error, error_size, -ENOMEM, "out of memory for classes");
  }
  g->class_of[ROOT_ID] = ROOT_CLASS_ID;
  char *name = malloc(kSiteNameSize);
  if (name == NULL) return hd_tool_fail(error, error_size, -ENOMEM, "out of memory for classes");
  uint32_t id = ROOT_ID + 1;
  bool ok = true;
  for (size_t k = 0; k < g->r->snapshot_count && ok; k++) {
    const hd_snapshot *s = g->r->snapshots[k];
    /* Sites are named once per stack trace, not once per block; blocks whose trace never arrived
     * share the slot after the last trace. */
    uint32_t *class_of_trace = calloc(s->stack_trace_count + 1, sizeof *class_of_trace);
    ok = class_of_trace != NULL;
    for (size_t i = 0; i < s->allocation_count && ok; i++, id++) {
      static const hd_snapshot_stack_trace kNoTrace = {0};
      const hd_snapshot_stack_trace *trace =
          hd_snapshot_find_stack_trace(s, g->allocation[id]->stack_trace_key);
      size_t slot = trace ? (size_t)(trace - s->stack_traces) : s->stack_trace_count;
      if (class_of_trace[slot] == 0) {
        class_of_trace[slot] = site_class(g, s, trace ? trace : &kNoTrace, name);
      }
      g->class_of[id] = class_of_trace[slot];
      ok = g->class_of[id] != 0;
    }
    free(class_of_trace);
  }
  free(name);
  return ok ? 0 : hd_tool_fail(error, error_size, -ENOMEM, "out of memory for classes");
}

/* ---- references: a conservative scan of each block's contents ---- */

typedef struct address_range {
  uint64_t start, end; /* [start, end) */
} address_range;

static HD_MUST_CHECK int add_edge(graph *g, uint32_t to, char *error, size_t error_size) {
  if (g->edge_count + 1 >= DART_COUNT_LIMIT) {
    return hd_tool_fail(
        error, error_size, -EOVERFLOW,
        "more than %llu references between blocks: the dartheap format holds no more",
        (unsigned long long)(DART_COUNT_LIMIT - 1));
  }
  if (g->edge_count == g->edge_capacity) {
    size_t capacity = g->edge_capacity ? g->edge_capacity * 2 : 4096;
    uint32_t *grown = realloc(g->edges, capacity * sizeof *grown);
    if (grown == NULL)
      return hd_tool_fail(error, error_size, -ENOMEM, "out of memory for references");
    g->edges = grown;
    g->edge_capacity = capacity;
  }
  g->edges[g->edge_count++] = to;
  return 0;
}

static uint64_t load_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = POINTER_SIZE - 1; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

/* The index in ranges (sorted, count > 0) of the block holding address, or -1. */
static ptrdiff_t find_block(const address_range *ranges, size_t count, uint64_t address) {
  if (address < ranges[0].start) return -1;
  size_t lo = 0, hi = count; /* the answer is the last start <= address, in [lo, hi) */
  while (hi - lo > 1) {
    size_t mid = lo + (hi - lo) / 2;
    if (ranges[mid].start <= address) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return address < ranges[lo].end ? (ptrdiff_t)lo : -1;
}

static HD_MUST_CHECK int scan_contents(graph *g, char *error, size_t error_size) {
  uint32_t first = ROOT_ID + 1; /* the root's references are kept apart, in root_refs */
  for (size_t k = 0; k < g->r->snapshot_count; k++) {
    const hd_snapshot *s = g->r->snapshots[k];
    size_t count = s->allocation_count;
    if (count == 0) continue;
    address_range *ranges = malloc(count * sizeof *ranges);
    if (ranges == NULL)
      return hd_tool_fail(error, error_size, -ENOMEM, "out of memory for references");
    for (size_t i = 0; i < count; i++) {
      const hd_snapshot_allocation *a = g->allocation[first + i];
      /* A zero-size block still owns its address, which a pointer to it holds. */
      const uint64_t block = hd_snapshot_block_size(s, a);
      const uint64_t size = block ? block : 1;
      ranges[i].start = a->address;
      ranges[i].end = a->address + size < a->address ? UINT64_MAX : a->address + size;
    }
    int rc = 0;
    for (size_t i = 0; i < count && rc == 0; i++) {
      uint32_t id = first + (uint32_t)i;
      const hd_snapshot_allocation *a = g->allocation[id];
      const hd_snapshot_block *b = hd_snapshot_find_block(s, a->address);
      if (b != NULL && b->size != hd_snapshot_block_size(s, a)) {
        rc = hd_tool_fail(error, error_size, -EINVAL,
                          "block 0x%llx: %zu bytes of contents for a block of %llu bytes",
                          (unsigned long long)a->address, b->size,
                          (unsigned long long)hd_snapshot_block_size(s, a));
      }
      if (b != NULL && rc == 0) {
        /* Only words aligned in the process's address space can hold a pointer the program
         * follows; block addresses need not be 8-aligned in a hostile snapshot. */
        size_t offset = (POINTER_SIZE - (size_t)(a->address % POINTER_SIZE)) % POINTER_SIZE;
        for (; offset + POINTER_SIZE <= b->size && rc == 0; offset += POINTER_SIZE) {
          ptrdiff_t target = find_block(ranges, count, load_le64(b->bytes + offset));
          if (target >= 0) rc = add_edge(g, first + (uint32_t)target, error, error_size);
        }
      }
      g->edge_start[id + 1] = (uint32_t)g->edge_count;
    }
    free(ranges);
    if (rc != 0) return rc;
    first += (uint32_t)count;
  }
  return 0;
}

/* ---- reachability: the root references the source components of the block graph ---- */

/* Tarjan's strongly connected components, iteratively (a linked list of a million blocks would
 * overflow a recursive walk). component[v] is filled for every block v. */
static HD_MUST_CHECK int strongly_connected(const graph *g, uint32_t *component, char *error,
                                            size_t error_size) {
  uint32_t n = g->object_count;
  uint32_t *index = calloc((size_t)n + 1, sizeof *index);
  uint32_t *low = calloc((size_t)n + 1, sizeof *low);
  uint32_t *stack = malloc(((size_t)n + 1) * sizeof *stack);
  uint32_t *calls = malloc(((size_t)n + 1) * sizeof *calls);
  uint32_t *next_edge = malloc(((size_t)n + 1) * sizeof *next_edge);
  bool *on_stack = calloc((size_t)n + 1, sizeof *on_stack);
  int rc = 0;
  if (!index || !low || !stack || !calls || !next_edge || !on_stack) {
    rc = hd_tool_fail(error, error_size, -ENOMEM, "out of memory for the reachability pass");
    goto out;
  }
  uint32_t counter = 0, stack_size = 0, components = 0;
  for (uint32_t start = ROOT_ID + 1; start <= n; start++) {
    if (index[start] != 0) continue;
    uint32_t depth = 0;
    calls[depth++] = start;
    index[start] = low[start] = ++counter;
    next_edge[start] = g->edge_start[start];
    stack[stack_size++] = start;
    on_stack[start] = true;
    while (depth > 0) {
      uint32_t v = calls[depth - 1];
      if (next_edge[v] < g->edge_start[v + 1]) {
        uint32_t w = g->edges[next_edge[v]++];
        if (index[w] == 0) {
          index[w] = low[w] = ++counter;
          next_edge[w] = g->edge_start[w];
          stack[stack_size++] = w;
          on_stack[w] = true;
          calls[depth++] = w;
        } else if (on_stack[w] && index[w] < low[v]) {
          low[v] = index[w];
        }
        continue;
      }
      depth--;
      if (low[v] == index[v]) {
        uint32_t w;
        do {
          w = stack[--stack_size];
          on_stack[w] = false;
          component[w] = components;
        } while (w != v);
        components++;
      }
      if (depth > 0) {
        uint32_t parent = calls[depth - 1];
        if (low[v] < low[parent]) low[parent] = low[v];
      }
    }
  }
out:
  free(index);
  free(low);
  free(stack);
  free(calls);
  free(next_edge);
  free(on_stack);
  return rc;
}

/* The root references one block (the lowest id) of each component nothing outside it references:
 * the blocks no other block references, and one block of each cycle unreachable otherwise. Then
 * every block is reachable from the root with the fewest root references possible, so DevTools'
 * retaining paths stay those of the program. */
static HD_MUST_CHECK int choose_root_references(graph *g, char *error, size_t error_size) {
  uint32_t n = g->object_count;
  uint32_t *component = calloc((size_t)n + 1, sizeof *component);
  /* Per component: 0 = a source not yet referenced by the root, 1 = referenced from outside
   * or by the root already. */
  uint8_t *covered = calloc((size_t)n + 1, 1);
  int rc = 0;
  if (component == NULL || covered == NULL) {
    rc = hd_tool_fail(error, error_size, -ENOMEM, "out of memory for the reachability pass");
    goto out;
  }
  rc = strongly_connected(g, component, error, error_size);
  if (rc != 0) goto out;
  for (uint32_t v = ROOT_ID + 1; v <= n; v++) {
    for (uint32_t e = g->edge_start[v]; e < g->edge_start[v + 1]; e++) {
      uint32_t w = g->edges[e];
      if (component[w] != component[v]) covered[component[w]] = 1;
    }
  }
  g->root_refs = malloc(((size_t)n + 1) * sizeof *g->root_refs);
  if (g->root_refs == NULL) {
    rc = hd_tool_fail(error, error_size, -ENOMEM, "out of memory for the root's references");
    goto out;
  }
  for (uint32_t v = ROOT_ID + 1; v <= n; v++) {
    if (!covered[component[v]]) {
      covered[component[v]] = 1;
      g->root_refs[g->root_ref_count++] = v;
    }
  }
  if (g->edge_count + g->root_ref_count >= DART_COUNT_LIMIT) {
    rc = hd_tool_fail(
        error, error_size, -EOVERFLOW, "%zu references: the dartheap format holds at most %llu",
        g->edge_count + g->root_ref_count, (unsigned long long)(DART_COUNT_LIMIT - 1));
  }
out:
  free(component);
  free(covered);
  return rc;
}

/* ---- identity hash codes ---- */

static uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= UINT64_C(0xbf58476d1ce4e5b9);
  x ^= x >> 27;
  x *= UINT64_C(0x94d049bb133111eb);
  x ^= x >> 31;
  return x;
}

/* 31 bits, as every value a JavaScript reader reads; never 0, which means "no hash". */
static uint32_t fold_nonzero(uint64_t h) {
  uint32_t v = (uint32_t)(h ^ (h >> 32)) & 0x7fffffffu;
  return v ? v : 1;
}

/* The allocation's address and timestamp identify it across snapshots of its process; a block
 * freed and reallocated at the same address is a new object to DevTools' diff. */
static uint32_t allocation_hash(const hd_snapshot_allocation *a) {
  uint64_t when = mix64((uint64_t)a->timestamp + UINT64_C(0x9e3779b97f4a7c15));
  return fold_nonzero(mix64(a->address ^ when));
}

typedef struct hash_entry {
  uint64_t key; /* class id << 32 | hash */
  uint32_t id;
} hash_entry;

static int by_key_then_id(const void *a, const void *b) {
  const hash_entry *x = a, *y = b;
  if (x->key != y->key) return x->key < y->key ? -1 : 1;
  return x->id < y->id ? -1 : x->id > y->id;
}

typedef struct key_set {
  uint64_t *keys; /* 0 = empty; a key is never 0 because its hash is not */
  size_t capacity;
} key_set;

static bool key_set_has(const key_set *s, uint64_t key) {
  for (size_t i = mix64(key) & (s->capacity - 1);; i = (i + 1) & (s->capacity - 1)) {
    if (s->keys[i] == 0) return false;
    if (s->keys[i] == key) return true;
  }
}

static void key_set_put(key_set *s, uint64_t key) {
  size_t i = mix64(key) & (s->capacity - 1);
  while (s->keys[i] != 0 && s->keys[i] != key) i = (i + 1) & (s->capacity - 1);
  s->keys[i] = key;
}

/* DevTools matches objects of a class across snapshots by identity hash, so within a class they
 * must be unique. With 31 bits, a class of a million blocks has collisions; the object with the
 * higher id of a colliding pair gets the first free rehash of its value, deterministically. */
static HD_MUST_CHECK int assign_hashes(graph *g, char *error, size_t error_size) {
  uint32_t n = g->object_count;
  g->hash[ROOT_ID] = fold_nonzero(mix64(ROOT_ID));
  size_t count = n - ROOT_ID;
  if (count == 0) return 0;
  hash_entry *entries = malloc(count * sizeof *entries);
  key_set taken = {0};
  taken.capacity = 64;
  while (taken.capacity < count * 2) taken.capacity *= 2;
  taken.keys = calloc(taken.capacity, sizeof *taken.keys);
  if (entries == NULL || taken.keys == NULL) {
    free(entries);
    free(taken.keys);
    return hd_tool_fail(error, error_size, -ENOMEM, "out of memory for identity hash codes");
  }
  for (uint32_t v = ROOT_ID + 1; v <= n; v++) {
    g->hash[v] = allocation_hash(g->allocation[v]);
    entries[v - ROOT_ID - 1] = (hash_entry){(uint64_t)g->class_of[v] << 32 | g->hash[v], v};
    key_set_put(&taken, entries[v - ROOT_ID - 1].key);
  }
  qsort(entries, count, sizeof *entries, by_key_then_id);
  for (size_t i = 1; i < count; i++) {
    if (entries[i].key != entries[i - 1].key) continue;
    uint32_t v = entries[i].id;
    uint64_t class_bits = (uint64_t)g->class_of[v] << 32;
    uint64_t h = g->hash[v];
    do {
      h = fold_nonzero(mix64(h + UINT64_C(0x9e3779b97f4a7c15)));
    } while (key_set_has(&taken, class_bits | h));
    key_set_put(&taken, class_bits | h);
    g->hash[v] = (uint32_t)h;
  }
  free(entries);
  free(taken.keys);
  return 0;
}

/* ---- output ---- */

static void put_bytes(FILE *out, const void *bytes, size_t size) { fwrite(bytes, 1, size, out); }

static void put_uleb(FILE *out, uint64_t v) {
  uint8_t buf[10];
  size_t n = 0;
  do {
    uint8_t byte = v & 0x7f;
    v >>= 7;
    buf[n++] = byte | (v ? 0x80 : 0);
  } while (v);
  put_bytes(out, buf, n);
}

static void put_string(FILE *out, const char *s) {
  size_t len = strlen(s);
  put_uleb(out, len);
  put_bytes(out, s, len);
}

enum { kNoData = 0 };

static char *graph_name(const graph *g, const hd_dartheap_options *options) {
  if (options != NULL && options->name != NULL) return strdup(options->name);
  const hd_reassembler *r = g->r;
  if (r->snapshot_count == 1 && r->snapshots[0]->has_header) {
    return hd_dart_format("%s (pid %llu)", r->snapshots[0]->process_name,
                          (unsigned long long)r->snapshots[0]->pid);
  }
  if (r->snapshot_count > 1) return hd_dart_format("%zu processes", r->snapshot_count);
  return strdup("heapdump");
}

static HD_MUST_CHECK int write_graph(const graph *g, const char *name, FILE *out, char *error,
                                     size_t error_size) {
  uint64_t shallow_size = 0;
  for (uint32_t v = ROOT_ID + 1; v <= g->object_count; v++) shallow_size += g->allocation[v]->size;

  put_bytes(out, "dartheap", 8);
  put_uleb(out, 0); /* flags */
  put_string(out, name);
  put_uleb(out, shallow_size);
  put_uleb(out, shallow_size); /* capacity: the live blocks are all we know of the heap */
  put_uleb(out, 0);            /* external size: a block's memory is all its own */

  put_uleb(out, g->classes.count);
  for (size_t c = 0; c < g->classes.count; c++) {
    const dart_class *k = &g->classes.classes[c];
    put_uleb(out, 0); /* flags */
    put_string(out, k->name);
    put_string(out, k->library_name);
    put_string(out, k->library_uri);
    put_string(out, ""); /* reserved */
    put_uleb(out, 0);    /* fields: a block's words have no names */
  }

  put_uleb(out, g->edge_count + g->root_ref_count);
  put_uleb(out, g->object_count);
  put_uleb(out, ROOT_CLASS_ID);
  put_uleb(out, 0);
  put_uleb(out, kNoData);
  put_uleb(out, g->root_ref_count);
  for (size_t i = 0; i < g->root_ref_count; i++) put_uleb(out, g->root_refs[i]);
  for (uint32_t v = ROOT_ID + 1; v <= g->object_count; v++) {
    put_uleb(out, g->class_of[v]);
    put_uleb(out, g->allocation[v]->size);
    put_uleb(out, kNoData);
    put_uleb(out, g->edge_start[v + 1] - g->edge_start[v]);
    for (uint32_t e = g->edge_start[v]; e < g->edge_start[v + 1]; e++) put_uleb(out, g->edges[e]);
  }

  put_uleb(out, 0); /* external properties */
  for (uint32_t v = ROOT_ID; v <= g->object_count; v++) put_uleb(out, g->hash[v]);

  if (fflush(out) != 0 || ferror(out)) {
    int code = errno ? errno : EIO;
    return hd_tool_fail(error, error_size, -code, "writing the dartheap file: %s", strerror(code));
  }
  return 0;
}

int hd_dartheap_write(const hd_reassembler *r, const hd_dartheap_options *options, FILE *out,
                      char *error, size_t error_size) {
  if (r == NULL || out == NULL)
    return hd_tool_fail(error, error_size, -EINVAL, "no snapshot or no output");
  graph g = {.r = r, .symbolizer = options ? options->symbolizer : NULL};
  for (size_t k = 0; k < r->snapshot_count; k++) {
    if (r->snapshots[k]->has_header) g.per_process_libraries = true;
  }
  char *name = NULL;
  int rc = assign_ids(&g, error, error_size);
  if (rc == 0) rc = assign_classes(&g, error, error_size);
  if (rc == 0) rc = scan_contents(&g, error, error_size);
  if (rc == 0) rc = choose_root_references(&g, error, error_size);
  if (rc == 0) rc = assign_hashes(&g, error, error_size);
  if (rc == 0) {
    name = graph_name(&g, options);
    if (name == NULL) rc = hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
  }
  if (rc == 0) {
    errno = 0;
    rc = write_graph(&g, name, out, error, error_size);
  }
  free(name);
  graph_free(&g);
  return rc;
}
