/* The library's life in a process: configuration from the environment, the lazy
 * allocation-free init, the constructor, fork, thread exit, the exit leak check, and what
 * registration and the public API need of the live tables (their memfds, a sealed copy). */
#define _GNU_SOURCE
#include "runtime.h"

#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <malloc.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "heapdump/contract/arm_page.h"
#include "heapdump/contract/names.h"
#include "regions.h"
#include "registration.h"
#include "stack.h"

__thread hd_thread_state hd_tls __attribute__((tls_model("initial-exec")));
int hd_state;
uint32_t hd_name_generation;
hd_alloc_table hd_live_alloc;
hd_res_table hd_live_res;
uint64_t hd_sample_bytes;

static char g_exe_name[HD_REGION_NAME_MAX];
static int g_follow_children = 1;
/* The configuration the tables are made with: at init, or when a dormant process is armed. */
static int g_unwind_method = HD_UNWIND_CFI;
static unsigned g_max_frames = HD_MAX_FRAMES;
static uint64_t g_max_memory;
static uintptr_t g_own_text_lo, g_own_text_hi;
/* Its destructor hands a thread's writer state back when the thread exits. */
static pthread_key_t g_thread_exit_key;
static bool g_thread_exit_key_made;

extern char **environ;
extern const ElfW(Ehdr) __ehdr_start; /* this module's ELF header, set by the static linker */

/* ------------------------------------------------------------------ configuration */

static const char *early_getenv(const char *name);

/* `heapdump run --children` chooses which of its command's descendants are profiled:
 * HEAPDUMP_PROFILE_ROOT is the command's pid (profiled whatever program it runs, across exec)
 * and HEAPDUMP_PROFILE_ONLY the programs profiled among its descendants, comma-separated ("":
 * none). A process not chosen keeps the library in LD_PRELOAD for its own children but records
 * nothing and never registers. */
static bool program_selected(pid_t pid) {
  const char *only = early_getenv(HD_ENV_PROFILE_ONLY);
  if (only == NULL) return true;
  const char *root = early_getenv(HD_ENV_PROFILE_ROOT);
  if (root != NULL && strtol(root, NULL, 10) == (long)pid) return true;
  char comm[HD_COMM_MAX + 1] = {0};
  syscall(SYS_prctl, PR_GET_NAME, comm, 0, 0, 0); /* not prctl(): we interpose it */
  return hd_comm_listed(only, comm);
}

/* getenv that works before libc has set `environ` (the first malloc may come from ld.so):
 * falls back to a raw read of /proc/self/environ into a static buffer. No allocation. */
static const char *early_getenv(const char *name) {
  static char buf[65536];
  static size_t len;
  static int loaded;
  size_t nl = strlen(name);
  if (environ) {
    for (char **e = environ; *e; e++)
      if (strncmp(*e, name, nl) == 0 && (*e)[nl] == '=') return *e + nl + 1;
    return NULL;
  }
  if (!loaded) {
    loaded = 1;
    int fd = (int)syscall(SYS_openat, AT_FDCWD, "/proc/self/environ", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      ssize_t n;
      while (len < sizeof(buf) - 1 &&
             (n = syscall(SYS_read, fd, buf + len, sizeof(buf) - 1 - len)) > 0)
        len += (size_t)n;
      syscall(SYS_close, fd);
    }
  }
  for (size_t i = 0; i < len; i += strlen(buf + i) + 1)
    if (strncmp(buf + i, name, nl) == 0 && buf[i + nl] == '=') return buf + i + nl + 1;
  return NULL;
}

/* A size with an optional K, M or G suffix; dflt for none, 0 or anything else (an unknown
 * suffix, trailing text). Too large saturates at UINT64_MAX, for the caller's cap. */
static uint64_t parse_size(const char *s, uint64_t dflt) {
  if (!s || !*s) return dflt;
  uint64_t v = 0;
  for (; *s >= '0' && *s <= '9'; s++) {
    if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, (uint64_t)(*s - '0'), &v))
      v = UINT64_MAX;
  }
  unsigned shift = 0;
  switch (*s) {
    case '\0': break;
    case 'k':
    case 'K': shift = 10; break;
    case 'm':
    case 'M': shift = 20; break;
    case 'g':
    case 'G': shift = 30; break;
    default: return dflt;
  }
  if (shift != 0 && s[1] != '\0') return dflt;
  if (v > UINT64_MAX >> shift) return UINT64_MAX;
  v <<= shift;
  return v ? v : dflt;
}

/* CLOCK_MONOTONIC_COARSE by default (runtime.h says why); HEAPDUMP_CLOCK=precise: nanoseconds. */
clockid_t hd_clock = CLOCK_MONOTONIC_COARSE;

/* Text range of this module, whose frames are dropped from the top of every trace. */
static void own_text_range(uintptr_t *lo, uintptr_t *hi) {
  const ElfW(Ehdr) *eh = &__ehdr_start;
  const ElfW(Phdr) *ph = (const ElfW(Phdr) *)((const char *)eh + eh->e_phoff);
  uintptr_t base = (uintptr_t)eh;
  *lo = *hi = 0;
  for (int i = 0; i < eh->e_phnum; i++) {
    if (ph[i].p_type == PT_LOAD && (ph[i].p_flags & PF_X)) {
      *lo = base + ph[i].p_vaddr;
      *hi = *lo + ph[i].p_memsz;
    }
  }
}

/* Memory of the library's own in the process, which a leak check must not take for the
 * program's (hd_rec_mapping): its module's writable data (which holds the jemalloc linked into
 * it), its static TLS in every thread (the same offset from each thread pointer), and, with glibc
 * as the backend, glibc's heaps. */
static int note_own_tls(struct dl_phdr_info *info, size_t size, void *unused) {
  (void)unused;
  if (info->dlpi_addr != (uintptr_t)&__ehdr_start ||
      size < offsetof(struct dl_phdr_info, dlpi_tls_data) + sizeof(void *) ||
      info->dlpi_tls_data == NULL) {
    return 0;
  }
  for (int i = 0; i < info->dlpi_phnum; i++) {
    if (info->dlpi_phdr[i].p_type != PT_TLS) continue;
    const uint64_t offset =
        (uint64_t)((uintptr_t)info->dlpi_tls_data - (uintptr_t)__builtin_thread_pointer());
    (void)hd_res_add_mapping(&hd_live_res, HD_MAPPING_HEAPDUMP_TLS, true, offset,
                             info->dlpi_phdr[i].p_memsz);
  }
  return 1;
}

/* The tables' own mappings (their memfds are shared memory). */
static void note_tables(bool mapped, const hd_alloc_table *alloc, const hd_res_table *res) {
  (void)hd_res_add_mapping(&hd_live_res, HD_MAPPING_HEAPDUMP, mapped,
                           (uint64_t)(uintptr_t)alloc->hdr, alloc->size);
  (void)hd_res_add_mapping(&hd_live_res, HD_MAPPING_HEAPDUMP, mapped,
                           (uint64_t)(uintptr_t)res->base, res->size);
}

static void note_memory_not_the_programs(void) {
  note_tables(true, &hd_live_alloc, &hd_live_res);
  const ElfW(Ehdr) *eh = &__ehdr_start;
  const ElfW(Phdr) *ph = (const ElfW(Phdr) *)((const char *)eh + eh->e_phoff);
  for (int i = 0; i < eh->e_phnum; i++) {
    if (ph[i].p_type == PT_LOAD && (ph[i].p_flags & PF_W)) {
      (void)hd_res_add_mapping(&hd_live_res, HD_MAPPING_HEAPDUMP, true,
                               (uintptr_t)eh + ph[i].p_vaddr, ph[i].p_memsz);
    }
  }
  dl_iterate_phdr(note_own_tls, NULL);
  if (hd_use_system) {
    (void)hd_res_add_mapping(&hd_live_res, HD_MAPPING_BRK_HEAP, true, 0, 0);
    (void)hd_res_add_mapping(&hd_live_res, HD_MAPPING_BLOCKS_MAPPED, true, 0, 0);
  }
  /* What jemalloc mapped before the tables existed (its set-up's arena and metadata). */
  hd_backend_publish_mappings();
}

/* The live tables, empty, and the unwinder set up to fill them. */
/* Atomic: set once a dormant process being armed has made its tables. */
static int g_armed_tables_made;

bool hd_tables_made(void) {
  const int state = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE);
  return state == HD_STATE_READY ||
         (state == HD_STATE_ARMING && __atomic_load_n(&g_armed_tables_made, __ATOMIC_ACQUIRE));
}

/* Makes both tables; on failure says which one, its size and the errno of the call that failed
 * (an arming reports them to the collector). */
static bool create_tables(hd_arm_failure *failed) {
  const uint64_t alloc_bytes = g_max_memory / 4 * 3, res_bytes = g_max_memory / 4;
  int rc = hd_alloc_table_create(&hd_live_alloc, alloc_bytes, HD_MEMFD_ALLOCATIONS);
  if (rc != 0) {
    *failed = (hd_arm_failure){"allocations table", alloc_bytes, -rc};
    return false;
  }
  /* Nodes keep their time as an offset from this: no allocation is timed before it. */
  hd_live_alloc.hdr->time_base = hd_now_ns();
  rc = hd_res_table_create(&hd_live_res, res_bytes, HD_MEMFD_RESOURCES);
  if (rc != 0) {
    hd_alloc_table_destroy(&hd_live_alloc);
    *failed = (hd_arm_failure){"resources table", res_bytes, -rc};
    return false;
  }
  hd_live_res.hdr->sample_bytes = hd_sample_bytes;
  if (hd_sampled_out_untagged) hd_live_alloc.hdr->flags |= HD_ALLOC_FLAG_UNRECORDED_UNTAGGED;
  if (hd_sample_bytes != 0)
    __atomic_fetch_or(&hd_record_filter,
                      hd_sampled_out_untagged ? HD_FILTER_SAMPLING_ON_GLIBC : HD_FILTER_SAMPLED,
                      __ATOMIC_RELAXED);
  hd_stack_configure(g_unwind_method, g_max_frames, g_own_text_lo, g_own_text_hi);
  return true;
}

/* HEAPDUMP_DORMANT=1, or the library named in /etc/ld.so.preload (loaded into every process)
 * and not in LD_PRELOAD (which `heapdump run` and users set to record from the start);
 * HEAPDUMP_DORMANT=0 records from the start wherever the library was loaded from. */
static bool dormant_wanted(void) {
  const char *dormant = early_getenv(HD_ENV_DORMANT);
  if (dormant != NULL) return strcmp(dormant, "1") == 0;
  const char *preload = early_getenv("LD_PRELOAD");
  return (preload == NULL || strstr(preload, "libheapdump") == NULL) && hd_preload_file_names_us();
}

/* The filter's dormant bit (and the dormant word) first, then the state: the bit is only ever
 * set while the calls that see it would forward to glibc anyway (here, the state initialising or
 * being armed by this thread), and cleared by the thread that arms, once the state says so
 * (hd_arm). Set after the state, it could outlive another thread's arming begun in between. */
static void become_dormant(void) {
  __atomic_fetch_or(&hd_record_filter, HD_FILTER_DORMANT, __ATOMIC_RELAXED);
  hd_dormant_word_follow(true);
  __atomic_store_n(&hd_state, HD_STATE_DORMANT, __ATOMIC_RELEASE);
}

void hd_init_slow(void) {
  if (hd_tls.guard) return; /* nested inside init: the backend is already chosen */
  const int now = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE);
  if (now == HD_STATE_DORMANT || now == HD_STATE_ARMING) return;
  /* Guard first: a signal handler allocating right after the state change below must forward,
   * not wait for an init that cannot finish until the handler returns. */
  hd_tls.guard++;
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  int expected = HD_STATE_UNINIT;
  if (!__atomic_compare_exchange_n(&hd_state, &expected, HD_STATE_INITIALIZING, false,
                                   __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    hd_tls.guard--;
    /* Sleeps rather than yields: under real-time scheduling a yield never lets a lower-priority
     * initialising thread run. Start-up only, so a plain sleep is precise enough. */
    while (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) == HD_STATE_INITIALIZING) {
      struct timespec pause = {0, 50000};
      nanosleep(&pause, NULL);
    }
    return;
  }
  /* A set-user-ID or set-group-ID program, or one with file capabilities (AT_SECURE; loaded
   * from /etc/ld.so.preload, as ld.so ignores LD_PRELOAD then): its environment is its
   * unprivileged caller's choice, so the library takes nothing from it and only forwards to
   * glibc, never armable: recording would hand a privileged heap to that caller's collector. */
  if (getauxval(AT_SECURE) != 0) {
    hd_backend_init(true);
    hd_tls.guard--;
    become_dormant();
    return;
  }
  /* A dormant process's blocks are glibc's, untagged: recording, once armed, stays on glibc. */
  const bool dormant = dormant_wanted();
  const char *a = early_getenv(HD_ENV_ALLOCATOR);
  const uint64_t sample_bytes = parse_size(early_getenv(HD_ENV_SAMPLE_BYTES), 0);
  hd_sample_bytes = sample_bytes > HD_MAX_SAMPLE_BYTES ? HD_MAX_SAMPLE_BYTES : sample_bytes;
  /* Sampled from the start, unless jemalloc is asked for: the program keeps glibc, and the
   * blocks sampling leaves out (nearly all) are glibc's own, without a tag, so that they cost
   * little more than the program's malloc alone (a process armed later keeps tagging them: its
   * untagged blocks are the ones from before arming, counted as unattributed). */
  const bool sampled_on_glibc =
      !dormant && hd_sample_bytes != 0 && !(a && strcmp(a, "jemalloc") == 0);
  hd_backend_init(dormant || sampled_on_glibc || (a && strcmp(a, "system") == 0));
  if (sampled_on_glibc) hd_note_sampled_out_untagged();
  const char *u = early_getenv(HD_ENV_UNWIND);
  if (u != NULL && strcmp(u, "fp") == 0) g_unwind_method = HD_UNWIND_FP;
  if (u != NULL && strcmp(u, "libunwind") == 0) g_unwind_method = HD_UNWIND_LIBUNWIND;
  if (u != NULL && strcmp(u, "compare") == 0) g_unwind_method = HD_UNWIND_COMPARE;
  g_max_frames = (unsigned)parse_size(early_getenv(HD_ENV_MAX_FRAMES), HD_MAX_FRAMES);
  g_max_memory = parse_size(early_getenv(HD_ENV_MAX_MEMORY), (uint64_t)1 << 30);
  const char *clock = early_getenv(HD_ENV_CLOCK);
  if (clock && strcmp(clock, "precise") == 0) hd_clock = CLOCK_MONOTONIC;
  const char *f = early_getenv(HD_ENV_FOLLOW_CHILDREN);
  g_follow_children = !(f && strcmp(f, "0") == 0);
  own_text_range(&g_own_text_lo, &g_own_text_hi);
  int state = HD_STATE_OFF;
  if (dormant) {
    /* Until armed: the tables are made then, with the rate the collector asks for. */
    hd_dormant_map_page(early_getenv(HD_ENV_SOCKET), early_getenv(HD_ENV_RUNTIME_DIR));
    state = HD_STATE_DORMANT;
  } else if (program_selected(getpid()) && create_tables(&(hd_arm_failure){0})) {
    state = HD_STATE_READY;
  }
  hd_tls.guard--;
  if (state == HD_STATE_DORMANT)
    become_dormant();
  else
    __atomic_store_n(&hd_state, state, __ATOMIC_RELEASE);
  if (state == HD_STATE_READY) note_memory_not_the_programs();
}

void hd_note_rename(void) { __atomic_fetch_add(&hd_name_generation, 1, __ATOMIC_RELAXED); }

void hd_count_beyond_cfi(void) { hd_res_count_beyond_cfi(&hd_live_res); }

void hd_note_unwind_tables_refused(unsigned modules) {
  /* Only into this process's own tables: a fork child that was not given tables of its own
   * still maps its parent's. */
  if (!hd_tables_made()) return;
  hd_res_set_unwind_tables_refused(&hd_live_res, modules);
}

void hd_rescan_regions(void) {
  if (!hd_tables_made()) return;
  hd_tls.guard++;
  hd_regions_scan(&hd_live_res, g_exe_name);
  hd_stack_modules_changed();
  hd_tls.guard--;
}

void hd_instrumentation_tables(hd_owned_fd *alloc, hd_owned_fd *res) {
  bool on = hd_tables_made();
  *alloc = on ? hd_live_alloc.memfd : HD_OWNED_FD_NONE;
  *res = on ? hd_live_res.memfd : HD_OWNED_FD_NONE;
}

int hd_snapshot_copy_live(hd_owned_fd *out) {
  if (!out) return -EINVAL;
  *out = HD_OWNED_FD_NONE;
  hd_ensure_init();
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return -ENODEV;
  hd_backend_publish_mappings(); /* a snapshot with contents needs them all */
  hd_tls.guard++;
  hd_alloc_table snap;
  hd_alloc_table_lock_all(&hd_live_alloc);
  int rc = hd_alloc_table_clone_locked(&hd_live_alloc, &snap, 0, HD_MEMFD_SNAPSHOT);
  /* The mark the copy's blocks go with: the collector reads the trace counters later. */
  if (rc == 0)
    snap.hdr->snapshot_peak_mark = __atomic_load_n(&hd_live_res.hdr->peak_mark, __ATOMIC_RELAXED);
  hd_alloc_table_unlock_all(&hd_live_alloc);
  if (rc == 0) {
    rc = hd_alloc_table_freeze(&snap);
    if (rc == 0)
      *out = snap.memfd;
    else
      hd_alloc_table_destroy(&snap);
  }
  hd_tls.guard--;
  return rc;
}

void hd_watch_thread_exit(void) {
  if (!g_thread_exit_key_made) return;
  hd_tls.guard++; /* pthread_setspecific may allocate */
  pthread_setspecific(g_thread_exit_key, &hd_tls);
  hd_tls.guard--;
}

/* ------------------------------------------------------------------ fork */

/* The tables are MAP_SHARED: after fork parent and child would write the same memory. So the
 * prepare handler (all writers stopped) copies both tables into new memfds; the child adopts
 * them (its live set equals the parent's at the fork) and the parent drops them. */
static hd_alloc_table g_fork_alloc;
static hd_res_table g_fork_res;
static int g_fork_locked, g_fork_copied;

static void fork_prepare(void) {
  g_fork_locked = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) == HD_STATE_READY;
  if (!g_fork_locked) return;
  hd_backend_publish_mappings(); /* the child's copy of the table has them all */
  hd_tls.guard++;
  pthread_mutex_lock(&hd_live_res.lock);
  hd_alloc_table_lock_all(&hd_live_alloc);
  const bool counts_settled = hd_res_fork_gate_close(&hd_live_res, &hd_tls.writer);
  g_fork_copied = 0;
  /* A child not chosen for profiling gets no copy, and so stops recording (fork_child). Its pid
   * is not known yet, but it is not the root: only its program (ours) decides. */
  if (counts_settled && program_selected(0) &&
      hd_alloc_table_clone_locked(&hd_live_alloc, &g_fork_alloc, hd_live_alloc.size,
                                  HD_MEMFD_ALLOCATIONS) == 0) {
    if (hd_res_table_clone_locked(&hd_live_res, &g_fork_res, HD_MEMFD_RESOURCES) == 0) {
      uint64_t live_blocks, live_bytes;
      hd_alloc_table_sum_locked(&g_fork_alloc, hd_sample_bytes, &live_blocks, &live_bytes);
      hd_res_reconcile_live(&g_fork_res, live_blocks, live_bytes);
      g_fork_copied = 1;
    } else {
      hd_alloc_table_destroy(&g_fork_alloc);
    }
  }
}

static void fork_parent(void) {
  if (!g_fork_locked) return;
  hd_res_fork_gate_open(&hd_live_res);
  hd_alloc_table_unlock_all(&hd_live_alloc);
  pthread_mutex_unlock(&hd_live_res.lock);
  if (g_fork_copied) {
    hd_alloc_table_destroy(&g_fork_alloc);
    hd_res_table_destroy(&g_fork_res);
  }
  hd_tls.guard--;
}

static void fork_child(void) {
  hd_backend_after_fork_child();
  hd_dormant_after_fork_child();
  /* Sampled recording: the child draws its own sample points, not the parent's sequence (the
   * generator is seeded again from the child's tid at its next draw). */
  hd_tls.sample_random = 0;
  /* Forked while another thread armed the process: that thread, and the locks it may hold, are
   * not here, and the tables being made are the parent's. The child records nothing, ever: its
   * blocks (untagged, glibc's) go back to glibc through the paths of a process switched off. */
  const int state = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE);
  if (state == HD_STATE_ARMING || (state == HD_STATE_READY && !g_fork_locked))
    __atomic_store_n(&hd_state, HD_STATE_OFF, __ATOMIC_RELEASE); /* armed after fork_prepare */
  if (!g_fork_locked) return;
  hd_stack_after_fork_child();
  hd_regions_after_fork_child();
  if (g_fork_copied) {
    hd_alloc_table old_alloc = hd_live_alloc;
    hd_res_table old_res = hd_live_res;
    hd_res_table_adopt_index(&g_fork_res, &old_res);
    hd_live_alloc = g_fork_alloc;
    hd_live_res = g_fork_res;
    pthread_mutex_init(&hd_live_alloc.world_lock, NULL);
    pthread_mutex_init(&hd_live_res.lock, NULL);
    hd_live_alloc.hdr->pid = (uint32_t)getpid(); /* the copies were made by the parent */
    hd_live_res.hdr->pid = (uint32_t)getpid();
    /* Our mappings of the parent's memfds; the parent keeps its own. */
    note_tables(false, &old_alloc, &old_res);
    note_tables(true, &hd_live_alloc, &hd_live_res);
    hd_alloc_table_destroy(&old_alloc);
    hd_res_table_destroy(&old_res);
  } else {
    /* Not chosen, or could not copy: stop recording rather than write into the parent's
     * tables. */
    __atomic_store_n(&hd_state, HD_STATE_OFF, __ATOMIC_RELEASE);
  }
  hd_res_fork_gate_open(&hd_live_res);
  g_fork_locked = 0;
  /* The cached free nodes were numbered in the parent's table; the counters record is copied. */
  hd_tls.writer.node_count = 0;
  hd_tls.writer.live_delta = 0;
  hd_tls.tid = 0; /* new tid: the next allocation records a new thread info */
  hd_tls.thread_key = 0;
  hd_tls.name_countdown = 0;
  hd_tls.guard--;
  if (g_fork_copied) hd_registration_after_fork_child();
}

/* ------------------------------------------------------------------ start-up */

/* Runs at thread exit after the thread's TLS destructors (C++ thread_local ones included) but
 * before its last frees by libc; those take the shared paths. */
static void thread_exit(void *arg) {
  (void)arg;
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return;
  hd_tls.guard++;
  hd_writer_thread_retire(&hd_live_alloc, &hd_live_res, &hd_tls.writer);
  hd_tls.guard--;
}

static void strip_from_ld_preload(void) {
  const char *pre = getenv("LD_PRELOAD");
  Dl_info di;
  if (!pre || !dladdr((void *)&hd_init_slow, &di) || !di.dli_fname) return;
  const char *self = strrchr(di.dli_fname, '/');
  self = self ? self + 1 : di.dli_fname;
  char out[4096];
  size_t o = 0;
  for (const char *p = pre; *p;) {
    size_t n = strcspn(p, " :");
    const char *base = p;
    for (const char *q = p; q < p + n; q++)
      if (*q == '/') base = q + 1;
    bool ours =
        n > 0 && (size_t)(p + n - base) == strlen(self) && strncmp(base, self, strlen(self)) == 0;
    if (n > 0 && !ours && o + n + 2 < sizeof(out)) {
      if (o) out[o++] = ':';
      memcpy(out + o, p, n);
      o += n;
    }
    p += n;
    if (*p) p++;
  }
  out[o] = 0;
  if (o)
    setenv("LD_PRELOAD", out, 1);
  else
    unsetenv("LD_PRELOAD");
}

/* exit() runs its handlers last-registered first, and this one is registered before the C
 * library registers the loader's finalizer (our constructor runs before the program starts):
 * it runs after the program's atexit handlers and every static destructor. Registered without
 * a DSO handle, so that finalizing this library does not run it early. */
extern int __cxa_atexit(void (*fn)(void *), void *arg, void *dso_handle);

/* The exit snapshot, stored from the exit path with contents and roots (a leak check) while
 * this thread waits for the collector, bounded by the snapshot timeout; without a collector,
 * or if it fails, the collector's own exit snapshot (without contents) is what remains. */
static void exit_leak_check(void *unused) {
  (void)unused;
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return;
  if (!hd_exit_with_contents_wanted()) return; /* a fork child of the command, say */
  hd_owned_fd memfd;
  if (hd_snapshot_copy_live(&memfd) != 0) return;
  int rc = hd_store_named_snapshot(HD_EXIT_SNAPSHOT_NAME, &memfd, true);
  (void)rc;
  hd_owned_fd_close(&memfd);
}

/* The main program's path, which the module scans name its regions by. */
static void read_exe_name(void) {
  ssize_t n = readlink("/proc/self/exe", g_exe_name, sizeof(g_exe_name) - 1);
  g_exe_name[n > 0 ? n : 0] = 0;
}

/* What recording needs beyond the tables, set up once they exist: at start, or when armed
 * (whichever comes first: a process armed before its constructor ran is not set up twice). */
static void start_services(bool at_start) {
  static bool started;
  if (started) return;
  started = true;
  hd_tls.guard++;
  if (at_start) read_exe_name(); /* armed: read before the tables were published */
  g_thread_exit_key_made = pthread_key_create(&g_thread_exit_key, thread_exit) == 0;
  hd_tls.guard--;
  /* Not when armed: setenv while the program's threads may read the environment is a race. */
  if (!g_follow_children && at_start) strip_from_ld_preload();
  hd_tls.guard++; /* what loading libunwind allocates is the library's own */
  hd_stack_start();
  hd_tls.guard--;
  hd_rescan_regions();
  hd_register_with_collector();
  if (hd_exit_with_contents_wanted()) __cxa_atexit(exit_leak_check, NULL, NULL);
}

__attribute__((constructor)) static void hd_constructor(void) {
  hd_ensure_init();
  const int state = __atomic_load_n(&hd_state, __ATOMIC_ACQUIRE);
  const bool ready = state == HD_STATE_READY;
  /* A dormant process too: once armed, a fork gives the child tables of its own. */
  if (state == HD_STATE_DORMANT || state == HD_STATE_ARMING || ready) {
    hd_tls.guard++;
    pthread_atfork(fork_prepare, fork_parent, fork_child);
    hd_tls.guard--;
  }
  if (!ready) return;
  start_services(true);
}

/* From a dormant process's allocation (dormant.c), with no lock of ours held. The state is
 * ARMING meanwhile: the other threads go on forwarding to glibc untagged, as this one's own
 * allocations do (guard), and a fork child records nothing. Those blocks are the unattributed
 * bytes, which glibc's statistics count last, just before the state becomes READY; the tables
 * say "armed" only then, so a client that saw it (`heapdump arm` waits for it) knows every later
 * allocation is recorded. */
void hd_arm(uint64_t sample_bytes, uint64_t generation) {
  int dormant = HD_STATE_DORMANT;
  if (!__atomic_compare_exchange_n(&hd_state, &dormant, HD_STATE_ARMING, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE)) {
    return;
  }
  __atomic_fetch_and(&hd_record_filter, ~(uint32_t)HD_FILTER_DORMANT, __ATOMIC_RELAXED);
  hd_dormant_word_follow(false);
  hd_tls.guard++;
  /* HD_ARM_OWN_RATE keeps what the environment said at start (read then, as for any process). */
  if (sample_bytes != HD_ARM_OWN_RATE)
    hd_sample_bytes = sample_bytes > HD_MAX_SAMPLE_BYTES ? HD_MAX_SAMPLE_BYTES : sample_bytes;
  hd_arm_failure failed;
  const bool made = create_tables(&failed);
  hd_tls.guard--;
  if (!made) {
    /* Said (else the client would wait for an arming that is not coming) while still ARMING:
     * a fork child made meanwhile records nothing, ever, so it never waits for the registration
     * lock this thread holds. */
    hd_report_arm_failure(generation, &failed);
    become_dormant();
    return;
  }
  hd_tls.guard++;
  read_exe_name(); /* before another thread's dlopen may scan the modules into the tables */
  hd_tls.guard--;
  __atomic_store_n(&g_armed_tables_made, 1, __ATOMIC_RELEASE);
  hd_note_untagged_blocks();
  note_memory_not_the_programs();
  start_services(false);
  hd_tls.guard++;
  const struct mallinfo2 glibc = mallinfo2();
  hd_tls.guard--;
  __atomic_store_n(&hd_live_res.hdr->unattributed_bytes, (uint64_t)(glibc.uordblks + glibc.hblkhd),
                   __ATOMIC_RELAXED);
  __atomic_fetch_or(&hd_record_filter, HD_FILTER_ARMED, __ATOMIC_RELAXED);
  __atomic_store_n(&hd_state, HD_STATE_READY, __ATOMIC_RELEASE);
  __atomic_store_n(&hd_live_res.hdr->arm_state, HD_ARM_ARMED, __ATOMIC_RELEASE);
}

void hd_set_paused(bool paused) {
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return;
  if (paused)
    __atomic_fetch_or(&hd_record_filter, HD_FILTER_PAUSED, __ATOMIC_RELAXED);
  else
    __atomic_fetch_and(&hd_record_filter, ~(uint32_t)HD_FILTER_PAUSED, __ATOMIC_RELAXED);
  /* After the filter: a client that sees the state knows every later allocation follows it. */
  __atomic_store_n(&hd_live_res.hdr->arm_state, paused ? HD_ARM_DISARMED : HD_ARM_ARMED,
                   __ATOMIC_RELEASE);
}
