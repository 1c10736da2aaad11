/* The dormant library: loaded into every process of a host or a service, it forwards each call
 * to glibc untouched (no tag, no record) until a collector arms it, through the arm page
 * (contract/arm_page.h) the process mapped at start (making it, if no collector ever ran). Seeing a
 * request costs an allocation one load (hd_arm_poll, at every allocation); acting on it happens
 * here, off the hot path, on the first allocation after the request.
 *
 * Nothing here but arming allocates, and no thread waits for another: a thread that finds
 * another one acting on a request goes on as it was. The thread that arms does the setting up
 * (tables, registration with the collector, the unwinder) inside the program's allocation. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/auxv.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "heapdump/contract/arm_page.h"
#include "heapdump/contract/arm_page_file.h"
#include "heapdump/contract/names.h"
#include "runtime.h"

static const uint64_t g_never_moves;
const uint64_t *hd_arm_generation = &g_never_moves;
uint64_t hd_arm_seen;
/* Odd and not UINT64_MAX: never a generation seen (a settled one is even, and a page just mapped
 * is seen as UINT64_MAX). */
static const uint64_t g_not_dormant = 1;
const uint64_t *hd_dormant_word = &g_not_dormant;

void hd_dormant_word_follow(bool dormant) {
  __atomic_store_n(&hd_dormant_word, dormant ? hd_arm_generation : &g_not_dormant,
                   __ATOMIC_RELAXED);
}
static const hd_arm_page *g_page;
static int g_acting; /* atomic: a thread is acting on a request */

/* Reads a whole small file with raw syscalls into buf (NUL-terminated); its length, or -1. */
static long read_small_file(const char *path, char *buf, size_t size) {
  const int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  size_t len = 0;
  long n;
  while (len < size - 1 && (n = syscall(SYS_read, fd, buf + len, size - 1 - len)) > 0)
    len += (size_t)n;
  syscall(SYS_close, fd);
  buf[len] = '\0';
  return (long)len;
}

bool hd_preload_file_names_us(void) {
  /* Read through a small buffer on the stack, at every start of every process of a host that
   * preloads the library: a static one would be a page of its own to fault in. */
  static const char name[] = "libheapdump";
  enum { CUT = sizeof name - 2 }; /* the most of the name a read's end may cut off */
  const int fd = (int)syscall(SYS_openat, AT_FDCWD, "/etc/ld.so.preload", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[512];
  size_t kept = 0;
  bool found = false;
  long n;
  while (!found && (n = syscall(SYS_read, fd, buf + kept, sizeof buf - kept)) > 0) {
    const size_t length = kept + (size_t)n;
    found = memmem(buf, length, name, sizeof name - 1) != NULL;
    kept = length < CUT ? length : CUT;
    memmove(buf, buf + length - kept, kept);
  }
  syscall(SYS_close, fd);
  return found;
}

/* Owned by this user or root, and writable by nobody else. */
static bool trusted(const struct stat *st, unsigned uid) {
  return (st->st_uid == uid || st->st_uid == 0) && (st->st_mode & 022) == 0;
}

/* The page mapped read-only. Where it is mapped tells this program from the one this process
 * ran before an exec (same pid and start time, contract/arm_page.h). Without address space
 * randomisation (under gdb, `setarch -R`, randomize_va_space=0) both would map it at the same
 * address, and the program exec'd would take its predecessor's request; so the page goes at one
 * of PLACES pages of a reservation, drawn from the clock (nothing of AT_RANDOM's secrets shown
 * in /proc/PID/maps). Two programs in a row share a place once in PLACES. */
#define PLACES 16384u
_Static_assert(PLACES == 1u << 14, "a place is the draw's 14 high bits");
static void *map_at_a_drawn_place(int fd) {
  const size_t page = getauxval(AT_PAGESZ) ? getauxval(AT_PAGESZ) : 4096;
  const size_t bytes = (HD_ARM_PAGE_BYTES + page - 1) / page * page, span = PLACES * page + bytes;
  char *reserved = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) return mmap(NULL, HD_ARM_PAGE_BYTES, PROT_READ, MAP_SHARED, fd, 0);
  /* The system call, not the vDSO: its code and data would be three pages this process
   * otherwise never touches at start, each a page fault, which cost more than the call. */
  struct timespec now = {0, 0};
  syscall(SYS_clock_gettime, CLOCK_MONOTONIC, &now);
  const uint64_t draw =
      ((uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec) * UINT64_C(0x9E3779B97F4A7C15);
  const size_t before = (size_t)(draw >> 50) % PLACES * page; /* its 14 high bits */
  void *p = mmap(reserved + before, HD_ARM_PAGE_BYTES, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
  /* The reservation around the page goes; where the page should be, a failed mapping may have
   * left a hole another thread's mapping could fill since, so that part is left alone. */
  if (before > 0) munmap(reserved, before);
  munmap(reserved + before + bytes, span - before - bytes);
  return p != MAP_FAILED ? p : mmap(NULL, HD_ARM_PAGE_BYTES, PROT_READ, MAP_SHARED, fd, 0);
}

void hd_dormant_map_page(const char *socket, const char *runtime_dir) {
  const unsigned uid = (unsigned)syscall(SYS_getuid);
  /* sun_path's size: a longer socket path names no socket a collector could listen on. Small
   * buffers keep this start-up call on the stack pages the process touched already. */
  char socket_path[108], path[108 + sizeof HD_ARM_PAGE_SUFFIX];
  if (hd_socket_path(socket, runtime_dir, &uid, socket_path, sizeof socket_path) != 0 ||
      hd_arm_page_path(socket_path, path, sizeof path) != 0) {
    return;
  }
  /* A relative socket path would make a directory in every process's working directory. */
  if (path[0] != '/') return;
  /* Only a page this user's (or root's) collector wrote, in a directory nobody else may write
   * to: a page planted by another user (say in /tmp/heapdump-0/, made before root's collector
   * ran) could otherwise arm this process and make it hand its tables to that user's socket.
   * No collector has run yet (a service started at boot before the collector's unit): the
   * socket's directory is made as the collector makes it, and the page in it, so that the
   * collector started later finds this very page and can arm this process. The directory is
   * opened without following a link (one another user put in /tmp/heapdump-UID would lead
   * elsewhere), checked, and the page made relative to it. */
  const char *name;
  const int dir_fd = hd_arm_page_dir_open(path, true, &name);
  if (dir_fd < 0) return;
  struct stat st;
  int fd = -1;
  if (fstat(dir_fd, &st) == 0 && S_ISDIR(st.st_mode) && trusted(&st, uid))
    fd = hd_arm_page_file_open(dir_fd, name, O_RDONLY);
  close(dir_fd);
  if (fd < 0) return; /* not made nor opened (read-only /run, ...): this process cannot be armed */
  void *p = MAP_FAILED;
  /* Shorter than the page, a mapping of it would fault past the end. */
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && trusted(&st, uid) &&
      st.st_size >= (off_t)HD_ARM_PAGE_BYTES)
    p = map_at_a_drawn_place(fd);
  close(fd);
  if (p == MAP_FAILED) return;
  const hd_arm_page *page = p;
  if (page->magic != HD_ARM_PAGE_MAGIC || page->version != HD_ARM_PAGE_VERSION) {
    munmap(p, HD_ARM_PAGE_BYTES);
    return;
  }
  g_page = page;
  /* Odd, so never a settled generation: the first allocation looks for a slot naming this
   * process (its pid and start time), which a collector may have written before it started. */
  __atomic_store_n(&hd_arm_seen, UINT64_MAX, __ATOMIC_RELAXED);
  __atomic_store_n(&hd_arm_generation, &page->generation, __ATOMIC_RELEASE);
}

/* This process's start time (/proc/self/stat), which names it in a slot with its pid. */
static uint64_t own_start_ticks(void) {
  char buf[1024];
  return read_small_file("/proc/self/stat", buf, sizeof buf) > 0 ? hd_stat_start_ticks(buf) : 0;
}

/* This process's request in the page at generation gen; HD_ARM_SLOT_FREE if it has none. */
static uint32_t find_request(const hd_arm_page *page, uint64_t *sample_bytes) {
  const uint32_t pid = (uint32_t)syscall(SYS_getpid); /* a fork child has its own */
  uint64_t start = 0;
  for (uint32_t i = 0; i < HD_ARM_SLOTS; i++) {
    const hd_arm_slot *slot = &page->slots[i];
    if (__atomic_load_n(&slot->pid, __ATOMIC_RELAXED) != pid) continue;
    if (start == 0) start = own_start_ticks();
    if (__atomic_load_n(&slot->start_ticks, __ATOMIC_RELAXED) != start ||
        __atomic_load_n(&slot->page_address, __ATOMIC_RELAXED) != (uint64_t)(uintptr_t)page) {
      continue; /* another process of this pid: a reused one, another namespace's, an exec'd */
    }
    *sample_bytes = __atomic_load_n(&slot->sample_bytes, __ATOMIC_RELAXED);
    return __atomic_load_n(&slot->request, __ATOMIC_RELAXED);
  }
  return HD_ARM_SLOT_FREE;
}

void hd_dormant_after_fork_child(void) {
  /* Only the forking thread exists here: a request another thread was acting on is not, and the
   * child's handlers are not its parent's, so this thread looks at its next allocation. */
  __atomic_store_n(&g_acting, 0, __ATOMIC_RELAXED);
  hd_tls.arm_skip = hd_tls.arm_last_skip = 0;
}

/* The end of the mapping that holds addr, from /proc/self/maps read with raw syscalls and
 * parsed as it streams (no line is kept whole); 0 if it cannot be read or names none. */
static uintptr_t mapping_end(uintptr_t addr) {
  static char buf[4096]; /* one thread at a time: g_acting */
  const int fd = (int)syscall(SYS_openat, AT_FDCWD, "/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  enum { START, END, REST } field = START;
  uintptr_t start = 0, end = 0, found = 0;
  long n;
  while (found == 0 && (n = syscall(SYS_read, fd, buf, sizeof buf)) > 0) {
    for (long i = 0; i < n && found == 0; i++) {
      const char c = buf[i];
      const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (field == START && digit >= 0) {
        start = start << 4 | (uintptr_t)digit;
      } else if (field == START) {
        field = END;
      } else if (field == END && digit >= 0) {
        end = end << 4 | (uintptr_t)digit;
      } else if (field == END) {
        if (start <= addr && addr < end) found = end;
        field = REST;
      } else if (c == '\n') {
        field = START;
        start = end = 0;
      }
    }
  }
  syscall(SYS_close, fd);
  return found;
}

/* Where the kernel's signal frame on x86-64 (struct rt_sigframe) holds the signal mask to
 * restore: after the restorer's address (8 bytes), uc_flags, uc_link, uc_stack (40) and
 * uc_mcontext (256). (The siginfo after it is written for SA_SIGINFO actions only.) */
#define FRAME_SAVED_MASK_OFFSET 304u
_Static_assert(sizeof(void *) == 8, "the signal frame's layout is x86-64's");
#define SCAN_BYTES ((uintptr_t)1 << 20)
#define SCAN_STEP 4096u

/* Every restorer an action of this process has named when a thread looked (kept, so that the
 * handler of an action reset since, as SA_RESETHAND resets it, is still known by its frame).
 * One per signal at most at any time; glibc gives all of its actions one. */
static uintptr_t g_restorers[64];
static unsigned g_restorer_count;

static bool is_restorer(uintptr_t word) {
  for (unsigned i = 0; i < g_restorer_count; i++) {
    if (g_restorers[i] == word) return true;
  }
  return false;
}

/* Whether a seccomp filter watches this process (/proc/self/status, "Seccomp: 2"): a call the
 * program never makes itself may then kill it (systemd's SystemCallFilter= without
 * SystemCallErrorNumber=), so none is made. */
static bool seccomp_filtered(void) {
  static char status[4096]; /* one thread at a time: g_acting */
  if (read_small_file("/proc/self/status", status, sizeof status) <= 0) return true;
  const char *line = strstr(status, "\nSeccomp:");
  if (line == NULL) return false; /* a kernel without seccomp */
  line += strlen("\nSeccomp:");
  while (*line == ' ' || *line == '\t') line++;
  return *line != '0';
}

/* Reads [at, at + len) of this thread's stack, which lies within its mapping (the caller bounds
 * it by /proc/self/maps): with process_vm_readv on this very process where that call is safe to
 * make (not direct: no seccomp filter), so that memory another thread unmaps meanwhile (a
 * coroutine's stack inside a heap that is trimmed) ends the read instead of faulting the program;
 * else directly. The bytes read (fewer at memory gone meanwhile), or -1 if the stack cannot be read
 * at all. */
static long read_stack(bool direct, uintptr_t at, void *buf, size_t len) {
  if (direct) {
    memcpy(buf, (const void *)at, len);
    return (long)len;
  }
  struct iovec local = {buf, len}, remote = {(void *)at, len};
  const long got =
      syscall(SYS_process_vm_readv, syscall(SYS_getpid), &local, 1UL, &remote, 1UL, 0UL);
  if (got >= 0) return got;
  return errno == EFAULT ? 0 : -1;
}

/* Whether this thread is running a signal handler, which may have interrupted anything
 * (glibc's malloc amid its lists, the loader amid a dlopen) that arming would then call into.
 * On an alternate stack the kernel says so. Elsewhere, the kernel starts a handler with a
 * signal frame on the stack, which stays there until the handler returns: the action's restorer
 * as the return address, then the context interrupted, with its signal mask. While the handler
 * runs, its signal is blocked (and the action's mask), which the interrupted context's mask did
 * not block. So a handler runs if such a frame lies between the stack pointer and the end of
 * the stack, and a signal is blocked now that the frame's mask does not block; for an
 * SA_NODEFER action, which may block nothing more, the frame alone is taken. A frame left behind
 * by a handler that returned, where the thread has blocked more signals since or an action is
 * SA_NODEFER, says yes where no handler runs, which delays arming. The search ends 1 MiB up: a
 * handler deeper than that in its own calls is not looked for. Not inlined: the search starts
 * at this call's frame, above what it holds itself. */
__attribute__((noinline)) static bool in_signal_handler(void) {
  struct {
    uintptr_t handler;
    unsigned long flags;
    uintptr_t restorer;
    uint64_t mask;
  } action;
  bool nodefer = false;
  for (int sig = 1; sig <= 64; sig++) {
    if (syscall(SYS_rt_sigaction, sig, NULL, &action, sizeof action.mask) != 0) continue;
    if (action.handler == (uintptr_t)SIG_DFL || action.handler == (uintptr_t)SIG_IGN) continue;
    nodefer |= (action.flags & SA_NODEFER) != 0;
    /* 0: an action without a restorer, which the kernel cannot deliver on x86-64. */
    if (action.restorer != 0 && !is_restorer(action.restorer) &&
        g_restorer_count < sizeof g_restorers / sizeof g_restorers[0])
      g_restorers[g_restorer_count++] = action.restorer;
  }
  if (g_restorer_count == 0) return false;
  stack_t alternate;
  if (syscall(SYS_sigaltstack, NULL, &alternate) == 0 && (alternate.ss_flags & SS_ONSTACK))
    return true;
  uint64_t blocked = 0;
  if (syscall(SYS_rt_sigprocmask, SIG_BLOCK, NULL, &blocked, sizeof blocked) != 0) return true;
  /* Static: one thread at a time (g_acting), and not on a handler's small stack. Each step
   * reads a frame's length past itself, so that a frame starting in it is read whole. */
  static unsigned char window[SCAN_STEP + FRAME_SAVED_MASK_OFFSET + sizeof(uint64_t)];
  const uintptr_t sp = (uintptr_t)__builtin_frame_address(0) & ~(uintptr_t)7;
  const uintptr_t end = mapping_end(sp);
  if (end == 0) return true; /* cannot tell: say yes */
  const bool direct = seccomp_filtered();
  const uintptr_t last = end - sp > SCAN_BYTES ? sp + SCAN_BYTES : end;
  for (uintptr_t at = sp; at < last; at += SCAN_STEP) {
    const size_t want = last - at < sizeof window ? last - at : sizeof window;
    const long got = read_stack(direct, at, window, want);
    if (got < 0 || (got == 0 && at == sp)) return true; /* cannot tell: say yes */
    for (long off = 0; off < (long)SCAN_STEP && off + (long)sizeof(uintptr_t) <= got; off += 8) {
      uintptr_t word;
      memcpy(&word, window + off, sizeof word);
      /* A frame would run past the stack's end: not one. */
      if (!is_restorer(word) || off + FRAME_SAVED_MASK_OFFSET + sizeof(uint64_t) > (size_t)got)
        continue;
      uint64_t saved_mask;
      memcpy(&saved_mask, window + off + FRAME_SAVED_MASK_OFFSET, sizeof saved_mask);
      if (nodefer || (blocked & ~saved_mask) != 0) return true;
    }
    if (got < (long)want) break; /* the rest was unmapped meanwhile */
  }
  return false;
}

/* A thread that found itself in a signal handler skips this many of its allocations before it
 * looks again (doubling each time, so that a restorer's stale copy costs the thread a search
 * per this many allocations, not one each); another thread may arm the process meanwhile. */
#define FIRST_SKIP 16u
#define LAST_SKIP (1u << 20)

void hd_arm_poll_slow(void) {
  /* Not from the library's own code, nor from a call of the allocator's it interrupted. */
  if (hd_tls.guard || hd_tls.in_backend || g_page == NULL) return;
  /* A pause for the request this thread found itself in a handler for, not for a later one. */
  if (hd_tls.arm_skip > 0 &&
      __atomic_load_n(hd_arm_generation, __ATOMIC_RELAXED) == hd_tls.arm_skip_generation &&
      __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) == HD_STATE_DORMANT) {
    hd_tls.arm_skip--;
    return;
  }
  if (__atomic_exchange_n(&g_acting, 1, __ATOMIC_ACQUIRE)) return;
  const int saved_errno = errno; /* the program's, through its allocation */
  const uint64_t gen = __atomic_load_n(&g_page->generation, __ATOMIC_ACQUIRE);
  if (gen != __atomic_load_n(&hd_arm_seen, __ATOMIC_RELAXED) && (gen & 1) == 0) {
    uint64_t sample_bytes = 0;
    const uint32_t request = find_request(g_page, &sample_bytes);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    const bool dormant = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) == HD_STATE_DORMANT;
    /* Arming waits for an allocation outside any signal handler; the others are two atomic
     * operations on the library's own words, safe anywhere. */
    if (request == HD_ARM_SLOT_RECORD && dormant && in_signal_handler()) {
      const uint32_t last = hd_tls.arm_skip_generation == gen ? hd_tls.arm_last_skip : 0;
      hd_tls.arm_last_skip = last == 0 ? FIRST_SKIP : last < LAST_SKIP ? last * 2 : LAST_SKIP;
      hd_tls.arm_skip = hd_tls.arm_last_skip;
      hd_tls.arm_skip_generation = gen;
    } else if (__atomic_load_n(&g_page->generation, __ATOMIC_RELAXED) == gen) {
      /* A slot read while the collector rewrote it is read again at a later allocation. */
      hd_tls.arm_skip = hd_tls.arm_last_skip = 0;
      __atomic_store_n(&hd_arm_seen, gen, __ATOMIC_RELAXED);
      if (request == HD_ARM_SLOT_RECORD && dormant) {
        hd_arm(sample_bytes, gen);
      } else if (request == HD_ARM_SLOT_RECORD) {
        hd_set_paused(false);
      } else if (request == HD_ARM_SLOT_PAUSE && !dormant) {
        hd_set_paused(true);
      }
      /* Said last: a client that sees it knows the request took effect. */
      if (request != HD_ARM_SLOT_FREE && hd_tables_made())
        __atomic_store_n(&hd_live_res.hdr->arm_generation, (uint32_t)gen, __ATOMIC_RELEASE);
    }
  }
  errno = saved_errno;
  __atomic_store_n(&g_acting, 0, __ATOMIC_RELEASE);
}
