# The libFuzzer harnesses (clang: -fsanitize=fuzzer with AddressSanitizer and UBSan). Built by
# `make fuzz`, which configures a build directory with -DFW_FUZZ=ON and CC=clang. Each harness
# links its own instrumented copy of the library, so coverage reaches into the kernels and
# drivers. The float64 references and the harnesses' helpers are compiled with the sanitizers
# but without coverage: the fuzzer should not steer by them, and uninstrumented they run about
# 3x faster. Included from the top CMakeLists.txt (not a subdirectory), so the kernel tables
# keep their per-file ISA flags.
if(NOT CMAKE_C_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "FW_FUZZ needs clang (libFuzzer): configure with CC=clang")
endif()
set(FW_SAN -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
set(FW_FUZZ_LIB_SOURCES ${FW_SOURCES})
list(FILTER FW_FUZZ_LIB_SOURCES EXCLUDE REGEX "src/ref/")
# The kernel tables, the per-tile work items and the thread pool run the inner loops, whose
# comparisons (tile bounds, mask edges) follow from the shapes the harness decodes: nothing to
# steer by. Tracing them cost about half of every execution (perf over fuzz_diff's corpus).
set_property(SOURCE src/kern/portable.c src/kern/avx2.c src/kern/avx512.c src/kern/avx512bf16.c
  src/attn/tile.c src/attn/decode.c src/gdn/chunk.c src/gdn/decode.c src/threads.c
  APPEND PROPERTY COMPILE_OPTIONS -fno-sanitize-coverage=trace-cmp)
add_library(flywheel_fuzz STATIC ${FW_FUZZ_LIB_SOURCES})
target_compile_options(flywheel_fuzz PRIVATE -fsanitize=fuzzer-no-link ${FW_SAN} -O1)
add_library(flywheel_fuzz_ref STATIC src/ref/attn_ref.c src/ref/gdn_ref.c src/ref/conv_ref.c
  src/ref/gdn_layer_ref.c tests/test_util.c
  fuzz/fuzz_util.c)
target_compile_options(flywheel_fuzz_ref PRIVATE ${FW_SAN} -O2)
foreach(t flywheel_fuzz flywheel_fuzz_ref)
  target_include_directories(${t} PUBLIC include src tests fuzz)
  target_link_libraries(${t} PUBLIC Threads::Threads m)
endforeach()
foreach(h attn kvcache gdn conv diff layer)
  if(EXISTS ${PROJECT_SOURCE_DIR}/fuzz/fuzz_${h}.c)
    add_executable(fuzz_${h} fuzz/fuzz_${h}.c)
    target_compile_options(fuzz_${h} PRIVATE -fsanitize=fuzzer ${FW_SAN} -O1)
    target_link_options(fuzz_${h} PRIVATE -fsanitize=fuzzer ${FW_SAN})
    target_link_libraries(fuzz_${h} PRIVATE flywheel_fuzz_ref flywheel_fuzz)
  endif()
endforeach()
# flywheel.jax's FFI handlers (python/flywheel/_fwjax.c, compiled into the harness), where the
# top-level configuration found jaxlib's FFI header
if(fw_jax_include AND EXISTS "${fw_jax_include}/xla/ffi/api/c_api.h")
  add_executable(fuzz_jax fuzz/fuzz_jax.c)
  target_compile_options(fuzz_jax PRIVATE -fsanitize=fuzzer ${FW_SAN} -O1)
  target_link_options(fuzz_jax PRIVATE -fsanitize=fuzzer ${FW_SAN})
  target_include_directories(fuzz_jax PRIVATE ${fw_jax_include})
  target_link_libraries(fuzz_jax PRIVATE flywheel_fuzz_ref flywheel_fuzz)
endif()
