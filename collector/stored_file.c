/* Reading stored snapshot files back (stored_file.h). */
#define _GNU_SOURCE
#include "stored_file.h"

#include <errno.h>
#include <pb_decode.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "heapdump_client.pb.h"

/* size bytes at offset; false at the end of the file or on an error. */
static bool read_at(int fd, void *data, size_t size, off_t offset) {
  uint8_t *p = data;
  while (size > 0) {
    ssize_t n = pread(fd, p, size, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= (size_t)n;
    offset += n;
  }
  return true;
}

/* The header: the uid and the metadata's length; false unless it is a stored snapshot's. */
static bool read_header(int fd, uint32_t *uid, uint32_t *meta_len) {
  char magic[8];
  return read_at(fd, magic, 8, 0) && memcmp(magic, HD_STORED_MAGIC, 8) == 0 &&
         read_at(fd, uid, 4, 8) && read_at(fd, meta_len, 4, 12) && *meta_len <= HD_STORED_META_MAX;
}

int hd_stored_file_info(int fd, hd_stored_snapshot_info *info) {
  uint32_t uid, meta_len;
  uint8_t meta[HD_STORED_META_MAX];
  struct stat st;
  if (fstat(fd, &st) != 0) return -errno;
  if (!S_ISREG(st.st_mode) || !read_header(fd, &uid, &meta_len) || !read_at(fd, meta, meta_len, 16))
    return -EINVAL;
  heapdump_client_StoredSnapshot s = heapdump_client_StoredSnapshot_init_zero;
  pb_istream_t in = pb_istream_from_buffer(meta, meta_len);
  if (!pb_decode(&in, heapdump_client_StoredSnapshot_fields, &s) || !s.has_snapshot_id)
    return -EINVAL;
  /* Each record's length must fit a batch, and the file must end on a record. */
  for (off_t offset = 16 + (off_t)meta_len; offset < st.st_size;) {
    uint32_t len;
    if (!read_at(fd, &len, 4, offset) || len > HD_BATCH_CAPACITY ||
        offset + 4 + (off_t)len > st.st_size)
      return -EINVAL;
    offset += 4 + (off_t)len;
  }
  memset(info, 0, sizeof *info);
  info->id = s.snapshot_id;
  snprintf(info->name, sizeof info->name, "%s", s.snapshot_name);
  snprintf(info->process_name, sizeof info->process_name, "%s", s.process_name);
  info->pid = s.process_koid;
  info->uid = uid;
  info->bytes = (uint64_t)st.st_size;
  /* Files stored before these fields existed lack them: zero reads as unknown. */
  info->taken_at_unix_ns = s.taken_at_unix_ns;
  info->live_bytes = s.live_bytes;
  info->live_blocks = s.live_blocks;
  return 0;
}

int hd_stored_file_stream(int fd, hd_batch_writer *w) {
  uint32_t uid, meta_len;
  if (!read_header(fd, &uid, &meta_len)) return -EIO;
  uint8_t *body = malloc(HD_BATCH_CAPACITY);
  if (body == NULL) return -ENOMEM;
  int rc = 0;
  off_t offset = 16 + (off_t)meta_len;
  uint32_t len;
  while (rc == 0 && read_at(fd, &len, 4, offset)) {
    if (len > HD_BATCH_CAPACITY || !read_at(fd, body, len, offset + 4)) {
      rc = -EIO;
      break;
    }
    offset += 4 + (off_t)len;
    if (hd_batch_forward(w, body, len) != HD_OK) rc = -EPIPE;
  }
  free(body);
  return rc;
}
