/* conv/conv_table.h: the causal conv1d's kernel sub-table (kern/kernels.h has the whole
 * table); kernels in conv/conv_kern.h. */
#ifndef FW_CONV_TABLE_H
#define FW_CONV_TABLE_H

#include <stdint.h>
#include "flywheel.h"

/* The conv kernels' SiLU for outputs rounded to bf16 or f16 (fw_conv_kernels.row). */
#define FW_SILU_HALF 2

typedef struct fw_conv_kernels {
    /* The conv's weights, packed [D][W] of dtype dt, as f32 [W][D] (the layout row and rows
     * read: tap k of channel c at wt[k * D + c]). */
    void (*weights)(int W, int64_t D, const void *w, fw_dtype dt, float *wb);
    /* One output row of the causal conv1d over n contiguous channels:
     * y[c] = act(bias[c] + sum_{k<W} wt[k * ldw + c] taps[k][c]) (+ res[c] when res is given),
     * act SiLU (x / (1 + e^-x)) when silu (1, or FW_SILU_HALF: its exponential to 2^-13.7,
     * for outputs rounded to bf16 or f16 without a residual); taps of dtype tdt, res of rdt,
     * y stored as ydt. */
    void (*row)(int W, const void *const *taps, fw_dtype tdt, const float *wt, int64_t ldw,
                const float *bias, const void *res, fw_dtype rdt, int n, int silu, void *y,
                fw_dtype ydt);
    /* R consecutive rows without a residual: ys[r] = row over taps rows[r .. r + W - 1]
     * (R + W - 1 tap rows), the same bits. pass (width 4): 1 takes the rows one (two on the
     * 512-bit tables) at a time, prefetching a later tap row of the call as it goes; more
     * slides the taps in registers down passes of several rows (fw_conv_pass_rows). stream:
     * the outputs may be stored non-temporally (bypassing the cache; the kernel falls back to
     * plain stores for rows not aligned to its vectors, and orders what it streamed before
     * it returns). */
    void (*rows)(int W, int R, int pass, const void *const *rows, fw_dtype tdt, const float *wt,
                 int64_t ldw, const float *bias, int n, int silu, void *const *ys, fw_dtype ydt,
                 int stream);
} fw_conv_kernels;
#define FW_CONV_ENTRIES(X) X(conv, weights) X(conv, row) X(conv, rows)

#endif /* FW_CONV_TABLE_H */
