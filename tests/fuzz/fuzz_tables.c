/* libFuzzer target: the collector's table reader (collector/table_reader.c) on hostile shared
 * memory. Each input builds an allocations table and a resources table in two sealed memfds, as
 * a profiled process would hand them over, and runs everything the collector does with them:
 * open, live snapshot, statistics, every record of the resources log, and the stack trace and
 * thread of every live block.
 *
 * Input (little-endian), so that small inputs can reach any offset of tables whose fixed parts
 * alone are hundreds of KiB:
 *   u16 allocations-table pages (bit 15: read the table as final, see below), u16
 *   resources-table pages (4 KiB pages, clamped to the bounds below), then patches until the
 *   input ends:
 *   u8 table (bit 0: 0 allocations, 1 resources), u32 offset, u16 length, `length` bytes
 *   written at offset (wrapped into the table; cut at its end and at the end of the input).
 * Never-patched bytes are zero, as in a sparse memfd. tests/fuzz/make_table_seeds.py writes
 * seeds in this form from the tables of real programs.
 *
 * An odd sequence counter is a writer in the middle of an update: a live reader waits up to a
 * second for it by design (a stuck slot is tested in hd_tables_test), so for a live read the
 * harness makes every counter even to keep runs fast. A final read (the table of an exited
 * process: hd_read_limits.final) never waits, so it gets the counters as the input left them,
 * locks held mid-update included. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "heapdump/contract/shm_layout.h"
#include "table_reader.h"

enum {
  kPage = 4096,
  kMaxAllocPages = 2048, /* 8 MiB: room for the slot array and nodes */
  kMaxResPages = 512,
  kMaxBlocksResolved = 4096,
};

static uint32_t le16(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
static uint32_t le32(const uint8_t *p) { return le16(p) | le16(p + 2) << 16; }

static uint64_t clamp_pages(uint32_t pages, uint32_t max) {
  if (pages == 0) pages = 1;
  return (uint64_t)(pages > max ? max : pages) * kPage;
}

/* Clears the low bit of every slot counter, where the (hostile) header says they are. */
static void even_counters(uint8_t *alloc, uint64_t size) {
  if (size < sizeof(hd_alloc_header)) return;
  hd_alloc_header *h = (hd_alloc_header *)alloc;
  uint64_t off = h->seq_offset, bytes = (uint64_t)HD_SEQ_SLOTS * 4;
  if (off % 4 != 0 || off > size || bytes > size - off) return;
  uint32_t *seq = (uint32_t *)(alloc + off);
  for (uint32_t i = 0; i < HD_SEQ_SLOTS; i++) seq[i] &= ~1u;
}

/* Clears the low bit of the seq of every counters record's entries the (hostile) header's list
 * reaches: a reader waits a second for an odd one before it stops waiting. */
static void even_pending(uint8_t *res, uint64_t size) {
  if (size < sizeof(hd_res_header)) return;
  uint64_t off = ((hd_res_header *)res)->counters_head;
  for (int hops = 0; off != 0 && off % 8 == 0 && hops < 4096; hops++) {
    if (off > size || sizeof(hd_rec_counters) > size - off) return;
    hd_rec_counters *c = (hd_rec_counters *)(res + off);
    for (uint32_t i = 0; i < HD_PENDING_TRACES; i++) c->pending[i].seq &= ~1u;
    if (c->next >= off) return;
    off = c->next;
  }
}

/* A zero-filled (sparse) memfd of `size` bytes, mapped writable at *map. */
static int make_table(const char *name, uint64_t size, uint8_t **map) {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) abort();
  void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) abort();
  *map = m;
  return fd;
}

/* Seals as the library does, so that the reader accepts the memfd. */
static void seal_table(int fd, uint8_t *map, uint64_t size) {
  munmap(map, size);
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) abort();
}

static int by_address(const void *a, const void *b) {
  uint64_t x = ((const hd_live_block *)a)->address, y = ((const hd_live_block *)b)->address;
  return x < y ? -1 : x > y;
}

static void read_resources(int fd, const hd_live_block *blocks, size_t count) {
  hd_res_reader *r;
  if (hd_res_reader_open(fd, &r) != HD_READ_OK) return;
  hd_table_stats stats;
  /* A damaged list of per-thread counters is reported; any other failure is a reader bug. */
  hd_read_status stats_status = hd_res_reader_stats(r, &stats);
  if (stats_status != HD_READ_OK && stats_status != HD_READ_ERR_CORRUPT) abort();
  if (stats_status == HD_READ_OK && stats.live_bytes > stats.peak_live_bytes) abort();
  uint64_t frames[HD_MAX_FRAMES];
  size_t n;
  uint64_t cursor = 0, last = 0;
  hd_res_entry e;
  hd_read_status st;
  while ((st = hd_res_reader_next(r, &cursor, &e)) == HD_READ_OK) {
    if (cursor <= last) abort(); /* the walk must move forward */
    last = cursor;
    if (e.type == HD_ENTRY_STACK &&
        hd_res_reader_stack(r, e.key, frames, HD_MAX_FRAMES, &n, NULL, NULL) == HD_READ_OK &&
        n > HD_MAX_FRAMES)
      abort();
    if (e.type == HD_ENTRY_THREAD && e.u.thread.name[sizeof(e.u.thread.name) - 1] != 0) abort();
    if (e.type == HD_ENTRY_REGION &&
        strnlen(e.u.region.name, sizeof(e.u.region.name)) == sizeof(e.u.region.name))
      abort();
  }
  /* As a snapshot reads the traces' counts: through an index of the threads' entries. */
  hd_pending_index *pending = hd_res_reader_pending_index(r);
  for (size_t i = 0; i < count && i < kMaxBlocksResolved; i++) {
    hd_trace_counters counters;
    hd_thread_info thread;
    hd_read_status stack = hd_res_reader_stack_indexed(r, pending, blocks[i].stack_key, frames, 4,
                                                       &n, &counters, NULL);
    if ((stack == HD_READ_OK && n > 4) || (stack == HD_READ_ERR_NO_SPACE && n <= 4)) abort();
    if (hd_res_reader_thread(r, blocks[i].thread_key, &thread) == HD_READ_OK &&
        thread.name[sizeof(thread.name) - 1] != 0)
      abort();
  }
  hd_pending_index_free(pending);
  hd_res_reader_close(r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 4) return 0;
  const bool final = le16(data) & 0x8000u;
  uint64_t alloc_size = clamp_pages(le16(data) & 0x7fffu, kMaxAllocPages);
  uint64_t res_size = clamp_pages(le16(data + 2), kMaxResPages);
  uint8_t *alloc, *res;
  int afd = make_table("fuzz-allocations", alloc_size, &alloc);
  int rfd = make_table("fuzz-resources", res_size, &res);
  for (size_t pos = 4; pos + 7 <= size;) {
    bool to_res = data[pos] & 1;
    uint8_t *image = to_res ? res : alloc;
    uint64_t image_size = to_res ? res_size : alloc_size;
    uint64_t off = le32(data + pos + 1) % image_size;
    size_t len = le16(data + pos + 5);
    pos += 7;
    if (len > size - pos) len = size - pos;
    memcpy(image + off, data + pos, len < image_size - off ? len : image_size - off);
    pos += len;
  }
  if (!final) even_counters(alloc, alloc_size);
  even_pending(res, res_size);
  seal_table(afd, alloc, alloc_size);
  seal_table(rfd, res, res_size);

  hd_live_block *blocks = NULL;
  size_t count = 0;
  hd_alloc_reader *a;
  if (hd_alloc_reader_open(afd, &a) == HD_READ_OK) {
    hd_alloc_table_info info;
    if (hd_alloc_reader_info(a, &info) != HD_READ_OK) abort();
    hd_read_limits limits = {.final = true};
    hd_read_status read = final ? hd_alloc_reader_snapshot_unordered(a, &limits, &blocks, &count)
                                : hd_alloc_reader_snapshot(a, &blocks, &count);
    if (read == HD_READ_OK) {
      if (final && count > 1) qsort(blocks, count, sizeof *blocks, by_address);
      /* Sorted, and no address twice: the reader keeps one record of an address even from a
       * table that records it in many nodes. */
      for (size_t i = 1; i < count; i++)
        if (blocks[i].address <= blocks[i - 1].address) abort();
      if (count > info.node_capacity) abort();
    } else if (final && (read == HD_READ_ERR_BUSY || read == HD_READ_ERR_TIMED_OUT)) {
      abort(); /* a final read never waits for a writer */
    }
    hd_alloc_reader_close(a);
  }
  read_resources(rfd, blocks, count);
  free(blocks);
  close(afd);
  close(rfd);
  return 0;
}
