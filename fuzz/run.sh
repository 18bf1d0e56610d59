#!/usr/bin/env bash
# fuzz/run.sh BUILD_DIR SECONDS [HARNESS...]: run each libFuzzer harness for SECONDS over its
# committed seed corpus (fuzz/corpus/NAME) and its regression inputs (fuzz/regress/NAME; every
# finding is kept there). New corpus entries go to BUILD_DIR/fuzz-corpus/NAME, findings to
# BUILD_DIR/fuzz-findings/. Prints one line per harness with the executions it ran clean and
# exits non-zero if any harness found something. Harnesses: attn kvcache gdn conv diff layer (the
# default), and jax where jaxlib's FFI header was found (make fuzz adds it then).
set -uo pipefail
build=$1
seconds=$2
shift 2
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(attn kvcache gdn conv diff layer)
src=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$build/fuzz-findings"
status=0
for h in "${names[@]}"; do
  bin=$build/fuzz_$h
  [ -x "$bin" ] || { echo "fuzz: $bin is not built"; exit 2; }
  mkdir -p "$build/fuzz-corpus/$h" "$src/corpus/$h" "$src/regress/$h"
  log=$build/fuzz-$h.log
  # the regression inputs once each, then the fuzzing run from both directories
  if ls "$src/regress/$h"/* >/dev/null 2>&1 && ! "$bin" "$src/regress/$h"/* >"$log" 2>&1; then
    echo "fuzz_$h: a regression input fails again (see $log)"
    status=1
    continue
  fi
  "$bin" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$build/fuzz-findings/$h-" \
    "$build/fuzz-corpus/$h" "$src/corpus/$h" "$src/regress/$h" >"$log" 2>&1
  rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  if [ $rc -ne 0 ]; then
    echo "fuzz_$h: FINDING after ${runs:-?} executions (input in $build/fuzz-findings/, log $log):"
    grep -m1 -A12 '^problem:\|ERROR: AddressSanitizer\|runtime error\|ERROR: libFuzzer' "$log" | head -20
    status=1
  else
    echo "fuzz_$h: ${runs:-?} executions in ${seconds} s, clean"
  fi
done
exit $status
