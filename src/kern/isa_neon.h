/* isa_neon.h: the thin vector layer for AArch64's Advanced SIMD (NEON). 4 floats per vector,
 * 32 registers. Armv8.0-A baseline: f32 FMA, and the f16 <-> f32 conversions (FCVTL, FCVTN),
 * which every AArch64 core has. Compiled with FEAT_BF16 (neon_bf16.c), the bf16 pair products
 * run on BFDOT; without, they are emulated with f32 FMAs on the same pairs. Conversions to
 * bf16 round in integer arithmetic on both tables (BFCVTN would give a NaN the default NaN's
 * sign, not its own). */
#include <arm_neon.h>
#include <string.h>

#ifdef __ARM_FEATURE_BF16_VECTOR_ARITHMETIC
#define ISA_NAME "neon_bf16"
#else
#define ISA_NAME "neon"
#endif
#define VL 4
#define TM 4 /* vectors of query rows per register tile: 4 x 4 = 16 rows */
/* QK_TJ: 4 x 4 = 16 accumulator chains (with 3, 12: 74% of the FMA pipes in llvm-mca's
 * Neoverse V1 schedule, whose FMLA chain is 4 cycles; 92% with 4, 99% for BFDOT), and 64-key
 * tiles hold whole register tiles; the 16 running totals live outside the inner loop */
#define QK_TJ 4
/* TJ: 5 x 4 = 20 accumulators + 4 row vectors + 5 value broadcasts, which gcc loads at the top
 * of each key's step: with 6, 34 registers, and two accumulators spilled to the stack every
 * step (tools/mca_aarch64.py, Neoverse V1: pv's loop predicted at 40% of the FMA pipes, the
 * reloads ordered after their stores; 94% with 5) */
#define TJ 5
#define DEC_RT 4 /* decode: 4 rows x 2 key vectors x 2 sets = 16 accumulators */
/* decode from key rows: 4 blocks of 4 rows x 1 key side by side, 16 accumulators (alone, a
 * block's 4 chains fill a quarter of the FMA pipes in llvm-mca's schedule for Neoverse V1) */
#define DQ_NB 4

typedef float32x4_t vf;
typedef uint32x4_t vm;

static inline vf vload(const float *p) { return vld1q_f32(p); }
static inline void vstore(float *p, vf x) { vst1q_f32(p, x); }
static inline vf vset1(float x) { return vdupq_n_f32(x); }
/* A value the compiler must hold in a register (not reload it at each use). */
static inline vf vkeep(vf x) { __asm__("" : "+w"(x)); return x; }
static inline vf vzero(void) { return vdupq_n_f32(0.0f); }
static inline vf vfma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf vadd(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vsub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vmul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vdiv(vf a, vf b) { return vdivq_f32(a, b); }
/* (FRECPE's 2^-8 would need two Newton steps to reach 2^-14: the division) */
static inline vf vdiv_half(vf a, vf b) { return vdivq_f32(a, b); }
/* max(a, b), b where either is NaN (FMAX would return the NaN of either): a select, as the
 * x86 tables' max. */
static inline vf vmax(vf a, vf b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline vm vlt(vf a, vf b) { return vcltq_f32(a, b); }
static inline vm vge(vf a, vf b) { return vcgeq_f32(a, b); }
static inline vm veq(vf a, vf b) { return vceqq_f32(a, b); }
static inline vm vnotlt(vf a, vf b) { return vmvnq_u32(vcltq_f32(a, b)); }
static inline vm vmand(vm a, vm b) { return vandq_u32(a, b); }
static inline int vany(vm m) { return vmaxvq_u32(m) != 0; }
static inline int vall(vm m) { return vminvq_u32(m) == 0xffffffffu; }
static inline vf vsel(vm m, vf a, vf b) { return vbslq_f32(m, a, b); }
static inline vf vmaskz(vm m, vf a) { return vreinterpretq_f32_u32(vandq_u32(m, vreinterpretq_u32_f32(a))); }

#include "isa_poly.h"

/* 2^x to about 2 ulp: clamp to [-127, 128], x = n + f, degree-5 polynomial for 2^f, 2^n built
 * in the exponent field (n = -127 gives 0, n = 128 gives inf). FMAX / FMIN pass a NaN on, and
 * its n converts to 0: NaN times 1. half: vexp2_half_poly's degree 3. */
static inline vf vexp2_to(vf x, const int half)
{
    x = vminq_f32(vdupq_n_f32(128.0f), vmaxq_f32(vdupq_n_f32(-127.0f), x));
    const vf n = vrndnq_f32(x);
    const vf f = vsubq_f32(x, n);
    const vf p = half ? vexp2_half_poly(f) : vexp2_poly(f);
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

static inline vf vexp2(vf x) { return vexp2_to(x, 0); }

/* (float)(a[i + x] - b[i + x]) for x < VL, the differences in double (b NULL: zeros). */
static inline vf vload_dsub(const double *a, const double *b, int64_t i)
{
    float64x2_t lo = vld1q_f64(a + i), hi = vld1q_f64(a + i + 2);
    if (b) {
        lo = vsubq_f64(lo, vld1q_f64(b + i));
        hi = vsubq_f64(hi, vld1q_f64(b + i + 2));
    }
    return vcvt_high_f32_f64(vcvt_f32_f64(lo), hi);
}

/* Four bytes at p, widened to the low half of 16-bit lanes. */
static inline uint16x4_t vload_bytes4(const uint8_t *p)
{
    uint32_t w;
    memcpy(&w, p, 4);
    return vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w))));
}

static inline vf vload_in(const void *src, fw_dtype dt, int64_t i)
{
    if (dt == FW_F32)
        return vld1q_f32((const float *)src + i);
    if (dt == FW_BF16)
        return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)src + i), 16));
    if (dt == FW_F16)
        return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)src + i)));
    /* 8-bit floats through f16 bits (kern/isa.h: vload_in) */
    const uint16x4_t w = vload_bytes4((const uint8_t *)src + i);
    if (dt == FW_F8E5M2)
        return vcvt_f32_f16(vreinterpret_f16_u16(vshl_n_u16(w, 8)));
    const uint16x4_t h = vorr_u16(vand_u16(vshl_n_u16(w, 8), vdup_n_u16(0x8000)),
                                  vand_u16(vshl_n_u16(w, 7), vdup_n_u16(0x3f80)));
    const uint16x4_t nan = vceq_u16(vand_u16(w, vdup_n_u16(0x7f)), vdup_n_u16(0x7f));
    return vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vorr_u16(h, vand_u16(nan, vdup_n_u16(0x7e00))))),
                     vdupq_n_f32(256.0f));
}

static inline void cvt_in_vec(const void *src, fw_dtype dt, int64_t i, float scale, float *dst)
{
    vst1q_f32(dst + i, vmulq_f32(vload_in(src, dt, i), vdupq_n_f32(scale)));
}

/* the largest lane: halves, then pairs, with vmax's rule for NaN (as the AVX2 table) */
static inline float vhmax(vf x)
{
    const vf m = vmax(x, vextq_f32(x, x, 2));
    return vgetq_lane_f32(vmax(m, vextq_f32(m, m, 1)), 0);
}

static inline vf vload_bits(const void *p) { return vld1q_f32((const float *)p); }
static inline vf vbf16_even(vf w) { return vreinterpretq_f32_u32(vshlq_n_u32(vreinterpretq_u32_f32(w), 16)); }
static inline vf vbf16_odd(vf w)
{
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(w), vdupq_n_u32(0xffff0000u)));
}

/* In-register transpose of 4 rows of 4: 32-bit then 64-bit interleaves. */
static inline void vtranspose(vf *r)
{
    const vf t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
    const vf t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
#define F64(x) vreinterpretq_f64_f32(x)
    r[0] = vreinterpretq_f32_f64(vtrn1q_f64(F64(t0), F64(t2)));
    r[1] = vreinterpretq_f32_f64(vtrn1q_f64(F64(t1), F64(t3)));
    r[2] = vreinterpretq_f32_f64(vtrn2q_f64(F64(t0), F64(t2)));
    r[3] = vreinterpretq_f32_f64(vtrn2q_f64(F64(t1), F64(t3)));
#undef F64
}

/* x rounded to bf16 (nearest even; NaN stays NaN, made quiet), as f32 bits with a zero low
 * half. */
static inline uint32x4_t vround_bf16_bits(vf x)
{
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    uint32x4_t r = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1))));
    const uint32x4_t num = vceqq_f32(x, x);
    r = vbslq_u32(num, r, vorrq_u32(u, vdupq_n_u32(0x400000)));
    return vandq_u32(r, vdupq_n_u32(0xffff0000u));
}

/* VL floats as VL f16 or bf16 (dt), rounded to nearest even. */
static inline uint16x4_t vhalf_bits(vf x, fw_dtype dt)
{
    if (dt == FW_F16)
        return vreinterpret_u16_f16(vcvt_f16_f32(x));
    return vshrn_n_u32(vround_bf16_bits(x), 16);
}

/* VL floats stored as dtype dt at element i of dst (rounded to nearest even). */
static inline void vstore_as(void *dst, fw_dtype dt, int64_t i, vf x)
{
    if (dt == FW_F32)
        vst1q_f32((float *)dst + i, x);
    else
        vst1_u16((uint16_t *)dst + i, vhalf_bits(x, dt));
}

static inline void cvt_out_vec(const float *src, int64_t i, void *dst, fw_dtype dt)
{
    vstore_as(dst, dt, i, vld1q_f32(src + i));
}

/* No non-temporal store in the intrinsics (STNP is a hint, and only for pairs of registers):
 * plain stores, nothing to order. */
static inline void vstream_as(void *dst, fw_dtype dt, int64_t i, vf x) { vstore_as(dst, dt, i, x); }
static inline void vstream_fence(void) {}

/* No one-store form of a vector pair (vstore2_as in conv/conv_kern.h stores them one by one). */
static inline int vstore2_native(void *dst, fw_dtype dt, int64_t i, vf lo, vf hi, int nt) { return 0; }

/* ---- bf16 pairs (see "bf16 products" in kern/mm_kern.h) */
static inline vf vbcast_word(const uint32_t *p) { return vreinterpretq_f32_u32(vld1q_dup_u32(p)); }

#ifdef __ARM_FEATURE_BF16_VECTOR_ARITHMETIC
/* A word operand (kern/isa.h: vload_word) is the word in the low lane of a 64-bit vector, one
 * LDR; vdpbf_by multiplies by that element (BFDOT by element). A broadcast costs a DUP or LD1R
 * on the FMA pipes: in mm's bf16 tiles 3 for every 12 BFDOT, which held them to 74-80% of the
 * pipes in llvm-mca's schedule (tools/mca_aarch64.py). */
#define ISA_WORD_OPERAND 1
typedef bfloat16x4_t vw;
static inline vw vload_word(const uint32_t *p) { return vreinterpret_bf16_u64(vcreate_u64((uint64_t)*p)); }
static inline vf vdpbf_by(vf acc, vf a, vw w) { return vbfdotq_lane_f32(acc, vreinterpretq_bf16_f32(a), w, 0); }

/* BFDOT: each lane's two products and the accumulator, as Armv8.6's BFDotAdd without
 * FEAT_EBF16: the pair's sum, then the total, each rounded to odd, bf16 and f32 subnormals
 * flushed to zero, and any NaN the default NaN (kern/isa.h lets a table read bf16 denormals
 * as zero; the tests hold each table to its own bar). */
static inline vf vdpbf(vf acc, vf a, vf b)
{
    return vbfdotq_f32(acc, vreinterpretq_bf16_f32(a), vreinterpretq_bf16_f32(b));
}

/* BFMMLA: a 2x4 by 4x2 bf16 block product, two BFDotAdds per lane in word order, so a chain
 * of them gives the bits of the same chain of BFDOTs. llvm-mca's Neoverse V1, V2 and N2 models
 * issue it at BFDOT's rate with twice the products: mm's bf16 tiles run on it (mm_mmla.h). */
#define ISA_MMLA 1
static inline vf vmmla(vf acc, vf a, vf b)
{
    return vbfmmlaq_f32(acc, vreinterpretq_bf16_f32(a), vreinterpretq_bf16_f32(b));
}
static inline void vzip_words(vf a, vf b, vf *lo, vf *hi)
{
    *lo = vzip1q_f32(a, b);
    *hi = vzip2q_f32(a, b);
}
static inline vf vload_halves(const uint32_t *p0, const uint32_t *p1)
{
    return vreinterpretq_f32_u32(vcombine_u32(vld1_u32(p0), vld1_u32(p1)));
}
static inline void vzip_halves(vf a, vf b, vf *lo, vf *hi)
{
    *lo = vreinterpretq_f32_f64(vzip1q_f64(vreinterpretq_f64_f32(a), vreinterpretq_f64_f32(b)));
    *hi = vreinterpretq_f32_f64(vzip2q_f64(vreinterpretq_f64_f32(a), vreinterpretq_f64_f32(b)));
}
#else
static inline vf vdpbf(vf acc, vf a, vf b)
{
    return vfma(vbf16_even(a), vbf16_even(b), vfma(vbf16_odd(a), vbf16_odd(b), acc));
}
#endif

static inline vf vbf16_pair(vf even, vf odd)
{
    return vreinterpretq_f32_u32(vorrq_u32(vshrq_n_u32(vround_bf16_bits(even), 16), vround_bf16_bits(odd)));
}

/* The 2 VL elements lo, hi of a row rounded to bf16, in order: word l = (x[2l], x[2l+1]). */
static inline vf vbf16_row(vf lo, vf hi)
{
    const uint16x8_t h = vcombine_u16(vshrn_n_u32(vround_bf16_bits(lo), 16), vshrn_n_u32(vround_bf16_bits(hi), 16));
    return vreinterpretq_f32_u16(h);
}

/* Pair words of two rows' bf16, 2 VL columns in order: lo holds columns 0..3, hi 4..7. */
static inline void vpair_bits(vf a, vf b, vf *lo, vf *hi)
{
    const uint16x8_t x = vreinterpretq_u16_f32(a), y = vreinterpretq_u16_f32(b);
    *lo = vreinterpretq_f32_u16(vzip1q_u16(x, y));
    *hi = vreinterpretq_f32_u16(vzip2q_u16(x, y));
}

/* 2 VL f32 columns of o in vpair_rows_bf16's order (their own), and back. */
static inline void vcols_to_pairs(const float *o, vf *lo, vf *hi)
{
    *lo = vld1q_f32(o);
    *hi = vld1q_f32(o + 4);
}

static inline void vpairs_to_cols(float *o, vf lo, vf hi)
{
    vst1q_f32(o, lo);
    vst1q_f32(o + 4, hi);
}

/* Lane i of the result: the sum of a[i]'s lanes, i < 4 (pairwise adds: (a0 + a1) + (a2 + a3)). */
static inline vf vsum_each(const vf *a)
{
    return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3]));
}

/* The lanes as 4 rows of 1: lane r to dst + r ld. */
static inline void vstore_rows(float *dst, int64_t ld, vf t)
{
    vst1q_lane_f32(dst, t, 0);
    vst1q_lane_f32(dst + ld, t, 1);
    vst1q_lane_f32(dst + 2 * ld, t, 2);
    vst1q_lane_f32(dst + 3 * ld, t, 3);
}

static inline float vhsum(vf x) { return vaddvq_f32(x); }

/* FMLA: 4 cycles' latency on 2 (Neoverse N1, N2) to 4 (V1, V2) pipes: 16 chains fill them;
 * 24, with the two operands, stay within the 32 registers. */
#define PEAK_CHAINS 24
