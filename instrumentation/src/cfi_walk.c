/* Our x86-64 unwinder: the walk (the module list, rule cache and rule compiler are the other
 * cfi_*.c files). For each frame it needs three numbers: where the frame's CFA (the stack
 * pointer before the call) is, relative to rsp or rbp; where below the CFA the return address
 * is; and where the caller's rbp was saved, if it was. DWARF's call-frame information says that
 * for every instruction, in a byte code that libgcc and libunwind interpret anew on each step.
 * Here the byte code of the frame's FDE is run once per program counter and compiled into one
 * 64-bit rule, which a cache keeps; the allocation path then reads a rule and two stack slots per
 * frame, with no lock, no system call and no allocation.
 *
 * Code with no call-frame information at all (outside every module: JIT code; a module without
 * .eh_frame_hdr; a gap between a module's FDEs: hand-written assembly) is stepped over as a
 * frame-pointer frame where rbp points at one, as libunwind does. What a rule cannot say (a CFA
 * computed by an expression, a return address kept in another register) ends the walk there:
 * HD_CFI_UNSUPPORTED, with the frames walked so far. */
#define _GNU_SOURCE
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>

#include "cfi_internal.h"

bool hd_cfi_thread_stack(uintptr_t *lo, uintptr_t *hi) {
  pthread_attr_t attr;
  void *addr;
  size_t size;
  bool found = false;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    if (pthread_attr_getstack(&attr, &addr, &size) == 0) {
      *lo = (uintptr_t)addr;
      *hi = (uintptr_t)addr + size;
      found = true;
    }
    pthread_attr_destroy(&attr);
  }
  return found;
}

bool hd_cfi_in_bounds(const hd_cfi_bounds *b, uintptr_t addr, uintptr_t size) {
  for (unsigned i = 0; i < b->count; i++) {
    if (addr >= b->lo[i] && b->hi[i] >= size && addr <= b->hi[i] - size) return true;
  }
  return false;
}

/* What a walk read (NULL record: nothing is kept); `fits` is cleared when it outgrows the
 * record.
 *
 * Not everything read decides the walk. Code built without frame pointers uses rbp as an
 * ordinary register, so the rbp a frame saved is often data that changes from call to call; it
 * matters only if a later frame's CFA is rbp-based before another saved rbp replaces it. The log
 * keeps which read gave the current rbp (bp_source, -1: the rbp the walk started with) and from
 * which frame on it is the current one (bp_since), and marks the read needed, and those frames
 * as using the rbp they started with, when a CFA uses it; return addresses are always needed.
 * Trails and memos keep only the needed reads, and compare a starting rbp only if it is used.
 *
 * last: the thread's trail, which the walk may join (NULL: none); last_pos is the frame of it
 * the walk's stack pointer has reached (from the innermost outwards; UINT_MAX once past its
 * outermost frame). Its reads are checked from
 * the outermost inwards, as far as a join needs: every one before last_checked_to holds, and
 * last_changed is the first found changed (UINT_MAX: none yet). */
typedef struct walk_log {
  hd_cfi_walk_record *record;
  bool fits;
  int bp_source;
  unsigned bp_since;
  hd_cfi_trail *last;
  unsigned last_pos, last_checked_to, last_changed;
  bool joined, joined_trail; /* joined_trail: the trail is now this walk's */
  bool by_frame_pointer;     /* a frame without call-frame information was stepped by rbp */
} walk_log;

static void set_bit(uint64_t *words, unsigned i) { words[i / 64] |= (uint64_t)1 << (i % 64); }
static bool bit_set(const uint64_t *words, unsigned i) { return (words[i / 64] >> (i % 64)) & 1; }
/* Clears bits [from, 128) of a two-word set. */
static void clear_bits_from(uint64_t *words, unsigned from) {
  if (from < 64) {
    words[0] &= ((uint64_t)1 << from) - 1;
    words[1] = 0;
  } else if (from < 128) {
    words[1] &= ((uint64_t)1 << (from - 64)) - 1;
  }
}

/* A saved register at addr, which must lie in the stack no lower than `floor`; frame: the frame
 * reading it; gives_bp: it is the next frame's rbp. */
static bool read_saved(const hd_cfi_bounds *b, uintptr_t addr, uintptr_t floor, uintptr_t *out,
                       unsigned frame, bool gives_bp, walk_log *log) {
  if (addr < floor || !hd_cfi_in_bounds(b, addr, sizeof *out)) return false;
  memcpy(out, (const void *)addr, sizeof *out); /* a CFA from a bad rbp need not be aligned */
  if (!log->fits) return true;
  hd_cfi_walk_record *r = log->record;
  if (r->read_count == HD_CFI_TRAIL_READS) {
    log->fits = false;
    return true;
  }
  const unsigned k = r->read_count++;
  r->slot[k] = addr;
  r->value[k] = *out;
  if (gives_bp) {
    log->bp_source = (int)k;
    log->bp_since = frame + 1;
  } else {
    set_bit(r->needed, k);
  }
  return true;
}

/* Frame `frame` (or, when it is the frame a walk joins, the frames of the trail from there on)
 * uses the current rbp. */
static void bp_used(walk_log *log, unsigned frame) {
  if (!log->fits) return;
  if (log->bp_source >= 0) set_bit(log->record->needed, (unsigned)log->bp_source);
  for (unsigned i = log->bp_since; i <= frame; i++) set_bit(log->record->bp_needed, i);
}

/* Where frame n of the walk stands (its pc is in the walk's frames). */
static void log_frame(walk_log *log, unsigned n, uintptr_t sp, uintptr_t bp, bool after_call) {
  if (!log->fits) return;
  hd_cfi_walk_record *r = log->record;
  r->sp[n] = sp;
  r->bp[n] = bp;
  r->first_read[n] = (uint8_t)r->read_count;
  if (after_call) set_bit(r->after_call, n);
}

/* Makes the walk's frames [0, n) (program counters in `frames`, the rest in record r), innermost
 * first, frames [at, at + n) of trail t, innermost last, with their needed reads. */
static void trail_put_record(hd_cfi_trail *t, unsigned at, const uint64_t *frames,
                             const hd_cfi_walk_record *r, unsigned n) {
  clear_bits_from(t->after_call, at);
  clear_bits_from(t->bp_needed, at);
  unsigned reads = at == 0 ? 0 : t->first_read[at];
  for (unsigned j = 0; j < n; j++) {
    const unsigned k = n - 1 - j, q = at + j;
    t->pc[q] = frames[k];
    t->sp[q] = r->sp[k];
    t->bp[q] = r->bp[k];
    if (bit_set(r->after_call, k)) set_bit(t->after_call, q);
    if (bit_set(r->bp_needed, k)) set_bit(t->bp_needed, q);
    t->first_read[q] = (uint8_t)reads;
    const unsigned read_end = k + 1 < n ? r->first_read[k + 1] : r->read_count;
    for (unsigned i = r->first_read[k]; i < read_end; i++) {
      if (!bit_set(r->needed, i)) continue;
      t->slot[reads] = r->slot[i];
      t->value[reads++] = r->value[i];
    }
  }
  t->first_read[at + n] = (uint8_t)reads;
  t->frame_count = at + n;
  t->read_count = reads;
}

/* Whether the walk, at its frame n (pc, sp, bp, after_call), can join the thread's trail; if so,
 * frames[n..*count) are the trail's frames from there outwards (up to capacity), *end is how it
 * ends, and the trail becomes this walk's (unless the record is full or the walk is cut by the
 * capacity: the trail then stays the earlier walk's, as valid to join as before). */
static bool join_last(walk_log *log, unsigned n, uintptr_t pc, uintptr_t sp, uintptr_t bp,
                      bool after_call, uint64_t *frames, unsigned capacity, unsigned *count,
                      hd_cfi_end *end) {
  hd_cfi_trail *last = log->last;
  unsigned q = log->last_pos;
  while (q != UINT_MAX && last->sp[q] < sp) q--;
  log->last_pos = q;
  if (q == UINT_MAX || last->sp[q] != sp || last->pc[q] != pc ||
      bit_set(last->after_call, q) != after_call ||
      (bit_set(last->bp_needed, q) && last->bp[q] != bp)) {
    return false;
  }
  /* Frames q outwards read [0, first_read[q + 1]). The frames a walk meets only go outwards, so
   * a read is checked at most once per walk. */
  const unsigned reads_end = last->first_read[q + 1];
  if (reads_end > log->last_changed) return false;
  for (unsigned k = log->last_checked_to; k < reads_end; k++) {
    uintptr_t now;
    memcpy(&now, (const void *)last->slot[k], sizeof now);
    if (now != last->value[k]) {
      log->last_changed = k;
      return false;
    }
  }
  if (reads_end > log->last_checked_to) log->last_checked_to = reads_end;
  const unsigned total = n + q + 1;
  /* A trail cut by its capacity does not say what lies past its end. */
  if (last->end == HD_CFI_FULL && total < capacity) return false;
  const unsigned kept = (total < capacity ? total : capacity) - n;
  for (unsigned i = 0; i < kept; i++) frames[n + i] = last->pc[q - i];
  *count = n + kept;
  *end = total > capacity ? HD_CFI_FULL : (hd_cfi_end)last->end;
  log->joined = true;
  if (!log->fits || total > capacity) return true;
  /* The frames joined use the rbp this walk brings them. */
  if (n > 0 && bit_set(last->bp_needed, q)) bp_used(log, n - 1);
  trail_put_record(last, q + 1, frames, log->record, n);
  log->joined_trail = true;
  return true;
}

/* Whether memo m still describes a walk starting at sp and bp: every slot it read holds the
 * value it read. The slots were in this thread's stack, which stays mapped while it runs. */
static bool memo_holds(const hd_cfi_memo *m, uintptr_t pc, uintptr_t sp, uintptr_t bp,
                       uint64_t generation) {
  if (m->frame_count == 0 || m->pc != pc || m->sp != sp || (m->bp_matters && m->bp != bp) ||
      m->generation != generation) {
    return false;
  }
  uintptr_t differs = 0;
  for (unsigned i = 0; i < m->read_count; i++) {
    uintptr_t now;
    memcpy(&now, (const void *)m->slot[i], sizeof now);
    differs |= now ^ m->value[i];
  }
  return differs == 0;
}

/* Below its stack pointer a function may keep data in the 128-byte red zone (psABI 3.2.2), and
 * after `leave` its CFI still places the caller's rbp in the slot just popped: a frame's saved
 * registers lie no lower than rsp - RED_ZONE. */
#define RED_ZONE 128

/* The kernel's signal frame on x86-64: the handler returns to the restorer with rsp at the
 * ucontext_t, whose gregs (at offset 40) hold the interrupted registers. */
enum { UC_GREGS = 40, GREG_RBP = 10, GREG_RSP = 15, GREG_RIP = 16 };

/* The walk itself, from the frame that returns to pc with sp and bp; logs what it reads. */
static hd_cfi_end walk(const hd_cfi_bounds *bounds, uintptr_t pc, uintptr_t sp, uintptr_t bp,
                       uint64_t generation, bool may_lock_loader, uint64_t *frames,
                       unsigned capacity, unsigned *count, walk_log *log) {
  bool after_call = true; /* pc is a return address: its call is the instruction before it */
  unsigned n = 0;
  hd_cfi_end end = HD_CFI_UNSUPPORTED;
  for (;;) {
    if (n == capacity) {
      end = HD_CFI_FULL;
      break;
    }
    if (log->last != NULL &&
        join_last(log, n, pc, sp, bp, after_call, frames, capacity, count, &end)) {
      return end;
    }
    log_frame(log, n, sp, bp, after_call);
    const unsigned frame = n;
    frames[n++] = pc;
    const uint64_t rule = hd_cfi_rule_at(after_call ? pc - 1 : pc, generation, may_lock_loader);
    if (RULE_KIND(rule) == RULE_OUTERMOST) {
      end = HD_CFI_COMPLETE;
      break;
    }
    if (rule == RULE_NO_INFO) {
      /* Code without call-frame information: a frame-pointer frame if rbp points at a (saved
       * rbp, return address) pair above rsp, as libunwind steps it. Such a walk is neither
       * remembered nor made the trail: rbp may hold anything in code without frame pointers. */
      log->fits = false;
      log->by_frame_pointer = true;
      uintptr_t ra, saved_bp;
      if (bp % 8 != 0 || !read_saved(bounds, bp + 8, sp, &ra, frame, false, log) ||
          !read_saved(bounds, bp, sp, &saved_bp, frame, true, log)) {
        break;
      }
      sp = bp + 16;
      pc = ra;
      bp = saved_bp;
      after_call = true;
    } else if (RULE_KIND(rule) == RULE_UNSUPPORTED) {
      break;
    } else if (RULE_KIND(rule) == RULE_SIGNAL) {
      const uintptr_t gregs = sp + UC_GREGS;
      if (!read_saved(bounds, gregs + 8 * GREG_RIP, sp, &pc, frame, false, log) ||
          !read_saved(bounds, gregs + 8 * GREG_RSP, sp, &sp, frame, false, log) ||
          !read_saved(bounds, gregs + 8 * GREG_RBP, gregs, &bp, frame, true, log)) {
        break;
      }
      after_call = false; /* the interrupted instruction itself */
    } else {
      if (RULE_CFA_RBP(rule)) bp_used(log, frame);
      const uintptr_t cfa = (RULE_CFA_RBP(rule) ? bp : sp) + (intptr_t)RULE_CFA_OFFSET(rule);
      if (cfa <= sp) break; /* each caller's frame is above its callee's */
      uintptr_t ra;
      if (!read_saved(bounds, cfa + 8 * (intptr_t)RULE_RA_WORDS(rule), sp - RED_ZONE, &ra, frame,
                      false, log)) {
        break;
      }
      if (RULE_RBP_SAVED(rule) && !read_saved(bounds, cfa + 8 * (intptr_t)RULE_RBP_WORDS(rule),
                                              sp - RED_ZONE, &bp, frame, true, log)) {
        break;
      }
      sp = cfa;
      pc = ra;
      after_call = true;
    }
    if (pc == 0) {
      end = HD_CFI_COMPLETE;
      break;
    }
  }
  *count = n;
  return end;
}

/* Keeps the walk trail t describes (its frames given innermost first) as memo m. False if it
 * does not fit one. */
static bool memoize_trail(hd_cfi_memo *m, const hd_cfi_trail *t, const uint64_t *frames,
                          uintptr_t pc, uintptr_t sp, uintptr_t bp) {
  if (t->frame_count > HD_CFI_MEMO_FRAMES || t->read_count > HD_CFI_MEMO_READS) return false;
  memcpy(m->slot, t->slot, t->read_count * sizeof *m->slot);
  memcpy(m->value, t->value, t->read_count * sizeof *m->value);
  m->read_count = t->read_count;
  m->pc = pc;
  m->sp = sp;
  m->bp = bp;
  m->bp_matters = bit_set(t->bp_needed, t->frame_count - 1);
  m->generation = t->generation;
  m->end = t->end;
  memcpy(m->frames, frames, t->frame_count * sizeof *frames);
  m->frame_count = t->frame_count;
  m->stack_key = 0;
  return true;
}

hd_cfi_end hd_cfi_backtrace(const hd_cfi_bounds *bounds, uintptr_t pc, uintptr_t sp, uintptr_t bp,
                            bool may_lock_loader, uint64_t *frames, unsigned capacity,
                            unsigned *count, hd_cfi_memos *memos, bool *reused, bool *joined,
                            bool *by_frame_pointer, uint32_t **stack_key) {
  const uint64_t generation = hd_cfi_generation();
  *reused = false;
  *joined = false;
  *by_frame_pointer = false;
  *stack_key = NULL;
  /* A walk on an alternate signal stack is not remembered: its bounds come and go. */
  const bool memoize = memos != NULL && bounds->count == 1;
  for (unsigned i = 0; memoize && i < HD_CFI_MEMOS; i++) {
    const hd_cfi_memo *m = &memos->entry[i];
    /* A walk cut by its capacity is the walk of another capacity only if they are equal. */
    const bool fits =
        m->end == HD_CFI_FULL ? m->frame_count == capacity : m->frame_count <= capacity;
    if (fits && memo_holds(m, pc, sp, bp, generation)) {
      memcpy(frames, m->frames, m->frame_count * sizeof *frames);
      *count = m->frame_count;
      *reused = true;
      *stack_key = &memos->entry[i].stack_key;
      return (hd_cfi_end)m->end;
    }
  }
  walk_log log = {.bp_source = -1, .last_changed = UINT_MAX};
  hd_cfi_trail *t = NULL;
  if (memoize && capacity <= HD_CFI_TRAIL_FRAMES) {
    t = &memos->trail;
    hd_cfi_walk_record *r = &memos->record;
    r->read_count = 0;
    memset(r->after_call, 0, sizeof r->after_call);
    memset(r->bp_needed, 0, sizeof r->bp_needed);
    memset(r->needed, 0, sizeof r->needed);
    log.record = r;
    log.fits = true;
    if (t->frame_count != 0 && t->generation == generation) {
      log.last = t;
      log.last_pos = t->frame_count - 1;
    }
  }
  const hd_cfi_end end =
      walk(bounds, pc, sp, bp, generation, may_lock_loader, frames, capacity, count, &log);
  *joined = log.joined;
  *by_frame_pointer = log.by_frame_pointer;
  if (t == NULL || end == HD_CFI_UNSUPPORTED) return end;
  if (log.joined) {
    if (!log.joined_trail) return end;
  } else {
    if (!log.fits) return end;
    trail_put_record(t, 0, frames, log.record, *count);
    t->end = end;
    t->generation = generation;
  }
  hd_cfi_memo *m = &memos->entry[memos->next];
  if (memoize_trail(m, t, frames, pc, sp, bp)) {
    *stack_key = &m->stack_key;
    memos->next = (memos->next + 1) % HD_CFI_MEMOS;
  }
  return end;
}
