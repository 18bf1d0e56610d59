/* attn_ref.c: the float64 reference for softmax attention. Row by row, scores in double,
 * exp() from libm, two passes (max, then sum and output); O(sk) scratch, one thread. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "attn.h"

static double load(const fw_tensor *t, int64_t off)
{
    const char *b = t->data;
    switch (t->dtype) {
    case FW_F32: return ((const float *)b)[off];
    case FW_BF16: return fw_bf16_to_f32(((const uint16_t *)b)[off]);
    case FW_F16: return fw_f16_to_f32(((const uint16_t *)b)[off]);
    case FW_F64: return ((const double *)b)[off];
    }
    return 0.0;
}

static void store(const fw_tensor *t, int64_t off, double x)
{
    char *b = t->data;
    switch (t->dtype) {
    case FW_F32: ((float *)b)[off] = (float)x; break;
    case FW_BF16: ((uint16_t *)b)[off] = fw_f32_to_bf16((float)x); break;
    case FW_F16: ((uint16_t *)b)[off] = fw_f32_to_f16((float)x); break;
    case FW_F64: ((double *)b)[off] = x; break;
    }
}

static fw_status reference(const fw_attn_prob *p, int64_t rb, int64_t re)
{
    if (rb < 0 || re < rb)
        return fw_fail(FW_ERR_ARG, "row range [%lld, %lld) is invalid", (long long)rb, (long long)re);
    const int64_t d = p->d, dv = p->dv;
    double *s = malloc((size_t)(p->sk > 0 ? p->sk : 1) * sizeof(double));
    double *acc = malloc((size_t)dv * sizeof(double));
    double *q = malloc((size_t)d * sizeof(double));
    if (!s || !acc || !q) {
        free(s); free(acc); free(q);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the reference's row buffers");
    }
    for (int64_t b = 0; b < p->batch; b++) {
        const fw_attn_seq sq = fw_attn_seq_get(p, b);
        for (int64_t h = 0; h < p->hq; h++) {
            const int64_t kvh = h / p->G;
            for (int64_t r = rb; r < fw_min64(re, sq.sq); r++) {
                int64_t lo, hi;
                fw_attn_visible(p, sq.sq, sq.sk, r, &lo, &hi);
                for (int64_t x = 0; x < d; x++)
                    q[x] = load(p->q, sq.q0 + r * p->qs[0] + h * p->qs[1] + x * p->qs[2]);
                double mx = -INFINITY;
                for (int64_t j = lo; j < hi; j++) {
                    double dot = 0.0;
                    const int64_t kr = sq.k0 + j * p->ks[0] + kvh * p->ks[1];
                    for (int64_t x = 0; x < d; x++)
                        dot += q[x] * load(p->k, kr + x * p->ks[2]);
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
                    const double e = exp(s[j] - mx);
                    const int64_t vr = sq.v0 + j * p->vs[0] + kvh * p->vs[1];
                    sum += e;
                    for (int64_t x = 0; x < dv; x++)
                        acc[x] += e * load(p->v, vr + x * p->vs[2]);
                }
                const int64_t orow = sq.o0 + r * p->os[0] + h * p->os[1];
                for (int64_t x = 0; x < dv; x++)
                    store(p->out, orow + x * p->os[2], hi > lo ? acc[x] / sum : 0.0);
                if (p->lse)
                    store(p->lse, sq.lse0 + h * p->lse_h + r * p->lse_r,
                          hi > lo ? mx + log(sum) : -INFINITY);
            }
        }
    }
    free(s);
    free(acc);
    free(q);
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
