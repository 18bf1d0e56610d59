/* gdn/layer.c: one Gated DeltaNet (or KDA) layer of an engine step (fw_gdn_layer): every
 * argument checked, the gates included, then window by window the causal conv (conv/conv1d.c)
 * of the sequences' qkv rows from their conv slots into a buffer, and the gated delta rule on
 * views of that buffer, with the gates computed in its kernels from the raw a and b: the
 * decodes by the fused step, the prefills by the chunked pass, both on the recurrent pool. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "../conv/conv.h"
#include "gdn.h"

void fw_gdn_layer_params_init(fw_gdn_layer_params *p)
{
    if (p)
        memset(p, 0, sizeof *p);
}

/* a_log [n_v], or dt_bias [n_v] (or [n_v d_k] when per_channel, KDA's). */
static fw_status check_vec(const fw_tensor *t, const char *what, int64_t n, int64_t per_channel)
{
    fw_status s = fw_check_tensor(t, what, 1, FW_DT_IN);
    if (!s && t->shape[0] != n && t->shape[0] != per_channel)
        s = fw_fail(FW_ERR_SHAPE, "%s has %lld entries; it must have n_v = %lld%s", what, (long long)t->shape[0],
                    (long long)n, per_channel > 0 ? " or, for KDA, n_v d_k" : "");
    return s;
}

/* Rows per window of the layer: the conv output of a window (LAYER_ROWS x dim elements,
 * 4 MiB for Qwen3-Next's 8192 bf16 channels) stays in cache until the gated delta rule reads
 * it, instead of a T x dim buffer whose pages a long prefill faults in on every call
 * (measured, T = 4K: the layer at 1.32x the core alone with one buffer, of which the
 * kernel's page clearing was 13% of the profile). A multiple of the chunk (64), so a long
 * sequence cut into windows runs the same chunks. */
#define LAYER_ROWS 256

/* The conv part of a window (as layer_window): its rows into L->cbuf, cu its sequences'
 * bounds there. */
static fw_status window_conv(const gdn_layer_prob *L, int64_t s0, int64_t s1, int64_t u0, int64_t u1, int32_t *cu)
{
    const fw_tensor *qkv = L->qkv;
    const int piece = u1 >= 0;
    const int64_t len = L->qsl[s0 + 1] - L->qsl[s0];
    const int64_t R0 = L->qsl[s0] + (piece ? u0 : 0), R1 = piece ? L->qsl[s0] + u1 : L->qsl[s1], rn = R1 - R0;
    const int64_t n = s1 - s0, K = L->w->shape[1];
    int32_t rd_local[1];
    const int32_t *rd = L->ridx + s0, *wr = L->wr + s0;
    for (int64_t i = 0; i <= n; i++)
        cu[i] = piece ? (i ? (int32_t)rn : 0) : L->qsl[s0 + i] - (int32_t)R0;
    /* the conv of rows [R0, R1) */
    fw_tensor x = gdn_conv_rows(qkv, R0, rn);
    const int64_t xs[3] = {1, rn, L->dim};
    fw_tensor y = fw_tensor_contiguous(L->cbuf, qkv->dtype, 3, xs);
    fw_conv1d_state cin = {L->caches->conv, rd, NULL}, cfin = {L->caches->conv, wr, NULL};
    if (piece && u0 > 0) { /* the K-1 rows before the piece, in qkv, as a one-slot cache */
        cin.cache = *qkv;
        cin.cache.ndim = 3;
        cin.cache.data = (char *)qkv->data + (R0 - (K - 1)) * qkv->stride[0] * (int64_t)fw_dtype_size(qkv->dtype);
        cin.cache.shape[0] = 1; cin.cache.shape[1] = K - 1; cin.cache.shape[2] = L->dim;
        cin.cache.stride[0] = 0; cin.cache.stride[1] = qkv->stride[0]; cin.cache.stride[2] = qkv->stride[1];
        rd_local[0] = 0;
        cin.idx = rd_local;
    }
    const int last = !piece || u1 == len;
    return fw_conv1d_fwd_cached(&x, L->w, L->bias, cu, n, &cin, last ? &cfin : NULL, &y, &L->cp);
}

/* One window: sequences [s0, s1) whole (u1 < 0), or tokens [u0, u1) of sequence s0 alone:
 * the conv from the conv slot (or, past a piece's start, from the rows before it in qkv),
 * its final state written with the sequence's last token, then the decode step or the
 * chunked pass from the recurrent read slot (a later piece: the write slot, where the
 * earlier piece left it). */
static fw_status layer_window(const gdn_layer_prob *L, int64_t s0, int64_t s1, int64_t u0, int64_t u1, int decode)
{
    const int piece = u1 >= 0;
    const int64_t R0 = L->qsl[s0] + (piece ? u0 : 0), R1 = piece ? L->qsl[s0] + u1 : L->qsl[s1], rn = R1 - R0;
    const int64_t n = s1 - s0;
    int32_t cu[LAYER_ROWS + 1], wr_local[1];
    const int32_t *rd = L->ridx + s0, *wr = L->wr + s0;
    fw_status s = window_conv(L, s0, s1, u0, u1, cu);
    if (s)
        return s;
    /* the gated delta rule on views of the conv rows */
    const fw_tensor *qkv = L->qkv;
    fw_tensor y2 = fw_tensor_contiguous(L->cbuf, qkv->dtype, 2, (int64_t[]){rn, L->dim});
    fw_tensor o2 = *L->out;
    fw_tensor q = gdn_rows_view(&y2, 0, rn, 0, L->nkq, L->dk);
    fw_tensor k = gdn_rows_view(&y2, 0, rn, L->nkq * L->dk, L->nkq, L->dk);
    fw_tensor v = gdn_rows_view(&y2, 0, rn, 2 * L->nkq * L->dk, L->nv, L->dv);
    fw_tensor o = gdn_rows_view(&o2, R0, rn, 0, L->nv, L->dv);
    /* the raw gates of these rows: the kernels compute g and beta from them */
    fw_tensor tg = L->kda ? gdn_rows_view(L->a, R0, rn, 0, L->nv, L->dk) : gdn_rows2(L->a, R0, rn);
    fw_tensor tb = gdn_rows2(L->b, R0, rn);
    const fw_dtype rdt = L->caches->recurrent_dtype;
    if (piece && L->carry) { /* a bf16 cache: the pieces pass on an f32 state, rounded once */
        static const int32_t zero = 0;
        const int64_t len = L->qsl[s0 + 1] - L->qsl[s0];
        const fw_gdn_pool slot = {L->caches->recurrent, L->slots, L->caches->recurrent_stride, rd, wr, rdt},
                          carry = {L->carry, 1, L->nv * L->dk * L->dv, &zero, &zero, FW_F32};
        return fw_gdn_prefill_pools(&q, &k, &v, &tg, &tb, cu, n, u0 > 0 ? &carry : &slot, u1 == len ? &slot : &carry,
                                    &o, &L->gp);
    }
    if (piece && u0 > 0) { /* a later piece continues from the write slot */
        wr_local[0] = wr[0];
        rd = wr_local;
    }
    fw_gdn_pool pool = {L->caches->recurrent, L->slots, L->caches->recurrent_stride, rd, wr, rdt};
    return decode ? fw_gdn_decode_pool(&q, &k, &v, &tg, &tb, &pool, &o, &L->gp)
                  : fw_gdn_prefill_pool(&q, &k, &v, &tg, &tb, cu, n, &pool, &o, &L->gp);
}

/* out's rows past the last token used, zeroed (params->zero_tail). */
void fw_gdn_layer_zero_tail(const gdn_layer_prob *L)
{
    for (int64_t t = L->used; t < L->T; t++)
        for (int64_t c = 0; c < L->nv * L->dv; c++)
            fw_store_f64(L->out, t * L->out->stride[0] + c * L->out->stride[1], 0.0);
}

/* The conv part of speculative windows [s0, s1) (rows at most LAYER_ROWS): the conv of their
 * rows from the conv read slots into L->cbuf, and a conv checkpoint per token (the K-1 raw
 * rows ending there, from the read slot's rows saved first, as the window may overwrite its
 * read slot) to slot wr[i] + t. */
static fw_status windows_conv(const gdn_layer_prob *L, int64_t s0, int64_t s1)
{
    const fw_kernels *kt = fw_kernels_get(L->gp.isa);
    const fw_tensor *qkv = L->qkv, *conv = &L->caches->conv;
    const int64_t n = s1 - s0, K = L->w->shape[1], dim = L->dim, R0 = L->qsl[s0], rn = L->qsl[s1] - R0;
    const int64_t es = (int64_t)fw_dtype_size(qkv->dtype);
    int32_t cu[LAYER_ROWS + 1];
    for (int64_t i = 0; i <= n; i++)
        cu[i] = L->qsl[s0 + i] - (int32_t)R0;
    fw_tensor x = gdn_conv_rows(qkv, R0, rn);
    fw_tensor y = fw_tensor_contiguous(L->cbuf, qkv->dtype, 3, (int64_t[]){1, rn, dim});
    fw_conv1d_state cin = {*conv, L->ridx + s0, NULL};
    fw_status s = fw_conv1d_fwd_cached(&x, L->w, L->bias, cu, n, &cin, NULL, &y, &L->cp);
    if (s)
        return s;
    /* scratch: the read slots' conv rows */
    const int64_t km = K - 1 > 0 ? K - 1 : 0;
    float *init = malloc(sizeof(float) * (size_t)(n * km * dim + dim + 1));
    if (!init)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the speculative windows' conv scratch");
    float *row = init + n * km * dim;
    const int64_t cs1 = conv->stride[1], cs2 = conv->stride[2], ces = (int64_t)fw_dtype_size(conv->dtype);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < km; j++) {
            float *dst = init + (i * km + j) * dim;
            const int64_t r = L->ridx[s0 + i];
            if (r < 0)
                memset(dst, 0, sizeof(float) * (size_t)dim);
            else
                kt->cvt.to_f32((const char *)conv->data + (r * conv->stride[0] + j * cs1) * ces, conv->dtype, cs2, (int)dim,
                           1.0f, dst);
        }
    for (int64_t i = 0; i < n; i++) /* conv checkpoints: after token t, rows t+1 .. t+K-1 of [init | window] */
        for (int64_t t = 0; t < L->qsl[s0 + i + 1] - L->qsl[s0 + i]; t++)
            for (int64_t j = 0; j < km; j++) {
                const int64_t c = t + 1 + j;
                const float *src = init + (i * km + c) * dim;
                if (c >= km) {
                    const int64_t qr = L->qsl[s0 + i] + c - km;
                    kt->cvt.to_f32((const char *)qkv->data + qr * qkv->stride[0] * es, qkv->dtype, qkv->stride[1], (int)dim,
                               1.0f, row);
                    src = row;
                }
                kt->cvt.from_f32(src, (int)dim,
                             (char *)conv->data + ((L->wr[s0 + i] + t) * conv->stride[0] + j * cs1) * ces, conv->dtype, cs2);
            }
    free(init);
    return FW_OK;
}

/* Speculative windows [s0, s1) (rows at most LAYER_ROWS): their conv (windows_conv), then
 * token by token the fused decode step of the windows that reach position t, from slot
 * rd[i] (t = 0) or wr[i] + t - 1 to slot wr[i] + t, on rows gathered into scratch. */
static fw_status layer_windows(const gdn_layer_prob *L, int64_t s0, int64_t s1)
{
    const fw_kernels *kt = fw_kernels_get(L->gp.isa);
    const fw_tensor *qkv = L->qkv;
    const int64_t n = s1 - s0, dim = L->dim, R0 = L->qsl[s0];
    const int64_t ga = L->kda ? L->nv * L->dk : L->nv, es = (int64_t)fw_dtype_size(qkv->dtype);
    int32_t rdv[LAYER_ROWS], wrv[LAYER_ROWS];
    fw_status s = windows_conv(L, s0, s1);
    if (s)
        return s;
    /* scratch: per position the gathered rows and gates */
    const int64_t nvdv = L->nv * L->dv, oes = (int64_t)fw_dtype_size(L->out->dtype);
    /* rows (qkv's dtype), gates (f32), out rows (out's dtype), one f32 row: each part 64-byte
     * aligned, so the f32 ones are aligned whatever the 2-byte parts' lengths */
    const int64_t rb = (n * dim * es + 63) / 64 * 64, gb = (n * (ga + L->nv) * 4 + 63) / 64 * 64;
    const int64_t ob = (n * nvdv * oes + 63) / 64 * 64;
    char *rows = aligned_alloc(64, (size_t)(rb + gb + ob + (nvdv * 4 + 63) / 64 * 64));
    if (!rows)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the speculative windows' scratch");
    /* the recurrent state, position by position */
    char *qr = rows, *ar = qr + rb, *br = ar + n * ga * 4, *orow = ar + gb;
    float *otmp = (float *)(orow + ob);
    for (int64_t t = 0; !s; t++) {
        int64_t na = 0;
        int32_t who[LAYER_ROWS];
        for (int64_t i = 0; i < n; i++) {
            if (L->qsl[s0 + i + 1] - L->qsl[s0 + i] <= t)
                continue;
            const int64_t r = L->qsl[s0 + i] + t;
            memcpy(qr + na * dim * es, (const char *)L->cbuf + (r - R0) * dim * es, (size_t)(dim * es));
            fw_tensor av = L->kda ? gdn_rows_view(L->a, r, 1, 0, L->nv, L->dk) : gdn_rows2(L->a, r, 1);
            const int64_t as = L->kda ? av.stride[2] : av.stride[1];
            for (int64_t h = 0; h < (L->kda ? L->nv : 1); h++)
                kt->cvt.to_f32(fw_elem(&av, h * (L->kda ? av.stride[1] : 0)), av.dtype, as, (int)(L->kda ? L->dk : L->nv),
                           1.0f, (float *)ar + na * ga + h * (L->kda ? L->dk : 0));
            kt->cvt.to_f32(fw_elem(L->b, r * L->b->stride[0]), L->b->dtype, L->b->stride[1], (int)L->nv, 1.0f,
                       (float *)br + na * L->nv);
            rdv[na] = t ? L->wr[s0 + i] + (int32_t)t - 1 : L->ridx[s0 + i];
            wrv[na] = L->wr[s0 + i] + (int32_t)t;
            who[na++] = (int32_t)r;
        }
        if (!na)
            break;
        fw_tensor y2 = fw_tensor_contiguous(qr, qkv->dtype, 2, (int64_t[]){na, dim});
        fw_tensor q = gdn_rows_view(&y2, 0, na, 0, L->nkq, L->dk);
        fw_tensor k = gdn_rows_view(&y2, 0, na, L->nkq * L->dk, L->nkq, L->dk);
        fw_tensor v = gdn_rows_view(&y2, 0, na, 2 * L->nkq * L->dk, L->nv, L->dv);
        fw_tensor tg = L->kda ? fw_tensor_contiguous(ar, FW_F32, 3, (int64_t[]){na, L->nv, L->dk})
                              : fw_tensor_contiguous(ar, FW_F32, 2, (int64_t[]){na, L->nv});
        fw_tensor tb = fw_tensor_contiguous(br, FW_F32, 2, (int64_t[]){na, L->nv});
        fw_tensor o = fw_tensor_contiguous(orow, L->out->dtype, 3, (int64_t[]){na, L->nv, L->dv});
        fw_gdn_pool pool = {L->caches->recurrent, L->slots, L->caches->recurrent_stride, rdv, wrv,
                            L->caches->recurrent_dtype};
        s = fw_gdn_decode_pool(&q, &k, &v, &tg, &tb, &pool, &o, &L->gp);
        for (int64_t j = 0; j < na && !s; j++) { /* the out rows (out may be strided) */
            kt->cvt.to_f32(orow + j * nvdv * oes, L->out->dtype, 1, (int)nvdv, 1.0f, otmp);
            kt->cvt.from_f32(otmp, (int)nvdv, (char *)L->out->data + who[j] * L->out->stride[0] * oes, L->out->dtype,
                         L->out->stride[1]);
        }
    }
    free(rows);
    return s;
}

/* The head counts and dims of params. */
static fw_status check_heads(const fw_gdn_layer_params *params)
{
    const int64_t nkq = params->n_kq, nv = params->n_v, dk = params->d_k, dv = params->d_v;
    if (nkq < 1 || nv < 1 || nv % nkq || dk < 1 || dk > FW_MAX_HEAD_DIM || dv < 1 || dv > FW_MAX_HEAD_DIM ||
        nv > FW_MAX_HEADS)
        return fw_fail(FW_ERR_SHAPE, "n_kq %lld, n_v %lld, d_k %lld, d_v %lld: n_v must be a multiple of n_kq "
                       "(at most %d) and the dims 1..%d", (long long)nkq, (long long)nv, (long long)dk,
                       (long long)dv, FW_MAX_HEADS, FW_MAX_HEAD_DIM);
    return FW_OK;
}

/* The step's tensors against the heads: ranks and dtypes (out also f64 for the reference),
 * the gate parameters, the shapes, and out free of self-aliasing. *kda: a is [T, n_v d_k],
 * a decay per key channel (d_k = 1 is GDN either way). */
static fw_status check_layer_tensors(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                                     const fw_tensor *conv_weight, const fw_tensor *a_log, const fw_tensor *dt_bias,
                                     const fw_tensor *out, const fw_gdn_layer_params *params, int ref, int *kda)
{
    const int64_t nkq = params->n_kq, nv = params->n_v, dk = params->d_k, dv = params->d_v;
    fw_status s;
    if ((s = fw_check_tensor(qkv, "qkv", 2, FW_DT_IN)) || (s = fw_check_tensor(b, "b", 2, FW_DT_IN)) ||
        (s = fw_check_tensor(conv_weight, "conv_weight", 2, FW_DT_IN)) ||
        (s = fw_check_tensor(a, "a", 2, FW_DT_IN)) ||
        (s = fw_check_tensor(out, "out", 2, ref ? FW_DT_IN | 1u << FW_F64 : FW_DT_IN)))
        return s;
    *kda = dk > 1 && a->shape[1] == nv * dk;
    if ((s = check_vec(a_log, "a_log", nv, 0)) || (s = check_vec(dt_bias, "dt_bias", nv, *kda ? nv * dk : 0)))
        return s;
    const int64_t T = qkv->shape[0], dim = 2 * nkq * dk + nv * dv;
    if (qkv->shape[1] != dim)
        return fw_fail(FW_ERR_SHAPE, "qkv has %lld columns; [q | k | v] needs 2 n_kq d_k + n_v d_v = %lld",
                       (long long)qkv->shape[1], (long long)dim);
    if (b->shape[0] != T || b->shape[1] != nv || a->shape[0] != T || (a->shape[1] != nv && !*kda))
        return fw_fail(FW_ERR_SHAPE, "b must be [T, n_v] = [%lld, %lld] and a [T, n_v] (or, for KDA, [T, n_v d_k] = "
                       "[%lld, %lld])", (long long)T, (long long)nv, (long long)T, (long long)(nv * dk));
    if (out->shape[0] != T || out->shape[1] != nv * dv)
        return fw_fail(FW_ERR_SHAPE, "out must be [T, n_v d_v] = [%lld, %lld]", (long long)T, (long long)(nv * dv));
    return fw_check_no_alias(out, "out");
}

/* The batch against qkv's T rows: its distribution, its pointers, query_start_loc, the
 * speculative windows' bound, and each sequence's tokens. *used: the rows its sequences take. */
static fw_status check_batch(const fw_gdn_batch *batch, int64_t T, int64_t *used)
{
    fw_status s;
    const int64_t n = batch->n_seqs;
    const int32_t *qsl = batch->query_start_loc, *sl = batch->seq_lens, *wr = batch->state_indices;
    const int64_t de = batch->decode_end, pe = batch->prefill_end, me = batch->mixed_end;
    if (n < 0 || n > INT32_MAX)
        return fw_fail(FW_ERR_ARG, "n_seqs is %lld; it must be 0..2^31-1", (long long)n);
    if (!(0 <= de && de <= pe && pe <= me && me <= n))
        return fw_fail(FW_ERR_ARG, "distribution [%lld, %lld, %lld] must be 0 <= decode_end <= prefill_end <= "
                       "mixed_end <= n_seqs = %lld", (long long)de, (long long)pe, (long long)me, (long long)n);
    if (me > 0 && (!qsl || !sl || !wr))
        return fw_fail(FW_ERR_NULL, "%s is NULL", !qsl ? "query_start_loc" : !sl ? "seq_lens" : "state_indices");
    if (me > 0 && (s = fw_check_cu_seqlens(qsl, me, -1, "query_start_loc")))
        return s;
    *used = me > 0 ? qsl[me] : 0;
    if (*used > T)
        return fw_fail(FW_ERR_SEQLENS, "query_start_loc[%lld] = %lld is past qkv's %lld rows", (long long)me,
                       (long long)*used, (long long)T);
    const int64_t spec = batch->num_spec_tokens;
    if (spec < 0 || spec >= LAYER_ROWS)
        return fw_fail(FW_ERR_ARG, "num_spec_tokens is %lld; it must be 0..%d", (long long)spec, LAYER_ROWS - 1);
    for (int64_t i = 0; i < me; i++) {
        const int64_t ql = qsl[i + 1] - qsl[i];
        if (i < de && !spec && ql != 1)
            return fw_fail(FW_ERR_SEQLENS, "sequence %lld is a decode (before decode_end %lld) with %lld tokens; "
                           "a decode has 1", (long long)i, (long long)de, (long long)ql);
        if (i < de && spec && (ql < 1 || ql > spec + 1))
            return fw_fail(FW_ERR_SEQLENS, "sequence %lld is a speculative window (before decode_end %lld) of %lld "
                           "tokens; a window has 1..num_spec_tokens + 1 = %lld", (long long)i, (long long)de,
                           (long long)ql, (long long)(spec + 1));
        if (sl[i] < ql)
            return fw_fail(FW_ERR_SEQLENS, "seq_lens[%lld] = %d is less than its %lld new tokens", (long long)i,
                           (int)sl[i], (long long)ql);
    }
    return FW_OK;
}

/* The conv cache: [slots, K-1, dim]. */
static fw_status check_conv_cache(const fw_gdn_caches *caches, int64_t K, int64_t dim)
{
    fw_status s;
    if ((s = fw_check_tensor(&caches->conv, "conv cache", 3, FW_DT_IN)))
        return s;
    if (caches->conv.shape[1] != K - 1 || caches->conv.shape[2] != dim)
        return fw_fail(FW_ERR_SHAPE, "the conv cache is [%lld, %lld, %lld]; it must be [slots, K-1, dim] = "
                       "[slots, %lld, %lld]", (long long)caches->conv.shape[0], (long long)caches->conv.shape[1],
                       (long long)caches->conv.shape[2], (long long)(K - 1), (long long)dim);
    return FW_OK;
}

/* The slot each sequence of a checked batch reads, allocated into *ridx (the caller frees
 * it): a new sequence reads none (-1), a speculative window its read slot plus its offset. */
static fw_status read_slots(const fw_gdn_batch *batch, int32_t **ridx)
{
    const int64_t me = batch->mixed_end, de = batch->decode_end, spec = batch->num_spec_tokens;
    const int32_t *qsl = batch->query_start_loc, *sl = batch->seq_lens;
    const int32_t *rd = batch->read_state_indices ? batch->read_state_indices : batch->state_indices;
    int32_t *r = *ridx = malloc(sizeof(int32_t) * (size_t)(me > 0 ? me : 1));
    if (!r)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the layer's slot lists");
    for (int64_t i = 0; i < me; i++)
        r[i] = sl[i] > qsl[i + 1] - qsl[i] ? rd[i] + (spec && i < de && batch->read_offsets ? batch->read_offsets[i] : 0)
                                            : -1;
    return FW_OK;
}

/* The slots read (ridx) and written (state_indices) against the pools: the recurrent pool's
 * checks (a plain step's; windows write a group of slots each, checked after), and every
 * sequence writing one. */
static fw_status check_slots(const fw_gdn_batch *batch, const fw_gdn_caches *caches, const int32_t *ridx,
                             const fw_gdn_layer_params *params)
{
    const int64_t me = batch->mixed_end, spec = batch->num_spec_tokens, slots = caches->conv.shape[0];
    const int32_t *wr = batch->state_indices;
    fw_gdn_pool pool = {caches->recurrent, slots, caches->recurrent_stride, ridx, wr, caches->recurrent_dtype};
    fw_status s = fw_gdn_check_pool(&pool, spec ? 0 : me, params->n_v, params->d_k, params->d_v);
    for (int64_t i = 0; i < me && !s; i++)
        if (wr[i] < 0)
            s = fw_fail(FW_ERR_INDEX, "state_indices[%lld] is %d; every sequence writes a slot", (long long)i, (int)wr[i]);
    if (!s && spec)
        s = gdn_check_window_slots(me, batch->decode_end, batch->query_start_loc, ridx, wr, slots);
    return s;
}

/* The conv's weight [dim, K] and bias [dim] (its slots are the pool's, checked with them). */
static fw_status check_conv_args(const fw_tensor *conv_weight, const fw_tensor *conv_bias, int64_t dim)
{
    fw_status s = FW_OK;
    const int64_t K = conv_weight->shape[1];
    if (conv_weight->shape[0] != dim || K < 1 || K > FW_MAX_CONV_WIDTH)
        return fw_fail(FW_ERR_SHAPE, "conv_weight is [%lld, %lld]; it must be [dim, K] = [%lld, 1..%d]",
                       (long long)conv_weight->shape[0], (long long)K, (long long)dim, FW_MAX_CONV_WIDTH);
    if (conv_bias && !(s = fw_check_tensor(conv_bias, "conv_bias", 1, FW_DT_IN)) && conv_bias->shape[0] != dim)
        s = fw_fail(FW_ERR_SHAPE, "conv_bias has %lld entries; it must have dim = %lld",
                    (long long)conv_bias->shape[0], (long long)dim);
    return s;
}

/* The outputs apart from the inputs: out from every input and the conv cache, the conv cache
 * from qkv and conv_weight. */
static fw_status check_overlaps(const fw_tensor *out, const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                                const fw_tensor *conv_weight, const fw_tensor *conv_bias, const fw_gdn_caches *caches)
{
    const fw_tensor *ins[6] = {qkv, b, a, conv_weight, &caches->conv, conv_bias};
    static const char *names[6] = {"qkv", "b", "a", "conv_weight", "the conv cache", "conv_bias"};
    for (int i = 0; i < 6; i++)
        if (ins[i] && fw_overlap(out, ins[i]))
            return fw_fail(FW_ERR_STRIDE, "out overlaps %s; it must be a separate buffer", names[i]);
    if (fw_overlap(&caches->conv, qkv) || fw_overlap(&caches->conv, conv_weight))
        return fw_fail(FW_ERR_STRIDE, "the conv cache overlaps qkv or conv_weight");
    return FW_OK;
}

/* The scalar parameters, the precision and the kernel table. */
static fw_status check_scalars(const fw_gdn_layer_params *params)
{
    if (!isfinite(params->scale) || !(params->l2norm_eps >= 0.0f) || !isfinite(params->l2norm_eps) ||
        (params->zero_tail != 0 && params->zero_tail != 1) ||
        (params->beta_activated != 0 && params->beta_activated != 1) ||
        !(params->lower_bound <= 0.0f) || !isfinite(params->lower_bound))
        return fw_fail(FW_ERR_ARG, "scale %g, l2norm_eps %g, zero_tail %d, beta_activated %d, lower_bound %g: finite, "
                       ">= 0, 0 or 1, 0 or 1, finite and <= 0", (double)params->scale, (double)params->l2norm_eps,
                       (int)params->zero_tail, (int)params->beta_activated, (double)params->lower_bound);
    if (params->precision < FW_PREC_AUTO || params->precision > FW_PREC_BF16)
        return fw_fail(FW_ERR_ARG, "precision is %d", (int)params->precision);
    if (!fw_kernels_get(params->isa))
        return FW_ERR_UNSUPPORTED;
    return FW_OK;
}

/* The conv's parameters: SiLU, the layer's threads and table. */
static fw_conv1d_params conv_params_of(const fw_gdn_layer_params *params)
{
    fw_conv1d_params cp;
    fw_conv1d_params_init(&cp);
    cp.activation = FW_ACT_SILU;
    cp.threads = params->threads;
    cp.isa = params->isa;
    return cp;
}

/* The core's parameters: the gates computed in its kernels from the raw a and b. */
static fw_gdn_params core_params_of(const fw_gdn_layer_params *params, const fw_tensor *a_log,
                                    const fw_tensor *dt_bias)
{
    fw_gdn_params gp;
    fw_gdn_params_init(&gp);
    gp.scale = params->scale;
    gp.l2norm_qk = 1;
    gp.l2norm_eps = params->l2norm_eps;
    gp.threads = params->threads;
    gp.isa = params->isa;
    gp.precision = params->precision;
    gp.a_log = a_log;
    gp.dt_bias = dt_bias;
    gp.lower_bound = params->lower_bound;
    gp.beta_sigmoid = !params->beta_activated;
    return gp;
}

/* Every argument checked, in this order, before anything is written: the heads, the
 * tensors, the batch, the conv cache, the slots, the conv's weight and bias, the threads, the
 * overlaps, the scalars, then the gates of every row used (they do not depend on the conv:
 * finite, or refused). On success L holds the step, with ridx allocated. */
fw_status fw_gdn_layer_check(gdn_layer_prob *L, const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                             const fw_tensor *conv_weight, const fw_tensor *conv_bias, const fw_tensor *a_log,
                             const fw_tensor *dt_bias, const fw_gdn_batch *batch, const fw_gdn_caches *caches,
                             const fw_tensor *out, const fw_gdn_layer_params *params, int ref)
{
    fw_status s;
    if (!batch || !caches || !params)
        return fw_fail(FW_ERR_NULL, "%s is NULL", !batch ? "batch" : !caches ? "caches" : "params");
    int kda = 0;
    if ((s = check_heads(params)) ||
        (s = check_layer_tensors(qkv, b, a, conv_weight, a_log, dt_bias, out, params, ref, &kda)))
        return s;
    const int64_t nkq = params->n_kq, nv = params->n_v, dk = params->d_k, dv = params->d_v;
    const int64_t T = qkv->shape[0], dim = 2 * nkq * dk + nv * dv;
    int64_t used = 0;
    int32_t *ridx;
    if ((s = check_batch(batch, T, &used)) || (s = check_conv_cache(caches, conv_weight->shape[1], dim)) ||
        (s = read_slots(batch, &ridx)))
        return s;
    if (!(s = check_slots(batch, caches, ridx, params)) && !(s = check_conv_args(conv_weight, conv_bias, dim)) &&
        !(s = fw_check_threads(params->threads)))
        s = check_overlaps(out, qkv, b, a, conv_weight, conv_bias, caches);
    const fw_conv1d_params cp = conv_params_of(params);
    const fw_gdn_params gp = core_params_of(params, a_log, dt_bias);
    if (!s)
        s = check_scalars(params);
    if (!s) {
        fw_tensor tg = kda ? gdn_rows_view(a, 0, used, 0, nv, dk) : gdn_rows2(a, 0, used), tb = gdn_rows2(b, 0, used);
        s = fw_gdn_check_gates(&tg, &tb, nv, dk, &gp);
    }
    if (s) {
        free(ridx);
        return s;
    }
    *L = (gdn_layer_prob){qkv, conv_weight, conv_bias, out, a, b, batch->query_start_loc, ridx, batch->state_indices,
                          caches, NULL, NULL, cp, gp, nkq, nv, dk, dv, dim, caches->conv.shape[0], T, used,
                          batch->decode_end, batch->mixed_end, batch->num_spec_tokens, kda, params->zero_tail};
    return FW_OK;
}

/* The step: windows of at most LAYER_ROWS rows, the conv writing a window's rows into cbuf
 * and the gated delta rule reading them there. With a replay plan P, the decodes (and
 * windows) run ReplaySSM and every recurrent state written gets its bf16 shadow. */
static fw_status layer_run(gdn_layer_prob *L, const gdn_replay_plan *P)
{
    const int64_t used = L->used, de = L->de, me = L->me, spec = L->spec, dim = L->dim;
    const int32_t *qsl = L->qsl;
    L->cbuf = malloc((size_t)(fw_min64(used, LAYER_ROWS) * dim) * fw_dtype_size(L->qkv->dtype) + 1);
    if (!L->cbuf)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the layer's %lld x %lld conv rows", (long long)used,
                       (long long)dim);
    int64_t longest = 0;
    for (int64_t i = de; i < me; i++)
        longest = fw_max64(longest, qsl[i + 1] - qsl[i]);
    if (L->caches->recurrent_dtype != FW_F32 && longest > LAYER_ROWS &&
        !(L->carry = malloc(sizeof(float) * (size_t)(L->nv * L->dk * L->dv)))) {
        free(L->cbuf);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the layer's f32 state for a long sequence");
    }
    fw_status s = FW_OK;
    if (spec || P) { /* windows (or ReplaySSM decodes), in groups of at most LAYER_ROWS rows */
        for (int64_t i = 0; i < de && !s;) {
            int64_t j = i + 1;
            while (j < de && qsl[j + 1] - qsl[i] <= LAYER_ROWS)
                j++;
            if (!P) {
                s = layer_windows(L, i, j);
            } else {
                int32_t cu[LAYER_ROWS + 1];
                s = spec ? windows_conv(L, i, j) : window_conv(L, i, j, 0, -1, cu);
                if (!s)
                    s = gdn_replay_run(L, P, i, j);
            }
            i = j;
        }
    }
    for (int64_t d0 = 0; d0 < (spec || P ? 0 : de) && !s; d0 += LAYER_ROWS) /* decodes: whole sequences */
        s = layer_window(L, d0, fw_min64(de, d0 + LAYER_ROWS), 0, -1, 1);
    for (int64_t i = de; i < me && !s;) {
        const int64_t len = qsl[i + 1] - qsl[i];
        if (len > LAYER_ROWS) { /* a long sequence: pieces of LAYER_ROWS tokens, state carried */
            for (int64_t u0 = 0; u0 < len && !s; u0 += LAYER_ROWS)
                s = layer_window(L, i, i + 1, u0, fw_min64(len, u0 + LAYER_ROWS), 0);
            i++;
            continue;
        }
        int64_t j = i + 1; /* short ones together, up to LAYER_ROWS rows */
        while (j < me && j - i < LAYER_ROWS && qsl[j + 1] - qsl[i] <= LAYER_ROWS)
            j++;
        s = layer_window(L, i, j, 0, -1, 0);
        i = j;
    }
    for (int64_t i = de; P && i < me && !s; i++)
        gdn_replay_shadow(L, P, L->wr[i]);
    if (!s && L->zero_tail)
        fw_gdn_layer_zero_tail(L);
    free(L->cbuf);
    free(L->carry);
    return s;
}

fw_status gdn_layer_call(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a, const fw_tensor *conv_weight,
                         const fw_tensor *conv_bias, const fw_tensor *a_log, const fw_tensor *dt_bias,
                         const fw_gdn_batch *batch, const fw_gdn_caches *caches, const fw_gdn_replay *replay,
                         int with_replay, const fw_tensor *out, const fw_gdn_layer_params *params, int ref,
                         gdn_layer_run_fn run)
{
    fw_clear_error();
    gdn_layer_prob L;
    gdn_replay_plan P;
    fw_status s = fw_gdn_layer_check(&L, qkv, b, a, conv_weight, conv_bias, a_log, dt_bias, batch, caches, out,
                                     params, ref);
    if (s)
        return s;
    if (!with_replay) {
        s = run(&L, NULL);
    } else if (!(s = gdn_replay_check(&L, batch, replay, &P))) {
        s = run(&L, &P);
        gdn_replay_free(&P);
    }
    free((void *)L.ridx);
    return s;
}

fw_status fw_gdn_layer(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                       const fw_tensor *conv_weight, const fw_tensor *conv_bias,
                       const fw_tensor *a_log, const fw_tensor *dt_bias,
                       const fw_gdn_batch *batch, const fw_gdn_caches *caches,
                       const fw_tensor *out, const fw_gdn_layer_params *params)
{
    return gdn_layer_call(qkv, b, a, conv_weight, conv_bias, a_log, dt_bias, batch, caches, NULL, 0, out, params, 0,
                          layer_run);
}

fw_status fw_gdn_layer_replay(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                              const fw_tensor *conv_weight, const fw_tensor *conv_bias,
                              const fw_tensor *a_log, const fw_tensor *dt_bias,
                              const fw_gdn_batch *batch, const fw_gdn_caches *caches,
                              const fw_gdn_replay *replay, const fw_tensor *out,
                              const fw_gdn_layer_params *params)
{
    return gdn_layer_call(qkv, b, a, conv_weight, conv_bias, a_log, dt_bias, batch, caches, replay, 1, out, params, 0,
                          layer_run);
}
