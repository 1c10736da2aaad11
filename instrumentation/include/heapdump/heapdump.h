/* heapdump application API: lets a program running under libheapdump.so query its heap
 * statistics and store named snapshots of its live allocations in the collector.
 *
 * ERRORS. Every function returns HEAPDUMP_OK (0) or one of the negative HEAPDUMP_ERROR_*
 * codes below, and is declared warn_unused_result.
 *
 * OPTIONAL LINKING (weak-symbol pattern). A program that must also run without the library
 * defines HEAPDUMP_WEAK_API before including this header and does not link libheapdump.so:
 *
 *     #define HEAPDUMP_WEAK_API
 *     #include <heapdump/heapdump.h>
 *     ...
 *     if (heapdump_available()) (void)heapdump_take_named_snapshot("after-load");
 *
 * The functions are then weak references: NULL unless libheapdump.so was preloaded (or linked),
 * in which case they resolve to the library's definitions. heapdump_available() is only
 * defined in this mode.
 *
 * THREADS. All functions are thread-safe and may be called from any thread, including from
 * static constructors and destructors; they are not async-signal-safe. */
#ifndef HEAPDUMP_HEAPDUMP_H
#define HEAPDUMP_HEAPDUMP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of heapdump this header belongs to; every heapdump program prints it with
 * --version. */
#define HEAPDUMP_VERSION_MAJOR 0
#define HEAPDUMP_VERSION_MINOR 2
#define HEAPDUMP_VERSION_PATCH 0
#define HEAPDUMP_VERSION_STRING "0.2.0"

#define HEAPDUMP_OK 0
/* An argument is NULL or out of range. */
#define HEAPDUMP_ERROR_INVALID_ARGUMENT (-1)
/* The library is loaded but not recording (its shared memory could not be set up, or a forked
 * child could not copy its parent's tables). */
#define HEAPDUMP_ERROR_NOT_RECORDING (-2)
/* No collector took the snapshot (none is running, or it did not accept the connection within
 * 2 seconds). The snapshot was taken and discarded; the program is unaffected and keeps
 * recording. */
#define HEAPDUMP_ERROR_NO_COLLECTOR (-3)
/* Memory or file descriptors for the snapshot copy could not be obtained. */
#define HEAPDUMP_ERROR_NO_MEMORY (-4)
/* The collector received the snapshot but could not store it (its storage is full or
 * unwritable; its log says why). */
#define HEAPDUMP_ERROR_COLLECTOR_REFUSED (-5)
/* The collector received the snapshot but did not say within HEAPDUMP_SNAPSHOT_TIMEOUT seconds
 * (30 unless set) whether it stored it: it may still do so. It is never sent twice. */
#define HEAPDUMP_ERROR_NO_ANSWER (-6)

/* Longest snapshot name accepted, in bytes, without the terminating NUL. */
#define HEAPDUMP_SNAPSHOT_NAME_MAX 32

/* Process-wide counters since the start of recording. Counters cover recorded blocks only:
 * allocations made while the tables were full are counted in dropped_allocations instead.
 * Later versions add fields only at the end. The size a program was compiled with travels with
 * every call (heapdump_get_stats passes it), so a library fills only the fields its caller knows
 * and zeroes the ones it does not know itself: old programs keep working with new libraries, and
 * new programs with old ones. */
struct heapdump_stats {
  uint64_t blocks_allocated;
  uint64_t bytes_allocated; /* requested bytes */
  uint64_t blocks_freed;
  uint64_t bytes_freed;
  uint64_t live_blocks;         /* blocks_allocated - blocks_freed */
  uint64_t live_bytes;          /* bytes_allocated - bytes_freed */
  uint64_t peak_live_bytes;     /* highest live_bytes seen: exact when one thread allocates;
                                   with several, each may hold back up to 64 KiB of its share */
  uint64_t dropped_allocations; /* not recorded: allocations table full (HEAPDUMP_MAX_MEMORY) */
};

#if defined(HEAPDUMP_WEAK_API)
#define HEAPDUMP_DECL __attribute__((weak, warn_unused_result))
#else
#define HEAPDUMP_DECL __attribute__((warn_unused_result))
#endif

/* Fills *out with the current counters. Each counter is read atomically; they are not a
 * consistent set at one instant while other threads allocate.
 * Returns HEAPDUMP_OK; HEAPDUMP_ERROR_INVALID_ARGUMENT if out is NULL;
 * HEAPDUMP_ERROR_NOT_RECORDING (and *out zeroed) if the library is not recording. */
#define heapdump_get_stats(out) heapdump_get_stats_sized((out), sizeof(struct heapdump_stats))

/* What heapdump_get_stats calls: size is sizeof(struct heapdump_stats) as the caller was
 * compiled, at least the 64 bytes of version 0.1's struct (else
 * HEAPDUMP_ERROR_INVALID_ARGUMENT). */
HEAPDUMP_DECL int heapdump_get_stats_sized(struct heapdump_stats *out, size_t size);

/* Takes a snapshot of exactly the live allocations at the call (other threads' allocations
 * wait while it is copied) and stores it in the collector under `name`, a NUL-terminated
 * string of 1 to HEAPDUMP_SNAPSHOT_NAME_MAX bytes (names need not be unique).
 * Returns HEAPDUMP_OK when the collector has it; HEAPDUMP_ERROR_INVALID_ARGUMENT for a bad
 * name; HEAPDUMP_ERROR_NOT_RECORDING; HEAPDUMP_ERROR_NO_MEMORY; HEAPDUMP_ERROR_NO_COLLECTOR
 * if no collector took it; HEAPDUMP_ERROR_COLLECTOR_REFUSED if it could not store it;
 * HEAPDUMP_ERROR_NO_ANSWER if it took it and did not answer in time. The snapshot is
 * downloadable from the collector after the program exits. The call never waits unboundedly
 * on the collector: connecting and registering give up after 2 s each (a connection that
 * fails before the snapshot leaves is tried once more: the collector may have restarted);
 * once the collector has the snapshot, the call waits up to HEAPDUMP_SNAPSHOT_TIMEOUT seconds
 * (default 30) for the answer that it is stored, and never sends it again.
 * Cancellation-safe: a thread cancelled inside finishes the call, then acts on the
 * cancellation at its next cancellation point. */
HEAPDUMP_DECL int heapdump_take_named_snapshot(const char *name);

#if defined(HEAPDUMP_WEAK_API)
/* Nonzero if libheapdump.so is present in the process. */
static inline int heapdump_available(void) { return heapdump_get_stats_sized != 0; }
#endif

#ifdef __cplusplus
}
#endif

#endif /* HEAPDUMP_HEAPDUMP_H */
