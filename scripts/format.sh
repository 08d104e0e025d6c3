#!/usr/bin/env bash
# clang-format with the repository's .clang-format.
#   scripts/format.sh            reformat every C++ file in place
#   scripts/format.sh --check    change nothing; list the files that differ, exit 1 if any does
#   scripts/format.sh [--check] FILE...   only these files
# Needs Debian's clang-format (the .clang-format is written for version 14, bookworm's).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "format: clang-format is missing (apt-get install clang-format)" >&2; exit 77; }
check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
if [ $# -eq 0 ]; then
  mapfile -t files < <(git ls-files -- '*.cpp' '*.h' '*.hpp' '*.cu')
else
  files=("$@")
  for f in "${files[@]}"; do  # clang-format would rewrite any other text as if it were C++
    case "$f" in
      *.cpp | *.h | *.hpp | *.cu) ;;
      *) echo "format: $f is not a C++ file (.cpp, .h, .hpp, .cu); nothing was changed" >&2; exit 2 ;;
    esac
  done
fi
if [ "$check" = 1 ]; then
  bad=0
  for f in "${files[@]}"; do
    if ! clang-format --style=file "$f" | cmp -s "$f" -; then
      n=$(clang-format --style=file "$f" | diff "$f" - | grep -c '^<' || true)
      echo "$f: $n lines would change"
      bad=1
    fi
  done
  exit "$bad"
fi
clang-format --style=file -i "${files[@]}"
