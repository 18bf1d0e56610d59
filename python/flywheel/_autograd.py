"""torch autograd for flywheel's attention (imported on the first differentiable call).

flash_attn_func and flash_attn_varlen_func route torch inputs that require grad here: the
forward runs as usual and saves out and lse, the backward is flash_attn_backward /
flash_attn_varlen_backward (the library's fw_attn_bwd) with the forward's precision (bf16
products for bf16 inputs by default, flywheel.auto_precision). lse is returned non-differentiable.
Gradients come back in the dtypes of q, k and v; that of attention sinks (the library's
dsinks, float32) in the sinks' dtype, where they require grad. Double backward is not
supported.
"""

import torch

from . import _tensors as T
from . import attention as _attn


def _sinks_tensor(sinks):
    """sinks as a tensor save_for_backward takes (None stays None): a numpy array (no
    gradient) as its float32 values, which the library reads as it would the array."""
    if sinks is None or torch.is_tensor(sinks):
        return sinks
    return torch.from_numpy(T.to_numpy_f32(sinks, "sinks"))


def _dsinks(ctx, sinks):
    """A float32 output for the gradient of sinks (input 3) where it is wanted, else None."""
    return torch.empty(sinks.shape, dtype=torch.float32) if ctx.needs_input_grad[3] else None


def _sinks_grad(dsinks, sinks):
    return None if dsinks is None else dsinks.to(sinks.dtype)


class _Dense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, causal, window, softcap, isa, plain, precision):
        out, lse = _attn.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                         window_size=window, softcap=softcap,
                                         return_softmax_lse=True, isa=isa, plain=plain,
                                         precision=precision, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.options = dict(softmax_scale=scale, causal=causal, window_size=window,
                           softcap=softcap, isa=isa, plain=plain, precision=precision)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dsinks = _dsinks(ctx, sinks)
        dq, dk, dv = _attn.flash_attn_backward(dout, q, k, v, out, lse, sinks=sinks,
                                               dsinks=dsinks, **ctx.options)
        return (dq, dk, dv, _sinks_grad(dsinks, sinks)) + (None,) * 7


class _Varlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap,
                isa, precision):
        out, lse = _attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                softmax_scale=scale, causal=causal,
                                                window_size=window, softcap=softcap,
                                                return_softmax_lse=True, isa=isa,
                                                precision=precision, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cu = (cu_q, cu_k, max_q, max_k)
        ctx.options = dict(softmax_scale=scale, causal=causal, window_size=window,
                           softcap=softcap, isa=isa, precision=precision)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dsinks = _dsinks(ctx, sinks)
        dq, dk, dv = _attn.flash_attn_varlen_backward(dout, q, k, v, out, lse, *ctx.cu,
                                                      sinks=sinks, dsinks=dsinks, **ctx.options)
        return (dq, dk, dv, _sinks_grad(dsinks, sinks)) + (None,) * 10


def dense(q, k, v, sinks, scale, causal, window, softcap, isa, plain, precision):
    """(out, lse) of flash_attn_func, recorded for autograd."""
    return _Dense.apply(q, k, v, _sinks_tensor(sinks), scale, causal, tuple(window), softcap,
                        isa, plain, precision)


def varlen(q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, isa,
           precision):
    """(out, lse) of flash_attn_varlen_func, recorded for autograd."""
    return _Varlen.apply(q, k, v, _sinks_tensor(sinks), cu_q, cu_k, max_q, max_k, scale, causal,
                         tuple(window), softcap, isa, precision)
