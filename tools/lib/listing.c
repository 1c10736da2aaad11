/* See heapdump/tools/listing.h. */
#define _GNU_SOURCE
#include "heapdump/tools/listing.h"

#include <inttypes.h>
#include <time.h>

#include "heapdump/tools/report.h"

void hd_format_time(uint64_t unix_ns, bool rfc3339, char *out, size_t size) {
  time_t seconds = (time_t)(unix_ns / 1000000000u);
  struct tm tm;
  if ((rfc3339 ? gmtime_r(&seconds, &tm) : localtime_r(&seconds, &tm)) == NULL) {
    snprintf(out, size, "-");
    return;
  }
  if (rfc3339) {
    char date[32];
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out, size, "%s.%03uZ", date, (unsigned)(unix_ns / 1000000u % 1000u));
  } else {
    strftime(out, size, "%Y-%m-%d %H:%M:%S", &tm);
  }
}

void hd_listing_write_json(FILE *out, const hd_listing_item *items, size_t count) {
  fputc('[', out);
  for (size_t i = 0; i < count; i++) {
    const hd_listing_item *s = &items[i];
    fprintf(out, "%s{\"id\":%" PRIu32 ",\"name\":", i ? "," : "", s->id);
    hd_json_string(out, s->name);
    fputs(",\"process_name\":", out);
    hd_json_string(out, s->process_name);
    fprintf(out, ",\"pid\":%" PRIu64, s->pid);
    if (s->has_totals) {
      char when[40];
      hd_format_time(s->taken_at_unix_ns, true, when, sizeof when);
      fprintf(out,
              ",\"taken_at\":\"%s\",\"taken_at_unix_ns\":%" PRIu64 ",\"live_bytes\":%" PRIu64
              ",\"live_blocks\":%" PRIu64,
              when, s->taken_at_unix_ns, s->live_bytes, s->live_blocks);
    } else {
      fputs(",\"taken_at\":null,\"taken_at_unix_ns\":null,\"live_bytes\":null,\"live_blocks\":null",
            out);
    }
    fprintf(out, ",\"stored_bytes\":%" PRIu64 "}", s->stored_bytes);
  }
  fputs("]\n", out);
}
