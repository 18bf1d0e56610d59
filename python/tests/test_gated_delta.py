"""chunk_gated_delta_rule / fused_recurrent_gated_delta_rule / decode / verify + commit against
a float64 numpy recurrence, fla's torch reference, and bad input; bf16 products against the
bar set by their same-roundings float64 reference (ref_gdn_bf16)."""

import ml_dtypes
import numpy as np
import pytest

import flywheel
from flywheel import FlywheelError
from conftest import FAMILIES, as64, make, read_only, ref_gdn, ref_gdn_bf16, round_to, torch

try:
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
except Exception:  # fla not installed, or it fails to import on this machine
    naive_recurrent_gated_delta_rule = None

# max |error| against the float64 recurrence: outputs are O(1); bf16 output rounding dominates
GTOL = {"float32": 2e-4, "bfloat16": 2e-2}


def bf16_bars(plain, same_roundings, out_dtype):
    """The bars of bf16 products for (output, final state) against the plain float64
    recurrence: 2 x the same-roundings reference's error against it (its output rounded to
    out_dtype first) + 1e-5. plain and same_roundings are (o, h) pairs."""
    (ro, rh), (so, sh) = plain, same_roundings
    return (2 * np.abs(round_to(so, out_dtype) - ro).max(initial=0) + 1e-5,
            2 * np.abs(sh - rh).max() + 1e-5)


def inputs(rng, B, Tn, H, HV, K, V, dtype, family):
    q, q64 = make(rng, (B, Tn, H, K), dtype, family)
    k, k64 = make(rng, (B, Tn, H, K), dtype, family)
    v, v64 = make(rng, (B, Tn, HV, V), dtype, family)
    g64 = -np.abs(rng.standard_normal((B, Tn, HV))) * 0.3
    b64 = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, Tn, HV))))
    g, beta = g64.astype(np.float32), b64.astype(np.float32)
    if family == "torch":
        g, beta = torch.from_numpy(g), torch.from_numpy(beta)
    return (q, k, v, g, beta), (q64, k64, v64, g.astype(np.float64) if family == "numpy"
                                else g64.astype(np.float32).astype(np.float64),
                                as64(beta))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("Tn", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4), (1, 3)])
@pytest.mark.parametrize("fn", ["chunk", "fused"])
def test_prefill_matches_reference(family, dtype, Tn, heads, fn):
    H, HV = heads
    K, V = 32, 48
    rng = np.random.default_rng(Tn * 7 + HV)
    (q, k, v, g, beta), (q64, k64, v64, g64, b64) = inputs(rng, 2, Tn, H, HV, K, V, dtype,
                                                         family)
    h0 = rng.standard_normal((2, HV, K, V)).astype(np.float32) * 0.1
    kw = dict(g=g, beta=beta, initial_state=h0, output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    if fn == "chunk":
        f = flywheel.chunk_gated_delta_rule
        kw["precision"] = "f32"  # bf16 inputs may default to bf16 products: checked below
    else:
        f = flywheel.fused_recurrent_gated_delta_rule
    o, ht = f(q, k, v, **kw)
    assert tuple(o.shape) == (2, Tn, HV, V) and o.dtype == v.dtype
    assert tuple(ht.shape) == (2, HV, K, V) and str(ht.dtype).endswith("float32")
    bf16_default = fn == "chunk" and dtype == "bfloat16"
    if bf16_default:
        del kw["precision"]
        ob, hb = f(q, k, v, **kw)
    for i in range(2):
        args = (q64[i], k64[i], v64[i], g64[i], b64[i], K ** -0.5, h0[i], True)
        ro, rh = ref_gdn(*args)
        assert np.abs(as64(o)[i] - ro).max() <= GTOL[dtype]
        assert np.abs(as64(ht)[i] - rh).max() <= 1e-3
        if bf16_default:
            bar_o, bar_h = bf16_bars((ro, rh), ref_gdn_bf16(*args), dtype)
            assert np.abs(as64(ob)[i] - ro).max() <= bar_o
            assert np.abs(as64(hb)[i] - rh).max() <= bar_h


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("Tn", [1, 64, 150])
@pytest.mark.parametrize("l2norm", [True, False])
def test_bf16_products_on_float32_inputs(family, Tn, l2norm):
    H, HV, K, V = 2, 4, 32, 48
    rng = np.random.default_rng(Tn * 5 + l2norm)
    (q, k, v, g, beta), (q64, k64, v64, g64, b64) = inputs(rng, 2, Tn, H, HV, K, V, "float32",
                                                         family)
    if not l2norm:  # keys of norm ~1 keep the recurrence stable
        q, k = q * K ** -0.5, k * K ** -0.5
        q64, k64 = as64(q), as64(k)
    h0 = rng.standard_normal((2, HV, K, V)).astype(np.float32) * 0.1
    kw = dict(scale=0.2, initial_state=h0, output_final_state=True,
              use_qk_l2norm_in_kernel=l2norm)
    o, ht = flywheel.chunk_gated_delta_rule(q, k, v, g, beta, precision="bf16", **kw)
    o32, _ = flywheel.chunk_gated_delta_rule(q, k, v, g, beta, precision="f32", **kw)
    assert o.dtype == q.dtype
    assert not np.array_equal(as64(o), as64(o32))  # the products were rounded
    for i in range(2):
        args = (q64[i], k64[i], v64[i], g64[i], b64[i], 0.2, h0[i], l2norm)
        ro, rh = ref_gdn(*args)
        bar_o, bar_h = bf16_bars((ro, rh), ref_gdn_bf16(*args), "float32")
        assert np.abs(as64(o)[i] - ro).max() <= bar_o
        assert np.abs(as64(ht)[i] - rh).max() <= bar_h


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_precision_auto_follows_the_dtype_of_q(dtype):
    """The default is bf16 products for bf16 inputs on a table with a native bf16 dot product
    (AMX and AArch64's BFMMLA and BFDOT anywhere; vdpbf16ps on AMD only, which runs it at
    twice its FMA rate, Intel at half), f32 products otherwise: bit for bit what
    auto_precision names."""
    same = flywheel.auto_precision(dtype)
    # avx512bf16's answer depends on the CPU's vendor (tests/test_attn.c checks that rule)
    isa = flywheel.default_isa()
    native = isa in ("amx", "neon_bf16") or (
        isa == "avx512bf16" and flywheel.auto_precision("bfloat16", "avx512bf16") == "bf16")
    assert same == ("bf16" if dtype == "bfloat16" and native else "f32")
    assert flywheel.auto_precision(dtype, "avx2") == "f32"  # emulated pairs: f32 is faster
    assert flywheel.auto_precision(dtype, "portable") == "f32"
    rng = np.random.default_rng(20)
    (q, k, v, g, beta), _ = inputs(rng, 1, 100, 2, 4, 32, 32, dtype, "numpy")
    state = (rng.standard_normal((1, 4, 32, 32)) * 0.1).astype(np.float32)
    want, want_h = flywheel.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                   output_final_state=True, precision=same)
    for precision in (None, "auto"):
        o, ht = flywheel.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                output_final_state=True, precision=precision)
        assert np.array_equal(as64(o), as64(want)) and np.array_equal(ht, want_h)
    want_v, _ = flywheel.gated_delta_rule_verify(q[:, :40], k[:, :40], v[:, :40], g[:, :40],
                                                 beta[:, :40], state, precision=same)
    o, _ = flywheel.gated_delta_rule_verify(q[:, :40], k[:, :40], v[:, :40], g[:, :40],
                                            beta[:, :40], state)
    assert np.array_equal(as64(o), as64(want_v))


@pytest.mark.parametrize("bad", ["fp8", 3])
def test_bad_precision_is_refused(bad):
    rng = np.random.default_rng(21)
    (q, k, v, g, beta), _ = inputs(rng, 1, 8, 2, 4, 16, 16, "float32", "numpy")
    with pytest.raises(ValueError, match="precision"):
        flywheel.chunk_gated_delta_rule(q, k, v, g, beta, precision=bad)
    state = np.zeros((1, 4, 16, 16), np.float32)
    with pytest.raises(ValueError, match="precision"):
        flywheel.gated_delta_rule_verify(q, k, v, g, beta, state, precision=bad)


@pytest.mark.parametrize("family", FAMILIES)
def test_varlen_with_empty_sequences(family):
    rng = np.random.default_rng(11)
    lens = [70, 0, 5, 130]
    cu = np.cumsum([0] + lens)
    (q, k, v, g, beta), (q64, k64, v64, g64, b64) = inputs(rng, 1, cu[-1], 2, 4, 64, 64,
                                                         "float32", family)
    h0 = rng.standard_normal((4, 4, 64, 64)).astype(np.float32) * 0.1
    o, ht = flywheel.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.2, initial_state=h0,
                                            output_final_state=True, cu_seqlens=cu,
                                            use_qk_l2norm_in_kernel=True)
    for i in range(4):
        s = slice(cu[i], cu[i + 1])
        ro, rh = ref_gdn(q64[0, s], k64[0, s], v64[0, s], g64[0, s], b64[0, s], 0.2, h0[i],
                         True)
        assert np.abs(as64(o)[0, s] - ro).max(initial=0) <= 5e-4
        assert np.abs(as64(ht)[i] - rh).max() <= 1e-3


def test_gate_and_beta_activations_like_fla():
    rng = np.random.default_rng(12)
    (q, k, v, g, beta), _ = inputs(rng, 1, 40, 2, 2, 32, 32, "float32", "numpy")
    raw_g, raw_b = rng.standard_normal((1, 40, 2)).astype(np.float32), \
        rng.standard_normal((1, 40, 2)).astype(np.float32)
    A_log, dt_bias = np.array([0.1, -0.5], np.float32), np.array([0.3, 0.0], np.float32)
    o1, _ = flywheel.chunk_gated_delta_rule(q, k, v, raw_g, raw_b, use_gate_in_kernel=True,
                                            A_log=A_log, dt_bias=dt_bias,
                                            use_beta_sigmoid_in_kernel=True)
    gg = (-np.exp(A_log) * np.log1p(np.exp(raw_g + dt_bias))).astype(np.float32)
    bb = (1 / (1 + np.exp(-raw_b))).astype(np.float32)
    o2, _ = flywheel.chunk_gated_delta_rule(q, k, v, gg, bb)
    assert np.abs(o1 - o2).max() <= 1e-5


@pytest.mark.skipif(naive_recurrent_gated_delta_rule is None, reason="fla is not installed")
def test_against_fla_torch_reference():
    rng = np.random.default_rng(13)
    (q, k, v, g, beta), _ = inputs(rng, 2, 100, 4, 4, 64, 64, "float32", "torch")
    k = torch.nn.functional.normalize(k, dim=-1)  # the naive reference has no l2norm option
    h0 = torch.randn(2, 4, 64, 64) * 0.1
    want, want_h = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0,
                                                    output_final_state=True)
    for f in (flywheel.chunk_gated_delta_rule, flywheel.fused_recurrent_gated_delta_rule):
        o, ht = f(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True)
        assert (o - want).abs().max().item() <= 1e-3
        assert (ht - want_h).abs().max().item() <= 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_equal_the_recurrence(family):
    rng = np.random.default_rng(14)
    (q, k, v, g, beta), _ = inputs(rng, 3, 6, 2, 4, 32, 32, "float32", family)
    h0 = (rng.standard_normal((3, 4, 32, 32)) * 0.1).astype(np.float32)
    want, want_h = flywheel.fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True)
    slots = np.zeros((5, 4, 32, 32), np.float32)
    idx = np.array([4, 0, 2], np.int32)
    slots[idx] = h0
    if family == "torch":
        slots = torch.from_numpy(slots)
    for t in range(6):
        o = flywheel.gated_delta_rule_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t],
                                             slots, idx)
        assert np.abs(as64(o) - as64(want)[:, t]).max() <= 1e-5
    assert np.abs(as64(slots)[idx] - as64(want_h)).max() <= 1e-5


@pytest.mark.parametrize("call", ["chunk", "fused_recurrent", "decode"])
def test_l2norm_eps_is_used(call):
    """l2norm_eps=0.5 against the recurrence with that epsilon, far from the default's."""
    rng = np.random.default_rng(21)
    Tn, H, HV, K, V = 5, 2, 4, 16, 16
    q = (rng.standard_normal((1, Tn, H, K)) * 0.3).astype(np.float32)
    k = (rng.standard_normal((1, Tn, H, K)) * 0.3).astype(np.float32)
    v = rng.standard_normal((1, Tn, HV, V)).astype(np.float32)
    g = (-0.2 * rng.random((1, Tn, HV))).astype(np.float32)
    beta = rng.random((1, Tn, HV)).astype(np.float32)
    scale = K ** -0.5
    want, _ = ref_gdn(*(x[0].astype(np.float64) for x in (q, k, v, g, beta)), scale,
                      l2norm=True, eps=0.5)
    default, _ = ref_gdn(*(x[0].astype(np.float64) for x in (q, k, v, g, beta)), scale,
                         l2norm=True)
    if call == "decode":
        state = np.zeros((1, HV, K, V), np.float32)
        got = np.stack([flywheel.gated_delta_rule_decode(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state,
            use_qk_l2norm_in_kernel=True, l2norm_eps=0.5) for t in range(Tn)], 1)[0]
    else:
        fn = (flywheel.chunk_gated_delta_rule if call == "chunk"
              else flywheel.fused_recurrent_gated_delta_rule)
        got = fn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, l2norm_eps=0.5)[0][0]
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(want - default).max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_on_a_padded_pool(family):
    """A pool with padded slots, read and write slots apart, a zero start and a sequence not
    kept: the bits of the dense calls on gathered states; other slots untouched."""
    rng = np.random.default_rng(31)
    H, HV, K, V, pad = 2, 4, 16, 16, 40
    lens = [9, 1, 5]
    Tn = sum(lens)
    cu = np.array([0, 9, 10, 15], np.int32)
    q, k = (rng.standard_normal((1, Tn, H, K)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, Tn, HV, V)).astype(np.float32)
    g = (-0.3 * rng.random((1, Tn, HV))).astype(np.float32)
    beta = rng.random((1, Tn, HV)).astype(np.float32)
    raw = rng.standard_normal((6, HV * K * V + pad)).astype(np.float32)
    before = raw.copy()
    pool = np.lib.stride_tricks.as_strided(raw, (6, HV, K, V), (raw.strides[0], K * V * 4, V * 4, 4))
    rd, wr = np.array([4, -1, 1], np.int32), np.array([0, 3, -1], np.int32)
    init = np.stack([pool[r] if r >= 0 else np.zeros((HV, K, V), np.float32) for r in rd])
    want_o, want_h = flywheel.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init,
                                                     output_final_state=True, cu_seqlens=cu,
                                                     use_qk_l2norm_in_kernel=True)
    if family == "torch":
        raw_t = torch.from_numpy(raw)
        pool_arg = raw_t[:, :HV * K * V].view(6, HV, K, V)
    else:
        pool_arg = pool
    o = flywheel.gated_delta_rule_prefill(q, k, v, g, beta, pool_arg, wr, cu_seqlens=cu,
                                          read_state_indices=rd, use_qk_l2norm_in_kernel=True)
    assert np.array_equal(as64(o), as64(want_o))
    assert np.array_equal(raw[0, :HV * K * V].reshape(HV, K, V), want_h[0])
    assert np.array_equal(raw[3, :HV * K * V].reshape(HV, K, V), want_h[1])
    for s_ in (1, 2, 4, 5):
        assert np.array_equal(raw[s_], before[s_])
    assert np.array_equal(raw[:, HV * K * V:], before[:, HV * K * V:])
    # decode: the first token of each sequence, slots as above, against the dense decode
    raw[:] = before
    dense = init.copy()
    want = flywheel.gated_delta_rule_decode(q[0, :3], k[0, :3], v[0, :3], g[0, :3], beta[0, :3],
                                            dense, np.arange(3, dtype=np.int32))
    got = flywheel.gated_delta_rule_decode(q[0, :3], k[0, :3], v[0, :3], g[0, :3], beta[0, :3],
                                           pool_arg, wr, read_state_indices=rd)
    assert np.array_equal(as64(got), as64(want))
    assert np.array_equal(raw[0, :HV * K * V].reshape(HV, K, V), dense[0])
    assert np.array_equal(raw[3, :HV * K * V].reshape(HV, K, V), dense[1])
    for s_ in (1, 2, 4, 5):
        assert np.array_equal(raw[s_], before[s_])


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_state_pools_follow_the_f32_pool(family):
    """A bf16 pool (vLLM's default state cache for a bf16 model), padded, read and write slots
    apart: prefill and decode give the bits of the same call on an f32 pool holding the same
    values, each written state rounded to bf16 once (nearest even); other slots and the
    padding untouched. An f16 pool is refused with nothing written."""
    rng = np.random.default_rng(32)
    H, HV, K, V, pad = 2, 4, 16, 16, 40
    cu = np.array([0, 70, 71, 90], np.int32)
    Tn = int(cu[-1])
    q, k = (rng.standard_normal((1, Tn, H, K)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, Tn, HV, V)).astype(np.float32)
    g = (-0.3 * rng.random((1, Tn, HV))).astype(np.float32)
    beta = rng.random((1, Tn, HV)).astype(np.float32)
    raw16 = (rng.standard_normal((6, HV * K * V + pad)) * 0.3).astype(ml_dtypes.bfloat16)
    rd, wr = np.array([4, -1, 1], np.int32), np.array([0, 3, -1], np.int32)
    for call in ("prefill", "decode"):
        raw32, raw = raw16.astype(np.float32), raw16.copy()
        if family == "torch":
            raw_t = torch.from_numpy(raw.view(np.uint16).view(np.int16)).view(torch.bfloat16)
            p16 = raw_t[:, :HV * K * V].view(6, HV, K, V)
        else:
            p16 = np.lib.stride_tricks.as_strided(raw, (6, HV, K, V),
                                                  (raw.strides[0], K * V * 2, V * 2, 2))
        p32 = np.lib.stride_tricks.as_strided(raw32, (6, HV, K, V),
                                              (raw32.strides[0], K * V * 4, V * 4, 4))
        if call == "prefill":
            args = (q, k, v, g, beta)
            fn = lambda p: flywheel.gated_delta_rule_prefill(  # noqa: E731
                *args, p, wr, cu_seqlens=cu, read_state_indices=rd, use_qk_l2norm_in_kernel=True)
        else:
            args = (q[0, :3], k[0, :3], v[0, :3], g[0, :3], beta[0, :3])
            fn = lambda p: flywheel.gated_delta_rule_decode(  # noqa: E731
                *args, p, wr, read_state_indices=rd, use_qk_l2norm_in_kernel=True)
        o32, o16 = fn(p32), fn(p16)
        assert np.array_equal(as64(o16), as64(o32))
        want = raw16.copy()
        for s_ in (0, 3):
            want[s_, :HV * K * V] = raw32[s_, :HV * K * V].astype(ml_dtypes.bfloat16)
        assert np.array_equal(raw.view(np.uint16), want.view(np.uint16))
    half = np.ones((6, HV, K, V), np.float16)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        flywheel.gated_delta_rule_decode(q[0, :3], k[0, :3], v[0, :3], g[0, :3], beta[0, :3],
                                         half, wr, read_state_indices=rd)
    assert (half == 1).all()


def test_pool_refuses_a_slot_read_by_one_and_written_by_another():
    q = np.zeros((2, 1, 4), np.float32)
    v = np.zeros((2, 1, 4), np.float32)
    g = np.zeros((2, 1), np.float32)
    state = np.ones((3, 1, 4, 4), np.float32)
    with pytest.raises(FlywheelError, match="reads state slot 1"):
        flywheel.gated_delta_rule_decode(q, q, v, g, g, state, [1, 2], read_state_indices=[0, 1])
    assert (state == 1).all()


@pytest.mark.parametrize("call", ["decode", "verify"])
def test_gates_computed_inside_the_kernel(call):
    """Qwen3-Next's gates from raw a, b inside decode and verify: the outputs of the same
    gates computed before the call."""
    rng = np.random.default_rng(41)
    N, H, HV, K, V = 3, 2, 4, 16, 16
    q, k = (rng.standard_normal((N, H, K)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((N, HV, V)).astype(np.float32)
    a, b = (rng.standard_normal((N, HV)).astype(np.float32) * 2 for _ in range(2))
    A_log = (rng.standard_normal(HV) * 0.5).astype(np.float32)
    dt_bias = (rng.standard_normal(HV) * 0.5).astype(np.float32)
    x = a.astype(np.float64) + dt_bias
    g = (-np.exp(A_log.astype(np.float64)) * np.log1p(np.exp(x))).astype(np.float32)
    beta = (1 / (1 + np.exp(-b.astype(np.float64)))).astype(np.float32)
    s1 = (rng.standard_normal((4, HV, K, V)) * 0.1).astype(np.float32)
    s2 = s1.copy()
    idx = np.array([3, 0, 1], np.int32)
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              use_beta_sigmoid_in_kernel=True)
    if call == "decode":
        want = flywheel.gated_delta_rule_decode(q, k, v, g, beta, s1, idx,
                                                use_qk_l2norm_in_kernel=True)
        got = flywheel.gated_delta_rule_decode(q, k, v, a, b, s2, idx,
                                               use_qk_l2norm_in_kernel=True, **kw)
        assert np.abs(s1 - s2).max() <= 1e-5
    else:
        cu = np.array([0, 1, 3], np.int32)
        want, _ = flywheel.gated_delta_rule_verify(q[None, :], k[None, :], v[None, :], g[None],
                                                   beta[None], s1, idx[:2], cu,
                                                   use_qk_l2norm_in_kernel=True)
        got, _ = flywheel.gated_delta_rule_verify(q[None, :], k[None, :], v[None, :], a[None],
                                                  b[None], s2, idx[:2], cu,
                                                  use_qk_l2norm_in_kernel=True, **kw)
    assert np.abs(as64(got) - as64(want)).max() <= 1e-5
    with pytest.raises(ValueError, match="A_log"):
        flywheel.gated_delta_rule_decode(q, k, v, a, b, s2, idx, use_gate_in_kernel=True)


def test_bad_l2norm_eps_is_refused():
    q = np.zeros((1, 2, 1, 4), np.float32)
    v = np.zeros((1, 2, 1, 4), np.float32)
    g = np.zeros((1, 2, 1), np.float32)
    with pytest.raises(FlywheelError, match="l2norm_eps"):
        flywheel.chunk_gated_delta_rule(q, q, v, g, g, l2norm_eps=-1.0)


@pytest.mark.parametrize("accepted", [[0, 3], [5, 1], [2, 2]])
def test_verify_then_commit_equals_decoding_the_accepted_tokens(accepted):
    rng = np.random.default_rng(15)
    lens = [5, 3]
    cu = np.cumsum([0] + lens)
    (q, k, v, g, beta), _ = inputs(rng, 1, cu[-1], 2, 4, 32, 32, "float32", "numpy")
    state = (rng.standard_normal((3, 4, 32, 32)) * 0.1).astype(np.float32)
    idx = np.array([2, 0], np.int32)
    o, replay = flywheel.gated_delta_rule_verify(q, k, v, g, beta, state, idx, cu_seqlens=cu)
    committed = state.copy()
    want_o, _ = flywheel.fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state[idx], cu_seqlens=cu)
    assert np.abs(o - want_o).max() <= 1e-4
    flywheel.gated_delta_rule_commit(replay, accepted, state)
    for i, m in enumerate(accepted):
        s = slice(cu[i], cu[i] + m)
        _, h = flywheel.fused_recurrent_gated_delta_rule(
            q[:, s], k[:, s], v[:, s], g=g[:, s], beta=beta[:, s],
            initial_state=committed[idx[i]][None], output_final_state=True)
        assert np.abs(state[idx[i]] - h[0]).max() <= 1e-4
    assert np.array_equal(state[1], committed[1])  # the slot nobody uses


@pytest.mark.parametrize("dtype, precision", [("float32", "bf16"), ("bfloat16", "bf16")])
def test_verify_on_bf16_products(dtype, precision):
    """verify is one chunk per sequence, from the slot's state: its outputs, and the states
    committed with every token accepted, within the bars of the same-roundings reference."""
    rng = np.random.default_rng(22)
    lens = [5, 64, 17]
    cu = np.cumsum([0] + lens)
    K = 32
    (q, k, v, g, beta), (q64, k64, v64, g64, b64) = inputs(rng, 1, cu[-1], 2, 4, K, 32, dtype,
                                                         "numpy")
    state = (rng.standard_normal((4, 4, K, 32)) * 0.1).astype(np.float32)
    idx = np.array([3, 0, 2], np.int32)
    before = state.copy()
    o, replay = flywheel.gated_delta_rule_verify(q, k, v, g, beta, state, idx, cu_seqlens=cu,
                                                 use_qk_l2norm_in_kernel=True,
                                                 precision=precision)
    assert o.dtype == v.dtype
    o32, _ = flywheel.gated_delta_rule_verify(q, k, v, g, beta, state, idx, cu_seqlens=cu,
                                              use_qk_l2norm_in_kernel=True, precision="f32")
    assert not np.array_equal(as64(o), as64(o32))  # the products were rounded
    flywheel.gated_delta_rule_commit(replay, lens, state)
    for i in range(3):
        s = slice(cu[i], cu[i + 1])
        args = (q64[0, s], k64[0, s], v64[0, s], g64[0, s], b64[0, s], K ** -0.5,
                before[idx[i]], True)
        ro, rh = ref_gdn(*args)
        bar_o, bar_h = bf16_bars((ro, rh), ref_gdn_bf16(*args), dtype)
        assert np.abs(as64(o)[0, s] - ro).max() <= bar_o
        assert np.abs(state[idx[i]] - rh).max() <= bar_h
    assert np.array_equal(state[1], before[1])  # the slot nobody uses


def test_bad_inputs():
    rng = np.random.default_rng(16)
    (q, k, v, g, beta), _ = inputs(rng, 1, 8, 2, 4, 16, 16, "float32", "numpy")
    with pytest.raises(FlywheelError) as e:
        flywheel.chunk_gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    assert e.value.status == "FW_ERR_SHAPE"
    with pytest.raises(FlywheelError, match="FW_ERR_SEQLENS"):
        flywheel.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=[0, 9])
    with pytest.raises(ValueError, match="batch size must be 1"):
        flywheel.chunk_gated_delta_rule(*(np.concatenate([x, x]) for x in (q, k, v, g, beta)),
                                        cu_seqlens=[0, 8])
    with pytest.raises(ValueError, match="initial_state"):
        flywheel.chunk_gated_delta_rule(q, k, v, g, beta,
                                        initial_state=np.zeros((2, 4, 16, 16), np.float32))
    with pytest.raises(ValueError, match="gk must be"):  # gk is KDA's [B, T, HV, K]
        flywheel.fused_recurrent_gated_delta_rule(q, k, v, gk=g, beta=beta)
    with pytest.raises(NotImplementedError, match="state_v_first"):
        flywheel.chunk_gated_delta_rule(q, k, v, g, beta, state_v_first=True)
    with pytest.raises(NotImplementedError, match="'foo'"):
        flywheel.chunk_gated_delta_rule(q, k, v, g, beta, foo=1)
    slots = np.zeros((2, 4, 16, 16), np.float32)
    with pytest.raises(TypeError, match="contiguous float32"):  # a dtype: TypeError
        flywheel.gated_delta_rule_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                         slots.astype(np.float64))
    with pytest.raises(ValueError, match="non-contiguous"):  # a layout: ValueError
        flywheel.gated_delta_rule_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                         np.zeros((2, 4, 16, 32), np.float32)[..., ::2])
    with pytest.raises(FlywheelError, match="FW_ERR_INDEX|FW_ERR_ARG"):
        flywheel.gated_delta_rule_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], slots,
                                         [5])


@pytest.mark.parametrize("family", FAMILIES)
def test_views_into_a_packed_qkv_buffer_on_every_table(family):
    """q, k, v as head slices of one [B, T, 2H + HV, K] projection output (no copies)."""
    rng = np.random.default_rng(17)
    B, Tn, H, HV, K = 2, 70, 2, 4, 32
    buf, buf64 = make(rng, (B, Tn, 2 * H + HV, K), "float32", family)
    q, k, v = buf[:, :, :H], buf[:, :, H:2 * H], buf[:, :, 2 * H:]
    g = -np.abs(rng.standard_normal((B, Tn, HV))).astype(np.float32) * 0.2
    beta = np.full((B, Tn, HV), 0.6, np.float32)
    for isa in flywheel.isa_tables():
        o, _ = flywheel.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                               isa=isa)
        for i in range(B):
            ro, _ = ref_gdn(buf64[i, :, :H], buf64[i, :, H:2 * H], buf64[i, :, 2 * H:],
                            g[i].astype(np.float64), beta[i].astype(np.float64), K ** -0.5,
                            None, True)
            assert np.abs(as64(o)[i] - ro).max() <= GTOL["float32"], isa


def test_out_buffer_is_written_in_place():
    rng = np.random.default_rng(18)
    (q, k, v, g, beta), _ = inputs(rng, 2, 40, 2, 4, 32, 32, "float32", "numpy")
    want, _ = flywheel.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    buf = np.full_like(want, np.nan)
    got, _ = flywheel.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                             out=buf)
    assert got is buf and np.array_equal(buf, want)
    with pytest.raises(FlywheelError, match="FW_ERR_SHAPE"):
        flywheel.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, out=buf[:, :, :2])


def test_serving_calls_reject_bad_input():
    rng = np.random.default_rng(19)
    cu = np.array([0, 3, 70])  # the second sequence has 67 draft tokens: more than 64
    (q, k, v, g, beta), _ = inputs(rng, 1, 70, 2, 4, 16, 16, "float32", "numpy")
    state = np.zeros((2, 4, 16, 16), np.float32)
    with pytest.raises(FlywheelError):
        flywheel.gated_delta_rule_verify(q, k, v, g, beta, state, cu_seqlens=cu)
    _, replay = flywheel.gated_delta_rule_verify(q[:, :5], k[:, :5], v[:, :5], g[:, :5],
                                                 beta[:, :5], state, cu_seqlens=[0, 3, 5])
    with pytest.raises(ValueError, match="accepted must have 2 entries"):
        flywheel.gated_delta_rule_commit(replay, [1], state)
    with pytest.raises(FlywheelError):  # more accepted tokens than the sequence drafted
        flywheel.gated_delta_rule_commit(replay, [4, 0], state)
    assert not state.any()  # refused calls leave the states alone
    with pytest.raises(ValueError, match="one token per sequence"):
        flywheel.gated_delta_rule_decode(q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2],
                                         state)


def test_five_positional_arguments_to_fused_recurrent():
    """fla's signature is (q, k, v, g, gk, gv, beta, ...): a 5th positional argument is gk."""
    rng = np.random.default_rng(22)
    (q, k, v, g, beta), _ = inputs(rng, 1, 8, 2, 4, 16, 16, "float32", "numpy")
    with pytest.raises(ValueError, match=r"beta must be passed by keyword \(beta=\.\.\.\)") as e:
        flywheel.fused_recurrent_gated_delta_rule(q, k, v, g, beta)
    assert "5th positional argument" in str(e.value)
    with pytest.raises(ValueError, match=r"KDA, \[B, T, HV, K\]"):  # gk: [B, T, HV, K]
        flywheel.fused_recurrent_gated_delta_rule(q, k, v, g, g[..., None], beta=beta)
    with pytest.raises(NotImplementedError, match="gv"):
        flywheel.fused_recurrent_gated_delta_rule(q, k, v, g, gv=g, beta=beta)
    o, _ = flywheel.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta)
    want, _ = flywheel.chunk_gated_delta_rule(q, k, v, g, beta)
    assert np.abs(o - want).max() <= 1e-4


def test_head_dim_zero_is_a_shape_error():
    """The default scale 1/sqrt(K) is left to the library, which refuses K = 0 as a shape."""
    z = np.zeros((1, 4, 2, 0), np.float32)
    v = np.zeros((1, 4, 2, 8), np.float32)
    g = np.zeros((1, 4, 2), np.float32)
    state = np.zeros((1, 2, 0, 8), np.float32)
    calls = [lambda: flywheel.chunk_gated_delta_rule(z, z, v, g, g),
             lambda: flywheel.chunk_gated_delta_rule(z, z, v, g, g, scale=0.5),
             lambda: flywheel.fused_recurrent_gated_delta_rule(z, z, v, g, beta=g),
             lambda: flywheel.gated_delta_rule_decode(z[:, 0], z[:, 0], v[:, 0], g[:, 0],
                                                      g[:, 0], state),
             lambda: flywheel.gated_delta_rule_verify(z, z, v, g, g, state)]
    for call in calls:
        with pytest.raises(FlywheelError) as e:
            call()
        assert e.value.status == "FW_ERR_SHAPE" and "head dims" in str(e.value)


def test_read_only_arrays_the_call_writes_are_refused():
    rng = np.random.default_rng(23)
    (q, k, v, g, beta), _ = inputs(rng, 1, 5, 2, 4, 16, 16, "float32", "numpy")
    state = (rng.standard_normal((2, 4, 16, 16)) * 0.1).astype(np.float32)
    ro = read_only(state)
    with pytest.raises(ValueError, match="state is a read-only numpy array"):
        flywheel.gated_delta_rule_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], ro)
    assert np.array_equal(ro, state)
    # verify only reads the state: a read-only one is fine; commit writes it
    o, replay = flywheel.gated_delta_rule_verify(q, k, v, g, beta, ro)
    assert np.array_equal(o, flywheel.gated_delta_rule_verify(q, k, v, g, beta, state)[0])
    with pytest.raises(ValueError, match="state is a read-only numpy array"):
        flywheel.gated_delta_rule_commit(replay, [3], ro)
    assert np.array_equal(ro, state)
    out = read_only(np.zeros_like(v))
    for fn in (flywheel.chunk_gated_delta_rule, flywheel.fused_recurrent_gated_delta_rule):
        with pytest.raises(ValueError, match="out is a read-only numpy array"):
            fn(q, k, v, g=g, beta=beta, out=out)
    assert not out.any()
    # read-only inputs (q, k, v, gates, initial state) are only read
    h0 = read_only(state[:1])
    o, h = flywheel.chunk_gated_delta_rule(*map(read_only, (q, k, v, g, beta)),
                                           initial_state=h0, output_final_state=True)
    assert np.array_equal(o, flywheel.chunk_gated_delta_rule(q, k, v, g, beta,
                                                             initial_state=state[:1])[0])


def test_unsupported_dtypes_raise_type_error():
    """Every dtype the library does not take is a TypeError; shapes stay ValueError."""
    rng = np.random.default_rng(24)
    (q, k, v, g, beta), _ = inputs(rng, 1, 5, 2, 4, 16, 16, "float32", "numpy")
    state = np.zeros((2, 4, 16, 16), np.float32)
    for bad in (np.float64, np.int32):
        x = q.astype(bad)
        with pytest.raises(TypeError, match=f"q: dtype {np.dtype(bad)} is not supported"):
            flywheel.chunk_gated_delta_rule(x, k, v, g, beta)
        with pytest.raises(TypeError, match="v: dtype"):
            flywheel.fused_recurrent_gated_delta_rule(q, k, v.astype(bad), g, beta=beta)
        with pytest.raises(TypeError, match="out: dtype"):
            flywheel.chunk_gated_delta_rule(q, k, v, g, beta, out=v.astype(bad))
        with pytest.raises(TypeError, match="k: dtype"):
            flywheel.gated_delta_rule_decode(q[:, 0], k[:, 0].astype(bad), v[:, 0], g[:, 0],
                                             beta[:, 0], state)
        with pytest.raises(TypeError, match="state: dtype"):
            flywheel.gated_delta_rule_verify(q, k, v, g, beta, state.astype(bad))
    # g, beta, initial_state: any floating dtype is converted; others are refused
    for bad in (np.int32, np.int64, bool, np.complex64):
        with pytest.raises(TypeError, match="g: dtype"):
            flywheel.chunk_gated_delta_rule(q, k, v, g.astype(bad), beta)
        with pytest.raises(TypeError, match="beta: dtype"):
            flywheel.gated_delta_rule_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                                             beta[:, 0].astype(bad), state)
        with pytest.raises(TypeError, match="initial_state: dtype"):
            flywheel.chunk_gated_delta_rule(q, k, v, g, beta,
                                            initial_state=state[:1].astype(bad))
    o64, _ = flywheel.chunk_gated_delta_rule(q, k, v, g.astype(np.float64),
                                             beta.astype(np.float16))
    o32, _ = flywheel.chunk_gated_delta_rule(q, k, v, g, beta.astype(np.float16)
                                             .astype(np.float32))
    assert np.array_equal(o64, o32)
    _, replay = flywheel.gated_delta_rule_verify(q, k, v, g, beta, state)
    with pytest.raises(TypeError, match="state: dtype float64"):
        flywheel.gated_delta_rule_commit(replay, [2], state.astype(np.float64))
    if torch is not None:
        with pytest.raises(TypeError, match="g: dtype torch.int64"):
            flywheel.chunk_gated_delta_rule(q, k, v, torch.zeros(1, 5, 4, dtype=torch.int64),
                                            beta)
    with pytest.raises(TypeError, match="g is required"):
        flywheel.chunk_gated_delta_rule(q, k, v, None, beta)
    with pytest.raises(TypeError, match="isa must be a kernel table name"):
        flywheel.chunk_gated_delta_rule(q, k, v, g, beta, isa=2)
    with pytest.raises(ValueError) as e:  # a shape is still a ValueError, not a TypeError
        flywheel.chunk_gated_delta_rule(q, k, v, g[:, :, :3], beta)
    assert not isinstance(e.value, TypeError)
