/* The heapdump command: shared state of its subcommands (command_line.c and options.c hold the
 * command line; docs/tools.md is the user documentation). */
#ifndef HEAPDUMP_CLI_H
#define HEAPDUMP_CLI_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/listing.h"
#include "heapdump/tools/pprof.h"
#include "heapdump/tools/report.h"
#include "heapdump/tools/sites.h"
#include "heapdump_client.pb.h"

/* Exit codes, documented in docs/tools.md. `heapdump run` exits with its command's status. */
enum {
  EXIT_OK = 0,
  EXIT_FAILURE_ = 1,     /* I/O errors, corrupt input, a collector failure, an arming that failed */
  EXIT_USAGE = 2,        /* bad command line */
  EXIT_NO_COLLECTOR = 3, /* nothing listens at the socket */
  EXIT_NOT_FOUND = 4,    /* no matching process, unknown snapshot id */
  EXIT_AMBIGUOUS = 5,    /* several processes match and one is needed */
  EXIT_PERMISSION = 6,   /* the collector or a file refused us */
  EXIT_TIMEOUT = 7,      /* the collector accepted but did not answer in time */
  EXIT_PARTIAL = 8,      /* some of the processes asked for could not be read: the rest written */
  EXIT_RUN_FAILED = 125, /* `run`: heapdump failed before the command could run */
};

typedef enum cli_format {
  FORMAT_NONE = 0, /* not given: from the output's extension, else pprof */
  FORMAT_RAW,
  FORMAT_PPROF,
  FORMAT_DARTHEAP,
  FORMAT_TEXT,
  FORMAT_FOLDED,
  FORMAT_JSON, /* the report as JSON */
  FORMAT_HTML, /* the self-contained HTML report */
} cli_format;

typedef struct cli_options {
  const char *socket; /* --socket, else HEAPDUMP_SOCKET or the default path */
  char socket_buf[4096];
  const char *output; /* --output; "-" is stdout */
  cli_format format;
  bool contents, all, json, tags, symbolize;
  bool has_pid;
  uint64_t pid;
  const char *name;
  const char *children;     /* run: --children all|none|NAME[,NAME...] (NULL: all) */
  const char *children_dir; /* run: --children-dir */
  const char *sample_bytes; /* run: --sample-bytes, checked (NULL: HEAPDUMP_SAMPLE_BYTES as set) */
  bool verbose;             /* run: --verbose */
  bool show_reachable;      /* report, leaks, run: --show-reachable */
  bool no_leak_check;       /* run: --no-leak-check */
  /* leaks: per snapshot, the categories of its blocks as checked (cli_write's report), and when. */
  uint8_t *const *leak_categories;
  uint64_t leak_now_ns;
  bool force; /* convert: --force, overwrite an existing output */
  /* The HTML page's header: what the snapshot came from, and (run) the command's line and pid. */
  const char *source;
  const char *command_line;
  uint64_t command_pid;
  const char *html_output; /* run: --html */
  double interval;
  /* --timeout: seconds a collector may take to answer a call or to send the next batch of a
   * stream; 0 waits forever. */
  double timeout;
  size_t top;
  size_t max_frames; /* text: frames shown per group */
  hd_report_by by;
  hd_report_sort sort;
  hd_pprof_sample sample;
  const char *debug_dirs[16];
  size_t debug_dir_count;
  /* --alloc-fn (shell patterns) and --no-builtin-alloc-fns: the allocation wrappers whose callers
   * are the sites (heapdump/tools/sites.h). */
  const char *alloc_fn_patterns[64];
  size_t alloc_fn_count;
  bool no_builtin_alloc_fns;
  bool help, version; /* --help, --version: said at once, nothing run */
} cli_options;

/* ---- the command line (command_line.c: the commands; options.c: the options) ---- */

/* The commands, in the order of their table. */
typedef enum cli_command_id {
  CLI_RUN,
  CLI_SNAPSHOT,
  CLI_LIST,
  CLI_DOWNLOAD,
  CLI_DELETE,
  CLI_CONVERT,
  CLI_REPORT,
  CLI_DIFF,
  CLI_LEAKS,
  CLI_ARM,
  CLI_DISARM,
  CLI_COMMAND_COUNT,
} cli_command_id;

typedef struct cli_command {
  const char *name;
  const char *summary; /* a line of `heapdump --help` */
  const char *usage;
  const char *description; /* before the options in `heapdump COMMAND --help` */
  const char *notes;       /* after them, or NULL */
  /* run: its options end at COMMAND, whose own options are COMMAND's. */
  bool options_end_at_first_argument;
  int min_args, max_args; /* how many arguments it takes; max_args -1: any number */
  const char *wrong_args; /* the usage error when it gets another number */
  /* What only the whole command line tells (NULL: nothing). Returns CLI_GO_ON or an exit code,
   * having said why. */
  int (*check)(const cli_options *o, const struct cli_command *c);
  int (*run)(cli_options *o, int argc, char **argv);
} cli_command;

/* What a parser answers when the command line goes on (every other answer is an exit code). */
#define CLI_GO_ON (-1)

/* A command line parsed: the command and its arguments (pointing into argv). */
typedef struct cli_invocation {
  const cli_command *command;
  int argc;
  char **argv;
} cli_invocation;

/* Parses the command line (argv[0] is the program), filling o and *out without running
 * anything. Returns CLI_GO_ON if the command is to run, else the exit code to end with (help
 * and version printed, a usage error said on stderr). getopt_long may reorder argv. */
HD_MUST_CHECK int cli_parse(int argc, char **argv, cli_options *o, cli_invocation *out);
const cli_command *cli_command_at(unsigned id);
/* `heapdump COMMAND --help`, on stdout. */
void cli_command_help(unsigned id);
/* Says "heapdump: " and the message with a pointer to --help on stderr; returns EXIT_USAGE. */
HD_MUST_CHECK int cli_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Applies the options in argv (argv[0] is the command's name) of command id to o; *first_arg
 * is where its arguments start. Returns CLI_GO_ON or the exit code to end with. */
HD_MUST_CHECK int cli_apply_options(unsigned id, int argc, char **argv, cli_options *o,
                                    int *first_arg);
/* The option help of command id, by section. */
void cli_print_options(unsigned id);
/* The long name of option i of the table (without "--"), NULL past its end. */
const char *cli_option_name(size_t i);

/* A symbolizer for o's writers (--symbolize, --debug-dir), with o's allocation wrappers, which
 * *fns holds (it must outlive the symbolizer); NULL without symbolization or if it cannot
 * start (said on stderr). */
hd_symbolizer *cli_symbolizer(const cli_options *o, hd_alloc_fns *fns);

/* Prints "heapdump: " and the message to stderr, unless cli_quiet is set. */
void cli_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
extern bool cli_quiet;

/* ---- talking to the collector (client.c) ---- */

/* Connects to the collector with o->timeout on the connection; on failure prints why (and how to
 * start one) and returns the exit code, else 0. */
HD_MUST_CHECK int cli_connect(const cli_options *o, int *fd);
/* Says that the collector did not `what` within o->timeout; returns EXIT_TIMEOUT. */
HD_MUST_CHECK int cli_timed_out(const cli_options *o, const char *what);
/* A live snapshot of the process(es) o selects into r (finished). Returns an exit code;
 * EXIT_PARTIAL when some processes could not be read (each said on stderr; r holds the others). */
HD_MUST_CHECK int cli_take_live_snapshot(const cli_options *o, uint64_t pid, hd_reassembler *r);
typedef hd_listing_item cli_stored;

/* Stored snapshot meta->id into r (finished), labelled with meta's process. Returns an exit
 * code. */
HD_MUST_CHECK int cli_download(const cli_options *o, const cli_stored *meta, hd_reassembler *r);
/* Every stored snapshot matching the selector in o (if any). *out is malloc'ed. Returns an exit
 * code. */
HD_MUST_CHECK int cli_list(const cli_options *o, cli_stored **out, size_t *count);
/* Deletes stored snapshot id. Returns an exit code (EXIT_NOT_FOUND if the collector has no such
 * snapshot of ours). */
HD_MUST_CHECK int cli_delete(const cli_options *o, uint32_t id);
/* Asks the collector to arm (recording, at sample_bytes if has_sample_bytes, else at the rate
 * of its first arming) or disarm dormant process pid; 0 once it published the request (at
 * *generation of its arm page), else an exit code, having said why. */
HD_MUST_CHECK int cli_arm_process(const cli_options *o, uint64_t pid, bool recording,
                                  bool has_sample_bytes, uint64_t sample_bytes,
                                  uint64_t *generation);
/* Where process pid stands with the collector. Returns an exit code, without a message: a
 * collector that cannot tell (an older one) is not an error for the callers. */
HD_MUST_CHECK int cli_process_state(const cli_options *o, uint64_t pid,
                                    heapdump_client_CollectorGetProcessStateResponse *out);

/* ---- writing results (output.c) ---- */

cli_format cli_parse_format(const char *name);
/* Process names become part of file names: copies name keeping [A-Za-z0-9._-], others as '_'
 * ("process" if empty). */
void cli_safe_name(char *out, size_t size, const char *name);
const char *cli_format_extension(cli_format f);
/* The format to write: o->format, else from the output's extension, else fallback. */
cli_format cli_output_format(const cli_options *o, const char *output, cli_format fallback);

/* An output file, written to a temporary file beside it and renamed into place when complete,
 * so a failed run never leaves a half-written file and an unwritable path fails early. A path
 * that names what is not ours to replace (a device such as /dev/null, a FIFO, a symbolic link
 * such as /dev/stdout) is written in place; a directory, a socket or a block device is refused. */
typedef struct cli_output {
  char path[4096];
  char tmp[4200];
  FILE *file;
  bool is_stdout;
  bool in_place, in_place_regular; /* written in place; a regular file (through a link) */
} cli_output;
HD_MUST_CHECK int cli_output_open(cli_output *out, const char *path);
HD_MUST_CHECK int cli_output_commit(cli_output *out);
void cli_output_abort(cli_output *out);

/* A stream over out for text that names what a profiled program chose (process and thread
 * names, symbols, paths): C0 controls but newline and tab, DEL and the C1 controls (U+0080 to
 * U+009F) are written as \xNN, so no name can send escape sequences to a terminal. Closing it
 * flushes out and leaves it open. NULL when out of memory. */
FILE *cli_text_stream(FILE *out);
/* stderr for messages, through such a stream: they name processes, files and symbols too. */
FILE *cli_stderr(void);

/* Writes r in format f to out (symbolizing per o). Returns an exit code. */
HD_MUST_CHECK int cli_write(const cli_options *o, const hd_reassembler *r, cli_format f,
                            cli_output *out);

/* A progress line on stderr while a snapshot streams in, when stderr is a terminal. */
void cli_progress_attach(hd_reassembler *r);
void cli_progress_done(hd_reassembler *r);

/* ---- what `heapdump run` sets up (run_env.c) ---- */

/* libheapdump.so: $HEAPDUMP_LIBRARY, else beside this executable or in an installed lib dir,
 * else where this build put it. False if none is found. */
bool cli_find_library(char *out, size_t size);

/* A collector of `heapdump run`'s own, on a private socket with private storage in a temporary
 * directory, served by a thread of this process. */
typedef struct cli_embedded {
  char dir[64];
  char socket[128];
  char storage[128];
  struct hd_collector *collector;
  pthread_t thread;
  bool running;
} cli_embedded;
/* Starts it; on failure says why and returns -1. */
HD_MUST_CHECK int cli_embedded_start(cli_embedded *e);
/* Stops it (if running) and removes its directory. */
void cli_embedded_stop(cli_embedded *e);

/* ---- subcommands: each gets the arguments the command table lets through ---- */
HD_MUST_CHECK int cmd_run(cli_options *o, int argc, char **argv);
HD_MUST_CHECK int cmd_snapshot(cli_options *o, int argc, char **argv);
HD_MUST_CHECK int cmd_list(cli_options *o, int argc, char **argv);
HD_MUST_CHECK int cmd_download(cli_options *o, int argc, char **argv);
HD_MUST_CHECK int cmd_delete(cli_options *o, int argc, char **argv);
HD_MUST_CHECK int cmd_convert(cli_options *o, int argc, char **argv);
HD_MUST_CHECK int cmd_report(cli_options *o, int argc, char **argv);
HD_MUST_CHECK int cmd_diff(cli_options *o, int argc, char **argv);
HD_MUST_CHECK int cmd_leaks(cli_options *o, int argc, char **argv);
HD_MUST_CHECK int cmd_arm(cli_options *o, int argc, char **argv);
HD_MUST_CHECK int cmd_disarm(cli_options *o, int argc, char **argv);

/* Reads a raw snapshot file or a pprof heap profile ("-": stdin) into r. A raw file is read as
 * a stream, its block contents kept in a temporary file: neither need fit in memory. Returns an
 * exit code. */
HD_MUST_CHECK int cli_read_snapshot(const char *path, hd_reassembler *r);

/* Fails (with its exit code) on an unwritable --output before anything is asked of a collector
 * or a command is run. */
HD_MUST_CHECK int cli_probe_output(const cli_options *o);

/* Block contents received into r go to an unlinked temporary file in $TMPDIR (else /tmp):
 * they can be far larger than the rest of a snapshot. Where no such file can be made, says so
 * and keeps them in memory. */
void cli_spill_contents(hd_reassembler *r);

#endif
