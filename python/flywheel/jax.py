"""flywheel's attention on JAX arrays, under jax.jit: XLA FFI custom calls (_fwjax.c).

    import flywheel.jax as fj
    out = jax.jit(fj.flash_attn_func, static_argnames="causal")(q, k, v, causal=True)

Calls (flash-attn's names and layouts, as flywheel's own; flywheel.tpu's calls take these
paths on traced values):
  flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                  softcap=0.0, return_softmax_lse=False, sinks=None, head_major=False)
      q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv] -> out [b, sq, hq, dv]
      (head_major=True: [b, h, s, d], the original FlyWheel's layout, read through strides);
      lse [b, hq, sq] float32 with return_softmax_lse.
  flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)
      packed q [total_q, hq, d], k [total_k, hkv, d], v [total_k, hkv, dv] (head_major:
      [h, total, d]); rows past the last offsets are padding (out 0, lse -inf); lse
      [hq, total_q].
      Both are differentiable (jax.grad, jax.vjp): the gradients of q, k, v and sinks come
      from flywheel's backward (a custom_vjp); lse is not differentiable (its cotangent is
      dropped).
  flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=...,
                  cache_batch_idx=None, block_table=None, ..., cu_seqlens_q=None, sinks=None)
      contiguous or paged caches. Returns (out, [lse,] k_cache, v_cache): JAX arrays are
      immutable, so the caches come back as results; donate them (jax.jit(...,
      donate_argnums=...)) and the new rows are written into the donated buffers in place
      (input_output_aliases), with no copy of the caches.
  chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, chunk_kda, fused_recurrent_kda
      fla's names and arguments (q, k [B, T, H, K], v [B, T, HV, V], g [B, T, HV] or KDA's
      [B, T, HV, K], beta [B, T, HV], cu_seqlens with B = 1) -> (o, final_state or None);
      forward only (flywheel has no GDN backward: jax.grad raises NotImplementedError).
  gdn_layer(...), next_replay_lens(...)
      flywheel.tpu's serving layers (fused_conv1d_gdn / _kda and their _replay forms) and
      their commit rule, which flywheel.tpu runs here on traced values; the slot caches alias
      their arguments as above.

Arrays: float32, bfloat16 or float16 (q, k, v one dtype), on the CPU. Static shapes, as jit
has them; every shape, dtype and option is checked when the call is traced (ValueError,
TypeError, NotImplementedError), and the library checks again when it runs (an XLA error
with its message). jit and eager calls run the same handler and give the same bits. vmap
runs the call once per element (vmap_method "sequential").

Threads: a handler runs on the XLA thread that reaches it and uses flywheel's own pool for
the kernel, as every flywheel call does, with flywheel.set_num_threads()'s count as it was when
the call was traced (all online CPUs by default); XLA's CPU threads wait meanwhile, so the
two take the cores in turn.

The handlers are built where jaxlib's FFI header was found when the library was built
(_fwjax.so beside _fwext.abi3.so); without it, importing this module raises ImportError.
"""

import ctypes
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from . import _lib

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _load():
    here = os.path.dirname(_lib._path) if os.environ.get("FLYWHEEL_LIBRARY") \
        else os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "_fwjax.so")
    if not os.path.exists(path):
        raise ImportError(f"flywheel.jax needs {path}, which is built with the library where "
                          f"jaxlib's FFI header is found (jax.ffi.include_dir())")
    h = ctypes.CDLL(path)
    fns = [ctypes.cast(getattr(_lib.lib, n), ctypes.c_void_p)
           for n in ("fw_attn_params_init", "fw_last_error", "fw_attn_fwd", "fw_attn_bwd",
                     "fw_attn_kvcache_fwd", "fw_attn_varlen_fwd", "fw_attn_varlen_bwd",
                     "fw_gdn_layer_params_init", "fw_gdn_layer", "fw_gdn_layer_replay",
                     "fw_gdn_params_init", "fw_gdn_prefill")]
    h.fwjax_bind.argtypes = [ctypes.c_void_p] * len(fns)
    if h.fwjax_bind(*fns) != 0:
        raise ImportError(f"{path}: binding the library's functions failed")
    for name in ("attn_fwd", "attn_bwd", "varlen_fwd", "varlen_bwd", "kvcache", "gdn_layer",
                 "gdn_prefill"):
        jax.ffi.register_ffi_target(f"flywheel_{name}",
                                    jax.ffi.pycapsule(getattr(h, f"fwjax_{name}")),
                                    platform="cpu")
    return h


_handlers = _load()


# ------------------------------------------------------------------ checks --

def _float_operands(names, *xs):
    dts = {jnp.dtype(x.dtype) for x in xs}
    for n, x in zip(names, xs):
        if jnp.dtype(x.dtype) not in [jnp.dtype(t) for t in _FLOATS]:
            raise TypeError(f"{n} must be float32, bfloat16 or float16, got {x.dtype}")
    if len(dts) != 1:
        raise TypeError(f"{', '.join(names)} must share one dtype, got "
                        f"{', '.join(str(x.dtype) for x in xs)}")


# layouts of the dense calls' q, k, v, out: flash-attn's [b, s, h, d], head-major [b, h, s, d],
# heads outer [h, b, s, d] (the original FlyWheel's heads_outer_fold); packed calls take the
# first two ([total, h, d], [h, total, d])
TOKEN_MAJOR, HEAD_MAJOR, HEADS_OUTER = 0, 1, 2


def _config(d, softmax_scale, causal, window_size, softcap, layout, rotary=None):
    """The static attributes of a call, as the handlers read them (a hashable tuple); rotary:
    None or (interleaved, q_only)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    side = lambda s: -1 if s is None or s < 0 or s >= 2**62 else int(s)
    if softmax_scale is None:
        scale = 1.0 / float(d) ** 0.5
    else:
        scale = float(softmax_scale)
        if not np.isfinite(np.float32(scale)):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
        if scale == 0.0:
            raise NotImplementedError("softmax_scale=0 (uniform attention) is not supported")
    softcap = float(softcap or 0.0)
    if not softcap >= 0.0 or not np.isfinite(softcap):
        raise ValueError(f"softcap must be >= 0 and finite, got {softcap!r}")
    cfg = (("causal", bool(causal)), ("layout", int(layout)), ("scale", scale),
           ("softcap", softcap), ("window_left", side(left)), ("window_right", side(right)))
    if rotary is not None:
        cfg += (("rotary_interleaved", bool(rotary[0])), ("rotary_q_only", bool(rotary[1])))
    return cfg


def _attrs(cfg):
    a = dict(cfg)
    r = dict(causal=a["causal"], layout=np.int32(a["layout"]), scale=np.float32(a["scale"]),
             softcap=np.float32(a["softcap"]), window_left=np.int64(a["window_left"]),
             window_right=np.int64(a["window_right"]), threads=np.int32(_lib.settings.threads or 0))
    if "rotary_interleaved" in a:
        r.update(rotary=True, rotary_interleaved=a["rotary_interleaved"],
                 rotary_q_only=a["rotary_q_only"])
    return r


def _dims(q, k, v, layout):
    for n, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            lay = ("[b, s, h, d]", "[b, h, s, d]", "[h, b, s, d]")[layout]
            raise ValueError(f"{n} must be {lay}, got shape {tuple(x.shape)}")
    axes = ((0, 1, 2, 3), (0, 2, 1, 3), (1, 2, 0, 3))[layout]  # (b, s, h, d) of the layout
    (b, sq, hq, d), (bk, sk, hkv, dk), (bv, sv, hv, dv) = (
        tuple(x.shape[i] for i in axes) for x in (q, k, v))
    if not (b == bk == bv) or sk != sv or hkv != hv or d != dk:
        raise ValueError(f"incompatible shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the K/V heads ({hkv}) must divide the query heads ({hq})")
    return b, sq, hq, d, sk, hkv, dv


def _sinks(sinks, s_aux, hq):
    if sinks is not None and s_aux is not None:
        raise ValueError("pass sinks or s_aux, not both")
    s = sinks if sinks is not None else s_aux
    if s is None:
        return None
    if s.shape != (hq,):
        raise ValueError(f"sinks must be [hq] = [{hq}], got shape {tuple(s.shape)}")
    if jnp.dtype(s.dtype) not in [jnp.dtype(t) for t in _FLOATS]:
        raise TypeError(f"sinks must be float32, bfloat16 or float16, got {s.dtype}")
    return s


# --------------------------------------------------------------- attention --

def _rotary(rotary_cos, rotary_sin):
    """The rotary tables of a call, (cos, sin) or None (the library checks them against d)."""
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None or rotary_cos.shape != rotary_sin.shape or \
            rotary_cos.ndim != 2 or rotary_cos.dtype != rotary_sin.dtype:
        raise ValueError("rotary_cos and rotary_sin must be [seqlen_ro, rotary_dim / 2] alike")
    _float_operands(("rotary_cos",), rotary_cos)
    return (rotary_cos, rotary_sin)


def _fwd_call(q, k, v, sinks, rot, out, cfg):
    a = dict(cfg)
    b, sq, hq, d, sk, hkv, dv = _dims(q, k, v, a["layout"])
    oshape = ((b, sq, hq, dv), (b, hq, sq, dv), (hq, b, sq, dv))[a["layout"]]
    args = (q, k, v) + (() if sinks is None else (sinks,)) + (() if rot is None else tuple(rot))
    args, aliases = _out_arg(args, out, oshape, q.dtype)
    call = jax.ffi.ffi_call("flywheel_attn_fwd",
                            (jax.ShapeDtypeStruct(oshape, q.dtype),
                             jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)),
                            input_output_aliases=aliases, vmap_method="sequential")
    return call(*args, sinks=sinks is not None, **_attrs(cfg))


def _out_arg(args, out, shape, dtype):
    """args and the aliases of a call, with `out` (an array of the output's shape and dtype, or
    None) as one more argument whose buffer the output takes: donated, the kernel writes into
    it, and XLA maps no fresh pages for the output (it allocates each output anew)."""
    if out is None:
        return args, {}
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"out must be {tuple(shape)} {jnp.dtype(dtype).name}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return args + (out,), {len(args): 0}


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, sinks, rot, out, cfg):
    return _fwd_call(q, k, v, sinks, rot, out, cfg)


def _attention_fwd(q, k, v, sinks, rot, out, cfg):
    o, lse = _fwd_call(q, k, v, sinks, rot, out, cfg)
    return (o, lse), (q, k, v, sinks, rot, o, lse)


def _attention_bwd(cfg, res, cts):
    q, k, v, sinks, rot, out, lse = res
    if rot is not None:
        raise NotImplementedError("the gradient of attention with rotary tables: the backward "
                                  "takes none (rotate q and k first to differentiate through it)")
    dout = cts[0].astype(out.dtype)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if sinks is not None:
        shapes.append(jax.ShapeDtypeStruct(sinks.shape, jnp.float32))
    call = jax.ffi.ffi_call("flywheel_attn_bwd", tuple(shapes), vmap_method="sequential")
    args = (q, k, v, out, dout, lse) + (() if sinks is None else (sinks,))
    grads = call(*args, **_attrs(cfg))
    if sinks is None:
        return tuple(grads) + (None, None, None)
    return tuple(grads[:3]) + (grads[3].astype(sinks.dtype), None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, return_softmax_lse=False, head_major=False,
                    heads_outer_fold=False, sinks=None, s_aux=None, rotary_cos=None,
                    rotary_sin=None, rotary_interleaved=False, rotary_k=True, out=None):
    """Dense attention, flash-attn's `flash_attn_func`, on JAX arrays (jit-able, differentiable).

    q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv] -> out [b, sq, hq, dv];
    head_major=True: q [b, hq, sq, d], k [b, hkv, sk, d], v [b, hkv, sk, dv] -> out
    [b, hq, sq, dv]; heads_outer_fold=True: [hq, b, sq, d] ... -> [hq, b, sq, dv]. Masks,
    softcap, sinks and lse as flywheel.flash_attn_func. Rotary tables as there (key j at j,
    query i at sk - sq + i; rotary_k=False rotates q only); not differentiable.
    return_softmax_lse=True returns (out, lse [b, hq, sq] float32); return_attn_probs=True
    (out, lse, None). out: an array of the output's shape and dtype whose buffer the result
    takes; donated to the caller's jax.jit, the kernel writes into it in place, which spares
    XLA mapping fresh pages for every output (a page fault per 4 KiB written). dropout and
    ALiBi raise NotImplementedError.
    """
    del deterministic  # always deterministic
    if dropout_p:
        raise NotImplementedError("dropout_p > 0: flywheel is an inference library (no dropout)")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes are not supported")
    _float_operands(("q", "k", "v"), q, k, v)
    if head_major and heads_outer_fold:
        raise ValueError("head_major and heads_outer_fold are two layouts: pass one")
    layout = HEADS_OUTER if heads_outer_fold else HEAD_MAJOR if head_major else TOKEN_MAJOR
    b, sq, hq, d, sk, hkv, dv = _dims(q, k, v, layout)
    s = _sinks(sinks, s_aux, hq)
    rot = _rotary(rotary_cos, rotary_sin)
    cfg = _config(d, softmax_scale, causal, window_size, softcap, layout,
                  None if rot is None else (rotary_interleaved, not rotary_k))
    out, lse = _attention(q, k, v, s, rot, out, cfg)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_softmax_lse else out


def _int_array(x, name, shape=None):
    """An index operand as int32 (a traced value stays traced); TypeError if not integers."""
    if isinstance(x, (int, np.integer)):
        x = jnp.asarray(x, jnp.int32)
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be integers, got {getattr(x, 'dtype', type(x).__name__)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    return jnp.asarray(x).astype(jnp.int32)


def _kvcache_call(q, caches, seqlens, cu, num_active, table, batch_idx, k, v, sinks, cfg,
                  head_major=False, read_only=False):
    """The packed cache call (fwjax_kvcache): q [total_q, hq, d] ([hq, total_q, d] head-major),
    caches (k_cache, v_cache) or (merged kv,), int32 seqlens [b], cu [b + 1], num_active
    scalar, table [b, pages] or None, batch_idx [b] or None, k, v [total_q, hkv, d|dv] or
    None. Returns (out like q, lse [hq, total_q], *caches), or without the caches when
    read_only (no appends: the caches are read where they lie, never copied)."""
    merged = len(caches) == 1
    hq, total = (q.shape[0], q.shape[1]) if head_major else (q.shape[1], q.shape[0])
    dv = caches[-1].shape[3]
    oshape = (hq, total, dv) if head_major else (total, hq, dv)
    shapes = (jax.ShapeDtypeStruct(oshape, q.dtype), jax.ShapeDtypeStruct((hq, total), jnp.float32))
    if not read_only:
        shapes += tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)
    args = (q,) + tuple(caches) + (seqlens, cu, jnp.reshape(num_active, (1,)).astype(jnp.int32))
    args += tuple(x for x in (table, batch_idx) if x is not None)
    if k is not None:
        args += (k, v)
    if sinks is not None:
        args += (sinks,)
    aliases = {} if read_only else {1 + i: 2 + i for i in range(len(caches))}
    call = jax.ffi.ffi_call("flywheel_kvcache", shapes, input_output_aliases=aliases,
                            vmap_method="sequential")
    a = _attrs(cfg)
    a["layout"] = np.int32(HEAD_MAJOR if head_major else TOKEN_MAJOR)
    return call(*args, merged=merged, paged=table is not None, batch_idx=batch_idx is not None,
                appends=k is not None, **a)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            return_softmax_lse=False, *, cu_seqlens_q=None, sinks=None,
                            s_aux=None):
    """Append to K/V caches and attend, flash-attn's `flash_attn_with_kvcache`, on JAX arrays.

    q [b, sq, hq, d], or packed [total_q, hq, d] with cu_seqlens_q [b + 1] (flash-attn 3);
    k_cache, v_cache: contiguous [b_cache, S, hkv, d|dv] (cache_batch_idx [b] picks each
    sequence's entry, identity by default) or paged [num_blocks, page_size, hkv, d|dv] with
    block_table [b, max_pages]; cache_seqlens an int or [b] (required), the rows each sequence
    holds; k, v (q's layout with hkv heads) or None: new rows, written at cache_seqlens[i] ..
    before attending. sinks / s_aux [hq] as in flash_attn_func. Index operands may be traced.
    Returns (out like q, [lse,] k_cache, v_cache), lse [b, hq, sq] ([hq, total_q] packed)
    float32; donated caches are updated in place. Not differentiable.
    """
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required: the rows each cache holds")
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new rows), or neither")
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("block_table and cache_batch_idx are mutually exclusive")
    _float_operands(("q", "k_cache", "v_cache") + (("k", "v") if k is not None else ()),
                    q, k_cache, v_cache, *((k, v) if k is not None else ()))
    packed = cu_seqlens_q is not None
    if q.ndim != (3 if packed else 4) or k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ValueError(f"q, k_cache, v_cache must be {'[total_q' if packed else '[b, sq'}, hq, "
                         f"d], [.., .., hkv, d], [.., .., hkv, dv]; got shapes "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    if v_cache.shape[:3] != k_cache.shape[:3] or k_cache.shape[3] != d:
        raise ValueError(f"incompatible shapes: q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the K/V heads ({hkv}) must divide the query heads ({hq})")
    if k is not None and (k.shape != q.shape[:-2] + (hkv, d) or
                          v.shape != q.shape[:-2] + (hkv, dv)):
        raise ValueError(f"k and v must be {q.shape[:-2] + (hkv, d)}, {q.shape[:-2] + (hkv, dv)}; "
                         f"got {tuple(k.shape)}, {tuple(v.shape)}")
    if packed:
        cu = _int_array(cu_seqlens_q, "cu_seqlens_q")
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"cu_seqlens_q must be [b + 1], got shape {tuple(cu.shape)}")
        b, sq = cu.shape[0] - 1, None
    else:
        b, sq = q.shape[0], q.shape[1]
        cu = jnp.arange(b + 1, dtype=jnp.int32) * sq
    if isinstance(cache_seqlens, (int, np.integer)):
        cache_seqlens = jnp.full((b,), cache_seqlens, jnp.int32)
    seqlens = _int_array(cache_seqlens, "cache_seqlens", (b,))
    table = None if block_table is None else _int_array(block_table, "block_table")
    if table is not None and (table.ndim != 2 or table.shape[0] != b):
        raise ValueError(f"block_table must be [b = {b}, max_pages], got {tuple(table.shape)}")
    bidx = None if cache_batch_idx is None else _int_array(cache_batch_idx, "cache_batch_idx", (b,))
    if table is None and bidx is None and k_cache.shape[0] < b:
        raise ValueError(f"contiguous caches need an entry per sequence ({b}) or "
                         f"cache_batch_idx; got {tuple(k_cache.shape)}")
    s = _sinks(sinks, s_aux, hq)
    cfg = _config(d, softmax_scale, causal, window_size, softcap, TOKEN_MAJOR)
    flat = lambda x: x if packed else x.reshape((b * sq,) + x.shape[2:])
    out, lse, kc, vc = _kvcache_call(flat(q), (k_cache, v_cache), seqlens, cu, b, table, bidx,
                                     None if k is None else flat(k), None if v is None else flat(v),
                                     s, cfg)
    if not packed:
        out = out.reshape(b, sq, hq, dv)
        lse = lse.reshape(hq, b, sq).transpose(1, 0, 2)
    return (out, lse, kc, vc) if return_softmax_lse else (out, kc, vc)


# ------------------------------------------------------------------ varlen --

def _varlen_call(q, k, v, cu_q, cu_k, sinks, rot, out, cfg):
    a = dict(cfg)
    hm = a["layout"] == HEAD_MAJOR
    hq, total = (q.shape[0], q.shape[1]) if hm else (q.shape[1], q.shape[0])
    dv = v.shape[-1]
    oshape = (hq, total, dv) if hm else (total, hq, dv)
    args = (q, k, v, cu_q, cu_k) + (() if sinks is None else (sinks,)) + \
        (() if rot is None else tuple(rot))
    args, aliases = _out_arg(args, out, oshape, q.dtype)
    call = jax.ffi.ffi_call("flywheel_varlen_fwd",
                            (jax.ShapeDtypeStruct(oshape, q.dtype),
                             jax.ShapeDtypeStruct((hq, total), jnp.float32)),
                            input_output_aliases=aliases, vmap_method="sequential")
    return call(*args, sinks=sinks is not None, **_attrs(cfg))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _varlen(q, k, v, cu_q, cu_k, sinks, rot, out, cfg):
    return _varlen_call(q, k, v, cu_q, cu_k, sinks, rot, out, cfg)


def _varlen_fwd(q, k, v, cu_q, cu_k, sinks, rot, out, cfg):
    o, lse = _varlen_call(q, k, v, cu_q, cu_k, sinks, rot, out, cfg)
    return (o, lse), (q, k, v, cu_q, cu_k, sinks, rot, o, lse)


def _varlen_bwd(cfg, res, cts):
    q, k, v, cu_q, cu_k, sinks, rot, out, lse = res
    if rot is not None:
        raise NotImplementedError("the gradient of attention with rotary tables: the backward "
                                  "takes none (rotate q and k first to differentiate through it)")
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if sinks is not None:
        shapes.append(jax.ShapeDtypeStruct(sinks.shape, jnp.float32))
    call = jax.ffi.ffi_call("flywheel_varlen_bwd", tuple(shapes), vmap_method="sequential")
    args = (q, k, v, out, cts[0].astype(out.dtype), lse, cu_q, cu_k)
    grads = call(*(args + (() if sinks is None else (sinks,))), **_attrs(cfg))
    ds = None if sinks is None else grads[3].astype(sinks.dtype)
    return tuple(grads[:3]) + (None, None, ds, None, None)


_varlen.defvjp(_varlen_fwd, _varlen_bwd)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, *,
                           return_softmax_lse=False, head_major=False, sinks=None, s_aux=None,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                           rotary_k=True, out=None):
    """Packed variable-length attention, flash-attn's `flash_attn_varlen_func`, on JAX arrays
    (jit-able, differentiable; with rotary tables, per-sequence positions, forward only).

    q [total_q, hq, d], k [total_k, hkv, d], v [total_k, hkv, dv] -> out [total_q, hq, dv];
    head_major=True: q [hq, total_q, d], k, v, out alike. cu_seqlens_q, cu_seqlens_k
    [b + 1] int offsets from 0 (may be traced); rows past their last entries are padding:
    out 0, lse -inf, gradient 0. max_seqlen_q / max_seqlen_k are accepted and unused.
    lse [hq, total_q] float32 with return_softmax_lse. Masks, softcap, sinks as
    flash_attn_func; gradients of q, k, v and sinks from flywheel's backward. out: as in
    flash_attn_func (a donated buffer the result is written into).
    """
    del deterministic, max_seqlen_q, max_seqlen_k
    if dropout_p:
        raise NotImplementedError("dropout_p > 0: flywheel is an inference library (no dropout)")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes are not supported")
    _float_operands(("q", "k", "v"), q, k, v)
    for n, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            lay = "[h, total, d]" if head_major else "[total, h, d]"
            raise ValueError(f"{n} must be {lay}, got shape {tuple(x.shape)}")
    (hq, hkv, tk, tv) = (q.shape[0], k.shape[0], k.shape[1], v.shape[1]) if head_major else \
        (q.shape[1], k.shape[1], k.shape[0], v.shape[0])
    hv = v.shape[0] if head_major else v.shape[1]
    if q.shape[-1] != k.shape[-1] or tk != tv or hv != hkv:
        raise ValueError(f"incompatible shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the K/V heads ({hkv}) must divide the query heads ({hq})")
    cu_q = _int_array(cu_seqlens_q, "cu_seqlens_q")
    cu_k = _int_array(cu_seqlens_k, "cu_seqlens_k")
    if cu_q.ndim != 1 or cu_q.shape != cu_k.shape or cu_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be [b + 1] alike, got shapes "
                         f"{tuple(cu_q.shape)}, {tuple(cu_k.shape)}")
    s = _sinks(sinks, s_aux, hq)
    rot = _rotary(rotary_cos, rotary_sin)
    cfg = _config(q.shape[-1], softmax_scale, causal, window_size, softcap,
                  HEAD_MAJOR if head_major else TOKEN_MAJOR,
                  None if rot is None else (rotary_interleaved, not rotary_k))
    out, lse = _varlen(q, k, v, cu_q, cu_k, s, rot, out, cfg)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_softmax_lse else out


# ---------------------------------------------------------- linear attention --

def gdn_layer(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
              query_start_loc, state_indices, distribution, seq_lens, read_state_indices,
              read_offsets, *, n_kq, n_v, d_k, d_v, kernel_size, num_spec_tokens=0,
              zero_initialize_out=True, precision=None, l2norm_eps=None, lower_bound=None,
              beta_is_activated=False, replay=None):
    """One GDN / KDA layer of an engine step on JAX arrays (fwjax_gdn_layer): the arguments of
    flywheel.tpu's fused_conv1d_gdn / fused_conv1d_kda (a [T, n_v] is GDN, [T, n_v d_k] KDA),
    index operands possibly traced. replay = (recurrent_shadow, replay_state, replay_lens,
    replay_window) runs the ReplaySSM decodes. Returns ((conv_state, recurrent_state[,
    recurrent_shadow, replay_state]), out): the caches alias their arguments, so donated ones
    are updated in place."""
    _float_operands(("qkv",), qkv)
    dim = 2 * n_kq * d_k + n_v * d_v
    if qkv.ndim != 2 or qkv.shape[1] != dim:
        raise ValueError(f"qkv must be [T, 2 n_kq d_k + n_v d_v] = [T, {dim}], got "
                         f"{tuple(qkv.shape)}")
    T = qkv.shape[0]
    if b.shape != (T, n_v) or a.ndim != 2 or a.shape[0] != T:
        raise ValueError(f"b must be [T, n_v] = {(T, n_v)} and a (g) [T, ...]; got "
                         f"{tuple(b.shape)}, {tuple(a.shape)}")
    w = conv_weight[:, 0] if conv_weight.ndim == 3 and conv_weight.shape[1] == 1 else conv_weight
    if w.ndim != 2 or w.shape != (dim, kernel_size):
        raise ValueError(f"conv_weight must be [dim, 1, kernel_size] = [{dim}, 1, {kernel_size}], "
                         f"got shape {tuple(conv_weight.shape)}")
    if conv_state.ndim != 3 or recurrent_state.ndim != 4 or \
            recurrent_state.shape[1:] != (n_v, d_k, d_v):
        raise ValueError(f"conv_state must be [slots, K-1, dim] and recurrent_state [slots, n_v, "
                         f"d_k, d_v]; got {tuple(conv_state.shape)}, "
                         f"{tuple(recurrent_state.shape)}")
    for n, x in (("b", b), ("a", a), ("conv_weight", w), ("a_log", a_log), ("dt_bias", dt_bias),
                 ("conv_state", conv_state), ("recurrent_state", recurrent_state)) + \
            ((("conv_bias", conv_bias),) if conv_bias is not None else ()):
        _float_operands((n,), x)
    sidx = _int_array(state_indices, "state_indices")
    if sidx.ndim != 1:
        raise ValueError(f"state_indices must be [num_seqs], got {tuple(sidx.shape)}")
    n = sidx.shape[0]
    qsl = _int_array(query_start_loc, "query_start_loc", (n + 1,))
    dist = _int_array(distribution, "distribution", (3,))
    slen = _int_array(seq_lens, "seq_lens", (n,))
    ridx = _int_array(read_state_indices, "read_state_indices", (n,))
    offs = None
    if num_spec_tokens and read_offsets is not None:
        offs = _int_array(read_offsets, "read_offsets", (n,))
    if lower_bound is not None and not float(lower_bound) < 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    args = (qkv, b, a, w) + (() if conv_bias is None else (conv_bias,)) + (a_log, dt_bias)
    args += (qsl, sidx, dist, slen, ridx) + (() if offs is None else (offs,))
    caches = (conv_state, recurrent_state)
    if replay is not None:
        shadow, records, lens, window = replay
        lens = _int_array(lens, "replay_lens", (n,))
        if records.ndim != 3 or records.shape[1] != int(window):
            raise ValueError(f"replay_state must be [slots, replay_window, record_dim] with "
                             f"replay_window {window}, got shape {tuple(records.shape)}")
        caches += (shadow, records)
    args += caches + (() if replay is None else (lens,))
    first = len(args) - len(caches) - (0 if replay is None else 1)
    shapes = (jax.ShapeDtypeStruct((T, n_v * d_v), qkv.dtype),) + tuple(
        jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)
    call = jax.ffi.ffi_call("flywheel_gdn_layer", shapes,
                            input_output_aliases={first + i: 1 + i for i in range(len(caches))},
                            vmap_method="sequential")
    r = call(*args, n_kq=np.int32(n_kq), n_v=np.int32(n_v), d_k=np.int32(d_k),
             d_v=np.int32(d_v), num_spec_tokens=np.int32(num_spec_tokens),
             zero_tail=bool(zero_initialize_out),
             l2norm_eps=np.float32(0.0 if l2norm_eps is None else l2norm_eps),
             lower_bound=np.float32(0.0 if lower_bound is None else lower_bound),
             beta_activated=bool(beta_is_activated), precision=np.int32(_lib.precision(precision)),
             has_bias=conv_bias is not None, has_offsets=offs is not None,
             replay=replay is not None, threads=np.int32(_lib.settings.threads or 0))
    return tuple(r[1:]), r[0]


def next_replay_lens(replay_lens, query_start_loc, seq_lens, state_indices, read_state_indices,
                     distribution, num_accepted, replay_window):
    """flywheel.tpu.next_replay_lens on JAX values (traced or not): the committed records of
    each sequence after a replay step, int32."""
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    lens, qsl = i32(replay_lens), i32(query_start_loc)
    rd, wr = i32(read_state_indices), i32(state_indices)
    ql = qsl[1:] - qsl[:-1]
    has_init = (i32(seq_lens) - ql) > 0
    committed = jnp.where(has_init, lens, 0)
    flush = (committed + ql > replay_window) | ~has_init | (rd != wr)
    is_decode = jnp.arange(lens.shape[0]) < i32(distribution)[0]
    base = jnp.where(flush, 0, committed)
    return jnp.where(is_decode, base + i32(num_accepted), 0).astype(jnp.int32)


def _forward_only(name, fn, *args):
    """fn(*args) as a custom_vjp whose backward raises: a forward-only call says so when it is
    differentiated, instead of failing inside XLA."""
    @jax.custom_vjp
    def f(*a):
        return fn(*a)

    def bwd(_, g):
        raise NotImplementedError(f"{name} is forward only: flywheel has no backward for it")

    f.defvjp(lambda *a: (fn(*a), None), bwd)
    return f(*args)


def _gdn_prefill(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens,
                 flags, precision, l2norm_eps, name, gates=None, beta_sigmoid=False,
                 lower_bound=None):
    """fwjax_gdn_prefill on [B, T, ...] operands (or packed with cu_seqlens, B = 1); gates =
    (a_log, dt_bias or None) computed in the kernel, g then the raw input. Returns (o,
    final_state or None)."""
    _float_operands(("q", "k", "v"), q, k, v)
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be [B, T, H, K] alike and v [B, T, HV, V], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H:
        raise ValueError(f"the q/k heads ({H}) must divide the value heads ({HV})")
    if g.shape not in ((B, T, HV), (B, T, HV, K)) or beta.shape != (B, T, HV):
        raise ValueError(f"g must be [B, T, HV] = {(B, T, HV)} (KDA: [B, T, HV, K]) and beta "
                         f"[B, T, HV]; got {tuple(g.shape)}, {tuple(beta.shape)}")
    _float_operands(("g",), g)
    _float_operands(("beta",), beta)
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1, got {B}")
        cu = _int_array(cu_seqlens, "cu_seqlens")
        if cu.ndim != 1 or cu.shape[0] < 1:
            raise ValueError(f"cu_seqlens must be [N + 1], got shape {tuple(cu.shape)}")
    else:
        cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    n = cu.shape[0] - 1
    if scale is None:
        scale = K ** -0.5
    elif float(scale) == 0.0:
        raise NotImplementedError("scale=0 is not supported")
    f32 = lambda x: x if gates is not None else x.astype(jnp.float32)
    args = (q.reshape(B * T, H, K), k.reshape(B * T, H, K), v.reshape(B * T, HV, V),
            f32(g).reshape((B * T,) + g.shape[2:]), f32(beta).reshape(B * T, HV), cu)
    if gates is not None:  # a_log [HV] (None: exp(a_log) = 1, fla's sigmoid gate), dt_bias
        a_log, dtb = gates    # [HV] or KDA's [HV * K] (or [HV, K])
        a_log = jnp.zeros((HV,), jnp.float32) if a_log is None else a_log
        if a_log.shape != (HV,):
            raise ValueError(f"A_log must be [HV] = [{HV}], got shape {tuple(a_log.shape)}")
        if dtb is not None:
            if dtb.size == HV * K and g.ndim == 4 and dtb.ndim <= 2:
                dtb = dtb.reshape(HV * K)
            elif dtb.shape != (HV,):
                raise ValueError(f"dt_bias must be [HV] = [{HV}]" + (
                    f" or [HV * K] = [{HV * K}]" if g.ndim == 4 else "") +
                    f", got shape {tuple(dtb.shape)}")
        gates = (a_log, dtb)
        args += tuple(x for x in gates if x is not None)
    if lower_bound is not None and not float(lower_bound) < 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    if initial_state is not None:
        if initial_state.shape != (n, HV, K, V):
            raise ValueError(f"initial_state must be [N, HV, K, V] = {(n, HV, K, V)}, got "
                             f"{tuple(initial_state.shape)}")
        args += (initial_state.astype(jnp.float32),)
    shapes = (jax.ShapeDtypeStruct((B * T, HV, V), v.dtype),)
    if output_final_state:
        shapes += (jax.ShapeDtypeStruct((n, HV, K, V), jnp.float32),)
    aliases = {len(args) - 1: 1} if output_final_state and initial_state is not None else {}
    call = jax.ffi.ffi_call("flywheel_gdn_prefill", shapes, input_output_aliases=aliases,
                            vmap_method="sequential")
    attrs = dict(scale=np.float32(scale), l2norm=bool(l2norm), flags=np.int32(flags),
                 precision=np.int32(_lib.precision(precision)),
                 l2norm_eps=np.float32(0.0 if l2norm_eps is None else l2norm_eps),
                 beta_sigmoid=bool(beta_sigmoid),
                 lower_bound=np.float32(0.0 if lower_bound is None else lower_bound),
                 kernel_gates=gates is not None,
                 has_dt_bias=gates is not None and gates[1] is not None,
                 has_h0=initial_state is not None, has_ht=bool(output_final_state),
                 threads=np.int32(_lib.settings.threads or 0))
    r = _forward_only(name, lambda *a: call(*a, **attrs), *args)
    o = r[0].reshape(B, T, HV, V)
    return o, (r[1] if output_final_state else None)


def _beta_in(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval):
    """beta for the kernel and whether it takes its sigmoid (2 sigmoid(b) is computed here)."""
    if allow_neg_eigval:
        if not use_beta_sigmoid_in_kernel:
            raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
        return 2.0 * jax.nn.sigmoid(beta.astype(jnp.float32)), False
    return beta, bool(use_beta_sigmoid_in_kernel)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           cu_seqlens=None, *, use_gate_in_kernel=False, A_log=None,
                           dt_bias=None, inverse="blocked", precision=None, l2norm_eps=None):
    """fla's `chunk_gated_delta_rule` on JAX arrays (jit-able; forward only): arguments and
    results as flywheel.chunk_gated_delta_rule. The gates of use_gate_in_kernel and
    use_beta_sigmoid_in_kernel are computed in the kernel."""
    if inverse not in ("blocked", "fwd_subst"):
        raise ValueError("inverse must be 'blocked' or 'fwd_subst'")
    if use_gate_in_kernel and A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log")
    beta, bsig = _beta_in(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _gdn_prefill(q, k, v, g, beta, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens,
                        _lib.GDN_FWD_SUBST if inverse == "fwd_subst" else 0, precision,
                        l2norm_eps, "chunk_gated_delta_rule",
                        (A_log, dt_bias) if use_gate_in_kernel else None, bsig)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                     A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                                     allow_neg_eigval=False, cu_seqlens=None, *,
                                     l2norm_eps=None):
    """fla's `fused_recurrent_gated_delta_rule` on JAX arrays (jit-able; forward only): the
    token-by-token recurrence; gk [B, T, HV, K] per-key-channel decays (added to g's);
    pass beta by keyword, as in fla."""
    if gk is not None and beta is None:
        raise ValueError("gk was given and beta was not: beta must be passed by keyword")
    if gv is not None:
        raise NotImplementedError("per-value-channel gates gv are not supported")
    if gk is not None:
        if use_gate_in_kernel:
            raise NotImplementedError("gk with use_gate_in_kernel: see fused_recurrent_kda")
        g = gk.astype(jnp.float32) + (0.0 if g is None else g.astype(jnp.float32)[..., None])
    if g is None or beta is None:
        raise NotImplementedError("g (or gk) and beta are required")
    if use_gate_in_kernel and A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log")
    beta, bsig = _beta_in(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _gdn_prefill(q, k, v, g, beta, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens, _lib.GDN_FUSED_RECURRENT, None,
                        l2norm_eps, "fused_recurrent_gated_delta_rule",
                        (A_log, dt_bias) if use_gate_in_kernel else None, bsig)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, cu_seqlens=None, *, A_log=None, dt_bias=None,
              inverse="blocked", precision=None, l2norm_eps=None):
    """fla's `chunk_kda` on JAX arrays (jit-able; forward only): g [B, T, HV, K], arguments
    and results as flywheel.chunk_kda."""
    if inverse not in ("blocked", "fwd_subst"):
        raise ValueError("inverse must be 'blocked' or 'fwd_subst'")
    if safe_gate and use_gate_in_kernel and lower_bound is None:
        raise ValueError("lower_bound must be given when safe_gate=True and "
                         "use_gate_in_kernel=True")
    if use_gate_in_kernel and A_log is None and not (safe_gate and lower_bound is not None):
        raise ValueError("A_log must be given when use_gate_in_kernel=True and lower_bound is "
                         "not set (with safe_gate)")
    if g.ndim != 4:
        raise ValueError(f"g must be [B, T, HV, K] (a decay per key channel), got {tuple(g.shape)}")
    beta, bsig = _beta_in(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    lb = lower_bound if safe_gate else None
    return _gdn_prefill(q, k, v, g, beta, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens,
                        _lib.GDN_FWD_SUBST if inverse == "fwd_subst" else 0, precision,
                        l2norm_eps, "chunk_kda", _kda_gates(use_gate_in_kernel, A_log, dt_bias),
                        bsig, lb if use_gate_in_kernel else None)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
                        initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                        lower_bound=None, cu_seqlens=None, *, l2norm_eps=None):
    """fla's `fused_recurrent_kda` on JAX arrays (jit-able; forward only)."""
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("A_log must be given when use_gate_in_kernel=True and lower_bound is "
                         "not set")
    if g.ndim != 4:
        raise ValueError(f"g must be [B, T, HV, K] (a decay per key channel), got {tuple(g.shape)}")
    beta, bsig = _beta_in(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _gdn_prefill(q, k, v, g, beta, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens, _lib.GDN_FUSED_RECURRENT, None,
                        l2norm_eps, "fused_recurrent_kda",
                        _kda_gates(use_gate_in_kernel, A_log, dt_bias), bsig,
                        lower_bound if use_gate_in_kernel else None)


def _kda_gates(use_gate_in_kernel, A_log, dt_bias):
    """The kernel's gate operands (a_log, dt_bias) of a KDA call, or None."""
    if not use_gate_in_kernel:
        if dt_bias is not None:
            raise ValueError("dt_bias is used with use_gate_in_kernel=True and A_log")
        return None
    return (A_log, dt_bias)
