/* Gunzipping a profile (gunzip.h). */
#include "gunzip.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "heapdump/tools/util.h"

/* What a profile of `size` compressed bytes may inflate to: a hundred times that (profiles
 * compress five to thirty times), at least 64 MiB, at most `max`. A gzip bomb (deflate reaches
 * a thousand to one) is stopped there rather than filling memory. */
static size_t inflate_limit(size_t size, size_t max) {
  const size_t floor = (size_t)64 << 20;
  size_t limit = size > SIZE_MAX / 100 ? SIZE_MAX : size * 100;
  if (limit < floor) limit = floor;
  return limit < max ? limit : max;
}

int hd_gunzip(const uint8_t *data, size_t size, size_t max, uint8_t **out, size_t *out_size,
              char *error, size_t error_size) {
  if (size < 2 || data[0] != 0x1f || data[1] != 0x8b) {
    *out = malloc(size ? size : 1);
    if (*out == NULL) return hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
    memcpy(*out, data, size);
    *out_size = size;
    return 0;
  }
  if (size > UINT32_MAX) {
    return hd_tool_fail(error, error_size, -EFBIG, "a compressed profile over 4 GiB is not read");
  }
  z_stream z = {0};
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) {
    return hd_tool_fail(error, error_size, -ENOMEM, "cannot start decompressing");
  }
  const size_t limit = inflate_limit(size, max);
  size_t capacity = size * 4 + 4096 < limit ? size * 4 + 4096 : limit, used = 0;
  uint8_t *buf = malloc(capacity);
  z.next_in = (Bytef *)data;
  z.avail_in = (uInt)size;
  int zrc = Z_OK;
  while (buf != NULL && zrc == Z_OK) {
    if (used == capacity) {
      if (capacity == limit) break; /* more to inflate than a profile may */
      const size_t bigger = capacity > limit / 2 ? limit : capacity * 2;
      uint8_t *grown = realloc(buf, bigger);
      if (grown == NULL) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = grown;
      capacity = bigger;
    }
    z.next_out = buf + used;
    z.avail_out = (uInt)(capacity - used > UINT32_MAX ? UINT32_MAX : capacity - used);
    zrc = inflate(&z, Z_NO_FLUSH);
    used = (size_t)(z.next_out - buf);
  }
  inflateEnd(&z);
  if (buf == NULL) return hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
  if (zrc == Z_OK && used == limit) {
    free(buf);
    return hd_tool_fail(error, error_size, -EFBIG,
                        "the profile inflates to more than %zu MiB (%zu MiB compressed): not read "
                        "(a gzip bomb, or a profile bigger than any heap profile)",
                        limit >> 20, size >> 20);
  }
  if (zrc != Z_STREAM_END) {
    free(buf);
    return hd_tool_fail(error, error_size, -EINVAL, "the gzip stream is damaged or cut short");
  }
  *out = buf;
  *out_size = used;
  return 0;
}
