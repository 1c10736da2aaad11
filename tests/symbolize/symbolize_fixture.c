/* A shared library of known code for symbolize_test: a noinline function, an always-inline
 * function inlined into a noinline one, and a function whose last instruction is a call that
 * never returns, laid out before another function. Each records the return address of its call
 * and the source lines the test expects there. Built -O2 -g, unsanitized, with functions in
 * source order. */
#include <setjmp.h>

#include "symbolize_fixture.h"

/* noipa keeps gcc from cloning or specializing the functions whose addresses the test checks;
 * clang does neither to a noinline function. */
#ifdef __clang__
#define FIXTURE_OPAQUE __attribute__((noinline))
#else
#define FIXTURE_OPAQUE __attribute__((noipa))
#endif

hd_fixture_site hd_fixture_last;
static volatile int fixture_sink;
static jmp_buf *escape_target;

/* Returns line so that its caller uses the result after the call: the call is never a tail
 * call, and its return address stays inside the caller. */
FIXTURE_OPAQUE int hd_fixture_record(int line, int caller_line) {
  hd_fixture_last.return_address = __builtin_return_address(0);
  hd_fixture_last.line = line;
  hd_fixture_last.caller_line = caller_line;
  return line;
}

FIXTURE_OPAQUE void hd_fixture_noinline(void) { fixture_sink += hd_fixture_record(__LINE__, 0); }

static inline __attribute__((always_inline)) void fixture_inlined(int caller_line) {
  fixture_sink += hd_fixture_record(__LINE__, caller_line);
}

FIXTURE_OPAQUE void hd_fixture_outer(void) {
  fixture_inlined(__LINE__);
  fixture_sink++;
}

FIXTURE_OPAQUE __attribute__((noreturn)) void hd_fixture_escape(void) {
  hd_fixture_last.return_address = __builtin_return_address(0);
  longjmp(*escape_target, 1);
}

FIXTURE_OPAQUE void hd_fixture_ends_in_call(jmp_buf *target) {
  escape_target = target;
  hd_fixture_escape();
}

/* The return address of hd_fixture_ends_in_call's last call is past its end: the first byte of
 * this function, or (when functions are aligned) the padding before it. */
FIXTURE_OPAQUE int hd_fixture_follows(void) { return fixture_sink; }

void hd_fixture_run_ends_in_call(void) {
  jmp_buf target;
  if (setjmp(target) == 0) hd_fixture_ends_in_call(&target);
}
