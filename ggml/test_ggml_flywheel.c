/*
 * flywheel's ggml backend against ggml's CPU backend and a float64 reference, on the flash
 * attention that llama.cpp builds: causal masks over a KV cache with unused cells, sliding
 * windows, decode rows, several streams, padded mask rows, sinks, softcap, GQA, f32 / f16 / bf16
 * caches as views with the cache's strides; and the masks flywheel hands back to ggml's CPU
 * kernel (an additive bias, two sequences interleaved in one cache, a row that sees no key).
 *
 *   test_ggml_flywheel PATH/libggml-flywheel.so           the tests (exit status 1 on a failure)
 *   test_ggml_flywheel PATH/libggml-flywheel.so --bench [THREADS [f16|bf16]]
 *                                        llama.cpp's shapes timed on both backends
 *
 * Each case checks that the backend took the path it should (flywheel or ggml's CPU kernel, by
 * its node counters), that the output is within test-backend-ops' bar of the CPU backend's
 * (normalised mean squared error 5e-4), within twice the CPU backend's own error of the
 * float64 reference plus 1e-5 (the CPU kernel accumulates f16 values in f16, flywheel in f32;
 * for bf16 caches, twice the larger of that and the error of bf16 products' roundings),
 * bit-identical with 1 and 2 threads, and, where the CPU kernel ran it, bit-identical to it.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"

enum mask_kind { M_NONE, M_CAUSAL, M_FULL, M_BIAS, M_TWO_SEQS, M_EMPTY_ROW };

typedef struct {
    const char *name;
    int d, dv, hq, hkv, n, n_kv, ns;
    enum mask_kind mask;
    int ctx;    /* cells in use (the rest are masked, as llama.cpp pads n_kv) */
    int window; /* left window of a causal mask, -1 none */
    int sinks;
    float softcap;
    enum ggml_type kv;
    int served; /* 1: flywheel must run it; 0: ggml's CPU kernel must */
} fa_case;

typedef void (*counts_fn)(ggml_backend_t, uint64_t *, uint64_t *);
typedef void (*threads_fn)(ggml_backend_t, int);

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float frand(void) /* uniform in [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 40) * (2.0 / 16777216.0) - 1.0);
}

static double load(const struct ggml_tensor *t, const char *p)
{
    switch (t->type) {
    case GGML_TYPE_F32: return *(const float *)p;
    case GGML_TYPE_F16: return ggml_fp16_to_fp32(*(const ggml_fp16_t *)p);
    case GGML_TYPE_BF16: return ggml_bf16_to_fp32(*(const ggml_bf16_t *)p);
    default: return NAN;
    }
}

static void store(const struct ggml_tensor *t, char *p, float x)
{
    switch (t->type) {
    case GGML_TYPE_F32: *(float *)p = x; break;
    case GGML_TYPE_F16: *(ggml_fp16_t *)p = ggml_fp32_to_fp16(x); break;
    case GGML_TYPE_BF16: *(ggml_bf16_t *)p = ggml_fp32_to_bf16(x); break;
    default: break;
    }
}

/* Every element of a 4-d view, by its strides, set to scale x uniform. */
static void fill(struct ggml_tensor *t, float scale)
{
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++)
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++)
                for (int64_t i0 = 0; i0 < t->ne[0]; i0++)
                    store(t, (char *)t->data + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] +
                                 i3 * t->nb[3], scale * frand());
}

/* llama.cpp's mask for case c: rows [n_kv, rows, 1, ns], stream s's context ctx - 5 s. */
static void fill_mask(const fa_case *c, struct ggml_tensor *m)
{
    for (int64_t s = 0; s < m->ne[3]; s++)
        for (int64_t r = 0; r < m->ne[1]; r++) {
            ggml_fp16_t *row = (ggml_fp16_t *)((char *)m->data + r * m->nb[1] + s * m->nb[3]);
            const int ctx = c->ctx - 5 * (int)s, pos = ctx - c->n + (int)r;
            for (int j = 0; j < c->n_kv; j++) {
                int see = 0;
                float bias = 0.0f;
                switch (c->mask) {
                case M_CAUSAL:
                    see = j <= pos && (c->window < 0 || j >= pos - c->window);
                    break;
                case M_FULL:
                    see = j >= 3 && j < ctx; /* a context that starts past cell 0 */
                    break;
                case M_BIAS:
                    see = j <= pos;
                    bias = 0.5f * frand();
                    break;
                case M_TWO_SEQS: /* even cells belong to the even rows' sequence */
                    see = j <= pos && (j & 1) == (r & 1);
                    break;
                case M_EMPTY_ROW:
                    see = j <= pos && r != 1;
                    break;
                case M_NONE:
                    break;
                }
                if (r >= c->n) /* padding rows: never read */
                    see = (j * 7 + (int)r) % 3 == 0;
                row[j] = ggml_fp32_to_fp16(see ? bias : -INFINITY);
            }
        }
}

static double bf16_round(double x)
{
    return ggml_bf16_to_fp32(ggml_fp32_to_bf16((float)x));
}

/* The float64 reference of one node (ggml's definition, the mask read as given). With bf16,
 * the roundings of bf16 products and nothing else: q rounded to bf16 and each probability
 * rounded to bf16 before it multiplies V (the denominator sums them unrounded). */
static void reference(const struct ggml_tensor *q, const struct ggml_tensor *k,
                      const struct ggml_tensor *v, const struct ggml_tensor *m,
                      const struct ggml_tensor *sinks, float scale, float softcap, int bf16,
                      double *out)
{
    const int64_t d = q->ne[0], dv = v->ne[0], n = q->ne[1], hq = q->ne[2], ns = q->ne[3];
    const int64_t n_kv = k->ne[1], g = hq / k->ne[2];
    double *s = malloc(n_kv * sizeof(double));
    for (int64_t i3 = 0; i3 < ns; i3++)
        for (int64_t h = 0; h < hq; h++)
            for (int64_t r = 0; r < n; r++) {
                double mx = -INFINITY;
                for (int64_t j = 0; j < n_kv; j++) {
                    double mv = 0;
                    if (m)
                        mv = ggml_fp16_to_fp32(*(const ggml_fp16_t *)((const char *)m->data +
                                                                      j * m->nb[0] + r * m->nb[1] +
                                                                      (i3 % m->ne[3]) * m->nb[3]));
                    if (mv == -INFINITY) {
                        s[j] = -INFINITY;
                        continue;
                    }
                    double dot = 0;
                    for (int64_t i = 0; i < d; i++) {
                        double qi = load(q, (const char *)q->data + i * q->nb[0] + r * q->nb[1] +
                                                h * q->nb[2] + i3 * q->nb[3]);
                        dot += (bf16 ? bf16_round(qi) : qi) *
                               load(k, (const char *)k->data + i * k->nb[0] + j * k->nb[1] +
                                           (h / g) * k->nb[2] + i3 * k->nb[3]);
                    }
                    dot *= scale;
                    if (softcap > 0)
                        dot = softcap * tanh(dot / softcap);
                    s[j] = dot + mv;
                    mx = s[j] > mx ? s[j] : mx;
                }
                double sk = sinks ? ((const float *)sinks->data)[h] : -INFINITY;
                if (sinks && sk > mx)
                    mx = sk;
                double den = sinks ? exp(sk - mx) : 0;
                double *o = out + ((i3 * n + r) * hq + h) * dv;
                for (int64_t i = 0; i < dv; i++)
                    o[i] = 0;
                if (mx == -INFINITY)
                    continue;
                for (int64_t j = 0; j < n_kv; j++) {
                    if (s[j] == -INFINITY)
                        continue;
                    const double p = exp(s[j] - mx), pv = bf16 ? bf16_round(p) : p;
                    den += p;
                    for (int64_t i = 0; i < dv; i++)
                        o[i] += pv * load(v, (const char *)v->data + i * v->nb[0] + j * v->nb[1] +
                                                (h / g) * v->nb[2] + i3 * v->nb[3]);
                }
                for (int64_t i = 0; i < dv; i++)
                    o[i] = den > 0 ? o[i] / den : 0;
            }
    free(s);
}

typedef struct {
    struct ggml_context *ctx;
    ggml_backend_buffer_t buf;
    struct ggml_cgraph *graph;
    struct ggml_tensor *q, *k, *v, *m, *sinks, *out;
} fa_graph;

/* The node as llama.cpp builds it: K and V views of caches of n_kv + 16 cells with all heads
 * of a cell together, q a permuted view of [d, hq, n] rows, the mask padded to 16 rows. */
static int build(const fa_case *c, fa_graph *g)
{
    const size_t mem = 16 * ggml_tensor_overhead() + ggml_graph_overhead();
    struct ggml_init_params ip = {mem, NULL, true};
    g->ctx = ggml_init(ip);
    struct ggml_context *x = g->ctx;
    const int cells = c->n_kv + 16;
    struct ggml_tensor *kc = ggml_new_tensor_3d(x, c->kv, c->d * c->hkv, cells, c->ns);
    struct ggml_tensor *vc = ggml_new_tensor_3d(x, c->kv, c->dv * c->hkv, cells, c->ns);
    struct ggml_tensor *q0 = ggml_new_tensor_4d(x, GGML_TYPE_F32, c->d, c->hq, c->n, c->ns);
    g->k = ggml_view_4d(x, kc, c->d, c->hkv, c->n_kv, c->ns, kc->nb[0] * c->d, kc->nb[1],
                        kc->nb[2], 0);
    g->k = ggml_permute(x, g->k, 0, 2, 1, 3);
    g->v = ggml_view_4d(x, vc, c->dv, c->hkv, c->n_kv, c->ns, vc->nb[0] * c->dv, vc->nb[1],
                        vc->nb[2], 0);
    g->v = ggml_permute(x, g->v, 0, 2, 1, 3);
    g->q = ggml_permute(x, q0, 0, 2, 1, 3);
    g->m = c->mask == M_NONE ? NULL
                             : ggml_new_tensor_4d(x, GGML_TYPE_F16, c->n_kv, GGML_PAD(c->n, 16),
                                                  1, c->ns);
    g->sinks = c->sinks ? ggml_new_tensor_1d(x, GGML_TYPE_F32, c->hq) : NULL;
    g->out = ggml_flash_attn_ext(x, g->q, g->k, g->v, g->m, 1.0f / sqrtf((float)c->d), 0.0f,
                                 c->softcap);
    ggml_flash_attn_ext_add_sinks(g->out, g->sinks);
    ggml_prec_set_acc(g->out, GGML_PREC_F32);
    g->graph = ggml_new_graph(x);
    ggml_build_forward_expand(g->graph, g->out);
    g->buf = ggml_backend_alloc_ctx_tensors_from_buft(x, ggml_backend_cpu_buffer_type());
    if (!g->buf)
        return 0;
    fill(kc, 1.0f);
    fill(vc, 1.0f);
    fill(q0, 2.0f);
    if (g->m)
        fill_mask(c, g->m);
    if (g->sinks)
        fill(g->sinks, 3.0f);
    return 1;
}

static void release(fa_graph *g)
{
    ggml_backend_buffer_free(g->buf);
    ggml_free(g->ctx);
}

static int run_case(const fa_case *c, ggml_backend_t cpu, ggml_backend_t fw, counts_fn counts,
                    threads_fn set_threads)
{
    fa_graph g;
    if (!build(c, &g)) {
        printf("FAIL %s: no buffer\n", c->name);
        return 0;
    }
    const size_t n_out = (size_t)ggml_nelements(g.out), bytes = n_out * sizeof(float);
    float *ref = malloc(bytes), *got = malloc(bytes), *got1 = malloc(bytes);
    double *f64 = malloc(n_out * sizeof(double)), *sr = malloc(n_out * sizeof(double));
    int ok = 1;
    ggml_backend_graph_compute(cpu, g.graph);
    memcpy(ref, g.out->data, bytes);
    uint64_t s0 = 0, f0 = 0, s1 = 0, f1 = 0;
    counts(fw, &s0, &f0);
    float *runs[2] = {got, got1}; /* on 2 threads, then 1 */
    for (int t = 0; t < 2; t++) {
        set_threads(fw, 2 - t);
        memset(g.out->data, 0xff, bytes);
        if (ggml_backend_graph_compute(fw, g.graph) != GGML_STATUS_SUCCESS)
            ok = 0;
        memcpy(runs[t], g.out->data, bytes);
    }
    counts(fw, &s1, &f1);
    const int served = s1 - s0 == 2 && f1 == f0, fell_back = f1 - f0 == 2 && s1 == s0;
    if (c->served ? !served : !fell_back) {
        printf("FAIL %s: expected %s, served %llu, handed back %llu\n", c->name,
               c->served ? "flywheel" : "ggml's CPU kernel", (unsigned long long)(s1 - s0),
               (unsigned long long)(f1 - f0));
        ok = 0;
    }
    if (memcmp(got, got1, bytes) != 0) {
        printf("FAIL %s: 1 and 2 threads differ\n", c->name);
        ok = 0;
    }
    if (!c->served && memcmp(got, ref, bytes) != 0) {
        printf("FAIL %s: ggml's CPU kernel ran it, yet the bits differ\n", c->name);
        ok = 0;
    }
    const float scale = 1.0f / sqrtf((float)c->d);
    const int bf16 = c->kv == GGML_TYPE_BF16;
    reference(g.q, g.k, g.v, g.m, g.sinks, scale, c->softcap, 0, f64);
    if (bf16)
        reference(g.q, g.k, g.v, g.m, g.sinks, scale, c->softcap, 1, sr);
    double num = 0, den = 0, err_fw = 0, err_cpu = 0, err_sr = 0;
    for (size_t i = 0; i < n_out; i++) {
        num += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
        den += (double)ref[i] * ref[i];
        const double e1 = fabs(got[i] - f64[i]), e2 = fabs(ref[i] - f64[i]);
        const double e3 = bf16 ? fabs((double)(float)sr[i] - f64[i]) : 0;
        err_fw = e1 > err_fw || e1 != e1 ? e1 : err_fw;
        err_cpu = e2 > err_cpu ? e2 : err_cpu;
        err_sr = e3 > err_sr ? e3 : err_sr;
    }
    /* the bar: twice the error of the CPU backend, or of an implementation with bf16
     * products' roundings where the cache is bf16 (the backend's choice on CPUs with a
     * native bf16 dot product), whichever is larger */
    const double bar = 2 * (err_cpu > err_sr ? err_cpu : err_sr) + 1e-5;
    const double nmse = den > 0 ? num / den : num;
    if (!(nmse <= 5e-4) || !(err_fw <= bar)) {
        printf("FAIL %s: nmse %.3g against the CPU backend, max error %.3g against float64 "
               "(bar %.3g)\n", c->name, nmse, err_fw, bar);
        ok = 0;
    }
    if (ok)
        printf("ok   %-34s %s  nmse %.2e  err %.2e (bar %.2e)\n", c->name,
               c->served ? "flywheel" : "cpu     ", nmse, err_fw, bar);
    free(ref);
    free(got);
    free(got1);
    free(f64);
    free(sr);
    release(&g);
    return ok;
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* Median seconds of reps computes of the graph on backend b. */
static double timed(ggml_backend_t b, struct ggml_cgraph *graph, int reps)
{
    double t[16];
    for (int i = 0; i < reps; i++) {
        const double t0 = now();
        ggml_backend_graph_compute(b, graph);
        t[i] = now() - t0;
    }
    for (int i = 1; i < reps; i++)
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            const double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    return t[reps / 2];
}

/* llama.cpp's attention nodes of a Llama-style GQA 32:8 d 128 layer, f16 cache: a 512-token
 * ubatch of a prompt at several depths, and one decode row at 16K. */
static void bench(ggml_backend_t cpu, ggml_backend_t fw, threads_fn set_threads, int threads,
                  enum ggml_type kv)
{
    static const struct { int n, ctx; } shapes[] = {
        {512, 512}, {512, 2048}, {512, 4096}, {1, 4096}, {1, 16384}};
    ggml_backend_dev_t cpu_dev = ggml_backend_get_device(cpu);
    threads_fn cpu_threads = (threads_fn)ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(cpu_dev), "ggml_backend_set_n_threads");
    if (cpu_threads)
        cpu_threads(cpu, threads);
    set_threads(fw, threads);
    printf("FLASH_ATTN_EXT, hq 32, hkv 8, d 128, %s cache, causal mask, %d threads; "
           "FLOP = 4 d hq (visible keys summed over rows); medians of 5\n", ggml_type_name(kv),
           threads);
    printf("%6s %7s %12s %12s %8s\n", "rows", "context", "cpu GFLOP/s", "fw GFLOP/s", "fw/cpu");
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        fa_case c = {"bench", 128, 128, 32, 8, shapes[i].n, GGML_PAD(shapes[i].ctx, 256), 1,
                     M_CAUSAL, shapes[i].ctx, -1, 0, 0.0f, kv, 1};
        fa_graph g;
        if (!build(&c, &g))
            return;
        double keys = 0;
        for (int r = 0; r < c.n; r++)
            keys += c.ctx - c.n + r + 1;
        const double flop = 4.0 * c.d * c.hq * keys;
        timed(cpu, g.graph, 1);
        timed(fw, g.graph, 1);
        const double tc = timed(cpu, g.graph, 5), tf = timed(fw, g.graph, 5);
        printf("%6d %7d %12.1f %12.1f %7.2fx\n", c.n, c.ctx, flop / tc * 1e-9, flop / tf * 1e-9,
               tc / tf);
        release(&g);
    }
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH/libggml-flywheel.so [--bench [THREADS]]\n", argv[0]);
        return 2;
    }
    ggml_backend_reg_t reg = ggml_backend_load(argv[1]);
    if (!reg) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 2;
    }
    if (!ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)) /* a GGML_BACKEND_DL build */
        ggml_backend_load_all_from_path(FWG_GGML_LIBDIR);
    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
    ggml_backend_t fw = ggml_backend_dev_init(ggml_backend_reg_dev_get(reg, 0), NULL);
    counts_fn counts = (counts_fn)ggml_backend_reg_get_proc_address(reg, "ggml_backend_flywheel_counts");
    threads_fn set_threads = (threads_fn)ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (!cpu || !fw || !counts || !set_threads) {
        fprintf(stderr, "the CPU backend or the flywheel backend could not start\n");
        return 2;
    }
    if (argc > 2 && strcmp(argv[2], "--bench") == 0) {
        bench(cpu, fw, set_threads, argc > 3 ? atoi(argv[3]) : 2,
              argc > 4 && strcmp(argv[4], "bf16") == 0 ? GGML_TYPE_BF16 : GGML_TYPE_F16);
        return 0;
    }
    const fa_case cases[] = {
        /* name                               d   dv  hq hkv  n  n_kv ns mask     ctx win sk cap kv served */
        {"prefill causal f16",               64,  64,  8, 2, 37, 256, 1, M_CAUSAL, 200, -1, 0, 0, GGML_TYPE_F16, 1},
        {"prefill causal bf16 sinks",       128, 128,  8, 2, 64, 256, 1, M_CAUSAL, 180, -1, 1, 0, GGML_TYPE_BF16, 1},
        {"prefill causal f32 softcap",       80,  80,  6, 3, 20, 128, 1, M_CAUSAL, 100, -1, 0, 30, GGML_TYPE_F32, 1},
        {"prefill sliding window",           64,  64,  4, 4, 50, 256, 1, M_CAUSAL, 230, 32, 1, 0, GGML_TYPE_F16, 1},
        {"prefill d 192, dv 128",           192, 128,  4, 1, 17, 128, 1, M_CAUSAL,  90, -1, 0, 0, GGML_TYPE_F16, 1},
        {"first ubatch (rows = context)",   128, 128,  4, 1, 40, 256, 1, M_CAUSAL,  40, -1, 0, 0, GGML_TYPE_F16, 1},
        {"decode",                          128, 128, 32, 8,  1, 512, 1, M_CAUSAL, 301, -1, 0, 0, GGML_TYPE_F16, 1},
        {"decode window sinks",              64,  64,  8, 1,  1, 512, 1, M_CAUSAL, 400, 128, 1, 0, GGML_TYPE_BF16, 1},
        {"MLA decode 576/512",              576, 512, 16, 1,  1, 256, 1, M_CAUSAL, 129, -1, 0, 0, GGML_TYPE_F16, 1},
        {"three streams",                    64,  64,  4, 2, 12, 128, 3, M_CAUSAL, 100, -1, 0, 0, GGML_TYPE_F16, 1},
        {"a context past cell 0",            64,  64,  4, 2,  9, 128, 1, M_FULL,   70, -1, 1, 0, GGML_TYPE_F16, 1},
        {"no mask",                          40,  40,  2, 1, 33,  97, 2, M_NONE,   97, -1, 0, 0, GGML_TYPE_F32, 1},
        {"additive bias (CPU)",              64,  64,  4, 2, 16, 128, 1, M_BIAS,  100, -1, 0, 0, GGML_TYPE_F16, 0},
        {"two sequences interleaved (CPU)",  64,  64,  4, 2, 16, 128, 1, M_TWO_SEQS, 100, -1, 0, 0, GGML_TYPE_F16, 0},
        {"a row that sees no key (CPU)",     64,  64,  4, 2, 16, 128, 1, M_EMPTY_ROW, 100, -1, 1, 0, GGML_TYPE_F16, 0},
    };
    int failed = 0, n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++)
        failed += !run_case(&cases[i], cpu, fw, counts, set_threads);
    printf("%d of %d cases passed\n", n - failed, n);
    ggml_backend_free(fw);
    ggml_backend_free(cpu);
    return failed ? 1 : 0;
}
