/*
 * _fwext.c: the compiled fast path of the Python binding (a CPython extension on the limited
 * API of Python 3.10, so one abi3 build serves every later Python).
 *
 * Why: a call through ctypes cost 33-35 us before any kernel work (building ctypes structs,
 * numpy offset arrays, Python-level checks), more than a decode step's kernel at 1K context.
 * Engines make thousands of such calls per second.
 *
 * How it stays exactly the binding it speeds up: each public Python function (attention.py,
 * gated_delta.py, layers.py, conv.py) first offers its arguments to the matching function here;
 * which function, the arguments in order and the conditions under which the call is offered
 * come from the call's description (python/flywheel/_calls.py, `fast=`). The fast path
 * takes only the common, fully valid case: torch CPU tensors or numpy arrays seen through
 * DLPack without copies, int32 index arrays, plain numbers, the options that need no Python
 * work. Anything else -- another type or dtype, a layout the Python path would copy, a
 * read-only array (numpy refuses to export one), an empty array, a tensor that requires grad
 * (grad mode on), a value out of range, and any status other than FW_OK from the library,
 * which writes nothing when it refuses -- returns NotImplemented and the Python path runs the call as before, with its
 * copies, conversions and error messages. So results and errors are the Python path's by
 * construction; python/tests/test_fastpath.py checks both paths give the same bits and that
 * the fast path really runs.
 *
 * The library is the one the ctypes binding loaded: _lib.py hands init() the addresses of its
 * functions by name (`symbols` below lists the ones it needs), so the extension links to
 * nothing but Python and cannot meet another copy of libflywheel. The GIL is released while
 * the kernel runs.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "flywheel.h"

/* the functions below take a fixed number of positional arguments (from the Python side) */
static int nargs(Py_ssize_t n, Py_ssize_t want, const char *name)
{
    if (n == want)
        return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, n);
    return 0;
}

/* ------------------------------------------------------------------ DLPack -- */
/* The DLPack ABI (dlpack.h, v0.8: the "dltensor" capsule every exporter gives when called
 * without max_version), declared from its published specification. */
typedef struct {
    int32_t device_type; /* 1: CPU */
    int32_t device_id;
} dl_device;

typedef struct {
    uint8_t code; /* 0 int, 1 uint, 2 float, 4 bfloat */
    uint8_t bits;
    uint16_t lanes;
} dl_dtype;

typedef struct {
    void *data;
    dl_device device;
    int32_t ndim;
    dl_dtype dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL: C-contiguous */
    uint64_t byte_offset;
} dl_tensor;

typedef struct dl_managed {
    dl_tensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed *self);
} dl_managed;

/* ------------------------------------------------------- library and state -- */
typedef fw_status (*attn_fwd_fn)(const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                 const fw_tensor *, const fw_tensor *, const fw_attn_params *);
typedef fw_status (*attn_varlen_fn)(const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                    const int32_t *, const int32_t *, int64_t, const fw_tensor *,
                                    const fw_tensor *, const fw_attn_params *);
typedef fw_status (*attn_kvcache_fn)(const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                     const int32_t *, int64_t, const fw_kv_cache *,
                                     const fw_tensor *, const fw_tensor *, const fw_attn_params *);
typedef void (*attn_init_fn)(fw_attn_params *);
typedef void (*gdn_init_fn)(fw_gdn_params *);
typedef fw_status (*gdn_decode_fn)(const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                   const fw_tensor *, const fw_tensor *, float *, int64_t,
                                   const int32_t *, const fw_tensor *, const fw_gdn_params *);
typedef fw_status (*gdn_layer_fn)(const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                  const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                  const fw_tensor *, const fw_gdn_batch *, const fw_gdn_caches *,
                                  const fw_tensor *, const fw_gdn_layer_params *);
typedef void (*layer_init_fn)(fw_gdn_layer_params *);
typedef fw_status (*conv1d_fn)(const fw_tensor *, const fw_tensor *, const fw_tensor *,
                               const int32_t *, int64_t, const fw_conv1d_state *,
                               const fw_conv1d_state *, const fw_tensor *, const fw_tensor *,
                               const fw_conv1d_params *);
typedef void (*conv_init_fn)(fw_conv1d_params *);
typedef fw_status (*gdn_decode_pool_fn)(const fw_tensor *, const fw_tensor *, const fw_tensor *,
                                        const fw_tensor *, const fw_tensor *, const fw_gdn_pool *,
                                        const fw_tensor *, const fw_gdn_params *);

/* the library's functions, set by init() */
struct library {
    attn_fwd_fn attn_fwd;
    attn_varlen_fn attn_varlen;
    attn_kvcache_fn attn_kvcache;
    gdn_decode_fn gdn_decode;
    attn_init_fn attn_params_init;
    gdn_init_fn gdn_params_init;
    gdn_layer_fn gdn_layer;
    layer_init_fn layer_params_init;
    gdn_decode_pool_fn gdn_decode_pool;
    conv1d_fn conv1d;
    conv_init_fn conv_params_init;
};

/* each function of struct library by its name in the library */
static const struct {
    const char *name;
    size_t offset;
} symbols[] = {
    {"fw_attn_fwd", offsetof(struct library, attn_fwd)},
    {"fw_attn_varlen_fwd", offsetof(struct library, attn_varlen)},
    {"fw_attn_kvcache_fwd", offsetof(struct library, attn_kvcache)},
    {"fw_gdn_decode", offsetof(struct library, gdn_decode)},
    {"fw_attn_params_init", offsetof(struct library, attn_params_init)},
    {"fw_gdn_params_init", offsetof(struct library, gdn_params_init)},
    {"fw_gdn_layer", offsetof(struct library, gdn_layer)},
    {"fw_gdn_layer_params_init", offsetof(struct library, layer_params_init)},
    {"fw_gdn_decode_pool", offsetof(struct library, gdn_decode_pool)},
    {"fw_conv1d_fwd", offsetof(struct library, conv1d)},
    {"fw_conv1d_params_init", offsetof(struct library, conv_params_init)},
};

static struct {
    struct library fw;
    PyObject *torch_tensor; /* torch.Tensor, once torch is imported */
    PyObject *to_dlpack;    /* torch._C._to_dlpack */
    PyObject *torch_empty;  /* torch.empty */
    PyObject *torch_f32;    /* torch.float32 */
    PyObject *torch_empty_like; /* torch.empty_like */
    PyObject *torch_grad_enabled; /* torch.is_grad_enabled */
    PyObject *np_ndarray, *np_empty, *np_float32;
    PyObject *s_dlpack, *s_requires_grad, *s_dtype, *s_silu, *s_swish;
    unsigned long long fast, fallback; /* calls taken and declined (under the GIL) */
} st;

/* The outcome of a step of the fast path: go on, decline (the Python path takes the call), or
 * a Python exception is set (only for a failure of Python itself, such as no memory). */
enum { OK = 0, DECLINE = 1, FAIL = -1 };

/* torch.Tensor and its helpers, looked up once torch is in sys.modules (never imported here) */
static void find_torch(void)
{
    if (st.torch_tensor)
        return;
    PyObject *mods = PyImport_GetModuleDict(); /* borrowed */
    PyObject *torch = PyDict_GetItemString(mods, "torch");
    if (!torch)
        return;
    PyObject *tensor = PyObject_GetAttrString(torch, "Tensor");
    PyObject *empty = PyObject_GetAttrString(torch, "empty");
    PyObject *f32 = PyObject_GetAttrString(torch, "float32");
    PyObject *like = PyObject_GetAttrString(torch, "empty_like");
    PyObject *grad = PyObject_GetAttrString(torch, "is_grad_enabled");
    PyObject *c = PyObject_GetAttrString(torch, "_C");
    PyObject *to = c ? PyObject_GetAttrString(c, "_to_dlpack") : NULL;
    Py_XDECREF(c);
    if (!tensor || !empty || !f32 || !like || !grad || !to) {
        Py_XDECREF(tensor);
        Py_XDECREF(empty);
        Py_XDECREF(f32);
        Py_XDECREF(like);
        Py_XDECREF(grad);
        Py_XDECREF(to);
        PyErr_Clear();
        return;
    }
    st.torch_grad_enabled = grad;
    st.torch_empty = empty;
    st.torch_f32 = f32;
    st.torch_empty_like = like;
    st.to_dlpack = to;
    st.torch_tensor = tensor;
}

static int is_torch(PyObject *o)
{
    if (!st.torch_tensor)
        find_torch();
    return st.torch_tensor && PyObject_IsInstance(o, st.torch_tensor) == 1;
}

static int is_numpy(PyObject *o) { return PyObject_IsInstance(o, st.np_ndarray) == 1; }

/* An array argument as an fw_tensor (no copy). dtype codes as fw_dtype, plus FW_INT32 for
 * index arrays. Declines what the Python path would copy, convert or refuse. */
#define FW_INT32 100

typedef struct {
    fw_tensor t;
    int dtype; /* fw_dtype, or FW_INT32 */
    int torch; /* a torch tensor (else numpy) */
} arr;

static int get_arr(PyObject *o, arr *a)
{
    PyObject *cap;
    if (is_torch(o)) {
        PyObject *g = PyObject_GetAttr(o, st.s_requires_grad);
        if (!g)
            return FAIL;
        const int grad = PyObject_IsTrue(g);
        Py_DECREF(g);
        if (grad < 0)
            return FAIL;
        if (grad) {
            /* under torch.no_grad() (a model's parameters at inference) it is an input as
             * any other; with grad mode on the Python path says what to do */
            PyObject *on = PyObject_CallNoArgs(st.torch_grad_enabled);
            if (!on)
                return FAIL;
            const int enabled = PyObject_IsTrue(on);
            Py_DECREF(on);
            if (enabled)
                return enabled < 0 ? FAIL : DECLINE;
        }
        cap = PyObject_CallFunctionObjArgs(st.to_dlpack, o, NULL);
        a->torch = 1;
    } else if (is_numpy(o)) {
        PyObject *m = PyObject_GetAttr(o, st.s_dlpack);
        cap = m ? PyObject_CallNoArgs(m) : NULL;
        Py_XDECREF(m);
        a->torch = 0;
    } else {
        return DECLINE;
    }
    if (!cap) { /* not exportable: read-only numpy, a dtype DLPack has no code for, ... */
        PyErr_Clear();
        return DECLINE;
    }
    const dl_managed *m = PyCapsule_GetPointer(cap, "dltensor");
    int rc = DECLINE;
    if (!m) {
        PyErr_Clear();
        Py_DECREF(cap);
        return DECLINE;
    }
    const dl_tensor *d = &m->dl_tensor;
    const dl_dtype dt = d->dtype;
    int code = -1;
    if (dt.lanes == 1) {
        if (dt.code == 2 && dt.bits == 32)
            code = FW_F32;
        else if (dt.code == 2 && dt.bits == 16)
            code = FW_F16;
        else if (dt.code == 4 && dt.bits == 16)
            code = FW_BF16;
        else if (dt.code == 0 && dt.bits == 32)
            code = FW_INT32;
    }
    if (d->device.device_type == 1 && code >= 0 && d->ndim >= 0 && d->ndim <= FW_MAX_DIMS) {
        fw_tensor *t = &a->t;
        memset(t, 0, sizeof *t);
        t->data = (char *)d->data + d->byte_offset;
        t->dtype = code == FW_INT32 ? FW_F32 : (fw_dtype)code;
        t->ndim = d->ndim;
        int64_t run = 1;
        rc = OK;
        for (int i = d->ndim - 1; i >= 0; i--) {
            t->shape[i] = d->shape[i];
            t->stride[i] = d->strides ? d->strides[i] : run;
            run *= d->shape[i];
            if (t->stride[i] < 0)
                rc = DECLINE; /* numpy would copy it */
            /* An empty array goes the Python way: its exporter's strides may not be the
             * array's (numpy exports an empty view whose byte strides are not whole
             * elements, which the Python path refuses to merge; found by the binding
             * fuzzer), and an empty call has nothing to gain here. */
            if (d->shape[i] == 0)
                rc = DECLINE;
        }
        a->dtype = code;
        /* the data stays alive with `o`, which the caller holds for the whole call */
    }
    Py_DECREF(cap); /* the exporter's destructor releases its export */
    return rc;
}

/* an array the call writes: numpy's export already refused read-only ones */
static int get_float(PyObject *o, arr *a, int ndim)
{
    int rc = get_arr(o, a);
    if (rc != OK)
        return rc;
    return a->dtype != FW_INT32 && a->t.ndim == ndim ? OK : DECLINE;
}

/* an int32 index array of `ndim` dims, unit stride in its last dim (or one entry) */
static int get_index(PyObject *o, arr *a, int ndim)
{
    int rc = get_arr(o, a);
    if (rc != OK)
        return rc;
    if (a->dtype != FW_INT32 || a->t.ndim != ndim)
        return DECLINE;
    return a->t.stride[ndim - 1] == 1 || a->t.shape[ndim - 1] <= 1 ? OK : DECLINE;
}

/* [b, s, rest...] as [b*s, rest...] without a copy, if the strides allow (else decline) */
static int merge01(fw_tensor *t)
{
    const int64_t b = t->shape[0], s = t->shape[1];
    int64_t lead;
    if (s == 1)
        lead = t->stride[0];
    else if (b == 1 || t->stride[0] == s * t->stride[1])
        lead = t->stride[1];
    else
        return DECLINE;
    t->shape[0] = b * s;
    t->stride[0] = lead;
    for (int i = 1; i + 1 < t->ndim; i++) {
        t->shape[i] = t->shape[i + 1];
        t->stride[i] = t->stride[i + 1];
    }
    t->ndim--;
    return OK;
}

/* drops dimension 1, of size 1 */
static void drop1(fw_tensor *t)
{
    for (int i = 1; i + 1 < t->ndim; i++) {
        t->shape[i] = t->shape[i + 1];
        t->stride[i] = t->stride[i + 1];
    }
    t->ndim--;
}

/* ------------------------------------------------------------------ outputs -- */
static size_t elem_size(fw_dtype dt) { return dt == FW_F32 ? 4 : 2; }

/* outputs up to this size are allocated here; larger ones by the Python path, which puts
 * them in numpy memory (huge pages; see _tensors._LARGE) */
#define SMALL_OUTPUT (4 << 20)

/* t is C-contiguous with exactly this shape (its one-element dims' strides aside) */
static int same_dense(const fw_tensor *t, const int64_t *shape, int ndim)
{
    if (t->ndim != ndim)
        return 0;
    int64_t run = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        if (t->shape[i] != shape[i] || (shape[i] > 1 && t->stride[i] != run))
            return 0;
        run *= shape[i];
    }
    return 1;
}

/* A new contiguous output of `like`'s family, with `like`'s dtype (or float32). `same`: like
 * is a contiguous array of this shape and dtype, so torch.empty_like(like) makes it (0.9 us,
 * against 1.1-1.9 us for torch.empty with a dtype). */
static PyObject *new_output(PyObject *like, int torch, const int64_t *shape, int ndim,
                            size_t elem, int f32, int same)
{
    size_t bytes = elem;
    for (int i = 0; i < ndim; i++)
        bytes *= (size_t)shape[i];
    if (bytes >= SMALL_OUTPUT)
        return Py_NewRef(Py_NotImplemented);
    PyObject *dims = PyTuple_New(ndim);
    if (!dims)
        return NULL;
    for (int i = 0; i < ndim; i++) {
        PyObject *n = PyLong_FromLongLong(shape[i]);
        if (!n) {
            Py_DECREF(dims);
            return NULL;
        }
        PyTuple_SetItem(dims, i, n);
    }
    PyObject *r = NULL;
    if (torch && same && !f32) {
        r = PyObject_CallFunctionObjArgs(st.torch_empty_like, like, NULL);
    } else if (torch) {
        /* torch.empty(*dims, dtype=...): faster than a shape tuple */
        PyObject *kw = PyDict_New(), *args = Py_NewRef(dims);
        PyObject *dtype = f32 ? Py_NewRef(st.torch_f32) : PyObject_GetAttr(like, st.s_dtype);
        if (kw && args && dtype && PyDict_SetItem(kw, st.s_dtype, dtype) == 0)
            r = PyObject_Call(st.torch_empty, args, kw);
        Py_XDECREF(dtype);
        Py_XDECREF(kw);
        Py_XDECREF(args);
    } else {
        PyObject *dtype = f32 ? Py_NewRef(st.np_float32) : PyObject_GetAttr(like, st.s_dtype);
        if (dtype)
            r = PyObject_CallFunctionObjArgs(st.np_empty, dims, dtype, NULL);
        Py_XDECREF(dtype);
    }
    Py_DECREF(dims);
    return r;
}

/* ---------------------------------------------------------------- arguments -- */
/* A float option as the library's float32 (None: `none`); declines a type other than float
 * or int, and values the Python path refuses or reports (0 where 0 means something else,
 * values that round to 0 or overflow float32) */
static int get_f32(PyObject *o, float none, int zero_ok, float *out)
{
    if (o == Py_None) {
        *out = none;
        return OK;
    }
    if (!PyFloat_CheckExact(o) && !PyLong_CheckExact(o))
        return DECLINE;
    const double x = PyFloat_AsDouble(o);
    if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return DECLINE;
    }
    const float f = (float)x;
    if (!(fabs(x) <= FLT_MAX) || (x != 0 && f == 0) || (x == 0 && !zero_ok))
        return DECLINE;
    *out = f;
    return OK;
}

/* one side of window_size: None or any negative value is unbounded (-1), as is anything from
 * 2^62 on; ints only (a float side goes the Python way) */
static int get_side(PyObject *o, int64_t *out)
{
    if (o == Py_None) {
        *out = -1;
        return OK;
    }
    if (!PyLong_Check(o))
        return DECLINE;
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (n == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return DECLINE;
    }
    *out = overflow || n < 0 || n >= ((long long)1 << 62) ? -1 : (int64_t)n;
    return OK;
}

static int get_window(PyObject *w, fw_attn_params *p)
{
    if (!PyTuple_Check(w) || PyTuple_Size(w) != 2)
        return DECLINE;
    int rc = get_side(PyTuple_GetItem(w, 0), &p->window_left);
    return rc == OK ? get_side(PyTuple_GetItem(w, 1), &p->window_right) : rc;
}

static int get_int(PyObject *o, long long lo, long long hi, long long *out)
{
    if (!PyLong_Check(o))
        return DECLINE;
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (n == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return DECLINE;
    }
    if (overflow || n < lo || n > hi)
        return DECLINE;
    *out = n;
    return OK;
}

/* scale, causal, window, softcap, threads of an attention call */
static int attn_params(PyObject *scale, PyObject *causal, PyObject *window, PyObject *softcap,
                       PyObject *threads, int64_t d, fw_attn_params *p)
{
    st.fw.attn_params_init(p);
    long long th;
    int rc = get_f32(scale, d > 0 ? (float)(1.0 / sqrt((double)d)) : 0.0f, 0, &p->scale);
    if (rc == OK)
        rc = get_f32(softcap, 0.0f, 1, &p->softcap);
    if (rc == OK)
        rc = get_window(window, p);
    if (rc == OK)
        rc = get_int(threads, 0, INT32_MAX, &th);
    if (rc != OK)
        return rc;
    p->threads = (int32_t)th;
    const int c = PyObject_IsTrue(causal);
    if (c < 0) {
        PyErr_Clear();
        return DECLINE;
    }
    p->causal = c;
    return OK;
}

/* attention sinks [hq] (None: none) into p: f32, bf16 or f16, any stride, read in place (the
 * library checks the length); another dtype goes the Python way, which converts it */
static int get_sinks(PyObject *o, arr *s, fw_attn_params *p)
{
    if (o == Py_None)
        return OK;
    int rc = get_arr(o, s);
    if (rc != OK)
        return rc;
    if (s->dtype == FW_INT32 || s->t.ndim != 1)
        return DECLINE;
    p->sinks = &s->t;
    return OK;
}

/* The end of a fast call: NotImplemented (or the Python error) where it declined, else out,
 * or (out, lse) when lse is not NULL. Takes over the references to out and lse. */
static PyObject *finish(int rc, PyObject *out, PyObject *lse)
{
    if (rc != OK) {
        Py_XDECREF(out);
        Py_XDECREF(lse);
        if (rc == FAIL)
            return NULL;
        st.fallback++;
        return Py_NewRef(Py_NotImplemented);
    }
    st.fast++;
    if (!lse)
        return out;
    PyObject *r = PyTuple_Pack(2, out, lse);
    Py_DECREF(out);
    Py_DECREF(lse);
    return r;
}

#define TRY(x)                  \
    do {                        \
        int rc_ = (x);          \
        if (rc_ != OK) {        \
            rc = rc_;           \
            goto done;          \
        }                       \
    } while (0)

/* An output: the caller's (kept as is, validated by the library), or a new one */
static int get_out(PyObject *given, PyObject *like, int torch, const int64_t *shape, int ndim,
                   size_t elem, int f32, int same, PyObject **obj, arr *a)
{
    if (given != Py_None) {
        *obj = Py_NewRef(given);
        return get_float(given, a, ndim);
    }
    *obj = new_output(like, torch, shape, ndim, elem, f32, same);
    if (!*obj)
        return FAIL;
    if (*obj == Py_NotImplemented)
        return DECLINE;
    return get_float(*obj, a, ndim);
}

/* ------------------------------------------------------------ attention calls -- */

/* flash_attn_func(q, k, v, scale, causal, window, softcap, threads, out, want_lse, sinks)
 *   -> out, or (out, lse) with want_lse; q/k/v [b, s, h, d] */
static PyObject *attn_func(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    (void)self;
    if (!nargs(n, 11, "attn_func"))
        return NULL;
    arr q, k, v, o, l, sk;
    PyObject *out = NULL, *lse = NULL;
    fw_attn_params p;
    int rc = OK;
    const int want_lse = PyObject_IsTrue(a[9]) == 1;
    TRY(get_float(a[0], &q, 4));
    TRY(get_float(a[1], &k, 4));
    TRY(get_float(a[2], &v, 4));
    if (k.torch != q.torch || v.torch != q.torch)
        TRY(DECLINE);
    const int64_t b = q.t.shape[0], sq = q.t.shape[1], hq = q.t.shape[2], dv = v.t.shape[3];
    TRY(attn_params(a[3], a[4], a[5], a[6], a[7], q.t.shape[3], &p));
    TRY(get_sinks(a[10], &sk, &p));
    const int64_t os[4] = {b, sq, hq, dv}, ls[3] = {b, hq, sq};
    TRY(get_out(a[8], a[0], q.torch, os, 4, elem_size(q.t.dtype), 0, same_dense(&q.t, os, 4), &out,
                &o));
    if (want_lse)
        TRY(get_out(Py_None, a[0], q.torch, ls, 3, 4, 1, 0, &lse, &l));
    fw_status s;
    Py_BEGIN_ALLOW_THREADS
    s = st.fw.attn_fwd(&q.t, &k.t, &v.t, &o.t, want_lse ? &l.t : NULL, &p);
    Py_END_ALLOW_THREADS
    if (s != FW_OK)
        TRY(DECLINE);
done:
    return finish(rc, out, lse);
}

/* the longest sequence of int32 offsets cu[0..n] (0 if not monotone: the library refuses) */
static int64_t longest(const fw_tensor *cu)
{
    const int32_t *c = cu->data;
    int64_t m = 0;
    for (int64_t i = 0; i + 1 < cu->shape[0]; i++)
        if (c[i + 1] - (int64_t)c[i] > m)
            m = c[i + 1] - (int64_t)c[i];
    return m;
}

/* flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap,
 *   threads, out, want_lse, sinks) -> out or (out, lse); q/k/v [total, h, d] */
static PyObject *attn_varlen(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    (void)self;
    if (!nargs(n, 15, "attn_varlen"))
        return NULL;
    arr q, k, v, cq, ck, o, l, sk;
    PyObject *out = NULL, *lse = NULL;
    fw_attn_params p;
    long long maxq, maxk;
    int rc = OK;
    const int want_lse = PyObject_IsTrue(a[13]) == 1;
    TRY(get_float(a[0], &q, 3));
    TRY(get_float(a[1], &k, 3));
    TRY(get_float(a[2], &v, 3));
    if (k.torch != q.torch || v.torch != q.torch)
        TRY(DECLINE);
    TRY(get_index(a[3], &cq, 1));
    TRY(get_index(a[4], &ck, 1));
    if (cq.t.shape[0] != ck.t.shape[0] || cq.t.shape[0] < 1)
        TRY(DECLINE);
    TRY(get_int(a[5], 0, INT64_MAX, &maxq));
    TRY(get_int(a[6], 0, INT64_MAX, &maxk));
    if (maxq < longest(&cq.t) || maxk < longest(&ck.t))
        TRY(DECLINE);
    const int64_t tq = q.t.shape[0], hq = q.t.shape[1], dv = v.t.shape[2];
    TRY(attn_params(a[7], a[8], a[9], a[10], a[11], q.t.shape[2], &p));
    TRY(get_sinks(a[14], &sk, &p));
    const int64_t os[3] = {tq, hq, dv}, ls[2] = {hq, tq};
    TRY(get_out(a[12], a[0], q.torch, os, 3, elem_size(q.t.dtype), 0, same_dense(&q.t, os, 3), &out,
                &o));
    if (want_lse)
        TRY(get_out(Py_None, a[0], q.torch, ls, 2, 4, 1, 0, &lse, &l));
    fw_status s;
    Py_BEGIN_ALLOW_THREADS
    s = st.fw.attn_varlen(&q.t, &k.t, &v.t, cq.t.data, ck.t.data, cq.t.shape[0] - 1, &o.t,
                       want_lse ? &l.t : NULL, &p);
    Py_END_ALLOW_THREADS
    if (s != FW_OK)
        TRY(DECLINE);
done:
    return finish(rc, out, lse);
}

/* sequences whose offsets or lengths live on the stack; more take the Python path */
#define MAX_BATCH 4096

/* flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale,
 *   causal, window, softcap, threads, out, layout, sinks) -> out; q [b, sq, hq, d], no lse,
 *   not packed; layout: fw_kv_layout */
static PyObject *attn_kvcache(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    (void)self;
    if (!nargs(n, 15, "attn_kvcache"))
        return NULL;
    arr q, kc, vc, kn, vn, sl, bt, o, sk;
    PyObject *out = NULL;
    fw_attn_params p;
    fw_kv_cache cache;
    int32_t cu[MAX_BATCH + 1], lens[MAX_BATCH];
    int rc = OK;
    const int append = a[3] != Py_None;
    if (append != (a[4] != Py_None))
        TRY(DECLINE);
    TRY(get_float(a[0], &q, 4));
    TRY(get_float(a[1], &kc, 4));
    TRY(get_float(a[2], &vc, 4));
    if (kc.torch != q.torch || vc.torch != q.torch)
        TRY(DECLINE);
    const int64_t b = q.t.shape[0], sq = q.t.shape[1], hq = q.t.shape[2], dv = vc.t.shape[3];
    if (b > MAX_BATCH || b * sq > INT32_MAX)
        TRY(DECLINE);
    memset(&cache, 0, sizeof cache);
    cache.k = kc.t;
    cache.v = vc.t;
    long long layout;
    TRY(get_int(a[13], 0, 1, &layout));
    cache.layout = (int32_t)layout;
    /* cache_seqlens: an int for every sequence, or [b] int32 */
    if (PyLong_Check(a[5])) {
        long long len;
        TRY(get_int(a[5], INT32_MIN, INT32_MAX, &len));
        for (int64_t i = 0; i < b; i++)
            lens[i] = (int32_t)len;
        cache.seqlens = lens;
    } else {
        TRY(get_index(a[5], &sl, 1));
        if (sl.t.shape[0] != b)
            TRY(DECLINE);
        cache.seqlens = sl.t.data;
    }
    if (a[6] != Py_None) {
        TRY(get_index(a[6], &bt, 2));
        if (bt.t.shape[0] != b || bt.t.shape[0] * bt.t.shape[1] == 0)
            TRY(DECLINE);
        cache.block_table = bt.t.data;
        cache.max_pages = bt.t.shape[1];
        cache.block_table_stride = b > 1 ? bt.t.stride[0] : bt.t.shape[1];
    }
    if (append) {
        TRY(get_float(a[3], &kn, 4));
        TRY(get_float(a[4], &vn, 4));
        if (kn.t.shape[1] != sq || vn.t.shape[1] != sq)
            TRY(DECLINE);
        TRY(merge01(&kn.t));
        TRY(merge01(&vn.t));
    }
    for (int64_t i = 0; i <= b; i++)
        cu[i] = (int32_t)(i * sq);
    TRY(attn_params(a[7], a[8], a[9], a[10], a[11], q.t.shape[3], &p));
    TRY(get_sinks(a[14], &sk, &p));
    const int64_t os[4] = {b, sq, hq, dv};
    const int same = same_dense(&q.t, os, 4);
    TRY(merge01(&q.t));
    TRY(get_out(a[12], a[0], q.torch, os, 4, elem_size(q.t.dtype), 0, same, &out, &o));
    TRY(merge01(&o.t));
    fw_status s;
    Py_BEGIN_ALLOW_THREADS
    s = st.fw.attn_kvcache(&q.t, append ? &kn.t : NULL, append ? &vn.t : NULL, cu, b, &cache, &o.t,
                        NULL, &p);
    Py_END_ALLOW_THREADS
    if (s != FW_OK)
        TRY(DECLINE);
done:
    return finish(rc, out, NULL);
}

/* ------------------------------------------------------------- GDN decode -- */

/* An IEEE half's value as float32 (exact; a NaN keeps its payload, as numpy's conversion). */
static float half_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t bits;
    float f;
    if (e == 0x1f) {
        bits = sign | 0x7f800000u | m << 13;
    } else if (e) {
        bits = sign | (e + 112) << 23 | m << 13;
    } else {
        f = (float)m * 0x1p-24f; /* zero or a subnormal half: a normal float */
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* the most elements of a gate operand converted here (4 MiB of float32) */
#define GATE_MAX ((int64_t)1 << 20)

/* A gate operand (g or beta) in float32 for the library: float32 as it lies; bf16 or f16
 * converted (exactly) into a new contiguous array, *buf (PyMem_Free it), as the Python path's
 * to_numpy_f32 does. One to four dims. */
static int gate_f32(arr *x, float **buf)
{
    fw_tensor *t = &x->t;
    if (x->dtype == FW_F32)
        return OK;
    if (x->dtype != FW_BF16 && x->dtype != FW_F16)
        return DECLINE;
    int64_t shape[4] = {1, 1, 1, 1}, stride[4] = {0, 0, 0, 0}, count = 1;
    for (int i = 0; i < t->ndim; i++) {
        shape[4 - t->ndim + i] = t->shape[i];
        stride[4 - t->ndim + i] = t->stride[i];
        if (t->shape[i] > GATE_MAX || (count *= t->shape[i]) > GATE_MAX)
            return DECLINE; /* a huge (zero-stride) view: the Python path's */
    }
    float *f = *buf = PyMem_Malloc((size_t)(count > 0 ? count : 1) * sizeof(float));
    if (!f) {
        PyErr_NoMemory();
        return FAIL;
    }
    const uint16_t *h = t->data;
    for (int64_t a = 0; a < shape[0]; a++)
        for (int64_t b = 0; b < shape[1]; b++)
            for (int64_t c = 0; c < shape[2]; c++)
                for (int64_t d = 0; d < shape[3]; d++) {
                    const uint16_t e = h[a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3]];
                    if (x->dtype == FW_F16) {
                        *f++ = half_f32(e);
                    } else {
                        const uint32_t bits = (uint32_t)e << 16;
                        memcpy(f++, &bits, 4);
                    }
                }
    t->data = *buf;
    t->dtype = FW_F32;
    for (int64_t i = t->ndim - 1, run = 1; i >= 0; i--) {
        t->stride[i] = run;
        run *= t->shape[i];
    }
    x->dtype = FW_F32;
    return OK;
}

/* gated_delta_rule_decode(q, k, v, g, beta, state, state_indices, scale, l2norm, threads,
 *   out) -> out (v's shape); q/k [N, H, K] or [N, 1, H, K], v [N, HV, V] or [N, 1, HV, V],
 *   g/beta [N, HV] or [N, 1, HV] float32, bf16 or f16 (KDA's g [N, HV, K]), state [slots,
 *   HV, K, V] contiguous float32 or bf16 */
static PyObject *gdn_decode(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    (void)self;
    if (!nargs(n, 11, "gdn_decode"))
        return NULL;
    arr q, k, v, g, beta, state, idx, o;
    PyObject *out = NULL;
    float *conv[2] = {NULL, NULL};
    fw_gdn_params p;
    int32_t order[MAX_BATCH];
    long long th;
    int rc = OK;
    TRY(get_arr(a[2], &v));
    const int squeeze = v.t.ndim == 4, vdense = same_dense(&v.t, v.t.shape, v.t.ndim);
    const int nd = squeeze ? 4 : 3;
    TRY(get_float(a[0], &q, nd));
    TRY(get_float(a[1], &k, nd));
    if (v.dtype == FW_INT32 || v.t.ndim != nd || q.torch != v.torch || k.torch != v.torch)
        TRY(DECLINE);
    if (squeeze) {
        if (q.t.shape[1] != 1 || k.t.shape[1] != 1 || v.t.shape[1] != 1)
            TRY(DECLINE);
        drop1(&q.t);
        drop1(&k.t);
        drop1(&v.t);
    }
    const int64_t N = v.t.shape[0], HV = v.t.shape[1], V = v.t.shape[2], K = q.t.shape[2];
    if (N > MAX_BATCH)
        TRY(DECLINE);
    TRY(get_arr(a[3], &g));
    TRY(get_arr(a[4], &beta));
    arr *gb[2] = {&g, &beta};
    for (int i = 0; i < 2; i++) {
        fw_tensor *t = &gb[i]->t;
        /* KDA's g [N, HV, K]: a decay per key channel, passed as it is ([N, 1, 1] with HV =
         * K = 1 is the same either way) */
        const int kda = i == 0 && t->ndim == 3 && t->shape[0] == N && t->shape[1] == HV &&
                        t->shape[2] == K && !(HV == 1 && K == 1);
        if (!kda && (t->ndim < 2 || t->ndim > 3 || t->shape[0] != N ||
                     t->shape[t->ndim - 1] != HV || (t->ndim == 3 && t->shape[1] != 1)))
            TRY(DECLINE);
        if (!kda && t->ndim == 3)
            drop1(t);
        /* bf16 or f16 (a bf16 model's beta): to float32 here, as the Python path would */
        TRY(gate_f32(gb[i], &conv[i]));
    }
    /* the state: a contiguous float32 or bf16 slot array, used in place (bf16: as a pool) */
    TRY(get_float(a[5], &state, 4));
    const fw_tensor *S = &state.t;
    if ((state.dtype != FW_F32 && state.dtype != FW_BF16) || S->shape[1] != HV || S->shape[2] != K ||
        S->shape[3] != V || S->stride[3] != 1 || S->stride[2] != V || S->stride[1] != K * V ||
        S->stride[0] != HV * K * V)
        TRY(DECLINE);
    const int32_t *slots = order;
    if (a[6] == Py_None) {
        for (int64_t i = 0; i < N; i++)
            order[i] = (int32_t)i;
    } else {
        TRY(get_index(a[6], &idx, 1));
        if (idx.t.shape[0] != N)
            TRY(DECLINE);
        slots = idx.t.data;
    }
    st.fw.gdn_params_init(&p);
    TRY(get_f32(a[7], K > 0 ? (float)(1.0 / sqrt((double)K)) : 0.0f, 0, &p.scale));
    const int l2 = PyObject_IsTrue(a[8]);
    if (l2 < 0) {
        PyErr_Clear();
        TRY(DECLINE);
    }
    p.l2norm_qk = l2;
    TRY(get_int(a[9], 0, INT32_MAX, &th));
    p.threads = (int32_t)th;
    const int64_t os[4] = {N, 1, HV, V}, os3[3] = {N, HV, V};
    TRY(get_out(a[10], a[2], v.torch, squeeze ? os : os3, nd, elem_size(v.t.dtype), 0, vdense, &out,
                &o));
    if (squeeze) {
        if (o.t.shape[1] != 1)
            TRY(DECLINE);
        drop1(&o.t);
    }
    for (int64_t i = 0; i < N && state.dtype == FW_BF16; i++)
        if (slots[i] < 0) /* a pool's negative index is no slot: the Python path refuses it */
            TRY(DECLINE);
    fw_status s;
    Py_BEGIN_ALLOW_THREADS
    if (state.dtype == FW_BF16) {
        const fw_gdn_pool pool = {state.t.data, S->shape[0], HV * K * V, slots, slots, FW_BF16};
        s = st.fw.gdn_decode_pool(&q.t, &k.t, &v.t, &g.t, &beta.t, &pool, &o.t, &p);
    } else {
        s = st.fw.gdn_decode(&q.t, &k.t, &v.t, &g.t, &beta.t, state.t.data, S->shape[0], slots,
                             &o.t, &p);
    }
    Py_END_ALLOW_THREADS
    if (s != FW_OK)
        TRY(DECLINE);
done:
    PyMem_Free(conv[0]);
    PyMem_Free(conv[1]);
    return finish(rc, out, NULL);
}

/* -------------------------------------------------------- GDN serving layer -- */

/* An int32 index vector of n entries (unit stride, or one entry) */
static int get_indices(PyObject *o, int64_t n, const int32_t **out)
{
    arr x;
    int rc = get_index(o, &x, 1);
    if (rc != OK)
        return rc;
    if (x.t.shape[0] != n)
        return DECLINE;
    *out = x.t.data;
    return OK;
}

/* gdn_layer(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
 *   query_start_loc, state_indices, distribution, seq_lens, read_state_indices, n_kq, n_v,
 *   d_k, d_v, kernel_size, l2norm_eps, zero_initialize_out, threads, out) -> out:
 *   fused_conv1d_gdn without speculative windows, isa or precision, with out given;
 *   recurrent_state a float32 slot array [slots, n_v, d_k, d_v], each slot contiguous. The
 *   library checks the rest. */
static PyObject *gdn_layer(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    (void)self;
    if (!nargs(n, 23, "gdn_layer"))
        return NULL;
    arr qkv, b, ga, conv, rec, w, cb, alog, dtb, qsl, o;
    PyObject *out = NULL;
    fw_gdn_batch batch;
    fw_gdn_caches caches;
    fw_gdn_layer_params p;
    long long nkq, nv, dk, dv, ks, th;
    int rc = OK;
    /* zero_initialize_out's truth value first, as the Python call's: one that raises (a numpy
     * array) raises whatever else the call holds */
    const int zt = PyObject_IsTrue(a[20]);
    if (zt < 0)
        TRY(FAIL);
    if (a[22] == Py_None)
        TRY(DECLINE);
    out = Py_NewRef(a[22]);
    TRY(get_float(a[0], &qkv, 2));
    TRY(get_float(a[1], &b, 2));
    TRY(get_float(a[2], &ga, 2));
    TRY(get_arr(a[3], &conv));
    TRY(get_float(a[4], &rec, 4));
    TRY(get_arr(a[5], &w));
    if (w.dtype == FW_INT32 || conv.dtype == FW_INT32 || w.t.ndim < 2 || w.t.ndim > 3)
        TRY(DECLINE);
    if (w.t.ndim == 3) { /* [dim, 1, K] */
        if (w.t.shape[1] != 1)
            TRY(DECLINE);
        drop1(&w.t);
    }
    if (a[6] != Py_None)
        TRY(get_float(a[6], &cb, 1));
    TRY(get_float(a[7], &alog, 1));
    TRY(get_float(a[8], &dtb, 1));
    TRY(get_int(a[14], 1, INT32_MAX, &nkq));
    TRY(get_int(a[15], 1, INT32_MAX, &nv));
    TRY(get_int(a[16], 1, INT32_MAX, &dk));
    TRY(get_int(a[17], 1, INT32_MAX, &dv));
    TRY(get_int(a[18], 1, INT32_MAX, &ks));
    /* GDN's a [T, n_v] (the library would read [T, n_v d_k] as KDA's) and K = kernel_size */
    if (ga.t.shape[1] != nv || w.t.shape[1] != ks)
        TRY(DECLINE);
    /* the state pool as _pool_slots takes it: float32 or bf16, each slot contiguous */
    const fw_tensor *R = &rec.t;
    if ((rec.dtype != FW_F32 && rec.dtype != FW_BF16) || R->shape[1] != nv || R->shape[2] != dk ||
        R->shape[3] != dv || R->stride[3] != 1 || R->stride[2] != dv || R->stride[1] != dk * dv ||
        (R->shape[0] > 1 && R->stride[0] < nv * dk * dv))
        TRY(DECLINE);
    memset(&batch, 0, sizeof batch);
    TRY(get_index(a[9], &qsl, 1)); /* query_start_loc: n_seqs + 1 entries */
    batch.n_seqs = qsl.t.shape[0] - 1;
    if (batch.n_seqs < 0)
        TRY(DECLINE);
    batch.query_start_loc = qsl.t.data;
    TRY(get_indices(a[10], batch.n_seqs, &batch.state_indices));
    TRY(get_indices(a[12], batch.n_seqs, &batch.seq_lens));
    if (a[13] != Py_None)
        TRY(get_indices(a[13], batch.n_seqs, &batch.read_state_indices));
    const int32_t *d3;
    TRY(get_indices(a[11], 3, &d3));
    batch.decode_end = d3[0];
    batch.prefill_end = d3[1];
    batch.mixed_end = d3[2];
    st.fw.layer_params_init(&p);
    p.n_kq = (int32_t)nkq;
    p.n_v = (int32_t)nv;
    p.d_k = (int32_t)dk;
    p.d_v = (int32_t)dv;
    TRY(get_f32(a[19], 0.0f, 0, &p.l2norm_eps));
    p.zero_tail = zt;
    TRY(get_int(a[21], 0, INT32_MAX, &th));
    p.threads = (int32_t)th;
    TRY(get_float(out, &o, 2));
    caches.conv = conv.t;
    caches.recurrent = R->data;
    caches.recurrent_stride = R->shape[0] > 1 ? R->stride[0] : nv * dk * dv;
    caches.recurrent_dtype = (fw_dtype)rec.dtype;
    fw_status s;
    Py_BEGIN_ALLOW_THREADS
    s = st.fw.gdn_layer(&qkv.t, &b.t, &ga.t, &w.t, a[6] == Py_None ? NULL : &cb.t, &alog.t, &dtb.t,
                     &batch, &caches, &o.t, &p);
    Py_END_ALLOW_THREADS
    if (s != FW_OK)
        TRY(DECLINE);
done:
    return finish(rc, out, NULL);
}

/* ------------------------------------------------------------- conv update -- */

/* [a, b, c] as [a, c, b] (no copy) */
static void swap12(fw_tensor *t)
{
    const int64_t n = t->shape[1], s = t->stride[1];
    t->shape[1] = t->shape[2];
    t->stride[1] = t->stride[2];
    t->shape[2] = n;
    t->stride[2] = s;
}

/* [a, b] as [a, b, 1] */
static void add_last(fw_tensor *t)
{
    t->shape[2] = 1;
    t->stride[2] = 1;
    t->ndim = 3;
}

/* causal_conv1d_update(x, conv_state, weight, bias, activation, cache_seqlens,
 *   conv_state_indices, threads, out) -> out: x [B, D] or [B, D, L]; conv_state [slots, D, S]
 *   (updated in place); weight [D, W] or [D, 1, W]; bias [D] or None; activation None,
 *   "silu" or "swish"; cache_seqlens and conv_state_indices None or int32 [B]. As conv.py's
 *   Python path: fw_conv1d_fwd on [B, L, D] views, the state read at cache_seqlens and
 *   written at cache_seqlens + L (mod S). */
static PyObject *conv_update(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    (void)self;
    if (!nargs(n, 9, "conv_update"))
        return NULL;
    arr x, cs, w, b, o;
    PyObject *out = NULL;
    fw_conv1d_params p;
    const int32_t *idx = NULL, *roff = NULL;
    int32_t woff[MAX_BATCH];
    long long th;
    int rc = OK;
    TRY(get_arr(a[0], &x));
    const int nd = x.t.ndim;
    if (x.dtype == FW_INT32 || (nd != 2 && nd != 3))
        TRY(DECLINE);
    int64_t xs[3] = {x.t.shape[0], x.t.shape[1], nd == 3 ? x.t.shape[2] : 1};
    const int xdense = same_dense(&x.t, xs, nd);
    if (nd == 2)
        add_last(&x.t);
    const int64_t B = xs[0], D = xs[1], L = xs[2];
    if (B > MAX_BATCH)
        TRY(DECLINE);
    TRY(get_float(a[1], &cs, 3));
    if (cs.t.shape[1] != D)
        TRY(DECLINE);
    const int64_t S = cs.t.shape[2];
    TRY(get_arr(a[2], &w));
    if (w.dtype == FW_INT32)
        TRY(DECLINE);
    if (w.t.ndim == 3 && w.t.shape[1] == 1)
        drop1(&w.t);
    if (w.t.ndim != 2 || w.t.shape[0] != D)
        TRY(DECLINE);
    if (a[3] != Py_None) {
        TRY(get_arr(a[3], &b));
        if (b.dtype == FW_INT32 || b.t.ndim != 1 || b.t.shape[0] != D)
            TRY(DECLINE);
    }
    st.fw.conv_params_init(&p);
    if (a[4] == Py_None)
        p.activation = FW_ACT_NONE;
    /* (two strs: PyUnicode_Compare cannot fail) */
    else if (PyUnicode_Check(a[4]) && (PyUnicode_Compare(a[4], st.s_silu) == 0 ||
                                       PyUnicode_Compare(a[4], st.s_swish) == 0))
        p.activation = FW_ACT_SILU;
    else
        TRY(DECLINE);
    if (a[6] != Py_None)
        TRY(get_indices(a[6], B, &idx));
    else if (cs.t.shape[0] < B)
        TRY(DECLINE);
    if (a[5] != Py_None) {
        TRY(get_indices(a[5], B, &roff));
        const int64_t m = S > 1 ? S : 1;
        for (int64_t i = 0; i < B; i++) /* (roff + L) mod S, floored as numpy's % */
            woff[i] = (int32_t)((((int64_t)roff[i] + L) % m + m) % m);
    }
    TRY(get_int(a[7], 0, INT32_MAX, &th));
    p.threads = (int32_t)th;
    TRY(get_out(a[8], a[0], x.torch, xs, nd, elem_size(x.t.dtype), 0, xdense, &out, &o));
    if (nd == 2)
        add_last(&o.t);
    if (o.t.shape[0] != B || o.t.shape[1] != D || o.t.shape[2] != L)
        TRY(DECLINE);
    swap12(&x.t);
    swap12(&o.t);
    swap12(&cs.t);
    const fw_conv1d_state in = {cs.t, idx, roff}, fin = {cs.t, idx, roff ? woff : NULL};
    fw_status s;
    Py_BEGIN_ALLOW_THREADS
    s = st.fw.conv1d(&x.t, &w.t, a[3] != Py_None ? &b.t : NULL, NULL, B, &in, &fin, NULL, &o.t, &p);
    Py_END_ALLOW_THREADS
    if (s != FW_OK)
        TRY(DECLINE);
done:
    return finish(rc, out, NULL);
}

/* -------------------------------------------------------------------- module -- */

/* init(abi, {name: address}): the library's ABI version and the addresses of its functions,
 * from the ctypes binding (the functions python/flywheel/_calls.py's fast paths name; every
 * one of `symbols` must be there). ImportError when the ABI differs from the header this was
 * compiled with or a function is missing. */
static PyObject *init(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    (void)self;
    if (!nargs(n, 2, "init"))
        return NULL;
    const long abi = PyLong_AsLong(a[0]);
    if (abi == -1 && PyErr_Occurred())
        return NULL;
    if (abi != FW_ABI_VERSION) {
        PyErr_Format(PyExc_ImportError,
                     "flywheel._fwext was compiled for ABI version %d, the library has %ld: "
                     "rebuild both from one source tree",
                     FW_ABI_VERSION, abi);
        return NULL;
    }
    if (!PyDict_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "init: the addresses must be a dict {name: address}");
        return NULL;
    }
    struct library fw;
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        PyObject *addr = PyDict_GetItemString(a[1], symbols[i].name); /* borrowed */
        if (!addr) {
            PyErr_Format(PyExc_ImportError, "flywheel._fwext needs %s, which the binding did "
                         "not hand it (python/flywheel/_calls.py names the fast paths' "
                         "functions)", symbols[i].name);
            return NULL;
        }
        void *f = PyLong_AsVoidPtr(addr);
        if (!f) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "init: a NULL address for %s", symbols[i].name);
            return NULL;
        }
        /* POSIX: a function's address from dlsym (ctypes) converts back to its pointer type */
        memcpy((char *)&fw + symbols[i].offset, &f, sizeof f);
    }
    st.fw = fw;
    Py_RETURN_NONE;
}

/* stats() -> (calls the fast path ran, calls it declined) */
static PyObject *stats(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return Py_BuildValue("(KK)", st.fast, st.fallback);
}

static PyMethodDef methods[] = {
    {"init", (PyCFunction)(void (*)(void))init, METH_FASTCALL, "the library's functions"},
    {"attn_func", (PyCFunction)(void (*)(void))attn_func, METH_FASTCALL, "flash_attn_func"},
    {"attn_varlen", (PyCFunction)(void (*)(void))attn_varlen, METH_FASTCALL,
     "flash_attn_varlen_func"},
    {"attn_kvcache", (PyCFunction)(void (*)(void))attn_kvcache, METH_FASTCALL,
     "flash_attn_with_kvcache"},
    {"gdn_decode", (PyCFunction)(void (*)(void))gdn_decode, METH_FASTCALL,
     "gated_delta_rule_decode"},
    {"gdn_layer", (PyCFunction)(void (*)(void))gdn_layer, METH_FASTCALL, "fused_conv1d_gdn"},
    {"conv_update", (PyCFunction)(void (*)(void))conv_update, METH_FASTCALL,
     "causal_conv1d_update"},
    {"stats", stats, METH_NOARGS, "(fast calls, declined calls)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "flywheel._fwext", "the compiled fast path of the flywheel binding",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fwext(void)
{
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np)
        return NULL;
    st.np_ndarray = PyObject_GetAttrString(np, "ndarray");
    st.np_empty = PyObject_GetAttrString(np, "empty");
    st.np_float32 = PyObject_GetAttrString(np, "float32");
    Py_DECREF(np);
    st.s_dlpack = PyUnicode_InternFromString("__dlpack__");
    st.s_requires_grad = PyUnicode_InternFromString("requires_grad");
    st.s_dtype = PyUnicode_InternFromString("dtype");
    st.s_silu = PyUnicode_InternFromString("silu");
    st.s_swish = PyUnicode_InternFromString("swish");
    if (!st.np_ndarray || !st.np_empty || !st.np_float32 || !st.s_dlpack ||
        !st.s_requires_grad || !st.s_dtype || !st.s_silu || !st.s_swish)
        return NULL;
    return PyModule_Create(&module);
}
