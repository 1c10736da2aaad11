/* Our own x86-64 unwinder: DWARF call-frame information (.eh_frame_hdr and .eh_frame) compiled
 * into compact per-PC rules, kept in a cache the allocation path reads without locks. */
#ifndef HEAPDUMP_INSTRUMENTATION_CFI_H
#define HEAPDUMP_INSTRUMENTATION_CFI_H

#include <stdbool.h>
#include <stdint.h>

/* Not exported from the library that holds it (libheapdump.so, or bench's floor library). */
#define HD_CFI_HIDDEN __attribute__((visibility("hidden")))

/* Where a walk may read: the thread's stack and, in a handler on an alternate signal stack, that
 * stack too. Every read of a saved register is checked against them, so a walk never faults. */
typedef struct hd_cfi_bounds {
  uintptr_t lo[2], hi[2];
  unsigned count;
} hd_cfi_bounds;

/* Validated trace reuse. A walk is a function of where it starts (the program's return address,
 * rsp and rbp at its call into the library), of the rules of the program counters it meets (the
 * module-list generation), and of the stack slots it reads (return addresses, saved rbp, a
 * signal frame's registers). A memo keeps all of these with the walk's result; while they all
 * still hold, the walk would read the same values and give the same frames, so the memo's
 * frames are the walk's without walking. Per thread, a few recent walks; deep stacks (more than
 * HD_CFI_MEMO_FRAMES frames) are always walked. */
#define HD_CFI_MEMOS 8
#define HD_CFI_MEMO_FRAMES 40
#define HD_CFI_MEMO_READS 64

typedef struct hd_cfi_memo {
  uintptr_t pc, sp, bp;
  bool bp_matters; /* the walk used the starting rbp (else bp is not compared) */
  uint64_t generation;
  unsigned frame_count, read_count; /* frame_count 0: empty */
  int end;                          /* the walk's hd_cfi_end */
  uint32_t stack_key;               /* the caller's interned key of this trace, 0: not known */
  uintptr_t slot[HD_CFI_MEMO_READS], value[HD_CFI_MEMO_READS];
  uint64_t frames[HD_CFI_MEMO_FRAMES];
} hd_cfi_memo;

typedef struct hd_cfi_memos {
  hd_cfi_memo entry[HD_CFI_MEMOS];
  unsigned next; /* the entry the next new walk replaces */
} hd_cfi_memos;

/* The calling thread's stack (pthread_getattr_np, which may allocate and, for the main thread,
 * read /proc: once per thread, by a caller that keeps those allocations out of its records). */
bool hd_cfi_thread_stack(uintptr_t *lo, uintptr_t *hi) HD_CFI_HIDDEN;

/* Whether [addr, addr + size) lies in one of the bounds' stacks. */
bool hd_cfi_in_bounds(const hd_cfi_bounds *b, uintptr_t addr, uintptr_t size) HD_CFI_HIDDEN;

/* What ended a walk. */
typedef enum hd_cfi_end {
  HD_CFI_COMPLETE,    /* the outermost frame (its return address undefined, or zero) */
  HD_CFI_FULL,        /* out of room in frames */
  HD_CFI_UNSUPPORTED, /* a frame our rules cannot describe: the caller falls back */
} hd_cfi_end;

/* (Re)reads the loaded modules' unwind tables; called at start and after dlopen/dlclose, never
 * on the allocation path (it takes the loader's lock through dl_iterate_phdr). */
void hd_cfi_modules_changed(void) HD_CFI_HIDDEN;

/* Around the real dlclose: in between, no module of the list is read (it may be unmapping). */
void hd_cfi_modules_closing(void) HD_CFI_HIDDEN;
void hd_cfi_modules_closed(void) HD_CFI_HIDDEN;

/* In a fork child: the list's lock may have been held by a thread of the parent. */
void hd_cfi_after_fork_child(void) HD_CFI_HIDDEN;

/* Walks a stack from a frame whose return address is pc, whose caller's stack pointer is sp
 * (just above that return address) and whose rbp is bp: frames[0..capacity) receives pc and the
 * program counter of each caller, innermost first; *count: how many. may_lock_loader: a rule
 * not cached yet may first check with the loader that no module came or went (false in a signal
 * handler). With memos (the calling thread's own), a walk that a memo shows would repeat is
 * not made (*reused), and a new one that fits is remembered; *stack_key then points at the
 * memo's stack_key, where the caller keeps the key it interned these frames under (0 until it
 * does; NULL when no memo holds the trace). Valid until the thread's next walk with memos. */
hd_cfi_end hd_cfi_backtrace(const hd_cfi_bounds *bounds, uintptr_t pc, uintptr_t sp, uintptr_t bp,
                            bool may_lock_loader, uint64_t *frames, unsigned capacity,
                            unsigned *count, hd_cfi_memos *memos, bool *reused,
                            uint32_t **stack_key) HD_CFI_HIDDEN;

#endif
