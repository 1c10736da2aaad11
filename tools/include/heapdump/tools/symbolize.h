/* Symbolization of the program addresses of a snapshot, offline, from the ELF files on this
 * machine: for each executable region, the file at the region's name (used only when its build ID
 * matches), /usr/lib/debug/.build-id/xx/rest.debug, each configured debug directory (same
 * .build-id layout, or the file's basename) and the binary's .gnu_debuglink; the search order is
 * in tools/symbolize/README.md. libelf reads symbol tables; libdw gives file, line and inlined
 * frames. No network access. Results are cached per module and per address. Not thread-safe. */
#ifndef HEAPDUMP_TOOLS_SYMBOLIZE_H
#define HEAPDUMP_TOOLS_SYMBOLIZE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/snapshot.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hd_symbolizer hd_symbolizer;

typedef struct hd_symbolizer_options {
  const char *const *debug_dirs; /* extra directories searched (--debug-dir), in order */
  size_t debug_dir_count;
  /* Opens only files owned by root or by this process's user and writable by no one else: for
   * a privileged symbolizer (a root collector) of paths an unprivileged process named, which
   * must not parse files that process could have crafted. */
  bool trusted_files_only;
} hd_symbolizer_options;

/* hd_source_frame (one source-level frame) is defined with the snapshot model. */

/* What one program address resolves to. */
typedef struct hd_location_info {
  const hd_snapshot_region *region; /* the region holding the address; NULL if none does */
  const char *module;               /* basename of region->name ("" without a region) */
  uint64_t module_offset;           /* address - region->address + region->file_offset */
  /* frames[0] is the innermost inlined frame, frames[frame_count - 1] the function that holds the
   * machine code. frame_count 0: unresolved. Owned by the symbolizer. */
  const hd_source_frame *frames;
  size_t frame_count;
} hd_location_info;

/* Returns 0 or a negative errno value. */
HD_MUST_CHECK int hd_symbolizer_create(const hd_symbolizer_options *options, hd_symbolizer **out);
/* The allocation wrappers (heapdump/tools/sites.h) that the sites found through this symbolizer
 * honour: the caller's, which must outlive it; NULL: the built-in ones. */
struct hd_alloc_fns;
void hd_symbolizer_set_alloc_fns(hd_symbolizer *s, struct hd_alloc_fns *fns);
struct hd_alloc_fns *hd_symbolizer_alloc_fns(const hd_symbolizer *s);
void hd_symbolizer_destroy(hd_symbolizer *s);

/* Resolves address, a program address of snapshot snap. is_return_address: the address is a
 * return address, so it is looked up at address - 1 (the call). Every address of a heapdump stack
 * trace is one, the first included: the instrumentation leaves its own frames out, so a trace
 * starts where the allocating call returns to. Never fails: an address that cannot be resolved
 * gives frame_count 0 (and region NULL if no region holds it). */
void hd_symbolize(hd_symbolizer *s, const hd_snapshot *snap, uint64_t address,
                  bool is_return_address, hd_location_info *out);

/* True once any lookup so far found symbols (a symbol table or debug info) for its module. */
bool hd_symbolizer_found_symbols(const hd_symbolizer *s);

/* Writes the display name of a location: the outermost function's name if resolved (demangled,
 * see demangle.h), else "module+0xoffset", else "0xaddress". Returns out. */
char *hd_location_name(const hd_location_info *loc, uint64_t address, char *out, size_t size);
/* The same, with a demangled name's parameter list left out ("shop::make_basket"). */
char *hd_location_short_name(const hd_location_info *loc, uint64_t address, char *out, size_t size);

#ifdef __cplusplus
}
#endif
#endif
