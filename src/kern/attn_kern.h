/*
 * attn_kern.h: the attention micro-kernels, written once over the vector layer (isa_*.h)
 * and compiled once per ISA with only that ISA's flags. Included by portable.c, avx2.c and
 * avx512.c after their isa_*.h; defines the table FW_TABLE.
 *
 * Tile layout (see internal.h): vectors run along query rows, so
 *   qk:  ST[j][m] = bias[m] + sum_k K[j][k] QT[k][m]   broadcast K[j][k], load QT[k][m..]
 *   pv:  OT[c][m] += sum_j V[j][c] PT[j][m]            broadcast V[j][c], load PT[j][m..]
 * Both keep TJ x TM accumulators in registers (AVX-512: 6 x 4 zmm = 24 of 32 registers; per
 * k step 4 vector loads + 6 broadcasts feed 24 FMAs, so the loads never limit the 2 FMA
 * pipes). Every FMA chain runs over k (or j) in order, one per output, so a result does not
 * depend on how rows are grouped into tiles.
 */
#include <math.h>
#include <stdint.h>
#include <time.h>

#define FW_INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------- conversion -- */

/* Strided bf16 / f16 rows move their 16-bit elements through a contiguous block of this many,
 * converted in vectors (the scalar conversions, a rounding with its NaN test per element, took
 * 45% of a decode of Qwen3-Next's conv with transformers' [batch, dim, state_len] state,
 * whose rows have a stride of 4: 66 us a call for 8192 channels). */
#define CVT_BLOCK 256

static void to_f32(const void *src, fw_dtype dt, int64_t stride, int64_t n, float scale, float *dst)
{
    int64_t i = 0;
    if (stride == 1)
        for (; i + VL <= n; i += VL)
            cvt_in_vec(src, dt, i, scale, dst);
    else if (dt != FW_F32)
        for (; i + VL <= n;) {
            uint16_t h[CVT_BLOCK];
            const uint16_t *s = (const uint16_t *)src + i * stride;
            const int m = (int)((n - i < CVT_BLOCK ? n - i : CVT_BLOCK) / VL * VL);
            for (int e = 0; e < m; e++)
                h[e] = s[e * stride];
            for (int e = 0; e < m; e += VL)
                cvt_in_vec(h, dt, e, scale, dst + i);
            i += m;
        }
    for (; i < n; i++) {
        int64_t o = i * stride;
        float x = dt == FW_F32 ? ((const float *)src)[o]
                  : dt == FW_BF16 ? fw_cvt_bf16_f32(((const uint16_t *)src)[o])
                                  : fw_cvt_f16_f32(((const uint16_t *)src)[o]);
        dst[i] = x * scale;
    }
}

static void from_f32(const float *src, int64_t n, void *dst, fw_dtype dt, int64_t stride)
{
    int64_t i = 0;
    if (stride == 1)
        for (; i + VL <= n; i += VL)
            cvt_out_vec(src, i, dst, dt);
    else if (dt != FW_F32)
        for (; i + VL <= n;) {
            uint16_t h[CVT_BLOCK];
            uint16_t *d = (uint16_t *)dst + i * stride;
            const int m = (int)((n - i < CVT_BLOCK ? n - i : CVT_BLOCK) / VL * VL);
            for (int e = 0; e < m; e += VL)
                cvt_out_vec(src + i, e, h, dt);
            for (int e = 0; e < m; e++)
                d[e * stride] = h[e];
            i += m;
        }
    for (; i < n; i++) {
        int64_t o = i * stride;
        if (dt == FW_F32)
            ((float *)dst)[o] = src[i];
        else if (dt == FW_BF16)
            ((uint16_t *)dst)[o] = fw_cvt_f32_bf16(src[i]);
        else
            ((uint16_t *)dst)[o] = fw_cvt_f32_f16(src[i]);
    }
}

/* ---------------------------------------------------------------------- qk -- */

/* The sum over k runs in blocks of QK_KB steps: each block starts from zero and is added
 * to a running total, both kept in registers (QK_TJ keys x TM vectors x 2 sets). The
 * rounding error then grows like QK_KB + d / QK_KB instead of d, as accurate as the plain
 * kernel's SIMD-lane partial sums; with one sequential chain, logits near 1e4 failed the
 * 2x-plain bar. Measured on AVX-512 (M = 64, 64 keys, d = 128): a running total kept in ST
 * instead of registers cost 11-35% of qk throughput; this form costs none. */
#define QK_KB 8
/* a load at byte offset b of a row starts a cache line (rows are 64-byte aligned where it
 * counts): the decode kernels prefetch the line of the rows read next there */
#define DEC_PF_LINE(b) ((b) % 64 == 0)

/* The line at byte offset b of the next rows j and j + 1, those of them below nn. */
FW_INLINE void dec_pf_pair(const void *const *next, int nn, int j, size_t b)
{
    if (j < nn)
        __builtin_prefetch((const char *)next[j] + b, 0, 2);
    if (j + 1 < nn)
        __builtin_prefetch((const char *)next[j + 1] + b, 0, 2);
}

FW_INLINE void qk_tile(const int tj, const int tm, int d, int M, const float *K, int64_t ldk,
                       const float *QT, const float *bias, float *ST)
{
    vf tot[QK_TJ][TM], acc[QK_TJ][TM];
    for (int m = 0; m < tm; m++) {
        vf b = vload(bias + m * VL);
        for (int j = 0; j < tj; j++)
            tot[j][m] = b;
    }
    for (int k0 = 0; k0 < d; k0 += QK_KB) {
        /* full blocks get a constant trip count, so the compiler unrolls them */
        const int kn = d - k0 < QK_KB ? d - k0 : QK_KB;
        for (int j = 0; j < tj; j++)
            for (int m = 0; m < tm; m++)
                acc[j][m] = vzero();
        for (int k = k0; k < k0 + (kn == QK_KB ? QK_KB : kn); k++) {
            vf q[TM];
            for (int m = 0; m < tm; m++)
                q[m] = vkeep(vload(QT + (int64_t)k * M + m * VL));
            for (int j = 0; j < tj; j++) {
                vf kb = vset1(K[j * ldk + k]);
                for (int m = 0; m < tm; m++)
                    acc[j][m] = vfma(q[m], kb, acc[j][m]);
            }
        }
        for (int j = 0; j < tj; j++)
            for (int m = 0; m < tm; m++)
                tot[j][m] = vadd(tot[j][m], acc[j][m]);
    }
    for (int j = 0; j < tj; j++)
        for (int m = 0; m < tm; m++)
            vstore(ST + (int64_t)j * M + m * VL, tot[j][m]);
}

/* Row tails (tm < TM: fewer than TM*VL rows left) are rare: only small tiles have them. */
static __attribute__((noinline)) void qk_tile_tail(int tj, int tm, int d, int M, const float *K,
                                                   int64_t ldk, const float *QT, const float *bias,
                                                   float *ST)
{
    qk_tile(tj, tm, d, M, K, ldk, QT, bias, ST);
}

static void qk(int nk, int d, int M, const float *K, int64_t ldk, const float *QT,
               const float *bias, float *ST)
{
    for (int m0 = 0; m0 < M; m0 += TM * VL) {
        int tm = (M - m0) / VL < TM ? (M - m0) / VL : TM;
        for (int j0 = 0; j0 < nk; j0 += QK_TJ) {
            int tj = nk - j0 < QK_TJ ? nk - j0 : QK_TJ;
            const float *Kj = K + j0 * ldk;
            float *S = ST + (int64_t)j0 * M + m0;
            if (tm < TM)
                qk_tile_tail(tj, tm, d, M, Kj, ldk, QT + m0, bias + m0, S);
            else if (tj == QK_TJ)
                qk_tile(QK_TJ, TM, d, M, Kj, ldk, QT + m0, bias + m0, S);
            else if (tj == 2)
                qk_tile(2, TM, d, M, Kj, ldk, QT + m0, bias + m0, S);
            else
                qk_tile(1, TM, d, M, Kj, ldk, QT + m0, bias + m0, S);
        }
    }
}

/* ---------------------------------------------------------------------- pv -- */

FW_INLINE void pv_tile(const int tc, const int tm, int nk, int M, const float *V, int64_t ldv,
                       const float *PT, float *OT)
{
    vf acc[TJ][TM];
    for (int c = 0; c < tc; c++)
        for (int m = 0; m < tm; m++)
            acc[c][m] = vload(OT + (int64_t)c * M + m * VL);
    for (int j = 0; j < nk; j++) {
        vf p[TM];
        for (int m = 0; m < tm; m++)
            p[m] = vload(PT + (int64_t)j * M + m * VL);
        const float *vr = V + j * ldv;
        for (int c = 0; c < tc; c++) {
            vf vb = vset1(vr[c]);
            for (int m = 0; m < tm; m++)
                acc[c][m] = vfma(p[m], vb, acc[c][m]);
        }
    }
    for (int c = 0; c < tc; c++)
        for (int m = 0; m < tm; m++)
            vstore(OT + (int64_t)c * M + m * VL, acc[c][m]);
}

static __attribute__((noinline)) void pv_tile_tail(int tc, int tm, int nk, int M, const float *V,
                                                   int64_t ldv, const float *PT, float *OT)
{
    pv_tile(tc, tm, nk, M, V, ldv, PT, OT);
}

static void pv(int nk, int dv, int M, const float *V, int64_t ldv, const float *PT, float *OT)
{
    for (int m0 = 0; m0 < M; m0 += TM * VL) {
        int tm = (M - m0) / VL < TM ? (M - m0) / VL : TM;
        for (int c0 = 0; c0 < dv; c0 += TJ) {
            int tc = dv - c0 < TJ ? dv - c0 : TJ;
            const float *Vc = V + c0;
            float *O = OT + (int64_t)c0 * M + m0;
            if (tm < TM) {
                pv_tile_tail(tc, tm, nk, M, Vc, ldv, PT + m0, O);
                continue;
            }
            switch (tc) {
            case 6: pv_tile(6, TM, nk, M, Vc, ldv, PT + m0, O); break;
            case 5: pv_tile(5, TM, nk, M, Vc, ldv, PT + m0, O); break;
            case 4: pv_tile(4, TM, nk, M, Vc, ldv, PT + m0, O); break;
            case 3: pv_tile(3, TM, nk, M, Vc, ldv, PT + m0, O); break;
            case 2: pv_tile(2, TM, nk, M, Vc, ldv, PT + m0, O); break;
            default: pv_tile(1, TM, nk, M, Vc, ldv, PT + m0, O); break;
            }
        }
    }
}

/* ------------------------------------------------------------ bf16 products --
 *
 * "Pair layout": bf16 operands hold two adjacent elements of the reduction in one 32-bit
 * word, the even one in the low half. It is the operand layout of vdpbf16ps (one word per
 * f32 lane), of AMX-BF16 B tiles (pair-interleaved rows) and of Arm's BFDOT/BFMMLA, so a
 * table for any of them packs the same panels:
 *   QW [dw][M]           the q tile, unscaled: QW[w][m] = (q_m[2w], q_m[2w+1]), dw = ceil(d/2)
 *   K  [nk][2 ldkw]      bf16 key rows as they lie, zero past d: word w = (K[j][2w], K[j][2w+1])
 *   PW [ceil(nk/2)][M]   probabilities: PW[w][m] = (P[2w][m], P[2w+1][m])
 *   VW [ceil(nk/2)][dv]  value rows in pairs of keys: VW[w][c] = (V[2w][c], V[2w+1][c]);
 *                        pack_vw packs it, and a table may choose its own form (AMX: VW^T)
 * Products are exact in f32 and accumulate in f32, so the error is the f32 kernel's plus
 * the rounding of the operands to bf16. The scale is applied in f32 after the reduction,
 * never folded into a bf16 operand. Each accumulator chain runs over the words in order, as
 * in the f32 kernels. */

/* dst[i] = (even[i], odd[i]) rounded to bf16, i < n; odd = NULL gives zeros there. */
static void pack_pairs(const float *even, const float *odd, int n, uint32_t *dst)
{
    int i = 0;
    if (odd)
        for (; i + VL <= n; i += VL)
            vstore((float *)dst + i, vbf16_pair(vload(even + i), vload(odd + i)));
    else
        for (; i + VL <= n; i += VL)
            vstore((float *)dst + i, vbf16_pair(vload(even + i), vzero()));
    for (; i < n; i++)
        dst[i] = (uint32_t)fw_cvt_f32_bf16(even[i]) | (uint32_t)(odd ? fw_cvt_f32_bf16(odd[i]) : 0) << 16;
}

/* dst[w] = (x[2w], x[2w+1]) rounded to bf16 for w < ceil(n/2), zero past n. */
static void pack_row_pairs(const float *x, int n, uint32_t *dst)
{
    int w = 0;
    for (; 2 * (w + VL) <= n; w += VL)
        vstore((float *)dst + w, vbf16_row(vload(x + 2 * w), vload(x + 2 * w + VL)));
    for (; w < (n + 1) / 2; w++)
        dst[w] = (uint32_t)fw_cvt_f32_bf16(x[2 * w]) | (uint32_t)(2 * w + 1 < n ? fw_cvt_f32_bf16(x[2 * w + 1]) : 0) << 16;
}

/* VW[w][c] = (X[2w][c], X[2w+1][c]) rounded to bf16: row pairs in the pair layout; bf16 rows
 * (already their values) through f32, a pair of rows at a time. */
static void pack_vw(const void *X, fw_dtype dt, int n, int cols, uint32_t *VW)
{
    float row[2][FW_MAX_HEAD_DIM];
    const size_t es = dt == FW_F32 ? sizeof(float) : sizeof(uint16_t);
    for (int w = 0; 2 * w < n; w++) {
        const char *e = (const char *)X + (size_t)2 * w * cols * es, *o = e + (size_t)cols * es;
        const int odd = 2 * w + 1 < n;
        if (dt != FW_F32) {
            to_f32(e, dt, 1, cols, 1.0f, row[0]);
            if (odd)
                to_f32(o, dt, 1, cols, 1.0f, row[1]);
            e = (const char *)row[0];
            o = (const char *)row[1];
        }
        pack_pairs((const float *)e, odd ? (const float *)o : NULL, cols, VW + (size_t)w * cols);
    }
}

/* ceil(red / 2) x cols words: the pair layout pads only an odd reduction length. */
static size_t panel_bytes(int red, int cols) { return (size_t)((red + 1) / 2) * (size_t)cols * sizeof(uint32_t); }

FW_INLINE void qkb_tile(const int tj, const int tm, int dw, int M, const uint32_t *K, int64_t ldkw,
                        const uint32_t *QW, float scale, const float *bias, float *ST)
{
    vf tot[QK_TJ][TM], acc[QK_TJ][TM];
    for (int j = 0; j < tj; j++)
        for (int m = 0; m < tm; m++)
            tot[j][m] = vzero();
    /* two-level sum over blocks of QK_KB words, as in qk_tile */
    for (int w0 = 0; w0 < dw; w0 += QK_KB) {
        const int wn = dw - w0 < QK_KB ? dw - w0 : QK_KB;
        for (int j = 0; j < tj; j++)
            for (int m = 0; m < tm; m++)
                acc[j][m] = vzero();
        for (int w = w0; w < w0 + (wn == QK_KB ? QK_KB : wn); w++) {
            vf q[TM];
            for (int m = 0; m < tm; m++)
                q[m] = vkeep(vload((const float *)QW + (int64_t)w * M + m * VL));
            for (int j = 0; j < tj; j++) {
                vf kb = vbcast_word(K + j * ldkw + w);
                for (int m = 0; m < tm; m++)
                    acc[j][m] = vdpbf(acc[j][m], q[m], kb);
            }
        }
        for (int j = 0; j < tj; j++)
            for (int m = 0; m < tm; m++)
                tot[j][m] = vadd(tot[j][m], acc[j][m]);
    }
    const vf sc = vset1(scale);
    for (int m = 0; m < tm; m++) {
        vf b = vload(bias + m * VL);
        for (int j = 0; j < tj; j++)
            vstore(ST + (int64_t)j * M + m * VL, vfma(tot[j][m], sc, b));
    }
}

static __attribute__((noinline)) void qkb_tile_tail(int tj, int tm, int dw, int M, const uint32_t *K,
                                                    int64_t ldkw, const uint32_t *QW, float scale,
                                                    const float *bias, float *ST)
{
    qkb_tile(tj, tm, dw, M, K, ldkw, QW, scale, bias, ST);
}

/* ST[j][m] = bias[m] + scale * sum_w dot(K[j] word w, QW[w][m]), j < nk, m < M. */
static void qk_bf16(int nk, int dw, int M, const uint32_t *K, int64_t ldkw, const uint32_t *QW,
                    float scale, const float *bias, float *ST)
{
    for (int m0 = 0; m0 < M; m0 += TM * VL) {
        int tm = (M - m0) / VL < TM ? (M - m0) / VL : TM;
        for (int j0 = 0; j0 < nk; j0 += QK_TJ) {
            int tj = nk - j0 < QK_TJ ? nk - j0 : QK_TJ;
            const uint32_t *Kj = K + j0 * ldkw, *Q = QW + m0;
            const float *b = bias + m0;
            float *S = ST + (int64_t)j0 * M + m0;
            if (tm < TM)
                qkb_tile_tail(tj, tm, dw, M, Kj, ldkw, Q, scale, b, S);
            else if (tj == QK_TJ)
                qkb_tile(QK_TJ, TM, dw, M, Kj, ldkw, Q, scale, b, S);
            else if (tj == 2)
                qkb_tile(2, TM, dw, M, Kj, ldkw, Q, scale, b, S);
            else
                qkb_tile(1, TM, dw, M, Kj, ldkw, Q, scale, b, S);
        }
    }
}

FW_INLINE void pvb_tile(const int tc, const int tm, int nw, int M, const uint32_t *VW, int ldvw,
                        const uint32_t *PW, float *OT)
{
    vf acc[TJ][TM];
    for (int c = 0; c < tc; c++)
        for (int m = 0; m < tm; m++)
            acc[c][m] = vload(OT + (int64_t)c * M + m * VL);
    for (int w = 0; w < nw; w++) {
        vf p[TM];
        for (int m = 0; m < tm; m++)
            p[m] = vkeep(vload((const float *)PW + (int64_t)w * M + m * VL));
        const uint32_t *vr = VW + (int64_t)w * ldvw;
        for (int c = 0; c < tc; c++) {
            vf vb = vbcast_word(vr + c);
            for (int m = 0; m < tm; m++)
                acc[c][m] = vdpbf(acc[c][m], p[m], vb);
        }
    }
    for (int c = 0; c < tc; c++)
        for (int m = 0; m < tm; m++)
            vstore(OT + (int64_t)c * M + m * VL, acc[c][m]);
}

static __attribute__((noinline)) void pvb_tile_tail(int tc, int tm, int nw, int M, const uint32_t *VW,
                                                    int ldvw, const uint32_t *PW, float *OT)
{
    pvb_tile(tc, tm, nw, M, VW, ldvw, PW, OT);
}

/* OT[c][m] += sum_w dot(VW[w][c], PW[w][m]), c < dv, m < M, over nw word rows. */
static void pv_bf16(int nw, int dv, int M, const uint32_t *VW, const uint32_t *PW, float *OT)
{
    for (int m0 = 0; m0 < M; m0 += TM * VL) {
        int tm = (M - m0) / VL < TM ? (M - m0) / VL : TM;
        for (int c0 = 0; c0 < dv; c0 += TJ) {
            int tc = dv - c0 < TJ ? dv - c0 : TJ;
            const uint32_t *Vc = VW + c0, *P = PW + m0;
            float *O = OT + (int64_t)c0 * M + m0;
            if (tm < TM) {
                pvb_tile_tail(tc, tm, nw, M, Vc, dv, P, O);
                continue;
            }
            switch (tc) {
            case 6: pvb_tile(6, TM, nw, M, Vc, dv, P, O); break;
            case 5: pvb_tile(5, TM, nw, M, Vc, dv, P, O); break;
            case 4: pvb_tile(4, TM, nw, M, Vc, dv, P, O); break;
            case 3: pvb_tile(3, TM, nw, M, Vc, dv, P, O); break;
            case 2: pvb_tile(2, TM, nw, M, Vc, dv, P, O); break;
            default: pvb_tile(1, TM, nw, M, Vc, dv, P, O); break;
            }
        }
    }
}

/* ----------------------------------------------------------------- softmax -- */

/* tanh(x): 1 - 2 / (2^(2 x log2 e) + 1), where inf and 0 at the ends give exactly +-1; below
 * |x| = 1/4, where that form cancels (at x = 0.01 its error is 1e-5 relative, a softcap of 30
 * multiplies it into the scores), the Taylor series to x^11 (the next term is below 1e-9
 * relative there). */
FW_INLINE vf vtanh(vf x)
{
    const vf one = vset1(1.0f), x2 = vmul(x, x);
    const vf big = vsub(one, vdiv(vset1(2.0f), vadd(vexp2(vmul(vset1(2.0f * 1.4426950408889634f), x)), one)));
    vf p = vset1(-1382.0f / 155925.0f);
    p = vadd(vmul(p, x2), vset1(62.0f / 2835.0f));
    p = vadd(vmul(p, x2), vset1(-17.0f / 315.0f));
    p = vadd(vmul(p, x2), vset1(2.0f / 15.0f));
    p = vadd(vmul(p, x2), vset1(-1.0f / 3.0f));
    p = vadd(vmul(vmul(p, x2), x), x);
    return vsel(vlt(x2, vset1(0.0625f)), p, big);
}

static void softcap(int nk, int M, float *ST, float cap2)
{
    const vf c = vset1(cap2);
    for (int64_t i = 0; i < (int64_t)nk * M; i += VL)
        vstore(ST + i, vmul(c, vtanh(vload(ST + i))));
}

static int softmax(const fw_softmax_args *s)
{
    const int nk = s->nk, M = s->M, masked = s->lo != NULL;
    float *ST = s->ST;
    const vf ninf = vset1(-INFINITY), zero = vzero(), one = vset1(1.0f),
             bound = vset1(FW_ANCHOR_BOUND);
    int fail = 0;
    for (int m = 0; m < M; m += VL) {
        vf a = vload(s->a + m), l = vload(s->l + m);
        vf lo = zero, hi = zero;
        if (masked) {
            lo = vload(s->lo + m);
            hi = vload(s->hi + m);
        }
        vm unset = veq(a, ninf);
        vf sub = a;
        int need_sub = !s->folded;
        if (s->online || vany(unset)) {
            vf mx = ninf;
            for (int j = 0; j < nk; j++) {
                vf x = vload(ST + (int64_t)j * M + m);
                if (masked) {
                    vf jf = vset1((float)j);
                    x = vsel(vmand(vge(jf, lo), vlt(jf, hi)), x, ninf);
                }
                mx = vmax(mx, x);
            }
            if (s->online) {
                vf mnew = vmax(a, mx);
                vm grow = vlt(a, mnew);
                if (vany(grow)) {
                    vf scale = vsel(grow, vsel(unset, zero, vexp2(vsub(a, mnew))), one);
                    l = vmul(l, scale);
                    for (int c = 0; c < s->dv; c++) {
                        float *o = s->OT + (int64_t)c * M + m;
                        vstore(o, vmul(vload(o), scale));
                    }
                }
                a = mnew;
                sub = vsel(veq(a, ninf), zero, a);
            } else {
                vf anew = vsel(unset, mx, a);
                vf use = vsel(veq(anew, ninf), zero, anew);
                sub = s->folded ? vsel(unset, use, zero) : use;
                a = anew;
            }
            need_sub = 1;
        }
        vf sum = zero;
        for (int j = 0; j < nk; j++) {
            float *pj = ST + (int64_t)j * M + m;
            vf x = vload(pj);
            if (need_sub)
                x = vsub(x, sub);
            vf p = vexp2(x);
            if (masked) {
                vf jf = vset1((float)j);
                p = vmaskz(vmand(vge(jf, lo), vlt(jf, hi)), p);
            }
            vstore(pj, p);
            sum = vadd(sum, p);
        }
        l = vadd(l, sum);
        if (s->online) {
            vstore(s->a + m, a);
            vstore(s->l + m, l);
        } else {
            fail |= !vall(vlt(l, bound));
            vstore(s->pending + m, a);
            vstore(s->pending + M + m, l);
        }
    }
    if (s->online)
        return 0;
    if (fail)
        return 1;
    for (int m = 0; m < M; m += VL) {
        vstore(s->a + m, vload(s->pending + m));
        vstore(s->l + m, vload(s->pending + M + m));
    }
    return 0;
}

/* ------------------------------------------------------------------ decode --
 *
 * Few query rows (decode, multi-token decode: G x n <= FW_DEC_ROWS): keys run along the
 * vector lanes instead, so no lane idles.
 *   Kt [d][FW_DEC_KEYS]   f32 key tile, transposed in registers while converting (pack_kt)
 *   Q  [R][d]             f32 query rows in log2 units
 *   S  [R][FW_DEC_KEYS]   scores, then probabilities
 *   V  [nk][dv]           f32 value rows;  O [R][dv] accumulator
 */

/* bf16 rows: transpose 32-bit words (pairs of dims) and split each pair with a shift and a
 * mask, instead of widening first: 2.5x fewer shuffles per element. */
static const uint16_t pack_zero[2 * VL];

static void pack_kt(const void *const *rows, fw_dtype dt, int64_t kdim, int nk, int d, float *Kt)
{
    for (int j0 = 0; j0 < FW_DEC_KEYS; j0 += VL) { /* every column: zero past nk */
        int k0 = 0;
        if (kdim == 1 && dt == FW_BF16)
            for (; k0 + 2 * VL <= d; k0 += 2 * VL) {
                vf r[VL];
                for (int i = 0; i < VL; i++)
                    r[i] = vload_bits(j0 + i < nk ? (const uint16_t *)rows[j0 + i] + k0 : pack_zero);
                vtranspose(r);
                for (int c = 0; c < VL; c++) {
                    vstore(Kt + (size_t)(k0 + 2 * c) * FW_DEC_KEYS + j0, vbf16_even(r[c]));
                    vstore(Kt + (size_t)(k0 + 2 * c + 1) * FW_DEC_KEYS + j0, vbf16_odd(r[c]));
                }
            }
        if (kdim == 1)
            for (; k0 + VL <= d; k0 += VL) {
                vf r[VL];
                for (int i = 0; i < VL; i++)
                    r[i] = j0 + i < nk ? vload_in(rows[j0 + i], dt, k0) : vzero();
                vtranspose(r);
                for (int c = 0; c < VL; c++)
                    vstore(Kt + (size_t)(k0 + c) * FW_DEC_KEYS + j0, r[c]);
            }
        for (; k0 < d; k0++)
            for (int i = 0; i < VL; i++) {
                float x = 0.0f;
                if (j0 + i < nk)
                    to_f32((const char *)rows[j0 + i] + (size_t)(k0 * kdim) * (dt == FW_F32 ? 4 : 2), dt,
                           1, 1, 1.0f, &x);
                Kt[(size_t)k0 * FW_DEC_KEYS + j0 + i] = x;
            }
    }
}

FW_INLINE void dec_qk_tile(const int rt, const int kv, int d, const float *Q, const float *Kt,
                           int64_t ldk, float *S, const float *Ktn, const int pf)
{
    vf tot[DEC_RT][2], acc[DEC_RT][2];
    for (int r = 0; r < rt; r++)
        for (int x = 0; x < kv; x++)
            tot[r][x] = vzero();
    for (int k0 = 0; k0 < d; k0 += QK_KB) {
        const int kn = d - k0 < QK_KB ? d - k0 : QK_KB;
        for (int r = 0; r < rt; r++)
            for (int x = 0; x < kv; x++)
                acc[r][x] = vzero();
        for (int k = k0; k < k0 + (kn == QK_KB ? QK_KB : kn); k++) {
            vf kt[2];
            for (int x = 0; x < kv; x++) {
                kt[x] = vkeep(vload(Kt + (size_t)k * ldk + x * VL));
                if (pf && DEC_PF_LINE(x * VL * 4))
                    __builtin_prefetch(Ktn + (size_t)k * ldk + x * VL, 0, 2);
            }
            for (int r = 0; r < rt; r++) {
                vf qb = vset1(Q[(size_t)r * d + k]);
                for (int x = 0; x < kv; x++)
                    acc[r][x] = vfma(kt[x], qb, acc[r][x]);
            }
        }
        for (int r = 0; r < rt; r++)
            for (int x = 0; x < kv; x++)
                tot[r][x] = vadd(tot[r][x], acc[r][x]);
    }
    for (int r = 0; r < rt; r++)
        for (int x = 0; x < kv; x++)
            vstore(S + (size_t)r * FW_DEC_KEYS + x * VL, tot[r][x]);
}

static __attribute__((noinline)) void dec_qk_tail(int rt, int kv, int d, const float *Q,
                                                  const float *Kt, int64_t ldk, float *S)
{
    dec_qk_tile(rt, kv, d, Q, Kt, ldk, S, NULL, 0);
}

/* S[r][j] = sum_k Q[r][k] Kt[k][j] (row k of Kt at Kt + k ldk) for r < R and the
 * ceil(nk / VL) key vectors holding keys (those keys are read, whatever nk says). Ktn: the
 * panel read next, laid out as Kt (NULL: none); each line of it at the offset of a line
 * read here is prefetched (into L2) as that line is read. */
static void dec_qk(int R, int nk, int d, const float *Q, const float *Kt, int64_t ldk,
                   const float *Ktn, float *S)
{
    const int nkv = (nk + VL - 1) / VL;
    for (int r0 = 0; r0 < R; r0 += DEC_RT)
        for (int x0 = 0; x0 < nkv; x0 += 2) {
            const int rt = R - r0 < DEC_RT ? R - r0 : DEC_RT, kv = nkv - x0 < 2 ? nkv - x0 : 2;
            const float *q = Q + (size_t)r0 * d, *kt = Kt + x0 * VL;
            float *sp = S + (size_t)r0 * FW_DEC_KEYS + x0 * VL;
            if (rt == DEC_RT && kv == 2 && Ktn && r0 == 0)
                dec_qk_tile(DEC_RT, 2, d, q, kt, ldk, sp, Ktn + x0 * VL, 1);
            else if (rt == DEC_RT && kv == 2)
                dec_qk_tile(DEC_RT, 2, d, q, kt, ldk, sp, NULL, 0);
            else
                dec_qk_tail(rt, kv, d, q, kt, ldk, sp);
        }
}

static const float dec_iota[FW_DEC_KEYS] = {
    0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
    22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43,
    44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};

/* Backward's elementwise step on R query rows x FW_DEC_KEYS keys (row stride FW_DEC_KEYS), in
 * place. S (raw q.k) becomes P = 2^(s - lse2[r]), s = qs S (log2 units) or with a softcap
 * cap2 tanh(qs S); dP (dO.v) becomes dS = P (dP - D[r]), times 1 - tanh^2 with a softcap, the
 * derivative of the score by qs S up to the constant the driver applies at the end. Keys
 * outside [lo[r], hi[r]) get P = dS = 0 by selection, so a NaN there never enters the row's
 * sums (it can still reach the products, as in the forward). */
static void bwd_ds(int R, float *S, float *dP, const float *lse2, const float *D, const float *lo,
                   const float *hi, float qs, float cap2)
{
    const vf q = vset1(qs), c = vset1(cap2), one = vset1(1.0f);
    for (int r = 0; r < R; r++) {
        const vf l = vset1(lse2[r]), dd = vset1(D[r]), vlo = vset1(lo[r]), vhi = vset1(hi[r]);
        float *s = S + (size_t)r * FW_DEC_KEYS, *dp = dP + (size_t)r * FW_DEC_KEYS;
        for (int x = 0; x < FW_DEC_KEYS; x += VL) {
            const vf j = vload(dec_iota + x);
            const vm in = vmand(vge(j, vlo), vlt(j, vhi));
            vf sc = vmul(q, vload(s + x)), t = one;
            if (cap2 > 0.0f) {
                t = vtanh(sc);
                sc = vmul(c, t);
            }
            const vf p = vmaskz(in, vexp2(vsub(sc, l)));
            vf ds = vmul(p, vsub(vload(dp + x), dd));
            if (cap2 > 0.0f)
                ds = vmul(ds, vsub(one, vmul(t, t)));
            vstore(s + x, p);
            vstore(dp + x, vmaskz(in, ds));
        }
    }
}

/* Rotary embedding of one head row x: pair i = (x[i], x[i + h]) (GPT-NeoX halves) or
 * (x[2i], x[2i+1]) (interleaved, GPT-J) becomes (a c[i] - b s[i], a s[i] + b c[i]), i < h. */
static void rope(float *x, int h, const float *c, const float *s, int interleaved)
{
    int i = 0;
    if (!interleaved) {
        for (; i + VL <= h; i += VL) {
            const vf a = vload(x + i), b = vload(x + h + i), cv = vload(c + i), sv = vload(s + i);
            vstore(x + i, vsub(vmul(a, cv), vmul(b, sv)));
            vstore(x + h + i, vadd(vmul(a, sv), vmul(b, cv)));
        }
    }
    for (; i < h; i++) {
        float *pa = interleaved ? x + 2 * i : x + i, *pb = interleaved ? pa + 1 : x + h + i;
        const float a = *pa, b = *pb;
        *pa = a * c[i] - b * s[i];
        *pb = a * s[i] + b * c[i];
    }
}

/* Online softmax with lazy rescale: keys outside [lo[r], hi[r]) (tile coordinates, hi <= nk)
 * get probability 0; O rows are rescaled only when the max grew. Each pass runs over every
 * row before the next (the rows' maxima, then their rescales, then their probabilities), so
 * one row's reductions overlap the others' (Zen 4 VM, 1K decode, `flywheel ab`, the same bits:
 * f32 0.99x the time, bf16 0.97x, against one row at a time). */
static void dec_softmax(int R, int nk, float *S, const float *lo, const float *hi, float *m,
                        float *l, float *O, int dv)
{
    const int nkv = (nk + VL - 1) / VL;
    const vf ninf = vset1(-INFINITY);
    float rm[FW_DEC_ROWS];
    for (int r = 0; r < R; r++) {
        const float *s = S + (size_t)r * FW_DEC_KEYS;
        const vf vlo = vset1(lo[r]), vhi = vset1(hi[r]);
        vf mx = ninf;
        for (int x = 0; x < nkv; x++) {
            const vf j = vload(dec_iota + x * VL);
            mx = vmax(mx, vsel(vmand(vge(j, vlo), vlt(j, vhi)), vload(s + x * VL), ninf));
        }
        rm[r] = vhmax(mx);
    }
    for (int r = 0; r < R; r++) {
        /* vmax drops a NaN that a later key of its lane meets, so rm can even be -inf with a
         * NaN score in the tile: the probabilities below are computed all the same (against
         * 0 when the maximum is -inf), so the NaN reaches the row (found by
         * fuzz/fuzz_kvcache.c; a shortcut here zeroed the tile) */
        const float mnew = rm[r] > m[r] || rm[r] != rm[r] ? rm[r] : m[r];
        /* (an unchanged maximum scales by exp2(0) = 1: no call) */
        const float scale = m[r] == -INFINITY ? 0.0f : mnew == m[r] ? 1.0f : exp2f(m[r] - mnew);
        if (scale != 1.0f) {
            float *o = O + (size_t)r * dv;
            for (int c = 0; c < dv; c++)
                o[c] *= scale;
            l[r] *= scale;
        }
        m[r] = mnew;
    }
    for (int r = 0; r < R; r++) {
        float *s = S + (size_t)r * FW_DEC_KEYS;
        const vf vlo = vset1(lo[r]), vhi = vset1(hi[r]);
        const vf mv = vset1(m[r] == -INFINITY ? 0.0f : m[r]);
        vf sum = vzero();
        for (int x = 0; x < nkv; x++) {
            const vf j = vload(dec_iota + x * VL);
            vf pr = vmaskz(vmand(vge(j, vlo), vlt(j, vhi)), vexp2(vsub(vload(s + x * VL), mv)));
            vstore(s + x * VL, pr);
            sum = vadd(sum, pr);
        }
        l[r] += vhsum(sum);
    }
}

/* Key j of dec_pv_tile; pf: prefetch next[j]'s lines at the offsets read. */
FW_INLINE void dec_pv_step(vf acc[DEC_RT][4], const int rt, const int cv, int j, int c0, const float *P,
                           const void *const *V, fw_dtype dt, const void *const *next, const int pf)
{
    const size_t es = dt == FW_F32 ? 4 : 2;
    vf vv[4];
    for (int c = 0; c < cv; c++)
        vv[c] = vkeep(vload_in(V[j], dt, c0 + c * VL));
    for (int c = 0; pf && c < cv; c++)
        if (DEC_PF_LINE((c0 + c * VL) * es))
            __builtin_prefetch((const char *)next[j] + (size_t)(c0 + c * VL) * es, 0, 2);
    for (int r = 0; r < rt; r++) {
        vf pb = vset1(P[(size_t)r * FW_DEC_KEYS + j]);
        for (int c = 0; c < cv; c++)
            acc[r][c] = vfma(vv[c], pb, acc[r][c]);
    }
}

/* The keys below nn prefetch the next rows (next NULL: none), the rest none: two loops, so
 * that neither tests the key index, and with dt a constant (dec_pv's f32 values) neither
 * tests the dtype (measured on the Zen 4 VM, f32 1K decode, `flywheel ab`, the same bits: hot
 * 0.99x the time, 3 caches in rotation 0.97x). */
FW_INLINE void dec_pv_tile(const int rt, const int cv, int nk, int c0, const float *P,
                           const void *const *V, fw_dtype dt, float *O, int dv,
                           const void *const *next, int nn)
{
    vf acc[DEC_RT][4];
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < cv; c++)
            acc[r][c] = vload(O + (size_t)r * dv + c0 + c * VL);
    const int jp = next ? (nn < nk ? nn : nk) : 0;
    int j = 0;
    for (; j < jp; j++)
        dec_pv_step(acc, rt, cv, j, c0, P, V, dt, next, 1);
    for (; j < nk; j++)
        dec_pv_step(acc, rt, cv, j, c0, P, V, dt, NULL, 0);
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < cv; c++)
            vstore(O + (size_t)r * dv + c0 + c * VL, acc[r][c]);
}

#ifdef DEC_PV_EO
/* dec_pv_tile for bf16 values on a layer whose widening load costs more than a shift
 * (DEC_PV_EO: AVX2's vpmovzxwd): each pair of value vectors is one load split by vbf16_even
 * and vbf16_odd, the accumulators held in that even / odd column order and put back in
 * order at the end. The same FMAs in the same order: the same bits. */
FW_INLINE void dec_pv_step_eo(vf acc[DEC_RT][4], const int rt, int j, int c0, const float *P,
                              const void *const *V, const void *const *next, const int pf)
{
    vf vv[4];
    for (int c = 0; c < 4; c += 2) {
        const vf w = vload_bits((const uint16_t *)V[j] + c0 + c * VL);
        vv[c] = vkeep(vbf16_even(w));
        vv[c + 1] = vkeep(vbf16_odd(w));
        if (pf && DEC_PF_LINE((c0 + c * VL) * 2))
            __builtin_prefetch((const uint16_t *)next[j] + c0 + c * VL, 0, 2);
    }
    for (int r = 0; r < rt; r++) {
        vf pb = vset1(P[(size_t)r * FW_DEC_KEYS + j]);
        for (int c = 0; c < 4; c++)
            acc[r][c] = vfma(vv[c], pb, acc[r][c]);
    }
}

/* (the keys below nn prefetch the next rows, as in dec_pv_tile) */
FW_INLINE void dec_pv_tile_eo(const int rt, int nk, int c0, const float *P, const void *const *V, float *O,
                              int dv, const void *const *next, int nn)
{
    vf acc[DEC_RT][4];
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < 4; c += 2)
            vcols_to_eo(O + (size_t)r * dv + c0 + c * VL, &acc[r][c], &acc[r][c + 1]);
    const int jp = next ? (nn < nk ? nn : nk) : 0;
    int j = 0;
    for (; j < jp; j++)
        dec_pv_step_eo(acc, rt, j, c0, P, V, next, 1);
    for (; j < nk; j++)
        dec_pv_step_eo(acc, rt, j, c0, P, V, NULL, 0);
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < 4; c += 2)
            veo_to_cols(O + (size_t)r * dv + c0 + c * VL, acc[r][c], acc[r][c + 1]);
}
#endif

static __attribute__((noinline)) void dec_pv_tail(int rt, int cv, int nk, int c0, const float *P,
                                                  const void *const *V, fw_dtype dt, float *O, int dv)
{
    dec_pv_tile(rt, cv, nk, c0, P, V, dt, O, dv, NULL, 0);
}

/* O[r][c] += sum_j P[r][j] V[j][c], r < R, c < dv, j < nk (in order, per output). V[j]
 * points at key j's value row, contiguous, in dtype dt: converted in registers. next[j], j <
 * nn: the value rows read next (NULL: none), prefetched line by line as the lines at the
 * same offsets of V[j] are read. */
static void dec_pv(int R, int nk, int dv, const float *P, const void *const *V, fw_dtype dt,
                   const void *const *next, int nn, float *O)
{
    const int dvv = dv / VL * VL;
    for (int r0 = 0; r0 < R; r0 += DEC_RT) {
        const int rt = R - r0 < DEC_RT ? R - r0 : DEC_RT;
        const float *pr = P + (size_t)r0 * FW_DEC_KEYS;
        float *o = O + (size_t)r0 * dv;
        for (int c0 = 0; c0 < dvv; c0 += 4 * VL) {
            const int cv = (dvv - c0) / VL < 4 ? (dvv - c0) / VL : 4;
#ifdef DEC_PV_EO
            if (rt == DEC_RT && cv == 4 && dt == FW_BF16)
                dec_pv_tile_eo(DEC_RT, nk, c0, pr, V, o, dv, r0 == 0 ? next : NULL, nn);
            else
#endif
            if (rt == DEC_RT && cv == 4 && dt == FW_F32)
                dec_pv_tile(DEC_RT, 4, nk, c0, pr, V, FW_F32, o, dv, r0 == 0 ? next : NULL, nn);
            else if (rt == DEC_RT && cv == 4)
                dec_pv_tile(DEC_RT, 4, nk, c0, pr, V, dt, o, dv, r0 == 0 ? next : NULL, nn);
            else
                dec_pv_tail(rt, cv, nk, c0, pr, V, dt, o, dv);
        }
        for (int r = 0; r < rt; r++)
            for (int c = dvv; c < dv; c++) {
                float a = o[(size_t)r * dv + c], x;
                for (int j = 0; j < nk; j++) {
                    to_f32((const char *)V[j] + (size_t)c * (dt == FW_F32 ? 4 : 2), dt, 1, 1, 1.0f, &x);
                    a += pr[(size_t)r * FW_DEC_KEYS + j] * x;
                }
                o[(size_t)r * dv + c] = a;
            }
    }
}

/* ---- decode with bf16 products (pair layout, see "bf16 products"):
 *   KtW [dw][FW_DEC_KEYS]  key words transposed: KtW[w][j] = (K[j][2w], K[j][2w+1])
 *   QW  [R][dw]            query words, unscaled; the scale is applied to the f32 scores
 *   PW  [R][FW_DEC_KEYS/2] probability words (P[r][2w], P[r][2w+1])
 * A bf16 key row already is its words, so the transpose moves words and never splits them. */
static void pack_kt_bf16(const void *const *rows, fw_dtype dt, int64_t kdim, int nk, int d, uint32_t *KtW)
{
    const int dw = (d + 1) / 2;
    for (int j0 = 0; j0 < FW_DEC_KEYS; j0 += VL) { /* every column: zero past nk */
        int w0 = 0;
        if (kdim == 1 && dt == FW_BF16)
            for (; w0 + VL <= d / 2; w0 += VL) {
                vf r[VL];
                for (int i = 0; i < VL; i++)
                    r[i] = vload_bits(j0 + i < nk ? (const uint16_t *)rows[j0 + i] + 2 * w0 : pack_zero);
                vtranspose(r);
                for (int c = 0; c < VL; c++)
                    vstore((float *)KtW + (size_t)(w0 + c) * FW_DEC_KEYS + j0, r[c]);
            }
        for (; w0 < dw; w0++)
            for (int i = 0; i < VL; i++) {
                float x[2] = {0.0f, 0.0f};
                for (int e = 0; e < 2 && j0 + i < nk && 2 * w0 + e < d; e++)
                    to_f32((const char *)rows[j0 + i] + (size_t)((2 * w0 + e) * kdim) * (dt == FW_F32 ? 4 : 2),
                           dt, 1, 1, 1.0f, &x[e]);
                KtW[(size_t)w0 * FW_DEC_KEYS + j0 + i] =
                    (uint32_t)fw_cvt_f32_bf16(x[0]) | (uint32_t)fw_cvt_f32_bf16(x[1]) << 16;
            }
    }
}

FW_INLINE void decb_qk_tile(const int rt, const int kv, int dw, const uint32_t *QW, const uint32_t *KtW,
                            float scale, float *S)
{
    vf tot[DEC_RT][2], acc[DEC_RT][2];
    for (int r = 0; r < rt; r++)
        for (int x = 0; x < kv; x++)
            tot[r][x] = vzero();
    for (int w0 = 0; w0 < dw; w0 += QK_KB) {
        const int wn = dw - w0 < QK_KB ? dw - w0 : QK_KB;
        for (int r = 0; r < rt; r++)
            for (int x = 0; x < kv; x++)
                acc[r][x] = vzero();
        for (int w = w0; w < w0 + (wn == QK_KB ? QK_KB : wn); w++) {
            vf kt[2];
            for (int x = 0; x < kv; x++)
                kt[x] = vkeep(vload((const float *)KtW + (size_t)w * FW_DEC_KEYS + x * VL));
            for (int r = 0; r < rt; r++) {
                vf qb = vbcast_word(QW + (size_t)r * dw + w);
                for (int x = 0; x < kv; x++)
                    acc[r][x] = vdpbf(acc[r][x], kt[x], qb);
            }
        }
        for (int r = 0; r < rt; r++)
            for (int x = 0; x < kv; x++)
                tot[r][x] = vadd(tot[r][x], acc[r][x]);
    }
    const vf sc = vset1(scale);
    for (int r = 0; r < rt; r++)
        for (int x = 0; x < kv; x++)
            vstore(S + (size_t)r * FW_DEC_KEYS + x * VL, vmul(tot[r][x], sc));
}

static __attribute__((noinline)) void decb_qk_tail(int rt, int kv, int dw, const uint32_t *QW,
                                                   const uint32_t *KtW, float scale, float *S)
{
    decb_qk_tile(rt, kv, dw, QW, KtW, scale, S);
}

/* S[r][j] = scale * sum_w dot(QW[r][w], KtW[w][j]) for r < R and the key vectors holding keys. */
static void dec_qk_bf16(int R, int nk, int dw, const uint32_t *QW, const uint32_t *KtW, float scale,
                        float *S)
{
    const int nkv = (nk + VL - 1) / VL;
    for (int r0 = 0; r0 < R; r0 += DEC_RT)
        for (int x0 = 0; x0 < nkv; x0 += 2) {
            const int rt = R - r0 < DEC_RT ? R - r0 : DEC_RT, kv = nkv - x0 < 2 ? nkv - x0 : 2;
            const uint32_t *q = QW + (size_t)r0 * dw, *kt = KtW + x0 * VL;
            float *sp = S + (size_t)r0 * FW_DEC_KEYS + x0 * VL;
            if (rt == DEC_RT && kv == 2)
                decb_qk_tile(DEC_RT, 2, dw, q, kt, scale, sp);
            else
                decb_qk_tail(rt, kv, dw, q, kt, scale, sp);
        }
}

/* VL words (row0[i + l], row1[i + l]) of two value rows of dtype dt, rounded to bf16; row1
 * NULL gives zeros in the high halves. */
FW_INLINE vf vload_pair_rows(const void *row0, const void *row1, fw_dtype dt, int64_t i)
{
    return vbf16_pair(vload_in(row0, dt, i), row1 ? vload_in(row1, dt, i) : vzero());
}

/* One element of dtype dt at index i of p, as f32. */
FW_INLINE float load_as_f32(const void *p, fw_dtype dt, int64_t i)
{
    return dt == FW_F32 ? ((const float *)p)[i]
           : dt == FW_BF16 ? fw_cvt_bf16_f32(((const uint16_t *)p)[i])
                           : fw_cvt_f16_f32(((const uint16_t *)p)[i]);
}

/* Kt [d][FW_DEC_KEYS] from transposed keys (key j of channel x at src[x * ld + j]): rows
 * copied a vector at a time, zero past nk. */
static void pack_kt_cols(const void *src, fw_dtype dt, int64_t ld, int nk, int d, float *Kt)
{
    const int nv = nk / VL * VL;
    for (int x = 0; x < d; x++) {
        float *dst = Kt + (size_t)x * FW_DEC_KEYS;
        int j = 0;
        for (; j < nv; j += VL)
            vstore(dst + j, vload_in(src, dt, (int64_t)x * ld + j));
        for (; j < nk; j++)
            dst[j] = load_as_f32(src, dt, (int64_t)x * ld + j);
        for (; j < FW_DEC_KEYS; j++)
            dst[j] = 0.0f;
    }
}

/* KtW [ceil(d/2)][FW_DEC_KEYS] key words (channels 2w, 2w+1 of key j) from transposed keys,
 * two channel rows paired a vector at a time, zero past nk. */
static void pack_kt_cols_bf16(const void *src, fw_dtype dt, int64_t ld, int nk, int d, uint32_t *KtW)
{
    const int nv = nk / VL * VL, dw = (d + 1) / 2;
    const size_t es = dt == FW_F32 ? 4 : 2;
    for (int w = 0; w < dw; w++) {
        const char *r0 = (const char *)src + (size_t)(2 * w * ld) * es;
        const char *r1 = 2 * w + 1 < d ? r0 + (size_t)ld * es : NULL;
        uint32_t *dst = KtW + (size_t)w * FW_DEC_KEYS;
        int j = 0;
        for (; j < nv; j += VL)
            vstore((float *)dst + j, vload_pair_rows(r0, r1, dt, j));
        for (; j < nk; j++)
            dst[j] = (uint32_t)fw_cvt_f32_bf16(load_as_f32(r0, dt, j)) |
                     (uint32_t)(r1 ? fw_cvt_f32_bf16(load_as_f32(r1, dt, j)) : 0) << 16;
        for (; j < FW_DEC_KEYS; j++)
            dst[j] = 0;
    }
}

/* dst[j][x] = src[x * ld + j] as f32: VL x VL blocks transposed in registers, the edges one
 * element at a time. */
static void cols_to_rows(const void *src, fw_dtype dt, int64_t ld, int nk, int d, float *dst)
{
    const int nv = nk / VL * VL, dvv = d / VL * VL;
    for (int j0 = 0; j0 < nv; j0 += VL)
        for (int x0 = 0; x0 < dvv; x0 += VL) {
            vf r[VL];
            for (int i = 0; i < VL; i++)
                r[i] = vload_in(src, dt, (int64_t)(x0 + i) * ld + j0);
            vtranspose(r);
            for (int c = 0; c < VL; c++)
                vstore(dst + (size_t)(j0 + c) * d + x0, r[c]);
        }
    for (int j = 0; j < nk; j++)
        for (int x = j < nv ? dvv : 0; x < d; x++)
            dst[(size_t)j * d + x] = load_as_f32(src, dt, (int64_t)x * ld + j);
}

FW_INLINE void decb_pv_tile(const int rt, const int cv, int nk, int c0, const uint32_t *PW,
                            const void *const *V, fw_dtype dt, float *O, int dv,
                            const void *const *next, int nn, const int pf)
{
    const size_t es = dt == FW_F32 ? 4 : 2;
    vf acc[DEC_RT][4];
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < cv; c++)
            acc[r][c] = vload(O + (size_t)r * dv + c0 + c * VL);
    for (int j = 0; j < nk; j += 2) {
        vf vv[4];
        for (int c = 0; c < cv; c++)
            vv[c] = vkeep(vload_pair_rows(V[j], j + 1 < nk ? V[j + 1] : NULL, dt, c0 + c * VL));
        for (int c = 0; pf && c < cv; c++)
            if (DEC_PF_LINE((c0 + c * VL) * es))
                dec_pf_pair(next, nn, j, (size_t)(c0 + c * VL) * es);
        for (int r = 0; r < rt; r++) {
            vf pb = vbcast_word(PW + (size_t)r * (FW_DEC_KEYS / 2) + j / 2);
            for (int c = 0; c < cv; c++)
                acc[r][c] = vdpbf(acc[r][c], vv[c], pb);
        }
    }
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < cv; c++)
            vstore(O + (size_t)r * dv + c0 + c * VL, acc[r][c]);
}

static __attribute__((noinline)) void decb_pv_tail(int rt, int cv, int nk, int c0, const uint32_t *PW,
                                                   const void *const *V, fw_dtype dt, float *O, int dv)
{
    decb_pv_tile(rt, cv, nk, c0, PW, V, dt, O, dv, NULL, 0, 0);
}

/* decb_pv_tile for bf16 value rows: the pairs by unpacking two rows' words (vpair_rows_bf16),
 * not by converting and rounding them, with O's columns permuted to match while the tile
 * holds them. cv = 4 (two pairs of vectors). */
static const uint16_t dec_zero_row[FW_MAX_HEAD_DIM];

FW_INLINE void decb_pv_tile_rows(const int rt, int nk, int c0, const uint32_t *PW,
                                 const void *const *V, float *O, int dv, const void *const *next,
                                 int nn, const int pf)
{
    vf acc[DEC_RT][4];
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < 4; c += 2)
            vcols_to_pairs(O + (size_t)r * dv + c0 + c * VL, &acc[r][c], &acc[r][c + 1]);
    for (int j = 0; j < nk; j += 2) {
        const uint16_t *r0 = (const uint16_t *)V[j] + c0;
        const uint16_t *r1 = (j + 1 < nk ? (const uint16_t *)V[j + 1] : dec_zero_row) + c0;
        vf vv[4];
        for (int c = 0; c < 4; c += 2) {
            vpair_rows_bf16(r0 + c * VL, r1 + c * VL, &vv[c], &vv[c + 1]);
            for (int h = 0; pf && h < 2; h++) /* the pair's 2 VL columns of each row */
                if (DEC_PF_LINE((c0 + (c + h) * VL) * 2))
                    dec_pf_pair(next, nn, j, (size_t)(c0 + (c + h) * VL) * 2);
        }
        for (int c = 0; c < 4; c++)
            vv[c] = vkeep(vv[c]);
        for (int r = 0; r < rt; r++) {
            vf pb = vbcast_word(PW + (size_t)r * (FW_DEC_KEYS / 2) + j / 2);
            for (int c = 0; c < 4; c++)
                acc[r][c] = vdpbf(acc[r][c], vv[c], pb);
        }
    }
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < 4; c += 2)
            vpairs_to_cols(O + (size_t)r * dv + c0 + c * VL, acc[r][c], acc[r][c + 1]);
}

static __attribute__((noinline)) void decb_pv_rows_tail(int rt, int nk, int c0, const uint32_t *PW,
                                                        const void *const *V, float *O, int dv)
{
    decb_pv_tile_rows(rt, nk, c0, PW, V, O, dv, NULL, 0, 0);
}

/* O[r][c] += sum_j P[r][j] V[j][c] with P rounded to bf16 pairs (into PW, R x FW_DEC_KEYS / 2
 * words) and V rows read in place, paired two keys at a time in registers. Measured
 * (avx512bf16, 4 rows, 64 keys, dv 128, cache-hot): bf16 rows paired by conversion and
 * rounding 8.0 ns a key, by unpacking (decb_pv_tile_rows) 5.2; decode at 1K context, GQA
 * 32:8, one thread, best of 300: 174 -> 153 us. */
static void dec_pv_bf16(int R, int nk, int dv, const float *P, const void *const *V, fw_dtype dt,
                        const void *const *next, int nn, uint32_t *PW, float *O)
{
    const int dvv = dv / VL * VL, nw = (nk + 1) / 2;
    for (int r = 0; r < R; r++)
        pack_row_pairs(P + (size_t)r * FW_DEC_KEYS, nk, PW + (size_t)r * (FW_DEC_KEYS / 2));
    for (int r0 = 0; r0 < R; r0 += DEC_RT) {
        const int rt = R - r0 < DEC_RT ? R - r0 : DEC_RT;
        const uint32_t *pr = PW + (size_t)r0 * (FW_DEC_KEYS / 2);
        float *o = O + (size_t)r0 * dv;
        for (int c0 = 0; c0 < dvv; c0 += 4 * VL) {
            const int cv = (dvv - c0) / VL < 4 ? (dvv - c0) / VL : 4;
            const int pf = next && r0 == 0;
            if (dt == FW_BF16 && cv == 4 && rt == DEC_RT && pf)
                decb_pv_tile_rows(DEC_RT, nk, c0, pr, V, o, dv, next, nn, 1);
            else if (dt == FW_BF16 && cv == 4 && rt == DEC_RT)
                decb_pv_tile_rows(DEC_RT, nk, c0, pr, V, o, dv, NULL, 0, 0);
            else if (dt == FW_BF16 && cv == 4)
                decb_pv_rows_tail(rt, nk, c0, pr, V, o, dv);
            else if (rt == DEC_RT && cv == 4 && pf)
                decb_pv_tile(DEC_RT, 4, nk, c0, pr, V, dt, o, dv, next, nn, 1);
            else if (rt == DEC_RT && cv == 4)
                decb_pv_tile(DEC_RT, 4, nk, c0, pr, V, dt, o, dv, NULL, 0, 0);
            else
                decb_pv_tail(rt, cv, nk, c0, pr, V, dt, o, dv);
        }
        for (int r = 0; r < rt; r++)
            for (int c = dvv; c < dv; c++) {
                float a = o[(size_t)r * dv + c], x[2];
                for (int w = 0; w < nw; w++) {
                    const uint32_t pw = pr[(size_t)r * (FW_DEC_KEYS / 2) + w];
                    for (int e = 0; e < 2 && 2 * w + e < nk; e++) {
                        to_f32((const char *)V[2 * w + e] + (size_t)c * (dt == FW_F32 ? 4 : 2), dt, 1, 1, 1.0f, &x[e]);
                        a += fw_cvt_bf16_f32((uint16_t)(pw >> (16 * e))) *
                             fw_cvt_bf16_f32(fw_cvt_f32_bf16(x[e]));
                    }
                }
                o[(size_t)r * dv + c] = a;
            }
    }
}

/* Decode QK^T (f32 products) from the key rows themselves. A register block is DQ_RB query
 * rows by DQ_KB keys, VL accumulators in all, each summing its dot product along d in its
 * lanes; vsum_each then adds up every accumulator's lanes at once (a tree of shuffles and
 * adds, lane i of the result being accumulator i's total), and a whole block goes to S as
 * DQ_RB rows of DQ_KB. pack_kt's f32 panel took d / VL transposes per VL keys (8 per 16 keys
 * for d = 128). Measured, decode at 1K context, GQA 32:8, d 128, one thread, f32: pack_kt was
 * 40% of the time; the call 561 -> 394 us (best of 300, three runs each). Summing each block
 * by a full transpose, then a chain of adds, then lane by lane through memory, took as long
 * as its FMAs: 16.2 ns a key for 4 rows against 9.4 with vsum_each and the row stores (8.7 is
 * this machine's FMA rate), the whole call 300 -> 246 us.
 * With bf16 products the same scheme on vdpbf16ps was slower than pack_kt_bf16's panel
 * (254 -> 270 us with the transpose sums: a bf16 row holds twice the elements per transpose),
 * so it stays there. */
#define DQ_RB (VL < 4 ? VL : 4)
#define DQ_KB (VL / DQ_RB)

/* The keys of a block (a valid row stands in for the keys past nk) and its query rows (row
 * r0 stands in past R). */
FW_INLINE void dq_block(int R, int nk, int r0, int j0, const void *const *rows, const void **kr,
                        int *rr)
{
    for (int x = 0; x < DQ_KB; x++)
        kr[x] = rows[j0 + x < nk ? j0 + x : j0];
    for (int r = 0; r < DQ_RB; r++)
        rr[r] = r0 + r < R ? r0 + r : r0;
}

/* The next rows that block (r0, j0) prefetches as it reads its own (next[j], j < nn; a
 * valid row stands in past nn) into kn: 0 where it prefetches none (no next rows, or a row
 * block after the first, which reads the same keys again). */
FW_INLINE int dq_next(int nn, int r0, int j0, const void *const *next, const void **kn)
{
    if (!next || r0 != 0 || j0 >= nn)
        return 0;
    for (int x = 0; x < DQ_KB; x++)
        kn[x] = next[j0 + x < nn ? j0 + x : j0];
    return 1;
}

/* Sets of accumulators per block that take turns along d: one with vectors (a block has VL
 * independent sums), four in the portable table, whose one-lane block would otherwise be a
 * single chain of dependent FMAs (measured there: bf16 rows 416 ns a key against 155 through
 * the panel, whose register tile has many). */
#define DQ_SETS (VL == 1 ? 4 : 1)

FW_INLINE void dq_zero(vf acc[DQ_SETS][VL])
{
    for (int e = 0; e < DQ_SETS; e++)
        for (int i = 0; i < VL; i++)
            acc[e][i] = vzero();
}

/* The block's totals, lane r * DQ_KB + x: row r0 + r, key j0 + x. */
FW_INLINE vf dq_total(vf acc[DQ_SETS][VL])
{
    for (int e = 1; e < DQ_SETS; e++)
        for (int i = 0; i < VL; i++)
            acc[0][i] = vadd(acc[0][i], acc[e][i]);
    return vsum_each(acc[0]);
}

/* One step along d: elements c .. c+VL-1 of the block's rows and keys (f32 products). */
FW_INLINE void dq_step_f32(vf *acc, const void *const *kr, const int *rr, const float *Q, int d,
                           fw_dtype dt, int c, const void *const *kn, const int pf)
{
    const size_t es = dt == FW_F32 ? 4 : 2;
    vf kv[DQ_KB];
    for (int x = 0; x < DQ_KB; x++) {
        kv[x] = vload_in(kr[x], dt, c);
        if (pf && DEC_PF_LINE(c * es))
            __builtin_prefetch((const char *)kn[x] + (size_t)c * es, 0, 2);
    }
    for (int r = 0; r < DQ_RB; r++) {
        const vf qv = vload(Q + (size_t)rr[r] * d + c);
        for (int x = 0; x < DQ_KB; x++)
            acc[r * DQ_KB + x] = vfma(qv, kv[x], acc[r * DQ_KB + x]);
    }
}

/* One step along the words: words w .. w+VL-1 of the block's rows and keys (bf16 products). */
FW_INLINE void dq_step_bf16(vf *acc, const void *const *kr, const int *rr, const uint32_t *QW,
                            int dw, int w, const void *const *kn, const int pf)
{
    vf kv[DQ_KB];
    for (int x = 0; x < DQ_KB; x++) {
        kv[x] = vload_bits((const uint32_t *)kr[x] + w);
        if (pf && DEC_PF_LINE(w * 4))
            __builtin_prefetch((const uint32_t *)kn[x] + w, 0, 2);
    }
    for (int r = 0; r < DQ_RB; r++) {
        const vf qv = vload_bits(QW + (size_t)rr[r] * dw + w);
        for (int x = 0; x < DQ_KB; x++)
            acc[r * DQ_KB + x] = vdpbf(acc[r * DQ_KB + x], kv[x], qv);
    }
}

static void dq_zero_tail(int R, int nk, float *S)
{
    for (int r = 0; r < R; r++)
        for (int j = nk; j < FW_DEC_KEYS; j++)
            S[(size_t)r * FW_DEC_KEYS + j] = 0.0f;
}

/* The f32 products of one block along d (dec_qk_rows); pf: prefetch kn's lines as kr's are
 * read. */
FW_INLINE void dq_block_f32(vf acc[DQ_SETS][VL], const void *const *kr, const int *rr, const float *Q,
                            int d, fw_dtype dt, const void *const *kn, const int pf)
{
    const int dvec = d / VL * VL;
    int c = 0;
    for (; c + DQ_SETS * VL <= dvec; c += DQ_SETS * VL)
        for (int e = 0; e < DQ_SETS; e++)
            dq_step_f32(acc[e], kr, rr, Q, d, dt, c + e * VL, kn, pf);
    for (; c < dvec; c += VL)
        dq_step_f32(acc[0], kr, rr, Q, d, dt, c, kn, pf);
}

/* One step along d of dq_f32_block; pf: prefetch the next rows' line at this offset. */
FW_INLINE void dq_f32_step(vf acc[VL], const float *const *k, const float *const *n, const float *QP,
                           int c, const int pf)
{
    vf kv[DQ_KB];
    for (int x = 0; x < DQ_KB; x++) {
        kv[x] = vload(k[x] + c);
        if (pf && DEC_PF_LINE(c * 4))
            __builtin_prefetch(n[x] + c, 0, 2);
    }
    for (int r = 0; r < DQ_RB; r++)
        for (int x = 0; x < DQ_KB; x++)
            acc[r * DQ_KB + x] = vfma(vload(QP + r * VL), kv[x], acc[r * DQ_KB + x]);
}

/* One whole block of f32 key rows (DQ_SETS == 1, DQ_RB rows, d a multiple of VL) into S (row
 * stride FW_DEC_KEYS): QP holds the block's query rows vector by vector, QP[(c / VL) * DQ_RB +
 * r] = Q[r0 + r][c .. c+VL-1], so one pointer and the key rows' offset address every load;
 * kn: the next rows to prefetch, or NULL. The FMAs and the sum of dq_block_f32 and
 * dq_total, in the same order (the same bits). Measured (Zen 4 VM, f32 1K decode, GQA 32:8,
 * d 128, `flywheel ab`): through dq_block_f32 the loop (query rows by index, the dtype's and
 * the prefetch's tests) spilled an accumulator and reloaded pointers at every step; this one
 * holds them in registers: hot 0.96x the time (2 threads and 1), 3 caches in rotation (L3)
 * 0.97x, from DRAM level (0.99-1.02x). Slower on the same VM: lanes along (query
 * row, four channels) with each key's four channels broadcast to every 128-bit lane (6
 * shuffles a block to add, not 30): 1.06-1.07x, a broadcast load costing a third of an FMA's
 * slot there (1.38 cycles a broadcast-and-FMA pair against 1.0 with whole loads). */
FW_INLINE void dq_f32_block(const void *const *kr, const void *const *kn, const float *QP, int d, float *S)
{
    const float *k[DQ_KB], *n[DQ_KB];
    for (int x = 0; x < DQ_KB; x++) {
        k[x] = (const float *)kr[x];
        n[x] = kn ? (const float *)kn[x] : NULL;
    }
    vf acc[VL];
    for (int i = 0; i < VL; i++)
        acc[i] = vzero();
    if (kn)
        for (int c = 0; c < d; c += VL, QP += DQ_RB * VL)
            dq_f32_step(acc, k, n, QP, c, 1);
    else
        for (int c = 0; c < d; c += VL, QP += DQ_RB * VL)
            dq_f32_step(acc, k, n, QP, c, 0);
    vstore_rows(S, FW_DEC_KEYS, vsum_each(acc));
}

/* next[j], j < nn: the key rows read next (NULL: none), prefetched line by line as the
 * lines at the same offsets of rows[j] are read. */
static void dec_qk_rows(int R, int nk, int d, const float *Q, const void *const *rows, fw_dtype dt,
                        const void *const *next, int nn, float *S)
{
    const int dvec = d / VL * VL;
    const size_t es = dt == FW_F32 ? 4 : 2;
    for (int r0 = 0; r0 < R; r0 += DQ_RB) {
        const int whole = DQ_SETS == 1 && dt == FW_F32 && r0 + DQ_RB <= R && dvec == d;
        float QP[DQ_RB * FW_MAX_HEAD_DIM];
        for (int c = 0; whole && c < d; c += VL)
            for (int r = 0; r < DQ_RB; r++)
                vstore(QP + (c / VL * DQ_RB + r) * VL, vload(Q + (size_t)(r0 + r) * d + c));
        for (int j0 = 0; j0 < nk; j0 += DQ_KB) {
            const void *kr[DQ_KB];
            int rr[DQ_RB];
            dq_block(R, nk, r0, j0, rows, kr, rr);
            const void *kn[DQ_KB];
            const int pf = dq_next(nn, r0, j0, next, kn);
            if (whole) {
                dq_f32_block(kr, pf ? kn : NULL, QP, d, S + (size_t)r0 * FW_DEC_KEYS + j0);
                continue;
            }
            vf acc[DQ_SETS][VL];
            dq_zero(acc);
            if (pf)
                dq_block_f32(acc, kr, rr, Q, d, dt, kn, 1);
            else
                dq_block_f32(acc, kr, rr, Q, d, dt, NULL, 0);
            /* lane r * DQ_KB + x: row r0 + r, key j0 + x. A whole block goes straight to S
             * (keys past nk too: dq_zero_tail clears them after); the rest lane by lane. */
            const vf tot = dq_total(acc);
            if (r0 + DQ_RB <= R && dvec == d) {
                vstore_rows(S + (size_t)r0 * FW_DEC_KEYS + j0, FW_DEC_KEYS, tot);
                continue;
            }
            float t[VL];
            vstore(t, tot);
            for (int r = 0; r < DQ_RB && r0 + r < R; r++)
                for (int x = 0; x < DQ_KB && j0 + x < nk; x++) {
                    float s = t[r * DQ_KB + x];
                    for (int c = dvec; c < d; c++) {
                        float k;
                        to_f32((const char *)kr[x] + (size_t)c * es, dt, 1, 1, 1.0f, &k);
                        s += Q[(size_t)(r0 + r) * d + c] * k;
                    }
                    S[(size_t)(r0 + r) * FW_DEC_KEYS + j0 + x] = s;
                }
        }
    }
    dq_zero_tail(R, nk, S);
}

/* Decode QK^T with bf16 products from bf16 key rows themselves (rows[j]: contiguous bf16,
 * read as words: a bf16 row already is its pairs): S[r][j] = scale * QW[r] . K[j] for r < R,
 * j < nk, 0 for j in [nk, FW_DEC_KEYS). The blocks of dec_qk_rows on vdpbf16ps. Measured
 * (avx512bf16, 4 query rows, 64 keys, d 128, cache-hot): pack_kt_bf16's panel then
 * dec_qk_bf16 7.9-8.1 ns a key, this 5.5-5.8; decode at 1K context, GQA 32:8, one thread,
 * bf16, best of 300: 202 -> 174 us. */
/* The bf16 products of one block along the words (dec_qk_rows_bf16); pf: prefetch kn's lines
 * as kr's are read. */
FW_INLINE void dq_block_bf16(vf acc[DQ_SETS][VL], const void *const *kr, const int *rr,
                             const uint32_t *QW, int dw, int wvec, const void *const *kn, const int pf)
{
    int w = 0;
    for (; w + DQ_SETS * VL <= wvec; w += DQ_SETS * VL)
        for (int e = 0; e < DQ_SETS; e++)
            dq_step_bf16(acc[e], kr, rr, QW, dw, w + e * VL, kn, pf);
    for (; w < wvec; w += VL)
        dq_step_bf16(acc[0], kr, rr, QW, dw, w, kn, pf);
}

static void dec_qk_rows_bf16(int R, int nk, int d, const uint32_t *QW, const void *const *rows,
                             float scale, const void *const *next, int nn, float *S)
{
    const int dw = (d + 1) / 2, wvec = d / 2 / VL * VL;
    const vf sc = vset1(scale);
    for (int r0 = 0; r0 < R; r0 += DQ_RB)
        for (int j0 = 0; j0 < nk; j0 += DQ_KB) {
            const void *kr[DQ_KB];
            int rr[DQ_RB];
            dq_block(R, nk, r0, j0, rows, kr, rr);
            vf acc[DQ_SETS][VL];
            dq_zero(acc);
            const void *kn[DQ_KB];
            if (dq_next(nn, r0, j0, next, kn))
                dq_block_bf16(acc, kr, rr, QW, dw, wvec, kn, 1);
            else
                dq_block_bf16(acc, kr, rr, QW, dw, wvec, NULL, 0);
            const vf tot = dq_total(acc);
            if (r0 + DQ_RB <= R && wvec == dw && d % 2 == 0) {
                vstore_rows(S + (size_t)r0 * FW_DEC_KEYS + j0, FW_DEC_KEYS, vmul(tot, sc));
                continue;
            }
            float t[VL];
            vstore(t, tot);
            for (int r = 0; r < DQ_RB && r0 + r < R; r++)
                for (int x = 0; x < DQ_KB && j0 + x < nk; x++) {
                    float s = t[r * DQ_KB + x];
                    for (int e = 2 * wvec; e < d; e++) {
                        const uint32_t qw = QW[(size_t)(r0 + r) * dw + e / 2];
                        s += fw_cvt_bf16_f32((uint16_t)(qw >> (16 * (e % 2)))) *
                             fw_cvt_bf16_f32(((const uint16_t *)kr[x])[e]);
                    }
                    S[(size_t)(r0 + r) * FW_DEC_KEYS + j0 + x] = s * scale;
                }
        }
    dq_zero_tail(R, nk, S);
}

/* Decode products straight from a FW_KV_TILES cache (flywheel.h, fw_kv_cache), with keys (QK)
 * or channels (PV) along the lanes, as the panels above have them: a tile row of the cache is
 * 16 lanes of words, so a key vector of channel pair w is one load, and a value vector of key
 * pair w the same. VL divides 16 on every table. */
FW_INLINE void dect_qk_block(int rt, int kv, int dw, const uint32_t *QW, const uint32_t *const *kw,
                             float scale, float *S)
{
    vf acc[DEC_RT][2];
    for (int r = 0; r < rt; r++)
        for (int x = 0; x < kv; x++)
            acc[r][x] = vzero();
    for (int w = 0; w < dw; w++) {
        vf k[2];
        for (int x = 0; x < kv; x++)
            k[x] = vkeep(vload((const float *)kw[x] + (size_t)w * 16));
        for (int r = 0; r < rt; r++) {
            const vf qb = vbcast_word(QW + (size_t)r * dw + w);
            for (int x = 0; x < kv; x++)
                acc[r][x] = vdpbf(acc[r][x], k[x], qb);
        }
    }
    const vf sc = vset1(scale);
    for (int r = 0; r < rt; r++)
        for (int x = 0; x < kv; x++)
            vstore(S + (size_t)r * FW_DEC_KEYS + x * VL, vmul(acc[r][x], sc));
}

static __attribute__((noinline)) void dect_qk_tail(int rt, int kv, int dw, const uint32_t *QW,
                                                   const uint32_t *const *kw, float scale, float *S)
{
    dect_qk_block(rt, kv, dw, QW, kw, scale, S);
}

/* S[r][j] = scale * QW[r] . K[j] (bf16 products) for r < R, j < nk; 0 for j in [nk, 64). */
static void dec_qk_tiles_bf16(int R, int nk, int d, const uint32_t *QW, const uint16_t *const *kg,
                              float scale, float *S)
{
    const int dw = d / 2, nkv = (nk + VL - 1) / VL;
    for (int r0 = 0; r0 < R; r0 += DEC_RT)
        for (int x0 = 0; x0 < nkv; x0 += 2) {
            const int rt = R - r0 < DEC_RT ? R - r0 : DEC_RT, kv = nkv - x0 < 2 ? nkv - x0 : 2;
            const uint32_t *kw[2];
            for (int x = 0; x < kv; x++) /* keys (x0 + x) VL ..: group / 16, lane % 16 */
                kw[x] = (const uint32_t *)kg[(x0 + x) * VL / 16] + (x0 + x) * VL % 16;
            if (rt == DEC_RT && kv == 2)
                dect_qk_block(DEC_RT, 2, dw, QW + (size_t)r0 * dw, kw, scale, S + (size_t)r0 * FW_DEC_KEYS + x0 * VL);
            else
                dect_qk_tail(rt, kv, dw, QW + (size_t)r0 * dw, kw, scale, S + (size_t)r0 * FW_DEC_KEYS + x0 * VL);
        }
    dq_zero_tail(R, nk, S); /* (the keys past nk in the last vector scored whatever the cache held) */
}

/* O[r][c0 ..] += P V over key pairs w < nw (whole pairs) of the channel vectors at vc[c]
 * (channel vector c's row of key pair 0), then the lone key 2 nw when `odd`: its P word holds
 * a zero in the odd half, but the cache's odd key beside it is never read into a product. */
FW_INLINE void dect_pv_block(int rt, int cv, int nw, int odd, const uint32_t *PW,
                             const uint16_t *const *vg, const int64_t *voff, float *O, int dv)
{
    vf acc[DEC_RT][4];
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < cv; c++)
            acc[r][c] = vload(O + (size_t)r * dv + c * VL);
    for (int w = 0; w < nw + odd; w++) {
        vf v[4];
        for (int c = 0; c < cv; c++) {
            v[c] = vkeep(vload((const float *)(vg[w / 16] + voff[c]) + (size_t)(w % 16) * 16));
            if (w == nw) /* the lone key: its values alone (the even half), as f32 */
                v[c] = vbf16_even(v[c]);
        }
        for (int r = 0; r < rt; r++) {
            const vf pb = vbcast_word(PW + (size_t)r * (FW_DEC_KEYS / 2) + w);
            for (int c = 0; c < cv; c++)
                acc[r][c] = w == nw ? vfma(v[c], vbf16_even(pb), acc[r][c]) : vdpbf(acc[r][c], v[c], pb);
        }
    }
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < cv; c++)
            vstore(O + (size_t)r * dv + c * VL, acc[r][c]);
}

static __attribute__((noinline)) void dect_pv_tail(int rt, int cv, int nw, int odd, const uint32_t *PW,
                                                   const uint16_t *const *vg, const int64_t *voff,
                                                   float *O, int dv)
{
    dect_pv_block(rt, cv, nw, odd, PW, vg, voff, O, dv);
}

/* O[r][c] += sum_j P[r][j] V[j][c] for r < R, c < dv, with P rounded to bf16 pairs into PW
 * (R x FW_DEC_KEYS / 2 words, zero past nk) and V read from its tiles. */
static void dec_pv_tiles_bf16(int R, int nk, int dv, const float *P, const uint16_t *const *vg,
                              int64_t vgs, uint32_t *PW, float *O)
{
    for (int r = 0; r < R; r++)
        pack_row_pairs(P + (size_t)r * FW_DEC_KEYS, nk, PW + (size_t)r * (FW_DEC_KEYS / 2));
    const int nw = nk / 2, odd = nk & 1;
    for (int r0 = 0; r0 < R; r0 += DEC_RT) {
        const int rt = R - r0 < DEC_RT ? R - r0 : DEC_RT;
        for (int c0 = 0; c0 < dv; c0 += 4 * VL) {
            const int cv = (dv - c0) / VL < 4 ? (dv - c0) / VL : 4;
            int64_t voff[4]; /* channel c0 + c VL: group / 16 (vgs apart), lane % 16 (words) */
            for (int c = 0; c < cv; c++)
                voff[c] = (c0 + c * VL) / 16 * vgs + (c0 + c * VL) % 16 * 2;
            const uint32_t *pr = PW + (size_t)r0 * (FW_DEC_KEYS / 2);
            float *o = O + (size_t)r0 * dv + c0;
            if (rt == DEC_RT && cv == 4)
                dect_pv_block(DEC_RT, 4, nw, odd, pr, vg, voff, o, dv);
            else
                dect_pv_tail(rt, cv, nw, odd, pr, vg, voff, o, dv);
        }
    }
}

/* ------------------------------------------------------------ causal conv1d -- */

/* x / (1 + e^-x), e^-x as 2^(-x log2 e): -inf gives NaN (-inf / inf), as the formula does in
 * the reference; a large negative x, -0. mode FW_SILU_HALF, for outputs rounded to bf16 or
 * f16: the exponential to 2^-13.7 (vexp2_half_poly) and the division to 2^-14 (vdiv_half),
 * 1.4e-4 relative in all, against half an ulp of 2^-9 (bf16) or 2^-11 (f16). */
FW_INLINE vf vsilu(vf x, const int mode)
{
    const vf d = vadd(vset1(1.0f), vexp2_to(vmul(x, vset1(-1.4426950408889634f)), mode == FW_SILU_HALF));
    return mode == FW_SILU_HALF ? vdiv_half(x, d) : vdiv(x, d);
}


/* 2 VL elements lo then hi stored as dt at element i of dst, non-temporally where nt (dst + i
 * aligned as vstream_as needs): in one store where the layer has one (vstore2_native), else
 * a vector at a time. */
FW_INLINE void vstore2_as(void *dst, fw_dtype dt, int64_t i, vf lo, vf hi, int nt)
{
    if (vstore2_native(dst, dt, i, lo, hi, nt))
        return;
    if (nt) {
        vstream_as(dst, dt, i, lo);
        vstream_as(dst, dt, i + VL, hi);
    } else {
        vstore_as(dst, dt, i, lo);
        vstore_as(dst, dt, i + VL, hi);
    }
}

/* nv vectors of outputs from channel c, their sums independent (4 at a time overlap the
 * latency of the tap chain, the exponential and the division: the conv above 4.90-5.09 ms
 * one vector at a time, 4.72-4.80 four). tdt and silu are constants where conv1d_row calls
 * it, so the conversions and the activation are picked at compile time. Measured (one
 * thread, rows in L1, 4 taps, bf16 in and out, SiLU): about 25 cycles a vector, nearly all
 * of them vector operations (4 conversions, 4 FMAs, 11 for SiLU, 9 for the bf16 rounding)
 * on this machine's one 512-bit operation a cycle; a reciprocal and a Newton step in place
 * of the division was slower (30). */
FW_INLINE void conv_vecs(const int nv, int W, const void *const *taps, const fw_dtype tdt, const float *wt,
                         int64_t ldw, const float *bias, const void *res, fw_dtype rdt, const int silu,
                         void *y, fw_dtype ydt, int c, int nt)
{
    vf acc[4];
    for (int v = 0; v < nv; v++)
        acc[v] = vload(bias + c + v * VL);
    for (int k = 0; k < W; k++) {
        const float *wk = wt + (size_t)k * ldw + c;
        for (int v = 0; v < nv; v++)
            acc[v] = vfma(vload(wk + v * VL), vload_in(taps[k], tdt, c + v * VL), acc[v]);
    }
    if (silu)
        for (int v = 0; v < nv; v++)
            acc[v] = vsilu(acc[v], silu);
    if (res)
        for (int v = 0; v < nv; v++)
            acc[v] = vadd(acc[v], vload_in(res, rdt, c + v * VL));
    if (nv == 4 && nt) {
        vstore2_as(y, ydt, c, acc[0], acc[1], 1);
        vstore2_as(y, ydt, c + 2 * VL, acc[2], acc[3], 1);
        return;
    }
    for (int v = 0; v < nv; v++)
        vstore_as(y, ydt, c + v * VL, acc[v]);
}

/* Prefetches the 4 vectors of channels from c of tap row `row` (dtype tdt; NULL: none). */
FW_INLINE void conv_prefetch4(const void *row, const fw_dtype tdt, int c)
{
    const size_t ts = tdt == FW_F32 ? 4 : 2;
    if (row)
        for (size_t b = 0; b < 4 * VL * ts; b += 64)
            __builtin_prefetch((const char *)row + (size_t)c * ts + b, 0, 3);
}

/* ahead (or NULL): a later tap row, whose elements of each 4 vectors' channels are prefetched
 * as they are computed here. nt: those 4 vectors stored non-temporally (y aligned as
 * vstream_as needs; the caller fences). */
FW_INLINE void conv_row_as(int W, const void *const *taps, const fw_dtype tdt, const float *wt, int64_t ldw,
                           const float *bias, const void *res, fw_dtype rdt, int n, const int silu, void *y,
                           fw_dtype ydt, const void *ahead, int nt)
{
    int c = 0;
    for (; c + 4 * VL <= n; c += 4 * VL) {
        conv_prefetch4(ahead, tdt, c);
        conv_vecs(4, W, taps, tdt, wt, ldw, bias, res, rdt, silu, y, ydt, c, nt);
    }
    for (; c + VL <= n; c += VL)
        conv_vecs(1, W, taps, tdt, wt, ldw, bias, res, rdt, silu, y, ydt, c, 0);
    for (; c < n; c++) {
        float acc = bias[c];
        for (int k = 0; k < W; k++)
            acc = fmaf(wt[(size_t)k * ldw + c], load_as_f32(taps[k], tdt, c), acc);
        if (silu)
            acc = acc / (1.0f + expf(-acc));
        if (res)
            acc += load_as_f32(res, rdt, c);
        float one[1] = {acc};
        from_f32(one, 1, (char *)y + (size_t)c * (ydt == FW_F32 ? 4 : 2), ydt, 1);
    }
}

/* conv weights packed [D][W] (one row of taps per channel) as f32 [W][D]. Plain loops over
 * words, which the compiler vectorizes with each table's flags (a width-4 bf16 block: two
 * word permutes, a widening and a shift per 16 outputs); the scalar transpose in the driver
 * was about a third of a one-token decode of 8192 channels. */
FW_INLINE void conv_weights_as(const int W, int64_t D, const void *w, const fw_dtype dt, float *wb)
{
    for (int64_t d = 0; d < D; d++)
        for (int k = 0; k < W; k++)
            wb[k * D + d] = load_as_f32(w, dt, d * W + k);
}

static void conv_weights(int W, int64_t D, const void *w, fw_dtype dt, float *wb)
{
    if (W == 4 && dt == FW_BF16) /* Qwen3-Next's and Kimi's width */
        conv_weights_as(4, D, w, FW_BF16, wb);
    else if (W == 4 && dt == FW_F32)
        conv_weights_as(4, D, w, FW_F32, wb);
    else
        conv_weights_as(W, D, w, dt, wb);
}

static void conv1d_row(int W, const void *const *taps, fw_dtype tdt, const float *wt, int64_t ldw,
                       const float *bias, const void *res, fw_dtype rdt, int n, int silu, void *y,
                       fw_dtype ydt)
{
#define CONV_ROW(T, S) conv_row_as(W, taps, T, wt, ldw, bias, res, rdt, n, S, y, ydt, NULL, 0)
#define CONV_ROW_MODES(T) (silu == FW_SILU_HALF ? CONV_ROW(T, FW_SILU_HALF) : silu ? CONV_ROW(T, 1) : CONV_ROW(T, 0))
    if (tdt == FW_BF16)
        CONV_ROW_MODES(FW_BF16);
    else if (tdt == FW_F16)
        CONV_ROW_MODES(FW_F16);
    else
        CONV_ROW_MODES(FW_F32);
#undef CONV_ROW_MODES
#undef CONV_ROW
}

/* Channels [c, n) of R consecutive width-4 output rows (taps rows[r .. r + 3]), row by row
 * through the row kernel with plain stores: what a multi-row kernel leaves past its vectors. */
FW_INLINE void conv_rows_from(int R, const void *const *rows, const fw_dtype tdt, const float *wt, int64_t ldw,
                              const float *bias, int n, const int silu, void *const *ys, fw_dtype ydt, int c)
{
    const size_t ts = tdt == FW_F32 ? 4 : 2, ysz = ydt == FW_F32 ? 4 : 2;
    for (int r = 0; c < n && r < R; r++) {
        const void *taps[4];
        for (int k = 0; k < 4; k++)
            taps[k] = (const char *)rows[r + k] + (size_t)c * ts;
        conv_row_as(4, taps, tdt, wt + c, ldw, bias + c, NULL, FW_F32, n - c, silu, (char *)ys[r] + (size_t)c * ysz,
                    ydt, NULL, 0);
    }
}

/* Output rows per pass of conv_rows4_block. A pass walks its rows down each pair of channel
 * vectors, so it has one line of each of its R + 3 tap rows and R output rows in flight at
 * a time: few enough for the core's outstanding misses to cover. Measured (the kernel
 * alone over Qwen3-Next's conv, 2K tokens x 8192 channels, bf16, SiLU, one thread, streamed
 * outputs): passes of 4 / 8 / 12 / 16 / 32 / 64 rows 3.06 / 3.01 / 3.06 / 3.66 / 5.42 /
 * 5.79 ms; plain stores 3.94 / 4.00 / 4.10 / 4.66 / 5.09 / 4.43 ms. */
#define CONV_PASS_ROWS 8

/* R <= CONV_PASS_ROWS consecutive output rows of width 4 from R + 3 tap rows (row r's taps:
 * rows[r .. r+3]), 2 vectors of channels at a time with their weights and the three earlier
 * taps held in registers as the rows slide: each tap row is loaded and converted once, not 4
 * times. The same operations in the same order as conv_vecs, so the same bits. nt: the
 * vector pairs stored non-temporally (every ys[r] aligned for vstream_as). */
FW_INLINE void conv_rows4_block(int R, const void *const *rows, const fw_dtype tdt, const float *wt, int64_t ldw,
                                const float *bias, int n, const int silu, void *const *ys, fw_dtype ydt, int nt)
{
    int c = 0;
    for (; c + 2 * VL <= n; c += 2 * VL) {
        vf w[4][2], t[3][2], bb[2];
        for (int v = 0; v < 2; v++) {
            bb[v] = vload(bias + c + v * VL);
            for (int k = 0; k < 4; k++)
                w[k][v] = vload(wt + (size_t)k * ldw + c + v * VL);
            for (int k = 0; k < 3; k++)
                t[k][v] = vload_in(rows[k], tdt, c + v * VL);
        }
        for (int r = 0; r < R; r++) {
            vf y[2];
            for (int v = 0; v < 2; v++) {
                const vf t3 = vload_in(rows[r + 3], tdt, c + v * VL);
                vf acc = vfma(w[0][v], t[0][v], bb[v]);
                acc = vfma(w[1][v], t[1][v], acc);
                acc = vfma(w[2][v], t[2][v], acc);
                acc = vfma(w[3][v], t3, acc);
                y[v] = silu ? vsilu(acc, silu) : acc;
                t[0][v] = t[1][v];
                t[1][v] = t[2][v];
                t[2][v] = t3;
            }
            vstore2_as(ys[r], ydt, c, y[0], y[1], nt);
        }
    }
    conv_rows_from(R, rows, tdt, wt, ldw, bias, n, silu, ys, ydt, c); /* past the last vector pair */
}

/* Two consecutive output rows, 4 vectors of channels from c: row 0 from taps rows[0..3], row
 * 1 from rows[1..4], each tap row loaded and converted once for both (5 conversions for 8
 * vectors where conv_vecs makes 16); the same operations in the same order per output as
 * conv_vecs, so the same bits. Taken by the one-row-at-a-time path on the 512-bit tables
 * (CONV_PAIRS): on the avx2 table, 16 registers, it spilled and lost. */
#define CONV_PAIRS (VL >= 16)
FW_INLINE void conv_pair_vecs(const void *const *rows, const fw_dtype tdt, const float *wt, int64_t ldw,
                              const float *bias, const int silu, void *y0, void *y1, fw_dtype ydt, int c, int nt)
{
    vf a0[4], a1[4];
    for (int v = 0; v < 4; v++) {
        vf t[5];
        for (int k = 0; k < 5; k++)
            t[k] = vload_in(rows[k], tdt, c + v * VL);
        vf x0 = vload(bias + c + v * VL), x1 = x0;
        for (int k = 0; k < 4; k++) {
            const vf w = vload(wt + (size_t)k * ldw + c + v * VL);
            x0 = vfma(w, t[k], x0);
            x1 = vfma(w, t[k + 1], x1);
        }
        a0[v] = silu ? vsilu(x0, silu) : x0;
        a1[v] = silu ? vsilu(x1, silu) : x1;
    }
    if (nt) {
        vstore2_as(y0, ydt, c, a0[0], a0[1], 1);
        vstore2_as(y0, ydt, c + 2 * VL, a0[2], a0[3], 1);
        vstore2_as(y1, ydt, c, a1[0], a1[1], 1);
        vstore2_as(y1, ydt, c + 2 * VL, a1[2], a1[3], 1);
        return;
    }
    for (int v = 0; v < 4; v++) {
        vstore_as(y0, ydt, c + v * VL, a0[v]);
        vstore_as(y1, ydt, c + v * VL, a1[v]);
    }
}

/* Tap rows prefetched ahead of the newest one when the rows are taken one at a time: the
 * hardware streamers alone left the loads of each new row waiting on memory. Measured on the
 * Zen 4 VM (Qwen3-Next's conv, 2K tokens x 8192 channels, bf16, SiLU, `flywheel bench conv`):
 * one thread 8.8-9.2 ms without, 6.7-7.1 with 2 rows ahead (6.7-7.3 with 4, 6.8-6.9 with 8);
 * two threads 4.7-5.2 without, 4.2-4.6 with 2. With the prefetch, streaming the outputs
 * (fw_conv_stream) paid too: 2 threads 3.9-4.3 ms plain, 3.2-4.1 streamed (on the Zen 3 VM,
 * without the prefetch, streamed rows had lost: 9.6-15.5 against 8.1-11.2 ms). Both against
 * the kernel before them, alternating, 2 threads: bf16 4.8-5.4 -> 3.0-3.9 ms, f32 8.8-10.1 ->
 * 6.1-6.5 ms. */
#define CONV_AHEAD_ROWS 2

/* The tap row CONV_AHEAD_ROWS past output row r's newest (rows[r + 3]), or NULL past the
 * call's R + 3 rows. */
FW_INLINE const void *conv_ahead(int R, const void *const *rows, int r)
{
    return r + CONV_AHEAD_ROWS < R ? rows[r + 3 + CONV_AHEAD_ROWS] : NULL;
}

FW_INLINE void conv_rows4_as(int R, int pass, const void *const *rows, const fw_dtype tdt, const float *wt,
                             int64_t ldw, const float *bias, int n, const int silu, void *const *ys, fw_dtype ydt,
                             int nt)
{
    if (pass == 1) { /* a row at a time (fw_conv_pass_rows), or two (conv_pair_vecs), 4 vectors
                      * at a time; the same bits */
        int r = 0;
        for (; CONV_PAIRS && r + 1 < R; r += 2) {
            const void *a0 = conv_ahead(R, rows, r), *a1 = conv_ahead(R, rows, r + 1);
            int c = 0;
            for (; c + 4 * VL <= n; c += 4 * VL) {
                conv_prefetch4(a0, tdt, c);
                conv_prefetch4(a1, tdt, c);
                conv_pair_vecs(rows + r, tdt, wt, ldw, bias, silu, ys[r], ys[r + 1], ydt, c, nt);
            }
            conv_rows_from(2, rows + r, tdt, wt, ldw, bias, n, silu, ys + r, ydt, c);
        }
        for (; r < R; r++)
            conv_row_as(4, rows + r, tdt, wt, ldw, bias, NULL, FW_F32, n, silu, ys[r], ydt, conv_ahead(R, rows, r), nt);
        return;
    }
    for (int r0 = 0; r0 < R; r0 += CONV_PASS_ROWS)
        conv_rows4_block(R - r0 < CONV_PASS_ROWS ? R - r0 : CONV_PASS_ROWS, rows + r0, tdt, wt, ldw, bias, n, silu,
                         ys + r0, ydt, nt);
}

/* R consecutive output rows (no residual): ys[r] = conv1d_row of taps rows[r .. r + W - 1].
 * pass: 1 for a row at a time, else passes of CONV_PASS_ROWS (width 4). stream: the width-4
 * kernel stores non-temporally where every row is aligned for it. */
static void conv1d_rows(int W, int R, int pass, const void *const *rows, fw_dtype tdt, const float *wt, int64_t ldw,
                        const float *bias, int n, int silu, void *const *ys, fw_dtype ydt, int stream)
{
    if (W != 4) {
        for (int r = 0; r < R; r++)
            conv1d_row(W, rows + r, tdt, wt, ldw, bias, NULL, FW_F32, n, silu, ys[r], ydt);
        return;
    }
    const uintptr_t vbytes = (uintptr_t)VL * (ydt == FW_F32 ? 4 : 2);
    int nt = stream;
    for (int r = 0; r < R && nt; r++)
        nt = (uintptr_t)ys[r] % vbytes == 0;
#define CONV_ROWS(T, S) conv_rows4_as(R, pass, rows, T, wt, ldw, bias, n, S, ys, ydt, nt)
#define CONV_ROWS_MODES(T) (silu == FW_SILU_HALF ? CONV_ROWS(T, FW_SILU_HALF) : silu ? CONV_ROWS(T, 1) : CONV_ROWS(T, 0))
    if (tdt == FW_BF16)
        CONV_ROWS_MODES(FW_BF16);
    else if (tdt == FW_F16)
        CONV_ROWS_MODES(FW_F16);
    else
        CONV_ROWS_MODES(FW_F32);
#undef CONV_ROWS_MODES
#undef CONV_ROWS
    if (nt)
        vstream_fence();
}

/* ------------------------------------------------------------ plain baseline -- */

static float dot(const float *x, const float *y, int n)
{
    vf acc = vzero();
    int i = 0;
    for (; i + VL <= n; i += VL)
        acc = vfma(vload(x + i), vload(y + i), acc);
    float s = vhsum(acc);
    for (; i < n; i++)
        s += x[i] * y[i];
    return s;
}

static void axpby(float *acc, float a, const float *x, float b, int n)
{
    /* acc = b * acc + a * x */
    vf va = vset1(a), vb = vset1(b);
    int i = 0;
    for (; i + VL <= n; i += VL)
        vstore(acc + i, vfma(va, vload(x + i), vmul(vb, vload(acc + i))));
    for (; i < n; i++)
        acc[i] = a * x[i] + b * acc[i];
}

static void plain_row(const float *q, int d, int dv, fw_dtype dt, const void *K, int64_t ldk,
                      int64_t kdim, const void *V, int64_t ldv, int64_t vdim, int64_t n, float cap2,
                      float *acc, float *mo, float *lo, float *scratch)
{
    const size_t es = dt == FW_F32 ? 4 : 2;
    float m = *mo, l = *lo, *kf = scratch, *vf_ = scratch + d;
    for (int64_t j = 0; j < n; j++) {
        to_f32((const char *)K + (size_t)(j * ldk) * es, dt, kdim, d, 1.0f, kf);
        to_f32((const char *)V + (size_t)(j * ldv) * es, dt, vdim, dv, 1.0f, vf_);
        float s = dot(q, kf, d);
        if (cap2 > 0.0f)
            s = cap2 * tanhf(s);
        float p = 1.0f, scale = 1.0f;
        if (s > m) { /* p = exp2(s - s): 1, or NaN for s = +inf as in the reference */
            scale = m == -INFINITY ? 0.0f : exp2f(m - s);
            m = s;
            p = s == INFINITY ? NAN : 1.0f;
        } else { /* s = -inf adds nothing (a row that only has those ends as NaN at the store) */
            p = s == -INFINITY ? 0.0f : exp2f(s - m);
        }
        axpby(acc, p, vf_, scale, dv);
        l = l * scale + p;
    }
    *mo = m;
    *lo = l;
}

/* --------------------------------------------------------- Gated DeltaNet -- */

/* x[i] = 2^x[i]. Arguments below -126 give 0 (callers mask with -1e30, never -inf). */
static void exp2_inplace(float *x, int64_t n)
{
    int64_t i = 0;
    for (; i + VL <= n; i += VL)
        vstore(x + i, vexp2(vload(x + i)));
    for (; i < n; i++)
        x[i] = exp2f(x[i]);
}

/* Row r of x [rows][n] times scale / sqrt(|x_r|^2 + eps) (l2 = 1) or times scale (l2 = 0). */
static void rows_l2scale(float *x, int rows, int n, float scale, int l2, float eps)
{
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * n, s = scale;
        if (l2) {
            vf a0 = vzero(), a1 = vzero();
            int i = 0;
            for (; i + 2 * VL <= n; i += 2 * VL) {
                const vf u = vload(xr + i), w = vload(xr + i + VL);
                a0 = vfma(u, u, a0);
                a1 = vfma(w, w, a1);
            }
            double ss = vhsum(vadd(a0, a1));
            for (; i < n; i++)
                ss += (double)xr[i] * xr[i];
            s = (float)(scale / sqrt(ss + (double)eps));
        }
        const vf vs = vset1(s);
        int i = 0;
        for (; i + VL <= n; i += VL)
            vstore(xr + i, vmul(vs, vload(xr + i)));
        for (; i < n; i++)
            xr[i] *= s;
    }
}

/* The chunk's gate matrices, rows i < L, columns j < 64, gam[] in log2 units (read to 64):
 *   A[i][j]  = beta[i] 2^(gam_i - gam_j) KK[i][j]  for j < i, else 0
 *   G[i][j]  = 2^(gam_i - gam_j) QK[i][j]           for j <= i, j < L, else 0
 * Masked differences become -1e30 before exp2 (never -inf: 2^(-inf) is NaN in some tables). */
static void gdn_gates(int L, const float *gam, const float *beta, const float *KK, const float *QK,
                      float *A, float *G, int ldg)
{
    const vf big = vset1(-1e30f);
    for (int i = 0; i < L; i++) {
        const vf gi = vset1(gam[i]), fi = vset1((float)i), fl = vset1((float)L), bi = vset1(beta[i]);
        for (int j = 0; j < 64; j += VL) {
            const vf jv = vload(dec_iota + j), dlt = vsub(gi, vload(gam + j));
            const vf ea = vexp2(vsel(vlt(jv, fi), dlt, big));
            const vf eg = vexp2(vsel(vmand(vlt(jv, vadd(fi, vset1(1.0f))), vlt(jv, fl)), dlt, big));
            vstore(A + (size_t)i * 64 + j, vmul(vmul(ea, bi), vload(KK + (size_t)i * 64 + j)));
            vstore(G + (size_t)i * ldg + j, vmul(eg, vload(QK + (size_t)i * 64 + j)));
        }
    }
}

/* X = (I + A)^-1 for A strictly lower triangular, L x L (row strides lda, ldx), by forward
 * substitution: row i of X is e_i - sum_{m<i} A[i][m] X[m][:], vectors along the columns. */
static void tri_inv_fwd(const float *A, int lda, int L, float *X, int ldx)
{
    for (int i = 0; i < L; i++) {
        float *xi = X + (size_t)i * ldx;
        for (int j = 0; j < L; j++)
            xi[j] = j == i ? 1.0f : 0.0f;
        for (int m = 0; m < i; m++) {
            const vf a = vset1(-A[(size_t)i * lda + m]);
            const float *xm = X + (size_t)m * ldx;
            int j = 0;
            for (; j + VL <= m + 1; j += VL)
                vstore(xi + j, vfma(a, vload(xm + j), vload(xi + j)));
            for (; j <= m; j++)
                xi[j] += -A[(size_t)i * lda + m] * xm[j];
        }
    }
}

/* The same inverse in FlyWheel's matmul form: the 16 x 16 diagonal blocks by forward
 * substitution, then block row I, column J < I as X_IJ = -X_II (sum_{M=J}^{I-1} A_IM X_MJ),
 * in order of distance I - J, each a pair of 16 x 16 block products (broadcast FMAs along
 * the block's 16 columns). L is padded to a multiple of 16 with identity rows, which leaves
 * the inverse's first L rows and columns exact. */
#define TRI_B 16
static void tri_inv_blocked(const float *A, int lda, int L, float *X, int ldx)
{
    const int nb = (L + TRI_B - 1) / TRI_B, Lp = nb * TRI_B;
    float Ap[64 * 64], tmp[TRI_B * TRI_B];
    for (int i = 0; i < Lp; i++)
        for (int j = 0; j < Lp; j++)
            Ap[i * 64 + j] = i < L && j < L ? A[(size_t)i * lda + j] : 0.0f;
    for (int i = 0; i < Lp; i++)
        for (int j = 0; j < Lp; j++)
            X[(size_t)i * ldx + j] = 0.0f;
    for (int b = 0; b < nb; b++)
        tri_inv_fwd(Ap + b * TRI_B * 64 + b * TRI_B, 64, TRI_B, X + (size_t)b * TRI_B * ldx + b * TRI_B, ldx);
    for (int dist = 1; dist < nb; dist++)
        for (int I = dist; I < nb; I++) {
            const int J = I - dist;
            for (int r = 0; r < TRI_B; r++) {
                float *t = tmp + r * TRI_B;
                for (int c = 0; c < TRI_B; c++)
                    t[c] = 0.0f;
                for (int mcol = J * TRI_B; mcol < I * TRI_B; mcol++) {
                    const vf a = vset1(Ap[(I * TRI_B + r) * 64 + mcol]);
                    const float *xm = X + (size_t)mcol * ldx + J * TRI_B;
                    for (int c = 0; c < TRI_B; c += VL)
                        vstore(t + c, vfma(a, vload(xm + c), vload(t + c)));
                }
            }
            for (int r = 0; r < TRI_B; r++) {
                float *xo = X + (size_t)(I * TRI_B + r) * ldx + J * TRI_B;
                for (int c = 0; c < TRI_B; c++)
                    xo[c] = 0.0f;
                for (int q2 = 0; q2 <= r; q2++) {
                    const vf a = vset1(-X[(size_t)(I * TRI_B + r) * ldx + I * TRI_B + q2]);
                    for (int c = 0; c < TRI_B; c += VL)
                        vstore(xo + c, vfma(a, vload(tmp + q2 * TRI_B + c), vload(xo + c)));
                }
            }
        }
}

/* KDA: dst = x o 2^(g1 - g0) over n elements (x NULL: ones; g0 NULL: zeros). The chunk's
 * per-channel decays enter its operands this way, every exponent a difference <= 0. */
/* KDA's decayed operands: e = 2^(float)(g1 - g0) (the difference in double; g0 NULL: 0),
 * dx = x o e (x NULL: e) and, with dy, dy = y o e: one exponential for two operands, the
 * same bits as exp2_scale on the rounded differences. */
static void exp2d_scale2(int n, const double *g1, const double *g0, const float *x, float *dx, const float *y,
                         float *dy)
{
    int i = 0;
    for (; i + VL <= n; i += VL) {
        const vf e = vexp2(vload_dsub(g1, g0, i));
        vstore(dx + i, x ? vmul(vload(x + i), e) : e);
        if (dy)
            vstore(dy + i, vmul(vload(y + i), e));
    }
    for (; i < n; i++) {
        const float e = exp2f((float)(g1[i] - (g0 ? g0[i] : 0.0)));
        dx[i] = x ? x[i] * e : e;
        if (dy)
            dy[i] = y[i] * e;
    }
}

static void exp2_scale(int n, const float *x, const float *g1, const float *g0, float *dst)
{
    int i = 0;
    for (; i + VL <= n; i += VL) {
        vf e = g0 ? vsub(vload(g1 + i), vload(g0 + i)) : vload(g1 + i);
        e = vexp2(e);
        vstore(dst + i, x ? vmul(vload(x + i), e) : e);
    }
    for (; i < n; i++) {
        const float e = exp2f(g1[i] - (g0 ? g0[i] : 0.0f));
        dst[i] = x ? x[i] * e : e;
    }
}

/* log(1 + z) for z in [0, 1] with only vector arithmetic: 1 + z = 2^e m, e = [z > sqrt2 - 1],
 * m in [sqrt(1/2), sqrt2], t = (m - 1) / (m + 1) from z itself ((z - 1) / (z + 3) or z /
 * (z + 2), so 1 + z is never rounded), log m = 2 atanh t to t^9 (|t| <= 0.172: the next term
 * is below 4e-10). */
FW_INLINE vf vlog1p_unit(vf z)
{
    const vm big = vlt(vset1(0.41421356f), z);
    const vf t = vsel(big, vdiv(vsub(z, vset1(1.0f)), vadd(z, vset1(3.0f))), vdiv(z, vadd(z, vset1(2.0f))));
    const vf s = vmul(t, t);
    vf p = vfma(s, vset1(1.0f / 9.0f), vset1(1.0f / 7.0f));
    p = vfma(p, s, vset1(1.0f / 5.0f));
    p = vfma(p, s, vset1(1.0f / 3.0f));
    p = vfma(p, s, vset1(1.0f));
    return vadd(vmul(vadd(t, t), p), vsel(big, vset1(0.69314718f), vzero()));
}

/* KDA's gates of one row, in log2 units, from the raw a (n channels) and the value head's
 * dt_bias row (NULL: 0), ea = exp(a_log), lb = lower_bound: y = a + dt_bias, then
 * -ea softplus(y) (lb = 0; softplus(y) = max(y, 0) + log1p(e^-|y|), and y above 20) or
 * lb sigmoid(ea y). Vectorised; within a few ulp of gate_g_at's libm form (gdn.h). */
static void kda_gates(int n, const float *a, const float *bias, float ea, float lb, float *g2)
{
    const float l2e = 1.44269504088896341f; /* log2(e) */
    const vf L2E = vset1(l2e), E = vset1(ea);
    int i = 0;
    for (; i + VL <= n; i += VL) {
        const vf y = bias ? vadd(vload(a + i), vload(bias + i)) : vload(a + i);
        vf g;
        if (lb < 0.0f) {
            g = vdiv(vset1(lb), vadd(vset1(1.0f), vexp2(vmul(vmul(vset1(-1.0f), vmul(E, y)), L2E))));
        } else {
            const vf ay = vmax(y, vsub(vzero(), y));
            const vf sp = vadd(vmax(y, vzero()), vlog1p_unit(vexp2(vmul(vsub(vzero(), ay), L2E))));
            g = vmul(vsub(vzero(), E), vsel(vlt(vset1(20.0f), y), y, sp));
        }
        vstore(g2 + i, vmul(g, L2E));
    }
    for (; i < n; i++) {
        const float y = a[i] + (bias ? bias[i] : 0.0f);
        const float g = lb < 0.0f ? lb / (1.0f + expf(-ea * y)) : -ea * (y > 20.0f ? y : log1pf(expf(y)));
        g2[i] = g * l2e;
    }
}

/* KDA's pairs inside each block of FW_KDA_BLOCK rows of a chunk (products cover the pairs across
 * blocks). For j <= i in one block, KE = K_j o E_{j+1} o ... o E_i, with E_s the step decays
 * 2^(g_s) [L][dk]: K_j decayed to row i by products, with no exponent of a difference at all.
 *   A[i][j] = beta_i K_i . KE  (j < i),      G[i][j] = Q_i . KE  (j <= i)
 * Entries outside the diagonal blocks are left as they are. */
static void kda_diag(int L, int dk, const float *Q, const float *K, const float *E, const float *beta,
                     float *A, int lda, float *G, int ldg)
{
    float ke[FW_MAX_HEAD_DIM];
    const int nv = dk / VL * VL;
    for (int b0 = 0; b0 < L; b0 += FW_KDA_BLOCK) {
        const int b1 = b0 + FW_KDA_BLOCK < L ? b0 + FW_KDA_BLOCK : L;
        for (int j = b0; j < b1; j++) {
            memcpy(ke, K + (size_t)j * dk, sizeof(float) * (size_t)dk);
            for (int i = j; i < b1; i++) {
                const float *ki = K + (size_t)i * dk, *qi = Q + (size_t)i * dk, *ei = E + (size_t)i * dk;
                vf sk = vzero(), sq = vzero();
                int x = 0;
                for (; x < nv; x += VL) {
                    vf e = vload(ke + x);
                    if (i > j) {
                        e = vmul(e, vload(ei + x));
                        vstore(ke + x, e);
                    }
                    sk = vfma(vload(ki + x), e, sk);
                    sq = vfma(vload(qi + x), e, sq);
                }
                float tk = vhsum(sk), tq = vhsum(sq);
                for (; x < dk; x++) {
                    if (i > j)
                        ke[x] *= ei[x];
                    tk += ki[x] * ke[x];
                    tq += qi[x] * ke[x];
                }
                if (i > j)
                    A[(size_t)i * lda + j] = beta[i] * tk;
                G[(size_t)i * ldg + j] = tq;
            }
        }
    }
}

/* Column vectors of the state per register block of the decode step: the block's a and b
 * sums (2 x GDN_CV accumulators) stay in registers over all dk rows. */
#define GDN_CV 8

/* a = h^T (d o k), b = h^T (d o q) over rows 0 .. dk-1 (d the rows' decays) for cv column
 * vectors of h from column 0. */
FW_INLINE void gdn_dec_ab_in(const int cv, const void *h, const fw_dtype dt, int64_t ldh, int dk,
                             const float *q, const float *k, const float *d, float *a, float *b)
{
    vf va[GDN_CV], vb[GDN_CV];
    for (int c = 0; c < cv; c++)
        va[c] = vb[c] = vzero();
    for (int r = 0; r < dk; r++) {
        const char *hr = (const char *)h + (size_t)r * (size_t)ldh * (dt == FW_F32 ? 4 : 2);
        const vf kr = vset1(d[r] * k[r]), qr = vset1(d[r] * q[r]);
        for (int c = 0; c < cv; c++) {
            const vf x = vload_in(hr, dt, c * VL);
            va[c] = vfma(kr, x, va[c]);
            vb[c] = vfma(qr, x, vb[c]);
        }
    }
    for (int c = 0; c < cv; c++) {
        vstore(a + c * VL, va[c]);
        vstore(b + c * VL, vb[c]);
    }
}

FW_INLINE void gdn_dec_ab(const int cv, const float *h, int64_t ldh, int dk, const float *q,
                          const float *k, const float *d, float *a, float *b)
{
    gdn_dec_ab_in(cv, h, FW_F32, ldh, dk, q, k, d, a, b);
}

/* h = diag(decay) h + k dl^T for cv column vectors of h (f32, or bf16: read into f32 and
 * rounded back) from column 0. */
FW_INLINE void gdn_dec_update_in(const int cv, void *h, const fw_dtype dt, int64_t ldh, int dk, const float *k,
                                 const float *dl, const float *decay)
{
    vf d[GDN_CV];
    for (int c = 0; c < cv; c++)
        d[c] = vload(dl + c * VL);
    for (int r = 0; r < dk; r++) {
        char *hr = (char *)h + (size_t)r * (size_t)ldh * (dt == FW_F32 ? 4 : 2);
        const vf kr = vset1(k[r]), al = vset1(decay[r]);
        for (int c = 0; c < cv; c++)
            vstore_as(hr, dt, c * VL, vfma(kr, d[c], vmul(al, vload_in(hr, dt, c * VL))));
    }
}

FW_INLINE void gdn_dec_update(const int cv, float *h, int64_t ldh, int dk, const float *k,
                              const float *dl, const float *decay)
{
    gdn_dec_update_in(cv, h, FW_F32, ldh, dk, k, dl, decay);
}

static __attribute__((noinline)) void gdn_dec_ab_tail(int cv, const float *h, int64_t ldh, int dk,
                                                      const float *q, const float *k, const float *d,
                                                      float *a, float *b)
{
    gdn_dec_ab(cv, h, ldh, dk, q, k, d, a, b);
}

static __attribute__((noinline)) void gdn_dec_ab_bf16(int cv, const void *h, int64_t ldh, int dk,
                                                      const float *q, const float *k, const float *d,
                                                      float *a, float *b)
{
    gdn_dec_ab_in(cv, h, FW_BF16, ldh, dk, q, k, d, a, b);
}

static __attribute__((noinline)) void gdn_dec_update_tail(int cv, float *h, int64_t ldh, int dk,
                                                          const float *k, const float *dl,
                                                          const float *decay)
{
    gdn_dec_update(cv, h, ldh, dk, k, dl, decay);
}

static __attribute__((noinline)) void gdn_dec_update_bf16(int cv, void *h, int64_t ldh, int dk,
                                                          const float *k, const float *dl,
                                                          const float *decay)
{
    gdn_dec_update_in(cv, h, FW_BF16, ldh, dk, k, dl, decay);
}

/* One fused decode step on columns [c0, c1) of a state h [dk][ldh] (GDN_COLS at most), with
 * D = diag(decay) the decays of h's rows (all alike for GDN, one per key channel for KDA):
 * first a = h^T D k and b = h^T D q, then delta = beta (v - a), o = b + delta (k . q), and
 * the update h = D h + k delta^T on the second pass. Each pass takes GDN_CV column
 * vectors at a time with their sums or deltas in registers, so h is the only array in
 * memory it reads and writes. Measured (`flywheel bench gdn --decode --seqs 1 --h 16 --hv 32
 * --dk 128 --dv 128 --dtype bf16`): with a and b in memory, loaded and stored for every row,
 * 107 / 65 us a step on 1 / 2 threads; in registers, 70 / 45 us (64 sequences: 6.1-6.2 ->
 * 5.7-5.8 ms, where DRAM bandwidth bounds it).
 * The columns are independent, so threads can split them. */
#define GDN_COLS 1024
/* The fused step's two reads of the state, alone (ReplaySSM reads a checkpoint it does not
 * update, f32 or its bf16 shadow: hdt): a[c] = sum_r decay[r] k[r] h[r][c], b[c] = the same
 * with q, for c in [c0, c1); ldh in elements. */
static void gdn_dec_reads(const void *hv, fw_dtype hdt, int64_t ldh, int dk, int c0, int c1, const float *q,
                          const float *k, const float *decay, float *a, float *b)
{
    const int n = c1 - c0, nv = n / VL * VL, es = hdt == FW_F32 ? 4 : 2;
    const char *h = (const char *)hv + (size_t)c0 * (size_t)es;
    a += c0;
    b += c0;
    for (int c = 0; c < nv; c += GDN_CV * VL) {
        const int cv = (nv - c) / VL < GDN_CV ? (nv - c) / VL : GDN_CV;
        const char *hc = h + (size_t)c * (size_t)es;
        if (hdt != FW_F32 && cv == GDN_CV)
            gdn_dec_ab_in(GDN_CV, hc, FW_BF16, ldh, dk, q, k, decay, a + c, b + c);
        else if (hdt != FW_F32)
            gdn_dec_ab_bf16(cv, hc, ldh, dk, q, k, decay, a + c, b + c);
        else if (cv == GDN_CV)
            gdn_dec_ab(GDN_CV, (const float *)hc, ldh, dk, q, k, decay, a + c, b + c);
        else
            gdn_dec_ab_tail(cv, (const float *)hc, ldh, dk, q, k, decay, a + c, b + c);
    }
    for (int c = nv; c < n; c++) {
        a[c] = b[c] = 0.0f;
        for (int r = 0; r < dk; r++) {
            const char *e = h + ((size_t)r * (size_t)ldh + (size_t)c) * (size_t)es;
            const float x = hdt == FW_F32 ? *(const float *)e : fw_cvt_bf16_f32(*(const uint16_t *)e);
            a[c] += decay[r] * k[r] * x;
            b[c] += decay[r] * q[r] * x;
        }
    }
}

static void gdn_dec_cols(void *hv, fw_dtype hdt, int64_t ldh, int dk, int c0, int c1, const float *q,
                         const float *k, const float *v, const float *decay, float beta, float kq,
                         float *o)
{
    float a[GDN_COLS], b[GDN_COLS], dl[GDN_COLS];
    const int n = c1 - c0, nv = n / VL * VL, es = hdt == FW_F32 ? 4 : 2;
    char *h = (char *)hv + (size_t)c0 * (size_t)es;
    gdn_dec_reads(h, hdt, ldh, dk, 0, n, q, k, decay, a, b);
    for (int c = 0; c < n; c++) {
        dl[c] = beta * (v[c0 + c] - a[c]);
        o[c0 + c] = b[c] + dl[c] * kq;
    }
    for (int c = 0; c < nv; c += GDN_CV * VL) {
        const int cv = (nv - c) / VL < GDN_CV ? (nv - c) / VL : GDN_CV;
        char *hc = h + (size_t)c * (size_t)es;
        if (hdt != FW_F32 && cv == GDN_CV)
            gdn_dec_update_in(GDN_CV, hc, FW_BF16, ldh, dk, k, dl + c, decay);
        else if (hdt != FW_F32)
            gdn_dec_update_bf16(cv, hc, ldh, dk, k, dl + c, decay);
        else if (cv == GDN_CV)
            gdn_dec_update(GDN_CV, (float *)hc, ldh, dk, k, dl + c, decay);
        else
            gdn_dec_update_tail(cv, (float *)hc, ldh, dk, k, dl + c, decay);
    }
    for (int r = 0; r < dk; r++)
        for (int c = nv; c < n; c++) {
            char *e = h + ((size_t)r * (size_t)ldh + (size_t)c) * (size_t)es;
            if (hdt == FW_F32) {
                *(float *)e = k[r] * dl[c] + decay[r] * *(float *)e;
            } else {
                const float x = k[r] * dl[c] + decay[r] * fw_cvt_bf16_f32(*(uint16_t *)e);
                *(uint16_t *)e = fw_cvt_f32_bf16(x);
            }
        }
}

/* The plain recurrent step the baseline times: four separate passes over h, as ggml does:
 * decay (row r by decay[r]), a = h^T k, h += k delta^T, o = h^T q. */
static void gdn_step4(float *h, int64_t ldh, int dk, int dv, const float *q, const float *k,
                      const float *v, const float *decay, float beta, float *o, float *tmp)
{
    const int nv = dv / VL * VL;
    for (int r = 0; r < dk; r++) {
        float *hr = h + (size_t)r * ldh;
        const vf al = vset1(decay[r]);
        int c = 0;
        for (; c < nv; c += VL)
            vstore(hr + c, vmul(al, vload(hr + c)));
        for (; c < dv; c++)
            hr[c] *= decay[r];
    }
    for (int c = 0; c < dv; c++)
        tmp[c] = 0.0f;
    for (int r = 0; r < dk; r++) {
        const float *hr = h + (size_t)r * ldh;
        const vf kr = vset1(k[r]);
        int c = 0;
        for (; c < nv; c += VL)
            vstore(tmp + c, vfma(kr, vload(hr + c), vload(tmp + c)));
        for (; c < dv; c++)
            tmp[c] += k[r] * hr[c];
    }
    for (int c = 0; c < dv; c++)
        tmp[c] = beta * (v[c] - tmp[c]);
    for (int r = 0; r < dk; r++) {
        float *hr = h + (size_t)r * ldh;
        const vf kr = vset1(k[r]);
        int c = 0;
        for (; c < nv; c += VL)
            vstore(hr + c, vfma(kr, vload(tmp + c), vload(hr + c)));
        for (; c < dv; c++)
            hr[c] += k[r] * tmp[c];
    }
    for (int c = 0; c < dv; c++)
        o[c] = 0.0f;
    for (int r = 0; r < dk; r++) {
        const float *hr = h + (size_t)r * ldh;
        const vf qr = vset1(q[r]);
        int c = 0;
        for (; c < nv; c += VL)
            vstore(o + c, vfma(qr, vload(hr + c), vload(o + c)));
        for (; c < dv; c++)
            o[c] += q[r] * hr[c];
    }
}

/* ------------------------------------------------------------------- peak -- */

/* Throughput of one thread in GFLOP/s over about `seconds`: PEAK_CHAINS independent chains
 * (more than latency x pipes), each value pinned in a register with vkeep so no compiler can
 * fold, merge or drop a chain, so the count of instructions executed is exactly the count
 * in the formula. f32 FMAs give 2 flops per lane; bf16 pair products (bf16 = 1) 4 per word
 * lane, two products and their sums (emulated tables measure what their emulation sustains). */
FW_INLINE double peak_run(double seconds, const int bf16)
{
    vf acc[PEAK_CHAINS];
    const uint32_t one = 0x3f803f80u; /* the bf16 pair (1, 1) */
    const vf b = vkeep(bf16 ? vbcast_word(&one) : vset1((float)(1.0 - 1e-7 * seconds)));
    const vf c = vkeep(bf16 ? vbcast_word(&one) : vset1((float)(1e-7 * seconds)));
    for (int i = 0; i < PEAK_CHAINS; i++)
        acc[i] = vkeep(vset1((float)i * (float)seconds));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double t;
    int64_t iters = 0;
    do {
        for (int r = 0; r < 4096; r++)
            for (int i = 0; i < PEAK_CHAINS; i++)
                acc[i] = vkeep(bf16 ? vdpbf(acc[i], b, c) : vfma(acc[i], b, c));
        iters += 4096;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        t = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    } while (t < seconds);
    vf s = acc[0];
    for (int i = 1; i < PEAK_CHAINS; i++)
        s = vadd(s, acc[i]);
    volatile float sink = vhsum(s);
    (void)sink;
    return (double)iters * PEAK_CHAINS * VL * (bf16 ? 4.0 : 2.0) / t * 1e-9;
}

static double peak(double seconds) { return peak_run(seconds, 0); }
static double peak_bf16(double seconds) { return peak_run(seconds, 1); }

static float stream_sum(const float *x, size_t n)
{
    vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (size_t i = 0; i < n; i += 4 * VL) {
        a0 = vadd(a0, vload(x + i));
        a1 = vadd(a1, vload(x + i + VL));
        a2 = vadd(a2, vload(x + i + 2 * VL));
        a3 = vadd(a3, vload(x + i + 3 * VL));
    }
    return vhsum(vadd(vadd(a0, a1), vadd(a2, a3)));
}

const fw_kernels FW_TABLE = {
    .name = ISA_NAME,
    .vl = VL,
    .bk = 64,
#ifdef __AVX512BF16__
    .native_bf16 = FW_BF16_DOT,
#endif
    .to_f32 = to_f32,
    .from_f32 = from_f32,
    .qk = qk,
    .softcap = softcap,
    .softmax = softmax,
    .pv = pv,
    .pack_pairs = pack_pairs,
    .pack_row_pairs = pack_row_pairs,
    .pack_vw = pack_vw,
    .qk_bf16 = qk_bf16,
    .pv_bf16 = pv_bf16,
    .pack_kt = pack_kt,
    .dec_qk = dec_qk,
    .dec_softmax = dec_softmax,
    .dec_pv = dec_pv,
    .pack_kt_bf16 = pack_kt_bf16,
    .pack_kt_cols = pack_kt_cols,
    .pack_kt_cols_bf16 = pack_kt_cols_bf16,
    .cols_to_rows = cols_to_rows,
    .panel_bytes = panel_bytes,
    .dec_qk_bf16 = dec_qk_bf16,
    .dec_pv_bf16 = dec_pv_bf16,
    .dec_qk_rows = dec_qk_rows,
    .dec_qk_rows_bf16 = dec_qk_rows_bf16,
    .dec_qk_tiles_bf16 = dec_qk_tiles_bf16,
    .dec_pv_tiles_bf16 = dec_pv_tiles_bf16,
    .plain_row = plain_row,
    .peak = peak,
    .peak_bf16 = peak_bf16,
    .stream_sum = stream_sum,
    .exp2_inplace = exp2_inplace,
    .rows_l2scale = rows_l2scale,
    .gdn_gates = gdn_gates,
    .tri_inv_fwd = tri_inv_fwd,
    .tri_inv_blocked = tri_inv_blocked,
    .gdn_dec_cols = gdn_dec_cols,
    .gdn_dec_reads = gdn_dec_reads,
    .gdn_step4 = gdn_step4,
    .exp2_scale = exp2_scale,
    .exp2d_scale2 = exp2d_scale2,
    .kda_diag = kda_diag,
    .kda_gates = kda_gates,
    .conv_weights = conv_weights,
    .conv1d_row = conv1d_row,
    .conv1d_rows = conv1d_rows,
    .bwd_ds = bwd_ds,
    .rope = rope,
};
