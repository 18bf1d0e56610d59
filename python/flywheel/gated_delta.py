"""Gated DeltaNet with flash-linear-attention's names, arguments and layouts (forward only);
the engine calls (decode, verify, commit, pool prefill) also take KDA's g [.., HV, K]
(flywheel.fla.chunk_kda and fused_recurrent_kda have fla's KDA names).

Per value head, with state h [K, V] float32 (fla's layout):
    h_t = exp(g_t) h_{t-1} + k_t beta_t (v_t - exp(g_t) h_{t-1}^T k_t)^T,   o_t = h_t^T (scale q_t)
Shapes (GVA: HV a multiple of H; value head j uses q/k head j // (HV // H)):
    q, k [B, T, H, K]   v [B, T, HV, V]   g, beta [B, T, HV]   states [N, HV, K, V] float32
With cu_seqlens (N + 1 offsets), B must be 1 and the N sequences are packed along T.
q, k, v may be float32, bfloat16 or float16 (numpy or torch CPU) and are read in place when
[B, T] merges into one stride (any contiguous input); g and beta are used as float32 (a copy
when they come in another dtype or layout); states as contiguous float32 (a copy otherwise,
except where a state is updated in place, which then must already be one).

Errors: TypeError for a dtype the library does not take (q, k, v or out in float64 or an
integer dtype; g, beta, initial_state in a dtype that is not floating; a state updated in
place that is not float32); ValueError for bad shapes and values (FlywheelError with the
library's status when the library finds them, head dim 0 included), and for a read-only numpy
array the call would write (out; the state of gated_delta_rule_decode and
gated_delta_rule_commit); NotImplementedError for options the library does not have.
"""

import numpy as np

from . import _lib
from . import _tensors as T

# the compiled fast path's dispatch of calls below, from their description (_calls.py): call it
# with the function's locals() where the call is offered; NotImplemented: the Python path runs it
_fast_decode = _lib.fast_call("gated_delta_rule_decode")


def _params(q, scale, l2norm, flags=0, isa=None, precision=None, l2norm_eps=None):
    p = _lib.GdnParams()
    if scale is None:
        # 0 is the library's 1/sqrt(K): with K = 0 the library reports the shape (FW_ERR_SHAPE)
        K = q.shape[-1]
        p.scale = 1.0 / float(K) ** 0.5 if K > 0 else 0.0
    else:
        p.scale = _lib.float32_param(scale, "scale", "1/sqrt(K)")
        if p.scale == 0.0:
            raise NotImplementedError("scale=0 is not supported")
    p.l2norm_qk = 1 if l2norm else 0
    p.threads = _lib.settings.threads
    p.isa = _lib.isa_name(isa)
    p.flags = flags
    p.precision = _lib.precision(precision)
    if l2norm_eps is not None:
        p.l2norm_eps = _lib.float32_param(l2norm_eps, "l2norm_eps", "1e-6")
    return p


def _unsupported(kwargs, **named):
    for name, value in named.items():
        if value:
            raise NotImplementedError(f"{name} is not supported")
    for name in kwargs:
        raise NotImplementedError(f"argument {name!r} is not supported")


def _gates(g, beta, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
           allow_neg_eigval):
    """g and beta as float32 numpy arrays, with fla's optional in-kernel activations applied
    here (g = -exp(A_log) * softplus(g + dt_bias); beta = sigmoid(beta), doubled with
    allow_neg_eigval)."""
    g = T.to_numpy_f32(g, "g")
    beta = T.to_numpy_f32(beta, "beta")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log")
        x = g + (0.0 if dt_bias is None else T.to_numpy_f32(dt_bias, "dt_bias"))
        softplus = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
        g = np.ascontiguousarray(-np.exp(T.to_numpy_f32(A_log, "A_log")) * softplus,
                                 dtype=np.float32)
    if use_beta_sigmoid_in_kernel:
        beta = (1.0 / (1.0 + np.exp(-beta))).astype(np.float32)
        if allow_neg_eigval:
            beta = beta * np.float32(2.0)
    return g, beta


def _flatten(q, k, v, g, beta, cu_seqlens):
    """[B, T, ...] operands as packed [B*T, ...] views plus int32 cu_seqlens. g is [B, T, HV]
    (GDN) or [B, T, HV, K] (KDA: a decay per key channel)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, H, K] / [B, T, HV, V], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Tn = q.shape[0], q.shape[1]
    kda = tuple(v.shape[:3]) + (q.shape[3],)
    if (g.shape not in (tuple(v.shape[:3]), kda)) or beta.shape != tuple(v.shape[:3]):
        raise ValueError(f"g must be [B, T, HV] = {tuple(v.shape[:3])} (or, for KDA, [B, T, HV, K]"
                         f" = {kda}) and beta [B, T, HV], got {g.shape} and {beta.shape}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1, got {B}")
        cu = T.index_array(cu_seqlens, "cu_seqlens")
        if cu.ndim != 1 or cu.size < 1:
            raise ValueError(f"cu_seqlens must be 1-D with N + 1 entries, got shape {cu.shape}")
    else:
        cu = T.int32_offsets(B, Tn, "q [B, T, H, K]")
    return (T.merge_leading(q), T.merge_leading(k), T.merge_leading(v),
            g.reshape((B * Tn,) + g.shape[2:]), beta.reshape(B * Tn, beta.shape[2]), cu)


def _run_prefill(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                 cu_seqlens, flags, isa, gate_args, out, precision=None, l2norm_eps=None):
    q, k, v = (T.float_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    g, beta = _gates(g, beta, *gate_args)
    return _prefill_call(q, k, v, g, beta, scale, initial_state, output_final_state,
                         use_qk_l2norm, cu_seqlens, flags, isa, out, precision, l2norm_eps)


def _prefill_call(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                  cu_seqlens, flags, isa, out, precision, l2norm_eps, kernel_gates=None):
    """fw_gdn_prefill on float arrays q, k, v and float32 g, beta ([B, T, ...], or packed with
    cu_seqlens); kernel_gates(p, HV, K) sets the gates computed in the kernels and returns
    what p points into."""
    q2, k2, v2, g2, b2, cu = _flatten(q, k, v, g, beta, cu_seqlens)
    B, Tn, HV, V = v.shape
    n = cu.size - 1
    K = q.shape[-1]
    h0 = None
    if initial_state is not None:
        h0 = T.to_numpy_f32(initial_state, "initial_state")
        if h0.shape != (n, HV, K, V):
            raise ValueError(f"initial_state must be [N, HV, K, V] = {(n, HV, K, V)}, got "
                             f"{h0.shape}")
    o = T.output(out, v, (B, Tn, HV, V))
    ht = T.empty_like_family(q, (n, HV, K, V), "float32") if output_final_state else None
    p = _params(q, scale, use_qk_l2norm, flags, isa, precision, l2norm_eps)
    keep = kernel_gates(p, HV, K) if kernel_gates is not None else None
    o2 = T.merged_view(o, "out")
    _lib.check(_lib.lib.fw_gdn_prefill(T.describe(q2), T.describe(k2), T.describe(v2),
                                       T.describe(g2), T.describe(b2), T.ptr(cu), n,
                                       T.ptr(h0), T.ptr(ht), T.describe(o2), p))
    del keep  # the gate arrays p pointed into
    return o, ht


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                           chunk_indices=None, cp_context=None, *, use_gate_in_kernel=False,
                           A_log=None, dt_bias=None, out=None, isa=None, inverse="blocked",
                           precision=None, l2norm_eps=None, **kwargs):
    """Chunked (WY/UT form, 64-token chunks) prefill, fla's `chunk_gated_delta_rule`.

    q, k [B, T, H, K]; v [B, T, HV, V]; g (log decay, <= 0) and beta [B, T, HV];
    initial_state [N, HV, K, V]; cu_seqlens [N + 1] with B = 1 for packed sequences
    (cu_seqlens_cpu and chunk_indices are accepted and not needed).
    Returns (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or None).
    use_gate_in_kernel / A_log / dt_bias and use_beta_sigmoid_in_kernel / allow_neg_eigval
    are applied to the small gate arrays before the call. out: an existing [B, T, HV, V]
    output to write instead of a new one (saves the allocation and page faults of large
    outputs). inverse="fwd_subst" selects the
    forward-substitution triangular inverse. precision of the chunk's products: None or
    "auto" (bf16 for bfloat16 q where flywheel.auto_precision says so, as fla's chunk kernels), "f32" or "bf16" (which operands are
    rounded: docs/linear-attention.md, "Product precision"). l2norm_eps: the epsilon inside
    the in-kernel l2 norm's square root (None: 1e-6, fla's; vLLM's CPU kernels use 1e-5).
    Not supported (NotImplementedError): state_v_first, cp_context, other fla keyword arguments.
    """
    _unsupported(kwargs, state_v_first=state_v_first, cp_context=cp_context)
    if inverse not in ("blocked", "fwd_subst"):
        raise ValueError("inverse must be 'blocked' or 'fwd_subst'")
    flags = _lib.GDN_FWD_SUBST if inverse == "fwd_subst" else 0
    return _run_prefill(q, k, v, g, beta, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens, flags, isa,
                        (use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                         allow_neg_eigval), out, precision, l2norm_eps)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                     A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                                     allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, out=None, isa=None, l2norm_eps=None,
                                     **kwargs):
    """Token-by-token recurrence (one fused pass over the state per token),
    fla's `fused_recurrent_gated_delta_rule`; arguments and results as
    chunk_gated_delta_rule. For decode into a slot array in place, see
    gated_delta_rule_decode. Pass beta by keyword: as in fla, the 5th positional argument is
    gk, and gk without beta raises ValueError saying so. gk [B, T, HV, K]: per-key-channel log
    decays (KDA), added to g's when both are given. Not supported (NotImplementedError):
    per-value-channel gates gv, state_v_first, gk with use_gate_in_kernel.
    """
    if gk is not None and beta is None:
        raise ValueError(
            "gk was given and beta was not: beta must be passed by keyword (beta=...), because "
            "the 5th positional argument of fla's fused_recurrent_gated_delta_rule(q, k, v, g, "
            "gk, gv, beta, ...) is gk")
    if gv is not None:
        raise NotImplementedError("per-value-channel gates gv are not supported: a gate g per "
                                  "token and head, or gk per key channel (KDA)")
    _unsupported(kwargs, state_v_first=state_v_first)
    if gk is not None:
        if use_gate_in_kernel:
            raise NotImplementedError("gk with use_gate_in_kernel: for KDA's gates see "
                                      "flywheel.fla.fused_recurrent_kda")
        gk = T.to_numpy_f32(gk, "gk")
        if gk.ndim != 4:
            raise ValueError(f"gk must be [B, T, HV, K] (a log decay per key channel), got shape "
                             f"{gk.shape}")
        if g is not None:
            g = T.to_numpy_f32(g, "g")
            if gk.ndim != 4 or g.shape != gk.shape[:3]:
                raise ValueError(f"g [B, T, HV] and gk [B, T, HV, K] do not match: {g.shape}, "
                                 f"{gk.shape}")
            gk = gk + g[..., None]
        g = gk
    if g is None or beta is None:
        raise NotImplementedError("g (or gk) and beta are required")
    return _run_prefill(q, k, v, g, beta, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens, _lib.GDN_FUSED_RECURRENT, isa,
                        (use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                         allow_neg_eigval), out, None, l2norm_eps)


def _state_slots(state, HV, K, V, written, bf16=False):
    """The slot count of a state array the library reads (and, if `written`, updates) in
    place: TypeError for another type or dtype than float32 (or, with bf16, bfloat16),
    ValueError for the shape, the layout or (written) a read-only numpy array."""
    kind = "float32 or bfloat16" if bf16 else "float32"
    want = f"a contiguous {kind} [slots, HV, K, V] = [slots, {HV}, {K}, {V}] array"
    ok = (_lib.F32, _lib.BF16) if bf16 else (_lib.F32,)
    if T.is_torch(state):
        if state.device.type != "cpu":
            raise NotImplementedError(f"state is on {state.device}: CPU tensors only")
        f32, contiguous = T._torch_code(state) in ok, state.is_contiguous()
    elif isinstance(state, np.ndarray):
        f32, contiguous = T._NP_CODES.get(state.dtype) in ok, state.flags.c_contiguous
    else:
        raise TypeError(f"state must be {want} (numpy or torch), got {type(state).__name__}")
    if not f32:
        raise TypeError(f"state: dtype {state.dtype} is not supported: state must be {want} "
                        "(it is used in place, never converted)")
    if not contiguous or state.ndim != 4 or tuple(state.shape[1:]) != (HV, K, V):
        raise ValueError(f"state must be {want} (it is used in place), got "
                         f"{'a non-contiguous ' if not contiguous else ''}"
                         f"shape {tuple(state.shape)}")
    if written:
        T.check_writable(state, "state")
    return state.shape[0]


def _kernel_gates(p, HV, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                  K=None, lower_bound=None):
    """Set p to compute the gates inside the kernels from the raw a (passed as g) and b (as
    beta); returns the arrays p points into (keep them alive for the call). K: KDA's key dim
    (dt_bias may then be [HV * K] or [HV, K]); lower_bound: the sigmoid gate (A_log None:
    exp(A_log) = 1)."""
    keep = []
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log")
        if A_log is None:
            A_log = np.zeros(HV, np.float32)
        for x, name, field in ((A_log, "A_log", "a_log"), (dt_bias, "dt_bias", "dt_bias")):
            if x is None:
                continue
            a = T.to_numpy_f32(x, name)
            if name == "dt_bias" and K is not None and a.size == HV * K and a.ndim <= 2:
                a = a.reshape(HV * K)
            elif a.shape != (HV,):
                want = f"[HV] = [{HV}]" + (f" or [HV * K] = [{HV * K}]" if name == "dt_bias" and K
                                           else "")
                raise ValueError(f"{name} must be {want}, got shape {a.shape}")
            t = T.describe(a)
            keep += [a, t]
            setattr(p, field, _lib.ctypes.pointer(t))
        if lower_bound is not None:
            p.lower_bound = _lib.float32_param(lower_bound, "lower_bound", "none")
            if not p.lower_bound < 0:
                raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    elif dt_bias is not None:
        raise ValueError("dt_bias is used with use_gate_in_kernel=True and A_log")
    p.beta_sigmoid = 1 if use_beta_sigmoid_in_kernel else 0
    return keep


def _pool_slots(state, HV, K, V):
    """A state pool the library reads and updates in place: float32 or bfloat16 [slots, HV,
    K, V] whose slots may lie further apart than HV K V elements (an engine's padded slots),
    each slot contiguous. A bf16 state is read into float32 and each state written is rounded
    to bf16 once a call. Returns (slots, slot stride in elements, the library's dtype code)."""
    want = (f"a float32 or bfloat16 [slots, HV, K, V] = [slots, {HV}, {K}, {V}] array, each "
            "slot contiguous")
    if T.is_torch(state):
        if state.device.type != "cpu":
            raise NotImplementedError(f"state is on {state.device}: CPU tensors only")
        code, st = T._torch_code(state), tuple(state.stride())
    elif isinstance(state, np.ndarray):
        code = T._NP_CODES.get(state.dtype)
        st = tuple(s // state.itemsize for s in state.strides)
    else:
        raise TypeError(f"state must be {want} (numpy or torch), got {type(state).__name__}")
    if code not in (_lib.F32, _lib.BF16):
        raise TypeError(f"state: dtype {state.dtype} is not supported: state must be {want}")
    if state.ndim != 4 or tuple(state.shape[1:]) != (HV, K, V):
        raise ValueError(f"state must be {want}, got shape {tuple(state.shape)}")
    # (a one-element dimension's stride reaches no other element: numpy's contiguity rule)
    inner = all(n == 1 or s == w for n, s, w in zip(state.shape[1:], st[1:], (K * V, V, 1)))
    if not inner or (state.shape[0] > 1 and st[0] < HV * K * V):
        raise ValueError(f"state must be {want} (it is updated in place), got strides {st}")
    T.check_writable(state, "state")
    return state.shape[0], st[0] if state.shape[0] > 1 else HV * K * V, code


def _pool(state, slots, stride, dtype, read, write):
    p = _lib.GdnPool()
    p.data = T.ptr(state)
    p.slots, p.slot_stride, p.dtype = slots, stride, dtype
    p.read, p.write = T.ptr(read), T.ptr(write)
    return p


def _is_bf16(state):
    if T.is_torch(state):
        return T._torch_code(state) == _lib.BF16
    return isinstance(state, np.ndarray) and T._NP_CODES.get(state.dtype) == _lib.BF16


def _indices(state_indices, n):
    if state_indices is None:
        return np.arange(n, dtype=np.int32)
    idx = T.index_array(state_indices, "state_indices")
    if idx.shape != (n,):
        raise ValueError(f"state_indices must have {n} entries, got {idx.shape}")
    return idx


def gated_delta_rule_decode(q, k, v, g, beta, state, state_indices=None, scale=None,
                            use_qk_l2norm_in_kernel=False, *, out=None, isa=None,
                            l2norm_eps=None, read_state_indices=None, use_gate_in_kernel=False,
                            A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                            lower_bound=None):
    """One decode step for N sequences, updating their states in a slot array in place.

    q, k [N, H, K] (or [N, 1, H, K]); v [N, HV, V] (or [N, 1, HV, V]); g, beta [N, HV]
    (or [N, 1, HV]); state [slots, HV, K, V] contiguous float32 or bfloat16 (numpy or torch;
    bf16: read into float32, each new state rounded to bf16 once), sequence i using slot
    state_indices[i] (default i; distinct). Returns o with v's shape and dtype;
    l2norm_eps: as in chunk_gated_delta_rule. use_gate_in_kernel with A_log [HV] (and
    dt_bias [HV]): g is the raw a and the kernel computes g = -exp(A_log) softplus(a +
    dt_bias); use_beta_sigmoid_in_kernel: beta is the raw b, the kernel takes sigmoid(b)
    (Qwen3-Next's gates, computed inside the decode step). read_state_indices [N]: the slot each sequence
    starts from when it is not its state_indices slot (prefix caching; negative: a zero
    state); a negative state_indices entry then means the new state is not kept. With it,
    state may also be a pool whose slots lie further apart (padded), each slot contiguous.
    out: an existing array of that shape (any float dtype the library writes) to write and
    return instead of a new one. KDA: g [N, HV, K] (or [N, 1, HV, K]), a decay per key
    channel; with use_gate_in_kernel, dt_bias may be [HV * K] and lower_bound selects the
    sigmoid gate lower_bound * sigmoid(exp(A_log) (a + dt_bias)).
    """
    r = _fast_decode(locals())
    if r is not NotImplemented:
        return r
    q, k, v = (T.float_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    squeeze = v.ndim == 4
    if squeeze:
        if q.ndim != 4 or k.ndim != 4:
            raise ValueError(f"with v [N, 1, HV, V], q and k must be [N, 1, H, K], got shapes "
                             f"{tuple(q.shape)} and {tuple(k.shape)}")
        if q.shape[1] != 1 or k.shape[1] != 1 or v.shape[1] != 1:
            raise ValueError("4-D decode inputs must be [N, 1, ...]: one token per sequence")
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    if v.ndim != 3 or q.ndim != 3 or k.ndim != 3:
        raise ValueError(f"q, k, v must be [N, H, K], [N, H, K], [N, HV, V], got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    N, HV, V = v.shape
    K = q.shape[-1]
    g = T.to_numpy_f32(g, "g")
    beta = T.to_numpy_f32(beta, "beta")
    # the shape, not only the size: [HV, N] has N * HV entries in another order
    if beta.shape not in ((N, HV), (N, 1, HV)):
        raise ValueError(f"beta must be [N, HV] = {(N, HV)} (or [N, 1, HV]), got shape {beta.shape}")
    kda = g.shape in ((N, HV, K), (N, 1, HV, K))
    if g.shape not in ((N, HV), (N, 1, HV)) and not kda:
        raise ValueError(f"g must be [N, HV] = {(N, HV)} (or [N, 1, HV]; KDA: [N, HV, K]), got "
                         f"shape {g.shape}")
    g, beta = g.reshape((N, HV, K) if kda else (N, HV)), beta.reshape(N, HV)
    pool = None
    if read_state_indices is not None:
        slots, stride, sdt = _pool_slots(state, HV, q.shape[-1], V)
        idx = _indices(state_indices, N)
        ridx = T.index_array(read_state_indices, "read_state_indices")
        if ridx.shape != (N,):
            raise ValueError(f"read_state_indices must have {N} entries, got {ridx.shape}")
        pool = _pool(state, slots, stride, sdt, ridx, idx)
    else:
        slots = _state_slots(state, HV, q.shape[-1], V, written=True, bf16=True)
        idx = _indices(state_indices, N)
        if _is_bf16(state):  # the library takes bf16 states as a pool, in place on its slots
            if idx.size and idx.min() < 0:  # a slot array's indices are slots (a pool's may not be)
                i = int(np.argmax(idx < 0))
                raise _lib.FlywheelError("FW_ERR_INDEX", f"state_indices[{i}] = {int(idx[i])} is "
                                                         f"not a slot (0..{slots - 1})")
            pool = _pool(state, slots, HV * q.shape[-1] * V, _lib.BF16, idx, idx)
    if out is None:
        o = T.empty_like_family(v, (N, HV, V))
    else:
        o = T.output(out, v, None)
        if tuple(o.shape) != ((N, 1, HV, V) if squeeze else (N, HV, V)):
            raise ValueError(f"out must have v's shape {(N, 1, HV, V) if squeeze else (N, HV, V)},"
                             f" got {tuple(o.shape)}")
        if squeeze:
            o = o[:, 0]
    p = _params(q, scale, use_qk_l2norm_in_kernel, 0, isa, None, l2norm_eps)
    keep = _kernel_gates(p, HV, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                         K if kda else None, lower_bound)
    if pool is not None:
        _lib.check(_lib.lib.fw_gdn_decode_pool(T.describe(q), T.describe(k), T.describe(v),
                                               T.describe(g), T.describe(beta), pool,
                                               T.describe(o), p))
    else:
        _lib.check(_lib.lib.fw_gdn_decode(T.describe(q), T.describe(k), T.describe(v),
                                          T.describe(g), T.describe(beta), T.ptr(state), slots,
                                          T.ptr(idx), T.describe(o), p))
    del keep  # the gate arrays p pointed into
    if out is not None:
        return out
    return o.reshape(N, 1, HV, V) if squeeze else o


def gated_delta_rule_prefill(q, k, v, g, beta, state, state_indices, cu_seqlens=None,
                             read_state_indices=None, scale=None, use_qk_l2norm_in_kernel=False,
                             *, out=None, isa=None, precision=None, l2norm_eps=None):
    """Chunked prefill with the states in a serving engine's pool, read and written in place.

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (B = 1 with cu_seqlens [N + 1]);
    state [slots, HV, K, V] float32 or bfloat16 (each final state rounded to bf16 once),
    each slot contiguous (slots may lie further apart: padded); sequence i starts from slot
    read_state_indices[i] (default: state_indices[i]; negative: a zero state) and its final
    state goes to slot state_indices[i] (negative: not kept). No two sequences may write one
    slot, nor read one another writes. Returns o [B, T, HV, V] (out: an existing array to
    write instead). precision, l2norm_eps: as in chunk_gated_delta_rule.
    """
    q, k, v = (T.float_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    g, beta = _gates(g, beta, False, None, None, False, False)
    q2, k2, v2, g2, b2, cu = _flatten(q, k, v, g, beta, cu_seqlens)
    n = cu.size - 1
    B, Tn, HV, V = v.shape
    slots, stride, sdt = _pool_slots(state, HV, q.shape[-1], V)
    widx = _indices(state_indices, n)
    ridx = widx
    if read_state_indices is not None:
        ridx = T.index_array(read_state_indices, "read_state_indices")
        if ridx.shape != (n,):
            raise ValueError(f"read_state_indices must have {n} entries, got {ridx.shape}")
    o = T.output(out, v, (B, Tn, HV, V))
    p = _params(q, scale, use_qk_l2norm_in_kernel, 0, isa, precision, l2norm_eps)
    _lib.check(_lib.lib.fw_gdn_prefill_pool(T.describe(q2), T.describe(k2), T.describe(v2),
                                            T.describe(g2), T.describe(b2), T.ptr(cu), n,
                                            _pool(state, slots, stride, sdt, ridx, widx),
                                            T.describe(T.merged_view(o, "out")), p))
    return o


class GDNReplay:
    """What gated_delta_rule_verify keeps for gated_delta_rule_commit: per token and value head
    the written delta and chunk-local log decay (one per key channel for KDA), per token and
    q/k head the normalised key (a float32 buffer of fw_gdn_replay_floats or
    fw_kda_replay_floats entries, its first float tagging which), with the batch layout it was
    made for."""

    def __init__(self, buffer, cu, idx, H, HV, K, V):
        self.buffer, self.cu_seqlens, self.state_indices = buffer, cu, idx
        self.H, self.HV, self.K, self.V = H, HV, K, V


def gated_delta_rule_verify(q, k, v, g, beta, state, state_indices=None, cu_seqlens=None,
                            scale=None, use_qk_l2norm_in_kernel=False, *, out=None, isa=None,
                            precision=None, l2norm_eps=None, use_gate_in_kernel=False,
                            A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                            lower_bound=None):
    """Speculative verify: up to 64 draft tokens per sequence from the committed states, which
    are read and not changed. KDA: g [B, T, HV, K] (gates as in gated_delta_rule_decode).

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (B = 1 with cu_seqlens [N + 1]);
    state [slots, HV, K, V] contiguous float32; state_indices [N] (default 0..N-1).
    Returns (o [B, T, HV, V], replay); pass replay to gated_delta_rule_commit with the number
    of accepted tokens per sequence. precision, l2norm_eps: as in chunk_gated_delta_rule;
    use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel: as in
    gated_delta_rule_decode (the gates computed inside the kernel).
    out: an existing [B, T, HV, V] array to write as o instead of a new one.
    """
    q, k, v = (T.float_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    g, beta = _gates(g, beta, False, None, None, False, False)
    q2, k2, v2, g2, b2, cu = _flatten(q, k, v, g, beta, cu_seqlens)
    n = cu.size - 1
    B, Tn, HV, V = v.shape
    H, K = q.shape[2], q.shape[3]
    slots = _state_slots(state, HV, K, V, written=False)
    idx = _indices(state_indices, n)
    kda = g2.ndim == 3
    floats = (_lib.lib.fw_kda_replay_floats if kda else _lib.lib.fw_gdn_replay_floats)(
        B * Tn, H, HV, K, V)
    replay = np.empty(floats, dtype=np.float32)
    o = T.output(out, v, (B, Tn, HV, V))
    p = _params(q, scale, use_qk_l2norm_in_kernel, 0, isa, precision, l2norm_eps)
    keep = _kernel_gates(p, HV, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                         K if kda else None, lower_bound)
    _lib.check(_lib.lib.fw_gdn_verify(T.describe(q2), T.describe(k2), T.describe(v2),
                                      T.describe(g2), T.describe(b2), T.ptr(cu), n,
                                      T.ptr(state), slots, T.ptr(idx), T.ptr(replay),
                                      floats, T.describe(T.merged_view(o, "out")), p))
    del keep
    return o, GDNReplay(replay, cu, idx, H, HV, K, V)


def _check_replay(r):
    """TypeError unless r is a GDNReplay whose arrays are what verify makes (the library
    reads them by pointer: a float16 buffer would be read past its end)."""
    if not isinstance(r, GDNReplay):
        raise TypeError(f"replay must be the GDNReplay gated_delta_rule_verify returned, got "
                        f"{type(r).__name__}")
    for name, dtype in (("buffer", np.float32), ("cu_seqlens", np.int32),
                        ("state_indices", np.int32)):
        a = getattr(r, name)
        if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == 1 and
                a.flags.c_contiguous):
            raise TypeError(f"replay.{name} must be a contiguous 1-D {np.dtype(dtype)} numpy "
                            "array (the GDNReplay of gated_delta_rule_verify)")
    if r.cu_seqlens.size < 1 or r.state_indices.size != r.cu_seqlens.size - 1:
        raise ValueError(f"replay: {r.cu_seqlens.size} cu_seqlens entries for "
                         f"{r.state_indices.size} state indices")
    for name in ("H", "HV", "K", "V"):
        if not isinstance(getattr(r, name), (int, np.integer)):
            raise TypeError(f"replay.{name} must be an integer")


def gated_delta_rule_commit(replay, accepted, state):
    """Commit accepted[i] (0 .. n_i) tokens of each sequence of a verify call: slot
    replay.state_indices[i] of `state` becomes the state after those tokens, in place."""
    _check_replay(replay)
    r = replay
    acc = T.index_array(accepted, "accepted")
    if acc.shape != (r.cu_seqlens.size - 1,):
        raise ValueError(f"accepted must have {r.cu_seqlens.size - 1} entries, got {acc.shape}")
    if not acc.size:  # no sequences: still a pointer (the library refuses NULL)
        acc = np.zeros(1, np.int32)
    slots = _state_slots(state, r.HV, r.K, r.V, written=True)
    p = _lib.GdnParams()
    p.threads = _lib.settings.threads
    _lib.check(_lib.lib.fw_gdn_commit(T.ptr(r.cu_seqlens), r.cu_seqlens.size - 1, T.ptr(acc),
                                      r.H, r.HV, r.K, r.V, T.ptr(state), slots,
                                      T.ptr(r.state_indices), T.ptr(r.buffer), r.buffer.size,
                                      p))
