/* Descriptions of hd_status values. */
#include "heapdump/fidl/status.h"

const char *hd_status_str(hd_status status) {
  switch (status) {
    case HD_OK: return "ok";
    case HD_ERR_IO: return "socket I/O failed";
    case HD_ERR_PEER_CLOSED: return "peer closed the channel";
    case HD_ERR_TRUNCATED_HEADER: return "message shorter than the transaction header";
    case HD_ERR_BAD_MAGIC: return "bad wire-format magic in the transaction header";
    case HD_ERR_UNKNOWN_ORDINAL: return "unknown method ordinal";
    case HD_ERR_TOO_LARGE: return "message over the size limit";
    case HD_ERR_TOO_MANY_FDS: return "too many file descriptors in one message";
    case HD_ERR_DECODE: return "malformed message body";
    case HD_ERR_MISSING_FD: return "a required handle is missing";
    case HD_ERR_UNEXPECTED_FD: return "unexpected file descriptors in the message";
    case HD_ERR_ENCODE: return "message body could not be encoded";
    case HD_ERR_UNEXPECTED_MESSAGE: return "unexpected message";
    case HD_ERR_INVALID_ARGS: return "invalid arguments";
    case HD_ERR_REASSEMBLY: return "snapshot stream is inconsistent";
    case HD_ERR_NO_MEMORY: return "out of memory";
    case HD_ERR_CANCELED: return "canceled";
    case HD_ERR_TIMED_OUT: return "timed out";
  }
  return "unknown status";
}
