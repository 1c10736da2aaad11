/* heapdump-collector: the daemon instrumented processes register with and clients ask for
 * snapshots. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "heapdump/collector.h"

static hd_collector *running;

static void on_signal(int sig) {
  (void)sig;
  if (running != NULL) hd_collector_stop(running);
}

static void usage(FILE *out) {
  fprintf(out,
          "usage: heapdump-collector [--socket PATH] [--storage DIR] [--max-stored N]\n"
          "                          [--max-storage-bytes B] [--foreground] [--log-level L]\n"
          "\n"
          "Serves heap snapshots of processes running with libheapdump.so preloaded.\n"
          "  --socket PATH          listen here (default: $HEAPDUMP_SOCKET, else\n"
          "                         $XDG_RUNTIME_DIR/heapdump/collector.sock, else\n"
          "                         /tmp/heapdump-$UID/collector.sock)\n"
          "  --storage DIR          stored snapshots (default: $XDG_STATE_HOME/heapdump, else\n"
          "                         ~/.local/state/heapdump)\n"
          "  --max-stored N         keep at most N stored snapshots, evicting the oldest\n"
          "  --max-storage-bytes B  keep at most B bytes of stored snapshots\n"
          "  --foreground           stay attached to the terminal (default: detach)\n"
          "  --log-level L          error, warn, info (default) or debug; logs go to stderr\n");
}

/* A decimal count in [0, max]: no sign, no suffix, no overflow. */
static bool parse_count(const char *text, unsigned long long max, unsigned long long *out) {
  if (text[0] < '0' || text[0] > '9') return false;
  char *end;
  errno = 0;
  *out = strtoull(text, &end, 10);
  return errno == 0 && *end == '\0' && *out <= max;
}

static int parse_level(const char *s) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; i++) {
    if (strcmp(s, names[i]) == 0) return i;
  }
  return -1;
}

int main(int argc, char **argv) {
  static const struct option longopts[] = {
      {"socket", required_argument, 0, 's'},      {"storage", required_argument, 0, 'd'},
      {"max-stored", required_argument, 0, 'n'},  {"max-storage-bytes", required_argument, 0, 'b'},
      {"foreground", no_argument, 0, 'f'},        {"log-level", required_argument, 0, 'l'},
      {"help", no_argument, 0, 'h'},              {0, 0, 0, 0}};
  hd_collector_options options = {.log_level = HD_LOG_INFO};
  int foreground = 0, opt;
  unsigned long long count;
  while ((opt = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    switch (opt) {
      case 's': options.socket_path = optarg; break;
      case 'd': options.storage_dir = optarg; break;
      case 'n':
        if (!parse_count(optarg, UINT32_MAX, &count)) {
          fprintf(stderr, "heapdump-collector: bad --max-stored: %s (a count, 0 for no limit)\n",
                  optarg);
          return 2;
        }
        options.max_stored = (uint32_t)count;
        break;
      case 'b':
        if (!parse_count(optarg, UINT64_MAX, &count)) {
          fprintf(stderr, "heapdump-collector: bad --max-storage-bytes: %s (bytes, 0 for no limit)\n",
                  optarg);
          return 2;
        }
        options.max_storage_bytes = count;
        break;
      case 'f': foreground = 1; break;
      case 'l':
        options.log_level = parse_level(optarg);
        if (options.log_level < 0) {
          fprintf(stderr, "heapdump-collector: bad --log-level: %s\n", optarg);
          return 2;
        }
        break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (optind != argc) {
    usage(stderr);
    return 2;
  }
  hd_collector *c;
  int rc = hd_collector_create(&options, &c);
  if (rc != 0) {
    fprintf(stderr, "heapdump-collector: cannot start: %s\n", strerror(-rc));
    return 1;
  }
  /* Detach only once the socket is listening, so that "started" means "reachable". */
  if (!foreground && daemon(0, 1) != 0) {
    fprintf(stderr, "heapdump-collector: cannot detach: %s\n", strerror(errno));
    hd_collector_destroy(c);
    return 1;
  }
  running = c;
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  rc = hd_collector_run(c);
  running = NULL;
  hd_collector_destroy(c);
  return rc == 0 ? 0 : 1;
}
