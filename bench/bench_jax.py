"""`make bench-jax`: flywheel's calls under jax.jit (flywheel.jax's XLA FFI custom calls)
against the same kernels called without JAX, in one run.

Rows (bf16, all online CPUs; medians and min-max over --rounds rounds of back-to-back calls):
  decode attention   flash_attn_with_kvcache, 1 sequence, 32:8 heads, d 128, 1K context, one
                     new token appended (contiguous caches, donated under jit); against the
                     same C call timed by the CLI (`flywheel bench kvcache --decode`) and the
                     binding's call on torch tensors (its compiled fast path)
  decode GDN layer   flywheel.tpu.fused_conv1d_gdn, one decode token, Qwen3-Next's layer (16
                     q/k heads, 32 value heads, d 128, conv width 4; caches donated); against
                     the binding's call on torch tensors (with out=, its compiled fast path)
  decode step        both calls in one jitted function; against both torch calls back to back
  tiny decode step   the step on 1-head shapes (attention 1 head, d 128, 1-token context; a
                     1-head GDN layer, d 16), whose kernels take about a microsecond: against
                     a jitted no-op on the same donated caches (JAX's own dispatch), and the
                     attention call's C time (CLI): what the FFI adds per call
  prefill attention  flash_attn_func, T = 4K causal, 32:8 heads, d 128; against the torch call;
                     and with out= a donated buffer (XLA maps fresh pages for each new output:
                     about 9.5K page faults a call for this 32 MB one)
  attention block    the original FlyWheel benchmark's block under one jit: x [1, T, 4096] ->
                     q, k, v projections (einsums into the head-major layout) -> flywheel.tpu's
                     flash_attn_func -> output projection, T = 2K; against the projections
                     alone (jitted) plus the attention call alone (jitted)
"adds" is the jitted time less the reference's.

Usage: python bench/bench_jax.py [--rounds 7] [--json]
"""

import argparse
import json
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

import flywheel
import flywheel.jax as fj
import flywheel.tpu as tpu

BF = ml_dtypes.bfloat16


def timed(fs, calls, rounds):
    """Per-call microseconds of each function in fs (each returns what to wait for, or None):
    `rounds` rounds of `calls` back-to-back calls, the functions taking turns round by round
    (so that drift in the machine's speed reaches them alike)."""
    for f in fs:
        for _ in range(max(calls // 10, 3)):
            jax.block_until_ready(f())
    out = [[] for _ in fs]
    for _ in range(rounds):
        for f, o in zip(fs, out):
            t = time.perf_counter()
            for _ in range(calls):
                r = f()
            jax.block_until_ready(r)
            o.append((time.perf_counter() - t) / calls * 1e6)
    return out


def cli_us(args, rounds):
    cli = os.path.join(os.path.dirname(os.environ.get("FLYWHEEL_LIBRARY", "build/x")), "flywheel")
    times = []
    for _ in range(rounds):
        out = subprocess.run([cli, "bench"] + args + ["--json"], check=True, capture_output=True,
                             text=True).stdout
        rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        times.append(rows[-1]["us_per_step"])
    return times


def decode_inputs(rng):
    q = rng.standard_normal((1, 1, 32, 128)).astype(BF)
    kn = rng.standard_normal((1, 1, 8, 128)).astype(BF)
    kc = rng.standard_normal((1, 1040, 8, 128)).astype(BF)
    return q, kn, kc, kc.copy(), np.array([1023], np.int32)


def layer_inputs(rng, nkq=16, nv=32, d=128):
    K, slots = 4, 4
    dim = 2 * nkq * d + nv * d
    x = dict(qkv=rng.standard_normal((1, dim)).astype(BF),
             b=rng.standard_normal((1, nv)).astype(BF), a=rng.standard_normal((1, nv)).astype(BF),
             conv_state=rng.standard_normal((slots, K - 1, dim)).astype(BF),
             recurrent_state=(rng.standard_normal((slots, nv, d, d)) * 0.01).astype(np.float32),
             conv_weight=(rng.standard_normal((dim, 1, K)) * 0.3).astype(BF), conv_bias=None,
             a_log=np.log(rng.uniform(1, 8, nv)).astype(np.float32),
             dt_bias=np.zeros(nv, np.float32),
             query_start_loc=np.array([0, 1], np.int32), state_indices=np.array([1], np.int32),
             distribution=np.array([1, 1, 1], np.int32), seq_lens=np.array([50], np.int32),
             read_state_indices=np.array([1], np.int32))
    return x, dict(n_kq=nkq, n_v=nv, d_k=d, d_v=d, kernel_size=K)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []

    def row(name, jit_us, ref_us, ref_name):
        r = {"row": name, "jit_us": statistics.median(jit_us),
             "jit_range": [min(jit_us), max(jit_us)],
             "ref": ref_name, "ref_us": statistics.median(ref_us),
             "ref_range": [min(ref_us), max(ref_us)]}
        r["adds_us"] = r["jit_us"] - r["ref_us"]
        rows.append(r)

    def tt(x):  # a torch tensor of x's values (bf16 stays bf16)
        if x is None or x.dtype == np.int32:
            return None if x is None else torch.from_numpy(x)
        t = torch.from_numpy(np.asarray(x, np.float32))
        return t.to(torch.bfloat16 if x.dtype == BF else torch.float32)

    # decode attention
    q, kn, kc, vc, lens = decode_inputs(rng)
    att = jax.jit(lambda q, kc, vc, kn, n: fj.flash_attn_with_kvcache(q, kc, vc, kn, kn,
                                                                      cache_seqlens=n),
                  donate_argnums=(1, 2))
    st = {"kc": jnp.asarray(kc), "vc": jnp.asarray(vc)}
    jq, jkn, jl = jnp.asarray(q), jnp.asarray(kn), jnp.asarray(lens)
    tq, tkn, tkc, tvc, tl = (tt(x) for x in (q, kn, kc, vc, lens))

    def att_step():
        o, st["kc"], st["vc"] = att(jq, st["kc"], st["vc"], jkn, jl)
        return o

    def att_torch():
        return flywheel.flash_attn_with_kvcache(tq, tkc, tvc, tkn, tkn, cache_seqlens=tl)

    t_att, t_tatt = timed([att_step, att_torch], 300, a.rounds)
    t_c = cli_us(["kvcache", "--decode", "--batch", "1", "--ctx", "1024", "--hq", "32",
                  "--hkv", "8", "--d", "128", "--page", "0", "--dtype", "bf16", "--reps", "300"],
                 a.rounds)
    row("decode attention", t_att, t_c, "C call (CLI)")
    row("decode attention", t_att, t_tatt, "torch call")

    # decode GDN layer
    x, dims = layer_inputs(rng)
    lay = jax.jit(lambda *v: tpu.fused_conv1d_gdn(*v, **dims), donate_argnums=(3, 4))
    jx = [None if v is None else jnp.asarray(v) for v in x.values()]
    tx = [tt(v) for v in x.values()]

    def lay_step():
        (jx[3], jx[4]), o = lay(*jx)
        return o

    tout = torch.empty(1, dims["n_v"] * dims["d_v"], dtype=torch.bfloat16)

    def lay_torch():  # out= takes the compiled fast path, as an engine's reused buffer does
        return flywheel.fused_conv1d_gdn(*tx, **dims, out=tout)[1]

    t_lay, t_tlay = timed([lay_step, lay_torch], 300, a.rounds)
    row("decode GDN layer", t_lay, t_tlay, "torch call")

    # both in one step
    def step(q, kc, vc, kn, n, *v):
        o, kc, vc = fj.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=n)
        caches, o2 = tpu.fused_conv1d_gdn(*v, **dims)
        return o, o2, kc, vc, caches

    stepd = jax.jit(step, donate_argnums=(1, 2, 8, 9))  # both caches of both calls

    def both():
        o, o2, st["kc"], st["vc"], (jx[3], jx[4]) = stepd(jq, st["kc"], st["vc"], jkn, jl, *jx)
        return o2

    def both_torch():
        att_torch()
        return lay_torch()

    row("decode step", *timed([both, both_torch], 300, a.rounds), "torch calls")

    # the fixed costs: JAX's dispatch of a jitted step (a no-op on the same donated caches),
    # and the decode step on 1-head, 1-token shapes, whose kernels take about a microsecond
    noop = jax.jit(lambda q, kc, vc, kn, n, *v: (q * 1, kc, vc, v[3], v[4]),
                   donate_argnums=(1, 2, 8, 9))

    def noop_step():
        o, st["kc"], st["vc"], jx[3], jx[4] = noop(jq, st["kc"], st["vc"], jkn, jl, *jx)
        return o

    tiny = {"q": jnp.ones((1, 1, 1, 128), jnp.bfloat16),
            "kc": jnp.zeros((1, 4, 1, 128), jnp.bfloat16),
            "vc": jnp.zeros((1, 4, 1, 128), jnp.bfloat16), "n": jnp.zeros(1, jnp.int32)}
    tx_, tdims = layer_inputs(rng, nkq=1, nv=1, d=16)
    tjx = [None if v is None else jnp.asarray(v) for v in tx_.values()]
    tiny_stepd = jax.jit(lambda q, kc, vc, kn, n, *v: (
        fj.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=n),
        tpu.fused_conv1d_gdn(*v, **tdims)), donate_argnums=(1, 2, 8, 9))

    def tiny_step():
        (o, tiny["kc"], tiny["vc"]), ((tjx[3], tjx[4]), o2) = tiny_stepd(
            tiny["q"], tiny["kc"], tiny["vc"], tiny["q"], tiny["n"], *tjx)
        return o2

    t_noop, t_tiny = timed([noop_step, tiny_step], 1000, a.rounds)
    t_c1 = cli_us(["kvcache", "--decode", "--batch", "1", "--ctx", "1", "--hq", "1", "--hkv",
                   "1", "--d", "128", "--page", "0", "--dtype", "bf16", "--threads", "1", "--reps",
                   "2000"], a.rounds)
    row("tiny decode step", t_tiny, t_noop, "no-op jit (JAX's dispatch)")
    rows.append({"row": "tiny decode attention", "ref": "C call (CLI)",
                 "ref_us": statistics.median(t_c1), "ref_range": [min(t_c1), max(t_c1)]})

    # prefill attention
    T = 4096
    pq = rng.standard_normal((1, T, 32, 128)).astype(BF)
    pk = rng.standard_normal((1, T, 8, 128)).astype(BF)
    pre = jax.jit(lambda q, k, v: fj.flash_attn_func(q, k, v, causal=True))
    pre_out = jax.jit(lambda q, k, v, o: fj.flash_attn_func(q, k, v, causal=True, out=o),
                      donate_argnums=(3,))
    jp = [jnp.asarray(v) for v in (pq, pk, pk)]
    tp = [tt(v) for v in (pq, pk, pk)]
    buf = {"o": jnp.zeros(pq.shape, jnp.bfloat16)}

    def pre_donated():
        buf["o"] = pre_out(*jp, buf["o"])
        return buf["o"]

    t_pre, t_pre_out, t_tpre = timed([lambda: pre(*jp), pre_donated,
                                      lambda: flywheel.flash_attn_func(*tp, causal=True)],
                                     3, a.rounds)
    row("prefill attention", t_pre, t_tpre, "torch call")
    row("prefill, donated out", t_pre_out, t_tpre, "torch call")

    # the attention block
    T, dm = 2048, 4096
    xs = jnp.asarray(rng.standard_normal((1, T, dm)).astype(BF))
    wq = jnp.asarray((rng.standard_normal((dm, 32, 128)) * dm ** -0.5).astype(BF))
    wk = jnp.asarray((rng.standard_normal((dm, 8, 128)) * dm ** -0.5).astype(BF))
    wo = jnp.asarray((rng.standard_normal((32, 128, dm)) * 64 ** -1).astype(BF))

    def proj(x):
        return (jnp.einsum("btm,mhd->bhtd", x, wq), jnp.einsum("btm,mhd->bhtd", x, wk),
                jnp.einsum("btm,mhd->bhtd", x, wk))

    block = jax.jit(lambda x: jnp.einsum("bhtd,hdm->btm",
                                         tpu.flash_attn_func(*proj(x), causal=True), wo))
    projs = jax.jit(lambda x: jnp.einsum("bhtd,hdm->btm", proj(x)[0], wo))
    qkv = jax.jit(proj)(xs)
    attn = jax.jit(lambda q, k, v: tpu.flash_attn_func(q, k, v, causal=True))
    t_block, t_proj, t_attn = timed([lambda: block(xs), lambda: projs(xs), lambda: attn(*qkv)], 2,
                                    a.rounds)
    row("attention block", t_block, [p + t for p, t in zip(t_proj, t_attn)],
        "projections + attention, each jitted")

    if a.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{'row':22} {'jit us':>12} {'range':>17}   {'reference':36} {'us':>10} {'adds us':>9}")
    for r in rows:
        if "jit_us" not in r:
            print(f"{r['row']:22} {'':30}{r['ref']:36} {r['ref_us']:10.1f}")
            continue
        lo, hi = r["jit_range"]
        print(f"{r['row']:22} {r['jit_us']:12.1f} {lo:8.1f}-{hi:<8.1f}"
              f"   {r['ref']:36} {r['ref_us']:10.1f} {r['adds_us']:9.1f}")


if __name__ == "__main__":
    main()
