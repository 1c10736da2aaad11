/* Recording runtime of libheapdump.so, the names each of its files defines for the others:
 * lifecycle.c (configuration, init, fork, thread exit, the exit check), backend.c (where the
 * memory comes from), record.c (the hot path: record and tag), nested.c (nested calls and the
 * signal queue). The shim (preload.c) only guards, forwards to these and records; api.c is the
 * public API, hooks.c the calls the library watches (dlopen, thread names). */
#ifndef HEAPDUMP_INSTRUMENTATION_RUNTIME_H
#define HEAPDUMP_INSTRUMENTATION_RUNTIME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "heapdump/contract/must_check.h"
#include "tables.h"

#define HD_LIKELY(x) __builtin_expect(!!(x), 1)
#define HD_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define HD_HIDDEN __attribute__((visibility("hidden")))

/* The library's state. Below READY, a hook leaves its fast path: to initialise (UNINIT,
 * INITIALIZING), or, dormant (DORMANT, and ARMING while one thread sets recording up), to
 * forward to glibc untouched; so a dormant library costs the recording path nothing. */
enum {
  HD_STATE_UNINIT = 0,
  HD_STATE_INITIALIZING = 1,
  HD_STATE_DORMANT = 2,
  HD_STATE_ARMING = 3,
  HD_STATE_READY = 4,
  HD_STATE_OFF = 5,
};

/* A table operation that a signal handler could not do itself because it interrupted this
 * thread inside a hook (which may hold a slot lock or the resources lock): queued in TLS and
 * applied by the interrupted hook before it returns. */
typedef struct hd_pending_op {
  void *ptr;
  uint64_t size;
  uint64_t timestamp;
  uint32_t stack_key;
  uint32_t thread_key;
  uint32_t lg_align;
  uint32_t is_free; /* 1: erase ptr's record, then free it; 0: record ptr */
  uint32_t node;    /* to record ptr in: reserved, and written in ptr's tag, by the handler */
} hd_pending_op;

#define HD_PENDING_MAX 32u
/* A thread re-reads its own name (one prctl) once per this many of its allocations, so a rename
 * the library cannot see (a write to /proc/self/task/TID/comm) is picked up. */
#define HD_NAME_RECHECK_ALLOCATIONS 4096u

/* A thread's recently used stack traces and their keys: a hit skips probing the shared dedup
 * index, whose slots are cache misses in a program with many distinct traces. Entries hold a
 * 128-bit fingerprint of the frames instead of the frames (8 KiB per thread instead of 256 KiB
 * for the same reach). 9 of its bits pick the entry and
 * 96 are compared, 87 of them not implied by the entry's position: a different trace is taken
 * for the cached one with a probability of at most 2^-87 per lookup. Direct mapped. */
#define HD_TRACE_CACHE_ENTRIES 512u /* a power of two */
typedef struct hd_trace_cache_entry {
  uint64_t print_lo;
  uint32_t print_hi;
  uint32_t key; /* 0 = empty */
} hd_trace_cache_entry;

/* Per-thread state; initial-exec TLS so access never allocates or takes the loader lock and it
 * stays valid through thread teardown. Fields read by signal handlers on the same thread are
 * ordered with signal fences. */
typedef struct hd_thread_state {
  /* The busy word: these three share 4 bytes, so that the exported calls learn whether the
   * thread is inside the library with one compare (hd_thread_busy). */
  int16_t guard;      /* >0 while the library's own code runs: nested calls only forward */
  uint8_t in_hook;    /* 1 while a hook records: nested calls queue their table operation */
  uint8_t in_backend; /* >0 inside the real allocator, which is not reentrant */
  int in_unwind;      /* >0 while capturing a stack: a nested call records no trace */
  /* Sampled recording: bytes this thread allocates before its next recorded block (0 = not
   * drawn yet); beside the words above, which a sampled-out malloc reads too. */
  int64_t sample_countdown;
  uint32_t thread_key;     /* resources key of this thread's current name, 0 = not recorded */
  uint32_t name_gen;       /* value of hd_name_generation when the name was last read */
  uint32_t name_countdown; /* allocations left before the name is read again; 0 = read now */
  uint32_t tid;
  uintptr_t stack_lo, stack_hi;  /* frame-pointer walk bounds, 0 = unknown */
  char name[HD_THREAD_NAME_MAX]; /* name recorded under thread_key */
  hd_writer_thread writer;       /* this thread's share of the tables' writer state */
  hd_trace_cache_entry traces[HD_TRACE_CACHE_ENTRIES]; /* used by hooks only, not by handlers */
  uint32_t pending_count; /* entries of `pending` in use; may exceed HD_PENDING_MAX */
  hd_pending_op pending[HD_PENDING_MAX];
  uint64_t sample_random; /* sampled recording: the generator of the intervals (0 = not seeded) */
  /* Dormant: allocations to pass before this thread looks at a request again, after it found
   * itself in a signal handler (dormant.c); the last such pause; the request's generation. */
  uint32_t arm_skip, arm_last_skip;
  uint64_t arm_skip_generation;
} hd_thread_state;

/* ---- lifecycle.c: configuration, lazy init, the live tables, fork, thread exit ---- */

extern __thread hd_thread_state hd_tls __attribute__((tls_model("initial-exec"))) HD_HIDDEN;
extern int hd_state HD_HIDDEN;
extern uint32_t hd_name_generation HD_HIDDEN;
/* The live tables; replaced only in a fork child (single-threaded then). */
extern hd_alloc_table hd_live_alloc HD_HIDDEN;
extern hd_res_table hd_live_res HD_HIDDEN;
/* HEAPDUMP_SAMPLE_BYTES (hd_res_header.sample_bytes): 0 = every block recorded. Set before
 * recording starts, never changed. */
extern uint64_t hd_sample_bytes HD_HIDDEN;

/* Whether the live tables exist and are this process's: recording (READY), or being armed past
 * the point where the arming thread made them (ARMING). */
bool hd_tables_made(void) HD_HIDDEN;
/* Makes sure the backend is chosen and recording set up (or switched off, or dormant: then it
 * returns at once). */
void hd_init_slow(void) HD_HIDDEN;
static inline void hd_ensure_init(void) {
  if (HD_UNLIKELY(__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) < HD_STATE_READY)) hd_init_slow();
}

/* Timestamps: CLOCK_MONOTONIC_COARSE by default, the same clock as CLOCK_MONOTONIC read without
 * the TSC, to the kernel tick (1-4 ms); a tenth of the cost of a precise read, which was about a
 * tenth of the whole hook. HEAPDUMP_CLOCK=precise: CLOCK_MONOTONIC. */
extern clockid_t hd_clock HD_HIDDEN;
static inline uint64_t hd_now_ns(void) {
  struct timespec ts;
  clock_gettime(hd_clock, &ts); /* vDSO: no syscall */
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* A thread's first record: its writer state goes back when it exits. */
void hd_watch_thread_exit(void) HD_HIDDEN;
void hd_note_rename(void) HD_HIDDEN;
void hd_rescan_regions(void) HD_HIDDEN;
/* Counts, in the process statistics, a stack our unwinder could not describe by call-frame
 * information alone (stacks_beyond_cfi). */
void hd_count_beyond_cfi(void) HD_HIDDEN;
/* Publishes how many loaded modules' unwind tables our checks refused (unwind_tables_refused). */
void hd_note_unwind_tables_refused(unsigned modules) HD_HIDDEN;

/* For the registration code: the live tables' memfds (fd -1 when not recording). They stay the
 * library's; check hd_owned_fd_valid before handing one over. */
void hd_instrumentation_tables(hd_owned_fd *alloc, hd_owned_fd *res) HD_HIDDEN;
/* Copies the live set under the table lock into a new memfd, sealed (incl. F_SEAL_WRITE), with
 * the allocations-table layout and HD_ALLOC_FLAG_SNAPSHOT; *out is the caller's to close.
 * Returns 0 or -errno. */
int hd_snapshot_copy_live(hd_owned_fd *out) HD_HIDDEN HD_MUST_CHECK;

/* ---- backend.c: real memory ---- */

extern int hd_use_system HD_HIDDEN; /* backend chosen at init: 1 = glibc, 0 = jemalloc */

/* Backend (real memory). lg_align: log2 of the alignment (0 = default). Each call marks the
 * thread as inside the allocator (hd_tls.in_backend) for its duration: */
/* The mark around a call of the real allocator, which is not reentrant (a signal handler that
 * interrupts it must not call it again). The fences keep the compiler from moving the mark past
 * the call; no fence for the processor is needed, as only this thread's handlers read it. */
static inline void hd_backend_enter(void) {
  hd_tls.in_backend++;
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
}
static inline void hd_backend_leave(void) {
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  hd_tls.in_backend--;
}
/* Once, at init: chooses the backend (jemalloc, linked into this library, or glibc's if asked
 * for) and looks up what the other calls rely on. */
void hd_backend_init(bool want_system) HD_HIDDEN;
/* Every block holds HD_TAG_BYTES (shm_layout.h) more than asked for, at the end of its usable
 * size (record.c, the block's tag); sizes given to these functions are the program's. */
/* jemalloc's flags (part of its ABI), which its API takes and the backend passes on. */
#define HD_MALLOCX_LG_ALIGN_MASK 0x3f
#define HD_MALLOCX_ZERO 0x40
/* *usable: the block's usable size (tag included), known to the backend without a lookup. */
void *hd_backend_alloc(size_t size, unsigned lg_align, bool zero, size_t *usable) HD_HIDDEN;
void hd_backend_free(void *p, size_t size_hint, unsigned lg_align) HD_HIDDEN; /* hint 0 = unknown */
void *hd_backend_realloc(void *p, size_t size) HD_HIDDEN;
size_t hd_backend_usable(void *p) HD_HIDDEN; /* the allocator's, tag included */
/* jemalloc only: the block's new usable size if it was resized in place, else 0. */
size_t hd_backend_resize_in_place(void *p, size_t size) HD_HIDDEN;
/* What malloc_usable_size will answer for a block of size allocated so (jemalloc's nallocx);
 * the size itself with glibc, which cannot say before it allocates; 0 for an impossible size. */
size_t hd_backend_size_class(size_t size, unsigned lg_align) HD_HIDDEN;
/* false: a size the program must see fail with ENOMEM, as glibc would fail it */
bool hd_backend_grants(size_t size) HD_HIDDEN;
/* Writes into the resources table what the allocator mapped and unmapped since the last call
 * (backend.c). From where this thread holds no lock and is not inside the allocator; does
 * nothing before the tables exist. hd_backend_mappings_waiting says whether there is any. */
extern uint32_t hd_backend_mappings_waiting HD_HIDDEN;
void hd_backend_publish_mappings(void) HD_HIDDEN;
static inline void hd_backend_publish_waiting_mappings(void) {
  if (HD_UNLIKELY(__atomic_load_n(&hd_backend_mappings_waiting, __ATOMIC_RELAXED) != 0))
    hd_backend_publish_mappings();
}
/* In a fork child: the queue of changes starts afresh (backend.c). */
void hd_backend_after_fork_child(void) HD_HIDDEN;
/* The dormant library's calls: glibc's own, no tag (the block is the program's alone). */
void *hd_backend_alloc_untagged(size_t size, unsigned lg_align, bool zero) HD_HIDDEN;
void *hd_backend_realloc_untagged(void *p, size_t size) HD_HIDDEN;
size_t hd_backend_usable_untagged(void *p) HD_HIDDEN;
/* glibc's chunk size of a system-backend block, as its statistics (mallinfo2) count it. */
size_t hd_backend_footprint(void *p) HD_HIDDEN;

/* ---- record.c: the hot path ---- */

/* Recording; call with hd_tls.in_hook set. */
void hd_record_alloc(void *p, size_t size, unsigned lg_align, size_t usable) HD_HIDDEN;
/* Erases p's record (if any) and frees it through the backend. */
void hd_free_recorded(void *p) HD_HIDDEN;
/* What becomes of a new block: recorded, left out by sampling, or left out while recording is
 * paused (its bytes then counted as unattributed). hd_record_filter is 0 when every block is
 * recorded (one load decides); its bits say sampling is on, recording is paused, or the process
 * was armed (its allocations then take the slow path, where they see the collector's next
 * request: a process recording since start never polls). */
enum {
  HD_FILTER_SAMPLED = 1,
  HD_FILTER_PAUSED = 2,
  HD_FILTER_ARMED = 4,
  HD_FILTER_GLIBC_UNTAGGED = 8,
  HD_FILTER_DORMANT = 16
};
/* HD_FILTER_DORMANT, the whole filter while the library is dormant: set just before the state
 * becomes HD_STATE_DORMANT and cleared by the arming thread just after the state has left it
 * (lifecycle.c, become_dormant), so that the exported calls learn "dormant" from the load that
 * tells them "sampling" too (one that sees the state without the bit takes a hook, which
 * forwards as well). */
/* HD_FILTER_GLIBC_UNTAGGED, set with HD_FILTER_SAMPLED once the tables of a process sampling on
 * glibc exist (hd_sampled_out_untagged): a block sampling leaves out is glibc's own, untagged.
 * The exported calls' first load: the whole filter equal to both bits says a new block goes to
 * glibc at the end of the countdown, and that bit alone that a block without a tag does. */
#define HD_FILTER_SAMPLING_ON_GLIBC (HD_FILTER_SAMPLED | HD_FILTER_GLIBC_UNTAGGED)
extern uint32_t hd_record_filter HD_HIDDEN;
typedef enum { HD_RECORD = 0, HD_SAMPLED_OUT = 1, HD_UNATTRIBUTED = 2 } hd_record_choice;
hd_record_choice hd_choose_slow(size_t size) HD_HIDDEN;
/* Takes a block of size bytes off this thread's countdown to its next sample point, if the
 * block ends before it: false, the countdown untouched, if the block reaches the point (or the
 * thread has drawn no interval yet: a countdown of 0). One subtraction in memory and the jump
 * on its flags, which GCC does not make of the C (it loads, subtracts, stores and tests: three
 * more instructions in every sampled-out malloc); the rare block that reaches the point puts
 * its size back. */
__attribute__((always_inline)) static inline bool hd_countdown_leaves_out(size_t size) {
  __asm__ goto("subq %1, %0\n\tjle %l[reached]"
               :
               : "m"(hd_tls.sample_countdown), "r"(size)
               : "cc", "memory"
               : reached);
  return true;
reached:
  hd_tls.sample_countdown = (int64_t)((uint64_t)hd_tls.sample_countdown + size);
  return false;
}
/* Moves this thread's sampling countdown when sampling is on. An allocation that sampling
 * leaves out, in a process that samples and nothing else, costs the load of the filter and the
 * countdown's subtraction; the rest (the thread's first interval, the allocation that uses the
 * countdown up, a paused or armed process) is hd_choose_slow's. */
static inline hd_record_choice hd_choose(size_t size) {
  const uint32_t filter = __atomic_load_n(&hd_record_filter, __ATOMIC_RELAXED);
  if (HD_LIKELY(filter == 0)) return HD_RECORD;
  if (HD_LIKELY((filter & ~(uint32_t)HD_FILTER_GLIBC_UNTAGGED) == HD_FILTER_SAMPLED) &&
      HD_LIKELY(hd_countdown_leaves_out(size)))
    return HD_SAMPLED_OUT;
  return hd_choose_slow(size);
}
/* A new block left out (choice not HD_RECORD): its tag written and, while paused, its bytes
 * counted as unattributed. */
void hd_leave_out(void *p, size_t usable, hd_record_choice choice) HD_HIDDEN;
/* From arming on: frees may meet blocks without a tag (allocated while dormant). */
void hd_note_untagged_blocks(void) HD_HIDDEN;
/* Sampling on glibc (set at init): a block sampling leaves out is glibc's own, untagged, and
 * its allocation costs the countdown and glibc's call (preload.c). */
extern bool hd_sampled_out_untagged HD_HIDDEN;
void hd_note_sampled_out_untagged(void) HD_HIDDEN;
/* Frees block p if it has no tag (sampling left it out) and no record: false if it may have
 * one, for hd_free_recorded. */
bool hd_free_if_untagged(void *p) HD_HIDDEN;
/* Before glibc frees block p other than through hd_free_recorded (a realloc that moves it, the
 * library's own frees): where sampled-out blocks have no tag, a block glibc makes of the same
 * chunk must not find p's tag at its end. A block without a tag is left as it is. Returns the
 * tag it cleared (0: none), for hd_tag_restore if p stays (a failed realloc). */
uint64_t hd_tag_clear(void *p) HD_HIDDEN;
void hd_tag_restore(void *p, uint64_t saved) HD_HIDDEN;
/* Where sampling leaves blocks untagged: a count per bucket of block addresses of the blocks
 * that carry a tag (record.c). A block whose bucket holds 0 has none, and no record. */
#define HD_TAGGED_BUCKETS (1u << 15)
extern uint8_t hd_tagged_count[HD_TAGGED_BUCKETS] HD_HIDDEN;
static inline size_t hd_tagged_bucket(const void *p) {
  return (size_t)(((uint64_t)(uintptr_t)p * UINT64_C(0x9E3779B97F4A7C15)) >> 49);
}
static inline bool hd_tagged_maybe(const void *p) {
  return __atomic_load_n(&hd_tagged_count[hd_tagged_bucket(p)], __ATOMIC_ACQUIRE) != 0;
}

/* hd_record_alloc with the sampling choice already made (hd_choose: once per block). */
void hd_record_chosen(void *p, size_t size, unsigned lg_align, size_t usable,
                      hd_record_choice choice) HD_HIDDEN;
/* What malloc_usable_size tells the program: the block's usable size less its tag (a block
 * from before arming has none). */
size_t hd_program_usable(void *p) HD_HIDDEN;
void *hd_realloc_recorded(void *p, size_t size) HD_HIDDEN;
/* Writes block p's tag: the node that records it (HD_NO_NODE: none). usable: the block's usable
 * size where the caller has it (hd_tag_set looks it up). */
void hd_tag_set_at(void *p, size_t usable, uint32_t index) HD_HIDDEN;
void hd_tag_set(void *p, uint32_t index) HD_HIDDEN;

/* ---- dormant.c: the dormant library, armed and disarmed through the arm page ---- */

/* The arm page's generation word (contract/arm_page.h), or a zero that never moves where no
 * page is mapped; and the generation this process last acted on. */
extern const uint64_t *hd_arm_generation HD_HIDDEN;
extern uint64_t hd_arm_seen HD_HIDDEN;
/* What a dormant malloc compares with hd_arm_seen, so that one compare says both "dormant" and
 * "no request waits": hd_arm_generation while the library is dormant (set with the filter's
 * dormant bit, cleared with it: lifecycle.c), else a word no generation seen ever equals. */
extern const uint64_t *hd_dormant_word HD_HIDDEN;
void hd_dormant_word_follow(bool dormant) HD_HIDDEN;
void hd_arm_poll_slow(void) HD_HIDDEN;
/* Acts on the collector's request for this process, if the page moved: one load when not. */
static inline bool hd_arm_request_waiting(void) {
  return __atomic_load_n(hd_arm_generation, __ATOMIC_RELAXED) !=
         __atomic_load_n(&hd_arm_seen, __ATOMIC_RELAXED);
}
static inline void hd_arm_poll(void) {
  if (HD_UNLIKELY(hd_arm_request_waiting())) hd_arm_poll_slow();
}
/* A hook's first step: the state, initialised if need be. Dormant (HD_STATE_DORMANT or
 * ARMING: the library only forwards to glibc: HEAPDUMP_DORMANT=1, or named in
 * /etc/ld.so.preload and not in LD_PRELOAD), an allocation first acts on a request of the
 * collector's (arm_allocation: it may arm, and then records). A state below READY means
 * "forward to glibc". */
/* Whether a hook forwards to glibc untouched in this state: dormant, or being armed. (Below
 * DORMANT, a call is the initialising thread's own, which takes the nested path.) */
static inline bool hd_forwards(int state) {
  return state == HD_STATE_DORMANT || state == HD_STATE_ARMING;
}

static inline int hd_hook_state(bool arm_allocation) {
  int state = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE);
  if (HD_LIKELY(state >= HD_STATE_READY)) return state;
  if (state < HD_STATE_DORMANT) {
    hd_init_slow();
    state = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE);
  }
  if (arm_allocation && state == HD_STATE_DORMANT) {
    hd_arm_poll();
    state = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE);
  }
  return state;
}

/* glibc's own calls, made last and unmarked by the dormant library (a signal handler that
 * interrupts them never arms: dormant.c) and by the exported malloc, calloc, realloc and free
 * for a block sampling leaves out (a handler that interrupts glibc there enters it again, as it
 * would without the library: those calls are glibc's and touch nothing of the library's). */
/* Called through their GOT entries, not a PLT stub: one jump fewer (GCC; clang, which the TSan
 * build uses, has no such attribute). */
#if defined(__has_attribute) && __has_attribute(noplt)
#define HD_NOPLT __attribute__((noplt))
#else
#define HD_NOPLT
#endif
HD_NOPLT void *__libc_malloc(size_t size);
HD_NOPLT void *__libc_calloc(size_t n, size_t size);
HD_NOPLT void *__libc_realloc(void *p, size_t size);
HD_NOPLT void __libc_free(void *p);
/* glibc's calls for blocks without a tag made inside a hook, marked as inside the allocator: a
 * signal handler that interrupts them finds the thread inside the library (nested.c). */
static inline void *hd_glibc_malloc(size_t size) {
  hd_backend_enter();
  void *p = __libc_malloc(size);
  hd_backend_leave();
  return p;
}
static inline void hd_glibc_free(void *p) {
  hd_backend_enter();
  __libc_free(p);
  hd_backend_leave();
}
/* Whether this thread is inside the library's code, a hook or the real allocator: then the
 * exported calls take no block straight to glibc. */
_Static_assert(offsetof(hd_thread_state, in_hook) == offsetof(hd_thread_state, guard) + 2 &&
                   offsetof(hd_thread_state, in_backend) == offsetof(hd_thread_state, guard) + 3 &&
                   offsetof(hd_thread_state, guard) % 4 == 0,
               "guard, in_hook and in_backend share a word");
static inline bool hd_thread_busy(void) {
  uint32_t busy;
  memcpy(&busy, (const char *)&hd_tls + offsetof(hd_thread_state, guard), sizeof busy);
  return busy != 0;
}
/* The exported calls' whole decision, from one load of the filter (hd_filter_now), for a block
 * glibc serves alone: the caller then calls glibc last. Sampling on glibc: malloc's and
 * calloc's, sampling is all the library does with new blocks, and the block is left out;
 * free's, blocks without a tag are glibc's, and block p surely has none (its bucket holds no
 * tag); realloc's, all of these. */
static inline uint32_t hd_filter_now(void) {
  return __atomic_load_n(&hd_record_filter, __ATOMIC_RELAXED);
}
static inline bool hd_sampled_out_malloc(uint32_t filter, size_t size) {
  return HD_LIKELY(filter == HD_FILTER_SAMPLING_ON_GLIBC) && HD_LIKELY(!hd_thread_busy()) &&
         HD_LIKELY(hd_countdown_leaves_out(size));
}
static inline bool hd_sampled_out_free(uint32_t filter, const void *p) {
  return HD_LIKELY((filter & HD_FILTER_GLIBC_UNTAGGED) != 0) && HD_LIKELY(!hd_thread_busy()) &&
         HD_LIKELY(!hd_tagged_maybe(p));
}
static inline bool hd_sampled_out_realloc(uint32_t filter, const void *p, size_t size) {
  return HD_LIKELY(filter == HD_FILTER_SAMPLING_ON_GLIBC) && HD_LIKELY(!hd_thread_busy()) &&
         HD_LIKELY(!hd_tagged_maybe(p)) && HD_LIKELY(hd_countdown_leaves_out(size));
}
/* A dormant library with no request of the collector's waiting (one that waits arms first: the
 * hooks): one compare, the dormant word with the generation last seen. */
static inline bool hd_dormant_passes(void) {
  return HD_LIKELY(
      __atomic_load_n(__atomic_load_n(&hd_dormant_word, __ATOMIC_RELAXED), __ATOMIC_RELAXED) ==
      __atomic_load_n(&hd_arm_seen, __ATOMIC_RELAXED));
}
/* Either way the thread's latest allocation is no longer a recorded block's (record.c,
 * count_if_temporary): a sampled-out block is never recorded, so 0 stands for its address. */
static inline void hd_sampled_out_forget_last(void) { hd_tls.writer.last_alloc_address = 0; }

/* At init, for a dormant process: maps the arm page beside the collector's socket (the
 * variables' values, NULL when unset), read-only. */
void hd_dormant_map_page(const char *socket, const char *runtime_dir) HD_HIDDEN;
/* In a fork child: no other thread is acting on a request. */
void hd_dormant_after_fork_child(void) HD_HIDDEN;
/* Whether /etc/ld.so.preload names libheapdump (read with raw syscalls: no allocation). */
bool hd_preload_file_names_us(void) HD_HIDDEN;

/* What an arming could not make: a table, the bytes asked for, the errno of the failed call. */
typedef struct hd_arm_failure {
  const char *table;
  uint64_t bytes;
  int error;
} hd_arm_failure;

/* lifecycle.c: what the requests do. Arming (from HD_STATE_DORMANT, for the arm page's request
 * of that generation) creates the tables, registers and starts recording (if the tables cannot
 * be made, the process tells the collector why, and stays dormant); pausing and resuming switch
 * recording of new blocks off and on (frees always take records out). */
void hd_arm(uint64_t sample_bytes, uint64_t generation) HD_HIDDEN;
void hd_set_paused(bool paused) HD_HIDDEN;

/* ---- nested.c: nested calls and the signal queue ---- */

/* Calls made while this thread is already inside the library (hd_tls.guard or in_hook set):
 * from the library's own code (forwarded, unrecorded) or from a signal handler that interrupted
 * a hook (done at once on the allocator, the table part queued). Inside the allocator itself
 * (in_backend), which is not reentrant, allocations fail with ENOMEM and frees are queued. */
void *hd_nested_alloc(size_t size, unsigned lg_align, bool zero) HD_HIDDEN;
void hd_nested_free(void *p) HD_HIDDEN;
void *hd_nested_realloc(void *p, size_t size) HD_HIDDEN;

/* Applies the operations signal handlers queued while this thread was in a hook. */
void hd_drain_pending(void) HD_HIDDEN;

static inline void hd_hook_enter(void) {
  hd_tls.in_hook = 1;
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

/* Leaves a hook. A handler that ran after the last drain but before in_hook was cleared has
 * queued its operation; it is applied here rather than left for the next hook. */
static inline void hd_hook_leave(void) {
  for (;;) {
    if (HD_UNLIKELY(__atomic_load_n(&hd_tls.pending_count, __ATOMIC_RELAXED) != 0))
      hd_drain_pending();
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    hd_tls.in_hook = 0;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    if (HD_LIKELY(__atomic_load_n(&hd_tls.pending_count, __ATOMIC_RELAXED) == 0)) return;
    hd_tls.in_hook = 1;
  }
}

#endif /* HEAPDUMP_INSTRUMENTATION_RUNTIME_H */
