/* internal.h: what the drivers and the per-ISA kernel tables share. Not installed. */
#ifndef FW_INTERNAL_H
#define FW_INTERNAL_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include "flywheel.h"

/* ------------------------------------------------------------------ limits --
 * What every entry point accepts (checked once per call; the messages print these). */
#define FW_MAX_HEAD_DIM 1024 /* head dims d, dv, dk: 1 .. FW_MAX_HEAD_DIM */
#define FW_MAX_HEADS 65536   /* query heads (attention), value heads (Gated DeltaNet) */
#define FW_MAX_THREADS 256   /* threads: 0 (all CPUs) .. this; also caps the pool (threads.c) */
#define FW_MAX_PAGE_SIZE 65536 /* KV-cache page size: any from 1 to this (vLLM's hybrid models: 1152) */

/* The input dtypes the drivers take (a mask of 1 << fw_dtype, for fw_check_tensor). */
#define FW_DT_IN ((1u << FW_F32) | (1u << FW_BF16) | (1u << FW_F16))

/* Record a formatted message for fw_last_error() and return `s`. */
fw_status fw_fail(fw_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void fw_clear_error(void);

/* ------------------------------------------------------------ kernel table --
 *
 * Layout used by the tiled attention kernel ("transposed tiles"): vectors run along the
 * query rows of a tile, so every softmax reduction is a vertical vector op and K/V rows are
 * used as they are (only converted to f32), never transposed.
 *   QT [d][M]   the q tile, scaled, one column per query row (M rows, a multiple of vl)
 *   K  [nk][d]  f32 key rows, row stride ldk
 *   ST [nk][M]  scores, then probabilities, in place
 *   V  [nk][dv] f32 value rows, row stride ldv
 *   OT [dv][M]  the output accumulator
 */

/* Inputs of one softmax step over a score tile (see fw_kernels.softmax). */
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

/* The decode path: keys per tile (= FW_ATTN_BK) and the most query rows (G x n) it takes. */
#define FW_DEC_KEYS 64
/* decode contexts longer than this many keys sweep each tile's rows before using them */
#define FW_DEC_SWEEP_KEYS 8192
/* AMX decode on key rows this many bytes apart or more prefetches the next head's rows */
#define FW_DEC_FETCH_ROW_BYTES 2048
#define FW_DEC_ROWS 16

/* The conv kernels' SiLU for outputs rounded to bf16 or f16 (fw_kernels.conv1d_row). */
#define FW_SILU_HALF 2

enum { FW_BF16_EMULATED = 0, FW_BF16_DOT = 1, FW_BF16_TILES = 2 };

typedef struct fw_kernels {
    const char *name;
    int vl; /* floats per vector; M must be a multiple of it */
    /* how bf16 pair products run (fw_isa_native_bf16): FW_BF16_EMULATED (two f32 FMAs a
     * pair, slower than f32 products), FW_BF16_DOT (vdpbf16ps, whose rate depends on the CPU)
     * or FW_BF16_TILES (AMX) */
    int native_bf16;
    /* keys per K/V tile of the tiled attention forward: 64 (FW_ATTN_BK), or more where the
     * products gain from a longer reduction (amx: 128, pv_bf16's sum over a tile's keys) */
    int bk;
    /* dst[i] = scale * src[i*stride] for i < n; src is f32, bf16 or f16. */
    void (*to_f32)(const void *src, fw_dtype dt, int64_t stride, int64_t n, float scale, float *dst);
    /* dst[i*stride] = src[i] rounded to dt (f32, bf16, f16) for i < n. */
    void (*from_f32)(const float *src, int64_t n, void *dst, fw_dtype dt, int64_t stride);
    /* ST[j][m] = bias[m] + sum_k K[j][k] * QT[k][m], j < nk, m < M. */
    void (*qk)(int nk, int d, int M, const float *K, int64_t ldk, const float *QT,
               const float *bias, float *ST);
    /* ST[j][m] = cap2 * tanh(ST[j][m]) for j < nk, m < M (softcap in log2 units). */
    void (*softcap)(int nk, int M, float *ST, float cap2);
    /* Static anchor: returns 1 when a row's sum reached FW_ANCHOR_BOUND; then a, l and OT are
     * untouched and ST is clobbered, and the caller replays the tile with online = 1.
     * Online: always returns 0. Masked entries (outside [lo, hi)) get probability 0. */
    int (*softmax)(const fw_softmax_args *s);
    /* OT[c][m] += sum_j V[j][c] * PT[j][m], c < dv, m < M. */
    void (*pv)(int nk, int dv, int M, const float *V, int64_t ldv, const float *PT, float *OT);
    /* bf16 products on operands in pair layout (two bf16 of adjacent reduction elements per
     * 32-bit word; panels described in attn_kern.h): the tables own this packing.
     * pack_pairs: dst[i] = (even[i], odd[i]) rounded to bf16, i < n (odd NULL: zeros).
     * qk_bf16: ST[j][m] = bias[m] + scale * (K row j . q row m) over dw words, K rows ldkw
     * words apart, QW [dw][M]. pv_bf16: OT[c][m] += sum_w VW[w][c] . PW[w][m], VW from
     * pack_vw (nw = ceil(n/2) word rows, dv = cols), PW [nw][M]. */
    void (*pack_pairs)(const float *even, const float *odd, int n, uint32_t *dst);
    /* dst[w] = (x[2w], x[2w+1]) rounded to bf16, w < ceil(n/2), zero past n. */
    void (*pack_row_pairs)(const float *x, int n, uint32_t *dst);
    /* pv_bf16's first operand from rows X [n][cols] of dtype dt (f32 or bf16, contiguous: a
     * tile's value rows, or whatever rows a product sums over), rounded to bf16 in this
     * table's layout: the pair layout VW [ceil(n/2)][cols] here; AMX its transpose, padded to
     * whole tiles (amx.c). Sized by panel_bytes(n, cols); cols <= FW_MAX_HEAD_DIM. */
    void (*pack_vw)(const void *X, fw_dtype dt, int n, int cols, uint32_t *VW);
    void (*qk_bf16)(int nk, int dw, int M, const uint32_t *K, int64_t ldkw, const uint32_t *QW,
                    float scale, const float *bias, float *ST);
    void (*pv_bf16)(int nw, int dv, int M, const uint32_t *VW, const uint32_t *PW, float *OT);
    /* Decode kernels (keys along the lanes; layouts in attn_kern.h). pack_kt converts nk <= 64
     * key rows (rows[j] points at key j, head applied; kdim = stride within a row) into
     * Kt[d][FW_DEC_KEYS], transposed, zero past nk (every column is written, so any table's
     * dec_qk reads it, whatever its vector length; dec_qk reads row k of Kt at Kt + k ldk, and
     * every key of the vectors holding the nk keys). dec_pv reads value rows in place
     * (contiguous rows of dtype dt).
     * Interleaved prefetch: Ktn (dec_qk) is the panel read next (the next K/V head's, or the
     * next tile's), laid out as Kt; next[j], j < nn (dec_pv, dec_qk_rows) its rows: each line
     * of them at the offset of a line the kernel reads is prefetched into L2 as that line is
     * read, so the next products' misses overlap these (dec_qk_rows_bf16 and dec_pv_bf16
     * alike; AMX's versions read with tile loads and take no hint: the driver prefetches for
     * them). NULL: none. */
    void (*pack_kt)(const void *const *rows, fw_dtype dt, int64_t kdim, int nk, int d, float *Kt);
    void (*dec_qk)(int R, int nk, int d, const float *Q, const float *Kt, int64_t ldk, const float *Ktn,
                   float *S);
    void (*dec_softmax)(int R, int nk, float *S, const float *lo, const float *hi, float *m,
                        float *l, float *O, int dv);
    void (*dec_pv)(int R, int nk, int dv, const float *P, const void *const *V, fw_dtype dt,
                   const void *const *next, int nn, float *O);
    /* The decode kernels with bf16 products (layouts in attn_kern.h): pack_kt_bf16 gives
     * KtW [ceil(d/2)][FW_DEC_KEYS] key words; dec_qk_bf16 S = scale * QW . KtW; dec_pv_bf16
     * rounds P to bf16 pairs in PW [R][FW_DEC_KEYS / 2] and adds P V to O. */
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
    /* Bytes of a bf16 operand panel in this table's layout, `red` reduction elements (a head
     * dim, or keys) by `cols` (the other operand's rows): ceil(red / 2) x cols words in the
     * pair layout. The workspace plans ask the table, so a table with padded tiles (AMX: 16
     * rows of 32 bf16) sizes its own panels. */
    size_t (*panel_bytes)(int red, int cols);
    void (*dec_qk_bf16)(int R, int nk, int dw, const uint32_t *QW, const uint32_t *KtW, float scale,
                        float *S);
    void (*dec_pv_bf16)(int R, int nk, int dv, const float *P, const void *const *V, fw_dtype dt,
                        const void *const *next, int nn, uint32_t *PW, float *O);
    /* Decode QK^T with f32 products straight from the key rows (contiguous rows of dtype dt:
     * kdim 1), no transposed panel: S[r][j] = Q[r] . K[j] (Q scaled) for r < R, j < nk, and 0
     * for j in [nk, FW_DEC_KEYS). */
    void (*dec_qk_rows)(int R, int nk, int d, const float *Q, const void *const *rows, fw_dtype dt,
                        const void *const *next, int nn, float *S);
    /* The same with bf16 products from bf16 key rows (contiguous), read as words:
     * S[r][j] = scale * QW[r] . K[j], QW as for dec_qk_bf16 (R x ceil(d/2) words). */
    void (*dec_qk_rows_bf16)(int R, int nk, int d, const uint32_t *QW, const void *const *rows,
                             float scale, const void *const *next, int nn, float *S);
    /* The decode's products straight from a FW_KV_TILES cache (flywheel.h), for tables whose
     * products take its order (AMX); NULL elsewhere, where the driver copies the rows out.
     * kg[i]: key group i of the tile (keys 16 i .. 16 i + 15: ceil(d / 32) blocks of 16 channel
     * pairs x 16 keys, 1 KiB each, contiguous); S as dec_qk_rows_bf16 gives it. vg[i]: value
     * group i (keys 32 i .. 32 i + 31: 16 key pairs x 16 channels, 1 KiB) of channels 0-15,
     * channels 16 x .. at vg[i] + x * vgs elements; P and O as dec_pv_bf16 takes them. Keys
     * past nk are never used, whatever the cache holds there. */
    void (*dec_qk_tiles_bf16)(int R, int nk, int d, const uint32_t *QW, const uint16_t *const *kg,
                              float scale, float *S);
    void (*dec_pv_tiles_bf16)(int R, int nk, int dv, const float *P, const uint16_t *const *vg,
                              int64_t vgs, uint32_t *PW, float *O);
    /* Plain baseline: one query row against n keys, one key at a time with online softmax:
     * convert the key and value rows on use (like ggml's vector path), dot, scalar exp2,
     * axpy. q is f32 in log2 units (scaled by scale*log2(e), or by 1/softcap with cap2 > 0).
     * K, V point at the first key's row, ldk/ldv are row strides and kdim/vdim the strides
     * within a row, in elements of dt. Continues from (acc[dv], *m, *l); scratch: d + dv. */
    void (*plain_row)(const float *q, int d, int dv, fw_dtype dt, const void *K, int64_t ldk,
                      int64_t kdim, const void *V, int64_t ldv, int64_t vdim, int64_t n,
                      float cap2, float *acc, float *m, float *l, float *scratch);
    /* FMA throughput of one thread in GFLOP/s over about `seconds`; peak_bf16: the same for
     * bf16 pair products (vdpbf16ps where the table has it, else its emulation). */
    double (*peak)(double seconds);
    double (*peak_bf16)(double seconds);
    /* Sum of n floats read with vector loads (several independent accumulators): the read
     * stream of the bandwidth microbenchmark. n is a multiple of 64. */
    float (*stream_sum)(const float *x, size_t n);
    /* Gated DeltaNet (kern/attn_kern.h): x = 2^x; X = (I + A)^-1 for a strictly lower
     * triangular L x L A (L <= 64), by forward substitution or in blocked matmul form; the
     * fused decode step on a block of at most FW_MAX_HEAD_DIM state columns (h f32, or bf16:
     * read into f32, the step in f32, each element rounded back once), and its two reads
     * of the state alone (gdn_dec_reads: a = (decay k)^T h, b = (decay q)^T h, h f32 or bf16); the 4-pass
     * recurrent step of the baseline (tmp: dv floats). The steps decay state row r by
     * decay[r] (dk floats: alike for GDN, per key channel for KDA). */
    void (*exp2_inplace)(float *x, int64_t n);
    void (*rows_l2scale)(float *x, int rows, int n, float scale, int l2, float eps);
    void (*gdn_gates)(int L, const float *gam, const float *beta, const float *KK, const float *QK,
                      float *A, float *G, int ldg);
    void (*tri_inv_fwd)(const float *A, int lda, int L, float *X, int ldx);
    void (*tri_inv_blocked)(const float *A, int lda, int L, float *X, int ldx);
    void (*gdn_dec_cols)(void *h, fw_dtype hdt, int64_t ldh, int dk, int c0, int c1, const float *q,
                         const float *k, const float *v, const float *decay, float beta, float kq,
                         float *o);
    void (*gdn_dec_reads)(const void *h, fw_dtype hdt, int64_t ldh, int dk, int c0, int c1, const float *q,
                          const float *k, const float *decay, float *a, float *b);
    void (*gdn_step4)(float *h, int64_t ldh, int dk, int dv, const float *q, const float *k,
                      const float *v, const float *decay, float beta, float *o, float *tmp);
    /* KDA's chunk (kern/attn_kern.h): dst = x o 2^(g1 - g0) (x NULL: ones, g0 NULL: zeros);
     * the pairs inside each diagonal FW_KDA_BLOCK-row block of A and of the gated QK, from
     * the step decays E [L][dk] = 2^g. */
    void (*exp2_scale)(int n, const float *x, const float *g1, const float *g0, float *dst);
    /* e = 2^(float)(g1 - g0), the difference in double (g0 NULL: 0); dx = x o e (x NULL: e),
     * and dy = y o e when dy is given: two operands decayed by one exponential. */
    void (*exp2d_scale2)(int n, const double *g1, const double *g0, const float *x, float *dx, const float *y,
                         float *dy);
    void (*kda_diag)(int L, int dk, const float *Q, const float *K, const float *E, const float *beta,
                     float *A, int lda, float *G, int ldg);
    /* KDA's gates of a row computed in the kernels (fw_gdn_params.a_log), in log2 units:
     * g2 = log2(e) x (-ea softplus(a + bias), or lb sigmoid(ea (a + bias)) with lb < 0). */
    void (*kda_gates)(int n, const float *a, const float *bias, float ea, float lb, float *g2);
    /* The conv's weights, packed [D][W] of dtype dt, as f32 [W][D] (the layout conv1d_row and
     * conv1d_rows read: tap k of channel c at wt[k * D + c]). */
    void (*conv_weights)(int W, int64_t D, const void *w, fw_dtype dt, float *wb);
    /* One output row of the causal conv1d over n contiguous channels:
     * y[c] = act(bias[c] + sum_{k<W} wt[k * ldw + c] taps[k][c]) (+ res[c] when res is given),
     * act SiLU (x / (1 + e^-x)) when silu (1, or FW_SILU_HALF: its exponential to 2^-13.7,
     * for outputs rounded to bf16 or f16 without a residual); taps of dtype tdt, res of rdt,
     * y stored as ydt. */
    void (*conv1d_row)(int W, const void *const *taps, fw_dtype tdt, const float *wt, int64_t ldw,
                       const float *bias, const void *res, fw_dtype rdt, int n, int silu, void *y,
                       fw_dtype ydt);
    /* R consecutive rows without a residual: ys[r] = conv1d_row over taps rows[r .. r + W - 1]
     * (R + W - 1 tap rows), the same bits. pass (width 4): 1 takes the rows one (two on the
     * 512-bit tables) at a time, prefetching a later tap row of the call as it goes; more
     * slides the taps in registers down passes of several rows (fw_conv_pass_rows). stream:
     * the outputs may be stored non-temporally (bypassing the cache; the kernel falls back to
     * plain stores for rows not aligned to its vectors, and orders what it streamed before
     * it returns). */
    void (*conv1d_rows)(int W, int R, int pass, const void *const *rows, fw_dtype tdt, const float *wt, int64_t ldw,
                        const float *bias, int n, int silu, void *const *ys, fw_dtype ydt, int stream);
    /* Attention backward's elementwise step (kern/attn_kern.h): P and dS of R query rows x
     * FW_DEC_KEYS keys from the raw scores S and dP = dO.v, per-row lse2 (log2 units), D and
     * visible keys [lo, hi). */
    void (*bwd_ds)(int R, float *S, float *dP, const float *lse2, const float *D, const float *lo,
                   const float *hi, float qs, float cap2);
    /* Rotary embedding of one head row x in place: h pairs (GPT-NeoX halves, or interleaved
     * GPT-J pairs) rotated by the f32 cos / sin rows c, s. */
    void (*rope)(float *x, int h, const float *c, const float *s, int interleaved);
} fw_kernels;

/* KDA chunks: rows per diagonal block (kda_diag's; the driver's products cover the rest). */
#define FW_KDA_BLOCK 16

/* Every function entry of a table, in order. A table may leave entries NULL: the registry
 * fills them from the portable table (BLIS's way), which is legal because no entry's
 * contract depends on the vector length of another (the portable entries take any M, and
 * packers write every column they hand on). The assertion keeps the list whole. */
#define FW_KERNEL_ENTRIES(X)                                                                     \
    X(to_f32) X(from_f32) X(qk) X(softcap) X(softmax) X(pv) X(pack_pairs) X(pack_row_pairs) X(pack_vw) \
    X(qk_bf16) X(pv_bf16) X(pack_kt) X(dec_qk) X(dec_softmax) X(dec_pv) X(pack_kt_bf16) X(pack_kt_cols) X(pack_kt_cols_bf16) X(cols_to_rows)          \
    X(panel_bytes) X(dec_qk_bf16) X(dec_pv_bf16) X(dec_qk_rows) X(dec_qk_rows_bf16) X(dec_qk_tiles_bf16) X(dec_pv_tiles_bf16) \
    X(plain_row) X(peak) X(peak_bf16) X(stream_sum)                                              \
    X(exp2_inplace) X(rows_l2scale) X(gdn_gates) X(tri_inv_fwd) X(tri_inv_blocked)               \
    X(gdn_dec_cols) X(gdn_dec_reads) X(gdn_step4) X(exp2_scale) X(exp2d_scale2) X(kda_diag) X(kda_gates) X(conv_weights) X(conv1d_row) X(conv1d_rows) X(bwd_ds) X(rope)
#define FW_KERNEL_ONE(f) +1
_Static_assert(sizeof(fw_kernels) == offsetof(fw_kernels, to_f32) +
                                         (0 FW_KERNEL_ENTRIES(FW_KERNEL_ONE)) * sizeof(void (*)(void)),
               "FW_KERNEL_ENTRIES must list every entry of fw_kernels");

/* t's NULL entries from base. */
void fw_kernels_fill(fw_kernels *t, const fw_kernels *base);

/* The table by name (NULL = default), its NULL entries filled from the portable table. Sets
 * an error and returns NULL if unknown/unsupported. */
const fw_kernels *fw_kernels_get(const char *name);

extern const fw_kernels fw_kernels_portable;
#if defined(__x86_64__) || defined(_M_X64)
extern const fw_kernels fw_kernels_avx2;
extern const fw_kernels fw_kernels_avx512;
extern const fw_kernels fw_kernels_avx512bf16;
extern const fw_kernels fw_kernels_amx;
#endif

/* ---------------------------------------------------------------- threads -- */

/* fn(ctx, item, tid) for every item in [0, n) on up to `threads` workers, tid 0 ..
 * min(threads, n) - 1, never two at once with one tid. Item i belongs to worker i % threads,
 * which takes its items in order; a worker without items left takes the others' (threads.c).
 * Callers make each item's result independent of the worker that runs it.
 * The workers run on the host's loop (fw_set_parallel), OpenMP (FW_OPENMP) or the built-in
 * pool (the caller is worker 0). Never fails: if threads cannot be started, the remaining
 * work runs on the threads that did. */
typedef void (*fw_item_fn)(void *ctx, int64_t item, int tid);
void fw_parallel(int threads, int64_t n, fw_item_fn fn, void *ctx);
/* Online CPUs, 1 .. FW_MAX_THREADS, as counted at the first call. */
int fw_cpu_count(void);
/* The CPU's vendor string from CPUID leaf 0 ("AuthenticAMD", "GenuineIntel", ...), asked once;
 * "" where there is none (not x86). */
const char *fw_cpu_vendor(void);
/* FW_PREC_AUTO's rule for vdpbf16ps (FW_BF16_DOT tables), by vendor, never by timing (results
 * must not depend on a measurement): 1 where it runs at twice the f32 FMA rate per element
 * pair, so that bf16 products beat f32 ones: AMD's Zen 4 and Zen 5 (measured on Zen 5: 536
 * GFLOP/s against 264 with FMAs, one core). 0 for Intel's Cooper Lake to Granite Rapids,
 * where it runs at half its FMA rate (measured on a Sapphire Rapids-class Xeon: 106 against
 * 200 GFLOP/s, and bf16-product prefill 1.5x slower than f32 products), and for any other or
 * unknown vendor. */
int fw_bf16_dot_native(const char *vendor);
/* The decode kernel's default for software prefetch of the next key tile and the address-order
 * sweep of long contexts (FW_ATTN_DEC_PREFETCH), by vendor: 0 for Intel, 1 otherwise. A
 * software prefetch holds one of an Intel core's 16 L1 fill buffers until its line arrives,
 * while the L2 streamer, trained by the kernel's own loads, keeps more in flight. Measured on
 * the Sapphire Rapids-class Xeon VM (bf16, GQA 32:8, d 128, 2 threads unless said, mean of
 * 1000-3000 calls): 1K keys hot 131-136 us with them, 96-105 without; 4K hot 671-700 against
 * 499-513; 16K hot 3.07-3.09 ms against 2.03-2.15; 32K from DRAM (8 rotating caches) 8.7 ms
 * against 8.3-8.7; 1K from L3 (64 rotating caches), one thread, 463-476 against 450-452. On
 * 2 MiB pages (madvise(MADV_HUGEPAGE), as `flywheel bench` allocates) long contexts go the
 * other way: 32K 6.96 ms with, 10.1 without; 4K 646 us against 671; 1K still 113 against 88.
 * The rule follows the 4 KiB pages a caller's tensors get by default. On Zen 5 both were
 * faster (attn/decode.c). */
int fw_dec_prefetch(const char *vendor);
/* Whether the decode prefetches the next K/V head's key rows of each tile before a head's
 * products: with AMX tiles (native_bf16, the table's fw_kernels field, FW_BF16_TILES), bf16
 * key rows read in place (bf16_rows), tokens row_bytes >= FW_DEC_FETCH_ROW_BYTES apart, and
 * FW_ATTN_NO_DEC_PREFETCH not in flags (attn/decode.c has the measurements). */
int fw_dec_fetch_krows(int native_bf16, int bf16_rows, int64_t row_bytes, uint32_t flags);
/* Rows of one pass of the width-4 conv's rows kernel (conv1d_rows), by vendor: 1 (a row at a
 * time, front to back) for AMD, 64 (the kernel's passes of 8 rows, its taps slid in registers)
 * otherwise. A pass walks its R + 3 tap rows and R output rows down each run of channels, all
 * D channels apart: on a Zen 3 VM (AVX2, L1 32 KiB 8-way) that many same-offset lines thrash
 * the cache and confuse its prefetchers. Measured there (Qwen3-Next's conv, 2K tokens x 8192
 * channels, W 4, SiLU, 2 threads, medians of 10, alternating runs): bf16 45.3-46.8 ms with
 * passes of 8 against 8.1-11.2 ms a row at a time (conv_rows4_as), f32 24.3-25.5 against
 * 8.6-8.8; passes of 2 f32 11.0-11.9. On the Sapphire Rapids-class Xeon VM passes of 8 rows were the best
 * measured (attn_kern.h, CONV_PASS_ROWS); Zen 5 ran this conv at 84-104% of a same-run copy a
 * row at a time, before the sliding kernel existed. On a Zen 4 VM (AVX-512, 2026-12-03) the
 * two ran level: 4.9-6.8 ms either way, 2 threads, three alternating runs; a row at a time
 * then gained a prefetch ahead, streamed stores and two rows a step (3.0-3.3 ms; attn_kern.h,
 * CONV_AHEAD_ROWS and conv_pair_vecs). Either gives the same bits. */
int fw_conv_pass_rows(const char *vendor);

/* The threads a call runs on: `requested` (params->threads, validated), or for 0 the default
 * of fw_set_parallel (all online CPUs unless set; OpenMP's in an FW_OPENMP build). */
int fw_threads(int32_t requested);

/* --------------------------------------------------------- small helpers -- */

static inline int64_t fw_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t fw_max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t fw_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Validate a tensor: non-NULL data unless it has no elements, rank, dtype in `dtypes` (a bit
 * mask of 1 << fw_dtype), non-negative shape and strides, the furthest element offset fits
 * int64. `what` names it in messages. */
fw_status fw_check_tensor(const fw_tensor *t, const char *what, int ndim, unsigned dtypes);
/* An output must not have two elements at one address. */
fw_status fw_check_no_alias(const fw_tensor *t, const char *what);
/* Cumulative sequence lengths `name` of n >= 0 sequences: non-NULL, cu[0] == 0,
 * non-decreasing over its n + 1 entries, and cu[n] == total, the rows of the packed tensors
 * (total < 0: not checked). FW_ERR_NULL for NULL, else FW_ERR_SEQLENS. */
fw_status fw_check_cu_seqlens(const int32_t *cu, int64_t n, int64_t total, const char *name);
/* The slots n sequences read and write in one call (slot of sequence i: idx[i], or i when idx
 * is NULL and `identity`, else none; negative: none): no two sequences write one slot, and,
 * with `cross`, no sequence reads a slot another writes. FW_ERR_INDEX naming both
 * sequences and "<what> slot". */
fw_status fw_check_slot_rw(int64_t n, const int32_t *read, int read_identity, const int32_t *write,
                           int write_identity, int cross, const char *what);
/* 1 if the byte ranges two tensors span intersect (an empty tensor spans none). */
int fw_overlap(const fw_tensor *a, const fw_tensor *b);
/* params->threads: 0 (all CPUs) .. FW_MAX_THREADS, else FW_ERR_ARG. */
fw_status fw_check_threads(int32_t threads);

/* The address of element offset `off` of t, and any-dtype loads and stores in double (the
 * float64 references read and write through these). */
static inline const char *fw_elem(const fw_tensor *t, int64_t off)
{
    return (const char *)t->data + off * (int64_t)fw_dtype_size(t->dtype);
}
/* The dtype conversions (fw_bf16_to_f32 and friends in flywheel.h are these, exported): inline
 * here because the portable table and the references convert one element at a time. f32 ->
 * bf16 and f16 round to nearest even; a NaN stays a quiet NaN of the same sign. */
static inline uint32_t fw_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float fw_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float fw_cvt_bf16_f32(uint16_t h) { return fw_u2f((uint32_t)h << 16); }

static inline uint16_t fw_cvt_f32_bf16(float f)
{
    uint32_t u = fw_f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float fw_cvt_f16_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f)
        return fw_u2f(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0)
            return fw_u2f(sign);
        /* subnormal: man * 2^-24 is exact in f32 */
        float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    return fw_u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t fw_cvt_f32_f16(float f)
{
    uint32_t u = fw_f2u(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below 2^-14: subnormal or zero, rounded to nearest even */
        float m = fw_u2f(a) * 0x1p24f; /* exact scaling into units of 2^-24 */
        uint32_t r = (uint32_t)m;
        float frac = m - (float)r;
        if (frac > 0.5f || (frac == 0.5f && (r & 1u)))
            r++;
        return (uint16_t)(sign | r);
    }
    uint32_t e = (a >> 23) - 112u, man = a & 0x7fffffu;
    uint32_t h = (e << 10) | (man >> 13);
    uint32_t rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

static inline double fw_load_f64(const fw_tensor *t, int64_t off)
{
    const char *b = t->data;
    switch (t->dtype) {
    case FW_F32: return ((const float *)b)[off];
    case FW_BF16: return fw_cvt_bf16_f32(((const uint16_t *)b)[off]);
    case FW_F16: return fw_cvt_f16_f32(((const uint16_t *)b)[off]);
    case FW_F64: return ((const double *)b)[off];
    }
    return 0.0;
}

static inline void fw_store_f64(const fw_tensor *t, int64_t off, double x)
{
    char *b = t->data;
    switch (t->dtype) {
    case FW_F32: ((float *)b)[off] = (float)x; break;
    case FW_BF16: ((uint16_t *)b)[off] = fw_cvt_f32_bf16((float)x); break;
    case FW_F16: ((uint16_t *)b)[off] = fw_cvt_f32_f16((float)x); break;
    case FW_F64: ((double *)b)[off] = x; break;
    }
}

#endif /* FW_INTERNAL_H */
