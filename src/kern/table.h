/*
 * kern/table.h: one ISA's whole kernel table, FW_TABLE: every op's kernel file compiled over
 * the vector layer that the including table file chose. A table file (kern/<isa>.c) includes
 * ../internal.h and its isa_<isa>.h, names FW_TABLE and includes this; it is compiled with
 * only its ISA's flags. A new op adds its kernel file here and its sub-table below.
 */
#include "isa.h"
#include "kern_util.h"
#include "cvt_kern.h"
#include "mm_kern.h"
#include "peak_kern.h"
#include "../attn/attn_kern.h"
#include "../attn/dec_kern.h"
#include "../attn/bwd_kern.h"
#include "../attn/rope_kern.h"
#include "../conv/conv_kern.h"
#include "../gdn/gdn_kern.h"

const fw_kernels FW_TABLE = {
    .name = ISA_NAME,
    .vl = VL,
    .bk = 64,
#if defined(__AVX512BF16__) || defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
    .native_bf16 = FW_BF16_DOT,
#endif
    .cvt = FW_CVT_TABLE,
    .mm = FW_MM_TABLE,
    .peak = FW_PEAK_TABLE,
    .attn = FW_ATTN_TABLE,
    .dec = FW_DEC_TABLE,
    .bwd = FW_BWD_TABLE,
    .rope = FW_ROPE_TABLE,
    .gdn = FW_GDN_TABLE,
    .conv = FW_CONV_TABLE,
};
