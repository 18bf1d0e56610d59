/* isa_avx2.h: the thin vector layer for AVX2 + FMA + F16C. 8 floats per vector, 16 registers. */
#include <immintrin.h>

#define ISA_NAME "avx2"
#define VL 8
#define TM 2 /* 2 x 8 = 16 rows per register tile */
#define QK_TJ 3 /* 3 x 2 x 2 sets = 12 accumulators + 2 row vectors + 1 broadcast */
#define TJ 6 /* 2 x 6 = 12 accumulators, + 2 row vectors + 1 broadcast = 15 of 16 registers */
#define DEC_RT 2 /* decode: 2 rows x 2 key vectors x 2 sets = 8 accumulators */

typedef __m256 vf;
typedef __m256 vm;

static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
/* A value the compiler must hold in a register (not fold into a memory operand of each
 * FMA, which would turn 4 row loads per k step into 12). */
static inline vf vkeep(vf x) { __asm__("" : "+x"(x)); return x; }
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
/* a / b for values rounded to bf16 or f16 next: the division (vrcpps's 2^-12 is too coarse
 * for f16). */
static inline vf vdiv_half(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vm vlt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
static inline vm vge(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
static inline vm veq(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
static inline vm vnotlt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_NLT_UQ); }
static inline vm vmand(vm a, vm b) { return _mm256_and_ps(a, b); }
static inline int vany(vm m) { return _mm256_movemask_ps(m) != 0; }
static inline int vall(vm m) { return _mm256_movemask_ps(m) == 0xff; }
static inline vf vsel(vm m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); }
static inline vf vmaskz(vm m, vf a) { return _mm256_and_ps(m, a); }

#include "isa_poly.h"

/* 2^x to about 2 ulp: clamp to [-127, 128], x = n + f, degree-5 polynomial for 2^f, 2^n built
 * in the exponent field (n = -127 gives 0, n = 128 gives inf). NaN passes through the clamps
 * (the data is the second operand of max/min). half: vexp2_half_poly's degree 3. */
static inline vf vexp2_to(vf x, const int half)
{
    x = _mm256_min_ps(_mm256_set1_ps(128.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), x));
    vf n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf f = _mm256_sub_ps(x, n);
    const vf p = half ? vexp2_half_poly(f) : vexp2_poly(f);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline vf vexp2(vf x) { return vexp2_to(x, 0); }

/* (float)(a[i + x] - b[i + x]) for x < VL, the differences in double (b NULL: zeros). */
static inline vf vload_dsub(const double *a, const double *b, int64_t i)
{
    __m256d lo = _mm256_loadu_pd(a + i), hi = _mm256_loadu_pd(a + i + 4);
    if (b) {
        lo = _mm256_sub_pd(lo, _mm256_loadu_pd(b + i));
        hi = _mm256_sub_pd(hi, _mm256_loadu_pd(b + i + 4));
    }
    return _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
}

static inline vf vload_in(const void *src, fw_dtype dt, int64_t i)
{
    if (dt == FW_F32)
        return _mm256_loadu_ps((const float *)src + i);
    if (dt == FW_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))), 16));
    if (dt == FW_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i)));
    /* 8-bit floats through f16 bits (kern/isa.h: vload_in) */
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)src + i)));
    if (dt == FW_F8E5M2)
        return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
    const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(w, 8), _mm_set1_epi16((short)0x8000)),
                                   _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(0x3f80)));
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7f));
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7e00)))),
                         _mm256_set1_ps(256.0f));
}

static inline void cvt_in_vec(const void *src, fw_dtype dt, int64_t i, float scale, float *dst)
{
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(vload_in(src, dt, i), _mm256_set1_ps(scale)));
}

static inline float vhmax(vf x)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline vf vload_bits(const void *p) { return _mm256_loadu_ps(p); }
static inline vf vbf16_even(vf w) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(w), 16)); }
static inline vf vbf16_odd(vf w)
{
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(w), _mm256_set1_epi32((int)0xffff0000u)));
}

/* In-register transpose of 8 rows of 8: unpack, shuffle pairs, swap 128-bit halves. */
static inline void vtranspose(vf *r)
{
    vf t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    /* u[4g + c], 128-bit lane L, holds rows 4g..4g+3 of column 4L + c */
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}

/* x rounded to bf16 (nearest even; NaN stays NaN), as f32 bits with a zero low half. */
static inline __m256i vround_bf16_bits(vf x)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
}

/* VL floats stored as dtype dt at element i of dst (rounded to nearest even). */
/* VL floats as VL f16 or bf16 (dt), rounded to nearest even. */
static inline __m128i vhalf_bits(vf x, fw_dtype dt)
{
    if (dt == FW_F16)
        return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i r = _mm256_srli_epi32(vround_bf16_bits(x), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline void vstore_as(void *dst, fw_dtype dt, int64_t i, vf x)
{
    if (dt == FW_F32)
        _mm256_storeu_ps((float *)dst + i, x);
    else
        _mm_storeu_si128((__m128i *)((uint16_t *)dst + i), vhalf_bits(x, dt));
}

static inline void cvt_out_vec(const float *src, int64_t i, void *dst, fw_dtype dt)
{
    vstore_as(dst, dt, i, _mm256_loadu_ps(src + i));
}

/* vstore_as with a non-temporal store; dst + i aligned to the vector's bytes (32 for f32,
 * 16 for bf16 and f16); ordered for other threads by vstream_fence. */
static inline void vstream_as(void *dst, fw_dtype dt, int64_t i, vf x)
{
    if (dt == FW_F32)
        _mm256_stream_ps((float *)dst + i, x);
    else
        _mm_stream_si128((__m128i *)((uint16_t *)dst + i), vhalf_bits(x, dt));
}

static inline void vstream_fence(void) { _mm_sfence(); }

/* No one-store form of a vector pair (vstore2_as in conv/conv_kern.h stores them one by one). */
static inline int vstore2_native(void *dst, fw_dtype dt, int64_t i, vf lo, vf hi, int nt) { return 0; }

/* ---- bf16 pairs (see "bf16 products" in kern/mm_kern.h), emulated with f32 FMAs. */
static inline vf vbcast_word(const uint32_t *p) { return _mm256_castsi256_ps(_mm256_set1_epi32((int)*p)); }

static inline vf vdpbf(vf acc, vf a, vf b)
{
    return vfma(vbf16_even(a), vbf16_even(b), vfma(vbf16_odd(a), vbf16_odd(b), acc));
}

static inline vf vbf16_pair(vf even, vf odd)
{
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_srli_epi32(vround_bf16_bits(even), 16),
                                               vround_bf16_bits(odd)));
}

/* The 2 VL elements lo, hi of a row rounded to bf16, in order: word i = (x[2i], x[2i+1]).
 * packus works within 128-bit lanes; the 64-bit permute puts the halves back in order. */
static inline vf vbf16_row(vf lo, vf hi)
{
    const __m256i p = _mm256_packus_epi32(_mm256_srli_epi32(vround_bf16_bits(lo), 16),
                                          _mm256_srli_epi32(vround_bf16_bits(hi), 16));
    return _mm256_castsi256_ps(_mm256_permute4x64_epi64(p, _MM_SHUFFLE(3, 1, 2, 0)));
}

/* Pair words of two rows' bf16, 2 VL columns (see isa_avx512.h): lane L of lo holds columns
 * 8L .. 8L+3, of hi 8L+4 .. 8L+7. */
static inline void vpair_bits(vf a, vf b, vf *lo, vf *hi)
{
    const __m256i x = _mm256_castps_si256(a), y = _mm256_castps_si256(b);
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(x, y));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(x, y));
}

/* 2 VL f32 columns of o in vpair_rows_bf16's order, and back. */
static inline void vcols_to_pairs(const float *o, vf *lo, vf *hi)
{
    const vf o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8);
    *lo = _mm256_permute2f128_ps(o0, o1, 0x20);
    *hi = _mm256_permute2f128_ps(o0, o1, 0x31);
}

static inline void vpairs_to_cols(float *o, vf lo, vf hi)
{
    _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* 2 VL f32 columns of o split into the even and the odd ones, the order vbf16_even and
 * vbf16_odd give a bf16 row's 2 VL elements (the decode's bf16 values, DEC_PV_EO), and back. */
#define DEC_PV_EO 1
static inline void vcols_to_eo(const float *o, vf *e, vf *od)
{
    const vf a = _mm256_loadu_ps(o), b = _mm256_loadu_ps(o + 8);
    *e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
    *od = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
}

static inline void veo_to_cols(float *o, vf e, vf od)
{
    const vf lo = _mm256_unpacklo_ps(e, od), hi = _mm256_unpackhi_ps(e, od);
    _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* Lane i of the result: the sum of a[i]'s lanes, i < 8 (a tree; see isa_avx512.h). */
static inline vf vsum_each(const vf *a)
{
    vf x[4], y[2];
    for (int i = 0; i < 4; i++)
        x[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        y[i] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20), _mm256_permute2f128_ps(y[0], y[1], 0x31));
}

/* The lanes as 4 rows of 2: lanes 2r, 2r+1 to dst + r * ld. */
static inline void vstore_rows(float *dst, int64_t ld, vf t)
{
    const __m128 lo = _mm256_castps256_ps128(t), hi = _mm256_extractf128_ps(t, 1);
    _mm_storel_pi((__m64 *)dst, lo);
    _mm_storeh_pi((__m64 *)(dst + ld), lo);
    _mm_storel_pi((__m64 *)(dst + 2 * ld), hi);
    _mm_storeh_pi((__m64 *)(dst + 3 * ld), hi);
}

static inline float vhsum(vf x)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define PEAK_CHAINS 12
