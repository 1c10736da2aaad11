/* Allocation sites (see sites.h). The instrumentation already leaves its own frames out of the
 * stack traces it records, but a trace still starts in whatever allocator entry point the program
 * called: operator new in libstdc++, strdup in libc, ... Naming those as the site would put every
 * C++ allocation under one site, so they are skipped. */
#include "heapdump/tools/sites.h"

#include <stdio.h>
#include <string.h>

#include "heapdump/tools/demangle.h"

/* Functions that only allocate on their caller's behalf (linkage names): the C library's, and
 * the checked-allocation wrappers of widely used runtimes, which would otherwise be the site of
 * nearly every block of the programs built on them. */
static const char *const kAllocatorFunctions[] = {
    "malloc", "calloc", "realloc", "reallocarray", "free", "posix_memalign", "aligned_alloc",
    "memalign", "valloc", "pvalloc", "__libc_malloc", "__libc_calloc", "__libc_realloc",
    "__libc_memalign", "strdup", "strndup", "__strdup", "__strndup", "wcsdup", "asprintf",
    "vasprintf", "__asprintf", "__vasprintf_internal",
    /* GNU and BSD style checked wrappers */
    "xmalloc", "xcalloc", "xrealloc", "xstrdup", "xstrndup", "xzalloc", "xmemdup", "xreallocarray",
    /* GLib */
    "g_malloc", "g_malloc0", "g_realloc", "g_try_malloc", "g_try_malloc0", "g_try_realloc",
    "g_malloc_n", "g_malloc0_n", "g_realloc_n", "g_strdup", "g_strndup", "g_memdup2",
    "g_slice_alloc", "g_slice_alloc0",
    /* Perl */
    "Perl_safesysmalloc", "Perl_safesyscalloc", "Perl_safesysrealloc",
    /* CPython's raw and object allocators */
    "_PyMem_RawMalloc", "_PyMem_RawCalloc", "_PyMem_RawRealloc", "PyMem_RawMalloc",
    "PyMem_RawCalloc", "PyMem_RawRealloc", "PyMem_Malloc", "PyMem_Calloc", "PyMem_Realloc",
    "_PyObject_Malloc", "_PyObject_Calloc", "_PyObject_Realloc", "PyObject_Malloc",
    "PyObject_Calloc", "PyObject_Realloc",
};

static bool is_allocator_function(const char *name) {
  if (name == NULL) return false;
  /* glibc's internal aliases (__GI___strdup) name the same functions. */
  if (strncmp(name, "__GI_", 5) == 0) name += 5;
  /* operator new and new[] in all their overloads (Itanium C++ ABI: _Znw... and _Zna...). */
  if (strncmp(name, "_Znw", 4) == 0 || strncmp(name, "_Zna", 4) == 0) return true;
  if (strncmp(name, "operator new", 12) == 0) return true;
  for (size_t i = 0; i < sizeof kAllocatorFunctions / sizeof kAllocatorFunctions[0]; i++) {
    if (strcmp(name, kAllocatorFunctions[i]) == 0) return true;
  }
  return false;
}

static bool is_instrumentation_module(const char *module) {
  return strncmp(module, "libheapdump", 11) == 0;
}

/* Code of the C++ standard library: its shared libraries (GCC's and LLVM's), and functions of
 * its namespaces compiled into the program (templates instantiated there). A std::string member
 * is built in basic_string::_M_construct; the site worth naming is the function that built it.
 * An address is judged by the function that holds its code: a standard function inlined into
 * the program's own is that function's. */
static bool is_std_library(const hd_location_info *loc) {
  if (strncmp(loc->module, "libstdc++", 9) == 0 || strncmp(loc->module, "libc++", 6) == 0) {
    return true;
  }
  return loc->frame_count > 0 && hd_is_std_library_name(loc->frames[loc->frame_count - 1].function);
}

void hd_locate(hd_symbolizer *sym, const hd_snapshot *snap, uint64_t a, bool is_return_address,
               hd_location_info *loc) {
  if (sym != NULL) {
    hd_symbolize(sym, snap, a, is_return_address, loc);
    return;
  }
  memset(loc, 0, sizeof *loc);
  loc->module = "";
  for (size_t r = 0; r < snap->region_count; r++) {
    const hd_snapshot_region *g = &snap->regions[r];
    if (a >= g->address && a - g->address < g->size) {
      const char *name = g->name ? g->name : "";
      const char *slash = strrchr(name, '/');
      loc->region = g;
      loc->module = slash ? slash + 1 : name;
      loc->module_offset = a - g->address + g->file_offset;
      break;
    }
  }
}

static void locate(hd_symbolizer *sym, const hd_snapshot *snap,
                   const hd_snapshot_stack_trace *trace, size_t i, hd_location_info *loc) {
  hd_locate(sym, snap, trace->addresses[i], true, loc);
}

size_t hd_site_frame(hd_symbolizer *sym, const hd_snapshot *snap,
                     const hd_snapshot_stack_trace *trace) {
  for (size_t i = 0; i < trace->count; i++) {
    hd_location_info loc;
    locate(sym, snap, trace, i, &loc);
    if (is_instrumentation_module(loc.module) || is_std_library(&loc)) continue;
    bool allocator = false;
    for (size_t f = 0; f < loc.frame_count && !allocator; f++) {
      allocator = is_allocator_function(loc.frames[f].function);
    }
    if (!allocator) return i;
  }
  return trace->count > 0 ? trace->count - 1 : 0;
}

static char *site_name(hd_symbolizer *sym, const hd_snapshot *snap,
                       const hd_snapshot_stack_trace *trace, bool parameters, char *out,
                       size_t size) {
  if (trace->count == 0) {
    snprintf(out, size, "(no stack)");
    return out;
  }
  size_t i = hd_site_frame(sym, snap, trace);
  hd_location_info loc;
  locate(sym, snap, trace, i, &loc);
  return parameters ? hd_location_name(&loc, trace->addresses[i], out, size)
                    : hd_location_short_name(&loc, trace->addresses[i], out, size);
}

char *hd_site_name(hd_symbolizer *sym, const hd_snapshot *snap,
                   const hd_snapshot_stack_trace *trace, char *out, size_t size) {
  return site_name(sym, snap, trace, true, out, size);
}

char *hd_site_short_name(hd_symbolizer *sym, const hd_snapshot *snap,
                         const hd_snapshot_stack_trace *trace, char *out, size_t size) {
  return site_name(sym, snap, trace, false, out, size);
}

const char *hd_site_module(hd_symbolizer *sym, const hd_snapshot *snap,
                           const hd_snapshot_stack_trace *trace) {
  if (trace->count == 0) return "";
  hd_location_info loc;
  locate(sym, snap, trace, hd_site_frame(sym, snap, trace), &loc);
  return loc.module;
}
