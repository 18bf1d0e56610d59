/*
 * attn/run.c: the softmax-attention driver: the work list, its order and threads, the merge of
 * split decode contexts, and the entry points fw_attn_fwd, fw_attn_varlen_fwd and
 * fw_attn_kvcache_fwd (with the append of the new K/V rows to the cache). Validation is in
 * attn/setup.c, the item kernels in attn/tile.c, attn/decode.c and attn/plain.c, the
 * arithmetic in the kernel table (kern/kernels.h).
 *
 * Work decomposition. A work item is a chunk: up to FW_ATTN_CHUNK_MAX q tiles of one
 * (sequence, K/V head) (attn/tile.c). A decode sequence (fw_attn_is_decode) is one item per
 * key split instead, all heads together (attn/decode.c), the splits merged afterwards; the
 * plain baseline takes FW_ATTN_PLAIN_ROWS rows of one q head (attn/plain.c).
 * Items run longest first on a shared counter (causal balance); each item's result depends on
 * nothing but its inputs, so any thread count gives the same bits.
 */
#include <stdlib.h>
#include "run.h"

static int cmp_item(const void *x, const void *y)
{
    const item *a = x, *b = y;
    if (a->cost != b->cost)
        return a->cost > b->cost ? -1 : 1;
    if (a->seq != b->seq)
        return a->seq < b->seq ? -1 : 1;
    if (a->head != b->head)
        return a->head < b->head ? -1 : 1;
    if (a->kb != b->kb)
        return a->kb < b->kb ? -1 : 1;
    return a->chunk < b->chunk ? -1 : (a->chunk > b->chunk);
}

/* Merge of a split decode context: per row, the partials of its splits in split order,
 * weighted by 2^(a_s - max a); the order is fixed, so the bits do not depend on the threads.
 * Partials of split sp: rows [units][R] of (o[dv], a, l) at part + sp * units * R * (dv + 2). */
typedef struct {
    int64_t seq, nsplit, part;
} merge_item;

typedef struct {
    const run_ctx *c;
    const merge_item *m;
} merge_ctx;

static void merge_fn(void *vctx, int64_t idx, int tid)
{
    const merge_ctx *mc = vctx;
    const run_ctx *c = mc->c;
    const fw_attn_prob *p = c->p;
    const merge_item *mi = &mc->m[idx];
    const fw_attn_seq sq = fw_attn_seq_get(p, mi->seq);
    const int gqa = !(c->flags & FW_ATTN_NO_GQA_PACK);
    const int64_t dv = p->dv, units = gqa ? p->hkv : p->hq, n = sq.sq, R = c->G * n;
    const int64_t split_stride = units * R * (dv + 2);
    float *orow = (float *)(c->ws + (size_t)tid * c->ws_stride + c->wl.row);
    for (int64_t r = 0; r < units * R; r++) {
        const float *base = c->part + mi->part + r * (dv + 2);
        /* the largest split maximum; a NaN one (a NaN reached the row) wins and makes every
         * weight, so the row, NaN, as on the unsplit paths */
        float amax = -INFINITY;
        for (int64_t sp = 0; sp < mi->nsplit; sp++) {
            const float a = base[sp * split_stride + dv];
            amax = a > amax || a != a ? a : amax;
            if (a != a)
                break;
        }
        float l = 0.0f;
        for (int64_t j = 0; j < dv; j++)
            orow[j] = 0.0f;
        for (int64_t sp = 0; sp < mi->nsplit && amax != -INFINITY; sp++) {
            /* a split whose scores were all -inf weighs 0, and still passes on the NaN that
             * 0 x an inf value made in it, as the unsplit paths do (found by
             * fuzz/fuzz_kvcache.c); a split that saw no key holds zeros */
            const float *src = base + sp * split_stride;
            const float w = exp2f(src[dv] - amax);
            for (int64_t j = 0; j < dv; j++)
                orow[j] += w * src[j];
            l += w * src[dv + 1];
        }
        const int64_t u = r / R, g = (r % R) / n, i = r % n;
        fw_attn_store_row(c, &sq, gqa ? u * p->G + g : u, i, orow, amax, l);
    }
}

/* Item idx on thread tid: the kernel its sequence's shape (and the flags) call for. */
static void run_item(void *vctx, int64_t idx, int tid)
{
    const run_ctx *c = vctx;
    const item *it = &c->items[idx];
    const fw_attn_seq sq = fw_attn_seq_get(c->p, it->seq);
    if (c->flags & FW_ATTN_PLAIN)
        fw_attn_plain_item(c, it, &sq, tid);
    else if (fw_attn_decode_seq(c->p, c->G, sq.sq))
        fw_attn_decode_item(c, it, &sq, tid);
    else
        fw_attn_tile_item(c, it, &sq, tid);
}

/* The call's plan, made once: the resolved flags and scales (in the run_ctx the items read),
 * each sequence's tile rows, and the counts the allocations need. */
typedef struct {
    int threads, plain;
    int64_t heads;   /* items per (sequence, chunk): K/V heads, or q heads unpacked */
    int64_t units;   /* decode: K/V heads (or q heads unpacked) of one item's workspace */
    int64_t groups;  /* decode: items per split (fw_attn_dec_groups) */
    int64_t n, nmerge, npart; /* work items, split decodes to merge, their partial floats */
    int *bq, *M;     /* [batch]: each sequence's tile rows (fw_attn_tile_rows) */
    size_t need;     /* workspace bytes */
} run_plan;

/* Sequence i's items on the tiled path, as the key ranges' heuristic counts them
 * (fw_attn_tile_splits): its q tiles times the heads; the shape only. */
static int64_t tile_items(const run_plan *pl, int64_t i, fw_attn_seq s)
{
    return fw_ceil_div(s.sq, pl->bq[i]) * pl->heads;
}

static fw_status plan_call(const fw_attn_prob *p, const fw_attn_params *params, run_ctx *c, run_plan *pl)
{
    const uint32_t flags = params ? params->flags : 0;
    memset(c, 0, sizeof *c);
    memset(pl, 0, sizeof *pl);
    c->p = p;
    c->kt = p->kt;
    c->flags = flags;
    /* the decode prefetch's default, resolved once per call: by the CPU's vendor */
    if (!(flags & (FW_ATTN_DEC_PREFETCH | FW_ATTN_NO_DEC_PREFETCH)) && fw_dec_prefetch(fw_cpu_vendor()))
        c->flags |= FW_ATTN_DEC_PREFETCH;
    c->G = (int)((flags & FW_ATTN_NO_GQA_PACK) ? 1 : p->G);
    c->cap2 = p->softcap > 0 ? (float)(p->softcap * FW_LOG2E) : 0.0f;
    /* scores come out in log2 units (or divided by the softcap): f32 products fold this
     * into q; bf16 products apply it to the f32 scores */
    c->qscale = (float)(p->softcap > 0 ? p->scale / p->softcap : p->scale * FW_LOG2E);
    pl->threads = fw_threads(params ? params->threads : 0);
    pl->plain = (flags & FW_ATTN_PLAIN) != 0;
    pl->heads = (pl->plain || (flags & FW_ATTN_NO_GQA_PACK)) ? p->hq : p->hkv;
    pl->units = fw_attn_ws_units(p->hq, p->hkv, flags);
    if (!(pl->bq = malloc(2 * sizeof(int) * (size_t)(p->batch > 0 ? p->batch : 1))))
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the tile plan of %lld sequences", (long long)p->batch);
    pl->M = pl->bq + p->batch;

    /* the work list: q tiles of each sequence's own size, grouped into chunks; a decode
     * sequence (fw_attn_is_decode: G x n <= FW_DEC_ROWS rows per K/V head) is one item per key
     * split instead, all heads together, or its heads in groups when the items are fewer
     * than the threads (fw_attn_dec_groups) */
    int64_t total_tiles = 0, nd = 0;
    for (int64_t i = 0; i < p->batch; i++) {
        const int64_t sq = fw_attn_seq_get(p, i).sq;
        fw_attn_tile_rows(c->G, c->kt->vl, sq, &pl->bq[i], &pl->M[i]);
        total_tiles += fw_ceil_div(sq, pl->bq[i]) * pl->heads;
    }
    c->chunk = fw_attn_chunk_tiles(total_tiles, pl->threads);
    for (int64_t i = 0; i < p->batch; i++) {
        const fw_attn_seq s = fw_attn_seq_get(p, i);
        if (!pl->plain && fw_attn_decode_seq(p, c->G, s.sq)) {
            const int64_t ns = fw_attn_kv_splits(s.sk, pl->units);
            nd += ns;
            if (ns > 1) {
                pl->nmerge++;
                pl->npart += ns * pl->units * c->G * s.sq * (p->dv + 2);
            }
        } else {
            const int64_t ns = pl->plain ? 1 : fw_attn_tile_splits(s.sk, tile_items(pl, i, s));
            pl->n += fw_ceil_div(s.sq, pl->plain ? FW_ATTN_PLAIN_ROWS : (int64_t)c->chunk * pl->bq[i]) * pl->heads * ns;
            if (ns > 1) {
                pl->nmerge++;
                pl->npart += ns * pl->units * c->G * s.sq * (p->dv + 2);
            }
        }
    }
    pl->groups = fw_attn_dec_groups(pl->units, pl->n + nd, pl->threads);
    pl->n += nd * pl->groups;
    if (pl->n == 0)
        return FW_OK; /* nothing to run: no workspace asked for */
    c->wl = fw_attn_ws_layout(p->hq, p->hkv, p->d, p->dv, c->kt, flags, p->bf16);
    pl->need = fw_attn_ws_bytes(&c->wl, pl->threads);
    if (params && params->workspace && params->workspace_bytes < pl->need)
        return fw_fail(FW_ERR_WORKSPACE, "workspace has %zu bytes; this call needs %zu",
                       params->workspace_bytes, pl->need);
    if ((uint64_t)pl->n > SIZE_MAX / sizeof(item) || (uint64_t)pl->npart > SIZE_MAX / sizeof(float))
        return fw_fail(FW_ERR_OVERFLOW, "%lld work items overflow size_t", (long long)pl->n);
    return FW_OK;
}

/* The items of sequence i (and its merge, for a split decode) as the plan counted them. */
static void sequence_items(const run_ctx *c, const run_plan *pl, int64_t i, int64_t *n,
                           merge_item *merges, int64_t *nmerge, int64_t *npart)
{
    const fw_attn_prob *p = c->p;
    const fw_attn_seq s = fw_attn_seq_get(p, i);
    if (!pl->plain && fw_attn_decode_seq(p, c->G, s.sq)) {
        const int64_t ns = fw_attn_kv_splits(s.sk, pl->units), keys = fw_attn_kv_split_keys(s.sk, pl->units);
        const int64_t rows = pl->units * c->G * s.sq, ng = pl->groups;
        if (ns > 1) {
            merge_item mi = {i, ns, *npart};
            merges[(*nmerge)++] = mi;
        }
        for (int64_t sp = 0; sp < ns; sp++)
            for (int64_t g = 0; g < ng; g++) {
                item e = {i, g, ng, sp * keys, ns > 1 ? (sp + 1) * keys : INT64_MAX,
                          ns > 1 ? *npart + sp * rows * (p->dv + 2) : -1,
                          fw_ceil_div(pl->units, ng) * fw_min64(keys, s.sk) + FW_ATTN_BK, 0, 0};
                c->items[(*n)++] = e;
            }
        *npart += ns > 1 ? ns * rows * (p->dv + 2) : 0;
        return;
    }
    const int64_t span = pl->plain ? FW_ATTN_PLAIN_ROWS : (int64_t)c->chunk * pl->bq[i];
    /* a split sequence: each range of keys an item per chunk, its partials [units][G sq] rows
     * per range, as a split decode's, merged the same way */
    const int64_t items = tile_items(pl, i, s), ns = pl->plain ? 1 : fw_attn_tile_splits(s.sk, items);
    const int64_t keys = fw_attn_tile_split_keys(s.sk, items);
    const int64_t rows_per_head = c->G * s.sq;
    if (ns > 1) {
        merge_item mi = {i, ns, *npart};
        merges[(*nmerge)++] = mi;
    }
    for (int64_t sp = 0; sp < ns; sp++)
        for (int64_t h = 0; h < pl->heads; h++)
            for (int64_t ch = 0; ch * span < s.sq; ch++) {
                /* cost: the keys the chunk's last row sees (in its range) times its rows */
                int64_t rows = fw_min64(span, s.sq - ch * span), lo, hi;
                const int64_t kb = ns > 1 ? sp * keys : 0, ke = ns > 1 ? (sp + 1) * keys : INT64_MAX;
                fw_attn_visible(p, s.sq, s.sk, ch * span + rows - 1, &lo, &hi);
                lo = fw_max64(lo, kb);
                hi = fw_min64(hi, ke);
                item e = {i, h, ch, kb, ke,
                          ns > 1 ? *npart + (sp * pl->units + h) * rows_per_head * (p->dv + 2) : -1,
                          rows * fw_max64(1, hi - lo + FW_ATTN_BK), pl->bq[i], pl->M[i]};
                c->items[(*n)++] = e;
            }
    *npart += ns > 1 ? ns * pl->units * rows_per_head * (p->dv + 2) : 0;
}

/* Plan, allocate, list the items longest first, run them and merge the split decodes. */
static fw_status run(const fw_attn_prob *p, const fw_attn_params *params)
{
    if (!p->kt)
        return FW_ERR_UNSUPPORTED; /* fw_kernels_get said why, in the setup */
    run_ctx c;
    run_plan pl;
    fw_status s = plan_call(p, params, &c, &pl);
    if (s || pl.n == 0) {
        free(pl.bq);
        return s;
    }
    c.items = malloc((size_t)pl.n * sizeof(item));
    merge_item *merges = pl.nmerge ? malloc((size_t)pl.nmerge * sizeof(merge_item)) : NULL;
    c.part = pl.npart ? malloc((size_t)pl.npart * sizeof(float)) : NULL;
    void *own = NULL;
    char *ws = params && params->workspace ? params->workspace : (own = malloc(pl.need));
    if (c.items && ws && (!pl.nmerge || (merges && c.part))) {
        c.ws = (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
        unsigned sink[FW_MAX_THREADS * 16];
        c.sink = sink;
        c.ws_stride = c.wl.total;
        int64_t n = 0, nmerge = 0, npart = 0;
        for (int64_t i = 0; i < p->batch; i++)
            sequence_items(&c, &pl, i, &n, merges, &nmerge, &npart);
        qsort(c.items, (size_t)n, sizeof(item), cmp_item);
        fw_parallel(pl.threads, n, run_item, &c);
        if (nmerge) {
            merge_ctx mc = {&c, merges};
            fw_parallel(pl.threads, nmerge, merge_fn, &mc);
        }
    } else {
        s = fw_fail(FW_ERR_NOMEM, "cannot allocate %zu bytes of workspace, %lld work items and "
                    "%lld split partials", pl.need, (long long)pl.n, (long long)pl.npart);
    }
    free(c.items);
    free(merges);
    free(c.part);
    free(own);
    free(pl.bq);
    return s;
}

fw_status fw_attn_fwd(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                      const fw_tensor *out, const fw_tensor *lse, const fw_attn_params *params)
{
    fw_clear_error();
    fw_attn_prob p;
    fw_status s = fw_attn_setup(&p, q, k, v, NULL, NULL, 0, 0, out, lse, params, 0);
    return s ? s : run(&p, params);
}

fw_status fw_attn_varlen_fwd(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                             const int32_t *cu_seqlens_q, const int32_t *cu_seqlens_k,
                             int64_t batch, const fw_tensor *out, const fw_tensor *lse,
                             const fw_attn_params *params)
{
    fw_clear_error();
    fw_attn_prob p;
    fw_status s = fw_attn_setup(&p, q, k, v, cu_seqlens_q, cu_seqlens_k, batch, 1, out, lse,
                                params, 0);
    return s ? s : run(&p, params);
}

/* ---------------------------------------------------------------- KV cache -- */

/* An fp8 cache's new row of n elements from src (any float dtype, element stride ss):
 * converted to f32, rotated at pos when rot, each divided by the descale and rounded to the
 * cache's type at dst (element stride ds). */
static void append_f8_row(const fw_attn_prob *p, const fw_kernels *kt, const fw_tensor *src, const char *a,
                          int64_t n, int rot, int64_t pos, float descale, uint8_t *dst, int64_t ds)
{
    float row[FW_MAX_HEAD_DIM];
    kt->cvt.to_f32(a, src->dtype, src->stride[2], n, 1.0f, row);
    if (rot)
        fw_attn_rotate(p, kt, row, pos);
    for (int64_t x = 0; x < n; x++)
        dst[x * ds] = fw_cvt_f32_f8(row[x] / descale, p->k->dtype);
}

/* Write each sequence's new rows at positions seqlens[i] .. seqlens[i] + n_i - 1; with a rotary
 * embedding the K rows are rotated on the way (converted to f32, rotated at their position,
 * stored in the cache's dtype); an fp8 cache stores them divided by its descales. Runs after
 * validation, so every destination exists and no page is written by two sequences. */
static void append_rows(const fw_attn_prob *p, const fw_kernels *kt)
{
    const size_t es = fw_dtype_size(p->k->dtype);
    const int f8 = p->kdesc != NULL;
    float row_f32[FW_MAX_HEAD_DIM];
    uint16_t w[FW_MAX_HEAD_DIM];
    for (int64_t i = 0; i < p->batch; i++) {
        const fw_attn_seq s = fw_attn_seq_get(p, i);
        for (int64_t r = 0; r < s.sq; r++)
            for (int v = 0; v < 2; v++) {
                const fw_tensor *src = v ? p->vnew : p->knew, *dst = v ? p->v : p->k;
                const int64_t *ds = v ? p->vs : p->ks, n = v ? p->dv : p->d;
                const int64_t j = p->cache_len[i] - s.kpos + r;
                const int64_t row = p->tiles ? 0 : fw_attn_key(p, &s, j, v);
                /* FW_KV_TILES (bf16): the row is staged in w, then scattered into its tiles */
                const int64_t bs = p->tiles ? 1 : ds[2];
                for (int64_t h = 0; h < p->hkv; h++) {
                    const int64_t at = (p->cuq[i] + r) * src->stride[0] + h * src->stride[1];
                    const char *a = (const char *)src->data + at * (int64_t)fw_dtype_size(src->dtype);
                    char *b = p->tiles ? (char *)w : (char *)dst->data + (row + h * ds[1]) * (int64_t)es;
                    if (f8)
                        append_f8_row(p, kt, src, a, n, !v && p->rot_append, p->cache_len[i] + r,
                                      fw_attn_descale(p, v, i, h), (uint8_t *)b, bs);
                    else if (!v && p->rot_append) {
                        kt->cvt.to_f32(a, src->dtype, src->stride[2], n, 1.0f, row_f32);
                        fw_attn_rotate(p, kt, row_f32, p->cache_len[i] + r);
                        kt->cvt.from_f32(row_f32, n, b, dst->dtype, bs);
                    } else if (src->stride[2] == 1 && bs == 1)
                        memcpy(b, a, (size_t)n * es);
                    else
                        for (int64_t x = 0; x < n; x++)
                            memcpy(b + x * bs * (int64_t)es, a + x * src->stride[2] * (int64_t)es, es);
                    for (int64_t x = 0; x < n && p->tiles; x++)
                        ((uint16_t *)dst->data)[fw_attn_tile_elem(p, &s, j, h, x, v)] = w[x];
                }
            }
    }
}

fw_status fw_attn_kvcache_fwd(const fw_tensor *q, const fw_tensor *k_new, const fw_tensor *v_new,
                              const int32_t *cu_seqlens_q, int64_t batch, const fw_kv_cache *cache,
                              const fw_tensor *out, const fw_tensor *lse,
                              const fw_attn_params *params)
{
    fw_clear_error();
    fw_attn_prob p;
    fw_status s = fw_attn_setup_kvcache(&p, q, k_new, v_new, cu_seqlens_q, batch, cache, out, lse,
                                        params, 0);
    if (s)
        return s;
    /* the kernel table must resolve before the cache is touched */
    if (!p.kt)
        return FW_ERR_UNSUPPORTED;
    if (p.append)
        append_rows(&p, p.kt);
    return run(&p, params);
}
