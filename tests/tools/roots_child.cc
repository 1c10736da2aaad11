// Blocks reachable only from memory the program mapped itself, and blocks truly lost beside them:
// one kind of root per mode, each site a function of its own, the expected leak check known from
// the program. Run by guest_test.cc under `heapdump run` and valgrind's memcheck.
//   roots_child mapping   a block kept only in a private anonymous mapping; one lost
//   roots_child shared    a block kept only in a shared anonymous mapping; one lost
//   roots_child sparse    a block kept only 40 GiB into a 64 GiB sparse mapping; one lost
//   roots_child pools     1,000 objects in mmap'd pools (a garbage-collected heap's shape), each
//                         owning a 100-byte block; 500 objects dropped (their memory cleared), so
//                         500 blocks definitely lost, 500 still reachable
//   roots_child list      a C-style list of 250 nodes whose head is lost: 1 definitely lost, 249
//                         indirectly
//   roots_child static    500 blocks kept only in a 320 MiB static array (a module's data far
//                         past any size read at once), spread over all of it; one lost
//   roots_child tree      a binary tree of 32,767 nodes of 56 bytes a global points to, half of
//                         it built by another thread (in a glibc thread arena), and a 256 KiB
//                         block (one glibc maps on its own) another global points to; two
//                         1 MiB blocks, the first pointing to the second, lost: 1 definitely
//                         lost, 1 indirectly. Sampled, nearly every recorded node hangs from
//                         unrecorded ones.
//   roots_child environ   run with 1,000 variables PAD...: 100 blocks kept only in 100 of their
//                         slots past the 600th of the envp array (as setproctitle keeps
//                         its copies of argv), more than a page above where main's caller began
//                         (the top of the stack glibc reports for the main thread); one lost
#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace {

// Opaque to the compiler, so that stores of pointers stay and registers do not keep them.
void *volatile g_sink;
template <typename T>
T opaque(T p) {
  g_sink = reinterpret_cast<void *>(p);
  return reinterpret_cast<T>(g_sink);
}

void *map(size_t size, int flags) {
  void *m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_ANONYMOUS | flags, -1, 0);
  if (m == MAP_FAILED) {
    std::perror("mmap");
    std::exit(3);
  }
  return m;
}

}  // namespace

// The sites, with C names so that reports name them plainly.
extern "C" {

__attribute__((noinline)) void keep_in_mapping(void **slot) { *slot = opaque(std::malloc(1000)); }

__attribute__((noinline)) void lose_block() {
  char *volatile lost = static_cast<char *>(std::malloc(2000));
  lost[0] = 1;
  lost = nullptr;
}

__attribute__((noinline)) void *pool_payload() { return opaque(std::malloc(100)); }

__attribute__((noinline)) void keep_in_static(void **slot) { *slot = opaque(std::malloc(100)); }

// An empty string, as an environment entry must stay readable as one.
__attribute__((noinline)) char *keep_in_environ() {
  return opaque(static_cast<char *>(std::calloc(1, 100)));
}

struct Node {
  Node *next;
  char data[48];
};

__attribute__((noinline)) void lose_list() {
  Node *volatile head = nullptr;
  for (int i = 0; i < 250; i++) {
    Node *n = opaque(static_cast<Node *>(std::malloc(sizeof(Node))));  // its stores stay
    n->next = head;
    head = n;
  }
  head = nullptr;
}

struct TreeNode {
  TreeNode *left, *right;
  char data[40];
};

__attribute__((noinline)) TreeNode *keep_in_tree(int depth) {
  if (depth == 0) return nullptr;
  TreeNode *n = opaque(static_cast<TreeNode *>(std::malloc(sizeof(TreeNode))));
  std::memset(n->data, depth, sizeof n->data);
  n->left = keep_in_tree(depth - 1);
  n->right = keep_in_tree(depth - 1);
  return n;
}

__attribute__((noinline)) void *keep_big(size_t size) { return opaque(std::calloc(1, size)); }

__attribute__((noinline)) void lose_pair() {
  void **first = opaque(static_cast<void **>(std::malloc(1 << 20)));  // its store stays
  first[0] = opaque(std::malloc(1 << 20));
}

}  // extern "C"

namespace {

constexpr size_t kStaticSlots = (size_t{320} << 20) / sizeof(void *);
void *g_static[kStaticSlots];  // .bss: only the pages written become resident

TreeNode *volatile g_tree;
void *volatile g_big;

struct PoolObject {
  void *payload;
  long id;
};

// Overwrites the stack the calls used, so that no dead frame keeps a stale pointer.
__attribute__((noinline)) void scrub() {
  volatile char junk[16384];
  for (size_t i = 0; i < sizeof junk; i++) junk[i] = 0;
}

}  // namespace

int main(int argc, char **argv, char **envp) {
  if (argc != 2) return 2;
  const char *mode = argv[1];
  if (std::strcmp(mode, "mapping") == 0 || std::strcmp(mode, "shared") == 0) {
    const bool shared = mode[0] == 's';
    void **m = static_cast<void **>(map(4096, shared ? MAP_SHARED : MAP_PRIVATE));
    keep_in_mapping(&m[17]);
    lose_block();
  } else if (std::strcmp(mode, "sparse") == 0) {
    const size_t size = size_t{64} << 30;
    char *m = static_cast<char *>(map(size, MAP_PRIVATE | MAP_NORESERVE));
    keep_in_mapping(reinterpret_cast<void **>(m + (size_t{40} << 30) + 64));
    lose_block();
  } else if (std::strcmp(mode, "pools") == 0) {
    // Ten pools of 100 objects, as a collector's arenas would hold them.
    PoolObject *pools[10];
    for (auto &pool : pools) {
      pool = static_cast<PoolObject *>(map(1 << 20, MAP_PRIVATE));
      for (int i = 0; i < 100; i++) pool[i] = PoolObject{pool_payload(), i};
    }
    // The collector drops every other object: its memory is cleared, its payload leaks.
    for (auto &pool : pools) {
      for (int i = 0; i < 100; i += 2) std::memset(&pool[i], 0, sizeof pool[i]);
    }
  } else if (std::strcmp(mode, "list") == 0) {
    lose_list();
  } else if (std::strcmp(mode, "environ") == 0) {
    size_t count = 0;
    while (envp[count] != nullptr) count++;
    if (count < 1000) {
      std::fprintf(stderr, "roots_child environ needs 1,000 environment variables, has %zu\n",
                   count);
      return 2;
    }
    // The padding's slots (PAD...), from the end: the others are variables the program and the
    // profiler still read.
    int kept = 0;
    for (size_t i = count; i-- > 600 && kept < 100;) {
      if (std::strncmp(envp[i], "PAD", 3) != 0) continue;
      envp[i] = keep_in_environ();
      kept++;
    }
    if (kept < 100) return 2;
    lose_block();
  } else if (std::strcmp(mode, "tree") == 0) {
    TreeNode *right = nullptr;
    std::thread builder([&right] { right = keep_in_tree(14); });
    builder.join();
    TreeNode *root = opaque(static_cast<TreeNode *>(std::malloc(sizeof(TreeNode))));
    root->left = keep_in_tree(14);
    root->right = right;
    g_tree = root;
    g_big = keep_big(256 << 10);
    lose_pair();
  } else if (std::strcmp(mode, "static") == 0) {
    for (size_t i = 0; i < 500; i++) keep_in_static(&g_static[i * (kStaticSlots / 500) + 7]);
    lose_block();
  } else {
    return 2;
  }
  scrub();
  g_sink = nullptr;
  return 0;
}
