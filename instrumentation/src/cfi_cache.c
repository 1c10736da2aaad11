/* The rule cache of our unwinder: the compiled rule of each program counter met, under the
 * module list's generation, read by the allocation path without a lock. */
#include "cfi_internal.h"

#include <stddef.h>

/* Direct-mapped and lock-free: an entry is two words, the rule and its key (pc and generation)
 * XOR a mix of the rule, each stored and loaded atomically on its own. A reader that sees the
 * halves of different writes finds that they do not match its key (the mix spreads any
 * difference of two rules over all 64 bits) and computes the rule itself. */
#define CACHE_SLOTS 8192
static struct { uint64_t check, rule; } g_cache[CACHE_SLOTS];

static uint64_t cache_key(uintptr_t pc, uint64_t generation) { return pc ^ (generation << 48); }

static uint64_t mix(uint64_t rule) { return rule * 0xff51afd7ed558ccdu; }

/* A reader that sees an entry half emptied finds it does not match. */
void hd_cfi_cache_clear(void) {
  for (size_t i = 0; i < CACHE_SLOTS; i++) {
    __atomic_store_n(&g_cache[i].check, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&g_cache[i].rule, 0, __ATOMIC_RELAXED);
  }
}

static size_t cache_slot(uintptr_t pc) {
  return (size_t)((pc * 0x9e3779b97f4a7c15u) >> 51) & (CACHE_SLOTS - 1);
}

uint64_t hd_cfi_rule_at(uintptr_t pc, uint64_t generation, bool may_lock_loader) {
  const uint64_t key = cache_key(pc, generation);
  const size_t slot = cache_slot(pc);
  const uint64_t rule = __atomic_load_n(&g_cache[slot].rule, __ATOMIC_RELAXED);
  const uint64_t check = __atomic_load_n(&g_cache[slot].check, __ATOMIC_RELAXED);
  if ((check ^ mix(rule)) == key) return rule;
  hd_cfi_module m;
  hd_cfi_lookup found = hd_cfi_find_module(pc, &m);
  /* Outside the modules loaded with the program, the list may be stale: glibc loads and unloads
   * modules without dlopen. The loader's counts say whether it is, under the loader's lock, and
   * the module is looked up again in the list they confirm. In a signal handler the loader
   * cannot be asked (the interrupted code may be inside it): the list is taken as it is, which
   * only a module glibc unloaded without dlclose, whose range code on this very stack now
   * occupies, could make stale. */
  if ((found != HD_CFI_MODULE_FOUND || !m.resident) && may_lock_loader) {
    if (!hd_cfi_modules_current()) return RULE_UNSUPPORTED; /* not cached */
    found = hd_cfi_find_module(pc, &m);
  }
  if (found == HD_CFI_MODULE_CHANGING) return RULE_UNSUPPORTED;
  const uint64_t computed = found == HD_CFI_MODULE_FOUND
                                ? hd_cfi_rule(&m.tables, pc)
                                : RULE_NO_INFO; /* outside every module (JIT) */
  __atomic_store_n(&g_cache[slot].rule, computed, __ATOMIC_RELAXED);
  __atomic_store_n(&g_cache[slot].check, mix(computed) ^ key, __ATOMIC_RELAXED);
  /* A writer that read its generation before the list changed must not leave its entry for a
   * wrap of the generation to revive. */
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (hd_cfi_generation() != generation) {
    __atomic_store_n(&g_cache[slot].check, 0, __ATOMIC_RELAXED);
  }
  return computed;
}
