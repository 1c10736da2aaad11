#!/usr/bin/env bash
# The two set-up commands of the README:
#   scripts/setup.sh demo   installs what is missing, builds, runs the demo (the main job)
#   scripts/setup.sh test   installs what is missing, builds, runs every test (ctest)
# BUILD_DIR (default build-release) is the CMake build directory; extra arguments go to cmake.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-}
case "$mode" in
  demo|test) shift ;;
  *) echo "usage: scripts/setup.sh demo|test [cmake args...]" >&2; exit 2 ;;
esac

scripts/install-deps.sh
build_dir=${BUILD_DIR:-build-release}
jobs=$(nproc)
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
ninja -C "$build_dir" -j "$jobs"

if [ "$mode" = demo ]; then
  exec scripts/demo.sh "$build_dir"
fi
ctest --test-dir "$build_dir" -j "$jobs" --output-on-failure --timeout 600
