/* Channels: AF_UNIX SOCK_SEQPACKET sockets carrying framed messages of at most
 * HD_MAX_MESSAGE_BYTES with up to HD_MAX_MESSAGE_FDS file descriptors (SCM_RIGHTS). A message is
 * one datagram, so framing is kept by the kernel; descriptors travel with the bytes they belong to.
 * All descriptors are created close-on-exec. */
#ifndef HEAPDUMP_FIDL_CHANNEL_H
#define HEAPDUMP_FIDL_CHANNEL_H

#include <stddef.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The Zircon channel limit, kept so that a message fits any Fuchsia-shaped peer. */
#define HD_MAX_MESSAGE_BYTES 65536u
/* Descriptors per message (Zircon allows 64 handles). */
#define HD_MAX_MESSAGE_FDS 64u

/* A connected pair of channel ends, for passing one end to a peer. */
HD_MUST_CHECK hd_status hd_channel_pair(int ends[2]);

/* Connects to a listening socket at path. */
HD_MUST_CHECK hd_status hd_channel_connect(const char *path, int *out_fd);

/* As hd_channel_connect, and every later send and receive on the channel (connect too, when the
 * listener's backlog is full) gives up with HD_ERR_TIMED_OUT after `seconds` without progress;
 * 0 waits forever. */
HD_MUST_CHECK hd_status hd_channel_connect_timeout(const char *path, double seconds, int *out_fd);

/* Makes sends and receives on fd give up with HD_ERR_TIMED_OUT after `seconds` without
 * progress (0: wait forever). */
HD_MUST_CHECK hd_status hd_channel_set_timeout(int fd, double seconds);

/* Binds and listens at path (removing a stale socket file first). */
HD_MUST_CHECK hd_status hd_channel_listen(const char *path, int backlog, int *out_fd);

/* Sends one message. fds are borrowed: the caller still owns (and closes) them. */
HD_MUST_CHECK hd_status hd_channel_send(int fd, const void *bytes, size_t size, const int *fds,
                                        size_t fd_count);

/* Receives one message into bytes[capacity] and up to max_fds descriptors. Never leaks a
 * descriptor: on any error every descriptor that arrived is closed and *fd_count is 0.
 * A message larger than capacity gives HD_ERR_TOO_LARGE, more descriptors than max_fds
 * HD_ERR_TOO_MANY_FDS, an orderly shutdown of the peer HD_ERR_PEER_CLOSED, nothing within the
 * channel's timeout (at once on a non-blocking socket) HD_ERR_TIMED_OUT. */
HD_MUST_CHECK hd_status hd_channel_recv(int fd, void *bytes, size_t capacity, size_t *size,
                                        int *fds, size_t max_fds, size_t *fd_count);

#ifdef __cplusplus
}
#endif
#endif
