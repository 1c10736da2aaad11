/* Committing the tables' pages ahead of the allocating threads.
 *
 * The tables grow into a sparse memfd, and the first write to each new page is a page fault
 * (about 2 µs here, allocating and zeroing the page) taken by whichever thread allocated. A
 * helper thread instead populates the pages ahead of where the writers are
 * (MADV_POPULATE_WRITE on the shared mapping, which fills the page tables every thread uses),
 * so the writers find them present. Writers only say how far they have got: one load and a
 * compare, and a call out of line once they come within HD_PRECOMMIT_SLACK of what is
 * committed.
 *
 * The helper lives for one burst of work: a writer that asks for more starts it (a clone, at
 * most once per 256 KiB of an area's growth), it populates what was asked for and exits. It is
 * not a pthread: it is cloned raw, with its own small stack and thread pointer, all signals
 * blocked, and runs nothing but system calls, so glibc and libstdc++ still see a
 * single-threaded process (their fast paths stay on) and no program signal lands on it. Calls
 * that need the process single-threaded, or that change what every thread may do (credentials,
 * seccomp), wait until no helper exists (hd_precommit_hold) and none starts before they return.
 * No helper ever starts for an area below HD_PRECOMMIT_START_AFTER, with HEAPDUMP_PRECOMMIT=0,
 * where clone is refused, or on kernels without MADV_POPULATE_WRITE (before 5.14): the writers
 * then take the faults themselves, as they did before. x86-64, as the rest of the library. */
#ifndef HEAPDUMP_INSTRUMENTATION_PRECOMMIT_H
#define HEAPDUMP_INSTRUMENTATION_PRECOMMIT_H

#include <stdbool.h>
#include <stdint.h>

/* An area of a table's mapping that grows from its start. */
typedef struct hd_precommit_area {
  uint8_t *base;
  uint64_t size;
  uint64_t ask_at;    /* atomic: a writer past this many bytes asks for more */
  uint64_t committed; /* atomic; written by the helper: [base, base + committed) is populated */
  uint64_t wanted;    /* atomic; raised by writers: how far the helper should populate */
} hd_precommit_area;

/* How far ahead of a writer the helper keeps an area committed, how close a writer may come to
 * the committed end before it asks for more, and how big an area must be for it to ask. */
#define HD_PRECOMMIT_AHEAD ((uint64_t)512 << 10)
#define HD_PRECOMMIT_SLACK ((uint64_t)256 << 10)
#define HD_PRECOMMIT_START_AFTER ((uint64_t)1 << 20)

/* Asks for the area to be committed up to `target` bytes from its start. */
void hd_precommit_want(hd_precommit_area *a, uint64_t target);

/* A writer is about to use the area up to `end` bytes from its start. */
static inline void hd_precommit_need(hd_precommit_area *a, uint64_t end) {
  if (__builtin_expect(end < __atomic_load_n(&a->ask_at, __ATOMIC_RELAXED), 1)) return;
  hd_precommit_want(a, end + HD_PRECOMMIT_AHEAD);
}

/* Sets up an area over [base, base + size) and lets the helper serve it (at most
 * HD_PRECOMMIT_AREAS areas; setting up the same area again, as a fork child does, replaces
 * it). Only while no helper runs: at start-up and in a fork child. An area never set up (all
 * zero: the tables' private copies) asks once per call and is never served. */
#define HD_PRECOMMIT_AREAS 4
void hd_precommit_area_init(hd_precommit_area *a, void *base, uint64_t size);
/* Process-wide switch, read once at start-up (HEAPDUMP_PRECOMMIT=0 turns it off). */
void hd_precommit_enable(bool on);
/* Stops the helper if one runs, waits until its thread has left the process, and keeps any
 * other from starting until the matching release. Returns true if a helper may still count
 * among the process's threads for a moment (its exit could not be confirmed through /proc):
 * a call refused for that may be retried. For calls that fail in a process of several
 * threads, or that change only the calling thread. Does nothing in a process sharing this
 * memory that is not the helper's (a vfork child). */
bool hd_precommit_hold(void);
void hd_precommit_release(void);
/* In a fork child: only the forking thread exists there. */
void hd_precommit_after_fork_child(void);
/* Whether a helper thread exists now (tests). */
bool hd_precommit_running(void);

#endif /* HEAPDUMP_INSTRUMENTATION_PRECOMMIT_H */
