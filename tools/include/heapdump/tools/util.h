/* Small helpers the tools' libraries share: error messages into a caller's buffer, growable
 * arrays, and a string hash. */
#ifndef HEAPDUMP_TOOLS_UTIL_H
#define HEAPDUMP_TOOLS_UTIL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* Formats a message into error and returns rc (a negative errno value), so a failing function
 * can `return hd_tool_fail(error, error_size, -EINVAL, "...", ...)`. */
static inline int hd_tool_fail(char *error, size_t size, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static inline int hd_tool_fail(char *error, size_t size, int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(error, size, fmt, ap);
  va_end(ap);
  return rc;
}

/* Makes room for one more item in a growable array; false when out of memory (unchanged). */
static inline bool hd_reserve_one(void **items, size_t count, size_t *capacity, size_t item_size) {
  if (count < *capacity) return true;
  size_t new_capacity = *capacity ? *capacity * 2 : 64;
  void *bigger = realloc(*items, new_capacity * item_size);
  if (bigger == NULL) return false;
  *items = bigger;
  *capacity = new_capacity;
  return true;
}

#define HD_RESERVE(array, count, capacity) \
  hd_reserve_one((void **)&(array), (count), &(capacity), sizeof *(array))

/* FNV-1a, for the tools' hash tables of names and keys: h continues a hash over size more bytes
 * (start from HD_FNV1A_BASIS). */
#define HD_FNV1A_BASIS UINT64_C(0xcbf29ce484222325)
static inline uint64_t hd_fnv1a(uint64_t h, const void *data, size_t size) {
  const unsigned char *p = (const unsigned char *)data;
  for (size_t i = 0; i < size; i++) h = (h ^ p[i]) * UINT64_C(0x100000001b3);
  return h;
}

#endif
