/* Calls made while this thread is already inside the library: from the library's own code
 * (forwarded, unrecorded) or from a signal handler that interrupted a hook (done at once on the
 * allocator, the table part queued here and applied by the interrupted hook). */
#define _GNU_SOURCE
#include "runtime.h"

#include <errno.h>
#include <string.h>

#include "heapdump/contract/dcheck.h"
#include "stack.h"

/* Queues op for the interrupted hook; false if the queue is full. The slot is claimed with one
 * atomic add, so a handler interrupting this one (a second signal) claims another slot. */
static bool queue_pending(const hd_pending_op *op) {
  uint32_t i = __atomic_fetch_add(&hd_tls.pending_count, 1, __ATOMIC_RELAXED);
  if (i >= HD_PENDING_MAX) return false;
  hd_tls.pending[i] = *op;
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  return true;
}

/* From a signal handler inside a hook: the block is real already; its record waits. The trace
 * is taken here (the handler's own stack), unless that cannot be done safely. Its node is
 * reserved and written in its tag now, while the handler still owns the block: by the time the
 * record is written, the program may have freed the block, whose tag must then not be touched. */
static void defer_record(void *p, size_t size, unsigned lg_align, size_t usable) {
  if (__atomic_load_n(&hd_state, __ATOMIC_ACQUIRE) != HD_STATE_READY) return;
  /* Sampled like a hook's allocation; a handler that interrupts the hook's own countdown
   * update may lose or repeat one interval, which only moves the sample points. */
  const hd_record_choice choice = hd_choose(size);
  if (choice != HD_RECORD) {
    if (choice == HD_UNATTRIBUTED) hd_leave_out(p, usable, choice);
    return;
  }
  hd_pending_op op = {.ptr = p,
                      .size = size,
                      .lg_align = lg_align & HD_NODE_ALIGN_MASK,
                      .thread_key = hd_tls.thread_key,
                      .timestamp = hd_res_timestamp_after_mark(&hd_live_res, hd_now_ns()),
                      .node = hd_alloc_table_reserve(&hd_live_alloc)};
  if (op.node == HD_NO_NODE) {
    hd_res_count_drop(&hd_live_res, offsetof(hd_stats_block, dropped_allocations));
    return;
  }
  hd_tag_set_at(p, usable, op.node);
  uint64_t frames[HD_MAX_FRAMES];
  bool truncated;
  unsigned n = hd_capture_stack(frames, true, &truncated, NULL);
  if (n > 0) {
    op.stack_key =
        hd_res_intern_stack_nowait(&hd_live_res, frames, n, truncated ? HD_STACK_TRUNCATED : 0);
  }
  if (!queue_pending(&op)) {
    hd_tag_set_at(p, usable, HD_NO_NODE);
    hd_alloc_table_release(&hd_live_alloc, op.node);
    hd_res_count_drop(&hd_live_res, offsetof(hd_stats_block, dropped_allocations));
  }
}

void *hd_nested_alloc(size_t size, unsigned lg_align, bool zero) {
  if (hd_tls.in_backend) {
    errno = ENOMEM;
    return NULL;
  }
  size_t usable;
  void *p = hd_backend_alloc(size, lg_align, zero, &usable);
  if (!p) {
    errno = ENOMEM;
    return NULL;
  }
  hd_tag_set_at(p, usable, HD_NO_NODE); /* unless a record is queued */
  if (!hd_tls.guard) defer_record(p, size, lg_align, usable);
  return p;
}

void hd_nested_free(void *p) {
  if (hd_tls.guard && !hd_tls.in_backend) {
    hd_tag_clear(p);
    hd_backend_free(p, 0, 0);
    return;
  }
  /* Erasing now could wait for a slot lock the interrupted hook holds; freeing before the erase
   * would let another thread get the address while it is still recorded. Both wait. */
  hd_pending_op op = {.ptr = p, .is_free = 1};
  if (queue_pending(&op)) return;
  /* Queue full: the block is not returned (leaked), so that its record, if it has one, stays
   * true: a free that erased nothing would leave a record of a block the allocator hands out
   * again, and with no index over addresses nothing would find that record later. */
}

void *hd_nested_realloc(void *p, size_t size) {
  if (hd_tls.in_backend) {
    errno = ENOMEM;
    return NULL;
  }
  if (hd_tls.guard) {
    const uint64_t tag = hd_tag_clear(p); /* glibc frees p if it moves the block */
    void *q = hd_backend_realloc(p, size);
    if (!q) {
      hd_tag_restore(p, tag);
      errno = ENOMEM;
    } else {
      hd_tag_set(q, HD_NO_NODE);
    }
    return q;
  }
  /* Always moves: the old block's record can only be dropped later, with its free. */
  void *q = hd_nested_alloc(size, 0, false);
  if (!q) return NULL;
  size_t old_usable = hd_program_usable(p);
  memcpy(q, p, old_usable < size ? old_usable : size);
  hd_nested_free(p);
  return q;
}

void hd_drain_pending(void) {
  int saved_errno = errno;
  hd_backend_publish_waiting_mappings(); /* what a handler's allocation made the allocator map */
  uint32_t done = 0;
  for (;;) {
    uint32_t n = __atomic_load_n(&hd_tls.pending_count, __ATOMIC_RELAXED);
    for (; done < n && done < HD_PENDING_MAX; done++) {
      hd_pending_op op = hd_tls.pending[done];
      __atomic_signal_fence(__ATOMIC_SEQ_CST);
      HD_DCHECK(op.is_free || op.node != HD_NO_NODE); /* queued only with a node reserved */
      if (op.is_free) {
        hd_free_recorded(op.ptr);
      } else if (__atomic_load_n(&hd_state, __ATOMIC_RELAXED) == HD_STATE_READY) {
        /* The block's tag already names op.node; the block itself may be gone. */
        hd_alloc_info info = {.address = (uint64_t)(uintptr_t)op.ptr,
                              .size = op.size,
                              .timestamp = op.timestamp,
                              .thread_key = op.thread_key,
                              .stack_key = op.stack_key,
                              .flags = op.lg_align};
        hd_tls.writer.last_alloc_address = info.address; /* the thread's latest allocation */
        if (hd_alloc_table_fill(&hd_live_alloc, &hd_tls.writer, op.node, &info)) {
          const uint64_t blocks =
              hd_sample_weight(info.address, info.timestamp, info.size, hd_sample_bytes);
          hd_res_count_alloc(&hd_live_res, &hd_tls.writer, info.stack_key, blocks,
                             blocks * info.size, info.timestamp);
        } else {
          hd_res_count_drop(&hd_live_res, offsetof(hd_stats_block, dropped_allocations));
        }
      }
    }
    /* Fails if a handler queued more meanwhile: those are applied in the next round. */
    if (__atomic_compare_exchange_n(&hd_tls.pending_count, &n, 0, false, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED))
      break;
  }
  errno = saved_errno;
}
