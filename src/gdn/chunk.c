/*
 * gdn/chunk.c: the Gated DeltaNet chunked (WY/UT) pass and
 * its entry points: prefill (and its recurrent baselines), speculative verify and commit.
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
#include "gdn.h"

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
    size_t kw, qw, ktw, gw, tw, rhsw, ww, hw, dw, kpw, xo;
    /* KDA only: cumulative log2 decays G per channel (doubles) and step decays E, the
     * block-relative Q^ and K^, 2^G K^, decayed key rows of one block product, its two
     * results, 2^G_last, one row of exponents */
    size_t gcs, gst, qb, kb, k2, kr, sq, sk, dl, total;
} gdn_ws;

/* The per-thread layout in floats; the bf16 panels sized by the table (panel_bytes). */
static gdn_ws gdn_plan(const gdn_prob *p, const fw_kernels *kt, int64_t hg)
{
    gdn_ws w;
    const size_t C = GDN_C, dk = (size_t)p->dk, P = GDN_P;
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
    TAKE(hd, (size_t)(hg * p->r * w.pv) * (dk + C) * P); /* per value head of the item and dv panel: h rows, Delta rows */
#define PANEL(red, cols) (b * kt->mm.panel_bytes((int)(red), (int)(cols)) / sizeof(float))
    TAKE(kw, PANEL(dk, C));
    TAKE(qw, PANEL(dk, C));
    TAKE(ktw, PANEL(dk, C));
    TAKE(gw, PANEL(C, C));
    TAKE(tw, PANEL(C, C));
    TAKE(rhsw, np * PANEL(C, P));
    TAKE(ww, PANEL(dk, C));
    TAKE(hw, PANEL(dk, P));
    TAKE(dw, PANEL(C, P));
    TAKE(kpw, PANEL(C, dk));
    TAKE(xo, b * C * P);
    const size_t kda = p->kda ? 1 : 0;
    TAKE(gcs, kda * 2 * C * dk);
    TAKE(gst, kda * C * dk);
    TAKE(qb, kda * C * dk);
    TAKE(kb, kda * C * dk);
    TAKE(k2, kda * C * dk);
    TAKE(kr, kda * C * dk);
    TAKE(sq, kda * FW_KDA_BLOCK * C);
    TAKE(sk, kda * FW_KDA_BLOCK * C);
    TAKE(dl, kda * dk);
#undef PANEL
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
    /* states: sequence i's at init + slot * init_stride (slot = init_idx[i], or i without
     * indices; negative: zeros), its final one at final + final_idx[i] * final_stride
     * (negative: not written); init or final NULL: none; idt / fdt their dtypes, f32 or bf16
     * (read into f32, rounded once when stored) */
    const void *init;
    void *final;
    fw_dtype idt, fdt;
    const int32_t *init_idx, *final_idx;
    int64_t init_stride, final_stride;
    int verify;
    int64_t hg;         /* chunked items: q/k heads per item (fw_gdn_head_group) */
    float *replay;      /* verify: the replay buffer (gdn.h: replay_at), or NULL */
    replay_parts rp;
} gdn_ctx;

/* Sequence seq's value head vh in the initial state (NULL: zeros), or in the final one
 * (NULL: not written). */
static const void *init_of(const gdn_ctx *c, int64_t seq, int64_t vh)
{
    const int64_t s = c->init_idx ? c->init_idx[seq] : seq;
    return c->init && s >= 0 ? (const char *)c->init + (size_t)(s * c->init_stride + vh * c->p->dk * c->p->dv) *
                                                         fw_dtype_size(c->idt)
                             : NULL;
}

static void *final_of(const gdn_ctx *c, int64_t seq, int64_t vh)
{
    const int64_t s = c->final_idx ? c->final_idx[seq] : seq;
    return c->final && s >= 0 ? (char *)c->final + (size_t)(s * c->final_stride + vh * c->p->dk * c->p->dv) *
                                                       fw_dtype_size(c->fdt)
                              : NULL;
}

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

/* The chunk an item works on after the current one: q/k head h, tokens [t, t + n) (n = 0:
 * none). */
typedef struct {
    int64_t h, t;
    int n;
} chunk_next;

/* Part `part` of `parts` of the next chunk's rows: q and k of its head, v and out (and KDA's
 * g) of its value heads, a part before each panel's products. */
static void prefetch_next(const gdn_ctx *c, chunk_next nx, int part, int parts)
{
    const gdn_prob *p = c->p;
    const int64_t h = nx.h;
    for (int i = nx.n * part / parts; i < nx.n * (part + 1) / parts; i++) {
        const int64_t t = nx.t + i;
        prefetch_row(p->q, t, h, p->dk, 0);
        prefetch_row(p->k, t, h, p->dk, 0);
        for (int64_t e = 0; e < p->r; e++) {
            prefetch_row(p->v, t, h * p->r + e, p->dv, 0);
            prefetch_row(p->out, t, h * p->r + e, p->dv, 1);
            if (p->kda) /* KDA's decay rows, as far apart as v's */
                prefetch_row(p->g, t, h * p->r + e, p->dk, 0);
        }
    }
}

/* Row r of out, value head vh, columns [q*64, q*64 + n), from f32. */
static void store_out(const gdn_ctx *c, const float *src, int64_t t, int64_t vh, int q, int n)
{
    const fw_tensor *o = c->p->out;
    c->kt->cvt.from_f32(src, n, (char *)at(o, t, vh) + (size_t)(q * GDN_P * o->stride[2]) * fw_dtype_size(o->dtype),
                    o->dtype, o->stride[2]);
}

/* The chunk's K^ and Q^ rows in f32 (Q^ times qscale), kept for commit when verifying. */
static void chunk_rows(const gdn_ctx *c, float *K, float *Q, int64_t h, int64_t t0, int L, float qscale)
{
    const gdn_prob *p = c->p;
    const int dk = (int)p->dk;
    for (int i = 0; i < L; i++) {
        c->kt->cvt.to_f32(at(p->k, t0 + i, h), p->k->dtype, p->k->stride[2], dk, 1.0f, K + (size_t)i * dk);
        c->kt->cvt.to_f32(at(p->q, t0 + i, h), p->q->dtype, p->q->stride[2], dk, 1.0f, Q + (size_t)i * dk);
    }
    c->kt->gdn.rows_l2scale(K, L, dk, 1.0f, p->l2, (float)p->eps);
    c->kt->gdn.rows_l2scale(Q, L, dk, qscale, p->l2, (float)p->eps);
    if (c->replay)
        for (int i = 0; i < L; i++)
            memcpy(c->rp.key + ((size_t)(t0 + i) * p->H + h) * dk, K + (size_t)i * dk, (size_t)dk * sizeof(float));
}

/* Value head vh's gates over the chunk, into gam (4 x 64 floats): gamma (log2 units, zero past
 * L), 2^gamma, 2^(gamma_last - gamma), beta. Kept for commit when verifying. */
static void chunk_gates(const gdn_ctx *c, float *gam, int64_t vh, int64_t t0, int L)
{
    const gdn_prob *p = c->p;
    float *ex = gam + GDN_C, *exl = ex + GDN_C, *bet = exl + GDN_C;
    double acc = 0;
    for (int i = 0; i < L; i++) {
        acc += gate_g(p, t0 + i, vh);
        gam[i] = (float)(acc * FW_LOG2E);
        bet[i] = gate_beta(p, t0 + i, vh);
    }
    for (int i = 0; i < L; i++) {
        ex[i] = gam[i];
        exl[i] = gam[L - 1] - gam[i];
    }
    c->kt->gdn.exp2_inplace(ex, L);
    c->kt->gdn.exp2_inplace(exl, L);
    for (int i = L; i < GDN_C; i++)
        gam[i] = 0.0f;
    if (c->replay)
        for (int i = 0; i < L; i++)
            c->rp.gam[(size_t)(t0 + i) * p->HV + vh] = gam[i];
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
                c->kt->gdn.rows_l2scale(rh, 1, n, bet[i] * ex[i], 0, 0.0f);
            } else {
                const int v0 = (q - (int)c->w.pk) * P;
                n = panel_cols(p->dv, q - (int)c->w.pk);
                c->kt->cvt.to_f32(at(p->v, t0 + i, vh) + (size_t)(v0 * p->v->stride[2]) * fw_dtype_size(p->v->dtype),
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
            memcpy(c->rp.delta + ((size_t)(t0 + i) * c->p->HV + vh) * dv + q * P, D + (size_t)i * P,
                   (size_t)panel_cols(dv, q) * sizeof(float));
    }
}

/* KDA's per-channel gates of value head vh over the chunk (f32 products), with G the
 * cumulative log2 decays per channel and E = 2^g the step decays. Fills what gdn_chunk reads
 * in GDN's gates' place: gam with beta and unit decays (the decays are in the operands
 * instead); K2 = 2^G o K^ (the keys of the RHS); Ao's first dk columns 2^G o Q^; Kpp =
 * 2^(G_last - G) o K^; dl = 2^G_last (the state rows' decays); A (strictly lower, beta_i
 * applied) and Ao's gated QK (lower with the diagonal):
 *   A_ij = beta_i sum_x K^_ix K^_jx 2^(G_ix - G_jx),   QK_ij = sum_x Q^_ix K^_jx 2^(G_ix - G_jx).
 * Pairs across blocks of 16 rows are products of 2^(G_i - G_b) o Q^_i (b the first row of
 * i's block) with 2^(G_b - G_j) o K^_j: both exponents <= 0 (G does not increase), so nothing
 * overflows, and a factor that underflows stands for a product below it. Pairs inside a
 * block come from kda_diag. G is summed in double and each exponent is a difference taken
 * in double, then rounded (exp2d_scale2, which decays Q^ and K^ by one exponential where
 * they share it): with strong decays |G| reaches thousands within a chunk, where a float's
 * ulp (5e-4 at 4096) would be the error of every small difference, 3e-4 relative in its
 * exponential. kda_exponent: the same rounded exponents, for the verify replay. */
static void kda_exponent(int dk, const double *g1, const double *g0, float *dst)
{
    for (int x = 0; x < dk; x++)
        dst[x] = (float)(g1[x] - (g0 ? g0[x] : 0.0));
}

static void kda_chunk_gates(const gdn_ctx *c, float *W, int64_t vh, int64_t t0, int L, float *Am, float *Ao)
{
    const gdn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    const gdn_ws *w = &c->w;
    const int dk = (int)p->dk, lda = dk + GDN_C;
    const float *K = W + w->kc, *Q = W + w->qc;
    double *G = (double *)(W + w->gcs);
    float *E = W + w->gst, *Qb = W + w->qb, *Kb = W + w->kb, *K2 = W + w->k2;
    float *Kr = W + w->kr, *Sq = W + w->sq, *Sk = W + w->sk, *Kpp = W + w->kpp, *gam = W + w->gam;
    float *ex = gam + GDN_C, *exl = ex + GDN_C, *bet = exl + GDN_C;
    for (int i = 0; i < L; i++) {
        float *e = E + (size_t)i * dk;
        double *gi = G + (size_t)i * dk;
        kda_log2_decays(kt, p, t0 + i, vh, e, Sq);
        for (int x = 0; x < dk; x++)
            gi[x] = (i ? gi[x - dk] : 0.0) + e[x];
        bet[i] = gate_beta(p, t0 + i, vh);
        ex[i] = exl[i] = 1.0f;
        if (c->replay)
            kda_exponent(dk, gi, NULL, c->rp.gam + ((size_t)(t0 + i) * p->HV + vh) * dk);
    }
    for (int i = 0; i < GDN_C; i++)
        gam[i] = 0.0f;
    kt->gdn.exp2_inplace(E, (int64_t)L * dk);
    const double *Gl = G + (size_t)(L - 1) * dk;
    for (int i = 0; i < L; i++) { /* Q and K share each exponential */
        const size_t r = (size_t)i * dk;
        kt->gdn.exp2d_scale2(dk, G + r, G + (size_t)(i / FW_KDA_BLOCK * FW_KDA_BLOCK) * dk, Q + r, Qb + r, K + r, Kb + r);
        kt->gdn.exp2d_scale2(dk, G + r, NULL, Q + r, Ao + (size_t)i * lda, K + r, K2 + r);
        kt->gdn.exp2d_scale2(dk, Gl, G + r, K + r, Kpp + r, NULL, NULL);
        memset(Am + (size_t)i * GDN_C, 0, GDN_C * sizeof(float));
        memset(Ao + (size_t)i * lda + dk, 0, GDN_C * sizeof(float));
    }
    kt->gdn.exp2d_scale2(dk, Gl, NULL, NULL, W + w->dl, NULL, NULL);
    for (int b = FW_KDA_BLOCK; b < L; b += FW_KDA_BLOCK) {
        const int R = L - b < FW_KDA_BLOCK ? L - b : FW_KDA_BLOCK;
        const void *rows[GDN_C];
        for (int j = 0; j < b; j++) {
            kt->gdn.exp2d_scale2(dk, G + (size_t)b * dk, G + (size_t)j * dk, K + (size_t)j * dk, Kr + (size_t)j * dk, NULL,
                             NULL);
            rows[j] = Kr + (size_t)j * dk;
        }
        kt->dec.qk_rows(R, b, dk, Qb + (size_t)b * dk, rows, FW_F32, NULL, 0, Sq);
        kt->dec.qk_rows(R, b, dk, Kb + (size_t)b * dk, rows, FW_F32, NULL, 0, Sk);
        for (int r = 0; r < R; r++)
            for (int j = 0; j < b; j++) {
                Am[(size_t)(b + r) * GDN_C + j] = bet[b + r] * Sk[(size_t)r * GDN_C + j];
                Ao[(size_t)(b + r) * lda + dk + j] = Sq[(size_t)r * GDN_C + j];
            }
    }
    kt->gdn.kda_diag(L, dk, Q, K, E, bet, Am, GDN_C, Ao + dk, lda);
}

/* The state rows of one dv panel (HD, dk rows of 64) decayed over the chunk: by 2^g_last, or
 * for KDA row x by its own 2^G_last[x] (kda_chunk_gates' dl). */
static void decay_state(const gdn_ctx *c, const float *W, float *HD, float ex_last)
{
    const int dk = (int)c->p->dk;
    if (c->p->kda)
        for (int x = 0; x < dk; x++)
            c->kt->gdn.rows_l2scale(HD + (size_t)x * GDN_P, 1, GDN_P, W[c->w.dl + (size_t)x], 0, 0.0f);
    else
        c->kt->gdn.rows_l2scale(HD, dk, GDN_P, ex_last, 0, 0.0f);
}

static void chunk_inverse(const gdn_ctx *c, const float *Am, int L, float *Ti)
{
    if (c->flags & FW_GDN_FWD_SUBST)
        c->kt->gdn.tri_inv_fwd(Am, GDN_C, L, Ti, GDN_C);
    else
        c->kt->gdn.tri_inv_blocked(Am, GDN_C, L, Ti, GDN_C);
}

/* One chunk of tokens [t0, t0 + L) of q/k head h for its r value heads (the item's value
 * heads e0 .. e0 + r - 1 in the workspace), f32 products; nx, the item's next chunk, is
 * prefetched meanwhile. */
static void gdn_chunk(const gdn_ctx *c, float *W, int64_t h, int64_t e0, int64_t t0, int L, chunk_next nx,
                       int update)
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
    if (!p->kda) {
        const void *krows[GDN_C];
        for (int i = 0; i < L; i++)
            krows[i] = K + (size_t)i * dk;
        /* K^T [dk][64] by the decode kernels' transposing pack (FW_DEC_KEYS == GDN_C), zero past L */
        kt->dec.pack_kt(krows, FW_F32, 1, L, dk, Kt);
        /* the Gram matrices, once for all value heads of this q/k head */
        kt->mm.qk(L, dk, GDN_C, K, dk, Kt, zero, KK);
        kt->mm.qk(L, dk, GDN_C, Q, dk, Kt, zero, QK);
    }
    for (int64_t e = 0; e < p->r; e++) {
        const int64_t vh = h * p->r + e;
        if (p->kda) {
            kda_chunk_gates(c, W, vh, t0, L, Am, Ao);
        } else {
            chunk_gates(c, gam, vh, t0, L);
            /* A (strictly lower) and QK o Gamma o M (lower with the diagonal) */
            kt->gdn.gates(L, gam, bet, KK, QK, Am, Ao + dk, dk + GDN_C);
            for (int i = 0; i < L; i++) {
                float *ao = Ao + (size_t)i * (dk + GDN_C);
                memcpy(ao, Q + (size_t)i * dk, (size_t)dk * sizeof(float));
                kt->gdn.rows_l2scale(ao, 1, dk, ex[i], 0, 0.0f);
            }
        }
        chunk_rhs(c, RHS, p->kda ? W + w->k2 : K, gam, vh, t0, L);
        chunk_inverse(c, Am, L, Ti);
        for (int q = 0; q < np; q++) /* [W | U] = T RHS, a panel at a time */
            kt->mm.qk(L, L, P, Ti, GDN_C, RHS + (size_t)q * GDN_C * P, zero, WU + (size_t)q * GDN_C * P);
        for (int i = 0; i < L; i++) /* W row-major */
            for (int q = 0; q < w->pk; q++)
                memcpy(Wr + (size_t)i * dk + q * P, WU + ((size_t)q * GDN_C + i) * P,
                       (size_t)panel_cols(dk, q) * sizeof(float));
        for (int q = 0; q < w->pv; q++) {
            float *HD = hd_panel(c, W, e0 + e, q), *D = HD + (size_t)dk * P;
            prefetch_next(c, nx, (int)e * (int)w->pv + q, (int)(p->r * w->pv));
            kt->mm.qk(L, dk, P, Wr, dk, HD, zero, Wh); /* W h */
            chunk_delta(c, D, WU + ((size_t)(w->pk + q) * GDN_C) * P, Wh, vh, t0, L, q);
            /* O = [2^g Q^ | QK o Gamma o M] [h ; Delta], this panel's columns */
            kt->mm.qk(L, dk + L, P, Ao, dk + GDN_C, HD, zero, Wh);
            for (int r = 0; r < L; r++)
                store_out(c, Wh + (size_t)r * P, t0 + r, vh, q, panel_cols(p->dv, q));
        }
        if (!update)
            continue;
        /* h <- 2^g_last h + (2^(g_last - g) K^)^T Delta (KDA: the decays per row of h, Kpp
         * already decayed per channel) */
        if (!p->kda) {
            memcpy(Kpp, K, (size_t)L * dk * sizeof(float));
            for (int i = 0; i < L; i++)
                kt->gdn.rows_l2scale(Kpp + (size_t)i * dk, 1, dk, exl[i], 0, 0.0f);
        }
        for (int q = 0; q < w->pv; q++) {
            float *HD = hd_panel(c, W, e0 + e, q);
            decay_state(c, W, HD, ex[L - 1]);
            kt->mm.pv(L, dk, P, Kpp, dk, HD + (size_t)dk * P, HD);
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
 * fla's chunk kernels round the same operands (they decay Delta where this decays K^).
 * KDA: A and G come from kda_chunk_gates on f32 products (its decays differ per channel, so
 * the Gram matrices are not shared by the value heads), the keys of the RHS are 2^G o K^,
 * and the per-channel decays enter the rounded operands instead of scaling results:
 *   O = scale ((2^G o Q^)b hb + Gb Deltab),   h <- 2^G_last o h + (2^(G_last - G) o K^)b^T Deltab */
static void gdn_chunk_bf16(const gdn_ctx *c, float *W, int64_t h, int64_t e0, int64_t t0, int L, chunk_next nx,
                            int update)
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
    /* G's rows: GDN's gated QK alone (stride 64); KDA's kda_chunk_gates layout, 2^G o Q^ then
     * the gated QK (stride dk + 64) */
    const int ldg = p->kda ? dk + GDN_C : GDN_C;
    const float *Gq = p->kda ? G + dk : G;
    chunk_rows(c, K, Q, h, t0, L, 1.0f);
    if (!p->kda) {
        const void *krows[GDN_C];
        for (int i = 0; i < L; i++) {
            kt->mm.pack_row_pairs(K + (size_t)i * dk, dk, Kw + (size_t)i * dkw);
            kt->mm.pack_row_pairs(Q + (size_t)i * dk, dk, Qw + (size_t)i * dkw);
            krows[i] = Kw + (size_t)i * dkw;
        }
        /* Kb^T [dkw][64] words, zero past L: Kb's rows are already their words, moved as bf16 rows */
        kt->dec.pack_kt_bf16(krows, FW_BF16, 1, L, dk, KtW);
        kt->mm.qk_bf16(L, dkw, GDN_C, Kw, dkw, KtW, 1.0f, zero, KK);
        kt->mm.qk_bf16(L, dkw, GDN_C, Qw, dkw, KtW, 1.0f, zero, QK);
    }
    for (int64_t e = 0; e < p->r; e++) {
        const int64_t vh = h * p->r + e;
        if (p->kda) {
            kda_chunk_gates(c, W, vh, t0, L, Am, G);
            for (int i = 0; i < L; i++) /* (2^G o Q^)b, this value head's */
                kt->mm.pack_row_pairs(G + (size_t)i * ldg, dk, Qw + (size_t)i * dkw);
        } else {
            chunk_gates(c, gam, vh, t0, L);
            kt->gdn.gates(L, gam, bet, KK, QK, Am, G, GDN_C);
        }
        chunk_rhs(c, RHS, p->kda ? W + w->k2 : K, gam, vh, t0, L);
        chunk_inverse(c, Am, L, Ti);
        for (int i = 0; i < L; i++) {
            kt->mm.pack_row_pairs(Ti + (size_t)i * GDN_C, L, Tw + (size_t)i * GDN_W);
            kt->mm.pack_row_pairs(Gq + (size_t)i * ldg, L, Gw + (size_t)i * GDN_W);
        }
        for (int q = 0; q < np; q++) { /* [W | U] = Tb RHSb, a panel at a time */
            const float *R = RHS + (size_t)q * GDN_C * P;
            uint32_t *Rq = RW + (size_t)q * GDN_W * P;
            for (int x = 0; x < Lw; x++)
                kt->mm.pack_pairs(R + (size_t)(2 * x) * P, 2 * x + 1 < L ? R + (size_t)(2 * x + 1) * P : NULL, P,
                               Rq + (size_t)x * P);
            kt->mm.qk_bf16(L, Lw, P, Tw, GDN_W, Rq, 1.0f, zero, WU + (size_t)q * GDN_C * P);
        }
        for (int i = 0; i < L; i++) { /* Wb rows */
            for (int q = 0; q < w->pk; q++)
                memcpy(Wr + (size_t)i * dk + q * P, WU + ((size_t)q * GDN_C + i) * P,
                       (size_t)panel_cols(dk, q) * sizeof(float));
            kt->mm.pack_row_pairs(Wr + (size_t)i * dk, dk, Ww + (size_t)i * dkw);
        }
        if (update) { /* (2^(g_last - g) K^)b in pairs of tokens: the A operand of the update
                       * (KDA's Kpp is already decayed per channel) */
            for (int i = 0; i < L && !p->kda; i++) {
                memcpy(Kpp + (size_t)i * dk, K + (size_t)i * dk, (size_t)dk * sizeof(float));
                kt->gdn.rows_l2scale(Kpp + (size_t)i * dk, 1, dk, exl[i], 0, 0.0f);
            }
            kt->mm.pack_vw(Kpp, FW_F32, L, dk, KPw);
        }
        for (int q = 0; q < w->pv; q++) {
            float *HD = hd_panel(c, W, e0 + e, q), *D = HD + (size_t)dk * P;
            prefetch_next(c, nx, (int)e * (int)w->pv + q, (int)(p->r * w->pv));
            for (int x = 0; x < dkw; x++) /* hb */
                kt->mm.pack_pairs(HD + (size_t)(2 * x) * P, 2 * x + 1 < dk ? HD + (size_t)(2 * x + 1) * P : NULL, P,
                               Hw + (size_t)x * P);
            kt->mm.qk_bf16(L, dkw, P, Ww, dkw, Hw, 1.0f, zero, Wh); /* Wb hb */
            chunk_delta(c, D, WU + ((size_t)(w->pk + q) * GDN_C) * P, Wh, vh, t0, L, q);
            for (int x = 0; x < Lw; x++)
                kt->mm.pack_pairs(D + (size_t)(2 * x) * P, 2 * x + 1 < L ? D + (size_t)(2 * x + 1) * P : NULL, P,
                               Dw + (size_t)x * P);
            kt->mm.qk_bf16(L, dkw, P, Qw, dkw, Hw, 1.0f, zero, X);   /* Qb hb (KDA: (2^G o Q^)b hb) */
            kt->mm.qk_bf16(L, Lw, P, Gw, GDN_W, Dw, 1.0f, zero, Wh); /* Gb Deltab */
            for (int r = 0; r < L; r++) {
                float *o = Wh + (size_t)r * P;
                const float *xr = X + (size_t)r * P;
                for (int x = 0; x < P; x++)
                    o[x] = scale * (ex[r] * xr[x] + o[x]);
                store_out(c, o, t0 + r, vh, q, panel_cols(p->dv, q));
            }
            if (update) { /* h <- 2^g_last h + (2^(g_last - g) K^)b^T Deltab */
                decay_state(c, W, HD, ex[L - 1]);
                kt->mm.pv_bf16(Lw, dk, P, KPw, Dw, HD);
            }
        }
    }
}


/* Element e of a state array of dtype dt. */
static inline char *state_at(const void *base, fw_dtype dt, int64_t e)
{
    return (char *)base + (size_t)e * fw_dtype_size(dt);
}

/* State [dk][dv] of dtype c->idt (src NULL: zeros) into the f32 dv panels of value head e,
 * or back out as c->fdt (rounded to bf16 for a bf16 state). */
static void load_state(const gdn_ctx *c, float *W, int64_t e, const void *src)
{
    const gdn_prob *p = c->p;
    for (int64_t q = 0; q < c->w.pv; q++) {
        float *HD = hd_panel(c, W, e, q);
        const int64_t n = src ? fw_min64(GDN_P, p->dv - q * GDN_P) : 0;
        for (int64_t x = 0; x < p->dk; x++) {
            if (n)
                c->kt->cvt.to_f32(state_at(src, c->idt, x * p->dv + q * GDN_P), c->idt, 1, n, 1.0f, HD + x * GDN_P);
            for (int64_t y = n; y < GDN_P; y++)
                HD[x * GDN_P + y] = 0.0f;
        }
    }
}

static void store_state(const gdn_ctx *c, float *W, int64_t e, void *dst)
{
    const gdn_prob *p = c->p;
    for (int64_t q = 0; q < c->w.pv; q++) {
        const float *HD = hd_panel(c, W, e, q);
        const int64_t n = fw_min64(GDN_P, p->dv - q * GDN_P);
        for (int64_t x = 0; x < p->dk; x++)
            c->kt->cvt.from_f32(HD + x * GDN_P, n, state_at(dst, c->fdt, x * p->dv + q * GDN_P), c->fdt, 1);
    }
}

int fw_gdn_head_group(int64_t H, int64_t r, int64_t dk, int64_t dv, int64_t n_seqs, int threads)
{
    const int64_t state = ((dv + GDN_P - 1) / GDN_P) * (dk + GDN_C) * GDN_P * (int64_t)sizeof(float);
    int hg = 1;
    while (hg < FW_GDN_GROUP_MAX && 2 * hg <= H && 2 * hg * r * state <= FW_GDN_GROUP_BYTES &&
           n_seqs * ((H + 2 * hg - 1) / (2 * hg)) >= 2 * (int64_t)threads)
        hg *= 2;
    return hg;
}

/* Prefill or verify item: (sequence, group of hg q/k heads), the group's heads chunk by chunk
 * in lockstep: a token's rows of adjacent heads share their pages and lines, fetched once
 * for the group where one head at a time touched a page per row (the rows lie a page or
 * more apart). */
static void chunked_item(void *vctx, int64_t idx, int tid)
{
    const gdn_ctx *c = vctx;
    const gdn_prob *p = c->p;
    float *W = c->ws + (size_t)tid * c->w.total;
    const int64_t groups = (p->H + c->hg - 1) / c->hg;
    const int64_t seq = idx / groups, h0 = idx % groups * c->hg, h1 = fw_min64(p->H, h0 + c->hg);
    const int64_t t0 = p->cu[seq], t1 = p->cu[seq + 1], nv = (h1 - h0) * p->r;
    const int verify = c->verify;
    for (int64_t e = 0; e < nv; e++)
        load_state(c, W, e, init_of(c, seq, h0 * p->r + e));
    memset(W + c->w.zero, 0, GDN_P * sizeof(float));
    for (int64_t t = t0; t < t1; t += GDN_C) {
        const int L = (int)fw_min64(GDN_C, t1 - t), nxt = (int)fw_min64(GDN_C, fw_max64(0, t1 - t - GDN_C));
        for (int64_t h = h0; h < h1; h++) {
            const chunk_next nx = h + 1 < h1 ? (chunk_next){h + 1, t, L} : (chunk_next){h0, t + GDN_C, nxt};
            (p->bf16 ? gdn_chunk_bf16 : gdn_chunk)(c, W, h, (h - h0) * p->r, t, L, nx, !verify);
        }
    }
    for (int64_t e = 0; e < nv; e++) {
        void *dst = final_of(c, seq, h0 * p->r + e);
        if (dst)
            store_state(c, W, e, dst);
    }
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
          *tmp = o + dv, *dec = W + c->w.kpp;
    const void *h0 = init_of(c, seq, vh);
    if (h0)
        kt->cvt.to_f32(h0, c->idt, 1, p->dk * p->dv, 1.0f, hst);
    else
        memset(hst, 0, sizeof(float) * (size_t)(p->dk * p->dv));
    for (int64_t t = p->cu[seq]; t < p->cu[seq + 1]; t++) {
        load_qk(kt, p, p->q, t, h, p->scale, q);
        load_qk(kt, p, p->k, t, h, 1.0, k);
        kt->cvt.to_f32(at(p->v, t, vh), p->v->dtype, p->v->stride[2], dv, 1.0f, v);
        const float beta = gate_beta(p, t, vh);
        gate_decays(kt, p, t, vh, dec, dec + dk);
        if (c->flags & FW_GDN_RECURRENT) {
            kt->gdn.step4(hst, dv, dk, dv, q, k, v, dec, beta, o, tmp);
        } else {
            float kq = 0;
            for (int x = 0; x < dk; x++)
                kq += k[x] * q[x];
            for (int c0 = 0; c0 < dv; c0 += 64)
                kt->gdn.dec_cols(hst, FW_F32, dv, dk, c0, (int)fw_min64(dv, c0 + 64), q, k, v, dec, beta, kq, o);
        }
        kt->cvt.from_f32(o, dv, (void *)at(p->out, t, vh), p->out->dtype, p->out->stride[2]);
    }
    void *dst = final_of(c, seq, vh);
    if (dst)
        kt->cvt.from_f32(hst, p->dk * p->dv, dst, c->fdt, 1);
}

/* Allocate per-thread workspace and run the chunked items (or the recurrent ones) over c's
 * sequences. */
static fw_status gdn_run(gdn_ctx *c, const fw_gdn_params *params, fw_item_fn fn)
{
    const gdn_prob *p = c->p;
    const fw_kernels *kt = fw_kernels_get(params ? params->isa : NULL);
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    c->kt = kt;
    c->flags = params ? params->flags : 0;
    const int threads = fw_threads(params ? params->threads : 0);
    const int chunked = fn == chunked_item;
    c->hg = chunked ? fw_gdn_head_group(p->H, p->r, p->dk, p->dv, p->n, threads) : 1;
    c->w = gdn_plan(p, kt, c->hg);
    const int64_t n = chunked ? p->n * ((p->H + c->hg - 1) / c->hg) : p->n * p->HV;
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

/* The prefill passes over c's states: the recurrent baselines by (sequence, value head), the
 * chunked pass by (sequence, q/k head). A sequence's initial and final state may be one
 * buffer: every item reads its own states before it writes them, and no two items share a
 * state (the pool's check refuses a slot read by one sequence and written by another). */
static fw_status prefill_run(gdn_ctx *c, const fw_gdn_params *params)
{
    const uint32_t fl = params ? params->flags : 0;
    gdn_prob *p = (gdn_prob *)c->p;
    if (fl & (FW_GDN_RECURRENT | FW_GDN_FUSED_RECURRENT)) {
        p->bf16 = 0; /* the recurrent baselines run f32 products */
        return gdn_run(c, params, recurrent_item);
    }
    return gdn_run(c, params, chunked_item);
}

fw_status fw_gdn_prefill(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                         const fw_tensor *beta, const int32_t *cu_seqlens, int64_t n_seqs,
                         const float *initial_state, float *final_state, const fw_tensor *out,
                         const fw_gdn_params *params)
{
    fw_clear_error();
    gdn_prob p;
    fw_status s = fw_gdn_check(&p, q, k, v, g, beta, cu_seqlens, n_seqs, 1, out, params, 0);
    if (s)
        return s;
    gdn_ctx c;
    memset(&c, 0, sizeof c);
    c.p = &p;
    c.init = initial_state;
    c.final = final_state;
    c.init_stride = c.final_stride = p.HV * p.dk * p.dv;
    return prefill_run(&c, params);
}

/* The prefill of checked problem p from pool `from` to pool `to` (fw_gdn_prefill_pools). */
static fw_status pools_run(const gdn_prob *p, const fw_gdn_pool *from, const fw_gdn_pool *to,
                           const fw_gdn_params *params)
{
    gdn_ctx c;
    memset(&c, 0, sizeof c);
    c.p = p;
    c.init = from->read ? from->data : NULL;
    c.final = to->data;
    c.init_idx = from->read;
    c.final_idx = to->write ? to->write : to->read;
    c.init_stride = from->slot_stride;
    c.final_stride = to->slot_stride;
    c.idt = from->dtype;
    c.fdt = to->dtype;
    return prefill_run(&c, params);
}

fw_status fw_gdn_prefill_pool(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                              const fw_tensor *beta, const int32_t *cu_seqlens, int64_t n_seqs,
                              const fw_gdn_pool *pool, const fw_tensor *out, const fw_gdn_params *params)
{
    fw_clear_error();
    gdn_prob p;
    fw_status s = fw_gdn_check(&p, q, k, v, g, beta, cu_seqlens, n_seqs, 1, out, params, 0);
    if (s || (s = fw_gdn_check_pool(pool, n_seqs, p.HV, p.dk, p.dv)))
        return s;
    return pools_run(&p, pool, pool, params);
}

fw_status fw_gdn_prefill_pools(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                               const fw_tensor *beta, const int32_t *cu_seqlens, int64_t n_seqs,
                               const fw_gdn_pool *from, const fw_gdn_pool *to, const fw_tensor *out,
                               const fw_gdn_params *params)
{
    gdn_prob p;
    fw_status s = fw_gdn_check(&p, q, k, v, g, beta, cu_seqlens, n_seqs, 1, out, params, 0);
    return s ? s : pools_run(&p, from, to, params);
}

/* ------------------------------------------------------- verify and commit -- */

size_t fw_gdn_replay_floats(int64_t T, int64_t H, int64_t HV, int64_t dk, int64_t dv)
{
    return replay_size(T, H, HV, dk, dv, 0);
}

size_t fw_kda_replay_floats(int64_t T, int64_t H, int64_t HV, int64_t dk, int64_t dv)
{
    return replay_size(T, H, HV, dk, dv, 1);
}

fw_status fw_gdn_verify(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                        const fw_tensor *beta, const int32_t *cu_seqlens, int64_t n_seqs, const float *state,
                        int64_t slots, const int32_t *state_indices, float *replay, size_t replay_floats,
                        const fw_tensor *out, const fw_gdn_params *params)
{
    fw_clear_error();
    gdn_prob p;
    fw_status s = fw_gdn_check(&p, q, k, v, g, beta, cu_seqlens, n_seqs, 1, out, params, 0);
    if (s || (s = fw_gdn_check_slots(state_indices, n_seqs, slots, state)))
        return s;
    for (int64_t i = 0; i < n_seqs; i++)
        if (cu_seqlens[i + 1] - cu_seqlens[i] > GDN_C)
            return fw_fail(FW_ERR_SEQLENS, "sequence %lld has %d tokens to verify; at most %d", (long long)i,
                           (int)(cu_seqlens[i + 1] - cu_seqlens[i]), GDN_C);
    if (!replay)
        return fw_fail(FW_ERR_NULL, "replay is NULL");
    const size_t need = replay_size(p.T, p.H, p.HV, p.dk, p.dv, p.kda);
    if (replay_floats < need)
        return fw_fail(FW_ERR_WORKSPACE, "replay holds %zu floats; this call needs %zu (%s)", replay_floats, need,
                       p.kda ? "fw_kda_replay_floats: KDA keeps a decay per key channel" : "fw_gdn_replay_floats");
    gdn_ctx c;
    memset(&c, 0, sizeof c);
    c.p = &p;
    c.init = state;
    c.init_idx = state_indices;
    c.init_stride = p.HV * p.dk * p.dv;
    c.verify = 1;
    c.replay = replay;
    c.rp = replay_at(replay, p.T, p.HV, p.dk, p.dv, p.kda);
    replay[0] = p.kda ? KDA_REPLAY_TAG : GDN_REPLAY_TAG;
    fw_gdn_params vp;
    if (params)
        vp = *params;
    else
        fw_gdn_params_init(&vp);
    vp.flags &= FW_GDN_FWD_SUBST; /* verify is always the one-chunk WY pass */
    return gdn_run(&c, &vp, chunked_item);
}

/* Commit item (sequence i, value head vh): h = 2^g_{m-1} h_0 + sum_{j<m} 2^(g_{m-1} - g_j) k_j delta_j^T
 * with m = accepted[i] and g the chunk-local log decays (log2 units) kept by verify; under KDA
 * g is a vector, row x of h decays by 2^g_{m-1,x} and key channel x by 2^(g_{m-1,x} - g_{j,x}). */
typedef struct {
    const int32_t *cu, *accepted;
    int64_t H, HV, dk, dv;
    float *state;
    const int32_t *idx;
    replay_parts rp;
} commit_ctx;

static void commit_item(void *vctx, int64_t it, int tid)
{
    const commit_ctx *c = vctx;
    const int64_t i = it / c->HV, vh = it % c->HV, m = c->accepted[i], t0 = c->cu[i];
    const int64_t dk = c->dk, dv = c->dv, gw = c->rp.gw;
    if (m == 0)
        return;
    float *h = c->state + ((size_t)c->idx[i] * c->HV + vh) * (size_t)(dk * dv);
    const float *glast = c->rp.gam + ((size_t)(t0 + m - 1) * c->HV + vh) * gw;
    for (int64_t x = 0; x < dk; x++) {
        const float al = exp2f(glast[gw > 1 ? x : 0]);
        for (int64_t y = 0; y < dv; y++)
            h[x * dv + y] *= al;
    }
    for (int64_t j = 0; j < m; j++) {
        const float *gj = c->rp.gam + ((size_t)(t0 + j) * c->HV + vh) * gw;
        const float *kj = c->rp.key + ((size_t)(t0 + j) * c->H + vh / (c->HV / c->H)) * dk;
        const float *dj = c->rp.delta + ((size_t)(t0 + j) * c->HV + vh) * dv;
        for (int64_t x = 0; x < dk; x++) {
            const int64_t e = gw > 1 ? x : 0;
            const float a = exp2f(glast[e] - gj[e]) * kj[x];
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
    if (H < 1 || HV < 1 || HV % H || dk < 1 || dk > FW_MAX_HEAD_DIM || dv < 1 || dv > FW_MAX_HEAD_DIM)
        return fw_fail(FW_ERR_SHAPE, "H %lld, HV %lld, dk %lld, dv %lld: HV must be a multiple of H and dims 1..%d",
                       (long long)H, (long long)HV, (long long)dk, (long long)dv, FW_MAX_HEAD_DIM);
    if ((s = fw_gdn_check_slots(state_indices, n_seqs, slots, state)))
        return s;
    if ((s = fw_check_cu_seqlens(cu_seqlens, n_seqs, -1, "cu_seqlens")))
        return s;
    for (int64_t i = 0; i < n_seqs; i++) {
        const int64_t len = (int64_t)cu_seqlens[i + 1] - cu_seqlens[i];
        if (len > GDN_C)
            return fw_fail(FW_ERR_SEQLENS, "sequence %lld has %lld verified tokens; 0..%d expected", (long long)i,
                           (long long)len, GDN_C);
        if (accepted[i] < 0 || accepted[i] > len)
            return fw_fail(FW_ERR_ARG, "accepted[%lld] = %d is outside 0..%lld", (long long)i, (int)accepted[i],
                           (long long)len);
    }
    const int64_t T = cu_seqlens[n_seqs];
    if (replay_floats < 1 || (replay[0] != GDN_REPLAY_TAG && replay[0] != KDA_REPLAY_TAG))
        return fw_fail(FW_ERR_ARG, "replay was not written by fw_gdn_verify (its first float tags the layout)");
    const int kda = replay[0] == KDA_REPLAY_TAG;
    const size_t need = replay_size(T, H, HV, dk, dv, kda);
    if (replay_floats < need)
        return fw_fail(FW_ERR_WORKSPACE, "replay holds %zu floats; %zu expected (%s replay)", replay_floats, need,
                       kda ? "a KDA" : "a GDN");
    if (params && (s = fw_check_threads(params->threads)))
        return s;
    commit_ctx c = {cu_seqlens, accepted, H, HV, dk, dv, state, state_indices,
                    replay_at((float *)replay, T, HV, dk, dv, kda)};
    fw_parallel(fw_threads(params ? params->threads : 0), n_seqs * HV, commit_item, &c);
    return FW_OK;
}

