# Shell helpers of the script tests (tests/tools/fsdp_run_test.sh, tests/examples/fsdp_gpt_test.sh);
# sourced. Each script keeps its command's output in "$TMP"/out and "$TMP"/err.

# fail MESSAGE...: prints the message and the last command's output, then exits 1.
fail() {
  echo "FAIL: $*" >&2
  for f in "$TMP"/out "$TMP"/err; do
    [ -f "$f" ] && { echo "--- $(basename "$f"):" >&2; cat "$f" >&2; }
  done
  exit 1
}

# A TCP port nobody listens on now, for the rendezvous (ctest runs tests in parallel, and other
# jobs on the machine may use the default 29500). Below the kernel's default ephemeral range
# (32768-60999 in /proc/sys/net/ipv4/ip_local_port_range), so no connection another test opens meanwhile takes it.
free_port() {
  local port
  for _ in $(seq 100); do
    port=$((20000 + RANDOM % 6000))  # 20000-25999; the C++ harness's LoopbackPort draws above
    if ! ss -Htan "( sport = :$port )" 2>/dev/null | grep -q .; then
      echo "$port"
      return
    fi
  done
  echo 29500
}
