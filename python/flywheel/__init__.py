"""FlyWheel attention kernels in C, for CPUs: softmax attention (dense, varlen, paged KV cache)
with flash-attn's calls, and Gated DeltaNet with flash-linear-attention's calls.

    import torch, flywheel
    out = flywheel.flash_attn_func(q, k, v, causal=True)   # q [b, s, hq, d] torch or numpy

Forward only. Inputs are numpy arrays or torch CPU tensors (float32, bfloat16, float16) and
are read in place; see each function for the few cases that copy. Errors from the C library
raise FlywheelError (a ValueError) with the library's message; options the library does not
have raise NotImplementedError.
"""

from ._lib import FlywheelError, get_num_threads, set_num_threads
from ._lib import lib as _clib
from .attention import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .gated_delta import (GDNReplay, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                          gated_delta_rule_commit, gated_delta_rule_decode,
                          gated_delta_rule_verify)

__version__ = "0.1.0"

__all__ = [
    "FlywheelError", "GDNReplay", "chunk_gated_delta_rule", "flash_attn_func",
    "flash_attn_varlen_func", "flash_attn_with_kvcache", "fused_recurrent_gated_delta_rule",
    "gated_delta_rule_commit", "gated_delta_rule_decode", "gated_delta_rule_verify",
    "get_num_threads", "isa_tables", "default_isa", "set_num_threads",
]


def isa_tables():
    """The kernel tables this CPU runs, best last ("portable", "avx2", "avx512",
    "avx512bf16")."""
    names = (_clib.fw_isa_name(i) for i in range(_clib.fw_isa_count()))
    return [n.decode() for n in names if _clib.fw_isa_supported(n)]


def default_isa():
    """The table calls use unless they name one (FLYWHEEL_ISA or the best this CPU runs)."""
    name = _clib.fw_isa_default()
    return name.decode() if name else None
