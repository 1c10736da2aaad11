/* A program holding a linked list, a binary tree and a cycle, for the dartheap reference tests.
 * Every node has a distinct odd size, so the tests can tell nodes apart by size alone; it prints
 * "node SIZE" for each node and "edge FROM_SIZE TO_SIZE" for each pointer, then "ready", and
 * waits until its stdin closes. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct node {
  struct node *a, *b;
} node;

static size_t next_size = 3001;
static node *volatile roots[3];

__attribute__((noinline)) static node *make(void) {
  size_t size = next_size;
  next_size += 8;
  node *n = calloc(1, size);
  printf("node %zu\n", size);
  return n;
}

static size_t size_of(const node *n, node *const *all, const size_t *sizes, size_t count) {
  for (size_t i = 0; i < count; i++) {
    if (all[i] == n) return sizes[i];
  }
  return 0;
}

int main(void) {
  node *all[32];
  size_t sizes[32], count = 0;
#define MAKE(var)               \
  node *var = make();           \
  sizes[count] = next_size - 8; \
  all[count++] = var
  /* list: l0 -> l1 -> l2 -> l3 -> l4 */
  MAKE(l0);
  MAKE(l1);
  MAKE(l2);
  MAKE(l3);
  MAKE(l4);
  l0->a = l1;
  l1->a = l2;
  l2->a = l3;
  l3->a = l4;
  /* tree: t0 (t1 (t3, t4), t2 (t5, t6)) */
  MAKE(t0);
  MAKE(t1);
  MAKE(t2);
  MAKE(t3);
  MAKE(t4);
  MAKE(t5);
  MAKE(t6);
  t0->a = t1;
  t0->b = t2;
  t1->a = t3;
  t1->b = t4;
  t2->a = t5;
  t2->b = t6;
  /* cycle: c0 -> c1 -> c2 -> c0, referenced from no other block */
  MAKE(c0);
  MAKE(c1);
  MAKE(c2);
  c0->a = c1;
  c1->a = c2;
  c2->a = c0;
  roots[0] = l0;
  roots[1] = t0;
  roots[2] = c0;
  for (size_t i = 0; i < count; i++) {
    for (node *const *p = &all[i]->a; p <= &all[i]->b; p++) {
      if (*p != NULL) {
        printf("edge %zu %zu\n", sizes[i], size_of(*p, all, sizes, count));
      }
    }
  }
  printf("ready\n");
  fflush(stdout);
  char buf[16];
  while (read(STDIN_FILENO, buf, sizeof buf) > 0) {
  }
  return 0;
}
