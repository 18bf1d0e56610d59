/* test_main.c: runs the test suites; the last line is "N passed, N failed".
 *
 *   test_flywheel                      every suite
 *   test_flywheel --filter PATTERNS    the suites whose names match one of the comma-separated
 *                                      fnmatch patterns ("attn.sweep_*,gdn.*"); a bare group
 *                                      name ("gdn", no '.' and no wildcard) means "gdn.*"
 *   test_flywheel GROUP|PATTERN ...    the same as --filter
 *   test_flywheel --list [--filter P]  the suite names, one a line
 *   test_flywheel --print-default      the default kernel table and what a call on it returns:
 *                                      isa.env runs this binary again under each FLYWHEEL_ISA
 * A pattern that matches no suite is an error (exit 2), so a typo cannot pass as an empty
 * run. FW_TEST_QUICK=1 runs the smaller sweeps (sanitizer builds, emulators); FW_TEST_TABLES=
 * NAMES runs the calls that loop over kernel tables on those only (test_util.h; a name that is
 * no table is an error, exit 2). */
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "test_util.h"

static const char *self_path;

static int print_default(void)
{
    float x[4] = {1, 2, 3, 4}, o[4];
    int64_t s[4] = {1, 1, 1, 4};
    fw_tensor q = fw_tensor_contiguous(x, FW_F32, 4, s), to = fw_tensor_contiguous(o, FW_F32, 4, s);
    fw_status st = fw_attn_fwd(&q, &q, &q, &to, NULL, NULL);
    printf("%s %d %s\n", fw_isa_default() ? fw_isa_default() : "none", (int)st, fw_last_error());
    return 0;
}

/* FLYWHEEL_ISA selects the default table; a name this CPU cannot run makes calls fail. */
static void test_isa_env(void)
{
    for (int i = -1; i < fw_isa_count(); i++) {
        const char *name = i < 0 ? "bogus" : fw_isa_name(i);
        char cmd[1024], line[512] = "";
        snprintf(cmd, sizeof cmd, "FLYWHEEL_ISA=%s '%s' --print-default", name, self_path);
        FILE *p = popen(cmd, "r");
        if (p) {
            if (!fgets(line, sizeof line, p))
                line[0] = 0;
            pclose(p);
        }
        case_begin("FLYWHEEL_ISA=%s", name);
        char got[64] = "";
        int st = -1;
        sscanf(line, "%63s %d", got, &st);
        if (i >= 0 && fw_isa_supported(name))
            case_check(strcmp(got, name) == 0 && st == FW_OK, "child printed \"%s\"", line);
        else
            case_check(strcmp(got, "none") == 0 && st == FW_ERR_UNSUPPORTED &&
                           strstr(line, "FLYWHEEL_ISA"),
                       "child printed \"%s\"", line);
        case_end();
    }
}

/* fw_version() is "MAJOR.MINOR.PATCH" of the header's FW_VERSION_*, fw_abi_version() its
 * FW_ABI_VERSION. */
static void test_version(void)
{
    char want[64];
    snprintf(want, sizeof want, "%d.%d.%d", FW_VERSION_MAJOR, FW_VERSION_MINOR, FW_VERSION_PATCH);
    case_begin("fw_version() is \"%s\"", want);
    const char *v = fw_version();
    case_check(v != NULL && strcmp(v, want) == 0, "fw_version() returned \"%s\"", v ? v : "(null)");
    case_check(v == fw_version(), "fw_version() is not one constant string");
    case_end();
    case_begin("fw_abi_version() is FW_ABI_VERSION (%d)", FW_ABI_VERSION);
    case_check(FW_ABI_VERSION >= 1, "FW_ABI_VERSION %d", FW_ABI_VERSION);
    case_check(fw_abi_version() == FW_ABI_VERSION, "fw_abi_version() returned %d", fw_abi_version());
    case_end();
}

static const test_suite main_suites[] = {
    {"isa.env", test_isa_env},
    {"api.version", test_version},
    {NULL, NULL}};

extern const test_suite threads_suites[]; /* test_threads.c */

static const test_suite *const groups[] = {main_suites, attn_suites, attn_bwd_suites, rotary_suites,
                                           kvcache_suites, gdn_suites, layer_suites,
                                           conv_suites, nan_suites, threads_suites};
#define NGROUPS (int)(sizeof groups / sizeof groups[0])

#define MAX_PATTERNS 256 /* every suite by name, as tests/run_aarch64.sh full lists them */
static char *patterns[MAX_PATTERNS];
static int bare[MAX_PATTERNS], npatterns;

static int usage(FILE *f, int rc)
{
    fprintf(f, "usage: test_flywheel [--filter PATTERNS] [--list] [GROUP|PATTERN ...]\n"
               "       test_flywheel --print-default\n"
               "PATTERNS: comma-separated fnmatch patterns over the suite names (--list);\n"
               "a bare group name (attn, gdn, ...) means all of its suites. Default: all.\n"
               "FW_TEST_QUICK=1: the smaller sweeps.\n"
               "FW_TEST_TABLES=NAMES: only these kernel tables (comma-separated table names or\n"
               "\"default\"). Default: every table this CPU runs.\n");
    return rc;
}

/* Adds the comma-separated patterns of arg; a bare name (no '.', no wildcard) becomes
 * "name.*". Returns 0 if there are too many. */
static int add_patterns(const char *arg)
{
    const char *s = arg;
    for (;;) {
        size_t n = strcspn(s, ",");
        if (n > 0) {
            if (npatterns == MAX_PATTERNS)
                return 0;
            char *p = malloc(n + 3);
            if (!p)
                return 0;
            memcpy(p, s, n);
            bare[npatterns] = strcspn(s, ".*?[") >= n;
            strcpy(p + n, bare[npatterns] ? ".*" : "");
            patterns[npatterns++] = p;
        }
        if (!s[n])
            return 1;
        s += n + 1;
    }
}

static int selected(const char *name)
{
    if (npatterns == 0)
        return 1;
    for (int i = 0; i < npatterns; i++)
        if (fnmatch(patterns[i], name, 0) == 0)
            return 1;
    return 0;
}

int main(int argc, char **argv)
{
    self_path = argv[0];
    int list = 0, filtered = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--print-default") == 0)
            return print_default();
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0)
            return usage(stdout, 0);
        if (strcmp(a, "--list") == 0) {
            list = 1;
            continue;
        }
        if (strcmp(a, "--filter") == 0 || strncmp(a, "--filter=", 9) == 0) {
            const char *v = a[8] == '=' ? a + 9 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v) {
                fprintf(stderr, "test_flywheel: --filter needs a value\n");
                return usage(stderr, 2);
            }
            a = v;
        } else if (a[0] == '-') {
            fprintf(stderr, "test_flywheel: unknown option '%s'\n", a);
            return usage(stderr, 2);
        }
        filtered = 1;
        if (!add_patterns(a)) {
            fprintf(stderr, "test_flywheel: more than %d patterns\n", MAX_PATTERNS);
            return 2;
        }
    }
    if (filtered && npatterns == 0) {
        fprintf(stderr, "test_flywheel: an empty filter\n");
        return 2;
    }
    /* every pattern must match a suite */
    int nsel = 0, nall = 0;
    for (int i = 0; i < npatterns; i++) {
        int hit = 0;
        for (int g = 0; g < NGROUPS; g++)
            for (const test_suite *t = groups[g]; t->name; t++)
                hit |= fnmatch(patterns[i], t->name, 0) == 0;
        if (!hit) {
            if (bare[i])
                fprintf(stderr, "test_flywheel: no group '%.*s' (--list prints the suites)\n",
                        (int)strlen(patterns[i]) - 2, patterns[i]);
            else
                fprintf(stderr, "test_flywheel: no suite matches '%s' (--list prints them)\n",
                        patterns[i]);
            return 2;
        }
    }
    for (int g = 0; g < NGROUPS; g++)
        for (const test_suite *t = groups[g]; t->name; t++) {
            nall++;
            if (selected(t->name)) {
                nsel++;
                if (list)
                    printf("%s\n", t->name);
            }
        }
    if (list)
        return 0;
    if (!tables_check())
        return 2;

    printf("kernel tables:");
    for (int i = 0; i < fw_isa_count(); i++) {
        const char *name = fw_isa_name(i);
        printf(" %s%s", name, !fw_isa_supported(name) ? " (not on this CPU)"
                              : !test_table(name)     ? " (not tested: FW_TEST_TABLES)"
                                                      : "");
    }
    printf("; default %s%s", fw_isa_default() ? fw_isa_default() : "(none)",
           quick_mode() ? "; quick sweep" : "");
    if (nsel < nall)
        printf("; %d of %d suites", nsel, nall);
    printf("\n");
    fflush(stdout);
    for (int g = 0; g < NGROUPS; g++)
        for (const test_suite *t = groups[g]; t->name; t++)
            if (selected(t->name))
                t->run();
    tally_print();
    for (int i = 0; i < npatterns; i++)
        free(patterns[i]);
    return tally_failed() ? 1 : 0;
}
