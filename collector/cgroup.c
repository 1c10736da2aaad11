/* The memory limit a process runs under, from its cgroup (v2: memory.max; v1: the memory
 * controller's memory.limit_in_bytes): the lowest limit on its cgroup's path, for a trigger set
 * as a share of it. Read from /proc and /sys like any reader of the process's state. */
#define _GNU_SOURCE
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "collector_internal.h"

/* A limit file's value; 0 for "max", a v1 "unlimited" (a page-rounded 2^63 - 1) or unreadable. */
static uint64_t read_limit(const char *path) {
  FILE *f = fopen(path, "re");
  if (f == NULL) return 0;
  char text[32] = "";
  const bool read = fgets(text, sizeof text, f) != NULL;
  fclose(f);
  if (!read || text[0] < '0' || text[0] > '9') return 0;
  const unsigned long long v = strtoull(text, NULL, 10);
  return v >= (UINT64_C(1) << 62) ? 0 : (uint64_t)v;
}

/* The lowest limit in `limit_file` of the cgroup at `group` under `root` and of its ancestors
 * (each level caps the ones below it); 0 if none. */
static uint64_t lowest_limit_on_path(const char *root, char *group, const char *limit_file) {
  uint64_t lowest = 0;
  for (;;) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s%s/%s", root, group, limit_file) < (int)sizeof path) {
      const uint64_t limit = read_limit(path);
      if (limit != 0 && (lowest == 0 || limit < lowest)) lowest = limit;
    }
    char *slash = strrchr(group, '/');
    if (slash == NULL || group[0] == '\0') break;
    *slash = '\0'; /* the parent; "" is the root */
  }
  return lowest;
}

uint64_t hd_cgroup_memory_limit(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/cgroup", (int)pid);
  FILE *f = fopen(path, "re");
  if (f == NULL) return 0;
  uint64_t limit = 0;
  char line[PATH_MAX + 64];
  while (limit == 0 && fgets(line, sizeof line, f) != NULL) {
    line[strcspn(line, "\n")] = '\0';
    /* "ID:CONTROLLERS:PATH" */
    char *controllers = strchr(line, ':');
    char *group = controllers ? strchr(controllers + 1, ':') : NULL;
    if (group == NULL) continue;
    *group++ = '\0';
    controllers++;
    /* A path outside the collector's cgroup namespace ("/../x") names nothing under its mount. */
    if (strstr(group, "..") != NULL) continue;
    if (strcmp(line, "0") == 0 && controllers[0] == '\0') {
      limit = lowest_limit_on_path("/sys/fs/cgroup", group, "memory.max");
    } else {
      for (char *save = NULL, *c = strtok_r(controllers, ",", &save); c != NULL;
           c = strtok_r(NULL, ",", &save)) {
        if (strcmp(c, "memory") == 0) {
          limit = lowest_limit_on_path("/sys/fs/cgroup/memory", group, "memory.limit_in_bytes");
          break;
        }
      }
    }
  }
  fclose(f);
  return limit;
}
