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

static fw_status run(const fw_attn_prob *p, const fw_attn_params *params)
{
    const uint32_t flags = params ? params->flags : 0;
    const fw_kernels *kt = fw_kernels_get(params ? params->isa : NULL);
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    const int threads = fw_threads(params ? params->threads : 0);
    const int plain = (flags & FW_ATTN_PLAIN) != 0;
    run_ctx c;
    memset(&c, 0, sizeof c);
    c.p = p;
    c.kt = kt;
    c.flags = flags;
    /* the decode prefetch's default, resolved once per call: by the CPU's vendor */
    if (!(flags & (FW_ATTN_DEC_PREFETCH | FW_ATTN_NO_DEC_PREFETCH)) && fw_dec_prefetch(fw_cpu_vendor()))
        c.flags |= FW_ATTN_DEC_PREFETCH;
    c.G = (int)((flags & FW_ATTN_NO_GQA_PACK) ? 1 : p->G);
    c.cap2 = p->softcap > 0 ? (float)(p->softcap * FW_LOG2E) : 0.0f;
    /* scores come out in log2 units (or divided by the softcap): f32 products fold this
     * into q; bf16 products apply it to the f32 scores */
    c.qscale = (float)(p->softcap > 0 ? p->scale / p->softcap : p->scale * FW_LOG2E);
    const int64_t heads = (plain || (flags & FW_ATTN_NO_GQA_PACK)) ? p->hq : p->hkv;

    /* the work list: q tiles of each sequence's own size, grouped into chunks; a decode
     * sequence (fw_attn_is_decode: G x n <= FW_DEC_ROWS rows per K/V head) is one item per key
     * split instead, all heads together, or its heads in groups when the items are fewer
     * than the threads (fw_attn_dec_groups) */
    int64_t total_tiles = 0, n = 0, nd = 0, nmerge = 0, npart = 0;
    const int64_t units = fw_attn_ws_units(p->hq, p->hkv, flags);
    for (int64_t i = 0; i < p->batch; i++) {
        int bq, M;
        fw_attn_tile_rows(c.G, kt->vl, fw_attn_seq_get(p, i).sq, &bq, &M);
        total_tiles += fw_ceil_div(fw_attn_seq_get(p, i).sq, bq) * heads;
    }
    c.chunk = fw_attn_chunk_tiles(total_tiles, threads);
    for (int64_t i = 0; i < p->batch; i++) {
        const fw_attn_seq s = fw_attn_seq_get(p, i);
        int bq, M;
        fw_attn_tile_rows(c.G, kt->vl, s.sq, &bq, &M);
        if (!plain && fw_attn_decode_seq(p, c.G, s.sq)) {
            const int64_t ns = fw_attn_kv_splits(s.sk, units);
            nd += ns;
            if (ns > 1) {
                nmerge++;
                npart += ns * units * c.G * s.sq * (p->dv + 2);
            }
        } else {
            n += fw_ceil_div(s.sq, plain ? FW_ATTN_PLAIN_ROWS : (int64_t)c.chunk * bq) * heads;
        }
    }
    const int64_t ng = fw_attn_dec_groups(units, n + nd, threads);
    n += nd * ng;
    if (n == 0)
        return FW_OK;
    c.wl = fw_attn_ws_layout(p->hq, p->hkv, p->d, p->dv, kt, flags, p->bf16);
    const size_t need = fw_attn_ws_bytes(&c.wl, threads);
    if (params && params->workspace && params->workspace_bytes < need)
        return fw_fail(FW_ERR_WORKSPACE, "workspace has %zu bytes; this call needs %zu",
                       params->workspace_bytes, need);
    if ((uint64_t)n > SIZE_MAX / sizeof(item) || (uint64_t)npart > SIZE_MAX / sizeof(float))
        return fw_fail(FW_ERR_OVERFLOW, "%lld work items overflow size_t", (long long)n);
    c.items = malloc((size_t)n * sizeof(item));
    merge_item *merges = nmerge ? malloc((size_t)nmerge * sizeof(merge_item)) : NULL;
    c.part = npart ? malloc((size_t)npart * sizeof(float)) : NULL;
    void *own = NULL;
    char *ws = params && params->workspace ? params->workspace : (own = malloc(need));
    if (!c.items || !ws || (nmerge && (!merges || !c.part))) {
        free(c.items);
        free(merges);
        free(c.part);
        free(own);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate %zu bytes of workspace, %lld work items and "
                       "%lld split partials", need, (long long)n, (long long)npart);
    }
    c.ws = (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    unsigned sink[FW_MAX_THREADS * 16];
    c.sink = sink;
    c.ws_stride = c.wl.total;
    n = nmerge = npart = 0;
    for (int64_t i = 0; i < p->batch; i++) {
        const fw_attn_seq s = fw_attn_seq_get(p, i);
        int bq, M;
        fw_attn_tile_rows(c.G, kt->vl, s.sq, &bq, &M);
        if (!plain && fw_attn_decode_seq(p, c.G, s.sq)) {
            const int64_t ns = fw_attn_kv_splits(s.sk, units), keys = fw_attn_kv_split_keys(s.sk, units);
            const int64_t rows = units * c.G * s.sq;
            if (ns > 1) {
                merge_item mi = {i, ns, npart};
                merges[nmerge++] = mi;
            }
            for (int64_t sp = 0; sp < ns; sp++)
                for (int64_t g = 0; g < ng; g++) {
                    item e = {i, g, ng, sp * keys, ns > 1 ? (sp + 1) * keys : INT64_MAX,
                              ns > 1 ? npart + sp * rows * (p->dv + 2) : -1,
                              fw_ceil_div(units, ng) * fw_min64(keys, s.sk) + FW_ATTN_BK};
                    c.items[n++] = e;
                }
            npart += ns > 1 ? ns * rows * (p->dv + 2) : 0;
            continue;
        }
        const int64_t span = plain ? FW_ATTN_PLAIN_ROWS : (int64_t)c.chunk * bq;
        for (int64_t h = 0; h < heads; h++)
            for (int64_t ch = 0; ch * span < s.sq; ch++) {
                /* cost: the keys the chunk's last row sees times its rows */
                int64_t rows = fw_min64(span, s.sq - ch * span), lo, hi;
                fw_attn_visible(p, s.sq, s.sk, ch * span + rows - 1, &lo, &hi);
                item e = {i, h, ch, 0, INT64_MAX, -1, rows * fw_max64(1, hi - lo + FW_ATTN_BK)};
                c.items[n++] = e;
            }
    }
    qsort(c.items, (size_t)n, sizeof(item), cmp_item);
    fw_parallel(threads, n, run_item, &c);
    if (nmerge) {
        merge_ctx mc = {&c, merges};
        fw_parallel(threads, nmerge, merge_fn, &mc);
    }
    free(c.items);
    free(merges);
    free(c.part);
    free(own);
    return FW_OK;
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

/* Write each sequence's new rows at positions seqlens[i] .. seqlens[i] + n_i - 1; with a rotary
 * embedding the K rows are rotated on the way (converted to f32, rotated at their position,
 * stored in the cache's dtype). Runs after validation, so every destination exists and no
 * page is written by two sequences. */
static void append_rows(const fw_attn_prob *p, const fw_kernels *kt)
{
    const size_t es = fw_dtype_size(p->k->dtype);
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
                    const char *a = (const char *)src->data +
                                    ((p->cuq[i] + r) * src->stride[0] + h * src->stride[1]) * (int64_t)es;
                    char *b = p->tiles ? (char *)w : (char *)dst->data + (row + h * ds[1]) * (int64_t)es;
                    if (!v && p->rot_append) {
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
    const fw_kernels *kt = fw_kernels_get(params ? params->isa : NULL);
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    if (p.append)
        append_rows(&p, kt);
    return run(&p, params);
}
