/* ref/gdn_layer_ref.c: the float64 reference of the GDN / KDA serving layer
 * (fw_gdn_layer_ref): the layer's own checks, then sequence by sequence (a speculative
 * window token by token, a checkpoint after each) the conv's reference from the conv read
 * slot into rows kept in qkv's dtype, as the layer keeps them, and the core's reference on
 * views of those rows from the recurrent read slot, its final state stored in the write
 * slot. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "../gdn/gdn.h"

/* Scratch of one call: the conv rows of the longest piece, a state in and out. */
typedef struct {
    void *rows;
    float *state;
    double *fin;
} piece_buf;

/* Rows [r0, r0 + n) of one sequence from slot rd (negative: zero states) to slot wr, both
 * caches; decode: the exact recurrence (the layer's fused step has no product roundings),
 * else the chunked pass's precision (fw_gdn_ref's same-roundings reference for bf16
 * products). */
/* The conv's reference of rows [r0, r0 + n) of one sequence from conv slot rd to slot wr,
 * into `rows` (qkv's dtype). */
static fw_status ref_conv(const gdn_layer_prob *L, int64_t r0, int64_t n, int32_t rd, int32_t wr, void *rows)
{
    fw_tensor x = gdn_conv_rows(L->qkv, r0, n);
    fw_tensor y = fw_tensor_contiguous(rows, L->qkv->dtype, 3, (int64_t[]){1, n, L->dim});
    const int32_t cu[2] = {0, (int32_t)n};
    fw_conv1d_state cin = {L->caches->conv, &rd, NULL}, cfin = {L->caches->conv, &wr, NULL};
    return fw_conv1d_ref(&x, L->w, L->bias, cu, 1, &cin, &cfin, NULL, &y, &L->cp);
}

/* A speculative window i: the conv's reference over its rows from conv slot ridx[i] into
 * `rows` (as one sequence: token t's taps are the window's raw rows, not a checkpoint read
 * back in the cache's dtype), then the checkpoint after each token t to conv slot wr[i] + t:
 * the K-1 raw rows ending there, from the read slot's rows (saved first: the window may write
 * its read slot) and the window's. */
static fw_status ref_window_conv(const gdn_layer_prob *L, int64_t i, void *rows)
{
    const fw_tensor *qkv = L->qkv, *conv = &L->caches->conv;
    const int64_t r0 = L->qsl[i], n = L->qsl[i + 1] - r0, km = L->w->shape[1] - 1, dim = L->dim;
    fw_tensor x = gdn_conv_rows(qkv, r0, n);
    fw_tensor y = fw_tensor_contiguous(rows, qkv->dtype, 3, (int64_t[]){1, n, dim});
    const int32_t cu[2] = {0, (int32_t)n}, rd = L->ridx[i];
    fw_conv1d_state cin = {*conv, &rd, NULL};
    fw_status s = fw_conv1d_ref(&x, L->w, L->bias, cu, 1, &cin, NULL, NULL, &y, &L->cp);
    double *init = malloc(sizeof(double) * (size_t)(km * dim + 1));
    if (!s && !init)
        s = fw_fail(FW_ERR_NOMEM, "cannot allocate the reference's conv rows");
    for (int64_t j = 0; j < km * dim && !s; j++)
        init[j] = rd < 0 ? 0.0 : fw_load_f64(conv, rd * conv->stride[0] + (j / dim) * conv->stride[1] +
                                                       (j % dim) * conv->stride[2]);
    for (int64_t t = 0; t < n && !s; t++)
        for (int64_t j = 0; j < km; j++)
            for (int64_t c = 0; c < dim; c++) {
                const int64_t e = t + 1 + j; /* entry of [init | window] */
                const double v = e < km ? init[e * dim + c]
                                        : fw_load_f64(qkv, (r0 + e - km) * qkv->stride[0] + c * qkv->stride[1]);
                fw_store_f64(conv, (L->wr[i] + t) * conv->stride[0] + j * conv->stride[1] + c * conv->stride[2], v);
            }
    free(init);
    return s;
}

/* Rows [r0, r0 + n) of one sequence from slot rd to slot wr: the conv's (unless `rows` holds
 * them already), then the core's. */
static fw_status ref_piece(const gdn_layer_prob *L, int64_t r0, int64_t n, int32_t rd, int32_t wr, int decode,
                           const piece_buf *B, const void *rows)
{
    const fw_tensor *qkv = L->qkv;
    const int64_t dim = L->dim, ss = L->nv * L->dk * L->dv;
    const int32_t cu[2] = {0, (int32_t)n};
    fw_status s = rows ? FW_OK : ref_conv(L, r0, n, rd, wr, B->rows);
    if (s)
        return s;
    fw_tensor y2 = fw_tensor_contiguous(rows ? (void *)rows : B->rows, qkv->dtype, 2, (int64_t[]){n, dim});
    fw_tensor q = gdn_rows_view(&y2, 0, n, 0, L->nkq, L->dk);
    fw_tensor k = gdn_rows_view(&y2, 0, n, L->nkq * L->dk, L->nkq, L->dk);
    fw_tensor v = gdn_rows_view(&y2, 0, n, 2 * L->nkq * L->dk, L->nv, L->dv);
    fw_tensor o = gdn_rows_view(L->out, r0, n, 0, L->nv, L->dv);
    fw_tensor tg = L->kda ? gdn_rows_view(L->a, r0, n, 0, L->nv, L->dk) : gdn_rows2(L->a, r0, n);
    fw_tensor tb = gdn_rows2(L->b, r0, n);
    /* the recurrent slots as a flat tensor of their dtype (bf16: read exactly, written rounded
     * from f32, as the layer rounds its f32 state) */
    const int64_t st = L->caches->recurrent_stride;
    const fw_tensor rec = fw_tensor_contiguous(L->caches->recurrent, L->caches->recurrent_dtype, 1,
                                               (int64_t[]){(L->slots > 0 ? (L->slots - 1) * st : 0) + ss});
    for (int64_t i = 0; i < ss && rd >= 0; i++)
        B->state[i] = (float)fw_load_f64(&rec, rd * st + i);
    fw_gdn_params gp = L->gp;
    gp.threads = 1;
    if (decode)
        gp.flags |= FW_GDN_RECURRENT;
    s = fw_gdn_ref(&q, &k, &v, &tg, &tb, cu, 1, rd >= 0 ? B->state : NULL, B->fin, &o, &gp);
    for (int64_t i = 0; i < ss && !s; i++)
        fw_store_f64(&rec, wr * st + i, B->fin[i]);
    return s;
}

/* Element (slot, row, col) of the records tensor `rec`. */
#define REC(slot, row, col) (((slot) * rec->stride[0] + (row) * rec->stride[1] + (col) * rec->stride[2]))

/* Decode i's state before its tokens, in double: its checkpoint (the f32 one, or from the bf16
 * shadow), then each committed record as stored: S = diag(e^g_j) S + k_j u_j^T. The shadow is
 * read before the flush writes it: the flush may write the slot it reads. */
static void ref_fold(const gdn_layer_prob *L, const gdn_replay_plan *P, int64_t i, int shadow, double *S)
{
    const int64_t nv = L->nv, dk = L->dk, dv = L->dv, gw = L->kda ? dk : 1, rr = nv / L->nkq;
    const int64_t Lc = P->len[i], rd = P->rd[i];
    const fw_tensor *rec = &P->R->records, *sh = &P->R->shadow;
    const float *ck = rd >= 0 ? (const float *)L->caches->recurrent + rd * L->caches->recurrent_stride : NULL;
    for (int64_t h = 0; h < nv; h++)
        for (int64_t x = 0; x < dk; x++)
            for (int64_t y = 0; y < dv; y++)
                S[(h * dk + x) * dv + y] =
                    !ck ? 0.0
                    : shadow ? fw_load_f64(sh, rd * sh->stride[0] + h * sh->stride[1] + x * sh->stride[2] + y * sh->stride[3])
                             : ck[(h * dk + x) * dv + y];
    for (int64_t j = 0; j < Lc; j++)
        for (int64_t vh = 0; vh < nv; vh++)
            for (int64_t x = 0; x < dk; x++) {
                const double dec = exp(fw_load_f64(rec, REC(rd, j, P->goff + vh * gw + (L->kda ? x : 0))));
                const double kx = fw_load_f64(rec, REC(rd, j, P->koff + (vh / rr) * dk + x));
                for (int64_t y = 0; y < dv; y++)
                    S[(vh * dk + x) * dv + y] = dec * S[(vh * dk + x) * dv + y] +
                                                kx * fw_load_f64(rec, REC(rd, j, vh * dv + y));
            }
}

/* One ReplaySSM decode i in double (fw_gdn_layer_replay_ref): its conv rows (a window's token
 * by token, a conv checkpoint after each), the checkpoint and committed records folded, the
 * flushed checkpoint written, then the exact recurrence over its tokens, their records
 * stored in the records' dtype. S: n_v d_k d_v doubles of scratch. */
static fw_status ref_replay(const gdn_layer_prob *L, const gdn_replay_plan *P, int64_t i, const piece_buf *B,
                            double *S)
{
    const int64_t r0 = L->qsl[i], n = L->qsl[i + 1] - r0, dim = L->dim;
    const int64_t nkq = L->nkq, nv = L->nv, dk = L->dk, dv = L->dv, gw = L->kda ? dk : 1, rr = nv / nkq;
    const int64_t Lc = P->len[i], wr = L->wr[i], base = P->flush[i] ? 0 : Lc;
    const fw_tensor *rec = &P->R->records;
    fw_status s = L->spec ? ref_window_conv(L, i, B->rows) : ref_conv(L, r0, n, L->ridx[i], L->wr[i], B->rows);
    if (s)
        return s;
    fw_tensor y2 = fw_tensor_contiguous(B->rows, L->qkv->dtype, 2, (int64_t[]){n, dim});
    fw_tensor q = gdn_rows_view(&y2, 0, n, 0, nkq, dk), k = gdn_rows_view(&y2, 0, n, nkq * dk, nkq, dk);
    fw_tensor v = gdn_rows_view(&y2, 0, n, 2 * nkq * dk, nv, dv), o = gdn_rows_view(L->out, r0, n, 0, nv, dv);
    fw_tensor tg = L->kda ? gdn_rows_view(L->a, r0, n, 0, nv, dk) : gdn_rows2(L->a, r0, n), tb = gdn_rows2(L->b, r0, n);
    gdn_prob p;
    if ((s = fw_gdn_check(&p, &q, &k, &v, &tg, &tb, NULL, 0, 0, &o, &L->gp, 1)))
        return s;
    /* the flushed checkpoint: the f32 one, then the committed records; the state the tokens
     * read: the same, from the bf16 shadow under bf16 products */
    ref_fold(L, P, i, 0, S);
    if (P->flush[i]) {
        float *cw = (float *)L->caches->recurrent + wr * L->caches->recurrent_stride;
        for (int64_t e = 0; e < nv * dk * dv; e++)
            cw[e] = (float)S[e];
    }
    if (P->shadow_reads)
        ref_fold(L, P, i, 1, S);
    if (P->flush[i])
        gdn_replay_shadow(L, P, wr);
    /* the new tokens */
    double qn[FW_MAX_HEAD_DIM], kn[FW_MAX_HEAD_DIM], u[FW_MAX_HEAD_DIM], g[FW_MAX_HEAD_DIM];
    for (int64_t t = 0; t < n; t++)
        for (int64_t hk = 0; hk < nkq; hk++) {
            double nq = 0, nk = 0;
            for (int64_t x = 0; x < dk; x++) {
                qn[x] = fw_load_f64(&q, t * q.stride[0] + hk * q.stride[1] + x * q.stride[2]);
                kn[x] = fw_load_f64(&k, t * k.stride[0] + hk * k.stride[1] + x * k.stride[2]);
                nq += qn[x] * qn[x];
                nk += kn[x] * kn[x];
            }
            const double sq = p.scale / sqrt(nq + p.eps), sk = 1.0 / sqrt(nk + p.eps);
            for (int64_t x = 0; x < dk; x++) {
                qn[x] *= sq;
                kn[x] *= sk;
                fw_store_f64(rec, REC(wr, base + t, P->koff + hk * dk + x), kn[x]);
            }
            for (int64_t vh = hk * rr; vh < (hk + 1) * rr; vh++) {
                double *Sh = S + vh * dk * dv;
                for (int64_t x = 0; x < gw; x++) {
                    g[x] = gate_g_at(&p, t, vh, x);
                    fw_store_f64(rec, REC(wr, base + t, P->goff + vh * gw + x), g[x]);
                }
                const double beta = gate_beta(&p, t, vh);
                for (int64_t y = 0; y < dv; y++) {
                    double ks = 0;
                    for (int64_t x = 0; x < dk; x++)
                        ks += kn[x] * (Sh[x * dv + y] *= exp(g[L->kda ? x : 0]));
                    u[y] = beta * (fw_load_f64(&v, t * v.stride[0] + vh * v.stride[1] + y * v.stride[2]) - ks);
                    fw_store_f64(rec, REC(wr, base + t, vh * dv + y), u[y]);
                }
                for (int64_t y = 0; y < dv; y++) {
                    double os = 0;
                    for (int64_t x = 0; x < dk; x++)
                        os += qn[x] * (Sh[x * dv + y] += kn[x] * u[y]);
                    fw_store_f64(&o, t * o.stride[0] + vh * o.stride[1] + y * o.stride[2], os);
                }
            }
        }
    return FW_OK;
}

/* Both references: the plain layer (P NULL) or ReplaySSM decodes. */
static fw_status layer_ref(gdn_layer_prob *L, const gdn_replay_plan *P)
{
    fw_status s = FW_OK;
    int64_t longest = 1;
    for (int64_t i = 0; i < L->me; i++)
        longest = fw_max64(longest, L->qsl[i + 1] - L->qsl[i]);
    const int64_t ss = L->nv * L->dk * L->dv;
    piece_buf B = {malloc((size_t)(longest * L->dim) * fw_dtype_size(L->qkv->dtype)),
                   malloc(sizeof(float) * (size_t)ss), malloc(sizeof(double) * (size_t)ss)};
    if (!B.rows || !B.state || !B.fin)
        s = fw_fail(FW_ERR_NOMEM, "cannot allocate the reference's scratch");
    for (int64_t i = 0; i < L->me && !s; i++) {
        const int64_t r0 = L->qsl[i], len = L->qsl[i + 1] - r0;
        if (P && i < L->de)
            s = ref_replay(L, P, i, &B, B.fin);
        else if (L->spec && i < L->de) { /* a window: slot wr + t holds the states after token t */
            s = ref_window_conv(L, i, B.rows);
            for (int64_t t = 0; t < len && !s; t++)
                s = ref_piece(L, r0 + t, 1, t ? L->wr[i] + (int32_t)t - 1 : L->ridx[i], L->wr[i] + (int32_t)t, 1, &B,
                              (char *)B.rows + t * L->dim * (int64_t)fw_dtype_size(L->qkv->dtype));
        } else {
            s = ref_piece(L, r0, len, L->ridx[i], L->wr[i], i < L->de, &B, NULL);
        }
        if (!s && P && i >= L->de)
            gdn_replay_shadow(L, P, L->wr[i]);
    }
    if (!s && L->zero_tail)
        fw_gdn_layer_zero_tail(L);
    free(B.rows);
    free(B.state);
    free(B.fin);
    return s;
}

fw_status fw_gdn_layer_ref(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                           const fw_tensor *conv_weight, const fw_tensor *conv_bias,
                           const fw_tensor *a_log, const fw_tensor *dt_bias, const fw_gdn_batch *batch,
                           const fw_gdn_caches *caches, const fw_tensor *out,
                           const fw_gdn_layer_params *params)
{
    return gdn_layer_call(qkv, b, a, conv_weight, conv_bias, a_log, dt_bias, batch, caches, NULL, 0, out, params, 1,
                          layer_ref);
}

fw_status fw_gdn_layer_replay_ref(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                                  const fw_tensor *conv_weight, const fw_tensor *conv_bias,
                                  const fw_tensor *a_log, const fw_tensor *dt_bias, const fw_gdn_batch *batch,
                                  const fw_gdn_caches *caches, const fw_gdn_replay *replay, const fw_tensor *out,
                                  const fw_gdn_layer_params *params)
{
    return gdn_layer_call(qkv, b, a, conv_weight, conv_bias, a_log, dt_bias, batch, caches, replay, 1, out, params, 1,
                          layer_ref);
}
