"""flywheel.tpu (the original FlyWheel package's calls: head-major and token-major layouts,
heads_outer_fold, the merged paged KV cache) against a float64 numpy reference of the
original's documented semantics, and its refusals."""

import inspect

import numpy as np
import pytest

import flywheel.tpu as tpu
from conftest import FAMILIES, TOL, as64, make, ref_attention, round_bf16, torch

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    jax = jnp = None

needs_jax = pytest.mark.skipif(jax is None, reason="jax is not installed")

# (family, dtype): float32 in every family, bfloat16 through torch where torch is importable
CASES = [(f, "float32") for f in FAMILIES] + (
    [("torch", "bfloat16")] if torch is not None else [])
MASKS = [  # (causal, window_size, softcap)
    (False, (-1, -1), 0.0),
    (True, (-1, -1), 0.0),
    (True, (6, -1), 0.0),
    (False, (5, 2), 20.0),
]


def ref(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """The original's attention for one sequence, in float64, tokens first: q [sq, hq, d],
    k [sk, hkv, d], v [sk, hkv, dv] -> out [sq, hq, dv], lse [hq, sq]. Query i sees key j
    iff i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded; causal: right = 0);
    q head h reads kv head h // (hq / hkv); softcap > 0: softcap * tanh(scale q.k / softcap);
    a row with no key gives out 0 and lse -inf."""
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    group = hq // hkv
    s = np.einsum("qhd,khd->hqk", q, np.repeat(k, group, axis=1)) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    left, right = window
    if causal:
        right = 0
    diag = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    seen = np.ones((sq, sk), bool)
    if left >= 0:
        seen &= j >= diag - left
    if right >= 0:
        seen &= j <= diag + right
    s = np.where(seen[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", p / np.where(den > 0, den, 1.0),
                    np.repeat(v, group, axis=1))
    lse = np.where(den[..., 0] > 0, np.log(np.maximum(den[..., 0], 1e-300)) + m[..., 0],
                   -np.inf)
    return out, lse


def close(got, want, dtype, what=""):
    got = as64(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    err = np.abs(got - want).max(initial=0.0)
    assert err <= TOL[dtype], f"{what}: max error {err} over {TOL[dtype]}"


def close_lse(got, want, what=""):
    got = as64(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), what
    fin = np.isfinite(want)
    assert np.abs(got[fin] - want[fin]).max(initial=0.0) <= 1e-3, what


def perm(x, axes):
    return x.permute(*axes) if torch is not None and isinstance(x, torch.Tensor) \
        else x.transpose(axes)


# ---------------------------------------------------------------------- signatures --

ORIGINAL_PARAMS = {  # flywheel-tpu 0.3.0's names, in order; "*" marks keyword-only
    "flash_attn_func": [
        "q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size",
        "attention_chunk", "softcap", "alibi_slopes", "deterministic", "return_attn_probs",
        "return_softmax_lse", "interpret", "head_dim", "token_major", "*rotary_cos",
        "*rotary_sin", "*rotary_interleaved", "*rotary_k", "*heads_outer_fold"],
    "flash_attn_varlen_func": [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
        "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
        "deterministic", "return_attn_probs", "return_softmax_lse", "interpret", "head_dim",
        "token_major", "block_sizes", "*rotary_cos", "*rotary_sin", "*rotary_interleaved",
        "*rotary_k", "*block_table", "*seqused_k", "*num_active"],
    "flash_attn_with_kvcache": [
        "q", "k_cache", "v_cache", "k", "v", "*cache_seqlens", "*cache_batch_idx",
        "*block_table", "*num_active", "*cu_seqlens_q", "*softmax_scale", "*causal",
        "*window_size", "*softcap", "*return_softmax_lse", "*interpret"],
}
EXTENSIONS = ["*sinks", "*s_aux"]  # flywheel's keyword-only additions, after the original's


@pytest.mark.parametrize("name", sorted(ORIGINAL_PARAMS))
def test_signatures_match_the_original(name):
    params = inspect.signature(getattr(tpu, name)).parameters.values()
    got = [("*" if p.kind is p.KEYWORD_ONLY else "") + p.name for p in params]
    assert got == ORIGINAL_PARAMS[name] + EXTENSIONS
    defaults = {p.name: p.default for p in params}
    assert defaults.get("window_size", (-1, -1)) == (-1, -1)
    assert defaults.get("interpret", False) is False
    if name == "flash_attn_with_kvcache":
        assert defaults["cache_seqlens"] is inspect.Parameter.empty  # required


# --------------------------------------------------------------------------- dense --

DENSE_SHAPES = [  # (b, sq, sk, hq, hkv, d, dv)
    (2, 9, 23, 4, 2, 16, 16),
    (1, 30, 11, 6, 1, 32, 24),   # sq > sk: causal rows with no key
    (2, 1, 17, 4, 4, 8, 8),
]


@pytest.mark.parametrize("family,dtype", CASES)
@pytest.mark.parametrize("shape", DENSE_SHAPES)
@pytest.mark.parametrize("mask", MASKS)
def test_dense_head_major(family, dtype, shape, mask):
    b, sq, sk, hq, hkv, d, dv = shape
    causal, window, softcap = mask
    rng = np.random.default_rng(sum(shape))
    q, q64 = make(rng, (b, hq, sq, d), dtype, family)
    k, k64 = make(rng, (b, hkv, sk, d), dtype, family)
    v, v64 = make(rng, (b, hkv, sk, dv), dtype, family)
    out, lse = tpu.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                   softcap=softcap, return_softmax_lse=True, interpret=True)
    assert type(out) is type(q) and out.dtype == q.dtype
    assert tuple(out.shape) == (b, hq, sq, dv) and tuple(lse.shape) == (b, hq, sq)
    for i in range(b):
        ro, rl = ref(q64[i].transpose(1, 0, 2), k64[i].transpose(1, 0, 2),
                     v64[i].transpose(1, 0, 2), d ** -0.5, causal, window, softcap)
        close(as64(out)[i], ro.transpose(1, 0, 2), dtype, f"batch {i}")
        close_lse(lse[i], rl, f"batch {i}")
    # without lse: out alone, the same values
    alone = tpu.flash_attn_func(q, k, v, None, None, causal, window, None, softcap)
    assert np.array_equal(as64(alone), as64(out))


@pytest.mark.parametrize("family,dtype", CASES)
@pytest.mark.parametrize("mask", MASKS[1:3])
def test_dense_token_major(family, dtype, mask):
    b, sq, sk, hq, hkv, d, dv = 2, 13, 29, 6, 2, 16, 8
    causal, window, softcap = mask
    rng = np.random.default_rng(3)
    q, q64 = make(rng, (b, sq, hq * d), dtype, family)
    k, k64 = make(rng, (b, sk, hkv * d), dtype, family)
    v, v64 = make(rng, (b, sk, hkv * dv), dtype, family)
    out, lse = tpu.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                   return_softmax_lse=True, head_dim=d, token_major=True)
    assert tuple(out.shape) == (b, sq, hq * dv) and tuple(lse.shape) == (b, hq, sq)
    for i in range(b):
        ro, rl = ref(q64[i].reshape(sq, hq, d), k64[i].reshape(sk, hkv, d),
                     v64[i].reshape(sk, hkv, dv), d ** -0.5, causal, window)
        close(as64(out)[i], ro.reshape(sq, hq * dv), dtype, f"batch {i}")
        close_lse(lse[i], rl)


@pytest.mark.parametrize("family,dtype", CASES)
def test_dense_heads_outer_fold(family, dtype):
    b, sq, sk, hq, hkv, d = 3, 12, 20, 8, 2, 16
    rng = np.random.default_rng(4)
    q, q64 = make(rng, (hq, b, sq, d), dtype, family)
    k, k64 = make(rng, (hkv, b, sk, d), dtype, family)
    v, v64 = make(rng, (hkv, b, sk, d), dtype, family)
    out = tpu.flash_attn_func(q, k, v, causal=True, softmax_scale=0.3, heads_outer_fold=True)
    assert tuple(out.shape) == (hq, b, sq, d)
    for i in range(b):
        ro, _ = ref(q64[:, i].transpose(1, 0, 2), k64[:, i].transpose(1, 0, 2),
                    v64[:, i].transpose(1, 0, 2), 0.3, causal=True)
        close(as64(out)[:, i], ro.transpose(1, 0, 2), dtype, f"batch {i}")


def test_dense_unaligned_lengths_are_computed():
    """The original refuses seqlen_k that is not a multiple of 128 without a right bound;
    flywheel computes it exactly."""
    rng = np.random.default_rng(5)
    q, q64 = make(rng, (1, 2, 7, 8), "float32", "numpy")
    k, k64 = make(rng, (1, 2, 77, 8), "float32", "numpy")
    out = tpu.flash_attn_func(q, k, k)
    ro, _ = ref(q64[0].transpose(1, 0, 2), k64[0].transpose(1, 0, 2),
                k64[0].transpose(1, 0, 2), 8 ** -0.5)
    close(out[0], ro.transpose(1, 0, 2), "float32")


# -------------------------------------------------------------------------- varlen --

@pytest.mark.parametrize("family,dtype", CASES)
@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("mask", MASKS)
def test_varlen(family, dtype, token_major, mask):
    causal, window, softcap = mask
    hq, hkv, d, dv = 4, 2, 16, 8
    cu_q = np.array([0, 5, 5, 17, 20], np.int32)
    cu_k = np.array([0, 9, 12, 30, 31], np.int32)
    total_q, total_k = 23, 34  # buffers with padding rows past the last sequence
    rng = np.random.default_rng(6)
    if token_major:
        q, q64 = make(rng, (total_q, hq * d), dtype, family)
        k, k64 = make(rng, (total_k, hkv * d), dtype, family)
        v, v64 = make(rng, (total_k, hkv * dv), dtype, family)
        tq, tk, tv = (x.reshape(x.shape[0], h, -1) for x, h in
                      ((q64, hq), (k64, hkv), (v64, hkv)))
    else:
        q, q64 = make(rng, (hq, total_q, d), dtype, family)
        k, k64 = make(rng, (hkv, total_k, d), dtype, family)
        v, v64 = make(rng, (hkv, total_k, dv), dtype, family)
        tq, tk, tv = (x.transpose(1, 0, 2) for x in (q64, k64, v64))
    # max_seqlen underestimates are fine in the original (they only size tiles)
    out, lse = tpu.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 4, 4, causal=causal, window_size=window, softcap=softcap,
        return_softmax_lse=True, head_dim=d if token_major else None,
        token_major=token_major, block_sizes=(128, 128, 128, 128))
    assert tuple(lse.shape) == (hq, total_q)
    o = as64(out)
    o = o.reshape(total_q, hq, dv) if token_major else o.transpose(1, 0, 2)
    assert tuple(out.shape) == ((total_q, hq * dv) if token_major else (hq, total_q, dv))
    for i in range(len(cu_q) - 1):
        a, z, ka, kz = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        ro, rl = ref(tq[a:z], tk[ka:kz], tv[ka:kz], d ** -0.5, causal, window, softcap)
        close(o[a:z], ro, dtype, f"sequence {i}")
        close_lse(as64(lse)[:, a:z], rl, f"sequence {i}")
    assert np.all(o[cu_q[-1]:] == 0) and np.all(np.isneginf(as64(lse)[:, cu_q[-1]:]))


# ------------------------------------------------------------- merged paged caches --

def merge(kc, vc):
    """The original's merged rows from K and V [..., hkv, d]: row 2h is K head h, row
    2h + 1 is V head h."""
    hkv = kc.shape[-2]
    kv = np.empty(kc.shape[:-2] + (2 * hkv, kc.shape[-1]), kc.dtype)
    for h in range(hkv):
        kv[..., 2 * h, :] = kc[..., h, :]
        kv[..., 2 * h + 1, :] = vc[..., h, :]
    return kv


def paged_cache(rng, lens_capacity, page, hkv, d, dtype, spare=3):
    """A merged paged cache over random pages: returns (kv [pages, page, 2hkv, d] as numpy
    of `dtype`, its float64 value, block_table [b, max_pages], per-sequence token order
    k64 [b, cap, hkv, d], v64)."""
    b = len(lens_capacity)
    max_pages = max(-(-c // page) for c in lens_capacity)
    num_pages = b * max_pages + spare
    kc, kc64 = make(rng, (num_pages, page, hkv, d), dtype, "numpy")
    vc, vc64 = make(rng, (num_pages, page, hkv, d), dtype, "numpy")
    kv, kv64 = merge(kc, vc), merge(kc64, vc64)
    order = rng.permutation(num_pages)[:b * max_pages]
    table = order.reshape(b, max_pages).astype(np.int32)
    cap = max_pages * page
    k64 = kc64[table].reshape(b, cap, hkv, d)
    v64 = vc64[table].reshape(b, cap, hkv, d)
    return kv, kv64, table, k64, v64


def slot(table, page, i, t):
    return table[i, t // page], t % page


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page", [16, 48])
@pytest.mark.parametrize("num_active", [None, 2])
@pytest.mark.parametrize("mask", MASKS[:3])
def test_varlen_paged_merged_cache(dtype, page, num_active, mask):
    causal, window, _ = mask
    hq, hkv, d = 6, 3, 16
    seqused = np.array([40, 7, 90], np.int32)
    cu_q = np.array([0, 6, 13, 16], np.int32)  # sequence 1: 7 queries over 7 keys
    total_q = 19                               # 3 padding rows
    rng = np.random.default_rng(7 + page)
    kv, kv64, table, k64, v64 = paged_cache(rng, seqused, page, hkv, d, dtype)
    before = kv.copy()
    q, q64 = make(rng, (hq, total_q, d), dtype, "numpy")
    out, lse = tpu.flash_attn_varlen_func(
        q, kv, None, cu_q, None, 8, 96, causal=causal, window_size=window,
        return_softmax_lse=True, block_table=table, seqused_k=seqused, num_active=num_active)
    assert tuple(out.shape) == (hq, total_q, d) and tuple(lse.shape) == (hq, total_q)
    assert np.array_equal(kv.view(np.uint8), before.view(np.uint8))  # read-only
    o, tq = as64(out).transpose(1, 0, 2), q64.transpose(1, 0, 2)
    active = 3 if num_active is None else num_active
    for i in range(active):
        a, z, n = cu_q[i], cu_q[i + 1], seqused[i]
        ro, rl = ref(tq[a:z], k64[i, :n], v64[i, :n], d ** -0.5, causal, window)
        close(o[a:z], ro, dtype, f"sequence {i}")
        close_lse(as64(lse)[:, a:z], rl, f"sequence {i}")
    end = cu_q[active]
    assert np.all(o[end:] == 0) and np.all(np.isneginf(as64(lse)[:, end:]))


@pytest.mark.parametrize("family,dtype", CASES)
@pytest.mark.parametrize("page", [16, 48])
@pytest.mark.parametrize("sq", [1, 5])
@pytest.mark.parametrize("mask", MASKS)
def test_kvcache_merged_appends_in_place(family, dtype, page, sq, mask):
    causal, window, softcap = mask
    hq, hkv, d = 4, 2, 16
    lens = np.array([0, 37, 60], np.int32)
    rng = np.random.default_rng(sq + page)
    kv, kv64, table, k64, v64 = paged_cache(rng, lens + sq, page, hkv, d, "float32")
    if dtype == "bfloat16":  # exact bf16 values in the float64 copies too
        kv64, k64, v64 = (round_bf16(x) for x in (kv64, k64, v64))
        kv = kv64.astype(np.float32)
    q, q64 = make(rng, (3, sq, hq, d), dtype, family)
    kn, kn64 = make(rng, (3, sq, hkv, d), dtype, family)
    vn, vn64 = make(rng, (3, sq, hkv, d), dtype, family)
    cache = torch.from_numpy(kv).to(getattr(torch, dtype)) if family == "torch" else kv
    res = tpu.flash_attn_with_kvcache(q, cache, None, kn, vn, cache_seqlens=lens,
                                      block_table=table, causal=causal, window_size=window,
                                      softcap=softcap, return_softmax_lse=True)
    assert len(res) == 3
    out, lse, new_cache = res
    assert new_cache is cache  # numpy / torch caches are updated in place
    assert tuple(out.shape) == (3, sq, hq, d) and tuple(lse.shape) == (3, hq, sq)
    got = as64(new_cache)
    want = kv64.copy()
    for i in range(3):
        for t in range(sq):
            pg, row = slot(table, page, i, lens[i] + t)
            for h in range(hkv):
                want[pg, row, 2 * h] = kn64[i, t, h]
                want[pg, row, 2 * h + 1] = vn64[i, t, h]
    assert np.array_equal(got, want)  # the new rows at their slots, nothing else touched
    for i in range(3):
        n = lens[i]
        kctx = np.concatenate([k64[i, :n], kn64[i]])
        vctx = np.concatenate([v64[i, :n], vn64[i]])
        ro, rl = ref(q64[i], kctx, vctx, d ** -0.5, causal, window, softcap)
        close(as64(out)[i], ro, dtype, f"row {i}")
        close_lse(as64(lse)[i], rl, f"row {i}")


def test_kvcache_merged_packed_with_num_active_and_padding():
    hq, hkv, d, page = 4, 1, 8, 16
    lens = np.array([3, 20, 0, 9], np.int32)
    cu = np.array([0, 4, 5, 11, 14], np.int32)  # 4 queries, 1, 6, 3 (row 3 inactive)
    total = 16                                  # 2 padding rows
    rng = np.random.default_rng(12)
    kv, kv64, table, k64, v64 = paged_cache(rng, lens + np.diff(cu), page, hkv, d, "float32")
    q, q64 = make(rng, (total, hq, d), "float32", "numpy")
    kn, kn64 = make(rng, (total, hkv, d), "float32", "numpy")
    vn, vn64 = make(rng, (total, hkv, d), "float32", "numpy")
    before = kv64.copy()
    out, lse, cache = tpu.flash_attn_with_kvcache(
        q, kv, None, kn, vn, cache_seqlens=lens, block_table=table, num_active=3,
        cu_seqlens_q=cu, causal=True, return_softmax_lse=True)
    assert cache is kv and tuple(out.shape) == (total, hq, d) and lse.shape == (hq, total)
    for i in range(3):
        a, z, n = cu[i], cu[i + 1], lens[i]
        kctx = np.concatenate([k64[i, :n], kn64[a:z]])
        vctx = np.concatenate([v64[i, :n], vn64[a:z]])
        ro, rl = ref(q64[a:z], kctx, vctx, d ** -0.5, causal=True)
        close(out[a:z], ro, "float32", f"sequence {i}")
        close_lse(lse[:, a:z], rl)
        for t in range(z - a):
            pg, row = slot(table, page, i, n + t)
            assert np.array_equal(as64(kv)[pg, row, 0], kn64[a + t, 0])
            assert np.array_equal(as64(kv)[pg, row, 1], vn64[a + t, 0])
    assert np.all(out[cu[3]:] == 0) and np.all(np.isneginf(lse[:, cu[3]:]))
    # the inactive sequence appended nothing
    for t in range(cu[4] - cu[3]):
        pg, row = slot(table, page, 3, lens[3] + t)
        assert np.array_equal(as64(kv)[pg, row], before[pg, row])


@pytest.mark.parametrize("page", [2048, 1152, 12])
def test_kvcache_merged_large_pages_and_no_append(page):
    """Pages of any size (1152: vLLM's hybrid models; 12: not a power of two); without k / v
    the context is cache_seqlens and the cache is not written."""
    hq, hkv, d = 2, 2, 8
    lens = np.array([3000, 1], np.int32)
    rng = np.random.default_rng(13)
    kv, kv64, table, k64, v64 = paged_cache(rng, lens, page, hkv, d, "float32", spare=1)
    q, q64 = make(rng, (2, 1, hq, d), "float32", "numpy")
    out, cache = tpu.flash_attn_with_kvcache(q, kv, None, cache_seqlens=lens,
                                             block_table=table, window_size=(100, -1))
    assert np.array_equal(as64(cache), kv64)
    for i in range(2):
        ro, _ = ref(q64[i], k64[i, :lens[i]], v64[i, :lens[i]], d ** -0.5, window=(100, -1))
        close(out[i], ro, "float32", f"row {i}")


def test_kvcache_num_active_decode_skips_rows():
    hq, hkv, d, page = 2, 1, 8, 16
    lens = np.array([5, 9, 30], np.int32)
    rng = np.random.default_rng(14)
    kv, kv64, table, k64, v64 = paged_cache(rng, lens + 1, page, hkv, d, "float32")
    q, q64 = make(rng, (3, 1, hq, d), "float32", "numpy")
    kn, kn64 = make(rng, (3, 1, hkv, d), "float32", "numpy")
    out, lse, _ = tpu.flash_attn_with_kvcache(q, kv, None, kn, kn, cache_seqlens=lens,
                                              block_table=table, num_active=1,
                                              return_softmax_lse=True)
    kctx = np.concatenate([k64[0, :5], kn64[0]])
    vctx = np.concatenate([v64[0, :5], kn64[0]])  # kn is appended as both K and V
    ro, rl = ref(q64[0], kctx, vctx, d ** -0.5)
    close(out[0], ro, "float32")
    close_lse(lse[0], rl)
    assert np.all(out[1:] == 0) and np.all(np.isneginf(lse[1:]))
    for i in (1, 2):
        pg, row = slot(table, page, i, lens[i])
        assert np.array_equal(as64(kv)[pg, row], kv64[pg, row])


# -------------------------------------------------------------- contiguous caches --

@pytest.mark.parametrize("family,dtype", CASES)
@pytest.mark.parametrize("use_idx", [False, True])
def test_kvcache_contiguous_pair(family, dtype, use_idx):
    hq, hkv, d, S = 4, 2, 16, 96
    rng = np.random.default_rng(15)
    kc, kc64 = make(rng, (4, S, hkv, d), dtype, family)
    vc, vc64 = make(rng, (4, S, hkv, d), dtype, family)
    q, q64 = make(rng, (2, 1, hq, d), dtype, family)
    kn, kn64 = make(rng, (2, 1, hkv, d), dtype, family)
    vn, vn64 = make(rng, (2, 1, hkv, d), dtype, family)
    lens = np.array([50, 95], np.int32)
    idx = np.array([3, 1]) if use_idx else None
    rows = idx if use_idx else np.arange(2)
    out, k_out, v_out = tpu.flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=lens, cache_batch_idx=idx, causal=True)
    assert k_out is kc and v_out is vc
    wk, wv = kc64.copy(), vc64.copy()
    for i, r in enumerate(rows):
        wk[r, lens[i]], wv[r, lens[i]] = kn64[i, 0], vn64[i, 0]
        kctx, vctx = wk[r, :lens[i] + 1], wv[r, :lens[i] + 1]
        ro, _ = ref(q64[i], kctx, vctx, d ** -0.5, causal=True)
        close(as64(out)[i], ro, dtype, f"row {i}")
    assert np.array_equal(as64(kc), wk) and np.array_equal(as64(vc), wv)


# ------------------------------------------------------------------------------ JAX --

@needs_jax
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_arrays(dtype):
    rng = np.random.default_rng(16)
    q, q64 = make(rng, (2, 4, 10, 16), dtype, "numpy")
    k, k64 = make(rng, (2, 2, 14, 16), dtype, "numpy")
    out, lse = tpu.flash_attn_func(jnp.asarray(q), jnp.asarray(k), jnp.asarray(k),
                                   causal=True, return_softmax_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (2, 4, 10, 16)
    for i in range(2):
        kt = k64[i].transpose(1, 0, 2)
        ro, rl = ref(q64[i].transpose(1, 0, 2), kt, kt, 16 ** -0.5, causal=True)
        close(np.asarray(out[i], np.float64), ro.transpose(1, 0, 2), dtype)
        close_lse(np.asarray(lse[i], np.float64), rl)


@needs_jax
def test_jax_merged_cache_comes_back_updated():
    hq, hkv, d, page = 4, 2, 16, 16
    lens = np.array([10, 31], np.int32)
    rng = np.random.default_rng(17)
    kv, kv64, table, k64, v64 = paged_cache(rng, lens + 3, page, hkv, d, "bfloat16")
    q, q64 = make(rng, (2, 3, hq, d), "bfloat16", "numpy")
    kn, kn64 = make(rng, (2, 3, hkv, d), "bfloat16", "numpy")
    vn, vn64 = make(rng, (2, 3, hkv, d), "bfloat16", "numpy")
    cache = jnp.asarray(kv)
    out, new = tpu.flash_attn_with_kvcache(
        jnp.asarray(q), cache, None, jnp.asarray(kn), jnp.asarray(vn),
        cache_seqlens=jnp.asarray(lens), block_table=jnp.asarray(table), causal=True)
    assert isinstance(out, jax.Array) and isinstance(new, jax.Array)
    assert np.array_equal(np.asarray(cache, np.float64), kv64)  # the input is not changed
    got = np.asarray(new, np.float64)
    for i in range(2):
        for t in range(3):
            pg, row = slot(table, page, i, lens[i] + t)
            assert np.array_equal(got[pg, row, 0::2], kn64[i, t])
            assert np.array_equal(got[pg, row, 1::2], vn64[i, t])
        kctx = np.concatenate([k64[i, :lens[i]], kn64[i]])
        vctx = np.concatenate([v64[i, :lens[i]], vn64[i]])
        ro, _ = ref(q64[i], kctx, vctx, d ** -0.5, causal=True)
        close(np.asarray(out[i], np.float64), ro, "bfloat16", f"row {i}")


# -------------------------------------------------------------------------- refusals --

def test_options_flywheel_lacks_raise_not_implemented():
    rng = np.random.default_rng(18)
    q, _ = make(rng, (1, 2, 4, 8), "float32", "numpy")
    t = np.ones((4, 4), np.float32)
    for kwargs in [dict(dropout_p=0.1), dict(alibi_slopes=np.ones(2, np.float32)),
                   dict(return_attn_probs=True), dict(attention_chunk=64),
                   dict(heads_outer_fold=True, return_softmax_lse=True)]:
        with pytest.raises(NotImplementedError):
            tpu.flash_attn_func(q, q, q, **kwargs)
    tm = q.reshape(1, 4, 16)
    with pytest.raises(NotImplementedError):
        tpu.flash_attn_func(tm, tm, tm, head_dim=8, token_major=True, heads_outer_fold=True)
    cu = np.array([0, 4])
    qv = q[0]
    kv = np.zeros((2, 16, 4, 8), np.float32)
    with pytest.raises(NotImplementedError, match="RoPE"):
        tpu.flash_attn_varlen_func(qv, kv, None, cu, None, 4, 4, rotary_cos=t, rotary_sin=t,
                                   block_table=np.zeros((1, 1), np.int32), seqused_k=[4])
    with pytest.raises(NotImplementedError, match="token_major"):
        tpu.flash_attn_varlen_func(qv, kv, None, cu, None, 4, 4, token_major=True,
                                   block_table=np.zeros((1, 1), np.int32), seqused_k=[4])


def test_bad_arguments_raise_as_in_the_original():
    rng = np.random.default_rng(19)
    q, _ = make(rng, (1, 2, 4, 8), "float32", "numpy")
    with pytest.raises(ValueError, match="window_size"):
        tpu.flash_attn_func(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        tpu.flash_attn_func(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="head_dim"):
        tpu.flash_attn_func(q, q, q, head_dim=8)
    with pytest.raises(ValueError, match="head_dim"):
        tpu.flash_attn_func(q.reshape(1, 4, 16), q.reshape(1, 4, 16), q.reshape(1, 4, 16),
                            token_major=True)
    with pytest.raises(TypeError, match="heads_outer_fold"):
        tpu.flash_attn_func(q, q, q, heads_outer_fold=1)
    qv, cu, bt = q[0], np.array([0, 4]), np.zeros((1, 1), np.int32)
    kv = np.zeros((2, 16, 4, 8), np.float32)
    with pytest.raises(ValueError, match="v=None"):
        tpu.flash_attn_varlen_func(qv, kv, kv, cu, None, 4, 4, block_table=bt, seqused_k=[4])
    with pytest.raises(ValueError, match="cu_seqlens_k=None"):
        tpu.flash_attn_varlen_func(qv, kv, None, cu, cu, 4, 4, block_table=bt, seqused_k=[4])
    with pytest.raises(ValueError, match="seqused_k"):
        tpu.flash_attn_varlen_func(qv, kv, None, cu, None, 4, 4, block_table=bt)
    with pytest.raises(ValueError, match="block_table"):
        tpu.flash_attn_varlen_func(qv, qv, qv, cu, cu, 4, 4, seqused_k=[4])
    with pytest.raises(ValueError, match="positive"):
        tpu.flash_attn_varlen_func(qv, qv, qv, cu, cu, 0, 4)
    with pytest.raises(ValueError, match="block_sizes"):
        tpu.flash_attn_varlen_func(qv, qv, qv, cu, cu, 4, 4, block_sizes=(128, 128))
    qd = np.zeros((1, 1, 2, 8), np.float32)
    with pytest.raises(ValueError, match="v_cache=None"):
        tpu.flash_attn_with_kvcache(qd, kv, kv, cache_seqlens=3, block_table=bt)
    with pytest.raises(ValueError, match="mutually exclusive"):
        tpu.flash_attn_with_kvcache(qd, kv, None, cache_seqlens=3, block_table=bt,
                                    cache_batch_idx=[0])
    cc = np.zeros((1, 16, 2, 8), np.float32)
    with pytest.raises(ValueError, match="v_cache=None"):
        tpu.flash_attn_with_kvcache(qd, cc, None, cache_seqlens=3)
    with pytest.raises(ValueError, match="together"):
        tpu.flash_attn_with_kvcache(qd, cc, cc, np.zeros((1, 1, 2, 8), np.float32),
                                    cache_seqlens=3)
    with pytest.raises(ValueError, match="num_active"):
        tpu.flash_attn_with_kvcache(qd, cc, cc, cache_seqlens=3, num_active=2)


def test_rows_with_no_visible_key_give_zero_and_neg_inf():
    """Paged contexts shorter than the queries (causal) or empty: out 0, lse -inf there."""
    hq, hkv, d, page = 2, 1, 8, 16
    rng = np.random.default_rng(20)
    kv, kv64, table, k64, v64 = paged_cache(rng, [20, 20], page, hkv, d, "float32")
    q, q64 = make(rng, (hq, 9, d), "float32", "numpy")
    cu, seqused = np.array([0, 4, 9]), np.array([2, 0])
    out, lse = tpu.flash_attn_varlen_func(q, kv, None, cu, None, 5, 20, causal=True,
                                          return_softmax_lse=True, block_table=table,
                                          seqused_k=seqused)
    for i in range(2):
        a, z, n = cu[i], cu[i + 1], seqused[i]
        ro, rl = ref(q64[:, a:z].transpose(1, 0, 2), k64[i, :n], v64[i, :n], d ** -0.5,
                     causal=True)
        close(out[:, a:z].transpose(1, 0, 2), ro, "float32", f"sequence {i}")
        close_lse(lse[:, a:z], rl, f"sequence {i}")
    # sequence 0: 4 queries over 2 keys, so queries 0 and 1 see none; sequence 1: no keys
    assert np.isneginf(lse[:, :2]).all() and np.isfinite(lse[:, 2:4]).all()
    assert np.all(out[:, 4:] == 0) and np.isneginf(lse[:, 4:]).all()
    qd, _ = make(rng, (2, 3, hq, d), "float32", "numpy")
    out, lse, _ = tpu.flash_attn_with_kvcache(qd, kv, None, cache_seqlens=[0, 1],
                                              block_table=table, causal=True,
                                              return_softmax_lse=True)
    assert np.all(out[0] == 0) and np.isneginf(lse[0]).all()
    assert np.all(out[1, :2] == 0) and np.isneginf(lse[1, :, :2]).all()
    assert np.isfinite(lse[1, :, 2]).all()


# ------------------------------------------------------------------- attention sinks --

@pytest.mark.parametrize("family,dtype", CASES)
def test_sinks_in_every_layout(family, dtype):
    """sinks / s_aux on the three calls: dense head-major and token-major, packed varlen with
    padding rows, the merged paged cache (varlen and kvcache, num_active) and the contiguous
    pair; rows of a sequence that see no key give 0 and the sink, padding rows and inactive
    ones 0 and -inf."""
    rng = np.random.default_rng(30)
    hq, hkv, d = 4, 2, 16
    sinks, s64 = make(rng, (hq,), "float32", family, scale=2.0)
    # dense, head-major (causal, sq > sk: rows with no key) and token-major
    q, q64 = make(rng, (2, hq, 12, d), dtype, family)
    k, k64 = make(rng, (2, hkv, 9, d), dtype, family)
    out, lse = tpu.flash_attn_func(q, k, k, causal=True, return_softmax_lse=True, sinks=sinks)
    tok = tpu.flash_attn_func(perm(q, (0, 2, 1, 3)).reshape(2, 12, hq * d),
                              perm(k, (0, 2, 1, 3)).reshape(2, 9, hkv * d),
                              perm(k, (0, 2, 1, 3)).reshape(2, 9, hkv * d), causal=True,
                              head_dim=d, token_major=True, s_aux=sinks)
    for i in range(2):
        tq, tk = q64[i].transpose(1, 0, 2), k64[i].transpose(1, 0, 2)
        ro, rl = ref_attention(tq, tk, tk, d ** -0.5, causal=True, sinks=s64)
        close(as64(out)[i], ro.transpose(1, 0, 2), dtype, f"batch {i}")
        close_lse(lse[i], rl, f"batch {i}")
        close(as64(tok)[i], ro.reshape(12, hq * d), dtype, f"token-major batch {i}")
    assert np.array_equal(as64(lse)[:, :, :3], np.broadcast_to(s64[:, None], (2, hq, 3)))
    # packed varlen with 3 padding rows
    cu_q, cu_k = np.array([0, 5, 17]), np.array([0, 9, 30])
    q, q64 = make(rng, (hq, 20, d), dtype, family)
    k, k64 = make(rng, (hkv, 31, d), dtype, family)
    out, lse = tpu.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 12, 21, causal=True,
                                          return_softmax_lse=True, sinks=sinks)
    for i in range(2):
        a, z, ka, kz = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        tk = k64[:, ka:kz].transpose(1, 0, 2)
        ro, rl = ref_attention(q64[:, a:z].transpose(1, 0, 2), tk, tk, d ** -0.5, causal=True,
                               sinks=s64)
        close(as64(out)[:, a:z].transpose(1, 0, 2), ro, dtype, f"sequence {i}")
        close_lse(lse[:, a:z], rl, f"sequence {i}")
    assert np.all(as64(out)[:, 17:] == 0) and np.isneginf(as64(lse)[:, 17:]).all()


def test_sinks_with_paged_and_contiguous_caches():
    hq, hkv, d, page = 4, 1, 8, 16
    rng = np.random.default_rng(31)
    sinks = np.array([1.0, -0.5, 3.0, 0.0], np.float32)
    s64 = sinks.astype(np.float64)
    kv, kv64, table, k64, v64 = paged_cache(rng, [30, 30, 30], page, hkv, d, "float32")
    # varlen over the paged cache: sequence 1 has no keys, sequence 2 is inactive
    q, q64 = make(rng, (hq, 10, d), "float32", "numpy")
    cu, seqused = np.array([0, 4, 6, 9]), np.array([20, 0, 7])
    out, lse = tpu.flash_attn_varlen_func(q, kv, None, cu, None, 4, 20, return_softmax_lse=True,
                                          block_table=table, seqused_k=seqused, num_active=2,
                                          s_aux=sinks)
    ro, rl = ref_attention(q64[:, :4].transpose(1, 0, 2), k64[0, :20], v64[0, :20], d ** -0.5,
                           sinks=s64)
    close(out[:, :4].transpose(1, 0, 2), ro, "float32")
    close_lse(lse[:, :4], rl)
    assert np.all(out[:, 4:6] == 0) and np.array_equal(lse[:, 4:6], np.repeat(s64[:, None], 2, 1))
    assert np.all(out[:, 6:] == 0) and np.isneginf(lse[:, 6:]).all()
    # kvcache: the merged paged cache with an append, and the contiguous pair
    qd, qd64 = make(rng, (2, 2, hq, d), "float32", "numpy")
    kn, kn64 = make(rng, (2, 2, hkv, d), "float32", "numpy")
    lens = np.array([11, 25])
    out, lse, _ = tpu.flash_attn_with_kvcache(qd, kv, None, kn, kn, cache_seqlens=lens,
                                              block_table=table[:2], causal=True,
                                              return_softmax_lse=True, sinks=sinks)
    kc, kc64 = make(rng, (2, 32, hkv, d), "float32", "numpy")
    pair, plse, _, _ = tpu.flash_attn_with_kvcache(qd, kc, kc.copy(), cache_seqlens=lens,
                                                   return_softmax_lse=True, sinks=sinks)
    for i in range(2):
        kctx = np.concatenate([k64[i, :lens[i]], kn64[i]])
        vctx = np.concatenate([v64[i, :lens[i]], kn64[i]])
        ro, rl = ref_attention(qd64[i], kctx, vctx, d ** -0.5, causal=True, sinks=s64)
        close(out[i], ro, "float32", f"paged row {i}")
        close_lse(lse[i], rl, f"paged row {i}")
        ro, rl = ref_attention(qd64[i], kc64[i, :lens[i]], kc64[i, :lens[i]], d ** -0.5,
                               sinks=s64)
        close(pair[i], ro, "float32", f"contiguous row {i}")
        close_lse(plse[i], rl, f"contiguous row {i}")
    with pytest.raises(ValueError, match="s_aux"):
        tpu.flash_attn_func(qd, qd, qd, sinks=sinks, s_aux=sinks)


def test_the_original_serving_layer_names():
    """flywheel.tpu carries the original's seven calls: the layers (and their ReplaySSM forms)
    are flywheel's."""
    import flywheel
    for name in ("fused_conv1d_gdn", "fused_conv1d_kda", "fused_conv1d_gdn_replay",
                 "fused_conv1d_kda_replay"):
        assert getattr(tpu, name) is getattr(flywheel, name)
    assert set(tpu.__all__) >= {"flash_attn_func", "flash_attn_varlen_func",
                                "flash_attn_with_kvcache", "fused_conv1d_gdn",
                                "fused_conv1d_gdn_replay", "fused_conv1d_kda",
                                "fused_conv1d_kda_replay"}
