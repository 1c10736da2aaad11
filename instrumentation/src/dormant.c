/* The dormant library: loaded into every process of a host or a service, it forwards each call
 * to glibc untouched (no tag, no record) until a collector arms it, through the arm page
 * (contract/arm_page.h) the process mapped at start. Seeing a request costs an allocation one
 * load (hd_arm_poll, at every allocation); acting on it happens here, off the hot path, on the
 * first allocation after the request.
 *
 * Nothing here allocates, and nothing waits: a thread that finds another one acting on a request
 * goes on as it was, and acts (or not) at a later allocation. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "heapdump/contract/arm_page.h"
#include "heapdump/contract/names.h"
#include "runtime.h"

int hd_dormant;
static const uint64_t g_never_moves;
const uint64_t *hd_arm_generation = &g_never_moves;
uint64_t hd_arm_seen;
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
  static char buf[4096];
  return read_small_file("/etc/ld.so.preload", buf, sizeof buf) > 0 &&
         strstr(buf, "libheapdump") != NULL;
}

void hd_dormant_map_page(const char *socket, const char *runtime_dir) {
  const unsigned uid = (unsigned)syscall(SYS_getuid);
  char socket_path[4096], path[4096 + sizeof HD_ARM_PAGE_SUFFIX];
  if (hd_socket_path(socket, runtime_dir, &uid, socket_path, sizeof socket_path) != 0 ||
      hd_arm_page_path(socket_path, path, sizeof path) != 0) {
    return;
  }
  const int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return; /* no collector (yet): this process cannot be armed */
  struct stat st;
  void *p = MAP_FAILED;
  /* Shorter than the page, a mapping of it would fault past the end. */
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size >= (off_t)HD_ARM_PAGE_BYTES)
    p = mmap(NULL, HD_ARM_PAGE_BYTES, PROT_READ, MAP_SHARED, fd, 0);
  syscall(SYS_close, fd);
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
    if (__atomic_load_n(&slot->start_ticks, __ATOMIC_RELAXED) != start) continue;
    *sample_bytes = __atomic_load_n(&slot->sample_bytes, __ATOMIC_RELAXED);
    return __atomic_load_n(&slot->request, __ATOMIC_RELAXED);
  }
  return HD_ARM_SLOT_FREE;
}

void hd_dormant_after_fork_child(void) {
  /* Only the forking thread exists here: a request another thread was acting on is not. */
  __atomic_store_n(&g_acting, 0, __ATOMIC_RELAXED);
}

void hd_arm_poll_slow(void) {
  /* Not from the library's own code, nor from a signal handler that interrupted glibc. */
  if (hd_tls.guard || hd_tls.in_backend || g_page == NULL) return;
  if (__atomic_exchange_n(&g_acting, 1, __ATOMIC_ACQUIRE)) return;
  const uint64_t gen = __atomic_load_n(&g_page->generation, __ATOMIC_ACQUIRE);
  if (gen != __atomic_load_n(&hd_arm_seen, __ATOMIC_RELAXED) && (gen & 1) == 0) {
    uint64_t sample_bytes = 0;
    const uint32_t request = find_request(g_page, &sample_bytes);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    /* A slot read while the collector rewrote it is read again at a later allocation. */
    const bool dormant = __atomic_load_n(&hd_dormant, __ATOMIC_ACQUIRE) != 0;
    /* Arming sets up the tables and registers: only from a dormant allocation's own call, never
     * from inside a hook (a signal handler's), which leaves it to a later allocation. */
    const bool can_act = !(dormant && hd_tls.in_hook);
    if (__atomic_load_n(&g_page->generation, __ATOMIC_RELAXED) == gen && can_act) {
      __atomic_store_n(&hd_arm_seen, gen, __ATOMIC_RELAXED);
      if (request == HD_ARM_SLOT_RECORD && dormant) {
        (void)hd_arm(sample_bytes);
      } else if (request == HD_ARM_SLOT_RECORD) {
        hd_set_paused(false);
      } else if (request == HD_ARM_SLOT_PAUSE && !dormant) {
        hd_set_paused(true);
      }
    }
  }
  __atomic_store_n(&g_acting, 0, __ATOMIC_RELEASE);
}
