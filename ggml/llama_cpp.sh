#!/usr/bin/env bash
# The llama.cpp release flywheel's ggml backend is built and tested against, and the parts of
# it the tests and benchmarks run: ggml's libraries, test-backend-ops, llama-bench and
# llama-completion.
#
#   ggml/llama_cpp.sh DIR PIP    DIR/src: its source, DIR/build/bin: what it builds;
#                                PIP: a pip that downloads the source
#
# The source is llama.cpp 0c1e570 (ggml 0.25.3), as the llama-cpp-python 0.3.36 sdist on PyPI
# carries it in vendor/llama.cpp, checked against the sdist's SHA-256; nothing of it is kept in
# this repository. Built as llama.cpp's release packages are: shared libraries with dynamic
# backends (GGML_BACKEND_DL, so that every tool loads GGML_BACKEND_PATH) and OpenMP threads;
# its CPU backend is one variant for this CPU (GGML_NATIVE cannot be combined with
# GGML_BACKEND_DL, so the x86 features ggml has options for are read from /proc/cpuinfo; AMX's
# int8 matrix kernels are left out: this release's stop on SIGILL on a Xeon VM with AMX). A
# second run only rebuilds what changed (about 4 minutes the first time on 2 cores).
set -euo pipefail
dir=$1 pip=$2
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

if [ ! -f "$dir/src/.complete" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp"
  sdist=$tmp/llama_cpp_python-$version.tar.gz
  echo "$sha256  $sdist" | sha256sum -c --quiet -
  tar xzf "$sdist" -C "$tmp" "llama_cpp_python-$version/vendor/llama.cpp"
  rm -rf "$dir/src"
  mkdir -p "$dir"
  mv "$tmp/llama_cpp_python-$version/vendor/llama.cpp" "$dir/src"
  touch "$dir/src/.complete"
fi

isa=()
if [ "$(uname -m)" = x86_64 ]; then
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  for pair in sse4_2:SSE42 avx:AVX f16c:F16C fma:FMA avx2:AVX2 bmi2:BMI2 avx_vnni:AVX_VNNI \
              avx512bw:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
              avx512_bf16:AVX512_BF16; do
    case $flags in
      *" ${pair%%:*} "*) isa+=("-DGGML_${pair#*:}=ON") ;;
      *) isa+=("-DGGML_${pair#*:}=OFF") ;;
    esac
  done
fi
log=$dir/build.log
{ cmake -S "$dir/src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_BACKEND_DL=ON -DGGML_NATIVE=OFF "${isa[@]}" -DGGML_CCACHE=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF &&
  cmake --build "$dir/build" -j "$(nproc)" --target ggml-cpu test-backend-ops llama-bench \
    llama-completion; } >"$log" 2>&1 || { tail -40 "$log"; echo "llama.cpp's build failed: $log"; exit 1; }
