/*
 * amx.c: the amx kernel table: the bf16 products of the tiled attention (prefill, varlen,
 * the backward), of the GDN/KDA chunked prefill (which runs on qk_bf16 and pv_bf16) and of the
 * decode on bf16 key rows and on FW_KV_TILES caches, on AMX-BF16 tiles; every other entry is
 * avx512bf16's (cpu.c fills them from it). Compiled with only this ISA's flags (AVX-512 +
 * AMX-TILE + AMX-BF16).
 *
 * A tile holds 16 rows of 64 bytes: 16 x 32 bf16 (16 words of the pair layout) or 16 x 16
 * f32. tdpbf16ps C += A B takes A [16][16 words] row-major and B [16 words][16] with each
 * row's 16 lanes one word (the pair layout's panels, kern/mm_kern.h), and sums the 32 exact
 * bf16 products of an element in f32 with round-to-nearest-even, bf16 denormal inputs read
 * as zero (as vdpbf16ps does), except that a sum of zeros is +0 whatever their signs (measured
 * here: -0 + (-0) x (+0) and -0 + (-0) x (-0) give +0), where vdpbf16ps keeps -0 + -0 at
 * -0. So:
 *   qk_bf16: ST[j][m]  (C)  = K rows [j][w] (A, as the driver keeps them) x QW [w][m] (B)
 *   pv_bf16: OT[c][m]  (C) += VW^T [c][w] (A, transposed once per value tile by pack_vw)
 *                             x PW [w][m] (B)
 * Each C element's sum runs over the words in order, 16 at a time, whatever tile it sits in:
 * results do not depend on M, nk or the block a row falls in. Partial blocks (the ends of
 * nk, M, dv, the words) are copied into zeroed 1 KiB tiles, so every element takes the same
 * path. Register plan: C 0-3 (a 2 x 2 block of 32 x 32 outputs), A 4-5, B 6-7; per 16
 * words, 4 tile loads feed 4 tdpbf16ps of 16 cycles each.
 *
 * K/V tiles of 128 keys (bk): pv_bf16 loads and stores its accumulators (OT, dv x M f32)
 * once per call and sums over the tile's keys in between, so 64-key tiles spent more on
 * those tile moves than on the products (microbenchmark, M = 64, dv = 128: 1.46 us of pv
 * per 64 keys at 64-key tiles, 1.08 at 128).
 *
 * Tile state is a thread's: each call checks the configuration (another library may have
 * changed it since) and leaves it loaded for the next call; no call relies on what a tile
 * held before it. The kernel must have granted the process the tile data (arch_prctl,
 * cpu.c) before the table is used.
 */
#include <string.h>
#include <time.h>
#include "../internal.h"
#include "isa_avx512.h"

#define FW_INLINE static inline __attribute__((always_inline))
#define TW 16 /* words (or floats) per tile row, rows per tile */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every tile 16 rows of 64 bytes (palette 1). */
static const tile_config config = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {TW, TW, TW, TW, TW, TW, TW, TW}};

/* Loads the configuration unless the thread has it already: ldtilecfg costs ~50 ns here (a
 * qk_bf16 call is ~850 ns), reading it back 7 ns. */
static void tiles_as(const tile_config *want)
{
    _Alignas(64) tile_config now;
    _tile_storeconfig(&now);
    if (memcmp(&now, want, sizeof now) != 0)
        _tile_loadconfig(want);
}

static void tiles_on(void) { tiles_as(&config); }

/* The decode's on FW_KV_TILES: the accumulators (0, 1) and A tiles (4, 5) of R rows, the B
 * tiles (2, 3, 6, 7) of 16: every tile move carries the R query rows only, so the kernels
 * load and store their operands where they lie (no zero rows to pad, no copies). Loaded once
 * a call when the decode follows a call with another configuration (~50 ns). */
static void tiles_rows(int R)
{
    _Alignas(64) tile_config c = config;
    c.rows[0] = c.rows[1] = c.rows[4] = c.rows[5] = (uint8_t)R;
    tiles_as(&c);
}

static int round16(int n) { return (n + TW - 1) / TW * TW; }

/* The four accumulator tiles (0-3) set to zero. */
FW_INLINE void zero_acc(void)
{
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* The 16 x 16-word block at src (rows ld words apart) of which rows x cols are valid: src
 * itself when whole (*stride = its row stride in bytes), else those words copied into buf
 * with zeros around them. rows or cols <= 0 gives a zero tile; src is then not read. */
static const void *block(const uint32_t *src, int64_t ld, int rows, int cols, uint32_t *buf,
                         int64_t *stride)
{
    if (rows >= TW && cols >= TW) {
        *stride = ld * (int64_t)sizeof(uint32_t);
        return src;
    }
    memset(buf, 0, TW * TW * sizeof(uint32_t));
    for (int r = 0; r < rows && r < TW && cols > 0; r++)
        memcpy(buf + r * TW, src + r * ld, (size_t)(cols < TW ? cols : TW) * sizeof(uint32_t));
    *stride = TW * sizeof(uint32_t);
    return buf;
}

/* One step of 16 words of the 2 x 2 register plan: C tile 2a + b += A tile a x B tile b, the
 * A tiles (a0, a1) and B tiles (b0, b1) loaded from their blocks (row strides in bytes). */
FW_INLINE void step_2x2(const void *a0, int64_t s0, const void *a1, int64_t s1, const void *b0, int64_t s2,
                        const void *b1, int64_t s3)
{
    _tile_loadd(4, a0, s0);
    _tile_loadd(5, a1, s1);
    _tile_loadd(6, b0, s2);
    _tile_loadd(7, b1, s3);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

/* ST[j][m] = bias[m] + scale * sum_w dot(K[j] word w, QW[w][m]), j < nk, m < M. */
static void qk_bf16(int nk, int dw, int M, const uint32_t *K, int64_t ldkw, const uint32_t *QW,
                    float scale, const float *bias, float *ST)
{
    /* four separate copies, so a sanitizer sees a copy that overruns its tile */
    _Alignas(64) uint32_t ta0[TW * TW], ta1[TW * TW], tb0[TW * TW], tb1[TW * TW];
    _Alignas(64) float cb[TW * TW];
    const vf sc = vset1(scale);
    tiles_on();
    for (int m0 = 0; m0 < M; m0 += 2 * TW)
        for (int j0 = 0; j0 < nk; j0 += 2 * TW) {
            zero_acc();
            for (int w0 = 0; w0 < dw; w0 += TW) {
                int64_t s0, s1, s2, s3;
                const int j1 = j0 + TW, m1 = m0 + TW;
                const void *a0 = block(K + j0 * ldkw + w0, ldkw, nk - j0, dw - w0, ta0, &s0);
                const void *a1 = block(j1 < nk ? K + j1 * ldkw + w0 : K, ldkw, nk - j1, dw - w0, ta1, &s1);
                const void *b0 = block(QW + (int64_t)w0 * M + m0, M, dw - w0, M - m0, tb0, &s2);
                const void *b1 = block(m1 < M ? QW + (int64_t)w0 * M + m1 : QW, M, dw - w0, M - m1, tb1, &s3);
                step_2x2(a0, s0, a1, s1, b0, s2, b1, s3);
            }
            /* ST rows of each 16 x 16 block = bias + scale C, the valid part only */
            for (int t = 0; t < 4; t++) {
                const int jb = j0 + (t >> 1) * TW, mb = m0 + (t & 1) * TW;
                if (jb >= nk || mb >= M)
                    continue;
                switch (t) {
                case 0: _tile_stored(0, cb, TW * sizeof(float)); break;
                case 1: _tile_stored(1, cb, TW * sizeof(float)); break;
                case 2: _tile_stored(2, cb, TW * sizeof(float)); break;
                default: _tile_stored(3, cb, TW * sizeof(float)); break;
                }
                const int rows = nk - jb < TW ? nk - jb : TW, cols = M - mb < TW ? M - mb : TW;
                const __mmask16 k = (__mmask16)((1u << cols) - 1);
                const vf b = _mm512_maskz_loadu_ps(k, bias + mb);
                for (int r = 0; r < rows; r++)
                    _mm512_mask_storeu_ps(ST + (int64_t)(jb + r) * M + mb, k, vfma(vload(cb + r * TW), sc, b));
            }
        }
}

/* OT[c][m] += sum_w dot(VT[c][w], PW[w][m]), c < dv, m < M, over nw word rows; VT from
 * pack_vw (rows round16(nw) words apart, zero past nw). */
static void pv_bf16(int nw, int dv, int M, const uint32_t *VT, const uint32_t *PW, float *OT)
{
    /* four separate copies, so a sanitizer sees a copy that overruns its tile */
    _Alignas(64) uint32_t ta0[TW * TW], ta1[TW * TW], tb0[TW * TW], tb1[TW * TW];
    _Alignas(64) float cb[4][TW * TW];
    const int ld = round16(nw);
    tiles_on();
    for (int c0 = 0; c0 < dv; c0 += 2 * TW)
        for (int m0 = 0; m0 < M; m0 += 2 * TW) {
            const float *o[4];
            int64_t os[4];
            for (int t = 0; t < 4; t++) {
                const int cb0 = c0 + (t >> 1) * TW, mb = m0 + (t & 1) * TW;
                o[t] = cb0 < dv && mb < M ? OT + (int64_t)cb0 * M + mb : OT;
                o[t] = block((const uint32_t *)o[t], M, dv - cb0, M - mb, (uint32_t *)cb[t], &os[t]);
            }
            _tile_loadd(0, o[0], os[0]);
            _tile_loadd(1, o[1], os[1]);
            _tile_loadd(2, o[2], os[2]);
            _tile_loadd(3, o[3], os[3]);
            for (int w0 = 0; w0 < nw; w0 += TW) {
                int64_t s0, s1, s2, s3;
                const int c1 = c0 + TW, m1 = m0 + TW;
                const void *a0 = block(VT + (int64_t)c0 * ld + w0, ld, dv - c0, TW, ta0, &s0);
                const void *a1 = block(c1 < dv ? VT + (int64_t)c1 * ld + w0 : VT, ld, dv - c1, TW, ta1, &s1);
                const void *b0 = block(PW + (int64_t)w0 * M + m0, M, nw - w0, M - m0, tb0, &s2);
                const void *b1 = block(m1 < M ? PW + (int64_t)w0 * M + m1 : PW, M, nw - w0, M - m1, tb1, &s3);
                step_2x2(a0, s0, a1, s1, b0, s2, b1, s3);
            }
            /* whole blocks go straight back to OT; partial ones through their copy */
            float *dst[4];
            int64_t ds[4];
            for (int t = 0; t < 4; t++) {
                const int cb0 = c0 + (t >> 1) * TW, mb = m0 + (t & 1) * TW;
                const int whole = dv - cb0 >= TW && M - mb >= TW;
                dst[t] = whole ? OT + (int64_t)cb0 * M + mb : cb[t];
                ds[t] = whole ? (int64_t)M * (int64_t)sizeof(float) : TW * (int64_t)sizeof(float);
            }
            _tile_stored(0, dst[0], ds[0]);
            _tile_stored(1, dst[1], ds[1]);
            _tile_stored(2, dst[2], ds[2]);
            _tile_stored(3, dst[3], ds[3]);
            for (int t = 0; t < 4; t++) {
                const int cb0 = c0 + (t >> 1) * TW, mb = m0 + (t & 1) * TW;
                if (dst[t] != cb[t] || cb0 >= dv || mb >= M)
                    continue;
                const int rows = dv - cb0 < TW ? dv - cb0 : TW, cols = M - mb < TW ? M - mb : TW;
                for (int r = 0; r < rows; r++)
                    memcpy(OT + (int64_t)(cb0 + r) * M + mb, cb[t] + r * TW, (size_t)cols * sizeof(float));
            }
        }
}

/* The 16 x 16 transpose of 32-bit lanes: out[i] lane j = r[j] lane i. */
FW_INLINE void transpose16(const __m512i r[16], __m512i out[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + k], lane L: rows 4g .. 4g + 3 of column 4L + k */
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i v = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), w = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
        const __m512i x = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88),
                      y = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
        out[k] = _mm512_shuffle_i32x4(v, x, 0x88);
        out[8 + k] = _mm512_shuffle_i32x4(v, x, 0xdd);
        out[4 + k] = _mm512_shuffle_i32x4(w, y, 0x88);
        out[12 + k] = _mm512_shuffle_i32x4(w, y, 0xdd);
    }
}

/* Elements c0 .. c0 + 15 of row x (dtype f32 or f16) as f32, those outside k zero (and not
 * read). */
FW_INLINE vf masked_f32(const void *x, fw_dtype dt, int c0, __mmask16 k)
{
    if (dt == FW_F32)
        return _mm512_maskz_loadu_ps(k, (const float *)x + c0);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)x + c0));
}

/* Elements e0 .. e0 + 31 of a bf16 or fp8 row as 32 bf16 lanes, those outside k zero (and
 * not read); fp8 looked up as bf16 (vf8_bf16_lanes). */
FW_INLINE __m512i bf16_lanes(const void *row, fw_dtype dt, int e0, __mmask32 k)
{
    if (dt == FW_BF16)
        return _mm512_maskz_loadu_epi16(k, (const uint16_t *)row + e0);
    return vf8_bf16_lanes(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(k, (const uint8_t *)row + e0)), dt);
}

/* 16 words of the pair layout from value rows `even`, `odd` (NULL: zeros) of dtype dt,
 * columns c0 .. c0 + cn - 1 (cn <= 16, zero past): word c = (even[c], odd[c]) in bf16. */
FW_INLINE __m512i pair_words(const void *even, const void *odd, fw_dtype dt, int c0, int cn)
{
    const __mmask16 k = (__mmask16)((1u << cn) - 1);
    if (dt == FW_BF16) {
        const __m512i e = even ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)even + c0))
                               : _mm512_setzero_si512();
        const __m512i o = odd ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)odd + c0))
                              : _mm512_setzero_si512();
        return _mm512_or_si512(e, _mm512_slli_epi32(o, 16));
    }
    const vf e = even ? masked_f32(even, dt, c0, k) : vzero(), o = odd ? masked_f32(odd, dt, c0, k) : vzero();
    return _mm512_castps_si512(vbf16_pair(e, o));
}

/* VT[c][w] = (X[2w][c], X[2w+1][c]) rounded to bf16 for c < cols, w < round16(ceil(n/2)),
 * zero past n: the pair layout's VW transposed, 16 x 16 words at a time; X f32 or bf16. */
static void pack_vw(const void *X, fw_dtype dt, int n, int cols, uint32_t *VT)
{
    const int nw = (n + 1) / 2, ld = round16(nw);
    const size_t row = (size_t)cols * (dt == FW_F32 ? sizeof(float) : sizeof(uint16_t));
    for (int w0 = 0; w0 < ld; w0 += TW)
        for (int c0 = 0; c0 < cols; c0 += TW) {
            const int cn = cols - c0 < TW ? cols - c0 : TW;
            __m512i r[16], out[16];
            for (int i = 0; i < TW; i++) {
                const int e = 2 * (w0 + i), o = e + 1;
                r[i] = _mm512_setzero_si512();
                if (e < n) {
                    const char *xe = (const char *)X + (size_t)e * row;
                    r[i] = pair_words(xe, o < n ? xe + row : NULL, dt, c0, cn);
                }
            }
            transpose16(r, out);
            for (int c = 0; c < cn; c++)
                _mm512_storeu_si512(VT + (int64_t)(c0 + c) * ld + w0, out[c]);
        }
}

/* ------------------------------------------------------------------ decode --
 *
 * Decode (R <= FW_DEC_ROWS = 16 query rows of a K/V head against a tile of 64 keys) on tiles:
 *   dec_qk_rows_bf16: S^T [key][row] (C) = bf16 key rows (A, read in place when 16 rows lie
 *                     at one stride, else copied) x QW^T [w][row] (B, transposed per call)
 *   dec_pv_bf16:      P V [row][c]  (C) = P rounded to pairs [row][w] (A) x the value rows
 *                     paired two keys at a time [w][c] (B, interleaved per call)
 * Rows past R are zero and dropped; S^T is transposed into S's rows on the way out. */

/* S[r][j] = scale * QW[r] . K[j] over ceil(d/2) words for r < R, j < nk; 0 for j in
 * [nk, FW_DEC_KEYS). K rows are contiguous, bf16 or fp8 (an fp8 cache's: looked up as bf16
 * into the A tile's copy, bf16_lanes). */
static void dec_qk_rows_bf16(int R, int nk, int d, const uint32_t *QW, const void *const *rows, fw_dtype dt,
                             float scale, const void *const *next, int nn, float *S)
{
    (void)next; /* (tile loads take no prefetch hint: attn/decode.c prefetches for them) */
    (void)nn;
    _Alignas(64) uint32_t ta[TW * TW], tq[TW * TW];
    _Alignas(64) float st[4][TW * TW];
    const int dw = (d + 1) / 2;
    tiles_on();
    zero_acc();
    for (int w0 = 0; w0 < dw; w0 += TW) {
        const int cw = dw - w0 < TW ? dw - w0 : TW;
        const __mmask16 kw = (__mmask16)((1u << cw) - 1);
        __m512i r[16], t[16];
        for (int i = 0; i < TW; i++)
            r[i] = i < R ? _mm512_maskz_loadu_epi32(kw, QW + (int64_t)i * dw + w0) : _mm512_setzero_si512();
        transpose16(r, t);
        for (int i = 0; i < TW; i++)
            _mm512_store_si512(tq + i * TW, t[i]);
        _tile_loadd(6, tq, 64);
        /* the last word of an odd d holds one element and whatever follows the row */
        const int whole_words = w0 + TW <= d / 2;
        for (int kb = 0; kb < 4; kb++) {
            const int j0 = kb * TW, kn = nk - j0 < TW ? nk - j0 : TW;
            if (kn <= 0)
                break;
            const char *k0 = (const char *)rows[j0] + (size_t)w0 * 4;
            const int64_t ks = kn > 1 ? (const char *)rows[j0 + 1] - (const char *)rows[j0] : 0;
            int direct = kn == TW && whole_words && dt == FW_BF16;
            for (int i = 2; direct && i < TW; i++)
                direct = (const char *)rows[j0 + i] - (const char *)rows[j0] == i * ks;
            const void *a = k0;
            int64_t as = ks;
            if (!direct) {
                memset(ta + kn * TW, 0, (size_t)(TW - kn) * TW * sizeof(uint32_t));
                const int ne = 2 * cw - (w0 + cw > d / 2 && (d & 1)); /* elements of the block in a row */
                const __mmask32 ke = ne == 2 * TW ? 0xffffffffu : (__mmask32)((1u << ne) - 1);
                for (int i = 0; i < kn; i++)
                    _mm512_store_si512(ta + i * TW, bf16_lanes(rows[j0 + i], dt, 2 * w0, ke));
                a = ta;
                as = 64;
            }
            if (kb & 1)
                _tile_loadd(5, a, as);
            else
                _tile_loadd(4, a, as);
            switch (kb) {
            case 0: _tile_dpbf16ps(0, 4, 6); break;
            case 1: _tile_dpbf16ps(1, 5, 6); break;
            case 2: _tile_dpbf16ps(2, 4, 6); break;
            default: _tile_dpbf16ps(3, 5, 6); break;
            }
        }
    }
    _tile_stored(0, st[0], 64);
    _tile_stored(1, st[1], 64);
    _tile_stored(2, st[2], 64);
    _tile_stored(3, st[3], 64);
    const vf sc = vset1(scale);
    for (int kb = 0; kb < 4; kb++) {
        const int j0 = kb * TW;
        const __mmask16 valid = nk - j0 >= TW ? 0xffff : nk > j0 ? (__mmask16)((1u << (nk - j0)) - 1) : 0;
        __m512i c[16], t[16];
        for (int i = 0; i < TW; i++)
            c[i] = _mm512_load_si512(st[kb] + i * TW);
        transpose16(c, t);
        for (int i = 0; i < R; i++)
            vstore(S + (size_t)i * FW_DEC_KEYS + j0, _mm512_maskz_mul_ps(valid, _mm512_castsi512_ps(t[i]), sc));
    }
}

/* The decode's PV A tiles: P rows rounded to pairs into pa [rows][32 words] (zero past nk, and
 * rows R .. rows - 1 zero: the tiles load `rows` rows), and into PW (R x FW_DEC_KEYS / 2
 * words, as the contract has it). */
static void pack_p(int R, int nk, const float *P, uint32_t *PW, uint32_t *pa, int rows)
{
    memset(pa + R * 2 * TW, 0, (size_t)(rows - R) * 2 * TW * sizeof(uint32_t));
    for (int r = 0; r < R; r++)
        for (int w0 = 0; w0 < 2 * TW; w0 += TW) {
            const int k0 = 2 * w0, n0 = nk - k0, n1 = nk - k0 - TW;
            const __mmask16 m0 = n0 >= TW ? 0xffff : n0 > 0 ? (__mmask16)((1u << n0) - 1) : 0;
            const __mmask16 m1 = n1 >= TW ? 0xffff : n1 > 0 ? (__mmask16)((1u << n1) - 1) : 0;
            const float *pr = P + (size_t)r * FW_DEC_KEYS + k0;
            const vf x = vbf16_row(_mm512_maskz_loadu_ps(m0, pr), _mm512_maskz_loadu_ps(m1, pr + TW));
            _mm512_store_ps((float *)pa + r * 2 * TW + w0, x);
            _mm512_storeu_ps((float *)PW + (size_t)r * (FW_DEC_KEYS / 2) + w0, x);
        }
}

/* O[r][c] += sum_j P[r][j] V[j][c], P rounded to bf16 pairs (into PW, R x FW_DEC_KEYS / 2
 * words, as the contract has it) and V rows of dtype dt read in place, two keys a word. bf16
 * rows (and an fp8 cache's, looked up as bf16: bf16_lanes) are paired by unpacking 32
 * columns of two rows at once, which leaves the columns of
 * each 16-word half in the order of the unpack (4 of every 8); the sums are put back in
 * column order as they are added to O, once per call. Measured (4 rows, 64 keys, dv 128,
 * cache-hot): pairing 16 columns at a time by widening was 1.04 us a call, slower than
 * vdpbf16ps's 0.75. */
static void dec_pv_bf16(int R, int nk, int dv, const float *P, const void *const *V, fw_dtype dt,
                        const void *const *next, int nn, uint32_t *PW, float *O)
{
    (void)next; /* (tile loads take no prefetch hint: attn/decode.c prefetches for them) */
    (void)nn;
    _Alignas(64) uint32_t pa[TW * 2 * TW], lo[2 * TW * TW], hi[2 * TW * TW];
    _Alignas(64) float clo[TW * TW], chi[TW * TW];
    const int nw = (nk + 1) / 2;
    pack_p(R, nk, P, PW, pa, TW);
    tiles_on();
    _tile_loadd(4, pa, 2 * TW * 4);
    _tile_loadd(5, pa + TW, 2 * TW * 4);
    /* column c0 + idx[i] of O takes lane i of the (lo, hi) pair of sums */
    const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i idx1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int c0 = 0; c0 < dv; c0 += 2 * TW) {
        const int cn = dv - c0 < 2 * TW ? dv - c0 : 2 * TW;
        const __mmask32 kc = cn == 2 * TW ? 0xffffffffu : (__mmask32)((1u << cn) - 1);
        for (int w = 0; w < 2 * TW && w < ((nw + TW - 1) / TW) * TW; w++) {
            const int e = 2 * w, o = e + 1;
            __m512i ev = _mm512_setzero_si512(), od = _mm512_setzero_si512();
            if (dt == FW_BF16 || fw_is_f8(dt)) {
                if (e < nk)
                    ev = bf16_lanes(V[e], dt, c0, kc);
                if (o < nk)
                    od = bf16_lanes(V[o], dt, c0, kc);
                _mm512_store_si512(lo + w * TW, _mm512_unpacklo_epi16(ev, od));
                _mm512_store_si512(hi + w * TW, _mm512_unpackhi_epi16(ev, od));
            } else {
                /* f32 or f16 rows: rounded pairs of columns in the same order */
                const int n0 = cn < TW ? cn : TW, n1 = cn - TW;
                const __m512i a = e < nk ? pair_words(V[e], o < nk ? V[o] : NULL, dt, c0, n0) : ev;
                const __m512i b = e < nk && n1 > 0 ? pair_words(V[e], o < nk ? V[o] : NULL, dt, c0 + TW, n1) : ev;
                /* a holds columns 0-15 in order, b 16-31: regroup as the unpack would */
                const __m512i g0 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
                const __m512i g1 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
                _mm512_store_si512(lo + w * TW, _mm512_permutex2var_epi32(a, g0, b));
                _mm512_store_si512(hi + w * TW, _mm512_permutex2var_epi32(a, g1, b));
            }
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(6, lo, 64);
        _tile_loadd(7, hi, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (nw > TW) {
            _tile_loadd(6, lo + TW * TW, 64);
            _tile_loadd(7, hi + TW * TW, 64);
            _tile_dpbf16ps(0, 5, 6);
            _tile_dpbf16ps(1, 5, 7);
        }
        _tile_stored(0, clo, 64);
        _tile_stored(1, chi, 64);
        const __mmask16 k0 = (__mmask16)kc, k1 = (__mmask16)(kc >> 16);
        for (int r = 0; r < R; r++) {
            const vf a = vload(clo + r * TW), b = vload(chi + r * TW);
            float *or = O + (size_t)r * dv + c0;
            _mm512_mask_storeu_ps(or, k0, vadd(_mm512_maskz_loadu_ps(k0, or), _mm512_permutex2var_ps(a, idx0, b)));
            if (k1)
                _mm512_mask_storeu_ps(or + TW, k1,
                                      vadd(_mm512_maskz_loadu_ps(k1, or + TW), _mm512_permutex2var_ps(a, idx1, b)));
        }
    }
}

/*
 * Decode on a FW_KV_TILES cache (vLLM's AMX layout), on tiles of R rows (tiles_rows): the
 * cache's key and value groups are B tiles as they lie, 1 KiB each, so nothing is transposed
 * or paired per call:
 *   dec_qk_tiles_bf16: S [row][key] (C, one tile per 16 keys, stored into S's rows) = QW
 *                      [row][w] (A, loaded from QW's rows) x a key group's block [w][key] (B)
 *   dec_pv_tiles_bf16: O [row][c] (C, one tile per 16 channels, loaded from O's rows and
 *                      stored back) += P pairs [row][w] (A) x a value group's block
 *                      [key pair][c] (B)
 * PV adds its products into O inside the tile unit, two channel tiles at a time. Measured (a
 * C loop of hot calls, medians; GQA 32:8, d 128 unless said), against 16-row tiles that summed
 * each 64-key tile from zero into a buffer then added it to O: 256 keys on 1 thread 31.6 ->
 * 24.9-31.6 us, 1K on 2 threads 73-78 -> 62-65 us, GQA 16:2 d 256 at 4K on 2 threads 210-221
 * -> 199-203 us. (So the sums are not the row layout's bits, which add each tile's sum to O.)
 * Both products keep four B loads in flight (tile roles below), and load the B tiles with the
 * streaming hint (tileloaddt1), as vLLM's kernels do. Measured with `flywheel ab ... decode
 * --dtype bf16 --tiles [--caches N]` (2 threads, B / A of the medians, the same bits each
 * time; "cold": N rotating caches past the L3, as an engine reads a layer's cache): against two
 * B tiles and four accumulators (QK 64 keys at a time, PV alternating accumulator pairs), the
 * streaming hint alone gave 1K (GQA 32:8, d 128) hot 0.93-0.96, cold 0.95, and GQA 16:2, d
 * 256, 1152-token pages, 4K hot 0.98, cold 0.98-0.985; the four B tiles then 1K hot 0.98,
 * cold 1.00, 4K hot 0.93, cold 1.00-1.001 (without the hint the four B tiles were 3.7% later
 * cold at 4K). An earlier version of these kernels had measured the hint 1.5-2x slower.
 * Prefetching the next tile's blocks made the 1K call slower (77 -> 88-104 us). Keys past nk
 * are masked out of S, and a value group that runs past nk is copied with zeros in their
 * place (whatever the cache holds there: 0 x NaN would not be 0).
 */

/* The decode's products on FW_KV_TILES in the tile roles: accumulators 0, 1 and A tiles 4, 5
 * of R rows (tiles_rows), B tiles 2, 3, 6, 7 of 16, so that four B loads, each into a tile
 * no pending product reads, are in flight at once (streaming, above). */
static void dec_qk_tiles_bf16(int R, int nk, int d, const uint32_t *QW, const uint16_t *const *kg,
                              float scale, float *S)
{
    const int dw = d / 2, ng = (nk + TW - 1) / TW;
    const int64_t qs = (int64_t)dw * sizeof(uint32_t), ss = FW_DEC_KEYS * sizeof(float);
    tiles_rows(R);
    /* key groups g and g + 1 at a time; block w0 / 16 of a group is 16 words x 16 keys */
    for (int g = 0; g < ng; g += 2) {
        const uint16_t *k0 = kg[g], *k1 = g + 1 < ng ? kg[g + 1] : NULL;
        _tile_zero(0);
        _tile_zero(1);
        for (int w0 = 0; w0 < dw; w0 += 2 * TW) {
            _tile_loadd(4, QW + w0, qs);
            _tile_stream_loadd(2, k0 + (size_t)w0 * 2 * TW, 64);
            _tile_dpbf16ps(0, 4, 2);
            if (k1) {
                _tile_stream_loadd(3, k1 + (size_t)w0 * 2 * TW, 64);
                _tile_dpbf16ps(1, 4, 3);
            }
            if (w0 + TW < dw) {
                _tile_loadd(5, QW + w0 + TW, qs);
                _tile_stream_loadd(6, k0 + (size_t)(w0 + TW) * 2 * TW, 64);
                _tile_dpbf16ps(0, 5, 6);
                if (k1) {
                    _tile_stream_loadd(7, k1 + (size_t)(w0 + TW) * 2 * TW, 64);
                    _tile_dpbf16ps(1, 5, 7);
                }
            }
        }
        _tile_stored(0, S + g * TW, ss);
        if (k1)
            _tile_stored(1, S + (g + 1) * TW, ss);
    }
    const vf sc = vset1(scale);
    for (int g = 0; g < FW_DEC_KEYS / TW; g++) {
        const int n = nk - g * TW;
        const __mmask16 valid = n >= TW ? 0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0;
        for (int r = 0; r < R; r++) {
            float *sr = S + (size_t)r * FW_DEC_KEYS + g * TW;
            vstore(sr, _mm512_maskz_mul_ps(valid, _mm512_maskz_load_ps(valid, sr), sc));
        }
    }
}

/* A channel block of a value group at b that holds `keys` keys (< 32), copied into pt: its whole
 * key pairs, then the lone even key, zeros past (0 x NaN would not be 0). */
static const uint16_t *dec_v_part(const uint16_t *b, int keys, uint32_t *pt)
{
    memset(pt, 0, TW * TW * sizeof(uint32_t));
    memcpy(pt, b, (size_t)(keys / 2) * 64);
    for (int i = 0; i < TW && (keys & 1); i++)
        pt[(keys / 2) * TW + i] = ((const uint32_t *)b)[(keys / 2) * TW + i] & 0xffffu;
    return (const uint16_t *)pt;
}

static void dec_pv_tiles_bf16(int R, int nk, int dv, const float *P, const uint16_t *const *vg,
                              int64_t vgs, uint32_t *PW, float *O)
{
    _Alignas(64) uint32_t pa[TW * 2 * TW], part[2][TW * TW];
    pack_p(R, nk, P, PW, pa, R); /* (tiles of R rows: tiles_rows) */
    const int ng = (nk + 2 * TW - 1) / (2 * TW), tail = nk - (ng - 1) * 2 * TW; /* keys of the last group */
    const int64_t os = (int64_t)dv * sizeof(float);
    tiles_rows(R);
    _tile_loadd(4, pa, 2 * TW * 4);
    _tile_loadd(5, pa + TW, 2 * TW * 4);
    for (int x = 0; x < dv / TW; x += 2) { /* channel blocks x, x + 1 */
        const uint16_t *b[2][2];
        for (int g = 0; g < ng; g++)
            for (int t = 0; t < 2; t++)
                b[g][t] = g == ng - 1 && tail < 2 * TW ? dec_v_part(vg[g] + (x + t) * vgs, tail, part[t])
                                                       : vg[g] + (x + t) * vgs;
        _tile_loadd(0, O + x * TW, os);
        _tile_loadd(1, O + (x + 1) * TW, os);
        _tile_stream_loadd(2, b[0][0], 64);
        _tile_dpbf16ps(0, 4, 2);
        _tile_stream_loadd(3, b[0][1], 64);
        _tile_dpbf16ps(1, 4, 3);
        if (ng > 1) {
            _tile_stream_loadd(6, b[1][0], 64);
            _tile_dpbf16ps(0, 5, 6);
            _tile_stream_loadd(7, b[1][1], 64);
            _tile_dpbf16ps(1, 5, 7);
        }
        _tile_stored(0, O + x * TW, os);
        _tile_stored(1, O + (x + 1) * TW, os);
    }
}

/* round16(ceil(red / 2)) x cols words: pack_vw pads its word rows to whole tiles; the
 * other panels keep the pair layout's size (partial tiles are copied). */
static size_t panel_bytes(int red, int cols)
{
    return (size_t)round16((red + 1) / 2) * (size_t)cols * sizeof(uint32_t);
}

/* tdpbf16ps throughput of one thread in GFLOP/s over about `seconds`: four independent
 * accumulator tiles (each product 16 x 16 x 32 bf16 multiply-adds, 2 flops each). */
static double peak_bf16(double seconds)
{
    _Alignas(64) uint32_t ones[TW * TW];
    for (int i = 0; i < TW * TW; i++)
        ones[i] = 0x3f803f80u; /* the bf16 pair (1, 1) */
    tiles_on();
    zero_acc();
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double t;
    int64_t iters = 0;
    do {
        for (int r = 0; r < 1024; r++) {
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 5);
            _tile_dpbf16ps(2, 4, 5);
            _tile_dpbf16ps(3, 4, 5);
        }
        iters += 1024;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        t = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    } while (t < seconds);
    _Alignas(64) float c[TW * TW];
    _tile_stored(0, c, 64);
    volatile float sink = c[0];
    (void)sink;
    return (double)iters * 4 * (TW * TW * 2 * TW) * 2.0 / t * 1e-9;
}

const fw_kernels fw_kernels_amx = {
    .name = "amx",
    .vl = VL,
    .bk = 128,
    .native_bf16 = FW_BF16_TILES,
    .mm = {.pack_vw = pack_vw, .qk_bf16 = qk_bf16, .pv_bf16 = pv_bf16, .panel_bytes = panel_bytes},
    .dec = {.qk_rows_bf16 = dec_qk_rows_bf16, .pv_bf16 = dec_pv_bf16,
            .qk_tiles_bf16 = dec_qk_tiles_bf16, .pv_tiles_bf16 = dec_pv_tiles_bf16},
    .peak = {.bf16 = peak_bf16},
};
