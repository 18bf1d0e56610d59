/* conv/conv.h: what the causal conv1d driver (conv/conv1d.c) and its float64 reference
 * (ref/conv_ref.c) share: the validated problem, its check, and row addressing. */
#ifndef FW_CONV_H
#define FW_CONV_H

#include "../internal.h"

typedef struct {
    const fw_tensor *x, *w, *b, *res, *out;
    const fw_conv1d_state *init, *final; /* NULL when absent */
    const int32_t *cu;
    int64_t n, B, L, D, W, Si, So; /* Si, So: entries of the init and final caches (0: none) */
    int silu;
} conv_prob;

/* Validates every argument (see fw_conv1d_fwd); `ref` admits f64 out and final cache.
 * Nothing is written. */
fw_status fw_conv_check(conv_prob *p, const fw_tensor *x, const fw_tensor *weight,
                        const fw_tensor *bias, const int32_t *cu, int64_t n,
                        const fw_conv1d_state *init, const fw_conv1d_state *final,
                        const fw_tensor *residual, const fw_tensor *out,
                        const fw_conv1d_params *params, int ref);

/* Channels per output item of fw_conv1d_fwd for D channels, `chunks` token chunks of all
 * sequences and `threads` threads (a pure function; conv/conv1d.c says why). */
int64_t fw_conv_channel_block(int64_t D, int64_t chunks, int threads);

/* Whether fw_conv1d_fwd stores an output of out_bytes non-temporally (a pure function;
 * conv/conv1d.c says why and what was measured). */
int fw_conv_stream(int64_t out_bytes);

/* fw_conv1d_fwd without a residual for the GDN layer's windows: the stores always go through
 * the cache (the core reads the window at once), and SiLU is the f32 one for every output
 * dtype. The layer's reference rounds the window to qkv's dtype as the layer does; with the
 * f32 SiLU both round nearly the same values, so the records, computed from the rounded
 * window, agree to 1e-4 (test layer.replay). The half-precision SiLU would flip 1 bf16
 * ulp in a few percent of the window and move the records by up to 6e-3. */
fw_status fw_conv1d_fwd_cached(const fw_tensor *x, const fw_tensor *weight, const fw_tensor *bias,
                               const int32_t *cu_seqlens, int64_t n_seqs, const fw_conv1d_state *init,
                               const fw_conv1d_state *final, const fw_tensor *out,
                               const fw_conv1d_params *params);

/* Sequence i: batch row and first token along L, and its length. */
static inline void conv_seq(const conv_prob *p, int64_t i, int64_t *b, int64_t *t0, int64_t *len)
{
    if (p->cu) {
        *b = 0;
        *t0 = p->cu[i];
        *len = p->cu[i + 1] - p->cu[i];
    } else {
        *b = i;
        *t0 = 0;
        *len = p->L;
    }
}

/* Element offset of (row b, token t, channel c) of a [B, L, D] tensor. */
static inline int64_t conv_off(const fw_tensor *t, int64_t b, int64_t l, int64_t c)
{
    return b * t->stride[0] + l * t->stride[1] + c * t->stride[2];
}

/* The slot of sequence i in a state (negative: none), and the row of its logical entry e. */
static inline int64_t conv_slot(const fw_conv1d_state *s, int64_t i)
{
    return s->idx ? s->idx[i] : i;
}

static inline int64_t conv_row(const fw_conv1d_state *s, int64_t S, int64_t i, int64_t e)
{
    if (!s->offsets)
        return e;
    const int64_t r = ((int64_t)s->offsets[i] + e) % S;
    return r < 0 ? r + S : r;
}

#endif /* FW_CONV_H */
