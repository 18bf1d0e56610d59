/*
 * test_attn.c: softmax attention against the float64 reference, on every kernel table the
 * host runs: shapes, GQA ratios, head dims, dtypes, masks, softcap, varlen, strides, guard
 * bytes, NaN/inf, forced overflow replay, thread-count invariance, bad input.
 * Every case runs in both product precisions. Accuracy bar against the exact float64
 * reference: f32 products: max |kernel - ref| <= 2 * max |plain - ref| + 1e-5, where plain is
 * the row-at-a-time online-softmax kernel in f32 (FW_ATTN_PLAIN); bf16 products: <= 2 * the
 * error of the same-roundings float64 reference (q, k, v rounded to bf16, P rounded to bf16
 * before PV, output rounded to its dtype) + 1e-5. lse: the same with + 1e-4; for bf16
 * products 2 * (same-roundings + plain) + 1e-4, since both precisions sum the scores in f32
 * and the float64 same-roundings reference does not.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "attn/attn.h"
#include "internal.h"
#include "test_util.h"

typedef struct {
    int64_t b, sq, sk, hq, hkv, d, dv;
    fw_dtype dt, odt;
    int causal;
    int64_t wl, wr;
    float softcap, scale;
    int layout; /* 0: contiguous; 1: strided views (packed qkv when sq == sk); 2: dim stride 2 */
    int sinks;  /* 1: attention sinks (in q's dtype, stride 2), see problem_make */
} shape;

typedef struct {
    shape s;
    gbuf in, out, lse, snk;
    fw_tensor q, k, v, o, l, sinks;
} problem;

/* The sinks of a problem that has them, else NULL (for fw_attn_params.sinks). */
static const fw_tensor *sinks_of(const problem *P) { return P->s.sinks ? &P->sinks : NULL; }

static const char *dtn(fw_dtype d) { return fw_dtype_name(d); }

static void describe(char *buf, size_t n, const shape *s)
{
    snprintf(buf, n, "b%lld sq%lld sk%lld h%lld:%lld d%lld dv%lld %s->%s%s w(%lld,%lld) cap%g L%d%s",
             (long long)s->b, (long long)s->sq, (long long)s->sk, (long long)s->hq,
             (long long)s->hkv, (long long)s->d, (long long)s->dv, dtn(s->dt), dtn(s->odt),
             s->causal ? " causal" : "", (long long)s->wl, (long long)s->wr, (double)s->softcap,
             s->layout, s->sinks ? " sinks" : "");
}

static void problem_make(problem *P, const shape *s, uint64_t seed)
{
    memset(P, 0, sizeof *P);
    P->s = *s;
    const int bshd[4] = {0, 1, 2, 3}, bhsd[4] = {0, 2, 1, 3};
    int64_t qs[4] = {s->b, s->sq, s->hq, s->d}, ks[4] = {s->b, s->sk, s->hkv, s->d},
            vs[4] = {s->b, s->sk, s->hkv, s->dv}, os[4] = {s->b, s->sq, s->hq, s->dv};
    size_t es = fw_dtype_size(s->dt), eo = fw_dtype_size(s->odt);
    int64_t eq, ek, ev, eout;
    if (s->layout == 1 && s->sq == s->sk) {
        /* q, k, v as views into one packed [b, s, hq*d + hkv*d + hkv*dv] buffer */
        int64_t row = s->hq * s->d + s->hkv * s->d + s->hkv * s->dv;
        P->in = gbuf_new((size_t)(s->b * s->sq * row + 1) * es);
        char *base = P->in.p;
        P->q = tview4(base, s->dt, qs, bshd, 0, 1, &eq);
        P->q.stride[1] = row; P->q.stride[0] = row * s->sq;
        P->k = P->q; P->k.data = base + (size_t)(s->hq * s->d) * es;
        P->k.shape[2] = s->hkv;
        P->v = P->k; P->v.data = base + (size_t)(s->hq * s->d + s->hkv * s->d) * es;
        P->v.shape[3] = s->dv;
        P->k.shape[1] = P->v.shape[1] = s->sk;
    } else {
        const int *perm = s->layout == 1 ? bhsd : bshd;
        int64_t pad = s->layout == 1 ? 3 : 0, st = s->layout == 2 ? 2 : 1;
        fw_tensor tq = tview4(NULL, s->dt, qs, perm, pad, st, &eq);
        fw_tensor tk = tview4(NULL, s->dt, ks, perm, pad, st, &ek);
        fw_tensor tv = tview4(NULL, s->dt, vs, perm, pad, st, &ev);
        P->in = gbuf_new((size_t)(eq + ek + ev + 1) * es);
        char *base = P->in.p;
        P->q = tq; P->q.data = base;
        P->k = tk; P->k.data = base + (size_t)eq * es;
        P->v = tv; P->v.data = base + (size_t)(eq + ek) * es;
    }
    {
        const int *perm = s->layout == 1 ? bhsd : bshd;
        fw_tensor to = tview4(NULL, s->odt, os, perm, s->layout ? 5 : 0, 1, &eout);
        P->out = gbuf_new((size_t)(eout + 1) * eo);
        P->o = to;
        P->o.data = P->out.p;
        int64_t ls[3] = {s->b, s->hq, s->sq};
        P->lse = gbuf_new((size_t)(s->b * s->hq * (s->sq + 2) + 1) * 4);
        P->l = fw_tensor_contiguous(P->lse.p, FW_F32, 3, ls);
        if (s->layout) { /* gaps between lse rows */
            P->l.stride[1] = s->sq + 2;
            P->l.stride[0] = s->hq * (s->sq + 2);
        }
    }
    rng_seed(seed);
    tfill_normal(&P->q, 1.0);
    tfill_normal(&P->k, 1.0);
    tfill_normal(&P->v, 1.0);
    if (s->sinks) {
        /* by head: a sink near the rows' lse, one that dominates it (out near 0), one far
         * below it, a random one; every value exact in each dtype */
        static const double V[4] = {3.0, 40.0, -30.0};
        P->snk = gbuf_new((size_t)(2 * s->hq) * es);
        P->sinks = fw_tensor_contiguous(P->snk.p, s->dt, 1, &s->hq);
        P->sinks.stride[0] = 2;
        for (int64_t h = 0; h < s->hq; h++)
            tset(&P->sinks, &h, h % 4 == 3 ? round_to(FW_BF16, 2.0 * rng_normal()) : V[h % 4]);
    }
}

static void problem_free(problem *P)
{
    gbuf_free(&P->in);
    gbuf_free(&P->out);
    gbuf_free(&P->lse);
    if (P->s.sinks)
        gbuf_free(&P->snk);
}

static void params_of(const shape *s, const fw_tensor *sinks, fw_attn_params *p, const char *isa,
                      int threads, uint32_t flags)
{
    fw_attn_params_init(p);
    p->sinks = sinks;
    p->causal = s->causal;
    p->window_left = s->wl;
    p->window_right = s->wr;
    p->softcap = s->softcap;
    p->scale = s->scale;
    p->isa = isa;
    p->threads = threads;
    p->flags = flags;
}

/* Output of a run, gathered as doubles in [b, sq, hq, dv] and [b, hq, sq] order. */
typedef struct {
    double *o, *l;
    int64_t no, nl;
} result;

static void result_free(result *r)
{
    free(r->o);
    free(r->l);
}

static result gather(const problem *P)
{
    result r;
    r.no = P->s.b * P->s.sq * P->s.hq * P->s.dv;
    r.nl = P->s.b * P->s.hq * P->s.sq;
    r.o = malloc((size_t)(r.no + 1) * sizeof(double));
    r.l = malloc((size_t)(r.nl + 1) * sizeof(double));
    int64_t idx[4] = {0}, n = 0;
    if (r.no)
        do r.o[n++] = tget(&P->o, idx); while (tnext(&P->o, idx));
    memset(idx, 0, sizeof idx);
    n = 0;
    if (r.nl)
        do r.l[n++] = tget(&P->l, idx); while (tnext(&P->l, idx));
    return r;
}

static fw_status run_kernel(problem *P, const char *isa, int threads, uint32_t flags, int prec)
{
    fw_attn_params p;
    params_of(&P->s, sinks_of(P), &p, isa, threads, flags);
    p.precision = prec;
    memset(P->out.p, 0xA5, P->out.bytes);
    memset(P->lse.p, 0xA5, P->lse.bytes);
    return fw_attn_fwd(&P->q, &P->k, &P->v, &P->o, &P->l, &p);
}

/* The reference for rows [r0, r1) (all if r1 <= 0), as doubles: exact (FW_PREC_F32), or with
 * the roundings of bf16 products (FW_PREC_BF16), then the output rounded to its dtype. */
static result reference(const problem *P, int64_t r0, int64_t r1, int prec)
{
    const shape *s = &P->s;
    int64_t os[4] = {s->b, s->sq, s->hq, s->dv}, ls[3] = {s->b, s->hq, s->sq};
    result r;
    r.no = s->b * s->sq * s->hq * s->dv;
    r.nl = s->b * s->hq * s->sq;
    r.o = calloc((size_t)r.no + 1, sizeof(double));
    r.l = calloc((size_t)r.nl + 1, sizeof(double));
    fw_tensor o = fw_tensor_contiguous(r.o, FW_F64, 4, os), l = fw_tensor_contiguous(r.l, FW_F64, 3, ls);
    fw_attn_params p;
    params_of(s, sinks_of(P), &p, NULL, 1, 0);
    p.precision = prec;
    fw_status st = fw_attn_ref(&P->q, &P->k, &P->v, &o, &l, &p, r0, r1 > 0 ? r1 : INT64_MAX);
    case_check(st == FW_OK, "reference failed: %s", fw_last_error());
    if (prec == FW_PREC_BF16)
        for (int64_t i = 0; i < r.no; i++)
            r.o[i] = round_to(s->odt, r.o[i]);
    return r;
}

/* The exact reference and the same-roundings one of bf16 products. */
typedef struct {
    result exact, sr;
} refs;

static refs references(const problem *P, int64_t r0, int64_t r1)
{
    refs R = {reference(P, r0, r1, FW_PREC_F32), reference(P, r0, r1, FW_PREC_BF16)};
    return R;
}

static void refs_free(refs *R)
{
    result_free(&R->exact);
    result_free(&R->sr);
}

static int row_in(int64_t row, int64_t r0, int64_t r1) { return row >= r0 && (r1 <= 0 || row < r1); }

/* max |x - ref| over rows [r0, r1) of out and lse; NaN counts as infinite error. */
static void max_err(const shape *s, const result *x, const result *ref, int64_t r0, int64_t r1,
                    double *eo, double *el)
{
    *eo = *el = 0;
    for (int64_t i = 0; i < x->no; i++) {
        int64_t row = (i / (s->hq * s->dv)) % s->sq;
        if (!row_in(row, r0, r1))
            continue;
        double e = fabs(x->o[i] - ref->o[i]);
        if (!(e <= *eo))
            *eo = isnan(e) ? INFINITY : e;
    }
    for (int64_t i = 0; i < x->nl; i++) {
        int64_t row = i % s->sq;
        if (!row_in(row, r0, r1))
            continue;
        double e = (isinf(ref->l[i]) && x->l[i] == ref->l[i]) ? 0 : fabs(x->l[i] - ref->l[i]);
        if (!(e <= *el))
            *el = isnan(e) ? INFINITY : e;
    }
}

/* Run plain, then the kernel in both product precisions on one table, and check them against
 * the exact reference with the bar of each precision. */
static void check_problem(problem *P, const char *isa, int threads, uint32_t flags, const refs *R,
                          int64_t r0, int64_t r1)
{
    fw_status st = run_kernel(P, isa, 1, FW_ATTN_PLAIN, FW_PREC_AUTO);
    case_check(st == FW_OK, "plain returned %s: %s", fw_status_string(st), fw_last_error());
    result pl = gather(P);
    double ep, elp, esr, elsr;
    max_err(&P->s, &pl, &R->exact, r0, r1, &ep, &elp);
    max_err(&P->s, &R->sr, &R->exact, r0, r1, &esr, &elsr);
    for (int prec = FW_PREC_F32; prec <= FW_PREC_BF16; prec++) {
        const char *pn = prec == FW_PREC_BF16 ? "bf16" : "f32";
        st = run_kernel(P, isa, threads, flags, prec);
        case_check(st == FW_OK, "kernel returned %s: %s", fw_status_string(st), fw_last_error());
        case_check(tuntouched(&P->out, &P->o), "out: bytes outside the view or guards written");
        case_check(tuntouched(&P->lse, &P->l), "lse: bytes outside the view or guards written");
        result k = gather(P);
        double ek, elk;
        max_err(&P->s, &k, &R->exact, r0, r1, &ek, &elk);
        /* the lse of bf16 products also carries the f32 accumulation of the scores, which the
         * float64 same-roundings reference has not: its bar adds plain's lse error */
        const double bo = prec == FW_PREC_BF16 ? esr : ep, bl = prec == FW_PREC_BF16 ? elsr + elp : elp;
        case_check(ek <= 2 * bo + 1e-5, "[%s %s products, flags %u] out error %.3g > 2 x %s %.3g + 1e-5",
                   isa, pn, flags, ek, prec == FW_PREC_BF16 ? "same-roundings" : "plain", bo);
        case_check(elk <= 2 * bl + 1e-4, "[%s %s products, flags %u] lse error %.3g > 2 x %s %.3g + 1e-4",
                   isa, pn, flags, elk, prec == FW_PREC_BF16 ? "same-roundings" : "plain", bl);
        for (int64_t i = 0; i < k.no; i++)
            if (!isfinite(k.o[i])) {
                case_check(0, "[%s %s] out[%lld] = %g is not finite", isa, pn, (long long)i, k.o[i]);
                break;
            }
        result_free(&k);
    }
    result_free(&pl);
}

/* The tables the tests run (test_table). */
static int ntables(void) { return fw_isa_count(); }
static const char *table(int i) { return test_table(fw_isa_name(i)) ? fw_isa_name(i) : NULL; }

static void run_shape(const shape *s, uint32_t flags, int threads)
{
    char name[256];
    describe(name, sizeof name, s);
    case_begin("attn %s flags %u threads %d", name, flags, threads);
    problem P;
    problem_make(&P, s, (uint64_t)(s->sq * 131 + s->sk * 7 + s->d + s->hq));
    /* reference on a slice of rows when the problem is big */
    double cost = (double)s->b * s->sq * s->sk * s->hq * (s->d + s->dv);
    int64_t r0 = 0, r1 = 0;
    if (cost > 4e7) {
        r0 = s->sq > 48 ? s->sq - 48 : 0;
        r1 = 0;
    }
    refs R = references(&P, r0, r1);
    for (int t = 0; t < ntables(); t++)
        if (table(t))
            check_problem(&P, table(t), threads, flags, &R, r0, r1);
    refs_free(&R);
    problem_free(&P);
    case_end();
}

static shape base_shape(void)
{
    shape s = {1, 64, 64, 4, 1, 64, 64, FW_F32, FW_F32, 0, -1, -1, 0.0f, 0.0f, 0, 0};
    return s;
}

/* ---------------------------------------------------------------- sweeps -- */

static void sweep_lengths(void)
{
    static const int64_t L[] = {1, 7, 63, 64, 65, 127, 300, 1000, 2048};
    static const int64_t R[][2] = {{1, 1}, {4, 1}, {8, 1}, {32, 8}, {7, 7}, {6, 2}, {16, 1}};
    static const int64_t D[][2] = {{32, 32}, {64, 64}, {80, 80}, {96, 96}, {128, 128}, {192, 128}, {256, 256}, {64, 32}};
    static const fw_dtype T[] = {FW_F32, FW_BF16, FW_F16};
    int n = 0;
    const int step = quick_mode() ? 5 : 1;
    for (int i = 0; i < 9; i++)
        for (int j = 0; j < 9; j++, n++) {
            if (n % step)
                continue;
            shape s = base_shape();
            s.sq = L[i];
            s.sk = L[j];
            const int64_t *r = R[n % 7], *d = D[(n / 2) % 8];
            s.hq = r[0]; s.hkv = r[1]; s.d = d[0]; s.dv = d[1];
            /* keep the big cases affordable for the reference */
            if (s.sq * s.sk > 200000 && s.hq > 8) { s.hq = 8; s.hkv = s.hkv > 1 ? 2 : 1; }
            s.dt = s.odt = T[n % 3];
            s.causal = (n % 4) != 1;
            if (n % 6 == 5) { s.wl = 37; s.wr = s.causal ? -1 : 11; }
            if (n % 10 == 3) s.softcap = 30.0f;
            s.layout = n % 3 == 2 ? 1 : 0;
            s.sinks = n % 4 == 2;
            run_shape(&s, 0, 2);
        }
}

static void sweep_ratios_dims(void)
{
    static const int64_t R[][2] = {{1, 1}, {4, 1}, {8, 1}, {32, 8}, {7, 7}, {6, 2}, {16, 1}};
    static const int64_t D[] = {32, 64, 80, 96, 128, 192, 256};
    for (int r = 0; r < 7; r++) {
        shape s = base_shape();
        s.sq = 100; s.sk = 150; s.hq = R[r][0]; s.hkv = R[r][1]; s.causal = 1;
        s.dt = s.odt = FW_BF16;
        run_shape(&s, 0, 2);
    }
    for (int i = 0; i < 7; i += quick_mode() ? 3 : 1)
        for (int t = 0; t < 3; t++) {
            shape s = base_shape();
            s.sq = 70; s.sk = 130; s.hq = 4; s.hkv = 2; s.d = D[i]; s.dv = D[(i + 3) % 7];
            s.dt = s.odt = (fw_dtype)t;
            s.causal = t != 1;
            run_shape(&s, 0, 1);
        }
}

static void sweep_masks(void)
{
    static const int64_t W[][2] = {{-1, -1}, {0, 0}, {5, -1}, {-1, 5}, {64, 0}, {100, 100}, {1, 70}};
    for (int w = 0; w < 7; w++)
        for (int c = 0; c < 2; c++) {
            shape s = base_shape();
            s.sq = 150; s.sk = 200; s.hq = 6; s.hkv = 2;
            s.causal = c; s.wl = W[w][0]; s.wr = W[w][1];
            s.softcap = w % 2 ? 20.0f : 0.0f;
            s.dt = s.odt = (fw_dtype)(w % 3);
            s.sinks = (w + c) % 2;
            run_shape(&s, 0, 2);
        }
    /* sq > sk with causal: the first rows see nothing (out 0, lse -inf) */
    shape s = base_shape();
    s.sq = 130; s.sk = 40; s.causal = 1;
    run_shape(&s, 0, 2);
    s.sinks = 1; /* with sinks: out 0, lse = the sink */
    run_shape(&s, 0, 2);
    s.sinks = 0;
    s.sk = 0; /* no keys at all */
    run_shape(&s, 0, 1);
    s.causal = 0; s.sq = 0; s.sk = 10; /* no queries */
    run_shape(&s, 0, 1);
}

static void sweep_layouts_dtypes(void)
{
    for (int lay = 0; lay < 3; lay++)
        for (int t = 0; t < 3; t++)
            for (int ot = 0; ot < 3; ot++) {
                if (quick_mode() && ot != t)
                    continue;
                shape s = base_shape();
                s.b = 2; s.sq = 65; s.sk = lay == 1 ? 65 : 90; s.hq = 4; s.hkv = 2;
                s.d = 64; s.dv = lay == 1 ? 48 : 64;
                s.dt = (fw_dtype)t; s.odt = (fw_dtype)ot; s.layout = lay; s.causal = 1;
                s.sinks = (lay + t) % 2;
                run_shape(&s, 0, 2);
            }
}

static void sweep_techniques(void)
{
    /* decode-shaped calls (the decode kernel) under each switch */
    static const uint32_t D[] = {0, FW_ATTN_ONLINE_SOFTMAX, FW_ATTN_NO_GQA_PACK, FW_ATTN_NO_TILE_SKIP};
    for (int f = 0; f < 4; f++) {
        shape s = base_shape();
        s.sq = 3; s.sk = 2500; s.hq = 8; s.hkv = 2; s.causal = 1; s.wl = f == 3 ? 700 : -1;
        s.softcap = f == 2 ? 25.0f : 0.0f;
        s.dt = s.odt = FW_BF16;
        s.sinks = f % 2;
        run_shape(&s, D[f], 2);
    }
    static const uint32_t F[] = {FW_ATTN_ONLINE_SOFTMAX, FW_ATTN_NO_GQA_PACK, FW_ATTN_NO_TILE_SKIP,
                                 FW_ATTN_ONLINE_SOFTMAX | FW_ATTN_NO_TILE_SKIP};
    for (int f = 0; f < 4; f++)
        for (int c = 0; c < 2; c++) {
            shape s = base_shape();
            s.sq = 200; s.sk = 260; s.hq = 8; s.hkv = 2; s.causal = c;
            s.wl = c ? 90 : -1; s.softcap = c ? 0.0f : 25.0f;
            s.dt = s.odt = FW_BF16;
            s.sinks = c;
            run_shape(&s, F[f], 2);
        }
}

/* Keys scaled x40 after the first tile: logits near 1e4 overflow exp2 against the first
 * tile's anchor, so the bound check must catch it and replay exactly. */
static void test_overflow_replay(void)
{
    for (int t = 0; t < 3; t++) {
        shape s = base_shape();
        s.sq = 96; s.sk = 300; s.hq = 4; s.hkv = 2; s.d = 64; s.dv = 64;
        s.dt = s.odt = (fw_dtype)t;
        s.causal = t == 1;
        char name[256];
        describe(name, sizeof name, &s);
        case_begin("overflow replay %s", name);
        problem P;
        problem_make(&P, &s, 77 + t);
        int64_t idx[4] = {0};
        do { /* q: positive, aligned; keys: x40 past key 64 */
            tset(&P.q, idx, 25.0 + 2.0 * fabs(tget(&P.q, idx)));
        } while (tnext(&P.q, idx));
        memset(idx, 0, sizeof idx);
        do {
            double x = 1.0 + 0.25 * fabs(tget(&P.k, idx));
            tset(&P.k, idx, idx[1] >= 64 ? 40.0 * x : x);
        } while (tnext(&P.k, idx));
        refs R = references(&P, 0, 0);
        double maxlse = 0;
        for (int64_t i = 0; i < R.exact.nl; i++)
            maxlse = fmax(maxlse, R.exact.l[i]);
        case_check(maxlse > 5e3, "the test's logits only reach %g", maxlse);
        for (int i = 0; i < ntables(); i++)
            if (table(i)) {
                check_problem(&P, table(i), 2, 0, &R, 0, 0);
                check_problem(&P, table(i), 2, FW_ATTN_ONLINE_SOFTMAX, &R, 0, 0);
            }
        refs_free(&R);
        problem_free(&P);
        case_end();
    }
}

static void test_threads_identical(void)
{
    for (int i = 0; i < ntables(); i++) {
        if (!table(i))
            continue;
        for (int c = 0; c < 4; c++) {
            const int prec = c < 2 ? FW_PREC_BF16 : FW_PREC_F32;
            shape s = base_shape();
            s.b = 2; s.sq = 333; s.sk = 400; s.hq = 12; s.hkv = 4; s.d = 80; s.dv = 96;
            s.causal = c & 1; s.dt = s.odt = FW_BF16; s.wl = c & 1 ? -1 : 100;
            s.sinks = c == 1 || c == 2;
            case_begin("threads 1/2/3 bit-identical [%s] causal %d, %s products", table(i), c & 1,
                       prec == FW_PREC_BF16 ? "bf16" : "f32");
            problem P;
            problem_make(&P, &s, 5);
            size_t n = P.out.bytes, nl = P.lse.bytes;
            unsigned char *first = malloc(n), *firstl = malloc(nl);
            for (int th = 1; th <= 3; th++) {
                fw_status st = run_kernel(&P, table(i), th, 0, prec);
                case_check(st == FW_OK, "status %d", st);
                if (th == 1) {
                    memcpy(first, P.out.p, n);
                    memcpy(firstl, P.lse.p, nl);
                } else {
                    case_check(memcmp(first, P.out.p, n) == 0, "out differs at %d threads", th);
                    case_check(memcmp(firstl, P.lse.p, nl) == 0, "lse differs at %d threads", th);
                }
            }
            free(first);
            free(firstl);
            problem_free(&P);
            case_end();
        }
    }
}

/* Several application threads calling at once, repeatedly and with 2 or 3 threads each (so
 * the worker pool is handed between callers, grows, and is found in use), get the bits of a
 * lone call. */
typedef struct {
    problem *P;
    const char *isa;
    fw_status st;
    unsigned char *out;
} conc_arg;

static void *conc_main(void *x)
{
    conc_arg *a = x;
    problem *P = a->P;
    int64_t os[4] = {P->s.b, P->s.sq, P->s.hq, P->s.dv};
    fw_tensor o = fw_tensor_contiguous(a->out, P->s.odt, 4, os);
    a->st = FW_OK;
    for (int r = 0; r < 6 && a->st == FW_OK; r++) {
        fw_attn_params p;
        params_of(&P->s, sinks_of(P), &p, a->isa, 2 + r % 2, 0);
        a->st = fw_attn_fwd(&P->q, &P->k, &P->v, &o, NULL, &p);
    }
    return NULL;
}

/* FW_PREC_AUTO: bf16 products for bf16 q only on a table with a native bf16 dot product
 * (fw_isa_native_bf16), f32 products elsewhere and for other dtypes: the same bits as the
 * precision it resolves to, on every table the host runs. */
static void test_auto_precision(void)
{
    case_begin("fw_isa_native_bf16");
    case_check(!fw_isa_native_bf16("portable") && !fw_isa_native_bf16("avx2") &&
                   !fw_isa_native_bf16("avx512") && !fw_isa_native_bf16("neon") &&
                   !fw_isa_native_bf16("no-such-table"),
               "a table without a bf16 dot product, or no table, reports a native one");
#if defined(__aarch64__)
    const int dot = 1; /* BFDOT: native wherever neon_bf16 runs */
#else
    const int dot = fw_bf16_dot_native(fw_cpu_vendor());
#endif
    case_check(fw_isa_native_bf16("neon_bf16") == (fw_isa_supported("neon_bf16") && dot),
               "neon_bf16: %d, supported %d", fw_isa_native_bf16("neon_bf16"), fw_isa_supported("neon_bf16"));
    case_check(fw_isa_native_bf16("avx512bf16") == (fw_isa_supported("avx512bf16") && dot),
               "avx512bf16: %d, supported %d, vendor %s", fw_isa_native_bf16("avx512bf16"),
               fw_isa_supported("avx512bf16"), fw_cpu_vendor());
    case_check(fw_isa_native_bf16("amx") == fw_isa_supported("amx"), "amx: %d, supported %d",
               fw_isa_native_bf16("amx"), fw_isa_supported("amx"));
    case_check(fw_isa_native_bf16(NULL) == fw_isa_native_bf16(fw_isa_default()), "the default table");
    case_end();
    /* vdpbf16ps counts as native by vendor: twice the FMA rate on AMD, half on Intel */
    case_begin("fw_bf16_dot_native");
    case_check(fw_bf16_dot_native("AuthenticAMD"), "AMD");
    case_check(!fw_bf16_dot_native("GenuineIntel"), "Intel");
    case_check(!fw_bf16_dot_native("") && !fw_bf16_dot_native(NULL) && !fw_bf16_dot_native("AuthenticAMDx") &&
                   !fw_bf16_dot_native("HygonGenuine"),
               "no vendor, a longer string, another vendor");
#if defined(__x86_64__)
    case_check(strlen(fw_cpu_vendor()) == 12, "x86 vendor \"%s\" is not 12 characters", fw_cpu_vendor());
#else
    case_check(fw_cpu_vendor()[0] == 0, "vendor \"%s\" off x86", fw_cpu_vendor());
#endif
    case_end();
    /* the decode's prefetch default: off on Intel only */
    case_begin("fw_dec_prefetch");
    case_check(!fw_dec_prefetch("GenuineIntel"), "Intel");
    case_check(fw_dec_prefetch("AuthenticAMD") && fw_dec_prefetch("HygonGenuine") && fw_dec_prefetch("") &&
                   fw_dec_prefetch(NULL) && fw_dec_prefetch("GenuineIntelx"),
               "AMD, another vendor, none, a longer string");
    case_end();
    /* the AMX decode's next-head key-row prefetch: tiles, bf16 rows in place, 2 KiB a token */
    case_begin("fw_dec_fetch_krows");
    case_check(fw_dec_fetch_krows(FW_BF16_TILES, 1, 2048, 0) && fw_dec_fetch_krows(FW_BF16_TILES, 1, 4096, FW_ATTN_DEC_PREFETCH),
               "AMX, bf16 rows, 2 and 4 KiB a token");
    case_check(!fw_dec_fetch_krows(FW_BF16_TILES, 1, 1024, 0) && !fw_dec_fetch_krows(FW_BF16_TILES, 1, 2047, 0),
               "under 2 KiB a token");
    case_check(!fw_dec_fetch_krows(FW_BF16_DOT, 1, 2048, 0) && !fw_dec_fetch_krows(FW_BF16_EMULATED, 1, 4096, 0) &&
                   !fw_dec_fetch_krows(FW_BF16_TILES, 0, 2048, 0),
               "vdpbf16ps or emulated products, keys not bf16 rows");
    case_check(!fw_dec_fetch_krows(FW_BF16_TILES, 1, 2048, FW_ATTN_NO_DEC_PREFETCH), "FW_ATTN_NO_DEC_PREFETCH");
    case_end();
    const fw_dtype dts[2] = {FW_BF16, FW_F32};
    for (int it = 0; it < fw_isa_count(); it++) {
        const char *isa = table(it);
        if (!isa)
            continue;
        for (int di = 0; di < 2; di++) {
            shape s = base_shape();
            s.sq = 70; s.sk = 90; s.hq = 4; s.hkv = 2; s.causal = 1; s.dt = s.odt = dts[di];
            problem P;
            problem_make(&P, &s, 31 + (uint64_t)di);
            const int want = dts[di] == FW_BF16 && fw_isa_native_bf16(isa) ? FW_PREC_BF16 : FW_PREC_F32;
            case_begin("auto precision [%s] %s: %s products", isa, dtn(s.dt), want == FW_PREC_BF16 ? "bf16" : "f32");
            size_t n = P.out.bytes;
            char *ref = malloc(n);
            fw_status st = run_kernel(&P, isa, 2, 0, want);
            memcpy(ref, P.out.p, n);
            fw_status sa = run_kernel(&P, isa, 2, 0, FW_PREC_AUTO);
            case_check(st == FW_OK && sa == FW_OK, "status %d / %d", st, sa);
            case_check(memcmp(ref, P.out.p, n) == 0, "FW_PREC_AUTO differs from the precision it resolves to");
            fw_status so = run_kernel(&P, isa, 2, 0, want == FW_PREC_BF16 ? FW_PREC_F32 : FW_PREC_BF16);
            case_check(so == FW_OK && memcmp(ref, P.out.p, n) != 0, "the other precision gives the same bits");
            free(ref);
            problem_free(&P);
            case_end();
        }
    }
}

static void test_concurrent_callers(void)
{
    shape s = base_shape();
    s.sq = 200; s.sk = 200; s.hq = 8; s.hkv = 2; s.causal = 1;
    problem P;
    problem_make(&P, &s, 9);
    const char *isa = fw_isa_default();
    case_begin("4 concurrent callers [%s]", isa);
    size_t n = (size_t)(s.b * s.sq * s.hq * s.dv) * 4;
    conc_arg a[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        a[i].P = &P; a[i].isa = isa; a[i].out = malloc(n);
        pthread_create(&th[i], NULL, conc_main, &a[i]);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++) {
        case_check(a[i].st == FW_OK, "caller %d: status %d", i, a[i].st);
        case_check(memcmp(a[0].out, a[i].out, n) == 0, "caller %d differs", i);
    }
    for (int i = 0; i < 4; i++)
        free(a[i].out);
    problem_free(&P);
    case_end();
}

/* A child forked after the worker pool exists (a server forking workers) gets a pool of its
 * own: its threaded calls finish and give the parent's bits. */
static void test_fork_child(void)
{
    shape s = base_shape();
    s.sq = 150; s.sk = 150; s.hq = 8; s.hkv = 2; s.causal = 1;
    problem P;
    problem_make(&P, &s, 10);
    case_begin("threaded calls in a forked child");
    fw_attn_params p;
    params_of(&s, NULL, &p, NULL, 2, 0);
    size_t n = (size_t)(s.b * s.sq * s.hq * s.dv) * 4;
    unsigned char *want = malloc(n);
    int64_t os[4] = {s.b, s.sq, s.hq, s.dv};
    fw_tensor o = fw_tensor_contiguous(want, s.odt, 4, os);
    fw_status st = fw_attn_fwd(&P.q, &P.k, &P.v, &o, NULL, &p); /* starts the pool */
    case_check(st == FW_OK, "parent call: status %d", st);
    pid_t pid = fork();
    if (pid == 0) {
        unsigned char *got = malloc(n);
        fw_tensor og = fw_tensor_contiguous(got, s.odt, 4, os);
        int bad = 0;
        for (int r = 0; r < 3; r++)
            bad |= fw_attn_fwd(&P.q, &P.k, &P.v, &og, NULL, &p) != FW_OK || memcmp(got, want, n);
        _exit(bad);
    }
    int status = -1;
    case_check(pid > 0 && waitpid(pid, &status, 0) == pid, "fork/waitpid failed");
    case_check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child: status %d", status);
    free(want);
    problem_free(&P);
    case_end();
}

/* Caller workspace: the same bits as internal allocation; too small is refused. Both product
 * precisions (the bf16 panels make the workspace larger). */
static void test_workspace(void)
{
    for (int prec = FW_PREC_F32; prec <= FW_PREC_BF16; prec++) {
        shape s = base_shape();
        s.sq = 100; s.sk = 120; s.hq = 8; s.hkv = 2; s.causal = 1;
        problem P;
        problem_make(&P, &s, 11);
        case_begin("caller workspace, %s products", prec == FW_PREC_BF16 ? "bf16" : "f32");
        fw_attn_params p;
        params_of(&s, NULL, &p, NULL, 2, 0);
        p.precision = prec;
        size_t bytes = 0;
        fw_status st = fw_attn_workspace_size(&P.q, &P.k, &P.v, &p, &bytes);
        case_check(st == FW_OK && bytes > 0, "workspace size: %d %zu", st, bytes);
        case_check(bytes < (size_t)64 << 20, "workspace %zu bytes is not small", bytes);
        run_kernel(&P, NULL, 2, 0, prec);
        unsigned char *ref = malloc(P.out.bytes);
        memcpy(ref, P.out.p, P.out.bytes);
        gbuf ws = gbuf_new(bytes);
        p.workspace = ws.p;
        p.workspace_bytes = bytes;
        memset(P.out.p, 0xA5, P.out.bytes);
        st = fw_attn_fwd(&P.q, &P.k, &P.v, &P.o, &P.l, &p);
        case_check(st == FW_OK, "with workspace: %s", fw_last_error());
        case_check(memcmp(ref, P.out.p, P.out.bytes) == 0, "workspace run differs");
        case_check(gbuf_guards_ok(&ws), "workspace guards overwritten");
        p.workspace_bytes = bytes - 1;
        memset(P.out.p, 0xA5, P.out.bytes);
        st = fw_attn_fwd(&P.q, &P.k, &P.v, &P.o, &P.l, &p);
        case_check(st == FW_ERR_WORKSPACE && strstr(fw_last_error(), "workspace"),
                   "small workspace: %d %s", st, fw_last_error());
        int clean = 1;
        for (size_t i = 0; i < P.out.bytes; i++)
            clean &= ((unsigned char *)P.out.p)[i] == 0xA5;
        case_check(clean, "out written although the workspace was refused");
        gbuf_free(&ws);
        free(ref);
        problem_free(&P);
        case_end();
    }
}

/* ------------------------------------------------------------------ varlen -- */

static void test_varlen(void)
{
    static const int32_t lq[] = {5, 0, 70, 1, 130, 64, 0};
    static const int32_t lk[] = {9, 3, 70, 200, 0, 64, 0};
    const int B = 7;
    for (int c = 0; c < 3; c++)
        for (int t = 0; t < 3; t++) {
            case_begin("varlen causal %d dtype %s", c == 1, dtn((fw_dtype)t));
            int32_t cuq[8] = {0}, cuk[8] = {0};
            for (int i = 0; i < B; i++) {
                cuq[i + 1] = cuq[i] + lq[i];
                cuk[i + 1] = cuk[i] + lk[i];
            }
            const int64_t hq = 6, hkv = 2, d = 48, dv = 40, tq = cuq[B], tk = cuk[B];
            fw_dtype dt = (fw_dtype)t;
            int64_t qs[3] = {tq, hq, d}, ks[3] = {tk, hkv, d}, vs[3] = {tk, hkv, dv},
                    os[3] = {tq, hq, dv}, ls[2] = {hq, tq};
            size_t es = fw_dtype_size(dt);
            gbuf bq = gbuf_new((size_t)(tq * hq * d) * es), bk = gbuf_new((size_t)(tk * hkv * d) * es),
                 bv = gbuf_new((size_t)(tk * hkv * dv) * es), bo = gbuf_new((size_t)(tq * hq * dv) * es),
                 bl = gbuf_new((size_t)(hq * tq) * 4);
            fw_tensor q = fw_tensor_contiguous(bq.p, dt, 3, qs), k = fw_tensor_contiguous(bk.p, dt, 3, ks),
                      v = fw_tensor_contiguous(bv.p, dt, 3, vs), o = fw_tensor_contiguous(bo.p, dt, 3, os),
                      l = fw_tensor_contiguous(bl.p, FW_F32, 2, ls);
            rng_seed(100 + c * 3 + t);
            tfill_normal(&q, 1); tfill_normal(&k, 1); tfill_normal(&v, 1);
            double *ro = calloc((size_t)(tq * hq * dv) + 1, 8), *rl = calloc((size_t)(hq * tq) + 1, 8);
            fw_tensor fo = fw_tensor_contiguous(ro, FW_F64, 3, os), fl = fw_tensor_contiguous(rl, FW_F64, 2, ls);
            fw_attn_params p;
            fw_attn_params_init(&p);
            p.causal = c == 1;
            if (c == 2) { p.window_left = 10; p.window_right = 3; p.softcap = 15; }
            p.precision = FW_PREC_F32;
            fw_status st = fw_attn_varlen_ref(&q, &k, &v, cuq, cuk, B, &fo, &fl, &p, 0, INT64_MAX);
            case_check(st == FW_OK, "ref: %s", fw_last_error());
            /* the same-roundings reference of bf16 products, and its error */
            double *so_ = calloc((size_t)(tq * hq * dv) + 1, 8), *sl_ = calloc((size_t)(hq * tq) + 1, 8);
            fw_tensor sfo = fw_tensor_contiguous(so_, FW_F64, 3, os), sfl = fw_tensor_contiguous(sl_, FW_F64, 2, ls);
            p.precision = FW_PREC_BF16;
            st = fw_attn_varlen_ref(&q, &k, &v, cuq, cuk, B, &sfo, &sfl, &p, 0, INT64_MAX);
            case_check(st == FW_OK, "same-roundings ref: %s", fw_last_error());
            double sre, srl;
            sr_errors(so_, sl_, ro, rl, tq * hq * dv, tq * hq, dt, &sre, &srl);
            free(so_);
            free(sl_);
            p.precision = FW_PREC_F32;
            /* the varlen reference equals the dense reference of each sequence on its own */
            for (int i = 0; i < B; i++) {
                int64_t q1[4] = {1, lq[i], hq, d}, k1[4] = {1, lk[i], hkv, d}, v1[4] = {1, lk[i], hkv, dv},
                        o1[4] = {1, lq[i], hq, dv}, l1[3] = {1, hq, lq[i]};
                fw_tensor sq_ = fw_tensor_contiguous((char *)bq.p + (size_t)(cuq[i] * hq * d) * es, dt, 4, q1);
                fw_tensor sk_ = fw_tensor_contiguous((char *)bk.p + (size_t)(cuk[i] * hkv * d) * es, dt, 4, k1);
                fw_tensor sv_ = fw_tensor_contiguous((char *)bv.p + (size_t)(cuk[i] * hkv * dv) * es, dt, 4, v1);
                double *so = calloc((size_t)(lq[i] * hq * dv) + 1, 8), *sl = calloc((size_t)(hq * lq[i]) + 1, 8);
                fw_tensor to = fw_tensor_contiguous(so, FW_F64, 4, o1), tl = fw_tensor_contiguous(sl, FW_F64, 3, l1);
                st = fw_attn_ref(&sq_, &sk_, &sv_, &to, &tl, &p, 0, INT64_MAX);
                case_check(st == FW_OK, "dense ref of sequence %d: %s", i, fw_last_error());
                for (int64_t x = 0; x < lq[i] * hq * dv; x++)
                    case_check(so[x] == ro[cuq[i] * hq * dv + x], "varlen ref != dense ref, seq %d", i);
                for (int64_t h = 0; h < hq; h++)
                    for (int64_t r = 0; r < lq[i]; r++)
                        case_check(sl[h * lq[i] + r] == rl[h * tq + cuq[i] + r] ||
                                       (isinf(sl[h * lq[i] + r]) && isinf(rl[h * tq + cuq[i] + r])),
                                   "varlen lse != dense lse, seq %d", i);
                free(so);
                free(sl);
            }
            for (int it = 0; it < ntables(); it++) {
                if (!table(it))
                    continue;
                /* pass 0: f32 products, 1: plain, 2: bf16 products */
                double err[3][2];
                for (int pass = 0; pass < 3; pass++) {
                    p.isa = table(it);
                    p.flags = pass == 1 ? FW_ATTN_PLAIN : 0;
                    p.precision = pass == 2 ? FW_PREC_BF16 : FW_PREC_F32;
                    p.threads = 3;
                    memset(bo.p, 0xA5, bo.bytes);
                    memset(bl.p, 0xA5, bl.bytes);
                    st = fw_attn_varlen_fwd(&q, &k, &v, cuq, cuk, B, &o, &l, &p);
                    case_check(st == FW_OK, "varlen: %s", fw_last_error());
                    case_check(gbuf_guards_ok(&bo) && gbuf_guards_ok(&bl), "guards");
                    double eo = 0, el = 0;
                    int64_t idx[3] = {0};
                    do {
                        double e = fabs(tget(&o, idx) - ro[toffset(&fo, idx)]);
                        eo = e > eo || isnan(e) ? (isnan(e) ? INFINITY : e) : eo;
                    } while (tnext(&o, idx));
                    int64_t li[2] = {0};
                    do {
                        double a = tget(&l, li), b = rl[toffset(&fl, li)];
                        double e = (isinf(a) && a == b) ? 0 : fabs(a - b);
                        el = e > el || isnan(e) ? (isnan(e) ? INFINITY : e) : el;
                    } while (tnext(&l, li));
                    err[pass][0] = eo;
                    err[pass][1] = el;
                }
                case_check(err[0][0] <= 2 * err[1][0] + 1e-5, "[%s] varlen out error %.3g vs plain %.3g",
                           table(it), err[0][0], err[1][0]);
                case_check(err[0][1] <= 2 * err[1][1] + 1e-4, "[%s] varlen lse error %.3g vs plain %.3g",
                           table(it), err[0][1], err[1][1]);
                case_check(err[2][0] <= 2 * sre + 1e-5, "[%s] varlen bf16 products: out error %.3g vs "
                           "same-roundings %.3g", table(it), err[2][0], sre);
                case_check(err[2][1] <= 2 * (srl + err[1][1]) + 1e-4, "[%s] varlen bf16 products: lse "
                           "error %.3g vs same-roundings %.3g + plain %.3g", table(it), err[2][1], srl,
                           err[1][1]);
            }
            free(ro); free(rl);
            gbuf_free(&bq); gbuf_free(&bk); gbuf_free(&bv); gbuf_free(&bo); gbuf_free(&bl);
            case_end();
        }
}

/* --------------------------------------------------------------- bad input -- */

static void expect_bad(const char *what, fw_status got, fw_status want, const gbuf *out, const gbuf *lse)
{
    case_begin("bad input: %s", what);
    case_check(got == want, "status %s, expected %s (%s)", fw_status_string(got),
               fw_status_string(want), fw_last_error());
    case_check(strlen(fw_last_error()) > 10, "message \"%s\" is empty", fw_last_error());
    int clean = 1;
    for (size_t i = 0; i < out->bytes; i++)
        clean &= ((unsigned char *)out->p)[i] == 0xA5;
    for (size_t i = 0; i < lse->bytes; i++)
        clean &= ((unsigned char *)lse->p)[i] == 0xA5;
    case_check(clean && gbuf_guards_ok(out) && gbuf_guards_ok(lse), "output written on bad input");
    case_end();
}

static void test_bad_input(void)
{
    shape s = base_shape();
    s.b = 2; s.sq = 10; s.sk = 12; s.hq = 4; s.hkv = 2; s.d = 16; s.dv = 8;
    problem P;
    problem_make(&P, &s, 3);
    memset(P.out.p, 0xA5, P.out.bytes);
    memset(P.lse.p, 0xA5, P.lse.bytes);
    fw_attn_params p, p0;
    params_of(&s, NULL, &p0, NULL, 2, 0);
    fw_tensor q = P.q, k = P.k, v = P.v, o = P.o, l = P.l;
#define BAD(what, want, call) do { fw_tensor q_ = q, k_ = k, v_ = v, o_ = o, l_ = l; p = p0; \
        (void)q_; (void)k_; (void)v_; (void)o_; (void)l_; \
        { call; } expect_bad(what, fw_attn_fwd(&q_, &k_, &v_, &o_, &l_, &p), want, &P.out, &P.lse); \
    } while (0)
    expect_bad("null q", fw_attn_fwd(NULL, &k, &v, &o, &l, &p0), FW_ERR_NULL, &P.out, &P.lse);
    expect_bad("null out", fw_attn_fwd(&q, &k, &v, NULL, &l, &p0), FW_ERR_NULL, &P.out, &P.lse);
    BAD("null data", FW_ERR_NULL, q_.data = NULL);
    BAD("null out data", FW_ERR_NULL, o_.data = NULL);
    BAD("q rank 3", FW_ERR_SHAPE, q_.ndim = 3);
    BAD("f64 input", FW_ERR_DTYPE, q_.dtype = FW_F64);
    BAD("fp8 inputs (KV caches only)", FW_ERR_DTYPE, q_.dtype = k_.dtype = v_.dtype = FW_F8E4M3);
    BAD("fp8 out", FW_ERR_DTYPE, o_.dtype = FW_F8E5M2);
    BAD("bad dtype value", FW_ERR_DTYPE, o_.dtype = (fw_dtype)9);
    BAD("mixed dtypes", FW_ERR_DTYPE, k_.dtype = FW_BF16);
    BAD("lse f16", FW_ERR_DTYPE, l_.dtype = FW_F16);
    BAD("heads do not divide", FW_ERR_SHAPE, (k_.shape[2] = 3, v_.shape[2] = 3));
    BAD("k/v heads differ", FW_ERR_SHAPE, v_.shape[2] = 1);
    BAD("head dim mismatch", FW_ERR_SHAPE, k_.shape[3] = 8);
    BAD("out dv mismatch", FW_ERR_SHAPE, o_.shape[3] = 9);
    BAD("batch mismatch", FW_ERR_SHAPE, k_.shape[0] = 1);
    BAD("k/v lengths differ", FW_ERR_SHAPE, v_.shape[1] = 11);
    BAD("out rows mismatch", FW_ERR_SHAPE, o_.shape[1] = 9);
    BAD("lse shape", FW_ERR_SHAPE, l_.shape[2] = 3);
    BAD("negative size", FW_ERR_SHAPE, q_.shape[1] = -1);
    BAD("zero head dim", FW_ERR_SHAPE, (q_.shape[3] = 0, k_.shape[3] = 0));
    BAD("negative stride", FW_ERR_STRIDE, k_.stride[1] = -5);
    BAD("aliasing out", FW_ERR_STRIDE, o_.stride[1] = 0);
    BAD("aliasing lse", FW_ERR_STRIDE, l_.stride[2] = 0);
    BAD("overflowing strides", FW_ERR_OVERFLOW, q_.stride[0] = INT64_MAX / 2);
    BAD("overflowing sizes", FW_ERR_OVERFLOW, (k_.shape[1] = INT64_MAX / 4, k_.stride[1] = 8));
    BAD("nan scale", FW_ERR_ARG, p.scale = NAN);
    BAD("negative softcap", FW_ERR_ARG, p.softcap = -1);
    BAD("threads -1", FW_ERR_ARG, p.threads = -1);
    BAD("threads 1000", FW_ERR_ARG, p.threads = 1000);
    BAD("causal 2", FW_ERR_ARG, p.causal = 2);
    BAD("unknown flag", FW_ERR_ARG, p.flags = 1u << 20);
    BAD("prefetch on and off", FW_ERR_ARG, p.flags = FW_ATTN_DEC_PREFETCH | FW_ATTN_NO_DEC_PREFETCH);
    BAD("precision 3", FW_ERR_ARG, p.precision = 3);
    BAD("precision -1", FW_ERR_ARG, p.precision = -1);
    BAD("unknown table", FW_ERR_UNSUPPORTED, p.isa = "sve9");
    {
        float sv[16] = {0};
        const int64_t n = s.hq, n1 = s.hq + 1, two[2] = {1, s.hq};
        fw_tensor ts = fw_tensor_contiguous(sv, FW_F32, 1, &n), tl = fw_tensor_contiguous(sv, FW_F32, 1, &n1),
                  t2 = fw_tensor_contiguous(sv, FW_F32, 2, two), tf = ts, tn = ts;
        tf.dtype = FW_F64;
        tn.data = NULL;
        BAD("sinks: one more than the q heads", FW_ERR_SHAPE, p.sinks = &tl);
        BAD("sinks of rank 2", FW_ERR_SHAPE, p.sinks = &t2);
        BAD("sinks f64", FW_ERR_DTYPE, p.sinks = &tf);
        BAD("sinks' data NULL", FW_ERR_NULL, p.sinks = &tn);
        BAD("sinks (valid) with an f64 input", FW_ERR_DTYPE, (p.sinks = &ts, q_.dtype = FW_F64));
    }
    /* a known table this CPU cannot run (under tests/run_baseline.sh's qemu64: all but portable) */
    for (int i = 0; i < fw_isa_count(); i++) {
        const char *name = fw_isa_name(i);
        if (fw_isa_supported(name))
            continue;
        BAD("a table this CPU lacks", FW_ERR_UNSUPPORTED, p.isa = name);
        case_check(strstr(fw_last_error(), "needs instructions this CPU lacks") != NULL, "%s: \"%s\"", name,
                   fw_last_error());
        case_check(!fw_isa_native_bf16(name), "%s: a table this CPU lacks reports a native bf16 dot product", name);
    }
    /* varlen: lengths */
    {
        int64_t qs[3] = {10, 4, 16}, ks[3] = {12, 2, 16}, vs[3] = {12, 2, 8}, os[3] = {10, 4, 8};
        fw_tensor vq = fw_tensor_contiguous(P.q.data, P.q.dtype, 3, qs),
                  vk = fw_tensor_contiguous(P.k.data, P.k.dtype, 3, ks),
                  vv = fw_tensor_contiguous(P.v.data, P.v.dtype, 3, vs),
                  vo = fw_tensor_contiguous(P.o.data, P.o.dtype, 3, os);
        gbuf none = gbuf_new(0);
        int32_t good_q[3] = {0, 4, 10}, good_k[3] = {0, 5, 12};
        int32_t dec[3] = {0, 6, 4}, start[3] = {1, 4, 10}, end_q[3] = {0, 4, 9};
        p = p0;
        expect_bad("varlen: null cu_seqlens_q",
                   fw_attn_varlen_fwd(&vq, &vk, &vv, NULL, good_k, 2, &vo, NULL, &p), FW_ERR_NULL,
                   &P.out, &none);
        expect_bad("varlen: decreasing cu_seqlens_q",
                   fw_attn_varlen_fwd(&vq, &vk, &vv, dec, good_k, 2, &vo, NULL, &p), FW_ERR_SEQLENS,
                   &P.out, &none);
        expect_bad("varlen: cu_seqlens_k[0] != 0",
                   fw_attn_varlen_fwd(&vq, &vk, &vv, good_q, start, 2, &vo, NULL, &p), FW_ERR_SEQLENS,
                   &P.out, &none);
        expect_bad("varlen: cu_seqlens_q end != total",
                   fw_attn_varlen_fwd(&vq, &vk, &vv, end_q, good_k, 2, &vo, NULL, &p), FW_ERR_SEQLENS,
                   &P.out, &none);
        expect_bad("varlen: negative batch",
                   fw_attn_varlen_fwd(&vq, &vk, &vv, good_q, good_k, -1, &vo, NULL, &p), FW_ERR_ARG,
                   &P.out, &none);
        fw_tensor l2 = P.l;
        expect_bad("varlen: lse rank 3",
                   fw_attn_varlen_fwd(&vq, &vk, &vv, good_q, good_k, 2, &vo, &l2, &p), FW_ERR_SHAPE,
                   &P.out, &P.lse);
        p.workspace = P.in.p;
        p.workspace_bytes = 10;
        expect_bad("workspace too small",
                   fw_attn_varlen_fwd(&vq, &vk, &vv, good_q, good_k, 2, &vo, NULL, &p),
                   FW_ERR_WORKSPACE, &P.out, &none);
        gbuf_free(&none);
    }
    /* the reference validates the same way, and checks its row range */
    {
        fw_attn_params pr = p0;
        expect_bad("reference: k of rank 0",
                   fw_attn_ref(&q, &(fw_tensor){0}, &v, &o, &l, &pr, 0, 1), FW_ERR_SHAPE, &P.out, &P.lse);
        expect_bad("reference: negative row range", fw_attn_ref(&q, &k, &v, &o, &l, &pr, 5, 2),
                   FW_ERR_ARG, &P.out, &P.lse);
    }
#undef BAD
    case_begin("status strings and last error");
    for (int st = 0; st <= FW_ERR_INDEX; st++)
        case_check(strncmp(fw_status_string((fw_status)st), "FW_", 3) == 0, "status %d string", st);
    case_check(fw_attn_fwd(&q, &k, &v, &o, &l, &p0) == FW_OK && fw_last_error()[0] == 0,
               "a good call clears the message");
    case_end();
    problem_free(&P);
}

/* --------------------------------------------------- kernel table entries -- */

/* Decode scores S [R][FW_DEC_KEYS] against scale * sum_k q[r][k] K[j][k] in double, q rounded
 * to qdt and K given as f32 rows of d: the largest residual in units of its bound, scale x the
 * sum of |terms| x tol; *tail_zero: S is zero past nk. */
static double dec_scores_residual(const float *S, int R, int nk, int d, const float *Q, fw_dtype qdt,
                                  const float *Kf, double scale, double tol, int *tail_zero)
{
    double worst = 0;
    *tail_zero = 1;
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < nk; j++) {
            double x = 0, a = 0;
            for (int k = 0; k < d; k++) {
                const double t = round_to(qdt, Q[r * d + k]) * Kf[j * d + k];
                x += t;
                a += fabs(t);
            }
            worst = worse(worst, fabs(S[r * FW_DEC_KEYS + j] - scale * x) / (scale * a * tol + 1e-30));
        }
        for (int j = nk; j < FW_DEC_KEYS; j++)
            *tail_zero &= S[r * FW_DEC_KEYS + j] == 0.0f;
    }
    return worst;
}

/* The decode kernels that read key and value rows in place, against float64 sums: dec_qk_rows
 * (f32 products, contiguous rows of any dtype), dec_qk_rows_bf16 (bf16 rows), dec_pv_bf16 on
 * bf16 value rows (whose pairs come by unpacking, with O's columns permuted while in
 * registers: O starts from random values) over value widths that take every column path of
 * the table (blocks of 4 vectors, fewer, scalar columns), and S past nk cleared. */
static void check_dec_rows(const fw_kernels *kt, fw_dtype dt, const void *const *rows, int64_t kdim,
                           int nk, int d, int R)
{
    if (kdim != 1)
        return;
    const int dw = (d + 1) / 2, dv = kt->vl * (4 + 2 * (nk % 2)) + nk % 3;
    float *Q = malloc(sizeof(float) * (size_t)(R * d)), *S = malloc(sizeof(float) * (size_t)(R * FW_DEC_KEYS));
    float *Kf = malloc(sizeof(float) * (size_t)(nk * d)), *O = malloc(sizeof(float) * (size_t)(R * dv));
    float *O0 = malloc(sizeof(float) * (size_t)(R * dv));
    uint32_t *QW = malloc(sizeof(uint32_t) * (size_t)(R * dw)), PW[FW_DEC_ROWS * FW_DEC_KEYS / 2];
    uint16_t *V = malloc(sizeof(uint16_t) * (size_t)(nk * dv));
    for (int j = 0; j < nk; j++)
        kt->cvt.to_f32(rows[j], dt, 1, d, 1.0f, Kf + (size_t)j * d);
    for (int i = 0; i < R * d; i++)
        Q[i] = (float)rng_normal();
    for (int pass = 0; pass < 1 + (dt == FW_BF16); pass++) {
        const float scale = pass ? 0.375f : 1.0f;
        for (int i = 0; i < R * FW_DEC_KEYS; i++)
            S[i] = NAN;
        if (pass) {
            for (int r = 0; r < R; r++)
                kt->mm.pack_row_pairs(Q + (size_t)r * d, d, QW + (size_t)r * dw);
            kt->dec.qk_rows_bf16(R, nk, d, QW, rows, FW_BF16, scale, NULL, 0, S);
            float *S2 = malloc(sizeof(float) * (size_t)(R * FW_DEC_KEYS));
            const void *next[FW_DEC_KEYS];
            for (int j = 0; j < nk; j++)
                next[j] = rows[nk - 1 - j];
            kt->dec.qk_rows_bf16(R, nk, d, QW, rows, FW_BF16, scale, next, nk - nk % 3, S2);
            case_check(memcmp(S, S2, sizeof(float) * (size_t)(R * FW_DEC_KEYS)) == 0,
                       "dec_qk_rows_bf16 R %d nk %d d %d: prefetching the next tile changed S", R, nk, d);
            free(S2);
        } else {
            /* with the next tile's rows prefetched as these are read (here: the same rows,
             * in reverse, nk or fewer of them): the same bits as without */
            const void *next[FW_DEC_KEYS];
            const int nn = nk - nk % 3;
            for (int j = 0; j < nk; j++)
                next[j] = rows[nk - 1 - j];
            kt->dec.qk_rows(R, nk, d, Q, rows, dt, next, nn, S);
            float *S2 = malloc(sizeof(float) * (size_t)(R * FW_DEC_KEYS));
            kt->dec.qk_rows(R, nk, d, Q, rows, dt, NULL, 0, S2);
            case_check(memcmp(S, S2, sizeof(float) * (size_t)(R * FW_DEC_KEYS)) == 0,
                       "dec_qk_rows %s R %d nk %d d %d: prefetching the next tile changed S", dtn(dt), R, nk, d);
            free(S2);
        }
        int zero;
        const double worst = dec_scores_residual(S, R, nk, d, Q, pass ? FW_BF16 : FW_F32, Kf, scale,
                                                 1e-6 * (d + 1), &zero);
        case_check(worst <= 1 && zero, "%s %s R %d nk %d d %d: residual %.3g of bound, tail %s",
                   pass ? "dec_qk_rows_bf16" : "dec_qk_rows", dtn(dt), R, nk, d, worst, zero ? "zero" : "not zero");
    }
    /* dec_pv_bf16 on bf16 rows read in place */
    const void *vrows[FW_DEC_KEYS];
    for (int j = 0; j < nk; j++) {
        vrows[j] = V + (size_t)j * dv;
        for (int c = 0; c < dv; c++)
            V[j * dv + c] = fw_f32_to_bf16((float)rng_normal());
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < FW_DEC_KEYS; j++)
            S[r * FW_DEC_KEYS + j] = j < nk ? (float)rng_uniform() : 0.0f;
    for (int i = 0; i < R * dv; i++)
        O[i] = O0[i] = (float)rng_normal();
    {   /* with the next tile's value rows prefetched (here: these, reversed): the same bits */
        const void *next[FW_DEC_KEYS];
        float *O2 = malloc(sizeof(float) * (size_t)(R * dv));
        memcpy(O2, O0, sizeof(float) * (size_t)(R * dv));
        for (int j = 0; j < nk; j++)
            next[j] = vrows[nk - 1 - j];
        kt->dec.pv_bf16(R, nk, dv, S, vrows, FW_BF16, next, nk - nk % 2, PW, O2);
        kt->dec.pv_bf16(R, nk, dv, S, vrows, FW_BF16, NULL, 0, PW, O);
        case_check(memcmp(O, O2, sizeof(float) * (size_t)(R * dv)) == 0,
                   "dec_pv_bf16 R %d nk %d dv %d: prefetching the next tile changed O", R, nk, dv);
        /* and dec_pv (f32 products) on the same bf16 rows (AVX2's even / odd path) */
        float *O3 = malloc(sizeof(float) * (size_t)(R * dv));
        memcpy(O2, O0, sizeof(float) * (size_t)(R * dv));
        memcpy(O3, O0, sizeof(float) * (size_t)(R * dv));
        kt->dec.pv(R, nk, dv, S, vrows, FW_BF16, next, nk - nk % 2, O2);
        kt->dec.pv(R, nk, dv, S, vrows, FW_BF16, NULL, 0, O3);
        case_check(memcmp(O3, O2, sizeof(float) * (size_t)(R * dv)) == 0,
                   "dec_pv bf16 rows R %d nk %d dv %d: prefetching the next tile changed O", R, nk, dv);
        free(O2);
        free(O3);
    }
    double worst = 0;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < dv; c++) {
            double x = O0[r * dv + c], a = fabs(x);
            for (int j = 0; j < nk; j++) {
                const double t = (double)fw_bf16_to_f32(fw_f32_to_bf16(S[r * FW_DEC_KEYS + j])) *
                                 fw_bf16_to_f32(V[j * dv + c]);
                x += t;
                a += fabs(t);
            }
            worst = worse(worst, fabs(O[r * dv + c] - x) / (a * 1e-6 * (nk + 1) + 1e-30));
        }
    case_check(worst <= 1, "dec_pv_bf16 bf16 rows R %d nk %d dv %d: residual %.3g of bound", R, nk, dv, worst);
    free(Q); free(S); free(Kf); free(O); free(O0); free(QW); free(V);
}

/* The tiled bf16 products of every table (vdpbf16ps, its emulation, AMX tiles) against sums in
 * double of the same bf16 operands: qk_bf16 on key rows with unread words past dw (NaN), and
 * pv_bf16 on the table's own pack_vw panel, allocated at exactly panel_bytes (the packer
 * writes its padding: the panel starts as NaN). Ends of nk, dw, dv and M that are not whole
 * tiles included. A row's (qk) or a value column's (pv) result is the same bits when it is
 * computed alone, so nothing depends on which block of the tile it falls in. */
static double bf(uint32_t w, int odd) { return fw_bf16_to_f32((uint16_t)(odd ? w >> 16 : w)); }

static void bf16_products_case(const fw_kernels *kt, int nk, int d, int M, int dv)
{
    const int dw = (d + 1) / 2, ldkw = dw + 3, nw = (nk + 1) / 2;
    const float scale = 0.7f;
    uint32_t *K = malloc(sizeof(uint32_t) * (size_t)nk * ldkw), *QW = malloc(sizeof(uint32_t) * (size_t)dw * M);
    uint32_t *PW = malloc(sizeof(uint32_t) * (size_t)nw * M), *VT = malloc(kt->mm.panel_bytes(nk, dv));
    uint32_t *VT1 = malloc(kt->mm.panel_bytes(nk, 1));
    float *ST = malloc(sizeof(float) * (size_t)nk * M), *ST1 = malloc(sizeof(float) * (size_t)M);
    float *bias = malloc(sizeof(float) * (size_t)M), *X = malloc(sizeof(float) * (size_t)nk * dv);
    float *P = malloc(sizeof(float) * (size_t)nk * M), *X1 = malloc(sizeof(float) * (size_t)nk);
    float *OT = malloc(sizeof(float) * (size_t)dv * M), *O0 = malloc(sizeof(float) * (size_t)dv * M);
    float *OT1 = malloc(sizeof(float) * (size_t)M);
    for (int j = 0; j < nk; j++)
        for (int w = 0; w < ldkw; w++)
            K[j * ldkw + w] = w < dw ? (uint32_t)fw_f32_to_bf16((float)rng_normal()) |
                                           (uint32_t)(2 * w + 1 < d ? fw_f32_to_bf16((float)rng_normal()) : 0) << 16
                                     : 0x7fc07fc0u;
    for (int i = 0; i < dw * M; i++)
        QW[i] = (uint32_t)fw_f32_to_bf16((float)rng_normal()) | (uint32_t)fw_f32_to_bf16((float)rng_normal()) << 16;
    for (int m = 0; m < M; m++)
        bias[m] = (float)rng_normal();
    for (int i = 0; i < nk * dv; i++)
        X[i] = (float)rng_normal();
    for (int i = 0; i < nk * M; i++)
        P[i] = (float)rng_uniform();
    for (int i = 0; i < dv * M; i++)
        O0[i] = OT[i] = (float)rng_normal();
    for (int w = 0; w < nw; w++)
        kt->mm.pack_pairs(P + (size_t)2 * w * M, 2 * w + 1 < nk ? P + (size_t)(2 * w + 1) * M : NULL, M, PW + (size_t)w * M);
    memset(VT, 0xff, kt->mm.panel_bytes(nk, dv));
    /* bf16 rows pack to the bits of f32 rows of the same values */
    uint16_t *X16 = malloc(sizeof(uint16_t) * (size_t)nk * dv);
    float *Xr = malloc(sizeof(float) * (size_t)nk * dv);
    for (int i = 0; i < nk * dv; i++) {
        X16[i] = fw_f32_to_bf16(X[i]);
        Xr[i] = fw_bf16_to_f32(X16[i]);
    }
    kt->mm.pack_vw(X16, FW_BF16, nk, dv, VT);
    uint32_t *VT16 = malloc(kt->mm.panel_bytes(nk, dv));
    memcpy(VT16, VT, kt->mm.panel_bytes(nk, dv));
    memset(VT, 0xff, kt->mm.panel_bytes(nk, dv));
    kt->mm.pack_vw(Xr, FW_F32, nk, dv, VT);
    case_check(memcmp(VT16, VT, kt->mm.panel_bytes(nk, dv)) == 0, "pack_vw nk %d dv %d: bf16 rows pack to other bits "
               "than f32 rows of the same values", nk, dv);
    free(X16); free(Xr); free(VT16);
    memset(VT, 0xff, kt->mm.panel_bytes(nk, dv));
    kt->mm.pack_vw(X, FW_F32, nk, dv, VT);
    kt->mm.qk_bf16(nk, dw, M, K, ldkw, QW, scale, bias, ST);
    kt->mm.pv_bf16(nw, dv, M, VT, PW, OT);
    const double u = 1.0 / (1 << 23);
    double worst = 0;
    int same = 1;
    for (int j = 0; j < nk; j++) {
        kt->mm.qk_bf16(1, dw, M, K + (size_t)j * ldkw, ldkw, QW, scale, bias, ST1);
        for (int m = 0; m < M; m++) {
            double s = 0, a = 0;
            for (int w = 0; w < dw; w++)
                for (int h = 0; h < 2; h++) {
                    const double x = bf(K[j * ldkw + w], h) * bf(QW[w * M + m], h);
                    s += x;
                    a += fabs(x);
                }
            const double want = bias[m] + scale * s, bound = u * ((2 * dw + 4) * scale * a + 2 * fabs(bias[m])) + 1e-30;
            worst = worse(worst, fabs(ST[j * M + m] - want) / bound);
            same &= memcmp(&ST[j * M + m], &ST1[m], sizeof(float)) == 0;
        }
    }
    case_check(worst <= 1, "qk_bf16 nk %d d %d M %d: residual %.3g of bound", nk, d, M, worst);
    case_check(same, "qk_bf16 nk %d d %d M %d: a key row alone gives other bits", nk, d, M);
    worst = 0;
    for (int c = 0; c < dv; c++) {
        for (int j = 0; j < nk; j++)
            X1[j] = X[j * dv + c];
        kt->mm.pack_vw(X1, FW_F32, nk, 1, VT1);
        memcpy(OT1, O0 + (size_t)c * M, sizeof(float) * (size_t)M);
        kt->mm.pv_bf16(nw, 1, M, VT1, PW, OT1);
        for (int m = 0; m < M; m++) {
            double s = O0[c * M + m], a = fabs(s);
            for (int j = 0; j < nk; j++) {
                const double x = round_to(FW_BF16, X[j * dv + c]) * round_to(FW_BF16, P[j * M + m]);
                s += x;
                a += fabs(x);
            }
            worst = worse(worst, fabs(OT[c * M + m] - s) / (u * (nk + 4) * a + 1e-30));
            same &= memcmp(&OT[c * M + m], &OT1[m], sizeof(float)) == 0;
        }
    }
    case_check(worst <= 1, "pv_bf16 nk %d dv %d M %d: residual %.3g of bound", nk, dv, M, worst);
    case_check(same, "pv_bf16 nk %d dv %d M %d: a value column alone gives other bits", nk, dv, M);
    free(K); free(QW); free(PW); free(VT); free(VT1); free(ST); free(ST1); free(bias); free(X); free(P);
    free(X1); free(OT); free(O0); free(OT1);
}

/* The decode's bf16 kernels on key and value rows read in place, each followed by an inf
 * that must not be read (an odd d ends in half a word), at one stride or at irregular
 * places (a paged cache's rows: AMX loads rows at one stride directly, others through a
 * copy): S against double sums, zero past nk; P V against double sums. */
static void bf16_decode_case(const fw_kernels *kt, int R, int nk, int d, int dv, int irregular)
{
    const int dw = (d + 1) / 2, kst = d + 3, vst = dv + 1;
    uint16_t *K = malloc(sizeof(uint16_t) * (size_t)(2 * FW_DEC_KEYS * kst)),
             *V = malloc(sizeof(uint16_t) * (size_t)(2 * FW_DEC_KEYS * vst));
    float *Q = malloc(sizeof(float) * (size_t)(R * d)), *S = malloc(sizeof(float) * (size_t)(R * FW_DEC_KEYS));
    float *O = malloc(sizeof(float) * (size_t)(R * dv)), *O0 = malloc(sizeof(float) * (size_t)(R * dv));
    float *Kf = malloc(sizeof(float) * (size_t)(nk * d));
    uint32_t *QW = malloc(sizeof(uint32_t) * (size_t)(R * dw)), PW[FW_DEC_ROWS * FW_DEC_KEYS / 2];
    const void *rows[FW_DEC_KEYS], *vrows[FW_DEC_KEYS];
    for (int i = 0; i < 2 * FW_DEC_KEYS * kst; i++)
        K[i] = 0x7f80; /* inf wherever no key element is */
    for (int i = 0; i < 2 * FW_DEC_KEYS * vst; i++)
        V[i] = 0x7f80;
    for (int j = 0; j < nk; j++) {
        const int at = irregular ? 2 * j - j % 3 : j; /* 0, 1, 2, 6, 7, 8, 12, ... */
        rows[j] = K + (size_t)at * kst;
        vrows[j] = V + (size_t)at * vst;
        for (int x = 0; x < d; x++)
            ((uint16_t *)rows[j])[x] = fw_f32_to_bf16((float)rng_normal());
        for (int c = 0; c < dv; c++)
            ((uint16_t *)vrows[j])[c] = fw_f32_to_bf16((float)rng_normal());
    }
    for (int i = 0; i < R * d; i++)
        Q[i] = (float)rng_normal();
    for (int r = 0; r < R; r++)
        kt->mm.pack_row_pairs(Q + (size_t)r * d, d, QW + (size_t)r * dw);
    for (int i = 0; i < R * FW_DEC_KEYS; i++)
        S[i] = NAN;
    kt->dec.qk_rows_bf16(R, nk, d, QW, rows, FW_BF16, 0.5f, NULL, 0, S);
    const double u = 1.0 / (1 << 23);
    /* an fp8 cache's key rows (each followed by NaN bytes) against bf16 rows of their values:
     * the same bits */
    {
        uint8_t *K8 = malloc((size_t)(nk * (d + 4)));
        uint16_t *K16 = malloc(sizeof(uint16_t) * (size_t)(nk * (d + 4)));
        float *S8 = malloc(sizeof(float) * (size_t)(R * FW_DEC_KEYS)), *S16 = malloc(sizeof(float) * (size_t)(R * FW_DEC_KEYS));
        const void *k8[FW_DEC_KEYS], *k16[FW_DEC_KEYS];
        for (int f = 0; f < 2; f++) {
            const fw_dtype dt = f ? FW_F8E5M2 : FW_F8E4M3;
            for (int j = 0; j < nk; j++) {
                k8[j] = K8 + (size_t)j * (d + 4);
                k16[j] = K16 + (size_t)j * (d + 4);
                for (int x = 0; x < d + 4; x++) {
                    const uint8_t b = x < d ? (uint8_t)((unsigned)(256 * rng_uniform()) & (f ? 0xbbu : 0xf7u)) : 0xff;
                    K8[(size_t)j * (d + 4) + x] = b;
                    K16[(size_t)j * (d + 4) + x] = fw_f32_to_bf16(fw_cvt_f8_f32(b, dt));
                }
            }
            kt->dec.qk_rows_bf16(R, nk, d, QW, k8, dt, 0.5f, NULL, 0, S8);
            kt->dec.qk_rows_bf16(R, nk, d, QW, k16, FW_BF16, 0.5f, NULL, 0, S16);
            case_check(memcmp(S8, S16, sizeof(float) * (size_t)(R * FW_DEC_KEYS)) == 0, "dec_qk_rows_bf16 R %d nk "
                       "%d d %d: %s rows give other bits than bf16 rows of their values", R, nk, d,
                       f ? "f8e5m2" : "f8e4m3");
        }
        free(K8); free(K16); free(S8); free(S16);
    }
    for (int j = 0; j < nk; j++)
        for (int k = 0; k < d; k++)
            Kf[j * d + k] = fw_bf16_to_f32(((const uint16_t *)rows[j])[k]);
    int zero;
    double worst = dec_scores_residual(S, R, nk, d, Q, FW_BF16, Kf, 0.5, u * (d + 4), &zero);
    case_check(worst <= 1 && zero, "dec_qk_rows_bf16 R %d nk %d d %d %s rows: residual %.3g of bound, tail %s", R, nk,
               d, irregular ? "irregular" : "regular", worst, zero ? "zero" : "not zero");
    for (int r = 0; r < R; r++)
        for (int j = 0; j < FW_DEC_KEYS; j++)
            S[r * FW_DEC_KEYS + j] = j < nk ? (float)rng_uniform() : 0.0f;
    for (int i = 0; i < R * dv; i++)
        O[i] = O0[i] = (float)rng_normal();
    kt->dec.pv_bf16(R, nk, dv, S, vrows, FW_BF16, NULL, 0, PW, O);
    worst = 0;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < dv; c++) {
            double x = O0[r * dv + c], a = fabs(x);
            for (int j = 0; j < nk; j++) {
                const double t = round_to(FW_BF16, S[r * FW_DEC_KEYS + j]) * fw_bf16_to_f32(((const uint16_t *)vrows[j])[c]);
                x += t;
                a += fabs(t);
            }
            worst = worse(worst, fabs(O[r * dv + c] - x) / (a * u * (nk + 4) + 1e-30));
        }
    case_check(worst <= 1, "dec_pv_bf16 R %d nk %d dv %d %s rows: residual %.3g of bound", R, nk, dv,
               irregular ? "irregular" : "regular", worst);
    /* the same values as f32 rows (each followed by an inf), prefetched as the next tile's
     * while read: the same sums */
    float *V32 = malloc(sizeof(float) * (size_t)(nk * (dv + 1)));
    const void *v32[FW_DEC_KEYS];
    for (int j = 0; j < nk; j++) {
        v32[j] = V32 + (size_t)j * (dv + 1);
        for (int c = 0; c < dv; c++)
            V32[(size_t)j * (dv + 1) + c] = fw_bf16_to_f32(((const uint16_t *)vrows[j])[c]);
        V32[(size_t)j * (dv + 1) + dv] = INFINITY;
    }
    float *O32 = malloc(sizeof(float) * (size_t)(R * dv));
    memcpy(O32, O0, sizeof(float) * (size_t)(R * dv));
    kt->dec.pv_bf16(R, nk, dv, S, v32, FW_F32, v32, nk, PW, O32);
    case_check(memcmp(O32, O, sizeof(float) * (size_t)(R * dv)) == 0, "dec_pv_bf16 R %d nk %d dv %d: f32 rows of the "
               "same values give other bits than bf16 rows", R, nk, dv);
    /* an fp8 cache's rows (each followed by a NaN byte) against f32 rows of their values */
    uint8_t *V8 = malloc((size_t)(nk * (dv + 1)));
    float *O8 = malloc(sizeof(float) * (size_t)(R * dv));
    const void *v8[FW_DEC_KEYS];
    for (int f = 0; f < 2; f++) {
        const fw_dtype dt = f ? FW_F8E5M2 : FW_F8E4M3;
        for (int j = 0; j < nk; j++) {
            v8[j] = V8 + (size_t)j * (dv + 1);
            for (int c = 0; c < dv; c++) {
                uint8_t b = (uint8_t)((unsigned)(256 * rng_uniform()) & (f ? 0xbbu : 0xf7u)); /* below the top exponent: finite */
                V8[(size_t)j * (dv + 1) + c] = b;
                V32[(size_t)j * (dv + 1) + c] = fw_cvt_f8_f32(b, dt);
            }
            V8[(size_t)j * (dv + 1) + dv] = 0xff;
        }
        memcpy(O32, O0, sizeof(float) * (size_t)(R * dv));
        memcpy(O8, O0, sizeof(float) * (size_t)(R * dv));
        kt->dec.pv_bf16(R, nk, dv, S, v32, FW_F32, NULL, 0, PW, O32);
        kt->dec.pv_bf16(R, nk, dv, S, v8, dt, NULL, 0, PW, O8);
        case_check(memcmp(O32, O8, sizeof(float) * (size_t)(R * dv)) == 0, "dec_pv_bf16 R %d nk %d dv %d: %s rows "
                   "give other bits than f32 rows of their values", R, nk, dv, f ? "f8e5m2" : "f8e4m3");
    }
    free(V8); free(O8);
    free(V32); free(O32);
    free(K); free(V); free(Q); free(S); free(O); free(O0); free(QW); free(Kf);
}

/* Signed zeros: products that are all -0 (P = 0 against negative values) keep an output of
 * -0 at -0, however many words the keys fill (nk even: no padding half, whose +0 product would
 * make the sum +0 on every table); an odd last word included (nw odd), where a 2x2 block
 * product must not add a zero second word. AMX tiles sum zeros to +0 whatever their signs
 * (kern/amx.c): there the outputs must be zeros of either sign. */
static void bf16_signed_zero_case(const fw_kernels *kt, int nk)
{
    const int dv = 10, M = 2 * kt->vl, nw = (nk + 1) / 2;
    float *X = malloc(sizeof(float) * (size_t)(nk * dv)), *P = calloc((size_t)(nk * M), sizeof(float));
    float *OT = malloc(sizeof(float) * (size_t)(dv * M));
    uint32_t *VW = malloc(kt->mm.panel_bytes(nk, dv)), *PW = malloc(sizeof(uint32_t) * (size_t)(nw * M));
    for (int i = 0; i < nk * dv; i++)
        X[i] = -1.5f - (float)i;
    for (int i = 0; i < dv * M; i++)
        OT[i] = -0.0f;
    kt->mm.pack_vw(X, FW_F32, nk, dv, VW);
    for (int w = 0; w < nw; w++)
        kt->mm.pack_pairs(P + (size_t)2 * w * M, 2 * w + 1 < nk ? P + (size_t)(2 * w + 1) * M : NULL, M,
                          PW + (size_t)w * M);
    kt->mm.pv_bf16(nw, dv, M, VW, PW, OT);
    const int tiles = kt->native_bf16 == FW_BF16_TILES;
    int bad = 0;
    for (int i = 0; i < dv * M; i++)
        bad += !(OT[i] == 0 && (tiles || signbit(OT[i])));
    case_check(bad == 0, "pv_bf16 nk %d: %d of %d outputs of -0 plus -0 products are not %s", nk, bad, dv * M,
               tiles ? "zero" : "-0");
    free(X); free(P); free(OT); free(VW); free(PW);
}

/* An fp8 cache's key rows as bf16 words (dec.pack_kt_bf16, the lookup on AVX-512): every byte
 * of both formats, exactly its value (a NaN a NaN of its sign). */
static void f8_words_case(const fw_kernels *kt)
{
    enum { d = 128 };
    uint8_t *K = malloc((size_t)FW_DEC_KEYS * d);
    uint32_t *KtW = malloc(sizeof(uint32_t) * (size_t)(d / 2 * FW_DEC_KEYS));
    const void *rows[FW_DEC_KEYS];
    for (int f = 0; f < 2; f++) {
        const fw_dtype dt = f ? FW_F8E5M2 : FW_F8E4M3;
        for (int j = 0; j < FW_DEC_KEYS; j++) {
            rows[j] = K + (size_t)j * d;
            for (int x = 0; x < d; x++)
                K[(size_t)j * d + x] = (uint8_t)(j * d + x + 37 * f);
        }
        kt->dec.pack_kt_bf16(rows, dt, 1, FW_DEC_KEYS, d, KtW);
        int bad = 0;
        for (int j = 0; j < FW_DEC_KEYS; j++)
            for (int x = 0; x < d; x++) {
                const uint32_t w = KtW[(size_t)(x / 2) * FW_DEC_KEYS + j];
                const float got = fw_bf16_to_f32((uint16_t)(w >> (16 * (x & 1))));
                const float want = fw_cvt_f8_f32(K[(size_t)j * d + x], dt);
                bad += !(got == want || (isnan(got) && isnan(want))) || signbit(got) != signbit(want);
            }
        case_check(bad == 0, "pack_kt_bf16 %s rows: %d of %d words' halves are not their bytes' values",
                   f ? "f8e5m2" : "f8e4m3", bad, FW_DEC_KEYS * d);
    }
    free(K); free(KtW);
}

static void test_bf16_products(void)
{
    static const int nks[] = {1, 2, 15, 17, 33, 64}, ds[] = {1, 2, 31, 64, 80, 128}, dvs[] = {1, 17, 40, 128};
    for (int t = 0; t < ntables(); t++) {
        if (!table(t))
            continue;
        const fw_kernels *kt = fw_kernels_get(table(t));
        case_begin("bf16 products qk_bf16 / pack_vw / pv_bf16, decode rows [%s]", kt->name);
        rng_seed(4321);
        for (int a = 0; a < 6; a++)
            for (int M = kt->vl; M <= 80; M += kt->vl * (M < 32 ? 1 : 3))
                bf16_products_case(kt, nks[a], ds[(a + M / kt->vl) % 6], M, dvs[(a + 2 * M / kt->vl) % 4]);
        static const int dks[] = {31, 33, 64, 127, 128}, dnk[] = {1, 16, 17, 40, 64}, dR[] = {1, 4, 6, 16};
        for (int a = 0; a < 5; a++)
            for (int b = 0; b < 4; b++)
                for (int irr = 0; irr < 2; irr++)
                    bf16_decode_case(kt, dR[b], dnk[(a + b) % 5], dks[a], dvs[(a + b + irr) % 4] + 16 * irr, irr);
        for (int nk = 2; nk <= 8; nk += 2)
            bf16_signed_zero_case(kt, nk);
        f8_words_case(kt);
        case_end();
    }
}

static void test_micro_kernels(void)
{
    for (int t = 0; t < ntables(); t++) {
        if (!table(t))
            continue;
        const fw_kernels *kt = fw_kernels_get(table(t));
        case_begin("micro-kernels qk/pv/softmax/exp2 [%s]", kt->name);
        rng_seed(1234);
        for (int M = kt->vl; M <= 80; M += kt->vl * (M < 32 ? 1 : 3))
            for (int nk = 1; nk <= 64; nk += 9) {
                int d = 1 + (nk * 7 + M) % 70, dv = 1 + (nk * 3 + M) % 50;
                float *K = malloc(sizeof(float) * nk * d), *QT = malloc(sizeof(float) * d * M);
                float *bias = malloc(sizeof(float) * M), *ST = malloc(sizeof(float) * nk * M);
                float *V = malloc(sizeof(float) * nk * dv), *OT = malloc(sizeof(float) * dv * M);
                for (int i = 0; i < nk * d; i++) K[i] = (float)rng_normal();
                for (int i = 0; i < d * M; i++) QT[i] = (float)rng_normal();
                for (int i = 0; i < M; i++) bias[i] = (float)rng_normal();
                for (int i = 0; i < nk * dv; i++) V[i] = (float)rng_normal();
                for (int i = 0; i < dv * M; i++) OT[i] = (float)rng_normal();
                kt->mm.qk(nk, d, M, K, d, QT, bias, ST);
                double worst = 0;
                for (int j = 0; j < nk; j++)
                    for (int m = 0; m < M; m++) {
                        double s = bias[m], a = fabs(bias[m]);
                        for (int k = 0; k < d; k++) {
                            s += (double)K[j * d + k] * QT[k * M + m];
                            a += fabs((double)K[j * d + k] * QT[k * M + m]);
                        }
                        worst = worse(worst, fabs(ST[j * M + m] - s) / (a * 1e-6 * (d + 1)));
                    }
                case_check(worst <= 1, "qk M %d nk %d d %d: residual %.3g of bound", M, nk, d, worst);
                double *want = malloc(sizeof(double) * dv * M);
                for (int c = 0; c < dv; c++)
                    for (int m = 0; m < M; m++) {
                        double s = OT[c * M + m];
                        for (int j = 0; j < nk; j++)
                            s += (double)V[j * dv + c] * ST[j * M + m];
                        want[c * M + m] = s;
                    }
                kt->mm.pv(nk, dv, M, V, dv, ST, OT);
                worst = 0;
                for (int i = 0; i < dv * M; i++)
                    worst = worse(worst, fabs(OT[i] - want[i]) / (1e-5 * (1 + fabs(want[i])) * (nk + 1)));
                case_check(worst <= 1, "pv M %d nk %d dv %d: residual %.3g of bound", M, nk, dv, worst);
                free(want);
                free(K); free(QT); free(bias); free(ST); free(V); free(OT);
            }
        /* exp2 through the static-anchor softmax: anchor 0, folded, all visible: P = 2^S */
        {
            const int M = kt->vl * 4, nk = 64;
            float *ST = malloc(sizeof(float) * nk * M), *a = malloc(sizeof(float) * M),
                  *l = malloc(sizeof(float) * M), *pend = malloc(sizeof(float) * 2 * M);
            double worst = 0;
            for (int rep = 0; rep < 40; rep++) {
                for (int i = 0; i < nk * M; i++)
                    ST[i] = (float)(-126.0 + 130.0 * rng_uniform()) * (i % 3 ? 1.0f : 0.01f);
                float *S0 = malloc(sizeof(float) * nk * M);
                memcpy(S0, ST, sizeof(float) * nk * M);
                for (int m = 0; m < M; m++) { a[m] = 0; l[m] = 0; }
                fw_softmax_args sa = {nk, M, ST, a, l, NULL, NULL, 1, 0, NULL, 0, pend};
                int r = kt->attn.softmax(&sa);
                case_check(r == 0, "softmax replayed a bounded tile");
                for (int i = 0; i < nk * M; i++) {
                    double want = exp2((double)S0[i]);
                    if (want >= 0x1p-126)
                        worst = worse(worst, fabs(ST[i] - want) / (want * 0x1p-23));
                }
                free(S0);
            }
            case_check(worst <= 4, "exp2 error %.2f ulp", worst);
            /* the bound: a score 80 above the anchor makes the sum pass 2^64: replay */
            for (int i = 0; i < nk * M; i++) ST[i] = 0;
            ST[5 * M] = 80.0f;
            for (int m = 0; m < M; m++) { a[m] = 3; l[m] = 1; }
            fw_softmax_args sb = {nk, M, ST, a, l, NULL, NULL, 1, 0, NULL, 0, pend};
            case_check(kt->attn.softmax(&sb) == 1, "an overflowing tile was not flagged");
            case_check(a[0] == 3 && l[0] == 1, "a failing tile committed its state");
            free(ST); free(a); free(l); free(pend);
        }
        /* decode kernels: pack_kt is a transpose; dec_qk and dec_pv are small GEMMs */
        for (int dt = 0; dt < 3; dt++)
            for (int nk = 1; nk <= FW_DEC_KEYS; nk += 21) {
                /* (nk 43: R 8 and d 64, whole blocks of every table's row kernels) */
                const int d = dt == 1 ? 48 : nk == 43 ? 64 : 37 + nk % 5, dv = 40 + nk % 3, R = 1 + nk % 9;
                const int64_t kdim = nk == 22 ? 2 : 1; /* one case with strided rows */
                uint16_t *kraw = malloc(sizeof(uint32_t) * (size_t)(nk * d * kdim + 1));
                float *Kt = malloc(sizeof(float) * (size_t)d * FW_DEC_KEYS), *Q = malloc(sizeof(float) * (size_t)(R * d));
                float *S = malloc(sizeof(float) * (size_t)(R * FW_DEC_KEYS)), *V = malloc(sizeof(float) * (size_t)(nk * dv));
                float *O = calloc((size_t)(R * dv), sizeof(float));
                const void *rows[FW_DEC_KEYS], *vrows[FW_DEC_KEYS];
                const size_t es = fw_dtype_size((fw_dtype)dt);
                for (int j = 0; j < nk; j++) {
                    rows[j] = (char *)kraw + (size_t)(j * d * kdim) * es;
                    for (int k = 0; k < d; k++) {
                        float x = (float)rng_normal();
                        if (dt == FW_F32) ((float *)rows[j])[k * kdim] = x;
                        else if (dt == FW_BF16) ((uint16_t *)rows[j])[k * kdim] = fw_f32_to_bf16(x);
                        else ((uint16_t *)rows[j])[k * kdim] = fw_f32_to_f16(x);
                    }
                }
                kt->dec.pack_kt(rows, (fw_dtype)dt, kdim, nk, d, Kt);
                int same = 1;
                for (int j = 0; j < nk; j++)
                    for (int k = 0; k < d; k++) {
                        float want;
                        kt->cvt.to_f32((const char *)rows[j] + (size_t)(k * kdim) * es, (fw_dtype)dt, 1, 1, 1.0f, &want);
                        same &= Kt[k * FW_DEC_KEYS + j] == want;
                    }
                case_check(same, "pack_kt %s nk %d d %d kdim %lld is not the transpose", dtn((fw_dtype)dt), nk, d,
                           (long long)kdim);
                /* the same panels from the keys stored transposed (a row of keys per channel, row
                 * stride ld past the keys, junk there): Kt and KtW equal to the row packers' */
                {
                    const int64_t ld = nk + 19;
                    char *cols = malloc((size_t)(d * ld) * es);
                    memset(cols, 0x7f, (size_t)(d * ld) * es); /* junk (NaN) past the keys */
                    for (int j = 0; j < nk; j++)
                        for (int k = 0; k < d; k++)
                            memcpy(cols + (size_t)(k * ld + j) * es, (const char *)rows[j] + (size_t)(k * kdim) * es, es);
                    float *Kc = malloc(sizeof(float) * (size_t)d * FW_DEC_KEYS);
                    const int dw = (d + 1) / 2;
                    uint32_t *Wr = malloc(sizeof(uint32_t) * (size_t)dw * FW_DEC_KEYS);
                    uint32_t *Wc = malloc(sizeof(uint32_t) * (size_t)dw * FW_DEC_KEYS);
                    memset(Kc, 0x55, sizeof(float) * (size_t)d * FW_DEC_KEYS);
                    memset(Wc, 0x55, sizeof(uint32_t) * (size_t)dw * FW_DEC_KEYS);
                    kt->dec.pack_kt_cols(cols, (fw_dtype)dt, ld, nk, d, Kc);
                    kt->dec.pack_kt_bf16(rows, (fw_dtype)dt, kdim, nk, d, Wr);
                    kt->dec.pack_kt_cols_bf16(cols, (fw_dtype)dt, ld, nk, d, Wc);
                    case_check(memcmp(Kc, Kt, sizeof(float) * (size_t)d * FW_DEC_KEYS) == 0,
                               "pack_kt_cols %s nk %d d %d differs from pack_kt", dtn((fw_dtype)dt), nk, d);
                    case_check(memcmp(Wc, Wr, sizeof(uint32_t) * (size_t)dw * FW_DEC_KEYS) == 0,
                               "pack_kt_cols_bf16 %s nk %d d %d differs from pack_kt_bf16", dtn((fw_dtype)dt), nk, d);
                    float *Kr = malloc(sizeof(float) * (size_t)(nk * d)); /* and back to key rows */
                    kt->dec.cols_to_rows(cols, (fw_dtype)dt, ld, nk, d, Kr);
                    int back = 1;
                    for (int j = 0; j < nk; j++)
                        for (int k = 0; k < d; k++)
                            back &= Kr[(size_t)j * d + k] == Kt[k * FW_DEC_KEYS + j];
                    case_check(back, "cols_to_rows %s nk %d d %d is not the transpose", dtn((fw_dtype)dt), nk, d);
                    free(cols); free(Kc); free(Wr); free(Wc); free(Kr);
                }
                for (int i = 0; i < R * d; i++) Q[i] = (float)rng_normal();
                for (int i = 0; i < nk * dv; i++) V[i] = (float)rng_normal();
                memset(S, 0, sizeof(float) * (size_t)(R * FW_DEC_KEYS));
                kt->dec.qk(R, nk, d, Q, Kt, FW_DEC_KEYS, NULL, S);
                {   /* prefetching a next panel (here: this one) gives the same bits */
                    float *S2 = malloc(sizeof(float) * (size_t)(R * FW_DEC_KEYS));
                    memcpy(S2, S, sizeof(float) * (size_t)(R * FW_DEC_KEYS));
                    kt->dec.qk(R, nk, d, Q, Kt, FW_DEC_KEYS, Kt, S);
                    case_check(memcmp(S, S2, sizeof(float) * (size_t)(R * FW_DEC_KEYS)) == 0,
                               "dec_qk R %d nk %d d %d: prefetching the next panel changed S", R, nk, d);
                    free(S2);
                }
                double worst = 0;
                for (int r = 0; r < R; r++)
                    for (int j = 0; j < nk; j++) {
                        double x = 0, a = 0;
                        for (int k = 0; k < d; k++) {
                            x += (double)Q[r * d + k] * Kt[k * FW_DEC_KEYS + j];
                            a += fabs((double)Q[r * d + k] * Kt[k * FW_DEC_KEYS + j]);
                        }
                        worst = worse(worst, fabs(S[r * FW_DEC_KEYS + j] - x) / (a * 1e-6 * (d + 1)));
                    }
                case_check(worst <= 1, "dec_qk R %d nk %d d %d: residual %.3g of bound", R, nk, d, worst);
                for (int j = 0; j < nk; j++)
                    vrows[j] = V + (size_t)j * dv;
                {   /* with the next tile's value rows prefetched (here: these, reversed): the
                     * same bits as without */
                    const void *next[FW_DEC_KEYS];
                    float *O2 = calloc((size_t)(R * dv), sizeof(float));
                    for (int j = 0; j < nk; j++)
                        next[j] = vrows[nk - 1 - j];
                    kt->dec.pv(R, nk, dv, S, vrows, FW_F32, next, nk - nk % 2, O2);
                    kt->dec.pv(R, nk, dv, S, vrows, FW_F32, NULL, 0, O);
                    case_check(memcmp(O, O2, sizeof(float) * (size_t)(R * dv)) == 0,
                               "dec_pv R %d nk %d dv %d: prefetching the next tile changed O", R, nk, dv);
                    free(O2);
                }
                worst = 0;
                for (int r = 0; r < R; r++)
                    for (int c = 0; c < dv; c++) {
                        double x = 0;
                        for (int j = 0; j < nk; j++)
                            x += (double)S[r * FW_DEC_KEYS + j] * V[j * dv + c];
                        worst = worse(worst, fabs(O[r * dv + c] - x) / (1e-5 * (1 + fabs(x)) * (nk + 1)));
                    }
                case_check(worst <= 1, "dec_pv R %d nk %d dv %d: residual %.3g of bound", R, nk, dv, worst);
                check_dec_rows(kt, (fw_dtype)dt, rows, kdim, nk, d, R);
                free(kraw); free(Kt); free(Q); free(S); free(V); free(O);
            }
        /* conversions: the table's vector paths equal the scalar functions */
        {
            uint16_t hb[100];
            float f[100], g[100];
            for (int i = 0; i < 100; i++)
                f[i] = (float)(rng_normal() * exp(8 * rng_normal()));
            f[3] = INFINITY; f[4] = -0.0f; f[5] = NAN; f[6] = 1e-7f; f[7] = 65519.0f;
            for (int dt = FW_BF16; dt <= FW_F16; dt++) {
                kt->cvt.from_f32(f, 100, hb, (fw_dtype)dt, 1);
                int same = 1;
                for (int i = 0; i < 100; i++) {
                    uint16_t want = dt == FW_BF16 ? fw_f32_to_bf16(f[i]) : fw_f32_to_f16(f[i]);
                    same &= hb[i] == want || (f[i] != f[i] && ((hb[i] & 0x7fff) > (dt == FW_BF16 ? 0x7f80 : 0x7c00)));
                }
                case_check(same, "from_f32 %s differs from the scalar rounding", dtn((fw_dtype)dt));
                kt->cvt.to_f32(hb, (fw_dtype)dt, 1, 100, 2.0f, g);
                same = 1;
                for (int i = 0; i < 100; i++) {
                    float want = 2.0f * (dt == FW_BF16 ? fw_bf16_to_f32(hb[i]) : fw_f16_to_f32(hb[i]));
                    same &= g[i] == want || (g[i] != g[i] && want != want);
                }
                case_check(same, "to_f32 %s differs from the scalar conversion", dtn((fw_dtype)dt));
            }
        }
        case_end();
    }
    case_begin("scalar conversions: rounding to nearest even, specials");
    case_check(fw_f32_to_bf16(1.0f) == 0x3f80, "bf16(1)");
    case_check(fw_f32_to_bf16(1.00390625f) == 0x3f80, "bf16 tie rounds to even");
    case_check(fw_f32_to_bf16(1.01171875f) == 0x3f82, "bf16 tie rounds up to even");
    case_check(fw_f32_to_f16(65504.0f) == 0x7bff && fw_f32_to_f16(65520.0f) == 0x7c00, "f16 max/overflow");
    case_check(fw_f32_to_f16(0x1p-24f) == 0x0001 && fw_f32_to_f16(0x1p-25f) == 0, "f16 subnormal ties");
    case_check(fw_f16_to_f32(0x0001) == 0x1p-24f && fw_f16_to_f32(0xfc00) == -INFINITY, "f16 decode");
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = fw_f16_to_f32((uint16_t)h);
        if (f == f && fw_f32_to_f16(f) != h) {
            case_check(0, "f16 round trip 0x%04x", h);
            break;
        }
        f = fw_bf16_to_f32((uint16_t)h);
        if (f == f && fw_f32_to_bf16(f) != h) {
            case_check(0, "bf16 round trip 0x%04x", h);
            break;
        }
    }
    case_end();
}

static void test_heuristics(void)
{
    case_begin("tiling heuristics");
    int bq, M;
    fw_attn_tile_rows(4, 16, 4096, &bq, &M);
    case_check(bq == 16 && M == 64, "G4 vl16: bq %d M %d", bq, M);
    fw_attn_tile_rows(4, 16, 1, &bq, &M);
    case_check(bq == 1 && M == 16, "decode: bq %d M %d", bq, M);
    fw_attn_tile_rows(3, 16, 1000, &bq, &M);
    case_check(bq == 21 && M == 64, "G3: bq %d M %d", bq, M);
    fw_attn_tile_rows(128, 8, 1000, &bq, &M);
    case_check(bq == 1 && M == 128, "G128: bq %d M %d", bq, M);
    fw_attn_tile_rows(1, 1, 7, &bq, &M);
    case_check(bq == 7 && M == 7, "portable short: bq %d M %d", bq, M);
    case_check(fw_attn_chunk_tiles(2048, 2) == 16, "2048 tiles, 2 threads");
    case_check(fw_attn_chunk_tiles(40, 2) == 2, "40 tiles, 2 threads");
    case_check(fw_attn_chunk_tiles(1, 8) == 1, "1 tile");
    case_end();
}

/* Tables may leave entries NULL (filled from the portable table), which is legal only if no
 * entry relies on another's vector length: every registered table is whole once resolved, a
 * partial one takes the portable entries it lacks, and the portable key packers feed each
 * table's decode products exactly as its own do (every column written, garbage before). */
static void test_partial_tables(void)
{
    const fw_kernels *port = fw_kernels_get("portable");
    for (int it = 0; it < fw_isa_count(); it++) {
        if (!test_table(fw_isa_name(it)))
            continue;
        const fw_kernels *t = fw_kernels_get(fw_isa_name(it));
        case_begin("kernel table %s: resolved whole; a partial one filled from portable", t->name);
#define FW_NONNULL(sub, f) case_check(t->sub.f != NULL, "entry " #sub "." #f " is NULL");
        FW_KERNEL_ENTRIES(FW_NONNULL)
#undef FW_NONNULL
        fw_kernels part;
        memset(&part, 0, sizeof part);
        part.name = t->name;
        part.vl = t->vl;
        part.dec.qk = t->dec.qk;
        part.dec.qk_bf16 = t->dec.qk_bf16;
        fw_kernels_fill(&part, port);
        case_check(part.dec.qk == t->dec.qk && part.dec.qk_bf16 == t->dec.qk_bf16 &&
                       part.dec.pack_kt == port->dec.pack_kt && part.dec.pack_kt_bf16 == port->dec.pack_kt_bf16 &&
                       part.mm.qk == port->mm.qk && part.gdn.step4 == port->gdn.step4,
                   "fill replaced a given entry or left a missing one");
        enum { R = 3, D = 72, DW = D / 2 };
        static uint16_t keys[FW_DEC_KEYS][D];
        static float K32[FW_DEC_KEYS][D], Kt[D * FW_DEC_KEYS], Q[R * D], S0[R * FW_DEC_KEYS], S1[R * FW_DEC_KEYS];
        static uint32_t KtW[DW * FW_DEC_KEYS], QW[R * DW];
        rng_seed(77);
        for (int j = 0; j < FW_DEC_KEYS; j++)
            for (int x = 0; x < D; x++) {
                keys[j][x] = fw_f32_to_bf16((float)rng_normal());
                K32[j][x] = fw_bf16_to_f32(keys[j][x]);
            }
        for (int i = 0; i < R * D; i++)
            Q[i] = (float)rng_normal();
        for (int r = 0; r < R; r++)
            port->mm.pack_row_pairs(Q + r * D, D, QW + r * DW);
        static const int nks[] = {1, 37, 64};
        for (int n = 0; n < 3; n++) {
            const int nk = nks[n];
            const void *rows32[FW_DEC_KEYS], *rows16[FW_DEC_KEYS];
            for (int j = 0; j < nk; j++) {
                rows32[j] = K32[j];
                rows16[j] = keys[j];
            }
            for (int bf = 0; bf < 2; bf++) {
                for (int way = 0; way < 2; way++) { /* 0: the table's own packer, 1: portable's */
                    const fw_kernels *pk = way ? port : t;
                    float *S = way ? S1 : S0;
                    memset(Kt, 0xff, sizeof Kt); /* NaN: every column must be written */
                    memset(KtW, 0xff, sizeof KtW);
                    memset(S, 0, sizeof S0);
                    if (bf) {
                        pk->dec.pack_kt_bf16(rows16, FW_BF16, 1, nk, D, KtW);
                        t->dec.qk_bf16(R, nk, DW, QW, KtW, 0.5f, S);
                    } else {
                        pk->dec.pack_kt(rows32, FW_F32, 1, nk, D, Kt);
                        t->dec.qk(R, nk, D, Q, Kt, FW_DEC_KEYS, NULL, S);
                    }
                }
                int same = 1;
                for (int r = 0; r < R; r++)
                    for (int j = 0; j < nk; j++)
                        same &= memcmp(&S0[r * FW_DEC_KEYS + j], &S1[r * FW_DEC_KEYS + j], sizeof(float)) == 0 &&
                                S0[r * FW_DEC_KEYS + j] == S0[r * FW_DEC_KEYS + j];
                case_check(same, "%s products, %d keys: the portable packer feeds %s's dec_qk differently",
                           bf ? "bf16" : "f32", nk, t->name);
            }
        }
        case_end();
    }
}

/* Any negative window side means unbounded (flash-attn's rule): (-5, 3) is (-1, 3), bit for
 * bit, and (-7, -2) is full attention. */
static void test_negative_windows(void)
{
    case_begin("attention: any negative window side is unbounded, and so is INT64_MAX");
    enum { S = 90, H = 2, D = 16 };
    static float q[S * H * D], k[S * H * D], v[S * H * D], o1[S * H * D], o2[S * H * D];
    int64_t sh[4] = {1, S, H, D};
    fw_tensor tq = fw_tensor_contiguous(q, FW_F32, 4, sh), tk = fw_tensor_contiguous(k, FW_F32, 4, sh),
              tv = fw_tensor_contiguous(v, FW_F32, 4, sh), t1 = fw_tensor_contiguous(o1, FW_F32, 4, sh),
              t2 = fw_tensor_contiguous(o2, FW_F32, 4, sh);
    rng_seed(21);
    tfill_normal(&tq, 1.0);
    tfill_normal(&tk, 1.0);
    tfill_normal(&tv, 1.0);
    /* the extremes are fuzz/fuzz_attn.c's: diag - window_left overflowed int64 */
    static const int64_t w[4][4] = {{-5, 3, -1, 3}, {-7, -2, -1, -1}, {INT64_MAX, INT64_MAX, -1, -1},
                                    {INT64_MIN, 4, INT64_MAX, 4}};
    for (int c = 0; c < 4; c++) {
        fw_attn_params p;
        fw_attn_params_init(&p);
        p.window_left = w[c][0];
        p.window_right = w[c][1];
        fw_status st = fw_attn_fwd(&tq, &tk, &tv, &t1, NULL, &p);
        p.window_left = w[c][2];
        p.window_right = w[c][3];
        st |= fw_attn_fwd(&tq, &tk, &tv, &t2, NULL, &p);
        case_check(st == FW_OK, "status: %s", fw_last_error());
        case_check(memcmp(o1, o2, sizeof o1) == 0, "window (%lld, %lld) differs from (%lld, %lld)",
                   (long long)w[c][0], (long long)w[c][1], (long long)w[c][2], (long long)w[c][3]);
    }
    case_end();
}

/* fw_tensor_contiguous on a rank out of range, a NULL shape and sizes whose product
 * overflows int64 (found by fuzz/fuzz_attn.c: the stride computation overflowed): every entry
 * point refuses the descriptor with the status that names the problem. */
static void test_contiguous_descriptors(void)
{
    case_begin("attention: fw_tensor_contiguous of bad ranks and overflowing sizes is refused");
    static float x[64];
    int64_t ok[4] = {1, 4, 2, 8}, huge[4] = {1, (int64_t)1 << 40, 1 << 20, 1 << 10};
    fw_tensor good = fw_tensor_contiguous(x, FW_F32, 4, ok), o = fw_tensor_contiguous(x, FW_F32, 4, ok);
    const fw_tensor bad[4] = {fw_tensor_contiguous(x, FW_F32, 5, ok), fw_tensor_contiguous(x, FW_F32, -1, ok),
                              fw_tensor_contiguous(x, FW_F32, 4, NULL), fw_tensor_contiguous(x, FW_F32, 4, huge)};
    const fw_status want[4] = {FW_ERR_SHAPE, FW_ERR_SHAPE, FW_ERR_SHAPE, FW_ERR_OVERFLOW};
    for (int i = 0; i < 4; i++) {
        fw_status st = fw_attn_fwd(&bad[i], &good, &good, &o, NULL, NULL);
        case_check(st == want[i], "descriptor %d: status %d (%s), expected %d", i, (int)st, fw_last_error(),
                   (int)want[i]);
    }
    case_check(huge[3] == 1 << 10 && bad[3].stride[0] == INT64_MAX, "the stride saturates");
    case_end();
}

/* Decode with keys along the innermost stride and strided head dims: K/V [1, 40, 2, 16] with
 * element strides (key 1, head 40, dim 80), in buffers allocated to the last element, so that
 * AddressSanitizer (make test-asan) sees any read past it. The decode kernel's row sweep read
 * (d - 1) x (stride - 1) elements past each row's end (found by fuzz/fuzz_attn.c). */
static void test_decode_strided_extent(void)
{
    case_begin("attention: decode on K/V with strided head dims reads nothing past them, GQA groups packed or not");
    /* a context long enough for the kernel's row sweep (found by fuzz/fuzz_attn.c) */
    enum { SK = FW_DEC_SWEEP_KEYS + 9, HKV = 2, HQ = 4, D = 16 };
    const int64_t n = (SK - 1) + (HKV - 1) * SK + (D - 1) * SK * HKV + 1;
    float *k = malloc(sizeof(float) * (size_t)n), *v = malloc(sizeof(float) * (size_t)n);
    float q[HQ * D], o[HQ * D];
    double ro[HQ * D];
    int64_t qs[4] = {1, 1, HQ, D};
    fw_tensor tq = fw_tensor_contiguous(q, FW_F32, 4, qs), to = fw_tensor_contiguous(o, FW_F32, 4, qs),
              tr = fw_tensor_contiguous(ro, FW_F64, 4, qs);
    fw_tensor tk = {k, FW_F32, 4, {1, SK, HKV, D}, {n, 1, SK, SK * HKV}}, tv = tk;
    tv.data = v;
    rng_seed(31);
    tfill_normal(&tq, 1.0);
    tfill_normal(&tk, 1.0);
    tfill_normal(&tv, 1.0);
    /* with the prefetch and sweep forced on and off (the default depends on the CPU's vendor),
     * query heads in GQA groups or one by one (each of a group's heads then finds the value
     * rows its predecessor converted) */
    for (int it = 0; it < 4 * fw_isa_count(); it++) {
        if (!test_table(fw_isa_name(it / 4)))
            continue;
        fw_attn_params p;
        fw_attn_params_init(&p);
        p.isa = fw_isa_name(it / 4);
        p.flags = (it % 2 ? FW_ATTN_NO_DEC_PREFETCH : FW_ATTN_DEC_PREFETCH) | (it % 4 >= 2 ? FW_ATTN_NO_GQA_PACK : 0);
        fw_status st = fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p);
        st |= fw_attn_ref(&tq, &tk, &tv, &tr, NULL, &p, 0, INT64_MAX);
        case_check(st == FW_OK, "%s flags %#x: %s", p.isa, (unsigned)p.flags, fw_last_error());
        double e = 0;
        for (int i = 0; i < HQ * D; i++)
            e = worse(e, fabs(o[i] - ro[i]));
        case_check(e < 1e-5, "%s flags %#x: error %g", p.isa, (unsigned)p.flags, e);
    }
    free(k);
    free(v);
    case_end();
}

/* The decode kernel's prefetch and sweep (FW_ATTN_DEC_PREFETCH / FW_ATTN_NO_DEC_PREFETCH) move
 * no result: the same bits with them on, off and by default, on every table the host runs, for
 * a context past FW_DEC_SWEEP_KEYS in a token-major cache (heads together: the sweep's case),
 * bf16 and f32. */
static void test_decode_prefetch_bits(void)
{
    /* on 40 threads the 34 key ranges have their 2 heads in 2 groups: the sweep and the
     * prefetch of a group's slice of each row */
    /* (strided head dims: the products read panels, not K and V in place, so the bursts of
     * prefetches and the sweep run instead of the products' own prefetch) */
    case_begin("attention: decode prefetch on, off and by default, heads in groups or not, K and V "
               "read in place or strided, give the same bits");
    enum { B = 2, SK = FW_DEC_SWEEP_KEYS + 77, HKV = 2, HQ = 8, D = 64 };
    int64_t qs[4] = {B, 1, HQ, D};
    for (int dt = 0; dt < 4; dt++) {
        const fw_dtype t = dt % 2 ? FW_F32 : FW_BF16;
        const int64_t hd = dt / 2 ? 2 : 1; /* head-dim stride of K and V */
        const size_t es = fw_dtype_size(t), nkv = (size_t)B * SK * HKV * D * hd;
        void *q = malloc(es * B * HQ * D), *k = malloc(es * nkv), *v = malloc(es * nkv);
        float *o[5];
        int64_t kbuf[4] = {B, SK, HKV, D * hd};
        fw_tensor tq = fw_tensor_contiguous(q, t, 4, qs), tk = fw_tensor_contiguous(k, t, 4, kbuf),
                  tv = fw_tensor_contiguous(v, t, 4, kbuf);
        tk.shape[3] = tv.shape[3] = D;
        tk.stride[3] = tv.stride[3] = hd;
        rng_seed(37);
        tfill_normal(&tq, 1.0);
        tfill_normal(&tk, 1.0);
        tfill_normal(&tv, 1.0);
        static const uint32_t flags[5] = {0, FW_ATTN_DEC_PREFETCH, FW_ATTN_NO_DEC_PREFETCH,
                                          FW_ATTN_DEC_PREFETCH, FW_ATTN_NO_DEC_PREFETCH};
        static const int threads[5] = {1, 2, 2, 40, 40};
        for (int it = 0; it < fw_isa_count(); it++) {
            if (!test_table(fw_isa_name(it)))
                continue;
            for (int f = 0; f < 5; f++) {
                o[f] = calloc(B * HQ * D, sizeof(float));
                fw_tensor to = fw_tensor_contiguous(o[f], FW_F32, 4, qs);
                fw_attn_params p;
                fw_attn_params_init(&p);
                p.isa = fw_isa_name(it);
                p.causal = 1;
                p.flags = flags[f];
                p.threads = threads[f];
                const fw_status st = fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p);
                case_check(st == FW_OK, "%s flags %u: %s", p.isa, flags[f], fw_last_error());
            }
            for (int f = 1; f < 5; f++)
                case_check(!memcmp(o[0], o[f], sizeof(float) * B * HQ * D) && isfinite(o[0][0]),
                           "%s %s%s: outputs of run %d differ", fw_isa_name(it), dt % 2 ? "f32" : "bf16",
                           hd > 1 ? " strided" : "", f);
            for (int f = 0; f < 5; f++)
                free(o[f]);
        }
        free(q);
        free(k);
        free(v);
    }
    case_end();
}

/* A scale and softcap each valid, whose score multiplier (scale x log2 e, or scale / softcap)
 * overflows a float: refused, where the kernels made NaN of finite inputs (found by the
 * atheris harness of the Python binding); the same in the reference and the KV-cache call. */
static void test_scale_overflow(void)
{
    case_begin("attention: a score multiplier that overflows a float is refused");
    float q[2] = {1, 1}, k[4] = {1, -0.5f, 0.5f, 0.5f}, v[2] = {1, 2}, o[1] = {0};
    double r[1];
    int64_t qs[4] = {1, 1, 1, 2}, ks[4] = {1, 2, 1, 2}, vs[4] = {1, 2, 1, 1}, os[4] = {1, 1, 1, 1};
    fw_tensor tq = fw_tensor_contiguous(q, FW_F32, 4, qs), tk = fw_tensor_contiguous(k, FW_F32, 4, ks),
              tv = fw_tensor_contiguous(v, FW_F32, 4, vs), to = fw_tensor_contiguous(o, FW_F32, 4, os),
              tr = fw_tensor_contiguous(r, FW_F64, 4, os);
    static const float sc[4][2] = {{0, 1e-40f}, {1e37f, 1e-2f}, {3e38f, 0}, {1, 3e38f}};
    for (int c = 0; c < 4; c++) {
        fw_attn_params p;
        fw_attn_params_init(&p);
        p.scale = sc[c][0];
        p.softcap = sc[c][1];
        fw_status a = fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p), b = fw_attn_ref(&tq, &tk, &tv, &tr, NULL, &p, 0, 1);
        case_check(a == FW_ERR_ARG && b == FW_ERR_ARG && strstr(fw_last_error(), "overflows a float"),
                   "scale %g softcap %g: %d %d (%s)", (double)sc[c][0], (double)sc[c][1], (int)a, (int)b,
                   fw_last_error());
        case_check(o[0] == 0, "out written");
    }
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.scale = 1e30f;
    p.softcap = 1e-2f * 1e5f; /* multiplier 1e33: fine */
    case_check(fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p) == FW_OK && o[0] == o[0], "a large finite multiplier: %s",
               fw_last_error());
    case_end();
}

const test_suite attn_suites[] = {
    {"attn.scale_overflow", test_scale_overflow},
    {"attn.decode_strided_extent", test_decode_strided_extent},
    {"attn.decode_prefetch_bits", test_decode_prefetch_bits},
    {"attn.negative_windows", test_negative_windows},
    {"attn.contiguous_descriptors", test_contiguous_descriptors},
    {"attn.heuristics", test_heuristics},
    {"attn.partial_tables", test_partial_tables},
    {"attn.micro_kernels", test_micro_kernels},
    {"attn.bf16_products", test_bf16_products},
    {"attn.bad_input", test_bad_input},
    {"attn.workspace", test_workspace},
    {"attn.threads_identical", test_threads_identical},
    {"attn.concurrent_callers", test_concurrent_callers},
    {"attn.auto_precision", test_auto_precision},
    {"attn.fork_child", test_fork_child},
    {"attn.overflow_replay", test_overflow_replay},
    {"attn.varlen", test_varlen},
    {"attn.sweep_masks", sweep_masks},
    {"attn.sweep_techniques", sweep_techniques},
    {"attn.sweep_layouts_dtypes", sweep_layouts_dtypes},
    {"attn.sweep_ratios_dims", sweep_ratios_dims},
    {"attn.sweep_lengths", sweep_lengths},
    {NULL, NULL}};
