"""The compiled fast path (python/flywheel/_fwext.c) against the ctypes path it shortcuts.

Every valid call the fast path takes must give the ctypes path's bits (outputs, lse, caches and
states written in place), and every call it declines must behave exactly as the ctypes path
(same result or same exception type and message). The tests count, with _fwext.stats(), that
the fast path really took the calls meant for it. Skipped where the extension is not in use
(FLYWHEEL_BINDING=ctypes: then the whole suite runs on ctypes alone, which `make test-python`
does as its second pass).
"""

import os

import numpy as np
import pytest

import flywheel
from flywheel import _lib

from conftest import make, torch

fast_only = pytest.mark.skipif(_lib.fast is None, reason="the compiled fast path is not in use")

FAMS = ["numpy", "torch"] if torch is not None else ["numpy"]


@pytest.mark.skipif(not os.environ.get("FLYWHEEL_EXPECT_BINDING"),
                    reason="FLYWHEEL_EXPECT_BINDING is not set")
def test_expected_binding():
    """`make test-python` says which binding each pass must be on (a fast path that failed to
    build must not pass as a ctypes run)."""
    assert _lib.binding()[0] == os.environ["FLYWHEEL_EXPECT_BINDING"], _lib.binding()


def both_paths(call):
    """call() through the fast path and through ctypes alone: (fast result, ctypes result,
    fast calls taken, calls declined). `call` builds its own inputs (so in-place writes of one
    run do not feed the other)."""
    before = _lib.fast.stats()
    fast = _run(call)
    after = _lib.fast.stats()
    saved, _lib.fast = _lib.fast, None
    try:
        slow = _run(call)
    finally:
        _lib.fast = saved
    return fast, slow, after[0] - before[0], after[1] - before[1]


def _run(call):
    try:
        return ("ok", call())
    except Exception as e:  # the type and message are what must agree
        return ("raised", type(e), str(e))


def _np(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy()
    return x.view(np.int16) if x.dtype.itemsize == 2 else x


def same(a, b):
    """Bit-identical results: arrays, tuples and lists of them, None."""
    if isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
        return
    if a is None or isinstance(a, (int, float, str, type)):
        assert a == b
        return
    assert type(a) is type(b)
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    np.testing.assert_array_equal(_np(a), _np(b))


def check(call, taken):
    fast, slow, n_fast, n_declined = both_paths(call)
    assert fast[0] == slow[0], (fast, slow)
    if fast[0] == "raised":
        assert fast[1:] == slow[1:]
    else:
        same(fast[1], slow[1])
    if taken:
        assert (n_fast, n_declined) == (1, 0)
    else:
        assert n_fast == 0


@fast_only
@pytest.mark.parametrize("family", FAMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(causal=True, window_size=(5, 0)),
                                  dict(softcap=3.5, softmax_scale=0.2),
                                  dict(window_size=(None, 2**70))])
def test_func_same_bits(family, dtype, opts):
    def call(lse=False, with_out=False):
        rng = np.random.default_rng(1)
        q, _ = make(rng, (2, 5, 4, 24), dtype, family)
        k, _ = make(rng, (2, 9, 2, 24), dtype, family)
        v, _ = make(rng, (2, 9, 2, 16), dtype, family)
        out = None
        if with_out:
            out = (torch.zeros((2, 5, 4, 16), dtype=q.dtype) if family == "torch"
                   else np.zeros((2, 5, 4, 16), q.dtype))
        r = flywheel.flash_attn_func(q, k, v, return_softmax_lse=lse, out=out, **opts)
        return (r, out) if with_out else r
    taken = _exportable(family, dtype)
    check(call, taken)
    check(lambda: call(lse=True), taken)
    check(lambda: call(with_out=True), taken)


@fast_only
@pytest.mark.parametrize("family", FAMS)
def test_varlen_same_bits(family):
    def call(lse):
        rng = np.random.default_rng(2)
        q, _ = make(rng, (11, 6, 32), "float16", family)
        k, _ = make(rng, (19, 2, 32), "float16", family)
        v, _ = make(rng, (19, 2, 32), "float16", family)
        cq = np.array([0, 3, 3, 11], np.int32)
        ck = np.array([0, 7, 10, 19], np.int32)
        if family == "torch":
            cq, ck = torch.from_numpy(cq), torch.from_numpy(ck)
        return flywheel.flash_attn_varlen_func(q, k, v, cq, ck, 8, 9, causal=True,
                                               return_attn_probs=lse)
    check(lambda: call(False), taken=True)
    check(lambda: call(True), taken=True)


def _numpy_exports_bfloat16():
    """Whether numpy's DLPack export takes ml_dtypes' bfloat16 (ml_dtypes 0.7 on; before it,
    there was no code for it and the export raised)."""
    import ml_dtypes
    try:
        np.zeros(1, ml_dtypes.bfloat16).__dlpack__()
    except (BufferError, TypeError, ValueError):
        return False
    return True


def _bf16_exports():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return _numpy_exports_bfloat16()


def _exportable(family, dtype):
    """Whether the compiled path takes the call: all of them but numpy bfloat16 arrays where
    numpy cannot export them (those calls go the ctypes way)."""
    return not (family == "numpy" and dtype == "bfloat16") or _numpy_exports_bfloat16()


def _cache_call(family, dtype, paged, append, seqlens_int, with_out, sq=1, b=3, sinks=None):
    rng = np.random.default_rng(3)
    hq, hkv, d, S, page = 8, 2, 64, 96, 16
    q, _ = make(rng, (b, sq, hq, d), dtype, family)
    if paged:
        kc, _ = make(rng, (b * S // page, page, hkv, d), dtype, family)
        vc, _ = make(rng, (b * S // page, page, hkv, d), dtype, family)
        bt = np.random.default_rng(4).permutation(b * S // page).astype(np.int32).reshape(b, -1)
    else:
        kc, _ = make(rng, (b, S, hkv, d), dtype, family)
        vc, _ = make(rng, (b, S, hkv, d), dtype, family)
        bt = None
    lens = np.array([40, 7, 80][:b], np.int32)
    kn = vn = None
    if append:
        kn, _ = make(rng, (b, sq, hkv, d), dtype, family)
        vn, _ = make(rng, (b, sq, hkv, d), dtype, family)
    out = None
    if family == "torch":
        lens = torch.from_numpy(lens)
        bt = None if bt is None else torch.from_numpy(bt)
        if with_out:
            out = torch.zeros((b, sq, hq, d), dtype=q.dtype)
    elif with_out:
        out = np.zeros((b, sq, hq, d), q.dtype)
    r = flywheel.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=37 if seqlens_int else lens,
                                         block_table=bt, causal=True, out=out, sinks=sinks)
    return r, kc, vc, out


@fast_only
@pytest.mark.parametrize("family", FAMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("append", [False, True])
def test_kvcache_same_bits(family, dtype, paged, append):
    for seqlens_int in (False, True):
        for with_out in (False, True):
            for sq in (1, 3):
                check(lambda: _cache_call(family, dtype, paged, append, seqlens_int, with_out, sq),
                      taken=_exportable(family, dtype))


@fast_only
@pytest.mark.parametrize("family", FAMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_sinks_same_bits(family, dtype):
    """Attention sinks (of any dtype the library reads, any stride) go the fast path of every
    attention call, with the ctypes path's bits (out, lse, the caches)."""
    def sinks(rng):
        s, _ = make(rng, (16,), dtype, family, scale=2.0)
        return s[::2]

    def func():
        rng = np.random.default_rng(11)
        q, _ = make(rng, (2, 5, 8, 24), "float32", family)
        k, _ = make(rng, (2, 9, 2, 24), "float32", family)
        return flywheel.flash_attn_func(q, k, k, causal=True, return_softmax_lse=True,
                                        sinks=sinks(rng))

    def varlen():
        rng = np.random.default_rng(12)
        q, _ = make(rng, (11, 8, 32), "float16", family)
        k, _ = make(rng, (19, 2, 32), "float16", family)
        cq, ck = np.array([0, 3, 3, 11], np.int32), np.array([0, 7, 10, 19], np.int32)
        return flywheel.flash_attn_varlen_func(q, k, k, cq, ck, 8, 9, causal=True,
                                               return_softmax_lse=True, s_aux=sinks(rng))

    def kvcache(paged):
        return _cache_call(family, "float32", paged, True, False, False, sq=2,
                           sinks=sinks(np.random.default_rng(13)))
    taken = _exportable(family, dtype)
    for call in (func, varlen, lambda: kvcache(False), lambda: kvcache(True)):
        check(call, taken)


def _gdn_call(family, squeeze, with_idx, with_out, l2norm, dtype="bfloat16", kda=False,
              state_dtype="float32", gate_dtype="float32"):
    rng = np.random.default_rng(5)
    N, H, HV, K, V, slots = 3, 2, 4, 16, 24, 5
    lead = (N, 1) if squeeze else (N,)
    q, _ = make(rng, lead + (H, K), dtype, family)
    k, _ = make(rng, lead + (H, K), dtype, family)
    v, _ = make(rng, lead + (HV, V), dtype, family)
    g = -np.abs(rng.standard_normal(lead + ((HV, K) if kda else (HV,)))).astype(np.float32)
    beta = rng.uniform(0, 1, lead + (HV,)).astype(np.float32)
    if gate_dtype != "float32":  # a bf16 model's gates; a strided g
        g, _ = make(rng, lead + ((HV, 2 * K) if kda else (2 * HV,)), gate_dtype, family)
        g = -abs(g[..., ::2])
        beta, _ = make(rng, lead + (HV,), gate_dtype, family)
        beta = abs(beta) / 4
    state = rng.standard_normal((slots, HV, K, V)).astype(np.float32)
    if state_dtype == "bfloat16":
        state, _ = make(rng, (slots, HV, K, V), "bfloat16", family)
    idx = np.array([4, 0, 2], np.int32) if with_idx else None
    out = np.zeros(lead + (HV, V), v.dtype) if family == "numpy" and with_out else None
    if family == "torch" and gate_dtype == "float32":
        g, beta = torch.from_numpy(g), torch.from_numpy(beta)
    if family == "torch":
        state = state if state_dtype == "bfloat16" else torch.from_numpy(state)
        idx = None if idx is None else torch.from_numpy(idx)
        if with_out:
            out = torch.zeros(lead + (HV, V), dtype=v.dtype)
    o = flywheel.gated_delta_rule_decode(q, k, v, g, beta, state, idx,
                                         use_qk_l2norm_in_kernel=l2norm, out=out)
    return o, state, out


@fast_only
@pytest.mark.parametrize("family", FAMS)
@pytest.mark.parametrize("squeeze", [False, True])
@pytest.mark.parametrize("with_idx", [False, True])
def test_gdn_decode_same_bits(family, squeeze, with_idx):
    for with_out in (False, True):
        for l2norm in (False, True):
            check(lambda: _gdn_call(family, squeeze, with_idx, with_out, l2norm, "float16"),
                  taken=True)
            check(lambda: _gdn_call(family, squeeze, with_idx, with_out, l2norm),
                  taken=_exportable(family, "bfloat16"))
            # KDA's g [N, HV, K]; [N, 1, HV, K] goes the ctypes way
            check(lambda: _gdn_call(family, squeeze, with_idx, with_out, l2norm, "float16", True),
                  taken=not squeeze)
            # bf16 states (a bf16 pool, updated in place)
            check(lambda: _gdn_call(family, squeeze, with_idx, with_out, l2norm, "float16",
                                    state_dtype="bfloat16"),
                  taken=_exportable(family, "bfloat16"))
            # bf16 / f16 g and beta (converted to float32 by either path), KDA's g too
            for gd in ("bfloat16", "float16"):
                for kda in (False, True):
                    check(lambda: _gdn_call(family, squeeze, with_idx, with_out, l2norm,
                                            "float16", kda, gate_dtype=gd),
                          taken=_exportable(family, gd) and not (kda and squeeze))


def _conv_call(family, dtype, two_d, L, bias, act, seqlens, idx, with_out, channel_last=False,
               state_dtype=None):
    """causal_conv1d_update on a [slots, D, S] state ([B, D, S] as transformers keeps it, or
    a transposed [slots, S, D] one: channel_last)."""
    rng = np.random.default_rng(7)
    B, D, W, S, slots = 3, 40, 4, 5, 4
    x, _ = make(rng, (B, D) if two_d else (B, D, L), dtype, family)
    if channel_last:
        st, _ = make(rng, (slots, S, D), state_dtype or dtype, family)
        st = st.transpose(1, 2) if family == "torch" else np.swapaxes(st, 1, 2)
    else:
        st, _ = make(rng, (slots, D, S), state_dtype or dtype, family)
    w, _ = make(rng, (D, 1, W), "float32", family)
    b = make(rng, (D,), dtype, family)[0] if bias else None
    lens = np.array([0, 7, 3], np.int32) if seqlens else None
    slot = np.array([3, 0, 1], np.int32) if idx else None
    out = None
    if with_out:
        out = make(rng, tuple(x.shape), dtype, family)[0]
    if family == "torch":
        lens = None if lens is None else torch.from_numpy(lens)
        slot = None if slot is None else torch.from_numpy(slot)
    o = flywheel.causal_conv1d_update(x, st, w, b, activation=act, cache_seqlens=lens,
                                      conv_state_indices=slot, out=out)
    return o, st, out


@fast_only
@pytest.mark.parametrize("family", FAMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("two_d", [False, True])
def test_conv_update_same_bits(family, dtype, two_d):
    for L in ((1,) if two_d else (1, 3)):
        for bias, act in ((False, None), (True, "silu"), (True, "swish")):
            for seqlens in (False, True):
                for idx in (False, True):
                    for with_out in (False, True):
                        check(lambda: _conv_call(family, dtype, two_d, L, bias, act, seqlens, idx,
                                                 with_out),
                              taken=_exportable(family, dtype))
    check(lambda: _conv_call(family, dtype, two_d, 1, True, "silu", True, True, False,
                             channel_last=True, state_dtype="float32"), taken=_exportable(family, dtype))


def _layer_call(family, dtype="bfloat16", with_read=True, zero_tail=True, padded=False,
                eps=None, **over):
    """fused_conv1d_gdn over 2 decodes, a continued prefill of 5 and a new one of 3 tokens,
    then a padding row: (out, conv_state, recurrent_state)."""
    rng = np.random.default_rng(9)
    nkq, nv, dk, dv, K, slots = 2, 4, 16, 8, 4, 6
    dim, T = 2 * nkq * dk + nv * dv, 11
    qkv, _ = make(rng, (T, dim), dtype, family)
    b, _ = make(rng, (T, nv), dtype, family)
    a, _ = make(rng, (T, nv), dtype, family)
    w, _ = make(rng, (dim, 1, K), dtype, family)
    cb, _ = make(rng, (dim,), "float32", family)
    conv, _ = make(rng, (slots, K - 1, dim), dtype, family)
    alog = rng.standard_normal(nv).astype(np.float32) * 0.5
    dtb = rng.standard_normal(nv).astype(np.float32)
    words = nv * dk * dv + (24 if padded else 0)
    pool = (rng.standard_normal((slots, words)) * 0.1).astype(np.float32)
    rec = np.lib.stride_tricks.as_strided(pool, (slots, nv, dk, dv),
                                          (words * 4, dk * dv * 4, dv * 4, 4))
    qsl = np.array([0, 1, 2, 7, 10], np.int32)
    idx = np.array([3, 0, 5, 1], np.int32)
    sl = np.array([9, 4, 12, 3], np.int32)
    read = np.array([3, 2, 5, 1], np.int32) if with_read else None
    dist = np.array([2, 4, 4], np.int32)
    out = np.full((T, nv * dv), 7, qkv.dtype if family == "numpy" else np.float32)
    if family == "torch":
        alog, dtb = torch.from_numpy(alog), torch.from_numpy(dtb)
        pool = torch.from_numpy(pool)
        rec = torch.as_strided(pool, (slots, nv, dk, dv), (words, dk * dv, dv, 1))
        qsl, idx, sl, dist = (torch.from_numpy(x) for x in (qsl, idx, sl, dist))
        read = None if read is None else torch.from_numpy(read)
        out = torch.full((T, nv * dv), 7.0, dtype=qkv.dtype)
    kw = dict(n_kq=nkq, n_v=nv, d_k=dk, d_v=dv, kernel_size=K, l2norm_eps=eps,
              zero_initialize_out=zero_tail, out=out)
    a = over.pop("a", a)
    kw.update(over)
    args = [qkv, b, a, conv, rec, w, cb, alog, dtb, qsl, idx, dist, sl, read]
    (c, r), o = flywheel.fused_conv1d_gdn(*args, **kw)
    assert c is conv and r is rec and o is kw["out"]
    return o, conv, pool


@fast_only
@pytest.mark.parametrize("family", FAMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gdn_layer_same_bits(family, dtype):
    for opts in (dict(), dict(with_read=False), dict(zero_tail=False), dict(padded=True),
                 dict(eps=1e-5)):
        check(lambda: _layer_call(family, dtype, **opts), taken=_exportable(family, dtype))


@fast_only
def test_gdn_layer_declined_as_ctypes():
    """Calls the layer's fast path leaves to the ctypes path: no out (a new one), isa=, int64
    indices, KDA's a width under fused_conv1d_gdn, a kernel_size the weights do not have."""
    check(lambda: _layer_call("numpy", "float32", isa="portable"), taken=False)
    check(lambda: _layer_call("numpy", "float32", precision="f32"), taken=False)
    with pytest.raises(ValueError, match="kernel_size"):
        _layer_call("numpy", "float32", kernel_size=3)
    fast, slow, n_fast, _ = both_paths(lambda: _layer_call("numpy", "float32", kernel_size=3))
    assert fast == slow and n_fast == 0
    rng = np.random.default_rng(1)
    wide = rng.standard_normal((11, 4 * 16)).astype(np.float32)
    fast, slow, n_fast, _ = both_paths(lambda: _layer_call("numpy", "float32", a=wide))
    assert fast == slow and fast[0] == "raised" and n_fast == 0


def _readonly(x):
    x = np.array(x)
    x.setflags(write=False)
    return x


# calls the fast path must leave to the ctypes path, which copies, converts or refuses them
def _declined_cases():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    kv = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    cases = {
        "float64 q": lambda: flywheel.flash_attn_func(q.astype(np.float64), kv, kv),
        "read-only out": lambda: flywheel.flash_attn_func(q, kv, kv, out=_readonly(np.zeros_like(q))),
        "read-only q (read only, so it runs)": lambda: flywheel.flash_attn_func(_readonly(q), kv, kv),
        "negative strides": lambda: flywheel.flash_attn_func(q[:, ::-1], kv, kv),
        "list q": lambda: flywheel.flash_attn_func(q.tolist(), kv, kv),
        "float window": lambda: flywheel.flash_attn_func(q, kv, kv, window_size=(2.0, -1)),
        "window list": lambda: flywheel.flash_attn_func(q, kv, kv, window_size=[2, 0]),
        "scale 0": lambda: flywheel.flash_attn_func(q, kv, kv, softmax_scale=0),
        "scale 1e-50": lambda: flywheel.flash_attn_func(q, kv, kv, softmax_scale=1e-50),
        "scale inf": lambda: flywheel.flash_attn_func(q, kv, kv, softmax_scale=float("inf")),
        "numpy scale": lambda: flywheel.flash_attn_func(q, kv, kv, softmax_scale=np.float32(0.3)),
        "q and k of two dtypes": lambda: flywheel.flash_attn_func(q.astype(np.float16), kv, kv),
        "head dims differ": lambda: flywheel.flash_attn_func(q, kv[..., :4], kv),
        "3-D q": lambda: flywheel.flash_attn_func(q[0], kv, kv),
        "int64 cu_seqlens": lambda: flywheel.flash_attn_varlen_func(
            q[0], kv[0], kv[0], np.array([0, 4], np.int64), np.array([0, 6], np.int64), 4, 6),
        "max_seqlen short": lambda: flywheel.flash_attn_varlen_func(
            q[0], kv[0], kv[0], np.array([0, 4], np.int32), np.array([0, 6], np.int32), 3, 6),
        "cu_seqlens decreasing": lambda: flywheel.flash_attn_varlen_func(
            q[0], kv[0], kv[0], np.array([0, 5, 4], np.int32), np.array([0, 3, 6], np.int32),
            5, 6),
        "kvcache int64 seqlens": lambda: flywheel.flash_attn_with_kvcache(
            q, kv.copy(), kv.copy(), cache_seqlens=np.array([3], np.int64)),
        "kvcache seqlens too long": lambda: flywheel.flash_attn_with_kvcache(
            q, kv.copy(), kv.copy(), cache_seqlens=9),
        "kvcache read-only cache appended": lambda: flywheel.flash_attn_with_kvcache(
            q, _readonly(kv), kv.copy(), kv[:, :4], kv[:, :4], cache_seqlens=0),
        "kvcache k without v": lambda: flywheel.flash_attn_with_kvcache(
            q, kv.copy(), kv.copy(), kv[:, :4], None, cache_seqlens=0),
        "float64 sinks": lambda: flywheel.flash_attn_func(q, kv, kv, sinks=np.ones(2)),
        "sinks list": lambda: flywheel.flash_attn_func(q, kv, kv, sinks=[0.5, 1.0]),
        "int32 sinks": lambda: flywheel.flash_attn_func(q, kv, kv, sinks=np.ones(2, np.int32)),
        "2-D sinks": lambda: flywheel.flash_attn_func(q, kv, kv,
                                                      sinks=np.ones((1, 2), np.float32)),
        "sinks too short": lambda: flywheel.flash_attn_varlen_func(
            q[0], kv[0], kv[0], np.array([0, 4], np.int32), np.array([0, 6], np.int32), 4, 6,
            sinks=np.ones(1, np.float32)),
        "kvcache sinks too long, appended": lambda: flywheel.flash_attn_with_kvcache(
            q, kv.copy(), kv.copy(), kv[:, :4], kv[:, :4], cache_seqlens=0,
            sinks=np.ones(3, np.float32)),
        "sinks and s_aux": lambda: flywheel.flash_attn_func(
            q, kv, kv, sinks=np.ones(2, np.float32), s_aux=np.ones(2, np.float32)),
        "gdn float64 g": lambda: flywheel.gated_delta_rule_decode(
            q[0, :2], q[0, :2], q[0, :2], np.zeros((2, 2), np.float64), np.zeros((2, 2), np.float32),
            np.zeros((2, 2, 8, 8), np.float32)),
        "conv float64 x": lambda: flywheel.causal_conv1d_update(
            np.zeros((2, 8, 1)), np.zeros((2, 8, 3), np.float32), np.ones((8, 4), np.float32)),
        "conv gelu": lambda: flywheel.causal_conv1d_update(
            q[0, :2], np.zeros((2, 4, 3), np.float32), np.ones((4, 4), np.float32),
            activation="gelu"),
        "conv read-only state": lambda: flywheel.causal_conv1d_update(
            q[0, :2], _readonly(np.zeros((2, 4, 3), np.float32)), np.ones((4, 4), np.float32)),
        "conv int64 slots": lambda: flywheel.causal_conv1d_update(
            q[0, :2], np.zeros((2, 4, 3), np.float32), np.ones((4, 4), np.float32),
            conv_state_indices=np.array([1, 0], np.int64)),
        "conv dim differs": lambda: flywheel.causal_conv1d_update(
            q[0, :2], np.zeros((2, 5, 3), np.float32), np.ones((4, 4), np.float32)),
        "conv too few slots": lambda: flywheel.causal_conv1d_update(
            q[0, :2], np.zeros((1, 4, 3), np.float32), np.ones((4, 4), np.float32)),
        "conv slots alias": lambda: flywheel.causal_conv1d_update(
            q[0, :2], np.zeros((2, 4, 3), np.float32), np.ones((4, 4), np.float32),
            conv_state_indices=np.array([1, 1], np.int32)),
        "gdn float64 state": lambda: flywheel.gated_delta_rule_decode(
            q[0, :2], q[0, :2], q[0, :2], np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32),
            np.zeros((2, 2, 8, 8), np.float64)),
        "gdn bf16 state, negative slot": lambda: flywheel.gated_delta_rule_decode(
            q[0, :2], q[0, :2], q[0, :2], np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32),
            torch.zeros(3, 2, 8, 8, dtype=torch.bfloat16) if torch is not None
            else np.zeros((3, 2, 8, 8), np.float32), np.array([1, -1], np.int32)),
        "gdn duplicate slots": lambda: flywheel.gated_delta_rule_decode(
            q[0, :2], q[0, :2], q[0, :2], np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32),
            np.zeros((2, 2, 8, 8), np.float32), np.array([1, 1], np.int32)),
    }
    if _bf16_exports():
        import ml_dtypes
        bf = ml_dtypes.bfloat16
        # an empty bf16 out whose byte strides are not whole elements: numpy exports it (as
        # whole elements that merge), the Python path refuses to merge its [b, sq] (found
        # by the binding fuzzer: the fast path ran the empty call)
        cases["kvcache empty out, odd strides"] = lambda: flywheel.flash_attn_with_kvcache(
            np.zeros((0, 2, 2, 8), bf), np.zeros((1, 6, 2, 8), bf), np.zeros((1, 6, 2, 8), bf),
            cache_seqlens=np.zeros(0, np.int32),
            out=np.ndarray((0, 2, 2, 8), bf, buffer=np.zeros(64, np.uint8),
                           strides=(217, 108, 27, 3)))
    if torch is not None:
        tq = torch.from_numpy(q).requires_grad_()
        cases["torch q with numpy k"] = lambda: flywheel.flash_attn_func(tq.detach(), kv, kv)
        # grad mode on: a conv update has no backward (the Python path refuses it)
        tw = torch.ones(2, 4, requires_grad=True)
        cases["conv weight requiring grad"] = lambda: flywheel.causal_conv1d_update(
            torch.from_numpy(q[0, :2]), torch.zeros(2, 2, 3), tw)
    return cases


@fast_only
@pytest.mark.skipif(torch is None, reason="needs torch")
def test_no_grad_parameters_taken():
    """Under torch.no_grad() a tensor that requires grad (a model's conv weight, as
    transformers passes it at inference) is an input like any other: the fast path takes the
    call (it declined them all, so every conv update of a model ran through ctypes)."""
    def call():
        rng = np.random.default_rng(8)
        x, _ = make(rng, (2, 16, 1), "bfloat16", "torch")
        st, _ = make(rng, (2, 16, 4), "bfloat16", "torch")
        w = torch.nn.Parameter(make(rng, (16, 1, 4), "bfloat16", "torch")[0])
        with torch.no_grad():
            return flywheel.causal_conv1d_update(x, st, w.squeeze(1), None, "silu"), st
    check(call, taken=True)
    assert torch.is_grad_enabled()
    # with grad on, the differentiable path (attention's autograd.Function) is Python's, and
    # its forward, which runs with grad off, takes the fast path
    rng = np.random.default_rng(6)
    tq = torch.from_numpy(rng.standard_normal((1, 4, 2, 8)).astype(np.float32)).requires_grad_()
    tk = torch.from_numpy(rng.standard_normal((1, 6, 2, 8)).astype(np.float32))
    check(lambda: flywheel.flash_attn_func(tq, tk, tk).detach(), taken=True)


@fast_only
@pytest.mark.parametrize("name", list(_declined_cases()))
def test_declined_behaves_as_ctypes(name):
    check(_declined_cases()[name], taken=False)


@fast_only
def test_binding_reports_compiled():
    kind, origin = _lib.binding()
    assert kind == "compiled" and origin.endswith("_fwext.abi3.so")


def test_dlpack_producer_inputs():
    """A DLPack producer that is neither numpy nor torch (JAX) is read as numpy, the result is
    numpy, and it is the numpy input's result."""
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 5, 4, 16)).astype(np.float32)
    kv = rng.standard_normal((1, 7, 2, 16)).astype(np.float32)
    want = flywheel.flash_attn_func(q, kv, kv, causal=True)
    got = flywheel.flash_attn_func(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(kv), causal=True)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="read-only"):
        flywheel.flash_attn_func(q, kv, kv, out=jnp.zeros((1, 5, 4, 16), jnp.float32))


class _Producer:
    """A minimal DLPack producer (what a third-party array type offers)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_any_dlpack_producer_inputs():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 3, 2, 8)).astype(np.float16)
    kv = rng.standard_normal((1, 4, 1, 8)).astype(np.float16)
    got = flywheel.flash_attn_func(_Producer(q), _Producer(kv), _Producer(kv))
    assert isinstance(got, np.ndarray) and got.dtype == np.float16
    np.testing.assert_array_equal(got, flywheel.flash_attn_func(q, kv, kv))
