"""flywheel.jax: the XLA FFI custom calls under jax.jit, and flywheel.tpu's calls on traced
values. jit and eager calls run the same handler as the numpy binding's call and must give
its bits; gradients are checked against float64 autodiff; donated caches change in place."""

import functools

import numpy as np
import pytest

from conftest import make, ref_attention, round_to

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import flywheel  # noqa: E402
import flywheel.jax as fj  # noqa: E402  (jax is installed: the handlers must be built)
import flywheel.tpu as tpu  # noqa: E402

CASES = [  # (b, sq, sk, hq, hkv, d, dv, causal, window, softcap, sinks)
    (2, 33, 40, 8, 2, 64, 64, True, (-1, -1), 0.0, False),
    (1, 17, 17, 4, 4, 32, 48, False, (5, 3), 0.0, False),
    (3, 1, 70, 6, 3, 16, 16, True, (-1, -1), 30.0, True),
    (1, 50, 29, 4, 1, 8, 8, False, (-1, -1), 0.0, True),
]


def _inputs(case, dtype, seed):
    b, sq, sk, hq, hkv, d, dv = case[:7]
    rng = np.random.default_rng(seed)
    q, _ = make(rng, (b, sq, hq, d), dtype, "numpy")
    k, _ = make(rng, (b, sk, hkv, d), dtype, "numpy")
    v, _ = make(rng, (b, sk, hkv, dv), dtype, "numpy")
    s = (rng.standard_normal(hq) * 2).astype(np.float32) if case[10] else None
    return q, k, v, s


def _opts(case):
    return dict(causal=case[7], window_size=case[8], softcap=case[9])


def _bits(a, b):
    return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES)
def test_forward_jit_eager_and_library_agree(case, dtype):
    q, k, v, s = _inputs(case, dtype, 1)
    want, want_lse = flywheel.flash_attn_func(q, k, v, return_softmax_lse=True, sinks=s,
                                              **_opts(case))
    call = lambda q, k, v, s: fj.flash_attn_func(q, k, v, return_softmax_lse=True, sinks=s,
                                                 **_opts(case))
    args = [jnp.asarray(x) if x is not None else None for x in (q, k, v, s)]
    for out, lse in (jax.jit(call)(*args), call(*args)):
        assert out.dtype == jnp.dtype(dtype) and out.shape == want.shape
        assert _bits(out, want) and _bits(lse, want_lse)
    # and the float64 reference, on the first sequence
    f64 = [x.astype(np.float64) if x is not None else None for x in (q, k, v)]
    ro, _ = ref_attention(f64[0][0], f64[1][0], f64[2][0], case[5] ** -0.5, case[7], case[8],
                          case[9], sinks=s)
    err = np.abs(np.asarray(want[0], np.float64) - round_to(ro, dtype)).max()
    assert err <= {"float32": 2e-5, "bfloat16": 3e-2, "float16": 3e-3}[dtype]


@pytest.mark.parametrize("case", CASES[:2])
def test_head_major_is_the_token_major_call_transposed(case):
    q, k, v, s = _inputs(case, "bfloat16", 2)
    want = flywheel.flash_attn_func(q, k, v, sinks=s, **_opts(case))
    hm = [jnp.asarray(x).transpose(0, 2, 1, 3) for x in (q, k, v)]
    out = jax.jit(lambda a, b, c: fj.flash_attn_func(a, b, c, head_major=True, sinks=s,
                                                     **_opts(case)))(*hm)
    assert _bits(np.asarray(out).transpose(0, 2, 1, 3), want)


def _dense64(q, k, v, s, causal, window, softcap, scale):
    """float64 attention in JAX, [b, s, h, d], for autodiff."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, 2), jnp.repeat(v, g, 2)
    x = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        x = softcap * jnp.tanh(x / softcap)
    sq, sk = q.shape[1], k.shape[1]
    i, j = jnp.arange(sq)[:, None] + sk - sq, jnp.arange(sk)[None, :]
    left, right = window
    right = 0 if causal else right
    ok = jnp.ones((sq, sk), bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    x = jnp.where(ok, x, -jnp.inf)
    if s is not None:  # the sink as one more logit that adds no value row
        x = jnp.concatenate([x, jnp.broadcast_to(s[None, :, None, None], x.shape[:3] + (1,))], -1)
        v = jnp.concatenate([v, jnp.zeros(v.shape[:1] + (1,) + v.shape[2:], v.dtype)], 1)
    p = jax.nn.softmax(x, -1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("case", CASES)
def test_grads_match_float64_autodiff(case):
    q, k, v, s = _inputs(case, "float32", 3)
    w = np.random.default_rng(4).standard_normal((case[0], case[1], case[3], case[6]))
    argn = (0, 1, 2) if s is None else (0, 1, 2, 3)
    loss = lambda q, k, v, s: (fj.flash_attn_func(q, k, v, sinks=s, **_opts(case)) *
                               w.astype(np.float32)).sum()
    got = jax.jit(jax.grad(loss, argnums=argn))(*(jnp.asarray(x) if x is not None else None
                                                 for x in (q, k, v, s)))
    with jax.enable_x64(True):
        loss64 = lambda q, k, v, s: (_dense64(q, k, v, s, case[7], case[8], case[9],
                                              case[5] ** -0.5) * w).sum()
        want = jax.grad(loss64, argnums=argn)(*(jnp.asarray(x, jnp.float64) if x is not None
                                                else None for x in (q, k, v, s)))
        want = [np.asarray(x) for x in want]
    for name, a, b in zip("q k v sinks".split(), got, want):
        assert a.shape == b.shape and a.dtype == jnp.float32
        err = np.abs(np.asarray(a).astype(np.float64) - b).max()
        assert err <= 2e-5 * max(1.0, np.abs(b).max()), (name, err)


def test_kvcache_donated_caches_are_appended_in_place():
    b, S, hq, hkv, d, n = 2, 64, 8, 2, 32, 3
    rng = np.random.default_rng(5)
    kc, _ = make(rng, (b, S, hkv, d), "bfloat16", "numpy")
    vc, _ = make(rng, (b, S, hkv, d), "bfloat16", "numpy")
    q, _ = make(rng, (b, n, hq, d), "bfloat16", "numpy")
    kn, _ = make(rng, (b, n, hkv, d), "bfloat16", "numpy")
    vn, _ = make(rng, (b, n, hkv, d), "bfloat16", "numpy")
    lens = np.array([20, 41], np.int32)
    wk, wv = kc.copy(), vc.copy()
    want, want_lse = flywheel.flash_attn_with_kvcache(q, wk, wv, kn, vn, cache_seqlens=lens,
                                                      causal=True, return_softmax_lse=True)
    step = jax.jit(lambda q, kc, vc, kn, vn, lens: fj.flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=lens, causal=True, return_softmax_lse=True),
        donate_argnums=(1, 2))
    KC, VC = jnp.asarray(kc), jnp.asarray(vc)
    addr = (KC.unsafe_buffer_pointer(), VC.unsafe_buffer_pointer())
    out, lse, KC2, VC2 = step(jnp.asarray(q), KC, VC, jnp.asarray(kn), jnp.asarray(vn),
                              jnp.asarray(lens))
    assert (KC2.unsafe_buffer_pointer(), VC2.unsafe_buffer_pointer()) == addr
    assert KC.is_deleted() and VC.is_deleted()
    assert _bits(out, want) and _bits(lse, want_lse)
    assert _bits(KC2, wk) and _bits(VC2, wv)


def test_kvcache_without_donation_leaves_the_caches():
    b, S, hq, hkv, d = 1, 16, 2, 1, 8
    rng = np.random.default_rng(6)
    kc, _ = make(rng, (b, S, hkv, d), "float32", "numpy")
    q, _ = make(rng, (b, 1, hq, d), "float32", "numpy")
    kn, _ = make(rng, (b, 1, hkv, d), "float32", "numpy")
    KC = jnp.asarray(kc)
    out, KC2, VC2 = jax.jit(lambda *a: fj.flash_attn_with_kvcache(*a, cache_seqlens=5))(
        jnp.asarray(q), KC, KC, jnp.asarray(kn), jnp.asarray(kn))
    assert _bits(KC, kc) and not KC.is_deleted()
    assert _bits(np.asarray(KC2)[0, 5], kn[0, 0]) and _bits(np.asarray(VC2)[0, 5], kn[0, 0])
    wk, wv = kc.copy(), kc.copy()
    want = flywheel.flash_attn_with_kvcache(q, wk, wv, kn, kn, cache_seqlens=5)
    assert _bits(out, want)


def test_vmap_runs_the_call_per_element():
    case = CASES[0]
    q, k, v, _ = _inputs(case, "float32", 7)
    stack = lambda x: jnp.stack([jnp.asarray(x), jnp.asarray(x) * 0.5])
    out = jax.vmap(lambda a, b, c: fj.flash_attn_func(a, b, c, causal=True))(
        stack(q), stack(k), stack(v))
    assert _bits(out[0], flywheel.flash_attn_func(q, k, v, causal=True))
    assert _bits(out[1], flywheel.flash_attn_func(q * 0.5, k * 0.5, v * 0.5, causal=True))


def test_bad_input_raises_at_trace_time():
    x = jnp.zeros((1, 4, 2, 8), jnp.float32)
    f = lambda *a, **kw: jax.jit(lambda *b: fj.flash_attn_func(*b, **kw))(*a)
    with pytest.raises(ValueError, match="must be"):
        f(x[0], x, x)
    with pytest.raises(TypeError, match="one dtype"):
        f(x, x.astype(jnp.bfloat16), x)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        f(x.astype(jnp.int32), x, x)
    with pytest.raises(ValueError, match="divide"):
        f(jnp.zeros((1, 4, 3, 8)), x, x)
    with pytest.raises(ValueError, match="incompatible"):
        f(x, jnp.zeros((1, 4, 2, 4)), x)
    with pytest.raises(ValueError, match="sinks"):
        f(x, x, x, sinks=jnp.zeros(3))
    with pytest.raises(NotImplementedError):
        f(x, x, x, dropout_p=0.1)
    with pytest.raises(ValueError, match="softcap"):
        f(x, x, x, softcap=-1.0)
    with pytest.raises(ValueError, match="cache_seqlens"):
        fj.flash_attn_with_kvcache(x, x, x)


def test_library_refusals_come_back_as_xla_errors():
    # a context past the cache's capacity is found by the library when the call runs: its
    # message comes back, and the donated cache is not written
    x = jnp.zeros((1, 1, 2, 8), jnp.float32)
    kc = jnp.ones((1, 4, 2, 8), jnp.float32)
    with pytest.raises(Exception, match="cache rows"):
        out = fj.flash_attn_with_kvcache(x, kc, kc, x, x, cache_seqlens=4)
        jax.block_until_ready(out)
    assert _bits(kc, np.ones((1, 4, 2, 8), np.float32))


# ------------------------------------------------------------------ flywheel.tpu --

@pytest.mark.parametrize("token_major", [False, True])
def test_tpu_flash_attn_func_under_jit_gives_the_eager_bits(token_major):
    b, sq, sk, hq, hkv, d = 2, 24, 31, 4, 2, 32
    rng = np.random.default_rng(8)
    q, _ = make(rng, (b, hq, sq, d), "bfloat16", "numpy")
    k, _ = make(rng, (b, hkv, sk, d), "bfloat16", "numpy")
    v, _ = make(rng, (b, hkv, sk, d), "bfloat16", "numpy")
    if token_major:
        q, k, v = (x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1) for x in (q, k, v))
    kw = dict(causal=True, window_size=(9, -1), return_softmax_lse=True,
              head_dim=d if token_major else None, token_major=token_major)
    eager = tpu.flash_attn_func(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), **kw)
    jitted = jax.jit(lambda a, b, c: tpu.flash_attn_func(a, b, c, **kw))(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert _bits(jitted[0], eager[0]) and _bits(jitted[1], eager[1])
    g = jax.grad(lambda a: tpu.flash_attn_func(a, jnp.asarray(k), jnp.asarray(v), causal=True,
                                               head_dim=d if token_major else None,
                                               token_major=token_major).astype(
                                                   jnp.float32).sum())(jnp.asarray(q))
    assert g.shape == q.shape and bool(jnp.isfinite(g.astype(jnp.float32)).all())


def test_tpu_with_kvcache_under_jit_appends_in_place():
    b, S, hq, hkv, d = 2, 32, 4, 2, 16
    rng = np.random.default_rng(9)
    kc, _ = make(rng, (b, S, hkv, d), "bfloat16", "numpy")
    vc, _ = make(rng, (b, S, hkv, d), "bfloat16", "numpy")
    q, _ = make(rng, (b, 1, hq, d), "bfloat16", "numpy")
    kn, _ = make(rng, (b, 1, hkv, d), "bfloat16", "numpy")
    lens = np.array([3, 30], np.int32)
    eager = tpu.flash_attn_with_kvcache(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc),
                                        jnp.asarray(kn), jnp.asarray(kn),
                                        cache_seqlens=jnp.asarray(lens), causal=True)
    step = jax.jit(lambda q, kc, vc, kn, lens: tpu.flash_attn_with_kvcache(
        q, kc, vc, kn, kn, cache_seqlens=lens, causal=True), donate_argnums=(1, 2))
    KC = jnp.asarray(kc)
    addr = KC.unsafe_buffer_pointer()
    got = step(jnp.asarray(q), KC, jnp.asarray(vc), jnp.asarray(kn), jnp.asarray(lens))
    assert got[1].unsafe_buffer_pointer() == addr
    assert all(_bits(a, e) for a, e in zip(got, eager))


@pytest.mark.parametrize("form", ["heads_outer_fold", "rotary", "rotary_q_only"])
def test_tpu_folded_and_rotary_forms_under_jit_give_the_eager_bits(form):
    rng = np.random.default_rng(18)
    hq, hkv, b, sq, sk, d = 4, 2, 2, 9, 13, 32
    kw = dict(causal=True)
    if form == "heads_outer_fold":
        shapes = ((hq, b, sq, d), (hkv, b, sk, d))
        kw["heads_outer_fold"] = True
    else:
        shapes = ((b, hq, sq, d), (b, hkv, sk, d))
        cos = np.cos(np.arange(16)[:, None] * 0.1 * np.arange(1, 9)).astype(np.float32)
        sin = np.sin(np.arange(16)[:, None] * 0.1 * np.arange(1, 9)).astype(np.float32)
        kw.update(rotary_cos=jnp.asarray(cos), rotary_sin=jnp.asarray(sin),
                  rotary_k=form != "rotary_q_only", rotary_interleaved=True)
    q, _ = make(rng, shapes[0], "bfloat16", "numpy")
    k, _ = make(rng, shapes[1], "bfloat16", "numpy")
    args = [jnp.asarray(x) for x in (q, k, k)]
    eager = tpu.flash_attn_func(*args, **kw)
    jitted = jax.jit(lambda *a: tpu.flash_attn_func(*a, **kw))(*args)
    assert _bits(jitted, eager)
    if form == "rotary":
        with pytest.raises(NotImplementedError, match="rotary"):
            jax.grad(lambda a: tpu.flash_attn_func(a, *args[1:], **kw).astype(
                jnp.float32).sum())(args[0])
    if form != "heads_outer_fold":  # the packed call's rotary tables: per-sequence positions
        qp, _ = make(rng, (hq, 20, d), "bfloat16", "numpy")
        kp, _ = make(rng, (hkv, 20, d), "bfloat16", "numpy")
        cu = jnp.array([0, 7, 20], jnp.int32)
        vkw = {n: x for n, x in kw.items() if n.startswith("rotary")}
        pargs = [jnp.asarray(x) for x in (qp, kp, kp)]
        eager = tpu.flash_attn_varlen_func(*pargs, cu, cu, 13, 13, causal=True, **vkw)
        jitted = jax.jit(lambda *a: tpu.flash_attn_varlen_func(*a, 13, 13, causal=True, **vkw))(
            *pargs, cu, cu)
        assert _bits(jitted, eager)


# ----------------------------------------------------------------- packed calls --

def _packed(rng, lens_q, lens_k, hq, hkv, d, dv, dtype, pad_q=0, pad_k=0):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, _ = make(rng, (cu_q[-1] + pad_q, hq, d), dtype, "numpy")
    k, _ = make(rng, (cu_k[-1] + pad_k, hkv, d), dtype, "numpy")
    v, _ = make(rng, (cu_k[-1] + pad_k, hkv, dv), dtype, "numpy")
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_major", [False, True])
def test_varlen_gives_the_library_bits_and_pads(dtype, head_major):
    rng = np.random.default_rng(10)
    q, k, v, cu_q, cu_k = _packed(rng, [5, 0, 17, 1], [9, 3, 17, 30], 6, 2, 32, 16, dtype,
                                  pad_q=4, pad_k=2)
    used_q, used_k = cu_q[-1], cu_k[-1]
    want, want_lse = flywheel.flash_attn_varlen_func(
        q[:used_q], k[:used_k], v[:used_k], cu_q, cu_k, 17, 30, causal=True,
        window_size=(6, -1), return_softmax_lse=True)
    hm = (lambda x: jnp.asarray(x).transpose(1, 0, 2)) if head_major else jnp.asarray
    f = jax.jit(lambda q, k, v, a, b: fj.flash_attn_varlen_func(
        q, k, v, a, b, causal=True, window_size=(6, -1), return_softmax_lse=True,
        head_major=head_major))
    out, lse = f(hm(q), hm(k), hm(v), jnp.asarray(cu_q), jnp.asarray(cu_k))
    out = np.asarray(out).transpose(1, 0, 2) if head_major else np.asarray(out)
    assert _bits(out[:used_q], want) and _bits(np.asarray(lse)[:, :used_q], want_lse)
    assert not np.asarray(out[used_q:], np.float32).any()
    assert np.isneginf(np.asarray(lse)[:, used_q:]).all()


def test_varlen_grads_match_float64_per_sequence():
    rng = np.random.default_rng(11)
    lens_q, lens_k = [4, 9, 1], [7, 9, 12]
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, 4, 2, 16, 8, "float32", pad_q=3, pad_k=1)
    s = rng.standard_normal(4).astype(np.float32)
    w = rng.standard_normal((q.shape[0], 4, 8))
    loss = lambda q, k, v, s: (fj.flash_attn_varlen_func(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), causal=True, softcap=20.0,
        sinks=s) * w.astype(np.float32)).sum()
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(jnp.asarray(x) for x in (q, k, v, s)))
    want = [np.zeros(x.shape) for x in (q, k, v, s)]
    with jax.enable_x64(True):
        for i in range(3):
            a, b, c, e = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
            loss64 = lambda q, k, v, s: (_dense64(q[None], k[None], v[None], s, True, (-1, -1),
                                                  20.0, 0.25)[0] * w[a:b]).sum()
            g = [np.asarray(x) for x in jax.grad(loss64, argnums=(0, 1, 2, 3))(
                *(jnp.asarray(x, jnp.float64) for x in (q[a:b], k[c:e], v[c:e], s)))]
            want[0][a:b] += g[0]
            want[1][c:e] += g[1]
            want[2][c:e] += g[2]
            want[3] += g[3]
    for name, a, b in zip("q k v sinks".split(), got, want):
        err = np.abs(np.asarray(a).astype(np.float64) - b).max()
        assert err <= 2e-5 * max(1.0, np.abs(b).max()), (name, err)
    assert not np.asarray(got[0])[cu_q[-1]:].any() and not np.asarray(got[1])[cu_k[-1]:].any()


@pytest.mark.parametrize("form", ["paged", "packed", "batch_idx"])
def test_kvcache_forms_give_the_library_bits(form):
    rng = np.random.default_rng(12)
    hq, hkv, d, page = 4, 2, 16, 16
    lens = np.array([7, 30, 0], np.int32)
    n = np.array([1, 3, 2]) if form == "packed" else np.array([2, 2, 2])
    kw = {}
    if form == "paged":
        kc, _ = make(rng, (9, page, hkv, d), "bfloat16", "numpy")
        kw["block_table"] = rng.permutation(9)[:9].reshape(3, 3).astype(np.int32)
    else:
        kc, _ = make(rng, (4, 48, hkv, d), "bfloat16", "numpy")
        if form == "batch_idx":
            kw["cache_batch_idx"] = np.array([3, 0, 2], np.int32)
    vc = (kc.astype(np.float32) * 0.5).astype(kc.dtype)
    if form == "packed":
        kw["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
        shape = (int(n.sum()),)
    else:
        shape = (3, 2)
    q, _ = make(rng, shape + (hq, d), "bfloat16", "numpy")
    kn, _ = make(rng, shape + (hkv, d), "bfloat16", "numpy")
    wk, wv = kc.copy(), vc.copy()
    want = flywheel.flash_attn_with_kvcache(q, wk, wv, kn, kn, cache_seqlens=lens, causal=True,
                                            return_softmax_lse=True, **kw)
    jkw = {k_: jnp.asarray(x) for k_, x in kw.items()}
    got = jax.jit(lambda q, kc, vc, kn, lens, kw: fj.flash_attn_with_kvcache(
        q, kc, vc, kn, kn, cache_seqlens=lens, causal=True, return_softmax_lse=True, **kw),
        donate_argnums=(1, 2))(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc),
                               jnp.asarray(kn), jnp.asarray(lens), jkw)
    for a, b in zip(got, (want[0], want[1], wk, wv)):
        assert _bits(a, b)


# ------------------------------------------------- flywheel.tpu's packed forms --

def _merged(kc, vc):
    kv = np.empty(kc.shape[:2] + (2 * kc.shape[2], kc.shape[3]), kc.dtype)
    kv[:, :, 0::2], kv[:, :, 1::2] = kc, vc
    return kv


@pytest.mark.parametrize("token_major", [False, True])
def test_tpu_varlen_under_jit_gives_the_eager_bits(token_major):
    rng = np.random.default_rng(13)
    q, k, v, cu_q, cu_k = _packed(rng, [3, 11], [8, 11], 4, 2, 16, 16, "bfloat16", pad_q=2)
    if token_major:
        q, k, v = (x.reshape(x.shape[0], -1) for x in (q, k, v))
    else:
        q, k, v = (x.transpose(1, 0, 2).copy() for x in (q, k, v))
    kw = dict(causal=True, return_softmax_lse=True, head_dim=16 if token_major else None,
              token_major=token_major)
    args = [jnp.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    eager = tpu.flash_attn_varlen_func(*args, 11, 11, **kw)
    jitted = jax.jit(lambda *a: tpu.flash_attn_varlen_func(*a, 11, 11, **kw))(*args)
    assert _bits(jitted[0], eager[0]) and _bits(jitted[1], eager[1])


@pytest.mark.parametrize("page", [16, 131072])
def test_tpu_paged_calls_under_jit_give_the_eager_bits(page):
    rng = np.random.default_rng(14)
    hq, hkv, d = 4, 2, 8
    pages = 7 if page == 16 else 2
    kc, _ = make(rng, (pages, page, hkv, d), "bfloat16", "numpy")
    vc, _ = make(rng, (pages, page, hkv, d), "bfloat16", "numpy")
    kv = _merged(kc, vc)
    table = (np.array([[4, 1, 6], [0, 2, 5], [3, 3, 3]]) if page == 16
             else np.array([[1], [0], [0]])).astype(np.int32)
    lens = np.array([20, 33, 2], np.int32)
    # the paged varlen read (head-major q, num_active traced, padding rows)
    nq = np.array([2, 3, 1])
    cu = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    q, _ = make(rng, (hq, cu[-1] + 2, d), "bfloat16", "numpy")
    args = (jnp.asarray(q), jnp.asarray(kv), None, jnp.asarray(cu), None)
    kw = dict(causal=True, return_softmax_lse=True, block_table=jnp.asarray(table),
              seqused_k=jnp.asarray(lens))
    for na in (3, 2):
        eager = tpu.flash_attn_varlen_func(*args, 4, 64, num_active=na, **kw)
        jitted = jax.jit(lambda q, kv, cu, na: tpu.flash_attn_varlen_func(
            q, kv, None, cu, None, 4, 64, num_active=na, **kw))(args[0], args[1], args[3],
                                                                jnp.asarray(na))
        assert _bits(jitted[0], eager[0]) and _bits(jitted[1], eager[1])
    # the append into the merged cache, donated: in place
    qd, _ = make(rng, (3, 2, hq, d), "bfloat16", "numpy")
    kn, _ = make(rng, (3, 2, hkv, d), "bfloat16", "numpy")
    kw = dict(cache_seqlens=jnp.asarray(lens), block_table=jnp.asarray(table), causal=True,
              return_softmax_lse=True, num_active=2)
    eager = tpu.flash_attn_with_kvcache(jnp.asarray(qd), jnp.asarray(kv), None, jnp.asarray(kn),
                                        jnp.asarray(kn), **kw)
    KV = jnp.asarray(kv)
    addr = KV.unsafe_buffer_pointer()
    step = jax.jit(lambda q, kv, kn: tpu.flash_attn_with_kvcache(q, kv, None, kn, kn, **kw),
                   donate_argnums=(1,))
    jitted = step(jnp.asarray(qd), KV, jnp.asarray(kn))
    assert jitted[2].unsafe_buffer_pointer() == addr
    assert all(_bits(a, e) for a, e in zip(jitted, eager))


def test_tpu_ragged_and_batch_idx_kvcache_under_jit():
    rng = np.random.default_rng(15)
    hq, hkv, d = 4, 1, 16
    kc, _ = make(rng, (3, 40, hkv, d), "float32", "numpy")
    vc, _ = make(rng, (3, 40, hkv, d), "float32", "numpy")
    cu = np.array([0, 2, 2, 5], np.int32)
    q, _ = make(rng, (6, hq, d), "float32", "numpy")
    kn, _ = make(rng, (6, hkv, d), "float32", "numpy")
    kw = dict(cache_seqlens=np.array([4, 9, 1], np.int32),
              cache_batch_idx=np.array([2, 0, 1], np.int32),
              cu_seqlens_q=cu, causal=True, return_softmax_lse=True)
    jkw = {k_: jnp.asarray(x) for k_, x in kw.items()
           if k_ not in ("causal", "return_softmax_lse")}
    eager = tpu.flash_attn_with_kvcache(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc),
                                        jnp.asarray(kn), jnp.asarray(kn), **kw)
    jitted = jax.jit(lambda q, kc, vc, kn, kw: tpu.flash_attn_with_kvcache(
        q, kc, vc, kn, kn, causal=True, return_softmax_lse=True, **kw))(
        jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(kn), jkw)
    assert all(_bits(a, e) for a, e in zip(jitted, eager))


# ------------------------------------------------------------ linear attention --

def _layer_case(kda, rng):
    from test_layers import DK, NV, batch, inputs
    qsl, seq_lens, sidx, read, dist, T = batch()
    qkv, b, a, w, bias, a_log, dt_bias, conv, rec = inputs(rng, T)
    if kda:
        a = rng.standard_normal((T, NV * DK)).astype(np.float32)
        dt_bias = (rng.standard_normal(NV * DK) * 0.5).astype(np.float32)
    return (qkv, b, a, conv, rec, w, bias, a_log, dt_bias, qsl, sidx, dist, seq_lens, read)


@pytest.mark.parametrize("kda", [False, True])
def test_tpu_layers_under_jit_give_the_numpy_bits_in_place(kda):
    from test_layers import DK, DV, K, NKQ, NV
    rng = np.random.default_rng(16)
    case = _layer_case(kda, rng)
    kw = dict(n_kq=NKQ, n_v=NV, d_k=DK, d_v=DV, kernel_size=K)
    if kda:
        kw["lower_bound"] = -5.0
    call = tpu.fused_conv1d_kda if kda else tpu.fused_conv1d_gdn
    conv, rec = case[3].copy(), case[4].copy()
    (_, _), want = call(*case[:3], conv, rec, *case[5:], **kw)
    jcase = [jnp.asarray(x) for x in case]
    addr = (jcase[3].unsafe_buffer_pointer(), jcase[4].unsafe_buffer_pointer())
    step = jax.jit(lambda *a: call(*a, **kw), donate_argnums=(3, 4))
    (c2, r2), out = step(*jcase)
    assert (c2.unsafe_buffer_pointer(), r2.unsafe_buffer_pointer()) == addr
    assert _bits(out, want) and _bits(c2, conv) and _bits(r2, rec)


@pytest.mark.parametrize("kda", [False, True])
def test_tpu_replay_steps_under_jit_give_the_numpy_bits(kda):
    import ml_dtypes
    from test_layers import DK, DV, K, NKQ, NV, SLOTS, _replay_step_inputs, inputs
    rng = np.random.default_rng(17)
    _, _, _, w, bias, a_log, _, conv, rec = inputs(rng, 1)
    dt_bias = (rng.standard_normal(NV * DK if kda else NV) * 0.5).astype(np.float32)
    call = tpu.fused_conv1d_kda_replay if kda else tpu.fused_conv1d_gdn_replay
    dim = (flywheel.kda_replay_record_dim if kda else flywheel.replay_record_dim)(NKQ, NV, DK, DV)
    W = 3
    shadow = rec.astype(ml_dtypes.bfloat16)
    records = np.zeros((SLOTS, W, dim), np.float32)
    sidx, read = np.array([1, 2, 4], np.int32), np.array([1, 2, 3], np.int32)
    seq_lens, dist = np.array([9, 9, 9], np.int32), np.array([3, 3, 3], np.int32)
    kw = dict(n_kq=NKQ, n_v=NV, d_k=DK, d_v=DV, kernel_size=K, replay_window=W)
    if kda:
        kw["lower_bound"] = -5.0
    host = [conv.copy(), rec.copy(), shadow.copy(), records.copy()]
    dev = [jnp.asarray(x) for x in (conv, rec, shadow, records)]
    lens = np.zeros(3, np.int32)
    jlens = jnp.asarray(lens)

    @jax.jit
    def jstep(qkv, b, g, qsl, conv, rec, shadow, records, lens):
        caches, out = call(qkv, b, g, conv, rec, shadow, records, w, bias, a_log, dt_bias, qsl,
                           sidx, dist, seq_lens, read, lens, **kw)
        new = tpu.next_replay_lens(lens, qsl, seq_lens, sidx, read, dist,
                                   jnp.ones(3, jnp.int32), W)
        return caches, out, new

    for step in range(5):
        qkv, b, g, qsl = _replay_step_inputs(rng, kda)
        (_, _, _, _), want = call(qkv, b, g, *host, w, bias, a_log, dt_bias, qsl, sidx, dist,
                                  seq_lens, read, lens, **kw)
        caches, out, jlens = jstep(qkv, b, g, qsl, *dev, jlens)
        dev = list(caches)
        assert _bits(out, want), step
        assert all(_bits(d, h) for d, h in zip(dev, host)), step
        lens = tpu.next_replay_lens(lens, qsl, seq_lens, sidx, read, dist, [1, 1, 1], W)
        assert _bits(jlens, lens), step


def test_traced_indices_are_checked_when_the_call_runs():
    """Index operands traced under jit are known only when the call runs: bad ones come back
    as XLA errors with the handler's or the library's message, and the caches are unchanged."""
    x = jnp.zeros((4, 2, 8), jnp.float32)
    kv = jnp.ones((3, 4, 4, 8), jnp.float32)   # merged: 2 K/V heads
    read = jax.jit(lambda q, kv, cu, lens, table, na: tpu.flash_attn_varlen_func(
        q.transpose(1, 0, 2), kv, None, cu, None, 4, 8, block_table=table, seqused_k=lens,
        num_active=na))
    good = (jnp.array([0, 1, 3], jnp.int32), jnp.array([2, 4], jnp.int32),
            jnp.array([[0, 1], [2, 1]], jnp.int32), jnp.int32(2))
    jax.block_until_ready(read(x, kv, *good))
    bad = [
        ((jnp.array([1, 1, 3], jnp.int32),) + good[1:], "cu_seqlens_q"),       # not from 0
        ((jnp.array([0, 1, 9], jnp.int32),) + good[1:], "cu_seqlens_q"),       # past q's rows
        (good[:3] + (jnp.int32(3),), "num_active"),                            # past the batch
        ((good[0], jnp.array([2, 9], jnp.int32)) + good[2:], "seqlens|cache|rows|pages"),
        (good[:2] + (jnp.array([[0, 1], [7, 1]], jnp.int32), good[3]), "page|block"),
    ]
    for args, msg in bad:
        with pytest.raises(Exception, match=msg):
            jax.block_until_ready(read(x, kv, *args))
    assert _bits(kv, np.ones((3, 4, 4, 8), np.float32))
    cu = jnp.array([0, 2, 9], jnp.int32)
    with pytest.raises(Exception, match="cu_seqlens"):
        jax.block_until_ready(jax.jit(fj.flash_attn_varlen_func)(x, x, x, cu, cu))


def test_the_originals_jitted_serving_loop_runs_unchanged(monkeypatch):
    """A decode loop written against the original (its README: caches donated on the outer
    jit and rebound each step; `from flywheel_tpu... import ...`) runs with flywheel.tpu in
    the original's place, and gives the eager calls' bits step after step."""
    import sys
    import types
    monkeypatch.setitem(sys.modules, "flywheel_tpu", tpu)
    monkeypatch.setitem(sys.modules, "flywheel_tpu.linear_attention",
                        types.SimpleNamespace(fused_conv1d_gdn=tpu.fused_conv1d_gdn))
    from flywheel_tpu import flash_attn_with_kvcache
    from flywheel_tpu.linear_attention import fused_conv1d_gdn
    from test_layers import DK, DV, K, NKQ, NV, SLOTS, inputs

    rng = np.random.default_rng(19)
    _, _, _, w, bias, a_log, dt_bias, conv, rec = inputs(rng, 1)
    kc, vc = (jnp.zeros((2, 64, 2, 16), jnp.bfloat16) for _ in range(2))
    caches = [kc, vc, jnp.asarray(conv), jnp.asarray(rec)]
    host = [np.zeros((2, 64, 2, 16), kc.dtype), np.zeros((2, 64, 2, 16), kc.dtype), conv.copy(),
            rec.copy()]
    idx = dict(query_start_loc=np.array([0, 1, 2], np.int32),
               state_indices=np.array([1, 2], np.int32), distribution=np.array([2, 2, 2], np.int32),
               read_state_indices=np.array([1, 2], np.int32))
    dims = dict(n_kq=NKQ, n_v=NV, d_k=DK, d_v=DV, kernel_size=K)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
    def step(k_cache, v_cache, conv_state, recurrent_state, q, k, v, qkv, b, a, lens):
        out, k_cache, v_cache = flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                        cache_seqlens=lens, causal=True)
        (conv_state, recurrent_state), o2 = fused_conv1d_gdn(
            qkv, b, a, conv_state, recurrent_state, w, bias, a_log, dt_bias,
            idx["query_start_loc"], idx["state_indices"], idx["distribution"], lens + 1,
            idx["read_state_indices"], **dims)
        return out, o2, k_cache, v_cache, conv_state, recurrent_state

    for t in range(3):
        q = rng.standard_normal((2, 1, 4, 16)).astype(host[0].dtype)
        kn = rng.standard_normal((2, 1, 2, 16)).astype(host[0].dtype)
        qkv = rng.standard_normal((2, 2 * NKQ * DK + NV * DV)).astype(np.float32)
        b, a = (rng.standard_normal((2, NV)).astype(np.float32) for _ in range(2))
        lens = np.array([5 + t, 9 + t], np.int32)
        want = tpu.flash_attn_with_kvcache(q, host[0], host[1], kn, kn, cache_seqlens=lens,
                                           causal=True)[0]
        (_, _), want2 = tpu.fused_conv1d_gdn(qkv, b, a, host[2], host[3], w, bias, a_log, dt_bias,
                                             idx["query_start_loc"], idx["state_indices"],
                                             idx["distribution"], lens + 1,
                                             idx["read_state_indices"], **dims)
        out, o2, *caches = step(*caches, q, kn, kn, qkv, b, a, jnp.asarray(lens))
        assert _bits(out, want) and _bits(o2, want2), t
        assert all(_bits(c, h) for c, h in zip(caches, host)), t


# ------------------------------------------------------------------- fla's calls --

def _gdn_inputs(rng, dtype, kda, B=1, T=70, H=2, HV=4, K=16, V=16):
    q, _ = make(rng, (B, T, H, K), dtype, "numpy")
    k, _ = make(rng, (B, T, H, K), dtype, "numpy")
    v, _ = make(rng, (B, T, HV, V), dtype, "numpy")
    g = (-np.abs(rng.standard_normal((B, T, HV) + ((K,) if kda else ()))) * 0.1).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (B, T, HV)).astype(np.float32)
    h0 = (rng.standard_normal((3 if B == 1 else B, HV, K, V)) * 0.1).astype(np.float32)
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("call", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                                  "chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fla_calls_give_the_library_bits(call, dtype):
    rng = np.random.default_rng(20)
    kda = "kda" in call
    q, k, v, g, beta, h0 = _gdn_inputs(rng, dtype, kda)
    cu = np.array([0, 30, 31, 70], np.int32)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              cu_seqlens=cu)
    if call == "fused_recurrent_gated_delta_rule":
        kw["beta"] = beta
        pos = (q, k, v, g)
    else:
        pos = (q, k, v, g, beta)
    want = getattr(flywheel.fla if kda else flywheel, call)(*pos, **kw)
    f = getattr(fj, call)
    jpos = [jnp.asarray(x) for x in pos]
    jkw = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    for got in (jax.jit(lambda *a: f(*a, **jkw))(*jpos), f(*jpos, **jkw)):
        assert _bits(got[0], want[0]) and _bits(got[1], want[1])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gates_in_the_kernel_give_the_library_bits(lower_bound):
    rng = np.random.default_rng(21)
    q, k, v, g, beta, h0 = _gdn_inputs(rng, "float32", True, B=2, T=40)
    raw = rng.standard_normal(g.shape).astype(np.float32)
    a_log = np.log(rng.uniform(1, 4, 4)).astype(np.float32)
    dt_bias = (rng.standard_normal(4 * 16) * 0.3).astype(np.float32)
    kw = dict(use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
              use_beta_sigmoid_in_kernel=True, output_final_state=True)
    if lower_bound is not None:
        kw.update(safe_gate=True, lower_bound=lower_bound)
    b = rng.standard_normal(beta.shape).astype(np.float32)
    want = flywheel.chunk_kda(q, k, v, raw, b, **kw)
    jkw = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    got = jax.jit(lambda *a: fj.chunk_kda(*a, **jkw))(*(jnp.asarray(x) for x in (q, k, v, raw, b)))
    assert _bits(got[0], want[0]) and _bits(got[1], want[1])


def test_fla_calls_are_forward_only_and_check_shapes():
    rng = np.random.default_rng(22)
    q, k, v, g, beta, _ = _gdn_inputs(rng, "float32", False, B=1, T=8)
    args = [jnp.asarray(x) for x in (q, k, v, g, beta)]
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(lambda a: fj.chunk_gated_delta_rule(a, *args[1:])[0].sum())(args[0])
    with pytest.raises(ValueError, match="beta"):
        fj.chunk_gated_delta_rule(*args[:4], args[4][:, :, :2])
    with pytest.raises(ValueError, match="initial_state"):
        fj.chunk_gated_delta_rule(*args, initial_state=jnp.zeros((2, 4, 16, 16)))
    with pytest.raises(ValueError, match="divide"):
        fj.chunk_gated_delta_rule(args[0][:, :, :1].repeat(3, 2), args[1][:, :, :1].repeat(3, 2),
                                  *args[2:])


@pytest.mark.parametrize("packed", [False, True])
def test_a_donated_out_buffer_takes_the_result(packed):
    rng = np.random.default_rng(23)
    if packed:
        q, k, v, cu, _ = _packed(rng, [5, 9], [5, 9], 4, 2, 16, 16, "bfloat16", pad_q=2)
        f = lambda q, k, v, out: fj.flash_attn_varlen_func(q, k, v, jnp.asarray(cu),
                                                           jnp.asarray(cu), causal=True, out=out)
    else:
        q, k, v, _ = _inputs(CASES[0], "bfloat16", 24)
        f = lambda q, k, v, out: fj.flash_attn_func(q, k, v, causal=True, out=out)
    args = [jnp.asarray(x) for x in (q, k, v)]
    want = jax.jit(lambda *a: f(*a, None))(*args)
    buf = jnp.zeros(want.shape, want.dtype)
    addr = buf.unsafe_buffer_pointer()
    got = jax.jit(f, donate_argnums=(3,))(*args, buf)
    assert got.unsafe_buffer_pointer() == addr and _bits(got, want)
    with pytest.raises(ValueError, match="out must be"):
        f(*args, jnp.zeros(want.shape, jnp.float32))
