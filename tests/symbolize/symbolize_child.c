/* Run under LD_PRELOAD=libheapdump.so by symbolize_test: allocates CHILD_BLOCKS blocks of
 * CHILD_SIZE bytes through an always-inline function inlined into child_allocates(), prints
 * "ready <pid> <line of the malloc call> <line of the inlined call>" and waits for a line on
 * stdin before exiting. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define CHILD_BLOCKS 3
#define CHILD_SIZE 4242

void *volatile child_blocks[CHILD_BLOCKS];
/* Each __LINE__ shares its source line with the call it stands for. */
static int malloc_line, inlined_call_line;

// Each line number is taken on the line of the call it names.
// clang-format off
static inline __attribute__((always_inline)) void *child_inlined_alloc(size_t size) {
  malloc_line = __LINE__; void *block = malloc(size);
  return block;
}

__attribute__((noinline)) void child_allocates(void) {
  for (int i = 0; i < CHILD_BLOCKS; i++) {
    inlined_call_line = __LINE__; child_blocks[i] = child_inlined_alloc(CHILD_SIZE);
  }
}
// clang-format on

int main(void) {
  child_allocates();
  printf("ready %d %d %d\n", (int)getpid(), malloc_line, inlined_call_line);
  fflush(stdout);
  char line[16];
  if (fgets(line, sizeof line, stdin) == NULL) return 0;
  for (int i = 0; i < CHILD_BLOCKS; i++) free(child_blocks[i]);
  return 0;
}
