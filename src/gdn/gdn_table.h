/* gdn/gdn_table.h: Gated DeltaNet's and KDA's kernel sub-table (kern/kernels.h has the whole
 * table); kernels in gdn/gdn_kern.h. The chunks' products run on the mm sub-table. */
#ifndef FW_GDN_TABLE_H
#define FW_GDN_TABLE_H

#include <stdint.h>
#include "flywheel.h"

/* KDA chunks: rows per diagonal block (kda_diag's; the driver's products cover the rest). */
#define FW_KDA_BLOCK 16

typedef struct fw_gdn_kernels {
    /* x = 2^x in place. */
    void (*exp2_inplace)(float *x, int64_t n);
    /* Each of `rows` rows of n: times scale, and L2-normalised first when l2 (eps inside). */
    void (*rows_l2scale)(float *x, int rows, int n, float scale, int l2, float eps);
    /* The chunk's gate matrices of L rows, gam the cumulative gates in log2 units:
     * A [L][64] = beta_i 2^(gam_i - gam_j) KK (strictly lower) and G [L][ldg] =
     * 2^(gam_i - gam_j) QK (lower with the diagonal). */
    void (*gates)(int L, const float *gam, const float *beta, const float *KK, const float *QK,
                  float *A, float *G, int ldg);
    /* X = (I + A)^-1 for a strictly lower triangular L x L A (L <= 64), by forward
     * substitution or in blocked matmul form. */
    void (*tri_inv_fwd)(const float *A, int lda, int L, float *X, int ldx);
    void (*tri_inv_blocked)(const float *A, int lda, int L, float *X, int ldx);
    /* The fused decode step on a block [c0, c1) of at most FW_MAX_HEAD_DIM state columns (h
     * f32, or bf16: read into f32, the step in f32, each element rounded back once); state
     * row r decays by decay[r] (dk floats: alike for GDN, per key channel for KDA). */
    void (*dec_cols)(void *h, fw_dtype hdt, int64_t ldh, int dk, int c0, int c1, const float *q,
                     const float *k, const float *v, const float *decay, float beta, float kq,
                     float *o);
    /* Its two reads of the state alone: a = (decay k)^T h, b = (decay q)^T h, h f32 or bf16. */
    void (*dec_reads)(const void *h, fw_dtype hdt, int64_t ldh, int dk, int c0, int c1,
                      const float *q, const float *k, const float *decay, float *a, float *b);
    /* The 4-pass recurrent step of the baseline (tmp: dv floats). */
    void (*step4)(float *h, int64_t ldh, int dk, int dv, const float *q, const float *k,
                  const float *v, const float *decay, float beta, float *o, float *tmp);
    /* KDA: dst = x o 2^(g1 - g0) (x NULL: ones, g0 NULL: zeros). */
    void (*exp2_scale)(int n, const float *x, const float *g1, const float *g0, float *dst);
    /* e = 2^(float)(g1 - g0), the difference in double (g0 NULL: 0); dx = x o e (x NULL: e),
     * and dy = y o e when dy is given: two operands decayed by one exponential. */
    void (*exp2d_scale2)(int n, const double *g1, const double *g0, const float *x, float *dx,
                         const float *y, float *dy);
    /* The pairs inside each diagonal FW_KDA_BLOCK-row block of A and of the gated QK, from
     * the step decays E [L][dk] = 2^g. */
    void (*kda_diag)(int L, int dk, const float *Q, const float *K, const float *E,
                     const float *beta, float *A, int lda, float *G, int ldg);
    /* KDA's gates of a row computed in the kernels (fw_gdn_params.a_log), in log2 units:
     * g2 = log2(e) x (-ea softplus(a + bias), or lb sigmoid(ea (a + bias)) with lb < 0). */
    void (*kda_gates)(int n, const float *a, const float *bias, float ea, float lb, float *g2);
} fw_gdn_kernels;
#define FW_GDN_ENTRIES(X)                                                                        \
    X(gdn, exp2_inplace) X(gdn, rows_l2scale) X(gdn, gates) X(gdn, tri_inv_fwd)                  \
    X(gdn, tri_inv_blocked) X(gdn, dec_cols) X(gdn, dec_reads) X(gdn, step4) X(gdn, exp2_scale)  \
    X(gdn, exp2d_scale2) X(gdn, kda_diag) X(gdn, kda_gates)

#endif /* FW_GDN_TABLE_H */
