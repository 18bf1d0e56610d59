/*
 * test_rotary.c: the rotary embedding fused into attention (fw_attn_params.rotary_*): the
 * dense / varlen forward (q and k rotated as their tiles are packed, decode-shaped calls
 * included) and the KV cache (new keys rotated as they are appended), on every table and
 * in both product precisions, against the float64 reference with the accuracy bar of
 * test_attn.c; the reference's convention against a rotation written here from flash-attn's
 * definition (rotate, then attend without rotary); and bad input.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "test_util.h"

typedef struct {
    int64_t sq, sk, hq, hkv, d, rd;
    fw_dtype dt;
    int causal, inter;
} rshape;

/* cos / sin tables [n, rd / 2] of RoPE with base 10000, f32, row stride `ld` >= rd / 2. */
typedef struct {
    float *c, *s;
    fw_tensor tc, ts;
} rtable;

static rtable table_make(int64_t n, int64_t rd, int64_t ld)
{
    rtable t;
    const int64_t h = rd / 2, shp[2] = {n, h};
    t.c = malloc((size_t)(n * ld + 1) * sizeof(float));
    t.s = malloc((size_t)(n * ld + 1) * sizeof(float));
    for (int64_t p = 0; p < n; p++)
        for (int64_t i = 0; i < h; i++) {
            const double f = p * pow(10000.0, -2.0 * (double)i / (double)rd);
            t.c[p * ld + i] = (float)cos(f);
            t.s[p * ld + i] = (float)sin(f);
        }
    t.tc = fw_tensor_contiguous(t.c, FW_F32, 2, shp);
    t.ts = fw_tensor_contiguous(t.s, FW_F32, 2, shp);
    t.tc.stride[0] = t.ts.stride[0] = ld;
    return t;
}

static void table_free(rtable *t)
{
    free(t->c);
    free(t->s);
}

/* flash-attn's rotation of one head row x (d values) at position p, in double. */
static void rotate_ref(double *x, int64_t rd, int inter, const rtable *t, int64_t p)
{
    const int64_t h = rd / 2;
    for (int64_t i = 0; i < h; i++) {
        const double c = t->c[p * t->tc.stride[0] + i], s = t->s[p * t->tc.stride[0] + i];
        const int64_t a = inter ? 2 * i : i, b = inter ? 2 * i + 1 : i + h;
        const double x0 = x[a], x1 = x[b];
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
}

static double max_diff(const double *a, const double *b, int64_t n)
{
    double e = 0;
    for (int64_t i = 0; i < n; i++) {
        const double x = fabs(a[i] - b[i]);
        e = x <= e ? e : isnan(x) ? INFINITY : x;
    }
    return e;
}

static double *to64(const fw_tensor *t, int64_t n)
{
    double *x = malloc((size_t)(n + 1) * sizeof(double));
    int64_t idx[4] = {0}, i = 0;
    if (n)
        do x[i++] = tget(t, idx); while (tnext(t, idx));
    return x;
}

/* Dense forward with rotary: every table, both precisions, against the reference. */
static void run_dense(const rshape *s)
{
    case_begin("rotary dense sq%lld sk%lld h%lld:%lld d%lld rd%lld %s%s %s", (long long)s->sq,
               (long long)s->sk, (long long)s->hq, (long long)s->hkv, (long long)s->d,
               (long long)s->rd, fw_dtype_name(s->dt), s->causal ? " causal" : "",
               s->inter ? "GPT-J" : "NeoX");
    const int64_t qs[4] = {1, s->sq, s->hq, s->d}, ks[4] = {1, s->sk, s->hkv, s->d},
                  os[4] = {1, s->sq, s->hq, s->d};
    const int64_t nq = s->sq * s->hq * s->d, nk = s->sk * s->hkv * s->d;
    const size_t es = fw_dtype_size(s->dt);
    char *buf = malloc((size_t)(nq + 2 * nk) * es + 16);
    fw_tensor q = fw_tensor_contiguous(buf, s->dt, 4, qs), k = fw_tensor_contiguous(buf + nq * es, s->dt, 4, ks);
    fw_tensor v = fw_tensor_contiguous(buf + (nq + nk) * es, s->dt, 4, ks);
    rng_seed((uint64_t)(s->sq * 7 + s->sk + s->d));
    tfill_normal(&q, 1.0);
    tfill_normal(&k, 1.0);
    tfill_normal(&v, 1.0);
    rtable t = table_make(s->sk + 3, s->rd, s->rd / 2 + 5);
    float *o = malloc((size_t)(nq + 1) * sizeof(float));
    double *ref = malloc((size_t)(nq + 1) * sizeof(double)), *sr = malloc((size_t)(nq + 1) * sizeof(double));
    fw_tensor to = fw_tensor_contiguous(o, FW_F32, 4, os), tr = fw_tensor_contiguous(ref, FW_F64, 4, os),
              ts = fw_tensor_contiguous(sr, FW_F64, 4, os);
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.causal = s->causal;
    p.rotary_cos = &t.tc;
    p.rotary_sin = &t.ts;
    p.rotary_interleaved = s->inter;
    p.precision = FW_PREC_F32;
    fw_status r = fw_attn_ref(&q, &k, &v, &tr, NULL, &p, 0, INT64_MAX);
    case_check(r == FW_OK, "reference: %s", fw_last_error());
    p.precision = FW_PREC_BF16;
    r = fw_attn_ref(&q, &k, &v, &ts, NULL, &p, 0, INT64_MAX);
    case_check(r == FW_OK, "bf16 reference: %s", fw_last_error());
    const double esr = max_diff(sr, ref, nq);
    p.flags = FW_ATTN_PLAIN;
    p.precision = FW_PREC_AUTO;
    r = fw_attn_fwd(&q, &k, &v, &to, NULL, &p);
    case_check(r == FW_OK, "plain: %s", fw_last_error());
    double *x = to64(&to, nq);
    const double ep = max_diff(x, ref, nq);
    free(x);
    for (int i = 0; i < fw_isa_count(); i++) {
        if (!test_table(fw_isa_name(i)))
            continue;
        for (int prec = FW_PREC_F32; prec <= FW_PREC_BF16; prec++) {
            p.flags = 0;
            p.isa = fw_isa_name(i);
            p.precision = prec;
            p.threads = 2;
            r = fw_attn_fwd(&q, &k, &v, &to, NULL, &p);
            case_check(r == FW_OK, "[%s] %s", p.isa, fw_last_error());
            x = to64(&to, nq);
            const double e = max_diff(x, ref, nq), bar = 2 * (prec == FW_PREC_BF16 ? esr : ep) + 1e-5;
            case_check(e <= bar, "[%s %s products] error %.3g > %.3g", p.isa,
                       prec == FW_PREC_BF16 ? "bf16" : "f32", e, bar);
            free(x);
        }
    }
    free(o); free(ref); free(sr); free(buf);
    table_free(&t);
    case_end();
}

static void test_dense(void)
{
    const rshape S[] = {
        {100, 100, 4, 2, 64, 64, FW_F32, 1, 0},  {100, 100, 4, 2, 64, 64, FW_F32, 1, 1},
        {37, 90, 8, 2, 80, 32, FW_BF16, 1, 0},   {37, 90, 8, 2, 80, 32, FW_BF16, 0, 1},
        {1, 70, 4, 4, 64, 16, FW_F16, 0, 0},     {3, 130, 8, 1, 128, 128, FW_BF16, 1, 1},
        {65, 65, 6, 3, 34, 2, FW_F32, 1, 0},
    };
    for (size_t i = 0; i < sizeof S / sizeof S[0]; i++)
        run_dense(&S[i]);
}

/* The reference's convention: attention with rotary equals attention without it on q and k
 * rotated here (flash-attn's definition), in double, stored as f32: query i at sk - sq + i,
 * key j at j. */
static void test_convention(void)
{
    for (int mode = 0; mode < 3; mode++) {
        const int inter = mode == 1, q_only = mode == 2;
        case_begin("rotary convention (%s): rotate-then-attend equals fused",
                   q_only ? "NeoX, q only" : inter ? "GPT-J" : "NeoX");
        const int64_t sq = 20, sk = 50, h = 2, d = 24, rd = 16;
        const int64_t qs[4] = {1, sq, h, d}, ks[4] = {1, sk, h, d};
        float *q = malloc((size_t)(sq * h * d) * 4), *k = malloc((size_t)(sk * h * d) * 4),
              *v = malloc((size_t)(sk * h * d) * 4), *q2 = malloc((size_t)(sq * h * d) * 4),
              *k2 = malloc((size_t)(sk * h * d) * 4);
        fw_tensor tq = fw_tensor_contiguous(q, FW_F32, 4, qs), tk = fw_tensor_contiguous(k, FW_F32, 4, ks),
                  tv = fw_tensor_contiguous(v, FW_F32, 4, ks), tq2 = fw_tensor_contiguous(q2, FW_F32, 4, qs),
                  tk2 = fw_tensor_contiguous(k2, FW_F32, 4, ks);
        rng_seed(21);
        tfill_normal(&tq, 1.0);
        tfill_normal(&tk, 1.0);
        tfill_normal(&tv, 1.0);
        rtable t = table_make(sk, rd, rd / 2);
        double row[64];
        for (int w = 0; w < 2; w++) {
            const int64_t n = w ? sk : sq;
            for (int64_t i = 0; i < n; i++)
                for (int64_t hh = 0; hh < h; hh++) {
                    const float *src = (w ? k : q) + (i * h + hh) * d;
                    for (int64_t x = 0; x < d; x++)
                        row[x] = src[x];
                    if (!(w && q_only))
                        rotate_ref(row, rd, inter, &t, w ? i : sk - sq + i);
                    for (int64_t x = 0; x < d; x++)
                        (w ? k2 : q2)[(i * h + hh) * d + x] = (float)row[x];
                }
        }
        double *a = malloc((size_t)(sq * h * d) * 8), *b = malloc((size_t)(sq * h * d) * 8);
        fw_tensor ta = fw_tensor_contiguous(a, FW_F64, 4, qs), tb = fw_tensor_contiguous(b, FW_F64, 4, qs);
        fw_attn_params p;
        fw_attn_params_init(&p);
        p.causal = 1;
        p.precision = FW_PREC_F32;
        case_check(fw_attn_ref(&tq2, &tk2, &tv, &tb, NULL, &p, 0, INT64_MAX) == FW_OK, "%s", fw_last_error());
        p.rotary_cos = &t.tc;
        p.rotary_sin = &t.ts;
        p.rotary_interleaved = inter;
        p.rotary_q_only = q_only;
        case_check(fw_attn_ref(&tq, &tk, &tv, &ta, NULL, &p, 0, INT64_MAX) == FW_OK, "%s", fw_last_error());
        double e = max_diff(a, b, sq * h * d);
        case_check(e <= 1e-5, "fused and rotate-then-attend differ by %.3g (reference)", e);
        p.threads = 2;
        case_check(fw_attn_fwd(&tq, &tk, &tv, &ta, NULL, &p) == FW_ERR_DTYPE, "f64 out accepted");
        float *o = malloc((size_t)(sq * h * d) * 4);
        fw_tensor to = fw_tensor_contiguous(o, FW_F32, 4, qs);
        case_check(fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p) == FW_OK, "%s", fw_last_error());
        for (int64_t i = 0; i < sq * h * d; i++)
            a[i] = o[i];
        e = max_diff(a, b, sq * h * d);
        case_check(e <= 1e-5, "fused and rotate-then-attend differ by %.3g (kernel)", e);
        free(o);
        free(q); free(k); free(v); free(q2); free(k2); free(a); free(b);
        table_free(&t);
        case_end();
    }
}

/* The KV cache: new keys rotated at seqlens + i on append (the cache holds them rounded to its
 * dtype); queries at seqlens + i when causal, at seqlens otherwise; contiguous and paged. */
static void test_kvcache(void)
{
    for (int paged = 0; paged < 2; paged++)
        for (int causal = 0; causal < 2; causal++) {
            case_begin("rotary kvcache %s, %s", paged ? "paged" : "contiguous", causal ? "causal" : "full");
            const int64_t b = 2, S = 64, hkv = 2, hq = 4, d = 32, rd = 32, n = 3;
            const int32_t cached[2] = {5, 40}, cu[3] = {0, 3, 6};
            const int64_t cs[4] = {b * (paged ? 4 : 1), paged ? 16 : S, hkv, d}, qs[3] = {b * n, hq, d},
                          ns[3] = {b * n, hkv, d};
            const int64_t ncache = cs[0] * cs[1] * hkv * d;
            uint16_t *kc = malloc((size_t)ncache * 2), *vc = malloc((size_t)ncache * 2);
            uint16_t *kn = malloc((size_t)(b * n * hkv * d) * 2), *vn = malloc((size_t)(b * n * hkv * d) * 2);
            uint16_t *qq = malloc((size_t)(b * n * hq * d) * 2);
            fw_tensor tkc = fw_tensor_contiguous(kc, FW_BF16, 4, cs), tvc = fw_tensor_contiguous(vc, FW_BF16, 4, cs);
            fw_tensor tkn = fw_tensor_contiguous(kn, FW_BF16, 3, ns), tvn = fw_tensor_contiguous(vn, FW_BF16, 3, ns);
            fw_tensor tq = fw_tensor_contiguous(qq, FW_BF16, 3, qs);
            rng_seed(31 + (uint64_t)paged);
            tfill_normal(&tkc, 1.0);
            tfill_normal(&tvc, 1.0);
            tfill_normal(&tkn, 1.0);
            tfill_normal(&tvn, 1.0);
            tfill_normal(&tq, 1.0);
            const int32_t bt[8] = {3, 0, 6, 5, 1, 4, 7, 2}; /* 4 pages of 16 per sequence */
            fw_kv_cache c;
            memset(&c, 0, sizeof c);
            c.k = tkc;
            c.v = tvc;
            c.seqlens = cached;
            if (paged) {
                c.block_table = bt;
                c.max_pages = 4;
            }
            rtable t = table_make(S, rd, rd / 2);
            fw_attn_params p;
            fw_attn_params_init(&p);
            p.causal = causal;
            p.rotary_cos = &t.tc;
            p.rotary_sin = &t.ts;
            p.precision = FW_PREC_F32;
            const int64_t os[3] = {b * n, hq, d};
            double *ref = malloc((size_t)(b * n * hq * d) * 8);
            float *out = malloc((size_t)(b * n * hq * d) * 4);
            fw_tensor tr = fw_tensor_contiguous(ref, FW_F64, 3, os), to = fw_tensor_contiguous(out, FW_F32, 3, os);
            fw_status r = fw_attn_kvcache_ref(&tq, &tkn, &tvn, cu, b, &c, &tr, NULL, &p);
            case_check(r == FW_OK, "reference: %s", fw_last_error());
            /* an independent check of the positions: the reference without rotary on q and
             * new keys rotated here equals the one with it */
            {
                uint16_t *q2 = malloc((size_t)(b * n * hq * d) * 2), *k2 = malloc((size_t)(b * n * hkv * d) * 2);
                fw_tensor tq2 = fw_tensor_contiguous(q2, FW_BF16, 3, qs), tk2 = fw_tensor_contiguous(k2, FW_BF16, 3, ns);
                double row[32];
                for (int64_t i = 0; i < b; i++)
                    for (int64_t j = 0; j < n; j++) {
                        for (int64_t hh = 0; hh < hq; hh++) {
                            for (int64_t x = 0; x < d; x++)
                                row[x] = fw_bf16_to_f32(qq[((i * n + j) * hq + hh) * d + x]);
                            rotate_ref(row, rd, 0, &t, cached[i] + (causal ? j : 0));
                            for (int64_t x = 0; x < d; x++)
                                q2[((i * n + j) * hq + hh) * d + x] = fw_f32_to_bf16((float)row[x]);
                        }
                        for (int64_t hh = 0; hh < hkv; hh++) {
                            for (int64_t x = 0; x < d; x++)
                                row[x] = fw_bf16_to_f32(kn[((i * n + j) * hkv + hh) * d + x]);
                            rotate_ref(row, rd, 0, &t, cached[i] + j);
                            for (int64_t x = 0; x < d; x++)
                                k2[((i * n + j) * hkv + hh) * d + x] = fw_f32_to_bf16((float)row[x]);
                        }
                    }
                double *r2 = malloc((size_t)(b * n * hq * d) * 8);
                fw_tensor tr2 = fw_tensor_contiguous(r2, FW_F64, 3, os);
                fw_attn_params p2 = p;
                p2.rotary_cos = p2.rotary_sin = NULL;
                r = fw_attn_kvcache_ref(&tq2, &tk2, &tvn, cu, b, &c, &tr2, NULL, &p2);
                case_check(r == FW_OK, "unrotated reference: %s", fw_last_error());
                /* q was rounded to bf16 after rotating here: a difference of that order */
                const double e = max_diff(ref, r2, b * n * hq * d);
                case_check(e <= 2e-2, "rotate-then-attend differs from the fused reference by %.3g", e);
                free(q2); free(k2); free(r2);
            }
            /* plain, then each table: all append the same rotated rows, and attend */
            uint16_t *kc0 = malloc((size_t)ncache * 2), *vc0 = malloc((size_t)ncache * 2);
            memcpy(kc0, kc, (size_t)ncache * 2);
            memcpy(vc0, vc, (size_t)ncache * 2);
            p.flags = FW_ATTN_PLAIN;
            r = fw_attn_kvcache_fwd(&tq, &tkn, &tvn, cu, b, &c, &to, NULL, &p);
            case_check(r == FW_OK, "plain: %s", fw_last_error());
            double *x = to64(&to, b * n * hq * d);
            const double ep = max_diff(x, ref, b * n * hq * d);
            free(x);
            uint16_t *kc1 = malloc((size_t)ncache * 2);
            memcpy(kc1, kc, (size_t)ncache * 2);
            /* the appended rows: rotate(k_new) in double, rounded to bf16, within one rounding */
            for (int64_t i = 0; i < b; i++)
                for (int64_t j = 0; j < n; j++) {
                    const int64_t pos = cached[i] + j;
                    const int64_t slot = paged ? bt[i * 4 + pos / 16] * 16 + pos % 16 : i * S + pos;
                    double row[32];
                    for (int64_t hh = 0; hh < hkv; hh++) {
                        for (int64_t xx = 0; xx < d; xx++)
                            row[xx] = fw_bf16_to_f32(kn[((i * n + j) * hkv + hh) * d + xx]);
                        rotate_ref(row, rd, 0, &t, pos);
                        for (int64_t xx = 0; xx < d; xx++) {
                            const double got = fw_bf16_to_f32(kc1[(slot * hkv + hh) * d + xx]);
                            case_check(fabs(got - row[xx]) <= fabs(row[xx]) * 0x1p-8 + 1e-6,
                                       "cache row %lld head %lld [%lld]: %g, rotated %g", (long long)pos,
                                       (long long)hh, (long long)xx, got, row[xx]);
                        }
                    }
                }
            for (int i = 0; i < fw_isa_count(); i++) {
                if (!test_table(fw_isa_name(i)))
                    continue;
                memcpy(kc, kc0, (size_t)ncache * 2);
                memcpy(vc, vc0, (size_t)ncache * 2);
                p.flags = 0;
                p.isa = fw_isa_name(i);
                r = fw_attn_kvcache_fwd(&tq, &tkn, &tvn, cu, b, &c, &to, NULL, &p);
                case_check(r == FW_OK, "[%s] %s", p.isa, fw_last_error());
                case_check(memcmp(kc, kc1, (size_t)ncache * 2) == 0, "[%s] the cache differs from plain's",
                           p.isa);
                x = to64(&to, b * n * hq * d);
                const double e = max_diff(x, ref, b * n * hq * d);
                case_check(e <= 2 * ep + 1e-5, "[%s] error %.3g > 2 x plain %.3g + 1e-5", p.isa, e, ep);
                free(x);
            }
            free(kc0); free(vc0); free(kc1); free(kc); free(vc); free(kn); free(vn); free(qq);
            free(ref); free(out);
            table_free(&t);
            case_end();
        }
}

static void expect(const char *what, fw_status got, fw_status want)
{
    case_begin("rotary bad input: %s", what);
    case_check(got == want, "returned %s, expected %s (%s)", fw_status_string(got), fw_status_string(want),
               fw_last_error());
    case_check(fw_last_error()[0] != 0, "no message");
    case_end();
}

static void test_bad_input(void)
{
    const int64_t qs[4] = {1, 8, 2, 16}, ks[4] = {1, 10, 2, 16};
    float q[256], k[320], v[320], o[256];
    memset(q, 0, sizeof q);
    memset(k, 0, sizeof k);
    memset(v, 0, sizeof v);
    fw_tensor tq = fw_tensor_contiguous(q, FW_F32, 4, qs), tk = fw_tensor_contiguous(k, FW_F32, 4, ks),
              tv = fw_tensor_contiguous(v, FW_F32, 4, ks), to = fw_tensor_contiguous(o, FW_F32, 4, qs);
    rtable t = table_make(10, 16, 8), shortt = table_make(9, 16, 8), wide = table_make(10, 18, 9);
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.rotary_cos = &t.tc;
    expect("rotary_sin NULL", fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p), FW_ERR_NULL);
    p.rotary_sin = &t.ts;
    p.rotary_interleaved = 2;
    expect("rotary_interleaved 2", fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p), FW_ERR_ARG);
    p.rotary_interleaved = 0;
    p.rotary_sin = &shortt.ts;
    expect("cos and sin shapes differ", fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p), FW_ERR_SHAPE);
    p.rotary_cos = &shortt.tc;
    expect("9 positions for 10 keys", fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p), FW_ERR_SHAPE);
    p.rotary_cos = &wide.tc;
    p.rotary_sin = &wide.ts;
    expect("rotary_dim 18 > d 16", fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p), FW_ERR_SHAPE);
    p.rotary_cos = &t.tc;
    p.rotary_sin = &t.ts;
    fw_tensor ti = t.tc;
    ti.dtype = FW_F64;
    p.rotary_cos = &ti;
    expect("f64 table", fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p), FW_ERR_DTYPE);
    p.rotary_cos = &t.tc;
    /* more queries than keys: query positions sk - sq + i would be negative */
    expect("sq > sk", fw_attn_fwd(&tk, &tq, &tq, &to, NULL, &p), FW_ERR_SHAPE);
    /* KV cache without new keys */
    const int64_t cs[4] = {1, 16, 2, 16}, q3[3] = {1, 2, 16};
    float kc[512], vc[512];
    const int32_t len[1] = {4}, cu[2] = {0, 1};
    fw_kv_cache c;
    memset(&c, 0, sizeof c);
    c.k = fw_tensor_contiguous(kc, FW_F32, 4, cs);
    c.v = fw_tensor_contiguous(vc, FW_F32, 4, cs);
    c.seqlens = len;
    fw_tensor tq3 = fw_tensor_contiguous(q, FW_F32, 3, q3), to3 = fw_tensor_contiguous(o, FW_F32, 3, q3);
    expect("KV cache without k_new", fw_attn_kvcache_fwd(&tq3, NULL, NULL, cu, 1, &c, &to3, NULL, &p),
           FW_ERR_ARG);
    p.rotary_q_only = 2;
    expect("rotary_q_only 2", fw_attn_fwd(&tq, &tk, &tv, &to, NULL, &p), FW_ERR_ARG);
    p.rotary_q_only = 1; /* q only: a KV-cache call without new keys is fine */
    memset(kc, 0, sizeof kc);
    memset(vc, 0, sizeof vc);
    case_begin("rotary q only: a KV-cache call without k_new runs");
    case_check(fw_attn_kvcache_fwd(&tq3, NULL, NULL, cu, 1, &c, &to3, NULL, &p) == FW_OK, "%s",
               fw_last_error());
    case_end();
    p.rotary_q_only = 0;
    /* the backward takes none */
    const int64_t ls[3] = {1, 2, 8};
    float l[16], g[3][320];
    fw_tensor tl = fw_tensor_contiguous(l, FW_F32, 3, ls);
    fw_tensor d0 = fw_tensor_contiguous(g[0], FW_F32, 4, qs), d1 = fw_tensor_contiguous(g[1], FW_F32, 4, ks),
              d2 = fw_tensor_contiguous(g[2], FW_F32, 4, ks);
    expect("backward with rotary", fw_attn_bwd(&tq, &tk, &tv, &to, &to, &tl, &d0, &d1, &d2, &p), FW_ERR_ARG);
    table_free(&t);
    table_free(&shortt);
    table_free(&wide);
}

const test_suite rotary_suites[] = {
    {"rotary.dense", test_dense},
    {"rotary.convention", test_convention},
    {"rotary.kvcache", test_kvcache},
    {"rotary.bad_input", test_bad_input},
    {NULL, NULL}};
