/* The storage workers: threads that write named and exit snapshots to disk and rescan /proc when
 * a listing asks for it, so that none of this slow work (reading a big table, fsync) runs on the
 * poll thread and delays other clients. Named snapshots have a thread of their own: their
 * process waits for the answer (up to HEAPDUMP_SNAPSHOT_TIMEOUT), which must not wait behind a
 * big exit snapshot, and a process has one store queued at a time, so that none can queue its
 * stores ahead of everyone else's. Stopping finishes every queued job, so that a SIGTERM loses
 * no exit snapshot. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "collector_internal.h"
#include "heapdump/contract/dcheck.h"
#include "heapdump_process.bindings.h"

/* Sync: the thread that queues a job fills it in before enqueue() publishes it under the
 * worker's lock; from then on it is the worker thread's that pops it, save next, which the lock
 * guards while the job is queued. */
typedef struct job {
  struct job *next;
  hd_process *process;
  char name[HD_NAME_SIZE];
  int memfd;               /* named snapshots: the frozen allocations copy */
  bool exit_with_contents; /* named snapshots: the process's own exit snapshot */
  int reply_fd;            /* named snapshots: where to answer; -1: a trigger's, unanswered */
  uint32_t txid;
} job;

typedef struct job_queue {
  job *head, *tail;
} job_queue;

/* Sync: each field says what guards it. The worker is made by hd_worker_start before its threads
 * start and freed by hd_worker_stop after they are joined. Lock order: hd_collector.lock before
 * lock (hd_worker_reserve_exit is called under both, so that a census never misses an exit). */
typedef struct hd_worker {
  pthread_t named_thread, exit_thread; /* Sync: the thread that starts and stops the worker */
  pthread_mutex_t lock;                /* guards the fields below and hd_process.*_store_pending */
  pthread_cond_t wake;                 /* both threads wait on it, with lock */
  job_queue named, at_exit;            /* Sync: lock */
  bool discovery_queued;               /* Sync: lock */
  unsigned exits_pending;              /* exit snapshots queued or being stored. Sync: lock */
  bool stopping;                       /* Sync: lock */
  hd_message *scratch; /* Sync: the named-store thread only (made before it starts) */
} hd_worker;

static void push(job_queue *q, job *j) {
  j->next = NULL;
  if (q->tail != NULL) {
    q->tail->next = j;
  } else {
    q->head = j;
  }
  q->tail = j;
}

static job *pop(job_queue *q) {
  job *j = q->head;
  if (j != NULL) {
    q->head = j->next;
    if (q->head == NULL) q->tail = NULL;
  }
  return j;
}

static void store_named(hd_collector *c, hd_message *scratch, job *j) {
  uint32_t id = 0;
  int rc = hd_store_snapshot(c, j->process, j->name, j->memfd, j->exit_with_contents, &id);
  if (rc == 0 && j->exit_with_contents) {
    pthread_mutex_lock(&c->lock);
    j->process->exit_stored_id = id;
    pthread_mutex_unlock(&c->lock);
    hd_log(c, HD_LOG_INFO, "stored snapshot %u \"%s\" of %s[%u] from its exit path, with contents",
           (unsigned)id, j->name, j->process->name, (unsigned)j->process->pid);
  }
  /* Before the answer: the process may send its next request the moment it has it. */
  pthread_mutex_lock(&c->worker->lock);
  if (j->reply_fd < 0)
    j->process->trigger_store_pending = false;
  else
    j->process->named_store_pending = false;
  pthread_mutex_unlock(&c->worker->lock);
  if (j->reply_fd < 0) return; /* the collector's own (a trigger): nobody waits for an answer */
  heapdump_process_SnapshotSinkStoreNamedSnapshotResponse resp =
      heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_init_zero;
  if (rc == 0) {
    resp.has_snapshot_id = true;
    resp.snapshot_id = id;
  } else {
    resp.has_error = true;
    resp.error = rc == -EINVAL ? heapdump_process_StoreError_INVALID_SNAPSHOT
                               : heapdump_process_StoreError_STORAGE_FAILED;
  }
  if (hd_fidl_snapshot_sink_store_named_snapshot_reply(j->reply_fd, scratch, j->txid, &resp) !=
      HD_OK) {
    hd_log(c, HD_LOG_INFO, "%s[%u] did not wait for the answer to its snapshot \"%s\"",
           j->process->name, (unsigned)j->process->pid, j->name);
  }
}

/* Waits for a job of the queue this thread serves; false once stopping with nothing left. */
static bool next_job(hd_worker *w, bool named_thread, job **out, bool *discover) {
  pthread_mutex_lock(&w->lock);
  for (;;) {
    *out = pop(named_thread ? &w->named : &w->at_exit);
    /* A rescan is pointless once stopping: nothing would serve what it finds. */
    *discover = *out == NULL && !named_thread && w->discovery_queued && !w->stopping;
    if (*discover) w->discovery_queued = false;
    if (*out != NULL || *discover || w->stopping) break;
    pthread_cond_wait(&w->wake, &w->lock);
  }
  pthread_mutex_unlock(&w->lock);
  return *out != NULL || *discover;
}

static void *run_named(void *arg) {
  hd_collector *c = arg;
  hd_worker *w = c->worker;
  job *j;
  bool discover;
  while (next_job(w, true, &j, &discover)) {
    store_named(c, w->scratch, j);
    close(j->memfd);
    close(j->reply_fd);
    hd_process_release(j->process);
    free(j);
  }
  return NULL;
}

static void *run_exits(void *arg) {
  hd_collector *c = arg;
  hd_worker *w = c->worker;
  job *j;
  bool discover;
  while (next_job(w, false, &j, &discover)) {
    if (discover) {
      hd_discover_processes(c, false);
      continue;
    }
    uint32_t id = 0;
    bool stored = hd_store_snapshot(c, j->process, j->name, -1, false, &id) == 0;
    if (!stored) {
      hd_log(c, HD_LOG_WARN, "no %s snapshot for %s[%u]", j->name, j->process->name,
             (unsigned)j->process->pid);
    }
    hd_exit_record_finish(c, j->process, stored, id);
    hd_process_release(j->process);
    free(j);
    pthread_mutex_lock(&w->lock);
    HD_DCHECK(w->exits_pending > 0); /* reserved by hd_worker_reserve_exit */
    w->exits_pending--;
    pthread_mutex_unlock(&w->lock);
  }
  return NULL;
}

static void signal_stop(hd_worker *w) {
  pthread_mutex_lock(&w->lock);
  w->stopping = true;
  pthread_cond_broadcast(&w->wake);
  pthread_mutex_unlock(&w->lock);
}

static void destroy(hd_worker *w) {
  pthread_mutex_destroy(&w->lock);
  pthread_cond_destroy(&w->wake);
  free(w->scratch);
  free(w);
}

int hd_worker_start(hd_collector *c) {
  hd_worker *w = calloc(1, sizeof *w);
  if (w == NULL) return -ENOMEM;
  w->scratch = malloc(sizeof *w->scratch);
  if (w->scratch == NULL) {
    free(w);
    return -ENOMEM;
  }
  pthread_mutex_init(&w->lock, NULL);
  pthread_cond_init(&w->wake, NULL);
  c->worker = w;
  int rc = hd_start_thread(&w->named_thread, NULL, run_named, c);
  if (rc == 0) {
    rc = hd_start_thread(&w->exit_thread, NULL, run_exits, c);
    if (rc != 0) {
      signal_stop(w);
      pthread_join(w->named_thread, NULL);
    }
  }
  if (rc != 0) {
    c->worker = NULL;
    destroy(w);
    return -rc;
  }
  return 0;
}

void hd_worker_stop(hd_collector *c) {
  hd_worker *w = c->worker;
  if (w == NULL) return;
  signal_stop(w);
  pthread_join(w->named_thread, NULL);
  pthread_join(w->exit_thread, NULL);
  c->worker = NULL;
  destroy(w);
}

static void enqueue(hd_worker *w, job_queue *q, job *j) {
  pthread_mutex_lock(&w->lock);
  push(q, j);
  pthread_cond_broadcast(&w->wake); /* the two threads wait on one condition */
  pthread_mutex_unlock(&w->lock);
}

void hd_queue_exit_snapshot(hd_collector *c, hd_process *p, const char *name) {
  job *j = calloc(1, sizeof *j);
  if (j == NULL) {
    hd_log(c, HD_LOG_ERROR, "out of memory: no %s snapshot for %s[%u]", name, p->name,
           (unsigned)p->pid);
    hd_exit_record_finish(c, p, false, 0);
    pthread_mutex_lock(&c->worker->lock);
    HD_DCHECK(c->worker->exits_pending > 0);
    c->worker->exits_pending--;
    pthread_mutex_unlock(&c->worker->lock);
    return;
  }
  j->process = hd_process_retain(p);
  j->memfd = j->reply_fd = -1;
  snprintf(j->name, sizeof j->name, "%s", name);
  enqueue(c->worker, &c->worker->at_exit, j);
}

void hd_worker_reserve_exit(hd_collector *c) {
  pthread_mutex_lock(&c->worker->lock);
  c->worker->exits_pending++;
  pthread_mutex_unlock(&c->worker->lock);
}

unsigned hd_worker_exits_pending(hd_collector *c) {
  pthread_mutex_lock(&c->worker->lock);
  unsigned n = c->worker->exits_pending;
  pthread_mutex_unlock(&c->worker->lock);
  return n;
}

/* Queues a store of p unless one of its kind (*pending, under the worker's lock) is queued or
 * running: -EBUSY then, -ENOMEM if it could not be queued. */
static int queue_store(hd_collector *c, hd_process *p, bool *pending, const char *name, int memfd,
                       bool exit_with_contents, int reply_fd, uint32_t txid) {
  hd_worker *w = c->worker;
  job *j = calloc(1, sizeof *j);
  if (j == NULL) return -ENOMEM;
  pthread_mutex_lock(&w->lock);
  const bool busy = *pending;
  *pending = true;
  pthread_mutex_unlock(&w->lock);
  if (busy) {
    free(j);
    return -EBUSY;
  }
  j->process = hd_process_retain(p);
  snprintf(j->name, sizeof j->name, "%s", name);
  j->memfd = memfd;
  j->exit_with_contents = exit_with_contents;
  j->reply_fd = reply_fd;
  j->txid = txid;
  enqueue(w, &w->named, j);
  return 0;
}

int hd_queue_named_snapshot(hd_collector *c, hd_process *p, const char *name, int memfd,
                            bool exit_with_contents, int reply_fd, uint32_t txid) {
  return queue_store(c, p, &p->named_store_pending, name, memfd, exit_with_contents, reply_fd,
                     txid);
}

int hd_queue_trigger_snapshot(hd_collector *c, hd_process *p) {
  /* Its own flag: a trigger never makes the process's own named or exit snapshot busy. */
  return queue_store(c, p, &p->trigger_store_pending, HD_TRIGGER_SNAPSHOT_NAME, -1, false, -1, 0);
}

void hd_queue_discovery(hd_collector *c) {
  hd_worker *w = c->worker;
  pthread_mutex_lock(&w->lock);
  w->discovery_queued = true;
  pthread_cond_broadcast(&w->wake);
  pthread_mutex_unlock(&w->lock);
}
