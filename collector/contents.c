/* Batched, coalesced reads of block contents with process_vm_readv. */
#define _GNU_SOURCE
#include "contents.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include "heapdump/contract/must_check.h"

bool hd_pidfd_alive(int pidfd) {
  if (pidfd < 0) return true;
  struct pollfd pfd = {.fd = pidfd, .events = POLLIN};
  return poll(&pfd, 1, 0) == 0;
}

/* What reading needs of a block. Two fit in the memory of one hd_live_block, so the blocks array
 * holds both the spans and the sort's scratch: contents cost no memory beyond the buffer. */
typedef struct span {
  uint64_t address, size;
} span;
_Static_assert(2 * sizeof(span) <= sizeof(hd_live_block), "spans and scratch fit in the blocks");

/* Rewrites blocks[0..count) as the spans of the blocks to read, at the start of the same memory
 * (span i never overlaps a block not yet read); returns how many. */
static size_t spans_of(hd_live_block *blocks, size_t count, uint64_t max_block) {
  unsigned char *spans = (unsigned char *)blocks;
  size_t n = 0;
  for (size_t i = 0; i < count; i++) {
    const span s = {blocks[i].address, blocks[i].size};
    /* A block that wraps around the address space is corrupt: nothing to read. */
    if (s.size == 0 || s.size > max_block || s.size > UINT64_MAX - s.address) continue;
    memcpy(spans + n++ * sizeof s, &s, sizeof s);
  }
  return n;
}

/* Sorts spans[0..n) by address, least significant digit first, on the bits in which the
 * addresses differ (a few passes, as a heap spans a small part of the address space); scratch
 * holds n more. Returns the one of the two arrays that holds the result. */
static span *sort_by_address(span *spans, span *scratch, size_t n) {
  enum { kDigitBits = 11, kDigits = 1 << kDigitBits };
  if (n < 2) return spans;
  uint64_t lowest = UINT64_MAX, highest = 0;
  for (size_t i = 0; i < n; i++) {
    if (spans[i].address < lowest) lowest = spans[i].address;
    if (spans[i].address > highest) highest = spans[i].address;
  }
  const uint64_t range = highest - lowest;
  size_t starts[kDigits];
  for (unsigned shift = 0; shift < 64 && range >> shift != 0; shift += kDigitBits) {
    memset(starts, 0, sizeof starts);
    for (size_t i = 0; i < n; i++) starts[((spans[i].address - lowest) >> shift) & (kDigits - 1)]++;
    size_t total = 0;
    for (size_t d = 0; d < kDigits; d++) {
      size_t in_digit = starts[d];
      starts[d] = total;
      total += in_digit;
    }
    for (size_t i = 0; i < n; i++) {
      scratch[starts[((spans[i].address - lowest) >> shift) & (kDigits - 1)]++] = spans[i];
    }
    span *sorted = scratch;
    scratch = spans;
    spans = sorted;
  }
  return spans;
}

typedef struct contents_reader {
  pid_t pid;
  int pidfd;
  hd_contents_fn fn;
  void *ctx;
  bool gone; /* the process exited or may not be read: nothing more will be */
  const span *spans;
  size_t count, bytes; /* ranges pending, and their bytes */
  struct iovec remote[HD_CONTENTS_MAX_RANGES];
  size_t first[HD_CONTENTS_MAX_RANGES], end[HD_CONTENTS_MAX_RANGES]; /* spans of each range */
  bool whole[HD_CONTENTS_MAX_RANGES];                                /* read whole */
  uint8_t buffer[HD_CONTENTS_BUFFER_BYTES];
} contents_reader;

static void note_read_error(contents_reader *r) {
  if (errno == ESRCH || errno == EPERM) r->gone = true;
}

/* Reads the pending ranges into the buffer, consecutively. A short read stops at a range that
 * could not be read whole (a page of it is unmapped): that range is marked and the read resumes
 * after it. */
static void read_ranges(contents_reader *r) {
  size_t done = 0, offset = 0;
  while (done < r->count && !r->gone) {
    struct iovec into = {r->buffer + offset, r->bytes - offset};
    ssize_t n = process_vm_readv(r->pid, &into, 1, r->remote + done, r->count - done, 0);
    if (n < 0) note_read_error(r);
    size_t read = n > 0 ? (size_t)n : 0, consumed = 0;
    while (done < r->count && consumed + r->remote[done].iov_len <= read) {
      consumed += r->remote[done].iov_len;
      r->whole[done++] = true;
    }
    if (done < r->count) {
      consumed += r->remote[done].iov_len;
      r->whole[done++] = false;
    }
    offset += consumed;
  }
}

/* Reads one block alone into `into`; true if it was read whole while the process was alive. */
static bool read_one(contents_reader *r, const span *s, uint8_t *into) {
  struct iovec local = {into, s->size};
  struct iovec remote = {(void *)(uintptr_t)s->address, s->size};
  ssize_t n = process_vm_readv(r->pid, &local, 1, &remote, 1, 0);
  if (n < 0) note_read_error(r);
  if (!r->gone && !hd_pidfd_alive(r->pidfd)) r->gone = true;
  return !r->gone && n >= 0 && (uint64_t)n == s->size;
}

static HD_MUST_CHECK hd_status deliver_range(contents_reader *r, size_t range,
                                             const uint8_t *bytes) {
  const uint64_t base = (uintptr_t)r->remote[range].iov_base;
  for (size_t i = r->first[range]; i < r->end[range]; i++) {
    const span *s = &r->spans[i];
    hd_status status = r->fn(r->ctx, s->address, bytes + (s->address - base), s->size);
    if (status != HD_OK) return status;
  }
  return HD_OK;
}

/* Reads the pending ranges and passes on their blocks, if the process is still alive. */
static HD_MUST_CHECK hd_status flush(contents_reader *r) {
  read_ranges(r);
  if (!r->gone && !hd_pidfd_alive(r->pidfd)) r->gone = true;
  hd_status status = HD_OK;
  size_t offset = 0;
  for (size_t i = 0; i < r->count && status == HD_OK && !r->gone; i++) {
    if (r->whole[i]) status = deliver_range(r, i, r->buffer + offset);
    offset += r->remote[i].iov_len;
  }
  /* A range that came back short holds a block freed and unmapped meanwhile: its blocks are read
   * again one by one, so that only that one is lost. The buffer is free again by now. */
  for (size_t i = 0; i < r->count && status == HD_OK && !r->gone; i++) {
    if (r->whole[i] || r->end[i] - r->first[i] < 2) continue;
    for (size_t j = r->first[i]; j < r->end[i] && status == HD_OK && !r->gone; j++) {
      const span *s = &r->spans[j];
      if (read_one(r, s, r->buffer)) status = r->fn(r->ctx, s->address, r->buffer, s->size);
    }
  }
  r->count = 0;
  r->bytes = 0;
  return status;
}

/* A block too large for the buffer, read alone into one of its own size. */
static HD_MUST_CHECK hd_status read_large(contents_reader *r, const span *s) {
  uint8_t *bytes = malloc(s->size);
  if (bytes == NULL) return HD_OK; /* contents are best effort: this block goes without */
  hd_status status = read_one(r, s, bytes) ? r->fn(r->ctx, s->address, bytes, s->size) : HD_OK;
  free(bytes);
  return status;
}

/* Adds span i to the last range if it is near enough and the range still fits the buffer. */
static bool join_last_range(contents_reader *r, size_t i) {
  if (r->count == 0) return false;
  const span *s = &r->spans[i];
  struct iovec *last = &r->remote[r->count - 1];
  const uint64_t start = (uintptr_t)last->iov_base, end = start + last->iov_len;
  if (s->address > end && s->address - end > HD_CONTENTS_MAX_GAP) return false;
  const uint64_t new_end = s->address + s->size > end ? s->address + s->size : end;
  if (r->bytes + (new_end - end) > sizeof r->buffer) return false;
  r->bytes += new_end - end;
  last->iov_len = new_end - start;
  r->end[r->count - 1] = i + 1;
  return true;
}

hd_status hd_read_block_contents(pid_t pid, int pidfd, hd_live_block *blocks, size_t count,
                                 uint64_t max_block, uint64_t max_total, bool *cut,
                                 hd_contents_fn fn, void *ctx) {
  if (cut != NULL) *cut = false;
  contents_reader *r = malloc(sizeof *r);
  if (r == NULL) return HD_OK;
  const size_t n = spans_of(blocks, count, max_block);
  span *spans = (span *)(void *)blocks;
  r->pid = pid;
  r->pidfd = pidfd;
  r->fn = fn;
  r->ctx = ctx;
  r->gone = false;
  r->spans = sort_by_address(spans, spans + n, n);
  r->count = 0;
  r->bytes = 0;
  hd_status status = HD_OK;
  uint64_t budget = max_total != 0 ? max_total : UINT64_MAX;
  for (size_t i = 0; i < n && status == HD_OK && !r->gone; i++) {
    const span *s = &r->spans[i];
    if (s->size > budget) {
      if (cut != NULL) *cut = true;
      break;
    }
    budget -= s->size;
    if (s->size > sizeof r->buffer) {
      status = flush(r);
      if (status == HD_OK && !r->gone) status = read_large(r, s);
      continue;
    }
    if (join_last_range(r, i)) continue;
    if (r->count == HD_CONTENTS_MAX_RANGES || r->bytes + s->size > sizeof r->buffer) {
      status = flush(r);
      if (status != HD_OK) break;
    }
    r->first[r->count] = i;
    r->end[r->count] = i + 1;
    r->remote[r->count] = (struct iovec){(void *)(uintptr_t)s->address, s->size};
    r->bytes += s->size;
    r->count++;
  }
  if (status == HD_OK) status = flush(r);
  free(r);
  return status;
}
