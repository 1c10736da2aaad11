/* The heapdump command line: one table of commands (their help, how many arguments they take,
 * what they check of the whole line, their handlers), and the parser that applies it and the
 * option table (options.c) without running anything. */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "heapdump/collector.h"
#include "heapdump/contract/must_check.h"
#include "heapdump/heapdump.h"

bool cli_quiet;

/* "heapdump: ", the message, then `end`, on stderr. */
static void say(const char *fmt, va_list ap, const char *end) {
  FILE *out = cli_stderr();
  fputs("heapdump: ", out);
  vfprintf(out, fmt, ap);
  fputs(end, out);
}

void cli_error(const char *fmt, ...) {
  if (cli_quiet) return;
  va_list ap;
  va_start(ap, fmt);
  say(fmt, ap, "\n");
  va_end(ap);
}

int cli_usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  say(fmt, ap, "\n(see heapdump --help)\n");
  va_end(ap);
  return EXIT_USAGE;
}

/* How long a collector may take to answer: it answers calls at once and sends a 10^6-block
 * snapshot's batches in well under a second, so a silent one is stuck, stopped or not one. */
#define DEFAULT_TIMEOUT_SECONDS 10

static HD_MUST_CHECK int check_run(const cli_options *o, const cli_command *c) {
  (void)c;
  if (o->output != NULL && strcmp(o->output, "-") == 0) {
    return cli_usage_error(
        "run: --output - would mix the profile into COMMAND's own output; "
        "give a file");
  }
  return CLI_GO_ON;
}

/* report and leaks write about a snapshot, not the snapshot itself. */
static HD_MUST_CHECK int check_report(const cli_options *o, const cli_command *c) {
  cli_format f = cli_output_format(o, o->output, FORMAT_TEXT);
  if (f != FORMAT_TEXT && f != FORMAT_JSON && f != FORMAT_HTML) {
    return cli_usage_error(
        "%s writes text, JSON or HTML, not %s%s", c->name,
        o->format != FORMAT_NONE ? "that format" : o->output,
        c == cli_command_at(CLI_REPORT) ? " (heapdump convert writes other formats)" : "");
  }
  return CLI_GO_ON;
}

static HD_MUST_CHECK int check_pid_given(const cli_options *o, const cli_command *c) {
  if (!o->has_pid) return cli_usage_error("%s wants --pid PID", c->name);
  return CLI_GO_ON;
}

static HD_MUST_CHECK int check_diff(const cli_options *o, const cli_command *c) {
  (void)c;
  cli_format f = cli_output_format(o, o->output, FORMAT_TEXT);
  if (f != FORMAT_TEXT && f != FORMAT_JSON && f != FORMAT_PPROF && f != FORMAT_HTML) {
    return cli_usage_error("diff writes text, json, pprof or html, not %s",
                           o->format != FORMAT_NONE ? "that format" : o->output);
  }
  if (o->by == HD_REPORT_BY_THREAD) {
    return cli_usage_error(
        "diff groups by site or stack: the threads of two snapshots do not "
        "pair up");
  }
  return CLI_GO_ON;
}

static const cli_command kCommands[CLI_COMMAND_COUNT] = {
    [CLI_RUN] =
        {"run", "run a program under the profiler; write and report what it leaked",
         "heapdump run [OPTIONS] -- COMMAND [ARGS...]",
         "Runs COMMAND with libheapdump.so preloaded and exit snapshots on, using the collector "
         "at\n"
         "the socket if one answers, else one of its own for the run. When COMMAND exits, writes\n"
         "its exit snapshot (the blocks still live) to heapdump.NAME.PID.pb.gz (or --output) and\n"
         "prints a leak check of it: COMMAND stores its exit snapshot from its exit path (after "
         "its\n"
         "atexit handlers and static destructors) with contents and roots, so every block still\n"
         "live is classified as valgrind does; definitely and indirectly lost are listed by site.\n"
         "Exits with COMMAND's status.\n",
         "\nCOMMAND is followed across exec (env, nice, sh -c 'exec ...', wrapper scripts): the\n"
         "report and FILE are of its last program. With the collector run starts itself, the\n"
         "processes COMMAND starts are profiled too (see --children); run waits until each has "
         "its\n"
         "exit snapshot written, then prints one summary line and the top ones by peak live "
         "bytes.\n",
         .options_end_at_first_argument = true, .min_args = 0, .max_args = -1, .check = check_run,
         .run = cmd_run},
    [CLI_SNAPSHOT] = {"snapshot", "take a live snapshot of a running instrumented process",
                      "heapdump snapshot [--pid PID | --name NAME] [--all] [--contents] [OPTIONS]",
                      "Takes a live snapshot of a running instrumented process, without stopping "
                      "it, and writes\n"
                      "it to heapdump.NAME.PID.pb.gz (or --output).\n",
                      NULL, .min_args = 0, .max_args = 0, .run = cmd_snapshot},
    [CLI_LIST] =
        {"list", "list the snapshots the collector stored",
         "heapdump list [--pid PID | --name NAME] [--json]",
         "Lists the snapshots the collector stored (named snapshots and exit snapshots), oldest\n"
         "first: ID, NAME, PROCESS[PID], TAKEN (local time), LIVE BYTES and BLOCKS (what the\n"
         "process had live then), STORED (bytes on the collector's disk).\n",
         NULL, .min_args = 0, .max_args = 0, .run = cmd_list},
    [CLI_DOWNLOAD] = {"download", "download a stored snapshot", "heapdump download ID [OPTIONS]",
                      "Downloads stored snapshot ID and writes it to heapdump.snapshot-ID.pb.gz "
                      "(or --output).\n",
                      NULL, .min_args = 1, .max_args = 1,
                      .wrong_args = "wants exactly one snapshot ID", .run = cmd_download},
    [CLI_DELETE] =
        {"delete", "delete stored snapshots",
         "heapdump delete ID... | heapdump delete --all [--pid PID | --name NAME]",
         "Deletes stored snapshots: the IDs given (see heapdump list), or with --all every one\n"
         "stored of your processes (of those --pid or --name select). Root deletes anyone's.\n"
         "Unknown IDs are reported and the others still deleted (exit status 4).\n",
         NULL, .min_args = 0, .max_args = -1, .run = cmd_delete},
    [CLI_CONVERT] =
        {"convert", "convert a snapshot file (raw or pprof) to another format",
         "heapdump convert INPUT --format F [--output FILE] [OPTIONS]",
         "Converts a raw snapshot file or a pprof heap profile (INPUT '-': stdin) to format F. "
         "The\n"
         "output defaults to INPUT with the format's extension (text and folded: stdout). An\n"
         "existing file is not overwritten unless --force. A profile holds less than a raw file:\n"
         "per stack its totals (per block with --tags), and the names it was written with.\n",
         NULL, .min_args = 1, .max_args = 1, .wrong_args = "wants exactly one INPUT file",
         .run = cmd_convert},
    [CLI_REPORT] =
        {"report", "print the top allocation sites of a snapshot file (raw or pprof)",
         "heapdump report INPUT [--top N] [--by site|stack|thread] [--json | --format html]",
         "Prints the top allocation sites (or stacks, or threads) of a raw snapshot file or a "
         "pprof\n"
         "heap profile (what run and snapshot write by default) by live bytes and blocks, with "
         "the\n"
         "bytes and blocks allocated since start where recorded, and symbolized stacks (a\n"
         "symbolized profile's names are used as written).\n",
         "\nA snapshot taken with --contents also holds the program's roots (its modules' data, "
         "its\n"
         "threads' stacks and TLS): its report is a leak check, each block classified as\n"
         "definitely lost, indirectly lost, possibly lost or still reachable, as valgrind does.\n",
         .min_args = 1, .max_args = 1, .wrong_args = "wants exactly one INPUT file",
         .check = check_report, .run = cmd_report},
    [CLI_DIFF] =
        {"diff", "what grew between two snapshots of a process",
         "heapdump diff BASE NEW [--format text|json|pprof|html] [--by site|stack] [OPTIONS]",
         "Compares two snapshot files of one process (raw or pprof; e.g. the first and the last "
         "of\n"
         "`heapdump run --interval`): per site (or stack), the bytes and blocks added (live in "
         "NEW,\n"
         "not in BASE), removed (live in BASE, freed by NEW) and the net change, sorted by net\n"
         "growth, with the stack that changed most. Blocks are matched by address and allocation\n"
         "time where both files record them one by one (raw, or pprof written with --tags); from\n"
         "profiles of totals, added and removed are each site's net change. Several processes in\n"
         "a file are paired by pid. pprof output holds the net change of every stack (negative\n"
         "where it shrank), for `go tool pprof -top` or a flame graph of growth.\n",
         NULL, .min_args = 2, .max_args = 2, .wrong_args = "wants two snapshot files, BASE and NEW",
         .check = check_diff, .run = cmd_diff},
    [CLI_LEAKS] =
        {"leaks", "check a running program for leaks, without stopping it",
         "heapdump leaks [--pid PID | --name NAME] [--interval S] [--json] [OPTIONS]",
         "Checks a running instrumented program for leaks without stopping it: takes two "
         "snapshots\n"
         "with contents and roots (its modules' data, its threads' stacks and TLS, the memory it\n"
         "mapped itself), S seconds apart, classifies every block as valgrind does (definitely\n"
         "lost, indirectly lost, possibly lost, still reachable) and reports as lost only the\n"
         "blocks lost in both scans (same address, size and allocation time), so that a pointer "
         "in\n"
         "flight in a register between two places makes no false leak. Lists the lost blocks by\n"
         "category and site, with bytes, blocks, the age of the oldest and the stack.\n",
         NULL, .min_args = 0, .max_args = 0, .check = check_report, .run = cmd_leaks},
    [CLI_ARM] =
        {"arm", "make a dormant process record its allocations from now on",
         "heapdump arm --pid PID [--sample-bytes N] [OPTIONS]",
         "Arms process PID, which runs the dormant library (HEAPDUMP_DORMANT=1, or\n"
         "/etc/ld.so.preload): from its next allocation on it records the blocks it allocates,\n"
         "every one or sampled, and registers with the collector, so that snapshot, leaks and the\n"
         "collector's HTTP endpoints see it. What was live before is counted as unattributed\n"
         "bytes. Waits until the process records (it must allocate once), at most --timeout\n"
         "seconds. Root arms any process, others their own.\n",
         NULL, .min_args = 0, .max_args = 0, .check = check_pid_given, .run = cmd_arm},
    [CLI_DISARM] =
        {"disarm", "make an armed process record no new allocation",
         "heapdump disarm --pid PID [OPTIONS]",
         "Disarms process PID: from its next allocation on it records no new block (their bytes\n"
         "are counted as unattributed), while frees still take recorded blocks out, so its\n"
         "snapshots stay true. `heapdump arm` resumes it, at the rate of its first arming.\n"
         "Waits until the process has stopped (it must allocate once), at most --timeout "
         "seconds.\n",
         NULL, .min_args = 0, .max_args = 0, .check = check_pid_given, .run = cmd_disarm},
};

const cli_command *cli_command_at(unsigned id) {
  return id < CLI_COMMAND_COUNT ? &kCommands[id] : NULL;
}

static void print_usage(FILE *out) {
  fputs("usage: heapdump COMMAND [OPTIONS]\n\nCommands:\n", out);
  for (size_t i = 0; i < CLI_COMMAND_COUNT; i++) {
    fprintf(out, "  %-9s %s\n", kCommands[i].name, kCommands[i].summary);
  }
  fputs(
      "\n`heapdump COMMAND --help` describes a command. Formats: raw, pprof, dartheap, text,\n"
      "folded, json, html.\n",
      out);
}

void cli_command_help(unsigned id) {
  const cli_command *c = &kCommands[id];
  printf("usage: %s\n\n%s", c->usage, c->description);
  cli_print_options(id);
  if (c->notes != NULL) printf("%s", c->notes);
  printf(
      "\nExit status: 0 success, 1 failure, 2 usage error, 3 no collector running, 4 no such\n"
      "process or snapshot, 5 ambiguous process name, 6 permission denied, 7 the collector\n"
      "did not answer in time, 8 some processes could not be read (the others written)%s.\n",
      id == CLI_RUN ? ";\nrun: COMMAND's status (128+N if killed by signal N), 125 if heapdump "
                      "could not start it,\n126/127 if it could not be executed / found"
                    : "");
}

/* Checks the number of arguments the command got against its table row. */
static HD_MUST_CHECK int check_argument_count(const cli_command *c, int argc, char **argv) {
  if (argc >= c->min_args && (c->max_args < 0 || argc <= c->max_args)) return CLI_GO_ON;
  if (c->max_args == 0) return cli_usage_error("%s: unexpected argument '%s'", c->name, argv[0]);
  return cli_usage_error("%s: %s", c->name, c->wrong_args);
}

int cli_parse(int argc, char **argv, cli_options *o, cli_invocation *out) {
  *o = (cli_options){
      .symbolize = true, .top = 20, .max_frames = 8, .timeout = DEFAULT_TIMEOUT_SECONDS};
  if (argc >= 2 && strcmp(argv[1], "--version") == 0) {
    printf("heapdump %s\n", HEAPDUMP_VERSION_STRING);
    return EXIT_OK;
  }
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
      strcmp(argv[1], "help") == 0) {
    print_usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? EXIT_USAGE : EXIT_OK;
  }
  unsigned id = CLI_COMMAND_COUNT;
  for (unsigned i = 0; i < CLI_COMMAND_COUNT; i++) {
    if (strcmp(argv[1], kCommands[i].name) == 0) id = i;
  }
  if (id == CLI_COMMAND_COUNT) return cli_usage_error("unknown command '%s'", argv[1]);
  const cli_command *c = &kCommands[id];

  int first_arg;
  int rc = cli_apply_options(id, argc - 1, argv + 1, o, &first_arg);
  if (rc != CLI_GO_ON) return rc;
  if (o->socket == NULL) {
    if (hd_default_socket_path(o->socket_buf, sizeof o->socket_buf) != 0) {
      cli_error("the collector's socket path is too long");
      return EXIT_USAGE;
    }
    o->socket = o->socket_buf;
  }
  if (c->check != NULL && (rc = c->check(o, c)) != CLI_GO_ON) return rc;
  const int rest = argc - 1 - first_arg;
  char **args = argv + 1 + first_arg;
  if ((rc = check_argument_count(c, rest, args)) != CLI_GO_ON) return rc;
  *out = (cli_invocation){c, rest, args};
  return CLI_GO_ON;
}
