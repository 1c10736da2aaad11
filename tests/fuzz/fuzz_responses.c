/* libFuzzer target: arbitrary bodies of every two-way response a client decodes (GetNext result
 * with its callback-decoded listing, Register and StoreNamedSnapshot responses, Empty). The first
 * byte picks the response type. */
#include <pb_decode.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "heapdump/fidl/message.h"
#include "heapdump_client.pb.h"
#include "heapdump_process.pb.h"

static hd_message msg;

static bool count_snapshot(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  heapdump_client_StoredSnapshot s = heapdump_client_StoredSnapshot_init_zero;
  if (!pb_decode(stream, heapdump_client_StoredSnapshot_fields, &s)) return false;
  (*(size_t *)*arg)++;
  return true;
}

/* Called by nanopb before the result's variant is decoded: hooks the listing callback. */
static bool prepare_listing(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)stream;
  if (field->tag == heapdump_client_StoredSnapshotIteratorGetNextResult_response_tag) {
    heapdump_client_StoredSnapshotIteratorGetNextResponse *response = field->pData;
    response->batch.funcs.decode = count_snapshot;
    response->batch.arg = *arg;
  }
  return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size - 1 > HD_MAX_BODY_BYTES) return 0;
  hd_message_init(&msg);
  memcpy(msg.bytes + HD_HEADER_BYTES, data + 1, size - 1);
  msg.size = HD_HEADER_BYTES + size - 1;
  hd_status status;
  switch (data[0] % 4) {
    case 0: {
      size_t count = 0;
      heapdump_client_StoredSnapshotIteratorGetNextResult result =
          heapdump_client_StoredSnapshotIteratorGetNextResult_init_zero;
      result.cb_result.funcs.decode = prepare_listing;
      result.cb_result.arg = &count;
      status = hd_message_decode_body(
          &msg, heapdump_client_StoredSnapshotIteratorGetNextResult_fields, &result);
      break;
    }
    case 1: {
      heapdump_process_RegistryRegisterResponse r =
          heapdump_process_RegistryRegisterResponse_init_zero;
      status = hd_message_decode_body(&msg, heapdump_process_RegistryRegisterResponse_fields, &r);
      break;
    }
    case 2: {
      heapdump_process_SnapshotSinkStoreNamedSnapshotResponse r =
          heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_init_zero;
      status = hd_message_decode_body(
          &msg, heapdump_process_SnapshotSinkStoreNamedSnapshotResponse_fields, &r);
      break;
    }
    default: {
      heapdump_client_Empty r = heapdump_client_Empty_init_zero;
      status = hd_message_decode_body(&msg, heapdump_client_Empty_fields, &r);
    }
  }
  (void)status;
  return 0;
}
