/* The processor hint for a spin-wait, shared by the table writer's slot lock and the reader's
 * retry loop. heapdump runs on x86-64 only (shm_layout.h). */
#ifndef HEAPDUMP_CONTRACT_CPU_H
#define HEAPDUMP_CONTRACT_CPU_H

/* Tells the core this is a spin-wait: it yields pipeline resources to a sibling hyperthread
 * (which may be the lock holder) and avoids the memory-order flush on loop exit. */
static inline void hd_cpu_relax(void) { __builtin_ia32_pause(); }

#endif /* HEAPDUMP_CONTRACT_CPU_H */
