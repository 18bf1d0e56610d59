"""Kimi Delta Attention (KDA) with flash-linear-attention's names and arguments (fla.ops.kda),
forward only.

KDA is the gated delta rule with one decay per key channel: per value head, with state
h [K, V] float32 and A_t = diag(exp(g_t)),
    h_t = A_t h_{t-1} + k_t beta_t (v_t - h_{t-1}^T A_t k_t)^T,   o_t = h_t^T (scale q_t)
Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; states
[N, HV, K, V] float32; cu_seqlens [N + 1] with B = 1 for packed sequences.
The gates may be computed inside the kernels (use_gate_in_kernel): g is then the raw input,
A_log [HV] and dt_bias [HV * K], and the log decay -exp(A_log) softplus(g + dt_bias), or with
a lower bound (fla's safe gate) lower_bound * sigmoid(exp(A_log) (g + dt_bias)).
The chunked pass runs bf16 products for bfloat16 q by default (flywheel.auto_precision), as chunk_gated_delta_rule
(precision=; docs/linear-attention.md).
Dtypes and errors as in flywheel.gated_delta; decode into slot arrays, verify and commit take
KDA's g through gated_delta_rule_decode / _verify / _commit.
"""

import numpy as np

from . import _lib
from . import _tensors as T
from .gated_delta import _kernel_gates, _prefill_call, _unsupported


def _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval):
    """beta as given to the kernel and whether the kernel takes its sigmoid: 2 sigmoid(b)
    (allow_neg_eigval) is computed here, on the small [B, T, HV] array."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if allow_neg_eigval:
        b = T.to_numpy_f32(beta, "beta")
        return (np.float32(2.0) / (1.0 + np.exp(-b))).astype(np.float32), False
    return beta, use_beta_sigmoid_in_kernel


def _run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens,
         flags, isa, out, l2norm_eps, gate, precision=None):
    """Prefill over [B, T] (or packed) sequences; gate = (use_gate_in_kernel, A_log, dt_bias,
    lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval)."""
    use_gate, A_log, dt_bias, lower_bound, beta_sigmoid, neg = gate
    q, k, v = (T.float_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    beta, beta_sigmoid = _beta(beta, beta_sigmoid, neg)
    g, beta = T.to_numpy_f32(g, "g"), T.to_numpy_f32(beta, "beta")
    if g.ndim != 4:
        raise ValueError(f"g must be [B, T, HV, K] (a decay per key channel), got shape {g.shape}")
    return _prefill_call(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                         cu_seqlens, flags, isa, out, precision, l2norm_eps,
                         lambda p, HV, K: _kernel_gates(p, HV, use_gate, A_log, dt_bias,
                                                        beta_sigmoid, K, lower_bound))


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
              use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, out=None,
              isa=None, inverse="blocked", precision=None, l2norm_eps=None, chunk_size=64,
              **kwargs):
    """Chunked prefill (WY form, 64-token chunks), fla's `chunk_kda`.

    Returns (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or None).
    use_gate_in_kernel: g is the raw gate input, A_log [HV] and dt_bias [HV * K] (keywords,
    as fla reads them); with safe_gate=True the gate is lower_bound * sigmoid(exp(A_log) (g +
    dt_bias)) (A_log None: exp(A_log) = 1), as in fla, where lower_bound only counts with
    safe_gate. use_beta_sigmoid_in_kernel: beta is the raw logit (allow_neg_eigval: 2 sigmoid).
    disable_recompute, use_graph, max_num_seqs and cu_seqlens_cpu (training and CUDA-graph
    knobs) are accepted and ignored; chunk_size 32 or 64 is accepted and the kernel's chunk is
    64 (the result is the same recurrence). out, isa, inverse, precision, l2norm_eps: as in
    flywheel.chunk_gated_delta_rule (precision None: flywheel.auto_precision; bf16 products round
    the operands decayed per channel: docs/linear-attention.md). Not supported (NotImplementedError): state_v_first,
    cp_context, return_intermediate_states, other fla keyword arguments.
    """
    _unsupported(kwargs, state_v_first=state_v_first, cp_context=cp_context,
                 return_intermediate_states=return_intermediate_states)
    if chunk_size not in (32, 64):
        raise ValueError(f"chunk_size must be 32 or 64 for KDA, got {chunk_size}")
    if inverse not in ("blocked", "fwd_subst"):
        raise ValueError("inverse must be 'blocked' or 'fwd_subst'")
    if safe_gate and use_gate_in_kernel and lower_bound is None:
        raise ValueError("lower_bound must be given when safe_gate=True and use_gate_in_kernel=True")
    if use_gate_in_kernel and A_log is None and not (safe_gate and lower_bound is not None):
        raise ValueError("A_log must be given when use_gate_in_kernel=True and lower_bound is not "
                         "set (with safe_gate)")
    flags = _lib.GDN_FWD_SUBST if inverse == "fwd_subst" else 0
    gate = (use_gate_in_kernel, A_log, dt_bias, lower_bound if safe_gate else None,
            use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, flags, isa, out, l2norm_eps, gate, precision)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
                        initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                        lower_bound=None, state_v_first=False, cu_seqlens=None, *, out=None,
                        isa=None, l2norm_eps=None, **kwargs):
    """Token-by-token recurrence (one fused pass over the state per token), fla's
    `fused_recurrent_kda`; arguments and results as chunk_kda, except that lower_bound selects
    the sigmoid gate by itself, as in fla's recurrent kernel. For decode into a slot array in
    place see flywheel.gated_delta_rule_decode, which takes KDA's g [N, HV, K].
    Not supported (NotImplementedError): state_v_first, other fla keyword arguments.
    """
    _unsupported(kwargs, state_v_first=state_v_first)
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("A_log must be given when use_gate_in_kernel=True and lower_bound is not set")
    gate = (use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
            allow_neg_eigval)
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, _lib.GDN_FUSED_RECURRENT, isa, out,
                l2norm_eps, gate)


__all__ = ["chunk_kda", "fused_recurrent_kda"]
