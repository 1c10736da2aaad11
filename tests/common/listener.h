// What the end-to-end tests share to start a real daemon: waiting until it listens.
#ifndef HEAPDUMP_TESTS_COMMON_LISTENER_H
#define HEAPDUMP_TESTS_COMMON_LISTENER_H

#include <sys/types.h>

#include <string>

namespace hdtest {

// Waits up to 20 s until something accepts connections at path (a stale socket file does not
// count); false as soon as the process `owner` has exited, which is left for the caller to reap.
bool WaitForListener(const std::string &path, pid_t owner);

}  // namespace hdtest

#endif
