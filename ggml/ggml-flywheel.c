/*
 * libggml-flywheel: a ggml backend that serves llama.cpp's flash attention from flywheel.
 *
 * It is an ACCEL device, like ggml's BLAS backend: it computes on host memory, takes the CPU
 * backend's buffers as they are (so the KV cache is read where llama.cpp keeps it) and claims
 * only GGML_OP_FLASH_ATTN_EXT; ggml's scheduler leaves every other op to the CPU backend.
 * Loaded at run time by an unmodified llama.cpp build: GGML_BACKEND_PATH=/path/to/this.so.
 *
 * GGML_OP_FLASH_ATTN_EXT, as ggml defines it (ggml.h, ggml-cpu's reference):
 *   q    [DK, N, hq, ns]   f32, any strides          (ggml's ne order: innermost first)
 *   k    [DK, n_kv, hkv, ns], v [DV, n_kv, hkv, ns]: f32 | f16 | bf16, one type, rows contiguous
 *   mask [n_kv, >= N, 1, 1 or ns] f16, added to the scores; -inf hides a key
 *   sinks [hq] f32 or none; op_params: scale, max_bias (ALiBi), logit_softcap, precision,
 *   n_kv_max (sparse K/V)
 *   dst  [DV, hq, N, ns]   f32, contiguous: flash-attn's [b, sq, hq, dv]
 * Query head h reads K/V head h / (hq / hkv); a row that sees no key gives zeros.
 *
 * flywheel's attention takes its masks as rules (causal, bottom-right, with a left window), not
 * as tensors. So each call reads the mask first: where every row sees a contiguous run of keys
 * with zeros on it and -inf elsewhere, and the runs are those of a causal (or full) attention
 * over one context with one left window, as llama.cpp builds for a sequence in its cache, the
 * call runs on fw_attn_kvcache_fwd over that context, in place in the cache. Any other mask (an
 * additive bias, several sequences interleaved in one cache, a ring-buffer window that has
 * wrapped) runs ggml's own CPU kernel on the node, with its bits: never a wrong answer, and
 * never slower than the CPU backend would have been, beyond the mask's reading.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flywheel.h"
#include "ggml-backend-impl.h"
#include "ggml.h"

#define FWG_EXPORT __attribute__((visibility("default")))

/* --------------------------------------------------------------- the mask -- */

/* The keys of one stream's rows, in flywheel's terms: keys [base, base + len) of the cache are
 * the context, the rows align bottom-right to it, causal or not, with a left window (-1: none). */
typedef struct fwg_span {
    int64_t base, len;
    int causal;
    int64_t window_left;
} fwg_span;

/* f16 bit patterns of a KQ mask's entries: +0 and -0 show a key, -inf hides it. */
#define F16_ZERO 0x0000u
#define F16_NZERO 0x8000u
#define F16_NINF 0xFC00u

/* Reads n_rows mask rows of n_kv entries (row r at m + r * row_stride) into a span; lo and hi
 * are n_rows of scratch. Returns 0 when the mask is not such a pattern (an entry other than
 * 0 or -inf, a row that sees no key or a broken run, runs of no single rule). */
static int fwg_mask_span(const uint16_t *m, size_t row_stride, int64_t n_rows, int64_t n_kv,
                         int64_t *lo, int64_t *hi, fwg_span *span)
{
    for (int64_t r = 0; r < n_rows; r++) {
        const uint16_t *row = m + (size_t)r * row_stride;
        int64_t a = -1, b = -1;
        for (int64_t j = 0; j < n_kv; j++) {
            const unsigned x = row[j];
            if (x == F16_ZERO || x == F16_NZERO) {
                if (a < 0)
                    a = j;
                else if (b != j - 1)
                    return 0; /* a second run */
                b = j;
            } else if (x != F16_NINF) {
                return 0; /* an additive bias */
            }
        }
        if (a < 0)
            return 0;
        lo[r] = a;
        hi[r] = b;
    }
    int64_t base = lo[0], top = hi[0];
    int causal = 0, full = 1;
    for (int64_t r = 1; r < n_rows; r++) {
        base = lo[r] < base ? lo[r] : base;
        top = hi[r] > top ? hi[r] : top;
        full &= hi[r] == hi[0];
    }
    if (!full) {
        causal = 1; /* row r must end at hi[0] + r */
        for (int64_t r = 1; r < n_rows; r++)
            if (hi[r] != hi[0] + r)
                return 0;
    }
    /* one left window: the rows that start past base start wl keys before their end; the
     * others must not reach further back than wl (a full attention has no window) */
    int64_t wl = -1;
    for (int64_t r = 0; r < n_rows; r++)
        if (lo[r] > base) {
            if (full || (wl >= 0 && hi[r] - lo[r] != wl))
                return 0;
            wl = hi[r] - lo[r];
        }
    if (wl >= 0)
        for (int64_t r = 0; r < n_rows; r++)
            if (lo[r] == base && hi[r] - base > wl)
                return 0;
    span->base = base;
    span->len = top + 1 - base;
    span->causal = causal;
    span->window_left = wl;
    return 1;
}

/* ------------------------------------------------------------ the backend -- */

typedef struct fwg_context {
    int n_threads;                /* 0: flywheel's default (all online CPUs) */
    ggml_backend_t cpu;           /* ggml's CPU backend, for the nodes flywheel does not take */
    void (*cpu_set_threads)(ggml_backend_t, int);
    struct ggml_context *one_ctx; /* a one-node graph for them */
    struct ggml_cgraph *one;
    int64_t *scratch;             /* lo and hi of the mask's rows */
    int64_t scratch_rows;
    /* the last mask read in this graph: layers share it */
    const void *mask_data;
    int64_t mask_rows, mask_kv, mask_stream;
    int mask_ok;
    fwg_span mask_span;
    uint64_t served, fell_back;   /* nodes since the backend was made */
} fwg_context;

static int fwg_debug(void)
{
    const char *e = getenv("FLYWHEEL_GGML_DEBUG");
    return e && *e && strcmp(e, "0") != 0;
}

static int fw_type(enum ggml_type t, fw_dtype *dt)
{
    switch (t) {
    case GGML_TYPE_F32: *dt = FW_F32; return 1;
    case GGML_TYPE_F16: *dt = FW_F16; return 1;
    case GGML_TYPE_BF16: *dt = FW_BF16; return 1;
    default: return 0;
    }
}

static float op_float(const struct ggml_tensor *t, int i)
{
    float f;
    memcpy(&f, (const char *)t->op_params + i * sizeof(float), sizeof f);
    return f;
}

static int32_t op_int(const struct ggml_tensor *t, int i)
{
    int32_t v;
    memcpy(&v, (const char *)t->op_params + i * sizeof(int32_t), sizeof v);
    return v;
}

/* What flywheel can be asked for, from the node's shapes and params alone (the mask's values
 * are read when it runs). */
static int fa_supported(const struct ggml_tensor *op)
{
    const struct ggml_tensor *q = op->src[0], *k = op->src[1], *v = op->src[2];
    const struct ggml_tensor *mask = op->src[3], *sinks = op->src[4];
    fw_dtype dt;
    if (!q || !k || !v || q->type != GGML_TYPE_F32 || op->type != GGML_TYPE_F32)
        return 0;
    if (k->type != v->type || !fw_type(k->type, &dt))
        return 0; /* quantised caches stay with the CPU backend */
    if (q->nb[0] != sizeof(float) || k->nb[0] != ggml_type_size(k->type) ||
        v->nb[0] != ggml_type_size(v->type) || !ggml_is_contiguous(op))
        return 0;
    if (k->ne[0] != q->ne[0] || v->ne[1] != k->ne[1] || v->ne[2] != k->ne[2] || k->ne[2] == 0 ||
        q->ne[2] % k->ne[2] != 0 || q->ne[3] != k->ne[3] || v->ne[3] != k->ne[3])
        return 0;
    if (k->ne[1] > INT32_MAX || q->ne[1] > INT32_MAX)
        return 0; /* flywheel's lengths are int32 */
    const float scale = op_float(op, 0), max_bias = op_float(op, 1), softcap = op_float(op, 2);
    if (max_bias != 0.0f || !(softcap >= 0.0f) || !isfinite(scale) || scale == 0.0f ||
        op_int(op, 4) != 0)
        return 0; /* ALiBi, a negative softcap and sparse K/V sets stay with the CPU backend */
    if (mask && (mask->type != GGML_TYPE_F16 || !ggml_is_contiguous(mask) || mask->ne[2] != 1 ||
                 mask->ne[0] < k->ne[1] || mask->ne[1] < q->ne[1]))
        return 0;
    if (sinks && (sinks->type != GGML_TYPE_F32 || sinks->ne[0] != q->ne[2]))
        return 0;
    return 1;
}

/* The mask's span for stream i3, read once per graph for every layer that shares it. */
static int mask_span(fwg_context *c, const struct ggml_tensor *mask, int64_t n_rows, int64_t n_kv,
                     int64_t i3, fwg_span *span)
{
    if (!mask) {
        span->base = 0;
        span->len = n_kv;
        span->causal = 0;
        span->window_left = -1;
        return 1;
    }
    const int64_t stream = i3 % mask->ne[3];
    if (c->mask_data == mask->data && c->mask_rows == n_rows && c->mask_kv == n_kv &&
        c->mask_stream == stream) {
        *span = c->mask_span;
        return c->mask_ok;
    }
    if (c->scratch_rows < n_rows) {
        int64_t *s = realloc(c->scratch, 2 * (size_t)n_rows * sizeof(int64_t));
        if (!s)
            return 0;
        c->scratch = s;
        c->scratch_rows = n_rows;
    }
    const uint16_t *m = (const uint16_t *)((const char *)mask->data + stream * mask->nb[3]);
    c->mask_ok = fwg_mask_span(m, mask->nb[1] / sizeof(uint16_t), n_rows, n_kv, c->scratch,
                               c->scratch + n_rows, &c->mask_span);
    c->mask_data = mask->data;
    c->mask_rows = n_rows;
    c->mask_kv = n_kv;
    c->mask_stream = stream;
    *span = c->mask_span;
    return c->mask_ok;
}

/* A flywheel view of ggml memory: shape and byte strides, innermost last. */
static fw_tensor view(void *data, fw_dtype dt, int ndim, const int64_t *shape, const size_t *nb)
{
    fw_tensor t = {data, dt, ndim, {0}, {0}};
    for (int i = 0; i < ndim; i++) {
        t.shape[i] = shape[i];
        t.stride[i] = (int64_t)(nb[i] / fw_dtype_size(dt));
    }
    return t;
}

/* The node on flywheel: one fw_attn_kvcache_fwd per stream, over the context the mask shows.
 * 0 when a stream's mask is not such a rule or flywheel refuses it (then nothing was written
 * for that stream, and the caller runs the whole node on the CPU backend). */
static int fa_flywheel(fwg_context *c, struct ggml_tensor *node)
{
    const struct ggml_tensor *q = node->src[0], *k = node->src[1], *v = node->src[2];
    const struct ggml_tensor *mask = node->src[3], *sinks = node->src[4];
    const int64_t d = q->ne[0], dv = v->ne[0], n = q->ne[1], hq = q->ne[2], ns = q->ne[3];
    const int64_t n_kv = k->ne[1], hkv = k->ne[2];
    fw_dtype kdt = FW_F32;
    fw_type(k->type, &kdt);

    fw_attn_params p;
    fw_attn_params_init(&p);
    p.scale = op_float(node, 0);
    p.softcap = op_float(node, 2);
    p.threads = c->n_threads;
    /* A bf16 cache gets bf16 products where the CPU has a native bf16 dot product (AMX, AMD's
     * AVX-512 BF16, Arm's BF16): q rounded to bf16 as ggml's CPU kernel rounds it for bf16
     * keys, and P rounded to bf16 before PV, flash-attn's arithmetic. Other caches: f32. */
    p.precision = kdt == FW_BF16 && fw_isa_native_bf16(NULL) ? FW_PREC_BF16 : FW_PREC_F32;
    fw_tensor sk;
    if (sinks) {
        sk = view(sinks->data, FW_F32, 1, &hq, sinks->nb);
        p.sinks = &sk;
    }
    for (int64_t i3 = 0; i3 < ns; i3++) {
        fwg_span span, *s = &span;
        if (!mask_span(c, mask, n, n_kv, i3, s)) {
            if (fwg_debug())
                fprintf(stderr, "ggml-flywheel: %s: the mask is not a causal or full span; "
                                "ggml's CPU kernel runs it\n", node->name);
            return 0;
        }
        p.causal = s->causal;
        p.window_left = s->window_left;
        fw_tensor tq = view((char *)q->data + i3 * q->nb[3], FW_F32, 3, (int64_t[]){n, hq, d},
                            (size_t[]){q->nb[1], q->nb[2], q->nb[0]});
        fw_tensor to = view((char *)node->data + i3 * node->nb[3], FW_F32, 3,
                            (int64_t[]){n, hq, dv}, (size_t[]){node->nb[2], node->nb[1], node->nb[0]});
        fw_kv_cache cache;
        memset(&cache, 0, sizeof cache);
        cache.k = view((char *)k->data + i3 * k->nb[3] + s->base * k->nb[1], kdt, 4,
                       (int64_t[]){1, s->len, hkv, d}, (size_t[]){0, k->nb[1], k->nb[2], k->nb[0]});
        cache.v = view((char *)v->data + i3 * v->nb[3] + s->base * v->nb[1], kdt, 4,
                       (int64_t[]){1, s->len, hkv, dv}, (size_t[]){0, v->nb[1], v->nb[2], v->nb[0]});
        const int32_t seqlen = (int32_t)s->len, cu[2] = {0, (int32_t)n};
        cache.seqlens = &seqlen;
        const fw_status st = fw_attn_kvcache_fwd(&tq, NULL, NULL, cu, 1, &cache, &to, NULL, &p);
        if (st != FW_OK) {
            if (fwg_debug())
                fprintf(stderr, "ggml-flywheel: %s: flywheel refused (%s); ggml's CPU kernel "
                                "runs it\n", node->name, fw_last_error());
            return 0;
        }
    }
    return 1;
}

static enum ggml_status on_cpu(fwg_context *c, struct ggml_tensor *node)
{
    if (!c->cpu)
        return GGML_STATUS_FAILED;
    if (c->cpu_set_threads && c->n_threads > 0)
        c->cpu_set_threads(c->cpu, c->n_threads);
    ggml_graph_clear(c->one);
    ggml_graph_add_node(c->one, node);
    return ggml_backend_graph_compute(c->cpu, c->one);
}

static enum ggml_status fwg_graph_compute(ggml_backend_t backend, struct ggml_cgraph *cgraph)
{
    fwg_context *c = backend->context;
    c->mask_data = NULL; /* inputs change between graphs */
    for (int i = 0; i < ggml_graph_n_nodes(cgraph); i++) {
        struct ggml_tensor *node = ggml_graph_node(cgraph, i);
        if (!(node->flags & GGML_TENSOR_FLAG_COMPUTE))
            continue;
        switch (node->op) {
        case GGML_OP_NONE:
        case GGML_OP_RESHAPE:
        case GGML_OP_VIEW:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE:
            break;
        case GGML_OP_FLASH_ATTN_EXT:
            if (fa_supported(node) && fa_flywheel(c, node)) {
                c->served++;
            } else {
                c->fell_back++;
                const enum ggml_status st = on_cpu(c, node);
                if (st != GGML_STATUS_SUCCESS)
                    return st;
            }
            break;
        default:
            return GGML_STATUS_FAILED; /* never scheduled here: supports_op refuses it */
        }
    }
    return GGML_STATUS_SUCCESS;
}

static const char *fwg_name(ggml_backend_t backend)
{
    (void)backend;
    return "FLYWHEEL";
}

static void fwg_free(ggml_backend_t backend)
{
    fwg_context *c = backend->context;
    if (fwg_debug())
        fprintf(stderr, "ggml-flywheel: %llu nodes on flywheel, %llu on ggml's CPU kernel\n",
                (unsigned long long)c->served, (unsigned long long)c->fell_back);
    if (c->cpu)
        ggml_backend_free(c->cpu);
    if (c->one_ctx)
        ggml_free(c->one_ctx);
    free(c->scratch);
    free(c);
    free(backend);
}

static const struct ggml_backend_i fwg_backend_i = {
    .get_name = fwg_name,
    .free = fwg_free,
    .graph_compute = fwg_graph_compute,
};

static ggml_guid_t fwg_guid(void)
{
    static ggml_guid guid = {0x66, 0x6c, 0x79, 0x77, 0x68, 0x65, 0x65, 0x6c,
                             0x2d, 0x67, 0x67, 0x6d, 0x6c, 0x2d, 0x66, 0x61};
    return &guid;
}

static void fwg_set_n_threads(ggml_backend_t backend, int n_threads)
{
    if (backend && ggml_guid_matches(backend->guid, fwg_guid()))
        ((fwg_context *)backend->context)->n_threads = n_threads > 0 ? n_threads : 0;
}

/* Nodes this backend ran on flywheel, and those it handed to ggml's CPU kernel. */
static void fwg_counts(ggml_backend_t backend, uint64_t *served, uint64_t *fell_back)
{
    if (!backend || !ggml_guid_matches(backend->guid, fwg_guid()))
        return;
    const fwg_context *c = backend->context;
    if (served)
        *served = c->served;
    if (fell_back)
        *fell_back = c->fell_back;
}

static ggml_backend_t fwg_init(ggml_backend_dev_t dev, const char *params)
{
    (void)params;
    fwg_context *c = calloc(1, sizeof *c);
    ggml_backend_t b = calloc(1, sizeof *b);
    if (!c || !b)
        goto fail;
    struct ggml_init_params ip = {ggml_graph_overhead_custom(1, false), NULL, true};
    c->one_ctx = ggml_init(ip);
    if (!c->one_ctx)
        goto fail;
    c->one = ggml_new_graph_custom(c->one_ctx, 1, false);
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    c->cpu = cpu ? ggml_backend_dev_init(cpu, NULL) : NULL;
    if (c->cpu)
        c->cpu_set_threads = (void (*)(ggml_backend_t, int))ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(cpu), "ggml_backend_set_n_threads");
    b->guid = fwg_guid();
    b->iface = fwg_backend_i;
    b->device = dev;
    b->context = c;
    return b;
fail:
    if (c && c->one_ctx)
        ggml_free(c->one_ctx);
    free(c);
    free(b);
    return NULL;
}

/* ------------------------------------------------------------- the device -- */

static const char *fwg_dev_name(ggml_backend_dev_t dev)
{
    (void)dev;
    return "FLYWHEEL";
}

static const char *fwg_dev_description(ggml_backend_dev_t dev)
{
    (void)dev;
    static char text[96];
    if (!text[0]) {
        const char *isa = fw_isa_default();
        snprintf(text, sizeof text, "flywheel attention (%s)", isa ? isa : "no table");
    }
    return text;
}

static void fwg_dev_memory(ggml_backend_dev_t dev, size_t *free_bytes, size_t *total)
{
    (void)dev;
    *free_bytes = 0;
    *total = 0;
}

static enum ggml_backend_dev_type fwg_dev_type(ggml_backend_dev_t dev)
{
    (void)dev;
    return GGML_BACKEND_DEVICE_TYPE_ACCEL;
}

static void fwg_dev_props(ggml_backend_dev_t dev, struct ggml_backend_dev_props *props)
{
    memset(props, 0, sizeof *props);
    props->name = fwg_dev_name(dev);
    props->description = fwg_dev_description(dev);
    props->type = fwg_dev_type(dev);
    props->caps.buffer_from_host_ptr = true;
    props->caps.mmap_support = true;
}

static ggml_backend_buffer_type_t fwg_dev_buffer_type(ggml_backend_dev_t dev)
{
    (void)dev;
    return ggml_backend_cpu_buffer_type();
}

static ggml_backend_buffer_t fwg_dev_from_host_ptr(ggml_backend_dev_t dev, void *ptr, size_t size,
                                                   size_t max_tensor_size)
{
    (void)dev;
    (void)max_tensor_size;
    return ggml_backend_cpu_buffer_from_ptr(ptr, size);
}

static bool fwg_dev_supports_op(ggml_backend_dev_t dev, const struct ggml_tensor *op)
{
    (void)dev;
    switch (op->op) {
    case GGML_OP_NONE:
    case GGML_OP_RESHAPE:
    case GGML_OP_VIEW:
    case GGML_OP_PERMUTE:
    case GGML_OP_TRANSPOSE:
        return true;
    case GGML_OP_FLASH_ATTN_EXT:
        return fa_supported(op) && fw_isa_default() != NULL;
    default:
        return false;
    }
}

static bool fwg_dev_supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft)
{
    (void)dev;
    return ggml_backend_buft_is_host(buft);
}

static const struct ggml_backend_device_i fwg_device_i = {
    .get_name = fwg_dev_name,
    .get_description = fwg_dev_description,
    .get_memory = fwg_dev_memory,
    .get_type = fwg_dev_type,
    .get_props = fwg_dev_props,
    .init_backend = fwg_init,
    .get_buffer_type = fwg_dev_buffer_type,
    .buffer_from_host_ptr = fwg_dev_from_host_ptr,
    .supports_op = fwg_dev_supports_op,
    .supports_buft = fwg_dev_supports_buft,
};

/* --------------------------------------------------------------- the reg -- */

static const char *fwg_reg_name(ggml_backend_reg_t reg)
{
    (void)reg;
    return "FLYWHEEL";
}

static size_t fwg_reg_count(ggml_backend_reg_t reg)
{
    (void)reg;
    return 1;
}

static ggml_backend_dev_t fwg_reg_device(ggml_backend_reg_t reg, size_t index)
{
    static struct ggml_backend_device dev = {fwg_device_i, NULL, NULL};
    if (index != 0)
        return NULL;
    dev.reg = reg;
    return &dev;
}

static void *fwg_reg_proc(ggml_backend_reg_t reg, const char *name)
{
    (void)reg;
    if (strcmp(name, "ggml_backend_set_n_threads") == 0)
        return (void *)fwg_set_n_threads;
    if (strcmp(name, "ggml_backend_flywheel_counts") == 0)
        return (void *)fwg_counts;
    return NULL;
}

static ggml_backend_reg_t fwg_reg(void)
{
    static struct ggml_backend_reg reg = {
        GGML_BACKEND_API_VERSION, {fwg_reg_name, fwg_reg_count, fwg_reg_device, fwg_reg_proc}, NULL};
    return &reg;
}

/* ggml's dynamic-backend entry points (ggml_backend_load) */
FWG_EXPORT ggml_backend_reg_t ggml_backend_init(void)
{
    return fwg_reg();
}

FWG_EXPORT int ggml_backend_score(void)
{
    return fw_isa_default() ? 1 : 0;
}
