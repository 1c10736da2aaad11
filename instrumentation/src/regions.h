/* Executable-region recording (dl_iterate_phdr); off the allocation hot path. */
#ifndef HEAPDUMP_INSTRUMENTATION_REGIONS_H
#define HEAPDUMP_INSTRUMENTATION_REGIONS_H

#include "tables.h"

void hd_regions_scan(hd_res_table *res, const char *exe_name) __attribute__((visibility("hidden")));
void hd_regions_after_fork_child(void) __attribute__((visibility("hidden")));

#endif
