/* Internals shared by the collector's files: the collector, registered processes, stream jobs
 * and the stored-snapshot catalogue. */
#ifndef HEAPDUMP_COLLECTOR_INTERNAL_H
#define HEAPDUMP_COLLECTOR_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "heapdump/collector.h"
#include "heapdump/fidl/batch.h"
#include "heapdump/internal/shm_layout.h"
#include "heapdump_client.pb.h"
#include "table_reader.h"

#define HD_MAX_PROCESSES 1024

typedef struct hd_process {
  atomic_int refs;
  pid_t pid;
  uid_t uid;
  char name[33];
  bool exit_snapshot;
  bool live;          /* in the live set (protected by hd_collector.lock) */
  int open_channels;  /* registry connection + sink (protected by hd_collector.lock) */
  hd_alloc_reader *alloc;
  hd_res_reader *res;
  pthread_mutex_t read_lock; /* readers are single-threaded: one snapshot at a time */
} hd_process;

typedef struct hd_stored_snapshot_info {
  uint32_t id;
  char name[33];
  char process_name[33];
  uint64_t pid;
  uid_t uid;
  uint64_t bytes;
} hd_stored_snapshot_info;

typedef struct hd_stored_list {
  hd_stored_snapshot_info *items;
  size_t count, next;
  bool ended;
} hd_stored_list;

struct conn_table;

struct hd_collector {
  char socket_path[108];
  char storage_dir[4096];
  int listen_fd;
  int wake[2];
  int log_level;
  uint32_t max_stored;
  uint64_t max_storage_bytes;
  pthread_mutex_t lock;
  hd_process *processes[HD_MAX_PROCESSES];
  size_t process_count;
  hd_stored_snapshot_info *stored; /* oldest first */
  size_t stored_count, stored_capacity;
  uint32_t next_id;
  int active_streams;
  pthread_cond_t streams_done;
  struct conn_table *conns;
  hd_message *scratch;
};

typedef struct hd_stream_job {
  hd_collector *c;
  int receiver;
  bool with_contents, multi_process;
  heapdump_client_CollectorError error; /* set: report it instead of streaming */
  hd_process *processes[HD_MAX_PROCESSES];
  size_t process_count;
  bool stored;
  uint32_t stored_id;
  uid_t peer_uid;
} hd_stream_job;

void hd_log(hd_collector *c, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void hd_process_release(hd_process *p);

/* Streams (stream.c). Takes ownership of job; runs it on a thread of its own. */
void hd_start_stream(hd_stream_job *job);
void hd_wait_streams(hd_collector *c);
/* Writes the elements of one process's snapshot: the live table when snapshot_alloc is NULL, else
 * a frozen copy. Returns 0, or -EIO if the tables are corrupt or unreadable. */
int hd_produce_snapshot(hd_collector *c, hd_process *p, hd_alloc_reader *snapshot_alloc,
                        bool with_contents, hd_batch_writer *w);

/* Storage (storage.c). */
int hd_storage_open(hd_collector *c, const char *dir);
void hd_storage_close(hd_collector *c);
int hd_store_named_snapshot(hd_collector *c, hd_process *p, const char *name, int memfd,
                            uint32_t *id);
void hd_store_exit_snapshot(hd_collector *c, hd_process *p);
int hd_storage_list(hd_collector *c, uid_t uid, const heapdump_client_ProcessSelector *selector,
                    hd_stored_list *out);
hd_status hd_storage_send_page(int fd, hd_message *msg, hd_stored_list *listing);
/* Streams stored snapshot id to w (without the final empty batch). -ENOENT if unknown or not
 * visible to uid. */
int hd_storage_stream(hd_collector *c, uint32_t id, uid_t uid, hd_batch_writer *w);

#endif
