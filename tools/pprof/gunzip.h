/* A profile's bytes, gunzipped when gzip-compressed (as pprof writes them), else as they are.
 * Private to tools/pprof. */
#ifndef HEAPDUMP_TOOLS_PPROF_GUNZIP_H
#define HEAPDUMP_TOOLS_PPROF_GUNZIP_H

#include <stddef.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"

/* *out: the bytes (malloc'ed). A compressed profile may inflate to a hundred times its size (at
 * least 64 MiB, at most max). Returns 0, or a negative errno value with a message in error
 * (-EINVAL: a damaged or cut gzip stream; -EFBIG: one that inflates past that). */
HD_MUST_CHECK int hd_gunzip(const uint8_t *data, size_t size, size_t max, uint8_t **out,
                            size_t *out_size, char *error, size_t error_size);

#endif
