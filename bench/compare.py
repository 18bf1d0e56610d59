"""`make compare`: flywheel side by side with its peers, in one process, on the same inputs.

Dense causal prefill and decode: PyTorch CPU SDPA (f32, bf16), JAX
jax.nn.dot_product_attention (XLA CPU; f32, bf16), ggml flash_attn_ext (ggml-python; K/V f16,
as llama.cpp's default cache). The attention backward (dq, dk, dv, causal): torch's SDPA
backward (autograd) against flash_attn_backward. Gated DeltaNet prefill and decode: ggml gated_delta_net and
fla's torch reference (naive_chunk_gated_delta_rule / naive_recurrent_gated_delta_rule). KDA
(a decay per key channel, Kimi Linear's shapes) prefill and decode: ggml gated_delta_net with
per-channel gates (g [dk, HV, T, n]) and fla's torch reference (naive_chunk_kda /
naive_recurrent_kda).
flywheel-tpu (the original FlyWheel, JAX Pallas) runs in interpret mode on small shapes beside
flywheel.tpu's same calls under jax.jit (flywheel's XLA FFI custom calls): both rows give their
max error against a float64 reference and their time (the original's interpret mode emulates
its TPU kernels: its time is what a CPU user of the original waits).

Every system gets the same input values: they are drawn once, rounded to bf16, and handed to
each system in its own layout and dtype outside the timed region. Timings are medians of
--reps runs after one warm-up. The diff column is the max |peer - flywheel| over the output,
against flywheel's f32 result.

FLOP formulas: attention 2 (d + dv) per visible (query, key) pair and query head, its
backward 2.5 x that;
Gated DeltaNet 2 (3 dk dv + 64 (3 dk + 2 dv) + 63 * 62 / 6) per token and value head
(the chunked pass's products as dense tiles, chunk 64), and the same for KDA (its exponentials
and decay products not counted). Decode: GB/s of K/V (attention) or of state read and written
(GDN, KDA).

Usage: python bench/compare.py [--out docs/compare] [--threads N] [--reps R] [--quick]
                                [--only attn-prefill,attn-decode,attn-backward,gdn-prefill,
                                        gdn-decode,kda-prefill,kda-decode,oracle]
"""

import argparse
import ctypes
import datetime
import importlib
import os
import platform
import statistics
import sys
import time
import traceback

import numpy as np

import flywheel
from flywheel import _lib

HQ, HKV, D = 32, 8, 128                 # make run's attention shape (Llama-3-8B-like GQA)
GH, GHV, GD = 16, 32, 128               # make run's GDN shape (Qwen3-Next)
KH, KHV, KD = 32, 32, 128               # KDA's (Kimi Linear)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def median_time(fn, reps):
    fn()  # warm-up (compiles JAX, touches memory)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bf16_values(rng, shape, scale=1.0):
    """float32 values exactly representable in bf16, so every dtype sees the same numbers."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


class Row:
    def __init__(self, op, system, dtype, size, seconds=None, value=None, unit="", diff=None,
                 note=""):
        self.op, self.system, self.dtype, self.size = op, system, dtype, size
        self.seconds, self.value, self.unit, self.diff, self.note = (seconds, value, unit, diff,
                                                                     note)


# ------------------------------------------------------------------------------ peers --

class Peers:
    """Imports each peer once; a peer that cannot be imported is recorded with the reason."""

    def __init__(self, threads):
        self.missing = {}
        self.threads = threads
        self.torch = self._load("torch", "torch", lambda m: m.set_num_threads(threads))
        self.jax = self._load("jax", "jax",
                              lambda m: m.config.update("jax_platforms", "cpu"))
        self.ggml = self._load("ggml", "ggml (ggml-python)")
        self.fla = self._load("fla.ops.gated_delta_rule.naive", "fla")
        self.fla_kda = self._load("fla.ops.kda.naive", "fla (KDA)")
        self.fwtpu = self._load("flywheel_tpu", "flywheel-tpu")
        if self.fwtpu is None and sys.version_info < (3, 12):
            self.missing["flywheel-tpu"] = ("not installed here: it needs Python >= 3.12 and "
                                            "jax >= 0.11")

    def _load(self, module, label, setup=None):
        try:
            m = importlib.import_module(module)
            if setup is not None:
                setup(m)
            return m
        except Exception as e:
            self.missing[label.split()[0]] = f"import {label} failed: {e}"
            return None


class GgmlGraph:
    """One ggml context holding input tensors, one op and its graph, computed on demand."""

    def __init__(self, ggml, mem_bytes):
        self.g = ggml
        params = ggml.ggml_init_params(mem_size=int(mem_bytes), mem_buffer=None, no_alloc=False)
        self.ctx = ggml.ggml_init(params)
        if not self.ctx:
            raise MemoryError("ggml_init failed")

    def tensor(self, gtype, ne, data=None):
        g = self.g
        t = g.ggml_new_tensor(self.ctx, gtype, len(ne), (ctypes.c_int64 * len(ne))(*ne))
        if data is not None:
            ctypes.memmove(g.ggml_get_data(t), data.ctypes.data, data.nbytes)
        return t

    def build(self, out):
        self.out = out
        self.graph = self.g.ggml_new_graph(self.ctx)
        self.g.ggml_build_forward_expand(self.graph, out)

    def compute(self, threads):
        self.g.ggml_graph_compute_with_ctx(self.ctx, self.graph, threads)

    def result(self, count):
        p = ctypes.cast(self.g.ggml_get_data(self.out), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(p, shape=(count,)).copy()

    def free(self):
        self.g.ggml_free(self.ctx)


def ggml_attention(ggml, q, k, v, causal, threads):
    """ggml_flash_attn_ext with f32 Q and f16 K/V; q [sq, hq, d], k/v [sk, hkv, d] numpy f32.
    Returns (run, result) closures."""
    sq, hq, d = q.shape
    sk, hkv, _ = k.shape
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    mask = None
    if causal:
        rows = (sq + 63) // 64 * 64
        i = np.arange(rows)[:, None] + sk - sq
        j = np.arange(sk)[None, :]
        mask = np.where(j <= i, 0.0, -np.inf).astype(np.float16)
    mem = q.nbytes * 2 + k16.nbytes + v16.nbytes + (mask.nbytes if mask is not None else 0)
    gg = GgmlGraph(ggml, mem + (256 << 20))
    tq = gg.tensor(ggml.GGML_TYPE_F32, [d, hq, sq], np.ascontiguousarray(q))
    tk = gg.tensor(ggml.GGML_TYPE_F16, [d, hkv, sk], np.ascontiguousarray(k16))
    tv = gg.tensor(ggml.GGML_TYPE_F16, [d, hkv, sk], np.ascontiguousarray(v16))
    tm = gg.tensor(ggml.GGML_TYPE_F16, [sk, mask.shape[0]], mask) if mask is not None else None
    pq = ggml.ggml_permute(gg.ctx, tq, 0, 2, 1, 3)  # [d, sq, hq]
    pk = ggml.ggml_permute(gg.ctx, tk, 0, 2, 1, 3)
    pv = ggml.ggml_permute(gg.ctx, tv, 0, 2, 1, 3)
    out = ggml.ggml_flash_attn_ext(gg.ctx, pq, pk, pv, tm, d ** -0.5, 0.0, 0.0)
    ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
    gg.build(out)  # result [dv, hq, sq]: the [sq, hq, dv] layout
    return (lambda: gg.compute(threads),
            lambda: gg.result(sq * hq * v.shape[-1]).reshape(sq, hq, -1), gg)


def ggml_gdn(ggml, q, k, v, g, beta, state, threads):
    """ggml_gated_delta_net over n_seqs sequences of n_tokens: q, k [n, t, HV, dk] (already
    l2-normalised and expanded to the value heads, since ggml maps heads by modulo),
    v [n, t, HV, dv], g [n, t, HV] (or KDA's [n, t, HV, dk]: ggml takes a gate per key channel
    from g's shape), beta [n, t, HV], state [n, HV, dk, dv] (fla layout; ggml holds each
    head's state transposed). ggml scales q by 1/sqrt(dv) itself. Its last argument (1) is the
    number of states the op keeps."""
    n, t, hv, dk = q.shape
    dv = v.shape[-1]
    gk = g.shape[3] if g.ndim == 4 else 1
    st = np.ascontiguousarray(state.transpose(0, 1, 3, 2))
    mem = q.nbytes * 2 + v.nbytes * 2 + st.nbytes * 2 + g.nbytes * 2
    gg = GgmlGraph(ggml, mem + (64 << 20))
    f32 = ggml.GGML_TYPE_F32
    tq = gg.tensor(f32, [dk, hv, t, n], np.ascontiguousarray(q))
    tk = gg.tensor(f32, [dk, hv, t, n], np.ascontiguousarray(k))
    tv = gg.tensor(f32, [dv, hv, t, n], np.ascontiguousarray(v))
    tg = gg.tensor(f32, [gk, hv, t, n], np.ascontiguousarray(g))
    tb = gg.tensor(f32, [1, hv, t, n], np.ascontiguousarray(beta))
    ts = gg.tensor(f32, [dv, dv, hv, n], st)
    out = ggml.ggml_gated_delta_net(gg.ctx, tq, tk, tv, tg, tb, ts, 1)
    gg.build(out)
    return (lambda: gg.compute(threads),
            lambda: gg.result(n * t * hv * dv).reshape(n, t, hv, dv), gg)


# ------------------------------------------------------------------------ benchmarks --

def attn_flop(sq, sk, causal):
    if not causal:
        pairs = sq * sk
    else:
        pairs = sum(min(sk, i + sk - sq + 1) for i in range(sq))
    return 2.0 * (D + D) * pairs * HQ


def run_peer(rows, op, system, dtype, size, fn, result, ref, reps, work, unit, note=""):
    """Time fn, compare result() with ref, and append a row; a failing peer gets a row that
    says why."""
    try:
        sec = median_time(fn, reps)
        out = np.asarray(result(), dtype=np.float64)
        diff = float(np.abs(out.reshape(ref.shape) - ref).max())
        rows.append(Row(op, system, dtype, size, sec, work / sec, unit, diff, note))
    except Exception as e:
        log(f"{system} {op} {size}: {e}")
        traceback.print_exc(file=sys.stderr)
        rows.append(Row(op, system, dtype, size, note=f"failed: {type(e).__name__}: {e}"))


def bench_attention(P, rows, op, size, q, k, v, causal, ours_fn, work, unit, reps):
    """flywheel (ours_fn) and the attention peers on q [1, sq, HQ, D], k/v [1, sk, HKV, D];
    work(bytes per element) is the FLOP or byte count of one call."""
    torch = P.torch
    ref = ours_fn(q, k, v)[0].astype(np.float64)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    for dt, es in (("float32", 4), ("bfloat16", 2)):
        a = [x.to(getattr(torch, dt)) for x in (tq, tk, tv)]
        box = {}

        def ours(a=a, box=box):
            box["o"] = ours_fn(*a)
        run_peer(rows, op, "flywheel", dt, size, ours, lambda box=box: box["o"][0].float().numpy(),
                 ref, reps, work(es), unit)
    for dt, es in (("float32", 4), ("bfloat16", 2)):
        a = [x.to(getattr(torch, dt)).transpose(1, 2).contiguous() for x in (tq, tk, tv)]
        box = {}

        def sdpa(a=a, box=box):
            box["o"] = torch.nn.functional.scaled_dot_product_attention(
                *a, is_causal=causal, enable_gqa=True)
        run_peer(rows, op, "torch SDPA", dt, size, sdpa,
                 lambda box=box: box["o"][0].transpose(0, 1).float().numpy(), ref, reps,
                 work(es), unit)
    if P.jax is not None:
        jax, jnp = P.jax, P.jax.numpy
        for dt, es in (("float32", 4), ("bfloat16", 2)):
            a = [jnp.asarray(x, dtype=getattr(jnp, dt)) for x in (q, k, v)]
            f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="xla"))
            box = {}

            def xla(a=a, f=f, box=box):
                box["o"] = f(*a).block_until_ready()
            run_peer(rows, op, "JAX XLA", dt, size, xla,
                     lambda box=box: np.asarray(box["o"][0].astype(jnp.float32)), ref, reps,
                     work(es), unit)
    if P.ggml is not None:
        try:
            run, res, gg = ggml_attention(P.ggml, q[0], k[0], v[0], causal, P.threads)
            run_peer(rows, op, "ggml flash_attn_ext", "f32 Q, f16 K/V", size, run, res, ref,
                     reps, work(2), unit)
            gg.free()
        except Exception as e:
            rows.append(Row(op, "ggml flash_attn_ext", "f32 Q, f16 K/V", size,
                            note=f"failed: {e}"))


def bench_prefill(P, rows, T, reps):
    rng = np.random.default_rng(T)
    q, k, v = (bf16_values(rng, (1, T, h, D)) for h in (HQ, HKV, HKV))
    flop = attn_flop(T, T, True)
    bench_attention(P, rows, "attn prefill", f"T={T}", q, k, v, True,
                    lambda q, k, v: flywheel.flash_attn_func(q, k, v, causal=True),
                    lambda es: flop, "GFLOP/s", reps)


def bench_decode(P, rows, L, reps):
    rng = np.random.default_rng(L + 1)
    q = bf16_values(rng, (1, 1, HQ, D))
    k, v = (bf16_values(rng, (1, L, HKV, D)) for _ in range(2))
    bench_attention(P, rows, "attn decode", f"ctx={L}", q, k, v, False,
                    lambda q, k, v: flywheel.flash_attn_with_kvcache(q, k, v, cache_seqlens=L),
                    lambda es: 2 * L * HKV * D * es, "GB/s K/V", reps)


def bench_attn_backward(P, rows, T, reps):
    """The backward alone (dq, dk, dv from dout and the forward's saved state): flywheel's
    flash_attn_backward (what its autograd calls) against torch's SDPA backward
    (torch.autograd.grad through scaled_dot_product_attention, retain_graph), causal T x T;
    FLOP 2.5 x the forward's. diff: max |peer - flywheel f32| over dq, dk, dv."""
    torch = P.torch
    rng = np.random.default_rng(T + 7)
    q, k, v = (bf16_values(rng, (1, T, h, D)) for h in (HQ, HKV, HKV))
    g = bf16_values(rng, (1, T, HQ, D))
    flop = 2.5 * attn_flop(T, T, True)
    op, size = "attn backward", f"T={T}"
    box = {}
    ref = None
    for dt in ("float32", "bfloat16"):
        a = [torch.from_numpy(x).to(getattr(torch, dt)) for x in (q, k, v, g)]
        with torch.no_grad():
            out, lse = flywheel.flash_attn_func(*a[:3], causal=True, return_softmax_lse=True)

        def ours(a=a, out=out, lse=lse, box=box):
            box["g"] = flywheel.flash_attn_backward(a[3], *a[:3], out, lse, causal=True)

        def result(box=box):
            return np.concatenate([x.float().numpy().ravel() for x in box["g"]])
        if ref is None:
            ours()
            ref = result().astype(np.float64)
        run_peer(rows, op, "flywheel", dt, size, ours, result, ref, reps, flop, "GFLOP/s")
    for dt in ("float32", "bfloat16"):
        a = [torch.from_numpy(x).to(getattr(torch, dt)).transpose(1, 2).contiguous()
             .requires_grad_() for x in (q, k, v)]
        gt = torch.from_numpy(g).to(getattr(torch, dt)).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(*a, is_causal=True,
                                                               enable_gqa=True)

        def sdpa(a=a, out=out, gt=gt, box=box):
            box["g"] = torch.autograd.grad(out, a, gt, retain_graph=True)

        def result(box=box):
            return np.concatenate([x.transpose(1, 2).float().numpy().ravel() for x in box["g"]])
        run_peer(rows, op, "torch SDPA", dt, size, sdpa, result, ref, reps, flop, "GFLOP/s")


def gdn_inputs(rng, n, T):
    q, k = (bf16_values(rng, (n, T, GH, GD)) for _ in range(2))
    q /= np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)  # pre-normalised: ggml has no l2norm
    k /= np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    v = bf16_values(rng, (n, T, GHV, GD))
    g = (-np.abs(rng.standard_normal((n, T, GHV))) * 0.1).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((n, T, GHV))))).astype(np.float32)
    return q, k, v, g, beta


def gdn_flop(T):
    C = 64
    return 2.0 * (3 * GD * GD + C * (3 * GD + 2 * GD) + (C - 1) * (C - 2) / 6.0) * T * GHV


def bench_linear_prefill(P, rows, op, size, inputs, flop, reps, chunk, fused, chunk_label,
                         ggml_label, fla_call, r):
    """flywheel's chunked pass (f32 and bf16 inputs) and fused recurrent step, ggml
    gated_delta_net and fla's naive chunked reference on the same prefill. inputs: (q, k, v,
    g, beta) numpy; chunk(q, k, v, g, beta) and fused(...) flywheel's calls; fla_call(torch
    tensors) fla's (None: fla missing); r the value heads per q/k head (ggml and fla expand
    q/k)."""
    q, k, v, g, beta = inputs
    ref = chunk(q, k, v, g, beta)[0][0].astype(np.float64)
    torch = P.torch
    for dt in ("float32", "bfloat16"):
        a = [torch.from_numpy(x).to(getattr(torch, dt)) for x in (q, k, v)]
        gb = [torch.from_numpy(g), torch.from_numpy(beta)]
        box = {}

        def ours(a=a, gb=gb, box=box):
            box["o"] = chunk(*a, *gb)[0]
        run_peer(rows, op, chunk_label, dt, size, ours,
                 lambda box=box: box["o"][0].float().numpy(), ref, reps, flop, "GFLOP/s")
    box = {}

    def fused_run():
        box["o"] = fused(q, k, v, g, beta)[0]
    run_peer(rows, op, "flywheel fused recurrent", "float32", size, fused_run,
             lambda: box["o"][0], ref, max(1, reps // 2), flop, "GFLOP/s")
    qe, ke = np.repeat(q, r, axis=2), np.repeat(k, r, axis=2)
    if P.ggml is not None:
        try:
            run, res, gg = ggml_gdn(P.ggml, qe, ke, v, g, beta,
                                    np.zeros((1, v.shape[2], q.shape[3], v.shape[3]), np.float32),
                                    P.threads)
            run_peer(rows, op, ggml_label, "float32", size, run,
                     lambda: res()[0], ref, max(1, reps // 2), flop, "GFLOP/s")
            gg.free()
        except Exception as e:
            rows.append(Row(op, ggml_label, "float32", size, note=f"failed: {e}"))
    if fla_call is not None:
        a = [torch.from_numpy(x) for x in (qe, ke, v, g, beta)]
        box = {}

        def fla():
            box["o"] = fla_call(*a)[0]
        run_peer(rows, op, fla_call.label, "float32", size, fla,
                 lambda: box["o"][0].numpy(), ref, 1, flop, "GFLOP/s")


def _labelled(fn, label):
    fn.label = label
    return fn


def bench_gdn_prefill(P, rows, T, reps):
    rng = np.random.default_rng(T + 2)
    fla = None if P.fla is None else _labelled(
        lambda q, k, v, g, b: P.fla.naive_chunk_gated_delta_rule(q, k, v, g, b),
        "fla naive chunk (torch)")
    bench_linear_prefill(
        P, rows, "GDN prefill", f"T={T}", gdn_inputs(rng, 1, T), gdn_flop(T), reps,
        flywheel.chunk_gated_delta_rule,
        lambda q, k, v, g, b: flywheel.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=b),
        "flywheel chunk", "ggml gated_delta_net", fla, GHV // GH)


def bench_linear_decode(P, rows, op, n, inputs, state0, ggml_label, fla_call, r, reps):
    """flywheel's decode step on a slot array (the state advancing each call, as in serving;
    the diff uses the first call), ggml gated_delta_net and fla's naive recurrence, for n
    sequences. fla_call(torch q, k, v, g, beta, h0) (None: fla missing); r the value heads per
    q/k head (ggml and fla expand q/k)."""
    q, k, v, g, beta = inputs
    size = f"{n} seqs"
    moved = 2.0 * state0.size * 4
    st = state0.copy()
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    ref = flywheel.gated_delta_rule_decode(*args, st).astype(np.float64)
    box = {}

    def ours():
        box["o"] = flywheel.gated_delta_rule_decode(*args, st)
    run_peer(rows, op, "flywheel", "float32", size, ours, lambda: ref, ref, reps, moved,
             "GB/s state")
    qe, ke = np.repeat(q, r, axis=2), np.repeat(k, r, axis=2)
    if P.ggml is not None:
        try:
            run, res, gg = ggml_gdn(P.ggml, qe, ke, v, g, beta, state0, P.threads)
            run_peer(rows, op, ggml_label, "float32", size, run,
                     lambda: res()[:, 0], ref, reps, moved, "GB/s state")
            gg.free()
        except Exception as e:
            rows.append(Row(op, ggml_label, "float32", size, note=f"failed: {e}"))
    if fla_call is not None:
        torch = P.torch
        a = [torch.from_numpy(x) for x in (qe, ke, v, g, beta, state0)]
        box = {}

        def fla():
            box["o"] = fla_call(*a)[0]
        run_peer(rows, op, fla_call.label, "float32", size, fla,
                 lambda: box["o"][:, 0].numpy(), ref, reps, moved, "GB/s state")


def bench_gdn_decode(P, rows, n, reps):
    rng = np.random.default_rng(n + 3)
    inputs = gdn_inputs(rng, n, 1)
    state0 = (rng.standard_normal((n, GHV, GD, GD)) * 0.05).astype(np.float32)
    fla = None if P.fla is None else _labelled(
        lambda q, k, v, g, b, h0: P.fla.naive_recurrent_gated_delta_rule(
            q, k, v, b, g, initial_state=h0, output_final_state=True),
        "fla naive recurrent (torch)")
    bench_linear_decode(P, rows, "GDN decode", n, inputs, state0, "ggml gated_delta_net", fla,
                        GHV // GH, reps)


def kda_inputs(rng, n, T):
    q, k = (bf16_values(rng, (n, T, KH, KD)) for _ in range(2))
    q /= np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)  # pre-normalised: ggml has no l2norm
    k /= np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    v = bf16_values(rng, (n, T, KHV, KD))
    g = (-np.abs(rng.standard_normal((n, T, KHV, KD))) * 0.1).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((n, T, KHV))))).astype(np.float32)
    return q, k, v, g, beta


def kda_flop(T):
    C = 64
    return 2.0 * (3 * KD * KD + C * (3 * KD + 2 * KD) + (C - 1) * (C - 2) / 6.0) * T * KHV


def bench_kda_prefill(P, rows, T, reps):
    rng = np.random.default_rng(T + 4)
    fla = None if P.fla_kda is None else _labelled(P.fla_kda.naive_chunk_kda,
                                                     "fla naive_chunk_kda (torch)")
    bench_linear_prefill(
        P, rows, "KDA prefill", f"T={T}", kda_inputs(rng, 1, T), kda_flop(T), reps,
        flywheel.chunk_kda, flywheel.fused_recurrent_kda, "flywheel chunk",
        "ggml gated_delta_net (gate per channel)", fla, KHV // KH)


def bench_kda_decode(P, rows, n, reps):
    rng = np.random.default_rng(n + 5)
    inputs = kda_inputs(rng, n, 1)
    state0 = (rng.standard_normal((n, KHV, KD, KD)) * 0.05).astype(np.float32)
    fla = None if P.fla_kda is None else _labelled(
        lambda q, k, v, g, b, h0: P.fla_kda.naive_recurrent_kda(
            q, k, v, g, b, initial_state=h0, output_final_state=True),
        "fla naive_recurrent_kda (torch)")
    bench_linear_decode(P, rows, "KDA decode", n, inputs, state0,
                        "ggml gated_delta_net (gate per channel)", fla, KHV // KH, reps)


def attention64(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0):
    """float64 attention, [b, s, h, d] in and out (masks bottom-right, GQA, softcap; a row that
    sees no key gives 0): the reference both sides of the oracle are measured against."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, 2), np.repeat(v, g, 2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[3])
    if softcap:
        s = softcap * np.tanh(s / softcap)
    sq, sk = q.shape[1], k.shape[1]
    i, j = np.arange(sq)[:, None] + sk - sq, np.arange(sk)[None, :]
    left, right = window_size
    right = 0 if causal else right
    ok = np.ones((sq, sk), bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    s = np.where(ok, s, -np.inf)
    m = s.max(-1, keepdims=True, initial=-np.inf)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    den = p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p / np.where(den > 0, den, 1), v)


def oracle(P, rows):
    """flywheel-tpu's Pallas kernels in interpret mode against flywheel.tpu's calls under
    jax.jit (flywheel.jax's FFI custom calls) on small shapes: each one's max error against
    float64, and its time (the original's interpret mode is an emulation: its time says what a
    CPU user of the original waits, not what its kernels do on a TPU)."""
    if P.fwtpu is None:
        rows.append(Row("oracle", "flywheel-tpu (interpret)", "bfloat16", "-",
                        note=P.missing["flywheel-tpu"]))
        return
    jax, jnp = P.jax, P.jax.numpy
    import flywheel.tpu as ours_tpu

    def timed(f, reps):
        jax.block_until_ready(f())
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def both(name, ours, theirs, want, reps=5):
        for system, f, n in (("flywheel.tpu (jax.jit)", ours, reps),
                             ("flywheel-tpu (interpret)", theirs, 1)):
            try:
                sec = timed(f, n)
                got = np.asarray(f().astype(jnp.float32), np.float64)
                rows.append(Row("oracle", system, "bfloat16", name, seconds=sec,
                                diff=float(np.abs(got - want).max()),
                                note="diff: max error against float64"))
            except Exception as e:
                traceback.print_exc(file=sys.stderr)
                rows.append(Row("oracle", system, "bfloat16", name,
                                note=f"failed: {type(e).__name__}: {e}"))

    rng = np.random.default_rng(5)
    cases = [("causal GQA", 256, 256, dict(causal=True)),
             ("window (64, 0) + softcap 20", 256, 256, dict(causal=True, window_size=(64, 0),
                                                            softcap=20.0)),
             ("causal, sq < sk", 100, 256, dict(causal=True))]
    for name, sq, sk, kw in cases:
        q = bf16_values(rng, (1, sq, 8, 128))
        k, v = (bf16_values(rng, (1, sk, 2, 128)) for _ in range(2))
        want = attention64(q, k, v, **kw).transpose(0, 2, 1, 3)
        hm = [jnp.asarray(x.transpose(0, 2, 1, 3), dtype=jnp.bfloat16) for x in (q, k, v)]
        jitted = jax.jit(lambda a, b, c, kw=kw: ours_tpu.flash_attn_func(a, b, c, **kw))
        both(f"{name}, sq={sq} sk={sk}", lambda: jitted(*hm),
             lambda: P.fwtpu.flash_attn_func(*hm, interpret=True, **kw), want)
    # decode against a contiguous cache
    q = bf16_values(rng, (2, 1, 8, 128))
    kc, vc = (bf16_values(rng, (2, 512, 2, 128)) for _ in range(2))
    lens = np.array([300, 512], np.int32)
    want = np.concatenate([attention64(q[i:i + 1], kc[i:i + 1, :lens[i]], vc[i:i + 1, :lens[i]])
                           for i in range(2)])
    a = [jnp.asarray(x, dtype=jnp.bfloat16) for x in (q, kc, vc)]
    jl = jnp.asarray(lens)
    step = jax.jit(lambda q, kc, vc, n: ours_tpu.flash_attn_with_kvcache(q, kc, vc,
                                                                          cache_seqlens=n)[0])
    # (the original donates its caches: each of its calls gets copies)
    both("kvcache decode, ctx 300/512", lambda: step(*a, jl),
         lambda: P.fwtpu.flash_attn_with_kvcache(a[0], jnp.array(a[1]), jnp.array(a[2]),
                                                 cache_seqlens=jl, interpret=True)[0], want)


# --------------------------------------------------------------------------- report --

def row_peak(r, peaks):
    """The peak a row is measured against: bf16 rows (bf16 products, for flywheel) the bf16
    dot-product peak, every other row the FMA peak; both measured in the same run."""
    bf16 = r.dtype == "bfloat16"
    return peaks["bf16"] if bf16 else peaks["f32"]


def fmt_table(rows, peaks):
    out = ["| op | size | system | dtype | median time | throughput | vs flywheel | "
           "max abs diff from flywheel | note |",
           "|---|---|---|---|---|---|---|---|---|"]
    best = {}
    for r in rows:  # flywheel's fastest time per (op, size), any dtype: the ratio's numerator
        if r.system.startswith("flywheel") and "tpu" not in r.system and r.seconds:
            key = (r.op, r.size)
            best[key] = min(best.get(key, float("inf")), r.seconds)
    for r in rows:
        t = f"{r.seconds * 1e3:.2f} ms" if r.seconds else "-"
        thr = "-"
        if r.value:
            thr = f"{r.value / 1e9:.1f} {r.unit}"
            if r.unit == "GFLOP/s":
                pk = row_peak(r, peaks)
                kind = "bf16" if pk == peaks["bf16"] else "FMA"
                thr += f" ({100 * r.value / 1e9 / pk:.0f}% of {kind} peak)"
        ratio = "-"
        if r.seconds and best.get((r.op, r.size)):
            ratio = f"{best[(r.op, r.size)] / r.seconds:.2f}x"
        diff = f"{r.diff:.2e}" if r.diff is not None else "-"
        out.append(f"| {r.op} | {r.size} | {r.system} | {r.dtype} | {t} | {thr} | {ratio} | "
                   f"{diff} | {r.note} |")
    return "\n".join(out)


def plot(rows, outdir, peaks):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []
    for op, xlabel, fname in (("attn prefill", "sequence length T (causal)", "attn_prefill.png"),
                              ("attn decode", "context length", "attn_decode.png"),
                              ("GDN prefill", "sequence length T", "gdn_prefill.png"),
                              ("KDA prefill", "sequence length T", "kda_prefill.png")):
        sel = [r for r in rows if r.op == op and r.value]
        if not sel:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key in sorted({(r.system, r.dtype) for r in sel}):
            pts = sorted((int(r.size.split("=")[1]), r.value / 1e9) for r in sel
                         if (r.system, r.dtype) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"{key[0]} ({key[1]})")
        if sel[0].unit == "GFLOP/s":
            for name, pk in (("FMA", peaks["f32"]), ("bf16 dot-product", peaks["bf16"])):
                ax.axhline(pk, color="gray", linestyle="--", linewidth=1)
                ax.text(ax.get_xlim()[0], pk, f" {name} peak (measured)", va="bottom", fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(sel[0].unit)
        ax.set_title(f"{op}: throughput, {P_THREADS[0]} threads, {platform.machine()}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, fname), dpi=110)
        plt.close(fig)
        files.append(fname)
    return files


P_THREADS = [0]


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/compare")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small sweep (a smoke test)")
    sections = ["attn-prefill", "attn-decode", "attn-backward", "gdn-prefill", "gdn-decode",
                "kda-prefill", "kda-decode", "oracle"]
    ap.add_argument("--only", default=",".join(sections),
                    help="comma-separated sections (default: all): " + ", ".join(sections))
    args = ap.parse_args()
    only = args.only.split(",")
    for name in only:
        if name not in sections:
            ap.error(f"--only: unknown section {name!r}; the sections are {', '.join(sections)}")
    P_THREADS[0] = args.threads
    flywheel.set_num_threads(args.threads)
    P = Peers(args.threads)
    if P.torch is None:  # the inputs are handed to every system through torch tensors
        sys.exit(f"compare: {P.missing['torch']}")
    peaks = {}
    for key, fn in (("f32", _lib.lib.fw_peak_gflops), ("bf16", _lib.lib.fw_peak_bf16_gflops)):
        value = ctypes.c_double()
        _lib.check(fn(None, args.threads, 0.5, ctypes.byref(value)))
        peaks[key] = value.value
    rows = []
    prefill_T = [256, 512] if args.quick else [512, 1024, 2048, 4096]
    decode_L = [1024, 4096] if args.quick else [1024, 4096, 16384, 32768]
    backward_T = [256] if args.quick else [1024, 4096]
    gdn_T = [256, 512] if args.quick else [512, 1024, 2048, 4096]
    gdn_n = [4] if args.quick else [1, 64]
    decode_reps = max(args.reps, 5)
    for name, label, sizes, bench, reps in (
            ("attn-prefill", "attention prefill T=", prefill_T, bench_prefill, args.reps),
            ("attn-decode", "attention decode ctx=", decode_L, bench_decode, decode_reps),
            ("attn-backward", "attention backward T=", backward_T, bench_attn_backward,
             args.reps),
            ("gdn-prefill", "GDN prefill T=", gdn_T, bench_gdn_prefill, args.reps),
            ("gdn-decode", "GDN decode, sequences: ", gdn_n, bench_gdn_decode, decode_reps),
            ("kda-prefill", "KDA prefill T=", gdn_T, bench_kda_prefill, args.reps),
            ("kda-decode", "KDA decode, sequences: ", gdn_n, bench_kda_decode, decode_reps)):
        if name not in only:
            continue
        for x in sizes:
            log(f"{label}{x}")
            bench(P, rows, x, reps)
    if "oracle" in only:
        log("flywheel-tpu oracle")
        oracle(P, rows)
    for name, why in P.missing.items():
        if name != "flywheel-tpu":
            rows.append(Row("-", name, "-", "-", note=why))

    os.makedirs(args.out, exist_ok=True)
    table = fmt_table(rows, peaks)
    plots = plot(rows, args.out, peaks)
    versions = []
    for mod, label in (("torch", "torch"), ("jax", "jax"), ("ggml", "ggml-python"),
                       ("fla", "fla"), ("flywheel_tpu", "flywheel-tpu")):
        m = sys.modules.get(mod)
        if m is not None:
            versions.append(f"{label} {getattr(m, '__version__', '?')}")
    header = (f"# flywheel and its peers, side by side\n\n"
              f"Measured {datetime.date.today().isoformat()} on {cpu_name()}, "
              f"{os.cpu_count()} CPUs, {args.threads} threads for every system "
              f"(torch.set_num_threads, ggml n_threads, flywheel threads; XLA's CPU pool is "
              f"sized to the machine). Peaks measured in the same run: f32 FMA "
              f"{peaks['f32']:.0f} GFLOP/s, bf16 dot product {peaks['bf16']:.0f} GFLOP/s; bfloat16 "
              f"rows are % of the bf16 peak, the others % of the FMA peak. "
              f"Python {platform.python_version()}; {', '.join(versions)}. "
              f"Command: `make compare` (`python bench/compare.py`), medians of "
              f"{args.reps} runs (decode: {decode_reps}).\n\n"
              f"Shapes: attention hq={HQ}, hkv={HKV}, d={D}, batch 1 (prefill causal; decode one "
              f"query token against a cache of `ctx` tokens); GDN H={GH}, HV={GHV}, "
              f"dk=dv={GD}; KDA H=HV={KHV}, dk=dv={KD}. Inputs are the same values for everyone (bf16-representable). "
              f"`vs flywheel` is flywheel's fastest time for that op and size (any dtype) over the "
              f"row's time: below 1, the row is slower.\n\n")
    body = header + table + "\n\n" + "".join(f"![{p}]({p})\n" for p in plots)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(body)
    print(table)
    print(f"\nwrote {os.path.join(args.out, 'compare.md')} and {len(plots)} plots")


if __name__ == "__main__":
    main()
