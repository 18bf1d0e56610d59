/* test_main.c: runs every test; the last line is "N passed, N failed".
 * `test_flywheel --print-default` prints the default kernel table and what a call on it
 * returns: the FLYWHEEL_ISA test runs this binary again under each value. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "test_util.h"

void test_attn_all(void);
void test_kvcache_all(void);
void test_gdn_all(void);
void test_nan_all(void);

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
static void test_isa_env(const char *self)
{
    for (int i = -1; i < fw_isa_count(); i++) {
        const char *name = i < 0 ? "bogus" : fw_isa_name(i);
        char cmd[1024], line[512] = "";
        snprintf(cmd, sizeof cmd, "FLYWHEEL_ISA=%s '%s' --print-default", name, self);
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

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--print-default") == 0)
        return print_default();
    printf("kernel tables:");
    for (int i = 0; i < fw_isa_count(); i++)
        printf(" %s%s", fw_isa_name(i), fw_isa_supported(fw_isa_name(i)) ? "" : " (not on this CPU)");
    printf("; default %s%s\n", fw_isa_default() ? fw_isa_default() : "(none)",
           quick_mode() ? "; quick sweep" : "");
    /* `test_flywheel [attn|kvcache|gdn|nan]`: one group; no argument: all */
    const char *only = argc > 1 ? argv[1] : "";
    if (!*only)
        test_isa_env(argv[0]);
    if (!*only || strcmp(only, "attn") == 0)
        test_attn_all();
    if (!*only || strcmp(only, "kvcache") == 0)
        test_kvcache_all();
    if (!*only || strcmp(only, "gdn") == 0)
        test_gdn_all();
    if (!*only || strcmp(only, "nan") == 0)
        test_nan_all();
    tally_print();
    return tally_failed() ? 1 : 0;
}
