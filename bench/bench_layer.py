"""`make bench-layer`: flywheel.fused_conv1d_gdn (one GDN layer of an engine step) against its
parts in the same run, Qwen3-Next shapes (n_kq 16, n_v 32, d_k = d_v = 128, conv width 4),
bf16 activations, float32 recurrent states, torch CPU tensors, 2 threads (--threads).

  prefill T: the layer on one new sequence of T tokens against the GDN core alone
    (gated_delta_rule_prefill on already-convolved q/k/v views and precomputed gates) and
    the conv alone (causal_conv1d_fn); ratio layer / core.
  mixed: 60 decodes + one 2K prefill in one layer call against the two as separate calls.
  decode 64: the layer on 64 one-token decodes; bytes moved = recurrent states read and
    written (64 x 32 x 128 x 128 x 4 x 2) + conv states read and written (64 x 3 x 8192 x 2
    x 2); GB/s against the read bandwidth measured in the same run.
  replay N (1 and 64): the same decodes through fused_conv1d_gdn_replay (window 16, f32
    records) against fused_conv1d_gdn: a step with 8 committed records (it reads the
    checkpoint's bf16 shadow, bf16 qkv making the products bf16, or with --replay-f32 the f32
    checkpoint, and the records, and writes one record), and a flushing step (16 committed:
    it also folds them into the f32 checkpoint and writes it with its bf16 shadow).
Each figure: the median (and min-max) of --reps timed calls after one warm-up call.
"""

import argparse
import statistics
import time

import numpy as np
import torch

import flywheel

NKQ, NV, D, K = 16, 32, 128, 4
DIM = 2 * NKQ * D + NV * D


def timed(fn, reps):
    fn()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return statistics.median(t), min(t), max(t)


def fmt(x):
    return f"{x[0] * 1e3:8.2f} ms ({x[1] * 1e3:.2f}-{x[2] * 1e3:.2f})"


def setup(T, slots, rng):
    qkv = torch.from_numpy(rng.standard_normal((T, DIM)).astype(np.float32)).to(torch.bfloat16)
    b = torch.from_numpy(rng.standard_normal((T, NV)).astype(np.float32)).to(torch.bfloat16)
    a = torch.from_numpy(rng.standard_normal((T, NV)).astype(np.float32)).to(torch.bfloat16)
    w = torch.from_numpy((rng.standard_normal((DIM, 1, K)) * 0.5).astype(np.float32)).to(torch.bfloat16)
    a_log = torch.from_numpy(np.log(rng.uniform(1, 16, NV)).astype(np.float32))
    dt_bias = torch.from_numpy((rng.standard_normal(NV) * 0.5).astype(np.float32)).to(torch.bfloat16)
    conv = torch.zeros(slots, K - 1, DIM, dtype=torch.bfloat16)
    rec = torch.zeros(slots, NV, D, D)
    return qkv, b, a, w, a_log, dt_bias, conv, rec


def layer(args, qkv, b, a, w, a_log, dt_bias, conv, rec, qsl, seq_lens, sidx, dist, out):
    return lambda: flywheel.fused_conv1d_gdn(
        qkv, b, a, conv, rec, w, None, a_log, dt_bias, qsl, sidx, dist, seq_lens, sidx,
        n_kq=NKQ, n_v=NV, d_k=D, d_v=D, kernel_size=K, out=out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--t", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--replay-f32", action="store_true",
                    help="replay decodes with f32 products (read the f32 checkpoint)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flywheel.set_num_threads(args.threads)
    rng = np.random.default_rng(1)
    T = args.t
    with torch.inference_mode():
        # prefill: layer vs core vs conv
        qkv, b, a, w, a_log, dt_bias, conv, rec = setup(T, 2, rng)
        qsl = np.array([0, T], np.int32)
        seq_lens, sidx, dist = np.array([T], np.int32), np.array([1], np.int32), np.array([0, 1, 1], np.int32)
        out = torch.empty(T, NV * D, dtype=torch.bfloat16)
        t_layer = timed(layer(args, qkv, b, a, w, a_log, dt_bias, conv, rec, qsl, seq_lens, sidx,
                              dist, out), args.reps)
        xc = flywheel.causal_conv1d_fn(qkv[None].transpose(1, 2), w, activation="silu")
        y = xc.transpose(1, 2)[0]                                        # [T, DIM] view
        q = y[:, :NKQ * D].unflatten(1, (NKQ, D))[None]
        k = y[:, NKQ * D:2 * NKQ * D].unflatten(1, (NKQ, D))[None]
        v = y[:, 2 * NKQ * D:].unflatten(1, (NV, D))[None]
        g = (-a_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias.float()))[None]
        beta = torch.sigmoid(b.float())[None]
        o4 = out.view(1, T, NV, D)
        t_core = timed(lambda: flywheel.gated_delta_rule_prefill(
            q, k, v, g, beta, rec, [1], cu_seqlens=np.array([0, T], np.int32),
            read_state_indices=[-1], use_qk_l2norm_in_kernel=True, out=o4), args.reps)
        xin = qkv[None].transpose(1, 2)
        t_conv = timed(lambda: flywheel.causal_conv1d_fn(xin, w, activation="silu", out=xc),
                       args.reps)
        print(f"prefill T={T}: layer {fmt(t_layer)}  core {fmt(t_core)}  conv {fmt(t_conv)}  "
              f"layer / core = {t_layer[0] / t_core[0]:.3f}")
        # mixed: 60 decodes + one 2K prefill
        P, ND = 2048, 60
        Tm = ND + P
        qkv, b, a, w, a_log, dt_bias, conv, rec = setup(Tm, ND + 2, rng)
        qsl = np.concatenate([np.arange(ND + 1), [ND + P]]).astype(np.int32)
        seq_lens = np.concatenate([np.full(ND, 100), [P]]).astype(np.int32)
        sidx = np.arange(1, ND + 2, dtype=np.int32)
        out = torch.empty(Tm, NV * D, dtype=torch.bfloat16)
        t_mixed = timed(layer(args, qkv, b, a, w, a_log, dt_bias, conv, rec, qsl, seq_lens, sidx,
                              np.array([ND, ND + 1, ND + 1], np.int32), out), args.reps)
        dec = layer(args, qkv[:ND], b[:ND], a[:ND], w, a_log, dt_bias, conv, rec, qsl[:ND + 1],
                    seq_lens[:ND], sidx[:ND], np.array([ND, ND, ND], np.int32), out[:ND])
        pre = layer(args, qkv[ND:], b[ND:], a[ND:], w, a_log, dt_bias, conv, rec,
                    np.array([0, P], np.int32), seq_lens[ND:], sidx[ND:],
                    np.array([0, 1, 1], np.int32), out[ND:])
        t_apart = timed(lambda: (dec(), pre()), args.reps)
        print(f"mixed {ND} decodes + {P} prefill: one call {fmt(t_mixed)}  two calls "
              f"{fmt(t_apart)}  one / two = {t_mixed[0] / t_apart[0]:.3f}")
        # decode of 64 sequences
        N = 64
        qkv, b, a, w, a_log, dt_bias, conv, rec = setup(N, N + 1, rng)
        qsl = np.arange(N + 1, dtype=np.int32)
        seq_lens, sidx = np.full(N, 50, np.int32), np.arange(1, N + 1, dtype=np.int32)
        out = torch.empty(N, NV * D, dtype=torch.bfloat16)
        t_dec = timed(layer(args, qkv, b, a, w, a_log, dt_bias, conv, rec, qsl, seq_lens, sidx,
                            np.array([N, N, N], np.int32), out), args.reps * 4)
        nbytes = N * NV * D * D * 4 * 2 + N * (K - 1) * DIM * 2 * 2
        bw = flywheel._lib.ctypes.c_double()
        flywheel._clib.fw_read_bandwidth(args.threads, 1 << 30, flywheel._lib.ctypes.byref(bw))
        gbps = nbytes / t_dec[0] / 1e9
        print(f"decode {N} seqs: {fmt(t_dec)}  {gbps:.1f} GB/s states moved = "
              f"{100 * gbps / bw.value:.0f}% of {bw.value:.1f} GB/s read bandwidth")
        # ReplaySSM decodes against the plain ones
        W, dim = 16, flywheel.replay_record_dim(NKQ, NV, D, D)
        for N in (1, 64):
            qkv, b, a, w, a_log, dt_bias, conv, rec = setup(N, N + 1, rng)
            rec.normal_(0, 0.1)
            qsl = np.arange(N + 1, dtype=np.int32)
            seq_lens, sidx = np.full(N, 50, np.int32), np.arange(1, N + 1, dtype=np.int32)
            dist = np.array([N, N, N], np.int32)
            out = torch.empty(N, NV * D, dtype=torch.bfloat16)
            shadow = rec.to(torch.bfloat16)
            records = torch.randn(N + 1, W, dim) * 0.1
            records[:, :, NV * D + NKQ * D:] = -records[:, :, NV * D + NKQ * D:].abs()
            t_plain = timed(layer(args, qkv, b, a, w, a_log, dt_bias, conv, rec, qsl, seq_lens,
                                  sidx, dist, out), args.reps * 4)
            times = []
            for committed in (8, W):
                lens = np.full(N, committed, np.int32)
                times.append(timed(lambda: flywheel.fused_conv1d_gdn_replay(
                    qkv, b, a, conv, rec, shadow, records, w, None, a_log, dt_bias, qsl, sidx,
                    dist, seq_lens, sidx, lens, n_kq=NKQ, n_v=NV, d_k=D, d_v=D, kernel_size=K,
                    replay_window=W, out=out, precision="f32" if args.replay_f32 else None),
                    args.reps * 4))
            print(f"replay {N} seqs ({'f32 checkpoint' if args.replay_f32 else 'bf16 shadow'} "
                  f"reads): plain decode {fmt(t_plain)}  replay step {fmt(times[0])}  "
                  f"flush step {fmt(times[1])}  plain / replay = {t_plain[0] / times[0][0]:.2f}, "
                  f"per step over a window of {W} = "
                  f"{t_plain[0] / ((W - 1) * times[0][0] + times[1][0]) * W:.2f}")


if __name__ == "__main__":
    main()
