/* libFuzzer target: an arbitrary datagram as received by a server. Parses the header and
 * dispatches it to every protocol the collector serves, whose handlers only take descriptors. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "heapdump/fidl/batch.h"
#include "heapdump/fidl/message.h"
#include "heapdump_client.bindings.h"
#include "heapdump_process.bindings.h"

static hd_message msg;
static hd_batch_reader reader;

static hd_status ignore_element(void *ctx, const hd_element *e) {
  (void)ctx;
  (void)e;
  return HD_OK;
}
static hd_status take_receiver(void *ctx, hd_message *m,
                               heapdump_client_CollectorTakeLiveSnapshotRequest *r) {
  (void)ctx;
  return hd_message_take_fd(m, &r->receiver) == -1 ? HD_OK : HD_ERR_INVALID_ARGS;
}
static hd_status list(void *ctx, hd_message *m,
                      heapdump_client_CollectorListStoredSnapshotsRequest *r) {
  (void)ctx;
  (void)m;
  (void)r;
  return HD_OK;
}
static hd_status download(void *ctx, hd_message *m,
                          heapdump_client_CollectorDownloadStoredSnapshotRequest *r) {
  (void)ctx;
  (void)m;
  (void)r;
  return HD_OK;
}
static void prepare_batch(void *ctx, heapdump_client_SnapshotReceiverBatchRequest *r) {
  (void)ctx;
  hd_batch_reader_prepare(&reader, r);
}
static hd_status batch(void *ctx, hd_message *m, heapdump_client_SnapshotReceiverBatchRequest *r) {
  (void)ctx;
  (void)m;
  (void)r;
  return HD_OK;
}
static hd_status report_error(void *ctx, hd_message *m,
                              heapdump_client_SnapshotReceiverReportErrorRequest *r) {
  (void)ctx;
  (void)m;
  (void)r;
  return HD_OK;
}
static hd_status get_next(void *ctx, hd_message *m,
                          heapdump_client_StoredSnapshotIteratorGetNextRequest *r) {
  (void)ctx;
  (void)m;
  (void)r;
  return HD_OK;
}
static hd_status register_process(void *ctx, hd_message *m,
                                  heapdump_process_RegistryRegisterRequest *r) {
  (void)ctx;
  (void)m;
  (void)r;
  return HD_OK;
}
static hd_status reattach(void *ctx, hd_message *m, heapdump_process_RegistryReattachRequest *r) {
  (void)ctx;
  (void)m;
  (void)r;
  return HD_OK;
}
static hd_status report_arm_failure(void *ctx, hd_message *m,
                                    heapdump_process_RegistryReportArmFailureRequest *r) {
  (void)ctx;
  (void)m;
  (void)r;
  return HD_OK;
}
static hd_status store(void *ctx, hd_message *m,
                       heapdump_process_SnapshotSinkStoreNamedSnapshotRequest *r) {
  (void)ctx;
  (void)m;
  (void)r;
  return HD_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > sizeof msg.bytes) return 0;
  hd_message_init(&msg);
  memcpy(msg.bytes, data, size);
  msg.size = size;
  if (hd_message_parse_header(&msg) != HD_OK) return 0;
  hd_batch_reader_init(&reader, ignore_element, NULL);
  const hd_fidl_collector_server collector = {.take_live_snapshot = take_receiver,
                                              .list_stored_snapshots = list,
                                              .download_stored_snapshot = download};
  const hd_fidl_snapshot_receiver_server receiver = {
      .batch_prepare = prepare_batch, .batch = batch, .report_error = report_error};
  const hd_fidl_stored_snapshot_iterator_server iterator = {.get_next = get_next};
  const hd_fidl_registry_server registry = {.register_ = register_process,
                                            .reattach = reattach,
                                            .report_arm_failure = report_arm_failure};
  const hd_fidl_snapshot_sink_server sink = {.store_named_snapshot = store};
  hd_status status = hd_fidl_collector_dispatch(&collector, NULL, &msg);
  if (status == HD_ERR_UNKNOWN_ORDINAL)
    status = hd_fidl_snapshot_receiver_dispatch(&receiver, NULL, &msg);
  if (status == HD_ERR_UNKNOWN_ORDINAL)
    status = hd_fidl_stored_snapshot_iterator_dispatch(&iterator, NULL, &msg);
  if (status == HD_ERR_UNKNOWN_ORDINAL) status = hd_fidl_registry_dispatch(&registry, NULL, &msg);
  if (status == HD_ERR_UNKNOWN_ORDINAL) status = hd_fidl_snapshot_sink_dispatch(&sink, NULL, &msg);
  (void)status;
  return 0;
}
