"""`make bench-calls`: the fixed cost of a call through the Python binding.

For each call, the time per call through Python (median and min-max of --rounds rounds of
back-to-back calls) on the compiled fast path (python/flywheel/_fwext.c) and on the ctypes
path, and the time of the same C call measured by the CLI (`flywheel bench kvcache|gdn
--json`, which calls the library from C in a loop). Fixed overhead = Python time - C time.

Calls (torch tensors, one thread):
  decode 1x1     flash_attn_with_kvcache: 1 sequence, 1 query head, 1 K/V head, d 128, a
                 1-token context after appending the new token (k=, v= given), bf16
  gdn 1x1        gated_delta_rule_decode: 1 sequence, 1 q/k head, 1 value head, 128 x 128
                 state, bf16 (a unit key, so the state stays finite call after call)
  conv 1x1       causal_conv1d_update: 1 sequence, 1 channel, width 4, a [1, 1, 4] state
                 (transformers' layout), bf16, SiLU
  decode 1K      flash_attn_with_kvcache at the issue's engine shape: batch 1, 32:8 heads,
                 d 128, 1K context, bf16, 2 threads (a real decode step; overhead matters
                 there as a share of the call)
Each with out= (an engine's reused buffer) and without (a new output per call).

Usage: python bench/bench_calls.py [--rounds 7] [--calls 2000] [--json]
"""

import argparse
import json
import os
import statistics
import subprocess
import time

import numpy as np
import torch

import flywheel
from flywheel import _lib


def per_call_us(f, calls, rounds):
    for _ in range(max(calls // 10, 20)):
        f()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return times


def c_call_us(args, rounds):
    """The C call's time from the CLI (median over rounds of its own median)."""
    cli = os.path.join(os.path.dirname(os.environ.get("FLYWHEEL_LIBRARY", "build/x")), "flywheel")
    times = []
    for _ in range(rounds):
        out = subprocess.run([cli, "bench"] + args + ["--json"], check=True, capture_output=True,
                             text=True).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        times.append(rows[-1]["us_per_step"])
    return times


def summary(ts):
    return {"median": statistics.median(ts), "min": min(ts), "max": max(ts)}


def cases():
    bf = torch.bfloat16
    q1, k1, v1 = (torch.randn(1, 1, 1, 128, dtype=bf) for _ in range(3))
    kc1, vc1 = torch.zeros(1, 1, 1, 128, dtype=bf), torch.zeros(1, 1, 1, 128, dtype=bf)
    o1 = torch.empty(1, 1, 1, 128, dtype=bf)
    zero = torch.zeros(1, dtype=torch.int32)

    gq, gk, gv = (torch.randn(1, 1, 128, dtype=bf) for _ in range(3))
    gk = (gk.float() / gk.float().norm()).to(bf)  # a unit key, as models give: the state stays finite
    gg, gb = torch.full((1, 1), -0.1), torch.full((1, 1), 0.5)
    state = torch.zeros(1, 1, 128, 128)
    go = torch.empty(1, 1, 128, dtype=bf)

    q, kn, vn = (torch.randn(1, 1, h, 128, dtype=bf) for h in (32, 8, 8))
    kc, vc = torch.randn(1, 1024, 8, 128, dtype=bf), torch.randn(1, 1024, 8, 128, dtype=bf)
    o = torch.empty(1, 1, 32, 128, dtype=bf)
    lens = torch.full((1,), 1023, dtype=torch.int32)

    cx = torch.randn(1, 1, 1, dtype=bf)
    cst, cw, co = torch.zeros(1, 1, 4, dtype=bf), torch.randn(1, 4, dtype=bf), torch.empty(1, 1, 1, dtype=bf)

    return [
        ("decode 1x1", 1, ["kvcache", "--decode", "--batch", "1", "--ctx", "1", "--hq", "1",
                           "--hkv", "1", "--d", "128", "--page", "0", "--dtype", "bf16",
                           "--threads", "1", "--reps", "2000"],
         lambda: flywheel.flash_attn_with_kvcache(q1, kc1, vc1, k1, v1, cache_seqlens=zero,
                                                  out=o1),
         lambda: flywheel.flash_attn_with_kvcache(q1, kc1, vc1, k1, v1, cache_seqlens=zero)),
        ("gdn 1x1", 1, ["gdn", "--decode", "--seqs", "1", "--h", "1", "--hv", "1", "--dk", "128",
                        "--dv", "128", "--dtype", "bf16", "--threads", "1", "--reps", "2000"],
         lambda: flywheel.gated_delta_rule_decode(gq, gk, gv, gg, gb, state, out=go),
         lambda: flywheel.gated_delta_rule_decode(gq, gk, gv, gg, gb, state)),
        ("conv 1x1", 1, ["conv", "--decode", "1", "--d", "1", "--w", "4", "--dtype", "bf16",
                         "--threads", "1", "--reps", "64"],
         lambda: flywheel.causal_conv1d_update(cx, cst, cw, None, activation="silu", out=co),
         lambda: flywheel.causal_conv1d_update(cx, cst, cw, None, activation="silu")),
        ("decode 1K", 2, ["kvcache", "--decode", "--batch", "1", "--ctx", "1024", "--hq", "32",
                          "--hkv", "8", "--d", "128", "--page", "0", "--dtype", "bf16",
                          "--threads", "2", "--reps", "500"],
         lambda: flywheel.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, out=o),
         lambda: flywheel.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens)),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    kind, origin = _lib.binding()
    if kind != "compiled":
        raise SystemExit(f"bench_calls: the compiled fast path is not in use ({origin})")
    torch.set_num_threads(1)
    rows = []
    for name, threads, cli, with_out, new_out in cases():
        flywheel.set_num_threads(threads)
        c = c_call_us(cli, a.rounds)
        row = {"call": name, "threads": threads, "c_us": summary(c)}
        for label, f in (("out=", with_out), ("new out", new_out)):
            fast = per_call_us(f, a.calls, a.rounds)
            saved, _lib.fast = _lib.fast, None
            try:
                slow = per_call_us(f, max(a.calls // 10, 50), a.rounds)
            finally:
                _lib.fast = saved
            row[label] = {"compiled_us": summary(fast), "ctypes_us": summary(slow),
                          "compiled_overhead_us": statistics.median(fast) - statistics.median(c),
                          "ctypes_overhead_us": statistics.median(slow) - statistics.median(c)}
        rows.append(row)
    if a.json:
        print(json.dumps({"binding": origin, "rows": rows}, indent=1))
        return
    print(f"per-call time (us), median [min-max] of {a.rounds} rounds; overhead = Python - C")
    print(f"{'call':12} {'output':8} {'C call':>18} {'compiled':>18} {'ctypes':>18} "
          f"{'overhead: compiled':>19} {'ctypes':>7}")
    fmt = lambda s: f"{s['median']:7.2f} [{s['min']:.2f}-{s['max']:.2f}]"
    for r in rows:
        for label in ("out=", "new out"):
            x = r[label]
            print(f"{r['call']:12} {label:8} {fmt(r['c_us']):>18} {fmt(x['compiled_us']):>18} "
                  f"{fmt(x['ctypes_us']):>18} {x['compiled_overhead_us']:19.2f} "
                  f"{x['ctypes_overhead_us']:7.2f}")


if __name__ == "__main__":
    main()
