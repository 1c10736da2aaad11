/* A program whose memory has a known shape over time, for the HTML report's tests: it climbs to
 * a 16 MiB peak in 1 MiB steps, stores a named snapshot there, holds the peak, frees all but one
 * step, and leaks one 4 KiB session on the way out. It prints how long it lived (from the start
 * of main to its return, in ms), so a test knows how many timeline samples to expect. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HEAPDUMP_WEAK_API
#include "heapdump/heapdump.h"

#define STEP (1 << 20)
#define PEAK_STEPS 16

struct session {
  char user[4096];
};

/* Reachable from a global at exit: still reachable, not a leak (volatile: the store is kept though
 * nothing reads it). */
static char *volatile kept_step;

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void pause_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&t, &t) != 0) continue;
}

__attribute__((noinline)) static char *grow_cache(void) {
  char *step = malloc(STEP);
  memset(step, 1, STEP);
  return step;
}

__attribute__((noinline)) static struct session *open_session(const char *user) {
  struct session *s = malloc(sizeof *s);
  snprintf(s->user, sizeof s->user, "%s", user);
  return s;
}

int main(void) {
  const double start = now_ms();
  char *steps[PEAK_STEPS];
  for (int i = 0; i < PEAK_STEPS; i++) {
    steps[i] = grow_cache();
    pause_ms(20);
  }
  if (heapdump_take_named_snapshot("at-peak") != HEAPDUMP_OK)
    fprintf(stderr, "no at-peak snapshot\n");
  pause_ms(600);
  kept_step = steps[0];
  for (int i = 1; i < PEAK_STEPS; i++) free(steps[i]);
  struct session *lost = open_session("nobody"); /* never freed, pointer dropped: the leak */
  printf("session of %s\n", lost->user);
  pause_ms(400);
  printf("lived %.0f ms\n", now_ms() - start);
  return 0;
}
