/* Stacks as text: the frames of one stack trace under a report's group, and every stack trace
 * of a snapshot as folded stacks, for flame graphs (see report.h). */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "heapdump/tools/demangle.h"
#include "heapdump/tools/report.h"
#include "heapdump/tools/sites.h"
#include "heapdump/tools/util.h"

void hd_report_frames_text(FILE *out, hd_symbolizer *sym, const hd_snapshot *s,
                           const hd_snapshot_stack_trace *trace, size_t first, size_t max_frames) {
  size_t shown = 0;
  for (size_t i = first; i < trace->count && (max_frames == 0 || shown < max_frames);
       i++, shown++) {
    hd_location_info loc;
    uint64_t address = trace->addresses[i];
    hd_locate(sym, s, address, true, &loc);
    if (loc.frame_count == 0) {
      char name[300];
      fprintf(out, "        at %s\n", hd_location_name(&loc, address, name, sizeof name));
      continue;
    }
    for (size_t f = 0; f < loc.frame_count; f++) {
      const hd_source_frame *fr = &loc.frames[f];
      fprintf(out, "        at %s", fr->function ? hd_demangle(fr->function) : "??");
      if (fr->file != NULL && fr->line > 0) {
        fprintf(out, " (%s:%" PRIu32 ")", fr->file, fr->line);
      } else {
        fprintf(out, " (%s+0x%" PRIx64 ")", loc.module, loc.module_offset);
      }
      fprintf(out, "%s\n", f + 1 < loc.frame_count ? " [inlined]" : "");
    }
  }
  char cut[48] = "";
  if (trace->truncated) snprintf(cut, sizeof cut, "truncated at %zu frames", trace->count);
  if (first + shown < trace->count) {
    fprintf(out, "        ... %zu more frames%s%s%s\n", trace->count - first - shown,
            cut[0] ? " (" : "", cut, cut[0] ? ")" : "");
  } else if (cut[0]) {
    fprintf(out, "        ... %s\n", cut);
  }
}

/* ---- folded stacks ---- */

/* Frame names must not contain the separators of the format. */
static void folded_name(FILE *out, const char *name) {
  for (const char *p = name; *p; p++) fputc(*p == ';' || *p == '\n' ? '_' : *p, out);
}

int hd_folded_write(const hd_reassembler *r, hd_symbolizer *sym, FILE *out, char *error,
                    size_t error_size) {
  errno = 0;
  for (size_t p = 0; p < r->snapshot_count; p++) {
    const hd_snapshot *s = r->snapshots[p];
    hd_trace_totals *totals = hd_trace_totals_of(s);
    if (totals == NULL) return hd_tool_fail(error, error_size, -ENOMEM, "out of memory");
    for (size_t i = 0; i < s->stack_trace_count; i++) {
      const hd_snapshot_stack_trace *trace = &s->stack_traces[i];
      if (totals[i].live_bytes == 0 && totals[i].live_blocks == 0) continue;
      bool first = true;
      if (s->has_header) {
        fprintf(out, "%s[%" PRIu64 "]", s->process_name, s->pid);
        first = false;
      }
      if (trace->count == 0) {
        fprintf(out, "%s(no stack)", first ? "" : ";");
        first = false;
      } else if (trace->truncated) {
        /* The root-most frames are missing: cut stacks meet under one root of their own. */
        fputs(first ? "" : ";", out);
        fprintf(out, HD_TRUNCATED_FRAME_FORMAT, trace->count);
        first = false;
      }
      /* From the root to the allocation site, as pprof's samples: the allocator's own frames
       * (operator new, checked wrappers, the standard library) would be every flame's tip. */
      const size_t site = hd_site_frame(sym, s, trace);
      for (size_t k = trace->count; k-- > site;) {
        hd_location_info loc;
        hd_locate(sym, s, trace->addresses[k], true, &loc);
        if (loc.frame_count == 0) {
          char name[300];
          fputs(first ? "" : ";", out);
          folded_name(out, hd_location_name(&loc, trace->addresses[k], name, sizeof name));
          first = false;
          continue;
        }
        for (size_t f = loc.frame_count; f-- > 0;) {
          fputs(first ? "" : ";", out);
          folded_name(out, loc.frames[f].function ? hd_demangle(loc.frames[f].function) : "??");
          first = false;
        }
      }
      fprintf(out, " %" PRIu64 "\n", totals[i].live_bytes);
    }
    free(totals);
  }
  if (fflush(out) != 0 || ferror(out)) {
    int err = errno ? errno : EIO;
    return hd_tool_fail(error, error_size, -err, "cannot write folded stacks: %s", strerror(err));
  }
  return 0;
}
