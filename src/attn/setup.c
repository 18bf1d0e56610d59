/*
 * attn/setup.c: attention's validation: params, tensors, cu_seqlens and the KV cache, into
 * one fw_attn_prob (attn.h) for the kernel driver and the reference alike; the per-sequence
 * view of it; the tiling heuristics (pure functions, unit-tested).
 */
#include <float.h>
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

/* Offsets of the varlen sequences; attention also admits NULL for an empty batch (no
 * sequences, no rows). */
static fw_status check_cu(const int32_t *cu, int64_t batch, int64_t total, const char *name)
{
    if (!cu && batch == 0 && total == 0)
        return FW_OK;
    return fw_check_cu_seqlens(cu, batch, total, name);
}

fw_status fw_attn_check_params(const fw_attn_params *params)
{
    if (!isfinite(params->scale))
        return fw_fail(FW_ERR_ARG, "scale is %g; it must be finite (0 means 1/sqrt(d))",
                       (double)params->scale);
    if (!(params->softcap >= 0.0f) || !isfinite(params->softcap))
        return fw_fail(FW_ERR_ARG, "softcap is %g; it must be finite and >= 0 (0 = off)",
                       (double)params->softcap);
    if (params->causal != 0 && params->causal != 1)
        return fw_fail(FW_ERR_ARG, "causal is %d; it must be 0 or 1", (int)params->causal);
    fw_status s;
    if ((s = fw_check_threads(params->threads)))
        return s;
    if (params->precision < FW_PREC_AUTO || params->precision > FW_PREC_BF16)
        return fw_fail(FW_ERR_ARG, "precision is %d; it must be FW_PREC_AUTO (0), FW_PREC_F32 (1) "
                       "or FW_PREC_BF16 (2)", (int)params->precision);
    if (params->flags & ~(uint32_t)(FW_ATTN_ONLINE_SOFTMAX | FW_ATTN_NO_GQA_PACK |
                                    FW_ATTN_NO_TILE_SKIP | FW_ATTN_PLAIN | FW_ATTN_DEC_PREFETCH |
                                    FW_ATTN_NO_DEC_PREFETCH))
        return fw_fail(FW_ERR_ARG, "flags 0x%x has unknown bits", (unsigned)params->flags);
    if ((params->flags & FW_ATTN_DEC_PREFETCH) && (params->flags & FW_ATTN_NO_DEC_PREFETCH))
        return fw_fail(FW_ERR_ARG, "flags 0x%x set both FW_ATTN_DEC_PREFETCH and "
                       "FW_ATTN_NO_DEC_PREFETCH", (unsigned)params->flags);
    if (params->rotary_interleaved != 0 && params->rotary_interleaved != 1)
        return fw_fail(FW_ERR_ARG, "rotary_interleaved is %d; it must be 0 (GPT-NeoX halves) or 1 "
                       "(GPT-J pairs)", (int)params->rotary_interleaved);
    if (params->rotary_q_only != 0 && params->rotary_q_only != 1)
        return fw_fail(FW_ERR_ARG, "rotary_q_only is %d; it must be 0 or 1",
                       (int)params->rotary_q_only);
    return FW_OK;
}

/* The rotary embedding of params on a validated problem: the tables' ranks, shapes and dtype,
 * and every position the call uses (query positions sk - sq + i must not be negative). */
static fw_status setup_rotary(fw_attn_prob *p, const fw_attn_params *params)
{
    const fw_tensor *c = params->rotary_cos, *sn = params->rotary_sin;
    if (!c && !sn)
        return FW_OK;
    if (!c || !sn)
        return fw_fail(FW_ERR_NULL, "rotary_%s is NULL but rotary_%s is given: pass both or neither",
                       c ? "sin" : "cos", c ? "cos" : "sin");
    fw_status s;
    if ((s = fw_check_tensor(c, "rotary_cos", 2, FW_DT_IN)) ||
        (s = fw_check_tensor(sn, "rotary_sin", 2, FW_DT_IN)))
        return s;
    if (c->dtype != sn->dtype || c->shape[0] != sn->shape[0] || c->shape[1] != sn->shape[1])
        return fw_fail(FW_ERR_SHAPE, "rotary_cos (%s [%lld, %lld]) and rotary_sin (%s [%lld, %lld]) "
                       "must share a shape and dtype", fw_dtype_name(c->dtype), (long long)c->shape[0],
                       (long long)c->shape[1], fw_dtype_name(sn->dtype), (long long)sn->shape[0],
                       (long long)sn->shape[1]);
    if (c->shape[1] < 1 || 2 * c->shape[1] > p->d)
        return fw_fail(FW_ERR_SHAPE, "rotary_cos is [%lld, %lld]: rotary_dim = 2 x %lld must be 2..d "
                       "(%lld)", (long long)c->shape[0], (long long)c->shape[1], (long long)c->shape[1],
                       (long long)p->d);
    if (p->kvcache && !p->append && !params->rotary_q_only)
        return fw_fail(FW_ERR_ARG, "rotary embedding in a KV-cache call needs k_new and v_new (it "
                       "rotates the new keys as they are appended; the cache holds rotated keys), "
                       "or rotary_q_only");
    for (int64_t i = 0; i < p->batch; i++) {
        const fw_attn_seq e = fw_attn_seq_get(p, i);
        if (e.sq > e.sk)
            return fw_fail(FW_ERR_SHAPE, "sequence %lld has %lld queries but %lld keys: with rotary "
                           "embedding query i sits at position sk - sq + i, which must not be negative",
                           (long long)i, (long long)e.sq, (long long)e.sk);
        if (e.sk > c->shape[0])
            return fw_fail(FW_ERR_SHAPE, "rotary_cos has %lld positions but sequence %lld uses "
                           "positions up to %lld", (long long)c->shape[0], (long long)i,
                           (long long)e.sk - 1);
    }
    p->rcos = c;
    p->rsin = sn;
    p->rhalf = c->shape[1];
    p->rinter = params->rotary_interleaved;
    p->rot_k = !p->kvcache && !params->rotary_q_only;
    p->rot_append = p->kvcache && !params->rotary_q_only;
    p->rot_q_fixed = p->kvcache && !p->causal && p->wl < 0 && p->wr < 0;
    return FW_OK;
}

void fw_attn_rotate(const fw_attn_prob *p, const fw_kernels *kt, float *x, int64_t pos)
{
    const fw_tensor *c = p->rcos, *sn = p->rsin;
    const char *cr = fw_elem(c, pos * c->stride[0]), *sr = fw_elem(sn, pos * sn->stride[0]);
    if (c->dtype == FW_F32 && c->stride[1] == 1 && sn->stride[1] == 1) {
        kt->rope.rotate(x, (int)p->rhalf, (const float *)cr, (const float *)sr, p->rinter);
        return;
    }
    float cf[FW_MAX_HEAD_DIM / 2], sf[FW_MAX_HEAD_DIM / 2];
    kt->cvt.to_f32(cr, c->dtype, c->stride[1], p->rhalf, 1.0f, cf);
    kt->cvt.to_f32(sr, sn->dtype, sn->stride[1], p->rhalf, 1.0f, sf);
    kt->rope.rotate(x, (int)p->rhalf, cf, sf, p->rinter);
}

void fw_attn_tile_rows_out(const fw_attn_prob *p, const fw_attn_seq *s, int64_t j0, int n,
                           int64_t h, int v, uint16_t *dst)
{
    const uint16_t *src = (const uint16_t *)(v ? p->v : p->k)->data;
    const int64_t len = v ? p->dv : p->d;
    for (int i = 0; i < n; i++, dst += len) {
        const uint16_t *row = src + fw_attn_tile_elem(p, s, j0 + i, h, 0, v);
        if (v) /* channel x at (x / 16) * 16 page + (x % 16) * 2 */
            for (int64_t x0 = 0; x0 < len; x0 += 16, row += 16 * p->page)
                for (int x = 0; x < 16; x++)
                    dst[x0 + x] = row[2 * x];
        else /* channel pair w at w * 32 */
            for (int64_t w = 0; w < len / 2; w++) {
                dst[2 * w] = row[32 * w];
                dst[2 * w + 1] = row[32 * w + 1];
            }
    }
}

/* The fields both setups derive the same way: lse strides ([hq, total_q] packed, or
 * [b, hq, sq]), the scale (0 = 1/sqrt(d)), softcap, the mask (causal sets wr = 0; a negative
 * side is unbounded, flash-attn's rule), the kernel table and the product precision (the
 * reference resolves the precision by the table's name: it runs on none). */
/* params->sinks on a problem with hq query heads: one value per head, any float dtype. */
static fw_status setup_sinks(fw_attn_prob *p, const fw_attn_params *params)
{
    const fw_tensor *t = params->sinks;
    if (!t)
        return FW_OK;
    fw_status s = fw_check_tensor(t, "sinks", 1, FW_DT_IN);
    if (s)
        return s;
    if (t->shape[0] != p->hq)
        return fw_fail(FW_ERR_SHAPE, "sinks has %lld values; it must have one per query head "
                       "(%lld)", (long long)t->shape[0], (long long)p->hq);
    p->sinks = t;
    return FW_OK;
}

static fw_status setup_common(fw_attn_prob *p, const fw_tensor *lse, const fw_attn_params *params, int ref)
{
    if (lse && p->varlen) {
        p->lse_b = lse->stride[1]; p->lse_h = lse->stride[0]; p->lse_r = lse->stride[1];
    } else if (lse) {
        p->lse_b = lse->stride[0]; p->lse_h = lse->stride[1]; p->lse_r = lse->stride[2];
    }
    p->scale = params->scale != 0.0f ? (double)params->scale : 1.0 / sqrt((double)p->d);
    p->softcap = params->softcap;
    p->causal = params->causal;
    p->wl = params->window_left < 0 ? -1 : params->window_left; /* any negative: unbounded */
    p->wr = params->causal ? 0 : params->window_right < 0 ? -1 : params->window_right;
    p->kt = ref ? NULL : fw_kernels_get(params->isa);
    p->bf16 = ref ? fw_bf16_products(params->isa, p->q->dtype, params->precision)
                  : fw_kernels_bf16_products(p->kt, p->q->dtype, params->precision);
    /* the kernels fold the scale into one f32 multiplier of the scores, scale x log2(e), or
     * scale / softcap with a softcap (and the softcap into softcap x log2(e)): each must be a
     * finite float, else finite inputs would give inf - inf (found by the atheris harness) */
    const double m = p->softcap > 0 ? p->scale / p->softcap : p->scale * FW_LOG2E;
    if (p->softcap * FW_LOG2E > FLT_MAX)
        return fw_fail(FW_ERR_ARG, "softcap %g x log2(e) overflows a float", p->softcap);
    if (!(fabs(m) <= FLT_MAX) && p->softcap > 0)
        return fw_fail(FW_ERR_ARG, "scale %g / softcap %g = %g overflows a float (the kernels "
                       "multiply the scores by it)", p->scale, p->softcap, m);
    if (!(fabs(m) <= FLT_MAX))
        return fw_fail(FW_ERR_ARG, "scale %g x log2(e) = %g overflows a float (the kernels "
                       "multiply the scores by it)", p->scale, m);
    return setup_sinks(p, params);
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
    const unsigned dt_out = FW_DT_IN | (ref ? 1u << FW_F64 : 0u);
    fw_status s;
    if ((s = fw_check_tensor(q, "q", nd, FW_DT_IN)) || (s = fw_check_tensor(k, "k", nd, FW_DT_IN)) ||
        (s = fw_check_tensor(v, "v", nd, FW_DT_IN)) || (s = fw_check_tensor(out, "out", nd, dt_out)))
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
    if (d < 1 || d > FW_MAX_HEAD_DIM || dv < 1 || dv > FW_MAX_HEAD_DIM)
        return fw_fail(FW_ERR_SHAPE, "head dims must be 1..%d: d is %lld, dv is %lld",
                       FW_MAX_HEAD_DIM, (long long)d, (long long)dv);
    if (hq > FW_MAX_HEADS)
        return fw_fail(FW_ERR_SHAPE, "q has %lld heads; at most %d are supported", (long long)hq,
                       FW_MAX_HEADS);
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
    if ((s = fw_attn_check_params(params)))
        return s;
    if (varlen) {
        if (batch < 0 || batch > INT32_MAX)
            return fw_fail(FW_ERR_ARG, "batch is %lld; it must be 0..2^31-1", (long long)batch);
        if ((s = check_cu(cuq, batch, q->shape[0], "cu_seqlens_q")) ||
            (s = check_cu(cuk, batch, k->shape[0], "cu_seqlens_k")))
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
    return (s = setup_common(p, lse, params, ref)) ? s : setup_rotary(p, params);
}

fw_attn_seq fw_attn_seq_get(const fw_attn_prob *p, int64_t i)
{
    fw_attn_seq s;
    s.index = i;
    s.kpos = 0;
    if (p->varlen) {
        int64_t r = p->cuq[i];
        s.q0 = r * p->qs[0];
        s.o0 = r * p->os[0];
        s.lse0 = r * p->lse_b;
        s.sq = (int64_t)p->cuq[i + 1] - r;
        if (p->kvcache) {
            const int64_t e = p->batch_idx ? p->batch_idx[i] : i;
            s.kpos = p->leftpad ? p->leftpad[i] : 0;
            s.k0 = e * p->kb + s.kpos * p->ks[0];
            s.v0 = e * p->vb + s.kpos * p->vs[0];
            s.sk = (int64_t)p->cache_len[i] + (p->append ? s.sq : 0) - s.kpos;
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

/* The KV-cache call's tensors: dtypes, shapes against q and the cache, no aliased outputs. */
static fw_status kv_check_tensors(const fw_tensor *q, const fw_tensor *k_new, const fw_tensor *v_new,
                                  const fw_kv_cache *cache, const fw_tensor *out, const fw_tensor *lse, int ref)
{
    const unsigned dt_out = FW_DT_IN | (ref ? 1u << FW_F64 : 0u);
    const fw_tensor *kc = &cache->k, *vc = &cache->v;
    fw_status s;
    if ((s = fw_check_tensor(q, "q", 3, FW_DT_IN)) || (s = fw_check_tensor(out, "out", 3, dt_out)) ||
        (s = fw_check_tensor(kc, "cache.k", 4, FW_DT_IN | FW_DT_F8)) ||
        (s = fw_check_tensor(vc, "cache.v", 4, FW_DT_IN | FW_DT_F8)))
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
    if (d < 1 || d > FW_MAX_HEAD_DIM || dv < 1 || dv > FW_MAX_HEAD_DIM || hq > FW_MAX_HEADS)
        return fw_fail(FW_ERR_SHAPE, "head dims must be 1..%d and heads at most %d: d %lld, dv %lld, hq %lld",
                       FW_MAX_HEAD_DIM, FW_MAX_HEADS, (long long)d, (long long)dv, (long long)hq);
    if (out->shape[0] != q->shape[0] || out->shape[1] != hq || out->shape[2] != dv)
        return fw_fail(FW_ERR_SHAPE, "out must be [%lld, %lld, %lld] (q rows, q heads, dv); it is [%lld, %lld, %lld]",
                       (long long)q->shape[0], (long long)hq, (long long)dv, (long long)out->shape[0],
                       (long long)out->shape[1], (long long)out->shape[2]);
    if (lse && (lse->shape[0] != hq || lse->shape[1] != q->shape[0]))
        return fw_fail(FW_ERR_SHAPE, "lse must be [hq, total_q] = [%lld, %lld]", (long long)hq,
                       (long long)q->shape[0]);
    if (k_new) {
        if ((s = fw_check_tensor(k_new, "k_new", 3, FW_DT_IN)) || (s = fw_check_tensor(v_new, "v_new", 3, FW_DT_IN)))
            return s;
        const int f8 = fw_is_f8(kc->dtype);
        if (f8 && k_new->dtype != v_new->dtype)
            return fw_fail(FW_ERR_DTYPE, "k_new is %s but v_new is %s; they must match (an %s cache "
                           "quantises either)", fw_dtype_name(k_new->dtype), fw_dtype_name(v_new->dtype),
                           fw_dtype_name(kc->dtype));
        if (!f8 && (k_new->dtype != kc->dtype || v_new->dtype != kc->dtype))
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
    return FW_OK;
}

/* An fp8 cache's descales: both given, f32, each a scalar (rank 0 or [1]) or [batch, hkv],
 * finite and > 0; other caches take none. */
static fw_status kv_check_descales(const fw_kv_cache *cache, int64_t batch)
{
    const int f8 = fw_is_f8(cache->k.dtype);
    const fw_tensor *t[2] = {cache->k_descale, cache->v_descale};
    const char *names[2] = {"cache.k_descale", "cache.v_descale"};
    if (!f8) {
        if (t[0] || t[1])
            return fw_fail(FW_ERR_ARG, "%s is set but the cache is %s: descales go with fp8 caches "
                           "(FW_F8E4M3, FW_F8E5M2) only", t[0] ? names[0] : names[1],
                           fw_dtype_name(cache->k.dtype));
        return FW_OK;
    }
    const int64_t hkv = cache->k.shape[2];
    for (int i = 0; i < 2; i++) {
        if (!t[i])
            return fw_fail(FW_ERR_NULL, "%s is NULL: an %s cache needs k_descale and v_descale (a "
                           "scalar or [batch, hkv], f32)", names[i], fw_dtype_name(cache->k.dtype));
        const int nd = t[i]->ndim;
        fw_status s = fw_check_tensor(t[i], names[i], nd >= 0 && nd <= 2 ? nd : 2, 1u << FW_F32);
        if (s)
            return s;
        const int scalar = nd == 0 || (nd == 1 && t[i]->shape[0] == 1);
        if (!scalar && !(nd == 2 && t[i]->shape[0] == batch && t[i]->shape[1] == hkv))
            return fw_fail(FW_ERR_SHAPE, "%s must be a scalar (rank 0 or [1]) or [batch, hkv] = "
                           "[%lld, %lld]; it has rank %d, shape [%lld, %lld]", names[i], (long long)batch,
                           (long long)hkv, nd, (long long)(nd > 0 ? t[i]->shape[0] : 0),
                           (long long)(nd > 1 ? t[i]->shape[1] : 0));
        const int64_t n = scalar ? 1 : batch * hkv;
        for (int64_t e = 0; e < n; e++) {
            const float x = ((const float *)t[i]->data)[scalar ? 0 : e / hkv * t[i]->stride[0] +
                                                                    e % hkv * t[i]->stride[1]];
            if (!(x > 0.0f) || !isfinite(x))
                return fw_fail(FW_ERR_ARG, "%s holds %g (element %lld); a descale must be finite and "
                               "> 0", names[i], (double)x, (long long)e);
        }
    }
    return FW_OK;
}

/* The cache's layout and paging: FW_KV_TILES' requirements, the page size (*shift: its log2,
 * or -1 when it is not a power of two) and the block table's row stride (*bts). */
static fw_status kv_check_layout(const fw_kv_cache *cache, int64_t batch, int64_t d, int64_t dv, int64_t *shift,
                                 int64_t *bts)
{
    const fw_tensor *kc = &cache->k, *vc = &cache->v;
    const int paged = cache->block_table != NULL;
    const int64_t rows = kc->shape[1];
    if (paged && (cache->leftpad || cache->batch_idx))
        return fw_fail(FW_ERR_ARG, "cache.%s needs a contiguous cache (block_table NULL), as "
                       "flash-attn's cache_%s does", cache->leftpad ? "leftpad" : "batch_idx",
                       cache->leftpad ? "leftpad" : "batch_idx");
    if (cache->layout != FW_KV_ROWS && cache->layout != FW_KV_TILES)
        return fw_fail(FW_ERR_ARG, "cache.layout is %d; it must be FW_KV_ROWS (0) or FW_KV_TILES (1)",
                       (int)cache->layout);
    if (cache->layout == FW_KV_TILES) {
        if (!paged || kc->dtype != FW_BF16)
            return fw_fail(!paged ? FW_ERR_ARG : FW_ERR_DTYPE, "cache.layout FW_KV_TILES needs a paged "
                           "bf16 cache; this one is %s and %s", paged ? "paged" : "contiguous",
                           fw_dtype_name(kc->dtype));
        if (rows % 32 || d % 32 || dv % 32)
            return fw_fail(FW_ERR_SHAPE, "cache.layout FW_KV_TILES needs page_size, d and dv multiples of "
                           "32; they are %lld, %lld, %lld", (long long)rows, (long long)d, (long long)dv);
        if (kc->stride[1] != d || kc->stride[3] != 1 || vc->stride[1] != dv || vc->stride[3] != 1)
            return fw_fail(FW_ERR_STRIDE, "cache.layout FW_KV_TILES needs each (page, head) block dense: "
                           "cache.k strides [., %lld, ., 1] and cache.v [., %lld, ., 1]; they are "
                           "[., %lld, ., %lld] and [., %lld, ., %lld]", (long long)d, (long long)dv,
                           (long long)kc->stride[1], (long long)kc->stride[3], (long long)vc->stride[1],
                           (long long)vc->stride[3]);
    }
    if (paged) {
        if (rows < 1 || rows > FW_MAX_PAGE_SIZE)
            return fw_fail(FW_ERR_SHAPE, "page_size (cache.k dimension 1) is %lld; it must be 1 to %d",
                           (long long)rows, FW_MAX_PAGE_SIZE);
        while (((int64_t)1 << *shift) < rows)
            (*shift)++;
        if (((int64_t)1 << *shift) != rows)
            *shift = -1;
        *bts = cache->block_table_stride ? cache->block_table_stride : cache->max_pages;
        if (cache->max_pages < 1 || *bts < cache->max_pages)
            return fw_fail(FW_ERR_ARG, "block table: max_pages %lld must be >= 1 and its row stride %lld "
                           ">= max_pages", (long long)cache->max_pages, (long long)*bts);
    } else if (!cache->batch_idx && kc->shape[0] < batch) {
        return fw_fail(FW_ERR_SHAPE, "the contiguous cache holds %lld sequences but batch is %lld",
                       (long long)kc->shape[0], (long long)batch);
    }
    return FW_OK;
}

/* Every sequence's context fits, every entry or page it touches exists, and no entry or page
 * is written (k_new given) by two sequences. */
static fw_status kv_check_seqs(const fw_kv_cache *cache, const int32_t *cuq, int64_t batch, int appends,
                               int64_t bts)
{
    const int paged = cache->block_table != NULL;
    const int64_t num_pages = cache->k.shape[0], rows = cache->k.shape[1];
    fw_status s = FW_OK;
    unsigned char *written = NULL;
    if ((paged || cache->batch_idx) && appends && !(written = calloc((size_t)num_pages + 1, 1)))
        return fw_fail(FW_ERR_NOMEM, "cannot allocate %lld bytes to check the entries written",
                       (long long)num_pages);
    for (int64_t i = 0; i < batch && !s; i++) {
        const int64_t old = cache->seqlens[i], n = (int64_t)cuq[i + 1] - cuq[i];
        const int64_t len = old + (appends ? n : 0);
        if (old < 0) {
            s = fw_fail(FW_ERR_SEQLENS, "cache.seqlens[%lld] is %lld; it must be >= 0", (long long)i,
                        (long long)old);
        } else if (cache->leftpad && (cache->leftpad[i] < 0 || cache->leftpad[i] > old)) {
            s = fw_fail(FW_ERR_SEQLENS, "cache.leftpad[%lld] is %d; it must be 0 .. cache.seqlens[%lld] "
                        "(%lld)", (long long)i, (int)cache->leftpad[i], (long long)i, (long long)old);
        } else if (!paged) {
            const int32_t e = cache->batch_idx ? cache->batch_idx[i] : (int32_t)i;
            if (cache->batch_idx && (e < 0 || e >= num_pages))
                s = fw_fail(FW_ERR_INDEX, "cache.batch_idx[%lld] = %d is not an entry of the cache "
                            "(0..%lld)", (long long)i, (int)e, (long long)num_pages - 1);
            else if (written && n > 0 && written[e]++)
                s = fw_fail(FW_ERR_INDEX, "cache entry %d (cache.batch_idx) is written by two sequences "
                            "(the second is %lld)", (int)e, (long long)i);
            else if (len > rows)
                s = fw_fail(FW_ERR_SEQLENS, "sequence %lld needs %lld cache rows but the cache holds %lld",
                            (long long)i, (long long)len, (long long)rows);
        } else {
            const int64_t pages = (len + rows - 1) / rows;
            if (pages > cache->max_pages)
                s = fw_fail(FW_ERR_SEQLENS, "sequence %lld needs %lld pages for %lld tokens but the block "
                            "table has %lld columns", (long long)i, (long long)pages, (long long)len,
                            (long long)cache->max_pages);
            for (int64_t pg = 0; pg < pages && !s; pg++) {
                int32_t e = cache->block_table[i * bts + pg];
                if (e < 0 || e >= num_pages)
                    s = fw_fail(FW_ERR_INDEX, "block_table[%lld][%lld] = %d is not a page of the cache "
                                "(0..%lld)", (long long)i, (long long)pg, (int)e, (long long)num_pages - 1);
                else if (written && n > 0 && pg >= old / rows) {
                    if (written[e])
                        s = fw_fail(FW_ERR_INDEX, "page %d is written by two sequences (the second is %lld)",
                                    (int)e, (long long)i);
                    written[e] = 1;
                }
            }
        }
    }
    free(written);
    return s;
}


/* The validated KV-cache call as a problem (the rows of the cache and the new rows). */
static void kv_fill(fw_attn_prob *p, const fw_tensor *q, const fw_tensor *k_new, const fw_tensor *v_new,
                    const int32_t *cuq, int64_t batch, const fw_kv_cache *cache, const fw_tensor *out,
                    const fw_tensor *lse, int64_t shift, int64_t bts)
{
    const fw_tensor *kc = &cache->k, *vc = &cache->v;
    const int paged = cache->block_table != NULL;
    const int64_t hq = q->shape[1], hkv = kc->shape[2], d = q->shape[2], dv = vc->shape[3], rows = kc->shape[1];
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
        p->bt = cache->block_table; p->bt_stride = bts; p->page = rows; p->page_shift = shift;
        p->kpage = kc->stride[0]; p->vpage = vc->stride[0];
    }
    p->tiles = cache->layout == FW_KV_TILES;
    p->kdesc = cache->k_descale;
    p->vdesc = cache->v_descale;
    p->cache_len = cache->seqlens;
    p->leftpad = cache->leftpad;
    p->batch_idx = cache->batch_idx;
    for (int64_t i = 0; i < batch; i++) {
        fw_attn_seq e = fw_attn_seq_get(p, i);
        p->sq = fw_max64(p->sq, e.sq);
        p->sk = fw_max64(p->sk, e.sk);
    }
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
    if (!cache)
        return fw_fail(FW_ERR_NULL, "cache is NULL: a fw_kv_cache is required");
    fw_status s;
    if ((s = kv_check_tensors(q, k_new, v_new, cache, out, lse, ref)) || (s = fw_attn_check_params(params)))
        return s;
    if (batch < 0 || batch > INT32_MAX)
        return fw_fail(FW_ERR_ARG, "batch is %lld; it must be 0..2^31-1", (long long)batch);
    if ((s = check_cu(cuq, batch, q->shape[0], "cu_seqlens_q")))
        return s;
    if (batch > 0 && !cache->seqlens)
        return fw_fail(FW_ERR_NULL, "cache.seqlens is NULL");
    int64_t shift = 0, bts = 0;
    if ((s = kv_check_layout(cache, batch, q->shape[2], cache->v.shape[3], &shift, &bts)) ||
        (s = kv_check_descales(cache, batch)) || (s = kv_check_seqs(cache, cuq, batch, k_new != NULL, bts)))
        return s;
    kv_fill(p, q, k_new, v_new, cuq, batch, cache, out, lse, shift, bts);
    return (s = setup_common(p, lse, params, ref)) ? s : setup_rotary(p, params);
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

int64_t fw_attn_kv_split_keys(int64_t sk, int64_t units)
{
    if (units >= 2 && sk <= 2 * FW_KV_SPLIT)
        return fw_max64(sk, 1);
    return sk > FW_KV_SPLIT ? FW_KV_SPLIT : FW_KV_SPLIT / 2;
}

int64_t fw_attn_kv_splits(int64_t sk, int64_t units)
{
    const int64_t keys = fw_attn_kv_split_keys(sk, units);
    return sk > keys ? fw_ceil_div(sk, keys) : 1;
}

int64_t fw_attn_tile_split_keys(int64_t sk, int64_t items)
{
    if (items < 1 || items >= FW_TILE_SPLIT_ITEMS || sk <= FW_TILE_SPLIT_MIN)
        return fw_max64(sk, 1);
    const int64_t want = fw_ceil_div(FW_TILE_SPLIT_ITEMS, items);
    return fw_max64(FW_TILE_SPLIT_MIN, fw_ceil_div(fw_ceil_div(sk, want), FW_KV_SPLIT) * FW_KV_SPLIT);
}

int64_t fw_attn_tile_splits(int64_t sk, int64_t items)
{
    const int64_t keys = fw_attn_tile_split_keys(sk, items);
    return sk > keys ? fw_ceil_div(sk, keys) : 1;
}

int64_t fw_attn_dec_groups(int64_t units, int64_t items, int threads)
{
    if (units < 2 || items >= threads)
        return 1;
    const int64_t want = fw_min64(units, fw_ceil_div(threads, fw_max64(items, 1)));
    return fw_ceil_div(units, fw_ceil_div(units, want));
}
