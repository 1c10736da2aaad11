/* hd_microbench: the cost of one malloc+free pair at a chosen call depth, in as many threads as
 * asked, under whatever allocator or profiler the environment preloads. bench/run runs it under
 * every tool and compares the results of the same round.
 *
 * Each thread descends `depth` real frames (noinline, not tail calls, so the unwinders walk them),
 * warms up, then for `seconds` frees the oldest block of a per-thread ring and allocates a new
 * one, sizes taken from a fixed log-uniform table. The ring keeps a live set (1024 blocks by
 * default), so a profiler's table holds blocks and a free is not of the block just allocated.
 *
 * It also reports which profiler it found in its own process (heapdump's statistics, jemalloc's
 * mallctl, gperftools' IsHeapProfilerRunning), so that a run under a profiler that silently did
 * not engage cannot pass as a fast one. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HEAPDUMP_WEAK_API
#include "heapdump/heapdump.h"

#define SIZE_TABLE 4096 /* power of two */
#define CHUNK 256       /* pairs between two looks at the clock */
/* heaptrack stalls its first allocations for about 0.2 s while its interpreter starts. */
#define MIN_WARM_UP_S 0.25

typedef struct options {
  unsigned depth;
  unsigned threads;
  size_t min_size, max_size;
  double seconds;
  unsigned ring; /* power of two */
  const char *result_path;
} options;

typedef struct worker {
  const options *opt;
  pthread_barrier_t *start;
  size_t sizes[SIZE_TABLE];
  uint64_t pairs;
  uint64_t end_ns; /* when its measured loop ended (its ring is freed after) */
  uint64_t cpu_ns; /* CPU time of its measured loop */
  int failed;
} worker;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t thread_cpu_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Log-uniform sizes in [min, max], the same sequence on every run (xorshift, fixed seed per
 * thread): small blocks dominate, as in real programs, yet every size class is visited. */
static void fill_sizes(size_t *sizes, const options *opt, unsigned thread) {
  uint64_t state = 0x9e3779b97f4a7c15u ^ ((uint64_t)thread * 0xbf58476d1ce4e5b9u);
  unsigned lo = 63u - (unsigned)__builtin_clzl(opt->min_size);
  unsigned hi = opt->max_size > 1 ? 63u - (unsigned)__builtin_clzl(opt->max_size - 1) : 0;
  if (hi < lo) hi = lo;
  for (size_t i = 0; i < SIZE_TABLE; i++) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    unsigned octave = lo + (unsigned)(state % (hi - lo + 1));
    size_t size = ((size_t)1 << octave) + (size_t)((state >> 20) & (((size_t)1 << octave) - 1));
    if (size < opt->min_size) size = opt->min_size;
    if (size > opt->max_size) size = opt->max_size;
    sizes[i] = size;
  }
}

/* Frees the oldest block of the ring and allocates a new one, n times from index *i. */
static int churn_pairs(worker *w, void **ring, uint64_t *i, unsigned n) {
  size_t mask = w->opt->ring - 1;
  for (unsigned k = 0; k < n; k++, (*i)++) {
    size_t slot = *i & mask;
    free(ring[slot]);
    char *p = malloc(w->sizes[*i & (SIZE_TABLE - 1)]);
    if (p == NULL) return -1;
    *(volatile char *)p = (char)*i; /* a program writes what it allocates */
    ring[slot] = p;
  }
  return 0;
}

/* The innermost benchmark frame: fills the ring, warms up (the profiler's tables, caches and
 * helper processes reach their steady state), then measures. */
__attribute__((noinline)) static uint64_t churn(worker *w) {
  const options *opt = w->opt;
  void **ring = calloc(opt->ring, sizeof *ring);
  if (ring == NULL) {
    w->failed = 1;
    pthread_barrier_wait(w->start);
    return 0;
  }
  /* The live set is in place before anything is measured. */
  uint64_t i = 0;
  for (size_t s = 0; s < opt->ring && !w->failed; s++) {
    ring[s] = malloc(w->sizes[s & (SIZE_TABLE - 1)]);
    w->failed = ring[s] == NULL;
  }
  double warm_up = opt->seconds / 10 > MIN_WARM_UP_S ? opt->seconds / 10 : MIN_WARM_UP_S;
  uint64_t warm_until = now_ns() + (uint64_t)(warm_up * 1e9);
  while (!w->failed && now_ns() < warm_until) w->failed = churn_pairs(w, ring, &i, CHUNK) != 0;
  pthread_barrier_wait(w->start);
  uint64_t first = i, cpu0 = thread_cpu_ns();
  uint64_t deadline = now_ns() + (uint64_t)(opt->seconds * 1e9);
  while (!w->failed && now_ns() < deadline) w->failed = churn_pairs(w, ring, &i, CHUNK) != 0;
  w->end_ns = now_ns();
  w->cpu_ns = thread_cpu_ns() - cpu0;
  w->pairs = i - first;
  for (size_t s = 0; s < opt->ring; s++) free(ring[s]);
  free(ring);
  return i;
}

/* One real frame per level: the addition after the call keeps it from being a tail call. */
__attribute__((noinline)) static uint64_t descend(worker *w, unsigned levels) {
  if (levels <= 1) return churn(w);
  uint64_t r = descend(w, levels - 1);
  __asm__ volatile("" : "+r"(r)::"memory");
  return r + 1;
}

static void *thread_main(void *arg) {
  worker *w = arg;
  descend(w, w->opt->depth);
  return NULL;
}

static unsigned usable_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  int n = CPU_COUNT(&set);
  return n > 0 ? (unsigned)n : 1;
}

/* What the preloaded allocator or profiler says about itself, as key=value pairs. */
static void describe_profiler(FILE *out) {
  if (heapdump_available()) {
    struct heapdump_stats stats;
    int rc = heapdump_get_stats(&stats);
    fprintf(out, " heapdump=%d heapdump_blocks_allocated=%" PRIu64, rc == HEAPDUMP_OK,
            rc == HEAPDUMP_OK ? stats.blocks_allocated : 0);
  }
  int (*mallctl)(const char *, void *, size_t *, void *, size_t) =
      (int (*)(const char *, void *, size_t *, void *, size_t))dlsym(RTLD_DEFAULT, "mallctl");
  if (mallctl != NULL) {
    bool config_prof = false, opt_prof = false;
    size_t bool_size = sizeof(bool), lg_sample = 0, size_size = sizeof(size_t);
    (void)mallctl("config.prof", &config_prof, &bool_size, NULL, 0);
    bool_size = sizeof(bool);
    int has_opt = mallctl("opt.prof", &opt_prof, &bool_size, NULL, 0) == 0;
    int has_sample = mallctl("opt.lg_prof_sample", &lg_sample, &size_size, NULL, 0) == 0;
    fprintf(out, " jemalloc_config_prof=%d jemalloc_opt_prof=%d", config_prof, has_opt && opt_prof);
    if (has_sample) fprintf(out, " jemalloc_lg_prof_sample=%zu", lg_sample);
  }
  int (*unwind_floor_active)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "hd_unwind_floor_active");
  if (unwind_floor_active != NULL) fprintf(out, " unwind_floor=%d", unwind_floor_active());
  int (*heap_profiler_running)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "IsHeapProfilerRunning");
  if (heap_profiler_running != NULL) {
    fprintf(out, " gperftools_heap_profiler=%d", heap_profiler_running());
  }
}

static void usage(FILE *out) {
  fprintf(out,
          "usage: hd_microbench [--depth D] [--threads T] [--sizes MIN-MAX] [--seconds S]\n"
          "                     [--ring R] [--result FILE]\n"
          "  --depth D      benchmark frames above each thread's entry at every malloc (8)\n"
          "  --threads T    allocating threads (1)\n"
          "  --sizes A-B    request sizes, log-uniform between A and B bytes (16-65536)\n"
          "  --seconds S    how long each thread is measured, after a warm-up (0.5)\n"
          "  --ring R       live blocks per thread, a power of two (1024)\n"
          "  --result FILE  write the result line here instead of stdout\n");
}

static int parse_sizes(const char *text, size_t *lo, size_t *hi) {
  char *end;
  errno = 0;
  unsigned long a = strtoul(text, &end, 10), b = a;
  if (errno != 0 || end == text) return -1;
  if (*end == '-') {
    const char *second = end + 1;
    b = strtoul(second, &end, 10);
    if (errno != 0 || end == second) return -1;
  }
  if (*end != '\0' || a == 0 || b < a || b > (1ul << 30)) return -1;
  *lo = a;
  *hi = b;
  return 0;
}

static int parse_options(int argc, char **argv, options *opt) {
  static const struct option longopts[] = {
      {"depth", required_argument, 0, 'd'}, {"threads", required_argument, 0, 't'},
      {"sizes", required_argument, 0, 's'}, {"seconds", required_argument, 0, 'S'},
      {"ring", required_argument, 0, 'r'},  {"result", required_argument, 0, 'o'},
      {"help", no_argument, 0, 'h'},        {0, 0, 0, 0}};
  *opt = (options){
      .depth = 8, .threads = 1, .min_size = 16, .max_size = 65536, .seconds = 0.5, .ring = 1024};
  int c;
  char *end;
  while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    switch (c) {
      case 'd':
        opt->depth = (unsigned)strtoul(optarg, &end, 10);
        if (*end != '\0' || opt->depth < 1 || opt->depth > 1000) return -1;
        break;
      case 't':
        opt->threads = (unsigned)strtoul(optarg, &end, 10);
        if (*end != '\0' || opt->threads < 1 || opt->threads > 256) return -1;
        break;
      case 's':
        if (parse_sizes(optarg, &opt->min_size, &opt->max_size) != 0) return -1;
        break;
      case 'S':
        opt->seconds = strtod(optarg, &end);
        if (*end != '\0' || !(opt->seconds > 0 && opt->seconds <= 3600)) return -1;
        break;
      case 'r':
        opt->ring = (unsigned)strtoul(optarg, &end, 10);
        if (*end != '\0' || opt->ring == 0 || (opt->ring & (opt->ring - 1)) != 0 ||
            opt->ring > (1u << 20))
          return -1;
        break;
      case 'o': opt->result_path = optarg; break;
      case 'h': usage(stdout); exit(0);
      default: return -1;
    }
  }
  return optind == argc ? 0 : -1;
}

int main(int argc, char **argv) {
  options opt;
  if (parse_options(argc, argv, &opt) != 0) {
    usage(stderr);
    return 2;
  }
  worker *workers = calloc(opt.threads, sizeof *workers);
  pthread_t *ids = calloc(opt.threads, sizeof *ids);
  pthread_barrier_t start;
  if (workers == NULL || ids == NULL || pthread_barrier_init(&start, NULL, opt.threads + 1) != 0) {
    fprintf(stderr, "hd_microbench: out of memory\n");
    return 1;
  }
  for (unsigned t = 0; t < opt.threads; t++) {
    workers[t].opt = &opt;
    workers[t].start = &start;
    fill_sizes(workers[t].sizes, &opt, t);
    int rc = pthread_create(&ids[t], NULL, thread_main, &workers[t]);
    if (rc != 0) {
      fprintf(stderr, "hd_microbench: pthread_create: %s\n", strerror(rc));
      return 1;
    }
  }
  pthread_barrier_wait(&start);
  uint64_t wall0 = now_ns();
  uint64_t pairs = 0, end = wall0, cpu = 0;
  int failed = 0;
  for (unsigned t = 0; t < opt.threads; t++) {
    pthread_join(ids[t], NULL);
    pairs += workers[t].pairs;
    failed |= workers[t].failed;
    if (workers[t].end_ns > end) end = workers[t].end_ns;
    cpu += workers[t].cpu_ns;
  }
  uint64_t wall = end - wall0;
  if (failed || pairs == 0) {
    fprintf(stderr, "hd_microbench: an allocation failed\n");
    return 1;
  }
  /* Per pair, in core-nanoseconds: wall time times the cores the threads could use, so that
   * 1, 2 and 8 threads on the same machine are comparable. */
  unsigned cores = opt.threads < usable_cpus() ? opt.threads : usable_cpus();
  FILE *out = opt.result_path != NULL ? fopen(opt.result_path, "w") : stdout;
  if (out == NULL) {
    fprintf(stderr, "hd_microbench: %s: %s\n", opt.result_path, strerror(errno));
    return 1;
  }
  fprintf(out,
          "ns_per_pair=%.2f cpu_ns_per_pair=%.2f pairs=%" PRIu64 " wall_ns=%" PRIu64
          " cores=%u depth=%u threads=%u sizes=%zu-%zu",
          (double)wall * cores / (double)pairs, (double)cpu / (double)pairs, pairs, wall, cores,
          opt.depth, opt.threads, opt.min_size, opt.max_size);
  describe_profiler(out);
  fputc('\n', out);
  if (out != stdout) fclose(out);
  free(workers);
  free(ids);
  pthread_barrier_destroy(&start);
  return 0;
}
