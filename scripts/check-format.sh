#!/usr/bin/env bash
# Checks that every C and C++ file of the tree follows .clang-format (Debian 12's clang-format 14,
# which scripts/install-deps.sh installs) and that no line of them passes 100 columns (clang-format
# leaves long string literals alone). With --fix, formats the files instead of checking them.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.c' '*.h' '*.cc')
if [ "${1:-}" = "--fix" ]; then
  clang-format --style=file -i "${files[@]}"
  exit 0
fi
clang-format --style=file --dry-run --Werror "${files[@]}"
long=$(awk 'length > 100 { print FILENAME ":" FNR ": " length " columns" }' "${files[@]}")
if [ -n "$long" ]; then
  echo "$long"
  echo "lines over 100 columns (split the string literals)" >&2
  exit 1
fi
echo "format: ${#files[@]} files follow .clang-format"
