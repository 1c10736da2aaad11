/* A server-like program for heapdump diff's tests. Each request it serves keeps 10 blocks of
 * 1000 bytes in a cache that only grows (remember_request: a slow leak) and replaces each of its
 * 50 buffers of 64 bytes by a new one (churn_buffers: as many live after as before), over a
 * table of 5000 bytes allocated once (setup_table). Modes:
 *   growth_child named N   serves 1 request, stores the named snapshot "before" (through
 *                          heapdump.h), waits 50 ms, serves N more, stores "after"; exits 1
 *                          if either could not be stored. The wait puts the new buffers in
 *                          a later tick of the recording's clock than the ones they replace
 *                          at the same addresses, so that they can be told apart.
 *   growth_child serve N MS   serves N requests, MS milliseconds apart
 */
#define HEAPDUMP_WEAK_API
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "heapdump/heapdump.h"

enum { kCacheBlocksPerRequest = 10, kBuffers = 50 };

static void *volatile cache[100000];
static size_t cached;
static void *volatile buffers[kBuffers];
static void *volatile table;

__attribute__((noinline)) static void setup_table(void) { table = calloc(1, 5000); }

__attribute__((noinline)) static void remember_request(void) {
  for (int i = 0; i < kCacheBlocksPerRequest && cached < sizeof cache / sizeof cache[0]; i++) {
    cache[cached++] = malloc(1000);
  }
}

__attribute__((noinline)) static void churn_buffers(void) {
  for (int i = 0; i < kBuffers; i++) {
    void *fresh = malloc(64);
    void *old = buffers[i];
    buffers[i] = fresh;
    free(old);
  }
}

static void serve(void) {
  remember_request();
  churn_buffers();
}

static int store(const char *name) {
  if (!heapdump_available() || heapdump_take_named_snapshot(name) != HEAPDUMP_OK) {
    fprintf(stderr, "growth_child: could not store snapshot %s\n", name);
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  setup_table();
  if (argc == 3 && strcmp(argv[1], "named") == 0) {
    serve();
    if (store("before") != 0) return 1;
    nanosleep(&(struct timespec){0, 50 * 1000000}, NULL);
    for (long i = atol(argv[2]); i > 0; i--) serve();
    return store("after");
  }
  if (argc == 4 && strcmp(argv[1], "serve") == 0) {
    long pause_ms = atol(argv[3]);
    struct timespec pause = {pause_ms / 1000, pause_ms % 1000 * 1000000};
    for (long i = atol(argv[2]); i > 0; i--) {
      serve();
      nanosleep(&pause, NULL);
    }
    return 0;
  }
  fprintf(stderr, "usage: growth_child named N | serve N MS\n");
  return 2;
}
