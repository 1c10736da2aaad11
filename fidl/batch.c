/* Batch writer (measured packing and chunking of snapshot elements) and streaming batch reader. */
#include "heapdump/fidl/batch.h"

#include <pb_decode.h>
#include <pb_encode.h>
#include <string.h>

#include "heapdump_client.bindings.h"

/* Every length inside a batch is below 2^21, so its varint takes at most 3 bytes. */
#define MAX_LENGTH_VARINT 3u
/* Field 1 of SnapshotReceiverBatchRequest, wire type 2 (length-delimited): one byte. */
#define BATCH_FIELD_TAG 0x0Au

static size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    n++;
  }
  return n;
}

void hd_batch_writer_init(hd_batch_writer *w, hd_batch_send_fn send, void *ctx) {
  w->send = send;
  w->ctx = ctx;
  w->used = 0;
  w->element_count = 0;
  w->batches_sent = 0;
}

hd_status hd_batch_flush(hd_batch_writer *w) {
  if (w->element_count == 0) return HD_OK;
  hd_status status = w->send(w->ctx, w->buf, w->used);
  w->batches_sent++;
  w->used = 0;
  w->element_count = 0;
  return status;
}

hd_status hd_batch_forward(hd_batch_writer *w, const uint8_t *body, size_t size) {
  if (size > HD_BATCH_CAPACITY) return HD_ERR_INVALID_ARGS;
  hd_status status = hd_batch_flush(w);
  if (status != HD_OK || size == 0) return status;
  w->batches_sent++;
  return w->send(w->ctx, body, size);
}

hd_status hd_batch_end(hd_batch_writer *w) {
  hd_status status = hd_batch_flush(w);
  if (status != HD_OK) return status;
  w->batches_sent++;
  return w->send(w->ctx, w->buf, 0);
}

/* Encodes e at the end of buf; the caller has checked it fits. */
static hd_status encode_at_end(hd_batch_writer *w, const heapdump_client_SnapshotElement *e,
                               size_t size) {
  pb_ostream_t out = pb_ostream_from_buffer(w->buf + w->used, HD_BATCH_CAPACITY - w->used);
  if (!pb_encode_tag(&out, PB_WT_STRING, 1) || !pb_encode_varint(&out, size) ||
      !pb_encode(&out, heapdump_client_SnapshotElement_fields, e)) {
    return HD_ERR_ENCODE;
  }
  w->used += out.bytes_written;
  w->element_count++;
  return HD_OK;
}

static hd_status add_measured(hd_batch_writer *w, const heapdump_client_SnapshotElement *e) {
  size_t size;
  if (!pb_get_encoded_size(&size, heapdump_client_SnapshotElement_fields, e)) return HD_ERR_ENCODE;
  size_t total = 1 + varint_size(size) + size;
  if (total > HD_BATCH_CAPACITY) return HD_ERR_ENCODE;
  if (w->used + total > HD_BATCH_CAPACITY) {
    hd_status status = hd_batch_flush(w);
    if (status != HD_OK) return status;
  }
  return encode_at_end(w, e, size);
}

hd_status hd_batch_add(hd_batch_writer *w, const heapdump_client_SnapshotElement *e) {
  /* Chunked variants have their own entry points that bound their payloads. */
  if (e->which_element == heapdump_client_SnapshotElement_stack_trace_tag ||
      e->which_element == heapdump_client_SnapshotElement_block_contents_tag) {
    return HD_ERR_INVALID_ARGS;
  }
  return add_measured(w, e);
}

typedef struct u64_slice {
  const uint64_t *values;
  size_t count;
} u64_slice;

static bool encode_packed_u64(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const u64_slice *slice = *arg;
  if (slice->count == 0) return true;
  size_t payload = 0;
  for (size_t i = 0; i < slice->count; i++) payload += varint_size(slice->values[i]);
  if (!pb_encode_tag(stream, PB_WT_STRING, field->tag) || !pb_encode_varint(stream, payload)) {
    return false;
  }
  for (size_t i = 0; i < slice->count; i++) {
    if (!pb_encode_varint(stream, slice->values[i])) return false;
  }
  return true;
}

typedef struct byte_slice {
  const uint8_t *bytes;
  size_t size;
} byte_slice;

static bool encode_bytes(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const byte_slice *slice = *arg;
  return pb_encode_tag_for_field(stream, field) &&
         pb_encode_string(stream, slice->bytes, slice->size);
}

/* Room left in the current batch for a chunk's payload, given the encoded size of the element
 * without payload: the element's own length prefixes may grow, and the payload brings a tag and a
 * length. Zero if not even that overhead fits. */
static size_t payload_room(const hd_batch_writer *w, size_t empty_element_size) {
  size_t overhead = 1 + MAX_LENGTH_VARINT + empty_element_size + 2 * (MAX_LENGTH_VARINT - 1) + 1 +
                    MAX_LENGTH_VARINT;
  size_t free_bytes = HD_BATCH_CAPACITY - w->used;
  return free_bytes > overhead ? free_bytes - overhead : 0;
}

hd_status hd_batch_add_stack_trace(hd_batch_writer *w, uint64_t key, const uint64_t *addresses,
                                   size_t count) {
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_stack_trace_tag;
  e.element.stack_trace.has_stack_trace_key = true;
  e.element.stack_trace.stack_trace_key = key;
  u64_slice slice = {addresses, 0};
  e.element.stack_trace.program_addresses.funcs.encode = encode_packed_u64;
  e.element.stack_trace.program_addresses.arg = &slice;
  size_t empty_size;
  if (!pb_get_encoded_size(&empty_size, heapdump_client_SnapshotElement_fields, &e)) {
    return HD_ERR_ENCODE;
  }
  size_t done = 0;
  do {
    size_t room = payload_room(w, empty_size);
    size_t n = 0, payload = 0;
    while (done + n < count && payload + varint_size(addresses[done + n]) <= room) {
      payload += varint_size(addresses[done + n]);
      n++;
    }
    /* Flush rather than write a chunk of nothing, unless the trace is empty. */
    if (n == 0 && count > 0) {
      if (w->element_count == 0) return HD_ERR_ENCODE;
      hd_status status = hd_batch_flush(w);
      if (status != HD_OK) return status;
      continue;
    }
    slice.values = count > 0 ? addresses + done : addresses; /* no arithmetic on NULL */
    slice.count = n;
    hd_status status = add_measured(w, &e);
    if (status != HD_OK) return status;
    done += n;
  } while (done < count);
  return HD_OK;
}

hd_status hd_batch_add_block_contents(hd_batch_writer *w, uint64_t address, const uint8_t *bytes,
                                      size_t size) {
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_block_contents_tag;
  e.element.block_contents.has_address = true;
  e.element.block_contents.address = address;
  byte_slice slice = {bytes, 0};
  e.element.block_contents.contents.funcs.encode = encode_bytes;
  e.element.block_contents.contents.arg = &slice;
  size_t empty_size;
  if (!pb_get_encoded_size(&empty_size, heapdump_client_SnapshotElement_fields, &e)) {
    return HD_ERR_ENCODE;
  }
  size_t done = 0;
  do {
    size_t room = payload_room(w, empty_size);
    size_t n = size - done < room ? size - done : room;
    if (n == 0 && size > 0) {
      if (w->element_count == 0) return HD_ERR_ENCODE;
      hd_status status = hd_batch_flush(w);
      if (status != HD_OK) return status;
      continue;
    }
    slice.bytes = size > 0 ? bytes + done : bytes;
    slice.size = n;
    hd_status status = add_measured(w, &e);
    if (status != HD_OK) return status;
    done += n;
  } while (done < size);
  return HD_OK;
}

static bool encode_raw_body(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  (void)field;
  const byte_slice *body = *arg;
  return pb_write(stream, body->bytes, body->size);
}

hd_status hd_batch_send_on_channel(void *hd_batch_channel_ctx, const uint8_t *body, size_t size) {
  hd_batch_channel *ch = hd_batch_channel_ctx;
  heapdump_client_SnapshotReceiverBatchRequest request =
      heapdump_client_SnapshotReceiverBatchRequest_init_zero;
  byte_slice slice = {body, size};
  request.batch.funcs.encode = encode_raw_body;
  request.batch.arg = &slice;
  heapdump_client_Empty ack = heapdump_client_Empty_init_zero;
  return hd_snapshot_receiver_batch(ch->channel, ch->scratch, &request, NULL, 0, &ack);
}

/* ---- reader ---- */

static bool decode_addresses(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  hd_batch_reader *r = *arg;
  while (stream->bytes_left > 0) {
    uint64_t value;
    if (!pb_decode_varint(stream, &value)) return false;
    if (r->address_count == HD_READER_MAX_ADDRESSES) PB_RETURN_ERROR(stream, "too many addresses");
    r->addresses[r->address_count++] = value;
  }
  return true;
}

static bool decode_contents(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  hd_batch_reader *r = *arg;
  size_t n = stream->bytes_left;
  if (n > HD_READER_MAX_CONTENTS - r->contents_size) PB_RETURN_ERROR(stream, "contents too long");
  if (!pb_read(stream, r->contents + r->contents_size, n)) return false;
  r->contents_size += n;
  return true;
}

/* Called by nanopb before a SnapshotElement variant is decoded: hooks the vector callbacks. */
static bool prepare_variant(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)stream;
  hd_batch_reader *r = *arg;
  if (field->tag == heapdump_client_SnapshotElement_stack_trace_tag) {
    heapdump_client_StackTrace *trace = field->pData;
    trace->program_addresses.funcs.decode = decode_addresses;
    trace->program_addresses.arg = r;
  } else if (field->tag == heapdump_client_SnapshotElement_block_contents_tag) {
    heapdump_client_BlockContents *block = field->pData;
    block->contents.funcs.decode = decode_contents;
    block->contents.arg = r;
  }
  return true;
}

static bool decode_element(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  hd_batch_reader *r = *arg;
  heapdump_client_SnapshotElement element = heapdump_client_SnapshotElement_init_zero;
  element.cb_element.funcs.decode = prepare_variant;
  element.cb_element.arg = r;
  r->address_count = 0;
  r->contents_size = 0;
  if (!pb_decode(stream, heapdump_client_SnapshotElement_fields, &element)) return false;
  hd_element e = {.element = &element};
  if (element.which_element == heapdump_client_SnapshotElement_stack_trace_tag) {
    e.addresses = r->addresses;
    e.address_count = r->address_count;
  } else if (element.which_element == heapdump_client_SnapshotElement_block_contents_tag) {
    e.contents = r->contents;
    e.contents_size = r->contents_size;
  }
  r->element_count++;
  hd_status status = r->on_element(r->ctx, &e);
  if (status != HD_OK) {
    r->status = status;
    return false;
  }
  return true;
}

void hd_batch_reader_init(hd_batch_reader *r, hd_element_fn on_element, void *ctx) {
  r->on_element = on_element;
  r->ctx = ctx;
  r->status = HD_OK;
  r->element_count = 0;
  r->address_count = 0;
  r->contents_size = 0;
}

void hd_batch_reader_prepare(hd_batch_reader *r,
                             heapdump_client_SnapshotReceiverBatchRequest *request) {
  r->element_count = 0;
  request->batch.funcs.decode = decode_element;
  request->batch.arg = r;
}

hd_status hd_batch_reader_decode(hd_batch_reader *r, hd_message *msg) {
  heapdump_client_SnapshotReceiverBatchRequest request =
      heapdump_client_SnapshotReceiverBatchRequest_init_zero;
  hd_batch_reader_prepare(r, &request);
  r->status = HD_OK;
  hd_status status =
      hd_message_decode_body(msg, heapdump_client_SnapshotReceiverBatchRequest_fields, &request);
  if (status != HD_OK && r->status != HD_OK) return r->status;
  return status;
}
