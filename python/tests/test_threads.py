"""flywheel.set_spin_us / get_spin_us: the pool's spin window from Python."""

import numpy as np
import pytest

import flywheel


def test_spin_window_roundtrip_and_calls_still_agree():
    saved = flywheel.get_spin_us()
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 3, 4, 16)).astype(np.float32)
    kv = rng.standard_normal((1, 700, 2, 16)).astype(np.float32)
    try:
        want = flywheel.flash_attn_func(q, kv, kv, causal=True)
        for us in (0, 50, 1000000):
            flywheel.set_spin_us(us)
            assert flywheel.get_spin_us() == us
            np.testing.assert_array_equal(flywheel.flash_attn_func(q, kv, kv, causal=True), want)
    finally:
        flywheel.set_spin_us(saved)


@pytest.mark.parametrize("bad", [-1, 1000001, 2**70, float("inf")])
def test_spin_window_out_of_range(bad):
    saved = flywheel.get_spin_us()
    with pytest.raises(ValueError, match="spin window"):
        flywheel.set_spin_us(bad)
    assert flywheel.get_spin_us() == saved


def _omp_or_skip():
    try:
        flywheel.use_openmp_threads(2)
    except NotImplementedError as e:
        pytest.skip(f"no OpenMP loop in this build: {e}")


def test_openmp_threads_same_bits_and_back():
    """use_openmp_threads: the parallel loops on OpenMP's team (torch's, in torch), the same bits
    as the library's own threads (attention, GDN prefill, on 1..3 threads), threading_mode
    saying which, use_own_threads going back."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 300, 4, 32)).astype(np.float32)
    kv = rng.standard_normal((1, 700, 2, 32)).astype(np.float32)
    T, H, HV, D = 200, 2, 4, 32
    gq = rng.standard_normal((1, T, H, D)).astype(np.float32)
    gk = rng.standard_normal((1, T, H, D)).astype(np.float32)
    gv = rng.standard_normal((1, T, HV, D)).astype(np.float32)
    g = -np.abs(rng.standard_normal((1, T, HV))).astype(np.float32) * 0.1
    beta = rng.uniform(0.2, 0.9, (1, T, HV)).astype(np.float32)

    def run():
        a = flywheel.flash_attn_func(q, kv, kv, causal=True)
        o, s = flywheel.chunk_gated_delta_rule(gq, gk, gv, g, beta, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
        return [np.asarray(a), np.asarray(o), np.asarray(s)]

    saved = flywheel.get_num_threads()
    flywheel.use_own_threads()  # whatever an earlier test left
    assert flywheel.threading_mode() == ("own", 0)
    want = run()
    try:
        _omp_or_skip()
        assert flywheel.threading_mode() == ("openmp", 2)
        for n in (1, 2, 3):
            flywheel.set_num_threads(n)
            for got, w in zip(run(), want):
                np.testing.assert_array_equal(got, w)
        flywheel.set_num_threads(0)  # the count use_openmp_threads set
        for got, w in zip(run(), want):
            np.testing.assert_array_equal(got, w)
        flywheel.use_openmp_threads()  # OpenMP's team size now
        assert flywheel.threading_mode()[0] == "openmp" and flywheel.threading_mode()[1] >= 1
    finally:
        flywheel.use_own_threads()
        flywheel.set_num_threads(saved)
    assert flywheel.threading_mode() == ("own", 0)
    for got, w in zip(run(), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("bad", [0, -1, 257, 2.0, True, "2"])
def test_openmp_threads_bad_count(bad):
    _omp_or_skip()
    flywheel.use_own_threads()
    with pytest.raises(ValueError, match="threads must be"):
        flywheel.use_openmp_threads(bad)
    assert flywheel.threading_mode() == ("own", 0)


def test_vllm_plugin_shares_torch_threads(monkeypatch):
    """The vLLM plugin's share_threads: once per process, torch's OpenMP threads by default
    (FLYWHEEL_VLLM_THREADS=openmp), the library's own with =own, anything else refused."""
    torch = pytest.importorskip("torch")
    import flywheel.integrations.vllm as fwv
    _omp_or_skip()
    try:
        for setting, want in (("openmp", ("openmp", torch.get_num_threads())), ("own", ("own", 0))):
            flywheel.use_own_threads()
            fwv._THREADS.clear()
            monkeypatch.setenv("FLYWHEEL_VLLM_THREADS", setting)
            fwv.share_threads()
            assert flywheel.threading_mode() == want
            flywheel.use_own_threads()
            fwv.share_threads()  # once only: the second call changes nothing
            assert flywheel.threading_mode() == ("own", 0)
        fwv._THREADS.clear()
        monkeypatch.setenv("FLYWHEEL_VLLM_THREADS", "pool")
        for _ in range(2):  # refused each time, not remembered
            with pytest.raises(ValueError, match="FLYWHEEL_VLLM_THREADS"):
                fwv.share_threads()
    finally:
        fwv._THREADS.clear()
        flywheel.use_own_threads()
