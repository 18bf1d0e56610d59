/* avx2.c: the avx2 kernel table (kern/table.h); compiled with only this ISA's flags. */
#include "../internal.h"
#include "isa_avx2.h"
#define FW_TABLE fw_kernels_avx2
#include "table.h"
