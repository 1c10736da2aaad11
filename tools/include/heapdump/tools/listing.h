/* The listing of stored snapshots as `heapdump list --json` prints it, shared with the
 * collector's HTTP API (GET /api/v1/snapshots), which serves the same document. */
#ifndef HEAPDUMP_TOOLS_LISTING_H
#define HEAPDUMP_TOOLS_LISTING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "heapdump/contract/names.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One stored snapshot. */
typedef struct hd_listing_item {
  uint32_t id;
  char name[HD_NAME_SIZE];
  char process_name[HD_NAME_SIZE];
  uint64_t pid;
  bool has_totals; /* false for snapshots an older collector stored */
  uint64_t taken_at_unix_ns;
  uint64_t live_bytes, live_blocks;
  uint64_t stored_bytes;
} hd_listing_item;

/* Writes the items as a JSON array ending in a newline: [{"id":1,"name":…,"process_name":…,
 * "pid":4242,"taken_at":"2026-11-24T09:31:05.412Z","taken_at_unix_ns":…,"live_bytes":…,
 * "live_blocks":…,"stored_bytes":…}, …], the time and live totals null where unknown. */
void hd_listing_write_json(FILE *out, const hd_listing_item *items, size_t count);

/* unix_ns as local time for people (2026-11-24 10:31:05), or as UTC RFC 3339 with milliseconds
 * for JSON; "-" if it cannot be converted. */
void hd_format_time(uint64_t unix_ns, bool rfc3339, char *out, size_t size);

#ifdef __cplusplus
}
#endif
#endif
