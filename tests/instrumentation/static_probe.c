/* A statically linked program, exec'd by hd_child under LD_PRELOAD=libheapdump.so: the dynamic
 * loader never runs for it, so the preload cannot apply. Checks that nothing the library did in
 * its parent reaches it (no inherited heapdump memfd, no mapping of the library) and that it
 * allocates normally. Exit status 0 on success. */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int fd_links_mention(const char *what) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int found = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    char path[512], link[256];
    snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
    ssize_t n = readlink(path, link, sizeof(link) - 1);
    if (n <= 0) continue;
    link[n] = 0;
    found |= strstr(link, what) != NULL;
  }
  closedir(d);
  return found;
}

static int maps_mention(const char *what) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return -1;
  char line[1024];
  int found = 0;
  while (fgets(line, sizeof(line), f)) found |= strstr(line, what) != NULL;
  fclose(f);
  return found;
}

int main(void) {
  if (fd_links_mention("heapdump") != 0) {
    fprintf(stderr, "static_probe: a heapdump descriptor was inherited\n");
    return 1;
  }
  if (maps_mention("libheapdump") != 0) {
    fprintf(stderr, "static_probe: libheapdump is mapped\n");
    return 2;
  }
  unsigned char *blocks[256];
  for (int i = 0; i < 256; i++) {
    blocks[i] = malloc(100 + (size_t)i * 37);
    if (!blocks[i]) return 3;
    memset(blocks[i], i, 100 + (size_t)i * 37);
  }
  for (int i = 0; i < 256; i++) {
    for (size_t b = 0; b < 100 + (size_t)i * 37; b++)
      if (blocks[i][b] != (unsigned char)i) return 4;
    free(blocks[i]);
  }
  return 0;
}
