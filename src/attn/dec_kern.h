/* attn/dec_kern.h: the dec sub-table (attn/attn_table.h): attention's decode kernels, keys
 * along the lanes; included by kern/table.h. */

/* ------------------------------------------------------------------ decode --
 *
 * Few query rows (decode, multi-token decode: G x n <= FW_DEC_ROWS): keys run along the
 * vector lanes instead, so no lane idles.
 *   Kt [d][FW_DEC_KEYS]   f32 key tile, transposed in registers while converting (pack_kt)
 *   Q  [R][d]             f32 query rows in log2 units
 *   S  [R][FW_DEC_KEYS]   scores, then probabilities
 *   V  [nk][dv]           f32 value rows;  O [R][dv] accumulator
 */
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
                    to_f32((const char *)rows[j0 + i] + (size_t)(k0 * kdim) * fw_esize(dt), dt,
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
    const size_t es = fw_esize(dt);
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
                    to_f32((const char *)V[j] + (size_t)c * fw_esize(dt), dt, 1, 1, 1.0f, &x);
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
        if (kdim == 1 && dt != FW_BF16) /* (fp8 caches: their words, exact) */
            for (; w0 + VL <= d / 2; w0 += VL) {
                vf r[VL];
                for (int i = 0; i < VL; i++)
                    r[i] = j0 + i >= nk     ? vzero()
                           : fw_is_f8(dt) ? vload_f8_bits(rows[j0 + i], dt, 2 * w0)
                                          : vbf16_row(vload_in(rows[j0 + i], dt, 2 * w0), vload_in(rows[j0 + i], dt, 2 * w0 + VL));
                vtranspose(r);
                for (int c = 0; c < VL; c++)
                    vstore((float *)KtW + (size_t)(w0 + c) * FW_DEC_KEYS + j0, r[c]);
            }
        for (; w0 < dw; w0++)
            for (int i = 0; i < VL; i++) {
                float x[2] = {0.0f, 0.0f};
                for (int e = 0; e < 2 && j0 + i < nk && 2 * w0 + e < d; e++)
                    to_f32((const char *)rows[j0 + i] + (size_t)((2 * w0 + e) * kdim) * fw_esize(dt),
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
                const vw qb = vload_word(QW + (size_t)r * dw + w);
                for (int x = 0; x < kv; x++)
                    acc[r][x] = vdpbf_by(acc[r][x], kt[x], qb);
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
    const size_t es = fw_esize(dt);
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
    const size_t es = fw_esize(dt);
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
            const vw pb = vload_word(PW + (size_t)r * (FW_DEC_KEYS / 2) + j / 2);
            for (int c = 0; c < cv; c++)
                acc[r][c] = vdpbf_by(acc[r][c], vv[c], pb);
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

/* decb_pv_tile for bf16 value rows (dt FW_BF16) and an fp8 cache's (FW_F8E4M3, FW_F8E5M2):
 * the pairs by unpacking two rows' bf16 (vpair_bits; an fp8 row's read by vload_f8_bits),
 * not by converting and rounding them, with O's columns permuted to match while the tile
 * holds them. cv = 4 (two pairs of vectors). */
static const uint16_t dec_zero_row[FW_MAX_HEAD_DIM];

FW_INLINE void decb_pv_tile_rows(const int rt, int nk, int c0, const uint32_t *PW,
                                 const void *const *V, fw_dtype dt, float *O, int dv,
                                 const void *const *next, int nn, const int pf)
{
    const size_t es = fw_esize(dt);
    vf acc[DEC_RT][4];
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < 4; c += 2)
            vcols_to_pairs(O + (size_t)r * dv + c0 + c * VL, &acc[r][c], &acc[r][c + 1]);
    for (int j = 0; j < nk; j += 2) {
        const char *r0 = (const char *)V[j] + c0 * es;
        const char *r1 = (j + 1 < nk ? (const char *)V[j + 1] : (const char *)dec_zero_row) + c0 * es;
        vf vv[4];
        for (int c = 0; c < 4; c += 2) {
            if (dt == FW_BF16)
                vpair_bits(vload_bits(r0 + c * VL * es), vload_bits(r1 + c * VL * es), &vv[c], &vv[c + 1]);
            else
                vpair_bits(vload_f8_bits(r0, dt, c * VL), vload_f8_bits(r1, dt, c * VL), &vv[c], &vv[c + 1]);
            for (int h = 0; pf && h < 2; h++) /* the pair's 2 VL columns of each row */
                if (DEC_PF_LINE((c0 + (c + h) * VL) * es))
                    dec_pf_pair(next, nn, j, (size_t)(c0 + (c + h) * VL) * es);
        }
        for (int c = 0; c < 4; c++)
            vv[c] = vkeep(vv[c]);
        for (int r = 0; r < rt; r++) {
            const vw pb = vload_word(PW + (size_t)r * (FW_DEC_KEYS / 2) + j / 2);
            for (int c = 0; c < 4; c++)
                acc[r][c] = vdpbf_by(acc[r][c], vv[c], pb);
        }
    }
    for (int r = 0; r < rt; r++)
        for (int c = 0; c < 4; c += 2)
            vpairs_to_cols(O + (size_t)r * dv + c0 + c * VL, acc[r][c], acc[r][c + 1]);
}

static __attribute__((noinline)) void decb_pv_rows_tail(int rt, int nk, int c0, const uint32_t *PW,
                                                        const void *const *V, fw_dtype dt, float *O, int dv)
{
    decb_pv_tile_rows(rt, nk, c0, PW, V, dt, O, dv, NULL, 0, 0);
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
                decb_pv_tile_rows(DEC_RT, nk, c0, pr, V, FW_BF16, o, dv, next, nn, 1);
            else if (dt == FW_BF16 && cv == 4 && rt == DEC_RT)
                decb_pv_tile_rows(DEC_RT, nk, c0, pr, V, FW_BF16, o, dv, NULL, 0, 0);
            else if (fw_is_f8(dt) && cv == 4 && rt == DEC_RT && pf)
                decb_pv_tile_rows(DEC_RT, nk, c0, pr, V, dt, o, dv, next, nn, 1);
            else if (fw_is_f8(dt) && cv == 4 && rt == DEC_RT)
                decb_pv_tile_rows(DEC_RT, nk, c0, pr, V, dt, o, dv, NULL, 0, 0);
            else if ((dt == FW_BF16 || fw_is_f8(dt)) && cv == 4)
                decb_pv_rows_tail(rt, nk, c0, pr, V, dt, o, dv);
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
                        to_f32((const char *)V[2 * w + e] + (size_t)c * fw_esize(dt), dt, 1, 1, 1.0f, &x[e]);
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
/* Blocks side by side: DQ_NB (an ISA's optional constant, 1 unless it says) blocks of
 * consecutive keys run together, their query loads shared, DQ_NB x VL accumulators. For a
 * layer whose block is few chains (NEON: 4 rows of 1 key, 4 accumulators, a quarter of the
 * FMA pipes by llvm-mca's schedule for Neoverse V1, tools/mca_aarch64.py); each accumulator is
 * the chain it is alone, so the bits do not change. DQ_NK: the keys of the blocks together. */
#ifndef DQ_NB
#define DQ_NB 1
#endif
#define DQ_NK (DQ_NB * DQ_KB)
_Static_assert(FW_DEC_KEYS % DQ_NK == 0, "a tile holds whole blocks");

/* The keys of a block (a valid row stands in for the keys past nk) and its query rows (row
 * r0 stands in past R). */
FW_INLINE void dq_block(int R, int nk, int r0, int j0, const void *const *rows, const void **kr,
                        int *rr)
{
    for (int x = 0; x < DQ_NK; x++)
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
    for (int x = 0; x < DQ_NK; x++)
        kn[x] = next[j0 + x < nn ? j0 + x : j0];
    return 1;
}

/* Sets of accumulators per block that take turns along d: one with vectors (a block has VL
 * independent sums), four in the portable table, whose one-lane block would otherwise be a
 * single chain of dependent FMAs (measured there: bf16 rows 416 ns a key against 155 through
 * the panel, whose register tile has many). */
#define DQ_SETS (VL == 1 ? 4 : 1)

FW_INLINE void dq_zero(vf acc[DQ_SETS][DQ_NB][VL])
{
    for (int e = 0; e < DQ_SETS; e++)
        for (int b = 0; b < DQ_NB; b++)
            for (int i = 0; i < VL; i++)
                acc[e][b][i] = vzero();
}

/* Block b's totals, lane r * DQ_KB + x: row r0 + r, key j0 + b DQ_KB + x. */
FW_INLINE vf dq_total(vf acc[DQ_SETS][DQ_NB][VL], int b)
{
    for (int e = 1; e < DQ_SETS; e++)
        for (int i = 0; i < VL; i++)
            acc[0][b][i] = vadd(acc[0][b][i], acc[e][b][i]);
    return vsum_each(acc[0][b]);
}

/* One step along d: elements c .. c+VL-1 of the blocks' rows and keys (f32 products). */
FW_INLINE void dq_step_f32(vf acc[DQ_NB][VL], const void *const *kr, const int *rr, const float *Q,
                           int d, fw_dtype dt, int c, const void *const *kn, const int pf)
{
    const size_t es = fw_esize(dt);
    vf kv[DQ_NK];
    for (int x = 0; x < DQ_NK; x++) {
        kv[x] = vload_in(kr[x], dt, c);
        if (pf && DEC_PF_LINE(c * es))
            __builtin_prefetch((const char *)kn[x] + (size_t)c * es, 0, 2);
    }
    for (int r = 0; r < DQ_RB; r++) {
        const vf qv = vload(Q + (size_t)rr[r] * d + c);
        for (int b = 0; b < DQ_NB; b++)
            for (int x = 0; x < DQ_KB; x++)
                acc[b][r * DQ_KB + x] = vfma(qv, kv[b * DQ_KB + x], acc[b][r * DQ_KB + x]);
    }
}

/* One step along the words: words w .. w+VL-1 of the blocks' rows and keys (bf16 products;
 * key rows bf16, or fp8 read as their bf16). */
FW_INLINE void dq_step_bf16(vf acc[DQ_NB][VL], const void *const *kr, const int *rr,
                            const uint32_t *QW, int dw, int w, fw_dtype dt, const void *const *kn, const int pf)
{
    const size_t at = (size_t)w * 2 * fw_esize(dt); /* the words' byte offset in a key row */
    vf kv[DQ_NK];
    for (int x = 0; x < DQ_NK; x++) {
        kv[x] = dt == FW_BF16 ? vload_bits((const char *)kr[x] + at) : vload_f8_bits(kr[x], dt, 2 * w);
        if (pf && DEC_PF_LINE(at))
            __builtin_prefetch((const char *)kn[x] + at, 0, 2);
    }
    for (int r = 0; r < DQ_RB; r++) {
        const vf qv = vload_bits(QW + (size_t)rr[r] * dw + w);
        for (int b = 0; b < DQ_NB; b++)
            for (int x = 0; x < DQ_KB; x++)
                acc[b][r * DQ_KB + x] = vdpbf(acc[b][r * DQ_KB + x], kv[b * DQ_KB + x], qv);
    }
}

static void dq_zero_tail(int R, int nk, float *S)
{
    for (int r = 0; r < R; r++)
        for (int j = nk; j < FW_DEC_KEYS; j++)
            S[(size_t)r * FW_DEC_KEYS + j] = 0.0f;
}

/* Block b's totals (dq_total) to S, rows r0.., keys j0 + b DQ_KB..: a whole block of rows in
 * one go (keys past nk too: dq_zero_tail clears them after), else lane by lane, the rows
 * below R and the keys below nk. */
FW_INLINE void dq_store(float *S, int R, int nk, int r0, int j0, int b, vf tot, int whole)
{
    float *s = S + (size_t)r0 * FW_DEC_KEYS + j0 + b * DQ_KB;
    if (whole) {
        vstore_rows(s, FW_DEC_KEYS, tot);
        return;
    }
    float t[VL];
    vstore(t, tot);
    for (int r = 0; r < DQ_RB && r0 + r < R; r++)
        for (int x = 0; x < DQ_KB && j0 + b * DQ_KB + x < nk; x++)
            s[(size_t)r * FW_DEC_KEYS + x] = t[r * DQ_KB + x];
}

/* The f32 products of the blocks along d (dec_qk_rows); pf: prefetch kn's lines as kr's are
 * read. */
FW_INLINE void dq_block_f32(vf acc[DQ_SETS][DQ_NB][VL], const void *const *kr, const int *rr,
                            const float *Q, int d, fw_dtype dt, const void *const *kn, const int pf)
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
FW_INLINE void dq_f32_step(vf acc[DQ_NB][VL], const float *const *k, const float *const *n,
                           const float *QP, int c, const int pf)
{
    vf kv[DQ_NK];
    for (int x = 0; x < DQ_NK; x++) {
        kv[x] = vload(k[x] + c);
        if (pf && DEC_PF_LINE(c * 4))
            __builtin_prefetch(n[x] + c, 0, 2);
    }
    for (int r = 0; r < DQ_RB; r++) {
        const vf qv = vload(QP + r * VL);
        for (int b = 0; b < DQ_NB; b++)
            for (int x = 0; x < DQ_KB; x++)
                acc[b][r * DQ_KB + x] = vfma(qv, kv[b * DQ_KB + x], acc[b][r * DQ_KB + x]);
    }
}

/* Whole blocks of f32 key rows (DQ_SETS == 1, DQ_RB rows, d a multiple of VL) into S (row
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
    const float *k[DQ_NK], *n[DQ_NK];
    for (int x = 0; x < DQ_NK; x++) {
        k[x] = (const float *)kr[x];
        n[x] = kn ? (const float *)kn[x] : NULL;
    }
    vf acc[DQ_NB][VL];
    for (int b = 0; b < DQ_NB; b++)
        for (int i = 0; i < VL; i++)
            acc[b][i] = vzero();
    if (kn)
        for (int c = 0; c < d; c += VL, QP += DQ_RB * VL)
            dq_f32_step(acc, k, n, QP, c, 1);
    else
        for (int c = 0; c < d; c += VL, QP += DQ_RB * VL)
            dq_f32_step(acc, k, n, QP, c, 0);
    for (int b = 0; b < DQ_NB; b++)
        vstore_rows(S + b * DQ_KB, FW_DEC_KEYS, vsum_each(acc[b]));
}

/* next[j], j < nn: the key rows read next (NULL: none), prefetched line by line as the
 * lines at the same offsets of rows[j] are read. */
static void dec_qk_rows(int R, int nk, int d, const float *Q, const void *const *rows, fw_dtype dt,
                        const void *const *next, int nn, float *S)
{
    const int dvec = d / VL * VL;
    const size_t es = fw_esize(dt);
    for (int r0 = 0; r0 < R; r0 += DQ_RB) {
        const int whole = DQ_SETS == 1 && dt == FW_F32 && r0 + DQ_RB <= R && dvec == d;
        float QP[DQ_RB * FW_MAX_HEAD_DIM];
        for (int c = 0; whole && c < d; c += VL)
            for (int r = 0; r < DQ_RB; r++)
                vstore(QP + (c / VL * DQ_RB + r) * VL, vload(Q + (size_t)(r0 + r) * d + c));
        for (int j0 = 0; j0 < nk; j0 += DQ_NK) {
            const void *kr[DQ_NK];
            int rr[DQ_RB];
            dq_block(R, nk, r0, j0, rows, kr, rr);
            const void *kn[DQ_NK];
            const int pf = dq_next(nn, r0, j0, next, kn);
            if (whole) {
                dq_f32_block(kr, pf ? kn : NULL, QP, d, S + (size_t)r0 * FW_DEC_KEYS + j0);
                continue;
            }
            vf acc[DQ_SETS][DQ_NB][VL];
            dq_zero(acc);
            if (pf)
                dq_block_f32(acc, kr, rr, Q, d, dt, kn, 1);
            else
                dq_block_f32(acc, kr, rr, Q, d, dt, NULL, 0);
            const int wb = r0 + DQ_RB <= R && dvec == d;
            for (int b = 0; b < DQ_NB; b++)
                dq_store(S, R, nk, r0, j0, b, dq_total(acc, b), wb);
            /* the channels past the vectors, one at a time, after the lanes' sums */
            for (int r = 0; r < DQ_RB && r0 + r < R && dvec < d; r++)
                for (int x = 0; x < DQ_NK && j0 + x < nk; x++) {
                    float *sp = S + (size_t)(r0 + r) * FW_DEC_KEYS + j0 + x;
                    for (int c = dvec; c < d; c++) {
                        float k;
                        to_f32((const char *)kr[x] + (size_t)c * es, dt, 1, 1, 1.0f, &k);
                        *sp += Q[(size_t)(r0 + r) * d + c] * k;
                    }
                }
        }
    }
    dq_zero_tail(R, nk, S);
}

/* Decode QK^T with bf16 products from bf16 key rows themselves (rows[j]: contiguous bf16,
 * read as words: a bf16 row already is its pairs; an fp8 cache's rows as their bf16, by
 * vload_f8_bits): S[r][j] = scale * QW[r] . K[j] for r < R,
 * j < nk, 0 for j in [nk, FW_DEC_KEYS). The blocks of dec_qk_rows on vdpbf16ps. Measured
 * (avx512bf16, 4 query rows, 64 keys, d 128, cache-hot): pack_kt_bf16's panel then
 * dec_qk_bf16 7.9-8.1 ns a key, this 5.5-5.8; decode at 1K context, GQA 32:8, one thread,
 * bf16, best of 300: 202 -> 174 us. */
/* The bf16 products of the blocks along the words (dec_qk_rows_bf16); pf: prefetch kn's lines
 * as kr's are read. */
FW_INLINE void dq_block_bf16(vf acc[DQ_SETS][DQ_NB][VL], const void *const *kr, const int *rr,
                             const uint32_t *QW, int dw, int wvec, fw_dtype dt, const void *const *kn,
                             const int pf)
{
    int w = 0;
    for (; w + DQ_SETS * VL <= wvec; w += DQ_SETS * VL)
        for (int e = 0; e < DQ_SETS; e++)
            dq_step_bf16(acc[e], kr, rr, QW, dw, w + e * VL, dt, kn, pf);
    for (; w < wvec; w += VL)
        dq_step_bf16(acc[0], kr, rr, QW, dw, w, dt, kn, pf);
}

/* (each dtype's loop compiled apart: dt a constant in it) */
FW_INLINE void dq_block_bf16_as(vf acc[DQ_SETS][DQ_NB][VL], const void *const *kr, const int *rr,
                                const uint32_t *QW, int dw, int wvec, fw_dtype dt, const void *const *kn)
{
    if (dt == FW_BF16 && kn)
        dq_block_bf16(acc, kr, rr, QW, dw, wvec, FW_BF16, kn, 1);
    else if (dt == FW_BF16)
        dq_block_bf16(acc, kr, rr, QW, dw, wvec, FW_BF16, NULL, 0);
    else if (kn)
        dq_block_bf16(acc, kr, rr, QW, dw, wvec, dt, kn, 1);
    else
        dq_block_bf16(acc, kr, rr, QW, dw, wvec, dt, NULL, 0);
}

static void dec_qk_rows_bf16(int R, int nk, int d, const uint32_t *QW, const void *const *rows, fw_dtype dt,
                             float scale, const void *const *next, int nn, float *S)
{
    const int dw = (d + 1) / 2, wvec = d / 2 / VL * VL;
    const vf sc = vset1(scale);
    for (int r0 = 0; r0 < R; r0 += DQ_RB)
        for (int j0 = 0; j0 < nk; j0 += DQ_NK) {
            const void *kr[DQ_NK];
            int rr[DQ_RB];
            dq_block(R, nk, r0, j0, rows, kr, rr);
            vf acc[DQ_SETS][DQ_NB][VL];
            dq_zero(acc);
            const void *kn[DQ_NK];
            dq_block_bf16_as(acc, kr, rr, QW, dw, wvec, dt, dq_next(nn, r0, j0, next, kn) ? kn : NULL);
            if (r0 + DQ_RB <= R && wvec == dw && d % 2 == 0) {
                for (int b = 0; b < DQ_NB; b++)
                    dq_store(S, R, nk, r0, j0, b, vmul(dq_total(acc, b), sc), 1);
                continue;
            }
            /* the sums, then the elements past the vectors one at a time, then the scale */
            for (int b = 0; b < DQ_NB; b++)
                dq_store(S, R, nk, r0, j0, b, dq_total(acc, b), 0);
            for (int r = 0; r < DQ_RB && r0 + r < R; r++)
                for (int x = 0; x < DQ_NK && j0 + x < nk; x++) {
                    float *sp = S + (size_t)(r0 + r) * FW_DEC_KEYS + j0 + x, sum = *sp;
                    for (int e = 2 * wvec; e < d; e++) {
                        const uint32_t qw = QW[(size_t)(r0 + r) * dw + e / 2];
                        sum += fw_cvt_bf16_f32((uint16_t)(qw >> (16 * (e % 2)))) *
                               load_as_f32(kr[x], dt, e);
                    }
                    *sp = sum * scale;
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
            const vw qb = vload_word(QW + (size_t)r * dw + w);
            for (int x = 0; x < kv; x++)
                acc[r][x] = vdpbf_by(acc[r][x], k[x], qb);
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

#define FW_DEC_TABLE                                                                             \
    {.pack_kt = pack_kt, .qk = dec_qk, .softmax = dec_softmax, .pv = dec_pv,                       \
     .pack_kt_bf16 = pack_kt_bf16, .pack_kt_cols = pack_kt_cols,                                  \
     .pack_kt_cols_bf16 = pack_kt_cols_bf16, .cols_to_rows = cols_to_rows, .qk_bf16 = dec_qk_bf16, \
     .pv_bf16 = dec_pv_bf16, .qk_rows = dec_qk_rows, .qk_rows_bf16 = dec_qk_rows_bf16,            \
     .qk_tiles_bf16 = dec_qk_tiles_bf16, .pv_tiles_bf16 = dec_pv_tiles_bf16}
