/* What the jemalloc linked into libheapdump.so imports from beyond libc (jemalloc_imports.c). */
#ifndef HEAPDUMP_INSTRUMENTATION_JEMALLOC_IMPORTS_H
#define HEAPDUMP_INSTRUMENTATION_JEMALLOC_IMPORTS_H

#include <stdint.h>

double hd_je_log(double x);
double hd_je_exp(double x);
double hd_je_round(double x);

int hd_je__Unwind_Backtrace(void *trace, void *arg);
uintptr_t hd_je__Unwind_GetIP(void *context);

#endif
