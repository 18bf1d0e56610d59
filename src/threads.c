/* threads.c: a fork-join parallel loop with dynamic item assignment. Threads are created per
 * call: a call does milliseconds of work or more, and keeping no pool means no global state. */
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>
#include "internal.h"

typedef struct {
    fw_item_fn fn;
    void *ctx;
    int64_t n;
    atomic_llong next;
} job;

typedef struct {
    job *j;
    int tid;
} worker;

static void run_items(job *j, int tid)
{
    for (;;) {
        int64_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->n)
            return;
        j->fn(j->ctx, i, tid);
    }
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    run_items(w->j, w->tid);
    return NULL;
}

#define FW_MAX_THREADS 256

void fw_parallel(int threads, int64_t n, fw_item_fn fn, void *ctx)
{
    job j = {fn, ctx, n, 0};
    if (threads > FW_MAX_THREADS)
        threads = FW_MAX_THREADS;
    if (threads > n)
        threads = (int)n;
    pthread_t th[FW_MAX_THREADS];
    worker w[FW_MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        w[t].j = &j;
        w[t].tid = t;
        if (pthread_create(&th[t], NULL, worker_main, &w[t]) != 0)
            break;
        started = t;
    }
    run_items(&j, 0);
    for (int t = 1; t <= started; t++)
        pthread_join(th[t], NULL);
}

int fw_cpu_count(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (n > FW_MAX_THREADS ? FW_MAX_THREADS : (int)n);
}
