/* A program with known pointer structures in its heap, run under LD_PRELOAD by dartheap_test: a
 * linked list, a binary tree, a cycle nothing else points to, and a pointer into the middle of a
 * buffer. It prints "ready <pid>" and each structure's block addresses, then waits for a line on
 * stdin before exiting. The globals keep the structures alive; the heap scan does not see them,
 * so the first block of each structure is referenced by no other block. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define LIST_LENGTH 4
#define TREE_NODES 7
#define RING_LENGTH 3
#define BUFFER_SIZE 64

struct list_node {
  struct list_node *next;
  long value; /* small numbers: never mistaken for a pointer */
};

struct tree_node {
  struct tree_node *left, *right;
  long value;
};

struct ring_node {
  long value;
  struct ring_node *next;
};

struct holder {
  long value;
  char *middle;
};

struct list_node *volatile list_head;
struct tree_node *volatile tree_nodes[TREE_NODES];
struct ring_node *volatile ring_nodes[RING_LENGTH];
struct holder *volatile buffer_holder;
char *volatile buffer;

__attribute__((noinline)) struct list_node *build_list(void) {
  struct list_node *head = NULL;
  for (int i = LIST_LENGTH - 1; i >= 0; i--) {
    struct list_node *n = malloc(sizeof *n);
    n->next = head;
    n->value = i;
    head = n;
  }
  return head;
}

/* A complete binary tree in heap order: node i's children are 2i+1 and 2i+2. */
__attribute__((noinline)) void build_tree(void) {
  for (int i = 0; i < TREE_NODES; i++) tree_nodes[i] = calloc(1, sizeof(struct tree_node));
  for (int i = 0; i < TREE_NODES; i++) {
    tree_nodes[i]->value = i;
    if (2 * i + 1 < TREE_NODES) tree_nodes[i]->left = tree_nodes[2 * i + 1];
    if (2 * i + 2 < TREE_NODES) tree_nodes[i]->right = tree_nodes[2 * i + 2];
  }
}

__attribute__((noinline)) void build_ring(void) {
  for (int i = 0; i < RING_LENGTH; i++) ring_nodes[i] = malloc(sizeof(struct ring_node));
  for (int i = 0; i < RING_LENGTH; i++) {
    ring_nodes[i]->value = i;
    ring_nodes[i]->next = ring_nodes[(i + 1) % RING_LENGTH];
  }
}

__attribute__((noinline)) void build_interior_pointer(void) {
  buffer = calloc(1, BUFFER_SIZE);
  buffer_holder = malloc(sizeof *buffer_holder);
  buffer_holder->value = 1;
  buffer_holder->middle = buffer + BUFFER_SIZE / 2 + 3;
}

int main(void) {
  list_head = build_list();
  build_tree();
  build_ring();
  build_interior_pointer();
  printf("ready %d\nlist", (int)getpid());
  for (struct list_node *n = list_head; n != NULL; n = n->next) printf(" %p", (void *)n);
  printf("\ntree");
  for (int i = 0; i < TREE_NODES; i++) printf(" %p", (void *)tree_nodes[i]);
  printf("\nring");
  for (int i = 0; i < RING_LENGTH; i++) printf(" %p", (void *)ring_nodes[i]);
  printf("\ninterior %p %p\nend\n", (void *)buffer_holder, (void *)buffer);
  fflush(stdout);
  char line[16];
  if (fgets(line, sizeof line, stdin) == NULL) return 0;
  return 0;
}
