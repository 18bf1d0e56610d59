"""flywheel's kernels inside Hugging Face transformers, with no edit to its source.

    import flywheel.integrations.transformers as fwt
    fwt.enable(model)          # or fwt.enable() before loading, then attn_implementation="flywheel"

- Attention: `flywheel` is registered in transformers' AttentionInterface (and its mask in
  AttentionMaskInterface, built as sdpa's, so a mask that is pure causality arrives as None).
  Calls without a mask run flywheel.flash_attn_func on the [b, h, s, d] views transposed in
  place (causal as sdpa's is_causal: top-left, so a prompt against an empty static cache
  attends to its own rows; one query token attends to every key). Tensors that need
  gradients take flywheel's backward (flash_attn_func is differentiable). Calls flywheel
  cannot serve the same way go to transformers' sdpa: an explicit mask (padding, chunked
  prefill after a cache), dropout, softcap, sliding windows.
- Gated DeltaNet layers (Qwen3-Next, Qwen3.5 and their MoE variants, which look these names up
  in their module at call time): causal_conv1d_fn / causal_conv1d_update become flywheel's,
  torch_chunk_gated_delta_rule flywheel.chunk_gated_delta_rule, and
  torch_recurrent_gated_delta_rule the decode step, which updates the cache's float32 (or
  bf16) state in place (gated_delta_rule_decode) and returns it as the final state. These are
  forward-only: with tensors that need gradients they call transformers' own functions
  (training a hybrid model runs flywheel's attention, forward and backward, and torch's Gated
  DeltaNet).

- Outputs are reused: a call's output array is kept (one per shape, dtype and layout, per
  thread) and written again by a later call with the same shape once nothing else refers to
  its memory (torch's storage use count: no tensor, view or storage object besides the kept
  one). A model layer's conv, Gated DeltaNet and attention outputs are dead when the next
  layer runs, so a prefill allocates each once instead of once a layer. This is what made the
  difference inside a model: a fresh 128 MiB output is faulted in huge page by huge page,
  and with the heap churned by a model's step the kernel zeroed and compacted memory for
  250-360 ms of CPU during a 20 ms conv (Qwen3-Next-style model, 8K prompt, bf16; e2e.py).
  enable(reuse_outputs=False) turns it off; disable() drops the kept arrays.

disable() puts transformers' functions back.
"""

import functools
import importlib
import threading
import weakref

import flywheel

_NAME = "flywheel"
_GDN_MODULES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
_saved = {}
_reuse = {"on": True}
_kept = threading.local()  # .box: this thread's _Kept
_kept_all = weakref.WeakSet()  # every live thread's _Kept, for disable()
_kept_lock = threading.Lock()
_KEPT_MAX = 8  # arrays kept per thread (the oldest goes first)


def _use_count(t):
    import torch
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Kept:
    """One thread's kept outputs: {(kind, shape, stride, dtype): tensor}, oldest first."""
    __slots__ = ("arrays", "__weakref__")

    def __init__(self):
        self.arrays = {}


@functools.lru_cache(maxsize=None)
def _unshared_count():
    """The storage use count of a tensor nothing else refers to (the tensor, plus the storage
    object the query makes), or None where this torch cannot tell."""
    import torch
    try:
        return _use_count(torch.empty(1))
    except (AttributeError, RuntimeError):
        return None


def _output(kind, shape, dtype, like=None):
    """An output array for a call: the one kept for (kind, shape, layout, dtype) if nothing
    refers to it any more, else a new one (torch.empty_like(like) when given, to keep its
    layout, else contiguous), kept in its place. None (the callee allocates) when reuse is
    off or this torch cannot tell whether an array is referred to."""
    import torch
    if not _reuse["on"] or _unshared_count() is None:
        return None
    shape = tuple(shape)
    key = (kind, shape, None if like is None else tuple(like.stride()), dtype)
    box = getattr(_kept, "box", None)
    if box is None:
        box = _kept.box = _Kept()
        with _kept_lock:
            _kept_all.add(box)
    arrays = box.arrays
    out = arrays.get(key)
    if out is not None and _use_count(out) == _unshared_count():
        return out
    out = torch.empty_like(like) if like is not None else torch.empty(shape, dtype=dtype)
    arrays.pop(key, None)
    arrays[key] = out
    while len(arrays) > _KEPT_MAX:
        del arrays[next(iter(arrays))]
    return out


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(*args, **kwargs)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
              **kwargs):
    """transformers' attention-function contract: query [b, hq, sq, d], key/value
    [b, hkv, sk, d]; returns (out [b, sq, hq, d], None)."""
    if (attention_mask is not None or dropout or kwargs.get("softcap") is not None or
            kwargs.get("sliding_window") is not None or kwargs.get("output_attentions")):
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)
    sq, sk = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and sq > 1
    if causal and sk > sq:  # sdpa's top-left causality: the keys past the queries are unused
        key, value = key[:, :, :sq], value[:, :, :sq]
    q = query.transpose(1, 2)
    out = None if _needs_grad(query, key, value) else _output(
        "attention", (q.shape[0], q.shape[1], q.shape[2], value.shape[3]), q.dtype)
    out = flywheel.flash_attn_func(q, key.transpose(1, 2), value.transpose(1, 2),
                                   softmax_scale=scaling, causal=causal, out=out)
    return out, None


def _original(fn):
    """transformers' own function `fn` that enable() replaced."""
    for (_, name), orig in _saved.items():
        if name == fn:
            return orig
    raise NotImplementedError(f"{fn}: transformers' function was not saved (call enable())")


def _needs_grad(*xs):
    import torch
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                           for x in xs)


def _chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                            output_final_state=False, use_qk_l2norm_in_kernel=False,
                            cu_seqlens=None, **kwargs):
    if _needs_grad(query, key, value, g, beta, initial_state):
        return _original("torch_chunk_gated_delta_rule")(
            query, key, value, g, beta, chunk_size=chunk_size, initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    return flywheel.chunk_gated_delta_rule(query, key, value, g, beta,
                                           initial_state=initial_state,
                                           output_final_state=output_final_state,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                           cu_seqlens=cu_seqlens,
                                           out=_output("gdn", value.shape, value.dtype))


def _recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None,
                                output_final_state=False, use_qk_l2norm_in_kernel=False,
                                cu_seqlens=None, **kwargs):
    import torch
    if _needs_grad(query, key, value, g, beta, initial_state):
        return _original("torch_recurrent_gated_delta_rule")(
            query, key, value, g, beta, initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    B, S, _, K = query.shape
    HV, V = value.shape[2], value.shape[3]
    if (S == 1 and cu_seqlens is None and isinstance(initial_state, torch.Tensor) and
            initial_state.dtype in (torch.float32, torch.bfloat16) and
            initial_state.is_contiguous() and tuple(initial_state.shape) == (B, HV, K, V) and
            not initial_state.requires_grad):
        o = flywheel.gated_delta_rule_decode(query, key, value, g, beta, initial_state,
                                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return o, (initial_state if output_final_state else None)
    return flywheel.fused_recurrent_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens)


def _causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    if _needs_grad(hidden_states, weight, bias):
        return _original("causal_conv1d_fn")(hidden_states, weight, bias, activation=activation,
                                             **kwargs)
    return flywheel.causal_conv1d_fn(hidden_states, weight, bias, activation=activation,
                                     out=_output("conv", hidden_states.shape, hidden_states.dtype,
                                                 like=hidden_states))


def _causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    return flywheel.causal_conv1d_update(hidden_states, conv_state, weight, bias,
                                         activation=activation)


_REPLACEMENTS = {
    "causal_conv1d_fn": _causal_conv1d_fn,
    "causal_conv1d_update": _causal_conv1d_update,
    "torch_chunk_gated_delta_rule": _chunk_gated_delta_rule,
    "torch_recurrent_gated_delta_rule": _recurrent_gated_delta_rule,
}


_threads = {}  # "shared": enable() put flywheel's loops on torch's threads


def enable(model=None, reuse_outputs=True, share_threads=True):
    """Register flywheel's attention as attn_implementation "flywheel" and swap the Gated
    DeltaNet layers' kernel functions; with `model`, also switch it to "flywheel".
    reuse_outputs: keep and reuse the kernels' output arrays (see the module docstring).
    share_threads: run flywheel's parallel loops on torch's OpenMP threads
    (flywheel.use_openmp_threads(torch.get_num_threads()), where the package has its OpenMP
    loop; disable() puts the library's own threads back), so that no second pool competes
    with torch's for the cores (README, "Threads inside an engine")."""
    _reuse["on"] = bool(reuse_outputs)
    if share_threads:
        import torch
        try:
            flywheel.use_openmp_threads(torch.get_num_threads())
            _threads["shared"] = True
        except NotImplementedError:  # a build without OpenMP: the library's pool
            pass
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(_NAME, attention)
    AttentionMaskInterface.register(_NAME, sdpa_mask)
    for name in _GDN_MODULES:
        try:
            mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        for fn, new in _REPLACEMENTS.items():
            if hasattr(mod, fn) and getattr(mod, fn) is not new:
                _saved.setdefault((name, fn), getattr(mod, fn))
                setattr(mod, fn, new)
    if model is not None:
        model.set_attn_implementation(_NAME)
    return model


def disable(model=None, attn_implementation="sdpa"):
    """Put transformers' Gated DeltaNet functions back; with `model`, switch its attention to
    `attn_implementation`."""
    for (name, fn), orig in list(_saved.items()):
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        setattr(mod, fn, orig)
        del _saved[(name, fn)]
    if _threads.pop("shared", False):
        flywheel.use_own_threads()
    with _kept_lock:
        for box in list(_kept_all):
            box.arrays.clear()
    if model is not None:
        model.set_attn_implementation(attn_implementation)
    return model


__all__ = ["attention", "disable", "enable"]
