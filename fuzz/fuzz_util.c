/* fuzz_util.c: the harnesses' byte decoder, tensor layouts, value classes and comparison. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "fuzz_util.h"
#include "test_util.h"

unsigned fz_byte(fz_in *in)
{
    if (!in->n)
        return 0;
    in->n--;
    return *in->p++;
}

int64_t fz_range(fz_in *in, int64_t lo, int64_t hi)
{
    if (hi <= lo)
        return lo;
    uint64_t span = (uint64_t)(hi - lo) + 1, x = fz_byte(in);
    if (span > 256)
        x = x << 8 | fz_byte(in);
    return lo + (int64_t)(x % span);
}

int fz_chance(fz_in *in, unsigned num) { return fz_byte(in) < num; }

int64_t fz_size(fz_in *in, int64_t small, int64_t big)
{
    return fz_chance(in, 8) ? fz_range(in, 0, big) : fz_range(in, 0, small);
}

int fz_vclass(fz_in *in)
{
    unsigned b = fz_byte(in);
    return b < 224 ? FZ_MODERATE : b < 248 ? FZ_SPECIAL : FZ_HUGE;
}

void fz_seed(fz_in *in)
{
    uint64_t s = 0;
    for (int i = 0; i < 4; i++)
        s = s << 8 | fz_byte(in);
    rng_seed(s + 1);
}

int64_t fz_numel(const fw_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i] > 0 ? t->shape[i] : 0;
    return n;
}

double fz_eps(fw_dtype dt)
{
    return dt == FW_F32 ? 0x1p-23 : dt == FW_BF16 ? 0x1p-7 : dt == FW_F16 ? 0x1p-10 : 0x1p-52;
}

double fz_absmax(const fw_tensor *t)
{
    double m = 0;
    int64_t idx[FW_MAX_DIMS] = {0};
    if (!fz_numel(t))
        return 0;
    do {
        double x = fabs(tget(t, idx));
        if (isfinite(x) && x > m)
            m = x;
    } while (tnext(t, idx));
    return m;
}

double fz_absmax_d(const double *x, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(x[i]))
            m = fmax(m, fabs(x[i]));
    return m;
}

double fz_lse_slack(const double *ex_lse, int64_t n, double smax)
{
    return 1e-5 + 0x1p-23 * (64 * fz_absmax_d(ex_lse, n) + 8 * smax);
}

static void fill(const fw_tensor *t, int vclass, double scale)
{
    int64_t n = fz_numel(t), idx[FW_MAX_DIMS] = {0};
    if (!n)
        return;
    /* uniform with the normal's variance: a normal draw costs a log and a cosine */
    const double a = scale * 1.7320508075688772 * 2;
    do
        tset(t, idx, a * (rng_uniform() - 0.5));
    while (tnext(t, idx));
    if (vclass == FZ_MODERATE)
        return;
    double big = t->dtype == FW_F16 ? 6e4 : 3e38;
    for (int s = 0, ns = 1 + (int)(rng_uniform() * 3); s < ns; s++) {
        int64_t e = (int64_t)(rng_uniform() * (double)n);
        for (int i = t->ndim - 1; i >= 0; i--) {
            idx[i] = e % t->shape[i];
            e /= t->shape[i];
        }
        double u = rng_uniform(), x;
        if (vclass == FZ_SPECIAL)
            x = u < 0.5 ? NAN : u < 0.75 ? INFINITY : -INFINITY;
        else
            x = (u < 0.5 ? big : -big) * (0.5 + rng_uniform() * 0.5);
        tset(t, idx, x);
    }
}

/* The byte of an input's padding: a huge value (0x7F7F: bf16 3.4e38, f16 NaN; f32 3.4e38), so
 * a kernel that lets an element past its view reach a result fails the comparison, every run
 * alike (unset padding made a CI finding that did not replay). */
#define FZ_PAD 0x7F

void fz_tensor_new(fz_in *in, fz_tensor *ft, fw_dtype dt, int ndim, const int64_t *shape,
                   int output, int corrupt, int vclass, double scale)
{
    memset(ft, 0, sizeof *ft);
    fw_tensor *t = &ft->t;
    t->dtype = dt;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++)
        t->shape[i] = shape[i];
    /* the layout: 0-3 contiguous, 4 padded, 5 permuted, 6 permuted and padded, 7 broadcast */
    unsigned mode = fz_byte(in) % 8;
    int order[FW_MAX_DIMS] = {0, 1, 2, 3};
    if (mode == 5 || mode == 6)
        for (int i = ndim - 1; i > 0; i--) {
            int j = (int)fz_range(in, 0, i), x = order[i];
            order[i] = order[j];
            order[j] = x;
        }
    int64_t s = 1;
    for (int k = ndim - 1; k >= 0; k--) {
        int i = order[k];
        t->stride[i] = s;
        s = s * (shape[i] > 0 ? shape[i] : 1) + (mode == 4 || mode == 6 ? fz_range(in, 0, 3) : 0);
    }
    if (mode == 7 && ndim) {
        int j = (int)fz_range(in, 0, ndim - 1);
        if (!output || shape[j] <= 1)
            t->stride[j] = 0;
    }
    int64_t n = fz_numel(t), span = 1;
    for (int i = 0; i < ndim; i++)
        span += n ? (shape[i] - 1) * t->stride[i] : 0;
    ft->bytes = (size_t)span * fw_dtype_size(dt);
    ft->buf = malloc(ft->bytes);
    t->data = ft->buf;
    memset(ft->buf, output ? 0xA5 : FZ_PAD, ft->bytes);
    if (!output)
        fill(t, vclass, scale);
    if (corrupt == FZ_NONE || in->broken || !fz_chance(in, 10))
        return;
    int j = ndim ? (int)fz_range(in, 0, ndim - 1) : 0;
    switch (fz_byte(in) % 7) {
    case 0: /* a negative stride: refused whatever the sizes */
        if (ndim) {
            t->stride[j] = -1 - fz_range(in, 0, 3);
            ft->bad = 1;
        }
        break;
    case 1: /* a stride whose offsets overflow int64 (needs every size > 0 and one >= 3) */
        for (int i = 0; i < ndim; i++)
            if (n && shape[i] >= 3) {
                t->stride[i] = INT64_MAX / 2 + 1;
                ft->bad = 1;
                break;
            }
        break;
    case 2: /* another dtype where the call takes none but `dt`: float64, which no kernel
               takes, an fp8 type (caches only, with descales) or one that does not exist */
        t->dtype = fz_chance(in, 128) ? FW_F64 : (fw_dtype)(4 + fz_byte(in) % 250);
        if (t->dtype == dt)
            t->dtype = FW_F64;
        ft->bad = 1;
        break;
    case 3: /* NULL data behind elements */
        if (n) {
            t->data = NULL;
            ft->bad = 1;
        }
        break;
    case 4: /* the wrong rank */
        t->ndim = ndim == FW_MAX_DIMS ? ndim - 1 : fz_chance(in, 128) && ndim ? ndim - 1 : ndim + 1;
        if (t->ndim > ndim)
            t->shape[ndim] = 1, t->stride[ndim] = 1;
        ft->bad = 1;
        break;
    case 5: /* a size another operand fixes, off by one */
        if (ndim && (corrupt >> j & 1)) {
            t->shape[j] += shape[j] && fz_chance(in, 128) ? -1 : 1;
            ft->bad = 1;
        }
        break;
    case 6: /* a negative size */
        if (ndim) {
            t->shape[j] = -1 - fz_range(in, 0, 1000);
            ft->bad = 1;
        }
        break;
    }
    in->broken = ft->bad;
}

void fz_tensor_free(fz_tensor *ft)
{
    free(ft->buf);
    ft->buf = NULL;
}

void fz_tensor_relayout(fz_tensor *ft, const int64_t *stride)
{
    fw_tensor nt = ft->t;
    const int64_t n = fz_numel(&ft->t);
    int64_t span = 1, idx[FW_MAX_DIMS] = {0};
    for (int i = 0; i < nt.ndim; i++) {
        nt.stride[i] = stride[i];
        span += n ? (nt.shape[i] - 1) * stride[i] : 0;
    }
    ft->bytes = (size_t)span * fw_dtype_size(nt.dtype);
    unsigned char *buf = malloc(ft->bytes);
    memset(buf, FZ_PAD, ft->bytes);
    nt.data = buf;
    if (n)
        do
            tset(&nt, idx, tget(&ft->t, idx));
        while (tnext(&nt, idx));
    free(ft->buf);
    ft->buf = buf;
    ft->t = nt;
}

unsigned char *fz_snapshot(const fz_tensor *ft)
{
    unsigned char *s = malloc(ft->bytes ? ft->bytes : 1);
    memcpy(s, ft->buf, ft->bytes);
    return s;
}

int fz_unchanged(const fz_tensor *ft, const unsigned char *snap)
{
    return memcmp(ft->buf, snap, ft->bytes) == 0;
}

char fz_desc[1024];

/* AddressSanitizer's hook before a report: the report starts with the problem. */
void __asan_on_error(void);
void __asan_on_error(void) { fprintf(stderr, "\nproblem: %s\n", fz_desc); }

void fz_describe(const char *fmt, ...)
{
    size_t n = strlen(fz_desc);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fz_desc + n, sizeof fz_desc - n, fmt, ap);
    va_end(ap);
}

void fz_describe_tensor(const char *name, const fz_tensor *ft, int vclass)
{
    static const char *cls[] = {"moderate", "special", "huge"};
    const fw_tensor *t = &ft->t;
    fz_describe("\n  %s %s%s [", name, fw_dtype_name(t->dtype), ft->bad ? " (broken)" : "");
    for (int i = 0; i < t->ndim && i < FW_MAX_DIMS; i++)
        fz_describe("%s%lld", i ? ", " : "", (long long)t->shape[i]);
    fz_describe("] strides [");
    for (int i = 0; i < t->ndim && i < FW_MAX_DIMS; i++)
        fz_describe("%s%lld", i ? ", " : "", (long long)t->stride[i]);
    fz_describe("] %s", vclass >= 0 ? cls[vclass] : "output");
    /* FZ_DUMP=1 (replaying an input): where the non-finite and huge values are */
    if (vclass > FZ_MODERATE && getenv("FZ_DUMP") && !ft->bad && fz_numel(t)) {
        int64_t idx[FW_MAX_DIMS] = {0};
        do {
            double x = tget(t, idx);
            if (!isfinite(x) || fabs(x) > 1e4) {
                fz_describe(" %g at (", x);
                for (int i = 0; i < t->ndim; i++)
                    fz_describe("%s%lld", i ? "," : "", (long long)idx[i]);
                fz_describe(")");
            }
        } while (tnext(t, idx));
    }
}

void fz_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "\nproblem: %s\nFUZZ FINDING: ", fz_desc);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}

const char *fz_isa(fz_in *in)
{
    int i = (int)fz_range(in, 0, 7) - 1;
    if (i < 0 || i >= fw_isa_count() || !fw_isa_supported(fw_isa_name(i)))
        return NULL;
    return fw_isa_name(i);
}

uint32_t fz_dec_prefetch(fz_in *in)
{
    static const uint32_t f[3] = {0, FW_ATTN_DEC_PREFETCH, FW_ATTN_NO_DEC_PREFETCH};
    return f[fz_range(in, 0, 2)];
}

void fz_compare(const char *what, const fw_tensor *got, const double *sr, const double *ex,
                int64_t n, int values, int rules, double slack)
{
    const int wider = rules & FZ_WIDER, any = rules & FZ_ANY_NONFINITE;
    double bar = 0;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(sr[i]) && isfinite(ex[i]))
            bar = fmax(bar, fabs(round_to(got->dtype, sr[i]) - ex[i]));
    bar = 2 * bar + slack;
    int64_t idx[FW_MAX_DIMS] = {0}, i = 0;
    if (!n || !values)
        return;
    do {
        double g = tget(got, idx);
        if (isnan(sr[i]))
            FZ_CHECK(any ? !isfinite(g) : isnan(g), "%s[%lld]: the reference is NaN, the kernel gave %g",
                     what, (long long)i, g);
        else if (isinf(sr[i]))
            FZ_CHECK(g == sr[i] || (any && !isfinite(g)) || (wider && isnan(g)),
                     "%s[%lld]: the reference is %g, the kernel gave %g", what, (long long)i, sr[i], g);
        else if (!isfinite(g))
            FZ_CHECK(wider && (isnan(g) || any), "%s[%lld]: the kernel gave %g, the reference %g",
                     what, (long long)i, g, sr[i]);
        else
            FZ_CHECK(fabs(g - ex[i]) <= bar,
                     "%s[%lld]: kernel %.9g, reference %.9g (same roundings %.9g), allowed %.3g",
                     what, (long long)i, g, ex[i], sr[i], bar);
        i++;
    } while (tnext(got, idx));
}

int fz_sinks(fz_in *in, fz_tensor *ft, int64_t hq, int *vclass)
{
    static const fw_dtype dts[3] = {FW_F32, FW_BF16, FW_F16};
    memset(ft, 0, sizeof *ft);
    *vclass = FZ_MODERATE;
    if (fz_byte(in) < 160)
        return 0;
    *vclass = fz_vclass(in);
    const fw_dtype dt = dts[fz_range(in, 0, 2)];
    const double scale = fz_byte(in) >= 192 ? (double)fz_range(in, 8, 40) : (double)fz_range(in, 1, 3);
    const int64_t shape[1] = {hq};
    fz_tensor_new(in, ft, dt, 1, shape, 0, FZ_ALL, *vclass, scale);
    return 1;
}
