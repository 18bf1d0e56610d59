# Thin wrapper over CMake. `make run`: the main job; `make test`: every test.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
MAKEFLAGS += --no-print-directory

.PHONY: all build run test test-asan bench clean

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

clean:
	rm -rf $(BUILD) $(BUILD)-asan
