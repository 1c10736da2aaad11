/* Messages: a 16-byte little-endian transaction header followed by a nanopb-encoded body, plus the
 * descriptors that travelled with it.
 *
 *   offset 0  u32 txid      0 for one-way messages; two-way replies repeat the request's txid
 *   offset 4  u8  flags[3]  flags[0] bit 0: this is a response; all other bits zero
 *   offset 7  u8  magic     HD_WIRE_MAGIC, the wire-format version
 *   offset 8  u64 ordinal   the method (see the Ordinal enums of the IDL)
 *
 * Handle fields of a body hold indexes into the descriptor list. Decoding checks that every handle
 * field is present, that each refers to a distinct received descriptor, and that no descriptor is
 * left unreferenced; on failure every received descriptor is closed. Descriptors a handler does
 * not take with hd_message_take_fd are closed by hd_message_close_fds. */
#ifndef HEAPDUMP_FIDL_MESSAGE_H
#define HEAPDUMP_FIDL_MESSAGE_H

#include <pb.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/channel.h"
#include "heapdump/fidl/status.h"
#include "heapdump_client.pb.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HD_HEADER_BYTES 16u
#define HD_WIRE_MAGIC 0x01u
#define HD_FLAG_RESPONSE 0x01u
/* Largest body: the message limit less the header. */
#define HD_MAX_BODY_BYTES (HD_MAX_MESSAGE_BYTES - HD_HEADER_BYTES)

typedef struct hd_message {
  uint32_t txid;
  uint8_t flags;
  uint64_t ordinal;
  size_t size; /* header + body bytes */
  size_t fd_count;
  int fds[HD_MAX_MESSAGE_FDS]; /* -1 once taken */
  uint8_t bytes[HD_MAX_MESSAGE_BYTES];
} hd_message;

/* Empties a message (it owns no descriptor afterwards). */
void hd_message_init(hd_message *msg);

/* Parses the header of msg->bytes[0..size). On error the descriptors are closed. */
HD_MUST_CHECK hd_status hd_message_parse_header(hd_message *msg);

/* Receives one message and parses its header. */
HD_MUST_CHECK hd_status hd_message_recv(int channel, hd_message *msg);

/* Encodes header and body. fds are borrowed and only checked against the body's handle fields:
 * every handle field present with index < fd_count, each index used once, every fd used. */
HD_MUST_CHECK hd_status hd_message_encode(hd_message *msg, uint32_t txid, uint8_t flags,
                                          uint64_t ordinal, const pb_msgdesc_t *desc,
                                          const void *body, size_t fd_count);

/* Sends an encoded message with fds (borrowed). */
HD_MUST_CHECK hd_status hd_message_send(int channel, const hd_message *msg, const int *fds,
                                        size_t fd_count);

/* Decodes the body into body (which the caller may have prepared with decode callbacks) and
 * validates the handles against the received descriptors. */
HD_MUST_CHECK hd_status hd_message_decode_body(hd_message *msg, const pb_msgdesc_t *desc,
                                               void *body);

/* Takes ownership of the descriptor a decoded handle refers to; -1 if already taken. */
HD_MUST_CHECK int hd_message_take_fd(hd_message *msg, const heapdump_client_Handle *handle);

/* Like hd_message_take_fd, for a handle that must be a channel end (an AF_UNIX SOCK_SEQPACKET
 * socket): any other descriptor is closed and -1 returned. Only a channel tells its holder that
 * the peer closed (a datagram socket's close goes unnoticed: it would be held forever). */
HD_MUST_CHECK int hd_message_take_channel(hd_message *msg, const heapdump_client_Handle *handle);

/* Closes every descriptor not taken. */
void hd_message_close_fds(hd_message *msg);

/* Sends a request of a two-way method and waits for its reply, which replaces the request in msg
 * (its header parsed, its body not yet decoded). Messages with another txid are refused. */
HD_MUST_CHECK hd_status hd_message_call(int channel, hd_message *msg, const int *fds,
                                        size_t fd_count);

/* The second half of hd_message_call, for a caller that sends the request itself because it must
 * know whether it left: a request the peer received must not be sent again. */
HD_MUST_CHECK hd_status hd_message_await_reply(int channel, hd_message *msg, uint32_t txid,
                                               uint64_t ordinal);

/* Transaction ids for two-way calls: never 0, distinct per process. */
uint32_t hd_next_txid(void);

#ifdef __cplusplus
}
#endif
#endif
