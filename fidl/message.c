/* Transaction header framing, body encoding through nanopb, and handle validation. */
#include "heapdump/fidl/message.h"

#include <pb_common.h>
#include <pb_decode.h>
#include <pb_encode.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include "heapdump/contract/must_check.h"

static void put_le32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_le32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static uint64_t get_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

void hd_message_init(hd_message *msg) {
  msg->txid = 0;
  msg->flags = 0;
  msg->ordinal = 0;
  msg->size = 0;
  msg->fd_count = 0;
}

void hd_message_close_fds(hd_message *msg) {
  for (size_t i = 0; i < msg->fd_count; i++) {
    if (msg->fds[i] >= 0) close(msg->fds[i]);
    msg->fds[i] = -1;
  }
  msg->fd_count = 0;
}

hd_status hd_message_parse_header(hd_message *msg) {
  hd_status status = HD_OK;
  if (msg->size < HD_HEADER_BYTES) {
    status = HD_ERR_TRUNCATED_HEADER;
  } else if (msg->bytes[7] != HD_WIRE_MAGIC) {
    status = HD_ERR_BAD_MAGIC;
  } else if ((msg->bytes[4] & ~HD_FLAG_RESPONSE) != 0 || msg->bytes[5] != 0 || msg->bytes[6] != 0) {
    status = HD_ERR_DECODE; /* reserved flag bits must be zero */
  } else {
    msg->txid = get_le32(msg->bytes);
    msg->flags = msg->bytes[4];
    msg->ordinal = get_le64(msg->bytes + 8);
  }
  if (status != HD_OK) hd_message_close_fds(msg);
  return status;
}

hd_status hd_message_recv(int channel, hd_message *msg) {
  hd_message_init(msg);
  hd_status status = hd_channel_recv(channel, msg->bytes, sizeof msg->bytes, &msg->size, msg->fds,
                                     HD_MAX_MESSAGE_FDS, &msg->fd_count);
  if (status != HD_OK) return status;
  return hd_message_parse_header(msg);
}

/* Visits the top-level handle fields of a message body: fields of type heapdump.client.Handle.
 * Returns HD_MISSING_FD for an absent handle or index, HD_ERR_UNEXPECTED_FD/INVALID for a bad
 * index; `used` collects the indexes seen. */
static HD_MUST_CHECK hd_status check_handles(const pb_msgdesc_t *desc, void *body, size_t fd_count,
                                             size_t *handle_count) {
  uint64_t used = 0;
  _Static_assert(HD_MAX_MESSAGE_FDS <= 64, "the used-set is one 64-bit word");
  *handle_count = 0;
  pb_field_iter_t iter;
  if (!pb_field_iter_begin(&iter, desc, body)) return HD_OK; /* no fields */
  do {
    if (iter.submsg_desc != &heapdump_client_Handle_msg) continue;
    if (PB_HTYPE(iter.type) != PB_HTYPE_OPTIONAL) continue;
    const bool *has = (const bool *)iter.pSize;
    const heapdump_client_Handle *handle = (const heapdump_client_Handle *)iter.pData;
    if (has == NULL || !*has || !handle->has_index) return HD_ERR_MISSING_FD;
    if (handle->index >= fd_count) return HD_ERR_MISSING_FD;
    if (used & (UINT64_C(1) << handle->index)) return HD_ERR_DECODE; /* one fd, two handles */
    used |= UINT64_C(1) << handle->index;
    (*handle_count)++;
  } while (pb_field_iter_next(&iter));
  return HD_OK;
}

hd_status hd_message_encode(hd_message *msg, uint32_t txid, uint8_t flags, uint64_t ordinal,
                            const pb_msgdesc_t *desc, const void *body, size_t fd_count) {
  hd_message_init(msg);
  if (fd_count > HD_MAX_MESSAGE_FDS) return HD_ERR_INVALID_ARGS;
  size_t handle_count;
  /* nanopb's iterator takes a non-const pointer; nothing is written through it here. */
  hd_status status = check_handles(desc, (void *)body, fd_count, &handle_count);
  if (status != HD_OK || handle_count != fd_count) return HD_ERR_INVALID_ARGS;
  pb_ostream_t stream = pb_ostream_from_buffer(msg->bytes + HD_HEADER_BYTES, HD_MAX_BODY_BYTES);
  if (!pb_encode(&stream, desc, body)) return HD_ERR_ENCODE;
  put_le32(msg->bytes, txid);
  msg->bytes[4] = flags;
  msg->bytes[5] = 0;
  msg->bytes[6] = 0;
  msg->bytes[7] = HD_WIRE_MAGIC;
  put_le64(msg->bytes + 8, ordinal);
  msg->txid = txid;
  msg->flags = flags;
  msg->ordinal = ordinal;
  msg->size = HD_HEADER_BYTES + stream.bytes_written;
  return HD_OK;
}

hd_status hd_message_send(int channel, const hd_message *msg, const int *fds, size_t fd_count) {
  return hd_channel_send(channel, msg->bytes, msg->size, fds, fd_count);
}

hd_status hd_message_decode_body(hd_message *msg, const pb_msgdesc_t *desc, void *body) {
  hd_status status = HD_OK;
  pb_istream_t stream =
      pb_istream_from_buffer(msg->bytes + HD_HEADER_BYTES, msg->size - HD_HEADER_BYTES);
  size_t handle_count = 0;
  if (!pb_decode(&stream, desc, body)) {
    status = HD_ERR_DECODE;
  } else {
    status = check_handles(desc, body, msg->fd_count, &handle_count);
    if (status == HD_OK && handle_count != msg->fd_count) status = HD_ERR_UNEXPECTED_FD;
  }
  if (status != HD_OK) hd_message_close_fds(msg);
  return status;
}

int hd_message_take_fd(hd_message *msg, const heapdump_client_Handle *handle) {
  if (!handle->has_index || handle->index >= msg->fd_count) return -1;
  int fd = msg->fds[handle->index];
  msg->fds[handle->index] = -1;
  return fd;
}

int hd_message_take_channel(hd_message *msg, const heapdump_client_Handle *handle) {
  int fd = hd_message_take_fd(msg, handle);
  int type = 0, domain = 0;
  socklen_t type_len = sizeof type, domain_len = sizeof domain;
  if (fd >= 0 && (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) != 0 ||
                  getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &domain_len) != 0 ||
                  type != SOCK_SEQPACKET || domain != AF_UNIX)) {
    close(fd);
    return -1;
  }
  return fd;
}

uint32_t hd_next_txid(void) {
  static _Atomic uint32_t counter;
  uint32_t id;
  do {
    id = atomic_fetch_add_explicit(&counter, 1, memory_order_relaxed) + 1;
  } while (id == 0);
  return id;
}

hd_status hd_message_call(int channel, hd_message *msg, const int *fds, size_t fd_count) {
  uint32_t txid = msg->txid;
  uint64_t ordinal = msg->ordinal;
  if (txid == 0) return HD_ERR_INVALID_ARGS;
  hd_status status = hd_message_send(channel, msg, fds, fd_count);
  if (status != HD_OK) return status;
  return hd_message_await_reply(channel, msg, txid, ordinal);
}

hd_status hd_message_await_reply(int channel, hd_message *msg, uint32_t txid, uint64_t ordinal) {
  hd_status status = hd_message_recv(channel, msg);
  if (status != HD_OK) return status;
  if (msg->txid != txid || msg->ordinal != ordinal || !(msg->flags & HD_FLAG_RESPONSE)) {
    hd_message_close_fds(msg);
    return HD_ERR_UNEXPECTED_MESSAGE;
  }
  return HD_OK;
}
