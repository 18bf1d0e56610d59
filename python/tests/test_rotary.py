"""Fused rotary embedding: flash_attn_func / flash_attn_varlen_func (flywheel-tpu's extension)
and flash_attn_with_kvcache (flash-attn's rotary_cos / rotary_sin / rotary_interleaved)
against a float64 rotate-then-attend reference written here from flash-attn's definition
(apply_rotary_emb: GPT-NeoX halves, or GPT-J pairs when interleaved), on numpy and torch,
partial rotary dims, GQA, contiguous and paged caches; and each class of bad input."""

import numpy as np
import pytest

import flywheel
from flywheel import FlywheelError, tpu
from conftest import FAMILIES, TOL, as64, make, ref_attention, torch


def tables(n, rd, dtype="float32"):
    """RoPE cos / sin [n, rd / 2] (base 10000)."""
    inv = 10000.0 ** (-np.arange(0, rd, 2) / rd)
    f = np.arange(n)[:, None] * inv[None]
    return np.cos(f).astype(dtype), np.sin(f).astype(dtype)


def rotate(x, cos, sin, pos, interleaved):
    """flash-attn's rotary on x [s, h, d] (float64) with row i at position pos[i]."""
    x = np.array(x, dtype=np.float64)
    rd = 2 * cos.shape[1]
    c = cos.astype(np.float64)[pos][:, None, :]
    s = sin.astype(np.float64)[pos][:, None, :]
    if interleaved:
        a, b = x[..., 0:rd:2].copy(), x[..., 1:rd:2].copy()
        x[..., 0:rd:2], x[..., 1:rd:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :rd // 2].copy(), x[..., rd // 2:rd].copy()
        x[..., :rd // 2], x[..., rd // 2:rd] = a * c - b * s, a * s + b * c
    return x


def convert(x, family):
    return torch.from_numpy(x) if family == "torch" else x


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", [(1, 30, 30, 4, 2, 64, 64), (2, 7, 50, 8, 2, 80, 32),
                                   (1, 1, 20, 4, 4, 32, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_matches_rotate_then_attend(family, dtype, interleaved, shape, causal):
    b, sq, sk, hq, hkv, d, rd = shape
    rng = np.random.default_rng(sum(shape))
    q, q64 = make(rng, (b, sq, hq, d), dtype, family)
    k, k64 = make(rng, (b, sk, hkv, d), dtype, family)
    v, v64 = make(rng, (b, sk, hkv, d), dtype, family)
    cos, sin = tables(sk + 2, rd)
    out = flywheel.flash_attn_func(q, k, v, causal=causal, rotary_cos=convert(cos, family),
                                   rotary_sin=convert(sin, family),
                                   rotary_interleaved=interleaved)
    for i in range(b):
        rq = rotate(q64[i], cos, sin, np.arange(sk - sq, sk), interleaved)
        rk = rotate(k64[i], cos, sin, np.arange(sk), interleaved)
        ro, _ = ref_attention(rq, rk, v64[i], d ** -0.5, causal)
        assert np.abs(as64(out)[i] - ro).max() <= TOL[dtype]


def test_q_only_and_varlen():
    rng = np.random.default_rng(2)
    lens = [5, 12, 1]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, q64 = make(rng, (sum(lens), 4, 32), "float32", "numpy")
    k, k64 = make(rng, (sum(lens), 2, 32), "float32", "numpy")
    v, v64 = make(rng, (sum(lens), 2, 32), "float32", "numpy")
    cos, sin = tables(16, 16)
    for rotary_k in (True, False):
        out = flywheel.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True,
                                              rotary_cos=cos, rotary_sin=sin,
                                              rotary_k=rotary_k)
        for i, n in enumerate(lens):
            s = slice(cu[i], cu[i + 1])
            rq = rotate(q64[s], cos, sin, np.arange(n), False)
            rk = rotate(k64[s], cos, sin, np.arange(n), False) if rotary_k else k64[s]
            ro, _ = ref_attention(rq, rk, v64[s], 32 ** -0.5, True)
            assert np.abs(out[s] - ro).max() <= TOL["float32"]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_kvcache_rotates_new_keys_and_queries(paged, causal, interleaved):
    rng = np.random.default_rng(5)
    b, S, hq, hkv, d, rd, n = 2, 64, 4, 2, 32, 16, 3
    seqlens = np.array([9, 40], np.int32)
    cos, sin = tables(S, rd)
    k_old, _ = make(rng, (b, S, hkv, d), "float32", "numpy")
    v_old, _ = make(rng, (b, S, hkv, d), "float32", "numpy")
    q, q64 = make(rng, (b, n, hq, d), "float32", "numpy")
    kn, kn64 = make(rng, (b, n, hkv, d), "float32", "numpy")
    vn, vn64 = make(rng, (b, n, hkv, d), "float32", "numpy")
    if paged:  # 4 pages of 16 rows per sequence, shuffled
        table = np.array([[3, 0, 6, 5], [1, 4, 7, 2]], np.int32)
        kc = np.zeros((8, 16, hkv, d), np.float32)
        vc = np.zeros((8, 16, hkv, d), np.float32)
        for i in range(b):
            for p in range(4):
                kc[table[i, p]] = k_old[i, 16 * p:16 * p + 16]
                vc[table[i, p]] = v_old[i, 16 * p:16 * p + 16]
    else:
        table, kc, vc = None, k_old.copy(), v_old.copy()
    out = flywheel.flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=seqlens, block_table=table,
                                           causal=causal, rotary_interleaved=interleaved)
    for i in range(b):
        L = seqlens[i]
        pos_k = np.arange(L, L + n)
        rk = rotate(kn64[i], cos, sin, pos_k, interleaved)
        got = (np.concatenate([kc[table[i, p]] for p in range(4)]) if paged else kc[i])
        assert np.abs(got[L:L + n] - rk).max() <= 1e-6  # appended rotated
        assert np.array_equal(got[:L], k_old[i, :L])   # the old rows untouched
        pos_q = pos_k if causal else np.full(n, L)
        rq = rotate(q64[i], cos, sin, pos_q, interleaved)
        keys = np.concatenate([k_old[i, :L].astype(np.float64), rk])
        vals = np.concatenate([v_old[i, :L].astype(np.float64), vn64[i]])
        ro, _ = ref_attention(rq, keys, vals, d ** -0.5, causal)
        assert np.abs(out[i] - ro).max() <= TOL["float32"]


def test_tpu_rotary_is_flywheels_in_head_major_layout():
    rng = np.random.default_rng(8)
    q, _ = make(rng, (1, 20, 4, 32), "float32", "numpy")
    k, _ = make(rng, (1, 30, 2, 32), "float32", "numpy")
    cos, sin = tables(30, 32)
    want = flywheel.flash_attn_func(q, k, k, causal=True, rotary_cos=cos, rotary_sin=sin)
    hm = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    got = tpu.flash_attn_func(hm(q), hm(k), hm(k), causal=True, rotary_cos=cos, rotary_sin=sin)
    assert np.array_equal(np.asarray(got), hm(want))


def test_rotary_bad_input():
    q = np.ones((1, 4, 2, 16), np.float32)
    cos, sin = tables(8, 16)
    with pytest.raises(ValueError, match="together"):
        flywheel.flash_attn_func(q, q, q, rotary_cos=cos)
    with pytest.raises(FlywheelError, match="FW_ERR_SHAPE"):  # rotary_dim 18 > d 16
        flywheel.flash_attn_func(q, q, q, rotary_cos=np.ones((8, 9), np.float32),
                                 rotary_sin=np.ones((8, 9), np.float32))
    with pytest.raises(FlywheelError, match="positions"):
        flywheel.flash_attn_func(q, q, q, rotary_cos=cos[:3], rotary_sin=sin[:3])
    with pytest.raises(ValueError, match="seqlen_ro"):
        flywheel.flash_attn_func(q, q, q, rotary_cos=cos[0], rotary_sin=sin[0])
    kc = np.zeros((1, 16, 2, 16), np.float32)
    with pytest.raises(FlywheelError, match="k_new"):
        flywheel.flash_attn_with_kvcache(q, kc, kc, rotary_cos=cos, rotary_sin=sin,
                                         cache_seqlens=4)
    if torch is not None:
        t = torch.ones(1, 4, 2, 16, requires_grad=True)
        with pytest.raises(NotImplementedError, match="rotary"):
            flywheel.flash_attn_func(t, t, t, rotary_cos=cos, rotary_sin=sin)
