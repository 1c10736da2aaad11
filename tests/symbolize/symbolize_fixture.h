/* The functions of the symbolize_test fixture library (see symbolize_fixture.c). */
#ifndef HEAPDUMP_TESTS_SYMBOLIZE_FIXTURE_H
#define HEAPDUMP_TESTS_SYMBOLIZE_FIXTURE_H

#ifdef __cplusplus
extern "C" {
#endif

/* What the last call into the fixture recorded: the return address of a call and the source
 * lines of that call and, for inlined code, of the call of the inlined function. */
typedef struct hd_fixture_site {
  void *return_address;
  int line, caller_line;
} hd_fixture_site;

extern hd_fixture_site hd_fixture_last;

int hd_fixture_record(int line, int caller_line);
void hd_fixture_noinline(void);
void hd_fixture_outer(void);
void hd_fixture_run_ends_in_call(void);
int hd_fixture_follows(void);

#ifdef __cplusplus
}
#endif
#endif
