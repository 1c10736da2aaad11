/* pprof output: a gzip-compressed profile.proto (github.com/google/pprof/proto/profile.proto),
 * encoded with nanopb while streaming, so the profile is never built in memory as a whole. */
#ifndef HEAPDUMP_TOOLS_PPROF_H
#define HEAPDUMP_TOOLS_PPROF_H

#include <stdbool.h>
#include <stdio.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/symbolize.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The file name of the one Mapping of the locations no module holds: every Location has a
 * Mapping, as profile ingesters require. */
#define HD_PPROF_UNMAPPED "[unmapped]"

typedef enum hd_pprof_sample {
  HD_PPROF_INUSE_SPACE = 0, /* the default sample type */
  HD_PPROF_INUSE_OBJECTS,
  HD_PPROF_ALLOC_SPACE,
  HD_PPROF_ALLOC_OBJECTS,
  HD_PPROF_PEAK_SPACE, /* only where the profile has the peak's sample types */
  HD_PPROF_PEAK_OBJECTS,
} hd_pprof_sample;

typedef struct hd_pprof_options {
  /* NULL: addresses only (Mappings and Locations; the only Function is the one naming empty
   * stacks), which pprof can symbolize itself from the files the Mappings name. */
  hd_symbolizer *symbolizer;
  /* One sample per block, labelled address/bytes/timestamp/thread, instead of one per stack
   * trace; the cumulative counters then come in one more sample per stack trace, unlabelled. */
  bool tags;
  hd_pprof_sample default_sample;
  /* The sample types in the order of Go's heap profiles (alloc_objects, alloc_space,
   * inuse_objects, inuse_space), the shape a /debug/pprof/heap endpoint serves. */
  bool go_order;
  /* The symbolizer's names are final: every Mapping says has_functions, so that a reader does
   * not look for symbols itself (pprof, given a profile over HTTP whose mapping has none, asks
   * the server's /debug/pprof/symbol and fails without it). */
  bool final_symbols;
  /* A profile that is not one snapshot's heap (heapdump diff): the values of the sample of stack
   * trace `trace` of snapshot `snapshot` (indices in r), in sample type order; false leaves the
   * trace out. Values may be negative. NULL: the snapshot's live totals and counters. Not
   * combined with tags. */
  bool (*trace_values)(void *ctx, size_t snapshot, size_t trace, int64_t values[4]);
  void *trace_values_ctx;
} hd_pprof_options;

/* Writes the snapshots of r to out as gzip'd profile.proto (options NULL: the defaults). Sample
 * types, in order: inuse_objects/count, inuse_space/bytes, alloc_objects/count,
 * alloc_space/bytes (the last two from the cumulative counters; 0 where a stack trace has none).
 * A multi-process stream (snapshots that began with a SnapshotHeader, however many) has every
 * sample labelled process_name and pid. Flushes out but does not close it. Returns 0, or a
 * negative errno value with a message in error: -EINVAL for bad arguments or a reassembler whose
 * references do not resolve (unfinished), -ENOMEM, or the errno of a failed write (-ENOSPC...). */
HD_MUST_CHECK int hd_pprof_write(const hd_reassembler *r, const hd_pprof_options *options,
                                 FILE *out, char *error, size_t error_size);

/* Reads a heap profile in pprof's format (gzip-compressed or not; heapdump's, or any with
 * inuse_space or alloc_space samples) into r, finished: each sample becomes one allocation
 * standing for its inuse_objects blocks (with --tags, the block at its address), its alloc
 * values the counters of its stack trace, a root "... truncated at N frames" frame the trace's
 * truncated flag, and each Location's names known locations of the snapshot. A multi-process
 * profile (process_name and pid labels) gives one snapshot per process; a single process is
 * called fallback_name (may be NULL) with fallback_pid. Returns 0, or with a message in error:
 * -EBADMSG (the bytes do not decode as a profile), -EINVAL (a damaged gzip stream, not a heap
 * profile, broken references) or -ENOMEM. */
HD_MUST_CHECK int hd_pprof_read(const uint8_t *data, size_t size, const char *fallback_name,
                                uint64_t fallback_pid, hd_reassembler *r, char *error,
                                size_t error_size);

#ifdef __cplusplus
}
#endif
#endif
