#!/usr/bin/env bash
# tests/install/check.sh [BUILD]: installs the CMake build BUILD (default build) into a
# temporary prefix, then builds the README's API example (the ```c block under "## API
# example", extracted here, so the README cannot drift from what is tested) against the
# installed copy only:
#   - a CMake project, find_package(flywheel) + flywheel::flywheel (and flywheel::flywheel_static)
#   - cc $(pkg-config --cflags --libs flywheel)
# and runs each program, which must exit 0. Needs cmake, a C compiler (CC, default cc) and
# pkg-config.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
cc=${CC:-cc}
[ -f "$build/CMakeCache.txt" ] || { echo "check.sh: $build is not a CMake build directory" >&2; exit 2; }
for tool in cmake pkg-config "$cc"; do
  command -v "$tool" >/dev/null || { echo "check.sh: needs $tool" >&2; exit 2; }
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

# 1. install; the configured prefix (CMAKE_INSTALL_PREFIX) is not this one, which is what
#    `cmake --install --prefix` must cope with
cmake --install "$build" --prefix "$prefix" >/dev/null
pc=$(find "$prefix" -name flywheel.pc)
config=$(find "$prefix" -name flywheelConfig.cmake)
if [ -z "$pc" ] || [ -z "$config" ]; then
  echo "check.sh: no flywheel.pc or flywheelConfig.cmake under $prefix" >&2
  exit 1
fi
for f in include/flywheel.h bin/flywheel; do
  [ -f "$prefix/$f" ] || { echo "check.sh: $f was not installed" >&2; exit 1; }
done
libdir=$(dirname "$(dirname "$pc")")
for f in libflywheel.so libflywheel.a cmake/flywheel/flywheelConfigVersion.cmake; do
  [ -e "$libdir/$f" ] || { echo "check.sh: ${libdir#"$tmp"/}/$f was not installed" >&2; exit 1; }
done
echo "installed into a temporary prefix: $(cd "$prefix" && find . -type f -o -type l | sort | tr '\n' ' ')"

# 2. the README's example
awk '/^## API example/ { sec = 1; next }
     sec && /^## / { exit }
     sec && /^```c$/ { code = 1; next }
     code && /^```$/ { exit }
     code' README.md > "$tmp/example.c"
grep -q 'int main' "$tmp/example.c" ||
  { echo "check.sh: README.md's API example has no main()" >&2; exit 1; }

run() {  # run NAME BINARY: the program must exit 0, on the installed libflywheel.so if any
  local name=$1 bin=$2 loads
  loads=$(LD_LIBRARY_PATH="$libdir" ldd "$bin" | grep 'libflywheel\.so' || true)
  if [ -n "$loads" ] && ! grep -q "=> $prefix/" <<<"$loads"; then
    echo "check.sh: $name does not load the installed libflywheel:$loads" >&2
    exit 1
  fi
  local out
  if ! out=$(LD_LIBRARY_PATH="$libdir" "$bin" 2>&1); then
    echo "check.sh: $name failed: $out" >&2
    exit 1
  fi
  echo "$name: $out"
}

# 2a. CMake: find_package(flywheel 0.1) from CMAKE_PREFIX_PATH, nothing from the source tree
cmake -S tests/install -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_C_COMPILER="$cc" -DEXAMPLE_SOURCE="$tmp/example.c" >/dev/null
cmake --build "$tmp/cmake-build" >/dev/null
run "find_package, flywheel::flywheel" "$tmp/cmake-build/example_shared"
run "find_package, flywheel::flywheel_static" "$tmp/cmake-build/example_static"
if ldd "$tmp/cmake-build/example_static" | grep -q libflywheel; then
  echo "check.sh: example_static loads libflywheel.so" >&2; exit 1
fi

# 2b. pkg-config
PKG_CONFIG_PATH=$(dirname "$pc")
export PKG_CONFIG_PATH
version=$(pkg-config --modversion flywheel)
[ "$version" = "$(sed -n 's/^#define FW_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' include/flywheel.h | paste -sd.)" ] ||
  { echo "check.sh: pkg-config says version $version, include/flywheel.h another" >&2; exit 1; }
# shellcheck disable=SC2046  # pkg-config's output is meant to be split into words
"$cc" -std=c11 -Wall -Wextra -Wpedantic -Werror -o "$tmp/example_pc" "$tmp/example.c" \
      $(pkg-config --cflags --libs flywheel)
run "pkg-config $version" "$tmp/example_pc"
echo "install check passed"
