/* kern/mm_kern.h: the mm sub-table (kern/kernels.h): the tile products of attention and
 * GDN, f32 and bf16, and the bf16 operand packing; included by kern/table.h.
 *
 * Tile layout: vectors run along query rows, so
 *   qk:  ST[j][m] = bias[m] + sum_k K[j][k] QT[k][m]   broadcast K[j][k], load QT[k][m..]
 *   pv:  OT[c][m] += sum_j V[j][c] PT[j][m]            broadcast V[j][c], load PT[j][m..]
 * Both keep TJ x TM accumulators in registers (AVX-512: 6 x 4 zmm = 24 of 32 registers; per
 * k step 4 vector loads + 6 broadcasts feed 24 FMAs, so the loads never limit the 2 FMA
 * pipes). Every FMA chain runs over k (or j) in order, one per output, so a result does not
 * depend on how rows are grouped into tiles.
 */

/* ---------------------------------------------------------------------- qk -- */

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
#if QK_TJ > 3
            else if (tj == 3)
                qk_tile(3, TM, d, M, Kj, ldk, QT + m0, bias + m0, S);
#endif
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
#if TJ >= 6 /* (a tile of 6 columns where the layer has them) */
            case 6: pv_tile(6, TM, nk, M, Vc, ldv, PT + m0, O); break;
#endif
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
 * f32 lane), of AMX-BF16 B tiles (pair-interleaved rows) and of Arm's BFDOT, and BFMMLA's
 * 2 x 2-word operands are two rows of it side by side (mm_mmla.h zips them in registers), so
 * a table for any of them packs the same panels, but for VW:
 *   QW [dw][M]           the q tile, unscaled: QW[w][m] = (q_m[2w], q_m[2w+1]), dw = ceil(d/2)
 *   K  [nk][2 ldkw]      bf16 key rows as they lie, zero past d: word w = (K[j][2w], K[j][2w+1])
 *   PW [ceil(nk/2)][M]   probabilities: PW[w][m] = (P[2w][m], P[2w+1][m])
 *   VW [ceil(nk/2)][dv]  value rows in pairs of keys: VW[w][c] = (V[2w][c], V[2w+1][c]);
 *                        pack_vw packs it, and a table may choose its own form (AMX: VW^T;
 *                        neon_bf16: blocks of 4 keys by column pairs, mm_mmla.h)
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

#ifdef ISA_MMLA
#include "mm_mmla.h" /* the same four on a 2x2 block product */
#else
/* VW[w][c] = (X[2w][c], X[2w+1][c]) rounded to bf16: row pairs in the pair layout; bf16 rows
 * (already their values) through f32, a pair of rows at a time. */
static void pack_vw(const void *X, fw_dtype dt, int n, int cols, uint32_t *VW)
{
    float row[2][FW_MAX_HEAD_DIM];
    const size_t es = fw_esize(dt);
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
                const vw kb = vload_word(K + j * ldkw + w);
                for (int m = 0; m < tm; m++)
                    acc[j][m] = vdpbf_by(acc[j][m], q[m], kb);
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
#if QK_TJ > 3
            else if (tj == 3)
                qkb_tile(3, TM, dw, M, Kj, ldkw, Q, scale, b, S);
#endif
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
            const vw vb = vload_word(vr + c);
            for (int m = 0; m < tm; m++)
                acc[c][m] = vdpbf_by(acc[c][m], p[m], vb);
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
#if TJ >= 6 /* (a tile of 6 columns where the layer has them) */
            case 6: pvb_tile(6, TM, nw, M, Vc, dv, P, O); break;
#endif
            case 5: pvb_tile(5, TM, nw, M, Vc, dv, P, O); break;
            case 4: pvb_tile(4, TM, nw, M, Vc, dv, P, O); break;
            case 3: pvb_tile(3, TM, nw, M, Vc, dv, P, O); break;
            case 2: pvb_tile(2, TM, nw, M, Vc, dv, P, O); break;
            default: pvb_tile(1, TM, nw, M, Vc, dv, P, O); break;
            }
        }
    }
}
#endif /* ISA_MMLA */

#define FW_MM_TABLE                                                                              \
    {.qk = qk, .pv = pv, .pack_pairs = pack_pairs, .pack_row_pairs = pack_row_pairs,               \
     .pack_vw = pack_vw, .qk_bf16 = qk_bf16, .pv_bf16 = pv_bf16, .panel_bytes = panel_bytes}
