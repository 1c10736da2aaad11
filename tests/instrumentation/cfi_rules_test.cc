// The unwinder's rule compiler (instrumentation/src/cfi_rules.c) on its own: .eh_frame_hdr and
// .eh_frame images built here byte by byte, one per shape of CIE and FDE, each call-frame
// instruction and rule kind, and malformed input; then every FDE of real modules (this test,
// libc, libstdc++) at its function's entry.
#include <link.h>
#include <string.h>

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

extern "C" {
#include "cfi_rules.h"
}

namespace {

using Bytes = std::vector<uint8_t>;

void Uleb(Bytes *out, uint64_t v) {
  do {
    uint8_t byte = v & 0x7f;
    v >>= 7;
    out->push_back(byte | (v ? 0x80 : 0));
  } while (v);
}

void Sleb(Bytes *out, int64_t v) {
  bool more = true;
  while (more) {
    uint8_t byte = v & 0x7f;
    v >>= 7;  // arithmetic
    more = !((v == 0 && !(byte & 0x40)) || (v == -1 && (byte & 0x40)));
    out->push_back(byte | (more ? 0x80 : 0));
  }
}

void Fixed(Bytes *out, uint64_t v, size_t size) {
  for (size_t i = 0; i < size; i++) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// Call-frame instructions, as a compiler writes them.
struct Cfa {
  Bytes b;
  Cfa &AdvanceLoc(uint8_t delta) { return Op(0x40 | delta); }
  Cfa &Offset(uint8_t reg, uint64_t factored) {
    Op(0x80 | reg);
    Uleb(&b, factored);
    return *this;
  }
  Cfa &Restore(uint8_t reg) { return Op(0xc0 | reg); }
  Cfa &Nop() { return Op(0x00); }
  Cfa &SetLoc(uint64_t address) {
    Op(0x01);
    Fixed(&b, address, 8);
    return *this;
  }
  Cfa &AdvanceLoc1(uint8_t d) {
    Op(0x02);
    Fixed(&b, d, 1);
    return *this;
  }
  Cfa &AdvanceLoc2(uint16_t d) {
    Op(0x03);
    Fixed(&b, d, 2);
    return *this;
  }
  Cfa &AdvanceLoc4(uint32_t d) {
    Op(0x04);
    Fixed(&b, d, 4);
    return *this;
  }
  Cfa &OffsetExtended(uint64_t reg, uint64_t f) {
    Op(0x05);
    Uleb(&b, reg);
    Uleb(&b, f);
    return *this;
  }
  Cfa &RestoreExtended(uint64_t reg) {
    Op(0x06);
    Uleb(&b, reg);
    return *this;
  }
  Cfa &Undefined(uint64_t reg) {
    Op(0x07);
    Uleb(&b, reg);
    return *this;
  }
  Cfa &SameValue(uint64_t reg) {
    Op(0x08);
    Uleb(&b, reg);
    return *this;
  }
  Cfa &Register(uint64_t reg, uint64_t other) {
    Op(0x09);
    Uleb(&b, reg);
    Uleb(&b, other);
    return *this;
  }
  Cfa &RememberState() { return Op(0x0a); }
  Cfa &RestoreState() { return Op(0x0b); }
  Cfa &DefCfa(uint64_t reg, uint64_t off) {
    Op(0x0c);
    Uleb(&b, reg);
    Uleb(&b, off);
    return *this;
  }
  Cfa &DefCfaRegister(uint64_t reg) {
    Op(0x0d);
    Uleb(&b, reg);
    return *this;
  }
  Cfa &DefCfaOffset(uint64_t off) {
    Op(0x0e);
    Uleb(&b, off);
    return *this;
  }
  Cfa &DefCfaExpression(const Bytes &e) {
    Op(0x0f);
    Uleb(&b, e.size());
    return Raw(e);
  }
  Cfa &Expression(uint64_t reg, const Bytes &e) {
    Op(0x10);
    Uleb(&b, reg);
    Uleb(&b, e.size());
    return Raw(e);
  }
  Cfa &OffsetExtendedSf(uint64_t reg, int64_t f) {
    Op(0x11);
    Uleb(&b, reg);
    Sleb(&b, f);
    return *this;
  }
  Cfa &DefCfaSf(uint64_t reg, int64_t f) {
    Op(0x12);
    Uleb(&b, reg);
    Sleb(&b, f);
    return *this;
  }
  Cfa &DefCfaOffsetSf(int64_t f) {
    Op(0x13);
    Sleb(&b, f);
    return *this;
  }
  Cfa &ValOffset(uint64_t reg, uint64_t f) {
    Op(0x14);
    Uleb(&b, reg);
    Uleb(&b, f);
    return *this;
  }
  Cfa &ValOffsetSf(uint64_t reg, int64_t f) {
    Op(0x15);
    Uleb(&b, reg);
    Sleb(&b, f);
    return *this;
  }
  Cfa &ValExpression(uint64_t reg, const Bytes &e) {
    Op(0x16);
    Uleb(&b, reg);
    Uleb(&b, e.size());
    return Raw(e);
  }
  Cfa &ArgsSize(uint64_t size) {
    Op(0x2e);
    Uleb(&b, size);
    return *this;
  }
  Cfa &NegativeOffsetExtended(uint64_t reg, uint64_t f) {
    Op(0x2f);
    Uleb(&b, reg);
    Uleb(&b, f);
    return *this;
  }
  Cfa &Op(uint8_t op) {
    b.push_back(op);
    return *this;
  }
  Cfa &Raw(const Bytes &more) {
    b.insert(b.end(), more.begin(), more.end());
    return *this;
  }
};

enum { RBP = 6, RSP = 7, RA = 16 };

struct Cie {
  std::string augmentation = "zR";
  uint8_t version = 1;
  uint64_t code_align = 1;
  int64_t data_align = -8;
  uint64_t ra_register = RA;
  Bytes augmentation_data = {0x1b};  // R: pcrel sdata4
  Bytes instructions = Cfa().DefCfa(RSP, 8).Offset(RA, 1).b;
  int64_t length_adjust = 0;  // malformed: added to the length field
};

struct Fde {
  uint64_t start = 0, range = 64;  // code offsets
  Bytes instructions;
  bool augmentation_data = true;  // the CIE's 'z': a length (0) before the instructions
  int64_t length_adjust = 0;
  uint32_t length = 0;  // malformed: this length field instead
  int64_t cie_pointer_adjust = 0;
};

// An .eh_frame_hdr with its search table, then .eh_frame with one CIE and its FDEs, in one
// buffer whose end is the end of the range the compiler may read; "code" addresses are those
// of a second buffer (they are only numbers to it).
class Image {
 public:
  Image(const Cie &cie, const std::vector<Fde> &fdes, uint8_t encoding = 0x1b) {
    Bytes eh;
    const size_t eh_at = 12 + 8 * fdes.size();
    // The CIE.
    Bytes c;
    Fixed(&c, 0, 4);  // id
    c.push_back(cie.version);
    c.insert(c.end(), cie.augmentation.begin(), cie.augmentation.end());
    c.push_back(0);
    Uleb(&c, cie.code_align);
    Sleb(&c, cie.data_align);
    if (cie.version == 1)
      c.push_back(static_cast<uint8_t>(cie.ra_register));
    else
      Uleb(&c, cie.ra_register);
    if (!cie.augmentation.empty() && cie.augmentation[0] == 'z') {
      Uleb(&c, cie.augmentation_data.size());
      c.insert(c.end(), cie.augmentation_data.begin(), cie.augmentation_data.end());
    }
    c.insert(c.end(), cie.instructions.begin(), cie.instructions.end());
    while (c.size() % 8 != 4) c.push_back(0);  // DW_CFA_nop padding
    Fixed(&eh, c.size() + cie.length_adjust, 4);
    eh.insert(eh.end(), c.begin(), c.end());
    // The FDEs.
    std::vector<size_t> fde_at;
    for (const Fde &f : fdes) {
      fde_at.push_back(eh_at + eh.size());
      Bytes d;
      Fixed(&d, eh.size() + 4 + f.cie_pointer_adjust, 4);  // back to the CIE at 0
      const uintptr_t start = code_base() + f.start;
      if (encoding == 0x1b) {
        const uintptr_t field = reinterpret_cast<uintptr_t>(bytes_.data()) + eh_at + eh.size() + 8;
        Fixed(&d, static_cast<uint32_t>(start - field), 4);
        Fixed(&d, f.range, 4);
      } else {  // absptr
        Fixed(&d, start, 8);
        Fixed(&d, f.range, 8);
      }
      if (f.augmentation_data) Uleb(&d, 0);
      d.insert(d.end(), f.instructions.begin(), f.instructions.end());
      while (d.size() % 8 != 4) d.push_back(0);
      Fixed(&eh, f.length != 0 ? f.length : d.size() + f.length_adjust, 4);
      eh.insert(eh.end(), d.begin(), d.end());
    }
    // The header: version, eh_frame_ptr (pcrel sdata4), fde_count (udata4), table (datarel
    // sdata4), and the table.
    Bytes h = {1, 0x1b, 0x03, 0x3b};
    Fixed(&h, static_cast<uint32_t>(eh_at - 4), 4);
    Fixed(&h, fdes.size(), 4);
    const uintptr_t hdr = reinterpret_cast<uintptr_t>(bytes_.data());
    for (size_t i = 0; i < fdes.size(); i++) {
      Fixed(&h, static_cast<uint32_t>(code_base() + fdes[i].start - hdr), 4);
      Fixed(&h, static_cast<uint32_t>(fde_at[i]), 4);
    }
    EXPECT_EQ(h.size(), eh_at);
    h.insert(h.end(), eh.begin(), eh.end());
    EXPECT_LE(h.size(), bytes_.capacity());
    bytes_.assign(h.begin(), h.end());  // capacity reserved: the address does not move
  }

  // The rule at code offset pc, as text; "hdr" if the header is refused.
  std::string RuleAt(uint64_t pc) const {
    hd_cfi_tables t;
    const uintptr_t lo = reinterpret_cast<uintptr_t>(bytes_.data());
    if (!hd_cfi_read_eh_frame_hdr(bytes_.data(), lo, lo + bytes_.size(), &t)) return "hdr";
    return Describe(hd_cfi_rule(&t, code_base() + pc));
  }

  Bytes *bytes() { return &bytes_; }
  // The functions' addresses: past the tables in the buffer's reserved room, so that 32-bit
  // offsets reach them; never read.
  uintptr_t code_base() const { return reinterpret_cast<uintptr_t>(bytes_.data()) + 0x8000; }

  static std::string Describe(uint64_t rule) {
    if (rule == RULE_NO_INFO) return "no-info";
    switch (RULE_KIND(rule)) {
      case RULE_UNSUPPORTED: return "unsupported";
      case RULE_OUTERMOST: return "outermost";
      case RULE_SIGNAL: return "signal";
    }
    std::string s = std::string(RULE_CFA_RBP(rule) ? "rbp" : "rsp") + "+" +
                    std::to_string(RULE_CFA_OFFSET(rule)) + " ra@" +
                    std::to_string(RULE_RA_WORDS(rule));
    if (RULE_RBP_SAVED(rule)) s += " rbp@" + std::to_string(RULE_RBP_WORDS(rule));
    return s;
  }

 private:
  static Bytes Reserved() {
    Bytes b;
    b.reserve(1 << 16);  // the data does not move while the image is built into it
    return b;
  }
  Bytes bytes_ = Reserved();
};

Fde Code(Cfa cfa, uint64_t range = 64) {
  Fde f;
  f.instructions = cfa.b;
  f.range = range;
  return f;
}

struct Case {
  const char *name;
  Cie cie;
  Fde fde;
  uint64_t pc;
  const char *rule;
};

const Bytes kPltExpression = {0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22};

Cie WithCie(void (*edit)(Cie *)) {
  Cie c;
  edit(&c);
  return c;
}

TEST(CfiRulesTest, EachShapeCompilesToItsRule) {
  const Case cases[] = {
      {"function entry", Cie(), Code(Cfa()), 0, "rsp+8 ra@-1"},
      {"after push rbp", Cie(), Code(Cfa().AdvanceLoc(1).DefCfaOffset(16).Offset(RBP, 2)), 1,
       "rsp+16 ra@-1 rbp@-2"},
      {"before push rbp's effect", Cie(), Code(Cfa().AdvanceLoc(1).DefCfaOffset(16)), 0,
       "rsp+8 ra@-1"},
      {"rbp frame", Cie(),
       Code(Cfa().AdvanceLoc(1).DefCfaOffset(16).Offset(RBP, 2).AdvanceLoc(3).DefCfaRegister(RBP)),
       10, "rbp+16 ra@-1 rbp@-2"},
      {"epilogue, remembered", Cie(),
       Code(Cfa()
                .AdvanceLoc(1)
                .DefCfaOffset(16)
                .Offset(RBP, 2)
                .AdvanceLoc(1)
                .RememberState()
                .DefCfa(RSP, 8)
                .Restore(RBP)
                .AdvanceLoc(1)
                .RestoreState()),
       2, "rsp+8 ra@-1"},
      {"after the epilogue, restored", Cie(),
       Code(Cfa()
                .AdvanceLoc(1)
                .DefCfaOffset(16)
                .Offset(RBP, 2)
                .AdvanceLoc(1)
                .RememberState()
                .DefCfa(RSP, 8)
                .Restore(RBP)
                .AdvanceLoc(1)
                .RestoreState()),
       3, "rsp+16 ra@-1 rbp@-2"},
      {"restore_extended", Cie(), Code(Cfa().Offset(RBP, 2).AdvanceLoc(1).RestoreExtended(RBP)), 1,
       "rsp+8 ra@-1"},
      {"restore_state with nothing remembered", Cie(), Code(Cfa().RestoreState()), 0,
       "unsupported"},
      {"nine states remembered", Cie(),
       Code(Cfa()
                .RememberState()
                .RememberState()
                .RememberState()
                .RememberState()
                .RememberState()
                .RememberState()
                .RememberState()
                .RememberState()
                .RememberState()),
       0, "unsupported"},
      {"outermost frame", Cie(), Code(Cfa().Undefined(RA)), 0, "outermost"},
      {"signal frame", WithCie([](Cie *c) { c->augmentation = "zRS"; }), Code(Cfa()), 0, "signal"},
      {"PLT entry before the push", Cie(), Code(Cfa().DefCfaExpression(kPltExpression)), 3,
       "rsp+8 ra@-1"},
      {"PLT entry after the push", Cie(), Code(Cfa().DefCfaExpression(kPltExpression)), 12,
       "rsp+16 ra@-1"},
      {"another CFA expression", Cie(), Code(Cfa().DefCfaExpression({0x77, 0x08})), 0,
       "unsupported"},
      {"a CFA expression, then a register", Cie(),
       Code(Cfa().DefCfaExpression({0x77, 0x08}).DefCfa(RSP, 16)), 0, "rsp+16 ra@-1"},
      {"rbp by expression", Cie(), Code(Cfa().Expression(RBP, {0x76, 0x00})), 0, "unsupported"},
      {"rbp by value expression", Cie(), Code(Cfa().ValExpression(RBP, {0x76, 0x00})), 0,
       "unsupported"},
      {"rbp in a register", Cie(), Code(Cfa().Register(RBP, 3)), 0, "unsupported"},
      {"rbp as a value", Cie(), Code(Cfa().ValOffset(RBP, 2)), 0, "unsupported"},
      {"ra as a signed value", Cie(), Code(Cfa().ValOffsetSf(RA, 1)), 0, "unsupported"},
      {"ra in a register", Cie(), Code(Cfa().Register(RA, 3)), 0, "unsupported"},
      {"ra by expression", Cie(), Code(Cfa().Expression(RA, {0x77, 0x00})), 0, "unsupported"},
      {"no rule for ra", WithCie([](Cie *c) { c->instructions = Cfa().DefCfa(RSP, 8).b; }),
       Code(Cfa()), 0, "unsupported"},
      {"a rule for rsp", Cie(), Code(Cfa().Offset(RSP, 2)), 0, "unsupported"},
      {"rsp the same", Cie(), Code(Cfa().SameValue(RSP)), 0, "rsp+8 ra@-1"},
      {"CFA from r10", Cie(), Code(Cfa().DefCfa(10, 0)), 0, "unsupported"},
      {"CFA offset past 32 bits", Cie(), Code(Cfa().DefCfaOffset(uint64_t{1} << 33)), 0,
       "unsupported"},
      {"ra not 8-byte aligned", WithCie([](Cie *c) {
         c->data_align = 1;
         c->instructions = Cfa().DefCfa(RSP, 8).OffsetExtendedSf(RA, -4).b;
       }),
       Code(Cfa()), 0, "unsupported"},
      {"rbp too far for 8 bits", Cie(), Code(Cfa().Offset(RBP, 200)), 0, "unsupported"},
      {"def_cfa_sf", Cie(), Code(Cfa().DefCfaSf(RSP, -2)), 0, "rsp+16 ra@-1"},
      {"def_cfa_offset_sf", Cie(), Code(Cfa().DefCfaOffsetSf(-3)), 0, "rsp+24 ra@-1"},
      {"offset_extended", Cie(), Code(Cfa().OffsetExtended(RBP, 3)), 0, "rsp+8 ra@-1 rbp@-3"},
      {"offset_extended_sf", Cie(), Code(Cfa().OffsetExtendedSf(RBP, 2)), 0, "rsp+8 ra@-1 rbp@-2"},
      {"GNU_negative_offset_extended", Cie(), Code(Cfa().NegativeOffsetExtended(RBP, 2)), 0,
       "rsp+8 ra@-1 rbp@2"},
      {"same_value after a save", Cie(), Code(Cfa().Offset(RBP, 2).SameValue(RBP)), 0,
       "rsp+8 ra@-1"},
      {"rbp undefined", Cie(), Code(Cfa().Undefined(RBP)), 0, "unsupported"},
      {"advance_loc1, before", Cie(), Code(Cfa().AdvanceLoc1(20).DefCfaOffset(16), 64), 19,
       "rsp+8 ra@-1"},
      {"advance_loc1, at", Cie(), Code(Cfa().AdvanceLoc1(20).DefCfaOffset(16), 64), 20,
       "rsp+16 ra@-1"},
      {"advance_loc2", Cie(), Code(Cfa().AdvanceLoc2(300).DefCfaOffset(16), 400), 299,
       "rsp+8 ra@-1"},
      {"advance_loc4", Cie(), Code(Cfa().AdvanceLoc4(300).DefCfaOffset(16), 400), 300,
       "rsp+16 ra@-1"},
      {"code alignment 4", WithCie([](Cie *c) { c->code_align = 4; }),
       Code(Cfa().AdvanceLoc(2).DefCfaOffset(16)), 7, "rsp+8 ra@-1"},
      {"code alignment 4, at", WithCie([](Cie *c) { c->code_align = 4; }),
       Code(Cfa().AdvanceLoc(2).DefCfaOffset(16)), 8, "rsp+16 ra@-1"},
      {"nop and GNU_args_size", Cie(), Code(Cfa().Nop().ArgsSize(16).Nop()), 0, "rsp+8 ra@-1"},
      {"version 3, ra register in LEB128", WithCie([](Cie *c) { c->version = 3; }), Code(Cfa()), 0,
       "rsp+8 ra@-1"},
      {"version 2", WithCie([](Cie *c) { c->version = 2; }), Code(Cfa()), 0, "unsupported"},
      {"return address in r15", WithCie([](Cie *c) { c->ra_register = 15; }), Code(Cfa()), 0,
       "unsupported"},
      {"personality and LSDA (zPLR)", WithCie([](Cie *c) {
         c->augmentation = "zPLR";
         c->augmentation_data = {0x9b, 0, 0, 0, 0, 0x1b, 0x1b};
       }),
       Code(Cfa().AdvanceLoc(1).DefCfaOffset(16)), 1, "rsp+16 ra@-1"},
      {"an augmentation letter unknown after z", WithCie([](Cie *c) {
         c->augmentation = "zRX";
         c->augmentation_data = {0x1b, 0xee, 0xee};
       }),
       Code(Cfa()), 0, "rsp+8 ra@-1"},
      {"the old 'eh' augmentation", WithCie([](Cie *c) { c->augmentation = "eh"; }), Code(Cfa()), 0,
       "unsupported"},
      {"an augmentation without z", WithCie([](Cie *c) { c->augmentation = "R"; }), Code(Cfa()), 0,
       "unsupported"},
      {"an unknown instruction", Cie(), Code(Cfa().Op(0x2d)), 0, "unsupported"},
      {"a LEB128 longer than 64 bits", Cie(), Code(Cfa().Op(0x0e).Raw(Bytes(11, 0x80)).Op(0x01)), 0,
       "unsupported"},
      {"an expression longer than the FDE", Cie(), Code(Cfa().Op(0x0f).Op(0x7f).Op(0x77)), 0,
       "unsupported"},
      {"instructions past pc are not run", Cie(), Code(Cfa().AdvanceLoc(4).Op(0x2d)), 3,
       "rsp+8 ra@-1"},
      {"pc past the FDE's range", Cie(), Code(Cfa(), 16), 16, "no-info"},
  };
  for (const Case &c : cases) {
    Image image(c.cie, {c.fde});
    EXPECT_EQ(image.RuleAt(c.pc), c.rule) << c.name;
  }
}

TEST(CfiRulesTest, ThePointerEncodingOfTheFdeIsTheCies) {
  Cie absolute;
  absolute.augmentation_data = {0x00};  // R: absptr
  Image image(absolute, {Code(Cfa().AdvanceLoc(2).DefCfaOffset(16))}, 0x00);
  EXPECT_EQ(image.RuleAt(1), "rsp+8 ra@-1");
  EXPECT_EQ(image.RuleAt(2), "rsp+16 ra@-1");
  // set_loc's operand is an address in the same encoding: one below every pc applies what
  // follows it, one above every pc ends the program there.
  Image low(absolute, {Code(Cfa().SetLoc(0).DefCfaOffset(16))}, 0x00);
  EXPECT_EQ(low.RuleAt(0), "rsp+16 ra@-1");
  Image high(absolute, {Code(Cfa().SetLoc(UINT64_MAX).DefCfaOffset(16))}, 0x00);
  EXPECT_EQ(high.RuleAt(0), "rsp+8 ra@-1");
}

TEST(CfiRulesTest, TheSearchTableFindsEachFunction) {
  std::vector<Fde> fdes;
  for (uint64_t i = 0; i < 20; i++) {
    Fde f = Code(Cfa().DefCfaOffset(8 * (i + 1)), 32);
    f.start = 64 * i;  // 32-byte gaps between functions
    fdes.push_back(f);
  }
  Image image(Cie(), fdes);
  for (uint64_t i = 0; i < 20; i++) {
    EXPECT_EQ(image.RuleAt(64 * i), "rsp+" + std::to_string(8 * (i + 1)) + " ra@-1") << i;
    EXPECT_EQ(image.RuleAt(64 * i + 31), "rsp+" + std::to_string(8 * (i + 1)) + " ra@-1") << i;
    EXPECT_EQ(image.RuleAt(64 * i + 40), "no-info") << "a gap between FDEs: " << i;
  }
  Image one(Cie(), {[] {
              Fde f = Code(Cfa());
              f.start = 100;
              return f;
            }()});
  EXPECT_EQ(one.RuleAt(99), "no-info") << "before the first FDE";
  Image none(Cie(), {});
  EXPECT_EQ(none.RuleAt(0), "no-info");
}

// Lengths and pointers that lead out of the range are refused, never followed.
TEST(CfiRulesTest, MalformedTablesAreRefusedWithoutReadingOutside) {
  {
    Fde f = Code(Cfa());
    f.length_adjust = 1 << 20;
    EXPECT_EQ(Image(Cie(), {f}).RuleAt(0), "unsupported") << "an FDE past the range";
  }
  {
    Fde f = Code(Cfa());
    f.cie_pointer_adjust = 1 << 20;
    EXPECT_EQ(Image(Cie(), {f}).RuleAt(0), "unsupported") << "a CIE before the range";
  }
  {
    Fde f = Code(Cfa());
    f.cie_pointer_adjust = -8;
    EXPECT_EQ(Image(Cie(), {f}).RuleAt(0), "unsupported") << "a CIE pointer into the CIE";
  }
  {
    Cie c;
    c.length_adjust = 1 << 20;
    EXPECT_EQ(Image(c, {Code(Cfa())}).RuleAt(0), "unsupported") << "a CIE past the range";
  }
  {
    Fde f = Code(Cfa());
    f.length = 0xffffffffu;
    EXPECT_EQ(Image(Cie(), {f}).RuleAt(0), "unsupported") << "a 64-bit DWARF length";
  }
  {
    Image image(Cie(), {Code(Cfa())});
    (*image.bytes())[0] = 2;
    EXPECT_EQ(image.RuleAt(0), "hdr") << "header version 2";
  }
  {
    Image image(Cie(), {Code(Cfa())});
    (*image.bytes())[3] = 0x1b;
    EXPECT_EQ(image.RuleAt(0), "hdr") << "a table that is not datarel sdata4";
  }
  {
    Image image(Cie(), {Code(Cfa())});
    (*image.bytes())[2] = 0x02;  // fde_count as udata2: the table starts 2 bytes off alignment
    EXPECT_EQ(image.RuleAt(0), "hdr") << "a misaligned table";
  }
  {
    Image image(Cie(), {Code(Cfa())});
    (*image.bytes())[8] = 0xff;  // fde_count: 255 entries of 8 bytes do not fit
    EXPECT_EQ(image.RuleAt(0), "hdr") << "a table longer than the range";
  }
  {
    Image image(Cie(), {Code(Cfa())});
    (*image.bytes())[7] = 0x40;  // eh_frame_ptr 1 GiB away
    EXPECT_EQ(image.RuleAt(0), "hdr") << ".eh_frame outside the range";
  }
  {
    Image image(Cie(), {Code(Cfa())});
    (*image.bytes())[19] = 0x40;  // the table's FDE pointer 1 GiB away
    EXPECT_EQ(image.RuleAt(0), "unsupported") << "a table entry outside the range";
  }
}

// A module's tables are checked whole when it is loaded: each search-table entry must point at
// an FDE in the range whose CIE is in the range too, and whose first address is the entry's.
// The corruptions of MalformedTablesAreRefusedWithoutReadingOutside that leave the header
// readable are each found; the tables as built pass.
TEST(CfiRulesTest, TheWholeTableCheckFindsEachInconsistency) {
  auto checked = [](Image &image) {
    hd_cfi_tables t;
    const uintptr_t lo = reinterpret_cast<uintptr_t>(image.bytes()->data());
    if (!hd_cfi_read_eh_frame_hdr(image.bytes()->data(), lo, lo + image.bytes()->size(), &t)) {
      return std::string("hdr");
    }
    return std::string(hd_cfi_check_tables(&t) ? "consistent" : "refused");
  };
  {
    Image image(Cie(), {Code(Cfa()), Code(Cfa())});
    EXPECT_EQ(checked(image), "consistent");
  }
  {
    Fde f = Code(Cfa());
    f.length_adjust = 1 << 20;
    Image image(Cie(), {f});
    EXPECT_EQ(checked(image), "refused") << "an FDE past the range";
  }
  {
    Fde f = Code(Cfa());
    f.cie_pointer_adjust = 1 << 20;
    Image image(Cie(), {f});
    EXPECT_EQ(checked(image), "refused") << "a CIE before the range";
  }
  {
    Fde f = Code(Cfa());
    f.cie_pointer_adjust = -8;
    Image image(Cie(), {f});
    EXPECT_EQ(checked(image), "refused") << "a CIE pointer into the CIE";
  }
  {
    Cie c;
    c.length_adjust = 1 << 20;
    Image image(c, {Code(Cfa())});
    EXPECT_EQ(checked(image), "refused") << "a CIE past the range";
  }
  {
    Image image(Cie(), {Code(Cfa())});
    (*image.bytes())[19] = 0x40;  // the table's FDE pointer 1 GiB away
    EXPECT_EQ(checked(image), "refused") << "a table entry outside the range";
  }
  {
    Image image(Cie(), {Code(Cfa())});
    (*image.bytes())[12] ^= 0x10;  // the entry's first address 16 bytes off the FDE's
    EXPECT_EQ(checked(image), "refused") << "an entry that disagrees with its FDE";
  }
  {  // FDE addresses in another encoding than linkers' pc-relative 4 bytes: read in full
    Cie absolute;
    absolute.augmentation_data = {0x00};  // R: absptr
    Image two(absolute, {Code(Cfa()), Code(Cfa())}, 0x00);
    EXPECT_EQ(checked(two), "consistent") << "absolute addresses";
    Image image(absolute, {Code(Cfa())}, 0x00);
    (*image.bytes())[12] ^= 0x10;
    EXPECT_EQ(checked(image), "refused") << "absolute addresses: an entry that disagrees";
  }
  {
    Fde second = Code(Cfa());
    second.start = 256;
    Image image(Cie(), {Code(Cfa()), second});
    for (int k = 0; k < 8; k++) {  // the entries swapped whole: each agrees with its FDE
      std::swap((*image.bytes())[12 + k], (*image.bytes())[20 + k]);
    }
    EXPECT_EQ(checked(image), "refused") << "a table out of order";
  }
}

// Real modules, as linkers and compilers make them: the rule at each FDE's first instruction
// compiles, and is mostly a function's entry (its return address just pushed); the others are
// the cold parts compilers split off functions, whose frames are set up already, and a few
// outermost and signal frames.
struct ModuleTables {
  const char *name;
  hd_cfi_tables tables;
  bool found;
};

int FindTables(struct dl_phdr_info *info, size_t, void *data) {
  auto *want = static_cast<ModuleTables *>(data);
  if (want->found || strstr(info->dlpi_name, want->name) == nullptr) return 0;
  uintptr_t hdr = 0;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    if (info->dlpi_phdr[i].p_type == PT_GNU_EH_FRAME)
      hdr = info->dlpi_addr + info->dlpi_phdr[i].p_vaddr;
  }
  for (int i = 0; hdr != 0 && i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) &ph = info->dlpi_phdr[i];
    const uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (ph.p_type == PT_LOAD && hdr >= start && hdr < start + ph.p_memsz) {
      want->found = hd_cfi_read_eh_frame_hdr(reinterpret_cast<const uint8_t *>(hdr), start,
                                             start + ph.p_memsz, &want->tables);
    }
  }
  return 0;
}

TEST(CfiRulesTest, EveryFdeOfRealModulesCompiles) {
  for (const char *name : {"libc.so.6", "libstdc++.so.6", ""}) {  // "": this test's program
    ModuleTables m = {name, {}, false};
    dl_iterate_phdr(FindTables, &m);
    ASSERT_TRUE(m.found) << name;
    ASSERT_GT(m.tables.fde_count, 100u) << name;
    EXPECT_TRUE(hd_cfi_check_tables(&m.tables)) << name << ": a linker's tables are consistent";
    size_t entry = 0, frame = 0, outermost = 0, signal = 0;
    for (uintptr_t i = 0; i < m.tables.fde_count; i++) {
      const uintptr_t pc = reinterpret_cast<uintptr_t>(m.tables.hdr) + m.tables.table[2 * i];
      const uint64_t rule = hd_cfi_rule(&m.tables, pc);
      EXPECT_NE(RULE_KIND(rule), RULE_UNSUPPORTED) << name << " FDE " << i;
      entry += Image::Describe(rule) == "rsp+8 ra@-1";
      frame += RULE_KIND(rule) == RULE_FRAME;
      outermost += RULE_KIND(rule) == RULE_OUTERMOST;
      signal += RULE_KIND(rule) == RULE_SIGNAL;
    }
    EXPECT_GE(entry, 3 * m.tables.fde_count / 4) << name;
    EXPECT_EQ(frame + outermost + signal, m.tables.fde_count) << name;
    EXPECT_LE(outermost + signal, 4u) << name;
  }
}

}  // namespace
