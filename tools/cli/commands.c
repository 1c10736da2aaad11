/* The subcommands that take, fetch or transform snapshots: snapshot, list, download, convert,
 * report, diff, leaks. `run` is in run.c. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "cli.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/tools/diff.h"
#include "heapdump/tools/html.h"
#include "heapdump/tools/reach.h"

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
  if (f == FORMAT_TEXT || f == FORMAT_FOLDED || f == FORMAT_JSON) return "-";
  snprintf(path, size, "%s%s", default_stem, cli_format_extension(f));
  return path;
}

/* Writes r to result_path(). Prints where it went on stderr. */
static HD_MUST_CHECK int write_result(const cli_options *o, const hd_reassembler *r,
                                      const char *default_stem) {
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
  if (rc == 0 && !out.is_stdout) fprintf(cli_stderr(), "heapdump: wrote %s\n", out.path);
  return rc;
}

int cmd_snapshot(cli_options *o, int argc, char **argv) {
  (void)argc, (void)argv; /* it takes none */
  if (o->has_pid && o->name != NULL) {
    cli_error("snapshot: --pid and --name cannot be combined");
    return EXIT_USAGE;
  }
  int rc = cli_probe_output(o);
  if (rc != 0) return rc;
  hd_reassembler r;
  hd_reassembler_init(&r);
  rc = cli_take_live_snapshot(o, o->has_pid ? o->pid : 0, &r);
  const bool partial = rc == EXIT_PARTIAL;
  if (partial) rc = 0;
  if (rc == 0) {
    char stem[128], name[40];
    if (o->all || r.snapshot_count != 1) {
      snprintf(stem, sizeof stem, "heapdump.all");
    } else {
      cli_safe_name(name, sizeof name, r.snapshots[0]->process_name);
      snprintf(stem, sizeof stem, "heapdump.%s.%" PRIu64, name, r.snapshots[0]->pid);
    }
    o->source = "live snapshot";
    rc = write_result(o, &r, stem);
  }
  hd_reassembler_destroy(&r);
  return rc == 0 && partial ? EXIT_PARTIAL : rc;
}

int cmd_list(cli_options *o, int argc, char **argv) {
  (void)argc, (void)argv; /* it takes none */
  cli_stored *items = NULL;
  size_t count = 0;
  int rc = cli_list(o, &items, &count);
  if (rc != 0) return rc;
  if (o->json) {
    hd_listing_write_json(stdout, items, count);
  } else {
    FILE *text = cli_text_stream(stdout); /* names are the programs' */
    if (text == NULL) text = stdout;
    fprintf(text, "%-8s %-20s %-26s %-19s %14s %10s %12s\n", "ID", "NAME", "PROCESS", "TAKEN",
            "LIVE BYTES", "BLOCKS", "STORED");
    for (size_t i = 0; i < count; i++) {
      const cli_stored *s = &items[i];
      char process[64], when[40] = "-", bytes[24] = "-", blocks[24] = "-";
      snprintf(process, sizeof process, "%s[%" PRIu64 "]", s->process_name, s->pid);
      if (s->has_totals) {
        hd_format_time(s->taken_at_unix_ns, false, when, sizeof when);
        snprintf(bytes, sizeof bytes, "%" PRIu64, s->live_bytes);
        snprintf(blocks, sizeof blocks, "%" PRIu64, s->live_blocks);
      }
      fprintf(text, "%-8" PRIu32 " %-20s %-26s %-19s %14s %10s %12" PRIu64 "\n", s->id, s->name,
              process, when, bytes, blocks, s->stored_bytes);
    }
    if (text != stdout) fclose(text);
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

int cmd_download(cli_options *o, int argc, char **argv) {
  (void)argc; /* one: the table says so */
  const char *id_text = argv[0];
  uint32_t id;
  if (!parse_id(id_text, &id)) {
    cli_error("download: '%s' is not a snapshot id (a positive number; see `heapdump list`)",
              id_text);
    return EXIT_USAGE;
  }
  int rc = cli_probe_output(o);
  if (rc != 0) return rc;
  /* The listing tells which process the snapshot is of; an id it lacks is still asked for, so
   * the collector's answer decides. */
  cli_stored meta = {.id = id};
  cli_stored *items = NULL;
  size_t count = 0;
  cli_options all = *o;
  all.has_pid = false;
  all.name = NULL;
  rc = cli_list(&all, &items, &count);
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
    char source[96];
    snprintf(source, sizeof source, "stored snapshot %" PRIu32 " (%s)", id, meta.name);
    cli_options download = *o; /* source points into this frame: not left in the caller's */
    download.source = source;
    rc = write_result(&download, &r, stem);
  }
  hd_reassembler_destroy(&r);
  return rc;
}

int cmd_delete(cli_options *o, int argc, char **argv) {
  if ((argc > 0) == o->all) {
    cli_error("delete: give snapshot IDs, or --all (with --pid or --name: only theirs)");
    return EXIT_USAGE;
  }
  if (argc > 0 && (o->has_pid || o->name != NULL)) {
    cli_error("delete: --pid and --name choose what --all deletes; IDs need neither");
    return EXIT_USAGE;
  }
  uint32_t *ids = calloc(argc > 0 ? (size_t)argc : 1, sizeof *ids);
  if (ids == NULL) return EXIT_FAILURE_;
  for (int i = 0; i < argc; i++) {
    if (!parse_id(argv[i], &ids[i])) {
      cli_error("delete: '%s' is not a snapshot id (a positive number; see `heapdump list`)",
                argv[i]);
      free(ids);
      return EXIT_USAGE;
    }
  }
  size_t count = (size_t)argc;
  if (o->all) {
    cli_stored *items = NULL;
    int rc = cli_list(o, &items, &count);
    if (rc != 0) {
      free(ids);
      return rc;
    }
    free(ids);
    ids = calloc(count + 1, sizeof *ids);
    for (size_t i = 0; ids != NULL && i < count; i++) ids[i] = items[i].id;
    free(items);
    if (ids == NULL) return EXIT_FAILURE_;
  }
  /* Every id is tried: one unknown id does not keep the others. */
  int status = 0;
  size_t deleted = 0;
  for (size_t i = 0; i < count; i++) {
    int rc = cli_delete(o, ids[i]);
    if (rc == 0) {
      deleted++;
    } else if (status == 0 || rc != EXIT_NOT_FOUND) {
      status = rc;
    }
    if (rc == EXIT_NO_COLLECTOR || rc == EXIT_TIMEOUT || rc == EXIT_PERMISSION) break;
  }
  free(ids);
  printf("deleted %zu snapshot%s\n", deleted, deleted == 1 ? "" : "s");
  return status;
}

int cmd_convert(cli_options *o, int argc, char **argv) {
  (void)argc; /* one: the table says so */
  const char *input = argv[0];
  if (o->format == FORMAT_NONE && o->output == NULL) {
    cli_error(
        "convert: give --format (raw, pprof, dartheap, text, folded, json, html) or an "
        "--output whose extension names one");
    return EXIT_USAGE;
  }
  hd_reassembler r;
  hd_reassembler_init(&r);
  int rc = cli_read_snapshot(input, &r);
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
      o->source = input;
      rc = write_result(o, &r, stem);
    }
  }
  hd_reassembler_destroy(&r);
  return rc;
}

/* The report of r to --output (default stdout): JSON with --json, or when the output is named
 * .json; the HTML page with --format html or a .html output; text otherwise. Returns an exit
 * code. */
static HD_MUST_CHECK int write_report(const cli_options *o, const hd_reassembler *r) {
  cli_format f = o->json ? FORMAT_JSON : cli_output_format(o, o->output, FORMAT_TEXT);
  cli_output out;
  int rc = cli_output_open(&out, o->output ? o->output : "-");
  if (rc != 0) return rc;
  rc = cli_write(o, r, f == FORMAT_JSON || f == FORMAT_HTML ? f : FORMAT_TEXT, &out);
  if (rc != 0) {
    cli_output_abort(&out);
    return rc;
  }
  rc = cli_output_commit(&out);
  if (rc == 0 && !out.is_stdout) fprintf(cli_stderr(), "heapdump: wrote %s\n", out.path);
  return rc;
}

int cmd_report(cli_options *o, int argc, char **argv) {
  (void)argc; /* one: the table says so */
  const char *input = argv[0];
  hd_reassembler r;
  hd_reassembler_init(&r);
  int rc = cli_read_snapshot(input, &r);
  o->source = input;
  if (rc == 0) rc = write_report(o, &r);
  hd_reassembler_destroy(&r);
  return rc;
}

/* A diff matches sites by name across the two snapshots: of two different programs it still
 * prints one, which reads as a change unless the user is told. */
static void warn_if_other_programs(const hd_reassembler *base, const hd_reassembler *next) {
  if (base->snapshot_count != 1 || next->snapshot_count != 1) return;
  const hd_snapshot *a = base->snapshots[0], *b = next->snapshots[0];
  if (a->process_name[0] == '\0' || b->process_name[0] == '\0' ||
      strcmp(a->process_name, b->process_name) == 0) {
    return;
  }
  cli_error("diff: BASE is of %s[%" PRIu64 "] and NEW of %s[%" PRIu64
            "]: not the same program; its sites are matched by name all the same",
            a->process_name, a->pid, b->process_name, b->pid);
}

int cmd_diff(cli_options *o, int argc, char **argv) {
  (void)argc; /* two: the table says so */
  const char *base_path = argv[0], *next_path = argv[1];
  if (strcmp(base_path, "-") == 0 && strcmp(next_path, "-") == 0) {
    cli_error("diff: only one of BASE and NEW can be stdin");
    return EXIT_USAGE;
  }
  cli_format f = cli_output_format(o, o->output, FORMAT_TEXT);
  if (o->json) f = FORMAT_JSON;
  hd_reassembler base, next;
  hd_reassembler_init(&base);
  hd_reassembler_init(&next);
  hd_symbolizer *sym = NULL;
  hd_alloc_fns fns;
  hd_diff *d = NULL;
  int rc = cli_read_snapshot(base_path, &base);
  if (rc == 0) rc = cli_read_snapshot(next_path, &next);
  if (rc == 0) warn_if_other_programs(&base, &next);
  if (rc == 0) sym = cli_symbolizer(o, &fns);
  char error[512] = "";
  if (rc == 0 && hd_diff_create(&base, &next, sym, o->by, &d, error, sizeof error) != 0) {
    cli_error("diff: %s", error);
    rc = EXIT_FAILURE_;
  }
  cli_output out;
  if (rc == 0) {
    const char *path = o->output;
    if (path == NULL)
      path = f == FORMAT_PPROF  ? "heapdump.diff.pb.gz"
             : f == FORMAT_HTML ? "heapdump.diff.html"
                                : "-";
    rc = cli_output_open(&out, path);
  }
  if (rc == 0) {
    int status;
    if (f == FORMAT_HTML) {
      char source[600];
      snprintf(source, sizeof source, "diff of %s (base) and %s", base_path, next_path);
      hd_html_options ho = {.symbolizer = sym, .source = source, .diff = d};
      status = hd_html_write(hd_diff_profile_snapshots(d), &ho, out.file, error, sizeof error);
    } else if (f == FORMAT_PPROF) {
      hd_pprof_options po = {.symbolizer = sym,
                             .default_sample = o->sample,
                             .trace_values = hd_diff_trace_values,
                             .trace_values_ctx = d};
      status = hd_pprof_write(hd_diff_profile_snapshots(d), &po, out.file, error, sizeof error);
    } else {
      FILE *text = f == FORMAT_JSON ? NULL : cli_text_stream(out.file);
      status = hd_diff_write_report(d, o->top, o->max_frames, f == FORMAT_JSON,
                                    text != NULL ? text : out.file, error, sizeof error);
      if (text != NULL && fclose(text) != 0 && status == 0) status = -EIO;
    }
    if (status != 0) {
      cli_error("%s: %s", out.path, error[0] ? error : strerror(-status));
      cli_output_abort(&out);
      rc = EXIT_FAILURE_;
    } else {
      rc = cli_output_commit(&out);
      if (rc == 0 && !out.is_stdout) fprintf(cli_stderr(), "heapdump: wrote %s\n", out.path);
    }
  }
  hd_diff_destroy(d);
  hd_symbolizer_destroy(sym);
  hd_reassembler_destroy(&next);
  hd_reassembler_destroy(&base);
  return rc;
}

static bool is_lost(uint8_t category) {
  return category == HD_DEFINITELY_LOST || category == HD_INDIRECTLY_LOST;
}

/* Categories of the blocks of `now` for the report: a block lost now counts as lost only if it
 * was lost in `before` too (same address, size and allocation time); otherwise it is left out as
 * unconfirmed (HD_REACH_CATEGORIES). categories must hold now->allocation_count. */
static HD_MUST_CHECK int confirm_leaks(const hd_snapshot *before, const hd_snapshot *now,
                                       uint8_t *categories) {
  uint8_t *earlier = NULL;
  int rc = hd_reach_classify(now, categories, NULL);
  if (rc == 0 && before != NULL) {
    earlier = malloc(before->allocation_count + 1);
    rc = earlier != NULL ? hd_reach_classify(before, earlier, NULL) : -ENOMEM;
  }
  for (size_t k = 0; rc == 0 && k < now->allocation_count; k++) {
    if (!is_lost(categories[k])) continue;
    const hd_snapshot_allocation *a = &now->allocations[k];
    const hd_snapshot_allocation *b =
        before != NULL ? hd_snapshot_find_allocation(before, a->address) : NULL;
    bool lost_before = b != NULL && b->timestamp == a->timestamp && b->size == a->size &&
                       is_lost(earlier[b - before->allocations]);
    if (!lost_before) categories[k] = HD_REACH_CATEGORIES;
  }
  free(earlier);
  return rc;
}

static uint64_t monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int cmd_leaks(cli_options *o, int argc, char **argv) {
  (void)argc, (void)argv; /* it takes none */
  if (o->has_pid && o->name != NULL) {
    cli_error("leaks: --pid and --name cannot be combined");
    return EXIT_USAGE;
  }
  int rc = cli_probe_output(o);
  if (rc != 0) return rc;
  cli_options live = *o;
  live.contents = true;
  hd_reassembler scans[2];
  hd_reassembler_init(&scans[0]);
  hd_reassembler_init(&scans[1]);
  /* Processes one scan could not read are said and left out; the others are checked. */
  bool partial = false;
  rc = cli_take_live_snapshot(&live, o->has_pid ? o->pid : 0, &scans[0]);
  if (rc == EXIT_PARTIAL) partial = true, rc = 0;
  if (rc == 0) {
    double interval = o->interval > 0 ? o->interval : 1.0;
    struct timespec pause = {(time_t)interval, (long)((interval - (double)(time_t)interval) * 1e9)};
    while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
    }
    rc = cli_take_live_snapshot(&live, o->has_pid ? o->pid : 0, &scans[1]);
    if (rc == EXIT_PARTIAL) partial = true, rc = 0;
  }
  uint64_t now = monotonic_ns();
  const hd_reassembler *r = &scans[1];
  uint8_t **categories = rc == 0 ? calloc(r->snapshot_count + 1, sizeof *categories) : NULL;
  if (rc == 0 && categories == NULL) rc = EXIT_FAILURE_;
  for (size_t i = 0; rc == 0 && i < r->snapshot_count; i++) {
    const hd_snapshot *s = r->snapshots[i];
    if (!hd_reach_possible(s)) {
      cli_error("the collector sent no roots for %s[%" PRIu64 "]: it is older than this heapdump",
                s->process_name, s->pid);
      rc = EXIT_FAILURE_;
      break;
    }
    const hd_snapshot *before = NULL;
    for (size_t k = 0; k < scans[0].snapshot_count; k++) {
      if (scans[0].snapshots[k]->pid == s->pid) before = scans[0].snapshots[k];
    }
    categories[i] = malloc(s->allocation_count + 1);
    if (categories[i] == NULL || confirm_leaks(before, s, categories[i]) != 0) {
      cli_error("out of memory");
      rc = EXIT_FAILURE_;
    }
  }
  if (rc == 0) {
    cli_options report = *o;
    report.leak_categories = categories;
    report.leak_now_ns = now;
    report.source = "leak check of a running process (two scans)";
    rc = write_report(&report, r);
  }
  for (size_t i = 0; categories != NULL && i < r->snapshot_count; i++) free(categories[i]);
  free(categories);
  hd_reassembler_destroy(&scans[0]);
  hd_reassembler_destroy(&scans[1]);
  return rc == 0 && partial ? EXIT_PARTIAL : rc;
}

/* --sample-bytes's value (checked by the option's parser): digits and an optional K, M or G. */
static uint64_t sample_bytes_of(const char *value) {
  if (value == NULL) return 0;
  char *end;
  uint64_t n = strtoull(value, &end, 10);
  const unsigned shift = *end == 'k' || *end == 'K'   ? 10
                         : *end == 'm' || *end == 'M' ? 20
                         : *end == 'g' || *end == 'G' ? 30
                                                      : 0;
  return n > (UINT64_MAX >> shift) ? UINT64_MAX : n << shift;
}

/* Publishes the request, then waits until the process applies it (at its next allocation) and
 * its recording state says so, at most --timeout seconds. */
static int arm_or_disarm(const cli_options *o, bool recording) {
  const bool has_sample_bytes = recording && o->sample_bytes != NULL;
  uint64_t generation = 0;
  int rc = cli_arm_process(o, o->pid, recording, has_sample_bytes,
                           has_sample_bytes ? sample_bytes_of(o->sample_bytes) : 0, &generation);
  if (rc != 0) return rc;
  const heapdump_client_RecordingState want =
      recording ? heapdump_client_RecordingState_RECORDING_ARMED
                : heapdump_client_RecordingState_RECORDING_DISARMED;
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (;;) {
    heapdump_client_CollectorGetProcessStateResponse st;
    const bool answered = cli_process_state(o, o->pid, &st) == 0;
    /* It acted on this request (or a later one) and could not make its tables. */
    if (answered && recording && st.has_arm_failure_generation &&
        st.arm_failure_generation >= generation) {
      cli_error("arm: process %" PRIu64
                " could not arm, and stays dormant (forwarding every call to the allocator): %s"
                " (a later `heapdump arm` makes it try again)",
                o->pid, st.arm_failure);
      return EXIT_FAILURE_;
    }
    if (answered && st.state == heapdump_client_ProcessState_PROCESS_STATE_RUNNING &&
        st.has_recording && st.recording == want &&
        (!st.has_arm_generation || (int32_t)(st.arm_generation - (uint32_t)generation) >= 0)) {
      if (!recording) {
        printf("disarmed: process %" PRIu64 " (%s) records no new block\n", o->pid,
               st.process_name);
      } else if (!st.has_sample_bytes || st.sample_bytes == 0) {
        printf("armed: process %" PRIu64 " (%s) records every block it allocates\n", o->pid,
               st.process_name);
      } else {
        printf("armed: process %" PRIu64 " (%s) records one block per %" PRIu64
               " bytes it allocates, on average\n",
               o->pid, st.process_name, st.sample_bytes);
      }
      return 0;
    }
    clock_gettime(CLOCK_MONOTONIC, &now);
    const double waited =
        (double)(now.tv_sec - start.tv_sec) + (double)(now.tv_nsec - start.tv_nsec) / 1e9;
    if (o->timeout > 0 && waited >= o->timeout) {
      if (recording) {
        cli_error("arm: asked; process %" PRIu64
                  " has not acted on it yet (it does at its next allocation; the request stands"
                  " until then, or until `heapdump disarm --pid %" PRIu64 "` withdraws it)",
                  o->pid, o->pid);
      } else {
        cli_error("disarm: asked; process %" PRIu64
                  " has not acted on it yet (it does at its next allocation)",
                  o->pid);
      }
      return EXIT_TIMEOUT;
    }
    const struct timespec pause = {0, 20 * 1000 * 1000};
    nanosleep(&pause, NULL);
  }
}

int cmd_arm(cli_options *o, int argc, char **argv) {
  (void)argc;
  (void)argv;
  return arm_or_disarm(o, true);
}

int cmd_disarm(cli_options *o, int argc, char **argv) {
  (void)argc;
  (void)argv;
  return arm_or_disarm(o, false);
}
