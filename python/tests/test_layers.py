"""flywheel.fused_conv1d_gdn (flywheel-tpu's serving-layer call) against a float64 reference
built from the definitions: the causal conv from each sequence's conv slot (zeros for a new
sequence), SiLU, the q/k/v split, the gates, and the gated delta rule from its recurrent slot;
both caches' write slots, untouched slots and zeroed padding rows; bad batches refused with
nothing written."""

import ml_dtypes
import numpy as np
import pytest

import flywheel
from flywheel import FlywheelError
from conftest import as64, ref_gdn, torch

NKQ, NV, DK, DV, K = 2, 4, 16, 16, 4
DIM = 2 * NKQ * DK + NV * DV
SLOTS = 10


def batch():
    """3 decodes (slots 1, 2, 3), a chunked prefill of 600 tokens after 30 (reads slot 8, writes
    4: prefix caching), a new sequence of 5 tokens (slot 5, holding garbage), a skipped one;
    then padding rows."""
    qlens = [1, 1, 1, 600, 5, 3]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    seq_lens = np.array([7, 2, 40, 630, 5, 9], np.int32)
    state_indices = np.array([1, 2, 3, 4, 5, 6], np.int32)
    read = np.array([1, 2, 3, 8, 5, 6], np.int32)
    dist = np.array([3, 5, 5], np.int32)
    return qsl, seq_lens, state_indices, read, dist, int(qsl[-1]) + 4


def inputs(rng, T):
    qkv = rng.standard_normal((T, DIM)).astype(np.float32)
    b = rng.standard_normal((T, NV)).astype(np.float32)
    a = rng.standard_normal((T, NV)).astype(np.float32)
    w = (rng.standard_normal((DIM, 1, K)) * 0.5).astype(np.float32)
    bias = (rng.standard_normal(DIM) * 0.1).astype(np.float32)
    a_log = np.log(rng.uniform(1, 8, NV)).astype(np.float32)
    dt_bias = (rng.standard_normal(NV) * 0.5).astype(np.float32)
    conv = rng.standard_normal((SLOTS, K - 1, DIM)).astype(np.float32)
    rec = (rng.standard_normal((SLOTS, NV, DK, DV)) * 0.1).astype(np.float32)
    return qkv, b, a, w, bias, a_log, dt_bias, conv, rec


def reference(qkv, b, a, w, bias, a_log, dt_bias, conv, rec, qsl, seq_lens, sidx, read, dist,
              lower_bound=None, beta_activated=False):
    """The layer by the definitions in float64; a [T, NV] (GDN) or [T, NV * DK] (KDA, with
    dt_bias [NV * DK]): the softplus gate, or lower_bound's sigmoid gate."""
    qkv, b, a = (np.asarray(x, np.float64) for x in (qkv, b, a))
    w, bias = np.asarray(w, np.float64)[:, 0], np.asarray(bias, np.float64)
    conv, rec = np.asarray(conv, np.float64).copy(), np.asarray(rec, np.float64).copy()
    conv0, rec0 = conv.copy(), rec.copy()
    out = np.zeros((qkv.shape[0], NV * DV))
    for i in range(int(dist[2])):
        r0, r1 = int(qsl[i]), int(qsl[i + 1])
        fresh = seq_lens[i] == r1 - r0
        init = np.zeros((K - 1, DIM)) if fresh else conv0[read[i]]
        x = np.concatenate([init, qkv[r0:r1]])
        y = sum(x[k:k + r1 - r0] * w[:, k] for k in range(K)) + bias
        y = y / (1 + np.exp(-y))
        q = y[:, :NKQ * DK].reshape(-1, NKQ, DK)
        k_ = y[:, NKQ * DK:2 * NKQ * DK].reshape(-1, NKQ, DK)
        v = y[:, 2 * NKQ * DK:].reshape(-1, NV, DV)
        kda = a.shape[1] == NV * DK
        ea = np.exp(np.asarray(a_log, np.float64))
        if kda:
            xg = a[r0:r1].reshape(-1, NV, DK) + np.asarray(dt_bias, np.float64).reshape(NV, DK)
            ea = ea[:, None]
        else:
            xg = a[r0:r1] + dt_bias
        if lower_bound is None:
            g = -ea * np.where(xg > 20, xg, np.log1p(np.exp(np.minimum(xg, 20))))
        else:
            g = lower_bound / (1 + np.exp(-ea * xg))
        beta = b[r0:r1] if beta_activated else 1 / (1 + np.exp(-b[r0:r1]))
        h0 = np.zeros((NV, DK, DV)) if fresh else rec0[read[i]]
        o, h = ref_gdn(q, k_, v, g, beta, DK ** -0.5, h0, l2norm=True)
        out[r0:r1] = o.reshape(r1 - r0, NV * DV)
        conv[sidx[i]] = x[-(K - 1):]
        rec[sidx[i]] = h
    return out, conv, rec


def test_layer_matches_the_reference():
    rng = np.random.default_rng(5)
    qsl, seq_lens, sidx, read, dist, T = batch()
    qkv, b, a, w, bias, a_log, dt_bias, conv, rec = inputs(rng, T)
    want_o, want_conv, want_rec = reference(qkv, b, a, w, bias, a_log, dt_bias, conv, rec, qsl,
                                            seq_lens, sidx, read, dist)
    conv_before, rec_before = conv.copy(), rec.copy()
    (c2, r2), o = flywheel.fused_conv1d_gdn(qkv, b, a, conv, rec, w, bias, a_log, dt_bias, qsl,
                                             sidx, dist, seq_lens, read, n_kq=NKQ, n_v=NV,
                                             d_k=DK, d_v=DV, kernel_size=K)
    assert c2 is conv and r2 is rec
    assert np.abs(o - want_o).max() <= 1e-4 * (1 + np.abs(want_o).max())
    assert not o[int(qsl[5]):].any()                     # skipped sequence and padding: zero
    for s in (1, 2, 3, 4, 5):
        assert np.array_equal(conv[s], want_conv[s].astype(np.float32))
        assert np.abs(rec[s] - want_rec[s]).max() <= 1e-4
    for s in (0, 6, 7, 8, 9):                            # not written: read-only, skipped, free
        assert np.array_equal(conv[s], conv_before[s]) and np.array_equal(rec[s], rec_before[s])


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_layer_on_bf16_torch_tensors_and_a_padded_pool():
    rng = np.random.default_rng(6)
    qsl, seq_lens, sidx, read, dist, T = batch()
    qkv, b, a, w, bias, a_log, dt_bias, conv, rec = inputs(rng, T)
    tq = torch.from_numpy(qkv).to(torch.bfloat16)
    qkv_b = tq.float().numpy()
    raw = torch.zeros(SLOTS, NV * DK * DV + 24)
    raw[:, :NV * DK * DV] = torch.from_numpy(rec.reshape(SLOTS, -1))
    pool = raw[:, :NV * DK * DV].view(SLOTS, NV, DK, DV)
    tconv = torch.from_numpy(conv).to(torch.bfloat16)
    want_o, want_conv, want_rec = reference(qkv_b, b, a, w, bias, a_log, dt_bias,
                                            tconv.float().numpy(), rec, qsl, seq_lens, sidx, read,
                                            dist)
    (_, _), o = flywheel.fused_conv1d_gdn(tq, torch.from_numpy(b), torch.from_numpy(a), tconv,
                                          pool, torch.from_numpy(w), torch.from_numpy(bias),
                                          torch.from_numpy(a_log), torch.from_numpy(dt_bias),
                                          qsl, sidx, dist, seq_lens, read, n_kq=NKQ, n_v=NV,
                                          d_k=DK, d_v=DV, kernel_size=K)
    assert o.dtype == torch.bfloat16
    # bf16 conv output, bf16 products in the chunked pass, bf16 out: a few bf16 ulps
    assert np.abs(as64(o) - want_o).max() <= 0.05 * (1 + np.abs(want_o).max())
    for s in (1, 2, 3, 4, 5):
        assert np.array_equal(tconv[s].float().numpy(), want_conv[s].astype(np.float32))
        assert np.abs(pool[s].numpy() - want_rec[s]).max() <= 0.02
    assert not raw[:, NV * DK * DV:].any()


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("with_out", [False, True])
def test_layer_on_a_bf16_recurrent_cache(with_out):
    """A bf16 recurrent cache (vLLM's default for a bf16 model), padded slots: the bits of the
    same call on an f32 cache holding the same values, each written slot rounded to bf16 once
    (the 600-token prefill runs in the layer's windows of 256 rows on an f32 state), the
    other slots and the padding untouched; with out= (the compiled fast path) and without."""
    rng = np.random.default_rng(7)
    qsl, seq_lens, sidx, read, dist, T = batch()
    qkv, b, a, w, bias, a_log, dt_bias, conv, rec = inputs(rng, T)
    tq = torch.from_numpy(qkv).to(torch.bfloat16)
    raw16 = torch.zeros(SLOTS, NV * DK * DV + 24, dtype=torch.bfloat16)
    raw16[:, :NV * DK * DV] = torch.from_numpy(rec.reshape(SLOTS, -1)).to(torch.bfloat16)
    raw16[:, NV * DK * DV:] = 3.0
    before = raw16.clone()
    raw32 = raw16.float()
    outs, convs = [], []
    for raw in (raw32, raw16):
        pool = raw[:, :NV * DK * DV].view(SLOTS, NV, DK, DV)
        tconv = torch.from_numpy(conv).to(torch.bfloat16)
        out = torch.empty(T, NV * DV, dtype=torch.bfloat16) if with_out else None
        (_, _), o = flywheel.fused_conv1d_gdn(tq, torch.from_numpy(b), torch.from_numpy(a), tconv,
                                              pool, torch.from_numpy(w), torch.from_numpy(bias),
                                              torch.from_numpy(a_log), torch.from_numpy(dt_bias),
                                              qsl, sidx, dist, seq_lens, read, n_kq=NKQ, n_v=NV,
                                              d_k=DK, d_v=DV, kernel_size=K, out=out)
        outs.append(o)
        convs.append(tconv)
    assert torch.equal(outs[0], outs[1]) and torch.equal(convs[0], convs[1])
    want = before.clone()
    for s in (1, 2, 3, 4, 5):
        want[s, :NV * DK * DV] = raw32[s, :NV * DK * DV].to(torch.bfloat16)
    assert torch.equal(raw16.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(want[4], before[4])  # the long prefill wrote its slot


@pytest.mark.parametrize("case", ["duplicate write slot", "read slot another writes",
                                  "decode of two tokens", "bad distribution", "slot past the cache",
                                  "seq_len below its tokens"])
def test_bad_batches_are_refused_with_nothing_written(case):
    rng = np.random.default_rng(7)
    qsl, seq_lens, sidx, read, dist, T = batch()
    qkv, b, a, w, bias, a_log, dt_bias, conv, rec = inputs(rng, T)
    sidx, read, dist, qsl, seq_lens = sidx.copy(), read.copy(), dist.copy(), qsl.copy(), seq_lens.copy()
    if case == "duplicate write slot":
        sidx[4] = sidx[3]
    elif case == "read slot another writes":
        read[3] = sidx[0]
    elif case == "decode of two tokens":
        dist[0] = 4
    elif case == "bad distribution":
        dist[:] = [4, 2, 5]
    elif case == "slot past the cache":
        sidx[2] = SLOTS
    else:
        seq_lens[3] = 100
    conv0, rec0 = conv.copy(), rec.copy()
    out = np.full((T, NV * DV), 7.0, np.float32)
    with pytest.raises(FlywheelError):
        flywheel.fused_conv1d_gdn(qkv, b, a, conv, rec, w, bias, a_log, dt_bias, qsl, sidx, dist,
                                  seq_lens, read, n_kq=NKQ, n_v=NV, d_k=DK, d_v=DV,
                                  kernel_size=K, out=out)
    assert np.array_equal(conv, conv0) and np.array_equal(rec, rec0) and (out == 7.0).all()


def spec_batch():
    """3 speculative windows (num_spec_tokens 3) of 3, 1 and 4 tokens writing slot groups 10,
    14, 18 (4 slots each) and reading slot 12 (inside its own group), 0 and 30; then a prefill
    of 20 tokens (reads 25, writes 26) and padding."""
    qlens = [3, 1, 4, 20]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    seq_lens = np.array([50, 9, 33, 40], np.int32)
    sidx = np.array([10, 14, 18, 26], np.int32)
    read = np.array([10, 0, 30, 25], np.int32)
    offs = np.array([2, 0, 0, 0], np.int32)
    return qsl, seq_lens, sidx, read, offs, np.array([3, 4, 4], np.int32), int(qsl[-1]) + 2


@pytest.mark.parametrize("kda", [False, True])
def test_speculative_windows_equal_sequential_decodes(kda):
    """Each window's outputs and its checkpoints after every token (conv and recurrent, slot
    state_indices + t) are the bits of one-token decodes through the layer, token by token,
    from the slot read_state_indices + read_offsets; the prefill after them is unchanged."""
    rng = np.random.default_rng(9)
    qsl, seq_lens, sidx, read, offs, dist, T = spec_batch()
    slots = 32
    qkv = rng.standard_normal((T, DIM)).astype(np.float32)
    b = rng.standard_normal((T, NV)).astype(np.float32)
    a = rng.standard_normal((T, NV * DK if kda else NV)).astype(np.float32)
    w = (rng.standard_normal((DIM, 1, K)) * 0.5).astype(np.float32)
    bias = (rng.standard_normal(DIM) * 0.1).astype(np.float32)
    a_log = np.log(rng.uniform(1, 8, NV)).astype(np.float32)
    dt_bias = (rng.standard_normal(NV * DK if kda else NV) * 0.5).astype(np.float32)
    conv = rng.standard_normal((slots, K - 1, DIM)).astype(np.float32)
    rec = (rng.standard_normal((slots, NV, DK, DV)) * 0.1).astype(np.float32)
    call = flywheel.fused_conv1d_kda if kda else flywheel.fused_conv1d_gdn
    kw = dict(n_kq=NKQ, n_v=NV, d_k=DK, d_v=DV, kernel_size=K)
    conv1, rec1 = conv.copy(), rec.copy()
    _, out = call(qkv, b, a, conv1, rec1, w, bias, a_log, dt_bias, qsl, sidx, dist, seq_lens,
                  read, offs, num_spec_tokens=3, **kw)
    conv2, rec2 = conv.copy(), rec.copy()
    want = np.zeros_like(out)
    for i in range(3):
        src = read[i] + offs[i]
        for t in range(qsl[i + 1] - qsl[i]):
            r = qsl[i] + t
            one = np.array([0, 1], np.int32)
            _, o = call(qkv[r:r + 1], b[r:r + 1], a[r:r + 1], conv2, rec2, w, bias, a_log,
                        dt_bias, one, np.array([sidx[i] + t], np.int32),
                        np.array([1, 1, 1], np.int32), np.array([seq_lens[i]], np.int32),
                        np.array([src], np.int32), **kw)
            want[r] = o[0]
            src = sidx[i] + t
    r0, r1 = qsl[3], qsl[4]
    _, o = call(qkv[r0:r1], b[r0:r1], a[r0:r1], conv2, rec2, w, bias, a_log, dt_bias,
                np.array([0, r1 - r0], np.int32), sidx[3:], np.array([0, 1, 1], np.int32),
                seq_lens[3:], read[3:], **kw)
    want[r0:r1] = o
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(conv1, conv2)
    np.testing.assert_array_equal(rec1, rec2)
    assert not out[qsl[4]:].any()
    assert (conv1[[1, 2, 3, 5, 9]] == conv[[1, 2, 3, 5, 9]]).all()  # slots nobody writes


@pytest.mark.parametrize("case", ["window too long", "read slot past the caches",
                                  "groups overlap", "reads another's group"])
def test_bad_speculative_windows_are_refused_with_nothing_written(case):
    rng = np.random.default_rng(10)
    qsl, seq_lens, sidx, read, offs, dist, T = spec_batch()
    slots = 32
    qkv = rng.standard_normal((T, DIM)).astype(np.float32)
    b, a = (rng.standard_normal((T, NV)).astype(np.float32) for _ in range(2))
    w = (rng.standard_normal((DIM, 1, K)) * 0.5).astype(np.float32)
    a_log, dt_bias = np.zeros(NV, np.float32), np.zeros(NV, np.float32)
    conv = rng.standard_normal((slots, K - 1, DIM)).astype(np.float32)
    rec = rng.standard_normal((slots, NV, DK, DV)).astype(np.float32)
    spec = 3
    if case == "window too long":
        spec = 2
    elif case == "read slot past the caches":
        offs[2] = 5
    elif case == "groups overlap":
        sidx[1] = 12
    else:
        read[1], offs[1] = 18, 1
    conv0, rec0 = conv.copy(), rec.copy()
    out = np.full((T, NV * DV), 7.0, np.float32)
    with pytest.raises(FlywheelError):
        flywheel.fused_conv1d_gdn(qkv, b, a, conv, rec, w, None, a_log, dt_bias, qsl, sidx, dist,
                                  seq_lens, read, offs, n_kq=NKQ, n_v=NV, d_k=DK, d_v=DV,
                                  kernel_size=K, num_spec_tokens=spec, out=out)
    assert np.array_equal(conv, conv0) and np.array_equal(rec, rec0) and (out == 7.0).all()


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("beta_activated", [False, True])
def test_kda_layer_matches_the_reference(lower_bound, beta_activated):
    """fused_conv1d_kda: the raw gate per key channel g [T, n_v d_k], dt_bias [n_v d_k], the
    softplus or the lower-bound sigmoid gate, b as logits or as beta itself."""
    rng = np.random.default_rng(15)
    qsl, seq_lens, sidx, read, dist, T = batch()
    qkv, b, _, w, bias, a_log, _, conv, rec = inputs(rng, T)
    g = rng.standard_normal((T, NV * DK)).astype(np.float32)
    dt_bias = (rng.standard_normal(NV * DK) * 0.5).astype(np.float32)
    if beta_activated:
        b = rng.uniform(0.1, 0.9, (T, NV)).astype(np.float32)
    want_o, want_conv, want_rec = reference(qkv, b, g, w, bias, a_log, dt_bias, conv, rec, qsl,
                                            seq_lens, sidx, read, dist, lower_bound,
                                            beta_activated)
    conv_before, rec_before = conv.copy(), rec.copy()
    (c2, r2), o = flywheel.fused_conv1d_kda(qkv, b, g, conv, rec, w, bias, a_log, dt_bias, qsl,
                                             sidx, dist, seq_lens, read, n_kq=NKQ, n_v=NV,
                                             d_k=DK, d_v=DV, kernel_size=K,
                                             lower_bound=lower_bound,
                                             beta_is_activated=beta_activated)
    assert c2 is conv and r2 is rec
    assert np.abs(o - want_o).max() <= 1e-4 * (1 + np.abs(want_o).max())
    assert not o[int(qsl[5]):].any()
    for s in (1, 2, 3, 4, 5):
        assert np.array_equal(conv[s], want_conv[s].astype(np.float32))
        assert np.abs(rec[s] - want_rec[s]).max() <= 1e-4
    for s in (0, 6, 7, 8, 9):
        assert np.array_equal(conv[s], conv_before[s]) and np.array_equal(rec[s], rec_before[s])


def test_kda_layer_bad_gates_are_refused_with_nothing_written():
    rng = np.random.default_rng(16)
    qsl, seq_lens, sidx, read, dist, T = batch()
    qkv, b, _, w, bias, a_log, _, conv, rec = inputs(rng, T)
    g = rng.standard_normal((T, NV * DK)).astype(np.float32)
    dt_bias = np.zeros(NV * DK, np.float32)
    kw = dict(n_kq=NKQ, n_v=NV, d_k=DK, d_v=DV, kernel_size=K)
    args = (w, bias, a_log, dt_bias, qsl, sidx, dist, seq_lens, read)
    with pytest.raises(ValueError, match="n_v d_k"):
        flywheel.fused_conv1d_kda(qkv, b, g[:, :NV], conv, rec, *args, **kw)
    with pytest.raises(ValueError, match="fused_conv1d_kda"):
        flywheel.fused_conv1d_gdn(qkv, b, g, conv, rec, *args, **kw)
    g[int(qsl[4]) + 2, 5] = np.nan  # a row of the last prefill: found before anything is written
    conv0, rec0 = conv.copy(), rec.copy()
    out = np.full((T, NV * DV), 7.0, np.float32)
    with pytest.raises(FlywheelError, match="computed from a"):
        flywheel.fused_conv1d_kda(qkv, b, g, conv, rec, *args, **kw, out=out)
    assert np.array_equal(conv, conv0) and np.array_equal(rec, rec0) and (out == 7.0).all()


# ------------------------------------------------------------------ ReplaySSM decodes --

def _replay_step_inputs(rng, kda):
    """One step of 3 decodes (slots 1, 2 in place; slot 3 read, slot 4 written: it flushes
    every step) and padding: qkv, b, gate, qsl, seq_lens, sidx, read, dist."""
    T = 5
    qkv = rng.standard_normal((T, DIM)).astype(np.float32)
    b = rng.standard_normal((T, NV)).astype(np.float32)
    g = rng.standard_normal((T, NV * DK if kda else NV)).astype(np.float32)
    qsl = np.array([0, 1, 2, 3], np.int32)
    return qkv, b, g, qsl


@pytest.mark.parametrize("kda", [False, True])
def test_replay_decodes_follow_the_plain_layer(kda):
    """Eight steps of ReplaySSM decodes (window 4: records accumulate, then flush) give the
    plain layer's outputs on the same tokens; every flushed checkpoint's shadow is its bf16;
    next_replay_lens counts the records."""
    rng = np.random.default_rng(11)
    _, _, _, w, bias, a_log, _, conv, rec = inputs(rng, 1)
    dt_bias = (rng.standard_normal(NV * DK if kda else NV) * 0.5).astype(np.float32)
    call = flywheel.fused_conv1d_kda_replay if kda else flywheel.fused_conv1d_gdn_replay
    plain = flywheel.fused_conv1d_kda if kda else flywheel.fused_conv1d_gdn
    dim = (flywheel.kda_replay_record_dim if kda else flywheel.replay_record_dim)(NKQ, NV, DK, DV)
    assert dim == NV * DV + NKQ * DK + (NV * DK if kda else 128)
    W = 4
    conv_p, rec_p = conv.copy(), rec.copy()
    shadow = np.zeros((SLOTS, NV, DK, DV), ml_dtypes.bfloat16)
    records = np.full((SLOTS, W, dim), np.nan, np.float32)   # never read past replay_lens
    lens = np.zeros(3, np.int32)
    sidx, read = np.array([1, 2, 4], np.int32), np.array([1, 2, 3], np.int32)
    seq_lens, dist = np.array([9, 9, 9], np.int32), np.array([3, 3, 3], np.int32)
    lb = {"lower_bound": -5.0} if kda else {}
    flushed = 0
    for step in range(8):
        qkv, b, g, qsl = _replay_step_inputs(rng, kda)
        (_, _), want = plain(qkv, b, g, conv_p, rec_p, w, bias, a_log, dt_bias, qsl, sidx, dist,
                             seq_lens, read, n_kq=NKQ, n_v=NV, d_k=DK, d_v=DV, kernel_size=K, **lb)
        before = rec.copy()
        (c2, r2, s2, p2), o = call(qkv, b, g, conv, rec, shadow, records, w, bias, a_log, dt_bias,
                                   qsl, sidx, dist, seq_lens, read, lens, n_kq=NKQ, n_v=NV,
                                   d_k=DK, d_v=DV, kernel_size=K, replay_window=W, **lb)
        assert c2 is conv and r2 is rec and s2 is shadow and p2 is records
        assert np.abs(o - want).max() <= 1e-4 * (1 + np.abs(want).max()), step
        assert np.array_equal(conv, conv_p)
        for s in range(SLOTS):
            if not np.array_equal(rec[s], before[s]):
                flushed += 1
                assert np.array_equal(shadow[s], rec[s].astype(ml_dtypes.bfloat16))
        new = flywheel.next_replay_lens(lens, qsl, seq_lens, sidx, read, dist, [1, 1, 1], W)
        assert new.dtype == np.int32
        assert list(new) == [1 if lens[0] == W else lens[0] + 1,
                             1 if lens[1] == W else lens[1] + 1, 1]
        lens = new
        conv_p[3], rec_p[3] = conv_p[4], rec_p[4]   # the prefix-slot decode reads back its copy
        conv[3], rec[3] = conv[4], rec[4]
        records[3], shadow[3] = records[4], shadow[4]
    assert flushed >= 8 + 2     # slot 4 every step, slots 1 and 2 once their window filled


def test_replay_record_dims_refuse_bad_counts():
    assert flywheel.replay_record_dim(16, 32, 128, 128) == 32 * 128 + 16 * 128 + 128
    assert flywheel.kda_replay_record_dim(16, 32, 128, 128) == 32 * 128 + 16 * 128 + 32 * 128
    for bad in ((-1, 2, 8, 8), (1, 2, 1 << 20, 8), (1, 2, 8, 2 ** 70)):
        with pytest.raises(ValueError):
            flywheel.replay_record_dim(*bad)
    with pytest.raises(TypeError):
        flywheel.kda_replay_record_dim(1, 2, 8.5, 8)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_replay_on_bf16_torch_tensors():
    """bf16 qkv, shadow and records as torch tensors: updated in place, outputs close to the
    plain layer's (bf16 products: the decodes read the bf16 shadow; bf16 records round u, k
    and g once)."""
    rng = np.random.default_rng(12)
    _, _, _, w, bias, a_log, dt_bias, conv, rec = inputs(rng, 1)
    dim = flywheel.replay_record_dim(NKQ, NV, DK, DV)
    conv_t = torch.from_numpy(conv).to(torch.bfloat16)
    conv_p, rec_p, rec_t = conv_t.clone(), rec.copy(), torch.from_numpy(rec.copy())
    shadow = rec_t.to(torch.bfloat16)           # the original's contract: the checkpoint's bf16
    records = torch.zeros(SLOTS, 8, dim, dtype=torch.bfloat16)
    lens = np.zeros(3, np.int32)
    sidx = read = np.array([1, 2, 3], np.int32)
    seq_lens, dist = np.array([9, 9, 1], np.int32), np.array([3, 3, 3], np.int32)
    for step in range(5):
        qkv, b, g, qsl = _replay_step_inputs(rng, False)
        tq = torch.from_numpy(qkv).to(torch.bfloat16)
        (_, _), want = flywheel.fused_conv1d_gdn(tq, b, g, conv_p, rec_p, w, bias, a_log, dt_bias,
                                                 qsl, sidx, dist, seq_lens, read, n_kq=NKQ,
                                                 n_v=NV, d_k=DK, d_v=DV, kernel_size=K)
        (c2, r2, s2, p2), o = flywheel.fused_conv1d_gdn_replay(
            tq, b, g, conv_t, rec_t, shadow, records, w, bias, a_log, dt_bias, qsl, sidx, dist,
            seq_lens, read, lens, n_kq=NKQ, n_v=NV, d_k=DK, d_v=DV, kernel_size=K,
            replay_window=8)
        assert o.dtype == torch.bfloat16 and s2 is shadow and p2 is records and r2 is rec_t
        assert np.abs(as64(o) - as64(want)).max() <= 0.05 * (1 + np.abs(as64(want)).max())
        assert torch.equal(conv_t, conv_p)
        lens = flywheel.next_replay_lens(lens, qsl, seq_lens, sidx, read, dist, [1, 1, 1], 8)
        seq_lens = seq_lens + 1
    assert records[1, :5].abs().sum() > 0 and records[1, 5:].abs().sum() == 0


@pytest.mark.parametrize("case", ["replay_lens past the window", "records of the wrong width",
                                  "replay_window not the records'", "shadow not bf16",
                                  "replay_lens of the wrong length"])
def test_bad_replay_input_is_refused_with_nothing_written(case):
    rng = np.random.default_rng(13)
    _, _, _, w, bias, a_log, dt_bias, conv, rec = inputs(rng, 1)
    qkv, b, g, qsl = _replay_step_inputs(rng, False)
    dim = flywheel.replay_record_dim(NKQ, NV, DK, DV)
    bf = ml_dtypes.bfloat16
    shadow = np.zeros((SLOTS, NV, DK, DV), bf)
    records = np.zeros((SLOTS, 4, dim), np.float32)
    lens, window = np.array([1, 1, 1], np.int32), 4
    if case == "replay_lens past the window":
        lens[1] = 5
    elif case == "records of the wrong width":
        records = np.zeros((SLOTS, 4, dim - 1), np.float32)
    elif case == "replay_window not the records'":
        window = 8
    elif case == "shadow not bf16":
        shadow = np.zeros((SLOTS, NV, DK, DV), np.float32)
    else:
        lens = np.array([1, 1], np.int32)
    saved = [x.copy() for x in (conv, rec, shadow, records)]
    out = np.full((qkv.shape[0], NV * DV), 7.0, np.float32)
    with pytest.raises((ValueError, TypeError)):
        flywheel.fused_conv1d_gdn_replay(qkv, b, g, conv, rec, shadow, records, w, bias, a_log,
                                         dt_bias, qsl, np.array([1, 2, 3], np.int32),
                                         np.array([3, 3, 3], np.int32), np.array([9, 9, 9], np.int32),
                                         np.array([1, 2, 3], np.int32), lens, n_kq=NKQ, n_v=NV,
                                         d_k=DK, d_v=DV, kernel_size=K, replay_window=window,
                                         out=out)
    for x, y in zip((conv, rec, shadow, records), saved):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
    assert (out == 7.0).all()
