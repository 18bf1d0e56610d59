/*
 * bench_attn.c: `flywheel bench attn` and the headline job of `flywheel run`.
 *
 * FLOP formula: GFLOP/s = 2 * (d + dv) * P / seconds / 1e9, where P is the number of
 * unmasked (query, key) pairs summed over batch and query heads (causal T x T: T(T+1)/2 per
 * head). Every figure is measured in the same run:
 *   seconds_median   median over --reps timed calls (after one untimed warm-up call)
 *   peak_gflops      the machine's FMA peak for the same thread count (fw_peak_gflops on
 *                    the call's kernel table, the best of 3 runs: bench_peak in bench.h)
 *   peak_bf16_gflops the bf16 dot-product peak, the same way (fw_peak_bf16_gflops)
 *   pct_peak         against the peak of the precision in use: bf16 products (bf16 inputs
 *                    by default, --precision bf16) against peak_bf16_gflops, else peak_gflops
 *   baseline_gflops  the plain row-at-a-time online-softmax kernel (FW_ATTN_PLAIN), same
 *                    formula, timed on the last baseline_rows = clamp(sq/16, 64, 256) query
 *                    rows, or --baseline-rows N (which see the same keys as in the full
 *                    problem: bottom-right alignment), median of 3
 * --check compares the last 32 query rows (those that see the most keys) against the float64
 * reference, next to the plain kernel's error on the same rows (bar: error <= 2 x plain + 1e-5);
 * with bf16 products the bar is 2 x the error of the same-roundings float64 reference (q, k, v
 * as given, P rounded to bf16 before PV, output rounded to its dtype) + 1e-5.
 * --bwd times the backward instead (its formula and check above run_bwd_cfg).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "commands.h"

typedef struct {
    int64_t b, sq, sk, hq, hkv, d, dv;
    fw_dtype dt;
    int causal;
    int64_t wl, wr;
    float softcap;
    int threads, reps;
    const char *isa;
    uint32_t flags;
    int json, check, baseline, techniques;
    int64_t base_rows; /* rows the plain baseline is timed on; 0: clamp(sq/16, 64, 256) */
    int prec; /* fw_precision */
    int bwd;  /* time the backward instead */
    int rotary; /* time the call with and without a fused RoPE of the whole head dim */
    const fw_tensor *rcos, *rsin;
} cfg;

typedef struct {
    void *q, *k, *v, *o;
    fw_tensor tq, tk, tv, to;
} bufs;

static uint64_t rng = 88172645463325252ull;
static double rnd(void)
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1p-53 * 2.0 - 1.0;
}

static void fill(const fw_tensor *t, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float x = (float)(rnd() * 1.7);
        if (t->dtype == FW_F32) ((float *)t->data)[i] = x;
        else if (t->dtype == FW_BF16) ((uint16_t *)t->data)[i] = fw_f32_to_bf16(x);
        else ((uint16_t *)t->data)[i] = fw_f32_to_f16(x);
    }
}

static int bufs_make(bufs *B, const cfg *c)
{
    size_t es = fw_dtype_size(c->dt);
    int64_t qs[4] = {c->b, c->sq, c->hq, c->d}, ks[4] = {c->b, c->sk, c->hkv, c->d},
            vs[4] = {c->b, c->sk, c->hkv, c->dv}, os[4] = {c->b, c->sq, c->hq, c->dv};
    int64_t nq = c->b * c->sq * c->hq * c->d, nk = c->b * c->sk * c->hkv * c->d,
            nv = c->b * c->sk * c->hkv * c->dv, no = c->b * c->sq * c->hq * c->dv;
    B->q = malloc((size_t)nq * es + 1);
    B->k = malloc((size_t)nk * es + 1);
    B->v = malloc((size_t)nv * es + 1);
    B->o = malloc((size_t)no * es + 1);
    if (!B->q || !B->k || !B->v || !B->o) {
        fprintf(stderr, "bench: out of memory\n");
        return 0;
    }
    B->tq = fw_tensor_contiguous(B->q, c->dt, 4, qs);
    B->tk = fw_tensor_contiguous(B->k, c->dt, 4, ks);
    B->tv = fw_tensor_contiguous(B->v, c->dt, 4, vs);
    B->to = fw_tensor_contiguous(B->o, c->dt, 4, os);
    fill(&B->tq, nq);
    fill(&B->tk, nk);
    fill(&B->tv, nv);
    return 1;
}

static void bufs_free(bufs *B)
{
    free(B->q); free(B->k); free(B->v); free(B->o);
}

/* Unmasked pairs of query rows [r0, sq) of one head of one sequence. */
static double pairs(const cfg *c, int64_t r0)
{
    double n = 0;
    for (int64_t r = r0; r < c->sq; r++) {
        int64_t diag = r + c->sk - c->sq;
        int64_t lo = c->wl >= 0 ? diag - c->wl : 0, hi = c->causal ? diag + 1
                                                       : (c->wr >= 0 ? diag + c->wr + 1 : c->sk);
        if (c->causal && c->wr >= 0 && diag + c->wr + 1 < hi)
            hi = diag + c->wr + 1;
        lo = lo < 0 ? 0 : lo;
        hi = hi > c->sk ? c->sk : hi;
        if (hi > lo)
            n += (double)(hi - lo);
    }
    return n;
}

/* The last query rows the plain baseline is timed on: --baseline-rows, else sq/16 between 64
 * and 256 (enough for a stable median at any length); at most sq. */
static int64_t baseline_rows(const cfg *c)
{
    const int64_t n = c->base_rows ? c->base_rows : (c->sq / 16 < 64 ? 64 : (c->sq / 16 > 256 ? 256 : c->sq / 16));
    return n < c->sq ? n : c->sq;
}

static void params_of(const cfg *c, fw_attn_params *p, uint32_t flags, int threads)
{
    fw_attn_params_init(p);
    p->causal = c->causal;
    p->window_left = c->wl;
    p->window_right = c->wr;
    p->softcap = c->softcap;
    p->threads = threads;
    p->isa = c->isa;
    p->flags = flags;
    p->precision = c->prec;
    p->rotary_cos = c->rcos;
    p->rotary_sin = c->rsin;
}

/* Median seconds of `reps` calls of call(ctx) after one untimed warm-up; *ok = 0 (and the
 * library's message on stderr) if one fails. */
static double median_calls(fw_status (*call)(void *), void *ctx, int reps, int *ok)
{
    double t[64];
    reps = reps > 64 ? 64 : reps;
    *ok = 1;
    for (int i = -1; i < reps; i++) {
        const double t0 = bench_now();
        const fw_status s = call(ctx);
        const double dt = bench_now() - t0;
        if (s != FW_OK) {
            fprintf(stderr, "bench: %s\n", fw_last_error());
            *ok = 0;
            return 0;
        }
        if (i >= 0)
            t[i] = dt;
    }
    return bench_median(t, reps);
}

/* One forward call: its operands and params. */
typedef struct {
    fw_tensor q, o;
    const bufs *B;
    fw_attn_params p;
} fwd_call;

static fw_status run_fwd(void *ctx)
{
    const fwd_call *f = ctx;
    return fw_attn_fwd(&f->q, &f->B->tk, &f->B->tv, &f->o, NULL, &f->p);
}

/* Median seconds of `reps` calls on query rows [r0, sq) (a bottom-right-aligned view). */
static double time_calls(const cfg *c, bufs *B, uint32_t flags, int64_t r0, int reps, int *ok)
{
    fwd_call f;
    params_of(c, &f.p, flags, c->threads);
    const size_t es = fw_dtype_size(c->dt);
    f.B = B;
    f.q = B->tq;
    f.o = B->to;
    f.q.shape[1] = f.o.shape[1] = c->sq - r0;
    f.q.data = (char *)B->q + (size_t)(r0 * f.q.stride[1]) * es;
    f.o.data = (char *)B->o + (size_t)(r0 * f.o.stride[1]) * es;
    return median_calls(run_fwd, &f, reps, ok);
}

typedef struct {
    double sec, gflops, peak, peak_f32, peak_bf16, base_gflops, err, perr, srerr, bar;
    int64_t base_rows;
    int bf16, checked, ok;
} result;

/* Output rows [r0, sq) of every batch as doubles, [b][rows][hq][dv]. */
static double *rows_of(const cfg *c, const bufs *B, int64_t r0)
{
    const int64_t n = c->sq - r0, per = c->hq * c->dv;
    double *x = malloc(sizeof(double) * (size_t)(c->b * n * per + 1));
    for (int64_t bb = 0; bb < c->b; bb++)
        for (int64_t i = 0; i < n * per; i++) {
            int64_t oo = (bb * c->sq + r0) * per + i;
            x[bb * n * per + i] = c->dt == FW_F32 ? ((float *)B->o)[oo]
                                  : c->dt == FW_BF16 ? fw_bf16_to_f32(((uint16_t *)B->o)[oo])
                                                     : fw_f16_to_f32(((uint16_t *)B->o)[oo]);
        }
    return x;
}

static double max_abs_diff(const double *x, const double *y, int64_t n)
{
    double e = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(x[i] - y[i]);
        e = d > e || d != d ? (d != d ? INFINITY : d) : e;
    }
    return e;
}

/* Times the kernel on the whole problem and the plain kernel on the last rows; with `check`
 * compares the last CHECK_ROWS rows of both (those that see the most keys) with the float64
 * reference. */
#define CHECK_ROWS 32

static result measure(const cfg *c, bufs *B, uint32_t flags, int with_baseline, int check)
{
    result r;
    memset(&r, 0, sizeof r);
    const double flop_per_pair = 2.0 * (double)(c->d + c->dv);
    const double P = pairs(c, 0) * (double)(c->b * c->hq);
    const int64_t nchk = c->sq < CHECK_ROWS ? c->sq : CHECK_ROWS;
    r.sec = time_calls(c, B, flags, 0, c->reps, &r.ok);
    if (!r.ok)
        return r;
    r.gflops = flop_per_pair * P / r.sec * 1e-9;
    r.bf16 = !(flags & FW_ATTN_PLAIN) && bench_bf16_products(c->isa, c->dt, c->prec);
    r.peak_f32 = bench_peak_over(c->isa, c->threads, 0, r.bf16 ? 0 : r.gflops);
    r.peak_bf16 = bench_peak_over(c->isa, c->threads, 1, r.bf16 ? r.gflops : 0);
    r.peak = r.bf16 ? r.peak_bf16 : r.peak_f32;
    double *mine = check ? rows_of(c, B, c->sq - nchk) : NULL;
    int ok = 1;
    if (with_baseline) {
        const int64_t rows = baseline_rows(c);
        const double s = time_calls(c, B, FW_ATTN_PLAIN, c->sq - rows, 3, &ok);
        r.base_rows = rows;
        r.base_gflops = ok && s > 0
                            ? flop_per_pair * pairs(c, c->sq - rows) * (double)(c->b * c->hq) / s * 1e-9
                            : 0;
    } else if (check) {
        time_calls(c, B, FW_ATTN_PLAIN, c->sq - nchk, 1, &ok);
    }
    if (check && ok) {
        /* the plain kernel's output now holds the last rows */
        double *plain = rows_of(c, B, c->sq - nchk);
        const int64_t n = c->b * nchk * c->hq * c->dv;
        int64_t os[4] = {c->b, c->sq, c->hq, c->dv};
        double *ref = malloc(sizeof(double) * (size_t)(n + 1));
        /* a [b, sq, hq, dv] view whose row sq - nchk is the start of ref */
        fw_tensor tr = fw_tensor_contiguous(ref, FW_F64, 4, os);
        tr.stride[0] = nchk * c->hq * c->dv;
        tr.data = ref - (c->sq - nchk) * tr.stride[1];
        double *sr = malloc(sizeof(double) * (size_t)(n + 1));
        fw_tensor ts = tr;
        ts.data = sr - (c->sq - nchk) * tr.stride[1];
        fw_attn_params p, ps;
        params_of(c, &p, 0, c->threads);
        p.precision = FW_PREC_F32;
        params_of(c, &ps, 0, c->threads);
        ps.precision = FW_PREC_BF16;
        if (fw_attn_ref(&B->tq, &B->tk, &B->tv, &tr, NULL, &p, c->sq - nchk, c->sq) == FW_OK &&
            (!r.bf16 || fw_attn_ref(&B->tq, &B->tk, &B->tv, &ts, NULL, &ps, c->sq - nchk, c->sq) == FW_OK)) {
            r.checked = 1;
            r.err = max_abs_diff(mine, ref, n);
            r.perr = max_abs_diff(plain, ref, n);
            if (r.bf16) {
                for (int64_t i = 0; i < n; i++) /* the same-roundings result rounded to out's dtype */
                    sr[i] = c->dt == FW_F32 ? (float)sr[i]
                            : c->dt == FW_BF16 ? fw_bf16_to_f32(fw_f32_to_bf16((float)sr[i]))
                                               : fw_f16_to_f32(fw_f32_to_f16((float)sr[i]));
                r.srerr = max_abs_diff(sr, ref, n);
            }
            r.bar = 2 * (r.bf16 ? r.srerr : r.perr) + 1e-5;
        } else {
            fprintf(stderr, "bench: reference: %s\n", fw_last_error());
        }
        free(sr);
        free(ref);
        free(plain);
    }
    free(mine);
    return r;
}

static void print_result(const cfg *c, const char *variant, const result *r)
{
    if (c->json) {
        printf("{\"op\":\"attn\",\"variant\":\"%s\",\"isa\":\"%s\",\"b\":%lld,\"sq\":%lld,\"sk\":%lld,"
               "\"hq\":%lld,\"hkv\":%lld,\"d\":%lld,\"dv\":%lld,\"dtype\":\"%s\",\"causal\":%s,"
               "\"window\":[%lld,%lld],\"softcap\":%g,\"threads\":%d,\"reps\":%d,"
               "\"products\":\"%s\",\"seconds_median\":%.6g,\"gflops\":%.2f,\"peak_gflops\":%.2f,"
               "\"peak_bf16_gflops\":%.2f,\"pct_peak\":%.1f",
               variant, c->isa ? c->isa : fw_isa_default(), (long long)c->b, (long long)c->sq,
               (long long)c->sk, (long long)c->hq, (long long)c->hkv, (long long)c->d,
               (long long)c->dv, fw_dtype_name(c->dt), c->causal ? "true" : "false",
               (long long)c->wl, (long long)c->wr, (double)c->softcap, c->threads, c->reps,
               r->bf16 ? "bf16" : "f32", r->sec, r->gflops, r->peak_f32, r->peak_bf16,
               100.0 * r->gflops / r->peak);
        if (r->base_gflops > 0) /* only figures that were measured */
            printf(",\"baseline_gflops\":%.2f,\"baseline_rows\":%lld,\"speedup_vs_baseline\":%.2f",
                   r->base_gflops, (long long)r->base_rows, r->gflops / r->base_gflops);
        else
            printf(",\"baseline_gflops\":null");
        if (r->checked) {
            printf(",\"max_err\":%.3g,\"plain_err\":%.3g", r->err, r->perr);
            if (r->bf16)
                printf(",\"same_roundings_err\":%.3g", r->srerr);
            printf(",\"check\":\"%s\"", r->err <= r->bar ? "pass" : "FAIL");
        }
        printf("}\n");
    } else {
        printf("%-10s %-5s x%-4s T=%-6lld h%lld:%lld d%lld/%lld %s%s thr=%d  %8.4f s  %7.1f GFLOP/s  "
               "%5.1f%% of %.0f %s peak",
               variant, fw_dtype_name(c->dt), r->bf16 ? "bf16" : "f32", (long long)c->sq,
               (long long)c->hq, (long long)c->hkv, (long long)c->d, (long long)c->dv,
               c->causal ? "causal" : "full", c->softcap > 0 ? " cap" : "", c->threads, r->sec,
               r->gflops, 100.0 * r->gflops / r->peak, r->peak, r->bf16 ? "bf16" : "FMA");
        if (r->base_gflops > 0)
            printf("  plain %.1f (x%.1f)", r->base_gflops, r->gflops / r->base_gflops);
        if (r->checked) {
            printf("  err %.2g (plain %.2g", r->err, r->perr);
            if (r->bf16)
                printf(", same-roundings %.2g", r->srerr);
            printf(") %s", r->err <= r->bar ? "ok" : "FAIL");
        }
        printf("\n");
    }
    fflush(stdout);
}

static int run_cfg(const cfg *c)
{
    bufs B;
    if (!bufs_make(&B, c))
        return 1;
    int fail = 0;
    static const struct { const char *name; uint32_t flags; } variants[] = {
        {"flywheel", 0},
        {"online", FW_ATTN_ONLINE_SOFTMAX},
        {"no-gqa-pack", FW_ATTN_NO_GQA_PACK},
        {"no-skip", FW_ATTN_NO_TILE_SKIP},
    };
    int nv = c->techniques ? 4 : 1;
    for (int i = 0; i < nv; i++) {
        uint32_t flags = c->flags | variants[i].flags;
        const char *name = c->flags & FW_ATTN_PLAIN ? "plain" : variants[i].name;
        result r = measure(c, &B, flags, c->baseline && i == 0, c->check && i == 0);
        if (!r.ok) {
            fail = 1;
            break;
        }
        if (c->check && i == 0)
            fail |= !(r.checked && r.err <= r.bar);
        print_result(c, name, &r);
    }
    bufs_free(&B);
    return fail;
}


/* ---------------------------------------------------------------- backward --
 *
 * FLOP formula: 2.5 x the forward's, 5 (d + dv) per unmasked pair (QK^T, dO V^T, P^T dO,
 * dS^T Q, dS K), against the peak of the precision in use (bf16 products for bf16 inputs by
 * default, --precision). The forward runs once first (f32 products) for out and lse. plain:
 * the row-at-a-time f32 backward (FW_ATTN_PLAIN) on the last baseline rows as their own
 * problem (q, out, dout, lse rows [r0, sq) against every key; same formula), median of 3.
 * --check: the same sub-problem of the last 32 rows through the kernel, plain and the float64
 * references; bar per gradient 2 x plain's error (f32 products) or 2 x the same-roundings
 * reference's (bf16 products: P and dS rounded to bf16, the gradient rounded to its dtype)
 * + 1e-5 x (1 + max |ref|). */

typedef struct {
    bufs B;
    void *go, *dq, *dk, *dv;
    float *lse;
    fw_tensor tgo, tl, tdq, tdk, tdv;
} bwd_bufs;

/* The problem's rows [r0, sq) as their own: q, out, dout, dq views and lse. */
static void bwd_view(const cfg *c, const bwd_bufs *W, int64_t r0, fw_tensor t[6])
{
    const size_t es = fw_dtype_size(c->dt);
    const fw_tensor *src[5] = {&W->B.tq, &W->B.to, &W->tgo, &W->tdq, &W->tl};
    for (int i = 0; i < 5; i++) {
        t[i] = *src[i];
        const int dim = i == 4 ? 2 : 1;
        t[i].shape[dim] = c->sq - r0;
        t[i].data = (char *)src[i]->data + (size_t)(r0 * src[i]->stride[dim]) * (i == 4 ? 4 : es);
    }
}

static fw_status bwd_call(const cfg *c, bwd_bufs *W, uint32_t flags, int64_t r0, const fw_tensor *dq,
                          const fw_tensor *dk, const fw_tensor *dv)
{
    fw_attn_params p;
    params_of(c, &p, flags, c->threads);
    fw_tensor t[6];
    bwd_view(c, W, r0, t);
    return fw_attn_bwd(&t[0], &W->B.tk, &W->B.tv, &t[1], &t[2], &t[4], dq ? dq : &t[3],
                       dk ? dk : &W->tdk, dv ? dv : &W->tdv, &p);
}

/* One backward call of the problem's rows [r0, sq). */
typedef struct {
    const cfg *c;
    bwd_bufs *W;
    uint32_t flags;
    int64_t r0;
} bwd_timed;

static fw_status run_bwd(void *ctx)
{
    const bwd_timed *b = ctx;
    return bwd_call(b->c, b->W, b->flags, b->r0, NULL, NULL, NULL);
}

static double bwd_time(const cfg *c, bwd_bufs *W, uint32_t flags, int64_t r0, int reps, int *ok)
{
    bwd_timed b = {c, W, flags, r0};
    return median_calls(run_bwd, &b, reps, ok);
}

/* The three gradients of the sub-problem of rows [r0, sq) into f64 buffers g[3]: kernel
 * (flags), or the reference (ref: 1 exact, 2 with the roundings of bf16 products, rounded to
 * the gradients' dtype, f32). */
static int bwd_grads(const cfg *c, bwd_bufs *W, uint32_t flags, int ref, int64_t r0, double *g[3])
{
    const int64_t n = c->sq - r0;
    const int64_t sq[4] = {c->b, n, c->hq, c->d}, sk[4] = {c->b, c->sk, c->hkv, c->d},
                  sv[4] = {c->b, c->sk, c->hkv, c->dv};
    fw_tensor d[3] = {fw_tensor_contiguous(g[0], FW_F64, 4, sq), fw_tensor_contiguous(g[1], FW_F64, 4, sk),
                      fw_tensor_contiguous(g[2], FW_F64, 4, sv)};
    fw_status s;
    if (ref) {
        fw_attn_params p;
        params_of(c, &p, 0, 1);
        p.precision = ref == 2 ? FW_PREC_BF16 : FW_PREC_F32;
        fw_tensor t[6];
        bwd_view(c, W, r0, t);
        s = fw_attn_bwd_ref(&t[0], &W->B.tk, &W->B.tv, &t[1], &t[2], &t[4], &d[0], &d[1], &d[2], &p);
    } else {
        /* f32 gradients, widened */
        float *f[3];
        for (int i = 0; i < 3; i++) {
            f[i] = (float *)g[i];
            d[i].dtype = FW_F32;
            d[i].data = f[i];
        }
        s = bwd_call(c, W, flags, r0, &d[0], &d[1], &d[2]);
        const int64_t cnt[3] = {c->b * n * c->hq * c->d, c->b * c->sk * c->hkv * c->d,
                                c->b * c->sk * c->hkv * c->dv};
        for (int i = 0; i < 3; i++)
            for (int64_t j = cnt[i] - 1; j >= 0; j--)
                g[i][j] = f[i][j];
    }
    if (s != FW_OK)
        fprintf(stderr, "bench: %s\n", fw_last_error());
    const int64_t all[3] = {c->b * n * c->hq * c->d, c->b * c->sk * c->hkv * c->d,
                            c->b * c->sk * c->hkv * c->dv};
    for (int i = 0; i < 3 && ref == 2; i++)
        for (int64_t j = 0; j < all[i]; j++)
            g[i][j] = (float)g[i][j];
    return s == FW_OK;
}

static int run_bwd_cfg(const cfg *c)
{
    bwd_bufs W;
    memset(&W, 0, sizeof W);
    if (!bufs_make(&W.B, c))
        return 1;
    const size_t es = fw_dtype_size(c->dt);
    const int64_t nq = c->b * c->sq * c->hq, nk = c->b * c->sk * c->hkv;
    const int64_t so[4] = {c->b, c->sq, c->hq, c->dv}, sl[3] = {c->b, c->hq, c->sq};
    W.go = malloc((size_t)(nq * c->dv) * es + 1);
    W.dq = malloc((size_t)(nq * c->d) * es + 1);
    W.dk = malloc((size_t)(nk * c->d) * es + 1);
    W.dv = malloc((size_t)(nk * c->dv) * es + 1);
    W.lse = malloc((size_t)nq * sizeof(float) + 1);
    if (!W.go || !W.dq || !W.dk || !W.dv || !W.lse) {
        fprintf(stderr, "bench: out of memory\n");
        return 1;
    }
    W.tgo = fw_tensor_contiguous(W.go, c->dt, 4, so);
    W.tl = fw_tensor_contiguous(W.lse, FW_F32, 3, sl);
    W.tdq = W.B.tq; W.tdq.data = W.dq;
    W.tdk = W.B.tk; W.tdk.data = W.dk;
    W.tdv = W.B.tv; W.tdv.data = W.dv;
    fill(&W.tgo, nq * c->dv);
    fw_attn_params p;
    params_of(c, &p, 0, c->threads);
    p.precision = FW_PREC_F32;
    const int bf16 = bench_bf16_products(c->isa, c->dt, c->prec);
    int fail = fw_attn_fwd(&W.B.tq, &W.B.tk, &W.B.tv, &W.B.to, &W.tl, &p) != FW_OK, ok = !fail;
    result r;
    memset(&r, 0, sizeof r);
    const double flop_per_pair = 5.0 * (double)(c->d + c->dv);
    if (ok)
        r.sec = bwd_time(c, &W, 0, 0, c->reps, &ok);
    if (ok) {
        r.ok = 1;
        r.gflops = flop_per_pair * pairs(c, 0) * (double)(c->b * c->hq) / r.sec * 1e-9;
        r.peak_f32 = bench_peak_over(c->isa, c->threads, 0, bf16 ? 0 : r.gflops);
        r.peak_bf16 = bench_peak_over(c->isa, c->threads, 1, bf16 ? r.gflops : 0);
        r.bf16 = bf16;
        r.peak = bf16 ? r.peak_bf16 : r.peak_f32;
        if (c->baseline) {
            const int64_t rows = baseline_rows(c);
            int bok;
            const double s = bwd_time(c, &W, FW_ATTN_PLAIN, c->sq - rows, 3, &bok);
            r.base_rows = rows;
            r.base_gflops = bok && s > 0 ? flop_per_pair * pairs(c, c->sq - rows) * (double)(c->b * c->hq) / s * 1e-9 : 0;
        }
        if (c->check) {
            const int64_t nchk = c->sq < CHECK_ROWS ? c->sq : CHECK_ROWS, r0 = c->sq - nchk;
            const int64_t cnt[3] = {c->b * nchk * c->hq * c->d, nk * c->d, nk * c->dv};
            double *g[4][3];
            int got = 1;
            for (int w = 0; w < 4; w++)
                for (int i = 0; i < 3; i++)
                    got &= (g[w][i] = malloc((size_t)(cnt[i] + 1) * sizeof(double))) != NULL;
            if (got && bwd_grads(c, &W, 0, 0, r0, g[0]) && bwd_grads(c, &W, FW_ATTN_PLAIN, 0, r0, g[1]) &&
                bwd_grads(c, &W, 0, 1, r0, g[2]) && (!bf16 || bwd_grads(c, &W, 0, 2, r0, g[3]))) {
                r.checked = 1;
                int pass = 1;
                for (int i = 0; i < 3; i++) {
                    double mag = 0;
                    for (int64_t j = 0; j < cnt[i]; j++)
                        mag = fmax(mag, fabs(g[2][i][j]));
                    const double e = max_abs_diff(g[0][i], g[2][i], cnt[i]), pe = max_abs_diff(g[1][i], g[2][i], cnt[i]);
                    const double se = bf16 ? max_abs_diff(g[3][i], g[2][i], cnt[i]) : 0;
                    pass &= e <= 2 * (bf16 ? se : pe) + 1e-5 * (1 + mag);
                    r.err = fmax(r.err, e);
                    r.perr = fmax(r.perr, pe);
                    r.srerr = fmax(r.srerr, se);
                }
                r.bar = pass ? INFINITY : -1;
            }
            for (int w = 0; w < 4; w++)
                for (int i = 0; i < 3; i++)
                    free(g[w][i]);
            fail |= !(r.checked && r.bar > 0);
        }
        print_result(c, "backward", &r);
    }
    free(W.go); free(W.dq); free(W.dk); free(W.dv); free(W.lse);
    bufs_free(&W.B);
    return fail || !ok;
}

/* The cost of a fused RoPE: the forward without and with rotary tables (rotary_dim = d, so
 * every channel of q and k rotates), alternating in ROPE_ROUNDS rounds of --reps calls; the
 * medians of all calls of each kind, their ratio, and the range of the per-round ratios. */
#define ROPE_ROUNDS 3

static int run_rotary_cfg(const cfg *c0)
{
    bufs B;
    if (!bufs_make(&B, c0))
        return 1;
    void *mem;
    fw_tensor rc, rs;
    if (!bench_rope_tables(c0->sk, c0->d, &mem, &rc, &rs)) {
        fprintf(stderr, "bench: out of memory\n");
        return 1;
    }
    cfg c = *c0;
    double t[2][ROPE_ROUNDS], lo = INFINITY, hi = 0;
    int ok = 1;
    for (int round = 0; round < ROPE_ROUNDS && ok; round++) {
        for (int with = 0; with < 2 && ok; with++) {
            c.rcos = with ? &rc : NULL;
            c.rsin = with ? &rs : NULL;
            t[with][round] = time_calls(&c, &B, c.flags, 0, c.reps, &ok);
        }
        const double r = t[1][round] / t[0][round];
        lo = r < lo ? r : lo;
        hi = r > hi ? r : hi;
    }
    if (ok) {
        const double a = bench_median(t[0], ROPE_ROUNDS), b = bench_median(t[1], ROPE_ROUNDS);
        if (c.json)
            printf("{\"op\":\"attn_rotary_cost\",\"sq\":%lld,\"sk\":%lld,\"hq\":%lld,\"hkv\":%lld,"
                   "\"d\":%lld,\"dtype\":\"%s\",\"threads\":%d,\"seconds_plain\":%.6g,"
                   "\"seconds_rotary\":%.6g,\"ratio\":%.4f,\"ratio_min\":%.4f,\"ratio_max\":%.4f}\n",
                   (long long)c.sq, (long long)c.sk, (long long)c.hq, (long long)c.hkv, (long long)c.d,
                   fw_dtype_name(c.dt), c.threads, a, b, b / a, lo, hi);
        else
            printf("rotary    %-5s T=%-6lld h%lld:%lld d%lld %s thr=%d  without %.4f s, with %.4f s: "
                   "%+.1f%% (rounds %+.1f%% .. %+.1f%%)\n", fw_dtype_name(c.dt), (long long)c.sq,
                   (long long)c.hq, (long long)c.hkv, (long long)c.d, c.causal ? "causal" : "full",
                   c.threads, a, b, 100 * (b / a - 1), 100 * (lo - 1), 100 * (hi - 1));
    }
    free(mem);
    bufs_free(&B);
    return !ok;
}

static cfg defaults(void)
{
    cfg c = {.b = 1, .sq = 4096, .sk = 4096, .hq = 32, .hkv = 8, .d = 128, .dv = 128, .dt = FW_BF16,
             .causal = 1, .wl = -1, .wr = -1, .reps = 5, .baseline = 1, .prec = FW_PREC_AUTO};
    return c;
}

static void attn_usage(void)
{
    printf("usage: flywheel bench attn [options]\n"
           "  --b N --t T (sq = sk = T) --sq N --sk N --hq N --hkv N --d N --dv N\n"
           "  --dtype f32|bf16|f16   --causal 0|1   --window L,R   --softcap C\n"
           "  --threads N (0 = all)  --reps N (median)   --isa NAME (`flywheel info` lists the tables)\n"
           "  --precision auto|f32|bf16   products (auto: bf16 for bf16 inputs on amx, neon_bf16, and\n"
           "                 avx512bf16 on AMD)\n"
           "  --online --no-gqa-pack --no-skip --plain --dec-prefetch --no-dec-prefetch\n"
           "                 technique switches\n"
           "  --techniques   also time each switch on its own (ratios in the same run)\n"
           "  --no-baseline  skip the plain kernel   --check   compare rows to the reference\n"
           "  --baseline-rows N  time the plain kernel on the last N query rows (default\n"
           "                 clamp(sq/16, 64, 256))\n"
           "  --json         one JSON object per line\n"
           "  --bwd          the backward (dq, dk, dv; f32 products) instead of the forward\n"
           "  --rotary       the cost of a fused RoPE (rotary_dim = d): the call with and without\n"
           "                 it, alternating, in the same run\n");
}

int bench_attn_main(int argc, char **argv)
{
    cfg c = defaults();
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
#define OPT(name) bench_opt(argc, argv, &i, name)
#define INT(name, lo, hi) bench_int(name, argv[i], lo, hi)
        if (OPT("--b")) c.b = INT("--b", 1, 1 << 20);
        else if (OPT("--t")) c.sq = c.sk = INT("--t", 1, 1 << 24);
        else if (OPT("--sq")) c.sq = INT("--sq", 1, 1 << 24);
        else if (OPT("--sk")) c.sk = INT("--sk", 1, 1 << 24);
        else if (OPT("--hq")) c.hq = INT("--hq", 1, 65536);
        else if (OPT("--hkv")) c.hkv = INT("--hkv", 1, 65536);
        else if (OPT("--d")) c.d = c.dv = INT("--d", 1, 1024);
        else if (OPT("--dv")) c.dv = INT("--dv", 1, 1024);
        else if (OPT("--causal")) c.causal = (int)INT("--causal", 0, 1);
        else if (OPT("--softcap")) c.softcap = (float)bench_real("--softcap", argv[i], 0, 1e30);
        else if (OPT("--threads")) c.threads = (int)INT("--threads", 0, 256);
        else if (OPT("--reps")) c.reps = (int)INT("--reps", 1, 100000);
        else if (OPT("--isa")) c.isa = argv[i];
        else if (OPT("--baseline-rows")) c.base_rows = INT("--baseline-rows", 1, 1 << 24);
        else if (OPT("--window")) {
            long long l, r;
            char tail;
            if (sscanf(argv[i], "%lld,%lld%c", &l, &r, &tail) != 2) {
                fprintf(stderr, "flywheel: --window %s: expected L,R (a negative side is unbounded)\n", argv[i]);
                return 2;
            }
            c.wl = l; c.wr = r;
        } else if (OPT("--precision")) {
            if (!bench_precision(argv[i], &c.prec)) { fprintf(stderr, "flywheel: unknown precision %s\n", argv[i]); return 2; }
        } else if (OPT("--dtype")) {
            if (!bench_dtype(argv[i], &c.dt)) { fprintf(stderr, "flywheel: unknown dtype %s\n", argv[i]); return 2; }
        }
        else if (!strcmp(a, "--online")) c.flags |= FW_ATTN_ONLINE_SOFTMAX;
        else if (!strcmp(a, "--no-gqa-pack")) c.flags |= FW_ATTN_NO_GQA_PACK;
        else if (!strcmp(a, "--no-skip")) c.flags |= FW_ATTN_NO_TILE_SKIP;
        else if (!strcmp(a, "--dec-prefetch")) c.flags |= FW_ATTN_DEC_PREFETCH;
        else if (!strcmp(a, "--no-dec-prefetch")) c.flags |= FW_ATTN_NO_DEC_PREFETCH;
        else if (!strcmp(a, "--plain")) { c.flags |= FW_ATTN_PLAIN; c.baseline = 0; }
        else if (!strcmp(a, "--techniques")) c.techniques = 1;
        else if (!strcmp(a, "--no-baseline")) c.baseline = 0;
        else if (!strcmp(a, "--check")) c.check = 1;
        else if (!strcmp(a, "--json")) c.json = 1;
        else if (!strcmp(a, "--bwd")) c.bwd = 1;
        else if (!strcmp(a, "--rotary")) c.rotary = 1;
        else if (bench_is_help(a)) { attn_usage(); return 0; }
        else { fprintf(stderr, "flywheel: unknown option %s\n", a); attn_usage(); return 2; }
#undef INT
#undef OPT
    }
    if (c.threads <= 0)
        c.threads = bench_cpus();
    if (c.reps < 1)
        c.reps = 1;
    return c.bwd ? run_bwd_cfg(&c) : c.rotary ? run_rotary_cfg(&c) : run_cfg(&c);
}

/* The plain baseline's rows in `flywheel run`: 64 query rows (at T = 4K the default 256 took
 * 10-40 s a row on a 2-core machine; the full-length baselines stay in `flywheel bench attn`). */
#define HEADLINE_BASE_ROWS 64

/* The headline set of `flywheel run` / `make run`: the forward at T = 1K and 4K (bf16 and f32,
 * GQA 32:8 d128; d256; one thread) with the plain baseline on the last HEADLINE_BASE_ROWS rows,
 * and the backward at 4K; each checked against float64. T = 16K and the full-length baselines
 * are `flywheel bench attn` runs (the text output names them). json: one object a row. */
int bench_attn_headline(int json, int small)
{
    const int all = bench_cpus();
    if (!json) {
        printf("FlyWheel-C main job: softmax attention forward, causal prefill (bottom-right), "
               "kernel table %s, %d thread(s)\n", fw_isa_default(), all);
        printf("GFLOP/s = 2*(d+dv)*unmasked_pairs/s; xbf16 = bf16 products (the default for bf16 "
               "inputs on amx, and on avx512bf16 on AMD), %% of the measured bf16-product peak of the table; "
               "xf32 = f32 products, %% of the measured FMA peak (same run); plain = row-at-a-time online "
               "softmax, f32, timed on the last %d query rows (same run); err = max|out-ref| on the last 32 "
               "rows vs float64 (bf16 products: bar = 2 x the same-roundings reference's error)\n",
               HEADLINE_BASE_ROWS);
        fflush(stdout);
    }
    static const struct { int64_t t, hq, hkv, d; fw_dtype dt; int threads; } set[] = {
        {1024, 32, 8, 128, FW_BF16, 0}, {4096, 32, 8, 128, FW_BF16, 0},
        {1024, 32, 8, 128, FW_F32, 0}, {4096, 32, 8, 128, FW_F32, 0},
        {4096, 16, 16, 256, FW_BF16, 0}, {4096, 32, 8, 128, FW_BF16, 1},
    };
    int fail = 0;
    for (size_t i = 0; i < sizeof set / sizeof set[0]; i++) {
        cfg c = defaults();
        c.sq = c.sk = small ? set[i].t / 16 : set[i].t;
        c.hq = small ? set[i].hq / 4 : set[i].hq;
        c.hkv = small ? set[i].hkv / 4 : set[i].hkv;
        c.d = c.dv = set[i].d; c.dt = set[i].dt;
        c.reps = small ? 1 : c.reps;
        c.threads = set[i].threads ? set[i].threads : all;
        c.base_rows = HEADLINE_BASE_ROWS;
        c.check = 1;
        c.json = json;
        fail |= run_cfg(&c);
    }
    if (!json)
        printf("backward: GFLOP/s = 5*(d+dv)*unmasked_pairs/s (2.5 x the forward's); err = max over dq, dk, "
               "dv of the last 32 rows as their own problem vs float64 (bar: 2 x plain's, or for bf16 "
               "products 2 x the same-roundings reference's)\n");
    for (int i = 0; i < 2; i++) {
        cfg c = defaults();
        c.dt = i ? FW_F32 : FW_BF16;
        c.threads = all;
        c.reps = small ? 1 : 3;
        if (small) {
            c.sq = c.sk = 256;
            c.hq /= 4;
            c.hkv /= 4;
        }
        c.baseline = 0;
        c.check = 1;
        c.json = json;
        fail |= run_bwd_cfg(&c);
    }
    if (!json)
        printf("T=16K and the baselines on their default rows (clamp(T/16, 64, 256)): flywheel bench attn --t 16384 "
               "--check --reps 3 [--dtype f32]; forward --t 4096 --check [--dtype f32 | --hq 16 --hkv 16 --d 256 | "
               "--threads 1]; backward --bwd --check --reps 3 [--dtype f32]\n");
    return fail;
}
