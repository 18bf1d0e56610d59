/*
 * bench_util.c: what the CLI's commands share (tools/bench.h): timing, medians, the measured
 * peaks, input filling, buffers, cache layouts and option parsing. It calls nothing else in
 * tools/; every command file and flywheel.c call into it.
 */
#define _DEFAULT_SOURCE 1 /* madvise(MADV_HUGEPAGE) */
#include <errno.h>
#include <math.h>
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

int bench_bf16_products(const char *isa, fw_dtype dt, int precision)
{
    return precision == FW_PREC_BF16 || (precision == FW_PREC_AUTO && dt == FW_BF16 && fw_isa_native_bf16(isa));
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

void bench_fill(void *p, size_t n, fw_dtype dt, double scale, uint64_t seed)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        float x = (float)(((double)(s >> 11) * 0x1p-53 * 2.0 - 1.0) * scale);
        if (dt == FW_F32) ((float *)p)[i] = x;
        else if (dt == FW_BF16) ((uint16_t *)p)[i] = fw_f32_to_bf16(x);
        else ((uint16_t *)p)[i] = fw_f32_to_f16(x);
    }
}

int bench_rope_tables(int64_t n, int64_t rd, void **mem, fw_tensor *tcos, fw_tensor *tsin)
{
    const int64_t h = rd / 2, shape[2] = {n, h};
    float *t = malloc((size_t)(2 * n * h + 1) * sizeof(float));
    if (!t)
        return 0;
    for (int64_t p = 0; p < n; p++)
        for (int64_t i = 0; i < h; i++) {
            const double f = (double)p * pow(10000.0, -2.0 * (double)i / (double)rd);
            t[p * h + i] = (float)cos(f);
            t[n * h + p * h + i] = (float)sin(f);
        }
    *mem = t;
    *tcos = fw_tensor_contiguous(t, FW_F32, 2, shape);
    *tsin = fw_tensor_contiguous(t + n * h, FW_F32, 2, shape);
    return 1;
}

double bench_value(const void *x, fw_dtype dt, int64_t i)
{
    return dt == FW_F32 ? ((const float *)x)[i]
           : dt == FW_BF16 ? fw_bf16_to_f32(((const uint16_t *)x)[i]) : fw_f16_to_f32(((const uint16_t *)x)[i]);
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

void bench_tiles_cache(fw_kv_cache *cache, int64_t hkv, int64_t page, int64_t d)
{
    const int64_t st[4] = {hkv * page * d, d, page * d, 1};
    memcpy(cache->k.stride, st, sizeof st);
    memcpy(cache->v.stride, st, sizeof st);
    cache->layout = FW_KV_TILES;
}

void bench_cols_cache(fw_kv_cache *cache, int64_t hkv, int64_t page, int64_t d)
{
    const int64_t ks[4] = {hkv * page * d, 1, page * d, page}, vs[4] = {hkv * page * d, d, page * d, 1};
    memcpy(cache->k.stride, ks, sizeof ks);
    memcpy(cache->v.stride, vs, sizeof vs);
}

/* The best of 3 runs (about 0.25 s each) of one peak microbenchmark of table isa on `threads`
 * threads; 0 on failure. */
static double peak_runs(int t, int threads, int bf16)
{
    double best = 0;
    for (int i = 0; i < 3; i++) {
        double g;
        if ((bf16 ? fw_peak_bf16_gflops : fw_peak_gflops)(fw_isa_name(t), threads, 0.25, &g) != FW_OK)
            return 0;
        best = g > best ? g : best;
    }
    return best;
}

/* Rounds of peak_runs kept at most, when a peak looks disturbed (below). */
#define PEAK_ROUNDS 4

/* A peak of table isa (NULL: the default) on `threads` threads, cached per table and thread
 * count: a benchmark's % of peak is its own table's. A shared machine only ever lowers a run
 * (another tenant's work, a vCPU the host has parked), so the peak is the best run, not the
 * median. On more than one thread, a peak under 3/4 of `threads` times the one-thread peak
 * is measured again, up to PEAK_ROUNDS rounds, keeping the best: on a Zen 4 VM a `make run`
 * once measured its two-thread peak while one vCPU was parked (225 GFLOP/s, the one-thread
 * figure), and printed 129-161% of it. Cores that share their vector units (SMT siblings)
 * stay below that bar; they cost the extra rounds and keep their best. at_least: a rate a
 * benchmark measured on the table; a cached peak below it is measured again the same way. */
static double peak_of(const char *isa, int threads, int bf16, double at_least)
{
    static double cache[2][8][257];
    const char *name = isa ? isa : fw_isa_default();
    int t = fw_isa_count();
    for (int i = 0; name && i < fw_isa_count(); i++)
        if (strcmp(name, fw_isa_name(i)) == 0)
            t = i;
    if (threads < 1 || threads > 256 || t >= 8)
        return 0;
    double *c = &cache[bf16][t][threads];
    if (*c > 0 && *c >= at_least)
        return *c;
    const double one = threads > 1 ? peak_of(isa, 1, bf16, 0) : 0;
    for (int round = 0; round < PEAK_ROUNDS; round++) {
        const double g = peak_runs(t, threads, bf16);
        if (g <= 0)
            return 0;
        *c = g > *c ? g : *c;
        if (*c >= at_least && *c >= 0.75 * threads * one)
            break;
    }
    return *c;
}

double bench_peak(const char *isa, int threads) { return peak_of(isa, threads, 0, 0); }
double bench_peak_bf16(const char *isa, int threads) { return peak_of(isa, threads, 1, 0); }
double bench_peak_over(const char *isa, int threads, int bf16, double rate) { return peak_of(isa, threads, bf16, rate); }

int bench_opt(int argc, char **argv, int *i, const char *name)
{
    if (strcmp(argv[*i], name) != 0)
        return 0;
    if (*i + 1 >= argc) {
        fprintf(stderr, "flywheel: %s needs a value\n", name);
        exit(2);
    }
    ++*i;
    return 1;
}

int64_t bench_int(const char *name, const char *text, int64_t lo, int64_t hi)
{
    char *end;
    errno = 0;
    const long long x = strtoll(text, &end, 10);
    if (errno || end == text || *end || x < lo || x > hi) {
        fprintf(stderr, "flywheel: %s %s: expected an integer from %lld to %lld\n", name, text, (long long)lo,
                (long long)hi);
        exit(2);
    }
    return x;
}

double bench_real(const char *name, const char *text, double lo, double hi)
{
    char *end;
    errno = 0;
    const double x = strtod(text, &end);
    if (errno || end == text || *end || !(x >= lo && x <= hi)) {
        fprintf(stderr, "flywheel: %s %s: expected a number from %g to %g\n", name, text, lo, hi);
        exit(2);
    }
    return x;
}

int bench_is_help(const char *arg) { return strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0; }
