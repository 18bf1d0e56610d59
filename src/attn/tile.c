/*
 * attn/tile.c: the tiled kernel of one chunk item (prefill, and any sequence with more than
 * FW_DEC_ROWS query rows per K/V head). A q tile stacks the G query heads of the GQA group as
 * extra rows (rows = G x bq positions), so each K/V tile is converted to f32 once per chunk
 * and used by every head of the group. Inside a chunk the K/V tiles are the outer loop and
 * the q tiles the inner one, so the workspace does not grow with the sequence length. Tiles
 * that no row of a q tile can see are skipped by index arithmetic; only tiles some row sees
 * partly are masked. A rotary embedding rotates q rows and K rows as they are converted. The arithmetic is in the kernel table (kern/kernels.h).
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

/* ST = bias + scores of the tile's nk keys against its M rows, in log2 units. */
static void tile_qk(const run_ctx *c, const tile_ops *o, int nk, int M, const float *bias, float *ST)
{
    const int d = (int)c->p->d, dw = (d + 1) / 2;
    if (c->p->bf16)
        c->kt->mm.qk_bf16(nk, dw, M, o->KW, dw, o->QW, c->qscale, bias, ST);
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

/* Chunk it->chunk of the sequence's q tiles, for K/V head it->head (its G q heads) or, without
 * GQA packing, q head it->head, over the keys [it->kb, it->ke). */
void fw_attn_tile_item(const run_ctx *c, const item *it, const fw_attn_seq *sq, int tid)
{
    const fw_attn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    const int G = c->G, d = (int)p->d, dv = (int)p->dv;
    const int bq = it->bq, M = it->M; /* the call's plan (attn/run.c) */
    const int online = (c->flags & FW_ATTN_ONLINE_SOFTMAX) != 0;
    const int skip = !(c->flags & FW_ATTN_NO_TILE_SKIP);
    const int folded = !online && c->cap2 == 0.0f; /* the anchor rides in qk's bias */
    const int64_t kvh = (c->flags & FW_ATTN_NO_GQA_PACK) ? it->head / p->G : it->head;
    const int64_t h0 = (c->flags & FW_ATTN_NO_GQA_PACK) ? it->head : it->head * p->G;
    char *w = c->ws + (size_t)tid * c->ws_stride;
    float *QT = (float *)(w + c->wl.qt), *OT = (float *)(w + c->wl.ot);
    float *A = (float *)(w + c->wl.al), *L = A + FW_ATTN_CHUNK_MAX * M;
    int64_t *RLO = (int64_t *)(w + c->wl.rng), *RHI = RLO + FW_ATTN_CHUNK_MAX * M;
    float *bias = (float *)(w + c->wl.vec), *zero = bias + M, *lo = zero + M, *hi = lo + M,
          *pending = hi + M;
    float *ST = (float *)(w + c->wl.st), *Kf = (float *)(w + c->wl.kf), *Vf = (float *)(w + c->wl.vf);
    float *orow = (float *)(w + c->wl.row);
    uint32_t *QW = (uint32_t *)(w + c->wl.qw), *KW = (uint32_t *)(w + c->wl.kw);
    uint32_t *VW = (uint32_t *)(w + c->wl.vw);
    const int bf16 = p->bf16, dw = (d + 1) / 2;
    tile_ops ops = {NULL, Kf, Vf, NULL, KW, VW, (uint32_t *)(w + c->wl.pw)};
    tile_keys tk[FW_ATTN_CHUNK_MAX];

    const int64_t p0 = it->chunk * (int64_t)c->chunk * bq;
    const int64_t p1 = fw_min64(sq->sq, p0 + (int64_t)c->chunk * bq);
    const int nt = (int)fw_ceil_div(p1 - p0, bq);
    int64_t klo = INT64_MAX, khi = INT64_MIN;

    /* Pack the chunk's q tiles: QT[r][k][m] for row m = g * bq + t (head h0 + g, position
     * p0 + r * bq + t), scaled so scores come out in log2 units (f32 products), or unscaled
     * and then paired into QW[r] (bf16 products). Padding rows are zero and see no key. */
    memset(zero, 0, (size_t)M * sizeof(float));
    for (int r = 0; r < nt; r++) {
        float *qt = QT + (size_t)r * d * M;
        memset(qt, 0, (size_t)d * M * sizeof(float));
        memset(OT + (size_t)r * dv * M, 0, (size_t)dv * M * sizeof(float));
        tile_keys t = {INT64_MAX, INT64_MIN, INT64_MIN, INT64_MAX};
        for (int m = 0; m < M; m++) {
            A[r * M + m] = -INFINITY;
            L[r * M + m] = 0.0f;
            RLO[r * M + m] = RHI[r * M + m] = 0;
        }
        for (int g = 0; g < G; g++)
            for (int i = 0; i < bq && p0 + (int64_t)r * bq + i < p1; i++) {
                const int64_t pos = p0 + (int64_t)r * bq + i;
                const int m = g * bq + i;
                const char *src = fw_elem(p->q, sq->q0 + pos * p->qs[0] + (h0 + g) * p->qs[1]);
                kt->cvt.to_f32(src, p->q->dtype, p->qs[2], d, bf16 ? 1.0f : c->qscale, orow);
                if (p->rcos)
                    fw_attn_rotate(p, kt, orow, fw_attn_qpos(p, sq, pos));
                for (int k = 0; k < d; k++)
                    qt[(size_t)k * M + m] = orow[k];
                int64_t vlo, vhi;
                fw_attn_visible(p, sq->sq, sq->sk, pos, &vlo, &vhi);
                t.clo = fw_max64(t.clo, vlo);
                t.chi = fw_min64(t.chi, vhi);
                if (vhi > vlo) {
                    RLO[r * M + m] = vlo;
                    RHI[r * M + m] = vhi;
                    t.lo = fw_min64(t.lo, vlo);
                    t.hi = fw_max64(t.hi, vhi);
                }
            }
        tk[r] = t;
        klo = fw_min64(klo, t.lo);
        khi = fw_max64(khi, t.hi);
        if (bf16)
            for (int x = 0; x < dw; x++)
                kt->mm.pack_pairs(qt + (size_t)2 * x * M, 2 * x + 1 < d ? qt + (size_t)(2 * x + 1) * M : NULL,
                               M, QW + ((size_t)r * dw + x) * M);
    }
    if (!skip) {
        klo = 0;
        khi = sq->sk;
    }
    klo = fw_max64(klo, it->kb); /* a split item covers its range of keys only */
    khi = fw_min64(khi, it->ke);
    const int64_t es = (int64_t)fw_dtype_size(p->k->dtype);
    const int64_t kline = ((d - 1) * p->ks[2] + 1) * es, vline = ((dv - 1) * p->vs[2] + 1) * es;
    /* keys stored transposed, each channel's keys contiguous, every tile inside one page */
    const int BK = kt->bk;
    const int kcols = p->ks[0] == 1 && d > 1 && (!p->bt || p->page % BK == 0);
    /* bf16 products on contiguous bf16 key rows, not rotated: the rows are the K words */
    const int kraw = bf16 && !kcols && !p->rot_k && p->k->dtype == FW_BF16 && p->ks[2] == 1;
    /* and contiguous bf16 value rows go to pack_vw as they are (Vf holds them as bf16) */
    const int vraw = bf16 && p->v->dtype == FW_BF16 && p->vs[2] == 1;
    for (int64_t t0 = klo < khi ? klo / BK * BK : khi; t0 < khi; t0 += BK) {
        const int64_t t1 = fw_min64(sq->sk, t0 + BK);
        const int nk = (int)(t1 - t0);
        /* K and V rows of this tile, converted to f32 once for every q tile and head here;
         * keys stored transposed (vLLM's CPU cache) are transposed back a block at a time */
        if (kcols)
            kt->dec.cols_to_rows(fw_elem(p->k, fw_attn_key(p, sq, t0, 0) + kvh * p->ks[1]), p->k->dtype, p->ks[2], nk,
                             d, Kf);
        for (int j = 0; j < nk && p->tiles; j++) {
            /* FW_KV_TILES (bf16, d even, not rotated): rows copied out of their tiles, into the
             * K words and V rows directly with bf16 products, else through orow and to f32 */
            uint16_t *kr = bf16 ? (uint16_t *)(KW + (size_t)j * dw) : (uint16_t *)orow;
            uint16_t *vr = bf16 ? (uint16_t *)Vf + (size_t)j * dv : (uint16_t *)orow + d;
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
            uint16_t *kw = (uint16_t *)(KW + (size_t)j * dw);
            if (kraw) /* bf16 rows already are their words: copied, not converted twice */
                memcpy(kw, fw_elem(p->k, kr), (size_t)d * sizeof(uint16_t));
            else if (!kcols)
                kt->cvt.to_f32(fw_elem(p->k, kr), p->k->dtype, p->ks[2], d, 1.0f, Kf + (size_t)j * d);
            if (vraw)
                memcpy((uint16_t *)Vf + (size_t)j * dv, fw_elem(p->v, vr), (size_t)dv * sizeof(uint16_t));
            else
                kt->cvt.to_f32(fw_elem(p->v, vr), p->v->dtype, p->vs[2], dv, 1.0f, Vf + (size_t)j * dv);
            if (p->rot_k)
                fw_attn_rotate(p, kt, Kf + (size_t)j * d, t0 + j);
            if (bf16 && !kraw)
                kt->cvt.from_f32(Kf + (size_t)j * d, d, kw, FW_BF16, 1);
            if (bf16 && (d & 1))
                kw[d] = 0;
        }
        if (bf16)
            kt->mm.pack_vw(Vf, vraw ? FW_BF16 : FW_F32, nk, dv, VW);
        /* Ask for the next tile's K and V rows now: they arrive while this tile's products run.
         * Without it the conversion above waited on memory for 10% of the time of a 4K causal
         * bf16 prefill (1 thread; rows 2 KiB apart defeat the hardware prefetcher). */
        const int64_t tn = fw_min64(khi, t1 + BK);
        if (kcols && tn > t1) /* transposed keys: each channel's row of the next tile's keys */
            for (int64_t x = 0; x < d; x++) {
                const char *kr = fw_elem(p->k, fw_attn_key(p, sq, t1, 0) + kvh * p->ks[1] + x * p->ks[2]);
                for (int64_t b = 0; b < (tn - t1) * es; b += 64)
                    __builtin_prefetch(kr + b, 0, 2);
            }
        for (int64_t j = t1; j < tn && !p->tiles; j++) {
            const char *kr = fw_elem(p->k, fw_attn_key(p, sq, j, 0) + kvh * p->ks[1]);
            const char *vr = fw_elem(p->v, fw_attn_key(p, sq, j, 1) + kvh * p->vs[1]);
            for (int64_t b = 0; b < (kcols ? 0 : kline); b += 64)
                __builtin_prefetch(kr + b, 0, 2);
            for (int64_t b = 0; b < vline; b += 64)
                __builtin_prefetch(vr + b, 0, 2);
        }
        for (int r = 0; r < nt; r++) {
            const tile_keys *t = &tk[r];
            int boundary = 1;
            if (skip) {
                if (t->hi <= t->lo || t1 <= t->lo || t0 >= t->hi)
                    continue;
                boundary = !(t->clo <= t0 && t->chi >= t1);
            }
            const int64_t *rlo = RLO + r * M, *rhi = RHI + r * M;
            float *A_r = A + r * M, *L_r = L + r * M, *OT_r = OT + (size_t)r * dv * M;
            if (boundary)
                for (int m = 0; m < M; m++) {
                    lo[m] = (float)fw_max64(0, fw_min64(nk, rlo[m] - t0));
                    hi[m] = (float)fw_max64(0, fw_min64(nk, rhi[m] - t0));
                }
            for (int m = 0; m < M; m++)
                bias[m] = folded && A_r[m] != -INFINITY ? -A_r[m] : 0.0f;
            ops.QT = QT + (size_t)r * d * M;
            ops.QW = QW + (size_t)r * dw * M;
            tile_qk(c, &ops, nk, M, bias, ST);
            fw_softmax_args sa = {nk, M, ST, A_r, L_r, boundary ? lo : NULL, boundary ? hi : NULL,
                                  folded, online, OT_r, dv, pending};
            if (kt->attn.softmax(&sa)) {
                /* the static anchor's bound failed: replay this tile exactly, online */
                tile_qk(c, &ops, nk, M, zero, ST);
                sa.folded = 0;
                sa.online = 1;
                kt->attn.softmax(&sa);
            }
            tile_pv(c, &ops, nk, M, ST, OT_r);
        }
    }
    /* Normalise and store (or keep a split's partials); rows are gathered from OT's columns. */
    for (int r = 0; r < nt; r++)
        for (int g = 0; g < G; g++)
            for (int i = 0; i < bq && p0 + (int64_t)r * bq + i < p1; i++) {
                const int m = g * bq + i;
                const float *ot = OT + (size_t)r * dv * M + m;
                for (int j = 0; j < dv; j++)
                    orow[j] = ot[(size_t)j * M];
                if (it->part >= 0)
                    fw_attn_store_partial(c, it, m, orow, A[r * M + m], L[r * M + m]);
                else
                    fw_attn_store_row(c, sq, h0 + g, p0 + (int64_t)r * bq + i, orow, A[r * M + m],
                                      L[r * M + m]);
            }
}
