/* internal.h: what the drivers and the per-ISA kernel tables share. Not installed. */
#ifndef FW_INTERNAL_H
#define FW_INTERNAL_H

#include <math.h>
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

/* log2(e) and ln(2): the kernels compute exponentials as powers of 2 */
#define FW_LOG2E 1.4426950408889634
#define FW_LN2 0.6931471805599453

/* Whether a call with q of dtype `q` and params->precision `precision` on the kernel table
 * named `isa` (NULL: the default) uses bf16 products: when asked, or by default for bf16 q on
 * a table with a native bf16 dot product. The other tables emulate the pair products with
 * f32 FMAs plus the bit work to split the pairs, which is slower than f32 products on the
 * same bf16 inputs (measured on a Zen 1, avx2: attention 0.74x, GDN prefill 0.77x) and less
 * accurate, so their default is f32 products. Attention, GDN and KDA and the references
 * all resolve it here. */
int fw_bf16_products(const char *isa, fw_dtype q, int32_t precision);

/* The input dtypes the drivers take (a mask of 1 << fw_dtype, for fw_check_tensor). */
#define FW_DT_IN ((1u << FW_F32) | (1u << FW_BF16) | (1u << FW_F16))
/* The 8-bit floats, which only KV caches take. */
#define FW_DT_F8 ((1u << FW_F8E4M3) | (1u << FW_F8E5M2))
static inline int fw_is_f8(fw_dtype dt) { return (int)((FW_DT_F8 >> dt) & 1u); }

/* Record a formatted message for fw_last_error() and return `s`. */
fw_status fw_fail(fw_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void fw_clear_error(void);

#include "kern/kernels.h"

/* fw_bf16_products' rule on a table already looked up (NULL: none, so no native bf16). */
int fw_kernels_bf16_products(const fw_kernels *kt, fw_dtype q, int32_t precision);

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
 * measured (conv/conv_kern.h, CONV_PASS_ROWS); Zen 5 ran this conv at 84-104% of a same-run copy a
 * row at a time, before the sliding kernel existed. On a Zen 4 VM (AVX-512, 2026-12-03) the
 * two ran level: 4.9-6.8 ms either way, 2 threads, three alternating runs; a row at a time
 * then gained a prefetch ahead, streamed stores and two rows a step (3.0-3.3 ms; conv/conv_kern.h,
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

/* 8-bit floats (FW_F8E4M3, FW_F8E5M2) to f32, exact. e5m2 is the top byte of an f16; e4m3's
 * byte s.eeee.mmm is 2^(e-7) x 1.mmm (e > 0) or 2^-6 x 0.mmm, and NaN at eeee.mmm = 1111.111. */
static inline float fw_cvt_f8_f32(uint8_t b, fw_dtype dt)
{
    if (dt == FW_F8E5M2)
        return fw_cvt_f16_f32((uint16_t)(b << 8));
    const int e = (b >> 3) & 15, m = b & 7;
    const float a = e == 15 && m == 7 ? NAN : e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    return b & 0x80 ? -a : a;
}

/* f32 to an 8-bit float, to nearest even, saturating at the largest finite value (inf
 * included); NaN stays NaN (e4m3's only NaN, e5m2's quiet one). */
static inline uint8_t fw_cvt_f32_f8(float x, fw_dtype dt)
{
    const int e5 = dt == FW_F8E5M2, mbits = e5 ? 2 : 3, emin = e5 ? -14 : -6;
    const float top = e5 ? 57344.0f : 448.0f;
    const uint8_t sign = (uint8_t)((fw_f2u(x) >> 24) & 0x80);
    if (x != x)
        return (uint8_t)(sign | (e5 ? 0x7e : 0x7f));
    float a = fabsf(x);
    if (!(a < top))
        a = top; /* (inf too) */
    int ex;
    frexpf(a, &ex); /* a = f 2^ex, f in [0.5, 1): a's exponent is ex - 1 */
    const int ue = a == 0.0f || ex - 1 < emin ? emin : ex - 1;
    const float r = rintf(ldexpf(a, mbits - ue)); /* in units of 2^(ue - mbits); a <= top keeps it finite */
    /* r < 2^mbits: a subnormal (its units are the subnormals'); else 1.m, or 2.0 when the
     * rounding carried into the next binade, which the addition carries into the exponent field
     * (ue - emin + 1, the bias being 1 - emin) */
    const uint32_t code = r < (float)(1 << mbits) ? (uint32_t)r
                                                  : ((uint32_t)(ue - emin + 1) << mbits) + ((uint32_t)r - (1u << mbits));
    return (uint8_t)(sign | code);
}

/* Bytes of one element of dt (the kernels' form of fw_dtype_size). */
static inline size_t fw_esize(fw_dtype dt)
{
    return dt == FW_F32 ? 4 : dt == FW_F64 ? 8 : dt >= FW_F8E4M3 ? 1 : 2;
}

/* One element of dtype dt (f32, bf16, f16, or an 8-bit float) at index i of p, as f32. */
static inline float fw_load_elem(const void *p, fw_dtype dt, int64_t i)
{
    return dt == FW_F32 ? ((const float *)p)[i]
           : dt == FW_BF16 ? fw_cvt_bf16_f32(((const uint16_t *)p)[i])
           : dt == FW_F16 ? fw_cvt_f16_f32(((const uint16_t *)p)[i])
                          : fw_cvt_f8_f32(((const uint8_t *)p)[i], dt);
}

static inline double fw_load_f64(const fw_tensor *t, int64_t off)
{
    const char *b = t->data;
    switch (t->dtype) {
    case FW_F32: return ((const float *)b)[off];
    case FW_BF16: return fw_cvt_bf16_f32(((const uint16_t *)b)[off]);
    case FW_F16: return fw_cvt_f16_f32(((const uint16_t *)b)[off]);
    case FW_F64: return ((const double *)b)[off];
    case FW_F8E4M3: case FW_F8E5M2: return fw_cvt_f8_f32(((const uint8_t *)b)[off], t->dtype);
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
    case FW_F8E4M3: case FW_F8E5M2: ((uint8_t *)b)[off] = fw_cvt_f32_f8((float)x, t->dtype); break;
    }
}

#endif /* FW_INTERNAL_H */
