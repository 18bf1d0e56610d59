/* core.c: status codes and messages, tensor descriptors and the checks every entry point
 * shares (tensors, cu_seqlens, threads), scalar dtype conversions. */
#include <stdlib.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include "internal.h"

static _Thread_local char fw_errbuf[512];

fw_status fw_fail(fw_status s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fw_errbuf, sizeof fw_errbuf, fmt, ap);
    va_end(ap);
    return s;
}

void fw_clear_error(void) { fw_errbuf[0] = 0; }

const char *fw_last_error(void) { return fw_errbuf; }

#define FW_STR_(x) #x
#define FW_STR(x) FW_STR_(x)

const char *fw_version(void)
{
    return FW_STR(FW_VERSION_MAJOR) "." FW_STR(FW_VERSION_MINOR) "." FW_STR(FW_VERSION_PATCH);
}

int fw_abi_version(void) { return FW_ABI_VERSION; }

const char *fw_status_string(fw_status s)
{
    switch (s) {
    case FW_OK: return "FW_OK: success";
    case FW_ERR_NULL: return "FW_ERR_NULL: a required pointer is NULL";
    case FW_ERR_DTYPE: return "FW_ERR_DTYPE: unsupported dtype";
    case FW_ERR_SHAPE: return "FW_ERR_SHAPE: shapes do not fit together";
    case FW_ERR_STRIDE: return "FW_ERR_STRIDE: invalid strides";
    case FW_ERR_ARG: return "FW_ERR_ARG: parameter out of range";
    case FW_ERR_SEQLENS: return "FW_ERR_SEQLENS: invalid cumulative sequence lengths";
    case FW_ERR_OVERFLOW: return "FW_ERR_OVERFLOW: sizes overflow 64-bit arithmetic";
    case FW_ERR_NOMEM: return "FW_ERR_NOMEM: out of memory";
    case FW_ERR_WORKSPACE: return "FW_ERR_WORKSPACE: workspace too small";
    case FW_ERR_UNSUPPORTED: return "FW_ERR_UNSUPPORTED: kernel table not available";
    case FW_ERR_INDEX: return "FW_ERR_INDEX: page index out of range or written twice";
    }
    return "FW_ERR_UNKNOWN: not a fw_status value";
}

size_t fw_dtype_size(fw_dtype dt)
{
    switch (dt) {
    case FW_F32: return 4;
    case FW_BF16: case FW_F16: return 2;
    case FW_F64: return 8;
    case FW_F8E4M3: case FW_F8E5M2: return 1;
    }
    return 0;
}

const char *fw_dtype_name(fw_dtype dt)
{
    switch (dt) {
    case FW_F32: return "f32";
    case FW_BF16: return "bf16";
    case FW_F16: return "f16";
    case FW_F64: return "f64";
    case FW_F8E4M3: return "f8e4m3";
    case FW_F8E5M2: return "f8e5m2";
    }
    return "unknown";
}

fw_tensor fw_tensor_contiguous(void *data, fw_dtype dtype, int32_t ndim, const int64_t *shape)
{
    fw_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dtype;
    t.ndim = shape ? ndim : -1;
    if (!shape || ndim < 0 || ndim > FW_MAX_DIMS)
        return t; /* every entry point refuses the rank */
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t.shape[i] = shape[i];
        t.stride[i] = s;
        /* past int64 the stride saturates, and the entry points report the overflow */
        if (__builtin_mul_overflow(s, shape[i] > 0 ? shape[i] : 1, &s))
            s = INT64_MAX;
    }
    return t;
}

fw_status fw_check_tensor(const fw_tensor *t, const char *what, int ndim, unsigned dtypes)
{
    if (!t)
        return fw_fail(FW_ERR_NULL, "%s is NULL: a tensor descriptor is required", what);
    if (t->ndim != ndim)
        return fw_fail(FW_ERR_SHAPE, "%s has %d dimensions, expected %d", what, (int)t->ndim, ndim);
    if ((unsigned)t->dtype > FW_F8E5M2 || !(dtypes & (1u << t->dtype)))
        return fw_fail(FW_ERR_DTYPE, "%s has dtype %s, which this operation does not accept",
                       what, fw_dtype_name(t->dtype));
    int64_t last = 0, count = 1;
    for (int i = 0; i < ndim; i++) {
        if (t->shape[i] < 0)
            return fw_fail(FW_ERR_SHAPE, "%s has negative size %lld in dimension %d", what,
                           (long long)t->shape[i], i);
        if (t->stride[i] < 0)
            return fw_fail(FW_ERR_STRIDE, "%s has negative stride %lld in dimension %d", what,
                           (long long)t->stride[i], i);
    }
    for (int i = 0; i < ndim; i++) {
        if (t->shape[i] == 0) { count = 0; break; }
        int64_t span;
        if (__builtin_mul_overflow(t->shape[i] - 1, t->stride[i], &span) ||
            __builtin_add_overflow(last, span, &last) ||
            __builtin_mul_overflow(count, t->shape[i], &count))
            return fw_fail(FW_ERR_OVERFLOW, "%s: the offset of its last element overflows int64", what);
    }
    int64_t bytes;
    if (count && __builtin_mul_overflow(last + 1, (int64_t)fw_dtype_size(t->dtype), &bytes))
        return fw_fail(FW_ERR_OVERFLOW, "%s: its byte extent overflows int64", what);
    if (count && !t->data)
        return fw_fail(FW_ERR_NULL, "%s has %lld elements but a NULL data pointer", what,
                       (long long)count);
    return FW_OK;
}

/* Two distinct indices reach one address iff, after sorting the dims of size > 1 by stride,
 * some stride is not larger than the furthest offset the smaller-stride dims reach. */
fw_status fw_check_no_alias(const fw_tensor *t, const char *what)
{
    int idx[FW_MAX_DIMS], n = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 0)
            return FW_OK;
        if (t->shape[i] > 1)
            idx[n++] = i;
    }
    for (int a = 1; a < n; a++)
        for (int b = a; b > 0 && t->stride[idx[b]] < t->stride[idx[b - 1]]; b--) {
            int x = idx[b]; idx[b] = idx[b - 1]; idx[b - 1] = x;
        }
    int64_t reach = 0;
    for (int a = 0; a < n; a++) {
        int i = idx[a];
        if (t->stride[i] <= reach)
            return fw_fail(FW_ERR_STRIDE,
                           "%s is an output but its elements overlap (dimension %d has stride %lld "
                           "within the span of the smaller dimensions)",
                           what, i, (long long)t->stride[i]);
        reach += (t->shape[i] - 1) * t->stride[i];
    }
    return FW_OK;
}

/* Byte range [lo, hi) a tensor's elements span (hi = lo for an empty one). */
static void byte_range(const fw_tensor *t, uintptr_t *lo, uintptr_t *hi)
{
    int64_t last = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 0) {
            *lo = *hi = (uintptr_t)t->data;
            return;
        }
        last += (t->shape[i] - 1) * t->stride[i];
    }
    *lo = (uintptr_t)t->data;
    *hi = *lo + (uintptr_t)((last + 1) * (int64_t)fw_dtype_size(t->dtype));
}

int fw_overlap(const fw_tensor *a, const fw_tensor *b)
{
    uintptr_t al, ah, bl, bh;
    byte_range(a, &al, &ah);
    byte_range(b, &bl, &bh);
    return al < bh && bl < ah;
}

typedef struct {
    int64_t slot, seq;
} slot_seq;

static int by_slot(const void *a, const void *b)
{
    const slot_seq *x = a, *y = b;
    return x->slot < y->slot ? -1 : x->slot > y->slot ? 1 : (x->seq > y->seq) - (x->seq < y->seq);
}

static int64_t slot_of(const int32_t *idx, int identity, int64_t i)
{
    return idx ? idx[i] : identity ? i : -1;
}

fw_status fw_check_slot_rw(int64_t n, const int32_t *read, int read_identity, const int32_t *write,
                           int write_identity, int cross, const char *what)
{
    slot_seq *wr = malloc(sizeof(slot_seq) * (size_t)(n > 0 ? n : 1));
    if (!wr)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate %lld slot entries to check", (long long)n);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = slot_of(write, write_identity, i);
        if (s >= 0)
            wr[m++] = (slot_seq){s, i};
    }
    qsort(wr, (size_t)m, sizeof *wr, by_slot);
    fw_status st = FW_OK;
    for (int64_t j = 1; j < m && !st; j++)
        if (wr[j].slot == wr[j - 1].slot)
            st = fw_fail(FW_ERR_INDEX, "sequences %lld and %lld both write %s slot %lld", (long long)wr[j - 1].seq,
                         (long long)wr[j].seq, what, (long long)wr[j].slot);
    for (int64_t i = 0; i < n && cross && !st; i++) {
        const int64_t s = slot_of(read, read_identity, i);
        if (s < 0)
            continue;
        int64_t lo = 0, hi = m;
        while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if (wr[mid].slot < s)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo < m && wr[lo].slot == s && wr[lo].seq != i)
            st = fw_fail(FW_ERR_INDEX, "sequence %lld reads %s slot %lld, which sequence %lld writes in the same call",
                         (long long)i, what, (long long)s, (long long)wr[lo].seq);
    }
    free(wr);
    return st;
}

fw_status fw_check_cu_seqlens(const int32_t *cu, int64_t n, int64_t total, const char *name)
{
    if (!cu)
        return fw_fail(FW_ERR_NULL, "%s is NULL", name);
    if (cu[0] != 0)
        return fw_fail(FW_ERR_SEQLENS, "%s[0] is %d; it must be 0", name, (int)cu[0]);
    for (int64_t i = 1; i <= n; i++)
        if (cu[i] < cu[i - 1])
            return fw_fail(FW_ERR_SEQLENS, "%s[%lld] = %d is less than %s[%lld] = %d", name,
                           (long long)i, (int)cu[i], name, (long long)(i - 1), (int)cu[i - 1]);
    if (total >= 0 && cu[n] != total)
        return fw_fail(FW_ERR_SEQLENS, "%s[%lld] = %d but the packed tensors have %lld rows", name,
                       (long long)n, (int)cu[n], (long long)total);
    return FW_OK;
}

fw_status fw_check_threads(int32_t threads)
{
    if (threads < 0 || threads > FW_MAX_THREADS)
        return fw_fail(FW_ERR_ARG, "threads is %d; it must be 0 (all CPUs) to %d", (int)threads,
                       FW_MAX_THREADS);
    return FW_OK;
}

/* ------------------------------------------------------ dtype conversions -- */

float fw_bf16_to_f32(uint16_t h) { return fw_cvt_bf16_f32(h); }
uint16_t fw_f32_to_bf16(float f) { return fw_cvt_f32_bf16(f); }
float fw_f16_to_f32(uint16_t h) { return fw_cvt_f16_f32(h); }
uint16_t fw_f32_to_f16(float f) { return fw_cvt_f32_f16(f); }
float fw_f8_to_f32(uint8_t b, fw_dtype dt)
{
    return dt == FW_F8E4M3 || dt == FW_F8E5M2 ? fw_cvt_f8_f32(b, dt) : NAN;
}
uint8_t fw_f32_to_f8(float f, fw_dtype dt)
{
    return dt == FW_F8E4M3 || dt == FW_F8E5M2 ? fw_cvt_f32_f8(f, dt) : 0;
}
