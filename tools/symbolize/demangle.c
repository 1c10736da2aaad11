/* Demangling with a cache (see demangle.h). Reports name the same few thousand functions over
 * and over, and libiberty allocates a fresh string for every call. */
#include "heapdump/tools/demangle.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <libiberty/demangle.h>

#include "heapdump/tools/util.h"

typedef struct cached_name {
  char *name;      /* NULL: empty entry */
  char *demangled; /* NULL: not a mangled name */
} cached_name;

/* One cache per way of demangling (libiberty's flags). */
typedef struct name_cache {
  int flags;
  cached_name *names;
  size_t mask, count;
} name_cache;

static name_cache g_with_parameters = {DMGL_PARAMS | DMGL_ANSI | DMGL_AUTO, NULL, 0, 0};
static name_cache g_without_parameters = {DMGL_ANSI | DMGL_AUTO, NULL, 0, 0};

static uint64_t hash_name(const char *s) { return hd_fnv1a(HD_FNV1A_BASIS, s, strlen(s)); }

static bool grow(name_cache *c) {
  const size_t slots = c->names ? (c->mask + 1) * 2 : 1024;
  cached_name *bigger = calloc(slots, sizeof *bigger);
  if (bigger == NULL) return false;
  for (size_t i = 0; c->names && i <= c->mask; i++) {
    if (c->names[i].name == NULL) continue;
    size_t at = hash_name(c->names[i].name) & (slots - 1);
    while (bigger[at].name != NULL) at = (at + 1) & (slots - 1);
    bigger[at] = c->names[i];
  }
  free(c->names);
  c->names = bigger;
  c->mask = slots - 1;
  return true;
}

/* Mangled names start with _Z (C++, and Rust's legacy scheme) or _R (Rust v0). */
static bool looks_mangled(const char *name) {
  return name[0] == '_' && (name[1] == 'Z' || name[1] == 'R');
}

static const char *demangle(name_cache *c, const char *name) {
  if (name == NULL || !looks_mangled(name)) return name;
  if ((c->count + 1) * 2 > (c->names ? c->mask + 1 : 0) && !grow(c)) {
    return name; /* out of memory: the linkage name is still a name */
  }
  size_t at = hash_name(name) & c->mask;
  for (; c->names[at].name != NULL; at = (at + 1) & c->mask) {
    if (strcmp(c->names[at].name, name) == 0) {
      return c->names[at].demangled ? c->names[at].demangled : name;
    }
  }
  char *copy = strdup(name);
  if (copy == NULL) return name;
  c->names[at] = (cached_name){.name = copy, .demangled = cplus_demangle(name, c->flags)};
  c->count++;
  return c->names[at].demangled ? c->names[at].demangled : name;
}

const char *hd_demangle(const char *name) { return demangle(&g_with_parameters, name); }

const char *hd_demangle_without_parameters(const char *name) {
  return demangle(&g_without_parameters, name);
}

bool hd_is_std_library_name(const char *name) {
  if (name == NULL || strncmp(name, "_Z", 2) != 0) return false;
  const char *p = name + 2;
  /* A nested name: N, then the qualifiers of a member function (restrict, volatile, const,
   * & or &&), then its first component. */
  if (*p == 'N') {
    p++;
    while (*p == 'r' || *p == 'V' || *p == 'K') p++;
    if (*p == 'R' || *p == 'O') p++;
  }
  /* St is std::; Sa, Sb, Ss, Si, So and Sd abbreviate std::allocator, basic_string, string and
   * the standard streams. */
  return (p[0] == 'S' && p[1] != '\0' && strchr("tabsiod", p[1]) != NULL) ||
         strncmp(p, "9__gnu_cxx", 10) == 0;
}
