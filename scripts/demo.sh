#!/usr/bin/env bash
# The README's main job, until `heapdump run` exists: start a collector, run the demo program with
# libheapdump.so preloaded (it stores a named snapshot and leaks on purpose; its exit snapshot is
# on), and show what the collector stored.
set -euo pipefail
build_dir=$(realpath "${1:-build-release}")
work=$(mktemp -d /tmp/heapdump-demo.XXXXXX)
socket="$work/run/collector.sock"
"$build_dir/collector/heapdump-collector" --foreground --socket "$socket" --storage "$work/state" \
  2>"$work/collector.log" &
collector=$!
trap 'kill $collector 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$socket" ] && break; sleep 0.05; done

echo "== running the demo program under libheapdump.so"
HEAPDUMP_SOCKET="$socket" HEAPDUMP_EXIT_SNAPSHOT=1 \
  LD_PRELOAD="$build_dir/instrumentation/libheapdump.so" "$build_dir/tools/leaky"

# The collector stores the exit snapshot when it sees the program's connection close.
for _ in $(seq 100); do grep -q '"exit"' "$work/collector.log" && break; sleep 0.05; done
kill $collector
wait $collector || true
trap - EXIT
echo "== collector log"
cat "$work/collector.log"
echo "== stored snapshots in $work/state"
ls -l "$work/state"
grep -q 'stored snapshot .* "after-build"' "$work/collector.log"
grep -q 'stored snapshot .* "exit"' "$work/collector.log"
echo "demo: the named snapshot and the exit snapshot were stored"
