#!/bin/sh
# Runs every test executable of a GN build and reports one line per test.
#
# usage: build/run_gn_tests.sh OUT_DIR
#
# The tests are listed in OUT_DIR/gn_tests.txt, written by the root BUILD.gn from the
# "heapdump_tests" metadata of group("tests") (see build/hd_test.gni): one per line,
# "NAME COMMAND [ARGS...]", paths relative to OUT_DIR. Each runs with the working directory
# OUT_DIR, HEAPDUMP_BUILD_DIR set to the absolute OUT_DIR and a timeout of HD_TEST_TIMEOUT seconds
# (default 900); its output goes to OUT_DIR/test_logs/NAME.log. Exits non-zero if any test fails
# or the list is missing or empty.
set -u

if [ $# -lt 1 ]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
out_dir=$(cd "$1" 2>/dev/null && pwd) || { echo "run_gn_tests: no such directory: $1" >&2; exit 2; }
list="$out_dir/gn_tests.txt"
if [ ! -s "$list" ]; then
  echo "run_gn_tests: $list is missing or empty; run ninja -C $out_dir first" >&2
  exit 2
fi

logs="$out_dir/test_logs"
mkdir -p "$logs"
export HEAPDUMP_BUILD_DIR="$out_dir"

total=0
failed=0
failed_names=
set -f  # the command lines are split on spaces, never globbed
while read -r name command || [ -n "$name" ]; do
  [ -n "$name" ] || continue
  total=$((total + 1))
  log="$logs/$name.log"
  start=$(date +%s)
  # shellcheck disable=SC2086
  (cd "$out_dir" && timeout "${HD_TEST_TIMEOUT:-900}" $command; exit $?) </dev/null >"$log" 2>&1
  status=$?
  secs=$(( $(date +%s) - start ))
  summary=$(grep -E '^\[  (PASSED|FAILED)  \] [0-9]+ test' "$log" | tr '\n' ' ' | sed 's/ *$//')
  if [ "$status" -eq 0 ]; then
    echo "PASS  $name (${secs}s)${summary:+ $summary}"
  else
    failed=$((failed + 1))
    failed_names="$failed_names $name"
    echo "FAIL  $name (exit $status, ${secs}s)${summary:+ $summary} -- log: $log"
    tail -n 30 "$log" | sed 's/^/    /'
  fi
done <"$list"

echo "run_gn_tests: $((total - failed))/$total tests passed${failed_names:+; failed:$failed_names}"
[ "$failed" -eq 0 ]
