/* gdn/check.c: Gated DeltaNet's validation: params, the token tensors and cu_seqlens into
 * one gdn_prob (gdn.h), and the state slots of decode and verify. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include "gdn.h"

void fw_gdn_params_init(fw_gdn_params *p)
{
    if (p)
        memset(p, 0, sizeof *p);
}

static fw_status check_gates(const gdn_prob *p, int threads);

fw_status fw_gdn_check(gdn_prob *p, const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                       const fw_tensor *g, const fw_tensor *beta, const int32_t *cu, int64_t n,
                       int need_cu, const fw_tensor *out, const fw_gdn_params *params, int ref)
{
    memset(p, 0, sizeof *p);
    fw_status s;
    const int raw_g = params && params->a_log, raw_b = params && params->beta_sigmoid;
    if ((s = fw_check_tensor(q, "q", 3, FW_DT_IN)) || (s = fw_check_tensor(k, "k", 3, FW_DT_IN)) ||
        (s = fw_check_tensor(v, "v", 3, FW_DT_IN)) ||
        (s = fw_check_tensor(g, raw_g ? "g (the raw a)" : "g", g && g->ndim == 3 ? 3 : 2,
                             raw_g ? FW_DT_IN : 1u << FW_F32)) ||
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
    const int kda = g->ndim == 3;
    if (kda && g->shape[2] != dk)
        return fw_fail(FW_ERR_SHAPE, "g is [T, HV, %lld]: KDA's per-channel decays must be [T, HV, dk] with dk = %lld",
                       (long long)g->shape[2], (long long)dk);
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
        if (params->a_log && params->a_log->shape[0] != HV)
            return fw_fail(FW_ERR_SHAPE, "a_log must have HV = %lld entries", (long long)HV);
        if (params->a_log && params->dt_bias && params->dt_bias->shape[0] != HV &&
            !(kda && params->dt_bias->shape[0] == HV * dk))
            return fw_fail(FW_ERR_SHAPE, "dt_bias must have HV = %lld entries%s", (long long)HV,
                           kda ? " or, for KDA, HV x dk" : "");
        if (!params->a_log && params->dt_bias)
            return fw_fail(FW_ERR_ARG, "dt_bias without a_log: the gates are computed from a_log");
        if (!(params->lower_bound <= 0.0f) || !isfinite(params->lower_bound))
            return fw_fail(FW_ERR_ARG, "lower_bound is %g; it must be finite and < 0 (0: the softplus gate)",
                           (double)params->lower_bound);
        if (!params->a_log && params->lower_bound != 0.0f)
            return fw_fail(FW_ERR_ARG, "lower_bound without a_log: it bounds the gates computed from a_log");
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
    p->bf16 = fw_bf16_products(params ? params->isa : NULL, q->dtype, params ? params->precision : FW_PREC_AUTO);
    p->a_log = raw_g ? params->a_log : NULL;
    p->dt_bias = raw_g ? params->dt_bias : NULL;
    p->beta_sigmoid = raw_b;
    p->lower_bound = raw_g ? params->lower_bound : 0.0f;
    p->kda = kda;
    return check_gates(p, fw_threads(params ? params->threads : 0));
}

/* Row (t, j) of a gate tensor x, n elements along its last dim (stride s, or one element), as
 * float. */
static void gate_row(const fw_tensor *x, int64_t t, int64_t j, int64_t n, float *dst)
{
    const int64_t base = t * x->stride[0] + j * x->stride[1], s = x->ndim == 3 ? x->stride[2] : 0;
    if (x->dtype == FW_F32) {
        const float *r = (const float *)x->data + base;
        for (int64_t a = 0; a < n; a++)
            dst[a] = r[a * s];
    } else {
        for (int64_t a = 0; a < n; a++)
            dst[a] = (float)fw_load_f64(x, base + a * s);
    }
}

/* Every log decay finite and <= 0, every beta finite, as the kernels will compute them
 * (gdn.h, gate_g_at), without their exponentials: a given g is compared; from the raw a, with
 * y = a + dt_bias and u = exp(a_log) y in float as there, the softplus gate -exp(a_log)
 * softplus(y) is finite (and <= 0) exactly when y is not NaN and, where softplus(y) = y (y >
 * 20), u is finite; the sigmoid gate lower_bound sigmoid(u) exactly when u is not NaN;
 * exp(a_log) itself must be finite. The message gives the first bad gate's value. Measured
 * (KDA's g [4096, 32, 128] f32, 64 MiB): the scan took 3.7% of a one-thread prefill, one
 * thread's work before the call's threads start; it now runs on them. */
#define GATE_ROWS 256 /* tokens per item of the scan */

typedef struct {
    const gdn_prob *p;
    const float *ea, *bias; /* exp(a_log) per head and dt_bias per gate, with a_log */
    int64_t *first;         /* per item: its first bad row t HV + j, or -1 */
} gate_scan;

/* Whether row (t, j)'s n gates (row, or the raw a) give a bad log decay: a flag per row
 * (branch-free, vectorised), the channel found only on failure. */
static int gate_row_bad(const gate_scan *sc, int64_t j, const float *row, int64_t n)
{
    const gdn_prob *p = sc->p;
    int any = 0;
    if (!p->a_log) {
        for (int64_t a = 0; a < n; a++)
            any |= !(row[a] <= 0.0f) | (row[a] == -INFINITY);
    } else {
        for (int64_t a = 0; a < n; a++) {
            const float y = row[a] + sc->bias[j * n + a], u = sc->ea[j] * y;
            any |= p->lower_bound < 0.0f ? u != u : (y != y) | ((y > 20.0f) & !(fabsf(u) <= FLT_MAX));
        }
    }
    return any;
}

static void gate_scan_item(void *ctx, int64_t idx, int tid)
{
    (void)tid;
    const gate_scan *sc = ctx;
    const gdn_prob *p = sc->p;
    const int64_t n = p->kda ? p->dk : 1, t1 = fw_min64(p->T, (idx + 1) * GATE_ROWS);
    const int direct = p->g->dtype == FW_F32 && (p->g->ndim == 2 || p->g->stride[2] == 1);
    float row[FW_MAX_HEAD_DIM];
    sc->first[idx] = -1;
    for (int64_t t = idx * GATE_ROWS; t < t1; t++)
        for (int64_t j = 0; j < p->HV; j++) {
            const float *r = row;
            if (direct)
                r = (const float *)p->g->data + t * p->g->stride[0] + j * p->g->stride[1];
            else
                gate_row(p->g, t, j, n, row);
            if (gate_row_bad(sc, j, r, n)) {
                sc->first[idx] = t * p->HV + j;
                return;
            }
        }
}

static fw_status check_gates(const gdn_prob *p, int threads)
{
    const int64_t n = p->kda ? p->dk : 1;
    float *ea = NULL, *bias = NULL;
    if (p->a_log) {
        ea = malloc(sizeof(float) * (size_t)(p->HV * (n + 1)));
        if (!ea)
            return fw_fail(FW_ERR_NOMEM, "cannot allocate %lld gate parameters", (long long)(p->HV * (n + 1)));
        bias = ea + p->HV;
        for (int64_t j = 0; j < p->HV; j++) {
            const double al = fw_load_f64(p->a_log, j * p->a_log->stride[0]);
            ea[j] = expf((float)al);
            if (!isfinite(ea[j])) {
                free(ea);
                return fw_fail(FW_ERR_ARG, "a_log[%lld] = %g: exp(a_log) must be finite", (long long)j, al);
            }
            for (int64_t a = 0; a < n; a++) {
                const int64_t bi = p->dt_bias && p->dt_bias->shape[0] != p->HV ? j * p->dk + a : j;
                bias[j * n + a] = p->dt_bias ? (float)fw_load_f64(p->dt_bias, bi * p->dt_bias->stride[0]) : 0.0f;
            }
        }
    }
    /* the rows in items of GATE_ROWS tokens on the call's threads, each item's first bad row
     * (t HV + j, or -1), the first of them reported */
    const int64_t items = (p->T + GATE_ROWS - 1) / GATE_ROWS;
    int64_t first1, *first = items > 1 ? malloc(sizeof(int64_t) * (size_t)items) : &first1;
    if (!first) {
        free(ea);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate %lld gate flags", (long long)items);
    }
    gate_scan sc = {p, ea, bias, first};
    fw_parallel(threads, items, gate_scan_item, &sc);
    int64_t badrow = -1;
    for (int64_t i = 0; i < items && badrow < 0; i++)
        badrow = first[i];
    if (first != &first1)
        free(first);
    if (badrow >= 0) {
        const int64_t t = badrow / p->HV, j = badrow % p->HV;
        int64_t bad = 0;
        while (bad < n - 1 && gate_g_at(p, t, j, bad) <= 0.0f && gate_g_at(p, t, j, bad) != -INFINITY)
            bad++;
        free(ea);
        char ch[32] = "";
        if (p->kda)
            snprintf(ch, sizeof ch, "[%lld]", (long long)bad);
        return fw_fail(FW_ERR_ARG, "g[%lld][%lld]%s = %g%s: the log decay must be finite and <= 0", (long long)t,
                       (long long)j, ch, (double)gate_g_at(p, t, j, bad), p->a_log ? " (computed from a)" : "");
    }
    free(ea);
    for (int64_t t = 0; t < p->T; t++)
        for (int64_t j = 0; j < p->HV; j++) {
            const float bv = gate_beta(p, t, j);
            if (!isfinite(bv))
                return fw_fail(FW_ERR_ARG, "beta[%lld][%lld] = %g%s is not finite", (long long)t, (long long)j,
                               (double)bv, p->beta_sigmoid ? " (computed from b)" : "");
        }
    return FW_OK;
}

fw_status fw_gdn_check_gates(const fw_tensor *g, const fw_tensor *beta, int64_t HV, int64_t dk,
                             const fw_gdn_params *params)
{
    gdn_prob p;
    memset(&p, 0, sizeof p);
    p.g = g;
    p.beta = beta;
    p.T = g->shape[0];
    p.HV = HV;
    p.dk = dk;
    p.kda = g->ndim == 3;
    p.a_log = params->a_log;
    p.dt_bias = params->a_log ? params->dt_bias : NULL;
    p.lower_bound = params->a_log ? params->lower_bound : 0.0f;
    p.beta_sigmoid = params->beta_sigmoid;
    return check_gates(&p, fw_threads(params ? params->threads : 0));
}

typedef struct {
    int64_t slot, seq;
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

fw_status gdn_check_window_slots(int64_t n, int64_t de, const int32_t *qsl, const int32_t *rd, const int32_t *wr,
                                    int64_t slots)
{
    const int64_t total = (n > 0 ? (int64_t)qsl[de] - qsl[0] : 0) + (n - de);
    slot_seq *w = malloc(sizeof *w * (size_t)(total > 0 ? total : 1));
    if (!w)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate %lld slot entries to check", (long long)total);
    int64_t m = 0;
    fw_status st = FW_OK;
    for (int64_t i = 0; i < n && !st; i++) {
        const int64_t cnt = i < de ? qsl[i + 1] - qsl[i] : 1;
        if (rd[i] >= slots)
            st = fw_fail(FW_ERR_INDEX, "sequence %lld reads slot %lld (read_state_indices + read_offsets); the "
                         "caches have %lld", (long long)i, (long long)rd[i], (long long)slots);
        else if (wr[i] + cnt > slots)
            st = fw_fail(FW_ERR_INDEX, "sequence %lld writes slots %d..%lld; the caches have %lld", (long long)i,
                         (int)wr[i], (long long)(wr[i] + cnt - 1), (long long)slots);
        for (int64_t t = 0; t < cnt && !st; t++)
            w[m++] = (slot_seq){wr[i] + t, i};
    }
    if (!st)
        qsort(w, (size_t)m, sizeof *w, cmp_slot_seq);
    for (int64_t j = 1; j < m && !st; j++)
        if (w[j].slot == w[j - 1].slot)
            st = fw_fail(FW_ERR_INDEX, "sequences %lld and %lld both write slot %lld", (long long)w[j - 1].seq,
                         (long long)w[j].seq, (long long)w[j].slot);
    for (int64_t i = 0; i < n && !st; i++) {
        if (rd[i] < 0)
            continue;
        int64_t lo = 0, hi = m;
        while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if (w[mid].slot < rd[i])
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo < m && w[lo].slot == rd[i] && w[lo].seq != i)
            st = fw_fail(FW_ERR_INDEX, "sequence %lld reads slot %d, which sequence %lld writes in the same call",
                         (long long)i, (int)rd[i], (long long)w[lo].seq);
    }
    free(w);
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
    if (pool->dtype != FW_F32 && pool->dtype != FW_BF16)
        return fw_fail(FW_ERR_DTYPE, "pool dtype is %d; the states are f32 (FW_F32) or bf16 (FW_BF16)", (int)pool->dtype);
    if (pool->slots < 0)
        return fw_fail(FW_ERR_ARG, "pool has %lld slots; it must be >= 0", (long long)pool->slots);
    if (pool->slots > 1 && pool->slot_stride < state)
        return fw_fail(FW_ERR_STRIDE, "pool slot_stride is %lld elements; a state is HV x dk x dv = %lld",
                       (long long)pool->slot_stride, (long long)state);
    int64_t extent;
    if (pool->slots > 0 && (__builtin_mul_overflow(pool->slots - 1, pool->slot_stride, &extent) ||
                            __builtin_add_overflow(extent, state, &extent) ||
                            __builtin_mul_overflow(extent, (int64_t)fw_dtype_size(pool->dtype), &extent)))
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
