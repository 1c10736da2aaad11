/* heapdump: the command line of the profiler. Subcommands run a program under the profiler, take
 * live snapshots, list and download stored ones, and convert or report snapshot files. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "heapdump/collector.h"
#include "heapdump/heapdump.h"

bool cli_quiet;

void cli_error(const char *fmt, ...) {
  if (cli_quiet) return;
  va_list ap;
  va_start(ap, fmt);
  fputs("heapdump: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

static const char kUsage[] =
    "usage: heapdump COMMAND [OPTIONS]\n"
    "\n"
    "Commands:\n"
    "  run       run a program under the profiler; write and report what it leaked\n"
    "  snapshot  take a live snapshot of a running instrumented process\n"
    "  list      list the snapshots the collector stored\n"
    "  download  download a stored snapshot\n"
    "  delete    delete stored snapshots\n"
    "  convert   convert a snapshot file (raw or pprof) to another format\n"
    "  report    print the top allocation sites of a snapshot file (raw or pprof)\n"
    "  diff      what grew between two snapshots of a process\n"
    "  leaks     check a running program for leaks, without stopping it\n"
    "\n"
    "`heapdump COMMAND --help` describes a command. Formats: raw, pprof, dartheap, text, folded,\n"
    "json, html.\n";

static const char kOutputHelp[] =
    "Output options:\n"
    "  -o, --output FILE     where to write ('-': stdout)\n"
    "  -f, --format F        raw, pprof, dartheap, text, folded, json or html (default: from\n"
    "                        FILE's extension .heapdump .pb.gz .dartheap .txt .folded .json\n"
    "                        .html, else pprof)\n"
    "      --symbolize       add function names, files, lines and inlined frames where symbols\n"
    "                        are found (the default)\n"
    "      --no-symbolize    write addresses only\n"
    "      --debug-dir DIR   also look for debug files in DIR (repeatable)\n"
    "      --alloc-fn NAME   a function of the program that allocates for its callers\n"
    "                        (shell pattern; repeatable): its callers are the sites\n"
    "      --no-builtin-alloc-fns  xmalloc, g_malloc... are sites like other functions\n"
    "      --tags            pprof: one sample per block, labelled address, bytes, timestamp,\n"
    "                        thread\n"
    "      --sample-index T  pprof default sample type: inuse_space (default), inuse_objects,\n"
    "                        alloc_space, alloc_objects\n"
    "      --top N           text: groups shown per process (default 20; 0: all)\n"
    "      --by B            text: group by site (default), stack or thread\n"
    "      --json            text: JSON instead of a table\n";

static const char kCollectorHelp[] =
    "      --socket PATH     the collector's socket (default: $HEAPDUMP_SOCKET, else\n"
    "                        $XDG_RUNTIME_DIR/heapdump/collector.sock, else\n"
    "                        /tmp/heapdump-$UID/collector.sock)\n"
    "      --timeout S       give up when the collector does not answer, or sends nothing of\n"
    "                        a snapshot, for S seconds (default 10; 0: wait forever)\n";

static const char kGeneralHelp[] =
    "  -h, --help            this help\n"
    "      --version         heapdump's version\n";

/* One bit per command, for the table of which command takes which option. */
enum {
  CMD_RUN = 1 << 0,
  CMD_SNAPSHOT = 1 << 1,
  CMD_LIST = 1 << 2,
  CMD_DOWNLOAD = 1 << 3,
  CMD_CONVERT = 1 << 4,
  CMD_REPORT = 1 << 5,
  CMD_DELETE = 1 << 6,
  CMD_DIFF = 1 << 7,
  CMD_LEAKS = 1 << 8,
};
#define CMD_ALL                                                                              \
  (CMD_RUN | CMD_SNAPSHOT | CMD_LIST | CMD_DOWNLOAD | CMD_CONVERT | CMD_REPORT | CMD_DELETE | \
   CMD_DIFF | CMD_LEAKS)
#define CMD_WRITERS (CMD_RUN | CMD_SNAPSHOT | CMD_DOWNLOAD | CMD_CONVERT)   /* any format */
#define CMD_OUTPUT (CMD_WRITERS | CMD_REPORT | CMD_DIFF | CMD_LEAKS)       /* text too */
#define CMD_COLLECTOR (CMD_RUN | CMD_SNAPSHOT | CMD_LIST | CMD_DOWNLOAD | CMD_DELETE | CMD_LEAKS)

/* In the order of the CMD_ bits. */
static const struct {
  const char *name;
  const char *usage;
  const char *description;
  bool output_options;
} kCommands[] = {
    {"run", "heapdump run [OPTIONS] -- COMMAND [ARGS...]",
     "Runs COMMAND with libheapdump.so preloaded and exit snapshots on, using the collector at\n"
     "the socket if one answers, else one of its own for the run. When COMMAND exits, writes its\n"
     "exit snapshot (the blocks still live) to heapdump.NAME.PID.pb.gz (or --output) and prints\n"
     "a leak check of it: COMMAND stores its exit snapshot from its exit path (after its atexit\n"
     "handlers and static destructors) with contents and roots, so every block still live is\n"
     "classified as valgrind does; definitely and indirectly lost are listed by site. Exits with\n"
     "COMMAND's status.\n"
     "\n"
     "  -i, --interval SECONDS  also write a live snapshot every SECONDS seconds\n"
     "                          (FILE.1.pb.gz, FILE.2.pb.gz, ...)\n"
     "  -c, --contents          live snapshots carry the blocks' contents (exit snapshots\n"
     "                          cannot: the process is gone)\n"
     "      --children WHICH    the processes COMMAND starts that are profiled: all (the\n"
     "                          default), none, or program names, e.g. cc1plus,ld (" HD_STRINGIFY(HD_COMM_MAX) " bytes\n"
     "                          compared, as process names); COMMAND itself always is.\n"
     "                          --interval snapshots cover the ones chosen (COMMAND only when\n"
     "                          all, none, or named)\n"
     "      --children-dir DIR  where the snapshots of the processes COMMAND started go\n"
     "                          (default: FILE's stem with .d, e.g. heapdump.make.4242.d/)\n"
     "      --verbose           list every file written for those processes\n"
     "      --no-leak-check     COMMAND's exit snapshot without contents: what was live at\n"
     "                          exit is listed by site, not classified\n"
     "      --show-reachable    the leak check lists possibly lost and still reachable blocks\n"
     "                          too\n"
     "      --html FILE         also write the exit snapshot as an HTML page: memory over\n"
     "                          time, flame graph, sites and leak check, for a browser\n"
     "\n"
     "COMMAND is followed across exec (env, nice, sh -c 'exec ...', wrapper scripts): the\n"
     "report and FILE are of its last program. With the collector run starts itself, the\n"
     "processes COMMAND starts are profiled too (see --children); run waits until each has its\n"
     "exit snapshot written, then prints one summary line and the top ones by peak live bytes.\n",
     true},
    {"snapshot", "heapdump snapshot [--pid PID | --name NAME] [--all] [--contents] [OPTIONS]",
     "Takes a live snapshot of a running instrumented process, without stopping it, and writes\n"
     "it to heapdump.NAME.PID.pb.gz (or --output).\n"
     "\n"
     "  -p, --pid PID     the process with this pid\n"
     "  -n, --name NAME   the process with this name (at most " HD_STRINGIFY(HD_NAME_MAX) " bytes)\n"
     "  -a, --all         every matching process (all of them without --pid/--name)\n"
     "  -c, --contents    include each block's bytes (needed for dartheap references)\n",
     true},
    {"list", "heapdump list [--pid PID | --name NAME] [--json]",
     "Lists the snapshots the collector stored (named snapshots and exit snapshots), oldest\n"
     "first: ID, NAME, PROCESS[PID], TAKEN (local time), LIVE BYTES and BLOCKS (what the process\n"
     "had live then), STORED (bytes on the collector's disk).\n"
     "\n"
     "  -p, --pid PID     only those of this pid\n"
     "  -n, --name NAME   only those of processes with this name\n"
     "      --json        a JSON array\n",
     false},
    {"download", "heapdump download ID [OPTIONS]",
     "Downloads stored snapshot ID and writes it to heapdump.snapshot-ID.pb.gz (or --output).\n",
     true},
    {"convert", "heapdump convert INPUT --format F [--output FILE] [OPTIONS]",
     "Converts a raw snapshot file or a pprof heap profile (INPUT '-': stdin) to format F. The\n"
     "output defaults to INPUT with the format's extension (text and folded: stdout). An\n"
     "existing file is not overwritten unless --force. A profile holds less than a raw file:\n"
     "per stack its totals (per block with --tags), and the names it was written with.\n"
     "\n"
     "      --force       overwrite the output if it exists\n",
     true},
    {"report", "heapdump report INPUT [--top N] [--by site|stack|thread] [--json | --format html]",
     "Prints the top allocation sites (or stacks, or threads) of a raw snapshot file or a pprof\n"
     "heap profile (what run and snapshot write by default) by live bytes and blocks, with the\n"
     "bytes and blocks allocated since start where recorded, and symbolized stacks (a symbolized\n"
     "profile's names are used as written).\n"
     "\n"
     "  -o, --output FILE     where to write (default: stdout); text, JSON or the HTML report\n"
     "                        (.txt, .json, .html)\n"
     "  -f, --format F        text (default), json or html (default: from FILE's extension)\n"
     "      --top N           groups shown per process (default 20; 0: all)\n"
     "      --by B            group by site (default), stack or thread\n"
     "      --json            JSON instead of a table\n"
     "      --show-reachable  a leak check: list possibly lost and still reachable blocks too\n"
     "      --symbolize       function names, files and lines where symbols are found (default)\n"
     "      --no-symbolize    addresses only\n"
     "      --debug-dir DIR   also look for debug files in DIR (repeatable)\n"
     "      --alloc-fn NAME   a function of the program that allocates for its callers\n"
     "                        (shell pattern; repeatable): its callers are the sites\n"
     "      --no-builtin-alloc-fns  xmalloc, g_malloc... are sites like other functions\n"
     "\n"
     "A snapshot taken with --contents also holds the program's roots (its modules' data, its\n"
     "threads' stacks and TLS): its report is a leak check, each block classified as definitely\n"
     "lost, indirectly lost, possibly lost or still reachable, as valgrind does.\n",
     false},
    {"delete", "heapdump delete ID... | heapdump delete --all [--pid PID | --name NAME]",
     "Deletes stored snapshots: the IDs given (see heapdump list), or with --all every one\n"
     "stored of your processes (of those --pid or --name select). Root deletes anyone's.\n"
     "Unknown IDs are reported and the others still deleted (exit status 4).\n"
     "\n"
     "  -a, --all         every stored snapshot (of the processes --pid or --name select)\n"
     "  -p, --pid PID     with --all: only those of this pid\n"
     "  -n, --name NAME   with --all: only those of processes with this name\n",
     false},
    {"diff", "heapdump diff BASE NEW [--format text|json|pprof|html] [--by site|stack] [OPTIONS]",
     "Compares two snapshot files of one process (raw or pprof; e.g. the first and the last of\n"
     "`heapdump run --interval`): per site (or stack), the bytes and blocks added (live in NEW,\n"
     "not in BASE), removed (live in BASE, freed by NEW) and the net change, sorted by net\n"
     "growth, with the stack that changed most. Blocks are matched by address and allocation\n"
     "time where both files record them one by one (raw, or pprof written with --tags); from\n"
     "profiles of totals, added and removed are each site's net change. Several processes in\n"
     "a file are paired by pid. pprof output holds the net change of every stack (negative\n"
     "where it shrank), for `go tool pprof -top` or a flame graph of growth.\n"
     "\n"
     "  -o, --output FILE     where to write (default: stdout; pprof: heapdump.diff.pb.gz)\n"
     "  -f, --format F        text (default), json, pprof or html (default: from FILE's\n"
     "                        extension; html: heapdump.diff.html, a flame graph of growth)\n"
     "      --json            the same as --format json\n"
     "      --top N           groups shown per process (default 20; 0: all)\n"
     "      --by B            group by site (default) or stack\n"
     "      --sample-index T  pprof default sample type (default inuse_space)\n"
     "      --symbolize       function names, files and lines where symbols are found (default)\n"
     "      --no-symbolize    addresses only\n"
     "      --debug-dir DIR   also look for debug files in DIR (repeatable)\n"
     "      --alloc-fn NAME   a function of the program that allocates for its callers\n"
     "                        (shell pattern; repeatable): its callers are the sites\n"
     "      --no-builtin-alloc-fns  xmalloc, g_malloc... are sites like other functions\n",
     false},
    {"leaks", "heapdump leaks [--pid PID | --name NAME] [--interval S] [--json] [OPTIONS]",
     "Checks a running instrumented program for leaks without stopping it: takes two snapshots\n"
     "with contents and roots (its modules' data, its threads' stacks and TLS, the memory it\n"
     "mapped itself), S seconds apart, classifies every block as valgrind does (definitely\n"
     "lost, indirectly lost, possibly lost, still reachable) and reports as lost only the\n"
     "blocks lost in both scans (same address, size and allocation time), so that a pointer in\n"
     "flight in a register between two places makes no false leak. Lists the lost blocks by\n"
     "category and site, with bytes, blocks, the age of the oldest and the stack.\n"
     "\n"
     "  -p, --pid PID         the process with this pid\n"
     "  -n, --name NAME       the process with this name\n"
     "  -a, --all             every matching process\n"
     "  -i, --interval S      seconds between the two scans (default 1)\n"
     "  -o, --output FILE     where to write (default: stdout); text, JSON or the HTML report\n"
     "                        (.txt, .json, .html)\n"
     "  -f, --format F        text (default), json or html (default: from FILE's extension)\n"
     "      --json            JSON, in the shape of report --json, each group with its\n"
     "                        category and oldest_age_s\n"
     "      --show-reachable  list possibly lost and still reachable blocks too\n"
     "      --top N           groups shown per category (default 20; 0: all)\n"
     "      --by B            group by site (default), stack or thread\n"
     "      --symbolize       function names, files and lines where symbols are found (default)\n"
     "      --no-symbolize    addresses only\n"
     "      --debug-dir DIR   also look for debug files in DIR (repeatable)\n"
     "      --alloc-fn NAME   a function of the program that allocates for its callers\n"
     "                        (shell pattern; repeatable): its callers are the sites\n"
     "      --no-builtin-alloc-fns  xmalloc, g_malloc... are sites like other functions\n",
     false},
};

static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("heapdump: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs("\n(see heapdump --help)\n", stderr);
  va_end(ap);
  return EXIT_USAGE;
}

static void command_help(size_t i) {
  printf("usage: %s\n\n%s\n", kCommands[i].usage, kCommands[i].description);
  if (kCommands[i].output_options) printf("%s", kOutputHelp);
  if ((1u << i) & CMD_COLLECTOR) printf("%s", kCollectorHelp);
  printf("%s", kGeneralHelp);
  printf("\nExit status: 0 success, 1 failure, 2 usage error, 3 no collector running, 4 no such\n"
         "process or snapshot, 5 ambiguous process name, 6 permission denied, 7 the collector\n"
         "did not answer in time%s.\n",
         strcmp(kCommands[i].name, "run") == 0
             ? "; run: COMMAND's status\n(128+N if killed by signal N), 125 if heapdump could "
               "not start it, 126/127 if it\ncould not be executed / found"
             : "");
}

static bool parse_u64(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || s[0] == '-') return false;
  *out = v;
  return true;
}

enum {
  OPT_SOCKET = 256,
  OPT_SYMBOLIZE,
  OPT_NO_SYMBOLIZE,
  OPT_DEBUG_DIR,
  OPT_TAGS,
  OPT_SAMPLE_INDEX,
  OPT_TOP,
  OPT_BY,
  OPT_JSON,
  OPT_TIMEOUT,
  OPT_CHILDREN,
  OPT_CHILDREN_DIR,
  OPT_VERBOSE,
  OPT_FORCE,
  OPT_VERSION,
  OPT_SHOW_REACHABLE,
  OPT_NO_LEAK_CHECK,
  OPT_HTML,
  OPT_ALLOC_FN,
  OPT_NO_BUILTIN_ALLOC_FNS,
};

/* Which command takes which option: anything else is a usage error, never silently ignored. */
static const struct {
  int option;
  const char *name;
  unsigned commands;
} kOptionCommands[] = {
    {'o', "--output", CMD_OUTPUT},
    {'f', "--format", CMD_WRITERS | CMD_DIFF | CMD_REPORT | CMD_LEAKS},
    {'p', "--pid", CMD_SNAPSHOT | CMD_LIST | CMD_DELETE | CMD_LEAKS},
    {'n', "--name", CMD_SNAPSHOT | CMD_LIST | CMD_DELETE | CMD_LEAKS},
    {'a', "--all", CMD_SNAPSHOT | CMD_DELETE | CMD_LEAKS},
    {'c', "--contents", CMD_RUN | CMD_SNAPSHOT},
    {'i', "--interval", CMD_RUN | CMD_LEAKS},
    {OPT_SOCKET, "--socket", CMD_COLLECTOR},
    {OPT_TIMEOUT, "--timeout", CMD_COLLECTOR},
    {OPT_SYMBOLIZE, "--symbolize", CMD_OUTPUT},
    {OPT_NO_SYMBOLIZE, "--no-symbolize", CMD_OUTPUT},
    {OPT_DEBUG_DIR, "--debug-dir", CMD_OUTPUT},
    {OPT_TAGS, "--tags", CMD_WRITERS},
    {OPT_SAMPLE_INDEX, "--sample-index", CMD_WRITERS | CMD_DIFF},
    {OPT_TOP, "--top", CMD_OUTPUT},
    {OPT_BY, "--by", CMD_OUTPUT},
    {OPT_JSON, "--json", CMD_OUTPUT | CMD_LIST},
    {OPT_CHILDREN, "--children", CMD_RUN},
    {OPT_CHILDREN_DIR, "--children-dir", CMD_RUN},
    {OPT_VERBOSE, "--verbose", CMD_RUN},
    {OPT_FORCE, "--force", CMD_CONVERT},
    {OPT_VERSION, "--version", CMD_ALL},
    {OPT_SHOW_REACHABLE, "--show-reachable", CMD_REPORT | CMD_LEAKS | CMD_RUN},
    {OPT_NO_LEAK_CHECK, "--no-leak-check", CMD_RUN},
    {OPT_HTML, "--html", CMD_RUN},
    {OPT_ALLOC_FN, "--alloc-fn", CMD_OUTPUT},
    {OPT_NO_BUILTIN_ALLOC_FNS, "--no-builtin-alloc-fns", CMD_OUTPUT},
};

/* The option's name if `command` (an index in kCommands) does not take it, else NULL. */
static const char *option_refused(int option, size_t command) {
  for (size_t i = 0; i < sizeof kOptionCommands / sizeof kOptionCommands[0]; i++) {
    if (kOptionCommands[i].option == option) {
      return (kOptionCommands[i].commands & (1u << command)) ? NULL : kOptionCommands[i].name;
    }
  }
  return NULL;
}

/* How long a collector may take to answer: it answers calls at once and sends a 10^6-block
 * snapshot's batches in well under a second, so a silent one is stuck, stopped or not one. */
#define DEFAULT_TIMEOUT_SECONDS 10

static const struct option kLong[] = {
    {"help", no_argument, NULL, 'h'},
    {"output", required_argument, NULL, 'o'},
    {"format", required_argument, NULL, 'f'},
    {"pid", required_argument, NULL, 'p'},
    {"name", required_argument, NULL, 'n'},
    {"all", no_argument, NULL, 'a'},
    {"contents", no_argument, NULL, 'c'},
    {"interval", required_argument, NULL, 'i'},
    {"socket", required_argument, NULL, OPT_SOCKET},
    {"symbolize", no_argument, NULL, OPT_SYMBOLIZE},
    {"no-symbolize", no_argument, NULL, OPT_NO_SYMBOLIZE},
    {"debug-dir", required_argument, NULL, OPT_DEBUG_DIR},
    {"tags", no_argument, NULL, OPT_TAGS},
    {"sample-index", required_argument, NULL, OPT_SAMPLE_INDEX},
    {"top", required_argument, NULL, OPT_TOP},
    {"by", required_argument, NULL, OPT_BY},
    {"json", no_argument, NULL, OPT_JSON},
    {"timeout", required_argument, NULL, OPT_TIMEOUT},
    {"children", required_argument, NULL, OPT_CHILDREN},
    {"children-dir", required_argument, NULL, OPT_CHILDREN_DIR},
    {"verbose", no_argument, NULL, OPT_VERBOSE},
    {"force", no_argument, NULL, OPT_FORCE},
    {"version", no_argument, NULL, OPT_VERSION},
    {"show-reachable", no_argument, NULL, OPT_SHOW_REACHABLE},
    {"no-leak-check", no_argument, NULL, OPT_NO_LEAK_CHECK},
    {"html", required_argument, NULL, OPT_HTML},
    {"alloc-fn", required_argument, NULL, OPT_ALLOC_FN},
    {"no-builtin-alloc-fns", no_argument, NULL, OPT_NO_BUILTIN_ALLOC_FNS},
    {NULL, 0, NULL, 0},
};

/* parse_option's answer when the command line goes on. */
#define CONTINUE (-1)

/* Options that only switch something on (or off): which field they set, to what. */
static const struct {
  int option;
  size_t field; /* offset of a bool in cli_options */
  bool value;
} kSwitches[] = {
    {'a', offsetof(cli_options, all), true},
    {'c', offsetof(cli_options, contents), true},
    {OPT_SYMBOLIZE, offsetof(cli_options, symbolize), true},
    {OPT_NO_SYMBOLIZE, offsetof(cli_options, symbolize), false},
    {OPT_TAGS, offsetof(cli_options, tags), true},
    {OPT_JSON, offsetof(cli_options, json), true},
    {OPT_VERBOSE, offsetof(cli_options, verbose), true},
    {OPT_FORCE, offsetof(cli_options, force), true},
    {OPT_SHOW_REACHABLE, offsetof(cli_options, show_reachable), true},
    {OPT_NO_LEAK_CHECK, offsetof(cli_options, no_leak_check), true},
    {OPT_NO_BUILTIN_ALLOC_FNS, offsetof(cli_options, no_builtin_alloc_fns), true},
};

/* Sets the switch c; false if c is not one. */
static bool apply_switch(int c, cli_options *o) {
  for (size_t i = 0; i < sizeof kSwitches / sizeof kSwitches[0]; i++) {
    if (kSwitches[i].option == c) {
      *(bool *)((char *)o + kSwitches[i].field) = kSwitches[i].value;
      return true;
    }
  }
  return false;
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

/* apply_value's answer for what is not an option with a value (getopt's '?'). */
#define NOT_A_VALUE_OPTION (-2)

/* Applies an option that takes a value (c from getopt_long, its argument arg). Returns
 * CONTINUE, NOT_A_VALUE_OPTION, or the exit code of a usage error. */
static int apply_value(int c, const char *arg, cli_options *o) {
  static const char *const kSamples[] = {"inuse_space", "inuse_objects", "alloc_space",
                                         "alloc_objects", NULL};
  static const int kSampleValues[] = {HD_PPROF_INUSE_SPACE, HD_PPROF_INUSE_OBJECTS,
                                      HD_PPROF_ALLOC_SPACE, HD_PPROF_ALLOC_OBJECTS};
  static const char *const kBy[] = {"site", "stack", "thread", NULL};
  static const int kByValues[] = {HD_REPORT_BY_SITE, HD_REPORT_BY_STACK, HD_REPORT_BY_THREAD};
  static const char kProgramNameChars[] =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-,";
  uint64_t number;
  int keyword;
  switch (c) {
    case 'o':
      o->output = arg;
      return CONTINUE;
    case 'f':
      o->format = cli_parse_format(arg);
      if (o->format == FORMAT_NONE) {
        return usage_error("unknown format '%s' (raw, pprof, dartheap, text, folded, json, html)",
                           arg);
      }
      return CONTINUE;
    case 'p':
      if (!parse_u64(arg, &number) || number == 0) {
        return usage_error("--pid wants a process id, not '%s'", arg);
      }
      o->has_pid = true;
      o->pid = number;
      return CONTINUE;
    case 'n':
      if (strlen(arg) == 0 || strlen(arg) > HD_NAME_MAX) {
        return usage_error("--name wants a process name of 1 to " HD_STRINGIFY(HD_NAME_MAX) " bytes");
      }
      o->name = arg;
      return CONTINUE;
    case 'i':
      if (!parse_seconds(arg, false, INFINITY, &o->interval)) {
        return usage_error("--interval wants a positive number of seconds, not '%s'", arg);
      }
      return CONTINUE;
    case OPT_TIMEOUT:
      if (!parse_seconds(arg, true, 1e6, &o->timeout)) {
        return usage_error("--timeout wants a number of seconds (0: wait forever), not '%s'",
                           arg);
      }
      return CONTINUE;
    case OPT_SOCKET:
      o->socket = arg;
      return CONTINUE;
    case OPT_HTML:
      if (arg[0] == '\0' || strcmp(arg, "-") == 0) {
        return usage_error("--html wants a file name (the page is written beside the profile)");
      }
      o->html_output = arg;
      return CONTINUE;
    case OPT_DEBUG_DIR:
      if (o->debug_dir_count == sizeof o->debug_dirs / sizeof o->debug_dirs[0]) {
        return usage_error("too many --debug-dir options");
      }
      o->debug_dirs[o->debug_dir_count++] = arg;
      return CONTINUE;
    case OPT_ALLOC_FN:
      if (arg[0] == '\0') return usage_error("--alloc-fn wants a function name or pattern");
      if (o->alloc_fn_count == sizeof o->alloc_fn_patterns / sizeof o->alloc_fn_patterns[0]) {
        return usage_error("too many --alloc-fn options");
      }
      o->alloc_fn_patterns[o->alloc_fn_count++] = arg;
      return CONTINUE;
    case OPT_SAMPLE_INDEX:
      if (!pick_keyword(arg, kSamples, kSampleValues, &keyword)) {
        return usage_error("unknown sample type '%s'", arg);
      }
      o->sample = (hd_pprof_sample)keyword;
      return CONTINUE;
    case OPT_TOP:
      if (!parse_u64(arg, &number)) return usage_error("--top wants a number");
      o->top = (size_t)number;
      return CONTINUE;
    case OPT_BY:
      if (!pick_keyword(arg, kBy, kByValues, &keyword)) {
        return usage_error("--by wants site, stack or thread, not '%s'", arg);
      }
      o->by = (hd_report_by)keyword;
      return CONTINUE;
    case OPT_CHILDREN:
      if (arg[0] == '\0' || arg[strspn(arg, kProgramNameChars)] != '\0') {
        return usage_error("--children wants all, none or program names separated by commas, "
                           "not '%s'", arg);
      }
      o->children = arg;
      return CONTINUE;
    case OPT_CHILDREN_DIR:
      o->children_dir = arg;
      return CONTINUE;
  }
  return NOT_A_VALUE_OPTION;
}

/* Applies one option (c from getopt_long, its argument arg, as written option_text) of the
 * command (an index in kCommands) to o. Returns CONTINUE, or the exit code to end with now. */
static int parse_option(int c, size_t command, const char *arg, const char *option_text,
                        cli_options *o) {
  const char *name = kCommands[command].name;
  const char *refused = option_refused(c, command);
  if (refused != NULL) {
    return usage_error("%s does not take %s (heapdump %s --help lists its options)", name, refused,
                       name);
  }
  switch (c) {
    case 'h':
      command_help(command);
      return EXIT_OK;
    case OPT_VERSION:
      printf("heapdump %s\n", HEAPDUMP_VERSION_STRING);
      return EXIT_OK;
  }
  if (apply_switch(c, o)) return CONTINUE;
  const int rc = apply_value(c, arg, o);
  if (rc != NOT_A_VALUE_OPTION) return rc;
  if (optopt != 0 && optopt < 256) {
    return usage_error("%s: option -%c is unknown or needs a value", name, optopt);
  }
  return usage_error("%s: option %s is unknown or needs a value", name, option_text);
}

/* Checks what only the whole command line tells, then runs the command with its arguments (rest
 * of them at args). Returns the exit code. */
static int run_command(size_t command, cli_options *o, int rest, char **args) {
  const char *name = kCommands[command].name;
  if (o->socket == NULL) {
    if (hd_default_socket_path(o->socket_buf, sizeof o->socket_buf) != 0) {
      cli_error("the collector's socket path is too long");
      return EXIT_USAGE;
    }
    o->socket = o->socket_buf;
  }
  if (command == 0 && o->output != NULL && strcmp(o->output, "-") == 0) {
    return usage_error("run: --output - would mix the profile into COMMAND's own output; give a "
                       "file");
  }
  if (strcmp(name, "report") == 0 || strcmp(name, "leaks") == 0) {
    cli_format f = cli_output_format(o, o->output, FORMAT_TEXT);
    if (f != FORMAT_TEXT && f != FORMAT_JSON && f != FORMAT_HTML) {
      return usage_error("%s writes text, JSON or HTML, not %s%s", name,
                         o->format != FORMAT_NONE ? "that format" : o->output,
                         name[0] == 'r' ? " (heapdump convert writes other formats)" : "");
    }
  }
  if (strcmp(name, "diff") == 0) {
    cli_format f = cli_output_format(o, o->output, FORMAT_TEXT);
    if (f != FORMAT_TEXT && f != FORMAT_JSON && f != FORMAT_PPROF && f != FORMAT_HTML) {
      return usage_error("diff writes text, json, pprof or html, not %s",
                         o->format != FORMAT_NONE ? "that format" : o->output);
    }
    if (o->by == HD_REPORT_BY_THREAD) {
      return usage_error("diff groups by site or stack: the threads of two snapshots do not "
                         "pair up");
    }
    if (rest != 2) return usage_error("diff: wants two snapshot files, BASE and NEW");
    return cmd_diff(o, args[0], args[1]);
  }
  if (strcmp(name, "run") == 0) {
    if (rest > 0 && strcmp(args[0], "--") == 0) {
      rest--;
      args++;
    }
    return cmd_run(o, rest, args);
  }
  if (strcmp(name, "snapshot") == 0 || strcmp(name, "list") == 0 || strcmp(name, "leaks") == 0) {
    if (rest != 0) return usage_error("%s: unexpected argument '%s'", name, args[0]);
    if (strcmp(name, "leaks") == 0) {
      return cmd_leaks(o);
    }
    return strcmp(name, "list") == 0 ? cmd_list(o) : cmd_snapshot(o);
  }
  if (strcmp(name, "delete") == 0) return cmd_delete(o, rest, args);
  if (rest != 1) {
    return usage_error("%s: wants exactly one %s", name,
                       strcmp(name, "download") == 0 ? "snapshot ID" : "INPUT file");
  }
  if (strcmp(name, "download") == 0) return cmd_download(o, args[0]);
  if (strcmp(name, "convert") == 0) return cmd_convert(o, args[0]);
  return cmd_report(o, args[0]);
}

int main(int argc, char **argv) {
  if (argc >= 2 && strcmp(argv[1], "--version") == 0) {
    printf("heapdump %s\n", HEAPDUMP_VERSION_STRING);
    return EXIT_OK;
  }
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
      strcmp(argv[1], "help") == 0) {
    fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? EXIT_USAGE : EXIT_OK;
  }
  size_t command = SIZE_MAX;
  for (size_t i = 0; i < sizeof kCommands / sizeof kCommands[0]; i++) {
    if (strcmp(argv[1], kCommands[i].name) == 0) command = i;
  }
  if (command == SIZE_MAX) return usage_error("unknown command '%s'", argv[1]);
  const char *name = kCommands[command].name;

  cli_options o = {.symbolize = true, .top = 20, .max_frames = 8,
                   .timeout = DEFAULT_TIMEOUT_SECONDS};
  /* run: "+" stops at the first non-option, so COMMAND's own options are left alone; the other
   * commands take options before and after their arguments. */
  const char *short_options = strcmp(name, "run") == 0 ? "+ho:f:p:n:aci:" : "ho:f:p:n:aci:";
  argc--;
  argv++;
  optind = 1;
  opterr = 0;
  int c;
  while ((c = getopt_long(argc, argv, short_options, kLong, NULL)) != -1) {
    const int rc = parse_option(c, command, optarg, argv[optind - 1], &o);
    if (rc != CONTINUE) return rc;
  }
  return run_command(command, &o, argc - optind, argv + optind);
}
