"""fp8 KV caches through flash_attn_with_kvcache (float8_e4m3fn / float8_e5m2 with
k_descale / v_descale, flash-attn 3's arguments): against the float64 reference on the
dequantised cache, appends quantised as documented, torch and numpy (ml_dtypes) caches, errors.
"""

import ml_dtypes
import numpy as np
import pytest

import flywheel
from conftest import ref_attention

torch = pytest.importorskip("torch")

F8 = {"e4m3": (ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn, 448.0),
      "e5m2": (ml_dtypes.float8_e5m2, torch.float8_e5m2, 57344.0)}


def quantise(x, np_f8, top):
    """x (float32) as the library stores it: to nearest even, saturating at +-top (ml_dtypes'
    cast rounds to nearest even; the clip gives the saturation)."""
    return np.clip(x, -top, top).astype(np_f8)


def paged_cache(rng, np_f8, top, b, lens, page, hkv, d, dv):
    """Paged fp8 caches holding `lens` tokens per sequence, pages shuffled, and the block
    table: caches [pages, page, hkv, d|dv] in np_f8, their float64 values, block_table."""
    per = max(1, -(-max(lens) // page)) + 1
    npages = b * per + 2
    kc = quantise(rng.standard_normal((npages, page, hkv, d)).astype(np.float32) * 2, np_f8, top)
    vc = quantise(rng.standard_normal((npages, page, hkv, dv)).astype(np.float32) * 2, np_f8, top)
    bt = rng.permutation(npages)[:b * per].reshape(b, per).astype(np.int32)
    return kc, vc, bt


def gather(cache, bt, i, n):
    """Sequence i's first n rows of a paged cache, as float64 [n, hkv, d]."""
    page = cache.shape[1]
    rows = [cache[bt[i, j // page], j % page] for j in range(n)]
    return np.stack(rows).astype(np.float64) if rows else np.zeros((0,) + cache.shape[2:])


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
@pytest.mark.parametrize("family", ["numpy", "torch"])
@pytest.mark.parametrize("per_head", [False, True])
def test_decode_and_append(kind, family, per_head):
    """A ragged batch (decode, multi-token, a long context that splits) on paged fp8 caches
    with appends: out and lse against float64 attention on the dequantised caches, and the
    appended rows stored as k / descale rounded to the cache's type."""
    np_f8, torch_f8, top = F8[kind]
    rng = np.random.default_rng(7 if per_head else 8)
    b, hq, hkv, d, dv, page, sq = 3, 8, 2, 64, 48, 16, 2
    lens = [1500, 40, 0]
    kc, vc, bt = paged_cache(rng, np_f8, top, b, [n + sq for n in lens], page, hkv, d, dv)
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
    kn = rng.standard_normal((b, sq, hkv, d)).astype(np.float32)
    vn = rng.standard_normal((b, sq, hkv, dv)).astype(np.float32)
    if per_head:
        kd = (0.25 + 0.25 * np.arange(b * hkv, dtype=np.float32)).reshape(b, hkv)
        vd = kd[::-1].copy()
    else:
        kd, vd = np.float32(0.5), np.float32(1.5)
    kd_b, vd_b = np.broadcast_to(kd, (b, hkv)), np.broadcast_to(vd, (b, hkv))
    seqlens = np.array(lens, np.int32)
    before_k, before_v = kc.copy(), vc.copy()
    if family == "torch":
        args = [torch.from_numpy(x) for x in (q, kn, vn)]
        caches = [torch.from_numpy(c.view(np.uint8)).view(torch_f8) for c in (kc, vc)]
        desc = [torch.tensor(x) for x in (kd, vd)]
        out, lse = flywheel.flash_attn_with_kvcache(
            args[0], caches[0], caches[1], args[1], args[2], cache_seqlens=seqlens,
            block_table=bt, causal=True, return_softmax_lse=True, k_descale=desc[0],
            v_descale=desc[1])
        out, lse = out.numpy(), lse.numpy()
    else:
        out, lse = flywheel.flash_attn_with_kvcache(
            q, kc, vc, kn, vn, cache_seqlens=seqlens, block_table=bt, causal=True,
            return_softmax_lse=True, k_descale=kd if per_head else float(kd), v_descale=vd)
    for i in range(b):
        for r in range(sq):
            j = lens[i] + r
            page_of, row = bt[i, j // page], j % page
            want_k = quantise(kn[i, r] / kd_b[i][:, None], np_f8, top)
            want_v = quantise(vn[i, r] / vd_b[i][:, None], np_f8, top)
            np.testing.assert_array_equal(kc[page_of, row].view(np.uint8), want_k.view(np.uint8))
            np.testing.assert_array_equal(vc[page_of, row].view(np.uint8), want_v.view(np.uint8))
            before_k[page_of, row], before_v[page_of, row] = kc[page_of, row], vc[page_of, row]
        n = lens[i] + sq
        k64 = gather(kc, bt, i, n) * kd_b[i][None, :, None]
        v64 = gather(vc, bt, i, n) * vd_b[i][None, :, None]
        ro, rl = ref_attention(q[i].astype(np.float64), k64, v64, d ** -0.5, causal=True)
        np.testing.assert_allclose(out[i], ro, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(lse[i], rl, atol=2e-5, rtol=2e-5)
    # nothing but the appended rows changed
    np.testing.assert_array_equal(kc.view(np.uint8), before_k.view(np.uint8))
    np.testing.assert_array_equal(vc.view(np.uint8), before_v.view(np.uint8))


def test_bf16_query_matches_dequantised_bf16_cache():
    """bf16 q on an e4m3 cache gives the bits of the same call on a bf16 cache holding the
    stored bytes (exact in bf16) with the descales folded into the scale and the output: the
    fp8 path rounds nothing the bf16 path does not, up to the f32 order of the scale."""
    rng = np.random.default_rng(3)
    b, hq, hkv, d, page = 2, 4, 1, 32, 32
    kc, vc, bt = paged_cache(rng, ml_dtypes.float8_e4m3fn, 448.0, b, [300, 700], page, hkv, d, d)
    q = torch.from_numpy(rng.standard_normal((b, 1, hq, d)).astype(np.float32)).bfloat16()
    seqlens = np.array([300, 700], np.int32)
    out8 = flywheel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=bt,
                                           k_descale=1.0, v_descale=1.0, precision="f32")
    kb = torch.from_numpy(kc.astype(np.float32)).bfloat16()
    vb = torch.from_numpy(vc.astype(np.float32)).bfloat16()
    outb = flywheel.flash_attn_with_kvcache(q, kb, vb, cache_seqlens=seqlens, block_table=bt,
                                           precision="f32")
    assert torch.equal(out8, outb)


def test_torch_op_takes_descales():
    """torch.ops.flywheel.flash_attn_with_kvcache on a torch fp8 cache with descales: the
    call's bits, the cache appended as by the call."""
    import flywheel.torch_ops  # noqa: F401 (registers torch.ops.flywheel)
    rng = np.random.default_rng(11)
    kc, vc, bt = paged_cache(rng, ml_dtypes.float8_e5m2, 57344.0, 2, [70, 5], 8, 2, 32, 32)
    caches = [torch.from_numpy(c.view(np.uint8)).view(torch.float8_e5m2) for c in (kc, vc)]
    copies = [c.clone() for c in caches]
    q = torch.randn(2, 1, 4, 32)
    kn, vn = torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32)
    seqlens = torch.tensor([70, 5], dtype=torch.int32)
    kd, vd = torch.tensor(0.75), torch.full((2, 2), 1.25)
    got = torch.ops.flywheel.flash_attn_with_kvcache(
        q, caches[0], caches[1], kn, vn, seqlens, torch.from_numpy(bt), causal=True,
        k_descale=kd, v_descale=vd)
    want = flywheel.flash_attn_with_kvcache(q, copies[0], copies[1], kn, vn, cache_seqlens=seqlens,
                                            block_table=bt, causal=True, k_descale=kd,
                                            v_descale=vd)
    assert torch.equal(got[0], want)  # (the op returns out and lse, empty unless asked for)
    for a, b in zip(caches, copies):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_errors_write_nothing():
    rng = np.random.default_rng(5)
    kc, vc, bt = paged_cache(rng, ml_dtypes.float8_e4m3fn, 448.0, 1, [10], 16, 2, 16, 16)
    q = rng.standard_normal((1, 1, 4, 16)).astype(np.float32)
    kn = rng.standard_normal((1, 1, 2, 16)).astype(np.float32)
    before = kc.copy()
    seqlens = np.array([10], np.int32)
    bad = [({}, "k_descale"),                                           # fp8 without descales
           ({"k_descale": np.ones((1, 3), np.float32), "v_descale": 1.0}, "k_descale"),
           ({"k_descale": 0.0, "v_descale": 1.0}, "descale"),
           ({"k_descale": float("nan"), "v_descale": 1.0}, "descale")]
    for kw, what in bad:
        with pytest.raises(flywheel.FlywheelError, match=what):
            flywheel.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=seqlens,
                                             block_table=bt, **kw)
        np.testing.assert_array_equal(kc.view(np.uint8), before.view(np.uint8))
    with pytest.raises(flywheel.FlywheelError, match="descale"):  # descales on a float cache
        flywheel.flash_attn_with_kvcache(q, kc.astype(np.float32), vc.astype(np.float32),
                                         cache_seqlens=seqlens, block_table=bt, k_descale=1.0,
                                         v_descale=1.0)
    with pytest.raises(TypeError):  # fp8 queries: caches only
        flywheel.flash_attn_func(q.astype(ml_dtypes.float8_e4m3fn), kc[:1, :, :, :],
                                 vc[:1, :, :, :])
