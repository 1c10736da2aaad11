/* The names a dartheap file gives: formatted strings, library URIs, package names (names.h). */
#include "names.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

char *hd_dart_format(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0) return NULL;
  char *s = malloc((size_t)n + 1);
  if (s == NULL) return NULL;
  va_start(ap, fmt);
  vsnprintf(s, (size_t)n + 1, fmt, ap);
  va_end(ap);
  return s;
}

static bool is_uri_unreserved(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '.' || c == '_' || c == '~';
}

/* Percent-encodes every byte outside RFC 3986's unreserved set: readers parse libraryUri as a URI
 * and reject a malformed one, and module and process names may hold any byte. */
char *hd_dart_uri_encode(const char *s) {
  size_t len = strlen(s);
  char *out = malloc(len * 3 + 1);
  if (out == NULL) return NULL;
  static const char kHex[] = "0123456789ABCDEF";
  char *p = out;
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    if (is_uri_unreserved(*c)) {
      *p++ = (char)*c;
    } else {
      *p++ = '%';
      *p++ = kHex[*c >> 4];
      *p++ = kHex[*c & 15];
    }
  }
  *p = 0;
  return out;
}

/* A process name as a package-name part: the '/' that would end the package name (DevTools reads
 * the package name up to the first '/') is replaced, as is anything unprintable. */
void hd_dart_package_part(const char *name, char *out, size_t size) {
  size_t n = 0;
  for (const unsigned char *c = (const unsigned char *)name; *c && n + 1 < size; c++) {
    out[n++] = (*c == '/' || *c < 0x20 || *c == 0x7f) ? '_' : (char)*c;
  }
  out[n] = 0;
  if (n == 0) snprintf(out, size, "process");
}
