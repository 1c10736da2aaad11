/* Reachability roots of a process (see roots.h): where they are, from /proc and the thread
 * records of its resources table, then their bytes, read like block contents. */
#define _GNU_SOURCE
#include "roots.h"

#include <ctype.h>
#include <dirent.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "contents.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/contract/shm_layout.h"
#include "roots_internal.h"

bool hd_roots_grow(void **items, size_t count, size_t *capacity, size_t size) {
  if (count < *capacity) return true;
  size_t bigger = *capacity ? 2 * *capacity : 64;
  void *p = realloc(*items, bigger * size);
  if (p == NULL) return false;
  *items = p;
  *capacity = bigger;
  return true;
}

void hd_roots_add_root_as(gather *g, uint64_t start, uint64_t end, heapdump_client_RootKind kind,
                          uint64_t tid, const char *name, bool not_read) {
  if (start >= end) return;
  if (!hd_roots_grow((void **)&g->roots, g->root_count, &g->root_capacity, sizeof *g->roots)) {
    g->out_of_memory = true;
    return;
  }
  g->roots[g->root_count++] = (root){start, end, kind, tid, name, not_read};
}

void hd_roots_add_root(gather *g, uint64_t start, uint64_t end, heapdump_client_RootKind kind,
                       uint64_t tid, const char *name) {
  hd_roots_add_root_as(g, start, end, kind, tid, name, false);
}

/* ---- sets of address ranges ---- */

/* Adds [start, end) to s (kept sorted and disjoint). Linear in the set's size. */
bool hd_range_set_add(range_set *s, uint64_t start, uint64_t end) {
  if (start >= end) return true;
  size_t i = 0;
  while (i < s->count && s->items[i].end < start) i++;
  size_t j = i;
  while (j < s->count && s->items[j].start <= end) {
    if (s->items[j].start < start) start = s->items[j].start;
    if (s->items[j].end > end) end = s->items[j].end;
    j++;
  }
  if (j == i) { /* overlaps nothing: insert at i */
    if (!hd_roots_grow((void **)&s->items, s->count, &s->capacity, sizeof *s->items)) return false;
    memmove(&s->items[i + 1], &s->items[i], (s->count - i) * sizeof *s->items);
    s->count++;
  } else { /* replaces items [i, j) */
    memmove(&s->items[i + 1], &s->items[j], (s->count - j) * sizeof *s->items);
    s->count -= j - i - 1;
  }
  s->items[i] = (range){start, end};
  return true;
}

/* Removes [start, end) from s. */
bool hd_range_set_remove(range_set *s, uint64_t start, uint64_t end) {
  for (size_t i = 0; i < s->count && start < end; i++) {
    range r = s->items[i];
    if (r.end <= start || r.start >= end) continue;
    if (r.start < start && r.end > end) { /* splits it in two */
      if (!hd_roots_grow((void **)&s->items, s->count, &s->capacity, sizeof *s->items))
        return false;
      memmove(&s->items[i + 2], &s->items[i + 1], (s->count - i - 1) * sizeof *s->items);
      s->count++;
      s->items[i] = (range){r.start, start};
      s->items[i + 1] = (range){end, r.end};
      return true;
    }
    if (r.start < start) {
      s->items[i].end = start;
    } else if (r.end > end) {
      s->items[i].start = end;
    } else {
      memmove(&s->items[i], &s->items[i + 1], (s->count - i - 1) * sizeof *s->items);
      s->count--;
      i--;
    }
  }
  return true;
}

static bool readable_private(const mapping *m) { return m->perms[0] == 'r' && m->perms[3] == 'p'; }

/* Adds the readable private memory in [start, end) as roots of one kind (a range may span
 * several mappings, or holes). */
static void add_mapped(gather *g, uint64_t start, uint64_t end, heapdump_client_RootKind kind,
                       uint64_t tid, const char *name) {
  for (size_t i = 0; i < g->map_count; i++) {
    const mapping *m = &g->maps[i];
    if (m->end <= start || m->start >= end || !readable_private(m)) continue;
    hd_roots_add_root(g, m->start > start ? m->start : start, m->end < end ? m->end : end, kind,
                      tid, name);
  }
}

static const mapping *mapping_at(const gather *g, uint64_t address) {
  for (size_t i = 0; i < g->map_count; i++) {
    if (address >= g->maps[i].start && address < g->maps[i].end) return &g->maps[i];
  }
  return NULL;
}

static bool read_maps(pid_t pid, gather *g) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
  FILE *f = fopen(path, "re");
  if (f == NULL) return false;
  char *line = NULL;
  size_t line_size = 0;
  size_t capacity = 0;
  while (getline(&line, &line_size, f) > 0) {
    mapping m = {0};
    int name_at = 0;
    unsigned long long start, end, offset;
    if (sscanf(line, "%llx-%llx %4s %llx %*x:%*x %*u %n", &start, &end, m.perms, &offset,
               &name_at) < 4) {
      continue;
    }
    m.offset = offset;
    char *name = line + name_at;
    name[strcspn(name, "\n")] = '\0';
    m.start = start;
    m.end = end;
    if (g->map_count == MAX_MAPPINGS) { /* only counted: sent as a root not read */
      if (m.perms[0] == 'r' && m.perms[1] == 'w' && end > start) {
        if (!g->maps_cut) g->maps_cut_start = start;
        g->maps_cut = true;
        g->maps_cut_bytes += end - start;
      }
      continue;
    }
    m.path = strdup(name);
    if (m.path == NULL ||
        !hd_roots_grow((void **)&g->maps, g->map_count, &capacity, sizeof *g->maps)) {
      free(m.path);
      g->out_of_memory = true;
      break;
    }
    g->maps[g->map_count++] = m;
  }
  free(line);
  fclose(f);
  return !g->out_of_memory;
}

bool hd_roots_read_remote(pid_t pid, uint64_t address, void *out, size_t size) {
  struct iovec local = {out, size}, remote = {(void *)(uintptr_t)address, size};
  return process_vm_readv(pid, &local, 1, &remote, 1, 0) == (ssize_t)size;
}

/* The writable segments of the ELF module whose first page is mapped by m (offset 0): each
 * PT_LOAD with PF_W, from p_vaddr to p_vaddr + p_memsz past the load bias — its .data, its
 * .bss (also where the kernel maps it anonymously) and its relocated read-only data, read from
 * the program headers in the process's memory. False if m holds no ELF header. */
static bool add_elf_data(pid_t pid, gather *g, const mapping *m) {
  Elf64_Ehdr eh;
  if (!hd_roots_read_remote(pid, m->start, &eh, sizeof eh) ||
      memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64 ||
      eh.e_phentsize != sizeof(Elf64_Phdr) || eh.e_phnum == 0 || eh.e_phnum > 64 ||
      eh.e_phoff > m->end - m->start) {
    return false;
  }
  Elf64_Phdr ph[64];
  if (!hd_roots_read_remote(pid, m->start + eh.e_phoff, ph, eh.e_phnum * sizeof *ph)) return false;
  uint64_t bias = 0;
  bool found = false;
  for (unsigned i = 0; i < eh.e_phnum && !found; i++) {
    if (ph[i].p_type == PT_LOAD && ph[i].p_offset == 0) { /* the segment m maps */
      bias = m->start - (ph[i].p_vaddr & ~(uint64_t)0xfff);
      found = true;
    }
  }
  if (!found) return false;
  for (unsigned i = 0; i < eh.e_phnum; i++) {
    if (ph[i].p_type != PT_LOAD || !(ph[i].p_flags & PF_W) || ph[i].p_memsz == 0) continue;
    uint64_t start = bias + ph[i].p_vaddr;
    if (start < bias || ph[i].p_memsz > UINT64_MAX - start) continue; /* hostile headers */
    add_mapped(g, start, start + ph[i].p_memsz, heapdump_client_RootKind_ROOT_KIND_DATA, 0,
               m->path);
  }
  return true;
}

/* Modules' writable data: from each module's program headers; where they cannot be read, the
 * module's writable private file mappings. */
static void add_module_data(pid_t pid, gather *g) {
  for (size_t i = 0; i < g->map_count; i++) {
    const mapping *m = &g->maps[i];
    if (m->path[0] != '/' || m->offset != 0 || !readable_private(m) || add_elf_data(pid, g, m)) {
      continue;
    }
    for (size_t k = 0; k < g->map_count; k++) {
      const mapping *w = &g->maps[k];
      if (w->perms[1] == 'w' && readable_private(w) && strcmp(w->path, m->path) == 0) {
        hd_roots_add_root(g, w->start, w->end, heapdump_client_RootKind_ROOT_KIND_DATA, 0, w->path);
      }
    }
  }
}

/* A record of memory that is not the program's, applied in the order of the log. */
static void apply_mapping_record(gather *g, const hd_mapping_change *m) {
  if (m->kind == HD_MAPPING_BRK_HEAP) {
    g->brk_heap = m->mapped;
    return;
  }
  if (m->kind == HD_MAPPING_BLOCKS_MAPPED) {
    g->blocks_mapped = m->mapped;
    return;
  }
  if (m->kind == HD_MAPPING_HEAPDUMP_TLS) {
    if (m->mapped && g->heapdump_tls_count < sizeof g->heapdump_tls / sizeof *g->heapdump_tls) {
      g->heapdump_tls[g->heapdump_tls_count++] = (struct tls_span){m->start, m->size};
    }
    return;
  }
  range_set *set = m->kind == HD_MAPPING_ALLOCATOR  ? &g->allocator
                   : m->kind == HD_MAPPING_HEAPDUMP ? &g->heapdump
                                                    : NULL;
  if (set == NULL || m->size == 0 || m->start + m->size < m->start) return; /* hostile */
  const bool ok = m->mapped ? hd_range_set_add(set, m->start, m->start + m->size)
                            : hd_range_set_remove(set, m->start, m->start + m->size);
  if (!ok) g->out_of_memory = true;
}

void hd_roots_read_records(hd_process *p, gather *g) {
  hd_res_entry *entry = malloc(sizeof *entry);
  if (entry == NULL) {
    g->out_of_memory = true;
    return;
  }
  uint64_t cursor = 0;
  size_t mapping_records = 0;
  while (!g->out_of_memory && hd_res_reader_next(p->res, &cursor, entry) == HD_READ_OK) {
    if (entry->type == HD_ENTRY_MAPPING) {
      if (mapping_records++ < MAX_MAPPING_RECORDS) {
        apply_mapping_record(g, &entry->u.mapping);
      } else {
        g->records_cut = true;
      }
      continue;
    }
    if (entry->type != HD_ENTRY_THREAD_ROOTS) continue;
    if (!hd_roots_grow((void **)&g->threads, g->thread_count, &g->thread_capacity,
                       sizeof *g->threads)) {
      g->out_of_memory = true;
      break;
    }
    g->threads[g->thread_count++] = entry->u.thread_roots;
  }
  free(entry);
}

/* The newest record of a tid: tids are reused, and a thread records itself once. */
static const hd_thread_roots *thread_record(const gather *g, uint64_t tid) {
  for (size_t i = g->thread_count; i-- > 0;) {
    if (g->threads[i].tid == tid) return &g->threads[i];
  }
  return NULL;
}

static bool read_small_file(const char *path, char *out, size_t size) {
  FILE *f = fopen(path, "re");
  if (f == NULL) return false;
  size_t n = fread(out, 1, size - 1, f);
  out[n] = '\0';
  fclose(f);
  return n > 0;
}

/* The tid a thread has in its process's own PID namespace (its NSpid's last field). */
static uint64_t own_tid(const hd_process *p, uint64_t tid) {
  if (p->own_pid == p->pid) return tid;
  char path[96], status[4096];
  snprintf(path, sizeof path, "/proc/%d/task/%" PRIu64 "/status", (int)p->pid, tid);
  if (!read_small_file(path, status, sizeof status)) return tid;
  const char *line = strstr(status, "\nNSpid:");
  if (line == NULL) return tid;
  line += strlen("\nNSpid:");
  uint64_t last = tid;
  for (char *end;; line = end) {
    unsigned long long v = strtoull(line, &end, 10);
    if (end == line) break;
    last = v;
  }
  return last;
}

/* A thread blocked in the kernel shows its stack pointer in /proc/PID/task/TID/syscall ("NR
 * ARGS... SP PC", or "-1 SP PC"); a running one shows "running". */
static bool blocked_stack_pointer(pid_t pid, uint64_t tid, uint64_t *sp) {
  char path[96], text[256];
  snprintf(path, sizeof path, "/proc/%d/task/%" PRIu64 "/syscall", (int)pid, tid);
  if (!read_small_file(path, text, sizeof text) || strncmp(text, "running", 7) == 0) return false;
  char *fields[9];
  size_t n = 0;
  for (char *save = NULL, *f = strtok_r(text, " \n", &save); f != NULL && n < 9;
       f = strtok_r(NULL, " \n", &save)) {
    fields[n++] = f;
  }
  if (n < 3) return false;
  char *end;
  unsigned long long v = strtoull(fields[n - 2], &end, 16);
  if (*end != '\0' || v == 0) return false;
  *sp = v;
  return true;
}

static void add_thread(hd_process *p, gather *g, uint64_t tid) {
  uint64_t own = own_tid(p, tid);
  const hd_thread_roots *rec = thread_record(g, own);
  if (rec != NULL && g->record_alive != NULL) g->record_alive[rec - g->threads] = true;
  uint64_t sp = 0;
  bool blocked = blocked_stack_pointer(p->pid, tid, &sp);
  uint64_t lo = 0, hi = 0;
  if (rec != NULL && rec->stack_hi > rec->stack_lo) {
    lo = rec->stack_lo;
    hi = rec->stack_hi;
    /* The main thread's stack as glibc gives it ends one page above where the program's first
     * frame began (__libc_stack_end), not at the top of [stack]: above lie argv, envp and their
     * strings, which programs rewrite with pointers to blocks (setproctitle's copies of argv). */
    const mapping *m = mapping_at(g, hi - 1);
    if (m != NULL && m->end > hi && strcmp(m->path, "[stack]") == 0) hi = m->end;
  } else if (blocked) {
    const mapping *m = mapping_at(g, sp);
    if (m != NULL) {
      lo = m->start;
      hi = m->end;
    }
  }
  if (hi > lo) {
    /* Not the red zone below it: a thread blocked in the kernel sits in a system call wrapper,
     * and below its stack pointer lie the dead frames of the calls it made before, whose stale
     * pointers would keep lost blocks reachable. */
    uint64_t start = blocked && sp >= lo && sp < hi ? sp : lo;
    add_mapped(g, start, hi, heapdump_client_RootKind_ROOT_KIND_STACK, own, "");
    if (hd_roots_grow((void **)&g->live, g->live_count, &g->live_capacity, sizeof *g->live)) {
      g->live[g->live_count++] = (struct stack_span){lo, hi};
    } else {
      g->out_of_memory = true;
    }
  }
  if (rec == NULL || rec->thread_pointer == 0 ||
      (rec->thread_pointer >= lo && rec->thread_pointer < hi)) {
    return; /* a thread started by pthread_create keeps its TLS at the top of its stack */
  }
  const mapping *m = mapping_at(g, rec->thread_pointer);
  if (m == NULL || !readable_private(m)) return;
  uint64_t tp = rec->thread_pointer, start = m->start, end = m->end;
  if (end - start > TLS_WHOLE_MAPPING_MAX) {
    if (tp - start > TLS_BELOW) start = tp - TLS_BELOW;
    if (end - tp > TLS_ABOVE) end = tp + TLS_ABOVE;
  }
  hd_roots_add_root(g, start, end, heapdump_client_RootKind_ROOT_KIND_TLS, own, "");
}

/* An exited thread's control block, where glibc keeps its stack for the next thread: it still
 * points to the thread's dynamic thread vector, a block the next thread will use. Only a real
 * control block is taken, one that points to itself (x86-64 tcbhead_t: tcb and self). */
static void add_exited_thread(hd_process *p, gather *g, const hd_thread_roots *rec) {
  uint64_t tp = rec->thread_pointer;
  if (tp == 0) return;
  for (size_t i = 0; i < g->live_count; i++) {
    if (tp >= g->live[i].lo && tp < g->live[i].hi) return; /* a live thread's now */
  }
  for (size_t i = 0; i < g->root_count; i++) {
    if (g->roots[i].kind == heapdump_client_RootKind_ROOT_KIND_TLS && g->roots[i].start == tp) {
      return; /* taken already, for an earlier thread with the same stack */
    }
  }
  const mapping *m = mapping_at(g, tp);
  if (m == NULL || !readable_private(m) || m->path[0] != '\0') return;
  uint64_t head[3];
  struct iovec local = {head, sizeof head}, remote = {(void *)(uintptr_t)tp, sizeof head};
  if (process_vm_readv(p->pid, &local, 1, &remote, 1, 0) != (ssize_t)sizeof head || head[0] != tp ||
      head[2] != tp) {
    return;
  }
  hd_roots_add_root(g, tp, m->end - tp > TCB_SPAN ? tp + TCB_SPAN : m->end,
                    heapdump_client_RootKind_ROOT_KIND_TLS, rec->tid, "");
}

static void add_threads(hd_process *p, gather *g) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/task", (int)p->pid);
  DIR *d = opendir(path);
  if (d == NULL) return;
  g->record_alive = calloc(g->thread_count + 1, sizeof *g->record_alive);
  for (struct dirent *e; (e = readdir(d)) != NULL && !g->out_of_memory;) {
    if (!isdigit((unsigned char)e->d_name[0])) continue;
    add_thread(p, g, strtoull(e->d_name, NULL, 10));
  }
  closedir(d);
  for (size_t i = 0; g->record_alive != NULL && i < g->thread_count && !g->out_of_memory; i++) {
    if (!g->record_alive[i]) add_exited_thread(p, g, &g->threads[i]);
  }
}

/* Roots in pieces of at most ROOT_PIECE bytes: each is read into one buffer. */
static void split_in_pieces(gather *g) {
  size_t extra = 0;
  for (size_t i = 0; i < g->root_count; i++) {
    if (!g->roots[i].not_read) extra += (g->roots[i].end - g->roots[i].start - 1) / ROOT_PIECE;
  }
  if (extra == 0) return;
  root *pieces = malloc((g->root_count + extra) * sizeof *pieces);
  if (pieces == NULL) {
    g->out_of_memory = true;
    return;
  }
  size_t n = 0;
  for (size_t i = 0; i < g->root_count; i++) {
    root r = g->roots[i];
    if (r.not_read) {
      pieces[n++] = r;
      continue;
    }
    for (uint64_t at = r.start; at < r.end; at += ROOT_PIECE) {
      pieces[n] = r;
      pieces[n].start = at;
      pieces[n++].end = r.end - at > ROOT_PIECE ? at + ROOT_PIECE : r.end;
    }
  }
  free(g->roots);
  g->roots = pieces;
  g->root_count = n;
  g->root_capacity = n;
}

static int compare_u64(const void *a, const void *b) {
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

uint64_t *hd_roots_sorted_addresses(const hd_live_block *blocks, size_t count) {
  uint64_t *addresses = malloc((count ? count : 1) * sizeof *addresses);
  if (addresses == NULL) return NULL;
  for (size_t i = 0; i < count; i++) addresses[i] = blocks[i].address;
  qsort(addresses, count, sizeof *addresses, compare_u64);
  return addresses;
}

static int compare_roots(const void *a, const void *b) {
  const root *x = a, *y = b;
  return x->start < y->start ? -1 : x->start > y->start;
}

/* Sorted by address, each starting past the end of the one before (a TLS mapping next to a
 * module's data, say, is read once). */
static void remove_overlaps(gather *g) {
  if (g->root_count > 1) qsort(g->roots, g->root_count, sizeof *g->roots, compare_roots);
  size_t kept = 0;
  uint64_t covered = 0;
  for (size_t i = 0; i < g->root_count; i++) {
    root r = g->roots[i];
    if (r.start < covered) r.start = covered;
    if (r.start >= r.end) continue;
    g->roots[kept++] = r;
    covered = r.end;
  }
  g->root_count = kept;
}

typedef struct emit {
  const gather *g;
  bool *emitted; /* per root */
  hd_batch_writer *w;
} emit;

static HD_MUST_CHECK hd_status send_root(hd_batch_writer *w, const root *r, uint64_t address,
                                         const uint8_t *bytes, uint64_t size, bool not_read) {
  heapdump_client_RootRegion region = heapdump_client_RootRegion_init_zero;
  region.has_address = region.has_size = region.has_kind = true;
  region.address = address;
  region.size = size;
  region.kind = r->kind;
  region.has_thread_koid = r->tid != 0;
  region.thread_koid = r->tid;
  region.has_name = r->name[0] != '\0';
  snprintf(region.name, sizeof region.name, "%s", r->name);
  region.has_not_read = not_read;
  region.not_read = not_read;
  return hd_batch_add_root_region(w, &region, bytes, not_read ? 0 : size);
}

static HD_MUST_CHECK hd_status emit_root(void *ctx, uint64_t address, const uint8_t *bytes,
                                         uint64_t size) {
  const emit *e = ctx;
  size_t lo = 0, hi = e->g->root_count;
  while (lo < hi) { /* the root that starts at address */
    size_t mid = lo + (hi - lo) / 2;
    if (e->g->roots[mid].start < address) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == e->g->root_count || e->g->roots[lo].start != address) return HD_OK;
  e->emitted[lo] = true;
  return send_root(e->w, &e->g->roots[lo], address, bytes, size, false);
}

/* Where the roots are: modules' data and threads' stacks and TLS from /proc and the thread
 * records; then the program's own mappings; less what is not the program's. */
static void gather_roots(hd_process *p, const hd_live_block *blocks, size_t block_count,
                         gather *g) {
  if (!read_maps(p->pid, g)) return;
  hd_roots_read_records(p, g);
  add_module_data(p->pid, g);
  add_threads(p, g);
  /* On glibc: its memory among the program's mappings, and the blocks it holds that were not
   * recorded (a recorded block may hang from them). */
  g->unrecorded = hd_res_reader_sample_bytes(p->res) != 0 ||
                  hd_res_reader_arm_state(p->res) != HD_ARM_FROM_START;
  uint64_t *addresses = NULL;
  if (g->brk_heap || g->blocks_mapped) {
    addresses = hd_roots_sorted_addresses(blocks, block_count);
    if (addresses == NULL) {
      g->out_of_memory = true;
      return;
    }
    hd_roots_glibc_heaps(p->pid, g, addresses, block_count, g->unrecorded);
  }
  remove_overlaps(g);
  range_set taken = {0};
  if (g->root_count > 0) {
    taken.items = malloc(g->root_count * sizeof *taken.items);
    if (taken.items == NULL) {
      g->out_of_memory = true;
      free(addresses);
      return;
    }
    for (size_t i = 0; i < g->root_count; i++) {
      taken.items[i] = (range){g->roots[i].start, g->roots[i].end};
    }
    taken.count = taken.capacity = g->root_count;
  }
  if (!g->out_of_memory) {
    hd_roots_add_program_mappings(p, g, &taken, addresses, g->blocks_mapped ? block_count : 0);
  }
  free(addresses);
  free(taken.items);
  remove_overlaps(g);
  hd_roots_remove_not_the_programs(g);
  split_in_pieces(g);
}

hd_status hd_add_roots(hd_process *p, const hd_live_block *blocks, size_t block_count,
                       uint64_t max_total, bool *cut, hd_batch_writer *w) {
  gather g = {.pagemap_fd = -1};
  hd_status status = HD_OK;
  *cut = false;
  gather_roots(p, blocks, block_count, &g);
  if (g.records_cut) *cut = true;
  hd_live_block *reads = g.out_of_memory ? NULL : calloc(g.root_count + 1, sizeof *reads);
  bool *emitted = g.out_of_memory ? NULL : calloc(g.root_count + 1, sizeof *emitted);
  if (reads != NULL && emitted != NULL) {
    size_t n = 0;
    for (size_t i = 0; i < g.root_count; i++) {
      if (g.roots[i].not_read) continue;
      reads[n].address = g.roots[i].start;
      reads[n++].size = g.roots[i].end - g.roots[i].start;
    }
    emit e = {&g, emitted, w};
    status = hd_read_block_contents(p->pid, p->pidfd, reads, n, ROOT_PIECE, max_total, cut,
                                    emit_root, &e);
    /* What was left out (too much, unreadable, or past the bounds) is said, not dropped. */
    for (size_t i = 0; i < g.root_count && status == HD_OK; i++) {
      if (emitted[i]) continue;
      if (!g.roots[i].not_read) *cut = true;
      status = send_root(w, &g.roots[i], g.roots[i].start, NULL, g.roots[i].end - g.roots[i].start,
                         true);
    }
  }
  free(reads);
  free(emitted);
  for (size_t i = 0; i < g.map_count; i++) free(g.maps[i].path);
  free(g.maps);
  free(g.roots);
  free(g.threads);
  free(g.live);
  free(g.record_alive);
  free(g.allocator.items);
  free(g.heapdump.items);
  free(g.glibc.items);
  return status;
}
