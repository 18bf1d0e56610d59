/* kern/mm_mmla.h: mm's bf16 products (pack_vw, panel_bytes, qk_bf16, pv_bf16) on a 2x2 block
 * product, for a layer that defines ISA_MMLA (kern/isa.h: NEON with BF16, whose BFMMLA issues
 * at BFDOT's rate with twice its products in llvm-mca's Neoverse V1, V2 and N2 models).
 * Included by kern/mm_kern.h in place of its pair-layout forms, with their contracts
 * (kern/kernels.h) and their bits: each output's sum runs over the same words in the same
 * order, and vmmla is two of vdpbf's steps.
 *
 * A block: acc (f32, lanes r0c0 r0c1 r1c0 r1c1) += A . B^T, A and B each 2 rows of 2 words.
 *   qk  A = keys j, j+1 at words w, w+1, from the K rows as they lie: 2 words of each row (one
 *       load and one insert an operand); B = query rows m, m+1 at words w, w+1, QW's rows w
 *       and w+1 zipped word by word, once for all the key tiles. Scores leave a tile as rows
 *       again (the halves of two blocks zipped).
 *   pv  A = value columns c, c+1 at keys 4u..4u+3, loaded as they lie from this table's
 *       panel; B = query rows m, m+1 at the same keys, PW's rows 2u and 2u+1 zipped.
 * The panel that pack_vw writes (VW), keys in blocks of 4, then columns in pairs:
 *   VW[u][p] = 8 bf16: V[4u..4u+3][2p], then V[4u..4u+3][2p+1]; u < ceil(n / 4),
 *   p < ceil(cols / 2), zero past n and past cols.
 * An odd last word: in qk a block whose second word is zero on both sides (that step adds +0
 * to a block's partial sum, which then goes into a total that started at +0: the same bits);
 * in pv on vdpbf (mv_word_last), its outputs' chains having no such total.
 * Register tiles: qk MQ_JP key pairs by MQ_MP query-row pairs (16 blocks, 64 outputs), pv
 * MV_CP value-column pairs by MV_MP query-row pairs (20 blocks, 80 outputs);
 * tools/mca_aarch64.py predicts their loops. */
_Static_assert(VL == 4, "a 2x2 block of f32 is one vector");
#define MQ_JP 2    /* qk: key pairs by query-row pairs, the queries' operands zipped once */
#define MQ_MP 8
#define MV_CP 5    /* pv: value-column pairs by MV_MP query-row pairs (<= MQ_MP), both loaded */
#define MV_MP 4
#define MV_WORDS 64 /* pv: P's operands zipped 64 words (128 keys) at a time, 4 KiB */

/* 4 bf16 rows of cols elements from X rows r0 .. r0 + 3 (rows past n zero), each padded with
 * zeros to a multiple of 8; f32 rows rounded as pack_row_pairs rounds them (its words are a
 * bf16 row in order). */
static void mmla_rows4(const void *X, fw_dtype dt, int n, int cols, int r0,
                       uint32_t (*rows)[(FW_MAX_HEAD_DIM + 8) / 2])
{
    const int cp = (cols + 7) / 8 * 8;
    for (int i = 0; i < 4; i++) {
        uint16_t *r = (uint16_t *)rows[i];
        int c = 0;
        if (r0 + i < n) {
            if (dt == FW_BF16)
                memcpy(r, (const uint16_t *)X + (size_t)(r0 + i) * cols, (size_t)cols * sizeof(uint16_t));
            else
                pack_row_pairs((const float *)X + (size_t)(r0 + i) * cols, cols, rows[i]);
            c = cols;
        }
        for (; c < cp; c++)
            r[c] = 0;
    }
}

/* VW (the panel above) from rows X [n][cols] of dtype dt (f32 or bf16), rounded to bf16. */
static void pack_vw(const void *X, fw_dtype dt, int n, int cols, uint32_t *VW)
{
    uint32_t rows[4][(FW_MAX_HEAD_DIM + 8) / 2];
    const uint16_t *r[4] = {(const uint16_t *)rows[0], (const uint16_t *)rows[1], (const uint16_t *)rows[2],
                            (const uint16_t *)rows[3]};
    const int ncp = (cols + 1) / 2;
    for (int u = 0; 4 * u < n; u++) {
        mmla_rows4(X, dt, n, cols, 4 * u, rows);
        uint32_t *dst = VW + (size_t)u * ncp * 4;
        int p = 0;
        for (; p + 4 <= ncp; p += 4) { /* 8 columns: the row pairs' words, zipped */
            vf a0, a1, b0, b1, lo, hi;
            vpair_rows_bf16(r[0] + 2 * p, r[1] + 2 * p, &a0, &a1);
            vpair_rows_bf16(r[2] + 2 * p, r[3] + 2 * p, &b0, &b1);
            vzip_words(a0, b0, &lo, &hi);
            vstore((float *)(dst + 4 * p), lo);
            vstore((float *)(dst + 4 * p + 4), hi);
            vzip_words(a1, b1, &lo, &hi);
            vstore((float *)(dst + 4 * p + 8), lo);
            vstore((float *)(dst + 4 * p + 12), hi);
        }
        for (; p < ncp; p++)
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 4; i++)
                    ((uint16_t *)(dst + 4 * p))[4 * h + i] = r[i][2 * p + h];
    }
}

/* ceil(red / 4) blocks of ceil(cols / 2) pairs of 4 words: the panel above, and no less than
 * the pair layout of the other panels (ceil(red / 2) x cols words). */
static size_t panel_bytes(int red, int cols)
{
    return (size_t)((red + 3) / 4) * (size_t)((cols + 1) / 2) * 4 * sizeof(uint32_t);
}

/* The B operands of query rows m0 .. m0 + 2 mp - 1 (mp <= MQ_MP) at words [w0, w0 + wn): QZ[s][m] =
 * query pair m at words w0 + 2s and the next (an odd last word with a zero partner), zipped
 * once for all the tiles that read them. */
static void mmla_zip_rows(int mp, int w0, int wn, int M, const uint32_t *QW, vf *QZ)
{
    for (int s = 0; 2 * s < wn; s++) {
        const uint32_t *r = QW + (int64_t)(w0 + 2 * s) * M;
        for (int m = 0; m < mp; m += 2)
            vzip_words(vload_bits(r + 2 * m), 2 * s + 1 < wn ? vload_bits(r + M + 2 * m) : vzero(),
                       &QZ[s * MQ_MP + m], &QZ[s * MQ_MP + m + 1]);
    }
}

/* Words [w0, we) of a tile's blocks, we - w0 even: K rows kr[2 jp] (a row stands in past nk),
 * the queries' operands QZ (from word 0). A key pair's operand is 2 words of each row, one
 * load and one insert (2 of every 18 instructions on the FMA pipes): each accumulator is
 * updated once a step (GCC 12 moved accumulators between registers in a loop that updated
 * them twice). */
FW_INLINE void mq_words(const int jp, const int mp, int w0, int we, const uint32_t *const *kr, const vf *QZ,
                        vf acc[MQ_JP][MQ_MP])
{
    for (int w = w0; w < we; w += 2) {
        const vf *b = QZ + (w / 2) * MQ_MP;
        for (int j = 0; j < jp; j++) {
            const vf a = vload_halves(kr[2 * j] + w, kr[2 * j + 1] + w);
            for (int m = 0; m < mp; m++)
                acc[j][m] = vmmla(acc[j][m], a, b[m]);
        }
    }
}

/* An odd last word w, with a zero partner. */
static __attribute__((noinline)) void mq_word_last(int jp, int mp, int w, const uint32_t *const *kr,
                                                   const vf *QZ, vf acc[MQ_JP][MQ_MP])
{
    for (int j = 0; j < jp; j++) {
        const uint32_t t[4] = {kr[2 * j][w], 0, kr[2 * j + 1][w], 0};
        const vf a = vload_bits(t);
        for (int m = 0; m < mp; m++)
            acc[j][m] = vmmla(acc[j][m], a, QZ[(w / 2) * MQ_MP + m]);
    }
}

/* One register tile: keys j0 .. j0 + nj - 1 (nj <= 2 jp) by 2 mp query rows. */
FW_INLINE void mq_tile(const int jp, const int mp, int nj, int dw, int M, const uint32_t *K, int64_t ldkw,
                       const vf *QZ, float scale, const float *bias, float *ST)
{
    const uint32_t *kr[2 * MQ_JP];
    for (int j = 0; j < 2 * jp; j++)
        kr[j] = K + (j < nj ? j : 0) * ldkw;
    vf tot[MQ_JP][MQ_MP], acc[MQ_JP][MQ_MP];
    for (int j = 0; j < jp; j++)
        for (int m = 0; m < mp; m++)
            tot[j][m] = vzero();
    /* two-level sum over blocks of QK_KB words, as in mm_kern.h's qkb_tile */
    for (int w0 = 0; w0 < dw; w0 += QK_KB) {
        for (int j = 0; j < jp; j++)
            for (int m = 0; m < mp; m++)
                acc[j][m] = vzero();
        const int we = dw - w0 < QK_KB ? dw : w0 + QK_KB;
        mq_words(jp, mp, w0, we & ~1, kr, QZ, acc);
        if (we & 1)
            mq_word_last(jp, mp, we - 1, kr, QZ, acc);
        for (int j = 0; j < jp; j++)
            for (int m = 0; m < mp; m++)
                tot[j][m] = vadd(tot[j][m], acc[j][m]);
    }
    const vf sc = vset1(scale);
    for (int m = 0; m < mp; m += 2) {
        const vf bb = vload(bias + 2 * m);
        for (int j = 0; j < jp; j++) {
            vf r0, r1;
            vzip_halves(tot[j][m], tot[j][m + 1], &r0, &r1);
            vstore(ST + (int64_t)(2 * j) * M + 2 * m, vfma(r0, sc, bb));
            if (2 * j + 1 < nj)
                vstore(ST + (int64_t)(2 * j + 1) * M + 2 * m, vfma(r1, sc, bb));
        }
    }
}

static __attribute__((noinline)) void mq_tile_tail(int jp, int mp, int nj, int dw, int M, const uint32_t *K,
                                                   int64_t ldkw, const vf *QZ, float scale, const float *bias,
                                                   float *ST)
{
    mq_tile(jp, mp, nj, dw, M, K, ldkw, QZ, scale, bias, ST);
}

/* ST[j][m] = bias[m] + scale * sum_w dot(K[j] word w, QW[w][m]), j < nk, m < M; dw <=
 * FW_MAX_HEAD_DIM / 2 (QZ: 32 KiB of stack). */
static void qk_bf16(int nk, int dw, int M, const uint32_t *K, int64_t ldkw, const uint32_t *QW,
                    float scale, const float *bias, float *ST)
{
    vf QZ[FW_MAX_HEAD_DIM / 4 * MQ_MP];
    for (int m0 = 0; m0 < M; m0 += 2 * MQ_MP) {
        const int mp = M - m0 < 2 * MQ_MP ? (M - m0) / 2 : MQ_MP;
        mmla_zip_rows(mp, 0, dw, M, QW + m0, QZ);
        for (int j0 = 0; j0 < nk; j0 += 2 * MQ_JP) {
            const int nj = nk - j0 < 2 * MQ_JP ? nk - j0 : 2 * MQ_JP;
            const uint32_t *Kj = K + j0 * ldkw;
            float *S = ST + (int64_t)j0 * M + m0;
            if (mp == MQ_MP && nj == 2 * MQ_JP)
                mq_tile(MQ_JP, MQ_MP, nj, dw, M, Kj, ldkw, QZ, scale, bias + m0, S);
            else
                mq_tile_tail((nj + 1) / 2, mp, nj, dw, M, Kj, ldkw, QZ, scale, bias + m0, S);
        }
    }
}

/* An odd last word of P (its row pl at the tile's query rows) by the panel's block v, whose
 * second word is zero, on vdpbf as mm_kern.h's pvb_tile adds it (a zero second step would
 * make a -0 sum +0): lanes (c, m), (c, m + 1), (c + 1, m), (c + 1, m + 1) of each block. */
static __attribute__((noinline)) void mv_word_last(int cp, int mp, const uint32_t *v, const uint32_t *pl,
                                                   vf acc[MV_CP][MQ_MP])
{
    vf b[MQ_MP];
    for (int m = 0; m < mp; m += 2) {
        const vf x = vload_bits(pl + 2 * m);
        vzip_halves(x, x, &b[m], &b[m + 1]); /* (P m, P m+1) twice */
    }
    for (int c = 0; c < cp; c++) {
        vf lo, hi, a, rest;
        const vf x = vload_bits(v + 4 * c);
        vzip_words(x, x, &lo, &hi);
        vzip_halves(lo, hi, &a, &rest); /* (V c, V c, V c+1, V c+1) */
        for (int m = 0; m < mp; m++)
            acc[c][m] = vdpbf(acc[c][m], a, b[m]);
    }
}

/* One register tile: value columns c0 .. c0 + nc - 1 (nc <= 2 cp) by 2 mp query rows, words
 * [w0, w0 + wn) (w0 even): the panel's blocks from w0 / 2, P's operands PZ (and P's rows PW,
 * for an odd last word). */
FW_INLINE void mv_tile(const int cp, const int mp, int nc, int w0, int wn, int M, const uint32_t *VW, int ncp,
                       const vf *PZ, const uint32_t *PW, float *OT)
{
    vf acc[MV_CP][MQ_MP];
    for (int c = 0; c < cp; c++)
        for (int m = 0; m < mp; m += 2)
            vzip_halves(vload(OT + (int64_t)(2 * c) * M + 2 * m),
                        2 * c + 1 < nc ? vload(OT + (int64_t)(2 * c + 1) * M + 2 * m) : vzero(), &acc[c][m],
                        &acc[c][m + 1]);
    for (int s = 0; 2 * s + 1 < wn; s++) { /* keys 2 w0 + 4s .. + 3: block w0 / 2 + s of the panel */
        const uint32_t *v = VW + (size_t)(w0 / 2 + s) * ncp * 4;
        for (int c = 0; c < cp; c++) {
            const vf a = vload_bits(v + 4 * c);
            for (int m = 0; m < mp; m++)
                acc[c][m] = vmmla(acc[c][m], a, PZ[s * MQ_MP + m]);
        }
    }
    if (wn & 1)
        mv_word_last(cp, mp, VW + (size_t)(w0 / 2 + wn / 2) * ncp * 4, PW + (int64_t)(w0 + wn - 1) * M, acc);
    for (int c = 0; c < cp; c++)
        for (int m = 0; m < mp; m += 2) {
            vf r0, r1;
            vzip_halves(acc[c][m], acc[c][m + 1], &r0, &r1);
            vstore(OT + (int64_t)(2 * c) * M + 2 * m, r0);
            if (2 * c + 1 < nc)
                vstore(OT + (int64_t)(2 * c + 1) * M + 2 * m, r1);
        }
}

static __attribute__((noinline)) void mv_tile_tail(int cp, int mp, int nc, int w0, int wn, int M,
                                                   const uint32_t *VW, int ncp, const vf *PZ, const uint32_t *PW,
                                                   float *OT)
{
    mv_tile(cp, mp, nc, w0, wn, M, VW, ncp, PZ, PW, OT);
}

/* OT[c][m] += sum_w dot(VW's words w of column c, PW[w][m]), c < dv, m < M, over nw words. P's
 * operands are zipped for MV_WORDS words at a time, then every column tile reads them (the
 * accumulators go through OT between chunks: the same bits). */
static void pv_bf16(int nw, int dv, int M, const uint32_t *VW, const uint32_t *PW, float *OT)
{
    vf PZ[MV_WORDS / 2 * MQ_MP];
    const int ncp = (dv + 1) / 2;
    for (int m0 = 0; m0 < M; m0 += 2 * MV_MP) {
        const int mp = M - m0 < 2 * MV_MP ? (M - m0) / 2 : MV_MP;
        for (int w0 = 0; w0 < nw; w0 += MV_WORDS) {
            const int wn = nw - w0 < MV_WORDS ? nw - w0 : MV_WORDS;
            mmla_zip_rows(mp, w0, wn & ~1, M, PW + m0, PZ);
            for (int c0 = 0; c0 < dv; c0 += 2 * MV_CP) {
                const int nc = dv - c0 < 2 * MV_CP ? dv - c0 : 2 * MV_CP;
                const uint32_t *V = VW + (size_t)(c0 / 2) * 4;
                float *O = OT + (int64_t)c0 * M + m0;
                if (mp == MV_MP && nc == 2 * MV_CP)
                    mv_tile(MV_CP, MV_MP, nc, w0, wn, M, V, ncp, PZ, PW + m0, O);
                else if (mp == MV_MP && nc == 8) /* the end of a head dim that is a multiple of 8 */
                    mv_tile(4, MV_MP, nc, w0, wn, M, V, ncp, PZ, PW + m0, O);
                else
                    mv_tile_tail((nc + 1) / 2, mp, nc, w0, wn, M, V, ncp, PZ, PW + m0, O);
            }
        }
    }
}
