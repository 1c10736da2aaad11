/* A program with a known heap, run under LD_PRELOAD=libheapdump.so by collector_test: it leaks
 * from known functions and threads, stores a named snapshot if given a name, reports
 * "ready <pid> <rc>" on stdout, then reads commands on stdin: "snapshot NAME" stores another
 * named snapshot and answers "stored <rc>"; any other line, or the end of input, frees the
 * worker's blocks and exits. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define HEAPDUMP_WEAK_API
#include "heapdump/heapdump.h"

#define ALPHA_BLOCKS 10
#define ALPHA_SIZE 100
#define WORKER_BLOCKS 5
#define WORKER_SIZE 200

void *volatile keep[64];

__attribute__((noinline)) void alpha_leaks(void) {
  for (int i = 0; i < ALPHA_BLOCKS; i++) {
    keep[i] = malloc(ALPHA_SIZE);
    memset(keep[i], 'A', ALPHA_SIZE);
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

int main(int argc, char **argv) {
  const char *snapshot = argc > 1 ? argv[1] : NULL;
  alpha_leaks();
  pthread_t t;
  pthread_create(&t, NULL, worker_leaks, NULL);
  pthread_join(t, NULL);
  int rc = snapshot && heapdump_available() ? heapdump_take_named_snapshot(snapshot) : -100;
  /* stdin's buffer, given now: the first fgets would otherwise allocate one after "ready", while
   * a test may be comparing the live set with the statistics. */
  static char input_buffer[BUFSIZ];
  setvbuf(stdin, input_buffer, _IOFBF, sizeof input_buffer);
  printf("ready %d %d\n", (int)getpid(), rc);
  fflush(stdout);
  char line[64];
  while (fgets(line, sizeof line, stdin) != NULL) {
    char name[40];
    if (sscanf(line, "snapshot %39s", name) != 1) break;
    printf("stored %d\n", heapdump_available() ? heapdump_take_named_snapshot(name) : -100);
    fflush(stdout);
  }
  /* Free the worker's blocks: only alpha's remain for the exit snapshot. */
  for (int i = 0; i < WORKER_BLOCKS; i++) free(keep[ALPHA_BLOCKS + i]);
  return 0;
}
