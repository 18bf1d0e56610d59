"""Causal depthwise conv1d with the names, arguments and layouts of the `causal-conv1d`
package (what transformers and vLLM call), on the C library's fw_conv1d_fwd.

    out[b, c, t] = act(bias[c] + sum_k weight[c, k] * x[b, c, t - (W-1) + k])

x is read where it lies (any strides: transformers passes a transposed channel-last view,
which is read in place); weight [dim, width] (or [dim, 1, width], nn.Conv1d's), bias [dim].
Computed in float32, out rounded once. Dtypes: float32, bfloat16, float16 (numpy or torch
CPU); errors as everywhere in flywheel (see the package docstring).
"""

import numpy as np

from . import _lib
from . import _tensors as T

# the compiled fast path's dispatch of calls below, from their description (_calls.py): call it
# with the function's locals() where the call is offered; NotImplemented: the Python path runs it
_fast_update = _lib.fast_call("causal_conv1d_update")


def activation_code(activation):
    if activation is None:
        return 0
    if activation in ("silu", "swish"):
        return 1
    raise NotImplementedError(f"activation must be None, silu, or swish, got {activation!r}")


def params(activation, isa):
    p = _lib.Conv1dParams()
    p.activation = activation_code(activation)
    p.threads = _lib.settings.threads
    p.isa = _lib.isa_name(isa)
    return p


def swap12(x):
    """x [a, b, c] as a [a, c, b] view (no copy)."""
    return x.transpose(1, 2) if T.is_torch(x) else np.swapaxes(x, 1, 2)


def weight_2d(weight, D):
    """weight [D, W] or [D, 1, W] as a [D, W] view."""
    w = T.float_array(weight, "weight")
    if w.ndim == 3 and w.shape[1] == 1:
        w = w[:, 0]
    if w.ndim != 2 or w.shape[0] != D:
        raise ValueError(f"weight must be [dim, width] = [{D}, width] (or [dim, 1, width]), got "
                         f"shape {tuple(w.shape)}")
    return w


def bias_1d(bias, D):
    if bias is None:
        return None
    b = T.float_array(bias, "bias")
    if b.ndim != 1 or b.shape[0] != D:
        raise ValueError(f"bias must be [dim] = [{D}], got shape {tuple(b.shape)}")
    return b


def state(cache_view, idx=None, offsets=None):
    """An fw_conv1d_state over a [slots, S, D] view with optional int32 indices and offsets."""
    s = _lib.Conv1dState()
    s.cache = T.describe(cache_view)
    s.idx = T.ptr(idx)
    s.offsets = T.ptr(offsets)
    return s


def run(xv, w, b, cu, n, init, final, residual, ov, p):
    """fw_conv1d_fwd on [B, L, D] views (init, final: fw_conv1d_state or None)."""
    _lib.check(_lib.lib.fw_conv1d_fwd(
        T.describe(xv), T.describe(w), None if b is None else T.describe(b), T.ptr(cu), n,
        None if init is None else init, None if final is None else final,
        None if residual is None else T.describe(residual), T.describe(ov), p))


def _channel_last(x):
    """x [B, D, L] whose channels are adjacent in memory (a transposed [B, L, D])."""
    st = x.stride() if T.is_torch(x) else tuple(s // x.itemsize for s in x.strides)
    return x.shape[1] > 1 and st[1] == 1


def _rows_of(seq_idx, B, L):
    """Per batch row, int32 cu_seqlens of the runs of equal seq_idx (which must not
    decrease along a row)."""
    idx = T.index_array(seq_idx, "seq_idx")
    if idx.shape != (B, L):
        raise ValueError(f"seq_idx must be [batch, seqlen] = {(B, L)}, got {idx.shape}")
    rows = []
    for r in idx:
        if np.any(np.diff(r.astype(np.int64)) < 0):
            raise ValueError("seq_idx must not decrease along a row (sequences packed in order)")
        starts = np.flatnonzero(np.diff(r)) + 1
        rows.append(np.concatenate(([0], starts, [L])).astype(np.int32))
    return rows


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None, *,
                     out=None, isa=None):
    """causal-conv1d's forward over a batch.

    x [batch, dim, seqlen]; weight [dim, width]; bias [dim]; activation None, "silu" or
    "swish". seq_idx [batch, seqlen] (int32): sequences packed along a row, each convolved
    on its own (no initial or final states then, as in causal-conv1d). initial_states
    [batch, dim, S] (S >= width - 1; its last width - 1 entries are used); with
    return_final_states, returns (out, final_states) where final_states [batch, dim,
    width - 1] holds each row's last width - 1 inputs (final_states_out: an existing array to
    fill). out: an existing [batch, dim, seqlen] array to write and return; without it, out
    has x's memory layout (channel-last for a channel-last x, as torch.empty_like gives).
    """
    x = T.float_array(x, "x")
    if x.ndim != 3:
        raise ValueError(f"x must be [batch, dim, seqlen], got shape {tuple(x.shape)}")
    B, D, L = x.shape
    w = weight_2d(weight, D)
    b = bias_1d(bias, D)
    W = w.shape[1]
    p = params(activation, isa)
    if out is None and _channel_last(x):
        # as causal-conv1d's empty_like(x): a channel-last x gets a channel-last out
        o = swap12(T.empty_like_family(x, (B, L, D)))
    else:
        o = T.output(out, x, (B, D, L))
    if tuple(o.shape) != (B, D, L):
        raise ValueError(f"out must be [batch, dim, seqlen] = {(B, D, L)}, got {tuple(o.shape)}")
    xv, ov = swap12(x), swap12(o)
    if seq_idx is not None:
        if initial_states is not None or return_final_states:
            raise ValueError("seq_idx cannot be combined with initial_states or "
                             "return_final_states (as in causal-conv1d)")
        for r, cu in enumerate(_rows_of(seq_idx, B, L)):
            run(xv[r:r + 1], w, b, cu, len(cu) - 1, None, None, None, ov[r:r + 1], p)
        return o
    init = final = None
    keep = []
    if initial_states is not None:
        ist = T.float_array(initial_states, "initial_states")
        if ist.ndim != 3 or ist.shape[0] != B or ist.shape[1] != D:
            raise ValueError(f"initial_states must be [batch, dim, width - 1] = {(B, D, W - 1)}, "
                             f"got shape {tuple(ist.shape)}")
        keep.append(ist)
        init = state(swap12(ist))
    fs = None
    if return_final_states:
        if final_states_out is None:
            fs = T.empty_like_family(x, (B, D, W - 1))
        else:
            fs = T.check_writable(T.float_array(final_states_out, "final_states_out",
                                                inplace=True), "final_states_out")
            if tuple(fs.shape) != (B, D, W - 1):
                raise ValueError(f"final_states_out must be [batch, dim, width - 1] = "
                                 f"{(B, D, W - 1)}, got {tuple(fs.shape)}")
        final = state(swap12(fs))
    run(xv, w, b, None, B, init, final, None, ov, p)
    return (o, fs) if return_final_states else o


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, *, out=None, isa=None):
    """causal-conv1d's decode step: x's tokens appended to conv_state in place.

    x [batch, dim] or [batch, dim, seqlen]; conv_state [batch or slots, dim, state_len]
    (state_len >= width - 1), updated in place: without cache_seqlens it holds the last
    state_len inputs, oldest first; with cache_seqlens [batch] it is circular, a row's next
    write position being cache_seqlens mod state_len. conv_state_indices [batch] (int32)
    picks each row's slot (a negative index: start from zeros and write nothing). Returns out
    with x's shape.
    """
    r = _fast_update(locals())
    if r is not NotImplemented:
        return r
    x = T.float_array(x, "x")
    if x.ndim not in (2, 3):
        raise ValueError(f"x must be [batch, dim] or [batch, dim, seqlen], got {tuple(x.shape)}")
    x3 = x[:, :, None] if x.ndim == 2 else x
    B, D, L = x3.shape
    cs = T.check_writable(T.float_array(conv_state, "conv_state", inplace=True), "conv_state")
    if cs.ndim != 3 or cs.shape[1] != D:
        raise ValueError(f"conv_state must be [batch, dim, state_len] with dim {D}, got shape "
                         f"{tuple(cs.shape)}")
    w = weight_2d(weight, D)
    b = bias_1d(bias, D)
    idx = None
    if conv_state_indices is not None:
        idx = T.index_array(conv_state_indices, "conv_state_indices")
        if idx.shape != (B,):
            raise ValueError(f"conv_state_indices must have {B} entries, got {idx.shape}")
    elif cs.shape[0] < B:
        raise ValueError(f"conv_state has {cs.shape[0]} rows for a batch of {B}")
    read_off = write_off = None
    if cache_seqlens is not None:
        read_off = T.index_array(cache_seqlens, "cache_seqlens")
        if read_off.shape != (B,):
            raise ValueError(f"cache_seqlens must have {B} entries, got {read_off.shape}")
        write_off = (read_off.astype(np.int64) + L) % max(cs.shape[2], 1)
        write_off = write_off.astype(np.int32)
    o = T.output(out, x, tuple(x.shape))
    if tuple(o.shape) != tuple(x.shape):
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(o.shape)}")
    o3 = o[:, :, None] if o.ndim == 2 else o
    cv = swap12(cs)
    st_in, st_out = state(cv, idx, read_off), state(cv, idx, write_off)
    run(swap12(x3), w, b, None, B, st_in, st_out, None, swap12(o3), params(activation, isa))
    return o
