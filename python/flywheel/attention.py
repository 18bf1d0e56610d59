"""Softmax attention with flash-attn's names, arguments and layouts, forward and backward.

Shapes (b batch, s sequence, h heads, d head dim; hkv divides hq: GQA/MQA):
    flash_attn_func          q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv]
                             -> out [b, sq, hq, dv] (+ lse [b, hq, sq] float32)
    flash_attn_varlen_func   q [total_q, hq, d], k/v [total_k, hkv, d|dv], cu_seqlens int32
                             -> out [total_q, hq, dv] (+ lse [hq, total_q])
    flash_attn_with_kvcache  q [b, sq, hq, d], caches [b, S, hkv, d] or paged
                             [num_blocks, page_size, hkv, d] with block_table [b, max_pages]
                             -> out [b, sq, hq, dv] (+ lse [b, hq, sq])
    flash_attn_backward      dout, q, k, v, out, lse of flash_attn_func -> (dq, dk, dv)
    flash_attn_varlen_backward  the same for flash_attn_varlen_func
Backward: flash_attn_func and flash_attn_varlen_func are differentiable for torch tensors
that require grad (a torch.autograd.Function: the forward saves out and lse, the backward is
the library's fw_attn_bwd, f32 products; the gradient of sinks too where it requires grad);
numpy users call the *_backward functions.
Causal masks and windows are aligned bottom-right, as in flash-attn >= 2.1. Rows that see no
key give 0 (and lse -inf, or the sink with attention sinks: sinks= / s_aux=, [hq] logits that
join every row's softmax denominator, lse included). Inputs are numpy arrays or torch CPU
tensors in float32, bfloat16 (ml_dtypes.bfloat16 or torch.bfloat16) or float16, with any
non-negative element strides; they are read in place. Outputs have q's dtype and family
(numpy or torch) and are contiguous. Accumulation is float32.

Errors: TypeError for a dtype the library does not take (float64, integers, q and k of
different dtypes: FlywheelDtypeError when the library finds it); ValueError for bad shapes
and values (FlywheelError with the library's status when the library finds them, head dim 0
included), and for a read-only numpy array the call would write (out, or k_cache / v_cache
when k and v are appended); NotImplementedError for options the library does not have.
"""

import ctypes

import numpy as np

from . import _lib
from . import _tensors as T

# the compiled fast path's dispatch of calls below, from their description (_calls.py): call it
# with the function's locals() where the call is offered; NotImplemented: the Python path runs it
_fast_func = _lib.fast_call("flash_attn_func")
_fast_varlen = _lib.fast_call("flash_attn_varlen_func")
_fast_kvcache = _lib.fast_call("flash_attn_with_kvcache")


def _params(q, softmax_scale, causal, window_size, softcap, isa=None, plain=False,
            precision=None, sinks=None):
    p = _lib.AttnParams()
    d = q.shape[-1]
    if softmax_scale is None:
        # 0 is the library's 1/sqrt(d): with d = 0 the library reports the shape (FW_ERR_SHAPE)
        scale = 1.0 / float(d) ** 0.5 if d > 0 else 0.0
    else:
        scale = _lib.float32_param(softmax_scale, "softmax_scale", "1/sqrt(d)")
        if scale == 0.0:
            raise NotImplementedError("softmax_scale=0 (uniform attention) is not supported")
    p.scale = scale
    p.causal = 1 if causal else 0
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") \
            from None
    p.window_left = _window_side(left)
    p.window_right = _window_side(right)
    p.softcap = _lib.float32_param(softcap or 0.0, "softcap", "no softcap")
    p.threads = _lib.settings.threads
    p.isa = _lib.isa_name(isa)
    p.flags = _lib.ATTN_PLAIN if plain else 0
    p.precision = _lib.precision(precision)
    if sinks is not None:
        # [hq] (the library checks the length): float32, bfloat16 or float16 read in place,
        # any stride; another floating dtype (float64) as a float32 copy
        s = T.small_float_array(T.detach(sinks), "sinks")
        t = T.describe(s)
        p.sinks = ctypes.pointer(t)
        p.keep_sinks = (s, t)  # alive for the length of the call
    return p


def _sinks_arg(sinks, s_aux):
    """The sinks of a call: sinks= or s_aux= (its name in vLLM's flash-attn), not both."""
    if s_aux is None:
        return sinks
    if sinks is not None:
        raise ValueError("sinks and s_aux are one argument (s_aux is vLLM's name for it): "
                         "pass one of them")
    return s_aux


def _rotary(p, rotary_cos, rotary_sin, interleaved, q_only=False):
    """The rotary embedding of a call into params p (fw_attn_params.rotary_*): tables
    [seqlen_ro, rotary_dim / 2] of any float dtype and strides, read in place."""
    if rotary_cos is None and rotary_sin is None:
        return
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    tables = [T.float_array(T.detach(x), n) for x, n in ((rotary_cos, "rotary_cos"),
                                                          (rotary_sin, "rotary_sin"))]
    if any(t.ndim != 2 for t in tables):
        raise ValueError(f"rotary_cos and rotary_sin must be [seqlen_ro, rotary_dim / 2], got "
                         f"shapes {tuple(tables[0].shape)}, {tuple(tables[1].shape)}")
    described = [T.describe(t) for t in tables]
    p.rotary_cos, p.rotary_sin = (ctypes.pointer(t) for t in described)
    p.rotary_interleaved = 1 if interleaved else 0
    p.rotary_q_only = 1 if q_only else 0
    p.keep = (tables, described)  # alive for the length of the call


def _window_side(side):
    """One side of window_size as the library's int64: flash-attn's rule, any negative value
    (or None) is unbounded, the library's -1; so are +inf and sides of 2^62 or more, which no
    sequence reaches (ctypes would wrap a side past int64 around: 2^64 would become 0)."""
    if side is None or side < 0:
        return -1
    try:
        n = int(side)
    except OverflowError:  # +inf
        return -1
    return -1 if n >= 2**62 else n


def _unsupported(dropout_p=0.0, alibi_slopes=None, **named):
    if dropout_p:
        raise NotImplementedError("dropout_p > 0: flywheel is an inference library (no dropout)")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes are not supported")
    for name, value in named.items():
        if value is not None:
            raise NotImplementedError(f"{name} is not supported")


def _no_grad_rotary(rotary):
    if rotary:
        raise NotImplementedError("rotary embedding with inputs that require grad: the backward "
                                  "takes none (rotate q and k first to differentiate through it)")


def _no_grad_out(out):
    if out is not None:
        raise NotImplementedError("out= with inputs that require grad: autograd needs an output "
                                  "of its own (call under torch.no_grad() to write out)")


def _pack(out, lse, return_lse, return_attn_probs):
    if return_attn_probs:
        return out, lse, None
    if return_lse:
        return out, lse
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, return_softmax_lse=False, out=None, isa=None,
                    plain=False, precision=None, rotary_cos=None, rotary_sin=None,
                    rotary_interleaved=False, rotary_k=True, sinks=None, s_aux=None):
    """Dense attention forward, flash-attn's `flash_attn_func`.

    q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv] -> out [b, sq, hq, dv].
    causal: query i sees key j <= i + sk - sq. window_size (left, right), -1 = unbounded.
    softcap > 0: scores become softcap * tanh(score / softcap).
    return_softmax_lse=True returns (out, lse [b, hq, sq] float32); return_attn_probs=True
    returns (out, lse, None) like flash-attn without dropout. Results do not depend on
    `deterministic` (always deterministic). No copies of q, k, v (see module docstring).
    out: an existing [b, sq, hq, dv] array or tensor to write (and return) instead of a new
    one, which saves the allocation and first-touch page faults of large outputs.
    isa names a kernel table (flywheel.isa_tables(): "portable", "avx2", ..., "neon_bf16");
    plain=True runs the plain row-at-a-time baseline kernel (always f32 products).
    precision of the products QK^T and PV: None or "auto" (bf16 for bfloat16 q, else f32),
    "f32", or "bf16" (q, k, v and the probabilities P rounded to bf16, f32 accumulation).
    Rotary embedding (flywheel-tpu's extension): rotary_cos / rotary_sin [seqlen_ro,
    rotary_dim / 2] (rotary_dim <= d: the first rotary_dim channels rotate) rotate key j at
    position j and query i at sk - sq + i (so sq <= sk) as the kernels read them; q and k are
    not written. rotary_interleaved: GPT-J pairs instead of GPT-NeoX halves; rotary_k=False
    rotates q only. Not differentiable (NotImplementedError with grad).
    sinks [hq] (or s_aux, vLLM's name; not both): attention sinks, one logit per query head
    (gpt-oss) that joins every row's softmax denominator: out = sum_j e^s_j v_j /
    (sum_j e^s_j + e^sinks[h]); lse includes the sink, a row that sees no key gives out 0 and
    lse sinks[h]. Any floating dtype (float32, bfloat16, float16 read in place, others as a
    float32 copy), numpy or torch.
    Torch tensors that require grad (with grad enabled) make the call differentiable: the
    gradients of q, k, v (and of sinks, where it requires grad) come from flash_attn_backward
    (the saved out and lse; lse itself is not differentiable); out= is refused then.
    Not supported (NotImplementedError): dropout, ALiBi, non-CPU tensors.
    """
    _unsupported(dropout_p, alibi_slopes)
    # truth values first: one that raises (a numpy array) must not raise after out is written
    return_softmax_lse, return_attn_probs = bool(return_softmax_lse), bool(return_attn_probs)
    want_lse = return_softmax_lse or return_attn_probs
    rotary = rotary_cos is not None or rotary_sin is not None
    sinks = _sinks_arg(sinks, s_aux)
    if T.wants_grad(q, k, v, sinks):
        _no_grad_out(out)
        _no_grad_rotary(rotary)
        from . import _autograd
        r = _autograd.dense(q, k, v, sinks, softmax_scale, causal, window_size, softcap, isa,
                            plain, precision)
        return _pack(*r, return_softmax_lse, return_attn_probs) if want_lse else r[0]
    r = _fast_func(locals())
    if r is not NotImplemented:
        return _pack(*r, return_softmax_lse, return_attn_probs) if want_lse else r
    q, k, v = (T.float_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [b, sq, hq, d], [b, sk, hkv, d], [b, sk, hkv, dv], "
                         f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, sq, hq, _ = q.shape
    dv = v.shape[-1]
    out = T.output(out, q, (b, sq, hq, dv))
    lse = T.empty_like_family(q, (b, hq, sq), "float32") if want_lse else None
    p = _params(q, softmax_scale, causal, window_size, softcap, isa, plain, precision, sinks)
    _rotary(p, rotary_cos, rotary_sin, rotary_interleaved, not rotary_k)
    tq, tk, tv, to = T.describe(q), T.describe(k), T.describe(v), T.describe(out)
    tl = T.describe(lse) if want_lse else None
    _lib.check(_lib.lib.fw_attn_fwd(tq, tk, tv, to, tl, p))
    return _pack(out, lse, return_softmax_lse, return_attn_probs)


def _max_len(cu):
    return int(np.max(np.diff(cu))) if cu.size > 1 else 0


def _check_cu_seqlens(cu, name, total, rows):
    """cu_seqlens as the library wants them (1-D, from 0, non-decreasing, to `total`, the rows
    of `rows`), checked before anything that reads lengths from them; FlywheelError
    FW_ERR_SEQLENS (a ValueError) naming the first entry that is wrong."""
    def bad(message):
        return _lib.FlywheelError("FW_ERR_SEQLENS", message)
    if cu.ndim != 1 or cu.size < 1:
        raise bad(f"{name} must be 1-D with batch + 1 entries, got shape {cu.shape}")
    if cu[0] != 0:
        raise bad(f"{name}[0] = {cu[0]}, expected 0")
    down = np.flatnonzero(cu[1:] < cu[:-1])
    if down.size:
        i = int(down[0]) + 1
        raise bad(f"{name}[{i}] = {cu[i]} is less than {name}[{i - 1}] = {cu[i - 1]} (offsets "
                  "must be non-decreasing)")
    if cu[-1] != total:
        raise bad(f"{name}[-1] = {cu[-1]}, but {rows} has {total} rows")


def _varlen_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k):
    """The int32 offsets of a varlen call, checked against q's and k's rows and the max
    lengths (the offsets first: the lengths max_seqlen is compared with mean nothing until
    they hold)."""
    cq = T.index_array(cu_seqlens_q, "cu_seqlens_q")
    ck = T.index_array(cu_seqlens_k, "cu_seqlens_k")
    if cq.ndim != 1 or ck.ndim != 1 or cq.size != ck.size or cq.size < 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be 1-D with batch + 1 entries each")
    _check_cu_seqlens(cq, "cu_seqlens_q", q.shape[0], "q")
    _check_cu_seqlens(ck, "cu_seqlens_k", k.shape[0], "k")
    if max_seqlen_q < _max_len(cq) or max_seqlen_k < _max_len(ck):
        raise ValueError(f"max_seqlen_q={max_seqlen_q}, max_seqlen_k={max_seqlen_k} are below "
                         f"the longest sequences ({_max_len(cq)}, {_max_len(ck)})")
    return cq, ck


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           return_softmax_lse=False, out=None, isa=None, precision=None,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                           rotary_k=True, sinks=None, s_aux=None):
    """Packed variable-length attention, flash-attn's `flash_attn_varlen_func`.

    q [total_q, hq, d], k [total_k, hkv, d], v [total_k, hkv, dv]; cu_seqlens_q/k: batch + 1
    int32 offsets (any integer array; copied to int32 if needed). Masks are per sequence,
    aligned bottom-right; no key of another sequence is seen. max_seqlen_q/k must be at least
    the longest sequence (checked). Returns out [total_q, hq, dv], and lse [hq, total_q]
    float32 with return_softmax_lse / return_attn_probs. out: an existing [total_q, hq, dv]
    output to write instead of a new one. precision: None/"auto", "f32" or "bf16" products, as
    in flash_attn_func. block_table (paged K/V) is not supported here: use
    flash_attn_with_kvcache. Differentiable for torch tensors that require grad, as
    flash_attn_func (flash_attn_varlen_backward). rotary_*: as in flash_attn_func, positions
    per sequence. sinks / s_aux [hq]: as in flash_attn_func.
    """
    _unsupported(dropout_p, alibi_slopes, block_table=block_table)
    return_softmax_lse, return_attn_probs = bool(return_softmax_lse), bool(return_attn_probs)
    want_lse = return_softmax_lse or return_attn_probs
    rotary = rotary_cos is not None or rotary_sin is not None
    sinks = _sinks_arg(sinks, s_aux)
    if T.wants_grad(q, k, v, sinks):
        _no_grad_out(out)
        _no_grad_rotary(rotary)
        from . import _autograd
        r = _autograd.varlen(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, softmax_scale, causal, window_size, softcap, isa,
                             precision)
        return _pack(*r, return_softmax_lse, return_attn_probs) if want_lse else r[0]
    r = _fast_varlen(locals())
    if r is not NotImplemented:
        return _pack(*r, return_softmax_lse, return_attn_probs) if want_lse else r
    q, k, v = (T.float_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v must be [total_q, hq, d], [total_k, hkv, d], "
                         f"[total_k, hkv, dv], got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    cq, ck = _varlen_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    total_q, hq, _ = q.shape
    out = T.output(out, q, (total_q, hq, v.shape[-1]))
    lse = T.empty_like_family(q, (hq, total_q), "float32") if want_lse else None
    p = _params(q, softmax_scale, causal, window_size, softcap, isa, precision=precision,
                sinks=sinks)
    _rotary(p, rotary_cos, rotary_sin, rotary_interleaved, not rotary_k)
    tq, tk, tv, to = T.describe(q), T.describe(k), T.describe(v), T.describe(out)
    tl = T.describe(lse) if want_lse else None
    _lib.check(_lib.lib.fw_attn_varlen_fwd(tq, tk, tv, T.ptr(cq), T.ptr(ck), cq.size - 1, to,
                                           tl, p))
    return _pack(out, lse, return_softmax_lse, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, cu_seqlens_q=None, out=None,
                            isa=None, precision=None, cache_layout="rows", sinks=None,
                            s_aux=None, k_descale=None, v_descale=None):
    """Append to a K/V cache and attend, flash-attn's `flash_attn_with_kvcache`.

    q [b, sq, hq, d] (sq = 1 is decode; more is chunked prefill or speculative decode).
    k_cache/v_cache: contiguous [b, S, hkv, d|dv], or paged [num_blocks, page_size, hkv, d|dv]
    with block_table [b, max_pages] int32 (page_size any from 1 to 65536: vLLM's 1152-token
    blocks of hybrid models too).
    cache_seqlens: int or [b] ints, the tokens each sequence already holds (required).
    k, v [b, sq, hkv, d|dv] (optional): new tokens, written **in place** into the caches at
    positions cache_seqlens[i] .. before attending; then the context is cache_seqlens[i] + sq.
    cache_seqlens is not changed (add sq yourself, as with flash-attn).
    Extension (flash-attn 3): cu_seqlens_q [b + 1] makes q (and k, v) packed
    [total_q, hq, d] with a different number of new tokens per sequence.
    Returns out [b, sq, hq, dv] (or [total_q, hq, dv]), and lse [b, hq, sq]
    ([hq, total_q]) float32 with return_softmax_lse. Decode contexts are split into fixed
    ranges of FW_KV_SPLIT (512) keys, 256 up to 512 keys, none up to 1024 keys with two K/V
    heads or more, whatever num_splits says (the result never depends on the thread count). out: an existing output ([b, sq, hq, dv], whose [b, sq] merge into one stride, or
    [total_q, hq, dv]) to write instead of a new one. precision: None/"auto", "f32" or "bf16"
    products, as in flash_attn_func.
    Copies: q/k/v when [b, sq] cannot be merged into one stride (not for contiguous
    or sq = 1 inputs), and the int32 index arrays.
    Rotary embedding, flash-attn's: rotary_cos / rotary_sin [seqlen_ro, rotary_dim / 2]
    (rotary_dim <= d), only with k and v: new key i is rotated at cache_seqlens + i as it is
    appended (the cache holds rotated keys), query i at cache_seqlens + i when causal or
    windowed, else every query at cache_seqlens; rotary_interleaved (default True, as in
    flash-attn) pairs adjacent channels (GPT-J) instead of the halves (GPT-NeoX). Fused into
    the append and the q packing: no extra pass.
    cache_leftpad: [b] ints (contiguous caches only, as in flash-attn): sequence i's context
    starts at cache row cache_leftpad[i] (0 <= cache_leftpad[i] <= cache_seqlens[i]), the rows
    before it (a left-padded batch's padding) never read; queries align bottom-right to rows
    [cache_leftpad[i], cache_seqlens[i] + sq); new rows are still written at cache_seqlens[i],
    and rotary positions stay the rows' own.
    cache_batch_idx: [b] ints (contiguous caches only, as in flash-attn): sequence i uses
    entry cache_batch_idx[i] of the caches' first dimension; with k and v, two sequences may
    not share an entry (flash-attn leaves the winner undefined; here it is an error).
    cache_layout: "rows" (the default: the layouts above) or "tiles", vLLM CPU_ATTN's AMX
    layout (paged bf16 caches, page_size, d and dv multiples of 32, each [page_size, d] block
    of a (page, head) dense, stored in the order AMX's tile products load it; FW_KV_TILES in
    flywheel.h has the element order): vLLM's cache read in place, and k, v appended in it.
    sinks / s_aux [hq]: attention sinks, as in flash_attn_func (a split decode adds the sink
    once, after merging its ranges).
    fp8 caches (flash-attn 3's): k_cache / v_cache float8_e4m3fn or float8_e5m2 (torch's, or
    ml_dtypes' for numpy) with k_descale / v_descale, each a scalar (a float, or a 0-d or [1]
    array) or [b, hkv], any float dtype (used as float32), both required: a stored element x
    stands for x * descale. q, k, v and out stay float32, bfloat16 or float16; k and v are
    stored as k / k_descale rounded to nearest even, saturating at the type's largest finite
    value. The kernels convert the bytes in registers (docs/attention.md).
    Not supported (NotImplementedError): ALiBi, k without v.
    """
    _unsupported(0.0, alibi_slopes)
    if cache_layout not in ("rows", "tiles"):
        raise ValueError(f'cache_layout must be "rows" or "tiles", got {cache_layout!r}')
    layout = 1 if cache_layout == "tiles" else 0
    if (k is None) != (v is None):
        raise NotImplementedError("k and v must be given together")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required (the tokens each sequence already holds)")
    sinks = _sinks_arg(sinks, s_aux)
    r = _fast_kvcache(locals())
    if r is not NotImplemented:
        return r
    q = T.float_array(q, "q")
    kc = T.fp8_cache(k_cache, "k_cache") if T.is_fp8(k_cache) else \
        T.float_array(k_cache, "k_cache", inplace=True)
    vc = T.fp8_cache(v_cache, "v_cache") if T.is_fp8(v_cache) else \
        T.float_array(v_cache, "v_cache", inplace=True)
    if k is not None:  # k and v are appended to the caches in place
        T.check_writable(kc, "k_cache")
        T.check_writable(vc, "v_cache")
    if kc.ndim != 4 or vc.ndim != 4:
        raise ValueError(f"k_cache and v_cache must be [b, S, hkv, d|dv] or paged [num_blocks, "
                         f"page_size, hkv, d|dv], got shapes {tuple(kc.shape)}, "
                         f"{tuple(vc.shape)}")
    packed = cu_seqlens_q is not None
    if packed:
        cu = T.index_array(cu_seqlens_q, "cu_seqlens_q")
        if q.ndim != 3:
            raise ValueError(f"with cu_seqlens_q, q must be [total_q, hq, d], got {tuple(q.shape)}")
        _check_cu_seqlens(cu, "cu_seqlens_q", q.shape[0], "q")
        batch = cu.size - 1
        q3 = q
    else:
        if q.ndim != 4:
            raise ValueError(f"q must be [b, sq, hq, d], got shape {tuple(q.shape)}")
        batch, sq = q.shape[0], q.shape[1]
        cu = T.int32_offsets(batch, sq, "q [b, sq, hq, d]")
        q3 = T.merge_leading(q)
    seqlens = T.index_array(cache_seqlens, "cache_seqlens")  # integers, like the [b] form
    if np.ndim(cache_seqlens) == 0:
        seqlens = np.full(batch, seqlens.reshape(()), dtype=np.int32)
    elif seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must have {batch} entries, got {seqlens.shape}")
    kn = vn = None
    if k is not None:
        kn, vn = T.float_array(k, "k"), T.float_array(v, "v")
        if not packed:
            if kn.ndim != 4 or vn.ndim != 4 or kn.shape[1] != q.shape[1] or vn.shape[1] != q.shape[1]:
                raise NotImplementedError(
                    f"k/v must be [b, sq, hkv, d] with the sq of q ({q.shape[1]}), got "
                    f"{tuple(kn.shape)} and {tuple(vn.shape)}")
            kn, vn = T.merge_leading(kn), T.merge_leading(vn)
    cache = _lib.KVCache()
    cache.k, cache.v = T.describe(kc), T.describe(vc)
    bt = None
    if block_table is not None:
        bt = T.index_array(block_table, "block_table")
        if bt.ndim != 2 or bt.shape[0] != batch:
            raise ValueError(f"block_table must be [b, max_pages] with b = {batch}, got shape "
                             f"{bt.shape}")
        # never NULL, which would make the cache contiguous: an empty table (no sequences, or
        # no columns, which the library refuses) points at a dummy entry
        bt_mem = bt if bt.size else np.zeros(1, np.int32)
        cache.block_table = T.ptr(bt_mem)
        cache.max_pages = bt.shape[1]
        cache.block_table_stride = bt.shape[1]
    cache.seqlens = T.ptr(seqlens)
    cache.layout = layout
    keep = []  # the per-sequence index arrays and descales, alive until the call returns
    for field, value in (("k_descale", k_descale), ("v_descale", v_descale)):
        if value is not None:
            keep.append(T.descale_array(value, field))
            keep.append(T.describe(keep[-1]))
            setattr(cache, field, ctypes.pointer(keep[-1]))
    for field, value, name in (("leftpad", cache_leftpad, "cache_leftpad"),
                               ("batch_idx", cache_batch_idx, "cache_batch_idx")):
        if value is None:
            continue
        a = T.index_array(value, name)
        if a.shape != (batch,):
            raise ValueError(f"{name} must have {batch} entries, got {a.shape}")
        # never NULL, which would mean none (no sequences: a dummy entry, as for block_table)
        keep.append(a if a.size else np.zeros(1, np.int32))
        setattr(cache, field, T.ptr(keep[-1]))
    total_q, hq = q3.shape[0], q3.shape[1]
    if packed:
        out = out3 = T.output(out, q, (total_q, hq, vc.shape[-1]))
    else:
        out = T.output(out, q, (q.shape[0], q.shape[1], hq, vc.shape[-1]))
        out3 = T.merged_view(out, "out")
    lse = T.empty_like_family(q, (hq, total_q), "float32") if return_softmax_lse else None
    p = _params(q, softmax_scale, causal, window_size, softcap, isa, precision=precision,
                sinks=sinks)
    _rotary(p, rotary_cos, rotary_sin, rotary_interleaved)
    tk = T.describe(kn) if kn is not None else None
    tv = T.describe(vn) if vn is not None else None
    tl = T.describe(lse) if return_softmax_lse else None
    _lib.check(_lib.lib.fw_attn_kvcache_fwd(T.describe(q3), tk, tv, T.ptr(cu), batch, cache,
                                            T.describe(out3), tl, p))
    if not return_softmax_lse:
        return out
    if not packed:
        lse = T.swap01_contiguous(lse.reshape(hq, q.shape[0], q.shape[1]))
    return out, lse


def _dsinks(p, dsinks):
    """The sinks' gradient output of a backward call into params p (fw_attn_params.dsinks):
    the caller's [hq] float32 array, written in place (the library checks it)."""
    if dsinks is not None:
        d = T.check_writable(T.float_array(dsinks, "dsinks", inplace=True), "dsinks")
        t = T.describe(d)
        p.dsinks = ctypes.pointer(t)
        p.keep_dsinks = (d, t)


def _grad_outputs(dq, dk, dv, q, k, v):
    return (T.output(dq, q, tuple(q.shape), name="dq"), T.output(dk, k, tuple(k.shape), name="dk"),
            T.output(dv, v, tuple(v.shape), name="dv"))


def flash_attn_backward(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None,
                        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, *,
                        isa=None, plain=False, precision=None, sinks=None, dsinks=None):
    """Gradients of flash_attn_func: (dq, dk, dv), flash-attn's `_flash_attn_backward`.

    dout [b, sq, hq, dv] (the gradient of out); q, k, v, out and softmax_lse [b, hq, sq]
    float32 as flash_attn_func took and returned them (return_softmax_lse=True), with the
    same softmax_scale, causal, window_size and softcap. dq, dk, dv: new arrays of q's, k's
    and v's dtypes, or existing ones (any float dtype) written in place. FlashAttention-2's
    algorithm (P recomputed from lse, no sq x sk memory), f32 accumulation, bit-identical for
    any thread count. precision: None/"auto" (bf16 products for bfloat16 q where
    flywheel.auto_precision says so: P and dS rounded to bf16 before their products, as
    flash-attn does), "f32" or "bf16". plain=True runs the
    row-at-a-time f32 baseline. Inputs are read in place (torch tensors are detached).
    sinks: the forward's attention sinks [hq] (softmax_lse includes them). dsinks: an existing
    [hq] float32 array, written in place with the gradient of sinks (summed over the batch and
    rows: dsinks[h] = -sum_rows exp(sinks[h] - lse) sum(dout * out)); it needs sinks.
    """
    dout, q, k, v, out, lse = (T.float_array(T.detach(x), n) for x, n in (
        (dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"), (softmax_lse, "softmax_lse")))
    if any(x.ndim != 4 for x in (dout, q, k, v, out)) or lse.ndim != 3:
        raise ValueError(f"dout, q, k, v, out must be 4-D and softmax_lse [b, hq, sq], got shapes "
                         f"{[tuple(x.shape) for x in (dout, q, k, v, out, lse)]}")
    dq, dk, dv = _grad_outputs(dq, dk, dv, q, k, v)
    p = _params(q, softmax_scale, causal, window_size, softcap, isa, plain, precision, sinks)
    _dsinks(p, dsinks)
    _lib.check(_lib.lib.fw_attn_bwd(*(T.describe(x) for x in (q, k, v, out, dout, lse, dq, dk, dv)),
                                    p))
    return dq, dk, dv


def flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, dq=None, dk=None, dv=None,
                               softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, *, isa=None, plain=False, precision=None,
                               sinks=None, dsinks=None):
    """Gradients of flash_attn_varlen_func: (dq, dk, dv), as flash_attn_backward.

    dout [total_q, hq, dv]; q, k, v, out as flash_attn_varlen_func took and returned them;
    softmax_lse [hq, total_q] float32; cu_seqlens_q / cu_seqlens_k its offsets (checked as
    there). A sequence without queries gets dk = dv = 0, one without keys dq = 0. sinks,
    dsinks: as in flash_attn_backward.
    """
    dout, q, k, v, out, lse = (T.float_array(T.detach(x), n) for x, n in (
        (dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"), (softmax_lse, "softmax_lse")))
    if any(x.ndim != 3 for x in (dout, q, k, v, out)) or lse.ndim != 2:
        raise ValueError(f"dout, q, k, v, out must be 3-D and softmax_lse [hq, total_q], got "
                         f"shapes {[tuple(x.shape) for x in (dout, q, k, v, out, lse)]}")
    cq, ck = _varlen_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    dq, dk, dv = _grad_outputs(dq, dk, dv, q, k, v)
    p = _params(q, softmax_scale, causal, window_size, softcap, isa, plain, precision, sinks)
    _dsinks(p, dsinks)
    t = [T.describe(x) for x in (q, k, v, out, dout, lse)]
    _lib.check(_lib.lib.fw_attn_varlen_bwd(*t, T.ptr(cq), T.ptr(ck), cq.size - 1, T.describe(dq),
                                           T.describe(dk), T.describe(dv), p))
    return dq, dk, dv
