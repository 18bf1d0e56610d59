/*
 * fuzz_conv.c: libFuzzer harness of the causal conv1d (fw_conv1d_fwd): batched or packed
 * sequences, widths 1..17, any layout and dtype of x, out, weight, bias, residual and the
 * conv caches (fuzz_util.h), SiLU or none, and conv states: none, an init cache, separate
 * init and final caches, one cache in place by slot index (some negative), one cache in
 * place and circular (offsets, negative ones too). Broken on purpose now and then: a slot
 * past the cache, two sequences writing one slot, a slot read by one sequence and written by
 * another, offsets that do not add up, an unknown activation.
 * Checks (beyond fuzz_util.h's): on FW_OK, out against fw_conv1d_ref and every final cache
 * entry equal to the reference's (copies of inputs, rounded to the cache's dtype); on an
 * error, out and the caches untouched.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "fuzz_util.h"
#include "test_util.h"

#define MAXN 6
static const fw_dtype dts[3] = {FW_F32, FW_BF16, FW_F16};

/* A descriptor of the same layout over a copy of ft's buffer. */
static fw_tensor copy_of(const fz_tensor *ft, unsigned char **buf)
{
    *buf = malloc(ft->bytes + 1);
    memcpy(*buf, ft->buf, ft->bytes);
    fw_tensor t = ft->t;
    t.data = ft->t.data ? *buf + ((unsigned char *)ft->t.data - ft->buf) : NULL;
    return t;
}

/* Every element of a against b: equal, or both NaN. */
static int same_values(const fw_tensor *a, const fw_tensor *b)
{
    if (fz_numel(a) == 0)
        return 1;
    int64_t idx[FW_MAX_DIMS] = {0};
    do {
        const double x = tget(a, idx), y = tget(b, idx);
        if (!(x == y || (x != x && y != y)))
            return 0;
    } while (tnext(a, idx));
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size, 0};
    const fw_dtype dt = dts[fz_range(&in, 0, 2)], odt = dts[fz_range(&in, 0, 2)];
    const fw_dtype wdt = dts[fz_range(&in, 0, 2)], cdt = dts[fz_range(&in, 0, 2)];
    const int64_t W = fz_chance(&in, 16) ? 1 + fz_range(&in, 0, 16) : 1 + fz_range(&in, 0, 4);
    const int64_t D = 1 + fz_size(&in, 40, 300);
    const int varlen = fz_chance(&in, 96);
    int64_t B = varlen ? 1 : 1 + fz_range(&in, 0, 2), L = fz_size(&in, 12, 150), n = B;
    int32_t cu[MAXN + 1] = {0};
    int bad = 0;
    if (varlen) {
        n = fz_range(&in, 0, MAXN);
        for (int64_t i = 0; i < n; i++)
            cu[i + 1] = cu[i] + (int32_t)fz_size(&in, 8, 100);
        L = cu[n];
    }
    if (B * L * D > (1 << 17))
        L = (1 << 17) / (B * D); /* keeps an execution short */
    if (varlen && cu[n] != L) { /* cut the last sequences to the rows there are */
        for (int64_t i = 1; i <= n; i++)
            cu[i] = cu[i] > L ? (int32_t)L : cu[i];
        cu[n] = (int32_t)L;
    }
    fw_conv1d_params p;
    fw_conv1d_params_init(&p);
    p.activation = (int32_t)fz_range(&in, 0, 1);
    p.threads = (int32_t)fz_range(&in, 0, 3);
    p.isa = fz_isa(&in);
    if (fz_chance(&in, 4)) {
        p.activation = 5;
        bad = 1;
    }
    const int vx = fz_vclass(&in);
    int64_t xs[3] = {B, L, D}, ws[2] = {D, W}, bs[1] = {D};
    fz_tensor x, out, w, bias, res;
    fz_seed(&in);
    fz_tensor_new(&in, &x, dt, 3, xs, 0, FZ_ALL, vx, 1 + fz_range(&in, 0, 2));
    fz_tensor_new(&in, &out, odt, 3, xs, 1, FZ_ALL, 0, 0);
    /* masks: the dimensions another operand fixes (W and a cache's slots and S are free) */
    fz_tensor_new(&in, &w, wdt, 2, ws, 0, 0x1, FZ_MODERATE, 0.5);
    const int has_bias = fz_chance(&in, 128), has_res = fz_chance(&in, 64);
    fz_tensor_new(&in, &bias, wdt, 1, bs, 0, has_bias ? 0x1 : FZ_NONE, FZ_MODERATE, 0.5);
    fz_tensor_new(&in, &res, dt, 3, xs, 0, has_res ? FZ_ALL : FZ_NONE, FZ_MODERATE, 1);
    bad |= x.bad | out.bad | w.bad | (has_bias && bias.bad) | (has_res && res.bad);
    /* states: 0 none, 1 init, 2 init + final apart, 3 in place by index, 4 in place circular */
    const unsigned mode = fz_byte(&in) % 5;
    const int64_t slots = n + fz_range(&in, 0, 3), S = mode == 4 ? W - 1 + fz_range(&in, 1, 4)
                                                       : W - 1 + fz_range(&in, 0, 2);
    int64_t cs[3] = {slots, S, D};
    fz_tensor ci, cf;
    fz_tensor_new(&in, &ci, cdt, 3, cs, 0, mode ? 0x4 : FZ_NONE, FZ_MODERATE, 1);
    fz_tensor_new(&in, &cf, cdt, 3, cs, 1, mode == 2 ? 0x4 : FZ_NONE, 0, 0);
    if (mode)
        bad |= ci.bad | (mode == 2 && cf.bad);
    int32_t ridx[MAXN + 3], widx[MAXN + 3], roff[MAXN + 3], woff[MAXN + 3];
    int32_t perm[MAXN + 3];
    for (int64_t j = 0; j < slots; j++)
        perm[j] = (int32_t)j;
    for (int64_t j = slots - 1; j > 0; j--) {
        const int64_t k = fz_range(&in, 0, j);
        const int32_t t = perm[j]; perm[j] = perm[k]; perm[k] = t;
    }
    for (int64_t i = 0; i < n; i++) {
        ridx[i] = widx[i] = perm[i];
        if (fz_chance(&in, 24))
            ridx[i] = -1; /* starts from zeros, still writes its slot */
        else if (fz_chance(&in, 16))
            widx[i] = -1; /* reads, keeps nothing */
        roff[i] = (int32_t)fz_range(&in, -40, 40);
        woff[i] = (int32_t)(roff[i] + (varlen ? cu[i + 1] - cu[i] : L));
    }
    fw_conv1d_state si = {ci.t, ridx, mode == 4 ? roff : NULL}, sf = {mode >= 3 ? ci.t : cf.t, widx, mode == 4 ? woff : NULL};
    if (mode == 1 || mode == 2) {
        si.idx = fz_chance(&in, 128) ? NULL : ridx;
        sf.idx = si.idx ? widx : NULL;
        if (!si.idx)
            for (int64_t i = 0; i < n; i++)
                ridx[i] = widx[i] = (int32_t)i; /* what NULL means, for the reference */
    }
    if (mode >= 2 && n && si.idx && fz_chance(&in, 10)) { /* slots broken on purpose */
        const int64_t i = fz_range(&in, 0, n - 1);
        switch (fz_byte(&in) % 3) {
        case 0: widx[i] = (int32_t)slots; break;                                 /* past the cache */
        case 1: if (n > 1) widx[i] = widx[(i + 1) % n] >= 0 ? widx[(i + 1) % n] : (int32_t)slots; else widx[i] = (int32_t)slots; break;
        case 2: /* read by another (a race only where the cache holds entries) */
            if (n > 1 && mode >= 3 && S > 0)
                ridx[i] = widx[(i + 1) % n] >= 0 ? widx[(i + 1) % n] : (int32_t)slots;
            else
                widx[i] = (int32_t)slots;
            break;
        }
        bad = 1;
    }
    const fw_conv1d_state *pi = mode ? &si : NULL, *pf = mode >= 2 ? &sf : NULL;
    fz_desc[0] = 0;
    fz_describe("conv1d B %lld L %lld D %lld W %lld n %lld %s act %d threads %d isa %s states %u slots %lld S %lld "
                "cache %s", (long long)B, (long long)L, (long long)D, (long long)W, (long long)n,
                varlen ? "packed" : "batched", (int)p.activation, (int)p.threads, p.isa ? p.isa : "default", mode,
                (long long)slots, (long long)S, fw_dtype_name(cdt));
    fz_describe_tensor("x", &x, vx);
    fz_describe_tensor("out", &out, -1);
    fz_describe_tensor("weight", &w, FZ_MODERATE);
    for (int64_t i = 0; i < n && mode; i++)
        fz_describe("%s%d/%d/%d", i ? " " : "\n  read/write/offset ", (int)ridx[i], (int)widx[i], (int)roff[i]);

    /* the reference on copies of the caches (in place: of the one cache) */
    unsigned char *ci_copy, *cf_copy, *so = fz_snapshot(&out), *sci = fz_snapshot(&ci), *scf = fz_snapshot(&cf);
    fw_tensor rci = copy_of(&ci, &ci_copy), rcf = copy_of(&cf, &cf_copy);
    fw_conv1d_state rsi = si, rsf = sf;
    rsi.cache = rci;
    rsf.cache = mode >= 3 ? rci : rcf;
    const int64_t no = fz_numel(&out.t);
    double *ex = calloc((size_t)no + 1, sizeof(double));
    fw_status rs = FW_ERR_ARG;
    if (!bad && no >= 0) {
        fw_tensor eo = fw_tensor_contiguous(ex, FW_F64, 3, xs);
        rs = fw_conv1d_ref(&x.t, &w.t, has_bias ? &bias.t : NULL, varlen ? cu : NULL, n, mode ? &rsi : NULL,
                           mode >= 2 ? &rsf : NULL, has_res ? &res.t : NULL, &eo, &p);
    }
    const fw_status st = fw_conv1d_fwd(&x.t, &w.t, has_bias ? &bias.t : NULL, varlen ? cu : NULL, n, pi, pf,
                                       has_res ? &res.t : NULL, &out.t, &p);
    FZ_CHECK(st == FW_OK || *fw_last_error(), "status %d without a message", (int)st);
    if (bad)
        FZ_CHECK(st != FW_OK, "a broken problem was accepted");
    else
        FZ_CHECK((st == FW_OK) == (rs == FW_OK), "the kernel says %d, the reference %d (%s)", (int)st, (int)rs,
                 fw_last_error());
    if (st != FW_OK) {
        FZ_CHECK(fz_unchanged(&out, so) && fz_unchanged(&ci, sci) && fz_unchanged(&cf, scf),
                 "failed (%s) but wrote out or a cache", fw_last_error());
    } else {
        const int values = vx != FZ_HUGE;
        const int rules = vx == FZ_SPECIAL ? FZ_ANY_NONFINITE : 0;
        const double mx = fz_absmax_d(ex, no);
        fz_compare("out", &out.t, ex, ex, no, values, rules, (2 * fz_eps(odt) + 1e-5 * (double)W) * (1 + mx));
        if (mode >= 2)
            FZ_CHECK(same_values(mode >= 3 ? &ci.t : &cf.t, mode >= 3 ? &rci : &rcf),
                     "final cache differs from the reference's");
        if (mode == 2 || mode == 1)
            FZ_CHECK(fz_unchanged(&ci, sci), "the init cache was written");
    }
    free(ex); free(ci_copy); free(cf_copy); free(so); free(sci); free(scf);
    fz_tensor_free(&x); fz_tensor_free(&out); fz_tensor_free(&w); fz_tensor_free(&bias); fz_tensor_free(&res);
    fz_tensor_free(&ci); fz_tensor_free(&cf);
    return 0;
}
