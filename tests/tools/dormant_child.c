/* A busy program for the dormant library's tests: it holds blocks allocated at start
 * (hold_before: 1000 blocks of 1000 bytes), runs four threads that allocate, reallocate and free
 * without pause (half of their frees on another thread's blocks), and a fifth that keeps the
 * others under a storm of signals whose handler allocates and frees. Arming and disarming happen
 * while all of it runs. Commands on stdin, each answered "ok" on stdout:
 *   keep N SIZE    allocate N blocks of SIZE bytes in keep_after and hold them
 *   free-kept      free every block keep_after holds
 *   chain N        append N links of 64 bytes to the chain, a list whose first 100 links
 *                  chain_before made at start: armed, what chain_after appends hangs from blocks
 *                  allocated before arming
 *   free-before    free half of hold_before's blocks and grow the other half by realloc (after
 *                  checking malloc_usable_size and that a realloc that fails keeps the block)
 *   fork           fork a child that allocates, frees and exits; wait for it (its status: ok)
 *   pause, resume  stop and restart the four threads' churn (they keep what they hold)
 *   exec           exec this program again (same pid; it answers "ready PID", not "ok")
 *   exit (or end of input)  stop the threads, free everything, exit 0
 *   in-handler     (quiet only, with an arm request waiting) allocate in a handler of a signal
 *                  raised on an alternate stack (on the second thread), then in one on the main
 *                  thread's stack, saying whether either armed the process; then allocate
 *                  outside any handler until it is armed (at most 100000 times), saying how many
 *                  allocations that took
 * "ready PID" once the threads run. With the argument `quiet`, the main thread runs alone but for
 * one that waits to raise a signal on its alternate stack (each thread looks at a waiting request
 * afresh), and neither allocates between commands. A second argument `no-process-vm-readv` has a
 * seccomp filter refuse that call (EPERM), as some containers' do; "ready PID" says "refused"
 * after the pid then, if a call of it on the process itself is. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BEFORE 1000
#define THREADS 4
#define RING 256
#define MAX_KEPT 100000

static void *before[BEFORE];
static void *kept[MAX_KEPT];
static size_t kept_count;
static atomic_bool stopping, paused;
static atomic_ulong handled;
static pthread_t workers[THREADS];

/* Blocks handed from one thread to the next, which frees them. */
static pthread_mutex_t handoff_lock = PTHREAD_MUTEX_INITIALIZER;
static void *handoff[THREADS][RING];
static unsigned handoff_count[THREADS];

__attribute__((noinline)) static void hold_before(void) {
  for (int i = 0; i < BEFORE; i++) {
    before[i] = malloc(1000);
    memset(before[i], i & 0xff, 1000);
  }
}

struct link {
  struct link *next;
  char data[56];
};
static struct link *chain_head, *chain_tail;

static inline __attribute__((always_inline)) void append_link(void) {
  struct link *l = malloc(sizeof *l);
  memset(l, 0x3c, sizeof *l);
  l->next = NULL;
  if (chain_tail != NULL) {
    chain_tail->next = l;
  } else {
    chain_head = l;
  }
  chain_tail = l;
}

__attribute__((noinline)) static void chain_before(void) {
  for (int i = 0; i < 100; i++) append_link();
}

__attribute__((noinline)) static void chain_after(size_t n) {
  for (size_t i = 0; i < n; i++) append_link();
}

__attribute__((noinline)) static void keep_after(size_t n, size_t size) {
  for (size_t i = 0; i < n && kept_count < MAX_KEPT; i++) {
    kept[kept_count] = malloc(size);
    memset(kept[kept_count], 0x5a, size);
    kept_count++;
  }
}

static void on_signal(int sig) {
  (void)sig;
  void *p = malloc(64 + (handled % 200));
  if (p != NULL) memset(p, 1, 64);
  free(p);
  handled++;
}

/* Whether this process is armed: it maps the library's tables. Read with open and read, which
 * allocate nothing (the answer must not be changed by asking). */
static bool armed(void) {
  static char maps[1 << 16];
  const int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  size_t len = 0;
  ssize_t n;
  while (len < sizeof maps - 1 && (n = read(fd, maps + len, sizeof maps - 1 - len)) > 0)
    len += (size_t)n;
  close(fd);
  maps[len] = '\0';
  return strstr(maps, "heapdump-allocations") != NULL;
}

/* An allocation the compiler cannot leave out. */
static void allocate_once(void) {
  void *volatile p = malloc(100);
  free(p);
}

static atomic_bool armed_in_handler;
static void allocate_in_handler(int sig) {
  (void)sig;
  allocate_once();
  if (armed()) atomic_store(&armed_in_handler, true);
}

/* Allocates until the process is armed; how many allocations that took (0: not armed after
 * 100000). They run below a buffer left unwritten, which holds what the first handler's signal
 * frame left on the stack: a frame that no handler runs in any more. */
__attribute__((noinline)) static unsigned allocate_until_armed(void) {
  char below_the_handlers_frame[16384];
  __asm__ volatile("" : : "r"(below_the_handlers_frame) : "memory"); /* kept, unwritten */
  unsigned allocations = 0;
  while (!armed() && allocations < 100000) {
    allocate_once();
    allocations++;
  }
  return armed() ? allocations : 0;
}

/* Installs a seccomp filter under which process_vm_readv fails with EPERM. */
static bool refuse_process_vm_readv(void) {
  struct sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_readv, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  const struct sock_fprog program = {.len = sizeof filter / sizeof filter[0], .filter = filter};
  return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
}

static bool process_vm_readv_refused(void) {
  char from = 'x', to = 0;
  struct iovec local = {&to, 1}, remote = {&from, 1};
  return syscall(SYS_process_vm_readv, getpid(), &local, 1UL, &remote, 1UL, 0UL) < 0 &&
         errno == EPERM;
}

/* The second thread of a quiet run: at each byte on go_pipe, raises SIGUSR2 on its alternate
 * stack (a block of the heap, as programs that allocate theirs have), then answers on done_pipe. */
static int go_pipe[2], done_pipe[2];
static void *raise_on_alternate_stack(void *arg) {
  const stack_t alternate = {.ss_sp = arg, .ss_size = 1 << 16};
  sigaltstack(&alternate, NULL);
  char c;
  while (read(go_pipe[0], &c, 1) == 1) {
    raise(SIGUSR2);
    if (write(done_pipe[1], &c, 1) != 1) break;
  }
  return NULL;
}

static void in_handler(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = allocate_in_handler;
  sa.sa_flags = SA_ONSTACK;
  sigaction(SIGUSR2, &sa, NULL);
  char c = 'g';
  if (write(go_pipe[1], &c, 1) != 1 || read(done_pipe[0], &c, 1) != 1) return;
  const bool on_alternate_stack = atomic_load(&armed_in_handler);
  sa.sa_flags = 0;
  sigaction(SIGUSR2, &sa, NULL);
  raise(SIGUSR2);
  const bool on_stack = atomic_load(&armed_in_handler) && !on_alternate_stack;
  printf("armed in a handler: %d, on an alternate stack: %d; armed after %u allocations\n",
         on_stack, on_alternate_stack, allocate_until_armed());
}

static void *churn(void *arg) {
  const unsigned me = (unsigned)(size_t)arg, next = (me + 1) % THREADS;
  unsigned seed = me * 7919u + 1;
  void *ring[RING] = {0};
  const struct timespec nap = {0, 1000 * 1000};
  while (!atomic_load(&stopping)) {
    if (atomic_load(&paused)) {
      nanosleep(&nap, NULL);
      continue;
    }
    const unsigned i = (unsigned)rand_r(&seed) % RING;
    const size_t size = 1 + (size_t)rand_r(&seed) % 3000;
    switch (rand_r(&seed) % 4) {
      case 0: ring[i] = realloc(ring[i], size); break;
      case 1:
        free(ring[i]);
        ring[i] = calloc(1, size);
        break;
      case 2: {
        /* To the next thread, which frees it: a free from another thread. */
        void *p = malloc(size);
        pthread_mutex_lock(&handoff_lock);
        if (handoff_count[next] < RING)
          handoff[next][handoff_count[next]++] = p;
        else
          free(p);
        pthread_mutex_unlock(&handoff_lock);
        break;
      }
      default: {
        pthread_mutex_lock(&handoff_lock);
        while (handoff_count[me] > 0) free(handoff[me][--handoff_count[me]]);
        pthread_mutex_unlock(&handoff_lock);
        free(ring[i]);
        ring[i] = NULL;
      }
    }
  }
  for (unsigned i = 0; i < RING; i++) free(ring[i]);
  return NULL;
}

static void *storm(void *arg) {
  (void)arg;
  const struct timespec pause = {0, 200 * 1000};
  unsigned n = 0;
  while (!atomic_load(&stopping)) {
    pthread_kill(workers[n++ % THREADS], SIGUSR1);
    nanosleep(&pause, NULL);
  }
  return NULL;
}

int main(int argc, char **argv) {
  const bool quiet = argc > 1 && strcmp(argv[1], "quiet") == 0;
  const bool refuse = quiet && argc > 2 && strcmp(argv[2], "no-process-vm-readv") == 0;
  if (refuse) (void)refuse_process_vm_readv(); /* the test skips the pass where it cannot */
  setvbuf(stdout, NULL, _IOLBF, 0);
  hold_before();
  chain_before();
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &sa, NULL);
  pthread_t stormer, raiser;
  if (quiet) {
    if (pipe(go_pipe) != 0 || pipe(done_pipe) != 0 ||
        pthread_create(&raiser, NULL, raise_on_alternate_stack, malloc(1 << 16)) != 0)
      return 1;
  } else {
    for (size_t t = 0; t < THREADS; t++) pthread_create(&workers[t], NULL, churn, (void *)t);
    pthread_create(&stormer, NULL, storm, NULL);
  }
  printf("ready %d%s\n", (int)getpid(), refuse && process_vm_readv_refused() ? " refused" : "");
  char line[256];
  while (fgets(line, sizeof line, stdin) != NULL) {
    size_t n, size;
    if (sscanf(line, "keep %zu %zu", &n, &size) == 2) {
      keep_after(n, size);
    } else if (sscanf(line, "chain %zu", &n) == 1) {
      chain_after(n);
    } else if (strncmp(line, "free-kept", 9) == 0) {
      for (size_t i = 0; i < kept_count; i++) free(kept[i]);
      kept_count = 0;
    } else if (strncmp(line, "free-before", 11) == 0) {
      /* A realloc that fails leaves the block as it was, all of its bytes. */
      if (before[1] != NULL) {
        void *too_big = realloc(before[1], (size_t)1 << 60);
        const unsigned char *b = before[1];
        if (too_big != NULL || b[992] != 1 || b[999] != 1) {
          printf("a failed realloc changed block 1\n");
          return 1;
        }
      }
      for (int i = 0; i < BEFORE; i++) {
        if (before[i] != NULL && malloc_usable_size(before[i]) < 1000) {
          printf("malloc_usable_size of block %d: %zu\n", i, malloc_usable_size(before[i]));
          return 1;
        }
      }
      for (int i = 0; i < BEFORE; i++) {
        if (before[i] == NULL) continue;
        if (i % 2 == 0) {
          free(before[i]);
          before[i] = NULL;
        } else {
          before[i] = realloc(before[i], 4000);
          if (((unsigned char *)before[i])[999] != (i & 0xff)) {
            printf("realloc lost the bytes of block %d\n", i);
            return 1;
          }
        }
      }
    } else if (strncmp(line, "fork", 4) == 0) {
      const pid_t child = fork();
      if (child == 0) {
        for (int i = 0; i < 1000; i++) free(malloc(100 + (size_t)i));
        _exit(0);
      }
      int status = 0;
      if (child < 0 || waitpid(child, &status, 0) != child || status != 0) {
        printf("fork child failed: %d\n", status);
        return 1;
      }
    } else if (strncmp(line, "pause", 5) == 0) {
      atomic_store(&paused, true);
    } else if (strncmp(line, "resume", 6) == 0) {
      atomic_store(&paused, false);
    } else if (strncmp(line, "exec", 4) == 0) {
      execl("/proc/self/exe", "dormant_child", (char *)NULL);
      printf("exec failed\n");
      return 1;
    } else if (quiet && strncmp(line, "in-handler", 10) == 0) {
      in_handler();
    } else if (strncmp(line, "exit", 4) == 0) {
      break;
    } else {
      printf("unknown command: %s", line);
      return 1;
    }
    printf("ok\n");
  }
  atomic_store(&stopping, true);
  if (quiet) {
    close(go_pipe[1]);
    pthread_join(raiser, NULL);
  } else {
    pthread_join(stormer, NULL);
    for (size_t t = 0; t < THREADS; t++) pthread_join(workers[t], NULL);
  }
  for (size_t i = 0; i < kept_count; i++) free(kept[i]);
  for (int i = 0; i < BEFORE; i++) free(before[i]);
  while (chain_head != NULL) {
    struct link *next = chain_head->next;
    free(chain_head);
    chain_head = next;
  }
  for (int t = 0; t < THREADS; t++)
    while (handoff_count[t] > 0) free(handoff[t][--handoff_count[t]]);
  printf("done, %lu signals handled\n", (unsigned long)atomic_load(&handled));
  return 0;
}
