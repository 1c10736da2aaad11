/* Status codes of the fidl/ layer: every fallible function returns an hd_status and is marked
 * HD_MUST_CHECK, so a caller cannot drop an error silently. HD_OK is zero. */
#ifndef HEAPDUMP_FIDL_STATUS_H
#define HEAPDUMP_FIDL_STATUS_H

#include "heapdump/contract/must_check.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum hd_status {
  HD_OK = 0,
  HD_ERR_IO,                 /* a socket call failed (errno is preserved) */
  HD_ERR_PEER_CLOSED,        /* the other end closed the channel */
  HD_ERR_TRUNCATED_HEADER,   /* shorter than the 16-byte transaction header */
  HD_ERR_BAD_MAGIC,          /* the header's wire-format magic is not ours */
  HD_ERR_UNKNOWN_ORDINAL,    /* no method of the protocol has this ordinal */
  HD_ERR_TOO_LARGE,          /* over HD_MAX_MESSAGE_BYTES (the message was discarded) */
  HD_ERR_TOO_MANY_FDS,       /* over HD_MAX_MESSAGE_FDS (all received fds were closed) */
  HD_ERR_DECODE,             /* malformed body: bad varint, wrong wire type, over a bound... */
  HD_ERR_MISSING_FD,         /* a required handle field or its descriptor is missing */
  HD_ERR_UNEXPECTED_FD,      /* descriptors no handle field refers to (they were closed) */
  HD_ERR_ENCODE,             /* the body could not be encoded (over a bound or the limit) */
  HD_ERR_UNEXPECTED_MESSAGE, /* a response where a request was due, wrong txid or ordinal */
  HD_ERR_INVALID_ARGS,       /* the caller broke a documented precondition */
  HD_ERR_REASSEMBLY,         /* chunks or references of a snapshot stream do not add up */
  HD_ERR_NO_MEMORY,          /* an allocation failed (receiver side only) */
  HD_ERR_CANCELED,           /* a callback asked to stop */
  HD_ERR_TIMED_OUT,          /* nothing arrived or could be sent within the channel's timeout */
} hd_status;

/* A constant, human-readable description of a status. */
const char *hd_status_str(hd_status status);

#ifdef __cplusplus
}
#endif
#endif
