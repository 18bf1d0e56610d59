/* bench.h: what the CLI's benchmark pieces share. */
#ifndef FW_BENCH_H
#define FW_BENCH_H

#include <stdint.h>
#include "flywheel.h"

#include <stddef.h>

double bench_now(void);
/* Online CPUs, 1 .. 256: every benchmark's default thread count. */
int bench_cpus(void);
/* The dtype named "f32", "bf16" or "f16" into *dt; 0 (and *dt untouched) for any other name. */
int bench_dtype(const char *name, fw_dtype *dt);
/* KV-cache-sized buffers: 2 MiB-aligned, asking for transparent huge pages as a serving
 * engine's cache pool would (release with free()). */
void *bench_alloc(size_t bytes);
/* Median of n doubles (sorts them). */
double bench_median(double *x, int n);
/* The machine's FMA peak on `threads` threads: the median of 3 runs of the widest table's
 * microbenchmark, each about 0.25 s. Measured once per thread count per process. */
double bench_peak(int threads);
/* The same for bf16 pair products (fw_peak_bf16_gflops): the peak of bf16-product runs. */
double bench_peak_bf16(int threads);
/* 1 when a call with inputs of dtype dt and this fw_precision uses bf16 products. */
int bench_bf16_products(fw_dtype dt, int precision);
/* "auto", "f32" or "bf16" into *prec (an fw_precision); 0 for any other name. */
int bench_precision(const char *name, int *prec);

int bench_attn_main(int argc, char **argv);
int bench_attn_headline(void);
int bench_kvcache_main(int argc, char **argv);
int bench_kvcache_headline(void);
int bench_gdn_main(int argc, char **argv);
int bench_gdn_headline(void);

#endif
