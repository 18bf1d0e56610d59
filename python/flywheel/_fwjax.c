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
 * Handlers (arguments, then results; attributes by name):
 *   fwjax_attn_fwd  q, k, v[, sinks] -> out, lse [b, hq, sq] f32
 *   fwjax_attn_bwd  q, k, v, out, dout, lse[, sinks] -> dq, dk, dv[, dsinks]
 *   fwjax_kvcache   q, k_cache, v_cache, cache_seqlens[, k_new, v_new (attribute appends)]
 *                   [, sinks] -> out, lse [hq, b sq] f32, k_cache, v_cache (the caches'
 *                   results alias their arguments:
 *                   jax.py passes input_output_aliases, so a donated cache is appended to in
 *                   place)
 * Attributes: head_major (attention: q [b, hq, sq, d] instead of [b, sq, hq, d], and k, v, out,
 * dout and the gradients alike), causal, window_left, window_right, scale (0: 1/sqrt(d)),
 * softcap.
 */
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
} fwjax_api;

static fwjax_api api;

/* Binds the library's functions (jax.py passes them in this order); 0 on success. */
FWJAX_API int fwjax_bind(void *params_init, void *last_error, void *attn_fwd, void *attn_bwd, void *kvcache_fwd)
{
    if (!params_init || !last_error || !attn_fwd || !attn_bwd || !kvcache_fwd)
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

static int view(const XLA_FFI_Buffer *b, int head_major, fw_tensor *t)
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
    if (head_major && b->rank == 4) {
        int64_t x = t->shape[1];
        t->shape[1] = t->shape[2];
        t->shape[2] = x;
        x = t->stride[1];
        t->stride[1] = t->stride[2];
        t->stride[2] = x;
    }
    return 1;
}

/* A buffer's size in bytes (of the types fw_type takes). */
static size_t bytes(const XLA_FFI_Buffer *b)
{
    size_t n = b->dtype == XLA_FFI_DataType_F32 ? 4 : b->dtype == XLA_FFI_DataType_BF16 || b->dtype == XLA_FFI_DataType_F16 ? 2 : 1;
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

static void params(const XLA_FFI_CallFrame *f, fw_attn_params *p)
{
    api.params_init(p);
    p->scale = (float)num(f, "scale", 0.0);
    p->causal = num(f, "causal", 0.0) != 0.0;
    p->window_left = (int64_t)num(f, "window_left", -1.0);
    p->window_right = (int64_t)num(f, "window_right", -1.0);
    p->softcap = (float)num(f, "softcap", 0.0);
}

static XLA_FFI_Error *refused(const XLA_FFI_CallFrame *f) { return error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT, api.last_error()); }

static XLA_FFI_Error *bad_buffers(const XLA_FFI_CallFrame *f)
{
    return error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT, "flywheel: an operand has a type or rank the call does not take");
}

/* --------------------------------------------------------------- handlers -- */

FWJAX_API XLA_FFI_Error *fwjax_attn_fwd(XLA_FFI_CallFrame *f)
{
    if (metadata(f))
        return NULL;
    if (f->stage != XLA_FFI_ExecutionStage_EXECUTE)
        return NULL;
    const int hm = num(f, "head_major", 0.0) != 0.0;
    fw_tensor q, k, v, s, out, lse;
    if (!view(buffer(f, 0, 0), hm, &q) || !view(buffer(f, 0, 1), hm, &k) || !view(buffer(f, 0, 2), hm, &v) ||
        !view(buffer(f, 1, 0), hm, &out) || !view(buffer(f, 1, 1), 0, &lse) ||
        (f->args.size > 3 && !view(buffer(f, 0, 3), 0, &s)))
        return bad_buffers(f);
    fw_attn_params p;
    params(f, &p);
    p.sinks = f->args.size > 3 ? &s : NULL;
    return api.attn_fwd(&q, &k, &v, &out, &lse, &p) == FW_OK ? NULL : refused(f);
}

FWJAX_API XLA_FFI_Error *fwjax_attn_bwd(XLA_FFI_CallFrame *f)
{
    if (metadata(f))
        return NULL;
    if (f->stage != XLA_FFI_ExecutionStage_EXECUTE)
        return NULL;
    const int hm = num(f, "head_major", 0.0) != 0.0;
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

/* q [b, sq, hq, d] against contiguous caches [b, S, hkv, d|dv] holding cache_seqlens [b]
 * (int32) rows, after appending k_new / v_new [b, sq, hkv, d|dv] when given. */
FWJAX_API XLA_FFI_Error *fwjax_kvcache(XLA_FFI_CallFrame *f)
{
    if (metadata(f))
        return NULL;
    if (f->stage != XLA_FFI_ExecutionStage_EXECUTE)
        return NULL;
    fw_tensor q, kc, vc, kn, vn, s, out, lse, kco, vco;
    const XLA_FFI_Buffer *lens = buffer(f, 0, 3);
    const int appends = num(f, "appends", 0.0) != 0.0, sinks = f->args.size > 4 + 2 * appends;
    if (!view(buffer(f, 0, 0), 0, &q) || !view(buffer(f, 0, 1), 0, &kc) || !view(buffer(f, 0, 2), 0, &vc) ||
        !lens || lens->dtype != XLA_FFI_DataType_S32 || lens->rank != 1 || !view(buffer(f, 1, 0), 0, &out) ||
        !view(buffer(f, 1, 1), 0, &lse) || !view(buffer(f, 1, 2), 0, &kco) || !view(buffer(f, 1, 3), 0, &vco) ||
        (appends && (!view(buffer(f, 0, 4), 0, &kn) || !view(buffer(f, 0, 5), 0, &vn))) ||
        (sinks && !view(buffer(f, 0, 4 + 2 * appends), 0, &s)) || q.ndim != 4 ||
        kc.ndim != 4 || (appends && (kn.ndim != 4 || vn.ndim != 4)))
        return bad_buffers(f);
    const int64_t b = q.shape[0], sq = q.shape[1];
    if (lens->dims[0] != b || kc.shape[0] != b)
        return error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     "flywheel: cache_seqlens and the caches need one entry per sequence of q");
    /* The cache results alias the cache arguments (input_output_aliases); should XLA ever
     * hand separate buffers, the results start as copies of the caches. */
    if (kco.data != kc.data)
        memcpy(kco.data, kc.data, bytes(buffer(f, 0, 1)));
    if (vco.data != vc.data)
        memcpy(vco.data, vc.data, bytes(buffer(f, 0, 2)));
    int32_t few[65], *cu = b < 65 ? few : malloc((size_t)(b + 1) * sizeof(int32_t));
    if (!cu)
        return error(f, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "flywheel: out of memory");
    for (int64_t i = 0; i <= b; i++)
        cu[i] = (int32_t)(i * sq);
    /* [b, sq, h, x] seen as [b sq, h, x] (the packed batch of the call) */
    fw_tensor *rows[] = {&q, &out, &kn, &vn};
    for (int i = 0; i < (appends ? 4 : 2); i++) {
        fw_tensor *t = rows[i];
        t->ndim = 3;
        t->shape[0] *= t->shape[1];
        t->stride[0] = t->stride[1];
        t->shape[1] = t->shape[2];
        t->stride[1] = t->stride[2];
        t->shape[2] = t->shape[3];
        t->stride[2] = t->stride[3];
    }
    fw_kv_cache cache;
    memset(&cache, 0, sizeof cache);
    cache.k = kco;
    cache.v = vco;
    cache.seqlens = (const int32_t *)lens->data;
    fw_attn_params p;
    params(f, &p);
    p.sinks = sinks ? &s : NULL;
    const fw_status st = api.kvcache_fwd(&q, appends ? &kn : NULL, appends ? &vn : NULL, cu, b, &cache, &out, &lse, &p);
    if (cu != few)
        free(cu);
    return st == FW_OK ? NULL : refused(f);
}
