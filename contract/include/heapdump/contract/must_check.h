/* The one mark of a fallible call: its result must be looked at (the compiler warns otherwise,
 * and the build treats warnings as errors). */
#ifndef HEAPDUMP_CONTRACT_MUST_CHECK_H
#define HEAPDUMP_CONTRACT_MUST_CHECK_H

#define HD_MUST_CHECK __attribute__((warn_unused_result))

#endif /* HEAPDUMP_CONTRACT_MUST_CHECK_H */
