/*
 * test_threads.c: where the parallel loops run. fw_parallel on the built-in pool (spinning and
 * not), on host loops that run their tasks one after another, in reverse, or on pthreads at
 * once, and on OpenMP in an FW_OPENMP build: every item once, no two at once with one tid.
 * Attention (dense, decode with split merge) and Gated DeltaNet (prefill, decode) give the
 * built-in pool's bits on every host loop; the setting switches back and forth while calls
 * run; bad arguments change nothing.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "internal.h"
#include "test_util.h"
#ifdef FW_OPENMP
#include <omp.h>
#endif

/* ---------------------------------------------------------- host loops -- */

typedef struct {
    atomic_int calls;
    atomic_llong last_ntasks;
} host_log;

static void host_seen(void *host, int64_t ntasks)
{
    host_log *h = host;
    atomic_fetch_add(&h->calls, 1);
    atomic_store(&h->last_ntasks, ntasks);
}

/* (a) every task on the calling thread, in order */
static void host_serial(void *host, int64_t ntasks, fw_task_fn task, void *arg)
{
    host_seen(host, ntasks);
    for (int64_t t = 0; t < ntasks; t++)
        task(arg, t);
}

/* (c) the same, last task first */
static void host_reverse(void *host, int64_t ntasks, fw_task_fn task, void *arg)
{
    host_seen(host, ntasks);
    for (int64_t t = ntasks - 1; t >= 0; t--)
        task(arg, t);
}

/* (b) task 0 on the caller, every other on a thread of its own, all at once */
typedef struct {
    fw_task_fn task;
    void *arg;
    int64_t t;
} host_job;

static void *host_thread(void *x)
{
    host_job *j = x;
    j->task(j->arg, j->t);
    return NULL;
}

static void host_pthreads(void *host, int64_t ntasks, fw_task_fn task, void *arg)
{
    host_seen(host, ntasks);
    pthread_t th[FW_MAX_THREADS]; /* ntasks <= the thread count of a call */
    host_job jobs[FW_MAX_THREADS];
    int started[FW_MAX_THREADS] = {0};
    for (int64_t t = 1; t < ntasks; t++) {
        jobs[t] = (host_job){task, arg, t};
        started[t] = pthread_create(&th[t], NULL, host_thread, &jobs[t]) == 0;
        if (!started[t])
            task(arg, t);
    }
    task(arg, 0);
    for (int64_t t = 1; t < ntasks; t++)
        if (started[t])
            pthread_join(th[t], NULL);
}

typedef struct {
    const char *name;
    fw_parallel_fn fn; /* NULL: the built-in threads */
} loop_kind;

static const loop_kind loops[] = {
    {"built-in", NULL}, {"host serial", host_serial}, {"host reverse", host_reverse},
    {"host pthreads", host_pthreads}};
#define NLOOPS (int)(sizeof loops / sizeof loops[0])

static void busy_us(double us)
{
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    do
        clock_gettime(CLOCK_MONOTONIC, &b);
    while ((double)(b.tv_sec - a.tv_sec) * 1e6 + (double)(b.tv_nsec - a.tv_nsec) * 1e-3 < us);
}

/* --------------------------------------------------------- fw_parallel -- */

#define LOOP_MAX_ITEMS 200

typedef struct {
    int threads;
    atomic_int runs[LOOP_MAX_ITEMS];
    atomic_int in_use[FW_MAX_THREADS];
    atomic_int bad_tid, overlap;
} loop_ctx;

static void loop_item(void *ctx, int64_t item, int tid)
{
    loop_ctx *c = ctx;
    if (tid < 0 || tid >= c->threads) {
        atomic_fetch_add(&c->bad_tid, 1);
        return;
    }
    if (atomic_exchange(&c->in_use[tid], 1))
        atomic_fetch_add(&c->overlap, 1);
    atomic_fetch_add(&c->runs[item], 1);
    busy_us(item % 3 == 0 ? 20 : 2);
    atomic_store(&c->in_use[tid], 0);
}

/* Every item exactly once, each tid below min(threads, n) and never on two items at once;
 * the host loop is called once with min(threads, n) tasks when that is 2 or more. */
static void test_loop(void)
{
    static const int threads[] = {1, 2, 3, 8};
    static const int64_t items[] = {0, 1, 2, 7, LOOP_MAX_ITEMS};
    loop_ctx *c = malloc(sizeof *c);
    const int32_t spin0 = fw_get_spin_us();
    for (int l = 0; l < NLOOPS; l++)
        for (int spin = 0; spin < 2; spin++) {
            if (spin && loops[l].fn)
                continue; /* the spin window is the built-in pool's */
            case_begin("fw_parallel on %s%s: every item once, tids in range", loops[l].name,
                       loops[l].fn ? "" : spin ? ", spin 200 us" : ", spin 0");
            host_log h = {0, 0};
            case_check(fw_set_parallel(loops[l].fn, loops[l].fn ? &h : NULL, 0) == FW_OK, "set: %s",
                       fw_last_error());
            case_check(fw_set_spin_us(spin ? 200 : 0) == FW_OK, "fw_set_spin_us");
            for (size_t ti = 0; ti < sizeof threads / sizeof threads[0]; ti++)
                for (size_t ni = 0; ni < sizeof items / sizeof items[0]; ni++) {
                    const int th = threads[ti];
                    const int64_t n = items[ni];
                    memset(c, 0, sizeof *c);
                    c->threads = (int)(th < n ? th : n);
                    const int before = atomic_load(&h.calls);
                    fw_parallel(th, n, loop_item, c);
                    for (int64_t i = 0; i < n; i++)
                        case_check(atomic_load(&c->runs[i]) == 1, "%d threads, %lld items: item %lld ran %d times",
                                   th, (long long)n, (long long)i, atomic_load(&c->runs[i]));
                    case_check(!atomic_load(&c->bad_tid) && !atomic_load(&c->overlap),
                               "%d threads, %lld items: %d tids out of range, %d overlaps", th,
                               (long long)n, atomic_load(&c->bad_tid), atomic_load(&c->overlap));
                    const int want_calls = loops[l].fn && c->threads >= 2;
                    case_check(atomic_load(&h.calls) - before == want_calls &&
                                   (!want_calls || atomic_load(&h.last_ntasks) == c->threads),
                               "%d threads, %lld items: the host loop ran %d times, last with %lld tasks",
                               th, (long long)n, atomic_load(&h.calls) - before,
                               (long long)atomic_load(&h.last_ntasks));
                }
            case_check(fw_set_parallel(NULL, NULL, 0) == FW_OK, "reset");
            case_check(fw_set_spin_us(spin0) == FW_OK, "restore the spin window");
            case_end();
        }
    free(c);
}

/* ------------------------------------------------------------ problems -- */

/* Attention (dense causal bf16 with GQA; a decode row over 1500 keys: three 512-key splits
 * and their merge) and Gated DeltaNet (varlen prefill, decode), run into one byte string. */
typedef struct {
    fw_tensor q, k, v, dq, dk, dv;                       /* attention, dense and decode */
    fw_tensor gq, gk, gv, gg, gb, eq, ek, ev, eg, eb;    /* GDN prefill, decode */
    int32_t cu[3];
    float *state0; /* decode slots, as given */
    int64_t state_floats;
    int32_t idx[3];
    size_t bytes; /* of the outputs, states included */
    void *mem[17]; /* the 16 tensors' data and state0 */
    int nmem;
} problems;

static fw_tensor mk(problems *P, fw_dtype dt, int nd, int64_t a, int64_t b, int64_t c, int64_t d)
{
    const int64_t s[4] = {a, b, c, d};
    int64_t n = 1;
    for (int i = 0; i < nd; i++)
        n *= s[i];
    void *p = malloc((size_t)n * fw_dtype_size(dt));
    P->mem[P->nmem++] = p;
    fw_tensor t = fw_tensor_contiguous(p, dt, nd, s);
    tfill_normal(&t, 1.0);
    return t;
}

static size_t nbytes(const fw_tensor *t)
{
    size_t n = fw_dtype_size(t->dtype);
    for (int i = 0; i < t->ndim; i++)
        n *= (size_t)t->shape[i];
    return n;
}

/* gates g <= 0 and beta in (0, 1) */
static void gates(fw_tensor *g, fw_tensor *b)
{
    const size_t n = nbytes(g) / 4;
    for (size_t i = 0; i < n; i++) {
        ((float *)g->data)[i] = -0.1f * (float)rng_uniform();
        ((float *)b->data)[i] = 0.1f + 0.8f * (float)rng_uniform();
    }
}

static void problems_make(problems *P)
{
    memset(P, 0, sizeof *P);
    rng_seed(77);
    P->q = mk(P, FW_BF16, 4, 2, 150, 8, 64);
    P->k = mk(P, FW_BF16, 4, 2, 170, 2, 64);
    P->v = mk(P, FW_BF16, 4, 2, 170, 2, 64);
    P->dq = mk(P, FW_F32, 4, 1, 1, 8, 64);
    P->dk = mk(P, FW_F32, 4, 1, 1500, 2, 64);
    P->dv = mk(P, FW_F32, 4, 1, 1500, 2, 64);
    const int64_t T = 230, H = 2, HV = 4, D = 32;
    P->cu[0] = 0; P->cu[1] = 100; P->cu[2] = (int32_t)T;
    P->gq = mk(P, FW_BF16, 3, T, H, D, 1);
    P->gk = mk(P, FW_BF16, 3, T, H, D, 1);
    P->gv = mk(P, FW_BF16, 3, T, HV, D, 1);
    P->gg = mk(P, FW_F32, 2, T, HV, 1, 1);
    P->gb = mk(P, FW_F32, 2, T, HV, 1, 1);
    gates(&P->gg, &P->gb);
    P->eq = mk(P, FW_F32, 3, 3, H, D, 1);
    P->ek = mk(P, FW_F32, 3, 3, H, D, 1);
    P->ev = mk(P, FW_F32, 3, 3, HV, D, 1);
    P->eg = mk(P, FW_F32, 2, 3, HV, 1, 1);
    P->eb = mk(P, FW_F32, 2, 3, HV, 1, 1);
    gates(&P->eg, &P->eb);
    P->state_floats = 4 * HV * D * D;
    P->state0 = malloc(sizeof(float) * (size_t)P->state_floats);
    P->mem[P->nmem++] = P->state0;
    for (int64_t i = 0; i < P->state_floats; i++)
        P->state0[i] = (float)(0.1 * rng_normal());
    P->idx[0] = 2; P->idx[1] = 0; P->idx[2] = 3;
    P->bytes = 2 * 150 * 8 * 64 * 2 + 8 * 150 * 2 * 4 /* dense out, lse */ + 8 * 64 * 4 + 8 * 4 /* decode */
               + T * HV * D * 4 + 2 * HV * D * D * 4 /* prefill out, final states */
               + 3 * HV * D * 4 + P->state_floats * 4; /* decode out, slots */
}

static void problems_free(problems *P)
{
    for (int i = 0; i < P->nmem; i++)
        free(P->mem[i]);
}

/* Every problem on `threads` threads (0: the default), outputs into dst (P->bytes). */
static fw_status problems_run(const problems *P, int threads, unsigned char *dst)
{
    fw_attn_params ap;
    fw_attn_params_init(&ap);
    ap.causal = 1;
    ap.threads = threads;
    fw_gdn_params gp;
    fw_gdn_params_init(&gp);
    gp.l2norm_qk = 1;
    gp.threads = threads;
    unsigned char *p = dst;
    int64_t s4[4] = {2, 150, 8, 64}, sl[3] = {2, 8, 150};
    fw_tensor o = fw_tensor_contiguous(p, FW_BF16, 4, s4);
    p += nbytes(&o);
    fw_tensor l = fw_tensor_contiguous(p, FW_F32, 3, sl);
    p += nbytes(&l);
    fw_status st = fw_attn_fwd(&P->q, &P->k, &P->v, &o, &l, &ap);
    int64_t d4[4] = {1, 1, 8, 64}, dl[3] = {1, 8, 1};
    o = fw_tensor_contiguous(p, FW_F32, 4, d4);
    p += nbytes(&o);
    l = fw_tensor_contiguous(p, FW_F32, 3, dl);
    p += nbytes(&l);
    ap.causal = 0;
    if (!st)
        st = fw_attn_fwd(&P->dq, &P->dk, &P->dv, &o, &l, &ap);
    const int64_t HV = P->gv.shape[1], D = P->gv.shape[2];
    int64_t go[3] = {P->gv.shape[0], HV, D};
    o = fw_tensor_contiguous(p, FW_F32, 3, go);
    p += nbytes(&o);
    float *fin = (float *)p;
    p += (size_t)(2 * HV * D * D) * 4;
    if (!st)
        st = fw_gdn_prefill(&P->gq, &P->gk, &P->gv, &P->gg, &P->gb, P->cu, 2, NULL, fin, &o, &gp);
    int64_t eo[3] = {3, HV, D};
    o = fw_tensor_contiguous(p, FW_F32, 3, eo);
    p += nbytes(&o);
    float *state = (float *)p;
    memcpy(state, P->state0, sizeof(float) * (size_t)P->state_floats);
    p += sizeof(float) * (size_t)P->state_floats;
    if (!st)
        st = fw_gdn_decode(&P->eq, &P->ek, &P->ev, &P->eg, &P->eb, state, 4, P->idx, &o, &gp);
    if ((size_t)(p - dst) != P->bytes)
        return FW_ERR_SHAPE; /* the test's own sizes are wrong */
    return st;
}

/* Each problem on each loop, with 2 and 3 threads and with threads = 0 (the setting's 3),
 * gives the bits of the built-in pool on 3 threads. */
static void test_host_identical(void)
{
    problems P;
    problems_make(&P);
    unsigned char *want = malloc(P.bytes), *got = malloc(P.bytes);
    case_begin("reference: the built-in pool, 3 threads");
    case_check(problems_run(&P, 3, want) == FW_OK, "status: %s", fw_last_error());
    case_end();
    for (int l = 0; l < NLOOPS; l++) {
        case_begin("attention and GDN on %s: the built-in pool's bits", loops[l].name);
        host_log h = {0, 0};
        case_check(fw_set_parallel(loops[l].fn, loops[l].fn ? &h : NULL, 3) == FW_OK, "set: %s",
                   fw_last_error());
        for (int th = 0; th <= 3; th++) {
            if (th == 1)
                continue;
            memset(got, 0xAB, P.bytes);
            const fw_status st = problems_run(&P, th, got);
            case_check(st == FW_OK, "%d threads: status %d, %s", th, st, fw_last_error());
            case_check(memcmp(want, got, P.bytes) == 0, "%d threads: the outputs differ", th);
        }
        case_check(!loops[l].fn || atomic_load(&h.calls) > 0, "the host loop never ran");
        case_check(fw_set_parallel(NULL, NULL, 0) == FW_OK, "reset");
        case_end();
    }
    free(want);
    free(got);
    problems_free(&P);
}

/* ------------------------------------------------------------- setting -- */

typedef struct {
    const problems *P;
    unsigned char *got; /* one output string per item */
    atomic_int bad;
} nested_ctx;

static void nested_item(void *ctx, int64_t item, int tid)
{
    nested_ctx *c = ctx;
    if (problems_run(c->P, 2, c->got + (size_t)item * c->P->bytes) != FW_OK)
        atomic_fetch_add(&c->bad, 1);
    (void)tid;
}

/* Setting, querying and resetting; threads = 1 never reaches the host; a library call from
 * inside a host task (a nested loop) works. */
static void test_setting(void)
{
    host_log h = {0, 0};
    fw_parallel_fn fn;
    void *host;
    int32_t threads;
    case_begin("set, get, reset");
    case_check(fw_get_parallel(&fn, &host, &threads) == FW_OK && !fn && !host && threads == 0,
               "the setting is not NULL, NULL, 0 at the start");
    case_check(fw_set_parallel(host_serial, &h, 5) == FW_OK, "set: %s", fw_last_error());
    case_check(fw_get_parallel(&fn, &host, &threads) == FW_OK && fn == host_serial && host == &h &&
                   threads == 5, "get after set");
    case_check(fw_threads(0) == 5 && fw_threads(2) == 2, "fw_threads(0) is %d", fw_threads(0));
    loop_ctx *c = calloc(1, sizeof *c);
    c->threads = 1;
    fw_parallel(1, 10, loop_item, c);
    case_check(atomic_load(&h.calls) == 0, "a 1-thread loop called the host");
    c->threads = 5;
    fw_parallel(fw_threads(0), 10, loop_item, c);
    case_check(atomic_load(&h.calls) == 1 && atomic_load(&h.last_ntasks) == 5,
               "host: %d calls, %lld tasks", atomic_load(&h.calls),
               (long long)atomic_load(&h.last_ntasks));
    case_check(fw_set_parallel(NULL, NULL, 0) == FW_OK, "reset: %s", fw_last_error());
    case_check(fw_get_parallel(&fn, &host, &threads) == FW_OK && !fn && !host && threads == 0,
               "get after reset");
    memset(c, 0, sizeof *c);
    c->threads = 2;
    fw_parallel(2, 10, loop_item, c);
    case_check(atomic_load(&h.calls) == 1, "the host ran after the reset");
    case_check(fw_set_parallel(NULL, NULL, 2) == FW_OK && fw_threads(0) == 2,
               "a default thread count without a host loop");
    case_check(fw_set_parallel(NULL, NULL, 0) == FW_OK, "reset");
    free(c);
    case_end();

    case_begin("library calls inside host tasks");
    problems P;
    problems_make(&P);
    unsigned char *want = malloc(P.bytes);
    nested_ctx n = {&P, malloc(2 * P.bytes), 0};
    case_check(problems_run(&P, 2, want) == FW_OK, "reference: %s", fw_last_error());
    case_check(fw_set_parallel(host_pthreads, &h, 0) == FW_OK, "set");
    /* two outer items, each every problem on 2 threads, through the host loop again */
    fw_parallel(2, 2, nested_item, &n);
    case_check(!atomic_load(&n.bad), "a nested call failed");
    case_check(memcmp(want, n.got, P.bytes) == 0 && memcmp(want, n.got + P.bytes, P.bytes) == 0,
               "nested outputs differ");
    case_check(fw_set_parallel(NULL, NULL, 0) == FW_OK, "reset");
    free(want);
    free(n.got);
    problems_free(&P);
    case_end();
}

/* Calls keep running while another thread switches between a host loop and the built-in
 * threads: each call finishes on the loop it started with, with the same bits (and no data
 * race under ThreadSanitizer). */
typedef struct {
    const problems *P;
    const unsigned char *want;
    atomic_int done, bad;
} switch_ctx;

static void *switch_caller(void *x)
{
    switch_ctx *c = x;
    unsigned char *got = malloc(c->P->bytes);
    for (int r = 0; r < (quick_mode() ? 4 : 10); r++)
        if (problems_run(c->P, 2 + r % 2, got) != FW_OK || memcmp(got, c->want, c->P->bytes))
            atomic_fetch_add(&c->bad, 1);
    free(got);
    atomic_store(&c->done, 1);
    return NULL;
}

static void test_switch_in_flight(void)
{
    problems P;
    problems_make(&P);
    unsigned char *want = malloc(P.bytes);
    case_begin("switching the loop while calls run");
    case_check(problems_run(&P, 3, want) == FW_OK, "reference: %s", fw_last_error());
    switch_ctx c = {&P, want, 0, 0};
    host_log h = {0, 0};
    pthread_t th;
    case_check(pthread_create(&th, NULL, switch_caller, &c) == 0, "pthread_create");
    int switches = 0;
    while (!atomic_load(&c.done)) {
        const loop_kind *k = &loops[1 + switches % (NLOOPS - 1)];
        fw_set_parallel(switches % 2 ? NULL : k->fn, switches % 2 ? NULL : &h, 0);
        switches++;
        busy_us(100);
    }
    pthread_join(th, NULL);
    case_check(!atomic_load(&c.bad), "%d of the calls failed or differed", atomic_load(&c.bad));
    case_check(fw_set_parallel(NULL, NULL, 0) == FW_OK, "reset");
    case_end();
    free(want);
    problems_free(&P);
}

/* Bad arguments: a status, a message, and the setting unchanged. */
static void test_bad_args(void)
{
    host_log h = {0, 0};
    fw_parallel_fn fn;
    void *host;
    int32_t threads;
    case_begin("bad arguments change nothing");
    case_check(fw_set_parallel(host_serial, &h, 4) == FW_OK, "set");
    case_check(fw_set_parallel(NULL, &h, 0) == FW_ERR_ARG && *fw_last_error(), "a host without fn");
    case_check(fw_set_parallel(host_reverse, &h, -1) == FW_ERR_ARG, "threads -1");
    case_check(fw_set_parallel(host_reverse, &h, FW_MAX_THREADS + 1) == FW_ERR_ARG, "threads 257");
    case_check(fw_get_parallel(&fn, &host, &threads) == FW_OK && fn == host_serial && host == &h &&
                   threads == 4, "the setting changed");
    case_check(fw_get_parallel(NULL, &host, &threads) == FW_ERR_NULL, "fn NULL");
    case_check(fw_get_parallel(&fn, NULL, &threads) == FW_ERR_NULL, "host NULL");
    case_check(fw_get_parallel(&fn, &host, NULL) == FW_ERR_NULL, "threads NULL");
    case_check(fw_set_parallel(NULL, NULL, 0) == FW_OK, "reset");
    const int32_t spin = fw_get_spin_us();
    case_check(fw_set_spin_us(-1) == FW_ERR_ARG && fw_set_spin_us(FW_MAX_SPIN_US + 1) == FW_ERR_ARG,
               "spin windows -1 and FW_MAX_SPIN_US + 1");
    case_check(fw_get_spin_us() == spin, "the spin window changed");
    case_check(fw_set_spin_us(FW_MAX_SPIN_US) == FW_OK && fw_get_spin_us() == FW_MAX_SPIN_US &&
                   fw_set_spin_us(spin) == FW_OK, "spin window FW_MAX_SPIN_US");
    case_end();
}

/* The built-in pool with workers that never spin (every call wakes them) and after idle
 * gaps longer than the window (they sleep between calls): the same bits. */
static void test_spin(void)
{
    problems P;
    problems_make(&P);
    unsigned char *want = malloc(P.bytes), *got = malloc(P.bytes);
    const int32_t spin = fw_get_spin_us();
    case_begin("the pool with spin windows 0 and 50 us, calls after idle gaps");
    case_check(problems_run(&P, 3, want) == FW_OK, "reference: %s", fw_last_error());
    for (int r = 0; r < 8; r++) {
        case_check(fw_set_spin_us(r % 2 ? 50 : 0) == FW_OK, "fw_set_spin_us");
        if (r >= 4)
            nanosleep(&(struct timespec){0, 2000000}, NULL); /* 2 ms: past the window */
        const fw_status st = problems_run(&P, 2 + r % 3, got);
        case_check(st == FW_OK && memcmp(want, got, P.bytes) == 0, "run %d: status %d or bits differ", r, st);
    }
    case_check(fw_set_spin_us(spin) == FW_OK, "restore");
    case_end();
    free(want);
    free(got);
    problems_free(&P);
}

#ifdef FW_OPENMP
/* Calls from inside an OpenMP parallel region (nesting off: each runs on its own thread)
 * give the same bits; the default thread count there is 1. */
static void test_openmp_nested(void)
{
    problems P;
    problems_make(&P);
    unsigned char *want = malloc(P.bytes), *got = malloc(4 * P.bytes);
    case_begin("calls inside an OpenMP parallel region");
    case_check(problems_run(&P, 3, want) == FW_OK, "reference: %s", fw_last_error());
    atomic_int bad = 0, inner = 0;
#pragma omp parallel num_threads(2)
    {
        const int me = omp_get_thread_num();
        if (omp_get_num_threads() == 2 && fw_threads(0) != 1)
            atomic_fetch_add(&inner, 1);
        for (int r = 0; r < 2; r++)
            if (problems_run(&P, r ? 3 : 0, got + (size_t)(2 * me + r) * P.bytes) != FW_OK)
                atomic_fetch_add(&bad, 1);
    }
    case_check(!atomic_load(&bad), "a call failed");
    case_check(!atomic_load(&inner), "fw_threads(0) inside the region is not 1");
    for (int i = 0; i < 4; i++)
        case_check(memcmp(want, got + (size_t)i * P.bytes, P.bytes) == 0, "output %d differs", i);
    case_end();
    free(want);
    free(got);
    problems_free(&P);
}
#endif

const test_suite threads_suites[] = {
    {"threads.loop", test_loop},
    {"threads.host_identical", test_host_identical},
    {"threads.setting", test_setting},
    {"threads.switch_in_flight", test_switch_in_flight},
    {"threads.bad_args", test_bad_args},
    {"threads.spin", test_spin},
#ifdef FW_OPENMP
    {"threads.openmp_nested", test_openmp_nested},
#endif
    {NULL, NULL}};
