/* The demo program: builds a linked list, forgets part of it (a leak), stores a named snapshot
 * through the heapdump API, and prints what the profiler counted. Runs with or without
 * libheapdump.so preloaded (weak-symbol API). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define HEAPDUMP_WEAK_API
#include "heapdump/heapdump.h"

struct node {
  struct node *next;
  char payload[48];
};

/* The demo takes its time (about a second) so that its memory over time, which the collector
 * samples every 100 ms, has a shape: up while it builds, down while it frees. */
static void pause_briefly(void) {
  struct timespec t = {0, 40 * 1000 * 1000};
  nanosleep(&t, NULL);
}

__attribute__((noinline)) static struct node *build_list(int n) {
  struct node *head = NULL;
  for (int i = 0; i < n; i++) {
    struct node *x = malloc(sizeof *x);
    snprintf(x->payload, sizeof x->payload, "node %d", i);
    x->next = head;
    head = x;
    if (i % 100 == 99) pause_briefly();
  }
  return head;
}

int main(void) {
  struct node *kept = build_list(1000);
  struct node *lost = build_list(250); /* never freed: the leak */
  (void)lost;
  if (!heapdump_available()) {
    printf("leaky: libheapdump.so is not loaded\n");
  } else {
    int rc = heapdump_take_named_snapshot("after-build");
    printf("leaky: heapdump_take_named_snapshot(\"after-build\") = %d\n", rc);
  }
  for (int freed = 0; kept != NULL; freed++) {
    struct node *next = kept->next;
    free(kept);
    kept = next;
    if (freed % 100 == 99) pause_briefly();
  }
  struct heapdump_stats st;
  if (heapdump_available() && heapdump_get_stats(&st) == HEAPDUMP_OK) {
    printf(
        "leaky: allocated %llu blocks (%llu bytes), freed %llu; live at exit: %llu blocks, "
        "%llu bytes; peak %llu bytes\n",
        (unsigned long long)st.blocks_allocated, (unsigned long long)st.bytes_allocated,
        (unsigned long long)st.blocks_freed, (unsigned long long)st.live_blocks,
        (unsigned long long)st.live_bytes, (unsigned long long)st.peak_live_bytes);
  }
  return 0;
}
