/*
 * test_attn_bwd.c: attention backward (fw_attn_bwd, fw_attn_varlen_bwd) against the float64
 * reference, on every kernel table the host runs: lengths, GQA/MQA ratios, head dims, dtypes
 * of the inputs and of the gradients, masks, softcap, strided views, varlen with empty
 * sequences, guard bytes, thread-count invariance, workspace, NaN, bad input.
 * Each case runs the forward (f32 products) for out and lse, then the backward in both product
 * precisions. Accuracy bar per gradient against the exact float64 reference given the same
 * out and lse: max |kernel - ref| <= 2 x E + 1e-5 x (1 + max |ref|), where E is, for f32
 * products, the error of the row-at-a-time f32 backward (FW_ATTN_PLAIN), and for bf16
 * products that of the same-roundings float64 reference (inputs, P and dS rounded to bf16
 * where they enter products) rounded to the gradient's dtype.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "attn/bwd.h"
#include "test_util.h"

typedef struct {
    int64_t b, sq, sk, hq, hkv, d, dv;
    fw_dtype dt, gdt; /* inputs (q, k, v, out, dout); gradients */
    int causal;
    int64_t wl, wr;
    float softcap;
    int layout; /* 0: contiguous [b, s, h, d]; 1: [b, h, s, d] with padding; 2: dim stride 2 */
    int sinks;  /* 1: attention sinks (f32 [hq]), and their gradient dsinks checked */
} bshape;

/* q, k, v, out, dout, lse and the three gradients; gradients in their own guarded buffers. */
typedef struct {
    bshape s;
    gbuf in, l, g[3], sb, dsb;
    fw_tensor q, k, v, o, go, lse, d[3]; /* d: dq, dk, dv */
    fw_tensor sinks, dsinks;
} bprob;

/* A problem's sinks (and the gradient ds, NULL for none) into params p. */
static void sinks_into(const bprob *P, fw_attn_params *p, const fw_tensor *ds)
{
    p->sinks = P->s.sinks ? &P->sinks : NULL;
    p->dsinks = P->s.sinks ? ds : NULL;
}

static void describe(char *buf, size_t n, const bshape *s)
{
    snprintf(buf, n, "b%lld sq%lld sk%lld h%lld:%lld d%lld dv%lld %s->%s%s w(%lld,%lld) cap%g L%d%s",
             (long long)s->b, (long long)s->sq, (long long)s->sk, (long long)s->hq,
             (long long)s->hkv, (long long)s->d, (long long)s->dv, fw_dtype_name(s->dt),
             fw_dtype_name(s->gdt), s->causal ? " causal" : "", (long long)s->wl, (long long)s->wr,
             (double)s->softcap, s->layout, s->sinks ? " sinks" : "");
}

static void params_of(const bshape *s, fw_attn_params *p, const char *isa, int threads, uint32_t flags)
{
    fw_attn_params_init(p);
    p->causal = s->causal;
    p->window_left = s->wl;
    p->window_right = s->wr;
    p->softcap = s->softcap;
    p->isa = isa;
    p->threads = threads;
    p->flags = flags;
    p->precision = FW_PREC_F32;
}

static void prob_make(bprob *P, const bshape *s, uint64_t seed)
{
    memset(P, 0, sizeof *P);
    P->s = *s;
    const int bshd[4] = {0, 1, 2, 3}, bhsd[4] = {0, 2, 1, 3};
    const int *perm = s->layout == 1 ? bhsd : bshd;
    const int64_t pad = s->layout == 1 ? 3 : 0, st = s->layout == 2 ? 2 : 1;
    const int64_t shp[5][4] = {{s->b, s->sq, s->hq, s->d}, {s->b, s->sk, s->hkv, s->d},
                               {s->b, s->sk, s->hkv, s->dv}, {s->b, s->sq, s->hq, s->dv},
                               {s->b, s->sq, s->hq, s->dv}};
    fw_tensor t[5];
    int64_t ext[5], total = 0;
    for (int i = 0; i < 5; i++) {
        t[i] = tview4(NULL, s->dt, shp[i], perm, pad, st, &ext[i]);
        total += ext[i];
    }
    const size_t es = fw_dtype_size(s->dt);
    P->in = gbuf_new((size_t)(total + 1) * es);
    char *base = P->in.p;
    for (int i = 0; i < 5; i++) {
        t[i].data = base;
        base += ext[i] * (int64_t)es;
    }
    P->q = t[0]; P->k = t[1]; P->v = t[2]; P->o = t[3]; P->go = t[4];
    const int64_t ls[3] = {s->b, s->hq, s->sq};
    P->l = gbuf_new((size_t)(s->b * s->hq * s->sq + 1) * 4);
    P->lse = fw_tensor_contiguous(P->l.p, FW_F32, 3, ls);
    const int64_t *gs[3] = {shp[0], shp[1], shp[2]};
    for (int i = 0; i < 3; i++) {
        int64_t e;
        fw_tensor g = tview4(NULL, s->gdt, gs[i], perm, s->layout ? 5 : 0, 1, &e);
        P->g[i] = gbuf_new((size_t)(e + 1) * fw_dtype_size(s->gdt));
        P->d[i] = g;
        P->d[i].data = P->g[i].p;
    }
    rng_seed(seed);
    tfill_normal(&P->q, 1.0);
    tfill_normal(&P->k, 1.0);
    tfill_normal(&P->v, 1.0);
    tfill_normal(&P->go, 1.0);
    if (s->sinks) {
        /* by head: near the rows' lse, dominating it, far below it, random */
        P->sb = gbuf_new((size_t)s->hq * 4);
        P->dsb = gbuf_new((size_t)s->hq * 4);
        P->sinks = fw_tensor_contiguous(P->sb.p, FW_F32, 1, &s->hq);
        P->dsinks = fw_tensor_contiguous(P->dsb.p, FW_F32, 1, &s->hq);
        for (int64_t h = 0; h < s->hq; h++)
            ((float *)P->sb.p)[h] = h % 4 == 0 ? 4.0f : h % 4 == 1 ? 40.0f : h % 4 == 2 ? -30.0f
                                                                              : (float)rng_normal();
    }
    fw_attn_params p;
    params_of(s, &p, NULL, 0, 0);
    sinks_into(P, &p, NULL);
    fw_status r = fw_attn_fwd(&P->q, &P->k, &P->v, &P->o, &P->lse, &p);
    case_check(r == FW_OK, "forward returned %s: %s", fw_status_string(r), fw_last_error());
}

static void prob_free(bprob *P)
{
    gbuf_free(&P->in);
    gbuf_free(&P->l);
    for (int i = 0; i < 3; i++)
        gbuf_free(&P->g[i]);
    if (P->s.sinks) {
        gbuf_free(&P->sb);
        gbuf_free(&P->dsb);
    }
}

/* The three gradients as doubles, in index order (n[i] values each). */
typedef struct {
    double *x[3];
    int64_t n[3];
} grads;

static grads grads_of(const fw_tensor d[3])
{
    grads g;
    for (int i = 0; i < 3; i++) {
        g.n[i] = 1;
        for (int j = 0; j < d[i].ndim; j++)
            g.n[i] *= d[i].shape[j];
        g.x[i] = malloc((size_t)(g.n[i] + 1) * sizeof(double));
        int64_t idx[4] = {0}, n = 0;
        if (g.n[i])
            do g.x[i][n++] = tget(&d[i], idx); while (tnext(&d[i], idx));
    }
    return g;
}

static void grads_free(grads *g)
{
    for (int i = 0; i < 3; i++)
        free(g->x[i]);
}

static fw_status run_bwd(bprob *P, const char *isa, int threads, uint32_t flags, int prec)
{
    fw_attn_params p;
    params_of(&P->s, &p, isa, threads, flags);
    sinks_into(P, &p, &P->dsinks);
    p.precision = prec;
    for (int i = 0; i < 3; i++)
        memset(P->g[i].p, 0xA5, P->g[i].bytes);
    if (P->s.sinks)
        memset(P->dsb.p, 0xA5, P->dsb.bytes);
    return fw_attn_bwd(&P->q, &P->k, &P->v, &P->o, &P->go, &P->lse, &P->d[0], &P->d[1], &P->d[2], &p);
}

/* The float64 reference's gradients (dense f64 tensors of the gradients' shapes): exact
 * (FW_PREC_F32), or with the roundings of bf16 products, then rounded to the gradients' dtype
 * (FW_PREC_BF16); with sinks, their gradient into ds (hq doubles) unless it is NULL. */
static grads reference(const bprob *P, int prec, double *ds)
{
    fw_tensor d[3];
    grads g;
    for (int i = 0; i < 3; i++) {
        int64_t shp[4];
        for (int j = 0; j < 4; j++)
            shp[j] = P->d[i].shape[j];
        g.n[i] = shp[0] * shp[1] * shp[2] * shp[3];
        g.x[i] = calloc((size_t)g.n[i] + 1, sizeof(double));
        d[i] = fw_tensor_contiguous(g.x[i], FW_F64, 4, shp);
    }
    fw_attn_params p;
    params_of(&P->s, &p, NULL, 1, 0);
    fw_tensor tds = fw_tensor_contiguous(ds, FW_F64, 1, &P->s.hq);
    sinks_into(P, &p, ds ? &tds : NULL);
    p.precision = prec;
    fw_status r = fw_attn_bwd_ref(&P->q, &P->k, &P->v, &P->o, &P->go, &P->lse, &d[0], &d[1], &d[2], &p);
    case_check(r == FW_OK, "reference returned %s: %s", fw_status_string(r), fw_last_error());
    if (prec == FW_PREC_BF16)
        for (int i = 0; i < 3; i++)
            for (int64_t j = 0; j < g.n[i]; j++)
                g.x[i][j] = round_to(P->s.gdt, g.x[i][j]);
    return g;
}

/* max |x - ref| (NaN: infinite) and max |ref| of gradient i. */
static double max_err(const grads *x, const grads *ref, int i, double *mag)
{
    double e = 0.0;
    *mag = 0.0;
    for (int64_t j = 0; j < ref->n[i]; j++) {
        const double a = fabs(x->x[i][j] - ref->x[i][j]);
        e = a <= e ? e : isnan(a) ? INFINITY : a;
        *mag = fmax(*mag, fabs(ref->x[i][j]));
    }
    return e;
}

static const char *gname[3] = {"dq", "dk", "dv"};

static void run_shape(const bshape *s, int threads)
{
    char name[256];
    describe(name, sizeof name, s);
    case_begin("attn_bwd %s threads %d", name, threads);
    bprob P;
    prob_make(&P, s, (uint64_t)(s->sq * 131 + s->sk * 7 + s->d + s->hq * 3 + s->layout));
    double *ds = calloc((size_t)s->hq, sizeof(double));
    grads R = reference(&P, FW_PREC_F32, ds), SR = reference(&P, FW_PREC_BF16, NULL);
    fw_status r = run_bwd(&P, NULL, 1, FW_ATTN_PLAIN, FW_PREC_AUTO);
    case_check(r == FW_OK, "plain returned %s: %s", fw_status_string(r), fw_last_error());
    grads pl = grads_of(P.d);
    for (int t = 0; t < fw_isa_count(); t++) {
        const char *isa = fw_isa_name(t);
        if (!test_table(isa))
            continue;
        for (int prec = FW_PREC_F32; prec <= FW_PREC_BF16; prec++) {
            const char *pn = prec == FW_PREC_BF16 ? "bf16" : "f32";
            r = run_bwd(&P, isa, threads, 0, prec);
            case_check(r == FW_OK, "[%s %s] returned %s: %s", isa, pn, fw_status_string(r), fw_last_error());
            for (int i = 0; i < 3; i++)
                case_check(tuntouched(&P.g[i], &P.d[i]), "[%s %s] %s: bytes outside the view or "
                           "guards written", isa, pn, gname[i]);
            grads k = grads_of(P.d);
            /* dsinks: the same sum of f32 terms (D, lse) in double on every path, so within
             * rounding of the terms of the reference's */
            for (int64_t h = 0; h < s->hq && s->sinks; h++) {
                const double got = ((float *)P.dsb.p)[h];
                case_check(fabs(got - ds[h]) <= 1e-5 * (1 + fabs(ds[h])) && gbuf_guards_ok(&P.dsb),
                           "[%s %s] dsinks[%lld] %.9g, reference %.9g", isa, pn, (long long)h, got, ds[h]);
            }
            for (int i = 0; i < 3; i++) {
                double mag, eb = max_err(prec == FW_PREC_BF16 ? &SR : &pl, &R, i, &mag),
                            ek = max_err(&k, &R, i, &mag);
                case_check(ek <= 2 * eb + 1e-5 * (1 + mag), "[%s %s products] %s error %.3g > 2 x "
                           "%s %.3g + 1e-5 x (1 + %.3g)", isa, pn, gname[i], ek,
                           prec == FW_PREC_BF16 ? "same-roundings" : "plain", eb, mag);
            }
            grads_free(&k);
        }
    }
    grads_free(&pl);
    grads_free(&SR);
    grads_free(&R);
    free(ds);
    prob_free(&P);
    case_end();
}

static bshape base(void)
{
    bshape s = {1, 64, 64, 4, 2, 64, 64, FW_F32, FW_F32, 0, -1, -1, 0.0f, 0, 0};
    return s;
}

/* Odd lengths across the 64-key tiles and 128-key blocks, sq != sk, causal or not. */
static void sweep_lengths(void)
{
    const int64_t L[][2] = {{1, 1}, {1, 70}, {7, 7}, {63, 65}, {65, 63}, {100, 129}, {129, 100},
                            {200, 257}, {257, 130}};
    const int n = quick_mode() ? 5 : (int)(sizeof L / sizeof L[0]);
    for (int i = 0; i < n; i++)
        for (int c = 0; c < 2; c++) {
            bshape s = base();
            s.sq = L[i][0];
            s.sk = L[i][1];
            s.causal = c;
            s.sinks = (i + c) % 3 == 1;
            run_shape(&s, 2);
        }
}

/* GQA / MQA ratios (G = 1, 2, 3, 8, 70: a q tile of one position per head group chunk) and
 * head dims (odd, dv != d, one past a vector). */
static void sweep_ratios_dims(void)
{
    const int64_t H[][2] = {{2, 2}, {4, 2}, {6, 2}, {8, 1}, {70, 1}};
    for (int i = 0; i < 5; i++) {
        bshape s = base();
        s.hq = H[i][0];
        s.hkv = H[i][1];
        s.sq = 37;
        s.sk = 90;
        s.causal = i & 1;
        run_shape(&s, 2);
    }
    const int64_t D[][2] = {{128, 128}, {33, 17}, {17, 64}, {80, 96}, {1, 1}};
    for (int i = 0; i < 5; i++) {
        bshape s = base();
        s.d = D[i][0];
        s.dv = D[i][1];
        s.sq = 70;
        s.sk = 70;
        s.causal = 1;
        run_shape(&s, 2);
    }
}

/* Windows (rows that see no key among them), softcap, batch > 1. */
static void sweep_masks(void)
{
    const int64_t W[][2] = {{16, 0}, {0, 0}, {5, 30}, {-1, 3}, {200, -1}};
    for (int i = 0; i < 5; i++) {
        bshape s = base();
        s.sq = 90;
        s.sk = 150;
        s.wl = W[i][0];
        s.wr = W[i][1];
        s.b = 2;
        s.sinks = i % 2;
        run_shape(&s, 2);
    }
    bshape s = base();
    s.sq = 150;
    s.sk = 60; /* causal with sq > sk: the first 90 rows see no key */
    s.causal = 1;
    run_shape(&s, 2);
    s.sinks = 1;
    run_shape(&s, 2);
    s.sinks = 0;
    s = base();
    s.softcap = 5.0f;
    s.sq = 77;
    s.sk = 130;
    s.causal = 1;
    run_shape(&s, 2);
    s.softcap = 0.5f;
    s.causal = 0;
    run_shape(&s, 2);
}

/* Input and gradient dtypes, strided layouts. */
static void sweep_dtypes_layouts(void)
{
    const fw_dtype dts[3] = {FW_F32, FW_BF16, FW_F16};
    for (int a = 0; a < 3; a++)
        for (int g = 0; g < 3; g++) {
            bshape s = base();
            s.dt = dts[a];
            s.gdt = dts[g];
            s.sq = 45;
            s.sk = 80;
            s.causal = 1;
            s.layout = (a + g) % 3;
            s.sinks = a == g;
            run_shape(&s, 2);
        }
}

/* The bits of every gradient do not depend on the thread count (the splits do not either). */
static void test_threads_identical(void)
{
    bshape s = base();
    s.hq = 8;
    s.hkv = 2;
    s.sq = 300;
    s.sk = 600; /* 2 K/V heads: 4 key splits */
    s.causal = 1;
    s.dt = FW_BF16;
    s.sinks = 1;
    case_begin("attn_bwd: identical bits for threads 1, 2, 3, 7 (sinks and dsinks too)");
    bprob P;
    prob_make(&P, &s, 5);
    unsigned char *first[3] = {NULL, NULL, NULL};
    float dsinks[8];
    for (int i = 0; i < 3; i++)
        first[i] = malloc(P.g[i].bytes);
    const int th[4] = {1, 2, 3, 7};
    for (int t = 0; t < 4; t++) {
        fw_status r = run_bwd(&P, NULL, th[t], 0, FW_PREC_AUTO);
        case_check(r == FW_OK, "threads %d returned %s", th[t], fw_status_string(r));
        if (t == 0)
            memcpy(dsinks, P.dsb.p, sizeof dsinks);
        else
            case_check(memcmp(dsinks, P.dsb.p, sizeof dsinks) == 0, "dsinks differs with %d threads", th[t]);
        for (int i = 0; i < 3; i++) {
            if (t == 0)
                memcpy(first[i], P.g[i].p, P.g[i].bytes);
            else
                case_check(memcmp(first[i], P.g[i].p, P.g[i].bytes) == 0, "%s differs with %d threads",
                           gname[i], th[t]);
        }
    }
    for (int i = 0; i < 3; i++)
        free(first[i]);
    prob_free(&P);
    case_end();
}

/* Varlen with empty sequences (no queries: dk, dv zero; no keys: dq zero) against the
 * varlen reference, with the dense call's bar. */
static void test_varlen(void)
{
    const int32_t lq[5] = {0, 70, 33, 5, 130}, lk[5] = {40, 0, 90, 5, 200};
    for (int causal = 0; causal < 2; causal++) {
        case_begin("attn_bwd varlen, 5 sequences with empty ones, causal %d", causal);
        int32_t cuq[6] = {0}, cuk[6] = {0};
        for (int i = 0; i < 5; i++) {
            cuq[i + 1] = cuq[i] + lq[i];
            cuk[i + 1] = cuk[i] + lk[i];
        }
        const int64_t hq = 4, hkv = 2, d = 48, dv = 40, tq = cuq[5], tk = cuk[5];
        const int64_t sq[3] = {tq, hq, d}, sk[3] = {tk, hkv, d}, sv[3] = {tk, hkv, dv},
                      so[3] = {tq, hq, dv}, sl[2] = {hq, tq};
        double *buf = calloc((size_t)(2 * (tq * hq * (d + dv)) + 2 * tk * hkv * (d + dv) + hq * tq) * 2 + 16,
                             sizeof(double));
        float *f = (float *)buf;
        fw_tensor q = fw_tensor_contiguous(f, FW_F32, 3, sq), k = fw_tensor_contiguous(f + tq * hq * d, FW_F32, 3, sk);
        fw_tensor v = fw_tensor_contiguous((float *)k.data + tk * hkv * d, FW_F32, 3, sv);
        fw_tensor o = fw_tensor_contiguous((float *)v.data + tk * hkv * dv, FW_F32, 3, so);
        fw_tensor go = fw_tensor_contiguous((float *)o.data + tq * hq * dv, FW_F32, 3, so);
        fw_tensor l = fw_tensor_contiguous((float *)go.data + tq * hq * dv, FW_F32, 2, sl);
        rng_seed(17);
        tfill_normal(&q, 1.0);
        tfill_normal(&k, 1.0);
        tfill_normal(&v, 1.0);
        tfill_normal(&go, 1.0);
        fw_attn_params p;
        fw_attn_params_init(&p);
        p.causal = causal;
        p.precision = FW_PREC_F32;
        fw_status r = fw_attn_varlen_fwd(&q, &k, &v, cuq, cuk, 5, &o, &l, &p);
        case_check(r == FW_OK, "forward: %s", fw_last_error());
        /* kernel, plain (f32) and reference (f64) gradients */
        const int64_t *shp[3] = {sq, sk, sv};
        double *g[3][3];
        fw_tensor t[3][3];
        for (int w = 0; w < 3; w++)
            for (int i = 0; i < 3; i++) {
                const int64_t n = shp[i][0] * shp[i][1] * shp[i][2];
                g[w][i] = malloc((size_t)(n + 1) * sizeof(double));
                memset(g[w][i], 0xA5, (size_t)(n + 1) * sizeof(double));
                t[w][i] = fw_tensor_contiguous(g[w][i], w == 2 ? FW_F64 : FW_F32, 3, shp[i]);
            }
        p.threads = 2;
        r = fw_attn_varlen_bwd(&q, &k, &v, &o, &go, &l, cuq, cuk, 5, &t[0][0], &t[0][1], &t[0][2], &p);
        case_check(r == FW_OK, "kernel: %s", fw_last_error());
        p.flags = FW_ATTN_PLAIN;
        r = fw_attn_varlen_bwd(&q, &k, &v, &o, &go, &l, cuq, cuk, 5, &t[1][0], &t[1][1], &t[1][2], &p);
        case_check(r == FW_OK, "plain: %s", fw_last_error());
        r = fw_attn_varlen_bwd_ref(&q, &k, &v, &o, &go, &l, cuq, cuk, 5, &t[2][0], &t[2][1], &t[2][2], &p);
        case_check(r == FW_OK, "reference: %s", fw_last_error());
        for (int i = 0; i < 3; i++) {
            const int64_t n = shp[i][0] * shp[i][1] * shp[i][2];
            double ek = 0, ep = 0, mag = 0;
            for (int64_t j = 0; j < n; j++) {
                const double ref = g[2][i][j];
                const double a = fabs(((float *)g[0][i])[j] - ref), b = fabs(((float *)g[1][i])[j] - ref);
                ek = a <= ek ? ek : isnan(a) ? INFINITY : a;
                ep = b <= ep ? ep : isnan(b) ? INFINITY : b;
                mag = fmax(mag, fabs(ref));
            }
            case_check(ek <= 2 * ep + 1e-5 * (1 + mag), "%s error %.3g > 2 x plain %.3g", gname[i], ek, ep);
        }
        /* sequence 0 has no queries: its keys' gradients are 0; sequence 1 no keys: dq 0 */
        for (int64_t j = 0; j < lk[0] * hkv * d; j++)
            case_check(((float *)g[0][1])[j] == 0.0f, "dk of a sequence without queries is not 0");
        for (int64_t j = 0; j < lq[1] * hq * d; j++)
            case_check(((float *)g[0][0])[cuq[1] * hq * d + j] == 0.0f, "dq of a sequence without keys is not 0");
        for (int w = 0; w < 3; w++)
            for (int i = 0; i < 3; i++)
                free(g[w][i]);
        free(buf);
        case_end();
    }
}

/* fw_attn_bwd_workspace_size is enough, exactly, and a byte less is refused. */
static void test_workspace(void)
{
    case_begin("attn_bwd workspace: the queried size runs, one byte less is refused");
    bshape s = base();
    s.sq = 100;
    s.sk = 300;
    s.causal = 1;
    bprob P;
    prob_make(&P, &s, 9);
    fw_attn_params p;
    params_of(&s, &p, NULL, 2, 0);
    size_t bytes = 0;
    fw_status r = fw_attn_bwd_workspace_size(&P.q, &P.k, &P.v, 0, &p, &bytes);
    case_check(r == FW_OK && bytes > 0, "size: %s", fw_last_error());
    char *ws = malloc(bytes);
    p.workspace = ws;
    p.workspace_bytes = bytes - 1;
    r = fw_attn_bwd(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, &P.d[0], &P.d[1], &P.d[2], &p);
    case_check(r == FW_ERR_WORKSPACE, "one byte short returned %s", fw_status_string(r));
    p.workspace_bytes = bytes;
    r = fw_attn_bwd(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, &P.d[0], &P.d[1], &P.d[2], &p);
    case_check(r == FW_OK, "exact size returned %s: %s", fw_status_string(r), fw_last_error());
    grads a = grads_of(P.d);
    p.workspace = NULL;
    p.workspace_bytes = 0;
    r = run_bwd(&P, NULL, 2, 0, FW_PREC_F32);
    grads b = grads_of(P.d);
    for (int i = 0; i < 3; i++)
        case_check(memcmp(a.x[i], b.x[i], (size_t)a.n[i] * sizeof(double)) == 0,
                   "%s differs between the caller's workspace and the library's", gname[i]);
    grads_free(&a);
    grads_free(&b);
    p.flags = FW_ATTN_PLAIN;
    size_t plain = 0;
    r = fw_attn_bwd_workspace_size(&P.q, &P.k, &P.v, 0, &p, &plain);
    case_check(r == FW_OK && plain > 0, "plain size: %s", fw_last_error());
    free(ws);
    prob_free(&P);
    case_end();
}

/* NaN in one query row: its dq row is NaN and no other dq row is, as in the reference;
 * every dk / dv the reference makes NaN is NaN. */
static void test_nan(void)
{
    for (int t = 0; t < fw_isa_count(); t++) {
        const char *isa = fw_isa_name(t);
        if (!test_table(isa))
            continue;
        case_begin("attn_bwd [%s]: a NaN in q row 20 reaches dq row 20 only, and dk / dv as in the "
                   "reference", isa);
        bshape s = base();
        s.sq = s.sk = 90;
        s.causal = 1;
        s.hq = s.hkv = 1;
        bprob P;
        prob_make(&P, &s, 3);
        const int64_t idx[4] = {0, 20, 0, 5};
        tset(&P.q, idx, NAN);
        grads R = reference(&P, FW_PREC_F32, NULL);
        fw_status r = run_bwd(&P, isa, 2, 0, FW_PREC_AUTO);
        case_check(r == FW_OK, "returned %s", fw_status_string(r));
        grads k = grads_of(P.d);
        for (int64_t j = 0; j < k.n[0]; j++)
            case_check(isnan(k.x[0][j]) == isnan(R.x[0][j]), "dq[%lld]: kernel %g, reference %g",
                       (long long)j, k.x[0][j], R.x[0][j]);
        for (int i = 1; i < 3; i++)
            for (int64_t j = 0; j < k.n[i]; j++)
                if (isnan(R.x[i][j]))
                    case_check(isnan(k.x[i][j]), "%s[%lld] is %g, the reference NaN", gname[i],
                               (long long)j, k.x[i][j]);
        grads_free(&k);
        grads_free(&R);
        prob_free(&P);
        case_end();
    }
}

static void expect_bad(bprob *P, const char *what, fw_status got, fw_status want)
{
    case_begin("attn_bwd bad input: %s", what);
    case_check(got == want, "returned %s, expected %s (%s)", fw_status_string(got),
               fw_status_string(want), fw_last_error());
    case_check(fw_last_error()[0] != 0, "no message");
    for (int i = 0; i < 3; i++) {
        int ok = gbuf_guards_ok(&P->g[i]);
        for (size_t j = 0; j < P->g[i].bytes && ok; j++)
            ok = ((unsigned char *)P->g[i].p)[j] == 0xA5;
        case_check(ok, "%s was written", gname[i]);
    }
    case_end();
}

static void test_bad_input(void)
{
    bshape s = base();
    s.sq = 20;
    s.sk = 30;
    bprob P;
    case_begin("attn_bwd bad input: setup");
    prob_make(&P, &s, 11);
    case_end();
    for (int i = 0; i < 3; i++)
        memset(P.g[i].p, 0xA5, P.g[i].bytes);
    fw_attn_params p;
    params_of(&s, &p, NULL, 2, 0);
    const fw_tensor *dq = &P.d[0], *dk = &P.d[1], *dv = &P.d[2];
#define BWD(q, k, v, o, go, l, a, b, c, pp) fw_attn_bwd(q, k, v, o, go, l, a, b, c, pp)
    expect_bad(&P, "lse NULL", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, NULL, dq, dk, dv, &p), FW_ERR_NULL);
    expect_bad(&P, "dout NULL", BWD(&P.q, &P.k, &P.v, &P.o, NULL, &P.lse, dq, dk, dv, &p), FW_ERR_NULL);
    expect_bad(&P, "dk NULL", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, dq, NULL, dv, &p), FW_ERR_NULL);
    fw_tensor bad = *dq;
    bad.shape[3] = 63;
    expect_bad(&P, "dq's head dim differs from q's", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, &bad, dk, dv, &p),
               FW_ERR_SHAPE);
    bad = *dv;
    bad.shape[1] = 29;
    expect_bad(&P, "dv's length differs from v's", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, dq, dk, &bad, &p),
               FW_ERR_SHAPE);
    bad = P.go;
    bad.shape[2] = 3;
    expect_bad(&P, "dout's heads differ from out's", BWD(&P.q, &P.k, &P.v, &P.o, &bad, &P.lse, dq, dk, dv, &p),
               FW_ERR_SHAPE);
    bad = *dq;
    bad.dtype = FW_F64;
    expect_bad(&P, "dq is f64 (reference only)", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, &bad, dk, dv, &p),
               FW_ERR_DTYPE);
    bad = *dk;
    bad.data = dq->data;
    expect_bad(&P, "dk overlaps dq", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, dq, &bad, dv, &p),
               FW_ERR_STRIDE);
    bad = *dq;
    bad.data = P.q.data;
    expect_bad(&P, "dq overlaps q", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, &bad, dk, dv, &p),
               FW_ERR_STRIDE);
    bad = *dv;
    bad.stride[1] = 0;
    expect_bad(&P, "dv's rows alias", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, dq, dk, &bad, &p),
               FW_ERR_STRIDE);
    bad = *dq;
    bad.shape[0] = INT64_MAX / 2;
    expect_bad(&P, "dq's size overflows", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, &bad, dk, dv, &p),
               FW_ERR_OVERFLOW);
    fw_attn_params pb = p;
    pb.flags = FW_ATTN_ONLINE_SOFTMAX;
    expect_bad(&P, "a forward-only flag", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, dq, dk, dv, &pb), FW_ERR_ARG);
    pb = p;
    pb.isa = "bogus";
    expect_bad(&P, "unknown table", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, dq, dk, dv, &pb),
               FW_ERR_UNSUPPORTED);
    /* sinks and their gradient */
    float sk[8] = {0}, dsk[8];
    const int64_t n4 = 4, n3 = 3;
    fw_tensor ts = fw_tensor_contiguous(sk, FW_F32, 1, &n4), tds = fw_tensor_contiguous(dsk, FW_F32, 1, &n4);
    fw_tensor ts3 = fw_tensor_contiguous(sk, FW_F32, 1, &n3), tdsb = tds;
    tdsb.dtype = FW_BF16;
    const struct { const char *what; const fw_tensor *sinks, *dsinks; fw_status want; } sc[] = {
        {"dsinks without sinks", NULL, &tds, FW_ERR_NULL},
        {"sinks of 3 values for 4 heads", &ts3, &tds, FW_ERR_SHAPE},
        {"dsinks of 3 values for 4 heads", &ts, &ts3, FW_ERR_SHAPE},
        {"dsinks bf16", &ts, &tdsb, FW_ERR_DTYPE},
        {"dsinks overlaps sinks", &ts, &ts, FW_ERR_STRIDE},
    };
    for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++) {
        memset(dsk, 0xA5, sizeof dsk);
        pb = p;
        pb.sinks = sc[i].sinks;
        pb.dsinks = sc[i].dsinks;
        expect_bad(&P, sc[i].what, BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, dq, dk, dv, &pb), sc[i].want);
        unsigned char ff[sizeof dsk];
        memset(ff, 0xA5, sizeof ff);
        case_begin("attn_bwd bad input: %s leaves dsinks unwritten", sc[i].what);
        case_check(memcmp(dsk, ff, sizeof dsk) == 0, "dsinks was written");
        case_end();
    }
    pb = p;
    pb.sinks = &ts;
    tdsb = P.lse;
    tdsb.ndim = 1;
    tdsb.shape[0] = 4;
    pb.dsinks = &tdsb;
    expect_bad(&P, "dsinks overlaps lse", BWD(&P.q, &P.k, &P.v, &P.o, &P.go, &P.lse, dq, dk, dv, &pb),
               FW_ERR_STRIDE);
    const int32_t cu_bad[3] = {0, 30, 10};
    fw_tensor q3 = P.q, k3 = P.k, v3 = P.v, o3 = P.o, g3 = P.go, a3 = *dq, b3 = *dk, c3 = *dv;
    fw_tensor *all[8] = {&q3, &k3, &v3, &o3, &g3, &a3, &b3, &c3};
    for (int i = 0; i < 8; i++) { /* drop the batch dim of [1, s, h, d] */
        all[i]->ndim = 3;
        for (int j = 0; j < 3; j++) {
            all[i]->shape[j] = all[i]->shape[j + 1];
            all[i]->stride[j] = all[i]->stride[j + 1];
        }
    }
    const int64_t ls[2] = {4, 20};
    fw_tensor l2 = fw_tensor_contiguous(P.lse.data, FW_F32, 2, ls);
    expect_bad(&P, "varlen cu_seqlens_q decreasing",
               fw_attn_varlen_bwd(&q3, &k3, &v3, &o3, &g3, &l2, cu_bad, cu_bad, 2, &a3, &b3, &c3, &p),
               FW_ERR_SEQLENS);
    bprob *Pp = &P;
    case_begin("attn_bwd bad input: no crash on every NULL tensor pointer");
    for (int i = 0; i < 9; i++) {
        const fw_tensor *t[9] = {&Pp->q, &Pp->k, &Pp->v, &Pp->o, &Pp->go, &Pp->lse, dq, dk, dv};
        t[i] = NULL;
        fw_status r = fw_attn_bwd(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], &p);
        case_check(r == FW_ERR_NULL, "tensor %d NULL returned %s", i, fw_status_string(r));
    }
    case_end();
#undef BWD
    prob_free(&P);
}

/* Attention sinks: the reference backward's gradients (dsinks, dq, dk, dv) against central
 * differences of the float64 reference forward's loss sum(dout o out), which checks the
 * formula of dsinks and that lse including the sink leaves dq, dk, dv right. */
static void test_sinks_finite_differences(void)
{
    case_begin("attn_bwd sinks: the reference's gradients match central differences");
    enum { SQ = 5, SK = 7, HQ = 4, HKV = 2, D = 8 };
    const int64_t qs[4] = {1, SQ, HQ, D}, ks[4] = {1, SK, HKV, D}, os[4] = {1, SQ, HQ, D},
                  ls[3] = {1, HQ, SQ}, hq = HQ;
    double o[SQ * HQ * D], l[HQ * SQ], g[3][SQ * HQ * D], sinks[HQ] = {0.5, 2.0, -1.0, 1.5}, ds[HQ];
    /* the inputs are f32 tensors (attention takes no f64 input): their f32 values, as doubles */
    float qf[SQ * HQ * D], kf[SK * HKV * D], vf[SK * HKV * D], gof[SQ * HQ * D], sf[HQ];
    rng_seed(31);
    for (int i = 0; i < SQ * HQ * D; i++) { qf[i] = (float)rng_normal(); gof[i] = (float)rng_normal(); }
    for (int i = 0; i < SK * HKV * D; i++) { kf[i] = (float)rng_normal(); vf[i] = (float)rng_normal(); }
    fw_tensor tq = fw_tensor_contiguous(qf, FW_F32, 4, qs), tk = fw_tensor_contiguous(kf, FW_F32, 4, ks),
              tv = fw_tensor_contiguous(vf, FW_F32, 4, ks), tgo = fw_tensor_contiguous(gof, FW_F32, 4, os),
              to = fw_tensor_contiguous(o, FW_F64, 4, os), tl = fw_tensor_contiguous(l, FW_F64, 3, ls),
              ts = fw_tensor_contiguous(sf, FW_F32, 1, &hq), tds = fw_tensor_contiguous(ds, FW_F64, 1, &hq),
              tg[3] = {fw_tensor_contiguous(g[0], FW_F64, 4, qs), fw_tensor_contiguous(g[1], FW_F64, 4, ks),
                       fw_tensor_contiguous(g[2], FW_F64, 4, ks)};
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.causal = 1;
    p.precision = FW_PREC_F32;
    p.sinks = &ts;
    for (int h = 0; h < HQ; h++)
        sf[h] = (float)sinks[h];
    fw_status r = fw_attn_ref(&tq, &tk, &tv, &to, &tl, &p, 0, INT64_MAX);
    p.dsinks = &tds;
    if (!r)
        r = fw_attn_bwd_ref(&tq, &tk, &tv, &to, &tgo, &tl, &tg[0], &tg[1], &tg[2], &p);
    case_check(r == FW_OK, "reference: %s", fw_last_error());
    p.dsinks = NULL;
    /* loss(x) with one f32 input perturbed by +-e (exact in f32 at these magnitudes) */
    const float e = 1.0f / 1024;
    float *xs[4] = {sf, qf, kf, vf};
    const double *gs[4] = {ds, g[0], g[1], g[2]};
    const char *names[4] = {"dsinks", "dq", "dk", "dv"};
    const int pick[4] = {HQ, SQ * HQ * D, SK * HKV * D, SK * HKV * D};
    for (int w = 0; w < 4; w++)
        for (int i = 0; i < pick[w]; i += w ? 13 : 1) {
            double loss[2];
            const float x0 = xs[w][i];
            for (int sgn = 0; sgn < 2; sgn++) {
                xs[w][i] = x0 + (sgn ? -e : e);
                double o2[SQ * HQ * D];
                fw_tensor to2 = fw_tensor_contiguous(o2, FW_F64, 4, os);
                r = fw_attn_ref(&tq, &tk, &tv, &to2, NULL, &p, 0, INT64_MAX);
                loss[sgn] = 0;
                for (int j = 0; j < SQ * HQ * D; j++)
                    loss[sgn] += o2[j] * gof[j];
            }
            xs[w][i] = x0;
            const double fd = (loss[0] - loss[1]) / (2.0 * (double)e);
            case_check(r == FW_OK && fabs(fd - gs[w][i]) <= 1e-5 * (1 + fabs(fd)),
                       "%s[%d]: reference %.9g, central difference %.9g", names[w], i, gs[w][i], fd);
        }
    case_end();
}

/* The tiling functions' documented examples. */
static void test_heuristics(void)
{
    case_begin("attn_bwd heuristics: splits and q tiles");
    case_check(fw_attn_bwd_splits(1, 8, 4096) == 2, "1 x 8, 4096 keys: %d", fw_attn_bwd_splits(1, 8, 4096));
    case_check(fw_attn_bwd_splits(16, 8, 4096) == 1, "16 x 8: %d", fw_attn_bwd_splits(16, 8, 4096));
    case_check(fw_attn_bwd_splits(1, 1, 100) == 1, "1 x 1, 100 keys: %d", fw_attn_bwd_splits(1, 1, 100));
    case_check(fw_attn_bwd_splits(1, 1, 1 << 20) == 4, "1 x 1, 1M keys: %d", fw_attn_bwd_splits(1, 1, 1 << 20));
    case_check(fw_attn_bwd_splits(0, 8, 0) == 1, "empty batch: %d", fw_attn_bwd_splits(0, 8, 0));
    int bq, gh;
    fw_attn_bwd_tile(4, &bq, &gh);
    case_check(bq == 16 && gh == 4, "G 4: %d x %d", bq, gh);
    fw_attn_bwd_tile(1, &bq, &gh);
    case_check(bq == 64 && gh == 1, "G 1: %d x %d", bq, gh);
    fw_attn_bwd_tile(100, &bq, &gh);
    case_check(bq == 1 && gh == 64, "G 100: %d x %d", bq, gh);
    case_end();
}

const test_suite attn_bwd_suites[] = {
    {"attn_bwd.sweep_lengths", sweep_lengths},
    {"attn_bwd.sweep_ratios_dims", sweep_ratios_dims},
    {"attn_bwd.sweep_masks", sweep_masks},
    {"attn_bwd.sweep_dtypes_layouts", sweep_dtypes_layouts},
    {"attn_bwd.threads_identical", test_threads_identical},
    {"attn_bwd.varlen", test_varlen},
    {"attn_bwd.workspace", test_workspace},
    {"attn_bwd.nan", test_nan},
    {"attn_bwd.sinks_finite_differences", test_sinks_finite_differences},
    {"attn_bwd.bad_input", test_bad_input},
    {"attn_bwd.heuristics", test_heuristics},
    {NULL, NULL}};
