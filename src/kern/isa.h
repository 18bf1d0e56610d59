/*
 * kern/isa.h: the contract of the vector layer, the primitives every kernel file is written
 * over. Each ISA defines them in its isa_<isa>.h (portable, avx2, avx512, neon; the
 * avx512bf16 table is isa_avx512.h compiled with AVX512_BF16, neon_bf16 isa_neon.h compiled
 * with FEAT_BF16); kern/table.h includes this after it, so
 * the compiler checks every definition against the declarations below (a missing one fails
 * the link of any table that uses it, a different signature fails the build).
 *
 * Types: vf holds VL floats (the lanes); vw is a word operand of the bf16 products (below); vm
 * is a mask of VL lanes, made by the comparisons and consumed by vmand, vany, vall, vsel and
 * vmaskz only (its form is the ISA's: a lane vector on AVX2, a k register on AVX-512, an int
 * on the portable layer). A vf may also hold
 * VL 32-bit words, each two bf16 (the pair layout, kern/mm_kern.h): the even element in the
 * low half.
 *
 * Rounding: f32 arithmetic is IEEE round-to-nearest-even. vfma is fused (one rounding) on
 * the SIMD layers; the portable layer's a * b + c rounds twice unless the compiler fuses it,
 * and the tests hold each table to its own bar. Conversions to bf16 and f16 round to nearest
 * even and keep NaN a quiet NaN of the same sign. The bf16 products (vdpbf) sum exact
 * products in f32; a table may read bf16 denormals as zero there (vdpbf16ps and AMX do), and
 * may round each sum to odd instead of to nearest, flush f32 subnormal sums and give any NaN
 * the default NaN (Arm's BFDOT without FEAT_EBF16).
 *
 * May be emulated: everything may be built from narrower operations (the portable layer
 * builds all of it from scalars) as long as the results are the ones stated. Stated as
 * approximations, and free to differ between tables within their bounds: vexp2_to,
 * vdiv_half. All other primitives are exact or correctly rounded.
 *
 * Constants (macros) an ISA defines:
 *   ISA_NAME     the table's name
 *   VL           floats per vector: 1, 4, 8 or 16 so far; it must divide 16 and FW_DEC_KEYS
 *   TM, QK_TJ    mm's qk register tile: QK_TJ keys (at most 4) x TM vectors of query rows
 *                (x 2 sets)
 *   TJ           mm's pv register tile: TJ value columns x TM vectors (at most 6)
 *   DEC_RT       the decode's query rows per register tile
 *   PEAK_CHAINS  independent FMA chains of the peak microbenchmark (more than latency x pipes)
 * Optional: ISA_WORD_OPERAND with vw, vload_word and vdpbf_by (below); DEC_PV_EO with
 * vcols_to_eo / veo_to_cols (the decode's bf16 value rows as even and odd columns, where that
 * beats vpair_bits' order: AVX2); ISA_F8_BITS with vload_f8_bits (AVX-512: a table lookup);
 * DQ_NB, the decode's blocks of key rows side by side (attn/dec_kern.h; 1 unless said: NEON
 * 4); ISA_MMLA with vmmla, vzip_words, vzip_halves and
 * vload_halves (below), a 2x2 block product on VL 4 that mm's bf16 products and the bf16 peak
 * then run on (kern/mm_mmla.h: NEON with BF16, BFMMLA).
 */
#if !defined(ISA_NAME) || !defined(VL) || !defined(TM) || !defined(QK_TJ) || !defined(TJ) ||   \
    !defined(DEC_RT) || !defined(PEAK_CHAINS)
#error "the ISA header must define ISA_NAME, VL, TM, QK_TJ, TJ, DEC_RT and PEAK_CHAINS"
#endif
#if 16 % VL != 0
#error "VL must divide 16"
#endif

/* ---- lanes: loads and stores of f32 (unaligned), constants, keeping a value in a register */
static inline vf vload(const float *p);
static inline void vstore(float *p, vf x);
static inline vf vset1(float x);
static inline vf vzero(void);
/* x, held in a register: the compiler may not fold it into a memory operand of each use. */
static inline vf vkeep(vf x);

/* ---- arithmetic, lane by lane */
static inline vf vfma(vf a, vf b, vf c); /* a * b + c */
static inline vf vadd(vf a, vf b);
static inline vf vsub(vf a, vf b);
static inline vf vmul(vf a, vf b);
static inline vf vdiv(vf a, vf b);
/* a / b to 2^-14 relative or better, for results rounded to bf16 or f16 next. */
static inline vf vdiv_half(vf a, vf b);
/* max(a, b); where either is NaN the result is b. */
static inline vf vmax(vf a, vf b);
/* 2^x to about 2 ulp (half = 0), or to 2^-13.7 relative (half = 1, for results rounded to
 * bf16 or f16); +inf gives +inf, -inf and x below -150 give 0, NaN stays NaN. */
static inline vf vexp2_to(vf x, const int half);
static inline vf vexp2(vf x); /* vexp2_to(x, 0) */

/* ---- comparisons (ordered: false for NaN, except vnotlt, which is !(a < b)) and masks */
static inline vm vlt(vf a, vf b);
static inline vm vge(vf a, vf b);
static inline vm veq(vf a, vf b);
static inline vm vnotlt(vf a, vf b);
static inline vm vmand(vm a, vm b);
static inline int vany(vm m); /* some lane set */
static inline int vall(vm m); /* every lane set */
static inline vf vsel(vm m, vf a, vf b); /* m ? a : b */
static inline vf vmaskz(vm m, vf a);      /* m ? a : +0 */

/* ---- reductions and shuffles */
static inline float vhsum(vf x); /* the sum of the lanes (in the ISA's order) */
static inline float vhmax(vf x); /* the largest lane */
/* Lane i of the result: the sum of a[i]'s lanes, i < VL. */
static inline vf vsum_each(const vf *a);
/* r[0 .. VL-1] transposed in place (a VL x VL block). */
static inline void vtranspose(vf *r);
/* The lanes as R = min(VL, 4) rows of C = VL / R: lanes C r .. C r + C - 1 to dst + r ld. */
static inline void vstore_rows(float *dst, int64_t ld, vf t);

/* ---- dtypes: f32, bf16 and f16 elements (fw_dtype), and the 8-bit floats of KV caches */
/* VL elements of src from element i, as f32; exact for every input dtype. The 8-bit floats
 * may go through f16 bits: an e5m2 byte is the top byte of an f16, and an e4m3 byte s.e.m is
 * the f16 s.0e.m0000000 times 2^8 (its NaN, e.m all ones, set apart). */
static inline vf vload_in(const void *src, fw_dtype dt, int64_t i);
/* (float)(a[i + l] - b[i + l]), the differences in double (b NULL: zeros). */
static inline vf vload_dsub(const double *a, const double *b, int64_t i);
/* dst[i + l] = scale * src[i + l] as f32, l < VL. */
static inline void cvt_in_vec(const void *src, fw_dtype dt, int64_t i, float scale, float *dst);
/* x stored as dt at element i of dst, rounded to nearest even. */
static inline void vstore_as(void *dst, fw_dtype dt, int64_t i, vf x);
/* dst[i + l] = src[i + l] stored as dt. */
static inline void cvt_out_vec(const float *src, int64_t i, void *dst, fw_dtype dt);
/* vstore_as with a non-temporal store where the ISA has one (dst + i aligned to the vector's
 * bytes), ordered for other threads by vstream_fence; a plain store elsewhere. */
static inline void vstream_as(void *dst, fw_dtype dt, int64_t i, vf x);
static inline void vstream_fence(void);
/* Stores lo then hi (2 VL elements) as dt at element i in one operation and returns 1 where
 * the ISA has such a form for dt (streamed when nt); returns 0, storing nothing, elsewhere. */
static inline int vstore2_native(void *dst, fw_dtype dt, int64_t i, vf lo, vf hi, int nt);

/* ---- bf16 pairs: words of two bf16, the even element in the low half */
static inline vf vload_bits(const void *p);     /* VL words as raw bits */
static inline vf vbcast_word(const uint32_t *p); /* one word in every lane */
static inline vf vbf16_even(vf w);              /* each word's low bf16 as f32 */
static inline vf vbf16_odd(vf w);               /* each word's high bf16 as f32 */
/* acc + a.even b.even + a.odd b.odd per lane, the products exact. */
static inline vf vdpbf(vf acc, vf a, vf b);
/* A word operand (vw) and its product: vdpbf_by(acc, a, vload_word(p)) is vdpbf(acc, a,
 * vbcast_word(p)). A layer whose products multiply by element defines ISA_WORD_OPERAND, vw
 * (NEON with BF16: the word in one lane) and both; elsewhere the operand is the broadcast,
 * defined here once. */
#ifdef ISA_WORD_OPERAND
static inline vw vload_word(const uint32_t *p);
static inline vf vdpbf_by(vf acc, vf a, vw w);
#else
typedef vf vw;
static inline vw vload_word(const uint32_t *p) { return vbcast_word(p); }
static inline vf vdpbf_by(vf acc, vf a, vw w) { return vdpbf(acc, a, w); }
#endif
#ifdef ISA_MMLA
/* VL 4 as a 2x2 block of f32 (lanes r0c0 r0c1 r1c0 r1c1) and a and b as 2 rows of 2 words
 * each (lanes 0-1 row 0, lanes 2-3 row 1): acc[i][j] + the dot product of a's row i and b's
 * row j, as vdpbf over the first words of both rows, then over the second (BFMMLA). */
static inline vf vmmla(vf acc, vf a, vf b);
/* lo = (a0, b0, a1, b1), hi = (a2, b2, a3, b3): lane by lane (ZIP1 / ZIP2 of words). */
static inline void vzip_words(vf a, vf b, vf *lo, vf *hi);
/* lo = (a0, a1, b0, b1), hi = (a2, a3, b2, b3): halves (ZIP1 / ZIP2 of 64-bit elements). */
static inline void vzip_halves(vf a, vf b, vf *lo, vf *hi);
/* (p0[0], p0[1], p1[0], p1[1]): two words from each of two places. */
static inline vf vload_halves(const uint32_t *p0, const uint32_t *p1);
#endif
/* Words (even[l], odd[l]) rounded to bf16. */
static inline vf vbf16_pair(vf even, vf odd);
/* The 2 VL elements lo, hi of a row rounded to bf16, in order: word l = (x[2l], x[2l+1]). */
static inline vf vbf16_row(vf lo, vf hi);
/* Words (a[c], b[c]) of two rows' 2 VL bf16 each (as vload_bits reads a bf16 row: element c
 * of a in word c / 2, half c % 2) for 2 VL columns c, in an ISA's order that vcols_to_pairs
 * and vpairs_to_cols share (lo and hi hold the 2 VL columns between them). */
static inline void vpair_bits(vf a, vf b, vf *lo, vf *hi);
/* The same from two bf16 rows r0 and r1 in memory. */
static inline void vpair_rows_bf16(const uint16_t *r0, const uint16_t *r1, vf *lo, vf *hi)
{
    vpair_bits(vload_bits(r0), vload_bits(r1), lo, hi);
}
/* The 2 VL 8-bit floats (FW_F8E4M3, FW_F8E5M2) of src from element i as bf16, exact (every
 * value of both fits bf16; a NaN stays a NaN of its sign), in order: a bf16 row's 2 VL
 * elements as vload_bits reads them. A layer with a faster form than rounding vload_in's
 * defines ISA_F8_BITS and its own. */
#ifdef ISA_F8_BITS
static inline vf vload_f8_bits(const void *src, fw_dtype dt, int64_t i);
#else
static inline vf vload_f8_bits(const void *src, fw_dtype dt, int64_t i)
{
    return vbf16_row(vload_in(src, dt, i), vload_in(src, dt, i + VL));
}
#endif
/* 2 VL f32 columns of o in vpair_rows_bf16's order, and back. */
static inline void vcols_to_pairs(const float *o, vf *lo, vf *hi);
static inline void vpairs_to_cols(float *o, vf lo, vf hi);
#ifdef DEC_PV_EO
/* 2 VL f32 columns of o as the even and the odd ones, and back. */
static inline void vcols_to_eo(const float *o, vf *e, vf *od);
static inline void veo_to_cols(float *o, vf e, vf od);
#endif
