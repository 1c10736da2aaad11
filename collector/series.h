/* A process's memory over time: the statistics the collector samples from its tables every
 * sample interval, and the moments its snapshots were taken. Snapshots carry the series up to
 * their moment (StatsSample elements), which is what gives every report a timeline at no cost to
 * the program: the counters are already in shared memory, only the collector reads them. */
#ifndef HEAPDUMP_COLLECTOR_SERIES_H
#define HEAPDUMP_COLLECTOR_SERIES_H

#include <pthread.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/contract/names.h"
#include "heapdump/fidl/batch.h"
#include "table_reader.h"

/* Samples kept per process. Past this the series is thinned to half (the first sample stays, each
 * later pair keeps the one with more live bytes, so the peak survives) and later samples are kept
 * at twice the spacing: a process that runs for days still has a series covering its whole life,
 * in bounded memory (~112 KiB). */
#define HD_SERIES_CAPACITY 2048
/* Stored snapshots' moments kept per process, in time order (the oldest are dropped first). */
#define HD_SERIES_MARKS 64

typedef struct hd_series_sample {
  int64_t timestamp; /* CLOCK_MONOTONIC ns */
  uint64_t live_bytes, live_blocks;
  uint64_t bytes_allocated, blocks_allocated, bytes_freed, blocks_freed;
} hd_series_sample;

typedef struct hd_series_moment {
  hd_series_sample at;
  char name[HD_NAME_SIZE];
} hd_series_moment;

typedef struct hd_series {
  pthread_mutex_t lock;
  hd_series_sample *samples; /* allocated at the first sample */
  size_t count;
  /* Samples are kept one per `stride` sampling ticks; `pending` ticks of the current span have
   * been folded into the last sample so far. */
  uint32_t stride, pending;
  hd_series_moment marks[HD_SERIES_MARKS];
  size_t mark_count;
} hd_series;

void hd_series_init(hd_series *s);
void hd_series_destroy(hd_series *s);
/* Adds one sampling tick's statistics (taken at `now`). Out of memory: the tick is skipped. */
void hd_series_add(hd_series *s, const hd_table_stats *stats, int64_t now);
/* Writes the series as StatsSample elements in time order, the remembered moments of stored
 * snapshots among them, and last this snapshot's own moment, named `name`, with `stats`: timed
 * under the series' lock, so it is the latest of all, whatever other snapshot of the process
 * runs meanwhile. *moment (nullable) gets that moment, for hd_series_remember. */
HD_MUST_CHECK hd_status hd_series_write(hd_series *s, const hd_table_stats *stats, const char *name,
                                        hd_batch_writer *w, hd_series_moment *moment);
/* Remembers a stored snapshot's moment (once it is stored), so that later snapshots of the
 * process show it. Live snapshots are not remembered: they are not kept anywhere. */
void hd_series_remember(hd_series *s, const hd_series_moment *moment);

#endif
