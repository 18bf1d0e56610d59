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

Every op, its schema and its fake kernel come from the calls' description, _calls.py (one
entry per call: arguments with their schema types, defaults, shapes and dtypes; outputs with
their shapes; the arguments written in place, `Tensor(a!)` in the schema; `SymInt` is how
torch spells an int argument). torch.ops.flywheel.<name>.default._schema prints one.

Out variants `<name>_out`, for engines that reuse buffers (every call whose description sets
out_after): the op's arguments up to out_after, then its outputs (written in place), then
the rest of its options, less the flags that ask for an output (return_softmax_lse,
output_final_state: the output given = wanted, and then optional); they return nothing (a
custom op may not return an alias of an input, and torch 2.4's custom ops take no
keyword-only tensors). The first output is written by the library directly (the call's
out=); the others (lse, final_state, replay) are computed as by the op and copied in (they
are small). gated_delta_rule_commit has no out variant: it returns nothing and already writes
`state`; the KDA ops have none either.

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
    varlen ops (their Python calls take them; the cache ops take flash-attn's), and s_aux
    (the attention ops take it by its other name, sinks).
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
    formula calls the ops flash_attn_backward / flash_attn_varlen_backward (the description's
    `backward`), from the saved q, k, v, out and lse. The gradient of sinks (the attention
    sinks, where they require grad) is the library's formula in torch ops,
    -sum_rows exp(sinks - lse) x sum(dout o out) (the backward ops return dq, dk, dv only).
    Without return_softmax_lse the forward did not compute lse, and the backward runs the
    forward once more for it: pass return_softmax_lse=True when training. The other
    functional ops register a formula whose backward raises NotImplementedError ("... is
    forward-only"); torch takes no formula for ops that write in place, so a backward through
    those raises torch's RuntimeError ("no autograd formula was registered"). The forward
    itself runs with inputs that require grad (inside the op grad mode is off, so the Python
    calls' requires-grad check does not fire).
  * CPU tensors only (device_types="cpu"); numpy arrays are for the Python calls.
"""

import importlib

import torch

from . import _calls
from . import _tensors as _T
from . import gated_delta as _gdn

NAMESPACE = "flywheel"

__all__ = ["NAMESPACE", "OPS", "gdn_replay_floats"]

gdn_replay_floats = _calls.replay_floats


def _no_output(ref):
    """The placeholder of an output that was not asked for: an empty float32 tensor."""
    return ref.new_empty((0,), dtype=torch.float32)


# ------------------------------------------------------------------ schemas from the description

def _default(value):
    """A default value as a schema spells it."""
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _schema(args, outputs, written):
    """The schema string of an op taking `args` (_calls.Arg) and returning `outputs` (how many
    tensors), the arguments named in `written` annotated as written in place (alias sets
    named as torch.library.infer_schema names them: a<position>)."""
    parts = []
    for i, a in enumerate(args):
        kind = a.type.replace("Tensor", f"Tensor(a{i}!)", 1) if a.name in written else a.type
        parts.append(f"{kind} {a.name}" + ("" if a.default is _calls.REQUIRED
                                          else "=" + _default(a.default)))
    returns = "()" if outputs == 0 else "Tensor" if outputs == 1 else \
        "(" + ", ".join(["Tensor"] * outputs) + ")"
    return f"({', '.join(parts)}) -> {returns}"


def _function(name, args, body):
    """A Python function `name` with the parameters of `args` (their defaults too) whose
    body is body(<its arguments as a dict by name>); custom_op calls kernels and fakes with
    the op's arguments, positionally or by name."""
    names = [a.name for a in args]
    defaults = [a.default for a in args if a.default is not _calls.REQUIRED]
    scope = {"_body": body}
    exec(f"def {name}({', '.join(names)}):\n    return _body(locals())\n", scope)
    fn = scope[name]
    fn.__defaults__ = tuple(defaults) or None
    return fn


# ----------------------------------------------------------------- kernels from the description

def _python_kwargs(args, values):
    """The Python call's keyword arguments from the op's: each argument under its name, or
    packed with the others of the same `into` into a tuple under that name."""
    kw = {}
    for a in args:
        if a.into is None:
            kw[a.name] = values[a.name]
        else:
            kw[a.into] = kw.get(a.into, ()) + (values[a.name],)
    return kw


def _results(call, r, kw):
    """The op's outputs (a list, in the description's order) from the Python call's result r,
    which it returned as call.result says; kw: the keywords it was called with."""
    outs = call.outputs
    if call.result == "one":
        got = [r]
    elif call.result == "second":
        got = [r[1]]
    elif call.result == "wanted":
        got = list(r) if kw[outs[1].wanted_by] else [r, None]
    else:
        got = list(r)
    return [torch.from_numpy(x.buffer) if o.buffer and x is not None else x
            for o, x in zip(outs, got)]


def _returned(outs):
    return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def _first_tensor(call, values):
    return values[next(a.name for a in call.args if a.type == "Tensor")]


def _kernel(call, fn):
    """The functional op's CPU kernel: the Python call, outputs that were not asked for
    replaced by empty placeholders; an output allocated `like` an argument is passed as out=
    and returned."""
    def body(values):
        kw = _python_kwargs(call.args, values)
        given = [torch.empty_like(values[o.like]) for o in call.outputs if o.like]
        if given:
            kw["out"] = given[0]
        got = _results(call, fn(**kw), kw)
        outs = given or got
        ref = _first_tensor(call, values)
        return _returned([_no_output(ref) if x is None else x for x in outs])
    return body


def _out_kernel(call, fn):
    """The out form's CPU kernel: the Python call with out= the first output and the flags of
    the others set where they are given; those are then copied in."""
    flags = {o.wanted_by for o in call.outputs if o.wanted_by}
    options = [a for a in call.args if a.name not in flags]

    def body(values):
        kw = _python_kwargs(options, values)
        for o in call.outputs[1:]:
            if o.wanted_by:
                kw[o.wanted_by] = values[o.name] is not None
        kw["out"] = values[call.outputs[0].name]
        got = _results(call, fn(**kw), kw)
        for o, x in zip(call.outputs[1:], got[1:]):
            if values[o.name] is not None:
                values[o.name].copy_(x)
    return body


def _fake(call):
    """The functional op's fake kernel: each output's shape and dtype as described."""
    shapes = [compile(o.shape, f"<{call.name}: {o.name}>", "eval") if o.shape else None
              for o in call.outputs]
    helpers = {"replay_floats": _calls.replay_floats}

    def body(values):
        ref, outs = _first_tensor(call, values), []
        for o, shape in zip(call.outputs, shapes):
            if o.like:
                outs.append(torch.empty_like(values[o.like]))
            elif o.wanted_by and not values[o.wanted_by]:
                outs.append(_no_output(ref))
            elif o.dtype == "float32":
                outs.append(ref.new_empty(eval(shape, helpers, values), dtype=torch.float32))
            else:
                outs.append(values[o.dtype].new_empty(eval(shape, helpers, values)))
        return _returned(outs)
    return body


def _out_args(call):
    """The out form's arguments: the op's up to out_after, its outputs (optional where a flag
    asks for them; the flags dropped), the rest."""
    flags = {o.wanted_by for o in call.outputs if o.wanted_by}
    cut = [a.name for a in call.args].index(call.out_after) + 1
    outs = tuple(_calls.Arg(o.name, "Tensor?", None) if o.wanted_by
                 else _calls.Arg(o.name, "Tensor") for o in call.outputs)
    return call.args[:cut] + outs + tuple(a for a in call.args[cut:] if a.name not in flags)


# -------------------------------------------------------------------- hand-written adapters

def _gated_delta_rule_commit(replay, accepted, state, cu_seqlens, num_heads, state_indices=None):
    """gated_delta_rule_commit on a GDNReplay rebuilt from verify's replay buffer and what a
    tensor cannot carry (cu_seqlens, num_heads, state_indices; HV, K, V from state)."""
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


_ADAPTERS = {"gated_delta_rule_commit": _gated_delta_rule_commit}


# ------------------------------------------------------------------------------------ autograd

def _no_backward(name):
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{NAMESPACE}::{name} is forward-only: flywheel has no backward kernels (run it "
            "under torch.no_grad() or torch.inference_mode(), or pass detached inputs)")
    return backward


# The attention ops' autograd: the backward ops, from the saved q, k, v, out and lse. An lse
# that was not asked for (return_softmax_lse=False: an empty [0] placeholder) is recomputed
# by running the forward again; ask for it when training to save that.
def _attn_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output)
    ctx.options = inputs[3:]


def _attn_lse(name, q, k, v, out, lse, args):
    if lse.dim() != 1:
        return out, lse
    fwd = getattr(torch.ops, NAMESPACE).__getattr__(name)
    return fwd(q, k, v, *args)


def _attn_grads(ctx, grads, sinks, dout, out, lse):
    """The gradients of every input of an attention op: dq, dk, dv, None for the options, and
    that of sinks (its last input) where it is wanted, by the library's formula
    dsinks[h] = -sum over the rows of exp(sinks[h] - lse) x sum(dout o out), from lse
    [b, hq, sq] or [hq, total_q] (torch ops, so that torch.compile traces it)."""
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[2 + len(ctx.options)]:
        D = (dout.float() * out.float()).sum(-1).transpose(-1, -2)  # laid out as lse
        rows = [i for i in range(lse.dim()) if i != lse.dim() - 2]
        dsinks = -(torch.exp(sinks.float()[:, None] - lse) * D).sum(rows).to(sinks.dtype)
    return tuple(grads) + (None,) * (len(ctx.options) - 1) + (dsinks,)


def _flash_attn_func_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    scale, causal, left, right, softcap, _, precision, sinks = ctx.options
    out, lse = _attn_lse("flash_attn_func", q, k, v, out, lse,
                         (scale, causal, left, right, softcap, True, precision, sinks))
    grads = getattr(torch.ops, NAMESPACE).flash_attn_backward(dout, q, k, v, out, lse, scale,
                                                              causal, left, right, softcap,
                                                              precision, sinks)
    return _attn_grads(ctx, grads, sinks, dout, out, lse)


def _flash_attn_varlen_func_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    (cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap, _, precision,
     sinks) = ctx.options
    out, lse = _attn_lse("flash_attn_varlen_func", q, k, v, out, lse,
                         (cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap, True,
                          precision, sinks))
    grads = getattr(torch.ops, NAMESPACE).flash_attn_varlen_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap,
        precision, sinks)
    return _attn_grads(ctx, grads, sinks, dout, out, lse)


# the autograd formula of each op a description's `backward` names
_FORMULAS = {"flash_attn_backward": _flash_attn_func_backward,
             "flash_attn_varlen_backward": _flash_attn_varlen_func_backward}


# -------------------------------------------------------------------------------- registration

def _forms():
    """(name, schema, kernel, fake, written, call) of every op: each described call's, and its
    out form's (never an adapter's: _calls.py)."""
    for call in _calls.OPS.values():
        fn = getattr(importlib.import_module(f"{__package__}.{call.module}"), call.name)
        kernel = _ADAPTERS[call.adapter] if call.adapter else \
            _function(call.name, call.args, _kernel(call, fn))
        fake = _function(call.name, call.args, _fake(call))
        yield (call.name, _schema(call.args, len(call.outputs), call.mutates), kernel, fake,
               call.mutates, call)
        if call.out_after is not None:
            args = _out_args(call)
            written = call.mutates + tuple(o.name for o in call.outputs)
            yield (call.name + "_out", _schema(args, 0, written),
                   _function(call.name + "_out", args, _out_kernel(call, fn)),
                   _function(call.name + "_out", args, lambda values: None), written, None)


_FORMS = tuple(_forms())
OPS = tuple(f[0] for f in _FORMS)  # the registered names: torch.ops.flywheel.<name>


def _registered(name):
    try:
        return hasattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False


def _register():
    for name, schema, kernel, fake, written, call in _FORMS:
        if _registered(name):  # imported before in this process: keep that registration
            continue
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", kernel, mutates_args=written,
                                     device_types="cpu", schema=schema)
        op.register_fake(fake)
        if call is not None and call.backward:
            op.register_autograd(_FORMULAS[call.backward], setup_context=_attn_setup)
        elif not written:  # torch takes autograd formulas for functional ops only
            op.register_autograd(_no_backward(name))


_register()
