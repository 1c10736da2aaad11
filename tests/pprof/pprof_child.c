/* A program with a known heap, run under LD_PRELOAD=libheapdump.so by pprof_test: live blocks
 * from known functions and threads (one allocation site inlined into its caller), and a site whose
 * blocks were freed but one (its cumulative counters exceed what is live). Reports
 * "ready <pid>" on stdout and waits for input on stdin before exiting. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The sizes and counts pprof_test expects; each size is used by one site only. */
#define ALPHA_BLOCKS 10
#define ALPHA_SIZE 100
#define WORKER_BLOCKS 5
#define WORKER_SIZE 200
#define INLINED_BLOCKS 4
#define INLINED_SIZE 300
#define CHURN_BLOCKS 6
#define CHURN_SIZE 700

void *volatile keep[64];

__attribute__((noinline)) void alpha_leaks(void) {
  for (int i = 0; i < ALPHA_BLOCKS; i++) {
    keep[i] = malloc(ALPHA_SIZE);
    memset(keep[i], 'A', ALPHA_SIZE);
  }
}

static inline __attribute__((always_inline)) void *inlined_block(void) {
  void *p = malloc(INLINED_SIZE);
  memset(p, 'I', INLINED_SIZE);
  return p;
}

__attribute__((noinline)) void inline_caller(void) {
  for (int i = 0; i < INLINED_BLOCKS; i++) keep[20 + i] = inlined_block();
}

/* Frees each block but the last: 1 live, CHURN_BLOCKS allocated. (Through a volatile slot, so
 * that the compiler cannot pair malloc with free away.) */
__attribute__((noinline)) void churn(void) {
  for (int i = 0; i < CHURN_BLOCKS; i++) {
    free(keep[40]);
    keep[40] = malloc(CHURN_SIZE);
  }
}

__attribute__((noinline)) static void *worker_leaks(void *arg) {
  (void)arg;
  pthread_setname_np(pthread_self(), "hd-worker");
  for (int i = 0; i < WORKER_BLOCKS; i++) {
    keep[ALPHA_BLOCKS + i] = malloc(WORKER_SIZE);
    memset(keep[ALPHA_BLOCKS + i], 'W', WORKER_SIZE);
  }
  return NULL;
}

int main(void) {
  alpha_leaks();
  inline_caller();
  churn();
  pthread_t t;
  pthread_create(&t, NULL, worker_leaks, NULL);
  pthread_join(t, NULL);
  printf("ready %d\n", (int)getpid());
  fflush(stdout);
  getchar(); /* a line, or end of file, lets the program exit */
  return 0;
}
