/* gdn/check.c: Gated DeltaNet's validation: params, the token tensors and cu_seqlens into
 * one gdn_prob (gdn.h), and the state slots of decode and verify. */
#include <math.h>
#include <string.h>
#include <stdlib.h>
#include "gdn.h"

void fw_gdn_params_init(fw_gdn_params *p)
{
    if (p)
        memset(p, 0, sizeof *p);
}

fw_status fw_gdn_check(gdn_prob *p, const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                       const fw_tensor *g, const fw_tensor *beta, const int32_t *cu, int64_t n,
                       int need_cu, const fw_tensor *out, const fw_gdn_params *params, int ref)
{
    memset(p, 0, sizeof *p);
    fw_status s;
    const int raw_g = params && params->a_log, raw_b = params && params->beta_sigmoid;
    if ((s = fw_check_tensor(q, "q", 3, FW_DT_IN)) || (s = fw_check_tensor(k, "k", 3, FW_DT_IN)) ||
        (s = fw_check_tensor(v, "v", 3, FW_DT_IN)) ||
        (s = fw_check_tensor(g, raw_g ? "g (the raw a)" : "g", 2, raw_g ? FW_DT_IN : 1u << FW_F32)) ||
        (s = fw_check_tensor(beta, raw_b ? "beta (the raw b)" : "beta", 2, raw_b ? FW_DT_IN : 1u << FW_F32)) ||
        (s = fw_check_tensor(out, "out", 3, FW_DT_IN | (ref ? 1u << FW_F64 : 0u))))
        return s;
    if (k->dtype != q->dtype || v->dtype != q->dtype)
        return fw_fail(FW_ERR_DTYPE, "q, k and v must share a dtype: q is %s, k is %s, v is %s",
                       fw_dtype_name(q->dtype), fw_dtype_name(k->dtype), fw_dtype_name(v->dtype));
    const int64_t T = q->shape[0], H = q->shape[1], dk = q->shape[2], HV = v->shape[1], dv = v->shape[2];
    if (k->shape[0] != T || k->shape[1] != H || k->shape[2] != dk)
        return fw_fail(FW_ERR_SHAPE, "k must be [T, H, dk] = [%lld, %lld, %lld] like q", (long long)T,
                       (long long)H, (long long)dk);
    if (v->shape[0] != T || g->shape[0] != T || beta->shape[0] != T || out->shape[0] != T)
        return fw_fail(FW_ERR_SHAPE, "q, k, v, g, beta and out must have the same %lld tokens", (long long)T);
    if (H < 1 || HV < 1 || HV % H)
        return fw_fail(FW_ERR_SHAPE, "v has %lld heads, which is not a multiple of q/k's %lld heads",
                       (long long)HV, (long long)H);
    if (g->shape[1] != HV || beta->shape[1] != HV || out->shape[1] != HV || out->shape[2] != dv)
        return fw_fail(FW_ERR_SHAPE, "g and beta must be [T, HV] and out [T, HV, dv] with HV = %lld, dv = %lld",
                       (long long)HV, (long long)dv);
    if (dk < 1 || dk > FW_MAX_HEAD_DIM || dv < 1 || dv > FW_MAX_HEAD_DIM || HV > FW_MAX_HEADS)
        return fw_fail(FW_ERR_SHAPE, "head dims must be 1..%d (dk %lld, dv %lld) and HV at most %d",
                       FW_MAX_HEAD_DIM, (long long)dk, (long long)dv, FW_MAX_HEADS);
    if ((s = fw_check_no_alias(out, "out")))
        return s;
    if (params) {
        if (!isfinite(params->scale))
            return fw_fail(FW_ERR_ARG, "scale is %g; it must be finite (0 means 1/sqrt(dk))", (double)params->scale);
        if ((s = fw_check_threads(params->threads)))
            return s;
        if (params->l2norm_qk != 0 && params->l2norm_qk != 1)
            return fw_fail(FW_ERR_ARG, "l2norm_qk is %d; it must be 0 or 1", (int)params->l2norm_qk);
        if (params->beta_sigmoid != 0 && params->beta_sigmoid != 1)
            return fw_fail(FW_ERR_ARG, "beta_sigmoid is %d; it must be 0 or 1", (int)params->beta_sigmoid);
        if (params->a_log && ((s = fw_check_tensor(params->a_log, "a_log", 1, FW_DT_IN)) ||
                              (params->dt_bias && (s = fw_check_tensor(params->dt_bias, "dt_bias", 1, FW_DT_IN)))))
            return s;
        if (params->a_log && (params->a_log->shape[0] != HV || (params->dt_bias && params->dt_bias->shape[0] != HV)))
            return fw_fail(FW_ERR_SHAPE, "a_log and dt_bias must have HV = %lld entries", (long long)HV);
        if (!params->a_log && params->dt_bias)
            return fw_fail(FW_ERR_ARG, "dt_bias without a_log: the gates are computed from a_log");
        if (!(params->l2norm_eps >= 0.0f) || !isfinite(params->l2norm_eps))
            return fw_fail(FW_ERR_ARG, "l2norm_eps is %g; it must be finite and >= 0 (0 means 1e-6)",
                           (double)params->l2norm_eps);
        if (params->flags & ~(uint32_t)(FW_GDN_FWD_SUBST | FW_GDN_RECURRENT | FW_GDN_FUSED_RECURRENT))
            return fw_fail(FW_ERR_ARG, "flags 0x%x has unknown bits", (unsigned)params->flags);
        if (params->precision < FW_PREC_AUTO || params->precision > FW_PREC_BF16)
            return fw_fail(FW_ERR_ARG, "precision is %d; it must be FW_PREC_AUTO (0), FW_PREC_F32 (1) "
                           "or FW_PREC_BF16 (2)", (int)params->precision);
    }
    if (need_cu) {
        if (n < 0 || n > INT32_MAX)
            return fw_fail(FW_ERR_ARG, "n_seqs is %lld; it must be 0..2^31-1", (long long)n);
        if ((s = fw_check_cu_seqlens(cu, n, T, "cu_seqlens")))
            return s;
    }
    p->q = q; p->k = k; p->v = v; p->g = g; p->beta = beta; p->out = out;
    p->cu = cu; p->n = n; p->T = T; p->H = H; p->HV = HV; p->r = HV / H; p->dk = dk; p->dv = dv;
    p->scale = params && params->scale != 0.0f ? (double)params->scale : 1.0 / sqrt((double)dk);
    p->l2 = params ? params->l2norm_qk : 0;
    p->eps = params && params->l2norm_eps > 0.0f ? (double)params->l2norm_eps : 1e-6;
    p->bf16 = fw_attn_bf16_products(q->dtype, params ? params->precision : FW_PREC_AUTO);
    p->a_log = raw_g ? params->a_log : NULL;
    p->dt_bias = raw_g ? params->dt_bias : NULL;
    p->beta_sigmoid = raw_b;
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < HV; j++) {
            const float gv = gate_g(p, t, j), bv = gate_beta(p, t, j);
            if (!(gv <= 0.0f) || gv == -INFINITY)
                return fw_fail(FW_ERR_ARG, "g[%lld][%lld] = %g%s: the log decay must be finite and <= 0",
                               (long long)t, (long long)j, (double)gv, p->a_log ? " (computed from a)" : "");
            if (!isfinite(bv))
                return fw_fail(FW_ERR_ARG, "beta[%lld][%lld] = %g%s is not finite", (long long)t, (long long)j,
                               (double)bv, p->beta_sigmoid ? " (computed from b)" : "");
        }
    return FW_OK;

}

typedef struct {
    int32_t slot;
    int64_t seq;
} slot_seq;

static int cmp_slot_seq(const void *x, const void *y)
{
    const slot_seq *a = x, *b = y;
    if (a->slot != b->slot)
        return a->slot < b->slot ? -1 : 1;
    return a->seq < b->seq ? -1 : a->seq > b->seq;
}

fw_status fw_gdn_check_slots(const int32_t *idx, int64_t n, int64_t slots, const float *state)
{
    if (!state)
        return fw_fail(FW_ERR_NULL, "state is NULL");
    if (n > 0 && !idx)
        return fw_fail(FW_ERR_NULL, "state_indices is NULL");
    if (slots < 0)
        return fw_fail(FW_ERR_ARG, "slots is %lld; it must be >= 0", (long long)slots);
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= slots)
            return fw_fail(FW_ERR_INDEX, "state_indices[%lld] = %d is not a slot (0..%lld)", (long long)i,
                           (int)idx[i], (long long)slots - 1);
    /* distinct slots: each sequence owns its state (two items on one slot would race). All
     * pairs for a small batch; else (slot, sequence) pairs sorted, which finds the same first
     * duplicate slot. */
    if (n <= 64) {
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = i + 1; j < n; j++)
                if (idx[i] == idx[j])
                    return fw_fail(FW_ERR_INDEX, "sequences %lld and %lld share state slot %d", (long long)i,
                                   (long long)j, (int)idx[i]);
        return FW_OK;
    }
    slot_seq *sorted = malloc(sizeof *sorted * (size_t)n);
    if (!sorted)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate %lld slot entries to check for duplicates", (long long)n);
    for (int64_t i = 0; i < n; i++) {
        sorted[i].slot = idx[i];
        sorted[i].seq = i;
    }
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_slot_seq);
    fw_status st = FW_OK;
    for (int64_t i = 1; i < n && !st; i++)
        if (sorted[i].slot == sorted[i - 1].slot)
            st = fw_fail(FW_ERR_INDEX, "sequences %lld and %lld share state slot %d", (long long)sorted[i - 1].seq,
                         (long long)sorted[i].seq, (int)sorted[i].slot);
    free(sorted);
    return st;
}

/* The slot a pool gives sequence i to read from, or to write to (negative: none). */
static int64_t pool_write(const fw_gdn_pool *pool, int64_t i)
{
    return pool->write ? pool->write[i] : pool->read ? pool->read[i] : -1;
}

fw_status fw_gdn_check_pool(const fw_gdn_pool *pool, int64_t n, int64_t HV, int64_t dk, int64_t dv)
{
    if (!pool)
        return fw_fail(FW_ERR_NULL, "pool is NULL");
    const int64_t state = HV * dk * dv;
    if (pool->slots < 0)
        return fw_fail(FW_ERR_ARG, "pool has %lld slots; it must be >= 0", (long long)pool->slots);
    if (pool->slots > 1 && pool->slot_stride < state)
        return fw_fail(FW_ERR_STRIDE, "pool slot_stride is %lld floats; a state is HV x dk x dv = %lld",
                       (long long)pool->slot_stride, (long long)state);
    int64_t extent;
    if (pool->slots > 0 && (__builtin_mul_overflow(pool->slots - 1, pool->slot_stride, &extent) ||
                            __builtin_add_overflow(extent, state, &extent) ||
                            __builtin_mul_overflow(extent, (int64_t)sizeof(float), &extent)))
        return fw_fail(FW_ERR_OVERFLOW, "pool: %lld slots of stride %lld overflow int64 bytes",
                       (long long)pool->slots, (long long)pool->slot_stride);
    if (pool->slots > 0 && !pool->data)
        return fw_fail(FW_ERR_NULL, "pool has %lld slots but NULL data", (long long)pool->slots);
    if (n > 0 && !pool->write && !pool->read)
        return fw_fail(FW_ERR_NULL, "pool has neither read nor write indices: nothing to read or write");
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = pool->read ? pool->read[i] : -1, w = pool_write(pool, i);
        if (r >= pool->slots || w >= pool->slots)
            return fw_fail(FW_ERR_INDEX, "sequence %lld: %s slot %lld is past the pool's %lld slots", (long long)i,
                           r >= pool->slots ? "read" : "write", (long long)(r >= pool->slots ? r : w),
                           (long long)pool->slots);
    }
    return fw_check_slot_rw(n, pool->read, 0, pool->write ? pool->write : pool->read, 0, 1, "state");
}
