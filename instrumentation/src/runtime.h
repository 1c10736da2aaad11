/* Recording runtime of libheapdump.so: configuration, lazy allocation-free init, the backends,
 * stack capture, thread infos, executable regions, fork handling and the snapshot copy. The
 * preload shim (preload.c) only guards, forwards to these and records. */
#ifndef HEAPDUMP_INSTRUMENTATION_RUNTIME_H
#define HEAPDUMP_INSTRUMENTATION_RUNTIME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tables.h"

#define HD_LIKELY(x) __builtin_expect(!!(x), 1)
#define HD_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define HD_HIDDEN __attribute__((visibility("hidden")))

enum { HD_STATE_UNINIT = 0, HD_STATE_INITIALIZING = 1, HD_STATE_READY = 2, HD_STATE_OFF = 3 };

/* Per-thread state; initial-exec TLS so access never allocates or takes the loader lock and it
 * stays valid through thread teardown. */
typedef struct hd_thread_state {
  int guard;            /* >0 while inside a hook: nested calls only forward */
  uint32_t thread_key;  /* resources key of this thread's current name, 0 = not recorded */
  uint32_t name_gen;    /* value of hd_name_generation when thread_key was made */
  uint32_t tid;
  uintptr_t stack_lo, stack_hi; /* frame-pointer walk bounds, 0 = unknown */
  char name[HD_THREAD_NAME_MAX]; /* name recorded under thread_key */
} hd_thread_state;

extern __thread hd_thread_state hd_tls __attribute__((tls_model("initial-exec"))) HD_HIDDEN;
extern int hd_state HD_HIDDEN;
extern int hd_use_system HD_HIDDEN; /* backend chosen at init: 1 = glibc, 0 = jemalloc */
extern uint32_t hd_name_generation HD_HIDDEN;

/* Makes sure the backend is chosen and recording set up (or switched off). */
void hd_init_slow(void) HD_HIDDEN;
static inline void hd_ensure_init(void) {
  if (HD_UNLIKELY(__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) < HD_STATE_READY)) hd_init_slow();
}

/* Backend (real memory). flags for aligned: log2 of alignment (0 = default). */
void *hd_backend_alloc(size_t size, unsigned lg_align, bool zero) HD_HIDDEN;
void hd_backend_free(void *p, size_t size_hint, unsigned lg_align) HD_HIDDEN; /* hint 0 = unknown */
size_t hd_backend_usable(void *p) HD_HIDDEN;
bool hd_backend_resize_in_place(void *p, size_t size) HD_HIDDEN; /* jemalloc only */
size_t hd_backend_class(size_t size) HD_HIDDEN;                    /* 0: impossible size */

/* Recording; call with the guard held. */
void hd_record_alloc(void *p, size_t size, unsigned lg_align) HD_HIDDEN;
/* Erases p's record (if any) and frees it through the backend. */
void hd_free_recorded(void *p) HD_HIDDEN;
void *hd_realloc_recorded(void *p, size_t size) HD_HIDDEN;

void hd_note_rename(void) HD_HIDDEN;
void hd_rescan_regions(void) HD_HIDDEN;

/* For the registration code (fidl bindings) and tests: the live tables' memfds (-1 when not
 * recording). The fds stay owned by the library. */
void hd_instrumentation_tables(int *alloc_fd, int *res_fd) HD_HIDDEN;
/* Copies the live set under the table lock into a new memfd, sealed (incl. F_SEAL_WRITE), with
 * the allocations-table layout and HD_ALLOC_FLAG_SNAPSHOT; *out_fd is the caller's.
 * Returns 0 or -errno. */
int hd_snapshot_copy_live(int *out_fd) HD_HIDDEN HD_WUR;

#endif /* HEAPDUMP_INSTRUMENTATION_RUNTIME_H */
