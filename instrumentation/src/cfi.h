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
 * HD_CFI_MEMO_FRAMES frames) have no memo, and are left to the trail below. */
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

/* Validated reuse of the outer part of a walk. Deep stacks rarely repeat whole, but a walk that
 * leaves the frames it shares with the thread's previous one (recursive descent, an event loop)
 * meets one of that walk's frames again: the same program counter at the same stack pointer.
 * From there on, the walk is the same function of the same inputs, and it would give the
 * previous walk's remaining frames if the rbp it brings (where those frames use it) and every
 * slot they read still hold what they held. The trail keeps the thread's last walk for this,
 * outermost frame first, so that a walk that joins it replaces only the frames inside the one
 * it joined, and its shared outer part is never copied. */
#define HD_CFI_TRAIL_FRAMES 65 /* the most frames a walk is asked for (HD_MAX_FRAMES + 1) */
#define HD_CFI_TRAIL_READS (3 * HD_CFI_TRAIL_FRAMES) /* a signal frame reads three words */

typedef struct hd_cfi_trail {
  uint64_t generation;
  unsigned frame_count, read_count; /* frame_count 0: empty */
  int end;                          /* the walk's hd_cfi_end */
  uint64_t after_call[2];           /* bit q: the pc of frame q is a return address */
  uint64_t bp_needed[2]; /* bit q: frame q and those outside it use the rbp frame q starts with */
  uintptr_t pc[HD_CFI_TRAIL_FRAMES], sp[HD_CFI_TRAIL_FRAMES], bp[HD_CFI_TRAIL_FRAMES];
  uint8_t first_read[HD_CFI_TRAIL_FRAMES + 1]; /* frame q read [first_read[q], first_read[q + 1]) */
  uintptr_t slot[HD_CFI_TRAIL_READS], value[HD_CFI_TRAIL_READS]; /* the reads that decided it */
} hd_cfi_trail;

/* The walk in progress, innermost frame first (its program counters are the walk's frames):
 * where each frame stood, what it read, and which reads decided the walk. */
typedef struct hd_cfi_walk_record {
  unsigned read_count;
  uint64_t after_call[2], bp_needed[2]; /* as in a trail, by walk order */
  uint64_t needed[(HD_CFI_TRAIL_READS + 63) / 64];
  uintptr_t sp[HD_CFI_TRAIL_FRAMES], bp[HD_CFI_TRAIL_FRAMES];
  uint8_t first_read[HD_CFI_TRAIL_FRAMES];
  uintptr_t slot[HD_CFI_TRAIL_READS], value[HD_CFI_TRAIL_READS];
} hd_cfi_walk_record;

typedef struct hd_cfi_memos {
  hd_cfi_memo entry[HD_CFI_MEMOS];
  unsigned next; /* the entry the next new walk replaces */
  hd_cfi_trail trail;
  hd_cfi_walk_record record;
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
  HD_CFI_UNSUPPORTED, /* a frame our rules cannot describe, or a read out of bounds: the walk ends
                         there, its frames so far given */
} hd_cfi_end;

/* (Re)reads the loaded modules' unwind tables; called at start and after dlopen/dlclose, never
 * on the allocation path (it takes the loader's lock through dl_iterate_phdr). */
void hd_cfi_modules_changed(void) HD_CFI_HIDDEN;

/* Around the real dlclose: in between, no module of the list is read (it may be unmapping). */
void hd_cfi_modules_closing(void) HD_CFI_HIDDEN;
void hd_cfi_modules_closed(void) HD_CFI_HIDDEN;

/* A module's unwind tables are checked whole when the list first reads it (hd_cfi_check_tables):
 * inconsistent ones (offsets outside the module, FDEs that disagree with the search table) are
 * refused, and the module's frames are stepped by frame pointers. How many modules of the list
 * were refused: */
unsigned hd_cfi_refused_modules(void) HD_CFI_HIDDEN;

/* Whether libunwind may read the unwind tables of the module `info` describes: only if they
 * passed the checks (when the list read them, or now for a module loaded since); a module
 * without .eh_frame_hdr is shown (libunwind's open of its file fails). Called from within
 * dl_iterate_phdr. */
struct dl_phdr_info;
bool hd_cfi_module_tables_usable(const struct dl_phdr_info *info) HD_CFI_HIDDEN;

/* In a fork child: the list's lock may have been held by a thread of the parent. */
void hd_cfi_after_fork_child(void) HD_CFI_HIDDEN;

/* Walks a stack from a frame whose return address is pc, whose caller's stack pointer is sp
 * (just above that return address) and whose rbp is bp: frames[0..capacity) receives pc and the
 * program counter of each caller, innermost first; *count: how many. may_lock_loader: a rule
 * not cached yet may first check with the loader that no module came or went (false in a signal
 * handler). With memos (the calling thread's own), a walk that a memo shows would repeat is
 * not made (*reused), a walk that meets the previous walk's trail joins it (*joined), and a new
 * one that fits is remembered; *stack_key then points at the memo's stack_key, where the caller
 * keeps the key it interned these frames under (0 until it does; NULL when no memo holds the
 * trace). Valid until the thread's next walk with memos. *by_frame_pointer: a frame of code
 * without call-frame information was stepped by its frame pointer (such walks are never
 * remembered). */
hd_cfi_end hd_cfi_backtrace(const hd_cfi_bounds *bounds, uintptr_t pc, uintptr_t sp, uintptr_t bp,
                            bool may_lock_loader, uint64_t *frames, unsigned capacity,
                            unsigned *count, hd_cfi_memos *memos, bool *reused, bool *joined,
                            bool *by_frame_pointer, uint32_t **stack_key) HD_CFI_HIDDEN;

#endif
