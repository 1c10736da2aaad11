/* The live set: one entry per instrumented process, found by pid and identified by its
 * allocations table; its exit, exec and pid reuse; the record of recent exits. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "collector_internal.h"
#include "contents.h"
#include "heapdump/contract/dcheck.h"

hd_process *hd_process_new(pid_t pid, pid_t own_pid, uid_t uid, const char *name,
                           bool exit_snapshot, dev_t table_dev, ino_t table_ino, int pidfd,
                           hd_alloc_reader *alloc, hd_res_reader *res) {
  hd_process *p = calloc(1, sizeof *p);
  if (p == NULL) return NULL;
  atomic_init(&p->refs, 1);
  p->pid = pid;
  p->own_pid = own_pid;
  p->uid = uid;
  p->table_dev = table_dev;
  p->table_ino = table_ino;
  p->pidfd = pidfd;
  p->alloc = alloc;
  p->res = res;
  snprintf(p->name, sizeof p->name, "%s", name);
  p->exit_snapshot = exit_snapshot;
  hd_series_init(&p->series);
  return p;
}

hd_process *hd_process_retain(hd_process *p) {
  const int before = atomic_fetch_add(&p->refs, 1);
  HD_DCHECK(before > 0); /* only a holder of a reference hands out another */
  return p;
}

void hd_process_release(hd_process *p) {
  if (p == NULL) return;
  const int before = atomic_fetch_sub(&p->refs, 1);
  HD_DCHECK(before > 0);
  if (before != 1) return;
  hd_alloc_reader_close(p->alloc);
  hd_res_reader_close(p->res);
  close(p->pidfd);
  hd_series_destroy(&p->series);
  free(p->command_line);
  free(p);
}

bool hd_process_alive(const hd_process *p) { return hd_pidfd_alive(p->pidfd); }

static hd_process *find_locked(hd_collector *c, pid_t pid) {
  for (size_t i = 0; i < c->process_count; i++) {
    if (c->processes[i]->pid == pid) return c->processes[i];
  }
  return NULL;
}

static bool same_process(const hd_process *a, const hd_process *b) {
  return a->table_dev == b->table_dev && a->table_ino == b->table_ino;
}

bool hd_process_known(hd_collector *c, pid_t pid, dev_t table_dev, ino_t table_ino) {
  pthread_mutex_lock(&c->lock);
  const hd_process *p = find_locked(c, pid);
  bool known = p != NULL && p->table_dev == table_dev && p->table_ino == table_ino;
  pthread_mutex_unlock(&c->lock);
  return known;
}

hd_process *hd_process_find(hd_collector *c, pid_t pid, dev_t table_dev, ino_t table_ino,
                            uid_t uid) {
  pthread_mutex_lock(&c->lock);
  hd_process *p = find_locked(c, pid);
  if (p != NULL && (p->table_dev != table_dev || p->table_ino != table_ino ||
                    (uid != 0 && p->uid != uid) || !hd_process_alive(p))) {
    p = NULL;
  }
  if (p != NULL) hd_process_retain(p);
  pthread_mutex_unlock(&c->lock);
  return p;
}

/* Takes p out of the live set; false if it was not in it. */
static bool remove_locked(hd_collector *c, hd_process *p) {
  if (!p->live) return false;
  p->live = false;
  for (size_t i = 0; i < c->process_count; i++) {
    if (c->processes[i] == p) {
      c->processes[i] = c->processes[--c->process_count];
      break;
    }
  }
  return true;
}

/* Remembers that p left the live set. Called with c->lock held. */
static void record_exit_locked(hd_collector *c, hd_process *p, bool exit_snapshot) {
  uint64_t seq = ++c->exit_seq;
  hd_exit_record *r = &c->exit_records[seq % HD_EXIT_RECORDS];
  *r = (hd_exit_record){
      .seq = seq,
      .pid = p->pid,
      .uid = p->uid,
      .state = exit_snapshot ? heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_PENDING
                             : heapdump_client_ProcessState_PROCESS_STATE_EXITED_WITHOUT_SNAPSHOT,
  };
  if (p->exit_stored_id != 0) { /* it stored its own, from its exit path */
    r->state = heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_STORED;
    r->snapshot_id = p->exit_stored_id;
  }
  snprintf(r->name, sizeof r->name, "%s", p->name);
  p->exit_record = seq;
}

void hd_exit_record_finish(hd_collector *c, const hd_process *p, bool ok, uint32_t snapshot_id) {
  pthread_mutex_lock(&c->lock);
  hd_exit_record *r = &c->exit_records[p->exit_record % HD_EXIT_RECORDS];
  if (p->exit_record != 0 && r->seq == p->exit_record) {
    r->state = ok ? heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_STORED
                  : heapdump_client_ProcessState_PROCESS_STATE_EXITED_WITHOUT_SNAPSHOT;
    r->snapshot_id = snapshot_id;
  }
  pthread_mutex_unlock(&c->lock);
}

heapdump_client_CollectorGetProcessStateResponse hd_process_state(hd_collector *c, pid_t pid,
                                                                  uid_t uid) {
  heapdump_client_CollectorGetProcessStateResponse out = {
      .has_state = true,
      .state = heapdump_client_ProcessState_PROCESS_STATE_UNKNOWN,
  };
  pthread_mutex_lock(&c->lock);
  const hd_process *p = find_locked(c, pid);
  if (p != NULL && (uid == 0 || p->uid == uid)) {
    /* Exited, and the poll thread has not handled it yet: what it will do is known. */
    out.state =
        hd_process_alive(p)      ? heapdump_client_ProcessState_PROCESS_STATE_RUNNING
        : p->exit_stored_id != 0 ? heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_STORED
        : p->exit_snapshot       ? heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_PENDING
                           : heapdump_client_ProcessState_PROCESS_STATE_EXITED_WITHOUT_SNAPSHOT;
    if (out.state == heapdump_client_ProcessState_PROCESS_STATE_RUNNING) {
      out.has_recording = true;
      out.recording = hd_recording_state(hd_res_reader_arm_state(p->res));
      out.has_sample_bytes = true;
      out.sample_bytes = hd_res_reader_sample_bytes(p->res);
      out.has_arm_generation = true;
      out.arm_generation = hd_res_reader_arm_generation(p->res);
    }
    if (out.state == heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_STORED) {
      out.has_exit_snapshot_id = true;
      out.exit_snapshot_id = p->exit_stored_id;
    }
    out.has_process_name = true;
    snprintf(out.process_name, sizeof out.process_name, "%s", p->name);
  } else {
    const hd_exit_record *latest = NULL;
    for (size_t i = 0; i < HD_EXIT_RECORDS; i++) {
      const hd_exit_record *r = &c->exit_records[i];
      if (r->seq != 0 && r->pid == pid && (uid == 0 || r->uid == uid) &&
          (latest == NULL || r->seq > latest->seq)) {
        latest = r;
      }
    }
    if (latest != NULL) {
      out.state = latest->state;
      out.has_exit_snapshot_id =
          latest->state == heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_STORED;
      out.exit_snapshot_id = latest->snapshot_id;
      out.has_process_name = true;
      snprintf(out.process_name, sizeof out.process_name, "%s", latest->name);
    }
  }
  /* An earlier image of the pid (it exec'd) whose snapshot is still being stored keeps the pid
   * pending: a client waiting for the pid's snapshots must not stop at the last image's exit
   * snapshot, which that image stores itself and may store first. */
  if (out.state != heapdump_client_ProcessState_PROCESS_STATE_UNKNOWN &&
      out.state != heapdump_client_ProcessState_PROCESS_STATE_RUNNING) {
    for (size_t i = 0; i < HD_EXIT_RECORDS; i++) {
      const hd_exit_record *r = &c->exit_records[i];
      if (r->seq != 0 && r->pid == pid && (uid == 0 || r->uid == uid) &&
          r->state == heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_PENDING) {
        out.state = heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_PENDING;
        out.has_exit_snapshot_id = false;
        out.exit_snapshot_id = 0;
      }
    }
  }
  pthread_mutex_unlock(&c->lock);
  hd_arming_failure_of(c, pid, uid, &out);
  return out;
}

/* After p left the live set: its last snapshot ("exit", or "exec" when the process lives on
 * as another image), and the live set's reference. */
static void finish_exit(hd_collector *c, hd_process *p, bool exit_snapshot, bool exec) {
  hd_log(c, HD_LOG_INFO, "process %s[%u] %s", p->name, (unsigned)p->pid,
         exec ? "exec'd another program" : "exited");
  if (exit_snapshot)
    hd_queue_exit_snapshot(c, p, exec ? HD_EXEC_SNAPSHOT_NAME : HD_EXIT_SNAPSHOT_NAME);
  hd_process_release(p);
}

void hd_process_exited(hd_collector *c, hd_process *p) {
  pthread_mutex_lock(&c->lock);
  bool removed = remove_locked(c, p);
  bool exit_snapshot = p->exit_snapshot && p->exit_stored_id == 0;
  if (removed) record_exit_locked(c, p, exit_snapshot);
  if (removed && exit_snapshot) hd_worker_reserve_exit(c);
  pthread_mutex_unlock(&c->lock);
  if (removed) finish_exit(c, p, exit_snapshot, false);
}

hd_process *hd_live_set_add(hd_collector *c, hd_process *p, bool registration, bool *absorbed) {
  hd_process *entry = NULL, *stale = NULL;
  bool stale_exit_snapshot = false, exec = false;
  *absorbed = false;
  /* The series starts when the collector first sees the process, not at the next tick. Read
   * before the lock (p is not shared yet): the read walks the process's memory. */
  hd_table_stats st;
  if (c->sample_interval_ns != 0 && hd_res_reader_stats(p->res, &st) == HD_READ_OK) {
    hd_series_add(&p->series, &st, (int64_t)hd_monotonic_ns());
  }
  pthread_mutex_lock(&c->lock);
  hd_process *existing = find_locked(c, p->pid);
  if (existing != NULL && same_process(existing, p)) {
    if (registration) existing->exit_snapshot = p->exit_snapshot;
    if (registration && existing->command_line == NULL) {
      existing->command_line = p->command_line;
      p->command_line = NULL;
    }
    entry = hd_process_retain(existing);
    *absorbed = true;
  } else {
    if (existing != NULL) {
      /* Its pid registers new tables: the process is still alive, so it exec'd another program,
       * or it exited and its pid names another process now. */
      exec = hd_process_alive(existing);
      remove_locked(c, existing);
      stale = existing;
      stale_exit_snapshot = existing->exit_snapshot;
      record_exit_locked(c, existing, stale_exit_snapshot);
      if (stale_exit_snapshot) hd_worker_reserve_exit(c);
    }
    if (c->process_count < HD_MAX_PROCESSES) {
      p->live = true;
      c->processes[c->process_count++] = p;
      entry = hd_process_retain(p);
      p = NULL;
    }
  }
  pthread_mutex_unlock(&c->lock);
  if (stale != NULL) finish_exit(c, stale, stale_exit_snapshot, exec);
  hd_process_release(p);
  return entry;
}

heapdump_client_CollectorError hd_select_processes(hd_collector *c, uid_t uid, bool has_selector,
                                                   const heapdump_client_ProcessSelector *sel,
                                                   bool multi, hd_process **out, size_t *count) {
  *count = 0;
  if (has_selector && sel->which_selector != heapdump_client_ProcessSelector_by_name_tag &&
      sel->which_selector != heapdump_client_ProcessSelector_by_koid_tag) {
    return heapdump_client_CollectorError_PROCESS_SELECTOR_UNSUPPORTED;
  }
  pthread_mutex_lock(&c->lock);
  for (size_t i = 0; i < c->process_count; i++) {
    hd_process *p = c->processes[i];
    if (uid != 0 && p->uid != uid) continue;
    if (has_selector && sel->which_selector == heapdump_client_ProcessSelector_by_name_tag &&
        strcmp(p->name, sel->selector.by_name) != 0) {
      continue;
    }
    if (has_selector && sel->which_selector == heapdump_client_ProcessSelector_by_koid_tag &&
        (uint64_t)p->pid != sel->selector.by_koid) {
      continue;
    }
    /* Exited, and the poll thread has not seen it yet: its pid may already name another. */
    if (!hd_process_alive(p)) continue;
    out[(*count)++] = hd_process_retain(p);
  }
  pthread_mutex_unlock(&c->lock);
  if (*count == 0) return heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH;
  if (*count > 1 && !multi) {
    for (size_t i = 0; i < *count; i++) hd_process_release(out[i]);
    *count = 0;
    return heapdump_client_CollectorError_PROCESS_SELECTOR_AMBIGUOUS;
  }
  return heapdump_client_CollectorError_COLLECTOR_ERROR_UNSPECIFIED;
}

bool hd_read_process_name(pid_t pid, char *out, size_t size) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/comm", (int)pid);
  FILE *f = fopen(path, "re");
  if (f == NULL) return false;
  bool ok = fgets(out, (int)size, f) != NULL;
  fclose(f);
  if (ok) out[strcspn(out, "\n")] = '\0';
  return ok;
}
