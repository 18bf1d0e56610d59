/* kern/peak_kern.h: the peak sub-table (kern/kernels.h): the FMA and bf16 product peaks
 * and the read stream of the bandwidth microbenchmark; included by kern/table.h. */

/* ------------------------------------------------------------------- peak -- */

/* Throughput of one thread in GFLOP/s over about `seconds`: PEAK_CHAINS independent chains
 * (more than latency x pipes), each value pinned in a register with vkeep so no compiler can
 * fold, merge or drop a chain, so the count of instructions executed is exactly the count
 * in the formula. f32 FMAs give 2 flops per lane; bf16 pair products (bf16 = 1) 4 per word
 * lane, two products and their sums (emulated tables measure what their emulation sustains),
 * and 8 on a layer with a 2x2 block product (ISA_MMLA: a BFMMLA is 16 products), the
 * instruction mm's bf16 tiles run on there. */
#ifdef ISA_MMLA
#define PEAK_BF16(acc, b, c) vmmla(acc, b, c)
#define PEAK_BF16_FLOPS 8.0
#else
#define PEAK_BF16(acc, b, c) vdpbf(acc, b, c)
#define PEAK_BF16_FLOPS 4.0
#endif
FW_INLINE double peak_run(double seconds, const int bf16)
{
    vf acc[PEAK_CHAINS];
    const uint32_t one = 0x3f803f80u; /* the bf16 pair (1, 1) */
    const vf b = vkeep(bf16 ? vbcast_word(&one) : vset1((float)(1.0 - 1e-7 * seconds)));
    const vf c = vkeep(bf16 ? vbcast_word(&one) : vset1((float)(1e-7 * seconds)));
    for (int i = 0; i < PEAK_CHAINS; i++)
        acc[i] = vkeep(vset1((float)i * (float)seconds));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double t;
    int64_t iters = 0;
    do {
        for (int r = 0; r < 4096; r++)
            for (int i = 0; i < PEAK_CHAINS; i++)
                acc[i] = vkeep(bf16 ? PEAK_BF16(acc[i], b, c) : vfma(acc[i], b, c));
        iters += 4096;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        t = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    } while (t < seconds);
    vf s = acc[0];
    for (int i = 1; i < PEAK_CHAINS; i++)
        s = vadd(s, acc[i]);
    volatile float sink = vhsum(s);
    (void)sink;
    return (double)iters * PEAK_CHAINS * VL * (bf16 ? PEAK_BF16_FLOPS : 2.0) / t * 1e-9;
}

static double peak(double seconds) { return peak_run(seconds, 0); }
static double peak_bf16(double seconds) { return peak_run(seconds, 1); }

static float stream_sum(const float *x, size_t n)
{
    vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (size_t i = 0; i < n; i += 4 * VL) {
        a0 = vadd(a0, vload(x + i));
        a1 = vadd(a1, vload(x + i + VL));
        a2 = vadd(a2, vload(x + i + 2 * VL));
        a3 = vadd(a3, vload(x + i + 3 * VL));
    }
    return vhsum(vadd(vadd(a0, a1), vadd(a2, a3)));
}

#define FW_PEAK_TABLE {.f32 = peak, .bf16 = peak_bf16, .stream_sum = stream_sum}
