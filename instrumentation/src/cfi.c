/* Our x86-64 unwinder. For each frame it needs three numbers: where the frame's CFA (the stack
 * pointer before the call) is, relative to rsp or rbp; where below the CFA the return address
 * is; and where the caller's rbp was saved, if it was. DWARF's call-frame information says that
 * for every instruction, in a byte code that libgcc and libunwind interpret anew on each step.
 * Here the byte code of the frame's FDE is run once per program counter and compiled into one
 * 64-bit rule, which a cache keeps; the allocation path then reads a rule and two stack slots per
 * frame, with no lock, no system call and no allocation.
 *
 * Code with no call-frame information at all (outside every module: JIT code; a module without
 * .eh_frame_hdr; a gap between a module's FDEs: hand-written assembly) is stepped over as a
 * frame-pointer frame where rbp points at one, as libunwind does. What a rule cannot say (a CFA
 * computed by an expression, a return address kept in another register) ends the walk there:
 * HD_CFI_UNSUPPORTED, with the frames walked so far. */
#define _GNU_SOURCE
#include "cfi.h"

#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>

/* DWARF register numbers on x86-64 (System V psABI, "DWARF Register Number Mapping"). */
enum { DW_REG_RBP = 6, DW_REG_RSP = 7, DW_REG_RA = 16 };

/* Pointer encodings (LSB "DWARF Extensions", .eh_frame). */
enum {
  DW_EH_PE_absptr = 0x00,
  DW_EH_PE_uleb128 = 0x01,
  DW_EH_PE_udata2 = 0x02,
  DW_EH_PE_udata4 = 0x03,
  DW_EH_PE_udata8 = 0x04,
  DW_EH_PE_sleb128 = 0x09,
  DW_EH_PE_sdata2 = 0x0a,
  DW_EH_PE_sdata4 = 0x0b,
  DW_EH_PE_sdata8 = 0x0c,
  DW_EH_PE_pcrel = 0x10,
  DW_EH_PE_datarel = 0x30,
  DW_EH_PE_omit = 0xff,
};

/* ---- reading DWARF ---- */

/* A bounded reader: any read past `end` clears ok and reads zero. */
typedef struct dw_reader {
  const uint8_t *p, *end;
  bool ok;
} dw_reader;

static uint64_t read_fixed(dw_reader *r, size_t size) {
  if (!r->ok || (size_t)(r->end - r->p) < size) {
    r->ok = false;
    return 0;
  }
  uint64_t v = 0;
  memcpy(&v, r->p, size); /* little-endian */
  r->p += size;
  return v;
}

static uint64_t read_uleb(dw_reader *r) {
  uint64_t v = 0;
  for (unsigned shift = 0; r->ok; shift += 7) {
    if (r->p >= r->end || shift > 63) break;
    const uint8_t byte = *r->p++;
    v |= (uint64_t)(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) return v;
  }
  r->ok = false;
  return 0;
}

static int64_t read_sleb(dw_reader *r) {
  int64_t v = 0;
  for (unsigned shift = 0; r->ok; shift += 7) {
    if (r->p >= r->end || shift > 63) break;
    const uint8_t byte = *r->p++;
    v |= (int64_t)((uint64_t)(byte & 0x7f) << shift);
    if ((byte & 0x80) == 0) {
      if (shift + 7 < 64 && (byte & 0x40)) v |= -((int64_t)1 << (shift + 7));
      return v;
    }
  }
  r->ok = false;
  return 0;
}

/* Skips `length` bytes, if there are that many. */
static void skip(dw_reader *r, uint64_t length) {
  if (!r->ok || length > (uint64_t)(r->end - r->p)) {
    r->ok = false;
    return;
  }
  r->p += length;
}

/* An offset factored by the CIE's alignment, without signed overflow on hostile input. */
static int64_t factored(uint64_t value, int64_t factor) {
  return (int64_t)(value * (uint64_t)factor);
}

/* A pointer in encoding `enc`: absolute, relative to where it is stored (pcrel) or to
 * `datarel`. value_only: the format alone, as for an FDE's address range. */
static uintptr_t read_encoded(dw_reader *r, uint8_t enc, uintptr_t datarel, bool value_only) {
  const uintptr_t at = (uintptr_t)r->p;
  uint64_t v;
  switch (enc & 0x0f) {
    case DW_EH_PE_absptr: v = read_fixed(r, 8); break;
    case DW_EH_PE_uleb128: v = read_uleb(r); break;
    case DW_EH_PE_udata2: v = read_fixed(r, 2); break;
    case DW_EH_PE_udata4: v = read_fixed(r, 4); break;
    case DW_EH_PE_udata8: v = read_fixed(r, 8); break;
    case DW_EH_PE_sleb128: v = (uint64_t)read_sleb(r); break;
    case DW_EH_PE_sdata2: v = (uint64_t)(int64_t)(int16_t)read_fixed(r, 2); break;
    case DW_EH_PE_sdata4: v = (uint64_t)(int64_t)(int32_t)read_fixed(r, 4); break;
    case DW_EH_PE_sdata8: v = read_fixed(r, 8); break;
    default: r->ok = false; return 0;
  }
  if (value_only) return (uintptr_t)v;
  switch (enc & 0x70) {
    case DW_EH_PE_absptr: return (uintptr_t)v;
    case DW_EH_PE_pcrel: return at + (uintptr_t)v;
    case DW_EH_PE_datarel: return datarel + (uintptr_t)v;
    default: r->ok = false; return 0; /* textrel, funcrel, aligned: not used on x86-64 */
  }
}

/* ---- the modules ---- */

#define CFI_MAX_MODULES 1024

typedef struct cfi_module {
  uintptr_t lo, hi;      /* its executable segments */
  const uint8_t *hdr;    /* .eh_frame_hdr; NULL: none we can search */
  const int32_t *table;  /* (initial location, FDE) pairs relative to hdr, sorted */
  uintptr_t fde_count;
  uintptr_t resident;    /* non-zero: loaded with the program (g_read_before), never unloaded */
} cfi_module;

/* Readers copy an entry while the sequence stays even and unchanged (a seqlock): the writer,
 * alone under g_modules_lock, makes it odd while it rewrites the list. */
static cfi_module g_modules[CFI_MAX_MODULES];
static size_t g_module_count;
static uint32_t g_modules_seq;
static pthread_mutex_t g_modules_lock = PTHREAD_MUTEX_INITIALIZER;
static cfi_module g_staging[CFI_MAX_MODULES]; /* the next list, under g_modules_lock */
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
 * objects loaded with it, which the loader never unloads (cfi_module.resident): a cache miss in
 * one reads its tables without asking the loader (and taking its lock) whether modules moved.
 * dl_iterate_phdr lists them first, so each later reading keeps the mark of a module found at
 * the same place with the same range as in the reading before. A module glibc loaded itself
 * could be marked only if the first reading came after its load, but the load allocates (our
 * hook, whose first call reads) before the module joins the list. Under g_modules_lock. */
static bool g_read_before;

/* Our dlclose hooks in progress: while one is, the list may name a module being unmapped. */
static unsigned g_closing;

/* .eh_frame_hdr, version 1, with the binary-search table that linkers write (datarel sdata4). */
static bool read_eh_frame_hdr(const uint8_t *hdr, cfi_module *m) {
  if (hdr[0] != 1 || hdr[3] != (DW_EH_PE_datarel | DW_EH_PE_sdata4)) return false;
  dw_reader r = {hdr + 4, hdr + 4 + 16, true};
  (void)read_encoded(&r, hdr[1], (uintptr_t)hdr, false); /* eh_frame_ptr */
  const uintptr_t count = read_encoded(&r, hdr[2], (uintptr_t)hdr, false);
  if (!r.ok || hdr[1] == DW_EH_PE_omit || hdr[2] == DW_EH_PE_omit) return false;
  m->hdr = hdr;
  m->table = (const int32_t *)r.p;
  m->fde_count = count;
  return true;
}

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

static int stage_module(struct dl_phdr_info *info, size_t size, void *counts) {
  note_load_counts(info, size, counts);
  if (g_staged == CFI_MAX_MODULES) return 1;
  cfi_module m = {.lo = UINTPTR_MAX};
  const uint8_t *hdr = NULL;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
    const uintptr_t start = info->dlpi_addr + ph->p_vaddr;
    if (ph->p_type == PT_LOAD && (ph->p_flags & PF_X)) {
      if (start < m.lo) m.lo = start;
      if (start + ph->p_memsz > m.hi) m.hi = start + ph->p_memsz;
    } else if (ph->p_type == PT_GNU_EH_FRAME) {
      hdr = (const uint8_t *)start;
    }
  }
  if (m.lo >= m.hi) return 0;
  if (hdr != NULL) (void)read_eh_frame_hdr(hdr, &m); /* else its frames fall back */
  g_staging[g_staged++] = m;
  return 0;
}

static void clear_cache(void);

/* Moves the generation on; the cache is emptied first when its keys' 16 bits wrap. */
static void next_generation(void) {
  const uint64_t next = __atomic_load_n(&g_cache_generation, __ATOMIC_RELAXED) + 1;
  if ((next & 0xffff) == 0) clear_cache();
  __atomic_store_n(&g_cache_generation, next, __ATOMIC_RELEASE);
}

/* Rereads the list; the caller holds g_modules_lock. */
static void reread_modules(void) {
  unsigned long long counts[2] = {0, 0};
  g_staged = 0;
  dl_iterate_phdr(stage_module, counts);
  for (size_t i = 0; i < g_staged; i++) {
    const cfi_module *before = &g_modules[i]; /* the list as last read, rewritten below */
    g_staging[i].resident = !g_read_before || (i < g_module_count && before->resident &&
                                               before->lo == g_staging[i].lo &&
                                               before->hi == g_staging[i].hi);
  }
  g_read_before = true;
  const uint32_t seq = __atomic_load_n(&g_modules_seq, __ATOMIC_RELAXED);
  __atomic_store_n(&g_modules_seq, seq + 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  for (size_t i = 0; i < g_staged; i++) {
    cfi_module *m = &g_modules[i];
    __atomic_store_n(&m->lo, g_staging[i].lo, __ATOMIC_RELAXED);
    __atomic_store_n(&m->hi, g_staging[i].hi, __ATOMIC_RELAXED);
    __atomic_store_n(&m->hdr, g_staging[i].hdr, __ATOMIC_RELAXED);
    __atomic_store_n(&m->table, g_staging[i].table, __ATOMIC_RELAXED);
    __atomic_store_n(&m->fde_count, g_staging[i].fde_count, __ATOMIC_RELAXED);
    __atomic_store_n(&m->resident, g_staging[i].resident, __ATOMIC_RELAXED);
  }
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

/* Whether the loader loaded or unloaded a module since the list was read; if so the list is
 * reread here (so that a module's constructors, which run before dlopen returns, are walked
 * through), unless another thread is at it. Takes the loader's lock: only for a cache miss
 * outside the modules loaded with the program. */
typedef enum { MODULES_CURRENT, MODULES_BEING_REREAD } modules_check;
static modules_check modules_moved(void) {
  unsigned long long counts[2] = {0, 0};
  dl_iterate_phdr(read_load_counts, counts);
  if (counts[0] == __atomic_load_n(&g_loads_seen, __ATOMIC_RELAXED) &&
      counts[1] == __atomic_load_n(&g_unloads_seen, __ATOMIC_RELAXED)) {
    return MODULES_CURRENT;
  }
  if (pthread_mutex_trylock(&g_modules_lock) != 0) return MODULES_BEING_REREAD;
  reread_modules();
  pthread_mutex_unlock(&g_modules_lock);
  return MODULES_CURRENT;
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

typedef enum module_lookup { MODULE_FOUND, MODULE_NONE, MODULE_CHANGING } module_lookup;

static module_lookup find_module(uintptr_t pc, cfi_module *out) {
  if (__atomic_load_n(&g_closing, __ATOMIC_SEQ_CST) != 0) return MODULE_CHANGING;
  const uint32_t seq = __atomic_load_n(&g_modules_seq, __ATOMIC_ACQUIRE);
  if (seq & 1) return MODULE_CHANGING;
  const size_t n = __atomic_load_n(&g_module_count, __ATOMIC_RELAXED);
  module_lookup found = MODULE_NONE;
  for (size_t i = 0; i < n && found == MODULE_NONE; i++) {
    const cfi_module *m = &g_modules[i];
    const uintptr_t lo = __atomic_load_n(&m->lo, __ATOMIC_RELAXED);
    const uintptr_t hi = __atomic_load_n(&m->hi, __ATOMIC_RELAXED);
    if (pc < lo || pc >= hi) continue;
    out->lo = lo;
    out->hi = hi;
    out->hdr = __atomic_load_n(&m->hdr, __ATOMIC_RELAXED);
    out->table = __atomic_load_n(&m->table, __ATOMIC_RELAXED);
    out->fde_count = __atomic_load_n(&m->fde_count, __ATOMIC_RELAXED);
    out->resident = __atomic_load_n(&m->resident, __ATOMIC_RELAXED);
    found = MODULE_FOUND;
  }
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  return __atomic_load_n(&g_modules_seq, __ATOMIC_RELAXED) == seq ? found : MODULE_CHANGING;
}

/* ---- compiling a frame's rule ---- */

/* A rule in 64 bits:
 *   bits 0-1   kind (RULE_UNSUPPORTED, RULE_FRAME, RULE_OUTERMOST, RULE_SIGNAL)
 *   bit 2      the CFA is rbp + offset (else rsp + offset)
 *   bit 3      the caller's rbp is saved (else rbp is unchanged)
 *   bits 8-15  the return address's offset from the CFA, in 8-byte words (signed)
 *   bits 16-23 the saved rbp's offset from the CFA, in 8-byte words (signed)
 *   bits 32-63 the CFA's offset from its register (signed) */
enum { RULE_UNSUPPORTED = 0, RULE_FRAME = 1, RULE_OUTERMOST = 2, RULE_SIGNAL = 3 };
/* An unsupported rule for code that has no call-frame information at all (rather than some our
 * rules cannot express): the walk may step it by its frame pointer. */
#define RULE_NO_INFO ((uint64_t)RULE_UNSUPPORTED | 4u)
#define RULE_KIND(r) ((unsigned)((r)&3))
#define RULE_CFA_RBP(r) (((r) >> 2) & 1)
#define RULE_RBP_SAVED(r) (((r) >> 3) & 1)
#define RULE_RA_WORDS(r) ((int8_t)((r) >> 8))
#define RULE_RBP_WORDS(r) ((int8_t)((r) >> 16))
#define RULE_CFA_OFFSET(r) ((int32_t)((r) >> 32))

/* How a register is recovered, as far as our rules can say. REG_UNSET: no rule was given (for the
 * return address that is an FDE we cannot use, not the outermost frame, which says
 * DW_CFA_undefined). */
enum { REG_SAME, REG_AT_CFA_OFFSET, REG_UNDEFINED, REG_OTHER, REG_UNSET };

typedef struct reg_rule {
  uint8_t how;
  int64_t offset;
} reg_rule;

typedef struct frame_state {
  uint64_t cfa_reg; /* DW_REG_RSP or DW_REG_RBP; anything else cannot be compiled */
  int64_t cfa_offset;
  bool cfa_by_expression;
  bool rsp_rule; /* a rule for rsp itself: the caller's rsp is not the CFA, as ours assume */
  reg_rule rbp, ra;
} frame_state;

typedef struct cie_info {
  uint64_t code_align;
  int64_t data_align;
  uint8_t fde_encoding;
  bool has_augmentation_data, signal_frame;
  const uint8_t *instructions, *end;
} cie_info;

static bool read_cie(const uint8_t *cie, cie_info *out) {
  dw_reader r = {cie, cie + 4, true};
  const uint32_t length = (uint32_t)read_fixed(&r, 4);
  if (!r.ok || length == 0 || length == 0xffffffffu) return false;
  r.end = cie + 4 + length;
  if (read_fixed(&r, 4) != 0) return false; /* a CIE's id is 0 in .eh_frame */
  const uint8_t version = (uint8_t)read_fixed(&r, 1);
  if (version != 1 && version != 3) return false;
  const char *augmentation = (const char *)r.p;
  const size_t aug_length = strnlen(augmentation, (size_t)(r.end - r.p));
  if (aug_length == (size_t)(r.end - r.p) || strstr(augmentation, "eh") != NULL) return false;
  r.p += aug_length + 1;
  *out = (cie_info){.fde_encoding = DW_EH_PE_absptr};
  out->code_align = read_uleb(&r);
  out->data_align = read_sleb(&r);
  const uint64_t ra_register = version == 1 ? read_fixed(&r, 1) : read_uleb(&r);
  if (!r.ok || ra_register != DW_REG_RA) return false;
  if (augmentation[0] == 'z') {
    out->has_augmentation_data = true;
    const uint64_t data_length = read_uleb(&r);
    if (!r.ok || data_length > (uint64_t)(r.end - r.p)) return false;
    const uint8_t *data_end = r.p + data_length;
    for (const char *a = augmentation + 1; *a != '\0' && r.ok; a++) {
      if (*a == 'R') {
        out->fde_encoding = (uint8_t)read_fixed(&r, 1);
      } else if (*a == 'P') {
        const uint8_t encoding = (uint8_t)read_fixed(&r, 1);
        (void)read_encoded(&r, encoding & 0x7f, 0, true); /* the personality: not ours */
      } else if (*a == 'L') {
        (void)read_fixed(&r, 1);
      } else if (*a == 'S') {
        out->signal_frame = true;
      } else {
        break; /* unknown: 'z' tells its data's length, so the rest is skipped */
      }
    }
    r.p = data_end;
  } else if (augmentation[0] != '\0') {
    return false;
  }
  out->instructions = r.p;
  out->end = r.end;
  return r.ok;
}

static void set_reg(frame_state *s, uint64_t reg, uint8_t how, int64_t offset) {
  if (reg == DW_REG_RSP) s->rsp_rule = how != REG_SAME;
  reg_rule *rule = reg == DW_REG_RBP ? &s->rbp : reg == DW_REG_RA ? &s->ra : NULL;
  if (rule != NULL) *rule = (reg_rule){how, offset};
}

static void restore_reg(frame_state *s, const frame_state *initial, uint64_t reg) {
  if (reg == DW_REG_RSP) s->rsp_rule = initial->rsp_rule;
  if (reg == DW_REG_RBP) s->rbp = initial->rbp;
  if (reg == DW_REG_RA) s->ra = initial->ra;
}

/* The one CFA expression the linker writes for lazy-binding PLT entries: the entry pushes its
 * relocation index from its 11th (10th with IBT) byte on, so the CFA is rsp + 8, plus 8 from
 * there: DW_OP_breg7 8; DW_OP_breg16 0; DW_OP_lit15; DW_OP_and; DW_OP_litK; DW_OP_ge;
 * DW_OP_lit3; DW_OP_shl; DW_OP_plus. A PLT entry calls nothing, so pc is the exact instruction
 * (a signal interrupted it) and the expression is evaluated for it here, once. */
static bool plt_cfa(const uint8_t *expr, uint64_t length, const uint8_t *end, uintptr_t pc,
                    frame_state *s) {
  static const uint8_t kPlt[] = {0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x00, 0x2a, 0x33, 0x24, 0x22};
  enum { K_AT = 6, DW_OP_LIT0 = 0x30 };
  if (length != sizeof kPlt || (uint64_t)(end - expr) < length) return false;
  for (size_t i = 0; i < sizeof kPlt; i++) {
    if (i != K_AT && expr[i] != kPlt[i]) return false;
  }
  if (expr[K_AT] < DW_OP_LIT0 || expr[K_AT] > DW_OP_LIT0 + 15) return false;
  const unsigned k = expr[K_AT] - DW_OP_LIT0;
  s->cfa_reg = DW_REG_RSP;
  s->cfa_offset = 8 + ((pc & 15) >= k ? 8 : 0);
  return true;
}

#define REMEMBER_DEPTH 8

/* Runs call-frame instructions from `code` to `end` on *s until the location passes pc.
 * `initial`: the state after the CIE's instructions (DW_CFA_restore), NULL while running them. */
static bool run_cfa_program(const uint8_t *code, const uint8_t *end, const cie_info *cie,
                            uintptr_t location, uintptr_t pc, const frame_state *initial,
                            frame_state *s) {
  dw_reader r = {code, end, true};
  frame_state remembered[REMEMBER_DEPTH];
  unsigned depth = 0;
  while (r.ok && r.p < r.end && location <= pc) {
    const uint8_t op = (uint8_t)read_fixed(&r, 1);
    const uint8_t low = op & 0x3f;
    uint64_t reg;
    if (op >> 6 == 1) { /* advance_loc */
      location += low * cie->code_align;
      continue;
    }
    if (op >> 6 == 2) { /* offset */
      set_reg(s, low, REG_AT_CFA_OFFSET, factored(read_uleb(&r), cie->data_align));
      continue;
    }
    if (op >> 6 == 3) { /* restore */
      if (initial != NULL) restore_reg(s, initial, low);
      continue;
    }
    switch (op) {
      case 0x00: break; /* nop */
      case 0x01: location = read_encoded(&r, cie->fde_encoding, 0, false); break;
      case 0x02: location += read_fixed(&r, 1) * cie->code_align; break;
      case 0x03: location += read_fixed(&r, 2) * cie->code_align; break;
      case 0x04: location += read_fixed(&r, 4) * cie->code_align; break;
      case 0x05: reg = read_uleb(&r); set_reg(s, reg, REG_AT_CFA_OFFSET, factored(read_uleb(&r), cie->data_align)); break;
      case 0x06: reg = read_uleb(&r); if (initial != NULL) restore_reg(s, initial, reg); break;
      case 0x07: set_reg(s, read_uleb(&r), REG_UNDEFINED, 0); break;
      case 0x08: set_reg(s, read_uleb(&r), REG_SAME, 0); break;
      case 0x09: reg = read_uleb(&r); (void)read_uleb(&r); set_reg(s, reg, REG_OTHER, 0); break;
      case 0x0a: /* remember_state */
        if (depth == REMEMBER_DEPTH) return false;
        remembered[depth++] = *s;
        break;
      case 0x0b: /* restore_state */
        if (depth == 0) return false;
        *s = remembered[--depth];
        break;
      case 0x0c: s->cfa_reg = read_uleb(&r); s->cfa_offset = (int64_t)read_uleb(&r); s->cfa_by_expression = false; break;
      case 0x0d: s->cfa_reg = read_uleb(&r); s->cfa_by_expression = false; break;
      case 0x0e: s->cfa_offset = (int64_t)read_uleb(&r); break;
      case 0x0f: { /* def_cfa_expression */
        const uint64_t length = read_uleb(&r);
        s->cfa_by_expression = !plt_cfa(r.p, length, r.end, pc, s);
        skip(&r, length);
        break;
      }
      case 0x10: /* expression */
        reg = read_uleb(&r);
        set_reg(s, reg, REG_OTHER, 0);
        skip(&r, read_uleb(&r));
        break;
      case 0x11: reg = read_uleb(&r); set_reg(s, reg, REG_AT_CFA_OFFSET, factored((uint64_t)read_sleb(&r), cie->data_align)); break;
      case 0x12: s->cfa_reg = read_uleb(&r); s->cfa_offset = factored((uint64_t)read_sleb(&r), cie->data_align); s->cfa_by_expression = false; break;
      case 0x13: s->cfa_offset = factored((uint64_t)read_sleb(&r), cie->data_align); break;
      case 0x14: case 0x15: reg = read_uleb(&r); (void)read_uleb(&r); set_reg(s, reg, REG_OTHER, 0); break;
      case 0x16: /* val_expression */
        reg = read_uleb(&r);
        set_reg(s, reg, REG_OTHER, 0);
        skip(&r, read_uleb(&r));
        break;
      case 0x2e: (void)read_uleb(&r); break; /* GNU_args_size */
      case 0x2f: reg = read_uleb(&r); set_reg(s, reg, REG_AT_CFA_OFFSET, factored(0 - read_uleb(&r), cie->data_align)); break;
      default: return false;
    }
  }
  return r.ok;
}

/* The FDE whose range may hold pc: the last table entry starting at or before it. */
static const uint8_t *find_fde(const cfi_module *m, uintptr_t pc) {
  size_t lo = 0, hi = m->fde_count;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if ((uintptr_t)m->hdr + (intptr_t)m->table[2 * mid] <= pc) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo == 0 ? NULL : m->hdr + (intptr_t)m->table[2 * (lo - 1) + 1];
}

static uint64_t compile_rule(const frame_state *s, bool signal_frame) {
  if (signal_frame) return RULE_SIGNAL;
  if (s->ra.how == REG_UNDEFINED) return RULE_OUTERMOST;
  if (s->cfa_by_expression || s->rsp_rule || (s->cfa_reg != DW_REG_RSP && s->cfa_reg != DW_REG_RBP) ||
      s->cfa_offset < INT32_MIN || s->cfa_offset > INT32_MAX) {
    return RULE_UNSUPPORTED;
  }
  if (s->ra.how != REG_AT_CFA_OFFSET || s->ra.offset % 8 != 0 || s->ra.offset / 8 < INT8_MIN ||
      s->ra.offset / 8 > INT8_MAX) {
    return RULE_UNSUPPORTED;
  }
  uint64_t rule = RULE_FRAME | (s->cfa_reg == DW_REG_RBP ? 4u : 0u) |
                  (uint64_t)(uint8_t)(int8_t)(s->ra.offset / 8) << 8 |
                  (uint64_t)(uint32_t)(int32_t)s->cfa_offset << 32;
  if (s->rbp.how == REG_AT_CFA_OFFSET) {
    if (s->rbp.offset % 8 != 0 || s->rbp.offset / 8 < INT8_MIN || s->rbp.offset / 8 > INT8_MAX) {
      return RULE_UNSUPPORTED;
    }
    rule |= 8u | (uint64_t)(uint8_t)(int8_t)(s->rbp.offset / 8) << 16;
  } else if (s->rbp.how != REG_SAME) {
    return RULE_UNSUPPORTED;
  }
  return rule;
}

/* The rule at pc in module m, from its FDE. */
static uint64_t rule_from_fde(const cfi_module *m, uintptr_t pc) {
  if (m->hdr == NULL || m->fde_count == 0) return RULE_NO_INFO;
  const uint8_t *fde = find_fde(m, pc);
  if (fde == NULL) return RULE_NO_INFO;
  dw_reader r = {fde, fde + 8, true};
  const uint32_t length = (uint32_t)read_fixed(&r, 4);
  if (!r.ok || length == 0 || length == 0xffffffffu) return RULE_UNSUPPORTED;
  const uint8_t *const cie_pointer_at = r.p;
  const uint32_t cie_pointer = (uint32_t)read_fixed(&r, 4);
  cie_info cie;
  if (cie_pointer == 0 || !read_cie(cie_pointer_at - cie_pointer, &cie)) return RULE_UNSUPPORTED;
  r.end = fde + 4 + length;
  const uintptr_t begin = read_encoded(&r, cie.fde_encoding, 0, false);
  const uintptr_t range = read_encoded(&r, cie.fde_encoding, 0, true);
  if (!r.ok) return RULE_UNSUPPORTED;
  if (pc < begin || pc - begin >= range) return RULE_NO_INFO; /* between FDEs */
  if (cie.has_augmentation_data) skip(&r, read_uleb(&r));
  if (!r.ok || r.p > r.end) return RULE_UNSUPPORTED;
  frame_state initial = {.rbp = {REG_SAME, 0}, .ra = {REG_UNSET, 0}};
  if (!run_cfa_program(cie.instructions, cie.end, &cie, begin, UINTPTR_MAX, NULL, &initial)) {
    return RULE_UNSUPPORTED;
  }
  frame_state state = initial;
  if (!run_cfa_program(r.p, r.end, &cie, begin, pc, &initial, &state)) return RULE_UNSUPPORTED;
  return compile_rule(&state, cie.signal_frame);
}

/* ---- the rule cache ---- */

/* Direct-mapped and lock-free: an entry is two words, the rule and its key (pc and generation)
 * XOR a mix of the rule, each stored and loaded atomically on its own. A reader that sees the
 * halves of different writes finds that they do not match its key (the mix spreads any
 * difference of two rules over all 64 bits) and computes the rule itself. */
#define CACHE_SLOTS 8192
static struct {
  uint64_t check, rule;
} g_cache[CACHE_SLOTS];

static uint64_t cache_key(uintptr_t pc, uint64_t generation) { return pc ^ (generation << 48); }

static uint64_t mix(uint64_t rule) { return rule * 0xff51afd7ed558ccdu; }

/* After 2^16 generations a key could again match a rule cached that long ago: every entry is
 * emptied (a reader that sees an entry half emptied finds it does not match). */
static void clear_cache(void) {
  for (size_t i = 0; i < CACHE_SLOTS; i++) {
    __atomic_store_n(&g_cache[i].check, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&g_cache[i].rule, 0, __ATOMIC_RELAXED);
  }
}

static size_t cache_slot(uintptr_t pc) {
  return (size_t)((pc * 0x9e3779b97f4a7c15u) >> 51) & (CACHE_SLOTS - 1);
}

/* The rule at pc. may_lock_loader: a miss outside the modules loaded with the program may call
 * dl_iterate_phdr to check the module list (not from a signal handler, where the interrupted
 * code may be inside the loader). */
static uint64_t rule_at(uintptr_t pc, uint64_t generation, bool may_lock_loader) {
  const uint64_t key = cache_key(pc, generation);
  const size_t slot = cache_slot(pc);
  const uint64_t rule = __atomic_load_n(&g_cache[slot].rule, __ATOMIC_RELAXED);
  const uint64_t check = __atomic_load_n(&g_cache[slot].check, __ATOMIC_RELAXED);
  if ((check ^ mix(rule)) == key) return rule;
  cfi_module m;
  module_lookup found = find_module(pc, &m);
  /* Outside the modules loaded with the program, the list may be stale: glibc loads and unloads
   * modules without dlopen. The loader's counts say whether it is, under the loader's lock, and
   * the module is looked up again in the list they confirm. In a signal handler the loader
   * cannot be asked (the interrupted code may be inside it): the list is taken as it is, which
   * only a module glibc unloaded without dlclose, whose range code on this very stack now
   * occupies, could make stale. */
  if ((found != MODULE_FOUND || !m.resident) && may_lock_loader) {
    if (modules_moved() == MODULES_BEING_REREAD) return RULE_UNSUPPORTED; /* not cached */
    found = find_module(pc, &m);
  }
  if (found == MODULE_CHANGING) return RULE_UNSUPPORTED;
  const uint64_t computed = found == MODULE_FOUND ? rule_from_fde(&m, pc)
                                                  : RULE_NO_INFO; /* outside every module (JIT) */
  __atomic_store_n(&g_cache[slot].rule, computed, __ATOMIC_RELAXED);
  __atomic_store_n(&g_cache[slot].check, mix(computed) ^ key, __ATOMIC_RELAXED);
  /* A writer that read its generation before the list changed must not leave its entry for a
   * wrap of the generation to revive. */
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (__atomic_load_n(&g_cache_generation, __ATOMIC_RELAXED) != generation) {
    __atomic_store_n(&g_cache[slot].check, 0, __ATOMIC_RELAXED);
  }
  return computed;
}

/* ---- the walk ---- */

bool hd_cfi_thread_stack(uintptr_t *lo, uintptr_t *hi) {
  pthread_attr_t attr;
  void *addr;
  size_t size;
  bool found = false;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    if (pthread_attr_getstack(&attr, &addr, &size) == 0) {
      *lo = (uintptr_t)addr;
      *hi = (uintptr_t)addr + size;
      found = true;
    }
    pthread_attr_destroy(&attr);
  }
  return found;
}

bool hd_cfi_in_bounds(const hd_cfi_bounds *b, uintptr_t addr, uintptr_t size) {
  for (unsigned i = 0; i < b->count; i++) {
    if (addr >= b->lo[i] && b->hi[i] >= size && addr <= b->hi[i] - size) return true;
  }
  return false;
}

/* What a walk read (NULL record: nothing is kept); `fits` is cleared when it outgrows the
 * record.
 *
 * Not everything read decides the walk. Code built without frame pointers uses rbp as an
 * ordinary register, so the rbp a frame saved is often data that changes from call to call; it
 * matters only if a later frame's CFA is rbp-based before another saved rbp replaces it. The log
 * keeps which read gave the current rbp (bp_source, -1: the rbp the walk started with) and from
 * which frame on it is the current one (bp_since), and marks the read needed, and those frames
 * as using the rbp they started with, when a CFA uses it; return addresses are always needed.
 * Trails and memos keep only the needed reads, and compare a starting rbp only if it is used.
 *
 * last: the thread's trail, which the walk may join (NULL: none); last_pos is the frame of it
 * the walk's stack pointer has reached (from the innermost outwards; UINT_MAX once past its
 * outermost frame). Its reads are checked from
 * the outermost inwards, as far as a join needs: every one before last_checked_to holds, and
 * last_changed is the first found changed (UINT_MAX: none yet). */
typedef struct walk_log {
  hd_cfi_walk_record *record;
  bool fits;
  int bp_source;
  unsigned bp_since;
  hd_cfi_trail *last;
  unsigned last_pos, last_checked_to, last_changed;
  bool joined, joined_trail; /* joined_trail: the trail is now this walk's */
  bool by_frame_pointer;      /* a frame without call-frame information was stepped by rbp */
} walk_log;

static void set_bit(uint64_t *words, unsigned i) { words[i / 64] |= (uint64_t)1 << (i % 64); }
static bool bit_set(const uint64_t *words, unsigned i) { return (words[i / 64] >> (i % 64)) & 1; }
/* Clears bits [from, 128) of a two-word set. */
static void clear_bits_from(uint64_t *words, unsigned from) {
  if (from < 64) {
    words[0] &= ((uint64_t)1 << from) - 1;
    words[1] = 0;
  } else if (from < 128) {
    words[1] &= ((uint64_t)1 << (from - 64)) - 1;
  }
}

/* A saved register at addr, which must lie in the stack no lower than `floor`; frame: the frame
 * reading it; gives_bp: it is the next frame's rbp. */
static bool read_saved(const hd_cfi_bounds *b, uintptr_t addr, uintptr_t floor, uintptr_t *out,
                       unsigned frame, bool gives_bp, walk_log *log) {
  if (addr < floor || !hd_cfi_in_bounds(b, addr, sizeof *out)) return false;
  memcpy(out, (const void *)addr, sizeof *out); /* a CFA from a bad rbp need not be aligned */
  if (!log->fits) return true;
  hd_cfi_walk_record *r = log->record;
  if (r->read_count == HD_CFI_TRAIL_READS) {
    log->fits = false;
    return true;
  }
  const unsigned k = r->read_count++;
  r->slot[k] = addr;
  r->value[k] = *out;
  if (gives_bp) {
    log->bp_source = (int)k;
    log->bp_since = frame + 1;
  } else {
    set_bit(r->needed, k);
  }
  return true;
}

/* Frame `frame` (or, when it is the frame a walk joins, the frames of the trail from there on)
 * uses the current rbp. */
static void bp_used(walk_log *log, unsigned frame) {
  if (!log->fits) return;
  if (log->bp_source >= 0) set_bit(log->record->needed, (unsigned)log->bp_source);
  for (unsigned i = log->bp_since; i <= frame; i++) set_bit(log->record->bp_needed, i);
}

/* Where frame n of the walk stands (its pc is in the walk's frames). */
static void log_frame(walk_log *log, unsigned n, uintptr_t sp, uintptr_t bp, bool after_call) {
  if (!log->fits) return;
  hd_cfi_walk_record *r = log->record;
  r->sp[n] = sp;
  r->bp[n] = bp;
  r->first_read[n] = (uint8_t)r->read_count;
  if (after_call) set_bit(r->after_call, n);
}

/* Makes the walk's frames [0, n) (program counters in `frames`, the rest in record r), innermost
 * first, frames [at, at + n) of trail t, innermost last, with their needed reads. */
static void trail_put_record(hd_cfi_trail *t, unsigned at, const uint64_t *frames,
                             const hd_cfi_walk_record *r, unsigned n) {
  clear_bits_from(t->after_call, at);
  clear_bits_from(t->bp_needed, at);
  unsigned reads = at == 0 ? 0 : t->first_read[at];
  for (unsigned j = 0; j < n; j++) {
    const unsigned k = n - 1 - j, q = at + j;
    t->pc[q] = frames[k];
    t->sp[q] = r->sp[k];
    t->bp[q] = r->bp[k];
    if (bit_set(r->after_call, k)) set_bit(t->after_call, q);
    if (bit_set(r->bp_needed, k)) set_bit(t->bp_needed, q);
    t->first_read[q] = (uint8_t)reads;
    const unsigned read_end = k + 1 < n ? r->first_read[k + 1] : r->read_count;
    for (unsigned i = r->first_read[k]; i < read_end; i++) {
      if (!bit_set(r->needed, i)) continue;
      t->slot[reads] = r->slot[i];
      t->value[reads++] = r->value[i];
    }
  }
  t->first_read[at + n] = (uint8_t)reads;
  t->frame_count = at + n;
  t->read_count = reads;
}

/* Whether the walk, at its frame n (pc, sp, bp, after_call), can join the thread's trail; if so,
 * frames[n..*count) are the trail's frames from there outwards (up to capacity), *end is how it
 * ends, and the trail becomes this walk's (unless the record is full or the walk is cut by the
 * capacity: the trail then stays the earlier walk's, as valid to join as before). */
static bool join_last(walk_log *log, unsigned n, uintptr_t pc, uintptr_t sp, uintptr_t bp,
                      bool after_call, uint64_t *frames, unsigned capacity, unsigned *count,
                      hd_cfi_end *end) {
  hd_cfi_trail *last = log->last;
  unsigned q = log->last_pos;
  while (q != UINT_MAX && last->sp[q] < sp) q--;
  log->last_pos = q;
  if (q == UINT_MAX || last->sp[q] != sp || last->pc[q] != pc ||
      bit_set(last->after_call, q) != after_call ||
      (bit_set(last->bp_needed, q) && last->bp[q] != bp)) {
    return false;
  }
  /* Frames q outwards read [0, first_read[q + 1]). The frames a walk meets only go outwards, so
   * a read is checked at most once per walk. */
  const unsigned reads_end = last->first_read[q + 1];
  if (reads_end > log->last_changed) return false;
  for (unsigned k = log->last_checked_to; k < reads_end; k++) {
    uintptr_t now;
    memcpy(&now, (const void *)last->slot[k], sizeof now);
    if (now != last->value[k]) {
      log->last_changed = k;
      return false;
    }
  }
  if (reads_end > log->last_checked_to) log->last_checked_to = reads_end;
  const unsigned total = n + q + 1;
  /* A trail cut by its capacity does not say what lies past its end. */
  if (last->end == HD_CFI_FULL && total < capacity) return false;
  const unsigned kept = (total < capacity ? total : capacity) - n;
  for (unsigned i = 0; i < kept; i++) frames[n + i] = last->pc[q - i];
  *count = n + kept;
  *end = total > capacity ? HD_CFI_FULL : (hd_cfi_end)last->end;
  log->joined = true;
  if (!log->fits || total > capacity) return true;
  /* The frames joined use the rbp this walk brings them. */
  if (n > 0 && bit_set(last->bp_needed, q)) bp_used(log, n - 1);
  trail_put_record(last, q + 1, frames, log->record, n);
  log->joined_trail = true;
  return true;
}

/* Whether memo m still describes a walk starting at sp and bp: every slot it read holds the
 * value it read. The slots were in this thread's stack, which stays mapped while it runs. */
static bool memo_holds(const hd_cfi_memo *m, uintptr_t pc, uintptr_t sp, uintptr_t bp,
                       uint64_t generation) {
  if (m->frame_count == 0 || m->pc != pc || m->sp != sp || (m->bp_matters && m->bp != bp) ||
      m->generation != generation) {
    return false;
  }
  uintptr_t differs = 0;
  for (unsigned i = 0; i < m->read_count; i++) {
    uintptr_t now;
    memcpy(&now, (const void *)m->slot[i], sizeof now);
    differs |= now ^ m->value[i];
  }
  return differs == 0;
}

/* Below its stack pointer a function may keep data in the 128-byte red zone (psABI 3.2.2), and
 * after `leave` its CFI still places the caller's rbp in the slot just popped: a frame's saved
 * registers lie no lower than rsp - RED_ZONE. */
#define RED_ZONE 128

/* The kernel's signal frame on x86-64: the handler returns to the restorer with rsp at the
 * ucontext_t, whose gregs (at offset 40) hold the interrupted registers. */
enum { UC_GREGS = 40, GREG_RBP = 10, GREG_RSP = 15, GREG_RIP = 16 };

/* The walk itself, from the frame that returns to pc with sp and bp; logs what it reads. */
static hd_cfi_end walk(const hd_cfi_bounds *bounds, uintptr_t pc, uintptr_t sp, uintptr_t bp,
                       uint64_t generation, bool may_lock_loader, uint64_t *frames,
                       unsigned capacity, unsigned *count, walk_log *log) {
  bool after_call = true; /* pc is a return address: its call is the instruction before it */
  unsigned n = 0;
  hd_cfi_end end = HD_CFI_UNSUPPORTED;
  for (;;) {
    if (n == capacity) {
      end = HD_CFI_FULL;
      break;
    }
    if (log->last != NULL && join_last(log, n, pc, sp, bp, after_call, frames, capacity, count, &end)) {
      return end;
    }
    log_frame(log, n, sp, bp, after_call);
    const unsigned frame = n;
    frames[n++] = pc;
    const uint64_t rule = rule_at(after_call ? pc - 1 : pc, generation, may_lock_loader);
    if (RULE_KIND(rule) == RULE_OUTERMOST) {
      end = HD_CFI_COMPLETE;
      break;
    }
    if (rule == RULE_NO_INFO) {
      /* Code without call-frame information: a frame-pointer frame if rbp points at a (saved
       * rbp, return address) pair above rsp, as libunwind steps it. Such a walk is neither
       * remembered nor made the trail: rbp may hold anything in code without frame pointers. */
      log->fits = false;
      log->by_frame_pointer = true;
      uintptr_t ra, saved_bp;
      if (bp % 8 != 0 || !read_saved(bounds, bp + 8, sp, &ra, frame, false, log) ||
          !read_saved(bounds, bp, sp, &saved_bp, frame, true, log)) {
        break;
      }
      sp = bp + 16;
      pc = ra;
      bp = saved_bp;
      after_call = true;
    } else if (RULE_KIND(rule) == RULE_UNSUPPORTED) {
      break;
    } else if (RULE_KIND(rule) == RULE_SIGNAL) {
      const uintptr_t gregs = sp + UC_GREGS;
      if (!read_saved(bounds, gregs + 8 * GREG_RIP, sp, &pc, frame, false, log) ||
          !read_saved(bounds, gregs + 8 * GREG_RSP, sp, &sp, frame, false, log) ||
          !read_saved(bounds, gregs + 8 * GREG_RBP, gregs, &bp, frame, true, log)) {
        break;
      }
      after_call = false; /* the interrupted instruction itself */
    } else {
      if (RULE_CFA_RBP(rule)) bp_used(log, frame);
      const uintptr_t cfa = (RULE_CFA_RBP(rule) ? bp : sp) + (intptr_t)RULE_CFA_OFFSET(rule);
      if (cfa <= sp) break; /* each caller's frame is above its callee's */
      uintptr_t ra;
      if (!read_saved(bounds, cfa + 8 * (intptr_t)RULE_RA_WORDS(rule), sp - RED_ZONE, &ra, frame,
                      false, log)) {
        break;
      }
      if (RULE_RBP_SAVED(rule) && !read_saved(bounds, cfa + 8 * (intptr_t)RULE_RBP_WORDS(rule),
                                              sp - RED_ZONE, &bp, frame, true, log)) {
        break;
      }
      sp = cfa;
      pc = ra;
      after_call = true;
    }
    if (pc == 0) {
      end = HD_CFI_COMPLETE;
      break;
    }
  }
  *count = n;
  return end;
}

/* Keeps the walk trail t describes (its frames given innermost first) as memo m. False if it
 * does not fit one. */
static bool memoize_trail(hd_cfi_memo *m, const hd_cfi_trail *t, const uint64_t *frames,
                          uintptr_t pc, uintptr_t sp, uintptr_t bp) {
  if (t->frame_count > HD_CFI_MEMO_FRAMES || t->read_count > HD_CFI_MEMO_READS) return false;
  memcpy(m->slot, t->slot, t->read_count * sizeof *m->slot);
  memcpy(m->value, t->value, t->read_count * sizeof *m->value);
  m->read_count = t->read_count;
  m->pc = pc;
  m->sp = sp;
  m->bp = bp;
  m->bp_matters = bit_set(t->bp_needed, t->frame_count - 1);
  m->generation = t->generation;
  m->end = t->end;
  memcpy(m->frames, frames, t->frame_count * sizeof *frames);
  m->frame_count = t->frame_count;
  m->stack_key = 0;
  return true;
}

hd_cfi_end hd_cfi_backtrace(const hd_cfi_bounds *bounds, uintptr_t pc, uintptr_t sp, uintptr_t bp,
                            bool may_lock_loader, uint64_t *frames, unsigned capacity,
                            unsigned *count, hd_cfi_memos *memos, bool *reused, bool *joined,
                            bool *by_frame_pointer, uint32_t **stack_key) {
  const uint64_t generation = __atomic_load_n(&g_cache_generation, __ATOMIC_ACQUIRE);
  *reused = false;
  *joined = false;
  *by_frame_pointer = false;
  *stack_key = NULL;
  /* A walk on an alternate signal stack is not remembered: its bounds come and go. */
  const bool memoize = memos != NULL && bounds->count == 1;
  for (unsigned i = 0; memoize && i < HD_CFI_MEMOS; i++) {
    const hd_cfi_memo *m = &memos->entry[i];
    /* A walk cut by its capacity is the walk of another capacity only if they are equal. */
    const bool fits = m->end == HD_CFI_FULL ? m->frame_count == capacity
                                           : m->frame_count <= capacity;
    if (fits && memo_holds(m, pc, sp, bp, generation)) {
      memcpy(frames, m->frames, m->frame_count * sizeof *frames);
      *count = m->frame_count;
      *reused = true;
      *stack_key = &memos->entry[i].stack_key;
      return (hd_cfi_end)m->end;
    }
  }
  walk_log log = {.bp_source = -1, .last_changed = UINT_MAX};
  hd_cfi_trail *t = NULL;
  if (memoize && capacity <= HD_CFI_TRAIL_FRAMES) {
    t = &memos->trail;
    hd_cfi_walk_record *r = &memos->record;
    r->read_count = 0;
    memset(r->after_call, 0, sizeof r->after_call);
    memset(r->bp_needed, 0, sizeof r->bp_needed);
    memset(r->needed, 0, sizeof r->needed);
    log.record = r;
    log.fits = true;
    if (t->frame_count != 0 && t->generation == generation) {
      log.last = t;
      log.last_pos = t->frame_count - 1;
    }
  }
  const hd_cfi_end end =
      walk(bounds, pc, sp, bp, generation, may_lock_loader, frames, capacity, count, &log);
  *joined = log.joined;
  *by_frame_pointer = log.by_frame_pointer;
  if (t == NULL || end == HD_CFI_UNSUPPORTED) return end;
  if (log.joined) {
    if (!log.joined_trail) return end;
  } else {
    if (!log.fits) return end;
    trail_put_record(t, 0, frames, log.record, *count);
    t->end = end;
    t->generation = generation;
  }
  hd_cfi_memo *m = &memos->entry[memos->next];
  if (memoize_trail(m, t, frames, pc, sp, bp)) {
    *stack_key = &m->stack_key;
    memos->next = (memos->next + 1) % HD_CFI_MEMOS;
  }
  return end;
}
