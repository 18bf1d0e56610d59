"""The package's public calls, each described once, and the C entry points they run on.

This module is data: every other place that used to spell a call out by hand derives it from
here (the model is PyTorch's native_functions.yaml, one declarative entry per op):

  * _lib.py sets the ctypes prototypes (argtypes, restype) of every C entry point from
    C_FUNCTIONS, and hands the compiled fast path (_fwext.c) the addresses of the entry points
    the described fast paths name (fast_symbols()).
  * Each Python call that has a compiled fast path asks _lib.fast_call(name) for its dispatch:
    which _fwext function takes the call, the arguments it is given (names of the Python
    function's locals at the point of the call, in order) and the conditions under which it
    is offered the call at all (Fast below). _fwext.c keeps the conversions in C.
  * torch_ops.py registers torch.ops.flywheel.<name> for every call with `op` set: the schema
    string (mutation annotations from `mutates`), the CPU kernel (the Python call, its
    arguments mapped from the op's), the fake kernel (output shapes and dtypes from `outputs`)
    and, with `out_after` set, the `<name>_out` form.
  * python/tests/test_calls.py checks that the description and the package agree.

Shapes in `outputs` are Python expressions over the op's arguments (torch tensors, or fake
tensors while tracing) and the helper replay_floats; they give the fake kernels' shapes.
Nothing here imports torch or loads the library.
"""

from typing import NamedTuple, Optional, Tuple

REQUIRED = "required"  # the default of an argument that has none

# argument dtypes, as the calls document them
FLOAT = "float32, bfloat16 or float16"
F32 = "float32"
INDEX = "int32 (other integer dtypes are copied to int32)"
STATE = "float32 or bfloat16, updated in place"


class Arg(NamedTuple):
    """An argument of a call's torch op, in the op's order. type: its schema type ("Tensor",
    "Tensor?", "float?", "bool", "SymInt", "str", "str?"). into: the Python keyword it is
    passed as when that differs from its name; arguments with the same `into` are packed,
    in order, into one tuple (window_size_left, window_size_right -> window_size)."""
    name: str
    type: str
    default: object = REQUIRED
    shape: str = ""
    dtype: str = ""
    into: Optional[str] = None


class Out(NamedTuple):
    """An output of a call's torch op. shape: an expression over the op's arguments; dtype:
    the argument whose dtype it has, or "float32". like: an argument it is allocated like
    (torch.empty_like: its shape, dtype and strides) instead. wanted_by: the bool argument that
    asks for it; without it the op returns an empty float32 tensor of shape [0] in its place,
    and in the out form it is an optional buffer (given = wanted). buffer: the Python call
    returns a GDNReplay whose float32 .buffer is this output."""
    name: str
    shape: str = ""
    dtype: str = ""
    like: Optional[str] = None
    wanted_by: Optional[str] = None
    buffer: bool = False


def is_none(name):
    """A Fast condition: the local `name` is None."""
    return (name, "is None")


def is_false(name):
    """A Fast condition: the local `name` is false."""
    return (name, "false")


def is_given(name):
    """A Fast condition: the local `name` is not None."""
    return (name, "is not None")


THREADS = ("threads",)  # in Fast.args: the thread count set with flywheel.set_num_threads


class Fast(NamedTuple):
    """A call's compiled fast path: _fwext.<fn>(*args) where every condition holds (checked in
    order), else the ctypes path alone. args: names of the Python function's locals where it
    offers the call (its arguments, and values it derived before), or THREADS. c: the library
    functions the fast path calls (their addresses go to _fwext.init). The fast path returns
    NotImplemented for any call it does not take (see _fwext.c); the Python path runs it."""
    fn: str
    args: Tuple
    when: Tuple = ()
    c: Tuple[str, ...] = ()


class Call(NamedTuple):
    """A public call. module: flywheel.<module> defines it; exported: the public modules that
    name it. c: the library functions its ctypes path calls. fast: its compiled fast path.
    op: it is registered as torch.ops.flywheel.<name>, with the arguments `args` and the
    outputs `outputs`; mutates: the arguments it writes in place. result: how the Python call
    returns the outputs -- "one" (the only output), "all" (a tuple of all, None where one was
    not wanted), "wanted" (the first alone unless the second's wanted_by flag is set, then
    both: flash-attn's convention), "second" (((caches), out): the serving-layer calls).
    out_after: the argument after which the `<name>_out` form takes its outputs (written in
    place: the first is passed to the Python call as out=, the others copied in), None for no
    out form. adapter: the op's CPU kernel is torch_ops' hand-written adapter of that name
    (for a call whose arguments a tensor cannot carry one to one; no out form then).
    backward: the op that computes its gradients (torch_ops holds the autograd formula)."""
    name: str
    module: str
    c: Tuple[str, ...] = ()
    exported: Tuple[str, ...] = ("flywheel",)
    fast: Optional[Fast] = None
    op: bool = False
    args: Tuple[Arg, ...] = ()
    outputs: Tuple[Out, ...] = ()
    mutates: Tuple[str, ...] = ()
    result: str = "one"
    out_after: Optional[str] = None
    adapter: Optional[str] = None
    backward: Optional[str] = None


def replay_floats(total_tokens, num_heads, num_v_heads, head_k_dim, head_v_dim, kda=False):
    """The float32 entries of gated_delta_rule_verify's replay (fw_gdn_replay_floats of
    include/flywheel.h, or fw_kda_replay_floats with kda: KDA's g [.., HV, K]), as
    flywheel.gated_delta_rule_verify allocates it; works on SymInts, for the fake kernels."""
    per_head = head_v_dim + (head_k_dim if kda else 1)
    return 1 + total_tokens * (num_v_heads * per_head + num_heads * head_k_dim)


# ------------------------------------------------------------------------ the C entry points

# name -> (return type, argument types). Types: "status" (fw_status), "void", "int",
# "int32", "int64", "size" (size_t), "double", "str" (const char *), "ptr" (void *, an
# int32 array or a function), a struct of _lib.py ("tensor", "attn_params", ...), and any of
# them with "*" for a pointer. _lib.py refuses a library that lacks one of them.
C_FUNCTIONS = {
    "fw_abi_version": ("int", ()),
    "fw_version": ("str", ()),
    "fw_status_string": ("str", ("int",)),
    "fw_last_error": ("str", ()),
    "fw_isa_count": ("int", ()),
    "fw_isa_name": ("str", ("int",)),
    "fw_isa_supported": ("int", ("str",)),
    "fw_isa_native_bf16": ("int", ("str",)),
    "fw_isa_default": ("str", ()),
    "fw_attn_params_init": ("void", ("attn_params*",)),
    "fw_attn_fwd": ("status", ("tensor*",) * 5 + ("attn_params*",)),
    "fw_attn_varlen_fwd": ("status", ("tensor*",) * 3 + ("ptr", "ptr", "int64", "tensor*",
                                                         "tensor*", "attn_params*")),
    "fw_attn_workspace_size": ("status", ("tensor*",) * 3 + ("attn_params*", "size*")),
    "fw_attn_bwd": ("status", ("tensor*",) * 9 + ("attn_params*",)),
    "fw_attn_varlen_bwd": ("status", ("tensor*",) * 6 + ("ptr", "ptr", "int64") +
                           ("tensor*",) * 3 + ("attn_params*",)),
    "fw_attn_kvcache_fwd": ("status", ("tensor*",) * 3 + ("ptr", "int64", "kv_cache*",
                                                          "tensor*", "tensor*",
                                                          "attn_params*")),
    "fw_gdn_params_init": ("void", ("gdn_params*",)),
    "fw_gdn_prefill": ("status", ("tensor*",) * 5 + ("ptr", "int64", "ptr", "ptr", "tensor*",
                                                     "gdn_params*")),
    "fw_gdn_decode": ("status", ("tensor*",) * 5 + ("ptr", "int64", "ptr", "tensor*",
                                                    "gdn_params*")),
    "fw_gdn_prefill_pool": ("status", ("tensor*",) * 5 + ("ptr", "int64", "gdn_pool*",
                                                          "tensor*", "gdn_params*")),
    "fw_gdn_decode_pool": ("status", ("tensor*",) * 5 + ("gdn_pool*", "tensor*",
                                                         "gdn_params*")),
    "fw_gdn_layer_params_init": ("void", ("gdn_layer_params*",)),
    "fw_gdn_layer": ("status", ("tensor*",) * 7 + ("gdn_batch*", "gdn_caches*", "tensor*",
                                                   "gdn_layer_params*")),
    "fw_gdn_layer_replay": ("status", ("tensor*",) * 7 + ("gdn_batch*", "gdn_caches*",
                                                          "gdn_replay*", "tensor*",
                                                          "gdn_layer_params*")),
    "fw_gdn_replay_record_dim": ("int64", ("int64",) * 4 + ("int",)),
    "fw_gdn_replay_floats": ("size", ("int64",) * 5),
    "fw_kda_replay_floats": ("size", ("int64",) * 5),
    "fw_gdn_verify": ("status", ("tensor*",) * 5 + ("ptr", "int64", "ptr", "int64", "ptr",
                                                    "ptr", "size", "tensor*", "gdn_params*")),
    "fw_gdn_commit": ("status", ("ptr", "int64", "ptr", "int64", "int64", "int64", "int64",
                                 "ptr", "int64", "ptr", "ptr", "size", "gdn_params*")),
    "fw_conv1d_params_init": ("void", ("conv1d_params*",)),
    "fw_conv1d_fwd": ("status", ("tensor*",) * 3 + ("ptr", "int64", "conv1d_state*",
                                                    "conv1d_state*", "tensor*", "tensor*",
                                                    "conv1d_params*")),
    "fw_set_spin_us": ("status", ("int32",)),
    "fw_get_spin_us": ("int32", ()),
    "fw_set_parallel": ("status", ("ptr", "ptr", "int32")),
    "fw_get_parallel": ("status", ("ptr*", "ptr*", "int32*")),
    "fw_peak_gflops": ("status", ("str", "int32", "double", "double*")),
    "fw_peak_bf16_gflops": ("status", ("str", "int32", "double", "double*")),
    "fw_read_bandwidth": ("status", ("int32", "size", "double*")),
}


# ------------------------------------------------------------------------------- the calls

# options shared by the softmax attention ops (flash-attn's, with window_size as two ints)
_ATTN_OPTIONS = (
    Arg("softmax_scale", "float?", None, dtype="default d^-1/2"),
    Arg("causal", "bool", False),
    Arg("window_size_left", "SymInt", -1, into="window_size"),
    Arg("window_size_right", "SymInt", -1, into="window_size"),
    Arg("softcap", "float", 0.0),
)
_LSE_FLAG = Arg("return_softmax_lse", "bool", False)
_PRECISION = Arg("precision", "str?", None, dtype='None, "auto", "f32" or "bf16"')
# attention sinks (gpt-oss; vLLM's flash-attn calls them s_aux): one logit per query head
_SINKS = Arg("sinks", "Tensor?", None, shape="[hq]", dtype=FLOAT + " (other floating dtypes "
             "as float32)")

_VARLEN = (
    Arg("cu_seqlens_q", "Tensor", shape="[batch + 1]", dtype=INDEX),
    Arg("cu_seqlens_k", "Tensor", shape="[batch + 1]", dtype=INDEX),
    Arg("max_seqlen_q", "SymInt"),
    Arg("max_seqlen_k", "SymInt"),
)

_QKV = (
    Arg("q", "Tensor", shape="[B, T, H, K]", dtype=FLOAT),
    Arg("k", "Tensor", shape="[B, T, H, K]", dtype=FLOAT),
    Arg("v", "Tensor", shape="[B, T, HV, V]", dtype=FLOAT),
)
_GATES = (
    Arg("g", "Tensor", shape="[B, T, HV] (KDA: [B, T, HV, K])", dtype=FLOAT),
    Arg("beta", "Tensor", shape="[B, T, HV]", dtype=FLOAT),
)
_PREFILL_OUTPUTS = (
    Out("out", "tuple(v.shape)", "v"),
    Out("final_state", "(cu_seqlens.shape[0] - 1 if cu_seqlens is not None else v.shape[0], "
                       "v.shape[2], q.shape[-1], v.shape[-1])", "float32",
        wanted_by="output_final_state"),
)
_GATE_IN_KERNEL = (
    Arg("use_gate_in_kernel", "bool", False),
    Arg("A_log", "Tensor?", None, shape="[HV]", dtype=F32),
    Arg("dt_bias", "Tensor?", None, shape="[HV] (KDA: [HV * K])", dtype=F32),
)

# the serving layer's arguments up to the gate (fused_conv1d_gdn; KDA's g replaces a)
_LAYER_HEAD = (
    Arg("qkv", "Tensor", shape="[T, 2 n_kq d_k + n_v d_v]", dtype=FLOAT),
    Arg("b", "Tensor", shape="[T, n_v]", dtype=FLOAT),
)
_LAYER_TAIL = (
    Arg("conv_state", "Tensor", shape="[slots, kernel_size - 1, dim]", dtype=FLOAT),
    Arg("recurrent_state", "Tensor", shape="[slots, n_v, d_k, d_v]", dtype=STATE),
    Arg("conv_weight", "Tensor", shape="[dim, 1, kernel_size] or [dim, kernel_size]",
        dtype=FLOAT),
    Arg("conv_bias", "Tensor?", shape="[dim]", dtype=FLOAT),
    Arg("a_log", "Tensor", shape="[n_v]", dtype=F32),
    Arg("dt_bias", "Tensor", shape="[n_v]", dtype=F32),
    Arg("query_start_loc", "Tensor", shape="[num_seqs + 1]", dtype=INDEX),
    Arg("state_indices", "Tensor", shape="[num_seqs]", dtype=INDEX),
    Arg("distribution", "Tensor", shape="[3]: decode_end, prefill_end, mixed_end",
        dtype=INDEX),
    Arg("seq_lens", "Tensor", shape="[num_seqs]", dtype=INDEX),
    Arg("read_state_indices", "Tensor", shape="[num_seqs]", dtype=INDEX),
    Arg("n_kq", "SymInt"),
    Arg("n_v", "SymInt"),
    Arg("d_k", "SymInt"),
    Arg("d_v", "SymInt"),
    Arg("kernel_size", "SymInt"),
    Arg("zero_initialize_out", "bool", True),
)
_LAYER_OUTPUT = (Out("out", "(qkv.shape[0], n_v * d_v)", "qkv"),)

CALLS = (
    # ------------------------------------------------------------------ softmax attention
    Call("flash_attn_func", "attention", c=("fw_attn_fwd",),
         fast=Fast("attn_func",
                   ("q", "k", "v", "softmax_scale", "causal", "window_size", "softcap",
                    THREADS, "out", "want_lse", "sinks"),
                   when=(is_none("isa"), is_false("plain"), is_none("precision"),
                         is_false("rotary")),
                   c=("fw_attn_fwd", "fw_attn_params_init")),
         op=True, result="wanted", out_after="v", backward="flash_attn_backward",
         args=(Arg("q", "Tensor", shape="[b, sq, hq, d]", dtype=FLOAT),
               Arg("k", "Tensor", shape="[b, sk, hkv, d]", dtype=FLOAT),
               Arg("v", "Tensor", shape="[b, sk, hkv, dv]", dtype=FLOAT))
         + _ATTN_OPTIONS + (_LSE_FLAG, _PRECISION, _SINKS),
         outputs=(Out("out", "(*q.shape[:3], v.shape[-1])", "q"),
                  Out("lse", "(q.shape[0], q.shape[2], q.shape[1])", "float32",
                      wanted_by="return_softmax_lse"))),
    Call("flash_attn_varlen_func", "attention", c=("fw_attn_varlen_fwd",),
         fast=Fast("attn_varlen",
                   ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                    "max_seqlen_k", "softmax_scale", "causal", "window_size", "softcap",
                    THREADS, "out", "want_lse", "sinks"),
                   when=(is_none("isa"), is_none("precision"), is_false("rotary")),
                   c=("fw_attn_varlen_fwd", "fw_attn_params_init")),
         op=True, result="wanted", out_after="max_seqlen_k",
         backward="flash_attn_varlen_backward",
         args=(Arg("q", "Tensor", shape="[total_q, hq, d]", dtype=FLOAT),
               Arg("k", "Tensor", shape="[total_k, hkv, d]", dtype=FLOAT),
               Arg("v", "Tensor", shape="[total_k, hkv, dv]", dtype=FLOAT))
         + _VARLEN + _ATTN_OPTIONS + (_LSE_FLAG, _PRECISION, _SINKS),
         outputs=(Out("out", "(*q.shape[:2], v.shape[-1])", "q"),
                  Out("lse", "(q.shape[1], q.shape[0])", "float32",
                      wanted_by="return_softmax_lse"))),
    Call("flash_attn_backward", "attention", c=("fw_attn_bwd",), op=True, result="all",
         args=(Arg("dout", "Tensor", shape="[b, sq, hq, dv]", dtype=FLOAT),
               Arg("q", "Tensor", shape="[b, sq, hq, d]", dtype=FLOAT),
               Arg("k", "Tensor", shape="[b, sk, hkv, d]", dtype=FLOAT),
               Arg("v", "Tensor", shape="[b, sk, hkv, dv]", dtype=FLOAT),
               Arg("out", "Tensor", shape="[b, sq, hq, dv]", dtype=FLOAT),
               Arg("softmax_lse", "Tensor", shape="[b, hq, sq]", dtype=F32))
         + _ATTN_OPTIONS + (_PRECISION, _SINKS),
         outputs=(Out("dq", "tuple(q.shape)", "q"), Out("dk", "tuple(k.shape)", "k"),
                  Out("dv", "tuple(v.shape)", "v"))),
    Call("flash_attn_varlen_backward", "attention", c=("fw_attn_varlen_bwd",), op=True,
         result="all",
         args=(Arg("dout", "Tensor", shape="[total_q, hq, dv]", dtype=FLOAT),
               Arg("q", "Tensor", shape="[total_q, hq, d]", dtype=FLOAT),
               Arg("k", "Tensor", shape="[total_k, hkv, d]", dtype=FLOAT),
               Arg("v", "Tensor", shape="[total_k, hkv, dv]", dtype=FLOAT),
               Arg("out", "Tensor", shape="[total_q, hq, dv]", dtype=FLOAT),
               Arg("softmax_lse", "Tensor", shape="[hq, total_q]", dtype=F32))
         + _VARLEN + _ATTN_OPTIONS + (_PRECISION, _SINKS),
         outputs=(Out("dq", "tuple(q.shape)", "q"), Out("dk", "tuple(k.shape)", "k"),
                  Out("dv", "tuple(v.shape)", "v"))),
    Call("flash_attn_with_kvcache", "attention", c=("fw_attn_kvcache_fwd",),
         fast=Fast("attn_kvcache",
                   ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table",
                    "softmax_scale", "causal", "window_size", "softcap", THREADS, "out",
                    "layout", "sinks"),
                   when=(is_false("return_softmax_lse"), is_none("cu_seqlens_q"),
                         is_none("isa"), is_none("precision"), is_none("rotary_cos"),
                         is_none("rotary_sin"), is_none("cache_leftpad"),
                         is_none("cache_batch_idx"), is_none("k_descale"),
                         is_none("v_descale")),
                   c=("fw_attn_kvcache_fwd", "fw_attn_params_init")),
         op=True, result="wanted", out_after="v_cache", mutates=("k_cache", "v_cache"),
         args=(Arg("q", "Tensor", shape="[b, sq, hq, d] or packed [total_q, hq, d]",
                   dtype=FLOAT),
               Arg("k_cache", "Tensor",
                   shape="[b, S, hkv, d] or paged [num_blocks, page_size, hkv, d]",
                   dtype=FLOAT + ", written where k is given"),
               Arg("v_cache", "Tensor", shape="as k_cache, with dv",
                   dtype=FLOAT + ", written where v is given"),
               Arg("k", "Tensor?", None, shape="[b, sq, hkv, d] (packed [total_q, hkv, d])",
                   dtype=FLOAT),
               Arg("v", "Tensor?", None, shape="[b, sq, hkv, dv] (packed [total_q, hkv, dv])",
                   dtype=FLOAT),
               Arg("cache_seqlens", "Tensor?", None, shape="[b]", dtype=INDEX),
               Arg("block_table", "Tensor?", None, shape="[b, max_pages]", dtype=INDEX))
         + _ATTN_OPTIONS
         + (_LSE_FLAG,
            Arg("cu_seqlens_q", "Tensor?", None, shape="[b + 1]", dtype=INDEX),
            _PRECISION,
            Arg("rotary_cos", "Tensor?", None, shape="[seqlen_ro, rotary_dim / 2]",
                dtype=FLOAT),
            Arg("rotary_sin", "Tensor?", None, shape="[seqlen_ro, rotary_dim / 2]",
                dtype=FLOAT),
            Arg("rotary_interleaved", "bool", True),
            Arg("cache_leftpad", "Tensor?", None, shape="[b]", dtype=INDEX),
            Arg("cache_batch_idx", "Tensor?", None, shape="[b]", dtype=INDEX),
            Arg("cache_layout", "str", "rows", dtype='"rows" or "tiles"'),
            _SINKS,
            Arg("k_descale", "Tensor?", None, shape="scalar or [b, hkv]",
                dtype=F32 + " (any float dtype is converted), with fp8 caches"),
            Arg("v_descale", "Tensor?", None, shape="scalar or [b, hkv]",
                dtype=F32 + " (any float dtype is converted), with fp8 caches")),
         outputs=(Out("out", "(*q.shape[:-1], v_cache.shape[-1])", "q"),
                  Out("lse", "(q.shape[1], q.shape[0]) if cu_seqlens_q is not None else "
                             "(q.shape[0], q.shape[2], q.shape[1])", "float32",
                      wanted_by="return_softmax_lse"))),
    # ------------------------------------------------------------------- MLA (FlashMLA's)
    Call("flash_mla_with_kvcache", "mla", c=("fw_attn_kvcache_fwd",),
         exported=("flywheel", "flywheel.mla"), op=True, result="all",
         out_after="head_dim_v", mutates=("k_cache",),
         args=(Arg("q", "Tensor", shape="[b, sq, hq, d_qk]", dtype=FLOAT),
               Arg("k_cache", "Tensor", shape="[num_pages, page_size, 1, d_qk]",
                   dtype=FLOAT + " (or float8 with k_descale), written where k_new is given"),
               Arg("block_table", "Tensor", shape="[b, max_pages]", dtype=INDEX),
               Arg("cache_seqlens", "Tensor", shape="[b]", dtype=INDEX),
               Arg("head_dim_v", "SymInt"),
               Arg("softmax_scale", "float?", None, dtype="default d_qk^-1/2"),
               Arg("causal", "bool", False),
               Arg("k_new", "Tensor?", None, shape="[b, sq, 1, d_qk]", dtype=FLOAT),
               _PRECISION,
               Arg("k_descale", "Tensor?", None, shape="scalar or [b, 1]",
                   dtype=F32 + " (any float dtype is converted), with an fp8 k_cache")),
         outputs=(Out("out", "(*q.shape[:-1], head_dim_v)", "q"),
                  Out("lse", "(q.shape[0], q.shape[2], q.shape[1])", "float32"))),
    Call("get_mla_metadata", "mla", exported=("flywheel", "flywheel.mla")),
    # -------------------------------------------------------------------- Gated DeltaNet
    Call("chunk_gated_delta_rule", "gated_delta", c=("fw_gdn_prefill",), op=True,
         result="all", out_after="beta",
         args=_QKV + _GATES
         + (Arg("scale", "float?", None, dtype="default K^-1/2"),
            Arg("initial_state", "Tensor?", None, shape="[N, HV, K, V]", dtype=FLOAT),
            Arg("output_final_state", "bool", False),
            Arg("use_qk_l2norm_in_kernel", "bool", False),
            Arg("use_beta_sigmoid_in_kernel", "bool", False),
            Arg("allow_neg_eigval", "bool", False),
            Arg("cu_seqlens", "Tensor?", None, shape="[N + 1]", dtype=INDEX))
         + _GATE_IN_KERNEL
         + (Arg("inverse", "str", "blocked"), _PRECISION),
         outputs=_PREFILL_OUTPUTS),
    Call("fused_recurrent_gated_delta_rule", "gated_delta", c=("fw_gdn_prefill",), op=True,
         result="all", out_after="beta",
         args=_QKV + _GATES
         + (Arg("scale", "float?", None, dtype="default K^-1/2"),
            Arg("initial_state", "Tensor?", None, shape="[N, HV, K, V]", dtype=FLOAT),
            Arg("output_final_state", "bool", False),
            Arg("use_qk_l2norm_in_kernel", "bool", False))
         + _GATE_IN_KERNEL
         + (Arg("use_beta_sigmoid_in_kernel", "bool", False),
            Arg("allow_neg_eigval", "bool", False),
            Arg("cu_seqlens", "Tensor?", None, shape="[N + 1]", dtype=INDEX)),
         outputs=_PREFILL_OUTPUTS),
    Call("gated_delta_rule_decode", "gated_delta", c=("fw_gdn_decode", "fw_gdn_decode_pool"),
         fast=Fast("gdn_decode",
                   ("q", "k", "v", "g", "beta", "state", "state_indices", "scale",
                    "use_qk_l2norm_in_kernel", THREADS, "out"),
                   when=(is_none("isa"), is_none("l2norm_eps"), is_none("read_state_indices"),
                         is_false("use_gate_in_kernel"), is_false("use_beta_sigmoid_in_kernel"),
                         is_none("lower_bound")),
                   c=("fw_gdn_decode", "fw_gdn_decode_pool", "fw_gdn_params_init")),
         op=True, out_after="state", mutates=("state",),
         args=(Arg("q", "Tensor", shape="[N, H, K] or [N, 1, H, K]", dtype=FLOAT),
               Arg("k", "Tensor", shape="[N, H, K] or [N, 1, H, K]", dtype=FLOAT),
               Arg("v", "Tensor", shape="[N, HV, V] or [N, 1, HV, V]", dtype=FLOAT),
               Arg("g", "Tensor", shape="[N, HV] or [N, 1, HV] (KDA: [N, HV, K])",
                   dtype=FLOAT),
               Arg("beta", "Tensor", shape="[N, HV] or [N, 1, HV]", dtype=FLOAT),
               Arg("state", "Tensor", shape="[slots, HV, K, V]", dtype=STATE),
               Arg("state_indices", "Tensor?", None, shape="[N]", dtype=INDEX),
               Arg("scale", "float?", None, dtype="default K^-1/2"),
               Arg("use_qk_l2norm_in_kernel", "bool", False)),
         outputs=(Out("out", "tuple(v.shape)", "v"),)),
    Call("gated_delta_rule_verify", "gated_delta",
         c=("fw_gdn_verify", "fw_gdn_replay_floats", "fw_kda_replay_floats"),
         op=True, result="all", out_after="state",
         args=_QKV + _GATES
         + (Arg("state", "Tensor", shape="[slots, HV, K, V]", dtype=F32 + ", read only"),
            Arg("state_indices", "Tensor?", None, shape="[N]", dtype=INDEX),
            Arg("cu_seqlens", "Tensor?", None, shape="[N + 1]", dtype=INDEX),
            Arg("scale", "float?", None, dtype="default K^-1/2"),
            Arg("use_qk_l2norm_in_kernel", "bool", False),
            _PRECISION),
         outputs=(Out("out", "tuple(v.shape)", "v"),
                  Out("replay", "(replay_floats(v.shape[0] * v.shape[1], q.shape[2], "
                                "v.shape[2], q.shape[3], v.shape[3], g.dim() == 4),)",
                      "float32", buffer=True))),
    Call("gated_delta_rule_commit", "gated_delta", c=("fw_gdn_commit",), op=True,
         mutates=("state",), adapter="gated_delta_rule_commit",
         args=(Arg("replay", "Tensor", shape="[replay_floats(...)]",
                   dtype=F32 + ": gated_delta_rule_verify's replay"),
               Arg("accepted", "Tensor", shape="[N]", dtype=INDEX),
               Arg("state", "Tensor", shape="[slots, HV, K, V]", dtype=STATE),
               Arg("cu_seqlens", "Tensor", shape="[N + 1]", dtype=INDEX),
               Arg("num_heads", "SymInt"),
               Arg("state_indices", "Tensor?", None, shape="[N]", dtype=INDEX))),
    Call("gated_delta_rule_prefill", "gated_delta",
         c=("fw_gdn_prefill", "fw_gdn_prefill_pool")),
    # ------------------------------------------------------------------------------- KDA
    Call("chunk_kda", "kda", c=("fw_gdn_prefill",), exported=("flywheel", "flywheel.fla"),
         op=True, result="all",
         args=_QKV
         + (Arg("g", "Tensor", shape="[B, T, HV, K]", dtype=FLOAT),
            Arg("beta", "Tensor", shape="[B, T, HV]", dtype=FLOAT),
            Arg("scale", "float?", None, dtype="default K^-1/2"),
            Arg("initial_state", "Tensor?", None, shape="[N, HV, K, V]", dtype=FLOAT),
            Arg("output_final_state", "bool", False),
            Arg("use_qk_l2norm_in_kernel", "bool", False))
         + _GATE_IN_KERNEL
         + (Arg("use_beta_sigmoid_in_kernel", "bool", False),
            Arg("safe_gate", "bool", False),
            Arg("lower_bound", "float?", None),
            Arg("cu_seqlens", "Tensor?", None, shape="[N + 1]", dtype=INDEX)),
         outputs=_PREFILL_OUTPUTS),
    Call("fused_recurrent_kda", "kda", c=("fw_gdn_prefill",),
         exported=("flywheel", "flywheel.fla")),
    # ------------------------------------------------------------------------ causal conv1d
    Call("causal_conv1d_fn", "conv", c=("fw_conv1d_fwd",), op=True, out_after="weight",
         args=(Arg("x", "Tensor", shape="[batch, dim, seqlen]", dtype=FLOAT),
               Arg("weight", "Tensor", shape="[dim, width]", dtype=FLOAT),
               Arg("bias", "Tensor?", None, shape="[dim]", dtype=FLOAT),
               Arg("initial_states", "Tensor?", None, shape="[batch, dim, width - 1]",
                   dtype=FLOAT),
               Arg("activation", "str?", None, dtype='None, "silu" or "swish"')),
         outputs=(Out("out", like="x"),)),
    Call("causal_conv1d_update", "conv", c=("fw_conv1d_fwd",),
         fast=Fast("conv_update",
                   ("x", "conv_state", "weight", "bias", "activation", "cache_seqlens",
                    "conv_state_indices", THREADS, "out"),
                   when=(is_none("isa"),),
                   c=("fw_conv1d_fwd", "fw_conv1d_params_init")),
         op=True, out_after="weight", mutates=("conv_state",),
         args=(Arg("x", "Tensor", shape="[batch, dim] or [batch, dim, seqlen]", dtype=FLOAT),
               Arg("conv_state", "Tensor", shape="[batch or slots, dim, state_len]",
                   dtype=FLOAT + ", updated in place"),
               Arg("weight", "Tensor", shape="[dim, width]", dtype=FLOAT),
               Arg("bias", "Tensor?", None, shape="[dim]", dtype=FLOAT),
               Arg("activation", "str?", None, dtype='None, "silu" or "swish"'),
               Arg("cache_seqlens", "Tensor?", None, shape="[batch]", dtype=INDEX),
               Arg("conv_state_indices", "Tensor?", None, shape="[batch]", dtype=INDEX)),
         outputs=(Out("out", "tuple(x.shape)", "x"),)),
    Call("causal_conv1d", "fla", c=("fw_conv1d_fwd",), exported=("flywheel.fla",)),
    Call("causal_conv1d_update", "fla", c=("fw_conv1d_fwd",), exported=("flywheel.fla",)),
    # ------------------------------------------------------------ the serving-layer calls
    Call("fused_conv1d_gdn", "layers", c=("fw_gdn_layer",),
         exported=("flywheel", "flywheel.tpu"),
         fast=Fast("gdn_layer",
                   ("qkv", "b", "a", "conv_state", "recurrent_state", "conv_weight",
                    "conv_bias", "a_log", "dt_bias", "query_start_loc", "state_indices",
                    "distribution", "seq_lens", "read_state_indices", "n_kq", "n_v", "d_k",
                    "d_v", "kernel_size", "l2norm_eps", "zero_initialize_out", THREADS,
                    "out"),
                   when=(is_given("out"), is_none("isa"), is_none("precision"),
                         is_false("num_spec_tokens")),
                   c=("fw_gdn_layer", "fw_gdn_layer_params_init")),
         op=True, result="second", out_after="read_state_indices",
         mutates=("conv_state", "recurrent_state"),
         args=_LAYER_HEAD + (Arg("a", "Tensor", shape="[T, n_v]", dtype=FLOAT),)
         + _LAYER_TAIL,
         outputs=_LAYER_OUTPUT),
    Call("fused_conv1d_kda", "layers", c=("fw_gdn_layer",),
         exported=("flywheel", "flywheel.tpu"), op=True, result="second",
         mutates=("conv_state", "recurrent_state"),
         args=_LAYER_HEAD + (Arg("g", "Tensor", shape="[T, n_v d_k]", dtype=FLOAT),)
         + _LAYER_TAIL
         + (Arg("lower_bound", "float?", None), Arg("beta_is_activated", "bool", False)),
         outputs=_LAYER_OUTPUT),
    Call("fused_conv1d_gdn_replay", "layers", c=("fw_gdn_layer_replay",),
         exported=("flywheel", "flywheel.tpu")),
    Call("fused_conv1d_kda_replay", "layers", c=("fw_gdn_layer_replay",),
         exported=("flywheel", "flywheel.tpu")),
    Call("replay_record_dim", "layers", c=("fw_gdn_replay_record_dim",)),
    Call("kda_replay_record_dim", "layers", c=("fw_gdn_replay_record_dim",)),
    Call("next_replay_lens", "layers", exported=("flywheel", "flywheel.tpu")),
    # ------------------------------------------ the original FlyWheel package's attention
    Call("flash_attn_func", "tpu", c=("fw_attn_fwd",), exported=("flywheel.tpu",)),
    Call("flash_attn_varlen_func", "tpu", c=("fw_attn_varlen_fwd", "fw_attn_kvcache_fwd"),
         exported=("flywheel.tpu",)),
    Call("flash_attn_with_kvcache", "tpu", c=("fw_attn_kvcache_fwd",),
         exported=("flywheel.tpu",)),
)

OPS = {c.name: c for c in CALLS if c.op}  # the calls registered as torch ops, by name
FAST = {c.name: c for c in CALLS if c.fast is not None}  # the calls with a fast path


def fast_symbols():
    """The library functions the compiled fast path calls, each once, in description order."""
    return tuple(dict.fromkeys(s for c in FAST.values() for s in c.fast.c))
