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
    if (batch > 0 && !cu)
        return fw_fail(FW_ERR_NULL, "%s is NULL", name);
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
    if (params->flags & ~(uint32_t)(FW_ATTN_ONLINE_SOFTMAX | FW_ATTN_NO_GQA_PACK |
                                    FW_ATTN_NO_TILE_SKIP | FW_ATTN_PLAIN))
        return fw_fail(FW_ERR_ARG, "flags 0x%x has unknown bits", (unsigned)params->flags);
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
        if (lse) { p->lse_b = lse->stride[1]; p->lse_h = lse->stride[0]; p->lse_r = lse->stride[1]; }
    } else {
        p->batch = q->shape[0]; p->sq = q->shape[1]; p->sk = k->shape[1];
        p->qb = q->stride[0]; p->kb = k->stride[0]; p->vb = v->stride[0]; p->ob = out->stride[0];
        if (lse) { p->lse_b = lse->stride[0]; p->lse_h = lse->stride[1]; p->lse_r = lse->stride[2]; }
    }
    p->scale = params->scale != 0.0f ? (double)params->scale : 1.0 / sqrt((double)d);
    p->softcap = params->softcap;
    p->causal = params->causal;
    p->wl = params->window_left;
    p->wr = params->causal ? 0 : params->window_right;
    return FW_OK;
}

fw_attn_seq fw_attn_seq_get(const fw_attn_prob *p, int64_t i)
{
    fw_attn_seq s;
    if (p->varlen) {
        int64_t r = p->cuq[i], c = p->cuk[i];
        s.q0 = r * p->qs[0];
        s.k0 = c * p->ks[0];
        s.v0 = c * p->vs[0];
        s.o0 = r * p->os[0];
        s.lse0 = r * p->lse_b;
        s.sq = (int64_t)p->cuq[i + 1] - r;
        s.sk = (int64_t)p->cuk[i + 1] - c;
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
    size_t qt, ot, al, rng, vec, st, kf, vf, row, total; /* byte offsets within a thread's part */
} ws_layout;

static size_t up64(size_t x) { return (x + 63) & ~(size_t)63; }

/* Per-thread layout for tiles of M rows (the largest M any sequence length gives). */
static ws_layout ws_plan(int64_t d, int64_t dv, int M)
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
    w.total = w.row + up64(((size_t)d + dv) * f);
    return w;
}

static int eff_threads(const fw_attn_params *params)
{
    return params && params->threads > 0 ? params->threads : fw_cpu_count();
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

/* Whole workspace: one part per thread, plus slack to align the first to 64 bytes. */
static size_t ws_bytes(int64_t G, int64_t d, int64_t dv, const fw_kernels *kt, int threads,
                       uint32_t flags)
{
    return (size_t)threads * ws_plan(d, dv, ws_rows(G, kt, flags)).total + 64;
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
    if (params && (params->threads < 0 || params->threads > 256))
        return fw_fail(FW_ERR_ARG, "threads is %d; it must be 0 (all CPUs) to 256",
                       (int)params->threads);
    const fw_kernels *kt = fw_kernels_get(params ? params->isa : NULL);
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    *bytes = ws_bytes(hq / hkv, d, dv, kt, eff_threads(params), params ? params->flags : 0);
    return FW_OK;
}

/* ----------------------------------------------------------- tiled kernel -- */

typedef struct {
    int64_t seq, head, chunk; /* head: K/V head, or the q head when GQA packing is off */
    int64_t cost;
} item;

typedef struct {
    const fw_attn_prob *p;
    const fw_kernels *kt;
    uint32_t flags;
    int G;             /* q heads stacked per tile */
    int bq, M, chunk;  /* positions per q tile, padded rows, q tiles per chunk */
    float qscale, cap2;
    item *items;
    char *ws;
    size_t ws_stride;
    ws_layout wl;
} run_ctx;

static const char *elem(const fw_tensor *t, int64_t off)
{
    return (const char *)t->data + off * (int64_t)fw_dtype_size(t->dtype);
}

/* The key range a q tile needs: [lo, hi) is the union of its rows' visible ranges, and
 * [clo, chi) their intersection (empty if any row sees nothing): a K/V tile inside the
 * intersection needs no mask. */
typedef struct {
    int64_t lo, hi, clo, chi;
} tile_keys;

static void chunk_item(void *vctx, int64_t idx, int tid)
{
    const run_ctx *c = vctx;
    const fw_attn_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    const item *it = &c->items[idx];
    const fw_attn_seq sq = fw_attn_seq_get(p, it->seq);
    const int M = c->M, bq = c->bq, G = c->G, d = (int)p->d, dv = (int)p->dv;
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
    tile_keys tk[FW_ATTN_CHUNK_MAX];

    const int64_t p0 = it->chunk * (int64_t)c->chunk * bq;
    const int64_t p1 = fw_min64(sq.sq, p0 + (int64_t)c->chunk * bq);
    const int nt = (int)fw_ceil_div(p1 - p0, bq);
    int64_t klo = INT64_MAX, khi = INT64_MIN;

    /* Pack the chunk's q tiles: QT[r][k][m] for row m = g * bq + t (head h0 + g, position
     * p0 + r * bq + t), scaled so scores come out in log2 units. Padding rows are zero and see
     * no key. */
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
                const char *src = elem(p->q, sq.q0 + pos * p->qs[0] + (h0 + g) * p->qs[1]);
                kt->to_f32(src, p->q->dtype, p->qs[2], d, c->qscale, orow);
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
    }
    if (!skip) {
        klo = 0;
        khi = sq.sk;
    }
    for (int64_t t0 = klo < khi ? klo / FW_ATTN_BK * FW_ATTN_BK : khi; t0 < khi; t0 += FW_ATTN_BK) {
        const int64_t t1 = fw_min64(sq.sk, t0 + FW_ATTN_BK);
        const int nk = (int)(t1 - t0);
        /* K and V rows of this tile, converted to f32 once for every q tile and head here */
        for (int j = 0; j < nk; j++) {
            int64_t kr = sq.k0 + (t0 + j) * p->ks[0] + kvh * p->ks[1];
            int64_t vr = sq.v0 + (t0 + j) * p->vs[0] + kvh * p->vs[1];
            kt->to_f32(elem(p->k, kr), p->k->dtype, p->ks[2], d, 1.0f, Kf + (size_t)j * d);
            kt->to_f32(elem(p->v, vr), p->v->dtype, p->vs[2], dv, 1.0f, Vf + (size_t)j * dv);
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
            const float *QT_r = QT + (size_t)r * d * M;
            if (boundary)
                for (int m = 0; m < M; m++) {
                    lo[m] = (float)fw_max64(0, fw_min64(nk, rlo[m] - t0));
                    hi[m] = (float)fw_max64(0, fw_min64(nk, rhi[m] - t0));
                }
            for (int m = 0; m < M; m++)
                bias[m] = folded && A_r[m] != -INFINITY ? -A_r[m] : 0.0f;
            kt->qk(nk, d, M, Kf, d, QT_r, bias, ST);
            if (c->cap2 > 0.0f)
                kt->softcap(nk, M, ST, c->cap2);
            fw_softmax_args sa = {nk, M, ST, A_r, L_r, boundary ? lo : NULL, boundary ? hi : NULL,
                                  folded, online, OT_r, dv, pending};
            if (kt->softmax(&sa)) {
                /* the static anchor's bound failed: replay this tile exactly, online */
                kt->qk(nk, d, M, Kf, d, QT_r, zero, ST);
                if (c->cap2 > 0.0f)
                    kt->softcap(nk, M, ST, c->cap2);
                sa.folded = 0;
                sa.online = 1;
                kt->softmax(&sa);
            }
            kt->pv(nk, dv, M, Vf, dv, ST, OT_r);
        }
    }
    /* Normalise and store: out = OT / l; rows that saw no key give 0 and lse = -inf. */
    for (int r = 0; r < nt; r++)
        for (int g = 0; g < G; g++)
            for (int i = 0; i < bq && p0 + (int64_t)r * bq + i < p1; i++) {
                const int64_t pos = p0 + (int64_t)r * bq + i, h = h0 + g;
                const int m = g * bq + i;
                const float l = L[r * M + m], inv = l == 0.0f ? 0.0f : 1.0f / l;
                const float *ot = OT + (size_t)r * dv * M + m;
                for (int j = 0; j < dv; j++)
                    orow[j] = ot[(size_t)j * M] * inv;
                kt->from_f32(orow, dv, (void *)elem(p->out, sq.o0 + pos * p->os[0] + h * p->os[1]),
                             p->out->dtype, p->os[2]);
                if (p->lse)
                    ((float *)p->lse->data)[sq.lse0 + h * p->lse_h + pos * p->lse_r] =
                        l == 0.0f ? -INFINITY
                                  : (float)(((double)A[r * M + m] + log2((double)l)) * FW_LN2);
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
        kt->to_f32(elem(p->q, sq.q0 + r * p->qs[0] + h * p->qs[1]), p->q->dtype, p->qs[2], d,
                   c->qscale, qrow);
        int64_t lo, hi;
        fw_attn_visible(p, sq.sq, sq.sk, r, &lo, &hi);
        float m = -INFINITY, l = 0.0f;
        for (int j = 0; j < dv; j++)
            acc[j] = 0.0f;
        if (hi > lo)
            kt->plain_row(qrow, d, dv, p->k->dtype,
                          elem(p->k, sq.k0 + lo * p->ks[0] + kvh * p->ks[1]), p->ks[0], p->ks[2],
                          elem(p->v, sq.v0 + lo * p->vs[0] + kvh * p->vs[1]), p->vs[0], p->vs[2],
                          hi - lo, c->cap2, acc, &m, &l, scratch);
        const float inv = l == 0.0f ? 0.0f : 1.0f / l;
        for (int j = 0; j < dv; j++)
            acc[j] *= inv;
        kt->from_f32(acc, dv, (void *)elem(p->out, sq.o0 + r * p->os[0] + h * p->os[1]),
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
    return a->chunk < b->chunk ? -1 : (a->chunk > b->chunk);
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
    c.qscale = (float)(p->softcap > 0 ? p->scale / p->softcap : p->scale * FW_LOG2E);
    fw_attn_tile_rows(c.G, kt->vl, p->sq, &c.bq, &c.M);
    const int64_t heads = (plain || (flags & FW_ATTN_NO_GQA_PACK)) ? p->hq : p->hkv;

    /* the work list */
    int64_t total_tiles = 0;
    for (int64_t i = 0; i < p->batch; i++)
        total_tiles += fw_ceil_div(fw_attn_seq_get(p, i).sq, c.bq) * heads;
    c.chunk = fw_attn_chunk_tiles(total_tiles, threads);
    const int64_t span = plain ? PLAIN_ROWS : (int64_t)c.chunk * c.bq;
    int64_t n = 0;
    for (int64_t i = 0; i < p->batch; i++)
        n += fw_ceil_div(fw_attn_seq_get(p, i).sq, span) * heads;
    if (n == 0)
        return FW_OK;
    const size_t need = ws_bytes(p->G, p->d, p->dv, kt, threads, flags);
    if (params && params->workspace && params->workspace_bytes < need)
        return fw_fail(FW_ERR_WORKSPACE, "workspace has %zu bytes; this call needs %zu",
                       params->workspace_bytes, need);
    if ((size_t)n > SIZE_MAX / sizeof(item))
        return fw_fail(FW_ERR_OVERFLOW, "%lld work items overflow size_t", (long long)n);
    c.items = malloc((size_t)n * sizeof(item));
    void *own = NULL;
    char *ws = params && params->workspace ? params->workspace : (own = malloc(need));
    if (!c.items || !ws) {
        free(c.items);
        free(own);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate %zu bytes of workspace and %lld work items",
                       need, (long long)n);
    }
    c.ws = (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    c.wl = ws_plan(p->d, p->dv, ws_rows(p->G, kt, flags));
    c.ws_stride = c.wl.total;
    n = 0;
    for (int64_t i = 0; i < p->batch; i++) {
        fw_attn_seq s = fw_attn_seq_get(p, i);
        for (int64_t h = 0; h < heads; h++)
            for (int64_t ch = 0; ch * span < s.sq; ch++) {
                /* cost: the keys the chunk's last row sees times its rows */
                int64_t rows = fw_min64(span, s.sq - ch * span), lo, hi;
                fw_attn_visible(p, s.sq, s.sk, ch * span + rows - 1, &lo, &hi);
                item e = {i, h, ch, rows * fw_max64(1, hi - lo + FW_ATTN_BK)};
                c.items[n++] = e;
            }
    }
    qsort(c.items, (size_t)n, sizeof(item), cmp_item);
    fw_parallel(threads, n, plain ? plain_item : chunk_item, &c);
    free(c.items);
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
