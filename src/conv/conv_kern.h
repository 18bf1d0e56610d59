/* conv/conv_kern.h: the conv sub-table (conv/conv_table.h): the causal conv1d's rows over
 * the vector layer; included by kern/table.h. */

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

#define FW_CONV_TABLE {.weights = conv_weights, .row = conv1d_row, .rows = conv1d_rows}
