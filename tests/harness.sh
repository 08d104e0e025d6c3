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
