/* neon_bf16.c: the neon_bf16 kernel table (kern/table.h): isa_neon.h compiled with FEAT_BF16,
 * whose bf16 pair products run on BFDOT. */
#include "../internal.h"
#include "isa_neon.h"
#define FW_TABLE fw_kernels_neon_bf16
#include "table.h"
