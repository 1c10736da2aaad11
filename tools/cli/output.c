/* Writing results: format selection, output files that appear only when complete, the writers
 * of every format, and the progress line. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/tools/dartheap.h"
#include "heapdump/tools/html.h"
#include "heapdump/tools/rawfile.h"
#include "heapdump/tools/symbolize.h"
#include "heapdump/tools/util.h"

static const struct {
  const char *name;
  cli_format format;
  const char *extension;
} kFormats[] = {
    {"raw", FORMAT_RAW, ".heapdump"},
    {"pprof", FORMAT_PPROF, ".pb.gz"},
    {"dartheap", FORMAT_DARTHEAP, ".dartheap"},
    {"text", FORMAT_TEXT, ".txt"},
    {"folded", FORMAT_FOLDED, ".folded"},
    {"json", FORMAT_JSON, ".json"},
    {"html", FORMAT_HTML, ".html"},
};

/* Extensions recognized besides the ones written by default. */
static const struct {
  const char *extension;
  cli_format format;
} kMoreExtensions[] = {
    {".pprof", FORMAT_PPROF},   {".pb", FORMAT_PPROF},         {".heapsnapshot", FORMAT_DARTHEAP},
    {".data", FORMAT_DARTHEAP}, {".collapsed", FORMAT_FOLDED}, {".htm", FORMAT_HTML},
};

cli_format cli_parse_format(const char *name) {
  for (size_t i = 0; i < sizeof kFormats / sizeof kFormats[0]; i++) {
    if (strcmp(name, kFormats[i].name) == 0) return kFormats[i].format;
  }
  return FORMAT_NONE;
}

const char *cli_format_extension(cli_format f) {
  for (size_t i = 0; i < sizeof kFormats / sizeof kFormats[0]; i++) {
    if (kFormats[i].format == f) return kFormats[i].extension;
  }
  return "";
}

static bool ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), m = strlen(suffix);
  return n >= m && strcmp(s + n - m, suffix) == 0;
}

cli_format cli_output_format(const cli_options *o, const char *output, cli_format fallback) {
  if (o->format != FORMAT_NONE) return o->format;
  if (output != NULL && strcmp(output, "-") != 0) {
    for (size_t i = 0; i < sizeof kFormats / sizeof kFormats[0]; i++) {
      if (ends_with(output, kFormats[i].extension)) return kFormats[i].format;
    }
    for (size_t i = 0; i < sizeof kMoreExtensions / sizeof kMoreExtensions[0]; i++) {
      if (ends_with(output, kMoreExtensions[i].extension)) return kMoreExtensions[i].format;
    }
  }
  return fallback;
}

/* How a path is written: replaced atomically (a regular file, or nothing yet), or written in
 * place, because what it names is not ours to replace (a character device such as /dev/null or a
 * terminal, a FIFO, a symbolic link such as /dev/stdout). Refused: a directory, a socket, a block
 * device. */
typedef enum { OUTPUT_REPLACE, OUTPUT_IN_PLACE, OUTPUT_REFUSED } output_kind;

static output_kind output_kind_of(const char *path, bool *regular, const char **refusal) {
  struct stat link, target;
  *regular = false;
  if (lstat(path, &link) != 0) return OUTPUT_REPLACE; /* nothing yet, or mkstemp will say why */
  if (S_ISREG(link.st_mode)) return OUTPUT_REPLACE;
  const bool followed = stat(path, &target) == 0;
  const mode_t mode = followed ? target.st_mode : link.st_mode;
  if (S_ISDIR(mode)) {
    *refusal = "it is a directory";
  } else if (S_ISSOCK(mode)) {
    *refusal = "it is a socket";
  } else if (S_ISBLK(mode)) {
    *refusal = "it is a block device";
  } else {
    *regular = S_ISREG(mode);
    return OUTPUT_IN_PLACE;
  }
  return OUTPUT_REFUSED;
}

static int output_error(const char *path, int err) {
  cli_error("cannot write %s: %s", path, strerror(err));
  return err == EACCES || err == EPERM || err == EROFS ? EXIT_PERMISSION : EXIT_FAILURE_;
}

int cli_output_open(cli_output *out, const char *path) {
  memset(out, 0, sizeof *out);
  if (strcmp(path, "-") == 0) {
    out->is_stdout = true;
    out->file = stdout;
    snprintf(out->path, sizeof out->path, "(stdout)");
    return 0;
  }
  if (snprintf(out->path, sizeof out->path, "%s", path) >= (int)sizeof out->path) {
    cli_error("output path too long: %s", path);
    return EXIT_USAGE;
  }
  bool regular;
  const char *refusal = NULL;
  const output_kind kind = output_kind_of(path, &regular, &refusal);
  if (kind == OUTPUT_REFUSED) {
    cli_error("cannot write %s: %s", path, refusal);
    return EXIT_FAILURE_;
  }
  int fd;
  if (kind == OUTPUT_IN_PLACE) {
    out->in_place = true;
    out->in_place_regular = regular;
    fd = open(path, O_WRONLY | O_CLOEXEC | (regular ? O_TRUNC : 0));
    if (fd < 0) return output_error(path, errno);
  } else {
    snprintf(out->tmp, sizeof out->tmp, "%s.tmp.XXXXXX", path);
    fd = mkstemp(out->tmp);
    if (fd < 0) return output_error(path, errno);
    /* mkstemp creates 0600; outputs are ordinary files, subject to the umask. */
    mode_t mask = umask(0);
    umask(mask);
    fchmod(fd, 0666 & ~mask);
  }
  out->file = fdopen(fd, "w");
  if (out->file == NULL) {
    const int err = errno;
    close(fd);
    if (!out->in_place) unlink(out->tmp);
    return output_error(path, err);
  }
  return 0;
}

int cli_output_commit(cli_output *out) {
  if (out->is_stdout) {
    if (fflush(stdout) != 0) {
      cli_error("cannot write to stdout: %s", strerror(errno));
      return EXIT_FAILURE_;
    }
    return 0;
  }
  /* A device or a FIFO cannot be synced (and need not be). */
  const bool sync = !out->in_place || out->in_place_regular;
  bool ok = fflush(out->file) == 0 && (!sync || fsync(fileno(out->file)) == 0);
  int err = errno;
  ok = fclose(out->file) == 0 && ok;
  out->file = NULL;
  if (out->in_place) {
    if (!ok) cli_error("cannot write %s: %s", out->path, strerror(err));
    return ok ? 0 : EXIT_FAILURE_;
  }
  if (!ok || rename(out->tmp, out->path) != 0) {
    if (ok) err = errno;
    unlink(out->tmp);
    cli_error("cannot write %s: %s", out->path, strerror(err));
    return EXIT_FAILURE_;
  }
  return 0;
}

void cli_output_abort(cli_output *out) {
  if (out->is_stdout || out->file == NULL) return;
  fclose(out->file);
  out->file = NULL;
  if (!out->in_place) unlink(out->tmp); /* what was written in place stays */
}

hd_symbolizer *cli_symbolizer(const cli_options *o, hd_alloc_fns *fns) {
  if (!o->symbolize) return NULL;
  hd_symbolizer_options so = {.debug_dirs = o->debug_dirs, .debug_dir_count = o->debug_dir_count};
  hd_symbolizer *sym = NULL;
  if (hd_symbolizer_create(&so, &sym) != 0) {
    cli_error("cannot start the symbolizer; writing addresses only");
    return NULL;
  }
  *fns = (hd_alloc_fns){.patterns = o->alloc_fn_patterns,
                        .pattern_count = o->alloc_fn_count,
                        .no_builtin = o->no_builtin_alloc_fns};
  hd_symbolizer_set_alloc_fns(sym, fns);
  return sym;
}

/* ---- text that names what the program chose ---- */

typedef struct text_stream {
  FILE *out;
  bool after_c2; /* the last byte written was 0xC2, which may start a C1 control */
} text_stream;

/* Appends c to buf at *n as \xNN. */
static void put_escaped(char *buf, size_t *n, unsigned char c) {
  static const char kHex[] = "0123456789abcdef";
  buf[(*n)++] = '\\';
  buf[(*n)++] = 'x';
  buf[(*n)++] = kHex[c >> 4];
  buf[(*n)++] = kHex[c & 15];
}

/* Escapes a chunk at a time into one write of the underlying stream (stderr is unbuffered). */
static ssize_t text_write(void *cookie, const char *buf, size_t size) {
  text_stream *t = cookie;
  char escaped[4096 + 16];
  size_t n = 0;
  for (size_t i = 0; i < size; i++) {
    if (n > 4096) {
      if (fwrite(escaped, 1, n, t->out) != n) return -1;
      n = 0;
    }
    const unsigned char c = (unsigned char)buf[i];
    if (t->after_c2) {
      t->after_c2 = false;
      if (c >= 0x80 && c <= 0x9f) { /* U+0080-U+009F: C1 controls, such as CSI */
        put_escaped(escaped, &n, 0xc2);
        put_escaped(escaped, &n, c);
        continue;
      }
      escaped[n++] = (char)0xc2;
    }
    if (c == 0xc2) {
      t->after_c2 = true;
    } else if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f) {
      put_escaped(escaped, &n, c);
    } else {
      escaped[n++] = (char)c;
    }
  }
  if (n > 0 && fwrite(escaped, 1, n, t->out) != n) return -1;
  return (ssize_t)size;
}

/* Closing writes what it held back and flushes the stream under it, which stays open. */
static int text_flush(void *cookie) {
  text_stream *t = cookie;
  if (t->after_c2) fputc(0xc2, t->out);
  t->after_c2 = false;
  return fflush(t->out);
}

static int text_close(void *cookie) {
  const int rc = text_flush(cookie);
  free(cookie);
  return rc;
}

FILE *cli_text_stream(FILE *out) {
  text_stream *t = calloc(1, sizeof *t);
  if (t == NULL) return NULL;
  t->out = out;
  FILE *f = fopencookie(t, "w", (cookie_io_functions_t){.write = text_write, .close = text_close});
  if (f == NULL) free(t);
  return f;
}

FILE *cli_stderr(void) {
  /* For the whole run, never closed: its state is static, so nothing of it is left allocated. */
  static text_stream state;
  static FILE *messages;
  if (messages == NULL) {
    state.out = stderr;
    messages =
        fopencookie(&state, "w", (cookie_io_functions_t){.write = text_write, .close = text_flush});
    if (messages == NULL) return stderr;
    setvbuf(messages, NULL, _IONBF, 0); /* as stderr: each message written at once */
  }
  return messages;
}

int cli_write(const cli_options *o, const hd_reassembler *r, cli_format f, cli_output *out) {
  hd_alloc_fns fns;
  hd_symbolizer *sym = f != FORMAT_RAW ? cli_symbolizer(o, &fns) : NULL;
  char error[512] = "";
  int rc = 0;
  /* Text names what the program chose (processes, threads, symbols): never raw to a terminal. */
  FILE *text = f == FORMAT_TEXT || f == FORMAT_FOLDED || f == FORMAT_NONE
                   ? cli_text_stream(out->file)
                   : NULL;
  if (text == NULL) text = out->file;
  switch (f) {
    case FORMAT_RAW: rc = hd_raw_write(r, out->file, error, sizeof error); break;
    case FORMAT_PPROF: {
      hd_pprof_options po = {.symbolizer = sym, .tags = o->tags, .default_sample = o->sample};
      rc = hd_pprof_write(r, &po, out->file, error, sizeof error);
      break;
    }
    case FORMAT_DARTHEAP: {
      hd_dartheap_options dopt = {.symbolizer = sym};
      rc = hd_dartheap_write(r, &dopt, out->file, error, sizeof error);
      break;
    }
    case FORMAT_FOLDED: rc = hd_folded_write(r, sym, text, error, sizeof error); break;
    case FORMAT_HTML: {
      hd_html_options ho = {.symbolizer = sym,
                            .source = o->source,
                            .command_line = o->command_line,
                            .command_pid = o->command_pid,
                            .categories = o->leak_categories,
                            .sort = o->sort};
      rc = hd_html_write(r, &ho, out->file, error, sizeof error);
      break;
    }
    case FORMAT_TEXT:
    case FORMAT_JSON:
    case FORMAT_NONE: {
      hd_report_options ro = {.symbolizer = sym,
                              .by = o->by,
                              .sort = o->sort,
                              .top = o->top,
                              .max_frames = o->max_frames,
                              .json = o->json || f == FORMAT_JSON,
                              .show_reachable = o->show_reachable,
                              .categories = o->leak_categories,
                              .now_ns = o->leak_now_ns,
                              .short_names = o->leak_categories != NULL};
      rc = hd_report_write(r, &ro, ro.json ? out->file : text, error, sizeof error);
      break;
    }
  }
  if (text != out->file && fclose(text) != 0 && rc == 0) rc = -EIO;
  hd_symbolizer_destroy(sym);
  if (rc != 0) {
    cli_error("%s: %s", out->path, error[0] ? error : strerror(-rc));
    return rc == -EACCES || rc == -EPERM ? EXIT_PERMISSION : EXIT_FAILURE_;
  }
  return 0;
}

/* The whole input, in memory: its first bytes tell its format. */
/* Reads the rest of in (after `prefix`, already taken from it) into memory. */
static HD_MUST_CHECK int read_input(FILE *in, const char *path, const uint8_t *prefix,
                                    size_t prefix_size, uint8_t **out, size_t *size) {
  size_t capacity = 0, used = 0;
  uint8_t *buf = NULL;
  for (;;) {
    if (!HD_RESERVE(buf, used, capacity)) { /* room for at least 64 bytes, then doubling */
      free(buf);
      buf = NULL;
      break;
    }
    if (used < prefix_size) { /* the bytes already taken from in come first */
      buf[used] = prefix[used];
      used++;
      continue;
    }
    size_t n = fread(buf + used, 1, capacity - used, in);
    used += n;
    if (n == 0) break;
  }
  bool failed = buf == NULL || ferror(in);
  int err = errno;
  if (failed) {
    free(buf);
    cli_error("cannot read %s: %s", path, buf == NULL ? "out of memory" : strerror(err));
    return EXIT_FAILURE_;
  }
  *out = buf;
  *size = used;
  return 0;
}

/* What a pprof profile does not say of its one process: its name and pid, taken from a file
 * name as run and snapshot write them (heapdump.NAME.PID.pb.gz), else the file's stem. */
static void name_from_path(const char *path, char *name, size_t size, uint64_t *pid) {
  const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
  unsigned long long number;
  int consumed = 0;
  *pid = 0;
  if (strncmp(base, "heapdump.", 9) == 0) {
    const char *dot = strchr(base + 9, '.');
    if (dot != NULL && sscanf(dot + 1, "%llu%n", &number, &consumed) == 1 && consumed > 0 &&
        (dot[1 + consumed] == '.' || dot[1 + consumed] == '\0')) {
      snprintf(name, size, "%.*s", (int)(dot - base - 9), base + 9);
      *pid = number;
      return;
    }
  }
  snprintf(name, size, "%.*s", (int)strcspn(base, "."), base);
}

int cli_probe_output(const cli_options *o) {
  if (o->output == NULL || strcmp(o->output, "-") == 0) return 0;
  bool regular;
  const char *refusal = NULL;
  switch (output_kind_of(o->output, &regular, &refusal)) {
    case OUTPUT_REFUSED: cli_error("cannot write %s: %s", o->output, refusal); return EXIT_FAILURE_;
    /* Not opened to probe it: a FIFO would wait for its reader, a file would be truncated. */
    case OUTPUT_IN_PLACE: return access(o->output, W_OK) == 0 ? 0 : output_error(o->output, errno);
    case OUTPUT_REPLACE: break;
  }
  cli_output probe;
  int rc = cli_output_open(&probe, o->output);
  if (rc == 0) cli_output_abort(&probe);
  return rc;
}

void cli_spill_contents(hd_reassembler *r) {
  const char *tmpdir = getenv("TMPDIR");
  const char *dir = tmpdir != NULL && tmpdir[0] != '\0' ? tmpdir : "/tmp";
  int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) { /* a file system without O_TMPFILE */
    char path[4096];
    snprintf(path, sizeof path, "%s/heapdump-contents-XXXXXX", dir);
    fd = mkostemp(path, O_CLOEXEC);
    if (fd >= 0) unlink(path);
  }
  if (fd >= 0) {
    hd_reassembler_spill_contents(r, fd);
  } else {
    cli_error(
        "cannot create a temporary file for block contents in %s (%s); keeping them in "
        "memory",
        dir, strerror(errno));
  }
}

/* Standard input, with the bytes already taken from it to tell its format put back in front:
 * a pipe cannot be rewound, and a raw snapshot read from one is read as a stream too. */
typedef struct peeked_input {
  FILE *in;
  uint8_t bytes[HD_RAW_MAGIC_SIZE];
  size_t size, at;
} peeked_input;

static HD_MUST_CHECK ssize_t read_peeked(void *cookie, char *buf, size_t size) {
  peeked_input *p = cookie;
  size_t n = 0;
  while (n < size && p->at < p->size) buf[n++] = (char)p->bytes[p->at++];
  if (n < size) n += fread(buf + n, 1, size - n, p->in);
  return n == 0 && ferror(p->in) ? -1 : (ssize_t)n;
}

static HD_MUST_CHECK int read_raw(FILE *in, const char *path, hd_reassembler *r) {
  cli_spill_contents(r);
  char error[256] = "";
  int rc = hd_raw_read(in, r, error, sizeof error);
  if (rc == -ENOMEM && error[0] == '\0') snprintf(error, sizeof error, "out of memory");
  if (rc != 0) {
    cli_error("%s: %s", path, error);
    return EXIT_FAILURE_;
  }
  return 0;
}

int cli_read_snapshot(const char *path, hd_reassembler *r) {
  const bool is_stdin = strcmp(path, "-") == 0;
  FILE *in = is_stdin ? stdin : fopen(path, "rb");
  if (in == NULL) {
    int err = errno;
    cli_error("cannot read %s: %s", path, strerror(err));
    return err == EACCES || err == EPERM ? EXIT_PERMISSION : EXIT_FAILURE_;
  }
  peeked_input peeked = {.in = in};
  peeked.size = fread(peeked.bytes, 1, sizeof peeked.bytes, in);
  if (peeked.size == HD_RAW_MAGIC_SIZE &&
      memcmp(peeked.bytes, HD_RAW_MAGIC, HD_RAW_MAGIC_SIZE) == 0) {
    int rc;
    if (!is_stdin) {
      rewind(in);
      rc = read_raw(in, path, r);
    } else {
      FILE *stream = fopencookie(&peeked, "rb", (cookie_io_functions_t){.read = read_peeked});
      rc = stream != NULL ? read_raw(stream, path, r) : EXIT_FAILURE_;
      if (stream != NULL)
        fclose(stream);
      else
        cli_error("cannot read %s: %s", path, strerror(errno));
    }
    if (!is_stdin) fclose(in);
    return rc;
  }
  /* Not raw: a pprof profile, which is decoded whole. */
  if (!is_stdin) rewind(in);
  uint8_t *data = NULL;
  size_t size = 0;
  int rc = read_input(in, path, is_stdin ? peeked.bytes : NULL, is_stdin ? peeked.size : 0, &data,
                      &size);
  if (!is_stdin) fclose(in);
  if (rc != 0) return rc;
  char error[256] = "";
  char name[64];
  uint64_t pid;
  name_from_path(is_stdin ? "profile" : path, name, sizeof name, &pid);
  rc = hd_pprof_read(data, size, name, pid, r, error, sizeof error);
  bool gzip = size >= 2 && data[0] == 0x1f && data[1] == 0x8b;
  free(data);
  if (rc == -EBADMSG && !gzip) {
    /* Neither magic, and not protobuf either: say what was expected. */
    cli_error("%s: neither a heapdump raw snapshot nor a pprof profile", path);
    return EXIT_FAILURE_;
  }
  if (rc != 0) {
    cli_error("%s: %s", path, error);
    return EXIT_FAILURE_;
  }
  return 0;
}

/* ---- progress ---- */

typedef struct progress_state {
  struct timespec last;
  bool shown;
} progress_state;

static progress_state g_progress;

static void show_progress(void *ctx, const hd_reassembler *r) {
  progress_state *p = ctx;
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  double since = (double)(now.tv_sec - p->last.tv_sec) + (now.tv_nsec - p->last.tv_nsec) / 1e9;
  if (p->shown && since < 0.1) return;
  p->last = now;
  p->shown = true;
  size_t allocations = 0;
  for (size_t i = 0; i < r->snapshot_count; i++) allocations += r->snapshots[i]->allocation_count;
  fprintf(stderr, "\rreceiving snapshot: %zu allocations, %.1f MiB", allocations,
          (double)r->bytes_received / (1024.0 * 1024.0));
}

void cli_progress_attach(hd_reassembler *r) {
  if (!isatty(STDERR_FILENO)) return;
  memset(&g_progress, 0, sizeof g_progress);
  r->progress = show_progress;
  r->progress_ctx = &g_progress;
}

void cli_progress_done(hd_reassembler *r) {
  if (r->progress != NULL && g_progress.shown) fputs("\r\033[K", stderr);
  r->progress = NULL;
}
