/*
 * attn/attn_table.h: softmax attention's kernel sub-tables (kern/kernels.h has the whole
 * table): attn (the tiled forward's softmax and the plain baseline), dec (decode), bwd (the
 * backward's elementwise step) and rope. Kernels: attn/attn_kern.h, dec_kern.h, bwd_kern.h,
 * rope_kern.h; the tile products they run on are the mm sub-table's.
 */
#ifndef FW_ATTN_TABLE_H
#define FW_ATTN_TABLE_H

#include <stdint.h>
#include "flywheel.h"

/* Inputs of one softmax step over a score tile (fw_attn_kernels.softmax; the tile layout is
 * mm's, kern/kernels.h). */
typedef struct fw_softmax_args {
    int nk, M;          /* keys in the tile, rows (multiple of vl) */
    float *ST;          /* [nk][M]: scores in (log2 units), probabilities out */
    float *a, *l;       /* [M] anchor / running max (-inf = not set yet) and running sum */
    const float *lo;    /* [M] first visible key of each row in tile coordinates, or NULL */
    const float *hi;    /* [M] one past the last visible key, or NULL (both NULL: all visible) */
    int folded;         /* qk already added -a for the rows whose anchor was set */
    int online;         /* 1: online softmax with lazy rescale of OT; 0: static anchor */
    float *OT;          /* [dv][M], rescaled by the online path */
    int dv;
    float *pending;     /* [2*M] scratch for the static-anchor path */
} fw_softmax_args;

/* The static anchor's bound: while a row's running sum stays below it, no probability in the
 * row can have overflowed (each is <= the sum), and OT <= sum * max|v| stays finite for any
 * |v| < 2^64. A sum at or past it (or inf/NaN) makes the tile replay with online softmax. */
#define FW_ANCHOR_BOUND 0x1p64f

typedef struct fw_attn_kernels {
    /* ST[j][m] = cap2 * tanh(ST[j][m]) for j < nk, m < M (softcap in log2 units). */
    void (*softcap)(int nk, int M, float *ST, float cap2);
    /* Static anchor: returns 1 when a row's sum reached FW_ANCHOR_BOUND; then a, l and OT are
     * untouched and ST is clobbered, and the caller replays the tile with online = 1.
     * Online: always returns 0. Masked entries (outside [lo, hi)) get probability 0. */
    int (*softmax)(const fw_softmax_args *s);
    /* Plain baseline: one query row against n keys, one key at a time with online softmax:
     * convert the key and value rows on use (like ggml's vector path), dot, scalar exp2,
     * axpy. q is f32 in log2 units (scaled by scale*log2(e), or by 1/softcap with cap2 > 0).
     * K, V point at the first key's row, ldk/ldv are row strides and kdim/vdim the strides
     * within a row, in elements of dt. Continues from (acc[dv], *m, *l); scratch: d + dv. */
    void (*plain_row)(const float *q, int d, int dv, fw_dtype dt, const void *K, int64_t ldk,
                      int64_t kdim, const void *V, int64_t ldv, int64_t vdim, int64_t n,
                      float cap2, float *acc, float *m, float *l, float *scratch);
} fw_attn_kernels;
#define FW_ATTN_ENTRIES(X) X(attn, softcap) X(attn, softmax) X(attn, plain_row)

/* The decode path: keys per tile (= FW_ATTN_BK) and the most query rows (G x n) it takes. */
#define FW_DEC_KEYS 64
#define FW_DEC_ROWS 16
/* decode contexts longer than this many keys sweep each tile's rows before using them */
#define FW_DEC_SWEEP_KEYS 8192
/* AMX decode on key rows this many bytes apart or more prefetches the next head's rows */
#define FW_DEC_FETCH_ROW_BYTES 2048

/*
 * dec: the decode kernels, keys along the lanes (layouts in attn/dec_kern.h).
 *   Kt  [d][FW_DEC_KEYS]          f32 key tile, transposed (pack_kt)
 *   KtW [ceil(d/2)][FW_DEC_KEYS]  bf16 key words (pack_kt_bf16)
 *   Q   [R][d] f32 query rows in log2 units (QW [R][ceil(d/2)] words for the bf16 forms)
 *   S   [R][FW_DEC_KEYS] scores, then probabilities;  O [R][dv] the accumulator
 * Interleaved prefetch: Ktn (qk) is the panel read next (the next K/V head's, or the next
 * tile's), laid out as Kt; next[j], j < nn (pv, qk_rows) its rows: each line of them at the
 * offset of a line the kernel reads is prefetched into L2 as that line is read, so the next
 * products' misses overlap these (qk_rows_bf16 and pv_bf16 alike; AMX's versions read with
 * tile loads and take no hint: the driver prefetches for them). NULL: none.
 */
typedef struct fw_dec_kernels {
    /* Kt from nk <= 64 key rows (rows[j] points at key j, head applied; kdim = stride within
     * a row), transposed, zero past nk (every column is written, so any table's qk reads it,
     * whatever its vector length; qk reads row k of Kt at Kt + k ldk, and every key of the
     * vectors holding the nk keys). */
    void (*pack_kt)(const void *const *rows, fw_dtype dt, int64_t kdim, int nk, int d, float *Kt);
    /* S = Q Kt over nk keys. */
    void (*qk)(int R, int nk, int d, const float *Q, const float *Kt, int64_t ldk, const float *Ktn,
               float *S);
    /* Online softmax of R rows over nk keys, keys outside [lo[r], hi[r]) masked; running max
     * m, sum l, O rescaled when the max grows. */
    void (*softmax)(int R, int nk, float *S, const float *lo, const float *hi, float *m, float *l,
                    float *O, int dv);
    /* O += P V, value rows read in place (contiguous rows of dtype dt). */
    void (*pv)(int R, int nk, int dv, const float *P, const void *const *V, fw_dtype dt,
               const void *const *next, int nn, float *O);
    /* KtW from key rows, as pack_kt. */
    void (*pack_kt_bf16)(const void *const *rows, fw_dtype dt, int64_t kdim, int nk, int d,
                         uint32_t *KtW);
    /* The same two panels (Kt, KtW) from keys stored transposed: key j of channel x at
     * element x * ld + j of src (vLLM's CPU cache keeps each block's keys so), dtype dt; zero
     * past nk. */
    void (*pack_kt_cols)(const void *src, fw_dtype dt, int64_t ld, int nk, int d, float *Kt);
    void (*pack_kt_cols_bf16)(const void *src, fw_dtype dt, int64_t ld, int nk, int d, uint32_t *KtW);
    /* Transposed keys back to f32 key rows: dst[j][x] (row stride d) = key j of channel x at
     * src[x * ld + j], j < nk, x < d (the prefill's K rows from such a cache). */
    void (*cols_to_rows)(const void *src, fw_dtype dt, int64_t ld, int nk, int d, float *dst);
    /* S = scale * QW . KtW. */
    void (*qk_bf16)(int R, int nk, int dw, const uint32_t *QW, const uint32_t *KtW, float scale,
                    float *S);
    /* Rounds P to bf16 pairs in PW [R][FW_DEC_KEYS / 2] and adds P V to O. */
    void (*pv_bf16)(int R, int nk, int dv, const float *P, const void *const *V, fw_dtype dt,
                    const void *const *next, int nn, uint32_t *PW, float *O);
    /* QK^T with f32 products straight from the key rows (contiguous rows of dtype dt: kdim 1),
     * no transposed panel: S[r][j] = Q[r] . K[j] (Q scaled) for r < R, j < nk, and 0 for j in
     * [nk, FW_DEC_KEYS). */
    void (*qk_rows)(int R, int nk, int d, const float *Q, const void *const *rows, fw_dtype dt,
                    const void *const *next, int nn, float *S);
    /* The same with bf16 products from key rows (contiguous) of dtype dt: FW_BF16, read as
     * words, or an fp8 cache's (FW_F8E4M3, FW_F8E5M2), read as their bf16 (exact):
     * S[r][j] = scale * QW[r] . K[j], QW as for qk_bf16 (R x ceil(d/2) words). */
    void (*qk_rows_bf16)(int R, int nk, int d, const uint32_t *QW, const void *const *rows, fw_dtype dt,
                         float scale, const void *const *next, int nn, float *S);
    /* The products straight from a FW_KV_TILES cache (flywheel.h), whose order is AMX's tiles
     * (the vector tables read it a vector of 16 lanes at a time, VL dividing 16).
     * kg[i]: key group i of the tile (keys 16 i .. 16 i + 15: ceil(d / 32) blocks of 16 channel
     * pairs x 16 keys, 1 KiB each, contiguous); S as qk_rows_bf16 gives it. vg[i]: value group
     * i (keys 32 i .. 32 i + 31: 16 key pairs x 16 channels, 1 KiB) of channels 0-15, channels
     * 16 x .. at vg[i] + x * vgs elements; P and O as pv_bf16 takes them. Keys past nk are
     * never used, whatever the cache holds there. */
    void (*qk_tiles_bf16)(int R, int nk, int d, const uint32_t *QW, const uint16_t *const *kg,
                          float scale, float *S);
    void (*pv_tiles_bf16)(int R, int nk, int dv, const float *P, const uint16_t *const *vg,
                          int64_t vgs, uint32_t *PW, float *O);
} fw_dec_kernels;
#define FW_DEC_ENTRIES(X)                                                                        \
    X(dec, pack_kt) X(dec, qk) X(dec, softmax) X(dec, pv) X(dec, pack_kt_bf16) X(dec, pack_kt_cols) \
    X(dec, pack_kt_cols_bf16) X(dec, cols_to_rows) X(dec, qk_bf16) X(dec, pv_bf16) X(dec, qk_rows) \
    X(dec, qk_rows_bf16) X(dec, qk_tiles_bf16) X(dec, pv_tiles_bf16)

typedef struct fw_bwd_kernels {
    /* The elementwise step: P and dS of R query rows x FW_DEC_KEYS keys from the raw scores S
     * and dP = dO.v, per-row lse2 (log2 units), D and visible keys [lo, hi). */
    void (*ds)(int R, float *S, float *dP, const float *lse2, const float *D, const float *lo,
               const float *hi, float qs, float cap2);
} fw_bwd_kernels;
#define FW_BWD_ENTRIES(X) X(bwd, ds)

typedef struct fw_rope_kernels {
    /* Rotary embedding of one head row x in place: h pairs (GPT-NeoX halves, or interleaved
     * GPT-J pairs) rotated by the f32 cos / sin rows c, s. */
    void (*rotate)(float *x, int h, const float *c, const float *s, int interleaved);
} fw_rope_kernels;
#define FW_ROPE_ENTRIES(X) X(rope, rotate)

#endif /* FW_ATTN_TABLE_H */
