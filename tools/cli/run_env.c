/* What `heapdump run` sets up around the command (cli.h): the path of libheapdump.so to preload
 * and, when no collector answers at the socket, a collector of its own for the run. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "heapdump/collector.h"

static bool is_file(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

bool cli_find_library(char *out, size_t size) {
  const char *env = getenv(HD_ENV_LIBRARY);
  if (env != NULL && env[0] != '\0') {
    if (!is_file(env) || realpath(env, out) == NULL) return false;
    return true;
  }
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash != NULL) *slash = '\0';
    static const char *const kRelative[] = {
        "libheapdump.so",
        "../lib/heapdump/libheapdump.so",
        "../lib/libheapdump.so",
        "../instrumentation/libheapdump.so",
        "../../instrumentation/libheapdump.so",
    };
    for (size_t i = 0; i < sizeof kRelative / sizeof kRelative[0]; i++) {
      char candidate[PATH_MAX + 64];
      snprintf(candidate, sizeof candidate, "%s/%s", exe, kRelative[i]);
      if (is_file(candidate) && realpath(candidate, out) != NULL) return true;
    }
  }
#ifdef HD_BUILD_PRELOAD_LIB
  if (is_file(HD_BUILD_PRELOAD_LIB) &&
      snprintf(out, size, "%s", HD_BUILD_PRELOAD_LIB) < (int)size) {
    return true;
  }
#endif
  (void)size;
  return false;
}

/* ---- the embedded collector ---- */

static void *serve(void *arg) {
  cli_embedded *e = arg;
  int rc = hd_collector_run(e->collector);
  if (rc != 0) cli_error("the embedded collector stopped: %s", strerror(-rc));
  return NULL;
}

int cli_embedded_start(cli_embedded *e) {
  memset(e, 0, sizeof *e);
  const char *tmp = getenv("TMPDIR");
  snprintf(e->dir, sizeof e->dir, "%s/heapdump-run-XXXXXX",
           tmp != NULL && tmp[0] && strlen(tmp) < 32 ? tmp : "/tmp");
  if (mkdtemp(e->dir) == NULL) {
    cli_error("cannot create a directory for the embedded collector: %s", strerror(errno));
    return -1;
  }
  snprintf(e->socket, sizeof e->socket, "%s/collector.sock", e->dir);
  snprintf(e->storage, sizeof e->storage, "%s/state", e->dir);
  hd_collector_options options = {
      .socket_path = e->socket, .storage_dir = e->storage, .log_level = HD_LOG_WARN};
  int rc = hd_collector_create(&options, &e->collector);
  if (rc != 0) {
    cli_error("cannot start the embedded collector: %s", strerror(-rc));
    rmdir(e->dir);
    return -1;
  }
  if (pthread_create(&e->thread, NULL, serve, e) != 0) {
    cli_error("cannot start the embedded collector's thread");
    hd_collector_destroy(e->collector);
    rmdir(e->dir);
    return -1;
  }
  e->running = true;
  return 0;
}

static void remove_tree(const char *path) {
  DIR *d = opendir(path);
  if (d != NULL) {
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL) {
      if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0) continue;
      char child[512];
      snprintf(child, sizeof child, "%s/%s", path, entry->d_name);
      if (entry->d_type == DT_DIR) {
        remove_tree(child);
      } else {
        unlink(child);
      }
    }
    closedir(d);
  }
  rmdir(path);
}

void cli_embedded_stop(cli_embedded *e) {
  if (!e->running) return;
  hd_collector_stop(e->collector);
  pthread_join(e->thread, NULL);
  hd_collector_destroy(e->collector);
  remove_tree(e->dir);
  e->running = false;
}
