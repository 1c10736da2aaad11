/* Small helpers the tools' libraries share: error messages into a caller's buffer, growable
 * arrays, and a string hash.
 *
 * The tools' error convention, which every library under tools/ follows:
 * - A function that can fail returns int: 0 on success, else a negative errno value (-ENOMEM,
 *   -EINVAL for input that is not what it should be, -EIO for a failed read or write); it is
 *   declared HD_MUST_CHECK. Where the caller shows the failure to a person, the function also
 *   takes `char *error, size_t error_size` and writes one line there, without "heapdump: " or a
 *   newline (hd_tool_fail below). It never prints.
 * - A function that cannot fail but may find nothing returns bool or NULL.
 * - Only the heapdump command (tools/cli) prints: cli_error() says "heapdump: " and the message
 *   on stderr, and each command returns an exit code (tools/cli/cli.h, documented in
 *   docs/tools.md), never a negative errno. */
#ifndef HEAPDUMP_TOOLS_UTIL_H
#define HEAPDUMP_TOOLS_UTIL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "heapdump/contract/must_check.h"

/* Formats a message into error and returns rc (a negative errno value), so a failing function
 * can `return hd_tool_fail(error, error_size, -EINVAL, "...", ...)`. */
static HD_MUST_CHECK inline int hd_tool_fail(char *error, size_t size, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static HD_MUST_CHECK inline int hd_tool_fail(char *error, size_t size, int rc, const char *fmt,
                                             ...) {
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
