/* The names a dartheap file gives (dartheap.c's helpers): formatted strings, library URIs and
 * package names, each made so that DevTools and the other readers accept it. */
#ifndef HEAPDUMP_TOOLS_DARTHEAP_NAMES_H
#define HEAPDUMP_TOOLS_DARTHEAP_NAMES_H

#include <stdbool.h>
#include <stddef.h>

/* A malloc'ed string formatted as printf does; NULL when out of memory. */
char *hd_dart_format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* s percent-encoded outside RFC 3986's unreserved set, malloc'ed; NULL when out of memory. */
char *hd_dart_uri_encode(const char *s);

/* A process name as a package-name part ("process" if it is empty). */
void hd_dart_package_part(const char *name, char *out, size_t size);

#endif
