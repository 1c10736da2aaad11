/* Channel transport over AF_UNIX SOCK_SEQPACKET sockets: one message per datagram, descriptors in
 * SCM_RIGHTS control messages. */
#include "heapdump/fidl/channel.h"

#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>
#include "heapdump/contract/must_check.h"

hd_status hd_channel_pair(int ends[2]) {
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ends) != 0) return HD_ERR_IO;
  return HD_OK;
}

static HD_MUST_CHECK hd_status fill_address(const char *path, struct sockaddr_un *addr) {
  size_t len = strlen(path);
  if (len == 0 || len >= sizeof addr->sun_path) {
    errno = ENAMETOOLONG;
    return HD_ERR_INVALID_ARGS;
  }
  memset(addr, 0, sizeof *addr);
  addr->sun_family = AF_UNIX;
  memcpy(addr->sun_path, path, len + 1);
  return HD_OK;
}

hd_status hd_channel_set_timeout(int fd, double seconds) {
  if (seconds < 0) return HD_ERR_INVALID_ARGS;
  struct timeval tv = {(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
      setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0) {
    return HD_ERR_IO;
  }
  return HD_OK;
}

hd_status hd_channel_connect_timeout(const char *path, double seconds, int *out_fd) {
  struct sockaddr_un addr;
  hd_status status = fill_address(path, &addr);
  if (status != HD_OK) return status;
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return HD_ERR_IO;
  /* Set before connect: a Unix socket's connect waits for backlog room as long as a send. */
  status = seconds > 0 ? hd_channel_set_timeout(fd, seconds) : HD_OK;
  int rc = status == HD_OK ? 0 : -1;
  while (rc == 0 && (rc = connect(fd, (const struct sockaddr *)&addr, sizeof addr)) != 0 &&
         errno == EINTR) {
    rc = 0;
  }
  if (rc != 0) {
    int saved = errno;
    close(fd);
    errno = saved;
    return saved == EAGAIN ? HD_ERR_TIMED_OUT : HD_ERR_IO;
  }
  *out_fd = fd;
  return HD_OK;
}

hd_status hd_channel_connect(const char *path, int *out_fd) {
  return hd_channel_connect_timeout(path, 0, out_fd);
}

hd_status hd_channel_listen(const char *path, int backlog, int *out_fd) {
  struct sockaddr_un addr;
  hd_status status = fill_address(path, &addr);
  if (status != HD_OK) return status;
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return HD_ERR_IO;
  /* Only a stale socket file is replaced, never a regular file someone pointed us at. */
  struct stat st;
  if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode)) unlink(path);
  if (bind(fd, (const struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, backlog) != 0) {
    int saved = errno;
    close(fd);
    errno = saved;
    return HD_ERR_IO;
  }
  *out_fd = fd;
  return HD_OK;
}

hd_status hd_channel_send(int fd, const void *bytes, size_t size, const int *fds, size_t fd_count) {
  if (size > HD_MAX_MESSAGE_BYTES || fd_count > HD_MAX_MESSAGE_FDS) return HD_ERR_INVALID_ARGS;
  struct iovec iov = {.iov_base = (void *)bytes, .iov_len = size};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  union {
    char buf[CMSG_SPACE(sizeof(int) * HD_MAX_MESSAGE_FDS)];
    struct cmsghdr align;
  } control;
  if (fd_count > 0) {
    memset(&control, 0, sizeof control);
    msg.msg_control = control.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fd_count);
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fd_count);
    memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * fd_count);
  }
  ssize_t sent;
  do {
    sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return HD_ERR_TIMED_OUT;
  if (sent < 0) return (errno == EPIPE || errno == ECONNRESET) ? HD_ERR_PEER_CLOSED : HD_ERR_IO;
  return (size_t)sent == size ? HD_OK : HD_ERR_IO;
}

/* Takes every descriptor out of the control messages: kept ones go to fds[], the rest are closed
 * at once so that no path leaks them. Returns false if any had to be dropped. */
static bool collect_fds(struct msghdr *msg, int *fds, size_t max_fds, size_t *fd_count) {
  bool all_kept = true;
  *fd_count = 0;
  for (struct cmsghdr *cmsg = CMSG_FIRSTHDR(msg); cmsg != NULL; cmsg = CMSG_NXTHDR(msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; i++) {
      int received;
      memcpy(&received, CMSG_DATA(cmsg) + i * sizeof(int), sizeof received);
      if (*fd_count < max_fds) {
        fds[(*fd_count)++] = received;
      } else {
        close(received);
        all_kept = false;
      }
    }
  }
  return all_kept;
}

static void close_all(int *fds, size_t *fd_count) {
  for (size_t i = 0; i < *fd_count; i++) close(fds[i]);
  *fd_count = 0;
}

hd_status hd_channel_recv(int fd, void *bytes, size_t capacity, size_t *size, int *fds,
                          size_t max_fds, size_t *fd_count) {
  struct iovec iov = {.iov_base = bytes, .iov_len = capacity};
  union {
    char buf[CMSG_SPACE(sizeof(int) * HD_MAX_MESSAGE_FDS)];
    struct cmsghdr align;
  } control;
  struct msghdr msg = {.msg_iov = &iov,
                       .msg_iovlen = 1,
                       .msg_control = control.buf,
                       .msg_controllen = sizeof control.buf};
  *size = 0;
  *fd_count = 0;
  ssize_t got;
  do {
    got = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return HD_ERR_TIMED_OUT;
  if (got < 0) return errno == ECONNRESET ? HD_ERR_PEER_CLOSED : HD_ERR_IO;
  bool all_kept = collect_fds(&msg, fds, max_fds, fd_count);
  if (got == 0 && *fd_count == 0 && !(msg.msg_flags & MSG_TRUNC)) return HD_ERR_PEER_CLOSED;
  if (msg.msg_flags & MSG_TRUNC) {
    close_all(fds, fd_count);
    return HD_ERR_TOO_LARGE;
  }
  if (!all_kept || (msg.msg_flags & MSG_CTRUNC)) {
    close_all(fds, fd_count);
    return HD_ERR_TOO_MANY_FDS;
  }
  *size = (size_t)got;
  return HD_OK;
}
