// Program run under LD_PRELOAD=libheapdump.so by the integration tests. It performs the
// allocations of one scenario (argv[1]), checks what it can itself (exit status 1 + message on
// failure), prints "ready", and waits for a byte on stdin so the test can read its tables.
#define HEAPDUMP_WEAK_API
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <new>
#include <string>
#include <vector>

#define UNW_LOCAL_ONLY
#include <libunwind.h>

#include "heapdump/heapdump.h"

// heapdump 0.1's entry point, a function then (a macro now): what programs built against that
// header call.
extern "C" __attribute__((weak)) int heapdump_get_stats_v0_1(struct heapdump_stats *out) __asm__(
    "heapdump_get_stats");
#include "heapdump/contract/names.h"
#include "table_reader.h"

#define CHECK(c)                                                           \
  do {                                                                     \
    if (!(c)) {                                                            \
      fprintf(stderr, "child check failed: %s (line %d)\n", #c, __LINE__); \
      _exit(1);                                                            \
    }                                                                      \
  } while (0)

static volatile size_t g_huge = SIZE_MAX;  // opaque to compile-time size checks
static std::vector<void *> g_keep;         // reserved up front in main
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
  for (long t = 0; t < kThreads; t++)
    CHECK(pthread_create(&th[t], nullptr, worker, (void *)t) == 0);
  for (auto &t : th) pthread_join(t, nullptr);
}

// As "threads", but the workers stay alive, blocked, while the tables are read: what they
// counted of their shared trace is still in their own counters records.
static int g_alive_hold[2];
static std::atomic<int> g_alive_done{0};

static void *alive_worker(void *arg) {
  worker(arg);
  g_alive_done++;
  char c;
  (void)!read(g_alive_hold[0], &c, 1);  // alive until the process exits
  return nullptr;
}

static void scenario_threads_alive() {
  CHECK(pipe(g_alive_hold) == 0);
  for (long t = 0; t < kThreads; t++) {
    pthread_t th;
    CHECK(pthread_create(&th, nullptr, alive_worker, (void *)t) == 0);
    pthread_detach(th);
  }
  while (g_alive_done < kThreads) usleep(1000);
}

// Sampled recording: four threads allocate through every entry point, reallocate and free
// blocks of 16-4000 bytes, each written over the whole of what malloc_usable_size says and
// checked byte for byte before it is freed or reallocated, and hand a quarter of them to the
// main thread to free; 500 blocks of 100000 bytes, which the test's rate always samples, are
// kept.
static const int kSampledThreads = 4, kSampledRounds = 30000, kSampledRing = 64;
static std::vector<void *> g_handed;  // freed by the main thread; under g_keep_lock

__attribute__((noinline)) static void *churn_alloc(unsigned r, size_t size) {
  void *p = nullptr;
  switch (r % 6) {
    case 0: p = malloc(size); break;
    case 1:
      p = calloc(1, size);
      for (size_t i = 0; p && i < size; i++) CHECK(((unsigned char *)p)[i] == 0);
      break;
    case 2: CHECK(posix_memalign(&p, 64, size) == 0 && (uintptr_t)p % 64 == 0); break;
    case 3:
      p = aligned_alloc(256, size);
      CHECK((uintptr_t)p % 256 == 0);
      break;
    case 4:
      p = memalign(32, size);
      CHECK((uintptr_t)p % 32 == 0);
      break;
    default: p = realloc(nullptr, size); break;
  }
  CHECK(p != nullptr && malloc_usable_size(p) >= size);
  return opaque(p);
}

__attribute__((noinline)) static void *churn(void *arg) {
  char name[16];
  snprintf(name, sizeof(name), "churn-%ld", (long)arg);
  pthread_setname_np(pthread_self(), name);
  unsigned r = 12345u + (unsigned)(long)arg;
  void *ring[kSampledRing] = {};
  for (int i = 0; i < kSampledRounds; i++) {
    r = r * 1103515245u + 12345u;
    const int at = (int)((r >> 8) % kSampledRing);
    const size_t size = 16 + (r >> 12) % 3985;
    if (ring[at] != nullptr && (r & 0x30000) == 0) {
      // Grown or shrunk: what it held comes along, and its new end is written over too.
      const unsigned char first = *(unsigned char *)ring[at];
      const size_t kept = std::min(malloc_usable_size(ring[at]), size);
      void *q = opaque(realloc(ring[at], size));
      CHECK(q != nullptr && malloc_usable_size(q) >= size);
      for (size_t k = 0; k < kept; k++) CHECK(((unsigned char *)q)[k] == first);
      memset(q, first, malloc_usable_size(q));
      ring[at] = q;
      continue;
    }
    if (ring[at] != nullptr) {
      // Every byte the program was given is as it wrote it, its last ones included.
      const unsigned char *b = (const unsigned char *)ring[at];
      for (size_t k = 0; k < malloc_usable_size(ring[at]); k++)
        CHECK(b[k] == (unsigned char)(at + 1));
      if (i % 4 == 0) {
        pthread_mutex_lock(&g_keep_lock);
        g_handed.push_back(ring[at]);
        pthread_mutex_unlock(&g_keep_lock);
      } else {
        free(ring[at]);
      }
    }
    ring[at] = churn_alloc(r >> 20, size);
    memset(ring[at], at + 1, malloc_usable_size(ring[at]));
  }
  for (void *p : ring) free(p);
  return nullptr;
}

__attribute__((noinline)) static void *keep_sampled() { return opaque(malloc(100000)); }

static void scenario_sampled_churn() {
  g_handed.reserve((size_t)kSampledThreads * kSampledRounds);
  pthread_t th[kSampledThreads];
  for (long t = 0; t < kSampledThreads; t++)
    CHECK(pthread_create(&th[t], nullptr, churn, (void *)t) == 0);
  for (int i = 0; i < 500; i++) keep(keep_sampled());
  for (auto &t : th) pthread_join(t, nullptr);
  for (void *p : g_handed) free(p);
  printf("churned\n");
}

// Prints "roots TID THREAD_POINTER LOCAL" for the calling thread after it allocated (a local
// variable's address is inside its stack).
static void print_roots(const char *who) {
  int local = 0;
  keep(opaque(malloc(64)));
  printf("roots %s %ld %p %p\n", who, (long)syscall(SYS_gettid), __builtin_thread_pointer(),
         opaque(&local));
  fflush(stdout);
}

static int g_hold[2];
static std::atomic<bool> g_held_printed{false};

static void *held_thread(void *) {
  print_roots("thread");
  g_held_printed = true;
  char c;
  (void)!read(g_hold[0], &c, 1);  // alive until the process exits
  return nullptr;
}

// The main thread and one more, alive while the tables are read, have recorded their roots.
static void scenario_roots() {
  print_roots("main");
  CHECK(pipe(g_hold) == 0);
  pthread_t th;
  CHECK(pthread_create(&th, nullptr, held_thread, nullptr) == 0);
  pthread_detach(th);
  while (!g_held_printed) usleep(1000);
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
    if (strstr(link, "memfd:" HD_MEMFD_ALLOCATIONS)) {
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

// Allocates from 2^bits distinct call paths: path i makes stack trace i.
__attribute__((noinline)) static void *path_b(unsigned i, int depth);
__attribute__((noinline)) static void *path_a(unsigned i, int depth) {
  void *p = depth == 0 ? malloc(40) : (i & 1 ? path_b : path_a)(i >> 1, depth - 1);
  return opaque(p);  // not a tail call: this frame stays on the stack
}
__attribute__((noinline)) static void *path_b(unsigned i, int depth) {
  void *p = depth == 0 ? malloc(40) : (i & 1 ? path_b : path_a)(i >> 1, depth - 1);
  return opaque(p);
}

static volatile int g_stop;
// Keeps the library's locks busy: slot locks (malloc/free), the resources lock (new thread
// names, new stack traces).
static void *hammer(void *arg) {
  long id = (long)arg;
  for (unsigned i = 0; !g_stop; i++) {
    free(opaque(malloc(100 + (rand() & 1023))));
    if (i % 256 == 0) {
      char name[16];
      snprintf(name, sizeof(name), "hammer-%ld-%u", id, i / 256 % 100);
      pthread_setname_np(pthread_self(), name);
      free(path_a(i / 256 + (unsigned)id * 4096, 12));
    }
  }
  return nullptr;
}

struct Hammers {
  pthread_t th[4];
  Hammers() {
    g_stop = 0;
    for (long i = 0; i < 4; i++) CHECK(pthread_create(&th[i], nullptr, hammer, (void *)i) == 0);
  }
  ~Hammers() {
    g_stop = 1;
    for (auto &t : th) pthread_join(t, nullptr);
  }
};

static int wait_status(pid_t pid) {
  int st = 0;
  CHECK(waitpid(pid, &st, 0) == pid);
  return st;
}

static bool exited_zero(int st) { return WIFEXITED(st) && WEXITSTATUS(st) == 0; }

static void scenario_fork() {
  keep(opaque(malloc(8888)));
  Hammers hammers;
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
    CHECK(exited_zero(wait_status(pid)));
  }
}

// Fork while other threads hold the library's locks; the child stays alive so the test can ask
// a real collector for both processes. The child keeps 8811 (inherited) and 8822 (its own);
// the parent keeps 8811 and 8833.
static pid_t g_forked_child = -1;
static void scenario_fork_register() {
  keep(opaque(malloc(8811)));
  int sync[2];
  CHECK(pipe(sync) == 0);
  {
    Hammers hammers;
    for (int i = 0; i < 20; i++) free(opaque(malloc(1000 + i)));
    g_forked_child = fork();
    CHECK(g_forked_child >= 0);
    if (g_forked_child == 0) {
      keep(opaque(malloc(8822)));
      printf("forked %d\n", (int)getpid());
      fflush(stdout);
      close(sync[1]);
      char c;
      (void)!read(0, &c, 1);  // the test closes our stdin when done
      _exit(0);
    }
    close(sync[1]);
    char c;
    CHECK(read(sync[0], &c, 1) == 0);  // the child has printed its pid
    close(sync[0]);
  }
  keep(opaque(malloc(8833)));
}

// The library's descriptors: its tables (memfds) and its collector connection (sockets).
static std::vector<int> library_fds() {
  std::vector<int> fds;
  DIR *d = opendir("/proc/self/fd");
  CHECK(d);
  while (struct dirent *e = readdir(d)) {
    char path[512], link[256];
    snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
    ssize_t len = readlink(path, link, sizeof(link) - 1);
    if (len <= 0) continue;
    link[len] = 0;
    const int fd = atoi(e->d_name);
    if (fd != dirfd(d) && (strstr(link, "memfd:heapdump") || strstr(link, "socket:")))
      fds.push_back(fd);
  }
  closedir(d);
  return fds;
}

// A daemon that closes every descriptor after start and opens its own files (log_0 .. log_7 in
// dir): the library must not close, write, send or reuse them, neither when a named snapshot is
// stored nor in a fork child, which re-registers. Prints "closed" once it has closed every
// descriptor and waits for a line on its stdin; then prints "snapshot RC" and, once its child
// and it have written one line to every file and found every file still open, "done"; then
// waits for the end of its stdin.
static void scenario_foreign_fds(const char *dir) {
  keep(opaque(malloc(7711)));
  const std::vector<int> ours = library_fds();
  CHECK(ours.size() >= 4);              // two tables, the registry connection, the snapshot sink
  for (int fd : ours) CHECK(fd >= 64);  // clear of the numbers a program gets first
  CHECK(syscall(SYS_close_range, 3, ~0U, 0) == 0);
  enum { kLogs = 8 };
  int logs[kLogs];
  ino_t inodes[kLogs];
  for (int i = 0; i < kLogs; i++) {
    std::string path = std::string(dir) + "/log_" + std::to_string(i);
    logs[i] = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    CHECK(logs[i] >= 0);
    struct stat st;
    CHECK(fstat(logs[i], &st) == 0);
    inodes[i] = st.st_ino;
  }
  auto still_open = [&] {
    for (int i = 0; i < kLogs; i++) {
      struct stat st;
      if (fstat(logs[i], &st) != 0 || st.st_ino != inodes[i]) {
        fprintf(stderr, "log_%d (fd %d): %s\n", i, logs[i],
                fstat(logs[i], &st) != 0 ? strerror(errno) : "now another file");
        return false;
      }
    }
    return true;
  };
  printf("closed\n");
  fflush(stdout);
  char go;
  CHECK(read(0, &go, 1) == 1);
  printf("snapshot %d\n", heapdump_take_named_snapshot("after-close"));
  fflush(stdout);
  CHECK(still_open());
  pid_t child = fork();
  CHECK(child >= 0);
  if (child == 0) {
    keep(opaque(malloc(7722)));  // the child records, and re-registers, with its own tables
    bool ok = still_open();
    for (int i = 0; i < kLogs; i++) ok = ok && write(logs[i], "child\n", 6) == 6;
    _exit(ok && still_open() ? 0 : 1);
  }
  int status = 0;
  CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(still_open());
  for (int i = 0; i < kLogs; i++) CHECK(write(logs[i], "parent\n", 7) == 7);
  printf("done\n");
  fflush(stdout);
  char c;
  (void)!read(0, &c, 1);  // the test takes a live snapshot, then closes our stdin
}

// Allocates from `depth` nested frames, each a return address the unwinder has not seen.
__attribute__((noinline)) static void allocate_deep(int depth) {
  if (depth == 0) {
    keep(opaque(malloc(48)));
    return;
  }
  allocate_deep(depth - 1);
  __asm__ volatile("" ::: "memory");  // not a tail call: every level keeps its frame
}

// The unwinder's own descriptors (libunwind's validation pipe) are taken by a program that closes
// every descriptor and opens hundreds of files: unwinding afterwards must not read, write or
// close any of them. Prints "intact" when every file is as the program left it.
static void scenario_unwinder_fds(const char *dir) {
  for (int d = 1; d < 40; d++) allocate_deep(d);  // the unwinder has made its pipe
  CHECK(syscall(SYS_close_range, 3, ~0U, 0) == 0);
  enum { kFiles = 700 };  // past the library's high numbers (512 and up)
  std::vector<int> files;
  std::vector<ino_t> inodes;
  for (int i = 0; i < kFiles; i++) {
    std::string path = std::string(dir) + "/file_" + std::to_string(i);
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    CHECK(fd >= 0 && write(fd, "program\n", 8) == 8 && lseek(fd, 0, SEEK_SET) == 0);
    struct stat st;
    CHECK(fstat(fd, &st) == 0);
    files.push_back(fd);
    inodes.push_back(st.st_ino);
  }
  for (int d = 40; d < 400; d++) allocate_deep(d);
  bool intact = true;
  for (int i = 0; i < kFiles; i++) {
    struct stat st;
    char bytes[16] = {};
    if (fstat(files[i], &st) != 0 || st.st_ino != inodes[i] || st.st_size != 8 ||
        lseek(files[i], 0, SEEK_CUR) != 0 || pread(files[i], bytes, sizeof bytes, 0) != 8 ||
        memcmp(bytes, "program\n", 8) != 0) {
      fprintf(stderr, "file_%d (fd %d) was touched\n", i, files[i]);
      intact = false;
    }
  }
  printf("%s\n", intact ? "intact" : "touched");
  fflush(stdout);
}

// Two SCHED_FIFO threads of different priorities on one CPU share a pool of blocks. The higher
// one wakes every ~50 us and preempts the lower one, often inside the library's critical
// sections; a lock that spins or yields for its preempted holder would never let it run again,
// and the program would hang for good (the alarm then kills it). Prints "realtime unavailable"
// (and returns) where real-time scheduling is not permitted.
static std::atomic<void *> g_pool[64];
static void *realtime_worker(void *arg) {
  const unsigned high = arg != nullptr;
  for (unsigned i = 0; i < 100000; i++) {
    void *old = g_pool[(i * 7 + high) & 63].exchange(malloc(16 + (i & 255)));
    free(old);
    if (high && i % 32 == 0) {
      struct timespec pause = {0, 50000};
      nanosleep(&pause, nullptr);
    }
  }
  return nullptr;
}

static void scenario_realtime() {
  cpu_set_t one_cpu;
  CPU_ZERO(&one_cpu);
  CPU_SET(sched_getcpu(), &one_cpu);
  CHECK(sched_setaffinity(0, sizeof(one_cpu), &one_cpu) == 0);  // inherited by the threads
  alarm(60);
  pthread_t threads[2];
  for (int high = 0; high < 2; high++) {
    pthread_attr_t attr;
    CHECK(pthread_attr_init(&attr) == 0);
    CHECK(pthread_attr_setinheritsched(&attr, PTHREAD_EXPLICIT_SCHED) == 0);
    CHECK(pthread_attr_setschedpolicy(&attr, SCHED_FIFO) == 0);
    struct sched_param param = {};
    param.sched_priority = high ? 20 : 10;
    CHECK(pthread_attr_setschedparam(&attr, &param) == 0);
    int rc = pthread_create(&threads[high], &attr, realtime_worker, high ? &g_pool : nullptr);
    pthread_attr_destroy(&attr);
    if (rc == EPERM) {
      CHECK(high == 0);
      printf("realtime unavailable\n");
      return;
    }
    CHECK(rc == 0);
  }
  for (pthread_t &t : threads) CHECK(pthread_join(t, nullptr) == 0);
  alarm(0);
  for (auto &slot : g_pool) free(slot.exchange(nullptr));
  printf("realtime done\n");
}

extern "C" void *__libc_malloc(size_t size);
extern "C" void *__libc_calloc(size_t n, size_t size);
extern "C" void *__libc_memalign(size_t align, size_t size);
extern "C" void __libc_free(void *p);

// Sizes glibc refuses (a request beyond RAM plus swap under the default overcommit policy) fail
// under the preload too, whatever the backend, with ENOMEM; what glibc grants is granted. glibc's
// own answer is asked for directly (__libc_*), so the check holds on any machine. Small blocks
// are 16-byte aligned, as glibc guarantees.
// Threads that store named snapshots without pause are cancelled, one after another, at random
// moments (mostly while they wait for the collector). Each call must run to its end, and the
// call made after them must not hang on a lock a cancelled thread left held (the alarm would
// kill the program).
static void *snapshot_until_cancelled(void *) {
  for (;;) {
    CHECK(heapdump_take_named_snapshot("cancelled") == HEAPDUMP_OK);
    pthread_testcancel();
  }
  return nullptr;
}

static void scenario_cancel() {
  alarm(60);
  for (int i = 0; i < 20; i++) {
    pthread_t thread;
    CHECK(pthread_create(&thread, nullptr, snapshot_until_cancelled, nullptr) == 0);
    usleep(2000 + 1000 * i);
    CHECK(pthread_cancel(thread) == 0);
    void *result = nullptr;
    CHECK(pthread_join(thread, &result) == 0 && result == PTHREAD_CANCELED);
  }
  printf("snapshot %d\n", heapdump_take_named_snapshot("after-cancel"));
  fflush(stdout);
}

static void scenario_impossible() {
  const size_t k64TiB = size_t{64} << 40, k1TiB = size_t{1} << 40;
  auto glibc_grants = [](void *p) {
    __libc_free(p);
    return p != nullptr;
  };
  auto check = [](const char *what, void *p, bool glibc_would) {
    const int error = errno;
    if ((p != nullptr) != glibc_would || (!p && error != ENOMEM)) {
      fprintf(stderr, "%s: %p (errno %d), glibc %s\n", what, p, error,
              glibc_would ? "grants" : "refuses");
      exit(1);
    }
    free(p);
  };
  const bool huge = glibc_grants(__libc_malloc(k64TiB));
  printf("glibc %s 64 TiB\n", huge ? "grants" : "refuses");
  errno = 0;
  check("malloc(64 TiB)", malloc(k64TiB), huge);
  const bool tera = glibc_grants(__libc_calloc(size_t{1} << 20, size_t{1} << 20));
  errno = 0;
  check("calloc(2^20, 2^20)", calloc(size_t{1} << 20, size_t{1} << 20), tera);
  const bool aligned = glibc_grants(__libc_memalign(k1TiB, 10));
  errno = 0;
  check("memalign(1 TiB, 10)", memalign(k1TiB, 10), aligned);
  void *q = nullptr;
  CHECK(posix_memalign(&q, k1TiB, 10) == (aligned ? 0 : ENOMEM));
  free(q);
  void *p = malloc(100);
  memset(p, 7, 100);
  errno = 0;
  void *grown = realloc(p, k64TiB);
  check("realloc(p, 64 TiB)", grown, huge);
  if (!grown) {
    CHECK(static_cast<unsigned char *>(p)[99] == 7);  // the old block is untouched
    free(p);
  }
  CHECK(malloc(g_huge / 2 + 1) == nullptr && errno == ENOMEM);
  for (size_t size = 0; size <= 32; size++) {
    std::vector<void *> blocks;
    for (int i = 0; i < 64; i++) {
      blocks.push_back(malloc(size));
      CHECK(reinterpret_cast<uintptr_t>(blocks.back()) % 16 == 0);
    }
    for (void *b : blocks) free(b);
  }
  void *small = malloc(3);
  void *bigger = realloc(small, 7);  // stays a 16-byte block
  CHECK(bigger && reinterpret_cast<uintptr_t>(bigger) % 16 == 0);
  free(bigger);
  printf("impossible done\n");
}

static int count_fds(const char *target) {
  DIR *d = opendir("/proc/self/fd");
  CHECK(d);
  int n = 0;
  while (struct dirent *e = readdir(d)) {
    char path[512], link[256];
    snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
    ssize_t len = readlink(path, link, sizeof(link) - 1);
    if (len <= 0) continue;
    link[len] = 0;
    n += strstr(link, target) != nullptr;
  }
  closedir(d);
  return n;
}

static bool maps_mention(const char *what) {
  int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  CHECK(fd >= 0);
  std::string maps;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) maps.append(buf, (size_t)n);
  close(fd);
  return maps.find(what) != std::string::npos;
}

// Started by "spawn" through exec: checks whether this process is instrumented exactly when
// expected, and that nothing of the parent's recording came along.
static int scenario_probe(bool expect_instrumented) {
  const char *preload = getenv("LD_PRELOAD");
  CHECK((preload != nullptr && strstr(preload, "libheapdump") != nullptr) == expect_instrumented);
  CHECK(maps_mention("libheapdump") == expect_instrumented);
  CHECK((heapdump_available() != 0) == expect_instrumented);
  // The parent's memfds are close-on-exec: at most our own table is open.
  CHECK(count_fds("memfd:" HD_MEMFD_ALLOCATIONS) == (expect_instrumented ? 1 : 0));
  void *p = opaque(malloc(12121));
  CHECK(p);
  memset(p, 1, 12121);
  if (expect_instrumented) {
    hd_alloc_reader *r = open_own_table();
    hd_alloc_table_info info;
    CHECK(hd_alloc_reader_info(r, &info) == HD_READ_OK && info.pid == (uint32_t)getpid());
    CHECK(count_size(r, 12121) == 1);
    CHECK(count_size(r, 8888) == 0);  // a new image: the parent's live set is not ours
    hd_alloc_reader_close(r);
  }
  free(p);
  return 0;
}

// vfork + exec and posix_spawn of this program ("probe"), and posix_spawn of a static binary,
// while other threads allocate.
static void scenario_spawn(const char *self, bool expect_instrumented, const char *static_probe) {
  keep(opaque(malloc(8888)));
  Hammers hammers;
  const char *expect = expect_instrumented ? "1" : "0";
  char *probe_argv[] = {(char *)self, (char *)"probe", (char *)expect, nullptr};
  char *static_argv[] = {(char *)static_probe, nullptr};
  for (int i = 0; i < 10; i++) {
    pid_t pid = vfork();
    CHECK(pid >= 0);
    if (pid == 0) {
      execve(self, probe_argv, environ);
      _exit(127);
    }
    CHECK(exited_zero(wait_status(pid)));
    CHECK(posix_spawn(&pid, self, nullptr, nullptr, probe_argv, environ) == 0);
    CHECK(exited_zero(wait_status(pid)));
    CHECK(posix_spawn(&pid, static_probe, nullptr, nullptr, static_argv, environ) == 0);
    CHECK(exited_zero(wait_status(pid)));
  }
}

// A SIGALRM storm while this thread allocates; the handler allocates and frees too. It keeps
// its blocks (3001) in a ring; the main loop keeps 100 blocks of 3002; everything else is
// freed. The handler's malloc may fail (ENOMEM) when it interrupts the real allocator.
static const int kRing = 32;
static void *volatile g_ring[kRing];
static volatile unsigned g_handled, g_handler_failures;
// Sampled on glibc, the program's call for a block sampling leaves out is glibc's alone, and a
// handler that interrupts glibc there would enter it again, as without the library (where that
// breaks the heap). So a sampled run's handler leaves out the signals that land in libc's code
// on the program's behalf: where the first frame outside libc is not the library's, or is one of
// its exported malloc, calloc, realloc and free, whose calls of glibc are unmarked (ends in a
// jump when optimised; a call, which returns there, in a build without optimisation). It counts
// those that land in the library's code, and in libc's on the library's behalf (a call the
// library marks: the handler's allocation there must fail, its free wait), which it must survive.
struct CodeRanges {
  uintptr_t lo[8], hi[8];
  int n = 0;
  bool Holds(uintptr_t pc) const {
    for (int i = 0; i < n; i++)
      if (pc >= lo[i] && pc < hi[i]) return true;
    return false;
  }
};
static CodeRanges g_libc_code, g_library_code, g_unmarked_callers;
static bool g_skip_in_libc;
static volatile unsigned g_skipped_in_libc, g_in_library, g_in_libc_for_library,
    g_failed_in_libc_for_library;

// Whether the first frame outside libc of the interrupted context is the library's, and not one
// of its exported calls that call glibc unmarked (false where the stack cannot be followed that
// far). A caller's address is its return address: the call is the byte before it.
static bool libc_called_by_library(void *context) {
  unw_cursor_t cursor;
  if (unw_init_local2(&cursor, static_cast<unw_context_t *>(context), UNW_INIT_SIGNAL_FRAME) != 0)
    return false;
  bool exact = true; /* the interrupted instruction, or one a signal frame resumes */
  for (int i = 0; i < 64; i++) {
    unw_word_t ip;
    if (unw_get_reg(&cursor, UNW_REG_IP, &ip) != 0) return false;
    if (!exact) ip--;
    if (!g_libc_code.Holds(ip)) return g_library_code.Holds(ip) && !g_unmarked_callers.Holds(ip);
    exact = unw_is_signal_frame(&cursor) > 0;
    if (unw_step(&cursor) <= 0) return false;
  }
  return false;
}

// The library's exported malloc, calloc, realloc and free, by their symbols' sizes.
static CodeRanges unmarked_callers() {
  CodeRanges ranges;
  for (const char *name : {"malloc", "calloc", "realloc", "free"}) {
    void *at = dlsym(RTLD_DEFAULT, name);
    Dl_info info;
    ElfW(Sym) *symbol = nullptr;
    CHECK(at != nullptr && g_library_code.Holds((uintptr_t)at));
    CHECK(dladdr1(at, &info, reinterpret_cast<void **>(&symbol), RTLD_DL_SYMENT) != 0 &&
          symbol != nullptr && symbol->st_size > 0);
    ranges.lo[ranges.n] = (uintptr_t)at;
    ranges.hi[ranges.n++] = (uintptr_t)at + symbol->st_size;
  }
  return ranges;
}

static CodeRanges executable_ranges_of(const char *name_part) {
  CodeRanges ranges;
  struct Search {
    const char *name_part;
    CodeRanges *ranges;
  } search = {name_part, &ranges};
  dl_iterate_phdr(
      [](struct dl_phdr_info *info, size_t, void *data) {
        auto *s = static_cast<Search *>(data);
        if (info->dlpi_name == nullptr || strstr(info->dlpi_name, s->name_part) == nullptr)
          return 0;
        for (int i = 0; i < info->dlpi_phnum; i++) {
          const ElfW(Phdr) &ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD || (ph.p_flags & PF_X) == 0) continue;
          CHECK(s->ranges->n < 8);
          s->ranges->lo[s->ranges->n] = info->dlpi_addr + ph.p_vaddr;
          s->ranges->hi[s->ranges->n++] = info->dlpi_addr + ph.p_vaddr + ph.p_memsz;
        }
        return 1;
      },
      &search);
  return ranges;
}

static void on_alarm(int, siginfo_t *, void *context) {
  int saved = errno;
  const uintptr_t pc = (uintptr_t) static_cast<ucontext_t *>(context)->uc_mcontext.gregs[REG_RIP];
  bool for_library = false;
  if (g_skip_in_libc && g_libc_code.Holds(pc)) {
    if (!libc_called_by_library(context)) {
      g_skipped_in_libc = g_skipped_in_libc + 1;
      return;
    }
    for_library = true;
    g_in_libc_for_library = g_in_libc_for_library + 1;
  }
  if (g_library_code.Holds(pc) && !g_unmarked_callers.Holds(pc)) g_in_library = g_in_library + 1;
  unsigned n = g_handled;
  free(g_ring[n % kRing]);
  void *p = malloc(3001);
  if (!p) g_handler_failures = g_handler_failures + 1;
  if (!p && for_library) g_failed_in_libc_for_library = g_failed_in_libc_for_library + 1;
  g_ring[n % kRing] = p;
  if (n % 4 == 1) free(calloc(1, 3003));
  if (n % 4 == 3) {
    void *q = malloc(3004);
    void *r = q ? realloc(q, 30050) : nullptr;
    free(r ? r : q);
  }
  g_handled = n + 1;
  errno = saved;
}

// on_alt_stack: the handler runs on an alternate signal stack (sigaltstack, SA_ONSTACK), which an
// unwinder must follow back to the thread's own stack. sampled: only some blocks are recorded,
// so the kept ones are at most, not exactly, recorded (the freed ones never); the handler skips
// the signals that interrupt libc on the program's behalf (above).
static void scenario_signals(bool on_alt_stack, bool sampled = false) {
  g_libc_code = executable_ranges_of("libc.so.6");
  g_library_code = executable_ranges_of("libheapdump");
  CHECK(g_libc_code.n > 0 && g_library_code.n > 0);
  g_unmarked_callers = unmarked_callers();
  if (sampled) { /* libunwind's own set-up, done before the first signal needs it */
    unw_context_t context;
    unw_cursor_t cursor;
    CHECK(unw_getcontext(&context) == 0 && unw_init_local(&cursor, &context) == 0);
    CHECK(unw_step(&cursor) >= 0);
  }
  g_skip_in_libc = sampled;
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_alarm;
  sa.sa_flags = SA_RESTART | SA_SIGINFO;
  if (on_alt_stack) {
    static char alt_stack[1 << 16];
    stack_t ss = {};
    ss.ss_sp = alt_stack;
    ss.ss_size = sizeof alt_stack;
    CHECK(sigaltstack(&ss, nullptr) == 0);
    sa.sa_flags |= SA_ONSTACK;
  }
  CHECK(sigaction(SIGALRM, &sa, nullptr) == 0);
  struct itimerval storm = {{0, 200}, {0, 200}};
  CHECK(setitimer(ITIMER_REAL, &storm, nullptr) == 0);
  void *mine[100] = {};
  for (unsigned long i = 0; g_handled < 2000 || i < 200000; i++) {
    unsigned k = i % 100;
    free(mine[k]);
    mine[k] = opaque(malloc(3002));
    if (i % 7 == 0) mine[k] = opaque(realloc(mine[k], 3002));
    free(opaque(malloc(3006 + i % 50)));
  }
  struct itimerval off = {{0, 0}, {0, 0}};
  CHECK(setitimer(ITIMER_REAL, &off, nullptr) == 0);
  sigset_t alarm;
  sigemptyset(&alarm);
  sigaddset(&alarm, SIGALRM);
  CHECK(sigprocmask(SIG_BLOCK, &alarm, nullptr) == 0);  // a signal still pending stays so
  for (void *p : mine) keep(p);
  int ring_live = 0;
  for (void *p : g_ring) ring_live += p != nullptr;
  hd_alloc_reader *r = open_own_table();
  if (sampled) {
    CHECK(count_size(r, 3001) <= ring_live && count_size(r, 3002) <= 100);
  } else if (count_size(r, 3001) != ring_live) {  // which blocks differ, for whoever meets this
    hd_live_block *b;
    size_t n;
    CHECK(hd_alloc_reader_snapshot(r, &b, &n) == HD_READ_OK);
    int unrecorded = 0, stale = 0;
    for (void *p : g_ring) {
      bool found = false;
      for (size_t i = 0; i < n && p; i++)
        found |= b[i].address == (uintptr_t)p && b[i].size == 3001;
      unrecorded += p && !found;
    }
    for (size_t i = 0; i < n; i++) {
      bool in_ring = false;
      for (void *p : g_ring) in_ring |= b[i].address == (uintptr_t)p;
      stale += b[i].size == 3001 && !in_ring;
    }
    struct heapdump_stats stats = {};
    CHECK(heapdump_get_stats(&stats) == HEAPDUMP_OK);
    fprintf(stderr,
            "ring: %d live, %d of them unrecorded, %d records of 3001 outside it; %llu dropped\n",
            ring_live, unrecorded, stale, (unsigned long long)stats.dropped_allocations);
    free(b);
    CHECK(false);
  }
  CHECK(sampled || count_size(r, 3002) == 100);
  for (uint64_t size = 3003; size < 3056; size++) CHECK(count_size(r, size) == 0);
  CHECK(count_size(r, 30050) == 0);
  hd_alloc_reader_close(r);
  printf(
      "handled %u failed %u ring %d in-library %u in-libc-for-library %u (failed %u) "
      "skipped-in-libc %u\n",
      g_handled, g_handler_failures, ring_live, g_in_library, g_in_libc_for_library,
      g_failed_in_libc_for_library, g_skipped_in_libc);
}

// Threads created and exiting all the time while others allocate. Each short-lived thread keeps
// one block (4321) and frees two more in its teardown: a pthread key destructor (4323) and a
// thread_local object's destructor (4324). Each long-lived thread keeps 10 blocks (4322).
static pthread_key_t g_teardown_key;
struct TeardownFree {
  void *p = nullptr;
  ~TeardownFree() { free(p); }
};
static thread_local TeardownFree t_teardown;

static void *short_lived(void *) {
  CHECK(pthread_setspecific(g_teardown_key, malloc(4323)) == 0);
  t_teardown.p = opaque(malloc(4324));
  for (int i = 0; i < 300; i++) free(opaque(malloc(64 + i)));
  keep(opaque(malloc(4321)));
  return nullptr;
}

static void *long_lived(void *) {
  void *mine[10] = {};
  for (unsigned i = 0; !g_stop; i++) {
    free(mine[i % 10]);
    mine[i % 10] = opaque(malloc(4322));
    free(opaque(realloc(opaque(malloc(16)), 5000)));
  }
  for (void *p : mine) keep(p);
  return nullptr;
}

static const int kChurnRounds = 60, kChurnWidth = 8;

static void scenario_thread_churn() {
  CHECK(pthread_key_create(&g_teardown_key, free) == 0);
  g_stop = 0;
  pthread_t steady[4];
  for (auto &t : steady) CHECK(pthread_create(&t, nullptr, long_lived, nullptr) == 0);
  for (int round = 0; round < kChurnRounds; round++) {
    pthread_t wave[kChurnWidth];
    for (auto &t : wave) CHECK(pthread_create(&t, nullptr, short_lived, nullptr) == 0);
    for (auto &t : wave) CHECK(pthread_join(t, nullptr) == 0);
  }
  g_stop = 1;
  for (auto &t : steady) CHECK(pthread_join(t, nullptr) == 0);
}

// The whole of malloc_usable_size is the program's: filling it is no overflow. Writing past it
// is, onto the bytes the library keeps after each block, and is counted. Four bytes past (a
// terminator, a small struct) leave the block's link whole: its free still erases its record.
// Eight bytes past destroy it: that record stays (the block shows as live), and the free costs no
// more. Sizes 7131 and 7132 mark the blocks kept.
static void scenario_overflow() {
  for (size_t size : {1, 24, 100, 4000, 70000}) {
    auto *p = (unsigned char *)opaque(malloc(size));
    const size_t usable = malloc_usable_size(p);
    CHECK(p && usable >= size);
    memset(p, 0xab, usable);
    free(opaque(p));  // opaque: stores to a block freed at once are otherwise dropped
  }
  auto *over4 = (unsigned char *)opaque(malloc(24));
  CHECK(over4);
  memset(over4, 0xcd, malloc_usable_size(over4) + 4);
  free(opaque(over4));
  auto *over8 = (unsigned char *)opaque(malloc(40));
  CHECK(over8);
  memset(over8, 0xcd, malloc_usable_size(over8) + 8);
  free(opaque(over8));
  auto *kept = (unsigned char *)opaque(realloc(opaque(malloc(7131)), 7132));
  CHECK(kept);
  memset(kept, 1, malloc_usable_size(kept));
  keep(kept);
  struct heapdump_stats st;
  CHECK(heapdump_get_stats(&st) == HEAPDUMP_OK && st.blocks_freed >= 7);
}

// A block freed twice (free, or realloc of a freed block): the library ends the program, as
// glibc would, before the allocator hands the block out twice. Reaching the end says it did not.
static void scenario_double_free(bool by_realloc) {
  void *p = opaque(malloc(32));
  void *again = opaque(p);  // the same block, which the compiler cannot tell
  CHECK(p);
  free(p);
  if (by_realloc) {
    keep(opaque(realloc(again, 64)));
  } else {
    free(again);
  }
  void *a = opaque(malloc(32)), *b = opaque(malloc(32));
  printf("%s\n", a == b ? "the block was handed out twice" : "the double free went unnoticed");
  exit(0);
}

// jemalloc's own API, called as a program calls it (folly does once it finds jemalloc serving
// malloc). Each function is found as the program's own calls would find it: the *allocx
// functions are the library's, and nothing else of the jemalloc inside it (mallctl) is in the
// program's scope. Keeps 5000, 5001 (4 KiB-aligned, zeroed), 50030 (moved from 5003 by rallocx)
// and 5005 (from 5004, moved to be 256-byte aligned); frees the rest.
static void scenario_jemalloc_api() {
  using mallocx_fn = void *(*)(size_t, int);
  using rallocx_fn = void *(*)(void *, size_t, int);
  using xallocx_fn = size_t (*)(void *, size_t, size_t, int);
  using sallocx_fn = size_t (*)(const void *, int);
  using nallocx_fn = size_t (*)(size_t, int);
  using dallocx_fn = void (*)(void *, int);
  using sdallocx_fn = void (*)(void *, size_t, int);
  auto mallocx = (mallocx_fn)dlsym(RTLD_DEFAULT, "mallocx");
  auto rallocx = (rallocx_fn)dlsym(RTLD_DEFAULT, "rallocx");
  auto xallocx = (xallocx_fn)dlsym(RTLD_DEFAULT, "xallocx");
  auto sallocx = (sallocx_fn)dlsym(RTLD_DEFAULT, "sallocx");
  auto nallocx = (nallocx_fn)dlsym(RTLD_DEFAULT, "nallocx");
  auto dallocx = (dallocx_fn)dlsym(RTLD_DEFAULT, "dallocx");
  auto sdallocx = (sdallocx_fn)dlsym(RTLD_DEFAULT, "sdallocx");
  CHECK(mallocx && rallocx && xallocx && sallocx && nallocx && dallocx && sdallocx);
  printf("mallctl in the program's scope: %s\n", dlsym(RTLD_DEFAULT, "mallctl") ? "yes" : "no");
  const char *backend = getenv("HEAPDUMP_ALLOCATOR");
  const bool jemalloc_backend = backend == nullptr || strcmp(backend, "system") != 0;
  const int kZero = 0x40;
  auto lg_align = [](int lg) { return lg; };

  keep(opaque(mallocx(5000, 0)));
  auto *aligned = (unsigned char *)opaque(mallocx(5001, kZero | lg_align(12)));
  CHECK(aligned && (uintptr_t)aligned % 4096 == 0);
  for (size_t i = 0; i < 5001; i++) CHECK(aligned[i] == 0);
  keep(aligned);
  // Told a size, the program may use all of it, and free with it.
  void *told = opaque(mallocx(4093, 0));
  const size_t usable = sallocx(told, 0);
  CHECK(usable >= 4093 && usable == malloc_usable_size(told));
  if (jemalloc_backend) CHECK(nallocx(4093, 0) == usable);
  memset(told, 0x5a, usable);
  sdallocx(opaque(told), usable, 0);
  auto *moved = (unsigned char *)opaque(malloc(5003));
  memset(moved, 7, 5003);
  moved = (unsigned char *)opaque(rallocx(moved, 50030, 0));
  CHECK(moved && moved[5002] == 7);
  CHECK(xallocx(moved, 60000, 0, 0) == malloc_usable_size(moved));
  keep(moved);
  auto *realigned = (unsigned char *)opaque(mallocx(5004, 0));
  memset(realigned, 9, 5004);
  realigned = (unsigned char *)opaque(rallocx(realigned, 5005, lg_align(8)));
  CHECK(realigned && (uintptr_t)realigned % 256 == 0 && realigned[5003] == 9);
  keep(realigned);
  dallocx(opaque(malloc(5006)), 0);
  free(opaque(mallocx(5007, 0)));
}

// Under a small HEAPDUMP_MAX_MEMORY: far more live blocks and stack traces than fit.
static void scenario_cap() {
  const int n = 60000;
  std::vector<unsigned char *> blocks(n);
  for (int i = 0; i < n; i++) {
    blocks[i] = (unsigned char *)opaque(malloc(24));
    CHECK(blocks[i]);
    memset(blocks[i], i & 0xff, 24);
  }
  for (unsigned i = 0; i < 8192; i++) keep(path_a(i, 13));
  for (int i = 0; i < n; i++)
    for (int b = 0; b < 24; b++) CHECK(blocks[i][b] == (i & 0xff));
  struct heapdump_stats st;
  CHECK(heapdump_get_stats(&st) == HEAPDUMP_OK && st.dropped_allocations > 0);
  // The oldest blocks were recorded; freeing them makes room for new records.
  for (int i = 0; i < n / 2; i++) free(blocks[i]);
  for (int i = 0; i < 100; i++) keep(opaque(malloc(25)));
  for (int i = n / 2; i < n; i++) keep(blocks[i]);
}

static void write_file(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  CHECK(fd >= 0 && write(fd, text, strlen(text)) == (ssize_t)strlen(text));
  close(fd);
}

// A thread renamed by writing its comm file directly (no prctl, no pthread_setname_np): 5551 is
// allocated under the old name, 5553 after enough allocations for the name to be read again.
static void *renamed_through_proc(void *) {
  pthread_setname_np(pthread_self(), "before-rename");
  keep(opaque(malloc(5551)));
  char path[64];
  snprintf(path, sizeof(path), "/proc/self/task/%ld/comm", (long)syscall(SYS_gettid));
  write_file(path, "after-rename");
  char now[16];
  CHECK(pthread_getname_np(pthread_self(), now, sizeof(now)) == 0 &&
        strcmp(now, "after-rename") == 0);
  for (int i = 0; i < 2 * 4096 + 2; i++) free(opaque(malloc(5552)));
  keep(opaque(malloc(5553)));
  return nullptr;
}

static void scenario_comm_rename() {
  pthread_t t;
  CHECK(pthread_create(&t, nullptr, renamed_through_proc, nullptr) == 0);
  CHECK(pthread_join(t, nullptr) == 0);
}

// ---- one-thread: the library adds no thread to the program.
// The threads whose /proc/self/task/TID/<file> has a line for which match() is true.
static int threads_where(const char *file, bool (*match)(const char *line)) {
  int n = 0;
  DIR *d = opendir("/proc/self/task");
  CHECK(d != nullptr);
  while (dirent *e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::string path = std::string("/proc/self/task/") + e->d_name + "/" + file;
    FILE *f = fopen(path.c_str(), "r");
    if (!f) continue;  // exited meanwhile
    char line[256];
    bool matched = false;
    while (!matched && fgets(line, sizeof line, f)) matched = match(line);
    fclose(f);
    n += matched;
  }
  closedir(d);
  return n;
}

static bool any_line(const char *line) { return line != nullptr; }
static bool runs_as_root(const char *status) {
  return strncmp(status, "Uid:", 4) == 0 && strtoul(status + 4, nullptr, 10) == 0;
}

static const char *errno_word(int rc) { return rc == 0 ? "ok" : strerror(errno); }

// Keeps n blocks of 32 bytes, counting the process's threads every 20,000 allocations; the
// most it saw.
static void *g_counted[2200000];
static size_t g_counted_count;
static int keep_counting_threads(int n) {
  int most = 0;
  for (int i = 0; i < n && g_counted_count < sizeof g_counted / sizeof *g_counted; i++) {
    g_counted[g_counted_count++] = opaque(malloc(32));
    if (i % 20000 == 0) {
      const int now = threads_where("comm", any_line);
      if (now > most) most = now;
    }
  }
  return most;
}

// A program that allocates and keeps 2,000,000 blocks sees one thread all along (the tables
// grow by 64 MB meanwhile). Then what the kernel allows only a process of one thread, right
// after growing: setns into a user namespace a fork child made, unshare of a new one; and, as
// root, that no thread keeps root after setresuid.
static void scenario_one_thread() {
  printf("threads-seen=%d\n", keep_counting_threads(2000000));
  fflush(stdout);
  pid_t dropper = fork();
  CHECK(dropper >= 0);
  if (dropper == 0) {
    if (getuid() != 0) {
      printf("creds=not-root\n");
    } else {
      keep_counting_threads(100000);
      CHECK(setresgid(65534, 65534, 65534) == 0 && setresuid(65534, 65534, 65534) == 0);
      printf("creds=%s\n",
             threads_where("status", runs_as_root) == 0 ? "dropped" : "a-thread-kept-root");
    }
    fflush(stdout);
    _exit(0);
  }
  int dropped;
  CHECK(waitpid(dropper, &dropped, 0) == dropper && WIFEXITED(dropped) &&
        WEXITSTATUS(dropped) == 0);
  int ready[2], hold[2];
  CHECK(pipe(ready) == 0 && pipe(hold) == 0);
  const unsigned uid = getuid(), gid = getgid();
  pid_t owner = fork();
  CHECK(owner >= 0);
  if (owner == 0) {
    char c = 'n';
    if (unshare(CLONE_NEWUSER) == 0) {
      char map[64];
      write_file("/proc/self/setgroups", "deny");
      snprintf(map, sizeof map, "0 %u 1", uid);
      write_file("/proc/self/uid_map", map);
      snprintf(map, sizeof map, "0 %u 1", gid);
      write_file("/proc/self/gid_map", map);
      c = 'y';
    }
    CHECK(write(ready[1], &c, 1) == 1);
    CHECK(read(hold[0], &c, 1) >= 0);
    _exit(0);
  }
  char made = 0;
  CHECK(read(ready[0], &made, 1) == 1);
  if (made == 'y') {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/ns/user", (int)owner);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    CHECK(fd >= 0);
    keep_counting_threads(20000);
    printf("setns=%s\n", errno_word(setns(fd, CLONE_NEWUSER)));
    close(fd);
  } else {
    printf("setns=unavailable\n");
  }
  CHECK(write(hold[1], "x", 1) == 1);
  CHECK(waitpid(owner, nullptr, 0) == owner);
  keep_counting_threads(20000);
  printf("unshare=%s\n", errno_word(unshare(CLONE_NEWUSER)));
}

// A seccomp filter that kills the process at any clone or clone3 (a sandbox allowing no new
// thread), then 1,000,000 blocks of 40 bytes kept, which grow the tables by 32 MB: the library
// must make no thread of its own for that.
static void scenario_seccomp_no_clone() {
  struct sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone, 2, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone3, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
  };
  struct sock_fprog program = {(unsigned short)(sizeof filter / sizeof *filter), filter};
  CHECK(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0);
  CHECK(prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0);
  for (int i = 0; i < 1000000; i++) keep(opaque(malloc(40)));
  printf("survived\n");
}

// One block (7777 bytes) allocated between two CLOCK_MONOTONIC readings, which are printed.
static void scenario_clock() {
  timespec before, after;
  clock_gettime(CLOCK_MONOTONIC, &before);
  keep(opaque(malloc(7777)));
  clock_gettime(CLOCK_MONOTONIC, &after);
  printf("clock %llu %llu\n",
         (unsigned long long)before.tv_sec * 1000000000ull + (unsigned long long)before.tv_nsec,
         (unsigned long long)after.tv_sec * 1000000000ull + (unsigned long long)after.tv_nsec);
}

// 2048 call paths, one per k: bit i of k picks which of two functions makes level i's call.
// Every path allocates 11000 + k bytes, twice: once in order and once in a scattered order, so
// a thread's trace cache both hits and evicts.
static const int kPathLevels = 11, kPaths = 1 << kPathLevels;
// The two differ in what they count, so that the compiler cannot fold them into one.
static void *path_step(int k, int level);
static volatile int g_left_calls, g_right_calls;
__attribute__((noinline)) static void *path_left(int k, int level) {
  g_left_calls = g_left_calls + 1;
  return opaque(path_step(k, level));
}
__attribute__((noinline)) static void *path_right(int k, int level) {
  g_right_calls = g_right_calls + 1;
  return opaque(path_step(k, level));
}
__attribute__((noinline)) static void *path_step(int k, int level) {
  if (level == kPathLevels) return opaque(malloc(11000 + (size_t)k));
  return (k >> level) & 1 ? path_right(k, level + 1) : path_left(k, level + 1);
}

static void scenario_paths() {
  for (int i = 0; i < 2 * kPaths; i++) {  // one call site for both rounds
    int k = i < kPaths ? i : (i * 1031) % kPaths;
    keep(path_step(k, 0));
  }
}

// One call site reached from three callers in turn, each allocation freed at once: a reused
// trace comes with the key interned for it, and a key from the wrong memo would move counts
// from one caller's trace to another's. kCallerRounds blocks of kCallerSize bytes per caller.
static const int kCallerRounds = 20000;
static const size_t kCallerSize = 4321;
__attribute__((noinline)) static void *caller_site() { return opaque(malloc(kCallerSize)); }
__attribute__((noinline)) static void caller_a() { free(opaque(caller_site())); }
__attribute__((noinline)) static void caller_b() { free(opaque(caller_site())); }
__attribute__((noinline)) static void caller_c() { free(opaque(caller_site())); }

static void scenario_callers() {
  for (int i = 0; i < kCallerRounds; i++) {
    caller_a();
    caller_b();
    caller_c();
  }
}

// Temporary allocations (freed by their thread before it allocates or frees anything else), one
// size per case: 5101 always temporary; 5102 freed after 5103 was allocated, then 5103 after
// that free (neither); 5104 moved by realloc right after its allocation (always: a realloc is
// the old block's free, then an allocation), and the moved block freed at once (always);
// 5105 freed by another thread (never).
static const int kTemporaryRounds = 1000;
static void *free_elsewhere(void *p) {
  free(p);
  return nullptr;
}

static void scenario_temporary() {
  for (int i = 0; i < kTemporaryRounds; i++) free(opaque(malloc(5101)));
  for (int i = 0; i < kTemporaryRounds; i++) {
    void *a = opaque(malloc(5102)), *b = opaque(malloc(5103));
    free(a);
    free(b);
  }
  for (int i = 0; i < kTemporaryRounds; i++) free(opaque(realloc(opaque(malloc(5104)), 1 << 20)));
  for (int i = 0; i < 50; i++) {
    pthread_t t;
    CHECK(pthread_create(&t, nullptr, free_elsewhere, opaque(malloc(5105))) == 0);
    CHECK(pthread_join(t, nullptr) == 0);
  }
}

// A peak and what comes after it: 2000 blocks of 6001 bytes and 1000 of 6002 live together,
// then the 6001s freed, the 6002s moved by realloc to 6003 bytes, and 500 of 6004 allocated:
// what was live at the peak is no longer live at the end.
static void scenario_peak() {
  static void *first[2000], *second[1000];
  for (auto &p : first) p = opaque(malloc(6001));
  for (auto &p : second) p = opaque(malloc(6002));
  for (auto &p : first) free(p);
  for (auto &p : second) keep(p = opaque(realloc(p, 6003)));
  for (int i = 0; i < 500; i++) keep(opaque(malloc(6004)));
}

// The peak of four threads: each holds 500 blocks of 4000 + its number bytes until all do, then
// frees them and keeps 100 of 7000 + its number.
static pthread_barrier_t g_peak_barrier;

static void *peak_thread(void *arg) {
  const size_t n = (size_t)(uintptr_t)arg;
  static thread_local void *held[500];
  for (auto &p : held) p = opaque(malloc(4000 + n));
  pthread_barrier_wait(&g_peak_barrier);
  for (auto &p : held) free(p);
  for (int i = 0; i < 100; i++) keep(opaque(malloc(7000 + n)));
  return nullptr;
}

static void scenario_peak_threads() {
  CHECK(pthread_barrier_init(&g_peak_barrier, nullptr, 4) == 0);
  pthread_t threads[4];
  for (uintptr_t n = 0; n < 4; n++)
    CHECK(pthread_create(&threads[n], nullptr, peak_thread, (void *)n) == 0);
  for (auto &t : threads) CHECK(pthread_join(t, nullptr) == 0);
}

static void scenario_dlopen(const char *lib) {
  void *h = dlopen(lib, RTLD_NOW);
  CHECK(h);
  auto fn = (void *(*)(size_t))dlsym(h, "testlib_allocate");
  CHECK(fn);
  keep(fn(7123));
  CHECK(dlclose(h) == 0);
}

// A module whose unwind tables may be corrupt (a copy of the test module, edited by the test):
// allocates from a frame of the module, then from deeper stacks of the program.
static void scenario_corrupt_module(const char *lib) {
  void *h = dlopen(lib, RTLD_NOW);
  CHECK(h);
  auto fn = (void *(*)(size_t))dlsym(h, "testlib_allocate_framed");
  CHECK(fn);
  for (int i = 0; i < 20; i++) keep(fn(7125));
  for (int d = 1; d < 20; d++) allocate_deep(d);
}

// Called only in a fork child: its return address is new to the unwinder there, which must then
// step through this frame rather than take it from a thread's trace cache.
__attribute__((noinline)) static void *allocate_in_child_only(size_t size) {
  void *p = malloc(size);
  return opaque(p);
}

// A fork while another thread holds libunwind's process-wide cache lock (a thread inside a step
// at that instant, which a busy program hits sooner or later): the lock stays held in the child.
// Holding it here makes that instant certain. It lies in libunwind 1.6's local address space,
// whose layout (Debian 12's) places it 0x58 bytes in; other versions print "skipped". Prints
// whether the child could allocate through a frame new to the unwinder within 10 s.
static void scenario_fork_unwinder_locked() {
#if UNW_VERSION_MAJOR == 1 && UNW_VERSION_MINOR == 6
  keep(opaque(malloc(100)));  // libunwind has initialised itself
  auto *lock =
      reinterpret_cast<pthread_mutex_t *>(reinterpret_cast<char *>(unw_local_addr_space) + 0x58);
  CHECK(pthread_mutex_trylock(lock) == 0);  // a mutex, free while no thread unwinds
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    free(allocate_in_child_only(4321));
    _exit(0);
  }
  CHECK(pthread_mutex_unlock(lock) == 0);
  int st = 0;
  for (int i = 0; i < 1000 && waitpid(pid, &st, WNOHANG) == 0; i++) usleep(10000);
  if (waitpid(pid, &st, WNOHANG) == 0) {
    kill(pid, SIGKILL);
    wait_status(pid);
    printf("child deadlocked\n");
  } else {
    printf("child %s\n", exited_zero(st) ? "allocated" : "failed");
  }
#else
  printf("skipped\n");
#endif
}

// Allocates through a module linked without .eh_frame_hdr, where libunwind would open the module's
// file to read its .debug_frame, and deep in this program, where it would validate addresses
// with a pipe of its own. Prints how often the module's file was opened meanwhile (an inotify
// watch sees every open, however brief) and how many pipes the process holds beyond stdin and
// stdout; with the library's unwinding, both are 0.
static void scenario_unwinder_opens(const char *built_lib) {
  // A private copy: the watch must see only this process's opens, not those of the same test
  // run in parallel for another configuration.
  char dir[] = "/tmp/hd-unwinder-opens-XXXXXX";
  CHECK(mkdtemp(dir) != nullptr);
  const std::string copy = std::string(dir) + "/libhd_testlib_nohdr.so";
  const char *lib = copy.c_str();
  {
    int in = open(built_lib, O_RDONLY | O_CLOEXEC),
        out = open(lib, O_WRONLY | O_CREAT | O_CLOEXEC, 0700);
    CHECK(in >= 0 && out >= 0);
    char buf[65536];
    ssize_t n;
    while ((n = read(in, buf, sizeof buf)) > 0) CHECK(write(out, buf, (size_t)n) == n);
    CHECK(n == 0 && close(in) == 0 && close(out) == 0);
  }
  void *h = dlopen(lib, RTLD_NOW);
  CHECK(h);
  auto fn = (void *(*)(size_t))dlsym(h, "testlib_allocate_framed");
  CHECK(fn);
  int watch = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  CHECK(watch >= 0 && inotify_add_watch(watch, lib, IN_OPEN) >= 0);
  for (int i = 0; i < 20; i++) keep(fn(7124));
  for (int d = 1; d < 60; d++) allocate_deep(d);
  int opened = 0;
  alignas(struct inotify_event) char events[4096];
  ssize_t n;
  while ((n = read(watch, events, sizeof events)) > 0) {
    for (ssize_t at = 0; at < n;) {
      const struct inotify_event *e = (const struct inotify_event *)(events + at);
      opened += (e->mask & IN_OPEN) != 0;
      at += (ssize_t)(sizeof *e + e->len);
    }
  }
  CHECK(errno == EAGAIN);
  close(watch);
  int pipes = 0;
  DIR *fds = opendir("/proc/self/fd");
  CHECK(fds);
  while (struct dirent *e = readdir(fds)) {
    char target[256];
    std::string path = std::string("/proc/self/fd/") + e->d_name;
    ssize_t len = readlink(path.c_str(), target, sizeof target - 1);
    if (len <= 0 || atoi(e->d_name) <= 2) continue;
    target[len] = 0;
    pipes += strncmp(target, "pipe:", 5) == 0;
  }
  closedir(fds);
  unlink(lib);
  rmdir(dir);
  printf("opened %d pipes %d\n", opened, pipes);
}

int main(int argc, char **argv) {
  g_keep.reserve(100000);
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "threads")
    scenario_threads();
  else if (mode == "threads-alive")
    scenario_threads_alive();
  else if (mode == "cxx")
    scenario_cxx();
  else if (mode == "realloc")
    scenario_realloc();
  else if (mode == "sampled-churn")
    scenario_sampled_churn();
  else if (mode == "edge")
    scenario_edge();
  else if (mode == "fork")
    scenario_fork();
  else if (mode == "dlopen")
    scenario_dlopen(argv[2]);
  else if (mode == "corrupt-module")
    scenario_corrupt_module(argv[2]);
  else if (mode == "fork-register")
    scenario_fork_register();
  else if (mode == "foreign-fds")
    scenario_foreign_fds(argv[2]);
  else if (mode == "unwinder-fds")
    scenario_unwinder_fds(argv[2]);
  else if (mode == "unwinder-opens")
    scenario_unwinder_opens(argv[2]);
  else if (mode == "fork-unwinder-locked")
    scenario_fork_unwinder_locked();
  else if (mode == "realtime")
    scenario_realtime();
  else if (mode == "impossible")
    scenario_impossible();
  else if (mode == "cancel")
    scenario_cancel();
  else if (mode == "probe")
    return scenario_probe(argc > 2 && strcmp(argv[2], "1") == 0);
  else if (mode == "spawn")
    scenario_spawn(argv[0], strcmp(argv[2], "1") == 0, argv[3]);
  else if (mode == "signals")
    scenario_signals(false);
  else if (mode == "signals-altstack")
    scenario_signals(true);
  else if (mode == "signals-sampled")
    scenario_signals(false, true);
  else if (mode == "thread-churn")
    scenario_thread_churn();
  else if (mode == "cap")
    scenario_cap();
  else if (mode == "overflow")
    scenario_overflow();
  else if (mode == "double-free")
    scenario_double_free(false);
  else if (mode == "realloc-freed")
    scenario_double_free(true);
  else if (mode == "jemalloc-api")
    scenario_jemalloc_api();
  else if (mode == "comm-rename")
    scenario_comm_rename();
  else if (mode == "clock")
    scenario_clock();
  else if (mode == "one-thread")
    scenario_one_thread();
  else if (mode == "seccomp-no-clone")
    scenario_seccomp_no_clone();
  else if (mode == "paths")
    scenario_paths();
  else if (mode == "callers")
    scenario_callers();
  else if (mode == "temporary")
    scenario_temporary();
  else if (mode == "peak")
    scenario_peak();
  else if (mode == "peak-threads")
    scenario_peak_threads();
  else if (mode == "roots")
    scenario_roots();
  else if (mode == "api") {
    struct heapdump_stats st;
    if (heapdump_available()) {
      keep(opaque(malloc(3333)));
      CHECK(heapdump_get_stats(&st) == HEAPDUMP_OK);
      CHECK(st.live_blocks >= 1 && st.blocks_allocated >= st.live_blocks &&
            st.peak_live_bytes >= 3333);
      CHECK(heapdump_get_stats(nullptr) == HEAPDUMP_ERROR_INVALID_ARGUMENT);
      // Callers of other versions: one built with a larger struct gets zeros past the fields
      // this library knows; one built against 0.1 (the heapdump_get_stats function, 64 bytes)
      // gets its fields and nothing written past them; a size below 0.1's is refused.
      struct {
        heapdump_stats known;
        uint64_t later[3];
      } newer;
      memset(&newer, 0xff, sizeof newer);
      CHECK(heapdump_get_stats_sized(&newer.known, sizeof newer) == HEAPDUMP_OK);
      CHECK(newer.known.live_blocks >= 1 && newer.later[0] == 0 && newer.later[2] == 0);
      alignas(8) unsigned char old[80];
      memset(old, 0xab, sizeof old);
      CHECK((heapdump_get_stats_v0_1)(reinterpret_cast<heapdump_stats *>(old)) == HEAPDUMP_OK);
      CHECK(reinterpret_cast<heapdump_stats *>(old)->live_blocks >= 1 && old[64] == 0xab &&
            old[79] == 0xab);
      CHECK(heapdump_get_stats_sized(&st, 63) == HEAPDUMP_ERROR_INVALID_ARGUMENT);
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
  if (g_forked_child > 0) CHECK(exited_zero(wait_status(g_forked_child)));
  return 0;
}
