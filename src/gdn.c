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

typedef struct {
    int64_t pk, pv;                 /* panels over dk and over dv */
    size_t kc, qc, ktr, kk, qk, am, ti, rhs, wu, wrow, aout, wh, kpp, zero, gam, hd, total; /* floats */
} gdn_ws;

static gdn_ws gdn_plan(const gdn_prob *p)
{
    gdn_ws w;
    const size_t C = GDN_C, dk = (size_t)p->dk, P = GDN_P;
    w.pk = (p->dk + GDN_P - 1) / GDN_P;
    w.pv = (p->dv + GDN_P - 1) / GDN_P;
    const size_t np = (size_t)(w.pk + w.pv);
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

/* One chunk of tokens [t0, t0 + L) of q/k head h for its r value heads. */
static void gdn_chunk(const gdn_ctx *c, float *W, int64_t h, int64_t t0, int L, int update)
{
    const gdn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    const gdn_ws *w = &c->w;
    const int dk = (int)p->dk, dv = (int)p->dv, P = GDN_P, np = (int)(w->pk + w->pv);
    float *K = W + w->kc, *Q = W + w->qc, *Kt = W + w->ktr, *KK = W + w->kk, *QK = W + w->qk;
    float *Am = W + w->am, *Ti = W + w->ti, *RHS = W + w->rhs, *WU = W + w->wu, *Wr = W + w->wrow;
    float *Ao = W + w->aout, *Wh = W + w->wh, *Kpp = W + w->kpp, *zero = W + w->zero, *gam = W + w->gam;
    float *ex = gam + GDN_C, *exl = ex + GDN_C, *bet = exl + GDN_C;
    for (int i = 0; i < L; i++) {
        kt->to_f32(at(p->k, t0 + i, h), p->k->dtype, p->k->stride[2], dk, 1.0f, K + (size_t)i * dk);
        kt->to_f32(at(p->q, t0 + i, h), p->q->dtype, p->q->stride[2], dk, 1.0f, Q + (size_t)i * dk);
    }
    kt->rows_l2scale(K, L, dk, 1.0f, p->l2);
    kt->rows_l2scale(Q, L, dk, (float)p->scale, p->l2);
    const void *krows[GDN_C];
    for (int i = 0; i < L; i++) {
        krows[i] = K + (size_t)i * dk;
        if (c->replay)
            memcpy(c->replay + (size_t)p->T * p->HV * (p->dv + 1) + ((size_t)(t0 + i) * p->H + h) * dk,
                   K + (size_t)i * dk, (size_t)dk * sizeof(float));
    }
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
        /* gamma: chunk-local cumulative log decay, log2 units */
        double acc = 0;
        for (int i = 0; i < L; i++) {
            acc += scalar_at(p->g, t0 + i, vh);
            gam[i] = (float)(acc * FW_LOG2E);
        }
        for (int i = 0; i < L; i++) {
            ex[i] = gam[i];
            exl[i] = gam[L - 1] - gam[i];
        }
        kt->exp2_inplace(ex, L);
        kt->exp2_inplace(exl, L);
        /* A (strictly lower) and QK o Gamma o M (lower with the diagonal) */
        for (int i = 0; i < L; i++)
            bet[i] = scalar_at(p->beta, t0 + i, vh);
        for (int i = L; i < GDN_C; i++)
            gam[i] = 0.0f;
        kt->gdn_gates(L, gam, bet, KK, QK, Am, Ao + dk, dk + GDN_C);
        for (int i = 0; i < L; i++) {
            const float b = bet[i];
            float *ao = Ao + (size_t)i * (dk + GDN_C);
            memcpy(ao, Q + (size_t)i * dk, (size_t)dk * sizeof(float));
            kt->rows_l2scale(ao, 1, dk, ex[i], 0);
            /* right-hand side [beta 2^g K^ | beta V] in panels: pk panels of K, pv of V */
            for (int q = 0; q < np; q++) {
                float *rh = RHS + ((size_t)q * GDN_C + i) * P;
                int n;
                if (q < w->pk) {
                    n = dk - q * P < P ? dk - q * P : P;
                    memcpy(rh, K + (size_t)i * dk + q * P, (size_t)n * sizeof(float));
                    kt->rows_l2scale(rh, 1, n, b * ex[i], 0);
                } else {
                    const int v0 = (q - (int)w->pk) * P;
                    n = dv - v0 < P ? dv - v0 : P;
                    kt->to_f32(at(p->v, t0 + i, vh) + (size_t)(v0 * p->v->stride[2]) * fw_dtype_size(p->v->dtype),
                               p->v->dtype, p->v->stride[2], n, b, rh);
                }
                for (int x = n; x < P; x++)
                    rh[x] = 0.0f;
            }
        }
        if (c->flags & FW_GDN_FWD_SUBST)
            kt->tri_inv_fwd(Am, GDN_C, L, Ti, GDN_C);
        else
            kt->tri_inv_blocked(Am, GDN_C, L, Ti, GDN_C);
        for (int q = 0; q < np; q++) /* [W | U] = T RHS, a panel at a time */
            kt->qk(L, L, P, Ti, GDN_C, RHS + (size_t)q * GDN_C * P, zero, WU + (size_t)q * GDN_C * P);
        for (int i = 0; i < L; i++) /* W row-major */
            for (int q = 0; q < w->pk; q++)
                memcpy(Wr + (size_t)i * dk + q * P, WU + ((size_t)q * GDN_C + i) * P,
                       (size_t)(dk - q * P < P ? dk - q * P : P) * sizeof(float));
        for (int q = 0; q < w->pv; q++) {
            float *HD = hd_panel(c, W, e, q), *D = HD + (size_t)dk * P;
            const float *U = WU + ((size_t)(w->pk + q) * GDN_C) * P;
            kt->qk(L, dk, P, Wr, dk, HD, zero, Wh); /* W h */
            for (int i = 0; i < L; i++) {
                for (int x = 0; x < P; x++)
                    D[(size_t)i * P + x] = U[(size_t)i * P + x] - Wh[(size_t)i * P + x];
                if (c->replay) {
                    const int n = dv - q * P < P ? dv - q * P : P;
                    memcpy(c->replay + ((size_t)(t0 + i) * p->HV + vh) * dv + q * P, D + (size_t)i * P,
                           (size_t)n * sizeof(float));
                }
            }
            /* O = [2^g Q^ | QK o Gamma o M] [h ; Delta], this panel's columns */
            kt->qk(L, dk + L, P, Ao, dk + GDN_C, HD, zero, Wh);
            const int n = dv - q * P < P ? dv - q * P : P;
            for (int r = 0; r < L; r++)
                kt->from_f32(Wh + (size_t)r * P, n,
                             (char *)at(p->out, t0 + r, vh) +
                                 (size_t)(q * P * p->out->stride[2]) * fw_dtype_size(p->out->dtype),
                             p->out->dtype, p->out->stride[2]);
        }
        if (c->replay)
            for (int i = 0; i < L; i++)
                c->replay[(size_t)p->T * p->HV * dv + (size_t)(t0 + i) * p->HV + vh] = gam[i];
        if (!update)
            continue;
        /* h <- 2^g_last h + (2^(g_last - g) K^)^T Delta */
        const float al = ex[L - 1];
        memcpy(Kpp, K, (size_t)L * dk * sizeof(float));
        for (int i = 0; i < L; i++)
            kt->rows_l2scale(Kpp + (size_t)i * dk, 1, dk, exl[i], 0);
        for (int q = 0; q < w->pv; q++) {
            float *HD = hd_panel(c, W, e, q);
            kt->rows_l2scale(HD, dk, P, al, 0);
            kt->pv(L, dk, P, Kpp, dk, HD + (size_t)dk * P, HD);
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
        gdn_chunk(c, W, h, t, (int)fw_min64(GDN_C, t1 - t), !verify);
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
    if (fl & (FW_GDN_RECURRENT | FW_GDN_FUSED_RECURRENT))
        return gdn_run(&c, params, n_seqs * p.HV, recurrent_item);
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
