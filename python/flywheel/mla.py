"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2) decode with FlashMLA's calls.

    tile_scheduler_metadata, num_splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                      tile_scheduler_metadata, num_splits, causal=True)

MLA caches one row per token that every query head shares: a paged cache
k_cache [num_pages, page_size, 1, d_qk] (DeepSeek: d_qk = 576, the 512 latent channels then
the 64 rope channels). The keys are the whole rows, the values their first head_dim_v
channels (DeepSeek: 512, the latent part). The call runs on the library's KV-cache attention
(fw_attn_kvcache_fwd) with one K/V head: the cache is described to it twice over the same
memory, as K and as V, V with K's data pointer and strides and head_dim_v as its last size, so
V is a view of the cached rows, never a copy. The work split is made inside each call from the
lengths and head counts (include/flywheel.h, fw_attn_kvcache_fwd), so FlashMLA's scheduler
metadata has nothing to carry here.

Inputs are numpy arrays or torch CPU tensors (float32, bfloat16, float16; q and k_cache of
one dtype, or an fp8 k_cache with k_descale), read in place; out has q's dtype and family.
FlashMLA's packed fp8 rows (is_fp8_kvcache) and sparse attention (indices, topk) raise
NotImplementedError.
"""

import ctypes
import operator

import numpy as np

from . import _lib
from . import _tensors as T

__all__ = ["flash_mla_with_kvcache", "get_mla_metadata"]


def _refuse(is_fp8_kvcache, sparse):
    """NotImplementedError for what FlashMLA has and the library does not: FlashMLA's packed
    fp8 cache format (is_fp8_kvcache: rows of fp8 latents, their scales and bf16 rope channels)
    and sparse attention."""
    if is_fp8_kvcache:
        raise NotImplementedError("FlashMLA's packed fp8 cache (is_fp8_kvcache=True) is not "
                                  "supported: pass a float8_e4m3fn / float8_e5m2 k_cache of "
                                  "[num_pages, page_size, 1, d_qk] with k_descale= instead")
    if sparse:
        raise NotImplementedError("sparse attention (FlashMLA's indices / topk) is not supported")


def get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
                     is_fp8_kvcache=False, topk=None):
    """FlashMLA's `get_mla_metadata`: the (tile_scheduler_metadata, num_splits) to pass to
    flash_mla_with_kvcache.

    On the CPU there is nothing to schedule ahead: each call splits its own work from the
    lengths and head counts, so both are None (flash_mla_with_kvcache takes None, or whatever
    metadata it is given, and ignores it). The arguments are FlashMLA's: cache_seqlens [b],
    num_q_tokens_per_head_k = s_q * h_q // h_kv, num_heads_k, num_heads_q. is_fp8_kvcache and
    topk (sparse attention) raise NotImplementedError, as flash_mla_with_kvcache would.
    """
    _refuse(is_fp8_kvcache, topk is not None)
    return None, None


def _first_channels(t, n):
    """A descriptor of the first n channels (the last dimension) of the tensor t describes:
    t's data pointer, dtype and strides, with n as its last size."""
    view = _lib.Tensor.from_buffer_copy(t)
    view.shape[t.ndim - 1] = n
    return view


def _params(d, softmax_scale, causal, isa, precision):
    p = _lib.AttnParams()
    _lib.lib.fw_attn_params_init(p)
    if softmax_scale is None:
        # 0 is the library's 1/sqrt(d): with d = 0 the library reports the shape (FW_ERR_SHAPE)
        p.scale = 1.0 / float(d) ** 0.5 if d > 0 else 0.0
    else:
        p.scale = _lib.float32_param(softmax_scale, "softmax_scale", "1/sqrt(d_qk)")
        if p.scale == 0.0:
            raise NotImplementedError("softmax_scale=0 (uniform attention) is not supported")
    p.causal = 1 if causal else 0
    p.threads = _lib.settings.threads
    p.isa = _lib.isa_name(isa)
    p.precision = _lib.precision(precision)
    return p


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                           tile_scheduler_metadata=None, num_splits=None, softmax_scale=None,
                           causal=False, is_fp8_kvcache=False, indices=None, *, k_new=None,
                           out=None, isa=None, precision=None, k_descale=None):
    """MLA decode over a paged latent cache, FlashMLA's `flash_mla_with_kvcache`.

    q [b, sq, hq, d_qk] (sq = 1 is decode, more a speculative multi-token decode);
    k_cache [num_pages, page_size, 1, d_qk] (any page size from 1 to 65536);
    block_table [b, max_pages] and cache_seqlens [b] (integers, copied to int32 if needed):
    token t of sequence i is row t % page_size of page block_table[i][t // page_size], and
    sequence i attends to its first cache_seqlens[i] tokens, which already include the new
    ones (FlashMLA does not append). Keys are k_cache's rows, values their first head_dim_v
    channels (1 <= head_dim_v <= d_qk; read in place, see the module docstring).
    Returns (out [b, sq, hq, head_dim_v] with q's dtype, lse [b, hq, sq] float32, the natural
    log of each row's softmax denominator). softmax_scale: None is 1/sqrt(d_qk). causal: query
    r of a sequence of context L sees keys j <= r + L - sq (aligned bottom-right, as
    flash_attn_with_kvcache); a row that sees no key gives 0 and lse -inf.
    tile_scheduler_metadata, num_splits: get_mla_metadata's (None), or anything: ignored.
    is_fp8_kvcache (FlashMLA's packed fp8 rows), indices (sparse attention):
    NotImplementedError.
    Extensions: k_new [b, sq, 1, d_qk] (k_cache's dtype) appends each sequence's new rows to
    the cache in place at positions cache_seqlens[i] .. before attending, as
    flash_attn_with_kvcache's k and v do; cache_seqlens then counts the tokens held before the
    append and the context is cache_seqlens[i] + sq (add sq yourself afterwards). out: an
    existing [b, sq, hq, head_dim_v] output ([b, sq] mergeable into one stride) to write
    instead of a new one. isa, precision: as in flash_attn_func. fp8 latent caches: k_cache
    float8_e4m3fn or float8_e5m2 with k_descale (a scalar or [b, 1], any float dtype, used as
    float32; required), a stored element x standing for x * k_descale in keys and values
    alike; q (and k_new, quantised on append) stay float32, bfloat16 or float16, as in
    flash_attn_with_kvcache's fp8 caches.
    Copies: q and k_new when [b, sq] cannot be merged into one stride, the int32 index arrays,
    and lse (computed [hq, b * sq], returned [b, hq, sq]).
    Errors, before anything is written: ValueError for shapes (k_cache's head dim not q's,
    head_dim_v out of range, more than one cache head, block_table or cache_seqlens not
    [b, ...], k_new not [b, sq, 1, d_qk]); FlywheelDtypeError (a TypeError and a ValueError)
    for q, k_cache and k_new of different dtypes; FlywheelError from the library (a page index
    out of range, a context longer than its pages, two sequences appending to one page).
    """
    _refuse(is_fp8_kvcache, indices is not None)
    q = T.float_array(q, "q")
    fp8 = T.is_fp8(k_cache)
    kc = T.fp8_cache(k_cache, "k_cache") if fp8 else T.float_array(k_cache, "k_cache", inplace=True)
    if fp8 and k_descale is None:
        raise ValueError(f"k_cache is {k_cache.dtype}: an fp8 latent cache needs k_descale (a "
                         "scalar or [b, 1])")
    if q.ndim != 4 or kc.ndim != 4:
        raise ValueError(f"q must be [b, sq, hq, d_qk] and k_cache [num_pages, page_size, 1, "
                         f"d_qk], got shapes {tuple(q.shape)}, {tuple(kc.shape)}")
    b, sq, hq, d = q.shape
    if kc.shape[2] != 1:
        raise ValueError(f"k_cache has {kc.shape[2]} heads: MLA's cache holds one row per token "
                         "that every query head shares, [num_pages, page_size, 1, d_qk]")
    if kc.shape[3] != d:
        raise ValueError(f"k_cache rows have {kc.shape[3]} channels but q has d_qk = {d}: "
                         "both hold the latent and rope channels")
    dv = operator.index(head_dim_v)
    if not 1 <= dv <= d:
        raise ValueError(f"head_dim_v = {dv}: the values are the first head_dim_v channels of "
                         f"the cached rows, so it must be 1 .. d_qk ({d})")
    bt = T.index_array(block_table, "block_table")
    if bt.ndim != 2 or bt.shape[0] != b:
        raise ValueError(f"block_table must be [b, max_pages] with b = {b}, got shape {bt.shape}")
    seqlens = T.index_array(cache_seqlens, "cache_seqlens")
    if seqlens.shape != (b,):
        raise ValueError(f"cache_seqlens must be [b] with b = {b}, got shape {seqlens.shape}")
    tk = T.describe(kc)
    if not fp8 and T.describe(q).dtype != tk.dtype:
        raise _lib.FlywheelDtypeError("FW_ERR_DTYPE", f"q is {q.dtype} but k_cache is "
                                      f"{kc.dtype}; they must match")
    tkn = None
    if k_new is not None:
        kn = T.float_array(k_new, "k_new")
        if tuple(kn.shape) != (b, sq, 1, d):
            raise ValueError(f"k_new must be [b, sq, 1, d_qk] = {[b, sq, 1, d]}, got shape "
                             f"{tuple(kn.shape)}")
        T.check_writable(kc, "k_cache")
        kn = T.merge_leading(kn)
        tkn = T.describe(kn)
        if not fp8 and tkn.dtype != tk.dtype:
            raise _lib.FlywheelDtypeError("FW_ERR_DTYPE", f"k_new is {kn.dtype} but k_cache is "
                                          f"{kc.dtype}; they must match")
    cu = T.int32_offsets(b, sq, "q [b, sq, hq, d_qk]")
    q3 = T.merge_leading(q)
    out = T.output(out, q, (b, sq, hq, dv))
    out3 = T.merged_view(out, "out")
    lse = T.empty_like_family(q, (hq, b * sq), "float32")
    p = _params(d, softmax_scale, causal, isa, precision)
    cache = _lib.KVCache()
    cache.k, cache.v = tk, _first_channels(tk, dv)
    # never NULL, which would make the cache contiguous: an empty table (no sequences, or no
    # columns, which the library refuses) points at a dummy entry
    bt_mem = bt if bt.size else np.zeros(1, np.int32)
    cache.block_table = T.ptr(bt_mem)
    cache.max_pages = cache.block_table_stride = bt.shape[1]
    cache.seqlens = T.ptr(seqlens)
    if k_descale is not None:  # keys and values are the same bytes: one descale for both
        desc = T.descale_array(k_descale, "k_descale")
        tdesc = T.describe(desc)
        cache.k_descale = cache.v_descale = ctypes.pointer(tdesc)
    # the new rows' first head_dim_v channels are their values: the library's V write of a
    # row repeats the bytes its K write has just stored there
    tvn = _first_channels(tkn, dv) if tkn is not None else None
    _lib.check(_lib.lib.fw_attn_kvcache_fwd(T.describe(q3), tkn, tvn, T.ptr(cu), b, cache,
                                            T.describe(out3), T.describe(lse), p))
    return out, T.swap01_contiguous(lse.reshape(hq, b, sq))
