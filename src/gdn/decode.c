/* gdn/decode.c: Gated DeltaNet (and KDA) decode: one token per sequence, the fused step on the state in
 * its slot, updated in place. */
#include <math.h>
#include <stdlib.h>
#include "gdn.h"

typedef struct {
    const gdn_prob *p;
    const fw_kernels *kt;
    char *state;
    fw_dtype sdt;                /* the states' dtype: f32 or bf16 */
    const int32_t *read, *write; /* slots (negative: zeros / not written); write NULL: read's */
    int64_t stride;              /* elements between slots */
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
    float *W = c->ws + (size_t)tid * c->ws_stride, *q = W, *k = q + dk, *v = k + dk, *o = v + dv,
          *dec = o + dv;
    /* the state updated in place: the write slot's, after a copy of the read slot's columns
     * (or zeros) when they differ; a scratch copy when nothing is written */
    const int64_t rs = c->read ? c->read[i] : -1, wsl = c->write ? c->write[i] : rs, head = vh * dk * dv;
    const size_t es = fw_dtype_size(c->sdt), cb = es * (size_t)(c1 - c0);
    char *h = wsl >= 0 ? c->state + (size_t)(wsl * c->stride + head) * es : (char *)(dec + 2 * dk + 16);
    if (rs != wsl || wsl < 0) {
        const char *h0 = rs >= 0 ? c->state + (size_t)(rs * c->stride + head) * es : NULL;
        for (int x = 0; x < dk; x++) {
            const size_t e = ((size_t)x * (size_t)dv + (size_t)c0) * es;
            if (h0)
                memcpy(h + e, h0 + e, cb);
            else
                memset(h + e, 0, cb);
        }
    }
    load_qk(c->kt, p, p->q, i, vh / p->r, p->scale, q);
    load_qk(c->kt, p, p->k, i, vh / p->r, 1.0, k);
    c->kt->cvt.to_f32(at(p->v, i, vh), p->v->dtype, p->v->stride[2], dv, 1.0f, v);
    float kq = 0;
    for (int x = 0; x < dk; x++)
        kq += k[x] * q[x];
    gate_decays(c->kt, p, i, vh, dec, dec + dk);
    c->kt->gdn.dec_cols(h, c->sdt, dv, dk, c0, c1, q, k, v, dec, gate_beta(p, i, vh), kq, o);
    c->kt->cvt.from_f32(o + c0, c1 - c0,
                    (char *)at(p->out, i, vh) + (int64_t)c0 * p->out->stride[2] * (int64_t)fw_dtype_size(p->out->dtype),
                    p->out->dtype, p->out->stride[2]);
}

static fw_status decode_run(const gdn_prob *p, dec_ctx *c, const fw_gdn_params *params, int scratch)
{
    const fw_kernels *kt = fw_kernels_get(params ? params->isa : NULL);
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    c->p = p;
    c->kt = kt;
    const int threads = fw_threads(params ? params->threads : 0);
    c->ws_stride = (size_t)(4 * p->dk + 2 * p->dv + 16) + (scratch ? (size_t)(p->dk * p->dv) : 0);
    c->nblk = p->T * p->HV >= threads ? 1 : (p->dv + 63) / 64;
    const int64_t n = p->T * p->HV * c->nblk;
    if (n == 0)
        return FW_OK;
    if (!(c->ws = malloc((size_t)threads * c->ws_stride * sizeof(float))))
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the decode workspace");
    fw_parallel(threads, n, decode_item, c);
    free(c->ws);
    return FW_OK;
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
    dec_ctx c;
    memset(&c, 0, sizeof c);
    c.state = (char *)state;
    c.sdt = FW_F32;
    c.read = state_indices;
    c.stride = p.HV * p.dk * p.dv;
    return decode_run(&p, &c, params, 0);
}

fw_status fw_gdn_decode_pool(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                             const fw_tensor *beta, const fw_gdn_pool *pool, const fw_tensor *out,
                             const fw_gdn_params *params)
{
    fw_clear_error();
    gdn_prob p;
    fw_status s = fw_gdn_check(&p, q, k, v, g, beta, NULL, 0, 0, out, params, 0);
    if (s || (s = fw_gdn_check_pool(pool, p.T, p.HV, p.dk, p.dv)))
        return s;
    dec_ctx c;
    memset(&c, 0, sizeof c);
    c.state = pool->data;
    c.sdt = pool->dtype;
    c.read = pool->read;
    c.write = pool->write;
    c.stride = pool->slot_stride;
    int scratch = 0;
    for (int64_t i = 0; i < p.T && !scratch; i++)
        scratch = (pool->write ? pool->write[i] : pool->read ? pool->read[i] : -1) < 0;
    return decode_run(&p, &c, params, scratch);
}
