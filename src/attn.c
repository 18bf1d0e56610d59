/*
 * attn.c: the softmax-attention driver: validation, tiling, GQA row stacking, the work list
 * and threads. The arithmetic is in the kernel table (kern/attn_kern.h).
 *
 * Work decomposition. A work item is a chunk: up to FW_ATTN_CHUNK_MAX q tiles of one
 * (sequence, K/V head). A q tile stacks the G query heads of the GQA group as extra rows
 * (rows = G x bq positions), so each K/V tile is converted to f32 once per chunk and used by
 * every head of the group. Inside a chunk the K/V tiles are the outer loop and the q tiles the
 * inner one, so the workspace does not grow with the sequence length. Tiles that no row of a
 * q tile can see are skipped by index arithmetic; only tiles some row sees partly are masked.
 * Items run longest first on a shared counter (causal balance); each item's result depends on
 * nothing but its inputs, so any thread count gives the same bits.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "attn.h"

void fw_attn_params_init(fw_attn_params *p)
{
    if (!p)
        return;
    memset(p, 0, sizeof *p);
    p->window_left = -1;
    p->window_right = -1;
}

/* ------------------------------------------------------------- validation -- */

static fw_status check_lengths(const int32_t *cu, int64_t batch, int64_t total, const char *name)
{
    if (!cu) {
        if (batch > 0 || total > 0)
            return fw_fail(FW_ERR_NULL, "%s is NULL", name);
        return FW_OK;
    }
    if (cu[0] != 0)
        return fw_fail(FW_ERR_SEQLENS, "%s[0] is %d; it must be 0", name, (int)cu[0]);
    for (int64_t i = 1; i <= batch; i++)
        if (cu[i] < cu[i - 1])
            return fw_fail(FW_ERR_SEQLENS, "%s[%lld] = %d is less than %s[%lld] = %d", name,
                           (long long)i, (int)cu[i], name, (long long)(i - 1), (int)cu[i - 1]);
    if (cu[batch] != total)
        return fw_fail(FW_ERR_SEQLENS, "%s[%lld] = %d but the packed tensor has %lld rows", name,
                       (long long)batch, (int)cu[batch], (long long)total);
    return FW_OK;
}

#define DT_IN ((1u << FW_F32) | (1u << FW_BF16) | (1u << FW_F16))

static fw_status check_params(const fw_attn_params *params)
{
    if (!isfinite(params->scale))
        return fw_fail(FW_ERR_ARG, "scale is %g; it must be finite (0 means 1/sqrt(d))",
                       (double)params->scale);
    if (!(params->softcap >= 0.0f) || !isfinite(params->softcap))
        return fw_fail(FW_ERR_ARG, "softcap is %g; it must be finite and >= 0 (0 = off)",
                       (double)params->softcap);
    if (params->window_left < -1 || params->window_right < -1)
        return fw_fail(FW_ERR_ARG, "window (%lld, %lld): each side must be >= 0, or -1 for unbounded",
                       (long long)params->window_left, (long long)params->window_right);
    if (params->causal != 0 && params->causal != 1)
        return fw_fail(FW_ERR_ARG, "causal is %d; it must be 0 or 1", (int)params->causal);
    if (params->threads < 0 || params->threads > 256)
        return fw_fail(FW_ERR_ARG, "threads is %d; it must be 0 (all CPUs) to 256",
                       (int)params->threads);
    if (params->precision < FW_PREC_AUTO || params->precision > FW_PREC_BF16)
        return fw_fail(FW_ERR_ARG, "precision is %d; it must be FW_PREC_AUTO (0), FW_PREC_F32 (1) "
                       "or FW_PREC_BF16 (2)", (int)params->precision);
    if (params->flags & ~(uint32_t)(FW_ATTN_ONLINE_SOFTMAX | FW_ATTN_NO_GQA_PACK |
                                    FW_ATTN_NO_TILE_SKIP | FW_ATTN_PLAIN))
        return fw_fail(FW_ERR_ARG, "flags 0x%x has unknown bits", (unsigned)params->flags);
    return FW_OK;
}


int fw_attn_bf16_products(fw_dtype q, int32_t precision)
{
    return precision == FW_PREC_BF16 || (precision == FW_PREC_AUTO && q == FW_BF16);
}

/* The fields both setups derive the same way: lse strides ([hq, total_q] packed, or
 * [b, hq, sq]), the scale (0 = 1/sqrt(d)), softcap, the mask (causal sets wr = 0) and the
 * product precision. */
static void setup_common(fw_attn_prob *p, const fw_tensor *lse, const fw_attn_params *params)
{
    if (lse && p->varlen) {
        p->lse_b = lse->stride[1]; p->lse_h = lse->stride[0]; p->lse_r = lse->stride[1];
    } else if (lse) {
        p->lse_b = lse->stride[0]; p->lse_h = lse->stride[1]; p->lse_r = lse->stride[2];
    }
    p->scale = params->scale != 0.0f ? (double)params->scale : 1.0 / sqrt((double)p->d);
    p->softcap = params->softcap;
    p->causal = params->causal;
    p->wl = params->window_left;
    p->wr = params->causal ? 0 : params->window_right;
    p->bf16 = fw_attn_bf16_products(p->q->dtype, params->precision);
}

fw_status fw_attn_setup(fw_attn_prob *p, const fw_tensor *q, const fw_tensor *k,
                        const fw_tensor *v, const int32_t *cuq, const int32_t *cuk,
                        int64_t batch, int varlen, const fw_tensor *out, const fw_tensor *lse,
                        const fw_attn_params *params, int ref)
{
    fw_attn_params defaults;
    if (!params) {
        fw_attn_params_init(&defaults);
        params = &defaults;
    }
    memset(p, 0, sizeof *p);
    const int nd = varlen ? 3 : 4, o = varlen ? 0 : 1; /* o: offset of the token dim */
    const unsigned dt_out = DT_IN | (ref ? 1u << FW_F64 : 0u);
    fw_status s;
    if ((s = fw_check_tensor(q, "q", nd, DT_IN)) || (s = fw_check_tensor(k, "k", nd, DT_IN)) ||
        (s = fw_check_tensor(v, "v", nd, DT_IN)) || (s = fw_check_tensor(out, "out", nd, dt_out)))
        return s;
    if (lse && (s = fw_check_tensor(lse, "lse", varlen ? 2 : 3,
                                    (1u << FW_F32) | (ref ? 1u << FW_F64 : 0u))))
        return s;
    if (k->dtype != q->dtype || v->dtype != q->dtype)
        return fw_fail(FW_ERR_DTYPE, "q, k and v must share a dtype: q is %s, k is %s, v is %s",
                       fw_dtype_name(q->dtype), fw_dtype_name(k->dtype), fw_dtype_name(v->dtype));
    const int64_t hq = q->shape[o + 1], hkv = k->shape[o + 1], d = q->shape[o + 2],
                  dv = v->shape[o + 2];
    if (!varlen) {
        if (k->shape[0] != q->shape[0] || v->shape[0] != q->shape[0] || out->shape[0] != q->shape[0])
            return fw_fail(FW_ERR_SHAPE, "batch sizes differ: q %lld, k %lld, v %lld, out %lld",
                           (long long)q->shape[0], (long long)k->shape[0], (long long)v->shape[0],
                           (long long)out->shape[0]);
    }
    if (v->shape[o] != k->shape[o])
        return fw_fail(FW_ERR_SHAPE, "k has %lld keys but v has %lld", (long long)k->shape[o],
                       (long long)v->shape[o]);
    if (out->shape[o] != q->shape[o])
        return fw_fail(FW_ERR_SHAPE, "q has %lld query rows but out has %lld",
                       (long long)q->shape[o], (long long)out->shape[o]);
    if (v->shape[o + 1] != hkv)
        return fw_fail(FW_ERR_SHAPE, "k has %lld heads but v has %lld", (long long)hkv,
                       (long long)v->shape[o + 1]);
    if (out->shape[o + 1] != hq)
        return fw_fail(FW_ERR_SHAPE, "q has %lld heads but out has %lld", (long long)hq,
                       (long long)out->shape[o + 1]);
    if (hq < 1 || hkv < 1 || hq % hkv)
        return fw_fail(FW_ERR_SHAPE, "k has %lld heads, which does not divide q's %lld heads",
                       (long long)hkv, (long long)hq);
    if (k->shape[o + 2] != d)
        return fw_fail(FW_ERR_SHAPE, "q has head dim %lld but k has %lld", (long long)d,
                       (long long)k->shape[o + 2]);
    if (out->shape[o + 2] != dv)
        return fw_fail(FW_ERR_SHAPE, "v has head dim %lld but out has %lld", (long long)dv,
                       (long long)out->shape[o + 2]);
    if (d < 1 || d > 1024 || dv < 1 || dv > 1024)
        return fw_fail(FW_ERR_SHAPE, "head dims must be 1..1024: d is %lld, dv is %lld",
                       (long long)d, (long long)dv);
    if (hq > 65536)
        return fw_fail(FW_ERR_SHAPE, "q has %lld heads; at most 65536 are supported", (long long)hq);
    if (lse) {
        int64_t want[3], n = varlen ? 2 : 3;
        if (varlen) { want[0] = hq; want[1] = q->shape[0]; }
        else { want[0] = q->shape[0]; want[1] = hq; want[2] = q->shape[1]; }
        for (int i = 0; i < n; i++)
            if (lse->shape[i] != want[i])
                return fw_fail(FW_ERR_SHAPE, "lse must be %s; its dimension %d is %lld, expected %lld",
                               varlen ? "[hq, total_q]" : "[b, hq, sq]", i,
                               (long long)lse->shape[i], (long long)want[i]);
        if ((s = fw_check_no_alias(lse, "lse")))
            return s;
    }
    if ((s = fw_check_no_alias(out, "out")))
        return s;
    if ((s = check_params(params)))
        return s;
    if (varlen) {
        if (batch < 0 || batch > INT32_MAX)
            return fw_fail(FW_ERR_ARG, "batch is %lld; it must be 0..2^31-1", (long long)batch);
        if ((s = check_lengths(cuq, batch, q->shape[0], "cu_seqlens_q")) ||
            (s = check_lengths(cuk, batch, k->shape[0], "cu_seqlens_k")))
            return s;
    }

    p->q = q; p->k = k; p->v = v; p->out = out; p->lse = lse;
    p->cuq = cuq; p->cuk = cuk; p->varlen = varlen;
    p->hq = hq; p->hkv = hkv; p->G = hq / hkv; p->d = d; p->dv = dv;
    for (int i = 0; i < 3; i++) {
        p->qs[i] = q->stride[o + i]; p->ks[i] = k->stride[o + i];
        p->vs[i] = v->stride[o + i]; p->os[i] = out->stride[o + i];
    }
    if (varlen) {
        p->batch = batch;
        for (int64_t i = 0; i < batch; i++) {
            p->sq = fw_max64(p->sq, (int64_t)cuq[i + 1] - cuq[i]);
            p->sk = fw_max64(p->sk, (int64_t)cuk[i + 1] - cuk[i]);
        }
    } else {
        p->batch = q->shape[0]; p->sq = q->shape[1]; p->sk = k->shape[1];
        p->qb = q->stride[0]; p->kb = k->stride[0]; p->vb = v->stride[0]; p->ob = out->stride[0];
    }
    setup_common(p, lse, params);
    return FW_OK;
}

fw_attn_seq fw_attn_seq_get(const fw_attn_prob *p, int64_t i)
{
    fw_attn_seq s;
    s.index = i;
    if (p->varlen) {
        int64_t r = p->cuq[i];
        s.q0 = r * p->qs[0];
        s.o0 = r * p->os[0];
        s.lse0 = r * p->lse_b;
        s.sq = (int64_t)p->cuq[i + 1] - r;
        if (p->kvcache) {
            s.k0 = i * p->kb;
            s.v0 = i * p->vb;
            s.sk = (int64_t)p->cache_len[i] + (p->append ? s.sq : 0);
        } else {
            int64_t c = p->cuk[i];
            s.k0 = c * p->ks[0];
            s.v0 = c * p->vs[0];
            s.sk = (int64_t)p->cuk[i + 1] - c;
        }
    } else {
        s.q0 = i * p->qb;
        s.k0 = i * p->kb;
        s.v0 = i * p->vb;
        s.o0 = i * p->ob;
        s.lse0 = i * p->lse_b;
        s.sq = p->sq;
        s.sk = p->sk;
    }
    return s;
}

fw_status fw_attn_setup_kvcache(fw_attn_prob *p, const fw_tensor *q, const fw_tensor *k_new,
                                const fw_tensor *v_new, const int32_t *cuq, int64_t batch,
                                const fw_kv_cache *cache, const fw_tensor *out,
                                const fw_tensor *lse, const fw_attn_params *params, int ref)
{
    fw_attn_params defaults;
    if (!params) {
        fw_attn_params_init(&defaults);
        params = &defaults;
    }
    memset(p, 0, sizeof *p);
    const unsigned dt_out = DT_IN | (ref ? 1u << FW_F64 : 0u);
    fw_status s;
    if (!cache)
        return fw_fail(FW_ERR_NULL, "cache is NULL: a fw_kv_cache is required");
    const fw_tensor *kc = &cache->k, *vc = &cache->v;
    if ((s = fw_check_tensor(q, "q", 3, DT_IN)) || (s = fw_check_tensor(out, "out", 3, dt_out)) ||
        (s = fw_check_tensor(kc, "cache.k", 4, DT_IN)) || (s = fw_check_tensor(vc, "cache.v", 4, DT_IN)))
        return s;
    if (lse && (s = fw_check_tensor(lse, "lse", 2, (1u << FW_F32) | (ref ? 1u << FW_F64 : 0u))))
        return s;
    if (!k_new != !v_new)
        return fw_fail(FW_ERR_NULL, "k_new is %s but v_new is %s: pass both or neither",
                       k_new ? "set" : "NULL", v_new ? "set" : "NULL");
    if (vc->dtype != kc->dtype)
        return fw_fail(FW_ERR_DTYPE, "cache.k is %s but cache.v is %s; they must match",
                       fw_dtype_name(kc->dtype), fw_dtype_name(vc->dtype));
    const int64_t hq = q->shape[1], hkv = kc->shape[2], d = q->shape[2], dv = vc->shape[3];
    if (kc->shape[3] != d)
        return fw_fail(FW_ERR_SHAPE, "q has head dim %lld but cache.k has %lld", (long long)d,
                       (long long)kc->shape[3]);
    if (vc->shape[2] != hkv || vc->shape[0] != kc->shape[0] || vc->shape[1] != kc->shape[1])
        return fw_fail(FW_ERR_SHAPE, "cache.v [%lld, %lld, %lld, .] does not match cache.k [%lld, %lld, %lld, .]",
                       (long long)vc->shape[0], (long long)vc->shape[1], (long long)vc->shape[2],
                       (long long)kc->shape[0], (long long)kc->shape[1], (long long)kc->shape[2]);
    if (hq < 1 || hkv < 1 || hq % hkv)
        return fw_fail(FW_ERR_SHAPE, "the cache has %lld heads, which does not divide q's %lld heads",
                       (long long)hkv, (long long)hq);
    if (d < 1 || d > 1024 || dv < 1 || dv > 1024 || hq > 65536)
        return fw_fail(FW_ERR_SHAPE, "head dims must be 1..1024 and heads at most 65536: d %lld, dv %lld, hq %lld",
                       (long long)d, (long long)dv, (long long)hq);
    if (out->shape[0] != q->shape[0] || out->shape[1] != hq || out->shape[2] != dv)
        return fw_fail(FW_ERR_SHAPE, "out must be [%lld, %lld, %lld] (q rows, q heads, dv); it is [%lld, %lld, %lld]",
                       (long long)q->shape[0], (long long)hq, (long long)dv, (long long)out->shape[0],
                       (long long)out->shape[1], (long long)out->shape[2]);
    if (lse && (lse->shape[0] != hq || lse->shape[1] != q->shape[0]))
        return fw_fail(FW_ERR_SHAPE, "lse must be [hq, total_q] = [%lld, %lld]", (long long)hq,
                       (long long)q->shape[0]);
    if (k_new) {
        if ((s = fw_check_tensor(k_new, "k_new", 3, DT_IN)) || (s = fw_check_tensor(v_new, "v_new", 3, DT_IN)))
            return s;
        if (k_new->dtype != kc->dtype || v_new->dtype != kc->dtype)
            return fw_fail(FW_ERR_DTYPE, "k_new/v_new (%s/%s) must have the cache's dtype %s",
                           fw_dtype_name(k_new->dtype), fw_dtype_name(v_new->dtype), fw_dtype_name(kc->dtype));
        if (k_new->shape[0] != q->shape[0] || k_new->shape[1] != hkv || k_new->shape[2] != d ||
            v_new->shape[0] != q->shape[0] || v_new->shape[1] != hkv || v_new->shape[2] != dv)
            return fw_fail(FW_ERR_SHAPE, "k_new must be [total_q, hkv, d] = [%lld, %lld, %lld] and v_new "
                           "[%lld, %lld, %lld]", (long long)q->shape[0], (long long)hkv, (long long)d,
                           (long long)q->shape[0], (long long)hkv, (long long)dv);
    }
    if ((s = fw_check_no_alias(out, "out")) || (lse && (s = fw_check_no_alias(lse, "lse"))) ||
        (k_new && ((s = fw_check_no_alias(kc, "cache.k")) || (s = fw_check_no_alias(vc, "cache.v")))))
        return s;
    if ((s = check_params(params)))
        return s;
    if (batch < 0 || batch > INT32_MAX)
        return fw_fail(FW_ERR_ARG, "batch is %lld; it must be 0..2^31-1", (long long)batch);
    if ((s = check_lengths(cuq, batch, q->shape[0], "cu_seqlens_q")))
        return s;
    if (batch > 0 && !cache->seqlens)
        return fw_fail(FW_ERR_NULL, "cache.seqlens is NULL");
    const int paged = cache->block_table != NULL;
    const int64_t num_pages = kc->shape[0], rows = kc->shape[1];
    int64_t shift = 0, bts = 0;
    if (paged) {
        while (shift < 11 && ((int64_t)1 << shift) < rows)
            shift++;
        if (rows < 8 || rows > 1024 || ((int64_t)1 << shift) != rows)
            return fw_fail(FW_ERR_SHAPE, "page_size (cache.k dimension 1) is %lld; it must be a power of "
                           "two from 8 to 1024", (long long)rows);
        bts = cache->block_table_stride ? cache->block_table_stride : cache->max_pages;
        if (cache->max_pages < 1 || bts < cache->max_pages)
            return fw_fail(FW_ERR_ARG, "block table: max_pages %lld must be >= 1 and its row stride %lld "
                           ">= max_pages", (long long)cache->max_pages, (long long)bts);
    } else if (kc->shape[0] < batch) {
        return fw_fail(FW_ERR_SHAPE, "the contiguous cache holds %lld sequences but batch is %lld",
                       (long long)kc->shape[0], (long long)batch);
    }
    /* every sequence's context fits, every page it touches exists; no page written twice */
    unsigned char *written = NULL;
    if (paged && k_new && !(written = calloc((size_t)num_pages + 1, 1)))
        return fw_fail(FW_ERR_NOMEM, "cannot allocate %lld bytes to check the block table",
                       (long long)num_pages);
    for (int64_t i = 0; i < batch && !s; i++) {
        const int64_t old = cache->seqlens[i], n = (int64_t)cuq[i + 1] - cuq[i];
        const int64_t len = old + (k_new ? n : 0);
        if (old < 0) {
            s = fw_fail(FW_ERR_SEQLENS, "cache.seqlens[%lld] is %lld; it must be >= 0", (long long)i,
                        (long long)old);
        } else if (!paged) {
            if (len > rows)
                s = fw_fail(FW_ERR_SEQLENS, "sequence %lld needs %lld cache rows but the cache holds %lld",
                            (long long)i, (long long)len, (long long)rows);
        } else {
            const int64_t pages = (len + rows - 1) >> shift;
            if (pages > cache->max_pages)
                s = fw_fail(FW_ERR_SEQLENS, "sequence %lld needs %lld pages for %lld tokens but the block "
                            "table has %lld columns", (long long)i, (long long)pages, (long long)len,
                            (long long)cache->max_pages);
            for (int64_t pg = 0; pg < pages && !s; pg++) {
                int32_t e = cache->block_table[i * bts + pg];
                if (e < 0 || e >= num_pages)
                    s = fw_fail(FW_ERR_INDEX, "block_table[%lld][%lld] = %d is not a page of the cache "
                                "(0..%lld)", (long long)i, (long long)pg, (int)e, (long long)num_pages - 1);
                else if (written && n > 0 && pg >= (old >> shift)) {
                    if (written[e])
                        s = fw_fail(FW_ERR_INDEX, "page %d is written by two sequences (the second is %lld)",
                                    (int)e, (long long)i);
                    written[e] = 1;
                }
            }
        }
    }
    free(written);
    if (s)
        return s;

    p->q = q; p->k = kc; p->v = vc; p->out = out; p->lse = lse;
    p->cuq = cuq; p->varlen = 1; p->kvcache = 1; p->append = k_new != NULL;
    p->knew = k_new; p->vnew = v_new;
    p->batch = batch;
    p->hq = hq; p->hkv = hkv; p->G = hq / hkv; p->d = d; p->dv = dv;
    for (int i = 0; i < 3; i++) {
        p->qs[i] = q->stride[i]; p->os[i] = out->stride[i];
        p->ks[i] = kc->stride[i + 1]; p->vs[i] = vc->stride[i + 1];
    }
    p->kb = kc->stride[0]; p->vb = vc->stride[0];
    if (paged) {
        p->bt = cache->block_table; p->bt_stride = bts; p->page_shift = shift;
        p->kpage = kc->stride[0]; p->vpage = vc->stride[0];
    }
    p->cache_len = cache->seqlens;
    for (int64_t i = 0; i < batch; i++) {
        fw_attn_seq e = fw_attn_seq_get(p, i);
        p->sq = fw_max64(p->sq, e.sq);
        p->sk = fw_max64(p->sk, e.sk);
    }
    setup_common(p, lse, params);
    return FW_OK;
}

/* ------------------------------------------------------------- heuristics -- */

void fw_attn_tile_rows(int64_t G, int vl, int64_t sq_max, int *bq, int *M)
{
    int64_t b = G >= FW_ATTN_TILE_ROWS ? 1 : FW_ATTN_TILE_ROWS / G;
    b = fw_max64(1, fw_min64(b, sq_max));
    *bq = (int)b;
    *M = (int)(fw_ceil_div(G * b, vl) * vl);
}

int fw_attn_chunk_tiles(int64_t total_tiles, int threads)
{
    int64_t c = total_tiles / (8 * (int64_t)(threads > 0 ? threads : 1));
    return (int)fw_max64(1, fw_min64(FW_ATTN_CHUNK_MAX, c));
}

/* ------------------------------------------------------------- workspace -- */

typedef struct {
    size_t qt, ot, al, rng, vec, st, kf, vf, row, dec; /* byte offsets in a thread's part */
    size_t qw, kw, vw, pw;                             /* bf16 products' panels (pair layout) */
    size_t total;
} ws_layout;

static size_t up64(size_t x) { return (x + 63) & ~(size_t)63; }

/* Per-thread layout for tiles of M rows (the largest M any sequence length gives) and a
 * decode state for `units` K/V groups of up to FW_DEC_ROWS rows each; with bf16 products
 * also the pair-layout panels of the q tiles, one K/V tile and one P tile (kern/attn_kern.h):
 * for d = dv = 128, M = 64: 256 + 16 + 16 + 8 KiB. */
static ws_layout ws_plan(int64_t d, int64_t dv, int M, int64_t units, int bf16)
{
    ws_layout w;
    size_t f = sizeof(float), C = FW_ATTN_CHUNK_MAX, BK = FW_ATTN_BK;
    w.qt = 0;
    w.ot = w.qt + up64(C * (size_t)d * M * f);
    w.al = w.ot + up64(C * (size_t)dv * M * f);   /* a, l: 2 x C x M floats */
    w.rng = w.al + up64(2 * C * M * f);           /* row key ranges: 2 x C x M int64 */
    w.vec = w.rng + up64(2 * C * M * sizeof(int64_t)); /* bias, zero, lo, hi, pending x2 */
    w.st = w.vec + up64(6 * (size_t)M * f);
    w.kf = w.st + up64(BK * M * f);
    w.vf = w.kf + up64(BK * (size_t)d * f);
    w.row = w.vf + up64(BK * (size_t)dv * f);     /* q row (d) and output row (dv) */
    w.dec = w.row + up64(((size_t)d + dv) * f);   /* per unit and row: q, o, a, l */
    w.qw = w.dec + up64((size_t)units * FW_DEC_ROWS * ((size_t)d + dv + 2) * f);
    const size_t dw = bf16 ? ((size_t)d + 1) / 2 : 0, wsz = sizeof(uint32_t);
    w.kw = w.qw + up64(C * dw * M * wsz);
    w.vw = w.kw + up64(BK * dw * wsz);
    w.pw = w.vw + up64(bf16 ? BK / 2 * (size_t)dv * wsz : 0);
    w.total = w.pw + up64(bf16 ? BK / 2 * (size_t)M * wsz : 0);
    return w;
}

/* Rows of a tile for these flags (the plain kernel keeps one vector's worth). */
static int ws_rows(int64_t G, const fw_kernels *kt, uint32_t flags)
{
    int bq, M;
    if (flags & FW_ATTN_PLAIN)
        return kt->vl;
    fw_attn_tile_rows((flags & FW_ATTN_NO_GQA_PACK) ? 1 : G, kt->vl, INT64_MAX, &bq, &M);
    return M;
}

/* K/V groups a decode item carries: the K/V heads, or every q head without GQA packing. */
static int64_t ws_units(int64_t hq, int64_t hkv, uint32_t flags)
{
    return (flags & FW_ATTN_PLAIN) ? 0 : (flags & FW_ATTN_NO_GQA_PACK) ? hq : hkv;
}

/* Whole workspace: one part per thread, plus slack to align the first to 64 bytes. */
static size_t ws_bytes(int64_t hq, int64_t hkv, int64_t d, int64_t dv, const fw_kernels *kt,
                       int threads, uint32_t flags, int bf16)
{
    const int tiles_bf16 = bf16 && !(flags & FW_ATTN_PLAIN);
    return (size_t)threads * ws_plan(d, dv, ws_rows(hq / hkv, kt, flags), ws_units(hq, hkv, flags),
                                     tiles_bf16).total + 64;
}

static int eff_threads(const fw_attn_params *params)
{
    return params && params->threads > 0 ? params->threads : fw_cpu_count();
}

fw_status fw_attn_workspace_size(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                 const fw_attn_params *params, size_t *bytes)
{
    fw_clear_error();
    if (!q || !k || !v || !bytes)
        return fw_fail(FW_ERR_NULL, "%s is NULL", !q ? "q" : !k ? "k" : !v ? "v" : "bytes");
    if (q->ndim < 3 || q->ndim > 4 || k->ndim != q->ndim || v->ndim != q->ndim)
        return fw_fail(FW_ERR_SHAPE, "q, k, v must all be 4-D (dense) or 3-D (varlen)");
    int o = q->ndim - 3;
    int64_t hq = q->shape[o + 1], hkv = k->shape[o + 1], d = q->shape[o + 2], dv = v->shape[o + 2];
    if (hq < 1 || hkv < 1 || hq % hkv || d < 1 || d > 1024 || dv < 1 || dv > 1024 || hq > 65536)
        return fw_fail(FW_ERR_SHAPE, "heads %lld/%lld or head dims %lld/%lld are invalid",
                       (long long)hq, (long long)hkv, (long long)d, (long long)dv);
    fw_attn_params dflt;
    fw_attn_params_init(&dflt);
    fw_status s = check_params(params ? params : &dflt);
    if (s)
        return s;
    const fw_kernels *kt = fw_kernels_get(params ? params->isa : NULL);
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    *bytes = ws_bytes(hq, hkv, d, dv, kt, eff_threads(params), params ? params->flags : 0,
                      fw_attn_bf16_products(q->dtype, params ? params->precision : FW_PREC_AUTO));
    return FW_OK;
}

/* ----------------------------------------------------------- tiled kernel -- */

typedef struct {
    int64_t seq, head, chunk; /* head: K/V head, or the q head when GQA packing is off */
    int64_t kb, ke;           /* the keys this item covers: [kb, ke) */
    int64_t part;             /* split items: offset of this split's partials, else -1 */
    int64_t cost;
} item;

typedef struct {
    const fw_attn_prob *p;
    const fw_kernels *kt;
    uint32_t flags;
    int G;             /* q heads stacked per tile */
    int chunk;         /* q tiles per chunk */
    float qscale, cap2;
    item *items;
    float *part;       /* split partials: per split, M rows of (dv accumulators, a, l) */
    unsigned *sink;    /* per thread (64 bytes apart): keeps the decode sweep's reads alive */
    char *ws;
    size_t ws_stride;
    ws_layout wl;
} run_ctx;

/* The key range a q tile needs: [lo, hi) is the union of its rows' visible ranges, and
 * [clo, chi) their intersection (empty if any row sees nothing): a K/V tile inside the
 * intersection needs no mask. */
typedef struct {
    int64_t lo, hi, clo, chi;
} tile_keys;

/* The result of one query row: out = o / l (0 if the row saw no key), lse = (a + log2 l) ln 2.
 * o: dv unnormalised f32 accumulators; a, l: anchor/max and sum in log2 units. */
static void store_row(const run_ctx *c, const fw_attn_seq *sq, int64_t h, int64_t pos, float *o,
                      float a, float l)
{
    const fw_attn_prob *p = c->p;
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;
    for (int64_t j = 0; j < p->dv; j++)
        o[j] *= inv;
    c->kt->from_f32(o, p->dv, (void *)fw_elem(p->out, sq->o0 + pos * p->os[0] + h * p->os[1]),
                    p->out->dtype, p->os[2]);
    if (p->lse)
        ((float *)p->lse->data)[sq->lse0 + h * p->lse_h + pos * p->lse_r] =
            l == 0.0f ? -INFINITY : (float)(((double)a + log2((double)l)) * FW_LN2);
}

/* A split item's partial for tile row m: (o[dv], a, l), unnormalised, for the merge. */
static void store_partial(const run_ctx *c, const item *it, int m, const float *o, float a, float l)
{
    const int64_t dv = c->p->dv;
    float *dst = c->part + it->part + (size_t)m * (dv + 2);
    memcpy(dst, o, (size_t)dv * sizeof(float));
    dst[dv] = a;
    dst[dv + 1] = l;
}

/* Element offsets of K and V rows t0 .. t1-1 (head 0), one page lookup per row. */
static void key_offsets(const fw_attn_prob *p, const fw_attn_seq *sq, int64_t t0, int64_t t1,
                        int64_t *koff, int64_t *voff)
{
    for (int64_t j = t0; j < t1; j++) {
        koff[j - t0] = fw_attn_key(p, sq, j, 0);
        voff[j - t0] = fw_attn_key(p, sq, j, 1);
    }
}

/* Reads one byte of every cache line of the tile's token rows (all heads), K then V, in
 * address order: sequential demand reads the hardware streamers follow, so the per-head
 * kernels after it find the tile in L2. */
static unsigned sweep_rows(const fw_attn_prob *p, const int64_t *koff, const int64_t *voff, int nk,
                           int64_t span, size_t es)
{
    unsigned acc = 0;
    const unsigned char *kb = p->k->data, *vb = p->v->data;
    for (int j = 0; j < nk; j++)
        for (int64_t b = 0; b < span; b += 64)
            acc += kb[koff[j] * (int64_t)es + b];
    for (int j = 0; j < nk; j++)
        for (int64_t b = 0; b < span; b += 64)
            acc += vb[voff[j] * (int64_t)es + b];
    return acc;
}

/* Decode path: every K/V group ("unit": a K/V head, or a q head without GQA packing) of one
 * sequence over the item's key range, with keys along the vector lanes. Each 64-key tile is
 * taken for all units before the next, so every token row of the cache (all heads) is read
 * once, front to back, while it is in cache; the next tile is prefetched meanwhile. A unit
 * holds R = G x n rows, row r = g * n + i (as in a q tile with bq = n).
 * Measured (bf16, GQA 32:8, d 128, 32K keys, K/V GB/s on 1 / 2 threads): one head per item
 * 3.8 / 7.5; all heads per item 7.2 / 16.0; + V read in place and a steady next-tile
 * prefetch 12.3 / 22.2; + the address-order sweep of each tile 14.1 / 25.7 (sweeping the
 * next tile's slices between heads instead: 12.6 / 23.4; sweep without prefetch: 12.2 / 23.0).
 * The rest is compute: G = 4 rows give 4 FMAs per element, and the K transpose is a third of
 * the time. */
static void decode_item(const run_ctx *c, const item *it, const fw_attn_seq *sq, int tid)
{
    const fw_attn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    const int G = c->G, n = (int)sq->sq, R = G * n, d = (int)p->d, dv = (int)p->dv;
    const int gqa = !(c->flags & FW_ATTN_NO_GQA_PACK);
    const int64_t units = gqa ? p->hkv : p->hq;
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
    const void *rows[FW_DEC_KEYS], *vrows[FW_DEC_KEYS];
    for (int64_t u = 0; u < units; u++)
        for (int g = 0; g < G; g++)
            for (int i = 0; i < n; i++) {
                const int64_t r = u * R + g * n + i, h = gqa ? u * p->G + g : u;
                const char *src = fw_elem(p->q, sq->q0 + i * p->qs[0] + h * p->qs[1]);
                if (bf16) {
                    kt->to_f32(src, p->q->dtype, p->qs[2], d, 1.0f, qrow);
                    kt->pack_row_pairs(qrow, d, QW + (size_t)r * dw);
                } else {
                    kt->to_f32(src, p->q->dtype, p->qs[2], d, c->qscale, Q + (size_t)r * d);
                }
                A[r] = -INFINITY;
                L[r] = 0.0f;
            }
    memset(O, 0, (size_t)(units * R * dv) * sizeof(float));
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
    /* bytes of one token's row over all heads, when the heads lie together in K and in V and
     * every unit iterates once per token (else 0: prefetch per head) */
    const int64_t kspan = ((p->hkv - 1) * p->ks[1] + p->d * p->ks[2]) * (int64_t)es;
    const int64_t vspan = ((p->hkv - 1) * p->vs[1] + p->dv * p->vs[2]) * (int64_t)es;
    const int64_t span = gqa && kspan == vspan && kspan <= 2 * p->hkv * kline ? kspan : 0;
    int64_t koff[2][FW_DEC_KEYS], voff[2][FW_DEC_KEYS];
    unsigned touch = 0;
    const int64_t tfirst = klo < khi ? klo / FW_DEC_KEYS * FW_DEC_KEYS : khi;
    if (tfirst < khi)
        key_offsets(p, sq, tfirst, fw_min64(sq->sk, tfirst + FW_DEC_KEYS), koff[0], voff[0]);
    for (int64_t t0 = tfirst, cur = 0; t0 < khi; t0 += FW_DEC_KEYS, cur ^= 1) {
        const int64_t t1 = fw_min64(sq->sk, t0 + FW_DEC_KEYS), tn = fw_min64(khi, t1 + FW_DEC_KEYS);
        const int nk = (int)(t1 - t0), nn = (int)fw_max64(0, tn - t1);
        if (nn > 0)
            key_offsets(p, sq, t1, tn, koff[cur ^ 1], voff[cur ^ 1]);
        for (int r = 0; r < R; r++) {
            lo[r] = (float)fw_max64(0, fw_min64(nk, vlo[r] - t0));
            hi[r] = vhi[r] > vlo[r] ? (float)fw_max64(0, fw_min64(nk, vhi[r] - t0)) : 0.0f;
        }
        if (span)
            touch += sweep_rows(p, koff[cur], voff[cur], nk, span, es);
        for (int64_t u = 0; u < units; u++) {
            const int64_t kvh = gqa ? u : u / p->G;
            const char *kb = fw_elem(p->k, kvh * p->ks[1]), *vb = fw_elem(p->v, kvh * p->vs[1]);
            const int pf = gqa || u % p->G == 0;
            for (int j = 0; j < nk; j++) {
                /* A steady stream of prefetches for the next tile, in address order: iteration
                 * (u, j) takes slice u of token row j (all heads' K, then V) when the heads
                 * of a token lie together, else this head's row j. Measured (one thread,
                 * 32K keys): 10.9 GB/s prefetching per head, 12.0 GB/s with the whole next
                 * tile in one burst. */
                if (j < nn && span) {
                    const int64_t it = u * nk + j, tt = it / units, part = it % units;
                    if (tt < nn) {
                        const int64_t b0 = span * part / units, b1 = span * (part + 1) / units;
                        const char *kr = (const char *)p->k->data + koff[cur ^ 1][tt] * (int64_t)es;
                        const char *vr = (const char *)p->v->data + voff[cur ^ 1][tt] * (int64_t)es;
                        for (int64_t b = b0 & ~(int64_t)63; b < b1; b += 64) {
                            __builtin_prefetch(kr + b, 0, 2);
                            __builtin_prefetch(vr + b, 0, 2);
                        }
                    }
                } else if (j < nn && pf) {
                    for (int64_t b = 0; b < kline; b += 64)
                        __builtin_prefetch(kb + koff[cur ^ 1][j] * (int64_t)es + b, 0, 2);
                    for (int64_t b = 0; b < vline; b += 64)
                        __builtin_prefetch(vb + voff[cur ^ 1][j] * (int64_t)es + b, 0, 2);
                }
                rows[j] = kb + koff[cur][j] * (int64_t)es;
                vrows[j] = vb + voff[cur][j] * (int64_t)es;
                if (!vdirect) {
                    kt->to_f32(vrows[j], p->v->dtype, p->vs[2], dv, 1.0f, Vf + (size_t)j * dv);
                    vrows[j] = Vf + (size_t)j * dv;
                }
            }
            float *Ou = O + (size_t)u * R * dv;
            if (bf16) {
                kt->pack_kt_bf16(rows, p->k->dtype, p->ks[2], nk, d, KtW);
                kt->dec_qk_bf16(R, nk, dw, QW + (size_t)u * R * dw, KtW, c->qscale, S);
            } else {
                kt->pack_kt(rows, p->k->dtype, p->ks[2], nk, d, Kt);
                kt->dec_qk(R, nk, d, Q + (size_t)u * R * d, Kt, S);
            }
            if (c->cap2 > 0.0f)
                kt->softcap(R, FW_DEC_KEYS, S, c->cap2);
            kt->dec_softmax(R, nk, S, lo, hi, A + u * R, L + u * R, Ou, dv);
            if (bf16)
                kt->dec_pv_bf16(R, nk, dv, S, vrows, vdirect ? p->v->dtype : FW_F32, PW, Ou);
            else
                kt->dec_pv(R, nk, dv, S, vrows, vdirect ? p->v->dtype : FW_F32, Ou);
        }
    }
    c->sink[tid * 16] += touch;
    for (int64_t u = 0; u < units; u++)
        for (int g = 0; g < G; g++)
            for (int i = 0; i < n; i++) {
                const int64_t r = u * R + g * n + i;
                if (it->part >= 0)
                    store_partial(c, it, (int)r, O + (size_t)r * dv, A[r], L[r]);
                else
                    store_row(c, sq, gqa ? u * p->G + g : u, i, O + (size_t)r * dv, A[r], L[r]);
            }
}

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
        c->kt->qk_bf16(nk, dw, M, o->KW, dw, o->QW, c->qscale, bias, ST);
    else
        c->kt->qk(nk, d, M, o->Kf, d, o->QT, bias, ST);
    if (c->cap2 > 0.0f)
        c->kt->softcap(nk, M, ST, c->cap2);
}

/* OT += P V over the tile's nk keys; bf16 products round P to bf16 pairs first. */
static void tile_pv(const run_ctx *c, const tile_ops *o, int nk, int M, const float *ST, float *OT)
{
    const int dv = (int)c->p->dv;
    if (!c->p->bf16) {
        c->kt->pv(nk, dv, M, o->Vf, dv, ST, OT);
        return;
    }
    const int nw = (nk + 1) / 2;
    for (int w = 0; w < nw; w++)
        c->kt->pack_pairs(ST + (size_t)2 * w * M, 2 * w + 1 < nk ? ST + (size_t)(2 * w + 1) * M : NULL,
                          M, o->PW + (size_t)w * M);
    c->kt->pv_bf16(nw, dv, M, o->VW, o->PW, OT);
}

static void chunk_item(void *vctx, int64_t idx, int tid)
{
    const run_ctx *c = vctx;
    const fw_attn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    const item *it = &c->items[idx];
    const fw_attn_seq sq = fw_attn_seq_get(p, it->seq);
    const int G = c->G, d = (int)p->d, dv = (int)p->dv;
    if (G * sq.sq <= FW_DEC_ROWS) {
        decode_item(c, it, &sq, tid);
        return;
    }
    int bq, M;
    fw_attn_tile_rows(G, kt->vl, sq.sq, &bq, &M);
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
    const int64_t p1 = fw_min64(sq.sq, p0 + (int64_t)c->chunk * bq);
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
                const char *src = fw_elem(p->q, sq.q0 + pos * p->qs[0] + (h0 + g) * p->qs[1]);
                kt->to_f32(src, p->q->dtype, p->qs[2], d, bf16 ? 1.0f : c->qscale, orow);
                for (int k = 0; k < d; k++)
                    qt[(size_t)k * M + m] = orow[k];
                int64_t vlo, vhi;
                fw_attn_visible(p, sq.sq, sq.sk, pos, &vlo, &vhi);
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
                kt->pack_pairs(qt + (size_t)2 * x * M, 2 * x + 1 < d ? qt + (size_t)(2 * x + 1) * M : NULL,
                               M, QW + ((size_t)r * dw + x) * M);
    }
    if (!skip) {
        klo = 0;
        khi = sq.sk;
    }
    klo = fw_max64(klo, it->kb); /* a split item covers its range of keys only */
    khi = fw_min64(khi, it->ke);
    const int64_t es = (int64_t)fw_dtype_size(p->k->dtype);
    const int64_t kline = ((d - 1) * p->ks[2] + 1) * es, vline = ((dv - 1) * p->vs[2] + 1) * es;
    for (int64_t t0 = klo < khi ? klo / FW_ATTN_BK * FW_ATTN_BK : khi; t0 < khi; t0 += FW_ATTN_BK) {
        const int64_t t1 = fw_min64(sq.sk, t0 + FW_ATTN_BK);
        const int nk = (int)(t1 - t0);
        /* K and V rows of this tile, converted to f32 once for every q tile and head here */
        for (int j = 0; j < nk; j++) {
            int64_t kr = fw_attn_key(p, &sq, t0 + j, 0) + kvh * p->ks[1];
            int64_t vr = fw_attn_key(p, &sq, t0 + j, 1) + kvh * p->vs[1];
            kt->to_f32(fw_elem(p->k, kr), p->k->dtype, p->ks[2], d, 1.0f, Kf + (size_t)j * d);
            kt->to_f32(fw_elem(p->v, vr), p->v->dtype, p->vs[2], dv, 1.0f, Vf + (size_t)j * dv);
            if (bf16) {
                uint16_t *kw = (uint16_t *)(KW + (size_t)j * dw);
                kt->from_f32(Kf + (size_t)j * d, d, kw, FW_BF16, 1);
                if (d & 1)
                    kw[d] = 0;
            }
        }
        if (bf16)
            for (int x = 0; x < (nk + 1) / 2; x++)
                kt->pack_pairs(Vf + (size_t)2 * x * dv, 2 * x + 1 < nk ? Vf + (size_t)(2 * x + 1) * dv : NULL,
                               dv, VW + (size_t)x * dv);
        /* Ask for the next tile's K and V rows now: they arrive while this tile's products run.
         * Without it the conversion above waited on memory for 10% of the time of a 4K causal
         * bf16 prefill (1 thread; rows 2 KiB apart defeat the hardware prefetcher). */
        for (int64_t j = t1; j < fw_min64(khi, t1 + FW_ATTN_BK); j++) {
            const char *kr = fw_elem(p->k, fw_attn_key(p, &sq, j, 0) + kvh * p->ks[1]);
            const char *vr = fw_elem(p->v, fw_attn_key(p, &sq, j, 1) + kvh * p->vs[1]);
            for (int64_t b = 0; b < kline; b += 64)
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
            if (kt->softmax(&sa)) {
                /* the static anchor's bound failed: replay this tile exactly, online */
                tile_qk(c, &ops, nk, M, zero, ST);
                sa.folded = 0;
                sa.online = 1;
                kt->softmax(&sa);
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
                    store_partial(c, it, m, orow, A[r * M + m], L[r * M + m]);
                else
                    store_row(c, &sq, h0 + g, p0 + (int64_t)r * bq + i, orow, A[r * M + m], L[r * M + m]);
            }
}

/* ------------------------------------------------------------ plain kernel -- */

/* One item: one (sequence, q head, block of PLAIN_ROWS query rows), each row on its own. */
#define PLAIN_ROWS 16

static void plain_item(void *vctx, int64_t idx, int tid)
{
    const run_ctx *c = vctx;
    const fw_attn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    const item *it = &c->items[idx];
    const fw_attn_seq sq = fw_attn_seq_get(p, it->seq);
    const int d = (int)p->d, dv = (int)p->dv;
    const int64_t h = it->head, kvh = h / p->G;
    char *w = c->ws + (size_t)tid * c->ws_stride;
    float *scratch = (float *)(w + c->wl.kf), *qrow = (float *)(w + c->wl.row);
    float *acc = (float *)(w + c->wl.ot);
    const int64_t r0 = it->chunk * PLAIN_ROWS, r1 = fw_min64(sq.sq, r0 + PLAIN_ROWS);
    for (int64_t r = r0; r < r1; r++) {
        kt->to_f32(fw_elem(p->q, sq.q0 + r * p->qs[0] + h * p->qs[1]), p->q->dtype, p->qs[2], d,
                   c->qscale, qrow);
        int64_t lo, hi;
        fw_attn_visible(p, sq.sq, sq.sk, r, &lo, &hi);
        float m = -INFINITY, l = 0.0f;
        for (int j = 0; j < dv; j++)
            acc[j] = 0.0f;
        /* runs of keys with a constant row stride: all of them, or one page at a time */
        for (int64_t j = lo; j < hi;) {
            const int64_t e = p->bt ? fw_min64(hi, ((j >> p->page_shift) + 1) << p->page_shift) : hi;
            kt->plain_row(qrow, d, dv, p->k->dtype, fw_elem(p->k, fw_attn_key(p, &sq, j, 0) + kvh * p->ks[1]),
                          p->ks[0], p->ks[2], fw_elem(p->v, fw_attn_key(p, &sq, j, 1) + kvh * p->vs[1]),
                          p->vs[0], p->vs[2], e - j, c->cap2, acc, &m, &l, scratch);
            j = e;
        }
        const float inv = l == 0.0f ? 0.0f : 1.0f / l;
        for (int j = 0; j < dv; j++)
            acc[j] *= inv;
        kt->from_f32(acc, dv, (void *)fw_elem(p->out, sq.o0 + r * p->os[0] + h * p->os[1]),
                     p->out->dtype, p->os[2]);
        if (p->lse)
            ((float *)p->lse->data)[sq.lse0 + h * p->lse_h + r * p->lse_r] =
                l == 0.0f ? -INFINITY : (float)(((double)m + log2((double)l)) * FW_LN2);
    }
}

/* ------------------------------------------------------------------ driver -- */

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
        float amax = -INFINITY;
        for (int64_t sp = 0; sp < mi->nsplit; sp++) {
            const float a = base[sp * split_stride + dv];
            amax = a > amax ? a : amax;
        }
        float l = 0.0f;
        for (int64_t j = 0; j < dv; j++)
            orow[j] = 0.0f;
        for (int64_t sp = 0; sp < mi->nsplit && amax != -INFINITY; sp++) {
            const float *src = base + sp * split_stride;
            if (src[dv] == -INFINITY)
                continue;
            const float w = exp2f(src[dv] - amax);
            for (int64_t j = 0; j < dv; j++)
                orow[j] += w * src[j];
            l += w * src[dv + 1];
        }
        const int64_t u = r / R, g = (r % R) / n, i = r % n;
        store_row(c, &sq, gqa ? u * p->G + g : u, i, orow, amax, l);
    }
}

int64_t fw_attn_kv_splits(int64_t sk)
{
    return sk > FW_KV_SPLIT ? fw_ceil_div(sk, FW_KV_SPLIT) : 1;
}

static fw_status run(const fw_attn_prob *p, const fw_attn_params *params)
{
    const uint32_t flags = params ? params->flags : 0;
    const fw_kernels *kt = fw_kernels_get(params ? params->isa : NULL);
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    const int threads = eff_threads(params);
    const int plain = (flags & FW_ATTN_PLAIN) != 0;
    run_ctx c;
    memset(&c, 0, sizeof c);
    c.p = p;
    c.kt = kt;
    c.flags = flags;
    c.G = (int)((flags & FW_ATTN_NO_GQA_PACK) ? 1 : p->G);
    c.cap2 = p->softcap > 0 ? (float)(p->softcap * FW_LOG2E) : 0.0f;
    /* scores come out in log2 units (or divided by the softcap): f32 products fold this
     * into q; bf16 products apply it to the f32 scores */
    c.qscale = (float)(p->softcap > 0 ? p->scale / p->softcap : p->scale * FW_LOG2E);
    const int64_t heads = (plain || (flags & FW_ATTN_NO_GQA_PACK)) ? p->hq : p->hkv;

    /* the work list: q tiles of each sequence's own size, grouped into chunks; a decode
     * sequence (G x n <= FW_DEC_ROWS rows per K/V head) is one item per key split instead,
     * all heads together */
    int64_t total_tiles = 0, n = 0, nmerge = 0, npart = 0;
    const int64_t units = ws_units(p->hq, p->hkv, flags);
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
        if (!plain && s.sq > 0 && c.G * s.sq <= FW_DEC_ROWS) {
            const int64_t ns = fw_attn_kv_splits(s.sk);
            n += ns;
            if (ns > 1) {
                nmerge++;
                npart += ns * units * c.G * s.sq * (p->dv + 2);
            }
        } else {
            n += fw_ceil_div(s.sq, plain ? PLAIN_ROWS : (int64_t)c.chunk * bq) * heads;
        }
    }
    if (n == 0)
        return FW_OK;
    const size_t need = ws_bytes(p->hq, p->hkv, p->d, p->dv, kt, threads, flags, p->bf16);
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
    c.wl = ws_plan(p->d, p->dv, ws_rows(p->G, kt, flags), units, p->bf16 && !plain);
    unsigned sink[256 * 16];
    c.sink = sink;
    c.ws_stride = c.wl.total;
    n = nmerge = npart = 0;
    for (int64_t i = 0; i < p->batch; i++) {
        const fw_attn_seq s = fw_attn_seq_get(p, i);
        int bq, M;
        fw_attn_tile_rows(c.G, kt->vl, s.sq, &bq, &M);
        if (!plain && s.sq > 0 && c.G * s.sq <= FW_DEC_ROWS) {
            const int64_t ns = fw_attn_kv_splits(s.sk), rows = units * c.G * s.sq;
            if (ns > 1) {
                merge_item mi = {i, ns, npart};
                merges[nmerge++] = mi;
            }
            for (int64_t sp = 0; sp < ns; sp++) {
                item e = {i, 0, 0, sp * FW_KV_SPLIT, ns > 1 ? (sp + 1) * FW_KV_SPLIT : INT64_MAX,
                          ns > 1 ? npart + sp * rows * (p->dv + 2) : -1,
                          units * fw_min64(FW_KV_SPLIT, s.sk) + FW_ATTN_BK};
                c.items[n++] = e;
            }
            npart += ns > 1 ? ns * rows * (p->dv + 2) : 0;
            continue;
        }
        const int64_t span = plain ? PLAIN_ROWS : (int64_t)c.chunk * bq;
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
    fw_parallel(threads, n, plain ? plain_item : chunk_item, &c);
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

/* Write each sequence's new rows at positions seqlens[i] .. seqlens[i] + n_i - 1. Runs after
 * validation, so every destination exists and no page is written by two sequences. */
static void append_rows(const fw_attn_prob *p)
{
    const size_t es = fw_dtype_size(p->k->dtype);
    for (int64_t i = 0; i < p->batch; i++) {
        const fw_attn_seq s = fw_attn_seq_get(p, i);
        for (int64_t r = 0; r < s.sq; r++)
            for (int v = 0; v < 2; v++) {
                const fw_tensor *src = v ? p->vnew : p->knew, *dst = v ? p->v : p->k;
                const int64_t *ds = v ? p->vs : p->ks, n = v ? p->dv : p->d;
                const int64_t row = fw_attn_key(p, &s, p->cache_len[i] + r, v);
                for (int64_t h = 0; h < p->hkv; h++) {
                    const char *a = (const char *)src->data +
                                    ((p->cuq[i] + r) * src->stride[0] + h * src->stride[1]) * (int64_t)es;
                    char *b = (char *)dst->data + (row + h * ds[1]) * (int64_t)es;
                    if (src->stride[2] == 1 && ds[2] == 1)
                        memcpy(b, a, (size_t)n * es);
                    else
                        for (int64_t x = 0; x < n; x++)
                            memcpy(b + x * ds[2] * (int64_t)es, a + x * src->stride[2] * (int64_t)es, es);
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
    if (!fw_kernels_get(params ? params->isa : NULL))
        return FW_ERR_UNSUPPORTED;
    if (p.append)
        append_rows(&p);
    return run(&p, params);
}
