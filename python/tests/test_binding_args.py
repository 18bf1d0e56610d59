"""Argument handling of the binding, one test per bug fuzz/python/fuzz_binding.py found: values
past int32, int64 or float32 that ctypes or numpy would wrap or raise OverflowError on, flags
read after the output was written, shapes that were accepted by size only, NULL pointers for
empty arrays, and commit's replay argument."""

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import flywheel
from flywheel import FlywheelError
from conftest import make

BIG = 2**31  # one past int32


def dense(rng, shape=(1, 6, 2, 8)):
    return make(rng, shape, "float32", "numpy")[0]


def gdn_inputs(rng, B=1, Tn=4, H=1, HV=2, K=4, V=4):
    q, k = dense(rng, (B, Tn, H, K)), dense(rng, (B, Tn, H, K))
    v = dense(rng, (B, Tn, HV, V))
    g = (-np.abs(rng.standard_normal((B, Tn, HV))) * 0.3).astype(np.float32)
    beta = rng.random((B, Tn, HV)).astype(np.float32)
    return q, k, v, g, beta


def test_index_values_past_int32_are_value_errors():
    """They raised OverflowError, which is not one of the error rules' types."""
    rng = np.random.default_rng(1)
    q = dense(rng)
    kc = np.zeros((2, 8, 2, 8), np.float32)
    calls = [
        lambda: flywheel.flash_attn_varlen_func(q[0], q[0], q[0], [0, 2**40], [0, 6], 6, 6),
        lambda: flywheel.flash_attn_with_kvcache(q[:, :1], kc, kc, cache_seqlens=[BIG]),
        lambda: flywheel.flash_attn_with_kvcache(q[:, :1], kc, kc, cache_seqlens=[1],
                                                 block_table=[[2**40]]),
    ]
    qd, kd, vd = dense(rng, (2, 1, 4)), dense(rng, (2, 1, 4)), dense(rng, (2, 2, 4))
    gd = -np.ones((2, 2), np.float32)
    state = np.zeros((3, 2, 4, 4), np.float32)
    calls.append(lambda: flywheel.gated_delta_rule_decode(qd, kd, vd, gd, gd, state,
                                                          state_indices=[0, BIG]))
    q4, k4, v4, g4, b4 = gdn_inputs(rng)
    calls.append(lambda: flywheel.chunk_gated_delta_rule(q4, k4, v4, g4, b4,
                                                         cu_seqlens=np.array([0, 2**40])))
    _, replay = flywheel.gated_delta_rule_verify(q4, k4, v4, g4, b4, state[:1])
    calls.append(lambda: flywheel.gated_delta_rule_commit(replay, [BIG], state[:1]))
    for call in calls:
        with pytest.raises(ValueError, match="do not fit in int32"):
            call()


def test_float_parameters_past_float64_or_float32_are_value_errors():
    """softmax_scale=2**2000 raised OverflowError; 1e-50 rounded to 0.0 in the library's
    float32 and silently became the default 1/sqrt(d) (a softcap of 1e-50: no softcap)."""
    rng = np.random.default_rng(2)
    q = dense(rng)
    for kw in ({"softmax_scale": 2**2000}, {"softcap": 2**2000}):
        with pytest.raises(ValueError, match="too large for a float"):
            flywheel.flash_attn_func(q, q, q, **kw)
    for kw in ({"softmax_scale": 1e-50}, {"softmax_scale": -1e-50}, {"softcap": 1e-50},
               {"softcap": -1e-50}):
        with pytest.raises(ValueError, match="rounds to 0 in float32"):
            flywheel.flash_attn_func(q, q, q, **kw)
        with pytest.raises(ValueError, match="rounds to 0 in float32"):
            flywheel.flash_attn_varlen_func(q[0], q[0], q[0], [0, 6], [0, 6], 6, 6, **kw)
    q4, k4, v4, g4, b4 = gdn_inputs(rng)
    with pytest.raises(ValueError, match="too large for a float"):
        flywheel.chunk_gated_delta_rule(q4, k4, v4, g4, b4, scale=2**2000)
    with pytest.raises(ValueError, match="rounds to 0 in float32"):
        flywheel.chunk_gated_delta_rule(q4, k4, v4, g4, b4, scale=1e-50)
    # a float32 subnormal is not 0: taken as given
    flywheel.flash_attn_func(q, q, q, softmax_scale=1e-40)


def test_window_sides_past_any_sequence_are_unbounded():
    """window_size=(2**64, -1) wrapped to (0, -1) in ctypes' int64 (a one-key window), and
    float('inf') raised OverflowError; both are unbounded, as is anything from 2^62 on."""
    rng = np.random.default_rng(3)
    q, k, v = dense(rng), dense(rng), dense(rng)
    full = flywheel.flash_attn_func(q, k, v)
    right2 = flywheel.flash_attn_func(q, k, v, window_size=(-1, 2))
    for side in (2**64, 2**63, 2**62, np.uint64(2**64 - 1), np.int64(2**63 - 1), float("inf")):
        assert np.array_equal(flywheel.flash_attn_func(q, k, v, window_size=(side, side)), full)
        assert np.array_equal(flywheel.flash_attn_func(q, k, v, window_size=(side, 2)), right2)
    assert not np.array_equal(flywheel.flash_attn_func(q, k, v, window_size=(0, -1)), full)
    with pytest.raises(ValueError):
        flywheel.flash_attn_func(q, k, v, window_size=(float("nan"), -1))


def test_set_num_threads_refuses_values_past_int32():
    """set_num_threads(2**32) was kept and wrapped to 0 (all CPUs) in the call's int32;
    set_num_threads(float('inf')) raised OverflowError."""
    flywheel.set_num_threads(2)
    for bad in (2**32, 2**32 + 1, BIG, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            flywheel.set_num_threads(bad)
        assert flywheel.get_num_threads() == 2


def test_row_counts_past_int32_are_value_errors():
    """The per-sequence offsets of [b, sq] queries (and GDN's [B, T]) were int32 arrays times
    sq: OverflowError from sq >= 2^31, a silent wrap from b * sq >= 2^31. Zero strides make
    such arrays cost nothing."""
    kc = np.zeros((2, 8, 1, 4), np.float32)
    for b, sq in ((1, BIG), (2, 2**30 + 1), (BIG, 1)):
        q = as_strided(np.zeros(4, np.float32), (b, sq, 1, 4), (0, 0, 0, 4))
        with pytest.raises(ValueError, match="int32 offsets"):
            flywheel.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=1)
    q = as_strided(np.zeros(4, np.float32), (1, BIG, 1, 4), (0, 0, 0, 4))
    v = np.zeros((1, BIG, 0, 4), np.float32)  # no value heads: nothing to allocate
    g = np.zeros((1, BIG, 0), np.float32)
    for f in (flywheel.chunk_gated_delta_rule, flywheel.fused_recurrent_gated_delta_rule):
        with pytest.raises(ValueError, match="int32 offsets"):
            f(q, q, v, g, beta=g) if f is flywheel.fused_recurrent_gated_delta_rule else \
                f(q, q, v, g, g)


def test_flags_are_read_before_out_is_written():
    """With return_softmax_lse=True, a return_attn_probs without a truth value (a numpy array)
    raised only after the kernel had written out=."""
    rng = np.random.default_rng(4)
    q = dense(rng)
    out = np.full(q.shape, 7.0, np.float32)
    with pytest.raises(ValueError, match="truth value"):
        flywheel.flash_attn_func(q, q, q, out=out, return_softmax_lse=True,
                                 return_attn_probs=np.array([1, 1]))
    assert (out == 7.0).all()
    with pytest.raises(ValueError, match="truth value"):
        flywheel.flash_attn_varlen_func(q[0], q[0], q[0], [0, 6], [0, 6], 6, 6, out=out[0],
                                        return_softmax_lse=True,
                                        return_attn_probs=np.array([1, 1]))
    assert (out == 7.0).all()


def test_kvcache_block_table_without_columns_is_not_a_contiguous_cache():
    """An empty block table was passed as NULL, which the library reads as a contiguous cache:
    block_table of shape [b, 0] attended over the paged cache as if it were [b, S]."""
    rng = np.random.default_rng(5)
    q = dense(rng, (1, 1, 2, 8))
    kc = np.zeros((2, 8, 2, 8), np.float32)
    with pytest.raises(FlywheelError, match="max_pages 0") as e:
        flywheel.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=[3],
                                         block_table=np.zeros((1, 0), np.int32))
    assert e.value.status == "FW_ERR_ARG"
    # no sequences: still a paged cache, whose page size is checked
    with pytest.raises(FlywheelError, match="page_size"):
        flywheel.flash_attn_with_kvcache(q[:0], np.zeros((2, 0, 2, 8), np.float32),
                                         np.zeros((2, 0, 2, 8), np.float32),
                                         cache_seqlens=np.zeros(0, np.int32),
                                         block_table=np.zeros((0, 1), np.int32))


def test_decode_gates_are_checked_by_shape_not_size():
    """g and beta of any shape with N * HV entries were accepted: [HV, N] gates were read in
    the wrong order."""
    rng = np.random.default_rng(6)
    N, H, HV, K, V = 3, 1, 2, 4, 4
    q, k, v = dense(rng, (N, H, K)), dense(rng, (N, H, K)), dense(rng, (N, HV, V))
    g = (-np.abs(rng.standard_normal((N, HV))) * 0.3).astype(np.float32)
    beta = rng.random((N, HV)).astype(np.float32)
    state = np.zeros((N, HV, K, V), np.float32)
    for bad in (g.T.copy(), g.reshape(-1), g.reshape(N, HV, 1)):
        for args in ((bad, beta), (g, bad.copy())):
            with pytest.raises(ValueError, match=r"must be \[N, HV\]"):
                flywheel.gated_delta_rule_decode(q, k, v, *args, state)
    assert (state == 0).all()
    flywheel.gated_delta_rule_decode(q, k, v, g[:, None], beta[:, None], state)  # [N, 1, HV]


def test_gdn_cu_seqlens_must_be_one_dimensional():
    """A 2-D cu_seqlens was read flat."""
    rng = np.random.default_rng(7)
    q, k, v, g, beta = gdn_inputs(rng)
    for f in (flywheel.chunk_gated_delta_rule, flywheel.gated_delta_rule_verify):
        args = (q, k, v, g, beta) if f is flywheel.chunk_gated_delta_rule else \
            (q, k, v, g, beta, np.zeros((1, 2, 4, 4), np.float32))
        with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
            f(*args, cu_seqlens=np.array([[0, 4]]))
    assert flywheel.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=[0, 1, 4])[0].shape == \
        v.shape


def test_commit_checks_its_replay_and_takes_an_empty_batch():
    """commit(None, ...) raised AttributeError; a GDNReplay made by hand with other arrays
    would have been read by pointer; the commit of an empty verify passed NULL for accepted,
    which the library refused (FW_ERR_NULL)."""
    rng = np.random.default_rng(8)
    q, k, v, g, beta = gdn_inputs(rng)
    state = np.zeros((1, 2, 4, 4), np.float32)
    for bad in (None, "replay", {"buffer": 1},
                flywheel.GDNReplay([0, 1], [0], [0], 1, 2, 4, 4),
                flywheel.GDNReplay(np.zeros(8, np.float16), np.array([0, 1], np.int32),
                                   np.array([0], np.int32), 1, 2, 4, 4)):
        with pytest.raises(TypeError, match="replay"):
            flywheel.gated_delta_rule_commit(bad, [0], state)
    o, replay = flywheel.gated_delta_rule_verify(q[:, :0], k[:, :0], v[:, :0], g[:, :0],
                                                 beta[:, :0], state, cu_seqlens=[0])
    assert o.shape == (1, 0, 2, 4)
    flywheel.gated_delta_rule_commit(replay, np.zeros(0, np.int32), state)
    assert (state == 0).all()
