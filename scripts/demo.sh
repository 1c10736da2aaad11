#!/usr/bin/env bash
# The README's main job: `heapdump run` on the demo program (tools/demo/leaky.c), which leaks on
# purpose and stores a named snapshot. heapdump prints a leak check of what was still live at
# exit and writes an HTML report of it, then the exit snapshot is converted to pprof and dartheap.
# Outputs go to $HEAPDUMP_DEMO_DIR (default ./demo-output).
set -euo pipefail
build_dir=$(realpath "${1:-build-release}")
heapdump="$build_dir/tools/cli/heapdump"
out=${HEAPDUMP_DEMO_DIR:-$PWD/demo-output}
mkdir -p "$out"
cd "$out"
rm -f leaky.heapdump leaky.html leaky.pb.gz leaky.dartheap heapdump.leaky.*

echo "== heapdump run --output leaky.heapdump --html leaky.html -- leaky"
"$heapdump" run --output leaky.heapdump --html leaky.html -- "$build_dir/tools/leaky"

echo
echo "== heapdump convert leaky.heapdump --format pprof / dartheap"
"$heapdump" convert leaky.heapdump --format pprof
"$heapdump" convert leaky.heapdump --format dartheap

echo
echo "== outputs in $out"
ls -l "$out"
echo
echo "Open them with: a browser: $out/leaky.html   (memory over time, flame graph, leak check)"
echo "                go tool pprof -top $out/leaky.pb.gz   (or -http=: for flame graphs)"
echo "                Dart DevTools: Memory > Diff Snapshots > Import snapshot(s) from disk > $out/leaky.dartheap"
