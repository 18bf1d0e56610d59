# Thin wrapper over CMake. `make run`: the main job; `make test`: every test.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
MAKEFLAGS += --no-print-directory

.PHONY: all build run test test-asan test-tsan clean

all: build

build:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/flywheel run

test: build
	$(BUILD)/test_flywheel

# The same tests under AddressSanitizer and UndefinedBehaviorSanitizer, on a smaller sweep.
test-asan:
	@cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=Debug -DFW_SANITIZE=ON >/dev/null
	@cmake --build $(BUILD)-asan -j $(JOBS)
	FW_TEST_QUICK=1 $(BUILD)-asan/test_flywheel

# ThreadSanitizer: concurrent callers and every threaded path, on the smaller sweep.
test-tsan:
	@cmake -S . -B $(BUILD)-tsan -DCMAKE_BUILD_TYPE=Debug -DFW_SANITIZE_THREAD=ON >/dev/null
	@cmake --build $(BUILD)-tsan -j $(JOBS) --target test_flywheel
	FW_TEST_QUICK=1 $(BUILD)-tsan/test_flywheel

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-tsan
