/* Heaps with a purpose, run under LD_PRELOAD=libheapdump.so by the collector tests. Each mode
 * builds its heap, prints "ready <pid>" and then follows commands on stdin; the end of input
 * ends the program.
 *
 *   deep DEPTH BYTES  one 64-byte block allocated DEPTH calls deep in recurse(), and one block of
 *                     BYTES bytes from allocate_big() holding byte i = (i * 7) & 0xff
 *   many N            N blocks of 32 bytes
 *   churn FILE        the consistency workload: see below
 *   grow              nothing yet; commands "grow N" allocate N blocks of GROW_BLOCK bytes in
 *                     grow_site(), "free" frees them all: each answered "ok" once done
 *   resident M A      M MiB in blocks of 1 MiB from malloc and A MiB of anonymous memory
 *                     mapped by the program itself, every page of both written
 *
 * churn: first allocates kept blocks (sizes 1000..1999, each size used by kept blocks only) and
 * writes "address size" of each to FILE, then allocates and frees kFreedEarly blocks of size
 * 7777 (used by nothing else), then starts kChurnThreads threads that allocate and free blocks of
 * sizes 1..999 without pause, growing their live sets so that the allocations table keeps
 * doubling, and prints "ready". Commands: "free-odd" frees the kept blocks of odd index and
 * answers "freed"; "stop" stops the threads and answers "stopped". */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SMALL_BLOCK 64
#define MANY_BLOCK 32
#define GROW_BLOCK 1000
#define MAX_GROWN 100000

enum { kKept = 20000, kFreedEarly = 20000, kChurnThreads = 4, kChurnMaxLive = 60000 };

void *volatile sink;

__attribute__((noinline)) static void recurse(int depth) {
  if (depth <= 1) {
    sink = malloc(SMALL_BLOCK);
    memset(sink, 'd', SMALL_BLOCK);
    return;
  }
  recurse(depth - 1);
  __asm__ volatile("" ::: "memory"); /* not a tail call: every level keeps its frame */
}

__attribute__((noinline)) static void *allocate_big(size_t bytes) {
  unsigned char *big = malloc(bytes);
  if (big == NULL) return NULL;
  for (size_t i = 0; i < bytes; i++) big[i] = (unsigned char)(i * 7);
  return big;
}

static atomic_bool stop_churn;

static void *churn(void *arg) {
  unsigned seed = (unsigned)(uintptr_t)arg * 2654435761u;
  void **held = calloc(kChurnMaxLive, sizeof *held);
  size_t count = 0;
  uint64_t step = 0;
  while (!atomic_load_explicit(&stop_churn, memory_order_relaxed)) {
    /* The live set grows by about one block in a hundred steps, up to kChurnMaxLive. */
    size_t target = step / 100 < kChurnMaxLive ? step / 100 : kChurnMaxLive;
    step++;
    bool grow = count < target ? rand_r(&seed) % 100 < 60 : rand_r(&seed) % 2 == 0;
    if (count == kChurnMaxLive) grow = false;
    if (count > 0 && !grow) {
      size_t victim = (size_t)rand_r(&seed) % count;
      free(held[victim]);
      held[victim] = held[--count];
    } else if (grow) {
      size_t size = 1 + (size_t)rand_r(&seed) % 999;
      held[count] = malloc(size);
      if (held[count] != NULL) count++;
    }
  }
  for (size_t i = 0; i < count; i++) free(held[i]);
  free(held);
  return NULL;
}

static int run_churn(const char *path) {
  static void *kept[kKept];
  FILE *out = fopen(path, "w");
  if (out == NULL) return 1;
  for (int i = 0; i < kKept; i++) {
    size_t size = 1000 + (size_t)i % 1000;
    kept[i] = malloc(size);
    fprintf(out, "%llx %zu\n", (unsigned long long)(uintptr_t)kept[i], size);
  }
  fclose(out);
  static void *early[kFreedEarly];
  for (int i = 0; i < kFreedEarly; i++) early[i] = malloc(7777);
  for (int i = 0; i < kFreedEarly; i++) free(early[i]);
  pthread_t threads[kChurnThreads];
  for (int i = 0; i < kChurnThreads; i++) {
    pthread_create(&threads[i], NULL, churn, (void *)(uintptr_t)(i + 1));
  }
  printf("ready %d\n", (int)getpid());
  fflush(stdout);
  char line[64];
  bool stopped = false;
  while (fgets(line, sizeof line, stdin) != NULL) {
    if (strcmp(line, "free-odd\n") == 0) {
      for (int i = 1; i < kKept; i += 2) free(kept[i]);
      printf("freed\n");
    } else if (strcmp(line, "stop\n") == 0 && !stopped) {
      atomic_store(&stop_churn, true);
      for (int i = 0; i < kChurnThreads; i++) pthread_join(threads[i], NULL);
      stopped = true;
      printf("stopped\n");
    }
    fflush(stdout);
  }
  if (!stopped) {
    atomic_store(&stop_churn, true);
    for (int i = 0; i < kChurnThreads; i++) pthread_join(threads[i], NULL);
  }
  return 0;
}

static void *grown[MAX_GROWN];
static long grown_count;

__attribute__((noinline)) static void grow_site(long n) {
  for (long i = 0; i < n && grown_count < MAX_GROWN; i++) grown[grown_count++] = malloc(GROW_BLOCK);
}

/* stdin's buffer is static: reading a command allocates nothing, so the live set between
 * commands is exactly what the commands made. */
static int run_grow(void) {
  static char input_buffer[BUFSIZ];
  setvbuf(stdin, input_buffer, _IOFBF, sizeof input_buffer);
  printf("ready %d\n", (int)getpid());
  fflush(stdout);
  char line[64];
  long n;
  while (fgets(line, sizeof line, stdin) != NULL) {
    if (sscanf(line, "grow %ld", &n) == 1) {
      grow_site(n);
    } else if (strcmp(line, "free\n") == 0) {
      while (grown_count > 0) free(grown[--grown_count]);
    }
    printf("ok\n");
    fflush(stdout);
  }
  return 0;
}

static void make_resident(long malloc_mib, long mapped_mib) {
  for (long i = 0; i < malloc_mib; i++) {
    char *block = malloc(1 << 20);
    memset(block, 'm', 1 << 20);
    sink = block;
  }
  const size_t mapped = (size_t)mapped_mib << 20;
  char *own = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (own == MAP_FAILED) abort();
  memset(own, 'a', mapped);
}

static void wait_for_end_of_input(void) {
  char line[64];
  while (fgets(line, sizeof line, stdin) != NULL) continue;
}

int main(int argc, char **argv) {
  if (argc == 4 && strcmp(argv[1], "deep") == 0) {
    recurse(atoi(argv[2]));
    sink = allocate_big(strtoull(argv[3], NULL, 10));
  } else if (argc == 3 && strcmp(argv[1], "many") == 0) {
    long n = atol(argv[2]);
    for (long i = 0; i < n; i++) sink = malloc(MANY_BLOCK);
  } else if (argc == 3 && strcmp(argv[1], "churn") == 0) {
    return run_churn(argv[2]);
  } else if (argc == 2 && strcmp(argv[1], "grow") == 0) {
    return run_grow();
  } else if (argc == 4 && strcmp(argv[1], "resident") == 0) {
    make_resident(atol(argv[2]), atol(argv[3]));
  } else {
    fprintf(stderr,
            "usage: heap_workload deep DEPTH BYTES | many N | churn FILE | grow | resident M A\n");
    return 2;
  }
  printf("ready %d\n", (int)getpid());
  fflush(stdout);
  wait_for_end_of_input();
  return 0;
}
