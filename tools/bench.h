/* bench.h: what the CLI's commands share (tools/bench_util.c). Nothing here depends on a
 * command: the commands' entry points are in tools/commands.h. */
#ifndef FW_BENCH_H
#define FW_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include "flywheel.h"

double bench_now(void);
/* Online CPUs, 1 .. 256: every benchmark's default thread count. */
int bench_cpus(void);
/* The dtype named "f32", "bf16" or "f16" into *dt; 0 (and *dt untouched) for any other name. */
int bench_dtype(const char *name, fw_dtype *dt);
/* KV-cache-sized buffers: 2 MiB-aligned, asking for transparent huge pages as a serving
 * engine's cache pool would (release with free()). */
void *bench_alloc(size_t bytes);
/* A paged cache's K and V [pages, page, hkv, d] restrided to FW_KV_TILES (vLLM's AMX layout):
 * pages [hkv][page][d], each (page, head) block dense, in tile order. */
void bench_tiles_cache(fw_kv_cache *cache, int64_t hkv, int64_t page, int64_t d);
/* The same cache restrided to vLLM's vec layout (its CPU_ATTN kernels for f32, and for bf16
 * without AMX): pages [hkv][...], each (page, head) block of K transposed [d][page], of V
 * [page][d]; FW_KV_ROWS strides. */
void bench_cols_cache(fw_kv_cache *cache, int64_t hkv, int64_t page, int64_t d);
/* n values of dtype dt (f32, bf16 or f16) uniform in [-scale, scale), from a xorshift stream
 * of `seed`: the same inputs on every run. */
void bench_fill(void *p, size_t n, fw_dtype dt, double scale, uint64_t seed);
/* RoPE tables (base 10000) of n positions and rotary_dim rd: cos and sin [n, rd / 2] f32 in
 * one allocation at *mem (release with free()), described by *cos and *sin. 0: no memory. */
int bench_rope_tables(int64_t n, int64_t rd, void **mem, fw_tensor *cos, fw_tensor *sin);
/* Element i of an array of dtype dt (f32, bf16 or f16), as a double. */
double bench_value(const void *x, fw_dtype dt, int64_t i);
/* Median of n doubles (sorts them). */
double bench_median(double *x, int n);
/* The machine's FMA peak on `threads` threads for table isa (NULL: the default): the best of
 * 3 runs of its microbenchmark, each about 0.25 s, measured again when it looks disturbed
 * (bench_util.c, peak_of). Measured once per table and thread count per process. */
double bench_peak(const char *isa, int threads);
/* The same for bf16 pair products (fw_peak_bf16_gflops): the peak of bf16-product runs. */
double bench_peak_bf16(const char *isa, int threads);
/* The FMA (bf16 0) or bf16-product (1) peak, measured again first if a benchmark's `rate`
 * on the same table and threads outran the cached one. */
double bench_peak_over(const char *isa, int threads, int bf16, double rate);
/* 1 when a call on table isa (NULL: the default) with inputs of dtype dt and this
 * fw_precision uses bf16 products (FW_PREC_AUTO: on a table with a native bf16 dot product). */
int bench_bf16_products(const char *isa, fw_dtype dt, int precision);
/* "auto", "f32" or "bf16" into *prec (an fw_precision); 0 for any other name. */
int bench_precision(const char *name, int *prec);

/* Option parsing of the bench commands. bench_opt: 1 when argv[*i] is `name` (then *i moves
 * to its value), 0 for any other argument; a missing value exits with status 2 and a message.
 * bench_int / bench_real: the value as a number in [lo, hi], or exit 2 naming the option,
 * the text and the range (no silent 0 for "abc"). */
int bench_opt(int argc, char **argv, int *i, const char *name);
int64_t bench_int(const char *name, const char *text, int64_t lo, int64_t hi);
double bench_real(const char *name, const char *text, double lo, double hi);
/* 1 for -h and --help. */
int bench_is_help(const char *arg);

#endif
