"""The original FlyWheel package's serving-layer calls for Gated DeltaNet and KDA (flywheel-tpu
0.3's fused_conv1d_gdn and fused_conv1d_kda, and their ReplaySSM forms fused_conv1d_gdn_replay
and fused_conv1d_kda_replay with next_replay_lens), on the C library's fw_gdn_layer and
fw_gdn_layer_replay: one call per layer per engine step over a ragged batch of decodes and
prefills, the slot caches updated in place (numpy and torch) or returned as new arrays (JAX,
which has no in-place update).
"""

import operator
import sys

import numpy as np

from . import _lib
from . import _tensors as T
from .gated_delta import _pool_slots

# the compiled fast path's dispatch of calls below, from their description (_calls.py): call it
# with the function's locals() where the call is offered; NotImplemented: the Python path runs it
_fast_layer = _lib.fast_call("fused_conv1d_gdn")


def _is_jax(x):
    return type(x).__module__.startswith("jax")


def _traced(*xs):
    """Whether any argument is a traced JAX value (inside jax.jit, grad or vmap)."""
    jax = sys.modules.get("jax")
    tracer = getattr(getattr(jax, "core", None), "Tracer", None)
    return tracer is not None and any(isinstance(x, tracer) for x in xs)


def _cache(x, name):
    """A cache the call updates: numpy/torch in place; a JAX array as a writable numpy copy."""
    if _is_jax(x):
        return np.array(x), True
    return T.check_writable(T.float_array(x, name, inplace=True), name), False


def _check_gate(x, width, what, kda_call=None):
    """A raw gate of 2 dims whose last is `width`, else ValueError saying what it must be."""
    if len(np.shape(x)) != 2 or np.shape(x)[-1:] != width:
        hint = f" (KDA's per-channel gate: {kda_call})" if kda_call else ""
        raise ValueError(f"{what} = [T, {width[0]}], got shape {tuple(np.shape(x))}{hint}")


def fused_conv1d_gdn(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log,
                     dt_bias, query_start_loc, state_indices, distribution, seq_lens,
                     read_state_indices, read_offsets=None, *, n_kq, n_v, d_k, d_v, kernel_size,
                     num_spec_tokens=0, zero_initialize_out=True, compute_precision=None,
                     decode_tile_size=4, mixed_tile_size=128, compute_chunk_size=64,
                     precision=None, l2norm_eps=None, out=None, isa=None):
    """Conv1d + SiLU + gated delta rule for one layer of an engine step.

    qkv [T, 2 n_kq d_k + n_v d_v] pre-conv rows; b, a [T, n_v]; conv_state [slots, K-1, dim]
    (the last K-1 raw rows of each sequence); recurrent_state [slots, n_v, d_k, d_v] float32
    or bfloat16 (slots may lie further apart, each contiguous; bf16: read into float32, each
    state written rounded to bf16 once a call, a speculative window's checkpoints each); conv_weight [dim, 1, K] (or [dim, K]),
    conv_bias [dim] or None; a_log, dt_bias [n_v]; query_start_loc [num_seqs + 1];
    state_indices, seq_lens, read_state_indices [num_seqs]; distribution [decode_end,
    prefill_end, mixed_end]. A sequence whose seq_len equals its query length starts from zero
    states. q = l2norm(q) d_k^-1/2, k = l2norm(k) (eps 1e-6, or l2norm_eps), beta = sigmoid(b),
    g = -exp(a_log) softplus(a + dt_bias). Returns ((conv_state, recurrent_state), out), out
    [T, n_v d_v] in qkv's dtype, rows past the last sequence zeroed with zero_initialize_out.

    Speculative windows (num_spec_tokens > 0): the first decode_end sequences are verify
    windows of 1 .. num_spec_tokens + 1 tokens; window i starts from slot
    read_state_indices[i] + read_offsets[i] and writes the conv and recurrent checkpoint after
    each of its tokens t to slot state_indices[i] + t, as the original does
    (gated_delta_rule_verify / _commit do it by replay instead: docs/linear-attention.md).

    decode_tile_size, mixed_tile_size and compute_chunk_size are the original's TPU tiling
    and are accepted and ignored; compute_precision too (the original's dots round to bf16
    whatever it says): precision= picks the chunked products as in chunk_gated_delta_rule.
    """
    r = _fast_layer(locals())
    if r is not NotImplemented:
        return (conv_state, recurrent_state), r
    _check_gate(a, (n_v,), "a must be [T, n_v]", "fused_conv1d_kda")
    return _layer(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
                  query_start_loc, state_indices, distribution, seq_lens, read_state_indices,
                  read_offsets, n_kq, n_v, d_k, d_v, kernel_size, num_spec_tokens,
                  zero_initialize_out, precision, l2norm_eps, out, isa, None, False)


def _record_dim(n_kq, n_v, d_k, d_v, kda):
    dims = [operator.index(x) for x in (n_kq, n_v, d_k, d_v)]
    dim = -1 if any(not 0 <= x < 2 ** 31 for x in dims) else int(
        _lib.lib.fw_gdn_replay_record_dim(*dims, kda))
    if dim < 0:
        raise ValueError(f"n_kq {n_kq}, n_v {n_v}, d_k {d_k}, d_v {d_v}: counts and dims must be "
                         "non-negative and within the library's head limits")
    return dim


def replay_record_dim(n_kq, n_v, d_k, d_v):
    """Entries of one GDN replay record [u | k | g], the last axis of replay_state:
    n_v d_v + n_kq d_k + n_v rounded up to 128 (flywheel-tpu's lane padding, never written)."""
    return _record_dim(n_kq, n_v, d_k, d_v, 0)


def kda_replay_record_dim(n_kq, n_v, d_k, d_v):
    """Entries of one KDA replay record: n_v d_v + n_kq d_k + n_v d_k (a log decay per key
    channel)."""
    return _record_dim(n_kq, n_v, d_k, d_v, 1)


def fused_conv1d_gdn_replay(qkv, b, a, conv_state, recurrent_state, recurrent_shadow,
                            replay_state, conv_weight, conv_bias, a_log, dt_bias, query_start_loc,
                            state_indices, distribution, seq_lens, read_state_indices,
                            replay_lens, read_offsets=None, *, n_kq, n_v, d_k, d_v, kernel_size,
                            replay_window=16, num_spec_tokens=0, zero_initialize_out=True,
                            compute_precision=None, decode_tile_size=4, mixed_tile_size=128,
                            compute_chunk_size=64, precision=None, l2norm_eps=None, out=None,
                            isa=None):
    """fused_conv1d_gdn whose decodes run ReplaySSM (flywheel-tpu's call of this name).

    A decode sequence s keeps its state as the f32 checkpoint recurrent_state[slot] plus the
    first replay_lens[s] records of replay_state[slot] (slot read_state_indices[s] when read,
    state_indices[s] when written). A step computes its tokens' outputs from them without
    forming the state and appends its tokens' records; it flushes (folds the committed
    records into a new checkpoint, written with its bf16 shadow, and appends from row 0) when
    they would not fit in replay_window, when it has no initial state, or when it reads and
    writes different slots. next_replay_lens gives the committed records of the next step.
    Speculative windows commit by moving replay_lens; only the conv keeps a checkpoint per
    position (read at read_offsets). Prefills and mixed sequences run as in fused_conv1d_gdn
    and write the shadow with their state.

    recurrent_shadow [slots, n_v, d_k, d_v] bfloat16, the checkpoint's bf16 (the caller
    initializes it so), written with every checkpoint; with bf16 products (precision "bf16",
    or the default with bf16 qkv) the decodes read it instead of the f32 checkpoint, as the
    original's do; replay_state [slots, replay_window,
    replay_record_dim(n_kq, n_v, d_k, d_v)] float32 or bfloat16; replay_lens [num_seqs].
    Any replay_window >= num_spec_tokens + 1 is taken (the original asks a multiple of 8).
    Returns ((conv_state, recurrent_state, recurrent_shadow, replay_state), out).
    """
    _check_gate(a, (n_v,), "a must be [T, n_v]", "fused_conv1d_kda_replay")
    return _layer(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
                  query_start_loc, state_indices, distribution, seq_lens, read_state_indices,
                  read_offsets, n_kq, n_v, d_k, d_v, kernel_size, num_spec_tokens,
                  zero_initialize_out, precision, l2norm_eps, out, isa, None, False,
                  (recurrent_shadow, replay_state, replay_lens, replay_window))


def fused_conv1d_kda_replay(qkv, b, g, conv_state, recurrent_state, recurrent_shadow,
                            replay_state, conv_weight, conv_bias, a_log, dt_bias, query_start_loc,
                            state_indices, distribution, seq_lens, read_state_indices,
                            replay_lens, read_offsets=None, *, n_kq, n_v, d_k, d_v, kernel_size,
                            replay_window=16, num_spec_tokens=0, zero_initialize_out=True,
                            compute_precision=None, decode_tile_size=4, mixed_tile_size=128,
                            compute_chunk_size=64, lower_bound=None, beta_is_activated=False,
                            precision=None, l2norm_eps=None, out=None, isa=None):
    """fused_conv1d_kda whose decodes run ReplaySSM: the protocol of fused_conv1d_gdn_replay,
    records of kda_replay_record_dim(n_kq, n_v, d_k, d_v) entries (a log decay per key
    channel). Returns ((conv_state, recurrent_state, recurrent_shadow, replay_state), out)."""
    _check_gate(g, (n_v * d_k,), "g must be [T, n_v d_k] (a raw gate per key channel)")
    return _layer(qkv, b, g, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
                  query_start_loc, state_indices, distribution, seq_lens, read_state_indices,
                  read_offsets, n_kq, n_v, d_k, d_v, kernel_size, num_spec_tokens,
                  zero_initialize_out, precision, l2norm_eps, out, isa, lower_bound,
                  beta_is_activated, (recurrent_shadow, replay_state, replay_lens, replay_window))


def next_replay_lens(replay_lens, query_start_loc, seq_lens, state_indices, read_state_indices,
                     distribution, num_accepted, replay_window):
    """Committed records of each sequence after a replay step that accepted num_accepted[s] of
    its tokens (its query length without speculation): the committed ones plus the accepted,
    or the accepted alone after a flush; 0 for prefills and mixed sequences. int32 numpy (a
    JAX array for traced JAX arguments, under jax.jit)."""
    if _traced(replay_lens, query_start_loc, seq_lens, state_indices, read_state_indices,
               distribution, num_accepted):
        from . import jax as fj
        return fj.next_replay_lens(replay_lens, query_start_loc, seq_lens, state_indices,
                                   read_state_indices, distribution, num_accepted, replay_window)
    lens = np.asarray(replay_lens, dtype=np.int64)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    ql = qsl[1:] - qsl[:-1]
    has_init = (np.asarray(seq_lens, dtype=np.int64) - ql) > 0
    rd = np.asarray(read_state_indices, dtype=np.int64)
    wr = np.asarray(state_indices, dtype=np.int64)
    committed = np.where(has_init, lens, 0)
    flush = (committed + ql > replay_window) | ~has_init | (rd != wr)
    is_decode = np.arange(lens.size) < int(np.asarray(distribution)[0])
    base = np.where(flush, 0, committed)
    return np.where(is_decode, base + np.asarray(num_accepted, dtype=np.int64), 0).astype(np.int32)


def fused_conv1d_kda(qkv, b, g, conv_state, recurrent_state, conv_weight, conv_bias, a_log,
                     dt_bias, query_start_loc, state_indices, distribution, seq_lens,
                     read_state_indices, read_offsets=None, *, n_kq, n_v, d_k, d_v, kernel_size,
                     num_spec_tokens=0, zero_initialize_out=True, compute_precision=None,
                     decode_tile_size=4, mixed_tile_size=128, compute_chunk_size=64,
                     lower_bound=None, beta_is_activated=False, precision=None, l2norm_eps=None,
                     out=None, isa=None):
    """Conv1d + SiLU + KDA (Kimi Delta Attention) for one layer of an engine step: as
    fused_conv1d_gdn, with g [T, n_v d_k] the raw gate of each key channel (head-major like q
    and k) and dt_bias [n_v d_k]: the log decay -exp(a_log) softplus(g + dt_bias), or with
    lower_bound lower_bound * sigmoid(exp(a_log) (g + dt_bias)); the state [d_k, d_v] decays
    row by row. beta_is_activated: b holds beta itself. precision= as in fused_conv1d_gdn (bf16
    products for bfloat16 qkv by default).
    The original's TPU knobs (decode_tile_size, mixed_tile_size, compute_chunk_size,
    compute_precision) are accepted and ignored; speculative windows as in fused_conv1d_gdn.
    """
    _check_gate(g, (n_v * d_k,), "g must be [T, n_v d_k] (a raw gate per key channel)")
    return _layer(qkv, b, g, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
                  query_start_loc, state_indices, distribution, seq_lens, read_state_indices,
                  read_offsets, n_kq, n_v, d_k, d_v, kernel_size, num_spec_tokens,
                  zero_initialize_out, precision, l2norm_eps, out, isa, lower_bound,
                  beta_is_activated)


def _layer(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
           query_start_loc, state_indices, distribution, seq_lens, read_state_indices,
           read_offsets, n_kq, n_v, d_k, d_v, kernel_size, num_spec_tokens, zero_initialize_out,
           precision, l2norm_eps, out, isa, lower_bound, beta_is_activated, replay=None):
    """fw_gdn_layer for both calls (a [T, n_v]: GDN; [T, n_v d_k]: KDA); with replay =
    (shadow, records, replay_lens, replay_window), fw_gdn_layer_replay. Traced JAX values (under
    jax.jit) take flywheel.jax's FFI call."""
    if _traced(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
               query_start_loc, state_indices, distribution, seq_lens, read_state_indices,
               read_offsets, *(replay or ())):
        if out is not None or isa is not None:
            raise NotImplementedError("out= and isa= are not served under jax.jit")
        from . import jax as fj
        return fj.gdn_layer(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias,
                            a_log, dt_bias, query_start_loc, state_indices, distribution,
                            seq_lens, read_state_indices, read_offsets, n_kq=n_kq, n_v=n_v,
                            d_k=d_k, d_v=d_v, kernel_size=kernel_size,
                            num_spec_tokens=num_spec_tokens,
                            zero_initialize_out=zero_initialize_out, precision=precision,
                            l2norm_eps=l2norm_eps, lower_bound=lower_bound,
                            beta_is_activated=beta_is_activated, replay=replay)
    jax_in = _is_jax(qkv)
    qkv = T.float_array(qkv, "qkv")
    b, a = T.float_array(b, "b"), T.float_array(a, "a")
    w = T.float_array(conv_weight, "conv_weight")
    if w.ndim == 3 and w.shape[1] == 1:
        w = w[:, 0]
    if w.ndim != 2 or w.shape[1] != kernel_size:
        raise ValueError(f"conv_weight must be [dim, 1, kernel_size] with kernel_size "
                         f"{kernel_size}, got shape {tuple(T.float_array(conv_weight, 'w').shape)}")
    cb = None if conv_bias is None else T.float_array(conv_bias, "conv_bias")
    al, dtb = T.float_array(a_log, "a_log"), T.float_array(dt_bias, "dt_bias")
    conv, conv_new = _cache(conv_state, "conv_state")
    rec_jax = _is_jax(recurrent_state)
    rec = recurrent_state
    if rec_jax:  # a copy the call updates, bf16 kept as bf16
        rec = np.array(recurrent_state)
        rec = rec if rec.dtype == T._NP_BF16 else rec.astype(np.float32)
    slots, stride, rdt = _pool_slots(rec, n_v, d_k, d_v)
    qsl = T.index_array(query_start_loc, "query_start_loc")
    sidx = T.index_array(state_indices, "state_indices")
    slen = T.index_array(seq_lens, "seq_lens")
    ridx = (None if read_state_indices is None
            else T.index_array(read_state_indices, "read_state_indices"))
    dist = T.index_array(distribution, "distribution")
    n = sidx.size
    if dist.shape != (3,) or qsl.shape != (n + 1,) or slen.shape != (n,) or (
            ridx is not None and ridx.shape != (n,)):
        raise ValueError(f"distribution must have 3 entries, query_start_loc num_seqs + 1 = {n + 1}"
                         f" and seq_lens, read_state_indices num_seqs = {n}; got {dist.shape}, "
                         f"{qsl.shape}, {slen.shape}, {None if ridx is None else ridx.shape}")
    o = T.output(out, qkv, (qkv.shape[0], n_v * d_v))
    batch = _lib.GdnBatch()
    batch.n_seqs = n
    batch.query_start_loc, batch.seq_lens = T.ptr(qsl), T.ptr(slen)
    batch.state_indices, batch.read_state_indices = T.ptr(sidx), T.ptr(ridx)
    batch.decode_end, batch.prefill_end, batch.mixed_end = (int(x) for x in dist)
    batch.num_spec_tokens = int(num_spec_tokens)
    offs = None
    if num_spec_tokens and read_offsets is not None:
        offs = T.index_array(read_offsets, "read_offsets")
        if offs.shape != (n,):
            raise ValueError(f"read_offsets must have num_seqs = {n} entries, got {offs.shape}")
        batch.read_offsets = T.ptr(offs)
    caches = _lib.GdnCaches()
    caches.conv = T.describe(conv)
    caches.recurrent = T.ptr(rec)
    caches.recurrent_stride = stride
    caches.recurrent_dtype = rdt
    p = _lib.GdnLayerParams()
    p.n_kq, p.n_v, p.d_k, p.d_v = n_kq, n_v, d_k, d_v
    p.l2norm_eps = 0.0 if l2norm_eps is None else _lib.float32_param(l2norm_eps, "l2norm_eps",
                                                                      "1e-6")
    p.zero_tail = 1 if zero_initialize_out else 0
    p.threads = _lib.settings.threads
    p.isa = _lib.isa_name(isa)
    p.precision = _lib.precision(precision)
    if lower_bound is not None:
        p.lower_bound = _lib.float32_param(lower_bound, "lower_bound", "none")
        if not p.lower_bound < 0:
            raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    p.beta_activated = 1 if beta_is_activated else 0
    args = (T.describe(qkv), T.describe(b), T.describe(a), T.describe(w),
            None if cb is None else T.describe(cb), T.describe(al), T.describe(dtb), batch, caches)
    if replay is None:
        _lib.check(_lib.lib.fw_gdn_layer(*args, T.describe(o), p))
    else:
        shadow_in, records_in, lens_in, window = replay
        shadow, shadow_new = _cache(shadow_in, "recurrent_shadow")
        records, records_new = _cache(records_in, "replay_state")
        lens = T.index_array(lens_in, "replay_lens")
        if lens.shape != (n,):
            raise ValueError(f"replay_lens must have num_seqs = {n} entries, got {lens.shape}")
        if np.shape(records)[1:2] != (int(window),):
            raise ValueError(f"replay_state must be [slots, replay_window, record_dim] with "
                             f"replay_window {window}, got shape {tuple(np.shape(records))}")
        r = _lib.GdnReplay()
        r.shadow, r.records, r.replay_lens = T.describe(shadow), T.describe(records), T.ptr(lens)
        _lib.check(_lib.lib.fw_gdn_layer_replay(*args, r, T.describe(o), p))
    if conv_new or rec_jax or (replay is not None and (shadow_new or records_new)):
        import jax.numpy as jnp
        conv_out = jnp.asarray(conv) if conv_new else conv_state
        rec_out = jnp.asarray(rec) if rec_jax else recurrent_state
        o = jnp.asarray(o) if jax_in else o
        if replay is None:
            return (conv_out, rec_out), o
        return (conv_out, rec_out, jnp.asarray(shadow) if shadow_new else replay[0],
                jnp.asarray(records) if records_new else replay[1]), o
    if replay is None:
        return (conv_state, recurrent_state), o
    return (conv_state, recurrent_state, replay[0], replay[1]), o
