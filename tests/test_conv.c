/*
 * test_conv.c: the causal conv1d (fw_conv1d_fwd) against its float64 reference: every table,
 * every dtype of x / weight / cache, widths 1..17, channel counts across the 256-channel
 * blocks, lengths across the 64-token items (0, 1, short of W, long), packed (cu_seqlens) and
 * batched, channel-last / channel-first / padded layouts, bias, SiLU, residual, and conv
 * states: none, separate init and final, in place by slot index (with a skipped sequence),
 * circular (offsets). Outputs within 2x the output rounding plus 2^-20 of the sum of the
 * terms' magnitudes; final states bit-identical; NaN and inf where the reference has them;
 * bit-identical results for any thread count; every class of bad input refused with nothing
 * written.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "conv/conv.h"
#include "test_util.h"

typedef struct {
    int64_t B, L, D, W;
    fw_dtype dt, wdt, cdt;
    int layout;  /* 0: [B, L, D]; 1: stored [B, D, L] (causal-conv1d's); 2: rows padded */
    int varlen;  /* cu_seqlens over one packed row */
    int states;  /* 0 none, 1 init, 2 init + final apart, 3 in place by index, 4 circular */
    int silu, res, bias;
    int specials; /* a NaN and infinities in x */
} ccase;

/* A [B, L, D] tensor of dtype dt in `layout`, in a fresh buffer. */
static fw_tensor conv_tensor(gbuf *g, fw_dtype dt, int64_t B, int64_t L, int64_t D, int layout)
{
    int64_t sh[3] = {B, L, D};
    const int64_t pad = layout == 2 ? 3 : 0;
    *g = gbuf_new((size_t)(B * L * (D + pad) + 1) * fw_dtype_size(dt));
    fw_tensor t = fw_tensor_contiguous(g->p, dt, 3, sh);
    if (layout == 1) {
        t.stride[1] = 1;
        t.stride[2] = L;
    } else if (layout == 2) {
        t.stride[1] = D + pad;
        t.stride[0] = L * (D + pad);
    }
    return t;
}

/* A copy of t as f32 magnitudes, contiguous. */
static fw_tensor abs_copy(const fw_tensor *t, float **buf)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    *buf = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    fw_tensor a = fw_tensor_contiguous(*buf, FW_F32, t->ndim, t->shape);
    int64_t idx[FW_MAX_DIMS] = {0};
    if (n > 0)
        do
            tset(&a, idx, fabs(tget(t, idx)));
        while (tnext(t, idx));
    return a;
}

/* Twice the rounding of a dtype: relative, and absolute among its subnormals. */
static double unit_of(fw_dtype dt)
{
    return dt == FW_BF16 ? 0x1p-8 : dt == FW_F16 ? 0x1p-10 : 0x1p-23;
}

static double tiny_of(fw_dtype dt)
{
    return dt == FW_BF16 ? 0x1p-133 : dt == FW_F16 ? 0x1p-24 : 0x1p-149;
}

static void run_ccase(const ccase *cc, const fw_kernels *kt, uint64_t seed)
{
    rng_seed(seed);
    const int64_t D = cc->D, W = cc->W;
    int64_t B = cc->B, L = cc->L, n = cc->B;
    int32_t cu[8] = {0};
    if (cc->varlen) { /* lengths 0, 1, W-1, a long one, ... packed in one row */
        static const int32_t lens[] = {0, 1, 3, 70, 2, 133, 5};
        n = 7;
        for (int i = 0; i < n; i++)
            cu[i + 1] = cu[i] + lens[i];
        B = 1;
        L = cu[n];
    }
    gbuf gx, go, gr, gw, gb, gi, gf, gc, gref;
    fw_tensor x = conv_tensor(&gx, cc->dt, B, L, D, cc->layout), out = conv_tensor(&go, cc->dt, B, L, D, cc->layout);
    fw_tensor res = conv_tensor(&gr, cc->dt, B, L, D, 0);
    int64_t wsh[2] = {D, W}, bsh[1] = {D}, rsh[3] = {B, L, D};
    gw = gbuf_new((size_t)(D * W) * fw_dtype_size(cc->wdt));
    gb = gbuf_new((size_t)D * fw_dtype_size(cc->wdt) + 1);
    fw_tensor w = fw_tensor_contiguous(gw.p, cc->wdt, 2, wsh), bias = fw_tensor_contiguous(gb.p, cc->wdt, 1, bsh);
    gref = gbuf_new((size_t)(B * L * D + 1) * sizeof(double));
    fw_tensor ref = fw_tensor_contiguous(gref.p, FW_F64, 3, rsh);
    tfill_normal(&x, 1.0);
    tfill_normal(&res, 1.0);
    tfill_normal(&w, 1.0 / sqrt((double)W));
    tfill_normal(&bias, 0.5);
    if (cc->specials && L > 2 && D > 1) {
        int64_t a[3] = {0, L / 2, 1}, b2[3] = {0, 1, 0}, c3[3] = {0, L - 1, D - 1};
        tset(&x, a, NAN);
        tset(&x, b2, INFINITY);
        tset(&x, c3, -INFINITY);
    }
    /* states: slots = n + 3, a permutation of slots, sequence 2 without a read slot */
    const int64_t slots = n + 3, S = cc->states == 4 ? W + 2 : (cc->states == 2 ? W : W - 1);
    int64_t ssh[3] = {slots, S, D};
    gi = gbuf_new((size_t)(slots * S * D + 1) * fw_dtype_size(cc->cdt));
    gf = gbuf_new((size_t)(slots * S * D + 1) * fw_dtype_size(cc->cdt));
    gc = gbuf_new((size_t)(slots * S * D + 1) * fw_dtype_size(cc->cdt));
    fw_tensor ci = fw_tensor_contiguous(gi.p, cc->cdt, 3, ssh), cf = fw_tensor_contiguous(gf.p, cc->cdt, 3, ssh);
    fw_tensor cc2 = fw_tensor_contiguous(gc.p, cc->cdt, 3, ssh);
    tfill_normal(&ci, 1.0);
    tfill_normal(&cf, 1.0);
    int32_t ridx[8], widx[8], roff[8], woff[8];
    for (int64_t i = 0; i < n; i++) {
        ridx[i] = (int32_t)((i * 3 + 1) % slots);
        widx[i] = ridx[i];
        roff[i] = (int32_t)(i * 5 - 3);
        woff[i] = roff[i] + (cc->varlen ? cu[i + 1] - cu[i] : (int32_t)L);
    }
    if (n > 2) {
        ridx[2] = -1;
        widx[(n > 4) ? 4 : 0] = -1;
    }
    fw_conv1d_state si = {ci, NULL, NULL}, sf = {cf, NULL, NULL};
    const fw_conv1d_state *pi = NULL, *pf = NULL;
    switch (cc->states) {
    case 1: pi = &si; break;
    case 2: pi = &si; pf = &sf; break;
    case 3: si.idx = ridx; sf = si; sf.idx = widx; pi = &si; pf = &sf; break;
    case 4: si.idx = ridx; si.offsets = roff; sf = si; sf.offsets = woff; pi = &si; pf = &sf; break;
    }
    if (cc->states >= 3) { /* in place: final is the init cache; a sequence writes its own read slot */
        for (int64_t i = 0; i < n; i++)
            if (ridx[i] >= 0 && widx[i] >= 0)
                widx[i] = ridx[i];
        sf.cache = ci;
    }
    fw_conv1d_params p;
    fw_conv1d_params_init(&p);
    p.activation = cc->silu ? FW_ACT_SILU : FW_ACT_NONE;
    p.isa = kt->name;
    /* the reference: on a copy of the final cache (in place: of the init cache) */
    const fw_tensor *fc = pf ? &pf->cache : NULL;
    fw_conv1d_state rfs = pf ? *pf : si, ris = pi ? *pi : si;
    if (pf) {
        memcpy(gc.p, fc->data, (size_t)(slots * S * D) * fw_dtype_size(cc->cdt));
        rfs.cache = cc2;
        if (cc->states >= 3)
            ris.cache = cc2;
    }
    /* the magnitudes of the terms: the same conv on |x|, |w|, |bias|, |init| (pre-activation) */
    float *ax, *aw, *ab, *ai;
    fw_tensor tax = abs_copy(&x, &ax), taw = abs_copy(&w, &aw), tab = abs_copy(&bias, &ab);
    fw_tensor tai = abs_copy(&ci, &ai);
    fw_status st = fw_conv1d_ref(&x, &w, cc->bias ? &bias : NULL, cc->varlen ? cu : NULL, n, pi ? &ris : NULL,
                                 pf ? &rfs : NULL, cc->res ? &res : NULL, &ref, &p);
    gbuf gm = gbuf_new((size_t)(B * L * D + 1) * sizeof(double));
    fw_tensor mag = fw_tensor_contiguous(gm.p, FW_F64, 3, rsh);
    fw_conv1d_state mis = ris;
    mis.cache = tai;
    fw_conv1d_params pm = p;
    pm.activation = FW_ACT_NONE;
    st |= fw_conv1d_ref(&tax, &taw, cc->bias ? &tab : NULL, cc->varlen ? cu : NULL, n, pi ? &mis : NULL, NULL,
                        NULL, &mag, &pm);
    st |= fw_conv1d_fwd(&x, &w, cc->bias ? &bias : NULL, cc->varlen ? cu : NULL, n, pi, pf, cc->res ? &res : NULL,
                        &out, &p);
    case_check(st == FW_OK, "status: %s", fw_last_error());
    double worst = 0;
    int specials_ok = 1;
    int64_t idx[3] = {0};
    if (B * L * D > 0)
        do {
            const double o = tget(&out, idx), r = tget(&ref, idx), m = tget(&mag, idx);
            if (isnan(r) || isinf(r)) {
                specials_ok &= isnan(r) ? isnan(o) : o == r;
                continue;
            }
            const double rr = cc->res ? fabs(tget(&res, idx)) : 0.0;
            worst = worse(worst, fabs(o - r) / (2 * unit_of(cc->dt) * fabs(r) + 0x1p-20 * (m + rr) + tiny_of(cc->dt)));
        } while (tnext(&out, idx));
    case_check(worst <= 1, "out: error %.3g of the bound", worst);
    case_check(specials_ok, "NaN or inf differs from the reference");
    if (pf && S > 0) {
        int same = 1;
        int64_t j[3] = {0};
        do {
            const double a = tget(fc, j), b = tget(&cc2, j);
            same &= a == b || (isnan(a) && isnan(b));
        } while (tnext(fc, j));
        case_check(same, "final states differ from the reference");
    }
    case_check(gbuf_guards_ok(&go) && gbuf_guards_ok(&gi) && gbuf_guards_ok(&gf), "wrote outside a buffer");
    free(ax); free(aw); free(ab); free(ai);
    gbuf_free(&gx); gbuf_free(&go); gbuf_free(&gr); gbuf_free(&gw); gbuf_free(&gb); gbuf_free(&gi);
    gbuf_free(&gf); gbuf_free(&gc); gbuf_free(&gref); gbuf_free(&gm);
}

static void test_conv_sweep(void)
{
    static const int64_t Ws[] = {1, 2, 4, 5, 17}, Ds[] = {1, 7, 300, 33};
    for (int t = 0; t < fw_isa_count(); t++) {
        if (!test_table(fw_isa_name(t)))
            continue;
        const fw_kernels *kt = fw_kernels_get(fw_isa_name(t));
        int k = 0;
        for (int wi = 0; wi < 5; wi++)
            for (int di = 0; di < 4; di++)
                for (int states = 0; states < 5; states++, k++) {
                    if (quick_mode() && k % 3)
                        continue;
                    ccase c = {2, 1 + (k * 37) % 150, Ds[di], Ws[wi], (fw_dtype)(k % 3), (fw_dtype)((k / 3) % 3),
                               (fw_dtype)((k / 2) % 3), k % 3, k % 2, states, (k / 2) % 2, k % 4 == 1,
                               (k / 4) % 2, k % 7 == 3};
                    case_begin("conv1d [%s] W %lld D %lld L %lld %s x, %s w, %s cache, layout %d, %s, states %d%s%s%s",
                               kt->name, (long long)c.W, (long long)c.D, (long long)c.L, fw_dtype_name(c.dt),
                               fw_dtype_name(c.wdt), fw_dtype_name(c.cdt), c.layout, c.varlen ? "packed" : "batched",
                               c.states, c.silu ? ", silu" : "", c.res ? ", residual" : "", c.bias ? ", bias" : "");
                    run_ccase(&c, kt, 100 + (uint64_t)k);
                    case_end();
                }
    }
}

/* The same call on 1, 2 and 3 threads: the same bits. */
static void test_conv_threads(void)
{
    case_begin("conv1d: bit-identical outputs and states on 1, 2, 3 threads");
    enum { L = 300, D = 700, W = 4, SL = 3 };
    static float x[L * D], o[3][L * D], st[3][2 * SL * D], w[D * W];
    int64_t xs[3] = {1, L, D}, ws[2] = {D, W}, ss[3] = {2, SL, D};
    rng_seed(9);
    for (int i = 0; i < L * D; i++)
        x[i] = (float)rng_normal();
    for (int i = 0; i < D * W; i++)
        w[i] = (float)rng_normal();
    int32_t cu[3] = {0, 101, L};
    fw_tensor tx = fw_tensor_contiguous(x, FW_F32, 3, xs), tw = fw_tensor_contiguous(w, FW_F32, 2, ws);
    for (int r = 0; r < 3; r++) {
        for (int i = 0; i < 2 * SL * D; i++)
            st[r][i] = (float)(i % 13);
        fw_tensor to = fw_tensor_contiguous(o[r], FW_F32, 3, xs);
        fw_conv1d_state s = {fw_tensor_contiguous(st[r], FW_F32, 3, ss), NULL, NULL};
        fw_conv1d_params p;
        fw_conv1d_params_init(&p);
        p.threads = r + 1;
        p.activation = FW_ACT_SILU;
        case_check(fw_conv1d_fwd(&tx, &tw, NULL, cu, 2, &s, &s, NULL, &to, &p) == FW_OK, "status: %s",
                   fw_last_error());
    }
    case_check(!memcmp(o[0], o[1], sizeof o[0]) && !memcmp(o[0], o[2], sizeof o[0]), "outputs differ");
    case_check(!memcmp(st[0], st[1], sizeof st[0]) && !memcmp(st[0], st[2], sizeof st[0]), "states differ");
    case_end();
}

/* The weights' layouts: packed [D, W] rows (converted in blocks and transposed, a constant
 * stride for W = 4), padded rows and a transposed view (element by element) give the same
 * bits, for f32 and bf16 weights, widths 3, 4 and 5 and a channel count off the block. */
static void test_conv_weight_layouts(void)
{
    case_begin("conv1d: packed, padded and transposed weights give the same bits");
    enum { L = 7, D = 150, WM = 5 };
    static float x[L * D], o[3][L * D], wf[D * (WM + 3)];
    static uint16_t wh[D * (WM + 3)];
    rng_seed(19);
    for (int i = 0; i < L * D; i++)
        x[i] = (float)rng_normal();
    int64_t xs[3] = {1, L, D};
    int32_t cu[2] = {0, L};
    fw_tensor tx = fw_tensor_contiguous(x, FW_F32, 3, xs);
    for (int bf = 0; bf < 2; bf++)
        for (int W = 3; W <= WM; W++)
            for (int lay = 0; lay < 3; lay++) {
                /* the same values in each layout: element (d, k) at d * s0 + k * s1 */
                const int64_t s0 = lay == 0 ? W : lay == 1 ? W + 3 : 1, s1 = lay == 2 ? D : 1;
                for (int d = 0; d < D; d++)
                    for (int k = 0; k < W; k++) {
                        const float v = (float)(0.25 * ((d * 7 + k * 3) % 11) - 1.0);
                        wf[d * s0 + k * s1] = v;
                        wh[d * s0 + k * s1] = fw_f32_to_bf16(v);
                    }
                fw_tensor tw = fw_tensor_contiguous(bf ? (void *)wh : (void *)wf, bf ? FW_BF16 : FW_F32, 2,
                                                    (int64_t[]){D, W});
                tw.stride[0] = s0;
                tw.stride[1] = s1;
                fw_tensor to = fw_tensor_contiguous(o[lay], FW_F32, 3, xs);
                fw_conv1d_params p;
                fw_conv1d_params_init(&p);
                fw_status st = fw_conv1d_fwd(&tx, &tw, NULL, cu, 1, NULL, NULL, NULL, &to, &p);
                case_check(st == FW_OK, "%s W %d layout %d: %s", bf ? "bf16" : "f32", W, lay, fw_last_error());
                if (lay)
                    case_check(!memcmp(o[0], o[lay], sizeof o[0]), "%s W %d: layout %d differs from packed",
                               bf ? "bf16" : "f32", W, lay);
            }
    case_end();
}

/* The kernels' SiLU for half-precision outputs (FW_SILU_HALF) against the f32 one, stored in
 * f32 so that the difference is the approximations': the exponential's polynomial (7.5e-5)
 * and, on AVX-512, the reciprocal (2^-14, 6.1e-5): within 1.4e-4 relative on [-40, 40], a
 * fourteenth of bf16's half ulp and under a third of f16's; NaN, infinities, -0 and
 * underflow alike. */
static void test_conv_silu_half(void)
{
    enum { N = 4107 };
    static float x[N], ya[N], yb[N], one[N], zero[N];
    for (int i = 0; i < N; i++)
        one[i] = 1.0f;
    for (int i = 0; i < 4096; i++)
        x[i] = -40.0f + 80.0f * (float)i / 4095.0f;
    const float sp[11] = {NAN, INFINITY, -INFINITY, -100.0f, 100.0f, 0.0f, -0.0f, 1e-30f, -1e-30f, -87.5f, 88.5f};
    memcpy(x + 4096, sp, sizeof sp);
    for (int t = 0; t < fw_isa_count(); t++) {
        if (!test_table(fw_isa_name(t)))
            continue;
        const fw_kernels *kt = fw_kernels_get(fw_isa_name(t));
        case_begin("conv1d: SiLU to half precision within 1.4e-4 of SiLU [%s]", kt->name);
        const void *taps[1] = {x};
        kt->conv.row(1, taps, FW_F32, one, N, zero, NULL, FW_F32, N, 1, ya, FW_F32);
        kt->conv.row(1, taps, FW_F32, one, N, zero, NULL, FW_F32, N, FW_SILU_HALF, yb, FW_F32);
        double worst = 0;
        int same_specials = 1;
        for (int i = 0; i < N; i++) {
            if (isnan(ya[i]) || isinf(ya[i]) || ya[i] == 0) {
                same_specials &= isnan(ya[i]) ? isnan(yb[i]) : yb[i] == ya[i] && signbit(yb[i]) == signbit(ya[i]);
                continue;
            }
            worst = worse(worst, fabs((double)yb[i] - ya[i]) / (fabs((double)ya[i]) + 0x1p-126));
        }
        case_check(worst <= 1.4e-4, "largest relative difference %.3g", worst);
        case_check(same_specials, "NaN, an infinity, a zero or an underflow differs");
        case_end();
    }
}

/* Outputs of 8 MiB and more, stored non-temporally (rows aligned for every table's vectors),
 * against the same calls through the cache (fw_conv1d_fwd_cached, which the reference sweep
 * covers): the same bits, outputs and states, on 1 and 3 threads; bf16 rows that are whole
 * vector pairs, without an activation (with SiLU the two calls differ by design: the cached
 * one keeps the f32 SiLU), f32 rows with a tail past them, with SiLU; two packed sequences on
 * conv states. */
static void test_conv_streamed(void)
{
    static const struct { fw_dtype dt; int64_t L, D; } cs[2] = {{FW_BF16, 520, 8224}, {FW_F32, 1030, 2064}};
    for (int ci = 0; ci < 2; ci++) {
        const fw_dtype dt = cs[ci].dt;
        const int64_t L = cs[ci].L, D = cs[ci].D, W = 4, SL = 3;
        const size_t es = fw_dtype_size(dt), nx = (size_t)(L * D), bytes = (nx * es + 63) / 64 * 64;
        case_check(fw_conv_stream((int64_t)(nx * es)), "the case is meant to stream");
        unsigned char *x = aligned_alloc(64, bytes), *o[2] = {aligned_alloc(64, bytes), aligned_alloc(64, bytes)};
        float *w = malloc(sizeof(float) * (size_t)(D * W)), *st[2] = {malloc(sizeof(float) * (size_t)(2 * SL * D)),
                                                                      malloc(sizeof(float) * (size_t)(2 * SL * D))};
        if (!x || !o[0] || !o[1] || !w || !st[0] || !st[1]) {
            fprintf(stderr, "test: out of memory\n");
            exit(2);
        }
        rng_seed(31 + (uint64_t)ci);
        for (size_t i = 0; i < nx; i++) {
            const float v = (float)rng_normal();
            fw_kernels_get(NULL)->cvt.from_f32(&v, 1, x + i * es, dt, 1);
        }
        for (int64_t i = 0; i < D * W; i++)
            w[i] = (float)(0.5 * rng_normal());
        int64_t xs[3] = {1, L, D}, ws[2] = {D, W}, ss[3] = {2, SL, D};
        int32_t cu[3] = {0, 301, (int32_t)L};
        fw_tensor tx = fw_tensor_contiguous(x, dt, 3, xs), tw = fw_tensor_contiguous(w, FW_F32, 2, ws);
        for (int t = 0; t < fw_isa_count(); t++) {
            if (!test_table(fw_isa_name(t)))
                continue;
            for (int thr = 1; thr <= 3; thr += 2) {
                case_begin("conv1d: %s outputs streamed, %lld x %lld, %d thread(s) [%s]", fw_dtype_name(dt),
                           (long long)L, (long long)D, thr, fw_isa_name(t));
                for (int r = 0; r < 2; r++) {
                    memset(o[r], 0xA5, bytes);
                    for (int64_t i = 0; i < 2 * SL * D; i++)
                        st[r][i] = (float)(i % 13) * 0.25f;
                    fw_tensor to = fw_tensor_contiguous(o[r], dt, 3, xs);
                    fw_conv1d_state s = {fw_tensor_contiguous(st[r], FW_F32, 3, ss), NULL, NULL};
                    fw_conv1d_params p;
                    fw_conv1d_params_init(&p);
                    p.threads = thr;
                    p.isa = fw_isa_name(t);
                    p.activation = dt == FW_F32 ? FW_ACT_SILU : FW_ACT_NONE;
                    fw_status stt = r ? fw_conv1d_fwd_cached(&tx, &tw, NULL, cu, 2, &s, &s, &to, &p)
                                      : fw_conv1d_fwd(&tx, &tw, NULL, cu, 2, &s, &s, NULL, &to, &p);
                    case_check(stt == FW_OK, "status: %s", fw_last_error());
                }
                case_check(!memcmp(o[0], o[1], nx * es), "streamed outputs differ from cached ones");
                case_check(!memcmp(st[0], st[1], sizeof(float) * (size_t)(2 * SL * D)), "states differ");
                case_end();
            }
        }
        free(x); free(o[0]); free(o[1]); free(w); free(st[0]); free(st[1]);
    }
}

/* Every class of bad input: the status, a message, and nothing written. */
static void test_conv_bad_input(void)
{
    enum { L = 10, D = 8, W = 4, SLOTS = 3, S = 3 };
    static float x[2 * L * D], o[2 * L * D], w[D * W], b[D], cache[SLOTS * S * D], cache2[SLOTS * S * D];
    int64_t xs[3] = {2, L, D}, ws[2] = {D, W}, bs[1] = {D}, cs[3] = {SLOTS, S, D};
    for (int i = 0; i < 2 * L * D; i++)
        x[i] = 1.0f;
    for (int i = 0; i < D * W; i++)
        w[i] = 0.5f;
    const fw_tensor tx = fw_tensor_contiguous(x, FW_F32, 3, xs), tw = fw_tensor_contiguous(w, FW_F32, 2, ws);
    const fw_tensor tb = fw_tensor_contiguous(b, FW_F32, 1, bs), to = fw_tensor_contiguous(o, FW_F32, 3, xs);
    const fw_tensor tc = fw_tensor_contiguous(cache, FW_F32, 3, cs), tc2 = fw_tensor_contiguous(cache2, FW_F32, 3, cs);
    int32_t dup[2] = {1, 1}, oob[2] = {0, 3}, cross[2] = {0, 1}, crossw[2] = {1, 2}, cu_bad[3] = {0, 5, 4};
    for (int k = 0; k < 19; k++) {
        fw_tensor X = tx, Wt = tw, B = tb, O = to;
        fw_conv1d_state si = {tc, NULL, NULL}, sf = {tc, NULL, NULL};
        const fw_conv1d_state *pi = &si, *pf = &sf;
        const fw_tensor *pb = &tb, *px = &X, *po = &O;
        const int32_t *cu = NULL;
        int64_t n = 2;
        fw_conv1d_params p;
        fw_conv1d_params_init(&p);
        fw_status want = FW_ERR_SHAPE;
        const char *what = "";
        switch (k) {
        case 0: px = NULL; want = FW_ERR_NULL; what = "NULL x"; break;
        case 1: X.ndim = 2; what = "x of rank 2"; break;
        case 2: X.dtype = FW_F64; want = FW_ERR_DTYPE; what = "f64 x"; break;
        case 3: O.shape[1] = L - 1; what = "out shorter than x"; break;
        case 4: Wt.shape[1] = 0; what = "W = 0"; break;
        case 5: B.shape[0] = D - 1; pb = &B; what = "bias of D - 1"; break;
        case 6: { static int32_t cu2[3] = {0, 4, 10}; cu = cu2; what = "cu_seqlens with 2 rows"; } break;
        case 7: X.shape[0] = 1; O.shape[0] = 1; cu = cu_bad; want = FW_ERR_SEQLENS; what = "decreasing cu_seqlens"; break;
        case 8: si.cache.shape[1] = W - 2; sf.cache = si.cache; what = "init of W - 2 entries"; break;
        case 9: si.idx = oob; sf.idx = oob; want = FW_ERR_INDEX; what = "slot past the cache"; break;
        case 10: sf.idx = dup; si.idx = dup; want = FW_ERR_INDEX; what = "two sequences write one slot"; break;
        case 11: si.idx = cross; sf.idx = crossw; want = FW_ERR_INDEX; what = "a slot read by one sequence and written by another"; break;
        case 12: sf.cache = tc; sf.cache.stride[1] = D + 1; sf.cache.shape[0] = 2; want = FW_ERR_STRIDE; what = "overlapping different views"; break;
        case 13: O = X; want = FW_ERR_STRIDE; what = "out is x"; break;
        case 14: p.activation = 7; want = FW_ERR_ARG; what = "activation 7"; break;
        case 15: p.threads = -1; want = FW_ERR_ARG; what = "threads -1"; break;
        case 16: O.stride[1] = 0; want = FW_ERR_STRIDE; what = "out with aliasing rows"; break;
        case 17: X.stride[2] = INT64_MAX / 4; want = FW_ERR_OVERFLOW; what = "x extent overflowing"; break;
        case 18: si.cache = tc2; sf.cache = tc2; sf.cache.data = o; want = FW_ERR_STRIDE; what = "final cache is out"; break;
        }
        (void)n;
        memset(o, 0x7f, sizeof o);
        for (int i = 0; i < SLOTS * S * D; i++)
            cache[i] = cache2[i] = 3.0f;
        case_begin("conv1d refuses %s", what);
        fw_status st = fw_conv1d_fwd(px, &Wt, pb, cu, 2, pi, pf, NULL, po, &p);
        int untouched = 1;
        for (int i = 0; i < 2 * L * D; i++)
            untouched &= ((uint32_t *)o)[i] == 0x7f7f7f7fu;
        for (int i = 0; i < SLOTS * S * D; i++)
            untouched &= cache[i] == 3.0f && cache2[i] == 3.0f;
        case_check(st == want && fw_last_error()[0] != 0, "status %d (want %d), \"%s\"", (int)st, (int)want,
                   fw_last_error());
        case_check(untouched, "a refused call wrote");
        case_end();
    }
}

/* The channel block heuristic (conv/conv1d.c): whole rows unless that starves the threads. */
static void test_conv_heuristics(void)
{
    case_begin("conv1d channel blocks");
    case_check(fw_conv_channel_block(8192, 32, 2) == 8192, "prefill: whole rows");
    case_check(fw_conv_channel_block(8192, 64, 2) == 8192, "64 decodes on 2 threads: whole rows");
    case_check(fw_conv_channel_block(8192, 1, 2) == 1024, "one decode on 2 threads: 8 blocks, got %lld",
               (long long)fw_conv_channel_block(8192, 1, 2));
    case_check(fw_conv_channel_block(300, 1, 4) == 256, "at least 256 channels, got %lld",
               (long long)fw_conv_channel_block(300, 1, 4));
    case_check(fw_conv_channel_block(100, 1, 8) == 100, "fewer channels than a block");
    case_end();
    case_begin("conv1d streams outputs of 8 MiB and more");
    case_check(!fw_conv_stream(0) && !fw_conv_stream(((int64_t)8 << 20) - 1), "streamed below 8 MiB");
    case_check(fw_conv_stream((int64_t)8 << 20) && fw_conv_stream((int64_t)2048 * 8192 * 2),
               "Qwen3-Next's 2K conv (32 MiB) not streamed");
    case_end();
    case_begin("conv1d rows kernel passes: a row at a time on AMD only");
    case_check(fw_conv_pass_rows("AuthenticAMD") == 1, "AMD");
    case_check(fw_conv_pass_rows("GenuineIntel") == 64 && fw_conv_pass_rows("HygonGenuine") == 64 &&
                   fw_conv_pass_rows("") == 64 && fw_conv_pass_rows(NULL) == 64 && fw_conv_pass_rows("AuthenticAMDx") == 64,
               "Intel, another vendor, none, a longer string");
    case_end();
}

/* The rows kernel (conv1d_rows: width 4 slides its taps in registers) against the row
 * kernel, bit for bit, on every table: widths 4 and 3, channel counts past and short of the
 * vector pairs, every tap dtype, bf16 and f32 out, no activation / SiLU / its half-precision
 * form, rows in passes or a row at a time (AMD's way, prefetching ahead: in one call and in
 * calls of one row), stores plain or streamed (output rows aligned for the table's vectors, or
 * one element off them: plain stores then). */
static void test_conv_rows_kernel(void)
{
    enum { R = 9, N = 83, NP = 96, WMAX = 4 }; /* NP: output row stride, 64-byte multiples */
    static const fw_dtype dts[3] = {FW_F32, FW_BF16, FW_F16};
    static float wt[WMAX * N], bias[N];
    static unsigned char x[(R + WMAX) * N * 4];
    static _Alignas(64) unsigned char ya[(R * NP + 1) * 4], yb[(R * NP + 1) * 4];
    rng_seed(71);
    for (int i = 0; i < WMAX * N; i++)
        wt[i] = (float)rng_normal();
    for (int i = 0; i < N; i++)
        bias[i] = (float)(0.1 * rng_normal());
    for (int t = 0; t < fw_isa_count(); t++) {
        if (!test_table(fw_isa_name(t)))
            continue;
        const fw_kernels *kt = fw_kernels_get(fw_isa_name(t));
        case_begin("conv1d: the rows kernel equals the row kernel [%s]", kt->name);
        for (int W = 3; W <= 4; W++)
            for (int di = 0; di < 3; di++)
                for (int oi = 0; oi < 2; oi++)
                    for (int silu = 0; silu <= FW_SILU_HALF; silu++)
                        for (int n = 1; n <= N; n += 41)
                        for (int st = 0; st < 4; st++) { /* plain; streamed: aligned, off, 32 bytes off 64 */
                            const fw_dtype dt = dts[di], ydt = oi ? FW_BF16 : FW_F32;
                            const size_t es = fw_dtype_size(dt), ys = fw_dtype_size(ydt);
                            for (int i = 0; i < (R + WMAX) * N; i++) {
                                const float v = (float)rng_normal();
                                kt->cvt.from_f32(&v, 1, x + (size_t)i * es, dt, 1);
                            }
                            const void *rows[R + WMAX];
                            void *yr[R];
                            for (int r = 0; r < R + W - 1; r++)
                                rows[r] = x + (size_t)r * N * es;
                            memset(yb, 0xA5, sizeof yb);
                            const size_t off = st == 2 ? ys : st == 3 ? 32 : 0;
                            for (int r = 0; r < R; r++) {
                                yr[r] = ya + (size_t)r * NP * ys + off;
                                kt->conv.row(W, rows + r, dt, wt, N, bias, NULL, FW_F32, n, silu,
                                               yb + (size_t)r * NP * ys + off, ydt);
                            }
                            for (int one = 0; one < 3; one++) { /* passes (fw_conv_pass_rows); a row at a
                                                                 * time, in one call or a call a row */
                                memset(ya, 0xA5, sizeof ya);
                                for (int r = 0; r < R; r += one == 2 ? 1 : R)
                                    kt->conv.rows(W, one == 2 ? 1 : R, one ? 1 : 64, rows + r, dt, wt, N, bias, n,
                                                    silu, yr + r, ydt, st > 0);
                                case_check(!memcmp(ya, yb, sizeof ya), "W %d, %s taps, %s out, silu %d, %d channels, "
                                           "%s, %s: the rows differ", W, fw_dtype_name(dt), fw_dtype_name(ydt), silu, n,
                                           st == 0 ? "plain stores" : st == 1 ? "streamed" : st == 2 ? "streamed, rows unaligned"
                                                                                              : "streamed, rows 32 bytes off 64",
                                           one == 2 ? "a call a row" : one ? "a row at a time" : "passes");
                            }
                        }
        case_end();
    }
}

/* The tables' weight packing ([D][W] -> f32 [W][D]) against a scalar transpose of the
 * library's conversions, bit for bit: f32, bf16 and f16, widths 2 to 17, channel counts off
 * every vector length, with NaN payloads, infinities, -0 and subnormals among the values. */
static void test_conv_weights_kernel(void)
{
    enum { DM = 150, WM = 17 };
    static const fw_dtype dts[3] = {FW_F32, FW_BF16, FW_F16};
    static const int widths[5] = {2, 3, 4, 5, 17}, ds[4] = {1, 15, 33, DM};
    static unsigned char w[DM * WM * 4];
    static float got[DM * WM + 16], want[DM * WM];
    rng_seed(83);
    for (int t = 0; t < fw_isa_count(); t++) {
        if (!test_table(fw_isa_name(t)))
            continue;
        const fw_kernels *kt = fw_kernels_get(fw_isa_name(t));
        case_begin("conv1d: the weight packing equals a scalar transpose [%s]", kt->name);
        for (int di = 0; di < 3; di++)
            for (int wi = 0; wi < 5; wi++)
                for (int ni = 0; ni < 4; ni++) {
                    const fw_dtype dt = dts[di];
                    const int W = widths[wi], D = ds[ni];
                    const size_t es = fw_dtype_size(dt);
                    for (int i = 0; i < D * W; i++) {
                        if (dt == FW_F32) {
                            const uint32_t special[4] = {0x7fc01234u, 0xff800000u, 0x80000000u, 0x00000005u};
                            uint32_t u;
                            const float v = (float)rng_normal();
                            memcpy(&u, &v, 4);
                            if (i % 7 == 3)
                                u = special[(i / 7) % 4];
                            memcpy(w + (size_t)i * 4, &u, 4);
                        } else {
                            const uint16_t special[4] = {(uint16_t)(dt == FW_BF16 ? 0x7fc5 : 0x7e05),
                                                         (uint16_t)(dt == FW_BF16 ? 0xff80 : 0xfc00), 0x8000, 0x0003};
                            uint16_t h = dt == FW_BF16 ? fw_f32_to_bf16((float)rng_normal())
                                                       : fw_f32_to_f16((float)rng_normal());
                            if (i % 7 == 3)
                                h = special[(i / 7) % 4];
                            memcpy(w + (size_t)i * 2, &h, 2);
                        }
                    }
                    for (int d = 0; d < D; d++)
                        for (int k = 0; k < W; k++) /* one element at a time: the library's scalar conversion */
                            kt->cvt.to_f32(w + ((size_t)d * W + k) * es, dt, 1, 1, 1.0f, want + (size_t)k * D + d);
                    memset(got, 0xA5, sizeof got);
                    kt->conv.weights(W, D, w, dt, got);
                    case_check(!memcmp(got, want, sizeof(float) * (size_t)(D * W)), "%s, W %d, %d channels: differs",
                               fw_dtype_name(dt), W, D);
                    case_check(((const unsigned char *)got)[sizeof(float) * (size_t)(D * W)] == 0xA5,
                               "%s, W %d, %d channels: wrote past [W][D]", fw_dtype_name(dt), W, D);
                }
        case_end();
    }
}

/* One-token decodes in place on a bf16 cache: each slot's rows move up by one and take the
 * token's row, the raw bits (NaN payloads, infinities, -0 and subnormals kept), on 1 and 2
 * threads and every table; a sequence whose slot index is negative writes nothing. */
static void test_conv_state_bits(void)
{
    enum { N = 5, D = 300, W = 4, S = W - 1 };
    static uint16_t x[N * D], st[N * S * D], st0[N * S * D], o[N * D], w[D * W];
    static const uint16_t special[5] = {0x7fc5, 0xff81, 0x8000, 0x0003, 0x7f80};
    rng_seed(89);
    for (int i = 0; i < N * D; i++)
        x[i] = i % 5 == 2 ? special[(i / 5) % 5] : fw_f32_to_bf16((float)rng_normal());
    for (int i = 0; i < N * S * D; i++)
        st0[i] = i % 3 == 1 ? special[(i / 3) % 5] : fw_f32_to_bf16((float)rng_normal());
    for (int i = 0; i < D * W; i++)
        w[i] = fw_f32_to_bf16((float)(0.3 * rng_normal()));
    int32_t idx[N] = {3, 0, -1, 4, 1}; /* slot 2 unused: sequence 2 has no slot */
    int64_t xs[3] = {N, 1, D}, ws[2] = {D, W}, ss[3] = {N, S, D};
    for (int t = 0; t < fw_isa_count(); t++) {
        if (!test_table(fw_isa_name(t)))
            continue;
        case_begin("conv1d: in-place decode states keep the raw bits [%s]", fw_isa_name(t));
        for (int thr = 1; thr <= 2; thr++) {
            memcpy(st, st0, sizeof st);
            fw_tensor tx = fw_tensor_contiguous(x, FW_BF16, 3, xs), to = fw_tensor_contiguous(o, FW_BF16, 3, xs);
            fw_tensor tw = fw_tensor_contiguous(w, FW_BF16, 2, ws);
            fw_conv1d_state sc = {fw_tensor_contiguous(st, FW_BF16, 3, ss), idx, NULL};
            fw_conv1d_params p;
            fw_conv1d_params_init(&p);
            p.activation = FW_ACT_SILU;
            p.threads = thr;
            p.isa = fw_isa_name(t);
            case_check(fw_conv1d_fwd(&tx, &tw, NULL, NULL, 0, &sc, &sc, NULL, &to, &p) == FW_OK, "status: %s",
                       fw_last_error());
            int bad = 0;
            for (int i = 0; i < N; i++) {
                if (idx[i] < 0)
                    continue;
                const uint16_t *s1 = st + (size_t)idx[i] * S * D, *s0 = st0 + (size_t)idx[i] * S * D;
                bad += memcmp(s1, s0 + D, sizeof(uint16_t) * (size_t)((S - 1) * D)) != 0;
                bad += memcmp(s1 + (size_t)(S - 1) * D, x + (size_t)i * D, sizeof(uint16_t) * D) != 0;
            }
            bad += memcmp(st + 2 * S * D, st0 + 2 * S * D, sizeof(uint16_t) * S * D) != 0;
            case_check(bad == 0, "%d threads: %d slots differ from the shifted raw rows", thr, bad);
        }
        case_end();
    }
}

const test_suite conv_suites[] = {
    {"conv.rows_kernel", test_conv_rows_kernel},
    {"conv.weights_kernel", test_conv_weights_kernel},
    {"conv.state_bits", test_conv_state_bits},
    {"conv.heuristics", test_conv_heuristics},
    {"conv.bad_input", test_conv_bad_input},
    {"conv.threads_identical", test_conv_threads},
    {"conv.weight_layouts", test_conv_weight_layouts},
    {"conv.streamed", test_conv_streamed},
    {"conv.silu_half", test_conv_silu_half},
    {"conv.sweep", test_conv_sweep},
    {NULL, NULL}};
