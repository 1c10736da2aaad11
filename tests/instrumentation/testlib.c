/* A module loaded with dlopen by hd_child: allocates in its constructor and on request. */
#include <stdlib.h>

void *testlib_ctor_block; /* global: the allocation must not be optimised away */

__attribute__((constructor)) static void testlib_init(void) { testlib_ctor_block = malloc(7121); }

void *testlib_allocate(size_t size) { return malloc(size); }

/* Allocates from a frame of its own: work after the call keeps it from being a tail call, so the
 * unwinder must step through this module to reach the caller. */
void *testlib_allocate_framed(size_t size) {
  void *p = malloc(size);
  __asm__ volatile("" : : "r"(p) : "memory");
  return p;
}
