/* SnapshotReceiver.Batch streaming: a writer that packs SnapshotElements into batches up to the
 * message limit (encoding each element once), splitting stack traces and block contents that
 * would not fit into several elements with the same key / address; a sender that keeps a few
 * batches in flight on a channel; and a reader that decodes a Batch body element by element
 * without building it in memory. */
#ifndef HEAPDUMP_FIDL_BATCH_H
#define HEAPDUMP_FIDL_BATCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/message.h"
#include "heapdump/fidl/status.h"
#include "heapdump_client.pb.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A Batch body is the concatenation of its encoded elements, so it may use the whole body. */
#define HD_BATCH_CAPACITY HD_MAX_BODY_BYTES

/* Sends one batch body (size 0 = the empty batch). The body is only borrowed for the call. */
typedef hd_status (*hd_batch_send_fn)(void *ctx, const uint8_t *body, size_t size);

typedef struct hd_batch_writer {
  hd_batch_send_fn send;
  void *ctx;
  size_t used;           /* bytes of buf holding encoded elements */
  size_t element_count;  /* elements in buf */
  uint64_t batches_sent; /* including empty ones */
  uint8_t buf[HD_BATCH_CAPACITY];
  /* An element nanopb encoded, held until its size tells whether it still fits in buf. */
  uint8_t element[HD_BATCH_CAPACITY];
} hd_batch_writer;

void hd_batch_writer_init(hd_batch_writer *w, hd_batch_send_fn send, void *ctx);

/* Appends an element whose size is bounded by the IDL (allocation, thread info, executable
 * region, snapshot header), flushing first if it would not fit. */
HD_MUST_CHECK hd_status hd_batch_add(hd_batch_writer *w, const heapdump_client_SnapshotElement *e);
/* Appends an allocation: what hd_batch_add does for one, without a SnapshotElement to fill. */
HD_MUST_CHECK hd_status hd_batch_add_allocation(hd_batch_writer *w,
                                                const heapdump_client_Allocation *allocation);
/* Appends a stack trace, split into several elements with the same key if needed (each marked
 * truncated when it is). */
HD_MUST_CHECK hd_status hd_batch_add_stack_trace(hd_batch_writer *w, uint64_t key,
                                                 const uint64_t *addresses, size_t count,
                                                 bool truncated);
/* Appends an executable region (a build ID longer than the IDL allows is HD_ERR_INVALID_ARGS;
 * a name longer than it allows is cut). */
HD_MUST_CHECK hd_status hd_batch_add_executable_region(hd_batch_writer *w, uint64_t address,
                                                       uint64_t size, uint64_t file_offset,
                                                       uint64_t vaddr, const uint8_t *build_id,
                                                       size_t build_id_size, const char *name);
/* Appends a block's contents, split into several elements with the same address if needed. */
HD_MUST_CHECK hd_status hd_batch_add_block_contents(hd_batch_writer *w, uint64_t address,
                                                    const uint8_t *bytes, size_t size);
/* Appends a root region with its bytes, split into several elements with the same address (and
 * the same other fields) if needed. region's contents field is ignored. */
HD_MUST_CHECK hd_status hd_batch_add_root_region(hd_batch_writer *w,
                                                 const heapdump_client_RootRegion *region,
                                                 const uint8_t *bytes, size_t size);
/* Sends the pending elements, if any, then body as one batch: a batch body produced earlier by a
 * writer (e.g. stored on disk). HD_ERR_INVALID_ARGS if it is over HD_BATCH_CAPACITY. */
HD_MUST_CHECK hd_status hd_batch_forward(hd_batch_writer *w, const uint8_t *body, size_t size);
/* Sends the pending elements, if any. */
HD_MUST_CHECK hd_status hd_batch_flush(hd_batch_writer *w);
/* Sends the pending elements, if any, then an empty batch. */
HD_MUST_CHECK hd_status hd_batch_end(hd_batch_writer *w);

/* Batch calls a channel sender leaves unanswered at most. The protocol acknowledges each batch
 * before the next is sent (docs/wire-protocol.md), as the original collector does; measured, a
 * window of 4 saved about 15% of a 10^6-block snapshot on 2 cores, not enough to change the
 * protocol's flow control for. The sender is written for any window. */
#define HD_BATCH_WINDOW 1u

/* A sender for hd_batch_writer that calls SnapshotReceiver.Batch on a channel. */
typedef struct hd_batch_channel {
  int channel;
  hd_message *scratch;
  uint32_t unanswered[HD_BATCH_WINDOW]; /* txids of the calls sent and not yet answered */
  size_t unanswered_count;
} hd_batch_channel;

void hd_batch_channel_init(hd_batch_channel *ch, int channel, hd_message *scratch);
/* An hd_batch_send_fn: sends the batch without waiting for its answer, after waiting for one
 * answer if HD_BATCH_WINDOW calls are unanswered. An empty batch (the end of a stream, or of one
 * process's snapshot) returns once every batch sent has been answered. Answers may come in any
 * order; anything else on the channel is HD_ERR_UNEXPECTED_MESSAGE. */
HD_MUST_CHECK hd_status hd_batch_send_on_channel(void *hd_batch_channel_ctx, const uint8_t *body,
                                                 size_t size);
/* Waits for the answers to every batch sent: before another call on the channel or closing it. */
HD_MUST_CHECK hd_status hd_batch_channel_drain(hd_batch_channel *ch);

/* One decoded element. Stack trace addresses and block bytes live in the reader's buffers and
 * are valid only during the callback. */
typedef struct hd_element {
  const heapdump_client_SnapshotElement *element; /* which_element 0: unknown variant */
  const uint64_t *addresses;                      /* stack_trace only */
  size_t address_count;
  const uint8_t *contents; /* block_contents and root_region only */
  size_t contents_size;
} hd_element;

typedef hd_status (*hd_element_fn)(void *ctx, const hd_element *e);

/* Upper bounds that follow from the body limit: a varint is at least one byte. */
#define HD_READER_MAX_ADDRESSES HD_BATCH_CAPACITY
#define HD_READER_MAX_CONTENTS HD_BATCH_CAPACITY

typedef struct hd_batch_reader {
  hd_element_fn on_element;
  void *ctx;
  hd_status status;     /* first error from on_element or a bound */
  size_t element_count; /* elements in the last decoded batch */
  size_t address_count;
  size_t contents_size;
  uint64_t addresses[HD_READER_MAX_ADDRESSES];
  uint8_t contents[HD_READER_MAX_CONTENTS];
  uint8_t element_bytes[HD_BATCH_CAPACITY]; /* the element being decoded */
  /* Allocations and block contents, one per block, are decoded into this without nanopb; only
   * which_element and that variant are written. */
  heapdump_client_SnapshotElement per_block;
} hd_batch_reader;

void hd_batch_reader_init(hd_batch_reader *r, hd_element_fn on_element, void *ctx);
/* Installs the decode callbacks into a Batch request (use as a *_prepare hook's body). */
void hd_batch_reader_prepare(hd_batch_reader *r, heapdump_client_SnapshotReceiverBatchRequest *req);
/* Decodes a Batch request body from a received message, calling on_element per element. */
HD_MUST_CHECK hd_status hd_batch_reader_decode(hd_batch_reader *r, hd_message *msg);

#ifdef __cplusplus
}
#endif
#endif
