/* libunwind, loaded only on request (HEAPDUMP_UNWIND=libunwind or compare), with no descriptor
 * of its own (libunwind_loader.c). */
#ifndef HEAPDUMP_INSTRUMENTATION_LIBUNWIND_LOADER_H
#define HEAPDUMP_INSTRUMENTATION_LIBUNWIND_LOADER_H

#include <stdbool.h>
#include "heapdump/contract/must_check.h"

#define HD_LIBUNWIND_HIDDEN __attribute__((visibility("hidden")))

/* Loads libunwind.so.8 (from the library's constructor: it runs dlopen) with its descriptor
 * calls redirected to ours, and gives it a per-thread cache. false: not found, or its imports
 * could not be redirected (it is then never used). */
bool hd_libunwind_load(void) HD_LIBUNWIND_HIDDEN;
/* unw_backtrace; -1 while libunwind is not loaded. */
HD_MUST_CHECK int hd_libunwind_backtrace(void **ips, int max) HD_LIBUNWIND_HIDDEN;
/* In a fork child: libunwind's shared cache (and the lock around it) is given up (stack.c). */
void hd_libunwind_share_no_cache(void) HD_LIBUNWIND_HIDDEN;

#endif
