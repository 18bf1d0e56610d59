"""KDA (a decay per key channel): chunk_kda / fused_recurrent_kda against the float64 numpy
recurrence and fla's torch reference, its gates inside the kernel (softplus, safe gate with
lower_bound, sigmoid beta, allow_neg_eigval), decode / verify / commit on slot arrays with
KDA's g, fla's fused_recurrent_gated_delta_rule with gk, and bad input."""

import numpy as np
import pytest

import flywheel
from flywheel import FlywheelError
from conftest import FAMILIES, as64, make, ref_gdn, ref_gdn_bf16, round_to, torch

try:
    from fla.ops.kda.naive import naive_recurrent_kda
except Exception:  # fla not installed, or it fails to import on this machine
    naive_recurrent_kda = None

TOL = {"float32": 2e-4, "bfloat16": 2e-2}


def inputs(rng, B, Tn, H, HV, K, V, dtype, family, gscale=0.3):
    q, q64 = make(rng, (B, Tn, H, K), dtype, family)
    k, k64 = make(rng, (B, Tn, H, K), dtype, family)
    v, v64 = make(rng, (B, Tn, HV, V), dtype, family)
    g = (-np.abs(rng.standard_normal((B, Tn, HV, K))) * gscale).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((B, Tn, HV))))).astype(np.float32)
    if family == "torch":
        g, beta = torch.from_numpy(g), torch.from_numpy(beta)
    return (q, k, v, g, beta), (q64, k64, v64, as64(g), as64(beta))


def softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("Tn", [1, 15, 17, 64, 65, 150])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4), (1, 3)])
@pytest.mark.parametrize("fn", ["chunk", "fused"])
def test_matches_reference(family, dtype, Tn, heads, fn):
    if dtype == "bfloat16" and family == "numpy":
        pytest.importorskip("ml_dtypes")
    H, HV = heads
    K, V = 32, 24
    rng = np.random.default_rng(Tn * 5 + HV)
    (q, k, v, g, beta), (q64, k64, v64, g64, b64) = inputs(rng, 2, Tn, H, HV, K, V, dtype, family)
    h0 = rng.standard_normal((2, HV, K, V)).astype(np.float32) * 0.1
    f = flywheel.chunk_kda if fn == "chunk" else flywheel.fused_recurrent_kda
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if fn == "chunk":
        kw["precision"] = "f32"  # bf16 inputs may default to bf16 products: checked below
    o, ht = f(q, k, v, g, beta, **kw)
    assert tuple(o.shape) == (2, Tn, HV, V) and o.dtype == v.dtype
    bf16_default = fn == "chunk" and dtype == "bfloat16"
    if bf16_default:
        del kw["precision"]
        ob, hb = f(q, k, v, g, beta, **kw)
    for i in range(2):
        args = (q64[i], k64[i], v64[i], g64[i], b64[i], K ** -0.5, h0[i], True)
        ro, rh = ref_gdn(*args)
        assert np.abs(as64(o)[i] - ro).max() <= TOL[dtype]
        assert np.abs(as64(ht)[i] - rh).max() <= 1e-3
        if bf16_default:  # within 2 x the same-roundings reference's error
            so, sh = ref_gdn_bf16(*args)
            assert np.abs(as64(ob)[i] - ro).max() <= \
                2 * np.abs(round_to(so, dtype) - ro).max(initial=0) + 1e-5
            assert np.abs(as64(hb)[i] - rh).max() <= 2 * np.abs(sh - rh).max() + 1e-5


@pytest.mark.parametrize("Tn", [1, 64, 150])
@pytest.mark.parametrize("gscale", [0.3, 20.0])
def test_bf16_products_on_float32_inputs(Tn, gscale):
    """precision="bf16" rounds the operands decayed per channel (docs/linear-attention.md): within 2 x the
    same-roundings reference's error, strong decays included; the products were rounded."""
    H, HV, K, V = 2, 4, 32, 24
    rng = np.random.default_rng(Tn + 11)
    (q, k, v, g, beta), (q64, k64, v64, g64, b64) = inputs(rng, 2, Tn, H, HV, K, V, "float32",
                                                         "numpy", gscale)
    h0 = rng.standard_normal((2, HV, K, V)).astype(np.float32) * 0.1
    kw = dict(scale=0.2, initial_state=h0, output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    o, ht = flywheel.chunk_kda(q, k, v, g, beta, precision="bf16", **kw)
    o32, _ = flywheel.chunk_kda(q, k, v, g, beta, precision="f32", **kw)
    assert o.dtype == q.dtype and not np.array_equal(o, o32)
    for i in range(2):
        args = (q64[i], k64[i], v64[i], g64[i], b64[i], 0.2, h0[i], True)
        ro, rh = ref_gdn(*args)
        so, sh = ref_gdn_bf16(*args)
        assert np.abs(o[i] - ro).max() <= 2 * np.abs(so - ro).max() + 1e-5
        assert np.abs(ht[i] - rh).max() <= 2 * np.abs(sh - rh).max() + 1e-5


def test_varlen_equals_separate_runs_and_strong_decays():
    rng = np.random.default_rng(3)
    lens = [65, 0, 1, 130, 7]
    cu = np.cumsum([0] + lens).astype(np.int32)
    (q, k, v, g, beta), _ = inputs(rng, 1, int(cu[-1]), 1, 2, 16, 16, "float32", "numpy",
                                   gscale=50.0)
    h0 = rng.standard_normal((5, 2, 16, 16)).astype(np.float32) * 0.1
    o, ht = flywheel.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    assert np.isfinite(o).all() and np.isfinite(ht).all()
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        oi, hi = flywheel.chunk_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                    initial_state=h0[i:i + 1], output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
        np.testing.assert_array_equal(o[:, a:b], oi)
        np.testing.assert_array_equal(ht[i], hi[0])
        ro, rh = ref_gdn(as64(q[0, a:b]), as64(k[0, a:b]), as64(v[0, a:b]), as64(g[0, a:b]),
                         as64(beta[0, a:b]), 0.25, h0[i], True)
        assert np.abs(o[0, a:b] - ro).max(initial=0) <= 2e-4
        assert np.abs(ht[i] - rh).max() <= 1e-4


@pytest.mark.skipif(naive_recurrent_kda is None or torch is None, reason="fla / torch not installed")
def test_matches_fla_naive():
    rng = np.random.default_rng(11)
    B, Tn, H, HV, K, V = 2, 70, 2, 4, 32, 32
    (q, k, v, g, beta), _ = inputs(rng, B, Tn, H, HV, K, V, "float32", "torch")
    k = torch.nn.functional.normalize(k, dim=-1)
    h0 = torch.randn(B, HV, K, V) * 0.1
    ro, rh = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for f in (flywheel.chunk_kda, flywheel.fused_recurrent_kda):
        o, ht = f(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert (o - ro).abs().max() <= 1e-4 and (ht - rh).abs().max() <= 1e-4


@pytest.mark.parametrize("gate", ["softplus", "safe"])
@pytest.mark.parametrize("fn", ["chunk", "fused"])
def test_gates_in_kernel(gate, fn):
    """use_gate_in_kernel / use_beta_sigmoid_in_kernel give the result of the same gates given
    (computed here in float32 as the kernel does)."""
    rng = np.random.default_rng(21)
    B, Tn, H, HV, K, V = 1, 40, 2, 4, 16, 16
    (q, k, v, _, _), _ = inputs(rng, B, Tn, H, HV, K, V, "float32", "numpy")
    a = (2 * rng.standard_normal((B, Tn, HV, K))).astype(np.float32)
    b = (2 * rng.standard_normal((B, Tn, HV))).astype(np.float32)
    A_log = (0.5 * rng.standard_normal(HV)).astype(np.float32)
    dt_bias = (0.5 * rng.standard_normal(HV * K)).astype(np.float32)
    y = a + dt_bias.reshape(HV, K)
    ea = np.exp(A_log)[:, None]
    g = (-5.0 / (1.0 + np.exp(-ea * y)) if gate == "safe" else -ea * softplus(y)).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-b))).astype(np.float32)
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    gk = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    if gate == "safe":
        gk.update(lower_bound=-5.0)
        if fn == "chunk":
            gk.update(safe_gate=True)
    f = flywheel.chunk_kda if fn == "chunk" else flywheel.fused_recurrent_kda
    o1, h1 = f(q, k, v, g, beta, **kw)
    o2, h2 = f(q, k, v, a, b, **kw, **gk)
    assert np.abs(o1 - o2).max() <= 1e-5 and np.abs(h1 - h2).max() <= 1e-5
    # allow_neg_eigval: beta = 2 sigmoid(b)
    o3, _ = f(q, k, v, g, 2 * beta, **kw)
    o4, _ = f(q, k, v, a, b, allow_neg_eigval=True, **kw, **gk)
    assert np.abs(o3 - o4).max() <= 1e-5


def test_chunk_lower_bound_needs_safe_gate():
    """chunk_kda reads lower_bound only with safe_gate (fla's rule); fused_recurrent_kda always."""
    rng = np.random.default_rng(5)
    (q, k, v, _, beta), _ = inputs(rng, 1, 20, 1, 1, 8, 8, "float32", "numpy")
    a = rng.standard_normal((1, 20, 1, 8)).astype(np.float32)
    A_log = np.zeros(1, np.float32)
    plain, _ = flywheel.chunk_kda(q, k, v, a, beta, use_gate_in_kernel=True, A_log=A_log)
    ignored, _ = flywheel.chunk_kda(q, k, v, a, beta, use_gate_in_kernel=True, A_log=A_log,
                                    lower_bound=-5.0)
    safe, _ = flywheel.chunk_kda(q, k, v, a, beta, use_gate_in_kernel=True, safe_gate=True,
                                 lower_bound=-5.0)
    np.testing.assert_array_equal(plain, ignored)
    assert np.abs(plain - safe).max() > 1e-3
    rec, _ = flywheel.fused_recurrent_kda(q, k, v, a, beta, use_gate_in_kernel=True,
                                          lower_bound=-5.0)
    assert np.abs(rec - safe).max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_verify_commit(family):
    """gated_delta_rule_decode with KDA's g, token by token, equals the reference; verify of
    the same tokens then commit of m equals m decode steps."""
    rng = np.random.default_rng(8)
    N, n, H, HV, K, V = 3, 6, 2, 4, 16, 24
    (q, k, v, g, beta), (q64, k64, v64, g64, b64) = inputs(rng, N, n, H, HV, K, V, "float32",
                                                           family)
    slots = 5
    idx = np.array([4, 0, 2], np.int32)
    state = (rng.standard_normal((slots, HV, K, V)) * 0.1).astype(np.float32)
    base = state.copy()
    if family == "torch":
        state = torch.from_numpy(state)
    outs = []
    for t in range(n):
        outs.append(as64(flywheel.gated_delta_rule_decode(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, idx,
            use_qk_l2norm_in_kernel=True)))
    for i in range(N):
        ro, rh = ref_gdn(q64[i], k64[i], v64[i], g64[i], b64[i], K ** -0.5, base[idx[i]], True)
        assert np.abs(np.stack([o[i] for o in outs]) - ro).max() <= 2e-4
        assert np.abs(as64(state)[idx[i]] - rh).max() <= 1e-4
    cu = np.arange(0, N * n + 1, n, dtype=np.int32)
    flat = [x.reshape((1, N * n) + tuple(x.shape[2:])) for x in (q, k, v, g, beta)]
    for m in (0, 3, n):
        work = base.copy()
        ov, rep = flywheel.gated_delta_rule_verify(*flat, work, idx, cu_seqlens=cu,
                                                   use_qk_l2norm_in_kernel=True)
        np.testing.assert_array_equal(work, base)
        assert np.abs(as64(ov).reshape(N, n, HV, V) - np.stack(outs, 1)).max() <= 2e-5
        flywheel.gated_delta_rule_commit(rep, np.full(N, m, np.int32), work)
        for i in range(N):
            _, rh = ref_gdn(q64[i][:m], k64[i][:m], v64[i][:m], g64[i][:m], b64[i][:m],
                            K ** -0.5, base[idx[i]], True)
            assert np.abs(work[idx[i]] - rh).max() <= 1e-4


def test_fused_recurrent_gdn_with_gk():
    """fla's fused_recurrent_gated_delta_rule(gk=...): the per-key-channel gate, plus g."""
    rng = np.random.default_rng(9)
    (q, k, v, gk, beta), (q64, k64, v64, g64, b64) = inputs(rng, 1, 30, 1, 2, 8, 8, "float32",
                                                           "numpy")
    g = (-np.abs(rng.standard_normal((1, 30, 2))) * 0.2).astype(np.float32)
    o, _ = flywheel.fused_recurrent_gated_delta_rule(q, k, v, g=g, gk=gk, beta=beta,
                                                     use_qk_l2norm_in_kernel=True)
    ro, _ = ref_gdn(q64[0], k64[0], v64[0], g64[0] + as64(g)[0][..., None], b64[0], 8 ** -0.5,
                    None, True)
    assert np.abs(o[0] - ro).max() <= 2e-4
    with pytest.raises(NotImplementedError, match="gv"):
        flywheel.fused_recurrent_gated_delta_rule(q, k, v, g=g, gv=gk, beta=beta)


def test_bad_input():
    rng = np.random.default_rng(1)
    (q, k, v, g, beta), _ = inputs(rng, 1, 10, 1, 2, 8, 8, "float32", "numpy")
    with pytest.raises(ValueError, match="B, T, HV, K"):
        flywheel.chunk_kda(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError):
        flywheel.chunk_kda(q, k, v, g[..., :7], beta)
    with pytest.raises(ValueError, match="chunk_size"):
        flywheel.chunk_kda(q, k, v, g, beta, chunk_size=16)
    with pytest.raises(ValueError, match="lower_bound"):
        flywheel.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, safe_gate=True)
    with pytest.raises(ValueError, match="A_log"):
        flywheel.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="dt_bias"):
        flywheel.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=np.zeros(2, np.float32),
                           dt_bias=np.zeros(15, np.float32))
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        flywheel.chunk_kda(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(NotImplementedError):
        flywheel.chunk_kda(q, k, v, g, beta, state_v_first=True)
    with pytest.raises(NotImplementedError):
        flywheel.chunk_kda(q, k, v, g, beta, return_intermediate_states=True)
    bad = g.copy()
    bad[0, 3, 1, 5] = np.nan
    with pytest.raises(FlywheelError, match=r"g\[3\]\[1\]\[5\]"):
        flywheel.chunk_kda(q, k, v, bad, beta)
    with pytest.raises(ValueError, match="lower_bound must be negative"):
        flywheel.fused_recurrent_kda(q, k, v, g, beta, use_gate_in_kernel=True, lower_bound=1.0)
