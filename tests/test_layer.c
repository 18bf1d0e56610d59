/*
 * test_layer.c: the GDN / KDA serving layer (fw_gdn_layer) against its float64 reference
 * (fw_gdn_layer_ref) on whole engine steps: decodes in place and from a prefix-cache slot, a
 * new prefill, continued prefills shorter and longer than the layer's 256-row window, a
 * skipped sequence and padding rows (zeroed); speculative windows with a read offset and a
 * checkpoint per token; GDN and KDA gates; bf16 and f32 qkv; every table. Bars: f32 products
 * within the fused step's absolute bar of the exact reference, bf16 products within 2x the
 * error of the same-roundings reference; conv slots bit-equal to the reference's, unwritten
 * slots untouched, the same bits on 1 and 3 threads. Bad input: refused by both, nothing
 * written.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "test_util.h"

enum { NKQ = 2, NV = 4, DK = 32, DV = 24, KW = 4, DIM = 2 * NKQ * DK + NV * DV, SLOTS = 16 };
enum { SS = NV * DK * DV, RSTRIDE = SS + 8 }; /* recurrent slots padded, as engines page them */

typedef struct {
    fw_dtype dt;
    int kda, spec;
} lcase;

/* One engine step's batch. */
typedef struct {
    int n, de, pe, me, spec, T;
    int32_t qsl[8], sl[8], wr[8], rd[8], off[8];
} lbatch;

static const lbatch plain_step = {
    /* decode in place, decode from a prefix slot, a new prefill, a prefill of 300 rows past
     * 50, a short continued one, a skipped one; 4 padding rows */
    6, 2, 5, 5, 0, 384,
    {0, 1, 2, 72, 372, 377, 380},
    {10, 5, 70, 350, 9, 3},
    {3, 5, 6, 8, 9, 11},
    {3, 4, 6, 7, 9, 11},
    {0}};

static const lbatch spec_step = {
    /* windows of 4 tokens (read slot 1 + offset 1) and of 2 (a new sequence), then a prefill
     * in place */
    3, 2, 3, 3, 3, 30,
    {0, 4, 6, 26},
    {20, 2, 40},
    {10, 14, 0},
    {1, 9, 0},
    {1, 0, 0}};

typedef struct {
    gbuf bqkv, ba, bb, bw, bbias, balog, bdt;
    fw_tensor qkv, a, b, w, bias, alog, dt;
    void *conv0;  /* the initial conv cache */
    float *rec0;  /* the initial recurrent pool */
    size_t conv_bytes;
} linputs;

static void make_layer_inputs(linputs *in, const lcase *c, int T, uint64_t seed)
{
    const size_t es = fw_dtype_size(c->dt);
    const int64_t ga = c->kda ? NV * DK : NV;
    in->bqkv = gbuf_new((size_t)(T * DIM) * es);
    in->ba = gbuf_new((size_t)(T * ga) * 4);
    in->bb = gbuf_new((size_t)(T * NV) * 4);
    in->bw = gbuf_new((size_t)(DIM * KW) * 4);
    in->bbias = gbuf_new((size_t)DIM * 4);
    in->balog = gbuf_new((size_t)NV * 4);
    in->bdt = gbuf_new((size_t)ga * 4);
    in->qkv = fw_tensor_contiguous(in->bqkv.p, c->dt, 2, (int64_t[]){T, DIM});
    in->a = fw_tensor_contiguous(in->ba.p, FW_F32, 2, (int64_t[]){T, ga});
    in->b = fw_tensor_contiguous(in->bb.p, FW_F32, 2, (int64_t[]){T, NV});
    in->w = fw_tensor_contiguous(in->bw.p, FW_F32, 2, (int64_t[]){DIM, KW});
    in->bias = fw_tensor_contiguous(in->bbias.p, FW_F32, 1, (int64_t[]){DIM});
    in->alog = fw_tensor_contiguous(in->balog.p, FW_F32, 1, (int64_t[]){NV});
    in->dt = fw_tensor_contiguous(in->bdt.p, FW_F32, 1, (int64_t[]){ga});
    rng_seed(seed);
    tfill_normal(&in->qkv, 1.0);
    tfill_normal(&in->a, 1.0);
    tfill_normal(&in->b, 1.0);
    tfill_normal(&in->w, 0.5);
    tfill_normal(&in->bias, 0.1);
    tfill_normal(&in->dt, 0.5);
    for (int i = 0; i < NV; i++) /* A = exp(a_log) in [0.5, 8] */
        ((float *)in->alog.data)[i] = (float)log(0.5 + 7.5 * rng_uniform());
    in->conv_bytes = (size_t)(SLOTS * (KW - 1) * DIM) * es;
    in->conv0 = malloc(in->conv_bytes);
    fw_tensor cv = fw_tensor_contiguous(in->conv0, c->dt, 3, (int64_t[]){SLOTS, KW - 1, DIM});
    tfill_normal(&cv, 1.0);
    in->rec0 = malloc(sizeof(float) * SLOTS * RSTRIDE);
    for (int i = 0; i < SLOTS * RSTRIDE; i++)
        in->rec0[i] = (float)(0.1 * rng_normal());
}

static void free_layer_inputs(linputs *in)
{
    gbuf_free(&in->bqkv); gbuf_free(&in->ba); gbuf_free(&in->bb); gbuf_free(&in->bw);
    gbuf_free(&in->bbias); gbuf_free(&in->balog); gbuf_free(&in->bdt);
    free(in->conv0);
    free(in->rec0);
}

/* Caches of one run, started from the inputs' initial ones. */
typedef struct {
    void *conv;
    float *rec;
    fw_gdn_caches c;
} lcaches;

static void caches_new(lcaches *k, const linputs *in, fw_dtype dt)
{
    k->conv = malloc(in->conv_bytes);
    k->rec = malloc(sizeof(float) * SLOTS * RSTRIDE);
    memcpy(k->conv, in->conv0, in->conv_bytes);
    memcpy(k->rec, in->rec0, sizeof(float) * SLOTS * RSTRIDE);
    k->c.conv = fw_tensor_contiguous(k->conv, dt, 3, (int64_t[]){SLOTS, KW - 1, DIM});
    k->c.recurrent = k->rec;
    k->c.recurrent_stride = RSTRIDE;
    k->c.recurrent_dtype = FW_F32;
}

static void caches_free(lcaches *k)
{
    free(k->conv);
    free(k->rec);
}

static fw_gdn_batch batch_of(const lbatch *s)
{
    fw_gdn_batch b;
    memset(&b, 0, sizeof b);
    b.n_seqs = s->n;
    b.query_start_loc = s->qsl;
    b.seq_lens = s->sl;
    b.state_indices = s->wr;
    b.read_state_indices = s->rd;
    b.decode_end = s->de;
    b.prefill_end = s->pe;
    b.mixed_end = s->me;
    b.num_spec_tokens = s->spec;
    b.read_offsets = s->spec ? s->off : NULL;
    return b;
}

static fw_gdn_layer_params lparams(const lcase *c, int precision, const char *isa, int threads)
{
    fw_gdn_layer_params p;
    fw_gdn_layer_params_init(&p);
    p.n_kq = NKQ;
    p.n_v = NV;
    p.d_k = DK;
    p.d_v = DV;
    p.zero_tail = 1;
    p.precision = precision;
    p.isa = isa;
    p.threads = threads;
    p.lower_bound = c->kda ? -5.0f : 0.0f; /* KDA with fla's safe gate, GDN with the softplus one */
    return p;
}

static fw_status run_layer(int ref, const linputs *in, const lbatch *s, lcaches *k, const fw_tensor *out,
                           const fw_gdn_layer_params *p)
{
    const fw_gdn_batch b = batch_of(s);
    return (ref ? fw_gdn_layer_ref : fw_gdn_layer)(&in->qkv, &in->b, &in->a, &in->w, &in->bias, &in->alog, &in->dt,
                                                    &b, &k->c, out, p);
}

static double max_diff(const double *x, const double *y, int64_t n)
{
    double e = 0;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs(x[i] - y[i]);
        if (!(d <= e))
            e = isnan(d) ? INFINITY : d;
    }
    return e;
}

static void state_to_double(const float *rec, double *dst)
{
    for (int64_t i = 0; i < SLOTS * RSTRIDE; i++)
        dst[i] = rec[i];
}

/* The slots step s writes (a window of n tokens writes n from its slot). */
static void written_slots(const lbatch *s, int written[SLOTS])
{
    memset(written, 0, sizeof(int) * SLOTS);
    for (int i = 0; i < s->me; i++)
        for (int t = 0; t < (i < s->de && s->spec ? s->qsl[i + 1] - s->qsl[i] : 1); t++)
            written[s->wr[i] + t] = 1;
}

static void layer_case(const lcase *c, uint64_t seed)
{
    const lbatch *s = c->spec ? &spec_step : &plain_step;
    case_begin("layer %s %s qkv, %s", c->kda ? "kda" : "gdn", fw_dtype_name(c->dt),
               c->spec ? "speculative windows" : "decodes + prefills + a skipped sequence");
    linputs in;
    make_layer_inputs(&in, c, s->T, seed);
    const int64_t no = (int64_t)s->T * NV * DV, ns = (int64_t)SLOTS * RSTRIDE;
    double *ro = malloc(sizeof(double) * (size_t)no), *so = malloc(sizeof(double) * (size_t)no);
    double *got = malloc(sizeof(double) * (size_t)no), *rs = malloc(sizeof(double) * (size_t)ns);
    double *ss = malloc(sizeof(double) * (size_t)ns), *ks = malloc(sizeof(double) * (size_t)ns);
    const int64_t os[2] = {s->T, NV * DV};
    /* the exact reference, and the same-roundings one of bf16 products */
    lcaches cr, cs;
    caches_new(&cr, &in, c->dt);
    caches_new(&cs, &in, c->dt);
    fw_gdn_layer_params p = lparams(c, FW_PREC_F32, NULL, 0);
    fw_tensor tro = fw_tensor_contiguous(ro, FW_F64, 2, os), tso = fw_tensor_contiguous(so, FW_F64, 2, os);
    fw_status st = run_layer(1, &in, s, &cr, &tro, &p);
    case_check(st == FW_OK, "reference: %s", fw_last_error());
    p.precision = FW_PREC_BF16;
    st = run_layer(1, &in, s, &cs, &tso, &p);
    case_check(st == FW_OK, "same-roundings reference: %s", fw_last_error());
    for (int64_t i = 0; i < no; i++)
        so[i] = round_to(c->dt, so[i]);
    state_to_double(cr.rec, rs);
    state_to_double(cs.rec, ss);
    const double eosr = max_diff(so, ro, no), essr = max_diff(ss, rs, ns);
    double big = 0;
    for (int64_t i = 0; i < no; i++)
        big = worse(big, fabs(ro[i]));
    const double bar = (c->dt == FW_F32 ? 1e-4 : 2 * 0x1p-8) * (1 + big);
    /* slots the step writes: the rest must keep their bits */
    int written[SLOTS];
    written_slots(s, written);
    gbuf ob = gbuf_new((size_t)no * fw_dtype_size(c->dt));
    fw_tensor to = fw_tensor_contiguous(ob.p, c->dt, 2, os);
    unsigned char *first = malloc(ob.bytes);
    for (int it = 0; it < fw_isa_count(); it++) {
        const char *isa = fw_isa_name(it);
        if (!test_table(isa))
            continue;
        for (int prec = FW_PREC_F32; prec <= FW_PREC_BF16; prec++) {
            lcaches ck;
            caches_new(&ck, &in, c->dt);
            p = lparams(c, prec, isa, 3);
            memset(ob.p, 0xA5, ob.bytes);
            st = run_layer(0, &in, s, &ck, &to, &p);
            case_check(st == FW_OK, "[%s prec %d] %s", isa, prec, fw_last_error());
            case_check(gbuf_guards_ok(&ob), "[%s prec %d] out guards", isa, prec);
            for (int64_t i = 0; i < no; i++) {
                int64_t idx[2] = {i / (NV * DV), i % (NV * DV)};
                got[i] = tget(&to, idx);
            }
            state_to_double(ck.rec, ks);
            const double eo = max_diff(got, ro, no), es = max_diff(ks, rs, ns);
            if (prec == FW_PREC_F32) {
                case_check(eo <= bar, "[%s] out error %.3g > %.3g", isa, eo, bar);
                case_check(es <= bar, "[%s] state error %.3g > %.3g", isa, es, bar);
            } else {
                case_check(eo <= 2 * eosr + 1e-5, "[%s bf16] out error %.3g > 2 x same-roundings %.3g + 1e-5", isa,
                           eo, eosr);
                case_check(es <= 2 * essr + 1e-5, "[%s bf16] state error %.3g > 2 x same-roundings %.3g + 1e-5",
                           isa, es, essr);
            }
            case_check(memcmp(ck.conv, cr.conv, in.conv_bytes) == 0, "[%s prec %d] conv slots differ from the "
                       "reference's", isa, prec);
            for (int sl = 0; sl < SLOTS; sl++)
                case_check(written[sl] || memcmp(ck.rec + sl * RSTRIDE, in.rec0 + sl * RSTRIDE,
                                                  sizeof(float) * RSTRIDE) == 0,
                           "[%s prec %d] slot %d is written by no sequence but changed", isa, prec, sl);
            for (int sl = 0; sl < SLOTS; sl++)
                case_check(memcmp(ck.rec + sl * RSTRIDE + SS, in.rec0 + sl * RSTRIDE + SS, 8 * sizeof(float)) == 0,
                           "[%s prec %d] slot %d's padding changed", isa, prec, sl);
            /* the same bits on one thread */
            memcpy(first, ob.p, ob.bytes);
            lcaches c1;
            caches_new(&c1, &in, c->dt);
            p.threads = 1;
            st = run_layer(0, &in, s, &c1, &to, &p);
            case_check(st == FW_OK && memcmp(first, ob.p, ob.bytes) == 0 &&
                           memcmp(c1.rec, ck.rec, sizeof(float) * SLOTS * RSTRIDE) == 0,
                       "[%s prec %d] 1 and 3 threads differ", isa, prec);
            caches_free(&c1);
            caches_free(&ck);
        }
    }
    free(first); free(ro); free(so); free(got); free(rs); free(ss); free(ks);
    gbuf_free(&ob);
    caches_free(&cr);
    caches_free(&cs);
    free_layer_inputs(&in);
    case_end();
}

static void test_layer_reference(void)
{
    static const lcase cases[] = {
        {FW_F32, 0, 0}, {FW_BF16, 0, 0}, {FW_F32, 1, 0}, {FW_BF16, 1, 0},
        {FW_F32, 0, 1}, {FW_BF16, 0, 1}, {FW_BF16, 1, 1}};
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++)
        layer_case(&cases[i], 300 + (uint64_t)i);
}

/* Caches of one run whose recurrent cache is the bf16 slots rb, reset to rb0 (the conv cache
 * and the unused f32 slots as caches_new makes them). */
static void caches_bf16(lcaches *k, const linputs *in, fw_dtype dt, uint16_t *rb, const uint16_t *rb0)
{
    caches_new(k, in, dt);
    memcpy(rb, rb0, sizeof(uint16_t) * SLOTS * RSTRIDE);
    k->c.recurrent = rb;
    k->c.recurrent_dtype = FW_BF16;
}

/* A bf16 recurrent cache (vLLM's default for a bf16 model). On the plain step (decodes, a
 * prefill longer than the 256-row window, a skipped sequence) the layer and its reference
 * give the bits of the same call on an f32 cache holding the same values, each written slot
 * rounded once, on every table, both precisions and 1 or 3 threads; unwritten slots and the
 * padding keep their bits. Speculative windows (a rounded checkpoint per token, which the next
 * token reads) stay within a bf16 rounding of the reference's. An f16 cache is refused with
 * nothing written, and so is a bf16 one under ReplaySSM (f32 checkpoints). */
static void test_layer_bf16_states(void)
{
    for (int kda = 0; kda < 2; kda++)
        for (int spec = 0; spec < 2; spec++) {
            const lcase c = {FW_BF16, kda, spec};
            const lbatch *s = spec ? &spec_step : &plain_step;
            case_begin("layer %s, bf16 recurrent cache, %s", kda ? "kda" : "gdn",
                       spec ? "speculative windows: within a rounding of the reference" :
                              "plain step: the f32 cache's bits, rounded once");
            linputs in;
            make_layer_inputs(&in, &c, s->T, 340 + (uint64_t)(2 * kda + spec));
            for (int i = 0; i < SLOTS * RSTRIDE; i++) /* values a bf16 cache holds exactly */
                in.rec0[i] = fw_bf16_to_f32(fw_f32_to_bf16(in.rec0[i]));
            uint16_t *rb0 = malloc(sizeof(uint16_t) * SLOTS * RSTRIDE), *rb = malloc(sizeof(uint16_t) * SLOTS * RSTRIDE);
            for (int i = 0; i < SLOTS * RSTRIDE; i++)
                rb0[i] = fw_f32_to_bf16(in.rec0[i]);
            const int64_t no = (int64_t)s->T * NV * DV, os[2] = {s->T, NV * DV};
            gbuf o32 = gbuf_new((size_t)no * 2), o16 = gbuf_new((size_t)no * 2);
            fw_tensor t32 = fw_tensor_contiguous(o32.p, FW_BF16, 2, os), t16 = fw_tensor_contiguous(o16.p, FW_BF16, 2, os);
            double *ro = malloc(sizeof(double) * (size_t)no), *go = malloc(sizeof(double) * (size_t)no);
            fw_tensor tro = fw_tensor_contiguous(ro, FW_F64, 2, os), tgo = fw_tensor_contiguous(go, FW_F64, 2, os);
            /* the references: f32 cache (spec: the exact reference) and bf16 cache */
            lcaches r32, r16;
            caches_new(&r32, &in, c.dt);
            caches_bf16(&r16, &in, c.dt, rb, rb0);
            fw_gdn_layer_params p = lparams(&c, FW_PREC_F32, NULL, 0);
            fw_status st = run_layer(1, &in, s, &r32, &tro, &p);
            case_check(st == FW_OK, "reference, f32 cache: %s", fw_last_error());
            st = run_layer(1, &in, s, &r16, &tgo, &p);
            case_check(st == FW_OK, "reference, bf16 cache: %s", fw_last_error());
            int same = 1;
            for (int i = 0; i < SLOTS * RSTRIDE; i++)
                same &= rb[i] == fw_f32_to_bf16(r32.rec[i]);
            if (!spec)
                case_check(same && memcmp(ro, go, sizeof(double) * (size_t)no) == 0,
                           "reference: bf16 cache differs from the f32 cache's rounded result");
            int written[SLOTS];
            written_slots(s, written);
            double big = 0, sbig = 0;
            for (int64_t i = 0; i < no; i++)
                big = worse(big, fabs(ro[i]));
            for (int i = 0; i < SLOTS * RSTRIDE; i++)
                sbig = worse(sbig, fabs(r32.rec[i]));
            for (int it = 0; it < fw_isa_count(); it++) {
                const char *isa = fw_isa_name(it);
                if (!test_table(isa))
                    continue;
                for (int prec = FW_PREC_F32; prec <= FW_PREC_BF16; prec++)
                    for (int threads = 1; threads <= 3; threads += 2) {
                        lcaches k32, k16;
                        caches_new(&k32, &in, c.dt);
                        caches_bf16(&k16, &in, c.dt, rb, rb0);
                        p = lparams(&c, prec, isa, threads);
                        st = run_layer(0, &in, s, &k32, &t32, &p);
                        st |= run_layer(0, &in, s, &k16, &t16, &p);
                        case_check(st == FW_OK, "[%s prec %d, %d threads] %s", isa, prec, threads, fw_last_error());
                        int kept = 1, bits = 1;
                        double es = 0, eo = 0;
                        for (int i = 0; i < SLOTS * RSTRIDE; i++) {
                            kept &= rb[i] == rb0[i] || (i % RSTRIDE < SS && written[i / RSTRIDE]);
                            bits &= rb[i] == fw_f32_to_bf16(k32.rec[i]);
                            es = worse(es, fabs(fw_bf16_to_f32(rb[i]) - r32.rec[i]));
                        }
                        for (int64_t i = 0; i < no; i++) {
                            const int64_t idx[2] = {i / (NV * DV), i % (NV * DV)};
                            eo = worse(eo, fabs(tget(&t16, idx) - ro[i]));
                        }
                        case_check(kept, "[%s prec %d, %d threads] a slot no sequence writes, or padding, changed", isa,
                                   prec, threads);
                        if (!spec)
                            case_check(bits && memcmp(o32.p, o16.p, o32.bytes) == 0,
                                       "[%s prec %d, %d threads] bf16 cache: %s differ from the f32 cache's", isa, prec,
                                       threads, bits ? "outputs" : "states (rounded)");
                        else if (prec == FW_PREC_F32)
                            case_check(es <= 0x1p-7 * (1 + sbig) && eo <= 0x1p-6 * (1 + big),
                                       "[%s, %d threads] windows: state error %.3g, out error %.3g against the exact "
                                       "reference", isa, threads, es, eo);
                        caches_free(&k32);
                        caches_free(&k16);
                    }
            }
            if (!spec) { /* an f16 cache; ReplaySSM on a bf16 one */
                lcaches kb;
                caches_bf16(&kb, &in, c.dt, rb, rb0);
                kb.c.recurrent_dtype = FW_F16;
                memset(o16.p, 0xA5, o16.bytes);
                p = lparams(&c, FW_PREC_AUTO, NULL, 2);
                for (int ref = 0; ref < 2; ref++) {
                    st = run_layer(ref, &in, s, &kb, ref ? &tgo : &t16, &p);
                    case_check(st == FW_ERR_DTYPE, "[%s] f16 recurrent cache: status %d (%s)",
                               ref ? "reference" : "layer", (int)st, fw_last_error());
                }
                kb.c.recurrent_dtype = FW_BF16;
                const int64_t rdim = fw_gdn_replay_record_dim(NKQ, NV, DK, DV, kda);
                gbuf sh = gbuf_new((size_t)SLOTS * SS * 2), rec = gbuf_new((size_t)SLOTS * 4 * rdim * 4);
                int32_t lens[8] = {0};
                fw_gdn_replay r = {fw_tensor_contiguous(sh.p, FW_BF16, 4, (int64_t[]){SLOTS, NV, DK, DV}),
                                   fw_tensor_contiguous(rec.p, FW_F32, 3, (int64_t[]){SLOTS, 4, rdim}), lens};
                const fw_gdn_batch b = batch_of(s);
                st = fw_gdn_layer_replay(&in.qkv, &in.b, &in.a, &in.w, &in.bias, &in.alog, &in.dt, &b, &kb.c, &r,
                                         &t16, &p);
                case_check(st == FW_ERR_DTYPE, "ReplaySSM on a bf16 cache: status %d (%s)", (int)st, fw_last_error());
                int untouched = memcmp(rb, rb0, sizeof(uint16_t) * SLOTS * RSTRIDE) == 0 &&
                                memcmp(kb.conv, in.conv0, in.conv_bytes) == 0;
                for (size_t i = 0; i < o16.bytes; i++)
                    untouched &= ((unsigned char *)o16.p)[i] == 0xA5;
                case_check(untouched, "a refused call wrote");
                gbuf_free(&sh);
                gbuf_free(&rec);
                caches_free(&kb);
            }
            free(rb0); free(rb); free(ro); free(go);
            gbuf_free(&o32);
            gbuf_free(&o16);
            caches_free(&r32);
            caches_free(&r16);
            free_layer_inputs(&in);
            case_end();
        }
}

/* Two sequences writing one slot, and rows past qkv: both the layer and its reference refuse
 * with the same status, and neither writes out or a cache. */
static void test_layer_reference_bad_input(void)
{
    const lcase c = {FW_F32, 0, 0};
    case_begin("layer and reference refuse the same bad input");
    linputs in;
    make_layer_inputs(&in, &c, plain_step.T, 320);
    lbatch dup = plain_step, past = plain_step;
    dup.wr[4] = dup.wr[2];
    past.me = past.n = 6;
    past.qsl[6] = past.T + 1;
    const lbatch *bad[2] = {&dup, &past};
    static const fw_status want[2] = {FW_ERR_INDEX, FW_ERR_SEQLENS};
    gbuf ob = gbuf_new((size_t)plain_step.T * NV * DV * 8);
    for (int k = 0; k < 2; k++)
        for (int ref = 0; ref < 2; ref++) {
            lcaches ck;
            caches_new(&ck, &in, c.dt);
            fw_gdn_layer_params p = lparams(&c, FW_PREC_F32, NULL, 2);
            fw_tensor to = fw_tensor_contiguous(ob.p, ref ? FW_F64 : FW_F32, 2, (int64_t[]){plain_step.T, NV * DV});
            memset(ob.p, 0xA5, ob.bytes);
            const fw_status st = run_layer(ref, &in, bad[k], &ck, &to, &p);
            case_check(st == want[k], "[%s case %d] status %d, want %d (%s)", ref ? "reference" : "layer", k,
                       (int)st, (int)want[k], fw_last_error());
            size_t wrote = 0;
            for (size_t i = 0; i < ob.bytes; i++)
                wrote += ((unsigned char *)ob.p)[i] != 0xA5;
            case_check(wrote == 0 && gbuf_guards_ok(&ob), "[%s case %d] out written", ref ? "reference" : "layer", k);
            case_check(memcmp(ck.conv, in.conv0, in.conv_bytes) == 0 &&
                           memcmp(ck.rec, in.rec0, sizeof(float) * SLOTS * RSTRIDE) == 0,
                       "[%s case %d] a cache written", ref ? "reference" : "layer", k);
            caches_free(&ck);
        }
    gbuf_free(&ob);
    free_layer_inputs(&in);
    case_end();
}

/* ReplaySSM (fw_gdn_layer_replay) over several steps of one batch: a decode in place (its
 * records accumulate, then flush when the window fills), one from a prefix slot (flushes
 * every step), a new sequence, a new prefill (its state's shadow written); speculative
 * windows in the `spec` cases. Every step both the layer and its reference start from the
 * same caches: out, checkpoints, records and conv slots against the reference under the
 * layer's bars, each shadow the bf16 of its checkpoint, untouched slots and records kept,
 * 1 and 3 threads the same bits, every table. Without windows and with f32 records, the
 * decode in place also follows the plain layer (fw_gdn_layer_ref) on the same tokens. */
enum { RW = 4, RSTEPS = 6 };
static const lbatch replay_step = {
    4, 3, 4, 4, 0, 25, {0, 1, 2, 3, 23}, {30, 12, 1, 20}, {3, 5, 6, 8}, {3, 4, 0, 0}, {0}};
static const lbatch replay_spec_step = {
    4, 3, 4, 4, 2, 30, {0, 3, 5, 6, 26}, {40, 12, 1, 20}, {3, 12, 7, 8}, {3, 10, 0, 0}, {0, 1, 0, 0}};

typedef struct {
    fw_dtype dt, rdt; /* qkv's dtype, the records' */
    int kda, spec;
    int prec; /* FW_PREC_BF16: the decodes read the bf16 shadow */
} rcase;

typedef struct {
    lcaches k;
    gbuf shadow, rec;
    fw_gdn_replay r;
} rstate;

static void rstate_new(rstate *x, const linputs *in, const rcase *c, int64_t rdim)
{
    const lcase lc = {c->dt, c->kda, c->spec};
    caches_new(&x->k, in, lc.dt);
    x->shadow = gbuf_new((size_t)SLOTS * SS * 2);
    x->rec = gbuf_new((size_t)(SLOTS * RW * rdim) * fw_dtype_size(c->rdt));
    x->r.shadow = fw_tensor_contiguous(x->shadow.p, FW_BF16, 4, (int64_t[]){SLOTS, NV, DK, DV});
    x->r.records = fw_tensor_contiguous(x->rec.p, c->rdt, 3, (int64_t[]){SLOTS, RW, rdim});
    x->r.replay_lens = NULL;
    rng_seed(77);
    tfill_normal(&x->r.records, 0.3);
    const int64_t goff = NV * DV + NKQ * DK; /* log decays: non-positive */
    for (int64_t sl = 0; sl < SLOTS; sl++)
        for (int64_t j = 0; j < RW; j++)
            for (int64_t g = goff; g < rdim; g++)
                fw_store_f64(&x->r.records, (sl * RW + j) * rdim + g, -fabs(fw_load_f64(&x->r.records, (sl * RW + j) * rdim + g)));
    for (int64_t sl = 0; sl < SLOTS; sl++) /* each shadow the bf16 of its checkpoint */
        for (int64_t e = 0; e < SS; e++)
            ((uint16_t *)x->shadow.p)[sl * SS + e] = fw_f32_to_bf16(in->rec0[sl * RSTRIDE + e]);
}

static void rstate_copy(rstate *dst, const rstate *src)
{
    memcpy(dst->k.conv, src->k.conv, src->k.c.conv.shape[0] * (KW - 1) * DIM * fw_dtype_size(src->k.c.conv.dtype));
    memcpy(dst->k.rec, src->k.rec, sizeof(float) * SLOTS * RSTRIDE);
    memcpy(dst->shadow.p, src->shadow.p, src->shadow.bytes);
    memcpy(dst->rec.p, src->rec.p, src->rec.bytes);
}

static void rstate_free(rstate *x)
{
    caches_free(&x->k);
    gbuf_free(&x->shadow);
    gbuf_free(&x->rec);
}

static fw_status run_replay(int ref, const linputs *in, const lbatch *s, rstate *x, const int32_t *lens,
                            const fw_tensor *out, const fw_gdn_layer_params *p)
{
    const fw_gdn_batch b = batch_of(s);
    x->r.replay_lens = lens;
    return (ref ? fw_gdn_layer_replay_ref : fw_gdn_layer_replay)(&in->qkv, &in->b, &in->a, &in->w, &in->bias,
                                                                  &in->alog, &in->dt, &b, &x->k.c, &x->r, out, p);
}

static void replay_case(const rcase *c, uint64_t seed)
{
    const lbatch *s = c->spec ? &replay_spec_step : &replay_step;
    const lcase lc = {c->dt, c->kda, c->spec};
    case_begin("layer replay %s %s qkv, %s records%s%s", c->kda ? "kda" : "gdn", fw_dtype_name(c->dt),
               fw_dtype_name(c->rdt), c->spec ? ", speculative windows" : "",
               c->prec == FW_PREC_BF16 ? ", bf16 products (shadow reads)" : "");
    const int64_t rdim = fw_gdn_replay_record_dim(NKQ, NV, DK, DV, c->kda), no = (int64_t)s->T * NV * DV;
    const int64_t os[2] = {s->T, NV * DV}, nrec = (int64_t)SLOTS * RW * rdim;
    linputs in;
    make_layer_inputs(&in, &lc, s->T, seed);
    rstate run, ref, plain;
    rstate_new(&run, &in, c, rdim);
    rstate_new(&ref, &in, c, rdim);
    rstate_new(&plain, &in, c, rdim);
    gbuf ob = gbuf_new((size_t)no * fw_dtype_size(c->dt)), ob1 = gbuf_new(ob.bytes);
    double *ro = malloc(sizeof(double) * (size_t)no), *po = malloc(sizeof(double) * (size_t)no);
    fw_tensor to = fw_tensor_contiguous(ob.p, c->dt, 2, os), to1 = fw_tensor_contiguous(ob1.p, c->dt, 2, os);
    fw_tensor tro = fw_tensor_contiguous(ro, FW_F64, 2, os), tpo = fw_tensor_contiguous(po, FW_F64, 2, os);
    int32_t lens[4] = {0, 3, 0, 0}; /* the decode in place starts from its checkpoint alone */
    const int bf = c->dt == FW_BF16, rbf = c->rdt == FW_BF16;
    int flushes = 0;
    for (int step = 0; step < RSTEPS; step++) {
        rng_seed(seed * 100 + (uint64_t)step); /* new tokens each step */
        tfill_normal(&in.qkv, 1.0);
        tfill_normal(&in.a, 1.0);
        tfill_normal(&in.b, 1.0);
        fw_gdn_layer_params p;
        fw_status st;
        double big = 0, bar = 0;
        void *rec0 = malloc(run.rec.bytes), *sh0 = malloc(run.shadow.bytes);
        memcpy(rec0, run.rec.p, run.rec.bytes);
        memcpy(sh0, run.shadow.p, run.shadow.bytes);
        float *st0 = malloc(sizeof(float) * SLOTS * RSTRIDE);
        memcpy(st0, run.k.rec, sizeof(float) * SLOTS * RSTRIDE);
        rstate one;
        rstate_new(&one, &in, c, rdim);
        for (int it = 0; it < fw_isa_count(); it++) {
            const char *isa = fw_isa_name(it);
            if (!test_table(isa))
                continue;
            /* the reference with the table's products: FW_PREC_AUTO resolves per table */
            p = lparams(&lc, c->prec, isa, 0);
            rstate_copy(&ref, &run);
            st = run_replay(1, &in, s, &ref, lens, &tro, &p);
            case_check(st == FW_OK, "[step %d %s] reference: %s", step, isa, fw_last_error());
            big = 0;
            for (int64_t i = 0; i < no; i++)
                big = worse(big, fabs(ro[i]));
            bar = (bf ? 2 * 0x1p-8 : 1e-4) * (1 + big);
            rstate k;
            rstate_new(&k, &in, c, rdim);
            rstate_copy(&k, &run);
            rstate_copy(&one, &run);
            p = lparams(&lc, c->prec, isa, 3);
            st = run_replay(0, &in, s, &k, lens, &to, &p);
            case_check(st == FW_OK, "[step %d %s] %s", step, isa, fw_last_error());
            double eo = 0, es = 0, er = 0;
            for (int64_t i = 0; i < no; i++)
                eo = worse(eo, fabs(tget(&to, (int64_t[]){i / (NV * DV), i % (NV * DV)}) - ro[i]));
            for (int64_t i = 0; i < SLOTS * RSTRIDE; i++)
                es = worse(es, fabs((double)k.k.rec[i] - ref.k.rec[i]));
            for (int64_t i = 0; i < nrec; i++) {
                const double want = fw_load_f64(&ref.r.records, i), d = fabs(fw_load_f64(&k.r.records, i) - want);
                er = fmax(er, rbf ? d / (0x1p-7 * (1 + fabs(want))) * 1e-4 : d);
            }
            case_check(eo <= bar && es <= bar && er <= 1e-4 * (1 + big), "[step %d %s] out error %.3g, checkpoint "
                       "%.3g, records %.3g (bar %.3g)", step, isa, eo, es, er, bar);
            case_check(memcmp(k.k.conv, ref.k.conv, in.conv_bytes) == 0, "[step %d %s] conv slots differ", step, isa);
            /* every shadow written is its checkpoint's bf16; slots nobody writes keep their bits */
            int sh_ok = 1, kept = 1;
            for (int64_t sl = 0; sl < SLOTS; sl++) {
                const int ckpt_changed = memcmp(k.k.rec + sl * RSTRIDE, st0 + sl * RSTRIDE, sizeof(float) * SS) != 0;
                const int sh_changed = memcmp((char *)k.shadow.p + sl * SS * 2, (char *)sh0 + sl * SS * 2, SS * 2) != 0;
                if (sh_changed || ckpt_changed)
                    for (int64_t e = 0; e < SS; e++)
                        sh_ok &= ((uint16_t *)k.shadow.p)[sl * SS + e] == fw_cvt_f32_bf16(k.k.rec[sl * RSTRIDE + e]);
                kept &= memcmp(k.k.rec + sl * RSTRIDE + SS, st0 + sl * RSTRIDE + SS, 8 * sizeof(float)) == 0;
                int touched = 0;
                for (int i = 0; i < s->me; i++)
                    touched |= s->wr[i] == sl;
                if (!touched)
                    kept &= !ckpt_changed && !sh_changed &&
                            memcmp((char *)k.rec.p + sl * RW * rdim * fw_dtype_size(c->rdt),
                                   (char *)rec0 + sl * RW * rdim * fw_dtype_size(c->rdt),
                                   (size_t)(RW * rdim) * fw_dtype_size(c->rdt)) == 0;
            }
            case_check(sh_ok, "[step %d %s] a shadow is not its checkpoint's bf16", step, isa);
            case_check(kept, "[step %d %s] a slot nobody writes, or a slot's padding, changed", step, isa);
            p.threads = 1;
            st = run_replay(0, &in, s, &one, lens, &to1, &p);
            case_check(st == FW_OK && memcmp(ob.p, ob1.p, ob.bytes) == 0 &&
                           memcmp(k.k.rec, one.k.rec, sizeof(float) * SLOTS * RSTRIDE) == 0 &&
                           memcmp(k.rec.p, one.rec.p, k.rec.bytes) == 0,
                       "[step %d %s] 1 and 3 threads differ", step, isa);
            if (it == 0 || !strcmp(isa, fw_isa_default()))
                rstate_copy(&one, &k);
            rstate_free(&k);
        }
        /* carry the default table's caches on; the decode in place against the plain layer */
        rstate_copy(&run, &one);
        if (!c->spec && !rbf && c->prec == FW_PREC_F32) {
            const lbatch mine = {1, 1, 1, 1, 0, s->T, {0, 1}, {s->sl[0]}, {3}, {3}, {0}};
            p = lparams(&lc, FW_PREC_F32, NULL, 0);
            const fw_gdn_batch b = batch_of(&mine);
            st = fw_gdn_layer_ref(&in.qkv, &in.b, &in.a, &in.w, &in.bias, &in.alog, &in.dt, &b, &plain.k.c, &tpo, &p);
            double ep = 0;
            for (int64_t e = 0; e < NV * DV; e++)
                ep = worse(ep, fabs(po[e] - ro[e]));
            case_check(st == FW_OK && ep <= bar, "[step %d] the decode in place is %.3g from the plain layer's",
                       step, ep);
        }
        for (int i = 0; i < s->de; i++) { /* accept every token */
            const int ql = s->qsl[i + 1] - s->qsl[i], has = s->sl[i] > ql;
            const int len = has ? lens[i] : 0, flush = !has || len + ql > RW || s->rd[i] != s->wr[i];
            flushes += flush;
            lens[i] = (flush ? 0 : len) + ql;
        }
        free(rec0);
        free(sh0);
        free(st0);
        rstate_free(&one);
    }
    case_check(flushes >= RSTEPS + 2, "only %d flushes", flushes);
    free(ro);
    free(po);
    gbuf_free(&ob);
    gbuf_free(&ob1);
    rstate_free(&run);
    rstate_free(&ref);
    rstate_free(&plain);
    free_layer_inputs(&in);
    case_end();
}

static void test_layer_replay(void)
{
    static const rcase cases[] = {
        {FW_F32, FW_F32, 0, 0, FW_PREC_F32}, {FW_BF16, FW_BF16, 0, 0, FW_PREC_F32},
        {FW_F32, FW_F32, 1, 0, FW_PREC_F32}, {FW_F32, FW_F32, 0, 1, FW_PREC_F32},
        {FW_BF16, FW_BF16, 1, 1, FW_PREC_F32}, {FW_BF16, FW_F32, 0, 0, FW_PREC_AUTO},
        {FW_F32, FW_BF16, 1, 1, FW_PREC_BF16}};
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++)
        replay_case(&cases[i], 400 + (uint64_t)i);
}

/* Bad replay input, each class refused by the layer and its reference with its status and
 * nothing written: replay NULL, a shadow not bf16, records of the wrong width, a window
 * shorter than a speculative window, committed records past the window, a decode reading
 * records another sequence writes. */
static void test_layer_replay_bad_input(void)
{
    const rcase c = {FW_F32, FW_F32, 0, 0, FW_PREC_F32};
    const lcase lc = {FW_F32, 0, 0};
    case_begin("layer replay: bad input refused, nothing written");
    const int64_t rdim = fw_gdn_replay_record_dim(NKQ, NV, DK, DV, 0);
    linputs in;
    make_layer_inputs(&in, &lc, replay_step.T, 330);
    rstate x;
    rstate_new(&x, &in, &c, rdim);
    void *rec0 = malloc(x.rec.bytes), *sh0 = malloc(x.shadow.bytes);
    memcpy(rec0, x.rec.p, x.rec.bytes);
    memcpy(sh0, x.shadow.p, x.shadow.bytes);
    gbuf ob = gbuf_new((size_t)replay_step.T * NV * DV * 8);
    static const fw_status want[6] = {FW_ERR_NULL, FW_ERR_DTYPE, FW_ERR_SHAPE, FW_ERR_SHAPE, FW_ERR_INDEX,
                                      FW_ERR_INDEX};
    for (int k = 0; k < 6; k++)
        for (int ref = 0; ref < 2; ref++) {
            lbatch s = replay_step;
            int32_t lens[4] = {1, 1, 0, 0};
            fw_gdn_replay r = x.r, *rp = &r;
            if (k == 0)
                rp = NULL;
            if (k == 1)
                r.shadow.dtype = FW_F16;
            if (k == 2)
                r.records.shape[2] = rdim - 1;
            if (k == 3) { /* windows of 5 tokens need 5 records */
                s.spec = 4;
                r.records.shape[1] = 4;
                r.records.stride[0] = 4 * rdim;
            }
            if (k == 4)
                lens[0] = RW + 1;
            if (k == 5) /* the decode from slot 4 reads what the prefill writes */
                s.wr[3] = 4;
            const fw_gdn_batch b = batch_of(&s);
            r.replay_lens = lens;
            fw_gdn_layer_params p = lparams(&lc, FW_PREC_F32, NULL, 2);
            fw_tensor to = fw_tensor_contiguous(ob.p, ref ? FW_F64 : FW_F32, 2, (int64_t[]){replay_step.T, NV * DV});
            memset(ob.p, 0xA5, ob.bytes);
            const fw_status st = (ref ? fw_gdn_layer_replay_ref : fw_gdn_layer_replay)(
                &in.qkv, &in.b, &in.a, &in.w, &in.bias, &in.alog, &in.dt, &b, &x.k.c, rp, &to, &p);
            case_check(st == want[k], "[%s case %d] status %d, want %d (%s)", ref ? "reference" : "layer", k, (int)st,
                       (int)want[k], fw_last_error());
            size_t wrote = 0;
            for (size_t i = 0; i < ob.bytes; i++)
                wrote += ((unsigned char *)ob.p)[i] != 0xA5;
            case_check(wrote == 0 && memcmp(x.k.conv, in.conv0, in.conv_bytes) == 0 &&
                           memcmp(x.k.rec, in.rec0, sizeof(float) * SLOTS * RSTRIDE) == 0 &&
                           memcmp(x.rec.p, rec0, x.rec.bytes) == 0 && memcmp(x.shadow.p, sh0, x.shadow.bytes) == 0,
                       "[%s case %d] something was written", ref ? "reference" : "layer", k);
        }
    free(rec0);
    free(sh0);
    gbuf_free(&ob);
    rstate_free(&x);
    free_layer_inputs(&in);
    case_end();
}

const test_suite layer_suites[] = {
    {"layer.replay_bad_input", test_layer_replay_bad_input},
    {"layer.replay", test_layer_replay},
    {"layer.reference", test_layer_reference},
    {"layer.bf16_states", test_layer_bf16_states},
    {"layer.reference_bad_input", test_layer_reference_bad_input},
    {NULL, NULL}};
