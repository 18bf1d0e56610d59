/* isa_portable.h: the "vector" layer in plain C: one float per vector. The same algorithm
 * as the SIMD tables, so the portable table tests the algorithm on any CPU. */
#include <math.h>
#include <string.h>

#define ISA_NAME "portable"
#define VL 1
#define TM 4
#define QK_TJ 3
#define TJ 6
#define DEC_RT 4

typedef float vf;
typedef int vm;

static inline vf vload(const float *p) { return *p; }
static inline void vstore(float *p, vf x) { *p = x; }
static inline vf vset1(float x) { return x; }
/* A value the compiler must hold in a register (not fold into a memory operand of each
 * FMA, which would turn 4 row loads per k step into 12). */
static inline vf vkeep(vf x) { return x; }
static inline vf vzero(void) { return 0.0f; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; } /* fmaf may be a libm call */
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vdiv(vf a, vf b) { return a / b; }
static inline vf vdiv_half(vf a, vf b) { return a / b; }
static inline vf vmax(vf a, vf b) { return (a > b) ? a : b; } /* NaN in b is returned */
static inline vm vlt(vf a, vf b) { return a < b; }
static inline vm vge(vf a, vf b) { return a >= b; }
static inline vm veq(vf a, vf b) { return a == b; }
static inline vm vnotlt(vf a, vf b) { return !(a < b); }
static inline vm vmand(vm a, vm b) { return a && b; }
static inline int vany(vm m) { return m != 0; }
static inline int vall(vm m) { return m != 0; }
static inline vf vsel(vm m, vf a, vf b) { return m ? a : b; }
static inline vf vmaskz(vm m, vf a) { return m ? a : 0.0f; }

#include "isa_poly.h"

/* 2^x: the same reduction and polynomials as the SIMD tables (half: vexp2_half_poly). */
static inline vf vexp2_to(vf x, const int half)
{
    if (x != x)
        return x;
    x = x < -127.0f ? -127.0f : (x > 128.0f ? 128.0f : x);
    float n = rintf(x);
    float f = x - n;
    const float p = half ? vexp2_half_poly(f) : vexp2_poly(f);
    uint32_t e = (uint32_t)((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

static inline vf vexp2(vf x) { return vexp2_to(x, 0); }

/* (float)(a[i] - b[i]), the difference in double (b NULL: zero). */
static inline vf vload_dsub(const double *a, const double *b, int64_t i) { return (float)(a[i] - (b ? b[i] : 0.0)); }

static inline vf vload_in(const void *src, fw_dtype dt, int64_t i)
{
    if (dt == FW_F32)
        return ((const float *)src)[i];
    if (dt == FW_BF16)
        return fw_cvt_bf16_f32(((const uint16_t *)src)[i]);
    if (dt == FW_F16)
        return fw_cvt_f16_f32(((const uint16_t *)src)[i]);
    return fw_cvt_f8_f32(((const uint8_t *)src)[i], dt);
}

static inline void cvt_in_vec(const void *src, fw_dtype dt, int64_t i, float scale, float *dst)
{
    dst[i] = vload_in(src, dt, i) * scale;
}

static inline float vhmax(vf x) { return x; }
static inline void vtranspose(vf *r) { (void)r; } /* a 1 x 1 block */
static inline vf vload_bits(const void *p)
{
    float f;
    memcpy(&f, p, 4);
    return f;
}
static inline vf vbf16_even(vf w)
{
    uint32_t u;
    memcpy(&u, &w, 4);
    return fw_cvt_bf16_f32((uint16_t)(u & 0xffffu));
}
static inline vf vbf16_odd(vf w)
{
    uint32_t u;
    memcpy(&u, &w, 4);
    return fw_cvt_bf16_f32((uint16_t)(u >> 16));
}

/* One float stored as dtype dt at element i of dst (rounded to nearest even). */
static inline void vstore_as(void *dst, fw_dtype dt, int64_t i, vf x)
{
    if (dt == FW_F32)
        ((float *)dst)[i] = x;
    else if (dt == FW_BF16)
        ((uint16_t *)dst)[i] = fw_cvt_f32_bf16(x);
    else
        ((uint16_t *)dst)[i] = fw_cvt_f32_f16(x);
}

static inline void cvt_out_vec(const float *src, int64_t i, void *dst, fw_dtype dt)
{
    vstore_as(dst, dt, i, src[i]);
}

/* The portable table has no non-temporal stores: plain ones, nothing to order. */
static inline void vstream_as(void *dst, fw_dtype dt, int64_t i, vf x) { vstore_as(dst, dt, i, x); }
static inline void vstream_fence(void) {}

static inline int vstore2_native(void *dst, fw_dtype dt, int64_t i, vf lo, vf hi, int nt) { return 0; }

/* Pair words of two rows' bf16, 2 columns: lo for column 0, hi for column 1. */
static inline void vpair_bits(vf a, vf b, vf *lo, vf *hi)
{
    uint32_t x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    const uint32_t w0 = (x & 0xffffu) | y << 16, w1 = x >> 16 | (y & 0xffff0000u);
    memcpy(lo, &w0, 4);
    memcpy(hi, &w1, 4);
}

static inline void vcols_to_pairs(const float *o, vf *lo, vf *hi)
{
    *lo = o[0];
    *hi = o[1];
}

static inline void vpairs_to_cols(float *o, vf lo, vf hi)
{
    o[0] = lo;
    o[1] = hi;
}

/* Lane i of the result: the sum of a[i]'s lanes (one lane, one vector). */
static inline vf vsum_each(const vf *a) { return a[0]; }
/* The lanes as 1 row of 1. */
static inline void vstore_rows(float *dst, int64_t ld, vf t)
{
    (void)ld;
    *dst = t;
}
static inline float vhsum(vf x) { return x; }

/* ---- bf16 pairs (see "bf16 products" in kern/mm_kern.h): one word, moved as a float's bits. */
static inline vf vbcast_word(const uint32_t *p) { return vload_bits(p); }
static inline vf vdpbf(vf acc, vf a, vf b)
{
    return vfma(vbf16_even(a), vbf16_even(b), vfma(vbf16_odd(a), vbf16_odd(b), acc));
}
static inline vf vbf16_pair(vf even, vf odd)
{
    uint32_t u = (uint32_t)fw_cvt_f32_bf16(even) | (uint32_t)fw_cvt_f32_bf16(odd) << 16;
    vf w;
    memcpy(&w, &u, 4);
    return w;
}

/* The 2 VL elements lo, hi of a row rounded to bf16, in order (one word here). */
static inline vf vbf16_row(vf lo, vf hi) { return vbf16_pair(lo, hi); }

#define PEAK_CHAINS 12
