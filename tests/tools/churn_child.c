/* A program whose sites differ in what they hold, allocate and throw away, for the report's
 * sorts (heapdump report --sort): keep_tables keeps 65536 bytes in 16 blocks; parse_lines
 * allocates 3,000 blocks of 1,000 bytes, each freed at once (temporary); build_index allocates
 * 2,000 blocks of 2,000 bytes and frees them all at the end, none right after its allocation.
 * At exit only keep_tables' blocks are live. */
#include <stdlib.h>
#include <string.h>

void *volatile kept[16];
void *volatile last_line; /* so that the compiler keeps each line's malloc and free */

__attribute__((noinline)) static void keep_tables(void) {
  for (int i = 0; i < 16; i++) {
    kept[i] = malloc(4096);
    memset(kept[i], 't', 4096);
  }
}

__attribute__((noinline)) static void parse_lines(void) {
  for (int i = 0; i < 3000; i++) {
    char *line = malloc(1000);
    memset(line, 'l', 1000);
    last_line = line;
    free(last_line);
  }
}

__attribute__((noinline)) static void build_index(void) {
  static void *entries[2000];
  for (int i = 0; i < 2000; i++) {
    entries[i] = malloc(2000);
    memset(entries[i], 'i', 2000);
  }
  for (int i = 0; i < 2000; i++) free(entries[i]);
}

int main(void) {
  keep_tables();
  parse_lines();
  build_index();
  return 0;
}
