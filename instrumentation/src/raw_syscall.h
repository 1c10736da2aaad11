/* A system call without glibc: no errno (the result is -errno on failure), no cancellation
 * point, nothing in thread-local storage touched. For calls whose errno is no business of the
 * program's (the unwinder's probes, the answers given to libunwind) and for forwarding an
 * interposed call without reaching ourselves again (prctl). x86-64. */
#ifndef HEAPDUMP_INSTRUMENTATION_RAW_SYSCALL_H
#define HEAPDUMP_INSTRUMENTATION_RAW_SYSCALL_H

static inline long hd_raw_syscall6(long number, long a1, long a2, long a3, long a4, long a5,
                                   long a6) {
  register long r10 __asm__("r10") = a4;
  register long r8 __asm__("r8") = a5;
  register long r9 __asm__("r9") = a6;
  long ret;
  __asm__ volatile("syscall"
                   : "=a"(ret)
                   : "a"(number), "D"(a1), "S"(a2), "d"(a3), "r"(r10), "r"(r8), "r"(r9)
                   : "rcx", "r11", "memory");
  return ret;
}

#endif /* HEAPDUMP_INSTRUMENTATION_RAW_SYSCALL_H */
