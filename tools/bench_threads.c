/*
 * bench_threads.c: `flywheel bench threads`, the latency of the library's parallel loop
 * (fw_parallel, on the built-in pool, or on OpenMP in an FW_OPENMP build) for a small job:
 * back to back, and as the first calls after idle gaps. Each item is a fixed amount of
 * arithmetic, calibrated to --item-us on one thread, and records when it started and on which
 * worker, so a slow call shows whether its workers started late (waking up) or its items
 * ran slowly (clock frequency, a shared core).
 */
#define _GNU_SOURCE 1 /* sched_getcpu */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "bench.h"
#include "commands.h"
#include "internal.h"

#define BT_MAX_ITEMS 256
#define BT_MAX_GAPS 16

typedef struct {
    int64_t iters; /* per item */
    double start[BT_MAX_ITEMS], end[BT_MAX_ITEMS];
    int tid[BT_MAX_ITEMS], cpu[BT_MAX_ITEMS];
    volatile uint64_t sink[BT_MAX_ITEMS];
} bt_ctx;

/* a dependent chain of multiply-adds: the same time on any worker, no memory traffic */
static uint64_t work(int64_t iters, uint64_t x)
{
    for (int64_t i = 0; i < iters; i++)
        x = x * 6364136223846793005u + 1442695040888963407u;
    return x;
}

/* the CPU this thread runs on; -1 where that cannot be asked */
static int bt_cpu(void)
{
#ifdef __linux__
    return sched_getcpu();
#else
    return -1;
#endif
}

static void bt_item(void *ctx, int64_t item, int tid)
{
    bt_ctx *c = ctx;
    c->start[item] = bench_now();
    c->sink[item] = work(c->iters, (uint64_t)item);
    c->end[item] = bench_now();
    c->tid[item] = tid;
    c->cpu[item] = bt_cpu();
}

typedef struct {
    double call;   /* us, the whole fw_parallel */
    double worker; /* us from the call to the first item on a worker other than the caller;
                      -1 if the caller ran every item */
    double item;   /* us, the longest item */
    int one_cpu;   /* a worker other than the caller ran items, but every item ran on the
                      CPU the caller was on when it called */
} bt_call;

static bt_call timed_call(bt_ctx *c, int threads, int items)
{
    const int caller_cpu = bt_cpu();
    const double t0 = bench_now();
    fw_parallel(threads, items, bt_item, c);
    const double t1 = bench_now();
    bt_call r = {(t1 - t0) * 1e6, -1, 0, 1};
    for (int i = 0; i < items; i++) {
        r.one_cpu &= c->cpu[i] == caller_cpu;
        if (c->tid[i] != 0 && (r.worker < 0 || (c->start[i] - t0) * 1e6 < r.worker))
            r.worker = (c->start[i] - t0) * 1e6;
        if ((c->end[i] - c->start[i]) * 1e6 > r.item)
            r.item = (c->end[i] - c->start[i]) * 1e6;
    }
    r.one_cpu &= r.worker >= 0 && caller_cpu >= 0;
    return r;
}

/* iterations of work() per microsecond on this thread, after a 50 ms warm-up */
static double calibrate(void)
{
    uint64_t x = work(1000, 1);
    const double w0 = bench_now();
    while (bench_now() - w0 < 0.05)
        x = work(100000, x);
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        const double t0 = bench_now();
        x = work(1000000, x);
        const double t = bench_now() - t0;
        best = t < best ? t : best;
    }
    volatile uint64_t sink = x;
    (void)sink;
    return 1000000 / (best * 1e6); /* a million iterations in `best` seconds */
}

static double median_of(const double *x, int n)
{
    double tmp[512];
    memcpy(tmp, x, sizeof(double) * (size_t)n);
    return bench_median(tmp, n);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: flywheel bench threads [--threads N] [--items N] [--item-us U] [--calls N]\n"
            "                              [--gaps S,S,...] [--reps N] [--spin-us U]\n"
            "  The latency of the library's parallel loop for a small job: --items items of about\n"
            "  --item-us microseconds of arithmetic on --threads threads (2, 2, 30), back to back\n"
            "  (200 calls), then --calls calls (20) after each idle gap in seconds (0.001,0.01,0.1,1,3),\n"
            "  --reps times each (3). --spin-us sets the pool's spin window (fw_set_spin_us; default:\n"
            "  FLYWHEEL_SPIN_US or 200). Per gap: the first call, when its first worker started and\n"
            "  its longest item (medians over the reps), in how many calls a worker ran items on the\n"
            "  caller's CPU, and how many calls passed before 3 in a row were within 1.25x of the\n"
            "  back-to-back median. Needs a quiet machine.\n");
}

int bench_threads_main(int argc, char **argv)
{
    int threads = 2, items = 2, calls = 20, reps = 3, ngaps = 5;
    double item_us = 30, gaps[BT_MAX_GAPS] = {0.001, 0.01, 0.1, 1, 3};
    for (int i = 0; i < argc; i++) {
        if (bench_is_help(argv[i])) {
            usage(stdout);
            return 0;
        } else if (bench_opt(argc, argv, &i, "--threads")) {
            threads = (int)bench_int("--threads", argv[i], 1, FW_MAX_THREADS);
        } else if (bench_opt(argc, argv, &i, "--items")) {
            items = (int)bench_int("--items", argv[i], 1, BT_MAX_ITEMS);
        } else if (bench_opt(argc, argv, &i, "--item-us")) {
            item_us = bench_real("--item-us", argv[i], 0.1, 100000);
        } else if (bench_opt(argc, argv, &i, "--calls")) {
            calls = (int)bench_int("--calls", argv[i], 5, 500);
        } else if (bench_opt(argc, argv, &i, "--reps")) {
            reps = (int)bench_int("--reps", argv[i], 1, 100);
        } else if (bench_opt(argc, argv, &i, "--spin-us")) {
            if (fw_set_spin_us((int32_t)bench_int("--spin-us", argv[i], 0, FW_MAX_SPIN_US)) != FW_OK)
                return 2;
        } else if (bench_opt(argc, argv, &i, "--gaps")) {
            char *list = strdup(argv[i]), *save = NULL;
            ngaps = 0;
            for (char *g = strtok_r(list, ",", &save); g; g = strtok_r(NULL, ",", &save)) {
                if (ngaps == BT_MAX_GAPS) {
                    fprintf(stderr, "flywheel: --gaps: at most %d gaps\n", BT_MAX_GAPS);
                    return 2;
                }
                gaps[ngaps++] = bench_real("--gaps", g, 0, 60);
            }
            free(list);
            if (!ngaps) {
                fprintf(stderr, "flywheel: --gaps: no gap given\n");
                return 2;
            }
        } else {
            usage(stderr);
            fprintf(stderr, "flywheel: bench threads: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    bt_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return 1;
    const double per_us = calibrate();
    c->iters = (int64_t)(item_us * per_us);
#ifdef FW_OPENMP
    const char *loop = "OpenMP (FW_OPENMP build)";
#else
    const char *loop = "the built-in pool";
#endif
    printf("fw_parallel on %s: %d thread(s), %d item(s) of %.1f us (%lld iterations), spin window "
           "%d us\n", loop, threads, items, item_us, (long long)c->iters, (int)fw_get_spin_us());

    /* back to back: the steady state */
    enum { WARM = 50, STEADY = 200 };
    double lat[STEADY], wk[STEADY], it[STEADY];
    int nwk = 0, none = 0;
    for (int i = 0; i < WARM; i++)
        timed_call(c, threads, items);
    for (int i = 0; i < STEADY; i++) {
        const bt_call r = timed_call(c, threads, items);
        lat[i] = r.call;
        it[i] = r.item;
        none += r.one_cpu;
        if (r.worker >= 0)
            wk[nwk++] = r.worker;
    }
    const double steady = median_of(lat, STEADY);
    double sorted[STEADY];
    memcpy(sorted, lat, sizeof lat);
    bench_median(sorted, STEADY); /* sorts */
    printf("back to back, %d calls: median %.1f us, p90 %.1f us; longest item %.1f us (median); a worker\n"
           "ran items in %d calls, starting %.1f us into the call (median), and in %d of them on the\n"
           "caller's CPU\n",
           STEADY, steady, sorted[STEADY * 9 / 10], median_of(it, STEADY), nwk,
           nwk ? median_of(wk, nwk) : -1.0, none);

    printf("after idle: medians over %d reps of the first call; \"one CPU\": calls of the %d after the gap\n"
           "(all reps) in which a worker ran items on the caller's CPU\n", reps, calls);
    printf("%10s %12s %14s %14s %8s %16s   %s\n", "idle gap", "first call", "worker start",
           "longest item", "one CPU", "calls to steady", "calls 2-5, last rep (us)");
    for (int g = 0; g < ngaps; g++) {
        double first[100], fwk[100], fit[100], tosteady[100], run[500];
        int nfwk = 0, ngone = 0;
        for (int r = 0; r < reps; r++) {
            const double s = gaps[g];
            nanosleep(&(struct timespec){(time_t)s, (long)((s - (double)(time_t)s) * 1e9)}, NULL);
            for (int i = 0; i < calls; i++) {
                const bt_call k = timed_call(c, threads, items);
                run[i] = k.call;
                ngone += k.one_cpu;
                if (i == 0) {
                    first[r] = k.call;
                    fit[r] = k.item;
                    if (k.worker >= 0)
                        fwk[nfwk++] = k.worker;
                }
            }
            int n = calls; /* not steady within the run: all of them */
            for (int i = 0; i + 2 < calls; i++)
                if (run[i] <= 1.25 * steady && run[i + 1] <= 1.25 * steady && run[i + 2] <= 1.25 * steady) {
                    n = i;
                    break;
                }
            tosteady[r] = n;
        }
        char wbuf[32];
        if (nfwk)
            snprintf(wbuf, sizeof wbuf, "%.1f us", median_of(fwk, nfwk));
        else
            snprintf(wbuf, sizeof wbuf, "none");
        printf("%9gs %9.1f us %14s %11.1f us %8d %16.0f   %.0f %.0f %.0f %.0f\n", gaps[g],
               median_of(first, reps), wbuf, median_of(fit, reps), ngone, median_of(tosteady, reps),
               run[1], run[2], run[3], run[4]);
    }
    printf("worker start: from the call to the first item a worker other than the caller ran "
           "(\"none\": the caller ran every item)\n");
    free(c);
    return 0;
}
