#!/usr/bin/env bash
# Installs the Debian 12 packages heapdump needs to build and test, if any is missing. Idempotent:
# when everything is present it changes nothing and needs no network.
set -euo pipefail

packages=(
  gcc g++ clang clang-format make cmake ninja-build pkg-config generate-ninja
  nanopb libnanopb-dev protobuf-compiler python3 python3-protobuf
  libunwind-dev libelf-dev libdw-dev libjemalloc-dev zlib1g-dev libgtest-dev libiberty-dev
  perl git file binutils dwz golang-go valgrind redis-server libmicrohttpd-dev prometheus
  libjs-chart.js node-d3-hierarchy chromium heaptrack cppcheck googletest
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "Installing: ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
