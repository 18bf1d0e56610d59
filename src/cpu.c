/* cpu.c: the kernel-table registry. The CPU is detected once; FLYWHEEL_ISA, read once, names
 * the default table. */
#define _GNU_SOURCE 1 /* syscall() */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "internal.h"

typedef struct {
    const fw_kernels *k;
    int (*supported)(void);
    const fw_kernels *base; /* fills the table's NULL entries before the portable table */
} entry;

static int always(void) { return 1; }

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>

/* CPUID feature bits plus XGETBV: the OS must save the YMM (and for AVX-512 the ZMM and mask)
 * register state, or the instructions fault even where CPUID lists them. */
static unsigned xcr0(void)
{
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return lo;
}

static int has_avx2(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    const unsigned osxsave = 1u << 27, avx = 1u << 28, fma = 1u << 12, f16c = 1u << 29;
    if ((c & (osxsave | avx | fma | f16c)) != (osxsave | avx | fma | f16c) || (xcr0() & 6u) != 6u)
        return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    return (b >> 5) & 1u; /* AVX2 */
}

static int has_avx512(void)
{
    unsigned a, b, c, d;
    if (!has_avx2() || (xcr0() & 0xe6u) != 0xe6u || !__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    const unsigned f = 1u << 16, dq = 1u << 17, bw = 1u << 30, vl = 1u << 31;
    return (b & (f | dq | bw | vl)) == (f | dq | bw | vl);
}

static int has_avx512bf16(void)
{
    unsigned a, b, c, d;
    if (!has_avx512() || !__get_cpuid_count(7, 1, &a, &b, &c, &d))
        return 0;
    return (a >> 5) & 1u; /* CPUID.(EAX=7,ECX=1):EAX bit 5: AVX512_BF16 */
}

/* AMX-TILE and AMX-BF16 (CPUID.(EAX=7,ECX=0):EDX bits 24 and 22), the tile state enabled in
 * XCR0 (bits 17, 18), and Linux's grant of the tile data to this process (arch_prctl
 * ARCH_REQ_XCOMP_PERM, Linux 5.16): until it is granted, the first tile instruction of
 * any thread faults. Asked once (support_run); a refusal (an older kernel, a seccomp filter,
 * a signal stack too small for the larger frame) leaves the table unsupported. */
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static int has_amx(void)
{
    unsigned a, b, c, d;
    if (!has_avx512bf16() || !__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    const unsigned tile = 1u << 24, bf16 = 1u << 22, state = 3u << 17;
    if ((d & (tile | bf16)) != (tile | bf16) || (xcr0() & state) != state)
        return 0;
#if defined(__linux__)
    const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
#else
    return 0;
#endif
}
#endif

#if defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1ul << 1)
#endif
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1ul << 14)
#endif

/* Advanced SIMD, which Linux reports on every AArch64 core it runs (the baseline), and
 * FEAT_BF16 (BFDOT, BFMMLA): the kernel's hardware capabilities, no instruction tried. */
static int has_neon(void) { return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0; }
static int has_neon_bf16(void) { return has_neon() && (getauxval(AT_HWCAP2) & HWCAP2_BF16) != 0; }
#endif

/* Best last: the default is the last supported entry. */
static const entry tables[] = {
    {&fw_kernels_portable, always, NULL},
#if defined(__x86_64__) || defined(_M_X64)
    {&fw_kernels_avx2, has_avx2, NULL},
    {&fw_kernels_avx512, has_avx512, NULL},
    {&fw_kernels_avx512bf16, has_avx512bf16, NULL},
    {&fw_kernels_amx, has_amx, &fw_kernels_avx512bf16},
#endif
#if defined(__aarch64__)
    {&fw_kernels_neon, has_neon, NULL},
    {&fw_kernels_neon_bf16, has_neon_bf16, NULL},
#endif
};
#define NTABLES ((int)(sizeof tables / sizeof tables[0]))

int fw_isa_count(void) { return NTABLES; }

const char *fw_isa_name(int i) { return i >= 0 && i < NTABLES ? tables[i].k->name : NULL; }

/* Whether this CPU runs each table, asked once: CPUID traps to the hypervisor in a virtual
 * machine (13.8 us an instruction on this project's Intel VM, 2026-12-02), and every bf16
 * attention call asked again for its table (fw_bf16_products): five CPUIDs, 31% of a
 * 1K-context decode call's time. */
static int support[NTABLES];
static pthread_once_t support_once = PTHREAD_ONCE_INIT;

static void support_run(void)
{
    for (int i = 0; i < NTABLES; i++)
        support[i] = tables[i].supported();
}

static int supported(const entry *e)
{
    pthread_once(&support_once, support_run);
    return support[e - tables];
}

static const entry *find(const char *name)
{
    for (int i = 0; i < NTABLES; i++)
        if (name && strcmp(name, tables[i].k->name) == 0)
            return &tables[i];
    return NULL;
}

int fw_isa_supported(const char *name)
{
    const entry *e = find(name);
    return e && supported(e);
}

static char vendor[13];
static pthread_once_t vendor_once = PTHREAD_ONCE_INIT;

static void vendor_run(void)
{
#if defined(__x86_64__) || defined(_M_X64)
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d)) {
        memcpy(vendor, &b, 4);
        memcpy(vendor + 4, &d, 4);
        memcpy(vendor + 8, &c, 4);
    }
#endif
}

const char *fw_cpu_vendor(void)
{
    pthread_once(&vendor_once, vendor_run);
    return vendor;
}

int fw_bf16_dot_native(const char *vendor_id)
{
    return vendor_id && strcmp(vendor_id, "AuthenticAMD") == 0;
}

int fw_dec_prefetch(const char *vendor_id)
{
    return !vendor_id || strcmp(vendor_id, "GenuineIntel") != 0;
}

int fw_conv_pass_rows(const char *vendor_id)
{
    return vendor_id && strcmp(vendor_id, "AuthenticAMD") == 0 ? 1 : 64;
}

/* Whether this CPU's dot-product table (FW_BF16_DOT) runs bf16 pairs at twice the f32 FMA
 * rate. x86: vdpbf16ps, by vendor (fw_bf16_dot_native). AArch64: BFDOT at FMLA's issue rate
 * with twice its products, BFMMLA with four times, on the FEAT_BF16 cores whose optimisation
 * guides (and llvm-mca's models) give their rates: Neoverse N2, V1 and V2
 * (docs/portability.md: a prediction, not yet a measurement). */
static int dot_native(void)
{
#if defined(__aarch64__)
    return 1;
#else
    return fw_bf16_dot_native(fw_cpu_vendor());
#endif
}

/* A table with a native bf16 dot product (AMX tiles, or a dot product at twice the FMA rate). */
static int native_bf16(const fw_kernels *k)
{
    return k && (k->native_bf16 == FW_BF16_TILES || (k->native_bf16 == FW_BF16_DOT && dot_native()));
}

int fw_isa_native_bf16(const char *name) { return native_bf16(fw_kernels_get(name)); }

int fw_kernels_bf16_products(const fw_kernels *kt, fw_dtype q, int32_t precision)
{
    if (precision != FW_PREC_AUTO || q != FW_BF16)
        return precision == FW_PREC_BF16;
    return native_bf16(kt);
}

int fw_bf16_products(const char *isa, fw_dtype q, int32_t precision)
{
    if (precision != FW_PREC_AUTO || q != FW_BF16)
        return precision == FW_PREC_BF16;
    return fw_isa_native_bf16(isa);
}

/* Detection result: an index into tables, or -1 if FLYWHEEL_ISA named a table this CPU cannot
 * run (then every call that uses the default fails with that message). Computed once, under
 * pthread_once, so concurrent first calls are safe. */
static int default_index;
static char env_name[32];
static pthread_once_t detect_once = PTHREAD_ONCE_INIT;

static void detect_run(void)
{
    const char *env = getenv("FLYWHEEL_ISA");
    if (env && *env) {
        const entry *e = find(env);
        strncpy(env_name, env, sizeof env_name - 1);
        default_index = e && supported(e) ? (int)(e - tables) : -1;
        return;
    }
    default_index = 0;
    for (int i = 0; i < NTABLES; i++)
        if (supported(&tables[i]))
            default_index = i;
}

static int detect(void)
{
    pthread_once(&detect_once, detect_run);
    return default_index;
}

const char *fw_isa_default(void)
{
    int d = detect();
    return d >= 0 ? tables[d].k->name : NULL;
}

void fw_kernels_fill(fw_kernels *t, const fw_kernels *base)
{
#define FW_FILL(sub, f) if (!t->sub.f) t->sub.f = base->sub.f;
    FW_KERNEL_ENTRIES(FW_FILL)
#undef FW_FILL
}

/* The registered tables with their NULL entries filled from the portable one, built once. */
static fw_kernels resolved[NTABLES];
static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;

static void resolve_run(void)
{
    for (int i = 0; i < NTABLES; i++) {
        resolved[i] = *tables[i].k;
        if (tables[i].base)
            fw_kernels_fill(&resolved[i], tables[i].base);
        fw_kernels_fill(&resolved[i], &fw_kernels_portable);
    }
}

static const fw_kernels *table(int i)
{
    pthread_once(&resolve_once, resolve_run);
    return &resolved[i];
}

/* "portable, avx2, ..." of the registered tables, into buf. */
static const char *table_names(char *buf, size_t n)
{
    buf[0] = 0;
    for (int i = 0; i < NTABLES; i++) {
        const size_t len = strlen(buf);
        snprintf(buf + len, n - len, "%s%s", i ? ", " : "", tables[i].k->name);
    }
    return buf;
}

const fw_kernels *fw_kernels_get(const char *name)
{
    char names[256];
    if (!name) {
        int d = detect();
        if (d < 0) {
            fw_fail(FW_ERR_UNSUPPORTED,
                    "FLYWHEEL_ISA=%s names no kernel table this CPU runs (tables: %s)", env_name,
                    table_names(names, sizeof names));
            return NULL;
        }
        return table(d);
    }
    const entry *e = find(name);
    if (!e) {
        fw_fail(FW_ERR_UNSUPPORTED, "unknown kernel table \"%s\" (tables: %s)", name,
                table_names(names, sizeof names));
        return NULL;
    }
    if (!supported(e)) {
        fw_fail(FW_ERR_UNSUPPORTED, "kernel table \"%s\" needs instructions this CPU lacks", name);
        return NULL;
    }
    return table((int)(e - tables));
}

typedef struct {
    const fw_kernels *k;
    double seconds;
    int bf16;
    double gflops[FW_MAX_THREADS];
} peak_ctx;

static void peak_item(void *ctx, int64_t item, int tid)
{
    peak_ctx *p = ctx;
    p->gflops[item] = p->bf16 ? p->k->peak.bf16(p->seconds) : p->k->peak.f32(p->seconds);
    (void)tid;
}

static fw_status peak_run(const char *isa, int32_t threads, double seconds, int bf16, double *gflops)
{
    fw_clear_error();
    if (!gflops)
        return fw_fail(FW_ERR_NULL, "gflops is NULL");
    fw_status st = fw_check_threads(threads);
    if (st)
        return st;
    if (!(seconds > 0 && seconds <= 60))
        return fw_fail(FW_ERR_ARG, "seconds is %g; it must be in (0, 60]", seconds);
    const fw_kernels *k = NULL;
    if (isa) {
        k = fw_kernels_get(isa);
    } else {
        for (int i = 0; i < NTABLES; i++)
            if (supported(&tables[i]))
                k = table(i);
    }
    if (!k)
        return FW_ERR_UNSUPPORTED;
    int n = fw_threads(threads);
    peak_ctx *p = calloc(1, sizeof *p);
    if (!p)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate %zu bytes", sizeof *p);
    p->k = k;
    p->seconds = seconds;
    p->bf16 = bf16;
    /* one item per thread, so all n run at once (items are taken as threads come free) */
    fw_parallel(n, n, peak_item, p);
    double s = 0;
    for (int i = 0; i < n; i++)
        s += p->gflops[i];
    free(p);
    *gflops = s;
    return FW_OK;
}

fw_status fw_peak_gflops(const char *isa, int32_t threads, double seconds, double *gflops)
{
    return peak_run(isa, threads, seconds, 0, gflops);
}

fw_status fw_peak_bf16_gflops(const char *isa, int32_t threads, double seconds, double *gflops)
{
    return peak_run(isa, threads, seconds, 1, gflops);
}

typedef struct {
    const fw_kernels *k;
    const float *buf;
    size_t per; /* floats per thread */
    float sink[FW_MAX_THREADS];
} bw_ctx;

static void bw_item(void *ctx, int64_t item, int tid)
{
    bw_ctx *b = ctx;
    b->sink[item] = b->k->peak.stream_sum(b->buf + (size_t)item * b->per, b->per);
    (void)tid;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

fw_status fw_read_bandwidth(int32_t threads, size_t bytes, double *gbps)
{
    fw_clear_error();
    if (!gbps)
        return fw_fail(FW_ERR_NULL, "gbps is NULL");
    fw_status s = fw_check_threads(threads);
    if (s)
        return s;
    const int n = fw_threads(threads);
    if (bytes < (size_t)n * 4096 || bytes > ((size_t)1 << 40))
        return fw_fail(FW_ERR_ARG, "bytes is %zu; it must be at least 4 KiB per thread and at most 1 TiB",
                       bytes);
    const fw_kernels *k = NULL;
    for (int i = 0; i < NTABLES; i++)
        if (supported(&tables[i]))
            k = table(i);
    bw_ctx *b = calloc(1, sizeof *b);
    const size_t per = bytes / sizeof(float) / (size_t)n / 64 * 64;
    float *buf = malloc(per * (size_t)n * sizeof(float));
    if (!b || !buf) {
        free(b);
        free(buf);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate %zu bytes for the bandwidth buffer", bytes);
    }
    for (size_t i = 0; i < per * (size_t)n; i++)
        buf[i] = (float)(i & 7);
    b->k = k;
    b->buf = buf;
    b->per = per;
    double t[5];
    for (int r = 0; r < 5; r++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        fw_parallel(n, n, bw_item, b);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        t[r] = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    }
    qsort(t, 5, sizeof t[0], cmp_double);
    *gbps = (double)(per * (size_t)n * sizeof(float)) / t[2] * 1e-9;
    free(buf);
    free(b);
    return FW_OK;
}
