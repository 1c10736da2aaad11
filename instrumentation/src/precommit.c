/* The helper thread that commits the tables' pages ahead of the allocating threads
 * (precommit.h says why and when).
 *
 * States: IDLE (no helper), STARTING (a writer is cloning one, until the helper itself says it
 * runs), RUNNING (it works), EXITING (it found nothing more to do and is leaving, or has left),
 * OFF (never again). The helper's thread id is written by the kernel at the clone and cleared
 * when the thread is gone (CLONE_*_TID): "helper_tid == 0" is what lets the next helper reuse
 * the one stack, and nothing but the kernel (and a fork child's reset) ever clears it. The
 * thread stays in the thread group a moment after that; `last_tid` keeps its id for those who
 * must wait until it has left. Starting and holding meet Dekker-style: a starter moves to
 * STARTING then reads `holds`; hold() raises `holds` then reads the state; both sequentially
 * consistent, so one of them sees the other. Only the process that cloned the helper
 * (`owner`) acts on it: a vfork child shares this memory but not the helper's thread group.
 * Built without sanitizers: their instrumentation would read the thread pointer, which the
 * helper does not share with the runtime. */
#define _GNU_SOURCE
#include "precommit.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "raw_syscall.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

#define PAGE_BYTES ((uint64_t)4096)
/* Areas are asked for in steps of this many bytes, and populated at most this much at a time,
 * so that one area's burst does not keep the others waiting. */
#define WANT_GRAIN ((uint64_t)64 << 10)
#define POPULATE_STEP ((uint64_t)256 << 10)
/* An area that never asks again: the hot path's compare always passes. */
#define NEVER ((uint64_t)1 << 62)
#define HELPER_STACK_BYTES ((uint64_t)32 << 10)
/* Interrupted populates retried in a row before the helper gives up for good. */
#define MAX_RETRIES 64

enum { IDLE = 0, STARTING, RUNNING, EXITING, OFF };

static struct {
  hd_precommit_area *areas[HD_PRECOMMIT_AREAS];
  unsigned area_count;
  int state;      /* atomic, see above */
  int holds;      /* atomic: callers that need no helper until they release */
  int stop;       /* atomic: the helper should leave now */
  int helper_tid; /* see above */
  int last_tid;   /* the last helper's id, until it is known to have left the process */
  int owner;      /* process id of the process whose helper this is */
  uint8_t *stack; /* the helper's stack (between two guard pages), reused by the next */
} g;

/* The helper's thread pointer: it must not be the TCB of the thread that cloned it, which may
 * exit and free it. Nothing the helper runs reads thread-local storage; this only keeps an
 * accidental read (a stack-protector canary) inside memory that stays. */
static struct {
  void *self;
  uint64_t words[31];
} __attribute__((aligned(64))) g_helper_tcb;

static bool sys_failed(long rc) { return rc < 0 && rc > -4096; }

static void pause_us(long us) {
  const struct timespec t = {0, us * 1000};
  hd_raw_syscall6(SYS_nanosleep, (long)&t, 0, 0, 0, 0, 0);
}

static void give_up(void) {
  __atomic_store_n(&g.state, OFF, __ATOMIC_SEQ_CST);
  for (unsigned i = 0; i < __atomic_load_n(&g.area_count, __ATOMIC_ACQUIRE); i++)
    __atomic_store_n(&g.areas[i]->ask_at, NEVER, __ATOMIC_RELAXED);
}

static bool work_left(void) {
  for (unsigned i = 0; i < __atomic_load_n(&g.area_count, __ATOMIC_ACQUIRE); i++) {
    hd_precommit_area *a = g.areas[i];
    if (__atomic_load_n(&a->wanted, __ATOMIC_SEQ_CST) > __atomic_load_n(&a->committed, __ATOMIC_RELAXED))
      return true;
  }
  return false;
}

/* One step over every area: false when there was nothing to do, or the helper gave up. */
static bool populate_some(int *retries) {
  bool worked = false;
  for (unsigned i = 0; i < __atomic_load_n(&g.area_count, __ATOMIC_ACQUIRE); i++) {
    hd_precommit_area *a = g.areas[i];
    uint64_t done = __atomic_load_n(&a->committed, __ATOMIC_RELAXED);
    uint64_t want = __atomic_load_n(&a->wanted, __ATOMIC_RELAXED);
    if (want <= done || a->base == NULL) continue;
    uint64_t n = want - done < POPULATE_STEP ? want - done : POPULATE_STEP;
    long rc = hd_raw_syscall6(SYS_madvise, (long)(a->base + done), (long)n, MADV_POPULATE_WRITE,
                              0, 0, 0);
    if (rc == -EINTR || rc == -EAGAIN) {
      if (++*retries <= MAX_RETRIES) return true;
    }
    if (sys_failed(rc)) { /* an old kernel, memory short, or no end to interruptions */
      give_up();
      return false;
    }
    *retries = 0;
    __atomic_store_n(&a->committed, done + n, __ATOMIC_RELEASE);
    uint64_t ask = done + n - HD_PRECOMMIT_SLACK;
    if (done + n > HD_PRECOMMIT_SLACK && ask > __atomic_load_n(&a->ask_at, __ATOMIC_RELAXED))
      __atomic_store_n(&a->ask_at, ask, __ATOMIC_RELAXED);
    worked = true;
  }
  return worked;
}

/* Leaves the RUNNING (or still STARTING) state for EXITING; false if the state is OFF. */
static bool mark_exiting(void) {
  for (;;) {
    int s = __atomic_load_n(&g.state, __ATOMIC_SEQ_CST);
    if (s == OFF) return false;
    if (__atomic_compare_exchange_n(&g.state, &s, EXITING, false, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST))
      return true;
  }
}

/* The helper's whole life: system calls only (see g_helper_tcb). */
static void helper_main(void) {
  /* First, before any system call (one a seccomp filter could kill it for): a hold waits for
   * STARTING to end. */
  int starting = STARTING;
  __atomic_compare_exchange_n(&g.state, &starting, RUNNING, false, __ATOMIC_SEQ_CST,
                              __ATOMIC_SEQ_CST);
  static const char name[16] = "heapdump-commit";
  hd_raw_syscall6(SYS_prctl, PR_SET_NAME, (long)name, 0, 0, 0, 0);
  int retries = 0;
  for (;;) {
    if (__atomic_load_n(&g.stop, __ATOMIC_SEQ_CST)) break;
    if (populate_some(&retries)) continue;
    if (!mark_exiting()) break;
    /* A writer that asked while we were RUNNING started nobody: look once more. */
    int exiting = EXITING;
    if (!work_left() || __atomic_load_n(&g.stop, __ATOMIC_SEQ_CST) ||
        !__atomic_compare_exchange_n(&g.state, &exiting, RUNNING, false, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST))
      return;
  }
  mark_exiting();
}

/* clone(2) itself, not glibc's: the child starts on its own stack with its own thread pointer,
 * calls helper_main and leaves with exit(2), touching nothing of the parent's. Its code says
 * to unwinders that it is the outermost frame. */
static long clone_helper(void) {
  const long flags = CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD |
                     CLONE_SYSVSEM | CLONE_SETTLS | CLONE_PARENT_SETTID | CLONE_CHILD_CLEARTID;
  g_helper_tcb.self = &g_helper_tcb;
  uint8_t *stack_top = g.stack + HELPER_STACK_BYTES; /* 16-byte aligned (a page's end) */
  register long r10 __asm__("r10") = (long)&g.helper_tid; /* child_tid: cleared at its exit */
  register long r8 __asm__("r8") = (long)&g_helper_tcb;   /* tls */
  register long r9 __asm__("r9") = (long)helper_main;     /* kept across the call in the child */
  long ret;
  __asm__ volatile(
      "syscall\n\t"
      "test %%rax, %%rax\n\t"
      "jnz 1f\n\t"
      ".cfi_remember_state\n\t"
      ".cfi_undefined rip\n\t"
      "xor %%ebp, %%ebp\n\t"
      "call *%%r9\n\t"
      "mov %[exit], %%eax\n\t"
      "xor %%edi, %%edi\n\t"
      "syscall\n\t"
      "hlt\n\t"
      ".cfi_restore_state\n\t"
      "1:\n\t"
      : "=a"(ret)
      : "a"((long)SYS_clone), "D"(flags), "S"(stack_top), "d"(&g.last_tid), "r"(r10),
        "r"(r8), "r"(r9), [exit] "i"(SYS_exit)
      : "rcx", "r11", "memory");
  return ret;
}

/* The stack between two inaccessible pages, so that it never merges with a neighbouring
 * mapping (which would make the mapping at its stack pointer look bigger than it is). */
static bool map_stack(void) {
  if (g.stack != NULL) return true;
  const uint64_t total = HELPER_STACK_BYTES + 2 * PAGE_BYTES;
  long m = hd_raw_syscall6(SYS_mmap, 0, (long)total, PROT_NONE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (sys_failed(m)) return false;
  if (sys_failed(hd_raw_syscall6(SYS_mprotect, m + (long)PAGE_BYTES, (long)HELPER_STACK_BYTES,
                                 PROT_READ | PROT_WRITE, 0, 0, 0))) {
    hd_raw_syscall6(SYS_munmap, m, (long)total, 0, 0, 0, 0);
    return false;
  }
  g.stack = (uint8_t *)m + PAGE_BYTES;
  return true;
}

static int own_pid(void) { return (int)hd_raw_syscall6(SYS_getpid, 0, 0, 0, 0, 0, 0); }

static void start_helper(void) {
  int s = __atomic_load_n(&g.state, __ATOMIC_SEQ_CST);
  if ((s != IDLE && s != EXITING) || __atomic_load_n(&g.helper_tid, __ATOMIC_ACQUIRE) != 0 ||
      __atomic_load_n(&g.holds, __ATOMIC_SEQ_CST) != 0)
    return; /* the cheap answers first: no system call */
  /* Signals blocked from here: a handler of this thread calling hold() must never find the
   * state STARTING on account of this very thread. The helper inherits the mask: none of the
   * program's signals is ever delivered to it. */
  uint64_t all = ~(uint64_t)0, old = 0;
  hd_raw_syscall6(SYS_rt_sigprocmask, SIG_SETMASK, (long)&all, (long)&old, 8, 0, 0);
  if (__atomic_compare_exchange_n(&g.state, &s, STARTING, false, __ATOMIC_SEQ_CST,
                                  __ATOMIC_SEQ_CST)) {
    if (__atomic_load_n(&g.helper_tid, __ATOMIC_ACQUIRE) != 0) {
      /* Between our look and the claim, another helper came and is now leaving: it is still
       * on the stack. */
      __atomic_store_n(&g.state, EXITING, __ATOMIC_SEQ_CST);
    } else if (__atomic_load_n(&g.holds, __ATOMIC_SEQ_CST) != 0) {
      __atomic_store_n(&g.state, s, __ATOMIC_SEQ_CST);
    } else if (!map_stack()) {
      give_up();
    } else {
      __atomic_store_n(&g.stop, 0, __ATOMIC_SEQ_CST);
      g.owner = own_pid();
      /* Not zero from before the clone until the kernel clears it at the helper's exit; the
       * kernel writes the id into last_tid before the clone returns. */
      __atomic_store_n(&g.helper_tid, -1, __ATOMIC_SEQ_CST);
      long tid = clone_helper(); /* the helper moves STARTING to RUNNING itself */
      if (sys_failed(tid)) { /* a sandbox that refuses clone, say */
        __atomic_store_n(&g.helper_tid, 0, __ATOMIC_SEQ_CST);
        give_up();
      }
    }
  }
  hd_raw_syscall6(SYS_rt_sigprocmask, SIG_SETMASK, (long)&old, 0, 8, 0, 0);
}

void hd_precommit_want(hd_precommit_area *a, uint64_t target) {
  if (a->base == NULL) return; /* a private copy of a table */
  int state = __atomic_load_n(&g.state, __ATOMIC_SEQ_CST);
  if (state == OFF) return;
  target = (target + WANT_GRAIN - 1) & ~(WANT_GRAIN - 1);
  if (target > a->size) target = a->size & ~(PAGE_BYTES - 1);
  uint64_t want = __atomic_load_n(&a->wanted, __ATOMIC_RELAXED);
  while (want < target && !__atomic_compare_exchange_n(&a->wanted, &want, target, true,
                                                       __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
  /* Read after the wish is stored: a helper that is leaving stores EXITING before it looks at
   * the wishes once more, so either it sees this one or this sees EXITING (and starts the next
   * helper, here or at the writer's next call once the last one is gone). */
  state = __atomic_load_n(&g.state, __ATOMIC_SEQ_CST);
  if (target < HD_PRECOMMIT_START_AFTER || state == RUNNING || state == STARTING) return;
  if (__atomic_load_n(&a->committed, __ATOMIC_RELAXED) >= target) return;
  start_helper();
}

static void task_path(char path[32], int tid) {
  static const char prefix[] = "/proc/self/task/";
  char digits[12];
  int n = 0, len = (int)sizeof prefix - 1;
  for (int i = 0; i < len; i++) path[i] = prefix[i];
  for (unsigned v = (unsigned)tid; v != 0; v /= 10) digits[n++] = (char)('0' + v % 10);
  while (n > 0) path[len++] = digits[--n];
  path[len] = 0;
}

static bool listed(const char *path) {
  return hd_raw_syscall6(SYS_access, (long)path, F_OK, 0, 0, 0, 0) == 0;
}

/* Waits until the last helper has left the process: the kernel clears helper_tid (a shared
 * futex's wake-up) as the thread exits, which no time limit may cut short, since the next
 * helper would share its stack. The thread stays in the thread group a moment longer, and a
 * call that needs the process single-threaded would still fail then: it has left when its
 * /proc/self/task entry has (both leave in one step of the exit). That is only asked of a /proc
 * that lists this very thread (not one of another pid namespace), and for a second at most. */
static void wait_until_gone(void) {
  for (int t; (t = __atomic_load_n(&g.helper_tid, __ATOMIC_ACQUIRE)) != 0;)
    hd_raw_syscall6(SYS_futex, (long)&g.helper_tid, FUTEX_WAIT, t, 0, 0, 0);
  const int last = __atomic_load_n(&g.last_tid, __ATOMIC_ACQUIRE);
  if (last == 0) return;
  char self[32], path[32];
  task_path(self, (int)hd_raw_syscall6(SYS_gettid, 0, 0, 0, 0, 0, 0));
  if (!listed(self)) return;
  task_path(path, last);
  for (int i = 0; i < 20000 && listed(path); i++) pause_us(50);
  if (!listed(path)) __atomic_store_n(&g.last_tid, 0, __ATOMIC_SEQ_CST);
}

bool hd_precommit_hold(void) {
  /* A process sharing this memory without the helper's thread group (a vfork child) neither
   * has the helper among its threads nor may stop it for the process that does. */
  if (g.owner != 0 && g.owner != own_pid()) return false;
  __atomic_fetch_add(&g.holds, 1, __ATOMIC_SEQ_CST);
  /* A starter that moved to STARTING before `holds` rose goes on to clone, and its helper
   * moves on to RUNNING: wait for that (a few system calls, with signals blocked). */
  while (__atomic_load_n(&g.state, __ATOMIC_SEQ_CST) == STARTING) pause_us(20);
  __atomic_store_n(&g.stop, 1, __ATOMIC_SEQ_CST);
  wait_until_gone();
  int s = __atomic_load_n(&g.state, __ATOMIC_SEQ_CST);
  while (s != OFF && s != IDLE &&
         !__atomic_compare_exchange_n(&g.state, &s, IDLE, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  /* True while a helper may still count as a thread: its exit could not be confirmed. */
  return __atomic_load_n(&g.last_tid, __ATOMIC_SEQ_CST) != 0;
}

void hd_precommit_release(void) {
  if (g.owner != 0 && g.owner != own_pid()) return;
  __atomic_fetch_sub(&g.holds, 1, __ATOMIC_SEQ_CST);
}

void hd_precommit_area_init(hd_precommit_area *a, void *base, uint64_t size) {
  a->base = base;
  a->size = size;
  a->wanted = 0;
  a->committed = 0;
  a->ask_at = g.state == OFF ? NEVER : HD_PRECOMMIT_START_AFTER - HD_PRECOMMIT_AHEAD;
  for (unsigned i = 0; i < g.area_count; i++)
    if (g.areas[i] == a) return;
  if (g.area_count == HD_PRECOMMIT_AREAS) {
    a->ask_at = NEVER;
    return;
  }
  g.areas[g.area_count] = a;
  __atomic_store_n(&g.area_count, g.area_count + 1, __ATOMIC_RELEASE);
}

void hd_precommit_enable(bool on) {
  if (!on) give_up();
}

void hd_precommit_after_fork_child(void) {
  if (g.state != OFF) g.state = IDLE;
  g.helper_tid = 0;
  g.last_tid = 0;
  g.owner = 0;
  g.holds = 0;
  g.stop = 0;
}

bool hd_precommit_running(void) { return __atomic_load_n(&g.helper_tid, __ATOMIC_ACQUIRE) != 0; }
