/* Snapshot streams: each runs on a stream thread (a bounded pool), picks the processes (after a
 * rescan of /proc, at most once a second), reads their tables (or a stored snapshot) and sends
 * batches, each acknowledged before the next (HD_BATCH_WINDOW). */
#define _GNU_SOURCE
#include <assert.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "collector_internal.h"
#include "contents.h"
#include "heapdump/contract/dcheck.h"
#include "heapdump/contract/must_check.h"
#include "heapdump_client.bindings.h"
#include "roots.h"

/* A client that does not acknowledge a batch for this long is dropped. */
#define ACK_TIMEOUT_SECONDS 60
/* How long a stopping collector lets running streams finish before it cuts their clients off. */
#define STOP_GRACE_SECONDS 2
/* Blocks larger than this are sent without contents. */
#define MAX_CONTENTS_BLOCK (256u << 20)

/* ---- a small set of u32 keys, in first-seen order ---- */

typedef struct key_set {
  uint32_t *slots; /* index in order + 1; 0 = empty */
  size_t capacity;
  uint32_t *order;
  size_t count;
} key_set;

/* Whether key is in s, and where in s->order (index nullable). */
static bool key_set_find(const key_set *s, uint32_t key, size_t *index) {
  if (s->capacity == 0) return false;
  for (size_t j = (key * 2654435761u) & (s->capacity - 1); s->slots[j] != 0;
       j = (j + 1) & (s->capacity - 1)) {
    if (s->order[s->slots[j] - 1] == key) {
      if (index != NULL) *index = s->slots[j] - 1;
      return true;
    }
  }
  return false;
}

static bool key_set_add(key_set *s, uint32_t key) {
  if ((s->count + 1) * 2 > s->capacity) {
    size_t capacity = s->capacity ? s->capacity * 2 : 256;
    uint32_t *slots = calloc(capacity, sizeof *slots);
    uint32_t *order = realloc(s->order, capacity * sizeof *order);
    if (slots == NULL || order == NULL) {
      free(slots);
      if (order != NULL) s->order = order;
      return false;
    }
    s->order = order;
    for (size_t i = 0; i < s->count; i++) {
      size_t j = (s->order[i] * 2654435761u) & (capacity - 1);
      while (slots[j] != 0) j = (j + 1) & (capacity - 1);
      slots[j] = (uint32_t)i + 1;
    }
    free(s->slots);
    s->slots = slots;
    s->capacity = capacity;
  }
  size_t j = (key * 2654435761u) & (s->capacity - 1);
  while (s->slots[j] != 0) {
    if (s->order[s->slots[j] - 1] == key) return true;
    j = (j + 1) & (s->capacity - 1);
  }
  s->order[s->count] = key;
  s->slots[j] = (uint32_t)++s->count;
  return true;
}

static void key_set_free(key_set *s) {
  free(s->slots);
  free(s->order);
}

/* ---- producing elements ---- */

/* What was live at the process's latest peak mark (shm_layout.h), per stack trace: the live
 * blocks allocated by the mark, plus the blocks each trace's counters say were live at the mark
 * and freed since. */
typedef struct peak_parts {
  uint64_t mark; /* read before the live blocks; 0: no mark, nothing attributed */
  uint64_t start_time_ns;
  uint64_t *live_blocks, *live_bytes; /* per index of the snapshot's stack key set */
  uint64_t blocks, bytes;             /* the sums of what the traces sent carry */
} peak_parts;

/* The blocks and bytes a live block stands for: itself, or what its sampling weight makes it
 * (hd_sample_weight, as the process counted it). */
static uint64_t weight_of(const hd_live_block *b, uint64_t sample_bytes) {
  return hd_sample_weight(b->address, b->timestamp, b->size, sample_bytes);
}

/* Sums the live blocks allocated by the mark per stack trace. false: out of memory. */
static bool peak_parts_count(peak_parts *peak, const hd_live_block *blocks, size_t count,
                             const key_set *stacks, uint64_t sample_bytes) {
  if (peak->mark == 0) return true;
  peak->live_blocks = calloc(stacks->count + 1, sizeof *peak->live_blocks);
  peak->live_bytes = calloc(stacks->count + 1, sizeof *peak->live_bytes);
  if (peak->live_blocks == NULL || peak->live_bytes == NULL) return false;
  for (size_t i = 0; i < count; i++) {
    size_t index;
    if (hd_peak_allocated_by(blocks[i].timestamp, peak->start_time_ns, peak->mark) &&
        key_set_find(stacks, blocks[i].stack_key, &index)) {
      const uint64_t k = weight_of(&blocks[i], sample_bytes);
      peak->live_blocks[index] += k;
      peak->live_bytes[index] += k * blocks[i].size;
    }
  }
  return true;
}

static void peak_parts_free(peak_parts *peak) {
  free(peak->live_blocks);
  free(peak->live_bytes);
}

/* A trace's count of blocks live at the mark and freed since, if it is of this mark. */
static uint64_t freed_since_mark(uint64_t tagged, uint64_t mark) {
  return hd_peak_mark_number(tagged) == hd_peak_mark_number(mark) ? hd_peak_mark_value(tagged) : 0;
}

/* The process's statistics, and its series up to now ending with this snapshot's own moment,
 * named `name`, with the same statistics. Unreadable statistics (a corrupt table) leave both
 * out: the snapshot goes on without them. */
static HD_MUST_CHECK hd_status add_stats_and_series(hd_process *p, const char *name,
                                                    const peak_parts *peak, hd_batch_writer *w,
                                                    hd_series_moment *moment) {
  hd_table_stats st;
  if (hd_res_reader_stats(p->res, &st) != HD_READ_OK) return HD_OK;
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_process_stats_tag;
  e.element.process_stats =
      (heapdump_client_ProcessStats){.has_blocks_allocated = true,
                                     .blocks_allocated = st.blocks_allocated,
                                     .has_bytes_allocated = true,
                                     .bytes_allocated = st.bytes_allocated,
                                     .has_blocks_freed = true,
                                     .blocks_freed = st.blocks_freed,
                                     .has_bytes_freed = true,
                                     .bytes_freed = st.bytes_freed,
                                     .has_live_blocks = true,
                                     .live_blocks = st.live_blocks,
                                     .has_live_bytes = true,
                                     .live_bytes = st.live_bytes,
                                     .has_peak_live_bytes = true,
                                     .peak_live_bytes = st.peak_live_bytes,
                                     .has_dropped_allocations = true,
                                     .dropped_allocations = st.dropped_allocations,
                                     .has_dropped_stack_traces = true,
                                     .dropped_stack_traces = st.dropped_stack_traces,
                                     .has_dropped_resources = true,
                                     .dropped_resources = st.dropped_resources,
                                     .has_stacks_beyond_cfi = true,
                                     .stacks_beyond_cfi = st.stacks_beyond_cfi,
                                     .has_writes_past_block_end = true,
                                     .writes_past_block_end = st.writes_past_block_end,
                                     .has_mapping_records_lost = true,
                                     .mapping_records_lost = st.mapping_records_lost,
                                     .has_unwind_tables_refused = true,
                                     .unwind_tables_refused = st.unwind_tables_refused,
                                     .has_sample_bytes = st.sample_bytes != 0,
                                     .sample_bytes = st.sample_bytes,
                                     .has_unattributed_bytes = st.arm_state != HD_ARM_FROM_START,
                                     .unattributed_bytes = st.unattributed_bytes,
                                     .has_recording = true,
                                     .recording = hd_recording_state((uint32_t)st.arm_state)};
  /* A mark set while the snapshot was read would mix two moments: nothing is attributed. */
  if (peak->mark != 0 && st.peak_mark == peak->mark) {
    heapdump_client_ProcessStats *ps = &e.element.process_stats;
    ps->has_peak_mark_time = ps->has_peak_mark_bytes = ps->has_peak_mark_blocks = true;
    ps->peak_mark_time =
        (int64_t)(peak->start_time_ns + (hd_peak_mark_value(peak->mark) << HD_PEAK_TIME_SHIFT));
    ps->peak_mark_bytes = peak->bytes;
    ps->peak_mark_blocks = peak->blocks;
  }
  hd_status status = hd_batch_add(w, &e);
  return status == HD_OK ? hd_series_write(&p->series, &st, name, w, moment) : status;
}

static HD_MUST_CHECK hd_status add_contents(void *writer, uint64_t address, const uint8_t *bytes,
                                            uint64_t size) {
  return hd_batch_add_block_contents(writer, address, bytes, size);
}

/* Sends stack trace key and its counters. only_if_allocated: skip a trace whose counters say
 * nothing was allocated from it (nothing to report without live blocks). live_index: the
 * trace's index in the snapshot's stack key set, or SIZE_MAX if no live block names it.
 * *unsettled counts the traces whose counters are sent unsettled. */
static HD_MUST_CHECK hd_status add_stack_trace(hd_process *p, hd_pending_index *pending,
                                               uint32_t key, uint64_t *frames,
                                               bool only_if_allocated, size_t live_index,
                                               peak_parts *peak, size_t *unsettled,
                                               hd_batch_writer *w) {
  size_t n = 0;
  hd_trace_counters counters = {0};
  bool truncated = false;
  bool known = key != 0 && hd_res_reader_stack_indexed(p->res, pending, key, frames, HD_MAX_FRAMES,
                                                       &n, &counters, &truncated) == HD_READ_OK;
  if (only_if_allocated && (!known || counters.allocated_blocks == 0)) return HD_OK;
  hd_status status = hd_batch_add_stack_trace(w, key, frames, known ? n : 0, known && truncated);
  if (status == HD_OK && known) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_stack_trace_counters_tag;
    e.element.stack_trace_counters =
        (heapdump_client_StackTraceCounters){.has_stack_trace_key = true,
                                             .stack_trace_key = key,
                                             .has_allocated_blocks = true,
                                             .allocated_blocks = counters.allocated_blocks,
                                             .has_allocated_bytes = true,
                                             .allocated_bytes = counters.allocated_bytes,
                                             .has_temporary_blocks = true,
                                             .temporary_blocks = counters.temporary_blocks,
                                             .has_unsettled = counters.unsettled,
                                             .unsettled = counters.unsettled};
    if (counters.unsettled) (*unsettled)++;
    if (peak->mark != 0) {
      heapdump_client_StackTraceCounters *tc = &e.element.stack_trace_counters;
      tc->peak_blocks = freed_since_mark(counters.peak_freed_blocks, peak->mark);
      tc->peak_bytes = freed_since_mark(counters.peak_freed_bytes, peak->mark);
      if (live_index != SIZE_MAX) {
        tc->peak_blocks += peak->live_blocks[live_index];
        tc->peak_bytes += peak->live_bytes[live_index];
      }
      tc->has_peak_blocks = tc->has_peak_bytes = tc->peak_blocks != 0;
      peak->blocks += tc->peak_blocks;
      peak->bytes += tc->peak_bytes;
    }
    status = hd_batch_add(w, &e);
  }
  return status;
}

static bool stop_requested(void *collector) {
  return atomic_load(&((hd_collector *)collector)->stop_requested);
}

/* Copies the live blocks of p's table (or of its sealed copy snapshot_alloc) within the read
 * timeout, and notes the peak mark before (*peak zeroed, then its mark and start time). Returns
 * 0, or -EIO with why (for a person) in why. */
static HD_MUST_CHECK int read_live_blocks(hd_collector *c, hd_process *p,
                                          hd_alloc_reader *snapshot_alloc, hd_live_block **blocks,
                                          size_t *count, peak_parts *peak, char *why,
                                          size_t why_size) {
  hd_alloc_reader *table = snapshot_alloc ? snapshot_alloc : p->alloc;
  *peak = (peak_parts){0};
  hd_table_stats before;
  hd_alloc_table_info copy;
  if (hd_res_reader_stats(p->res, &before) == HD_READ_OK) {
    peak->mark = before.peak_mark;
    peak->start_time_ns = before.start_time_ns;
    /* A copy's blocks go with the mark of when it was made: a mark set since then is a change
     * (add_stats_and_series). */
    if (snapshot_alloc != NULL && hd_alloc_reader_info(snapshot_alloc, &copy) == HD_READ_OK)
      peak->mark = copy.snapshot_peak_mark;
  }
  /* A sealed copy cannot change, nor can the table of a process that has exited (a process
   * killed inside the library leaves a slot locked forever): both are read as they are. */
  hd_read_limits limits = {
      .deadline_ns = hd_monotonic_ns() + c->read_timeout_ns,
      .stop = stop_requested,
      .stop_ctx = c,
      .final = snapshot_alloc != NULL || !hd_process_alive(p),
  };
  hd_read_status rs = hd_alloc_reader_snapshot_unordered(table, &limits, blocks, count);
  hd_alloc_reader_release_pages(table); /* the copy is all this snapshot needs from now on */
  if (rs != HD_READ_OK) {
    hd_log(c, HD_LOG_WARN, "snapshot of %s[%u] failed: %s", p->name, (unsigned)p->pid,
           hd_read_status_str(rs));
    snprintf(why, why_size, "its allocations table could not be read: %s", hd_read_status_str(rs));
    return -EIO;
  }
  return 0;
}

/* One Allocation per block, noting the stack traces and threads they name. *out_of_memory when
 * a key could not be noted. A sampled block is sent as the k blocks of its size it stands for
 * (count k, size k times its own), as the protocol sends blocks aggregated. */
static HD_MUST_CHECK hd_status add_allocations(const hd_live_block *blocks, size_t count,
                                               uint64_t sample_bytes, hd_batch_writer *w,
                                               hd_snapshot_totals *totals, key_set *stacks,
                                               key_set *threads, bool *out_of_memory) {
  hd_status status = HD_OK;
  for (size_t i = 0; i < count && status == HD_OK; i++) {
    const hd_live_block *b = &blocks[i];
    if (!key_set_add(stacks, b->stack_key) || !key_set_add(threads, b->thread_key)) {
      *out_of_memory = true;
      break;
    }
    const uint64_t k = weight_of(b, sample_bytes);
    const heapdump_client_Allocation a = {
        .has_address = true,
        .address = b->address,
        .has_size = true,
        .size = k * b->size,
        .has_stack_trace_key = true,
        .stack_trace_key = b->stack_key,
        .has_timestamp = true,
        .timestamp = (int64_t)b->timestamp,
        .has_thread_info_key = true,
        .thread_info_key = b->thread_key,
        .has_count = k != 1,
        .count = k,
    };
    status = hd_batch_add_allocation(w, &a);
    if (totals != NULL) {
      totals->live_bytes += k * b->size;
      totals->live_blocks += k;
    }
  }
  return status;
}

/* A ThreadInfo for every thread key the allocations name. */
static HD_MUST_CHECK hd_status add_thread_infos(hd_process *p, const key_set *threads,
                                                hd_batch_writer *w) {
  hd_status status = HD_OK;
  for (size_t i = 0; i < threads->count && status == HD_OK; i++) {
    hd_thread_info t;
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_thread_info_tag;
    e.element.thread_info.has_thread_info_key = true;
    e.element.thread_info.thread_info_key = threads->order[i];
    e.element.thread_info.has_name = true;
    /* Key 0 (or an unreadable record) still gets an entry, so every reference resolves. */
    if (threads->order[i] != 0 &&
        hd_res_reader_thread(p->res, threads->order[i], &t) == HD_READ_OK) {
      e.element.thread_info.has_koid = true;
      e.element.thread_info.koid = t.tid;
      snprintf(e.element.thread_info.name, sizeof e.element.thread_info.name, "%s", t.name);
    } else {
      strcpy(e.element.thread_info.name, "(unknown)");
    }
    status = hd_batch_add(w, &e);
  }
  return status;
}

/* The stack traces the allocations name, then from the resources log the traces no live block
 * names any more (they still carry allocation counters: what was allocated since start, pprof's
 * alloc_space) and every executable region. */
static HD_MUST_CHECK hd_status add_traces_and_regions(hd_process *p, const key_set *stacks,
                                                      peak_parts *peak, size_t *unsettled,
                                                      hd_batch_writer *w) {
  uint64_t frames[HD_MAX_FRAMES];
  hd_status status = HD_OK;
  /* Made after the live blocks were read, so that the counts of a trace include the blocks'
   * allocations (but for one whose count a thread had not yet added when the index was made). */
  hd_pending_index *pending = hd_res_reader_pending_index(p->res);
  for (size_t i = 0; i < stacks->count && status == HD_OK; i++) {
    status = add_stack_trace(p, pending, stacks->order[i], frames, false, i, peak, unsettled, w);
  }
  hd_res_entry *entry = malloc(sizeof *entry);
  if (entry == NULL) {
    hd_pending_index_free(pending);
    return HD_ERR_NO_MEMORY;
  }
  uint64_t cursor = 0;
  while (status == HD_OK && hd_res_reader_next(p->res, &cursor, entry) == HD_READ_OK) {
    if (entry->type == HD_ENTRY_STACK && entry->key != 0 &&
        !key_set_find(stacks, entry->key, NULL)) {
      status = add_stack_trace(p, pending, entry->key, frames, true, SIZE_MAX, peak, unsettled, w);
    } else if (entry->type == HD_ENTRY_REGION) {
      const hd_region *g = &entry->u.region;
      status = hd_batch_add_executable_region(w, g->address, g->size, g->file_offset, g->vaddr,
                                              g->build_id, g->build_id_len, g->name);
    }
  }
  free(entry);
  hd_pending_index_free(pending);
  return status;
}

/* The snapshot of p whose live blocks were read (blocks, count: taken and freed here). */
static HD_MUST_CHECK int produce_from_blocks(hd_collector *c, hd_process *p, hd_live_block *blocks,
                                             size_t count, peak_parts *peak, const char *name,
                                             bool with_contents, hd_batch_writer *w,
                                             hd_snapshot_totals *totals, hd_series_moment *moment) {
  key_set stacks = {0}, threads = {0};
  bool out_of_memory = false;
  const uint64_t sample_bytes = hd_res_reader_sample_bytes(p->res);
  hd_status status =
      add_allocations(blocks, count, sample_bytes, w, totals, &stacks, &threads, &out_of_memory);
  if (status == HD_OK && !out_of_memory)
    out_of_memory = !peak_parts_count(peak, blocks, count, &stacks, sample_bytes);
  if (status == HD_OK && !out_of_memory) status = add_thread_infos(p, &threads, w);
  size_t unsettled = 0;
  if (status == HD_OK && !out_of_memory)
    status = add_traces_and_regions(p, &stacks, peak, &unsettled, w);
  if (unsettled > 0) {
    hd_log(c, HD_LOG_WARN,
           "snapshot of %s[%u]: the counts of %zu stack trace(s) were read while a thread stayed "
           "inside a change of its share of them past 1 s (stopped by a debugger or a signal?): "
           "sent marked unsettled",
           p->name, (unsigned)p->pid, unsettled);
  }
  if (status == HD_OK && !out_of_memory) status = add_stats_and_series(p, name, peak, w, moment);
  if (status == HD_OK && !out_of_memory) status = hd_add_resident_memory(p, blocks, count, w);
  /* With contents come the roots a leak check scans them from. */
  if (with_contents && status == HD_OK && !out_of_memory) {
    bool cut = false;
    status = hd_add_roots(p, blocks, count, c->max_contents_bytes, &cut, w);
    if (cut) {
      hd_log(c, HD_LOG_WARN,
             "roots of %s[%u] not all read (--max-contents-bytes %llu, or bounds on mappings)",
             p->name, (unsigned)p->pid, (unsigned long long)c->max_contents_bytes);
    }
  }
  /* A block the process freed and unmapped meanwhile is skipped whole, never sent short. */
  if (with_contents && status == HD_OK && !out_of_memory) {
    bool cut = false;
    status = hd_read_block_contents(p->pid, p->pidfd, blocks, count, MAX_CONTENTS_BLOCK,
                                    c->max_contents_bytes, &cut, add_contents, w);
    if (cut) {
      hd_log(c, HD_LOG_WARN, "contents of %s[%u] cut at %llu bytes (--max-contents-bytes)", p->name,
             (unsigned)p->pid, (unsigned long long)c->max_contents_bytes);
    }
  }
  free(blocks);
  peak_parts_free(peak);
  key_set_free(&stacks);
  key_set_free(&threads);
  if (out_of_memory) return -ENOMEM;
  return status == HD_OK ? 0 : -EPIPE;
}

int hd_produce_snapshot(hd_collector *c, hd_process *p, hd_alloc_reader *snapshot_alloc,
                        const char *name, bool with_contents, hd_batch_writer *w,
                        hd_snapshot_totals *totals, hd_series_moment *moment) {
  hd_live_block *blocks = NULL;
  size_t count = 0;
  char why[160];
  peak_parts peak;
  int rc = read_live_blocks(c, p, snapshot_alloc, &blocks, &count, &peak, why, sizeof why);
  if (rc != 0) return rc;
  return produce_from_blocks(c, p, blocks, count, &peak, name, with_contents, w, totals, moment);
}

/* ---- stream threads ---- */

/* Reports error on the receiver channel, once the batches sent so far are answered (the
 * report's answer must be the only one due). */
static void report_error(hd_batch_channel *ch, heapdump_client_CollectorError error) {
  heapdump_client_SnapshotReceiverReportErrorRequest req =
      heapdump_client_SnapshotReceiverReportErrorRequest_init_zero;
  req.has_error = true;
  req.error = error;
  heapdump_client_Empty ack = heapdump_client_Empty_init_zero;
  hd_status status = hd_batch_channel_drain(ch);
  if (status == HD_OK) {
    status = hd_fidl_snapshot_receiver_report_error(ch->channel, ch->scratch, &req, NULL, 0, &ack);
  }
  (void)status; /* the client may be gone; nothing else to tell it */
}

/* A process's SnapshotHeader, alone in its batch; not_read: why the process could not be read
 * (NULL: it could). Returns 0 or -EPIPE. */
static HD_MUST_CHECK int send_header(hd_collector *c, hd_process *p, const char *not_read,
                                     hd_batch_writer *w) {
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_snapshot_header_tag;
  heapdump_client_SnapshotHeader *h = &e.element.snapshot_header;
  h->has_process_name = h->has_process_koid = true;
  snprintf(h->process_name, sizeof h->process_name, "%s", p->name);
  h->process_koid = (uint64_t)p->pid;
  pthread_mutex_lock(&c->lock);
  if (p->command_line != NULL) {
    h->has_command_line = true;
    snprintf(h->command_line, sizeof h->command_line, "%s", p->command_line);
  }
  pthread_mutex_unlock(&c->lock);
  if (not_read != NULL) {
    h->has_not_read = true;
    snprintf(h->not_read, sizeof h->not_read, "%s", not_read);
  }
  return hd_batch_add(w, &e) == HD_OK && hd_batch_flush(w) == HD_OK ? 0 : -EPIPE;
}

static void stream_live(hd_stream_job *job, hd_batch_channel *ch, hd_batch_writer *w) {
  hd_collector *c = job->c;
  hd_process **processes = malloc(HD_MAX_PROCESSES * sizeof *processes);
  if (processes == NULL) {
    report_error(ch, heapdump_client_CollectorError_LIVE_SNAPSHOT_FAILED);
    return;
  }
  hd_discover_processes(c, false);
  size_t count = 0;
  heapdump_client_CollectorError error = hd_select_processes(
      c, job->peer_uid, job->has_selector, &job->selector, job->multi_process, processes, &count);
  int rc = 0;
  if (error != heapdump_client_CollectorError_COLLECTOR_ERROR_UNSPECIFIED) {
    report_error(ch, error);
  }
  for (size_t i = 0; i < count && rc == 0; i++) {
    hd_process *p = processes[i];
    if (!job->multi_process) {
      rc = hd_produce_snapshot(c, p, NULL, "live", job->with_contents, w, NULL, NULL);
      if (rc == -EIO || rc == -ENOMEM) {
        report_error(ch, heapdump_client_CollectorError_LIVE_SNAPSHOT_FAILED);
      }
      continue;
    }
    /* Several processes: one that cannot be read is said in its header, and the others are
     * still sent. Its table is read before its header, so nothing of it is sent before. */
    hd_live_block *blocks = NULL;
    size_t block_count = 0;
    char why[160] = "";
    peak_parts peak;
    const int read = read_live_blocks(c, p, NULL, &blocks, &block_count, &peak, why, sizeof why);
    rc = send_header(c, p, read == 0 ? NULL : why, w);
    if (rc == 0 && read == 0) {
      rc = produce_from_blocks(c, p, blocks, block_count, &peak, "live", job->with_contents, w,
                               NULL, NULL);
    } else {
      free(blocks);
    }
    if (rc == -EIO || rc == -ENOMEM) {
      report_error(ch, heapdump_client_CollectorError_LIVE_SNAPSHOT_FAILED);
    } else if (rc == 0 && hd_batch_end(w) != HD_OK) {
      rc = -EPIPE;
    }
  }
  if (count > 0 && rc == 0 && hd_batch_end(w) != HD_OK) rc = -EPIPE;
  if (rc == -EPIPE) hd_log(c, HD_LOG_INFO, "client went away during a snapshot");
  for (size_t i = 0; i < count; i++) hd_process_release(processes[i]);
  free(processes);
}

static void stream_stored(hd_stream_job *job, hd_batch_channel *ch, hd_batch_writer *w) {
  int rc = hd_storage_stream(job->c, job->stored_id, job->peer_uid, w);
  if (rc == -ENOENT) {
    report_error(ch, heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND);
  } else if (rc == 0 && hd_batch_end(w) != HD_OK) {
    rc = -EPIPE;
  }
  if (rc != 0 && rc != -ENOENT) {
    hd_log(job->c, HD_LOG_WARN, "download of %u ended early", job->stored_id);
  }
}

static void unlink_stream(hd_collector *c, hd_stream_job *job) {
  if (job->prev != NULL) {
    job->prev->next = job->next;
  } else {
    c->streams = job->next;
  }
  if (job->next != NULL) job->next->prev = job->prev;
}

/* Ends a job that ran or never will: under c->lock. */
static void retire_locked(hd_collector *c, hd_stream_job *job) {
  unlink_stream(c, job);
  close(job->receiver); /* under the lock: a stop never shuts down a reused descriptor */
  c->active_streams--;
  free(job);
}

/* Whether the client hung up its receiver (it exited, or gave up): nobody would read the stream. */
static bool client_gone(int receiver) {
  struct pollfd p = {.fd = receiver, .events = 0};
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0;
}

/* Running streams per client, for a scheduling decision: only clients with a stream running (or
 * just taken), so at most one entry per stream thread. */
typedef struct client_load {
  pid_t client[HD_MAX_STREAM_THREADS];
  int running[HD_MAX_STREAM_THREADS];
  size_t count;
} client_load;

static int running_of(const client_load *l, pid_t client) {
  for (size_t i = 0; i < l->count; i++) {
    if (l->client[i] == client) return l->running[i];
  }
  return 0;
}

/* One more stream of client: room is certain, as each entry stands for a thread's stream. */
static void count_running(client_load *l, pid_t client) {
  for (size_t i = 0; i < l->count; i++) {
    if (l->client[i] == client) {
      l->running[i]++;
      return;
    }
  }
  HD_DCHECK(l->count < HD_MAX_STREAM_THREADS);
  if (l->count == HD_MAX_STREAM_THREADS) return;
  l->client[l->count] = client;
  l->running[l->count++] = 1;
}

/* Takes up to `max` queued jobs that may run now into out (marked running), one at a time: of
 * the clients below their share of the threads, the one running the fewest streams, and its
 * oldest request; so a client with nothing running goes before another's backlog. Drops on the
 * way the jobs whose client has gone, and every queued job of a stopping collector. Under
 * c->lock. */
static size_t take_runnable_locked(hd_collector *c, hd_stream_job **out, size_t max) {
  unsigned dropped = 0;
  if (atomic_load(&c->stop_requested)) {
    while (c->stream_queue != NULL) {
      hd_stream_job *job = c->stream_queue;
      c->stream_queue = job->queue_next;
      c->queued_streams--;
      retire_locked(c, job);
    }
    return 0;
  }
  client_load load = {.count = 0};
  for (const hd_stream_job *j = c->streams; j != NULL; j = j->next) {
    if (j->running) count_running(&load, j->peer_pid);
  }
  size_t taken = 0;
  while (taken < max) {
    hd_stream_job **best = NULL;
    int fewest = HD_STREAMS_PER_CLIENT;
    for (hd_stream_job **at = &c->stream_queue; *at != NULL && fewest > 0;
         at = &(*at)->queue_next) {
      const int n = running_of(&load, (*at)->peer_pid);
      if (n < fewest) {
        fewest = n;
        best = at;
      }
    }
    if (best == NULL) break; /* every waiting client runs its share */
    hd_stream_job *job = *best;
    *best = job->queue_next;
    c->queued_streams--;
    if (client_gone(job->receiver)) {
      dropped++;
      retire_locked(c, job);
      continue;
    }
    count_running(&load, job->peer_pid);
    job->running = true;
    out[taken++] = job;
  }
  if (dropped > 0) {
    hd_log(c, HD_LOG_INFO, "dropped %u queued snapshot request(s) whose client had gone", dropped);
  }
  return taken;
}

/* Takes job out of the queue. Under c->lock. */
static void unqueue_locked(hd_collector *c, hd_stream_job *job) {
  for (hd_stream_job **at = &c->stream_queue; *at != NULL; at = &(*at)->queue_next) {
    if (*at == job) {
      *at = job->queue_next;
      c->queued_streams--;
      return;
    }
  }
}

/* The newest queued job of the client with the most queued jobs, if that client has at least two
 * more than `client` has (so that queueing client's request leaves the other with as many or
 * more: two clients never take turns evicting each other); else NULL. Under c->lock. */
static hd_stream_job *newest_of_greediest_locked(hd_collector *c, pid_t client) {
  /* Queued jobs per client, in a table twice the queue's bound. */
  enum { SLOTS = 2 * HD_MAX_QUEUED_STREAMS };
  static_assert((SLOTS & (SLOTS - 1)) == 0, "a power of two");
  struct {
    pid_t pid;
    int count;
    hd_stream_job *newest;
  } *slots = calloc(SLOTS, sizeof *slots);
  if (slots == NULL) return NULL;
  int mine = 0, most = 0;
  hd_stream_job *greediest = NULL;
  for (hd_stream_job *j = c->stream_queue; j != NULL; j = j->queue_next) {
    size_t i = ((uint32_t)j->peer_pid * 2654435761u) & (SLOTS - 1);
    while (slots[i].count != 0 && slots[i].pid != j->peer_pid) i = (i + 1) & (SLOTS - 1);
    slots[i].pid = j->peer_pid;
    slots[i].newest = j;
    const int count = ++slots[i].count;
    if (j->peer_pid == client) mine = count;
    if (count > most) {
      most = count;
      greediest = j;
    }
  }
  hd_stream_job *evict = NULL;
  if (greediest != NULL && most > mine + 1) {
    size_t i = ((uint32_t)greediest->peer_pid * 2654435761u) & (SLOTS - 1);
    while (slots[i].pid != greediest->peer_pid) i = (i + 1) & (SLOTS - 1);
    evict = slots[i].newest;
  }
  free(slots);
  return evict;
}

static void *run_streams(void *arg);

/* Starts a stream thread for each of jobs (taken and counted in c->stream_threads); a job whose
 * thread cannot start is retired. */
static void start_threads(hd_collector *c, hd_stream_job **jobs, size_t count) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  for (size_t i = 0; i < count; i++) {
    pthread_t thread;
    if (hd_start_thread(&thread, &attr, run_streams, jobs[i]) != 0) {
      hd_log(c, HD_LOG_WARN, "cannot start a stream thread; dropping a request");
      pthread_mutex_lock(&c->lock);
      c->stream_threads--;
      retire_locked(c, jobs[i]);
      if (c->active_streams == 0) pthread_cond_broadcast(&c->streams_done);
      pthread_mutex_unlock(&c->lock);
    }
  }
  pthread_attr_destroy(&attr);
}

static void run_one(hd_stream_job *job) {
  if (client_gone(job->receiver)) return; /* its request came, its client went */
  struct timeval timeout = {ACK_TIMEOUT_SECONDS, 0};
  setsockopt(job->receiver, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(job->receiver, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  hd_message *scratch = malloc(sizeof *scratch);
  hd_batch_writer *w = malloc(sizeof *w);
  hd_batch_channel channel;
  hd_batch_channel_init(&channel, job->receiver, scratch);
  /* Without a message to report with, closing the channel tells the client. */
  if (scratch != NULL && w == NULL) {
    report_error(&channel, heapdump_client_CollectorError_LIVE_SNAPSHOT_FAILED);
  } else if (scratch != NULL) {
    hd_batch_writer_init(w, hd_batch_send_on_channel, &channel);
    if (job->stored) {
      stream_stored(job, &channel, w);
      atomic_fetch_add(&job->c->stored_streams_served, 1);
    } else {
      stream_live(job, &channel, w);
      atomic_fetch_add(&job->c->live_streams_served, 1);
    }
  }
  free(scratch);
  free(w);
}

/* A stream thread: runs its job, then the next one that may run, while there is one; a job it
 * finished may let a client's waiting request run on another thread. After its last unlock it
 * touches nothing of the collector, which a stop may be destroying by then. */
static void *run_streams(void *arg) {
  hd_stream_job *job = arg;
  hd_collector *c = job->c;
  while (job != NULL) {
    run_one(job);
    hd_stream_job *more[HD_MAX_STREAM_THREADS];
    pthread_mutex_lock(&c->lock);
    retire_locked(c, job);
    if (take_runnable_locked(c, &job, 1) == 0) {
      job = NULL;
      c->stream_threads--;
    }
    const size_t extra = take_runnable_locked(c, more, HD_MAX_STREAM_THREADS - c->stream_threads);
    c->stream_threads += extra;
    if (c->active_streams == 0) pthread_cond_broadcast(&c->streams_done);
    pthread_mutex_unlock(&c->lock);
    if (extra > 0) start_threads(c, more, extra);
  }
  return NULL;
}

void hd_start_stream(hd_stream_job *job) {
  hd_collector *c = job->c;
  const pid_t client = job->peer_pid;
  hd_stream_job *start[HD_MAX_STREAM_THREADS];
  size_t starting = 0;
  pthread_mutex_lock(&c->lock);
  c->active_streams++;
  job->prev = NULL;
  job->next = c->streams;
  if (c->streams != NULL) c->streams->prev = job;
  c->streams = job;
  /* Closing the receiver is what tells a refused client: an error report would wait for its
   * answer on the poll thread. A full queue makes room by refusing the newest request of the
   * client that queued the most, unless that is this client. */
  const char *refused = NULL;
  if (c->queued_streams >= HD_MAX_QUEUED_STREAMS) {
    hd_stream_job *evict = newest_of_greediest_locked(c, client);
    if (evict == NULL) {
      refused = "too many snapshot requests at once";
    } else {
      unqueue_locked(c, evict);
      hd_log(c, HD_LOG_WARN, "too many snapshot requests at once; dropping one of pid %u's",
             (unsigned)evict->peer_pid);
      retire_locked(c, evict);
    }
  }
  if (refused != NULL) {
    retire_locked(c, job);
  } else {
    job->running = false;
    job->queue_next = NULL;
    hd_stream_job **tail = &c->stream_queue;
    while (*tail != NULL) tail = &(*tail)->queue_next;
    *tail = job;
    c->queued_streams++;
    starting = take_runnable_locked(c, start, HD_MAX_STREAM_THREADS - c->stream_threads);
    c->stream_threads += starting;
  }
  pthread_mutex_unlock(&c->lock);
  if (refused != NULL) {
    hd_log(c, HD_LOG_WARN, "%s (pid %u); dropping a request", refused, (unsigned)client);
  }
  start_threads(c, start, starting);
}

void hd_wait_streams(hd_collector *c) {
  struct timespec grace;
  clock_gettime(CLOCK_REALTIME, &grace);
  grace.tv_sec += STOP_GRACE_SECONDS;
  pthread_mutex_lock(&c->lock);
  while (c->active_streams > 0) {
    if (pthread_cond_timedwait(&c->streams_done, &c->lock, &grace) == ETIMEDOUT) break;
  }
  if (c->active_streams > 0) {
    hd_log(c, HD_LOG_INFO, "stopping: cutting off %d client stream(s)", c->active_streams);
    for (hd_stream_job *job = c->streams; job != NULL; job = job->next) {
      shutdown(job->receiver, SHUT_RDWR);
    }
  }
  while (c->active_streams > 0) pthread_cond_wait(&c->streams_done, &c->lock);
  pthread_mutex_unlock(&c->lock);
}
