/*
 * flywheel.h: the public C API of libflywheel, FlyWheel's attention kernels in C.
 *
 * Conventions
 *   - Every function returns an fw_status. On failure, fw_last_error() gives a message for
 *     the calling thread that says exactly what is wrong, and nothing was written.
 *   - The library never exits, aborts or prints. It is safe to call from several threads at
 *     once. Global state: the once-only CPU detection, the threading settings (see "Threads":
 *     fw_set_parallel, fw_set_spin_us) and the threads parallel loops run on: a host's loop,
 *     OpenMP's (an FW_OPENMP build), or a pool of worker threads that one call at a time
 *     uses (a call that finds it in use starts its own threads). The pool's threads stay for
 *     the life of the process; a forked child starts without them.
 *   - Tensors are plain descriptors with explicit element strides (see fw_tensor).
 *   - Memory: attention allocates per-thread workspace whose size does not depend on the
 *     sequence lengths (never O(sq*sk)). Ask its size with fw_attn_workspace_size(); pass a
 *     buffer of at least that size in fw_attn_params.workspace, or leave it NULL and the
 *     library allocates (and frees) it inside the call, returning FW_ERR_NOMEM cleanly if
 *     that fails.
 */
#ifndef FLYWHEEL_H
#define FLYWHEEL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library targets Linux and macOS (gcc, clang) and is built with -fvisibility=hidden: the
 * functions marked FW_API are the only ones it exports. */
#if defined(__GNUC__)
#define FW_API __attribute__((visibility("default")))
#else
#define FW_API
#endif

/* ---------------------------------------------------------------- version -- */

/* The release, also in CMakeLists.txt's project() (a configure-time check keeps them equal). */
#define FW_VERSION_MAJOR 0
#define FW_VERSION_MINOR 1
#define FW_VERSION_PATCH 0

/* The ABI number: bumped by any change that breaks a program built against an earlier header
 * (the layout of a public struct, the value of an enum constant or #define a call takes, the
 * signature of a function, a function removed), and only by those: adding a function does
 * not bump it. The shared library's soname carries it (libflywheel.so.<ABI number>), and
 * bindings check it at load time (the Python package refuses a library whose
 * fw_abi_version() differs from the number it was written for). */
#define FW_ABI_VERSION 8

/* "MAJOR.MINOR.PATCH" of the library as built ("0.1.0"). A constant string. */
FW_API const char *fw_version(void);
/* FW_ABI_VERSION as the library was built with it; a program can compare it with the
 * FW_ABI_VERSION of the header it was compiled against. */
FW_API int fw_abi_version(void);

/* ---------------------------------------------------------------- status -- */

typedef enum fw_status {
    FW_OK = 0,
    FW_ERR_NULL,        /* a required pointer is NULL */
    FW_ERR_DTYPE,       /* a dtype the operation does not accept */
    FW_ERR_SHAPE,       /* ranks or sizes that do not fit together */
    FW_ERR_STRIDE,      /* negative strides, or an output whose elements alias */
    FW_ERR_ARG,         /* a parameter out of range (scale, window, softcap, threads, flags) */
    FW_ERR_SEQLENS,     /* cu_seqlens that are not non-decreasing or do not match the tensors */
    FW_ERR_OVERFLOW,    /* sizes or offsets that overflow 64-bit arithmetic */
    FW_ERR_NOMEM,       /* an allocation failed */
    FW_ERR_WORKSPACE,   /* the caller's workspace is smaller than fw_attn_workspace_size() */
    FW_ERR_UNSUPPORTED, /* a kernel table this CPU cannot run, or an unknown table name */
    FW_ERR_INDEX        /* a page index out of range, or a page two sequences would both write */
} fw_status;

/* A constant string naming the status ("FW_ERR_SHAPE: ..."). Never NULL. */
FW_API const char *fw_status_string(fw_status s);

/* The message of the last failing call on this thread ("" if none). Thread-local; valid until
 * the next call into the library from the same thread. */
FW_API const char *fw_last_error(void);

/* ---------------------------------------------------------------- tensors -- */

typedef enum fw_dtype {
    FW_F32 = 0,
    FW_BF16 = 1,
    FW_F16 = 2,
    FW_F64 = 3,    /* only for outputs of the float64 reference functions */
    /* 8-bit floats, only for KV caches (fw_kv_cache, with descales):
     * FW_F8E4M3: torch.float8_e4m3fn (4 exponent bits, bias 7, no inf, NaN S.1111.111,
     *   largest finite 448); FW_F8E5M2: torch.float8_e5m2 (5 exponent bits, bias 15, the top
     *   byte of an f16: inf and NaN as there, largest finite 57344). */
    FW_F8E4M3 = 4,
    FW_F8E5M2 = 5
} fw_dtype;

#define FW_MAX_DIMS 4

/* A strided view. Element (i0, i1, ...) lives at data + sum_k i_k * stride[k] elements.
 * Strides are in elements, must be >= 0; outputs must not have two elements at one address. */
typedef struct fw_tensor {
    void *data;
    fw_dtype dtype;
    int32_t ndim;
    int64_t shape[FW_MAX_DIMS];
    int64_t stride[FW_MAX_DIMS];
} fw_tensor;

/* A contiguous (row-major) descriptor of the given shape. A rank outside 0..FW_MAX_DIMS or a NULL
 * shape gives a descriptor every entry point refuses (FW_ERR_SHAPE); sizes whose product
 * overflows int64 one that they refuse with FW_ERR_OVERFLOW. */
FW_API fw_tensor fw_tensor_contiguous(void *data, fw_dtype dtype, int32_t ndim, const int64_t *shape);

FW_API size_t fw_dtype_size(fw_dtype dt);
FW_API const char *fw_dtype_name(fw_dtype dt);

/* Scalar conversions used throughout (round to nearest even; NaN stays NaN). */
FW_API float fw_bf16_to_f32(uint16_t h);
FW_API uint16_t fw_f32_to_bf16(float f);
FW_API float fw_f16_to_f32(uint16_t h);
FW_API uint16_t fw_f32_to_f16(float f);
/* 8-bit floats (dt FW_F8E4M3 or FW_F8E5M2; any other dt: NaN, 0). To f32: exact. From f32:
 * round to nearest even, saturating: a magnitude beyond the largest finite value (inf
 * included) gives the largest finite value of its sign; NaN stays NaN. A KV cache's appends
 * store x / descale this way. */
FW_API float fw_f8_to_f32(uint8_t b, fw_dtype dt);
FW_API uint8_t fw_f32_to_f8(float f, fw_dtype dt);

/* ---------------------------------------------------------- kernel tables -- */

/* Kernel tables by name: "portable" (plain C, always present); on x86-64 "avx2"
 * (AVX2+FMA+F16C), "avx512" (AVX-512 F/BW/DQ/VL), "avx512bf16" (AVX-512 with AVX512_BF16: bf16
 * products on vdpbf16ps) and "amx"; on AArch64 "neon" (Advanced SIMD) and "neon_bf16" (with
 * FEAT_BF16: bf16 products on BFDOT). Every table runs both product precisions (fw_precision); tables
 * without a bf16 dot product emulate it with f32 FMAs on the same rounded operands, slower
 * than f32 products, so FW_PREC_AUTO picks bf16 products only on a table with one. The
 * default is the best table this CPU runs, or the one named by the environment variable
 * FLYWHEEL_ISA (read once). */
FW_API int fw_isa_count(void);
FW_API const char *fw_isa_name(int i);            /* NULL past the end */
FW_API int fw_isa_supported(const char *name);    /* 1 if this CPU runs the table */
/* 1 if the table (NULL: the default) has a native bf16 dot product on this CPU, so that
 * FW_PREC_AUTO gives bf16 inputs bf16 products there: amx (tiles) wherever it runs,
 * avx512bf16 (vdpbf16ps) on AMD CPUs only, where it runs at twice the f32 FMA rate (Intel's
 * runs at half), and neon_bf16 (BFDOT) wherever it runs. 0 otherwise, or for a table this CPU cannot run. Decided by the CPU's vendor,
 * never by timing, so results do not depend on a measurement. */
FW_API int fw_isa_native_bf16(const char *name);
/* The table used when params->isa is NULL; NULL if FLYWHEEL_ISA names a table this CPU cannot
 * run (then calls that use the default fail with FW_ERR_UNSUPPORTED and say why). */
FW_API const char *fw_isa_default(void);

/* ------------------------------------------------------ softmax attention -- */

/* Technique switches, for A/B measurements. 0 (the default) is the fastest combination. */
enum {
    FW_ATTN_ONLINE_SOFTMAX = 1 << 0, /* online softmax with lazy rescale instead of the static anchor */
    FW_ATTN_NO_GQA_PACK = 1 << 1,    /* pack K/V per query head instead of once per GQA group */
    FW_ATTN_NO_TILE_SKIP = 1 << 2,   /* visit every K/V tile and mask it, instead of index skipping */
    FW_ATTN_PLAIN = 1 << 3,          /* the plain row-at-a-time online-softmax kernel (the baseline) */
    /* The decode kernel's software prefetch of the K/V rows it reads next (the next K/V
     * head's, issued by the products as they read the current head's, where they read K and
     * V in place; else the next key tile's in bursts, with an address-order sweep of
     * contexts over FW_DEC_SWEEP_KEYS keys): forced on, or off.
     * Neither (the default): on where
     * they were measured faster (AMD, and CPUs of unknown vendor), off on Intel, whose L2
     * streamer outpaces software prefetches. Both set is an error. Results are the same.
     * FW_ATTN_NO_DEC_PREFETCH also turns off the prefetch of the next head's key rows before
     * AMX products (the amx table on bf16 rows read in place, 2 KiB or more a token; on by
     * default everywhere). */
    FW_ATTN_DEC_PREFETCH = 1 << 4,
    FW_ATTN_NO_DEC_PREFETCH = 1 << 5
};

/* Precision of the matrix products (QK^T and PV). */
typedef enum fw_precision {
    FW_PREC_AUTO = 0, /* bf16 products when q is bf16 and the table has a native bf16 dot
                       * product (fw_isa_native_bf16), else f32 products */
    FW_PREC_F32 = 1,  /* operands converted to f32, f32 FMAs (any input dtype) */
    FW_PREC_BF16 = 2  /* bf16 operands (q, k, v as given when bf16, else rounded to bf16), f32
                         accumulation; the probabilities P are rounded to bf16 before PV, the
                         softmax scale is applied in f32 to the scores, never to a bf16 operand.
                         flash-attn's and every CPU peer's bf16 arithmetic. */
} fw_precision;

typedef struct fw_attn_params {
    float scale;           /* softmax scale; 0 means 1/sqrt(d). Must be finite, and so must
                              scale x log2(e) (scale / softcap with a softcap) as a float. */
    int32_t causal;        /* 1: query i sees key j only when j <= i + sk - sq (bottom-right) */
    int64_t window_left;   /* query i sees keys j >= i + sk - sq - window_left; any negative
                              value = unbounded (flash-attn's rule; -1 by default) */
    int64_t window_right;  /* query i sees keys j <= i + sk - sq + window_right; any negative
                              value = unbounded. causal implies window_right = 0. */
    float softcap;         /* > 0: scores become softcap * tanh(score / softcap); 0 = off */
    int32_t threads;       /* worker threads; 0 = all online CPUs */
    const char *isa;       /* kernel table name; NULL = fw_isa_default() */
    uint32_t flags;        /* FW_ATTN_* technique switches */
    void *workspace;       /* optional caller buffer, see fw_attn_workspace_size() */
    size_t workspace_bytes;
    int32_t precision;     /* fw_precision; FW_PREC_AUTO by default. The plain kernel
                              (FW_ATTN_PLAIN) always uses f32 products. */
    /* Rotary embedding (RoPE), fused into the kernels; NULL (the default) = none.
     * rotary_cos, rotary_sin [seqlen_ro, rotary_dim / 2], f32 | bf16 | f16, one shape and
     * dtype; rotary_dim <= d, the first rotary_dim channels of q and k rotate, the rest pass.
     * rotary_interleaved 1: GPT-J pairs (x[2i], x[2i+1]); 0: GPT-NeoX halves (x[i],
     * x[i + rotary_dim/2]). A pair (a, b) at position t becomes (a cos - b sin, a sin + b cos)
     * with cos = rotary_cos[t][i], sin = rotary_sin[t][i], in f32.
     * Positions (flash-attn's rules, bottom-right like the masks):
     *   fw_attn_fwd / varlen: key j at j, query i at sk - sq + i (so sq <= sk), both rotated
     *     as their tiles are packed; q and k are never written.
     *   fw_attn_kvcache_fwd: needs k_new (only new keys are rotated): new key i at
     *     seqlens + i, rotated as it is appended (the cache holds rotated keys); query i at
     *     seqlens + i when causal or windowed, else every query at seqlens.
     * rotary_q_only 1: keys are not rotated (they were before: flywheel-tpu's rotary_k=False);
     *   a KV-cache call then needs no k_new (query i at sk - sq + i, or sk - sq as above).
     * seqlen_ro must exceed every position used. The backward takes no rotary embedding. */
    const fw_tensor *rotary_cos;
    const fw_tensor *rotary_sin;
    int32_t rotary_interleaved;
    int32_t rotary_q_only;
    /* Attention sinks (gpt-oss; vLLM's flash-attn calls them s_aux); NULL (the default) =
     * none. sinks [hq], f32 | bf16 | f16, any stride: one learned logit per query head that
     * joins every row's softmax denominator and adds no value row:
     *   out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sinks[h])), s_j the scaled (and
     *   softcapped) scores; lse = log(sum_j exp(s_j) + exp(sinks[h])): lse includes the sink.
     * A row that sees no key gives out = 0 and lse = sinks[h]. Every forward (dense, varlen,
     * KV cache, decode, the plain baseline) and the backward take it; the backward needs the
     * same sinks as the forward, and since lse includes the sink, its dq, dk, dv need nothing
     * else. dsinks (backward only; the forward ignores it): NULL, or [hq] f32, written with
     * the gradient of the loss with respect to sinks, summed over the batch and rows:
     *   dsinks[h] = -sum_rows exp(sinks[h] - lse) x sum_x dout o out.
     * It needs sinks, and must not overlap any other tensor of the call. */
    const fw_tensor *sinks;
    const fw_tensor *dsinks;
} fw_attn_params;

/* Defaults: scale 0 (1/sqrt(d)), non-causal, windows -1, softcap 0, threads 0, isa NULL,
 * precision FW_PREC_AUTO, no rotary embedding, no sinks. */
FW_API void fw_attn_params_init(fw_attn_params *p);

/*
 * Dense forward.
 *   q   [b, sq, hq, d]     f32 | bf16 | f16
 *   k   [b, sk, hkv, d]    same dtype as q
 *   v   [b, sk, hkv, dv]   same dtype as q
 *   out [b, sq, hq, dv]    f32 | bf16 | f16 (may differ from q)
 *   lse [b, hq, sq]        f32, natural log of the softmax denominator; NULL to skip
 * hkv must divide hq; query head h uses K/V head h / (hq / hkv).
 * Rows that see no key give out = 0 and lse = -inf.
 */
FW_API fw_status fw_attn_fwd(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                             const fw_tensor *out, const fw_tensor *lse,
                             const fw_attn_params *params);

/*
 * Variable-length forward over a packed batch of `batch` sequences.
 *   q   [total_q, hq, d], k [total_k, hkv, d], v [total_k, hkv, dv], out [total_q, hq, dv]
 *   lse [hq, total_q] f32 or NULL
 *   cu_seqlens_q, cu_seqlens_k: int32, batch + 1 entries, non-decreasing, starting at 0 and
 *   ending at total_q (total_k). Sequence i owns rows cu[i] .. cu[i+1]-1; empty ones allowed.
 * Masks (causal, window) are per sequence, aligned bottom-right; no key of another sequence
 * is ever seen.
 */
FW_API fw_status fw_attn_varlen_fwd(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                    const int32_t *cu_seqlens_q, const int32_t *cu_seqlens_k,
                                    int64_t batch, const fw_tensor *out, const fw_tensor *lse,
                                    const fw_attn_params *params);

/* Bytes of workspace fw_attn_fwd / fw_attn_varlen_fwd use for these operands and params
 * (depends on d, dv, hq/hkv, the table and the thread count, not on sequence lengths). */
FW_API fw_status fw_attn_workspace_size(const fw_tensor *q, const fw_tensor *k,
                                        const fw_tensor *v, const fw_attn_params *params,
                                        size_t *bytes);

/*
 * Float64 references: the same contracts, computed row by row with float64 accumulation
 * and exp(). With bf16 products (params->precision, FW_PREC_AUTO resolved as in the kernels)
 * the reference makes the same roundings as the kernel and nothing else: q, k, v rounded to
 * bf16 (a no-op for bf16 inputs), each probability exp(s - max) rounded to bf16 before it
 * multiplies V (the denominator sums them unrounded), then the output rounded to its dtype.
 * Pass precision FW_PREC_F32 for the exact result of the given inputs. out may also be FW_F64. Only rows [row_begin, row_end) of every sequence
 * (dense: of sq; varlen: of each sequence's own length, clamped) and head are written, so
 * a caller can check a slice of a large problem; pass 0, INT64_MAX for all rows.
 * params->threads, isa, flags and workspace are ignored; the reference runs on one thread.
 */
FW_API fw_status fw_attn_ref(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                             const fw_tensor *out, const fw_tensor *lse,
                             const fw_attn_params *params, int64_t row_begin, int64_t row_end);
FW_API fw_status fw_attn_varlen_ref(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                    const int32_t *cu_seqlens_q, const int32_t *cu_seqlens_k,
                                    int64_t batch, const fw_tensor *out, const fw_tensor *lse,
                                    const fw_attn_params *params, int64_t row_begin,
                                    int64_t row_end);

/* ----------------------------------------------------- attention backward -- */

/*
 * Dense backward: FlashAttention-2's algorithm. P is recomputed tile by tile from the
 * forward's lse, D = rowsum(dout o out), dS = P o (dP - D), so nothing of size sq x sk is
 * ever stored.
 *   q, k, v, out, lse   the forward's inputs and outputs, shaped as in fw_attn_fwd; lse
 *                       (required) is what the forward wrote for the same params
 *   dout [b, sq, hq, dv] the gradient of out, same dtype as q
 *   dq [b, sq, hq, d], dk [b, sk, hkv, d], dv [b, sk, hkv, dv]: outputs, f32 | bf16 | f16
 *       (each may differ from q); every element is written (a key no query sees gets 0).
 *       They must not overlap each other or any input.
 * Products run in the forward's precision (params->precision: FW_PREC_AUTO gives bf16 inputs
 * bf16 products where the table has a native bf16 dot product; P and dS are then rounded to
 * bf16 before their products, as flash-attn's backward does), with f32 accumulation. dq sums
 * its key tiles, and dk / dv their query rows, in a fixed order, so the result is
 * bit-identical for any thread count. params->flags takes FW_ATTN_PLAIN (the row-at-a-time
 * baseline) only. Softcap, windows, GQA/MQA and dv != d as in the forward.
 * Workspace: fw_attn_bwd_workspace_size(); unlike the forward's it grows with the query
 * rows (f32 partial sums of dq, at most 4 copies: O(sq x hq x d), never O(sq x sk)).
 */
FW_API fw_status fw_attn_bwd(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                             const fw_tensor *out, const fw_tensor *dout, const fw_tensor *lse,
                             const fw_tensor *dq, const fw_tensor *dk, const fw_tensor *dv,
                             const fw_attn_params *params);
/* Variable-length backward: the tensors of fw_attn_varlen_fwd plus dout [total_q, hq, dv],
 * dq [total_q, hq, d], dk [total_k, hkv, d], dv [total_k, hkv, dv]. */
FW_API fw_status fw_attn_varlen_bwd(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                    const fw_tensor *out, const fw_tensor *dout,
                                    const fw_tensor *lse, const int32_t *cu_seqlens_q,
                                    const int32_t *cu_seqlens_k, int64_t batch,
                                    const fw_tensor *dq, const fw_tensor *dk, const fw_tensor *dv,
                                    const fw_attn_params *params);
/* Bytes of workspace a backward call with these tensors and params uses (q and k give the
 * rows: dense [b, sq, ...] or varlen [total, ...]; batch is 0 for dense calls, the number of
 * sequences for varlen ones). */
FW_API fw_status fw_attn_bwd_workspace_size(const fw_tensor *q, const fw_tensor *k,
                                            const fw_tensor *v, int64_t batch,
                                            const fw_attn_params *params, size_t *bytes);
/* Float64 references of the backward: the same contracts, one thread, every sum in double,
 * P = exp(s - lse) from the given lse and D from the given out and dout (the kernels' inputs,
 * so a check compares the arithmetic alone). Outputs may also be FW_F64. */
FW_API fw_status fw_attn_bwd_ref(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                 const fw_tensor *out, const fw_tensor *dout, const fw_tensor *lse,
                                 const fw_tensor *dq, const fw_tensor *dk, const fw_tensor *dv,
                                 const fw_attn_params *params);
FW_API fw_status fw_attn_varlen_bwd_ref(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                        const fw_tensor *out, const fw_tensor *dout,
                                        const fw_tensor *lse, const int32_t *cu_seqlens_q,
                                        const int32_t *cu_seqlens_k, int64_t batch,
                                        const fw_tensor *dq, const fw_tensor *dk,
                                        const fw_tensor *dv, const fw_attn_params *params);

/* ------------------------------------------------------------- KV cache -- */

/*
 * A K/V cache, in one of two layouts:
 *   contiguous (block_table == NULL): k [b, S, hkv, d], v [b, S, hkv, dv]; sequence i owns
 *       rows 0 .. S-1 of batch entry i (of entry batch_idx[i] with a batch_idx, below).
 *   paged: k [num_pages, page_size, hkv, d], v [num_pages, page_size, hkv, dv];
 *       block_table [b, max_pages] int32 (row stride block_table_stride, 0 = max_pages):
 *       token t of sequence i lives in page block_table[i][t / page_size] at row
 *       t % page_size. page_size is any from 1 to 65536 (a power of two is addressed with a
 *       shift; others, such as vLLM's 1152-token blocks of hybrid models, with a division).
 * seqlens[i] (int32) is the number of tokens sequence i already holds. k and v share a dtype
 * (f32, bf16 or f16). The library never changes seqlens: after an append of n tokens the
 * caller adds n, as with flash-attn's cache_seqlens.
 * leftpad[i] (int32, optional; flash-attn's cache_leftpad; contiguous caches only, as there):
 * sequence i's context starts at cache row leftpad[i] (0 <= leftpad[i] <= seqlens[i]): rows
 * before it (a left-padded batch's padding) are never read. Queries align bottom-right to the
 * rows [leftpad[i], seqlens[i] + n_i); new rows are still written at seqlens[i] .., and the
 * rotary positions stay the rows' own (new key r at seqlens[i] + r).
 * batch_idx[i] (int32, optional; flash-attn's cache_batch_idx; contiguous caches only, as
 * there): sequence i uses batch entry batch_idx[i] of the cache (0 .. k's dimension 0 - 1)
 * instead of entry i. With k_new, two sequences with new rows may not share an entry (flash-
 * attn leaves which one wins undefined; here it is refused).
 * layout (fw_kv_layout): how each page holds its rows.
 *   FW_KV_ROWS (0, the default): the strided rows above.
 *   FW_KV_TILES: vLLM CPU_ATTN's AMX layout, the operand order of AMX's tdpbf16ps, so that
 *       a decode loads its K and V tiles straight from the cache. Paged, bf16, page_size a
 *       multiple of 32, d and dv multiples of 32. k and v keep their shapes
 *       [num_pages, page_size, hkv, d | dv] with strides [page, d | dv, head, 1]: the
 *       page_size x d elements of each (page, head) are one dense block, stored so:
 *         K: key t, channel c at (t / 16) * 16 d + (c / 2) * 32 + (t % 16) * 2 + c % 2
 *            (16 keys at a time, each channel pair of them one 64-byte row);
 *         V: key t, channel c at (c / 16) * 16 page_size + (t / 2) * 32 + (c % 16) * 2 + t % 2
 *            (16 channels at a time, each key pair of them one 64-byte row).
 *       vLLM writes it with its cpu_attn_reshape_and_cache(..., isa="amx"); flywheel's
 *       appends (k_new, v_new) write it too. Keys or values at rows past a context are never
 *       used, whatever they hold.
 */
typedef enum { FW_KV_ROWS = 0, FW_KV_TILES = 1 } fw_kv_layout;

typedef struct fw_kv_cache {
    fw_tensor k, v;
    const int32_t *block_table; /* NULL: contiguous */
    int64_t max_pages;          /* columns of block_table (paged only) */
    int64_t block_table_stride; /* elements between block_table rows; 0 = max_pages */
    const int32_t *seqlens;     /* [b] */
    const int32_t *leftpad;     /* [b] first row of each context, or NULL (all 0) */
    const int32_t *batch_idx;   /* [b] cache entry of each sequence, or NULL (entry i) */
    int32_t layout;             /* fw_kv_layout; FW_KV_ROWS when zeroed */
    /* fp8 caches (k and v FW_F8E4M3 or FW_F8E5M2, FW_KV_ROWS): FA3's k_descale / v_descale,
     * both required, f32, each a scalar (rank 0, or [1]) or [b, hkv] (per sequence of the
     * call and K/V head). A stored element x stands for x * descale: the kernels convert the
     * bytes in registers and fold the descales into the score scale (K) and the row's
     * normalisation (V), never through a converted copy of the cache; appends store
     * k_new / descale (and v_new) rounded to nearest even, saturating (fw_f32_to_f8). k_new
     * and v_new are then f32, bf16 or f16, one dtype. NULL for other caches. */
    const fw_tensor *k_descale;
    const fw_tensor *v_descale;
} fw_kv_cache;

/*
 * Append and attend in one call, over a ragged batch of `batch` sequences
 * (flash-attn's flash_attn_with_kvcache). Sequence i has n_i = cu_seqlens_q[i+1] -
 * cu_seqlens_q[i] query tokens: 1 is decode, 2-8 a speculative multi-token decode, more a
 * chunked prefill or a prefill after a cached prefix; the kinds mix freely.
 *   q      [total_q, hq, d]      f32 | bf16 | f16
 *   k_new  [total_q, hkv, d]     same dtype as the cache, or NULL (then v_new is NULL too)
 *   v_new  [total_q, hkv, dv]    rows cu_seqlens_q[i] .. are sequence i's new tokens
 *   out    [total_q, hq, dv]     f32 | bf16 | f16
 *   lse    [hq, total_q]         f32, or NULL
 * With k_new, sequence i's new rows are first written at positions seqlens[i] ..
 * seqlens[i] + n_i - 1 and its context is L_i = seqlens[i] + n_i; without, L_i = seqlens[i].
 * Queries attend to keys [0, L_i) aligned bottom-right, with params' causal flag (set it:
 * query r then sees j <= r + L_i - n_i), window and softcap.
 * Everything is validated before anything is written: a page index out of range, a context
 * longer than its pages (or than S), negative lengths, mismatched heads or dims, two
 * sequences writing one page: a status comes back and the cache is untouched.
 * Decode-shaped sequences (G x n <= 16 query rows per K/V head) take a decode kernel with
 * keys along the vector lanes that reads each cache row once for all heads; their contexts
 * are split into fixed ranges of FW_KV_SPLIT keys (FW_KV_SPLIT / 2 for contexts of at most
 * FW_KV_SPLIT keys) that run in parallel and merge by log-sum-exp, except that contexts of at
 * most 2 x FW_KV_SPLIT keys with two K/V heads or more are not split: when a call has fewer
 * such pieces than threads, the heads of each are shared out instead. The split depends on
 * the context length and head counts only, never on the thread count, and paged and
 * contiguous caches holding the same data give the same bits.
 * Memory: the per-thread workspace of fw_attn_fwd, plus the split partial results (about
 * (dv + 2) floats per query row per split), both allocated inside the call.
 */
#define FW_KV_SPLIT 512
FW_API fw_status fw_attn_kvcache_fwd(const fw_tensor *q, const fw_tensor *k_new,
                                     const fw_tensor *v_new, const int32_t *cu_seqlens_q,
                                     int64_t batch, const fw_kv_cache *cache,
                                     const fw_tensor *out, const fw_tensor *lse,
                                     const fw_attn_params *params);

/* Float64 reference of fw_attn_kvcache_fwd: gathers each sequence's context (cached rows
 * through the block table, then the new rows from k_new/v_new) into a contiguous float64
 * copy and attends to it. Writes only out (which may be FW_F64) and lse; the cache is not
 * modified. */
FW_API fw_status fw_attn_kvcache_ref(const fw_tensor *q, const fw_tensor *k_new,
                                     const fw_tensor *v_new, const int32_t *cu_seqlens_q,
                                     int64_t batch, const fw_kv_cache *cache,
                                     const fw_tensor *out, const fw_tensor *lse,
                                     const fw_attn_params *params);

/* ------------------------------------------------------- Gated DeltaNet -- */

/*
 * Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention), per value head j with state
 * h in R^{dk x dv} (f32, row-major [dk][dv], fla's layout; h = S^T of the paper):
 *   alpha_t = exp(g_t), delta_t = beta_t (v_t - alpha_t h^T k_t),
 *   h_t = alpha_t h_{t-1} + k_t delta_t^T,   o_t = h_t^T q_t
 * KDA (Kimi Delta Attention, Kimi Linear) is the same rule with one decay per key channel:
 * g [T, HV, dk] instead of [T, HV], A_t = diag(exp(g_t)) decays the state's rows:
 *   delta_t = beta_t (v_t - h_{t-1}^T A_t k_t),   h_t = A_t h_{t-1} + k_t delta_t^T
 * Every call below takes either form; g's rank says which.
 * where q_t = scale * q / sqrt(|q|^2 + 1e-6) and k_t = k / sqrt(|k|^2 + 1e-6) when l2norm_qk
 * is set (else q_t = scale * q, k_t = k). Value head j uses q/k head j / (HV / H).
 * States: [N or slots, HV, dk, dv] f32, element (i, j, a, b) at i*HV*dk*dv + j*dk*dv + a*dv + b
 * (contiguous; the layout is part of the contract).
 */
enum {
    FW_GDN_FWD_SUBST = 1 << 0,   /* prefill: triangular inverse by forward substitution */
    FW_GDN_RECURRENT = 1 << 1,   /* prefill: the plain recurrence, four passes over the state
                                    per token (how ggml does it): the baseline */
    FW_GDN_FUSED_RECURRENT = 1 << 2 /* prefill: the fused one-pass decode step per token */
};

typedef struct fw_gdn_params {
    float scale;       /* 0 = 1/sqrt(dk) */
    int32_t l2norm_qk; /* 1: l2-normalise q and k inside the kernel */
    int32_t threads;   /* 0 = all online CPUs */
    const char *isa;   /* NULL = fw_isa_default() */
    uint32_t flags;    /* FW_GDN_* algorithm switches; 0 = chunked WY with the blocked inverse */
    int32_t precision; /* fw_precision of the chunked products (prefill, verify); FW_PREC_AUTO:
                          bf16 products for bf16 q on a table with a native bf16 dot product.
                          Which operands are rounded: docs/linear-attention.md, "Product
                          precision". Decode, commit and the recurrent modes always run f32
                          products on the f32 state. */
    float l2norm_eps;  /* with l2norm_qk: x / sqrt(|x|^2 + eps); 0 = 1e-6 (fla's and
                          transformers'; vLLM's CPU kernels use 1e-5) */
    /* Gates computed inside the kernels (Qwen3-Next's, Kimi Linear's): with a_log ([HV], any
     * float dtype), g holds the raw a (any float dtype) and the log decay is -exp(a_log)
     * softplus(a + dt_bias) (dt_bias [HV], or [HV dk] for KDA, or NULL), or with lower_bound
     * < 0 lower_bound sigmoid(exp(a_log) (a + dt_bias)) (fla's safe gate); with beta_sigmoid
     * = 1, beta holds the raw b and beta = sigmoid(b). The computed gates must be finite (g
     * <= 0), as given ones. */
    const fw_tensor *a_log, *dt_bias;
    int32_t beta_sigmoid;
    float lower_bound; /* 0: the softplus gate; < 0 (finite): the sigmoid gate; needs a_log */
} fw_gdn_params;

FW_API void fw_gdn_params_init(fw_gdn_params *p);

/*
 * Chunked prefill over a packed batch of N sequences (cu_seqlens: int32, N + 1 entries, 0 to
 * T, non-decreasing).
 *   q, k  [T, H, dk]    f32 | bf16 | f16          g     [T, HV] f32, per-token log decay (<= 0)
 *   v     [T, HV, dv]   same dtype as q                 or [T, HV, dk] f32 for KDA
 *   out   [T, HV, dv]   f32 | bf16 | f16          beta  [T, HV] f32
 *   initial_state [N, HV, dk, dv] f32 or NULL (zeros); final_state [N, HV, dk, dv] f32 or NULL
 *   (they may be the same buffer). A sequence of length 0 returns its initial state.
 * Chunks of 64 tokens never span two sequences; all exponentials are of differences <= 0.
 * KDA's bf16 products round the operands its per-channel decays are folded into; A and the
 * gated QK stay on f32 products (docs/linear-attention.md).
 * Memory: per-thread workspace of O(64 x (dk + dv) + (HV/H) x dk x dv) floats, allocated
 * inside the call (FW_ERR_NOMEM if that fails).
 */
FW_API fw_status fw_gdn_prefill(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                const fw_tensor *g, const fw_tensor *beta,
                                const int32_t *cu_seqlens, int64_t n_seqs,
                                const float *initial_state, float *final_state,
                                const fw_tensor *out, const fw_gdn_params *params);

/*
 * Decode: one token for each of N sequences. q, k [N, H, dk]; v [N, HV, dv]; g [N, HV] (KDA:
 * [N, HV, dk]), beta [N, HV] f32; out [N, HV, dv]. state: a slot array [slots, HV, dk, dv] f32; sequence i uses slot
 * state_indices[i] (distinct, in [0, slots)) and it is updated in place.
 */
FW_API fw_status fw_gdn_decode(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                               const fw_tensor *g, const fw_tensor *beta, float *state,
                               int64_t slots, const int32_t *state_indices,
                               const fw_tensor *out, const fw_gdn_params *params);

/*
 * A state pool as a serving engine keeps it: slot s at data + s * slot_stride elements, each
 * [HV, dk, dv] of dtype (slot_stride >= HV dk dv: engines pad slots to their page size). Sequence
 * i starts from slot read[i] (negative, or read NULL: a zero state) and its final state goes
 * to slot write[i] (negative: not written; write NULL: the read slot, in place). Read and
 * write slots differ under prefix caching. No two sequences may write one slot, and no
 * sequence may read a slot another one writes (FW_ERR_INDEX, nothing written).
 * dtype FW_F32 (0, the default of a zeroed struct) or FW_BF16 (vLLM's default state cache for
 * a bf16 model): a bf16 state is read into f32, the call runs on f32 states exactly as on an
 * f32 pool holding the same values, and each state it writes is rounded to bf16 (nearest even)
 * once, at the end of the call (a decode step: after the step).
 */
typedef struct fw_gdn_pool {
    void *data;
    int64_t slots, slot_stride;
    const int32_t *read, *write;
    fw_dtype dtype;
} fw_gdn_pool;

/* Prefill (as fw_gdn_prefill) with the states in a pool. */
FW_API fw_status fw_gdn_prefill_pool(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                     const fw_tensor *g, const fw_tensor *beta,
                                     const int32_t *cu_seqlens, int64_t n_seqs,
                                     const fw_gdn_pool *pool, const fw_tensor *out,
                                     const fw_gdn_params *params);

/* Decode (as fw_gdn_decode, N = q's first dimension) with the states in a pool. */
FW_API fw_status fw_gdn_decode_pool(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                                    const fw_tensor *g, const fw_tensor *beta, const fw_gdn_pool *pool,
                                    const fw_tensor *out, const fw_gdn_params *params);

/* ------------------------------------------------------- GDN serving layer -- */

/* The batch of one engine step (flywheel-tpu's fused_conv1d_gdn arguments): n_seqs
 * sequences, sequence i's tokens rows [query_start_loc[i], query_start_loc[i + 1]) of the
 * step; seq_lens[i] its whole length with them (seq_lens[i] == its query length: a new
 * sequence, which starts from zero conv and recurrent states whatever its slot holds);
 * state_indices[i] the slot its states go to and read_state_indices[i] (NULL: the same) the
 * slot it starts from (they differ under prefix caching). Sequences [0, decode_end) are
 * decodes of one token, [decode_end, mixed_end) prefills and chunked prefills, and those from
 * mixed_end on are skipped.
 * Speculative windows (flywheel-tpu's, num_spec_tokens > 0): sequences [0, decode_end) are
 * then verify windows of 1 .. num_spec_tokens + 1 tokens. Window i starts from slot
 * read_state_indices[i] + read_offsets[i] (read_offsets NULL: + 0) and writes, after each of
 * its tokens t, a checkpoint of both states to slot state_indices[i] + t (a group of
 * consecutive slots per sequence; the engine keeps the checkpoint of the last accepted
 * token). gated_delta_rule_verify / _commit do the same by replaying kept deltas instead
 * (docs/linear-attention.md, "Speculative decoding": which to choose). */
typedef struct fw_gdn_batch {
    int64_t n_seqs;
    const int32_t *query_start_loc, *seq_lens, *state_indices, *read_state_indices;
    int32_t decode_end, prefill_end, mixed_end;
    int32_t num_spec_tokens;
    const int32_t *read_offsets;
} fw_gdn_batch;

/* The two slot caches of a GDN layer, slots = conv.shape[0]: conv [slots, K-1, dim] (f32 |
 * bf16 | f16) the last K-1 raw qkv rows of a sequence; recurrent: slot s at recurrent + s *
 * recurrent_stride elements, [n_v, d_k, d_v] of recurrent_dtype: FW_F32 (0), or FW_BF16 as
 * in fw_gdn_pool (read into f32, each written state rounded once a call; a speculative
 * window's checkpoints each rounded). */
typedef struct fw_gdn_caches {
    fw_tensor conv;
    void *recurrent;
    int64_t recurrent_stride;
    fw_dtype recurrent_dtype;
} fw_gdn_caches;

typedef struct fw_gdn_layer_params {
    int32_t n_kq, n_v, d_k, d_v; /* q/k heads, value heads, their dims */
    float scale;                 /* 0 = d_k^-1/2 */
    float l2norm_eps;            /* 0 = 1e-6 */
    int32_t zero_tail;           /* zero the out rows past the last token of sequence mixed_end - 1 */
    int32_t threads;             /* 0 = all online CPUs */
    const char *isa;             /* NULL = fw_isa_default() */
    int32_t precision;           /* fw_precision of the chunked products (FW_PREC_AUTO: as fw_gdn_params) */
    float lower_bound;           /* < 0: the sigmoid gate lower_bound sigmoid(exp(a_log) (a + dt_bias)) */
    int32_t beta_activated;      /* 1: b holds beta itself (no sigmoid) */
} fw_gdn_layer_params;

FW_API void fw_gdn_layer_params_init(fw_gdn_layer_params *p);

/*
 * One Gated DeltaNet (or KDA) layer of an engine step, from the projections to the core's
 * output:
 *   qkv [T, dim] pre-conv rows, dim = 2 n_kq d_k + n_v d_v ([q | k | v], heads inside each)
 *   b [T, n_v]; a [T, n_v] (GDN), or [T, n_v d_k] for KDA (flywheel-tpu's fused_conv1d_kda:
 *   the raw gate of each key channel, head-major like q and k)
 *   conv_weight [dim, K] (K = 1 .. FW_MAX_CONV_WIDTH), conv_bias [dim] or NULL;
 *   a_log [n_v]; dt_bias [n_v] (KDA: [n_v d_k] or [n_v]); any float dtype for each
 *   out [T, n_v d_v]
 * Causal conv over each sequence's rows from its conv state, then SiLU; q = l2norm(q) scale,
 * k = l2norm(k) (eps inside the sqrt); beta = sigmoid(b) (b itself with beta_activated);
 * g = -exp(a_log) softplus(a + dt_bias), or lower_bound sigmoid(exp(a_log) (a + dt_bias));
 * the gated delta rule from the recurrent state: decodes by the fused step, prefills by the
 * chunked pass; both caches updated in their write slots. The gates are computed inside the
 * kernels (fw_gdn_params' a_log). Everything is checked before anything is written (slots
 * out of range, two sequences writing one slot, a slot read by one sequence and written by
 * another, lengths that do not add up, a bad distribution, gates that are not finite).
 * Workspace: the conv output of a window of at most 256 rows, allocated inside the call.
 */
FW_API fw_status fw_gdn_layer(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                              const fw_tensor *conv_weight, const fw_tensor *conv_bias,
                              const fw_tensor *a_log, const fw_tensor *dt_bias,
                              const fw_gdn_batch *batch, const fw_gdn_caches *caches,
                              const fw_tensor *out, const fw_gdn_layer_params *params);

/*
 * The float64 reference of fw_gdn_layer: the same arguments and checks (out may also be f64).
 * Sequence by sequence (a speculative window token by token, with its checkpoints) the conv
 * in double from the conv read slot (fw_conv1d_ref), its rows kept in qkv's dtype as the layer
 * keeps them; then the core in double from the recurrent read slot (fw_gdn_ref): decodes and
 * windows the exact recurrence (the layer's fused step rounds no products), prefills with the
 * chunked pass's product roundings under bf16 products (FW_PREC_F32: exact). out in its dtype,
 * both caches written as the layer writes them (the recurrent state rounded to its dtype).
 */
FW_API fw_status fw_gdn_layer_ref(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                                  const fw_tensor *conv_weight, const fw_tensor *conv_bias,
                                  const fw_tensor *a_log, const fw_tensor *dt_bias,
                                  const fw_gdn_batch *batch, const fw_gdn_caches *caches,
                                  const fw_tensor *out, const fw_gdn_layer_params *params);

/*
 * ReplaySSM decodes (flywheel-tpu's fused_conv1d_gdn_replay / fused_conv1d_kda_replay): a
 * decode sequence keeps its recurrent state as the f32 checkpoint in its recurrent slot plus
 * the first replay_lens[i] records of its slot in `records`. A step computes its tokens'
 * outputs from the checkpoint and the records without forming the state, and appends one
 * record per token [u | k | g]: the delta-rule correction u = beta (v - k S) per value head
 * (n_v d_v), the normalised key per q/k head (n_kq d_k), and the token's log decay (natural
 * log) per value head (GDN: n_v entries, then padding to a multiple of 128 that is never
 * written; KDA: n_v d_k). It flushes (folds the committed records into a new checkpoint,
 * written with its bf16 shadow to the write slot, and appends from row 0) when the committed
 * records plus its tokens would not fit in the window, when it has no initial state (seq_len
 * equal to its query length: a zero checkpoint) or when it reads and writes different slots.
 * The caller commits with next_replay_lens: committed + accepted tokens, or accepted alone
 * after a flush.
 *   shadow [slots, n_v, d_k, d_v] bf16: the checkpoint's bf16 copy, written with every
 *     checkpoint the layer writes (prefills included); with bf16 products (params->precision,
 *     FW_PREC_AUTO as for the products) the decodes read it instead of the f32 checkpoint, as
 *     the original's do (its dots round the state to bf16); a flush folds the f32 checkpoint
 *   records [slots, window, fw_gdn_replay_record_dim(...)] f32 | bf16, window >= 1 and
 *     >= num_spec_tokens + 1
 *   replay_lens [n_seqs] (decodes read theirs: 0 .. window)
 * Decodes (and speculative windows, whose conv still checkpoints per position, from
 * read_state_indices + read_offsets) read the checkpoint and records of read_state_indices
 * alone, and write records (and a flushed checkpoint) to state_indices; prefills and mixed
 * sequences run as in fw_gdn_layer and write the shadow with their state. The recurrent
 * cache must be f32 here (FW_ERR_DTYPE otherwise): the bf16 copy is the shadow.
 */
typedef struct fw_gdn_replay {
    fw_tensor shadow;
    fw_tensor records;
    const int32_t *replay_lens;
} fw_gdn_replay;

/* Entries of one record: n_v d_v + n_kq d_k + (KDA: n_v d_k; GDN: n_v rounded up to 128);
 * -1 when a count or dim is negative or past FW_MAX_HEADS / FW_MAX_HEAD_DIM. */
FW_API int64_t fw_gdn_replay_record_dim(int64_t n_kq, int64_t n_v, int64_t d_k, int64_t d_v, int kda);

/* fw_gdn_layer with ReplaySSM decodes (above); the same arguments and checks, and those of
 * replay. KDA when a is [T, n_v d_k], as in fw_gdn_layer. */
FW_API fw_status fw_gdn_layer_replay(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                                     const fw_tensor *conv_weight, const fw_tensor *conv_bias,
                                     const fw_tensor *a_log, const fw_tensor *dt_bias,
                                     const fw_gdn_batch *batch, const fw_gdn_caches *caches,
                                     const fw_gdn_replay *replay, const fw_tensor *out,
                                     const fw_gdn_layer_params *params);

/* Its float64 reference: per decode, the checkpoint and the committed records (as stored)
 * folded in double, the exact recurrence over its tokens, records stored in their dtype;
 * everything else as fw_gdn_layer_ref. */
FW_API fw_status fw_gdn_layer_replay_ref(const fw_tensor *qkv, const fw_tensor *b, const fw_tensor *a,
                                         const fw_tensor *conv_weight, const fw_tensor *conv_bias,
                                         const fw_tensor *a_log, const fw_tensor *dt_bias,
                                         const fw_gdn_batch *batch, const fw_gdn_caches *caches,
                                         const fw_gdn_replay *replay, const fw_tensor *out,
                                         const fw_gdn_layer_params *params);

/*
 * Speculative verify: n_i <= 64 tokens per sequence (cu_seqlens, as in prefill) from the
 * committed state in slot state_indices[i], which is read, not changed. Writes out for every
 * token and keeps, in the caller-owned `replay` buffer, what fw_gdn_commit needs to rebuild
 * the state after any number m <= n_i of accepted tokens: per token and value head the
 * written delta (dv floats) and the chunk-local log decay, and per token and q/k head the
 * normalised key (dk floats), after one float that tags the layout. Size it with
 * fw_gdn_replay_floats (1 + T x (HV x (dv + 1) + H x dk) floats). The buffer belongs to the
 * caller; the library keeps no state between the calls.
 */
FW_API size_t fw_gdn_replay_floats(int64_t T, int64_t H, int64_t HV, int64_t dk, int64_t dv);
/* The replay of a KDA verify (g [T, HV, dk]) keeps a decay per key channel:
 * 1 + T x (HV x (dv + dk) + H x dk) floats. */
FW_API size_t fw_kda_replay_floats(int64_t T, int64_t H, int64_t HV, int64_t dk, int64_t dv);
FW_API fw_status fw_gdn_verify(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                               const fw_tensor *g, const fw_tensor *beta,
                               const int32_t *cu_seqlens, int64_t n_seqs, const float *state,
                               int64_t slots, const int32_t *state_indices, float *replay,
                               size_t replay_floats, const fw_tensor *out,
                               const fw_gdn_params *params);
/* Commit accepted[i] (0 .. n_i) tokens of each sequence: slot state_indices[i] becomes exactly
 * the state after those tokens, from the committed state and the replay buffer of the verify
 * call with the same cu_seqlens, shapes and indices. */
FW_API fw_status fw_gdn_commit(const int32_t *cu_seqlens, int64_t n_seqs, const int32_t *accepted,
                               int64_t H, int64_t HV, int64_t dk, int64_t dv, float *state,
                               int64_t slots, const int32_t *state_indices, const float *replay,
                               size_t replay_floats, const fw_gdn_params *params);

/* Float64 reference: the plain recurrence, token by token, over a packed batch (arguments as
 * fw_gdn_prefill; out may be FW_F64). With bf16 products (params->precision, FW_PREC_AUTO
 * resolved as in the kernels, recurrent flags not set) it is instead the chunked pass in
 * double with the kernel's roundings and no others (docs/linear-attention.md, "Product
 * precision"); pass FW_PREC_F32 for the exact result of the given inputs. */
FW_API fw_status fw_gdn_ref(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v,
                            const fw_tensor *g, const fw_tensor *beta, const int32_t *cu_seqlens,
                            int64_t n_seqs, const float *initial_state, double *final_state,
                            const fw_tensor *out, const fw_gdn_params *params);

/* ------------------------------------------------------- causal conv1d -- */

#define FW_MAX_CONV_WIDTH 64 /* conv1d taps W: 1 .. FW_MAX_CONV_WIDTH */

/* Activations of fw_conv1d_fwd. */
typedef enum { FW_ACT_NONE = 0, FW_ACT_SILU = 1 } fw_activation;

typedef struct fw_conv1d_params {
    int32_t activation; /* fw_activation, applied after the bias */
    int32_t threads;    /* 0 = all online CPUs */
    const char *isa;    /* NULL = fw_isa_default() */
} fw_conv1d_params;

FW_API void fw_conv1d_params_init(fw_conv1d_params *p);

/* Conv states in slots: cache [slots, S, D] holds a sequence's last S raw inputs, oldest
 * first. idx (n_seqs entries, or NULL for slot i) picks each sequence's slot; a negative
 * index means none (read: a zero state; written: not written). offsets (n_seqs entries, or
 * NULL for 0) make a slot circular: its logical entry e lies at row (offsets[i] + e) mod S
 * (causal-conv1d's cache_seqlens: read at cache_seqlens, written at cache_seqlens + length). */
typedef struct fw_conv1d_state {
    fw_tensor cache;
    const int32_t *idx;
    const int32_t *offsets;
} fw_conv1d_state;

/*
 * Causal depthwise convolution over a batch of sequences, then bias, activation and residual:
 *   out[t][c] = act(bias[c] + sum_{k<W} weight[c][k] * x[t - (W-1) + k][c]) + residual[t][c]
 * where x before a sequence's first token is the sequence's initial state (its last W-1
 * entries) or zero.
 *   x, out, residual  [B, L, D]  f32 | bf16 | f16, any strides; residual may be NULL
 *   weight [D, W] (W = 1 .. FW_MAX_CONV_WIDTH), bias [D] or NULL: f32 | bf16 | f16
 *   cu_seqlens: NULL for B sequences of L tokens; else B = 1 and n_seqs sequences packed
 *   along L (int32, n_seqs + 1 entries from 0 to L, non-decreasing)
 *   init: the states sequences start from (S >= W-1), or NULL: zeros
 *   final: where each sequence's last S inputs go, the state entries before its first token
 *   taken from its initial state (zeros without one), or NULL. init and final may be the
 *   same cache (in place): then no sequence may read a slot another one writes.
 * Compute in f32; out is rounded once. For a bf16 or f16 out without a residual, SiLU's
 * exponential is taken to 2^-13.7 relative (below the output's rounding: 2^-9, 2^-11).
 * Outputs of 8 MiB and more are stored non-temporally (bypassing the cache). Inputs are
 * checked before anything is written: a refused call writes nothing. out must not overlap x,
 * residual or the caches.
 */
FW_API fw_status fw_conv1d_fwd(const fw_tensor *x, const fw_tensor *weight, const fw_tensor *bias,
                               const int32_t *cu_seqlens, int64_t n_seqs,
                               const fw_conv1d_state *init, const fw_conv1d_state *final,
                               const fw_tensor *residual, const fw_tensor *out,
                               const fw_conv1d_params *params);

/* Float64 reference of fw_conv1d_fwd, the same arguments (out and final's cache may be
 * FW_F64). */
FW_API fw_status fw_conv1d_ref(const fw_tensor *x, const fw_tensor *weight, const fw_tensor *bias,
                               const int32_t *cu_seqlens, int64_t n_seqs,
                               const fw_conv1d_state *init, const fw_conv1d_state *final,
                               const fw_tensor *residual, const fw_tensor *out,
                               const fw_conv1d_params *params);

/* ---------------------------------------------------------------- threads -- */

/*
 * Where a call's threads come from. A call splits its work into items and runs them on
 * params->threads workers (0: the default below), each with its own scratch; item i belongs
 * to worker i % threads, and a worker with none of its own left takes the others', so the
 * results are bit-identical for any thread count and any assignment of items to workers,
 * and a worker that starts late, or never, leaves its items to the others. The workers run
 * on one of:
 *   - the built-in pool (the default): threads that live between calls. After a job they
 *     spin for the spin window (below) so that calls in a loop find them awake, then sleep
 *     until the next call wakes them. A call that finds the pool in use by another call
 *     starts threads of its own.
 *   - OpenMP, in a library built with FW_OPENMP (cmake -DFW_OPENMP=ON, make build
 *     FW_OPENMP=1): each parallel loop is an `omp parallel` region of params->threads
 *     threads, worker omp_get_thread_num(), on the OpenMP runtime the library links (gcc:
 *     libgomp.so.1; in a torch process the loader keeps one copy of it for torch and the
 *     library, so both share one pool). Its threads wait and spin as OMP_WAIT_POLICY and
 *     GOMP_SPINCOUNT say. A call made inside a parallel region that cannot nest runs on the
 *     calling thread. In a forked child (libgomp cannot run regions there once its parent
 *     has) each call starts threads of its own.
 *   - the host's loop, set with fw_set_parallel (in either build).
 */

/* A host's parallel loop: run task(arg, t) once for every t in [0, ntasks), on the host's
 * threads, in any order and with any concurrency (even one after another on the calling
 * thread), and return when all of them have returned. The library hands it ntasks = the
 * call's thread count (min(threads, items)); task t is worker t, so two tasks with the same t
 * must never run at once. It never calls it with ntasks < 2: a call on one thread runs on the
 * calling thread. A task may itself call the library (a kernel called from the host's own
 * parallel code); then the host loop is entered again from inside a task, and the host must
 * allow that (run the tasks inline, as torch's at::parallel_for does when nested), or such
 * calls must pass params->threads = 1. */
typedef void (*fw_task_fn)(void *arg, int64_t t);
typedef void (*fw_parallel_fn)(void *host, int64_t ntasks, fw_task_fn task, void *arg);

/*
 * Process-wide: from now on, parallel loops run on fn(host, ...); fn = NULL (host NULL too)
 * goes back to the built-in threads (the pool, or OpenMP in an FW_OPENMP build).
 * threads: what params->threads = 0 means from now on, with or without a host loop: 1 to
 * 256 threads, or 0 for the library's own default, all online CPUs (in an FW_OPENMP build
 * omp_get_max_threads(), or 1 inside a parallel region that cannot nest). A host passes the
 * width of its pool (torch: at::get_num_threads()). The same default sizes the attention
 * workspace: fw_attn_workspace_size answers for the setting in force when it is asked.
 * Each parallel loop reads the setting once when it starts and finishes on the loop it read:
 * calls already running when this returns may still hand tasks to the previous loop, so a
 * host keeps its loop working until its calls into the library have returned. Safe to call
 * from any thread at any time. FW_ERR_ARG: a host without fn, or threads out of range
 * (nothing changes then).
 */
FW_API fw_status fw_set_parallel(fw_parallel_fn fn, void *host, int32_t threads);
/* The current setting (NULL, NULL, 0 until fw_set_parallel is called). FW_ERR_NULL if an
 * output pointer is NULL. */
FW_API fw_status fw_get_parallel(fw_parallel_fn *fn, void **host, int32_t *threads);

/* The built-in pool's spin window: how long, in microseconds, a worker keeps spinning for
 * the next job before it sleeps (never on the CPU its caller last ran on, where it would
 * only keep the caller off its CPU). 0 never spins: the cores go back to the host as soon as
 * a call returns, and each call pays for waking its workers (one futex wake-up each; the
 * caller meanwhile runs items, and never waits for a worker that has not woken up). The
 * default is 200, or the environment variable FLYWHEEL_SPIN_US (read once, at the first
 * call on the pool or to these two functions; a value that is not an integer in
 * [0, FW_MAX_SPIN_US] is ignored).
 * Workers use a new window from their next job on. It has no effect on OpenMP or on a host
 * loop. fw_set_spin_us: FW_ERR_ARG outside [0, FW_MAX_SPIN_US]. */
#define FW_MAX_SPIN_US 1000000
FW_API fw_status fw_set_spin_us(int32_t us);
FW_API int32_t fw_get_spin_us(void);

/* ------------------------------------------------------ machine benchmarks -- */

/* Measured single-precision FMA throughput of this machine in GFLOP/s (2 flops per FMA lane)
 * on `threads` threads at once, using the widest FMA the named table has (NULL = the widest
 * table this CPU runs). Runs for about `seconds`. */
FW_API fw_status fw_peak_gflops(const char *isa, int32_t threads, double seconds, double *gflops);

/* The same for bf16 pair products (vdpbf16ps on "avx512bf16": 4 flops per 32-bit lane; a
 * table without it measures its f32 emulation). This is the peak of FW_PREC_BF16 runs. */
FW_API fw_status fw_peak_bf16_gflops(const char *isa, int32_t threads, double seconds,
                                     double *gflops);

/* Measured streaming read bandwidth in GB/s (1e9 bytes/s) on `threads` threads at once, each
 * reading its share of a `bytes` buffer (much larger than the caches) with the widest table's
 * vector loads; the median of 5 passes. */
FW_API fw_status fw_read_bandwidth(int32_t threads, size_t bytes, double *gbps);

#ifdef __cplusplus
}
#endif
#endif /* FLYWHEEL_H */
