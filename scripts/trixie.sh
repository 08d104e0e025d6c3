#!/usr/bin/env bash
# A Debian trixie root (LibTorch 2.6, CPU, with Gloo) beside the bookworm host (LibTorch 1.13), to
# build and test libfsdp against LibTorch 2.x. Run as root on a Debian host with debootstrap.
#
#   scripts/trixie.sh setup             create the root, or reuse it when it is complete
#   scripts/trixie.sh run [--] CMD...   setup, then run CMD inside the root, in this directory
#   scripts/trixie.sh shell             setup, then an interactive shell inside the root
#
# The root is made by `debootstrap --variant=minbase trixie` and then gets, by apt, the trixie
# equivalents of scripts/setup.sh's packages (PKGS below). Each step leaves a stamp file in the
# root: a root whose debootstrap stamp is missing (an interrupted run) is removed and made again;
# one whose package stamp is missing or names other packages gets its apt step again. Each step's
# wall time is printed and appended to $FSDP_TRIXIE_ROOT.times.
#
# A run happens in a mount namespace of its own (unshare), in which the root is bind-mounted onto
# itself and /proc, /sys, /dev, /dev/pts, /dev/shm and the source tree into it, the source tree
# at its own path, so a build directory configured inside the root names the same paths as seen
# from the host; the mounts are undone at exit (trap), and leave with the namespace in any case.
# The command sees a clean environment: PATH, HOME=/root, LANG, TERM, and the host's FSDP_*, OMP_*,
# CTEST_*, CCACHE_*, GTEST_*, USE_LIBUV, JOBS, MAKEFLAGS and CMAKE_BUILD_PARALLEL_LEVEL. ccache's
# cache is the root's own (/root/.cache/ccache inside it), so it is kept with the root. Making or
# mending the root holds $FSDP_TRIXIE_ROOT.lock exclusively; runs, and setup's check that the root
# is complete, hold it shared, so runs go on side by side.
#
# Environment:
#   FSDP_TRIXIE_ROOT    where the root is (default /var/cache/libfsdp/trixie-root)
#   FSDP_TRIXIE_MIRROR  the Debian archive to install from (default: the one the host's own apt
#                       sources name, /etc/apt/sources.list and /etc/apt/sources.list.d/, so the
#                       root comes from whatever mirror this machine is configured with)
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd -P)
ROOT=${FSDP_TRIXIE_ROOT:-/var/cache/libfsdp/trixie-root}
MIRROR=${FSDP_TRIXIE_MIRROR:-}
TIMES=$ROOT.times
DEBOOTSTRAP_STAMP=.libfsdp-debootstrap-done
PACKAGES_STAMP=.libfsdp-packages-done

PKGS=(
  cmake g++ make pkg-config ccache
  libtorch-dev libgloo-dev          # LibTorch 2.6 (CPU, c10d with Gloo) and Gloo's headers/library
  libopenblas0-pthread
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev
  fortunes-min fortunes
  iproute2 procps
  python3-torch python3-safetensors # the Python interop test and the peer benchmark's contender
  gnuplot-nox                       # the peer benchmark's plots (as scripts/setup.sh --bench)
)

die() { echo "trixie: $*" >&2; exit 1; }
# The Debian archive the host's apt installs from: the URI of the first enabled 'deb' source
# (one-line .list or deb822 .sources) for a release suite (no -security, -updates, ...) with the
# 'main' component, over http(s), ftp or file. Prints nothing if there is none.
host_mirror() {
  local f
  {
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
      [ -f "$f" ] || continue
      awk '$1 == "deb" {
        i = 2
        if ($i ~ /^\[/) { while (i < NF && $i !~ /\]$/) i++; i++ }
        comps = ""
        for (j = i + 2; j <= NF && $j !~ /^#/; j++) comps = comps " " $j " "
        if ($(i + 1) !~ /-/ && comps ~ / main /) print $i
      }' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
      [ -f "$f" ] || continue
      awk 'BEGIN { RS = ""; FS = "\n" }
      {
        types = uris = suites = comps = ""; enabled = "yes"
        for (k = 1; k <= NF; k++) {
          line = $k
          if (line ~ /^[ \t]*#/) continue
          key = tolower(line); sub(/:.*/, "", key); val = line; sub(/^[^:]*:[ \t]*/, "", val)
          if (key == "types") types = " " val " "
          else if (key == "uris") uris = val
          else if (key == "suites") suites = " " val " "
          else if (key == "components") comps = " " val " "
          else if (key == "enabled") enabled = tolower(val)
        }
        if (enabled == "no" || types !~ / deb / || comps !~ / main /) next
        n = split(suites, s, /[ \t]+/); release = 0
        for (j = 1; j <= n; j++) if (s[j] != "" && s[j] !~ /-/) release = 1
        if (!release) next
        split(uris, u, /[ \t]+/); print u[1]
      }' "$f"
    done
  } | grep -E '^(https?|ftp|file):' | head -n 1
}
log_time() {  # log_time STEP SECONDS
  echo "trixie: $1 took $2 s"
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $1 $2 s" >>"$TIMES"
}
# Mount points under the root, deepest first (to undo them).
mounts_under_root() {
  awk -v r="$ROOT" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r
}

# root_complete PKGS_LINE: the root was made and has exactly these packages (both stamps).
root_complete() {
  [ -f "$ROOT/$DEBOOTSTRAP_STAMP" ] && [ "$(cat "$ROOT/$PACKAGES_STAMP" 2>/dev/null)" = "$1" ]
}

setup() {
  [ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, mounts)"
  mkdir -p "$(dirname "$ROOT")"
  # One setup at a time; runs of commands in a complete root hold the lock shared (run below).
  # A complete root is recognized under the shared lock, so a run does not wait for other runs;
  # only making or mending the root takes the lock exclusively (and checks again once it has it).
  local pkgs_line
  pkgs_line=$(printf '%s\n' "${PKGS[@]}" | sort | tr '\n' ' ')
  exec 9>>"$ROOT.lock"
  flock -s 9
  if root_complete "$pkgs_line"; then
    flock -u 9
    return
  fi
  flock 9
  if root_complete "$pkgs_line"; then
    flock -u 9
    return
  fi
  if [ ! -f "$ROOT/$DEBOOTSTRAP_STAMP" ]; then
    if [ -e "$ROOT" ]; then
      # A half-made root. Never delete through a mount (the source tree, /dev, ...).
      [ -z "$(mounts_under_root)" ] || die "$ROOT is incomplete and has mounts under it: $(mounts_under_root | tr '\n' ' ')"
      echo "trixie: removing the incomplete root $ROOT"
      rm -rf --one-file-system "$ROOT"
    fi
    command -v debootstrap >/dev/null ||
      die "debootstrap is missing: apt-get -o DPkg::Lock::Timeout=900 install -y debootstrap"
    [ -n "$MIRROR" ] || MIRROR=$(host_mirror)
    [ -n "$MIRROR" ] || die "no Debian archive found in the host's apt sources (/etc/apt/sources.list, /etc/apt/sources.list.d/); set FSDP_TRIXIE_MIRROR to one"
    echo "trixie: debootstrap --variant=minbase trixie $ROOT $MIRROR"
    local t=$SECONDS
    debootstrap --variant=minbase trixie "$ROOT" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1 ||
      { tail -30 "$ROOT.debootstrap.log" >&2; die "debootstrap failed (log: $ROOT.debootstrap.log)"; }
    log_time debootstrap $((SECONDS - t))
    touch "$ROOT/$DEBOOTSTRAP_STAMP"
  fi
  rm -f "$ROOT/$PACKAGES_STAMP"
  echo "trixie: apt-get install ${PKGS[*]}"
  local t=$SECONDS
  in_root bash -c 'export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/tmp/apt-install.log 2>&1 ||
      { tail -30 /tmp/apt-install.log; exit 1; }
    apt-get clean' -- "${PKGS[@]}"
  log_time "apt-install" $((SECONDS - t))
  echo "$pkgs_line" >"$ROOT/$PACKAGES_STAMP"
  flock -u 9
}

# in_root CMD...: CMD inside the root, in a private mount namespace with the bind mounts.
in_root() {
  # The host's name resolution, for apt and for the tests' rendezvous (hostname lookups).
  cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
  cp /etc/hosts "$ROOT/etc/hosts"
  local keep=() v
  for v in $(compgen -e); do
    case $v in
      FSDP_*|OMP_*|CTEST_*|CCACHE_*|GTEST_*|USE_LIBUV|JOBS|MAKEFLAGS|CMAKE_BUILD_PARALLEL_LEVEL|TERM)
        keep+=("$v=${!v}") ;;
    esac
  done
  local cwd=$PWD
  case $cwd/ in "$SRC"/*) ;; *) cwd=$SRC ;; esac
  unshare --mount --propagation private -- "$SRC/scripts/trixie.sh" __in_namespace "$cwd" \
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    "${keep[@]}" "$@"
}

# __in_namespace CWD CMD...: (in the namespace) mounts, chroot, CMD in CWD, unmounts at exit.
in_namespace() {
  local cwd=$1
  shift
  unmount_all() {
    local m
    for m in $(mounts_under_root); do
      umount "$m" 2>/dev/null || umount -l "$m" || echo "trixie: could not unmount $m" >&2
    done
  }
  trap unmount_all EXIT
  # The root a mount point of its own, as / is: 'ip netns exec' remounts / (gpt.two_node_netns).
  mount --bind "$ROOT" "$ROOT"
  local d
  for d in proc sys dev dev/pts dev/shm; do
    mkdir -p "$ROOT/$d"
    mount --bind "/$d" "$ROOT/$d"
  done
  mkdir -p "$ROOT$SRC"
  mount --bind "$SRC" "$ROOT$SRC"
  local rc=0
  chroot "$ROOT" /bin/sh -c 'cd "$1" && shift && exec "$@"' sh "$cwd" "$@" || rc=$?
  exit "$rc"
}

case ${1:-} in
  setup) setup ;;
  run)
    shift
    [ "${1:-}" = -- ] && shift
    [ $# -gt 0 ] || die "usage: scripts/trixie.sh run [--] CMD..."
    setup
    exec 9<"$ROOT.lock"
    flock -s 9
    in_root "$@"
    ;;
  shell)
    setup
    exec 9<"$ROOT.lock"
    flock -s 9
    in_root bash -i
    ;;
  __in_namespace)
    shift
    in_namespace "$@"
    ;;
  *) die "usage: scripts/trixie.sh setup | run [--] CMD... | shell" ;;
esac
