/* ref/conv_ref.c: the float64 reference of the causal conv1d (fw_conv1d_ref): every output
 * and final state entry straight from its definition, one sequence at a time, the final
 * states after every output (as the kernel orders them). */
#include <math.h>
#include <stdlib.h>
#include "../conv/conv.h"

/* Logical entry e of sequence i's state, channel c, in double (0 for none). */
static double state_at(const fw_conv1d_state *st, int64_t S, int64_t i, int64_t e, int64_t c)
{
    const int64_t slot = st ? conv_slot(st, i) : -1;
    if (slot < 0 || e < 0)
        return 0.0;
    const fw_tensor *t = &st->cache;
    return fw_load_f64(t, slot * t->stride[0] + conv_row(st, S, i, e) * t->stride[1] + c * t->stride[2]);
}

/* Input u of sequence i (u < 0: its initial state's entry Si + u), channel c. */
static double input_at(const conv_prob *p, int64_t i, int64_t b, int64_t t0, int64_t u, int64_t c)
{
    return u >= 0 ? fw_load_f64(p->x, conv_off(p->x, b, t0 + u, c)) : state_at(p->init, p->Si, i, p->Si + u, c);
}

fw_status fw_conv1d_ref(const fw_tensor *x, const fw_tensor *weight, const fw_tensor *bias,
                        const int32_t *cu_seqlens, int64_t n_seqs,
                        const fw_conv1d_state *init, const fw_conv1d_state *final,
                        const fw_tensor *residual, const fw_tensor *out,
                        const fw_conv1d_params *params)
{
    fw_clear_error();
    conv_prob p;
    fw_status s = fw_conv_check(&p, x, weight, bias, cu_seqlens, n_seqs, init, final, residual, out, params, 1);
    if (s)
        return s;
    for (int64_t i = 0; i < p.n; i++) {
        int64_t b, t0, len;
        conv_seq(&p, i, &b, &t0, &len);
        for (int64_t u = 0; u < len; u++)
            for (int64_t c = 0; c < p.D; c++) {
                double y = p.b ? fw_load_f64(p.b, c * p.b->stride[0]) : 0.0;
                for (int64_t k = 0; k < p.W; k++)
                    y += fw_load_f64(p.w, c * p.w->stride[0] + k * p.w->stride[1]) *
                         input_at(&p, i, b, t0, u - (p.W - 1) + k, c);
                if (p.silu)
                    y = y / (1.0 + exp(-y));
                if (p.res)
                    y += fw_load_f64(p.res, conv_off(p.res, b, t0 + u, c));
                fw_store_f64(out, conv_off(out, b, t0 + u, c), y);
            }
    }
    if (!final)
        return FW_OK;
    /* every sequence's final entries are read before any is written: in place, a sequence's
     * slot is read by no other sequence (checked), so per sequence suffices */
    double *buf = malloc(sizeof(double) * (size_t)(p.So * p.D > 0 ? p.So * p.D : 1));
    if (!buf)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the reference state");
    for (int64_t i = 0; i < p.n; i++) {
        const int64_t slot = conv_slot(final, i);
        if (slot < 0)
            continue;
        int64_t b, t0, len;
        conv_seq(&p, i, &b, &t0, &len);
        for (int64_t e = 0; e < p.So; e++)
            for (int64_t c = 0; c < p.D; c++)
                buf[e * p.D + c] = input_at(&p, i, b, t0, len - p.So + e, c);
        const fw_tensor *t = &final->cache;
        for (int64_t e = 0; e < p.So; e++)
            for (int64_t c = 0; c < p.D; c++)
                fw_store_f64(t, slot * t->stride[0] + conv_row(final, p.So, i, e) * t->stride[1] + c * t->stride[2],
                             buf[e * p.D + c]);
    }
    free(buf);
    return FW_OK;
}
