/*
 * test_nan.c: how NaN and inf travel (docs/design.md, "NaN and inf"), on every path and table, in both
 * precisions.
 * Attention: a NaN or inf in a query row makes that output row and its lse NaN; a NaN in a key
 * row makes NaN every row that sees the key; a NaN or +inf attention sink makes every row of
 * its head NaN (a -inf one is no sink); every other row stays finite. Paths: the tiled
 * prefill, the decode kernel on one key split, and on several splits (the log-sum-exp merge).
 * Gated DeltaNet: a NaN in q at token t makes the outputs of token t (its value heads) NaN and
 * nothing else; a NaN in k at token t makes NaN every output of its value heads from the start
 * of t's 64-token chunk on (from t itself on the recurrent modes) and their final state, and
 * leaves the earlier chunks and the other heads finite.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "test_util.h"

static int all_nan(const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isnan(x[i]))
            return 0;
    return 1;
}

static int all_finite(const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return 0;
    return 1;
}

/* Attention, dense batch of 1, hq 4, hkv 2 (G = 2), d 32, causal, f32 in and out. `what`: 0 a
 * NaN in q, 1 an inf in q, 2 a NaN in k row 0 of K/V head 0 (every query sees key 0), 3 a
 * -inf in q where every key of its K/V head is positive, so that every score of the row is
 * -inf: exp(-inf - (-inf)) is NaN, not the 0 and -inf of a row that sees no key (found by
 * fuzz/fuzz_attn.c). With attention sinks (finite on the other heads): 4 a NaN sink on head h
 * and 5 a +inf one make every row of head h NaN (exp(inf - inf) in the reference too); 6 a
 * -inf sink is no sink, every row finite. flags: the kernel (0, FW_ATTN_PLAIN,
 * FW_ATTN_ONLINE_SOFTMAX). */
static void attn_case(const char *table, int prec, int64_t sq, int64_t sk, int what, uint32_t flags)
{
    const int64_t hq = 4, hkv = 2, d = 32, r = sq - 1, h = 1;
    int64_t qs[4] = {1, sq, hq, d}, ks[4] = {1, sk, hkv, d}, ls[3] = {1, hq, sq};
    float *q = malloc(sizeof(float) * (size_t)(sq * hq * d)), *k = malloc(sizeof(float) * (size_t)(sk * hkv * d));
    float *v = malloc(sizeof(float) * (size_t)(sk * hkv * d)), *o = malloc(sizeof(float) * (size_t)(sq * hq * d));
    float *lse = malloc(sizeof(float) * (size_t)(hq * sq));
    fw_tensor tq = fw_tensor_contiguous(q, FW_F32, 4, qs), tk = fw_tensor_contiguous(k, FW_F32, 4, ks),
              tv = fw_tensor_contiguous(v, FW_F32, 4, ks), to = fw_tensor_contiguous(o, FW_F32, 4, qs),
              tl = fw_tensor_contiguous(lse, FW_F32, 3, ls);
    rng_seed(5);
    tfill_normal(&tq, 1.0);
    tfill_normal(&tk, 1.0);
    tfill_normal(&tv, 1.0);
    float sinks[4] = {0.5f, what == 4 ? NAN : what == 5 ? INFINITY : -INFINITY, -1.0f, 2.0f};
    fw_tensor ts = fw_tensor_contiguous(sinks, FW_F32, 1, &hq);
    if (what == 2)
        k[3] = NAN;
    else if (what < 4)
        q[(r * hq + h) * d + 7] = what == 3 ? -INFINITY : what ? INFINITY : NAN;
    if (what == 3)
        for (int64_t j = 0; j < sk; j++)
            k[(j * hkv + h / (hq / hkv)) * d + 7] = fabsf(k[(j * hkv + h / (hq / hkv)) * d + 7]) + 0.5f;
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.causal = 1;
    p.isa = table;
    p.precision = prec;
    p.threads = 2;
    p.flags = flags;
    p.sinks = what >= 4 ? &ts : NULL;
    static const char *kinds[] = {"NaN in q", "inf in q", "NaN in k", "every score -inf",
                                  "a NaN sink", "a +inf sink", "a -inf sink"};
    case_begin("NaN/inf: attention %s, sq %lld sk %lld, %s, %s products, flags %u", kinds[what],
               (long long)sq, (long long)sk, table, prec == FW_PREC_BF16 ? "bf16" : "f32",
               (unsigned)flags);
    fw_status st = fw_attn_fwd(&tq, &tk, &tv, &to, &tl, &p);
    case_check(st == FW_OK, "status %s", fw_last_error());
    for (int64_t i = 0; i < sq; i++)
        for (int64_t j = 0; j < hq; j++) {
            const float *orow = o + (i * hq + j) * d, l = lse[j * sq + i];
            const int hit = what == 2 ? j / (hq / hkv) == 0 : what >= 4 ? what < 6 && j == h
                                                                         : i == r && j == h;
            if (hit)
                case_check(all_nan(orow, d) && isnan(l), "row %lld head %lld: not NaN (out[0] %g, lse %g)",
                           (long long)i, (long long)j, (double)orow[0], (double)l);
            else
                case_check(all_finite(orow, d) && isfinite(l), "row %lld head %lld: not finite (out[0] %g, lse %g)",
                           (long long)i, (long long)j, (double)orow[0], (double)l);
        }
    case_end();
    free(q); free(k); free(v); free(o); free(lse);
}

/* Gated DeltaNet, T 150 (chunks at 0, 64, 128), H 2, HV 4, dk 32, dv 24, f32, l2norm in the
 * kernel; a NaN at token 70 of q/k head 0 (its value heads 0 and 1). */
static void gdn_case(const char *table, uint32_t flags, int prec, int in_k)
{
    enum { T = 150, H = 2, HV = 4, DK = 32, DV = 24, TN = 70 };
    int64_t qs[3] = {T, H, DK}, vs[3] = {T, HV, DV}, gs[2] = {T, HV};
    static float q[T * H * DK], k[T * H * DK], v[T * HV * DV], g[T * HV], b[T * HV], o[T * HV * DV];
    static float st[HV * DK * DV];
    fw_tensor tq = fw_tensor_contiguous(q, FW_F32, 3, qs), tk = fw_tensor_contiguous(k, FW_F32, 3, qs),
              tv = fw_tensor_contiguous(v, FW_F32, 3, vs), tg = fw_tensor_contiguous(g, FW_F32, 2, gs),
              tb = fw_tensor_contiguous(b, FW_F32, 2, gs), to = fw_tensor_contiguous(o, FW_F32, 3, vs);
    rng_seed(9);
    tfill_normal(&tq, 1.0);
    tfill_normal(&tk, 1.0);
    tfill_normal(&tv, 1.0);
    for (int i = 0; i < T * HV; i++) {
        g[i] = (float)(-0.1 - 0.2 * rng_uniform());
        b[i] = (float)(0.2 + 0.6 * rng_uniform());
    }
    (in_k ? k : q)[(TN * H + 0) * DK + 5] = NAN;
    fw_gdn_params p;
    fw_gdn_params_init(&p);
    p.l2norm_qk = 1;
    p.isa = table;
    p.flags = flags;
    p.precision = prec;
    p.threads = 2;
    const int32_t cu[2] = {0, T};
    const int chunked = !(flags & (FW_GDN_RECURRENT | FW_GDN_FUSED_RECURRENT));
    case_begin("NaN/inf: gdn prefill, NaN in %s, %s, flags %u, %s products", in_k ? "k" : "q", table,
               (unsigned)flags, prec == FW_PREC_BF16 ? "bf16" : "f32");
    fw_status s = fw_gdn_prefill(&tq, &tk, &tv, &tg, &tb, cu, 1, NULL, st, &to, &p);
    case_check(s == FW_OK, "status %s", fw_last_error());
    const int first = in_k ? (chunked ? TN / 64 * 64 : TN) : TN;
    for (int t = 0; t < T; t++)
        for (int vh = 0; vh < HV; vh++) {
            const float *orow = o + (t * HV + vh) * DV;
            const int nan_row = vh < 2 && (in_k ? t >= first : t == TN);
            if (nan_row)
                case_check(all_nan(orow, DV), "token %d value head %d: not NaN", t, vh);
            else if (!(in_k && vh < 2 && t >= TN / 64 * 64)) /* the chunk before t: either */
                case_check(all_finite(orow, DV), "token %d value head %d: not finite", t, vh);
        }
    for (int vh = 0; vh < HV; vh++) {
        const float *sv = st + (size_t)vh * DK * DV;
        if (in_k && vh < 2)
            case_check(all_nan(sv, DK * DV), "final state of value head %d: not NaN", vh);
        else
            case_check(all_finite(sv, DK * DV), "final state of value head %d: not finite", vh);
    }
    case_end();
}

/* GDN decode: a NaN in q of sequence 0 makes its outputs NaN and leaves its state finite; in
 * k, both NaN; sequence 1 untouched either way. */
static void gdn_decode_case(const char *table, int in_k)
{
    enum { N = 2, H = 1, HV = 2, DK = 16, DV = 16 };
    int64_t qs[3] = {N, H, DK}, vs[3] = {N, HV, DV}, gs[2] = {N, HV};
    float q[N * H * DK], k[N * H * DK], v[N * HV * DV], g[N * HV], b[N * HV], o[N * HV * DV];
    float st[N * HV * DK * DV];
    fw_tensor tq = fw_tensor_contiguous(q, FW_F32, 3, qs), tk = fw_tensor_contiguous(k, FW_F32, 3, qs),
              tv = fw_tensor_contiguous(v, FW_F32, 3, vs), tg = fw_tensor_contiguous(g, FW_F32, 2, gs),
              tb = fw_tensor_contiguous(b, FW_F32, 2, gs), to = fw_tensor_contiguous(o, FW_F32, 3, vs);
    rng_seed(11);
    tfill_normal(&tq, 1.0);
    tfill_normal(&tk, 1.0);
    tfill_normal(&tv, 1.0);
    for (int i = 0; i < N * HV; i++) {
        g[i] = -0.1f;
        b[i] = 0.5f;
    }
    for (int i = 0; i < N * HV * DK * DV; i++)
        st[i] = (float)(0.1 * rng_normal());
    (in_k ? k : q)[3] = NAN;
    const int32_t idx[N] = {0, 1};
    fw_gdn_params p;
    fw_gdn_params_init(&p);
    p.l2norm_qk = 1;
    p.isa = table;
    case_begin("NaN/inf: gdn decode, NaN in %s, %s", in_k ? "k" : "q", table);
    fw_status s = fw_gdn_decode(&tq, &tk, &tv, &tg, &tb, st, N, idx, &to, &p);
    case_check(s == FW_OK, "status %s", fw_last_error());
    case_check(all_nan(o, HV * DV), "sequence 0's outputs are not NaN");
    case_check(all_finite(o + HV * DV, HV * DV), "sequence 1's outputs are not finite");
    case_check(in_k ? all_nan(st, HV * DK * DV) : all_finite(st, HV * DK * DV), "sequence 0's state");
    case_check(all_finite(st + HV * DK * DV, HV * DK * DV), "sequence 1's state is not finite");
    case_end();
}

/* A key whose score is -inf (its k row -inf, every q entry positive) and whose value holds an
 * inf: probability 0 times inf is NaN in that value column, on one key split or in a split of
 * its own (sk = 513: the last key alone in the second split), where the merge used to drop
 * the split (found by fuzz/fuzz_kvcache.c). The other columns and lse stay finite. */
static void attn_inf_value_zero_weight(const char *table, int prec, int64_t sk)
{
    enum { HQ = 2, D = 8 };
    int64_t qs[4] = {1, 1, HQ, D}, ks[4] = {1, sk, 1, D}, ls[3] = {1, HQ, 1};
    float q[HQ * D], o[HQ * D], lse[HQ];
    float *k = malloc(sizeof(float) * (size_t)(sk * D)), *v = malloc(sizeof(float) * (size_t)(sk * D));
    fw_tensor tq = fw_tensor_contiguous(q, FW_F32, 4, qs), tk = fw_tensor_contiguous(k, FW_F32, 4, ks),
              tv = fw_tensor_contiguous(v, FW_F32, 4, ks), to = fw_tensor_contiguous(o, FW_F32, 4, qs),
              tl = fw_tensor_contiguous(lse, FW_F32, 3, ls);
    rng_seed(6);
    tfill_normal(&tk, 1.0);
    tfill_normal(&tv, 1.0);
    for (int i = 0; i < HQ * D; i++)
        q[i] = 0.25f + (float)rng_uniform();
    for (int c = 0; c < D; c++)
        k[(sk - 1) * D + c] = -INFINITY;
    v[(sk - 1) * D] = INFINITY;
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.isa = table;
    p.precision = prec;
    p.threads = 2;
    case_begin("NaN/inf: attention, a -inf score on an inf value, sk %lld, %s, %s products", (long long)sk,
               table, prec == FW_PREC_BF16 ? "bf16" : "f32");
    fw_status st = fw_attn_fwd(&tq, &tk, &tv, &to, &tl, &p);
    case_check(st == FW_OK, "status %s", fw_last_error());
    for (int h = 0; h < HQ; h++) {
        case_check(isnan(o[h * D]), "head %d: column 0 is %g, not NaN", h, (double)o[h * D]);
        case_check(all_finite(o + h * D + 1, D - 1) && isfinite(lse[h]), "head %d: other columns or lse not finite", h);
    }
    case_end();
    free(k);
    free(v);
}

/* Multi-token decode (3 rows per K/V head, causal) over 567 keys, the second split 55 keys
 * long: a NaN in the last key row 1 sees (565), which row 0 does not see. The decode softmax
 * lost it where the running maximum had met the NaN and then a masked key, and zeroed the
 * tile (found by fuzz/fuzz_kvcache.c, on the portable table). */
static void attn_nan_last_visible(const char *table, int prec)
{
    enum { SQ = 3, SK = 567, H = 2, D = 8 };
    static float q[SQ * H * D], k[SK * H * D], v[SK * H * D], o[SQ * H * D];
    int64_t qs[4] = {1, SQ, H, D}, ks[4] = {1, SK, H, D};
    fw_tensor tq = fw_tensor_contiguous(q, FW_F32, 4, qs), tk = fw_tensor_contiguous(k, FW_F32, 4, ks),
              tv = fw_tensor_contiguous(v, FW_F32, 4, ks), to = fw_tensor_contiguous(o, FW_F32, 4, qs);
    rng_seed(7);
    tfill_normal(&tq, 1.0);
    tfill_normal(&tk, 1.0);
    tfill_normal(&tv, 1.0);
    k[(565 * H + 1) * D + 3] = NAN;
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.causal = 1;
    p.isa = table;
    p.precision = prec;
    p.threads = 2;
    case_begin("NaN/inf: attention, NaN in the last key a decode row sees, %s, %s products", table,
               prec == FW_PREC_BF16 ? "bf16" : "f32");
    fw_status st = fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p);
    case_check(st == FW_OK, "status %s", fw_last_error());
    for (int r = 0; r < SQ; r++) {
        const float *row = o + (r * H + 1) * D;
        case_check(r == 0 ? all_finite(row, D) : all_nan(row, D), "row %d of head 1: out[0] %g", r, (double)row[0]);
        case_check(all_finite(o + (r * H) * D, D), "row %d of head 0 not finite", r);
    }
    case_end();
}

static void nan_attn(void)
{
    for (int it = 0; it < fw_isa_count(); it++) {
        const char *t = fw_isa_name(it);
        if (!test_table(t))
            continue;
        for (int prec = FW_PREC_F32; prec <= FW_PREC_BF16; prec++)
            for (int what = 0; what < 7; what++) {
                attn_case(t, prec, 70, 70, what, 0);   /* tiled prefill */
                attn_case(t, prec, 70, 70, what, FW_ATTN_ONLINE_SOFTMAX);
                attn_case(t, prec, 1, 300, what, 0);   /* decode, one split */
                attn_case(t, prec, 1, 1500, what, 0);  /* decode, three splits and the merge */
            }
        for (int what = 0; what < 7; what++) /* the plain kernel (f32 products only) */
            attn_case(t, FW_PREC_F32, 70, 70, what, FW_ATTN_PLAIN);
        for (int prec = FW_PREC_F32; prec <= FW_PREC_BF16; prec++) {
            attn_inf_value_zero_weight(t, prec, 300);
            attn_inf_value_zero_weight(t, prec, 513);
            attn_nan_last_visible(t, prec);
        }
    }
}

static void nan_gdn(void)
{
    for (int it = 0; it < fw_isa_count(); it++) {
        const char *t = fw_isa_name(it);
        if (!test_table(t))
            continue;
        for (int prec = FW_PREC_F32; prec <= FW_PREC_BF16; prec++)
            for (int in_k = 0; in_k < 2; in_k++) {
                gdn_case(t, 0, prec, in_k);
                gdn_case(t, FW_GDN_FWD_SUBST, prec, in_k);
            }
        for (int in_k = 0; in_k < 2; in_k++) {
            gdn_case(t, FW_GDN_RECURRENT, FW_PREC_F32, in_k);
            gdn_case(t, FW_GDN_FUSED_RECURRENT, FW_PREC_F32, in_k);
            gdn_decode_case(t, in_k);
        }
    }
}

const test_suite nan_suites[] = {
    {"nan.attn", nan_attn},
    {"nan.gdn", nan_gdn},
    {NULL, NULL}};
