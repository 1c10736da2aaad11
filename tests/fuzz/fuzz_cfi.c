/* libFuzzer target: the unwinder's rule compiler (instrumentation/src/cfi_rules.c) on hostile
 * call-frame information, as a dlopen'ed module could carry it.
 *
 * Input: u32 (little-endian) a program counter, as an offset from the image, then the image: an
 * .eh_frame_hdr followed by whatever the rest of the input holds (its .eh_frame), which is also
 * the whole range the compiler may read. The image is copied to a buffer of exactly its size, so
 * a read past it is a sanitizer's error. The rule is asked for that pc and for the first
 * instruction of each function the search table lists (up to 64), which reach the FDEs whatever
 * the pc; the whole-table check (hd_cfi_check_tables) runs on it first. tests/fuzz/corpus/cfi holds
 * the tables of a real program (objcopy -O binary -j .eh_frame_hdr -j .eh_frame) and small built
 * ones. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cfi_rules.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 4) return 0;
  uint32_t pc_offset;
  memcpy(&pc_offset, data, 4);
  const size_t image_size = size - 4;
  uint8_t *image = malloc(image_size + 1); /* +1: malloc(0) may return NULL */
  if (image == NULL) return 0;
  memcpy(image, data + 4, image_size);
  const uintptr_t lo = (uintptr_t)image, hi = lo + image_size;
  hd_cfi_tables t;
  if (hd_cfi_read_eh_frame_hdr(image, lo, hi, &t)) {
    (void)hd_cfi_check_tables(&t); /* the whole-table check reads every entry, FDE and CIE */
    uint64_t rules = hd_cfi_rule(&t, lo + pc_offset);
    for (uintptr_t i = 0; i < t.fde_count && i < 64; i++) {
      rules ^= hd_cfi_rule(&t, (uintptr_t)t.hdr + (intptr_t)t.table[2 * i]);
      rules ^= hd_cfi_rule(&t, (uintptr_t)t.hdr + (intptr_t)t.table[2 * i] + pc_offset % 256);
    }
    /* Every rule is one of the kinds the walk knows. */
    if (RULE_KIND(rules) > RULE_SIGNAL) abort();
  }
  free(image);
  return 0;
}
