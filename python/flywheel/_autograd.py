"""torch autograd for flywheel's attention (imported on the first differentiable call).

flash_attn_func and flash_attn_varlen_func route torch inputs that require grad here: the
forward runs as usual and saves out and lse, the backward is flash_attn_backward /
flash_attn_varlen_backward (the library's fw_attn_bwd) with the forward's precision (bf16
products for bf16 inputs by default, flywheel.auto_precision). lse is returned non-differentiable.
Gradients come back in the dtypes of q, k and v. Double backward is not supported.
"""

import torch

from . import attention as _attn


class _Dense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, softcap, isa, plain, precision):
        out, lse = _attn.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                         window_size=window, softcap=softcap,
                                         return_softmax_lse=True, isa=isa, plain=plain,
                                         precision=precision)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = dict(softmax_scale=scale, causal=causal, window_size=window,
                           softcap=softcap, isa=isa, plain=plain, precision=precision)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _attn.flash_attn_backward(dout, q, k, v, out, lse, **ctx.options)
        return (dq, dk, dv) + (None,) * 7


class _Varlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, isa,
                precision):
        out, lse = _attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                softmax_scale=scale, causal=causal,
                                                window_size=window, softcap=softcap,
                                                return_softmax_lse=True, isa=isa,
                                                precision=precision)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu = (cu_q, cu_k, max_q, max_k)
        ctx.options = dict(softmax_scale=scale, causal=causal, window_size=window,
                           softcap=softcap, isa=isa, precision=precision)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _attn.flash_attn_varlen_backward(dout, q, k, v, out, lse, *ctx.cu,
                                                      **ctx.options)
        return (dq, dk, dv) + (None,) * 10


def dense(q, k, v, scale, causal, window, softcap, isa, plain, precision):
    """(out, lse) of flash_attn_func, recorded for autograd."""
    return _Dense.apply(q, k, v, scale, causal, tuple(window), softcap, isa, plain, precision)


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, isa, precision):
    """(out, lse) of flash_attn_varlen_func, recorded for autograd."""
    return _Varlen.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, tuple(window), softcap,
                         isa, precision)
