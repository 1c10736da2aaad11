/* The module list of our unwinder: each loaded module's executable range and unwind tables, read
 * with dl_iterate_phdr when modules come and go, and read by the allocation path without a lock
 * (a seqlock). */
#define _GNU_SOURCE
#include <link.h>
#include <pthread.h>
#include <stddef.h>

#include "cfi_internal.h"
#include "heapdump/contract/dcheck.h"

#define CFI_MAX_MODULES 1024

/* Readers copy an entry while the sequence stays even and unchanged (a seqlock): the writer,
 * alone under g_modules_lock, makes it odd while it rewrites the list. */
static hd_cfi_module g_modules[CFI_MAX_MODULES];
static size_t g_module_count;
static uint32_t g_modules_seq;
static pthread_mutex_t g_modules_lock = PTHREAD_MUTEX_INITIALIZER;
static hd_cfi_module g_staging[CFI_MAX_MODULES]; /* the next list, under g_modules_lock */
static size_t g_staged;

/* Cached rules are keyed by pc and this generation, moved on whenever modules change: a rule
 * of an unloaded module never serves code loaded at its address later. */
static uint64_t g_cache_generation = 1;

/* The loader's counts of modules ever loaded and unloaded (dl_phdr_info's dlpi_adds and
 * dlpi_subs) when the list was read. glibc also loads and unloads modules without dlopen (iconv's
 * gconv modules, NSS): a cache miss compares the counts before it reads a module's tables, so a
 * module unmapped since is never read. */
static unsigned long long g_loads_seen, g_unloads_seen;

/* Whether the list was read before. The first reading's modules are the program and the
 * objects loaded with it, which the loader never unloads (hd_cfi_module.resident): a cache miss in
 * one reads its tables without asking the loader (and taking its lock) whether modules moved.
 * dl_iterate_phdr lists them first, so each later reading keeps the mark of a module found at
 * the same place with the same range as in the reading before. A module glibc loaded itself
 * could be marked only if the first reading came after its load, but the load allocates (our
 * hook, whose first call reads) before the module joins the list. Under g_modules_lock. */
static bool g_read_before;

/* Modules of the list whose tables were refused. */
static unsigned g_refused;

/* Our dlclose hooks in progress: while one is, the list may name a module being unmapped. */
static unsigned g_closing;

/* Whether dl_phdr_info has the load counts (glibc has had them since 2.4). */
static bool has_load_counts(size_t size) {
  return size >= offsetof(struct dl_phdr_info, dlpi_subs) + sizeof(unsigned long long);
}

/* Copies the loader's load and unload counts into counts[0..1]. */
static void note_load_counts(const struct dl_phdr_info *info, size_t size, void *counts) {
  if (has_load_counts(size)) {
    ((unsigned long long *)counts)[0] = info->dlpi_adds;
    ((unsigned long long *)counts)[1] = info->dlpi_subs;
  }
}

/* What reading a module's .eh_frame_hdr gave. TABLES_NONE: no search table we read (a linker
 * leaves it out when it cannot sort the FDEs): its frames fall back, and libunwind is not shown
 * it either (it would search .eh_frame unchecked), but the tables are not counted as refused.
 * TABLES_BAD: a search table whose offsets leave the module. */
typedef enum { TABLES_OK, TABLES_NONE, TABLES_BAD } tables_read;

/* Reads the header of the tables of the module info describes, whose .eh_frame_hdr is at hdr,
 * within the segment that maps it, where linkers put .eh_frame too. */
static tables_read read_tables(const struct dl_phdr_info *info, uintptr_t hdr, hd_cfi_tables *out) {
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
    const uintptr_t start = info->dlpi_addr + ph->p_vaddr;
    if (ph->p_type != PT_LOAD || hdr < start || hdr - start >= ph->p_memsz) continue;
    if (hd_cfi_read_eh_frame_hdr((const uint8_t *)hdr, start, start + ph->p_memsz, out)) {
      return TABLES_OK;
    }
    const uint8_t *h = (const uint8_t *)hdr;
    const bool searchable = ph->p_memsz - (hdr - start) >= 4 && h[0] == 1 && h[1] != 0xff &&
                            h[2] != 0xff && h[3] == 0x3b; /* version 1, datarel sdata4 table */
    return searchable ? TABLES_BAD : TABLES_NONE;
  }
  return TABLES_NONE;
}

/* Whether two readings give the same tables: the same place, bounds and entries. */
static bool same_tables(const hd_cfi_tables *a, const hd_cfi_tables *b) {
  return a->hdr == b->hdr && a->table == b->table && a->fde_count == b->fde_count &&
         a->lo == b->lo && a->hi == b->hi;
}

/* The same module (range and tables' address), its tables passed, in the list as last read: if
 * its tables read the same now, the check stands (tables are checked once, not at every dlopen
 * of another module). Under g_modules_lock. */
static const hd_cfi_module *previous_reading(const hd_cfi_module *m) {
  for (size_t i = 0; i < g_module_count; i++) {
    const hd_cfi_module *p = &g_modules[i];
    if (p->lo == m->lo && p->hi == m->hi && p->eh_frame_hdr == m->eh_frame_hdr && !p->refused) {
      return p;
    }
  }
  return NULL;
}

static int stage_module(struct dl_phdr_info *info, size_t size, void *counts) {
  note_load_counts(info, size, counts);
  if (g_staged == CFI_MAX_MODULES) return 1;
  hd_cfi_module m = {.lo = UINTPTR_MAX};
  uintptr_t hdr = 0;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
    const uintptr_t start = info->dlpi_addr + ph->p_vaddr;
    if (ph->p_type == PT_LOAD && (ph->p_flags & PF_X)) {
      if (start < m.lo) m.lo = start;
      if (start + ph->p_memsz > m.hi) m.hi = start + ph->p_memsz;
    } else if (ph->p_type == PT_GNU_EH_FRAME) {
      hdr = start;
    }
  }
  if (m.lo >= m.hi) return 0;
  m.eh_frame_hdr = hdr;
  if (hdr != 0) {
    /* The header is read at each reading (another module may have taken this one's place
     * between two); the whole check only for a module whose tables are not those checked the
     * last time. */
    const hd_cfi_module *before = previous_reading(&m);
    const tables_read got = read_tables(info, hdr, &m.tables);
    if (got == TABLES_BAD) {
      m.refused = true;
    } else if (got == TABLES_OK && (before == NULL || !same_tables(&before->tables, &m.tables))) {
      m.refused = !hd_cfi_check_tables(&m.tables);
    }
    if (got != TABLES_OK || m.refused) m.tables = (hd_cfi_tables){0};
  }
  g_staging[g_staged++] = m;
  return 0;
}

/* Moves the generation on; the cache is emptied first when its keys' 16 bits wrap. */
static void next_generation(void) {
  const uint64_t next = __atomic_load_n(&g_cache_generation, __ATOMIC_RELAXED) + 1;
  if ((next & 0xffff) == 0) hd_cfi_cache_clear();
  __atomic_store_n(&g_cache_generation, next, __ATOMIC_RELEASE);
}

/* Rereads the list; the caller holds g_modules_lock. */
static void reread_modules(void) {
  unsigned long long counts[2] = {0, 0};
  g_staged = 0;
  dl_iterate_phdr(stage_module, counts);
  for (size_t i = 0; i < g_staged; i++) {
    const hd_cfi_module *before = &g_modules[i]; /* the list as last read, rewritten below */
    g_staging[i].resident =
        !g_read_before || (i < g_module_count && before->resident &&
                           before->lo == g_staging[i].lo && before->hi == g_staging[i].hi);
  }
  g_read_before = true;
  const uint32_t seq = __atomic_load_n(&g_modules_seq, __ATOMIC_RELAXED);
  HD_DCHECK((seq & 1) == 0); /* one writer, under g_modules_lock */
  unsigned refused = 0;
  __atomic_store_n(&g_modules_seq, seq + 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  for (size_t i = 0; i < g_staged; i++) {
    hd_cfi_module *m = &g_modules[i];
    const hd_cfi_module *s = &g_staging[i];
    __atomic_store_n(&m->lo, s->lo, __ATOMIC_RELAXED);
    __atomic_store_n(&m->hi, s->hi, __ATOMIC_RELAXED);
    __atomic_store_n(&m->tables.hdr, s->tables.hdr, __ATOMIC_RELAXED);
    __atomic_store_n(&m->tables.table, s->tables.table, __ATOMIC_RELAXED);
    __atomic_store_n(&m->tables.fde_count, s->tables.fde_count, __ATOMIC_RELAXED);
    __atomic_store_n(&m->tables.lo, s->tables.lo, __ATOMIC_RELAXED);
    __atomic_store_n(&m->tables.hi, s->tables.hi, __ATOMIC_RELAXED);
    __atomic_store_n(&m->resident, s->resident, __ATOMIC_RELAXED);
    __atomic_store_n(&m->eh_frame_hdr, s->eh_frame_hdr, __ATOMIC_RELAXED);
    __atomic_store_n(&m->refused, s->refused, __ATOMIC_RELAXED);
    refused += s->refused != 0;
  }
  __atomic_store_n(&g_refused, refused, __ATOMIC_RELAXED);
  __atomic_store_n(&g_module_count, g_staged, __ATOMIC_RELAXED);
  __atomic_store_n(&g_loads_seen, counts[0], __ATOMIC_RELAXED);
  __atomic_store_n(&g_unloads_seen, counts[1], __ATOMIC_RELAXED);
  __atomic_store_n(&g_modules_seq, seq + 2, __ATOMIC_RELEASE);
  next_generation();
}

void hd_cfi_modules_changed(void) {
  pthread_mutex_lock(&g_modules_lock);
  reread_modules();
  pthread_mutex_unlock(&g_modules_lock);
}

void hd_cfi_modules_closing(void) { __atomic_fetch_add(&g_closing, 1, __ATOMIC_SEQ_CST); }

void hd_cfi_modules_closed(void) {
  hd_cfi_modules_changed();
  __atomic_fetch_sub(&g_closing, 1, __ATOMIC_SEQ_CST);
}

static int read_load_counts(struct dl_phdr_info *info, size_t size, void *counts) {
  note_load_counts(info, size, counts);
  return 1; /* the first module is enough: every one carries the counts */
}

bool hd_cfi_modules_current(void) {
  unsigned long long counts[2] = {0, 0};
  dl_iterate_phdr(read_load_counts, counts);
  if (counts[0] == __atomic_load_n(&g_loads_seen, __ATOMIC_RELAXED) &&
      counts[1] == __atomic_load_n(&g_unloads_seen, __ATOMIC_RELAXED)) {
    return true;
  }
  /* Reread here, so that a module's constructors, which run before dlopen returns, are walked
   * through. */
  if (pthread_mutex_trylock(&g_modules_lock) != 0) return false;
  reread_modules();
  pthread_mutex_unlock(&g_modules_lock);
  return true;
}

void hd_cfi_after_fork_child(void) {
  pthread_mutex_init(&g_modules_lock, NULL);
  const uint32_t seq = __atomic_load_n(&g_modules_seq, __ATOMIC_RELAXED);
  if (seq & 1) {
    /* A parent thread was rewriting the list: until the next dlopen or dlclose rebuilds it,
     * no module is known and every stack falls back. */
    __atomic_store_n(&g_module_count, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&g_modules_seq, seq + 1, __ATOMIC_RELEASE);
    next_generation();
  }
  __atomic_store_n(&g_closing, 0, __ATOMIC_RELAXED); /* hooks of other threads are gone */
}

hd_cfi_lookup hd_cfi_find_module(uintptr_t pc, hd_cfi_module *out) {
  if (__atomic_load_n(&g_closing, __ATOMIC_SEQ_CST) != 0) return HD_CFI_MODULE_CHANGING;
  const uint32_t seq = __atomic_load_n(&g_modules_seq, __ATOMIC_ACQUIRE);
  if (seq & 1) return HD_CFI_MODULE_CHANGING;
  const size_t n = __atomic_load_n(&g_module_count, __ATOMIC_RELAXED);
  hd_cfi_lookup found = HD_CFI_MODULE_NONE;
  for (size_t i = 0; i < n && found == HD_CFI_MODULE_NONE; i++) {
    const hd_cfi_module *m = &g_modules[i];
    const uintptr_t lo = __atomic_load_n(&m->lo, __ATOMIC_RELAXED);
    const uintptr_t hi = __atomic_load_n(&m->hi, __ATOMIC_RELAXED);
    if (pc < lo || pc >= hi) continue;
    out->lo = lo;
    out->hi = hi;
    out->tables.hdr = __atomic_load_n(&m->tables.hdr, __ATOMIC_RELAXED);
    out->tables.table = __atomic_load_n(&m->tables.table, __ATOMIC_RELAXED);
    out->tables.fde_count = __atomic_load_n(&m->tables.fde_count, __ATOMIC_RELAXED);
    out->tables.lo = __atomic_load_n(&m->tables.lo, __ATOMIC_RELAXED);
    out->tables.hi = __atomic_load_n(&m->tables.hi, __ATOMIC_RELAXED);
    out->resident = __atomic_load_n(&m->resident, __ATOMIC_RELAXED);
    found = HD_CFI_MODULE_FOUND;
  }
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  return __atomic_load_n(&g_modules_seq, __ATOMIC_RELAXED) == seq ? found : HD_CFI_MODULE_CHANGING;
}

unsigned hd_cfi_refused_modules(void) { return __atomic_load_n(&g_refused, __ATOMIC_RELAXED); }

/* The verdict on the module whose .eh_frame_hdr is at hdr, as the list has it: 1 not to be
 * shown to libunwind, 0 usable, -1 not in the list (or the list kept changing). */
static int listed_verdict(uintptr_t hdr) {
  for (int attempt = 0; attempt < 100; attempt++) {
    const uint32_t seq = __atomic_load_n(&g_modules_seq, __ATOMIC_ACQUIRE);
    if (seq & 1) continue;
    const size_t n = __atomic_load_n(&g_module_count, __ATOMIC_RELAXED);
    int verdict = -1;
    for (size_t i = 0; i < n && verdict < 0; i++) {
      if (__atomic_load_n(&g_modules[i].eh_frame_hdr, __ATOMIC_RELAXED) == hdr) {
        /* No tables kept: refused, or none that can be searched. */
        verdict = __atomic_load_n(&g_modules[i].tables.hdr, __ATOMIC_RELAXED) == NULL;
      }
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&g_modules_seq, __ATOMIC_RELAXED) == seq) return verdict;
  }
  return -1;
}

bool hd_cfi_module_tables_usable(const struct dl_phdr_info *info) {
  uintptr_t hdr = 0;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    if (info->dlpi_phdr[i].p_type == PT_GNU_EH_FRAME) {
      hdr = info->dlpi_addr + info->dlpi_phdr[i].p_vaddr;
    }
  }
  if (hdr == 0) return true; /* no tables: libunwind looks no further (its open fails) */
  const int verdict = listed_verdict(hdr);
  if (verdict >= 0) return verdict == 0;
  hd_cfi_tables tables;
  switch (read_tables(info, hdr, &tables)) {
    case TABLES_OK: return hd_cfi_check_tables(&tables);
    /* No search table: libunwind would search .eh_frame itself, unchecked. */
    case TABLES_NONE: return false;
    default: return false;
  }
}

uint64_t hd_cfi_generation(void) { return __atomic_load_n(&g_cache_generation, __ATOMIC_ACQUIRE); }
