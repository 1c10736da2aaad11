/* Stack capture for libheapdump.so: our own DWARF CFI unwinder (cfi_*.c, the default), libunwind
 * (loaded on request), or a bounded frame-pointer walk. */
#ifndef HEAPDUMP_INSTRUMENTATION_STACK_H
#define HEAPDUMP_INSTRUMENTATION_STACK_H

#include <stdbool.h>
#include <stdint.h>

#include "runtime.h"

/* HD_UNWIND_COMPARE records libunwind's traces and checks ours against each (a diagnostic:
 * its summary is printed at exit). */
enum {
  HD_UNWIND_NONE = -1, /* not configured */
  HD_UNWIND_LIBUNWIND = 0,
  HD_UNWIND_FP = 1,
  HD_UNWIND_CFI = 2,
  HD_UNWIND_COMPARE = 3
};
/* Frames at addresses in [lo, hi) at the top of the stack are dropped (the interposer's own). */
void hd_stack_configure(int method, unsigned max_frames, uintptr_t skip_lo,
                        uintptr_t skip_hi) HD_HIDDEN;
/* Fills frames[0..HD_MAX_FRAMES) with return addresses, innermost first; returns the count.
 * *truncated: the frame limit cut the walk short. in_signal_handler: called from a nested call,
 * so 0 when capturing now could not be safe. key_cache (may be NULL): set to where the
 * interned key of exactly these frames is kept for the next time the same trace is reused
 * (0 until the caller stores it there), or to NULL; valid until this thread's next capture. */
unsigned hd_capture_stack(uint64_t *frames, bool in_signal_handler, bool *truncated,
                          uint32_t **key_cache) HD_HIDDEN;
/* The calling thread's stack bounds, computed once per thread (they may allocate: under the
 * recursion guard); false if they cannot be known. */
bool hd_thread_stack(uintptr_t *lo, uintptr_t *hi) HD_HIDDEN;
/* From the library's constructor, where dlopen may run: loads libunwind if the method needs it
 * (if it cannot, says so on stderr and uses our unwinder). */
void hd_stack_start(void) HD_HIDDEN;

/* After dlopen or dlclose: the unwinder rereads the modules' tables. Around the real dlclose,
 * closing and closed (given what closing returned): in between, the unwinder reads no module's
 * tables. */
void hd_stack_modules_changed(void) HD_HIDDEN;
bool hd_stack_modules_closing(void) HD_HIDDEN;
void hd_stack_modules_closed(bool counted) HD_HIDDEN;

/* In a fork child, before anything unwinds: the unwinder must not wait for a lock that a thread
 * of the parent held at the fork (see stack.c). */
void hd_stack_after_fork_child(void) HD_HIDDEN;

#endif
