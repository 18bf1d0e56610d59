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
static fw_status ref_piece(const gdn_layer_prob *L, int64_t r0, int64_t n, int32_t rd, int32_t wr, int decode,
                           const piece_buf *B)
{
    const fw_tensor *qkv = L->qkv;
    const int64_t dim = L->dim, ss = L->nv * L->dk * L->dv;
    fw_tensor x = gdn_conv_rows(qkv, r0, n);
    fw_tensor y = fw_tensor_contiguous(B->rows, qkv->dtype, 3, (int64_t[]){1, n, dim});
    const int32_t cu[2] = {0, (int32_t)n};
    fw_conv1d_state cin = {L->caches->conv, &rd, NULL}, cfin = {L->caches->conv, &wr, NULL};
    fw_status s = fw_conv1d_ref(&x, L->w, L->bias, cu, 1, &cin, &cfin, NULL, &y, &L->cp);
    if (s)
        return s;
    fw_tensor y2 = fw_tensor_contiguous(B->rows, qkv->dtype, 2, (int64_t[]){n, dim});
    fw_tensor q = gdn_rows_view(&y2, 0, n, 0, L->nkq, L->dk);
    fw_tensor k = gdn_rows_view(&y2, 0, n, L->nkq * L->dk, L->nkq, L->dk);
    fw_tensor v = gdn_rows_view(&y2, 0, n, 2 * L->nkq * L->dk, L->nv, L->dv);
    fw_tensor o = gdn_rows_view(L->out, r0, n, 0, L->nv, L->dv);
    fw_tensor tg = L->kda ? gdn_rows_view(L->a, r0, n, 0, L->nv, L->dk) : gdn_rows2(L->a, r0, n);
    fw_tensor tb = gdn_rows2(L->b, r0, n);
    float *rec = L->caches->recurrent;
    const int64_t st = L->caches->recurrent_stride;
    if (rd >= 0)
        memcpy(B->state, rec + rd * st, sizeof(float) * (size_t)ss);
    fw_gdn_params gp = L->gp;
    gp.threads = 1;
    if (decode)
        gp.flags |= FW_GDN_RECURRENT;
    s = fw_gdn_ref(&q, &k, &v, &tg, &tb, cu, 1, rd >= 0 ? B->state : NULL, B->fin, &o, &gp);
    for (int64_t i = 0; i < ss && !s; i++)
        rec[wr * st + i] = (float)B->fin[i];
    return s;
}

fw_status fw_gdn_layer_ref(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                           const fw_tensor *conv_weight, const fw_tensor *conv_bias,
                           const fw_tensor *a_log, const fw_tensor *dt_bias, const fw_gdn_batch *batch,
                           const fw_gdn_caches *caches, const fw_tensor *out,
                           const fw_gdn_layer_params *params)
{
    fw_clear_error();
    gdn_layer_prob L;
    fw_status s = fw_gdn_layer_check(&L, qkv, b, a, conv_weight, conv_bias, a_log, dt_bias, batch, caches, out,
                                     params, 1);
    if (s)
        return s;
    int64_t longest = 1;
    for (int64_t i = 0; i < L.me; i++)
        longest = fw_max64(longest, L.qsl[i + 1] - L.qsl[i]);
    const int64_t ss = L.nv * L.dk * L.dv;
    piece_buf B = {malloc((size_t)(longest * L.dim) * fw_dtype_size(qkv->dtype)),
                   malloc(sizeof(float) * (size_t)ss), malloc(sizeof(double) * (size_t)ss)};
    if (!B.rows || !B.state || !B.fin)
        s = fw_fail(FW_ERR_NOMEM, "cannot allocate the reference's scratch");
    for (int64_t i = 0; i < L.me && !s; i++) {
        const int64_t r0 = L.qsl[i], len = L.qsl[i + 1] - r0;
        if (L.spec && i < L.de) /* a window: slot wr + t holds the states after token t */
            for (int64_t t = 0; t < len && !s; t++)
                s = ref_piece(&L, r0 + t, 1, t ? L.wr[i] + (int32_t)t - 1 : L.ridx[i], L.wr[i] + (int32_t)t, 1, &B);
        else
            s = ref_piece(&L, r0, len, L.ridx[i], L.wr[i], i < L.de, &B);
    }
    if (!s && L.zero_tail)
        fw_gdn_layer_zero_tail(&L);
    free(B.rows);
    free(B.state);
    free(B.fin);
    free((void *)L.ridx);
    return s;
}
