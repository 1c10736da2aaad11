/* Allocation sites (see sites.h). The instrumentation already leaves its own frames out of the
 * stack traces it records, but a trace still starts in whatever allocator entry point the program
 * called: operator new in libstdc++, strdup in libc, ... Naming those as the site would put every
 * C++ allocation under one site, so they are skipped. */
#include "heapdump/tools/sites.h"

#include <fnmatch.h>
#include <stdio.h>
#include <string.h>

#include "heapdump/tools/demangle.h"

/* The allocator's entry points (linkage names): the C library's. Always the allocator. */
static const char *const kEntryPoints[] = {
    "malloc",
    "calloc",
    "realloc",
    "reallocarray",
    "free",
    "posix_memalign",
    "aligned_alloc",
    "memalign",
    "valloc",
    "pvalloc",
    "__libc_malloc",
    "__libc_calloc",
    "__libc_realloc",
    "__libc_memalign",
    "strdup",
    "strndup",
    "__strdup",
    "__strndup",
    "wcsdup",
    "asprintf",
    "vasprintf",
    "__asprintf",
    "__vasprintf_internal",
};

/* Built-in allocation wrappers: the checked-allocation functions of widely used programs and
 * runtimes, which would otherwise be the site of nearly every block of the programs built on
 * them. Counted as the allocator unless hd_alloc_fns.no_builtin; a report lists those met. */
static const char *const kBuiltinWrappers[] = {
    /* GNU and BSD style checked wrappers (GCC, binutils, coreutils...) */
    "xmalloc",
    "xcalloc",
    "xrealloc",
    "xstrdup",
    "xstrndup",
    "xzalloc",
    "xmemdup",
    "xreallocarray",
    /* GLib */
    "g_malloc",
    "g_malloc0",
    "g_realloc",
    "g_try_malloc",
    "g_try_malloc0",
    "g_try_realloc",
    "g_malloc_n",
    "g_malloc0_n",
    "g_realloc_n",
    "g_strdup",
    "g_strndup",
    "g_memdup2",
    "g_slice_alloc",
    "g_slice_alloc0",
    /* Perl */
    "Perl_safesysmalloc",
    "Perl_safesyscalloc",
    "Perl_safesysrealloc",
    /* CPython's raw and object allocators */
    "_PyMem_RawMalloc",
    "_PyMem_RawCalloc",
    "_PyMem_RawRealloc",
    "PyMem_RawMalloc",
    "PyMem_RawCalloc",
    "PyMem_RawRealloc",
    "PyMem_Malloc",
    "PyMem_Calloc",
    "PyMem_Realloc",
    "_PyObject_Malloc",
    "_PyObject_Calloc",
    "_PyObject_Realloc",
    "PyObject_Malloc",
    "PyObject_Calloc",
    "PyObject_Realloc",
};

static bool listed(const char *name, const char *const *list, size_t count) {
  for (size_t i = 0; i < count; i++) {
    if (strcmp(name, list[i]) == 0) return true;
  }
  return false;
}

static void note_applied(hd_alloc_fns *fns, const char *name, bool builtin) {
  if (fns == NULL) return;
  const char *shown = hd_demangle_without_parameters(name);
  for (size_t i = 0; i < fns->applied_count; i++) {
    if (strcmp(fns->applied[i].name, shown) == 0) return;
  }
  if (fns->applied_count == sizeof fns->applied / sizeof fns->applied[0]) return;
  snprintf(fns->applied[fns->applied_count].name, sizeof fns->applied[0].name, "%s", shown);
  fns->applied[fns->applied_count++].builtin = builtin;
}

typedef enum allocating { NOT_ALLOCATING, ENTRY_POINT, WRAPPER } allocating;

/* Whether a frame's function (its linkage name) allocates on its caller's behalf: an entry point
 * of the allocator (operator new included), or a wrapper, built in or named by the caller (fns
 * may be NULL: the built-in ones). A pattern is matched against the linkage name and the
 * demangled one. */
static allocating allocating_function(const char *name, hd_alloc_fns *fns) {
  if (name == NULL) return NOT_ALLOCATING;
  /* glibc's internal aliases (__GI___strdup) name the same functions. */
  if (strncmp(name, "__GI_", 5) == 0) name += 5;
  /* operator new and new[] in all their overloads (Itanium C++ ABI: _Znw... and _Zna...). */
  if (strncmp(name, "_Znw", 4) == 0 || strncmp(name, "_Zna", 4) == 0) return ENTRY_POINT;
  if (strncmp(name, "operator new", 12) == 0) return ENTRY_POINT;
  if (listed(name, kEntryPoints, sizeof kEntryPoints / sizeof kEntryPoints[0])) return ENTRY_POINT;
  if ((fns == NULL || !fns->no_builtin) &&
      listed(name, kBuiltinWrappers, sizeof kBuiltinWrappers / sizeof kBuiltinWrappers[0])) {
    note_applied(fns, name, true);
    return WRAPPER;
  }
  for (size_t i = 0; fns != NULL && i < fns->pattern_count; i++) {
    if (fnmatch(fns->patterns[i], name, 0) == 0 ||
        (strncmp(name, "_Z", 2) == 0 &&
         (fnmatch(fns->patterns[i], hd_demangle(name), 0) == 0 ||
          fnmatch(fns->patterns[i], hd_demangle_without_parameters(name), 0) == 0))) {
      note_applied(fns, name, false);
      return WRAPPER;
    }
  }
  return NOT_ALLOCATING;
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

size_t hd_site_frame_wrapper(hd_symbolizer *sym, const hd_snapshot *snap,
                             const hd_snapshot_stack_trace *trace, const char **wrapper) {
  hd_alloc_fns *fns = sym != NULL ? hd_symbolizer_alloc_fns(sym) : NULL;
  if (wrapper != NULL) *wrapper = NULL;
  for (size_t i = 0; i < trace->count; i++) {
    hd_location_info loc;
    locate(sym, snap, trace, i, &loc);
    if (is_instrumentation_module(loc.module) || is_std_library(&loc)) continue;
    allocating kind = NOT_ALLOCATING;
    const char *function = NULL;
    for (size_t f = 0; f < loc.frame_count && kind == NOT_ALLOCATING; f++) {
      kind = allocating_function(loc.frames[f].function, fns);
      function = loc.frames[f].function;
    }
    if (kind == NOT_ALLOCATING) return i;
    /* The outermost wrapper: the one the site called. */
    if (wrapper != NULL && kind == WRAPPER) *wrapper = function;
  }
  return trace->count > 0 ? trace->count - 1 : 0;
}

size_t hd_site_frame(hd_symbolizer *sym, const hd_snapshot *snap,
                     const hd_snapshot_stack_trace *trace) {
  return hd_site_frame_wrapper(sym, snap, trace, NULL);
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
