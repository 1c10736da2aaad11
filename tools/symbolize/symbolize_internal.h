/* Between the parts of the symbolizer (private to tools/symbolize): symbolize.c indexes a
 * module's DWARF and symbols and resolves addresses; debug_files.c opens a module's files and
 * finds its separate debug file. */
#ifndef HEAPDUMP_TOOLS_SYMBOLIZE_INTERNAL_H
#define HEAPDUMP_TOOLS_SYMBOLIZE_INTERNAL_H

#include <elfutils/libdw.h>
#include <gelf.h>
#include <libelf.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "heapdump/tools/symbolize.h"

/* The system debug root of the .build-id layout and of .gnu_debuglink lookups. */
#define SYSTEM_DEBUG_ROOT "/usr/lib/debug"
/* Bounds on what corrupt DWARF can make us recurse into or allocate. */
#define MAX_DIE_DEPTH 256
#define MAX_INLINE_FRAMES 64

/* Address ranges sorted by start, each with an index into the owner's payload array; max_high
 * (the largest end of any range at or before this one) lets a lookup stop early with nested or
 * overlapping ranges. */
typedef struct range_entry {
  uint64_t low, high, max_high;
  size_t payload;
} range_entry;

typedef struct range_index {
  range_entry *entries;
  size_t count, capacity;
} range_index;

/* unit_die holds the ranges and the line table; function_root the function DIEs: the split unit
 * of a skeleton unit, else unit_die itself. */
typedef struct compile_unit {
  Dwarf_Die unit_die;
  Dwarf_Die function_root;
  bool indexed;
  range_index functions;
  Dwarf_Die *function_dies;
  size_t function_count, function_capacity;
} compile_unit;

typedef struct elf_file {
  int fd;
  Elf *elf;
} elf_file;

typedef struct module {
  uint64_t hash;
  char *name;
  uint8_t build_id[sizeof(((hd_snapshot_region *)0)->build_id)];
  size_t build_id_size;
  elf_file binary, debug;
  Dwarf *dwarf;
  compile_unit *units;
  size_t unit_count;
  range_index unit_ranges;
  range_index symbols;
  const char **symbol_names;
} module;

typedef struct cached_location {
  bool used;
  uint32_t module_index;
  uint64_t address;
  hd_source_frame *frames;
  size_t frame_count;
} cached_location;

struct hd_symbolizer {
  char **debug_dirs;
  size_t debug_dir_count;
  module **modules;
  size_t module_count, module_capacity;
  cached_location *cache; /* open addressing; capacity is a power of two */
  size_t cache_count, cache_capacity;
  bool found_symbols;
  bool trusted_files_only;        /* hd_symbolizer_options */
  struct hd_alloc_fns *alloc_fns; /* the caller's */
};

/* ---- debug_files.c ---- */

extern const elf_file kNoElfFile; /* {-1, NULL}: no file */
/* Opens path if it is a regular ELF file (never blocking on a FIFO or device named like one) and,
 * for a symbolizer of trusted files only, owned by root or by us and writable by no one else. */
bool hd_elf_file_open(const hd_symbolizer *s, const char *path, elf_file *out);
void hd_elf_file_close(elf_file *f);
/* Whether elf's build ID is the module's (on the prefix a region carries). */
bool hd_build_id_matches(const module *m, Elf *elf);
/* Finds the module's separate debug file, loading its DWARF (or, failing that, keeping the first
 * one with a symbol table) into m->debug. */
void hd_find_debug_file(const hd_symbolizer *s, module *m);

/* ---- symbolize.c ---- */

/* Loads elf's DWARF into m; false if it has none usable. */
bool hd_load_dwarf(module *m, Elf *elf);
/* elf's first section of the type (SHT_SYMTAB, SHT_DYNSYM), or NULL. */
Elf_Scn *hd_find_symbol_section(Elf *elf, GElf_Word type);

#endif
