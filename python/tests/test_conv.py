"""causal_conv1d_fn / causal_conv1d_update (causal-conv1d's calls) and flywheel.fla's
causal_conv1d / causal_conv1d_update against a float64 numpy reference written from the
formulas (circular conv states and slot indices included), on numpy and torch inputs in
float32, bfloat16 and float16, channel-first and channel-last layouts; and bad input."""

import numpy as np
import pytest

import flywheel
from flywheel import FlywheelError
from conftest import FAMILIES, as64, make, read_only, torch

DTYPES = ["float32", "bfloat16", "float16"]
WIDTHS = [1, 2, 4, 17]
LENGTHS = ["1", "W-1", "70", "130"]
LAYOUTS = ["channel_first", "channel_last"]
D = 37  # not a multiple of any vector width: the kernels' channel tails are used

# one unit in the last place at 1.0 of the half-precision output dtypes
ULP = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


# ------------------------------------------------------------------------ float64 reference

def silu(y):
    return y / (1.0 + np.exp(-y))


def act(y, activation):
    return y if activation is None else silu(y)


def last(a, n):
    """a's last n columns (along its last axis; n may be 0)."""
    return a[..., a.shape[-1] - n:]


def conv_window(hist, x, w, b=None, activation=None):
    """act(b + sum_k w[:, k] x'[:, t - (W-1) + k]) where x' is x [D, n] with the W-1 inputs
    hist [D, W-1] before it; -> [D, n]."""
    W, n = w.shape[1], x.shape[1]
    xx = np.concatenate([hist, x], axis=1)
    y = np.zeros(x.shape) if b is None else np.repeat(b[:, None], n, axis=1)
    for k in range(W):
        y = y + w[:, k:k + 1] * xx[:, k:k + n]
    return act(y, activation)


def runs(seq_idx_row):
    """The boundaries [0, ..., L] of the runs of equal values in seq_idx_row."""
    L = len(seq_idx_row)
    return [0] + [t for t in range(1, L) if seq_idx_row[t] != seq_idx_row[t - 1]] + [L]


def ref_fn(x, w, b=None, init=None, activation=None, seq_idx=None):
    """causal_conv1d_fn: x [B, D, L], w [D, W], init [B, D, S] (its last W-1 entries are the
    inputs before t = 0) -> out [B, D, L], final [B, D, W-1] (the last W-1 inputs)."""
    B, Dn, L = x.shape
    W = w.shape[1]
    out, final = np.zeros(x.shape), np.zeros((B, Dn, W - 1))
    for r in range(B):
        bounds = [0, L] if seq_idx is None else runs(seq_idx[r])
        for s, e in zip(bounds[:-1], bounds[1:]):
            hist = np.zeros((Dn, W - 1)) if init is None else last(init[r], W - 1)
            out[r, :, s:e] = conv_window(hist, x[r, :, s:e], w, b, activation)
            final[r] = last(np.concatenate([hist, x[r, :, s:e]], axis=1), W - 1)
    return out, final


def ref_update(x, state, w, b=None, activation=None, cache_seqlens=None, indices=None):
    """causal_conv1d_update (causal-conv1d's causal_conv1d_update_ref, with slot indices):
    x [B, D, L], state [slots, D, S] -> out [B, D, L], the new state (a copy).
    Without cache_seqlens the state is the last S inputs, oldest first; with them it is
    circular: the window is read at (c - (W-1) + k) mod S, token t written at (c + t) mod S.
    A negative slot index reads zeros and writes nothing."""
    state = state.copy()
    B, Dn, L = x.shape
    S, W = state.shape[2], w.shape[1]
    out = np.zeros(x.shape)
    for r in range(B):
        slot = r if indices is None else indices[r]
        cur = state[slot].copy() if slot >= 0 else np.zeros((Dn, S))
        if cache_seqlens is None:
            hist = last(cur, W - 1)
            new = last(np.concatenate([cur, x[r]], axis=1), S)
        else:
            c = int(cache_seqlens[r])
            hist = cur[:, [(c - (W - 1) + k) % S for k in range(W - 1)]]
            new = cur.copy()
            for t in range(L):
                new[:, (c + t) % S] = x[r, :, t]
        out[r] = conv_window(hist, x[r], w, b, activation)
        if slot >= 0:
            state[slot] = new
    return out, state


def ref_fla(x, w, b=None, residual=None, init=None, activation=None, cu=None):
    """fla's causal_conv1d: x [B, T, D], init [N, D, W] (a sequence's last W inputs; the conv
    reads the last W-1) -> y [B, T, D] (residual added after the activation), final [N, D, W]."""
    B, Tn, Dn = x.shape
    W = w.shape[1]
    seqs = ([(r, 0, Tn) for r in range(B)] if cu is None
            else [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)])
    y, final = np.zeros(x.shape), np.zeros((len(seqs), Dn, W))
    for i, (r, s, e) in enumerate(seqs):
        cache = np.zeros((Dn, W)) if init is None else init[i]
        xs = x[r, s:e].T
        y[r, s:e] = conv_window(last(cache, W - 1), xs, w, b, activation).T
        final[i] = last(np.concatenate([cache, xs], axis=1), W)
    return (y if residual is None else y + residual), final


def ref_fla_update(x, cache, w, b=None, residual=None, activation=None):
    """fla's causal_conv1d_update: cache [N, D, W] shifted left by one with x [N, D] appended;
    y = act(b + sum_k w[:, k] cache[:, :, k]) (+ residual) -> y [N, D], new cache."""
    new = np.concatenate([cache[:, :, 1:], x[:, :, None]], axis=2)
    y = (new * w[None]).sum(axis=2) + (0.0 if b is None else b[None])
    y = act(y, activation)
    return (y if residual is None else y + residual), new


# ---------------------------------------------------------------------------------- helpers

def length(spec, W):
    return W - 1 if spec == "W-1" else int(spec)


def swap12(a):
    return a.transpose(1, 2) if torch is not None and isinstance(a, torch.Tensor) \
        else np.swapaxes(a, 1, 2)


def make_bdl(rng, B, Dn, L, dtype, family, layout, scale=1.0):
    """x [B, D, L]: contiguous (channel_first) or the transposed view of a contiguous
    [B, L, D] tensor (channel_last, as transformers passes it); and its float64 value."""
    if layout == "channel_first":
        return make(rng, (B, Dn, L), dtype, family, scale)
    t, t64 = make(rng, (B, L, Dn), dtype, family, scale)
    return swap12(t), np.swapaxes(t64, 1, 2)


def make_weights(rng, W, dtype, family, Dn=D):
    """weight [D, W] scaled by W^-1/2 (outputs O(1)), bias [D]; and their float64 values."""
    w, w64 = make(rng, (Dn, W), dtype, family, scale=W ** -0.5)
    b, b64 = make(rng, (Dn,), dtype, family, scale=0.5)
    return w, w64, b, b64


def ints(values, family):
    a = np.asarray(values, dtype=np.int32)
    return torch.from_numpy(a) if family == "torch" else a


def like(a64, ref):
    """float64 values (representable in ref's dtype) as an array of ref's family and dtype."""
    if torch is not None and isinstance(ref, torch.Tensor):
        return torch.from_numpy(np.ascontiguousarray(a64)).to(ref.dtype)
    return np.ascontiguousarray(a64).astype(ref.dtype)


def empty(shape, dtype, family):
    """An output array filled with 7.0 (to see whether anything was written)."""
    ref, _ = make(np.random.default_rng(0), (1,), dtype, family)
    return like(np.full(shape, 7.0), ref)


def dtype_name(a):
    return str(a.dtype).replace("torch.", "")


def assert_close(got, ref, dtype):
    """float32: 1e-5 relative + absolute; bf16/f16: 2 ulps of the dtype relative + 1e-3."""
    got = as64(got)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if dtype == "float32":
        tol = 1e-5 * (1.0 + np.abs(ref))
    else:
        tol = 2 * ULP[dtype] * np.abs(ref) + 1e-3
    err = np.abs(got - ref)
    assert np.all(err <= tol), f"max error {err.max(initial=0)} ({dtype})"


def assert_exact(got, ref):
    got = as64(got)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.array_equal(got, ref)


def same_memory(a, b):
    if torch is not None and isinstance(a, torch.Tensor):
        return a is b or a.data_ptr() == b.data_ptr()
    return a is b


def logical(state64, offsets):
    """A circular state [B, D, S] in logical order: entry e at row (offsets[r] + e) mod S."""
    S = state64.shape[2]
    return np.stack([s[:, (int(o) + np.arange(S)) % S] for s, o in zip(state64, offsets)])


# --------------------------------------------------------------------------- causal_conv1d_fn

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", WIDTHS)
@pytest.mark.parametrize("Ls", LENGTHS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["plain", "silu_bias_states"])
def test_fn_matches_reference(family, dtype, W, Ls, layout, mode):
    L = length(Ls, W)
    rng = np.random.default_rng(1000 * W + L)
    B = 2
    x, x64 = make_bdl(rng, B, D, L, dtype, family, layout)
    w, w64, b, b64 = make_weights(rng, W, dtype, family)
    if mode == "plain":
        out = flywheel.causal_conv1d_fn(x, w)
        ro, _ = ref_fn(x64, w64)
    else:
        # S = W - 1 + 2: the last W - 1 entries are the ones used
        init, init64 = make(rng, (B, D, W + 1), dtype, family)
        out, fs = flywheel.causal_conv1d_fn(x, w, b, initial_states=init,
                                            return_final_states=True, activation="silu")
        ro, rf = ref_fn(x64, w64, b64, init64, "silu")
        assert dtype_name(fs) == dtype
        assert_exact(fs, rf)  # copies of inputs (initial state entries where L < W - 1)
    assert dtype_name(out) == dtype and tuple(out.shape) == (B, D, L)
    assert_close(out, ro, dtype)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fn_final_states_without_initial_states_are_padded_with_zeros(family, dtype):
    rng = np.random.default_rng(3)
    W, L = 17, 5  # shorter than W - 1: the first W - 1 - L entries are zeros
    x, x64 = make(rng, (2, D, L), dtype, family)
    w, w64, _, _ = make_weights(rng, W, dtype, family)
    out, fs = flywheel.causal_conv1d_fn(x, w, return_final_states=True)
    ro, rf = ref_fn(x64, w64)
    assert np.all(as64(fs)[:, :, :W - 1 - L] == 0)
    assert_exact(fs, rf)
    assert_close(out, ro, dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_fn_weight_3d_swish_and_outputs_given(family):
    """weight [D, 1, W] (nn.Conv1d's), "swish" == "silu", out= and final_states_out= are
    written and returned (a channel-last out view included)."""
    rng = np.random.default_rng(4)
    W, L, dtype = 4, 70, "bfloat16"
    x, x64 = make_bdl(rng, 2, D, L, dtype, family, "channel_last")
    w, w64, b, b64 = make_weights(rng, W, dtype, family)
    w3 = w[:, None, :]
    ro, rf = ref_fn(x64, w64, b64, activation="silu")
    out = swap12(empty((2, L, D), dtype, family))  # a [B, D, L] view of channel-last memory
    fs_out = empty((2, D, W - 1), dtype, family)
    res = flywheel.causal_conv1d_fn(x, w3, b, return_final_states=True,
                                    final_states_out=fs_out, activation="swish", out=out)
    assert same_memory(res[0], out) and same_memory(res[1], fs_out)
    assert_close(out, ro, dtype)
    assert_exact(fs_out, rf)
    silu = flywheel.causal_conv1d_fn(x, w, b, activation="silu")
    assert_exact(silu, as64(out))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fn_mixed_weight_dtype(family, dtype):
    """float32 weight and bias with half-precision x (weights kept in float32)."""
    rng = np.random.default_rng(5)
    x, x64 = make(rng, (2, D, 20), dtype, family)
    w, w64, b, b64 = make_weights(rng, 4, "float32", family)
    out = flywheel.causal_conv1d_fn(x, w, b, activation="silu")
    assert dtype_name(out) == dtype
    assert_close(out, ref_fn(x64, w64, b64, activation="silu")[0], dtype)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("W", [2, 4, 17])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fn_seq_idx(family, dtype, W, layout):
    """seq_idx: each run of equal values is its own sequence (no state crosses a boundary)."""
    rng = np.random.default_rng(6 + W)
    L = 40
    seq_idx = np.array([[0] * 3 + [1] * 20 + [2] * 17,  # runs of 3, 20, 17
                        [0] * 39 + [5]],                  # a one-token run at the end
                       dtype=np.int32)
    x, x64 = make_bdl(rng, 2, D, L, dtype, family, layout)
    w, w64, b, b64 = make_weights(rng, W, dtype, family)
    out = flywheel.causal_conv1d_fn(x, w, b, seq_idx=ints(seq_idx, family), activation="silu")
    ro, _ = ref_fn(x64, w64, b64, activation="silu", seq_idx=seq_idx)
    assert_close(out, ro, dtype)
    # and not what one unsplit sequence gives (the boundaries matter)
    whole, _ = ref_fn(x64, w64, b64, activation="silu")
    assert not np.allclose(as64(out)[0, :, 3:6], whole[0, :, 3:6])


def test_fn_each_isa_and_threads():
    """Every kernel table this CPU runs, and thread counts 1 and 4, on a bigger problem."""
    rng = np.random.default_rng(7)
    Dn, W, L = 300, 4, 130
    x, x64 = make_bdl(rng, 3, Dn, L, "bfloat16", "numpy", "channel_last")
    w, w64, b, b64 = make_weights(rng, W, "bfloat16", "numpy", Dn)
    init, init64 = make(rng, (3, Dn, W - 1), "bfloat16", "numpy")
    ro, rf = ref_fn(x64, w64, b64, init64, "silu")
    for threads in (1, 4):
        flywheel.set_num_threads(threads)
        for isa in flywheel.isa_tables():
            out, fs = flywheel.causal_conv1d_fn(x, w, b, initial_states=init,
                                                return_final_states=True, activation="silu",
                                                isa=isa)
            assert_close(out, ro, "bfloat16")
            assert_exact(fs, rf)


# ----------------------------------------------------------------------- causal_conv1d_update

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", WIDTHS)
@pytest.mark.parametrize("circular", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])
def test_update_step_by_step_equals_fn(family, dtype, W, circular, chunk):
    """Decoding a sequence chunk by chunk (x [B, D] for one token, [B, D, 3] otherwise) gives
    causal_conv1d_fn's output over the whole sequence, and leaves the last inputs in the
    state (rotated by cache_seqlens when circular)."""
    rng = np.random.default_rng(10 * W + chunk + circular)
    B, L = 2, 11
    S = W + 2 if circular else W - 1  # circular: more room than the window needs
    x, x64 = make(rng, (B, D, L), dtype, family)
    w, w64, b, b64 = make_weights(rng, W, dtype, family)
    state, state64 = make(rng, (B, D, S), dtype, family)
    c0 = np.array([5, 1], dtype=np.int32) if circular else np.zeros(B, np.int32)
    init64 = logical(state64, c0)
    init = like(init64, state)  # the same values in logical order
    full, fs = flywheel.causal_conv1d_fn(x, w, b, initial_states=init,
                                         return_final_states=True, activation="silu")
    ro, rf = ref_fn(x64, w64, b64, init64, "silu")
    assert_close(full, ro, dtype)
    outs = []
    for t in range(0, L, chunk):
        xt = x[:, :, t] if chunk == 1 else x[:, :, t:t + chunk]
        seqlens = ints(c0 + t, family) if circular else None
        o = flywheel.causal_conv1d_update(xt, state, w, b, "silu", cache_seqlens=seqlens)
        assert tuple(o.shape) == tuple(xt.shape)
        outs.append(as64(o).reshape(B, D, -1))
    steps = np.concatenate(outs, axis=2)
    assert_close(steps, ro, dtype)
    assert_close(steps, as64(full), dtype)
    # the state: the last S inputs of (initial state, x), in logical order
    fin = logical(as64(state), c0 + L) if circular else as64(state)
    assert_exact(fin, last(np.concatenate([init64, x64], axis=2), S))
    assert_exact(last(fin, W - 1), as64(fs))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", WIDTHS)
@pytest.mark.parametrize("circular", [False, True])
@pytest.mark.parametrize("seqlen", [None, 1, 3, 9])  # None: x [B, D]
@pytest.mark.parametrize("state_layout", LAYOUTS)
def test_update_matches_reference(family, dtype, W, circular, seqlen, state_layout):
    """One call against causal_conv1d_update_ref; circular states with seqlen > state_len
    wrap round and keep the last writes; a channel_last state is the [slots, D, S] view of
    [slots, S, D] memory, updated in place."""
    rng = np.random.default_rng(100 * W + (seqlen or 0) + circular)
    B = 3
    S = W + 3 if circular else W - 1 + (seqlen or 1) % 3  # non-circular: S >= W - 1
    if circular and seqlen == 9:
        S = max(W - 1, 4)  # seqlen > S: the buffer wraps during the call
    L = seqlen or 1
    x, x64 = make_bdl(rng, B, D, L, dtype, family, "channel_first")
    if seqlen is None:
        x, x64 = x[:, :, 0], x64[:, :, 0]
    w, w64, b, b64 = make_weights(rng, W, dtype, family)
    state, state64 = make_bdl(rng, B, D, S, dtype, family, state_layout)
    seqlens = np.array([0, 7, 2 * S + 1], dtype=np.int32) if circular else None
    out = flywheel.causal_conv1d_update(x, state, w, b, "silu",
                                        None if seqlens is None else ints(seqlens, family))
    ro, rs = ref_update(x64.reshape(B, D, L), state64, w64, b64, "silu", seqlens)
    assert tuple(out.shape) == tuple(x.shape) and dtype_name(out) == dtype
    assert_close(as64(out).reshape(B, D, L), ro, dtype)
    assert_exact(state, rs)


@pytest.mark.parametrize("family", FAMILIES)
def test_update_float32_state_with_bf16_x(family):
    rng = np.random.default_rng(11)
    W = 4
    x, x64 = make(rng, (2, D), "bfloat16", family)
    w, w64, b, b64 = make_weights(rng, W, "bfloat16", family)
    state, state64 = make(rng, (2, D, W - 1), "float32", family)
    out = flywheel.causal_conv1d_update(x, state, w, b)
    ro, rs = ref_update(x64[:, :, None], state64, w64, b64)
    assert_close(as64(out)[:, :, None], ro, "bfloat16")
    assert_exact(state, rs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("W", [1, 4, 17])
@pytest.mark.parametrize("circular", [False, True])
def test_update_slot_indices(family, dtype, W, circular):
    """conv_state_indices pick each row's slot; a negative index starts from zeros and
    writes nothing; slots no row names are left as they were."""
    rng = np.random.default_rng(200 + W + circular)
    slots, B, L = 6, 4, 2
    S = W + 1
    indices = np.array([3, -1, 0, -1], dtype=np.int32)  # two rows without a slot
    x, x64 = make(rng, (B, D, L), dtype, family)
    w, w64, b, b64 = make_weights(rng, W, dtype, family)
    state, state64 = make(rng, (slots, D, S), dtype, family)
    seqlens = np.array([4, 9, 1, 0], dtype=np.int32) if circular else None
    out = flywheel.causal_conv1d_update(x, state, w, b, "silu",
                                        None if seqlens is None else ints(seqlens, family),
                                        ints(indices, family))
    ro, rs = ref_update(x64, state64, w64, b64, "silu", seqlens, indices)
    assert_close(out, ro, dtype)
    assert_exact(state, rs)
    for s in (1, 2, 4, 5):  # untouched
        assert_exact(state[s], state64[s])
    # the rows without a slot: the output of a zero state
    zero, _ = ref_fn(x64[1::2], w64, b64, None, "silu")
    assert_close(as64(out)[1::2], zero, dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_update_out_given(family):
    rng = np.random.default_rng(12)
    W, dtype = 4, "float16"
    x, x64 = make(rng, (2, D, 3), dtype, family)
    w, w64, _, _ = make_weights(rng, W, dtype, family)
    state, state64 = make(rng, (2, D, W - 1), dtype, family)
    out = swap12(empty((2, 3, D), dtype, family))
    res = flywheel.causal_conv1d_update(x, state, w, out=out)
    assert same_memory(res, out)
    ro, rs = ref_update(x64, state64, w64)
    assert_close(out, ro, dtype)
    assert_exact(state, rs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seqlens", [[-1, -9], [2 ** 31 - 1, 2 ** 31 - 5]])
def test_update_cache_seqlens_wrap_as_a_remainder(family, seqlens):
    """cache_seqlens are taken mod state_len like torch.remainder: negative ones and ones near
    the int32 limit (given as int64, as vLLM's are) included."""
    rng = np.random.default_rng(19)
    W, S = 4, 6
    x, x64 = make(rng, (2, D, 3), "float32", family)
    w, w64, _, _ = make_weights(rng, W, "float32", family)
    state, state64 = make(rng, (2, D, S), "float32", family)
    c = np.array(seqlens, dtype=np.int64)
    cs = torch.from_numpy(c) if family == "torch" else c
    out = flywheel.causal_conv1d_update(x, state, w, cache_seqlens=cs)
    ro, rs = ref_update(x64, state64, w64, cache_seqlens=c)
    assert_close(out, ro, "float32")
    assert_exact(state, rs)


def test_empty_batch():
    w = np.ones((D, 4), np.float32)
    out, fs = flywheel.causal_conv1d_fn(np.zeros((0, D, 8), np.float32), w,
                                        return_final_states=True)
    assert out.shape == (0, D, 8) and fs.shape == (0, D, 3)


# ------------------------------------------------------------------------------------ fla

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", WIDTHS)
@pytest.mark.parametrize("Ls", LENGTHS)
@pytest.mark.parametrize("extras", [False, True])  # bias, residual, initial_state, silu
def test_fla_causal_conv1d_matches_reference(family, dtype, W, Ls, extras):
    L = length(Ls, W)
    rng = np.random.default_rng(300 + 7 * W + L)
    B = 2
    x, x64 = make(rng, (B, L, D), dtype, family)
    w, w64, b, b64 = make_weights(rng, W, dtype, family)
    kw, rkw = {}, {}
    if extras:
        res, res64 = make(rng, (B, L, D), dtype, family)
        init, init64 = make(rng, (B, D, W), dtype, family)
        kw = dict(bias=b, residual=res, initial_state=init, activation="silu")
        rkw = dict(b=b64, residual=res64, init=init64, activation="silu")
    y, fs = flywheel.fla.causal_conv1d(x, w, output_final_state=True, backend="triton", **kw)
    ry, rf = ref_fla(x64, w64, **rkw)
    assert dtype_name(y) == dtype and dtype_name(fs) == dtype
    assert_close(y, ry, dtype)
    assert_exact(fs, rf)
    y2, none = flywheel.fla.causal_conv1d(x, w, **kw)
    assert none is None
    assert_exact(y2, as64(y))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", [1, 4, 17])
@pytest.mark.parametrize("with_init", [False, True])
def test_fla_cu_seqlens(family, dtype, W, with_init):
    """Packed sequences, one of them empty (its final state is its initial state, or 0)."""
    rng = np.random.default_rng(400 + W + with_init)
    cu = np.array([0, 5, 5, 45, 46, 70], dtype=np.int32)
    N, Tn = len(cu) - 1, int(cu[-1])
    x, x64 = make(rng, (1, Tn, D), dtype, family)
    w, w64, b, b64 = make_weights(rng, W, dtype, family)
    res, res64 = make(rng, (1, Tn, D), dtype, family)
    init, init64 = make(rng, (N, D, W), dtype, family) if with_init else (None, None)
    y, fs = flywheel.fla.causal_conv1d(x, w, b, res, init, True, "silu",
                                       cu_seqlens=ints(cu, family))
    ry, rf = ref_fla(x64, w64, b64, res64, init64, "silu", cu)
    assert tuple(fs.shape) == (N, D, W)
    assert_close(y, ry, dtype)
    assert_exact(fs, rf)
    assert_exact(fs[1], init64[1] if with_init else np.zeros((D, W)))


@pytest.mark.parametrize("family", FAMILIES)
def test_fla_4d_input(family):
    """x [B, T, H, K] is read as [B, T, H K]; y has x's shape."""
    rng = np.random.default_rng(13)
    W, H, K = 4, 4, 8
    x, x64 = make(rng, (2, 9, H, K), "float32", family)
    w, w64, _, _ = make_weights(rng, W, "float32", family, H * K)
    y, _ = flywheel.fla.causal_conv1d(x, w, activation="silu")
    assert tuple(y.shape) == (2, 9, H, K)
    ry, _ = ref_fla(x64.reshape(2, 9, H * K), w64, activation="silu")
    assert_close(as64(y).reshape(2, 9, H * K), ry, "float32")


@pytest.mark.parametrize("family", FAMILIES)
def test_fla_strided_input(family):
    """x and residual as channel slices of wider projections (read in place)."""
    rng = np.random.default_rng(20)
    W = 4
    big, big64 = make(rng, (2, 15, 3 * D), "bfloat16", family)
    x, x64 = big[:, :, D:2 * D], big64[:, :, D:2 * D]
    res, res64 = big[:, :, :D], big64[:, :, :D]
    w, w64, b, b64 = make_weights(rng, W, "bfloat16", family)
    y, fs = flywheel.fla.causal_conv1d(x, w, b, res, output_final_state=True,
                                       activation="silu")
    ry, rf = ref_fla(x64, w64, b64, res64, activation="silu")
    assert_close(y, ry, "bfloat16")
    assert_exact(fs, rf)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", WIDTHS)
@pytest.mark.parametrize("x3d", [False, True])  # x [N, D] or [N, 1, D]
def test_fla_update_step_by_step(family, dtype, W, x3d):
    """One token at a time: each step against the formula, the cache updated in place and
    returned, and the whole run equal to fla.causal_conv1d over the sequence."""
    rng = np.random.default_rng(500 + W + x3d)
    N, L = 3, 6
    x, x64 = make(rng, (N, L, D), dtype, family)
    res, res64 = make(rng, (N, L, D), dtype, family)
    w, w64, b, b64 = make_weights(rng, W, dtype, family)
    cache, cache64 = make(rng, (N, D, W), dtype, family)
    y_full, f_full = flywheel.fla.causal_conv1d(x, w, b, res, like(cache64, cache), True,
                                                "silu")
    ref_cache = cache64
    ys = []
    for t in range(L):
        xt, rt = x[:, t], res[:, t]
        if x3d:
            xt, rt = xt[:, None], rt[:, None]
        y, c = flywheel.fla.causal_conv1d_update(xt, cache, rt, w, b, "silu")
        assert c is cache and tuple(y.shape) == tuple(xt.shape)
        ry, ref_cache = ref_fla_update(x64[:, t], ref_cache, w64, b64, res64[:, t], "silu")
        assert_close(as64(y).reshape(N, D), ry, dtype)
        assert_exact(cache, ref_cache)
        ys.append(as64(y).reshape(N, 1, D))
    assert_close(np.concatenate(ys, axis=1), as64(y_full), dtype)
    assert_exact(cache, as64(f_full))


# ---------------------------------------------------------------------------------- errors

def small(family="numpy", dtype="float32", W=4):
    rng = np.random.default_rng(14)
    x, _ = make(rng, (2, D, 5), dtype, family)
    w, _, b, _ = make_weights(rng, W, dtype, family)
    state, _ = make(rng, (2, D, W - 1), dtype, family)
    return x, w, b, state


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_x_is_a_type_error(family):
    x, w, _, state = small(family)
    x64 = x.double() if family == "torch" else x.astype(np.float64)
    with pytest.raises(TypeError, match="x"):
        flywheel.causal_conv1d_fn(x64, w)
    with pytest.raises(TypeError, match="x"):
        flywheel.causal_conv1d_update(x64[:, :, 0], state, w)
    with pytest.raises(TypeError, match="x"):
        flywheel.fla.causal_conv1d(swap12(x64), w)
    with pytest.raises(TypeError, match="x"):
        flywheel.fla.causal_conv1d_update(x64[:, :, 0], state, weight=w)


@pytest.mark.parametrize("shape", [(D + 1, 4), (D, 2, 4), (D,), (1, D, 4)])
def test_bad_weight_shape_is_a_value_error(shape):
    x, _, _, state = small()
    w = np.ones(shape, np.float32)
    with pytest.raises(ValueError, match="weight"):
        flywheel.causal_conv1d_fn(x, w)
    with pytest.raises(ValueError, match="weight"):
        flywheel.causal_conv1d_update(x[:, :, 0], state, w)


def test_bad_bias_shape_is_a_value_error():
    x, w, _, _ = small()
    with pytest.raises(ValueError, match="bias"):
        flywheel.causal_conv1d_fn(x, w, np.ones(D + 1, np.float32))


def test_width_over_the_limit_is_refused():
    x, _, _, _ = small()
    with pytest.raises(FlywheelError):
        flywheel.causal_conv1d_fn(x, np.ones((D, 65), np.float32))


def test_relu_is_not_implemented():
    x, w, _, state = small()
    before = state.copy()
    with pytest.raises(NotImplementedError, match="relu"):
        flywheel.causal_conv1d_fn(x, w, activation="relu")
    with pytest.raises(NotImplementedError, match="relu"):
        flywheel.causal_conv1d_update(x, state, w, activation="relu")
    with pytest.raises(NotImplementedError, match="relu"):
        flywheel.fla.causal_conv1d(swap12(x), w, activation="relu")
    with pytest.raises(NotImplementedError, match="relu"):
        flywheel.fla.causal_conv1d_update(x[:, :, 0], np.zeros((2, D, 4), np.float32),
                                          weight=w, activation="relu")
    assert np.array_equal(state, before)


def test_read_only_conv_state_is_refused_and_unchanged():
    x, w, _, state = small()
    ro = read_only(state)
    with pytest.raises(ValueError, match="conv_state is a read-only numpy array"):
        flywheel.causal_conv1d_update(x[:, :, 0], ro, w)
    assert np.array_equal(ro, state)
    cache = read_only(np.ones((2, D, 4), np.float32))
    with pytest.raises(ValueError, match="cache is a read-only numpy array"):
        flywheel.fla.causal_conv1d_update(x[:, :, 0], cache, weight=w)
    assert np.all(cache == 1)
    out = read_only(np.zeros_like(x))
    with pytest.raises(ValueError, match="out is a read-only numpy array"):
        flywheel.causal_conv1d_fn(x, w, out=out)
    assert np.all(out == 0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("circular", [False, True])
def test_short_conv_state_is_refused_and_nothing_written(family, circular):
    x, w, _, _ = small(family, W=4)
    state, _ = make(np.random.default_rng(15), (2, D, 2), "float32", family)  # S < W - 1
    before = as64(state).copy()
    out = empty((2, D, 5), "float32", family)
    with pytest.raises(FlywheelError):
        flywheel.causal_conv1d_update(x, state, w, cache_seqlens=ints([3, 1], family)
                                      if circular else None, out=out)
    assert_exact(state, before)
    assert np.all(as64(out) == 7.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_short_initial_states_are_refused(family):
    x, w, _, _ = small(family, W=4)
    init, _ = make(np.random.default_rng(16), (2, D, 2), "float32", family)
    with pytest.raises(FlywheelError):
        flywheel.causal_conv1d_fn(x, w, initial_states=init)


@pytest.mark.parametrize("family", FAMILIES)
def test_duplicate_conv_state_indices_are_refused(family):
    x, w, _, _ = small(family)
    x = x[:, :, :1]
    state, _ = make(np.random.default_rng(17), (4, D, 3), "float32", family)
    before = as64(state).copy()
    out = empty((2, D, 1), "float32", family)
    with pytest.raises(FlywheelError):
        flywheel.causal_conv1d_update(x, state, w, conv_state_indices=ints([2, 2], family),
                                      out=out)
    assert_exact(state, before)
    assert np.all(as64(out) == 7.0)
    # two rows without a slot are no conflict
    o = flywheel.causal_conv1d_update(x, state, w, conv_state_indices=ints([-1, -1], family))
    assert_exact(state, before)
    assert_close(o, ref_fn(as64(x), as64(w))[0], "float32")


def test_slot_index_past_the_cache_is_refused():
    x, w, _, _ = small()
    state = np.ones((3, D, 3), np.float32)
    with pytest.raises(FlywheelError, match="FW_ERR_INDEX"):
        flywheel.causal_conv1d_update(x[:, :, 0], state, w,
                                      conv_state_indices=np.array([0, 3], np.int32))
    assert np.all(state == 1)
    with pytest.raises(ValueError, match="conv_state has 1 rows"):  # no indices, too few slots
        flywheel.causal_conv1d_update(x[:, :, 0], state[:1], w)


def test_out_overlapping_x_is_refused():
    x, w, _, _ = small()
    before = x.copy()
    with pytest.raises(FlywheelError, match="overlaps"):
        flywheel.causal_conv1d_fn(x, w, out=x)
    assert np.array_equal(x, before)


def test_requires_grad_is_not_implemented():
    if torch is None:
        pytest.skip("torch is not installed")
    x, w, _, _ = small("torch")
    with pytest.raises(NotImplementedError, match="grad"):
        flywheel.causal_conv1d_fn(x.requires_grad_(), w)
    with torch.no_grad():
        assert flywheel.causal_conv1d_fn(x, w).shape == x.shape


def test_bad_seq_idx_and_combinations_are_value_errors():
    x, w, _, state = small()
    with pytest.raises(ValueError, match="decrease"):
        flywheel.causal_conv1d_fn(x, w, seq_idx=np.array([[0, 1, 1, 0, 2]] * 2, np.int32))
    with pytest.raises(ValueError, match="seq_idx"):
        flywheel.causal_conv1d_fn(x, w, seq_idx=np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="seq_idx"):
        flywheel.causal_conv1d_fn(x, w, seq_idx=np.zeros((2, 5), np.int32),
                                  initial_states=state)
    with pytest.raises(TypeError, match="seq_idx"):
        flywheel.causal_conv1d_fn(x, w, seq_idx=np.zeros((2, 5), np.float32))


def test_fla_bad_arguments():
    rng = np.random.default_rng(18)
    x, _ = make(rng, (2, 6, D), "float32", "numpy")
    w, _, _, _ = make_weights(rng, 4, "float32", "numpy")
    with pytest.raises(ValueError, match="initial_state"):
        flywheel.fla.causal_conv1d(x, w, initial_state=np.zeros((3, D, 4), np.float32))
    with pytest.raises(FlywheelError):  # cu_seqlens with B = 2
        flywheel.fla.causal_conv1d(x, w, cu_seqlens=np.array([0, 3, 6], np.int32))
    with pytest.raises(NotImplementedError, match="seq_idx"):
        flywheel.fla.causal_conv1d(x, w, seq_idx=np.zeros((2, 6), np.int32))
    with pytest.raises(ValueError, match="cache"):
        flywheel.fla.causal_conv1d_update(x[:, 0], np.zeros((2, D + 1, 4), np.float32),
                                          weight=w)
