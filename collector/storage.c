/* Stored snapshots: one file per snapshot under the storage directory, written atomically
 * (temporary file, fsync, rename, fsync of the directory), listed and streamed back on request.
 *
 * The file layout is in stored_file.h, which reads the files back. Snapshot ids come from the
 * `next-id` file, advanced before an id is used, so an id is never reused, across restarts and
 * evictions alike.
 *
 * The directory must be the collector's own and private (a root collector given a directory
 * another user made in /tmp would otherwise write wherever that user's symlinks point). Files
 * are reached through the verified directory's descriptor (openat and friends), new ones are
 * created O_EXCL|O_NOFOLLOW, and existing ones opened O_NOFOLLOW. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pb_decode.h>
#include <pb_encode.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "collector_internal.h"
#include "heapdump/contract/must_check.h"
#include "heapdump_client.bindings.h"

static HD_MUST_CHECK int mkdirs(const char *path) {
  char buf[4096];
  snprintf(buf, sizeof buf, "%s", path);
  for (char *p = buf + 1; *p; p++) {
    if (*p != '/') continue;
    *p = '\0';
    if (mkdir(buf, 0700) != 0 && errno != EEXIST) return -errno;
    *p = '/';
  }
  if (mkdir(buf, 0700) != 0 && errno != EEXIST) return -errno;
  return 0;
}

static bool write_all(int fd, const void *data, size_t size) {
  const uint8_t *p = data;
  while (size > 0) {
    ssize_t n = write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= (size_t)n;
  }
  return true;
}

static void snapshot_file_name(uint32_t id, char *out, size_t size) {
  snprintf(out, size, "snapshot-%u.hdsnap", id);
}

/* A new file of the storage directory, for writing. Whatever is at that name (the leftover of a
 * crash) is removed first, and the file is created, never opened through a link. */
static HD_MUST_CHECK int create_file(hd_collector *c, const char *name) {
  if (unlinkat(c->storage_fd, name, 0) != 0 && errno != ENOENT) return -errno;
  int fd = openat(c->storage_fd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  return fd >= 0 ? fd : -errno;
}

/* Persists next_id + 1 before id next_id is handed out. Called with c->lock held. */
static HD_MUST_CHECK int take_id(hd_collector *c, uint32_t *id) {
  if (c->next_id == UINT32_MAX) return -ENOSPC; /* every id has been used once */
  int fd = create_file(c, "next-id.tmp");
  if (fd < 0) return fd;
  char text[16];
  int len = snprintf(text, sizeof text, "%u\n", c->next_id + 1);
  bool ok = write_all(fd, text, (size_t)len) && fsync(fd) == 0;
  close(fd);
  if (!ok || renameat(c->storage_fd, "next-id.tmp", c->storage_fd, "next-id") != 0) return -EIO;
  fsync(c->storage_fd);
  *id = c->next_id++;
  return 0;
}

/* Reads and checks the header and record structure of a snapshot file of the directory. */
static HD_MUST_CHECK int load_info(int dir_fd, const char *name, hd_stored_snapshot_info *info) {
  int fd = openat(dir_fd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return -errno;
  int rc = hd_stored_file_info(fd, info);
  close(fd);
  return rc;
}

static int compare_ids(const void *a, const void *b) {
  uint32_t x = ((const hd_stored_snapshot_info *)a)->id,
           y = ((const hd_stored_snapshot_info *)b)->id;
  return x < y ? -1 : x > y;
}

static bool append_info(hd_collector *c, const hd_stored_snapshot_info *info) {
  if (c->stored_count == c->stored_capacity) {
    size_t capacity = c->stored_capacity ? c->stored_capacity * 2 : 16;
    void *grown = realloc(c->stored, capacity * sizeof *c->stored);
    if (grown == NULL) return false;
    c->stored = grown;
    c->stored_capacity = capacity;
  }
  c->stored[c->stored_count++] = *info;
  return true;
}

/* Evicts the oldest snapshots of uid over the limits. The limits hold for each uid on its own:
 * the processes of one user (which a root collector adopts) never evict another user's
 * snapshots, and each user can fill only their own share of the disk. Called with c->lock
 * held. */
static void enforce_retention_of(hd_collector *c, uid_t uid) {
  size_t count = 0;
  uint64_t total = 0;
  for (size_t i = 0; i < c->stored_count; i++) {
    if (c->stored[i].uid != uid) continue;
    count++;
    total += c->stored[i].bytes;
  }
  for (size_t i = 0; i < c->stored_count && count > 1 &&
                     ((c->max_stored != 0 && count > c->max_stored) ||
                      (c->max_storage_bytes != 0 && total > c->max_storage_bytes));) {
    if (c->stored[i].uid != uid) {
      i++;
      continue;
    }
    hd_stored_snapshot_info oldest = c->stored[i];
    char name[64];
    snapshot_file_name(oldest.id, name, sizeof name);
    unlinkat(c->storage_fd, name, 0);
    count--;
    total -= oldest.bytes;
    memmove(c->stored + i, c->stored + i + 1, (c->stored_count - i - 1) * sizeof *c->stored);
    c->stored_count--;
    hd_log(c, HD_LOG_INFO,
           "evicted stored snapshot %u (%s of %s[%llu], uid %u) to stay within limits", oldest.id,
           oldest.name, oldest.process_name, (unsigned long long)oldest.pid, (unsigned)uid);
  }
}

/* Every uid's limits. The walk goes down from the newest snapshot and an eviction moves only the
 * entries above it, down by one: no entry is passed over. Called with c->lock held. */
static void enforce_retention(hd_collector *c) {
  for (size_t i = c->stored_count; i-- > 0;) {
    if (i < c->stored_count) enforce_retention_of(c, c->stored[i].uid);
  }
}

/* The storage directory: dir, else $XDG_STATE_HOME/heapdump, else ~/.local/state/heapdump. */
static HD_MUST_CHECK int choose_storage_dir(hd_collector *c, const char *dir) {
  int n;
  if (dir != NULL) {
    n = snprintf(c->storage_dir, sizeof c->storage_dir, "%s", dir);
  } else if (getenv("XDG_STATE_HOME") != NULL && getenv("XDG_STATE_HOME")[0] == '/') {
    n = snprintf(c->storage_dir, sizeof c->storage_dir, "%s/heapdump", getenv("XDG_STATE_HOME"));
  } else if (getenv("HOME") != NULL) {
    n = snprintf(c->storage_dir, sizeof c->storage_dir, "%s/.local/state/heapdump", getenv("HOME"));
  } else {
    return -ENOENT;
  }
  return n < 0 || (size_t)n >= sizeof c->storage_dir - 64 ? -ENAMETOOLONG : 0;
}

/* Creates the directory if need be and opens it; it must be ours, mode 0700, and not a link. */
static HD_MUST_CHECK int open_private_dir(hd_collector *c) {
  int rc = mkdirs(c->storage_dir);
  if (rc != 0) {
    hd_log(c, HD_LOG_ERROR, "cannot create storage directory %s: %s", c->storage_dir,
           strerror(-rc));
    return rc;
  }
  c->storage_fd = open(c->storage_dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (c->storage_fd < 0 || fstat(c->storage_fd, &st) != 0) {
    rc = -errno;
    bool is_link = lstat(c->storage_dir, &st) == 0 && S_ISLNK(st.st_mode);
    hd_log(c, HD_LOG_ERROR, "cannot open storage directory %s: %s", c->storage_dir,
           is_link ? "it is a symbolic link" : strerror(-rc));
    return rc;
  }
  if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
    hd_log(c, HD_LOG_ERROR,
           "storage directory %s must be owned by uid %u with mode 0700 (it is uid %u, mode %o)",
           c->storage_dir, (unsigned)geteuid(), (unsigned)st.st_uid,
           (unsigned)(st.st_mode & 07777));
    return -EPERM;
  }
  return 0;
}

/* The persisted id counter (1 when there is none). */
static void read_next_id(hd_collector *c) {
  c->next_id = 1;
  int next_fd = openat(c->storage_fd, "next-id", O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  FILE *f = next_fd >= 0 ? fdopen(next_fd, "re") : NULL;
  if (f != NULL) {
    unsigned value;
    if (fscanf(f, "%u", &value) == 1 && value > 0) c->next_id = value;
    fclose(f);
  } else if (next_fd >= 0) {
    close(next_fd);
  }
}

/* Lists the stored snapshots in the directory: removes interrupted stores, keeps every id a file
 * names taken, and skips (with a warning) damaged files. */
static HD_MUST_CHECK int scan_stored(hd_collector *c) {
  int list_fd = dup(c->storage_fd); /* closedir closes the descriptor it reads */
  DIR *d = list_fd >= 0 ? fdopendir(list_fd) : NULL;
  if (d == NULL) {
    int rc = -errno;
    if (list_fd >= 0) close(list_fd);
    return rc;
  }
  rewinddir(d);
  struct dirent *entry;
  while ((entry = readdir(d)) != NULL) {
    unsigned id;
    char tail[16];
    if (strncmp(entry->d_name, ".tmp-", 5) == 0) {
      /* A store interrupted by a crash: never renamed, so never listed. */
      unlinkat(c->storage_fd, entry->d_name, 0);
      continue;
    }
    if (sscanf(entry->d_name, "snapshot-%u.%15s", &id, tail) != 2 || strcmp(tail, "hdsnap") != 0) {
      continue;
    }
    /* Even a damaged file's id stays taken: a new snapshot must not overwrite what someone
     * may still want to look at. */
    if (id >= c->next_id && id < UINT32_MAX) c->next_id = id + 1;
    hd_stored_snapshot_info info;
    int load_rc = load_info(c->storage_fd, entry->d_name, &info);
    if (load_rc != 0 || info.id != id) {
      hd_log(c, HD_LOG_WARN, "skipping damaged stored snapshot %s/%s: %s", c->storage_dir,
             entry->d_name,
             load_rc == 0         ? "its id is not the one in its name"
             : load_rc == -EINVAL ? "bad header or truncated record"
             : load_rc == -ELOOP  ? "it is a symbolic link"
                                  : strerror(-load_rc));
      continue;
    }
    if (!append_info(c, &info)) break;
  }
  closedir(d);
  if (c->stored_count > 1) qsort(c->stored, c->stored_count, sizeof *c->stored, compare_ids);
  if (c->stored_count > 0) hd_log(c, HD_LOG_INFO, "loaded %zu stored snapshots", c->stored_count);
  return 0;
}

int hd_storage_open(hd_collector *c, const char *dir) {
  int rc = choose_storage_dir(c, dir);
  if (rc == 0) rc = open_private_dir(c);
  if (rc != 0) return rc;
  read_next_id(c);
  rc = scan_stored(c);
  if (rc != 0) return rc;
  /* Limits lowered since the last run apply at once. */
  pthread_mutex_lock(&c->lock);
  enforce_retention(c);
  pthread_mutex_unlock(&c->lock);
  return 0;
}

void hd_storage_close(hd_collector *c) {
  if (c->storage_fd >= 0) close(c->storage_fd);
  c->storage_fd = -1;
  free(c->stored);
  c->stored = NULL;
  c->stored_count = c->stored_capacity = 0;
}

typedef struct file_sink {
  int fd;
  int error; /* the first write's errno (ENOSPC on a full disk); 0 while all is written */
} file_sink;

/* Writes to the sink unless an earlier write failed; false once one has. */
static bool sink_write(file_sink *sink, const void *data, size_t size) {
  if (sink->error == 0 && !write_all(sink->fd, data, size)) sink->error = errno != 0 ? errno : EIO;
  return sink->error == 0;
}

static HD_MUST_CHECK hd_status append_batch(void *ctx, const uint8_t *body, size_t size) {
  file_sink *sink = ctx;
  uint32_t len = (uint32_t)size;
  if (size == 0) return HD_OK; /* the end of the stream is implied by the end of the file */
  return sink_write(sink, &len, 4) && sink_write(sink, body, size) ? HD_OK : HD_ERR_IO;
}

static bool encode_meta(const heapdump_client_StoredSnapshot *meta, uint8_t *buf, uint32_t *len) {
  pb_ostream_t out = pb_ostream_from_buffer(buf, heapdump_client_StoredSnapshot_size);
  if (!pb_encode(&out, heapdump_client_StoredSnapshot_fields, meta)) return false;
  *len = (uint32_t)out.bytes_written;
  return true;
}

/* Why a named snapshot's table is refused, or NULL with *frozen open. Only a copy that can never
 * change is read without waiting (hd_produce_snapshot): it must be sealed against writing, say
 * it is a copy, and be of the process that sent it. */
static const char *frozen_copy_refusal(int memfd, const hd_process *p, hd_alloc_reader **frozen) {
  static const int kFrozen = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW;
  const int seals = fcntl(memfd, F_GET_SEALS);
  if (seals < 0 || (seals & kFrozen) != kFrozen) return "not sealed against writing";
  hd_read_status rs = hd_alloc_reader_open(memfd, frozen);
  if (rs != HD_READ_OK) return hd_read_status_str(rs);
  hd_alloc_table_info info;
  const char *refused = NULL;
  if (hd_alloc_reader_info(*frozen, &info) != HD_READ_OK ||
      !(info.flags & HD_ALLOC_FLAG_SNAPSHOT)) {
    refused = "a live table, not a snapshot copy";
  } else if (info.pid != (uint32_t)p->own_pid) {
    refused = "another process's table";
  }
  if (refused != NULL) {
    hd_alloc_reader_close(*frozen);
    *frozen = NULL;
  }
  return refused;
}

/* The summary at the head of a stored file, taken now; its live totals are filled in later. */
static heapdump_client_StoredSnapshot stored_meta(uint32_t id, const char *name,
                                                  const hd_process *p) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  heapdump_client_StoredSnapshot meta = {
      .has_snapshot_id = true,
      .snapshot_id = id,
      .has_snapshot_name = true,
      .has_process_koid = true,
      .process_koid = (uint64_t)p->pid,
      .has_process_name = true,
      .has_taken_at_unix_ns = true,
      .taken_at_unix_ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec,
      /* Rewritten in place once known: fixed64, so the message keeps its size. */
      .has_live_bytes = true,
      .has_live_blocks = true,
  };
  snprintf(meta.snapshot_name, sizeof meta.snapshot_name, "%s", name);
  snprintf(meta.process_name, sizeof meta.process_name, "%s", p->name);
  return meta;
}

/* Writes a stored file's head (magic, owner, summary) and the snapshot's batches to sink.
 * Returns hd_produce_snapshot's result (sink->error says whether the writes failed). */
static HD_MUST_CHECK int write_stored_body(hd_collector *c, hd_process *p, hd_alloc_reader *frozen,
                                           const char *name, bool with_contents, file_sink *sink,
                                           const uint8_t *meta_buf, uint32_t meta_len,
                                           hd_snapshot_totals *totals, hd_series_moment *moment) {
  uint32_t uid = (uint32_t)p->uid;
  (void)(sink_write(sink, HD_STORED_MAGIC, 8) && sink_write(sink, &uid, 4) &&
         sink_write(sink, &meta_len, 4) && sink_write(sink, meta_buf, meta_len));
  hd_batch_writer *w = malloc(sizeof *w);
  if (w == NULL) {
    sink->error = ENOMEM;
    return 0;
  }
  int rc = 0;
  hd_batch_writer_init(w, append_batch, sink);
  if (sink->error == 0) {
    rc = hd_produce_snapshot(c, p, frozen, name, with_contents, w, totals, moment);
  }
  if (rc == 0 && hd_batch_end(w) != HD_OK) rc = -EIO;
  free(w);
  return rc;
}

int hd_store_snapshot(hd_collector *c, hd_process *p, const char *name, int memfd,
                      bool with_contents, uint32_t *out_id) {
  hd_alloc_reader *frozen = NULL;
  if (memfd >= 0) {
    const char *refused = frozen_copy_refusal(memfd, p, &frozen);
    if (refused != NULL) {
      hd_log(c, HD_LOG_WARN, "%s[%u]: refused snapshot table: %s", p->name, (unsigned)p->pid,
             refused);
      return -EINVAL;
    }
  }
  pthread_mutex_lock(&c->lock);
  uint32_t id = 0;
  int rc = take_id(c, &id);
  pthread_mutex_unlock(&c->lock);
  if (rc != 0) {
    hd_alloc_reader_close(frozen);
    hd_log(c, HD_LOG_ERROR, "cannot allocate a snapshot id in %s", c->storage_dir);
    return -EIO;
  }
  char tmp[64], file_name[64];
  snprintf(tmp, sizeof tmp, ".tmp-%u", id);
  snapshot_file_name(id, file_name, sizeof file_name);
  int fd = create_file(c, tmp);
  if (fd < 0) {
    hd_alloc_reader_close(frozen);
    return -EIO;
  }
  heapdump_client_StoredSnapshot meta = stored_meta(id, name, p);
  _Static_assert(heapdump_client_StoredSnapshot_size <= HD_STORED_META_MAX,
                 "a stored file's reader takes metadata this long");
  uint8_t meta_buf[heapdump_client_StoredSnapshot_size];
  uint32_t meta_len = 0;
  file_sink sink = {fd, encode_meta(&meta, meta_buf, &meta_len) ? 0 : EINVAL};
  hd_snapshot_totals totals = {0};
  hd_series_moment moment = {0};
  rc = write_stored_body(c, p, frozen, name, with_contents, &sink, meta_buf, meta_len, &totals,
                         &moment);
  hd_alloc_reader_close(frozen);
  meta.live_bytes = totals.live_bytes;
  meta.live_blocks = totals.live_blocks;
  uint32_t final_len = 0;
  /* Why it failed, for the log: a full disk must say so. */
  const char *why = NULL;
  if (sink.error != 0) {
    why = strerror(sink.error);
  } else if (rc != 0) {
    why = "its table could not be read";
  } else if (!encode_meta(&meta, meta_buf, &final_len) || final_len != meta_len) {
    why = "its summary could not be encoded";
  } else if (pwrite(fd, meta_buf, meta_len, 16) != (ssize_t)meta_len || fsync(fd) != 0 ||
             renameat(c->storage_fd, tmp, c->storage_fd, file_name) != 0) {
    why = strerror(errno);
  }
  close(fd);
  hd_stored_snapshot_info info;
  if (why == NULL && load_info(c->storage_fd, file_name, &info) != 0)
    why = "it could not be read back";
  if (why != NULL) {
    unlinkat(c->storage_fd, tmp, 0);
    hd_log(c, HD_LOG_ERROR, "could not store snapshot \"%s\" of %s[%u] in %s: %s", name, p->name,
           (unsigned)p->pid, c->storage_dir, why);
    return rc == -EIO || rc == -EINVAL ? -EINVAL : -EIO;
  }
  fsync(c->storage_fd);
  if (moment.name[0] != '\0') hd_series_remember(&p->series, &moment);
  pthread_mutex_lock(&c->lock);
  append_info(c, &info);
  enforce_retention_of(c, p->uid);
  pthread_mutex_unlock(&c->lock);
  hd_log(c, HD_LOG_INFO, "stored snapshot %u \"%s\" of %s[%u]", id, name, p->name,
         (unsigned)p->pid);
  *out_id = id;
  return 0;
}

static bool matches(const hd_stored_snapshot_info *s, uid_t uid,
                    const heapdump_client_ProcessSelector *selector) {
  if (uid != 0 && s->uid != uid) return false;
  if (selector == NULL) return true;
  if (selector->which_selector == heapdump_client_ProcessSelector_by_name_tag) {
    return strcmp(s->process_name, selector->selector.by_name) == 0;
  }
  return s->pid == selector->selector.by_koid;
}

int hd_storage_list(hd_collector *c, uid_t uid, const heapdump_client_ProcessSelector *selector,
                    hd_stored_list *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&c->lock);
  out->items = malloc((c->stored_count + 1) * sizeof *out->items);
  if (out->items != NULL) {
    for (size_t i = 0; i < c->stored_count; i++) {
      if (matches(&c->stored[i], uid, selector)) out->items[out->count++] = c->stored[i];
    }
  }
  pthread_mutex_unlock(&c->lock);
  return out->items != NULL ? 0 : -ENOMEM;
}

typedef struct page {
  hd_stored_list *listing;
  size_t end;
} page;

static bool encode_page(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const page *pg = *arg;
  for (size_t i = pg->listing->next; i < pg->end; i++) {
    const hd_stored_snapshot_info *s = &pg->listing->items[i];
    heapdump_client_StoredSnapshot m = {
        .has_snapshot_id = true,
        .snapshot_id = s->id,
        .has_snapshot_name = true,
        .has_process_koid = true,
        .process_koid = s->pid,
        .has_process_name = true,
        .has_taken_at_unix_ns = s->taken_at_unix_ns != 0,
        .taken_at_unix_ns = s->taken_at_unix_ns,
        .has_live_bytes = s->taken_at_unix_ns != 0,
        .live_bytes = s->live_bytes,
        .has_live_blocks = s->taken_at_unix_ns != 0,
        .live_blocks = s->live_blocks,
        .has_stored_bytes = true,
        .stored_bytes = s->bytes,
    };
    snprintf(m.snapshot_name, sizeof m.snapshot_name, "%s", s->name);
    snprintf(m.process_name, sizeof m.process_name, "%s", s->process_name);
    if (!pb_encode_tag_for_field(stream, field) ||
        !pb_encode_submessage(stream, heapdump_client_StoredSnapshot_fields, &m)) {
      return false;
    }
  }
  return true;
}

hd_status hd_storage_send_page(int fd, hd_message *msg, hd_stored_list *listing) {
  /* As many entries as fit: each costs at most its bounded encoded size plus tag and length. */
  const size_t per_item = heapdump_client_StoredSnapshot_size + 3;
  size_t room = (HD_MAX_BODY_BYTES - 8) / per_item;
  page pg = {listing,
             listing->next + room < listing->count ? listing->next + room : listing->count};
  heapdump_client_StoredSnapshotIteratorGetNextResult result =
      heapdump_client_StoredSnapshotIteratorGetNextResult_init_zero;
  result.which_result = heapdump_client_StoredSnapshotIteratorGetNextResult_response_tag;
  result.result.response.batch.funcs.encode = encode_page;
  result.result.response.batch.arg = &pg;
  uint32_t txid = msg->txid;
  hd_status status = hd_fidl_stored_snapshot_iterator_get_next_reply(fd, msg, txid, &result);
  if (status == HD_OK) listing->next = pg.end;
  return status;
}

int hd_storage_delete(hd_collector *c, uint32_t id, uid_t uid) {
  hd_stored_snapshot_info found = {0};
  pthread_mutex_lock(&c->lock);
  size_t i = 0;
  while (i < c->stored_count && c->stored[i].id != id) i++;
  bool visible = i < c->stored_count && (uid == 0 || c->stored[i].uid == uid);
  int unlinked = 0;
  if (visible) {
    /* Unlinked under the lock so that no listing shows an id whose file is gone; a download
     * already streaming it keeps its open file. A file that stays (read-only storage) stays
     * listed: the snapshot is still there, and would be back after a restart. */
    char name[64];
    snapshot_file_name(id, name, sizeof name);
    unlinked = unlinkat(c->storage_fd, name, 0) == 0 || errno == ENOENT ? 0 : -errno;
    if (unlinked == 0) {
      found = c->stored[i];
      memmove(c->stored + i, c->stored + i + 1, (c->stored_count - i - 1) * sizeof *c->stored);
      c->stored_count--;
    }
  }
  pthread_mutex_unlock(&c->lock);
  if (!visible) return -ENOENT;
  if (unlinked != 0) {
    hd_log(c, HD_LOG_WARN, "cannot delete stored snapshot %u: %s", id, strerror(-unlinked));
    return unlinked;
  }
  if (fsync(c->storage_fd) != 0) {
    hd_log(c, HD_LOG_WARN, "deleted stored snapshot %u, but syncing %s failed: %s", id,
           c->storage_dir, strerror(errno));
  }
  hd_log(c, HD_LOG_INFO, "deleted stored snapshot %u (%s of %s[%llu]) at uid %u's request", id,
         found.name, found.process_name, (unsigned long long)found.pid, (unsigned)uid);
  return 0;
}

int hd_storage_stream(hd_collector *c, uint32_t id, uid_t uid, hd_batch_writer *w) {
  bool visible = false;
  pthread_mutex_lock(&c->lock);
  for (size_t i = 0; i < c->stored_count; i++) {
    if (c->stored[i].id == id) visible = uid == 0 || c->stored[i].uid == uid;
  }
  pthread_mutex_unlock(&c->lock);
  if (!visible) return -ENOENT;
  char name[64];
  snapshot_file_name(id, name, sizeof name);
  int fd = openat(c->storage_fd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return -ENOENT; /* evicted meanwhile */
  int rc = hd_stored_file_stream(fd, w);
  close(fd);
  return rc;
}
