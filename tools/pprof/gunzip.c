/* Gunzipping a profile (gunzip.h). */
#include "gunzip.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "heapdump/tools/util.h"

int hd_gunzip(const uint8_t *data, size_t size, size_t max, uint8_t **out, size_t *out_size,
              char *error, size_t error_size) {
  if (size < 2 || data[0] != 0x1f || data[1] != 0x8b) {
    *out = malloc(size ? size : 1);
    if (*out == NULL) return hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
    memcpy(*out, data, size);
    *out_size = size;
    return 0;
  }
  z_stream z = {0};
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) {
    return hd_tool_fail(error, error_size, -ENOMEM, "cannot start decompressing");
  }
  size_t capacity = size * 4 + 4096, used = 0;
  uint8_t *buf = malloc(capacity);
  z.next_in = (Bytef *)data;
  z.avail_in = (uInt)size;
  int zrc = Z_OK;
  while (buf != NULL && zrc == Z_OK) {
    if (used == capacity && capacity >= max) break;
    if (!HD_RESERVE(buf, used, capacity)) {
      free(buf);
      buf = NULL;
      break;
    }
    z.next_out = buf + used;
    z.avail_out = (uInt)(capacity - used > UINT32_MAX ? UINT32_MAX : capacity - used);
    zrc = inflate(&z, Z_NO_FLUSH);
    used = (size_t)(z.next_out - buf);
  }
  inflateEnd(&z);
  if (buf == NULL) return hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
  if (zrc != Z_STREAM_END) {
    free(buf);
    return hd_tool_fail(error, error_size, -EINVAL, "the gzip stream is damaged or cut short");
  }
  *out = buf;
  *out_size = used;
  return 0;
}
