/* A module's files (symbolize_internal.h): opening ELF files safely, matching them to a module by
 * build ID, and the search for its separate debug file (see README.md for the order). Nothing
 * here touches the network. */
#define _GNU_SOURCE
#include <elfutils/libdwelf.h>
#include <errno.h>
#include <fcntl.h>
#include <gelf.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "symbolize_internal.h"

const elf_file kNoElfFile = {-1, NULL};

/* Whether a file may be read by a symbolizer of trusted files only: installed by root or by our
 * own user, and replaceable by nobody else. */
static bool trusted(const struct stat *st) {
  return (st->st_uid == 0 || st->st_uid == geteuid()) && (st->st_mode & (S_IWGRP | S_IWOTH)) == 0;
}

/* O_NONBLOCK and the S_ISREG check: a FIFO or device named like a module must not hang us. */
bool hd_elf_file_open(const hd_symbolizer *s, const char *path, elf_file *out) {
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (s->trusted_files_only && !trusted(&st))) {
    close(fd);
    return false;
  }
  Elf *elf = elf_begin(fd, ELF_C_READ_MMAP, NULL);
  GElf_Ehdr ehdr;
  if (elf == NULL || elf_kind(elf) != ELF_K_ELF || gelf_getehdr(elf, &ehdr) == NULL) {
    elf_end(elf);
    close(fd);
    return false;
  }
  *out = (elf_file){fd, elf};
  return true;
}

void hd_elf_file_close(elf_file *f) {
  elf_end(f->elf);
  if (f->fd >= 0) close(f->fd);
  *f = kNoElfFile;
}

static bool same_inode(const elf_file *a, const elf_file *b) {
  struct stat sa, sb;
  return a->fd >= 0 && b->fd >= 0 && fstat(a->fd, &sa) == 0 && fstat(b->fd, &sb) == 0 &&
         sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/* The CRC-32 .gnu_debuglink records is zlib's. */
static bool file_crc32(int fd, uint32_t *out) {
  uLong crc = crc32(0L, Z_NULL, 0);
  unsigned char buffer[65536];
  off_t offset = 0;
  for (;;) {
    ssize_t n = pread(fd, buffer, sizeof buffer, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (n == 0) break;
    crc = crc32(crc, buffer, (uInt)n);
    offset += n;
  }
  *out = (uint32_t)crc;
  return true;
}

/* Regions carry at most sizeof(build_id) bytes of the note: a longer ID matches on that prefix. */
bool hd_build_id_matches(const module *m, Elf *elf) {
  const void *id = NULL;
  ssize_t n = dwelf_elf_gnu_build_id(elf, &id);
  if (n < 0) return false;
  if (m->build_id_size == 0 || n == 0) return m->build_id_size == 0 && n == 0;
  size_t size = (size_t)n;
  if (size > sizeof m->build_id) size = sizeof m->build_id;
  return size == m->build_id_size && memcmp(id, m->build_id, size) == 0;
}

typedef struct debug_search {
  const hd_symbolizer *s;
  module *m;
  const char *debuglink; /* from the binary, or NULL */
  uint32_t debuglink_crc;
  elf_file symbols_only; /* the first match without DWARF but with a .symtab */
} debug_search;

/* Tries path as the module's debug file; true once one with DWARF is loaded. */
static bool try_debug_file(debug_search *search, const char *path, bool via_debuglink) {
  elf_file candidate;
  if (!hd_elf_file_open(search->s, path, &candidate)) return false;
  module *m = search->m;
  bool matches = hd_build_id_matches(m, candidate.elf) && !same_inode(&candidate, &m->binary) &&
                 !same_inode(&candidate, &search->symbols_only);
  if (matches && m->build_id_size == 0 && via_debuglink) {
    uint32_t crc;
    matches = file_crc32(candidate.fd, &crc) && crc == search->debuglink_crc;
  }
  if (matches && hd_load_dwarf(m, candidate.elf)) {
    m->debug = candidate;
    return true;
  }
  if (matches && search->symbols_only.elf == NULL &&
      hd_find_symbol_section(candidate.elf, SHT_SYMTAB) != NULL) {
    search->symbols_only = candidate;
    return false;
  }
  hd_elf_file_close(&candidate);
  return false;
}

static void build_id_path(const module *m, const char *root, char *out, size_t size) {
  int n = snprintf(out, size, "%s/.build-id/%02x/", root, m->build_id[0]);
  for (size_t i = 1; n > 0 && (size_t)n < size && i < m->build_id_size; i++) {
    n += snprintf(out + n, size - (size_t)n, "%02x", m->build_id[i]);
  }
  if (n > 0 && (size_t)n < size) n += snprintf(out + n, size - (size_t)n, ".debug");
  if (n < 0 || (size_t)n >= size) out[0] = '\0';
}

static bool try_joined(debug_search *search, const char *dir, const char *middle, const char *file,
                       bool via_debuglink) {
  char path[PATH_MAX];
  int n = snprintf(path, sizeof path, "%s%s/%s", dir, middle, file);
  return n > 0 && (size_t)n < sizeof path && try_debug_file(search, path, via_debuglink);
}

/* The order: each --debug-dir (build-id layout, the module's basename, the debuglink name), the
 * system build-id directory, then the debuglink next to the binary, in its .debug/ and under the
 * system debug root. */
void hd_find_debug_file(const hd_symbolizer *s, module *m) {
  debug_search search = {s, m, NULL, 0, kNoElfFile};
  if (m->binary.elf != NULL) {
    GElf_Word crc = 0;
    search.debuglink = dwelf_elf_gnu_debuglink(m->binary.elf, &crc);
    search.debuglink_crc = crc;
  }
  const char *slash = strrchr(m->name, '/');
  const char *base = slash ? slash + 1 : m->name;
  char path[PATH_MAX];
  bool found = false;
  for (size_t i = 0; !found && i < s->debug_dir_count; i++) {
    if (m->build_id_size >= 2) {
      build_id_path(m, s->debug_dirs[i], path, sizeof path);
      found = path[0] != '\0' && try_debug_file(&search, path, false);
    }
    if (!found && base[0] != '\0') found = try_joined(&search, s->debug_dirs[i], "", base, false);
    if (!found && search.debuglink != NULL && strcmp(search.debuglink, base) != 0) {
      found = try_joined(&search, s->debug_dirs[i], "", search.debuglink, true);
    }
  }
  if (!found && m->build_id_size >= 2) {
    build_id_path(m, SYSTEM_DEBUG_ROOT, path, sizeof path);
    found = path[0] != '\0' && try_debug_file(&search, path, false);
  }
  if (!found && search.debuglink != NULL && slash != NULL) {
    char dir[PATH_MAX];
    int n = snprintf(dir, sizeof dir, "%.*s", (int)(slash - m->name), m->name);
    if (n >= 0 && (size_t)n < sizeof dir) {
      found = try_joined(&search, dir, "", search.debuglink, true) ||
              try_joined(&search, dir, "/.debug", search.debuglink, true) ||
              try_joined(&search, SYSTEM_DEBUG_ROOT, dir, search.debuglink, true);
    }
  }
  if (found) {
    hd_elf_file_close(&search.symbols_only);
  } else if (search.symbols_only.elf != NULL) {
    m->debug = search.symbols_only;
  }
}
