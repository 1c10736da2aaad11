/* The public API (heapdump/heapdump.h): statistics and named snapshots. */
#define _GNU_SOURCE
#include "runtime.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>

#include "heapdump/contract/names.h"
#include "heapdump/heapdump.h"
#include "registration.h"

_Static_assert(HD_NAME_MAX == HEAPDUMP_SNAPSHOT_NAME_MAX,
               "a named snapshot's name is a protocol name");

/* The size of struct heapdump_stats in heapdump 0.1, whose programs call heapdump_get_stats. */
#define STATS_V1_SIZE 64
_Static_assert(offsetof(struct heapdump_stats, dropped_allocations) + 8 == STATS_V1_SIZE,
               "fields are only ever added at the end of struct heapdump_stats");

__attribute__((visibility("default"))) int heapdump_get_stats_sized(struct heapdump_stats *out,
                                                                    size_t size) {
  if (!out || size < STATS_V1_SIZE) return HEAPDUMP_ERROR_INVALID_ARGUMENT;
  memset(out, 0, size); /* a newer caller's fields this library does not know are zero */
  hd_ensure_init();
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY)
    return HEAPDUMP_ERROR_NOT_RECORDING;
  hd_stats_block s;
  hd_res_read_stats(&hd_live_res, &s);
  struct heapdump_stats now = {
      .blocks_allocated = s.blocks_allocated,
      .bytes_allocated = s.bytes_allocated,
      .blocks_freed = s.blocks_freed,
      .bytes_freed = s.bytes_freed,
      .peak_live_bytes = s.peak_live_bytes,
      .dropped_allocations = s.dropped_allocations,
  };
  /* The counters are read one by one while other threads move them: a free counted after its
   * allocation was read would make the difference wrap below zero. */
  now.live_blocks =
      now.blocks_allocated > now.blocks_freed ? now.blocks_allocated - now.blocks_freed : 0;
  now.live_bytes =
      now.bytes_allocated > now.bytes_freed ? now.bytes_allocated - now.bytes_freed : 0;
  if (now.peak_live_bytes < now.live_bytes) now.peak_live_bytes = now.live_bytes;
  memcpy(out, &now, size < sizeof now ? size : sizeof now); /* only what an older caller knows */
  return HEAPDUMP_OK;
}

/* The entry point of programs built against heapdump 0.1's header, where heapdump_get_stats was
 * a function (now a macro passing the struct's size). */
#undef heapdump_get_stats
__attribute__((visibility("default"))) int heapdump_get_stats(struct heapdump_stats *out);
int heapdump_get_stats(struct heapdump_stats *out) {
  return heapdump_get_stats_sized(out, STATS_V1_SIZE);
}

__attribute__((visibility("default"))) int heapdump_take_named_snapshot(const char *name) {
  if (!name || !*name || strlen(name) > HEAPDUMP_SNAPSHOT_NAME_MAX)
    return HEAPDUMP_ERROR_INVALID_ARGUMENT;
  /* Cancelled inside (at a socket call), the thread would leave the registration lock held and
   * every later call of any thread would hang: the call runs to its end, like one system call,
   * and a pending cancellation acts at the caller's next cancellation point. */
  int cancel_state;
  pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cancel_state);
  hd_owned_fd memfd;
  int rc = hd_snapshot_copy_live(&memfd);
  if (rc == 0) {
    rc = hd_store_named_snapshot(name, &memfd, false);
    hd_owned_fd_close(&memfd);
  } else {
    rc = rc == -ENODEV ? HEAPDUMP_ERROR_NOT_RECORDING : HEAPDUMP_ERROR_NO_MEMORY;
  }
  pthread_setcancelstate(cancel_state, NULL);
  return rc;
}
