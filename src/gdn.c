/*
 * gdn.c: Gated DeltaNet drivers (../shared/docs/gdn.md sections 2-5, 7): chunked WY/UT
 * prefill, fused decode, speculative verify and commit, and the float64 reference.
 *
 * Chunked prefill, one pass per chunk of L <= 64 tokens (never spanning sequences), for one
 * (sequence, q/k head) work item and its r = HV / H value heads. Per chunk, shared by the r
 * value heads: K^ and Q^ rows, KK = K^ K^T and QK = Q^ K^T. Per value head, with gamma the
 * chunk-local cumulative log decay in log2 units (only differences <= 0 are exponentiated,
 * masked entries get -1e30 before exp2, never -inf):
 *   A   = strictly lower (beta_i 2^(g_i - g_j) KK_ij)          T = (I + A)^-1
 *   [W | U] = T [beta 2^g K^ | beta V]                         Delta = U - W h
 *   O   = [2^g Q^ | QK o Gamma o M] [h ; Delta]                (one GEMM over dk + L)
 *   h  <- 2^g_last h + (2^(g_last - g) K^)^T Delta
 * All products run on the attention table's GEMM micro-kernels: qk (C = bias + A B, B and C
 * with row stride M, a multiple of the vector length) and pv (C += A^T B).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "attn.h"

#define GDN_C 64 /* chunk length */

void fw_gdn_params_init(fw_gdn_params *p)
{
    if (p)
        memset(p, 0, sizeof *p);
}

typedef struct {
    const fw_tensor *q, *k, *v, *g, *beta, *out;
    const int32_t *cu;
    int64_t n, T, H, HV, r, dk, dv;
    double scale;
    int l2;
    int bf16; /* bf16 products (params->precision resolved; the chunked passes only) */
} gdn_prob;

#define DT_IN ((1u << FW_F32) | (1u << FW_BF16) | (1u << FW_F16))

/* Validates the token tensors ([T, H, dk], [T, HV, dv], [T, HV]) and, when cu is given, the
 * sequence boundaries. `ref` admits an f64 out. Also checks g <= 0 (the safe-exponential
 * contract) and that beta is finite. Nothing is written. */
static fw_status gdn_check(gdn_prob *p, const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                           const fw_tensor *g, const fw_tensor *beta, const int32_t *cu, int64_t n,
                           int need_cu, const fw_tensor *out, const fw_gdn_params *params, int ref)
{
    memset(p, 0, sizeof *p);
    fw_status s;
    if ((s = fw_check_tensor(q, "q", 3, DT_IN)) || (s = fw_check_tensor(k, "k", 3, DT_IN)) ||
        (s = fw_check_tensor(v, "v", 3, DT_IN)) || (s = fw_check_tensor(g, "g", 2, 1u << FW_F32)) ||
        (s = fw_check_tensor(beta, "beta", 2, 1u << FW_F32)) ||
        (s = fw_check_tensor(out, "out", 3, DT_IN | (ref ? 1u << FW_F64 : 0u))))
        return s;
    if (k->dtype != q->dtype || v->dtype != q->dtype)
        return fw_fail(FW_ERR_DTYPE, "q, k and v must share a dtype: q is %s, k is %s, v is %s",
                       fw_dtype_name(q->dtype), fw_dtype_name(k->dtype), fw_dtype_name(v->dtype));
    const int64_t T = q->shape[0], H = q->shape[1], dk = q->shape[2], HV = v->shape[1], dv = v->shape[2];
    if (k->shape[0] != T || k->shape[1] != H || k->shape[2] != dk)
        return fw_fail(FW_ERR_SHAPE, "k must be [T, H, dk] = [%lld, %lld, %lld] like q", (long long)T,
                       (long long)H, (long long)dk);
    if (v->shape[0] != T || g->shape[0] != T || beta->shape[0] != T || out->shape[0] != T)
        return fw_fail(FW_ERR_SHAPE, "q, k, v, g, beta and out must have the same %lld tokens", (long long)T);
    if (H < 1 || HV < 1 || HV % H)
        return fw_fail(FW_ERR_SHAPE, "v has %lld heads, which is not a multiple of q/k's %lld heads",
                       (long long)HV, (long long)H);
    if (g->shape[1] != HV || beta->shape[1] != HV || out->shape[1] != HV || out->shape[2] != dv)
        return fw_fail(FW_ERR_SHAPE, "g and beta must be [T, HV] and out [T, HV, dv] with HV = %lld, dv = %lld",
                       (long long)HV, (long long)dv);
    if (dk < 1 || dk > 1024 || dv < 1 || dv > 1024 || HV > 65536)
        return fw_fail(FW_ERR_SHAPE, "head dims must be 1..1024 (dk %lld, dv %lld) and HV at most 65536",
                       (long long)dk, (long long)dv);
    if ((s = fw_check_no_alias(out, "out")))
        return s;
    if (params) {
        if (!isfinite(params->scale))
            return fw_fail(FW_ERR_ARG, "scale is %g; it must be finite (0 means 1/sqrt(dk))", (double)params->scale);
        if (params->threads < 0 || params->threads > 256)
            return fw_fail(FW_ERR_ARG, "threads is %d; it must be 0 (all CPUs) to 256", (int)params->threads);
        if (params->l2norm_qk != 0 && params->l2norm_qk != 1)
            return fw_fail(FW_ERR_ARG, "l2norm_qk is %d; it must be 0 or 1", (int)params->l2norm_qk);
        if (params->flags & ~(uint32_t)(FW_GDN_FWD_SUBST | FW_GDN_RECURRENT | FW_GDN_FUSED_RECURRENT))
            return fw_fail(FW_ERR_ARG, "flags 0x%x has unknown bits", (unsigned)params->flags);
        if (params->precision < FW_PREC_AUTO || params->precision > FW_PREC_BF16)
            return fw_fail(FW_ERR_ARG, "precision is %d; it must be FW_PREC_AUTO (0), FW_PREC_F32 (1) "
                           "or FW_PREC_BF16 (2)", (int)params->precision);
    }
    if (need_cu) {
        if (n < 0 || n > INT32_MAX)
            return fw_fail(FW_ERR_ARG, "n_seqs is %lld; it must be 0..2^31-1", (long long)n);
        if (!cu)
            return fw_fail(FW_ERR_NULL, "cu_seqlens is NULL");
        if (cu[0] != 0)
            return fw_fail(FW_ERR_SEQLENS, "cu_seqlens[0] is %d; it must be 0", (int)cu[0]);
        for (int64_t i = 1; i <= n; i++)
            if (cu[i] < cu[i - 1])
                return fw_fail(FW_ERR_SEQLENS, "cu_seqlens[%lld] = %d is less than cu_seqlens[%lld] = %d",
                               (long long)i, (int)cu[i], (long long)(i - 1), (int)cu[i - 1]);
        if (cu[n] != T)
            return fw_fail(FW_ERR_SEQLENS, "cu_seqlens[%lld] = %d but the tensors have %lld tokens",
                           (long long)n, (int)cu[n], (long long)T);
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < HV; j++) {
            const float gv = ((const float *)g->data)[t * g->stride[0] + j * g->stride[1]];
            const float bv = ((const float *)beta->data)[t * beta->stride[0] + j * beta->stride[1]];
            if (!(gv <= 0.0f) || gv == -INFINITY)
                return fw_fail(FW_ERR_ARG, "g[%lld][%lld] = %g: the log decay must be finite and <= 0",
                               (long long)t, (long long)j, (double)gv);
            if (!isfinite(bv))
                return fw_fail(FW_ERR_ARG, "beta[%lld][%lld] = %g is not finite", (long long)t, (long long)j,
                               (double)bv);
        }
    p->q = q; p->k = k; p->v = v; p->g = g; p->beta = beta; p->out = out;
    p->cu = cu; p->n = n; p->T = T; p->H = H; p->HV = HV; p->r = HV / H; p->dk = dk; p->dv = dv;
    p->scale = params && params->scale != 0.0f ? (double)params->scale : 1.0 / sqrt((double)dk);
    p->l2 = params ? params->l2norm_qk : 0;
    p->bf16 = fw_attn_bf16_products(q->dtype, params ? params->precision : FW_PREC_AUTO);
    return FW_OK;
}

static const char *at(const fw_tensor *t, int64_t i, int64_t j)
{
    return fw_elem(t, i * t->stride[0] + j * t->stride[1]);
}

static float scalar_at(const fw_tensor *t, int64_t i, int64_t j)
{
    return *(const float *)at(t, i, j);
}

/* q^ (scaled) or k^ of token t, head h, as f32: l2-normalised when asked (eps inside the
 * sqrt), by the same table kernel as the chunked path. */
static void load_qk(const fw_kernels *kt, const gdn_prob *p, const fw_tensor *x, int64_t t, int64_t h,
                    double scale, float *dst)
{
    kt->to_f32(at(x, t, h), x->dtype, x->stride[2], p->dk, 1.0f, dst);
    kt->rows_l2scale(dst, 1, (int)p->dk, (float)scale, p->l2);
}

/* ------------------------------------------------------------- workspace -- */

/* Matrices that are the B or C operand of a product are kept in panels of GDN_P = 64 columns,
 * each panel contiguous ([rows][64]): qk then always runs at M = 64, where its B slice stays
 * in L1 (measured, AVX-512: 258 GFLOP/s at M = 64 against 178 at M = 128 or 256, where the
 * strided slice thrashes L1). */
#define GDN_P 64
#define GDN_W (GDN_C / 2) /* words of a chunk's tokens in pair layout */

typedef struct {
    int64_t pk, pv;                 /* panels over dk and over dv */
    size_t kc, qc, ktr, kk, qk, am, ti, rhs, wu, wrow, aout, wh, kpp, zero, gam, hd; /* floats */
    /* bf16 products only (32-bit words, pair layout): K^ and Q^ rows, K^ transposed, the
     * gated QK, T rows, RHS panels, W rows, h and Delta of one panel, decayed keys, Q^ h */
    size_t kw, qw, ktw, gw, tw, rhsw, ww, hw, dw, kpw, xo, total;
} gdn_ws;

static gdn_ws gdn_plan(const gdn_prob *p)
{
    gdn_ws w;
    const size_t C = GDN_C, dk = (size_t)p->dk, P = GDN_P, dkw = (dk + 1) / 2;
    w.pk = (p->dk + GDN_P - 1) / GDN_P;
    w.pv = (p->dv + GDN_P - 1) / GDN_P;
    const size_t np = (size_t)(w.pk + w.pv), b = p->bf16 ? 1 : 0;
    size_t o = 0;
#define TAKE(f, n) (w.f = o, o += ((size_t)(n) + 15) / 16 * 16)
    TAKE(kc, C * dk);
    TAKE(qc, C * dk);
    TAKE(ktr, dk * C);
    TAKE(kk, C * C);
    TAKE(qk, C * C);
    TAKE(am, C * C);
    TAKE(ti, C * C);
    TAKE(rhs, np * C * P);            /* [beta 2^g K^ | beta V], panels: pk for K, pv for V */
    TAKE(wu, np * C * P);             /* [W | U] = T RHS, same panels */
    TAKE(wrow, C * dk);               /* W row-major, the A operand of W h */
    TAKE(aout, C * (dk + C));
    TAKE(wh, C * P);
    TAKE(kpp, C * dk);
    TAKE(zero, P);
    TAKE(gam, 4 * C);
    TAKE(hd, (size_t)p->r * (size_t)w.pv * (dk + C) * P); /* per value head and dv panel: h rows, Delta rows */
    TAKE(kw, b * C * dkw);
    TAKE(qw, b * C * dkw);
    TAKE(ktw, b * dkw * C);
    TAKE(gw, b * C * GDN_W);
    TAKE(tw, b * C * GDN_W);
    TAKE(rhsw, b * np * GDN_W * P);
    TAKE(ww, b * C * dkw);
    TAKE(hw, b * dkw * P);
    TAKE(dw, b * GDN_W * P);
    TAKE(kpw, b * GDN_W * dk);
    TAKE(xo, b * C * P);
#undef TAKE
    w.total = o;
    return w;
}

/* ------------------------------------------------------------ chunked pass -- */

typedef struct {
    const gdn_prob *p;
    const fw_kernels *kt;
    gdn_ws w;
    float *ws;
    uint32_t flags;
    const float *init;  /* prefill: [N, HV, dk, dv] or NULL; verify: slot array */
    float *final;       /* prefill: [N, HV, dk, dv] or NULL */
    const int32_t *idx; /* verify: slot of each sequence */
    float *replay;      /* verify: deltas [T][HV][dv], gammas [T][HV], keys [T][H][dk] */
} gdn_ctx;

/* Panel q of value head e's [h ; Delta]: h rows [0, dk), Delta rows [dk, dk + 64), 64 wide. */
static float *hd_panel(const gdn_ctx *c, float *W, int64_t e, int64_t q)
{
    return W + c->w.hd + ((size_t)e * c->w.pv + (size_t)q) * (size_t)(c->p->dk + GDN_C) * GDN_P;
}

static int panel_cols(int64_t n, int q) { return n - q * GDN_P < GDN_P ? (int)(n - q * GDN_P) : GDN_P; }

/* Prefetch row (t, j) of x (rows of n contiguous elements) for reading, or for writing. Each
 * chunk prefetches the next chunk's rows while it works: token rows lie H x dk (or HV x dv)
 * elements apart, a page or more, which the hardware prefetchers do not follow. Measured
 * (bf16 products, T = 4K, Qwen3-Next shapes, 1 thread, 10 calls): 2.19-2.23 s without, 2.03-2.10
 * with; the input and output conversions still take 10% of the pass, half of it in TLB misses
 * (inputs in 2 MiB pages: 5% faster). */
static void prefetch_row(const fw_tensor *x, int64_t t, int64_t j, int64_t n, int write)
{
    if (x->stride[2] != 1)
        return;
    const char *r = at(x, t, j);
    for (size_t b = 0; b < (size_t)n * fw_dtype_size(x->dtype); b += 64) {
        if (write)
            __builtin_prefetch(r + b, 1, 3);
        else
            __builtin_prefetch(r + b, 0, 3);
    }
}

/* Part `part` of `parts` of the next chunk's rows (nxt tokens from t0 + 64): q and k of head
 * h, v and out of its value heads, a part before each panel's products. */
static void prefetch_next(const gdn_ctx *c, int64_t h, int64_t t0, int nxt, int part, int parts)
{
    const gdn_prob *p = c->p;
    for (int i = nxt * part / parts; i < nxt * (part + 1) / parts; i++) {
        const int64_t t = t0 + GDN_C + i;
        prefetch_row(p->q, t, h, p->dk, 0);
        prefetch_row(p->k, t, h, p->dk, 0);
        for (int64_t e = 0; e < p->r; e++) {
            prefetch_row(p->v, t, h * p->r + e, p->dv, 0);
            prefetch_row(p->out, t, h * p->r + e, p->dv, 1);
        }
    }
}

/* Row r of out, value head vh, columns [q*64, q*64 + n), from f32. */
static void store_out(const gdn_ctx *c, const float *src, int64_t t, int64_t vh, int q, int n)
{
    const fw_tensor *o = c->p->out;
    c->kt->from_f32(src, n, (char *)at(o, t, vh) + (size_t)(q * GDN_P * o->stride[2]) * fw_dtype_size(o->dtype),
                    o->dtype, o->stride[2]);
}

/* The chunk's K^ and Q^ rows in f32 (Q^ times qscale), kept for commit when verifying. */
static void chunk_rows(const gdn_ctx *c, float *K, float *Q, int64_t h, int64_t t0, int L, float qscale)
{
    const gdn_prob *p = c->p;
    const int dk = (int)p->dk;
    for (int i = 0; i < L; i++) {
        c->kt->to_f32(at(p->k, t0 + i, h), p->k->dtype, p->k->stride[2], dk, 1.0f, K + (size_t)i * dk);
        c->kt->to_f32(at(p->q, t0 + i, h), p->q->dtype, p->q->stride[2], dk, 1.0f, Q + (size_t)i * dk);
    }
    c->kt->rows_l2scale(K, L, dk, 1.0f, p->l2);
    c->kt->rows_l2scale(Q, L, dk, qscale, p->l2);
    if (c->replay)
        for (int i = 0; i < L; i++)
            memcpy(c->replay + (size_t)p->T * p->HV * (p->dv + 1) + ((size_t)(t0 + i) * p->H + h) * dk,
                   K + (size_t)i * dk, (size_t)dk * sizeof(float));
}

/* Value head vh's gates over the chunk, into gam (4 x 64 floats): gamma (log2 units, zero past
 * L), 2^gamma, 2^(gamma_last - gamma), beta. Kept for commit when verifying. */
static void chunk_gates(const gdn_ctx *c, float *gam, int64_t vh, int64_t t0, int L)
{
    const gdn_prob *p = c->p;
    float *ex = gam + GDN_C, *exl = ex + GDN_C, *bet = exl + GDN_C;
    double acc = 0;
    for (int i = 0; i < L; i++) {
        acc += scalar_at(p->g, t0 + i, vh);
        gam[i] = (float)(acc * FW_LOG2E);
        bet[i] = scalar_at(p->beta, t0 + i, vh);
    }
    for (int i = 0; i < L; i++) {
        ex[i] = gam[i];
        exl[i] = gam[L - 1] - gam[i];
    }
    c->kt->exp2_inplace(ex, L);
    c->kt->exp2_inplace(exl, L);
    for (int i = L; i < GDN_C; i++)
        gam[i] = 0.0f;
    if (c->replay)
        for (int i = 0; i < L; i++)
            c->replay[(size_t)p->T * p->HV * p->dv + (size_t)(t0 + i) * p->HV + vh] = gam[i];
}

/* The right-hand side [beta 2^g K^ | beta V] of value head vh, in panels of 64 columns (pk of
 * K, then pv of V), rows past a panel's width zero. */
static void chunk_rhs(const gdn_ctx *c, float *RHS, const float *K, const float *gam, int64_t vh, int64_t t0,
                      int L)
{
    const gdn_prob *p = c->p;
    const int dk = (int)p->dk, P = GDN_P, np = (int)(c->w.pk + c->w.pv);
    const float *ex = gam + GDN_C, *bet = ex + 2 * GDN_C;
    for (int i = 0; i < L; i++)
        for (int q = 0; q < np; q++) {
            float *rh = RHS + ((size_t)q * GDN_C + i) * P;
            int n;
            if (q < c->w.pk) {
                n = panel_cols(dk, q);
                memcpy(rh, K + (size_t)i * dk + q * P, (size_t)n * sizeof(float));
                c->kt->rows_l2scale(rh, 1, n, bet[i] * ex[i], 0);
            } else {
                const int v0 = (q - (int)c->w.pk) * P;
                n = panel_cols(p->dv, q - (int)c->w.pk);
                c->kt->to_f32(at(p->v, t0 + i, vh) + (size_t)(v0 * p->v->stride[2]) * fw_dtype_size(p->v->dtype),
                              p->v->dtype, p->v->stride[2], n, bet[i], rh);
            }
            for (int x = n; x < P; x++)
                rh[x] = 0.0f;
        }
}

/* Delta = U - W h for one panel of 64 columns, kept for commit when verifying. */
static void chunk_delta(const gdn_ctx *c, float *D, const float *U, const float *Wh, int64_t vh, int64_t t0,
                        int L, int q)
{
    const int dv = (int)c->p->dv, P = GDN_P;
    for (int i = 0; i < L; i++) {
        for (int x = 0; x < P; x++)
            D[(size_t)i * P + x] = U[(size_t)i * P + x] - Wh[(size_t)i * P + x];
        if (c->replay)
            memcpy(c->replay + ((size_t)(t0 + i) * c->p->HV + vh) * dv + q * P, D + (size_t)i * P,
                   (size_t)panel_cols(dv, q) * sizeof(float));
    }
}

static void chunk_inverse(const gdn_ctx *c, const float *Am, int L, float *Ti)
{
    if (c->flags & FW_GDN_FWD_SUBST)
        c->kt->tri_inv_fwd(Am, GDN_C, L, Ti, GDN_C);
    else
        c->kt->tri_inv_blocked(Am, GDN_C, L, Ti, GDN_C);
}

/* One chunk of tokens [t0, t0 + L) of q/k head h for its r value heads, f32 products; the
 * next chunk of the sequence has nxt tokens (prefetched meanwhile). */
static void gdn_chunk(const gdn_ctx *c, float *W, int64_t h, int64_t t0, int L, int nxt, int update)
{
    const gdn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    const gdn_ws *w = &c->w;
    const int dk = (int)p->dk, P = GDN_P, np = (int)(w->pk + w->pv);
    float *K = W + w->kc, *Q = W + w->qc, *Kt = W + w->ktr, *KK = W + w->kk, *QK = W + w->qk;
    float *Am = W + w->am, *Ti = W + w->ti, *RHS = W + w->rhs, *WU = W + w->wu, *Wr = W + w->wrow;
    float *Ao = W + w->aout, *Wh = W + w->wh, *Kpp = W + w->kpp, *zero = W + w->zero, *gam = W + w->gam;
    const float *ex = gam + GDN_C, *exl = ex + GDN_C, *bet = exl + GDN_C;
    chunk_rows(c, K, Q, h, t0, L, (float)p->scale);
    const void *krows[GDN_C];
    for (int i = 0; i < L; i++)
        krows[i] = K + (size_t)i * dk;
    /* K^T [dk][64] by the decode kernels' transposing pack (FW_DEC_KEYS == GDN_C); the keys
     * past L must read as zero, so clear the columns pack_kt leaves */
    kt->pack_kt(krows, FW_F32, 1, L, dk, Kt);
    for (int x = 0; x < dk; x++)
        for (int i = (L + kt->vl - 1) / kt->vl * kt->vl; i < GDN_C; i++)
            Kt[(size_t)x * GDN_C + i] = 0.0f;
    /* the Gram matrices, once for all value heads of this q/k head */
    kt->qk(L, dk, GDN_C, K, dk, Kt, zero, KK);
    kt->qk(L, dk, GDN_C, Q, dk, Kt, zero, QK);
    for (int64_t e = 0; e < p->r; e++) {
        const int64_t vh = h * p->r + e;
        chunk_gates(c, gam, vh, t0, L);
        /* A (strictly lower) and QK o Gamma o M (lower with the diagonal) */
        kt->gdn_gates(L, gam, bet, KK, QK, Am, Ao + dk, dk + GDN_C);
        for (int i = 0; i < L; i++) {
            float *ao = Ao + (size_t)i * (dk + GDN_C);
            memcpy(ao, Q + (size_t)i * dk, (size_t)dk * sizeof(float));
            kt->rows_l2scale(ao, 1, dk, ex[i], 0);
        }
        chunk_rhs(c, RHS, K, gam, vh, t0, L);
        chunk_inverse(c, Am, L, Ti);
        for (int q = 0; q < np; q++) /* [W | U] = T RHS, a panel at a time */
            kt->qk(L, L, P, Ti, GDN_C, RHS + (size_t)q * GDN_C * P, zero, WU + (size_t)q * GDN_C * P);
        for (int i = 0; i < L; i++) /* W row-major */
            for (int q = 0; q < w->pk; q++)
                memcpy(Wr + (size_t)i * dk + q * P, WU + ((size_t)q * GDN_C + i) * P,
                       (size_t)panel_cols(dk, q) * sizeof(float));
        for (int q = 0; q < w->pv; q++) {
            float *HD = hd_panel(c, W, e, q), *D = HD + (size_t)dk * P;
            prefetch_next(c, h, t0, nxt, (int)e * (int)w->pv + q, (int)(p->r * w->pv));
            kt->qk(L, dk, P, Wr, dk, HD, zero, Wh); /* W h */
            chunk_delta(c, D, WU + ((size_t)(w->pk + q) * GDN_C) * P, Wh, vh, t0, L, q);
            /* O = [2^g Q^ | QK o Gamma o M] [h ; Delta], this panel's columns */
            kt->qk(L, dk + L, P, Ao, dk + GDN_C, HD, zero, Wh);
            for (int r = 0; r < L; r++)
                store_out(c, Wh + (size_t)r * P, t0 + r, vh, q, panel_cols(p->dv, q));
        }
        if (!update)
            continue;
        /* h <- 2^g_last h + (2^(g_last - g) K^)^T Delta */
        memcpy(Kpp, K, (size_t)L * dk * sizeof(float));
        for (int i = 0; i < L; i++)
            kt->rows_l2scale(Kpp + (size_t)i * dk, 1, dk, exl[i], 0);
        for (int q = 0; q < w->pv; q++) {
            float *HD = hd_panel(c, W, e, q);
            kt->rows_l2scale(HD, dk, P, ex[L - 1], 0);
            kt->pv(L, dk, P, Kpp, dk, HD + (size_t)dk * P, HD);
        }
    }
}

/* The same chunk on bf16 products (pair layout, f32 accumulation). Rounded to bf16, and
 * nothing else (fw_gdn_ref's same-roundings mode makes exactly these roundings):
 *   Kb, Qb   the normalised key and query rows (Q^ unscaled: the scale is applied in f32)
 *   KK = Kb Kb^T, QK = Qb Kb^T;  A and T = (I + A)^-1 in f32, then Tb
 *   [W | U] = Tb [beta 2^g K^ | beta V]b;  Wb
 *   Delta = U - Wb hb, with hb the state rounded (the state itself stays f32);  Deltab
 *   O = scale (2^g o (Qb hb) + Gb Deltab), G = QK o Gamma o M in f32, then Gb
 *   h <- 2^g_last h + (2^(g_last - g) K^)b^T Deltab
 * fla's chunk kernels round the same operands (they decay Delta where this decays K^). */
static void gdn_chunk_bf16(const gdn_ctx *c, float *W, int64_t h, int64_t t0, int L, int nxt, int update)
{
    const gdn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    const gdn_ws *w = &c->w;
    const int dk = (int)p->dk, dkw = (dk + 1) / 2, P = GDN_P, np = (int)(w->pk + w->pv), Lw = (L + 1) / 2;
    float *K = W + w->kc, *Q = W + w->qc, *KK = W + w->kk, *QK = W + w->qk, *Am = W + w->am;
    float *Ti = W + w->ti, *RHS = W + w->rhs, *WU = W + w->wu, *Wr = W + w->wrow, *G = W + w->aout;
    float *Wh = W + w->wh, *Kpp = W + w->kpp, *zero = W + w->zero, *gam = W + w->gam, *X = W + w->xo;
    uint32_t *Kw = (uint32_t *)(W + w->kw), *Qw = (uint32_t *)(W + w->qw), *KtW = (uint32_t *)(W + w->ktw);
    uint32_t *Gw = (uint32_t *)(W + w->gw), *Tw = (uint32_t *)(W + w->tw), *RW = (uint32_t *)(W + w->rhsw);
    uint32_t *Ww = (uint32_t *)(W + w->ww), *Hw = (uint32_t *)(W + w->hw), *Dw = (uint32_t *)(W + w->dw);
    uint32_t *KPw = (uint32_t *)(W + w->kpw);
    const float *ex = gam + GDN_C, *exl = ex + GDN_C, *bet = exl + GDN_C;
    const float scale = (float)p->scale;
    chunk_rows(c, K, Q, h, t0, L, 1.0f);
    const void *krows[GDN_C];
    for (int i = 0; i < L; i++) {
        kt->pack_row_pairs(K + (size_t)i * dk, dk, Kw + (size_t)i * dkw);
        kt->pack_row_pairs(Q + (size_t)i * dk, dk, Qw + (size_t)i * dkw);
        krows[i] = Kw + (size_t)i * dkw;
    }
    /* Kb^T [dkw][64] words: Kb's rows are already their words, moved as bf16 rows; keys past
     * L read as zero */
    kt->pack_kt_bf16(krows, FW_BF16, 1, L, dk, KtW);
    for (int x = 0; x < dkw; x++)
        for (int i = (L + kt->vl - 1) / kt->vl * kt->vl; i < GDN_C; i++)
            KtW[(size_t)x * GDN_C + i] = 0;
    kt->qk_bf16(L, dkw, GDN_C, Kw, dkw, KtW, 1.0f, zero, KK);
    kt->qk_bf16(L, dkw, GDN_C, Qw, dkw, KtW, 1.0f, zero, QK);
    for (int64_t e = 0; e < p->r; e++) {
        const int64_t vh = h * p->r + e;
        chunk_gates(c, gam, vh, t0, L);
        kt->gdn_gates(L, gam, bet, KK, QK, Am, G, GDN_C);
        chunk_rhs(c, RHS, K, gam, vh, t0, L);
        chunk_inverse(c, Am, L, Ti);
        for (int i = 0; i < L; i++) {
            kt->pack_row_pairs(Ti + (size_t)i * GDN_C, L, Tw + (size_t)i * GDN_W);
            kt->pack_row_pairs(G + (size_t)i * GDN_C, L, Gw + (size_t)i * GDN_W);
        }
        for (int q = 0; q < np; q++) { /* [W | U] = Tb RHSb, a panel at a time */
            const float *R = RHS + (size_t)q * GDN_C * P;
            uint32_t *Rq = RW + (size_t)q * GDN_W * P;
            for (int x = 0; x < Lw; x++)
                kt->pack_pairs(R + (size_t)(2 * x) * P, 2 * x + 1 < L ? R + (size_t)(2 * x + 1) * P : NULL, P,
                               Rq + (size_t)x * P);
            kt->qk_bf16(L, Lw, P, Tw, GDN_W, Rq, 1.0f, zero, WU + (size_t)q * GDN_C * P);
        }
        for (int i = 0; i < L; i++) { /* Wb rows */
            for (int q = 0; q < w->pk; q++)
                memcpy(Wr + (size_t)i * dk + q * P, WU + ((size_t)q * GDN_C + i) * P,
                       (size_t)panel_cols(dk, q) * sizeof(float));
            kt->pack_row_pairs(Wr + (size_t)i * dk, dk, Ww + (size_t)i * dkw);
        }
        if (update) { /* (2^(g_last - g) K^)b in pairs of tokens: the A operand of the update */
            for (int i = 0; i < L; i++) {
                memcpy(Kpp + (size_t)i * dk, K + (size_t)i * dk, (size_t)dk * sizeof(float));
                kt->rows_l2scale(Kpp + (size_t)i * dk, 1, dk, exl[i], 0);
            }
            for (int x = 0; x < Lw; x++)
                kt->pack_pairs(Kpp + (size_t)(2 * x) * dk, 2 * x + 1 < L ? Kpp + (size_t)(2 * x + 1) * dk : NULL,
                               dk, KPw + (size_t)x * dk);
        }
        for (int q = 0; q < w->pv; q++) {
            float *HD = hd_panel(c, W, e, q), *D = HD + (size_t)dk * P;
            prefetch_next(c, h, t0, nxt, (int)e * (int)w->pv + q, (int)(p->r * w->pv));
            for (int x = 0; x < dkw; x++) /* hb */
                kt->pack_pairs(HD + (size_t)(2 * x) * P, 2 * x + 1 < dk ? HD + (size_t)(2 * x + 1) * P : NULL, P,
                               Hw + (size_t)x * P);
            kt->qk_bf16(L, dkw, P, Ww, dkw, Hw, 1.0f, zero, Wh); /* Wb hb */
            chunk_delta(c, D, WU + ((size_t)(w->pk + q) * GDN_C) * P, Wh, vh, t0, L, q);
            for (int x = 0; x < Lw; x++)
                kt->pack_pairs(D + (size_t)(2 * x) * P, 2 * x + 1 < L ? D + (size_t)(2 * x + 1) * P : NULL, P,
                               Dw + (size_t)x * P);
            kt->qk_bf16(L, dkw, P, Qw, dkw, Hw, 1.0f, zero, X);   /* Qb hb */
            kt->qk_bf16(L, Lw, P, Gw, GDN_W, Dw, 1.0f, zero, Wh); /* Gb Deltab */
            for (int r = 0; r < L; r++) {
                float *o = Wh + (size_t)r * P;
                const float *xr = X + (size_t)r * P;
                for (int x = 0; x < P; x++)
                    o[x] = scale * (ex[r] * xr[x] + o[x]);
                store_out(c, o, t0 + r, vh, q, panel_cols(p->dv, q));
            }
            if (update) { /* h <- 2^g_last h + (2^(g_last - g) K^)b^T Deltab */
                kt->rows_l2scale(HD, dk, P, ex[L - 1], 0);
                kt->pv_bf16(Lw, dk, P, KPw, Dw, HD);
            }
        }
    }
}

/* State rows [dk][dv] of (sequence or slot) i, value head vh, in a [*, HV, dk, dv] array. */
static size_t state_off(const gdn_prob *p, int64_t i, int64_t vh)
{
    return ((size_t)i * p->HV + vh) * (size_t)(p->dk * p->dv);
}

/* State [dk][dv] (src NULL: zeros) into the dv panels of value head e, or back out. */
static void load_state(const gdn_ctx *c, float *W, int64_t e, const float *src)
{
    const gdn_prob *p = c->p;
    for (int64_t q = 0; q < c->w.pv; q++) {
        float *HD = hd_panel(c, W, e, q);
        for (int64_t x = 0; x < p->dk; x++)
            for (int64_t y = 0; y < GDN_P; y++)
                HD[x * GDN_P + y] = src && q * GDN_P + y < p->dv ? src[x * p->dv + q * GDN_P + y] : 0.0f;
    }
}

static void store_state(const gdn_ctx *c, float *W, int64_t e, float *dst)
{
    const gdn_prob *p = c->p;
    for (int64_t q = 0; q < c->w.pv; q++) {
        const float *HD = hd_panel(c, W, e, q);
        const int64_t n = fw_min64(GDN_P, p->dv - q * GDN_P);
        for (int64_t x = 0; x < p->dk; x++)
            memcpy(dst + x * p->dv + q * GDN_P, HD + x * GDN_P, (size_t)n * sizeof(float));
    }
}

/* Prefill or verify item: (sequence, q/k head). */
static void chunked_item(void *vctx, int64_t idx, int tid)
{
    const gdn_ctx *c = vctx;
    const gdn_prob *p = c->p;
    float *W = c->ws + (size_t)tid * c->w.total;
    const int64_t seq = idx / p->H, h = idx % p->H;
    const int64_t t0 = p->cu[seq], t1 = p->cu[seq + 1];
    const int verify = c->idx != NULL;
    for (int64_t e = 0; e < p->r; e++) {
        const int64_t vh = h * p->r + e, src = verify ? c->idx[seq] : seq;
        load_state(c, W, e, c->init ? c->init + state_off(p, src, vh) : NULL);
    }
    memset(W + c->w.zero, 0, GDN_P * sizeof(float));
    for (int64_t t = t0; t < t1; t += GDN_C)
        (p->bf16 ? gdn_chunk_bf16 : gdn_chunk)(c, W, h, t, (int)fw_min64(GDN_C, t1 - t),
                                               (int)fw_min64(GDN_C, fw_max64(0, t1 - t - GDN_C)), !verify);
    if (c->final)
        for (int64_t e = 0; e < p->r; e++)
            store_state(c, W, e, c->final + state_off(p, seq, h * p->r + e));
}

/* Recurrent prefill item (the baselines): (sequence, value head), token by token. */
static void recurrent_item(void *vctx, int64_t idx, int tid)
{
    const gdn_ctx *c = vctx;
    const gdn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    float *W = c->ws + (size_t)tid * c->w.total;
    const int64_t seq = idx / p->HV, vh = idx % p->HV, h = vh / p->r;
    const int dk = (int)p->dk, dv = (int)p->dv;
    float *hst = W + c->w.hd, *q = W + c->w.qc, *k = W + c->w.kc, *v = W + c->w.wh, *o = v + dv,
          *tmp = o + dv;
    for (int64_t x = 0; x < p->dk * p->dv; x++)
        hst[x] = c->init ? c->init[state_off(p, seq, vh) + x] : 0.0f;
    for (int64_t t = p->cu[seq]; t < p->cu[seq + 1]; t++) {
        load_qk(kt, p, p->q, t, h, p->scale, q);
        load_qk(kt, p, p->k, t, h, 1.0, k);
        kt->to_f32(at(p->v, t, vh), p->v->dtype, p->v->stride[2], dv, 1.0f, v);
        const float alpha = expf(scalar_at(p->g, t, vh)), beta = scalar_at(p->beta, t, vh);
        if (c->flags & FW_GDN_RECURRENT) {
            kt->gdn_step4(hst, dv, dk, dv, q, k, v, alpha, beta, o, tmp);
        } else {
            float kq = 0;
            for (int x = 0; x < dk; x++)
                kq += k[x] * q[x];
            for (int c0 = 0; c0 < dv; c0 += 64)
                kt->gdn_dec_cols(hst, dv, dk, c0, (int)fw_min64(dv, c0 + 64), q, k, v, alpha, beta, kq, o);
        }
        kt->from_f32(o, dv, (void *)at(p->out, t, vh), p->out->dtype, p->out->stride[2]);
    }
    if (c->final)
        memcpy(c->final + state_off(p, seq, vh), hst, (size_t)(p->dk * p->dv) * sizeof(float));
}

static int threads_of(const fw_gdn_params *params)
{
    return params && params->threads > 0 ? params->threads : fw_cpu_count();
}

/* Allocate per-thread workspace and run `fn` over n items. */
static fw_status gdn_run(gdn_ctx *c, const fw_gdn_params *params, int64_t n, fw_item_fn fn)
{
    const fw_kernels *kt = fw_kernels_get(params ? params->isa : NULL);
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    c->kt = kt;
    c->flags = params ? params->flags : 0;
    c->w = gdn_plan(c->p);
    const int threads = threads_of(params);
    if (n == 0)
        return FW_OK;
    c->ws = malloc((size_t)threads * c->w.total * sizeof(float));
    if (!c->ws)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate %zu bytes of workspace",
                       (size_t)threads * c->w.total * sizeof(float));
    fw_parallel(threads, n, fn, c);
    free(c->ws);
    return FW_OK;
}

fw_status fw_gdn_prefill(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                         const fw_tensor *beta, const int32_t *cu_seqlens, int64_t n_seqs,
                         const float *initial_state, float *final_state, const fw_tensor *out,
                         const fw_gdn_params *params)
{
    fw_clear_error();
    gdn_prob p;
    fw_status s = gdn_check(&p, q, k, v, g, beta, cu_seqlens, n_seqs, 1, out, params, 0);
    if (s)
        return s;
    gdn_ctx c;
    memset(&c, 0, sizeof c);
    c.p = &p;
    c.init = initial_state;
    c.final = final_state;
    const uint32_t fl = params ? params->flags : 0;
    if (fl & (FW_GDN_RECURRENT | FW_GDN_FUSED_RECURRENT)) {
        p.bf16 = 0; /* the recurrent baselines run f32 products */
        return gdn_run(&c, params, n_seqs * p.HV, recurrent_item);
    }
    /* initial and final state may be one buffer: every item reads its own states before it
     * writes them, and no two items share a state */
    return gdn_run(&c, params, n_seqs * p.H, chunked_item);
}

/* ------------------------------------------------------------------ decode -- */

typedef struct {
    const gdn_prob *p;
    const fw_kernels *kt;
    float *state;
    const int32_t *idx;
    float *ws;
    size_t ws_stride;
    int64_t nblk;
} dec_ctx;

/* Item: (sequence, value head, block of state columns). A block is every column (whole rows,
 * read front to back) unless there are fewer (sequence, head) pairs than threads; then
 * columns split in blocks of 64 (the columns are independent). Measured, 64 sequences x 32
 * heads, 2 threads: 17.2 GB/s of state with 64-column items, which read half of every row. */
static void decode_item(void *vctx, int64_t it, int tid)
{
    const dec_ctx *c = vctx;
    const gdn_prob *p = c->p;
    const int64_t blk = it % c->nblk, vh = (it / c->nblk) % p->HV, i = it / (c->nblk * p->HV);
    const int64_t w = c->nblk == 1 ? p->dv : 64;
    const int dk = (int)p->dk, dv = (int)p->dv, c0 = (int)(blk * w), c1 = (int)fw_min64(dv, c0 + w);
    float *W = c->ws + (size_t)tid * c->ws_stride, *q = W, *k = q + dk, *v = k + dk, *o = v + dv;
    load_qk(c->kt, p, p->q, i, vh / p->r, p->scale, q);
    load_qk(c->kt, p, p->k, i, vh / p->r, 1.0, k);
    c->kt->to_f32(at(p->v, i, vh), p->v->dtype, p->v->stride[2], dv, 1.0f, v);
    float kq = 0;
    for (int x = 0; x < dk; x++)
        kq += k[x] * q[x];
    c->kt->gdn_dec_cols(c->state + state_off(p, c->idx[i], vh), dv, dk, c0, c1, q, k, v,
                        expf(scalar_at(p->g, i, vh)), scalar_at(p->beta, i, vh), kq, o);
    c->kt->from_f32(o + c0, c1 - c0,
                    (char *)at(p->out, i, vh) + (int64_t)c0 * p->out->stride[2] * (int64_t)fw_dtype_size(p->out->dtype),
                    p->out->dtype, p->out->stride[2]);
}

static fw_status check_slots(const int32_t *idx, int64_t n, int64_t slots, const float *state)
{
    if (!state)
        return fw_fail(FW_ERR_NULL, "state is NULL");
    if (n > 0 && !idx)
        return fw_fail(FW_ERR_NULL, "state_indices is NULL");
    if (slots < 0)
        return fw_fail(FW_ERR_ARG, "slots is %lld; it must be >= 0", (long long)slots);
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= slots)
            return fw_fail(FW_ERR_INDEX, "state_indices[%lld] = %d is not a slot (0..%lld)", (long long)i,
                           (int)idx[i], (long long)slots - 1);
    /* distinct slots: each sequence owns its state */
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = i + 1; j < n && j < i + 4096; j++)
            if (idx[i] == idx[j])
                return fw_fail(FW_ERR_INDEX, "sequences %lld and %lld share state slot %d", (long long)i,
                               (long long)j, (int)idx[i]);
    return FW_OK;
}

fw_status fw_gdn_decode(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                        const fw_tensor *beta, float *state, int64_t slots, const int32_t *state_indices,
                        const fw_tensor *out, const fw_gdn_params *params)
{
    fw_clear_error();
    gdn_prob p;
    fw_status s = gdn_check(&p, q, k, v, g, beta, NULL, 0, 0, out, params, 0);
    if (s || (s = check_slots(state_indices, p.T, slots, state)))
        return s;
    const fw_kernels *kt = fw_kernels_get(params ? params->isa : NULL);
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    const int threads = threads_of(params);
    dec_ctx c = {&p, kt, state, state_indices, NULL, (size_t)(2 * p.dk + 2 * p.dv + 16),
                 p.T * p.HV >= threads ? 1 : (p.dv + 63) / 64};
    const int64_t n = p.T * p.HV * c.nblk;
    if (n == 0)
        return FW_OK;
    if (!(c.ws = malloc((size_t)threads * c.ws_stride * sizeof(float))))
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the decode workspace");
    fw_parallel(threads, n, decode_item, &c);
    free(c.ws);
    return FW_OK;
}

/* ------------------------------------------------------- verify and commit -- */

size_t fw_gdn_replay_floats(int64_t T, int64_t H, int64_t HV, int64_t dk, int64_t dv)
{
    if (T < 0 || H < 0 || HV < 0 || dk < 0 || dv < 0)
        return 0;
    return (size_t)T * ((size_t)HV * (size_t)(dv + 1) + (size_t)H * (size_t)dk);
}

fw_status fw_gdn_verify(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                        const fw_tensor *beta, const int32_t *cu_seqlens, int64_t n_seqs, const float *state,
                        int64_t slots, const int32_t *state_indices, float *replay, size_t replay_floats,
                        const fw_tensor *out, const fw_gdn_params *params)
{
    fw_clear_error();
    gdn_prob p;
    fw_status s = gdn_check(&p, q, k, v, g, beta, cu_seqlens, n_seqs, 1, out, params, 0);
    if (s || (s = check_slots(state_indices, n_seqs, slots, state)))
        return s;
    for (int64_t i = 0; i < n_seqs; i++)
        if (cu_seqlens[i + 1] - cu_seqlens[i] > GDN_C)
            return fw_fail(FW_ERR_SEQLENS, "sequence %lld has %d tokens to verify; at most %d", (long long)i,
                           (int)(cu_seqlens[i + 1] - cu_seqlens[i]), GDN_C);
    if (!replay)
        return fw_fail(FW_ERR_NULL, "replay is NULL");
    const size_t need = fw_gdn_replay_floats(p.T, p.H, p.HV, p.dk, p.dv);
    if (replay_floats < need)
        return fw_fail(FW_ERR_WORKSPACE, "replay holds %zu floats; this call needs %zu", replay_floats, need);
    gdn_ctx c;
    memset(&c, 0, sizeof c);
    c.p = &p;
    c.init = state;
    c.idx = state_indices;
    c.replay = replay;
    fw_gdn_params vp;
    if (params)
        vp = *params;
    else
        fw_gdn_params_init(&vp);
    vp.flags &= FW_GDN_FWD_SUBST; /* verify is always the one-chunk WY pass */
    return gdn_run(&c, &vp, n_seqs * p.H, chunked_item);
}

/* Commit item (sequence i, value head vh): h = 2^g_{m-1} h_0 + sum_{j<m} 2^(g_{m-1} - g_j) k_j delta_j^T
 * with m = accepted[i] and g the chunk-local log decays (log2 units) kept by verify. */
typedef struct {
    const int32_t *cu, *accepted;
    int64_t H, HV, dk, dv;
    float *state;
    const int32_t *idx;
    const float *replay;
    int64_t T;
} commit_ctx;

static void commit_item(void *vctx, int64_t it, int tid)
{
    const commit_ctx *c = vctx;
    const int64_t i = it / c->HV, vh = it % c->HV, m = c->accepted[i], t0 = c->cu[i];
    const int64_t dk = c->dk, dv = c->dv;
    if (m == 0)
        return;
    const float *deltas = c->replay, *gams = c->replay + (size_t)c->T * c->HV * dv,
                *keys = gams + (size_t)c->T * c->HV;
    float *h = c->state + ((size_t)c->idx[i] * c->HV + vh) * (size_t)(dk * dv);
    const float glast = gams[(size_t)(t0 + m - 1) * c->HV + vh];
    const float al = exp2f(glast);
    for (int64_t x = 0; x < dk * dv; x++)
        h[x] *= al;
    for (int64_t j = 0; j < m; j++) {
        const float w = exp2f(glast - gams[(size_t)(t0 + j) * c->HV + vh]);
        const float *kj = keys + ((size_t)(t0 + j) * c->H + vh / (c->HV / c->H)) * dk;
        const float *dj = deltas + ((size_t)(t0 + j) * c->HV + vh) * dv;
        for (int64_t x = 0; x < dk; x++) {
            const float a = w * kj[x];
            for (int64_t y = 0; y < dv; y++)
                h[x * dv + y] += a * dj[y];
        }
    }
    (void)tid;
}

fw_status fw_gdn_commit(const int32_t *cu_seqlens, int64_t n_seqs, const int32_t *accepted, int64_t H,
                        int64_t HV, int64_t dk, int64_t dv, float *state, int64_t slots,
                        const int32_t *state_indices, const float *replay, size_t replay_floats,
                        const fw_gdn_params *params)
{
    fw_clear_error();
    fw_status s;
    if (n_seqs < 0 || n_seqs > INT32_MAX)
        return fw_fail(FW_ERR_ARG, "n_seqs is %lld; it must be 0..2^31-1", (long long)n_seqs);
    if (!cu_seqlens || !accepted || !replay)
        return fw_fail(FW_ERR_NULL, "%s is NULL", !cu_seqlens ? "cu_seqlens" : !accepted ? "accepted" : "replay");
    if (H < 1 || HV < 1 || HV % H || dk < 1 || dk > 1024 || dv < 1 || dv > 1024)
        return fw_fail(FW_ERR_SHAPE, "H %lld, HV %lld, dk %lld, dv %lld: HV must be a multiple of H and dims 1..1024",
                       (long long)H, (long long)HV, (long long)dk, (long long)dv);
    if ((s = check_slots(state_indices, n_seqs, slots, state)))
        return s;
    if (cu_seqlens[0] != 0)
        return fw_fail(FW_ERR_SEQLENS, "cu_seqlens[0] is %d; it must be 0", (int)cu_seqlens[0]);
    for (int64_t i = 0; i < n_seqs; i++) {
        const int64_t len = (int64_t)cu_seqlens[i + 1] - cu_seqlens[i];
        if (len < 0 || len > GDN_C)
            return fw_fail(FW_ERR_SEQLENS, "sequence %lld has %lld verified tokens; 0..%d expected", (long long)i,
                           (long long)len, GDN_C);
        if (accepted[i] < 0 || accepted[i] > len)
            return fw_fail(FW_ERR_ARG, "accepted[%lld] = %d is outside 0..%lld", (long long)i, (int)accepted[i],
                           (long long)len);
    }
    const int64_t T = cu_seqlens[n_seqs];
    if (replay_floats < fw_gdn_replay_floats(T, H, HV, dk, dv))
        return fw_fail(FW_ERR_WORKSPACE, "replay holds %zu floats; %zu expected", replay_floats,
                       fw_gdn_replay_floats(T, H, HV, dk, dv));
    if (params && (params->threads < 0 || params->threads > 256))
        return fw_fail(FW_ERR_ARG, "threads is %d; it must be 0 (all CPUs) to 256", (int)params->threads);
    commit_ctx c = {cu_seqlens, accepted, H, HV, dk, dv, state, state_indices, replay, T};
    fw_parallel(threads_of(params), n_seqs * HV, commit_item, &c);
    return FW_OK;
}

/* --------------------------------------------------------------- reference -- */

/* Element (i, j, x) of a 3-D tensor, in double, and the store back. */
static int64_t off3(const fw_tensor *t, int64_t i, int64_t j, int64_t x)
{
    return i * t->stride[0] + j * t->stride[1] + x * t->stride[2];
}

/* x rounded to bf16 (nearest even). */
static double rb(double x) { return (double)fw_bf16_to_f32(fw_f32_to_bf16((float)x)); }

/* The normalised row (l2: x / sqrt(|x|^2 + 1e-6)) of token t, head hh of x, in double. */
static void ref_row(const gdn_prob *p, const fw_tensor *x, int64_t t, int64_t hh, double *dst)
{
    double n = 0;
    for (int64_t i = 0; i < p->dk; i++) {
        dst[i] = fw_load_f64(x, off3(x, t, hh, i));
        n += dst[i] * dst[i];
    }
    const double s = p->l2 ? 1.0 / sqrt(n + 1e-6) : 1.0;
    for (int64_t i = 0; i < p->dk; i++)
        dst[i] *= s;
}

/* Same-roundings reference of the chunked pass on bf16 products: chunks of 64 tokens from each
 * sequence's start, every product in double, and the roundings of gdn_chunk_bf16 (its comment)
 * and no others. One (sequence, value head) at a time. */
static fw_status gdn_ref_bf16(const gdn_prob *p, const float *init, double *final)
{
    const int64_t C = GDN_C, dk = p->dk, dv = p->dv;
    double *h = malloc(sizeof(double) * (size_t)(dk * dv)), *hb = malloc(sizeof(double) * (size_t)(dk * dv));
    double *Kh = malloc(sizeof(double) * (size_t)(C * dk)), *Kb = malloc(sizeof(double) * (size_t)(C * dk));
    double *Qb = malloc(sizeof(double) * (size_t)(C * dk)), *Wb = malloc(sizeof(double) * (size_t)(C * dk));
    double *U = malloc(sizeof(double) * (size_t)(C * dv)), *Db = malloc(sizeof(double) * (size_t)(C * dv));
    double *T = malloc(sizeof(double) * (size_t)(C * C)), *Gb = malloc(sizeof(double) * (size_t)(C * C));
    double *row = malloc(sizeof(double) * (size_t)(dk > dv ? dk : dv));
    double gam[GDN_C], bet[GDN_C];
    if (!h || !hb || !Kh || !Kb || !Qb || !Wb || !U || !Db || !T || !Gb || !row) {
        free(h); free(hb); free(Kh); free(Kb); free(Qb); free(Wb); free(U); free(Db); free(T); free(Gb); free(row);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the reference state");
    }
    for (int64_t s = 0; s < p->n; s++)
        for (int64_t vh = 0; vh < p->HV; vh++) {
            const int64_t hh = vh / p->r;
            for (int64_t x = 0; x < dk * dv; x++)
                h[x] = init ? init[state_off(p, s, vh) + x] : 0.0;
            for (int64_t t0 = p->cu[s]; t0 < p->cu[s + 1]; t0 += C) {
                const int64_t L = fw_min64(C, p->cu[s + 1] - t0);
                double acc = 0;
                for (int64_t i = 0; i < L; i++) {
                    ref_row(p, p->k, t0 + i, hh, Kh + i * dk);
                    ref_row(p, p->q, t0 + i, hh, Qb + i * dk);
                    for (int64_t x = 0; x < dk; x++) {
                        Kb[i * dk + x] = rb(Kh[i * dk + x]);
                        Qb[i * dk + x] = rb(Qb[i * dk + x]);
                    }
                    acc += scalar_at(p->g, t0 + i, vh);
                    gam[i] = acc;
                    bet[i] = scalar_at(p->beta, t0 + i, vh);
                }
                /* T = (I + A)^-1, A_ij = beta_i e^(gam_i - gam_j) Kb_i . Kb_j (j < i), by rows;
                 * Gb = (e^(gam_i - gam_j) Qb_i . Kb_j)b (j <= i) */
                for (int64_t i = 0; i < L; i++) {
                    double a[GDN_C];
                    for (int64_t j = 0; j < L; j++) {
                        double kk = 0, qk = 0;
                        for (int64_t x = 0; x < dk; x++) {
                            kk += Kb[i * dk + x] * Kb[j * dk + x];
                            qk += Qb[i * dk + x] * Kb[j * dk + x];
                        }
                        a[j] = j < i ? bet[i] * exp(gam[i] - gam[j]) * kk : 0.0;
                        Gb[i * C + j] = j <= i ? rb(exp(gam[i] - gam[j]) * qk) : 0.0;
                    }
                    for (int64_t j = 0; j < L; j++) {
                        double v = i == j;
                        for (int64_t m = j; m < i; m++)
                            v -= a[m] * T[m * C + j];
                        T[i * C + j] = j <= i ? v : 0.0;
                    }
                }
                for (int64_t i = 0; i < L * C; i++)
                    T[i] = rb(T[i]);
                /* [W | U] = Tb [beta e^gam K^ | beta V]b; Wb */
                for (int64_t i = 0; i < L; i++) {
                    for (int64_t x = 0; x < dk; x++)
                        Wb[i * dk + x] = 0;
                    for (int64_t y = 0; y < dv; y++)
                        U[i * dv + y] = 0;
                }
                for (int64_t j = 0; j < L; j++) {
                    for (int64_t x = 0; x < dk; x++)
                        row[x] = rb(bet[j] * exp(gam[j]) * Kh[j * dk + x]);
                    for (int64_t i = j; i < L; i++)
                        for (int64_t x = 0; x < dk; x++)
                            Wb[i * dk + x] += T[i * C + j] * row[x];
                    for (int64_t y = 0; y < dv; y++)
                        row[y] = rb(bet[j] * fw_load_f64(p->v, off3(p->v, t0 + j, vh, y)));
                    for (int64_t i = j; i < L; i++)
                        for (int64_t y = 0; y < dv; y++)
                            U[i * dv + y] += T[i * C + j] * row[y];
                }
                for (int64_t i = 0; i < L * dk; i++)
                    Wb[i] = rb(Wb[i]);
                for (int64_t x = 0; x < dk * dv; x++)
                    hb[x] = rb(h[x]);
                /* Deltab = (U - Wb hb)b; O = scale (e^gam Qb hb + Gb Deltab) */
                for (int64_t i = 0; i < L; i++)
                    for (int64_t y = 0; y < dv; y++) {
                        double wh = 0;
                        for (int64_t x = 0; x < dk; x++)
                            wh += Wb[i * dk + x] * hb[x * dv + y];
                        Db[i * dv + y] = rb(U[i * dv + y] - wh);
                    }
                for (int64_t i = 0; i < L; i++)
                    for (int64_t y = 0; y < dv; y++) {
                        double qh = 0, gd = 0;
                        for (int64_t x = 0; x < dk; x++)
                            qh += Qb[i * dk + x] * hb[x * dv + y];
                        for (int64_t j = 0; j <= i; j++)
                            gd += Gb[i * C + j] * Db[j * dv + y];
                        fw_store_f64(p->out, off3(p->out, t0 + i, vh, y), p->scale * (exp(gam[i]) * qh + gd));
                    }
                /* h <- e^gam_last h + sum_i (e^(gam_last - gam_i) K^_i)b^T Deltab_i */
                const double al = exp(gam[L - 1]);
                for (int64_t x = 0; x < dk * dv; x++)
                    h[x] *= al;
                for (int64_t i = 0; i < L; i++)
                    for (int64_t x = 0; x < dk; x++) {
                        const double kx = rb(exp(gam[L - 1] - gam[i]) * Kh[i * dk + x]);
                        for (int64_t y = 0; y < dv; y++)
                            h[x * dv + y] += kx * Db[i * dv + y];
                    }
            }
            if (final)
                memcpy(final + state_off(p, s, vh), h, sizeof(double) * (size_t)(dk * dv));
        }
    free(h); free(hb); free(Kh); free(Kb); free(Qb); free(Wb); free(U); free(Db); free(T); free(Gb); free(row);
    return FW_OK;
}

fw_status fw_gdn_ref(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                     const fw_tensor *beta, const int32_t *cu_seqlens, int64_t n_seqs,
                     const float *initial_state, double *final_state, const fw_tensor *out,
                     const fw_gdn_params *params)
{
    fw_clear_error();
    gdn_prob p;
    fw_status s = gdn_check(&p, q, k, v, g, beta, cu_seqlens, n_seqs, 1, out, params, 1);
    if (s)
        return s;
    if (p.bf16 && !(params && params->flags & (FW_GDN_RECURRENT | FW_GDN_FUSED_RECURRENT)))
        return gdn_ref_bf16(&p, initial_state, final_state);
    const int64_t dk = p.dk, dv = p.dv;
    double *h = malloc(sizeof(double) * (size_t)(dk * dv)), *qq = malloc(sizeof(double) * (size_t)dk),
           *kk = malloc(sizeof(double) * (size_t)dk), *a = malloc(sizeof(double) * (size_t)dv);
    if (!h || !qq || !kk || !a) {
        free(h); free(qq); free(kk); free(a);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the reference state");
    }
    for (int64_t i = 0; i < n_seqs; i++)
        for (int64_t vh = 0; vh < p.HV; vh++) {
            const int64_t hh = vh / p.r;
            for (int64_t x = 0; x < dk * dv; x++)
                h[x] = initial_state ? initial_state[state_off(&p, i, vh) + x] : 0.0;
            for (int64_t t = cu_seqlens[i]; t < cu_seqlens[i + 1]; t++) {
                double nq = 0, nk = 0;
                for (int64_t x = 0; x < dk; x++) {
                    qq[x] = fw_load_f64(q, off3(q, t, hh, x));
                    kk[x] = fw_load_f64(k, off3(k, t, hh, x));
                    nq += qq[x] * qq[x];
                    nk += kk[x] * kk[x];
                }
                const double sq = p.scale / (p.l2 ? sqrt(nq + 1e-6) : 1.0), sk = p.l2 ? 1.0 / sqrt(nk + 1e-6) : 1.0;
                for (int64_t x = 0; x < dk; x++) {
                    qq[x] *= sq;
                    kk[x] *= sk;
                }
                const double al = exp((double)scalar_at(g, t, vh)), be = scalar_at(beta, t, vh);
                for (int64_t y = 0; y < dv; y++) {
                    double acc = 0;
                    for (int64_t x = 0; x < dk; x++)
                        acc += h[x * dv + y] * kk[x];
                    a[y] = be * (fw_load_f64(v, off3(v, t, vh, y)) - al * acc); /* delta */
                }
                for (int64_t x = 0; x < dk; x++)
                    for (int64_t y = 0; y < dv; y++)
                        h[x * dv + y] = al * h[x * dv + y] + kk[x] * a[y];
                for (int64_t y = 0; y < dv; y++) {
                    double o = 0;
                    for (int64_t x = 0; x < dk; x++)
                        o += h[x * dv + y] * qq[x];
                    fw_store_f64(out, off3(out, t, vh, y), o);
                }
            }
            if (final_state)
                memcpy(final_state + state_off(&p, i, vh), h, sizeof(double) * (size_t)(dk * dv));
        }
    free(h); free(qq); free(kk); free(a);
    return FW_OK;
}
