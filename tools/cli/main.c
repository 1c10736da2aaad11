/* heapdump: the command line of the profiler. Subcommands run a program under the profiler, take
 * live snapshots, list and download stored ones, and convert or report snapshot files; the
 * command and option tables are in command_line.c and options.c. */
#include "cli.h"

int main(int argc, char **argv) {
  cli_options o;
  cli_invocation invocation;
  const int rc = cli_parse(argc, argv, &o, &invocation);
  if (rc != CLI_GO_ON) return rc;
  return invocation.command->run(&o, invocation.argc, invocation.argv);
}
