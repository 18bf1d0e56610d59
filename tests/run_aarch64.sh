#!/usr/bin/env bash
# tests/run_aarch64.sh [BUILD] [quick|full]: the AArch64 tables, cross-built and run under
# emulation. Builds BUILD (default build-aarch64) with cmake/aarch64-linux-gnu.cmake (Debian's
# gcc-aarch64-linux-gnu and libc6-dev-arm64-cross), then under qemu-aarch64 (qemu-user):
#   1. the table each CPU model gets by itself: neon on a Cortex-A72 (Armv8.0-A, no BF16),
#      neon_bf16 on -cpu max (every extension qemu has, FEAT_BF16 included), and each table
#      forced by FLYWHEEL_ISA (--print-default, and the CLI's `info`, which names the core
#      from /proc/cpuinfo's implementer and part);
#   2. the C suites on -cpu max. Quick mode (the default, for CI): the quick sweep of a
#      selection (below) on neon and neon_bf16 (the portable table's code is the one x86-64
#      tests). Full mode (make test-aarch64 FULL=1, about 50 minutes on 2 cores): every
#      suite, whole sweeps, on both AArch64 tables. isa.env and attn.fork_child stay out, as
#      in run_baseline.sh (qemu-user does not follow exec, and cannot fork a process
#      that has threads): step 1 checks what isa.env checks;
#   3. the neon table on a Cortex-A72, quick, a selection (the CPU model without BF16: the
#      detection, and the kernels with nothing newer than Armv8.0-A to lean on);
#   4. `flywheel run --small` (the main job's calls on reduced shapes) on neon_bf16 (both
#      tables in full mode), and `flywheel bench attn --check` on small shapes (prefill, and a
#      decode row) per dtype on neon: the CLI checks each against the float64 reference and
#      fails past the bar.
# Results must not depend on the thread count on any table: the suites' threads_identical
# cases run on each.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-aarch64}
mode=${2:-quick}
for t in aarch64-linux-gnu-gcc qemu-aarch64; do
  command -v $t >/dev/null || {
    echo "run_aarch64: needs $t (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)" >&2
    exit 2
  }
done
cmake -S . -B "$build" -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DCMAKE_BUILD_TYPE=Release \
  -DFW_PYTHON_EXT=OFF >/dev/null
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" --target test_flywheel flywheel
tests=$build/test_flywheel cli=$build/flywheel
max=(qemu-aarch64 -cpu max -L /usr/aarch64-linux-gnu)
a72=(qemu-aarch64 -cpu cortex-a72 -L /usr/aarch64-linux-gnu)

fail() { echo "run_aarch64: $*" >&2; exit 1; }
default_of() {  # default_of CPU-ARGS...: the table --print-default names, and its status
  "$@" "$tests" --print-default | cut -d' ' -f1,2
}

echo "== the table each CPU gets"
[ "$(default_of "${max[@]}")" = "neon_bf16 0" ] || fail "-cpu max does not default to neon_bf16"
[ "$(default_of "${a72[@]}")" = "neon 0" ] || fail "a Cortex-A72 does not default to neon"
for t in portable neon neon_bf16; do
  [ "$(FLYWHEEL_ISA=$t default_of "${max[@]}")" = "$t 0" ] || fail "FLYWHEEL_ISA=$t is not the default"
done
out=$(FLYWHEEL_ISA=neon_bf16 default_of "${a72[@]}")
[ "$out" = "none 10" ] || fail "FLYWHEEL_ISA=neon_bf16 on a Cortex-A72: '$out', not refused"
"${max[@]}" "$cli" info
"${a72[@]}" "$cli" info | grep -qx 'default: neon' || fail "the CLI did not pick neon on a Cortex-A72"
# the core's name from /proc/cpuinfo's MIDR fields, as an AArch64 kernel writes them (qemu-user
# opens an absolute path under its -L prefix first: a sysroot whose proc/cpuinfo is a V1's)
root=$build/sysroot
mkdir -p "$root/proc"
ln -sfn /usr/aarch64-linux-gnu/lib "$root/lib"
printf 'processor\t: 0\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd40\n' \
  >"$root/proc/cpuinfo"
out=$(qemu-aarch64 -cpu max -L "$root" "$cli" info | head -1)
[ "${out%%,*}" = "cpu: Arm Neoverse V1" ] || fail "flywheel info on a Neoverse V1's cpuinfo: '$out'"

if [ "$mode" = quick ]; then
  # about 6 minutes on 2 cores; left out (each 2 to 10 minutes or more under emulation): the
  # big sweeps (attn.sweep_lengths, attn_bwd.sweep_lengths / _ratios_dims / _masks,
  # kvcache.sweep, kvcache.sweep_fp8, gdn.sweep_lengths) and attn.threads_identical, whose shapes are real size;
  # attn_bwd.threads_identical, conv.threads_identical and threads.host_identical stay
  suites='api.*,attn.scale_overflow,attn.decode_*,attn.negative_windows,attn.contiguous_descriptors'
  suites+=',attn.heuristics,attn.partial_tables,attn.micro_kernels,attn.bf16_products,attn.bad_input'
  suites+=',attn.workspace,attn.concurrent_callers,attn.auto_precision,attn.overflow_replay,attn.varlen'
  suites+=',attn.sweep_masks,attn.sweep_techniques,attn.sweep_layouts_dtypes,attn.sweep_ratios_dims'
  suites+=',attn_bwd.sweep_dtypes_layouts,attn_bwd.threads_identical,attn_bwd.bad_input,rotary.*'
  suites+=',kvcache.split_heuristic,kvcache.bad_input,kvcache.leftpad,kvcache.fp8_conversions'
  suites+=',gdn.bad_input,gdn.kernel_gates,gdn.decode_step,gdn.sweep_varlen,gdn.sweep_kda,gdn.kda_*'
  suites+=',layer.*,conv.*,nan.*,threads.*'
  export FW_TEST_QUICK=1 FW_TEST_TABLES=neon,neon_bf16
else
  suites=$("${max[@]}" "$tests" --list | grep -vx -e isa.env -e attn.fork_child | paste -sd, -)
  export FW_TEST_TABLES=neon,neon_bf16
fi
echo "== the C suites ($mode) on qemu -cpu max"
"${max[@]}" "$tests" --filter "$suites"

echo "== a Cortex-A72: neon"
FW_TEST_QUICK=1 FW_TEST_TABLES=neon "${a72[@]}" "$tests" \
  --filter 'api.*,attn.micro_kernels,attn.bf16_products,attn.sweep_layouts_dtypes,kvcache.fp8_conversions,nan.*'

echo "== the CLI on small shapes, checked against the reference"
# flywheel run --small: the main job's calls and checks (attention forward and backward, the
# KV cache, GDN and KDA, conv1d) on reduced shapes, 2 minutes a table under emulation: on
# neon_bf16 (whose f32 products are neon's code), both tables in full mode; and on neon, the
# attention forward and a decode row per dtype
tables=neon_bf16
[ "$mode" = quick ] || tables="neon neon_bf16"
for t in $tables; do
  FLYWHEEL_ISA=$t "${max[@]}" "$cli" run --small
done
for dt in f32 bf16; do
  "${max[@]}" "$cli" bench attn --isa neon --dtype $dt --t 300 --hq 4 --hkv 2 --d 64 --reps 1 --check
  "${max[@]}" "$cli" bench attn --isa neon --dtype $dt --sq 1 --sk 1000 --hq 8 --hkv 2 --d 128 --reps 1 --check
done
