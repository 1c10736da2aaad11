/* Reassembly of snapshot streams into in-memory snapshots, with the receiver-side checks. */
#define _GNU_SOURCE
#include "heapdump/fidl/snapshot.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "heapdump/contract/must_check.h"
#include "heapdump_client.bindings.h"

_Static_assert(HD_NAME_MAX == heapdump_client_Constants_MAX_NAME_LENGTH,
               "names as the IDL bounds them");

/* ---- a u64 -> index map (open addressing, linear probing) ---- */

static size_t hash_u64(uint64_t key) {
  key ^= key >> 33;
  key *= UINT64_C(0xff51afd7ed558ccd);
  key ^= key >> 33;
  return (size_t)key;
}

bool hd_u64_map_find(const hd_u64_map *m, uint64_t key, size_t *index) {
  if (m->capacity == 0) return false;
  for (size_t i = hash_u64(key) & (m->capacity - 1);; i = (i + 1) & (m->capacity - 1)) {
    if (m->slots[i] == 0) return false;
    if (m->keys[i] == key) {
      *index = m->slots[i] - 1;
      return true;
    }
  }
}

static bool map_put_unchecked(hd_u64_map *m, uint64_t key, size_t index) {
  for (size_t i = hash_u64(key) & (m->capacity - 1);; i = (i + 1) & (m->capacity - 1)) {
    if (m->slots[i] == 0) {
      m->keys[i] = key;
      m->slots[i] = index + 1;
      m->count++;
      return true;
    }
  }
}

bool hd_u64_map_put(hd_u64_map *m, uint64_t key, size_t index) {
  if ((m->count + 1) * 2 > m->capacity) {
    size_t capacity = m->capacity ? m->capacity * 2 : 64;
    hd_u64_map bigger = {calloc(capacity, sizeof(uint64_t)), calloc(capacity, sizeof(size_t)),
                         capacity, 0};
    if (bigger.keys == NULL || bigger.slots == NULL) {
      free(bigger.keys);
      free(bigger.slots);
      return false;
    }
    for (size_t i = 0; i < m->capacity; i++) {
      if (m->slots[i] != 0) map_put_unchecked(&bigger, m->keys[i], m->slots[i] - 1);
    }
    free(m->keys);
    free(m->slots);
    *m = bigger;
  }
  return map_put_unchecked(m, key, index);
}

void hd_u64_map_free(hd_u64_map *m) {
  free(m->keys);
  free(m->slots);
  memset(m, 0, sizeof *m);
}

/* Makes room for one more element in a growable array. */
static bool reserve_one(void **items, size_t count, size_t *capacity, size_t item_size) {
  if (count < *capacity) return true;
  size_t new_capacity = *capacity ? *capacity * 2 : 16;
  void *bigger = realloc(*items, new_capacity * item_size);
  if (bigger == NULL) return false;
  *items = bigger;
  *capacity = new_capacity;
  return true;
}

#define RESERVE(s, field, count, capacity) \
  reserve_one((void **)&(s)->field, (s)->count, &(s)->capacity, sizeof *(s)->field)

/* ---- reassembler ---- */

static HD_MUST_CHECK hd_status fail(hd_reassembler *r, hd_status status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->error, sizeof r->error, fmt, ap);
  va_end(ap);
  return status;
}

void hd_reassembler_init(hd_reassembler *r) { memset(r, 0, sizeof *r); }

static void snapshot_free(hd_snapshot *s) {
  free(s->allocations);
  for (size_t i = 0; i < s->stack_trace_count; i++) free(s->stack_traces[i].addresses);
  free(s->stack_traces);
  free(s->threads);
  for (size_t i = 0; i < s->region_count; i++) free(s->regions[i].name);
  free(s->regions);
  if (!s->blocks_spilled) {
    for (size_t i = 0; i < s->block_count; i++) free(s->blocks[i].bytes);
  }
  free(s->blocks);
  for (size_t i = 0; i < s->root_count; i++) {
    if (!s->blocks_spilled) free(s->roots[i].contents.bytes);
    free(s->roots[i].name);
  }
  free(s->roots);
  free(s->samples);
  free(s->command_line);
  hd_u64_map_free(&s->root_index);
  for (size_t i = 0; i < s->known_location_count; i++) {
    hd_snapshot_known_location *k = &s->known_locations[i];
    for (size_t f = 0; f < k->frame_count; f++) {
      free((char *)k->frames[f].function);
      free((char *)k->frames[f].file);
    }
    free(k->frames);
  }
  free(s->known_locations);
  hd_u64_map_free(&s->known_location_index);
  hd_u64_map_free(&s->allocation_index);
  hd_u64_map_free(&s->stack_trace_index);
  hd_u64_map_free(&s->thread_index);
  hd_u64_map_free(&s->region_index);
  hd_u64_map_free(&s->block_index);
  free(s);
}

void hd_reassembler_destroy(hd_reassembler *r) {
  for (size_t i = 0; i < r->snapshot_count; i++) snapshot_free(r->snapshots[i]);
  free(r->snapshots);
  if (r->spill_map != NULL) munmap(r->spill_map, r->spill_end);
  if (r->spilling) close(r->spill_fd);
  memset(r, 0, sizeof *r);
}

void hd_reassembler_spill_contents(hd_reassembler *r, int fd) {
  r->spilling = true;
  r->spill_fd = fd;
  r->spill_end = 0;
}

static bool pwrite_all(int fd, const uint8_t *bytes, size_t size, uint64_t offset) {
  while (size > 0) {
    ssize_t n = pwrite(fd, bytes, size, (off_t)offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    bytes += n;
    size -= (size_t)n;
    offset += (uint64_t)n;
  }
  return true;
}

/* Appends a chunk of block b's contents to the spill file. A block's chunks must lie end to end:
 * if another block's came in between, what it has so far is first copied to the end. */
static HD_MUST_CHECK hd_status spill_block(hd_reassembler *r, hd_snapshot *s, hd_snapshot_block *b,
                                           const uint8_t *bytes, size_t size) {
  s->blocks_spilled = true;
  if (b->size > 0 && b->spill_offset + b->size != r->spill_end) {
    uint8_t buffer[1 << 14];
    for (size_t moved = 0; moved < b->size;) {
      size_t n = b->size - moved < sizeof buffer ? b->size - moved : sizeof buffer;
      if (pread(r->spill_fd, buffer, n, (off_t)(b->spill_offset + moved)) != (ssize_t)n ||
          !pwrite_all(r->spill_fd, buffer, n, r->spill_end + moved)) {
        return fail(r, HD_ERR_IO, "cannot write block contents to the temporary file: %s",
                    strerror(errno));
      }
      moved += n;
    }
    b->spill_offset = r->spill_end;
    r->spill_end += b->size;
  }
  if (b->size == 0) b->spill_offset = r->spill_end;
  if (!pwrite_all(r->spill_fd, bytes, size, r->spill_end)) {
    return fail(r, HD_ERR_IO, "cannot write block contents to the temporary file: %s",
                strerror(errno));
  }
  r->spill_end += size;
  b->size += size;
  return HD_OK;
}

/* Maps the spill file and points every spilled block's bytes into it. */
static HD_MUST_CHECK hd_status map_spilled(hd_reassembler *r) {
  if (!r->spilling || r->spill_end == 0 || r->spill_map != NULL) return HD_OK;
  void *map = mmap(NULL, r->spill_end, PROT_READ, MAP_SHARED, r->spill_fd, 0);
  if (map == MAP_FAILED) {
    return fail(r, HD_ERR_NO_MEMORY, "cannot map the block contents: %s", strerror(errno));
  }
  r->spill_map = map;
  for (size_t k = 0; k < r->snapshot_count; k++) {
    hd_snapshot *s = r->snapshots[k];
    for (size_t i = 0; s->blocks_spilled && i < s->block_count; i++) {
      hd_snapshot_block *b = &s->blocks[i];
      if (b->size > 0) b->bytes = (uint8_t *)map + b->spill_offset;
    }
    for (size_t i = 0; s->blocks_spilled && i < s->root_count; i++) {
      hd_snapshot_block *b = &s->roots[i].contents;
      if (b->size > 0) b->bytes = (uint8_t *)map + b->spill_offset;
    }
  }
  return HD_OK;
}

void hd_reassembler_keep(hd_reassembler *r, bool (*keep)(const hd_snapshot *s, void *ctx),
                         void *ctx) {
  size_t kept = 0;
  for (size_t i = 0; i < r->snapshot_count; i++) {
    if (keep(r->snapshots[i], ctx)) {
      r->snapshots[kept++] = r->snapshots[i];
    } else {
      snapshot_free(r->snapshots[i]);
    }
  }
  r->snapshot_count = kept;
}

static hd_snapshot *new_snapshot(hd_reassembler *r) {
  if (!RESERVE(r, snapshots, snapshot_count, snapshot_capacity)) return NULL;
  hd_snapshot *s = calloc(1, sizeof *s);
  if (s != NULL) r->snapshots[r->snapshot_count++] = s;
  return s;
}

static hd_snapshot *current(hd_reassembler *r) {
  return r->snapshot_count ? r->snapshots[r->snapshot_count - 1] : new_snapshot(r);
}

static HD_MUST_CHECK hd_status add_allocation(hd_reassembler *r, hd_snapshot *s,
                                              const heapdump_client_Allocation *a) {
  size_t unused;
  if (!a->has_address) return fail(r, HD_ERR_REASSEMBLY, "allocation without an address");
  if (hd_u64_map_find(&s->allocation_index, a->address, &unused)) {
    return fail(r, HD_ERR_REASSEMBLY, "duplicate allocation at 0x%llx",
                (unsigned long long)a->address);
  }
  if (!RESERVE(s, allocations, allocation_count, allocation_capacity)) return HD_ERR_NO_MEMORY;
  hd_snapshot_allocation *out = &s->allocations[s->allocation_count];
  out->address = a->address;
  out->size = a->size;
  out->stack_trace_key = a->stack_trace_key;
  out->thread_info_key = a->thread_info_key;
  out->timestamp = a->timestamp;
  out->count = a->has_count ? a->count : 1;
  if (!hd_u64_map_put(&s->allocation_index, a->address, s->allocation_count))
    return HD_ERR_NO_MEMORY;
  s->allocation_count++;
  return HD_OK;
}

/* The trace with this key, created empty on first mention. */
static hd_snapshot_stack_trace *stack_trace_slot(hd_snapshot *s, uint64_t key) {
  size_t index;
  if (!hd_u64_map_find(&s->stack_trace_index, key, &index)) {
    if (!RESERVE(s, stack_traces, stack_trace_count, stack_trace_capacity)) return NULL;
    index = s->stack_trace_count;
    s->stack_traces[index] = (hd_snapshot_stack_trace){.key = key};
    if (!hd_u64_map_put(&s->stack_trace_index, key, index)) return NULL;
    s->stack_trace_count++;
  }
  return &s->stack_traces[index];
}

/* How many bytes are allocated for something of `size` bytes that arrives in pieces (a block's
 * contents, a stack trace's addresses). What fits one batch is allocated exactly, as most things
 * arrive whole; past that the allocation grows in steps of a quarter of its power of two, so a
 * large root arriving in thousands of pieces is copied a bounded number of times rather than
 * once per piece (quadratic: minutes for a 32 MiB mapping where realloc cannot move pages), at
 * most a quarter of it unused. A function of the size alone, so nothing needs to remember it. */
static size_t piece_capacity(size_t size) {
  if (size <= HD_MAX_MESSAGE_BYTES) return size;
  const size_t step = ((size_t)1 << (63 - __builtin_clzll((unsigned long long)size))) / 4;
  return (size + step - 1) & ~(step - 1);
}

static HD_MUST_CHECK hd_status add_stack_trace(hd_reassembler *r, hd_snapshot *s, uint64_t key,
                                               const uint64_t *addresses, size_t count,
                                               bool truncated) {
  hd_snapshot_stack_trace *t = stack_trace_slot(s, key);
  if (t == NULL) return HD_ERR_NO_MEMORY;
  t->truncated = t->truncated || truncated;
  if (count == 0) return HD_OK;
  if (t->count + count > (size_t)1 << 24) {
    return fail(r, HD_ERR_REASSEMBLY, "stack trace %llu too long", (unsigned long long)key);
  }
  const size_t have = piece_capacity(t->count * sizeof *t->addresses);
  const size_t need = (t->count + count) * sizeof *t->addresses;
  if (need > have) {
    uint64_t *grown = realloc(t->addresses, piece_capacity(need));
    if (grown == NULL) return HD_ERR_NO_MEMORY;
    t->addresses = grown;
  }
  memcpy(t->addresses + t->count, addresses, count * sizeof *t->addresses);
  t->count += count;
  return HD_OK;
}

/* Appends a chunk to the bytes of b (a block's or a root's). */
static HD_MUST_CHECK hd_status append_bytes(hd_reassembler *r, hd_snapshot *s, hd_snapshot_block *b,
                                            const uint8_t *bytes, size_t size) {
  if (size == 0) return HD_OK;
  /* Allocations may arrive after contents, so the size is checked at the end; this only stops
   * a stream from growing a block without bound. */
  if (b->size + size > ((size_t)1 << 40)) return fail(r, HD_ERR_REASSEMBLY, "block too large");
  if (r->spilling) return spill_block(r, s, b, bytes, size);
  if (b->size + size > piece_capacity(b->size)) {
    uint8_t *grown = realloc(b->bytes, piece_capacity(b->size + size));
    if (grown == NULL) return HD_ERR_NO_MEMORY;
    b->bytes = grown;
  }
  memcpy(b->bytes + b->size, bytes, size);
  b->size += size;
  return HD_OK;
}

static HD_MUST_CHECK hd_status add_block(hd_reassembler *r, hd_snapshot *s, uint64_t address,
                                         const uint8_t *bytes, size_t size) {
  size_t index;
  if (!hd_u64_map_find(&s->block_index, address, &index)) {
    if (!RESERVE(s, blocks, block_count, block_capacity)) return HD_ERR_NO_MEMORY;
    index = s->block_count;
    s->blocks[index] = (hd_snapshot_block){.address = address};
    if (!hd_u64_map_put(&s->block_index, address, index)) return HD_ERR_NO_MEMORY;
    s->block_count++;
  }
  return append_bytes(r, s, &s->blocks[index], bytes, size);
}

/* A root region: its first chunk makes it, each chunk (all carrying the same fields) adds bytes. */
static HD_MUST_CHECK hd_status add_root(hd_reassembler *r, hd_snapshot *s,
                                        const heapdump_client_RootRegion *g, const uint8_t *bytes,
                                        size_t size) {
  if (!g->has_address || !g->has_size) {
    return fail(r, HD_ERR_REASSEMBLY, "root region without an address or a size");
  }
  size_t index;
  if (!hd_u64_map_find(&s->root_index, g->address, &index)) {
    if (!RESERVE(s, roots, root_count, root_capacity)) return HD_ERR_NO_MEMORY;
    index = s->root_count;
    hd_snapshot_root *root = &s->roots[index];
    *root = (hd_snapshot_root){.address = g->address,
                               .size = g->size,
                               .kind = g->kind,
                               .thread_koid = g->thread_koid,
                               .not_read = g->not_read,
                               .contents = {.address = g->address}};
    root->name = strdup(g->has_name ? g->name : "");
    if (root->name == NULL) return HD_ERR_NO_MEMORY;
    if (!hd_u64_map_put(&s->root_index, g->address, index)) {
      free(root->name);
      return HD_ERR_NO_MEMORY;
    }
    s->root_count++;
  }
  hd_snapshot_root *root = &s->roots[index];
  if (root->size != g->size || root->kind != g->kind || root->thread_koid != g->thread_koid ||
      root->not_read != g->not_read) {
    return fail(r, HD_ERR_REASSEMBLY, "root region 0x%llx: chunks disagree",
                (unsigned long long)g->address);
  }
  if (root->not_read && size > 0) {
    return fail(r, HD_ERR_REASSEMBLY, "root region 0x%llx: contents of a root not read",
                (unsigned long long)g->address);
  }
  if (size > root->size - root->contents.size) {
    return fail(r, HD_ERR_REASSEMBLY, "root region 0x%llx: more contents than its size",
                (unsigned long long)g->address);
  }
  return append_bytes(r, s, &root->contents, bytes, size);
}

static HD_MUST_CHECK hd_status add_thread_info(hd_reassembler *r, hd_snapshot *s,
                                               const heapdump_client_ThreadInfo *t) {
  size_t unused;
  if (hd_u64_map_find(&s->thread_index, t->thread_info_key, &unused)) {
    return fail(r, HD_ERR_REASSEMBLY, "duplicate thread info key %llu",
                (unsigned long long)t->thread_info_key);
  }
  if (!RESERVE(s, threads, thread_count, thread_capacity)) return HD_ERR_NO_MEMORY;
  hd_snapshot_thread *out = &s->threads[s->thread_count];
  out->key = t->thread_info_key;
  out->koid = t->koid;
  snprintf(out->name, sizeof out->name, "%s", t->name);
  if (!hd_u64_map_put(&s->thread_index, t->thread_info_key, s->thread_count))
    return HD_ERR_NO_MEMORY;
  s->thread_count++;
  return HD_OK;
}

static HD_MUST_CHECK hd_status add_region(hd_reassembler *r, hd_snapshot *s,
                                          const heapdump_client_ExecutableRegion *g) {
  size_t unused;
  if (hd_u64_map_find(&s->region_index, g->address, &unused)) {
    return fail(r, HD_ERR_REASSEMBLY, "duplicate executable region at 0x%llx",
                (unsigned long long)g->address);
  }
  if (!RESERVE(s, regions, region_count, region_capacity)) return HD_ERR_NO_MEMORY;
  hd_snapshot_region *out = &s->regions[s->region_count];
  memset(out, 0, sizeof *out);
  out->address = g->address;
  out->size = g->size;
  out->file_offset = g->file_offset;
  out->vaddr = g->vaddr;
  if (g->has_build_id) {
    out->build_id_size = g->build_id.value.size;
    memcpy(out->build_id, g->build_id.value.bytes, out->build_id_size);
  }
  out->name = strdup(g->name);
  if (out->name == NULL) return HD_ERR_NO_MEMORY;
  if (!hd_u64_map_put(&s->region_index, g->address, s->region_count)) {
    free(out->name);
    return HD_ERR_NO_MEMORY;
  }
  s->region_count++;
  return HD_OK;
}

static HD_MUST_CHECK hd_status add_counters(hd_reassembler *r, hd_snapshot *s,
                                            const heapdump_client_StackTraceCounters *c) {
  hd_snapshot_stack_trace *t = stack_trace_slot(s, c->stack_trace_key);
  if (t == NULL) return HD_ERR_NO_MEMORY;
  if (t->has_counters) {
    return fail(r, HD_ERR_REASSEMBLY, "duplicate counters for stack trace %llu",
                (unsigned long long)c->stack_trace_key);
  }
  t->has_counters = true;
  t->allocated_blocks = c->allocated_blocks;
  t->allocated_bytes = c->allocated_bytes;
  t->has_temporary = c->has_temporary_blocks;
  t->temporary_blocks = c->temporary_blocks;
  t->peak_blocks = c->peak_blocks;
  t->peak_bytes = c->peak_bytes;
  t->counts_unsettled = c->has_unsettled && c->unsettled;
  return HD_OK;
}

hd_status hd_reassembler_add(void *reassembler, const hd_element *e) {
  hd_reassembler *r = reassembler;
  const heapdump_client_SnapshotElement *el = e->element;
  if (el->which_element == heapdump_client_SnapshotElement_snapshot_header_tag) {
    hd_snapshot *s = new_snapshot(r);
    if (s == NULL) return HD_ERR_NO_MEMORY;
    s->has_header = true;
    s->pid = el->element.snapshot_header.process_koid;
    snprintf(s->process_name, sizeof s->process_name, "%s",
             el->element.snapshot_header.process_name);
    if (el->element.snapshot_header.has_command_line) {
      s->command_line = strdup(el->element.snapshot_header.command_line);
      if (s->command_line == NULL) return HD_ERR_NO_MEMORY;
    }
    if (el->element.snapshot_header.has_not_read) {
      snprintf(s->not_read, sizeof s->not_read, "%s",
               el->element.snapshot_header.not_read[0] ? el->element.snapshot_header.not_read
                                                       : "no reason given");
    }
    return HD_OK;
  }
  hd_snapshot *s = current(r);
  if (s == NULL) return HD_ERR_NO_MEMORY;
  switch (el->which_element) {
    case heapdump_client_SnapshotElement_allocation_tag:
      return add_allocation(r, s, &el->element.allocation);
    case heapdump_client_SnapshotElement_stack_trace_tag:
      if (!el->element.stack_trace.has_stack_trace_key) {
        return fail(r, HD_ERR_REASSEMBLY, "stack trace without a key");
      }
      return add_stack_trace(
          r, s, el->element.stack_trace.stack_trace_key, e->addresses, e->address_count,
          el->element.stack_trace.has_truncated && el->element.stack_trace.truncated);
    case heapdump_client_SnapshotElement_block_contents_tag:
      if (!el->element.block_contents.has_address) {
        return fail(r, HD_ERR_REASSEMBLY, "block contents without an address");
      }
      return add_block(r, s, el->element.block_contents.address, e->contents, e->contents_size);
    case heapdump_client_SnapshotElement_root_region_tag:
      return add_root(r, s, &el->element.root_region, e->contents, e->contents_size);
    case heapdump_client_SnapshotElement_thread_info_tag:
      return add_thread_info(r, s, &el->element.thread_info);
    case heapdump_client_SnapshotElement_executable_region_tag:
      return add_region(r, s, &el->element.executable_region);
    case heapdump_client_SnapshotElement_stack_trace_counters_tag:
      return add_counters(r, s, &el->element.stack_trace_counters);
    case heapdump_client_SnapshotElement_process_stats_tag:
      if (s->has_stats) return fail(r, HD_ERR_REASSEMBLY, "duplicate process stats");
      s->has_stats = true;
      s->stats = el->element.process_stats;
      return HD_OK;
    case heapdump_client_SnapshotElement_resident_memory_tag:
      if (s->has_resident) return fail(r, HD_ERR_REASSEMBLY, "duplicate resident memory");
      s->has_resident = true;
      s->resident = el->element.resident_memory;
      return HD_OK;
    case heapdump_client_SnapshotElement_stats_sample_tag:
      if (!el->element.stats_sample.has_timestamp) {
        return fail(r, HD_ERR_REASSEMBLY, "stats sample without a timestamp");
      }
      if (!RESERVE(s, samples, sample_count, sample_capacity)) return HD_ERR_NO_MEMORY;
      s->samples[s->sample_count++] = el->element.stats_sample;
      return HD_OK;
    default:
      r->unknown_elements++; /* a flexible union: newer senders may add variants */
      return HD_OK;
  }
}

hd_status hd_reassembler_finish(hd_reassembler *r) {
  hd_status mapped = map_spilled(r);
  if (mapped != HD_OK) return mapped;
  for (size_t k = 0; k < r->snapshot_count; k++) {
    const hd_snapshot *s = r->snapshots[k];
    for (size_t i = 0; i < s->block_count; i++) {
      const hd_snapshot_block *b = &s->blocks[i];
      const hd_snapshot_allocation *a = hd_snapshot_find_allocation(s, b->address);
      if (a == NULL) {
        return fail(r, HD_ERR_REASSEMBLY, "contents for unknown block 0x%llx",
                    (unsigned long long)b->address);
      }
      if (hd_snapshot_block_size(s, a) != b->size) {
        return fail(r, HD_ERR_REASSEMBLY, "block 0x%llx: %zu bytes of contents for size %llu",
                    (unsigned long long)b->address, b->size,
                    (unsigned long long)hd_snapshot_block_size(s, a));
      }
    }
    for (size_t i = 0; i < s->root_count; i++) {
      const hd_snapshot_root *g = &s->roots[i];
      if (!g->not_read && g->contents.size != g->size) {
        return fail(r, HD_ERR_REASSEMBLY, "root region 0x%llx: %zu bytes of contents for size %llu",
                    (unsigned long long)g->address, g->contents.size, (unsigned long long)g->size);
      }
    }
    for (size_t i = 0; i < s->allocation_count; i++) {
      const hd_snapshot_allocation *a = &s->allocations[i];
      if (hd_snapshot_find_stack_trace(s, a->stack_trace_key) == NULL) {
        return fail(r, HD_ERR_REASSEMBLY, "allocation 0x%llx: unknown stack trace %llu",
                    (unsigned long long)a->address, (unsigned long long)a->stack_trace_key);
      }
      if (hd_snapshot_find_thread(s, a->thread_info_key) == NULL) {
        return fail(r, HD_ERR_REASSEMBLY, "allocation 0x%llx: unknown thread %llu",
                    (unsigned long long)a->address, (unsigned long long)a->thread_info_key);
      }
    }
  }
  return HD_OK;
}

const hd_snapshot_allocation *hd_snapshot_find_allocation(const hd_snapshot *s, uint64_t address) {
  size_t i;
  return hd_u64_map_find(&s->allocation_index, address, &i) ? &s->allocations[i] : NULL;
}
bool hd_snapshot_has_peak(const hd_snapshot *s) {
  if (s->has_stats) return s->stats.has_peak_mark_time;
  for (size_t i = 0; i < s->stack_trace_count; i++) {
    if (s->stack_traces[i].peak_blocks != 0) return true;
  }
  return false;
}

const hd_snapshot_stack_trace *hd_snapshot_find_stack_trace(const hd_snapshot *s, uint64_t key) {
  size_t i;
  return hd_u64_map_find(&s->stack_trace_index, key, &i) ? &s->stack_traces[i] : NULL;
}
const hd_snapshot_thread *hd_snapshot_find_thread(const hd_snapshot *s, uint64_t key) {
  size_t i;
  return hd_u64_map_find(&s->thread_index, key, &i) ? &s->threads[i] : NULL;
}
const hd_snapshot_root *hd_snapshot_find_root(const hd_snapshot *s, uint64_t address) {
  size_t i;
  return hd_u64_map_find(&s->root_index, address, &i) ? &s->roots[i] : NULL;
}
const hd_snapshot_block *hd_snapshot_find_block(const hd_snapshot *s, uint64_t address) {
  size_t i;
  return hd_u64_map_find(&s->block_index, address, &i) ? &s->blocks[i] : NULL;
}

typedef struct receive_state {
  int channel;
  hd_batch_reader *reader;
  hd_reassembler *reassembler;
  uint32_t error;
  bool ended;
  bool multi_process;
  bool inside_process; /* multi_process: between a header batch and its empty batch */
} receive_state;

static void prepare_batch(void *ctx, heapdump_client_SnapshotReceiverBatchRequest *req) {
  receive_state *st = ctx;
  hd_batch_reader_prepare(st->reader, req);
}

static HD_MUST_CHECK hd_status ack(receive_state *st, hd_message *msg, uint64_t ordinal) {
  heapdump_client_Empty empty = heapdump_client_Empty_init_zero;
  uint32_t txid = msg->txid;
  return ordinal == HD_ORDINAL_SNAPSHOT_RECEIVER_BATCH
             ? hd_fidl_snapshot_receiver_batch_reply(st->channel, msg, txid, &empty)
             : hd_fidl_snapshot_receiver_report_error_reply(st->channel, msg, txid, &empty);
}

static HD_MUST_CHECK hd_status on_batch(void *ctx, hd_message *msg,
                                        heapdump_client_SnapshotReceiverBatchRequest *req) {
  (void)req;
  receive_state *st = ctx;
  hd_reassembler *r = st->reassembler;
  r->batches_received++;
  r->bytes_received += msg->size;
  if (r->progress != NULL) r->progress(r->progress_ctx, r);
  if (st->reader->element_count == 0) {
    if (st->multi_process && st->inside_process) {
      st->inside_process = false;
    } else {
      st->ended = true;
    }
  } else if (st->multi_process && !st->inside_process) {
    st->inside_process = true;
  }
  return ack(st, msg, HD_ORDINAL_SNAPSHOT_RECEIVER_BATCH);
}

static HD_MUST_CHECK hd_status on_report_error(
    void *ctx, hd_message *msg, heapdump_client_SnapshotReceiverReportErrorRequest *req) {
  receive_state *st = ctx;
  st->error = req->has_error ? (uint32_t)req->error : (uint32_t)-1;
  st->ended = true;
  return ack(st, msg, HD_ORDINAL_SNAPSHOT_RECEIVER_REPORT_ERROR);
}

hd_status hd_snapshot_receive(int channel, bool multi_process, hd_reassembler *r, uint32_t *error) {
  hd_message *msg = malloc(sizeof *msg);
  hd_batch_reader *reader = malloc(sizeof *reader);
  if (msg == NULL || reader == NULL) {
    free(msg);
    free(reader);
    return HD_ERR_NO_MEMORY;
  }
  hd_batch_reader_init(reader, hd_reassembler_add, r);
  receive_state st = {
      .channel = channel, .reader = reader, .reassembler = r, .multi_process = multi_process};
  const hd_fidl_snapshot_receiver_server server = {
      .batch_prepare = prepare_batch, .batch = on_batch, .report_error = on_report_error};
  hd_status status = HD_OK;
  while (status == HD_OK && !st.ended) {
    status = hd_message_recv(channel, msg);
    if (status == HD_OK) status = hd_fidl_snapshot_receiver_dispatch(&server, &st, msg);
    /* An element the reassembler refused is the stream's fault, reported as such. */
    if (status == HD_ERR_DECODE && reader->status != HD_OK) status = reader->status;
  }
  *error = st.error;
  free(msg);
  free(reader);
  return status;
}

hd_status hd_snapshot_add_known_location(hd_snapshot *s, uint64_t address,
                                         const hd_source_frame *frames, size_t count) {
  size_t index;
  if (hd_u64_map_find(&s->known_location_index, address, &index)) return HD_ERR_REASSEMBLY;
  if (!RESERVE(s, known_locations, known_location_count, known_location_capacity)) {
    return HD_ERR_NO_MEMORY;
  }
  hd_snapshot_known_location k = {.address = address,
                                  .frames = calloc(count ? count : 1, sizeof *k.frames),
                                  .frame_count = count};
  bool ok = k.frames != NULL;
  for (size_t f = 0; ok && f < count; f++) {
    k.frames[f].line = frames[f].line;
    k.frames[f].column = frames[f].column;
    k.frames[f].function = frames[f].function ? strdup(frames[f].function) : NULL;
    k.frames[f].file = frames[f].file ? strdup(frames[f].file) : NULL;
    ok = (frames[f].function == NULL || k.frames[f].function != NULL) &&
         (frames[f].file == NULL || k.frames[f].file != NULL);
  }
  if (ok) ok = hd_u64_map_put(&s->known_location_index, address, s->known_location_count);
  if (!ok) {
    for (size_t f = 0; k.frames != NULL && f < count; f++) {
      free((char *)k.frames[f].function);
      free((char *)k.frames[f].file);
    }
    free(k.frames);
    return HD_ERR_NO_MEMORY;
  }
  s->known_locations[s->known_location_count++] = k;
  return HD_OK;
}

const hd_snapshot_known_location *hd_snapshot_find_known_location(const hd_snapshot *s,
                                                                  uint64_t address) {
  size_t i;
  return hd_u64_map_find(&s->known_location_index, address, &i) ? &s->known_locations[i] : NULL;
}
