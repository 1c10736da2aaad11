/* Descriptors the library holds inside a program that owns the descriptor table. A daemon may
 * call close_range(3, ~0U, 0) after start and open its own files, which then get the numbers
 * the library held: closing, sending or writing "our" number would hit the program's file. So
 * each descriptor is moved to a high number (out of the range programs hand out first) and
 * remembered by device and inode; it is used, sent or closed only while they still match. */
#ifndef HEAPDUMP_INSTRUMENTATION_OWNED_FD_H
#define HEAPDUMP_INSTRUMENTATION_OWNED_FD_H

#include <stdbool.h>
#include <sys/types.h>
#include "heapdump/contract/must_check.h"

typedef struct hd_owned_fd {
  int fd; /* -1: none */
  dev_t dev;
  ino_t ino;
} hd_owned_fd;

#define HD_OWNED_FD_NONE ((hd_owned_fd){.fd = -1})

/* Moves a descriptor the library just created to a high number (close-on-exec), closing the
 * original; returns the new number, or fd itself if no high number is free. */
HD_MUST_CHECK int hd_fd_move_high(int fd);

/* Takes over a descriptor the library just created: moves it to a high number (close-on-exec)
 * and records its identity. Returns false, closing fd, if it cannot be identified. */
bool hd_owned_fd_take(int fd, hd_owned_fd *out);

/* True while out->fd still names the file it was taken for. */
bool hd_owned_fd_valid(const hd_owned_fd *owned);

/* Closes the descriptor if it is still ours, and forgets it either way. */
void hd_owned_fd_close(hd_owned_fd *owned);

#endif
