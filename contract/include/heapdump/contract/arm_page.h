/* The arm page: how a collector tells a dormant process (HEAPDUMP_DORMANT=1, or the library
 * named in /etc/ld.so.preload) to start or stop recording, without a syscall on the process's
 * allocation path, a thread, a signal or ptrace.
 *
 * The collector keeps one file beside its socket (hd_arm_page_path), HD_ARM_PAGE_BYTES long,
 * mode 0644, which only it writes (whoever made it: contract/arm_page_file.h). A dormant process
 * maps it read-only once, at start, and on every allocation compares one word, the page's
 * generation, with the last it acted on; only when it moved does the process look for its own slot.
 * The collector changes a slot as a seqlock writer: generation made odd, the slot written,
 * generation made even (release), so a process that saw an odd generation, or a different one after
 * reading its slot, reads it again later.
 *
 * A slot names a process by its own pid (the pid in its innermost namespace, what getpid()
 * answers inside it), its start time (field 22 of /proc/PID/stat, clock ticks after boot, as the
 * process reads it in its own time namespace) and the address at which it mapped the page (from
 * /proc/PID/maps), so that neither a reused pid, nor a process of another pid namespace, nor the
 * program a process exec'd (same pid and start time, its own mapping, placed by a draw where
 * addresses are not randomised) takes a request meant for another. A slot stays the process's until
 * it exits; the collector reuses slots of exited processes.
 *
 * The file is kept across collector restarts (opened, never truncated: processes that mapped it
 * keep the same inode). A collector starting on a file with another magic or version replaces
 * it with a new file: processes that mapped the old one read it by its own layout, and keep it,
 * never armed by this collector. Layout fixed-width little-endian, pinned below. */
#ifndef HEAPDUMP_CONTRACT_ARM_PAGE_H
#define HEAPDUMP_CONTRACT_ARM_PAGE_H

#include <stddef.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/contract/names.h"

#define HD_ARM_PAGE_MAGIC UINT32_C(0x6d726168) /* "harm" */
#define HD_ARM_PAGE_VERSION 3u
#define HD_ARM_SLOTS 818u
#define HD_ARM_PAGE_SUFFIX ".arm" /* appended to the socket path */

/* What a slot asks of its process. */
enum {
  HD_ARM_SLOT_FREE = 0,
  HD_ARM_SLOT_RECORD = 1, /* record from the next allocation on (sample_bytes: the rate) */
  HD_ARM_SLOT_PAUSE = 2,  /* record no new block; frees still take records out */
};

typedef struct hd_arm_slot {
  uint32_t pid;           /* the process's own pid; 0 = free slot */
  uint32_t request;       /* HD_ARM_SLOT_* */
  uint64_t start_ticks;   /* /proc/PID/stat starttime */
  uint64_t page_address;  /* where the process mapped this page */
  uint64_t sample_bytes;  /* with HD_ARM_SLOT_RECORD: 0 = every block, HD_ARM_OWN_RATE, else
                           * the mean interval */
  uint32_t collector_pid; /* the collector's own: the pid as it sees the process */
  uint32_t flags;         /* the collector's own: HD_ARM_SLOT_RATE_FIXED */
} hd_arm_slot;

/* A slot's sample_bytes when no rate was asked for: the process's own, HEAPDUMP_SAMPLE_BYTES
 * from its environment (a service's drop-in may set it), else every block. */
#define HD_ARM_OWN_RATE UINT64_MAX

/* The process was asked to record: its rate stays sample_bytes until it exits. */
#define HD_ARM_SLOT_RATE_FIXED 1u

typedef struct hd_arm_page {
  uint32_t magic;      /* HD_ARM_PAGE_MAGIC */
  uint32_t version;    /* HD_ARM_PAGE_VERSION */
  uint64_t generation; /* atomic: odd while the collector writes a slot */
  uint64_t reserved[2];
  hd_arm_slot slots[HD_ARM_SLOTS];
  uint64_t tail[2];
} hd_arm_page;

#define HD_ARM_PAGE_BYTES 32768u

_Static_assert(sizeof(hd_arm_slot) == 40, "hd_arm_slot size");
_Static_assert(offsetof(hd_arm_page, generation) == 8, "hd_arm_page generation");
_Static_assert(offsetof(hd_arm_page, slots) == 32, "hd_arm_page slots");
_Static_assert(sizeof(hd_arm_page) == HD_ARM_PAGE_BYTES, "hd_arm_page size");

/* The arm page's path for the collector socket at socket_path. 0, or -2 if it does not fit. */
static HD_MUST_CHECK inline int hd_arm_page_path(const char *socket_path, char *out, size_t size) {
  size_t length = 0;
  return hd_path_append(out, size, &length, socket_path) &&
                 hd_path_append(out, size, &length, HD_ARM_PAGE_SUFFIX)
             ? 0
             : -2;
}

/* Field 22 (starttime) of a /proc/PID/stat line; 0 if it cannot be parsed. The command name
 * (field 2) may hold spaces and parentheses: fields are counted from its last ')'. */
static inline uint64_t hd_stat_start_ticks(const char *stat_line) {
  const char *p = NULL;
  for (const char *q = stat_line; *q; q++)
    if (*q == ')') p = q;
  if (p == NULL) return 0;
  int field = 2;
  for (p++; *p && field < 22; p++) {
    if (*p == ' ') field++;
  }
  uint64_t v = 0;
  for (; *p >= '0' && *p <= '9'; p++) v = v * 10 + (uint64_t)(*p - '0');
  return field == 22 ? v : 0;
}

#endif /* HEAPDUMP_CONTRACT_ARM_PAGE_H */
