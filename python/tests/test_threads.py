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
