/* The helper thread that commits the tables' pages ahead of the allocating threads
 * (precommit.h says why and when). */
#define _GNU_SOURCE
#include "precommit.h"

#include <errno.h>
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

#define PAGE_BYTES 4096u
/* Areas are asked for in steps of this many bytes, and populated at most this much at a time,
 * so that one area's burst does not keep the others waiting. */
#define WANT_GRAIN ((uint64_t)64 << 10)
#define POPULATE_STEP ((uint64_t)256 << 10)
/* Below this size of an area the faults are few: a small program never gets a helper. */
#define START_AFTER ((uint64_t)1 << 20)
/* An area that is never asked for again: the hot path's compare always passes. */
#define NEVER ((uint64_t)1 << 62)
#define HELPER_STACK_BYTES ((size_t)32 << 10)

enum { IDLE = 0, RUNNING = 1, OFF = 2 };

static struct {
  hd_precommit_area *areas[HD_PRECOMMIT_AREAS];
  unsigned area_count;
  int state;          /* atomic: IDLE (none yet), RUNNING, OFF (disabled, or it failed) */
  int holds;          /* atomic: callers that need the process single-threaded for now */
  uint32_t wake_seq;  /* atomic: bumped by writers with new wishes; the helper sleeps on it */
  uint32_t sleeping;  /* atomic: the helper is (about to be) asleep on wake_seq */
  uint32_t stop;      /* atomic: the helper should exit */
  int helper_tid;     /* set by the kernel at clone, cleared (and woken) when the helper exits */
  uint8_t *stack;     /* the helper's stack mapping, kept for the next helper */
} g;

/* The helper's thread pointer: it must not share the TCB of the thread that cloned it, which may
 * exit and free it. Nothing the helper runs reads thread-local storage; this only keeps an
 * accidental read (a stack-protector canary) inside memory that stays. */
static struct {
  void *self;
  uint64_t words[31];
} __attribute__((aligned(64))) g_helper_tcb;

static bool sys_failed(long rc) { return rc < 0 && rc > -4096; }

static void futex_wait(uint32_t *word, uint32_t expected) {
  hd_raw_syscall6(SYS_futex, (long)word, FUTEX_WAIT_PRIVATE, expected, 0, 0, 0);
}

static void futex_wake(uint32_t *word) {
  hd_raw_syscall6(SYS_futex, (long)word, FUTEX_WAKE_PRIVATE, 1, 0, 0, 0);
}

/* Waits until the thread whose id is in *tid_word has left the thread group. The kernel clears
 * the word (CLONE_CHILD_CLEARTID, a shared futex's wake-up) while the thread exits, but the
 * thread stays in the group a little longer, and a call that needs the process single-threaded
 * would still fail then: the thread is gone when its /proc/self/task entry is (both leave in
 * one step of the exit). Bounded to a second, in case /proc is something else. */
static void wait_until_gone(int *tid_word) {
  const int tid = __atomic_load_n(tid_word, __ATOMIC_ACQUIRE);
  for (int t; (t = __atomic_load_n(tid_word, __ATOMIC_ACQUIRE)) != 0;)
    hd_raw_syscall6(SYS_futex, (long)tid_word, FUTEX_WAIT, t, 0, 0, 0);
  if (tid == 0) return;
  char path[32] = "/proc/self/task/", digits[12];
  int n = 0, len = 16;
  for (unsigned v = (unsigned)tid; v != 0; v /= 10) digits[n++] = (char)('0' + v % 10);
  while (n > 0) path[len++] = digits[--n];
  path[len] = 0;
  const struct timespec pause = {0, 50000};
  for (int i = 0; i < 20000 && hd_raw_syscall6(SYS_access, (long)path, F_OK, 0, 0, 0, 0) == 0; i++)
    hd_raw_syscall6(SYS_nanosleep, (long)&pause, 0, 0, 0, 0, 0);
}

static void give_up(void) {
  __atomic_store_n(&g.state, OFF, __ATOMIC_RELEASE);
  for (unsigned i = 0; i < g.area_count; i++)
    __atomic_store_n(&g.areas[i]->committed, NEVER, __ATOMIC_RELAXED);
}

/* One step of work: true if something was populated. */
static bool populate_some(void) {
  bool worked = false;
  for (unsigned i = 0; i < __atomic_load_n(&g.area_count, __ATOMIC_ACQUIRE); i++) {
    hd_precommit_area *a = g.areas[i];
    uint64_t done = __atomic_load_n(&a->committed, __ATOMIC_RELAXED);
    uint64_t want = __atomic_load_n(&a->wanted, __ATOMIC_RELAXED);
    if (want <= done || done >= NEVER) continue;
    uint64_t n = want - done < POPULATE_STEP ? want - done : POPULATE_STEP;
    long rc = hd_raw_syscall6(SYS_madvise, (long)(a->base + done), (long)n, MADV_POPULATE_WRITE,
                              0, 0, 0);
    if (rc == -EINTR || rc == -EAGAIN) return true; /* try again */
    if (sys_failed(rc)) {                           /* old kernel, or memory short */
      give_up();
      return false;
    }
    __atomic_store_n(&a->committed, done + n, __ATOMIC_RELAXED);
    worked = true;
  }
  return worked;
}

/* The helper's whole life: system calls only (see g_helper_tcb). */
static void helper_main(void) {
  static const char name[16] = "heapdump-commit";
  hd_raw_syscall6(SYS_prctl, PR_SET_NAME, (long)name, 0, 0, 0, 0);
  for (;;) {
    uint32_t seen = __atomic_load_n(&g.wake_seq, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&g.stop, __ATOMIC_ACQUIRE)) return;
    if (__atomic_load_n(&g.state, __ATOMIC_ACQUIRE) == OFF) return;
    if (populate_some()) continue;
    /* Paired with the writer's bump of wake_seq then read of sleeping: one of the two sees the
     * other, so a wish is never left asleep. */
    __atomic_store_n(&g.sleeping, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&g.wake_seq, __ATOMIC_SEQ_CST) == seen && !__atomic_load_n(&g.stop, __ATOMIC_SEQ_CST))
      futex_wait(&g.wake_seq, seen);
    __atomic_store_n(&g.sleeping, 0, __ATOMIC_RELAXED);
  }
}

/* clone(2) itself, not glibc's: the child starts on its own stack with its own thread pointer,
 * calls helper_main and leaves with exit(2), touching nothing of the parent's. */
static long clone_helper(void) {
  const long flags = CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD |
                     CLONE_SYSVSEM | CLONE_SETTLS | CLONE_PARENT_SETTID | CLONE_CHILD_CLEARTID;
  g_helper_tcb.self = &g_helper_tcb;
  uint8_t *stack_top = g.stack + HELPER_STACK_BYTES; /* 16-byte aligned (page end) */
  register long r10 __asm__("r10") = (long)&g.helper_tid; /* child_tid */
  register long r8 __asm__("r8") = (long)&g_helper_tcb;   /* tls */
  register long r9 __asm__("r9") = (long)helper_main;     /* kept across the call in the child */
  long ret;
  __asm__ volatile(
      "syscall\n\t"
      "test %%rax, %%rax\n\t"
      "jnz 1f\n\t"
      "xor %%ebp, %%ebp\n\t" /* the outermost frame, for any unwinder */
      "call *%%r9\n\t"
      "mov %[exit], %%eax\n\t"
      "xor %%edi, %%edi\n\t"
      "syscall\n\t"
      "hlt\n\t"
      "1:\n\t"
      : "=a"(ret)
      : "a"((long)SYS_clone), "D"(flags), "S"(stack_top), "d"(&g.helper_tid), "r"(r10),
        "r"(r8), "r"(r9), [exit] "i"(SYS_exit)
      : "rcx", "r11", "memory");
  return ret;
}

static void start_helper(void) {
  int idle = IDLE;
  if (!__atomic_compare_exchange_n(&g.state, &idle, RUNNING, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_RELAXED))
    return;
  if (g.stack == NULL) {
    long m = hd_raw_syscall6(SYS_mmap, 0, (long)HELPER_STACK_BYTES, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (sys_failed(m)) {
      give_up();
      return;
    }
    g.stack = (uint8_t *)m;
  }
  __atomic_store_n(&g.stop, 0, __ATOMIC_RELAXED);
  /* The helper starts with every signal blocked (a clone inherits the mask), so none of the
   * program's signals is ever delivered to it. */
  uint64_t all = ~(uint64_t)0, old = 0;
  hd_raw_syscall6(SYS_rt_sigprocmask, SIG_SETMASK, (long)&all, (long)&old, 8, 0, 0);
  long tid = clone_helper();
  hd_raw_syscall6(SYS_rt_sigprocmask, SIG_SETMASK, (long)&old, 0, 8, 0, 0);
  if (sys_failed(tid)) give_up(); /* a sandbox that refuses clone, say */
}

void hd_precommit_want(hd_precommit_area *a, uint64_t target) {
  if (a->base == NULL) return; /* a private copy of a table */
  int state = __atomic_load_n(&g.state, __ATOMIC_ACQUIRE);
  if (state == OFF) return;
  target = (target + WANT_GRAIN - 1) & ~(WANT_GRAIN - 1);
  if (target > a->size) target = a->size & ~(uint64_t)(PAGE_BYTES - 1);
  uint64_t want = __atomic_load_n(&a->wanted, __ATOMIC_RELAXED);
  do {
    if (target <= want) return;
  } while (!__atomic_compare_exchange_n(&a->wanted, &want, target, true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED));
  if (state == IDLE) {
    if (target < START_AFTER || __atomic_load_n(&g.holds, __ATOMIC_ACQUIRE) != 0) return;
    start_helper();
    return;
  }
  __atomic_fetch_add(&g.wake_seq, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&g.sleeping, __ATOMIC_SEQ_CST)) futex_wake(&g.wake_seq);
}

void hd_precommit_area_init(hd_precommit_area *a, void *base, uint64_t size) {
  a->base = base;
  a->size = size;
  a->wanted = 0;
  a->committed = __atomic_load_n(&g.state, __ATOMIC_ACQUIRE) == OFF ? NEVER : 0;
  for (unsigned i = 0; i < g.area_count; i++)
    if (g.areas[i] == a) return;
  if (g.area_count == HD_PRECOMMIT_AREAS) {
    a->committed = NEVER;
    return;
  }
  g.areas[g.area_count] = a;
  __atomic_store_n(&g.area_count, g.area_count + 1, __ATOMIC_RELEASE);
}

void hd_precommit_enable(bool on) {
  if (!on) give_up();
}

void hd_precommit_hold(void) {
  __atomic_fetch_add(&g.holds, 1, __ATOMIC_ACQ_REL);
  int running = RUNNING;
  if (!__atomic_compare_exchange_n(&g.state, &running, IDLE, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_RELAXED))
    return;
  __atomic_store_n(&g.stop, 1, __ATOMIC_SEQ_CST);
  __atomic_fetch_add(&g.wake_seq, 1, __ATOMIC_SEQ_CST);
  futex_wake(&g.wake_seq);
  wait_until_gone(&g.helper_tid);
}

void hd_precommit_release(void) { __atomic_fetch_sub(&g.holds, 1, __ATOMIC_ACQ_REL); }

void hd_precommit_after_fork_child(void) {
  /* Only the forking thread exists in the child: the parent's helper is not there. */
  if (__atomic_load_n(&g.state, __ATOMIC_RELAXED) == RUNNING) g.state = IDLE;
  g.helper_tid = 0;
  g.sleeping = 0;
  g.stop = 0;
}

bool hd_precommit_running(void) {
  return __atomic_load_n(&g.state, __ATOMIC_ACQUIRE) == RUNNING;
}
