/* The rule compiler: DWARF call-frame information of one program counter, run once and compiled
 * into a 64-bit rule (cfi_rules.h). Every read is bounded by the module's range: a corrupt or
 * hostile .eh_frame gives RULE_UNSUPPORTED, never a read outside it. */
#include "cfi_rules.h"

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
      /* Sign extension in unsigned arithmetic: 1 << 63 does not fit an int64_t. */
      if (shift + 7 < 64 && (byte & 0x40))
        v = (int64_t)((uint64_t)v | (~UINT64_C(0) << (shift + 7)));
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

/* ---- the search table ---- */

static bool in_range(const hd_cfi_tables *t, const void *p, uint64_t size) {
  const uintptr_t at = (uintptr_t)p;
  return at >= t->lo && at <= t->hi && size <= t->hi - at;
}

bool hd_cfi_read_eh_frame_hdr(const uint8_t *hdr, uintptr_t lo, uintptr_t hi, hd_cfi_tables *out) {
  *out = (hd_cfi_tables){.lo = lo, .hi = hi};
  if (!in_range(out, hdr, 4) || hdr[0] != 1 || hdr[3] != (DW_EH_PE_datarel | DW_EH_PE_sdata4) ||
      hdr[1] == DW_EH_PE_omit || hdr[2] == DW_EH_PE_omit) {
    return false;
  }
  dw_reader r = {hdr + 4, (const uint8_t *)hi, true};
  const uintptr_t eh_frame = read_encoded(&r, hdr[1], (uintptr_t)hdr, false);
  const uintptr_t count = read_encoded(&r, hdr[2], (uintptr_t)hdr, false);
  /* The table's entries are 8 bytes each; the .eh_frame they point into follows in the range. */
  /* Linkers align the table (4-byte header fields after a 4-aligned section); one that is not
   * aligned is not a linker's, and reading it would be a misaligned load. */
  if (!r.ok || !in_range(out, (const void *)eh_frame, 4) || ((uintptr_t)r.p & 3) != 0 ||
      count > (hi - (uintptr_t)r.p) / 8) {
    return false;
  }
  out->hdr = hdr;
  out->table = (const int32_t *)r.p;
  out->fde_count = count;
  return true;
}

/* The FDE whose range may hold pc: the last table entry starting at or before it. */
static const uint8_t *find_fde(const hd_cfi_tables *t, uintptr_t pc) {
  size_t lo = 0, hi = t->fde_count;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if ((uintptr_t)t->hdr + (intptr_t)t->table[2 * mid] <= pc) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo == 0 ? NULL : t->hdr + (intptr_t)t->table[2 * (lo - 1) + 1];
}

/* ---- compiling a frame's rule ---- */

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

/* The CIE at cie, which must lie in the tables' range. */
static bool read_cie(const hd_cfi_tables *t, const uint8_t *cie, cie_info *out) {
  if (!in_range(t, cie, 4)) return false;
  dw_reader r = {cie, cie + 4, true};
  const uint32_t length = (uint32_t)read_fixed(&r, 4);
  if (!r.ok || length == 0 || length == 0xffffffffu || !in_range(t, cie + 4, length)) {
    return false;
  }
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

/* A program of call-frame instructions being run. */
typedef struct cfa_run {
  dw_reader r;
  const cie_info *cie;
  const frame_state *initial; /* for DW_CFA_restore; NULL while the CIE's own instructions run */
  uintptr_t location, pc;
  frame_state remembered[REMEMBER_DEPTH];
  unsigned depth;
} cfa_run;

/* What an instruction group made of one instruction. */
typedef enum { INSN_DONE, INSN_NOT_MINE, INSN_BAD } insn_result;

/* The instructions that move the location, and those with no effect on our rules. */
static insn_result location_instruction(cfa_run *run, uint8_t op) {
  dw_reader *r = &run->r;
  const uint64_t align = run->cie->code_align;
  switch (op) {
    case 0x00: return INSN_DONE; /* nop */
    case 0x01: run->location = read_encoded(r, run->cie->fde_encoding, 0, false); return INSN_DONE;
    case 0x02: run->location += read_fixed(r, 1) * align; return INSN_DONE;
    case 0x03: run->location += read_fixed(r, 2) * align; return INSN_DONE;
    case 0x04: run->location += read_fixed(r, 4) * align; return INSN_DONE;
    case 0x2e: (void)read_uleb(r); return INSN_DONE; /* GNU_args_size */
  }
  return INSN_NOT_MINE;
}

/* The instructions that define the CFA. */
static insn_result cfa_instruction(cfa_run *run, uint8_t op, frame_state *s) {
  dw_reader *r = &run->r;
  const int64_t align = run->cie->data_align;
  switch (op) {
    case 0x0c: /* def_cfa */
      s->cfa_reg = read_uleb(r);
      s->cfa_offset = (int64_t)read_uleb(r);
      s->cfa_by_expression = false;
      return INSN_DONE;
    case 0x0d: /* def_cfa_register */
      s->cfa_reg = read_uleb(r);
      s->cfa_by_expression = false;
      return INSN_DONE;
    case 0x0e: s->cfa_offset = (int64_t)read_uleb(r); return INSN_DONE; /* def_cfa_offset */
    case 0x0f: {                                                        /* def_cfa_expression */
      const uint64_t length = read_uleb(r);
      s->cfa_by_expression = !plt_cfa(r->p, length, r->end, run->pc, s);
      skip(r, length);
      return INSN_DONE;
    }
    case 0x12: /* def_cfa_sf */
      s->cfa_reg = read_uleb(r);
      s->cfa_offset = factored((uint64_t)read_sleb(r), align);
      s->cfa_by_expression = false;
      return INSN_DONE;
    case 0x13: s->cfa_offset = factored((uint64_t)read_sleb(r), align); return INSN_DONE;
  }
  return INSN_NOT_MINE;
}

/* The instructions that say how a register is recovered. */
static insn_result register_instruction(cfa_run *run, uint8_t op, frame_state *s) {
  dw_reader *r = &run->r;
  const int64_t align = run->cie->data_align;
  if (!((op >= 0x05 && op <= 0x09) || op == 0x10 || op == 0x11 || (op >= 0x14 && op <= 0x16) ||
        op == 0x2f)) {
    return INSN_NOT_MINE;
  }
  const uint64_t reg = read_uleb(r); /* each of them names its register first */
  switch (op) {
    case 0x05: /* offset_extended */
      set_reg(s, reg, REG_AT_CFA_OFFSET, factored(read_uleb(r), align));
      return INSN_DONE;
    case 0x06: /* restore_extended */
      if (run->initial != NULL) restore_reg(s, run->initial, reg);
      return INSN_DONE;
    case 0x07: set_reg(s, reg, REG_UNDEFINED, 0); return INSN_DONE;
    case 0x08: set_reg(s, reg, REG_SAME, 0); return INSN_DONE;
    case 0x09: /* register */
    case 0x14: /* val_offset */
    case 0x15: /* val_offset_sf */
      (void)read_uleb(r);
      set_reg(s, reg, REG_OTHER, 0);
      return INSN_DONE;
    case 0x10: /* expression */
    case 0x16: /* val_expression */
      set_reg(s, reg, REG_OTHER, 0);
      skip(r, read_uleb(r));
      return INSN_DONE;
    case 0x11: /* offset_extended_sf */
      set_reg(s, reg, REG_AT_CFA_OFFSET, factored((uint64_t)read_sleb(r), align));
      return INSN_DONE;
    case 0x2f: /* GNU_negative_offset_extended */
      set_reg(s, reg, REG_AT_CFA_OFFSET, factored(0 - read_uleb(r), align));
      return INSN_DONE;
  }
  return INSN_NOT_MINE;
}

/* remember_state and restore_state. */
static insn_result state_instruction(cfa_run *run, uint8_t op, frame_state *s) {
  if (op == 0x0a) {
    if (run->depth == REMEMBER_DEPTH) return INSN_BAD;
    run->remembered[run->depth++] = *s;
    return INSN_DONE;
  }
  if (op == 0x0b) {
    if (run->depth == 0) return INSN_BAD;
    *s = run->remembered[--run->depth];
    return INSN_DONE;
  }
  return INSN_NOT_MINE;
}

/* Runs call-frame instructions from `code` to `end` on *s until the location passes pc.
 * `initial`: the state after the CIE's instructions (DW_CFA_restore), NULL while running them. */
static bool run_cfa_program(const uint8_t *code, const uint8_t *end, const cie_info *cie,
                            uintptr_t location, uintptr_t pc, const frame_state *initial,
                            frame_state *s) {
  cfa_run run = {
      .r = {code, end, true}, .cie = cie, .initial = initial, .location = location, .pc = pc};
  dw_reader *r = &run.r;
  while (r->ok && r->p < r->end && run.location <= pc) {
    const uint8_t op = (uint8_t)read_fixed(r, 1);
    const uint8_t low = op & 0x3f;
    if (op >> 6 == 1) { /* advance_loc */
      run.location += low * cie->code_align;
    } else if (op >> 6 == 2) { /* offset */
      set_reg(s, low, REG_AT_CFA_OFFSET, factored(read_uleb(r), cie->data_align));
    } else if (op >> 6 == 3) { /* restore */
      if (initial != NULL) restore_reg(s, initial, low);
    } else {
      insn_result done = location_instruction(&run, op);
      if (done == INSN_NOT_MINE) done = cfa_instruction(&run, op, s);
      if (done == INSN_NOT_MINE) done = state_instruction(&run, op, s);
      if (done == INSN_NOT_MINE) done = register_instruction(&run, op, s);
      if (done != INSN_DONE) return false; /* a bad one, or one we do not know */
    }
  }
  return r->ok;
}

static uint64_t compile_rule(const frame_state *s, bool signal_frame) {
  if (signal_frame) return RULE_SIGNAL;
  if (s->ra.how == REG_UNDEFINED) return RULE_OUTERMOST;
  if (s->cfa_by_expression || s->rsp_rule ||
      (s->cfa_reg != DW_REG_RSP && s->cfa_reg != DW_REG_RBP) || s->cfa_offset < INT32_MIN ||
      s->cfa_offset > INT32_MAX) {
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

static uint32_t load32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, 4); /* little-endian */
  return v;
}

/* Whether cie_at holds a CIE: its length field, a length that fits the range, and id 0. */
static bool cie_frame_ok(const hd_cfi_tables *t, const uint8_t *cie_at) {
  if (!in_range(t, cie_at, 8)) return false;
  const uint32_t cie_length = load32(cie_at);
  return cie_length >= 4 && cie_length != 0xffffffffu && in_range(t, cie_at + 4, cie_length) &&
         load32(cie_at + 4) == 0;
}

/* Runs at every module's first reading, over every FDE of it (64,000 for cc1plus and its
 * libraries), so what holds for a run of FDEs is checked once per run: a CIE shared by the run's
 * FDEs once, and the pointer encoding linkers write (pc-relative, 4 bytes) read directly. */
bool hd_cfi_check_tables(const hd_cfi_tables *t) {
  if (t->hdr == NULL) return true; /* no tables: nothing to be wrong */
  const uint8_t *cie_read = NULL;  /* the CIE in `cie` */
  cie_info cie = {0};
  bool cie_ok = false;
  uintptr_t previous = 0;
  for (uintptr_t i = 0; i < t->fde_count; i++) {
    const uintptr_t location = (uintptr_t)t->hdr + (intptr_t)t->table[2 * i];
    const uint8_t *fde = t->hdr + (intptr_t)t->table[2 * i + 1];
    if ((i > 0 && location < previous) || !in_range(t, fde, 8)) return false;
    previous = location;
    const uint32_t length = load32(fde);
    if (length < 8 || length == 0xffffffffu || !in_range(t, fde + 4, length)) return false;
    const uint8_t *const cie_pointer_at = fde + 4;
    const uint32_t cie_pointer = load32(cie_pointer_at);
    if (cie_pointer == 0 || cie_pointer > (uintptr_t)cie_pointer_at - t->lo) return false;
    const uint8_t *cie_at = cie_pointer_at - cie_pointer;
    /* FDEs share a few CIEs, one after another: each is checked and read once per run of its
     * FDEs. A CIE our rules do not support (another return-address column, an unknown
     * augmentation) is well formed all the same; its FDEs' first addresses are not compared. */
    if (cie_at != cie_read) {
      if (!cie_frame_ok(t, cie_at)) return false;
      cie_ok = read_cie(t, cie_at, &cie);
      cie_read = cie_at;
    }
    if (!cie_ok) continue;
    uintptr_t begin;
    if (cie.fde_encoding == (DW_EH_PE_pcrel | DW_EH_PE_sdata4)) {
      /* length >= 8: the 4 bytes after the CIE pointer are inside the FDE. */
      begin = (uintptr_t)(fde + 8) + (uintptr_t)(intptr_t)(int32_t)load32(fde + 8);
    } else {
      dw_reader r = {fde + 8, fde + 4 + length, true};
      begin = read_encoded(&r, cie.fde_encoding, 0, false);
      if (!r.ok) return false;
    }
    if (begin != location) return false; /* the table and the FDE disagree */
  }
  return true;
}

uint64_t hd_cfi_rule(const hd_cfi_tables *t, uintptr_t pc) {
  if (t->hdr == NULL || t->fde_count == 0) return RULE_NO_INFO;
  const uint8_t *fde = find_fde(t, pc);
  if (fde == NULL) return RULE_NO_INFO;
  if (!in_range(t, fde, 8)) return RULE_UNSUPPORTED;
  dw_reader r = {fde, fde + 8, true};
  const uint32_t length = (uint32_t)read_fixed(&r, 4);
  if (length == 0 || length == 0xffffffffu || length < 4 || !in_range(t, fde + 4, length)) {
    return RULE_UNSUPPORTED;
  }
  const uint8_t *const cie_pointer_at = r.p;
  const uint32_t cie_pointer = (uint32_t)read_fixed(&r, 4);
  cie_info cie;
  if (cie_pointer == 0 || cie_pointer > (uintptr_t)cie_pointer_at - t->lo ||
      !read_cie(t, cie_pointer_at - cie_pointer, &cie)) {
    return RULE_UNSUPPORTED;
  }
  r.end = fde + 4 + length;
  const uintptr_t begin = read_encoded(&r, cie.fde_encoding, 0, false);
  const uintptr_t range = read_encoded(&r, cie.fde_encoding, 0, true);
  if (!r.ok) return RULE_UNSUPPORTED;
  if (pc < begin || pc - begin >= range) return RULE_NO_INFO; /* between FDEs */
  if (cie.has_augmentation_data) skip(&r, read_uleb(&r));
  if (!r.ok) return RULE_UNSUPPORTED;
  frame_state initial = {.rbp = {REG_SAME, 0}, .ra = {REG_UNSET, 0}};
  if (!run_cfa_program(cie.instructions, cie.end, &cie, begin, UINTPTR_MAX, NULL, &initial)) {
    return RULE_UNSUPPORTED;
  }
  frame_state state = initial;
  if (!run_cfa_program(r.p, r.end, &cie, begin, pc, &initial, &state)) return RULE_UNSUPPORTED;
  return compile_rule(&state, cie.signal_frame);
}
