/* Stack capture: chooses the unwinder and keeps the program's frames. Runs on the allocation
 * hot path. libunwind is reached only through libunwind_loader.c, when it was asked for. */
#define _GNU_SOURCE
#include "stack.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "cfi.h"
#include "libunwind_loader.h"
#include "raw_syscall.h"

/* Until hd_stack_configure (a process that records nothing never configures): no unwinder, no
 * module list. */
static int g_method = HD_UNWIND_NONE;
static unsigned g_max = HD_MAX_FRAMES;
static uintptr_t g_skip_lo, g_skip_hi;

void hd_stack_configure(int method, unsigned max_frames, uintptr_t skip_lo, uintptr_t skip_hi) {
  g_method = method;
  g_max = max_frames == 0 || max_frames > HD_MAX_FRAMES ? HD_MAX_FRAMES : max_frames;
  g_skip_lo = skip_lo;
  g_skip_hi = skip_hi;
  hd_stack_modules_changed();
}

static const char *method_name(int method) {
  return method == HD_UNWIND_LIBUNWIND ? "libunwind" : "compare";
}

void hd_stack_start(void) {
  if (g_method != HD_UNWIND_LIBUNWIND && g_method != HD_UNWIND_COMPARE) return;
  if (hd_libunwind_load()) return;
  char line[160];
  const int n = snprintf(line, sizeof line,
                         "heapdump: HEAPDUMP_UNWIND=%s needs libunwind.so.8, which could not be "
                         "loaded: heapdump's own unwinder is used\n",
                         method_name(g_method));
  (void)!write(STDERR_FILENO, line, (size_t)n);
  g_method = HD_UNWIND_CFI;
  hd_stack_modules_changed();
}

static bool uses_cfi(void) { return g_method == HD_UNWIND_CFI || g_method == HD_UNWIND_COMPARE; }

/* The module list is kept for our unwinder, and for libunwind, which is shown only the modules
 * whose tables the list's checks passed. */
static bool tracks_modules(void) { return uses_cfi() || g_method == HD_UNWIND_LIBUNWIND; }

void hd_stack_modules_changed(void) {
  if (!tracks_modules()) return;
  hd_cfi_modules_changed();
  hd_note_unwind_tables_refused(hd_cfi_refused_modules());
}

bool hd_stack_modules_closing(void) {
  const bool counted = tracks_modules();
  if (counted) hd_cfi_modules_closing();
  return counted;
}

void hd_stack_modules_closed(bool counted) {
  if (!counted) return;
  hd_cfi_modules_closed();
  hd_note_unwind_tables_refused(hd_cfi_refused_modules());
}

/* libunwind (Debian's 1.6 has no per-thread cache) takes one process-wide lock around every
 * step it cannot take from a thread's trace cache. A fork while another thread of the parent
 * held it leaves it held for good in the child, whose first unwinding through a frame new to it
 * would wait forever (with every signal blocked). So the child gives up libunwind's shared cache,
 * and with it the lock: its steps parse the unwind tables each time, and each thread's trace
 * cache still spares the walk most of them. */
void hd_stack_after_fork_child(void) {
  if (g_method == HD_UNWIND_FP || g_method == HD_UNWIND_NONE) return;
  hd_cfi_after_fork_child();
  hd_libunwind_share_no_cache();
}

static int own_frame(uintptr_t ip) { return ip >= g_skip_lo && ip < g_skip_hi; }

/* Thread stack bounds, once per thread. pthread_getattr_np may allocate: under the guard, so
 * those blocks are the library's own and unrecorded. */
static void thread_bounds(void) {
  hd_tls.guard++;
  if (!hd_cfi_thread_stack(&hd_tls.stack_lo, &hd_tls.stack_hi)) {
    hd_tls.stack_lo = hd_tls.stack_hi = 1; /* known to be unknown: nothing is in bounds */
  }
  hd_tls.guard--;
}

bool hd_thread_stack(uintptr_t *lo, uintptr_t *hi) {
  if (hd_tls.stack_hi == 0) thread_bounds();
  *lo = hd_tls.stack_lo;
  *hi = hd_tls.stack_hi;
  return *hi > 1;
}

/* Keeps the frames of a walk past our own, at most g_max of them. */
static unsigned keep_callers(const uint64_t *walked, unsigned got, uint64_t *frames,
                             bool *truncated) {
  unsigned n = 0, i = 0;
  while (i < got && own_frame((uintptr_t)walked[i])) i++;
  for (; i < got && n < g_max; i++) frames[n++] = walked[i];
  *truncated = i < got;
  return n;
}

__attribute__((noinline)) static unsigned capture_fp(uint64_t *frames, bool *truncated) {
  if (hd_tls.stack_hi == 0) thread_bounds();
  uintptr_t lo = hd_tls.stack_lo, hi = hd_tls.stack_hi;
  uintptr_t fp = (uintptr_t)__builtin_frame_address(0);
  unsigned n = 0;
  int skipping = 1;
  /* Each frame must lie inside this thread's stack, be aligned and above the previous one:
   * a garbage rbp (code built without frame pointers, alternate signal stack) ends the walk
   * instead of faulting. */
  while (fp >= lo && fp % 8 == 0 && hi >= 16 && fp <= hi - 16) {
    uintptr_t next = ((const uintptr_t *)fp)[0];
    uintptr_t ret = ((const uintptr_t *)fp)[1];
    if (ret == 0) break;
    if (!(skipping && own_frame(ret))) {
      skipping = 0;
      if (n == g_max) {
        *truncated = true;
        break;
      }
      frames[n++] = ret;
    }
    if (next <= fp) break;
    fp = next;
  }
  return n;
}

__attribute__((noinline)) static unsigned capture_unwind(uint64_t *frames, bool *truncated) {
  /* Room for our own frames (a few) and one past the limit, to tell a cut trace from one that
   * ends exactly there. */
  void *ips[HD_MAX_FRAMES + 17];
  const int saved_errno = errno; /* libunwind's system calls are no business of the program's */
  int got = hd_libunwind_backtrace(ips, (int)(g_max + 17));
  errno = saved_errno;
  /* Before the library's constructor has loaded libunwind (the allocations of the libraries
   * initialised before it): frame pointers. */
  if (got < 0) return capture_fp(frames, truncated);
  uint64_t walked[HD_MAX_FRAMES + 17];
  for (int i = 0; i < got; i++) walked[i] = (uint64_t)(uintptr_t)ips[i];
  return keep_callers(walked, got > 0 ? (unsigned)got : 0, frames, truncated);
}

/* HD_UNWIND_COMPARE's tally: stacks our unwinder left to libunwind, traces compared, found
 * different, reused without a walk, and walks that joined the thread's previous walk. */
static uint64_t g_cfi_fallbacks, g_compared, g_differed, g_reused, g_joined;

/* This thread's recent walks (cfi.h). Only its own thread touches them, and never from a call
 * nested in a hook (a signal handler's): a handler never unwinds while the thread it
 * interrupted does (hd_capture_stack), nor replaces the memo whose key cache the interrupted
 * hook is about to fill (make_info). */
static __thread hd_cfi_memos t_memos __attribute__((tls_model("initial-exec")));
/* The last MiB (address >> 20) found to hold a stack of the program's own, not an alternate
 * signal stack (0: none yet): its next walks skip the sigaltstack call. */
static __thread uintptr_t t_foreign_stack_mib __attribute__((tls_model("initial-exec")));

/* Where the program called into the library: its return address, its stack pointer after the
 * call returns, its rbp. Our own code is built with frame pointers (-fno-omit-frame-pointer in
 * both builds), so from here to the program its frames are a chain of (saved rbp, return
 * address) pairs, followed up to the first return address that is not ours: the walk proper
 * then starts in the program, and our own frames are neither walked nor part of a memo. */
static bool program_call(const hd_cfi_bounds *b, uintptr_t *pc, uintptr_t *sp, uintptr_t *bp) {
  uintptr_t fp = (uintptr_t)__builtin_frame_address(0);
  for (unsigned depth = 0; depth < 32; depth++) {
    if (fp % 8 != 0 || !hd_cfi_in_bounds(b, fp, 16)) return false;
    const uintptr_t saved_bp = ((const uintptr_t *)fp)[0], ret = ((const uintptr_t *)fp)[1];
    if (!own_frame(ret)) {
      *pc = ret;
      *sp = fp + 16;
      *bp = saved_bp;
      return true;
    }
    fp = saved_bp;
  }
  return false;
}

/* A stack the program made itself (a coroutine's, from makecontext or a library of its own):
 * the walk may read from just below sp up to where the memory stops being readable, up to
 * FOREIGN_STACK_PAGES pages; one system call (process_vm_readv of a byte per page, which stops
 * at the first page it cannot read) tells how far that is. Such stacks are freed and remapped
 * as coroutines end, so nothing is kept of them: neither the bounds nor the walk's memos. */
#define FOREIGN_STACK_PAGES 64
static bool foreign_stack_bounds(uintptr_t sp, uintptr_t *lo, uintptr_t *hi) {
  const uintptr_t page = 4096, first = (sp - 128) & ~(page - 1); /* the red zone included */
  struct iovec remote[FOREIGN_STACK_PAGES];
  char bytes[FOREIGN_STACK_PAGES];
  for (unsigned i = 0; i < FOREIGN_STACK_PAGES; i++) {
    remote[i] = (struct iovec){(void *)(first + i * page), 1};
  }
  struct iovec local = {bytes, sizeof bytes};
  const long self = hd_raw_syscall6(SYS_getpid, 0, 0, 0, 0, 0, 0);
  const long got = hd_raw_syscall6(SYS_process_vm_readv, self, (long)&local, 1, (long)remote,
                                   FOREIGN_STACK_PAGES, 0);
  if (got <= 0) return false;
  *lo = first;
  *hi = first + (uintptr_t)got * page;
  return true;
}

/* How much of a stack our unwinder described. */
typedef enum cfi_capture {
  CFI_NONE,             /* nothing: the stack could not even be entered */
  CFI_PARTIAL,          /* the frames up to one it could not describe */
  CFI_BY_FRAME_POINTER, /* whole, a frame without call-frame information stepped by rbp */
  CFI_WHOLE,            /* whole, by call-frame information */
} cfi_capture;

/* Our unwinder. */
__attribute__((noinline)) static cfi_capture capture_cfi(uint64_t *frames, unsigned *n,
                                                         bool *truncated, bool in_signal_handler,
                                                         uint32_t **key_cache) {
  if (hd_tls.stack_hi == 0) thread_bounds();
  hd_cfi_bounds bounds = {.lo = {hd_tls.stack_lo}, .hi = {hd_tls.stack_hi}, .count = 1};
  const uintptr_t sp = (uintptr_t)__builtin_frame_address(0);
  bool remembered = !in_signal_handler;
  if (sp < bounds.lo[0] || sp >= bounds.hi[0]) {
    /* Not on the thread's stack: a handler on an alternate signal stack (a system call, but
     * only here), else a stack the program made itself. */
    stack_t alt;
    if ((sp >> 20) != t_foreign_stack_mib && sigaltstack(NULL, &alt) == 0 &&
        (alt.ss_flags & SS_ONSTACK) && sp >= (uintptr_t)alt.ss_sp &&
        sp < (uintptr_t)alt.ss_sp + alt.ss_size) {
      bounds.lo[1] = (uintptr_t)alt.ss_sp;
      bounds.hi[1] = (uintptr_t)alt.ss_sp + alt.ss_size;
      bounds.count = 2;
    } else {
      t_foreign_stack_mib = sp >> 20;
      if (!foreign_stack_bounds(sp, &bounds.lo[0], &bounds.hi[0])) return CFI_NONE;
      remembered = false;
    }
  }
  uintptr_t pc, caller_sp, caller_bp;
  if (!program_call(&bounds, &pc, &caller_sp, &caller_bp)) return CFI_NONE;
  uint64_t walked[HD_MAX_FRAMES + 1];
  unsigned got;
  bool reused, joined, by_frame_pointer;
  uint32_t *memo_key;
  const hd_cfi_end end = hd_cfi_backtrace(&bounds, pc, caller_sp, caller_bp, !in_signal_handler,
                                          walked, g_max + 1, &got, remembered ? &t_memos : NULL,
                                          &reused, &joined, &by_frame_pointer, &memo_key);
  if (key_cache != NULL) *key_cache = memo_key;
  if (g_method == HD_UNWIND_COMPARE) {
    if (reused) __atomic_fetch_add(&g_reused, 1, __ATOMIC_RELAXED);
    if (joined) __atomic_fetch_add(&g_joined, 1, __ATOMIC_RELAXED);
  }
  *n = keep_callers(walked, got, frames, truncated);
  if (end == HD_CFI_UNSUPPORTED) return CFI_PARTIAL;
  return by_frame_pointer ? CFI_BY_FRAME_POINTER : CFI_WHOLE;
}

static void write_trace(char *line, size_t size, const char *who, const uint64_t *frames,
                        unsigned n) {
  size_t used = (size_t)snprintf(line, size, "heapdump: %s:", who);
  for (unsigned i = 0; i < n && used < size; i++) {
    used += (size_t)snprintf(line + used, size - used, " %#" PRIx64, frames[i]);
  }
  if (used >= size) used = size - 1;
  line[used] = '\n';
  (void)!write(STDERR_FILENO, line, used + 1);
}

/* libunwind's trace (recorded) against ours; the first few differences are printed. Stacks ours
 * could not describe to their end are left to libunwind; those it stepped by frame pointers are
 * compared like the rest. */
static unsigned capture_compared(uint64_t *frames, bool *truncated, bool in_signal_handler) {
  const unsigned n = capture_unwind(frames, truncated);
  uint64_t ours[HD_MAX_FRAMES];
  unsigned m;
  bool ours_truncated;
  const cfi_capture got = capture_cfi(ours, &m, &ours_truncated, in_signal_handler, NULL);
  if (got != CFI_WHOLE) hd_count_beyond_cfi();
  if (got == CFI_NONE || got == CFI_PARTIAL) {
    if (__atomic_fetch_add(&g_cfi_fallbacks, 1, __ATOMIC_RELAXED) < 5) {
      char line[HD_MAX_FRAMES * 20 + 64];
      write_trace(line, sizeof line, "left to libunwind", frames, n);
    }
    return n;
  }
  __atomic_fetch_add(&g_compared, 1, __ATOMIC_RELAXED);
  if (m == n && memcmp(ours, frames, n * sizeof *frames) == 0) return n;
  if (__atomic_fetch_add(&g_differed, 1, __ATOMIC_RELAXED) < 5) {
    char line[HD_MAX_FRAMES * 20 + 64];
    write_trace(line, sizeof line, "libunwind", frames, n);
    write_trace(line, sizeof line, "cfi", ours, m);
  }
  return n;
}

/* HD_UNWIND_COMPARE's verdict, when the program exits. */
__attribute__((destructor)) static void report_comparison(void) {
  if (g_method != HD_UNWIND_COMPARE) return;
  char line[200];
  const int n = snprintf(
      line, sizeof line,
      "heapdump: unwinders compared on %" PRIu64 " stacks: %" PRIu64 " differ; %" PRIu64
      " left to libunwind; %" PRIu64 " reused; %" PRIu64 " joined an earlier walk\n",
      __atomic_load_n(&g_compared, __ATOMIC_RELAXED),
      __atomic_load_n(&g_differed, __ATOMIC_RELAXED),
      __atomic_load_n(&g_cfi_fallbacks, __ATOMIC_RELAXED),
      __atomic_load_n(&g_reused, __ATOMIC_RELAXED), __atomic_load_n(&g_joined, __ATOMIC_RELAXED));
  (void)!write(STDERR_FILENO, line, (size_t)n);
}

static unsigned capture(uint64_t *frames, bool *truncated, bool in_signal_handler,
                        uint32_t **key_cache) {
  unsigned n;
  switch (g_method) {
    case HD_UNWIND_FP: return capture_fp(frames, truncated);
    case HD_UNWIND_CFI: {
      const cfi_capture got = capture_cfi(frames, &n, truncated, in_signal_handler, key_cache);
      if (got != CFI_WHOLE) hd_count_beyond_cfi();
      return got == CFI_NONE ? 0 : n;
    }
    case HD_UNWIND_COMPARE: return capture_compared(frames, truncated, in_signal_handler);
    case HD_UNWIND_LIBUNWIND: return capture_unwind(frames, truncated);
    default: return 0; /* not configured */
  }
}

unsigned hd_capture_stack(uint64_t *frames, bool in_signal_handler, bool *truncated,
                          uint32_t **key_cache) {
  *truncated = false;
  if (key_cache != NULL) *key_cache = NULL;
  /* A handler that interrupted a capture must not re-enter the unwinder (its per-thread cache is
   * mid-update), nor compute stack bounds (pthread_getattr_np is not async-signal-safe). */
  if (in_signal_handler &&
      (hd_tls.in_unwind || (g_method != HD_UNWIND_LIBUNWIND && hd_tls.stack_hi == 0)))
    return 0;
  hd_tls.in_unwind++;
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  unsigned n = capture(frames, truncated, in_signal_handler, key_cache);
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  hd_tls.in_unwind--;
  return n;
}
