/* threads.c: fw_parallel, the parallel loop of every call, and the threads it runs on.
 *
 * A loop of n items runs on `threads` workers (tid 0 .. threads - 1, the index of their
 * scratch). Item i belongs to worker i % threads: each worker takes its own items in order
 * from its own counter, then the items left to the others from theirs (run_items). Which
 * worker runs an item never changes its result, and a worker that starts late or not at all
 * leaves its items to the others, so a loop is correct on whatever concurrency the threads
 * underneath give it. Owning items keeps the same data on the same core from call to call
 * when the host repeats a call: measured, a GDN decode of 1 sequence x 32 heads (2 MiB of f32
 * state, 2 threads, each core's half fits its L2) 68-70 us a step with one shared counter
 * (any worker takes the next item, so states moved between cores), 49-50 us owned.
 * The workers come from one of three places, read once per loop:
 *   - the host's loop (fw_set_parallel): task t of `threads` tasks is worker t;
 *   - OpenMP (built with FW_OPENMP): an omp parallel region, worker omp_get_thread_num();
 *   - the built-in pool (below).
 *
 * Why a pool: a decode step is 0.1-0.5 ms, and creating, exiting and joining threads per call
 * cost 50-100 us of it (measured: a batch-1 decode over 2K keys in two 1K-key items, items
 * 220 us each, call 290-410 us, of which 20 us before the first item and 35-70 us joining
 * after the last). So workers live between calls, and after a job spin for the spin window
 * (fw_set_spin_us) before they sleep, so that calls in a loop (one per layer) find them awake.
 *
 * Waking. The caller posts the job to each worker's slot and wakes only the workers that
 * sleep, with one futex wake each on the slot's own word: a woken worker needs no lock, so a
 * call after idle costs each worker one wake-up. The caller runs items meanwhile; when it
 * finds none left it takes back the posts no worker has taken yet, so it never waits for a
 * worker to wake up, only for the items already running.
 *
 * One call holds the pool at a time. A caller that finds it held (several application
 * threads calling at once) starts its own threads for that call, so concurrent calls never
 * wait for each other. After fork() the child starts with an empty pool. */
#define _GNU_SOURCE 1 /* syscall(), sched_getcpu() */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include "internal.h"
#ifdef FW_OPENMP
#include <omp.h>
#elif defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#define FW_SPIN_US 200

typedef struct {
    _Alignas(64) atomic_llong k;
} counter;

typedef struct {
    fw_item_fn fn;
    void *ctx;
    int64_t n;
    int threads;
    counter next[FW_MAX_THREADS]; /* next[t].k: how many of worker t's own items are taken */
} job;

static void run_items(job *j, int tid)
{
    const int T = j->threads;
    for (int s = 0; s < T; s++) {
        const int o = (tid + s) % T;
        for (;;) {
            const int64_t i = o + atomic_fetch_add_explicit(&j->next[o].k, 1, memory_order_relaxed) * T;
            if (i >= j->n)
                break;
            j->fn(j->ctx, i, tid);
        }
    }
}

/* ------------------------------------------------------------- settings -- */

static struct {
    pthread_mutex_t mu; /* guards fn and host, which a loop reads together */
    fw_parallel_fn fn;
    void *host;
    atomic_int threads; /* what params->threads = 0 means; 0: the built-in default */
    atomic_int spin_us;
} set = {PTHREAD_MUTEX_INITIALIZER, NULL, NULL, 0, FW_SPIN_US};

static pthread_once_t set_once = PTHREAD_ONCE_INIT;

/* FLYWHEEL_SPIN_US, before the spin window is first read or written */
static void set_init(void)
{
    const char *e = getenv("FLYWHEEL_SPIN_US");
    if (e && *e) {
        char *end;
        errno = 0;
        const long us = strtol(e, &end, 10);
        if (!*end && !errno && us >= 0 && us <= FW_MAX_SPIN_US)
            atomic_store(&set.spin_us, (int)us);
    }
}

fw_status fw_set_parallel(fw_parallel_fn fn, void *host, int32_t threads)
{
    fw_clear_error();
    if (!fn && host)
        return fw_fail(FW_ERR_ARG, "fw_set_parallel: a host without a loop function (pass NULL "
                                   "for both to go back to the built-in threads)");
    const fw_status s = fw_check_threads(threads);
    if (s)
        return s;
    pthread_mutex_lock(&set.mu);
    set.fn = fn;
    set.host = host;
    atomic_store_explicit(&set.threads, threads, memory_order_relaxed);
    pthread_mutex_unlock(&set.mu);
    return FW_OK;
}

fw_status fw_get_parallel(fw_parallel_fn *fn, void **host, int32_t *threads)
{
    fw_clear_error();
    if (!fn || !host || !threads)
        return fw_fail(FW_ERR_NULL, "fw_get_parallel: %s is NULL", !fn ? "fn" : !host ? "host" : "threads");
    pthread_mutex_lock(&set.mu);
    *fn = set.fn;
    *host = set.host;
    *threads = atomic_load_explicit(&set.threads, memory_order_relaxed);
    pthread_mutex_unlock(&set.mu);
    return FW_OK;
}

fw_status fw_set_spin_us(int32_t us)
{
    fw_clear_error();
    if (us < 0 || us > FW_MAX_SPIN_US)
        return fw_fail(FW_ERR_ARG, "spin window %d us; it must be 0 to %d", (int)us, FW_MAX_SPIN_US);
    pthread_once(&set_once, set_init); /* so that FLYWHEEL_SPIN_US, read later, cannot undo it */
    atomic_store_explicit(&set.spin_us, us, memory_order_relaxed);
    return FW_OK;
}

int32_t fw_get_spin_us(void)
{
    pthread_once(&set_once, set_init);
    return atomic_load_explicit(&set.spin_us, memory_order_relaxed);
}

/* Read once: sysconf reads /sys/devices/system/cpu/online, 2 us a call here, and every call
 * with threads = 0 asked (a 1K-context decode takes 130 us on 2 threads). */
static int cpu_count;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

static void cpu_count_run(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_count = n < 1 ? 1 : (n > FW_MAX_THREADS ? FW_MAX_THREADS : (int)n);
}

int fw_cpu_count(void)
{
    pthread_once(&cpu_once, cpu_count_run);
    return cpu_count;
}

int fw_threads(int32_t requested)
{
    if (requested > 0)
        return requested;
    const int d = atomic_load_explicit(&set.threads, memory_order_relaxed);
    if (d > 0)
        return d;
#ifdef FW_OPENMP
    if (omp_get_active_level() >= omp_get_max_active_levels())
        return 1; /* a region here would have one thread */
    const int m = omp_get_max_threads();
    return m > FW_MAX_THREADS ? FW_MAX_THREADS : m;
#else
    return fw_cpu_count();
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

#ifdef FW_OPENMP
/* A child forked from a process that has run OpenMP regions cannot run one: libgomp waits for
 * its parent's threads, which the child does not have (measured: the fork test hung). So a
 * forked child's loops start threads of their own. */
static atomic_int forked;
#else
/* ------------------------------------------------------------------ pool -- */

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

/* The CPU this thread runs on, or -1 where that cannot be asked. */
static int this_cpu(void)
{
#ifdef __linux__
    return sched_getcpu();
#else
    return -1;
#endif
}

/* Worker t's mailbox. The job travels in `post` (swapped out by whoever takes it: the worker
 * to run it, or the caller to take it back); `seq`, bumped with every post, is the word a
 * sleeping worker waits on. */
typedef struct {
    _Alignas(64) _Atomic(job *) post;
    atomic_uint seq;
    atomic_int sleeping; /* the worker sleeps on seq, or is about to */
    atomic_int cpu;      /* while the worker runs a job: the CPU it took it on; else -1 */
} slot;

/* Sharing a CPU. Linux wakes a sleeping worker on its caller's CPU when it finds no idle one
 * (wake-affine), and there the worker preempts the caller, runs the items, and then, spinning,
 * would keep the caller off its CPU for the whole spin window: measured on a machine with
 * every CPU busy, 2 items of 30 us took 265 us a call, call after call, and a caller spinning
 * for a worker preempted on its CPU waited a scheduler tick (4 ms). So a worker does not spin
 * on the CPU its caller last ran on, and a caller waiting for a worker on its own CPU yields
 * it. */
static struct {
    atomic_int busy;       /* a call holds the pool */
    int started;           /* workers 1 .. started run; changed only by the holder */
    atomic_int active;     /* posts of the holder's job not yet finished or taken back */
    atomic_int caller_cpu; /* the CPU the latest holder posted its job from, or -1 */
    slot w[FW_MAX_THREADS];
} pool;

#ifdef __linux__
_Static_assert(sizeof(atomic_uint) == 4, "a futex word is 32 bits");

/* sleep until seq moves on from g (returns at once if it already has; may return spuriously) */
static void sleep_on(slot *s, unsigned g)
{
    syscall(SYS_futex, &s->seq, FUTEX_WAIT_PRIVATE, g, NULL, NULL, 0);
}

static void wake(slot *s)
{
    syscall(SYS_futex, &s->seq, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}
#else
/* no futex: one condition variable for all slots */
static pthread_mutex_t sleep_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;

static void sleep_on(slot *s, unsigned g)
{
    pthread_mutex_lock(&sleep_mu);
    while (atomic_load(&s->seq) == g)
        pthread_cond_wait(&sleep_cv, &sleep_mu);
    pthread_mutex_unlock(&sleep_mu);
}

static void wake(slot *s)
{
    (void)s;
    pthread_mutex_lock(&sleep_mu);
    pthread_cond_broadcast(&sleep_cv);
    pthread_mutex_unlock(&sleep_mu);
}
#endif

/* Until a job is posted: spin for the window (not on the caller's CPU), then sleep. The
 * caller stores post, bumps seq, then reads sleeping; the worker stores sleeping, reads seq,
 * then post (all seq_cst): either the caller sees sleeping and wakes it, or the worker sees
 * the post, or the futex sees seq moved on. */
/* A worker woken on its caller's CPU can only run after the caller, one after the other, and
 * Linux keeps waking it there while the other CPUs idle (measured, `flywheel bench threads`,
 * 2 threads x 30 us items: after 0.1 s to 3 s idle, the worker was on the caller's CPU in
 * every one of the next 20 calls, 62-75 us each against 31 us back to back). So it moves off
 * that CPU (its affinity without it, which migrates it at once) until its next job is done,
 * then gets its own affinity back: two system calls, about 3 us. 1 if it moved (saved holds
 * the affinity to restore). */
#ifdef __linux__
static int move_off(int cpu, cpu_set_t *saved)
{
    cpu_set_t other;
    if (sched_getaffinity(0, sizeof *saved, saved) != 0 || !CPU_ISSET(cpu, saved))
        return 0;
    other = *saved;
    CPU_CLR(cpu, &other);
    return CPU_COUNT(&other) > 0 && sched_setaffinity(0, sizeof other, &other) == 0;
}
#endif

static void await_post(slot *s, int *moved, void *saved)
{
    for (;;) {
        const int spin = atomic_load_explicit(&set.spin_us, memory_order_relaxed);
        const int caller = atomic_load_explicit(&pool.caller_cpu, memory_order_relaxed);
        if (spin > 0 && (caller < 0 || this_cpu() != caller)) {
            const double until = now_us() + spin;
            int spins = 0;
            while (!atomic_load_explicit(&s->post, memory_order_relaxed) &&
                   (++spins % 256 != 0 || (now_us() < until && (caller < 0 || this_cpu() != caller))))
                cpu_relax();
        }
        if (atomic_load_explicit(&s->post, memory_order_relaxed))
            return;
        atomic_store(&s->sleeping, 1);
        const unsigned g = atomic_load(&s->seq);
        if (!atomic_load(&s->post))
            sleep_on(s, g);
        atomic_store_explicit(&s->sleeping, 0, memory_order_relaxed);
        /* Woken with no job: a call posted one and took it back, having run every item
         * before this worker was up (a CPU waking from idle takes longer than a short call).
         * More calls follow: spin for them again rather than sleep, or every call of the
         * burst would pay the wake-up and run alone (measured: 20 calls in a row after 1 s
         * idle at twice the time of back-to-back calls). */
        if (atomic_load_explicit(&s->post, memory_order_relaxed))
            return;
#ifdef __linux__
        const int here = this_cpu();
        if (!*moved && here >= 0 && here == atomic_load_explicit(&pool.caller_cpu, memory_order_relaxed))
            *moved = move_off(here, saved);
#else
        (void)moved;
        (void)saved;
#endif
    }
}


static void *pool_main(void *arg)
{
    slot *s = arg;
    const int tid = (int)(s - pool.w);
    int moved = 0; /* off the caller's CPU until the next job is done */
#ifdef __linux__
    cpu_set_t saved;
#else
    char saved;
#endif
    for (;;) {
        await_post(s, &moved, &saved);
        job *j = atomic_exchange_explicit(&s->post, NULL, memory_order_acquire);
        if (j) {
            int here = this_cpu();
#ifdef __linux__
            if (!moved && here >= 0 &&
                here == atomic_load_explicit(&pool.caller_cpu, memory_order_relaxed) &&
                (moved = move_off(here, &saved)))
                here = this_cpu();
#endif
            atomic_store_explicit(&s->cpu, here, memory_order_relaxed);
            run_items(j, tid);
            atomic_store_explicit(&s->cpu, -1, memory_order_relaxed);
            atomic_fetch_sub_explicit(&pool.active, 1, memory_order_release);
#ifdef __linux__
            if (moved)
                sched_setaffinity(0, sizeof saved, &saved);
#endif
            moved = 0;
        }
    }
    return NULL;
}

/* A worker of the holder's job (1 .. want) runs on this CPU. */
static int worker_here(int want)
{
    const int me = this_cpu();
    for (int t = 1; me >= 0 && t <= want; t++)
        if (atomic_load_explicit(&pool.w[t].cpu, memory_order_relaxed) == me)
            return 1;
    return 0;
}

static int start_worker(int tid)
{
    atomic_store_explicit(&pool.w[tid].cpu, -1, memory_order_relaxed);
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    const int ok = pthread_create(&th, &at, pool_main, &pool.w[tid]) == 0;
    pthread_attr_destroy(&at);
    return ok;
}

/* Runs j on the pool with `threads` threads in all; 0 if the pool is held by another call. */
static int run_pool(job *j, int threads)
{
    int expected = 0;
    if (!atomic_compare_exchange_strong(&pool.busy, &expected, 1))
        return 0;
    pthread_once(&set_once, set_init); /* before a worker reads the spin window */
    while (pool.started < threads - 1 && start_worker(pool.started + 1))
        pool.started++;
    const int want = pool.started < threads - 1 ? pool.started : threads - 1;
    atomic_store_explicit(&pool.active, want, memory_order_relaxed);
    atomic_store_explicit(&pool.caller_cpu, this_cpu(), memory_order_relaxed);
    for (int t = 1; t <= want; t++) {
        slot *s = &pool.w[t];
        atomic_store(&s->post, j);
        atomic_fetch_add(&s->seq, 1);
        if (atomic_load(&s->sleeping))
            wake(s);
    }
    run_items(j, 0);
    /* every item is taken: take back the posts no worker has taken */
    for (int t = 1; t <= want; t++)
        if (atomic_exchange_explicit(&pool.w[t].post, NULL, memory_order_relaxed))
            atomic_fetch_sub_explicit(&pool.active, 1, memory_order_relaxed);
    for (int spins = 0; atomic_load_explicit(&pool.active, memory_order_acquire) > 0;) {
        cpu_relax();
        if (++spins % 256 == 0 && worker_here(want))
            sched_yield();
    }
    atomic_store_explicit(&pool.busy, 0, memory_order_release);
    return 1;
}
#endif /* !FW_OPENMP */

/* The child of a fork has only the forking thread: no pool workers (nor OpenMP threads), and
 * no other thread to release a lock it held at the fork. Registered when the library is
 * loaded: the host may have used OpenMP before its first call into the library. */
static void after_fork_child(void)
{
    pthread_mutex_init(&set.mu, NULL);
#ifdef FW_OPENMP
    atomic_store(&forked, 1);
#else
    pool.started = 0;
    atomic_store(&pool.busy, 0);
    atomic_store(&pool.active, 0);
    for (int t = 0; t < FW_MAX_THREADS; t++) {
        atomic_store(&pool.w[t].post, NULL);
        atomic_store(&pool.w[t].sleeping, 0);
        atomic_store(&pool.w[t].cpu, -1);
    }
#ifndef __linux__
    pthread_mutex_init(&sleep_mu, NULL);
    pthread_cond_init(&sleep_cv, NULL);
#endif
#endif
}

__attribute__((constructor)) static void threads_load(void)
{
    pthread_atfork(NULL, NULL, after_fork_child);
}

static void host_task(void *arg, int64_t t)
{
    run_items(arg, (int)t);
}

void fw_parallel(int threads, int64_t n, fw_item_fn fn, void *ctx)
{
    if (threads > FW_MAX_THREADS)
        threads = FW_MAX_THREADS;
    if (threads > n)
        threads = (int)n;
    if (threads < 1)
        threads = 1;
    job j;
    j.fn = fn;
    j.ctx = ctx;
    j.n = n;
    j.threads = threads;
    for (int t = 0; t < threads; t++)
        atomic_init(&j.next[t].k, 0);
    if (threads <= 1) {
        run_items(&j, 0);
        return;
    }
    pthread_mutex_lock(&set.mu);
    const fw_parallel_fn host_fn = set.fn;
    void *const host = set.host;
    pthread_mutex_unlock(&set.mu);
    if (host_fn) {
        host_fn(host, threads, host_task, &j);
        return;
    }
#ifdef FW_OPENMP
    if (atomic_load_explicit(&forked, memory_order_relaxed)) {
        run_spawned(&j, threads);
        return;
    }
#pragma omp parallel num_threads(threads)
    run_items(&j, omp_get_thread_num());
#else
    if (!run_pool(&j, threads))
        run_spawned(&j, threads);
#endif
}
