/*
 * flywheel: the command-line tool.
 *   flywheel run [--json]        the main job: headline kernels on real-size shapes, checked
 *                                against the reference, with throughput and % of peak
 *   flywheel bench attn [opts]   softmax attention benchmark (flywheel bench attn --help)
 *   flywheel bench kvcache       KV-cache append + attend: decode and chunked prefill
 *   flywheel bench gdn           Gated DeltaNet prefill (with baselines) and decode
 *   flywheel bench conv          causal conv1d prefill and decode
 *   flywheel bench threads       the parallel loop's latency, back to back and after idle gaps
 *   flywheel peak [threads]      this machine's measured FMA peak
 *   flywheel info                the CPU, kernel tables and the default
 */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include "bench.h"
#include "commands.h"

/* Arm's cores by MIDR part number (implementer 0x41), those the AArch64 tables target. */
static const struct {
    unsigned part;
    const char *name;
} arm_parts[] = {{0xd08, "Cortex-A72"}, {0xd0b, "Cortex-A76"}, {0xd0c, "Neoverse N1"},
                 {0xd40, "Neoverse V1"}, {0xd49, "Neoverse N2"}, {0xd4f, "Neoverse V2"}};

/* The CPU's model as Linux reports it, into buf: x86's first "model name" in /proc/cpuinfo,
 * or on AArch64 (which has none) the core named from its implementer and part numbers; 0
 * where there is neither (another OS, a CPU whose kernel names no model). */
static int cpu_model(char *buf, size_t n)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    int found = 0;
    unsigned impl = 0, part = 0;
    while (f && !found && fgets(line, sizeof line, f)) {
        const char *colon = strchr(line, ':');
        if (!colon)
            continue;
        if (strncmp(line, "CPU implementer", 15) == 0 && !impl)
            impl = (unsigned)strtoul(colon + 1, NULL, 0);
        if (strncmp(line, "CPU part", 8) == 0 && !part)
            part = (unsigned)strtoul(colon + 1, NULL, 0);
        if (strncmp(line, "model name", 10) != 0)
            continue;
        colon += 1 + (colon[1] == ' ');
        snprintf(buf, n, "%.*s", (int)strcspn(colon, "\n"), colon);
        found = buf[0] != 0;
    }
    if (f)
        fclose(f);
    for (size_t i = 0; !found && impl == 0x41 && i < sizeof arm_parts / sizeof arm_parts[0]; i++)
        if (arm_parts[i].part == part) {
            snprintf(buf, n, "Arm %s", arm_parts[i].name);
            found = 1;
        }
    if (!found && impl) {
        snprintf(buf, n, "AArch64, implementer 0x%02x, part 0x%03x", impl, part);
        found = 1;
    }
    return found;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: flywheel run [--json] [--small] | bench attn|kvcache|gdn|conv|threads [options] | ab A.so B.so\n"
            "                attn|decode|gdn|gdn-decode [options] | peak [threads] | info\n"
            "  run          the main job: headline kernels on real-size shapes (attention at T = 1K and\n"
            "               4K, KV cache, Gated DeltaNet, causal conv1d), checked against the float64\n"
            "               reference, with %% of peak (T = 16K and the full-length baselines: `flywheel\n"
            "               bench attn`, as the last attention line says); --json: one JSON object a\n"
            "               line (the bench commands' fields), no captions, then {\"op\":\"run\",...};\n"
            "               --small: the same calls and checks on a quarter of the heads and a sixteenth\n"
            "               of the tokens, once each (emulators, slow machines: the checks, not the speed)\n"
            "  bench attn|kvcache|gdn|conv|threads   see `flywheel bench attn --help` (the others alike)\n"
            "  ab A.so B.so KIND        two builds of the library taking turns in one process on the\n"
            "                           same inputs, and whether their outputs have the same bits\n"
            "                           (KIND: attn, decode, gdn, gdn-decode; `flywheel ab --help`)\n"
            "  peak [threads]           the FMA and bf16 dot-product peaks on 1..256 threads\n"
            "  info                     the CPU (model, online CPUs), the kernel tables and the default\n");
}

int main(int argc, char **argv)
{
    const char *cmd = argc >= 2 ? argv[1] : NULL;
    if (!cmd || bench_is_help(cmd)) {
        usage(cmd ? stdout : stderr);
        return cmd ? 0 : 2;
    }
    if (strcmp(cmd, "run") == 0) {
        int json = 0, small = 0;
        for (int i = 2; i < argc; i++) {
            if (bench_is_help(argv[i])) {
                usage(stdout);
                return 0;
            }
            if (strcmp(argv[i], "--json") == 0)
                json = 1;
            else if (strcmp(argv[i], "--small") == 0)
                small = 1;
            else {
                usage(stderr);
                fprintf(stderr, "flywheel: run takes no arguments but --json and --small (got %s)\n", argv[i]);
                return 2;
            }
        }
        int fail = bench_attn_headline(json, small);
        if (!json)
            printf("\nKV cache (append + attend, paged, page 256): decode K/V GB/s against the read bandwidth\n"
                   "measured in the same run; chunked prefill next to the dense kernel on the same shape\n");
        fail |= bench_kvcache_headline(json, small);
        if (!json)
            printf("\nGated DeltaNet (Qwen3-Next shapes, bf16): chunked prefill against the plain 4-pass\n"
                   "recurrence and the fused recurrent step in the same run; decode against the read bandwidth;\n"
                   "then KDA (a decay per key channel, Kimi Linear's 32 heads) the same way\n");
        fail |= bench_gdn_headline(json, small);
        if (!json)
            printf("\nCausal conv1d (Qwen3-Next's, bf16, width 4, SiLU): prefill GB/s against a copy of the same\n"
                   "bytes in the same run; decode of 64 sequences with their conv states in place\n");
        fail |= bench_conv_headline(json, small);
        if (json)
            printf("{\"op\":\"run\",\"check\":\"%s\"}\n", fail ? "FAIL" : "pass");
        else
            printf(fail ? "main job: FAILED\n" : "main job: all checks passed\n");
        return fail;
    }
    if (strcmp(cmd, "bench") == 0) {
        const char *what = argc >= 3 ? argv[2] : "";
        if (strcmp(what, "attn") == 0)
            return bench_attn_main(argc - 3, argv + 3);
        if (strcmp(what, "kvcache") == 0)
            return bench_kvcache_main(argc - 3, argv + 3);
        if (strcmp(what, "gdn") == 0)
            return bench_gdn_main(argc - 3, argv + 3);
        if (strcmp(what, "conv") == 0)
            return bench_conv_main(argc - 3, argv + 3);
        if (strcmp(what, "threads") == 0)
            return bench_threads_main(argc - 3, argv + 3);
        usage(stderr);
        fprintf(stderr, "flywheel: bench needs attn, kvcache, gdn, conv or threads%s%s\n", *what ? "; got " : "", what);
        return 2;
    }
    if (strcmp(cmd, "ab") == 0)
        return bench_ab_main(argc - 2, argv + 2);
    if (strcmp(cmd, "peak") == 0) {
        if (argc > 3 || (argc == 3 && bench_is_help(argv[2]))) {
            usage(argc == 3 ? stdout : stderr);
            return argc == 3 ? 0 : 2;
        }
        const int t = argc == 3 ? (int)bench_int("peak", argv[2], 1, 256) : 1;
        double g = bench_peak(NULL, t), gb = bench_peak_bf16(NULL, t);
        if (g <= 0 || gb <= 0) {
            fprintf(stderr, "flywheel: peak: %s\n", fw_last_error());
            return 1;
        }
        const char *isa = fw_isa_default() ? fw_isa_default() : "";
        printf("FMA peak on %d thread(s): %.1f GFLOP/s (f32, table %s)\n", t, g, isa);
        printf("bf16 product peak on %d thread(s): %.1f GFLOP/s (table %s: %s)\n", t, gb, isa,
               strcmp(isa, "amx") == 0          ? "AMX tiles, tdpbf16ps"
               : strcmp(isa, "avx512bf16") == 0 ? "vdpbf16ps"
               : strcmp(isa, "neon_bf16") == 0  ? "BFMMLA"
                                                : "no bf16 dot product, f32 emulation");
        return 0;
    }
    if (strcmp(cmd, "info") == 0) {
        char model[256];
        printf("cpu: %s, %d online CPUs\n", cpu_model(model, sizeof model) ? model : "model unknown", bench_cpus());
        printf("kernel tables:");
        for (int i = 0; i < fw_isa_count(); i++)
            printf(" %s%s", fw_isa_name(i), fw_isa_supported(fw_isa_name(i)) ? "" : "(unsupported)");
        printf("\ndefault: %s\n", fw_isa_default() ? fw_isa_default() : fw_last_error());
        printf("bf16 products for bf16 inputs by default (FW_PREC_AUTO) on:");
        int any = 0;
        for (int i = 0; i < fw_isa_count(); i++)
            if (fw_isa_supported(fw_isa_name(i)) && fw_isa_native_bf16(fw_isa_name(i)))
                any = printf(" %s", fw_isa_name(i));
        printf("%s\n", any ? "" : " none (f32 products)");
        return 0;
    }
    usage(stderr);
    fprintf(stderr, "flywheel: unknown command %s\n", cmd);
    return 2;
}
