/* Debug checks: the invariants the code relies on without testing them at run time (a slot is
 * odd while written, a reference count above zero, a queue within its bounds), said where they
 * must hold. Debug, sanitizer and fuzzing builds define HD_DEBUG_CHECKS and stop the process at
 * the first one broken, saying where; release builds compile the condition (so it cannot rot:
 * it still type-checks against the code around it) and drop it, as jemalloc's config_debug
 * does. The failure path allocates nothing and takes no lock: it runs inside the profiled
 * program's malloc too. */
#ifndef HEAPDUMP_CONTRACT_DCHECK_H
#define HEAPDUMP_CONTRACT_DCHECK_H

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef HD_DEBUG_CHECKS
#define HD_DEBUG true
#else
#define HD_DEBUG false
#endif

__attribute__((noreturn, cold, unused)) static void hd_dcheck_failed(const char *where,
                                                                     const char *condition) {
  static const char kPrefix[] = "heapdump: debug check failed at ";
  /* Unchecked writes: the process is about to stop whatever they return. */
  if (write(STDERR_FILENO, kPrefix, sizeof kPrefix - 1) < 0 ||
      write(STDERR_FILENO, where, strlen(where)) < 0 || write(STDERR_FILENO, ": ", 2) < 0 ||
      write(STDERR_FILENO, condition, strlen(condition)) < 0 || write(STDERR_FILENO, "\n", 1) < 0) {
  }
  abort();
}

#define HD_DCHECK_STRINGIFY_(x) #x
#define HD_DCHECK_STRINGIFY(x) HD_DCHECK_STRINGIFY_(x)

/* Stops the process if `condition` is false, in builds with debug checks; else nothing, the
 * condition compiled but never evaluated. */
#define HD_DCHECK(condition)                                                    \
  do {                                                                          \
    if (HD_DEBUG && __builtin_expect(!(condition), 0)) {                        \
      hd_dcheck_failed(__FILE__ ":" HD_DCHECK_STRINGIFY(__LINE__), #condition); \
    }                                                                           \
  } while (0)

#endif /* HEAPDUMP_CONTRACT_DCHECK_H */
