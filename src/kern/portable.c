/* portable.c: the portable kernel table (see attn_kern.h); compiled with only this ISA's flags. */
#include "../internal.h"
#include "isa_portable.h"
#define FW_TABLE fw_kernels_portable
#include "attn_kern.h"
