/* The poll thread's connections: adding, closing, closing the idle, accepting. */
#define _GNU_SOURCE
#include "connections.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

bool hd_conn_add(hd_collector *c, int fd, enum conn_kind kind, hd_process *process,
                 const struct ucred *peer) {
  if (c->conns->count == HD_MAX_CONNECTIONS) {
    hd_log(c, HD_LOG_WARN, "too many connections; refusing one");
    close(fd);
    hd_process_release(process);
    return false;
  }
  int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK); /* a peer that stops reading cannot block the loop */
  conn *k = &c->conns->items[c->conns->count++];
  memset(k, 0, sizeof *k);
  k->fd = fd;
  k->kind = kind;
  k->process = process;
  k->last_active_ns = hd_monotonic_ns();
  if (peer != NULL) k->peer = *peer;
  return true;
}

void hd_conn_close(hd_collector *c, size_t index) {
  conn *k = &c->conns->items[index];
  close(k->fd);
  if (k->process != NULL) hd_process_release(k->process);
  free(k->listing.items);
  c->conns->items[index] = c->conns->items[--c->conns->count];
}

/* Clients, iterators and connections that have not said what they are come and go; registry
 * and sink connections live as long as their process, idle or not. */
static bool may_idle_out(const conn *k) {
  return k->kind == CONN_NEW || k->kind == CONN_CLIENT || k->kind == CONN_ITERATOR;
}

bool hd_close_idle_connections(hd_collector *c) {
  const uint64_t now = hd_monotonic_ns();
  const bool crowded = c->conns->count >= HD_MAX_CONNECTIONS / 4 * 3;
  const uint64_t limit = crowded ? 1000000000u : c->idle_timeout_ns;
  bool any = false;
  for (size_t i = c->conns->count; i-- > 0;) {
    conn *k = &c->conns->items[i];
    if (!may_idle_out(k)) continue;
    if (now - k->last_active_ns > limit) {
      hd_log(c, HD_LOG_DEBUG, "closing a connection of pid %u idle for %llu s",
             (unsigned)k->peer.pid, (unsigned long long)((now - k->last_active_ns) / 1000000000u));
      hd_conn_close(c, i);
    } else {
      any = true;
    }
  }
  return any;
}

/* Out of descriptors: closes the client connection idle the longest, if one has been idle for
 * EVICT_AFTER_NS, so a new client is served at once rather than after the idle timeout (idle
 * clients holding every descriptor would lock everyone out until then). Registry and sink
 * connections are never closed: they are processes' lifelines. Returns whether one was closed. */
#define EVICT_AFTER_NS 100000000u
static bool evict_idlest_client(hd_collector *c) {
  const uint64_t now = hd_monotonic_ns();
  size_t idlest = c->conns->count;
  for (size_t i = 0; i < c->conns->count; i++) {
    const conn *k = &c->conns->items[i];
    if (!may_idle_out(k) || now - k->last_active_ns < EVICT_AFTER_NS) continue;
    if (idlest == c->conns->count || k->last_active_ns < c->conns->items[idlest].last_active_ns) {
      idlest = i;
    }
  }
  if (idlest == c->conns->count) return false;
  hd_log(c, HD_LOG_INFO, "out of descriptors: closing a connection of pid %u idle for %llu ms",
         (unsigned)c->conns->items[idlest].peer.pid,
         (unsigned long long)((now - c->conns->items[idlest].last_active_ns) / 1000000u));
  hd_conn_close(c, idlest);
  return true;
}

void hd_accept_connections(hd_collector *c) {
  for (;;) {
    int fd = accept4(c->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if ((errno == EMFILE || errno == ENFILE) && evict_idlest_client(c)) continue;
      const int error = errno;
      c->accept_backoff_ns = c->accept_backoff_ns == 0 ? 50000000u : c->accept_backoff_ns * 2;
      if (c->accept_backoff_ns > 1000000000u) c->accept_backoff_ns = 1000000000u;
      c->accept_paused_until_ns = hd_monotonic_ns() + c->accept_backoff_ns;
      hd_log(c, HD_LOG_WARN, "accept failed: %s; new connections wait %llu ms", strerror(error),
             (unsigned long long)(c->accept_backoff_ns / 1000000u));
      return;
    }
    c->accept_backoff_ns = 0;
    struct ucred peer;
    socklen_t len = sizeof peer;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) {
      close(fd);
      continue;
    }
    if (peer.uid != getuid() && peer.uid != 0) {
      hd_log(c, HD_LOG_WARN, "refused connection from uid %u (pid %u)", (unsigned)peer.uid,
             (unsigned)peer.pid);
      close(fd);
      continue;
    }
    hd_conn_add(c, fd, CONN_NEW, NULL, &peer);
  }
}
