// Program run under LD_PRELOAD=libheapdump.so by the integration tests. It performs the
// allocations of one scenario (argv[1]), checks what it can itself (exit status 1 + message on
// failure), prints "ready", and waits for a byte on stdin so the test can read its tables.
#define HEAPDUMP_WEAK_API
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <new>
#include <string>
#include <vector>

#include "heapdump/heapdump.h"
#include "table_reader.h"

#define CHECK(c)                                                   \
  do {                                                             \
    if (!(c)) {                                                    \
      fprintf(stderr, "child check failed: %s (line %d)\n", #c, __LINE__); \
      _exit(1);                                                    \
    }                                                              \
  } while (0)

static volatile size_t g_huge = SIZE_MAX;  // opaque to compile-time size checks
static std::vector<void *> g_keep;  // reserved up front in main
static pthread_mutex_t g_keep_lock = PTHREAD_MUTEX_INITIALIZER;

static void keep(void *p) {
  pthread_mutex_lock(&g_keep_lock);
  g_keep.push_back(p);
  pthread_mutex_unlock(&g_keep_lock);
}

// Opaque to the optimiser so allocations are not elided.
__attribute__((noinline)) static void *opaque(void *p) {
  __asm__ volatile("" : "+r"(p));
  return p;
}

static const int kThreads = 8, kPerThread = 20000, kKeepPerThread = 250;

__attribute__((noinline)) static void *worker(void *arg) {
  long t = (long)arg;
  char name[16];
  snprintf(name, sizeof(name), "worker-%ld", t);
  pthread_setname_np(pthread_self(), name);
  std::vector<void *> mine;
  mine.reserve(kPerThread);
  for (int i = 0; i < kPerThread; i++) {
    mine.push_back(opaque(malloc(7700 + t)));
    if (i % 3 == 2) {  // churn: free an older one
      free(mine[mine.size() / 2]);
      mine.erase(mine.begin() + (long)(mine.size() / 2));
    }
  }
  while (mine.size() > (size_t)kKeepPerThread) {
    free(mine.back());
    mine.pop_back();
  }
  for (void *p : mine) keep(p);
  return nullptr;
}

static void scenario_threads() {
  pthread_t th[kThreads];
  for (long t = 0; t < kThreads; t++) CHECK(pthread_create(&th[t], nullptr, worker, (void *)t) == 0);
  for (auto &t : th) pthread_join(t, nullptr);
}

static void scenario_cxx() {
  keep(opaque(new char[4441]));
  keep(opaque(new (std::align_val_t(64)) char[4442]));
  CHECK(((uintptr_t)g_keep.back() & 63) == 0);
  keep(opaque(new (std::nothrow) char[4443]));
  keep(opaque(new std::string(4444 - 1, 'x')));  // 4444-byte buffer inside
  char *gone = (char *)opaque(new char[4445]);
  delete[] gone;
  long *one = (long *)opaque(new long(5));
  ::operator delete(one, sizeof(long));  // sized delete
  void *al = opaque(::operator new(4446, std::align_val_t(256)));
  ::operator delete(al, 4446, std::align_val_t(256));
}

static void scenario_realloc() {
  void *p = opaque(malloc(5001));
  p = opaque(realloc(p, 5002));  // grows within its size class: in place
  keep(p);
  keep(opaque(realloc(nullptr, 5003)));
  void *r = opaque(malloc(5004));
  CHECK(opaque(realloc(r, 0)) == nullptr);  // glibc: frees
  void *s = opaque(malloc(16));
  memset(s, 7, 16);
  void *moved = opaque(realloc(s, 1 << 20));  // moves
  CHECK(((unsigned char *)moved)[15] == 7);
  keep(moved);
  void *big = opaque(malloc(300000));
  void *small = opaque(realloc(big, 5005));  // shrink
  keep(small);
  errno = 0;
  CHECK(opaque(realloc(small, g_huge - 4096)) == nullptr && errno == ENOMEM);
  CHECK(opaque(reallocarray(nullptr, g_huge / 2, 3)) == nullptr && errno == ENOMEM);
}

static void scenario_edge() {
  void *z = opaque(malloc(0));
  CHECK(z != nullptr);
  keep(z);
  errno = 0;
  CHECK(opaque(malloc(g_huge)) == nullptr && errno == ENOMEM);
  errno = 0;
  CHECK(opaque(malloc(g_huge / 2)) == nullptr && errno == ENOMEM);
  errno = 0;
  CHECK(opaque(calloc(g_huge / 2, 4)) == nullptr && errno == ENOMEM);
  void *m = nullptr;
  CHECK(posix_memalign(&m, 0, 10) == EINVAL);
  CHECK(posix_memalign(&m, 4, 10) == EINVAL);   // not a multiple of sizeof(void *)
  CHECK(posix_memalign(&m, 24, 10) == EINVAL);  // not a power of two
  CHECK(posix_memalign(&m, (size_t)1 << 40, g_huge / 2) == ENOMEM);
  for (size_t a = 8; a <= 65536; a *= 2) {
    CHECK(posix_memalign(&m, a, 6000) == 0 && ((uintptr_t)m % a) == 0);
    free(m);
    void *x = opaque(aligned_alloc(a, 6000));
    CHECK(x && (uintptr_t)x % a == 0);
    free(x);
    x = opaque(memalign(a, 6000));
    CHECK(x && (uintptr_t)x % a == 0);
    free(x);
  }
  CHECK(posix_memalign(&m, 64, 6001) == 0);
  keep(m);
  keep(opaque(aligned_alloc(4096, 6002)));
  keep(opaque(memalign(128, 6003)));
  void *v = opaque(valloc(6004));
  CHECK((uintptr_t)v % 4096 == 0);
  keep(v);
  void *pv = opaque(pvalloc(6005));  // rounded to 8192
  CHECK((uintptr_t)pv % 4096 == 0 && malloc_usable_size(pv) >= 8192);
  keep(pv);
  void *c = opaque(calloc(6006, 1));
  for (int i = 0; i < 6006; i++) CHECK(((char *)c)[i] == 0);
  keep(c);
  CHECK(malloc_usable_size(c) >= 6006 && malloc_usable_size(nullptr) == 0);
}

// Opens this process's own allocations table (after fork: the child's own copy).
static hd_alloc_reader *open_own_table() {
  DIR *d = opendir("/proc/self/fd");
  CHECK(d);
  hd_alloc_reader *r = nullptr;
  while (struct dirent *e = readdir(d)) {
    char path[512], link[256];
    snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
    ssize_t n = readlink(path, link, sizeof(link) - 1);
    if (n <= 0) continue;
    link[n] = 0;
    if (strstr(link, "memfd:heapdump-allocations")) {
      int fd = open(path, O_RDONLY);
      CHECK(fd >= 0);
      CHECK(hd_alloc_reader_open(fd, &r) == HD_READ_OK);
      close(fd);
    }
  }
  closedir(d);
  CHECK(r);
  return r;
}

static int count_size(hd_alloc_reader *r, uint64_t size) {
  hd_live_block *b;
  size_t n;
  CHECK(hd_alloc_reader_snapshot(r, &b, &n) == HD_READ_OK);
  int c = 0;
  for (size_t i = 0; i < n; i++) c += b[i].size == size;
  free(b);
  return c;
}

static volatile int g_stop;
static void *hammer(void *) {
  while (!g_stop) free(opaque(malloc(100 + (rand() & 1023))));
  return nullptr;
}

static void scenario_fork() {
  keep(opaque(malloc(8888)));
  pthread_t th[4];
  for (auto &t : th) CHECK(pthread_create(&t, nullptr, hammer, nullptr) == 0);
  for (int i = 0; i < 20; i++) {
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
      hd_alloc_reader *r = open_own_table();
      hd_alloc_table_info info;
      CHECK(hd_alloc_reader_info(r, &info) == HD_READ_OK && info.pid == (uint32_t)getpid());
      if (count_size(r, 8888) != 1) _exit(2);
      free(g_keep[0]);
      void *p = opaque(malloc(9999));
      if (count_size(r, 8888) != 0 || count_size(r, 9999) != 1) _exit(3);
      free(p);
      _exit(0);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  g_stop = 1;
  for (auto &t : th) pthread_join(t, nullptr);
}

static void scenario_dlopen(const char *lib) {
  void *h = dlopen(lib, RTLD_NOW);
  CHECK(h);
  auto fn = (void *(*)(size_t))dlsym(h, "testlib_allocate");
  CHECK(fn);
  keep(fn(7123));
  CHECK(dlclose(h) == 0);
}

int main(int argc, char **argv) {
  g_keep.reserve(100000);
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "threads") scenario_threads();
  else if (mode == "cxx") scenario_cxx();
  else if (mode == "realloc") scenario_realloc();
  else if (mode == "edge") scenario_edge();
  else if (mode == "fork") scenario_fork();
  else if (mode == "dlopen") scenario_dlopen(argv[2]);
  else if (mode == "api") {
    struct heapdump_stats st;
    if (heapdump_available()) {
      keep(opaque(malloc(3333)));
      CHECK(heapdump_get_stats(&st) == HEAPDUMP_OK);
      CHECK(st.live_blocks >= 1 && st.blocks_allocated >= st.live_blocks && st.peak_live_bytes >= 3333);
      CHECK(heapdump_get_stats(nullptr) == HEAPDUMP_ERROR_INVALID_ARGUMENT);
      CHECK(heapdump_take_named_snapshot("") == HEAPDUMP_ERROR_INVALID_ARGUMENT);
      CHECK(heapdump_take_named_snapshot("x") == HEAPDUMP_ERROR_NO_COLLECTOR);
      printf("loaded\n");
    } else {
      printf("not-loaded\n");
    }
  } else {
    fprintf(stderr, "unknown mode\n");
    return 2;
  }
  printf("ready\n");
  fflush(stdout);
  char c;
  (void)!read(0, &c, 1);
  return 0;
}
