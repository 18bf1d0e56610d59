/*
 * fuzz_diff.c: differential harness. One ragged attention problem (sequences of sq_i queries
 * over sk_i >= sq_i keys, bottom-right aligned) goes through every path that can express it:
 *   dense      fw_attn_fwd on each sequence alone;
 *   varlen     fw_attn_varlen_fwd on the packed batch;
 *   cache      fw_attn_kvcache_fwd on a contiguous cache holding the first sk_i - sq_i keys,
 *              appending the last sq_i (k_new, v_new);
 *   paged      the same on paged caches of two page sizes, pages in shuffled order;
 *   held       fw_attn_kvcache_fwd with every key already in the cache (no append).
 * Every result must be within the accuracy bar of the float64 reference (fuzz_util.h), and
 * bit-identical where docs/design.md promises it: any thread count on every path (1 vs 3), and
 * paged and contiguous caches holding the same data, whatever the page size. Inputs are
 * moderate or special (NaN / inf), in one dtype, contiguous.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "attn/attn.h"
#include "fuzz_util.h"
#include "test_util.h"

#define MAXB 6
static const fw_dtype dts[3] = {FW_F32, FW_BF16, FW_F16};

typedef struct {
    void *o;
    float *l;
} result;

static void bits_equal(const char *a, const char *b, const result *x, const result *y, size_t ob, size_t lb)
{
    FZ_CHECK(!memcmp(x->o, y->o, ob) && !memcmp(x->l, y->l, lb), "%s and %s differ in bits", a, b);
}

/* A cache [pages or B, rows, hkv, width] holding, for each sequence, `held` of its packed rows
 * (src, rows cuk[i] ..) at its positions 0 .. held-1 (block table bt with `mp` columns, or
 * contiguous when bt is NULL). */
static void *fill_cache(const void *src, size_t es, int64_t width, int64_t hkv, const int32_t *cuk,
                        const int32_t *held, int64_t B, int64_t nslots, int64_t rows, const int32_t *bt,
                        int64_t mp)
{
    const size_t row = (size_t)(hkv * width) * es;
    unsigned char *c = calloc((size_t)(nslots * rows) * row + 1, 1);
    for (int64_t i = 0; i < B; i++)
        for (int64_t t = 0; t < held[i]; t++) {
            int64_t slot = bt ? bt[i * mp + t / rows] : i, r = bt ? t % rows : t;
            memcpy(c + (size_t)(slot * rows + r) * row, (const char *)src + (size_t)(cuk[i] + t) * row, row);
        }
    return c;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size, 0};
    fw_dtype dt = dts[fz_range(&in, 0, 2)], odt = dts[fz_range(&in, 0, 2)];
    const size_t es = fw_dtype_size(dt), oes = fw_dtype_size(odt);
    int64_t hkv = 1 + fz_range(&in, 0, 2), G = 1 + fz_range(&in, 0, 3), hq = hkv * G;
    int64_t d = 1 + fz_size(&in, 15, 140), dv = fz_chance(&in, 160) ? d : 1 + fz_size(&in, 15, 140);
    int64_t B = 1 + fz_size(&in, 3, MAXB - 1);
    int32_t cuq[MAXB + 1] = {0}, cuk[MAXB + 1] = {0}, old[MAXB], all[MAXB];
    for (int64_t i = 0; i < B; i++) {
        int64_t sq = fz_chance(&in, 100) ? 1 : fz_size(&in, 8, 80);
        int64_t pre = fz_chance(&in, 16) ? fz_range(&in, 0, 1100) : fz_size(&in, 40, 200);
        cuq[i + 1] = cuq[i] + (int32_t)sq;
        cuk[i + 1] = cuk[i] + (int32_t)(sq + pre);
        old[i] = (int32_t)pre;
        all[i] = (int32_t)(sq + pre);
    }
    const int64_t tq = cuq[B], tk = cuk[B];
    if (tk * hq * (d + dv) > (1 << 20))
        d = dv = 1 + d % 8; /* keeps an execution under a few milliseconds */
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.causal = fz_chance(&in, 192);
    if (fz_chance(&in, 40))
        p.window_left = fz_range(&in, 0, 300);
    if (!p.causal && fz_chance(&in, 40))
        p.window_right = fz_range(&in, 0, 40);
    if (fz_chance(&in, 24))
        p.softcap = (float)fz_range(&in, 1, 100) / 4.0f;
    p.isa = fz_isa(&in);
    p.flags = fz_byte(&in) & 7; /* techniques; the plain kernel has no decode or cache path */
    p.precision = (int32_t)fz_range(&in, 0, 2);
    const int special = fz_chance(&in, 24);
    fz_seed(&in);

    int64_t qs[3] = {tq, hq, d}, ks[3] = {tk, hkv, d}, vs[3] = {tk, hkv, dv}, os[3] = {tq, hq, dv}, ls[2] = {hq, tq};
    void *q = malloc((size_t)(tq * hq * d) * es + 1), *k = malloc((size_t)(tk * hkv * d) * es + 1),
         *v = malloc((size_t)(tk * hkv * dv) * es + 1);
    fw_tensor tq_ = fw_tensor_contiguous(q, dt, 3, qs), tk_ = fw_tensor_contiguous(k, dt, 3, ks),
              tv_ = fw_tensor_contiguous(v, dt, 3, vs);
    int64_t idx[3] = {0};
    const double a = 2 * 1.7320508075688772;
    if (tq) do tset(&tq_, idx, a * (rng_uniform() - 0.5)); while (tnext(&tq_, idx));
    if (tk) do tset(&tk_, idx, a * (rng_uniform() - 0.5)); while (tnext(&tk_, idx));
    if (tk) do tset(&tv_, idx, a * (rng_uniform() - 0.5)); while (tnext(&tv_, idx));
    if (special && tk) { /* a NaN or inf in one q, k or v element */
        static const double sv[3] = {NAN, INFINITY, -INFINITY};
        const fw_tensor *t = fz_chance(&in, 85) ? &tq_ : fz_chance(&in, 128) ? &tk_ : &tv_;
        int64_t e[3] = {fz_range(&in, 0, t->shape[0] - 1), fz_range(&in, 0, t->shape[1] - 1), fz_range(&in, 0, t->shape[2] - 1)};
        if (t->shape[0])
            tset(t, e, sv[fz_range(&in, 0, 2)]);
    }

    fz_desc[0] = 0;
    fz_describe("diff %s->%s B %lld hq %lld hkv %lld d %lld dv %lld causal %d window %lld,%lld softcap %g isa %s "
                "flags %u precision %d special %d", fw_dtype_name(dt), fw_dtype_name(odt), (long long)B,
                (long long)hq, (long long)hkv, (long long)d, (long long)dv, (int)p.causal,
                (long long)p.window_left, (long long)p.window_right, (double)p.softcap,
                p.isa ? p.isa : "default", (unsigned)p.flags, (int)p.precision, special);
    for (int64_t i = 0; i < B; i++)
        fz_describe("%s(%d of %d)", i ? " " : "\n  seqs ", (int)(cuq[i + 1] - cuq[i]), (int)all[i]);

    /* the references */
    const int64_t no = tq * hq * dv, nl = hq * tq;
    double *ex = calloc((size_t)(no + nl) + 1, 8), *sr = calloc((size_t)(no + nl) + 1, 8);
    fw_tensor eo = fw_tensor_contiguous(ex, FW_F64, 3, os), el = fw_tensor_contiguous(ex + no, FW_F64, 2, ls);
    fw_tensor ro = fw_tensor_contiguous(sr, FW_F64, 3, os), rl = fw_tensor_contiguous(sr + no, FW_F64, 2, ls);
    fw_attn_params rp = p;
    rp.precision = FW_PREC_F32;
    FZ_CHECK(fw_attn_varlen_ref(&tq_, &tk_, &tv_, cuq, cuk, B, &eo, &el, &rp, 0, INT64_MAX) == FW_OK,
             "reference: %s", fw_last_error());
    const int bf16 = fw_bf16_products(p.isa, dt, p.precision);
    if (bf16) {
        rp.precision = FW_PREC_BF16;
        FZ_CHECK(fw_attn_varlen_ref(&tq_, &tk_, &tv_, cuq, cuk, B, &ro, &rl, &rp, 0, INT64_MAX) == FW_OK,
                 "reference: %s", fw_last_error());
    } else {
        memcpy(sr, ex, (size_t)(no + nl) * 8);
    }
    /* uniform values of std 1 are at most sqrt(3) */
    const double vmax = a / 2, smax = p.softcap > 0 ? p.softcap : vmax * vmax * sqrt((double)d);
    const double oslack = vmax * (2 * fz_eps(odt) + 1e-4 + 8 * smax * 0x1p-23 + (bf16 ? 0x1p-8 : 0));
    const double lslack = fz_lse_slack(ex + no, nl, smax);

    /* the paths: [0] varlen 1 thread, [1] varlen 3, [2] dense, [3] cache 1, [4] cache 3,
     * [5] paged (small pages), [6] paged (large pages), [7] held */
    enum { NP = 8 };
    static const char *names[NP] = {"varlen (1 thread)", "varlen (3 threads)", "dense", "cache (1 thread)",
                                    "cache (3 threads)", "paged", "paged (other page size)", "held"};
    result r[NP];
    for (int j = 0; j < NP; j++) {
        r[j].o = malloc((size_t)no * oes + 1);
        r[j].l = malloc((size_t)nl * 4 + 4);
        memset(r[j].o, 0xA5, (size_t)no * oes);
        memset(r[j].l, 0xA5, (size_t)nl * 4);
    }
    fw_status st;
    for (int j = 0; j < 2; j++) {
        fw_tensor to = fw_tensor_contiguous(r[j].o, odt, 3, os), tl = fw_tensor_contiguous(r[j].l, FW_F32, 2, ls);
        p.threads = j ? 3 : 1;
        st = fw_attn_varlen_fwd(&tq_, &tk_, &tv_, cuq, cuk, B, &to, &tl, &p);
        FZ_CHECK(st == FW_OK, "%s: %s", names[j], fw_last_error());
    }
    /* dense, one sequence at a time; lse [1, hq, sq] lands in the packed [hq, tq] by strides */
    for (int64_t i = 0; i < B; i++) {
        int64_t sq = cuq[i + 1] - cuq[i], sk = all[i];
        int64_t q4[4] = {1, sq, hq, d}, k4[4] = {1, sk, hkv, d}, v4[4] = {1, sk, hkv, dv}, o4[4] = {1, sq, hq, dv};
        fw_tensor a4 = fw_tensor_contiguous((char *)q + (size_t)(cuq[i] * hq * d) * es, dt, 4, q4);
        fw_tensor b4 = fw_tensor_contiguous((char *)k + (size_t)(cuk[i] * hkv * d) * es, dt, 4, k4);
        fw_tensor c4 = fw_tensor_contiguous((char *)v + (size_t)(cuk[i] * hkv * dv) * es, dt, 4, v4);
        fw_tensor d4 = fw_tensor_contiguous((char *)r[2].o + (size_t)(cuq[i] * hq * dv) * oes, odt, 4, o4);
        fw_tensor l3 = {r[2].l + cuq[i], FW_F32, 3, {1, hq, sq}, {0, tq, 1}};
        p.threads = 2;
        st = fw_attn_fwd(&a4, &b4, &c4, &d4, &l3, &p);
        FZ_CHECK(st == FW_OK, "dense, sequence %lld: %s", (long long)i, fw_last_error());
    }
    /* caches: the new rows of sequence i are its last sq_i keys */
    int64_t kns[3] = {tq, hkv, d}, vns[3] = {tq, hkv, dv};
    void *kn = malloc((size_t)(tq * hkv * d) * es + 1), *vn = malloc((size_t)(tq * hkv * dv) * es + 1);
    for (int64_t i = 0; i < B; i++) {
        int64_t sq = cuq[i + 1] - cuq[i];
        memcpy((char *)kn + (size_t)(cuq[i] * hkv * d) * es, (char *)k + (size_t)((cuk[i] + old[i]) * hkv * d) * es, (size_t)(sq * hkv * d) * es);
        memcpy((char *)vn + (size_t)(cuq[i] * hkv * dv) * es, (char *)v + (size_t)((cuk[i] + old[i]) * hkv * dv) * es, (size_t)(sq * hkv * dv) * es);
    }
    fw_tensor tkn = fw_tensor_contiguous(kn, dt, 3, kns), tvn = fw_tensor_contiguous(vn, dt, 3, vns);
    int64_t S = 0;
    for (int64_t i = 0; i < B; i++)
        S = fw_max64(S, all[i]);
    const int64_t psz[2] = {(int64_t)8 << fz_range(&in, 0, 2), (int64_t)64 << fz_range(&in, 0, 2)};
    for (int j = 3; j < NP; j++) {
        const int paged = j == 5 || j == 6, held = j == 7;
        const int64_t ps = paged ? psz[j - 5] : S;
        int64_t mp = 1, npages = B;
        int32_t *bt = NULL;
        if (paged) {
            npages = 0;
            for (int64_t i = 0; i < B; i++) {
                mp = fw_max64(mp, (all[i] + ps - 1) / ps);
                npages += (all[i] + ps - 1) / ps;
            }
            bt = malloc((size_t)(B * mp) * 4 + 4);
            int32_t *perm = malloc((size_t)npages * 4 + 4);
            for (int64_t x = 0; x < npages; x++)
                perm[x] = (int32_t)x;
            for (int64_t x = npages - 1; x > 0; x--) {
                int64_t y = (int64_t)(rng_uniform() * (double)(x + 1));
                int32_t t = perm[x]; perm[x] = perm[y]; perm[y] = t;
            }
            for (int64_t i = 0, nx = 0; i < B; i++)
                for (int64_t pg = 0; pg < mp; pg++)
                    bt[i * mp + pg] = pg < (all[i] + ps - 1) / ps ? perm[nx++] : -1;
            free(perm);
            npages = fw_max64(npages, 1);
        }
        const int32_t *have = held ? all : old;
        void *ck = fill_cache(k, es, d, hkv, cuk, have, B, npages, ps, bt, mp);
        void *cv = fill_cache(v, es, dv, hkv, cuk, have, B, npages, ps, bt, mp);
        int64_t cks[4] = {npages, ps, hkv, d}, cvs[4] = {npages, ps, hkv, dv};
        fw_kv_cache cache = {fw_tensor_contiguous(ck, dt, 4, cks), fw_tensor_contiguous(cv, dt, 4, cvs), bt, mp, 0,
                             have, NULL, NULL, FW_KV_ROWS, NULL, NULL};
        fw_tensor to = fw_tensor_contiguous(r[j].o, odt, 3, os), tl = fw_tensor_contiguous(r[j].l, FW_F32, 2, ls);
        p.threads = j == 4 ? 3 : j == 3 ? 1 : 2;
        st = fw_attn_kvcache_fwd(&tq_, held ? NULL : &tkn, held ? NULL : &tvn, cuq, B, &cache, &to, &tl, &p);
        FZ_CHECK(st == FW_OK, "%s: %s", names[j], fw_last_error());
        free(ck);
        free(cv);
        free(bt);
    }
    const int rules = special ? FZ_WIDER | FZ_ANY_NONFINITE : 0;
    for (int j = 0; j < NP; j++) {
        fw_tensor to = fw_tensor_contiguous(r[j].o, odt, 3, os), tl = fw_tensor_contiguous(r[j].l, FW_F32, 2, ls);
        fz_compare(names[j], &to, sr, ex, no, 1, rules, oslack);
        fz_compare(names[j], &tl, sr + no, ex + no, nl, 1, 0, lslack);
    }
    bits_equal(names[0], names[1], &r[0], &r[1], (size_t)no * oes, (size_t)nl * 4);
    bits_equal(names[3], names[4], &r[3], &r[4], (size_t)no * oes, (size_t)nl * 4);
    bits_equal(names[3], names[5], &r[3], &r[5], (size_t)no * oes, (size_t)nl * 4);
    bits_equal(names[5], names[6], &r[5], &r[6], (size_t)no * oes, (size_t)nl * 4);
    for (int j = 0; j < NP; j++) {
        free(r[j].o);
        free(r[j].l);
    }
    free(q); free(k); free(v); free(kn); free(vn); free(ex); free(sr);
    return 0;
}
