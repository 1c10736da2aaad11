/* Allocation sites: the frame of a stack trace that a report, a pprof label or a dartheap class
 * names. Stack traces start inside the allocator's entry points (operator new, strdup, ...) and
 * often inside the C++ standard library (a container growing, a string being built); the site is
 * the first frame of the program's own code. */
#ifndef HEAPDUMP_TOOLS_SITES_H
#define HEAPDUMP_TOOLS_SITES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/symbolize.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Allocation wrappers: functions of the program that allocate on their callers' behalf (redis's
 * zmalloc, GCC's xmalloc). Their frames count as the allocator's, so that a site is their
 * caller. Attached to a symbolizer (hd_symbolizer_set_alloc_fns); without one, function names
 * are unknown and only the built-in list applies. */
typedef struct hd_alloc_fns {
  const char *const *patterns; /* shell patterns (fnmatch), on the linkage or demangled name */
  size_t pattern_count;
  bool no_builtin; /* only the patterns: the built-in wrappers are sites like any function */
  /* Filled as sites are found: the wrappers met, for a report to say which it applied. */
  struct {
    char name[96];
    bool builtin;
  } applied[16];
  size_t applied_count;
} hd_alloc_fns;

/* hd_symbolize when sym is not NULL; otherwise only the region, module and offset are filled in
 * (frame_count 0). */
void hd_locate(hd_symbolizer *sym, const hd_snapshot *snap, uint64_t address,
               bool is_return_address, hd_location_info *loc);

/* The index in trace->addresses of the allocation site: the first frame that is neither in the
 * instrumentation library, nor a known allocation entry point (malloc family, operator new[],
 * strdup family), nor code of the C++ standard library (libstdc++ or libc++, or a function of
 * namespace std or __gnu_cxx). A trace made only of such frames gives its last frame; an empty
 * trace gives 0. sym may be NULL (then only module names are used). The allocation wrappers
 * attached to sym count as the allocator. */
size_t hd_site_frame(hd_symbolizer *sym, const hd_snapshot *snap,
                     const hd_snapshot_stack_trace *trace);
/* The same, and *wrapper: the outermost allocation wrapper the trace passed through (the function
 * the site called), NULL if none (entry points of the allocator such as malloc are not wrappers).
 */
size_t hd_site_frame_wrapper(hd_symbolizer *sym, const hd_snapshot *snap,
                             const hd_snapshot_stack_trace *trace, const char **wrapper);

/* The site's display name (see hd_location_name) written to out; returns out. For an empty
 * trace: "(no stack)". */
char *hd_site_name(hd_symbolizer *sym, const hd_snapshot *snap,
                   const hd_snapshot_stack_trace *trace, char *out, size_t size);

/* The same without a demangled name's parameter list ("shop::make_basket"). */
char *hd_site_short_name(hd_symbolizer *sym, const hd_snapshot *snap,
                         const hd_snapshot_stack_trace *trace, char *out, size_t size);

/* The module the site is in (basename of its region), "" if no region holds it. */
const char *hd_site_module(hd_symbolizer *sym, const hd_snapshot *snap,
                           const hd_snapshot_stack_trace *trace);

#ifdef __cplusplus
}
#endif
#endif
