// A program with a heap of known reachability, for the leak check's tests. It prints "ready" and
// waits until its stdin closes, with:
//   definitely lost   leak_basket: a Basket (64 bytes) whose vector owns 5 strings
//                     leak_cycle: one of two 3000-byte nodes pointing to each other
//   indirectly lost   leak_basket: the vector's buffer (160 bytes) and the strings (5 x 31 bytes)
//                     leak_cycle: the other node
//   possibly lost     keep_interior: 4000 bytes reached only 16 bytes past their start
//   still reachable   keep_global: 4100 bytes a global points to
//                     keep_on_stack: 4200 bytes only a waiting thread's stack points to
//                     keep_in_tls: 4300 bytes in the main thread's TLS, 4301 in the other's
//                     keep_in_main: 4400 bytes only main's stack points to
// The lost blocks are made last, by a thread that has exited by then: no stale copy of their
// pointers is left on a live stack, in a register, or in the unwritten part of a block
// allocated later from memory freed meanwhile (which a conservative scan would follow).
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <string>
#include <vector>

struct Basket {
  std::vector<std::string> items;
  char tag[40];
};
static_assert(sizeof(Basket) == 64, "the test expects a 64-byte Basket");

struct Node {
  Node *other;
  char payload[3000 - sizeof(Node *)];
};

void *volatile g_global;
char *volatile g_interior;
thread_local void *volatile t_tls;
static int g_hold[2];
static volatile bool g_thread_ready;

__attribute__((noinline)) void leak_basket() {
  Basket *b = new Basket();
  b->items.reserve(5);
  for (int i = 0; i < 5; i++) b->items.push_back(std::string(30, static_cast<char>('a' + i)));
  snprintf(b->tag, sizeof b->tag, "basket");
}

// Opaque to the optimiser, which may otherwise drop an allocation nothing reads.
template <typename T>
__attribute__((noinline)) T *opaque(T *p) {
  __asm__ volatile("" : "+r"(p)::"memory");
  return p;
}

__attribute__((noinline)) void leak_cycle() {
  Node *a = opaque(static_cast<Node *>(malloc(sizeof(Node))));
  Node *b = opaque(static_cast<Node *>(malloc(sizeof(Node))));
  a->other = b;
  b->other = a;
  opaque(a);
}

__attribute__((noinline)) void keep_interior() {
  g_interior = static_cast<char *>(malloc(4000)) + 16;
}

__attribute__((noinline)) void keep_global() { g_global = malloc(4100); }

__attribute__((noinline)) void keep_in_tls(size_t size) { t_tls = malloc(size); }

// jemalloc keeps, in every thread's TLS, the addresses of the gigabytes it looked up lately (its
// radix tree's cache keys), which a conservative scan takes for pointers: a block that starts
// exactly on a gigabyte boundary looks referenced. The Basket is this thread's first allocation,
// so it would start its arena's first slab wherever the allocator's new mapping landed (on a
// boundary in about one run of a hundred). A block of the same size class taken first, and freed
// once the Basket has the slot after it, keeps the Basket off such an address.
static void *make_leaks(void *) {
  void *first = opaque(malloc(sizeof(Basket)));
  leak_basket();
  free(first);
  leak_cycle();
  keep_interior();
  return nullptr;
}

__attribute__((noinline)) void *keep_on_stack() { return malloc(4200); }

static void *waiting_thread(void *) {
  void *volatile mine = keep_on_stack();
  keep_in_tls(4301);
  g_thread_ready = true;
  char c;
  (void)!read(g_hold[0], &c, 1);
  free(mine);
  return nullptr;
}

__attribute__((noinline)) void *keep_in_main() { return malloc(4400); }

int main() {
  printf("pid %d\n", static_cast<int>(getpid())); /* stdout's buffer is allocated now */
  fflush(stdout);
  keep_global();
  keep_in_tls(4300);
  void *volatile mine = keep_in_main();
  pthread_t leaker, waiter;
  if (pipe(g_hold) != 0 || pthread_create(&waiter, nullptr, waiting_thread, nullptr) != 0) return 1;
  while (!g_thread_ready) usleep(1000);
  if (pthread_create(&leaker, nullptr, make_leaks, nullptr) != 0) return 1;
  pthread_join(leaker, nullptr);
  printf("ready\n");
  fflush(stdout);
  char c;
  while (read(0, &c, 1) > 0) {
  }
  free(mine);
  return 0;
}
