/* attn/bwd.h: the validated attention backward problem, shared by the kernel driver
 * (attn/bwd.c) and the float64 reference (ref/attn_bwd_ref.c). */
#ifndef FW_ATTN_BWD_H
#define FW_ATTN_BWD_H

#include "attn.h"

/* The forward's problem (q, k, v, out, lse) plus the gradients. For each of dout, dq, dk, dv:
 * strides [batch, token, head, dim] (batch 0 for varlen). */
typedef struct {
    fw_attn_prob f;
    const fw_tensor *dout, *dq, *dk, *dv;
    int64_t dos[4], dqs[4], dks[4], dvs[4];
    const fw_tensor *dsinks;   /* [hq]: the sinks' gradient (params->dsinks), or NULL */
} fw_attn_bwd_prob;

/* Element offset of (row, head) of sequence `seq` in a gradient tensor with strides st; keys:
 * the row counts in k's rows (cu_seqlens_k), else in q's. */
static inline int64_t fw_bwd_off(const fw_attn_bwd_prob *b, const int64_t st[4], int64_t seq,
                                 int keys, int64_t row, int64_t head)
{
    const fw_attn_prob *p = &b->f;
    const int64_t base = p->varlen ? (int64_t)(keys ? p->cuk : p->cuq)[seq] * st[1] : seq * st[0];
    return base + row * st[1] + head * st[2];
}

/* Validates a backward call and fills *b; `ref` admits f64 gradients. Nothing is written. */
fw_status fw_attn_setup_bwd(fw_attn_bwd_prob *b, const fw_tensor *q, const fw_tensor *k,
                            const fw_tensor *v, const fw_tensor *out, const fw_tensor *dout,
                            const fw_tensor *lse, const int32_t *cuq, const int32_t *cuk,
                            int64_t batch, int varlen, const fw_tensor *dq, const fw_tensor *dk,
                            const fw_tensor *dv, const fw_attn_params *params, int ref);

/* ---- tiling (pure functions, unit-tested) ---- */

/* Keys a backward block holds: its dK / dV accumulators (d + dv) x FW_ATTN_BWD_KEYS floats
 * and the K / V panels stay resident while every q tile that sees them passes, and each q
 * tile is converted and packed once per block. Measured (bf16, GQA 32:8, d 128, T = 4K
 * causal, 2 threads, `flywheel bench attn --bwd`): 128 keys 59.6% of the bf16 peak, 256 keys
 * 64-66% (f32 products 78.5%), 512 keys 64-68% with twice the memory (0.9 MiB a thread at
 * 256 with bf16 panels). */
#define FW_ATTN_BWD_KEYS 256
/* Query rows of a backward q tile (G heads x positions, as in the forward's GQA packing). */
#define FW_ATTN_BWD_ROWS 64

/* Key splits of every (sequence, K/V head): enough work items for 16 threads, at most 4
 * (each split keeps an f32 copy of dq's partial sums) and at most one per
 * FW_ATTN_BWD_KEYS-key block of the longest sequence. A function of the shapes alone, never
 * of the thread count, so dq's order of sums, hence its bits, never depend on threads.
 * Examples: 1 sequence x 8 K/V heads, sk 4096 -> 2; 16 x 8 -> 1; 1 x 1, sk 100 -> 1. */
int fw_attn_bwd_splits(int64_t batch, int64_t hkv, int64_t sk_max);

/* A q tile: bq positions x gh heads of one GQA group (gh = min(G, FW_ATTN_BWD_ROWS), bq =
 * FW_ATTN_BWD_ROWS / gh). Example: G = 4 -> 16 x 4; G = 1 -> 64 x 1; G = 100 -> 1 x 64. */
void fw_attn_bwd_tile(int64_t G, int *bq, int *gh);

#endif /* FW_ATTN_BWD_H */
