/* Registration of this process with the collector, and named-snapshot hand-over. */
#ifndef HEAPDUMP_INSTRUMENTATION_REGISTRATION_H
#define HEAPDUMP_INSTRUMENTATION_REGISTRATION_H

#include "heapdump/contract/must_check.h"
#include "heapdump/heapdump.h"
#include "runtime.h"

/* Registers if a collector answers; otherwise does nothing (the program runs on). */
void hd_register_with_collector(void) HD_HIDDEN;
/* A process that could not arm for the arm page's request of that generation tells the
 * collector why (when it can reach it), so that the client waiting for the arming can say.
 * Called while the state is still ARMING. */
void hd_report_arm_failure(uint64_t generation, const hd_arm_failure *failed) HD_HIDDEN;
/* In a forked child: drops the parent's connection and registers the child. */
void hd_registration_after_fork_child(void) HD_HIDDEN;
/* Hands a sealed snapshot memfd (borrowed) to the collector under name, registering first if
 * needed; exit_with_contents: this is the process's exit snapshot, to be stored with contents
 * and roots while it waits. Returns HEAPDUMP_OK, HEAPDUMP_ERROR_NO_COLLECTOR,
 * HEAPDUMP_ERROR_NO_ANSWER or HEAPDUMP_ERROR_COLLECTOR_REFUSED. */
HD_MUST_CHECK int hd_store_named_snapshot(const char *name, const hd_owned_fd *memfd,
                                          bool exit_with_contents) HD_HIDDEN;
/* Whether this process stores its exit snapshot itself, with contents, from its exit path:
 * HEAPDUMP_EXIT_SNAPSHOT=1 and HEAPDUMP_EXIT_CONTENTS 1, or this process's pid (what `heapdump
 * run` sets for its command). */
bool hd_exit_with_contents_wanted(void) HD_HIDDEN;

#endif
