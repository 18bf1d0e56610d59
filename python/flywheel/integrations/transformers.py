"""flywheel's kernels inside Hugging Face transformers, with no edit to its source.

    import flywheel.integrations.transformers as fwt
    fwt.enable(model)          # or fwt.enable() before loading, then attn_implementation="flywheel"

- Attention: `flywheel` is registered in transformers' AttentionInterface (and its mask in
  AttentionMaskInterface, built as sdpa's, so a mask that is pure causality arrives as None).
  Calls without a mask run flywheel.flash_attn_func on the [b, h, s, d] views transposed in
  place (causal as sdpa's is_causal: top-left, so a prompt against an empty static cache
  attends to its own rows; one query token attends to every key). Tensors that need
  gradients take flywheel's backward (flash_attn_func is differentiable).
  Padded batches (left or right padding), a prefill after a cache and a static cache's
  unused rows: where the causal mask is causality plus one contiguous run of real tokens per
  sequence, the mask function (sdpa's, same tensor) also records each sequence's run, and
  attention makes one flash_attn_func call a sequence on its real queries and keys (views,
  no copies), causal aligned bottom-right; the rows of padding tokens come out zero, as
  flash-attn's unpadded path gives them. Softcaps and sliding windows (Gemma 2/3, Mistral,
  gpt-oss) are flywheel's too: a local mask is taken once it is checked to be causality,
  padding and the layer's window. Attention sinks (gpt-oss: the layer's `sinks`, which it
  passes as s_aux) become flywheel's sinks=, with their gradient where they require grad.
  Calls flywheel cannot serve the same way go to transformers' sdpa (the model's eager
  attention where a softcap or sinks are set: sdpa refuses the one and ignores the other):
  other masks (padding with holes, chunked attention, custom mask functions, masks on
  tensors that need gradients), dropout, bidirectional sliding windows.
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
import sys
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


def _runs(pad, batch, sk, q0, sq):
    """Per sequence (r0, r1, k0, k1): its real query rows [r0, r1) and the keys [k0, k1)
    they see, causal aligned bottom-right (k1 - 1 is the last real query's own position),
    for a causal mask over key positions 0 .. sk-1 with query row i at position q0 + i and
    pad [batch, sk] (None: no padding) the real tokens. None where a sequence's real tokens
    are not one contiguous run, or the queries do not lie within the keys."""
    import torch
    if q0 < 0 or q0 + sq > sk:
        return None
    if pad is None:
        lo, hi = [0] * batch, [sk] * batch
    else:
        pad = pad.to(torch.bool)
        if tuple(pad.shape) != (batch, sk):
            return None
        idx = torch.arange(sk, device=pad.device)
        first = torch.where(pad, idx, sk).min(1).values
        last = torch.where(pad, idx, -1).max(1).values
        count = pad.sum(1)
        if not bool(((count == 0) | (count == last - first + 1)).all()):
            return None
        lo = torch.where(count > 0, first, 0).tolist()
        hi = torch.where(count > 0, last + 1, 0).tolist()
    runs = []
    for a, b in zip(lo, hi):
        qlo, qhi = max(a, q0), min(b, q0 + sq)
        runs.append((qlo - q0, qhi - q0, a, qhi) if qhi > qlo else (0, 0, 0, 0))
    return tuple(runs)


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
          attention_mask=None, **kwargs):
    """AttentionMaskInterface entry: sdpa's mask (the same tensor, or None for plain
    causality), plus, for a causal mask whose real tokens are one run per sequence, the runs
    as the tensor's attribute `_flywheel_runs` for attention(). Whatever else sees the mask
    (sdpa when attention falls back to it, a model's own code) sees sdpa's."""
    import torch
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask
    if mask_function is None:
        mask_function = causal_mask_function
    m = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                  q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                  attention_mask=attention_mask, **kwargs)
    window = kwargs.get("local_size") if mask_function is not causal_mask_function else None
    if (m is None or (mask_function is not causal_mask_function and window is None) or
            torch.compiler.is_compiling() or
            isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor)):
        return m
    pad = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if pad is not None:
        pad = pad[:, kv_offset:kv_offset + kv_length]
    q0 = q_offset - kv_offset
    runs = _runs(pad, batch_size, kv_length, q0, q_length)
    if runs is None:
        return m
    if window is not None:
        # A local mask (sliding_window_causal_mask_function, or a chunked one: the function
        # does not say which) is taken only if it is causality, the padding and a window of
        # `window` keys: key j seen by query position p iff p - window < j <= p.
        j = torch.arange(kv_length, device=m.device)
        p = torch.arange(q_length, device=m.device)[:, None] + q0
        want = (j <= p) & (j > p - window)
        want = want[None, None] if pad is None else want[None, None] & pad[:, None, None, :].bool()
        if not torch.equal(m, want.expand_as(m)):
            return m
    m._flywheel_runs = (runs, window)
    return m


# Query rows up to which a padded batch whose real rows all end at the last row (left padding:
# decode steps, speculative tokens) takes one KV-cache call with cache_leftpad instead of a
# call per sequence: the padding query rows are computed too, and zeroed after.
_ONE_CALL_ROWS = 16


def _attend_runs(query, key, value, runs, scaling, **kw):
    """One causal flash_attn_func call per sequence on its run (see _runs), other rows zero;
    one call for the batch when every sequence has all its rows real and the same keys (no
    padding, or the same left padding before a cache's new rows), or, for a few query rows
    ending at the last (left padding), one flash_attn_with_kvcache call on the keys as a
    contiguous cache, each sequence's context from its first real key (cache_leftpad)."""
    import torch
    b, hq, sq, _ = query.shape
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    out = _output("attention", (b, sq, hq, value.shape[3]), query.dtype)
    if out is None:
        out = torch.empty((b, sq, hq, value.shape[3]), dtype=query.dtype)
    r0, r1, k0, k1 = runs[0]
    if r0 == 0 and r1 == sq and all(r == runs[0] for r in runs):  # every row, the same keys
        return flywheel.flash_attn_func(q, k[:, k0:k1], v[:, k0:k1], softmax_scale=scaling,
                                        causal=True, out=out, **kw)
    if sq <= _ONE_CALL_ROWS and all(r[1] == sq or r[1] == r[0] for r in runs):
        real = [r[1] > r[0] for r in runs]
        ends = torch.tensor([r[3] if x else 0 for r, x in zip(runs, real)], dtype=torch.int32)
        pads = torch.tensor([r[2] if x else 0 for r, x in zip(runs, real)], dtype=torch.int32)
        flywheel.flash_attn_with_kvcache(q, k, v, cache_seqlens=ends, cache_leftpad=pads,
                                         softmax_scale=scaling, causal=True, out=out, **kw)
        for i, (r0, r1, _, _) in enumerate(runs):
            out[i, :r0 if r1 > r0 else sq] = 0
        return out
    for i, (r0, r1, k0, k1) in enumerate(runs):
        out[i, :r0] = 0
        out[i, r1:] = 0
        if r1 > r0:
            flywheel.flash_attn_func(q[i:i + 1, r0:r1], k[i:i + 1, k0:k1], v[i:i + 1, k0:k1],
                                     softmax_scale=scaling, causal=True,
                                     out=out[i:i + 1, r0:r1], **kw)
    return out


def _fallback(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa; with a softcap, which sdpa refuses, or sinks (s_aux), which it
    ignores, the model's own eager attention (its modeling module's eager_attention_forward,
    which takes them)."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager(module, query, key, value, attention_mask, **kwargs)
    return _sdpa(module, query, key, value, attention_mask, **kwargs)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
              **kwargs):
    """transformers' attention-function contract: query [b, hq, sq, d], key/value
    [b, hkv, sk, d]; returns (out [b, sq, hq, d], None). kwargs softcap (flash-attn's),
    sliding_window (key j seen from position p iff p - sliding_window < j <= p) and s_aux
    (attention sinks [hq], gpt-oss's) are served."""
    sw, cap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    runs = None
    if attention_mask is not None:
        runs, window = getattr(attention_mask, "_flywheel_runs", (None, None))
        if (runs is not None and (len(runs) != query.shape[0] or window != sw or
                                  _needs_grad(query, key, value, sinks) or
                                  max(r[3] for r in runs) > key.shape[2])):
            runs = None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if ((attention_mask is not None and runs is None) or dropout or
            kwargs.get("output_attentions") or (sw is not None and not causal)):
        return _fallback(module, query, key, value, attention_mask, dropout=dropout,
                         scaling=scaling, is_causal=is_causal, **kwargs)
    kw = {"softcap": float(cap) if cap else 0.0, "sinks": sinks}
    if sw is not None:
        kw["window_size"] = (int(sw) - 1, 0)
    if runs is not None:
        return _attend_runs(query, key, value, runs, scaling, **kw), None
    sq, sk = query.shape[2], key.shape[2]
    causal = bool(causal) and sq > 1
    if causal and sk > sq:  # sdpa's top-left causality: the keys past the queries are unused
        key, value = key[:, :, :sq], value[:, :, :sq]
    q = query.transpose(1, 2)
    out = None if _needs_grad(query, key, value, sinks) else _output(
        "attention", (q.shape[0], q.shape[1], q.shape[2], value.shape[3]), q.dtype)
    out = flywheel.flash_attn_func(q, key.transpose(1, 2), value.transpose(1, 2),
                                   softmax_scale=scaling, causal=causal, out=out, **kw)
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
    with torch's for the cores (docs/threads.md)."""
    _reuse["on"] = bool(reuse_outputs)
    if share_threads:
        import torch
        try:
            flywheel.use_openmp_threads(torch.get_num_threads())
            _threads["shared"] = True
        except NotImplementedError:  # a build without OpenMP: the library's pool
            pass
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(_NAME, attention)
    AttentionMaskInterface.register(_NAME, _mask)
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
