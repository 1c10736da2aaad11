/* Between the parts of our unwinder: the module list (cfi_modules.c), the rule cache
 * (cfi_cache.c) and the walk (cfi_walk.c); the rule compiler is cfi_rules.h. */
#ifndef HEAPDUMP_INSTRUMENTATION_CFI_INTERNAL_H
#define HEAPDUMP_INSTRUMENTATION_CFI_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "cfi.h"
#include "cfi_rules.h"

/* ---- the module list (cfi_modules.c) ---- */

typedef struct hd_cfi_module {
  uintptr_t lo, hi;     /* its executable segments */
  hd_cfi_tables tables; /* hdr NULL: none we can search */
  uintptr_t resident;   /* non-zero: loaded with the program, never unloaded */
  /* The address of its .eh_frame_hdr, and whether its tables were refused (inconsistent: see
   * hd_cfi_check_tables), which leaves tables empty. Read by the libunwind filter. */
  uintptr_t eh_frame_hdr, refused;
} hd_cfi_module;

typedef enum hd_cfi_lookup {
  HD_CFI_MODULE_FOUND,
  HD_CFI_MODULE_NONE,     /* pc is in no module: JIT code, or a module loaded since */
  HD_CFI_MODULE_CHANGING, /* the list is being rewritten, or a module closed */
} hd_cfi_lookup;

/* The module holding pc, copied out of the list without a lock. */
hd_cfi_lookup hd_cfi_find_module(uintptr_t pc, hd_cfi_module *out) HD_CFI_HIDDEN;

/* Whether the list is as the loader has it: asks the loader (taking its lock) whether a module
 * came or went, and if so rereads the list here. False: another thread is rereading it. */
bool hd_cfi_modules_current(void) HD_CFI_HIDDEN;

/* The list's generation, moved on each time it is reread: rules are cached under it. */
uint64_t hd_cfi_generation(void) HD_CFI_HIDDEN;

/* ---- the rule cache (cfi_cache.c) ---- */

/* The rule at pc under generation. may_lock_loader: a miss outside the modules loaded with the
 * program may ask the loader whether the list is stale (not from a signal handler, where the
 * interrupted code may be inside the loader). */
uint64_t hd_cfi_rule_at(uintptr_t pc, uint64_t generation, bool may_lock_loader) HD_CFI_HIDDEN;

/* Empties the cache: after 2^16 generations a key could match a rule cached that long ago. */
void hd_cfi_cache_clear(void) HD_CFI_HIDDEN;

#endif
