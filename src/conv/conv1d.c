/* conv/conv1d.c: causal depthwise conv1d over a batch of sequences (fw_conv1d_fwd): the
 * check, then two parallel passes: the outputs, by items of (sequence, 64 tokens, a block of
 * channels), and after them the final states, by (sequence, 512 channels), so that a cache
 * updated in place is read by the first pass before the second writes it. Sequences of at most
 * 64 tokens (decodes) write their final states in their output items (fused_final). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "conv.h"

#define CONV_TOKENS 64 /* tokens per output item */
/* Items of at least this many rows take the rows kernel (conv1d_rows); shorter ones, decodes
 * above all, the row kernel, whose 4 vectors at a time hide more latency than the rows
 * kernel's 2 (one-token decodes of 64 sequences: 311-324 us a step, against 327-336 us) */
#define CONV_SLIDE_ROWS 4
#define CONV_STATE_CHANNELS 512

/* Channels per output item: all of them, so that an item reads whole rows front to back, one
 * stream the hardware prefetchers follow. Measured (Qwen3-Next's conv, 2K tokens x 8192
 * channels, bf16, 2 threads, medians of 10): items of 256 channels 6.7 ms (an item read 512
 * bytes of each 16 KiB row, and every segment started with a miss); 1024 channels, whose
 * weights stay in L1, 4.72-4.80 ms; all 8192 channels 4.16-4.26 ms. Halved, in multiples
 * of 64 channels, down to 256, while that leaves fewer than 4 items a thread (decode). */
int64_t fw_conv_channel_block(int64_t D, int64_t chunks, int threads)
{
    int64_t cb = D;
    while (cb > 256 && chunks * fw_ceil_div(D, cb) < 4 * (int64_t)threads)
        cb = fw_max64(256, (fw_ceil_div(cb, 2) + 63) / 64 * 64);
    return cb;
}

void fw_conv1d_params_init(fw_conv1d_params *p)
{
    if (p)
        memset(p, 0, sizeof *p);
}

static int same_view(const fw_tensor *a, const fw_tensor *b)
{
    if (a->data != b->data || a->dtype != b->dtype || a->ndim != b->ndim)
        return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i] || a->stride[i] != b->stride[i])
            return 0;
    return 1;
}

/* A state's cache and indices: [slots, S, D], S >= min_s, indices < slots (negative: none),
 * n <= slots without indices. */
static fw_status check_state(const fw_conv1d_state *st, const char *what, int64_t n, int64_t D,
                             int64_t min_s, unsigned dtypes, int64_t *S)
{
    char name[48];
    snprintf(name, sizeof name, "%s cache", what);
    fw_status s = fw_check_tensor(&st->cache, name, 3, dtypes);
    if (s)
        return s;
    const int64_t slots = st->cache.shape[0];
    *S = st->cache.shape[1];
    if (st->cache.shape[2] != D)
        return fw_fail(FW_ERR_SHAPE, "%s cache is [%lld, %lld, %lld]; its last dimension must be D = %lld",
                       what, (long long)slots, (long long)*S, (long long)st->cache.shape[2], (long long)D);
    if (*S < min_s)
        return fw_fail(FW_ERR_SHAPE, "%s cache holds %lld entries per slot; the conv needs the last W-1 = %lld",
                       what, (long long)*S, (long long)min_s);
    if (!st->idx && n > slots)
        return fw_fail(FW_ERR_INDEX, "%s cache has %lld slots for %lld sequences (no indices: slot i)",
                       what, (long long)slots, (long long)n);
    if (st->idx)
        for (int64_t i = 0; i < n; i++)
            if (st->idx[i] >= slots)
                return fw_fail(FW_ERR_INDEX, "%s index %lld is %d, past the cache's %lld slots", what,
                               (long long)i, (int)st->idx[i], (long long)slots);
    return FW_OK;
}

fw_status fw_conv_check(conv_prob *p, const fw_tensor *x, const fw_tensor *weight,
                        const fw_tensor *bias, const int32_t *cu, int64_t n,
                        const fw_conv1d_state *init, const fw_conv1d_state *final,
                        const fw_tensor *residual, const fw_tensor *out,
                        const fw_conv1d_params *params, int ref)
{
    memset(p, 0, sizeof *p);
    const unsigned f64 = ref ? 1u << FW_F64 : 0u;
    fw_status s;
    if ((s = fw_check_tensor(x, "x", 3, FW_DT_IN)) || (s = fw_check_tensor(weight, "weight", 2, FW_DT_IN)) ||
        (s = fw_check_tensor(out, "out", 3, FW_DT_IN | f64)) ||
        (bias && (s = fw_check_tensor(bias, "bias", 1, FW_DT_IN))) ||
        (residual && (s = fw_check_tensor(residual, "residual", 3, FW_DT_IN))))
        return s;
    const int64_t B = x->shape[0], L = x->shape[1], D = x->shape[2], W = weight->shape[1];
    for (int i = 0; i < 3; i++)
        if (out->shape[i] != x->shape[i] || (residual && residual->shape[i] != x->shape[i]))
            return fw_fail(FW_ERR_SHAPE, "out%s must be [B, L, D] = [%lld, %lld, %lld] like x",
                           residual ? " and residual" : "", (long long)B, (long long)L, (long long)D);
    if (weight->shape[0] != D || W < 1 || W > FW_MAX_CONV_WIDTH)
        return fw_fail(FW_ERR_SHAPE, "weight is [%lld, %lld]; it must be [D, W] with D = %lld and W 1..%d",
                       (long long)weight->shape[0], (long long)W, (long long)D, FW_MAX_CONV_WIDTH);
    if (bias && bias->shape[0] != D)
        return fw_fail(FW_ERR_SHAPE, "bias has %lld entries; it must have D = %lld", (long long)bias->shape[0],
                       (long long)D);
    if ((s = fw_check_no_alias(out, "out")))
        return s;
    if (params) {
        if (params->activation != FW_ACT_NONE && params->activation != FW_ACT_SILU)
            return fw_fail(FW_ERR_ARG, "activation is %d; it must be FW_ACT_NONE (0) or FW_ACT_SILU (1)",
                           (int)params->activation);
        if ((s = fw_check_threads(params->threads)))
            return s;
    }
    if (cu) {
        if (B != 1)
            return fw_fail(FW_ERR_SHAPE, "with cu_seqlens, x must be one packed row [1, T, D]; it has %lld rows",
                           (long long)B);
        if (n < 0 || n > INT32_MAX)
            return fw_fail(FW_ERR_ARG, "n_seqs is %lld; it must be 0..2^31-1", (long long)n);
        if ((s = fw_check_cu_seqlens(cu, n, L, "cu_seqlens")))
            return s;
    } else {
        n = B;
    }
    p->x = x; p->w = weight; p->b = bias; p->res = residual; p->out = out;
    p->cu = cu; p->n = n; p->B = B; p->L = L; p->D = D; p->W = W;
    p->silu = params && params->activation == FW_ACT_SILU;
    if (init && (s = check_state(init, "init", n, D, W - 1, FW_DT_IN, &p->Si)))
        return s;
    if (final) {
        if ((s = check_state(final, "final", n, D, 0, FW_DT_IN | f64, &p->So)) ||
            (s = fw_check_no_alias(&final->cache, "final cache")))
            return s;
        if (final->offsets && p->So == 0)
            return fw_fail(FW_ERR_SHAPE, "final cache has offsets but no entries per slot");
    }
    if (init && init->offsets && p->Si == 0)
        return fw_fail(FW_ERR_SHAPE, "init cache has offsets but no entries per slot");
    p->init = init;
    p->final = final;
    const int inplace = init && final && fw_overlap(&init->cache, &final->cache);
    if (inplace && !same_view(&init->cache, &final->cache))
        return fw_fail(FW_ERR_STRIDE, "the init and final caches overlap but are not the same view: "
                       "pass one cache for both to update it in place");
    const fw_tensor *in[6] = {x, weight, bias, residual, init ? &init->cache : NULL, final ? &final->cache : NULL};
    static const char *names[6] = {"x", "weight", "bias", "residual", "the init cache", "the final cache"};
    for (int i = 0; i < 6; i++)
        if (in[i] && fw_overlap(out, in[i]))
            return fw_fail(FW_ERR_STRIDE, "out overlaps %s; it must be a separate buffer", names[i]);
    if (final && residual && fw_overlap(&final->cache, residual))
        return fw_fail(FW_ERR_STRIDE, "the final cache overlaps residual");
    if (final && fw_overlap(&final->cache, x))
        return fw_fail(FW_ERR_STRIDE, "the final cache overlaps x");
    /* no two sequences write one slot; in place, no sequence reads a slot another writes */
    return final ? fw_check_slot_rw(n, init ? init->idx : NULL, 1, final->idx, 1, inplace, "conv state") : FW_OK;
}

/* ------------------------------------------------------------------ passes -- */

typedef struct {
    const conv_prob *p;
    const fw_kernels *kt;
    const int64_t *first; /* first item of each sequence (n + 1 entries) */
    int64_t nblk, cb;     /* channel blocks, and channels per block */
    const float *wt, *bias; /* weight as [W][D] and bias as [D], f32 */
    const void *zero;       /* D f32 zeros: the taps before a sequence without a state entry, and the bias without one */
    float *ws;
    size_t ws_stride;
    int stream; /* outputs stored non-temporally (fw_conv_stream) */
    int silu;   /* the kernels' activation: 0, 1 (SiLU) or FW_SILU_HALF (conv_silu_mode) */
    int pass;   /* the rows kernel's pass (fw_conv_pass_rows) */
} conv_ctx;

/* Channel c0 of a state's logical entry e of sequence i, or NULL for none (no state, no slot,
 * or an entry before the slot's first). */
static const char *state_at(const fw_conv1d_state *st, int64_t S, int64_t i, int64_t e, int64_t c0)
{
    const int64_t slot = st ? conv_slot(st, i) : -1;
    if (slot < 0 || e < 0)
        return NULL;
    const fw_tensor *t = &st->cache;
    return fw_elem(t, slot * t->stride[0] + conv_row(st, S, i, e) * t->stride[1] + c0 * t->stride[2]);
}

/* f32 copy of channels [c0, c0 + nc) of a state's logical entry e of sequence i (zeros for
 * none, as state_at). */
static void state_row(const conv_ctx *c, const fw_conv1d_state *st, int64_t S, int64_t i, int64_t e,
                      int64_t c0, int nc, float *dst)
{
    const char *src = state_at(st, S, i, e, c0);
    if (!src)
        memset(dst, 0, sizeof(float) * (size_t)nc);
    else
        c->kt->cvt.to_f32(src, st->cache.dtype, st->cache.stride[2], nc, 1.0f, dst);
}

static char *row_at(const fw_tensor *t, int64_t b, int64_t l, int64_t c)
{
    return (char *)t->data + conv_off(t, b, l, c) * (int64_t)fw_dtype_size(t->dtype);
}

/* Final state of sequence i, channels [c0, c0 + nc), in blocks of CONV_STATE_CHANNELS: the
 * last So entries of (its initial state, its tokens), each block read into the scratch before
 * any of it is written (in place, a slot's rows move). When x, the caches and the scratch
 * share a dtype and channels are contiguous, the rows are copied as they are (the bits a
 * conversion to f32 and back gives, signalling NaNs aside, which it would quiet). */
static void final_rows(const conv_ctx *c, int64_t i, int64_t c0, int64_t nc, int tid)
{
    const conv_prob *p = c->p;
    const int64_t slot = conv_slot(p->final, i);
    if (slot < 0)
        return;
    int64_t b, t0, len;
    conv_seq(p, i, &b, &t0, &len);
    float *buf = c->ws + (size_t)tid * c->ws_stride;
    const fw_tensor *t = &p->final->cache, *ic = p->init ? &p->init->cache : NULL;
    const int64_t es = (int64_t)fw_dtype_size(t->dtype);
    const int raw = t->dtype == p->x->dtype && t->stride[2] == 1 && p->x->stride[2] == 1 &&
                    (!ic || (ic->dtype == t->dtype && ic->stride[2] == 1));
    for (int64_t c1 = c0; c1 < c0 + nc; c1 += CONV_STATE_CHANNELS) {
        const int n1 = (int)fw_min64(CONV_STATE_CHANNELS, c0 + nc - c1);
        for (int64_t e = 0; e < p->So; e++) {
            const int64_t u = len - p->So + e; /* token of the sequence; negative: before it */
            float *row = buf + (size_t)e * CONV_STATE_CHANNELS;
            if (!raw && u >= 0)
                c->kt->cvt.to_f32(row_at(p->x, b, t0 + u, c1), p->x->dtype, p->x->stride[2], n1, 1.0f, row);
            else if (!raw)
                state_row(c, p->init, p->Si, i, p->Si + u, c1, n1, row);
            else {
                const char *src = u >= 0 ? row_at(p->x, b, t0 + u, c1) : state_at(p->init, p->Si, i, p->Si + u, c1);
                if (src)
                    memcpy(row, src, (size_t)(n1 * es));
                else
                    memset(row, 0, (size_t)(n1 * es));
            }
        }
        for (int64_t e = 0; e < p->So; e++) {
            char *dst = (char *)t->data + (slot * t->stride[0] + conv_row(p->final, p->So, i, e) * t->stride[1] +
                                           c1 * t->stride[2]) * es;
            if (raw)
                memcpy(dst, buf + (size_t)e * CONV_STATE_CHANNELS, (size_t)(n1 * es));
            else
                c->kt->cvt.from_f32(buf + (size_t)e * CONV_STATE_CHANNELS, n1, dst, t->dtype, t->stride[2]);
        }
    }
}

/* Whether sequence i's final state is written by its output items (out_item) instead of the
 * final-state pass: it has one item per channel block (1..CONV_TOKENS tokens, decodes and
 * verify windows), and that item reads every entry of its slot the final state needs for its
 * channels, in place too, since no other sequence reads a slot it writes (fw_conv_check). So
 * one pass and one parallel region serve a decode, and a state row is written by the core
 * that read it. */
static int fused_final(const conv_ctx *c, int64_t i)
{
    if (!c->p->final)
        return 0;
    int64_t b, t0, len;
    conv_seq(c->p, i, &b, &t0, &len);
    return len >= 1 && len <= CONV_TOKENS;
}

/* Outputs of tokens [u0, u1) of sequence i, channels [c0, c0 + nc). With channels contiguous
 * in x the taps are x's rows, read in their dtype by the kernel, and the output goes
 * straight to out when its channels are contiguous too; the window's rows before the
 * sequence's start (initial state entries, or zeros) and every row of other layouts go
 * through a ring of W rows in f32. */
static void out_item(void *vctx, int64_t it, int tid)
{
    const conv_ctx *c = vctx;
    const conv_prob *p = c->p;
    const fw_kernels *kt = c->kt;
    int64_t lo = 0, hi = p->n;
    while (lo < hi) { /* the sequence whose items hold `it` */
        const int64_t mid = (lo + hi) / 2;
        if (c->first[mid + 1] <= it)
            lo = mid + 1;
        else
            hi = mid;
    }
    const int64_t i = lo, k = it - c->first[i], blk = k % c->nblk, chunk = k / c->nblk;
    int64_t b, t0, len;
    conv_seq(p, i, &b, &t0, &len);
    const int64_t u0 = chunk * CONV_TOKENS, u1 = fw_min64(len, u0 + CONV_TOKENS), c0 = blk * c->cb;
    const int nc = (int)fw_min64(c->cb, p->D - c0), W = (int)p->W;
    float *ws = c->ws + (size_t)tid * c->ws_stride, *y = ws, *res = y + c->cb, *ring = res + c->cb;
    const int direct = p->x->stride[2] == 1, odirect = p->out->stride[2] == 1;
    const int rdirect = p->res && p->res->stride[2] == 1;
    /* state entries read in place too: the init cache in x's dtype, channels contiguous */
    const fw_tensor *ic = p->init ? &p->init->cache : NULL;
    const int sdirect = direct && (!ic || (ic->dtype == p->x->dtype && ic->stride[2] == 1));
    const void *taps[FW_MAX_CONV_WIDTH];
    if (u1 - u0 >= CONV_SLIDE_ROWS && direct && odirect && !p->res && (sdirect || u0 >= W - 1)) {
        /* every tap and output in place: the item's rows in one call, whose width-4 kernel
         * slides the taps in registers (measured 1.21-1.27x at Qwen3-Next's
         * 2K prefill) */
        const void *rows[CONV_TOKENS + FW_MAX_CONV_WIDTH];
        void *ys[CONV_TOKENS];
        for (int64_t v = u0 - (W - 1); v < u1; v++) {
            const char *e = v >= 0 ? row_at(p->x, b, t0 + v, c0) : state_at(p->init, p->Si, i, p->Si + v, c0);
            rows[v - u0 + W - 1] = e ? (const void *)e : c->zero;
        }
        for (int64_t u = u0; u < u1; u++)
            ys[u - u0] = row_at(p->out, b, t0 + u, c0);
        kt->conv.rows(W, (int)(u1 - u0), c->pass, rows, p->x->dtype, c->wt + c0, p->D, c->bias + c0, nc, c->silu,
                        ys, p->out->dtype, c->stream);
        if (fused_final(c, i))
            final_rows(c, i, c0, nc, tid);
        return;
    }
    for (int64_t u = u0 - (W - 1); u < u1; u++) {
        const int from_x = direct && (u >= W - 1 || sdirect); /* every tap read in place */
        if (!from_x) {
            float *row = ring + (size_t)((u - u0 + W - 1) % W) * c->cb;
            if (u >= 0)
                kt->cvt.to_f32(row_at(p->x, b, t0 + u, c0), p->x->dtype, p->x->stride[2], nc, 1.0f, row);
            else
                state_row(c, p->init, p->Si, i, p->Si + u, c0, nc, row);
        }
        if (u < u0)
            continue;
        for (int kk = 0; kk < W; kk++) {
            const int64_t v = u - (W - 1) + kk; /* the tap's token */
            if (!from_x) {
                taps[kk] = ring + (size_t)((v - u0 + W - 1) % W) * c->cb;
                continue;
            }
            const char *e = v >= 0 ? row_at(p->x, b, t0 + v, c0) : state_at(p->init, p->Si, i, p->Si + v, c0);
            taps[kk] = e ? (const void *)e : c->zero;
        }
        const void *r = NULL;
        fw_dtype rdt = FW_F32;
        if (rdirect) {
            r = row_at(p->res, b, t0 + u, c0);
            rdt = p->res->dtype;
        } else if (p->res) {
            kt->cvt.to_f32(row_at(p->res, b, t0 + u, c0), p->res->dtype, p->res->stride[2], nc, 1.0f, res);
            r = res;
        }
        void *dst = odirect ? (void *)row_at(p->out, b, t0 + u, c0) : (void *)y;
        kt->conv.row(W, taps, from_x ? p->x->dtype : FW_F32, c->wt + c0, p->D, c->bias + c0, r, rdt, nc,
                       c->silu, dst, odirect ? p->out->dtype : FW_F32);
        if (!odirect)
            kt->cvt.from_f32(y, nc, row_at(p->out, b, t0 + u, c0), p->out->dtype, p->out->stride[2]);
    }
    if (fused_final(c, i))
        final_rows(c, i, c0, nc, tid);
}

/* The final-state pass's item: sequence it / nblk, channels of block it % nblk; sequences of
 * one output item per channel block wrote theirs already (out_item). */
static void state_item(void *vctx, int64_t it, int tid)
{
    const conv_ctx *c = vctx;
    const int64_t i = it / c->nblk, c0 = (it % c->nblk) * CONV_STATE_CHANNELS;
    if (!fused_final(c, i))
        final_rows(c, i, c0, fw_min64(CONV_STATE_CHANNELS, c->p->D - c0), tid);
}

/* Outputs of at least this many bytes (a quarter of this machine's 32 MiB L3) bypass the
 * cache: little of them would still be there for the next op, and a plain store first reads
 * each line it writes, half as much traffic again as x and out. Measured (Qwen3-Next's conv,
 * 8192 channels, bf16, SiLU, 2 threads, two runs each, ms, streamed vs plain stores): 256
 * tokens 0.255-0.262 vs 0.277-0.290; 512: 0.42-0.52 vs 0.51-0.54; 1K: 0.72-0.97 vs
 * 1.17-1.22; 2K: 1.66-1.69 vs 2.56-2.59. What streaming costs the op that reads the output
 * next was not measured; hence the threshold, not 0. The GDN layer's windows, read back at
 * once, never stream (fw_conv1d_fwd_cached). */
#define CONV_STREAM_BYTES ((int64_t)8 << 20)

int fw_conv_stream(int64_t out_bytes)
{
    return out_bytes >= CONV_STREAM_BYTES;
}

/* The kernels' SiLU: to bf16 or f16 precision for an output of that dtype without a residual
 * (a residual could cancel the activation and leave its error larger than the output's
 * rounding), whatever layout the kernel stores in; the GDN layer's windows keep the f32 one
 * (fw_conv1d_fwd_cached says why). Measured (Qwen3-Next's conv at 2K, bf16,
 * 2 threads, three alternating runs): 1.46-1.67 ms against 1.72-1.96 ms with the f32 SiLU,
 * 1.15-1.18x; the error against float64 unchanged (half the bar: the bf16 rounding). */
static int conv_silu_mode(const conv_prob *p, int standalone)
{
    if (!p->silu)
        return 0;
    return standalone && p->out->dtype != FW_F32 && !p->res ? FW_SILU_HALF : 1;
}

/* The weights [D, W] as f32 [W][D] (wb), one row of taps per channel: packed rows ([D, W]
 * contiguous, as every caller passes them) by the table's conv_weights; otherwise strided,
 * element by element. Measured, Qwen3-Next's 12288 channels x 4 bf16 taps (a decode's layer
 * call, 2 threads): 25 us of a 56-67 us call strided. */
static void conv_weights(const fw_kernels *kt, const fw_tensor *w, int64_t D, int64_t W, float *wb)
{
    if (w->stride[1] == 1 && w->stride[0] == W) {
        kt->conv.weights((int)W, D, w->data, w->dtype, wb);
        return;
    }
    for (int64_t k = 0; k < W; k++)
        kt->cvt.to_f32(fw_elem(w, k * w->stride[1]), w->dtype, w->stride[0], D, 1.0f, wb + k * D);
}

static fw_status conv_fwd(const fw_tensor *x, const fw_tensor *weight, const fw_tensor *bias,
                          const int32_t *cu_seqlens, int64_t n_seqs, const fw_conv1d_state *init,
                          const fw_conv1d_state *final, const fw_tensor *residual, const fw_tensor *out,
                          const fw_conv1d_params *params, int standalone)
{
    fw_clear_error();
    conv_prob p;
    fw_status s = fw_conv_check(&p, x, weight, bias, cu_seqlens, n_seqs, init, final, residual, out, params, 0);
    if (s)
        return s;
    const fw_kernels *kt = fw_kernels_get(params ? params->isa : NULL);
    if (!kt)
        return FW_ERR_UNSUPPORTED;
    if (p.D == 0 || p.n == 0)
        return FW_OK;
    const int threads = fw_threads(params ? params->threads : 0);
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(p.n + 1));
    if (!first)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the conv1d workspace");
    first[0] = 0;
    for (int64_t i = 0; i < p.n; i++) {
        int64_t b, t0, len;
        conv_seq(&p, i, &b, &t0, &len);
        first[i + 1] = first[i] + fw_ceil_div(len, CONV_TOKENS);
    }
    const int64_t cb = fw_conv_channel_block(p.D, first[p.n], threads), nblk = fw_ceil_div(p.D, cb);
    for (int64_t i = 0; i <= p.n; i++)
        first[i] *= nblk;
    conv_ctx c = {&p, kt, first, nblk, cb, NULL, NULL, NULL, NULL, 0,
                  standalone && fw_conv_stream(p.B * p.L * p.D * (int64_t)fw_dtype_size(p.out->dtype)),
                  conv_silu_mode(&p, standalone), fw_conv_pass_rows(fw_cpu_vendor())};
    /* scratch per thread: outputs y, residual and the ring (W rows) of an out item, or the
     * So rows of a state item */
    const size_t out_stride = (size_t)(p.W + 2) * (size_t)cb, st_stride = (size_t)p.So * CONV_STATE_CHANNELS;
    c.ws_stride = out_stride > st_stride ? out_stride : st_stride;
    float *wb = malloc(sizeof(float) * (size_t)(p.D * (p.W + (p.b != NULL))));
    void *zero = calloc((size_t)p.D, sizeof(float));
    c.ws = malloc(sizeof(float) * (size_t)threads * c.ws_stride);
    c.zero = zero;
    if (!wb || !zero || !c.ws) {
        free(first);
        free(wb);
        free(zero);
        free(c.ws);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the conv1d workspace");
    }
    conv_weights(kt, p.w, p.D, p.W, wb);
    if (p.b)
        kt->cvt.to_f32(p.b->data, p.b->dtype, p.b->stride[0], p.D, 1.0f, wb + p.W * p.D);
    c.wt = wb;
    c.bias = p.b ? wb + p.W * p.D : (const float *)zero; /* no bias: the zero row */
    fw_parallel(threads, first[p.n], out_item, &c);
    int64_t rest = 0; /* sequences whose final states are left to the second pass */
    for (int64_t i = 0; final && i < p.n; i++)
        rest += !fused_final(&c, i);
    if (rest) {
        c.nblk = fw_ceil_div(p.D, CONV_STATE_CHANNELS);
        fw_parallel(threads, p.n * c.nblk, state_item, &c);
    }
    free(first);
    free(wb);
    free(zero);
    free(c.ws);
    return FW_OK;
}

fw_status fw_conv1d_fwd(const fw_tensor *x, const fw_tensor *weight, const fw_tensor *bias,
                        const int32_t *cu_seqlens, int64_t n_seqs,
                        const fw_conv1d_state *init, const fw_conv1d_state *final,
                        const fw_tensor *residual, const fw_tensor *out,
                        const fw_conv1d_params *params)
{
    return conv_fwd(x, weight, bias, cu_seqlens, n_seqs, init, final, residual, out, params, 1);
}

fw_status fw_conv1d_fwd_cached(const fw_tensor *x, const fw_tensor *weight, const fw_tensor *bias,
                               const int32_t *cu_seqlens, int64_t n_seqs, const fw_conv1d_state *init,
                               const fw_conv1d_state *final, const fw_tensor *out,
                               const fw_conv1d_params *params)
{
    return conv_fwd(x, weight, bias, cu_seqlens, n_seqs, init, final, NULL, out, params, 0);
}
