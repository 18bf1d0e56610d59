"""The attention backward: flash_attn_func / flash_attn_varlen_func under torch autograd and
flash_attn_backward / flash_attn_varlen_backward, against torch's autograd of attention in
float64 on the forward's test grid, torch's own SDPA backward in the same dtype, the numpy
calls, the torch ops (and torch.compile), and bad input.

Bar per gradient, against the float64 autograd: <= 2 x the error of torch's SDPA backward in
the same dtype + 1e-6 x (1 + max |ref|), plus for bf16 / f16 2 roundings of the dtype at the
largest gradient (the forward's out, which the backward reads, is itself rounded to the
dtype). The C tests (tests/test_attn_bwd.c) hold the strict 2 x
plain bar against the C float64 reference given the same out and lse.
"""

import math

import numpy as np
import pytest

import flywheel
from flywheel import FlywheelError
from conftest import torch

pytestmark = pytest.mark.skipif(torch is None, reason="torch is not installed")

SHAPES = [  # (b, sq, sk, hq, hkv, d, dv)
    (1, 1, 1, 4, 4, 64, 64),
    (2, 17, 33, 8, 2, 64, 64),
    (1, 100, 37, 6, 1, 128, 128),
    (1, 130, 130, 4, 2, 32, 48),
]
MASKS = [  # (causal, window, softcap)
    (False, (-1, -1), 0.0),
    (True, (-1, -1), 0.0),
    (True, (20, -1), 0.0),
    (False, (7, 3), 30.0),
]
EPS = {"float32": 0.0, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def visible(sq, sk, causal, window):
    left, right = window
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = i + sk - sq
    vis = torch.ones(sq, sk, dtype=torch.bool)
    right = 0 if causal else right
    if left >= 0:
        vis &= j >= diag - left
    if right >= 0:
        vis &= j <= diag + right
    return vis


def attention(q, k, v, causal, window, softcap, scale):
    """Attention by the formula in q's dtype (rows that see no key give 0), [b, s, h, d]."""
    G = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    vis = visible(q.shape[1], k.shape[1], causal, window)
    seen = vis.any(1, keepdim=True)
    s = s.masked_fill(~vis, -math.inf).masked_fill(~seen, 0.0)
    p = torch.softmax(s, -1) * seen
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)


def sdpa(q, k, v, causal, window):
    G = q.shape[2] // k.shape[2]
    mask = visible(q.shape[1], k.shape[1], causal, window)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(G, 1),
        v.transpose(1, 2).repeat_interleave(G, 1), attn_mask=mask)
    return o.transpose(1, 2)


def grads(fn, q, k, v, g):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(fn(q, k, v), (q, k, v), g)


def inputs(shape, dtype, seed):
    b, sq, sk, hq, hkv, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=gen).to(getattr(torch, dtype))  # noqa: E731
    return make(b, sq, hq, d), make(b, sk, hkv, d), make(b, sk, hkv, dv), make(b, sq, hq, dv)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask", MASKS)
def test_grads_match_float64_autograd(dtype, shape, mask):
    causal, window, softcap = mask
    q, k, v, g = inputs(shape, dtype, sum(shape))
    scale = shape[5] ** -0.5
    ref = grads(lambda a, b, c: attention(a.double(), b.double(), c.double(), causal, window,
                                          softcap, scale), q, k, v, g.double())
    got = grads(lambda a, b, c: flywheel.flash_attn_func(a, b, c, causal=causal,
                                                         window_size=window, softcap=softcap),
                q, k, v, g)
    # the same-precision implementation: torch's SDPA backward in the dtype (by the formula
    # in float32 where SDPA cannot: softcap, or rows that see no key, where SDPA gives NaN)
    empty_rows = not visible(shape[1], shape[2], causal, window).any(1).all()
    if softcap or empty_rows:
        same = grads(lambda a, b, c: attention(a.float(), b.float(), c.float(), causal, window,
                                               softcap, scale).to(a.dtype), q, k, v, g)
    else:
        same = grads(lambda a, b, c: sdpa(a, b, c, causal, window), q, k, v, g)
    for name, x, s, r, t in zip(("dq", "dk", "dv"), got, same, ref, (q, k, v)):
        assert x.dtype == t.dtype and x.shape == t.shape
        mag = r.abs().max().item()
        err = (x.double() - r).abs().max().item()
        bar = 2 * (s.double() - r).abs().max().item() + 1e-6 * (1 + mag) + 2 * EPS[dtype] * mag
        assert err <= bar, f"{name}: error {err:.3g} over {bar:.3g} (same-precision " \
            f"{(s.double() - r).abs().max().item():.3g}, max |ref| {mag:.3g})"


def test_numpy_backward_matches_autograd():
    q, k, v, g = inputs((2, 40, 70, 8, 2, 64, 32), "float32", 1)
    tq, tk, tv = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = flywheel.flash_attn_func(tq, tk, tv, causal=True, return_softmax_lse=True)
    out.backward(g)
    with torch.no_grad():
        o2, l2 = flywheel.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    n = lambda x: x.detach().numpy()  # noqa: E731
    dq, dk, dv = flywheel.flash_attn_backward(n(g), n(q), n(k), n(v), n(o2), n(l2), causal=True)
    assert all(type(x) is np.ndarray for x in (dq, dk, dv))
    for a, b in ((dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        assert np.array_equal(a, b.numpy())
    # given gradient arrays are written in place (any float dtype)
    bufs = [np.full(x.shape, np.nan, np.float16) for x in (dq, dk, dv)]
    r = flywheel.flash_attn_backward(n(g), n(q), n(k), n(v), n(o2), n(l2), *bufs, causal=True)
    assert all(a is b for a, b in zip(r, bufs))
    assert np.allclose(bufs[0], dq, atol=2e-2, rtol=2e-3)
    # plain=True: the baseline, same arithmetic in another order
    p = flywheel.flash_attn_backward(n(g), n(q), n(k), n(v), n(o2), n(l2), causal=True,
                                     plain=True)
    for a, b in zip(p, (dq, dk, dv)):
        assert np.allclose(a, b, atol=1e-5)


def test_varlen_grads_match_dense_per_sequence():
    lens_q, lens_k = [5, 0, 40, 17], [9, 12, 40, 0]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens_q), 4, 32, generator=gen, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 32, generator=gen, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 16, generator=gen, requires_grad=True)
    out = flywheel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                          causal=True)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    for i in range(4):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if lens_q[i] == 0:
            assert not k.grad[sk].any() and not v.grad[sk].any()
            continue
        if lens_k[i] == 0:
            assert not q.grad[sq].any()
            continue
        ref = grads(lambda a, b, c: attention(a.double(), b.double(), c.double(), True, (-1, -1),
                                              0.0, 32 ** -0.5),
                    q[sq][None], k[sk][None], v[sk][None], g[sq][None].double())
        for x, r in zip((q.grad[sq], k.grad[sk], v.grad[sk]), ref):
            assert (x.double() - r[0]).abs().max() <= 1e-5


def test_threads_give_identical_bits():
    q, k, v, g = inputs((1, 200, 300, 8, 2, 64, 64), "bfloat16", 4)
    before = flywheel.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            flywheel.set_num_threads(n)
            results.append(grads(lambda a, b, c: flywheel.flash_attn_func(a, b, c, causal=True),
                                 q, k, v, g))
    finally:
        flywheel.set_num_threads(before)
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], r))


def test_torch_ops_backward_and_compile():
    import flywheel.torch_ops  # noqa: F401
    OPS = torch.ops.flywheel
    q, k, v, g = inputs((1, 33, 50, 4, 2, 32, 32), "float32", 5)
    want = grads(lambda a, b, c: flywheel.flash_attn_func(a, b, c, causal=True), q, k, v, g)
    for lse in (False, True):  # without lse the backward runs the forward again for it
        got = grads(lambda a, b, c: OPS.flash_attn_func(a, b, c, None, True, -1, -1, 0.0, lse)[0],
                    q, k, v, g)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    direct = OPS.flash_attn_backward(g, q, k, v, *flywheel.flash_attn_func(
        q, k, v, causal=True, return_softmax_lse=True), None, True)
    assert all(torch.equal(a, b) for a, b in zip(direct, want))
    f = torch.compile(lambda a, b, c: OPS.flash_attn_func(a, b, c, None, True, -1, -1, 0.0,
                                                          True)[0], fullgraph=True)
    got = grads(f, q, k, v, g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    cu = torch.tensor([0, 33], dtype=torch.int32)
    cuk = torch.tensor([0, 50], dtype=torch.int32)
    got = grads(lambda a, b, c: OPS.flash_attn_varlen_func(a[0], b[0], c[0], cu, cuk, 33, 50, None,
                                                           True)[0][None], q, k, v, g)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-6


def test_backward_bad_input():
    q, k, v, g = (x.numpy() for x in inputs((1, 8, 8, 2, 2, 16, 16), "float32", 6))
    out, lse = flywheel.flash_attn_func(q, k, v, return_softmax_lse=True)
    with pytest.raises(FlywheelError, match="FW_ERR_SHAPE"):
        flywheel.flash_attn_backward(g, q, k, v, out, lse[:, :1])
    with pytest.raises(FlywheelError, match="FW_ERR_DTYPE"):
        flywheel.flash_attn_backward(g, q, k, v, out, lse.astype(np.float16))
    with pytest.raises(FlywheelError, match="dq"):
        flywheel.flash_attn_backward(g, q, k, v, out, lse, dq=np.zeros((1, 8, 2, 15), np.float32))
    ro = np.zeros(q.shape, np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        flywheel.flash_attn_backward(g, q, k, v, out, lse, dq=ro)
    with pytest.raises(FlywheelError, match="overlaps"):
        flywheel.flash_attn_backward(g, q, k, v, out, lse, dq=q)
    with pytest.raises(ValueError, match="4-D"):
        flywheel.flash_attn_backward(g[0], q, k, v, out, lse)
    t = torch.from_numpy(q).requires_grad_()
    with pytest.raises(NotImplementedError, match="out="):
        flywheel.flash_attn_func(t, t, t, out=torch.empty(q.shape))
    with pytest.raises(FlywheelError, match="FW_ERR_SEQLENS"):
        flywheel.flash_attn_varlen_backward(g[0], q[0], k[0], v[0], out[0], lse[0],
                                            [0, 9], [0, 8], 9, 8)


def test_backward_precision_follows_the_forward():
    """bf16 inputs: bf16 products by default (P and dS rounded to bf16), f32 products with
    precision="f32", in the autograd path as in the explicit call; f32 products are the more
    accurate against float64."""
    q, k, v, g = inputs((1, 60, 90, 4, 2, 64, 64), "bfloat16", 9)
    ref = grads(lambda a, b, c: attention(a.double(), b.double(), c.double(), True, (-1, -1), 0.0,
                                          0.125), q, k, v, g.double())
    err = {}
    for prec in (None, "f32"):
        auto = grads(lambda a, b, c: flywheel.flash_attn_func(a, b, c, causal=True,
                                                              precision=prec), q, k, v, g)
        with torch.no_grad():
            out, lse = flywheel.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True,
                                                precision=prec)
        direct = flywheel.flash_attn_backward(g, q, k, v, out, lse, causal=True, precision=prec)
        assert all(torch.equal(a, b) for a, b in zip(auto, direct))
        err[prec] = max((a.double() - r).abs().max().item() for a, r in zip(auto, ref))
    with torch.no_grad():
        out, lse = flywheel.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    f32 = flywheel.flash_attn_backward(g, q, k, v, out, lse, causal=True, precision="f32")
    bf16 = flywheel.flash_attn_backward(g, q, k, v, out, lse, causal=True, precision="bf16")
    assert not all(torch.equal(a, b) for a, b in zip(f32, bf16))
    assert err["f32"] <= err[None]


# --------------------------------------------------------------------------- attention sinks

def attention_sinks(q, k, v, sinks, causal, window, softcap, scale):
    """attention() with attention sinks: each row's softmax over its visible keys and one more
    logit, its head's sink, whose probability multiplies no value (a row that sees no key
    gives 0)."""
    G = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible(q.shape[1], k.shape[1], causal, window), -math.inf)
    sink = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)
    p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)


def sink_grads(fn, q, k, v, sinks, g):
    q, k, v, sinks = (x.detach().requires_grad_() for x in (q, k, v, sinks))
    return torch.autograd.grad(fn(q, k, v, sinks), (q, k, v, sinks), g)


def dsinks_formula(sinks, dout, out, lse):
    """The float64 formula dsinks[h] = -sum_rows exp(sinks[h] - lse) sum(dout * out), from
    dense out [b, sq, hq, dv] and lse [b, hq, sq]."""
    D = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    return -(torch.exp(sinks.double()[:, None] - lse.double()) * D).sum((0, 2))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("mask", MASKS[1:])
def test_sinks_grads_match_float64_autograd(dtype, shape, mask):
    """dq, dk, dv and the sinks' gradient (returned in the sinks' dtype) against float64
    autograd of the formula, within twice the error of the formula in float32 (plus the
    roundings of the dtype); rows that see no key included (causal, sq > sk). The sinks'
    gradient also against the float64 formula on the call's own out and lse."""
    causal, window, softcap = mask
    q, k, v, g = inputs(shape, dtype, sum(shape) + 7)
    sinks = torch.randn(shape[3], generator=torch.Generator().manual_seed(sum(shape))) * 1.5
    scale = shape[5] ** -0.5
    ref = sink_grads(lambda a, b, c, s: attention_sinks(a.double(), b.double(), c.double(), s,
                                                        causal, window, softcap, scale),
                     q, k, v, sinks.double(), g.double())
    same = sink_grads(lambda a, b, c, s: attention_sinks(a.float(), b.float(), c.float(), s,
                                                         causal, window, softcap,
                                                         scale).to(a.dtype), q, k, v, sinks, g)
    got = sink_grads(lambda a, b, c, s: flywheel.flash_attn_func(
        a, b, c, causal=causal, window_size=window, softcap=softcap, sinks=s), q, k, v, sinks, g)
    for name, x, s, r, t in zip(("dq", "dk", "dv", "dsinks"), got, same, ref, (q, k, v, sinks)):
        assert x.dtype == t.dtype and x.shape == t.shape
        mag = r.abs().max().item()
        err = (x.double() - r).abs().max().item()
        bar = 2 * (s.double() - r).abs().max().item() + 1e-6 * (1 + mag) + 2 * EPS[dtype] * mag
        assert err <= bar, f"{name}: error {err:.3g} over {bar:.3g}"
    with torch.no_grad():
        out, lse = flywheel.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                            softcap=softcap, return_softmax_lse=True, sinks=sinks)
    want = dsinks_formula(sinks, g, out, lse)
    assert (got[3].double() - want).abs().max() <= 1e-5 * (1 + want.abs().max())


def test_sinks_grad_only_where_asked_and_in_their_dtype():
    q, k, v, g = inputs((2, 20, 30, 4, 2, 32, 32), "float32", 10)
    s = torch.tensor([0.5, -1.0, 2.0, 0.0])
    want = sink_grads(lambda a, b, c, x: flywheel.flash_attn_func(a, b, c, causal=True, sinks=x),
                      q, k, v, s, g)
    # sinks that do not require grad (or numpy sinks): gradients of q, k, v alone, the same
    for sinks in (s, s.numpy()):
        tq = q.clone().requires_grad_()
        flywheel.flash_attn_func(tq, k, v, causal=True, sinks=sinks).backward(g)
        assert torch.equal(tq.grad, want[0])
    # sinks alone require grad: the call is still differentiable
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        ts = s.to(dtype, copy=True).requires_grad_()
        out = flywheel.flash_attn_func(q, k, v, causal=True, s_aux=ts)
        assert out.requires_grad
        out.backward(g)
        assert ts.grad.dtype == dtype
        assert (ts.grad.double() - want[3].double()).abs().max() <= 1e-2 * want[3].abs().max()


def test_varlen_sinks_grads_match_dense_per_sequence():
    """The sinks' gradient sums every sequence's rows (sequences without queries or keys add
    nothing); dq, dk, dv per sequence as without sinks."""
    lens_q, lens_k = [5, 0, 40, 17], [9, 12, 40, 0]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(sum(lens_q), 4, 32, generator=gen, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 32, generator=gen, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 16, generator=gen, requires_grad=True)
    sinks = torch.randn(4, generator=gen).requires_grad_()
    out = flywheel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                          causal=True, sinks=sinks)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    dsinks = torch.zeros(4, dtype=torch.float64)
    for i in range(4):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if lens_q[i] == 0:
            assert not k.grad[sk].any() and not v.grad[sk].any()
            continue
        if lens_k[i] == 0:
            assert not q.grad[sq].any()
            continue
        ref = sink_grads(lambda a, b, c, s: attention_sinks(a.double(), b.double(), c.double(),
                                                            s, True, (-1, -1), 0.0, 32 ** -0.5),
                         q[sq][None], k[sk][None], v[sk][None], sinks.double(),
                         g[sq][None].double())
        for x, r in zip((q.grad[sq], k.grad[sk], v.grad[sk]), ref):
            assert (x.double() - r[0]).abs().max() <= 1e-5
        dsinks += ref[3]
    assert (sinks.grad.double() - dsinks).abs().max() <= 1e-5 * (1 + dsinks.abs().max())


def test_backward_calls_write_dsinks():
    """flash_attn_backward / flash_attn_varlen_backward take sinks and write dsinks in place:
    the autograd path's gradient; dsinks is checked (it needs sinks, float32, [hq],
    writable)."""
    q, k, v, g = inputs((1, 24, 24, 4, 2, 32, 32), "float32", 12)
    s = torch.tensor([0.3, -0.7, 1.1, 2.5])
    want = sink_grads(lambda a, b, c, x: flywheel.flash_attn_func(a, b, c, causal=True, sinks=x),
                      q, k, v, s, g)
    n = lambda x: x.detach().numpy()  # noqa: E731
    out, lse = flywheel.flash_attn_func(n(q), n(k), n(v), causal=True, return_softmax_lse=True,
                                        sinks=n(s))
    dsinks = np.full(4, np.nan, np.float32)
    dq, dk, dv = flywheel.flash_attn_backward(n(g), n(q), n(k), n(v), out, lse, causal=True,
                                              sinks=n(s), dsinks=dsinks)
    for a, b in zip((dq, dk, dv, dsinks), want):
        assert np.array_equal(a, b.numpy())
    vd = np.zeros(4, np.float32)
    vr = flywheel.flash_attn_varlen_backward(n(g)[0], n(q)[0], n(k)[0], n(v)[0], out[0], lse[0],
                                             [0, 24], [0, 24], 24, 24, causal=True, sinks=n(s),
                                             dsinks=vd)
    assert np.array_equal(vd, dsinks) and np.array_equal(vr[0], dq[0])
    args = (n(g), n(q), n(k), n(v), out, lse)
    with pytest.raises(FlywheelError, match="FW_ERR_NULL"):
        flywheel.flash_attn_backward(*args, causal=True, dsinks=dsinks)
    with pytest.raises(FlywheelError, match="dsinks has 3 values"):
        flywheel.flash_attn_backward(*args, causal=True, sinks=n(s), dsinks=dsinks[:3])
    with pytest.raises(TypeError, match="dsinks"):
        flywheel.flash_attn_backward(*args, causal=True, sinks=n(s),
                                     dsinks=np.zeros(4, np.float16))
    ro = np.zeros(4, np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="dsinks is a read-only"):
        flywheel.flash_attn_backward(*args, causal=True, sinks=n(s), dsinks=ro)


def test_torch_ops_sinks_backward_and_compile():
    """The ops' sinks: the Python call's out and gradients (the sinks' by the formula in torch
    ops, close to the library's), under torch.compile too."""
    import flywheel.torch_ops  # noqa: F401
    OPS = torch.ops.flywheel
    q, k, v, g = inputs((1, 33, 50, 4, 2, 32, 32), "float32", 13)
    s = torch.tensor([0.5, -1.0, 2.0, 1.0])
    want = sink_grads(lambda a, b, c, x: flywheel.flash_attn_func(a, b, c, causal=True, sinks=x),
                      q, k, v, s, g)

    def check(got, exact):
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))
        assert (got[3] - want[3]).abs().max() <= 1e-5 * (1 + want[3].abs().max())
        assert not exact or torch.equal(got[3], exact[3])
    for lse in (False, True):  # without lse the backward runs the forward again for it
        eager = sink_grads(lambda a, b, c, x: OPS.flash_attn_func(
            a, b, c, None, True, -1, -1, 0.0, lse, sinks=x)[0], q, k, v, s, g)
        check(eager, None)
    f = torch.compile(lambda a, b, c, x: OPS.flash_attn_func(a, b, c, None, True, -1, -1, 0.0,
                                                             True, sinks=x)[0],
                      fullgraph=True, backend="aot_eager")
    check(sink_grads(f, q, k, v, s, g), None)
    cu = torch.tensor([0, 33], dtype=torch.int32)
    cuk = torch.tensor([0, 50], dtype=torch.int32)
    got = sink_grads(lambda a, b, c, x: OPS.flash_attn_varlen_func(
        a[0], b[0], c[0], cu, cuk, 33, 50, None, True, sinks=x)[0][None], q, k, v, s, g)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * (1 + b.abs().max())
    # sinks that do not require grad: no gradient for them, the others as before
    tq = q.clone().requires_grad_()
    OPS.flash_attn_func(tq, k, v, None, True, sinks=s)[0].backward(g)
    assert torch.equal(tq.grad, want[0]) and s.grad is None
