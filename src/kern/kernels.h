/*
 * kern/kernels.h: the kernel tables. One table per ISA (portable, avx2, avx512, avx512bf16,
 * amx), each a set of sub-tables, one per op, declared beside its op:
 *   cvt   dtype conversion of rows                    (here; kernels in kern/cvt_kern.h)
 *   mm    the tile products and their bf16 packing     (here; kern/mm_kern.h), shared by
 *         attention's forward and backward and GDN's chunks
 *   peak  the peak and bandwidth microbenchmarks      (here; kern/peak_kern.h)
 *   attn  softmax attention's tiled forward           (attn/attn_table.h; attn/attn_kern.h)
 *   dec   attention's decode                          (attn/attn_table.h; attn/dec_kern.h)
 *   bwd   attention's backward                        (attn/attn_table.h; attn/bwd_kern.h)
 *   rope  rotary embedding                            (attn/attn_table.h; attn/rope_kern.h)
 *   gdn   Gated DeltaNet and KDA                      (gdn/gdn_table.h; gdn/gdn_kern.h)
 *   conv  causal conv1d                               (conv/conv_table.h; conv/conv_kern.h)
 * Every kernel file is written once over the vector layer (kern/isa.h states its contract) and
 * compiled once per ISA (kern/table.h gathers them into FW_TABLE). A table may leave any entry
 * NULL: the registry (cpu.c) fills it from the table's base and then from the portable table
 * (BLIS's way), which is legal because no entry's contract depends on the vector length of
 * another (the portable entries take any M, and packers write every column they hand on).
 * docs/kernels.md says what a new ISA or a new op adds.
 */
#ifndef FW_KERN_KERNELS_H
#define FW_KERN_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include "flywheel.h"

/* How bf16 pair products run on a table (fw_kernels.native_bf16). */
enum {
    FW_BF16_EMULATED = 0, /* two f32 FMAs a pair, slower than f32 products */
    FW_BF16_DOT = 1,      /* vdpbf16ps or BFDOT, whose rate depends on the CPU (fw_bf16_dot_native) */
    FW_BF16_TILES = 2     /* AMX tiles */
};

/* cvt: rows of any input dtype to f32 and back. */
typedef struct fw_cvt_kernels {
    /* dst[i] = scale * src[i*stride] for i < n; src is f32, bf16 or f16. */
    void (*to_f32)(const void *src, fw_dtype dt, int64_t stride, int64_t n, float scale, float *dst);
    /* dst[i*stride] = src[i] rounded to dt (f32, bf16, f16) for i < n. */
    void (*from_f32)(const float *src, int64_t n, void *dst, fw_dtype dt, int64_t stride);
} fw_cvt_kernels;
#define FW_CVT_ENTRIES(X) X(cvt, to_f32) X(cvt, from_f32)

/*
 * mm: the products of a tile in the "transposed tiles" layout: vectors run along the query
 * rows of a tile, so every softmax reduction is a vertical vector op and K/V rows are used as
 * they are (only converted to f32), never transposed.
 *   QT [d][M]   the q tile, scaled, one column per query row (M rows, a multiple of vl)
 *   K  [nk][d]  f32 key rows, row stride ldk
 *   ST [nk][M]  scores, then probabilities, in place
 *   V  [nk][dv] f32 value rows, row stride ldv
 *   OT [dv][M]  the output accumulator
 * The bf16 forms take operands in pair layout (two bf16 of adjacent reduction elements per
 * 32-bit word; panels described in kern/mm_kern.h): the tables own this packing.
 */
typedef struct fw_mm_kernels {
    /* ST[j][m] = bias[m] + sum_k K[j][k] * QT[k][m], j < nk, m < M. */
    void (*qk)(int nk, int d, int M, const float *K, int64_t ldk, const float *QT,
               const float *bias, float *ST);
    /* OT[c][m] += sum_j V[j][c] * PT[j][m], c < dv, m < M. */
    void (*pv)(int nk, int dv, int M, const float *V, int64_t ldv, const float *PT, float *OT);
    /* dst[i] = (even[i], odd[i]) rounded to bf16, i < n (odd NULL: zeros). */
    void (*pack_pairs)(const float *even, const float *odd, int n, uint32_t *dst);
    /* dst[w] = (x[2w], x[2w+1]) rounded to bf16, w < ceil(n/2), zero past n. */
    void (*pack_row_pairs)(const float *x, int n, uint32_t *dst);
    /* pv_bf16's first operand from rows X [n][cols] of dtype dt (f32 or bf16, contiguous: a
     * tile's value rows, or whatever rows a product sums over), rounded to bf16 in this
     * table's layout: the pair layout VW [ceil(n/2)][cols] here; AMX its transpose, padded to
     * whole tiles (amx.c); neon_bf16 blocks of 4 rows by pairs of columns (mm_mmla.h). Sized
     * by panel_bytes(n, cols); cols <= FW_MAX_HEAD_DIM. */
    void (*pack_vw)(const void *X, fw_dtype dt, int n, int cols, uint32_t *VW);
    /* ST[j][m] = bias[m] + scale * (K row j . q row m) over dw words (dw <= FW_MAX_HEAD_DIM
     * / 2), K rows ldkw words apart, QW [dw][M]. */
    void (*qk_bf16)(int nk, int dw, int M, const uint32_t *K, int64_t ldkw, const uint32_t *QW,
                    float scale, const float *bias, float *ST);
    /* OT[c][m] += sum_w VW[w][c] . PW[w][m], VW from pack_vw (nw = ceil(n/2) word rows,
     * dv = cols), PW [nw][M]. */
    void (*pv_bf16)(int nw, int dv, int M, const uint32_t *VW, const uint32_t *PW, float *OT);
    /* Bytes of a bf16 operand panel in this table's layout, `red` reduction elements (a head
     * dim, or keys) by `cols` (the other operand's rows): ceil(red / 2) x cols words in the
     * pair layout. The workspace plans ask the table, so a table with padded tiles (AMX: 16
     * rows of 32 bf16; neon_bf16: blocks of 4 by pairs of columns) sizes its own panels. */
    size_t (*panel_bytes)(int red, int cols);
} fw_mm_kernels;
#define FW_MM_ENTRIES(X)                                                                         \
    X(mm, qk) X(mm, pv) X(mm, pack_pairs) X(mm, pack_row_pairs) X(mm, pack_vw) X(mm, qk_bf16)   \
    X(mm, pv_bf16) X(mm, panel_bytes)

/* peak: what `flywheel peak` and the benchmarks' % of peak measure. */
typedef struct fw_peak_kernels {
    /* FMA throughput of one thread in GFLOP/s over about `seconds`; bf16: the same for bf16
     * products (vdpbf16ps, BFMMLA, AMX tiles where the table has them, else its emulation). */
    double (*f32)(double seconds);
    double (*bf16)(double seconds);
    /* Sum of n floats read with vector loads (several independent accumulators): the read
     * stream of the bandwidth microbenchmark. n is a multiple of 64. */
    float (*stream_sum)(const float *x, size_t n);
} fw_peak_kernels;
#define FW_PEAK_ENTRIES(X) X(peak, f32) X(peak, bf16) X(peak, stream_sum)

#include "attn/attn_table.h"
#include "conv/conv_table.h"
#include "gdn/gdn_table.h"

typedef struct fw_kernels {
    const char *name;
    int vl; /* floats per vector; M must be a multiple of it */
    int native_bf16; /* how bf16 pair products run: FW_BF16_EMULATED, _DOT or _TILES */
    /* keys per K/V tile of the tiled attention forward: 64 (FW_ATTN_BK), or more where the
     * products gain from a longer reduction (amx: 128, pv_bf16's sum over a tile's keys) */
    int bk;
    fw_cvt_kernels cvt;
    fw_mm_kernels mm;
    fw_peak_kernels peak;
    fw_attn_kernels attn;
    fw_dec_kernels dec;
    fw_bwd_kernels bwd;
    fw_rope_kernels rope;
    fw_gdn_kernels gdn;
    fw_conv_kernels conv;
} fw_kernels;

/* Every function entry of every sub-table, X(sub-table, entry). The assertions keep the
 * lists whole: each sub-table holds its listed function pointers and nothing else. */
#define FW_KERNEL_ENTRIES(X)                                                                     \
    FW_CVT_ENTRIES(X) FW_MM_ENTRIES(X) FW_PEAK_ENTRIES(X) FW_ATTN_ENTRIES(X) FW_DEC_ENTRIES(X)    \
    FW_BWD_ENTRIES(X) FW_ROPE_ENTRIES(X) FW_GDN_ENTRIES(X) FW_CONV_ENTRIES(X)
#define FW_KERNEL_ONE(sub, f) +1
#define FW_KERNEL_SUB_WHOLE(type, list)                                                          \
    _Static_assert(sizeof(type) == (0 list(FW_KERNEL_ONE)) * sizeof(void (*)(void)),             \
                   #list " must list every entry of " #type)
FW_KERNEL_SUB_WHOLE(fw_cvt_kernels, FW_CVT_ENTRIES);
FW_KERNEL_SUB_WHOLE(fw_mm_kernels, FW_MM_ENTRIES);
FW_KERNEL_SUB_WHOLE(fw_peak_kernels, FW_PEAK_ENTRIES);
FW_KERNEL_SUB_WHOLE(fw_attn_kernels, FW_ATTN_ENTRIES);
FW_KERNEL_SUB_WHOLE(fw_dec_kernels, FW_DEC_ENTRIES);
FW_KERNEL_SUB_WHOLE(fw_bwd_kernels, FW_BWD_ENTRIES);
FW_KERNEL_SUB_WHOLE(fw_rope_kernels, FW_ROPE_ENTRIES);
FW_KERNEL_SUB_WHOLE(fw_gdn_kernels, FW_GDN_ENTRIES);
FW_KERNEL_SUB_WHOLE(fw_conv_kernels, FW_CONV_ENTRIES);

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
#if defined(__aarch64__)
extern const fw_kernels fw_kernels_neon;
extern const fw_kernels fw_kernels_neon_bf16;
#endif

#endif /* FW_KERN_KERNELS_H */
