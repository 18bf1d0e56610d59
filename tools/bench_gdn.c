/*
 * bench_gdn.c: `flywheel bench gdn`, Gated DeltaNet prefill and decode.
 *
 * FLOP formula (the chunked pass's products counted as dense tiles, chunk C = 64): per token
 * and value head, 2 x MACs with MACs = 3 dk dv + C (3 dk + 2 dv) + (C-1)(C-2)/6
 * (dk = dv = 128: 181,526 FLOP). GFLOP/s = that x tokens x HV / seconds; % of the peak of the
 * products in use (bf16 products: the bf16 dot-product peak, else the FMA peak), measured in
 * the same run. In the same run, on the same prefill: the chunked kernel with either
 * triangular inverse in the chosen precision (--precision; auto: bf16 products for bf16
 * inputs), then with bf16 products the chunked kernel on f32 products (the same-run ratio),
 * the plain recurrence with four passes over the state per token (how ggml does it) and the
 * fused one-pass recurrent step; tokens/s for each.
 * --kda: KDA, one decay per key channel (g [T, HV, dk]), on the same FLOP formula (its extra
 * exponentials and decay products are not counted).
 * Decode: microseconds per step (one token for each of N sequences) and state bytes moved per
 * second (N x HV x dk x dv x 4 bytes, 2 with --state bf16, read and written: x 2) against the
 * read bandwidth measured in the same run. --state bf16: the states in a bf16 pool
 * (fw_gdn_decode_pool; vLLM's default state cache for a bf16 model).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "commands.h"

typedef struct {
    int64_t T, H, HV, dk, dv, nseq;
    fw_dtype dt;
    int threads, reps, json, baselines;
    const char *isa;
    int prec; /* fw_precision of the chunked modes */
    int kda;  /* g [T, HV, dk] */
    fw_dtype sdt; /* decode: the states' dtype */
} gcfg;

static double flop_per_token_head(int64_t dk, int64_t dv)
{
    const double C = 64;
    return 2.0 * (3.0 * dk * dv + C * (3.0 * dk + 2.0 * dv) + (C - 1) * (C - 2) / 6.0);
}

typedef struct {
    void *q, *k, *v, *o;
    float *g, *b, *st;
    fw_tensor tq, tk, tv, tg, tb, to;
} gbufs;

static int make(gbufs *B, const gcfg *c, int64_t T)
{
    const size_t es = fw_dtype_size(c->dt);
    int64_t qs[3] = {T, c->H, c->dk}, vs[3] = {T, c->HV, c->dv}, gs[3] = {T, c->HV, c->dk};
    const int64_t gn = T * c->HV * (c->kda ? c->dk : 1);
    B->q = malloc((size_t)(T * c->H * c->dk) * es + 1);
    B->k = malloc((size_t)(T * c->H * c->dk) * es + 1);
    B->v = malloc((size_t)(T * c->HV * c->dv) * es + 1);
    B->o = malloc((size_t)(T * c->HV * c->dv) * es + 1);
    B->g = malloc(sizeof(float) * (size_t)gn + 1);
    B->b = malloc(sizeof(float) * (size_t)(T * c->HV) + 1);
    B->st = calloc((size_t)(c->nseq * c->HV * c->dk * c->dv) + 1, sizeof(float));
    if (!B->q || !B->k || !B->v || !B->o || !B->g || !B->b || !B->st)
        return 0;
    bench_fill(B->q, (size_t)(T * c->H * c->dk), c->dt, 1.0, 1);
    bench_fill(B->k, (size_t)(T * c->H * c->dk), c->dt, 1.0, 2);
    bench_fill(B->v, (size_t)(T * c->HV * c->dv), c->dt, 1.0, 3);
    bench_fill(B->g, (size_t)gn, FW_F32, 0.5, 4);
    bench_fill(B->b, (size_t)(T * c->HV), FW_F32, 0.5, 5);
    for (int64_t i = 0; i < gn; i++)
        B->g[i] = -0.05f - fabsf(B->g[i]);
    for (int64_t i = 0; i < T * c->HV; i++)
        B->b[i] = 0.5f + B->b[i] * 0.5f;
    B->tq = fw_tensor_contiguous(B->q, c->dt, 3, qs);
    B->tk = fw_tensor_contiguous(B->k, c->dt, 3, qs);
    B->tv = fw_tensor_contiguous(B->v, c->dt, 3, vs);
    B->to = fw_tensor_contiguous(B->o, c->dt, 3, vs);
    B->tg = fw_tensor_contiguous(B->g, FW_F32, c->kda ? 3 : 2, gs);
    B->tb = fw_tensor_contiguous(B->b, FW_F32, 2, gs);
    return 1;
}

static void unmake(gbufs *B)
{
    free(B->q); free(B->k); free(B->v); free(B->o); free(B->g); free(B->b); free(B->st);
}

/* The benchmark's parameters: l2norm in the kernel, its threads and table, these flags. */
static fw_gdn_params bench_params(const gcfg *c, uint32_t flags, int prec)
{
    fw_gdn_params p;
    fw_gdn_params_init(&p);
    p.l2norm_qk = 1;
    p.threads = c->threads;
    p.isa = c->isa;
    p.flags = flags;
    p.precision = prec;
    return p;
}

/* Median seconds of `reps` prefill calls (after a warm-up) with the given flags. */
static double time_prefill(const gcfg *c, gbufs *B, const int32_t *cu, uint32_t flags, int prec, int reps)
{
    fw_gdn_params p = bench_params(c, flags, prec);
    double t[32];
    reps = reps > 32 ? 32 : reps;
    for (int i = -1; i < reps; i++) {
        double t0 = bench_now();
        if (fw_gdn_prefill(&B->tq, &B->tk, &B->tv, &B->tg, &B->tb, cu, c->nseq, NULL, B->st, &B->to, &p) != FW_OK) {
            fprintf(stderr, "bench gdn: %s\n", fw_last_error());
            return -1;
        }
        if (i >= 0)
            t[i] = bench_now() - t0;
    }
    return bench_median(t, reps);
}

/* Check of the chunked kernel in precision `prec` on q/k head 0 and its value heads (views of
 * the benchmark's inputs), against the float64 recurrence: out and final-state errors, and
 * the bar, 2 x the error of the same-roundings reference (bf16 products; its output rounded to
 * the output dtype) or of the fused recurrent step (f32 products) + 1e-5. Returns the
 * verdict; the errors land in err[0..1], the bar's in err[2..3]. */
static int check_prefill(const gcfg *c, gbufs *B, int prec, double err[4])
{
    const int64_t T = c->T, r = c->HV / c->H, no = T * r * c->dv, ns = r * c->dk * c->dv;
    fw_tensor q = B->tq, k = B->tk, v = B->tv, g = B->tg, b = B->tb;
    q.shape[1] = k.shape[1] = 1;
    v.shape[1] = g.shape[1] = b.shape[1] = r;
    int64_t os[3] = {T, r, c->dv};
    void *o = malloc((size_t)no * fw_dtype_size(c->dt) + 1);
    float *st = malloc(sizeof(float) * (size_t)ns + 1);
    double *ro = malloc(sizeof(double) * (size_t)no + 1), *rs = malloc(sizeof(double) * (size_t)ns + 1);
    double *bo = malloc(sizeof(double) * (size_t)no + 1), *bs = malloc(sizeof(double) * (size_t)ns + 1);
    int ok = o && st && ro && rs && bo && bs;
    const int32_t cu[2] = {0, (int32_t)T};
    fw_tensor to = fw_tensor_contiguous(o, c->dt, 3, os), tro = fw_tensor_contiguous(ro, FW_F64, 3, os),
              tbo = fw_tensor_contiguous(bo, FW_F64, 3, os);
    fw_gdn_params p = bench_params(c, 0, FW_PREC_F32);
    const double e0[4] = {INFINITY, INFINITY, 0, 0};
    for (int i = 0; i < 4; i++)
        err[i] = e0[i];
    if (ok)
        ok = fw_gdn_ref(&q, &k, &v, &g, &b, cu, 1, NULL, rs, &tro, &p) == FW_OK;
    /* the bar: the same-roundings reference, or the fused recurrent step's own error */
    if (ok && prec == FW_PREC_BF16) {
        p.precision = FW_PREC_BF16;
        ok = fw_gdn_ref(&q, &k, &v, &g, &b, cu, 1, NULL, bs, &tbo, &p) == FW_OK;
        for (int64_t i = 0; ok && i < no; i++)
            bo[i] = c->dt == FW_BF16 ? fw_bf16_to_f32(fw_f32_to_bf16((float)bo[i]))
                    : c->dt == FW_F16 ? fw_f16_to_f32(fw_f32_to_f16((float)bo[i])) : bo[i];
    } else if (ok) {
        p.flags = FW_GDN_FUSED_RECURRENT;
        ok = fw_gdn_prefill(&q, &k, &v, &g, &b, cu, 1, NULL, st, &to, &p) == FW_OK;
        for (int64_t i = 0; ok && i < no; i++)
            bo[i] = bench_value(o, c->dt, i);
        for (int64_t i = 0; ok && i < ns; i++)
            bs[i] = st[i];
    }
    if (ok) {
        double eb[2] = {0, 0}, ek[2] = {0, 0};
        for (int64_t i = 0; i < no; i++)
            eb[0] = fmax(eb[0], fabs(bo[i] - ro[i]));
        for (int64_t i = 0; i < ns; i++)
            eb[1] = fmax(eb[1], fabs(bs[i] - rs[i]));
        p.flags = 0;
        p.precision = prec;
        ok = fw_gdn_prefill(&q, &k, &v, &g, &b, cu, 1, NULL, st, &to, &p) == FW_OK;
        for (int64_t i = 0; ok && i < no; i++) {
            const double d = fabs(bench_value(o, c->dt, i) - ro[i]);
            ek[0] = d > ek[0] || d != d ? d : ek[0];
        }
        for (int64_t i = 0; ok && i < ns; i++) {
            const double d = fabs(st[i] - rs[i]);
            ek[1] = d > ek[1] || d != d ? d : ek[1];
        }
        err[0] = ek[0];
        err[1] = ek[1];
        err[2] = 2 * eb[0] + 1e-5;
        err[3] = 2 * eb[1] + 1e-5;
    }
    free(o); free(st); free(ro); free(rs); free(bo); free(bs);
    return ok && err[0] <= err[2] && err[1] <= err[3];
}

static int run_prefill(const gcfg *c)
{
    gbufs B;
    if (!make(&B, c, c->T)) {
        fprintf(stderr, "bench gdn: out of memory\n");
        return 1;
    }
    /* the varlen batch: nseq sequences of uneven lengths summing to T */
    int32_t *cu = malloc(sizeof(int32_t) * (size_t)(c->nseq + 1));
    cu[0] = 0;
    for (int64_t i = 1; i <= c->nseq; i++)
        cu[i] = (int32_t)(c->T * i / c->nseq + (i < c->nseq ? (i % 2 ? 37 : -37) : 0));
    const double fl = flop_per_token_head(c->dk, c->dv) * (double)c->T * (double)c->HV;
    double pk = bench_peak(c->isa, c->threads), pkb = bench_peak_bf16(c->isa, c->threads);
    const int bf16 = bench_bf16_products(c->isa, c->dt, c->prec);
    /* the chunked modes in the chosen precision; with bf16 products, the same on f32 products
     * (the same-run ratio); the recurrent baselines always run f32 products */
    const int cp = bf16 ? FW_PREC_BF16 : FW_PREC_F32;
    const struct { const char *name; uint32_t flags; int prec, baseline; } modes[] = {
        {"chunked", 0, cp, 0}, {"chunked-fwdsubst", FW_GDN_FWD_SUBST, cp, 0}, {"chunked-f32", 0, FW_PREC_F32, 0},
        {"recurrent-4pass", FW_GDN_RECURRENT, FW_PREC_F32, 1}, {"recurrent-fused", FW_GDN_FUSED_RECURRENT, FW_PREC_F32, 1},
    };
    double base = 0, fused = 0, tps_f32 = 0, tps_chunked = 0;
    const char *op = c->kda ? "kda" : "gdn";
    int fail = 0;
    for (int m = 0; m < 5; m++) {
        if ((m == 2 && !bf16) || (modes[m].baseline && !c->baselines))
            continue;
        /* the recurrent baselines are slow: time them on fewer repetitions */
        const double s = time_prefill(c, &B, cu, modes[m].flags, modes[m].prec, modes[m].baseline ? 3 : c->reps);
        if (s < 0) {
            fail = 1;
            break;
        }
        const double gf = fl / s * 1e-9, tps = (double)c->T / s;
        const int mb = modes[m].prec == FW_PREC_BF16;
        if (mb)
            pkb = bench_peak_over(c->isa, c->threads, 1, gf);
        else
            pk = bench_peak_over(c->isa, c->threads, 0, gf);
        const double peak = mb ? pkb : pk;
        if (m == 0)
            tps_chunked = tps;
        if (m == 2)
            tps_f32 = tps;
        if (m == 3)
            base = tps;
        if (m == 4)
            fused = tps;
        if (c->json)
            printf("{\"op\":\"%s_prefill\",\"variant\":\"%s\",\"T\":%lld,\"seqs\":%lld,\"H\":%lld,\"HV\":%lld,"
                   "\"dk\":%lld,\"dv\":%lld,\"dtype\":\"%s\",\"threads\":%d,\"seconds_median\":%.6g,"
                   "\"tokens_per_s\":%.1f,\"gflops\":%.2f,\"products\":\"%s\",\"peak_gflops\":%.2f,"
                   "\"peak_bf16_gflops\":%.2f,\"pct_peak\":%.1f}\n",
                   c->kda ? "kda" : "gdn", modes[m].name, (long long)c->T, (long long)c->nseq, (long long)c->H,
                   (long long)c->HV, (long long)c->dk, (long long)c->dv, fw_dtype_name(c->dt), c->threads, s, tps, gf,
                   mb ? "bf16" : "f32", pk, pkb, 100 * gf / peak);
        else
            printf("%s prefill %-17s %-4s T=%-6lld seqs %-2lld H%lld HV%lld d%lld/%lld thr=%d  %8.4f s  %9.0f tok/s  "
                   "%6.1f GFLOP/s  %5.1f%% of %.0f %s peak\n",
                   c->kda ? "kda" : "gdn", modes[m].name, fw_dtype_name(c->dt), (long long)c->T, (long long)c->nseq, (long long)c->H,
                   (long long)c->HV, (long long)c->dk, (long long)c->dv, c->threads, s, tps, gf, 100 * gf / peak,
                   peak, mb ? "bf16" : "FMA");
        fflush(stdout);
    }
    if (!fail) {
        double e[4];
        const int pass = check_prefill(c, &B, cp, e);
        if (c->json)
            printf("{\"op\":\"%s_prefill_check\",\"T\":%lld,\"products\":\"%s\",\"out_err\":%.3g,"
                   "\"out_bar\":%.3g,\"state_err\":%.3g,\"state_bar\":%.3g,\"check\":\"%s\"}\n",
                   op, (long long)c->T, bf16 ? "bf16" : "f32", e[0], e[2], e[1], e[3], pass ? "pass" : "FAIL");
        else
            printf("%s prefill T=%lld: chunked, %s products, head 0 against float64: out err %.2g (bar %.2g), "
                   "state err %.2g (bar %.2g) %s\n",
                   op, (long long)c->T, bf16 ? "bf16" : "f32", e[0], e[2], e[1], e[3], pass ? "ok" : "FAIL");
        fail |= !pass;
    }
    if (bf16 && tps_f32 > 0 && !fail)
        printf(c->json ? "{\"op\":\"%s_prefill_ratio\",\"T\":%lld,\"bf16_over_f32_products\":%.2f}\n"
                       : "%s prefill T=%lld: bf16 / f32 products tokens/s = %.2fx\n",
               op, (long long)c->T, tps_chunked / tps_f32);
    if (c->baselines && base > 0 && fused > 0 && !fail) {
        const double s = time_prefill(c, &B, cu, 0, cp, c->reps);
        printf(c->json ? "{\"op\":\"%s_prefill_ratio\",\"T\":%lld,\"chunked_over_recurrent_4pass\":%.2f,"
                         "\"chunked_over_recurrent_fused\":%.2f}\n"
                       : "%s prefill T=%lld: chunked / recurrent-4pass tokens/s = %.2fx, chunked / recurrent-fused "
                         "= %.2fx\n",
               op, (long long)c->T, ((double)c->T / s) / base, ((double)c->T / s) / fused);
    }
    free(cu);
    unmake(&B);
    return fail;
}

static int run_decode(const gcfg *c, int64_t N)
{
    gcfg d = *c;
    d.nseq = N;
    gbufs B;
    if (!make(&B, &d, N)) {
        fprintf(stderr, "bench gdn: out of memory\n");
        return 1;
    }
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)N);
    for (int64_t i = 0; i < N; i++)
        idx[i] = (int32_t)(N - 1 - i);
    fw_gdn_params p = bench_params(c, 0, FW_PREC_AUTO);
    /* a bf16 pool over the same buffer (half of it) */
    const fw_gdn_pool pool = {B.st, N, c->HV * c->dk * c->dv, idx, idx, FW_BF16};
    double t[64];
    const int reps = c->reps * 4 > 64 ? 64 : c->reps * 4;
    for (int i = -1; i < reps; i++) {
        double t0 = bench_now();
        if ((c->sdt == FW_BF16 ? fw_gdn_decode_pool(&B.tq, &B.tk, &B.tv, &B.tg, &B.tb, &pool, &B.to, &p)
                               : fw_gdn_decode(&B.tq, &B.tk, &B.tv, &B.tg, &B.tb, B.st, N, idx, &B.to, &p)) != FW_OK) {
            fprintf(stderr, "bench gdn: %s\n", fw_last_error());
            free(idx);
            unmake(&B);
            return 1;
        }
        if (i >= 0)
            t[i] = bench_now() - t0;
    }
    const double s = bench_median(t, reps);
    const double bytes = 2.0 * (double)N * (double)c->HV * (double)c->dk * (double)c->dv * (c->sdt == FW_BF16 ? 2.0 : 4.0);
    double bw = 0;
    fw_read_bandwidth(c->threads, (size_t)1 << 30, &bw);
    if (c->json)
        printf("{\"op\":\"%s_decode\",\"state\":\"%s\",\"seqs\":%lld,\"HV\":%lld,\"dk\":%lld,\"dv\":%lld,\"threads\":%d,"
               "\"seconds_median\":%.6g,\"us_per_step\":%.2f,\"state_gbps\":%.2f,\"read_bw_gbps\":%.2f,\"pct_bw\":%.1f}\n",
               c->kda ? "kda" : "gdn", fw_dtype_name(c->sdt), (long long)N, (long long)c->HV, (long long)c->dk,
               (long long)c->dv, c->threads, s, s * 1e6, bytes / s * 1e-9, bw, 100 * bytes / s * 1e-9 / bw);
    else
        printf("%s decode  %lld seqs x %lld heads (%.0f MiB %s state) thr=%d  %9.1f us/step  %6.1f GB/s state moved  "
               "%5.1f%% of %.1f GB/s read bandwidth\n",
               c->kda ? "kda" : "gdn", (long long)N, (long long)c->HV, bytes / 2 / 1048576.0, fw_dtype_name(c->sdt), c->threads, s * 1e6, bytes / s * 1e-9,
               100 * bytes / s * 1e-9 / bw, bw);
    fflush(stdout);
    free(idx);
    unmake(&B);
    return 0;
}


static gcfg gdefaults(void)
{
    gcfg c = {4096, 16, 32, 128, 128, 1, FW_BF16, 0, 5, 0, 1, NULL, FW_PREC_AUTO, 0, FW_F32};
    c.threads = bench_cpus();
    return c;
}

int bench_gdn_main(int argc, char **argv)
{
    gcfg c = gdefaults();
    int mode = 0; /* 0: the sweep, 1: prefill, 2: decode */
    int64_t N = 64;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
#define OPT(name) bench_opt(argc, argv, &i, name)
#define INT(name, lo, hi) bench_int(name, argv[i], lo, hi)
        if (OPT("--t")) c.T = INT("--t", 1, 1 << 24);
        else if (OPT("--seqs")) c.nseq = N = INT("--seqs", 1, 1 << 20);
        else if (OPT("--h")) c.H = INT("--h", 1, 65536);
        else if (OPT("--hv")) c.HV = INT("--hv", 1, 65536);
        else if (OPT("--dk")) c.dk = INT("--dk", 1, 1024);
        else if (OPT("--dv")) c.dv = INT("--dv", 1, 1024);
        else if (OPT("--threads")) c.threads = (int)INT("--threads", 0, 256), c.threads = c.threads ? c.threads : bench_cpus();
        else if (OPT("--reps")) c.reps = (int)INT("--reps", 1, 100000);
        else if (OPT("--isa")) c.isa = argv[i];
        else if (OPT("--dtype")) {
            if (!bench_dtype(argv[i], &c.dt)) { fprintf(stderr, "flywheel: unknown dtype %s\n", argv[i]); return 2; }
        } else if (OPT("--state")) {
            if (!bench_dtype(argv[i], &c.sdt) || c.sdt == FW_F16) { fprintf(stderr, "flywheel: --state f32|bf16, not %s\n", argv[i]); return 2; }
        } else if (OPT("--precision")) {
            if (!bench_precision(argv[i], &c.prec)) { fprintf(stderr, "flywheel: unknown precision %s\n", argv[i]); return 2; }
        }
        else if (!strcmp(a, "--prefill")) mode = 1;
        else if (!strcmp(a, "--decode")) mode = 2;
        else if (!strcmp(a, "--no-baselines")) c.baselines = 0;
        else if (!strcmp(a, "--json")) c.json = 1;
        else if (!strcmp(a, "--kda")) c.kda = 1;
        else {
            if (!bench_is_help(a))
                fprintf(stderr, "flywheel: unknown option %s\n", a);
            printf("usage: flywheel bench gdn [--prefill | --decode] [--t T --seqs N --h H --hv HV --dk D --dv D\n"
                   "       --dtype f32|bf16|f16 --precision auto|f32|bf16 --threads N --reps N --isa NAME\n"
                   "       --state f32|bf16 --no-baselines --kda --json]\n"
                   "  with neither: prefill at T = 1K, 4K, 16K (one sequence, then a 4-sequence varlen batch)\n"
                   "  with the recurrent baselines, then decode for 1 and 64 sequences\n"
                   "  --kda: KDA (a decay per key channel); --state: the decode's states (bf16: a bf16 pool)\n");
            return bench_is_help(a) ? 0 : 2;
        }
#undef INT
#undef OPT
    }
    if (mode == 1)
        return run_prefill(&c);
    if (mode == 2)
        return run_decode(&c, N);
    int fail = 0;
    static const int64_t Ts[] = {1024, 4096, 16384};
    for (int i = 0; i < 3; i++) {
        gcfg p = c;
        p.T = Ts[i];
        p.nseq = 1;
        p.baselines = c.baselines && Ts[i] <= 4096; /* the 4-pass baseline at 16K takes minutes */
        fail |= run_prefill(&p);
    }
    gcfg vb = c;
    vb.T = 4096;
    vb.nseq = 4;
    vb.baselines = 0;
    fail |= run_prefill(&vb);
    fail |= run_decode(&c, 1);
    fail |= run_decode(&c, 64);
    return fail;
}

/* `make run`: GDN prefill at T = 4K with the recurrent baselines, decode for 64 sequences, and
 * KDA prefill at T = 4K on Kimi Linear's shapes (32 q/k and value heads); json: one object a
 * line. */
int bench_gdn_headline(int json, int small)
{
    gcfg c = gdefaults();
    const int s = small ? 4 : 1;
    c.json = json;
    c.T = small ? 256 : 4096;
    c.H /= s;
    c.HV /= s;
    c.reps = small ? 1 : c.reps;
    int fail = run_prefill(&c);
    fail |= run_decode(&c, 64 / (s * s));
    gcfg k = c;
    k.kda = 1;
    k.H = k.HV = 32 / s;
    return fail | run_prefill(&k);
}
