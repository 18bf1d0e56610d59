/*
 * flywheel: the command-line tool.
 *   flywheel run                 the main job: headline kernels on real-size shapes, checked
 *                                against the reference, with throughput and % of FMA peak
 *   flywheel bench attn [opts]   softmax attention benchmark (flywheel bench attn --help)
 *   flywheel bench kvcache       KV-cache append + attend: decode and chunked prefill
 *   flywheel bench gdn           Gated DeltaNet prefill (with baselines) and decode
 *   flywheel peak [threads]      this machine's measured FMA peak
 *   flywheel info                kernel tables and the default
 */
#define _DEFAULT_SOURCE 1 /* madvise(MADV_HUGEPAGE) */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "bench.h"

double bench_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int bench_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (n > 256 ? 256 : (int)n);
}

int bench_dtype(const char *name, fw_dtype *dt)
{
    static const struct { const char *name; fw_dtype dt; } names[] = {
        {"f32", FW_F32}, {"bf16", FW_BF16}, {"f16", FW_F16}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i].name)) {
            *dt = names[i].dt;
            return 1;
        }
    return 0;
}

int bench_precision(const char *name, int *prec)
{
    static const struct { const char *name; int prec; } names[] = {
        {"auto", FW_PREC_AUTO}, {"f32", FW_PREC_F32}, {"bf16", FW_PREC_BF16}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i].name)) {
            *prec = names[i].prec;
            return 1;
        }
    return 0;
}

int bench_bf16_products(fw_dtype dt, int precision)
{
    return precision == FW_PREC_BF16 || (precision == FW_PREC_AUTO && dt == FW_BF16);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double bench_median(double *x, int n)
{
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

void *bench_alloc(size_t bytes)
{
    const size_t huge = (size_t)2 << 20, n = (bytes + huge - 1) / huge * huge;
    void *p = aligned_alloc(huge, n ? n : huge);
#ifdef MADV_HUGEPAGE
    if (p)
        madvise(p, n ? n : huge, MADV_HUGEPAGE);
#endif
    return p;
}

/* Median of 3 runs of one peak microbenchmark on `threads` threads, cached per thread count. */
static double peak_of(int threads, int bf16)
{
    static double cache[2][257];
    if (threads < 1 || threads > 256)
        return 0;
    if (cache[bf16][threads] > 0)
        return cache[bf16][threads];
    double g[3];
    for (int i = 0; i < 3; i++)
        if ((bf16 ? fw_peak_bf16_gflops : fw_peak_gflops)(NULL, threads, 0.25, &g[i]) != FW_OK)
            return 0;
    return cache[bf16][threads] = bench_median(g, 3);
}

double bench_peak(int threads) { return peak_of(threads, 0); }
double bench_peak_bf16(int threads) { return peak_of(threads, 1); }

static void usage(FILE *f)
{
    fprintf(f,
            "usage: flywheel run | bench attn|kvcache|gdn [options] | peak [threads] | info\n"
            "  run          the headline set (causal prefill GQA 32:8 d=128 at T=1K/4K/16K in bf16\n"
            "               and f32, MHA d=256), checked against the reference on a slice of rows\n"
            "  bench attn   see `flywheel bench attn --help`\n");
}

int main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "run") == 0) {
        int fail = bench_attn_headline();
        printf("\nKV cache (append + attend, paged, page 256): decode K/V GB/s against the read bandwidth\n"
               "measured in the same run; chunked prefill next to the dense kernel on the same shape\n");
        fail |= bench_kvcache_headline();
        printf("\nGated DeltaNet (Qwen3-Next shapes, bf16): chunked prefill against the plain 4-pass\n"
               "recurrence and the fused recurrent step in the same run; decode against the read bandwidth\n");
        fail |= bench_gdn_headline();
        printf(fail ? "main job: FAILED\n" : "main job: all checks passed\n");
        return fail;
    }
    if (argc >= 3 && strcmp(argv[1], "bench") == 0 && strcmp(argv[2], "attn") == 0)
        return bench_attn_main(argc - 3, argv + 3);
    if (argc >= 3 && strcmp(argv[1], "bench") == 0 && strcmp(argv[2], "kvcache") == 0)
        return bench_kvcache_main(argc - 3, argv + 3);
    if (argc >= 3 && strcmp(argv[1], "bench") == 0 && strcmp(argv[2], "gdn") == 0)
        return bench_gdn_main(argc - 3, argv + 3);
    if (argc >= 2 && strcmp(argv[1], "peak") == 0) {
        int t = argc >= 3 ? atoi(argv[2]) : 1;
        double g = bench_peak(t), gb = bench_peak_bf16(t);
        if (g <= 0 || gb <= 0) {
            fprintf(stderr, "flywheel: peak: %s\n", fw_last_error());
            return 1;
        }
        printf("FMA peak on %d thread(s): %.1f GFLOP/s (f32, widest table)\n", t, g);
        printf("bf16 dot-product peak on %d thread(s): %.1f GFLOP/s (widest table%s)\n", t, gb,
               fw_isa_supported("avx512bf16") ? ", vdpbf16ps" : ": no bf16 dot product, f32 emulation");
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "info") == 0) {
        printf("kernel tables:");
        for (int i = 0; i < fw_isa_count(); i++)
            printf(" %s%s", fw_isa_name(i), fw_isa_supported(fw_isa_name(i)) ? "" : "(unsupported)");
        printf("\ndefault: %s\n", fw_isa_default() ? fw_isa_default() : fw_last_error());
        return 0;
    }
    usage(argc >= 2 && strcmp(argv[1], "--help") == 0 ? stdout : stderr);
    return argc >= 2 && strcmp(argv[1], "--help") == 0 ? 0 : 2;
}
