"""flywheel.torch_ops: the torch custom ops give the bits of the Python calls they wrap (out
variants included), pass torch.library.opcheck, and compile (aot_eager, fullgraph) into a
decode step whose in-place cache and state updates match eager."""

import importlib
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import flywheel  # noqa: E402
import flywheel.torch_ops as fw_ops  # noqa: E402

OPS = torch.ops.flywheel


def rnd(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def same(a, b):
    """Same dtype, shape and bits (NaN-free inputs, so equal values are equal bits)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b)


def clones(xs):
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in xs]


# ------------------------------------------------------------------------------------ inputs

def attn_inputs(dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return rnd(gen, 2, 5, 4, 32, dtype=dtype), rnd(gen, 2, 7, 2, 32, dtype=dtype), \
        rnd(gen, 2, 7, 2, 16, dtype=dtype)


def varlen_inputs(dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(1)
    q, k, v = rnd(gen, 8, 4, 32, dtype=dtype), rnd(gen, 11, 2, 32, dtype=dtype), \
        rnd(gen, 11, 2, 16, dtype=dtype)
    cq = torch.tensor([0, 3, 8], dtype=torch.int32)
    ck = torch.tensor([0, 4, 11], dtype=torch.int32)
    return q, k, v, cq, ck, 5, 7


def kvcache_inputs(paged=False, packed=False, dtype=torch.bfloat16):
    """q, k_cache, v_cache, k, v, cache_seqlens, block_table, cu_seqlens_q."""
    gen = torch.Generator().manual_seed(2)
    b, hq, hkv, d = 2, 4, 2, 32
    if paged:  # 4 pages of 16 tokens, two per sequence
        kc, vc = rnd(gen, 4, 16, hkv, d, dtype=dtype), rnd(gen, 4, 16, hkv, d, dtype=dtype)
        table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    else:
        kc, vc = rnd(gen, b, 32, hkv, d, dtype=dtype), rnd(gen, b, 32, hkv, d, dtype=dtype)
        table = None
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    if packed:  # 2 and 1 new tokens
        q = rnd(gen, 3, hq, d, dtype=dtype)
        k, v = rnd(gen, 3, hkv, d, dtype=dtype), rnd(gen, 3, hkv, d, dtype=dtype)
        cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    else:
        q = rnd(gen, b, 1, hq, d, dtype=dtype)
        k, v = rnd(gen, b, 1, hkv, d, dtype=dtype), rnd(gen, b, 1, hkv, d, dtype=dtype)
        cu = None
    return q, kc, vc, k, v, seqlens, table, cu


def gdn_inputs(dtype=torch.bfloat16, B=1, Tn=10):
    """q, k, v, g, beta, initial_state [2, HV, K, V], cu_seqlens (two sequences when B = 1)."""
    gen = torch.Generator().manual_seed(3)
    H, HV, K, V = 2, 4, 16, 16
    q, k = rnd(gen, B, Tn, H, K, dtype=dtype), rnd(gen, B, Tn, H, K, dtype=dtype)
    v = rnd(gen, B, Tn, HV, V, dtype=dtype)
    g = -0.1 * torch.rand(B, Tn, HV, generator=gen)
    beta = torch.rand(B, Tn, HV, generator=gen)
    h0 = rnd(gen, 2, HV, K, V, scale=0.1)
    cu = torch.tensor([0, 4, Tn], dtype=torch.int32)
    return q, k, v, g, beta, h0, cu


def decode_inputs(dtype=torch.bfloat16):
    """q, k [N, H, K], v [N, HV, V], g, beta [N, HV], state [slots, HV, K, V], indices."""
    gen = torch.Generator().manual_seed(4)
    N, H, HV, K, V = 3, 2, 4, 16, 16
    q, k = rnd(gen, N, H, K, dtype=dtype), rnd(gen, N, H, K, dtype=dtype)
    v = rnd(gen, N, HV, V, dtype=dtype)
    g = -0.1 * torch.rand(N, HV, generator=gen)
    beta = torch.rand(N, HV, generator=gen)
    state = rnd(gen, 5, HV, K, V, scale=0.1)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    return q, k, v, g, beta, state, idx


def verify_inputs(dtype=torch.bfloat16):
    """q, k, v [1, 6, ...], g, beta, state [3 slots], state_indices [2], cu_seqlens [0, 2, 6]."""
    gen = torch.Generator().manual_seed(5)
    H, HV, K, V = 2, 4, 16, 16
    q, k = rnd(gen, 1, 6, H, K, dtype=dtype), rnd(gen, 1, 6, H, K, dtype=dtype)
    v = rnd(gen, 1, 6, HV, V, dtype=dtype)
    g = -0.1 * torch.rand(1, 6, HV, generator=gen)
    beta = torch.rand(1, 6, HV, generator=gen)
    state = rnd(gen, 3, HV, K, V, scale=0.1)
    return q, k, v, g, beta, state, torch.tensor([2, 0], dtype=torch.int32), \
        torch.tensor([0, 2, 6], dtype=torch.int32)


def mla_inputs(dtype=torch.bfloat16):
    """q [2, 2, 4, 48], a paged latent cache [5 pages of 8, 1 head, 48], block_table [2, 2],
    cache_seqlens, k_new [2, 2, 1, 48]; head_dim_v is 32."""
    gen = torch.Generator().manual_seed(6)
    q, kc = rnd(gen, 2, 2, 4, 48, dtype=dtype), rnd(gen, 5, 8, 1, 48, dtype=dtype)
    table = torch.tensor([[3, 0], [4, 1]], dtype=torch.int32)
    return q, kc, table, torch.tensor([5, 12], dtype=torch.int32), \
        rnd(gen, 2, 2, 1, 48, dtype=dtype)


# ----------------------------------------------------------------------------- registration

def test_importing_flywheel_does_not_import_torch():
    env = dict(os.environ)
    code = "import sys, flywheel; assert 'torch' not in sys.modules, 'torch was imported'"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_op_is_registered_and_reimport_does_not_fail():
    expected = {"flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                "gated_delta_rule_decode", "gated_delta_rule_verify", "gated_delta_rule_commit",
                "causal_conv1d_fn", "causal_conv1d_update", "fused_conv1d_gdn",
                "flash_mla_with_kvcache"}
    expected |= {n + "_out" for n in expected - {"gated_delta_rule_commit"}}
    expected |= {"chunk_kda", "fused_conv1d_kda"}  # KDA: no out variants
    expected |= {"flash_attn_backward", "flash_attn_varlen_backward"}
    assert set(fw_ops.OPS) == expected
    for name in fw_ops.OPS:
        assert hasattr(OPS, name)
    importlib.reload(fw_ops)
    saved = sys.modules.pop("flywheel.torch_ops")
    try:
        importlib.import_module("flywheel.torch_ops")
    finally:
        sys.modules["flywheel.torch_ops"] = saved
        flywheel.torch_ops = saved
    q, k, v = attn_inputs()
    same(OPS.flash_attn_func(q, k, v)[0], flywheel.flash_attn_func(q, k, v))


def test_mutation_annotations():
    def written(name):
        schema = getattr(OPS, name).default._schema
        return {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert written("flash_attn_with_kvcache") == {"k_cache", "v_cache"}
    assert written("gated_delta_rule_decode") == {"state"}
    assert written("gated_delta_rule_commit") == {"state"}
    assert written("flash_attn_func") == set()
    assert written("gated_delta_rule_verify") == set()
    assert written("flash_attn_with_kvcache_out") == {"k_cache", "v_cache", "out", "lse"}
    assert written("gated_delta_rule_decode_out") == {"state", "out"}
    assert written("chunk_gated_delta_rule_out") == {"out", "final_state"}
    assert written("gated_delta_rule_verify_out") == {"out", "replay"}
    assert written("causal_conv1d_fn") == set()
    assert written("causal_conv1d_update") == {"conv_state"}
    assert written("fused_conv1d_gdn") == {"conv_state", "recurrent_state"}
    assert written("fused_conv1d_gdn_out") == {"conv_state", "recurrent_state", "out"}
    assert written("flash_mla_with_kvcache") == {"k_cache"}
    assert written("flash_mla_with_kvcache_out") == {"k_cache", "out", "lse"}


# ------------------------------------------------------------------- same bits as the calls

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lse", [False, True])
def test_flash_attn_func(dtype, lse):
    q, k, v = attn_inputs(dtype)
    opts = dict(causal=True, softmax_scale=0.2, softcap=30.0)
    out, got_lse = OPS.flash_attn_func(q, k, v, window_size_left=3, window_size_right=0,
                                       return_softmax_lse=lse, **opts)
    want = flywheel.flash_attn_func(q, k, v, window_size=(3, 0), return_softmax_lse=lse,
                                    **opts)
    if lse:
        same(out, want[0])
        same(got_lse, want[1])
        assert got_lse.shape == (2, 4, 5)
    else:
        same(out, want)
        assert got_lse.shape == (0,) and got_lse.dtype == torch.float32
    assert out.shape == (2, 5, 4, 16) and out.dtype == dtype

    buf, lbuf = torch.full_like(out, 7.0), torch.empty(2, 4, 5)
    assert OPS.flash_attn_func_out(q, k, v, buf, lbuf if lse else None, window_size_left=3,
                                   window_size_right=0, **opts) is None
    same(buf, out)
    if lse:
        same(lbuf, got_lse)


@pytest.mark.parametrize("lse", [False, True])
def test_flash_attn_varlen_func(lse):
    args = varlen_inputs()
    out, got_lse = OPS.flash_attn_varlen_func(*args, causal=True, return_softmax_lse=lse)
    want = flywheel.flash_attn_varlen_func(*args, causal=True, return_softmax_lse=lse)
    same(out, want[0] if lse else want)
    if lse:
        same(got_lse, want[1])
        assert got_lse.shape == (4, 8)
    else:
        assert got_lse.shape == (0,)
    buf, lbuf = torch.zeros_like(out), torch.empty(4, 8)
    OPS.flash_attn_varlen_func_out(*args, buf, lbuf if lse else None, causal=True)
    same(buf, out)
    if lse:
        same(lbuf, got_lse)


def test_flash_attn_with_kvcache_leftpad_like_the_call():
    q, kc, vc, k, v, seqlens, table, cu = kvcache_inputs()
    pads = torch.tensor([1, 0], dtype=torch.int32)[:seqlens.shape[0]]
    kc2, vc2 = kc.clone(), vc.clone()
    out, _ = OPS.flash_attn_with_kvcache(q, kc, vc, k, v, seqlens, causal=True,
                                         cache_leftpad=pads)
    want = flywheel.flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=seqlens,
                                            causal=True, cache_leftpad=pads)
    same(out, want)
    same(kc, kc2)
    swap = torch.tensor([1, 0], dtype=torch.int32)  # the sequences' entries swapped
    got, _ = OPS.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), None, None, seqlens + 1,
                                         causal=True, cache_batch_idx=swap)
    same(got, flywheel.flash_attn_with_kvcache(q, kc.flip(0), vc.flip(0),
                                               cache_seqlens=seqlens + 1, causal=True))
    plain = flywheel.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=seqlens + 1,
                                             causal=True)
    assert not torch.equal(out, plain)  # the padding rows were left out
    buf = torch.zeros_like(out)
    OPS.flash_attn_with_kvcache_out(q, kc.clone(), vc.clone(), buf, None, None, None,
                                    seqlens + 1, None, causal=True, cache_leftpad=pads)
    same(buf, flywheel.flash_attn_with_kvcache(q, kc.clone(), vc.clone(),
                                               cache_seqlens=seqlens + 1, causal=True,
                                               cache_leftpad=pads))


@pytest.mark.parametrize("paged,packed", [(False, False), (True, False), (False, True),
                                          (True, True)])
@pytest.mark.parametrize("lse", [False, True])
def test_flash_attn_with_kvcache_appends_like_the_call(paged, packed, lse):
    q, kc, vc, k, v, seqlens, table, cu = kvcache_inputs(paged, packed)
    kc2, vc2 = kc.clone(), vc.clone()
    out, got_lse = OPS.flash_attn_with_kvcache(q, kc, vc, k, v, seqlens, table, causal=True,
                                               return_softmax_lse=lse, cu_seqlens_q=cu)
    want = flywheel.flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=seqlens,
                                            block_table=table, causal=True,
                                            return_softmax_lse=lse, cu_seqlens_q=cu)
    same(kc, kc2)
    same(vc, vc2)
    assert not torch.equal(kc, kvcache_inputs(paged, packed)[1])  # k was appended
    same(out, want[0] if lse else want)
    if lse:
        same(got_lse, want[1])
        assert got_lse.shape == ((4, 3) if packed else (2, 4, 1))

    # the out variant, from fresh caches
    q, kc3, vc3, k, v, seqlens, table, cu = kvcache_inputs(paged, packed)
    buf = torch.zeros_like(out)
    lbuf = torch.empty(got_lse.shape) if lse else None
    OPS.flash_attn_with_kvcache_out(q, kc3, vc3, buf, lbuf, k, v, seqlens, table, causal=True,
                                    cu_seqlens_q=cu)
    same(buf, out)
    same(kc3, kc)
    same(vc3, vc)
    if lse:
        same(lbuf, got_lse)


def test_attention_ops_take_sinks():
    """sinks (Tensor? sinks=None in every attention op and out form; last but for the KV-cache
    ops' descales): the calls' bits, lse included, with the caches appended as by the call."""
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                 "flash_attn_backward", "flash_attn_varlen_backward", "flash_attn_func_out",
                 "flash_attn_varlen_func_out", "flash_attn_with_kvcache_out"):
        names = [a.name for a in getattr(OPS, name).default._schema.arguments]
        tail = names[-3:] if "kvcache" in name else names[-1:]
        assert tail == (["sinks", "k_descale", "v_descale"] if "kvcache" in name else ["sinks"]), name
        arg = getattr(OPS, name).default._schema.arguments[names.index("sinks")]
        assert (str(arg.type), arg.default_value) == ("Optional[Tensor]", None), name
    q, k, v = attn_inputs()
    out, lse = OPS.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True, sinks=sinks)
    want = flywheel.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True, sinks=sinks)
    same(out, want[0])
    same(lse, want[1])
    assert not torch.equal(out, OPS.flash_attn_func(q, k, v, causal=True)[0])
    buf, lbuf = torch.empty_like(out), torch.empty_like(lse)
    OPS.flash_attn_func_out(q, k, v, buf, lbuf, causal=True, sinks=sinks)
    same(buf, out)
    same(lbuf, lse)
    g = torch.randn(out.shape).to(out.dtype)
    for a, b in zip(OPS.flash_attn_backward(g, q, k, v, out, lse, causal=True, sinks=sinks),
                    flywheel.flash_attn_backward(g, q, k, v, out, lse, causal=True, sinks=sinks)):
        same(a, b)

    args = varlen_inputs()
    out, lse = OPS.flash_attn_varlen_func(*args, causal=True, return_softmax_lse=True,
                                          sinks=sinks.bfloat16())
    want = flywheel.flash_attn_varlen_func(*args, causal=True, return_softmax_lse=True,
                                           sinks=sinks.bfloat16())
    same(out, want[0])
    same(lse, want[1])
    buf = torch.empty_like(out)
    OPS.flash_attn_varlen_func_out(*args, buf, None, causal=True, sinks=sinks.bfloat16())
    same(buf, out)
    g = torch.randn(out.shape).to(out.dtype)
    for a, b in zip(OPS.flash_attn_varlen_backward(g, *args[:3], out, lse, *args[3:],
                                                   causal=True, sinks=sinks),
                    flywheel.flash_attn_varlen_backward(g, *args[:3], out, lse, *args[3:],
                                                        causal=True, sinks=sinks)):
        same(a, b)

    for paged, packed in ((False, False), (True, True)):
        q, kc, vc, k, v, seqlens, table, cu = kvcache_inputs(paged, packed)
        kc2, vc2 = kc.clone(), vc.clone()
        out, lse = OPS.flash_attn_with_kvcache(q, kc, vc, k, v, seqlens, table, causal=True,
                                               return_softmax_lse=True, cu_seqlens_q=cu,
                                               sinks=sinks)
        want = flywheel.flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=seqlens,
                                                block_table=table, causal=True,
                                                return_softmax_lse=True, cu_seqlens_q=cu,
                                                sinks=sinks)
        same(out, want[0])
        same(lse, want[1])
        same(kc, kc2)
        q, kc3, vc3, k, v, seqlens, table, cu = kvcache_inputs(paged, packed)
        buf = torch.empty_like(out)
        OPS.flash_attn_with_kvcache_out(q, kc3, vc3, buf, None, k, v, seqlens, table,
                                        causal=True, cu_seqlens_q=cu, sinks=sinks)
        same(buf, out)
        same(kc3, kc)


def test_flash_attn_with_kvcache_without_new_tokens_leaves_the_caches():
    q, kc, vc, _, _, seqlens, _, _ = kvcache_inputs()
    before = kc.clone(), vc.clone()
    out, _ = OPS.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    same(out, flywheel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens))
    same(kc, before[0])
    same(vc, before[1])


@pytest.mark.parametrize("name", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("final", [False, True])
def test_gdn_prefill(name, varlen, final):
    q, k, v, g, beta, h0, cu = gdn_inputs(B=1 if varlen else 2)
    if not varlen:
        cu = None
    op, call = getattr(OPS, name), getattr(flywheel, name)
    o, h = op(q, k, v, g, beta, 0.3, h0, final, True, cu_seqlens=cu)
    want_o, want_h = call(q, k, v, g, beta=beta, scale=0.3, initial_state=h0,
                          output_final_state=final, use_qk_l2norm_in_kernel=True,
                          cu_seqlens=cu)
    same(o, want_o)
    if final:
        same(h, want_h)
        assert h.shape == (2, 4, 16, 16) and h.dtype == torch.float32
    else:
        assert want_h is None and h.shape == (0,)
    buf = torch.zeros_like(o)
    hbuf = torch.zeros(2, 4, 16, 16) if final else None
    getattr(OPS, name + "_out")(q, k, v, g, beta, buf, hbuf, 0.3, h0, True, cu_seqlens=cu)
    same(buf, o)
    if final:
        same(hbuf, h)


def test_chunk_gated_delta_rule_gate_options():
    q, k, v, g, beta, h0, cu = gdn_inputs()
    A_log, dt_bias = torch.rand(4), torch.rand(4)
    opts = dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, use_gate_in_kernel=True,
                A_log=A_log, dt_bias=dt_bias, inverse="fwd_subst", precision="f32")
    o, h = OPS.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, True, cu_seqlens=cu, **opts)
    want_o, want_h = flywheel.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                     output_final_state=True, cu_seqlens=cu,
                                                     **opts)
    same(o, want_o)
    same(h, want_h)


@pytest.mark.parametrize("four_d", [False, True])
def test_gated_delta_rule_decode(four_d):
    q, k, v, g, beta, state, idx = decode_inputs()
    if four_d:
        q, k, v = q[:, None], k[:, None], v[:, None]
    s1, s2, s3 = state.clone(), state.clone(), state.clone()
    o = OPS.gated_delta_rule_decode(q, k, v, g, beta, s1, idx, 0.25, True)
    want = flywheel.gated_delta_rule_decode(q, k, v, g, beta, s2, idx, 0.25, True)
    same(o, want)
    same(s1, s2)
    assert not torch.equal(s1, state)
    same(s1[1], state[1])  # a slot nobody uses
    buf = torch.zeros_like(o)
    OPS.gated_delta_rule_decode_out(q, k, v, g, beta, s3, buf, idx, 0.25, True)
    same(buf, o)
    same(s3, s1)


def test_gated_delta_rule_verify_and_commit():
    q, k, v, g, beta, state, idx, cu = verify_inputs()
    o, replay = OPS.gated_delta_rule_verify(q, k, v, g, beta, state, idx, cu, None, True)
    want_o, want_replay = flywheel.gated_delta_rule_verify(q, k, v, g, beta, state, idx,
                                                           cu_seqlens=cu,
                                                           use_qk_l2norm_in_kernel=True)
    same(o, want_o)
    assert replay.dtype == torch.float32
    assert replay.shape == (fw_ops.gdn_replay_floats(6, 2, 4, 16, 16),)
    same(replay, torch.from_numpy(want_replay.buffer))

    buf, rbuf = torch.zeros_like(o), torch.zeros_like(replay)
    OPS.gated_delta_rule_verify_out(q, k, v, g, beta, state, buf, rbuf, idx, cu, None, True)
    same(buf, o)
    same(rbuf, replay)

    accepted = torch.tensor([1, 3], dtype=torch.int32)
    s1, s2 = state.clone(), state.clone()
    assert OPS.gated_delta_rule_commit(replay, accepted, s1, cu, 2, idx) is None
    flywheel.gated_delta_rule_commit(want_replay, accepted, s2)
    same(s1, s2)
    assert not torch.equal(s1, state)
    same(s1[1], state[1])  # the slot nobody uses


def test_verify_and_commit_batched_default_indices():
    """[B, T] inputs: commit takes the offsets arange(B + 1) * T and default slots."""
    q, k, v, g, beta, state, _, _ = verify_inputs()
    q, k, v, g, beta = (x.reshape(2, 3, *x.shape[2:]) for x in (q, k, v, g, beta))
    state = state[:2].clone()
    o, replay = OPS.gated_delta_rule_verify(q, k, v, g, beta, state)
    want_o, want_replay = flywheel.gated_delta_rule_verify(q, k, v, g, beta, state)
    same(o, want_o)
    cu = torch.arange(3, dtype=torch.int32) * 3
    s1, s2 = state.clone(), state.clone()
    OPS.gated_delta_rule_commit(replay, torch.tensor([3, 2]), s1, cu, 2)
    flywheel.gated_delta_rule_commit(want_replay, [3, 2], s2)
    same(s1, s2)


def test_errors_are_the_calls_errors():
    q, k, v = attn_inputs()
    with pytest.raises(ValueError, match="window_size|shape|FW_ERR"):
        OPS.flash_attn_func(q, k[:, :, :, :16], v)
    qd, kd, vd, g, beta, state, idx = decode_inputs()
    with pytest.raises(TypeError, match="float32"):
        OPS.gated_delta_rule_decode(qd, kd, vd, g, beta, state.double(), idx)


def test_forward_only_backward_raises():
    """Inputs that require grad run forward (in the op's autograd.Function, grad is off, so the
    Python call's requires-grad check does not fire); a backward through a forward-only op
    raises. flash_attn_func has a backward (test_attention_bwd.py)."""
    q, k, v = (x.float().requires_grad_() for x in attn_inputs())
    out, _ = OPS.flash_attn_func(q, k, v)
    same(out.detach(), flywheel.flash_attn_func(q.detach(), k.detach(), v.detach()))
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    gq, gk, gv, gg, gb, _, _ = gdn_inputs(torch.float32)
    o, _ = OPS.chunk_gated_delta_rule(gq, gk, gv.requires_grad_(), gg, gb)
    with pytest.raises(NotImplementedError, match="forward-only"):
        o.sum().backward()
    # ops that write in place get torch's own error (no formula can be registered for them)
    dq, dk, dv, dg, db, state, idx = decode_inputs(torch.float32)
    o = OPS.gated_delta_rule_decode(dq.requires_grad_(), dk, dv, dg, db, state, idx)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        o.sum().backward()
    with torch.no_grad():
        out, _ = OPS.flash_attn_func(q, k, v)
    assert not out.requires_grad


def conv_inputs():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 10, 16, generator=g).transpose(1, 2)        # [2, 16, 10] channel-last
    return (x, torch.randn(16, 4, generator=g), torch.randn(16, generator=g),
            torch.randn(2, 16, 3, generator=g))


def layer_inputs():
    """1 q/k head, 2 value heads, dims 8, width 3: a decode (seq_len 5) and a new 6-token
    prefill, then 2 padding rows; 4 slots."""
    g = torch.Generator().manual_seed(12)
    T, dim = 9, 2 * 8 + 2 * 8
    return (torch.randn(T, dim, generator=g), torch.randn(T, 2, generator=g),
            torch.randn(T, 2, generator=g), torch.randn(4, 2, dim, generator=g),
            torch.randn(4, 2, 8, 8, generator=g) * 0.1, torch.randn(dim, 1, 3, generator=g),
            None, torch.rand(2, generator=g), torch.randn(2, generator=g),
            torch.tensor([0, 1, 7], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
            torch.tensor([1, 2, 2], dtype=torch.int32), torch.tensor([5, 6], dtype=torch.int32),
            torch.tensor([3, 2], dtype=torch.int32), 1, 2, 8, 8, 3)


def test_conv_and_layer_ops_give_the_calls_bits():
    x, w, b, h0 = conv_inputs()
    want = flywheel.causal_conv1d_fn(x, w, b, initial_states=h0, activation="silu")
    assert torch.equal(OPS.causal_conv1d_fn(x, w, b, h0, "silu"), want)
    s1, s2 = torch.randn(4, 16, 3), None
    s2 = s1.clone()
    idx = torch.tensor([3, 1], dtype=torch.int32)
    xt = x[:, :, 0].contiguous()
    assert torch.equal(OPS.causal_conv1d_update(xt, s1, w, b, "silu", None, idx),
                       flywheel.causal_conv1d_update(xt, s2, w, b, "silu",
                                                     conv_state_indices=idx))
    assert torch.equal(s1, s2)
    args = layer_inputs()
    c1, r1 = args[3].clone(), args[4].clone()
    c2, r2 = args[3].clone(), args[4].clone()
    o1 = OPS.fused_conv1d_gdn(*args[:3], c1, r1, *args[5:])
    (_, _), o2 = flywheel.fused_conv1d_gdn(*args[:3], c2, r2, *args[5:14], n_kq=1, n_v=2,
                                            d_k=8, d_v=8, kernel_size=3)
    assert torch.equal(o1, o2) and torch.equal(c1, c2) and torch.equal(r1, r2)


# ------------------------------------------------------------------------------------ opcheck

def _opcheck_cases():
    q, k, v = attn_inputs()
    vl = varlen_inputs()
    kq, kc, vc, kk, kv, seqlens, _, _ = kvcache_inputs()
    pq, pkc, pvc, pk, pv, pseq, table, cu_q = kvcache_inputs(paged=True, packed=True)
    gq, gk, gv, gg, gb, h0, cu = gdn_inputs()
    dq, dk, dv, dg, db, state, idx = decode_inputs()
    vq, vk, vv, vg, vb, vstate, vidx, vcu = verify_inputs()
    _, replay = OPS.gated_delta_rule_verify(vq, vk, vv, vg, vb, vstate, vidx, vcu)
    cx, cw, cb, ch0 = conv_inputs()
    la = layer_inputs()
    kg = -0.1 * torch.rand(1, 10, 4, 16, generator=torch.Generator().manual_seed(4))  # KDA's g
    floats = replay.shape[0]
    mq, mkc, mtable, mseq, mnew = mla_inputs()
    return [
        ("flash_attn_func", (q, k, v), dict(causal=True, return_softmax_lse=True)),
        ("flash_attn_func", (q, k, v), dict(window_size_left=2, softcap=5.0)),
        ("flash_attn_func", (q, k, v), dict(causal=True, return_softmax_lse=True,
                                            sinks=torch.randn(4))),
        ("flash_attn_func_out", (q, k, v, torch.empty(2, 5, 4, 16, dtype=q.dtype),
                                 torch.empty(2, 4, 5)), dict(causal=True)),
        ("flash_attn_varlen_func", vl, dict(causal=True, return_softmax_lse=True)),
        ("flash_attn_varlen_func", vl, dict(sinks=torch.randn(4).bfloat16())),
        ("flash_attn_backward", (torch.randn(2, 5, 4, 16).to(q.dtype), q, k, v)
         + tuple(OPS.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)),
         dict(causal=True)),
        ("flash_attn_backward", (torch.randn(2, 5, 4, 16).to(q.dtype), q, k, v)
         + tuple(OPS.flash_attn_func(q, k, v, return_softmax_lse=True, sinks=torch.ones(4))),
         dict(sinks=torch.ones(4))),
        ("flash_attn_varlen_backward", (torch.randn(8, 4, 16).to(q.dtype),) + vl[:3]
         + tuple(OPS.flash_attn_varlen_func(*vl, return_softmax_lse=True)) + vl[3:], {}),
        ("flash_attn_varlen_func_out", vl + (torch.empty(8, 4, 16, dtype=q.dtype), None), {}),
        ("flash_attn_with_kvcache", (kq, kc, vc, kk, kv, seqlens),
         dict(causal=True, return_softmax_lse=True)),
        ("flash_attn_with_kvcache", (kq, kc, vc, kk, kv, seqlens),
         dict(causal=True, rotary_cos=torch.rand(64, 8), rotary_sin=torch.rand(64, 8),
              rotary_interleaved=False)),
        ("flash_attn_with_kvcache", (pq, pkc, pvc, pk, pv, pseq, table),
         dict(causal=True, cu_seqlens_q=cu_q)),
        ("flash_attn_with_kvcache", (kq, kc, vc, kk, kv, seqlens),
         dict(causal=True, sinks=torch.randn(4))),
        ("flash_attn_with_kvcache_out",
         (kq, kc, vc, torch.empty(2, 1, 4, 32, dtype=q.dtype), None, kk, kv, seqlens),
         dict(sinks=torch.randn(4))),
        ("flash_attn_with_kvcache_out",
         (kq, kc, vc, torch.empty(2, 1, 4, 32, dtype=q.dtype), torch.empty(2, 4, 1), kk, kv,
          seqlens), dict(causal=True)),
        ("chunk_gated_delta_rule", (gq, gk, gv, gg, gb),
         dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)),
        ("chunk_gated_delta_rule", (gq, gk, gv, gg, gb), dict(use_qk_l2norm_in_kernel=True)),
        ("chunk_gated_delta_rule_out",
         (gq, gk, gv, gg, gb, torch.empty_like(gv), torch.empty(2, 4, 16, 16)),
         dict(cu_seqlens=cu)),
        ("fused_recurrent_gated_delta_rule", (gq, gk, gv, gg, gb),
         dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)),
        ("fused_recurrent_gated_delta_rule_out", (gq, gk, gv, gg, gb, torch.empty_like(gv)),
         {}),
        ("gated_delta_rule_decode", (dq, dk, dv, dg, db, state, idx), {}),
        ("gated_delta_rule_decode_out", (dq, dk, dv, dg, db, state, torch.empty_like(dv), idx),
         {}),
        ("gated_delta_rule_verify", (vq, vk, vv, vg, vb, vstate, vidx, vcu), {}),
        ("gated_delta_rule_verify_out",
         (vq, vk, vv, vg, vb, vstate, torch.empty_like(vv), torch.empty(floats), vidx, vcu),
         {}),
        ("gated_delta_rule_commit",
         (replay, torch.tensor([1, 3], dtype=torch.int32), vstate.clone(), vcu, 2, vidx), {}),
        ("causal_conv1d_fn", (cx, cw, cb, ch0), dict(activation="silu")),
        ("causal_conv1d_fn_out", (cx, cw, torch.empty_like(cx), cb), {}),
        ("causal_conv1d_update", (cx[:, :, 0].contiguous(), torch.randn(4, 16, 3), cw, cb),
         dict(activation="silu", conv_state_indices=torch.tensor([3, 1], dtype=torch.int32))),
        ("causal_conv1d_update_out", (cx[:, :, 0].contiguous(), torch.randn(2, 16, 3), cw,
                                      torch.empty(2, 16), cb), {}),
        ("fused_conv1d_gdn", la, {}),
        ("fused_conv1d_gdn_out", la[:14] + (torch.empty(9, 16),) + la[14:], {}),
        ("chunk_kda", (gq, gk, gv, kg, gb),
         dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)),
        ("chunk_kda", (gq, gk, gv, torch.randn_like(kg), gb),
         dict(use_gate_in_kernel=True, A_log=torch.zeros(4), use_qk_l2norm_in_kernel=True)),
        ("fused_conv1d_kda", la[:2] + (torch.randn(9, 16),) + la[3:8] + (torch.randn(16),) + la[9:],
         dict(lower_bound=-5.0)),
        ("flash_mla_with_kvcache", (mq, mkc, mtable, mseq, 32), dict(causal=True)),
        ("flash_mla_with_kvcache", (mq, mkc, mtable, mseq, 32),
         dict(causal=True, k_new=mnew, softmax_scale=0.2)),
        ("flash_mla_with_kvcache_out", (mq, mkc, mtable, mseq, 32, torch.empty(2, 2, 4, 32,
                                        dtype=mq.dtype), torch.empty(2, 4, 2)), {}),
    ]


_CASES = _opcheck_cases()


@pytest.mark.parametrize("case", range(len(_CASES)),
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(_CASES)])
def test_opcheck(case):
    name, args, kwargs = _CASES[case]
    args = tuple(clones(args))
    kwargs = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in kwargs.items()}
    torch.library.opcheck(getattr(OPS, name).default, args, kwargs)


def test_every_op_is_opchecked():
    assert {c[0] for c in _CASES} == set(fw_ops.OPS)


# ------------------------------------------------------------------------------ torch.compile

def _decode_step(q, k_new, v_new, k_cache, v_cache, seqlens, qg, kg, vg, g, beta, state):
    """One engine step: append to the KV cache and attend, and update the GDN state."""
    out, _ = torch.ops.flywheel.flash_attn_with_kvcache(q * 0.5, k_cache, v_cache, k_new,
                                                        v_new, seqlens, causal=True)
    o = torch.ops.flywheel.gated_delta_rule_decode(qg, kg, vg, g.float() * 2.0, beta, state)
    return out.float().sum(dim=-1), o + 1.0


def _step_inputs(step):
    gen = torch.Generator().manual_seed(10 + step)
    q = rnd(gen, 2, 1, 4, 32, dtype=torch.bfloat16)
    k, v = rnd(gen, 2, 1, 2, 32, dtype=torch.bfloat16), rnd(gen, 2, 1, 2, 32,
                                                              dtype=torch.bfloat16)
    seqlens = torch.tensor([5 + step, 9 + step], dtype=torch.int32)
    dq, dk, dv, g, beta, _, _ = decode_inputs()
    return q, k, v, seqlens, dq[:2], dk[:2], dv[:2], -0.05 * torch.rand(2, 4, generator=gen), \
        beta[:2]


def _run_steps(fn):
    _, kc, vc, _, _, _, _, _ = kvcache_inputs()
    state = decode_inputs()[5][:2].clone()
    results = []
    for step in range(2):
        q, k, v, seqlens, qg, kg, vg, g, beta = _step_inputs(step)
        results.append(fn(q, k, v, kc, vc, seqlens, qg, kg, vg, g, beta, state))
    return results, kc, vc, state


def _check_compiled(compiled):
    want, kc, vc, state = _run_steps(_decode_step)
    got, kc2, vc2, state2 = _run_steps(compiled)
    for (a, b), (c, d) in zip(got, want):
        same(a, c)
        same(b, d)
    same(kc2, kc)
    same(vc2, vc)
    same(state2, state)


def test_compile_decode_step_aot_eager():
    torch._dynamo.reset()
    _check_compiled(torch.compile(_decode_step, fullgraph=True, backend="aot_eager"))


def _decode_step_out(q, k_new, v_new, k_cache, v_cache, seqlens, qg, kg, vg, g, beta, state):
    """_decode_step with the engine's own buffers (the out variants)."""
    out = q.new_empty(q.shape)
    o = vg.new_empty(vg.shape)
    torch.ops.flywheel.flash_attn_with_kvcache_out(q * 0.5, k_cache, v_cache, out, None, k_new,
                                                   v_new, seqlens, causal=True)
    torch.ops.flywheel.gated_delta_rule_decode_out(qg, kg, vg, g.float() * 2.0, beta, state, o)
    return out.float().sum(dim=-1), o + 1.0


def test_compile_decode_step_out_variants_aot_eager():
    torch._dynamo.reset()
    compiled = torch.compile(_decode_step_out, fullgraph=True, backend="aot_eager")
    want, kc, vc, state = _run_steps(_decode_step)
    got, kc2, vc2, state2 = _run_steps(compiled)
    for (a, b), (c, d) in zip(got, want):
        same(a, c)
        same(b, d)
    same(kc2, kc)
    same(vc2, vc)
    same(state2, state)


def _has_cxx():
    return any(shutil.which(c) for c in (os.environ.get("CXX") or "c++", "g++", "clang++"))


@pytest.mark.skipif(not _has_cxx(), reason="inductor's CPU backend needs a C++ compiler")
def test_compile_decode_step_inductor():
    """The default backend (inductor: C++ codegen, about 30 s on a 2-core machine with a cold
    cache) keeps the ops and the in-place updates."""
    torch._dynamo.reset()
    _check_compiled(torch.compile(_decode_step, fullgraph=True))
