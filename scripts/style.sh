#!/usr/bin/env bash
# The repository's style checks, each failing with the files it names:
#   format    every C++ file as clang-format formats it (scripts/format.sh --check)
#   layers    library layers only look down, no cycles (scripts/layering.py)
#   notes     every "Note [...]" cited in code, scripts and docs is a heading of docs/design.md
#   size      no file of src/, include/, tools/, examples/ over 500 lines
#   stdfs     no C++ file uses std::filesystem (PyTorch's pip LibTorch exports its own copies of it)
#   tidy      clang-tidy finds nothing in src/ and include/ (scripts/tidy.sh; needs a configured
#             build: BUILD_DIR, default build)
# Usage: scripts/style.sh [CHECK...]   (default: format layers notes size stdfs; tidy only when named)
# Installs clang-format, clang-tidy and universal-ctags from Debian's packages when missing (root).
set -uo pipefail
cd "$(dirname "$0")/.."
checks=("$@")
[ ${#checks[@]} -gt 0 ] || checks=(format layers notes size stdfs)

need=()
for c in "${checks[@]}"; do
  case $c in
    format) command -v clang-format >/dev/null || need+=(clang-format) ;;
    layers) command -v ctags >/dev/null || need+=(universal-ctags) ;;
    tidy) command -v clang-tidy >/dev/null || need+=(clang-tidy) ;;
  esac
done
if [ ${#need[@]} -gt 0 ]; then
  echo "style: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=900 update -qq &&
    apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
    { echo "style: could not install ${need[*]}" >&2; exit 1; }
fi

notes() {
  local missing
  missing=$(comm -23 \
    <(git grep -hoE 'Note \[[A-Z][^]]*\]' -- . ':!docs/design.md' | sed -E 's/^Note //' | sort -u) \
    <(grep -oE '^### Note \[[^]]+\]' docs/design.md | sed -E 's/^### Note //' | sort -u))
  [ -z "$missing" ] || { echo "notes: cited but not in docs/design.md: $missing" >&2; return 1; }
  echo "notes: every cited note is in docs/design.md"
}

size() {
  local long
  long=$(git ls-files -- src include tools examples | while read -r f; do
    n=$(wc -l <"$f")
    [ "$n" -le 500 ] || echo "$f ($n lines)"
  done)
  [ -z "$long" ] || { echo "size: over 500 lines: $long" >&2; return 1; }
  echo "size: no file of src/, include/, tools/, examples/ over 500 lines"
}

stdfs() {
  local users
  users=$(git grep -lE 'std::filesystem|#[[:space:]]*include[[:space:]]*<filesystem>' -- '*.cpp' '*.h' '*.hpp' '*.cu')
  [ -z "$users" ] || { echo "stdfs: std::filesystem or <filesystem> (use POSIX calls, docs/building.md) in: $users" >&2; return 1; }
  echo "stdfs: no C++ file uses std::filesystem"
}

status=0
for c in "${checks[@]}"; do
  case $c in
    format) scripts/format.sh --check && echo "format: clean" ;;
    layers) /usr/bin/python3 scripts/layering.py ;;
    notes) notes ;;
    size) size ;;
    stdfs) stdfs ;;
    tidy) scripts/tidy.sh ;;
    *) echo "style: unknown check '$c' (format, layers, notes, size, stdfs, tidy)" >&2; false ;;
  esac || status=1
done
exit "$status"
