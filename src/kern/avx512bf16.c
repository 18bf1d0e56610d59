/* avx512bf16.c: the avx512bf16 kernel table: the AVX-512 vector layer with AVX512_BF16, so
 * bf16 products run on vdpbf16ps (kern/table.h); compiled with only this ISA's flags. */
#include "../internal.h"
#include "isa_avx512.h"
#define FW_TABLE fw_kernels_avx512bf16
#include "table.h"
