/* isa_avx512.h: the thin vector layer for AVX-512 (F, BW, DQ, VL). 16 floats per vector.
 * Compiled with AVX512_BF16 too (avx512bf16.c), the bf16 pair products and conversions use
 * vdpbf16ps and vcvtne2ps2bf16; without, they are emulated with f32 FMAs on the same pairs. */
#include <immintrin.h>

#ifdef __AVX512BF16__
#define ISA_NAME "avx512bf16"
#else
#define ISA_NAME "avx512"
#endif
#define VL 16
#define TM 4 /* vectors of query rows per register tile: 4 x 16 = 64 rows */
#define QK_TJ 3 /* keys per qk register tile: 3 x 4 x 2 sets = 24 accumulators */
#define TJ 6 /* value columns per pv register tile: 4 x 6 = 24 accumulators */
#define DEC_RT 4 /* decode: query rows per register tile (x 2 key vectors x 2 sets = 16) */

typedef __m512 vf;
typedef __mmask16 vm;

static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
/* A value the compiler must hold in a register (not fold into a memory operand of each
 * FMA, which would turn 4 row loads per k step into 12). */
static inline vf vkeep(vf x) { __asm__("" : "+v"(x)); return x; }
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
/* a / b to 2^-14 relative (a times vrcp14ps, whose results keep their subnormals: no FTZ):
 * for values rounded to bf16 or f16 next. The division is 3 operations and one every 10-16
 * cycles on Intel's cores, the reciprocal one every 2. */
static inline vf vdiv_half(vf a, vf b) { return _mm512_mul_ps(a, _mm512_rcp14_ps(b)); }
/* max(a, b) where b is returned when either is NaN: callers pass the data second. */
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vm vlt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
static inline vm vge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
static inline vm veq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline vm vnotlt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_NLT_UQ); }
static inline vm vmand(vm a, vm b) { return (vm)(a & b); }
static inline int vany(vm m) { return m != 0; }
static inline int vall(vm m) { return m == 0xffff; }
static inline vf vsel(vm m, vf a, vf b) { return _mm512_mask_blend_ps(m, b, a); } /* m ? a : b */
static inline vf vmaskz(vm m, vf a) { return _mm512_maskz_mov_ps(m, a); }

#include "isa_poly.h"

/* 2^x to about 2 ulp: x = n + f, |f| <= 1/2, 2^f by a degree-5 polynomial, then scalef by n
 * (which also gives inf above 128 and 0 below -150 without a clamp). half, for results
 * rounded to bf16 or f16: x = floor(x) + f, f in [0, 1) in one vreduceps (0 for +-inf, NaN
 * kept), 2^f by vexp2_half_poly's polynomial moved to [0, 1) (sqrt(2) p(f - 1/2) expanded:
 * the same 2^-13.7 relative error), and scalef, which takes floor(x) itself: one operation
 * fewer than rounding x and subtracting (the conv's SiLU, conv/conv_kern.h vsilu). */
static inline vf vexp2_to(vf x, const int half)
{
    if (half) {
        const vf f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        vf p = vfma(vset1(0.07802410896084194f), f, vset1(0.22606790106952918f));
        p = vfma(p, f, vset1(0.6958331690795104f));
        return _mm512_scalef_ps(vfma(p, f, vset1(0.9999252639595343f)), x);
    }
    vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf f = _mm512_sub_ps(x, n);
    return _mm512_scalef_ps(vexp2_poly(f), n);
}

static inline vf vexp2(vf x) { return vexp2_to(x, 0); }

/* (float)(a[i + x] - b[i + x]) for x < VL, the differences in double (b NULL: zeros). */
static inline vf vload_dsub(const double *a, const double *b, int64_t i)
{
    __m512d lo = _mm512_loadu_pd(a + i), hi = _mm512_loadu_pd(a + i + 8);
    if (b) {
        lo = _mm512_sub_pd(lo, _mm512_loadu_pd(b + i));
        hi = _mm512_sub_pd(hi, _mm512_loadu_pd(b + i + 8));
    }
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo)), _mm512_cvtpd_ps(hi), 1);
}

/* VL contiguous elements of src from element i, converted to f32. */
static inline vf vload_in(const void *src, fw_dtype dt, int64_t i)
{
    if (dt == FW_F32)
        return _mm512_loadu_ps((const float *)src + i);
    if (dt == FW_BF16) { /* one zero-masked word shuffle into the high halves: one operation where
                          * a widening then a shift is two (both run on the vector ports) */
        const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5,
                                             0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
        const __m256i w = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i));
        return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xaaaaaaaau, idx, _mm512_castsi256_si512(w)));
    }
    if (dt == FW_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i)));
    /* 8-bit floats through f16 bits (kern/isa.h: vload_in) */
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)src + i)));
    if (dt == FW_F8E5M2)
        return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
    const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16((short)0x8000)),
                                      _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3f80)));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7f));
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_mask_mov_epi16(h, nan, _mm256_set1_epi16(0x7e00))),
                         _mm512_set1_ps(256.0f));
}

static inline void cvt_in_vec(const void *src, fw_dtype dt, int64_t i, float scale, float *dst)
{
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(vload_in(src, dt, i), _mm512_set1_ps(scale)));
}

static inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }

/* VL 32-bit words (here: pairs of bf16) as raw bits, and the two bf16 of each word as f32:
 * the low half (even element) shifted up, the high half (odd element) masked. */
static inline vf vload_bits(const void *p) { return _mm512_loadu_ps(p); }
static inline vf vbf16_even(vf w) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(w), 16)); }
static inline vf vbf16_odd(vf w)
{
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(w), _mm512_set1_epi32((int)0xffff0000u)));
}

/* In-register transpose of 16 rows of 16: unpack within 128-bit lanes, shuffle pairs, then
 * two rounds of 128-bit-lane shuffles (64 shuffles in all). */
static inline void vtranspose(vf *r)
{
    vf t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    /* u[4g + c], 128-bit lane L, holds rows 4g..4g+3 of column 4L + c */
    for (int c = 0; c < 4; c++) {
        vf x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
        vf x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
        vf x2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
        vf x3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
        r[c] = _mm512_shuffle_f32x4(x0, x2, _MM_SHUFFLE(2, 0, 2, 0));
        r[8 + c] = _mm512_shuffle_f32x4(x0, x2, _MM_SHUFFLE(3, 1, 3, 1));
        r[4 + c] = _mm512_shuffle_f32x4(x1, x3, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + c] = _mm512_shuffle_f32x4(x1, x3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* x rounded to bf16 (nearest even; NaN stays NaN), as f32 bits with a zero low half. */
static inline __m512i vround_bf16_bits(vf x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

/* VL floats stored as dtype dt at element i of dst (rounded to nearest even). */
/* VL floats as VL f16 or bf16 (dt), rounded to nearest even. */
static inline __m256i vhalf_bits(vf x, fw_dtype dt)
{
    if (dt == FW_F16)
        return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#ifdef __AVX512BF16__
    /* vcvtneps2bf16: the same nearest-even rounding in one instruction (NaN stays NaN); it
     * reads denormal inputs as zero, the software form below keeps them */
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(vround_bf16_bits(x), 16));
#endif
}

static inline void vstore_as(void *dst, fw_dtype dt, int64_t i, vf x)
{
    if (dt == FW_F32)
        _mm512_storeu_ps((float *)dst + i, x);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i), vhalf_bits(x, dt));
}

static inline void cvt_out_vec(const float *src, int64_t i, void *dst, fw_dtype dt)
{
    vstore_as(dst, dt, i, _mm512_loadu_ps(src + i));
}

/* vstore_as with a non-temporal store (the line goes to memory without being read first);
 * dst + i must be aligned to the vector's bytes (64 for f32, 32 for bf16 and f16). Stores
 * issued this way are ordered for other threads by vstream_fence. */
static inline void vstream_as(void *dst, fw_dtype dt, int64_t i, vf x)
{
    if (dt == FW_F32)
        _mm512_stream_ps((float *)dst + i, x);
    else
        _mm256_stream_si256((__m256i *)((uint16_t *)dst + i), vhalf_bits(x, dt));
}

static inline void vstream_fence(void) { _mm_sfence(); }

/* ---- bf16 pairs (see "bf16 products" in kern/mm_kern.h): a vf holding VL 32-bit words, each
 * two bf16 of adjacent reduction elements, the even one in the low half. */

/* One word broadcast to every lane. */
static inline vf vbcast_word(const uint32_t *p) { return _mm512_castsi512_ps(_mm512_set1_epi32((int)*p)); }

#ifdef __AVX512BF16__
/* acc + a.odd b.odd + a.even b.even per lane (bf16 products are exact in f32) */
static inline vf vdpbf(vf acc, vf a, vf b)
{
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(a), (__m512bh)_mm512_castps_si512(b));
}

/* Words (even[i], odd[i]) rounded to nearest even: one conversion of both vectors, then
 * one word shuffle that interleaves them. */
static inline vf vbf16_pair(vf even, vf odd)
{
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even); /* even in 0..15, odd in 16..31 */
    return _mm512_castsi512_ps(_mm512_permutexvar_epi16(idx, both));
}

/* The 2 VL elements lo, hi of a row rounded to bf16, in order: word i = (x[2i], x[2i+1]). */
static inline vf vbf16_row(vf lo, vf hi) { return _mm512_castsi512_ps((__m512i)_mm512_cvtne2ps_pbh(hi, lo)); }
#else
static inline vf vdpbf(vf acc, vf a, vf b)
{
    return vfma(vbf16_even(a), vbf16_even(b), vfma(vbf16_odd(a), vbf16_odd(b), acc));
}

static inline vf vbf16_pair(vf even, vf odd)
{
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_srli_epi32(vround_bf16_bits(even), 16),
                                               vround_bf16_bits(odd)));
}

static inline vf vbf16_row(vf lo, vf hi)
{
    const __m256i a = _mm512_cvtepi32_epi16(_mm512_srli_epi32(vround_bf16_bits(lo), 16));
    const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(vround_bf16_bits(hi), 16));
    return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}
#endif

/* vstore2_as's one-store form of a vector pair (conv/conv_kern.h), 1 where it stored them: with
 * AVX512_BF16, a bf16 pair is one vcvtne2ps2bf16 and one store in place of two conversions
 * (each two operations on Intel) and two stores; the same bits. */
static inline int vstore2_native(void *dst, fw_dtype dt, int64_t i, vf lo, vf hi, int nt)
{
#ifdef __AVX512BF16__
    if (dt == FW_BF16) {
        float *p = (float *)((uint16_t *)dst + i);
        const __m512i w = _mm512_castps_si512(vbf16_row(lo, hi));
        if (!nt) {
            _mm512_storeu_si512(p, w);
        } else if ((uintptr_t)p % 64 == 0) {
            _mm512_stream_si512((__m512i *)p, w);
        } else { /* 32-byte aligned: the halves */
            _mm256_stream_si256((__m256i *)p, _mm512_castsi512_si256(w));
            _mm256_stream_si256((__m256i *)p + 1, _mm512_extracti64x4_epi64(w, 1));
        }
        return 1;
    }
#endif
    return 0;
}

/* Pair words of two rows' 2 VL bf16, a and b: word (a[c], b[c]) (a in the low half) for the
 * columns of lo and hi, in the order vcols_to_pairs gives: unpacking works within 128-bit
 * lanes, so lane L of lo holds columns 8L .. 8L+3 and of hi 8L+4 .. 8L+7. */
static inline void vpair_bits(vf a, vf b, vf *lo, vf *hi)
{
    const __m512i x = _mm512_castps_si512(a), y = _mm512_castps_si512(b);
    *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(x, y));
    *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(x, y));
}

/* 8-bit floats to bf16 by looking up the 128 magnitudes (two 64-entry word tables per type,
 * vpermt2w) and or-ing the sign in: 7 operations per 32 elements, where widening each half
 * to f32 through f16 and rounding back took 23. Entries: e4m3 e.m (4 + 3 bits) is 2^(e-7)
 * 1.m, 2^-6 0.m at e = 0, NaN at 1111.111; e5m2 (5 + 2) 2^(e-15) 1.m, 2^-14 0.m at e = 0,
 * inf / NaN at e = 31. Each a bf16 of the same value (its exponent field rebiased to 127). */
#define ISA_F8_BITS 1
#define F8_E4(n)                                                                                   \
    ((n) == 0x7f ? 0x7fc0                                                                          \
     : (n) >= 8  ? ((n) << 4) + (120 << 7)                                                         \
     : (n) == 0  ? 0                                                                               \
     : (n) == 1  ? 118 << 7                                                                        \
     : (n) < 4   ? 119 << 7 | ((n)&1) << 6                                                         \
                 : 120 << 7 | ((n)&3) << 5)
#define F8_E5(n)                                                                                   \
    ((n) >= 0x7d ? 0x7fc0                                                                          \
     : (n) == 0x7c ? 0x7f80                                                                        \
     : (n) >= 4  ? ((n) << 5) + (112 << 7)                                                         \
     : (n) == 0  ? 0                                                                               \
     : (n) == 1  ? 111 << 7                                                                        \
     : (n) == 2  ? 112 << 7                                                                        \
                 : 112 << 7 | 1 << 6)
#define F8_8(F, n) F(n), F(n + 1), F(n + 2), F(n + 3), F(n + 4), F(n + 5), F(n + 6), F(n + 7)
#define F8_32(F, n) F8_8(F, n), F8_8(F, n + 8), F8_8(F, n + 16), F8_8(F, n + 24)
static const uint16_t f8_bf16[2][128] __attribute__((aligned(64))) = {
    {F8_32(F8_E4, 0), F8_32(F8_E4, 32), F8_32(F8_E4, 64), F8_32(F8_E4, 96)},
    {F8_32(F8_E5, 0), F8_32(F8_E5, 32), F8_32(F8_E5, 64), F8_32(F8_E5, 96)}};
#undef F8_8
#undef F8_32
#undef F8_E4
#undef F8_E5

/* The 32 8-bit floats in the low bytes of w's 16-bit lanes, as bf16. */
static inline __m512i vf8_bf16_lanes(__m512i w, fw_dtype dt)
{
    const uint16_t *t = f8_bf16[dt == FW_F8E5M2];
    const __m512i lo = _mm512_permutex2var_epi16(_mm512_load_si512(t), w, _mm512_load_si512(t + 32));
    const __m512i hi = _mm512_permutex2var_epi16(_mm512_load_si512(t + 64), w, _mm512_load_si512(t + 96));
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), lo, hi);
    /* mag | (w << 8 & 0x8000): the sign */
    return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(w, 8), _mm512_set1_epi16((short)0x8000), 0xf8);
}

static inline vf vload_f8_bits(const void *src, fw_dtype dt, int64_t i)
{
    const __m256i b = _mm256_loadu_si256((const __m256i *)((const uint8_t *)src + i));
    return _mm512_castsi512_ps(vf8_bf16_lanes(_mm512_cvtepu8_epi16(b), dt));
}

/* 2 VL f32 columns of o in vpair_rows_bf16's order, and back. */
static inline void vcols_to_pairs(const float *o, vf *lo, vf *hi)
{
    const __m512i il = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i ih = _mm512_add_epi32(il, _mm512_set1_epi32(4));
    const vf o0 = _mm512_loadu_ps(o), o1 = _mm512_loadu_ps(o + 16);
    *lo = _mm512_permutex2var_ps(o0, il, o1);
    *hi = _mm512_permutex2var_ps(o0, ih, o1);
}

static inline void vpairs_to_cols(float *o, vf lo, vf hi)
{
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(8));
    _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo, i0, hi));
    _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo, i1, hi));
}

/* Lane i of the result: the sum of a[i]'s lanes, i < 16. A tree: each level adds two
 * shuffles of a pair of vectors (30 shuffles and 15 adds; a transpose then a sum of the rows
 * takes 64 shuffles). After the first two levels y[m]'s 128-bit lane L holds the partial sums
 * of a[4m .. 4m+3] over that lane's elements; the last two add the lanes. */
static inline vf vsum_each(const vf *a)
{
    vf x[8], y[4], w[2];
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The lanes as 4 rows of 4: lanes 4r .. 4r+3 to dst + r * ld. */
static inline void vstore_rows(float *dst, int64_t ld, vf t)
{
    _mm_storeu_ps(dst, _mm512_castps512_ps128(t));
    _mm_storeu_ps(dst + ld, _mm512_extractf32x4_ps(t, 1));
    _mm_storeu_ps(dst + 2 * ld, _mm512_extractf32x4_ps(t, 2));
    _mm_storeu_ps(dst + 3 * ld, _mm512_extractf32x4_ps(t, 3));
}

/* Horizontal sum, for the plain baseline's dot products. */
static inline float vhsum(vf x) { return _mm512_reduce_add_ps(x); }

/* One step of the peak microbenchmark: 12 independent FMA chains. */
#define PEAK_CHAINS 12
