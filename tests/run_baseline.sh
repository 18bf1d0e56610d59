#!/usr/bin/env bash
# tests/run_baseline.sh [BUILD]: the library must start and work on any x86-64 CPU, without
# AVX. Runs BUILD's (default build) test binary and CLI
#   1. natively with FLYWHEEL_ISA=portable (the default table forced to plain C), and
#   2. under qemu-x86_64 -cpu qemu64 (an x86-64 CPU without AVX; package qemu-user), where
#      the library must pick the portable table by itself: a stray AVX instruction outside
#      the kernel tables is an illegal instruction there (tests/check_baseline_isa.sh looks
#      for them in the object code).
# Both on the quick sweep (FW_TEST_QUICK=1) of the suites below: under the emulator each
# suite runs about 20-50 times slower, so the big sweeps stay out; isa.env is out because
# its children run natively (qemu-user does not follow exec), and attn.fork_child because
# qemu-user cannot fork a process that has threads. On a build that is not x86-64 only the
# native part runs.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
tests=$build/test_flywheel cli=$build/flywheel
if [ ! -x "$tests" ] || [ ! -x "$cli" ]; then
  echo "run_baseline: build $build first" >&2
  exit 2
fi

suites='api.*,attn.negative_windows,attn.heuristics,attn.partial_tables,attn.micro_kernels'
suites+=',attn.bad_input,attn.workspace,attn.concurrent_callers,attn.varlen'
suites+=',attn.sweep_layouts_dtypes,kvcache.split_heuristic,kvcache.bad_input,gdn.*,nan.*'
export FW_TEST_QUICK=1

expect_default() {  # expect_default WHAT LINE: --print-default said "portable 0 ..."
  case $2 in
    "portable 0"*) ;;
    *) echo "run_baseline: $1: the default table is not portable: $2" >&2; exit 1 ;;
  esac
}

echo "== FLYWHEEL_ISA=portable, natively"
expect_default "FLYWHEEL_ISA=portable" "$(FLYWHEEL_ISA=portable "$tests" --print-default)"
FLYWHEEL_ISA=portable "$tests" --filter "$suites,isa.env,attn.fork_child"

if ! objdump -f "$tests" 2>/dev/null | grep -q 'x86-64'; then
  echo "run_baseline: $tests is not x86-64; no emulator run"
  exit 0
fi
command -v qemu-x86_64 >/dev/null ||
  { echo "run_baseline: needs qemu-x86_64 (apt-get install qemu-user)" >&2; exit 2; }
qemu=(qemu-x86_64 -cpu qemu64)
echo "== ${qemu[*]}: a CPU without AVX"
unset FLYWHEEL_ISA
out=$("${qemu[@]}" "$cli" info)
echo "$out"
grep -qx 'default: portable' <<<"$out" || { echo "run_baseline: the CLI did not pick portable" >&2; exit 1; }
expect_default "${qemu[*]}" "$("${qemu[@]}" "$tests" --print-default)"
"${qemu[@]}" "$tests" --filter "$suites"
