/* portable.c: the portable kernel table (kern/table.h); compiled with only this ISA's flags. */
#include "../internal.h"
#include "isa_portable.h"
#define FW_TABLE fw_kernels_portable
#include "table.h"
