"""flywheel's attention on JAX arrays, under jax.jit: XLA FFI custom calls (_fwjax.c).

    import flywheel.jax as fj
    out = jax.jit(fj.flash_attn_func, static_argnames="causal")(q, k, v, causal=True)

Calls (flash-attn's names and layouts, as flywheel's own):
  flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                  softcap=0.0, return_softmax_lse=False, sinks=None)
      q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv] -> out [b, sq, hq, dv]
      (head_major=True: q [b, hq, sq, d], k, v, out alike, the original FlyWheel's layout);
      lse [b, hq, sq] float32 with return_softmax_lse. Differentiable (jax.grad, jax.vjp):
      the gradients of q, k, v and sinks come from flywheel's backward; lse is not
      differentiable (its cotangent is dropped).
  flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=...,
                  softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  return_softmax_lse=False, sinks=None)
      q [b, sq, hq, d], contiguous caches [b, S, hkv, d|dv], cache_seqlens an int or [b]
      int32 array, k, v [b, sq, hkv, d|dv] the new rows. Returns (out, [lse,] k_cache,
      v_cache): JAX arrays are immutable, so the caches come back as results; donate them
      (jax.jit(..., donate_argnums=...)) and the new rows are written into the donated
      buffers in place (input_output_aliases), with no copy of the caches.

Arrays: float32, bfloat16 or float16 (q, k, v one dtype), on the CPU. Static shapes, as jit
has them; every shape, dtype and option is checked when the call is traced (ValueError,
TypeError, NotImplementedError), and the library checks again when it runs (an XLA error
with its message). jit and eager calls run the same handler and give the same bits. vmap
runs the call once per element (vmap_method "sequential").

Threads: a handler runs on the XLA thread that reaches it and uses flywheel's own pool
(flywheel.set_threads(); all online CPUs by default) for the kernel, as every flywheel call
does; XLA's CPU threads wait meanwhile, so the two share the cores one after the other.

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
                     "fw_attn_kvcache_fwd")]
    h.fwjax_bind.argtypes = [ctypes.c_void_p] * len(fns)
    if h.fwjax_bind(*fns) != 0:
        raise ImportError(f"{path}: binding the library's functions failed")
    for name in ("attn_fwd", "attn_bwd", "kvcache"):
        jax.ffi.register_ffi_target(f"flywheel_{name}", jax.ffi.pycapsule(getattr(h, f"fwjax_{name}")),
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


def _config(d, softmax_scale, causal, window_size, softcap, head_major):
    """The static attributes of a call, as the handlers read them."""
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
    return (("causal", bool(causal)), ("head_major", bool(head_major)),
            ("scale", scale), ("softcap", softcap),
            ("window_left", side(left)), ("window_right", side(right)))


def _attrs(cfg):
    a = dict(cfg)
    return dict(causal=a["causal"], head_major=a["head_major"], scale=np.float32(a["scale"]),
                softcap=np.float32(a["softcap"]), window_left=np.int64(a["window_left"]),
                window_right=np.int64(a["window_right"]))


def _dims(q, k, v, head_major):
    for n, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            lay = "[b, h, s, d]" if head_major else "[b, s, h, d]"
            raise ValueError(f"{n} must be {lay}, got shape {tuple(x.shape)}")
    if head_major:
        (b, hq, sq, d), (bk, hkv, sk, dk), (bv, hv, sv, dv) = q.shape, k.shape, v.shape
    else:
        (b, sq, hq, d), (bk, sk, hkv, dk), (bv, sv, hv, dv) = q.shape, k.shape, v.shape
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

def _fwd_call(q, k, v, sinks, cfg):
    a = dict(cfg)
    b, sq, hq, d, sk, hkv, dv = _dims(q, k, v, a["head_major"])
    oshape = (b, hq, sq, dv) if a["head_major"] else (b, sq, hq, dv)
    call = jax.ffi.ffi_call("flywheel_attn_fwd",
                            (jax.ShapeDtypeStruct(oshape, q.dtype),
                             jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)),
                            vmap_method="sequential")
    args = (q, k, v) if sinks is None else (q, k, v, sinks)
    return call(*args, **_attrs(cfg))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, sinks, cfg):
    return _fwd_call(q, k, v, sinks, cfg)


def _attention_fwd(q, k, v, sinks, cfg):
    out, lse = _fwd_call(q, k, v, sinks, cfg)
    return (out, lse), (q, k, v, sinks, out, lse)


def _attention_bwd(cfg, res, cts):
    q, k, v, sinks, out, lse = res
    dout = cts[0].astype(out.dtype)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if sinks is not None:
        shapes.append(jax.ShapeDtypeStruct(sinks.shape, jnp.float32))
    call = jax.ffi.ffi_call("flywheel_attn_bwd", tuple(shapes), vmap_method="sequential")
    args = (q, k, v, out, dout, lse) + (() if sinks is None else (sinks,))
    grads = call(*args, **_attrs(cfg))
    if sinks is None:
        return tuple(grads) + (None,)
    return tuple(grads[:3]) + (grads[3].astype(sinks.dtype),)


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, return_softmax_lse=False, head_major=False,
                    sinks=None, s_aux=None):
    """Dense attention, flash-attn's `flash_attn_func`, on JAX arrays (jit-able, differentiable).

    q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv] -> out [b, sq, hq, dv];
    head_major=True: q [b, hq, sq, d], k [b, hkv, sk, d], v [b, hkv, sk, dv] -> out
    [b, hq, sq, dv]. Masks, softcap, sinks and lse as flywheel.flash_attn_func.
    return_softmax_lse=True returns (out, lse [b, hq, sq] float32); return_attn_probs=True
    (out, lse, None). dropout and ALiBi raise NotImplementedError.
    """
    del deterministic  # always deterministic
    if dropout_p:
        raise NotImplementedError("dropout_p > 0: flywheel is an inference library (no dropout)")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes are not supported")
    _float_operands(("q", "k", "v"), q, k, v)
    b, sq, hq, d, sk, hkv, dv = _dims(q, k, v, head_major)
    s = _sinks(sinks, s_aux, hq)
    cfg = _config(d, softmax_scale, causal, window_size, softcap, head_major)
    out, lse = _attention(q, k, v, s, cfg)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_softmax_lse else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            return_softmax_lse=False, *, sinks=None, s_aux=None):
    """Append to contiguous K/V caches and attend, flash-attn's `flash_attn_with_kvcache`, on
    JAX arrays. q [b, sq, hq, d]; k_cache, v_cache [b, S, hkv, d|dv]; cache_seqlens: an int or
    [b] int32 (required), the rows each cache holds; k, v [b, sq, hkv, d|dv] or None: new rows,
    written at cache_seqlens[i] .. before attending. sinks / s_aux [hq]: attention sinks, as
    in flash_attn_func. Returns (out [b, sq, hq, dv], [lse [b, hq, sq] float32,] k_cache,
    v_cache); donated caches are updated in place. Not differentiable.
    """
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required: the rows each cache holds")
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new rows), or neither")
    _float_operands(("q", "k_cache", "v_cache") + (("k", "v") if k is not None else ()),
                    q, k_cache, v_cache, *((k, v) if k is not None else ()))
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ValueError(f"q, k_cache, v_cache must be [b, sq, hq, d], [b, S, hkv, d], "
                         f"[b, S, hkv, dv]; got shapes {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    b, sq, hq, d = q.shape
    bc, S, hkv, dk = k_cache.shape
    dv = v_cache.shape[3]
    if bc != b or v_cache.shape[:3] != k_cache.shape[:3] or dk != d:
        raise ValueError(f"incompatible shapes: q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the K/V heads ({hkv}) must divide the query heads ({hq})")
    if k is not None and (k.shape != (b, sq, hkv, d) or v.shape != (b, sq, hkv, dv)):
        raise ValueError(f"k and v must be [b, sq, hkv, d|dv] = {(b, sq, hkv, d)}, "
                         f"{(b, sq, hkv, dv)}; got {tuple(k.shape)}, {tuple(v.shape)}")
    if isinstance(cache_seqlens, (int, np.integer)):
        cache_seqlens = jnp.full((b,), cache_seqlens, jnp.int32)
    if cache_seqlens.shape != (b,):
        raise ValueError(f"cache_seqlens must be an int or [b] = [{b}], got shape "
                         f"{tuple(cache_seqlens.shape)}")
    if not jnp.issubdtype(cache_seqlens.dtype, jnp.integer):
        raise TypeError(f"cache_seqlens must be integers, got {cache_seqlens.dtype}")
    s = _sinks(sinks, s_aux, hq)
    cfg = _config(d, softmax_scale, causal, window_size, softcap, False)
    call = jax.ffi.ffi_call("flywheel_kvcache",
                            (jax.ShapeDtypeStruct((b, sq, hq, dv), q.dtype),
                             jax.ShapeDtypeStruct((hq, b * sq), jnp.float32),
                             jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                             jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
                            input_output_aliases={1: 2, 2: 3}, vmap_method="sequential")
    args = (q, k_cache, v_cache, cache_seqlens.astype(jnp.int32))
    if k is not None:
        args += (k, v)
    if s is not None:
        args += (s,)
    out, lse, kc, vc = call(*args, appends=k is not None, **_attrs(cfg))
    if return_softmax_lse:
        return out, lse.reshape(hq, b, sq).transpose(1, 0, 2), kc, vc
    return out, kc, vc
