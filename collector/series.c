/* The per-process memory series (series.h). */
#include "series.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "heapdump/contract/must_check.h"

void hd_series_init(hd_series *s) {
  memset(s, 0, sizeof *s);
  pthread_mutex_init(&s->lock, NULL);
  s->stride = 1;
}

void hd_series_destroy(hd_series *s) {
  free(s->samples);
  pthread_mutex_destroy(&s->lock);
}

static hd_series_sample sample_of(const hd_table_stats *st, int64_t now) {
  return (hd_series_sample){.timestamp = now,
                            .live_bytes = st->live_bytes,
                            .live_blocks = st->live_blocks,
                            .bytes_allocated = st->bytes_allocated,
                            .blocks_allocated = st->blocks_allocated,
                            .bytes_freed = st->bytes_freed,
                            .blocks_freed = st->blocks_freed};
}

/* One sample standing for a span of ticks: the one with the most live bytes, whole (a moment
 * that was, with its own totals), since a memory timeline is read for its peaks. */
static hd_series_sample fold(hd_series_sample earlier, hd_series_sample later) {
  return earlier.live_bytes > later.live_bytes ? earlier : later;
}

void hd_series_add(hd_series *s, const hd_table_stats *stats, int64_t now) {
  const hd_series_sample sample = sample_of(stats, now);
  pthread_mutex_lock(&s->lock);
  if (s->samples == NULL) s->samples = malloc(HD_SERIES_CAPACITY * sizeof *s->samples);
  if (s->samples == NULL) {
    pthread_mutex_unlock(&s->lock);
    return;
  }
  if (s->count > 0 && s->pending > 0 && s->pending < s->stride) {
    s->samples[s->count - 1] = fold(s->samples[s->count - 1], sample);
    s->pending++;
  } else {
    if (s->count == HD_SERIES_CAPACITY) {
      /* The first sample stays as it is: the series starts when the process was first seen. */
      size_t kept = 1;
      for (size_t i = 1; i + 1 < HD_SERIES_CAPACITY; i += 2) {
        s->samples[kept++] = fold(s->samples[i], s->samples[i + 1]);
      }
      s->samples[kept++] = s->samples[HD_SERIES_CAPACITY - 1];
      s->count = kept;
      s->stride *= 2;
    }
    s->samples[s->count++] = sample;
    s->pending = 1;
  }
  pthread_mutex_unlock(&s->lock);
}

void hd_series_remember(hd_series *s, const hd_series_moment *moment) {
  pthread_mutex_lock(&s->lock);
  if (s->mark_count == HD_SERIES_MARKS) {
    memmove(s->marks, s->marks + 1, (HD_SERIES_MARKS - 1) * sizeof *s->marks);
    s->mark_count--;
  }
  /* Stores may finish out of order (two storage workers): keep the marks in time order. */
  size_t at = s->mark_count;
  while (at > 0 && s->marks[at - 1].at.timestamp > moment->at.timestamp) at--;
  memmove(s->marks + at + 1, s->marks + at, (s->mark_count - at) * sizeof *s->marks);
  s->marks[at] = *moment;
  s->mark_count++;
  pthread_mutex_unlock(&s->lock);
}

static HD_MUST_CHECK hd_status add_sample(hd_batch_writer *w, const hd_series_sample *v,
                                          const char *name) {
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_stats_sample_tag;
  heapdump_client_StatsSample *out = &e.element.stats_sample;
  *out = (heapdump_client_StatsSample){.has_timestamp = true,
                                       .timestamp = v->timestamp,
                                       .has_live_bytes = true,
                                       .live_bytes = v->live_bytes,
                                       .has_live_blocks = true,
                                       .live_blocks = v->live_blocks,
                                       .has_bytes_allocated = true,
                                       .bytes_allocated = v->bytes_allocated,
                                       .has_blocks_allocated = true,
                                       .blocks_allocated = v->blocks_allocated,
                                       .has_bytes_freed = true,
                                       .bytes_freed = v->bytes_freed,
                                       .has_blocks_freed = true,
                                       .blocks_freed = v->blocks_freed};
  if (name != NULL) {
    out->has_snapshot_name = true;
    snprintf(out->snapshot_name, sizeof out->snapshot_name, "%s", name);
  }
  return hd_batch_add(w, &e);
}

static int64_t monotonic_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

hd_status hd_series_write(hd_series *s, const hd_table_stats *stats, const char *name,
                          hd_batch_writer *w, hd_series_moment *moment) {
  hd_series_moment own = {.at = sample_of(stats, 0)};
  snprintf(own.name, sizeof own.name, "%s", name);
  /* Copied out first: writing may block on the receiver, and sampling must not wait for it. */
  pthread_mutex_lock(&s->lock);
  own.at.timestamp = monotonic_now();
  const size_t count = s->count, mark_count = s->mark_count;
  hd_series_sample *samples = count ? malloc(count * sizeof *samples) : NULL;
  hd_series_moment *marks = mark_count ? malloc(mark_count * sizeof *marks) : NULL;
  const bool copied = (count == 0 || samples != NULL) && (mark_count == 0 || marks != NULL);
  if (copied) {
    if (count) memcpy(samples, s->samples, count * sizeof *samples);
    if (mark_count) memcpy(marks, s->marks, mark_count * sizeof *marks);
  }
  pthread_mutex_unlock(&s->lock);
  if (moment != NULL) *moment = own;
  hd_status status = HD_OK;
  if (copied) {
    /* Merge by time: both lists are in time order. */
    size_t i = 0, j = 0;
    while (status == HD_OK && (i < count || j < mark_count)) {
      if (j < mark_count && (i == count || marks[j].at.timestamp <= samples[i].timestamp)) {
        status = add_sample(w, &marks[j].at, marks[j].name);
        j++;
      } else {
        status = add_sample(w, &samples[i++], NULL);
      }
    }
  }
  if (status == HD_OK) status = add_sample(w, &own.at, own.name);
  free(samples);
  free(marks);
  return status;
}
