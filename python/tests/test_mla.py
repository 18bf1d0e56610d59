"""flywheel.mla: FlashMLA's calls (MLA decode over a paged latent cache) against a float64
reference that gathers each context through the block table, on DeepSeek's shapes (576
channels: 512 latent + 64 rope, values the 512 latent ones) and smaller splits; the optional
append; the errors; the torch op. And MLA's prefill, which is flash_attn_varlen_func at
d 192, dv 128."""

import numpy as np
import pytest

import flywheel
from conftest import DTYPES, FAMILIES, TOL, as64, make, read_only, ref_attention, torch


def reference(q, k_cache, block_table, lens, dv, scale, causal):
    """float64 MLA: q [b, sq, hq, d], k_cache [num_pages, page_size, 1, d] -> out
    [b, sq, hq, dv], lse [b, hq, sq]. Sequence i's context is its first lens[i] tokens (token t
    at row t % page_size of page block_table[i][t // page_size]); keys are the whole rows,
    values their first dv channels; causal: query r sees keys j <= r + L - sq; a row that
    sees no key gives 0 and lse -inf."""
    b, sq, hq, d = q.shape
    page = k_cache.shape[1]
    out, lse = np.zeros((b, sq, hq, dv)), np.full((b, hq, sq), -np.inf)
    for i in range(b):
        L = int(lens[i])
        t = np.arange(L)
        rows = k_cache[block_table[i, t // page], t % page, 0]  # [L, d]
        s = (q[i].reshape(sq * hq, d) @ rows.T * scale).reshape(sq, hq, L)
        if causal:
            seen = t[None, :] <= np.arange(sq)[:, None] + L - sq  # [sq, L]
            s = np.where(seen[:, None, :], s, -np.inf)
        m = s.max(axis=-1, keepdims=True, initial=-np.inf)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        den = p.sum(axis=-1)  # [sq, hq]
        out[i] = (p @ rows[:, :dv]) / np.where(den > 0, den, 1.0)[..., None]
        with np.errstate(divide="ignore"):
            lse[i] = (np.log(den) + m[..., 0]).T
    return out, lse


def check(out, lse, ro, rl, dtype):
    assert tuple(out.shape) == ro.shape and tuple(lse.shape) == rl.shape
    err = np.abs(as64(out) - ro).max(initial=0.0)
    assert err <= TOL[dtype], f"max error {err} over {TOL[dtype]}"
    got = as64(lse)
    assert np.array_equal(np.isinf(got), np.isinf(rl))
    fin = np.isfinite(rl)
    assert np.abs(got[fin] - rl[fin]).max(initial=0.0) <= 1e-4


def paged_cache(rng, lens, page, d, dtype, family, extra=0):
    """A paged latent cache of random rows [num_pages, page, 1, d] (and its float64 value),
    and a block table giving sequence i pages for lens[i] + extra tokens in shuffled order,
    its unused entries -1 (never read). One page more than needed stays unused."""
    need = [-(-(int(n) + extra) // page) for n in lens]
    order = rng.permutation(sum(need) + 1).astype(np.int32)
    table = np.full((len(lens), max(need + [1])), -1, np.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = order[at:at + n]
        at += n
    kc, kc64 = make(rng, (len(order), page, 1, d), dtype, family)
    return kc, kc64, table


def mla(q, kc, table, lens, dv, **kw):
    """flash_mla_with_kvcache as FlashMLA's users call it: with get_mla_metadata's result."""
    b, sq, hq, _ = q.shape
    metadata = flywheel.get_mla_metadata(lens, sq * hq // kc.shape[2], kc.shape[2])
    return flywheel.flash_mla_with_kvcache(q, kc, table, lens, dv, *metadata, **kw)


# ----------------------------------------------------------------------- DeepSeek's shapes

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("page", [64, 3])
@pytest.mark.parametrize("hq", [16, 128])
def test_deepseek_decode(hq, page, sq, dtype):
    """d_qk 576, head_dim_v 512; hq 16 at sq 1 takes the decode kernel (16 query rows on the
    one K/V head), the others the tiled kernel; contexts from 1 token (whose first rows see
    no key when causal with sq 3) to 2000 (split into ranges of FW_KV_SPLIT keys)."""
    rng = np.random.default_rng(hq + page + sq)
    d, dv = 576, 512
    lens = np.array([2000, 1, 517, 1100], np.int32)
    kc, kc64, table = paged_cache(rng, lens, page, d, dtype, "numpy")
    q, q64 = make(rng, (len(lens), sq, hq, d), dtype, "numpy")
    causal = sq > 1
    out, lse = mla(q, kc, table, lens, dv, causal=causal)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    check(out, lse, *reference(q64, kc64, table, lens, dv, d ** -0.5, causal), dtype)


# ------------------------------------------------------------------------ other splits

SPLITS = [  # d_qk, head_dim_v, hq, page_size
    (96, 64, 4, 16),
    (64, 64, 8, 5),     # values are the whole rows
    (40, 8, 1, 1),
    (33, 17, 2, 48),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", SPLITS)
def test_other_splits(split, dtype, family):
    d, dv, hq, page = split
    rng = np.random.default_rng(d + dv + hq)
    lens = np.array([0, 5, 130, 77], np.int32)
    kc, kc64, table = paged_cache(rng, lens, page, d, dtype, family)
    for sq, causal, scale in ((1, False, None), (2, True, 0.3), (4, False, None)):
        q, q64 = make(rng, (len(lens), sq, hq, d), dtype, family)
        out, lse = mla(q, kc, table, lens, dv, causal=causal, softmax_scale=scale)
        assert type(out) is type(q) and type(lse) is type(q)
        want = reference(q64, kc64, table, lens, dv, scale or d ** -0.5, causal)
        check(out, lse, *want, dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_strided_cache_is_read_in_place(family):
    """Cache rows padded to 640 channels (a view of a larger buffer), a block table and
    lengths of other integer dtypes: read as they lie, V as the first 512 channels of the
    same rows."""
    rng = np.random.default_rng(5)
    lens = np.array([300, 64, 129])
    buf, buf64, table = paged_cache(rng, lens, 64, 640, "bfloat16", family)
    kc, kc64 = buf[..., :576], buf64[..., :576]
    q, q64 = make(rng, (3, 1, 16, 576), "bfloat16", family)
    want = reference(q64, kc64, table, lens, 512, 576 ** -0.5, False)
    if family == "torch":
        table, lens = torch.from_numpy(table).long(), torch.from_numpy(lens)
    out, lse = mla(q, kc, table, lens, 512)
    check(out, lse, *want, "bfloat16")


def test_metadata_round_trip():
    """get_mla_metadata's (None, None), no metadata at all, and FlashMLA's own metadata
    (anything) give the same bits."""
    rng = np.random.default_rng(6)
    lens = np.array([40, 700], np.int32)
    kc, _, table = paged_cache(rng, lens, 64, 576, "bfloat16", "numpy")
    q, _ = make(rng, (2, 2, 16, 576), "bfloat16", "numpy")
    metadata = flywheel.get_mla_metadata(lens, 2 * 16, 1, num_heads_q=16)
    assert metadata == (None, None)
    a = flywheel.flash_mla_with_kvcache(q, kc, table, lens, 512, *metadata, causal=True)
    b = flywheel.flash_mla_with_kvcache(q, kc, table, lens, 512, causal=True)
    c = flywheel.flash_mla_with_kvcache(q, kc, table, lens, 512, np.zeros((132, 8), np.int32),
                                        np.arange(3, dtype=np.int32), causal=True)
    for x in (b, c):
        assert np.array_equal(as64(x[0]), as64(a[0])) and np.array_equal(x[1], a[1])
    assert flywheel.mla.get_mla_metadata is flywheel.get_mla_metadata
    assert flywheel.mla.flash_mla_with_kvcache is flywheel.flash_mla_with_kvcache


def test_out_is_written_in_place():
    rng = np.random.default_rng(7)
    lens = np.array([90, 3], np.int32)
    kc, _, table = paged_cache(rng, lens, 16, 96, "float32", "numpy")
    q, _ = make(rng, (2, 3, 4, 96), "float32", "numpy")
    want = mla(q, kc, table, lens, 64, causal=True)
    buf = np.full((2, 3, 4, 64), 7.0, np.float32)
    out, lse = mla(q, kc, table, lens, 64, causal=True, out=buf)
    assert out is buf
    assert np.array_equal(buf, want[0]) and np.array_equal(lse, want[1])


# ---------------------------------------------------------------------------------- append

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("page", [64, 3])
@pytest.mark.parametrize("sq", [1, 3])
def test_append_writes_exactly_the_new_rows(sq, page, family):
    """k_new is written at cache_seqlens (all 576 channels; the V write of the first 512 repeats
    the same bytes) and nothing else changes; the result is the reference's on the longer
    contexts, and the same bits as attending to them afterwards without k_new."""
    rng = np.random.default_rng(8 + sq + page)
    d, dv, hq = 576, 512, 16
    lens = np.array([0, 70, 200], np.int32)
    kc, kc64, table = paged_cache(rng, lens, page, d, "bfloat16", family, extra=sq)
    q, q64 = make(rng, (3, sq, hq, d), "bfloat16", family)
    kn, kn64 = make(rng, (3, sq, 1, d), "bfloat16", family)
    out, lse = mla(q, kc, table, lens, dv, causal=True, k_new=kn)
    want = kc64.copy()
    for i in range(3):
        for r in range(sq):
            t = lens[i] + r
            want[table[i, t // page], t % page] = kn64[i, r]
    assert np.array_equal(as64(kc), want)
    check(out, lse, *reference(q64, want, table, lens + sq, dv, d ** -0.5, True), "bfloat16")
    again, lse2 = mla(q, kc, table, lens + sq, dv, causal=True)
    assert np.array_equal(as64(again), as64(out)) and np.array_equal(as64(lse2), as64(lse))
    assert np.array_equal(as64(kc), want)


# ---------------------------------------------------------------------------------- errors

def _case(dtype="float32"):
    """A valid small call with an append: q, k_cache, block_table, cache_seqlens, k_new."""
    rng = np.random.default_rng(9)
    lens = np.array([5, 20], np.int32)
    kc, _, table = paged_cache(rng, lens, 16, 96, dtype, "numpy", extra=1)
    q, _ = make(rng, (2, 1, 4, 96), dtype, "numpy")
    kn, _ = make(rng, (2, 1, 1, 96), dtype, "numpy")
    return q, kc, table, lens, kn


BAD = [  # (what, change to the arguments, exception, message)
    ("cache head dim", dict(k_cache=lambda a: a[..., :64]), ValueError, "96|64"),
    ("head_dim_v above d_qk", dict(head_dim_v=97), ValueError, "head_dim_v = 97"),
    ("head_dim_v 0", dict(head_dim_v=0), ValueError, "head_dim_v = 0"),
    ("two cache heads", dict(k_cache=lambda a: np.concatenate([a, a], axis=2)), ValueError,
     "2 heads"),
    ("block_table rows", dict(block_table=lambda a: a[:1]), ValueError, "block_table"),
    ("block_table rank", dict(block_table=lambda a: a[0]), ValueError, "block_table"),
    ("cache_seqlens shape", dict(cache_seqlens=lambda a: a[:1]), ValueError, "cache_seqlens"),
    ("k_new rows", dict(k_new=lambda a: np.concatenate([a, a], axis=1)), ValueError, "k_new"),
    ("q dtype", dict(q=lambda a: a.astype(np.float16)), TypeError, "q is float16"),
    ("k_new dtype", dict(k_new=lambda a: a.astype(np.float16)), ValueError, "k_new is float16"),
    ("page out of range", dict(block_table=lambda a: a + 100), flywheel.FlywheelError,
     "FW_ERR_INDEX"),
    ("context past its pages", dict(cache_seqlens=lambda a: a + 40), flywheel.FlywheelError,
     "FW_ERR_SEQLENS"),
    ("read-only cache", dict(k_cache=read_only), ValueError, "read-only"),
    ("fp8 flag", dict(is_fp8_kvcache=True), NotImplementedError, "fp8"),
    ("sparse", dict(indices=np.zeros((2, 1, 64), np.int32)), NotImplementedError, "sparse"),
    ("zero scale", dict(softmax_scale=0.0), NotImplementedError, "softmax_scale"),
]


@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_errors_write_nothing(bad):
    _, change, exc, match = bad
    q, kc, table, lens, kn = _case()
    args = dict(q=q, k_cache=kc, block_table=table, cache_seqlens=lens, head_dim_v=64, k_new=kn)
    for name, how in change.items():
        args[name] = how(args[name]) if callable(how) else how
    before = args["k_cache"].copy()
    with pytest.raises(exc, match=match):
        flywheel.flash_mla_with_kvcache(**args)
    assert np.array_equal(args["k_cache"], before)


def test_dtype_mismatch_is_a_type_and_a_value_error():
    q, kc, table, lens, _ = _case()
    with pytest.raises(flywheel.FlywheelDtypeError) as e:
        flywheel.flash_mla_with_kvcache(q.astype(np.float16), kc, table, lens, 64)
    assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)


@pytest.mark.skipif(torch is None, reason="torch")
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("hq", [16, 128])
def test_fp8_latent_cache(dtype, hq):
    """An fp8 latent cache with k_descale (keys and values the same bytes, one descale):
    against float64 MLA on the dequantised cache, at DeepSeek's shapes, with an append whose
    rows are stored as k_new / descale rounded to the cache's type."""
    rng = np.random.default_rng(13)
    lens = np.array([1100, 7], np.int32)
    kc, _, table = paged_cache(rng, lens, 64, 576, "float32", "torch", extra=1)
    kc8 = kc.to(getattr(torch, dtype))
    q = torch.randn(2, 1, hq, 576, dtype=torch.bfloat16)
    kn = torch.randn(2, 1, 1, 576)
    out, lse = flywheel.flash_mla_with_kvcache(q, kc8, table, lens, 512, None, None, causal=True,
                                               k_new=kn, k_descale=0.5)
    for i in range(2):  # the appended rows: k_new / 0.5 in the cache's type
        t = int(lens[i])
        got = kc8[table[i, t // 64], t % 64, 0]
        want = (kn[i, 0, 0] / 0.5).to(getattr(torch, dtype))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    deq = kc8.to(torch.float64).numpy() * 0.5
    ro, rl = reference(q.double().numpy(), deq, table, lens + 1, 512, 576 ** -0.5, True)
    check(out, lse, ro, rl, "bfloat16")


@pytest.mark.skipif(torch is None, reason="torch")
def test_fp8_latent_cache_needs_a_descale():
    q, kc, table, lens, _ = _case()
    kc8 = torch.from_numpy(kc).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_descale"):
        flywheel.flash_mla_with_kvcache(torch.from_numpy(q), kc8, table, lens, 64)


def test_metadata_refuses_fp8_and_sparse():
    lens = np.array([5], np.int32)
    with pytest.raises(NotImplementedError, match="fp8"):
        flywheel.get_mla_metadata(lens, 16, 1, is_fp8_kvcache=True)
    with pytest.raises(NotImplementedError, match="sparse"):
        flywheel.get_mla_metadata(lens, 16, 1, num_heads_q=16, topk=2048)


# ------------------------------------------------------------------------------- torch op

@pytest.mark.skipif(torch is None, reason="torch")
def test_torch_op_gives_the_calls_bits():
    import flywheel.torch_ops  # noqa: F401  (registers torch.ops.flywheel.*)
    ops = torch.ops.flywheel
    rng = np.random.default_rng(10)
    lens = np.array([33, 140], np.int32)
    kc, _, table = paged_cache(rng, lens, 16, 96, "bfloat16", "torch", extra=2)
    table, lens = torch.from_numpy(table), torch.from_numpy(lens)
    q, _ = make(rng, (2, 2, 4, 96), "bfloat16", "torch")
    kn, _ = make(rng, (2, 2, 1, 96), "bfloat16", "torch")
    kc2 = kc.clone()
    out, lse = ops.flash_mla_with_kvcache(q, kc, table, lens, 64, causal=True, k_new=kn)
    want = flywheel.flash_mla_with_kvcache(q, kc2, table, lens, 64, causal=True, k_new=kn)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1]) and torch.equal(kc, kc2)
    assert out.shape == (2, 2, 4, 64) and lse.shape == (2, 4, 2) and lse.dtype == torch.float32
    buf, lbuf = torch.empty_like(out), torch.empty_like(lse)
    assert ops.flash_mla_with_kvcache_out(q, kc, table, lens + 2, 64, buf, lbuf,
                                          causal=True) is None
    assert torch.equal(buf, out) and torch.equal(lbuf, lse)


# ---------------------------------------------------------------------------------- prefill

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_is_varlen_at_192_128(dtype):
    """MLA's prefill decompresses the latent rows into per-head keys (128 nope + 64 rope
    channels) and values (128): plain MHA through flash_attn_varlen_func, causal, ragged."""
    rng = np.random.default_rng(11)
    h, d, dv = 16, 192, 128
    lens = [1, 37, 0, 300, 129]
    cu = np.cumsum([0] + lens).astype(np.int32)
    q, q64 = make(rng, (cu[-1], h, d), dtype, "numpy")
    k, k64 = make(rng, (cu[-1], h, d), dtype, "numpy")
    v, v64 = make(rng, (cu[-1], h, dv), dtype, "numpy")
    out, lse = flywheel.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens),
                                               causal=True, return_softmax_lse=True)
    assert out.shape == (cu[-1], h, dv) and lse.shape == (h, cu[-1])
    for i in (i for i in range(len(lens)) if lens[i]):
        s = slice(cu[i], cu[i + 1])
        ro, rl = ref_attention(q64[s], k64[s], v64[s], d ** -0.5, causal=True)
        assert np.abs(as64(out)[s] - ro).max(initial=0.0) <= TOL[dtype]
        assert np.abs(lse[:, s] - rl).max(initial=0.0) <= 1e-4
