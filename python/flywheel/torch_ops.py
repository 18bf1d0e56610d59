"""flywheel's calls as torch custom ops (namespace `flywheel`), for torch.compile and engines.

    import torch, flywheel.torch_ops                      # registers torch.ops.flywheel.*
    out, _ = torch.ops.flywheel.flash_attn_func(q, k, v, causal=True)
    torch.ops.flywheel.flash_attn_func_out(q, k, v, buf, causal=True)    # writes buf

Importing this module registers the ops (torch.library.custom_op: a CPU kernel, and a fake
kernel that computes the output shapes and dtypes, so torch.compile traces them without
running them); `import flywheel` alone does not import torch. Importing it again
(importlib.reload, or a fresh import after sys.modules lost it) finds the ops registered and
keeps them. Each op calls the Python function of the same name (flywheel.attention,
flywheel.gated_delta), so it gives that function's bits and raises its errors. torch >= 2.4.

Schemas (`Tensor(a!)`: written in place; SymInt is how torch spells an int argument):

  flash_attn_func(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False,
      SymInt window_size_left=-1, SymInt window_size_right=-1, float softcap=0.,
      bool return_softmax_lse=False, str? precision=None) -> (Tensor out, Tensor lse)
  flash_attn_varlen_func(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q,
      Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, <options as
      flash_attn_func>) -> (Tensor out, Tensor lse)
  flash_attn_with_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k=None,
      Tensor? v=None, Tensor? cache_seqlens=None, Tensor? block_table=None,
      float? softmax_scale=None, bool causal=False, SymInt window_size_left=-1,
      SymInt window_size_right=-1, float softcap=0., bool return_softmax_lse=False,
      Tensor? cu_seqlens_q=None, str? precision=None, Tensor? rotary_cos=None,
      Tensor? rotary_sin=None, bool rotary_interleaved=True, Tensor? cache_leftpad=None,
      Tensor? cache_batch_idx=None, str cache_layout="rows") -> (Tensor out, Tensor lse)
  chunk_gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,
      float? scale=None, Tensor? initial_state=None, bool output_final_state=False,
      bool use_qk_l2norm_in_kernel=False, bool use_beta_sigmoid_in_kernel=False,
      bool allow_neg_eigval=False, Tensor? cu_seqlens=None, bool use_gate_in_kernel=False,
      Tensor? A_log=None, Tensor? dt_bias=None, str inverse="blocked", str? precision=None)
      -> (Tensor o, Tensor final_state)
  fused_recurrent_gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,
      float? scale=None, Tensor? initial_state=None, bool output_final_state=False,
      bool use_qk_l2norm_in_kernel=False, bool use_gate_in_kernel=False, Tensor? A_log=None,
      Tensor? dt_bias=None, bool use_beta_sigmoid_in_kernel=False, bool allow_neg_eigval=False,
      Tensor? cu_seqlens=None) -> (Tensor o, Tensor final_state)
  gated_delta_rule_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,
      Tensor(a!) state, Tensor? state_indices=None, float? scale=None,
      bool use_qk_l2norm_in_kernel=False) -> Tensor o
  gated_delta_rule_verify(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state,
      Tensor? state_indices=None, Tensor? cu_seqlens=None, float? scale=None,
      bool use_qk_l2norm_in_kernel=False, str? precision=None) -> (Tensor o, Tensor replay)
  gated_delta_rule_commit(Tensor replay, Tensor accepted, Tensor(a!) state,
      Tensor cu_seqlens, SymInt num_heads, Tensor? state_indices=None) -> ()
  causal_conv1d_fn(Tensor x, Tensor weight, Tensor? bias=None, Tensor? initial_states=None,
      str? activation=None) -> Tensor out    (x [batch, dim, seqlen]; out laid out like x)
  causal_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias=None,
      str? activation=None, Tensor? cache_seqlens=None, Tensor? conv_state_indices=None)
      -> Tensor out
  fused_conv1d_gdn(Tensor qkv, Tensor b, Tensor a, Tensor(a!) conv_state,
      Tensor(b!) recurrent_state, Tensor conv_weight, Tensor? conv_bias, Tensor a_log,
      Tensor dt_bias, Tensor query_start_loc, Tensor state_indices, Tensor distribution,
      Tensor seq_lens, Tensor read_state_indices, SymInt n_kq, SymInt n_v, SymInt d_k,
      SymInt d_v, SymInt kernel_size, bool zero_initialize_out=True) -> Tensor out
  chunk_kda(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale=None,
      Tensor? initial_state=None, bool output_final_state=False,
      bool use_qk_l2norm_in_kernel=False, bool use_gate_in_kernel=False, Tensor? A_log=None,
      Tensor? dt_bias=None, bool use_beta_sigmoid_in_kernel=False, bool safe_gate=False,
      float? lower_bound=None, Tensor? cu_seqlens=None) -> (Tensor o, Tensor final_state)
  fused_conv1d_kda(...as fused_conv1d_gdn, with g [T, n_v d_k] for a..., float? lower_bound=None,
      bool beta_is_activated=False) -> Tensor out

Out variants `<name>_out`, for engines that reuse buffers: the op's required arguments, then
its outputs (written in place), then its options; they return nothing (a custom op may not
return an alias of an input, and torch 2.4's custom ops take no keyword-only tensors):
  flash_attn_func_out(q, k, v, Tensor(a!) out, Tensor(b!)? lse=None, <options>)
  flash_attn_varlen_func_out(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      Tensor(a!) out, Tensor(b!)? lse=None, <options>)
  flash_attn_with_kvcache_out(q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) out,
      Tensor(d!)? lse=None, k=None, v=None, <options>)
  chunk_gated_delta_rule_out / fused_recurrent_gated_delta_rule_out(q, k, v, g, beta,
      Tensor(a!) out, Tensor(b!)? final_state=None, <options>)
  gated_delta_rule_decode_out(q, k, v, g, beta, Tensor(a!) state, Tensor(b!) out, <options>)
  gated_delta_rule_verify_out(q, k, v, g, beta, state, Tensor(a!) out, Tensor(b!) replay,
      <options>)
  causal_conv1d_fn_out(x, weight, Tensor(a!) out, <options>)
  causal_conv1d_update_out(x, Tensor(a!) conv_state, weight, Tensor(b!) out, <options>)
  fused_conv1d_gdn_out(qkv, ..., read_state_indices, Tensor(c!) out, n_kq, ..., <options>)
The options are the op's, less return_softmax_lse (lse given = lse wanted) and
output_final_state (final_state given = wanted). out is written by the library directly; lse,
final_state and replay are computed as by the op and copied in (they are small).
gated_delta_rule_commit has no out variant: it returns nothing and already writes `state`.

Choices where the Python calls differ:
  * Fixed result arity. The flash-attn ops always return (out, lse) and take
    return_softmax_lse: without it lse is not computed (the fast paths are kept) and is an
    empty float32 tensor of shape [0]; with it, lse is [b, hq, sq] float32 ([hq, total_q]
    for varlen, and for flash_attn_with_kvcache with cu_seqlens_q). The GDN prefill ops
    always return (o, final_state): final_state is [N, HV, K, V] float32 with
    output_final_state, else an empty float32 tensor of shape [0].
  * window_size is two ints, window_size_left and window_size_right (the names of
    flash-attn's own custom ops); negative = unbounded.
  * cache_seqlens is a [b] integer tensor (no Python int); it is required, as in the call.
  * Not arguments: what the library does not have (dropout_p, alibi_slopes, deterministic,
    return_attn_probs, num_splits, the varlen call's
    block_table, gk / gv, state_v_first, cp_context), the kernel-selection knobs isa= and
    plain= (FLYWHEEL_ISA selects the table for every call), and the rotary_* of the dense and
    varlen ops (their Python calls take them; the cache ops take flash-attn's).
  * flash_attn_with_kvcache(_out) declares k_cache and v_cache written; they are written
    only when k and v are given (a schema cannot say "sometimes"), so under torch.compile a
    call without k, v is treated as a write too (functionalization may copy the caches).
  * gated_delta_rule_verify's replay is the float32 buffer of flywheel.GDNReplay, shape
    [gdn_replay_floats(B*T, H, HV, K, V)] (include/flywheel.h: 1 + T x (HV x (V + 1) + H x K);
    KDA's g [B, T, HV, K]: 1 + T x (HV x (V + K) + H x K)). gated_delta_rule_commit rebuilds the GDNReplay from it and from what a
    tensor cannot carry: cu_seqlens (the verify call's [N + 1] offsets; for [B, T] inputs
    torch.arange(B + 1, dtype=torch.int32) * T), num_heads (H, the q/k heads of the verify
    call) and state_indices (the verify call's; default 0..N-1). HV, K, V come from state.
  * Backward. flash_attn_func and flash_attn_varlen_func are differentiable: their autograd
    formula calls the ops flash_attn_backward / flash_attn_varlen_backward (below), from the
    saved q, k, v, out and lse. Without return_softmax_lse the forward did not compute lse,
    and the backward runs the forward once more for it: pass return_softmax_lse=True when
    training. The other functional ops register a formula whose backward raises
    NotImplementedError ("... is forward-only"); torch takes no formula for ops that write
    in place, so a backward through those raises torch's RuntimeError ("no autograd formula
    was registered"). The forward itself runs with inputs that require grad (inside the op
    grad mode is off, so the Python calls' requires-grad check does not fire).
  * flash_attn_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
      Tensor softmax_lse, float? softmax_scale=None, bool causal=False,
      SymInt window_size_left=-1, SymInt window_size_right=-1, float softcap=0.,
      str? precision=None) -> (Tensor dq, Tensor dk, Tensor dv); flash_attn_varlen_backward takes cu_seqlens_q,
      cu_seqlens_k, max_seqlen_q, max_seqlen_k after softmax_lse.
  * CPU tensors only (device_types="cpu"); numpy arrays are for the Python calls.
"""

from typing import Optional, Tuple

import torch

from . import _tensors as _T
from . import attention as _attn
from . import conv as _conv
from . import gated_delta as _gdn
from . import kda as _kda
from . import layers as _layers

Tensor = torch.Tensor
NAMESPACE = "flywheel"

__all__ = ["NAMESPACE", "OPS", "gdn_replay_floats"]


def gdn_replay_floats(total_tokens, num_heads, num_v_heads, head_k_dim, head_v_dim, kda=False):
    """The float32 entries of gated_delta_rule_verify's replay (fw_gdn_replay_floats of
    include/flywheel.h, or fw_kda_replay_floats with kda: KDA's g [.., HV, K]), as
    flywheel.gated_delta_rule_verify allocates it; works on SymInts, for the fake kernels."""
    per_head = head_v_dim + (head_k_dim if kda else 1)
    return 1 + total_tokens * (num_v_heads * per_head + num_heads * head_k_dim)


def _no_lse(ref):
    """The placeholder of an output that was not asked for: an empty float32 tensor."""
    return ref.new_empty((0,), dtype=torch.float32)


def _copy_into(dst, src):
    if dst is not None:
        dst.copy_(src)


# ---------------------------------------------------------------- flash-attn: implementations

def _flash_attn_func(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float] = None,
                     causal: bool = False, window_size_left: int = -1,
                     window_size_right: int = -1, softcap: float = 0.0,
                     return_softmax_lse: bool = False,
                     precision: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    r = _attn.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                              window_size=(window_size_left, window_size_right),
                              softcap=softcap, return_softmax_lse=return_softmax_lse,
                              precision=precision)
    return r if return_softmax_lse else (r, _no_lse(q))


def _flash_attn_func_fake(q, k, v, softmax_scale=None, causal=False, window_size_left=-1,
                          window_size_right=-1, softcap=0.0, return_softmax_lse=False,
                          precision=None):
    b, sq, hq, _ = q.shape
    out = q.new_empty((b, sq, hq, v.shape[-1]))
    lse = q.new_empty((b, hq, sq), dtype=torch.float32) if return_softmax_lse else _no_lse(q)
    return out, lse


def _flash_attn_func_out(q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                         lse: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                         causal: bool = False, window_size_left: int = -1,
                         window_size_right: int = -1, softcap: float = 0.0,
                         precision: Optional[str] = None) -> None:
    r = _attn.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                              window_size=(window_size_left, window_size_right),
                              softcap=softcap, return_softmax_lse=lse is not None, out=out,
                              precision=precision)
    if lse is not None:
        lse.copy_(r[1])


def _flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                            cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size_left: int = -1, window_size_right: int = -1,
                            softcap: float = 0.0, return_softmax_lse: bool = False,
                            precision: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    r = _attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                     window_size=(window_size_left, window_size_right),
                                     softcap=softcap, return_softmax_lse=return_softmax_lse,
                                     precision=precision)
    return r if return_softmax_lse else (r, _no_lse(q))


def _flash_attn_varlen_func_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, softmax_scale=None, causal=False,
                                 window_size_left=-1, window_size_right=-1, softcap=0.0,
                                 return_softmax_lse=False, precision=None):
    total_q, hq, _ = q.shape
    out = q.new_empty((total_q, hq, v.shape[-1]))
    lse = (q.new_empty((hq, total_q), dtype=torch.float32) if return_softmax_lse
           else _no_lse(q))
    return out, lse


def _flash_attn_varlen_func_out(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                out: Tensor, lse: Optional[Tensor] = None,
                                softmax_scale: Optional[float] = None, causal: bool = False,
                                window_size_left: int = -1, window_size_right: int = -1,
                                softcap: float = 0.0, precision: Optional[str] = None) -> None:
    r = _attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                     window_size=(window_size_left, window_size_right),
                                     softcap=softcap, return_softmax_lse=lse is not None,
                                     out=out, precision=precision)
    if lse is not None:
        lse.copy_(r[1])


def _flash_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                         softmax_lse: Tensor, softmax_scale: Optional[float] = None,
                         causal: bool = False, window_size_left: int = -1,
                         window_size_right: int = -1, softcap: float = 0.0,
                         precision: Optional[str] = None) -> Tuple[Tensor, Tensor, Tensor]:
    return _attn.flash_attn_backward(dout, q, k, v, out, softmax_lse,
                                     softmax_scale=softmax_scale, causal=causal,
                                     window_size=(window_size_left, window_size_right),
                                     softcap=softcap, precision=precision)


def _grads_fake(dout, q, k, v, *args, **kwargs):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_attn_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                softmax_lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                max_seqlen_q: int, max_seqlen_k: int,
                                softmax_scale: Optional[float] = None, causal: bool = False,
                                window_size_left: int = -1, window_size_right: int = -1,
                                softcap: float = 0.0,
                                precision: Optional[str] = None) -> Tuple[Tensor, Tensor, Tensor]:
    return _attn.flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q,
                                            cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale=softmax_scale, causal=causal,
                                            window_size=(window_size_left, window_size_right),
                                            softcap=softcap, precision=precision)


def _flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                             k: Optional[Tensor] = None, v: Optional[Tensor] = None,
                             cache_seqlens: Optional[Tensor] = None,
                             block_table: Optional[Tensor] = None,
                             softmax_scale: Optional[float] = None, causal: bool = False,
                             window_size_left: int = -1, window_size_right: int = -1,
                             softcap: float = 0.0, return_softmax_lse: bool = False,
                             cu_seqlens_q: Optional[Tensor] = None,
                             precision: Optional[str] = None,
                             rotary_cos: Optional[Tensor] = None,
                             rotary_sin: Optional[Tensor] = None,
                             rotary_interleaved: bool = True,
                             cache_leftpad: Optional[Tensor] = None,
                             cache_batch_idx: Optional[Tensor] = None,
                             cache_layout: str = "rows") -> Tuple[Tensor, Tensor]:
    r = _attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                      block_table=block_table, softmax_scale=softmax_scale,
                                      causal=causal,
                                      window_size=(window_size_left, window_size_right),
                                      softcap=softcap, return_softmax_lse=return_softmax_lse,
                                      cu_seqlens_q=cu_seqlens_q, precision=precision,
                                      rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                      rotary_interleaved=rotary_interleaved,
                                      cache_leftpad=cache_leftpad,
                                      cache_batch_idx=cache_batch_idx, cache_layout=cache_layout)
    return r if return_softmax_lse else (r, _no_lse(q))


def _flash_attn_with_kvcache_fake(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                                  block_table=None, softmax_scale=None, causal=False,
                                  window_size_left=-1, window_size_right=-1, softcap=0.0,
                                  return_softmax_lse=False, cu_seqlens_q=None,
                                  precision=None, rotary_cos=None, rotary_sin=None,
                                  rotary_interleaved=True, cache_leftpad=None,
                                  cache_batch_idx=None, cache_layout="rows"):
    dv = v_cache.shape[-1]
    if cu_seqlens_q is not None:  # packed q [total_q, hq, d]
        total_q, hq, _ = q.shape
        out = q.new_empty((total_q, hq, dv))
        lse_shape = (hq, total_q)
    else:
        b, sq, hq, _ = q.shape
        out = q.new_empty((b, sq, hq, dv))
        lse_shape = (b, hq, sq)
    lse = q.new_empty(lse_shape, dtype=torch.float32) if return_softmax_lse else _no_lse(q)
    return out, lse


def _flash_attn_with_kvcache_out(q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor,
                                 lse: Optional[Tensor] = None,
                                 k: Optional[Tensor] = None, v: Optional[Tensor] = None,
                                 cache_seqlens: Optional[Tensor] = None,
                                 block_table: Optional[Tensor] = None,
                                 softmax_scale: Optional[float] = None, causal: bool = False,
                                 window_size_left: int = -1, window_size_right: int = -1,
                                 softcap: float = 0.0, cu_seqlens_q: Optional[Tensor] = None,
                                 precision: Optional[str] = None,
                                 rotary_cos: Optional[Tensor] = None,
                                 rotary_sin: Optional[Tensor] = None,
                                 rotary_interleaved: bool = True,
                                 cache_leftpad: Optional[Tensor] = None,
                                 cache_batch_idx: Optional[Tensor] = None,
                                 cache_layout: str = "rows") -> None:
    r = _attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                      block_table=block_table, softmax_scale=softmax_scale,
                                      causal=causal,
                                      window_size=(window_size_left, window_size_right),
                                      softcap=softcap, return_softmax_lse=lse is not None,
                                      cu_seqlens_q=cu_seqlens_q, out=out, precision=precision,
                                      rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                      rotary_interleaved=rotary_interleaved,
                                      cache_leftpad=cache_leftpad,
                                      cache_batch_idx=cache_batch_idx, cache_layout=cache_layout)
    if lse is not None:
        lse.copy_(r[1])


# ------------------------------------------------------------ Gated DeltaNet: implementations

def _prefill_fake(q, v, cu_seqlens, output_final_state):
    B = v.shape[0]
    n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    o = v.new_empty(tuple(v.shape))
    if output_final_state:
        h = q.new_empty((n, v.shape[2], q.shape[-1], v.shape[-1]), dtype=torch.float32)
    else:
        h = _no_lse(q)
    return o, h


def _final(h, ref):
    return h if h is not None else _no_lse(ref)


def _chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            scale: Optional[float] = None,
                            initial_state: Optional[Tensor] = None,
                            output_final_state: bool = False,
                            use_qk_l2norm_in_kernel: bool = False,
                            use_beta_sigmoid_in_kernel: bool = False,
                            allow_neg_eigval: bool = False,
                            cu_seqlens: Optional[Tensor] = None,
                            use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
                            dt_bias: Optional[Tensor] = None, inverse: str = "blocked",
                            precision: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    o, h = _gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, inverse=inverse,
        precision=precision)
    return o, _final(h, q)


def _chunk_gated_delta_rule_fake(q, k, v, g, beta, scale=None, initial_state=None,
                                 output_final_state=False, use_qk_l2norm_in_kernel=False,
                                 use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                 cu_seqlens=None, use_gate_in_kernel=False, A_log=None,
                                 dt_bias=None, inverse="blocked", precision=None):
    return _prefill_fake(q, v, cu_seqlens, output_final_state)


def _chunk_gated_delta_rule_out(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                out: Tensor, final_state: Optional[Tensor] = None,
                                scale: Optional[float] = None,
                                initial_state: Optional[Tensor] = None,
                                use_qk_l2norm_in_kernel: bool = False,
                                use_beta_sigmoid_in_kernel: bool = False,
                                allow_neg_eigval: bool = False,
                                cu_seqlens: Optional[Tensor] = None,
                                use_gate_in_kernel: bool = False,
                                A_log: Optional[Tensor] = None,
                                dt_bias: Optional[Tensor] = None, inverse: str = "blocked",
                                precision: Optional[str] = None) -> None:
    _, h = _gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=final_state is not None,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, inverse=inverse,
        precision=precision, out=out)
    _copy_into(final_state, h)


def _fused_recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                      scale: Optional[float] = None,
                                      initial_state: Optional[Tensor] = None,
                                      output_final_state: bool = False,
                                      use_qk_l2norm_in_kernel: bool = False,
                                      use_gate_in_kernel: bool = False,
                                      A_log: Optional[Tensor] = None,
                                      dt_bias: Optional[Tensor] = None,
                                      use_beta_sigmoid_in_kernel: bool = False,
                                      allow_neg_eigval: bool = False,
                                      cu_seqlens: Optional[Tensor] = None
                                      ) -> Tuple[Tensor, Tensor]:
    o, h = _gdn.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens)
    return o, _final(h, q)


def _fused_recurrent_gated_delta_rule_fake(q, k, v, g, beta, scale=None, initial_state=None,
                                           output_final_state=False,
                                           use_qk_l2norm_in_kernel=False,
                                           use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                           use_beta_sigmoid_in_kernel=False,
                                           allow_neg_eigval=False, cu_seqlens=None):
    return _prefill_fake(q, v, cu_seqlens, output_final_state)


def _fused_recurrent_gated_delta_rule_out(q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                                          beta: Tensor, out: Tensor,
                                          final_state: Optional[Tensor] = None,
                                          scale: Optional[float] = None,
                                          initial_state: Optional[Tensor] = None,
                                          use_qk_l2norm_in_kernel: bool = False,
                                          use_gate_in_kernel: bool = False,
                                          A_log: Optional[Tensor] = None,
                                          dt_bias: Optional[Tensor] = None,
                                          use_beta_sigmoid_in_kernel: bool = False,
                                          allow_neg_eigval: bool = False,
                                          cu_seqlens: Optional[Tensor] = None) -> None:
    _, h = _gdn.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=final_state is not None,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens, out=out)
    _copy_into(final_state, h)


def _gated_delta_rule_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                             state: Tensor, state_indices: Optional[Tensor] = None,
                             scale: Optional[float] = None,
                             use_qk_l2norm_in_kernel: bool = False) -> Tensor:
    return _gdn.gated_delta_rule_decode(q, k, v, g, beta, state, state_indices, scale,
                                        use_qk_l2norm_in_kernel)


def _gated_delta_rule_decode_fake(q, k, v, g, beta, state, state_indices=None, scale=None,
                                  use_qk_l2norm_in_kernel=False):
    return v.new_empty(tuple(v.shape))


def _gated_delta_rule_decode_out(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                 state: Tensor, out: Tensor,
                                 state_indices: Optional[Tensor] = None,
                                 scale: Optional[float] = None,
                                 use_qk_l2norm_in_kernel: bool = False) -> None:
    _gdn.gated_delta_rule_decode(q, k, v, g, beta, state, state_indices, scale,
                                 use_qk_l2norm_in_kernel, out=out)


def _gated_delta_rule_verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                             state: Tensor, state_indices: Optional[Tensor] = None,
                             cu_seqlens: Optional[Tensor] = None,
                             scale: Optional[float] = None,
                             use_qk_l2norm_in_kernel: bool = False,
                             precision: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    o, replay = _gdn.gated_delta_rule_verify(q, k, v, g, beta, state, state_indices,
                                             cu_seqlens, scale, use_qk_l2norm_in_kernel,
                                             precision=precision)
    return o, torch.from_numpy(replay.buffer)


def _gated_delta_rule_verify_fake(q, k, v, g, beta, state, state_indices=None, cu_seqlens=None,
                                  scale=None, use_qk_l2norm_in_kernel=False, precision=None):
    B, Tn, HV, V = v.shape
    floats = gdn_replay_floats(B * Tn, q.shape[2], HV, q.shape[3], V, g.dim() == 4)
    return v.new_empty(tuple(v.shape)), q.new_empty((floats,), dtype=torch.float32)


def _gated_delta_rule_verify_out(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                 state: Tensor, out: Tensor, replay: Tensor,
                                 state_indices: Optional[Tensor] = None,
                                 cu_seqlens: Optional[Tensor] = None,
                                 scale: Optional[float] = None,
                                 use_qk_l2norm_in_kernel: bool = False,
                                 precision: Optional[str] = None) -> None:
    _, r = _gdn.gated_delta_rule_verify(q, k, v, g, beta, state, state_indices, cu_seqlens,
                                        scale, use_qk_l2norm_in_kernel, out=out,
                                        precision=precision)
    replay.copy_(torch.from_numpy(r.buffer))


def _gated_delta_rule_commit(replay: Tensor, accepted: Tensor, state: Tensor,
                             cu_seqlens: Tensor, num_heads: int,
                             state_indices: Optional[Tensor] = None) -> None:
    if state.ndim != 4:
        raise ValueError(f"state must be [slots, HV, K, V], got shape {tuple(state.shape)}")
    if replay.dtype != torch.float32 or replay.ndim != 1:
        raise TypeError(f"replay must be the 1-D float32 replay of gated_delta_rule_verify, "
                        f"got {replay.dtype} of shape {tuple(replay.shape)}")
    cu = _T.index_array(cu_seqlens, "cu_seqlens")
    if cu.ndim != 1 or cu.size < 1:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 entries, got shape {cu.shape}")
    idx = _gdn._indices(state_indices, cu.size - 1)
    _, HV, K, V = state.shape
    rep = _gdn.GDNReplay(replay.detach().contiguous().numpy(), cu, idx, int(num_heads), HV, K, V)
    _gdn.gated_delta_rule_commit(rep, accepted, state)


def _gated_delta_rule_commit_fake(replay, accepted, state, cu_seqlens, num_heads,
                                  state_indices=None):
    return None


# ---------------------------------------------------------- conv and the GDN layer: implementations

def _causal_conv1d_fn(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                      initial_states: Optional[Tensor] = None,
                      activation: Optional[str] = None) -> Tensor:
    out = torch.empty_like(x)
    _conv.causal_conv1d_fn(x, weight, bias, initial_states=initial_states,
                           activation=activation, out=out)
    return out


def _causal_conv1d_fn_fake(x, weight, bias=None, initial_states=None, activation=None):
    return torch.empty_like(x)


def _causal_conv1d_fn_out(x: Tensor, weight: Tensor, out: Tensor, bias: Optional[Tensor] = None,
                          initial_states: Optional[Tensor] = None,
                          activation: Optional[str] = None) -> None:
    _conv.causal_conv1d_fn(x, weight, bias, initial_states=initial_states,
                           activation=activation, out=out)


def _causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor,
                          bias: Optional[Tensor] = None, activation: Optional[str] = None,
                          cache_seqlens: Optional[Tensor] = None,
                          conv_state_indices: Optional[Tensor] = None) -> Tensor:
    return _conv.causal_conv1d_update(x, conv_state, weight, bias, activation, cache_seqlens,
                                      conv_state_indices)


def _causal_conv1d_update_fake(x, conv_state, weight, bias=None, activation=None,
                               cache_seqlens=None, conv_state_indices=None):
    return x.new_empty(tuple(x.shape))


def _causal_conv1d_update_out(x: Tensor, conv_state: Tensor, weight: Tensor, out: Tensor,
                              bias: Optional[Tensor] = None, activation: Optional[str] = None,
                              cache_seqlens: Optional[Tensor] = None,
                              conv_state_indices: Optional[Tensor] = None) -> None:
    _conv.causal_conv1d_update(x, conv_state, weight, bias, activation, cache_seqlens,
                               conv_state_indices, out=out)


def _fused_conv1d_gdn(qkv: Tensor, b: Tensor, a: Tensor, conv_state: Tensor,
                      recurrent_state: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor],
                      a_log: Tensor, dt_bias: Tensor, query_start_loc: Tensor,
                      state_indices: Tensor, distribution: Tensor, seq_lens: Tensor,
                      read_state_indices: Tensor, n_kq: int, n_v: int, d_k: int, d_v: int,
                      kernel_size: int, zero_initialize_out: bool = True) -> Tensor:
    _, out = _layers.fused_conv1d_gdn(
        qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
        query_start_loc, state_indices, distribution, seq_lens, read_state_indices, n_kq=n_kq,
        n_v=n_v, d_k=d_k, d_v=d_v, kernel_size=kernel_size,
        zero_initialize_out=zero_initialize_out)
    return out


def _fused_conv1d_gdn_fake(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log,
                           dt_bias, query_start_loc, state_indices, distribution, seq_lens,
                           read_state_indices, n_kq, n_v, d_k, d_v, kernel_size,
                           zero_initialize_out=True):
    return qkv.new_empty((qkv.shape[0], n_v * d_v))


def _fused_conv1d_gdn_out(qkv: Tensor, b: Tensor, a: Tensor, conv_state: Tensor,
                          recurrent_state: Tensor, conv_weight: Tensor,
                          conv_bias: Optional[Tensor], a_log: Tensor, dt_bias: Tensor,
                          query_start_loc: Tensor, state_indices: Tensor, distribution: Tensor,
                          seq_lens: Tensor, read_state_indices: Tensor, out: Tensor, n_kq: int,
                          n_v: int, d_k: int, d_v: int, kernel_size: int,
                          zero_initialize_out: bool = True) -> None:
    _layers.fused_conv1d_gdn(
        qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
        query_start_loc, state_indices, distribution, seq_lens, read_state_indices, n_kq=n_kq,
        n_v=n_v, d_k=d_k, d_v=d_v, kernel_size=kernel_size,
        zero_initialize_out=zero_initialize_out, out=out)


def _chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
               scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
               output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
               use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
               dt_bias: Optional[Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
               safe_gate: bool = False, lower_bound: Optional[float] = None,
               cu_seqlens: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    o, h = _kda.chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        safe_gate=safe_gate, lower_bound=lower_bound, cu_seqlens=cu_seqlens, A_log=A_log,
        dt_bias=dt_bias)
    return o, _final(h, q)


def _chunk_kda_fake(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                    dt_bias=None, use_beta_sigmoid_in_kernel=False, safe_gate=False,
                    lower_bound=None, cu_seqlens=None):
    return _prefill_fake(q, v, cu_seqlens, output_final_state)


def _fused_conv1d_kda(qkv: Tensor, b: Tensor, g: Tensor, conv_state: Tensor,
                      recurrent_state: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor],
                      a_log: Tensor, dt_bias: Tensor, query_start_loc: Tensor,
                      state_indices: Tensor, distribution: Tensor, seq_lens: Tensor,
                      read_state_indices: Tensor, n_kq: int, n_v: int, d_k: int, d_v: int,
                      kernel_size: int, zero_initialize_out: bool = True,
                      lower_bound: Optional[float] = None,
                      beta_is_activated: bool = False) -> Tensor:
    _, out = _layers.fused_conv1d_kda(
        qkv, b, g, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
        query_start_loc, state_indices, distribution, seq_lens, read_state_indices, n_kq=n_kq,
        n_v=n_v, d_k=d_k, d_v=d_v, kernel_size=kernel_size,
        zero_initialize_out=zero_initialize_out, lower_bound=lower_bound,
        beta_is_activated=beta_is_activated)
    return out


def _fused_conv1d_kda_fake(qkv, b, g, conv_state, recurrent_state, conv_weight, conv_bias, a_log,
                           dt_bias, query_start_loc, state_indices, distribution, seq_lens,
                           read_state_indices, n_kq, n_v, d_k, d_v, kernel_size,
                           zero_initialize_out=True, lower_bound=None, beta_is_activated=False):
    return qkv.new_empty((qkv.shape[0], n_v * d_v))


# ------------------------------------------------------------------------------- registration

# name -> (implementation, fake, arguments written in place)
_SPECS = {
    "flash_attn_func": (_flash_attn_func, _flash_attn_func_fake, ()),
    "flash_attn_func_out": (_flash_attn_func_out, None, ("out", "lse")),
    "flash_attn_varlen_func": (_flash_attn_varlen_func, _flash_attn_varlen_func_fake, ()),
    "flash_attn_varlen_func_out": (_flash_attn_varlen_func_out, None, ("out", "lse")),
    "flash_attn_backward": (_flash_attn_backward, _grads_fake, ()),
    "flash_attn_varlen_backward": (_flash_attn_varlen_backward, _grads_fake, ()),
    "flash_attn_with_kvcache": (_flash_attn_with_kvcache, _flash_attn_with_kvcache_fake,
                                ("k_cache", "v_cache")),
    "flash_attn_with_kvcache_out": (_flash_attn_with_kvcache_out, None,
                                    ("k_cache", "v_cache", "out", "lse")),
    "chunk_gated_delta_rule": (_chunk_gated_delta_rule, _chunk_gated_delta_rule_fake, ()),
    "chunk_gated_delta_rule_out": (_chunk_gated_delta_rule_out, None, ("out", "final_state")),
    "fused_recurrent_gated_delta_rule": (_fused_recurrent_gated_delta_rule,
                                         _fused_recurrent_gated_delta_rule_fake, ()),
    "fused_recurrent_gated_delta_rule_out": (_fused_recurrent_gated_delta_rule_out, None,
                                             ("out", "final_state")),
    "gated_delta_rule_decode": (_gated_delta_rule_decode, _gated_delta_rule_decode_fake,
                                ("state",)),
    "gated_delta_rule_decode_out": (_gated_delta_rule_decode_out, None, ("state", "out")),
    "gated_delta_rule_verify": (_gated_delta_rule_verify, _gated_delta_rule_verify_fake, ()),
    "gated_delta_rule_verify_out": (_gated_delta_rule_verify_out, None, ("out", "replay")),
    "gated_delta_rule_commit": (_gated_delta_rule_commit, _gated_delta_rule_commit_fake,
                                ("state",)),
    "causal_conv1d_fn": (_causal_conv1d_fn, _causal_conv1d_fn_fake, ()),
    "causal_conv1d_fn_out": (_causal_conv1d_fn_out, None, ("out",)),
    "causal_conv1d_update": (_causal_conv1d_update, _causal_conv1d_update_fake, ("conv_state",)),
    "causal_conv1d_update_out": (_causal_conv1d_update_out, None, ("conv_state", "out")),
    "fused_conv1d_gdn": (_fused_conv1d_gdn, _fused_conv1d_gdn_fake,
                         ("conv_state", "recurrent_state")),
    "fused_conv1d_gdn_out": (_fused_conv1d_gdn_out, None,
                             ("conv_state", "recurrent_state", "out")),
    "chunk_kda": (_chunk_kda, _chunk_kda_fake, ()),
    "fused_conv1d_kda": (_fused_conv1d_kda, _fused_conv1d_kda_fake,
                         ("conv_state", "recurrent_state")),
}

OPS = tuple(_SPECS)  # the registered names: torch.ops.flywheel.<name>


def _none_fake(*args, **kwargs):
    """Fake kernel of the out variants: they return nothing and write only their outputs."""
    return None


def _registered(name):
    try:
        return hasattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False


def _no_backward(name):
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{NAMESPACE}::{name} is forward-only: flywheel has no backward kernels (run it "
            "under torch.no_grad() or torch.inference_mode(), or pass detached inputs)")
    return backward


# The attention ops' autograd: the backward ops above, from the saved q, k, v, out and lse.
# An lse that was not asked for (return_softmax_lse=False: an empty [0] placeholder) is
# recomputed by running the forward again; ask for it when training to save that.
def _attn_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output)
    ctx.options = inputs[3:]


def _attn_lse(name, q, k, v, out, lse, args):
    if lse.dim() != 1:
        return out, lse
    fwd = getattr(torch.ops, NAMESPACE).__getattr__(name)
    return fwd(q, k, v, *args)


def _flash_attn_func_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    scale, causal, left, right, softcap, _, precision = ctx.options
    out, lse = _attn_lse("flash_attn_func", q, k, v, out, lse,
                         (scale, causal, left, right, softcap, True, precision))
    grads = getattr(torch.ops, NAMESPACE).flash_attn_backward(dout, q, k, v, out, lse, scale,
                                                              causal, left, right, softcap,
                                                              precision)
    return tuple(grads) + (None,) * len(ctx.options)


def _flash_attn_varlen_func_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap, _, precision = ctx.options
    out, lse = _attn_lse("flash_attn_varlen_func", q, k, v, out, lse,
                         (cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap, True,
                          precision))
    grads = getattr(torch.ops, NAMESPACE).flash_attn_varlen_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap,
        precision)
    return tuple(grads) + (None,) * len(ctx.options)


_BACKWARDS = {"flash_attn_func": _flash_attn_func_backward,
              "flash_attn_varlen_func": _flash_attn_varlen_func_backward}


def _register():
    for name, (fn, fake, mutates) in _SPECS.items():
        if _registered(name):  # imported before in this process: keep that registration
            continue
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=mutates,
                                     device_types="cpu")
        op.register_fake(fake if fake is not None else _none_fake)
        if name in _BACKWARDS:
            op.register_autograd(_BACKWARDS[name], setup_context=_attn_setup)
        elif not mutates:  # torch takes autograd formulas for functional ops only
            op.register_autograd(_no_backward(name))


_register()
