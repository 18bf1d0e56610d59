/* attn/workspace.c: the per-thread workspace of the attention kernels, its layout and size
 * (fw_attn_workspace_size). */
#include "run.h"

static size_t up64(size_t x) { return (x + 63) & ~(size_t)63; }

/* Per-thread layout for tiles of M rows (the largest M any sequence length gives) and a
 * decode state for `units` K/V groups of up to FW_DEC_ROWS rows each; with bf16 products
 * also the bf16 panels of the q tiles, one K/V tile and one P tile, sized by the table
 * (kern/mm_kern.h; the pair layout: for d = dv = 128, M = 64, 256 + 16 + 16 + 8 KiB). */
static ws_layout ws_plan(const fw_kernels *kt, int64_t d, int64_t dv, int M, int64_t units, int bf16)
{
    ws_layout w;
    size_t f = sizeof(float), C = FW_ATTN_CHUNK_MAX, BK = (size_t)kt->bk;
    w.qt = 0;
    w.ot = w.qt + up64(C * (size_t)d * M * f);
    w.al = w.ot + up64(C * (size_t)dv * M * f);   /* a, l: 2 x C x M floats */
    w.rng = w.al + up64(2 * C * M * f);           /* row key ranges: 2 x C x M int64 */
    w.vec = w.rng + up64(2 * C * M * sizeof(int64_t)); /* bias, zero, lo, hi, pending x2 */
    w.st = w.vec + up64(6 * (size_t)M * f);
    w.kf = w.st + up64(BK * M * f);
    w.vf = w.kf + up64(BK * (size_t)d * f);
    w.row = w.vf + up64(BK * (size_t)dv * f);     /* q, o rows; plain: q, rotated k, v rows */
    w.dec = w.row + up64(2 * ((size_t)d + dv) * f); /* per unit and row: q, o, a, l */
    w.qw = w.dec + up64((size_t)units * FW_DEC_ROWS * ((size_t)d + dv + 2) * f);
    /* the bf16 panels, sized by the table: q tiles, one K tile, one V tile, one P tile */
    const size_t b = bf16 ? 1 : 0;
    w.kw = w.qw + up64(b * C * kt->mm.panel_bytes((int)d, M));
    w.vw = w.kw + up64(b * kt->mm.panel_bytes((int)d, (int)BK));
    w.pw = w.vw + up64(b * kt->mm.panel_bytes((int)BK, (int)dv));
    w.total = w.pw + up64(b * kt->mm.panel_bytes((int)BK, M));
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

int64_t fw_attn_ws_units(int64_t hq, int64_t hkv, uint32_t flags)
{
    return (flags & FW_ATTN_PLAIN) ? 0 : (flags & FW_ATTN_NO_GQA_PACK) ? hq : hkv;
}

ws_layout fw_attn_ws_layout(int64_t hq, int64_t hkv, int64_t d, int64_t dv, const fw_kernels *kt,
                            uint32_t flags, int bf16)
{
    const int tiles_bf16 = bf16 && !(flags & FW_ATTN_PLAIN);
    return ws_plan(kt, d, dv, ws_rows(hq / hkv, kt, flags), fw_attn_ws_units(hq, hkv, flags), tiles_bf16);
}

fw_status fw_attn_ws_query(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                           const size_t *bytes, const fw_attn_params *params, int64_t dims[4],
                           const fw_kernels **kt)
{
    fw_clear_error();
    if (!q || !k || !v || !bytes)
        return fw_fail(FW_ERR_NULL, "%s is NULL", !q ? "q" : !k ? "k" : !v ? "v" : "bytes");
    if (q->ndim < 3 || q->ndim > 4 || k->ndim != q->ndim || v->ndim != q->ndim)
        return fw_fail(FW_ERR_SHAPE, "q, k, v must all be 4-D (dense) or 3-D (varlen)");
    const int o = q->ndim - 3;
    const int64_t hq = q->shape[o + 1], hkv = k->shape[o + 1], d = q->shape[o + 2], dv = v->shape[o + 2];
    if (hq < 1 || hkv < 1 || hq % hkv || d < 1 || d > FW_MAX_HEAD_DIM || dv < 1 ||
        dv > FW_MAX_HEAD_DIM || hq > FW_MAX_HEADS)
        return fw_fail(FW_ERR_SHAPE, "heads %lld/%lld or head dims %lld/%lld are invalid",
                       (long long)hq, (long long)hkv, (long long)d, (long long)dv);
    fw_attn_params dflt;
    fw_attn_params_init(&dflt);
    fw_status s = fw_attn_check_params(params ? params : &dflt);
    if (s)
        return s;
    if (!(*kt = fw_kernels_get(params ? params->isa : NULL)))
        return FW_ERR_UNSUPPORTED;
    dims[0] = hq; dims[1] = hkv; dims[2] = d; dims[3] = dv;
    return FW_OK;
}

fw_status fw_attn_workspace_size(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                 const fw_attn_params *params, size_t *bytes)
{
    int64_t dims[4] = {0};
    const fw_kernels *kt = NULL;
    fw_status s = fw_attn_ws_query(q, k, v, bytes, params, dims, &kt);
    if (s)
        return s;
    const int64_t hq = dims[0], hkv = dims[1], d = dims[2], dv = dims[3];
    const ws_layout w = fw_attn_ws_layout(hq, hkv, d, dv, kt, params ? params->flags : 0,
                                          fw_kernels_bf16_products(kt, q->dtype, params ? params->precision
                                                                                         : FW_PREC_AUTO));
    *bytes = fw_attn_ws_bytes(&w, fw_threads(params ? params->threads : 0));
    return FW_OK;
}
