/* The subcommands that take, fetch or transform one snapshot: snapshot, list, download, convert,
 * report. `run` is in run.c. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"

void cli_safe_name(char *out, size_t size, const char *name) {
  size_t n = 0;
  for (const char *p = name; *p && n + 1 < size; p++) {
    char c = *p;
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.';
    out[n++] = ok ? c : '_';
  }
  out[n] = '\0';
  if (n == 0) snprintf(out, size, "process");
}

/* Where a result goes: o->output, else default_stem with the format's extension (text and
 * folded: stdout, "-"). path holds the name made. */
static const char *result_path(const cli_options *o, const char *default_stem, char *path,
                               size_t size) {
  cli_format f = cli_output_format(o, o->output, FORMAT_PPROF);
  if (o->output != NULL) return o->output;
  if (f == FORMAT_TEXT || f == FORMAT_FOLDED) return "-";
  snprintf(path, size, "%s%s", default_stem, cli_format_extension(f));
  return path;
}

/* Writes r to result_path(). Prints where it went on stderr. */
static int write_result(const cli_options *o, const hd_reassembler *r, const char *default_stem) {
  cli_format f = cli_output_format(o, o->output, FORMAT_PPROF);
  char path[4200];
  const char *output = result_path(o, default_stem, path, sizeof path);
  cli_output out;
  int rc = cli_output_open(&out, output);
  if (rc != 0) return rc;
  rc = cli_write(o, r, f, &out);
  if (rc != 0) {
    cli_output_abort(&out);
    return rc;
  }
  rc = cli_output_commit(&out);
  if (rc == 0 && !out.is_stdout) fprintf(stderr, "heapdump: wrote %s\n", out.path);
  return rc;
}

int cmd_snapshot(cli_options *o) {
  if (o->has_pid && o->name != NULL) {
    cli_error("snapshot: --pid and --name cannot be combined");
    return EXIT_USAGE;
  }
  /* Fail on an unwritable output before asking the collector for anything. */
  if (o->output != NULL && strcmp(o->output, "-") != 0) {
    cli_output probe;
    int rc = cli_output_open(&probe, o->output);
    if (rc != 0) return rc;
    cli_output_abort(&probe);
  }
  hd_reassembler r;
  hd_reassembler_init(&r);
  int rc = cli_take_live_snapshot(o, o->has_pid ? o->pid : 0, &r);
  if (rc == 0) {
    char stem[128], name[40];
    if (o->all || r.snapshot_count != 1) {
      snprintf(stem, sizeof stem, "heapdump.all");
    } else {
      cli_safe_name(name, sizeof name, r.snapshots[0]->process_name);
      snprintf(stem, sizeof stem, "heapdump.%s.%" PRIu64, name, r.snapshots[0]->pid);
    }
    rc = write_result(o, &r, stem);
  }
  hd_reassembler_destroy(&r);
  return rc;
}

int cmd_list(cli_options *o) {
  cli_stored *items = NULL;
  size_t count = 0;
  int rc = cli_list(o, &items, &count);
  if (rc != 0) return rc;
  if (o->json) {
    printf("[");
    for (size_t i = 0; i < count; i++) {
      printf("%s{\"id\":%" PRIu32 ",\"name\":", i ? "," : "", items[i].id);
      hd_json_string(stdout, items[i].name);
      printf(",\"process_name\":");
      hd_json_string(stdout, items[i].process_name);
      printf(",\"pid\":%" PRIu64 "}", items[i].pid);
    }
    printf("]\n");
  } else {
    printf("%-8s %-33s %s\n", "ID", "NAME", "PROCESS");
    for (size_t i = 0; i < count; i++) {
      printf("%-8" PRIu32 " %-33s %s[%" PRIu64 "]\n", items[i].id, items[i].name,
             items[i].process_name, items[i].pid);
    }
  }
  free(items);
  if (fflush(stdout) != 0) {
    cli_error("cannot write to stdout: %s", strerror(errno));
    return EXIT_FAILURE_;
  }
  return 0;
}

static bool parse_id(const char *text, uint32_t *id) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v == 0 || v > UINT32_MAX || text[0] == '-') {
    return false;
  }
  *id = (uint32_t)v;
  return true;
}

int cmd_download(cli_options *o, const char *id_text) {
  uint32_t id;
  if (!parse_id(id_text, &id)) {
    cli_error("download: '%s' is not a snapshot id (a positive number; see `heapdump list`)",
              id_text);
    return EXIT_USAGE;
  }
  if (o->output != NULL && strcmp(o->output, "-") != 0) {
    cli_output probe;
    int rc = cli_output_open(&probe, o->output);
    if (rc != 0) return rc;
    cli_output_abort(&probe);
  }
  /* The listing tells which process the snapshot is of; an id it lacks is still asked for, so
   * the collector's answer decides. */
  cli_stored meta = {.id = id};
  cli_stored *items = NULL;
  size_t count = 0;
  cli_options all = *o;
  all.has_pid = false;
  all.name = NULL;
  int rc = cli_list(&all, &items, &count);
  if (rc != 0) return rc;
  for (size_t i = 0; i < count; i++) {
    if (items[i].id == id) meta = items[i];
  }
  free(items);
  hd_reassembler r;
  hd_reassembler_init(&r);
  rc = cli_download(o, &meta, &r);
  if (rc == 0) {
    char stem[64];
    snprintf(stem, sizeof stem, "heapdump.snapshot-%" PRIu32, id);
    rc = write_result(o, &r, stem);
  }
  hd_reassembler_destroy(&r);
  return rc;
}

int cmd_convert(cli_options *o, const char *input) {
  if (o->format == FORMAT_NONE && o->output == NULL) {
    cli_error("convert: give --format (raw, pprof, dartheap, text, folded) or an --output whose "
              "extension names one");
    return EXIT_USAGE;
  }
  hd_reassembler r;
  hd_reassembler_init(&r);
  int rc = cli_read_raw(input, &r);
  if (rc == 0) {
    /* The default output sits beside the input: leaky.heapdump -> leaky.pb.gz. */
    char stem[4096];
    snprintf(stem, sizeof stem, "%s", strcmp(input, "-") == 0 ? "heapdump" : input);
    size_t n = strlen(stem), m = strlen(cli_format_extension(FORMAT_RAW));
    if (n > m && strcmp(stem + n - m, cli_format_extension(FORMAT_RAW)) == 0) stem[n - m] = '\0';
    char path[4200];
    const char *target = result_path(o, stem, path, sizeof path);
    struct stat st;
    if (!o->force && strcmp(target, "-") != 0 && stat(target, &st) == 0) {
      cli_error("convert: %s exists; --force overwrites it", target);
      rc = EXIT_FAILURE_;
    } else {
      rc = write_result(o, &r, stem);
    }
  }
  hd_reassembler_destroy(&r);
  return rc;
}

int cmd_report(cli_options *o, const char *input) {
  hd_reassembler r;
  hd_reassembler_init(&r);
  int rc = cli_read_raw(input, &r);
  if (rc == 0) {
    cli_options report = *o;
    report.format = FORMAT_TEXT;
    cli_output out;
    rc = cli_output_open(&out, o->output ? o->output : "-");
    if (rc == 0) {
      rc = cli_write(&report, &r, FORMAT_TEXT, &out);
      if (rc == 0) {
        rc = cli_output_commit(&out);
      } else {
        cli_output_abort(&out);
      }
    }
  }
  hd_reassembler_destroy(&r);
  return rc;
}
