/* hd_snapshot_target: the process bench/run snapshots. Run under LD_PRELOAD=libheapdump.so, it
 * allocates a given number of live blocks from a handful of call sites, then keeps allocating
 * threads busy and measures how long each of their malloc and free calls takes, so the harness
 * can see whether a snapshot taken meanwhile pauses them.
 *
 * Protocol on stdin/stdout, one line each:
 *   target prints  "ready pid=P blocks=N realtime=0|1 setup_ms=T"  once the blocks are live
 *   "window"   →   "ok"                                    starts a fresh measurement window
 *   "report"   →   "max_ns=M max_on_cpu_ns=C over_1ms=K ops=O"
 *                  about the window (C: the longest call during which the thread was never
 *                  switched out, i.e. the call itself took that long), and starts a new one
 *   end of input: the target exits.
 *
 * The allocating threads work in bursts of BURST_US then sleep as long (half a core each), so
 * the collector and the client still get CPU on a small machine. With --realtime they run under
 * SCHED_FIFO: other processes then cannot preempt them in user space. A call can still be slow
 * because its thread blocked in the kernel or waited for a CPU held by another process's kernel
 * code (non-preemptible kernels); the context-switch count around each call tells those apart. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define SITES 16
#define RING 64 /* live blocks per allocating thread */
#define BURST_US 200
#define SLOW_NS 1000000u

typedef struct window_stats {
  _Atomic uint64_t max_ns;
  _Atomic uint64_t max_on_cpu_ns; /* longest call during which the thread never left the CPU */
  _Atomic uint64_t over_1ms;
  _Atomic uint64_t ops;
} window_stats;

typedef struct allocator_thread {
  pthread_t id;
  bool want_realtime;
  bool realtime;
  _Alignas(64) window_stats stats;
} allocator_thread;

static atomic_bool g_stop;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* One distinct stack per depth, so the snapshot carries several stack traces. */
__attribute__((noinline)) static void *allocate_at(size_t size, unsigned depth) {
  if (depth == 0) return malloc(size);
  void *p = allocate_at(size, depth - 1);
  __asm__ volatile("" : "+r"(p)::"memory");
  return p;
}

/* --traces: a distinct stack per path of `bits` through two functions that each call on from two
 * call sites (a different return address per branch): TRACE_DEPTH levels give 2^TRACE_DEPTH
 * stacks. The asm statements differ so that the compiler keeps the branches apart. */
#define TRACE_DEPTH 17
static void *walk_b(size_t size, unsigned long bits, unsigned depth);
__attribute__((noinline)) static void *walk_a(size_t size, unsigned long bits, unsigned depth) {
  if (depth == 0) return malloc(size);
  void *p;
  if (bits & 1) {
    p = walk_a(size, bits >> 1, depth - 1);
    __asm__ volatile("nop" : "+r"(p)::"memory");
  } else {
    p = walk_b(size, bits >> 1, depth - 1);
    __asm__ volatile("nop; nop" : "+r"(p)::"memory");
  }
  return p;
}
__attribute__((noinline)) static void *walk_b(size_t size, unsigned long bits, unsigned depth) {
  if (depth == 0) return malloc(size);
  void *p;
  if (bits & 1) {
    p = walk_a(size, bits >> 1, depth - 1);
    __asm__ volatile("nop; nop; nop" : "+r"(p)::"memory");
  } else {
    p = walk_b(size, bits >> 1, depth - 1);
    __asm__ volatile("nop; nop; nop; nop" : "+r"(p)::"memory");
  }
  return p;
}

static void raise_to(_Atomic uint64_t *max, uint64_t ns) {
  uint64_t seen = atomic_load_explicit(max, memory_order_relaxed);
  while (ns > seen && !atomic_compare_exchange_weak_explicit(max, &seen, ns, memory_order_relaxed,
                                                             memory_order_relaxed)) {
  }
}

static void note(window_stats *s, uint64_t ns, bool stayed_on_cpu) {
  raise_to(&s->max_ns, ns);
  if (stayed_on_cpu) raise_to(&s->max_on_cpu_ns, ns);
  if (ns > SLOW_NS) atomic_fetch_add_explicit(&s->over_1ms, 1, memory_order_relaxed);
}

/* Context switches of the calling thread so far, voluntary (it blocked) or not (preempted). */
static long context_switches(void) {
  struct rusage usage;
  if (getrusage(RUSAGE_THREAD, &usage) != 0) return -1;
  return usage.ru_nvcsw + usage.ru_nivcsw;
}

static void *allocate_forever(void *arg) {
  allocator_thread *self = arg;
  if (self->want_realtime) {
    struct sched_param param = {.sched_priority = 1};
    self->realtime = pthread_setschedparam(pthread_self(), SCHED_FIFO, &param) == 0;
  }
  void *ring[RING] = {0};
  uint64_t i = 0;
  const struct timespec rest = {0, BURST_US * 1000};
  while (!atomic_load_explicit(&g_stop, memory_order_relaxed)) {
    uint64_t burst_end = now_ns() + BURST_US * 1000u, ops = 0;
    for (;;) {
      long switches = context_switches();
      uint64_t t0 = now_ns();
      if (t0 >= burst_end) break;
      size_t slot = i % RING;
      free(ring[slot]);
      uint64_t t1 = now_ns();
      ring[slot] = allocate_at(16 + (i % 8) * 16, (unsigned)(i % 4));
      uint64_t t2 = now_ns();
      bool stayed = switches >= 0 && context_switches() == switches;
      note(&self->stats, t1 - t0, stayed);
      note(&self->stats, t2 - t1, stayed);
      ops += 2;
      i++;
    }
    atomic_fetch_add_explicit(&self->stats.ops, ops, memory_order_relaxed);
    nanosleep(&rest, NULL);
  }
  for (size_t s = 0; s < RING; s++) free(ring[s]);
  return NULL;
}

static void usage(FILE *out) {
  fprintf(out,
          "usage: hd_snapshot_target --blocks N [--traces K] [--threads T] [--realtime]\n"
          "  --blocks N    live blocks to hold (16 to 64 bytes each)\n"
          "  --traces K    allocate them from K distinct stacks (at most %lu; default: 16)\n"
          "  --threads T   allocating threads whose call times are measured (2)\n"
          "  --realtime    run those threads under SCHED_FIFO if permitted\n",
          1ul << TRACE_DEPTH);
}

int main(int argc, char **argv) {
  static const struct option longopts[] = {
      {"blocks", required_argument, 0, 'b'}, {"threads", required_argument, 0, 't'},
      {"traces", required_argument, 0, 'k'}, {"realtime", no_argument, 0, 'r'},
      {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
  unsigned long blocks = 0, threads = 2, traces = 0;
  bool want_realtime = false;
  int c;
  char *end;
  while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    switch (c) {
      case 'b':
        errno = 0;
        blocks = strtoul(optarg, &end, 10);
        if (errno != 0 || *end != '\0' || blocks == 0 || blocks > 1000000000ul) {
          usage(stderr);
          return 2;
        }
        break;
      case 't':
        threads = strtoul(optarg, &end, 10);
        if (*end != '\0' || threads == 0 || threads > 64) {
          usage(stderr);
          return 2;
        }
        break;
      case 'k':
        errno = 0;
        traces = strtoul(optarg, &end, 10);
        if (errno != 0 || *end != '\0' || traces == 0 || traces > (1ul << TRACE_DEPTH)) {
          usage(stderr);
          return 2;
        }
        break;
      case 'r': want_realtime = true; break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (blocks == 0 || optind != argc) {
    usage(stderr);
    return 2;
  }

  uint64_t setup0 = now_ns();
  void **held = malloc(blocks * sizeof *held);
  if (held == NULL) {
    fprintf(stderr, "hd_snapshot_target: out of memory\n");
    return 1;
  }
  for (unsigned long i = 0; i < blocks; i++) {
    const size_t size = 16 + (i % 4) * 16;
    held[i] =
        traces ? walk_a(size, i % traces, TRACE_DEPTH) : allocate_at(size, (unsigned)(i % SITES));
    if (held[i] == NULL) {
      fprintf(stderr, "hd_snapshot_target: out of memory after %lu blocks\n", i);
      return 1;
    }
    *(volatile char *)held[i] = (char)i;
  }
  uint64_t setup_ms = (now_ns() - setup0) / 1000000u;

  allocator_thread *workers = calloc(threads, sizeof *workers);
  if (workers == NULL) return 1;
  for (unsigned long t = 0; t < threads; t++) {
    workers[t].want_realtime = want_realtime;
    if (pthread_create(&workers[t].id, NULL, allocate_forever, &workers[t]) != 0) {
      fprintf(stderr, "hd_snapshot_target: pthread_create failed\n");
      return 1;
    }
  }
  /* Let every thread try its scheduling class before reporting it. */
  for (unsigned long t = 0; t < threads; t++) {
    while (atomic_load(&workers[t].stats.ops) == 0) usleep(1000);
  }
  bool realtime = true;
  for (unsigned long t = 0; t < threads; t++) realtime = realtime && workers[t].realtime;
  printf("ready pid=%d blocks=%lu realtime=%d setup_ms=%" PRIu64 "\n", (int)getpid(), blocks,
         realtime, setup_ms);
  fflush(stdout);

  char line[64];
  while (fgets(line, sizeof line, stdin) != NULL) {
    uint64_t max_ns = 0, max_on_cpu_ns = 0, over = 0, ops = 0;
    for (unsigned long t = 0; t < threads; t++) {
      uint64_t m = atomic_exchange(&workers[t].stats.max_ns, 0);
      if (m > max_ns) max_ns = m;
      m = atomic_exchange(&workers[t].stats.max_on_cpu_ns, 0);
      if (m > max_on_cpu_ns) max_on_cpu_ns = m;
      over += atomic_exchange(&workers[t].stats.over_1ms, 0);
      ops += atomic_exchange(&workers[t].stats.ops, 0);
    }
    if (strncmp(line, "report", 6) == 0) {
      printf("max_ns=%" PRIu64 " max_on_cpu_ns=%" PRIu64 " over_1ms=%" PRIu64 " ops=%" PRIu64 "\n",
             max_ns, max_on_cpu_ns, over, ops);
    } else {
      printf("ok\n");
    }
    fflush(stdout);
  }
  atomic_store(&g_stop, true);
  for (unsigned long t = 0; t < threads; t++) pthread_join(workers[t].id, NULL);
  for (unsigned long i = 0; i < blocks; i++) free(held[i]);
  free(held);
  free(workers);
  return 0;
}
