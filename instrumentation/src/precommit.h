/* Committing the tables' pages ahead of the allocating threads.
 *
 * The tables grow into a sparse memfd, and the first write to each new page is a page fault
 * (about 2 µs here, allocating and zeroing the page) taken by whichever thread allocated. A
 * helper thread instead populates the pages ahead of where the writers are
 * (MADV_POPULATE_WRITE on the shared mapping, which fills the page tables of every thread), so
 * the writers find them present. Writers only say how far they have got; the hot path is one
 * load and a compare, and a wake-up (one futex call) happens at most once per kPrecommitAhead
 * bytes of growth of an area, and only while the helper sleeps.
 *
 * The helper is not a pthread: it is cloned raw, with its own small stack and thread pointer,
 * all signals blocked, and runs nothing but system calls. So glibc and libstdc++ still see a
 * single-threaded process (their fast paths stay on), and no program signal lands on it. It is
 * started only once a table area has grown past kPrecommitStartAfter (small programs never get
 * one), stopped around the calls that need a single-threaded process (unshare and setns into a
 * user namespace), and started again on demand in a fork child. Without it (HEAPDUMP_PRECOMMIT=0,
 * a clone refused by a sandbox, a kernel before 5.14 without MADV_POPULATE_WRITE, other
 * architectures than x86-64) the writers take the faults themselves, as before. */
#ifndef HEAPDUMP_INSTRUMENTATION_PRECOMMIT_H
#define HEAPDUMP_INSTRUMENTATION_PRECOMMIT_H

#include <stdbool.h>
#include <stdint.h>

/* An area of a table's mapping that grows from its start. */
typedef struct hd_precommit_area {
  uint8_t *base;
  uint64_t size;
  uint64_t committed; /* atomic; written by the helper: [base, base + committed) is populated */
  uint64_t wanted;    /* atomic; raised by writers: how far the helper should populate */
} hd_precommit_area;

/* How far ahead of a writer the helper keeps an area committed, and how close a writer may
 * come to the committed end before it asks for more. */
#define HD_PRECOMMIT_AHEAD ((uint64_t)512 << 10)
#define HD_PRECOMMIT_SLACK ((uint64_t)256 << 10)

/* Asks for the area to be committed up to `target` bytes from its start. */
void hd_precommit_want(hd_precommit_area *a, uint64_t target);

/* A writer is about to use the area up to `end` bytes from its start. */
static inline void hd_precommit_need(hd_precommit_area *a, uint64_t end) {
  if (__builtin_expect(end + HD_PRECOMMIT_SLACK <= __atomic_load_n(&a->committed, __ATOMIC_RELAXED), 1))
    return;
  hd_precommit_want(a, end + HD_PRECOMMIT_AHEAD);
}

/* Sets up an area over [base, base + size) and lets the helper serve it (at most
 * HD_PRECOMMIT_AREAS areas; the same area may be set up again, as in a fork child). An area
 * never set up (all zero: the tables' private copies) is never committed ahead. */
#define HD_PRECOMMIT_AREAS 4
void hd_precommit_area_init(hd_precommit_area *a, void *base, uint64_t size);
/* Process-wide switch, read once at start-up (HEAPDUMP_PRECOMMIT=0 turns it off). */
void hd_precommit_enable(bool on);
/* Stops the helper and waits until its thread is gone; the next need() starts a new one, unless
 * hd_precommit_hold is still in force. For calls that fail in a multi-threaded process. */
void hd_precommit_hold(void);
void hd_precommit_release(void);
/* In a fork child: the helper was the parent's, and the areas are re-initialised by the caller. */
void hd_precommit_after_fork_child(void);
/* Whether a helper thread is running (tests). */
bool hd_precommit_running(void);

#endif /* HEAPDUMP_INSTRUMENTATION_PRECOMMIT_H */
