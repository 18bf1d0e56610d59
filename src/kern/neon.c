/* neon.c: the neon kernel table (kern/table.h): Armv8.0-A Advanced SIMD, the AArch64 baseline. */
#include "../internal.h"
#include "isa_neon.h"
#define FW_TABLE fw_kernels_neon
#include "table.h"
