"""flash-linear-attention's short-convolution calls (fla.modules.convolution) and its KDA calls
(fla.ops.kda: chunk_kda, fused_recurrent_kda, from flywheel.kda), on the C
library's fw_conv1d_fwd: channel-last [B, T, D] inputs, conv caches of the kernel width W
([N, D, W]: a sequence's last W inputs, oldest first; the conv reads the last W - 1),
residual added after the activation.

    y, final_state = flywheel.fla.causal_conv1d(x, weight, activation="silu", cu_seqlens=cu)
    y, cache = flywheel.fla.causal_conv1d_update(x_t, cache, weight=weight, activation="silu")

Computed in float32, outputs rounded once; dtypes and errors as everywhere in flywheel.
"""

from . import _tensors as T
from .conv import bias_1d, params, run, state, swap12, weight_2d
from .kda import chunk_kda, fused_recurrent_kda


def _channels_last(x, D, name):
    """x [B, T, D] or [B, T, ...] whose trailing dims hold D channels, as [B, T, D]."""
    if x.ndim < 3:
        raise ValueError(f"{name} must be [B, T, D], got shape {tuple(x.shape)}")
    if x.ndim > 3:
        x = x.reshape(tuple(x.shape[:2]) + (-1,))
    if x.shape[2] != D:
        raise ValueError(f"{name} has {x.shape[2]} channels, weight {D}")
    return x


def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None,
                  output_final_state=False, activation=None, backend=None, cu_seqlens=None,
                  **kwargs):
    """fla's causal_conv1d: returns (y, final_state).

    x [B, T, D] (or [B, T, H, K] with H K = D); weight [D, W]; bias [D]; residual [B, T, D],
    added after the activation; initial_state [N, D, W] (N sequences: B, or the packed
    sequences of cu_seqlens, B = 1); output_final_state: final_state [N, D, W], a sequence's
    last W inputs (entries before its first token taken from its initial state, or 0).
    backend is accepted and ignored (one CPU implementation).
    """
    for name in kwargs:
        raise NotImplementedError(f"argument {name!r} is not supported")
    if weight is None:
        raise ValueError("weight is required ([D, W])")
    x = T.float_array(x, "x")
    w0 = T.float_array(weight, "weight")
    D = w0.shape[0] if w0.ndim >= 1 else 0
    w = weight_2d(w0, D)
    b = bias_1d(bias, D)
    W = w.shape[1]
    shape = tuple(x.shape)
    xv = _channels_last(x, D, "x")
    B, L = xv.shape[0], xv.shape[1]
    cu = None
    n = B
    if cu_seqlens is not None:
        cu = T.index_array(cu_seqlens, "cu_seqlens")
        if cu.ndim != 1 or cu.size < 1:
            raise ValueError(f"cu_seqlens must be 1-D with N + 1 entries, got shape {cu.shape}")
        n = cu.size - 1
    res = None
    if residual is not None:
        res = _channels_last(T.float_array(residual, "residual"), D, "residual")
    init = final = None
    if initial_state is not None:
        ist = T.float_array(initial_state, "initial_state")
        if ist.ndim != 3 or ist.shape[0] != n or ist.shape[1] != D:
            raise ValueError(f"initial_state must be [N, D, W] = {(n, D, W)}, got shape "
                             f"{tuple(ist.shape)}")
        init = state(swap12(ist))
    fs = None
    if output_final_state:
        fs = T.empty_like_family(x, (n, D, W))
        final = state(swap12(fs))
    y = T.empty_like_family(x, (B, L, D))
    run(xv, w, b, cu, n, init, final, res, y, params(activation, None))
    return y.reshape(shape), fs


def causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None):
    """fla's one-token step: cache [N, D, W] (a sequence's last W inputs) shifted by one with
    x appended, in place; y = act(bias + sum_w weight[:, w] cache[:, :, w]) (+ residual).
    x [N, D] (or [N, 1, D]). Returns (y, cache)."""
    if weight is None:
        raise ValueError("weight is required ([D, W])")
    x = T.float_array(x, "x")
    shape = tuple(x.shape)
    x2 = x.reshape(shape[0], -1) if x.ndim != 2 else x
    N, D = x2.shape
    w = weight_2d(weight, D)
    b = bias_1d(bias, D)
    c = T.check_writable(T.float_array(cache, "cache", inplace=True), "cache")
    if c.ndim != 3 or c.shape[0] != N or c.shape[1] != D:
        raise ValueError(f"cache must be [N, D, W] = {(N, D, w.shape[1])}, got {tuple(c.shape)}")
    res = None
    if residual is not None:
        res = T.float_array(residual, "residual").reshape(N, 1, D)
    y = T.empty_like_family(x, (N, 1, D))
    cv = swap12(c)
    s = state(cv)
    run(x2.reshape(N, 1, D), w, b, None, N, s, s, res, y, params(activation, None))
    return y.reshape(shape), cache


__all__ = ["causal_conv1d", "causal_conv1d_update", "chunk_kda", "fused_recurrent_kda"]
