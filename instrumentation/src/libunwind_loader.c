/* libunwind, loaded only when HEAPDUMP_UNWIND asks for it (libunwind, compare): never a
 * dependency of libheapdump.so, so that no program gets libunwind (nor the liblzma it needs)
 * because of us unless it was asked for. Loaded with a scope of its own (RTLD_LOCAL) from the
 * library's constructor, where dlopen may run.
 *
 * libunwind makes descriptors of its own while it unwinds: a validation pipe (re-created,
 * closing the old numbers, whenever a read from it fails), and an open file for each frame in a
 * module without .eh_frame_hdr, whose .debug_frame it then reads. In a program that closes every
 * descriptor and opens its own files, those numbers are the program's: the unwinder would read
 * from, write into and close them. So libunwind gets no descriptor at all: its imports of pipe2,
 * open, read, write, close and syscall are redirected, in its own global offset table, to
 * functions of ours that no one else can reach (nothing is exported to the program for this).
 * Its pipe was only a way to ask the kernel whether an address is readable (it drains the pipe,
 * then writes one byte from the address with syscall(SYS_write, ...)), so that conversation is
 * answered without one: its pipe2 succeeds with two ends that are no descriptors (-1), its read
 * finds the pipe empty, its write reads those bytes with process_vm_readv, which fails with EFAULT
 * where the write would have, and its close does nothing. Its open fails: a module without
 * .eh_frame_hdr ends the trace where frame pointers cannot continue it. Its dl_iterate_phdr is
 * redirected too, to hide the modules whose unwind tables our checks refused. */
#define _GNU_SOURCE
#include "libunwind_loader.h"

#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <stdarg.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define UNW_LOCAL_ONLY
#include <libunwind.h> /* for the names and constants only: nothing links against it */

#include "cfi.h"
#include "raw_syscall.h"

#define HD_STRINGIFY(x) #x
#define HD_NAME_OF(x) HD_STRINGIFY(x) /* the symbol a libunwind.h macro stands for */

static int (*g_backtrace)(void **ips, int max);
static int (*g_set_caching_policy)(unw_addr_space_t space, unw_caching_policy_t policy);
static unw_addr_space_t *g_local_space;

/* ---- what libunwind's descriptor calls get instead ---- */

/* Whether n bytes at address can be read, as a write from them to a pipe would tell. */
static long readable_like_write(const void *address, size_t n) {
  char copy[16];
  if (n > sizeof copy) n = sizeof copy;
  struct iovec local = {copy, n}, remote = {(void *)(uintptr_t)address, n};
  long rc = hd_raw_syscall6(SYS_process_vm_readv, hd_raw_syscall6(SYS_getpid, 0, 0, 0, 0, 0, 0),
                            (long)&local, 1, (long)&remote, 1, 0);
  if (rc < 0 && rc > -4096) {
    errno = (int)-rc;
    return -1;
  }
  return rc;
}

static int unwinder_pipe2(int fds[2], int flags) {
  (void)flags;
  fds[0] = fds[1] = -1;
  return 0;
}

static int unwinder_open(const char *path, int flags, ...) {
  (void)path;
  (void)flags;
  errno = EMFILE;
  return -1;
}

static int unwinder_close(int fd) {
  (void)fd;
  errno = EBADF;
  return -1;
}

static ssize_t unwinder_read(int fd, void *buf, size_t n) {
  (void)fd;
  (void)buf;
  (void)n;
  errno = EAGAIN;
  return -1;
}

static ssize_t unwinder_write(int fd, const void *buf, size_t n) {
  (void)fd;
  return readable_like_write(buf, n);
}

static long unwinder_syscall(long number, ...) {
  va_list ap;
  va_start(ap, number);
  long a[6];
  for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
  va_end(ap);
  if (number == SYS_write) return readable_like_write((const void *)a[1], (size_t)a[2]);
  long rc = hd_raw_syscall6(number, a[0], a[1], a[2], a[3], a[4], a[5]);
  if (rc < 0 && rc > -4096) { /* glibc's convention for syscall() */
    errno = (int)-rc;
    return -1;
  }
  return rc;
}

/* ---- the modules libunwind is shown ---- */

/* libunwind finds a module's unwind tables through dl_iterate_phdr and trusts them: offsets
 * outside the module make it read wild memory. It is shown only the modules whose tables passed
 * our checks (cfi.h); for a refused one it finds no tables, and the trace ends there. */
typedef struct module_filter {
  int (*callback)(struct dl_phdr_info *, size_t, void *);
  void *data;
} module_filter;

static int show_usable_module(struct dl_phdr_info *info, size_t size, void *data) {
  const module_filter *f = data;
  return hd_cfi_module_tables_usable(info) ? f->callback(info, size, f->data) : 0;
}

static int unwinder_dl_iterate_phdr(int (*callback)(struct dl_phdr_info *, size_t, void *),
                                    void *data) {
  module_filter f = {callback, data};
  return dl_iterate_phdr(show_usable_module, &f);
}

static const struct {
  const char *name;
  void *replacement;
} kRedirected[] = {
    {"pipe2", (void *)unwinder_pipe2},
    {"open", (void *)unwinder_open},
    {"close", (void *)unwinder_close},
    {"read", (void *)unwinder_read},
    {"write", (void *)unwinder_write},
    {"syscall", (void *)unwinder_syscall},
    {"dl_iterate_phdr", (void *)unwinder_dl_iterate_phdr},
};

/* ---- redirecting libunwind's imports ---- */

/* The loader rewrites a module's dynamic-section pointers to addresses on x86-64; read them
 * either way. */
static uintptr_t dynamic_address(uintptr_t base, uintptr_t value) {
  return value < base ? base + value : value;
}

typedef struct relro_range {
  uintptr_t base, lo, hi; /* [lo, hi): the module's read-only-after-relocation part */
} relro_range;

static int find_relro(struct dl_phdr_info *info, size_t size, void *data) {
  (void)size;
  relro_range *r = data;
  if (info->dlpi_addr != r->base) return 0;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    if (info->dlpi_phdr[i].p_type == PT_GNU_RELRO) {
      r->lo = r->base + info->dlpi_phdr[i].p_vaddr;
      r->hi = r->lo + info->dlpi_phdr[i].p_memsz;
    }
  }
  return 1;
}

static bool write_slot(uintptr_t slot, void *value, const relro_range *relro) {
  const uintptr_t page = slot & ~(uintptr_t)4095;
  const bool read_only = slot >= relro->lo && slot < relro->hi;
  if (read_only && mprotect((void *)page, 4096, PROT_READ | PROT_WRITE) != 0) return false;
  memcpy((void *)slot, &value, sizeof value);
  if (read_only) (void)mprotect((void *)page, 4096, PROT_READ);
  return true;
}

/* Points every relocation of the module against one of kRedirected's names at our function.
 * The module was loaded with RTLD_NOW: every slot is filled already and none is filled later. */
static bool redirect_imports(void *handle) {
  struct link_map *lm;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &lm) != 0) return false;
  const uintptr_t base = lm->l_addr;
  const ElfW(Sym) *symtab = NULL;
  const char *strtab = NULL;
  const ElfW(Rela) * tables[2] = {NULL, NULL};
  size_t table_bytes[2] = {0, 0};
  for (const ElfW(Dyn) *d = lm->l_ld; d->d_tag != DT_NULL; d++) {
    switch (d->d_tag) {
      case DT_SYMTAB: symtab = (const ElfW(Sym) *)dynamic_address(base, d->d_un.d_ptr); break;
      case DT_STRTAB: strtab = (const char *)dynamic_address(base, d->d_un.d_ptr); break;
      case DT_JMPREL: tables[0] = (const ElfW(Rela) *)dynamic_address(base, d->d_un.d_ptr); break;
      case DT_PLTRELSZ: table_bytes[0] = d->d_un.d_val; break;
      case DT_RELA: tables[1] = (const ElfW(Rela) *)dynamic_address(base, d->d_un.d_ptr); break;
      case DT_RELASZ: table_bytes[1] = d->d_un.d_val; break;
      default: break;
    }
  }
  if (symtab == NULL || strtab == NULL) return false;
  relro_range relro = {.base = base};
  dl_iterate_phdr(find_relro, &relro);
  size_t redirected = 0;
  for (int t = 0; t < 2; t++) {
    for (size_t i = 0; tables[t] != NULL && i < table_bytes[t] / sizeof(ElfW(Rela)); i++) {
      const ElfW(Rela) *r = &tables[t][i];
      const unsigned type = ELF64_R_TYPE(r->r_info);
      if (type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT) continue;
      const char *name = strtab + symtab[ELF64_R_SYM(r->r_info)].st_name;
      for (size_t k = 0; k < sizeof kRedirected / sizeof *kRedirected; k++) {
        if (strcmp(name, kRedirected[k].name) != 0) continue;
        if (!write_slot(base + r->r_offset, kRedirected[k].replacement, &relro)) return false;
        redirected++;
      }
    }
  }
  return redirected > 0;
}

/* ---- the entry points stack.c uses ---- */

bool hd_libunwind_load(void) {
  void *handle = dlopen("libunwind.so.8", RTLD_NOW | RTLD_LOCAL);
  if (handle == NULL) return false;
  /* Every import redirected before libunwind runs: if that cannot be done, it is not used. */
  __typeof__(g_backtrace) backtrace =
      (__typeof__(g_backtrace))dlsym(handle, HD_NAME_OF(unw_backtrace));
  __typeof__(g_set_caching_policy) caching =
      (__typeof__(g_set_caching_policy))dlsym(handle, HD_NAME_OF(unw_set_caching_policy));
  unw_addr_space_t *space = (unw_addr_space_t *)dlsym(handle, HD_NAME_OF(unw_local_addr_space));
  if (backtrace == NULL || caching == NULL || space == NULL || !redirect_imports(handle)) {
    dlclose(handle);
    return false;
  }
  g_set_caching_policy = caching;
  g_local_space = space;
  g_set_caching_policy(*g_local_space, UNW_CACHE_PER_THREAD);
  __atomic_store_n(&g_backtrace, backtrace, __ATOMIC_RELEASE);
  return true;
}

int hd_libunwind_backtrace(void **ips, int max) {
  int (*backtrace)(void **, int) = __atomic_load_n(&g_backtrace, __ATOMIC_ACQUIRE);
  return backtrace != NULL ? backtrace(ips, max) : -1;
}

void hd_libunwind_share_no_cache(void) {
  if (__atomic_load_n(&g_backtrace, __ATOMIC_ACQUIRE) != NULL)
    g_set_caching_policy(*g_local_space, UNW_CACHE_NONE);
}
