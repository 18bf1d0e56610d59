/* attn/run.h: what the attention kernel driver's files share (not the reference): the
 * workspace layout, the work item, the run context, the three item kernels and the row
 * stores. The driver itself, and how work is cut into items, is in attn/run.c. */
#ifndef FW_ATTN_RUN_H
#define FW_ATTN_RUN_H

#include <math.h>
#include <string.h>
#include "attn.h"

/* ------------------------------------------------------------- workspace -- */

typedef struct {
    size_t qt, ot, al, rng, vec, st, kf, vf, row, dec; /* byte offsets in a thread's part */
    size_t qw, kw, vw, pw;                             /* bf16 products' panels (pair layout) */
    size_t total;
} ws_layout;

/* One thread's part of the workspace of a call with these heads, head dims, table, flags and
 * product precision (attn/workspace.c). */
ws_layout fw_attn_ws_layout(int64_t hq, int64_t hkv, int64_t d, int64_t dv, const fw_kernels *kt,
                            uint32_t flags, int bf16);
/* K/V groups a decode item carries: the K/V heads, or every q head without GQA packing. */
int64_t fw_attn_ws_units(int64_t hq, int64_t hkv, uint32_t flags);

/* Whole workspace: one part per thread, plus slack to align the first to 64 bytes. */
static inline size_t fw_attn_ws_bytes(const ws_layout *w, int threads)
{
    return (size_t)threads * w->total + 64;
}

/* ------------------------------------------------------------- work items -- */

typedef struct {
    int64_t seq, head, chunk; /* head: K/V head, or the q head when GQA packing is off */
    int64_t kb, ke;           /* the keys this item covers: [kb, ke) */
    int64_t part;             /* split items: offset of this split's partials, else -1 */
    int64_t cost;
    int bq, M;                /* tiled items: q rows per tile, and M (fw_attn_tile_rows) */
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

/* Plain kernel: one item is one (sequence, q head, block of FW_ATTN_PLAIN_ROWS query rows),
 * each row on its own. */
#define FW_ATTN_PLAIN_ROWS 16

/* The item kernels; sq is the item's sequence. A chunk of q tiles (attn/tile.c); a decode
 * sequence's key split, all heads (attn/decode.c); the plain baseline (attn/plain.c). */
void fw_attn_tile_item(const run_ctx *c, const item *it, const fw_attn_seq *sq, int tid);
void fw_attn_decode_item(const run_ctx *c, const item *it, const fw_attn_seq *sq, int tid);
void fw_attn_plain_item(const run_ctx *c, const item *it, const fw_attn_seq *sq, int tid);

/* ------------------------------------------------------------- row stores -- */

/* The result of one query row: out = o / l, lse = (a + log2 l) ln 2; o: dv unnormalised f32
 * accumulators; a, l: anchor/max and sum in log2 units. l = 0 happens two ways: a row that
 * sees no key gives out = 0 and lse = -inf; a row whose keys all scored -inf (an inf in q or
 * k) gives NaN, as exp(-inf - (-inf)) does in the reference (docs/design.md, "NaN and inf").
 * With attention sinks, the sink t = sinks[h] log2(e) joins the sum in the frame of
 * m = max(a, t), so neither side overflows: l' = l 2^(a-m) + 2^(t-m), out = o 2^(a-m) / l',
 * lse = (m + log2 l') ln 2 (a row that sees no key: out = 0, lse = sinks[h]); a NaN sink makes
 * the row NaN, as in the reference. Per row, in double, after the row's last product. An fp8
 * cache's V descale multiplies the row here. */
static inline void fw_attn_store_row(const run_ctx *c, const fw_attn_seq *sq, int64_t h,
                                     int64_t pos, float *o, float a, float l)
{
    const fw_attn_prob *p = c->p;
    float inv = 1.0f / l;
    double lse = ((double)a + log2((double)l)) * FW_LN2;
    if (l == 0.0f) {
        int64_t lo, hi;
        fw_attn_visible(p, sq->sq, sq->sk, pos, &lo, &hi);
        inv = hi > lo ? NAN : 0.0f;
        lse = hi > lo ? NAN : p->sinks ? fw_attn_sink(p, h) : -INFINITY;
    } else if (p->sinks) {
        const double t = fw_attn_sink(p, h) * FW_LOG2E, m = t > a || t != t ? t : a;
        const double ea = exp2(a - m), den = l * ea + exp2(t - m);
        inv = (float)(ea / den);
        lse = (m + log2(den)) * FW_LN2;
    }
    if (p->vdesc)
        inv *= fw_attn_descale(p, 1, sq->index, h / p->G);
    for (int64_t j = 0; j < p->dv; j++)
        o[j] *= inv;
    c->kt->cvt.from_f32(o, p->dv, (void *)fw_elem(p->out, sq->o0 + pos * p->os[0] + h * p->os[1]),
                    p->out->dtype, p->os[2]);
    if (p->lse)
        ((float *)p->lse->data)[sq->lse0 + h * p->lse_h + pos * p->lse_r] = (float)lse;
}

/* A split item's partial for tile row m: (o[dv], a, l), unnormalised, for the merge. */
static inline void fw_attn_store_partial(const run_ctx *c, const item *it, int m, const float *o,
                                         float a, float l)
{
    const int64_t dv = c->p->dv;
    float *dst = c->part + it->part + (size_t)m * (dv + 2);
    memcpy(dst, o, (size_t)dv * sizeof(float));
    dst[dv] = a;
    dst[dv + 1] = l;
}

#endif /* FW_ATTN_RUN_H */
