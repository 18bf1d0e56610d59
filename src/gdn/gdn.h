/* gdn/gdn.h: what the Gated DeltaNet drivers (src/gdn/) and the float64 reference
 * (ref/gdn_ref.c) share: the validated problem, its checks, and token/state addressing. */
#ifndef FW_GDN_H
#define FW_GDN_H

#include "../attn/attn.h" /* FW_LOG2E, fw_bf16_products */

#define GDN_C 64 /* chunk length */

typedef struct {
    const fw_tensor *q, *k, *v, *g, *beta, *out;
    const int32_t *cu;
    int64_t n, T, H, HV, r, dk, dv;
    double scale;
    double eps; /* inside the l2 norm's sqrt */
    const fw_tensor *a_log, *dt_bias; /* a_log: g is the raw a (fw_gdn_params) */
    int beta_sigmoid;                 /* beta is the raw b */
    float lower_bound;                /* < 0: the sigmoid gate (fw_gdn_params) */
    int kda;                          /* g is [T, HV, dk]: one decay per key channel */
    int l2;
    int bf16; /* bf16 products (params->precision resolved; the chunked passes only) */
} gdn_prob;

/* q/k heads per chunked work item (chunk.c's chunked_item): the largest power of two up to
 * FW_GDN_GROUP_MAX whose r value heads' states (the workspace's h and Delta panels) fit in
 * FW_GDN_GROUP_BYTES (a Zen 5 core's L2) and that leaves at least 2 items per thread
 * (n_seqs * ceil(H / group)). The group changes the order of the work, never its roundings.
 * Measured (bf16 products, T = 4K, medians of alternating runs): one thread, KDA's 32 heads
 * 21.3K tok/s ungrouped, 21.6K / 22.1K / 22.8K in groups of 2 / 4 / 8; Qwen3-Next's GDN
 * 33.2K -> 38.2K in groups of 4. */
#define FW_GDN_GROUP_MAX 8
#define FW_GDN_GROUP_BYTES ((int64_t)1024 << 10)
int fw_gdn_head_group(int64_t H, int64_t r, int64_t dk, int64_t dv, int64_t n_seqs, int threads);

/* Validates the token tensors ([T, H, dk], [T, HV, dv], [T, HV]) and, when need_cu is set,
 * n and the sequence boundaries cu. `ref` admits an f64 out. Also checks g <= 0 (the
 * safe-exponential contract) and that beta is finite. Nothing is written. */
fw_status fw_gdn_check(gdn_prob *p, const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                       const fw_tensor *g, const fw_tensor *beta, const int32_t *cu, int64_t n,
                       int need_cu, const fw_tensor *out, const fw_gdn_params *params, int ref);
/* The gates alone, as fw_gdn_check checks them: g [T, HV] or [T, HV, dk] (KDA) and beta
 * [T, HV], given or raw (params' a_log, dt_bias, lower_bound, beta_sigmoid, already checked
 * for shape). The layer checks a whole step's gates before its first window. */
fw_status fw_gdn_check_gates(const fw_tensor *g, const fw_tensor *beta, int64_t HV, int64_t dk,
                             const fw_gdn_params *params);

/* fw_gdn_prefill_pool with sequence i's initial state read from pool `from` (slot
 * from->read[i]) and its final state written to pool `to` (slot to->write[i], or
 * to->read[i]): each with its own dtype, as the layer's pieces of a long sequence carry an f32
 * state between the slots of a bf16 cache. Both pools already checked by the caller. */
fw_status fw_gdn_prefill_pools(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                               const fw_tensor *beta, const int32_t *cu_seqlens, int64_t n_seqs,
                               const fw_gdn_pool *from, const fw_gdn_pool *to, const fw_tensor *out,
                               const fw_gdn_params *params);

/* A pool (fw_gdn_pool) for n sequences of HV x dk x dv states: every index a slot or
 * negative, the stride and extent representable, writes distinct, no cross read/write. */
fw_status fw_gdn_check_pool(const fw_gdn_pool *pool, int64_t n, int64_t HV, int64_t dk, int64_t dv);

/* A slot array and the slots of n sequences: state non-NULL, idx non-NULL when n > 0,
 * slots >= 0, every index in [0, slots), and no two sequences on one slot (among any 4096
 * consecutive sequences). */
fw_status fw_gdn_check_slots(const int32_t *idx, int64_t n, int64_t slots, const float *state);

/* A view of rows [r0, r0 + n) of a 2-D [T, *] tensor as [n, heads, dim] from column c0. */
static inline fw_tensor gdn_rows_view(const fw_tensor *t, int64_t r0, int64_t n, int64_t c0, int64_t heads, int64_t dim)
{
    fw_tensor v = *t;
    v.data = (char *)t->data + (r0 * t->stride[0] + c0 * t->stride[1]) * (int64_t)fw_dtype_size(t->dtype);
    v.ndim = 3;
    v.shape[0] = n;
    v.shape[1] = heads;
    v.shape[2] = dim;
    v.stride[0] = t->stride[0];
    v.stride[1] = dim * t->stride[1];
    v.stride[2] = t->stride[1];
    return v;
}

/* A view of rows [r0, r0 + n) of a 2-D tensor. */
static inline fw_tensor gdn_rows2(const fw_tensor *t, int64_t r0, int64_t n)
{
    fw_tensor v = *t;
    v.data = (char *)t->data + r0 * t->stride[0] * (int64_t)fw_dtype_size(t->dtype);
    v.shape[0] = n;
    return v;
}

/* Rows [r0, r0 + n) of the layer's 2-D qkv [T, dim] as the conv's input [1, n, dim]. */
static inline fw_tensor gdn_conv_rows(const fw_tensor *qkv, int64_t r0, int64_t n)
{
    fw_tensor x = *qkv;
    x.ndim = 3;
    x.data = (char *)qkv->data + r0 * qkv->stride[0] * (int64_t)fw_dtype_size(qkv->dtype);
    x.shape[0] = 1; x.shape[1] = n; x.shape[2] = qkv->shape[1];
    x.stride[0] = n * qkv->stride[0]; x.stride[1] = qkv->stride[0]; x.stride[2] = qkv->stride[1];
    return x;
}

/* One layer call (fw_gdn_layer), checked: its tensors, batch and slots, and the parameters
 * of its conv and of its core (the gates computed in the core's kernels from the raw a, b). */
typedef struct {
    const fw_tensor *qkv, *w, *bias, *out, *a, *b;
    const int32_t *qsl, *ridx, *wr; /* ridx: the slot each sequence reads (negative: none), owned */
    const fw_gdn_caches *caches;
    void *cbuf;  /* the layer's conv rows (NULL in the reference) */
    float *carry; /* a bf16 recurrent cache: the f32 state a long sequence's pieces pass on */
    fw_conv1d_params cp;
    fw_gdn_params gp;
    int64_t nkq, nv, dk, dv, dim, slots, T, used, de, me, spec;
    int kda, zero_tail;
} gdn_layer_prob;

/* Every check of fw_gdn_layer (`ref` admits an f64 out); nothing is written. On FW_OK the
 * caller frees L->ridx. */
fw_status fw_gdn_layer_check(gdn_layer_prob *L, const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                             const fw_tensor *conv_weight, const fw_tensor *conv_bias, const fw_tensor *a_log,
                             const fw_tensor *dt_bias, const fw_gdn_batch *batch, const fw_gdn_caches *caches,
                             const fw_tensor *out, const fw_gdn_layer_params *params, int ref);
/* out's rows past the last token used, zeroed (params->zero_tail). */
void fw_gdn_layer_zero_tail(const gdn_layer_prob *L);
/* The slots of n sequences of a step, the first de of them windows of qsl[i+1] - qsl[i]
 * tokens writing slots wr[i] .. wr[i] + n_i - 1, the others wr[i]: all in [0, slots), none
 * written twice, none read (rd, negative: none) by one sequence and written by another. */
fw_status gdn_check_window_slots(int64_t n, int64_t de, const int32_t *qsl, const int32_t *rd, const int32_t *wr,
                                 int64_t slots);
/* A step's ReplaySSM decodes (fw_gdn_layer_replay), checked: per decode i < de the slot its
 * checkpoint and records are read from (negative: none), the committed records it reads, and
 * whether it flushes. */
typedef struct {
    const fw_gdn_replay *R;
    int32_t *rd, *len;
    unsigned char *flush;
    int64_t window, koff, goff; /* records' rows; where the keys and the log decays start */
    int shadow_reads;           /* bf16 products: the decodes read the bf16 shadow */
} gdn_replay_plan;
/* Every check of replay against the checked layer L; nothing is written. On FW_OK the caller
 * frees the plan (gdn_replay_free). */
fw_status gdn_replay_check(const gdn_layer_prob *L, const fw_gdn_batch *batch, const fw_gdn_replay *replay,
                           gdn_replay_plan *P);
void gdn_replay_free(gdn_replay_plan *P);
/* The replay core of decodes [s0, s1), their conv rows in L->cbuf from row 0. */
fw_status gdn_replay_run(const gdn_layer_prob *L, const gdn_replay_plan *P, int64_t s0, int64_t s1);
/* The entry points of the layer and its reference: every check (replay's too when
 * with_replay: a NULL replay is refused), then run(L, the replay plan or NULL). */
typedef fw_status (*gdn_layer_run_fn)(gdn_layer_prob *L, const gdn_replay_plan *P);
fw_status gdn_layer_call(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a, const fw_tensor *conv_weight,
                         const fw_tensor *conv_bias, const fw_tensor *a_log, const fw_tensor *dt_bias,
                         const fw_gdn_batch *batch, const fw_gdn_caches *caches, const fw_gdn_replay *replay,
                         int with_replay, const fw_tensor *out, const fw_gdn_layer_params *params, int ref,
                         gdn_layer_run_fn run);
/* The bf16 shadow of recurrent slot `slot`, from the f32 state there. */
void gdn_replay_shadow(const gdn_layer_prob *L, const gdn_replay_plan *P, int64_t slot);

static inline const char *at(const fw_tensor *t, int64_t i, int64_t j)
{
    return fw_elem(t, i * t->stride[0] + j * t->stride[1]);
}

static inline float scalar_at(const fw_tensor *t, int64_t i, int64_t j)
{
    return (float)fw_load_f64(t, i * t->stride[0] + j * t->stride[1]);
}

/* The log decay g of token t, value head vh (key channel a under KDA; ignored otherwise), and
 * beta: given, or computed from the raw a and b (in float, the same here and in the
 * reference). */
static inline float gate_g_at(const gdn_prob *p, int64_t t, int64_t vh, int64_t a)
{
    const int64_t ch = p->kda ? a : 0;
    const float x = (float)fw_load_f64(p->g, t * p->g->stride[0] + vh * p->g->stride[1] +
                                                 (p->kda ? ch * p->g->stride[2] : 0));
    if (!p->a_log)
        return x;
    const int64_t bi = p->dt_bias && p->dt_bias->shape[0] != p->HV ? vh * p->dk + ch : vh;
    const float y = x + (p->dt_bias ? (float)fw_load_f64(p->dt_bias, bi * p->dt_bias->stride[0]) : 0.0f);
    const float ea = expf((float)fw_load_f64(p->a_log, vh * p->a_log->stride[0]));
    if (p->lower_bound < 0.0f)
        return p->lower_bound / (1.0f + expf(-ea * y));
    const float sp = y > 20.0f ? y : log1pf(expf(y));
    return -ea * sp;
}

static inline float gate_g(const gdn_prob *p, int64_t t, int64_t vh) { return gate_g_at(p, t, vh, 0); }

static inline float gate_beta(const gdn_prob *p, int64_t t, int64_t vh)
{
    const float b = scalar_at(p->beta, t, vh);
    return p->beta_sigmoid ? 1.0f / (1.0f + expf(-b)) : b;
}

/* KDA's log2 decays of token t, value head vh, into g2 (dk floats): given, or from the raw a
 * by the table's kda_gates (the same as gate_g_at to a few ulp). bias: dk floats of scratch. */
static inline void kda_log2_decays(const fw_kernels *kt, const gdn_prob *p, int64_t t, int64_t vh, float *g2,
                                   float *bias)
{
    if (!p->a_log) {
        kt->cvt.to_f32(at(p->g, t, vh), FW_F32, p->g->stride[2], p->dk, (float)FW_LOG2E, g2);
        return;
    }
    const float ea = expf((float)fw_load_f64(p->a_log, vh * p->a_log->stride[0]));
    const int per_channel = p->dt_bias && p->dt_bias->shape[0] != p->HV;
    for (int64_t x = 0; p->dt_bias && x < p->dk; x++)
        bias[x] = (float)fw_load_f64(p->dt_bias, (per_channel ? vh * p->dk + x : vh) * p->dt_bias->stride[0]);
    kt->cvt.to_f32(at(p->g, t, vh), p->g->dtype, p->g->stride[2], p->dk, 1.0f, g2);
    kt->gdn.kda_gates((int)p->dk, g2, p->dt_bias ? bias : NULL, ea, p->lower_bound, g2);
}

/* The decays exp(g) of the dk state rows of token t, value head vh, into d: one value for all
 * rows (GDN), or one per key channel (KDA), those by the table's exp2. scratch: dk floats. */
static inline void gate_decays(const fw_kernels *kt, const gdn_prob *p, int64_t t, int64_t vh, float *d,
                               float *scratch)
{
    if (!p->kda) {
        const float al = expf(gate_g(p, t, vh));
        for (int64_t x = 0; x < p->dk; x++)
            d[x] = al;
        return;
    }
    kda_log2_decays(kt, p, t, vh, d, scratch);
    kt->gdn.exp2_inplace(d, p->dk);
}

/* q^ (scaled) or k^ of token t, head h, as f32: l2-normalised when asked (p->eps inside the
 * sqrt), by the same table kernel as the chunked path. */
static inline void load_qk(const fw_kernels *kt, const gdn_prob *p, const fw_tensor *x, int64_t t,
                           int64_t h, double scale, float *dst)
{
    kt->cvt.to_f32(at(x, t, h), x->dtype, x->stride[2], p->dk, 1.0f, dst);
    kt->gdn.rows_l2scale(dst, 1, (int)p->dk, (float)scale, p->l2, (float)p->eps);
}

/* The replay buffer of verify and commit: replay[0] tags its layout (GDN_REPLAY_TAG or
 * KDA_REPLAY_TAG: commit reads a KDA replay differently and refuses an untagged buffer), then
 * the deltas [T][HV][dv], the chunk-local log2 decays [T][HV][gw] (gw = dk for KDA, else 1)
 * and the normalised keys [T][H][dk]. */
#define GDN_REPLAY_TAG 1234.5f
#define KDA_REPLAY_TAG 2345.5f
typedef struct {
    float *delta, *gam, *key;
    int64_t gw;
} replay_parts;

static inline size_t replay_size(int64_t T, int64_t H, int64_t HV, int64_t dk, int64_t dv, int kda)
{
    if (T < 0 || H < 0 || HV < 0 || dk < 0 || dv < 0)
        return 0;
    return 1 + (size_t)T * ((size_t)HV * (size_t)(dv + (kda ? dk : 1)) + (size_t)H * (size_t)dk);
}

static inline replay_parts replay_at(float *replay, int64_t T, int64_t HV, int64_t dk, int64_t dv, int kda)
{
    replay_parts r;
    r.gw = kda ? dk : 1;
    r.delta = replay + 1;
    r.gam = r.delta + (size_t)T * (size_t)(HV * dv);
    r.key = r.gam + (size_t)T * (size_t)(HV * r.gw);
    return r;
}

/* State rows [dk][dv] of (sequence or slot) i, value head vh, in a [*, HV, dk, dv] array. */
static inline size_t state_off(const gdn_prob *p, int64_t i, int64_t vh)
{
    return ((size_t)i * p->HV + vh) * (size_t)(p->dk * p->dv);
}

#endif /* FW_GDN_H */
