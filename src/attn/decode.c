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
    const fw_attn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    const int G = c->G, n = (int)sq->sq, R = G * n, d = (int)p->d, dv = (int)p->dv;
    const int gqa = !(c->flags & FW_ATTN_NO_GQA_PACK);
    const int64_t units = gqa ? p->hkv : p->hq;
    const int64_t per = fw_ceil_div(units, it->chunk), ua = it->head * per;
    const int64_t ub = fw_min64(units, ua + per), gu = ub - ua;
    const int skip = !(c->flags & FW_ATTN_NO_TILE_SKIP);
    char *w = c->ws + (size_t)tid * c->ws_stride;
    float *Q = (float *)(w + c->wl.dec), *O = Q + (size_t)units * R * d;
    float *A = O + (size_t)units * R * dv, *L = A + units * R;
    float *lo = (float *)(w + c->wl.vec), *hi = lo + FW_DEC_ROWS;
    float *S = (float *)(w + c->wl.st), *Kt = (float *)(w + c->wl.kf), *Vf = (float *)(w + c->wl.vf);
    /* bf16 products: query words in Q's place, key words in Kt's, P words in the P panel */
    const int bf16 = p->bf16, dw = (d + 1) / 2;
    uint32_t *QW = (uint32_t *)Q, *KtW = (uint32_t *)Kt, *PW = (uint32_t *)(w + c->wl.pw);
    float *qrow = (float *)(w + c->wl.row);
    int64_t vlo[FW_DEC_ROWS], vhi[FW_DEC_ROWS], klo = INT64_MAX, khi = INT64_MIN;
    /* key and value row pointers of a head in a tile, two sets: a head's and the next's (the
     * next head's are its prefetch hint, then its rows: each set is computed once; 1K decode
     * on one thread 0.97x the time, f32 and bf16, Zen 4 VM, `flywheel ab`); held: the head
     * and tile start each set is for (-1: none) */
    const void *rowset[2][FW_DEC_KEYS], *vrowset[2][FW_DEC_KEYS];
    int64_t held[2][2] = {{-1, -1}, {-1, -1}};
    int ri = 0;
    for (int64_t u = ua; u < ub; u++)
        for (int g = 0; g < G; g++)
            for (int i = 0; i < n; i++) {
                const int64_t r = u * R + g * n + i, h = gqa ? u * p->G + g : u;
                const char *src = fw_elem(p->q, sq->q0 + i * p->qs[0] + h * p->qs[1]);
                float *qf = bf16 ? qrow : Q + (size_t)r * d;
                kt->cvt.to_f32(src, p->q->dtype, p->qs[2], d, bf16 ? 1.0f : c->qscale, qf);
                if (p->rcos)
                    fw_attn_rotate(p, kt, qf, fw_attn_qpos(p, sq, i));
                if (bf16)
                    kt->mm.pack_row_pairs(qrow, d, QW + (size_t)r * dw);
                A[r] = -INFINITY;
                L[r] = 0.0f;
            }
    memset(O + (size_t)ua * R * dv, 0, (size_t)(gu * R * dv) * sizeof(float));
    /* visible keys depend on the position only: the same for every unit and head */
    for (int g = 0; g < G; g++)
        for (int i = 0; i < n; i++) {
            const int r = g * n + i;
            fw_attn_visible(p, sq->sq, sq->sk, i, &vlo[r], &vhi[r]);
            if (vhi[r] > vlo[r]) {
                klo = fw_min64(klo, vlo[r]);
                khi = fw_max64(khi, vhi[r]);
            }
        }
    if (!skip) {
        klo = 0;
        khi = sq->sk;
    }
    klo = fw_max64(klo, it->kb);
    khi = fw_min64(khi, it->ke);
    /* value rows are read in place when contiguous, else converted to f32 first */
    const int vdirect = p->vs[2] == 1;
    const size_t es = fw_dtype_size(p->k->dtype);
    const int64_t kline = p->d * p->ks[2] * (int64_t)es, vline = p->dv * p->vs[2] * (int64_t)es;
    /* bytes of one token's row over the item's heads (from element kbase / vbase of the row),
     * when the heads lie together in K and in V and every unit iterates once per token (else
     * 0: prefetch per head) */
    /* (the extent ends at the last element: with strided head dims, d * stride overshoots it,
     * and sweep_rows reads these bytes; found by fuzz/fuzz_attn.c) */
    const int64_t kspan = ((gu - 1) * p->ks[1] + (p->d - 1) * p->ks[2] + 1) * (int64_t)es;
    const int64_t vspan = ((gu - 1) * p->vs[1] + (p->dv - 1) * p->vs[2] + 1) * (int64_t)es;
    const int64_t span = gqa && kspan == vspan && kspan <= 2 * gu * kline && p->ks[0] != 1 ? kspan : 0;
    const int64_t kbase = gqa ? ua * p->ks[1] : 0, vbase = gqa ? ua * p->vs[1] : 0;
    /* The address-order sweep pays where the context streams from DRAM, and costs where it is
     * short. Measured on Zen 5 (bf16 / f32, GQA 32:8, d 128, one thread, best of 300): 1K context,
     * cache-hot 254 / 395 us with it, 215 / 321 without; cache-cold (16 rotating caches) 405-415
     * / 726-770 with, 386-398 / 762-778 without; 4K (2 threads, hot) 552 with, 476-481
     * without; 8K and 16K equal within the noise; 32K (an earlier, quiet measurement) 14.1
     * GB/s with it, 12.3 without. The next-tile prefetch below stays at every length: without
     * it, 1K hot was 6-8% faster, but cold 35% slower (514-524 us against 383-388). On Intel
     * both are off unless forced (fw_dec_prefetch has the measurements).
     * Where the products read K and V in place (kin, vin: below), the lines read next (the
     * next head's) are prefetched by the products themselves, each as they read the line at
     * the same offset of this head's, and the sweep is off: it gained nothing more (Zen 4, 2
     * threads, `flywheel ab` against the sweep: 16K and 32K 0.95-1.0x the time without it). */
    const int fetch = (c->flags & FW_ATTN_DEC_PREFETCH) && !p->tiles; /* run() set the CPU's default */
    /* keys stored transposed, each channel's keys contiguous (vLLM's CPU cache blocks), with
     * every 64-key tile inside one page: the panels come from those rows, and the next tile's
     * prefetch is per channel row */
    const int kcols = p->ks[0] == 1 && p->d > 1 && (!p->bt || p->page % FW_DEC_KEYS == 0);
    /* Interleaved prefetch (fw_kernels, "Interleaved prefetch"): the key products read K in
     * place (kin) and the value products V (vin), except AMX's bf16 products, whose tile loads
     * take no hint. A tile followed by another is whole (nk = FW_DEC_KEYS), so kcols' f32
     * panel is then read in place. Measured against the bursts of prefetches below, which
     * queue behind each other (Zen 4, 2 threads, GQA 32:8, d 128, `flywheel ab`, the same
     * bits): f32 1K 0.94x the time hot, 0.75x with 3 caches in rotation (24 MiB), 0.66x with
     * 24 (192 MiB, from DRAM), 4K 0.62x, batch 16 at 4K 0.69x; vLLM's vec layout (keys
     * transposed) 0.75-0.87x; bf16 from DRAM 0.61x, batch 16 at 4K 0.67x, 32K 0.90x, but 1K-4K
     * hot 1.02-1.05x (bf16 products read twice the elements per load, so the prefetches weigh
     * more there). Bursts for the keys or the values alone were slower than both together.
     * The rows prefetched are the next K/V head's (below): one head-tile ahead. A whole tile
     * ahead (every head's next tile: 512 KiB of f32 K and V at GQA 32:8, d 128, half of
     * this L2) lost lines before their use; against it (Zen 4, `flywheel ab`, the same bits):
     * f32 1K hot 0.95x the time (1 thread 0.89x), 3 caches 0.80x, 24 caches 0.98x, 32K
     * 0.91x, batch 16 at 4K 0.90x; bf16 1K hot 0.99x, 3 caches 0.98x, 32K 0.94x, from DRAM
     * and batch 16 at 4K level; vLLM's vec layout level. */
    const int bf16_rows = bf16 && p->k->dtype == FW_BF16 && p->ks[2] == 1; /* bf16 products on bf16 key rows */
    const int hint = !(bf16 && kt->native_bf16 == FW_BF16_TILES);
    const int kin = hint && (bf16 ? bf16_rows : kcols ? p->k->dtype == FW_F32 : p->ks[2] == 1);
    const int vin = hint && vdirect;
    const int sweep = fetch && span && sq->sk > FW_DEC_SWEEP_KEYS && !(kin && vin);
    /* (the next head's key rows are prefetched below) */
    const int krows_fetch = fw_dec_fetch_krows(kt->native_bf16, bf16_rows, p->ks[0] * (int64_t)es, c->flags);
    /* a token row in `gu` slices of whole cache lines (no division in the key loop) */
    const int64_t slice = ((span + gu - 1) / gu + 63) & ~(int64_t)63;
    int64_t koff[2][FW_DEC_KEYS], voff[2][FW_DEC_KEYS];
    unsigned touch = 0;
    const int64_t tfirst = klo < khi ? klo / FW_DEC_KEYS * FW_DEC_KEYS : khi;
    if (tfirst < khi && !p->tiles) /* (FW_KV_TILES: the groups are found per tile, below) */
        key_offsets(p, sq, tfirst, fw_min64(sq->sk, tfirst + FW_DEC_KEYS), koff[0], voff[0]);
    for (int64_t t0 = tfirst, cur = 0; t0 < khi; t0 += FW_DEC_KEYS, cur ^= 1) {
        const int64_t t1 = fw_min64(sq->sk, t0 + FW_DEC_KEYS), tn = fw_min64(khi, t1 + FW_DEC_KEYS);
        /* nn keys in the next tile, nf of them prefetched now */
        const int nk = (int)(t1 - t0), nn = (int)fw_max64(0, tn - t1), nf = fetch ? nn : 0;
        if (nn > 0 && !p->tiles)
            key_offsets(p, sq, t1, tn, koff[cur ^ 1], voff[cur ^ 1]);
        for (int r = 0; r < R; r++) {
            lo[r] = (float)fw_max64(0, fw_min64(nk, vlo[r] - t0));
            hi[r] = vhi[r] > vlo[r] ? (float)fw_max64(0, fw_min64(nk, vhi[r] - t0)) : 0.0f;
        }
        if (sweep)
            touch += sweep_rows(p, koff[cur], voff[cur], nk, span, es, kbase, vbase);
        for (int64_t u = ua; u < ub && p->tiles; u++) {
            /* FW_KV_TILES: bf16 products take the key and value groups where they lie; f32
             * products copy the tile's rows out first, then run as on bf16 rows */
            const int64_t kvh = gqa ? u : u / p->G;
            float *Ou = O + (size_t)u * R * dv;
            const uint16_t *kg[FW_DEC_KEYS / 16], *vg[FW_DEC_KEYS / 32];
            const void **rows = rowset[0], **vrows = vrowset[0];
            if (bf16) {
                for (int i = 0; 16 * i < nk; i++)
                    kg[i] = (const uint16_t *)p->k->data + fw_attn_tile_elem(p, sq, t0 + 16 * i, kvh, 0, 0);
                for (int i = 0; 32 * i < nk; i++)
                    vg[i] = (const uint16_t *)p->v->data + fw_attn_tile_elem(p, sq, t0 + 32 * i, kvh, 0, 1);
                kt->dec.qk_tiles_bf16(R, nk, d, QW + (size_t)u * R * dw, kg, c->qscale, S);
            } else {
                uint16_t *kr = (uint16_t *)Kt, *vr = (uint16_t *)Vf;
                fw_attn_tile_rows_out(p, sq, t0, nk, kvh, 0, kr);
                fw_attn_tile_rows_out(p, sq, t0, nk, kvh, 1, vr);
                for (int j = 0; j < nk; j++) {
                    rows[j] = kr + (size_t)j * d;
                    vrows[j] = vr + (size_t)j * dv;
                }
                kt->dec.qk_rows(R, nk, d, Q + (size_t)u * R * d, rows, FW_BF16, NULL, 0, S);
            }
            if (c->cap2 > 0.0f)
                kt->attn.softcap(R, FW_DEC_KEYS, S, c->cap2);
            kt->dec.softmax(R, nk, S, lo, hi, A + u * R, L + u * R, Ou, dv);
            if (bf16)
                kt->dec.pv_tiles_bf16(R, nk, dv, S, vg, 16 * p->page, PW, Ou);
            else
                kt->dec.pv(R, nk, dv, S, vrows, FW_BF16, NULL, 0, Ou);
        }
        for (int64_t u = ua; u < ub && !p->tiles; u++) {
            const int64_t kvh = gqa ? u : u / p->G;
            const char *kb = fw_elem(p->k, kvh * p->ks[1]), *vb = fw_elem(p->v, kvh * p->vs[1]);
            const int pf = gqa || u % p->G == 0;
            /* The products prefetch the keys (kil) and values (vil) the next K/V head reads, as
             * they read this one's: the next head's in this tile, after the item's last head
             * the first head's in the next tile (nx rows); the bursts below fetch the next
             * tile's rest. */
            const int more = gqa ? u + 1 < ub : (kvh + 1) * p->G < ub;
            const int64_t xh = more ? kvh + 1 : gqa ? ua : ua / p->G;
            const char *xkb = fw_elem(p->k, xh * p->ks[1]), *xvb = fw_elem(p->v, xh * p->vs[1]);
            const int64_t *xko = koff[more ? cur : cur ^ 1], *xvo = voff[more ? cur : cur ^ 1];
            const int nx = more ? nk : nn;
            const int kil = fetch && nx > 0 && pf && kin, vil = fetch && nx > 0 && pf && vin;
            if (held[ri][0] != kvh || held[ri][1] != t0) {
                if (held[ri ^ 1][0] == kvh && held[ri ^ 1][1] == t0) {
                    ri ^= 1; /* the rows the previous head prefetched */
                } else {
                    for (int j = 0; j < nk; j++) {
                        rowset[ri][j] = kb + koff[cur][j] * (int64_t)es;
                        vrowset[ri][j] = vb + voff[cur][j] * (int64_t)es;
                    }
                    held[ri][0] = kvh;
                    held[ri][1] = t0;
                }
            }
            const void **rows = rowset[ri], **vrows = vrowset[ri];
            const void **nrows = rowset[ri ^ 1], **nvrows = vrowset[ri ^ 1];
            if (kil || vil) {
                for (int j = 0; j < nx; j++) {
                    nrows[j] = xkb + xko[j] * (int64_t)es;
                    nvrows[j] = xvb + xvo[j] * (int64_t)es;
                }
                /* (the next tile's rows are whole where its keys are as many as prefetched) */
                const int whole = more || nx == fw_min64(sq->sk, t1 + FW_DEC_KEYS) - t1;
                held[ri ^ 1][0] = whole ? xh : -1;
                held[ri ^ 1][1] = more ? t0 : t1;
            }
            /* iteration (u, j) is number u * nk + j of the tile: token row tt, slice part */
            int64_t tt = span ? (u - ua) * nk / gu : 0, part = span ? (u - ua) * nk % gu : 0;
            for (int j = 0; j < nf && !(kil && vil); j++) {
                /* A steady stream of prefetches for the next tile, in address order: iteration
                 * (u, j) takes slice u of token row j (all heads' K, then V) when the heads
                 * of a token lie together, else this head's row j. Measured (one thread,
                 * 32K keys): 10.9 GB/s prefetching per head, 12.0 GB/s with the whole next
                 * tile in one burst. */
                if (span) {
                    if (tt < nn) {
                        const int64_t b0 = part * slice, b1 = fw_min64(span, b0 + slice);
                        const char *kr = (const char *)p->k->data + (koff[cur ^ 1][tt] + kbase) * (int64_t)es;
                        const char *vr = (const char *)p->v->data + (voff[cur ^ 1][tt] + vbase) * (int64_t)es;
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
                    if (kcols && !kil) /* channel rows j, j + nn, ...: the next tile's keys of each */
                        for (int64_t x = j; x < p->d; x += nn)
                            for (int64_t b = 0; b < nn * (int64_t)es; b += 64)
                                __builtin_prefetch(kb + (koff[cur ^ 1][0] + x * p->ks[2]) * (int64_t)es + b, 0, 2);
                    else if (!kil)
                        for (int64_t b = 0; b < kline; b += 64)
                            __builtin_prefetch(kb + koff[cur ^ 1][j] * (int64_t)es + b, 0, 2);
                    for (int64_t b = 0; b < vline && !vil; b += 64)
                        __builtin_prefetch(vb + voff[cur ^ 1][j] * (int64_t)es + b, 0, 2);
                }
            }
            for (int j = 0; j < nk && !vdirect; j++) {
                kt->cvt.to_f32(vrows[j], p->v->dtype, p->vs[2], dv, 1.0f, Vf + (size_t)j * dv);
                vrows[j] = Vf + (size_t)j * dv;
            }
            if (!vdirect) /* (vrows now point at the converted copy) */
                held[ri][0] = -1;
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
            const int64_t nkvh = gqa ? u + 1 : (u + 1) / p->G;
            if (krows_fetch && u + 1 < ub && nkvh != kvh) {
                const char *kn = fw_elem(p->k, nkvh * p->ks[1]);
                for (int j = 0; j < nk; j++)
                    for (int64_t b = 0; b < kline; b += 64)
                        __builtin_prefetch(kn + koff[cur][j] * (int64_t)es + b, 0, 2);
            }
            float *Ou = O + (size_t)u * R * dv;
            /* contiguous key rows are read in place (bf16 products: bf16 rows, which already
             * are their pairs); the rest go through a transposed panel */
            if (bf16_rows) {
                kt->dec.qk_rows_bf16(R, nk, d, QW + (size_t)u * R * dw, rows, c->qscale, kil ? nrows : NULL, nx, S);
            } else if (kcols) {
                if (bf16) {
                    kt->dec.pack_kt_cols_bf16(rows[0], p->k->dtype, p->ks[2], nk, d, KtW);
                    kt->dec.qk_bf16(R, nk, dw, QW + (size_t)u * R * dw, KtW, c->qscale, S);
                } else if (p->k->dtype == FW_F32 && (p->bt || nk == FW_DEC_KEYS)) {
                    /* f32 rows are the panel itself (a page holds whole tiles, junk keys
                     * past nk included, which the softmax's bounds drop) */
                    kt->dec.qk(R, nk, d, Q + (size_t)u * R * d, (const float *)rows[0], p->ks[2],
                               kil ? (const float *)nrows[0] : NULL, S);
                } else {
                    kt->dec.pack_kt_cols(rows[0], p->k->dtype, p->ks[2], nk, d, Kt);
                    kt->dec.qk(R, nk, d, Q + (size_t)u * R * d, Kt, FW_DEC_KEYS, NULL, S);
                }
            } else if (bf16) {
                kt->dec.pack_kt_bf16(rows, p->k->dtype, p->ks[2], nk, d, KtW);
                kt->dec.qk_bf16(R, nk, dw, QW + (size_t)u * R * dw, KtW, c->qscale, S);
            } else if (p->ks[2] == 1) {
                kt->dec.qk_rows(R, nk, d, Q + (size_t)u * R * d, rows, p->k->dtype, kil ? nrows : NULL, nx, S);
            } else {
                kt->dec.pack_kt(rows, p->k->dtype, p->ks[2], nk, d, Kt);
                kt->dec.qk(R, nk, d, Q + (size_t)u * R * d, Kt, FW_DEC_KEYS, NULL, S);
            }
            /* (the key vectors the products wrote: dec_qk leaves the rest of S unset, which
             * the softmax never reads; MemorySanitizer over the fuzz corpora) */
            for (int r = 0; r < R && c->cap2 > 0.0f; r++)
                kt->attn.softcap(1, (nk + kt->vl - 1) / kt->vl * kt->vl, S + (size_t)r * FW_DEC_KEYS, c->cap2);
            kt->dec.softmax(R, nk, S, lo, hi, A + u * R, L + u * R, Ou, dv);
            if (bf16)
                kt->dec.pv_bf16(R, nk, dv, S, vrows, vdirect ? p->v->dtype : FW_F32, vil ? nvrows : NULL, nx, PW,
                                Ou);
            else
                kt->dec.pv(R, nk, dv, S, vrows, vdirect ? p->v->dtype : FW_F32, vil ? nvrows : NULL, nx, Ou);
        }
    }
    c->sink[tid * 16] += touch;
    for (int64_t u = ua; u < ub; u++)
        for (int g = 0; g < G; g++)
            for (int i = 0; i < n; i++) {
                const int64_t r = u * R + g * n + i;
                if (it->part >= 0)
                    fw_attn_store_partial(c, it, (int)r, O + (size_t)r * dv, A[r], L[r]);
                else
                    fw_attn_store_row(c, sq, gqa ? u * p->G + g : u, i, O + (size_t)r * dv, A[r], L[r]);
            }
}
