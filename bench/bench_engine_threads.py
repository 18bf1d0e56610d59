"""`make bench-engine-threads`: flywheel's small calls inside a torch process, the way an
engine step makes them: each flywheel call right after a torch op that runs on torch's own
thread pool.

For each call (decode 1K: flash_attn_with_kvcache, batch 1, GQA 32:8, d 128, 1K context, bf16,
out= given; GDN decode: gated_delta_rule_decode, 1 sequence, 16:32 heads, 128 x 128 states,
bf16, out= given) and the torch op (torch.mm of an engine step's size: x [8, 2048] by
w [2048, 4096], bf16), with torch and flywheel both on --threads threads:
  alone        the call back to back, nothing else running (median per call)
  cold         the call after an evict: a one-thread numpy copy of 32 MiB, which leaves
               the caches as the torch op does (its weights are 16 MiB) without torch's
               threads: the call's time with its data out of cache and nothing else running
  interleaved  torch op, then the call, repeated: the call's time and the op's time, each
               against its own time alone (ratio; 1.00 = no interference); the call also
               against its cold time (what the threads cost, apart from the caches)
  after idle   the first calls after --idle seconds of sleep (what a request arriving at a
               quiet server sees): the first call and the median of the next 19, over 3 rounds
The library (and so the threading mode) is FLYWHEEL_LIBRARY's: build/ (the default pool),
or a build with FW_OPENMP=1 (OpenMP, sharing torch's libgomp); FLYWHEEL_SPIN_US sets the
default pool's spin window; --openmp-loop runs the library's loops on the package's OpenMP
host loop (flywheel.use_openmp_threads: torch's libgomp threads, any build). Each
configuration runs in its own process:
  python bench/bench_engine_threads.py [--threads 2] [--rounds 5] [--calls 200] [--idle 3]
                                        [--openmp-loop] [--json]
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

import flywheel
from flywheel import _lib


def med(ts):
    return statistics.median(ts)


def timed(f):
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e6


def calls():
    bf = torch.bfloat16
    q, kn, vn = (torch.randn(1, 1, h, 128, dtype=bf) for h in (32, 8, 8))
    kc, vc = torch.randn(1, 1024, 8, 128, dtype=bf), torch.randn(1, 1024, 8, 128, dtype=bf)
    o = torch.empty(1, 1, 32, 128, dtype=bf)
    lens = torch.full((1,), 1023, dtype=torch.int32)
    gq, gk = torch.randn(1, 16, 128, dtype=bf), torch.randn(1, 16, 128, dtype=bf)
    gv = torch.randn(1, 32, 128, dtype=bf)
    gg, gb = torch.full((1, 32), -0.1), torch.full((1, 32), 0.5)
    state = torch.zeros(1, 32, 128, 128)
    go = torch.empty(1, 32, 128, dtype=bf)
    return {
        "decode 1K": lambda: flywheel.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                                             out=o),
        "gdn decode 1x32": lambda: flywheel.gated_delta_rule_decode(
            gq, gk, gv, gg, gb, state, use_qk_l2norm_in_kernel=True, out=go),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--idle", type=float, default=3.0)
    ap.add_argument("--openmp-loop", action="store_true",
                    help="flywheel.use_openmp_threads: the loops on torch's OpenMP threads")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    flywheel.set_num_threads(a.threads)
    if a.openmp_loop:
        flywheel.use_openmp_threads(a.threads)
    x, w = torch.randn(8, 2048, dtype=torch.bfloat16), torch.randn(2048, 4096, dtype=torch.bfloat16)
    y = torch.empty(8, 4096, dtype=torch.bfloat16)
    op = lambda: torch.mm(x, w, out=y)
    src, dst = np.ones(8 << 20, np.float32), np.empty(8 << 20, np.float32)
    evict = lambda: np.copyto(dst, src)
    config = {"library": os.environ.get("FLYWHEEL_LIBRARY", "(package)"),
              "binding": _lib.binding()[0], "threads": a.threads,
              "spin_us": os.environ.get("FLYWHEEL_SPIN_US", "default"),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
              "loop": flywheel.threading_mode()[0]}
    rows = []
    with torch.inference_mode():
        for _ in range(50):
            op()
        op_alone = [med([timed(op) for _ in range(a.calls)]) for _ in range(a.rounds)]
        for name, f in calls().items():
            for _ in range(50):
                f()
            alone = [med([timed(f) for _ in range(a.calls)]) for _ in range(a.rounds)]
            cold = []
            for _ in range(a.rounds):
                tc = []
                for _ in range(a.calls):
                    evict()
                    tc.append(timed(f))
                cold.append(med(tc))
            inter_f, inter_op = [], []
            for _ in range(a.rounds):
                tf, to = [], []
                for _ in range(a.calls):
                    to.append(timed(op))
                    tf.append(timed(f))
                inter_f.append(med(tf))
                inter_op.append(med(to))
            first, rest = [], []
            for _ in range(3):
                time.sleep(a.idle)
                ts = [timed(f) for _ in range(20)]
                first.append(ts[0])
                rest.append(med(ts[1:]))
            rows.append({
                "call": name, "alone_us": med(alone), "alone_range": [min(alone), max(alone)],
                "interleaved_us": med(inter_f), "interleaved_range": [min(inter_f), max(inter_f)],
                "call_ratio": med(inter_f) / med(alone),
                "cold_us": med(cold), "cold_range": [min(cold), max(cold)],
                "call_ratio_cold": med(inter_f) / med(cold),
                "op_alone_us": med(op_alone), "op_interleaved_us": med(inter_op),
                "op_ratio": med(inter_op) / med(op_alone),
                "after_idle_first_us": med(first), "after_idle_next_us": med(rest)})
    if a.json:
        print(json.dumps({"config": config, "rows": rows}, indent=1))
        return
    print(" ".join(f"{k}={v}" for k, v in config.items()))
    print(f"{'call':16} {'alone us':>10} {'cold':>7} {'interleaved':>12} {'/alone':>7} "
          f"{'/cold':>6} {'torch.mm alone':>15} {'interleaved':>12} {'ratio':>6} "
          f"{'after idle: 1st':>16} {'next':>7}")
    for r in rows:
        print(f"{r['call']:16} {r['alone_us']:10.1f} {r['cold_us']:7.1f} {r['interleaved_us']:12.1f} "
              f"{r['call_ratio']:7.2f} {r['call_ratio_cold']:6.2f} "
              f"{r['op_alone_us']:15.1f} {r['op_interleaved_us']:12.1f} "
              f"{r['op_ratio']:6.2f} {r['after_idle_first_us']:16.1f} "
              f"{r['after_idle_next_us']:7.1f}")


if __name__ == "__main__":
    main()
