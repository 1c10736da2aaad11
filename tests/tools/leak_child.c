/* A program with known leaks for the heapdump command's tests: leak_small leaves 10 blocks of 100
 * bytes, leak_big 3 blocks of 4096 bytes, balanced() leaves nothing. Exits with status 3 so the
 * tests can check that `heapdump run` propagates it. With "wait", it stays alive until its stdin
 * closes, for live snapshots; with "sleep", for 1.5 s; with "deep", leak_deep also leaves one block
 * of 2222 bytes allocated 100 calls deep (past any frame limit under test). With "hog MB", it
 * also keeps one block of MB megabytes holding byte i = i * 7 & 0xff, and waits as with "wait".
 * With "overflow", it writes 8 bytes past the end of one block (all malloc_usable_size gives it,
 * and more) before freeing it. */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void *volatile kept[64];
static int kept_count;

__attribute__((noinline)) static void keep(void *p) { kept[kept_count++] = p; }

__attribute__((noinline)) void leak_small(void) {
  for (int i = 0; i < 10; i++) keep(malloc(100));
}

__attribute__((noinline)) void leak_big(void) {
  for (int i = 0; i < 3; i++) keep(malloc(4096));
}

__attribute__((noinline)) void balanced(void) {
  for (int i = 0; i < 100; i++) free(malloc(777));
}

/* Each level stays on the stack: the volatile read after the call keeps the compiler from
 * turning the recursion into a loop. */
__attribute__((noinline)) int leak_deep(int depth) {
  if (depth == 0) {
    keep(malloc(2222));
    return 0;
  }
  volatile int level = depth;
  int below = leak_deep(depth - 1);
  return below + level;
}

int main(int argc, char **argv) {
  leak_small();
  leak_big();
  balanced();
  if (argc > 1 && strcmp(argv[1], "deep") == 0) leak_deep(100);
  if (argc > 1 && strcmp(argv[1], "sleep") == 0) usleep(1500 * 1000);
  if (argc > 1 && strcmp(argv[1], "overflow") == 0) {
    volatile unsigned char *block = malloc(40);
    if (block == NULL) return 1;
    const size_t past_end = malloc_usable_size((void *)block) + 8;
    for (size_t i = 0; i < past_end; i++) block[i] = 0x5a;
    free((void *)block);
  }
  if (argc > 2 && strcmp(argv[1], "hog") == 0) {
    size_t size = (size_t)atol(argv[2]) << 20;
    unsigned char *hog = malloc(size);
    if (hog == NULL) return 1;
    for (size_t i = 0; i < size; i++) hog[i] = (unsigned char)(i * 7);
    keep(hog);
  }
  if (argc > 1 && (strcmp(argv[1], "wait") == 0 || strcmp(argv[1], "hog") == 0)) {
    printf("ready\n");
    fflush(stdout);
    char buf[16];
    while (read(STDIN_FILENO, buf, sizeof buf) > 0) {
    }
  }
  return 3;
}
