/* The rule compiler of our unwinder: from a module's .eh_frame_hdr and .eh_frame, the rule of one
 * program counter, in 64 bits. Pure functions of those bytes, bounded to the range the module
 * maps them in: a dlopen'ed module's call-frame information is input the program did not
 * write, and no byte of it makes a read outside that range
 * (tests/instrumentation/cfi_rules_test.cc, tests/fuzz/fuzz_cfi.c). */
#ifndef HEAPDUMP_INSTRUMENTATION_CFI_RULES_H
#define HEAPDUMP_INSTRUMENTATION_CFI_RULES_H

#include <stdbool.h>
#include <stdint.h>

#include "cfi.h"

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

/* A module's unwind tables: its .eh_frame_hdr, the binary-search table in it, and the range
 * [lo, hi) every byte read of them (table, FDEs, CIEs) must lie in. */
typedef struct hd_cfi_tables {
  const uint8_t *hdr;
  const int32_t *table; /* (initial location, FDE) pairs relative to hdr, sorted */
  uintptr_t fde_count;
  uintptr_t lo, hi;
} hd_cfi_tables;

/* Reads a version-1 .eh_frame_hdr at hdr with the search table linkers write (datarel sdata4),
 * which with the .eh_frame it points to must lie in [lo, hi). False: none we can search. */
bool hd_cfi_read_eh_frame_hdr(const uint8_t *hdr, uintptr_t lo, uintptr_t hi,
                              hd_cfi_tables *out) HD_CFI_HIDDEN;

/* Whether every entry of the search table is consistent: sorted, each pointing at an FDE that
 * lies in the range, whose CIE does too and is well formed, and whose first address is the
 * entry's. A module's tables are checked once when it is loaded; one that fails is not used
 * (its frames are stepped by frame pointers, and libunwind is not shown the module). Linear in
 * the number of FDEs. */
bool hd_cfi_check_tables(const hd_cfi_tables *t) HD_CFI_HIDDEN;

/* The rule at pc, from the FDE the tables give for it: RULE_NO_INFO where no FDE covers pc,
 * RULE_UNSUPPORTED where one does but our rules cannot say it or it is malformed. */
uint64_t hd_cfi_rule(const hd_cfi_tables *t, uintptr_t pc) HD_CFI_HIDDEN;

#endif
