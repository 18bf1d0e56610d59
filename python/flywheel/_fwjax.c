/*
 * _fwjax.c: flywheel's calls as XLA FFI custom calls, for JAX (flywheel/jax.py registers and
 * calls them with jax.ffi). Built against the XLA FFI C API header that jaxlib ships
 * (jax.ffi.include_dir()), as _fwjax.so next to _fwext.abi3.so, where that header is found.
 *
 * Like _fwext, it links to no library: jax.py hands fwjax_bind() the addresses of the
 * functions of the libflywheel the binding loaded, so there is one copy of the library and its
 * thread pool. Each handler maps XLA's dense row-major buffers onto fw_tensor views (a
 * head-major layout is the token-major tensor with permuted strides, so nothing is copied),
 * runs the call, and turns a refused call into an XLA error carrying fw_last_error()'s
 * message. Shapes and dtypes are checked at trace time in jax.py; the library checks them again
 * here and writes nothing when it refuses.
 *
 * Handlers (arguments, then results; [x] is there when attribute x is set, [sinks] of the
 * backward calls and of fwjax_kvcache and [dsinks] when the call has that many buffers):
 *   fwjax_attn_fwd    q, k, v[, sinks][, rotary_cos, rotary_sin if rotary] -> out, lse
 *                     [b, hq, sq] (attributes rotary_interleaved, rotary_q_only)
 *   fwjax_attn_bwd    q, k, v, out, dout, lse[, sinks] -> dq, dk, dv[, dsinks]
 *   fwjax_varlen_fwd  q, k, v, cu_q, cu_k[, sinks][, rotary_cos, rotary_sin if rotary] -> out,
 *                     lse [hq, total_q]
 *   fwjax_varlen_bwd  q, k, v, out, dout, lse, cu_q, cu_k[, sinks] -> dq, dk, dv[, dsinks]
 *   fwjax_kvcache     q, k_cache[, v_cache unless merged], seqlens, cu_q, num_active [1]
 *                     [, block_table if paged][, batch_idx][, k_new, v_new if appends]
 *                     [, sinks (a further buffer)] -> out, lse [hq, total_q][, k_cache[,
 *                     v_cache]] (a call that does not append may leave the caches out: they
 *                     are then only read)
 *   fwjax_gdn_prefill q, k, v [T, H|HV, dk|dv], g [T, HV] or [T, HV, dk] (KDA), beta [T, HV],
 *                     cu [N + 1][, a_log, dt_bias if kernel_gates (dt_bias if has_dt_bias)]
 *                     [, initial_state [N, HV, dk, dv] f32 if has_h0] -> out [T, HV, dv]
 *                     [, final_state if has_ht] (fw_gdn_prefill; attributes scale, l2norm,
 *                     flags, precision, l2norm_eps, beta_sigmoid, lower_bound)
 *   fwjax_gdn_layer   qkv, b, a, conv_weight [dim, K][, conv_bias if has_bias], a_log, dt_bias,
 *                     query_start_loc, state_indices, distribution [3], seq_lens,
 *                     read_state_indices[, read_offsets if has_offsets], conv_state,
 *                     recurrent_state[, shadow, records, replay_lens if replay]
 *                     -> out [T, n_v d_v], conv_state, recurrent_state[, shadow, records]
 *                     (fw_gdn_layer, or fw_gdn_layer_replay; attributes n_kq, n_v, d_k, d_v,
 *                     num_spec_tokens, zero_tail, l2norm_eps, lower_bound (0: none),
 *                     beta_activated, precision)
 * Shapes as in flywheel.h: dense [b, s, h, x], packed [total, h, x]; attribute layout 1
 * (head-major): the buffers are [b, h, s, x] and [h, total, x], layout 2 (heads outer) [h, b,
 * s, x] (the original FlyWheel's layouts), seen through strides.
 * lse is f32; cu_q, cu_k, seqlens, num_active, block_table, batch_idx are int32.
 * Packed calls take buffers longer than their sequences: rows past cu_q[used] (cu_q[-1]; for
 * the cache call cu_q[num_active], the rows of the active sequences) give out 0 and lse -inf,
 * and their gradients 0, as the original's padding rows do.
 * Caches (the KV caches of fwjax_kvcache, the slot caches of fwjax_gdn_layer) are results that
 * alias their arguments (jax.py passes input_output_aliases), so a donated cache is written
 * where it lies. merged: one cache [pages, page, 2 hkv, d], each token's K and V heads
 * interleaved (k0, v0, k1, v1, ...), read and written through two strided views. Pages of more
 * than 65536 tokens are split into flywheel pages (the fewest that divide them), the block
 * table with them.
 * Other attributes: causal, window_left, window_right, scale (0: 1/sqrt(d)), softcap, threads
 * (0: all online CPUs).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "flywheel.h"
#include "xla/ffi/api/c_api.h"

#define FWJAX_API __attribute__((visibility("default")))

/* The library functions the handlers call, bound once by fwjax_bind(). */
typedef struct {
    void (*params_init)(fw_attn_params *);
    const char *(*last_error)(void);
    fw_status (*attn_fwd)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                          const fw_tensor *, const fw_attn_params *);
    fw_status (*attn_bwd)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                          const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                          const fw_tensor *, const fw_attn_params *);
    fw_status (*kvcache_fwd)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const int32_t *, int64_t,
                             const fw_kv_cache *, const fw_tensor *, const fw_tensor *,
                             const fw_attn_params *);
    fw_status (*varlen_fwd)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const int32_t *,
                            const int32_t *, int64_t, const fw_tensor *, const fw_tensor *,
                            const fw_attn_params *);
    fw_status (*varlen_bwd)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                            const fw_tensor *, const fw_tensor *, const int32_t *, const int32_t *, int64_t,
                            const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_attn_params *);
    void (*gdn_params_init)(fw_gdn_params *);
    fw_status (*gdn_prefill)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                             const fw_tensor *, const int32_t *, int64_t, const float *, float *,
                             const fw_tensor *, const fw_gdn_params *);
    void (*layer_params_init)(fw_gdn_layer_params *);
    fw_status (*gdn_layer)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                           const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_gdn_batch *,
                           const fw_gdn_caches *, const fw_tensor *, const fw_gdn_layer_params *);
    fw_status (*gdn_layer_replay)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                  const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_gdn_batch *,
                                  const fw_gdn_caches *, const fw_gdn_replay *, const fw_tensor *,
                                  const fw_gdn_layer_params *);
} fwjax_api;

static fwjax_api api;

/* Binds the library's functions (jax.py passes them in this order); 0 on success. */
FWJAX_API int fwjax_bind(void *params_init, void *last_error, void *attn_fwd, void *attn_bwd, void *kvcache_fwd,
                         void *varlen_fwd, void *varlen_bwd, void *layer_params_init, void *gdn_layer,
                         void *gdn_layer_replay, void *gdn_params_init, void *gdn_prefill)
{
    if (!params_init || !last_error || !attn_fwd || !attn_bwd || !kvcache_fwd || !varlen_fwd || !varlen_bwd ||
        !layer_params_init || !gdn_layer || !gdn_layer_replay || !gdn_params_init || !gdn_prefill)
        return 1;
    api.params_init = (void (*)(fw_attn_params *))params_init;
    api.last_error = (const char *(*)(void))last_error;
    api.attn_fwd = (fw_status(*)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                 const fw_tensor *, const fw_attn_params *))attn_fwd;
    api.attn_bwd = (fw_status(*)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                 const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                 const fw_tensor *, const fw_attn_params *))attn_bwd;
    api.kvcache_fwd = (fw_status(*)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const int32_t *,
                                    int64_t, const fw_kv_cache *, const fw_tensor *, const fw_tensor *,
                                    const fw_attn_params *))kvcache_fwd;
    api.varlen_fwd = (fw_status(*)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const int32_t *,
                                   const int32_t *, int64_t, const fw_tensor *, const fw_tensor *,
                                   const fw_attn_params *))varlen_fwd;
    api.varlen_bwd = (fw_status(*)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                   const fw_tensor *, const fw_tensor *, const int32_t *, const int32_t *, int64_t,
                                   const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                   const fw_attn_params *))varlen_bwd;
    api.gdn_params_init = (void (*)(fw_gdn_params *))gdn_params_init;
    api.gdn_prefill = (fw_status(*)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                    const fw_tensor *, const int32_t *, int64_t, const float *, float *,
                                    const fw_tensor *, const fw_gdn_params *))gdn_prefill;
    api.layer_params_init = (void (*)(fw_gdn_layer_params *))layer_params_init;
    api.gdn_layer = (fw_status(*)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                  const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_gdn_batch *,
                                  const fw_gdn_caches *, const fw_tensor *, const fw_gdn_layer_params *))gdn_layer;
    api.gdn_layer_replay =
        (fw_status(*)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                      const fw_tensor *, const fw_tensor *, const fw_gdn_batch *, const fw_gdn_caches *,
                      const fw_gdn_replay *, const fw_tensor *, const fw_gdn_layer_params *))gdn_layer_replay;
    return 0;
}

/* ------------------------------------------------------------ call frames -- */

static XLA_FFI_Error *error(const XLA_FFI_CallFrame *f, XLA_FFI_Error_Code code, const char *msg)
{
    XLA_FFI_Error_Create_Args a;
    memset(&a, 0, sizeof a);
    a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
    a.message = msg;
    a.errc = code;
    return f->api->XLA_FFI_Error_Create(&a);
}

/* The metadata query XLA makes when it registers a handler: answered with the API version
 * this file was compiled against; 1 if the frame was that query. */
static int metadata(XLA_FFI_CallFrame *f)
{
    XLA_FFI_InternalExtension *e = f->extension_start;
    if (!e || e->type != XLA_FFI_Extension_Metadata)
        return 0;
    XLA_FFI_Metadata *m = ((XLA_FFI_Metadata_Extension *)e)->metadata;
    m->api_version.major_version = XLA_FFI_API_MAJOR;
    m->api_version.minor_version = XLA_FFI_API_MINOR;
    m->traits = 0;
    return 1;
}

/* Whether the frame asks a handler to run: not the metadata query (answered here) and the
 * execution stage (the others have nothing to prepare). */
static int executes(XLA_FFI_CallFrame *f)
{
    return !metadata(f) && f->stage == XLA_FFI_ExecutionStage_EXECUTE;
}

static int fw_type(XLA_FFI_DataType t, fw_dtype *dt)
{
    switch (t) {
    case XLA_FFI_DataType_F32: *dt = FW_F32; return 1;
    case XLA_FFI_DataType_BF16: *dt = FW_BF16; return 1;
    case XLA_FFI_DataType_F16: *dt = FW_F16; return 1;
    case XLA_FFI_DataType_F8E4M3FN: *dt = FW_F8E4M3; return 1;
    case XLA_FFI_DataType_F8E5M2: *dt = FW_F8E5M2; return 1;
    default: return 0;
    }
}

/* Buffer i of args (ret = 0) or results (ret = 1) as a dense fw_tensor; head_major swaps the
 * view's axes 1 and 2 (the buffer is [b, h, s, x], the view [b, s, h, x]). NULL if absent or
 * of a type or rank the library does not take. */
static const XLA_FFI_Buffer *buffer(const XLA_FFI_CallFrame *f, int ret, int64_t i)
{
    const int64_t n = ret ? f->rets.size : f->args.size;
    if (i >= n)
        return NULL;
    const int typed = ret ? f->rets.types[i] == XLA_FFI_RetType_BUFFER : f->args.types[i] == XLA_FFI_ArgType_BUFFER;
    return typed ? (const XLA_FFI_Buffer *)(ret ? f->rets.rets[i] : f->args.args[i]) : NULL;
}

/* layout: 0 as the buffer is; 1 head-major ([b, h, s, x] seen as [b, s, h, x], [h, t, x] as
 * [t, h, x]); 2 heads outer ([h, b, s, x] seen as [b, s, h, x]). */
static int view(const XLA_FFI_Buffer *b, int layout, fw_tensor *t)
{
    memset(t, 0, sizeof *t);
    if (!b || b->rank < 0 || b->rank > FW_MAX_DIMS || !fw_type(b->dtype, &t->dtype))
        return 0;
    t->data = b->data;
    t->ndim = (int32_t)b->rank;
    int64_t s = 1;
    for (int64_t i = b->rank - 1; i >= 0; i--) {
        t->shape[i] = b->dims[i];
        t->stride[i] = s;
        s *= b->dims[i] > 1 ? b->dims[i] : 1;
    }
    if (layout == 2 && b->rank == 4) { /* axes (1, 2, 0, 3) */
        const int64_t sh[3] = {t->shape[0], t->shape[1], t->shape[2]};
        const int64_t st[3] = {t->stride[0], t->stride[1], t->stride[2]};
        t->shape[0] = sh[1], t->shape[1] = sh[2], t->shape[2] = sh[0];
        t->stride[0] = st[1], t->stride[1] = st[2], t->stride[2] = st[0];
    } else if (layout == 1 && b->rank >= 3) {
        const int a = (int)b->rank - 3;
        int64_t x = t->shape[a];
        t->shape[a] = t->shape[a + 1];
        t->shape[a + 1] = x;
        x = t->stride[a];
        t->stride[a] = t->stride[a + 1];
        t->stride[a + 1] = x;
    }
    return 1;
}

/* Whether two buffers have one dtype and shape (a result that aliases an argument). */
static int same(const XLA_FFI_Buffer *a, const XLA_FFI_Buffer *b)
{
    if (!a || !b || a->dtype != b->dtype || a->rank != b->rank)
        return 0;
    for (int64_t i = 0; i < a->rank; i++)
        if (a->dims[i] != b->dims[i])
            return 0;
    return 1;
}

/* Whether a buffer's shape is exactly the rank-4 shape d. */
static int shaped(const XLA_FFI_Buffer *b, const int64_t d[4])
{
    return b && b->rank == 4 && b->dims[0] == d[0] && b->dims[1] == d[1] && b->dims[2] == d[2] && b->dims[3] == d[3];
}

/* An int32 buffer of the given rank, else NULL. */
static const int32_t *ints(const XLA_FFI_Buffer *b, int64_t rank)
{
    return b && b->dtype == XLA_FFI_DataType_S32 && b->rank == rank ? (const int32_t *)b->data : NULL;
}

/* Rows [used, total) of a packed output [total, h, x] (x contiguous) set to zero, and of its
 * lse [h, total] (when given) to -inf. */
static void pad_rows(const fw_tensor *o, const fw_tensor *lse, int64_t used)
{
    const size_t es = o->dtype == FW_F32 ? 4 : 2;
    for (int64_t r = used; r < o->shape[0]; r++)
        for (int64_t h = 0; h < o->shape[1]; h++)
            memset((char *)o->data + (size_t)(r * o->stride[0] + h * o->stride[1]) * es, 0, (size_t)o->shape[2] * es);
    for (int64_t h = 0; lse && h < lse->shape[0]; h++)
        for (int64_t r = used; r < lse->shape[1]; r++)
            ((float *)lse->data)[h * lse->stride[0] + r] = -__builtin_inff();
}

/* The first n rows of a packed view (n <= its rows). */
static fw_tensor rows(fw_tensor t, int64_t n)
{
    t.shape[0] = n;
    return t;
}

/* A buffer's size in bytes (of the types fw_type takes, and int32). */
static size_t bytes(const XLA_FFI_Buffer *b)
{
    size_t n = b->dtype == XLA_FFI_DataType_F32 || b->dtype == XLA_FFI_DataType_S32 ? 4
               : b->dtype == XLA_FFI_DataType_BF16 || b->dtype == XLA_FFI_DataType_F16 ? 2
                                                                                        : 1;
    for (int64_t i = 0; i < b->rank; i++)
        n *= (size_t)b->dims[i];
    return n;
}

/* The attribute called name, NULL if the call has none. */
static const XLA_FFI_Scalar *attr(const XLA_FFI_CallFrame *f, const char *name)
{
    const size_t len = strlen(name);
    for (int64_t i = 0; i < f->attrs.size; i++) {
        const XLA_FFI_ByteSpan *s = f->attrs.names[i];
        if (f->attrs.types[i] == XLA_FFI_AttrType_SCALAR && s->len == len && memcmp(s->ptr, name, len) == 0)
            return (const XLA_FFI_Scalar *)f->attrs.attrs[i];
    }
    return NULL;
}

/* A scalar attribute as a double (absent: dflt). */
static double num(const XLA_FFI_CallFrame *f, const char *name, double dflt)
{
    const XLA_FFI_Scalar *s = attr(f, name);
    if (!s)
        return dflt;
    switch (s->dtype) {
    case XLA_FFI_DataType_PRED: return *(const uint8_t *)s->value != 0;
    case XLA_FFI_DataType_S32: return *(const int32_t *)s->value;
    case XLA_FFI_DataType_S64: return (double)*(const int64_t *)s->value;
    case XLA_FFI_DataType_F32: return *(const float *)s->value;
    case XLA_FFI_DataType_F64: return *(const double *)s->value;
    default: return dflt;
    }
}

/* An integer attribute (absent: dflt), clamped to int32's range: a float one rounds toward
 * zero, NaN reads as dflt (so no conversion is out of range). */
static int32_t inum(const XLA_FFI_CallFrame *f, const char *name, int32_t dflt)
{
    const double x = num(f, name, (double)dflt);
    if (x != x)
        return dflt;
    return x <= (double)INT32_MIN ? INT32_MIN : x >= (double)INT32_MAX ? INT32_MAX : (int32_t)x;
}

/* A float attribute (absent: dflt); a double past float's range reads as an infinity, which
 * the library refuses where it must be finite. */
static float fnum(const XLA_FFI_CallFrame *f, const char *name, float dflt)
{
    const double x = num(f, name, (double)dflt);
    return x > FLT_MAX ? HUGE_VALF : x < -FLT_MAX ? -HUGE_VALF : (float)x;
}

static void params(const XLA_FFI_CallFrame *f, fw_attn_params *p)
{
    api.params_init(p);
    p->scale = fnum(f, "scale", 0.0f);
    p->causal = num(f, "causal", 0.0) != 0.0;
    p->window_left = inum(f, "window_left", -1);
    p->window_right = inum(f, "window_right", -1);
    p->softcap = fnum(f, "softcap", 0.0f);
    p->threads = inum(f, "threads", 0);
}

/* The fused rotary embedding of an attention call: its tables and the attributes. */
static void rotary_params(const XLA_FFI_CallFrame *f, const fw_tensor *cos, const fw_tensor *sin,
                          fw_attn_params *p)
{
    p->rotary_cos = cos;
    p->rotary_sin = sin;
    p->rotary_interleaved = num(f, "rotary_interleaved", 0.0) != 0.0;
    p->rotary_q_only = num(f, "rotary_q_only", 0.0) != 0.0;
}

static XLA_FFI_Error *refused(const XLA_FFI_CallFrame *f)
{
    return error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT, api.last_error());
}

static XLA_FFI_Error *bad_buffers(const XLA_FFI_CallFrame *f)
{
    return error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                 "flywheel: an operand has a type or rank the call does not take");
}

static XLA_FFI_Error *bad(const XLA_FFI_CallFrame *f, const char *msg)
{
    return error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT, msg);
}

/* --------------------------------------------------------------- handlers -- */

FWJAX_API XLA_FFI_Error *fwjax_attn_fwd(XLA_FFI_CallFrame *f)
{
    if (!executes(f))
        return NULL;
    const int hm = inum(f, "layout", 0);
    const int sinks = num(f, "sinks", 0.0) != 0.0, rotary = num(f, "rotary", 0.0) != 0.0;
    fw_tensor q, k, v, s, cos, sin, out, lse;
    if (!view(buffer(f, 0, 0), hm, &q) || !view(buffer(f, 0, 1), hm, &k) || !view(buffer(f, 0, 2), hm, &v) ||
        !view(buffer(f, 1, 0), hm, &out) || !view(buffer(f, 1, 1), 0, &lse) ||
        (sinks && !view(buffer(f, 0, 3), 0, &s)) ||
        (rotary && (!view(buffer(f, 0, 3 + sinks), 0, &cos) || !view(buffer(f, 0, 4 + sinks), 0, &sin))))
        return bad_buffers(f);
    fw_attn_params p;
    params(f, &p);
    p.sinks = sinks ? &s : NULL;
    if (rotary)
        rotary_params(f, &cos, &sin, &p);
    return api.attn_fwd(&q, &k, &v, &out, &lse, &p) == FW_OK ? NULL : refused(f);
}

FWJAX_API XLA_FFI_Error *fwjax_attn_bwd(XLA_FFI_CallFrame *f)
{
    if (!executes(f))
        return NULL;
    const int hm = inum(f, "layout", 0);
    fw_tensor q, k, v, out, dout, lse, s, dq, dk, dv, ds;
    if (!view(buffer(f, 0, 0), hm, &q) || !view(buffer(f, 0, 1), hm, &k) || !view(buffer(f, 0, 2), hm, &v) ||
        !view(buffer(f, 0, 3), hm, &out) || !view(buffer(f, 0, 4), hm, &dout) || !view(buffer(f, 0, 5), 0, &lse) ||
        !view(buffer(f, 1, 0), hm, &dq) || !view(buffer(f, 1, 1), hm, &dk) || !view(buffer(f, 1, 2), hm, &dv) ||
        (f->args.size > 6 && !view(buffer(f, 0, 6), 0, &s)) || (f->rets.size > 3 && !view(buffer(f, 1, 3), 0, &ds)))
        return bad_buffers(f);
    fw_attn_params p;
    params(f, &p);
    p.sinks = f->args.size > 6 ? &s : NULL;
    p.dsinks = f->rets.size > 3 ? &ds : NULL;
    return api.attn_bwd(&q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv, &p) == FW_OK ? NULL : refused(f);
}

/* Rows a packed call's sequences own, cu[n] (n = batch, or the active sequences), if cu is
 * [batch + 1] from 0 and cu[n] <= total; else -1. */
static int64_t used_rows(const XLA_FFI_Buffer *b, int64_t n, int64_t total)
{
    const int32_t *cu = ints(b, 1);
    if (!cu || b->dims[0] < 1 || n < 0 || n >= b->dims[0] || cu[0] != 0 || cu[n] < 0 || cu[n] > total)
        return -1;
    return cu[n];
}

/* A packed call's batch and the rows its sequences own in q and k (cu_q, cu_k: int32
 * [batch + 1] alike, from 0, their last entries within tq and tk rows); 0 if they are not. */
static int packed_rows(const XLA_FFI_Buffer *cq, const XLA_FFI_Buffer *ck, int64_t tq, int64_t tk, int64_t *batch,
                       int64_t *uq, int64_t *uk)
{
    *batch = cq && cq->rank == 1 ? cq->dims[0] - 1 : -1;
    *uq = used_rows(cq, *batch, tq);
    *uk = used_rows(ck, *batch, tk);
    return *uq >= 0 && *uk >= 0 && ck->rank == 1 && ck->dims[0] == *batch + 1;
}

FWJAX_API XLA_FFI_Error *fwjax_varlen_fwd(XLA_FFI_CallFrame *f)
{
    if (!executes(f))
        return NULL;
    const int hm = inum(f, "layout", 0);
    const int sinks = num(f, "sinks", 0.0) != 0.0, rotary = num(f, "rotary", 0.0) != 0.0;
    fw_tensor q, k, v, s, cos, sin, out, lse;
    if (!view(buffer(f, 0, 0), hm, &q) || !view(buffer(f, 0, 1), hm, &k) || !view(buffer(f, 0, 2), hm, &v) ||
        !view(buffer(f, 1, 0), hm, &out) || !view(buffer(f, 1, 1), 0, &lse) || q.ndim != 3 || k.ndim != 3 ||
        out.ndim != 3 || lse.ndim != 2 || (sinks && !view(buffer(f, 0, 5), 0, &s)) ||
        (rotary && (!view(buffer(f, 0, 5 + sinks), 0, &cos) || !view(buffer(f, 0, 6 + sinks), 0, &sin))))
        return bad_buffers(f);
    const XLA_FFI_Buffer *cq = buffer(f, 0, 3), *ck = buffer(f, 0, 4);
    int64_t batch, uq, uk;
    if (!packed_rows(cq, ck, q.shape[0], k.shape[0], &batch, &uq, &uk))
        return bad(f, "flywheel: cu_seqlens_q and cu_seqlens_k must be int32 [batch + 1] from 0, "
                      "their last entries within q's and k's rows");
    fw_attn_params p;
    params(f, &p);
    p.sinks = sinks ? &s : NULL;
    if (rotary)
        rotary_params(f, &cos, &sin, &p);
    const fw_tensor q1 = rows(q, uq), k1 = rows(k, uk), v1 = rows(v, uk), o1 = rows(out, uq);
    fw_tensor l1 = lse;
    l1.shape[1] = uq;
    if (api.varlen_fwd(&q1, &k1, &v1, (const int32_t *)cq->data, (const int32_t *)ck->data, batch, &o1, &l1, &p) !=
        FW_OK)
        return refused(f);
    pad_rows(&out, &lse, uq);
    return NULL;
}

FWJAX_API XLA_FFI_Error *fwjax_varlen_bwd(XLA_FFI_CallFrame *f)
{
    if (!executes(f))
        return NULL;
    const int hm = inum(f, "layout", 0);
    fw_tensor q, k, v, out, dout, lse, s, dq, dk, dv, ds;
    if (!view(buffer(f, 0, 0), hm, &q) || !view(buffer(f, 0, 1), hm, &k) || !view(buffer(f, 0, 2), hm, &v) ||
        !view(buffer(f, 0, 3), hm, &out) || !view(buffer(f, 0, 4), hm, &dout) || !view(buffer(f, 0, 5), 0, &lse) ||
        !view(buffer(f, 1, 0), hm, &dq) || !view(buffer(f, 1, 1), hm, &dk) || !view(buffer(f, 1, 2), hm, &dv) ||
        q.ndim != 3 || k.ndim != 3 || dq.ndim != 3 || dk.ndim != 3 || dv.ndim != 3 || lse.ndim != 2 ||
        (f->args.size > 8 && !view(buffer(f, 0, 8), 0, &s)) || (f->rets.size > 3 && !view(buffer(f, 1, 3), 0, &ds)))
        return bad_buffers(f);
    const XLA_FFI_Buffer *cq = buffer(f, 0, 6), *ck = buffer(f, 0, 7);
    int64_t batch, uq, uk;
    if (!packed_rows(cq, ck, q.shape[0], k.shape[0], &batch, &uq, &uk))
        return bad(f, "flywheel: cu_seqlens_q and cu_seqlens_k must be int32 [batch + 1] from 0, "
                      "their last entries within q's and k's rows");
    fw_attn_params p;
    params(f, &p);
    p.sinks = f->args.size > 8 ? &s : NULL;
    p.dsinks = f->rets.size > 3 ? &ds : NULL;
    const fw_tensor q1 = rows(q, uq), k1 = rows(k, uk), v1 = rows(v, uk), o1 = rows(out, uq), do1 = rows(dout, uq);
    const fw_tensor dq1 = rows(dq, uq), dk1 = rows(dk, uk), dv1 = rows(dv, uk);
    fw_tensor l1 = lse;
    l1.shape[1] = uq;
    if (api.varlen_bwd(&q1, &k1, &v1, &o1, &do1, &l1, (const int32_t *)cq->data, (const int32_t *)ck->data, batch,
                       &dq1, &dk1, &dv1, &p) != FW_OK)
        return refused(f);
    pad_rows(&dq, NULL, uq);
    pad_rows(&dk, NULL, uk);
    pad_rows(&dv, NULL, uk);
    return NULL;
}

/* The fewest r that split a page of P tokens into pages of at most 65536 (flywheel's
 * largest). */
static int64_t split_factor(int64_t P)
{
    int64_t r = 1;
    while (P / r > 65536 || P % r)
        r++;
    return r;
}

/* A cache view [N, P, ...] as [N r, P / r, ...] (its pages are dense: stride0 = P stride1). */
static void split_pages(fw_tensor *t, int64_t r)
{
    t->shape[0] *= r;
    t->shape[1] /= r;
    t->stride[0] = t->stride[1] * t->shape[1];
}

FWJAX_API XLA_FFI_Error *fwjax_kvcache(XLA_FFI_CallFrame *f)
{
    if (!executes(f))
        return NULL;
    const int hm = inum(f, "layout", 0), merged = num(f, "merged", 0.0) != 0.0;
    const int paged = num(f, "paged", 0.0) != 0.0, bidx = num(f, "batch_idx", 0.0) != 0.0;
    const int appends = num(f, "appends", 0.0) != 0.0;
    fw_tensor q, kn, vn, s, out, lse, kc, vc;
    int64_t a = 0;
    const int qok = view(buffer(f, 0, a++), hm, &q);
    const XLA_FFI_Buffer *kcin = buffer(f, 0, a++), *vcin = merged ? NULL : buffer(f, 0, a++);
    const XLA_FFI_Buffer *lens = buffer(f, 0, a++), *cu = buffer(f, 0, a++), *nact = buffer(f, 0, a++);
    const XLA_FFI_Buffer *table = paged ? buffer(f, 0, a++) : NULL, *bix = bidx ? buffer(f, 0, a++) : NULL;
    /* a call that appends returns the caches; one that only reads them may not (rets: 2) */
    const int ro = f->rets.size == 2;
    int ok = qok && q.ndim == 3 && view(buffer(f, 1, 0), hm, &out) && out.ndim == 3 && view(buffer(f, 1, 1), 0, &lse) &&
             lse.ndim == 2 && view(ro ? kcin : buffer(f, 1, 2), 0, &kc) && kc.ndim == 4 && kcin && ints(lens, 1) &&
             ints(cu, 1) && nact && nact->dtype == XLA_FFI_DataType_S32 && bytes(nact) >= 4 &&
             (!paged || ints(table, 2)) && (!bidx || ints(bix, 1)) && !(ro && appends) &&
             (ro || (same(kcin, buffer(f, 1, 2)) && (merged || same(vcin, buffer(f, 1, 3)))));
    if (ok && appends)
        ok = view(buffer(f, 0, a), 0, &kn) && view(buffer(f, 0, a + 1), 0, &vn) && kn.ndim == 3 && vn.ndim == 3;
    a += appends ? 2 : 0;
    if (ok && f->args.size > a)
        ok = view(buffer(f, 0, a), 0, &s);
    if (ok && merged) { /* K heads at even rows, V heads at odd ones */
        if (kc.shape[2] % 2)
            return bad(f, "flywheel: a merged cache needs an even number of head rows (2 hkv)");
        kc.shape[2] /= 2;
        kc.stride[2] *= 2;
        vc = kc;
        const size_t es = kc.dtype == FW_F32 ? 4 : kc.dtype == FW_BF16 || kc.dtype == FW_F16 ? 2 : 1;
        vc.data = (char *)kc.data + (size_t)kc.stride[3] * (size_t)kc.shape[3] * es;
    } else if (ok)
        ok = vcin && view(ro ? vcin : buffer(f, 1, 3), 0, &vc) && vc.ndim == 4;
    if (!ok)
        return bad_buffers(f);
    const int64_t batch = lens->dims[0];
    const int32_t na = *(const int32_t *)nact->data;
    if (cu->dims[0] != batch + 1 || (paged && table->dims[0] != batch) || (bidx && bix->dims[0] != batch))
        return bad(f, "flywheel: cache_seqlens, cu_seqlens_q, block_table and cache_batch_idx must have one "
                      "entry (row) per sequence");
    if (na < 0 || na > batch)
        return bad(f, "flywheel: num_active must be in [0, batch]");
    const int64_t used = used_rows(cu, na, q.shape[0]);
    if (used < 0 || (appends && (kn.shape[0] != q.shape[0] || vn.shape[0] != q.shape[0])))
        return bad(f, "flywheel: cu_seqlens_q must run from 0 to at most q's rows, and k, v have q's rows");
    /* the results start as the caches when XLA did not alias them (it does when donated) */
    if (kc.data != kcin->data)
        memcpy(buffer(f, 1, 2)->data, kcin->data, bytes(kcin));
    if (!merged && vc.data != vcin->data)
        memcpy(vc.data, vcin->data, bytes(vcin));
    fw_kv_cache cache;
    memset(&cache, 0, sizeof cache);
    int32_t *split = NULL;
    if (paged) {
        const int64_t r = split_factor(kc.shape[1]), cols = table->dims[1];
        cache.block_table = (const int32_t *)table->data;
        cache.max_pages = cols;
        if (r > 1) {
            if (!(split = malloc((size_t)(na > 0 ? na : 1) * (size_t)(cols * r) * sizeof(int32_t))))
                return error(f, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "flywheel: out of memory");
            const int32_t *t = (const int32_t *)table->data;
            for (int64_t i = 0; i < na * cols; i++)
                for (int64_t j = 0; j < r; j++) { /* (a page outside the cache stays outside) */
                    const int64_t x = (int64_t)t[i] * r + j;
                    split[i * r + j] = x > INT32_MAX ? INT32_MAX : (int32_t)x;
                }
            split_pages(&kc, r);
            split_pages(&vc, r);
            cache.block_table = split;
            cache.max_pages = cols * r;
        }
    }
    cache.k = kc;
    cache.v = vc;
    cache.seqlens = (const int32_t *)lens->data;
    cache.batch_idx = bidx ? (const int32_t *)bix->data : NULL;
    fw_attn_params p;
    params(f, &p);
    p.sinks = f->args.size > a ? &s : NULL;
    fw_status st = FW_OK;
    if (na > 0) {
        const fw_tensor q1 = rows(q, used), o1 = rows(out, used), kn1 = rows(kn, used), vn1 = rows(vn, used);
        fw_tensor l1 = lse;
        l1.shape[1] = used;
        st = api.kvcache_fwd(&q1, appends ? &kn1 : NULL, appends ? &vn1 : NULL, (const int32_t *)cu->data, na, &cache,
                             &o1, &l1, &p);
    }
    free(split);
    if (st != FW_OK)
        return refused(f);
    pad_rows(&out, &lse, na > 0 ? used : 0);
    return NULL;
}

FWJAX_API XLA_FFI_Error *fwjax_gdn_layer(XLA_FFI_CallFrame *f)
{
    if (!executes(f))
        return NULL;
    const int has_bias = num(f, "has_bias", 0.0) != 0.0, has_offsets = num(f, "has_offsets", 0.0) != 0.0;
    const int replay = num(f, "replay", 0.0) != 0.0;
    fw_tensor qkv, b, a, w, cb, al, dtb, conv, rec, out, shadow, records;
    int64_t i = 0;
    int ok = view(buffer(f, 0, i++), 0, &qkv) && view(buffer(f, 0, i++), 0, &b) && view(buffer(f, 0, i++), 0, &a) &&
             view(buffer(f, 0, i++), 0, &w);
    if (ok && has_bias)
        ok = view(buffer(f, 0, i++), 0, &cb);
    ok = ok && view(buffer(f, 0, i), 0, &al) && view(buffer(f, 0, i + 1), 0, &dtb);
    i += 2;
    const XLA_FFI_Buffer *qsl = buffer(f, 0, i), *sidx = buffer(f, 0, i + 1), *dist = buffer(f, 0, i + 2);
    const XLA_FFI_Buffer *slen = buffer(f, 0, i + 3), *ridx = buffer(f, 0, i + 4);
    i += 5;
    const XLA_FFI_Buffer *offs = has_offsets ? buffer(f, 0, i++) : NULL;
    const XLA_FFI_Buffer *conv_in = buffer(f, 0, i), *rec_in = buffer(f, 0, i + 1);
    const XLA_FFI_Buffer *shadow_in = replay ? buffer(f, 0, i + 2) : NULL, *rec_buf = buffer(f, 1, 2);
    const XLA_FFI_Buffer *records_in = replay ? buffer(f, 0, i + 3) : NULL, *lens = replay ? buffer(f, 0, i + 4) : NULL;
    ok = ok && ints(qsl, 1) && ints(sidx, 1) && ints(dist, 1) && dist->dims[0] == 3 && ints(slen, 1) &&
         ints(ridx, 1) && (!has_offsets || ints(offs, 1)) && conv_in && rec_in && rec_buf && rec_buf->rank == 4 &&
         view(buffer(f, 1, 0), 0, &out) && view(buffer(f, 1, 1), 0, &conv) && view(rec_buf, 0, &rec) &&
         (!replay || (shadow_in && records_in && ints(lens, 1) && view(buffer(f, 1, 3), 0, &shadow) &&
                      view(buffer(f, 1, 4), 0, &records)));
    const XLA_FFI_Buffer *ins[] = {conv_in, rec_in, shadow_in, records_in};
    for (int c = 0; ok && c < (replay ? 4 : 2); c++)
        ok = same(ins[c], buffer(f, 1, 1 + c));
    if (!ok)
        return bad_buffers(f);
    if (rec.shape[0] < conv.shape[0])
        return bad(f, "flywheel: recurrent_state needs a slot for each of conv_state's slots");
    const int64_t n = sidx->dims[0];
    if (qsl->dims[0] != n + 1 || slen->dims[0] != n || ridx->dims[0] != n || (has_offsets && offs->dims[0] != n) ||
        (replay && lens->dims[0] != n))
        return bad(f, "flywheel: query_start_loc needs num_seqs + 1 entries, and state_indices, seq_lens, "
                      "read_state_indices, read_offsets and replay_lens num_seqs");
    /* the results start as the caches when XLA did not alias them (it does when donated) */
    for (int c = 0; c < (replay ? 4 : 2); c++)
        if (buffer(f, 1, 1 + c)->data != ins[c]->data)
            memcpy(buffer(f, 1, 1 + c)->data, ins[c]->data, bytes(ins[c]));
    const int32_t *d = (const int32_t *)dist->data;
    fw_gdn_batch batch;
    memset(&batch, 0, sizeof batch);
    batch.n_seqs = n;
    batch.query_start_loc = (const int32_t *)qsl->data;
    batch.seq_lens = (const int32_t *)slen->data;
    batch.state_indices = (const int32_t *)sidx->data;
    batch.read_state_indices = (const int32_t *)ridx->data;
    batch.decode_end = d[0];
    batch.prefill_end = d[1];
    batch.mixed_end = d[2];
    batch.num_spec_tokens = inum(f, "num_spec_tokens", 0);
    batch.read_offsets = has_offsets ? (const int32_t *)offs->data : NULL;
    fw_gdn_caches caches;
    memset(&caches, 0, sizeof caches);
    caches.conv = conv;
    caches.recurrent = rec.data;
    caches.recurrent_stride = rec.shape[1] * rec.shape[2] * rec.shape[3];
    caches.recurrent_dtype = rec.dtype;
    fw_gdn_layer_params p;
    api.layer_params_init(&p);
    p.n_kq = inum(f, "n_kq", 0);
    p.n_v = inum(f, "n_v", 0);
    p.d_k = inum(f, "d_k", 0);
    p.d_v = inum(f, "d_v", 0);
    p.zero_tail = num(f, "zero_tail", 1.0) != 0.0;
    p.l2norm_eps = fnum(f, "l2norm_eps", 0.0f);
    p.lower_bound = fnum(f, "lower_bound", 0.0f);
    p.beta_activated = num(f, "beta_activated", 0.0) != 0.0;
    p.threads = inum(f, "threads", 0);
    p.precision = inum(f, "precision", 0);
    fw_status st;
    if (replay) {
        fw_gdn_replay r;
        r.shadow = shadow;
        r.records = records;
        r.replay_lens = (const int32_t *)lens->data;
        st = api.gdn_layer_replay(&qkv, &b, &a, &w, has_bias ? &cb : NULL, &al, &dtb, &batch, &caches, &r, &out, &p);
    } else
        st = api.gdn_layer(&qkv, &b, &a, &w, has_bias ? &cb : NULL, &al, &dtb, &batch, &caches, &out, &p);
    return st == FW_OK ? NULL : refused(f);
}

FWJAX_API XLA_FFI_Error *fwjax_gdn_prefill(XLA_FFI_CallFrame *f)
{
    if (!executes(f))
        return NULL;
    const int gates = num(f, "kernel_gates", 0.0) != 0.0, has_dtb = num(f, "has_dt_bias", 0.0) != 0.0;
    const int has_h0 = num(f, "has_h0", 0.0) != 0.0, has_ht = num(f, "has_ht", 0.0) != 0.0;
    fw_tensor q, k, v, g, beta, al, dtb, out, h0, ht;
    int64_t i = 6;
    const XLA_FFI_Buffer *cu = buffer(f, 0, 5);
    int ok = view(buffer(f, 0, 0), 0, &q) && view(buffer(f, 0, 1), 0, &k) && view(buffer(f, 0, 2), 0, &v) &&
             view(buffer(f, 0, 3), 0, &g) && view(buffer(f, 0, 4), 0, &beta) && ints(cu, 1) && cu->dims[0] >= 1 &&
             view(buffer(f, 1, 0), 0, &out);
    if (ok && gates)
        ok = view(buffer(f, 0, i++), 0, &al) && (!has_dtb || view(buffer(f, 0, i++), 0, &dtb));
    /* the states are read and written as raw [N, HV, dk, dv] floats: their shapes are checked
     * here (q [T, H, dk], v [T, HV, dv]) */
    const int64_t sd[4] = {cu && cu->rank == 1 ? cu->dims[0] - 1 : -1, v.ndim == 3 ? v.shape[1] : -1,
                           q.ndim == 3 ? q.shape[2] : -1, v.ndim == 3 ? v.shape[2] : -1};
    if (ok && has_h0)
        ok = shaped(buffer(f, 0, i), sd) && view(buffer(f, 0, i), 0, &h0) && h0.dtype == FW_F32;
    i += has_h0;
    if (ok && has_ht)
        ok = shaped(buffer(f, 1, 1), sd) && view(buffer(f, 1, 1), 0, &ht) && ht.dtype == FW_F32;
    if (!ok)
        return bad_buffers(f);
    fw_gdn_params p;
    api.gdn_params_init(&p);
    p.scale = fnum(f, "scale", 0.0f);
    p.l2norm_qk = num(f, "l2norm", 0.0) != 0.0;
    p.flags = (uint32_t)inum(f, "flags", 0);
    p.precision = inum(f, "precision", 0);
    p.l2norm_eps = fnum(f, "l2norm_eps", 0.0f);
    p.threads = inum(f, "threads", 0);
    p.beta_sigmoid = num(f, "beta_sigmoid", 0.0) != 0.0;
    p.lower_bound = fnum(f, "lower_bound", 0.0f);
    p.a_log = gates ? &al : NULL;
    p.dt_bias = gates && has_dtb ? &dtb : NULL;
    return api.gdn_prefill(&q, &k, &v, &g, &beta, (const int32_t *)cu->data, cu->dims[0] - 1,
                           has_h0 ? (const float *)h0.data : NULL, has_ht ? (float *)ht.data : NULL, &out, &p) == FW_OK
               ? NULL
               : refused(f);
}
