"""FlyWheel attention kernels in C, for CPUs: softmax attention (dense, varlen, paged KV cache)
with flash-attn's calls, MLA decode with FlashMLA's (also in flywheel.mla), Gated DeltaNet and
KDA with flash-linear-attention's calls, and the causal conv1d of the layers around them
(causal-conv1d's calls; fla's in flywheel.fla).

    import torch, flywheel
    out = flywheel.flash_attn_func(q, k, v, causal=True)   # q [b, s, hq, d] torch or numpy

Inputs are numpy arrays or torch CPU tensors (float32, bfloat16, float16) and are read in
place; see each function for the few cases that copy. Softmax attention has a backward:
flash_attn_func and flash_attn_varlen_func are differentiable for torch tensors that require
grad, and flash_attn_backward / flash_attn_varlen_backward compute the gradients directly;
the other calls are forward only.

Errors, one rule for every call:
  * TypeError: a dtype the library does not take (float64 or integer q, k, v, out or caches;
    g, beta or initial_state that are not floating; a state updated in place that is not
    float32; index arrays that are not integers), or not an array at all. When the library
    is the one to find it (q and k of different dtypes) it raises FlywheelDtypeError, which
    is both a TypeError and a FlywheelError.
  * ValueError: bad shapes and values. Errors from the C library raise FlywheelError (a
    ValueError) with the library's status and message (head dim 0: FW_ERR_SHAPE; bad
    cu_seqlens: FW_ERR_SEQLENS, checked before max_seqlen). A read-only numpy array
    (flags.writeable False) that the call would write into (out, a KV cache that k and v are
    appended to, a GDN state updated in place) is refused with a ValueError naming it, before
    anything is written.
  * NotImplementedError: options the library does not have.
"""

from ._lib import (FlywheelDtypeError, FlywheelError, get_num_threads, get_spin_us,
                   set_num_threads, set_spin_us, threading_mode, use_openmp_threads,
                   use_own_threads)
from ._lib import lib as _clib
from . import fla, tpu
from .attention import (flash_attn_backward, flash_attn_func, flash_attn_varlen_backward,
                        flash_attn_varlen_func, flash_attn_with_kvcache)
from .conv import causal_conv1d_fn, causal_conv1d_update
from .layers import (fused_conv1d_gdn, fused_conv1d_gdn_replay, fused_conv1d_kda,
                     fused_conv1d_kda_replay, kda_replay_record_dim, next_replay_lens,
                     replay_record_dim)
from .gated_delta import (GDNReplay, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                          gated_delta_rule_commit, gated_delta_rule_decode,
                          gated_delta_rule_prefill, gated_delta_rule_verify)
from .kda import chunk_kda, fused_recurrent_kda
from .mla import flash_mla_with_kvcache, get_mla_metadata

__version__ = "0.1.0"

__all__ = [
    "FlywheelDtypeError", "FlywheelError", "GDNReplay", "causal_conv1d_fn",
    "causal_conv1d_update", "chunk_gated_delta_rule", "chunk_kda", "fla", "mla", "tpu",
    "flash_attn_backward", "flash_attn_func", "flash_attn_varlen_backward",
    "flash_attn_varlen_func", "flash_attn_with_kvcache", "fused_conv1d_gdn",
    "fused_conv1d_kda", "fused_conv1d_gdn_replay", "fused_conv1d_kda_replay", "replay_record_dim",
    "kda_replay_record_dim", "next_replay_lens",
    "fused_recurrent_gated_delta_rule", "fused_recurrent_kda",
    "gated_delta_rule_commit", "gated_delta_rule_decode", "gated_delta_rule_prefill",
    "gated_delta_rule_verify", "flash_mla_with_kvcache", "get_mla_metadata",
    "get_num_threads", "get_spin_us", "isa_tables", "default_isa", "auto_precision", "set_num_threads",
    "set_spin_us", "threading_mode", "use_openmp_threads", "use_own_threads",
]


def isa_tables():
    """The kernel tables this CPU runs, best last ("portable"; on x86-64 "avx2", "avx512",
    "avx512bf16", "amx"; on AArch64 "neon", "neon_bf16")."""
    names = (_clib.fw_isa_name(i) for i in range(_clib.fw_isa_count()))
    return [n.decode() for n in names if _clib.fw_isa_supported(n)]


def default_isa():
    """The table calls use unless they name one (FLYWHEEL_ISA or the best this CPU runs)."""
    name = _clib.fw_isa_default()
    return name.decode() if name else None


def auto_precision(dtype, isa=None):
    """The products ("bf16" or "f32") that precision=None / "auto" gives inputs of `dtype`
    on table `isa` (None: the default): bf16 products for bf16 inputs on a table with a
    native bf16 dot product on this CPU (amx; neon_bf16, BFMMLA and BFDOT; avx512bf16 on AMD,
    whose vdpbf16ps runs at twice the FMA rate, Intel's at half), f32 products otherwise (the
    other tables emulate the bf16 dot product with f32 FMAs, slower than f32 products and less
    accurate)."""
    bf16 = str(dtype).rsplit(".", 1)[-1] == "bfloat16"
    name = isa.encode() if isa else None
    return "bf16" if bf16 and _clib.fw_isa_native_bf16(name) else "f32"
