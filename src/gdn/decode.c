/* gdn/decode.c: Gated DeltaNet decode: one token per sequence, the fused step on the state in
 * its slot, updated in place. */
#include <math.h>
#include <stdlib.h>
#include "gdn.h"

typedef struct {
    const gdn_prob *p;
    const fw_kernels *kt;
    float *state;
    const int32_t *idx;
    float *ws;
    size_t ws_stride;
    int64_t nblk;
} dec_ctx;

/* Item: (sequence, value head, block of state columns). A block is every column (whole rows,
 * read front to back) unless there are fewer (sequence, head) pairs than threads; then
 * columns split in blocks of 64 (the columns are independent). Measured, 64 sequences x 32
 * heads, 2 threads: 17.2 GB/s of state with 64-column items, which read half of every row. */
static void decode_item(void *vctx, int64_t it, int tid)
{
    const dec_ctx *c = vctx;
    const gdn_prob *p = c->p;
    const int64_t blk = it % c->nblk, vh = (it / c->nblk) % p->HV, i = it / (c->nblk * p->HV);
    const int64_t w = c->nblk == 1 ? p->dv : 64;
    const int dk = (int)p->dk, dv = (int)p->dv, c0 = (int)(blk * w), c1 = (int)fw_min64(dv, c0 + w);
    float *W = c->ws + (size_t)tid * c->ws_stride, *q = W, *k = q + dk, *v = k + dk, *o = v + dv;
    load_qk(c->kt, p, p->q, i, vh / p->r, p->scale, q);
    load_qk(c->kt, p, p->k, i, vh / p->r, 1.0, k);
    c->kt->to_f32(at(p->v, i, vh), p->v->dtype, p->v->stride[2], dv, 1.0f, v);
    float kq = 0;
    for (int x = 0; x < dk; x++)
        kq += k[x] * q[x];
    c->kt->gdn_dec_cols(c->state + state_off(p, c->idx[i], vh), dv, dk, c0, c1, q, k, v,
                        expf(scalar_at(p->g, i, vh)), scalar_at(p->beta, i, vh), kq, o);
    c->kt->from_f32(o + c0, c1 - c0,
                    (char *)at(p->out, i, vh) + (int64_t)c0 * p->out->stride[2] * (int64_t)fw_dtype_size(p->out->dtype),
                    p->out->dtype, p->out->stride[2]);
}

fw_status fw_gdn_decode(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                        const fw_tensor *beta, float *state, int64_t slots, const int32_t *state_indices,
                        const fw_tensor *out, const fw_gdn_params *params)
{
    fw_clear_error();
    gdn_prob p;
    fw_status s = fw_gdn_check(&p, q, k, v, g, beta, NULL, 0, 0, out, params, 0);
    if (s || (s = fw_gdn_check_slots(state_indices, p.T, slots, state)))
        return s;
    const fw_kernels *kt = fw_kernels_get(params ? params->isa : NULL);
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    const int threads = fw_threads(params ? params->threads : 0);
    dec_ctx c = {&p, kt, state, state_indices, NULL, (size_t)(2 * p.dk + 2 * p.dv + 16),
                 p.T * p.HV >= threads ? 1 : (p.dv + 63) / 64};
    const int64_t n = p.T * p.HV * c.nblk;
    if (n == 0)
        return FW_OK;
    if (!(c.ws = malloc((size_t)threads * c.ws_stride * sizeof(float))))
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the decode workspace");
    fw_parallel(threads, n, decode_item, &c);
    free(c.ws);
    return FW_OK;
}
