/* A program whose only pointer to a block moves from memory to a register: a thread allocates
 * 5000 bytes (hold_in_register), keeps the pointer in a global and in r12, and blocks reading a
 * byte from stdin; when one comes, it clears the global and blocks again until stdin closes,
 * the pointer in r12 only. A scan before the byte calls the block reachable; one after, lost.
 * It also leaks 6000 bytes for real (leak_for_real). Prints "ready" once the thread waits. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

void *volatile g_slot;

__attribute__((noinline)) void *hold_in_register(void) { return malloc(5000); }

/* The pointer is used (so the allocation stays) but never stored: no stale copy anywhere. */
__attribute__((noinline)) void leak_for_real(void) {
  void *p = malloc(6000);
  __asm__ volatile("" : : "r"(p));
}

/* read(0, c, 1) with kept in r12 while the thread is blocked in the kernel: a raw system call
 * pushes nothing on the stack. */
#define READ_KEEPING(c, kept)                                                  \
  do {                                                                         \
    long ret_;                                                                 \
    __asm__ volatile("syscall"                                                 \
                     : "=a"(ret_)                                              \
                     : "0"((long)SYS_read), "D"(0), "S"(c), "d"(1L), "r"(kept) \
                     : "rcx", "r11", "memory");                                \
  } while (0)

static void *holder(void *arg) {
  (void)arg;
  register void *kept __asm__("r12") = hold_in_register();
  g_slot = kept;
  char c;
  READ_KEEPING(&c, kept);
  g_slot = NULL;
  READ_KEEPING(&c, kept); /* until stdin closes */
  return NULL;
}

int main(void) {
  leak_for_real();
  pthread_t thread;
  if (pthread_create(&thread, NULL, holder, NULL) != 0) return 1;
  usleep(200 * 1000);
  printf("ready\n");
  fflush(stdout);
  pthread_join(thread, NULL);
  return 0;
}
