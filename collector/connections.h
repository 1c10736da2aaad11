/* The poll thread's table of connections (private to the collector): what each connection is,
 * which process it serves, and the functions that add, close, accept and serve them.
 *
 * Sync: every field of the table and of its connections belongs to the poll thread alone; the
 * table is allocated by hd_collector_create before that thread starts and closed by
 * hd_collector_destroy after it has been joined. A connection's process reference lets it read
 * only the process's fixed fields (pid, uid, name); the others take hd_collector.lock. */
#ifndef HEAPDUMP_COLLECTOR_CONNECTIONS_H
#define HEAPDUMP_COLLECTOR_CONNECTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "collector_internal.h"

#define HD_MAX_CONNECTIONS 1024

enum conn_kind { CONN_NEW, CONN_REGISTRY, CONN_SINK, CONN_CLIENT, CONN_ITERATOR };

typedef struct conn {
  int fd;
  enum conn_kind kind;
  struct ucred peer;
  hd_process *process;    /* CONN_REGISTRY, CONN_SINK */
  hd_stored_list listing; /* CONN_ITERATOR: a copy of the matching snapshots */
  heapdump_client_CollectorError listing_error; /* CONN_ITERATOR: answered instead */
  uint64_t last_active_ns;                      /* when it was accepted or last sent a message */
} conn;

struct conn_table { /* declared in collector_internal.h */
  conn items[HD_MAX_CONNECTIONS];
  size_t count;
};

/* Adds a connection served by the poll loop; takes fd and the reference to process (also when
 * refused: the table is full). */
bool hd_conn_add(hd_collector *c, int fd, enum conn_kind kind, hd_process *process,
                 const struct ucred *peer);
/* Closes connection index; the last connection takes its place. */
void hd_conn_close(hd_collector *c, size_t index);
/* Closes client connections idle for longer than the idle timeout, or, once the table is three
 * quarters full, for longer than a second: idle or abandoned clients never lock out new clients
 * and processes. Returns whether any connection may still idle out (the loop then wakes up to
 * look again). */
bool hd_close_idle_connections(hd_collector *c);
/* Accepts every pending connection. Out of descriptors, the client connection idle the longest
 * (for 100 ms at least) is closed to make room; with none to close (or out of memory), the
 * connection stays in the backlog and the socket stays readable: the poll thread then leaves it
 * alone for a while (50 ms, doubling up to a second while it lasts) rather than spin on it. */
void hd_accept_connections(hd_collector *c);
/* Handles one readable connection (handlers.c); returns false if it must be closed. */
bool hd_serve_connection(hd_collector *c, size_t index);

#endif
