/*
 * test_gdn.c: Gated DeltaNet against the float64 recurrence:
 * chunked vs recurrent at T in {1, 63, 64, 65, 150, 1000}, dk != dv, HV/H in {1, 2, 3};
 * varlen packing equals per-sequence runs; a state carried across a split at a non-multiple
 * of 64 equals one run; decays near -50 per step stay finite; keys with cosine 0.9 keep the
 * inverse error <= 1e-6; every m of a verify commit equals sequential decode; the fused
 * decode step on a column range against float64. Every table,
 * every dtype, both inverses, the recurrent baselines, thread counts, bad input. bf16
 * products (prefill, verify, commit): within 2x the error of the same-roundings reference.
 * KDA (g [T, HV, dk]): the same sweeps over lengths across the 16-row blocks and 64-token
 * chunks, verify + commit, its kernel gates (softplus and lower_bound) and its bad input.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "gdn/gdn.h"
#include "test_util.h"

typedef struct {
    int64_t T, H, HV, dk, dv;
    fw_dtype dt;
    int l2;
    double gscale; /* g = -gscale * softplus(noise) */
    double corr;   /* keys: mix of one shared direction with weight corr */
    float eps;     /* l2norm_eps (0: the default 1e-6) */
    int kda;       /* g [T, HV, dk]: one decay per key channel */
} gcase;

typedef struct {
    gbuf bq, bk, bv, bg, bb;
    fw_tensor q, k, v, g, beta;
} ginputs;

static void make_inputs(ginputs *in, const gcase *c, uint64_t seed)
{
    int64_t qs[3] = {c->T, c->H, c->dk}, vs[3] = {c->T, c->HV, c->dv}, gs[3] = {c->T, c->HV, c->dk};
    const int64_t gn = c->T * c->HV * (c->kda ? c->dk : 1);
    size_t es = fw_dtype_size(c->dt);
    in->bq = gbuf_new((size_t)(c->T * c->H * c->dk) * es + 1);
    in->bk = gbuf_new((size_t)(c->T * c->H * c->dk) * es + 1);
    in->bv = gbuf_new((size_t)(c->T * c->HV * c->dv) * es + 1);
    in->bg = gbuf_new((size_t)gn * 4 + 1);
    in->bb = gbuf_new((size_t)(c->T * c->HV) * 4 + 1);
    in->q = fw_tensor_contiguous(in->bq.p, c->dt, 3, qs);
    in->k = fw_tensor_contiguous(in->bk.p, c->dt, 3, qs);
    in->v = fw_tensor_contiguous(in->bv.p, c->dt, 3, vs);
    in->g = fw_tensor_contiguous(in->bg.p, FW_F32, c->kda ? 3 : 2, gs);
    in->beta = fw_tensor_contiguous(in->bb.p, FW_F32, 2, gs);
    rng_seed(seed);
    tfill_normal(&in->q, 1.0);
    tfill_normal(&in->v, 1.0);
    double *dir = malloc(sizeof(double) * (size_t)c->dk);
    double n = 0;
    for (int64_t x = 0; x < c->dk; x++) {
        dir[x] = rng_normal();
        n += dir[x] * dir[x];
    }
    for (int64_t t = 0; t < c->T; t++)
        for (int64_t h = 0; h < c->H; h++) {
            /* unit keys (unless l2 is done in the kernel): corr * dir + noise */
            double kk[FW_MAX_HEAD_DIM], s = 0;
            for (int64_t x = 0; x < c->dk; x++) {
                kk[x] = c->corr * dir[x] / sqrt(n) + (1 - c->corr) * rng_normal() / sqrt((double)c->dk);
                s += kk[x] * kk[x];
            }
            for (int64_t x = 0; x < c->dk; x++) {
                int64_t idx[3] = {t, h, x};
                tset(&in->k, idx, c->l2 ? 3.0 * kk[x] : kk[x] / sqrt(s));
            }
        }
    free(dir);
    for (int64_t i = 0; i < gn; i++)
        ((float *)in->g.data)[i] = (float)(-c->gscale * log1p(exp(rng_normal())));
    for (int64_t i = 0; i < c->T * c->HV; i++)
        ((float *)in->beta.data)[i] = (float)(1.0 / (1.0 + exp(-rng_normal())));
}

static void free_inputs(ginputs *in)
{
    gbuf_free(&in->bq); gbuf_free(&in->bk); gbuf_free(&in->bv); gbuf_free(&in->bg); gbuf_free(&in->bb);
}

static double max_abs(const double *a, const double *b, int64_t n)
{
    double e = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(a[i] - b[i]);
        if (!(d <= e))
            e = isnan(d) ? INFINITY : d;
    }
    return e;
}

static void out_to_double(const fw_tensor *o, double *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = o->dtype == FW_F32 ? ((float *)o->data)[i]
                 : o->dtype == FW_BF16 ? fw_bf16_to_f32(((uint16_t *)o->data)[i])
                                       : fw_f16_to_f32(((uint16_t *)o->data)[i]);
}

/* Chunked (both inverses) and the two recurrent modes, every table, against the reference
 * over a packed batch with the given sequence lengths; the recurrent-fused mode is the
 * "plain same precision" comparison for the 2x bar. */
static void run_gcase(const gcase *c, const int32_t *lens, int nseq, uint64_t seed)
{
    int32_t cu[16] = {0};
    for (int i = 0; i < nseq; i++)
        cu[i + 1] = cu[i] + lens[i];
    gcase cc = *c;
    cc.T = cu[nseq];
    case_begin("%s T%lld (%d seqs) H%lld HV%lld dk%lld dv%lld %s l2 %d (eps %g) g x%.0f corr %.1f",
               c->kda ? "kda" : "gdn", (long long)cc.T, nseq, (long long)c->H, (long long)c->HV,
               (long long)c->dk, (long long)c->dv,
               fw_dtype_name(c->dt), c->l2, (double)c->eps, c->gscale, c->corr);
    ginputs in;
    make_inputs(&in, &cc, seed);
    const int64_t no = cc.T * c->HV * c->dv, ns = (int64_t)nseq * c->HV * c->dk * c->dv;
    int64_t os[3] = {cc.T, c->HV, c->dv};
    float *init = malloc(sizeof(float) * (size_t)(ns + 1));
    rng_seed(seed + 1);
    for (int64_t i = 0; i < ns; i++)
        init[i] = (float)(0.3 * rng_normal());
    double *ro = malloc(sizeof(double) * (size_t)(no + 1)), *rs = malloc(sizeof(double) * (size_t)(ns + 1));
    fw_tensor tro = fw_tensor_contiguous(ro, FW_F64, 3, os);
    fw_gdn_params p;
    fw_gdn_params_init(&p);
    p.l2norm_qk = c->l2;
    p.l2norm_eps = c->eps;
    p.precision = FW_PREC_F32;
    fw_status st = fw_gdn_ref(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, nseq, init, rs, &tro, &p);
    case_check(st == FW_OK, "reference: %s", fw_last_error());
    /* the same-roundings reference of bf16 products, its output rounded to the output dtype:
     * its error against the plain one sets the bar of the bf16 runs */
    double *sro = malloc(sizeof(double) * (size_t)(no + 1)), *srs = malloc(sizeof(double) * (size_t)(ns + 1));
    fw_tensor tsro = fw_tensor_contiguous(sro, FW_F64, 3, os);
    p.precision = FW_PREC_BF16;
    st = fw_gdn_ref(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, nseq, init, srs, &tsro, &p);
    case_check(st == FW_OK, "same-roundings reference: %s", fw_last_error());
    for (int64_t i = 0; i < no; i++)
        sro[i] = round_to(c->dt, sro[i]);
    const double eosr = max_abs(sro, ro, no), essr = max_abs(srs, rs, ns);
    gbuf ob = gbuf_new((size_t)no * fw_dtype_size(c->dt) + 1);
    fw_tensor to = fw_tensor_contiguous(ob.p, c->dt, 3, os);
    double *got = malloc(sizeof(double) * (size_t)(no + 1));
    float *fin = malloc(sizeof(float) * (size_t)(ns + 1));
    double *fd = malloc(sizeof(double) * (size_t)(ns + 1));
    static const uint32_t modes[] = {FW_GDN_FUSED_RECURRENT, 0, FW_GDN_FWD_SUBST, FW_GDN_RECURRENT};
    unsigned char *first = malloc(ob.bytes);
    for (int it = 0; it < fw_isa_count(); it++) {
        if (!test_table(fw_isa_name(it)))
            continue;
        double eplain = 0, esplain = 0;
        for (int m = 0; m < 4; m++) {
            p.isa = fw_isa_name(it);
            p.flags = modes[m];
            p.threads = m == 1 ? 3 : 2;
            p.precision = FW_PREC_F32;
            memset(ob.p, 0xA5, ob.bytes);
            st = fw_gdn_prefill(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, nseq, init, fin, &to, &p);
            case_check(st == FW_OK, "[%s mode %u] %s", p.isa, modes[m], fw_last_error());
            case_check(gbuf_guards_ok(&ob), "[%s mode %u] out guards", p.isa, modes[m]);
            out_to_double(&to, got, no);
            for (int64_t i = 0; i < ns; i++)
                fd[i] = fin[i];
            const double eo = max_abs(got, ro, no), es = max_abs(fd, rs, ns);
            if (m == 0) { /* the fused recurrent step against float64, absolutely */
                eplain = eo;
                esplain = es;
                double big = 0;
                for (int64_t i = 0; i < no; i++)
                    big = worse(big, fabs(ro[i]));
                const double bar = (c->dt == FW_F32 ? 1e-4 : 2 * (c->dt == FW_BF16 ? 0x1p-8 : 0x1p-10)) * (1 + big);
                case_check(eo <= bar, "[%s] fused recurrent out error %.3g > %.3g", p.isa, eo, bar);
            } else {
                case_check(eo <= 2 * eplain + 1e-5, "[%s mode %u] out error %.3g > 2 x plain %.3g + 1e-5", p.isa,
                           modes[m], eo, eplain);
                case_check(es <= 2 * esplain + 1e-5, "[%s mode %u] state error %.3g > 2 x plain %.3g + 1e-5",
                           p.isa, modes[m], es, esplain);
            }
            if (m == 1) { /* thread-count invariance of the chunked kernel */
                memcpy(first, ob.p, ob.bytes);
                p.threads = 1;
                fw_gdn_prefill(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, nseq, init, fin, &to, &p);
                case_check(memcmp(first, ob.p, ob.bytes) == 0, "[%s] 1 and 3 threads differ", p.isa);
            }
        }
        /* bf16 products, both inverses: within 2 x the same-roundings reference's error */
        for (int m = 1; m < 3; m++) {
            p.flags = modes[m];
            p.precision = FW_PREC_BF16;
            p.threads = 3;
            memset(ob.p, 0xA5, ob.bytes);
            st = fw_gdn_prefill(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, nseq, init, fin, &to, &p);
            case_check(st == FW_OK, "[%s bf16 mode %u] %s", p.isa, modes[m], fw_last_error());
            case_check(gbuf_guards_ok(&ob), "[%s bf16 mode %u] out guards", p.isa, modes[m]);
            out_to_double(&to, got, no);
            for (int64_t i = 0; i < ns; i++)
                fd[i] = fin[i];
            const double eo = max_abs(got, ro, no), es = max_abs(fd, rs, ns);
            case_check(eo <= 2 * eosr + 1e-5, "[%s bf16 mode %u] out error %.3g > 2 x same-roundings %.3g + 1e-5",
                       p.isa, modes[m], eo, eosr);
            case_check(es <= 2 * essr + 1e-5, "[%s bf16 mode %u] state error %.3g > 2 x same-roundings %.3g + 1e-5",
                       p.isa, modes[m], es, essr);
            if (m == 1) {
                memcpy(first, ob.p, ob.bytes);
                p.threads = 1;
                fw_gdn_prefill(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, nseq, init, fin, &to, &p);
                case_check(memcmp(first, ob.p, ob.bytes) == 0, "[%s bf16] 1 and 3 threads differ", p.isa);
            }
        }
    }
    free(first); free(init); free(ro); free(rs); free(got); free(fin); free(fd); free(sro); free(srs);
    gbuf_free(&ob);
    free_inputs(&in);
    case_end();
}

/* (c) state carried across a split at a non-multiple of 64 equals one run; (b) via lens */
static void test_split_state(void)
{
    gcase c = {150, 2, 4, 32, 24, FW_F32, 1, 1.0, 0.2, 0.0f, 0};
    case_begin("gdn: state carried across a split at 100 equals one run");
    ginputs in;
    make_inputs(&in, &c, 5);
    int64_t os[3] = {150, 4, 24};
    float *o1 = malloc(sizeof(float) * 150 * 4 * 24), *o2 = malloc(sizeof(float) * 150 * 4 * 24);
    float s1[4 * 32 * 24], s2[4 * 32 * 24];
    fw_tensor t1 = fw_tensor_contiguous(o1, FW_F32, 3, os);
    fw_gdn_params p;
    fw_gdn_params_init(&p);
    p.l2norm_qk = 1;
    int32_t cu1[2] = {0, 150}, cuA[2] = {0, 100}, cuB[2] = {0, 50};
    fw_status st = fw_gdn_prefill(&in.q, &in.k, &in.v, &in.g, &in.beta, cu1, 1, NULL, s1, &t1, &p);
    /* first 100 tokens, then the last 50 from the carried state (views of the same inputs) */
    fw_tensor qa = in.q, ka = in.k, va = in.v, ga = in.g, ba = in.beta, oa = fw_tensor_contiguous(o2, FW_F32, 3, os);
    qa.shape[0] = ka.shape[0] = va.shape[0] = ga.shape[0] = ba.shape[0] = oa.shape[0] = 100;
    st |= fw_gdn_prefill(&qa, &ka, &va, &ga, &ba, cuA, 1, NULL, s2, &oa, &p);
    fw_tensor qb = qa, kb = ka, vb = va, gb = ga, bb = ba, ob = oa;
    qb.shape[0] = kb.shape[0] = vb.shape[0] = gb.shape[0] = bb.shape[0] = ob.shape[0] = 50;
    qb.data = (float *)in.q.data + 100 * 2 * 32;
    kb.data = (float *)in.k.data + 100 * 2 * 32;
    vb.data = (float *)in.v.data + 100 * 4 * 24;
    gb.data = (float *)in.g.data + 100 * 4;
    bb.data = (float *)in.beta.data + 100 * 4;
    ob.data = o2 + 100 * 4 * 24;
    st |= fw_gdn_prefill(&qb, &kb, &vb, &gb, &bb, cuB, 1, s2, s2, &ob, &p);
    case_check(st == FW_OK, "status %s", fw_last_error());
    double e = 0;
    for (int i = 0; i < 150 * 4 * 24; i++)
        e = worse(e, fabs(o1[i] - o2[i]));
    for (int i = 0; i < 4 * 32 * 24; i++)
        e = worse(e, fabs(s1[i] - s2[i]));
    case_check(e <= 2e-5, "split vs one run differ by %.3g", e);
    free(o1); free(o2);
    free_inputs(&in);
    case_end();
}

/* (e) correlated keys: the inverse stays within 1e-6 of the float64 inverse */
static void test_inverse_stability(void)
{
    for (int t = 0; t < fw_isa_count(); t++) {
        if (!test_table(fw_isa_name(t)))
            continue;
        const fw_kernels *kt = fw_kernels_get(fw_isa_name(t));
        case_begin("gdn: triangular inverse with keys at cosine 0.9 [%s]", kt->name);
        rng_seed(31);
        const int L = 64, dk = 128;
        double K[64][128], dir[128], n = 0;
        for (int x = 0; x < dk; x++) { dir[x] = rng_normal(); n += dir[x] * dir[x]; }
        for (int i = 0; i < L; i++) {
            double s = 0;
            for (int x = 0; x < dk; x++) {
                K[i][x] = 0.9 * dir[x] / sqrt(n) + 0.1 * rng_normal() / sqrt((double)dk);
                s += K[i][x] * K[i][x];
            }
            for (int x = 0; x < dk; x++)
                K[i][x] /= sqrt(s);
        }
        static float A[64 * 64], X[64 * 64];
        static double Ad[64][64], Xd[64][64];
        double cmin = 1;
        for (int i = 0; i < L; i++)
            for (int j = 0; j < L; j++) {
                double d = 0;
                for (int x = 0; x < dk; x++)
                    d += K[i][x] * K[j][x];
                if (i != j)
                    cmin = fmin(cmin, d);
                Ad[i][j] = j < i ? 0.95 * d : 0;
                A[i * 64 + j] = (float)Ad[i][j];
            }
        for (int i = 0; i < L; i++)
            for (int j = 0; j < L; j++) {
                double s = i == j;
                for (int m = j; m < i; m++)
                    s -= Ad[i][m] * Xd[m][j];
                Xd[i][j] = j <= i ? s : 0;
            }
        case_check(cmin > 0.85, "keys are not correlated enough (min cosine %.2f)", cmin);
        for (int method = 0; method < 2; method++) {
            (method ? kt->gdn.tri_inv_blocked : kt->gdn.tri_inv_fwd)(A, 64, L, X, 64);
            double e = 0;
            for (int i = 0; i < L; i++)
                for (int j = 0; j <= i; j++)
                    e = worse(e, fabs(X[i * 64 + j] - Xd[i][j]));
            case_check(e <= 1e-6, "%s inverse error %.3g", method ? "blocked" : "forward", e);
        }
        case_end();
    }
}

/* (g) the fused decode step of every table on a column range that takes every path: whole
 * blocks of GDN_CV vectors, a smaller block, scalar columns; the state's row stride is
 * wider than the range, and the columns outside it stay as they were. Each row has its own
 * decay (KDA's step; GDN's is the case of equal ones). */
static void test_decode_step(void)
{
    for (int t = 0; t < fw_isa_count(); t++) {
        if (!test_table(fw_isa_name(t)))
            continue;
        const fw_kernels *kt = fw_kernels_get(fw_isa_name(t));
        case_begin("gdn: fused decode step and its reads alone on a column range [%s]", kt->name);
        rng_seed(41);
        enum { DK = 37, LDH = 300 };
        const int c0 = 3, c1 = c0 + kt->vl * (8 + 2) + 5;
        static float h[DK * LDH], h0[DK * LDH], q[DK], k[DK], v[LDH], o[LDH], al[DK];
        for (int i = 0; i < DK * LDH; i++)
            h[i] = h0[i] = (float)rng_normal();
        for (int i = 0; i < DK; i++) {
            q[i] = (float)rng_normal();
            k[i] = (float)rng_normal() / 6;
            al[i] = (float)(0.5 + 0.5 * rng_uniform());
        }
        for (int i = 0; i < LDH; i++) {
            v[i] = (float)rng_normal();
            o[i] = 7.0f;
        }
        const float beta = 0.6f;
        double kq = 0;
        for (int x = 0; x < DK; x++)
            kq += (double)k[x] * q[x];
        kt->gdn.dec_cols(h, FW_F32, LDH, DK, c0, c1, q, k, v, al, beta, (float)kq, o);
        /* the two reads alone (ReplaySSM's), of the same h and of its bf16 copy */
        static float ra[LDH], rb[LDH], xa[LDH], xb[LDH];
        static uint16_t hb[DK * LDH];
        for (int c = 0; c < LDH; c++)
            ra[c] = rb[c] = xa[c] = xb[c] = 7.0f;
        for (int i = 0; i < DK * LDH; i++)
            hb[i] = fw_f32_to_bf16(h0[i]);
        kt->gdn.dec_reads(h0, FW_F32, LDH, DK, c0, c1, q, k, al, ra, rb);
        kt->gdn.dec_reads(hb, FW_BF16, LDH, DK, c0, c1, q, k, al, xa, xb);
        double eo = 0, eh = 0, er = 0;
        int outside = 1;
        for (int c = 0; c < LDH; c++) {
            if (c < c0 || c >= c1) {
                outside &= o[c] == 7.0f && ra[c] == 7.0f && rb[c] == 7.0f && xa[c] == 7.0f && xb[c] == 7.0f;
                for (int r = 0; r < DK; r++)
                    outside &= h[r * LDH + c] == h0[r * LDH + c];
                continue;
            }
            double a = 0, b = 0, sa = 0;
            for (int r = 0; r < DK; r++) {
                a += (double)al[r] * k[r] * h0[r * LDH + c];
                b += (double)al[r] * q[r] * h0[r * LDH + c];
                sa += fabs((double)q[r] * h0[r * LDH + c]) + fabs((double)k[r] * h0[r * LDH + c]);
            }
            double ab = 0, bb = 0;
            for (int r = 0; r < DK; r++) {
                ab += (double)al[r] * k[r] * fw_bf16_to_f32(hb[r * LDH + c]);
                bb += (double)al[r] * q[r] * fw_bf16_to_f32(hb[r * LDH + c]);
            }
            er = worse(worse(worse(worse(er, fabs(ra[c] - a) / (1 + sa)), fabs(rb[c] - b) / (1 + sa)),
                             fabs(xa[c] - ab) / (1 + sa)), fabs(xb[c] - bb) / (1 + sa));
            const double dl = beta * (v[c] - a), want = b + dl * kq;
            eo = worse(eo, fabs(o[c] - want) / (1 + sa + fabs(want)));
            for (int r = 0; r < DK; r++)
                eh = worse(eh, fabs(h[r * LDH + c] - ((double)al[r] * h0[r * LDH + c] + k[r] * dl)) /
                                  (1 + fabs(h0[r * LDH + c]) + sa));
        }
        case_check(eo <= 1e-5 && eh <= 1e-5 && er <= 1e-5, "columns %d..%d: output error %.3g, state error %.3g, "
                   "reads alone %.3g", c0, c1, eo, eh, er);
        case_check(outside, "columns outside the range were written");
        /* a bf16 state: the bits of the f32 step on the state widened, each element rounded */
        static float hw[DK * LDH], ow[LDH], ob[LDH];
        static uint16_t hs[DK * LDH];
        for (int i = 0; i < DK * LDH; i++)
            hw[i] = fw_bf16_to_f32(hs[i] = hb[i]);
        for (int c = 0; c < LDH; c++)
            ow[c] = ob[c] = 7.0f;
        kt->gdn.dec_cols(hw, FW_F32, LDH, DK, c0, c1, q, k, v, al, beta, (float)kq, ow);
        kt->gdn.dec_cols(hs, FW_BF16, LDH, DK, c0, c1, q, k, v, al, beta, (float)kq, ob);
        int same_o = memcmp(ow, ob, sizeof ow) == 0, same_h = 1;
        for (int i = 0; i < DK * LDH; i++)
            same_h &= hs[i] == (i % LDH >= c0 && i % LDH < c1 ? fw_f32_to_bf16(hw[i]) : hb[i]);
        case_check(same_o && same_h, "bf16 state: output %s, state %s the f32 step's on the widened state (rounded)",
                   same_o ? "equals" : "differs from", same_h ? "equals" : "differs from");
        case_end();
    }
}

/* (h2) a bf16 state pool (vLLM's default state cache for a bf16 model): prefill and decode,
 * GDN and KDA, on every table, both precisions of the chunked pass, the chunked and the
 * recurrent prefill, 1 and 3 threads: the outputs and the written states are the bits of the
 * same call on an f32 pool holding the same values, each written state rounded once (the
 * table's rounding, nearest even); slots no sequence writes and the padding keep their bits.
 * An f16 pool is refused with nothing written. */
static void test_state_pool_bf16(void)
{
    enum { H = 2, HV = 4, DK = 16, DV = 40, N = 3, SLOTS = 6, PAD = 5 };
    const int64_t ss = HV * DK * DV, stride = ss + PAD, np = SLOTS * stride;
    int32_t cu[N + 1] = {0, 150, 151, 190}, rd[N] = {4, -1, 2}, wr[N] = {1, 5, -1};
    static float p32[SLOTS * (HV * DK * DV + PAD)], w32[SLOTS * (HV * DK * DV + PAD)];
    static uint16_t p16[SLOTS * (HV * DK * DV + PAD)], b16[SLOTS * (HV * DK * DV + PAD)];
    rng_seed(91);
    for (int64_t i = 0; i < np; i++)
        w32[i] = fw_bf16_to_f32(b16[i] = fw_f32_to_bf16((float)(0.3 * rng_normal())));
    for (int kda = 0; kda < 2; kda++) {
        gcase c = {cu[N], H, HV, DK, DV, FW_BF16, 1, 1.0, 0.3, 0.0f, kda};
        ginputs in;
        make_inputs(&in, &c, 92 + (uint64_t)kda);
        const int64_t os[3] = {c.T, HV, DV};
        gbuf o1 = gbuf_new((size_t)(c.T * HV * DV) * 2), o2 = gbuf_new((size_t)(c.T * HV * DV) * 2);
        fw_tensor t1 = fw_tensor_contiguous(o1.p, FW_BF16, 3, os), t2 = fw_tensor_contiguous(o2.p, FW_BF16, 3, os);
        fw_tensor dq = in.q, dk = in.k, dv = in.v, dg = in.g, db = in.beta, d1 = t1, d2 = t2;
        dq.shape[0] = dk.shape[0] = dv.shape[0] = dg.shape[0] = db.shape[0] = d1.shape[0] = d2.shape[0] = N;
        const fw_gdn_pool pf = {p32, SLOTS, stride, rd, wr, FW_F32}, pb = {p16, SLOTS, stride, rd, wr, FW_BF16};
        for (int dec = 0; dec < 2; dec++) {
            case_begin("gdn: %s %s on a bf16 state pool: the f32 pool's bits, each written state rounded once",
                       kda ? "kda" : "gdn", dec ? "decode" : "prefill");
            for (int t = 0; t < fw_isa_count(); t++) {
                const char *isa = fw_isa_name(t);
                if (!test_table(isa))
                    continue;
                for (int mode = 0; mode < (dec ? 1 : 3); mode++)
                    for (int threads = 1; threads <= 3; threads += 2) {
                        fw_gdn_params p;
                        fw_gdn_params_init(&p);
                        p.l2norm_qk = 1;
                        p.isa = isa;
                        p.threads = threads;
                        p.precision = mode == 1 ? FW_PREC_BF16 : FW_PREC_F32;
                        p.flags = mode == 2 ? FW_GDN_RECURRENT : 0;
                        memcpy(p32, w32, sizeof p32);
                        memcpy(p16, b16, sizeof p16);
                        fw_status st = dec ? fw_gdn_decode_pool(&dq, &dk, &dv, &dg, &db, &pf, &d1, &p) |
                                                 fw_gdn_decode_pool(&dq, &dk, &dv, &dg, &db, &pb, &d2, &p)
                                           : fw_gdn_prefill_pool(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, N, &pf,
                                                                 &t1, &p) |
                                                 fw_gdn_prefill_pool(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, N, &pb,
                                                                     &t2, &p);
                        int bits = 1, kept = 1;
                        for (int64_t i = 0; i < np; i++) {
                            const int64_t sl = i / stride;
                            const int w = i % stride < ss && (sl == wr[0] || sl == wr[1] || sl == wr[2]);
                            bits &= p16[i] == fw_f32_to_bf16(p32[i]);
                            kept &= w || p16[i] == b16[i];
                        }
                        const size_t ob = (size_t)((dec ? N : c.T) * HV * DV) * 2;
                        case_check(st == FW_OK && bits && kept && memcmp(o1.p, o2.p, ob) == 0,
                                   "[%s mode %d, %d threads] status %d (%s): states %s, unwritten slots %s, outputs %s",
                                   isa, mode, threads, (int)st, fw_last_error(), bits ? "same" : "differ",
                                   kept ? "kept" : "changed", memcmp(o1.p, o2.p, ob) ? "differ" : "same");
                    }
            }
            case_end();
        }
        case_begin("gdn: %s f16 state pools are refused with nothing written", kda ? "kda" : "gdn");
        const fw_gdn_pool ph = {p16, SLOTS, stride, rd, wr, FW_F16};
        fw_gdn_params p;
        fw_gdn_params_init(&p);
        p.l2norm_qk = 1;
        memcpy(p16, b16, sizeof p16);
        memset(o2.p, 0xA5, o2.bytes);
        fw_status s1 = fw_gdn_decode_pool(&dq, &dk, &dv, &dg, &db, &ph, &d2, &p),
                  s2 = fw_gdn_prefill_pool(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, N, &ph, &t2, &p);
        int untouched = memcmp(p16, b16, sizeof p16) == 0;
        for (size_t x = 0; x < o2.bytes; x++)
            untouched &= ((unsigned char *)o2.p)[x] == 0xA5;
        case_check(s1 == FW_ERR_DTYPE && s2 == FW_ERR_DTYPE && untouched, "statuses %d, %d (%s)%s", (int)s1, (int)s2,
                   fw_last_error(), untouched ? "" : ", and it wrote");
        case_end();
        gbuf_free(&o1);
        gbuf_free(&o2);
        free_inputs(&in);
    }
}

/* (h) prefill and decode on a state pool (padded slots, read and write slots apart, a zero
 * start, a sequence not written) give the bits of the dense calls on gathered states, write
 * only their write slots, and refuse bad pools with nothing written */
static void test_state_pool(void)
{
    enum { H = 2, HV = 4, DK = 16, DV = 24, N = 3, SLOTS = 8, PAD = 37 };
    const int64_t ss = HV * DK * DV, stride = ss + PAD;
    gcase c = {0, H, HV, DK, DV, FW_BF16, 1, 1.0, 0.3, 0.0f, 0};
    int32_t cu[N + 1] = {0, 70, 71, 100};
    c.T = cu[N];
    ginputs in;
    make_inputs(&in, &c, 77);
    static float pool[SLOTS * (HV * DK * DV + PAD)], pool0[SLOTS * (HV * DK * DV + PAD)];
    static float init[N * HV * DK * DV], fin[N * HV * DK * DV];
    rng_seed(78);
    for (int64_t i = 0; i < SLOTS * stride; i++)
        pool0[i] = (float)(0.2 * rng_normal());
    /* sequence 0 reads 5 writes 2 (prefix caching), 1 starts from zeros and writes 6, 2 reads
     * 3 and writes nothing */
    int32_t rd[N] = {5, -1, 3}, wr[N] = {2, 6, -1};
    for (int i = 0; i < N; i++)
        for (int64_t x = 0; x < ss; x++)
            init[i * ss + x] = rd[i] >= 0 ? pool0[rd[i] * stride + x] : 0.0f;
    int64_t os[3] = {c.T, HV, DV};
    gbuf o1 = gbuf_new((size_t)(c.T * HV * DV) * 2 + 1), o2 = gbuf_new((size_t)(c.T * HV * DV) * 2 + 1);
    fw_tensor t1 = fw_tensor_contiguous(o1.p, FW_BF16, 3, os), t2 = fw_tensor_contiguous(o2.p, FW_BF16, 3, os);
    fw_gdn_params p;
    fw_gdn_params_init(&p);
    p.l2norm_qk = 1;
    fw_gdn_pool pl = {pool, SLOTS, stride, rd, wr, FW_F32};
    /* decode: the first token of each sequence, one per sequence (rows 0 .. N-1) */
    fw_tensor dq = in.q, dk = in.k, dv = in.v, dg = in.g, db = in.beta, dout = t2, dref = t1;
    dq.shape[0] = dk.shape[0] = dv.shape[0] = dg.shape[0] = db.shape[0] = dout.shape[0] = dref.shape[0] = N;
    for (int dec = 0; dec < 2; dec++) {
        case_begin("gdn: %s on a state pool equals the dense call on gathered states", dec ? "decode" : "prefill");
        memcpy(pool, pool0, sizeof pool);
        fw_status st;
        if (dec) {
            st = fw_gdn_decode_pool(&dq, &dk, &dv, &dg, &db, &pl, &dout, &p);
            memcpy(fin, init, sizeof init);
            int32_t id[N] = {0, 1, 2};
            st |= fw_gdn_decode(&dq, &dk, &dv, &dg, &db, fin, N, id, &dref, &p);
            case_check(memcmp(o1.p, o2.p, (size_t)(N * HV * DV) * 2) == 0, "outputs differ");
        } else {
            st = fw_gdn_prefill_pool(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, N, &pl, &t2, &p);
            st |= fw_gdn_prefill(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, N, init, fin, &t1, &p);
            case_check(memcmp(o1.p, o2.p, o1.bytes) == 0, "outputs differ");
        }
        case_check(st == FW_OK, "status: %s", fw_last_error());
        int same = 1, kept = 1;
        for (int64_t sl = 0; sl < SLOTS; sl++)
            for (int64_t x = 0; x < stride; x++) {
                const int64_t at_ = sl * stride + x;
                int seq = -1;
                for (int i = 0; i < N; i++)
                    if (wr[i] == sl && x < ss)
                        seq = i;
                if (seq >= 0)
                    same &= memcmp(&pool[at_], &fin[seq * ss + x], sizeof(float)) == 0;
                else
                    kept &= memcmp(&pool[at_], &pool0[at_], sizeof(float)) == 0;
            }
        case_check(same, "written slots differ from the dense call's final states");
        case_check(kept, "a slot (or padding) that no sequence writes changed");
        case_end();
    }
    case_begin("gdn: bad state pools are refused with nothing written");
    int32_t dup[N] = {2, 2, -1}, cross_r[N] = {1, 4, -1}, cross_w[N] = {4, 7, -1}, past[N] = {0, 8, 1};
    struct { const char *what; fw_gdn_pool pool; fw_status want; } bad[] = {
        {"slot stride under a state", {pool, SLOTS, ss - 1, rd, wr, FW_F32}, FW_ERR_STRIDE},
        {"slot past the pool", {pool, SLOTS, stride, past, NULL, FW_F32}, FW_ERR_INDEX},
        {"two sequences write one slot", {pool, SLOTS, stride, rd, dup, FW_F32}, FW_ERR_INDEX},
        {"a slot read by one sequence and written by another", {pool, SLOTS, stride, cross_r, cross_w, FW_F32}, FW_ERR_INDEX},
        {"NULL data", {NULL, SLOTS, stride, rd, wr, FW_F32}, FW_ERR_NULL},
        {"no indices", {pool, SLOTS, stride, NULL, NULL, FW_F32}, FW_ERR_NULL},
        {"overflowing extent", {pool, INT64_MAX / 8, stride, rd, wr, FW_F32}, FW_ERR_OVERFLOW},
    };
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
        memcpy(pool, pool0, sizeof pool);
        memset(o2.p, 0xA5, o2.bytes);
        fw_status st = b % 2 ? fw_gdn_prefill_pool(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, N, &bad[b].pool, &t2, &p)
                             : fw_gdn_decode_pool(&dq, &dk, &dv, &dg, &db, &bad[b].pool, &dout, &p);
        int untouched = memcmp(pool, pool0, sizeof pool) == 0;
        for (size_t x = 0; x < o2.bytes; x++)
            untouched &= ((unsigned char *)o2.p)[x] == 0xA5;
        case_check(st == bad[b].want && untouched, "%s: status %d (want %d), \"%s\"%s", bad[b].what, (int)st,
                   (int)bad[b].want, fw_last_error(), untouched ? "" : ", and it wrote");
    }
    case_end();
    gbuf_free(&o1);
    gbuf_free(&o2);
    free_inputs(&in);
}

/* Op 0 (prefill), 1 (decode of each sequence's first token) or 2 (verify) twice: with the
 * gates given (g, beta; state s1, out o1) and with the raw a, b and the kernels' gates (state
 * s2, out o2). Both statuses or'ed. */
typedef struct {
    const fw_tensor *g, *beta, *a, *b, *o1, *o2;
    const fw_gdn_params *given, *raw;
} gate_pair;

static fw_status run_gate_pair(int op, const ginputs *in, const int32_t *cu, int n, const gate_pair *gp,
                               float *s1, float *s2, const int32_t *idx, float *replay, size_t rf)
{
    if (op == 0)
        return fw_gdn_prefill(&in->q, &in->k, &in->v, gp->g, gp->beta, cu, n, NULL, s1, gp->o1, gp->given) |
               fw_gdn_prefill(&in->q, &in->k, &in->v, gp->a, gp->b, cu, n, NULL, s2, gp->o2, gp->raw);
    if (op == 2)
        return fw_gdn_verify(&in->q, &in->k, &in->v, gp->g, gp->beta, cu, n, s1, 3, idx, replay, rf, gp->o1,
                             gp->given) |
               fw_gdn_verify(&in->q, &in->k, &in->v, gp->a, gp->b, cu, n, s2, 3, idx, replay, rf, gp->o2, gp->raw);
    fw_tensor q = in->q, k = in->k, v = in->v, gg = *gp->g, bb = *gp->beta, aa = *gp->a, b2 = *gp->b;
    fw_tensor x1 = *gp->o1, x2 = *gp->o2;
    q.shape[0] = k.shape[0] = v.shape[0] = gg.shape[0] = bb.shape[0] = aa.shape[0] = b2.shape[0] = n;
    x1.shape[0] = x2.shape[0] = n;
    return fw_gdn_decode(&q, &k, &v, &gg, &bb, s1, 3, idx, &x1, gp->given) |
           fw_gdn_decode(&q, &k, &v, &aa, &b2, s2, 3, idx, &x2, gp->raw);
}

/* given: l2norm in the kernel, the gates given; raw: the same with the gates computed from
 * a_log, dt_bias and sigmoid beta */
static void gate_params(fw_gdn_params *given, fw_gdn_params *raw, const fw_tensor *a_log,
                        const fw_tensor *dt_bias)
{
    fw_gdn_params_init(given);
    given->l2norm_qk = 1;
    *raw = *given;
    raw->a_log = a_log;
    raw->dt_bias = dt_bias;
    raw->beta_sigmoid = 1;
}

/* (i) the gates computed inside the kernels (a_log, dt_bias, beta_sigmoid) give the bits of
 * the same gates computed before the call, on prefill, decode and verify; bad gate params
 * are refused */
static void test_kernel_gates(void)
{
    enum { H = 2, HV = 4, DK = 16, DV = 16, N = 2 };
    gcase c = {0, H, HV, DK, DV, FW_F32, 1, 1.0, 0.3, 0.0f, 0};
    int32_t cu[N + 1] = {0, 9, 14};
    c.T = cu[N];
    ginputs in;
    make_inputs(&in, &c, 91);
    static float a[14 * HV], b[14 * HV], g[14 * HV], beta[14 * HV], alog[HV], dtb[HV];
    static float o1[14 * HV * DV], o2[14 * HV * DV], s1[3 * HV * DK * DV], s2[3 * HV * DK * DV];
    rng_seed(92);
    for (int h = 0; h < HV; h++) {
        alog[h] = (float)(0.5 * rng_normal());
        dtb[h] = (float)(0.5 * rng_normal());
    }
    for (int i = 0; i < 14 * HV; i++) {
        a[i] = (float)(2 * rng_normal());
        b[i] = (float)(2 * rng_normal());
        const float y = a[i] + dtb[i % HV], sp = y > 20.0f ? y : log1pf(expf(y));
        g[i] = -expf(alog[i % HV]) * sp;
        beta[i] = 1.0f / (1.0f + expf(-b[i]));
    }
    int64_t gs[2] = {14, HV}, hs[1] = {HV}, os[3] = {14, HV, DV};
    fw_tensor ta = fw_tensor_contiguous(a, FW_F32, 2, gs), tb = fw_tensor_contiguous(b, FW_F32, 2, gs);
    fw_tensor tg = fw_tensor_contiguous(g, FW_F32, 2, gs), tbe = fw_tensor_contiguous(beta, FW_F32, 2, gs);
    fw_tensor tal = fw_tensor_contiguous(alog, FW_F32, 1, hs), tdt = fw_tensor_contiguous(dtb, FW_F32, 1, hs);
    fw_tensor to1 = fw_tensor_contiguous(o1, FW_F32, 3, os), to2 = fw_tensor_contiguous(o2, FW_F32, 3, os);
    fw_gdn_params given, raw;
    gate_params(&given, &raw, &tal, &tdt);
    int32_t idx[N] = {2, 0};
    float replay[4096];
    for (int op = 0; op < 3; op++) {
        case_begin("gdn: gates computed in the kernel equal the gates given (%s)",
                   op == 0 ? "prefill" : op == 1 ? "decode" : "verify");
        for (int i = 0; i < 3 * HV * DK * DV; i++)
            s1[i] = s2[i] = (float)(0.1 * (i % 17) - 0.8);
        const gate_pair gp = {&tg, &tbe, &ta, &tb, &to1, &to2, &given, &raw};
        fw_status st = run_gate_pair(op, &in, cu, N, &gp, s1, s2, idx, replay, 4096);
        case_check(st == FW_OK, "status: %s", fw_last_error());
        case_check(!memcmp(o1, o2, sizeof o1) && !memcmp(s1, s2, sizeof s1), "outputs or states differ");
        case_end();
    }
    case_begin("gdn: bad kernel-gate params are refused");
    fw_gdn_params bad = raw;
    bad.beta_sigmoid = 2;
    case_check(fw_gdn_prefill(&in.q, &in.k, &in.v, &ta, &tb, cu, N, NULL, NULL, &to2, &bad) == FW_ERR_ARG, "beta_sigmoid 2");
    bad = raw;
    fw_tensor short_alog = tal;
    short_alog.shape[0] = HV - 1;
    bad.a_log = &short_alog;
    case_check(fw_gdn_prefill(&in.q, &in.k, &in.v, &ta, &tb, cu, N, NULL, NULL, &to2, &bad) == FW_ERR_SHAPE, "a_log of HV - 1");
    bad = given;
    bad.dt_bias = &tdt;
    case_check(fw_gdn_prefill(&in.q, &in.k, &in.v, &tg, &tbe, cu, N, NULL, NULL, &to2, &bad) == FW_ERR_ARG, "dt_bias alone");
    a[5] = INFINITY; /* softplus(inf) = inf: g = -inf, refused */
    case_check(fw_gdn_prefill(&in.q, &in.k, &in.v, &ta, &tb, cu, N, NULL, NULL, &to2, &raw) == FW_ERR_ARG &&
                   strstr(fw_last_error(), "computed from a"), "an infinite raw a: %s", fw_last_error());
    case_end();
    free_inputs(&in);
}

/* (i) KDA's gates computed inside the kernels (per-channel raw a, dt_bias [HV dk], the
 * softplus gate and lower_bound's sigmoid gate, sigmoid beta) give the results of the same
 * gates given to 1e-5 (the kernels' vectorised gates are within a few ulp of libm's: see
 * test_kda_gate_kernel), on prefill, decode and verify; bad KDA shapes and gate params are
 * refused */
static void test_kda_gates(void)
{
    enum { H = 2, HV = 4, DK = 16, DV = 16, N = 2, TT = 14 };
    gcase c = {0, H, HV, DK, DV, FW_F32, 1, 1.0, 0.3, 0.0f, 1};
    int32_t cu[N + 1] = {0, 9, 14};
    c.T = cu[N];
    ginputs in;
    make_inputs(&in, &c, 95);
    static float a[TT * HV * DK], b[TT * HV], g[TT * HV * DK], beta[TT * HV], alog[HV], dtb[HV * DK];
    static float o1[TT * HV * DV], o2[TT * HV * DV], s1[3 * HV * DK * DV], s2[3 * HV * DK * DV];
    rng_seed(96);
    for (int h = 0; h < HV; h++)
        alog[h] = (float)(0.5 * rng_normal());
    for (int i = 0; i < HV * DK; i++)
        dtb[i] = (float)(0.5 * rng_normal());
    for (int i = 0; i < TT * HV; i++) {
        b[i] = (float)(2 * rng_normal());
        beta[i] = 1.0f / (1.0f + expf(-b[i]));
    }
    for (int i = 0; i < TT * HV * DK; i++)
        a[i] = (float)(2 * rng_normal());
    int64_t gs[3] = {TT, HV, DK}, bs[2] = {TT, HV}, hs[1] = {HV}, ds[1] = {HV * DK}, os[3] = {TT, HV, DV};
    fw_tensor ta = fw_tensor_contiguous(a, FW_F32, 3, gs), tb = fw_tensor_contiguous(b, FW_F32, 2, bs);
    fw_tensor tg = fw_tensor_contiguous(g, FW_F32, 3, gs), tbe = fw_tensor_contiguous(beta, FW_F32, 2, bs);
    fw_tensor tal = fw_tensor_contiguous(alog, FW_F32, 1, hs), tdt = fw_tensor_contiguous(dtb, FW_F32, 1, ds);
    fw_tensor to1 = fw_tensor_contiguous(o1, FW_F32, 3, os), to2 = fw_tensor_contiguous(o2, FW_F32, 3, os);
    fw_gdn_params given, raw;
    gate_params(&given, &raw, &tal, &tdt);
    int32_t idx[N] = {2, 0};
    static float replay[8192];
    for (int lb = 0; lb < 2; lb++) {
        raw.lower_bound = lb ? -5.0f : 0.0f;
        for (int i = 0; i < TT * HV * DK; i++) {
            const int vh = (i / DK) % HV;
            const float y = a[i] + dtb[vh * DK + i % DK], ea = expf(alog[vh]);
            g[i] = lb ? -5.0f / (1.0f + expf(-ea * y)) : -ea * (y > 20.0f ? y : log1pf(expf(y)));
        }
        for (int op = 0; op < 3; op++) {
            case_begin("kda: gates computed in the kernel equal the gates given (%s, %s gate)",
                       op == 0 ? "prefill" : op == 1 ? "decode" : "verify", lb ? "lower_bound sigmoid" : "softplus");
            for (int i = 0; i < 3 * HV * DK * DV; i++)
                s1[i] = s2[i] = (float)(0.1 * (i % 17) - 0.8);
            const gate_pair gp = {&tg, &tbe, &ta, &tb, &to1, &to2, &given, &raw};
            fw_status st = run_gate_pair(op, &in, cu, N, &gp, s1, s2, idx, replay, 8192);
            case_check(st == FW_OK, "status: %s", fw_last_error());
            double eo = 0, es = 0;
            for (size_t i = 0; i < sizeof o1 / sizeof o1[0]; i++)
                eo = worse(eo, fabs((double)o1[i] - o2[i]));
            for (size_t i = 0; i < sizeof s1 / sizeof s1[0]; i++)
                es = worse(es, fabs((double)s1[i] - s2[i]));
            case_check(eo <= 1e-5 && es <= 1e-5, "outputs differ by %.3g, states by %.3g", eo, es);
            case_end();
        }
    }
    case_begin("kda: bad per-channel gates and gate params are refused");
    fw_tensor wide = tg;
    wide.shape[2] = DK - 1;
    case_check(fw_gdn_prefill(&in.q, &in.k, &in.v, &wide, &tbe, cu, N, NULL, NULL, &to1, &given) == FW_ERR_SHAPE &&
                   strstr(fw_last_error(), "per-channel"), "g [T, HV, dk - 1]: %s", fw_last_error());
    fw_gdn_params bad = raw;
    fw_tensor odd = tdt;
    odd.shape[0] = HV * DK - 1;
    bad.dt_bias = &odd;
    case_check(fw_gdn_prefill(&in.q, &in.k, &in.v, &ta, &tb, cu, N, NULL, NULL, &to1, &bad) == FW_ERR_SHAPE,
               "dt_bias of HV dk - 1: %s", fw_last_error());
    bad = raw;
    bad.lower_bound = 1.0f;
    case_check(fw_gdn_prefill(&in.q, &in.k, &in.v, &ta, &tb, cu, N, NULL, NULL, &to1, &bad) == FW_ERR_ARG,
               "lower_bound 1");
    bad.lower_bound = -INFINITY;
    case_check(fw_gdn_prefill(&in.q, &in.k, &in.v, &ta, &tb, cu, N, NULL, NULL, &to1, &bad) == FW_ERR_ARG,
               "lower_bound -inf");
    bad = given;
    bad.lower_bound = -5.0f;
    case_check(fw_gdn_prefill(&in.q, &in.k, &in.v, &tg, &tbe, cu, N, NULL, NULL, &to1, &bad) == FW_ERR_ARG &&
                   strstr(fw_last_error(), "a_log"), "lower_bound without a_log: %s", fw_last_error());
    /* a GDN call with a dt_bias of HV x dk entries: only KDA takes one per channel */
    fw_tensor g2 = tbe;
    case_check(fw_gdn_prefill(&in.q, &in.k, &in.v, &g2, &tb, cu, N, NULL, NULL, &to1, &raw) == FW_ERR_SHAPE,
               "GDN with dt_bias [HV dk]: %s", fw_last_error());
    g[3 * HV * DK + 5] = NAN;
    case_check(fw_gdn_prefill(&in.q, &in.k, &in.v, &tg, &tbe, cu, N, NULL, NULL, &to1, &given) == FW_ERR_ARG &&
                   strstr(fw_last_error(), "[3][0][5]"), "a NaN decay of one channel: %s", fw_last_error());
    float small[64];
    case_check(fw_gdn_verify(&in.q, &in.k, &in.v, &ta, &tb, cu, N, s1, 3, idx, small,
                             fw_gdn_replay_floats(TT, H, HV, DK, DV), &to1, &raw) == FW_ERR_WORKSPACE &&
                   strstr(fw_last_error(), "fw_kda_replay_floats"), "KDA verify, GDN-sized replay: %s", fw_last_error());
    case_end();
    free_inputs(&in);
}

/* (i) the kda_gates kernel of every table against the gates in double: y from -60 to 60 (both
 * sides of softplus's threshold 20, and where e^-|y| is tiny), both gate forms, a row that
 * takes the vector and the scalar paths. The double gate starts from the float y = a + bias
 * and u = ea y, as any float evaluation does; the rounding of an exponent's argument x then
 * costs about |x| ulp of e^x (libm's expf of a rounded float too), so the bar is (8 + 2|x|)
 * float ulp of the value, plus 1e-37. */
static void test_kda_gate_kernel(void)
{
    enum { N = 1003 };
    static float a[N], bias[N], g2[N];
    for (int i = 0; i < N; i++) {
        a[i] = (float)(-60.0 + 120.0 * i / (N - 1));
        bias[i] = (float)(0.01 * (i % 7) - 0.03);
    }
    for (int t = 0; t < fw_isa_count(); t++) {
        if (!test_table(fw_isa_name(t)))
            continue;
        const fw_kernels *kt = fw_kernels_get(fw_isa_name(t));
        for (int form = 0; form < 2; form++) {
            case_begin("kda: the gate kernel against double [%s, %s gate]", kt->name, form ? "sigmoid" : "softplus");
            const float ea = 1.7f, lb = form ? -5.0f : 0.0f;
            kt->gdn.kda_gates(N, a, bias, ea, lb, g2);
            double worst = 0;
            for (int i = 0; i < N; i++) {
                const float yf = a[i] + bias[i], uf = ea * yf;
                const double y = yf, u = uf, sp = y > 20 ? y : log1p(exp(y));
                const double want = (form ? lb / (1 + exp(-u)) : -(double)ea * sp) / log(2.0);
                const double x = form ? fabs(u) : fabs(y);
                worst = worse(worst, fabs(g2[i] - want) / ((fabs(want) * 0x1p-23 + 1e-37) * (8 + 2 * x)));
            }
            case_check(worst <= 1, "worst error %.3g of the bar", worst);
            case_end();
        }
    }
}

/* KDA's decayed operands (exp2d_scale2): the same bits as exp2_scale on the exponents rounded
 * from their double differences, on every table, for both operands, with and without g0
 * and x, lengths past and short of the vectors; exponents across [-150, 10] and beyond. */
static void test_kda_scale_kernel(void)
{
    enum { N = 133 };
    static double g1[N], g0[N];
    static float x[N], y[N], e[N], ax[N], ay[N], bx[N], by[N];
    rng_seed(77);
    for (int i = 0; i < N; i++) {
        g0[i] = -1000.0 * rng_uniform();
        g1[i] = g0[i] + (i == 5 ? -1e4 : -160.0 * rng_uniform() + 10.0);
        x[i] = (float)rng_normal();
        y[i] = (float)rng_normal();
    }
    for (int t = 0; t < fw_isa_count(); t++) {
        if (!test_table(fw_isa_name(t)))
            continue;
        const fw_kernels *kt = fw_kernels_get(fw_isa_name(t));
        case_begin("kda: one exponential for two decayed operands equals exp2_scale [%s]", kt->name);
        for (int n = 1; n <= N; n += 22)
            for (int form = 0; form < 3; form++) { /* g0 and both operands; no g0; x NULL, no dy */
                const double *z = form == 1 ? NULL : g0;
                for (int i = 0; i < n; i++)
                    e[i] = (float)(g1[i] - (z ? z[i] : 0.0));
                kt->gdn.exp2_scale(n, form == 2 ? NULL : x, e, NULL, ax);
                kt->gdn.exp2_scale(n, y, e, NULL, ay);
                memset(bx, 0xA5, sizeof bx);
                memset(by, 0xA5, sizeof by);
                kt->gdn.exp2d_scale2(n, g1, z, form == 2 ? NULL : x, bx, form == 2 ? NULL : y, form == 2 ? NULL : by);
                case_check(!memcmp(ax, bx, sizeof(float) * (size_t)n), "n %d, form %d: first operand differs", n, form);
                if (form < 2)
                    case_check(!memcmp(ay, by, sizeof(float) * (size_t)n), "n %d, form %d: second operand differs", n,
                               form);
                else
                    case_check(((unsigned char *)by)[0] == 0xA5, "n %d: wrote dy without one", n);
                case_check(n == N || ((unsigned char *)bx)[sizeof(float) * (size_t)n] == 0xA5,
                           "n %d, form %d: wrote past n", n, form);
            }
        case_end();
    }
}

/* (f) verify + commit of every m equals sequential decode (GDN, and KDA with kda set); the
 * verify of bf16 products against the same-roundings reference (GDN) */
static void verify_commit(int kda)
{
    const int64_t H = 2, HV = 4, dk = 32, dv = 40, n = 7, N = 2, gw = kda ? dk : 1;
    gcase c = {n * N, H, HV, dk, dv, FW_F32, 1, 1.0, 0.3, 0.0f, kda};
    ginputs in;
    make_inputs(&in, &c, 17);
    const int64_t slots = 5, ss = HV * dk * dv;
    float *state = malloc(sizeof(float) * (size_t)(slots * ss)), *work = malloc(sizeof(float) * (size_t)(slots * ss));
    rng_seed(3);
    for (int64_t i = 0; i < slots * ss; i++)
        state[i] = (float)(0.2 * rng_normal());
    int32_t idx[2] = {3, 1}, cu[3] = {0, (int32_t)n, (int32_t)(2 * n)};
    int64_t os[3] = {2 * n, HV, dv};
    float *vo = malloc(sizeof(float) * (size_t)(2 * n * HV * dv)), *dob = malloc(sizeof(float) * (size_t)(HV * dv * 2));
    fw_tensor tvo = fw_tensor_contiguous(vo, FW_F32, 3, os);
    size_t rf = (kda ? fw_kda_replay_floats : fw_gdn_replay_floats)(2 * n, H, HV, dk, dv);
    float *replay = malloc(sizeof(float) * rf);
    fw_gdn_params p;
    fw_gdn_params_init(&p);
    p.l2norm_qk = 1;
    case_begin("%s: verify + commit for every m equals sequential decode", kda ? "kda" : "gdn");
    fw_status st = fw_gdn_verify(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, N, state, slots, idx, replay, rf, &tvo, &p);
    case_check(st == FW_OK, "verify: %s", fw_last_error());
    double worst_o = 0, worst_s = 0;
    for (int m = 0; m <= n; m++) {
        /* sequential decode of the first m tokens of each sequence from the committed state */
        memcpy(work, state, sizeof(float) * (size_t)(slots * ss));
        for (int t = 0; t < m; t++) {
            int64_t q1[3] = {N, H, dk}, v1[3] = {N, HV, dv}, g1[3] = {N, HV, dk};
            float qd[2 * 2 * 32], kd[2 * 2 * 32], vd[2 * 4 * 40], gd[2 * 4 * 32], bd[8];
            for (int i = 0; i < N; i++) {
                memcpy(qd + i * H * dk, (float *)in.q.data + (i * n + t) * H * dk, sizeof(float) * H * dk);
                memcpy(kd + i * H * dk, (float *)in.k.data + (i * n + t) * H * dk, sizeof(float) * H * dk);
                memcpy(vd + i * HV * dv, (float *)in.v.data + (i * n + t) * HV * dv, sizeof(float) * HV * dv);
                memcpy(gd + i * HV * gw, (float *)in.g.data + (i * n + t) * HV * gw, sizeof(float) * HV * gw);
                memcpy(bd + i * HV, (float *)in.beta.data + (i * n + t) * HV, sizeof(float) * HV);
            }
            fw_tensor tq = fw_tensor_contiguous(qd, FW_F32, 3, q1), tk = fw_tensor_contiguous(kd, FW_F32, 3, q1),
                      tv = fw_tensor_contiguous(vd, FW_F32, 3, v1), tg = fw_tensor_contiguous(gd, FW_F32, kda ? 3 : 2, g1),
                      tb = fw_tensor_contiguous(bd, FW_F32, 2, g1), to = fw_tensor_contiguous(dob, FW_F32, 3, v1);
            st = fw_gdn_decode(&tq, &tk, &tv, &tg, &tb, work, slots, idx, &to, &p);
            case_check(st == FW_OK, "decode: %s", fw_last_error());
            for (int i = 0; i < N; i++)
                for (int64_t x = 0; x < HV * dv; x++)
                    worst_o = worse(worst_o, fabs(dob[i * HV * dv + x] - vo[(i * n + t) * HV * dv + x]));
        }
        float *com = malloc(sizeof(float) * (size_t)(slots * ss));
        memcpy(com, state, sizeof(float) * (size_t)(slots * ss));
        int32_t acc[2] = {m, m};
        st = fw_gdn_commit(cu, N, acc, H, HV, dk, dv, com, slots, idx, replay, rf, &p);
        case_check(st == FW_OK, "commit: %s", fw_last_error());
        for (int64_t i = 0; i < slots * ss; i++)
            worst_s = worse(worst_s, fabs(com[i] - work[i]));
        free(com);
    }
    case_check(worst_o <= 2e-5, "verify outputs differ from sequential decode by %.3g", worst_o);
    case_check(worst_s <= 2e-5, "committed states differ from sequential decode by %.3g", worst_s);
    case_end();
    if (kda) { /* a GDN commit of a KDA replay is not possible: the tag says which it is */
        case_begin("kda: the replay's tag: a KDA replay one float short, an untagged one");
        int32_t acc[2] = {1, 1};
        float *com = malloc(sizeof(float) * (size_t)(slots * ss));
        memcpy(com, state, sizeof(float) * (size_t)(slots * ss));
        st = fw_gdn_commit(cu, N, acc, H, HV, dk, dv, com, slots, idx, replay, rf - 1, &p);
        case_check(st == FW_ERR_WORKSPACE, "short KDA replay: %s", fw_status_string(st));
        const float tag = replay[0];
        replay[0] = 0.0f;
        st = fw_gdn_commit(cu, N, acc, H, HV, dk, dv, com, slots, idx, replay, rf, &p);
        case_check(st == FW_ERR_ARG && strstr(fw_last_error(), "tag"), "untagged replay: %s", fw_last_error());
        replay[0] = tag;
        case_check(!memcmp(com, state, sizeof(float) * (size_t)(slots * ss)), "state written");
        free(com);
        case_end();
        free(state); free(work); free(vo); free(dob); free(replay);
        free_inputs(&in);
        return;
    }
    /* verify on bf16 products: its outputs, and the state committed after every token, within
     * 2 x the error of the same-roundings reference of a prefill from the slots' states */
    case_begin("gdn: verify + commit on bf16 products against the same-roundings reference");
    float *init = malloc(sizeof(float) * (size_t)(N * ss)), *com = malloc(sizeof(float) * (size_t)(slots * ss));
    double *ro = malloc(sizeof(double) * (size_t)(2 * n * HV * dv)), *sro = malloc(sizeof(double) * (size_t)(2 * n * HV * dv));
    double *rs = malloc(sizeof(double) * (size_t)(N * ss)), *srs = malloc(sizeof(double) * (size_t)(N * ss));
    for (int i = 0; i < N; i++)
        memcpy(init + i * ss, state + idx[i] * ss, sizeof(float) * (size_t)ss);
    fw_tensor tro = fw_tensor_contiguous(ro, FW_F64, 3, os), tsro = fw_tensor_contiguous(sro, FW_F64, 3, os);
    p.precision = FW_PREC_F32;
    st = fw_gdn_ref(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, N, init, rs, &tro, &p);
    p.precision = FW_PREC_BF16;
    st |= fw_gdn_ref(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, N, init, srs, &tsro, &p);
    st |= fw_gdn_verify(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, N, state, slots, idx, replay, rf, &tvo, &p);
    memcpy(com, state, sizeof(float) * (size_t)(slots * ss));
    int32_t all[2] = {(int32_t)n, (int32_t)n};
    st |= fw_gdn_commit(cu, N, all, H, HV, dk, dv, com, slots, idx, replay, rf, &p);
    case_check(st == FW_OK, "status: %s", fw_last_error());
    double eo = 0, eosr = 0, es = 0, essr = 0;
    for (int64_t x = 0; x < 2 * n * HV * dv; x++) {
        eo = worse(eo, fabs(vo[x] - ro[x]));
        eosr = worse(eosr, fabs(sro[x] - ro[x]));
    }
    for (int i = 0; i < N; i++)
        for (int64_t x = 0; x < ss; x++) {
            es = worse(es, fabs(com[idx[i] * ss + x] - rs[i * ss + x]));
            essr = worse(essr, fabs(srs[i * ss + x] - rs[i * ss + x]));
        }
    case_check(eosr > 0 && eo <= 2 * eosr + 1e-5, "verify outputs: error %.3g, same-roundings %.3g", eo, eosr);
    case_check(es <= 2 * essr + 1e-5, "committed state: error %.3g, same-roundings %.3g", es, essr);
    case_end();
    free(init); free(com); free(ro); free(sro); free(rs); free(srs);
    free(state); free(work); free(vo); free(dob); free(replay);
    free_inputs(&in);
}

/* One bad-input case: the expected status with a message, and out (0xA5 bytes) and the state
 * (all 1.0) untouched. */
#define BAD_STATE (4 * 4 * 8 * 8)
static void bad_verdict(const char *what, fw_status st, fw_status want, const gbuf *ob, const float *state)
{
    case_begin("gdn bad input: %s", what);
    case_check(st == want, "status %s, expected %s (%s)", fw_status_string(st), fw_status_string(want),
               fw_last_error());
    case_check(strlen(fw_last_error()) > 10, "message \"%s\"", fw_last_error());
    int clean = 1;
    for (size_t i = 0; i < ob->bytes; i++)
        clean &= ((unsigned char *)ob->p)[i] == 0xA5;
    for (int i = 0; i < BAD_STATE; i++)
        clean &= state[i] == 1.0f;
    case_check(clean, "out or state written");
    case_end();
}

/* bad input: a status and a message; out and the state untouched */
static void test_gdn_bad_input(void)
{
    gcase c = {10, 2, 4, 8, 8, FW_F32, 0, 1.0, 0.0, 0.0f, 0};
    ginputs in;
    make_inputs(&in, &c, 2);
    int64_t os[3] = {10, 4, 8};
    gbuf ob = gbuf_new(10 * 4 * 8 * 4);
    fw_tensor o = fw_tensor_contiguous(ob.p, FW_F32, 3, os);
    float state[BAD_STATE];
    for (int i = 0; i < BAD_STATE; i++)
        state[i] = 1.0f;
    int32_t cu[3] = {0, 4, 10}, bad_cu[3] = {0, 6, 4}, idx[2] = {0, 1}, bad_idx[2] = {0, 7}, dup_idx[2] = {2, 2};
    fw_gdn_params p;
    fw_gdn_params_init(&p);
    struct { const char *what; fw_status want; int which; } bad[] = {
        {"null q", FW_ERR_NULL, 0}, {"HV not a multiple of H", FW_ERR_SHAPE, 1}, {"decreasing cu_seqlens", FW_ERR_SEQLENS, 2},
        {"positive g", FW_ERR_ARG, 3}, {"g dtype f16", FW_ERR_DTYPE, 4}, {"state index out of range", FW_ERR_INDEX, 5},
        {"two sequences on one slot", FW_ERR_INDEX, 6}, {"null state", FW_ERR_NULL, 7}, {"verify of 65 tokens", FW_ERR_SEQLENS, 8},
        {"small replay buffer", FW_ERR_WORKSPACE, 9}, {"commit of more than verified", FW_ERR_ARG, 10},
        {"unknown flag", FW_ERR_ARG, 11}, {"nan beta", FW_ERR_ARG, 12}, {"precision 3", FW_ERR_ARG, 13},
        {"precision -1 (verify)", FW_ERR_ARG, 14}, {"l2norm_eps -1", FW_ERR_ARG, 15},
        {"l2norm_eps NaN (decode)", FW_ERR_ARG, 16},
    };
    float replay[4096];
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
        fw_tensor q = in.q, v = in.v, g = in.g;
        fw_gdn_params pp = p;
        float saved = 0;
        memset(ob.p, 0xA5, ob.bytes);
        fw_status st = FW_OK;
        int32_t acc[2] = {1, 9};
        switch (bad[b].which) {
        case 0: st = fw_gdn_prefill(NULL, &in.k, &in.v, &in.g, &in.beta, cu, 2, NULL, NULL, &o, &pp); break;
        case 1: v.shape[1] = 3; st = fw_gdn_prefill(&q, &in.k, &v, &g, &in.beta, cu, 2, NULL, NULL, &o, &pp); break;
        case 2: st = fw_gdn_prefill(&q, &in.k, &v, &g, &in.beta, bad_cu, 2, NULL, NULL, &o, &pp); break;
        case 3: saved = ((float *)g.data)[5]; ((float *)g.data)[5] = 0.5f;
            st = fw_gdn_prefill(&q, &in.k, &v, &g, &in.beta, cu, 2, NULL, NULL, &o, &pp);
            ((float *)g.data)[5] = saved; break;
        case 4: g.dtype = FW_F16; st = fw_gdn_prefill(&q, &in.k, &v, &g, &in.beta, cu, 2, NULL, NULL, &o, &pp); break;
        case 5: st = fw_gdn_verify(&q, &in.k, &v, &g, &in.beta, cu, 2, state, 4, bad_idx, replay, 4096, &o, &pp); break;
        case 6: st = fw_gdn_verify(&q, &in.k, &v, &g, &in.beta, cu, 2, state, 4, dup_idx, replay, 4096, &o, &pp); break;
        case 7: st = fw_gdn_verify(&q, &in.k, &v, &g, &in.beta, cu, 2, NULL, 4, idx, replay, 4096, &o, &pp); break;
        case 8: { int32_t cu65[2] = {0, 65}; st = fw_gdn_verify(&q, &in.k, &v, &g, &in.beta, cu65, 1, state, 4, idx, replay, 4096, &o, &pp); break; }
        case 9: st = fw_gdn_verify(&q, &in.k, &v, &g, &in.beta, cu, 2, state, 4, idx, replay, 10, &o, &pp); break;
        case 10: st = fw_gdn_commit(cu, 2, acc, 2, 4, 8, 8, state, 4, idx, replay, 4096, &pp); break;
        case 11: pp.flags = 1u << 9; st = fw_gdn_prefill(&q, &in.k, &v, &g, &in.beta, cu, 2, NULL, NULL, &o, &pp); break;
        case 12: saved = ((float *)in.beta.data)[3]; ((float *)in.beta.data)[3] = NAN;
            st = fw_gdn_prefill(&q, &in.k, &v, &g, &in.beta, cu, 2, NULL, NULL, &o, &pp);
            ((float *)in.beta.data)[3] = saved; break;
        case 13: pp.precision = 3; st = fw_gdn_prefill(&q, &in.k, &v, &g, &in.beta, cu, 2, NULL, NULL, &o, &pp); break;
        case 14: pp.precision = -1;
            st = fw_gdn_verify(&q, &in.k, &v, &g, &in.beta, cu, 2, state, 4, idx, replay, 4096, &o, &pp); break;
        case 15: pp.l2norm_eps = -1.0f; st = fw_gdn_prefill(&q, &in.k, &v, &g, &in.beta, cu, 2, NULL, NULL, &o, &pp); break;
        case 16: pp.l2norm_eps = NAN;
            st = fw_gdn_verify(&q, &in.k, &v, &g, &in.beta, cu, 2, state, 4, idx, replay, 4096, &o, &pp); break;
        }
        bad_verdict(bad[b].what, st, bad[b].want, &ob, state);
    }
    gbuf_free(&ob);
    free_inputs(&in);
}

/* The other entry points' bad input: decode (shapes, slots), the reference, and the machine
 * benchmarks and workspace query. */
static void test_more_bad_input(void)
{
    gcase c = {3, 2, 4, 8, 8, FW_F32, 0, 1.0, 0.0, 0.0f, 0};
    ginputs in;
    make_inputs(&in, &c, 9);
    int64_t os[3] = {3, 4, 8};
    gbuf ob = gbuf_new(3 * 4 * 8 * 4);
    fw_tensor o = fw_tensor_contiguous(ob.p, FW_F32, 3, os);
    float state[BAD_STATE];
    for (int i = 0; i < BAD_STATE; i++)
        state[i] = 1.0f;
    int32_t idx[3] = {0, 1, 2}, oob[3] = {0, 1, 4}, dup[3] = {0, 2, 2}, cu[2] = {0, 3};
    fw_gdn_params p;
    fw_gdn_params_init(&p);
    double fin[4 * 8 * 8];
    for (int b = 0; b < 8; b++) {
        fw_tensor q = in.q, beta = in.beta;
        fw_status want, st;
        const char *what;
        memset(ob.p, 0xA5, ob.bytes);
        switch (b) {
        case 0: what = "decode: null state"; want = FW_ERR_NULL;
            st = fw_gdn_decode(&q, &in.k, &in.v, &in.g, &beta, NULL, 4, idx, &o, &p); break;
        case 1: what = "decode: slot out of range"; want = FW_ERR_INDEX;
            st = fw_gdn_decode(&q, &in.k, &in.v, &in.g, &beta, state, 4, oob, &o, &p); break;
        case 2: what = "decode: two sequences on one slot"; want = FW_ERR_INDEX;
            st = fw_gdn_decode(&q, &in.k, &in.v, &in.g, &beta, state, 4, dup, &o, &p); break;
        case 3: what = "decode: beta of the wrong shape"; want = FW_ERR_SHAPE; beta.shape[1] = 3;
            st = fw_gdn_decode(&q, &in.k, &in.v, &in.g, &beta, state, 4, idx, &o, &p); break;
        case 4: what = "decode: null state_indices"; want = FW_ERR_NULL;
            st = fw_gdn_decode(&q, &in.k, &in.v, &in.g, &beta, state, 4, NULL, &o, &p); break;
        case 5: what = "reference: q of rank 2"; want = FW_ERR_SHAPE; q.ndim = 2;
            st = fw_gdn_ref(&q, &in.k, &in.v, &in.g, &beta, cu, 1, NULL, fin, &o, &p); break;
        case 6: what = "reference: null cu_seqlens"; want = FW_ERR_NULL;
            st = fw_gdn_ref(&q, &in.k, &in.v, &in.g, &beta, NULL, 1, NULL, fin, &o, &p); break;
        default: what = "decode: threads 999"; want = FW_ERR_ARG; p.threads = 999;
            st = fw_gdn_decode(&q, &in.k, &in.v, &in.g, &beta, state, 4, idx, &o, &p); p.threads = 0; break;
        }
        bad_verdict(what, st, want, &ob, state);
    }
    gbuf_free(&ob);
    free_inputs(&in);

    case_begin("bad input: machine benchmarks and the workspace query");
    double g = -1;
    case_check(fw_peak_gflops(NULL, 0, 0.01, NULL) == FW_ERR_NULL, "peak: null result");
    case_check(fw_peak_gflops(NULL, -3, 0.01, &g) == FW_ERR_ARG && g == -1, "peak: threads -3");
    case_check(fw_peak_gflops(NULL, 1, 0.0, &g) == FW_ERR_ARG, "peak: zero seconds");
    case_check(fw_peak_gflops("sve9", 1, 0.01, &g) == FW_ERR_UNSUPPORTED, "peak: unknown table");
    case_check(fw_peak_bf16_gflops(NULL, 0, 0.01, NULL) == FW_ERR_NULL, "bf16 peak: null result");
    case_check(fw_peak_bf16_gflops(NULL, -3, 0.01, &g) == FW_ERR_ARG && g == -1, "bf16 peak: threads -3");
    case_check(fw_peak_bf16_gflops(NULL, 1, 0.0, &g) == FW_ERR_ARG, "bf16 peak: zero seconds");
    case_check(fw_peak_bf16_gflops("sve9", 1, 0.01, &g) == FW_ERR_UNSUPPORTED, "bf16 peak: unknown table");
    case_check(fw_read_bandwidth(1, 100, &g) == FW_ERR_ARG && g == -1, "bandwidth: 100 bytes");
    case_check(fw_read_bandwidth(300, (size_t)1 << 20, &g) == FW_ERR_ARG, "bandwidth: threads 300");
    case_check(fw_read_bandwidth(1, (size_t)1 << 20, NULL) == FW_ERR_NULL, "bandwidth: null result");
    size_t bytes = 0;
    int64_t qs[4] = {1, 4, 6, 8}, ks[4] = {1, 4, 4, 8};
    fw_tensor tq = fw_tensor_contiguous(NULL, FW_F32, 4, qs), tk = fw_tensor_contiguous(NULL, FW_F32, 4, ks);
    case_check(fw_attn_workspace_size(&tq, &tk, &tk, NULL, &bytes) == FW_ERR_SHAPE && bytes == 0,
               "workspace: 4 K/V heads do not divide 6");
    case_check(fw_attn_workspace_size(&tq, &tk, &tk, NULL, NULL) == FW_ERR_NULL, "workspace: null result");
    {
        fw_attn_params wp;
        fw_attn_params_init(&wp);
        wp.precision = 7;
        int64_t ks4[4] = {1, 4, 3, 8};
        fw_tensor tk3 = fw_tensor_contiguous(NULL, FW_F32, 4, ks4);
        case_check(fw_attn_workspace_size(&tq, &tk3, &tk3, &wp, &bytes) == FW_ERR_ARG && bytes == 0 &&
                       strstr(fw_last_error(), "precision"), "workspace: precision 7");
    }
    case_check(fw_peak_gflops(NULL, 1, 0.01, &g) == FW_OK && g > 0, "peak: a good call measures");
    case_check(fw_peak_bf16_gflops(NULL, 1, 0.01, &g) == FW_OK && g > 0, "bf16 peak: a good call measures");
    case_check(fw_read_bandwidth(1, (size_t)1 << 22, &g) == FW_OK && g > 0, "bandwidth: a good call measures");
    case_end();
}

/* Two sequences on one state slot, far apart in a large batch, are refused (a race otherwise)
 * by decode, verify and commit, with both sequences named and nothing written. */
static void test_far_duplicate_slots(void)
{
    enum { N = 6000 };
    case_begin("gdn: duplicate state slots 5996 sequences apart are refused");
    static float q[N], k[N], v[N], g[N], b[N], o[N], state[N], replay[N * 4];
    static int32_t idx[N], cu[N + 1], acc[N];
    int64_t s3[3] = {N, 1, 1}, s2[2] = {N, 1};
    fw_tensor tq = fw_tensor_contiguous(q, FW_F32, 3, s3), tk = fw_tensor_contiguous(k, FW_F32, 3, s3),
              tv = fw_tensor_contiguous(v, FW_F32, 3, s3), to = fw_tensor_contiguous(o, FW_F32, 3, s3),
              tg = fw_tensor_contiguous(g, FW_F32, 2, s2), tb = fw_tensor_contiguous(b, FW_F32, 2, s2);
    for (int i = 0; i < N; i++) {
        q[i] = k[i] = v[i] = 1.0f;
        g[i] = -0.5f;
        b[i] = 0.5f;
        state[i] = 2.0f;
        o[i] = 7.0f;
        idx[i] = i;
        cu[i + 1] = i + 1;
        acc[i] = 1;
    }
    idx[N - 1] = 3;
    fw_gdn_params p;
    fw_gdn_params_init(&p);
    const size_t rf = fw_gdn_replay_floats(N, 1, 1, 1, 1);
    for (int call = 0; call < 3; call++) {
        fw_status st = call == 0   ? fw_gdn_decode(&tq, &tk, &tv, &tg, &tb, state, N, idx, &to, &p)
                       : call == 1 ? fw_gdn_verify(&tq, &tk, &tv, &tg, &tb, cu, N, state, N, idx, replay, rf, &to, &p)
                                   : fw_gdn_commit(cu, N, acc, 1, 1, 1, 1, state, N, idx, replay, rf, &p);
        case_check(st == FW_ERR_INDEX && strstr(fw_last_error(), "sequences 3 and 5999"),
                   "call %d: status %d, \"%s\"", call, (int)st, fw_last_error());
    }
    int untouched = 1;
    for (int i = 0; i < N; i++)
        untouched &= state[i] == 2.0f && o[i] == 7.0f;
    case_check(untouched, "the state or the output was written");
    case_end();
}

static void sweep_lengths(void)
{
    static const int64_t T[] = {1, 63, 64, 65, 150, 1000};
    for (int i = 0; i < 6; i++) {
        if (quick_mode() && T[i] > 150)
            continue;
        /* HV/H in {1, 2, 3}, dk != dv, every dtype, l2norm in and out of the kernel */
        gcase c = {0, 2, 2 * (1 + i % 3), 32, 24, (fw_dtype)(i % 3), i % 2, 1.0, 0.3, 0.0f, 0};
        int32_t len = (int32_t)T[i];
        run_gcase(&c, &len, 1, 40 + i);
    }
}

/* (b) varlen packing with empty sequences, (d) decays near -50 per step, correlated keys */
static void sweep_varlen(void)
{
    static const int32_t lens[] = {65, 0, 1, 130, 7};
    gcase c = {0, 2, 4, 48, 40, FW_BF16, 1, 1.0, 0.5, 0.0f, 0};
    run_gcase(&c, lens, 5, 60);
    gcase strong = {0, 1, 3, 32, 16, FW_F32, 1, 50.0, 0.9, 0.0f, 0};
    run_gcase(&strong, lens, 5, 61);
    /* an eps that moves the norms by several percent: every path must use it */
    gcase eps = {0, 2, 2, 32, 24, FW_F32, 1, 1.0, 0.3, 4.0f, 0};
    run_gcase(&eps, lens, 5, 62);
}

/* KDA (per-channel decays): lengths across the chunk and block boundaries, GVA, every dtype,
 * varlen with empty sequences, decays near -50 per step and channel */
static void sweep_kda(void)
{
    static const int64_t T[] = {1, 15, 16, 17, 63, 64, 65, 150, 1000};
    for (int i = 0; i < 9; i++) {
        if (quick_mode() && T[i] > 150)
            continue;
        gcase c = {0, 2, 2 * (1 + i % 3), 32 + 8 * (i % 2), 24, (fw_dtype)(i % 3), i % 2, 1.0, 0.3, 0.0f, 1};
        int32_t len = (int32_t)T[i];
        run_gcase(&c, &len, 1, 140 + i);
    }
    static const int32_t lens[] = {65, 0, 1, 130, 7};
    gcase c = {0, 2, 4, 48, 40, FW_BF16, 1, 1.0, 0.5, 0.0f, 1};
    run_gcase(&c, lens, 5, 160);
    gcase strong = {0, 1, 3, 32, 16, FW_F32, 1, 50.0, 0.9, 0.0f, 1};
    run_gcase(&strong, lens, 5, 161);
    gcase mild = {0, 1, 1, 128, 128, FW_F32, 1, 0.05, 0.3, 0.0f, 1};
    int32_t len = 200;
    run_gcase(&mild, &len, 1, 162);
}

/* The chunked pass's q/k head groups (fw_gdn_head_group): the heuristic's sizes, and the same
 * bits of out and final state on 1, 2, 4 and 7 threads, which group 4, 4, 2 and 1 heads here
 * (6 q/k heads: a group of 4 leaves one of 2), GDN and KDA, both precisions, every table. */
static void test_head_groups(void)
{
    case_begin("head group sizes");
    case_check(fw_gdn_head_group(32, 1, 128, 128, 1, 2) == 8, "KDA's 32 heads on 2 threads: %d",
               fw_gdn_head_group(32, 1, 128, 128, 1, 2));
    case_check(fw_gdn_head_group(16, 2, 128, 128, 1, 2) == 4, "Qwen3-Next's 16 x 2 heads on 2 threads: %d",
               fw_gdn_head_group(16, 2, 128, 128, 1, 2));
    case_check(fw_gdn_head_group(16, 2, 128, 128, 1, 16) == 1, "16 threads: %d",
               fw_gdn_head_group(16, 2, 128, 128, 1, 16));
    case_check(fw_gdn_head_group(16, 2, 128, 128, 8, 16) == 4, "8 sequences on 16 threads: %d",
               fw_gdn_head_group(16, 2, 128, 128, 8, 16));
    case_check(fw_gdn_head_group(6, 1, 32, 32, 1, 1) == 4, "6 heads, one thread: %d", fw_gdn_head_group(6, 1, 32, 32, 1, 1));
    case_check(fw_gdn_head_group(1, 64, 256, 256, 1, 1) == 1, "one head: %d", fw_gdn_head_group(1, 64, 256, 256, 1, 1));
    for (int64_t H = 1; H <= 64; H++)
        for (int th = 1; th <= 8; th++) { /* 3 sequences, states of 32 KiB: only H and the items bind */
            const int hg = fw_gdn_head_group(H, 1, 64, 64, 3, th);
            const int fits = hg == 1 || 3 * ((H + hg - 1) / hg) >= 2 * th;
            const int larger = 2 * hg <= FW_GDN_GROUP_MAX && 2 * hg <= H && 3 * ((H + 2 * hg - 1) / (2 * hg)) >= 2 * th;
            case_check(hg >= 1 && hg <= H && (hg & (hg - 1)) == 0 && fits && !larger,
                       "H %lld threads %d: group %d", (long long)H, th, hg);
        }
    case_end();
    static const int32_t lens[] = {70, 1, 129};
    int32_t cu[4] = {0, 70, 71, 200};
    for (int kda = 0; kda < 2; kda++)
        for (int prec = FW_PREC_F32; prec <= FW_PREC_BF16; prec++) {
            const gcase c = {cu[3], 6, 12, 32, 24, FW_BF16, 1, 1.0, 0.3, 0.0f, kda};
            case_begin("%s %s products: 3 sequences (%d, %d, %d), H 6, HV 12, 1/2/4/7 threads", kda ? "kda" : "gdn",
                       prec == FW_PREC_BF16 ? "bf16" : "f32", lens[0], lens[1], lens[2]);
            ginputs in;
            make_inputs(&in, &c, 300 + (uint64_t)(2 * kda + prec));
            const int64_t no = c.T * c.HV * c.dv, ns = 3 * c.HV * c.dk * c.dv;
            int64_t os[3] = {c.T, c.HV, c.dv};
            float *init = malloc(sizeof(float) * (size_t)ns), *fin = malloc(sizeof(float) * (size_t)ns),
                  *fin1 = malloc(sizeof(float) * (size_t)ns);
            rng_seed(301);
            for (int64_t i = 0; i < ns; i++)
                init[i] = (float)(0.3 * rng_normal());
            gbuf ob = gbuf_new((size_t)no * 2), o1 = gbuf_new((size_t)no * 2);
            fw_tensor to = fw_tensor_contiguous(ob.p, c.dt, 3, os);
            fw_gdn_params p;
            fw_gdn_params_init(&p);
            p.l2norm_qk = 1;
            p.precision = prec;
            for (int it = 0; it < fw_isa_count(); it++) {
                if (!test_table(fw_isa_name(it)))
                    continue;
                p.isa = fw_isa_name(it);
                static const int threads[] = {1, 2, 4, 7};
                for (int ti = 0; ti < 4; ti++) {
                    p.threads = threads[ti];
                    memset(ob.p, 0xA5, ob.bytes);
                    const fw_status st = fw_gdn_prefill(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, 3, init, fin, &to, &p);
                    case_check(st == FW_OK, "[%s] %d threads: %s", p.isa, p.threads, fw_last_error());
                    if (ti == 0) {
                        memcpy(o1.p, ob.p, ob.bytes);
                        memcpy(fin1, fin, sizeof(float) * (size_t)ns);
                        continue;
                    }
                    case_check(memcmp(o1.p, ob.p, ob.bytes) == 0, "[%s] out: 1 and %d threads (groups %d, %d) differ",
                               p.isa, p.threads, fw_gdn_head_group(6, 2, 32, 24, 3, 1),
                               fw_gdn_head_group(6, 2, 32, 24, 3, p.threads));
                    case_check(fw_gdn_head_group(6, 2, 32, 24, 3, p.threads) == (int[]){4, 4, 2, 1}[ti],
                               "%d threads: group %d", p.threads, fw_gdn_head_group(6, 2, 32, 24, 3, p.threads));
                    case_check(memcmp(fin1, fin, sizeof(float) * (size_t)ns) == 0,
                               "[%s] final state: 1 and %d threads differ", p.isa, p.threads);
                }
            }
            free(init); free(fin); free(fin1);
            gbuf_free(&ob); gbuf_free(&o1);
            free_inputs(&in);
            case_end();
        }
}

/* The gate scan runs in items of tokens on the call's threads: the first bad gate is the one
 * reported whichever item finds one first, with bad rows in two later items, NaN and +inf
 * and a positive value, a channel past the first (KDA), 1 and 3 threads; nothing written. */
static void test_gate_scan(void)
{
    for (int kda = 0; kda < 2; kda++) {
        const gcase c = {900, 1, 2, 8, 8, FW_F32, 0, 1.0, 0.0, 0.0f, kda};
        case_begin("%s gate scan, T 900, bad rows at tokens 601 and 300", kda ? "kda" : "gdn");
        ginputs in;
        make_inputs(&in, &c, 400 + (uint64_t)kda);
        float *g = in.g.data;
        const int64_t n = kda ? c.dk : 1;
        g[(601 * c.HV + 0) * n + (n - 1)] = NAN;      /* a later item's bad row */
        g[(300 * c.HV + 1) * n + (n > 1 ? 3 : 0)] = 0.25f; /* the first bad row: token 300, head 1 */
        g[(850 * c.HV + 1) * n] = INFINITY;
        int64_t os[3] = {c.T, c.HV, c.dv};
        gbuf ob = gbuf_new((size_t)(c.T * c.HV * c.dv) * 4);
        fw_tensor to = fw_tensor_contiguous(ob.p, FW_F32, 3, os);
        int32_t cu[2] = {0, (int32_t)c.T};
        for (int th = 1; th <= 3; th += 2) {
            fw_gdn_params p;
            fw_gdn_params_init(&p);
            p.threads = th;
            memset(ob.p, 0x5A, ob.bytes);
            const fw_status st = fw_gdn_prefill(&in.q, &in.k, &in.v, &in.g, &in.beta, cu, 1, NULL, NULL, &to, &p);
            const char *want = kda ? "g[300][1][3] = 0.25" : "g[300][1] = 0.25";
            case_check(st == FW_ERR_ARG && strstr(fw_last_error(), want), "%d threads: status %d, %s (want %s)", th,
                       (int)st, fw_last_error(), want);
            int untouched = 1;
            for (size_t i = 0; i < ob.bytes; i++)
                untouched &= ((unsigned char *)ob.p)[i] == 0x5A;
            case_check(untouched, "%d threads: out written", th);
        }
        gbuf_free(&ob);
        free_inputs(&in);
        case_end();
    }
}

static void test_verify_commit(void)
{
    verify_commit(0);
    verify_commit(1);
}

const test_suite gdn_suites[] = {
    {"gdn.far_duplicate_slots", test_far_duplicate_slots},
    {"gdn.more_bad_input", test_more_bad_input},
    {"gdn.bad_input", test_gdn_bad_input},
    {"gdn.inverse_stability", test_inverse_stability},
    {"gdn.decode_step", test_decode_step},
    {"gdn.state_pool", test_state_pool},
    {"gdn.state_pool_bf16", test_state_pool_bf16},
    {"gdn.kernel_gates", test_kernel_gates},
    {"gdn.kda_gates", test_kda_gates},
    {"gdn.kda_gate_kernel", test_kda_gate_kernel},
    {"gdn.kda_scale_kernel", test_kda_scale_kernel},
    {"gdn.verify_commit", test_verify_commit},
    {"gdn.head_groups", test_head_groups},
    {"gdn.gate_scan", test_gate_scan},
    {"gdn.split_state", test_split_state},
    {"gdn.sweep_lengths", sweep_lengths},
    {"gdn.sweep_varlen", sweep_varlen},
    {"gdn.sweep_kda", sweep_kda},
    {NULL, NULL}};
