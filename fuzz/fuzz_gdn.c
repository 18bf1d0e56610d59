/*
 * fuzz_gdn.c: libFuzzer harness of Gated DeltaNet: prefill (chunked with either inverse, and
 * the recurrent modes), decode on a slot array, and speculative verify followed by commit.
 * The problem: packed batches (sequences past a 64-token chunk now and then), any HV/H ratio,
 * head dims, dtypes and layouts (fuzz_util.h), decays from gentle to -50 per token, with or
 * without the in-kernel l2 norm, initial and final states (absent, separate or one buffer),
 * KDA's per-channel decays (g [T, HV, dk]) a third of the time,
 * and broken on purpose now and then: a positive, NaN or -inf decay, a NaN beta, a slot out of
 * range or used twice, a verify window over 64 tokens, a replay buffer one float short, an
 * accepted count out of range, offsets that do not add up.
 * Checks (beyond fuzz_util.h's): on FW_OK, outputs and states against fw_gdn_ref (the exact
 * recurrence, and the same-roundings chunked pass on bf16 products), every state slot the
 * call does not own byte-identical, verify leaving the state untouched, and commit giving
 * the state after the accepted tokens.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "attn/attn.h"
#include "fuzz_util.h"
#include "test_util.h"

#define MAXN 6
static const fw_dtype dts[3] = {FW_F32, FW_BF16, FW_F16};

typedef struct {
    fz_tensor q, k, v, g, beta, o;
    int vq, vk, vv;
} gdn_inputs;

/* q, k [T, H, dk], v [T, HV, dv], g [T, HV] (KDA: [T, HV, dk]) and beta [T, HV] f32, out
 * [T, HV, dv]; g and beta drawn here (g <= 0 with a per-call scale of decay, beta in [0, 1]).
 * Returns 1 if broken. */
static int draw_inputs(fz_in *in, gdn_inputs *x, fw_dtype dt, fw_dtype odt, int64_t T, int64_t H,
                       int64_t HV, int64_t dk, int64_t dv, int l2, int kda)
{
    int64_t qs[3] = {T, H, dk}, vs[3] = {T, HV, dv}, gs[3] = {T, HV, dk};
    x->vq = fz_vclass(in);
    x->vk = fz_vclass(in);
    x->vv = fz_vclass(in);
    fz_seed(in);
    fz_tensor_new(in, &x->q, dt, 3, qs, 0, FZ_ALL, x->vq, 1 + fz_range(in, 0, 2));
    /* without the norm, keys of length about 1 keep the recurrence contractive */
    fz_tensor_new(in, &x->k, dt, 3, qs, 0, FZ_ALL, x->vk, l2 ? 1 + fz_range(in, 0, 2) : 1 / sqrt((double)dk));
    fz_tensor_new(in, &x->v, dt, 3, vs, 0, FZ_ALL, x->vv, 1 + fz_range(in, 0, 2));
    fz_tensor_new(in, &x->g, FW_F32, kda ? 3 : 2, gs, 0, FZ_ALL, FZ_MODERATE, 1);
    /* a wrong rank can make g the other valid form: GDN's [T, HV] from KDA's [T, HV, dk], or
     * KDA's [T, HV, 1] from GDN's when dk = 1 */
    const fw_tensor *gt = &x->g.t;
    if (x->g.bad && gt->ndim != (kda ? 3 : 2) && gt->shape[0] == T && gt->shape[1] == HV &&
        (gt->ndim == 2 || (gt->ndim == 3 && gt->shape[2] == dk)))
        x->g.bad = 0;
    fz_tensor_new(in, &x->beta, FW_F32, 2, gs, 0, FZ_ALL, FZ_MODERATE, 1);
    fz_tensor_new(in, &x->o, odt, 3, vs, 1, FZ_ALL, 0, 0);
    int bad = x->q.bad | x->k.bad | x->v.bad | x->g.bad | x->beta.bad | x->o.bad;
    static const double decay[4] = {0.01, 0.5, 5, 50};
    const double gmax = decay[fz_range(in, 0, 3)];
    int64_t idx[3] = {0, 0, 0};
    if (fz_numel(&x->g.t) && x->g.t.data && x->beta.t.data && !x->g.bad && !x->beta.bad) {
        do
            tset(&x->g.t, idx, -gmax * rng_uniform());
        while (tnext(&x->g.t, idx));
        do
            tset(&x->beta.t, idx, rng_uniform());
        while (tnext(&x->beta.t, idx));
        if (fz_chance(in, 8)) { /* a decay > 0, NaN or -inf, or a NaN beta */
            idx[0] = fz_range(in, 0, T - 1);
            idx[1] = fz_range(in, 0, HV - 1);
            idx[2] = fz_range(in, 0, dk - 1);
            static const double badv[4] = {0.5, NAN, -INFINITY, NAN};
            int w = (int)fz_range(in, 0, 3);
            tset(w == 3 ? &x->beta.t : &x->g.t, idx, badv[w]);
            bad = 1;
        }
    }
    return bad;
}

static void free_inputs(gdn_inputs *x)
{
    fz_tensor_free(&x->q); fz_tensor_free(&x->k); fz_tensor_free(&x->v);
    fz_tensor_free(&x->g); fz_tensor_free(&x->beta); fz_tensor_free(&x->o);
}

/* Rows [r0, r0 + n) of a token-major tensor, as a view. */
static fw_tensor rows(const fw_tensor *t, int64_t r0, int64_t n)
{
    fw_tensor s = *t;
    s.data = (char *)t->data + (size_t)(r0 * t->stride[0]) * fw_dtype_size(t->dtype);
    s.shape[0] = n;
    return s;
}

/* The references of sequences' outputs and final states from given initial states (NULL:
 * zeros): ex exact, sr with the call's roundings. Sizes: out T*HV*dv, states N*HV*dk*dv. */
typedef struct {
    double *ex, *sr, *exs, *srs;
} refs;

static fw_status run_refs(const gdn_inputs *x, const int32_t *cu, int64_t n, const float *init,
                          const fw_gdn_params *p, int bf16, int64_t nstate, refs *r)
{
    int64_t no = fz_numel(&x->o.t), os[3] = {x->o.t.shape[0], x->o.t.shape[1], x->o.t.shape[2]};
    r->ex = calloc((size_t)no + 1, 8); r->sr = calloc((size_t)no + 1, 8);
    r->exs = calloc((size_t)nstate + 1, 8); r->srs = calloc((size_t)nstate + 1, 8);
    fw_tensor eo = fw_tensor_contiguous(r->ex, FW_F64, 3, os), ro = fw_tensor_contiguous(r->sr, FW_F64, 3, os);
    fw_gdn_params rp = *p;
    rp.precision = FW_PREC_F32;
    fw_status s = fw_gdn_ref(&x->q.t, &x->k.t, &x->v.t, &x->g.t, &x->beta.t, cu, n, init, r->exs, &eo, &rp);
    if (s == FW_OK && bf16) {
        rp.precision = FW_PREC_BF16;
        s = fw_gdn_ref(&x->q.t, &x->k.t, &x->v.t, &x->g.t, &x->beta.t, cu, n, init, r->srs, &ro, &rp);
    } else if (s == FW_OK) {
        memcpy(r->sr, r->ex, (size_t)no * 8);
        memcpy(r->srs, r->exs, (size_t)nstate * 8);
    }
    return s;
}

static void free_refs(refs *r)
{
    free(r->ex); free(r->sr); free(r->exs); free(r->srs);
}

/* A state array (f32, n floats) against its references; `rel` more slack relative to its
 * largest entry. */
static void compare_state(const char *what, const float *got, const double *sr, const double *ex,
                          int64_t n, int values, int nan_ok, double rel)
{
    int64_t shape[1] = {n};
    fw_tensor t = fw_tensor_contiguous((void *)got, FW_F32, 1, shape);
    fz_compare(what, &t, sr, ex, n, values, nan_ok, (1e-4 + rel) * (1 + fz_absmax_d(ex, n)));
}

/* Distinct slots for n sequences out of `slots`. */
static void draw_slots(fz_in *in, int32_t *idx, int64_t n, int64_t slots)
{
    int32_t all[MAXN + 4];
    for (int64_t j = 0; j < slots; j++)
        all[j] = (int32_t)j;
    for (int64_t j = slots - 1; j > 0; j--) {
        int64_t x = fz_range(in, 0, j);
        int32_t t = all[j]; all[j] = all[x]; all[x] = t;
    }
    for (int64_t i = 0; i < n; i++)
        idx[i] = all[i];
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size, 0};
    const unsigned op = fz_byte(&in) % 6; /* 0-3 prefill, 4 decode, 5 verify + commit */
    fw_dtype dt = dts[fz_range(&in, 0, 2)], odt = dts[fz_range(&in, 0, 2)];
    int64_t H = 1 + fz_range(&in, 0, 2), HV = H * (1 + fz_range(&in, 0, 2));
    int64_t dk = 1 + fz_size(&in, 15, 130), dv = 1 + fz_size(&in, 15, 130);
    fw_gdn_params p;
    fw_gdn_params_init(&p);
    p.l2norm_qk = !fz_chance(&in, 64);
    p.threads = (int32_t)fz_range(&in, 0, 3);
    p.isa = fz_isa(&in);
    p.precision = (int32_t)fz_range(&in, 0, 2);
    static const uint32_t modes[4] = {0, FW_GDN_FWD_SUBST, FW_GDN_RECURRENT, FW_GDN_FUSED_RECURRENT};
    p.flags = op < 4 ? modes[op] : fz_chance(&in, 128) ? FW_GDN_FWD_SUBST : 0;
    if (fz_chance(&in, 32))
        p.scale = (float)fz_range(&in, -16, 16) / 8.0f;
    int bad = 0;
    if (fz_chance(&in, 6)) { /* broken params */
        switch (fz_byte(&in) % 4) {
        case 0: p.scale = NAN; break;
        case 1: p.l2norm_qk = 2; break;
        case 2: p.flags |= 1u << 9; break;
        case 3: p.precision = 3; break;
        }
        bad = 1;
    }
    /* sequences: N of them; verify windows are 1..64 tokens */
    int64_t n = op == 4 ? 1 + fz_size(&in, 3, MAXN - 1) : fz_size(&in, 3, MAXN);
    int32_t cu[MAXN + 1] = {0};
    for (int64_t i = 0; i < n; i++)
        cu[i + 1] = cu[i] + (int32_t)(op == 4 ? 1 : op == 5 ? 1 + fz_size(&in, 8, 63) : fz_size(&in, 10, 150));
    if (op == 5 && n && fz_chance(&in, 6)) { /* a window over 64 tokens */
        cu[n] = cu[n - 1] + 65 + (int32_t)fz_range(&in, 0, 15);
        bad = 1;
    }
    int64_t T = cu[n];
    if (T * HV * (dk + dv) * (dk < 8 ? 8 : dk) > (1 << 21))
        dk = dv = 1 + dk % 8; /* keeps an execution under a few milliseconds */
    const int64_t nstate = n * HV * dk * dv, slot_floats = HV * dk * dv;
    gdn_inputs x;
    bad |= draw_inputs(&in, &x, dt, odt, T, H, HV, dk, dv, p.l2norm_qk, fz_chance(&in, 3));
    const int kda = x.g.t.ndim == 3; /* after draw_inputs: a wrong rank may switch the form */
    const int bf16 = !(p.flags & (FW_GDN_RECURRENT | FW_GDN_FUSED_RECURRENT)) &&
                     fw_bf16_products(p.isa, dt, p.precision) && op != 4;
    const int values = x.vq != FZ_HUGE && x.vk != FZ_HUGE && x.vv != FZ_HUGE;
    /* docs/design.md, "NaN and inf": a NaN or inf in k or v reaches every later output of its value
     * heads (from its chunk's start on the chunked pass); inf arithmetic may end as inf or NaN */
    const int nan_ok = (x.vk == FZ_SPECIAL || x.vv == FZ_SPECIAL ? FZ_WIDER : 0) |
                       (x.vq == FZ_SPECIAL || x.vk == FZ_SPECIAL || x.vv == FZ_SPECIAL ? FZ_ANY_NONFINITE : 0);

    fz_desc[0] = 0;
    fz_describe("%s %s N %lld T %lld H %lld HV %lld dk %lld dv %lld l2 %d threads %d isa %s flags %u "
                "precision %d scale %g", kda ? "kda" : "gdn", op < 4 ? "prefill" : op == 4 ? "decode" : "verify+commit",
                (long long)n, (long long)T, (long long)H, (long long)HV, (long long)dk, (long long)dv,
                (int)p.l2norm_qk, (int)p.threads, p.isa ? p.isa : "default", (unsigned)p.flags,
                (int)p.precision, (double)p.scale);
    for (int64_t i = 0; i < n; i++)
        fz_describe("%s%d", i ? " " : "\n  lengths ", (int)(cu[i + 1] - cu[i]));
    fz_describe_tensor("q", &x.q, x.vq);
    fz_describe_tensor("k", &x.k, x.vk);
    fz_describe_tensor("v", &x.v, x.vv);
    fz_describe_tensor("out", &x.o, -1);

    const int64_t no = fz_numel(&x.o.t);
    const double oslack = 1e-4;
    unsigned char *so = fz_snapshot(&x.o);
    if (op < 4) {
        /* prefill: initial state absent or given; final state absent, separate or in place */
        unsigned how = fz_byte(&in) % 4;
        float *init = how ? malloc((size_t)nstate * 4 + 4) : NULL, *fin = NULL;
        for (int64_t j = 0; init && j < nstate; j++)
            init[j] = (float)(rng_uniform() - 0.5);
        fin = how == 3 ? init : how ? malloc((size_t)nstate * 4 + 4) : fz_chance(&in, 128) ? malloc((size_t)nstate * 4 + 4) : NULL;
        if (fin && fin != init)
            memset(fin, 0xA5, (size_t)nstate * 4);
        float *init_copy = init ? malloc((size_t)nstate * 4 + 4) : NULL, *fin_snap = fin ? malloc((size_t)nstate * 4 + 4) : NULL;
        if (init)
            memcpy(init_copy, init, (size_t)nstate * 4);
        if (fin)
            memcpy(fin_snap, fin, (size_t)nstate * 4);
        const int32_t *cup = cu;
        if (fz_chance(&in, 4)) { /* NULL offsets, or a negative count */
            if (fz_chance(&in, 128)) cup = NULL; else n = -1;
            bad = 1;
        }
        refs r = {0};
        fw_status rs = bad ? FW_ERR_ARG : run_refs(&x, cup, n, init_copy, &p, bf16, nstate, &r);
        fw_status st = fw_gdn_prefill(&x.q.t, &x.k.t, &x.v.t, &x.g.t, &x.beta.t, cup, n, init, fin, &x.o.t, &p);
        FZ_CHECK(st == FW_OK || *fw_last_error(), "status %d without a message", (int)st);
        if (bad)
            FZ_CHECK(st != FW_OK, "a broken problem was accepted");
        else
            FZ_CHECK((st == FW_OK) == (rs == FW_OK), "the kernel says %d, the reference %d (%s)", (int)st, (int)rs, fw_last_error());
        if (st != FW_OK) {
            FZ_CHECK(fz_unchanged(&x.o, so), "failed (%s) but wrote out", fw_last_error());
            FZ_CHECK(!fin || !memcmp(fin, fin_snap, (size_t)nstate * 4), "failed (%s) but wrote the final state", fw_last_error());
        } else {
            fz_compare("out", &x.o.t, r.sr, r.ex, no, values, nan_ok,
                       (oslack + 2 * fz_eps(odt)) * (1e-3 + fz_absmax_d(r.ex, no)));
            if (fin)
                compare_state("final state", fin, r.srs, r.exs, nstate, values, nan_ok, 0);
        }
        free_refs(&r);
        free(init_copy); free(fin_snap);
        if (fin != init)
            free(fin);
        free(init);
    } else {
        /* decode / verify: a slot array with spare slots, distinct indices */
        int64_t slots = n + fz_range(&in, 0, 3);
        int32_t idx[MAXN];
        draw_slots(&in, idx, n, slots);
        float *state = malloc((size_t)(slots * slot_floats) * 4 + 4);
        for (int64_t j = 0; j < slots * slot_floats; j++)
            state[j] = (float)(rng_uniform() - 0.5);
        float *gathered = malloc((size_t)nstate * 4 + 4), *before = malloc((size_t)(slots * slot_floats) * 4 + 4);
        for (int64_t i = 0; i < n; i++)
            memcpy(gathered + i * slot_floats, state + (int64_t)idx[i] * slot_floats, (size_t)slot_floats * 4);
        memcpy(before, state, (size_t)(slots * slot_floats) * 4);
        if (n && fz_chance(&in, 8)) { /* a slot out of range or used twice */
            int64_t i = fz_range(&in, 0, n - 1);
            idx[i] = n > 1 && fz_chance(&in, 128) ? idx[(i + 1) % n] : fz_chance(&in, 128) ? -1 : (int32_t)slots;
            bad = 1;
        }
        refs r = {0};
        fw_status rs = bad ? FW_ERR_ARG : run_refs(&x, cu, n, gathered, &p, bf16, nstate, &r);
        if (op == 4) {
            fw_status st = fw_gdn_decode(&x.q.t, &x.k.t, &x.v.t, &x.g.t, &x.beta.t, state, slots, idx, &x.o.t, &p);
            if (bad)
                FZ_CHECK(st != FW_OK, "a broken problem was accepted");
            else
                FZ_CHECK((st == FW_OK) == (rs == FW_OK), "the kernel says %d, the reference %d (%s)", (int)st, (int)rs, fw_last_error());
            if (st != FW_OK) {
                FZ_CHECK(fz_unchanged(&x.o, so) && !memcmp(state, before, (size_t)(slots * slot_floats) * 4),
                         "failed (%s) but wrote out or the state", fw_last_error());
            } else {
                fz_compare("out", &x.o.t, r.sr, r.ex, no, values, nan_ok,
                           (oslack + 2 * fz_eps(odt)) * (1e-3 + fz_absmax_d(r.ex, no)));
                float *mine = malloc((size_t)nstate * 4 + 4);
                for (int64_t i = 0; i < n; i++) {
                    memcpy(mine + i * slot_floats, state + (int64_t)idx[i] * slot_floats, (size_t)slot_floats * 4);
                    memcpy(state + (int64_t)idx[i] * slot_floats, before + (int64_t)idx[i] * slot_floats, (size_t)slot_floats * 4);
                }
                compare_state("decoded state", mine, r.srs, r.exs, nstate, values, nan_ok, 0);
                FZ_CHECK(!memcmp(state, before, (size_t)(slots * slot_floats) * 4), "decode wrote a slot it does not own");
                free(mine);
            }
        } else {
            size_t need = (kda ? fw_kda_replay_floats : fw_gdn_replay_floats)(T, H, HV, dk, dv);
            int short_replay = fz_chance(&in, 8) && need > 0;
            size_t have = need - (size_t)short_replay;
            bad |= short_replay; /* one float short even at T = 0: the layout's tag */
            float *replay = malloc(have * 4 + 4);
            fw_status st = fw_gdn_verify(&x.q.t, &x.k.t, &x.v.t, &x.g.t, &x.beta.t, cu, n, state, slots, idx,
                                         replay, have, &x.o.t, &p);
            if (bad)
                FZ_CHECK(st != FW_OK, "a broken problem was accepted");
            else
                FZ_CHECK((st == FW_OK) == (rs == FW_OK), "the kernel says %d, the reference %d (%s)", (int)st, (int)rs, fw_last_error());
            FZ_CHECK(!memcmp(state, before, (size_t)(slots * slot_floats) * 4), "verify wrote the state");
            if (st != FW_OK) {
                FZ_CHECK(fz_unchanged(&x.o, so), "failed (%s) but wrote out", fw_last_error());
            } else {
                fz_compare("out", &x.o.t, r.sr, r.ex, no, values, nan_ok,
                           (oslack + 2 * fz_eps(odt)) * (1e-3 + fz_absmax_d(r.ex, no)));
                /* commit m_i accepted tokens; the reference runs each accepted prefix alone */
                int32_t acc[MAXN];
                int cbad = 0;
                for (int64_t i = 0; i < n; i++)
                    acc[i] = (int32_t)fz_range(&in, 0, cu[i + 1] - cu[i]);
                if (n && fz_chance(&in, 8)) {
                    int64_t i = fz_range(&in, 0, n - 1);
                    acc[i] = fz_chance(&in, 128) ? -1 : cu[i + 1] - cu[i] + 1;
                    cbad = 1;
                }
                st = fw_gdn_commit(cu, n, acc, H, HV, dk, dv, state, slots, idx, replay, have, &p);
                if (cbad)
                    FZ_CHECK(st != FW_OK, "commit accepted a count out of range");
                else
                    FZ_CHECK(st == FW_OK, "commit failed: %s", fw_last_error());
                if (st != FW_OK) {
                    FZ_CHECK(!memcmp(state, before, (size_t)(slots * slot_floats) * 4), "failed commit wrote the state");
                } else {
                    for (int64_t i = 0; i < n; i++) {
                        gdn_inputs xi = x;
                        xi.q.t = rows(&x.q.t, cu[i], acc[i]); xi.k.t = rows(&x.k.t, cu[i], acc[i]);
                        xi.v.t = rows(&x.v.t, cu[i], acc[i]); xi.g.t = rows(&x.g.t, cu[i], acc[i]);
                        xi.beta.t = rows(&x.beta.t, cu[i], acc[i]);
                        xi.o.t = rows(&x.o.t, cu[i], acc[i]);
                        int32_t cu1[2] = {0, acc[i]};
                        refs ri = {0};
                        FZ_CHECK(run_refs(&xi, cu1, 1, gathered + i * slot_floats, &p, bf16, slot_floats, &ri) == FW_OK,
                                 "commit reference: %s", fw_last_error());
                        /* after bf16 products, commit rebuilds the state in f32 from verify's
                         * deltas, without the chunked pass's roundings of the state and the
                         * decayed keys: up to one bf16 rounding apart (docs/linear-attention.md; found here
                         * with dk = dv = 1, where one rounding is the whole error) */
                        compare_state("committed state", state + (int64_t)idx[i] * slot_floats, ri.srs, ri.exs,
                                      slot_floats, values, nan_ok, bf16 ? 0x1p-8 : 0);
                        memcpy(state + (int64_t)idx[i] * slot_floats, before + (int64_t)idx[i] * slot_floats,
                               (size_t)slot_floats * 4);
                        free_refs(&ri);
                    }
                    FZ_CHECK(!memcmp(state, before, (size_t)(slots * slot_floats) * 4), "commit wrote a slot it does not own");
                }
            }
            free(replay);
        }
        free_refs(&r);
        free(state); free(gathered); free(before);
    }
    free(so);
    free_inputs(&x);
    return 0;
}
