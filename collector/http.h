/* The collector's HTTP service (heapdump-collector --http): see http.c and docs/fleet.md. Only
 * the daemon serves it; `heapdump run`'s embedded collector does not. */
#ifndef HEAPDUMP_COLLECTOR_HTTP_H
#define HEAPDUMP_COLLECTOR_HTTP_H

#include <stddef.h>

#include "heapdump/collector.h"
#include "heapdump/contract/must_check.h"

typedef struct hd_http hd_http;

/* Serves HTTP on address ("ADDR:PORT", "[V6]:PORT") for collector c, on threads of its own.
 * An address that is not loopback needs token_file (the token on its first line), and then
 * every request bears "Authorization: Bearer TOKEN". Returns 0, or a negative errno value with
 * a message for the user in error. */
HD_MUST_CHECK int hd_http_start(hd_collector *c, const char *address, const char *token_file,
                                hd_http **out, char *error, size_t error_size);
/* Stops serving (in-flight requests end first) and frees h; NULL does nothing. */
void hd_http_stop(hd_http *h);

#endif
