/* The stack-trace encoding of the resources table (shm_layout.h, "STACK TRACE ENCODING"): the
 * writer in libheapdump.so and the collector's reader share this one implementation. */
#ifndef HEAPDUMP_CONTRACT_STACK_CODEC_H
#define HEAPDUMP_CONTRACT_STACK_CODEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Bytes one frame can take: a 64-bit zigzag value in 7-bit groups. */
#define HD_STACK_CODEC_MAX_FRAME_BYTES 10u

/* Encodes count frames into out (room for count * HD_STACK_CODEC_MAX_FRAME_BYTES); returns the
 * bytes written. */
static inline size_t hd_stack_encode(const uint64_t *frames, unsigned count, uint8_t *out) {
  uint8_t *p = out;
  uint64_t prev = 0;
  for (unsigned i = 0; i < count; i++) {
    const int64_t delta = (int64_t)(frames[i] - prev);
    uint64_t z = ((uint64_t)delta << 1) ^ (uint64_t)(delta >> 63);
    prev = frames[i];
    while (z >= 0x80) {
      *p++ = (uint8_t)(z | 0x80);
      z >>= 7;
    }
    *p++ = (uint8_t)z;
  }
  return (size_t)(p - out);
}

/* Decodes count frames from the size bytes at in, storing the first max of them. False when the
 * bytes are not exactly count frames (a varint runs past the end or past 64 bits, or bytes are
 * left over): the record is corrupt. */
static inline bool hd_stack_decode(const uint8_t *in, size_t size, unsigned count, uint64_t *frames,
                                   unsigned max) {
  size_t pos = 0;
  uint64_t prev = 0;
  for (unsigned i = 0; i < count; i++) {
    uint64_t z = 0;
    for (unsigned shift = 0;; shift += 7) {
      if (pos >= size || shift > 63) return false;
      const uint8_t byte = in[pos++];
      z |= (uint64_t)(byte & 0x7f) << shift;
      if (!(byte & 0x80)) break;
    }
    prev += (z >> 1) ^ (0 - (z & 1));
    if (i < max) frames[i] = prev;
  }
  return pos == size;
}

#endif /* HEAPDUMP_CONTRACT_STACK_CODEC_H */
