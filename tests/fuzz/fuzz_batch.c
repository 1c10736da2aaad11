/* libFuzzer target: an arbitrary SnapshotReceiver.Batch body, decoded element by element into the
 * reassembler, then checked. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "heapdump/fidl/batch.h"
#include "heapdump/fidl/snapshot.h"

static hd_message msg;
static hd_batch_reader reader;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > HD_MAX_BODY_BYTES) return 0;
  hd_message_init(&msg);
  memcpy(msg.bytes + HD_HEADER_BYTES, data, size);
  msg.size = HD_HEADER_BYTES + size;
  hd_reassembler reassembler;
  hd_reassembler_init(&reassembler);
  hd_batch_reader_init(&reader, hd_reassembler_add, &reassembler);
  if (hd_batch_reader_decode(&reader, &msg) == HD_OK) {
    hd_status status = hd_reassembler_finish(&reassembler);
    (void)status;
  }
  hd_reassembler_destroy(&reassembler);
  return 0;
}
