"""The calls of the original FlyWheel package (flywheel-tpu 0.3, JAX Pallas kernels for TPU),
with its signatures, layouts and return conventions, on flywheel's CPU kernels: the three
attention calls below, and its serving-layer calls fused_conv1d_gdn, fused_conv1d_kda,
fused_conv1d_gdn_replay, fused_conv1d_kda_replay and next_replay_lens (the same functions as
flywheel's; under jax.jit they run as XLA FFI custom calls too, their caches aliased).

    import flywheel.tpu as tpu
    out = tpu.flash_attn_func(q, k, v, causal=True)        # q [b, hq, sq, d]: head-major

flywheel's own flash-attn-named calls (flywheel.flash_attn_func, ...) keep flash-attn's
token-major layouts; these take the original package's:

  flash_attn_func         head-major q [b, hq, sq, d], k [b, hkv, sk, d], v [b, hkv, sk, dv]
                          -> out [b, hq, sq, dv];
                          token_major=True with head_dim=: q [b, sq, hq * d], k [b, sk, hkv * d],
                          v [b, sk, hkv * dv] -> out [b, sq, hq * dv];
                          heads_outer_fold=True: q [hq, b, sq, d], k/v [hkv, b, sk, d|dv]
                          -> out [hq, b, sq, dv].
                          lse (return_softmax_lse) is [b, hq, sq] float32 in every layout.
  flash_attn_varlen_func  head-major q [hq, total_q, d], k/v [hkv, total_k, d|dv]
                          -> out [hq, total_q, dv], lse [hq, total_q];
                          token_major=True: q [total_q, hq * d] ... -> out [total_q, hq * dv];
                          block_table=: a paged, read-only merged cache as k (see below),
                          v=None, cu_seqlens_k=None, seqused_k [b] (kv lengths, new tokens
                          included), num_active.
  flash_attn_with_kvcache q [b, sq, hq, d] (token-major, as in flash-attn) or packed
                          [total_q, hq, d] with cu_seqlens_q; a contiguous pair
                          k_cache/v_cache [b_cache, S, hkv, d], or with block_table the merged
                          paged cache as k_cache and v_cache=None. Returns
                          (out, [lse,] k_cache, v_cache) or (out, [lse,] kv_cache).

The merged paged cache is [num_pages, page_size, 2 * hkv, d]: row 2h of a token is K head h,
row 2h + 1 is V head h ([k0, v0, k1, v1, ...]). flywheel reads it through two strided views
(kv[:, :, 0::2] and kv[:, :, 1::2]), so appends write into the caller's array in place. Any
page_size works (pages of more than 65536 tokens are split into flywheel pages of a divisor of
it, up to 65536).

Masks as in the original (and flash-attn): causal and window_size are aligned bottom-right,
query i of a sequence sees key j iff i + sk - sq - left <= j <= i + sk - sq + right (a side
of -1 is unbounded; causal sets right to 0); softcap > 0 applies
softcap * tanh(softmax_scale * q.k / softcap); softmax_scale defaults to 1 / sqrt(d). Rows
that see no key give out 0 and lse -inf, as do padding rows (past cu_seqlens_q[-1], or past
num_active) and rows of requests past num_active (which append nothing).

Attention sinks (flywheel's extension, as its flash-attn calls take them): sinks= (or s_aux=,
vLLM's name) [hq], any floating dtype, one logit per query head that joins every row's softmax
denominator; lse includes it, and a row of a sequence that sees no key gives out 0 and lse
sinks[h]. Padding rows and rows past num_active belong to no sequence: out 0, lse -inf still.

Arrays: numpy arrays, torch CPU tensors or JAX arrays, in float32, bfloat16 or float16
(the original takes bfloat16 only; flywheel takes more). Inputs are read in place (JAX arrays
through DLPack, or numpy where DLPack has no code for the dtype, e.g. bfloat16). Results come
back in q's family: numpy, torch, or JAX (a new JAX array). Caches: numpy arrays and torch
tensors are updated in place and returned (the same objects); JAX arrays cannot be written,
so a JAX cache is copied, updated, and returned as a new JAX array, which the caller must
rebind (as the original asks too: it donates its caches).

Under jax.jit (traced values), the three attention calls run as XLA FFI custom calls
(flywheel.jax): the same kernels and bits; flash_attn_func and flash_attn_varlen_func are
differentiable (jax.grad), flash_attn_with_kvcache appends to donated caches in place, and the
index operands (cu_seqlens_q, cache_seqlens, block_table, seqused_k, num_active,
cache_batch_idx) may be traced, as the original allows. The rotary tables are taken there too
(not differentiable, as in the original).

interpret is accepted and ignored (there is no Pallas interpreter here), so is block_sizes
of flash_attn_varlen_func (a TPU tile choice; checked as the original checks it), and
deterministic (flywheel is always deterministic). The original's restrictions that come from
TPU tiling (sequence lengths, head dims and page sizes in multiples of 128, even kv head
counts, decode-only contiguous caches, window right bounds of -1 or 0 on paged calls,
max_seqlen underestimates) are not imposed: those calls are computed exactly.

Refused with NotImplementedError (never ignored): dropout_p != 0, alibi_slopes,
return_attn_probs, attention_chunk, fused RoPE with a paged varlen cache,
heads_outer_fold with token_major or return_softmax_lse (as in the original); a page size
with no power-of-two factor of at least 8. The original's ValueErrors on bad arguments
(window sides below -1, negative softcap, head_dim without token_major, v with a block
table, ...) are raised here too.
"""

import sys

import numpy as np

from . import attention as _attn
from .layers import (fused_conv1d_gdn, fused_conv1d_gdn_replay, fused_conv1d_kda,
                     fused_conv1d_kda_replay, next_replay_lens)

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "fused_conv1d_gdn", "fused_conv1d_kda", "fused_conv1d_gdn_replay",
           "fused_conv1d_kda_replay", "next_replay_lens"]



# flywheel's paged cache: any page size up to _MAX_PAGE
_MAX_PAGE = 65536


# ------------------------------------------------------------------ array families --

def _torch():
    return sys.modules.get("torch")


def _is_torch(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _is_jax(x):
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def _check_not_traced(x, name):
    if _traced(x):
        raise TypeError(f"{name} is a traced JAX value: this form of the call runs eagerly on "
                        "the CPU only; under jax.jit / vmap / grad flywheel.tpu serves "
                        "flash_attn_func and flash_attn_with_kvcache on contiguous caches")


def _host(x, name):
    """An input as flywheel reads it: numpy and torch as they are, a JAX array as a
    (read-only) numpy view of its memory, through DLPack where numpy has a code for the
    dtype, else through __array__ (bfloat16)."""
    if x is None or not _is_jax(x):
        return x
    _check_not_traced(x, name)
    try:
        return np.from_dlpack(x)
    except (BufferError, TypeError, RuntimeError, ValueError):
        return np.asarray(x)


def _host_cache(x, name):
    """A cache that may be written: numpy and torch as they are (written in place); a JAX
    array as a writable numpy copy (returned to the caller as a new JAX array)."""
    if x is None or not _is_jax(x):
        return x
    _check_not_traced(x, name)
    return np.array(x, copy=True)


def _export(x, jax_family):
    if not jax_family:
        return x
    import jax.numpy as jnp
    return jnp.asarray(x)


def _ints(x, name):
    """An index operand (lengths, offsets, block tables) as a numpy integer array; ValueError
    if it is not integers (the original's rule)."""
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    elif _is_jax(x):
        _check_not_traced(x, name)
        x = np.asarray(x)
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array; got dtype {a.dtype}")
    return a.astype(np.int64)


def _count(x, name):
    """A python int from an int or a one-element integer array (num_active, max_seqlen)."""
    a = _ints(x, name)
    if a.size != 1:
        raise ValueError(f"{name} must be one integer; got shape {a.shape}")
    return int(a.reshape(()))


def _new(ref, shape, dtype=None, fill=None):
    """A new contiguous array of ref's family (torch tensor or numpy array) and dtype
    (or `dtype`, "float32"); filled with `fill` when given, else uninitialised."""
    if _is_torch(ref):
        torch = _torch()
        dt = ref.dtype if dtype is None else getattr(torch, dtype)
        if fill is None:
            return torch.empty(shape, dtype=dt)
        return torch.full(shape, fill, dtype=dt)
    dt = ref.dtype if dtype is None else np.dtype(dtype)
    if fill is None:
        return np.empty(shape, dtype=dt)
    return np.full(shape, fill, dtype=dt)


def _perm(x, axes):
    return x.permute(*axes) if _is_torch(x) else x.transpose(axes)


def _shape(x):
    return tuple(x.shape)


def _ndim(x):
    return len(x.shape)


# ------------------------------------------------------------------ argument checks --

def _common(window_size, dropout_p=0.0, softcap=0.0, alibi_slopes=None,
            return_attn_probs=False):
    """The original's shared checks; returns window_size as a tuple of two ints."""
    if dropout_p:
        raise NotImplementedError("dropout_p is not supported (flywheel is forward-only "
                                  "inference attention)")
    try:
        window = tuple(window_size)
    except TypeError:
        window = None
    if window is None or len(window) != 2 or any(side != -1 and side < 0 for side in window):
        raise ValueError("window_size must be a 2-tuple of -1 (unbounded) or non-negative "
                         f"ints; got {window_size!r}")
    if softcap < 0.0:
        raise ValueError(f"softcap must be non-negative; got {softcap}")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported")
    if return_attn_probs:
        raise NotImplementedError("return_attn_probs is not supported (as in the original)")
    return tuple(int(side) for side in window)


def _rotary_tables(rotary_cos, rotary_sin, rotary_interleaved, rotary_k):
    """The fused RoPE arguments of flywheel's calls (host arrays of the tables)."""
    if rotary_cos is None and rotary_sin is None:
        return {}
    if type(rotary_interleaved) is not bool or type(rotary_k) is not bool:
        raise ValueError("rotary_interleaved and rotary_k must be static bools")
    return dict(rotary_cos=None if rotary_cos is None else _host(rotary_cos, "rotary_cos"),
                rotary_sin=None if rotary_sin is None else _host(rotary_sin, "rotary_sin"),
                rotary_interleaved=rotary_interleaved, rotary_k=rotary_k)


def _sinks(sinks, s_aux):
    """The attention sinks of a call (sinks= or its alias s_aux=, not both), a host array."""
    return _host(_attn._sinks_arg(sinks, s_aux), "sinks")


def _check_max_seqlens(max_seqlen_q, max_seqlen_k):
    """The original's rule: positive static bounds (they only size its tiles, so an
    underestimate is not an error there, nor here); returns them as ints."""
    bounds = []
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _check_not_traced(value, name)
        if _is_torch(value) or _is_jax(value) or isinstance(value, np.ndarray):
            value = _count(value, name)
        if int(value) <= 0:
            raise ValueError(f"{name} must be positive; got {value}")
        bounds.append(int(value))
    return bounds


def _cu(x, name):
    cu = _ints(x, name)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be a 1-D integer array of batch + 1 boundaries; got "
                         f"shape {cu.shape}")
    return cu


def _num_active(num_active, batch):
    if num_active is None:
        return batch
    n = _count(num_active, "num_active")
    if not 0 <= n <= batch:
        raise ValueError(f"num_active must be in [0, {batch}]; got {n}")
    return n


def _used_rows(cu, total, name):
    """cu[-1], the rows the sequences own (rows past it are padding), checked against the
    buffer's `total` rows."""
    used = int(cu[-1])
    if not 0 <= used <= total:
        raise ValueError(f"{name}[-1] = {used}, but the buffer has {total} token rows")
    return used


def _max_len(cu):
    return max(0, int(np.max(np.diff(cu))))


def _token_major_heads(q, k, v, head_dim, rank):
    """(hq, hkv, d, dv) of fused (..., heads * head_dim) q/k/v, the original's rules (less its
    TPU head-dim restrictions)."""
    if head_dim is None:
        raise ValueError("token-major (fused head_dim) inputs require head_dim=; the fused "
                         f"width alone cannot determine the head split (got q {_shape(q)})")
    if type(head_dim) is not int:
        raise ValueError(f"head_dim must be a python int; got {head_dim!r}")
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive; got {head_dim}")
    if _ndim(q) != rank:
        raise ValueError(f"token_major=True expects {rank}-D (..., seqlen, nheads * head_dim) "
                         f"q/k/v; got q {_shape(q)}")
    if _ndim(k) != rank or _ndim(v) != rank:
        raise ValueError(f"q/k/v ranks must match; got {_shape(q)}, {_shape(k)}, {_shape(v)}")
    if q.shape[-1] % head_dim or k.shape[-1] % head_dim:
        raise ValueError(f"head_dim {head_dim} must divide the q/k fused widths; got "
                         f"{_shape(q)}, {_shape(k)}")
    hq, hkv = q.shape[-1] // head_dim, k.shape[-1] // head_dim
    if hkv == 0 or v.shape[-1] % hkv:
        raise ValueError(f"v fused width {v.shape[-1]} must be a multiple of nheads_k {hkv}")
    return hq, hkv, head_dim, v.shape[-1] // hkv


def _check_head_major(q, k, v, head_dim, heads_outer_fold):
    """flash_attn_func's rules for its 4-D layouts (head-major, or heads outer)."""
    if head_dim is not None:
        raise ValueError("head_dim is only meaningful for token-major (..., seqlen, "
                         "nheads * head_dim) inputs; 4-D inputs carry the split in their "
                         "shape")
    if _ndim(q) != 4 or _ndim(k) != 4 or _ndim(v) != 4:
        layout = "nheads, batch" if heads_outer_fold else "batch, nheads"
        raise ValueError(f"q/k/v must be 4-D ({layout}, seqlen, headdim); got "
                         f"{_shape(q)}, {_shape(k)}, {_shape(v)}")
    batch_axis, head_axis = (1, 0) if heads_outer_fold else (0, 1)
    _check_qkv(q, k, v, [batch_axis], head_axis)


def _check_qkv(q, k, v, batch_axes, head_axis):
    """The original's head-major shape rules: batch axes shared, k and v alike but for
    head_dim, q and k head dims equal, hkv dividing hq."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"Incompatible shapes: q {_shape(q)} vs k {_shape(k)}")
    if any(q.shape[a] != k.shape[a] for a in batch_axes):
        raise ValueError(f"Incompatible shapes: q {_shape(q)} vs k {_shape(k)}")
    if _shape(k)[:-1] != _shape(v)[:-1]:
        raise ValueError(f"k and v must share every axis but head_dim; got {_shape(k)}, "
                         f"{_shape(v)}")
    if k.shape[head_axis] == 0 or q.shape[head_axis] % k.shape[head_axis]:
        raise ValueError(f"nheads={q.shape[head_axis]} must be a multiple of "
                         f"nheads_k={k.shape[head_axis]}")


# ----------------------------------------------------------------------- paged caches --

def _split_factor(page):
    """How many flywheel pages one page of `page` tokens becomes: 1 up to 65536 tokens, else
    the fewest that divide it into pages of at most 65536."""
    if page <= 0:
        raise ValueError(f"page_size must be positive; got {page}")
    return next(r for r in range(1, page + 1) if page % r == 0 and page // r <= _MAX_PAGE)


def _split_pages(x, r, name):
    """x [N, P, ...] as a view [N * r, P / r, ...] of the same memory (writes reach x)."""
    if r == 1:
        return x
    n, p = x.shape[0], x.shape[1]
    shape = (n * r, p // r) + tuple(x.shape[2:])
    if _is_torch(x):
        try:
            return x.view(shape)
        except RuntimeError:
            pass
    else:
        s0, s1 = x.strides[:2]
        if n == 1 or s0 == p * s1:
            return np.lib.stride_tricks.as_strided(x, shape, (s1 * (p // r), s1) + x.strides[2:])
    raise ValueError(f"{name}: its page axes cannot be split into flywheel's page size without "
                     "a copy (the cache is written in place): pass a cache whose first two "
                     "axes are contiguous")


def _split_table(table, r):
    """A block table over pages of P tokens as one over pages of P / r tokens: page e becomes
    pages e*r .. e*r + r - 1. Out-of-range entries stay out of range (flywheel reports the
    ones a sequence uses; it never reads the others)."""
    if r == 1:
        return table
    t = table[:, :, None] * r + np.arange(r, dtype=np.int64)
    t = t.reshape(table.shape[0], table.shape[1] * r)
    return np.clip(t, -1, np.iinfo(np.int32).max)


def _merged_views(kv):
    """K and V of a merged [num_pages, page_size, 2 * hkv, d] cache, as strided views."""
    return kv[:, :, 0::2], kv[:, :, 1::2]


# ------------------------------------------------------------------------ the calls --

def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), attention_chunk=None, softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False, return_softmax_lse=False,
                    interpret=False, head_dim=None, token_major=False, *, rotary_cos=None,
                    rotary_sin=None, rotary_interleaved=False, rotary_k=True,
                    heads_outer_fold=False, sinks=None, s_aux=None):
    """Dense attention in the original FlyWheel's layouts.

    Head-major (default): q [b, hq, sq, d], k [b, hkv, sk, d], v [b, hkv, sk, dv] ->
    out [b, hq, sq, dv]. token_major=True: q [b, sq, hq * d], k [b, sk, hkv * d],
    v [b, sk, hkv * dv] with head_dim=d -> out [b, sq, hq * dv]. heads_outer_fold=True
    (head-major only): q [hq, b, sq, d], k/v [hkv, b, sk, d|dv] -> out [hq, b, sq, dv].
    return_softmax_lse adds lse [b, hq, sq] float32 (natural log). Masks, softcap and
    defaults: see the module docstring. interpret is ignored; rotary tables,
    attention_chunk, dropout, ALiBi and return_attn_probs raise NotImplementedError.
    rotary_cos / rotary_sin [seqlen_ro, rotary_dim / 2]: fused RoPE as in the original (key j
    at position j, query i at sk - sq + i; rotary_k=False rotates q only), any rotary_dim
    <= d (the original takes full-head tables only).
    sinks / s_aux [hq]: attention sinks (flywheel's extension; see the module docstring).
    """
    del interpret, deterministic  # no effect here (see above)
    window = _common(window_size, dropout_p, softcap, alibi_slopes, return_attn_probs)
    if attention_chunk is not None:
        raise NotImplementedError("attention_chunk is not supported")
    if type(heads_outer_fold) is not bool:
        raise TypeError("heads_outer_fold must be a bool")
    if heads_outer_fold and (token_major or return_softmax_lse):
        raise NotImplementedError("heads_outer_fold is a head-major layout without "
                                  "return_softmax_lse (as in the original)")
    if _traced(q, k, v, sinks, s_aux, rotary_cos, rotary_sin):
        if rotary_cos is not None or rotary_sin is not None:
            if type(rotary_interleaved) is not bool or type(rotary_k) is not bool:
                raise ValueError("rotary_interleaved and rotary_k must be static bools")
        rotary = dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                      rotary_interleaved=rotary_interleaved, rotary_k=rotary_k)
        return _jitted_func(q, k, v, softmax_scale, causal, window, softcap,
                            return_softmax_lse, head_dim, token_major, heads_outer_fold, sinks,
                            s_aux, rotary)
    sinks = _sinks(sinks, s_aux)
    rotary = _rotary_tables(rotary_cos, rotary_sin, rotary_interleaved, rotary_k)
    jax_out = _is_jax(q)
    q, k, v = _host(q, "q"), _host(k, "k"), _host(v, "v")
    if token_major:
        hq, hkv, d, dv = _token_major_heads(q, k, v, head_dim, 3)
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"Incompatible shapes: q {_shape(q)} vs k {_shape(k)}")
        if _shape(k)[:-1] != _shape(v)[:-1]:
            raise ValueError(f"k and v must share every axis but the fused one; got "
                             f"{_shape(k)}, {_shape(v)}")
        b, sq = q.shape[0], q.shape[1]
        fq = q.reshape(b, sq, hq, d)
        fk = k.reshape(k.shape[0], k.shape[1], hkv, d)
        fv = v.reshape(v.shape[0], v.shape[1], hkv, dv)
        out = _new(q, (b, sq, hq * dv))
        fout = out.reshape(b, sq, hq, dv)
    else:
        _check_head_major(q, k, v, head_dim, heads_outer_fold)
        # flash-attn's [b, s, h, d] as a view of either head-major layout
        axes = (1, 2, 0, 3) if heads_outer_fold else (0, 2, 1, 3)
        fq, fk, fv = _perm(q, axes), _perm(k, axes), _perm(v, axes)
        out = _new(q, _shape(q)[:3] + (v.shape[-1],))
        fout = _perm(out, axes)
    r = _attn.flash_attn_func(fq, fk, fv, softmax_scale=softmax_scale, causal=causal,
                              window_size=window, softcap=softcap,
                              return_softmax_lse=return_softmax_lse, out=fout, sinks=sinks,
                              **rotary)
    if return_softmax_lse:
        return _export(out, jax_out), _export(r[1], jax_out)
    return _export(out, jax_out)


def _traced(*xs):
    """Whether any argument is a traced JAX value (inside jax.jit, grad or vmap)."""
    jax = sys.modules.get("jax")
    tracer = getattr(getattr(jax, "core", None), "Tracer", None)
    return tracer is not None and any(isinstance(x, tracer) for x in xs)


def _jitted_func(q, k, v, softmax_scale, causal, window, softcap, return_softmax_lse,
                 head_dim, token_major, heads_outer_fold, sinks, s_aux, rotary):
    """flash_attn_func on traced JAX values: flywheel.jax's FFI call, in the head-major or
    heads-outer layout (strides, no transpose) or on the token-major fused layout reshaped to
    [b, s, h, d]."""
    from . import jax as fj
    if token_major:
        hq, hkv, d, dv = _token_major_heads(q, k, v, head_dim, 3)
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"Incompatible shapes: q {_shape(q)} vs k {_shape(k)}")
        b, sq = q.shape[0], q.shape[1]
        r = fj.flash_attn_func(q.reshape(b, sq, hq, d), k.reshape(k.shape[0], k.shape[1], hkv, d),
                               v.reshape(v.shape[0], v.shape[1], hkv, dv),
                               softmax_scale=softmax_scale, causal=causal, window_size=window,
                               softcap=softcap, return_softmax_lse=True, sinks=sinks, s_aux=s_aux,
                               **rotary)
        out = r[0].reshape(b, sq, hq * dv)
    else:
        _check_head_major(q, k, v, head_dim, heads_outer_fold)
        r = fj.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               window_size=window, softcap=softcap, return_softmax_lse=True,
                               head_major=not heads_outer_fold, heads_outer_fold=heads_outer_fold,
                               sinks=sinks, s_aux=s_aux, **rotary)
        out = r[0]
    return (out, r[1]) if return_softmax_lse else out


def _jitted_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window, softcap, return_softmax_lse, head_dim,
                   token_major, block_table, seqused_k, num_active, sinks, s_aux, rotary):
    """flash_attn_varlen_func on traced values: flywheel.jax's packed call (head-major through
    strides), or with block_table its read-only cache call on the merged cache."""
    from . import jax as fj
    _check_max_seqlens(max_seqlen_q, max_seqlen_k)
    if block_table is not None:
        if token_major:
            raise NotImplementedError("a paged KV cache takes head-major q (nheads, total_q, "
                                      "headdim); token_major=True is not supported (as in the "
                                      "original)")
        if cu_seqlens_k is not None or v is not None or seqused_k is None:
            raise ValueError("with block_table, pass the merged cache as k, v=None, "
                             "cu_seqlens_k=None and seqused_k (each sequence's kv length)")
        if _ndim(q) != 3 or _ndim(k) != 4 or k.shape[2] % 2:
            raise ValueError(f"with block_table, q must be (nheads, total_q, headdim) and k one "
                             f"merged (num_pages, page_size, 2 * nheads_k, headdim) cache; got "
                             f"{_shape(q)}, {_shape(k)}")
        fj._float_operands(("q", "k"), q, k)
        cu = fj._int_array(cu_seqlens_q, "cu_seqlens_q")
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"cu_seqlens_q must be (batch + 1,); got {_shape(cu)}")
        batch = cu.shape[0] - 1
        seqused = fj._int_array(seqused_k, "seqused_k", (batch,))
        table = fj._int_array(block_table, "block_table")
        if table.ndim != 2 or table.shape[0] != batch or table.shape[1] == 0:
            raise ValueError(f"block_table must be a (batch={batch}, max_pages_per_seq >= 1) "
                             f"integer array; got {_shape(table)}")
        hq, hkv = q.shape[0], k.shape[2] // 2
        if k.shape[3] != q.shape[2] or hkv == 0 or hq % hkv:
            raise ValueError(f"Incompatible shapes: q {_shape(q)} vs k {_shape(k)}")
        na = batch if num_active is None else fj._int_array(num_active, "num_active", ())
        s = fj._sinks(sinks, s_aux, hq)
        cfg = fj._config(q.shape[2], softmax_scale, causal, window, softcap, fj.HEAD_MAJOR)
        out, lse = fj._kvcache_call(q, (k,), seqused, cu, na, table, None, None, None, s, cfg,
                                    head_major=True, read_only=True)
        return (out, lse) if return_softmax_lse else out
    if seqused_k is not None or num_active is not None:
        raise ValueError("seqused_k and num_active describe a paged KV cache and need "
                         "block_table; packed K/V takes cu_seqlens_k")
    if token_major:
        hq, hkv, d, dv = _token_major_heads(q, k, v, head_dim, 2)
        r = fj.flash_attn_varlen_func(q.reshape(q.shape[0], hq, d), k.reshape(k.shape[0], hkv, d),
                                      v.reshape(v.shape[0], hkv, dv), cu_seqlens_q, cu_seqlens_k,
                                      softmax_scale=softmax_scale, causal=causal,
                                      window_size=window, softcap=softcap,
                                      return_softmax_lse=True, sinks=sinks, s_aux=s_aux, **rotary)
        out = r[0].reshape(q.shape[0], hq * dv)
    else:
        if head_dim is not None:
            raise ValueError("head_dim is only meaningful for token-major (total, nheads * "
                             "head_dim) inputs; 3-D inputs carry the split in their shape")
        if _ndim(q) != 3 or _ndim(k) != 3 or _ndim(v) != 3:
            raise ValueError(f"q/k/v must be 3-D (nheads, total, headdim); got {_shape(q)}, "
                             f"{_shape(k)}, {_shape(v)}")
        _check_qkv(q, k, v, [], 0)
        r = fj.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                      softmax_scale=softmax_scale, causal=causal,
                                      window_size=window, softcap=softcap,
                                      return_softmax_lse=True, head_major=True, sinks=sinks,
                                      s_aux=s_aux, **rotary)
        out = r[0]
    return (out, r[1]) if return_softmax_lse else out


def _jitted_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                    num_active, cu_seqlens_q, softmax_scale, causal, window, softcap,
                    return_softmax_lse, sinks, s_aux):
    """flash_attn_with_kvcache on traced values: flywheel.jax's cache call, the merged paged
    cache through its strided K and V views; the caches come back aliased (in place when the
    caller donates them)."""
    from . import jax as fj
    ragged = cu_seqlens_q is not None
    if _ndim(q) != (3 if ragged else 4):
        raise ValueError(f"q must be {'(total_q' if ragged else '(batch, seqlen_q'}, nheads, "
                         f"head_dim); got {_shape(q)}")
    if ragged:
        cu = fj._int_array(cu_seqlens_q, "cu_seqlens_q")
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"cu_seqlens_q must be (batch + 1,); got {_shape(cu)}")
        batch = cu.shape[0] - 1
    else:
        batch, sq = q.shape[0], q.shape[1]
        if batch <= 0 or sq <= 0:
            raise ValueError("batch and seqlen_q must be positive")
        cu = fj.jnp.arange(batch + 1, dtype=fj.jnp.int32) * sq
    hq, d = q.shape[-2], q.shape[-1]
    if block_table is not None:
        if v_cache is not None or cache_batch_idx is not None:
            raise ValueError("With block_table, pass one merged (num_pages, page_size, "
                             "2 * nheads_k, head_dim) cache as k_cache, v_cache=None and no "
                             "cache_batch_idx")
        if _ndim(k_cache) != 4 or k_cache.shape[2] % 2:
            raise ValueError("With block_table, k_cache must be (num_pages, page_size, "
                             f"2 * nheads_k, head_dim); got {_shape(k_cache)}")
        caches, hkv = (k_cache,), k_cache.shape[2] // 2
        table = fj._int_array(block_table, "block_table")
        if table.ndim != 2 or table.shape[0] != batch:
            raise ValueError(f"block_table must be (batch={batch}, max_pages_per_seq); got "
                             f"{_shape(table)}")
    else:
        if v_cache is None or _ndim(k_cache) != 4 or _shape(v_cache) != _shape(k_cache):
            raise ValueError("Without block_table, k_cache and v_cache must be separate "
                             "(batch_cache, capacity, nheads_k, head_dim) caches of one shape")
        caches, hkv, table = (k_cache, v_cache), k_cache.shape[2], None
    fj._float_operands(("q",) + ("k_cache", "v_cache")[:len(caches)], q, *caches)
    if k_cache.shape[3] != d:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} must match q's {d}")
    if hkv <= 0 or hq <= 0 or hq % hkv:
        raise ValueError(f"nheads={hq} must be a multiple of nheads_k={hkv}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be passed together, or both left out")
    if k is not None:
        want = _shape(q)[:-2] + (hkv, d)
        if _shape(k) != want or _shape(v) != want:
            raise ValueError(f"k and v must be {want} (matching q's token layout); got "
                             f"{_shape(k)}, {_shape(v)}")
    seqlens = fj._int_array(cache_seqlens, "cache_seqlens")
    if seqlens.ndim == 0:
        seqlens = fj.jnp.broadcast_to(seqlens, (batch,))
    seqlens = fj._int_array(seqlens, "cache_seqlens", (batch,))
    bidx = None if cache_batch_idx is None else fj._int_array(cache_batch_idx, "cache_batch_idx",
                                                             (batch,))
    if table is None and bidx is None and k_cache.shape[0] < batch:
        raise ValueError(f"the caches hold {k_cache.shape[0]} entries for {batch} sequences: "
                         "pass cache_batch_idx")
    na = batch if num_active is None else fj._int_array(num_active, "num_active", ())
    s = fj._sinks(sinks, s_aux, hq)
    cfg = fj._config(d, softmax_scale, causal, window, softcap, fj.TOKEN_MAJOR)
    flat = (lambda x: x) if ragged else (lambda x: x.reshape((-1,) + x.shape[2:]))
    r = fj._kvcache_call(flat(q), caches, seqlens, cu, na, table, bidx,
                         None if k is None else flat(k), None if v is None else flat(v), s, cfg)
    out, lse = r[0], r[1]
    if not ragged:
        out = out.reshape(_shape(q)[:3] + (out.shape[-1],))
        lse = lse.reshape(hq, batch, sq).transpose(1, 0, 2)
    return (out, lse) + tuple(r[2:]) if return_softmax_lse else (out,) + tuple(r[2:])


def _check_block_sizes(block_sizes):
    """The original's check of its TPU tile override (which is otherwise ignored here)."""
    if block_sizes is None:
        return
    blocks = tuple(block_sizes)
    if len(blocks) != 4 or not all(type(x) is int and x > 0 for x in blocks):
        raise ValueError("block_sizes must be 4 positive ints (block_q, block_kv, "
                         f"block_q_compute, block_kv_compute); got {blocks!r}")
    if blocks[0] % 128 or blocks[1] % 128:
        raise ValueError(f"block_q and block_kv must be multiples of 128; got {blocks!r}")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False,
                           return_softmax_lse=False, interpret=False, head_dim=None,
                           token_major=False, block_sizes=None, *, rotary_cos=None,
                           rotary_sin=None, rotary_interleaved=False, rotary_k=True,
                           block_table=None, seqused_k=None, num_active=None, sinks=None,
                           s_aux=None):
    """Packed variable-length attention in the original FlyWheel's layouts.

    Head-major (default): q [hq, total_q, d], k [hkv, total_k, d], v [hkv, total_k, dv] ->
    out [hq, total_q, dv]; token_major=True: q [total_q, hq * d], k [total_k, hkv * d],
    v [total_k, hkv * dv] with head_dim=d -> out [total_q, hq * dv]. lse [hq, total_q].
    cu_seqlens_q / cu_seqlens_k: [batch + 1] offsets from 0; buffer rows past their last
    entry are padding (out 0, lse -inf). Masks are per sequence, bottom-right aligned.
    max_seqlen_q / max_seqlen_k must be positive; an underestimate is not an error.

    block_table (paged, read-only): k is the merged [num_pages, page_size, 2 * hkv, d] cache
    (rows [k0, v0, k1, v1, ...]), v and cu_seqlens_k are None, seqused_k [batch] gives each
    sequence's kv length (its new tokens included, already in the cache), q stays
    head-major; query t of a sequence with n queries sits at position seqused_k - n + t.
    num_active keeps the first num_active sequences; rows after them give out 0, lse -inf.
    rotary_*: fused RoPE per sequence as in flash_attn_func; with block_table it raises
    NotImplementedError (rotate q before the call: the cache holds rotated keys).
    sinks / s_aux [hq]: attention sinks (see the module docstring), paged or not.
    """
    del interpret, deterministic  # no effect here (see above)
    window = _common(window_size, dropout_p, softcap, alibi_slopes, return_attn_probs)
    _check_block_sizes(block_sizes)
    if _traced(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, num_active, sinks,
               s_aux, rotary_cos, rotary_sin):
        rotary = {}
        if rotary_cos is not None or rotary_sin is not None:
            if block_table is not None:
                raise NotImplementedError("fused RoPE with a paged cache (block_table) is not "
                                          "supported: rotate q before the call (the cache holds "
                                          "rotated keys)")
            if type(rotary_interleaved) is not bool or type(rotary_k) is not bool:
                raise ValueError("rotary_interleaved and rotary_k must be static bools")
            rotary = dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                          rotary_interleaved=rotary_interleaved, rotary_k=rotary_k)
        return _jitted_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, causal, window, softcap, return_softmax_lse,
                              head_dim, token_major, block_table, seqused_k, num_active, sinks,
                              s_aux, rotary)
    sinks = _sinks(sinks, s_aux)
    rotary = _rotary_tables(rotary_cos, rotary_sin, rotary_interleaved, rotary_k)
    if block_table is not None and rotary:
        raise NotImplementedError("fused RoPE with a paged cache (block_table) is not supported: "
                                  "rotate q before the call (the cache holds rotated keys)")
    if block_table is not None:
        return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, causal, window, softcap, return_softmax_lse,
                             head_dim, token_major, block_table, seqused_k, num_active, sinks)
    if seqused_k is not None or num_active is not None:
        raise ValueError("seqused_k and num_active describe a paged KV cache and need "
                         "block_table; packed K/V takes cu_seqlens_k")
    jax_out = _is_jax(q)
    q, k, v = _host(q, "q"), _host(k, "k"), _host(v, "v")
    if token_major:
        hq, hkv, d, dv = _token_major_heads(q, k, v, head_dim, 2)
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must share every axis but the fused one; got "
                             f"{_shape(k)}, {_shape(v)}")
        total_q = q.shape[0]
        fq = q.reshape(total_q, hq, d)
        fk = k.reshape(k.shape[0], hkv, d)
        fv = v.reshape(v.shape[0], hkv, dv)
        out_shape, fout_of = (total_q, hq * dv), (lambda o: o.reshape(total_q, hq, dv))
    else:
        if head_dim is not None:
            raise ValueError("head_dim is only meaningful for token-major (total, nheads * "
                             "head_dim) inputs; 3-D inputs carry the split in their shape")
        if _ndim(q) != 3 or _ndim(k) != 3 or _ndim(v) != 3:
            raise ValueError(f"q/k/v must be 3-D (nheads, total, headdim); got {_shape(q)}, "
                             f"{_shape(k)}, {_shape(v)}")
        _check_qkv(q, k, v, [], 0)
        hq, total_q = q.shape[0], q.shape[1]
        fq, fk, fv = (_perm(x, (1, 0, 2)) for x in (q, k, v))
        out_shape, fout_of = (hq, total_q, v.shape[-1]), (lambda o: _perm(o, (1, 0, 2)))
    cu_q, cu_k = _ints(cu_seqlens_q, "cu_seqlens_q"), _ints(cu_seqlens_k, "cu_seqlens_k")
    if cu_q.ndim != 1 or cu_q.shape != cu_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be equal-shaped 1-D arrays; got "
                         f"{cu_q.shape}, {cu_k.shape}")
    if cu_q.shape[0] < 2:
        raise ValueError("cu_seqlens needs at least 2 entries (0 and the total); got "
                         f"{cu_q.shape[0]}")
    max_q, max_k = _check_max_seqlens(max_seqlen_q, max_seqlen_k)
    used_q = _used_rows(cu_q, fq.shape[0], "cu_seqlens_q")
    used_k = _used_rows(cu_k, fk.shape[0], "cu_seqlens_k")
    padded = used_q < total_q
    out = _new(fq, out_shape, fill=0 if padded else None)
    fout = fout_of(out)[:used_q]
    # flywheel checks max_seqlen against the longest sequence; the original takes any
    # positive bound (it only sizes tiles), so the larger of the two goes through
    r = _attn.flash_attn_varlen_func(
        fq[:used_q], fk[:used_k], fv[:used_k], cu_q, cu_k,
        max(max_q, _max_len(cu_q)), max(max_k, _max_len(cu_k)),
        softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
        return_softmax_lse=return_softmax_lse, out=fout, sinks=sinks, **rotary)
    if not return_softmax_lse:
        return _export(out, jax_out)
    lse = r[1]
    if padded:
        full = _new(fq, (hq, total_q), "float32", fill=-np.inf)
        full[:, :used_q] = lse
        lse = full
    return _export(out, jax_out), _export(lse, jax_out)


def _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, window, softcap, return_softmax_lse, head_dim,
                  token_major, block_table, seqused_k, num_active, sinks):
    """flash_attn_varlen_func's paged branch: flywheel's kvcache call without appends."""
    if token_major:
        raise NotImplementedError("a paged KV cache takes head-major q (nheads, total_q, "
                                  "headdim); token_major=True is not supported (as in the "
                                  "original)")
    if head_dim is not None:
        raise ValueError("head_dim is only meaningful for token-major inputs; a paged call "
                         "takes head-major q")
    if cu_seqlens_k is not None:
        raise ValueError("with block_table, pass cu_seqlens_k=None: seqused_k gives each "
                         "sequence's kv length")
    if v is not None:
        raise ValueError("with block_table, pass one merged (num_pages, page_size, "
                         "2 * nheads_k, headdim) cache as k and v=None")
    if seqused_k is None:
        raise ValueError("block_table needs seqused_k, the (batch,) kv length of each "
                         "sequence (its new tokens included)")
    _check_max_seqlens(max_seqlen_q, max_seqlen_k)
    jax_out = _is_jax(q)
    q, kv = _host(q, "q"), _host(k, "k")
    if _ndim(q) != 3:
        raise ValueError(f"with block_table, q must be (nheads, total_q, headdim); got "
                         f"{_shape(q)}")
    if _ndim(kv) != 4 or kv.shape[2] % 2:
        raise ValueError("with block_table, k must be one merged (num_pages, page_size, "
                         f"2 * nheads_k, headdim) cache; got {_shape(kv)}")
    cu = _cu(cu_seqlens_q, "cu_seqlens_q")
    if cu[0] != 0:
        raise ValueError(f"with block_table, cu_seqlens_q must start at 0; got "
                         f"cu_seqlens_q[0]={int(cu[0])}")
    batch = cu.shape[0] - 1
    seqused = _ints(seqused_k, "seqused_k")
    if seqused.shape != (batch,):
        raise ValueError(f"seqused_k must be a ({batch},) integer array; got {seqused.shape}")
    table = _ints(block_table, "block_table")
    if table.ndim != 2 or table.shape[0] != batch or table.shape[1] == 0:
        raise ValueError(f"block_table must be a (batch={batch}, max_pages_per_seq >= 1) "
                         f"integer array; got {table.shape}")
    na = _num_active(num_active, batch)
    hq, total_q, dv = q.shape[0], q.shape[1], kv.shape[3]
    used = _used_rows(cu[:na + 1], total_q, "cu_seqlens_q")
    padded = used < total_q
    out = _new(q, (hq, total_q, dv), fill=0 if padded else None)
    lse = None
    if used > 0:
        r = _split_factor(kv.shape[1])
        kview, vview = (_split_pages(x, r, "k") for x in _merged_views(kv))
        res = _attn.flash_attn_with_kvcache(
            _perm(q, (1, 0, 2))[:used], kview, vview, cache_seqlens=seqused[:na],
            block_table=_split_table(table[:na], r), softmax_scale=softmax_scale,
            causal=causal, window_size=window, softcap=softcap,
            return_softmax_lse=return_softmax_lse, cu_seqlens_q=cu[:na + 1],
            out=_perm(out, (1, 0, 2))[:used], sinks=sinks)
        if return_softmax_lse:
            lse = res[1]
    if not return_softmax_lse:
        return _export(out, jax_out)
    if padded or lse is None:
        full = _new(q, (hq, total_q), "float32", fill=-np.inf)
        if lse is not None:
            full[:, :used] = lse
        lse = full
    return _export(out, jax_out), _export(lse, jax_out)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                           cache_batch_idx=None, block_table=None, num_active=None,
                           cu_seqlens_q=None, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, return_softmax_lse=False,
                           interpret=False, sinks=None, s_aux=None):
    """Append to a KV cache and attend, the original FlyWheel's call.

    q [b, sq, hq, d], or packed [total_q, hq, d] with cu_seqlens_q [b + 1] (rows past
    cu_seqlens_q[-1] are padding: out 0, lse -inf). Caches: without block_table a contiguous
    pair k_cache, v_cache [b_cache, S, hkv, d] (cache_batch_idx [b] picks each row's cache
    row, identity by default); with block_table [b, max_pages] the merged paged cache
    k_cache [num_pages, page_size, 2 * hkv, d] (rows [k0, v0, k1, v1, ...]) and
    v_cache=None. k, v (together or neither): new tokens in q's token layout with hkv heads,
    written after each row's cache_seqlens (int or [b], lengths before the append); the
    context is then cache_seqlens + the row's new tokens, and queries align bottom-right to
    it. num_active: only the first num_active rows run and append; the rest give out 0 and
    lse -inf. Returns (out, [lse,] k_cache, v_cache), or (out, [lse,] kv_cache) when paged;
    lse is [b, hq, sq], or [hq, total_q] when packed. numpy / torch caches are updated in
    place and returned; JAX caches come back as new arrays. cache_seqlens is not advanced.
    sinks / s_aux [hq]: attention sinks (see the module docstring).
    """
    del interpret  # no effect here (see the module docstring)
    window = _common(window_size, softcap=softcap)
    if _traced(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
               num_active, cu_seqlens_q, sinks, s_aux):
        return _jitted_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                               block_table, num_active, cu_seqlens_q, softmax_scale, causal,
                               window, softcap, return_softmax_lse, sinks, s_aux)
    sinks = _sinks(sinks, s_aux)
    jax_out = _is_jax(q)
    q = _host(q, "q")
    ragged = cu_seqlens_q is not None
    if ragged:
        cu = _cu(cu_seqlens_q, "cu_seqlens_q")
        if _ndim(q) != 3:
            raise ValueError(f"With cu_seqlens_q, q must be (total_q, nheads, head_dim); got "
                             f"{_shape(q)}")
        batch = cu.shape[0] - 1
    elif _ndim(q) != 4:
        raise ValueError(f"q must be (batch, seqlen_q, nheads, head_dim); got {_shape(q)}")
    else:
        batch = q.shape[0]
        if batch <= 0 or q.shape[1] <= 0:
            raise ValueError("batch and seqlen_q must be positive")
    hq, d = q.shape[-2], q.shape[-1]
    paged = block_table is not None
    jax_caches = [_is_jax(k_cache), _is_jax(v_cache)]
    if paged:
        if v_cache is not None:
            raise ValueError("With block_table, pass one merged (num_pages, page_size, "
                             "2 * nheads_k, head_dim) cache as k_cache and v_cache=None")
        if cache_batch_idx is not None:
            raise ValueError("block_table and cache_batch_idx are mutually exclusive: the "
                             "block table already maps each query row to its pages")
        kv = _host_cache(k_cache, "k_cache")
        if _ndim(kv) != 4 or kv.shape[2] % 2:
            raise ValueError("With block_table, k_cache must be (num_pages, page_size, "
                             "2 * nheads_k, head_dim), each KV head's K then its V; got "
                             f"{_shape(kv)}")
        caches = (kv,)
        kc, vc = _merged_views(kv)
        table = _ints(block_table, "block_table")
        if table.ndim != 2 or table.shape[0] != batch:
            raise ValueError(f"block_table must be (batch={batch}, max_pages_per_seq); got "
                             f"{table.shape}")
    else:
        if v_cache is None:
            raise ValueError("Without block_table, k_cache and v_cache must be separate "
                             "(batch_cache, capacity, nheads_k, head_dim) caches; got "
                             "v_cache=None (a merged cache must be paged)")
        kc, vc = _host_cache(k_cache, "k_cache"), _host_cache(v_cache, "v_cache")
        if _ndim(kc) != 4 or _shape(vc) != _shape(kc):
            raise ValueError("k_cache and v_cache must share the shape (batch_cache, "
                             f"capacity, nheads_k, head_dim); got {_shape(kc)}, {_shape(vc)}")
        caches = (kc, vc)
    hkv = kc.shape[2]
    if kc.shape[3] != d:
        raise ValueError(f"cache head_dim {kc.shape[3]} must match q's {d}")
    if hkv <= 0 or hq <= 0 or hq % hkv:
        raise ValueError(f"nheads={hq} must be a multiple of nheads_k={hkv}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be passed together, or both left out")
    if k is not None:
        k, v = _host(k, "k"), _host(v, "v")
        want = _shape(q)[:-2] + (hkv, d)
        if _shape(k) != want or _shape(v) != want:
            raise ValueError(f"k and v must be {want} (matching q's token layout); got "
                             f"{_shape(k)}, {_shape(v)}")
    seqlens = _ints(cache_seqlens, "cache_seqlens")
    if seqlens.ndim == 0:
        seqlens = np.full(batch, int(seqlens), np.int64)
    elif seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must be a scalar or ({batch},) int array; got "
                         f"{seqlens.shape}")
    if cache_batch_idx is not None:
        rows = _ints(cache_batch_idx, "cache_batch_idx")
        if rows.shape != (batch,):
            raise ValueError(f"cache_batch_idx must be a scalar or ({batch},) int array; got "
                             f"{rows.shape}")
    na = _num_active(num_active, batch)

    # the first na rows run (and append); the others are skipped
    if ragged:
        used = _used_rows(cu[:na + 1], q.shape[0], "cu_seqlens_q")
        total = q.shape[0]
        padded = used < total
        out = _new(q, (total, hq, vc.shape[3]), fill=0 if padded else None)
        run = dict(q=q[:used], out=out[:used], cu_seqlens_q=cu[:na + 1])
        kn, vn = (None, None) if k is None else (k[:used], v[:used])
    else:
        used = na
        padded = na < batch
        out = _new(q, _shape(q)[:3] + (vc.shape[3],), fill=0 if padded else None)
        run = dict(q=q[:na], out=out[:na])
        kn, vn = (None, None) if k is None else (k[:na], v[:na])
    if paged:
        r = _split_factor(kc.shape[1])
        kc, vc = _split_pages(kc, r, "k_cache"), _split_pages(vc, r, "k_cache")
        table = _split_table(table[:na], r)
    elif cache_batch_idx is not None:
        # a contiguous cache picked by row: its rows as pages of S tokens, one row per table
        # entry (split into flywheel's page size)
        r = _split_factor(kc.shape[1])
        kc, vc = _split_pages(kc, r, "k_cache"), _split_pages(vc, r, "v_cache")
        table = _split_table(rows[:na, None], r)
    else:
        table = None
        kc, vc = kc[:na], vc[:na]
    lse = None
    if used > 0:
        res = _attn.flash_attn_with_kvcache(
            run["q"], kc, vc, kn, vn, cache_seqlens=seqlens[:na], block_table=table,
            softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
            return_softmax_lse=return_softmax_lse, cu_seqlens_q=run.get("cu_seqlens_q"),
            out=run["out"], sinks=sinks)
        if return_softmax_lse:
            lse = res[1]
    result = [_export(out, jax_out)]
    if return_softmax_lse:
        if ragged:
            shape, rows_of = (hq, q.shape[0]), (lambda a: a[:, :used])
        else:
            shape, rows_of = (batch, hq, q.shape[1]), (lambda a: a[:used])
        if padded or lse is None:
            full = _new(q, shape, "float32", fill=-np.inf)
            if lse is not None:
                rows_of(full)[...] = lse
            lse = full
        result.append(_export(lse, jax_out))
    result += [_export(c, j) for c, j in zip(caches, jax_caches)]
    return tuple(result)
