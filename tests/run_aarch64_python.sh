#!/usr/bin/env bash
# tests/run_aarch64_python.sh [BUILD]: the Python package as an Arm user's `pip install .` gets
# it, cross-built on x86-64 and run under emulation. Everything it fetches or builds stays in
# BUILD (default build-aarch64-python, git-ignored as build-*/), cached for the next run:
#   1. an aarch64 CPython 3.11: Debian 12's arm64 .debs (python3.11, libpython3.11-dev for the
#      headers, libgomp1 for the OpenMP loop, libstdc++6 for numpy), fetched by apt-get on
#      its own state and cache dirs in BUILD (the host's dpkg architectures are untouched) and
#      unpacked with dpkg -x into BUILD/rootfs, nothing configured; qemu-aarch64 -L
#      BUILD/rootfs runs it (qemu-user resolves the guest's absolute paths there first);
#   2. the wheel: `pip wheel . --no-deps --no-build-isolation` in a host venv holding
#      scikit-build-core (>= 0.11, for cmake.python-hints), cross-compiled the way its docs'
#      "manual cross compilation" says: CMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake,
#      cmake.python-hints off (the host Python is not the target), the target's Python named
#      to FindPython (its interpreter, a wrapper running it under qemu, and the arm64 headers:
#      the fast path _fwext.abi3.so builds against aarch64's pyconfig.h, which Debian's
#      multiarch pyconfig.h finds through -idirafter BUILD/rootfs/usr/include), and
#      _PYTHON_HOST_PLATFORM=linux-aarch64 for the wheel's platform tag (its Python and ABI
#      tags stay wheel.py-api's cp310-abi3). The OpenMP loop _fwomp.so builds on the cross
#      gcc's libgomp. Checked: a *-abi3-linux_aarch64 wheel whose three .so files are AArch64
#      ELF, whose libflywheel.so (stripped; its Build ID is the build dir's unstripped copy's)
#      holds the neon_bf16 name and BFMMLA and BFDOT code, and whose unstripped copy has both tables
#      (fw_kernels_neon, fw_kernels_neon_bf16);
#   3. numpy, ml_dtypes and pytest: manylinux aarch64 wheels for CPython 3.11 from PyPI
#      (pip download --platform), installed with the built wheel (flywheel-c[test], its own
#      dependencies resolved) by pip install --target BUILD/site, on PYTHONPATH;
#   4. on the emulated Python: the tables, default and binding on -cpu max (portable neon
#      neon_bf16; neon_bf16; the compiled fast path) and on -cpu cortex-a72 (portable neon;
#      neon), FLYWHEEL_ISA=neon on -cpu max, auto precision (bf16 products for bf16 inputs on
#      neon_bf16, f32 on neon: docs/portability.md) and use_openmp_threads;
#   5. python/tests (a copy in BUILD/tests) under qemu: on -cpu max (neon_bf16) with the
#      compiled fast path (FLYWHEEL_EXPECT_BINDING=compiled), every file but test_mla.py
#      (about 5 minutes alone under emulation); then on -cpu cortex-a72 (neon) on the ctypes
#      path (FLYWHEEL_BINDING=ctypes, FLYWHEEL_EXPECT_BINDING=ctypes) the attention, Gated
#      DeltaNet, call-table and argument files. torch, jax, fla and vLLM are not installed
#      (large downloads, and slow under emulation): their tests skip themselves, as do the
#      CLI's (the CLI is not in the wheel; tests/run_aarch64.sh runs it). Each run's output
#      is in BUILD/pytest-{max,a72}.log, its results in BUILD/pytest-{max,a72}.xml.
# Left out, for a reason that is not the package's: test_abi.py's two
# import-in-a-fresh-interpreter tests, which run sys.executable in a subprocess; qemu-user does
# not follow exec (no binfmt_misc registration here: the host kernel refuses the aarch64 ELF
# with ENOEXEC).
# About 5.5 minutes cold on 2 cores (47 MB of downloads), 5 warm (4 of them the tests, under qemu).
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
build=${1:-build-aarch64-python}
for t in aarch64-linux-gnu-gcc aarch64-linux-gnu-readelf qemu-aarch64 apt-get dpkg python3; do
  command -v $t >/dev/null || {
    echo "run_aarch64_python: needs $t (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user python3-venv)" >&2
    exit 2
  }
done
mkdir -p "$build"
build=$(cd "$build" && pwd)
rootfs=$build/rootfs
# pip keeps nothing outside BUILD: what it fetches is kept in BUILD/wheelhouse and host-venv
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
fail() { echo "run_aarch64_python: $*" >&2; exit 1; }

# each step's wall time, printed as it ends and again at the end
times=() t0=$(date +%s) tstep=$t0 sname=
step() {
  local now; now=$(date +%s)
  if [ -n "$sname" ]; then
    echo "-- $sname: $((now - tstep)) s"
    times+=("$(printf '%-58s %4d s' "$sname" $((now - tstep)))")
  fi
  sname=$1 tstep=$now
  [ -n "$sname" ] && echo "== $sname"
  return 0
}

step "aarch64 CPython 3.11 (Debian 12 arm64 .debs)"
pkgs="python3.11 libpython3.11-dev libgomp1 libstdc++6"
if [ "$(cat "$rootfs/.packages" 2>/dev/null)" != "$pkgs" ]; then
  a=$build/apt
  mkdir -p "$a/state/lists/partial" "$a/cache/archives/partial" "$a/sources.list.d"
  : >"$a/state/status"  # nothing installed: apt fetches the whole dependency closure
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  {
    echo "deb [arch=arm64 signed-by=$keyring] http://deb.debian.org/debian bookworm main"
    echo "deb [arch=arm64 signed-by=$keyring] http://deb.debian.org/debian bookworm-updates main"
    echo "deb [arch=arm64 signed-by=$keyring] http://deb.debian.org/debian-security bookworm-security main"
  } >"$a/sources.list"
  apt=(apt-get -q -o Debug::NoLocking=1 -o APT::Architecture=arm64 -o APT::Architectures::=arm64
       -o Dir::Etc::SourceList="$a/sources.list" -o Dir::Etc::SourceParts="$a/sources.list.d"
       -o Dir::State="$a/state" -o Dir::State::status="$a/state/status"
       -o Dir::Cache="$a/cache" -o Dir::Cache::archives="$a/cache/archives")
  "${apt[@]}" update >/dev/null
  # shellcheck disable=SC2086
  "${apt[@]}" install -y --download-only --no-install-recommends $pkgs | grep -E '^(Fetched|Need)' || true
  rm -rf "$rootfs"
  mkdir -p "$rootfs"
  for deb in "$a"/cache/archives/*.deb; do dpkg -x "$deb" "$rootfs"; done
  echo "$pkgs" >"$rootfs/.packages"
fi
qemu_max=(qemu-aarch64 -cpu max -L "$rootfs")
qemu_a72=(qemu-aarch64 -cpu cortex-a72 -L "$rootfs")
py=$rootfs/usr/bin/python3.11
# the target's interpreter for CMake's FindPython (a plain executable path)
mkdir -p "$build/bin"
printf '#!/bin/sh\nexec qemu-aarch64 -cpu max -L "%s" "%s" "$@"\n' "$rootfs" "$py" >"$build/bin/python3.11"
chmod +x "$build/bin/python3.11"
"$build/bin/python3.11" -c 'import platform, sys; print("guest:", platform.machine(), sys.version.split()[0])'

step "host venv with scikit-build-core"
venv=$build/host-venv
if ! "$venv/bin/python" -c 'import scikit_build_core' 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q 'scikit-build-core>=0.11,<2'
fi
"$venv/bin/python" -c 'import scikit_build_core, sys; print("scikit-build-core", scikit_build_core.__version__, "on Python", sys.version.split()[0])'

step "aarch64 wheel (pip wheel . through the cross toolchain)"
rm -rf "$build/dist"
# SKBUILD_BUILD_DIR: a persistent CMake build, so a rerun rebuilds only what changed
CMAKE_TOOLCHAIN_FILE=$src/cmake/aarch64-linux-gnu.cmake \
SKBUILD_CMAKE_PYTHON_HINTS=false \
SKBUILD_CMAKE_ARGS="-DPython3_EXECUTABLE=$build/bin/python3.11;-DPython3_INCLUDE_DIR=$rootfs/usr/include/python3.11;-DCMAKE_C_FLAGS=-idirafter $rootfs/usr/include" \
SKBUILD_BUILD_DIR=$build/wheel-build \
_PYTHON_HOST_PLATFORM=linux-aarch64 \
  "$venv/bin/pip" wheel . --no-deps --no-build-isolation -q -w "$build/dist"
whl=$(ls "$build"/dist/flywheel_c-*.whl)
basename "$whl"
case $whl in *-abi3-linux_aarch64.whl) ;; *) fail "$whl: not an abi3 linux_aarch64 wheel" ;; esac
rm -rf "$build/unpacked"
"$venv/bin/python" -m zipfile -e "$whl" "$build/unpacked"
for so in libflywheel.so _fwext.abi3.so _fwomp.so; do
  f=$build/unpacked/flywheel/$so
  [ -f "$f" ] || fail "the wheel has no flywheel/$so"
  m=$(aarch64-linux-gnu-readelf -h "$f" | sed -n 's/^ *Machine: *//p')
  [ "$m" = AArch64 ] || fail "flywheel/$so is for '$m', not AArch64"
  if command -v file >/dev/null; then file -b "$f" | sed "s|^|  $so: |"; else echo "  $so: $m"; fi
done
lib=$build/unpacked/flywheel/libflywheel.so
aarch64-linux-gnu-readelf -d "$build/unpacked/flywheel/_fwomp.so" | grep -q 'libgomp\.so' ||
  fail "_fwomp.so does not link libgomp: built without OpenMP"
grep -qa neon_bf16 "$lib" || fail "libflywheel.so has no neon_bf16 table name"
dis=$(aarch64-linux-gnu-objdump -d "$lib")
n=$(grep -cw bfdot <<<"$dis" || true)
[ "$n" -gt 0 ] || fail "libflywheel.so has no BFDOT instruction"
nm=$(grep -cw bfmmla <<<"$dis" || true)
[ "$nm" -gt 0 ] || fail "libflywheel.so has no BFMMLA instruction"
buildid() { aarch64-linux-gnu-readelf -n "$1" | sed -n 's/.*Build ID: *//p'; }
[ "$(buildid "$lib")" = "$(buildid "$build/wheel-build/libflywheel.so")" ] ||
  fail "the wheel's libflywheel.so is not the build dir's"
tables=$(aarch64-linux-gnu-nm "$build/wheel-build/libflywheel.so" | grep -o 'fw_kernels_neon[a-z0-9_]*' | sort | paste -sd' ')
[ "$tables" = "fw_kernels_neon fw_kernels_neon_bf16" ] || fail "tables in libflywheel.so: '$tables'"
echo "  libflywheel.so: $tables; $nm BFMMLA and $n BFDOT instructions; Build ID $(buildid "$lib")"

step "numpy, ml_dtypes, pytest (aarch64 wheels) and the package"
wh=$build/wheelhouse
plat=(--only-binary=:all: --python-version 3.11 --implementation cp
      --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64)
reqs="numpy>=1.21 ml_dtypes>=0.2 pytest>=7"
if [ "$(cat "$wh/.requirements" 2>/dev/null)" != "$reqs" ]; then
  rm -rf "$wh"
  # shellcheck disable=SC2086
  "$venv/bin/pip" download -q -d "$wh" "${plat[@]}" $reqs
  echo "$reqs" >"$wh/.requirements"
fi
rm -rf "$build/site"
"$venv/bin/pip" install -q --target "$build/site" --no-index --find-links "$wh" --find-links "$build/dist" \
  "${plat[@]}" --platform linux_aarch64 'flywheel-c[test]'
for d in "$build"/site/*.dist-info; do echo "  $(basename "$d" .dist-info)"; done

# the emulated Python, on the installed package alone
guest() {  # guest CPU-ARGS... -- PYTHON-ARGS...
  local q=()
  while [ "$1" != -- ]; do q+=("$1"); shift; done
  shift
  env -u PYTHONHOME PYTHONNOUSERSITE=1 PYTHONPATH="$build/site" "${q[@]}" "$py" "$@"
}

step "the tables on the emulated Python"
probe_of() { guest "$@" -c "$probe_src"; }
probe_src=$(cat <<EOF
import os, flywheel, numpy
from flywheel import _lib
assert flywheel.__file__.startswith("$build/site/"), flywheel.__file__
omp = "-"
if os.environ.get("OMP_CHECK"):
    flywheel.use_openmp_threads(2)
    omp = "%s:%d" % flywheel.threading_mode()
print(" ".join(flywheel.isa_tables()), flywheel.default_isa(), _lib.binding()[0],
      flywheel.auto_precision("bfloat16"), omp, "numpy-" + numpy.__version__,
      sep=" | ")
EOF
)
out=$(OMP_CHECK=1 probe_of "${qemu_max[@]}" --)
echo "  -cpu max:                  $out"
case $out in "portable neon neon_bf16 | neon_bf16 | compiled | bf16 | openmp:2 | "*) ;;
  *) fail "-cpu max: not (portable neon neon_bf16, default neon_bf16, compiled, bf16, openmp)" ;; esac
out=$(probe_of "${qemu_a72[@]}" --)
echo "  -cpu cortex-a72:           $out"
case $out in "portable neon | neon | compiled | f32 | - | "*) ;;
  *) fail "-cpu cortex-a72: not (portable neon, default neon, compiled, f32)" ;; esac
out=$(FLYWHEEL_ISA=neon probe_of "${qemu_max[@]}" --)
echo "  -cpu max, FLYWHEEL_ISA=neon: $out"
case $out in "portable neon neon_bf16 | neon | compiled | f32 | - | "*) ;;
  *) fail "FLYWHEEL_ISA=neon on -cpu max: not the default" ;; esac

rm -rf "$build/tests"
cp -r python/tests "$build/tests"
cd "$build/tests"
summary() {  # summary JUNIT-XML: passed / skipped / failed per file
  "$venv/bin/python" - "$1" <<'EOF'
import collections, sys, xml.etree.ElementTree as ET
n = collections.defaultdict(collections.Counter)
for case in ET.parse(sys.argv[1]).iter("testcase"):
    f = (case.get("classname") or case.get("name")).split(".")[0] + ".py"  # "": skipped whole
    kind = next((c.tag for c in case if c.tag in ("skipped", "failure", "error")), "passed")
    n[f][kind] += 1
for f in sorted(n):
    c = n[f]
    print(f"  {f:28} {c['passed']:4} passed {c['skipped']:4} skipped"
          + (f" {c['failure'] + c['error']:4} FAILED" if c['failure'] + c['error'] else ""))
EOF
}
pytest_on() {  # pytest_on NAME CPU-ARGS... -- PYTEST-ARGS...: the run's end, a per-file summary
  local name=$1 rc=0
  shift
  local q=()
  while [ "$1" != -- ]; do q+=("$1"); shift; done
  shift
  timeout 1800 env -u PYTHONHOME PYTHONNOUSERSITE=1 PYTHONPATH="$build/site" "${q[@]}" "$py" \
    -m pytest -q -p no:cacheprovider --rootdir . -rfE --junitxml="$build/pytest-$name.xml" "$@" \
    >"$build/pytest-$name.log" 2>&1 || rc=$?
  tail -n "$([ $rc -eq 0 ] && echo 1 || echo 60)" "$build/pytest-$name.log"
  summary "$build/pytest-$name.xml"
  [ $rc -eq 0 ] || fail "python tests ($name) failed (exit $rc): $build/pytest-$name.log"
}

step "python/tests on -cpu max (neon_bf16), compiled fast path"
sel=(--ignore=test_mla.py
     --deselect test_abi.py::test_import_refuses_a_real_library_of_another_abi
     --deselect test_abi.py::test_import_refuses_a_library_without_fw_abi_version)
FLYWHEEL_EXPECT_BINDING=compiled pytest_on max "${qemu_max[@]}" -- "${sel[@]}" .

step "python/tests on -cpu cortex-a72 (neon), ctypes path"
FLYWHEEL_BINDING=ctypes FLYWHEEL_EXPECT_BINDING=ctypes pytest_on a72 "${qemu_a72[@]}" -- \
  test_fastpath.py::test_expected_binding test_attention.py test_gated_delta.py test_calls.py \
  test_binding_args.py

step ""
echo "== times"
printf '  %s\n' "${times[@]}"
printf '  %-58s %4d s\n' total $(($(date +%s) - t0))
