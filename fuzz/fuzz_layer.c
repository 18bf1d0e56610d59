/*
 * fuzz_layer.c: libFuzzer harness of the GDN / KDA serving layer, plain (fw_gdn_layer) and
 * with ReplaySSM decodes (fw_gdn_layer_replay), against their float64 references.
 * The problem: an engine step of up to MAXN sequences (decodes or speculative windows,
 * prefills, a skipped tail, padding rows), new sequences and prefix-cache reads, padded
 * recurrent slots, any q/k : value head ratio, small head dims, conv widths 1..5, qkv and
 * conv cache in any dtype and layout (fuzz_util.h), KDA's per-channel gates a third of the
 * time, f32 or bf16 records and any window, an f32 or (a quarter of the time) bf16 recurrent
 * cache; broken on purpose now and then: a slot out of
 * range or written twice, a read slot another sequence writes, committed records past the
 * window, a shadow or records of the wrong dtype or width, an f16 recurrent cache (a bf16 one
 * under ReplaySSM), a window shorter than a
 * speculative window, a distribution out of order, and the tensors fuzz_util.h breaks.
 * Checks (beyond fuzz_util.h's): the layer and its reference agree on the status; on an
 * error nothing is written (out, both caches, shadow, records); on FW_OK with moderate
 * values, out, the recurrent slots, the records and the conv slots against the reference's,
 * and every shadow written equal to the bf16 of its checkpoint.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "fuzz_util.h"
#include "test_util.h"

#define MAXN 6
static const fw_dtype dts[3] = {FW_F32, FW_BF16, FW_F16};

typedef struct {
    fz_tensor qkv, b, a, w, bias, alog, dt, out, conv, shadow, rec;
    unsigned char *state; /* the recurrent slots, of dtype sdt */
    size_t state_elems;
    fw_dtype sdt;
} lin;

static size_t state_bytes(const lin *x)
{
    return x->state_elems * fw_dtype_size(x->sdt);
}

/* Element i of recurrent slots `st` (x's dtype). */
static double state_at(const lin *x, const unsigned char *st, size_t i)
{
    return x->sdt == FW_F32 ? ((const float *)st)[i] : fw_bf16_to_f32(((const uint16_t *)st)[i]);
}

/* The caches of the reference's run: copies of the kernel's before the call. */
typedef struct {
    unsigned char *conv, *shadow, *rec, *out;
    unsigned char *state;
} lcopy;

static void copy_of(const lin *x, lcopy *c)
{
    c->conv = fz_snapshot(&x->conv);
    c->shadow = fz_snapshot(&x->shadow);
    c->rec = fz_snapshot(&x->rec);
    c->out = fz_snapshot(&x->out);
    c->state = malloc(state_bytes(x) + 4);
    memcpy(c->state, x->state, state_bytes(x));
}

static void free_copy(lcopy *c)
{
    free(c->conv); free(c->shadow); free(c->rec); free(c->out); free(c->state);
}

/* A tensor like `t` over another buffer of the same span. */
static fw_tensor over(const fz_tensor *ft, unsigned char *buf)
{
    fw_tensor t = ft->t;
    if (t.data)
        t.data = buf + ((unsigned char *)ft->t.data - ft->buf);
    return t;
}

/* The byte address of element offset `o` of t. */
static unsigned char *elem_ptr(const fw_tensor *t, int64_t o)
{
    return (unsigned char *)t->data + o * (int64_t)fw_dtype_size(t->dtype);
}

/* max |a - b| over a's first `n` elements in row-major order (n < 0: all), and max |b|. */
static double maxabs_diff(const fw_tensor *a, const fw_tensor *b, double *big, int64_t n)
{
    double e = 0;
    *big = 0;
    if (n < 0)
        n = fz_numel(a);
    int64_t idx[FW_MAX_DIMS] = {0};
    for (int64_t i = 0; i < n; i++) {
        const double x = tget(a, idx), y = tget(b, idx);
        e = fmax(e, isnan(x - y) ? INFINITY : fabs(x - y));
        *big = fmax(*big, fabs(y));
        tnext(a, idx);
    }
    return e;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size, 0};
    const int replay = fz_chance(&in, 160), kda = fz_chance(&in, 85);
    const fw_dtype dt = dts[fz_range(&in, 0, 2)], cdt = dts[fz_range(&in, 0, 2)];
    const int64_t nkq = 1 + fz_range(&in, 0, 1), nv = nkq * (1 + fz_range(&in, 0, 2));
    const int64_t dk = 1 + fz_range(&in, 0, 19), dv = 1 + fz_range(&in, 0, 19), K = 1 + fz_range(&in, 0, 4);
    const int64_t dim = 2 * nkq * dk + nv * dv, ga = kda ? nv * dk : nv;
    int bad = 0;
    /* the batch: decodes (or windows), prefills, a skipped tail */
    const int64_t spec = fz_chance(&in, 64) ? fz_range(&in, 1, 3) : 0;
    const int64_t n = fz_range(&in, 0, MAXN), de = fz_range(&in, 0, n), pe = de + fz_range(&in, 0, n - de);
    int64_t me = pe + fz_range(&in, 0, n - pe);
    int32_t qsl[MAXN + 1] = {0}, sl[MAXN], wr[MAXN], rd[MAXN], off[MAXN], lens[MAXN];
    int64_t slots = 1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t ql = i < de ? (spec ? 1 + fz_range(&in, 0, spec) : 1) : 1 + fz_size(&in, 20, 300);
        qsl[i + 1] = qsl[i] + (int32_t)ql;
        sl[i] = (int32_t)(ql + (fz_chance(&in, 64) ? 0 : fz_range(&in, 1, 50)));
        slots += i < de && spec ? ql : 1;
    }
    slots += 1 + fz_range(&in, 0, 3); /* the last slot is never written: prefix reads come from it */
    /* write slots: disjoint groups (a window writes one per token); reads: the own slot, a
     * free one (prefix caching) or, with an offset, a window's later slot */
    int64_t next = fz_range(&in, 0, 1);
    for (int64_t i = 0; i < n; i++) {
        wr[i] = (int32_t)next;
        next += i < de && spec ? qsl[i + 1] - qsl[i] : 1;
        rd[i] = fz_chance(&in, 192) ? wr[i] : (int32_t)(slots - 1);
        off[i] = 0;
        lens[i] = (int32_t)fz_range(&in, 0, 6);
    }
    const int64_t T = (n ? qsl[n] : 0) + fz_range(&in, 0, 3);
    const int64_t rdim = fw_gdn_replay_record_dim(nkq, nv, dk, dv, kda), W = 1 + spec + fz_range(&in, 0, 5);
    if (fz_chance(&in, 8) && me) { /* broken batch (the checks cover sequences before me) */
        const int64_t i = fz_range(&in, 0, me - 1);
        switch (fz_byte(&in) % 4) {
        case 0: wr[i] = (int32_t)slots; break;
        case 1: if (me > 1) wr[(i + 1) % me] = wr[i]; else wr[i] = -1; break;
        case 2: me = n + 1; break;
        default:
            if (replay && i < de) lens[i] = (int32_t)W + 1; else sl[i] = 0;
        }
        bad = 1;
    }
    lin x;
    memset(&x, 0, sizeof x);
    fz_seed(&in);
    fz_tensor_new(&in, &x.qkv, dt, 2, (int64_t[]){T, dim}, 0, FZ_ALL, FZ_MODERATE, 1);
    fz_tensor_new(&in, &x.b, FW_F32, 2, (int64_t[]){T, nv}, 0, FZ_ALL, FZ_MODERATE, 1);
    /* (a's width is not broken: n_v d_k instead of n_v is KDA's valid form, and the reverse) */
    fz_tensor_new(&in, &x.a, FW_F32, 2, (int64_t[]){T, ga}, 0, 0x1, FZ_MODERATE, 1);
    fz_tensor_new(&in, &x.w, FW_F32, 2, (int64_t[]){dim, K}, 0, FZ_ALL, FZ_MODERATE, 0.5);
    fz_tensor_new(&in, &x.bias, FW_F32, 1, (int64_t[]){dim}, 0, FZ_ALL, FZ_MODERATE, 0.1);
    fz_tensor_new(&in, &x.alog, FW_F32, 1, (int64_t[]){nv}, 0, FZ_NONE, FZ_MODERATE, 1);
    fz_tensor_new(&in, &x.dt, FW_F32, 1, (int64_t[]){ga}, 0, FZ_NONE, FZ_MODERATE, 0.5);
    fz_tensor_new(&in, &x.out, dts[fz_range(&in, 0, 2)], 2, (int64_t[]){T, nv * dv}, 1, FZ_ALL, 0, 0);
    /* the caches the call writes: laid out as outputs, then filled. The conv cache's slots
     * are its own unless the replay state's must match them; the records' window is theirs. */
    fz_tensor_new(&in, &x.conv, cdt, 3, (int64_t[]){slots, K - 1, dim}, 1, replay ? FZ_ALL : 0x6, 0, 0);
    const fw_dtype sdt = fz_chance(&in, 8) ? FW_F32 : FW_BF16, rdt = fz_chance(&in, 8) ? FW_F16 : fz_chance(&in, 128) ? FW_BF16 : FW_F32;
    fz_tensor_new(&in, &x.shadow, sdt, 4, (int64_t[]){slots, nv, dk, dv}, 1, FZ_ALL, 0, 0);
    /* (the records' width is broken here, not by fz_tensor_new, which could undo it) */
    fz_tensor_new(&in, &x.rec, rdt, 3, (int64_t[]){slots, W, rdim + (fz_chance(&in, 6) ? 1 : 0)}, 1, 0x1, 0, 0);
    const fw_tensor *bias = fz_chance(&in, 64) ? NULL : &x.bias.t;
    bad |= x.qkv.bad | x.b.bad | x.a.bad | x.w.bad | (bias && x.bias.bad) | x.out.bad | x.conv.bad;
    if (replay)
        bad |= x.shadow.bad | x.rec.bad | (sdt != FW_BF16) | (rdt == FW_F16) | (x.rec.t.shape[2] != rdim);
    fz_tensor *written[3] = {&x.conv, &x.shadow, &x.rec};
    for (int i = 0; i < 3; i++)
        if (!written[i]->bad && written[i]->t.data)
            tfill_normal(&written[i]->t, i == 0 ? 1.0 : 0.3);
    if (!x.rec.bad && x.rec.t.data) /* the records' log decays are non-positive */
        for (int64_t s = 0; s < x.rec.t.shape[0]; s++)
            for (int64_t j = 0; j < W; j++)
                for (int64_t g = nv * dv + nkq * dk; g < x.rec.t.shape[2]; g++) {
                    const int64_t idx[3] = {s, j, g};
                    tset(&x.rec.t, idx, -fabs(tget(&x.rec.t, idx)));
                }
    const int64_t sstride = nv * dk * dv + fz_range(&in, 0, 3);
    x.sdt = fz_chance(&in, 64) ? FW_F16 : fz_chance(&in, 4) ? FW_BF16 : FW_F32;
    bad |= x.sdt == FW_F16 || (replay && x.sdt != FW_F32);
    x.state_elems = (size_t)(slots * sstride);
    x.state = malloc(state_bytes(&x) + 4);
    for (size_t i = 0; i < x.state_elems; i++) {
        const float v = (float)(0.2 * (rng_uniform() - 0.5));
        if (x.sdt == FW_F32)
            ((float *)x.state)[i] = v;
        else
            ((uint16_t *)x.state)[i] = x.sdt == FW_BF16 ? fw_f32_to_bf16(v) : 0x3c00;
    }

    fw_gdn_layer_params p;
    fw_gdn_layer_params_init(&p);
    p.n_kq = (int32_t)nkq; p.n_v = (int32_t)nv; p.d_k = (int32_t)dk; p.d_v = (int32_t)dv;
    p.zero_tail = fz_chance(&in, 128);
    p.threads = (int32_t)fz_range(&in, 0, 3);
    p.isa = fz_isa(&in);
    p.precision = (int32_t)fz_range(&in, 0, 2);
    p.lower_bound = kda && fz_chance(&in, 128) ? -5.0f : 0.0f;
    fw_gdn_batch b;
    memset(&b, 0, sizeof b);
    b.n_seqs = n; b.query_start_loc = qsl; b.seq_lens = sl; b.state_indices = wr; b.read_state_indices = rd;
    b.decode_end = (int32_t)de; b.prefill_end = (int32_t)pe; b.mixed_end = (int32_t)me;
    b.num_spec_tokens = (int32_t)spec; b.read_offsets = spec ? off : NULL;
    fw_gdn_caches c = {x.conv.t, x.state, sstride, x.sdt};
    fw_gdn_replay r = {x.shadow.t, x.rec.t, lens};

    fz_desc[0] = 0;
    fz_describe("%s %s n %lld (de %lld pe %lld me %lld) spec %lld T %lld nkq %lld nv %lld dk %lld dv %lld K %lld "
                "slots %lld W %lld threads %d isa %s precision %d recurrent %s", replay ? "replay" : "plain", kda ? "kda" : "gdn",
                (long long)n, (long long)de, (long long)pe, (long long)me, (long long)spec, (long long)T,
                (long long)nkq, (long long)nv, (long long)dk, (long long)dv, (long long)K, (long long)slots,
                (long long)W, (int)p.threads, p.isa ? p.isa : "default", (int)p.precision, fw_dtype_name(x.sdt));
    for (int64_t i = 0; i < n; i++)
        fz_describe("\n  seq %lld: %d tokens, seq_len %d, write %d, read %d, records %d", (long long)i,
                    (int)(qsl[i + 1] - qsl[i]), (int)sl[i], (int)wr[i], (int)rd[i], (int)lens[i]);
    fz_describe_tensor("qkv", &x.qkv, FZ_MODERATE);
    fz_describe_tensor("b", &x.b, FZ_MODERATE);
    fz_describe_tensor("a", &x.a, FZ_MODERATE);
    fz_describe_tensor("a_log", &x.alog, FZ_MODERATE);
    fz_describe_tensor("dt_bias", &x.dt, FZ_MODERATE);
    fz_describe_tensor("out", &x.out, -1);
    fz_describe_tensor("conv", &x.conv, -1);
    fz_describe_tensor("records", &x.rec, -1);

    lcopy before, refc;
    copy_of(&x, &before);
    copy_of(&x, &refc);
    /* the reference on copies of the caches, out in f64 */
    const int64_t no = T * nv * dv;
    double *ro = malloc(sizeof(double) * (size_t)(no > 0 ? no : 1));
    fw_tensor tro = fw_tensor_contiguous(ro, FW_F64, 2, (int64_t[]){T, nv * dv});
    fw_gdn_caches rc = {over(&x.conv, refc.conv), refc.state, sstride, x.sdt};
    fw_gdn_replay rr = {over(&x.shadow, refc.shadow), over(&x.rec, refc.rec), lens};
    /* (a broken out is the layer's alone: the reference takes f64, which breaks it for the
     * layer and may not for the reference) */
    fw_status rs = x.out.bad ? FW_ERR_ARG
                 : replay ? fw_gdn_layer_replay_ref(&x.qkv.t, &x.b.t, &x.a.t, &x.w.t, bias, &x.alog.t, &x.dt.t, &b,
                                                    &rc, &rr, &tro, &p)
                          : fw_gdn_layer_ref(&x.qkv.t, &x.b.t, &x.a.t, &x.w.t, bias, &x.alog.t, &x.dt.t, &b, &rc,
                                             &tro, &p);
    fw_status st = replay ? fw_gdn_layer_replay(&x.qkv.t, &x.b.t, &x.a.t, &x.w.t, bias, &x.alog.t, &x.dt.t, &b, &c,
                                                &r, &x.out.t, &p)
                          : fw_gdn_layer(&x.qkv.t, &x.b.t, &x.a.t, &x.w.t, bias, &x.alog.t, &x.dt.t, &b, &c, &x.out.t,
                                         &p);
    FZ_CHECK(st == FW_OK || *fw_last_error(), "status %d without a message", (int)st);
    if (bad)
        FZ_CHECK(st != FW_OK, "a broken problem was accepted");
    FZ_CHECK((st == FW_OK) == (rs == FW_OK), "the layer says %d, the reference %d", (int)st, (int)rs);
    if (st != FW_OK) {
        FZ_CHECK(fz_unchanged(&x.out, before.out) && fz_unchanged(&x.conv, before.conv) &&
                     fz_unchanged(&x.shadow, before.shadow) && fz_unchanged(&x.rec, before.rec) &&
                     !memcmp(x.state, before.state, state_bytes(&x)),
                 "failed (%s) but wrote something", fw_last_error());
    } else {
        /* f32 rows: rounding only; half-precision rows and bf16 products: a rounding of the
         * conv's rows may differ by an ulp between the two, and the chunked pass rounds */
        const double tol = dt == FW_F32 && x.out.t.dtype == FW_F32 && p.precision != FW_PREC_BF16 ? 1e-3 : 0.08;
        /* the rows of the sequences before mixed_end; past them, zeros with zero_tail, else
         * the bytes out had */
        const int64_t used = me > 0 ? qsl[me] : 0;
        double big, e = maxabs_diff(&x.out.t, &tro, &big, used * nv * dv);
        FZ_CHECK(e <= tol * (1 + big), "out differs from the reference by %.3g (largest %.3g)", e, big);
        for (int64_t t = used; t < T && p.zero_tail; t++)
            for (int64_t c = 0; c < nv * dv; c++)
                FZ_CHECK(tget(&x.out.t, (int64_t[]){t, c}) == 0, "padding row %lld is not zeroed", (long long)t);
        for (int64_t t = used; t < T && !p.zero_tail; t++)
            for (int64_t c = 0; c < nv * dv; c++) {
                const int64_t o = t * x.out.t.stride[0] + c * x.out.t.stride[1];
                FZ_CHECK(!memcmp(elem_ptr(&x.out.t, o), before.out + (elem_ptr(&x.out.t, o) - x.out.buf),
                                 fw_dtype_size(x.out.t.dtype)), "padding row %lld is written", (long long)t);
            }
        /* bf16 slots: the layer rounds f32 states, the reference float64 ones rounded to f32
         * first, so a value near a rounding boundary may land an ulp (<= 2^-7 of it) apart */
        double es = 0, bs = 0;
        for (size_t i = 0; i < x.state_elems; i++) {
            const double d = state_at(&x, x.state, i) - state_at(&x, refc.state, i);
            es = fmax(es, isnan(d) ? INFINITY : fabs(d));
            bs = fmax(bs, fabs(state_at(&x, refc.state, i)));
        }
        const double stol = tol + (x.sdt == FW_BF16 ? 0x1p-7 : 0.0);
        FZ_CHECK(es <= stol * (1 + bs), "a recurrent slot differs from the reference's by %.3g", es);
        fw_tensor rconv = over(&x.conv, refc.conv);
        e = maxabs_diff(&x.conv.t, &rconv, &big, -1);
        FZ_CHECK(e == 0, "a conv slot differs from the reference's by %.3g", e);
        if (replay) {
            /* bf16 records: the layer rounds f32 values, the reference float64 ones, so a value
             * near a rounding boundary may land an ulp (<= 2^-7 of it) apart */
            fw_tensor rrec = over(&x.rec, refc.rec);
            const double rtol = tol + (x.rec.t.dtype == FW_BF16 ? 0x1p-7 : 0.0);
            e = maxabs_diff(&x.rec.t, &rrec, &big, -1);
            FZ_CHECK(e <= rtol * (1 + big), "the records differ from the reference's by %.3g", e);
            const fw_tensor bsh = over(&x.shadow, before.shadow);
            for (int64_t s = 0; s < slots; s++) { /* a shadow written is its checkpoint's bf16 */
                int changed = 0;
                int64_t idx[4] = {s, 0, 0, 0};
                for (int64_t h = 0; h < nv; h++)
                    for (int64_t a = 0; a < dk; a++)
                        for (int64_t v = 0; v < dv; v++) {
                            idx[1] = h; idx[2] = a; idx[3] = v;
                            changed |= tget(&x.shadow.t, idx) != tget(&bsh, idx);
                        }
                for (int64_t h = 0; changed && h < nv; h++)
                    for (int64_t a = 0; a < dk; a++)
                        for (int64_t v = 0; v < dv; v++) {
                            idx[1] = h; idx[2] = a; idx[3] = v;
                            const float want = ((const float *)x.state)[s * sstride + (h * dk + a) * dv + v];
                            FZ_CHECK(tget(&x.shadow.t, idx) == round_to(FW_BF16, want) || (isnan(want) && isnan(tget(&x.shadow.t, idx))),
                                     "slot %lld's shadow is not its checkpoint's bf16", (long long)s);
                        }
            }
        }
    }
    free_copy(&before);
    free_copy(&refc);
    free(ro);
    free(x.state);
    fz_tensor *all[11] = {&x.qkv, &x.b, &x.a, &x.w, &x.bias, &x.alog, &x.dt, &x.out, &x.conv, &x.shadow, &x.rec};
    for (int i = 0; i < 11; i++)
        fz_tensor_free(all[i]);
    return 0;
}
