/*
 * fuzz_kvcache.c: libFuzzer harness of the KV-cache call (fw_attn_kvcache_fwd).
 * The problem: a ragged batch (decode, multi-token decode, chunked prefill; mostly short
 * contexts, sometimes past a 512-key split), with or without new rows to append, a contiguous
 * cache or a paged one (page size 8..64 or 1..72, a block table with spare columns, a row stride,
 * read-only prefix pages shared between sequences, now and then in FW_KV_TILES' tile order),
 * layouts and dtypes as in fuzz_util.h, and
 * broken on purpose now and then: a page index out of range, a page two sequences write, a
 * negative or too-long length, a page size of 0 or past 65536, a short block table,
 * offsets that do not add up, NULL lengths, an aliased cache that would be written.
 * fp8 caches (FW_F8E4M3, FW_F8E5M2; k_new / v_new in f32, bf16 or f16) with k_descale /
 * v_descale, each a scalar (rank 0 or [1]) or [batch, hkv] of any layout, values in
 * [1/16, 16] or (unchecked values) 2^+-100; broken now and then: one missing, a value 0,
 * negative, NaN or +-inf, the wrong shape, rank or dtype, NULL data, a negative stride, and
 * descales on a cache that is not fp8. Attention sinks (fz_sinks) on every kind of problem.
 * Checks (beyond fuzz_util.h's): the reference and the kernel accept the same problems; on
 * FW_OK every cache byte is what it was except the appended rows, which hold k_new / v_new
 * (an fp8 cache: k_new / descale in f32, rounded by fw_f32_to_f8). The bar on bf16 products
 * is fuzz_attn.c's; on an fp8 cache the scores' and values' bounds carry the descales.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "attn/attn.h"
#include "fuzz_util.h"
#include "test_util.h"

#define MAXB 8
static const fw_dtype dts[3] = {FW_F32, FW_BF16, FW_F16};

/* Element offset of (token t, head h, column c) of sequence i in a cache tensor, K (v = 0) or
 * V (v = 1) (its entry batch_idx[i] of a contiguous cache with a batch_idx; the tile order of
 * FW_KV_TILES, flywheel.h). */
static int64_t cache_off(const fw_tensor *t, const fw_kv_cache *kc, int64_t bts, int64_t i,
                         int64_t tok, int64_t h, int64_t c, int v)
{
    if (!kc->block_table) {
        const int64_t e = kc->batch_idx ? kc->batch_idx[i] : i;
        return e * t->stride[0] + tok * t->stride[1] + h * t->stride[2] + c * t->stride[3];
    }
    const int64_t ps = t->shape[1], page = kc->block_table[i * bts + tok / ps], r = tok % ps;
    if (kc->layout == FW_KV_TILES) {
        const int64_t base = page * t->stride[0] + h * t->stride[2];
        return v ? base + (c / 16) * 16 * ps + (r / 2) * 32 + (c % 16) * 2 + r % 2
                 : base + (r / 16) * 16 * t->shape[3] + (c / 2) * 32 + (r % 16) * 2 + c % 2;
    }
    return page * t->stride[0] + r * t->stride[1] + h * t->stride[2] + c * t->stride[3];
}

/* Descale of sequence i, K/V head h (a scalar or [batch, hkv], f32). */
static float descale_at(const fw_tensor *t, int64_t i, int64_t h)
{
    return ((const float *)t->data)[t->ndim == 2 ? i * t->stride[0] + h * t->stride[1] : 0];
}

/* What the cache must hold after an append: the snapshot with sequence i's new rows at
 * positions seqlens[i] .. copied from src (k_new or v_new, the cache's dtype), or for an fp8
 * cache src / descale rounded to the cache's type. */
static void expect_append(unsigned char *want, const fw_tensor *cache, const fw_kv_cache *kc,
                          int64_t bts, const fw_tensor *src, const int32_t *cuq, int64_t batch, int v)
{
    const size_t es = fw_dtype_size(cache->dtype);
    const fw_tensor *desc = v ? kc->v_descale : kc->k_descale;
    for (int64_t i = 0; i < batch; i++)
        for (int64_t r = cuq[i]; r < cuq[i + 1]; r++)
            for (int64_t h = 0; h < cache->shape[2]; h++)
                for (int64_t c = 0; c < cache->shape[3]; c++) {
                    int64_t o = cache_off(cache, kc, bts, i, kc->seqlens[i] + r - cuq[i], h, c, v);
                    int64_t s = r * src->stride[0] + h * src->stride[1] + c * src->stride[2];
                    if (desc) {
                        const int64_t idx[3] = {r, h, c};
                        want[o] = fw_f32_to_f8((float)tget(src, idx) / descale_at(desc, i, h), cache->dtype);
                    } else {
                        memcpy(want + (size_t)o * es, (const char *)src->data + (size_t)s * es, es);
                    }
                }
}

/* A descale tensor for a batch of `batch` sequences and hkv heads: a scalar (rank 0 or [1])
 * or [batch, hkv] in any layout, values 2^(-4 .. 4) (or, with `extreme`, 2^+-100); broken (ft->bad)
 * now and then: a value 0, negative, NaN or +-inf, another shape, rank or dtype, NULL data, a
 * negative stride. */
static void draw_descale(fz_in *in, fz_tensor *ft, int64_t batch, int64_t hkv, int extreme)
{
    const unsigned kind = fz_byte(in) % 3;
    const int64_t shape[2] = {kind == 2 ? batch : 1, hkv};
    fz_tensor_new(in, ft, FW_F32, (int)kind, shape, 0, FZ_NONE, FZ_MODERATE, 1.0);
    const int64_t n = fz_numel(&ft->t);
    int64_t idx[2] = {0, 0};
    if (n)
        do
            tset(&ft->t, idx, extreme ? exp2(rng_uniform() < 0.5 ? -100 : 100) : exp2(8 * rng_uniform() - 4));
        while (tnext(&ft->t, idx));
    if (fz_byte(in) < 244)
        return;
    fw_tensor *t = &ft->t;
    static const double vals[5] = {0.0, -1.0, NAN, INFINITY, -INFINITY};
    switch (fz_byte(in) % 6) {
    case 0: /* a value a descale cannot have */
        if (n) {
            int64_t e = fz_range(in, 0, n - 1), at[2] = {t->ndim == 2 ? e / hkv : 0, t->ndim == 2 ? e % hkv : 0};
            tset(t, at, vals[fz_range(in, 0, 4)]);
            ft->bad = 1;
        }
        break;
    case 1: /* another shape: [batch + 1, hkv], [batch, hkv + 1] or [2] */
        if (t->ndim == 2)
            t->shape[fz_range(in, 0, 1)] += 1;
        else
            t->ndim = 1, t->shape[0] = 2, t->stride[0] = 0;
        ft->bad = 1;
        break;
    case 2: /* rank 3, [1, 1, 1] */
        t->ndim = 3;
        for (int i = 0; i < 3; i++)
            t->shape[i] = t->stride[i] = 1;
        ft->bad = 1;
        break;
    case 3: /* another dtype: f16, bf16, f64 or an fp8 type */
        t->dtype = (fw_dtype)(1 + fz_range(in, 0, 4));
        ft->bad = 1;
        break;
    case 4: /* NULL data behind elements */
        if (n) {
            t->data = NULL;
            ft->bad = 1;
        }
        break;
    case 5: /* a negative stride */
        if (t->ndim) {
            t->stride[fz_range(in, 0, t->ndim - 1)] = -1;
            ft->bad = 1;
        }
        break;
    }
}

static int has_alias(const fw_tensor *t)
{
    if (!fz_numel(t))
        return 0;
    for (int i = 0; i < t->ndim; i++)
        if (t->stride[i] == 0 && t->shape[i] > 1)
            return 1;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size, 0};
    /* the cache's dtype: f32, bf16, f16, or now and then fp8 (k_new / v_new then in ndt) */
    const unsigned cb = fz_byte(&in);
    fw_dtype cdt = cb < 232 ? dts[cb % 3] : cb % 2 ? FW_F8E4M3 : FW_F8E5M2, qdt = dts[fz_range(&in, 0, 2)], odt = dts[fz_range(&in, 0, 2)];
    fw_dtype ndt = cb < 232 ? cdt : dts[fz_range(&in, 0, 2)];
    int64_t hkv = 1 + fz_range(&in, 0, 2), G = 1 + fz_range(&in, 0, 3), hq = hkv * G;
    int64_t d = 1 + fz_size(&in, 15, 140), dv = fz_chance(&in, 160) ? d : 1 + fz_size(&in, 15, 140);
    const int append = !fz_chance(&in, 64);
    int paged = fz_chance(&in, 128);
    /* pages of a power of two, or of any size (vLLM's hybrid models use 1152) */
    int64_t batch = fz_size(&in, 4, MAXB);
    int64_t ps = !paged ? 0 : fz_chance(&in, 128) ? (int64_t)8 << fz_range(&in, 0, 3) : 1 + fz_range(&in, 0, 71);
    /* FW_KV_TILES now and then (vLLM's AMX layout), mostly on a problem it takes: paged bf16,
     * pages and head dims of 32 or 64 */
    const int tiles = fz_chance(&in, 40);
    if (tiles && fz_chance(&in, 200)) {
        cdt = ndt = FW_BF16;
        paged = 1;
        ps = 32 << fz_range(&in, 0, 1);
        d = 32 << fz_range(&in, 0, 1);
        dv = 32 << fz_range(&in, 0, 1);
    }
    int bad = 0;
    int32_t cuq[MAXB + 1] = {0}, seqlens[MAXB] = {0};
    int64_t maxlen = 0;
    for (int64_t i = 0; i < batch; i++) {
        int64_t n = fz_chance(&in, 128) ? 1 : fz_size(&in, 8, 70);
        seqlens[i] = (int32_t)(fz_chance(&in, 32) ? fz_range(&in, 0, 700) : fz_range(&in, 0, 40));
        cuq[i + 1] = cuq[i] + (int32_t)n;
        maxlen = fw_max64(maxlen, seqlens[i] + (append ? n : 0));
    }
    const int64_t tq = cuq[batch];
    if (maxlen * fw_max64(batch, 1) * hq * (d + dv) > (1 << 20))
        d = dv = 1 + d % 8; /* keeps an execution under a few milliseconds */

    /* the cache: contiguous [batch + spare, S, hkv, d], or pages [num_pages, ps, hkv, d] */
    int32_t *bt = NULL;
    int64_t max_pages = 0, bts = 0, num_pages = 0;
    if (paged) {
        for (int64_t i = 0; i < batch; i++) {
            int64_t len = seqlens[i] + (append ? cuq[i + 1] - cuq[i] : 0);
            max_pages = fw_max64(max_pages, (len + ps - 1) / ps);
            num_pages += (len + ps - 1) / ps;
        }
        max_pages += fz_range(&in, 0, 2);
        max_pages = fw_max64(max_pages, 1);
        num_pages += fz_range(&in, 0, 3);
        bts = max_pages + fz_range(&in, 0, 2);
        bt = malloc((size_t)(fw_max64(batch, 1) * bts) * sizeof(int32_t));
        /* a shuffled list of the pages: each sequence takes the next ones it needs */
        int32_t *perm = malloc((size_t)(num_pages + 1) * sizeof(int32_t));
        for (int64_t j = 0; j < num_pages; j++)
            perm[j] = (int32_t)j;
        for (int64_t j = num_pages - 1; j > 0; j--) {
            int64_t x = fz_range(&in, 0, j);
            int32_t t = perm[j]; perm[j] = perm[x]; perm[x] = t;
        }
        int64_t next = 0;
        for (int64_t i = 0; i < batch; i++) {
            int64_t len = seqlens[i] + (append ? cuq[i + 1] - cuq[i] : 0), np = (len + ps - 1) / ps;
            for (int64_t pg = 0; pg < bts; pg++)
                bt[i * bts + pg] = pg < np ? perm[next++] : (int32_t)(fz_chance(&in, 128) ? -1 : 0x7fffffff);
        }
        free(perm);
        /* read-only prefix pages shared with sequence 0 (prefix caching) */
        if (batch > 1 && fz_chance(&in, 64))
            for (int64_t i = 1; i < batch; i++)
                for (int64_t pg = 0; pg < fw_min64(seqlens[0], seqlens[i]) / ps; pg++)
                    bt[i * bts + pg] = bt[pg];
    }
    int64_t cs[4] = {paged ? num_pages : batch + fz_range(&in, 0, 2),
                     paged ? ps : maxlen + fz_range(&in, 0, 3), hkv, d};
    int64_t cvs[4] = {cs[0], cs[1], hkv, dv};
    int vq = fz_vclass(&in), vk = fz_vclass(&in), vv = fz_vclass(&in);
    fz_seed(&in);
    int64_t qs[3] = {tq, hq, d}, kns[3] = {tq, hkv, d}, vns[3] = {tq, hkv, dv}, os[3] = {tq, hq, dv},
            ls[2] = {hq, tq};
    fz_tensor q, kn, vn, kc, vc, o, l;
    fz_tensor_new(&in, &q, qdt, 3, qs, 0, FZ_ALL, vq, 1 + fz_range(&in, 0, 2));
    fz_tensor_new(&in, &kn, ndt, 3, kns, 0, FZ_ALL, vk, 1 + fz_range(&in, 0, 2));
    fz_tensor_new(&in, &vn, ndt, 3, vns, 0, FZ_ALL, vv, 1 + fz_range(&in, 0, 2));
    fz_tensor_new(&in, &kc, cdt, 4, cs, 0, paged ? 0xE : 0xC, vk, 1 + fz_range(&in, 0, 2));
    fz_tensor_new(&in, &vc, cdt, 4, cvs, 0, paged ? 0xE : 0xC, vv, 1 + fz_range(&in, 0, 2));
    fz_tensor_new(&in, &o, odt, 3, os, 1, FZ_ALL, 0, 0);
    const int with_lse = !fz_chance(&in, 40);
    fz_tensor_new(&in, &l, FW_F32, 2, ls, 1, with_lse ? FZ_ALL : FZ_NONE, 0, 0);
    bad |= q.bad | kc.bad | vc.bad | o.bad | (with_lse && l.bad) | (append && (kn.bad | vn.bad));
    bad |= append && (has_alias(&kc.t) || has_alias(&vc.t));

    fw_kv_cache cache = {kc.t, vc.t, bt, max_pages, bts, seqlens, NULL, NULL, FW_KV_ROWS, NULL, NULL};
    if (tiles) {
        /* each (page, head) block dense where the buffer spans the whole tensor (a broadcast
         * cache keeps its strides); refused unless paged bf16 with pages, d and dv multiples
         * of 32 and dense blocks; now and then a layout value past the enum */
        for (int v = 0; v < 2; v++) {
            fz_tensor *ct = v ? &vc : &kc;
            const int64_t n = ct->t.shape[3];
            if (!ct->bad && ct->bytes >= (size_t)fz_numel(&ct->t) * fw_dtype_size(cdt) && !has_alias(&ct->t)) {
                /* (a new buffer: restriding the old one read the padding a padded layout
                 * left unwritten; found by fuzz_kvcache itself) */
                const int64_t st[4] = {ct->t.shape[2] * ct->t.shape[1] * n, n, ct->t.shape[1] * n, 1};
                fz_tensor_relayout(ct, st);
            }
        }
        cache.k = kc.t;
        cache.v = vc.t;
        cache.layout = fz_chance(&in, 240) ? 2 + (int32_t)fz_range(&in, 0, 5) : FW_KV_TILES;
        bad |= cache.layout != FW_KV_TILES || !paged || cdt != FW_BF16 || ps % 32 || d % 32 || dv % 32 ||
               kc.t.stride[1] != d || kc.t.stride[3] != 1 || vc.t.stride[1] != dv || vc.t.stride[3] != 1;
    }
    if (paged && fz_chance(&in, 64))
        cache.block_table_stride = 0, bts = max_pages; /* 0: rows max_pages apart */
    /* cache_leftpad: each context from a row in 0 .. seqlens[i]; with a block table, refused */
    int32_t leftpad[MAXB] = {0};
    if (batch > 0 && fz_chance(&in, 48)) {
        for (int64_t i = 0; i < batch; i++)
            leftpad[i] = (int32_t)fz_range(&in, 0, seqlens[i]);
        cache.leftpad = leftpad;
        bad |= paged;
    }
    /* cache_batch_idx: distinct entries of a contiguous cache, shuffled; with pages, refused */
    int32_t entry[MAXB + 2] = {0};
    if (batch > 0 && fz_chance(&in, 48)) {
        const int64_t ne = paged ? batch : cs[0];
        for (int64_t j = 0; j < ne; j++)
            entry[j] = (int32_t)j;
        for (int64_t j = ne - 1; j > 0; j--) {
            int64_t x = fz_range(&in, 0, j);
            int32_t t = entry[j]; entry[j] = entry[x]; entry[x] = t;
        }
        cache.batch_idx = entry;
        bad |= paged;
    }
    /* broken on purpose */
    int null_cuq = 0;
    if (fz_chance(&in, 24)) {
        unsigned what = fz_byte(&in) % 10;
        int64_t i = batch ? fz_range(&in, 0, batch - 1) : 0;
        int64_t len = seqlens[i] + (append ? cuq[i + 1] - cuq[i] : 0);
        if (what == 0 && batch) { /* a negative length */
            seqlens[i] = -1 - (int32_t)fz_range(&in, 0, 5);
            bad = 1;
        } else if (what == 1 && batch) { /* a context longer than the cache holds */
            seqlens[i] = (int32_t)(paged ? max_pages * ps : cs[1]) + 1;
            bad = 1;
        } else if (what == 2 && paged && len > 0) { /* a page index out of range */
            bt[i * bts + fz_range(&in, 0, (len - 1) / ps)] = fz_chance(&in, 128) ? -1 : (int32_t)num_pages;
            bad = 1;
        } else if (what == 3 && paged && append && batch > 1) { /* a page two sequences write */
            int64_t j = (i + 1) % batch, lj = seqlens[j] + cuq[j + 1] - cuq[j];
            if (cuq[i + 1] > cuq[i] && cuq[j + 1] > cuq[j] && lj > 0) {
                bt[i * bts + (len - 1) / ps] = bt[j * bts + (lj - 1) / ps];
                bad = 1;
            }
        } else if (what == 4 && paged) { /* a page size past the largest, or 0 */
            cache.k.shape[1] = cache.v.shape[1] = fz_chance(&in, 128) ? 65537 : 0;
            bad = 1;
        } else if (what == 5 && paged) { /* a block table too narrow, or its stride too short */
            if (fz_chance(&in, 128))
                cache.max_pages = 0;
            else
                cache.block_table_stride = max_pages - 1 > 0 ? max_pages - 1 : -1;
            bad = 1;
        } else if (what == 6 && batch) { /* NULL lengths or offsets */
            if (fz_chance(&in, 128))
                cache.seqlens = NULL;
            else
                null_cuq = 1;
            bad = 1;
        } else if (what == 8 && batch && !paged) { /* a leftpad past the cached rows, or negative */
            leftpad[i] = fz_chance(&in, 128) ? -1 : seqlens[i] + 1 + (int32_t)fz_range(&in, 0, 3);
            cache.leftpad = leftpad;
            bad = 1;
        } else if (what == 9 && batch && !paged) { /* an entry past the cache, or written twice */
            if (!cache.batch_idx) {
                for (int64_t j = 0; j < batch; j++)
                    entry[j] = (int32_t)j;
                cache.batch_idx = entry;
            }
            int64_t j = (i + 1) % batch;
            if (fz_chance(&in, 128) || !append || batch < 2 || cuq[i + 1] == cuq[i] || cuq[j + 1] == cuq[j])
                entry[i] = fz_chance(&in, 128) ? -1 : (int32_t)cs[0];
            else
                entry[i] = entry[j];
            bad = 1;
        } else if (what == 7) { /* a negative batch, or offsets that do not end at total_q */
            if (fz_chance(&in, 128))
                batch = -1;
            else
                cuq[batch] += 1;
            bad = 1;
        }
    }
    const int32_t *cuq_arg = null_cuq ? NULL : cuq;
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.causal = fz_chance(&in, 192);
    if (fz_chance(&in, 32))
        p.window_left = fz_range(&in, -2, 600);
    if (fz_chance(&in, 16))
        p.softcap = (float)fz_range(&in, 1, 100) / 4.0f;
    p.threads = (int32_t)fz_range(&in, 0, 3);
    p.isa = fz_isa(&in);
    p.flags = fz_byte(&in) & 15;
    p.flags |= fz_dec_prefetch(&in);
    p.precision = (int32_t)fz_range(&in, 0, 2);
    /* attention sinks now and then (fz_sinks) */
    fz_tensor snk;
    int vsink;
    if (fz_sinks(&in, &snk, hq, &vsink)) {
        p.sinks = &snk.t;
        bad |= snk.bad;
    }
    /* descales: an fp8 cache's (one now and then missing), now and then on another cache;
     * none of the rare cases for an input that ends here (its bytes read as zeros) */
    const int f8 = cdt == FW_F8E4M3 || cdt == FW_F8E5M2;
    fz_tensor kd = {0}, vd = {0};
    const int extreme = f8 && fz_byte(&in) >= 248;
    if (f8 || fz_byte(&in) >= 252) {
        draw_descale(&in, &kd, batch, hkv, extreme);
        draw_descale(&in, &vd, batch, hkv, extreme);
        cache.k_descale = &kd.t;
        cache.v_descale = &vd.t;
        bad |= !f8 || kd.bad || vd.bad;
        if (f8 && fz_byte(&in) >= 250) {
            if (fz_chance(&in, 128))
                cache.k_descale = NULL;
            else
                cache.v_descale = NULL;
            bad = 1;
        }
    }

    fz_desc[0] = 0;
    fz_describe("kvcache %s%s%s batch %lld, hq %lld, hkv %lld, d %lld, dv %lld; page size %lld, "
                "max_pages %lld, stride %lld, pages %lld; causal %d window %lld softcap %g "
                "threads %d isa %s flags %u precision %d",
                paged ? "paged" : "contiguous", append ? " append" : "",
                cache.layout == FW_KV_ROWS ? "" : cache.layout == FW_KV_TILES ? " tiles" : " layout?", (long long)batch,
                (long long)hq, (long long)hkv, (long long)d, (long long)dv, (long long)ps,
                (long long)cache.max_pages, (long long)cache.block_table_stride, (long long)num_pages,
                (int)p.causal, (long long)p.window_left, (double)p.softcap, (int)p.threads,
                p.isa ? p.isa : "default", (unsigned)p.flags, (int)p.precision);
    for (int64_t i = 0; i < batch && i < MAXB; i++)
        fz_describe("%s(%d+%d%s%d)", i ? " " : "\n  seqs ", (int)seqlens[i], (int)(cuq[i + 1] - cuq[i]),
                    cache.leftpad ? ", leftpad " : "", cache.leftpad ? (int)leftpad[i] : 0);
    if (cache.batch_idx)
        for (int64_t i = 0; i < batch && i < MAXB; i++)
            fz_describe("%s%d", i ? " " : "\n  batch_idx ", (int)entry[i]);
    fz_describe_tensor("q", &q, vq);
    fz_describe_tensor("k_new", &kn, vk);
    fz_describe_tensor("v_new", &vn, vv);
    fz_describe_tensor("cache.k", &kc, vk);
    fz_describe_tensor("cache.v", &vc, vv);
    if (p.sinks)
        fz_describe_tensor("sinks", &snk, vsink);
    if (cache.k_descale)
        fz_describe_tensor("k_descale", &kd, extreme ? FZ_HUGE : FZ_MODERATE);
    if (cache.v_descale)
        fz_describe_tensor("v_descale", &vd, extreme ? FZ_HUGE : FZ_MODERATE);
    fz_describe_tensor("out", &o, -1);

    /* the references first: the kernel appends to the cache they read */
    const fw_tensor *knp = append ? &kn.t : NULL, *vnp = append ? &vn.t : NULL, *lp = with_lse ? &l.t : NULL;
    int64_t no = fz_numel(&o.t), nl = fz_numel(&l.t);
    double *ex = calloc((size_t)(no + nl) + 1, sizeof(double)), *sr = calloc((size_t)(no + nl) + 1, sizeof(double));
    fw_tensor eo = fw_tensor_contiguous(ex, FW_F64, 3, os), el = fw_tensor_contiguous(ex + no, FW_F64, 2, ls);
    fw_tensor ro = fw_tensor_contiguous(sr, FW_F64, 3, os), rl = fw_tensor_contiguous(sr + no, FW_F64, 2, ls);
    fw_attn_params rp = p;
    rp.precision = FW_PREC_F32;
    const int bf16 = !(p.flags & FW_ATTN_PLAIN) && fw_bf16_products(p.isa, qdt, p.precision);
    fw_status rs = bad ? FW_ERR_ARG
                       : fw_attn_kvcache_ref(&q.t, knp, vnp, cuq_arg, batch, &cache, &eo, with_lse ? &el : NULL, &rp);
    if (rs == FW_OK && bf16) {
        rp.precision = FW_PREC_BF16;
        rs = fw_attn_kvcache_ref(&q.t, knp, vnp, cuq_arg, batch, &cache, &ro, with_lse ? &rl : NULL, &rp);
    } else if (rs == FW_OK) {
        memcpy(sr, ex, (size_t)(no + nl) * sizeof(double));
    }

    unsigned char *so = fz_snapshot(&o), *sl = fz_snapshot(&l), *sk = fz_snapshot(&kc), *sv = fz_snapshot(&vc);
    fw_status st = fw_attn_kvcache_fwd(&q.t, knp, vnp, cuq_arg, batch, &cache, &o.t, lp, &p);
    FZ_CHECK(st == FW_OK || *fw_last_error(), "status %d without a message", (int)st);
    if (bad)
        FZ_CHECK(st != FW_OK, "a broken problem was accepted");
    else
        FZ_CHECK((st == FW_OK) == (rs == FW_OK), "the kernel says %d, the reference %d (%s)", (int)st,
                 (int)rs, fw_last_error());
    if (st != FW_OK) {
        FZ_CHECK(fz_unchanged(&o, so) && fz_unchanged(&l, sl), "failed (%s) but wrote its outputs",
                 fw_last_error());
        FZ_CHECK(fz_unchanged(&kc, sk) && fz_unchanged(&vc, sv), "failed (%s) but wrote the cache",
                 fw_last_error());
    } else {
        if (append) {
            expect_append(sk, &kc.t, &cache, bts, &kn.t, cuq, batch, 0);
            expect_append(sv, &vc.t, &cache, bts, &vn.t, cuq, batch, 1);
        }
        FZ_CHECK(fz_unchanged(&kc, sk) && fz_unchanged(&vc, sv),
                 "the cache differs from its old bytes plus the appended rows");
        const int values = vq != FZ_HUGE && vk != FZ_HUGE && vv != FZ_HUGE && !extreme;
        /* an fp8 cache's elements stand for byte x descale */
        const double kds = f8 ? fz_absmax(&kd.t) : 1, vds = f8 ? fz_absmax(&vd.t) : 1;
        const double vmax = fmax(fz_absmax(&vc.t) * vds, append ? fz_absmax(&vn.t) : 0);
        const double kmax = fmax(fz_absmax(&kc.t) * kds, append ? fz_absmax(&kn.t) : 0);
        const double smax = (1 / sqrt((double)d)) * fz_absmax(&q.t) * kmax * (double)d;
        fz_compare("out", &o.t, sr, ex, no, values, vv == FZ_SPECIAL ? FZ_WIDER | FZ_ANY_NONFINITE : 0,
                   vmax * (2 * fz_eps(odt) + 1e-4 + 8 * smax * 0x1p-23 + (bf16 ? 0x1p-8 : 0)));
        if (with_lse)
            fz_compare("lse", &l.t, sr + no, ex + no, nl, values, 0, fz_lse_slack(ex + no, nl, smax));
    }
    free(ex); free(sr); free(so); free(sl); free(sk); free(sv); free(bt);
    fz_tensor_free(&q); fz_tensor_free(&kn); fz_tensor_free(&vn); fz_tensor_free(&kc);
    fz_tensor_free(&vc); fz_tensor_free(&o); fz_tensor_free(&l); fz_tensor_free(&snk);
    fz_tensor_free(&kd); fz_tensor_free(&vd);
    return 0;
}
