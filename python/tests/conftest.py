"""Shared helpers: float64 numpy references and input makers for numpy and torch."""

import numpy as np
import pytest

import flywheel

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None
try:
    import torch
except ImportError:
    torch = None

FAMILIES = ["numpy"] + (["torch"] if torch is not None else [])
DTYPES = ["float32", "bfloat16", "float16"]

# max |error| allowed against the float64 reference on O(1) outputs: the output rounding of
# the dtype (bf16 2^-9, f16 2^-12 relative) plus float32 accumulation.
TOL = {"float32": 2e-5, "bfloat16": 1.6e-2, "float16": 2e-3}


def make(rng, shape, dtype, family, scale=1.0):
    """A random tensor in the given family and dtype, and its exact float64 value."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if family == "torch":
        t = torch.from_numpy(x).to(getattr(torch, dtype))
        return t, t.to(torch.float64).numpy()
    if dtype == "bfloat16":
        if ml_dtypes is None:
            pytest.skip("bfloat16 numpy arrays need ml_dtypes")
        a = x.astype(ml_dtypes.bfloat16)
    else:
        a = x.astype(dtype)
    return a, a.astype(np.float64)


def as64(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.to(torch.float64).numpy()
    return np.asarray(x).astype(np.float64)


def round_bf16(x):
    """float64 values rounded to bfloat16 (through float32, nearest even, as the C library
    does), returned as float64."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def round_to(x, dtype):
    """float64 values rounded to an output dtype ("float32", "bfloat16", "float16")."""
    if dtype == "bfloat16":
        return round_bf16(x)
    return np.asarray(x).astype(dtype).astype(np.float64)


def ref_attention(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0,
                  bf16_products=False, sinks=None):
    """float64 attention for one sequence: q [sq, hq, d], k [sk, hkv, d], v [sk, hkv, dv]
    -> out [sq, hq, dv], lse [hq, sq]; masks aligned bottom-right, empty rows give 0 / -inf.
    sinks [hq]: attention sinks, exp(sinks[h]) added to each row's denominator (lse
    included: an empty row gives 0 / sinks[h]).
    bf16_products=True makes the roundings of the kernels' bf16 products and no others: q, k,
    v rounded to bf16, and each probability exp(s - max) rounded to bf16 before it multiplies
    V while the denominator sums them unrounded (the output is not rounded: see round_to)."""
    if bf16_products:
        q, k, v = round_bf16(q), round_bf16(k), round_bf16(v)
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    g = hq // hkv
    kk = np.repeat(k, g, axis=1)
    vv = np.repeat(v, g, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    left, right = window
    if causal:
        right = 0
    allowed = np.ones((sq, sk), dtype=bool)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    s = np.where(allowed[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(np.asarray(sinks, np.float64)[:, None, None] - m)
    pv = round_bf16(p) if bf16_products else p
    out = np.einsum("hqk,khd->qhd", pv / np.where(den > 0, den, 1.0), vv)
    lse = np.where(den[..., 0] > 0, np.log(np.where(den[..., 0] > 0, den[..., 0], 1.0)) +
                   m[..., 0], -np.inf)
    return out, lse


def ref_gdn(q, k, v, g, beta, scale, h0=None, l2norm=False, eps=1e-6):
    """float64 Gated DeltaNet recurrence for one sequence: q, k [T, H, K], v [T, HV, V],
    g, beta [T, HV], h0 [HV, K, V] -> o [T, HV, V], h [HV, K, V] (l2norm: x / sqrt(|x|^2 +
    eps)). KDA: g [T, HV, K], a decay per key channel (row of h)."""
    Tn, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    r = HV // H
    if l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
    h = np.zeros((HV, K, V)) if h0 is None else h0.astype(np.float64).copy()
    o = np.zeros((Tn, HV, V))
    for t in range(Tn):
        for j in range(HV):
            kt, qt = k[t, j // r], q[t, j // r] * scale
            h[j] *= np.exp(g[t, j])[:, None] if np.ndim(g[t, j]) else np.exp(g[t, j])
            delta = beta[t, j] * (v[t, j] - h[j].T @ kt)
            h[j] += np.outer(kt, delta)
            o[t, j] = h[j].T @ qt
    return o, h


def ref_gdn_bf16(q, k, v, g, beta, scale, h0=None, l2norm=False, chunk=64):
    """ref_gdn with the roundings of the chunked kernel's bf16 products and no others (those
    of fw_gdn_ref's same-roundings mode, src/ref/gdn_ref.c), in float64, one 64-token chunk at a
    time from the sequence's start. rb() is round_bf16; gam is the chunk's cumulative log decay:
      Kb, Qb = rb(K^), rb(Q^)            (K^, Q^: the l2-normalised rows, not scaled)
      A_ij = beta_i e^(gam_i - gam_j) Kb_i . Kb_j (j < i);  Tb = rb((I + A)^-1)
      W = Tb rb(beta e^gam K^);  U = Tb rb(beta V);  Deltab = rb(U - rb(W) rb(h))
      O = scale (e^gam Qb rb(h) + Gb Deltab),  Gb_ij = rb(e^(gam_i - gam_j) Qb_i . Kb_j) (j <= i)
      h <- e^gam_last h + rb(e^(gam_last - gam) K^)^T Deltab
    KDA (g [T, HV, K], gam per key channel): A and G on K^ and Q^ unrounded (the kernel's f32
    products), e^(gam_i - gam_j) inside the sums, and the decays in the rounded operands:
      O = scale (rb(e^gam o Q^) rb(h) + Gb Deltab),  h <- e^gam_last o h + rb(e^(gam_last - gam) o K^)^T Deltab
    The output is not rounded to the output dtype (see round_to); the state stays float64."""
    Tn, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    # per value head, chunk rows first: [HV, T, K], [HV, T, V], [HV, T]
    q = np.repeat(q, HV // H, axis=1).transpose(1, 0, 2)
    k = np.repeat(k, HV // H, axis=1).transpose(1, 0, 2)
    kda = np.ndim(g) == 3
    v, g, beta = v.transpose(1, 0, 2), (g.transpose(1, 0, 2) if kda else g.T), beta.T
    h = np.zeros((HV, K, V)) if h0 is None else h0.astype(np.float64).copy()
    o = np.zeros((HV, Tn, V))
    if kda:
        for t0 in range(0, Tn, chunk):
            s = slice(t0, t0 + chunk)
            Kh, Qh, Vc, bet = k[:, s], q[:, s], v[:, s], beta[:, s]
            L = Kh.shape[1]
            gam = np.cumsum(g[:, s], axis=1)  # [HV, L, K]
            lower = np.tril(np.ones((L, L), bool))[None, :, :, None]
            D = np.exp(np.where(lower, gam[:, :, None] - gam[:, None], -np.inf))  # j <= i
            KK = np.einsum("hix,hjx,hijx->hij", Kh, Kh, D)
            QK = np.einsum("hix,hjx,hijx->hij", Qh, Kh, D)
            A = bet[:, :, None] * np.tril(KK, -1)
            Tb = round_bf16(np.tril(np.linalg.inv(np.eye(L) + A)))
            W = Tb @ round_bf16(bet[:, :, None] * np.exp(gam) * Kh)
            U = Tb @ round_bf16(bet[:, :, None] * Vc)
            hb = round_bf16(h)
            Db = round_bf16(U - round_bf16(W) @ hb)
            o[:, s] = scale * (round_bf16(np.exp(gam) * Qh) @ hb + round_bf16(QK) @ Db)
            last = gam[:, -1:]
            Kd = round_bf16(np.exp(last - gam) * Kh)
            h = np.exp(last[:, 0])[:, :, None] * h + Kd.transpose(0, 2, 1) @ Db
        return o.transpose(1, 0, 2), h
    for t0 in range(0, Tn, chunk):
        s = slice(t0, t0 + chunk)
        Kh, Qh, Vc, bet = k[:, s], q[:, s], v[:, s], beta[:, s]
        L = Kh.shape[1]
        gam = np.cumsum(g[:, s], axis=1)
        diff = gam[:, :, None] - gam[:, None, :]  # gam_i - gam_j
        below = np.tril(np.ones((L, L), bool), -1)
        decay = np.exp(np.where(below, diff, -np.inf))  # j < i
        decay_eq = np.exp(np.where(below | np.eye(L, dtype=bool), diff, -np.inf))  # j <= i
        Kb, Qb = round_bf16(Kh), round_bf16(Qh)
        KK = Kb @ Kb.transpose(0, 2, 1)
        QK = Qb @ Kb.transpose(0, 2, 1)
        A = bet[:, :, None] * decay * KK
        Tb = round_bf16(np.tril(np.linalg.inv(np.eye(L) + A)))
        W = Tb @ round_bf16((bet * np.exp(gam))[:, :, None] * Kh)
        U = Tb @ round_bf16(bet[:, :, None] * Vc)
        hb = round_bf16(h)
        Db = round_bf16(U - round_bf16(W) @ hb)
        Gb = round_bf16(decay_eq * QK)
        o[:, s] = scale * (np.exp(gam)[:, :, None] * (Qb @ hb) + Gb @ Db)
        last = gam[:, -1]
        Kd = round_bf16(np.exp(last[:, None] - gam)[:, :, None] * Kh)
        h = np.exp(last)[:, None, None] * h + Kd.transpose(0, 2, 1) @ Db
    return o.transpose(1, 0, 2), h


def read_only(a):
    """A copy of numpy array a with flags.writeable False (as np.asarray of a JAX array)."""
    a = a.copy()
    a.setflags(write=False)
    return a


@pytest.fixture(autouse=True)
def _threads():
    flywheel.set_num_threads(2)
    yield
    flywheel.set_num_threads(0)
