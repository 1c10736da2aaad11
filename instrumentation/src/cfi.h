/* Our own x86-64 unwinder: DWARF call-frame information (.eh_frame_hdr and .eh_frame) compiled
 * into compact per-PC rules, kept in a cache the allocation path reads without locks. */
#ifndef HEAPDUMP_INSTRUMENTATION_CFI_H
#define HEAPDUMP_INSTRUMENTATION_CFI_H

#include <stdbool.h>
#include <stdint.h>

#include "runtime.h"

/* Where a walk may read: the thread's stack and, in a handler on an alternate signal stack, that
 * stack too. Every read of a saved register is checked against them, so a walk never faults. */
typedef struct hd_cfi_bounds {
  uintptr_t lo[2], hi[2];
  unsigned count;
} hd_cfi_bounds;

/* What ended a walk. */
typedef enum hd_cfi_end {
  HD_CFI_COMPLETE,    /* the outermost frame (its return address undefined, or zero) */
  HD_CFI_FULL,        /* out of room in frames */
  HD_CFI_UNSUPPORTED, /* a frame our rules cannot describe: the caller falls back */
} hd_cfi_end;

/* (Re)reads the loaded modules' unwind tables; called at start and after dlopen/dlclose, never
 * on the allocation path (it takes the loader's lock through dl_iterate_phdr). */
void hd_cfi_modules_changed(void) HD_HIDDEN;

/* In a fork child: the list's lock may have been held by a thread of the parent. */
void hd_cfi_after_fork_child(void) HD_HIDDEN;

/* Walks the caller's stack: frames[0..capacity) receives the program counter of each frame,
 * innermost first (its own frame's included; the caller drops what it must). *count: how many. */
hd_cfi_end hd_cfi_backtrace(const hd_cfi_bounds *bounds, uint64_t *frames, unsigned capacity,
                            unsigned *count) HD_HIDDEN;

#endif
