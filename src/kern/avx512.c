/* avx512.c: the avx512 kernel table (kern/table.h); compiled with only this ISA's flags. */
#include "../internal.h"
#include "isa_avx512.h"
#define FW_TABLE fw_kernels_avx512
#include "table.h"
