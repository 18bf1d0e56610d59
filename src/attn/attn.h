/* attn/attn.h: the validated attention problem shared by the kernel driver (src/attn/) and
 * the reference (ref/attn_ref.c), its validation (attn/setup.c) and the tiling heuristics. */
#ifndef FW_ATTN_H
#define FW_ATTN_H

#include "../internal.h"

/* One attention problem after validation: dense batches and varlen batches look alike here.
 * Offsets and strides are in elements. */
typedef struct fw_attn_prob {
    const fw_tensor *q, *k, *v, *out, *lse;
    const int32_t *cuq, *cuk; /* varlen only */
    int varlen;
    int64_t batch, sq, sk;    /* sq, sk: dense lengths; varlen: the longest sequence */
    int64_t hq, hkv, G, d, dv;
    int64_t qs[3], ks[3], vs[3], os[3]; /* token, head, dim strides */
    int64_t qb, kb, vb, ob;             /* dense batch strides (0 for varlen) */
    int64_t lse_b, lse_h, lse_r;        /* lse offset = lse_b * (dense batch | varlen row start)
                                           + lse_h * head + lse_r * row */
    /* KV-cache calls: keys come from the cache, through the block table when paged */
    int kvcache, append;
    const int32_t *bt;                  /* block table, NULL when the cache is contiguous */
    int64_t bt_stride, page, page_shift; /* page_size rows; page_shift: its log2 when a power of two, else -1 */
    int64_t kpage, vpage;               /* page strides of K and V (elements) */
    const int32_t *cache_len;           /* tokens cached before the call */
    const int32_t *leftpad;             /* first cache row of each context, or NULL */
    const int32_t *batch_idx;           /* cache entry of each sequence, or NULL (entry i) */
    const fw_tensor *knew, *vnew;       /* new rows (the reference reads them from here) */
    int tiles;                          /* FW_KV_TILES: pages hold K and V in AMX's tile order */
    double scale;                       /* softmax scale */
    double softcap;                     /* 0 = off */
    int causal;
    int64_t wl, wr;                     /* -1 = unbounded; causal sets wr = 0 */
    const fw_kernels *kt;               /* the call's kernel table (NULL: the reference's, or
                                         * one this CPU cannot run: the call fails) */
    int bf16;                           /* bf16 products (params->precision resolved) */
    /* rotary embedding (params->rotary_*): rcos NULL = none */
    const fw_tensor *rcos, *rsin;
    int64_t rhalf;                      /* rotary_dim / 2: pairs rotated per row */
    int rinter;                         /* GPT-J pairs (1) or GPT-NeoX halves (0) */
    int rot_k;                          /* keys rotated as they are read (dense, varlen) */
    int rot_append;                     /* new keys rotated as they are appended (KV cache) */
    int rot_q_fixed;                    /* every query at position sk - sq (KV cache, no mask) */
    const fw_tensor *sinks;             /* [hq] attention sinks (params->sinks), or NULL */
    const fw_tensor *kdesc, *vdesc;     /* an fp8 cache's descales (scalar or [b, hkv]), else NULL */
} fw_attn_prob;

/* What a stored K (v = 0) or V (v = 1) element of sequence seq, K/V head h stands for, per
 * unit: an fp8 cache's descale, else 1. */
static inline float fw_attn_descale(const fw_attn_prob *p, int v, int64_t seq, int64_t h)
{
    const fw_tensor *t = v ? p->vdesc : p->kdesc;
    if (!t)
        return 1.0f;
    return ((const float *)t->data)[t->ndim == 2 ? seq * t->stride[0] + h * t->stride[1] : 0];
}

/* Query head h's attention sink (natural-log units), as a double. */
static inline double fw_attn_sink(const fw_attn_prob *p, int64_t h)
{
    return fw_load_f64(p->sinks, h * p->sinks->stride[0]);
}

/* One sequence of the batch: where its rows start and how many there are. */
typedef struct {
    int64_t index;                /* which sequence of the batch */
    int64_t q0, k0, v0, o0, lse0; /* element offsets of row 0, head 0 in q, k, v, out, lse */
    int64_t sq, sk;
    int64_t kpos;                 /* cache row of key 0 (the KV cache's leftpad; else 0): the
                                     rotary position of key j is kpos + j */
} fw_attn_seq;

fw_attn_seq fw_attn_seq_get(const fw_attn_prob *p, int64_t i);

/* Element offset of key j's row (head 0) of sequence s, in K (v = 0) or V (v = 1): strided
 * rows, or a page lookup. */
static inline int64_t fw_attn_key(const fw_attn_prob *p, const fw_attn_seq *s, int64_t j, int v)
{
    const int64_t tok = v ? p->vs[0] : p->ks[0];
    if (!p->bt)
        return (v ? s->v0 : s->k0) + j * tok;
    /* a shift and a mask for a power of two (the branch goes one way for a whole call) */
    const int64_t pg = p->page_shift >= 0 ? j >> p->page_shift : j / p->page;
    const int64_t page = p->bt[s->index * p->bt_stride + pg];
    return page * (v ? p->vpage : p->kpage) + (j - pg * p->page) * tok;
}

/* FW_KV_TILES: element offset of channel x of key j, K/V head h, in K (v = 0) or V (v = 1)
 * (the layout is in flywheel.h, at fw_kv_cache). */
static inline int64_t fw_attn_tile_elem(const fw_attn_prob *p, const fw_attn_seq *s, int64_t j,
                                        int64_t h, int64_t x, int v)
{
    const int64_t pg = p->page_shift >= 0 ? j >> p->page_shift : j / p->page, r = j - pg * p->page;
    const int64_t base = p->bt[s->index * p->bt_stride + pg] * (v ? p->vpage : p->kpage) +
                         h * (v ? p->vs[1] : p->ks[1]);
    if (v)
        return base + (x >> 4) * 16 * p->page + (r >> 1) * 32 + (x & 15) * 2 + (r & 1);
    return base + (r >> 4) * 16 * p->d + (x >> 1) * 32 + (r & 15) * 2 + (x & 1);
}

/* FW_KV_TILES: keys j0 .. j0 + n - 1 of K/V head h copied out as bf16 rows, dst[i * len + x]
 * (len = d for K, dv for V). */
void fw_attn_tile_rows_out(const fw_attn_prob *p, const fw_attn_seq *s, int64_t j0, int n,
                           int64_t h, int v, uint16_t *dst);

/* Keys query row r of a sequence sees: [*lo, *hi), empty when hi <= lo. */
static inline void fw_attn_visible(const fw_attn_prob *p, int64_t sq, int64_t sk, int64_t r,
                                   int64_t *lo, int64_t *hi)
{
    int64_t diag = r + sk - sq;
    /* written so that windows up to INT64_MAX cannot overflow */
    *lo = p->wl >= 0 && diag > p->wl ? diag - p->wl : 0;
    *hi = p->wr >= 0 && p->wr < sk - diag ? diag + p->wr + 1 : sk;
}

/* Rotary embedding: x (d floats, f32) rotated in place at position pos by the table's rope
 * (attn/setup.c): cos / sin rows read in place when f32 and unit-stride, else converted. */
void fw_attn_rotate(const fw_attn_prob *p, const fw_kernels *kt, float *x, int64_t pos);

/* The rotary position of query row r of a sequence with sq queries and sk keys. */
static inline int64_t fw_attn_qpos(const fw_attn_prob *p, const fw_attn_seq *s, int64_t r)
{
    return s->kpos + s->sk - s->sq + (p->rot_q_fixed ? 0 : r);
}

/* What the workspace queries (forward and backward) check before sizing, reading no data:
 * q, k, v and bytes non-NULL, ranks alike (4: dense, 3: varlen), heads that group and head
 * dims in range, params; the kernel table into *kt, and hq, hkv, d, dv into dims. */
fw_status fw_attn_ws_query(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                           const size_t *bytes, const fw_attn_params *params, int64_t dims[4],
                           const fw_kernels **kt);

/* params alone (also fw_attn_workspace_size's check): scale, softcap, window, causal,
 * threads, precision, flags, rotary_interleaved. */
fw_status fw_attn_check_params(const fw_attn_params *params);

/* Validates everything and fills *p; `ref` admits f64 outputs. Nothing is written. */
fw_status fw_attn_setup_kvcache(fw_attn_prob *p, const fw_tensor *q, const fw_tensor *k_new,
                                const fw_tensor *v_new, const int32_t *cuq, int64_t batch,
                                const fw_kv_cache *cache, const fw_tensor *out,
                                const fw_tensor *lse, const fw_attn_params *params, int ref);
fw_status fw_attn_setup(fw_attn_prob *p, const fw_tensor *q, const fw_tensor *k,
                        const fw_tensor *v, const int32_t *cuq, const int32_t *cuk,
                        int64_t batch, int varlen, const fw_tensor *out, const fw_tensor *lse,
                        const fw_attn_params *params, int ref);

/* ---- tiling heuristics (pure functions, unit-tested) ---- */

/* A decode-shaped sequence: 1 .. FW_DEC_ROWS query rows per K/V head (G heads x sq
 * positions). It takes the decode kernel (attn/decode.c), one item per key split, all heads
 * together; longer ones take q tiles (attn/tile.c). */
static inline int fw_attn_is_decode(int64_t G, int64_t sq)
{
    return sq > 0 && G * sq <= FW_DEC_ROWS;
}

/* Whether a sequence of sq queries takes the decode kernel: decode-shaped, and its keys need
 * no rotation (the decode kernel reads them as they lie). */
static inline int fw_attn_decode_seq(const fw_attn_prob *p, int64_t G, int64_t sq)
{
    return !p->rot_k && fw_attn_is_decode(G, sq);
}

/* Keys per K/V tile. 64 keys x 4 bytes x d=128 = 32 KiB: one K tile plus one V tile stay in
 * L2 with the q tile and the accumulator of the chunk being processed. */
#define FW_ATTN_BK 64
/* Most q tiles a work item (chunk) holds; sizes the workspace. */
#define FW_ATTN_CHUNK_MAX 16
/* Rows a q tile aims for: the AVX-512 register tile is 4 vectors x 16 rows = 64 rows. */
#define FW_ATTN_TILE_ROWS 64

/* A q tile holds bq consecutive query positions of each of the G heads that share a K/V head
 * (G = hq / hkv; 1 without GQA packing): rows = G * bq, padded to M, a multiple of vl.
 * Example: G = 4, vl = 16, sq_max = 4096 -> bq = 16, M = 64; decode (sq_max = 1) -> bq = 1,
 * M = 16; G = 3 -> bq = 21, 63 rows, M = 64. */
void fw_attn_tile_rows(int64_t G, int vl, int64_t sq_max, int *bq, int *M);

/* q tiles per chunk: enough chunks for dynamic load balance (about 8 per thread), at most
 * FW_ATTN_CHUNK_MAX so the workspace is bounded. Example: 2048 tiles, 2 threads -> 16. */
int fw_attn_chunk_tiles(int64_t total_tiles, int threads);

/* Key ranges the context of a decode sequence (fw_attn_is_decode: G x n <= FW_DEC_ROWS query
 * rows per K/V head) with `units` K/V groups (K/V heads, or q heads without GQA packing) is
 * split into: one range up to 2 x FW_KV_SPLIT keys when there are two units or more (their
 * heads spread over the threads instead: fw_attn_dec_groups); else ranges of
 * fw_attn_kv_split_keys keys, FW_KV_SPLIT (512) past FW_KV_SPLIT keys and half that up to it;
 * ceil(sk / keys) of them, at least 1. Depends on the shape only, never on the thread count.
 * Examples (8 units): sk 32768 -> 64; 2048 -> 4; 1024 -> 1; (1 unit) 1024 -> 2, 512 -> 2,
 * 256 -> 1.
 * Why 512 (measured, bf16, GQA 32:8, d 128, batch 1, 2 threads, `flywheel bench kvcache
 * --decode`): 512-key splits give 34 GB/s of K/V at 1K keys against 20 with 2048 (one split
 * ran on one thread), 37 against 15-34 at 4K, 28 against 27 at 32K; batch 16 is unchanged
 * (26-31 GB/s). Splits this small pay off only since the thread pool (src/threads.c).
 * Why 256 up to 512 keys for one unit (Intel Xeon with AMX, 2 threads, the same shape): one
 * range ran on one thread; `flywheel bench kvcache --decode --reps 64`, batch 1, paged,
 * medians: 384 keys 56-58 -> 46-47 us, 512 keys 87-91 -> 57-76 us; batch 16 level (1072-1110
 * against 1101-1104 us at 384, 1449-1481 against 1467-1492 at 512). 256-key ranges past 512
 * keys were slower (C API, best of 2000 hot calls: 1K 107-108 us against 102-105, 4K 1-2%).
 * Why one range up to 1K keys, the heads in groups (Zen 4 VM, 2 threads, GQA 32:8, d 128,
 * batch 1, 128-token pages, medians of 2 x 800 calls alternating in blocks of 40 between the
 * two builds in one process): 700 keys f32 182-184 -> 118-120 us (two ranges of 512 and 188
 * keys were one thread's work), 1K f32 196 -> 188, bf16 128 -> 119, 512 keys bf16 64-75 ->
 * 58-74, batch 2 at 1K bf16 263-266 -> 236; cold caches (24 in rotation) level (f32 540-585
 * against 528-572, bf16 277-280 against 281-284); 4K and batch 16 take the old path. */
int64_t fw_attn_kv_split_keys(int64_t sk, int64_t units);
int64_t fw_attn_kv_splits(int64_t sk, int64_t units);

/* Key ranges a sequence on the tiled path is split into, as a split decode's, when its items
 * (q tiles x K/V heads, `items`) are fewer than FW_TILE_SPLIT_ITEMS: so that items x ranges
 * come near it, each range a multiple of FW_KV_SPLIT keys and at least FW_TILE_SPLIT_MIN; else
 * one range (fw_attn_tile_split_keys returns max(sk, 1)), as with no items (a sequence of no
 * queries). The shape only, never the threads.
 * It is what gives a decode of more than FW_DEC_ROWS rows per K/V head its threads: MLA's 128
 * heads on one latent head (one q tile of 128 rows) at 32K keys -> 16 ranges of 2048; 4K -> 4
 * of 1024; 8 items at 32K -> 2 of 16384; 16 items or more, or up to 1K keys -> 1. */
#define FW_TILE_SPLIT_ITEMS 16
#define FW_TILE_SPLIT_MIN 1024
int64_t fw_attn_tile_split_keys(int64_t sk, int64_t items);
int64_t fw_attn_tile_splits(int64_t sk, int64_t items);

/* How many groups the units of each decode item are spread over, when a call has fewer
 * items than threads (items: decode items by key range plus the other items): enough for
 * every thread, at most one unit a group, every group non-empty (units / ceil(units / want)
 * rounded up); else 1. Changes who computes a head, never its bits. Examples: 8 units, 1
 * item, 2 threads -> 2 (4 heads each); 3 threads -> 3 (3, 3, 2); 7 threads -> 4 (2 each:
 * ceil(8 / 7) = 2 a group); 1 unit -> 1; 2 items, 2 threads -> 1. */
int64_t fw_attn_dec_groups(int64_t units, int64_t items, int threads);

#endif /* FW_ATTN_H */
