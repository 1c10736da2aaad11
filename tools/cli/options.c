/* The heapdump command's options: one table says, for each, its names, its value, the commands
 * that take it, where its value goes and its help. getopt_long's table, the short-option string,
 * each command's option help and the "does not take" check are all derived from it, so adding an
 * option is one row here and one field in cli_options. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "heapdump/collector.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/heapdump.h"

#define ON(command) (1u << (command))
#define ALL_COMMANDS ((1u << CLI_COMMAND_COUNT) - 1)
/* The commands that write a snapshot in any format. */
#define WRITERS (ON(CLI_RUN) | ON(CLI_SNAPSHOT) | ON(CLI_DOWNLOAD) | ON(CLI_CONVERT))
/* ... and those that write text, JSON or HTML about one. */
#define OUTPUTS (WRITERS | ON(CLI_REPORT) | ON(CLI_DIFF) | ON(CLI_LEAKS))
#define COLLECTOR_CLIENTS                                                              \
  (ON(CLI_RUN) | ON(CLI_SNAPSHOT) | ON(CLI_LIST) | ON(CLI_DOWNLOAD) | ON(CLI_DELETE) | \
   ON(CLI_LEAKS) | ON(CLI_ARM) | ON(CLI_DISARM))
#define SELECTORS (ON(CLI_SNAPSHOT) | ON(CLI_LIST) | ON(CLI_DELETE) | ON(CLI_LEAKS))

/* Where an option's help is printed in `heapdump COMMAND --help`. */
typedef enum section {
  SECTION_COMMAND,
  SECTION_OUTPUT,
  SECTION_COLLECTOR,
  SECTION_GENERAL,
  SECTION_COUNT,
} section;

static const char *const kSectionTitles[SECTION_COUNT] = {
    "Options:", "Output options:", "Collector options:", "General options:"};

typedef struct cli_option cli_option;

/* Puts value (NULL for a switch) where the option says. Returns CLI_GO_ON or the exit code of
 * a usage error (said on stderr). */
typedef int (*option_apply)(const cli_option *opt, const char *value, cli_options *o);

struct cli_option {
  const char *name;       /* the long name, without "--" */
  char short_name;        /* 0: none */
  const char *value_name; /* NULL: a switch, which takes no value */
  unsigned commands;      /* ON() bits of the commands that take it */
  option_apply apply;
  size_t field;      /* the cli_options field apply writes, for the generic ones */
  bool switch_value; /* what set_switch writes there */
  section where;
  const char *help; /* one paragraph; wrapped when printed */
  /* Help worded for some commands, where the general one does not fit: first match wins. */
  struct {
    unsigned commands;
    const char *help;
  } help_for[3];
};

static HD_MUST_CHECK int set_switch(const cli_option *opt, const char *value, cli_options *o) {
  (void)value;
  *(bool *)((char *)o + opt->field) = opt->switch_value;
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_text(const cli_option *opt, const char *value, cli_options *o) {
  *(const char **)((char *)o + opt->field) = value;
  return CLI_GO_ON;
}

static bool parse_u64(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || s[0] == '-') return false;
  *out = v;
  return true;
}

/* A number of seconds in [min, max] (min itself only when zero_ok), or false. */
static bool parse_seconds(const char *arg, bool zero_ok, double max, double *out) {
  char *end;
  errno = 0;
  const double seconds = strtod(arg, &end);
  if (errno != 0 || end == arg || *end != '\0' || !(zero_ok ? seconds >= 0 : seconds > 0) ||
      seconds > max) {
    return false;
  }
  *out = seconds;
  return true;
}

/* The value of the keyword arg among names (NULL-terminated, values alike); false if none. */
static bool pick_keyword(const char *arg, const char *const names[], const int values[], int *out) {
  for (size_t i = 0; names[i] != NULL; i++) {
    if (strcmp(arg, names[i]) == 0) {
      *out = values[i];
      return true;
    }
  }
  return false;
}

static HD_MUST_CHECK int set_format(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  o->format = cli_parse_format(value);
  if (o->format == FORMAT_NONE) {
    return cli_usage_error("unknown format '%s' (raw, pprof, dartheap, text, folded, json, html)",
                           value);
  }
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_pid(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  uint64_t pid;
  if (!parse_u64(value, &pid) || pid == 0) {
    return cli_usage_error("--pid wants a process id, not '%s'", value);
  }
  o->has_pid = true;
  o->pid = pid;
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_name(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  if (strlen(value) == 0 || strlen(value) > HD_NAME_MAX) {
    return cli_usage_error(
        "--name wants a process name of 1 to " HD_STRINGIFY(HD_NAME_MAX) " bytes");
  }
  o->name = value;
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_interval(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  if (!parse_seconds(value, false, INFINITY, &o->interval)) {
    return cli_usage_error("--interval wants a positive number of seconds, not '%s'", value);
  }
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_timeout(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  if (!parse_seconds(value, true, 1e6, &o->timeout)) {
    return cli_usage_error("--timeout wants a number of seconds (0: wait forever), not '%s'",
                           value);
  }
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_html(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  if (value[0] == '\0' || strcmp(value, "-") == 0) {
    return cli_usage_error("--html wants a file name (the page is written beside the profile)");
  }
  o->html_output = value;
  return CLI_GO_ON;
}

static HD_MUST_CHECK int add_debug_dir(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  if (o->debug_dir_count == sizeof o->debug_dirs / sizeof o->debug_dirs[0]) {
    return cli_usage_error("too many --debug-dir options");
  }
  o->debug_dirs[o->debug_dir_count++] = value;
  return CLI_GO_ON;
}

static HD_MUST_CHECK int add_alloc_fn(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  if (value[0] == '\0') return cli_usage_error("--alloc-fn wants a function name or pattern");
  if (o->alloc_fn_count == sizeof o->alloc_fn_patterns / sizeof o->alloc_fn_patterns[0]) {
    return cli_usage_error("too many --alloc-fn options");
  }
  o->alloc_fn_patterns[o->alloc_fn_count++] = value;
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_sample(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  static const char *const kNames[] = {
      "inuse_space", "inuse_objects", "alloc_space", "alloc_objects",
      "peak_space",  "peak_objects",  NULL};
  static const int kValues[] = {HD_PPROF_INUSE_SPACE, HD_PPROF_INUSE_OBJECTS,
                                HD_PPROF_ALLOC_SPACE, HD_PPROF_ALLOC_OBJECTS,
                                HD_PPROF_PEAK_SPACE,  HD_PPROF_PEAK_OBJECTS};
  int sample;
  if (!pick_keyword(value, kNames, kValues, &sample)) {
    return cli_usage_error("unknown sample type '%s'", value);
  }
  o->sample = (hd_pprof_sample)sample;
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_top(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  uint64_t top;
  if (!parse_u64(value, &top)) return cli_usage_error("--top wants a number");
  o->top = (size_t)top;
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_by(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  static const char *const kNames[] = {"site", "stack", "thread", NULL};
  static const int kValues[] = {HD_REPORT_BY_SITE, HD_REPORT_BY_STACK, HD_REPORT_BY_THREAD};
  int by;
  if (!pick_keyword(value, kNames, kValues, &by)) {
    return cli_usage_error("--by wants site, stack or thread, not '%s'", value);
  }
  o->by = (hd_report_by)by;
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_sort(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  static const char *const kNames[] = {"live", "allocated", "temporary", "peak", NULL};
  static const int kValues[] = {HD_REPORT_SORT_LIVE, HD_REPORT_SORT_ALLOCATED,
                                HD_REPORT_SORT_TEMPORARY, HD_REPORT_SORT_PEAK};
  int sort;
  if (!pick_keyword(value, kNames, kValues, &sort)) {
    return cli_usage_error("--sort wants live, allocated, temporary or peak, not '%s'", value);
  }
  o->sort = (hd_report_sort)sort;
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_children(const cli_option *opt, const char *value, cli_options *o) {
  (void)opt;
  static const char kProgramNameChars[] =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-,";
  if (value[0] == '\0' || value[strspn(value, kProgramNameChars)] != '\0') {
    return cli_usage_error(
        "--children wants all, none or program names separated by commas, "
        "not '%s'",
        value);
  }
  o->children = value;
  return CLI_GO_ON;
}

static HD_MUST_CHECK int set_sample_bytes(const cli_option *opt, const char *value,
                                          cli_options *o) {
  (void)opt;
  const size_t digits = strspn(value, "0123456789");
  const char *suffix = value + digits;
  if (digits == 0 || digits > 12 ||
      (suffix[0] != '\0' && (strchr("kKmMgG", suffix[0]) == NULL || suffix[1] != '\0'))) {
    return cli_usage_error(
        "--sample-bytes wants a number of bytes, with K, M or G for KiB, MiB or GiB (0: record "
        "every block), not '%s'",
        value);
  }
  o->sample_bytes = value;
  return CLI_GO_ON;
}

#define SWITCH(field_name, value) \
  .apply = set_switch, .field = offsetof(cli_options, field_name), .switch_value = (value)
#define TEXT(field_name) .apply = set_text, .field = offsetof(cli_options, field_name)

static const cli_option kOptions[] = {
    /* What the command works on. */
    {"pid", 'p', "PID", SELECTORS | ON(CLI_ARM) | ON(CLI_DISARM), .apply = set_pid,
     .where = SECTION_COMMAND, .help = "the process with this pid",
     .help_for = {{ON(CLI_LIST), "only those of this pid"},
                  {ON(CLI_DELETE), "with --all: only those of this pid"}}},
    {"name", 'n', "NAME", SELECTORS, .apply = set_name, .where = SECTION_COMMAND,
     .help = "the process with this name (at most " HD_STRINGIFY(HD_NAME_MAX) " bytes)",
     .help_for = {{ON(CLI_LIST), "only those of processes with this name"},
                  {ON(CLI_DELETE), "with --all: only those of processes with this name"}}},
    {"all", 'a', NULL, ON(CLI_SNAPSHOT) | ON(CLI_DELETE) | ON(CLI_LEAKS), SWITCH(all, true),
     .where = SECTION_COMMAND, .help = "every matching process",
     .help_for = {{ON(CLI_SNAPSHOT), "every matching process (all of them without --pid/--name)"},
                  {ON(CLI_DELETE),
                   "every stored snapshot (of the processes --pid or --name select)"}}},
    {"interval", 'i', "SECONDS", ON(CLI_RUN) | ON(CLI_LEAKS), .apply = set_interval,
     .where = SECTION_COMMAND, .help = "seconds between the two scans (default 1)",
     .help_for = {{ON(CLI_RUN),
                   "also write a live snapshot every SECONDS seconds (FILE.1.pb.gz, "
                   "FILE.2.pb.gz, ...)"}}},
    {"contents", 'c', NULL, ON(CLI_RUN) | ON(CLI_SNAPSHOT), SWITCH(contents, true),
     .where = SECTION_COMMAND,
     .help = "include each block's bytes (needed for dartheap references)",
     .help_for = {{ON(CLI_RUN),
                   "live snapshots carry the blocks' contents (exit snapshots "
                   "cannot: the process is gone)"}}},
    {"children", 0, "WHICH", ON(CLI_RUN), .apply = set_children, .where = SECTION_COMMAND,
     .help = "the processes COMMAND starts that are profiled: all (the default), none, or "
             "program names, e.g. cc1plus,ld (" HD_STRINGIFY(
                 HD_COMM_MAX) " bytes compared, as "
                              "process names); COMMAND itself always is. --interval snapshots "
                              "cover the ones "
                              "chosen (COMMAND only when all, none, or named)"},
    {"children-dir", 0, "DIR", ON(CLI_RUN), TEXT(children_dir), .where = SECTION_COMMAND,
     .help = "where the snapshots of the processes COMMAND started go (default: FILE's stem "
             "with .d, e.g. heapdump.make.4242.d/)"},
    {"sample-bytes", 0, "N", ON(CLI_RUN) | ON(CLI_ARM), .apply = set_sample_bytes,
     .where = SECTION_COMMAND,
     .help = "record one block per N bytes allocated on average, each counted as the blocks it "
             "stands for, so that every count is an estimate (512K is the production value); "
             "default: every block (HEAPDUMP_SAMPLE_BYTES)",
     .help_for = {{ON(CLI_ARM),
                   "record one block per N bytes allocated on average (512K is the production "
                   "value); default: every block. Fixed at the process's first arming"}}},
    {"verbose", 0, NULL, ON(CLI_RUN), SWITCH(verbose, true), .where = SECTION_COMMAND,
     .help = "list every file written for those processes"},
    {"no-leak-check", 0, NULL, ON(CLI_RUN), SWITCH(no_leak_check, true), .where = SECTION_COMMAND,
     .help = "COMMAND's exit snapshot without contents: what was live at exit is listed by "
             "site, not classified"},
    {"show-reachable", 0, NULL, ON(CLI_RUN) | ON(CLI_REPORT) | ON(CLI_LEAKS),
     SWITCH(show_reachable, true), .where = SECTION_COMMAND,
     .help = "list possibly lost and still reachable blocks too",
     .help_for = {{ON(CLI_RUN),
                   "the leak check lists possibly lost and still reachable blocks "
                   "too"},
                  {ON(CLI_REPORT),
                   "a leak check: list possibly lost and still reachable blocks "
                   "too"}}},
    {"html", 0, "FILE", ON(CLI_RUN), .apply = set_html, .where = SECTION_COMMAND,
     .help = "also write the exit snapshot as an HTML page: memory over time, flame graph, "
             "sites and leak check, for a browser"},
    {"force", 0, NULL, ON(CLI_CONVERT), SWITCH(force, true), .where = SECTION_COMMAND,
     .help = "overwrite the output if it exists"},

    /* What is written, and how. */
    {"output", 'o', "FILE", OUTPUTS, TEXT(output), .where = SECTION_OUTPUT,
     .help = "where to write ('-': stdout)",
     .help_for = {{ON(CLI_REPORT) | ON(CLI_LEAKS),
                   "where to write (default: stdout); text, JSON or the HTML report (.txt, "
                   ".json, .html)"},
                  {ON(CLI_DIFF), "where to write (default: stdout; pprof: heapdump.diff.pb.gz)"}}},
    {"format", 'f', "F", OUTPUTS, .apply = set_format, .where = SECTION_OUTPUT,
     .help = "raw, pprof, dartheap, text, folded, json or html (default: from FILE's extension "
             ".heapdump .pb.gz .dartheap .txt .folded .json .html, else pprof)",
     .help_for = {{ON(CLI_REPORT) | ON(CLI_LEAKS),
                   "text (default), json or html (default: from FILE's extension)"},
                  {ON(CLI_DIFF),
                   "text (default), json, pprof or html (default: from FILE's "
                   "extension; html: heapdump.diff.html, a flame graph of "
                   "growth)"}}},
    {"json", 0, NULL, OUTPUTS | ON(CLI_LIST), SWITCH(json, true), .where = SECTION_OUTPUT,
     .help = "text: JSON instead of a table",
     .help_for = {{ON(CLI_REPORT), "JSON instead of a table"},
                  {ON(CLI_LIST), "a JSON array"},
                  {ON(CLI_DIFF), "the same as --format json"}}},
    {"top", 0, "N", OUTPUTS, .apply = set_top, .where = SECTION_OUTPUT,
     .help = "text: groups shown per process (default 20; 0: all)",
     .help_for = {{ON(CLI_REPORT) | ON(CLI_DIFF), "groups shown per process (default 20; 0: all)"},
                  {ON(CLI_LEAKS), "groups shown per category (default 20; 0: all)"}}},
    {"by", 0, "B", OUTPUTS, .apply = set_by, .where = SECTION_OUTPUT,
     .help = "text: group by site (default), stack or thread",
     .help_for = {{ON(CLI_REPORT) | ON(CLI_LEAKS), "group by site (default), stack or thread"},
                  {ON(CLI_DIFF), "group by site (default) or stack"}}},
    {"sort", 0, "S", OUTPUTS & ~(ON(CLI_DIFF) | ON(CLI_LEAKS)), .apply = set_sort,
     .where = SECTION_OUTPUT,
     .help = "text, JSON, html: sites or stacks by live bytes (live, the default), bytes "
             "allocated since start (allocated), temporary blocks (temporary: freed by their "
             "thread before it allocated or freed anything else) or bytes live at the peak "
             "(peak); all but live list sites with nothing live too"},
    {"tags", 0, NULL, WRITERS, SWITCH(tags, true), .where = SECTION_OUTPUT,
     .help = "pprof: one sample per block, labelled address, bytes, timestamp, thread"},
    {"sample-index", 0, "T", WRITERS | ON(CLI_DIFF), .apply = set_sample, .where = SECTION_OUTPUT,
     .help = "pprof default sample type: inuse_space (default), inuse_objects, alloc_space, "
             "alloc_objects, peak_space, peak_objects (what was live at the peak)"},
    {"symbolize", 0, NULL, OUTPUTS, SWITCH(symbolize, true), .where = SECTION_OUTPUT,
     .help = "function names, files, lines and inlined frames where symbols are found (the "
             "default)"},
    {"no-symbolize", 0, NULL, OUTPUTS, SWITCH(symbolize, false), .where = SECTION_OUTPUT,
     .help = "addresses only"},
    {"debug-dir", 0, "DIR", OUTPUTS, .apply = add_debug_dir, .where = SECTION_OUTPUT,
     .help = "also look for debug files in DIR (repeatable)"},
    {"alloc-fn", 0, "NAME", OUTPUTS, .apply = add_alloc_fn, .where = SECTION_OUTPUT,
     .help = "a function of the program that allocates for its callers (shell pattern; "
             "repeatable): its callers are the sites"},
    {"no-builtin-alloc-fns", 0, NULL, OUTPUTS, SWITCH(no_builtin_alloc_fns, true),
     .where = SECTION_OUTPUT, .help = "xmalloc, g_malloc... are sites like other functions"},

    /* Which collector to ask. */
    {"socket", 0, "PATH", COLLECTOR_CLIENTS, TEXT(socket), .where = SECTION_COLLECTOR,
     .help = "the collector's socket (default: $HEAPDUMP_SOCKET, else "
             "$XDG_RUNTIME_DIR/heapdump/collector.sock, else /tmp/heapdump-$UID/collector.sock)"},
    {"timeout", 0, "S", COLLECTOR_CLIENTS, .apply = set_timeout, .where = SECTION_COLLECTOR,
     .help = "give up when the collector does not answer, or sends nothing of a snapshot, for S "
             "seconds (default 10; 0: wait forever)"},

    {"help", 'h', NULL, ALL_COMMANDS, SWITCH(help, true), .where = SECTION_GENERAL,
     .help = "this help"},
    {"version", 0, NULL, ALL_COMMANDS, SWITCH(version, true), .where = SECTION_GENERAL,
     .help = "heapdump's version"},
};

#define OPTION_COUNT (sizeof kOptions / sizeof kOptions[0])

/* getopt_long's answer for option i: its short name, else a value past every char. */
static int option_code(size_t i) {
  return kOptions[i].short_name != 0 ? kOptions[i].short_name : 256 + (int)i;
}

static const cli_option *option_by_code(int code) {
  for (size_t i = 0; i < OPTION_COUNT; i++) {
    if (option_code(i) == code) return &kOptions[i];
  }
  return NULL;
}

const char *cli_option_name(size_t i) { return i < OPTION_COUNT ? kOptions[i].name : NULL; }

int cli_apply_options(unsigned command, int argc, char **argv, cli_options *o, int *first_arg) {
  const cli_command *c = cli_command_at(command);
  struct option long_options[OPTION_COUNT + 1];
  /* "+": options end at the first argument, the rest is the command's; "-"-less otherwise, so
   * options may follow arguments. */
  char short_options[2 * OPTION_COUNT + 2];
  size_t n = 0;
  if (c->options_end_at_first_argument) short_options[n++] = '+';
  for (size_t i = 0; i < OPTION_COUNT; i++) {
    long_options[i] =
        (struct option){kOptions[i].name, kOptions[i].value_name ? required_argument : no_argument,
                        NULL, option_code(i)};
    if (kOptions[i].short_name != 0) {
      short_options[n++] = kOptions[i].short_name;
      if (kOptions[i].value_name != NULL) short_options[n++] = ':';
    }
  }
  long_options[OPTION_COUNT] = (struct option){NULL, 0, NULL, 0};
  short_options[n] = '\0';

  optind = 0; /* glibc: start afresh, the "+" of this string included */
  opterr = 0;
  int code;
  while ((code = getopt_long(argc, argv, short_options, long_options, NULL)) != -1) {
    const cli_option *opt = option_by_code(code);
    if (opt == NULL) {
      /* As written: "--pid" missing its value is told as --pid, not as -p. */
      const char *written = argv[optind - 1];
      if (strncmp(written, "--", 2) != 0 && optopt != 0 && optopt < 256) {
        return cli_usage_error("%s: option -%c is unknown or needs a value", c->name, optopt);
      }
      return cli_usage_error("%s: option %s is unknown or needs a value", c->name, written);
    }
    if (!(opt->commands & ON(command))) {
      return cli_usage_error("%s does not take --%s (heapdump %s --help lists its options)",
                             c->name, opt->name, c->name);
    }
    /* `run --html -- prog`: getopt takes the "--" that ends the options for --html's value,
     * which would name the page "--". */
    if (optarg != NULL && strcmp(optarg, "--") == 0) {
      return cli_usage_error("%s: option --%s needs a value before --", c->name, opt->name);
    }
    const int rc = opt->apply(opt, optarg, o);
    if (rc != CLI_GO_ON) return rc;
    if (o->help) {
      cli_command_help(command);
      return EXIT_OK;
    }
    if (o->version) {
      printf("heapdump %s\n", HEAPDUMP_VERSION_STRING);
      return EXIT_OK;
    }
  }
  *first_arg = optind;
  return CLI_GO_ON;
}

/* Prints text with the cursor at column `at`, wrapped at kWidth, later lines indented to
 * `indent`. */
static void print_wrapped(const char *text, size_t at, size_t indent) {
  enum { kWidth = 94 };
  const char *p = text;
  bool first = true;
  while (*p != '\0') {
    size_t word = strcspn(p, " ");
    if (!first && at + 1 + word > kWidth) {
      printf("\n%*s", (int)indent, "");
      at = indent;
    } else if (!first) {
      putchar(' ');
      at++;
    }
    first = false;
    printf("%.*s", (int)word, p);
    at += word;
    p += word;
    p += strspn(p, " ");
  }
  putchar('\n');
}

void cli_print_options(unsigned command) {
  enum { kHelpColumn = 24 };
  for (int s = 0; s < SECTION_COUNT; s++) {
    bool titled = false;
    for (size_t i = 0; i < OPTION_COUNT; i++) {
      const cli_option *opt = &kOptions[i];
      if (opt->where != (section)s || !(opt->commands & ON(command))) continue;
      if (!titled) {
        printf("\n%s\n", kSectionTitles[s]);
        titled = true;
      }
      const char *help = opt->help;
      for (size_t k = 0; k < sizeof opt->help_for / sizeof opt->help_for[0]; k++) {
        if (opt->help_for[k].commands & ON(command)) {
          help = opt->help_for[k].help;
          break;
        }
      }
      char left[64];
      int width =
          snprintf(left, sizeof left, "  %c%c%s--%s%s%s", opt->short_name ? '-' : ' ',
                   opt->short_name ? opt->short_name : ' ', opt->short_name ? ", " : "  ",
                   opt->name, opt->value_name ? " " : "", opt->value_name ? opt->value_name : "");
      printf("%s", left);
      size_t at = (size_t)width;
      if (at + 2 <= kHelpColumn) {
        printf("%*s", (int)(kHelpColumn - at), "");
        at = kHelpColumn;
      } else {
        printf("  ");
        at += 2;
      }
      print_wrapped(help, at, kHelpColumn);
    }
  }
}
