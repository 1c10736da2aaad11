/* Offline symbolization of snapshot addresses from the ELF files on this machine.
 *
 * A module (one name + build ID) is opened once, on its first lookup: the binary at its path if
 * its build ID matches, and, when the binary has no DWARF, the first separate debug file found
 * (see README.md for the search order). Unit and function address indexes are built once per
 * module and per compilation unit; every resolved address is cached. Nothing here touches the
 * network: the debug-file search is ours, not libdwfl's (whose standard search may ask a
 * debuginfod server). */
#define _GNU_SOURCE
#include "heapdump/tools/symbolize.h"

#include "heapdump/tools/demangle.h"
#include "heapdump/tools/util.h"
#include "symbolize_internal.h"

#include <dwarf.h>
#include <elfutils/libdw.h>
#include <elfutils/libdwelf.h>
#include <errno.h>
#include <fcntl.h>
#include <gelf.h>
#include <inttypes.h>
#include <libelf.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

void hd_symbolizer_set_alloc_fns(hd_symbolizer *s, struct hd_alloc_fns *fns) { s->alloc_fns = fns; }

struct hd_alloc_fns *hd_symbolizer_alloc_fns(const hd_symbolizer *s) {
  return s->alloc_fns;
}

static bool grow(void **array, size_t *capacity, size_t needed, size_t element_size) {
  if (needed <= *capacity) return true;
  size_t new_capacity = *capacity ? *capacity * 2 : 16;
  while (new_capacity < needed) new_capacity *= 2;
  void *p = reallocarray(*array, new_capacity, element_size);
  if (p == NULL) return false;
  *array = p;
  *capacity = new_capacity;
  return true;
}

static bool range_add(range_index *r, uint64_t low, uint64_t high, size_t payload) {
  if (!grow((void **)&r->entries, &r->capacity, r->count + 1, sizeof(range_entry))) return false;
  r->entries[r->count++] = (range_entry){low, high, high, payload};
  return true;
}

static int compare_range_low(const void *a, const void *b) {
  const range_entry *x = a, *y = b;
  if (x->low != y->low) return x->low < y->low ? -1 : 1;
  return x->payload < y->payload ? -1 : x->payload > y->payload;
}

static void range_finish(range_index *r) {
  if (r->count > 1) qsort(r->entries, r->count, sizeof(range_entry), compare_range_low);
  for (size_t i = 1; i < r->count; i++) {
    if (r->entries[i - 1].max_high > r->entries[i].max_high) {
      r->entries[i].max_high = r->entries[i - 1].max_high;
    }
  }
}

/* The range holding address with the greatest start (the innermost of nested ranges). */
static const range_entry *range_find(const range_index *r, uint64_t address) {
  size_t lo = 0, hi = r->count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (r->entries[mid].low <= address) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  for (size_t i = lo; i-- > 0;) {
    const range_entry *e = &r->entries[i];
    if (e->max_high <= address) break;
    if (address < e->high) return e;
  }
  return NULL;
}

static void range_free(range_index *r) {
  free(r->entries);
  *r = (range_index){0};
}

/* ---- DWARF -------------------------------------------------------------------------------- */

static bool add_die_ranges(range_index *r, Dwarf_Die *die, size_t payload) {
  Dwarf_Addr base, start, end;
  ptrdiff_t offset = 0;
  while ((offset = dwarf_ranges(die, offset, &base, &start, &end)) > 0) {
    /* Start 0: code of a function the linker discarded, never a loaded address. */
    if (start != 0 && end > start && !range_add(r, start, end, payload)) return false;
  }
  return true;
}

static bool is_function_container(int tag) {
  switch (tag) {
    case DW_TAG_subprogram:
    case DW_TAG_lexical_block:
    case DW_TAG_namespace:
    case DW_TAG_class_type:
    case DW_TAG_structure_type:
    case DW_TAG_union_type:
    case DW_TAG_module: return true;
    default: return false;
  }
}

/* Records every concrete function (DW_TAG_subprogram with code) under parent, including those
 * in namespaces and classes and GNU C nested functions. */
static bool index_functions(compile_unit *cu, Dwarf_Die *parent, int depth) {
  Dwarf_Die child;
  if (depth > MAX_DIE_DEPTH || dwarf_child(parent, &child) != 0) return true;
  do {
    int tag = dwarf_tag(&child);
    if (tag == DW_TAG_subprogram &&
        (dwarf_hasattr(&child, DW_AT_low_pc) || dwarf_hasattr(&child, DW_AT_ranges))) {
      if (!grow((void **)&cu->function_dies, &cu->function_capacity, cu->function_count + 1,
                sizeof(Dwarf_Die))) {
        return false;
      }
      cu->function_dies[cu->function_count] = child;
      if (!add_die_ranges(&cu->functions, &child, cu->function_count)) return false;
      cu->function_count++;
    }
    if (is_function_container(tag) && !index_functions(cu, &child, depth + 1)) return false;
  } while (dwarf_siblingof(&child, &child) == 0);
  return true;
}

static bool ensure_functions_indexed(compile_unit *cu) {
  if (cu->indexed) return true;
  if (!index_functions(cu, &cu->function_root, 0)) {
    range_free(&cu->functions);
    cu->function_count = 0;
    return false;
  }
  range_finish(&cu->functions);
  cu->indexed = true;
  return true;
}

/* Builds the unit address index; false (and no DWARF kept) when the file has no unit. A unit
 * without ranges of its own is indexed through its functions' ranges. */
bool hd_load_dwarf(module *m, Elf *elf) {
  Dwarf *dwarf = dwarf_begin_elf(elf, DWARF_C_READ, NULL);
  if (dwarf == NULL) return false;
  m->dwarf = dwarf;
  size_t capacity = 0;
  Dwarf_CU *cu = NULL;
  uint8_t unit_type;
  Dwarf_Die unit_die, sub_die;
  bool ok = true;
  while (ok && dwarf_get_units(dwarf, cu, &cu, NULL, &unit_type, &unit_die, &sub_die) == 0) {
    if (unit_type != DW_UT_compile && unit_type != DW_UT_skeleton) continue;
    if (!grow((void **)&m->units, &capacity, m->unit_count + 1, sizeof(compile_unit))) break;
    size_t index = m->unit_count++;
    compile_unit *u = &m->units[index];
    *u = (compile_unit){.unit_die = unit_die, .function_root = unit_die};
    if (unit_type == DW_UT_skeleton && dwarf_tag(&sub_die) == DW_TAG_compile_unit) {
      u->function_root = sub_die;
    }
    size_t before = m->unit_ranges.count;
    ok = add_die_ranges(&m->unit_ranges, &unit_die, index);
    if (ok && m->unit_ranges.count == before) {
      ok = ensure_functions_indexed(u);
      for (size_t i = 0; ok && i < u->functions.count; i++) {
        ok = range_add(&m->unit_ranges, u->functions.entries[i].low, u->functions.entries[i].high,
                       index);
      }
    }
  }
  range_finish(&m->unit_ranges);
  if (m->unit_count > 0) return true;
  free(m->units);
  m->units = NULL;
  range_free(&m->unit_ranges);
  dwarf_end(dwarf);
  m->dwarf = NULL;
  return false;
}

/* The linkage (mangled) name when there is one, else the source name; through abstract
 * origins and specifications. */
static const char *die_function_name(Dwarf_Die *die) {
  static const unsigned attributes[] = {DW_AT_linkage_name, DW_AT_MIPS_linkage_name, DW_AT_name};
  for (size_t i = 0; i < sizeof attributes / sizeof attributes[0]; i++) {
    Dwarf_Attribute attribute;
    const char *name = dwarf_formstring(dwarf_attr_integrate(die, attributes[i], &attribute));
    if (name != NULL && name[0] != '\0') return name;
  }
  return NULL;
}

/* The inlined subroutine under parent whose code holds pc, looking through lexical blocks
 * (and, for blocks without ranges of their own, into them regardless). */
static bool find_inlined_at(Dwarf_Die *parent, Dwarf_Addr pc, Dwarf_Die *out, int depth) {
  Dwarf_Die child;
  if (depth > MAX_DIE_DEPTH || dwarf_child(parent, &child) != 0) return false;
  do {
    int tag = dwarf_tag(&child);
    if (tag != DW_TAG_inlined_subroutine && tag != DW_TAG_lexical_block &&
        tag != DW_TAG_try_block && tag != DW_TAG_catch_block) {
      continue;
    }
    bool has_code = dwarf_hasattr(&child, DW_AT_low_pc) || dwarf_hasattr(&child, DW_AT_ranges);
    if (has_code && dwarf_haspc(&child, pc) <= 0) continue;
    if (tag == DW_TAG_inlined_subroutine) {
      if (!has_code) continue;
      *out = child;
      return true;
    }
    if (find_inlined_at(&child, pc, out, depth + 1)) return true;
  } while (dwarf_siblingof(&child, &child) == 0);
  return false;
}

static void call_site(Dwarf_Die *inlined, hd_source_frame *caller) {
  Dwarf_Attribute attribute;
  Dwarf_Word value;
  if (dwarf_formudata(dwarf_attr(inlined, DW_AT_call_file, &attribute), &value) == 0) {
    Dwarf_Die unit;
    Dwarf_Files *files;
    size_t file_count;
    if (dwarf_diecu(inlined, &unit, NULL, NULL) != NULL &&
        dwarf_getsrcfiles(&unit, &files, &file_count) == 0 && value < file_count) {
      caller->file = dwarf_filesrc(files, value, NULL, NULL);
    }
  }
  if (dwarf_formudata(dwarf_attr(inlined, DW_AT_call_line, &attribute), &value) == 0) {
    caller->line = value > UINT32_MAX ? 0 : (uint32_t)value;
  }
  if (dwarf_formudata(dwarf_attr(inlined, DW_AT_call_column, &attribute), &value) == 0) {
    caller->column = value > UINT32_MAX ? 0 : (uint32_t)value;
  }
}

static void line_at(compile_unit *cu, Dwarf_Addr pc, hd_source_frame *frame) {
  Dwarf_Line *line = dwarf_getsrc_die(&cu->unit_die, pc);
  if (line == NULL) return;
  frame->file = dwarf_linesrc(line, NULL, NULL);
  int number = 0, column = 0;
  if (dwarf_lineno(line, &number) == 0 && number > 0) frame->line = (uint32_t)number;
  if (dwarf_linecol(line, &column) == 0 && column > 0) frame->column = (uint32_t)column;
}

/* Fills frames (innermost first) from DWARF; returns how many, 0 if DWARF does not cover pc. */
static size_t dwarf_frames(module *m, uint64_t pc, hd_source_frame *frames) {
  const range_entry *unit_entry = m->dwarf ? range_find(&m->unit_ranges, pc) : NULL;
  if (unit_entry == NULL) return 0;
  compile_unit *cu = &m->units[unit_entry->payload];
  const range_entry *function =
      ensure_functions_indexed(cu) ? range_find(&cu->functions, pc) : NULL;
  if (function == NULL) {
    frames[0] = (hd_source_frame){0};
    line_at(cu, pc, &frames[0]);
    return frames[0].file != NULL ? 1 : 0;
  }
  Dwarf_Die chain[MAX_INLINE_FRAMES];
  size_t depth = 1;
  chain[0] = cu->function_dies[function->payload];
  while (depth < MAX_INLINE_FRAMES && find_inlined_at(&chain[depth - 1], pc, &chain[depth], 0)) {
    depth++;
  }
  for (size_t i = 0; i < depth; i++) {
    Dwarf_Die *scope = &chain[depth - 1 - i];
    frames[i] = (hd_source_frame){.function = die_function_name(scope)};
    if (i == 0) {
      line_at(cu, pc, &frames[i]);
    } else {
      call_site(&chain[depth - i], &frames[i]);
    }
  }
  return depth;
}

/* ---- ELF symbol tables -------------------------------------------------------------------- */

typedef struct symbol_candidate {
  uint64_t low, size, section_end;
  const char *name;
  int rank; /* which of several names at one address wins: global, then weak, then local */
} symbol_candidate;

static int compare_candidates(const void *a, const void *b) {
  const symbol_candidate *x = a, *y = b;
  if (x->low != y->low) return x->low < y->low ? -1 : 1;
  return y->rank - x->rank;
}

static int binding_rank(unsigned char binding) {
  return binding == STB_GLOBAL ? 2 : binding == STB_WEAK ? 1 : 0;
}

Elf_Scn *hd_find_symbol_section(Elf *elf, GElf_Word type) {
  Elf_Scn *scn = NULL;
  while ((scn = elf_nextscn(elf, scn)) != NULL) {
    GElf_Shdr shdr;
    if (gelf_getshdr(scn, &shdr) != NULL && shdr.sh_type == type && shdr.sh_size > 0) return scn;
  }
  return NULL;
}

/* Indexes the function symbols of one table. A symbol without a size reaches to the next symbol
 * or the end of its section. */
static bool load_symbols(module *m, Elf *elf, Elf_Scn *scn) {
  GElf_Shdr shdr;
  Elf_Data *data = elf_getdata(scn, NULL);
  size_t entry_size = gelf_fsize(elf, ELF_T_SYM, 1, EV_CURRENT);
  if (gelf_getshdr(scn, &shdr) == NULL || data == NULL || data->d_buf == NULL || entry_size == 0) {
    return false;
  }
  size_t total = data->d_size / entry_size, count = 0;
  symbol_candidate *candidates = calloc(total ? total : 1, sizeof *candidates);
  if (candidates == NULL) return false;
  for (size_t i = 0; i < total; i++) {
    GElf_Sym sym;
    if (gelf_getsym(data, (int)i, &sym) == NULL) continue;
    int type = GELF_ST_TYPE(sym.st_info);
    if ((type != STT_FUNC && type != STT_GNU_IFUNC) || sym.st_value == 0 ||
        sym.st_shndx == SHN_UNDEF || sym.st_shndx >= SHN_LORESERVE) {
      continue;
    }
    const char *name = elf_strptr(elf, shdr.sh_link, sym.st_name);
    GElf_Shdr section;
    if (name == NULL || name[0] == '\0' ||
        gelf_getshdr(elf_getscn(elf, sym.st_shndx), &section) == NULL) {
      continue;
    }
    candidates[count++] =
        (symbol_candidate){sym.st_value, sym.st_size, section.sh_addr + section.sh_size, name,
                           binding_rank(GELF_ST_BIND(sym.st_info))};
  }
  qsort(candidates, count, sizeof *candidates, compare_candidates);
  m->symbol_names = calloc(count ? count : 1, sizeof *m->symbol_names);
  bool ok = m->symbol_names != NULL;
  size_t kept = 0;
  for (size_t i = 0; ok && i < count; i++) {
    if (i > 0 && candidates[i].low == candidates[i - 1].low) continue;
    uint64_t high = candidates[i].low + candidates[i].size;
    if (candidates[i].size == 0) {
      high = candidates[i].section_end;
      for (size_t j = i + 1; j < count; j++) {
        if (candidates[j].low > candidates[i].low) {
          if (candidates[j].low < high) high = candidates[j].low;
          break;
        }
      }
    }
    if (high <= candidates[i].low) continue;
    ok = range_add(&m->symbols, candidates[i].low, high, kept);
    if (ok) m->symbol_names[kept++] = candidates[i].name;
  }
  free(candidates);
  if (!ok || kept == 0) {
    range_free(&m->symbols);
    free(m->symbol_names);
    m->symbol_names = NULL;
    return false;
  }
  range_finish(&m->symbols);
  return true;
}

static const char *symbol_at(const module *m, uint64_t address) {
  const range_entry *e = range_find(&m->symbols, address);
  return e ? m->symbol_names[e->payload] : NULL;
}

/* Opens what exists of the module's files and indexes them; a module with nothing usable stays
 * (cached) with no symbols. */
static void open_module(const hd_symbolizer *s, module *m) {
  /* A relative name resolves against our working directory, not the program's: only a build
   * ID can tell whether the file found there is the right one. */
  bool path_usable = m->name[0] == '/' || (m->name[0] != '\0' && m->build_id_size > 0);
  if (path_usable && hd_elf_file_open(s, m->name, &m->binary) &&
      !hd_build_id_matches(m, m->binary.elf)) {
    hd_elf_file_close(&m->binary);
  }
  if (m->binary.elf == NULL || !hd_load_dwarf(m, m->binary.elf)) hd_find_debug_file(s, m);
  Elf_Scn *scn;
  if (m->debug.elf != NULL && (scn = hd_find_symbol_section(m->debug.elf, SHT_SYMTAB)) != NULL &&
      load_symbols(m, m->debug.elf, scn)) {
    return;
  }
  if (m->binary.elf == NULL) return;
  if ((scn = hd_find_symbol_section(m->binary.elf, SHT_SYMTAB)) != NULL &&
      load_symbols(m, m->binary.elf, scn)) {
    return;
  }
  if ((scn = hd_find_symbol_section(m->binary.elf, SHT_DYNSYM)) != NULL) {
    (void)load_symbols(m, m->binary.elf, scn);
  }
}

static void module_free(module *m) {
  for (size_t i = 0; i < m->unit_count; i++) {
    range_free(&m->units[i].functions);
    free(m->units[i].function_dies);
  }
  free(m->units);
  range_free(&m->unit_ranges);
  range_free(&m->symbols);
  free(m->symbol_names);
  dwarf_end(m->dwarf);
  hd_elf_file_close(&m->debug);
  hd_elf_file_close(&m->binary);
  free(m->name);
  free(m);
}

/* The module of a region, opened on first use; its index in s->modules, or -1 without memory. */
static long module_for(hd_symbolizer *s, const hd_snapshot_region *region) {
  size_t id_size = region->build_id_size;
  if (id_size > sizeof region->build_id) id_size = sizeof region->build_id;
  uint64_t hash = hd_fnv1a(hd_fnv1a(HD_FNV1A_BASIS, region->name, strlen(region->name)),
                           region->build_id, id_size);
  for (size_t i = 0; i < s->module_count; i++) {
    const module *m = s->modules[i];
    if (m->hash == hash && m->build_id_size == id_size &&
        memcmp(m->build_id, region->build_id, id_size) == 0 && strcmp(m->name, region->name) == 0) {
      return (long)i;
    }
  }
  if (!grow((void **)&s->modules, &s->module_capacity, s->module_count + 1, sizeof(module *))) {
    return -1;
  }
  module *m = calloc(1, sizeof *m);
  if (m == NULL || (m->name = strdup(region->name)) == NULL) {
    free(m);
    return -1;
  }
  m->hash = hash;
  memcpy(m->build_id, region->build_id, id_size);
  m->build_id_size = id_size;
  m->binary = m->debug = kNoElfFile;
  open_module(s, m);
  s->modules[s->module_count] = m;
  return (long)s->module_count++;
}

/* ---- The address cache -------------------------------------------------------------------- */

static size_t cache_slot(const hd_symbolizer *s, uint32_t module_index, uint64_t address) {
  uint64_t h = (address ^ ((uint64_t)module_index << 48)) * 0x9e3779b97f4a7c15u;
  size_t mask = s->cache_capacity - 1;
  size_t slot = (size_t)(h >> 20) & mask;
  while (s->cache[slot].used &&
         (s->cache[slot].module_index != module_index || s->cache[slot].address != address)) {
    slot = (slot + 1) & mask;
  }
  return slot;
}

static bool cache_reserve(hd_symbolizer *s) {
  if ((s->cache_count + 1) * 2 <= s->cache_capacity) return true;
  size_t capacity = s->cache_capacity ? s->cache_capacity * 2 : 1024;
  cached_location *old = s->cache;
  size_t old_capacity = s->cache_capacity;
  s->cache = calloc(capacity, sizeof *s->cache);
  if (s->cache == NULL) {
    s->cache = old;
    return false;
  }
  s->cache_capacity = capacity;
  for (size_t i = 0; i < old_capacity; i++) {
    if (old[i].used) s->cache[cache_slot(s, old[i].module_index, old[i].address)] = old[i];
  }
  free(old);
  return true;
}

/* The frames of a link-time address of module m, resolved once. NULL without memory. */
static const cached_location *resolve(hd_symbolizer *s, uint32_t module_index, uint64_t address) {
  if (!cache_reserve(s)) return NULL;
  size_t slot = cache_slot(s, module_index, address);
  if (s->cache[slot].used) return &s->cache[slot];
  module *m = s->modules[module_index];
  hd_source_frame frames[MAX_INLINE_FRAMES];
  size_t count = dwarf_frames(m, address, frames);
  if (count == 0 || frames[count - 1].function == NULL) {
    const char *symbol = symbol_at(m, address);
    if (symbol != NULL) {
      if (count == 0) frames[count++] = (hd_source_frame){0};
      frames[count - 1].function = symbol;
    }
  }
  hd_source_frame *copy = NULL;
  if (count > 0) {
    copy = malloc(count * sizeof *copy);
    if (copy == NULL) return NULL;
    memcpy(copy, frames, count * sizeof *copy);
  }
  s->cache[slot] = (cached_location){true, module_index, address, copy, count};
  s->cache_count++;
  return &s->cache[slot];
}

/* ---- Public interface --------------------------------------------------------------------- */

int hd_symbolizer_create(const hd_symbolizer_options *options, hd_symbolizer **out) {
  *out = NULL;
  if (elf_version(EV_CURRENT) == EV_NONE) return -ELIBBAD;
  hd_symbolizer *s = calloc(1, sizeof *s);
  if (s == NULL) return -ENOMEM;
  s->trusted_files_only = options != NULL && options->trusted_files_only;
  size_t count = options ? options->debug_dir_count : 0;
  if (count > 0) {
    s->debug_dirs = calloc(count, sizeof *s->debug_dirs);
    if (s->debug_dirs == NULL) {
      free(s);
      return -ENOMEM;
    }
  }
  for (size_t i = 0; i < count; i++) {
    if (options->debug_dirs[i] == NULL) {
      hd_symbolizer_destroy(s);
      return -EINVAL;
    }
    s->debug_dirs[s->debug_dir_count] = strdup(options->debug_dirs[i]);
    if (s->debug_dirs[s->debug_dir_count] == NULL) {
      hd_symbolizer_destroy(s);
      return -ENOMEM;
    }
    s->debug_dir_count++;
  }
  *out = s;
  return 0;
}

void hd_symbolizer_destroy(hd_symbolizer *s) {
  if (s == NULL) return;
  for (size_t i = 0; i < s->cache_capacity; i++) free(s->cache[i].frames);
  free(s->cache);
  for (size_t i = 0; i < s->module_count; i++) module_free(s->modules[i]);
  free(s->modules);
  for (size_t i = 0; i < s->debug_dir_count; i++) free(s->debug_dirs[i]);
  free(s->debug_dirs);
  free(s);
}

/* The last region recorded wins: a module loaded where an unloaded one was is the newer. */
static const hd_snapshot_region *region_holding(const hd_snapshot *snap, uint64_t address) {
  for (size_t i = snap->region_count; i-- > 0;) {
    const hd_snapshot_region *r = &snap->regions[i];
    if (address >= r->address && address - r->address < r->size) return r;
  }
  return NULL;
}

void hd_symbolize(hd_symbolizer *s, const hd_snapshot *snap, uint64_t address,
                  bool is_return_address, hd_location_info *out) {
  *out = (hd_location_info){.module = ""};
  /* A return address follows its call, and may be the first byte past the caller. */
  uint64_t lookup = is_return_address && address > 0 ? address - 1 : address;
  const hd_snapshot_region *region = region_holding(snap, lookup);
  if (region != NULL) {
    out->region = region;
    const char *name = region->name ? region->name : "";
    const char *slash = strrchr(name, '/');
    out->module = slash ? slash + 1 : name;
    out->module_offset = address - region->address + region->file_offset;
  }
  /* Names that came with the snapshot (a symbolized pprof profile) win: they were resolved
   * where the binaries were. */
  const hd_snapshot_known_location *known = hd_snapshot_find_known_location(snap, address);
  if (known != NULL) {
    out->frames = known->frames;
    out->frame_count = known->frame_count;
    return;
  }
  if (region == NULL || region->name == NULL) return;
  long index = module_for(s, region);
  if (index < 0) return;
  const module *m = s->modules[index];
  if (m->dwarf != NULL || m->symbols.count > 0) s->found_symbols = true;
  const cached_location *location =
      resolve(s, (uint32_t)index, lookup - region->address + region->vaddr);
  if (location == NULL) return;
  out->frames = location->frames;
  out->frame_count = location->frame_count;
}

bool hd_symbolizer_found_symbols(const hd_symbolizer *s) { return s->found_symbols; }

static char *location_name(const hd_location_info *loc, uint64_t address, bool parameters,
                           char *out, size_t size) {
  if (size == 0) return out;
  const char *function = loc->frame_count > 0 ? loc->frames[loc->frame_count - 1].function : NULL;
  if (function != NULL) {
    snprintf(out, size, "%s",
             parameters ? hd_demangle(function) : hd_demangle_without_parameters(function));
  } else if (loc->region != NULL) {
    snprintf(out, size, "%s+0x%" PRIx64, loc->module, loc->module_offset);
  } else {
    snprintf(out, size, "0x%" PRIx64, address);
  }
  return out;
}

char *hd_location_name(const hd_location_info *loc, uint64_t address, char *out, size_t size) {
  return location_name(loc, address, true, out, size);
}

char *hd_location_short_name(const hd_location_info *loc, uint64_t address, char *out,
                             size_t size) {
  return location_name(loc, address, false, out, size);
}
