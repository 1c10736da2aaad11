/* One block still reachable (100 bytes, from a global) and one definitely lost (200 bytes):
 * all a leak check of this program may show. No stdio, which would allocate its buffers. */
#include <stdlib.h>

void *g_kept;

__attribute__((noinline)) static void keep(void) { g_kept = malloc(100); }

__attribute__((noinline)) static void lose(void) {
  char *volatile lost = malloc(200);
  lost[0] = 1;
  lost = NULL;
}

/* Overwrites the stack the two calls used, so that no stale copy of the lost pointer stays. */
__attribute__((noinline)) static void scrub(void) {
  volatile char junk[4096];
  for (unsigned i = 0; i < sizeof junk; i++) junk[i] = 0;
}

int main(void) {
  keep();
  lose();
  scrub();
  return 0;
}
