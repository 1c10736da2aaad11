/* Arming and disarming dormant processes (ArmProcess, `heapdump arm` / `heapdump disarm`)
 * through the arm page (contract/arm_page.h), a file beside the socket that the collector alone
 * writes and dormant processes map read-only at start.
 *
 * The file is created complete by whichever comes first, the collector or a dormant process
 * (contract/arm_page_file.h), and kept across restarts: processes started under an earlier
 * collector, or before any, keep seeing the same file. Only the poll thread writes it (requests
 * are served there), as a seqlock writer. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "collector_internal.h"
#include "heapdump/contract/arm_page.h"
#include "heapdump/contract/arm_page_file.h"

/* Removes the temporary pages in dir_fd that creators killed midway left behind
 * (contract/arm_page_file.h): named so, and not written to for a minute. Only in a directory of
 * this user's that nobody else may enter, as the socket's is made (not one a socket path named
 * in `/` or the working directory leads to, where other users' files may be). */
static void remove_abandoned_temporaries(hd_collector *c, int dir_fd) {
  struct stat st;
  if (fstat(dir_fd, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & 077) != 0) return;
  const int list_fd = dup(dir_fd);
  DIR *dir = list_fd >= 0 ? fdopendir(list_fd) : NULL;
  if (dir == NULL) {
    if (list_fd >= 0) close(list_fd);
    return;
  }
  const time_t abandoned = time(NULL) - HD_ARM_PAGE_TEMPORARY_ABANDONED;
  const size_t prefix = strlen(HD_ARM_PAGE_TEMPORARY ".");
  for (struct dirent *e; (e = readdir(dir)) != NULL;) {
    struct stat st;
    if (strncmp(e->d_name, HD_ARM_PAGE_TEMPORARY ".", prefix) != 0 ||
        fstatat(dir_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
        st.st_mtime > abandoned) {
      continue;
    }
    if (unlinkat(dir_fd, e->d_name, 0) == 0)
      hd_log(c, HD_LOG_INFO, "removed %s, an arm page its creator left half made", e->d_name);
  }
  closedir(dir);
}

int hd_arming_open(hd_collector *c) {
  char path[sizeof c->socket_path + sizeof HD_ARM_PAGE_SUFFIX];
  if (hd_arm_page_path(c->socket_path, path, sizeof path) != 0) return -ENAMETOOLONG;
  /* Relative to the socket's directory, which prepare_socket_dir checked, not through a link. */
  const char *name;
  const int dir_fd = hd_arm_page_dir_open(path, false, &name);
  if (dir_fd >= 0) remove_abandoned_temporaries(c, dir_fd);
  int fd = dir_fd >= 0 ? hd_arm_page_file_open(dir_fd, name, O_RDWR) : dir_fd;
  /* A page of another layout (an older collector's) is replaced, not rewritten: the processes
   * that mapped it read it by its own layout, and keep it, unarmable by this collector. */
  uint32_t head[2] = {0, 0};
  if (fd >= 0 && (pread(fd, head, sizeof head, 0) != (ssize_t)sizeof head ||
                  head[0] != HD_ARM_PAGE_MAGIC || head[1] != HD_ARM_PAGE_VERSION)) {
    close(fd);
    fd = unlinkat(dir_fd, name, 0) == 0 ? hd_arm_page_file_open(dir_fd, name, O_RDWR) : -errno;
  }
  if (dir_fd >= 0) close(dir_fd);
  if (fd < 0) {
    hd_log(c, HD_LOG_ERROR, "cannot open the arm page %s: %s", path, strerror(-fd));
    return fd;
  }
  struct stat st;
  void *p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
      (st.st_size >= (off_t)HD_ARM_PAGE_BYTES || ftruncate(fd, HD_ARM_PAGE_BYTES) == 0)) {
    p = mmap(NULL, HD_ARM_PAGE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    hd_log(c, HD_LOG_ERROR, "cannot map the arm page %s: %s", path, strerror(err));
    return -err;
  }
  hd_arm_page *page = p;
  /* A collector that died between a slot's two stores left it odd: readers would wait forever. */
  if (page->generation & 1)
    __atomic_store_n(&page->generation, page->generation + 1, __ATOMIC_RELEASE);
  c->arm_page = page;
  c->arm_page_dev = st.st_dev;
  c->arm_page_ino = st.st_ino;
  return 0;
}

void hd_arming_close(hd_collector *c) {
  if (c->arm_page != NULL) munmap(c->arm_page, HD_ARM_PAGE_BYTES);
  c->arm_page = NULL;
}

/* The boottime offset of the time namespace of process `who` ("self" or a pid), in clock ticks
 * (/proc/WHO/timens_offsets; 0 without time namespaces, or in the initial one). */
static int64_t boottime_offset_ticks(const char *who) {
  char path[64], line[128];
  snprintf(path, sizeof path, "/proc/%s/timens_offsets", who);
  FILE *f = fopen(path, "re");
  if (f == NULL) return 0;
  int64_t ticks = 0;
  const long per_second = sysconf(_SC_CLK_TCK);
  while (fgets(line, sizeof line, f) != NULL) {
    char clock[32];
    long long seconds;
    long nanoseconds;
    if (sscanf(line, "%31s %lld %ld", clock, &seconds, &nanoseconds) == 3 &&
        (strcmp(clock, "boottime") == 0 || strcmp(clock, "7") == 0) && per_second > 0) {
      ticks = (int64_t)seconds * per_second + (int64_t)nanoseconds / (1000000000 / per_second);
    }
  }
  fclose(f);
  return ticks;
}

/* The start time of the process as it reads it itself (/proc/self/stat, field 22, shifted by
 * its time namespace's boottime offset), which names it in a slot; 0 if it is gone. */
static uint64_t start_ticks_of(pid_t pid) {
  char path[64], line[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "re");
  if (f == NULL) return 0;
  const bool read = fgets(line, sizeof line, f) != NULL;
  fclose(f);
  const uint64_t start = read ? hd_stat_start_ticks(line) : 0;
  if (start == 0) return 0;
  char who[16];
  snprintf(who, sizeof who, "%d", (int)pid);
  return start + (uint64_t)(boottime_offset_ticks(who) - boottime_offset_ticks("self"));
}

/* Whether every uid of a process (real, effective, saved, filesystem) is uid, as ptrace would
 * ask of a peer that is not root. */
static bool owned_by(pid_t pid, uid_t uid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "re");
  if (f == NULL) return false;
  bool owned = false;
  while (fgets(line, sizeof line, f) != NULL) {
    unsigned ids[4];
    if (sscanf(line, "Uid: %u %u %u %u", &ids[0], &ids[1], &ids[2], &ids[3]) == 4) {
      owned = ids[0] == uid && ids[1] == uid && ids[2] == uid && ids[3] == uid;
      break;
    }
  }
  fclose(f);
  return owned;
}

/* Whether the process maps this collector's arm page, and where (*address); *has_tables: it maps
 * the library's tables too (it records: armed, or a fork child of an armed process; the program
 * a process exec'd does not, whatever its predecessor's registration still says). The page is
 * known by its inode, and by its device or else its path (an overlay shows the file's device
 * under it, not the one fstat answers). */
static bool maps_page(const hd_collector *c, pid_t pid, uint64_t *address, bool *has_tables) {
  char path[64], line[4096 + 128], page_path[sizeof c->socket_path + sizeof HD_ARM_PAGE_SUFFIX];
  if (hd_arm_page_path(c->socket_path, page_path, sizeof page_path) != 0) return false;
  snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
  FILE *f = fopen(path, "re");
  if (f == NULL) return false;
  bool found = false;
  *has_tables = false;
  while (fgets(line, sizeof line, f) != NULL) {
    unsigned long long start, inode;
    unsigned major, minor;
    int name_at = 0;
    if (sscanf(line, "%llx-%*x %*s %*s %x:%x %llu %n", &start, &major, &minor, &inode, &name_at) <
        4) {
      continue;
    }
    line[strcspn(line, "\n")] = '\0';
    if (name_at > 0 && strncmp(line + name_at, "/memfd:" HD_MEMFD_ALLOCATIONS " ",
                               sizeof("/memfd:" HD_MEMFD_ALLOCATIONS)) == 0) {
      *has_tables = true;
    }
    if (found || inode != (unsigned long long)c->arm_page_ino) continue;
    found = makedev(major, minor) == c->arm_page_dev ||
            (name_at > 0 && strcmp(line + name_at, page_path) == 0);
    if (found) *address = start;
  }
  fclose(f);
  return found;
}

/* The slot of the process (pid as the collector sees it, start time, and where it mapped the
 * page: an exec'd program is another); else a free slot or one whose process is gone; NULL if
 * every slot names a running process. */
static hd_arm_slot *slot_for(hd_arm_page *page, pid_t pid, uint64_t start, uint64_t address,
                             bool *existing) {
  hd_arm_slot *free_slot = NULL;
  *existing = false;
  for (uint32_t i = 0; i < HD_ARM_SLOTS; i++) {
    hd_arm_slot *s = &page->slots[i];
    if (s->pid != 0 && s->collector_pid == (uint32_t)pid && s->start_ticks == start) {
      if (s->page_address == address) {
        *existing = true;
        return s;
      }
      if (free_slot == NULL) free_slot = s; /* the program it exec'd from */
    }
    if (free_slot == NULL &&
        (s->pid == 0 || start_ticks_of((pid_t)s->collector_pid) != s->start_ticks)) {
      free_slot = s;
    }
  }
  return free_slot;
}

heapdump_client_CollectorError hd_arming_request(hd_collector *c, pid_t pid, uid_t peer_uid,
                                                 bool recording, bool has_sample_bytes,
                                                 uint64_t sample_bytes, uint64_t *generation) {
  if (c->arm_page == NULL) return heapdump_client_CollectorError_PROCESS_NOT_DORMANT;
  const uint64_t start = start_ticks_of(pid);
  const pid_t own = hd_own_pid(pid);
  if (start == 0 || own <= 0) return heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH;
  if (peer_uid != 0 && !owned_by(pid, peer_uid))
    return heapdump_client_CollectorError_PERMISSION_DENIED;
  /* The collector itself, loaded dormant from /etc/ld.so.preload, would register with itself
   * from inside its own poll thread. */
  uint64_t address = 0;
  bool has_tables = false;
  if (pid == getpid() || !maps_page(c, pid, &address, &has_tables))
    return heapdump_client_CollectorError_PROCESS_NOT_DORMANT;
  bool existing;
  hd_arm_slot *slot = slot_for(c->arm_page, pid, start, address, &existing);
  if (slot == NULL) return heapdump_client_CollectorError_ARM_PAGE_FULL;
  /* Its rate, once armed: its tables' (a fork child of an armed process has no slot of its
   * own), or the one its slot asked for. */
  const heapdump_client_CollectorGetProcessStateResponse st = hd_process_state(c, pid, 0);
  const bool armed = has_tables && st.state == heapdump_client_ProcessState_PROCESS_STATE_RUNNING &&
                     st.has_recording &&
                     st.recording != heapdump_client_RecordingState_RECORDING_FROM_START;
  /* A slot asking for the process's own rate says which only once the process took it: then
   * (its tables made) the rate is fixed, though this collector may not know it yet (restarted,
   * the process not registered again), and only a request without one is sure to agree. */
  const bool rate_known = armed || (existing && (slot->flags & HD_ARM_SLOT_RATE_FIXED) != 0 &&
                                    (slot->sample_bytes != HD_ARM_OWN_RATE || has_tables));
  const uint64_t rate = armed ? st.sample_bytes : slot->sample_bytes;
  if (sample_bytes > HD_MAX_SAMPLE_BYTES) sample_bytes = HD_MAX_SAMPLE_BYTES;
  if (recording && has_sample_bytes && rate_known && sample_bytes != rate)
    return heapdump_client_CollectorError_SAMPLE_RATE_FIXED;
  /* None asked for: the rate it has, else its own (its environment's, else every block). */
  if (recording && !has_sample_bytes) sample_bytes = rate_known ? rate : HD_ARM_OWN_RATE;
  if (!recording && !existing && !armed) return heapdump_client_CollectorError_PROCESS_NOT_ARMED;
  hd_arm_page *page = c->arm_page;
  const uint64_t gen = page->generation;
  __atomic_store_n(&page->generation, gen + 1, __ATOMIC_RELAXED); /* odd: being written */
  __atomic_thread_fence(__ATOMIC_RELEASE);
  __atomic_store_n(&slot->pid, (uint32_t)own, __ATOMIC_RELAXED);
  __atomic_store_n(&slot->start_ticks, start, __ATOMIC_RELAXED);
  __atomic_store_n(&slot->page_address, address, __ATOMIC_RELAXED);
  __atomic_store_n(&slot->collector_pid, (uint32_t)pid, __ATOMIC_RELAXED);
  if (recording || !existing) __atomic_store_n(&slot->sample_bytes, sample_bytes, __ATOMIC_RELAXED);
  __atomic_store_n(&slot->flags,
                   (existing ? slot->flags : 0) | (recording ? HD_ARM_SLOT_RATE_FIXED : 0),
                   __ATOMIC_RELAXED);
  __atomic_store_n(&slot->request, recording ? HD_ARM_SLOT_RECORD : HD_ARM_SLOT_PAUSE,
                   __ATOMIC_RELAXED);
  __atomic_store_n(&page->generation, gen + 2, __ATOMIC_RELEASE);
  *generation = gen + 2;
  if (!recording)
    hd_log(c, HD_LOG_INFO, "process %d disarmed", (int)pid);
  else if (sample_bytes == 0)
    hd_log(c, HD_LOG_INFO, "process %d armed: every block", (int)pid);
  else if (sample_bytes == HD_ARM_OWN_RATE)
    hd_log(c, HD_LOG_INFO, "process %d armed: at its own rate", (int)pid);
  else
    hd_log(c, HD_LOG_INFO, "process %d armed: sampled, one block per %" PRIu64 " bytes", (int)pid,
           sample_bytes);
  return heapdump_client_CollectorError_COLLECTOR_ERROR_UNSPECIFIED;
}

void hd_arming_note_failure(hd_collector *c, pid_t pid, uid_t uid, uint64_t generation,
                            const char *what, int error) {
  hd_arm_failure_record r = {.pid = pid, .uid = uid, .generation = generation};
  r.start_ticks = start_ticks_of(pid);
  if (r.start_ticks == 0) return; /* gone already: nobody can ask about it */
  char reason[64];
  if (error > 0 && error < 4096)
    snprintf(reason, sizeof reason, "%s", strerror(error));
  else
    snprintf(reason, sizeof reason, "error %d", error);
  snprintf(r.text, sizeof r.text, "making %s: %s", what, reason);
  /* The process's words reach a terminal: nothing of them may drive it. */
  for (char *p = r.text; *p != '\0'; p++) {
    if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
  }
  hd_log(c, HD_LOG_WARN, "process %d could not arm (it stays dormant): %s", (int)pid, r.text);
  pthread_mutex_lock(&c->lock);
  c->arm_failures[c->arm_failures_next++ % HD_ARM_FAILURES] = r;
  pthread_mutex_unlock(&c->lock);
}

void hd_arming_failure_of(hd_collector *c, pid_t pid, uid_t uid,
                          heapdump_client_CollectorGetProcessStateResponse *out) {
  hd_arm_failure_record last = {0};
  pthread_mutex_lock(&c->lock);
  for (size_t i = 0; i < HD_ARM_FAILURES; i++) {
    const hd_arm_failure_record *r = &c->arm_failures[i];
    if (r->pid == pid && r->pid != 0 && (uid == 0 || r->uid == uid) &&
        (last.pid == 0 || r->generation > last.generation)) {
      last = *r;
    }
  }
  pthread_mutex_unlock(&c->lock);
  if (last.pid == 0 || start_ticks_of(pid) != last.start_ticks) return;
  out->has_arm_failure = out->has_arm_failure_generation = true;
  out->arm_failure_generation = last.generation;
  snprintf(out->arm_failure, sizeof out->arm_failure, "%s", last.text);
}
