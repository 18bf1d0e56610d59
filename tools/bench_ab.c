/*
 * bench_ab.c: `flywheel ab A.so B.so attn|decode|gdn|gdn-decode [options]`, two builds of the library timed
 * in one process.
 *
 * A shared VM's speed drifts by 10-50% between runs of one command, more than most kernel
 * changes gain, so two builds timed one after the other compare the machine's moods as much
 * as the builds. Here both libraries are loaded (dlopen, each with its own symbols) and take
 * turns on the same inputs: rounds of --calls calls, A then B, then B then A, ... (the first
 * call of each turn untimed). Reported: each build's median time per call with its 10th and
 * 90th percentiles, the ratio of the medians B / A and the range of the per-round ratios, and
 * whether the two builds' outputs have the same bits.
 *
 * Both builds must have the ABI number of the header this CLI was built with (the calls pass
 * its structs). One library given twice is an A/A run: the noise floor of the ratio.
 *
 *   attn    fw_attn_fwd, a causal prefill of --batch sequences of --t tokens (dense layout):
 *           --batch --t --hq --hkv --d --dtype; --bwd: fw_attn_bwd on the forward's out and lse
 *           (computed once by A) and a random dO, comparing dq, dk and dv
 *   decode  fw_attn_kvcache_fwd, one query token per sequence on a paged cache (no append):
 *           --batch --ctx --hq --hkv --d --page --dtype; --caches N rotates N caches of the
 *           same shape (N = 1: the cache stays hot; caches past the L3 in all: read from memory);
 *           --tiles: the cache in FW_KV_TILES (vLLM's AMX layout; bf16, page and d multiples of 32);
 *           --cols: in vLLM's vec layout (each page's keys of a head transposed)
 *   gdn     fw_gdn_prefill of one sequence, q/k l2-normalised in the kernel, beta 0.5:
 *           --t --h --hv --d --dtype; --kda: a decay per key channel
 *   gdn-decode  fw_gdn_decode of --n sequences (one token each) on f32 states updated in
 *           place: --n --h --hv --d --dtype; --caches N rotates N sets of state slots (each
 *           build has its own states, so both see the same values call by call)
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "commands.h"

typedef struct {
    const char *path;
    int (*abi)(void);
    const char *(*last_error)(void);
    void (*attn_init)(fw_attn_params *);
    fw_status (*fwd)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                     const fw_attn_params *);
    fw_status (*bwd)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                     const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                     const fw_attn_params *);
    fw_status (*kvcache)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const int32_t *, int64_t,
                         const fw_kv_cache *, const fw_tensor *, const fw_tensor *, const fw_attn_params *);
    void (*gdn_init)(fw_gdn_params *);
    fw_status (*gdn_prefill)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                             const fw_tensor *, const int32_t *, int64_t, const float *, float *,
                             const fw_tensor *, const fw_gdn_params *);
    fw_status (*gdn_decode)(const fw_tensor *, const fw_tensor *, const fw_tensor *, const fw_tensor *,
                            const fw_tensor *, float *, int64_t, const int32_t *, const fw_tensor *,
                            const fw_gdn_params *);
} lib;

typedef struct {
    int prefill, bwd, gdn, gdec, kda, tiles, cols, threads, rounds, calls, caches;
    int64_t batch, ctx, hq, hkv, d, page, T, H, HV, N;
    fw_dtype dt;
} acfg;

/* The inputs both builds take (decode: every cache's block table, caches in turn). */
typedef struct {
    const acfg *c;
    fw_tensor q, k, v, g, beta;
    fw_tensor o, dout, lse;   /* attn --bwd: the forward's out and lse, and dO */
    fw_kv_cache cache;
    int32_t *bt, *cuq, cu[2]; /* decode: block tables of every cache, cu_seqlens_q */
    float *state[2];          /* gdn-decode: each build's state slots [N x caches][HV, d, d] */
    int32_t *slot;            /* gdn-decode: slot i for sequence i % N of set i / N */
    size_t out_bytes;
} ainput;

static int load(lib *l, const char *path)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "flywheel: ab: cannot load %s: %s\n", path, dlerror());
        return 0;
    }
    l->path = path;
    *(void **)&l->abi = dlsym(h, "fw_abi_version");
    *(void **)&l->last_error = dlsym(h, "fw_last_error");
    *(void **)&l->attn_init = dlsym(h, "fw_attn_params_init");
    *(void **)&l->kvcache = dlsym(h, "fw_attn_kvcache_fwd");
    *(void **)&l->fwd = dlsym(h, "fw_attn_fwd");
    *(void **)&l->bwd = dlsym(h, "fw_attn_bwd");
    *(void **)&l->gdn_init = dlsym(h, "fw_gdn_params_init");
    *(void **)&l->gdn_prefill = dlsym(h, "fw_gdn_prefill");
    *(void **)&l->gdn_decode = dlsym(h, "fw_gdn_decode");
    if (!l->abi || !l->last_error || !l->attn_init || !l->kvcache || !l->fwd || !l->bwd || !l->gdn_init ||
        !l->gdn_prefill || !l->gdn_decode) {
        fprintf(stderr, "flywheel: ab: %s is not a libflywheel (a symbol is missing)\n", path);
        return 0;
    }
    if (l->abi() != FW_ABI_VERSION) {
        fprintf(stderr, "flywheel: ab: %s has ABI %d, this CLI passes the structs of ABI %d: build both with one header\n",
                path, l->abi(), FW_ABI_VERSION);
        return 0;
    }
    return 1;
}

/* attn: the prefill's forward into out, or with --bwd its backward into out (dq, dk, dv one
 * after the other). */
static fw_status call_prefill(const lib *l, const ainput *in, void *out)
{
    const acfg *c = in->c;
    fw_attn_params ap;
    l->attn_init(&ap);
    ap.causal = 1;
    ap.threads = c->threads;
    const int64_t qs[4] = {c->batch, c->T, c->hq, c->d}, ks[4] = {c->batch, c->T, c->hkv, c->d};
    const fw_tensor o = fw_tensor_contiguous(out, c->dt, 4, qs);
    if (!c->bwd)
        return l->fwd(&in->q, &in->k, &in->v, &o, NULL, &ap);
    const size_t es = fw_dtype_size(c->dt), nq = (size_t)(c->batch * c->T * c->hq * c->d);
    const size_t nk = (size_t)(c->batch * c->T * c->hkv * c->d);
    char *dk = (char *)out + nq * es, *dv = dk + nk * es;
    const fw_tensor tk = fw_tensor_contiguous(dk, c->dt, 4, ks), tv = fw_tensor_contiguous(dv, c->dt, 4, ks);
    return l->bwd(&in->q, &in->k, &in->v, &in->o, &in->dout, &in->lse, &o, &tk, &tv, &ap);
}

/* One call of the op on build l (number b) into `out`; decode: call number n reads cache
 * n % caches; gdn-decode: build b's state slot set n % caches. */
static fw_status call(const lib *l, int b, const ainput *in, int n, void *out)
{
    const acfg *c = in->c;
    if (c->prefill)
        return call_prefill(l, in, out);
    fw_gdn_params p;
    if (c->gdn || c->gdec) {
        l->gdn_init(&p);
        p.l2norm_qk = 1;
        p.threads = c->threads;
    }
    if (c->gdec) {
        const int64_t os[3] = {c->N, c->HV, c->d};
        const fw_tensor o = fw_tensor_contiguous(out, c->dt, 3, os);
        return l->gdn_decode(&in->q, &in->k, &in->v, &in->g, &in->beta, in->state[b], c->N * c->caches,
                             in->slot + (size_t)(n % c->caches) * (size_t)c->N, &o, &p);
    }
    if (c->gdn) {
        const int64_t os[3] = {c->T, c->HV, c->d};
        const fw_tensor o = fw_tensor_contiguous(out, c->dt, 3, os);
        return l->gdn_prefill(&in->q, &in->k, &in->v, &in->g, &in->beta, in->cu, 1, NULL, NULL, &o, &p);
    }
    const int64_t os[3] = {c->batch, c->hq, c->d};
    const fw_tensor o = fw_tensor_contiguous(out, c->dt, 3, os);
    fw_kv_cache kc = in->cache;
    kc.block_table = in->bt + (size_t)(n % c->caches) * (size_t)(c->batch * kc.max_pages);
    fw_attn_params ap;
    l->attn_init(&ap);
    ap.causal = 1;
    ap.threads = c->threads;
    return l->kvcache(&in->q, NULL, NULL, in->cuq, c->batch, &kc, &o, NULL, &ap);
}

static int setup(const acfg *c, ainput *in, void **mem, int nmem)
{
    const size_t es = fw_dtype_size(c->dt);
    memset(in, 0, sizeof *in);
    in->c = c;
    for (int i = 0; i < nmem; i++)
        mem[i] = NULL;
    if (c->prefill) {
        if ((double)c->batch * (double)c->T * (double)c->hq * (double)c->d * (double)es > 0x1p40)
            return 0;
        const int64_t qs[4] = {c->batch, c->T, c->hq, c->d}, ks[4] = {c->batch, c->T, c->hkv, c->d};
        const int64_t ls[3] = {c->batch, c->hq, c->T};
        const size_t nq = (size_t)(c->batch * c->T * c->hq * c->d), nk = (size_t)(c->batch * c->T * c->hkv * c->d);
        mem[0] = bench_alloc(nq * es);
        mem[1] = bench_alloc(nk * es);
        mem[2] = bench_alloc(nk * es);
        mem[3] = c->bwd ? bench_alloc(nq * es) : NULL;
        mem[4] = c->bwd ? bench_alloc(nq * es) : NULL;
        mem[5] = c->bwd ? malloc((size_t)(c->batch * c->hq * c->T) * sizeof(float)) : NULL;
        if (!mem[0] || !mem[1] || !mem[2] || (c->bwd && (!mem[3] || !mem[4] || !mem[5])))
            return 0;
        bench_fill(mem[0], nq, c->dt, 1.0, 1);
        bench_fill(mem[1], nk, c->dt, 1.0, 2);
        bench_fill(mem[2], nk, c->dt, 1.0, 3);
        in->q = fw_tensor_contiguous(mem[0], c->dt, 4, qs);
        in->k = fw_tensor_contiguous(mem[1], c->dt, 4, ks);
        in->v = fw_tensor_contiguous(mem[2], c->dt, 4, ks);
        if (c->bwd) {
            bench_fill(mem[4], nq, c->dt, 1.0, 4);
            in->o = fw_tensor_contiguous(mem[3], c->dt, 4, qs);
            in->dout = fw_tensor_contiguous(mem[4], c->dt, 4, qs);
            in->lse = fw_tensor_contiguous(mem[5], FW_F32, 3, ls);
        }
        in->out_bytes = (c->bwd ? nq + 2 * nk : nq) * es;
        return 1;
    }
    if (c->gdec) {
        const double sb = (double)(c->N * c->caches) * (double)c->HV * (double)c->d * (double)c->d * 4.0;
        if (sb > 0x1p40)
            return 0;
        const int64_t qs[3] = {c->N, c->H, c->d}, vs[3] = {c->N, c->HV, c->d}, bs[2] = {c->N, c->HV};
        const size_t nq = (size_t)(c->N * c->H * c->d), nv = (size_t)(c->N * c->HV * c->d), nb = (size_t)(c->N * c->HV);
        mem[0] = malloc(nq * es);
        mem[1] = malloc(nq * es);
        mem[2] = malloc(nv * es);
        mem[3] = malloc(2 * nb * sizeof(float));
        mem[4] = bench_alloc((size_t)sb);
        mem[5] = bench_alloc((size_t)sb);
        in->slot = malloc((size_t)(c->N * c->caches) * sizeof(int32_t));
        if (!mem[0] || !mem[1] || !mem[2] || !mem[3] || !mem[4] || !mem[5] || !in->slot)
            return 0;
        bench_fill(mem[0], nq, c->dt, 1.0, 1);
        bench_fill(mem[1], nq, c->dt, 1.0, 2);
        bench_fill(mem[2], nv, c->dt, 1.0, 3);
        float *g = mem[3], *b = g + nb;
        for (size_t i = 0; i < nb; i++) {
            g[i] = -0.01f * (float)(1 + i % 5); /* log decays */
            b[i] = 0.5f;
        }
        bench_fill(mem[4], (size_t)(sb / 4), FW_F32, 0.1, 4);
        memcpy(mem[5], mem[4], (size_t)sb);
        in->state[0] = mem[4];
        in->state[1] = mem[5];
        const int64_t ns = c->N * c->caches, step = ns % 7919 ? 7919 : 1; /* distinct slots */
        for (int64_t i = 0; i < ns; i++) /* sets scattered over the slots */
            in->slot[i] = (int32_t)((i * step) % ns);
        in->q = fw_tensor_contiguous(mem[0], c->dt, 3, qs);
        in->k = fw_tensor_contiguous(mem[1], c->dt, 3, qs);
        in->v = fw_tensor_contiguous(mem[2], c->dt, 3, vs);
        in->g = fw_tensor_contiguous(g, FW_F32, 2, bs);
        in->beta = fw_tensor_contiguous(b, FW_F32, 2, bs);
        in->out_bytes = nv * es;
        return 1;
    }
    if (c->gdn) {
        if ((double)c->T * (double)(c->H > c->HV ? c->H : c->HV) * (double)c->d * 4.0 > 0x1p46)
            return 0;
        const int64_t qs[3] = {c->T, c->H, c->d}, vs[3] = {c->T, c->HV, c->d}, bs[2] = {c->T, c->HV};
        const size_t nq = (size_t)(c->T * c->H * c->d), nv = (size_t)(c->T * c->HV * c->d);
        const size_t ng = c->kda ? nv : (size_t)(c->T * c->HV);
        mem[0] = bench_alloc(nq * es);
        mem[1] = bench_alloc(nq * es);
        mem[2] = bench_alloc(nv * es);
        mem[3] = bench_alloc(ng * sizeof(float));
        mem[4] = malloc((size_t)(c->T * c->HV) * sizeof(float));
        if (!mem[0] || !mem[1] || !mem[2] || !mem[3] || !mem[4])
            return 0;
        bench_fill(mem[0], nq, c->dt, 1.0, 1);
        bench_fill(mem[1], nq, c->dt, 1.0, 2);
        bench_fill(mem[2], nv, c->dt, 1.0, 3);
        bench_fill(mem[3], ng, FW_F32, 0.05, 4);
        float *g = mem[3], *b = mem[4];
        for (size_t i = 0; i < ng; i++)
            g[i] = -fabsf(g[i]); /* log decays in (-0.05, 0] */
        for (int64_t i = 0; i < c->T * c->HV; i++)
            b[i] = 0.5f;
        in->q = fw_tensor_contiguous(mem[0], c->dt, 3, qs);
        in->k = fw_tensor_contiguous(mem[1], c->dt, 3, qs);
        in->v = fw_tensor_contiguous(mem[2], c->dt, 3, vs);
        in->g = c->kda ? fw_tensor_contiguous(mem[3], FW_F32, 3, vs) : fw_tensor_contiguous(mem[3], FW_F32, 2, bs);
        in->beta = fw_tensor_contiguous(mem[4], FW_F32, 2, bs);
        in->cu[0] = 0;
        in->cu[1] = (int32_t)c->T;
        in->out_bytes = nv * es;
        return 1;
    }
    const int64_t per = (c->ctx + c->page - 1) / c->page;
    if ((double)per * (double)c->page * (double)(c->batch * c->caches) * (double)(c->hkv * c->d) * (double)es >
            0x1p46 ||
        (double)per * (double)(c->batch * c->caches) > 2147483647.0)
        return 0; /* past any machine's memory, or past int32 page indices */
    const int64_t pages = per * c->batch * c->caches;
    const int64_t ks[4] = {pages, c->page, c->hkv, c->d}, qs[3] = {c->batch, c->hq, c->d};
    const size_t nk = (size_t)(pages * c->page * c->hkv * c->d), nq = (size_t)(c->batch * c->hq * c->d);
    mem[0] = bench_alloc(nk * es);
    mem[1] = bench_alloc(nk * es);
    mem[2] = malloc(nq * es);
    mem[3] = malloc(sizeof(int32_t) * (size_t)pages);
    mem[4] = malloc(sizeof(int32_t) * (size_t)c->batch);
    mem[5] = malloc(sizeof(int32_t) * (size_t)(c->batch + 1));
    if (!mem[0] || !mem[1] || !mem[2] || !mem[3] || !mem[4] || !mem[5])
        return 0;
    bench_fill(mem[0], nk, c->dt, 1.0, 1);
    bench_fill(mem[1], nk, c->dt, 1.0, 2);
    bench_fill(mem[2], nq, c->dt, 1.0, 3);
    in->bt = mem[3];
    for (int64_t i = 0; i < pages; i++) /* pages scattered over the pool, as an engine's are */
        in->bt[i] = (int32_t)((i * 7919) % pages);
    int32_t *sl = mem[4];
    in->cuq = mem[5];
    for (int64_t i = 0; i < c->batch; i++)
        sl[i] = (int32_t)c->ctx;
    for (int64_t i = 0; i <= c->batch; i++)
        in->cuq[i] = (int32_t)i;
    in->q = fw_tensor_contiguous(mem[2], c->dt, 3, qs);
    in->cache.k = fw_tensor_contiguous(mem[0], c->dt, 4, ks);
    in->cache.v = fw_tensor_contiguous(mem[1], c->dt, 4, ks);
    if (c->tiles)
        bench_tiles_cache(&in->cache, c->hkv, c->page, c->d);
    if (c->cols)
        bench_cols_cache(&in->cache, c->hkv, c->page, c->d);
    in->cache.max_pages = per;
    in->cache.seqlens = sl;
    in->out_bytes = nq * es;
    return 1;
}

/* Quantile q of n sorted values (the nearest rank). */
static double pct(const double *sorted, int n, double q) { return sorted[(int)(q * (n - 1) + 0.5)]; }

/* Largest |a - b| over n values of dtype dt, and the largest |a| into *big. */
static double max_diff(const void *a, const void *b, size_t n, fw_dtype dt, double *big)
{
    double m = 0.0;
    *big = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double x = bench_value(a, dt, (int64_t)i), y = bench_value(b, dt, (int64_t)i);
        const double d = x == y ? 0.0 : fabs(x - y);
        m = d > m || d != d ? d : m;
        *big = fabs(x) > *big ? fabs(x) : *big;
    }
    return m;
}

static void ab_usage(FILE *f)
{
    fprintf(f, "usage: flywheel ab A.so B.so attn|decode|gdn|gdn-decode [--threads N --rounds N\n"
               "       --calls N --dtype f32|bf16|f16]\n"
               "       attn:   [--batch B --t T --hq H --hkv H --d D --bwd]\n"
               "       decode: [--batch B --ctx N --hq H --hkv H --d D --page P --caches N --tiles|--cols]\n"
               "       gdn:    [--t T --h H --hv HV --d D --kda]\n"
               "       gdn-decode: [--n N --h H --hv HV --d D --caches N]\n"
               "  two builds of the library in one process, taking turns on the same inputs (rounds of\n"
               "  --calls calls, A then B, then B then A, ...): median time per call, the 10th-90th\n"
               "  percentiles, B / A and the range of the per-round ratios, and whether the outputs agree.\n"
               "  Defaults: attn (a causal prefill; --bwd: its backward) bf16, batch 1, T 2048, GQA 32:8,\n"
               "  d 128, 5 rounds of 2 calls; decode f32, batch 1, ctx 1024, GQA 32:8, d 128, page 128,\n"
               "  1 cache (hot),\n"
               "  20 rounds of 40 calls; gdn bf16, T 4096, H = HV = 16, d 128, 3 rounds of 2 calls;\n"
               "  gdn-decode bf16, N 1, H 16, HV 32, d 128, f32 states, 1 slot set (hot), 20 rounds of 40;\n"
               "  threads: all CPUs. Both builds need this CLI's ABI number.\n");
}

int bench_ab_main(int argc, char **argv)
{
    if (argc >= 1 && bench_is_help(argv[0])) {
        ab_usage(stdout);
        return 0;
    }
    if (argc < 3) {
        ab_usage(stderr);
        fprintf(stderr, "flywheel: ab needs two libraries and attn, decode, gdn or gdn-decode\n");
        return 2;
    }
    acfg c = {.threads = bench_cpus(), .caches = 1, .batch = 1, .ctx = 1024, .hq = 32, .hkv = 8, .d = 128,
              .page = 128, .T = 4096, .H = 16, .HV = 16, .N = 1, .dt = FW_F32};
    if (strcmp(argv[2], "attn") == 0) {
        c.prefill = 1;
        c.dt = FW_BF16;
        c.T = 2048;
    } else if (strcmp(argv[2], "gdn") == 0) {
        c.gdn = 1;
        c.dt = FW_BF16;
    } else if (strcmp(argv[2], "gdn-decode") == 0) {
        c.gdec = 1;
        c.dt = FW_BF16;
        c.HV = 32;
    } else if (strcmp(argv[2], "decode") != 0) {
        ab_usage(stderr);
        fprintf(stderr, "flywheel: ab needs attn, decode, gdn or gdn-decode; got %s\n", argv[2]);
        return 2;
    }
    c.rounds = c.gdn ? 3 : c.prefill ? 5 : 20;
    c.calls = c.gdn || c.prefill ? 2 : 40;
    /* options of the attention kinds (attn, decode), of decode alone, of the linear ones */
    const int attn = !c.gdn && !c.gdec, dec = attn && !c.prefill, lin = c.gdn || c.gdec;
    for (int i = 3; i < argc; i++) {
        if (bench_is_help(argv[i])) {
            ab_usage(stdout);
            return 0;
        } else if (bench_opt(argc, argv, &i, "--threads"))
            c.threads = (int)bench_int("--threads", argv[i], 1, 256);
        else if (bench_opt(argc, argv, &i, "--rounds"))
            c.rounds = (int)bench_int("--rounds", argv[i], 1, 10000);
        else if (bench_opt(argc, argv, &i, "--calls"))
            c.calls = (int)bench_int("--calls", argv[i], 1, 10000);
        else if (bench_opt(argc, argv, &i, "--dtype")) {
            if (!bench_dtype(argv[i], &c.dt)) {
                fprintf(stderr, "flywheel: --dtype %s: expected f32, bf16 or f16\n", argv[i]);
                return 2;
            }
        } else if (attn && bench_opt(argc, argv, &i, "--batch"))
            c.batch = bench_int("--batch", argv[i], 1, 4096);
        else if (dec && bench_opt(argc, argv, &i, "--ctx"))
            c.ctx = bench_int("--ctx", argv[i], 1, 1 << 24);
        else if (attn && bench_opt(argc, argv, &i, "--hq"))
            c.hq = bench_int("--hq", argv[i], 1, 1024);
        else if (attn && bench_opt(argc, argv, &i, "--hkv"))
            c.hkv = bench_int("--hkv", argv[i], 1, 1024);
        else if (dec && bench_opt(argc, argv, &i, "--page"))
            c.page = bench_int("--page", argv[i], 1, 1 << 20);
        else if ((dec || c.gdec) && bench_opt(argc, argv, &i, "--caches"))
            c.caches = (int)bench_int("--caches", argv[i], 1, 4096);
        else if (bench_opt(argc, argv, &i, "--d"))
            c.d = bench_int("--d", argv[i], 1, 1024);
        else if ((c.gdn || c.prefill) && bench_opt(argc, argv, &i, "--t"))
            c.T = bench_int("--t", argv[i], 1, 1 << 24);
        else if (c.gdec && bench_opt(argc, argv, &i, "--n"))
            c.N = bench_int("--n", argv[i], 1, 1 << 16);
        else if (lin && bench_opt(argc, argv, &i, "--h"))
            c.H = bench_int("--h", argv[i], 1, 1024);
        else if (lin && bench_opt(argc, argv, &i, "--hv"))
            c.HV = bench_int("--hv", argv[i], 1, 1024);
        else if (c.gdn && strcmp(argv[i], "--kda") == 0)
            c.kda = 1;
        else if (c.prefill && strcmp(argv[i], "--bwd") == 0)
            c.bwd = 1;
        else if (dec && strcmp(argv[i], "--tiles") == 0)
            c.tiles = 1;
        else if (dec && strcmp(argv[i], "--cols") == 0)
            c.cols = 1;
        else {
            ab_usage(stderr);
            fprintf(stderr, "flywheel: ab %s: unknown option %s\n", argv[2], argv[i]);
            return 2;
        }
    }
    if (c.tiles && c.cols) {
        fprintf(stderr, "flywheel: ab decode: --tiles and --cols are two cache layouts; give one\n");
        return 2;
    }
    lib L[2];
    if (!load(&L[0], argv[0]) || !load(&L[1], argv[1]))
        return 2;
    ainput in;
    void *mem[6];
    const int ok = setup(&c, &in, mem, 6);
    void *out[2] = {ok ? malloc(in.out_bytes) : NULL, ok ? malloc(in.out_bytes) : NULL};
    const size_t nt = (size_t)c.rounds * (size_t)c.calls;
    double *t[2] = {malloc(nt * sizeof(double)), malloc(nt * sizeof(double))};
    double *rt = malloc((size_t)c.rounds * 2 * sizeof(double)), *ratio = malloc((size_t)c.rounds * sizeof(double));
    int rc = 1;
    if (!ok || !out[0] || !out[1] || !t[0] || !t[1] || !rt || !ratio) {
        fprintf(stderr, "flywheel: ab: out of memory (or a shape too large)\n");
        goto done;
    }
    if (ok && c.bwd) { /* the backward's out and lse: the forward's, computed once by A */
        fw_attn_params ap;
        L[0].attn_init(&ap);
        ap.causal = 1;
        ap.threads = c.threads;
        if (L[0].fwd(&in.q, &in.k, &in.v, &in.o, &in.lse, &ap) != FW_OK) {
            fprintf(stderr, "flywheel: ab: %s: %s\n", L[0].path, L[0].last_error());
            goto done;
        }
    }
    if (c.prefill)
        printf("flywheel ab: attention %s%s, batch %lld, T %lld, causal, GQA %lld:%lld, d %lld, %d thread(s)",
               c.bwd ? "backward " : "prefill ", fw_dtype_name(c.dt), (long long)c.batch, (long long)c.T,
               (long long)c.hq, (long long)c.hkv, (long long)c.d, c.threads);
    else if (c.gdec)
        printf("flywheel ab: gdn decode %s, N %lld, H %lld, HV %lld, d %lld, f32 states, %d slot set(s), %d thread(s)",
               fw_dtype_name(c.dt), (long long)c.N, (long long)c.H, (long long)c.HV, (long long)c.d, c.caches,
               c.threads);
    else if (c.gdn)
        printf("flywheel ab: gdn prefill%s %s, T %lld, H %lld, HV %lld, d %lld, %d thread(s)", c.kda ? " (KDA)" : "",
               fw_dtype_name(c.dt), (long long)c.T, (long long)c.H,
               (long long)c.HV, (long long)c.d, c.threads);
    else
        printf("flywheel ab: decode %s, batch %lld, ctx %lld, GQA %lld:%lld, d %lld, page %lld%s, %d cache(s), %d thread(s)",
               fw_dtype_name(c.dt), (long long)c.batch, (long long)c.ctx, (long long)c.hq, (long long)c.hkv,
               (long long)c.d, (long long)c.page, c.tiles ? " (FW_KV_TILES)" : c.cols ? " (vLLM's vec layout)" : "", c.caches, c.threads);
    printf("; %d rounds of %d calls a build, taking turns\n", c.rounds, c.calls);
    for (int r = 0, n = 0; r < c.rounds; r++, n += c.calls)
        for (int turn = 0; turn < 2; turn++) {
            const int b = turn ^ (r & 1); /* A B, then B A */
            double *tb = t[b] + n;
            for (int j = -1; j < c.calls; j++) {
                const double t0 = bench_now();
                const fw_status s = call(&L[b], b, &in, r * c.calls + j + 1, out[b]);
                const double dt = bench_now() - t0;
                if (s != FW_OK) {
                    fprintf(stderr, "flywheel: ab: %s: %s\n", L[b].path, L[b].last_error());
                    goto done;
                }
                if (j >= 0)
                    tb[j] = dt;
            }
            rt[2 * r + b] = bench_median(tb, c.calls);
        }
    for (int r = 0; r < c.rounds; r++)
        ratio[r] = rt[2 * r + 1] / rt[2 * r];
    double med[2];
    for (int b = 0; b < 2; b++) {
        med[b] = bench_median(t[b], (int)nt); /* sorts them, for the percentiles */
        printf("%s %s: median %.1f us (10th-90th percentile %.1f-%.1f)\n", b ? "B" : "A", L[b].path, med[b] * 1e6,
               pct(t[b], (int)nt, 0.1) * 1e6, pct(t[b], (int)nt, 0.9) * 1e6);
    }
    const double ratio_med = bench_median(ratio, c.rounds);
    /* the same inputs (round 0's cache; gdn-decode: each build's states after as many calls)
     * once more on each build */
    if (call(&L[0], 0, &in, 0, out[0]) != FW_OK || call(&L[1], 1, &in, 0, out[1]) != FW_OK) {
        fprintf(stderr, "flywheel: ab: the comparison call failed\n");
        goto done;
    }
    const size_t n = in.out_bytes / fw_dtype_size(c.dt);
    double big;
    const double diff = max_diff(out[0], out[1], n, c.dt, &big);
    printf("B / A time: %.3f (per-round ratios %.3f-%.3f, median %.3f); outputs: ", med[1] / med[0], ratio[0],
           ratio[c.rounds - 1], ratio_med);
    if (memcmp(out[0], out[1], in.out_bytes) == 0)
        printf("the same bits\n");
    else
        printf("differ, largest |B - A| %.3g (largest |A| %.3g)\n", diff, big);
    rc = 0;
done:
    for (int i = 0; i < 6; i++)
        free(mem[i]);
    free(in.slot);
    free(out[0]);
    free(out[1]);
    free(t[0]);
    free(t[1]);
    free(rt);
    free(ratio);
    return rc;
}
