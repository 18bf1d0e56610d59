/* ref/attn_ref.c: the float64 references for softmax attention, forward and backward. Each sequence's K/V context is
 * gathered into contiguous float64 rows; then row by row, scores in double, exp() from libm,
 * two passes (max, then sum and output). O(sk * hkv * (d + dv)) scratch, one thread.
 * With bf16 products it makes the kernel's roundings and no others: q, k, v to bf16, and
 * each probability to bf16 before it multiplies V (the sum stays unrounded, as in the
 * kernels, which sum the f32 probabilities). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "../attn/bwd.h"

/* x rounded to bf16 (nearest even) when `on`, else x. */
static double rnd(double x, int on) { return on ? (double)fw_cvt_bf16_f32(fw_cvt_f32_bf16((float)x)) : x; }

/* x rounded to dtype dt as a store to a tensor of it would (f32, bf16, f16). */
static double rnd_dt(fw_dtype dt, double x)
{
    return dt == FW_BF16 ? (double)fw_cvt_bf16_f32(fw_cvt_f32_bf16((float)x))
           : dt == FW_F16 ? (double)fw_cvt_f16_f32(fw_cvt_f32_f16((float)x))
           : dt == FW_F32 ? (double)(float)x : x;
}

/* The rotary embedding in double: the d values of x rotated at position pos. */
static void rotate(const fw_attn_prob *p, double *x, int64_t pos)
{
    const int64_t h = p->rhalf, step = p->rinter ? 2 : 1, other = p->rinter ? 1 : h;
    for (int64_t i = 0; i < h; i++) {
        const double c = fw_load_f64(p->rcos, pos * p->rcos->stride[0] + i * p->rcos->stride[1]);
        const double s = fw_load_f64(p->rsin, pos * p->rsin->stride[0] + i * p->rsin->stride[1]);
        double *a = x + i * step, *b = a + other;
        const double x0 = *a, x1 = *b;
        *a = x0 * c - x1 * s;
        *b = x0 * s + x1 * c;
    }
}

/* The context of sequence sq, K then V, gathered into contiguous float64 rows [sk][hkv][d|dv]:
 * cache rows through fw_attn_key (fw_attn_tile_elem for FW_KV_TILES), and for a KV-cache call with new rows, those from
 * k_new/v_new (the cache itself is not read for them, nor written). With a rotary embedding,
 * key j is rotated at position kpos + j (its cache row: kpos is the leftpad): every key of a
 * dense or varlen call; in a KV-cache call the new keys, then rounded to the cache's dtype as
 * the append stores them. */

static void gather(const fw_attn_prob *p, const fw_attn_seq *sq, double *K, double *V)
{
    const int64_t cached = p->kvcache && p->append ? p->cache_len[sq->index] - sq->kpos : sq->sk;
    for (int64_t j = 0; j < sq->sk; j++)
        for (int v = 0; v < 2; v++) {
            const int64_t n = v ? p->dv : p->d;
            const int64_t *st = v ? p->vs : p->ks;
            double *dst = (v ? V : K) + j * p->hkv * n;
            for (int64_t h = 0; h < p->hkv; h++)
                for (int64_t x = 0; x < n; x++) {
                    if (j < cached) {
                        const int64_t e = p->tiles ? fw_attn_tile_elem(p, sq, j, h, x, v)
                                                   : fw_attn_key(p, sq, j, v) + h * st[1] + x * st[2];
                        dst[h * n + x] = fw_load_f64(v ? p->v : p->k, e);
                    } else {
                        const fw_tensor *t = v ? p->vnew : p->knew;
                        const int64_t row = p->cuq[sq->index] + (j - cached);
                        dst[h * n + x] = fw_load_f64(t, row * t->stride[0] + h * t->stride[1] + x * t->stride[2]);
                    }
                }
            for (int64_t h = 0; h < p->hkv && !v && (p->rot_k || (p->rot_append && j >= cached)); h++) {
                rotate(p, dst + h * n, sq->kpos + j);
                for (int64_t x = 0; x < n && !p->rot_k && !p->kdesc; x++)
                    dst[h * n + x] = rnd_dt(p->k->dtype, dst[h * n + x]);
            }
            /* an fp8 cache: new rows as the append stores them (over the f32 descale, rounded
             * to the cache's type; rotated keys from the double rotation); the stored values,
             * exact in bf16, then times their descale */
            for (int64_t x = 0; x < p->hkv * n && p->kdesc && j >= cached; x++) {
                const float ds = fw_attn_descale(p, v, sq->index, x / n);
                dst[x] = fw_cvt_f8_f32(fw_cvt_f32_f8((float)dst[x] / ds, p->k->dtype), p->k->dtype);
            }
            for (int64_t x = 0; x < p->hkv * n; x++)
                dst[x] = rnd(dst[x], p->bf16) * (p->kdesc ? fw_attn_descale(p, v, sq->index, x / n) : 1.0f);
        }
}

static fw_status reference(const fw_attn_prob *p, int64_t rb, int64_t re)
{
    if (rb < 0 || re < rb)
        return fw_fail(FW_ERR_ARG, "row range [%lld, %lld) is invalid", (long long)rb, (long long)re);
    const int64_t d = p->d, dv = p->dv, sk = p->sk > 0 ? p->sk : 1;
    double *s = malloc((size_t)sk * sizeof(double));
    double *acc = malloc((size_t)dv * sizeof(double));
    double *q = malloc((size_t)d * sizeof(double));
    double *K = malloc((size_t)(sk * p->hkv * d) * sizeof(double));
    double *V = malloc((size_t)(sk * p->hkv * dv) * sizeof(double));
    if (!s || !acc || !q || !K || !V) {
        free(s); free(acc); free(q); free(K); free(V);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the reference's buffers");
    }
    for (int64_t b = 0; b < p->batch; b++) {
        const fw_attn_seq sq = fw_attn_seq_get(p, b);
        if (rb >= sq.sq)
            continue;
        gather(p, &sq, K, V);
        for (int64_t h = 0; h < p->hq; h++) {
            const int64_t kvh = h / p->G;
            for (int64_t r = rb; r < fw_min64(re, sq.sq); r++) {
                int64_t lo, hi;
                fw_attn_visible(p, sq.sq, sq.sk, r, &lo, &hi);
                for (int64_t x = 0; x < d; x++)
                    q[x] = fw_load_f64(p->q, sq.q0 + r * p->qs[0] + h * p->qs[1] + x * p->qs[2]);
                if (p->rcos)
                    rotate(p, q, fw_attn_qpos(p, &sq, r));
                for (int64_t x = 0; x < d; x++)
                    q[x] = rnd(q[x], p->bf16);
                double mx = -INFINITY;
                for (int64_t j = lo; j < hi; j++) {
                    double dot = 0.0;
                    const double *kr = K + (j * p->hkv + kvh) * d;
                    for (int64_t x = 0; x < d; x++)
                        dot += q[x] * kr[x];
                    dot *= p->scale;
                    if (p->softcap > 0)
                        dot = p->softcap * tanh(dot / p->softcap);
                    s[j] = dot;
                    if (dot > mx)
                        mx = dot;
                }
                double sum = 0.0;
                for (int64_t x = 0; x < dv; x++)
                    acc[x] = 0.0;
                for (int64_t j = lo; j < hi; j++) {
                    const double e = exp(s[j] - mx), ep = rnd(e, p->bf16);
                    const double *vr = V + (j * p->hkv + kvh) * dv;
                    sum += e;
                    for (int64_t x = 0; x < dv; x++)
                        acc[x] += ep * vr[x];
                }
                /* a sink t joins the sum in the frame of max(mx, t); the probabilities keep
                 * the keys' own frame, so bf16 products round the same values as without */
                double w = 1.0, lse = hi > lo ? mx + log(sum) : -INFINITY;
                if (p->sinks) {
                    const double t = fw_attn_sink(p, h), m = t > mx || t != t ? t : mx;
                    w = exp(mx - m);
                    sum = sum * w + exp(t - m);
                    lse = hi > lo ? m + log(sum) : t;
                }
                const int64_t orow = sq.o0 + r * p->os[0] + h * p->os[1];
                for (int64_t x = 0; x < dv; x++)
                    fw_store_f64(p->out, orow + x * p->os[2], hi > lo ? acc[x] * w / sum : 0.0);
                if (p->lse)
                    fw_store_f64(p->lse, sq.lse0 + h * p->lse_h + r * p->lse_r, lse);
            }
        }
    }
    free(s); free(acc); free(q); free(K); free(V);
    return FW_OK;
}

fw_status fw_attn_ref(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                      const fw_tensor *out, const fw_tensor *lse, const fw_attn_params *params,
                      int64_t row_begin, int64_t row_end)
{
    fw_clear_error();
    fw_attn_prob p;
    fw_status s = fw_attn_setup(&p, q, k, v, NULL, NULL, 0, 0, out, lse, params, 1);
    return s ? s : reference(&p, row_begin, row_end);
}

fw_status fw_attn_varlen_ref(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                             const int32_t *cu_seqlens_q, const int32_t *cu_seqlens_k,
                             int64_t batch, const fw_tensor *out, const fw_tensor *lse,
                             const fw_attn_params *params, int64_t row_begin, int64_t row_end)
{
    fw_clear_error();
    fw_attn_prob p;
    fw_status s = fw_attn_setup(&p, q, k, v, cu_seqlens_q, cu_seqlens_k, batch, 1, out, lse,
                                params, 1);
    return s ? s : reference(&p, row_begin, row_end);
}

fw_status fw_attn_kvcache_ref(const fw_tensor *q, const fw_tensor *k_new, const fw_tensor *v_new,
                              const int32_t *cu_seqlens_q, int64_t batch, const fw_kv_cache *cache,
                              const fw_tensor *out, const fw_tensor *lse,
                              const fw_attn_params *params)
{
    fw_clear_error();
    fw_attn_prob p;
    fw_status s = fw_attn_setup_kvcache(&p, q, k_new, v_new, cu_seqlens_q, batch, cache, out, lse,
                                        params, 1);
    return s ? s : reference(&p, 0, INT64_MAX);
}

/* ---------------------------------------------------------------- backward -- */

/* Sequence by sequence: K, V gathered in double, dK / dV accumulated in double over every
 * (head, row) that sees the key, dq row by row; P from the given lse, D from the given out
 * and dout. With bf16 products, the kernels' roundings and no others: q, k, v and dout
 * rounded to bf16 where they enter products (D takes dout as given), P rounded before it
 * multiplies dout, dS (before the scale) before it multiplies q and k. With dsinks: each
 * head's -sum exp(sink - lse) D over the rows, in double. */
static fw_status reference_bwd(const fw_attn_bwd_prob *b)
{
    const fw_attn_prob *p = &b->f;
    const int64_t d = p->d, dv = p->dv, sk = p->sk > 0 ? p->sk : 1;
    const size_t nk = (size_t)(sk * p->hkv * d), nv = (size_t)(sk * p->hkv * dv);
    double *K = malloc(nk * sizeof(double)), *V = malloc(nv * sizeof(double));
    double *dK = malloc(nk * sizeof(double)), *dV = malloc(nv * sizeof(double));
    double *q = malloc((size_t)(2 * d + dv) * sizeof(double));
    double *dsink = calloc((size_t)p->hq, sizeof(double)); /* -sum exp(sink - lse) D per head */
    if (!K || !V || !dK || !dV || !q || !dsink) {
        free(K); free(V); free(dK); free(dV); free(q); free(dsink);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the reference's buffers");
    }
    double *o = q + d, *dq = o + dv;
    for (int64_t i = 0; i < p->batch; i++) {
        const fw_attn_seq sq = fw_attn_seq_get(p, i);
        gather(p, &sq, K, V);
        memset(dK, 0, (size_t)(sq.sk * p->hkv * d) * sizeof(double));
        memset(dV, 0, (size_t)(sq.sk * p->hkv * dv) * sizeof(double));
        for (int64_t h = 0; h < p->hq; h++) {
            const int64_t kvh = h / p->G;
            for (int64_t r = 0; r < sq.sq; r++) {
                int64_t lo, hi;
                fw_attn_visible(p, sq.sq, sq.sk, r, &lo, &hi);
                const int64_t go = fw_bwd_off(b, b->dos, i, 0, r, h);
                const int64_t oo = sq.o0 + r * p->os[0] + h * p->os[1];
                double D = 0.0;
                for (int64_t x = 0; x < dv; x++) {
                    o[x] = fw_load_f64(b->dout, go + x * b->dos[3]);
                    D += o[x] * fw_load_f64(p->out, oo + x * p->os[2]);
                    o[x] = rnd(o[x], p->bf16);
                }
                for (int64_t x = 0; x < d; x++) {
                    q[x] = rnd(fw_load_f64(p->q, sq.q0 + r * p->qs[0] + h * p->qs[1] + x * p->qs[2]), p->bf16);
                    dq[x] = 0.0;
                }
                const double lse = fw_load_f64(p->lse, sq.lse0 + h * p->lse_h + r * p->lse_r);
                if (b->dsinks)
                    dsink[h] -= exp(fw_attn_sink(p, h) - lse) * D;
                for (int64_t j = lo; j < hi; j++) {
                    const double *kr = K + (j * p->hkv + kvh) * d, *vr = V + (j * p->hkv + kvh) * dv;
                    double *dk = dK + (j * p->hkv + kvh) * d, *dvr = dV + (j * p->hkv + kvh) * dv;
                    double s = 0.0, dp = 0.0, t = 0.0;
                    for (int64_t x = 0; x < d; x++)
                        s += q[x] * kr[x];
                    for (int64_t x = 0; x < dv; x++)
                        dp += o[x] * vr[x];
                    s *= p->scale;
                    if (p->softcap > 0) {
                        t = tanh(s / p->softcap);
                        s = p->softcap * t;
                    }
                    const double pr = exp(s - lse);
                    const double ds = rnd(pr * (dp - D) * (p->softcap > 0 ? 1.0 - t * t : 1.0), p->bf16) * p->scale;
                    const double pv = rnd(pr, p->bf16);
                    for (int64_t x = 0; x < d; x++) {
                        dq[x] += ds * kr[x];
                        dk[x] += ds * q[x];
                    }
                    for (int64_t x = 0; x < dv; x++)
                        dvr[x] += pv * o[x];
                }
                const int64_t qo = fw_bwd_off(b, b->dqs, i, 0, r, h);
                for (int64_t x = 0; x < d; x++)
                    fw_store_f64(b->dq, qo + x * b->dqs[3], dq[x]);
            }
        }
        for (int64_t j = 0; j < sq.sk; j++)
            for (int64_t h = 0; h < p->hkv; h++) {
                const int64_t ko = fw_bwd_off(b, b->dks, i, 1, j, h), vo = fw_bwd_off(b, b->dvs, i, 1, j, h);
                for (int64_t x = 0; x < d; x++)
                    fw_store_f64(b->dk, ko + x * b->dks[3], dK[(j * p->hkv + h) * d + x]);
                for (int64_t x = 0; x < dv; x++)
                    fw_store_f64(b->dv, vo + x * b->dvs[3], dV[(j * p->hkv + h) * dv + x]);
            }
    }
    for (int64_t h = 0; h < p->hq && b->dsinks; h++)
        fw_store_f64(b->dsinks, h * b->dsinks->stride[0], dsink[h]);
    free(K); free(V); free(dK); free(dV); free(q); free(dsink);
    return FW_OK;
}

fw_status fw_attn_bwd_ref(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                          const fw_tensor *out, const fw_tensor *dout, const fw_tensor *lse,
                          const fw_tensor *dq, const fw_tensor *dk, const fw_tensor *dv,
                          const fw_attn_params *params)
{
    fw_clear_error();
    fw_attn_bwd_prob b;
    fw_status s = fw_attn_setup_bwd(&b, q, k, v, out, dout, lse, NULL, NULL, 0, 0, dq, dk, dv,
                                    params, 1);
    return s ? s : reference_bwd(&b);
}

fw_status fw_attn_varlen_bwd_ref(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                 const fw_tensor *out, const fw_tensor *dout, const fw_tensor *lse,
                                 const int32_t *cu_seqlens_q, const int32_t *cu_seqlens_k,
                                 int64_t batch, const fw_tensor *dq, const fw_tensor *dk,
                                 const fw_tensor *dv, const fw_attn_params *params)
{
    fw_clear_error();
    fw_attn_bwd_prob b;
    fw_status s = fw_attn_setup_bwd(&b, q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, batch,
                                    1, dq, dk, dv, params, 1);
    return s ? s : reference_bwd(&b);
}
