#include "listener.h"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

extern "C" {
#include "heapdump/fidl/channel.h"
}

namespace hdtest {

bool WaitForListener(const std::string &path, pid_t owner) {
  for (int i = 0; i < 1000; i++) {
    int fd;
    if (hd_channel_connect(path.c_str(), &fd) == HD_OK) {
      close(fd);
      return true;
    }
    siginfo_t info = {};
    if (waitid(P_PID, static_cast<id_t>(owner), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid == owner) {
      return false;
    }
    usleep(20000);
  }
  return false;
}

}  // namespace hdtest
