/* Executable regions of loaded ELF modules, recorded into the resources table at start and
 * after dlopen/dlclose. Takes the loader lock (dl_iterate_phdr): never called on the hot path. */
#define _GNU_SOURCE
#include <elf.h>
#include <link.h>
#include <pthread.h>
#include <string.h>

#include "regions.h"

#define MAX_SEEN 4096

static pthread_mutex_t g_scan_lock = PTHREAD_MUTEX_INITIALIZER;
/* Modules already recorded (under g_scan_lock); a module reloaded elsewhere is recorded again,
 * an unloaded one stays recorded. */
static struct {
  uintptr_t base;
  uint64_t name_hash;
} g_seen[MAX_SEEN];
static unsigned g_seen_count;
static unsigned long long g_adds = ~0ull, g_subs = ~0ull;

static uint64_t hash_str(const char *s) {
  uint64_t h = 1469598103934665603u;
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211u;
  return h;
}

static unsigned read_build_id(const struct dl_phdr_info *info, uint8_t *out) {
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
    if (ph->p_type != PT_NOTE) continue;
    const uint8_t *p = (const uint8_t *)(info->dlpi_addr + ph->p_vaddr);
    const uint8_t *end = p + ph->p_memsz;
    while (p + sizeof(ElfW(Nhdr)) <= end) {
      const ElfW(Nhdr) *n = (const ElfW(Nhdr) *)p;
      size_t name_sz = (n->n_namesz + 3u) & ~3u, desc_sz = (n->n_descsz + 3u) & ~3u;
      const uint8_t *name = p + sizeof(*n), *desc = name + name_sz;
      if (desc + desc_sz > end) break;
      if (n->n_type == NT_GNU_BUILD_ID && n->n_namesz == 4 && memcmp(name, "GNU", 4) == 0) {
        unsigned len = n->n_descsz > HD_MAX_BUILD_ID ? HD_MAX_BUILD_ID : n->n_descsz;
        memcpy(out, desc, len);
        return len;
      }
      p = desc + desc_sz;
    }
  }
  return 0;
}

struct scan_ctx {
  hd_res_table *res;
  const char *exe_name;
  int first;
  int unchanged;
};

static int visit(struct dl_phdr_info *info, size_t size, void *arg) {
  struct scan_ctx *c = arg;
  if (c->first) {
    c->first = 0;
    if (size >= offsetof(struct dl_phdr_info, dlpi_subs) + sizeof(info->dlpi_subs)) {
      if (info->dlpi_adds == g_adds && info->dlpi_subs == g_subs) {
        c->unchanged = 1;
        return 1; /* nothing loaded or unloaded since the last scan */
      }
      g_adds = info->dlpi_adds;
      g_subs = info->dlpi_subs;
    }
  }
  const char *name = info->dlpi_name && info->dlpi_name[0] ? info->dlpi_name : c->exe_name;
  uint64_t nh = hash_str(name);
  for (unsigned i = 0; i < g_seen_count; i++)
    if (g_seen[i].base == info->dlpi_addr && g_seen[i].name_hash == nh) return 0;
  if (g_seen_count < MAX_SEEN) {
    g_seen[g_seen_count].base = info->dlpi_addr;
    g_seen[g_seen_count].name_hash = nh;
    g_seen_count++;
  }
  hd_region_info r;
  memset(&r, 0, sizeof(r));
  r.build_id_len = read_build_id(info, r.build_id);
  r.name = name;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
    if (ph->p_type != PT_LOAD || !(ph->p_flags & PF_X)) continue;
    r.address = info->dlpi_addr + ph->p_vaddr;
    r.size = ph->p_memsz;
    r.file_offset = ph->p_offset;
    r.vaddr = ph->p_vaddr;
    (void)hd_res_add_region(c->res, &r); /* a full table is counted inside */
  }
  return 0;
}

void hd_regions_scan(hd_res_table *res, const char *exe_name) {
  struct scan_ctx c = {res, exe_name ? exe_name : "", 1, 0};
  pthread_mutex_lock(&g_scan_lock);
  dl_iterate_phdr(visit, &c);
  pthread_mutex_unlock(&g_scan_lock);
}

void hd_regions_after_fork_child(void) { pthread_mutex_init(&g_scan_lock, NULL); }
