"""flywheel.jax: the XLA FFI custom calls under jax.jit, and flywheel.tpu's calls on traced
values. jit and eager calls run the same handler as the numpy binding's call and must give
its bits; gradients are checked against float64 autodiff; donated caches change in place."""

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
        err = np.abs(np.asarray(a, np.float64) - b).max()
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


def test_tpu_refuses_what_jit_does_not_serve_yet():
    x = jnp.zeros((1, 1, 4, 8), jnp.float32)
    with pytest.raises(NotImplementedError, match="jit"):
        jax.jit(lambda a: tpu.flash_attn_func(a, a, a, heads_outer_fold=True))(x)
    with pytest.raises(NotImplementedError, match="jit"):
        jax.jit(lambda a: tpu.flash_attn_with_kvcache(
            a, a, a, cache_seqlens=1, cache_batch_idx=jnp.zeros(1, jnp.int32)))(x)
