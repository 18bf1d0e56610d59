/* attn/plain.c: the plain baseline (FW_ATTN_PLAIN): one query row at a time against its keys,
 * one key at a time with online softmax (attn/attn_kern.h, plain_row), f32 products; keys a
 * rotary embedding rotates are converted and rotated one at a time, and keys of a FW_KV_TILES
 * cache copied out one at a time. */
#include "run.h"

/* Rows [it->chunk x FW_ATTN_PLAIN_ROWS, + FW_ATTN_PLAIN_ROWS) of q head it->head. */
void fw_attn_plain_item(const run_ctx *c, const item *it, const fw_attn_seq *sq, int tid)
{
    const fw_attn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    const int d = (int)p->d, dv = (int)p->dv;
    const int64_t h = it->head, kvh = h / p->G;
    char *w = c->ws + (size_t)tid * c->ws_stride;
    float *scratch = (float *)(w + c->wl.kf), *qrow = (float *)(w + c->wl.row);
    float *krow = qrow + d, *vrow = krow + d;
    float *acc = (float *)(w + c->wl.ot);
    const int64_t r0 = it->chunk * FW_ATTN_PLAIN_ROWS, r1 = fw_min64(sq->sq, r0 + FW_ATTN_PLAIN_ROWS);
    for (int64_t r = r0; r < r1; r++) {
        kt->cvt.to_f32(fw_elem(p->q, sq->q0 + r * p->qs[0] + h * p->qs[1]), p->q->dtype, p->qs[2], d,
                   c->qscale * fw_attn_descale(p, 0, sq->index, kvh), qrow);
        if (p->rcos)
            fw_attn_rotate(p, kt, qrow, fw_attn_qpos(p, sq, r));
        int64_t lo, hi;
        fw_attn_visible(p, sq->sq, sq->sk, r, &lo, &hi);
        float m = -INFINITY, l = 0.0f;
        for (int j = 0; j < dv; j++)
            acc[j] = 0.0f;
        /* keys rotated as they are read: one f32 key (and value) row at a time */
        for (int64_t j = lo; j < hi && p->rot_k; j++) {
            kt->cvt.to_f32(fw_elem(p->k, fw_attn_key(p, sq, j, 0) + kvh * p->ks[1]), p->k->dtype,
                       p->ks[2], d, 1.0f, krow);
            fw_attn_rotate(p, kt, krow, j);
            kt->cvt.to_f32(fw_elem(p->v, fw_attn_key(p, sq, j, 1) + kvh * p->vs[1]), p->v->dtype,
                       p->vs[2], dv, 1.0f, vrow);
            kt->attn.plain_row(qrow, d, dv, FW_F32, krow, d, 1, vrow, dv, 1, 1, c->cap2, acc, &m, &l,
                          scratch);
        }
        if (p->rot_k)
            lo = hi;
        /* FW_KV_TILES: each key's K and V rows copied out of their tiles as bf16 rows */
        for (int64_t j = lo; j < hi && p->tiles; j++) {
            uint16_t *kw = (uint16_t *)krow, *vw = (uint16_t *)vrow;
            fw_attn_tile_rows_out(p, sq, j, 1, kvh, 0, kw);
            fw_attn_tile_rows_out(p, sq, j, 1, kvh, 1, vw);
            kt->attn.plain_row(qrow, d, dv, FW_BF16, kw, d, 1, vw, dv, 1, 1, c->cap2, acc, &m, &l, scratch);
        }
        if (p->tiles)
            lo = hi;
        /* runs of keys with a constant row stride: all of them, or one page at a time */
        for (int64_t j = lo; j < hi;) {
            const int64_t e = p->bt ? fw_min64(hi, (j / p->page + 1) * p->page) : hi;
            kt->attn.plain_row(qrow, d, dv, p->k->dtype, fw_elem(p->k, fw_attn_key(p, sq, j, 0) + kvh * p->ks[1]),
                          p->ks[0], p->ks[2], fw_elem(p->v, fw_attn_key(p, sq, j, 1) + kvh * p->vs[1]),
                          p->vs[0], p->vs[2], e - j, c->cap2, acc, &m, &l, scratch);
            j = e;
        }
        fw_attn_store_row(c, sq, h, r, acc, m, l);
    }
}
