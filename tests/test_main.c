/* test_main.c: runs every test; the last line is "N passed, N failed". */
#include <stdio.h>
#include "test_util.h"

void test_attn_all(void);

int main(void)
{
    printf("kernel tables:");
    for (int i = 0; i < fw_isa_count(); i++)
        printf(" %s%s", fw_isa_name(i), fw_isa_supported(fw_isa_name(i)) ? "" : " (not on this CPU)");
    printf("; default %s%s\n", fw_isa_default() ? fw_isa_default() : "(none)",
           quick_mode() ? "; quick sweep" : "");
    test_attn_all();
    tally_print();
    return tally_failed() ? 1 : 0;
}
