/* Batch writer (packing and chunking of snapshot elements, each encoded once), the windowed
 * channel sender, and the streaming batch reader. */
#include "heapdump/fidl/batch.h"

#include <pb_decode.h>
#include <pb_encode.h>
#include <stdio.h>
#include <string.h>

#include "heapdump/contract/must_check.h"
#include "heapdump_client.bindings.h"

/* Every length inside a batch is below 2^21, so its varint takes at most 3 bytes. */
#define MAX_LENGTH_VARINT 3u
/* The key of a field: its number and wire type. Every field number used here is below 16, so a
 * key is one byte. */
#define KEY(field, wire_type) ((uint8_t)((field) << 3 | (wire_type)))
/* Field 1 of SnapshotReceiverBatchRequest, length-delimited. */
#define BATCH_FIELD_KEY KEY(1, PB_WT_STRING)

/* Allocation and BlockContents are encoded and decoded by hand below, field by field, with the
 * IDL's own tags. A field the IDL adds to either, or a field whose kind or type changes, would be
 * dropped or misread silently; instead the build fails here, from nanopb's field lists: each
 * message has exactly the fields the hand code handles, each tag with the kind and type it
 * writes. (A kind or type not listed below fails as an undeclared HD_HAND_* name.) */
#define HD_HAND_STATIC_OPTIONAL_UINT64 1
#define HD_HAND_STATIC_OPTIONAL_INT64 2
#define HD_HAND_CALLBACK_OPTIONAL_BYTES 3
#define HD_HAND_Allocation_1 HD_HAND_STATIC_OPTIONAL_UINT64     /* address */
#define HD_HAND_Allocation_2 HD_HAND_STATIC_OPTIONAL_UINT64     /* size */
#define HD_HAND_Allocation_3 HD_HAND_STATIC_OPTIONAL_UINT64     /* stack_trace_key */
#define HD_HAND_Allocation_4 HD_HAND_STATIC_OPTIONAL_INT64      /* timestamp */
#define HD_HAND_Allocation_5 HD_HAND_STATIC_OPTIONAL_UINT64     /* thread_info_key */
#define HD_HAND_Allocation_6 HD_HAND_STATIC_OPTIONAL_UINT64     /* count */
#define HD_HAND_BlockContents_1 HD_HAND_STATIC_OPTIONAL_UINT64  /* address */
#define HD_HAND_BlockContents_2 HD_HAND_CALLBACK_OPTIONAL_BYTES /* contents */
#define HD_COUNT_FIELD(a, allocation, kind, type, name, tag) +1
#define HD_ALLOCATION_FIELD_AS_HANDLED(a, allocation, kind, type, name, tag) \
  &&HD_HAND_Allocation_##tag == HD_HAND_##allocation##_##kind##_##type
#define HD_CONTENTS_FIELD_AS_HANDLED(a, allocation, kind, type, name, tag) \
  &&HD_HAND_BlockContents_##tag == HD_HAND_##allocation##_##kind##_##type
_Static_assert(
    0 heapdump_client_Allocation_FIELDLIST(HD_COUNT_FIELD, _) == 6,
    "Allocation has another field: add it to hd_batch_add_allocation and decode_allocation");
_Static_assert(
    1 heapdump_client_Allocation_FIELDLIST(HD_ALLOCATION_FIELD_AS_HANDLED, _),
    "an Allocation field changed its kind or type: the hand code writes optional varints");
_Static_assert(0 heapdump_client_BlockContents_FIELDLIST(HD_COUNT_FIELD, _) == 2,
               "BlockContents has another field: add it to the contents encoder and decoder");
_Static_assert(1 heapdump_client_BlockContents_FIELDLIST(HD_CONTENTS_FIELD_AS_HANDLED, _),
               "a BlockContents field changed its kind or type");
#undef HD_COUNT_FIELD
#undef HD_ALLOCATION_FIELD_AS_HANDLED
#undef HD_CONTENTS_FIELD_AS_HANDLED

static size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    n++;
  }
  return n;
}

static uint8_t *put_varint(uint8_t *p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  *p++ = (uint8_t)v;
  return p;
}

/* Bytes a length-delimited field with a one-byte key takes for a payload of `size` bytes. */
static size_t delimited_size(size_t size) { return 1 + varint_size(size) + size; }

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

/* Makes room for an element of `total` bytes (key and length included): flushes if it does not
 * fit behind the elements already in the batch. */
static HD_MUST_CHECK hd_status make_room(hd_batch_writer *w, size_t total) {
  if (total > HD_BATCH_CAPACITY) return HD_ERR_ENCODE;
  if (w->used + total > HD_BATCH_CAPACITY) return hd_batch_flush(w);
  return HD_OK;
}

/* Starts an element whose encoding (after its own key and length) takes `size` bytes; returns
 * where that encoding goes. The caller has made room. */
static uint8_t *begin_element(hd_batch_writer *w, size_t size) {
  uint8_t *p = w->buf + w->used;
  *p++ = BATCH_FIELD_KEY;
  p = put_varint(p, size);
  w->used += delimited_size(size);
  w->element_count++;
  return p;
}

/* Encodes e with nanopb into w->element, then copies it into the batch: each element is encoded
 * once, and the batch is filled exactly up to the limit. */
static HD_MUST_CHECK hd_status add_encoded(hd_batch_writer *w,
                                           const heapdump_client_SnapshotElement *e) {
  pb_ostream_t out = pb_ostream_from_buffer(w->element, sizeof w->element);
  if (!pb_encode(&out, heapdump_client_SnapshotElement_fields, e)) return HD_ERR_ENCODE;
  hd_status status = make_room(w, delimited_size(out.bytes_written));
  if (status != HD_OK) return status;
  memcpy(begin_element(w, out.bytes_written), w->element, out.bytes_written);
  return HD_OK;
}

/* ---- Allocation: one per live block, so written directly (the bytes nanopb would write) ---- */

static size_t allocation_size(const heapdump_client_Allocation *a) {
  size_t n = 0;
  if (a->has_address) n += 1 + varint_size(a->address);
  if (a->has_size) n += 1 + varint_size(a->size);
  if (a->has_stack_trace_key) n += 1 + varint_size(a->stack_trace_key);
  if (a->has_timestamp) n += 1 + varint_size((uint64_t)a->timestamp);
  if (a->has_thread_info_key) n += 1 + varint_size(a->thread_info_key);
  if (a->has_count) n += 1 + varint_size(a->count);
  return n;
}

static uint8_t *put_varint_field(uint8_t *p, uint8_t field, uint64_t value) {
  *p++ = KEY(field, PB_WT_VARINT);
  return put_varint(p, value);
}

hd_status hd_batch_add_allocation(hd_batch_writer *w, const heapdump_client_Allocation *a) {
  size_t body = allocation_size(a);
  size_t element = delimited_size(body);
  hd_status status = make_room(w, delimited_size(element));
  if (status != HD_OK) return status;
  uint8_t *p = begin_element(w, element);
  *p++ = KEY(heapdump_client_SnapshotElement_allocation_tag, PB_WT_STRING);
  p = put_varint(p, body);
  if (a->has_address) p = put_varint_field(p, heapdump_client_Allocation_address_tag, a->address);
  if (a->has_size) p = put_varint_field(p, heapdump_client_Allocation_size_tag, a->size);
  if (a->has_stack_trace_key) {
    p = put_varint_field(p, heapdump_client_Allocation_stack_trace_key_tag, a->stack_trace_key);
  }
  if (a->has_timestamp) {
    p = put_varint_field(p, heapdump_client_Allocation_timestamp_tag, (uint64_t)a->timestamp);
  }
  if (a->has_thread_info_key) {
    p = put_varint_field(p, heapdump_client_Allocation_thread_info_key_tag, a->thread_info_key);
  }
  if (a->has_count) put_varint_field(p, heapdump_client_Allocation_count_tag, a->count);
  return HD_OK;
}

hd_status hd_batch_add(hd_batch_writer *w, const heapdump_client_SnapshotElement *e) {
  /* Chunked variants have their own entry points that bound their payloads. */
  if (e->which_element == heapdump_client_SnapshotElement_stack_trace_tag ||
      e->which_element == heapdump_client_SnapshotElement_block_contents_tag ||
      e->which_element == heapdump_client_SnapshotElement_root_region_tag) {
    return HD_ERR_INVALID_ARGS;
  }
  if (e->which_element == heapdump_client_SnapshotElement_allocation_tag) {
    return hd_batch_add_allocation(w, &e->element.allocation);
  }
  return add_encoded(w, e);
}

/* ---- stack traces: split by address count ---- */

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

/* Room left in the current batch for a chunk's payload, given the encoded size of the element
 * without payload: the element's own length prefixes may grow, and the payload brings a key and a
 * length. Zero if not even that overhead fits. */
static size_t payload_room(const hd_batch_writer *w, size_t empty_element_size) {
  size_t overhead = 1 + MAX_LENGTH_VARINT + empty_element_size + 2 * (MAX_LENGTH_VARINT - 1) + 1 +
                    MAX_LENGTH_VARINT;
  size_t free_bytes = HD_BATCH_CAPACITY - w->used;
  return free_bytes > overhead ? free_bytes - overhead : 0;
}

/* Writes element e (of encoded size empty_size without its payload) as chunks carrying all of
 * its `total` payload items: fit(ctx, done, room) points e's payload at the items from `done` on
 * that fit in `room` bytes, and says how many. A chunk of nothing is written only when there is
 * nothing to write; otherwise a full batch is sent first. */
static HD_MUST_CHECK hd_status add_chunked(hd_batch_writer *w,
                                           const heapdump_client_SnapshotElement *e,
                                           size_t empty_size, size_t total,
                                           size_t (*fit)(void *ctx, size_t done, size_t room),
                                           void *ctx) {
  size_t done = 0;
  do {
    size_t n = fit(ctx, done, payload_room(w, empty_size));
    if (n == 0 && total > 0) {
      if (w->element_count == 0) return HD_ERR_ENCODE;
      hd_status status = hd_batch_flush(w);
      if (status != HD_OK) return status;
      continue;
    }
    hd_status status = add_encoded(w, e);
    if (status != HD_OK) return status;
    done += n;
  } while (done < total);
  return HD_OK;
}

typedef struct address_chunk {
  const uint64_t *all;
  size_t total;
  u64_slice slice;
} address_chunk;

static size_t fit_addresses(void *ctx, size_t done, size_t room) {
  address_chunk *c = ctx;
  size_t n = 0, payload = 0;
  while (done + n < c->total && payload + varint_size(c->all[done + n]) <= room) {
    payload += varint_size(c->all[done + n]);
    n++;
  }
  c->slice.values = c->total > 0 ? c->all + done : c->all; /* no arithmetic on NULL */
  c->slice.count = n;
  return n;
}

hd_status hd_batch_add_stack_trace(hd_batch_writer *w, uint64_t key, const uint64_t *addresses,
                                   size_t count, bool truncated) {
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_stack_trace_tag;
  e.element.stack_trace.has_stack_trace_key = true;
  e.element.stack_trace.stack_trace_key = key;
  e.element.stack_trace.has_truncated = truncated;
  e.element.stack_trace.truncated = truncated;
  address_chunk chunk = {addresses, count, {addresses, 0}};
  e.element.stack_trace.program_addresses.funcs.encode = encode_packed_u64;
  e.element.stack_trace.program_addresses.arg = &chunk.slice;
  size_t empty_size;
  if (!pb_get_encoded_size(&empty_size, heapdump_client_SnapshotElement_fields, &e)) {
    return HD_ERR_ENCODE;
  }
  return add_chunked(w, &e, empty_size, count, fit_addresses, &chunk);
}

/* ---- block contents: one per live block with contents, so written directly; split by bytes ----
 */

/* BlockContents {address, contents} of n bytes, in its SnapshotElement variant. */
static size_t block_contents_size(uint64_t address, size_t n) {
  return 1 + varint_size(address) + delimited_size(n);
}

static size_t block_contents_total(uint64_t address, size_t n) {
  return delimited_size(delimited_size(block_contents_size(address, n)));
}

/* The most of `left` bytes a chunk can carry in `room` bytes of batch. */
static size_t contents_chunk(uint64_t address, size_t left, size_t room) {
  /* Start from the bound where every length takes its longest varint, then take back the bytes
   * that overestimated: at most two per length, so a few steps. */
  size_t overhead = block_contents_total(address, 0) + 3 * (MAX_LENGTH_VARINT - 1);
  size_t n = room > overhead ? room - overhead : 0;
  if (n > left) n = left;
  while (n < left && block_contents_total(address, n + 1) <= room) n++;
  return n;
}

hd_status hd_batch_add_executable_region(hd_batch_writer *w, uint64_t address, uint64_t size,
                                         uint64_t file_offset, uint64_t vaddr,
                                         const uint8_t *build_id, size_t build_id_size,
                                         const char *name) {
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_executable_region_tag;
  heapdump_client_ExecutableRegion *r = &e.element.executable_region;
  if (build_id_size > sizeof r->build_id.value.bytes) return HD_ERR_INVALID_ARGS;
  r->has_address = r->has_size = r->has_file_offset = r->has_vaddr = r->has_name = true;
  r->address = address;
  r->size = size;
  r->file_offset = file_offset;
  r->vaddr = vaddr;
  r->has_build_id = build_id_size > 0;
  r->build_id.value.size = (pb_size_t)build_id_size;
  if (build_id_size > 0) memcpy(r->build_id.value.bytes, build_id, build_id_size);
  snprintf(r->name, sizeof r->name, "%s", name);
  return hd_batch_add(w, &e);
}

hd_status hd_batch_add_block_contents(hd_batch_writer *w, uint64_t address, const uint8_t *bytes,
                                      size_t size) {
  size_t done = 0;
  do {
    size_t room = HD_BATCH_CAPACITY - w->used;
    size_t n = contents_chunk(address, size - done, room);
    /* Flush rather than write a chunk of nothing, unless the block is empty. */
    if ((n == 0 && size > 0) || block_contents_total(address, n) > room) {
      if (w->element_count == 0) return HD_ERR_ENCODE;
      hd_status status = hd_batch_flush(w);
      if (status != HD_OK) return status;
      continue;
    }
    size_t inner = block_contents_size(address, n);
    uint8_t *p = begin_element(w, delimited_size(inner));
    *p++ = KEY(heapdump_client_SnapshotElement_block_contents_tag, PB_WT_STRING);
    p = put_varint(p, inner);
    p = put_varint_field(p, heapdump_client_BlockContents_address_tag, address);
    *p++ = KEY(heapdump_client_BlockContents_contents_tag, PB_WT_STRING);
    p = put_varint(p, n);
    if (n > 0) memcpy(p, bytes + done, n);
    done += n;
  } while (done < size);
  return HD_OK;
}

/* ---- root regions: few, so encoded by nanopb; split by bytes like stack traces ---- */

typedef struct byte_slice {
  const uint8_t *bytes;
  size_t size;
} byte_slice;

static bool encode_chunk(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  const byte_slice *chunk = *arg;
  return pb_encode_tag_for_field(stream, field) &&
         pb_encode_string(stream, chunk->bytes, chunk->size);
}

typedef struct byte_chunk {
  const uint8_t *all;
  size_t total;
  byte_slice slice;
} byte_chunk;

static size_t fit_bytes(void *ctx, size_t done, size_t room) {
  byte_chunk *c = ctx;
  size_t n = c->total - done < room ? c->total - done : room;
  c->slice.bytes = c->total > 0 ? c->all + done : c->all; /* no arithmetic on NULL */
  c->slice.size = n;
  return n;
}

hd_status hd_batch_add_root_region(hd_batch_writer *w, const heapdump_client_RootRegion *region,
                                   const uint8_t *bytes, size_t size) {
  heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
  e.which_element = heapdump_client_SnapshotElement_root_region_tag;
  e.element.root_region = *region;
  e.element.root_region.contents.funcs.encode = NULL;
  size_t empty_size;
  if (!pb_get_encoded_size(&empty_size, heapdump_client_SnapshotElement_fields, &e)) {
    return HD_ERR_ENCODE;
  }
  byte_chunk chunk = {bytes, size, {bytes, 0}};
  e.element.root_region.contents.funcs.encode = encode_chunk;
  e.element.root_region.contents.arg = &chunk.slice;
  return add_chunked(w, &e, empty_size, size, fit_bytes, &chunk);
}

/* ---- the channel sender ---- */

static bool encode_raw_body(pb_ostream_t *stream, const pb_field_t *field, void *const *arg) {
  (void)field;
  const byte_slice *body = *arg;
  return pb_write(stream, body->bytes, body->size);
}

void hd_batch_channel_init(hd_batch_channel *ch, int channel, hd_message *scratch) {
  ch->channel = channel;
  ch->scratch = scratch;
  ch->unanswered_count = 0;
}

/* Receives one answer, which must be to one of the unanswered calls. */
static HD_MUST_CHECK hd_status receive_answer(hd_batch_channel *ch) {
  hd_message *msg = ch->scratch;
  hd_status status = hd_message_recv(ch->channel, msg);
  if (status != HD_OK) return status;
  size_t i = 0;
  while (i < ch->unanswered_count && ch->unanswered[i] != msg->txid) i++;
  if (!(msg->flags & HD_FLAG_RESPONSE) || msg->ordinal != HD_ORDINAL_SNAPSHOT_RECEIVER_BATCH ||
      i == ch->unanswered_count) {
    hd_message_close_fds(msg);
    return HD_ERR_UNEXPECTED_MESSAGE;
  }
  heapdump_client_Empty answer = heapdump_client_Empty_init_zero;
  status = hd_message_decode_body(msg, heapdump_client_Empty_fields, &answer);
  if (status != HD_OK) return status;
  ch->unanswered[i] = ch->unanswered[--ch->unanswered_count];
  return HD_OK;
}

hd_status hd_batch_channel_drain(hd_batch_channel *ch) {
  while (ch->unanswered_count > 0) {
    hd_status status = receive_answer(ch);
    if (status != HD_OK) return status;
  }
  return HD_OK;
}

hd_status hd_batch_send_on_channel(void *hd_batch_channel_ctx, const uint8_t *body, size_t size) {
  hd_batch_channel *ch = hd_batch_channel_ctx;
  if (ch->unanswered_count == HD_BATCH_WINDOW) {
    hd_status status = receive_answer(ch);
    if (status != HD_OK) return status;
  }
  heapdump_client_SnapshotReceiverBatchRequest request =
      heapdump_client_SnapshotReceiverBatchRequest_init_zero;
  byte_slice slice = {body, size};
  request.batch.funcs.encode = encode_raw_body;
  request.batch.arg = &slice;
  uint32_t txid = hd_next_txid();
  hd_status status =
      hd_message_encode(ch->scratch, txid, 0, HD_ORDINAL_SNAPSHOT_RECEIVER_BATCH,
                        heapdump_client_SnapshotReceiverBatchRequest_fields, &request, 0);
  if (status == HD_OK) status = hd_message_send(ch->channel, ch->scratch, NULL, 0);
  if (status != HD_OK) return status;
  ch->unanswered[ch->unanswered_count++] = txid;
  return size == 0 ? hd_batch_channel_drain(ch) : HD_OK;
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
  } else if (field->tag == heapdump_client_SnapshotElement_root_region_tag) {
    heapdump_client_RootRegion *root = field->pData;
    root->contents.funcs.decode = decode_contents;
    root->contents.arg = r;
  }
  return true;
}

/* A varint of at most ten bytes whose value fits 64 bits. False for anything else, which is left
 * to nanopb to refuse. */
static bool read_varint(const uint8_t *p, size_t end, size_t *pos, uint64_t *value) {
  uint64_t v = 0;
  for (unsigned shift = 0; shift < 64 && *pos < end; shift += 7) {
    uint8_t byte = p[(*pos)++];
    if (shift == 63 && byte > 1) return false;
    v |= (uint64_t)(byte & 0x7f) << shift;
    if (!(byte & 0x80)) {
      *value = v;
      return true;
    }
  }
  return false;
}

/* The body of the only variant of a SnapshotElement: [*begin, end) once the key matched. */
static bool only_variant(const uint8_t *p, size_t size, uint8_t key, size_t *begin) {
  uint64_t length;
  *begin = 1;
  return size > 0 && p[0] == key && read_varint(p, size, begin, &length) && length == size - *begin;
}

static bool decode_allocation(const uint8_t *p, size_t size, heapdump_client_Allocation *a) {
  size_t pos;
  if (!only_variant(p, size, KEY(heapdump_client_SnapshotElement_allocation_tag, PB_WT_STRING),
                    &pos)) {
    return false;
  }
  *a = (heapdump_client_Allocation)heapdump_client_Allocation_init_zero;
  while (pos < size) {
    uint8_t key = p[pos++];
    uint64_t v;
    if (!read_varint(p, size, &pos, &v)) return false;
    switch (key) {
      case KEY(heapdump_client_Allocation_address_tag, PB_WT_VARINT):
        a->has_address = true;
        a->address = v;
        break;
      case KEY(heapdump_client_Allocation_size_tag, PB_WT_VARINT):
        a->has_size = true;
        a->size = v;
        break;
      case KEY(heapdump_client_Allocation_stack_trace_key_tag, PB_WT_VARINT):
        a->has_stack_trace_key = true;
        a->stack_trace_key = v;
        break;
      case KEY(heapdump_client_Allocation_timestamp_tag, PB_WT_VARINT):
        a->has_timestamp = true;
        a->timestamp = (int64_t)v;
        break;
      case KEY(heapdump_client_Allocation_thread_info_key_tag, PB_WT_VARINT):
        a->has_thread_info_key = true;
        a->thread_info_key = v;
        break;
      case KEY(heapdump_client_Allocation_count_tag, PB_WT_VARINT):
        a->has_count = true;
        a->count = v;
        break;
      default: return false;
    }
  }
  return true;
}

/* BlockContents with at most one contents field, which e then points to inside p. */
static bool decode_block_contents(const uint8_t *p, size_t size, hd_element *e,
                                  heapdump_client_BlockContents *b) {
  size_t pos;
  if (!only_variant(p, size, KEY(heapdump_client_SnapshotElement_block_contents_tag, PB_WT_STRING),
                    &pos)) {
    return false;
  }
  *b = (heapdump_client_BlockContents)heapdump_client_BlockContents_init_zero;
  bool has_contents = false;
  while (pos < size) {
    uint8_t key = p[pos++];
    uint64_t v;
    if (!read_varint(p, size, &pos, &v)) return false;
    if (key == KEY(heapdump_client_BlockContents_address_tag, PB_WT_VARINT)) {
      b->has_address = true;
      b->address = v;
    } else if (key == KEY(heapdump_client_BlockContents_contents_tag, PB_WT_STRING) &&
               !has_contents && v <= size - pos) {
      has_contents = true;
      e->contents = p + pos;
      e->contents_size = (size_t)v;
      pos += (size_t)v;
    } else {
      return false;
    }
  }
  return true;
}

/* The elements a snapshot holds one of per block, in the form writers produce them, decoded
 * without nanopb's walk of the field descriptors; false for anything else (another variant,
 * unknown fields, odd encodings), which nanopb then decodes or refuses. */
static bool decode_per_block(hd_batch_reader *r, const uint8_t *p, size_t size, hd_element *e) {
  heapdump_client_SnapshotElement *element = &r->per_block;
  if (decode_allocation(p, size, &element->element.allocation)) {
    element->which_element = heapdump_client_SnapshotElement_allocation_tag;
  } else if (decode_block_contents(p, size, e, &element->element.block_contents)) {
    element->which_element = heapdump_client_SnapshotElement_block_contents_tag;
  } else {
    return false;
  }
  e->element = element;
  return true;
}

static HD_MUST_CHECK hd_status deliver(hd_batch_reader *r, const hd_element *e) {
  r->element_count++;
  hd_status status = r->on_element(r->ctx, e);
  if (status != HD_OK) r->status = status;
  return status;
}

static bool decode_with_nanopb(pb_istream_t *outer, hd_batch_reader *r, size_t size) {
  heapdump_client_SnapshotElement element = heapdump_client_SnapshotElement_init_zero;
  element.cb_element.funcs.decode = prepare_variant;
  element.cb_element.arg = r;
  r->address_count = 0;
  r->contents_size = 0;
  pb_istream_t in = pb_istream_from_buffer(r->element_bytes, size);
  if (!pb_decode(&in, heapdump_client_SnapshotElement_fields, &element)) {
    PB_RETURN_ERROR(outer, PB_GET_ERROR(&in));
  }
  hd_element e = {.element = &element};
  if (element.which_element == heapdump_client_SnapshotElement_stack_trace_tag) {
    e.addresses = r->addresses;
    e.address_count = r->address_count;
  } else if (element.which_element == heapdump_client_SnapshotElement_block_contents_tag ||
             element.which_element == heapdump_client_SnapshotElement_root_region_tag) {
    e.contents = r->contents;
    e.contents_size = r->contents_size;
  }
  return deliver(r, &e) == HD_OK;
}

static bool decode_element(pb_istream_t *stream, const pb_field_t *field, void **arg) {
  (void)field;
  hd_batch_reader *r = *arg;
  size_t size = stream->bytes_left;
  if (size > sizeof r->element_bytes) PB_RETURN_ERROR(stream, "element too long");
  if (!pb_read(stream, r->element_bytes, size)) return false;
  hd_element e = {0};
  if (decode_per_block(r, r->element_bytes, size, &e)) return deliver(r, &e) == HD_OK;
  return decode_with_nanopb(stream, r, size);
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
