/* attn/decode.c: the decode kernel of one item: a decode-shaped sequence (fw_attn_is_decode)
 * over one key split, every K/V head together, with keys along the vector lanes. */
#include "run.h"

/* Element offsets of K and V rows t0 .. t1-1 (head 0), one page lookup per row; pages of a
 * size that is not a power of two are walked row by row from one division (measured, 4K
 * bf16 decode with 1152-token pages: a division per row cost 25% against 1024-token pages). */
static void key_offsets(const fw_attn_prob *p, const fw_attn_seq *sq, int64_t t0, int64_t t1,
                        int64_t *koff, int64_t *voff)
{
    if (p->bt && p->page_shift < 0) {
        const int32_t *row = p->bt + sq->index * p->bt_stride;
        int64_t pg = t0 / p->page, r = t0 - pg * p->page;
        for (int64_t j = t0; j < t1; j++) {
            koff[j - t0] = row[pg] * p->kpage + r * p->ks[0];
            voff[j - t0] = row[pg] * p->vpage + r * p->vs[0];
            if (++r == p->page) {
                r = 0;
                pg++;
            }
        }
        return;
    }
    for (int64_t j = t0; j < t1; j++) {
        koff[j - t0] = fw_attn_key(p, sq, j, 0);
        voff[j - t0] = fw_attn_key(p, sq, j, 1);
    }
}

/* Reads one byte of every cache line of the tile's token rows (the item's heads: span bytes
 * from element kbase / vbase of each row), K then V, in address order: sequential demand reads
 * the hardware streamers follow, so the per-head kernels after it find the tile in L2. */
static unsigned sweep_rows(const fw_attn_prob *p, const int64_t *koff, const int64_t *voff, int nk,
                           int64_t span, size_t es, int64_t kbase, int64_t vbase)
{
    unsigned acc = 0;
    const unsigned char *kb = (const unsigned char *)p->k->data + kbase * (int64_t)es;
    const unsigned char *vb = (const unsigned char *)p->v->data + vbase * (int64_t)es;
    for (int j = 0; j < nk; j++)
        for (int64_t b = 0; b < span; b += 64)
            acc += kb[koff[j] * (int64_t)es + b];
    for (int j = 0; j < nk; j++)
        for (int64_t b = 0; b < span; b += 64)
            acc += vb[voff[j] * (int64_t)es + b];
    return acc;
}

int fw_dec_fetch_krows(int native_bf16, int bf16_rows, int64_t row_bytes, uint32_t flags)
{
    return !(flags & FW_ATTN_NO_DEC_PREFETCH) && native_bf16 == FW_BF16_TILES && bf16_rows &&
           row_bytes >= FW_DEC_FETCH_ROW_BYTES;
}

/* What one decode item works with (fw_attn_decode_item): the call's and the item's shape,
 * the workspace's panels, how the cache is read (dec_access), and the key and value row
 * pointers carried from head to head. */
typedef struct {
    const run_ctx *c;
    const fw_attn_prob *p;
    const fw_kernels *kt;
    const fw_attn_seq *sq;
    int G, n, R, d, dv, dw, gqa, bf16;
    int64_t ua, ub, gu; /* the item's units [ua, ub), gu of them */
    float *Q, *O, *A, *L, *lo, *hi, *S, *Kt, *Vf, *qrow;
    uint32_t *QW, *KtW, *PW; /* bf16 products: query words in Q's place, key words in Kt's */
    int64_t vlo[FW_DEC_ROWS], vhi[FW_DEC_ROWS]; /* each row's visible keys */
    /* the access plan (dec_access) */
    int vdirect, fetch, kcols, bf16_rows, kin, vin, sweep, krows_fetch;
    size_t es;
    int64_t kline, vline, span, kbase, vbase, slice;
    /* element offsets of the rows of this tile (koff[cur]) and the next (koff[cur ^ 1]) */
    int64_t koff[2][FW_DEC_KEYS], voff[2][FW_DEC_KEYS];
    /* key and value row pointers of a head in a tile, two sets: a head's and the next's (the
     * next head's are its prefetch hint, then its rows: each set is computed once; 1K decode
     * on one thread 0.97x the time, f32 and bf16, Zen 4 VM, `flywheel ab`); held: the head
     * and tile start each set is for (-1: none) */
    const void *rowset[2][FW_DEC_KEYS], *vrowset[2][FW_DEC_KEYS];
    int64_t held[2][2];
    int ri;
} dec_item;

/* One 64-key tile [t0, t1) of the item: nk keys, nn in the next tile, nf of them prefetched
 * now; cur: which offset set is this tile's. */
typedef struct {
    int64_t t0, t1;
    int nk, nn, nf, cur;
} dec_tile;

/* The item's units and workspace panels. */
static void dec_setup(dec_item *D, const run_ctx *c, const item *it, const fw_attn_seq *sq, int tid)
{
    const fw_attn_prob *p = c->p;
    D->c = c;
    D->p = p;
    D->kt = c->kt;
    D->sq = sq;
    D->G = c->G;
    D->n = (int)sq->sq;
    D->R = D->G * D->n;
    D->d = (int)p->d;
    D->dv = (int)p->dv;
    D->dw = (D->d + 1) / 2;
    D->gqa = !(c->flags & FW_ATTN_NO_GQA_PACK);
    D->bf16 = p->bf16;
    const int64_t units = D->gqa ? p->hkv : p->hq, per = fw_ceil_div(units, it->chunk);
    D->ua = it->head * per;
    D->ub = fw_min64(units, D->ua + per);
    D->gu = D->ub - D->ua;
    char *w = c->ws + (size_t)tid * c->ws_stride;
    D->Q = (float *)(w + c->wl.dec);
    D->O = D->Q + (size_t)units * D->R * D->d;
    D->A = D->O + (size_t)units * D->R * D->dv;
    D->L = D->A + units * D->R;
    D->lo = (float *)(w + c->wl.vec);
    D->hi = D->lo + FW_DEC_ROWS;
    D->S = (float *)(w + c->wl.st);
    D->Kt = (float *)(w + c->wl.kf);
    D->Vf = (float *)(w + c->wl.vf);
    D->QW = (uint32_t *)D->Q;
    D->KtW = (uint32_t *)D->Kt;
    D->PW = (uint32_t *)(w + c->wl.pw);
    D->qrow = (float *)(w + c->wl.row);
    D->held[0][0] = D->held[0][1] = D->held[1][0] = D->held[1][1] = -1;
    D->ri = 0;
}

/* The score multiplier of unit u: the call's (scale, in log2 units), times an fp8 cache's K
 * descale of the unit's K/V head. */
static float dec_qscale(const dec_item *D, int64_t u)
{
    return D->c->qscale * fw_attn_descale(D->p, 0, D->sq->index, D->gqa ? u : u / D->p->G);
}

/* The item's query rows in Q (f32, scaled to log2 units) or QW (bf16 words), rotated where
 * the call has a rotary embedding; the running max, sum and output rows reset. */
static void dec_queries(dec_item *D)
{
    const fw_attn_prob *p = D->p;
    const fw_kernels *kt = D->kt;
    const int n = D->n, R = D->R, d = D->d;
    for (int64_t u = D->ua; u < D->ub; u++)
        for (int g = 0; g < D->G; g++)
            for (int i = 0; i < n; i++) {
                const int64_t r = u * R + g * n + i, h = D->gqa ? u * p->G + g : u;
                const char *src = fw_elem(p->q, D->sq->q0 + i * p->qs[0] + h * p->qs[1]);
                float *qf = D->bf16 ? D->qrow : D->Q + (size_t)r * d;
                kt->cvt.to_f32(src, p->q->dtype, p->qs[2], d, D->bf16 ? 1.0f : dec_qscale(D, u), qf);
                if (p->rcos)
                    fw_attn_rotate(p, kt, qf, fw_attn_qpos(p, D->sq, i));
                if (D->bf16)
                    kt->mm.pack_row_pairs(D->qrow, d, D->QW + (size_t)r * D->dw);
                D->A[r] = -INFINITY;
                D->L[r] = 0.0f;
            }
    memset(D->O + (size_t)D->ua * R * D->dv, 0, (size_t)(D->gu * R * D->dv) * sizeof(float));
}

/* Each row's visible keys (they depend on the position only: the same for every unit and
 * head), and the keys [*klo, *khi) the item reads: those some row sees (all with
 * FW_ATTN_NO_TILE_SKIP), within the item's split. */
static void dec_key_range(dec_item *D, const item *it, int64_t *klo, int64_t *khi)
{
    const fw_attn_seq *sq = D->sq;
    *klo = INT64_MAX;
    *khi = INT64_MIN;
    for (int g = 0; g < D->G; g++)
        for (int i = 0; i < D->n; i++) {
            const int r = g * D->n + i;
            fw_attn_visible(D->p, sq->sq, sq->sk, i, &D->vlo[r], &D->vhi[r]);
            if (D->vhi[r] > D->vlo[r]) {
                *klo = fw_min64(*klo, D->vlo[r]);
                *khi = fw_max64(*khi, D->vhi[r]);
            }
        }
    if (D->c->flags & FW_ATTN_NO_TILE_SKIP) {
        *klo = 0;
        *khi = sq->sk;
    }
    *klo = fw_max64(*klo, it->kb);
    *khi = fw_min64(*khi, it->ke);
}

/* How the item reads the cache: which rows the products read in place, what is prefetched
 * and how, whether each tile is swept in address order first. */
static void dec_access(dec_item *D)
{
    const fw_attn_prob *p = D->p;
    const run_ctx *c = D->c;
    const int64_t gu = D->gu, ua = D->ua;
    /* value rows are read in place when contiguous, else converted to f32 first */
    D->vdirect = p->vs[2] == 1;
    D->es = fw_dtype_size(p->k->dtype);
    const int64_t es = (int64_t)D->es;
    D->kline = p->d * p->ks[2] * es;
    D->vline = p->dv * p->vs[2] * es;
    /* bytes of one token's row over the item's heads (from element kbase / vbase of the row),
     * when the heads lie together in K and in V and every unit iterates once per token (else
     * 0: prefetch per head) */
    /* (the extent ends at the last element: with strided head dims, d * stride overshoots it,
     * and sweep_rows reads these bytes; found by fuzz/fuzz_attn.c) */
    const int64_t kspan = ((gu - 1) * p->ks[1] + (p->d - 1) * p->ks[2] + 1) * es;
    const int64_t vspan = ((gu - 1) * p->vs[1] + (p->dv - 1) * p->vs[2] + 1) * es;
    D->span = D->gqa && kspan == vspan && kspan <= 2 * gu * D->kline && p->ks[0] != 1 ? kspan : 0;
    D->kbase = D->gqa ? ua * p->ks[1] : 0;
    D->vbase = D->gqa ? ua * p->vs[1] : 0;
    /* The address-order sweep pays where the context streams from DRAM, and costs where it is
     * short. Measured on Zen 5 (bf16 / f32, GQA 32:8, d 128, one thread, best of 300): 1K context,
     * cache-hot 254 / 395 us with it, 215 / 321 without; cache-cold (16 rotating caches) 405-415
     * / 726-770 with, 386-398 / 762-778 without; 4K (2 threads, hot) 552 with, 476-481
     * without; 8K and 16K equal within the noise; 32K (an earlier, quiet measurement) 14.1
     * GB/s with it, 12.3 without. The next-tile prefetch (dec_prefetch_next) stays at every
     * length: without it, 1K hot was 6-8% faster, but cold 35% slower (514-524 us against
     * 383-388). On Intel both are off unless forced (fw_dec_prefetch has the measurements).
     * Where the products read K and V in place (kin, vin: below), the lines read next (the
     * next head's) are prefetched by the products themselves, each as they read the line at
     * the same offset of this head's, and the sweep is off: it gained nothing more (Zen 4, 2
     * threads, `flywheel ab` against the sweep: 16K and 32K 0.95-1.0x the time without it). */
    D->fetch = (c->flags & FW_ATTN_DEC_PREFETCH) && !p->tiles; /* run() set the CPU's default */
    /* keys stored transposed, each channel's keys contiguous (vLLM's CPU cache blocks), with
     * every 64-key tile inside one page: the panels come from those rows, and the next tile's
     * prefetch is per channel row */
    D->kcols = p->ks[0] == 1 && p->d > 1 && (!p->bt || p->page % FW_DEC_KEYS == 0);
    /* Interleaved prefetch (attn/attn_table.h, fw_dec_kernels): the key products read K in
     * place (kin) and the value products V (vin), except AMX's bf16 products, whose tile loads
     * take no hint. A tile followed by another is whole (nk = FW_DEC_KEYS), so kcols' f32
     * panel is then read in place. Measured against the bursts of prefetches of
     * dec_prefetch_next, which queue behind each other (Zen 4, 2 threads, GQA 32:8, d 128,
     * `flywheel ab`, the same bits): f32 1K 0.94x the time hot, 0.75x with 3 caches in
     * rotation (24 MiB), 0.66x with 24 (192 MiB, from DRAM), 4K 0.62x, batch 16 at 4K 0.69x;
     * vLLM's vec layout (keys transposed) 0.75-0.87x; bf16 from DRAM 0.61x, batch 16 at 4K
     * 0.67x, 32K 0.90x, but 1K-4K hot 1.02-1.05x (bf16 products read twice the elements per
     * load, so the prefetches weigh more there). Bursts for the keys or the values alone were
     * slower than both together.
     * The rows prefetched are the next K/V head's (dec_unit_rows): one head-tile ahead. A whole
     * tile ahead (every head's next tile: 512 KiB of f32 K and V at GQA 32:8, d 128, half of
     * this L2) lost lines before their use; against it (Zen 4, `flywheel ab`, the same bits):
     * f32 1K hot 0.95x the time (1 thread 0.89x), 3 caches 0.80x, 24 caches 0.98x, 32K
     * 0.91x, batch 16 at 4K 0.90x; bf16 1K hot 0.99x, 3 caches 0.98x, 32K 0.94x, from DRAM
     * and batch 16 at 4K level; vLLM's vec layout level. */
    /* bf16 products on bf16 key rows, or an fp8 cache's (read as their bf16) */
    D->bf16_rows = D->bf16 && (p->k->dtype == FW_BF16 || fw_is_f8(p->k->dtype)) && p->ks[2] == 1;
    const int hint = !(D->bf16 && D->kt->native_bf16 == FW_BF16_TILES);
    D->kin = hint && (D->bf16 ? D->bf16_rows : D->kcols ? p->k->dtype == FW_F32 : p->ks[2] == 1);
    D->vin = hint && D->vdirect;
    D->sweep = D->fetch && D->span && D->sq->sk > FW_DEC_SWEEP_KEYS && !(D->kin && D->vin);
    /* (the next head's key rows are prefetched in dec_unit_rows) */
    D->krows_fetch = fw_dec_fetch_krows(D->kt->native_bf16, D->bf16_rows, p->ks[0] * es, c->flags);
    /* a token row in `gu` slices of whole cache lines (no division in the key loop) */
    D->slice = ((D->span + gu - 1) / gu + 63) & ~(int64_t)63;
}

/* Unit u over a tile of a FW_KV_TILES cache: bf16 products take the key and value groups
 * where they lie; f32 products copy the tile's rows out first, then run as on bf16 rows. */
static void dec_unit_tiles(dec_item *D, const dec_tile *T, int64_t u)
{
    const fw_attn_prob *p = D->p;
    const fw_kernels *kt = D->kt;
    const int R = D->R, d = D->d, dv = D->dv, nk = T->nk;
    const int64_t kvh = D->gqa ? u : u / p->G;
    float *Ou = D->O + (size_t)u * R * dv;
    const uint16_t *kg[FW_DEC_KEYS / 16], *vg[FW_DEC_KEYS / 32];
    const void **rows = D->rowset[0], **vrows = D->vrowset[0];
    if (D->bf16) {
        for (int i = 0; 16 * i < nk; i++)
            kg[i] = (const uint16_t *)p->k->data + fw_attn_tile_elem(p, D->sq, T->t0 + 16 * i, kvh, 0, 0);
        for (int i = 0; 32 * i < nk; i++)
            vg[i] = (const uint16_t *)p->v->data + fw_attn_tile_elem(p, D->sq, T->t0 + 32 * i, kvh, 0, 1);
        kt->dec.qk_tiles_bf16(R, nk, d, D->QW + (size_t)u * R * D->dw, kg, D->c->qscale, D->S);
    } else {
        uint16_t *kr = (uint16_t *)D->Kt, *vr = (uint16_t *)D->Vf;
        fw_attn_tile_rows_out(p, D->sq, T->t0, nk, kvh, 0, kr);
        fw_attn_tile_rows_out(p, D->sq, T->t0, nk, kvh, 1, vr);
        for (int j = 0; j < nk; j++) {
            rows[j] = kr + (size_t)j * d;
            vrows[j] = vr + (size_t)j * dv;
        }
        kt->dec.qk_rows(R, nk, d, D->Q + (size_t)u * R * d, rows, FW_BF16, NULL, 0, D->S);
    }
    if (D->c->cap2 > 0.0f)
        kt->attn.softcap(R, FW_DEC_KEYS, D->S, D->c->cap2);
    kt->dec.softmax(R, nk, D->S, D->lo, D->hi, D->A + u * R, D->L + u * R, Ou, dv);
    if (D->bf16)
        kt->dec.pv_tiles_bf16(R, nk, dv, D->S, vg, 16 * p->page, D->PW, Ou);
    else
        kt->dec.pv(R, nk, dv, D->S, vrows, FW_BF16, NULL, 0, Ou);
}

/* The K/V row pointers of head kvh in the tile: the set the previous head prefetched when it
 * is this one, else a new one. Returns its index in rowset / vrowset. */
static int dec_rows_of(dec_item *D, const dec_tile *T, int64_t kvh, const char *kb, const char *vb)
{
    int ri = D->ri;
    if (D->held[ri][0] != kvh || D->held[ri][1] != T->t0) {
        if (D->held[ri ^ 1][0] == kvh && D->held[ri ^ 1][1] == T->t0) {
            ri ^= 1; /* the rows the previous head prefetched */
        } else {
            for (int j = 0; j < T->nk; j++) {
                D->rowset[ri][j] = kb + D->koff[T->cur][j] * (int64_t)D->es;
                D->vrowset[ri][j] = vb + D->voff[T->cur][j] * (int64_t)D->es;
            }
            D->held[ri][0] = kvh;
            D->held[ri][1] = T->t0;
        }
    }
    return D->ri = ri;
}

/* A steady stream of prefetches for the next tile, in address order, over unit u's key
 * iterations: iteration (u, j) takes slice u of token row j (all heads' K, then V) when the
 * heads of a token lie together, else this head's row j (from kb, vb), the keys unless the
 * products prefetch them (kil), the values unless vil. Measured (one thread, 32K keys): 10.9
 * GB/s prefetching per head, 12.0 GB/s with the whole next tile in one burst. */
static void dec_prefetch_next(const dec_item *D, const dec_tile *T, int64_t u, const char *kb,
                              const char *vb, int pf, int kil, int vil)
{
    const fw_attn_prob *p = D->p;
    const int64_t es = (int64_t)D->es, gu = D->gu, nn = T->nn;
    const int64_t *koff = D->koff[T->cur ^ 1], *voff = D->voff[T->cur ^ 1];
    /* iteration (u, j) is number u * nk + j of the tile: token row tt, slice part */
    int64_t tt = D->span ? (u - D->ua) * T->nk / gu : 0, part = D->span ? (u - D->ua) * T->nk % gu : 0;
    for (int j = 0; j < T->nf && !(kil && vil); j++) {
        if (D->span) {
            if (tt < nn) {
                const int64_t b0 = part * D->slice, b1 = fw_min64(D->span, b0 + D->slice);
                const char *kr = (const char *)p->k->data + (koff[tt] + D->kbase) * es;
                const char *vr = (const char *)p->v->data + (voff[tt] + D->vbase) * es;
                for (int64_t b = b0; b < b1; b += 64) {
                    __builtin_prefetch(kr + b, 0, 2);
                    __builtin_prefetch(vr + b, 0, 2);
                }
            }
            if (++part == gu) {
                part = 0;
                tt++;
            }
        } else if (pf) {
            if (D->kcols && !kil) /* channel rows j, j + nn, ...: the next tile's keys of each */
                for (int64_t x = j; x < p->d; x += nn)
                    for (int64_t b = 0; b < nn * es; b += 64)
                        __builtin_prefetch(kb + (koff[0] + x * p->ks[2]) * es + b, 0, 2);
            else if (!kil)
                for (int64_t b = 0; b < D->kline; b += 64)
                    __builtin_prefetch(kb + koff[j] * es + b, 0, 2);
            for (int64_t b = 0; b < D->vline && !vil; b += 64)
                __builtin_prefetch(vb + voff[j] * es + b, 0, 2);
        }
    }
}

/* S = unit u's scores against the tile's keys (rows), the next head's rows nrows (nx of
 * them) handed to the products that prefetch (kil). Contiguous key rows are read in place
 * (bf16 products: bf16 rows, which already are their pairs); the rest go through a
 * transposed panel. */
static void dec_scores(const dec_item *D, const dec_tile *T, int64_t u, const void **rows,
                       const void **nrows, int nx, int kil)
{
    const fw_attn_prob *p = D->p;
    const fw_kernels *kt = D->kt;
    const int R = D->R, d = D->d, dw = D->dw, nk = T->nk;
    const float *Qu = D->Q + (size_t)u * R * d;
    const uint32_t *QWu = D->QW + (size_t)u * R * dw;
    const float qscale = dec_qscale(D, u);
    if (D->bf16_rows) {
        kt->dec.qk_rows_bf16(R, nk, d, QWu, rows, p->k->dtype, qscale, kil ? nrows : NULL, nx, D->S);
    } else if (D->kcols) {
        if (D->bf16) {
            kt->dec.pack_kt_cols_bf16(rows[0], p->k->dtype, p->ks[2], nk, d, D->KtW);
            kt->dec.qk_bf16(R, nk, dw, QWu, D->KtW, qscale, D->S);
        } else if (p->k->dtype == FW_F32 && (p->bt || nk == FW_DEC_KEYS)) {
            /* f32 rows are the panel itself (a page holds whole tiles, junk keys past nk
             * included, which the softmax's bounds drop) */
            kt->dec.qk(R, nk, d, Qu, (const float *)rows[0], p->ks[2], kil ? (const float *)nrows[0] : NULL,
                       D->S);
        } else {
            kt->dec.pack_kt_cols(rows[0], p->k->dtype, p->ks[2], nk, d, D->Kt);
            kt->dec.qk(R, nk, d, Qu, D->Kt, FW_DEC_KEYS, NULL, D->S);
        }
    } else if (D->bf16) {
        kt->dec.pack_kt_bf16(rows, p->k->dtype, p->ks[2], nk, d, D->KtW);
        kt->dec.qk_bf16(R, nk, dw, QWu, D->KtW, qscale, D->S);
    } else if (p->ks[2] == 1) {
        kt->dec.qk_rows(R, nk, d, Qu, rows, p->k->dtype, kil ? nrows : NULL, nx, D->S);
    } else {
        kt->dec.pack_kt(rows, p->k->dtype, p->ks[2], nk, d, D->Kt);
        kt->dec.qk(R, nk, d, Qu, D->Kt, FW_DEC_KEYS, NULL, D->S);
    }
}

/* Unit u over the tile, rows read where they lie in the cache. */
static void dec_unit_rows(dec_item *D, const dec_tile *T, int64_t u)
{
    const fw_attn_prob *p = D->p;
    const fw_kernels *kt = D->kt;
    const int R = D->R, dv = D->dv, nk = T->nk;
    const int64_t es = (int64_t)D->es, ua = D->ua, ub = D->ub;
    const int64_t kvh = D->gqa ? u : u / p->G;
    const char *kb = fw_elem(p->k, kvh * p->ks[1]), *vb = fw_elem(p->v, kvh * p->vs[1]);
    const int pf = D->gqa || u % p->G == 0;
    /* The products prefetch the keys (kil) and values (vil) the next K/V head reads, as
     * they read this one's: the next head's in this tile, after the item's last head
     * the first head's in the next tile (nx rows); dec_prefetch_next fetches the next
     * tile's rest. */
    const int more = D->gqa ? u + 1 < ub : (kvh + 1) * p->G < ub;
    const int64_t xh = more ? kvh + 1 : D->gqa ? ua : ua / p->G;
    const char *xkb = fw_elem(p->k, xh * p->ks[1]), *xvb = fw_elem(p->v, xh * p->vs[1]);
    const int64_t *xko = D->koff[more ? T->cur : T->cur ^ 1], *xvo = D->voff[more ? T->cur : T->cur ^ 1];
    const int nx = more ? nk : T->nn;
    const int kil = D->fetch && nx > 0 && pf && D->kin, vil = D->fetch && nx > 0 && pf && D->vin;
    const int ri = dec_rows_of(D, T, kvh, kb, vb);
    const void **rows = D->rowset[ri], **vrows = D->vrowset[ri];
    const void **nrows = D->rowset[ri ^ 1], **nvrows = D->vrowset[ri ^ 1];
    if (kil || vil) {
        for (int j = 0; j < nx; j++) {
            nrows[j] = xkb + xko[j] * es;
            nvrows[j] = xvb + xvo[j] * es;
        }
        /* (the next tile's rows are whole where its keys are as many as prefetched) */
        const int whole = more || nx == fw_min64(D->sq->sk, T->t1 + FW_DEC_KEYS) - T->t1;
        D->held[ri ^ 1][0] = whole ? xh : -1;
        D->held[ri ^ 1][1] = more ? T->t0 : T->t1;
    }
    dec_prefetch_next(D, T, u, kb, vb, pf, kil, vil);
    for (int j = 0; j < nk && !D->vdirect; j++) {
        kt->cvt.to_f32(vrows[j], p->v->dtype, p->vs[2], dv, 1.0f, D->Vf + (size_t)j * dv);
        vrows[j] = D->Vf + (size_t)j * dv;
    }
    if (!D->vdirect) /* (vrows now point at the converted copy) */
        D->held[ri][0] = -1;
    /* AMX products read key rows with tile loads, which wait out their cache misses
     * alone: the next K/V head's key rows of the tile go to L2 before this head's
     * products. Measured on an Intel Xeon VM with AMX, bf16, 2 threads, against
     * FW_ATTN_NO_DEC_PREFETCH: GQA 32:8, d 128 (2 KiB a token): 1K decode 150-155 ->
     * 130-140 us, batch 16 at 4K 22.2 -> 15.6 ms; d 256 (4 KiB) at 2K 697-706 ->
     * 655-670 us. With 1 KiB a token (GQA 16:2 d 256, 16:4 d 128, at 4K) 3-5% slower:
     * four tokens to a 4 KiB page, which the L2 streamer follows, hence the threshold.
     * Slower too: adding the value rows (either head's), the first head's rows of the
     * next tile after the last head, the same prefetch before f32 or vdpbf16ps
     * products. */
    const int64_t nkvh = D->gqa ? u + 1 : (u + 1) / p->G;
    if (D->krows_fetch && u + 1 < ub && nkvh != kvh) {
        const char *kn = fw_elem(p->k, nkvh * p->ks[1]);
        for (int j = 0; j < nk; j++)
            for (int64_t b = 0; b < D->kline; b += 64)
                __builtin_prefetch(kn + D->koff[T->cur][j] * es + b, 0, 2);
    }
    float *Ou = D->O + (size_t)u * R * dv;
    dec_scores(D, T, u, rows, nrows, nx, kil);
    /* (the key vectors the products wrote: dec.qk leaves the rest of S unset, which
     * the softmax never reads; MemorySanitizer over the fuzz corpora) */
    for (int r = 0; r < R && D->c->cap2 > 0.0f; r++)
        kt->attn.softcap(1, (nk + kt->vl - 1) / kt->vl * kt->vl, D->S + (size_t)r * FW_DEC_KEYS, D->c->cap2);
    kt->dec.softmax(R, nk, D->S, D->lo, D->hi, D->A + u * R, D->L + u * R, Ou, dv);
    const fw_dtype vdt = D->vdirect ? p->v->dtype : FW_F32;
    if (D->bf16)
        kt->dec.pv_bf16(R, nk, dv, D->S, vrows, vdt, vil ? nvrows : NULL, nx, D->PW, Ou);
    else
        kt->dec.pv(R, nk, dv, D->S, vrows, vdt, vil ? nvrows : NULL, nx, Ou);
}

/* Each output row normalized and stored, or the partials of a split stored for the merge. */
static void dec_store(const dec_item *D, const item *it)
{
    const int n = D->n, R = D->R, dv = D->dv;
    for (int64_t u = D->ua; u < D->ub; u++)
        for (int g = 0; g < D->G; g++)
            for (int i = 0; i < n; i++) {
                const int64_t r = u * R + g * n + i;
                if (it->part >= 0)
                    fw_attn_store_partial(D->c, it, (int)r, D->O + (size_t)r * dv, D->A[r], D->L[r]);
                else
                    fw_attn_store_row(D->c, D->sq, D->gqa ? u * D->p->G + g : u, i, D->O + (size_t)r * dv,
                                      D->A[r], D->L[r]);
            }
}

/* Decode path: K/V groups ("units": K/V heads, or q heads without GQA packing) [ua, ub) of
 * one sequence, group it->head of the it->chunk its units are spread over (fw_attn_dec_groups;
 * usually one: all of them), over the item's key range, with keys along the vector lanes. Each
 * 64-key tile is taken for all the item's units before the next, so every token row of the
 * cache (the item's heads of it) is read once, front to back, while it is in cache; the next
 * tile is prefetched meanwhile, except on Intel (fw_dec_prefetch: there the L2 streamer does
 * better alone). A unit holds R = G x n rows, row r = g * n + i (as in a q tile with bq = n).
 * Measured on Zen 5 (bf16, GQA 32:8, d 128, 32K keys, K/V GB/s on 1 / 2 threads): one head
 * per item 3.8 / 7.5; all heads per item 7.2 / 16.0; + V read in place and a steady next-tile
 * prefetch 12.3 / 22.2; + the address-order sweep of each tile 14.1 / 25.7 (sweeping the
 * next tile's slices between heads instead: 12.6 / 23.4; sweep without prefetch: 12.2 / 23.0).
 * The rest is compute: G = 4 rows give 4 FMAs per element, and the K transpose is a third of
 * the time. */
void fw_attn_decode_item(const run_ctx *c, const item *it, const fw_attn_seq *sq, int tid)
{
    dec_item D;
    dec_setup(&D, c, it, sq, tid);
    dec_queries(&D);
    int64_t klo, khi;
    dec_key_range(&D, it, &klo, &khi);
    dec_access(&D);
    const fw_attn_prob *p = c->p;
    unsigned touch = 0;
    const int64_t tfirst = klo < khi ? klo / FW_DEC_KEYS * FW_DEC_KEYS : khi;
    if (tfirst < khi && !p->tiles) /* (FW_KV_TILES: the groups are found per tile) */
        key_offsets(p, sq, tfirst, fw_min64(sq->sk, tfirst + FW_DEC_KEYS), D.koff[0], D.voff[0]);
    for (int64_t t0 = tfirst, cur = 0; t0 < khi; t0 += FW_DEC_KEYS, cur ^= 1) {
        dec_tile T;
        T.t0 = t0;
        T.t1 = fw_min64(sq->sk, t0 + FW_DEC_KEYS);
        const int64_t tn = fw_min64(khi, T.t1 + FW_DEC_KEYS);
        T.nk = (int)(T.t1 - t0);
        T.nn = (int)fw_max64(0, tn - T.t1);
        T.nf = D.fetch ? T.nn : 0;
        T.cur = (int)cur;
        if (T.nn > 0 && !p->tiles)
            key_offsets(p, sq, T.t1, tn, D.koff[cur ^ 1], D.voff[cur ^ 1]);
        for (int r = 0; r < D.R; r++) {
            D.lo[r] = (float)fw_max64(0, fw_min64(T.nk, D.vlo[r] - t0));
            D.hi[r] = D.vhi[r] > D.vlo[r] ? (float)fw_max64(0, fw_min64(T.nk, D.vhi[r] - t0)) : 0.0f;
        }
        if (D.sweep)
            touch += sweep_rows(p, D.koff[cur], D.voff[cur], T.nk, D.span, D.es, D.kbase, D.vbase);
        for (int64_t u = D.ua; u < D.ub; u++) {
            if (p->tiles)
                dec_unit_tiles(&D, &T, u);
            else
                dec_unit_rows(&D, &T, u);
        }
    }
    c->sink[tid * 16] += touch;
    dec_store(&D, it);
}
