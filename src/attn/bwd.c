/*
 * attn/bwd.c: softmax attention's backward (fw_attn_bwd, fw_attn_varlen_bwd): validation, the
 * work list and its threads, and the two item kernels, tiled and plain.
 *
 * FlashAttention-2's algorithm on the forward's tile layout turned around: vectors run along
 * the 64 keys of a K/V tile, so every product is one of the forward's two micro-kernels
 * (kern/mm_kern.h) and nothing is transposed per tile. For a q tile of R rows (the G heads
 * of a GQA group stacked, as in the forward) and a key tile:
 *   S  [R][64] = Q K^T        qk, K packed transposed once per block (KT [d][64])
 *   dP [R][64] = dO V^T       qk, VT [dv][64]
 *   P = 2^(qs S - lse2), dS = P (dP - D)      bwd_ds (D = rowsum(dO o O), computed first)
 *   dV^T [dv][64] += dO^T P   pv: dV accumulates over the rows, in registers per call
 *   dK^T [d][64]  += Q^T dS   pv
 *   dQ [R][d] += dS K         qk into a scratch tile, added to dq's f32 partial sums
 * With bf16 products the same five run on qk_bf16 / pv_bf16 over pair-layout panels (two
 * adjacent elements of the reduction in one word): Q, dO as row words (pairs along d) and as
 * row pairs (two query rows interleaved), K^T, V^T as words of two channels per key, K as
 * two keys interleaved; P is rounded to bf16 for dV and dS for dK and dQ, as flash-attn does.
 * Work items are (sequence, K/V head, key split): an item owns the dK / dV of its keys
 * outright (every q head of the group is in its tiles) and writes its split's copy of dq's
 * partial sums, so no two items write one address and nothing is atomic. Inside an item the
 * keys run in blocks of FW_ATTN_BWD_KEYS (the outer loop, accumulators resident) and the q
 * tiles in order inside each block. A last pass adds the splits in split order. Every sum
 * runs in an order fixed by the shapes, so the bits do not depend on the thread count.
 */
#include <math.h>
#include <stdlib.h>
#include "bwd.h"

/* ------------------------------------------------------------- validation -- */

/* dst = the strides of t as [batch, token, head, dim] (batch 0 for varlen). */
static void strides4(const fw_tensor *t, int varlen, int64_t dst[4])
{
    dst[0] = varlen ? 0 : t->stride[0];
    for (int i = 0; i < 3; i++)
        dst[i + 1] = t->stride[i + !varlen];
}

/* params->dsinks: [hq] f32 (or f64 for the reference), with the forward's sinks, apart from
 * every input (in: q, k, v, out, dout, lse) and gradient (got: dout, dq, dk, dv). */
static fw_status setup_dsinks(fw_attn_bwd_prob *b, const fw_attn_params *params,
                              const fw_tensor *const in[6], const fw_tensor *const got[4], int ref)
{
    const fw_tensor *t = params ? params->dsinks : NULL;
    if (!t)
        return FW_OK;
    if (!params->sinks)
        return fw_fail(FW_ERR_NULL, "dsinks is set but sinks is NULL: the sinks' gradient needs "
                       "the forward's sinks");
    fw_status s = fw_check_tensor(t, "dsinks", 1, (1u << FW_F32) | (ref ? 1u << FW_F64 : 0u));
    if (s)
        return s;
    if (t->shape[0] != b->f.hq)
        return fw_fail(FW_ERR_SHAPE, "dsinks has %lld values; it must have one per query head "
                       "(%lld)", (long long)t->shape[0], (long long)b->f.hq);
    if ((s = fw_check_no_alias(t, "dsinks")))
        return s;
    if (fw_overlap(t, params->sinks))
        return fw_fail(FW_ERR_STRIDE, "dsinks overlaps sinks");
    static const char *names[10] = {"q", "k", "v", "out", "dout", "lse", "dout", "dq", "dk", "dv"};
    for (int u = 0; u < 10; u++)
        if (fw_overlap(t, u < 6 ? in[u] : got[u - 6]))
            return fw_fail(FW_ERR_STRIDE, "dsinks overlaps %s", names[u]);
    b->dsinks = t;
    return FW_OK;
}

fw_status fw_attn_setup_bwd(fw_attn_bwd_prob *b, const fw_tensor *q, const fw_tensor *k,
                            const fw_tensor *v, const fw_tensor *out, const fw_tensor *dout,
                            const fw_tensor *lse, const int32_t *cuq, const int32_t *cuk,
                            int64_t batch, int varlen, const fw_tensor *dq, const fw_tensor *dk,
                            const fw_tensor *dv, const fw_attn_params *params, int ref)
{
    memset(b, 0, sizeof *b);
    if (params && (params->rotary_cos || params->rotary_sin))
        return fw_fail(FW_ERR_ARG, "rotary embedding in the backward is not supported: rotate q and "
                       "k before the forward to differentiate through it");
    if (!lse)
        return fw_fail(FW_ERR_NULL, "lse is NULL: the backward needs the forward's lse");
    fw_status s = fw_attn_setup(&b->f, q, k, v, cuq, cuk, batch, varlen, out, lse, params, ref);
    if (s)
        return s;
    const int nd = varlen ? 3 : 4;
    const unsigned dt_out = FW_DT_IN | (ref ? 1u << FW_F64 : 0u);
    if ((s = fw_check_tensor(dout, "dout", nd, FW_DT_IN)) ||
        (s = fw_check_tensor(dq, "dq", nd, dt_out)) || (s = fw_check_tensor(dk, "dk", nd, dt_out)) ||
        (s = fw_check_tensor(dv, "dv", nd, dt_out)))
        return s;
    const fw_tensor *want[4] = {out, q, k, v}, *got[4] = {dout, dq, dk, dv};
    const char *names[4] = {"dout", "dq", "dk", "dv"}, *like[4] = {"out", "q", "k", "v"};
    for (int t = 0; t < 4; t++)
        for (int i = 0; i < nd; i++)
            if (got[t]->shape[i] != want[t]->shape[i])
                return fw_fail(FW_ERR_SHAPE, "%s must have %s's shape; its dimension %d is %lld, "
                               "%s's is %lld", names[t], like[t], i, (long long)got[t]->shape[i],
                               like[t], (long long)want[t]->shape[i]);
    const fw_tensor *in[6] = {q, k, v, out, dout, lse};
    const char *in_names[6] = {"q", "k", "v", "out", "dout", "lse"};
    for (int t = 1; t < 4; t++) {
        if ((s = fw_check_no_alias(got[t], names[t])))
            return s;
        for (int u = t + 1; u < 4; u++)
            if (fw_overlap(got[t], got[u]))
                return fw_fail(FW_ERR_STRIDE, "%s and %s overlap in memory", names[t], names[u]);
        for (int u = 0; u < 6; u++)
            if (fw_overlap(got[t], in[u]))
                return fw_fail(FW_ERR_STRIDE, "%s overlaps the input %s", names[t], in_names[u]);
    }
    if ((s = setup_dsinks(b, params, in, got, ref)))
        return s;
    const fw_attn_params *pp = params;
    if (pp && (pp->flags & ~(uint32_t)FW_ATTN_PLAIN))
        return fw_fail(FW_ERR_ARG, "flags 0x%x: the backward takes FW_ATTN_PLAIN only",
                       (unsigned)pp->flags);
    if (pp && (pp->flags & FW_ATTN_PLAIN))
        b->f.bf16 = 0; /* the plain baseline runs f32 products */
    b->dout = dout; b->dq = dq; b->dk = dk; b->dv = dv;
    strides4(dout, varlen, b->dos);
    strides4(dq, varlen, b->dqs);
    strides4(dk, varlen, b->dks);
    strides4(dv, varlen, b->dvs);
    return FW_OK;
}

/* ---------------------------------------------------------------- tiling -- */

int fw_attn_bwd_splits(int64_t batch, int64_t hkv, int64_t sk_max)
{
    const int64_t units = fw_max64(1, batch * hkv);
    int64_t n = fw_min64(4, fw_ceil_div(16, units));
    n = fw_min64(n, fw_max64(1, fw_ceil_div(sk_max, FW_ATTN_BWD_KEYS)));
    return (int)n;
}

void fw_attn_bwd_tile(int64_t G, int *bq, int *gh)
{
    *gh = (int)fw_min64(G, FW_ATTN_BWD_ROWS);
    *bq = FW_ATTN_BWD_ROWS / *gh;
}

/* ------------------------------------------------------------- workspace -- */

static size_t up64(size_t x) { return (x + 63) & ~(size_t)63; }

/* One thread's part (byte offsets), for the tiled kernel or the plain one. */
typedef struct {
    size_t kr, kt, vt, dkt, dvt, qr, dor, s, dp, tmp, vec, zero, rng, row;
    size_t ktw, vtw, kw2, qw, dow, qp, dop, pw, dsp, dsw; /* bf16 products' panels */
    size_t total;
} bws;

static int pad_dim(int64_t d, int vl) { return (int)fw_ceil_div(d, vl) * vl; }

/* The key split of sequence length sk: keys per split, a multiple of FW_ATTN_BWD_KEYS. */
static int64_t split_len(int64_t sk, int nsplit)
{
    return fw_ceil_div(fw_ceil_div(fw_max64(sk, 1), nsplit), FW_ATTN_BWD_KEYS) * FW_ATTN_BWD_KEYS;
}

static bws ws_plan(const fw_kernels *kt, int64_t d, int64_t dv, int plain, int bf16,
                   int64_t split_max)
{
    bws w;
    const size_t f = sizeof(float), B = FW_ATTN_BWD_KEYS, R = FW_ATTN_BWD_ROWS, BK = FW_ATTN_BK;
    const size_t dp = (size_t)pad_dim(d, kt->vl);
    memset(&w, 0, sizeof w);
    if (plain) {
        /* dK, dV accumulators of a whole split; q, dO, k, v and dq rows */
        w.dkt = 0;
        w.row = up64((size_t)split_max * ((size_t)d + dv) * f);
        w.total = w.row + up64((3 * (size_t)d + 2 * (size_t)dv) * f);
        return w;
    }
    w.kr = 0;
    w.kt = w.kr + up64(B * dp * f);
    w.vt = w.kt + up64(B * (size_t)d * f);
    w.dkt = w.vt + up64(B * (size_t)dv * f);
    w.dvt = w.dkt + up64(B * (size_t)d * f);
    w.qr = w.dvt + up64(B * (size_t)dv * f);
    w.dor = w.qr + up64(R * (size_t)d * f);
    w.s = w.dor + up64(R * (size_t)dv * f);
    w.dp = w.s + up64(R * BK * f);
    w.tmp = w.dp + up64(R * BK * f);
    w.vec = w.tmp + up64(R * dp * f);        /* lse2, D, lo, hi */
    w.zero = w.vec + up64(4 * R * f);        /* zeros: the products' bias */
    w.rng = w.zero + up64((dp > BK ? dp : BK) * f);
    w.row = w.rng + up64(2 * R * sizeof(int64_t));
    w.ktw = w.row + up64(((size_t)d + dv) * f);
    /* bf16 products: per block K^T, V^T words and K key pairs; per q tile Q, dO words and row
     * pairs; per key tile P, dS row pairs and dS words (sized by the table) */
    const size_t b = bf16 ? 1 : 0, nt = B / BK;
    w.vtw = w.ktw + up64(b * nt * kt->mm.panel_bytes((int)d, (int)BK));
    w.kw2 = w.vtw + up64(b * nt * kt->mm.panel_bytes((int)dv, (int)BK));
    w.qw = w.kw2 + up64(b * nt * kt->mm.panel_bytes((int)BK, (int)dp));
    w.dow = w.qw + up64(b * R * kt->mm.panel_bytes((int)d, 1));
    w.qp = w.dow + up64(b * R * kt->mm.panel_bytes((int)dv, 1));
    w.dop = w.qp + up64(b * kt->mm.panel_bytes((int)R, (int)d));
    w.pw = w.dop + up64(b * kt->mm.panel_bytes((int)R, (int)dv));
    w.dsp = w.pw + up64(b * kt->mm.panel_bytes((int)R, (int)BK));
    w.dsw = w.dsp + up64(b * kt->mm.panel_bytes((int)R, (int)BK));
    w.total = w.dsw + up64(b * R * kt->mm.panel_bytes((int)BK, 1));
    return w;
}

/* The whole call's memory: per thread parts, D [rows][hq] and dq's partial sums
 * [nsplit][rows][hq][d]. */
typedef struct {
    bws w;
    int threads, nsplit, plain;
    int64_t rows;
    size_t d_off, acc_off, total;
} bplan;

static fw_status plan(const fw_kernels *kt, int64_t rows, int64_t hq, int64_t hkv, int64_t d,
                      int64_t dv, int64_t batch, int64_t sk_max, int bf16,
                      const fw_attn_params *params, bplan *pl)
{
    pl->plain = params && (params->flags & FW_ATTN_PLAIN);
    pl->threads = fw_threads(params ? params->threads : 0);
    pl->nsplit = fw_attn_bwd_splits(batch, hkv, sk_max);
    pl->rows = rows;
    pl->w = ws_plan(kt, d, dv, pl->plain, bf16 && !pl->plain, split_len(sk_max, pl->nsplit));
    const double total = (double)pl->threads * pl->w.total + 64.0 + 4.0 * rows * hq * (1.0 + pl->nsplit * d) + 128.0;
    if (total > (double)SIZE_MAX / 2)
        return fw_fail(FW_ERR_OVERFLOW, "the backward's workspace (%g bytes) does not fit in memory", total);
    /* offsets from the 64-byte aligned start; total has the slack to align it */
    pl->d_off = (size_t)pl->threads * pl->w.total;
    pl->acc_off = pl->d_off + up64((size_t)rows * hq * sizeof(float));
    pl->total = pl->acc_off + up64((size_t)pl->nsplit * rows * hq * d * sizeof(float)) + 64;
    return FW_OK;
}

fw_status fw_attn_bwd_workspace_size(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                     int64_t batch, const fw_attn_params *params, size_t *bytes)
{
    int64_t dims[4] = {0};
    const fw_kernels *kt = NULL;
    fw_status s = fw_attn_ws_query(q, k, v, bytes, params, dims, &kt);
    if (s)
        return s;
    const int o = q->ndim - 3;
    const int64_t hq = dims[0], hkv = dims[1], d = dims[2], dv = dims[3];
    for (int i = 0; i < q->ndim; i++)
        if (q->shape[i] < 0 || k->shape[i] < 0 || q->shape[i] > INT32_MAX || k->shape[i] > INT32_MAX)
            return fw_fail(FW_ERR_SHAPE, "q's or k's dimension %d is out of range", i);
    if (o == 0 && (batch < 0 || batch > INT32_MAX))
        return fw_fail(FW_ERR_ARG, "batch is %lld; it must be 0..2^31-1", (long long)batch);
    /* varlen: the longest sequence may hold every key */
    const int64_t rows = o ? q->shape[0] * q->shape[1] : q->shape[0];
    const int64_t nb = o ? q->shape[0] : batch, sk = o ? k->shape[1] : k->shape[0];
    bplan pl;
    const int bf16 = fw_kernels_bf16_products(kt, q->dtype, params ? params->precision : FW_PREC_AUTO);
    if ((s = plan(kt, rows, hq, hkv, d, dv, nb, sk, bf16, params, &pl)))
        return s;
    *bytes = pl.total;
    return FW_OK;
}

/* ------------------------------------------------------------- the driver -- */

typedef struct {
    int64_t seq, kvh, split, kb, ke, cost;
} bitem;

typedef struct {
    const fw_attn_bwd_prob *b;
    const fw_kernels *kt;
    bplan pl;
    int bq, gh, dp;
    float qs, cap2, scale; /* raw scores x qs: log2 units (or x / softcap); dq, dk x scale */
    float *D;              /* [rows][hq] */
    float *acc;            /* [nsplit][rows][hq][d] */
    const bitem *items;
    char *ws;
} bctx;

/* Row index of position pos of sequence seq in D and dq's partial sums. */
static int64_t grow(const fw_attn_prob *p, int64_t seq, int64_t pos)
{
    return (p->varlen ? (int64_t)p->cuq[seq] : seq * p->sq) + pos;
}

static float *acc_row(const bctx *c, int64_t split, int64_t row, int64_t h)
{
    const fw_attn_prob *p = &c->b->f;
    return c->acc + ((split * c->pl.rows + row) * p->hq + h) * p->d;
}

/* Zero the item's rows of its split's partial sums of dq (its G heads, every position). */
static void zero_acc(const bctx *c, const bitem *it, const fw_attn_seq *sq)
{
    const fw_attn_prob *p = &c->b->f;
    for (int64_t pos = 0; pos < sq->sq; pos++)
        memset(acc_row(c, it->split, grow(p, it->seq, pos), it->kvh * p->G), 0,
               (size_t)(p->G * p->d) * sizeof(float));
}

/* Store the gradients of keys [k0, k0 + n) of K/V head kvh, dK x scale: from the tiled
 * kernel's transposed tiles ([tile][dim][FW_ATTN_BK]) when tiled, else from rows [key][dim]. */
static void store_kv(const bctx *c, const bitem *it, int64_t k0, int n, const float *dK,
                     const float *dV, int tiled, float *row)
{
    const fw_attn_bwd_prob *b = c->b;
    const fw_attn_prob *p = &b->f;
    const int BK = FW_ATTN_BK;
    for (int j = 0; j < n; j++)
        for (int t = 0; t < 2; t++) {
            const int64_t dim = t ? p->dv : p->d;
            const float *src = t ? dV : dK;
            const float f = t ? 1.0f : c->scale;
            if (tiled)
                for (int64_t x = 0; x < dim; x++)
                    row[x] = f * src[(j / BK) * BK * dim + x * BK + j % BK];
            else
                for (int64_t x = 0; x < dim; x++)
                    row[x] = f * src[j * dim + x];
            const fw_tensor *g = t ? b->dv : b->dk;
            const int64_t *st = t ? b->dvs : b->dks;
            c->kt->cvt.from_f32(row, dim, (void *)fw_elem(g, fw_bwd_off(b, st, it->seq, 1, k0 + j, it->kvh)),
                            g->dtype, st[3]);
        }
}

/* The bf16 products' panels of one thread (pair layout, kern/mm_kern.h). Per block: K^T and
 * V^T as words of two channels per key ([tile][d/2][64], [tile][dv/2][64]), K as two keys
 * interleaved ([tile][32][dp]). Per q tile: Q and dO rows as words ([R][d/2], [R][dv/2]) and
 * as row pairs ([R/2][d], [R/2][dv]). Per key tile: P and dS as row pairs ([R/2][64]), dS rows
 * as words ([R][32]). */
typedef struct {
    uint32_t *ktw, *vtw, *kw2, *qw, *dow, *qp, *dop, *pw, *dsp, *dsw;
    int dw, dvw;
} bpanels;

/* dst[w] = (rows 2w and 2w + 1 of x, rows n apart) for w < ceil(R / 2), n columns. */
static void pack_row_pairs_of(const fw_kernels *kt, const float *x, int R, int n, uint32_t *dst)
{
    for (int w = 0; 2 * w < R; w++)
        kt->mm.pack_pairs(x + (size_t)2 * w * n, 2 * w + 1 < R ? x + (size_t)(2 * w + 1) * n : NULL, n,
                       dst + (size_t)w * n);
}

/* The five products of a q tile of R rows against key tile t: S and dP, the elementwise step,
 * dV^T and dK^T, and dQ's contribution into tmp. */
static void tile_products(const bctx *c, const bpanels *bp, int t, int R, const float *Qr,
                          const float *dOr, const float *Kr, const float *KT, const float *VT,
                          float *dKT, float *dVT, float *S, float *dP, float *tmp,
                          const float *zero, const float *lse2, const float *Dm, const float *lo,
                          const float *hi)
{
    const fw_kernels *kt = c->kt;
    const int d = (int)c->b->f.d, dv = (int)c->b->f.dv, dp = c->dp, BK = FW_ATTN_BK;
    const float *kT = KT + (size_t)t * BK * d, *vT = VT + (size_t)t * BK * dv;
    float *dkT = dKT + (size_t)t * BK * d, *dvT = dVT + (size_t)t * BK * dv;
    if (!c->b->f.bf16) {
        kt->mm.qk(R, d, BK, Qr, d, kT, zero, S);
        kt->mm.qk(R, dv, BK, dOr, dv, vT, zero, dP);
        kt->bwd.ds(R, S, dP, lse2, Dm, lo, hi, c->qs, c->cap2);
        kt->mm.pv(R, dv, BK, dOr, dv, S, dvT);
        kt->mm.pv(R, d, BK, Qr, d, dP, dkT);
        kt->mm.qk(R, BK, dp, dP, BK, Kr + (size_t)t * BK * dp, zero, tmp);
        return;
    }
    const int dw = bp->dw, dvw = bp->dvw, rw = (R + 1) / 2;
    kt->mm.qk_bf16(R, dw, BK, bp->qw, dw, bp->ktw + (size_t)t * dw * BK, 1.0f, zero, S);
    kt->mm.qk_bf16(R, dvw, BK, bp->dow, dvw, bp->vtw + (size_t)t * dvw * BK, 1.0f, zero, dP);
    kt->bwd.ds(R, S, dP, lse2, Dm, lo, hi, c->qs, c->cap2);
    pack_row_pairs_of(kt, S, R, BK, bp->pw);
    kt->mm.pv_bf16(rw, dv, BK, bp->dop, bp->pw, dvT);
    pack_row_pairs_of(kt, dP, R, BK, bp->dsp);
    kt->mm.pv_bf16(rw, d, BK, bp->qp, bp->dsp, dkT);
    for (int m = 0; m < R; m++)
        kt->mm.pack_row_pairs(dP + (size_t)m * BK, BK, bp->dsw + (size_t)m * (BK / 2));
    kt->mm.qk_bf16(R, BK / 2, dp, bp->dsw, BK / 2, bp->kw2 + (size_t)t * (BK / 2) * dp, 1.0f, zero, tmp);
}

/* The tiled item: keys [it->kb, it->ke) of K/V head it->kvh, blocks of FW_ATTN_BWD_KEYS. */
static void tile_item(const bctx *c, const bitem *it, const fw_attn_seq *sq, int tid)
{
    const fw_attn_bwd_prob *b = c->b;
    const fw_attn_prob *p = &b->f;
    const fw_kernels *kt = c->kt;
    const int d = (int)p->d, dv = (int)p->dv, dp = c->dp, BK = FW_ATTN_BK;
    const int64_t G = p->G, kvh = it->kvh;
    char *w = c->ws + (size_t)tid * c->pl.w.total;
    const bws *L = &c->pl.w;
    float *Kr = (float *)(w + L->kr), *KT = (float *)(w + L->kt), *VT = (float *)(w + L->vt);
    float *dKT = (float *)(w + L->dkt), *dVT = (float *)(w + L->dvt);
    float *Qr = (float *)(w + L->qr), *dOr = (float *)(w + L->dor), *S = (float *)(w + L->s);
    float *dP = (float *)(w + L->dp), *tmp = (float *)(w + L->tmp), *zero = (float *)(w + L->zero);
    float *lse2 = (float *)(w + L->vec), *Dm = lse2 + FW_ATTN_BWD_ROWS, *lo = Dm + FW_ATTN_BWD_ROWS,
          *hi = lo + FW_ATTN_BWD_ROWS, *row = (float *)(w + L->row);
    int64_t *rlo = (int64_t *)(w + L->rng), *rhi = rlo + FW_ATTN_BWD_ROWS;
    const float *lse = p->lse->data;
    const int bf16 = p->bf16;
    const bpanels bp = {(uint32_t *)(w + L->ktw), (uint32_t *)(w + L->vtw), (uint32_t *)(w + L->kw2),
                        (uint32_t *)(w + L->qw), (uint32_t *)(w + L->dow), (uint32_t *)(w + L->qp),
                        (uint32_t *)(w + L->dop), (uint32_t *)(w + L->pw), (uint32_t *)(w + L->dsp),
                        (uint32_t *)(w + L->dsw), (d + 1) / 2, (dv + 1) / 2};
    memset(zero, 0, (size_t)(dp > BK ? dp : BK) * sizeof(float));
    zero_acc(c, it, sq);

    for (int64_t b0 = it->kb; b0 < it->ke; b0 += FW_ATTN_BWD_KEYS) {
        const int64_t b1 = fw_min64(it->ke, b0 + FW_ATTN_BWD_KEYS);
        const int nb = (int)(b1 - b0), ntile = (int)fw_ceil_div(nb, BK);
        /* K rows (padded to dp), K and V transposed per 64-key tile; padding keys are zero */
        memset(Kr, 0, (size_t)ntile * BK * dp * sizeof(float));
        memset(KT, 0, (size_t)ntile * BK * d * sizeof(float));
        memset(VT, 0, (size_t)ntile * BK * dv * sizeof(float));
        memset(dKT, 0, (size_t)ntile * BK * d * sizeof(float));
        memset(dVT, 0, (size_t)ntile * BK * dv * sizeof(float));
        for (int j = 0; j < nb; j++) {
            float *kr = Kr + (size_t)j * dp;
            kt->cvt.to_f32(fw_elem(p->k, fw_attn_key(p, sq, b0 + j, 0) + kvh * p->ks[1]), p->k->dtype,
                       p->ks[2], d, 1.0f, kr);
            kt->cvt.to_f32(fw_elem(p->v, fw_attn_key(p, sq, b0 + j, 1) + kvh * p->vs[1]), p->v->dtype,
                       p->vs[2], dv, 1.0f, row);
            float *kt_ = KT + (size_t)(j / BK) * BK * d + j % BK, *vt = VT + (size_t)(j / BK) * BK * dv + j % BK;
            for (int x = 0; x < d; x++)
                kt_[(size_t)x * BK] = kr[x];
            for (int x = 0; x < dv; x++)
                vt[(size_t)x * BK] = row[x];
        }
        for (int t = 0; t < ntile && bf16; t++) {
            pack_row_pairs_of(kt, KT + (size_t)t * BK * d, d, BK, bp.ktw + (size_t)t * bp.dw * BK);
            pack_row_pairs_of(kt, VT + (size_t)t * BK * dv, dv, BK, bp.vtw + (size_t)t * bp.dvw * BK);
            pack_row_pairs_of(kt, Kr + (size_t)t * BK * dp, BK, dp, bp.kw2 + (size_t)t * (BK / 2) * dp);
        }
        for (int64_t pos0 = 0; pos0 < sq->sq; pos0 += c->bq) {
            const int bq = (int)fw_min64(c->bq, sq->sq - pos0);
            /* the keys the tile's positions see (the same for every head) */
            int64_t ulo = INT64_MAX, uhi = INT64_MIN;
            for (int i = 0; i < bq; i++) {
                fw_attn_visible(p, sq->sq, sq->sk, pos0 + i, &rlo[i], &rhi[i]);
                if (rhi[i] > rlo[i]) {
                    ulo = fw_min64(ulo, rlo[i]);
                    uhi = fw_max64(uhi, rhi[i]);
                } else {
                    rlo[i] = rhi[i] = 0;
                }
            }
            if (uhi <= b0 || ulo >= b1)
                continue;
            for (int64_t g0 = 0; g0 < G; g0 += c->gh) {
                const int gh = (int)fw_min64(c->gh, G - g0), R = gh * bq;
                for (int gi = 0; gi < gh; gi++)
                    for (int i = 0; i < bq; i++) {
                        const int m = gi * bq + i;
                        const int64_t h = kvh * G + g0 + gi, pos = pos0 + i;
                        kt->cvt.to_f32(fw_elem(p->q, sq->q0 + pos * p->qs[0] + h * p->qs[1]), p->q->dtype,
                                   p->qs[2], d, 1.0f, Qr + (size_t)m * d);
                        kt->cvt.to_f32(fw_elem(b->dout, fw_bwd_off(b, b->dos, it->seq, 0, pos, h)),
                                   b->dout->dtype, b->dos[3], dv, 1.0f, dOr + (size_t)m * dv);
                        lse2[m] = (float)(lse[sq->lse0 + h * p->lse_h + pos * p->lse_r] * FW_LOG2E);
                        Dm[m] = c->D[grow(p, it->seq, pos) * p->hq + h];
                        if (bf16) {
                            kt->mm.pack_row_pairs(Qr + (size_t)m * d, d, bp.qw + (size_t)m * bp.dw);
                            kt->mm.pack_row_pairs(dOr + (size_t)m * dv, dv, bp.dow + (size_t)m * bp.dvw);
                        }
                    }
                if (bf16) {
                    kt->mm.pack_vw(Qr, FW_F32, R, d, bp.qp);
                    kt->mm.pack_vw(dOr, FW_F32, R, dv, bp.dop);
                }
                for (int t = 0; t < ntile; t++) {
                    const int64_t t0 = b0 + (int64_t)t * BK, t1 = fw_min64(b1, t0 + BK);
                    if (uhi <= t0 || ulo >= t1)
                        continue;
                    for (int gi = 0; gi < gh; gi++)
                        for (int i = 0; i < bq; i++) {
                            lo[gi * bq + i] = (float)fw_max64(0, fw_min64(t1 - t0, rlo[i] - t0));
                            hi[gi * bq + i] = (float)fw_max64(0, fw_min64(t1 - t0, rhi[i] - t0));
                        }
                    tile_products(c, &bp, t, R, Qr, dOr, Kr, KT, VT, dKT, dVT, S, dP, tmp, zero,
                                  lse2, Dm, lo, hi);
                    for (int gi = 0; gi < gh; gi++)
                        for (int i = 0; i < bq; i++) {
                            float *a = acc_row(c, it->split, grow(p, it->seq, pos0 + i), kvh * G + g0 + gi);
                            const float *src = tmp + (size_t)(gi * bq + i) * dp;
                            for (int x = 0; x < d; x++)
                                a[x] += src[x];
                        }
                }
            }
        }
        store_kv(c, it, b0, nb, dKT, dVT, 1, row);
    }
}

/* The plain item (FW_ATTN_PLAIN): one query row at a time (head by head, positions in
 * order), one visible key at a time, scalar f32 products; dK and dV of the split accumulate
 * in rows. The baseline the tiled kernel is measured and checked against. */
static void plain_item(const bctx *c, const bitem *it, const fw_attn_seq *sq, int tid)
{
    const fw_attn_bwd_prob *b = c->b;
    const fw_attn_prob *p = &b->f;
    const fw_kernels *kt = c->kt;
    const int64_t d = p->d, dv = p->dv, nk = it->ke - it->kb;
    char *w = c->ws + (size_t)tid * c->pl.w.total;
    float *dK = (float *)(w + c->pl.w.dkt), *dV = dK + nk * d;
    float *q = (float *)(w + c->pl.w.row), *o = q + d, *kr = o + dv, *vr = kr + d, *dq = vr + dv;
    const float *lse = p->lse->data;
    memset(dK, 0, (size_t)(nk * (d + dv)) * sizeof(float));
    zero_acc(c, it, sq);
    for (int64_t g = 0; g < p->G; g++) {
        const int64_t h = it->kvh * p->G + g;
        for (int64_t pos = 0; pos < sq->sq; pos++) {
            int64_t lo, hi;
            fw_attn_visible(p, sq->sq, sq->sk, pos, &lo, &hi);
            lo = fw_max64(lo, it->kb);
            hi = fw_min64(hi, it->ke);
            if (hi <= lo)
                continue;
            kt->cvt.to_f32(fw_elem(p->q, sq->q0 + pos * p->qs[0] + h * p->qs[1]), p->q->dtype, p->qs[2], d,
                       1.0f, q);
            kt->cvt.to_f32(fw_elem(b->dout, fw_bwd_off(b, b->dos, it->seq, 0, pos, h)), b->dout->dtype,
                       b->dos[3], dv, 1.0f, o);
            const float l2 = (float)(lse[sq->lse0 + h * p->lse_h + pos * p->lse_r] * FW_LOG2E);
            const float D = c->D[grow(p, it->seq, pos) * p->hq + h];
            memset(dq, 0, (size_t)d * sizeof(float));
            for (int64_t j = lo; j < hi; j++) {
                kt->cvt.to_f32(fw_elem(p->k, fw_attn_key(p, sq, j, 0) + it->kvh * p->ks[1]), p->k->dtype,
                           p->ks[2], d, 1.0f, kr);
                kt->cvt.to_f32(fw_elem(p->v, fw_attn_key(p, sq, j, 1) + it->kvh * p->vs[1]), p->v->dtype,
                           p->vs[2], dv, 1.0f, vr);
                float s = 0.0f, dp = 0.0f, t = 1.0f;
                for (int64_t x = 0; x < d; x++)
                    s += q[x] * kr[x];
                for (int64_t x = 0; x < dv; x++)
                    dp += o[x] * vr[x];
                s *= c->qs;
                if (c->cap2 > 0.0f) {
                    t = tanhf(s);
                    s = c->cap2 * t;
                }
                const float pr = exp2f(s - l2);
                const float ds = pr * (dp - D) * (c->cap2 > 0.0f ? 1.0f - t * t : 1.0f);
                float *dk = dK + (j - it->kb) * d, *dvr = dV + (j - it->kb) * dv;
                for (int64_t x = 0; x < d; x++) {
                    dq[x] += ds * kr[x];
                    dk[x] += ds * q[x];
                }
                for (int64_t x = 0; x < dv; x++)
                    dvr[x] += pr * o[x];
            }
            float *a = acc_row(c, it->split, grow(p, it->seq, pos), h);
            for (int64_t x = 0; x < d; x++)
                a[x] += dq[x];
        }
    }
    store_kv(c, it, it->kb, (int)nk, dK, dV, 0, q);
}

static void run_item(void *vctx, int64_t idx, int tid)
{
    const bctx *c = vctx;
    const bitem *it = &c->items[idx];
    const fw_attn_seq sq = fw_attn_seq_get(&c->b->f, it->seq);
    if (c->pl.plain)
        plain_item(c, it, &sq, tid);
    else
        tile_item(c, it, &sq, tid);
}

/* Rows per item of the two row passes (D before the items, dq after). */
#define ROW_BLOCK 64

/* Item idx of a row pass: sequence idx / nb, its positions [*r0, *r1) of block idx % nb, nb
 * blocks of the longest sequence. Returns the sequence. */
static fw_attn_seq row_block(const fw_attn_prob *p, int64_t idx, int64_t *r0, int64_t *r1)
{
    const int64_t nb = fw_ceil_div(fw_max64(p->sq, 1), ROW_BLOCK);
    const fw_attn_seq sq = fw_attn_seq_get(p, idx / nb);
    *r0 = (idx % nb) * ROW_BLOCK;
    *r1 = fw_min64(sq.sq, *r0 + ROW_BLOCK);
    return sq;
}

/* D[row][h] = sum dout o out over dv, in double, for a block of rows (row_block). */
static void d_pass(void *vctx, int64_t idx, int tid)
{
    (void)tid;
    const bctx *c = vctx;
    const fw_attn_bwd_prob *b = c->b;
    const fw_attn_prob *p = &b->f;
    int64_t r0, r1;
    const fw_attn_seq sq = row_block(p, idx, &r0, &r1);
    const int64_t seq = sq.index;
    for (int64_t pos = r0; pos < r1; pos++)
        for (int64_t h = 0; h < p->hq; h++) {
            double s = 0.0;
            const int64_t oo = sq.o0 + pos * p->os[0] + h * p->os[1];
            const int64_t go = fw_bwd_off(b, b->dos, seq, 0, pos, h);
            for (int64_t x = 0; x < p->dv; x++)
                s += fw_load_f64(p->out, oo + x * p->os[2]) * fw_load_f64(b->dout, go + x * b->dos[3]);
            c->D[grow(p, seq, pos) * p->hq + h] = (float)s;
        }
}

/* dsinks[h] = -sum over the sequences and rows, in order, of exp(sinks[h] - lse) x D: the
 * sink's probability times D, the derivative of the loss along the row's own softmax
 * (d out / d sink = -p_sink out). One head per call, in double. */
static void dsink_pass(void *vctx, int64_t h, int tid)
{
    (void)tid;
    const bctx *c = vctx;
    const fw_attn_prob *p = &c->b->f;
    const double t = fw_attn_sink(p, h);
    double sum = 0.0;
    for (int64_t i = 0; i < p->batch; i++) {
        const fw_attn_seq sq = fw_attn_seq_get(p, i);
        for (int64_t pos = 0; pos < sq.sq; pos++) {
            const double lse = ((const float *)p->lse->data)[sq.lse0 + h * p->lse_h + pos * p->lse_r];
            sum += exp(t - lse) * c->D[grow(p, i, pos) * p->hq + h];
        }
    }
    ((float *)c->b->dsinks->data)[h * c->b->dsinks->stride[0]] = (float)-sum;
}

/* dq = scale x the sum of the sequence's non-empty splits' partial sums, in split order. */
static void dq_pass(void *vctx, int64_t idx, int tid)
{
    const bctx *c = vctx;
    const fw_attn_bwd_prob *b = c->b;
    const fw_attn_prob *p = &b->f;
    int64_t r0, r1;
    const fw_attn_seq sq = row_block(p, idx, &r0, &r1);
    const int64_t seq = sq.index, len = split_len(sq.sk, c->pl.nsplit);
    float *row = (float *)(c->ws + (size_t)tid * c->pl.w.total + c->pl.w.row);
    for (int64_t pos = r0; pos < r1; pos++)
        for (int64_t h = 0; h < p->hq; h++) {
            memset(row, 0, (size_t)p->d * sizeof(float));
            for (int64_t s = 0; s < c->pl.nsplit && s * len < sq.sk; s++) {
                const float *a = acc_row(c, s, grow(p, seq, pos), h);
                for (int64_t x = 0; x < p->d; x++)
                    row[x] += a[x];
            }
            for (int64_t x = 0; x < p->d; x++)
                row[x] *= c->scale;
            c->kt->cvt.from_f32(row, p->d, (void *)fw_elem(b->dq, fw_bwd_off(b, b->dqs, seq, 0, pos, h)),
                            b->dq->dtype, b->dqs[3]);
        }
}

static int cmp_item(const void *x, const void *y)
{
    const bitem *a = x, *b = y;
    if (a->cost != b->cost)
        return a->cost > b->cost ? -1 : 1;
    if (a->seq != b->seq)
        return a->seq < b->seq ? -1 : 1;
    if (a->kvh != b->kvh)
        return a->kvh < b->kvh ? -1 : 1;
    return a->split < b->split ? -1 : (a->split > b->split);
}

static fw_status run(const fw_attn_bwd_prob *b, const fw_attn_params *params)
{
    const fw_attn_prob *p = &b->f;
    const fw_kernels *kt = p->kt; /* looked up once, by the setup */
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    bctx c;
    memset(&c, 0, sizeof c);
    c.b = b;
    c.kt = kt;
    const int64_t rows = p->varlen ? p->q->shape[0] : p->batch * p->sq;
    fw_status s = plan(kt, rows, p->hq, p->hkv, p->d, p->dv, p->batch, p->sk, p->bf16, params,
                       &c.pl);
    if (s)
        return s;
    fw_attn_bwd_tile(p->G, &c.bq, &c.gh);
    c.dp = pad_dim(p->d, kt->vl);
    c.scale = (float)p->scale;
    c.qs = (float)(p->softcap > 0 ? p->scale / p->softcap : p->scale * FW_LOG2E);
    c.cap2 = (float)(p->softcap * FW_LOG2E);
    char *own = NULL, *base = params ? params->workspace : NULL;
    if (base && params->workspace_bytes < c.pl.total)
        return fw_fail(FW_ERR_WORKSPACE, "workspace is %zu bytes; this backward needs %zu "
                       "(fw_attn_bwd_workspace_size)", params->workspace_bytes, c.pl.total);
    const int64_t nitems = p->batch * p->hkv * c.pl.nsplit;
    bitem *items = malloc((size_t)fw_max64(1, nitems) * sizeof(bitem));
    if (!base)
        base = own = malloc(c.pl.total);
    if (!base || !items) {
        free(own);
        free(items);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the backward's %zu bytes of workspace",
                       c.pl.total);
    }
    c.ws = (char *)(((uintptr_t)base + 63) & ~(uintptr_t)63);
    c.D = (float *)(c.ws + c.pl.d_off);
    c.acc = (float *)(c.ws + c.pl.acc_off);
    int64_t n = 0;
    for (int64_t i = 0; i < p->batch; i++) {
        const fw_attn_seq sq = fw_attn_seq_get(p, i);
        const int64_t len = split_len(sq.sk, c.pl.nsplit);
        for (int64_t sp = 0; sp < c.pl.nsplit && sp * len < sq.sk; sp++) {
            const int64_t kb = sp * len, ke = fw_min64(sq.sk, kb + len);
            /* cost: the (row, key) pairs it visits, plus its keys */
            int64_t cost = ke - kb;
            for (int64_t r = 0; r < sq.sq; r++) {
                int64_t lo, hi;
                fw_attn_visible(p, sq.sq, sq.sk, r, &lo, &hi);
                cost += p->G * fw_max64(0, fw_min64(hi, ke) - fw_max64(lo, kb));
            }
            for (int64_t h = 0; h < p->hkv; h++) {
                bitem e = {i, h, sp, kb, ke, cost};
                items[n++] = e;
            }
        }
    }
    qsort(items, (size_t)n, sizeof(bitem), cmp_item);
    c.items = items;
    const int64_t nrow = p->batch * fw_ceil_div(fw_max64(p->sq, 1), ROW_BLOCK);
    fw_parallel(c.pl.threads, nrow, d_pass, &c);
    if (b->dsinks)
        fw_parallel(c.pl.threads, p->hq, dsink_pass, &c);
    fw_parallel(c.pl.threads, n, run_item, &c);
    fw_parallel(c.pl.threads, nrow, dq_pass, &c);
    free(items);
    free(own);
    return FW_OK;
}

fw_status fw_attn_bwd(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                      const fw_tensor *out, const fw_tensor *dout, const fw_tensor *lse,
                      const fw_tensor *dq, const fw_tensor *dk, const fw_tensor *dv,
                      const fw_attn_params *params)
{
    fw_clear_error();
    fw_attn_bwd_prob b;
    fw_status s = fw_attn_setup_bwd(&b, q, k, v, out, dout, lse, NULL, NULL, 0, 0, dq, dk, dv,
                                    params, 0);
    return s ? s : run(&b, params);
}

fw_status fw_attn_varlen_bwd(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                             const fw_tensor *out, const fw_tensor *dout, const fw_tensor *lse,
                             const int32_t *cu_seqlens_q, const int32_t *cu_seqlens_k, int64_t batch,
                             const fw_tensor *dq, const fw_tensor *dk, const fw_tensor *dv,
                             const fw_attn_params *params)
{
    fw_clear_error();
    fw_attn_bwd_prob b;
    fw_status s = fw_attn_setup_bwd(&b, q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, batch,
                                    1, dq, dk, dv, params, 0);
    return s ? s : run(&b, params);
}
