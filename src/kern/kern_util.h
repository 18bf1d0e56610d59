/* kern/kern_util.h: what the op kernel files share, written over the vector layer: included
 * by kern/table.h after the ISA's isa_*.h and before the kernel files. */
#include <math.h>
#include <stdint.h>
#include <time.h>

#define FW_INLINE static inline __attribute__((always_inline))

/* The products' sum over k (mm's qk and the decode's, kern/mm_kern.h and attn/dec_kern.h)
 * runs in blocks of QK_KB steps: each block starts from zero and is added to a running total,
 * both kept in registers (QK_TJ keys x TM vectors x 2 sets). The rounding error then grows
 * like QK_KB + d / QK_KB instead of d, as accurate as the plain kernel's SIMD-lane partial
 * sums; with one sequential chain, logits near 1e4 failed the 2x-plain bar. Measured on
 * AVX-512 (M = 64, 64 keys, d = 128): a running total kept in ST instead of registers cost
 * 11-35% of qk throughput; this form costs none. */
#define QK_KB 8

/* tanh(x): 1 - 2 / (2^(2 x log2 e) + 1), where inf and 0 at the ends give exactly +-1; below
 * |x| = 1/4, where that form cancels (at x = 0.01 its error is 1e-5 relative, a softcap of 30
 * multiplies it into the scores), the Taylor series to x^11 (the next term is below 1e-9
 * relative there). */
FW_INLINE vf vtanh(vf x)
{
    const vf one = vset1(1.0f), x2 = vmul(x, x);
    const vf big = vsub(one, vdiv(vset1(2.0f), vadd(vexp2(vmul(vset1(2.0f * (float)FW_LOG2E), x)), one)));
    vf p = vset1(-1382.0f / 155925.0f);
    p = vadd(vmul(p, x2), vset1(62.0f / 2835.0f));
    p = vadd(vmul(p, x2), vset1(-17.0f / 315.0f));
    p = vadd(vmul(p, x2), vset1(2.0f / 15.0f));
    p = vadd(vmul(p, x2), vset1(-1.0f / 3.0f));
    p = vadd(vmul(vmul(p, x2), x), x);
    return vsel(vlt(x2, vset1(0.0625f)), p, big);
}

/* Key indices of a 64-key tile, loaded a vector at a time to mask keys by position (decode,
 * backward, GDN's gates). */
static const float dec_iota[FW_DEC_KEYS] = {
    0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
    22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43,
    44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};

/* One element of dtype dt at index i of p, as f32. */
FW_INLINE float load_as_f32(const void *p, fw_dtype dt, int64_t i) { return fw_load_elem(p, dt, i); }
