/*
 * bench_conv.c: `flywheel bench conv`, the causal conv1d (fw_conv1d_fwd) of the layers around
 * linear attention, at Qwen3-Next's shape by default (2K tokens x 8192 channels, width 4,
 * bf16, SiLU).
 *
 * Byte formula: a prefill reads x and writes out once (2 x B x L x D x element size) plus the
 * weights and bias; GB/s = that / seconds, against the read+write bandwidth of a copy of the
 * same bytes measured in the same run (threads each copying a slice with memcpy). Decode (N
 * sequences of one token, conv states updated in place): x, out, and the state rows read and
 * written (N x D x (2 (W-1) + 2) elements). The prefill output is checked against the float64
 * reference: within 2x the output rounding plus 2^-20 of the sum of the terms' magnitudes.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "commands.h"

typedef struct {
    int64_t B, L, D, W, decode;
    fw_dtype dt;
    int threads, reps, json, first; /* first: channel-first x [B, D, L] in memory */
} ccfg;

/* [B, L, D] over p: channel-last, or channel-first memory ([B, D, L]) seen as [B, L, D]. */
static fw_tensor view(void *p, fw_dtype dt, int64_t B, int64_t L, int64_t D, int first)
{
    int64_t sh[3] = {B, L, D};
    fw_tensor t = fw_tensor_contiguous(p, dt, 3, sh);
    if (first) {
        t.stride[1] = 1;
        t.stride[2] = L;
    }
    return t;
}

typedef struct {
    char *dst;
    const char *src;
    size_t n;
} slice;

static void *copy_slice(void *a)
{
    slice *s = a;
    memcpy(s->dst, s->src, s->n);
    return NULL;
}

/* GB/s (read + write) of copying `bytes` on `threads` threads: the median of 5. */
static double copy_bandwidth(int threads, size_t bytes)
{
    char *a = bench_alloc(bytes), *b = bench_alloc(bytes);
    if (!a || !b) {
        free(a);
        free(b);
        return 0;
    }
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double t[5];
    slice s[256];
    pthread_t th[256];
    for (int r = 0; r < 5; r++) {
        const double t0 = bench_now();
        for (int i = 0; i < threads; i++) {
            const size_t lo = bytes / (size_t)threads * (size_t)i, hi = i + 1 == threads ? bytes : lo + bytes / (size_t)threads;
            s[i] = (slice){b + lo, a + lo, hi - lo};
            if (i > 0 && pthread_create(&th[i], NULL, copy_slice, &s[i]) != 0)
                copy_slice(&s[i]), th[i] = 0;
        }
        copy_slice(&s[0]);
        for (int i = 1; i < threads; i++)
            if (th[i])
                pthread_join(th[i], NULL);
        t[r] = bench_now() - t0;
    }
    free(a);
    free(b);
    return 2.0 * (double)bytes / bench_median(t, 5) * 1e-9;
}

/* The output against the float64 reference; magnitudes from the same conv on |x| and |w|. */
static int check(const ccfg *c, const fw_tensor *x, const fw_tensor *w, const fw_tensor *out, double *err)
{
    const int64_t n = c->B * c->L * c->D;
    double *ref = malloc(sizeof(double) * (size_t)n), *mag = malloc(sizeof(double) * (size_t)n);
    float *ax = malloc(sizeof(float) * (size_t)n), *aw = malloc(sizeof(float) * (size_t)(c->D * c->W));
    *err = INFINITY;
    if (!ref || !mag || !ax || !aw) {
        free(ref); free(mag); free(ax); free(aw);
        return 1;
    }
    int64_t sh[3] = {c->B, c->L, c->D}, wsh[2] = {c->D, c->W};
    fw_tensor tr = fw_tensor_contiguous(ref, FW_F64, 3, sh), tm = fw_tensor_contiguous(mag, FW_F64, 3, sh);
    fw_tensor tax = view(ax, FW_F32, c->B, c->L, c->D, c->first), taw = fw_tensor_contiguous(aw, FW_F32, 2, wsh);
    for (int64_t i = 0; i < n; i++)
        ax[i] = fabsf(c->dt == FW_F32 ? ((float *)x->data)[i] : c->dt == FW_BF16 ? fw_bf16_to_f32(((uint16_t *)x->data)[i])
                                                                                 : fw_f16_to_f32(((uint16_t *)x->data)[i]));
    for (int64_t i = 0; i < c->D * c->W; i++)
        aw[i] = fabsf(c->dt == FW_F32 ? ((float *)w->data)[i] : c->dt == FW_BF16 ? fw_bf16_to_f32(((uint16_t *)w->data)[i])
                                                                                 : fw_f16_to_f32(((uint16_t *)w->data)[i]));
    fw_conv1d_params p;
    fw_conv1d_params_init(&p);
    fw_status s = fw_conv1d_ref(&tax, &taw, NULL, NULL, 0, NULL, NULL, NULL, &tm, &p);
    p.activation = FW_ACT_SILU;
    s |= fw_conv1d_ref(x, w, NULL, NULL, 0, NULL, NULL, NULL, &tr, &p);
    const double u = c->dt == FW_BF16 ? 0x1p-8 : c->dt == FW_F16 ? 0x1p-10 : 0x1p-23;
    const double tiny = c->dt == FW_F16 ? 0x1p-24 : 0x1p-133;
    double worst = s ? INFINITY : 0;
    for (int64_t b = 0; b < c->B && !s; b++)
        for (int64_t l = 0; l < c->L; l++)
            for (int64_t d = 0; d < c->D; d++) {
                const int64_t i = (b * c->L + l) * c->D + d, o = b * out->stride[0] + l * out->stride[1] + d * out->stride[2];
                const double got = c->dt == FW_F32 ? ((float *)out->data)[o]
                                   : c->dt == FW_BF16 ? fw_bf16_to_f32(((uint16_t *)out->data)[o])
                                                      : fw_f16_to_f32(((uint16_t *)out->data)[o]);
                worst = fmax(worst, fabs(got - ref[i]) / (2 * u * fabs(ref[i]) + 0x1p-20 * mag[i] + tiny));
            }
    free(ref); free(mag); free(ax); free(aw);
    *err = worst;
    return !(worst <= 1);
}

static int run_prefill(const ccfg *c)
{
    const size_t es = fw_dtype_size(c->dt), n = (size_t)(c->B * c->L * c->D);
    void *x = bench_alloc(n * es), *o = bench_alloc(n * es), *w = malloc((size_t)(c->D * c->W) * es);
    if (!x || !o || !w) {
        fprintf(stderr, "bench conv: out of memory\n");
        free(x); free(o); free(w);
        return 1;
    }
    bench_fill(x, n, c->dt, 2.0, 1);
    bench_fill(w, (size_t)(c->D * c->W), c->dt, 0.5, 2);
    int64_t wsh[2] = {c->D, c->W};
    fw_tensor tx = view(x, c->dt, c->B, c->L, c->D, c->first), to = view(o, c->dt, c->B, c->L, c->D, c->first);
    fw_tensor tw = fw_tensor_contiguous(w, c->dt, 2, wsh);
    fw_conv1d_params p;
    fw_conv1d_params_init(&p);
    p.activation = FW_ACT_SILU;
    p.threads = c->threads;
    double t[64];
    const int reps = c->reps > 64 ? 64 : c->reps;
    for (int r = -1; r < reps; r++) {
        const double t0 = bench_now();
        if (fw_conv1d_fwd(&tx, &tw, NULL, NULL, 0, NULL, NULL, NULL, &to, &p) != FW_OK) {
            fprintf(stderr, "bench conv: %s\n", fw_last_error());
            free(x); free(o); free(w);
            return 1;
        }
        if (r >= 0)
            t[r] = bench_now() - t0;
    }
    const double s = bench_median(t, reps);
    double lo = t[0], hi = t[reps - 1]; /* sorted by bench_median */
    const double bytes = 2.0 * (double)n * (double)es + (double)(c->D * c->W) * (double)es;
    const double bw = copy_bandwidth(c->threads, n * es);
    double err;
    const int fail = check(c, &tx, &tw, &to, &err);
    if (c->json)
        printf("{\"op\":\"conv1d_prefill\",\"B\":%lld,\"L\":%lld,\"D\":%lld,\"W\":%lld,\"dtype\":\"%s\",\"layout\":\"%s\","
               "\"threads\":%d,\"seconds_median\":%.6g,\"seconds_min\":%.6g,\"seconds_max\":%.6g,\"gbps\":%.2f,"
               "\"copy_gbps\":%.2f,\"pct_copy\":%.1f,\"err_of_bound\":%.3g,\"pass\":%s}\n",
               (long long)c->B, (long long)c->L, (long long)c->D, (long long)c->W, fw_dtype_name(c->dt),
               c->first ? "channel-first" : "channel-last", c->threads, s, lo, hi, bytes / s * 1e-9, bw,
               100 * bytes / s * 1e-9 / bw, err, fail ? "false" : "true");
    else
        printf("conv1d prefill [%lld, %lld tokens, %lld ch] W=%lld %s %s thr=%d  %8.3f ms (%.3f-%.3f)  %6.1f GB/s  "
               "%5.1f%% of %.1f GB/s copy  err %.2g of bound %s\n",
               (long long)c->B, (long long)c->L, (long long)c->D, (long long)c->W, fw_dtype_name(c->dt),
               c->first ? "channel-first" : "channel-last", c->threads, s * 1e3, lo * 1e3, hi * 1e3,
               bytes / s * 1e-9, 100 * bytes / s * 1e-9 / bw, bw, err, fail ? "FAIL" : "ok");
    fflush(stdout);
    free(x); free(o); free(w);
    return fail;
}

static int run_decode(const ccfg *c)
{
    const int64_t N = c->decode, D = c->D, S = c->W - 1;
    const size_t es = fw_dtype_size(c->dt);
    void *x = malloc((size_t)(N * D) * es + 1), *o = malloc((size_t)(N * D) * es + 1);
    void *w = malloc((size_t)(D * c->W) * es), *st = bench_alloc((size_t)(N * S * D) * es + 1);
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)N);
    if (!x || !o || !w || !st || !idx) {
        fprintf(stderr, "bench conv: out of memory\n");
        free(x); free(o); free(w); free(st); free(idx);
        return 1;
    }
    bench_fill(x, (size_t)(N * D), c->dt, 1.0, 3);
    bench_fill(w, (size_t)(D * c->W), c->dt, 0.5, 4);
    bench_fill(st, (size_t)(N * S * D), c->dt, 1.0, 5);
    for (int64_t i = 0; i < N; i++)
        idx[i] = (int32_t)(N - 1 - i);
    int64_t xs[3] = {N, 1, D}, wsh[2] = {D, c->W}, ss[3] = {N, S, D};
    fw_tensor tx = fw_tensor_contiguous(x, c->dt, 3, xs), to = fw_tensor_contiguous(o, c->dt, 3, xs);
    fw_tensor tw = fw_tensor_contiguous(w, c->dt, 2, wsh);
    fw_conv1d_state sc = {fw_tensor_contiguous(st, c->dt, 3, ss), idx, NULL};
    fw_conv1d_params p;
    fw_conv1d_params_init(&p);
    p.activation = FW_ACT_SILU;
    p.threads = c->threads;
    double t[256];
    const int reps = c->reps * 8 > 256 ? 256 : c->reps * 8;
    for (int r = -1; r < reps; r++) {
        const double t0 = bench_now();
        if (fw_conv1d_fwd(&tx, &tw, NULL, NULL, 0, &sc, &sc, NULL, &to, &p) != FW_OK) {
            fprintf(stderr, "bench conv: %s\n", fw_last_error());
            free(x); free(o); free(w); free(st); free(idx);
            return 1;
        }
        if (r >= 0)
            t[r] = bench_now() - t0;
    }
    const double s = bench_median(t, reps);
    const double bytes = (double)(N * D) * (double)es * (double)(2 * S + 2);
    if (c->json)
        printf("{\"op\":\"conv1d_decode\",\"seqs\":%lld,\"D\":%lld,\"W\":%lld,\"dtype\":\"%s\",\"threads\":%d,"
               "\"seconds_median\":%.6g,\"us_per_step\":%.2f,\"gbps\":%.2f}\n",
               (long long)N, (long long)D, (long long)c->W, fw_dtype_name(c->dt), c->threads, s, s * 1e6,
               bytes / s * 1e-9);
    else
        printf("conv1d decode  %lld seqs x %lld ch W=%lld %s thr=%d  %8.1f us/step  %6.1f GB/s (x, out, states)\n",
               (long long)N, (long long)D, (long long)c->W, fw_dtype_name(c->dt), c->threads, s * 1e6,
               bytes / s * 1e-9);
    fflush(stdout);
    free(x); free(o); free(w); free(st); free(idx);
    return 0;
}

static ccfg cdefaults(void)
{
    ccfg c = {1, 2048, 8192, 4, 0, FW_BF16, bench_cpus(), 10, 0, 0};
    return c;
}

/* `make run`: the prefill at the default shape, checked, then the decode of 64 sequences
 * (json: one object each). */
int bench_conv_headline(int json, int small)
{
    ccfg c = cdefaults();
    c.json = json;
    if (small) {
        c.L /= 16;
        c.D /= 16;
        c.reps = 1;
    }
    int fail = run_prefill(&c);
    c.decode = small ? 4 : 64;
    return fail | run_decode(&c);
}

int bench_conv_main(int argc, char **argv)
{
    ccfg c = cdefaults();
    int decode_only = 0;
    for (int i = 0; i < argc; i++) {
        if (bench_is_help(argv[i])) {
            printf("usage: flywheel bench conv [--l L --d D --w W --batch B --dtype f32|bf16|f16 --threads N\n"
                   "       --reps N --channel-first --decode N --json]\n"
                   "  prefill of B x L tokens x D channels (default 1 x 2048 x 8192, W 4, bf16, SiLU),\n"
                   "  then decode of N sequences (default 64; --decode N alone: decode only)\n");
            return 0;
        }
        if (bench_opt(argc, argv, &i, "--l")) c.L = bench_int("--l", argv[i], 1, 1 << 24);
        else if (bench_opt(argc, argv, &i, "--d")) c.D = bench_int("--d", argv[i], 1, 1 << 20);
        else if (bench_opt(argc, argv, &i, "--w")) c.W = bench_int("--w", argv[i], 1, FW_MAX_CONV_WIDTH);
        else if (bench_opt(argc, argv, &i, "--batch")) c.B = bench_int("--batch", argv[i], 1, 1 << 16);
        else if (bench_opt(argc, argv, &i, "--threads")) c.threads = (int)bench_int("--threads", argv[i], 1, 256);
        else if (bench_opt(argc, argv, &i, "--reps")) c.reps = (int)bench_int("--reps", argv[i], 1, 64);
        else if (bench_opt(argc, argv, &i, "--decode")) {
            c.decode = bench_int("--decode", argv[i], 1, 1 << 20);
            decode_only = 1;
        } else if (bench_opt(argc, argv, &i, "--dtype")) {
            if (!bench_dtype(argv[i], &c.dt)) {
                fprintf(stderr, "bench conv: --dtype %s: expected f32, bf16 or f16\n", argv[i]);
                return 2;
            }
        } else if (strcmp(argv[i], "--channel-first") == 0) c.first = 1;
        else if (strcmp(argv[i], "--json") == 0) c.json = 1;
        else {
            fprintf(stderr, "bench conv: unknown option %s (--help lists them)\n", argv[i]);
            return 2;
        }
    }
    if (decode_only)
        return run_decode(&c);
    int fail = run_prefill(&c);
    c.decode = 64;
    return fail | run_decode(&c);
}
