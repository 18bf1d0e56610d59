#!/usr/bin/env bash
# tests/check_baseline_isa.sh [BUILD ...]: the library must start on any x86-64 CPU, so only the
# kernel tables built with their own ISA flags (src/kern/avx2.c, avx512.c, avx512bf16.c, amx.c) may
# contain AVX instructions. Disassembles (objdump -d) every object file of the flywheel_obj
# target in each CMake build directory (default: build; the list is BUILD/flywheel_obj.objects,
# written by CMakeLists.txt) and fails if any other object, src/kern/portable.c included, has
# a VEX or EVEX instruction: a mnemonic starting with 'v', a VEX-encoded BMI instruction, a
# %ymm/%zmm or %k0-7 operand, or bytes objdump cannot decode. So that the check cannot pass
# vacuously, each table object must contain its own ISA (avx2: %ymm, avx512: %zmm,
# avx512bf16: vdpbf16ps, amx: tdpbf16ps). Builds that are not x86-64 are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- build
command -v objdump >/dev/null || { echo "check_baseline_isa: needs objdump (binutils)" >&2; exit 2; }

# Prints "vex ymm zmm bf16 amx" counts of an object; with a second argument, its VEX/EVEX
# instructions (up to that many) on stderr.
scan() {
  objdump -d --no-show-raw-insn "$1" | awk -v show="${2:-0}" -v obj="$1" '
    /^[0-9a-f]+ <.*>:$/ { fn = $2; sub(/:$/, "", fn) }
    /^ *[0-9a-f]+:\t/ {
      ins = $0; sub(/^ *[0-9a-f]+:\t/, "", ins)
      n = split(ins, w, " ")
      i = 1   # skip prefixes to the mnemonic
      while (i < n && w[i] ~ /^(lock|rep|repz|repe|repnz|repne|data16|data32|addr32|notrack|bnd|[c-gs]s|rex(\.[WRXB]+)?|\{(vex|vex3|evex)\})$/) i++
      m = w[i]
      bad = m ~ /^v/ || m ~ /^(andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx)$/ ||
            ins ~ /%[yz]mm[0-9]/ || ins ~ /%k[0-7]([^0-9]|$)/ || ins ~ /\(bad\)/
      if (bad) {
        vex++
        if (vex <= show) printf "    %s %s: %s\n", obj, fn, ins > "/dev/stderr"
      }
      ymm += ins ~ /%ymm[0-9]/; zmm += ins ~ /%zmm[0-9]/; bf16 += m == "vdpbf16ps"; amx += m == "tdpbf16ps"
    }
    END { printf "%d %d %d %d %d\n", vex, ymm, zmm, bf16, amx }'
}

status=0
for build in "$@"; do
  list=$build/flywheel_obj.objects
  [ -s "$list" ] || { echo "check_baseline_isa: no $list (configure $build with CMake first)" >&2; exit 2; }
  mapfile -t objs < "$list"
  for o in "${objs[@]}"; do
    [ -f "$o" ] || { echo "check_baseline_isa: $o is missing (build $build first)" >&2; exit 2; }
  done
  if ! objdump -f "${objs[0]}" | grep -q 'x86-64'; then
    echo "$build: not an x86-64 build, nothing to check"
    continue
  fi
  tables=0 baseline=0
  for o in "${objs[@]}"; do
    read -r vex ymm zmm bf16 amx < <(scan "$o")
    case $o in
      */src/kern/avx2.c.o) want=$ymm what=%ymm ;;
      */src/kern/avx512.c.o) want=$zmm what=%zmm ;;
      */src/kern/avx512bf16.c.o) want=$bf16 what=vdpbf16ps ;;
      */src/kern/amx.c.o) want=$amx what=tdpbf16ps ;;
      *) want=
    esac
    if [ -n "$want" ]; then
      tables=$((tables + 1))
      if [ "$vex" -eq 0 ] || [ "$want" -eq 0 ]; then
        echo "FAIL $o: a kernel table without its own ISA ($vex VEX/EVEX instructions, $want with $what)" >&2
        status=1
      fi
    else
      baseline=$((baseline + 1))
      if [ "$vex" -gt 0 ]; then
        echo "FAIL $o: $vex VEX/EVEX instructions outside the kernel tables, e.g." >&2
        scan "$o" 5 >/dev/null
        status=1
      fi
    fi
  done
  if [ "$tables" -ne 4 ] || ! grep -q '/src/kern/portable\.c\.o$' "$list"; then
    echo "FAIL $build: expected the four x86-64 kernel tables and portable.c among the objects" >&2
    status=1
  fi
  echo "$build: checked $baseline baseline objects (no AVX allowed) and $tables kernel tables"
done
exit $status
