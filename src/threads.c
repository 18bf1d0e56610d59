/* threads.c: a fork-join parallel loop with dynamic item assignment, on a pool of worker
 * threads that live between calls.
 *
 * Why a pool: a decode step is 0.1-0.5 ms, and creating, exiting and joining threads per call
 * cost 50-100 us of it (measured: a batch-1 decode over 2K keys in two 1K-key items, items
 * 220 us each, call 290-410 us, of which 20 us before the first item and 35-70 us joining
 * after the last). Pool workers spin for FW_SPIN_US after a job before they sleep on a
 * condition variable, so calls in a loop (one per layer) find them awake.
 *
 * One parallel region holds the pool at a time. A caller that finds it held (several
 * application threads calling at once) starts its own threads for that call, as before, so
 * concurrent calls never wait for each other. After fork() the child starts with an empty
 * pool. */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#include "internal.h"

#define FW_SPIN_US 200.0

typedef struct {
    fw_item_fn fn;
    void *ctx;
    int64_t n;
    atomic_llong next;
} job;

static void run_items(job *j, int tid)
{
    for (;;) {
        int64_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->n)
            return;
        j->fn(j->ctx, i, tid);
    }
}

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ------------------------------------------------------- per-call threads -- */

typedef struct {
    job *j;
    int tid;
} worker;

static void *worker_main(void *arg)
{
    worker *w = arg;
    run_items(w->j, w->tid);
    return NULL;
}

static void run_spawned(job *j, int threads)
{
    pthread_t th[FW_MAX_THREADS];
    worker w[FW_MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        w[t].j = j;
        w[t].tid = t;
        if (pthread_create(&th[t], NULL, worker_main, &w[t]) != 0)
            break;
        started = t;
    }
    run_items(j, 0);
    for (int t = 1; t <= started; t++)
        pthread_join(th[t], NULL);
}

/* ------------------------------------------------------------------ pool -- */

static struct {
    pthread_mutex_t mu;    /* guards everything below but the atomics */
    pthread_cond_t wake;   /* a new job was published */
    int started;           /* workers running: tids 1 .. started */
    atomic_int busy;       /* a parallel region holds the pool */
    job *cur;              /* the job of generation gen */
    int want;              /* workers 1 .. want take part in it */
    atomic_ulong gen;      /* bumped for every job */
    atomic_int active;     /* workers of the current job not yet done */
    unsigned long born[FW_MAX_THREADS]; /* gen when worker t was started: its jobs come after */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, NULL, 0, 0, 0, {0}};

static void *pool_main(void *arg)
{
    const int tid = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.mu);
    unsigned long seen = pool.born[tid];
    pthread_mutex_unlock(&pool.mu);
    for (;;) {
        /* spin a while for the next job, then sleep until one is published */
        const double until = now_us() + FW_SPIN_US;
        int spins = 0;
        while (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen &&
               (++spins % 256 != 0 || now_us() < until))
            cpu_relax();
        /* generation, job and participants are published together under the mutex */
        pthread_mutex_lock(&pool.mu);
        while (atomic_load_explicit(&pool.gen, memory_order_relaxed) == seen)
            pthread_cond_wait(&pool.wake, &pool.mu);
        seen = atomic_load_explicit(&pool.gen, memory_order_relaxed);
        job *j = pool.cur;
        const int mine = tid <= pool.want;
        pthread_mutex_unlock(&pool.mu);
        if (mine) {
            run_items(j, tid);
            atomic_fetch_sub_explicit(&pool.active, 1, memory_order_release);
        }
    }
    return NULL;
}

static void pool_after_fork(void)
{
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = 0;
    atomic_store(&pool.busy, 0);
    atomic_store(&pool.active, 0);
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void pool_init(void)
{
    pthread_atfork(NULL, NULL, pool_after_fork);
}

/* Runs j on the pool with `threads` threads in all; 0 if the pool is held by another call. */
static int run_pool(job *j, int threads)
{
    int expected = 0;
    if (!atomic_compare_exchange_strong(&pool.busy, &expected, 1))
        return 0;
    pthread_once(&pool_once, pool_init);
    pthread_mutex_lock(&pool.mu);
    while (pool.started < threads - 1) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        pool.born[pool.started + 1] = atomic_load_explicit(&pool.gen, memory_order_relaxed);
        const int ok = pthread_create(&th, &at, pool_main, (void *)(intptr_t)(pool.started + 1)) == 0;
        pthread_attr_destroy(&at);
        if (!ok)
            break;
        pool.started++;
    }
    const int want = pool.started < threads - 1 ? pool.started : threads - 1;
    pool.cur = j;
    pool.want = want;
    atomic_store_explicit(&pool.active, want, memory_order_release);
    atomic_fetch_add_explicit(&pool.gen, 1, memory_order_acq_rel);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    run_items(j, 0);
    while (atomic_load_explicit(&pool.active, memory_order_acquire) > 0)
        cpu_relax();
    atomic_store_explicit(&pool.busy, 0, memory_order_release);
    return 1;
}

void fw_parallel(int threads, int64_t n, fw_item_fn fn, void *ctx)
{
    job j = {fn, ctx, n, 0};
    if (threads > FW_MAX_THREADS)
        threads = FW_MAX_THREADS;
    if (threads > n)
        threads = (int)n;
    if (threads <= 1) {
        run_items(&j, 0);
        return;
    }
    if (!run_pool(&j, threads))
        run_spawned(&j, threads);
}

int fw_cpu_count(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (n > FW_MAX_THREADS ? FW_MAX_THREADS : (int)n);
}
