/*
 * fuzz_jax.c: XLA FFI call frames for flywheel.jax's handlers (python/flywheel/_fwjax.c,
 * compiled into this harness), built from the fuzzer's bytes: any handler, any number of
 * argument and result buffers of any dtype, rank and shape, any attributes, results that alias
 * arguments or not. XLA's frames match what jax.py declares; these need not, and whatever they
 * say the handlers must not crash, abort or touch memory outside the buffers (AddressSanitizer
 * sees each buffer as its own allocation). A refused frame must come back as an error; the
 * fake API records that one was made.
 *
 * Shapes are drawn from a pool of four sizes shared by the frame, float buffers mostly of one
 * dtype and int32 buffers mostly of small values, so that the frames often agree with
 * themselves and reach the library's calls rather than stop at the handlers' first check.
 */
#include <stdlib.h>
#include <string.h>
#include "fuzz_util.h"
#include "../python/flywheel/_fwjax.c"

enum { MAX_BUFS = 14, MAX_ATTRS = 40 };

static int errors_made;

static XLA_FFI_Error *fake_error(XLA_FFI_Error_Create_Args *a)
{
    if (!a->message)
        abort(); /* every refusal says why */
    errors_made++;
    return (XLA_FFI_Error *)&errors_made;
}

/* The dtypes a frame may carry: the handlers' own, and some they must refuse. */
static const XLA_FFI_DataType dtypes[] = {XLA_FFI_DataType_F32, XLA_FFI_DataType_BF16, XLA_FFI_DataType_F16,
                                          XLA_FFI_DataType_S32, XLA_FFI_DataType_F8E4M3FN,
                                          XLA_FFI_DataType_F8E5M2, XLA_FFI_DataType_PRED,
                                          XLA_FFI_DataType_F64, XLA_FFI_DataType_S64};

static size_t dtype_bytes(XLA_FFI_DataType t)
{
    switch (t) {
    case XLA_FFI_DataType_F64:
    case XLA_FFI_DataType_S64: return 8;
    case XLA_FFI_DataType_F32:
    case XLA_FFI_DataType_S32: return 4;
    case XLA_FFI_DataType_BF16:
    case XLA_FFI_DataType_F16: return 2;
    default: return 1;
    }
}

static const char *const attr_names[] = {
    "layout", "causal", "window_left", "window_right", "scale", "softcap", "threads", "sinks", "rotary",
    "rotary_interleaved", "rotary_q_only", "merged", "paged", "batch_idx", "appends", "has_bias",
    "has_offsets", "replay", "n_kq", "n_v", "d_k", "d_v", "num_spec_tokens", "zero_tail", "l2norm_eps",
    "lower_bound", "beta_activated", "precision", "kernel_gates", "has_dt_bias", "has_h0", "has_ht", "l2norm",
    "flags", "beta_sigmoid"};

typedef struct {
    XLA_FFI_Buffer b;
    int64_t dims[4];
    void *data;
} fz_buffer;

/* A buffer of the frame: its dtype (mostly the frame's float dtype, else int32 or any), rank
 * and dims from the shared pool, its exact allocation filled from the bytes. */
static void make_buffer(fz_in *in, fz_buffer *x, XLA_FFI_DataType fdt, const int64_t pool[4])
{
    memset(x, 0, sizeof *x);
    x->b.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    const unsigned k = fz_byte(in) % 8;
    x->b.dtype = k < 4 ? fdt : k < 7 ? XLA_FFI_DataType_S32 : dtypes[fz_byte(in) % 9];
    x->b.rank = fz_range(in, 0, 4);
    size_t n = 1;
    for (int64_t i = 0; i < x->b.rank; i++) {
        x->dims[i] = fz_chance(in, 16) ? fz_range(in, 0, 9) : pool[fz_byte(in) % 4];
        n *= (size_t)x->dims[i];
    }
    x->b.dims = x->dims;
    const size_t bytes = n * dtype_bytes(x->b.dtype);
    x->data = malloc(bytes ? bytes : 1);
    unsigned char *p = x->data;
    for (size_t i = 0; i < bytes; i++) {
        if (x->b.dtype == XLA_FFI_DataType_S32 && i % 4 == 0 && i + 4 <= bytes) {
            const int32_t v = (int32_t)fz_range(in, -2, 12); /* lengths, offsets, slots */
            memcpy(p + i, &v, 4);
            i += 3;
        } else if (x->b.dtype == XLA_FFI_DataType_F32 && i % 4 == 0 && i + 4 <= bytes) {
            const float v = (float)fz_range(in, -40, 40) / 16.0f;
            memcpy(p + i, &v, 4);
            i += 3;
        } else
            p[i] = (unsigned char)fz_byte(in);
    }
    x->b.data = x->data;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int bound;
    if (!bound) {
        bound = 1;
        if (fwjax_bind((void *)fw_attn_params_init, (void *)fw_last_error, (void *)fw_attn_fwd,
                       (void *)fw_attn_bwd, (void *)fw_attn_kvcache_fwd, (void *)fw_attn_varlen_fwd,
                       (void *)fw_attn_varlen_bwd, (void *)fw_gdn_layer_params_init, (void *)fw_gdn_layer,
                       (void *)fw_gdn_layer_replay, (void *)fw_gdn_params_init, (void *)fw_gdn_prefill) != 0)
            abort();
    }
    fz_in in = {data, size, 0};
    XLA_FFI_Handler *const handlers[] = {fwjax_attn_fwd, fwjax_attn_bwd, fwjax_varlen_fwd, fwjax_varlen_bwd,
                                         fwjax_kvcache, fwjax_gdn_layer, fwjax_gdn_prefill};
    XLA_FFI_Handler *h = handlers[fz_byte(&in) % 7];
    const XLA_FFI_DataType fdt = dtypes[fz_byte(&in) % 3];
    int64_t pool[4];
    for (int i = 0; i < 4; i++)
        pool[i] = fz_range(&in, 1, 6);

    static fz_buffer args[MAX_BUFS], rets[MAX_BUFS];
    XLA_FFI_ArgType at[MAX_BUFS];
    XLA_FFI_RetType rt[MAX_BUFS];
    void *ap[MAX_BUFS], *rp[MAX_BUFS];
    const int na = (int)fz_range(&in, 0, MAX_BUFS), nr = (int)fz_range(&in, 0, 6);
    for (int i = 0; i < na; i++) {
        make_buffer(&in, &args[i], fdt, pool);
        at[i] = XLA_FFI_ArgType_BUFFER;
        ap[i] = &args[i].b;
    }
    for (int i = 0; i < nr; i++) {
        make_buffer(&in, &rets[i], fdt, pool);
        rt[i] = XLA_FFI_RetType_BUFFER;
        rp[i] = &rets[i].b;
        if (na > 0 && fz_chance(&in, 64)) /* a result that aliases an argument, as donated caches do */
            rp[i] = &args[fz_byte(&in) % na].b;
    }

    XLA_FFI_ByteSpan spans[MAX_ATTRS], *names[MAX_ATTRS];
    XLA_FFI_AttrType types[MAX_ATTRS];
    XLA_FFI_Scalar scalars[MAX_ATTRS];
    void *attrs[MAX_ATTRS];
    union {
        uint8_t b;
        int32_t i32;
        int64_t i64;
        float f;
        double d;
    } values[MAX_ATTRS];
    int nattr = 0;
    for (size_t i = 0; i < sizeof attr_names / sizeof attr_names[0] && nattr < MAX_ATTRS; i++) {
        if (!fz_chance(&in, 128))
            continue;
        const int64_t v = fz_range(&in, -3, 20);
        const XLA_FFI_DataType kinds[] = {XLA_FFI_DataType_PRED, XLA_FFI_DataType_S32, XLA_FFI_DataType_S64,
                                          XLA_FFI_DataType_F32, XLA_FFI_DataType_F64};
        const XLA_FFI_DataType kind = kinds[fz_byte(&in) % 5];
        switch (kind) {
        case XLA_FFI_DataType_PRED: values[nattr].b = (uint8_t)(v & 1); break;
        case XLA_FFI_DataType_S32: values[nattr].i32 = (int32_t)v; break;
        case XLA_FFI_DataType_S64: values[nattr].i64 = v; break;
        case XLA_FFI_DataType_F32: values[nattr].f = (float)v / 4.0f; break;
        default: values[nattr].d = (double)v / 4.0; break;
        }
        spans[nattr] = (XLA_FFI_ByteSpan){attr_names[i], strlen(attr_names[i])};
        names[nattr] = &spans[nattr];
        types[nattr] = XLA_FFI_AttrType_SCALAR;
        scalars[nattr] = (XLA_FFI_Scalar){kind, &values[nattr]};
        attrs[nattr] = &scalars[nattr];
        nattr++;
    }

    XLA_FFI_Api api;
    memset(&api, 0, sizeof api);
    api.XLA_FFI_Error_Create = fake_error;
    XLA_FFI_CallFrame f;
    memset(&f, 0, sizeof f);
    f.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
    f.api = &api;
    f.stage = XLA_FFI_ExecutionStage_EXECUTE;
    f.args = (XLA_FFI_Args){XLA_FFI_Args_STRUCT_SIZE, NULL, na, at, ap};
    f.rets = (XLA_FFI_Rets){XLA_FFI_Rets_STRUCT_SIZE, NULL, nr, rt, rp};
    f.attrs = (XLA_FFI_Attrs){XLA_FFI_Attrs_STRUCT_SIZE, NULL, nattr, types, names, attrs};
    XLA_FFI_Metadata meta;
    XLA_FFI_Metadata_Extension ext;
    if (fz_chance(&in, 8)) { /* XLA's registration-time query: answered, nothing run */
        memset(&meta, 0, sizeof meta);
        ext.extension_base = (XLA_FFI_InternalExtension){sizeof ext, XLA_FFI_Extension_Metadata, NULL};
        ext.metadata = &meta;
        f.extension_start = &ext.extension_base;
    }
    errors_made = 0;
    XLA_FFI_Error *e = h(&f);
    if (e && e != (XLA_FFI_Error *)&errors_made)
        abort(); /* an error the fake API did not make */
    if (f.extension_start && (e || meta.api_version.major_version != XLA_FFI_API_MAJOR))
        abort();
    for (int i = 0; i < na; i++)
        free(args[i].data);
    for (int i = 0; i < nr; i++)
        free(rets[i].data);
    return 0;
}
