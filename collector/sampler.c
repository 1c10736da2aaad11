/* The sampler thread: every sample interval, each live process's statistics (counters the
 * process keeps in its shared tables anyway) go into its series. It only reads shared memory, so
 * the program pays nothing for its timeline; a process being snapshotted is sampled as usual. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <time.h>

#include "collector_internal.h"

typedef struct hd_sampler {
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t wake; /* on CLOCK_MONOTONIC, like the deadlines it waits for */
  bool stopping;
} hd_sampler;

/* The live bytes at which p's trigger fires: the lower of the two thresholds set, 0 if none. */
static uint64_t trigger_threshold(hd_collector *c, hd_process *p) {
  uint64_t threshold = c->trigger_live_bytes;
  if (c->trigger_limit_percent != 0) {
    if (!p->memory_limit_known) {
      p->memory_limit = hd_cgroup_memory_limit(p->pid);
      p->memory_limit_known = true;
    }
    const uint64_t share = p->memory_limit / 100 * c->trigger_limit_percent;
    if (share != 0 && (threshold == 0 || share < threshold)) threshold = share;
  }
  return threshold;
}

/* Stores a snapshot of p when its live bytes reach the trigger's threshold, so that a picture of
 * the heap before an out-of-memory kill survives it; once per crossing. An armed process's live
 * bytes include those it held before arming, which no site is credited with but the memory
 * limit counts all the same. */
static void check_trigger(hd_collector *c, hd_process *p, const hd_table_stats *st) {
  const uint64_t threshold = trigger_threshold(c, p);
  if (threshold == 0) return;
  const uint64_t live = st->live_bytes + st->unattributed_bytes;
  if (p->trigger_fired) {
    if (live < threshold / 10 * 9) p->trigger_fired = false;
    return;
  }
  if (live < threshold) return;
  /* Still storing the previous one, or out of memory: tried again at the next sample. */
  if (hd_queue_trigger_snapshot(c, p) != 0) return;
  p->trigger_fired = true;
  hd_log(c, HD_LOG_INFO,
         "%s[%u]: %" PRIu64 " live bytes, over the trigger's %" PRIu64 ": storing a snapshot",
         p->name, (unsigned)p->pid, live, threshold);
}

static void sample_live_processes(hd_collector *c) {
  hd_process **live = malloc(HD_MAX_PROCESSES * sizeof *live);
  if (live == NULL) return;
  const size_t n = hd_live_processes(c, live);
  const int64_t now = (int64_t)hd_monotonic_ns();
  for (size_t i = 0; i < n; i++) {
    hd_table_stats st;
    if (hd_res_reader_stats(live[i]->res, &st) == HD_READ_OK) {
      hd_series_add(&live[i]->series, &st, now);
      check_trigger(c, live[i], &st);
    }
    hd_process_release(live[i]);
  }
  free(live);
}

static void *run_sampler(void *arg) {
  hd_collector *c = arg;
  hd_sampler *s = c->sampler;
  struct timespec next;
  clock_gettime(CLOCK_MONOTONIC, &next);
  pthread_mutex_lock(&s->lock);
  while (!s->stopping) {
    pthread_mutex_unlock(&s->lock);
    sample_live_processes(c);
    pthread_mutex_lock(&s->lock);
    /* Ticks keep their spacing however long a round took; after a stall (a collector stopped
     * or starved of CPU) the schedule restarts from now rather than catching up in a burst. */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    uint64_t at =
        (uint64_t)next.tv_sec * 1000000000u + (uint64_t)next.tv_nsec + c->sample_interval_ns;
    const uint64_t now_ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    if (at + c->sample_interval_ns < now_ns) at = now_ns + c->sample_interval_ns;
    next.tv_sec = (time_t)(at / 1000000000u);
    next.tv_nsec = (long)(at % 1000000000u);
    while (!s->stopping && pthread_cond_timedwait(&s->wake, &s->lock, &next) != ETIMEDOUT) continue;
  }
  pthread_mutex_unlock(&s->lock);
  return NULL;
}

int hd_sampler_start(hd_collector *c) {
  if (c->sample_interval_ns == 0) return 0;
  hd_sampler *s = calloc(1, sizeof *s);
  if (s == NULL) return -ENOMEM;
  pthread_mutex_init(&s->lock, NULL);
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&s->wake, &attr);
  pthread_condattr_destroy(&attr);
  c->sampler = s;
  int rc = hd_start_thread(&s->thread, NULL, run_sampler, c);
  if (rc != 0) {
    c->sampler = NULL;
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->wake);
    free(s);
    return -rc;
  }
  return 0;
}

void hd_sampler_stop(hd_collector *c) {
  hd_sampler *s = c->sampler;
  if (s == NULL) return;
  pthread_mutex_lock(&s->lock);
  s->stopping = true;
  pthread_cond_signal(&s->wake);
  pthread_mutex_unlock(&s->lock);
  pthread_join(s->thread, NULL);
  c->sampler = NULL;
  pthread_mutex_destroy(&s->lock);
  pthread_cond_destroy(&s->wake);
  free(s);
}
