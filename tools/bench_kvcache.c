/*
 * bench_kvcache.c: `flywheel bench kvcache`, the serving-engine call (append + attend).
 *
 * decode: every sequence appends 1 token at position ctx-1 and attends to ctx keys (the
 *   same step repeated, so every repetition does identical work). Reports microseconds per
 *   step (median) and GB/s of K/V read = batch * ctx * hkv * (d + dv) * bytes(cache dtype) / s
 *   (--mla: batch * ctx * hkv * d * bytes, V being part of K's rows), against two read rates
 *   measured in the same run by fw_read_bandwidth: streaming from memory (a 1 GiB buffer) and
 *   reading as many bytes as the step's K/V, over and over (the buffer then stays in whichever
 *   cache holds the hot K/V: the ceiling of a hot step); and GFLOP/s = 2 batch hq ctx (d + dv)
 *   / s against the peak of the precision in use (what bounds MLA's 128-head decode).
 * --cache f8e4m3|f8e5m2: an fp8 cache (descales 1), q, k_new and out in --dtype.
 * --mla: MLA's latent cache: one K/V head of d = 576 channels, V the first dv = 512 channels
 *   of the same rows (a view: the bytes are read once for both products), pages of 64.
 * prefill: every sequence appends `new` tokens after a cached prefix of ctx - new tokens.
 *   GFLOP/s = 2 (d + dv) x unmasked pairs / s and % of the peak of the precision in use (bf16
 *   inputs: bf16 products, the bf16 dot-product peak; else the FMA peak), next to the dense
 *   kernel (fw_attn_fwd) on the same shape in the same run.
 * --rotary: the cost of a fused RoPE (rotary_dim = d) on the same call: without and with it,
 *   alternating in 3 rounds of --reps calls; medians and the range of per-round ratios.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "commands.h"

typedef struct {
    int64_t batch, ctx, nnew, hq, hkv, d, dv, page;
    fw_dtype dt, cdt; /* q, k_new, out; the cache */
    int mla;          /* --mla: V the first dv channels of K's rows */
    int threads, reps, json;
    const char *isa;
    int rotary;
    uint32_t flags; /* --dec-prefetch, --no-dec-prefetch */
    int tiles;      /* --tiles: FW_KV_TILES (vLLM's AMX layout; paged bf16) */
    int cols;       /* --cols: vLLM's vec layout (paged; each page's keys of a head transposed) */
} kcfg;

static void fill_bits(void *p, size_t n, fw_dtype dt)
{
    uint64_t s = 0x2545F4914F6CDD1Dull;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        float x = (float)((double)(s >> 11) * 0x1p-53 * 3.0 - 1.5);
        if (dt == FW_F32) ((float *)p)[i] = x;
        else if (dt == FW_BF16) ((uint16_t *)p)[i] = fw_f32_to_bf16(x);
        else if (dt == FW_F16) ((uint16_t *)p)[i] = fw_f32_to_f16(x);
        else ((uint8_t *)p)[i] = fw_f32_to_f8(x, dt);
    }
}


static int kv_run(const kcfg *c, int decode)
{
    const size_t es = fw_dtype_size(c->dt), ces = fw_dtype_size(c->cdt);
    const int64_t b = c->batch, n = decode ? 1 : c->nnew, tq = b * n, d = c->d, dv = c->dv;
    const int64_t ps = c->page ? c->page : c->ctx;
    const int64_t per = (c->ctx + ps - 1) / ps, pages = c->page ? b * per : b;
    int64_t ks[4] = {pages, ps, c->hkv, d}, vsh[4] = {pages, ps, c->hkv, dv}, qs[3] = {tq, c->hq, d},
            os[3] = {tq, c->hq, dv}, ns[3] = {tq, c->hkv, d}, vns[3] = {tq, c->hkv, dv};
    const size_t kbytes = (size_t)(pages * ps * c->hkv * d) * ces, vbytes = (size_t)(pages * ps * c->hkv * dv) * ces;
    void *kd = bench_alloc(kbytes), *vd = c->mla ? kd : bench_alloc(vbytes), *qd = malloc((size_t)(tq * c->hq * d) * es);
    void *knd = malloc((size_t)(tq * c->hkv * d) * es), *vnd = c->mla ? knd : malloc((size_t)(tq * c->hkv * dv) * es);
    void *od = malloc((size_t)(tq * c->hq * dv) * es);
    int32_t *bt = malloc(sizeof(int32_t) * (size_t)(b * per)), *cuq = malloc(sizeof(int32_t) * (size_t)(b + 1)),
            *sl = malloc(sizeof(int32_t) * (size_t)b);
#define KV_FREE() do { free(kd); if (!c->mla) { free(vd); free(vnd); } free(qd); free(knd); free(od); \
                       free(bt); free(cuq); free(sl); } while (0)
    if (!kd || !vd || !qd || !knd || !vnd || !od || !bt || !cuq || !sl) {
        fprintf(stderr, "bench kvcache: out of memory\n");
        KV_FREE();
        return 1;
    }
    fill_bits(kd, kbytes / ces, c->cdt);
    if (!c->mla) {
        fill_bits(vd, vbytes / ces, c->cdt);
        fill_bits(vnd, (size_t)(tq * c->hkv * dv), c->dt);
    }
    fill_bits(qd, (size_t)(tq * c->hq * d), c->dt);
    fill_bits(knd, (size_t)(tq * c->hkv * d), c->dt);
    /* pages of each sequence interleaved across the pool, as an allocator would leave them */
    for (int64_t i = 0; i < b; i++)
        for (int64_t pg = 0; pg < per; pg++)
            bt[i * per + pg] = (int32_t)(pg * b + i);
    for (int64_t i = 0; i <= b; i++)
        cuq[i] = (int32_t)(i * n);
    for (int64_t i = 0; i < b; i++)
        sl[i] = (int32_t)(c->ctx - n);
    fw_kv_cache cache;
    memset(&cache, 0, sizeof cache);
    cache.k = fw_tensor_contiguous(kd, c->cdt, 4, ks);
    cache.v = fw_tensor_contiguous(vd, c->cdt, 4, vsh);
    fw_tensor vn = fw_tensor_contiguous(vnd, c->dt, 3, vns);
    if (c->mla) { /* V: the first dv channels of K's rows, as are the new values of the new keys */
        for (int i = 0; i < 4; i++)
            cache.v.stride[i] = cache.k.stride[i];
        vn.stride[0] = c->hkv * d;
        vn.stride[1] = d;
    }
    const float one = 1.0f;
    const int64_t one_shape[1] = {1};
    const fw_tensor descale = fw_tensor_contiguous((void *)&one, FW_F32, 1, one_shape);
    if (c->cdt != c->dt) {
        cache.k_descale = &descale;
        cache.v_descale = &descale;
    }
    if (c->tiles)
        bench_tiles_cache(&cache, c->hkv, ps, d);
    if (c->cols)
        bench_cols_cache(&cache, c->hkv, ps, d);
    cache.block_table = c->page ? bt : NULL;
    cache.max_pages = per;
    cache.seqlens = sl;
    fw_tensor q = fw_tensor_contiguous(qd, c->dt, 3, qs), kn = fw_tensor_contiguous(knd, c->dt, 3, ns),
              o = fw_tensor_contiguous(od, c->dt, 3, os);
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.causal = 1;
    p.threads = c->threads;
    p.isa = c->isa;
    p.flags = c->flags;
    double t[64];
    int reps = c->reps > 64 ? 64 : c->reps, fail = 0;
    void *rmem = NULL;
    fw_tensor rc, rs;
    double rt[2][3], rlo = INFINITY, rhi = 0;
    if (c->rotary && !bench_rope_tables(c->ctx, c->d, &rmem, &rc, &rs)) {
        fprintf(stderr, "bench kvcache: out of memory\n");
        KV_FREE();
        return 1;
    }
    for (int round = 0; round < (c->rotary ? 3 : 1) && !fail; round++)
        for (int with = 0; with < (c->rotary ? 2 : 1) && !fail; with++) {
            p.rotary_cos = with ? &rc : NULL;
            p.rotary_sin = with ? &rs : NULL;
            for (int i = -1; i < reps && !fail; i++) {
                double t0 = bench_now();
                fw_status s = fw_attn_kvcache_fwd(&q, &kn, &vn, cuq, b, &cache, &o, NULL, &p);
                double dt = bench_now() - t0;
                if (s != FW_OK) {
                    fprintf(stderr, "bench kvcache: %s\n", fw_last_error());
                    fail = 1;
                } else if (i >= 0) {
                    t[i] = dt;
                }
            }
            if (c->rotary && !fail) {
                rt[with][round] = bench_median(t, reps);
                if (with) {
                    const double r = rt[1][round] / rt[0][round];
                    rlo = r < rlo ? r : rlo;
                    rhi = r > rhi ? r : rhi;
                }
            }
        }
    p.rotary_cos = p.rotary_sin = NULL;
    free(rmem);
    if (!fail && c->rotary) {
        const double a = bench_median(rt[0], 3), r = bench_median(rt[1], 3);
        printf("rotary    %-5s %s batch %-3lld ctx %-6lld new %lld h%lld:%lld d%lld thr=%d  without %.1f us, "
               "with %.1f us: %+.1f%% (rounds %+.1f%% .. %+.1f%%)\n", fw_dtype_name(c->dt),
               decode ? "decode " : "prefill", (long long)b, (long long)c->ctx, (long long)n,
               (long long)c->hq, (long long)c->hkv, (long long)c->d, c->threads, a * 1e6, r * 1e6,
               100 * (r / a - 1), 100 * (rlo - 1), 100 * (rhi - 1));
        KV_FREE();
        return 0;
    }
    if (!fail) {
        const double sec = bench_median(t, reps);
        const int bf16 = bench_bf16_products(c->isa, c->dt, FW_PREC_AUTO);
        char cache_name[32] = "", dname[48];
        if (c->cdt != c->dt)
            snprintf(cache_name, sizeof cache_name, " cache %s", fw_dtype_name(c->cdt));
        if (dv == d)
            snprintf(dname, sizeof dname, "d%lld", (long long)d);
        else
            snprintf(dname, sizeof dname, "d%lld/%lld", (long long)d, (long long)dv);
        if (decode) {
            double bw = 0, same = 0;
            const double bytes = (double)b * (double)c->ctx * (double)c->hkv * (double)(c->mla ? d : d + dv) * (double)ces;
            const double gbs = bytes / sec * 1e-9;
            const double gf = 2.0 * (double)b * (double)c->hq * (double)c->ctx * (double)(d + dv) / sec * 1e-9;
            const double pk = bench_peak_over(c->isa, c->threads, bf16, gf);
            /* (at least the 4 KiB a thread that fw_read_bandwidth takes; threads is >= 1 here) */
            if (fw_read_bandwidth(c->threads, (size_t)1 << 30, &bw) != FW_OK ||
                fw_read_bandwidth(c->threads, (size_t)fmax(bytes, 4096.0 * c->threads), &same) != FW_OK) {
                fprintf(stderr, "bench kvcache: %s\n", fw_last_error());
                fail = 1;
            } else if (c->json)
                printf("{\"op\":\"kvcache_decode\",\"batch\":%lld,\"ctx\":%lld,\"hq\":%lld,\"hkv\":%lld,\"d\":%lld,"
                       "\"dv\":%lld,\"mla\":%d,\"dtype\":\"%s\",\"cache_dtype\":\"%s\",\"page\":%lld,\"layout\":\"%s\","
                       "\"threads\":%d,\"reps\":%d,\"seconds_median\":%.6g,"
                       "\"us_per_step\":%.2f,\"kv_gbps\":%.2f,\"read_bw_gbps\":%.2f,\"pct_bw\":%.1f,"
                       "\"same_bytes_gbps\":%.2f,\"pct_same_bytes\":%.1f,\"gflops\":%.2f,\"products\":\"%s\","
                       "\"peak_gflops\":%.2f,\"pct_peak\":%.1f}\n",
                       (long long)b, (long long)c->ctx, (long long)c->hq, (long long)c->hkv, (long long)d,
                       (long long)dv, c->mla, fw_dtype_name(c->dt), fw_dtype_name(c->cdt), (long long)c->page,
                       c->tiles ? "tiles" : c->cols ? "cols" : "rows", c->threads, reps, sec, sec * 1e6, gbs, bw,
                       100 * gbs / bw, same, 100 * gbs / same, gf, bf16 ? "bf16" : "f32", pk, 100 * gf / pk);
            else
                printf("decode    %-5s%s%s batch %-3lld ctx %-6lld h%lld:%lld %s page %-5lld%s thr=%d  %9.1f us/step  "
                       "%6.1f GB/s K/V  %5.1f%% of %.1f GB/s read bandwidth, %5.1f%% of %.1f GB/s reading as many bytes;"
                       "  %6.1f GFLOP/s %5.1f%% of %.0f %s peak\n",
                       fw_dtype_name(c->dt), cache_name, c->mla ? " mla" : "", (long long)b, (long long)c->ctx,
                       (long long)c->hq, (long long)c->hkv, dname,
                       (long long)c->page, c->tiles ? " tiles" : c->cols ? " cols" : "", c->threads, sec * 1e6, gbs,
                       100 * gbs / bw, bw, 100 * gbs / same, same, gf, 100 * gf / pk, pk, bf16 ? "bf16" : "FMA");
        } else {
            /* pairs: row r of n sees keys [0, ctx - n + r] */
            const double pairs = (double)b * (double)c->hq * ((double)n * (double)(c->ctx - n) + (double)n * (double)(n + 1) / 2);
            const double gf = 2.0 * (double)(d + dv) * pairs / sec * 1e-9;
            /* the dense kernel on the same shape: q [b, n, hq, d] against the contiguous context,
             * in q's dtype */
            int64_t dq[4] = {b, n, c->hq, d}, dk[4] = {b, c->ctx, c->hkv, d}, dvs[4] = {b, c->ctx, c->hkv, dv},
                    dout[4] = {b, n, c->hq, dv};
            void *ck = malloc((size_t)(b * c->ctx * c->hkv * d) * es), *cv = malloc((size_t)(b * c->ctx * c->hkv * dv) * es);
            if (!ck || !cv) {
                fprintf(stderr, "bench kvcache: out of memory\n");
                free(ck);
                free(cv);
                KV_FREE();
                return 1;
            }
            fill_bits(ck, (size_t)(b * c->ctx * c->hkv * d), c->dt);
            fill_bits(cv, (size_t)(b * c->ctx * c->hkv * dv), c->dt);
            fw_tensor tq4 = fw_tensor_contiguous(qd, c->dt, 4, dq), tk4 = fw_tensor_contiguous(ck, c->dt, 4, dk),
                      tv4 = fw_tensor_contiguous(cv, c->dt, 4, dvs), to4 = fw_tensor_contiguous(od, c->dt, 4, dout);
            double td[64];
            for (int i = -1; i < reps; i++) {
                double t0 = bench_now();
                fw_attn_fwd(&tq4, &tk4, &tv4, &to4, NULL, &p);
                if (i >= 0)
                    td[i] = bench_now() - t0;
            }
            const double dsec = bench_median(td, reps), dgf = 2.0 * (double)(d + dv) * pairs / dsec * 1e-9;
            const double top = gf > dgf ? gf : dgf;
            const double pf = bench_peak_over(c->isa, c->threads, 0, bf16 ? 0 : top),
                         pb = bench_peak_over(c->isa, c->threads, 1, bf16 ? top : 0), pk = bf16 ? pb : pf;
            if (c->json)
                printf("{\"op\":\"kvcache_prefill\",\"batch\":%lld,\"ctx\":%lld,\"new\":%lld,\"hq\":%lld,\"hkv\":%lld,"
                       "\"d\":%lld,\"dv\":%lld,\"mla\":%d,\"dtype\":\"%s\",\"cache_dtype\":\"%s\",\"products\":\"%s\","
                       "\"page\":%lld,\"threads\":%d,\"reps\":%d,"
                       "\"seconds_median\":%.6g,\"gflops\":%.2f,\"peak_gflops\":%.2f,\"peak_bf16_gflops\":%.2f,"
                       "\"pct_peak\":%.1f,\"dense_gflops\":%.2f,\"dense_pct_peak\":%.1f}\n",
                       (long long)b, (long long)c->ctx, (long long)n, (long long)c->hq, (long long)c->hkv,
                       (long long)d, (long long)dv, c->mla, fw_dtype_name(c->dt), fw_dtype_name(c->cdt),
                       bf16 ? "bf16" : "f32", (long long)c->page, c->threads, reps, sec, gf, pf, pb, 100 * gf / pk,
                       dgf, 100 * dgf / pk);
            else
                printf("prefill   %-5s%s%s batch %-3lld %lld new on %lld cached h%lld:%lld %s page %-5lld thr=%d  %8.4f s  "
                       "%6.1f GFLOP/s %5.1f%% of %.0f %s peak   dense kernel %6.1f GFLOP/s %5.1f%%\n",
                       fw_dtype_name(c->dt), cache_name, c->mla ? " mla" : "", (long long)b, (long long)n,
                       (long long)(c->ctx - n), (long long)c->hq, (long long)c->hkv, dname, (long long)c->page,
                       c->threads, sec, gf, 100 * gf / pk, pk, bf16 ? "bf16" : "FMA", dgf, 100 * dgf / pk);
            free(ck);
            free(cv);
        }
        fflush(stdout);
    }
    KV_FREE();
#undef KV_FREE
    return fail;
}


static kcfg kdefaults(void)
{
    kcfg c = {1, 32768, 512, 32, 8, 128, 128, 256, FW_BF16, FW_BF16, 0, 0, 9, 0, NULL, 0, 0, 0, 0};
    c.threads = bench_cpus();
    return c;
}

int bench_kvcache_main(int argc, char **argv)
{
    kcfg c = kdefaults();
    int mode = 0, ctx_set = 0; /* mode 0: both sweeps, 1: decode, 2: prefill */
    int hq_set = 0, hkv_set = 0, d_set = 0, dv_set = 0, page_set = 0, cache_set = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
#define OPT(name) bench_opt(argc, argv, &i, name)
#define INT(name, lo, hi) bench_int(name, argv[i], lo, hi)
        if (OPT("--batch")) c.batch = INT("--batch", 1, 1 << 20);
        else if (OPT("--ctx")) c.ctx = INT("--ctx", 1, 1 << 24), ctx_set = 1;
        else if (OPT("--new")) c.nnew = INT("--new", 0, 1 << 24);
        else if (OPT("--hq")) c.hq = INT("--hq", 1, 65536), hq_set = 1;
        else if (OPT("--hkv")) c.hkv = INT("--hkv", 1, 65536), hkv_set = 1;
        else if (OPT("--d")) c.d = INT("--d", 1, 1024), d_set = 1;
        else if (OPT("--dv")) c.dv = INT("--dv", 1, 1024), dv_set = 1;
        else if (OPT("--page")) c.page = INT("--page", 0, 65536), page_set = 1;
        else if (OPT("--threads")) c.threads = (int)INT("--threads", 0, 256), c.threads = c.threads ? c.threads : bench_cpus();
        else if (OPT("--reps")) c.reps = (int)INT("--reps", 1, 100000);
        else if (OPT("--isa")) c.isa = argv[i];
        else if (OPT("--dtype")) {
            if (!bench_dtype(argv[i], &c.dt)) { fprintf(stderr, "flywheel: unknown dtype %s\n", argv[i]); return 2; }
        }
        else if (OPT("--cache")) {
            if (!strcmp(argv[i], "f8e4m3")) c.cdt = FW_F8E4M3;
            else if (!strcmp(argv[i], "f8e5m2")) c.cdt = FW_F8E5M2;
            else if (!bench_dtype(argv[i], &c.cdt)) {
                fprintf(stderr, "flywheel: --cache %s: expected f32, bf16, f16, f8e4m3 or f8e5m2\n", argv[i]);
                return 2;
            }
            cache_set = 1;
        }
        else if (!strcmp(a, "--mla")) c.mla = 1;
        else if (!strcmp(a, "--decode")) mode = 1;
        else if (!strcmp(a, "--prefill")) mode = 2;
        else if (!strcmp(a, "--json")) c.json = 1;
        else if (!strcmp(a, "--rotary")) c.rotary = 1;
        else if (!strcmp(a, "--dec-prefetch")) c.flags |= FW_ATTN_DEC_PREFETCH;
        else if (!strcmp(a, "--no-dec-prefetch")) c.flags |= FW_ATTN_NO_DEC_PREFETCH;
        else if (!strcmp(a, "--tiles")) c.tiles = 1;
        else if (!strcmp(a, "--cols")) c.cols = 1;
        else {
            if (!bench_is_help(a))
                fprintf(stderr, "flywheel: unknown option %s\n", a);
            printf("usage: flywheel bench kvcache [--decode | --prefill] [--batch N --ctx N --new N\n"
                   "       --hq N --hkv N --d N --dv N --page P (0 = contiguous) --dtype f32|bf16|f16\n"
                   "       --cache f8e4m3|f8e5m2|f32|bf16|f16 --mla\n"
                   "       --threads N --reps N --isa NAME --json --rotary --dec-prefetch | --no-dec-prefetch\n"
                   "       --tiles | --cols]\n"
                   "  --dtype: q, new keys and values, out; --cache: the cache's (default: --dtype; fp8: descales 1)\n"
                   "  --mla: MLA's latent cache, V the first dv channels of K's rows (defaults: hq 16, hkv 1,\n"
                   "    d 576, dv 512, page 64)\n"
                   "  --tiles: the cache in FW_KV_TILES, vLLM's AMX layout (paged bf16, page, d multiples of 32)\n"
                   "  --cols: in vLLM's vec layout, each page's keys of a head transposed (paged)\n"
                   "  --ctx is the context after the append (prefill default: 8192 + new)\n"
                   "  with neither --decode nor --prefill: decode at batch 1 and 16 over contexts 1K..32K,\n"
                   "  then 512 new tokens on an 8K prefix\n");
            return bench_is_help(a) ? 0 : 2;
        }
#undef INT
#undef OPT
    }
    if (c.tiles && c.cols) {
        fprintf(stderr, "flywheel: bench kvcache: --tiles and --cols are two cache layouts; give one\n");
        return 2;
    }
    if (c.mla) {
        c.hq = hq_set ? c.hq : 16;
        c.hkv = hkv_set ? c.hkv : 1;
        c.d = d_set ? c.d : 576;
        c.dv = dv_set ? c.dv : 512;
        c.page = page_set ? c.page : 64;
        if (c.dv > c.d || c.tiles || c.cols || c.rotary) {
            fprintf(stderr, "flywheel: bench kvcache: --mla reads V from K's rows: dv <= d, and no --tiles, --cols "
                            "or --rotary\n");
            return 2;
        }
    } else if (!dv_set) {
        c.dv = c.d;
    }
    if (!cache_set)
        c.cdt = c.dt;
    if ((c.tiles || c.cols || c.rotary) && c.dv != c.d) {
        fprintf(stderr, "flywheel: bench kvcache: --tiles, --cols and --rotary take dv = d\n");
        return 2;
    }
    if (mode == 1)
        return kv_run(&c, 1);
    if (mode == 2) {
        if (!ctx_set) /* 512 new tokens on an 8K prefix */
            c.ctx = 8192 + c.nnew;
        return kv_run(&c, 0);
    }
    int fail = 0;
    static const int64_t ctxs[] = {1024, 4096, 16384, 32768};
    for (int bi = 0; bi < 2; bi++)
        for (int i = 0; i < 4; i++) {
            kcfg d = c;
            d.batch = bi ? 16 : 1;
            d.ctx = ctxs[i];
            fail |= kv_run(&d, 1);
        }
    kcfg pf = c;
    pf.ctx = 8192 + 512;
    pf.nnew = 512;
    pf.reps = 5;
    fail |= kv_run(&pf, 0);
    return fail;
}

/* The two lines of `make run`: decode at 32K and a chunked prefill on an 8K prefix (json: one
 * object each). */
int bench_kvcache_headline(int json, int small)
{
    kcfg c = kdefaults();
    const int s = small ? 16 : 1;
    c.json = json;
    c.batch = 1;
    c.ctx = 32768 / s;
    if (small) {
        c.hq /= 4;
        c.hkv /= 4;
        c.reps = 1;
    }
    int fail = kv_run(&c, 1);
    c.ctx = (8192 + 512) / s;
    c.nnew = 512 / s;
    c.reps = small ? 1 : 5;
    return fail | kv_run(&c, 0);
}
