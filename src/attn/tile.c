/*
 * attn/tile.c: the tiled kernel of one chunk item (prefill, and any sequence with more than
 * FW_DEC_ROWS query rows per K/V head). A q tile stacks the G query heads of the GQA group as
 * extra rows (rows = G x bq positions), so each K/V tile is converted to f32 once per chunk
 * and used by every head of the group. Inside a chunk the K/V tiles are the outer loop and
 * the q tiles the inner one, so the workspace does not grow with the sequence length. Tiles
 * that no row of a q tile can see are skipped by index arithmetic; only tiles some row sees
 * partly are masked. A rotary embedding rotates q rows and K rows as they are converted. The
 * arithmetic is in the kernel table (kern/kernels.h).
 */
#include "run.h"

/* The key range a q tile needs: [lo, hi) is the union of its rows' visible ranges, and
 * [clo, chi) their intersection (empty if any row sees nothing): a K/V tile inside the
 * intersection needs no mask. */
typedef struct {
    int64_t lo, hi, clo, chi;
} tile_keys;

/* A q tile's operands in the precision of the call: f32 (QT scaled, K rows Kf) or bf16
 * pairs (QW unscaled, K words KW, V words VW; P goes through PW). */
typedef struct {
    const float *QT, *Kf, *Vf;
    const uint32_t *QW, *KW, *VW;
    uint32_t *PW;
} tile_ops;

/* ST = bias + scores of the tile's nk keys against its M rows, in log2 units (bf16 products:
 * qscale, the item's score multiplier, applied to the f32 scores). */
static void tile_qk(const run_ctx *c, const tile_ops *o, int nk, int M, float qscale, const float *bias,
                    float *ST)
{
    const int d = (int)c->p->d, dw = (d + 1) / 2;
    if (c->p->bf16)
        c->kt->mm.qk_bf16(nk, dw, M, o->KW, dw, o->QW, qscale, bias, ST);
    else
        c->kt->mm.qk(nk, d, M, o->Kf, d, o->QT, bias, ST);
    if (c->cap2 > 0.0f)
        c->kt->attn.softcap(nk, M, ST, c->cap2);
}

/* OT += P V over the tile's nk keys; bf16 products round P to bf16 pairs first. */
static void tile_pv(const run_ctx *c, const tile_ops *o, int nk, int M, const float *ST, float *OT)
{
    const int dv = (int)c->p->dv;
    if (!c->p->bf16) {
        c->kt->mm.pv(nk, dv, M, o->Vf, dv, ST, OT);
        return;
    }
    const int nw = (nk + 1) / 2;
    for (int w = 0; w < nw; w++)
        c->kt->mm.pack_pairs(ST + (size_t)2 * w * M, 2 * w + 1 < nk ? ST + (size_t)(2 * w + 1) * M : NULL,
                          M, o->PW + (size_t)w * M);
    c->kt->mm.pv_bf16(nw, dv, M, o->VW, o->PW, OT);
}

/* What one chunk item works with (fw_attn_tile_item): its rows and head, the workspace's
 * panels, and how its K/V rows are read. */
typedef struct {
    const run_ctx *c;
    const fw_attn_prob *p;
    const fw_kernels *kt;
    const fw_attn_seq *sq;
    int G, d, dv, dw, bq, M, bf16, online, skip, folded;
    int64_t kvh, h0;      /* the K/V head, and the first q head */
    float qscale;         /* the score multiplier: the call's, times an fp8 cache's K descale */
    int64_t p0, p1;       /* the chunk's positions [p0, p1), nt q tiles */
    int nt;
    float *QT, *OT, *A, *L, *bias, *zero, *lo, *hi, *pending, *ST, *Kf, *Vf, *orow;
    int64_t *RLO, *RHI;   /* each row's visible keys */
    uint32_t *QW, *KW, *VW;
    tile_ops ops;
    tile_keys tk[FW_ATTN_CHUNK_MAX];
    /* how K/V rows are read: keys stored transposed (kcols), bf16 rows used as they are as
     * the K words (kraw) and as pack_vw's input (vraw); the bytes of a row's elements */
    int kcols, kraw, vraw;
    int64_t es, kline, vline;
} tile_item;

/* The item's rows, head and workspace panels. */
static void tile_setup(tile_item *I, const run_ctx *c, const item *it, const fw_attn_seq *sq, int tid)
{
    const fw_attn_prob *p = c->p;
    I->c = c;
    I->p = p;
    I->kt = c->kt;
    I->sq = sq;
    I->G = c->G;
    I->d = (int)p->d;
    I->dv = (int)p->dv;
    I->dw = (I->d + 1) / 2;
    I->bq = it->bq; /* the call's plan (attn/run.c) */
    I->M = it->M;
    I->bf16 = p->bf16;
    I->online = (c->flags & FW_ATTN_ONLINE_SOFTMAX) != 0;
    I->skip = !(c->flags & FW_ATTN_NO_TILE_SKIP);
    I->folded = !I->online && c->cap2 == 0.0f; /* the anchor rides in qk's bias */
    I->kvh = (c->flags & FW_ATTN_NO_GQA_PACK) ? it->head / p->G : it->head;
    I->h0 = (c->flags & FW_ATTN_NO_GQA_PACK) ? it->head : it->head * p->G;
    I->qscale = c->qscale * fw_attn_descale(p, 0, sq->index, I->kvh);
    I->p0 = it->chunk * (int64_t)c->chunk * I->bq;
    I->p1 = fw_min64(sq->sq, I->p0 + (int64_t)c->chunk * I->bq);
    I->nt = (int)fw_ceil_div(I->p1 - I->p0, I->bq);
    const int M = I->M;
    char *w = c->ws + (size_t)tid * c->ws_stride;
    I->QT = (float *)(w + c->wl.qt);
    I->OT = (float *)(w + c->wl.ot);
    I->A = (float *)(w + c->wl.al);
    I->L = I->A + FW_ATTN_CHUNK_MAX * M;
    I->RLO = (int64_t *)(w + c->wl.rng);
    I->RHI = I->RLO + FW_ATTN_CHUNK_MAX * M;
    I->bias = (float *)(w + c->wl.vec);
    I->zero = I->bias + M;
    I->lo = I->zero + M;
    I->hi = I->lo + M;
    I->pending = I->hi + M;
    I->ST = (float *)(w + c->wl.st);
    I->Kf = (float *)(w + c->wl.kf);
    I->Vf = (float *)(w + c->wl.vf);
    I->orow = (float *)(w + c->wl.row);
    I->QW = (uint32_t *)(w + c->wl.qw);
    I->KW = (uint32_t *)(w + c->wl.kw);
    I->VW = (uint32_t *)(w + c->wl.vw);
    tile_ops ops = {NULL, I->Kf, I->Vf, NULL, I->KW, I->VW, (uint32_t *)(w + c->wl.pw)};
    I->ops = ops;
    I->es = (int64_t)fw_dtype_size(p->k->dtype);
    I->kline = ((I->d - 1) * p->ks[2] + 1) * I->es;
    I->vline = ((I->dv - 1) * p->vs[2] + 1) * I->es;
    /* keys stored transposed, each channel's keys contiguous, every tile inside one page */
    I->kcols = p->ks[0] == 1 && I->d > 1 && (!p->bt || p->page % I->kt->bk == 0);
    /* bf16 products on contiguous bf16 key rows, not rotated: the rows are the K words */
    I->kraw = I->bf16 && !I->kcols && !p->rot_k && p->k->dtype == FW_BF16 && p->ks[2] == 1;
    /* and contiguous bf16 value rows go to pack_vw as they are (Vf holds them as bf16) */
    I->vraw = I->bf16 && p->v->dtype == FW_BF16 && p->vs[2] == 1;
}

/* Pack q tile r: QT[r][k][m] for row m = g * bq + t (head h0 + g, position p0 + r * bq + t),
 * scaled so scores come out in log2 units (f32 products), or unscaled and then paired into
 * QW[r] (bf16 products). Padding rows are zero and see no key. Its accumulators reset; its
 * rows' visible keys in RLO / RHI; returns their union and intersection. */
static tile_keys tile_pack_q(tile_item *I, int r)
{
    const fw_attn_prob *p = I->p;
    const fw_kernels *kt = I->kt;
    const int d = I->d, M = I->M, bq = I->bq;
    float *qt = I->QT + (size_t)r * d * M;
    memset(qt, 0, (size_t)d * M * sizeof(float));
    memset(I->OT + (size_t)r * I->dv * M, 0, (size_t)I->dv * M * sizeof(float));
    tile_keys t = {INT64_MAX, INT64_MIN, INT64_MIN, INT64_MAX};
    for (int m = 0; m < M; m++) {
        I->A[r * M + m] = -INFINITY;
        I->L[r * M + m] = 0.0f;
        I->RLO[r * M + m] = I->RHI[r * M + m] = 0;
    }
    for (int g = 0; g < I->G; g++)
        for (int i = 0; i < bq && I->p0 + (int64_t)r * bq + i < I->p1; i++) {
            const int64_t pos = I->p0 + (int64_t)r * bq + i;
            const int m = g * bq + i;
            const char *src = fw_elem(p->q, I->sq->q0 + pos * p->qs[0] + (I->h0 + g) * p->qs[1]);
            kt->cvt.to_f32(src, p->q->dtype, p->qs[2], d, I->bf16 ? 1.0f : I->qscale, I->orow);
            if (p->rcos)
                fw_attn_rotate(p, kt, I->orow, fw_attn_qpos(p, I->sq, pos));
            for (int k = 0; k < d; k++)
                qt[(size_t)k * M + m] = I->orow[k];
            int64_t vlo, vhi;
            fw_attn_visible(p, I->sq->sq, I->sq->sk, pos, &vlo, &vhi);
            t.clo = fw_max64(t.clo, vlo);
            t.chi = fw_min64(t.chi, vhi);
            if (vhi > vlo) {
                I->RLO[r * M + m] = vlo;
                I->RHI[r * M + m] = vhi;
                t.lo = fw_min64(t.lo, vlo);
                t.hi = fw_max64(t.hi, vhi);
            }
        }
    if (I->bf16)
        for (int x = 0; x < I->dw; x++)
            kt->mm.pack_pairs(qt + (size_t)2 * x * M, 2 * x + 1 < d ? qt + (size_t)(2 * x + 1) * M : NULL, M,
                              I->QW + ((size_t)r * I->dw + x) * M);
    return t;
}

/* The K and V rows of the tile [t0, t0 + nk), converted to f32 once for every q tile and head
 * (bf16 products: K words in KW, V words in VW); keys stored transposed (vLLM's CPU cache)
 * are transposed back a block at a time. */
static void tile_load_kv(tile_item *I, int64_t t0, int nk)
{
    const fw_attn_prob *p = I->p;
    const fw_kernels *kt = I->kt;
    const fw_attn_seq *sq = I->sq;
    const int d = I->d, dv = I->dv, dw = I->dw, bf16 = I->bf16;
    const int64_t kvh = I->kvh;
    float *Kf = I->Kf, *Vf = I->Vf;
    if (I->kcols)
        kt->dec.cols_to_rows(fw_elem(p->k, fw_attn_key(p, sq, t0, 0) + kvh * p->ks[1]), p->k->dtype, p->ks[2],
                             nk, d, Kf);
    for (int j = 0; j < nk && p->tiles; j++) {
        /* FW_KV_TILES (bf16, d even, not rotated): rows copied out of their tiles, into the
         * K words and V rows directly with bf16 products, else through orow and to f32 */
        uint16_t *kr = bf16 ? (uint16_t *)(I->KW + (size_t)j * dw) : (uint16_t *)I->orow;
        uint16_t *vr = bf16 ? (uint16_t *)Vf + (size_t)j * dv : (uint16_t *)I->orow + d;
        fw_attn_tile_rows_out(p, sq, t0 + j, 1, kvh, 0, kr);
        fw_attn_tile_rows_out(p, sq, t0 + j, 1, kvh, 1, vr);
        if (!bf16) {
            kt->cvt.to_f32(kr, FW_BF16, 1, d, 1.0f, Kf + (size_t)j * d);
            kt->cvt.to_f32(vr, FW_BF16, 1, dv, 1.0f, Vf + (size_t)j * dv);
        }
    }
    for (int j = 0; j < nk && !p->tiles; j++) {
        int64_t kr = fw_attn_key(p, sq, t0 + j, 0) + kvh * p->ks[1];
        int64_t vr = fw_attn_key(p, sq, t0 + j, 1) + kvh * p->vs[1];
        uint16_t *kw = (uint16_t *)(I->KW + (size_t)j * dw);
        if (I->kraw) /* bf16 rows already are their words: copied, not converted twice */
            memcpy(kw, fw_elem(p->k, kr), (size_t)d * sizeof(uint16_t));
        else if (!I->kcols)
            kt->cvt.to_f32(fw_elem(p->k, kr), p->k->dtype, p->ks[2], d, 1.0f, Kf + (size_t)j * d);
        if (I->vraw)
            memcpy((uint16_t *)Vf + (size_t)j * dv, fw_elem(p->v, vr), (size_t)dv * sizeof(uint16_t));
        else
            kt->cvt.to_f32(fw_elem(p->v, vr), p->v->dtype, p->vs[2], dv, 1.0f, Vf + (size_t)j * dv);
        if (p->rot_k)
            fw_attn_rotate(p, kt, Kf + (size_t)j * d, t0 + j);
        if (bf16 && !I->kraw)
            kt->cvt.from_f32(Kf + (size_t)j * d, d, kw, FW_BF16, 1);
        if (bf16 && (d & 1))
            kw[d] = 0;
    }
    if (bf16)
        kt->mm.pack_vw(Vf, I->vraw ? FW_BF16 : FW_F32, nk, dv, I->VW);
}

/* Ask for the next tile's K and V rows [t1, tn) now: they arrive while this tile's products
 * run. Without it the conversion in tile_load_kv waited on memory for 10% of the time of a 4K
 * causal bf16 prefill (1 thread; rows 2 KiB apart defeat the hardware prefetcher). */
static void tile_prefetch_next(const tile_item *I, int64_t t1, int64_t tn)
{
    const fw_attn_prob *p = I->p;
    const fw_attn_seq *sq = I->sq;
    const int64_t kvh = I->kvh, es = I->es;
    if (I->kcols && tn > t1) /* transposed keys: each channel's row of the next tile's keys */
        for (int64_t x = 0; x < I->d; x++) {
            const char *kr = fw_elem(p->k, fw_attn_key(p, sq, t1, 0) + kvh * p->ks[1] + x * p->ks[2]);
            for (int64_t b = 0; b < (tn - t1) * es; b += 64)
                __builtin_prefetch(kr + b, 0, 2);
        }
    for (int64_t j = t1; j < tn && !p->tiles; j++) {
        const char *kr = fw_elem(p->k, fw_attn_key(p, sq, j, 0) + kvh * p->ks[1]);
        const char *vr = fw_elem(p->v, fw_attn_key(p, sq, j, 1) + kvh * p->vs[1]);
        for (int64_t b = 0; b < (I->kcols ? 0 : I->kline); b += 64)
            __builtin_prefetch(kr + b, 0, 2);
        for (int64_t b = 0; b < I->vline; b += 64)
            __builtin_prefetch(vr + b, 0, 2);
    }
}

/* q tile r against the loaded K/V tile [t0, t1): scores, softmax (masked where the tile
 * crosses a row's visible range; a static anchor that fails replays the tile online), and
 * P V into its accumulators. Skipped where no row of the q tile sees the tile. */
static void tile_attend(tile_item *I, int r, int64_t t0, int64_t t1)
{
    const int M = I->M, dv = I->dv, nk = (int)(t1 - t0);
    const tile_keys *t = &I->tk[r];
    int boundary = 1;
    if (I->skip) {
        if (t->hi <= t->lo || t1 <= t->lo || t0 >= t->hi)
            return;
        boundary = !(t->clo <= t0 && t->chi >= t1);
    }
    const int64_t *rlo = I->RLO + r * M, *rhi = I->RHI + r * M;
    float *A_r = I->A + r * M, *L_r = I->L + r * M, *OT_r = I->OT + (size_t)r * dv * M;
    if (boundary)
        for (int m = 0; m < M; m++) {
            I->lo[m] = (float)fw_max64(0, fw_min64(nk, rlo[m] - t0));
            I->hi[m] = (float)fw_max64(0, fw_min64(nk, rhi[m] - t0));
        }
    for (int m = 0; m < M; m++)
        I->bias[m] = I->folded && A_r[m] != -INFINITY ? -A_r[m] : 0.0f;
    I->ops.QT = I->QT + (size_t)r * I->d * M;
    I->ops.QW = I->QW + (size_t)r * I->dw * M;
    tile_qk(I->c, &I->ops, nk, M, I->qscale, I->bias, I->ST);
    fw_softmax_args sa = {nk, M, I->ST, A_r, L_r, boundary ? I->lo : NULL, boundary ? I->hi : NULL,
                          I->folded, I->online, OT_r, dv, I->pending};
    if (I->kt->attn.softmax(&sa)) {
        /* the static anchor's bound failed: replay this tile exactly, online */
        tile_qk(I->c, &I->ops, nk, M, I->qscale, I->zero, I->ST);
        sa.folded = 0;
        sa.online = 1;
        I->kt->attn.softmax(&sa);
    }
    tile_pv(I->c, &I->ops, nk, M, I->ST, OT_r);
}

/* Normalise and store (or keep a split's partials); rows are gathered from OT's columns. */
static void tile_store(const tile_item *I, const item *it)
{
    const int M = I->M, dv = I->dv, bq = I->bq;
    for (int r = 0; r < I->nt; r++)
        for (int g = 0; g < I->G; g++)
            for (int i = 0; i < bq && I->p0 + (int64_t)r * bq + i < I->p1; i++) {
                const int m = g * bq + i;
                const float *ot = I->OT + (size_t)r * dv * M + m;
                for (int j = 0; j < dv; j++)
                    I->orow[j] = ot[(size_t)j * M];
                if (it->part >= 0) /* (row g sq + position of the head's partials, as a decode's) */
                    fw_attn_store_partial(I->c, it, (int)(g * I->sq->sq + I->p0 + (int64_t)r * bq + i), I->orow,
                                          I->A[r * M + m], I->L[r * M + m]);
                else
                    fw_attn_store_row(I->c, I->sq, I->h0 + g, I->p0 + (int64_t)r * bq + i, I->orow,
                                      I->A[r * M + m], I->L[r * M + m]);
            }
}

/* Chunk it->chunk of the sequence's q tiles, for K/V head it->head (its G q heads) or, without
 * GQA packing, q head it->head, over the keys [it->kb, it->ke): K/V tiles outside, q tiles
 * inside. */
void fw_attn_tile_item(const run_ctx *c, const item *it, const fw_attn_seq *sq, int tid)
{
    tile_item I;
    tile_setup(&I, c, it, sq, tid);
    int64_t klo = INT64_MAX, khi = INT64_MIN;
    memset(I.zero, 0, (size_t)I.M * sizeof(float));
    for (int r = 0; r < I.nt; r++) {
        I.tk[r] = tile_pack_q(&I, r);
        klo = fw_min64(klo, I.tk[r].lo);
        khi = fw_max64(khi, I.tk[r].hi);
    }
    if (!I.skip) {
        klo = 0;
        khi = sq->sk;
    }
    klo = fw_max64(klo, it->kb); /* a split item covers its range of keys only */
    khi = fw_min64(khi, it->ke);
    const int BK = c->kt->bk;
    for (int64_t t0 = klo < khi ? klo / BK * BK : khi; t0 < khi; t0 += BK) {
        const int64_t t1 = fw_min64(sq->sk, t0 + BK);
        tile_load_kv(&I, t0, (int)(t1 - t0));
        tile_prefetch_next(&I, t1, fw_min64(khi, t1 + BK));
        for (int r = 0; r < I.nt; r++)
            tile_attend(&I, r, t0, t1);
    }
    tile_store(&I, it);
}
