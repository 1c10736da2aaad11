/* Fuzz target: a stored snapshot's file as the collector reads it back (collector/stored_file.c):
 * its summary, as a listing or the start-up scan reads it, then a download of it, forwarded batch
 * by batch as the collector sends it and decoded into the reassembler as a client receives it.
 * A damaged or planted file in the storage directory must give an error, never a crash. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "heapdump/fidl/batch.h"
#include "heapdump/fidl/snapshot.h"
#include "stored_file.h"

static hd_batch_writer writer;
static hd_message msg;
static hd_batch_reader reader;

/* What a client does with each batch of the download. */
static hd_status receive(void *ctx, const uint8_t *body, size_t size) {
  (void)ctx;
  if (size == 0) return HD_OK;
  hd_message_init(&msg);
  memcpy(msg.bytes + HD_HEADER_BYTES, body, size);
  msg.size = HD_HEADER_BYTES + size;
  return hd_batch_reader_decode(&reader, &msg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int fd = memfd_create("stored", MFD_CLOEXEC);
  if (fd < 0 || write(fd, data, size) != (ssize_t)size) abort();
  hd_stored_snapshot_info info;
  if (hd_stored_file_info(fd, &info) == 0) {
    /* A summary's strings are what listings send: always terminated, within their bounds. */
    if (memchr(info.name, 0, sizeof info.name) == NULL ||
        memchr(info.process_name, 0, sizeof info.process_name) == NULL || info.bytes != size)
      abort();
  }
  hd_reassembler reassembler;
  hd_reassembler_init(&reassembler);
  hd_batch_reader_init(&reader, hd_reassembler_add, &reassembler);
  hd_batch_writer_init(&writer, receive, NULL);
  if (hd_stored_file_stream(fd, &writer) == 0 && hd_batch_end(&writer) == HD_OK) {
    hd_status status = hd_reassembler_finish(&reassembler);
    (void)status;
  }
  hd_reassembler_destroy(&reassembler);
  close(fd);
  return 0;
}
