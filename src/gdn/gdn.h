/* gdn/gdn.h: what the Gated DeltaNet drivers (src/gdn/) and the float64 reference
 * (ref/gdn_ref.c) share: the validated problem, its checks, and token/state addressing. */
#ifndef FW_GDN_H
#define FW_GDN_H

#include "../attn/attn.h" /* FW_LOG2E, fw_attn_bf16_products */

#define GDN_C 64 /* chunk length */

typedef struct {
    const fw_tensor *q, *k, *v, *g, *beta, *out;
    const int32_t *cu;
    int64_t n, T, H, HV, r, dk, dv;
    double scale;
    double eps; /* inside the l2 norm's sqrt */
    const fw_tensor *a_log, *dt_bias; /* a_log: g is the raw a (fw_gdn_params) */
    int beta_sigmoid;                 /* beta is the raw b */
    int l2;
    int bf16; /* bf16 products (params->precision resolved; the chunked passes only) */
} gdn_prob;

/* Validates the token tensors ([T, H, dk], [T, HV, dv], [T, HV]) and, when need_cu is set,
 * n and the sequence boundaries cu. `ref` admits an f64 out. Also checks g <= 0 (the
 * safe-exponential contract) and that beta is finite. Nothing is written. */
fw_status fw_gdn_check(gdn_prob *p, const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                       const fw_tensor *g, const fw_tensor *beta, const int32_t *cu, int64_t n,
                       int need_cu, const fw_tensor *out, const fw_gdn_params *params, int ref);
/* A pool (fw_gdn_pool) for n sequences of HV x dk x dv states: every index a slot or
 * negative, the stride and extent representable, writes distinct, no cross read/write. */
fw_status fw_gdn_check_pool(const fw_gdn_pool *pool, int64_t n, int64_t HV, int64_t dk, int64_t dv);

/* A slot array and the slots of n sequences: state non-NULL, idx non-NULL when n > 0,
 * slots >= 0, every index in [0, slots), and no two sequences on one slot (among any 4096
 * consecutive sequences). */
fw_status fw_gdn_check_slots(const int32_t *idx, int64_t n, int64_t slots, const float *state);

static inline const char *at(const fw_tensor *t, int64_t i, int64_t j)
{
    return fw_elem(t, i * t->stride[0] + j * t->stride[1]);
}

static inline float scalar_at(const fw_tensor *t, int64_t i, int64_t j)
{
    return (float)fw_load_f64(t, i * t->stride[0] + j * t->stride[1]);
}

/* The log decay g and beta of token t, value head vh: given, or computed from the raw a and
 * b (in float, the same here and in the reference). */
static inline float gate_g(const gdn_prob *p, int64_t t, int64_t vh)
{
    const float x = scalar_at(p->g, t, vh);
    if (!p->a_log)
        return x;
    const float y = x + (p->dt_bias ? (float)fw_load_f64(p->dt_bias, vh * p->dt_bias->stride[0]) : 0.0f);
    const float sp = y > 20.0f ? y : log1pf(expf(y));
    return -expf((float)fw_load_f64(p->a_log, vh * p->a_log->stride[0])) * sp;
}

static inline float gate_beta(const gdn_prob *p, int64_t t, int64_t vh)
{
    const float b = scalar_at(p->beta, t, vh);
    return p->beta_sigmoid ? 1.0f / (1.0f + expf(-b)) : b;
}

/* q^ (scaled) or k^ of token t, head h, as f32: l2-normalised when asked (p->eps inside the
 * sqrt), by the same table kernel as the chunked path. */
static inline void load_qk(const fw_kernels *kt, const gdn_prob *p, const fw_tensor *x, int64_t t,
                           int64_t h, double scale, float *dst)
{
    kt->to_f32(at(x, t, h), x->dtype, x->stride[2], p->dk, 1.0f, dst);
    kt->rows_l2scale(dst, 1, (int)p->dk, (float)scale, p->l2, (float)p->eps);
}

/* State rows [dk][dv] of (sequence or slot) i, value head vh, in a [*, HV, dk, dv] array. */
static inline size_t state_off(const gdn_prob *p, int64_t i, int64_t vh)
{
    return ((size_t)i * p->HV + vh) * (size_t)(p->dk * p->dv);
}

#endif /* FW_GDN_H */
