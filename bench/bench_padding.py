"""Padded batches in transformers: flywheel's attention (flywheel.integrations.transformers:
for the prefill one call per sequence on its real tokens, for the decode step one KV-cache
call with cache_leftpad) against transformers' sdpa on its masked path, the attention call
alone on the same mask and inputs.

    python bench/bench_padding.py [--threads 2] [--reps 3] [--decode-reps 50]

A batch of 4 sequences with 0 / 256 / 512 / 1024 padding tokens (left) of 2048, GQA 16:2,
d 256 (the attention layers of bench/e2e.py's model), bf16 and f32: the prefill, and one
decode step against the 2048 keys. Prints medians and ranges, the ratio, the time to build
the mask (sdpa's mask and the runs), and the largest difference on the real rows.
Times are medians and ranges over the repetitions, after a warm-up call."""

import argparse

import torch
from bench_layer import timed  # a warm-up call, then medians and ranges of reps
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function

import flywheel.integrations.transformers as fwt


class _Module:
    is_causal = True
    num_key_value_groups = 8
    training = False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-reps", type=int, default=50)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    b, sk, pads, scale = 4, 2048, (0, 256, 512, 1024), 256 ** -0.5
    fwt.enable(share_threads=False)
    for dt in (torch.bfloat16, torch.float32):
        for sq in (sk, 1):
            q = torch.randn(b, 16, sq, 256, dtype=dt)
            k, v = (torch.randn(b, 2, sk, 256, dtype=dt) for _ in range(2))
            pad = torch.ones(b, sk, dtype=torch.bool)
            for i, p in enumerate(pads):
                pad[i, :p] = False

            def mask():
                return fwt._mask(batch_size=b, q_length=sq, kv_length=sk, q_offset=sk - sq,
                                 kv_offset=0, mask_function=causal_mask_function,
                                 attention_mask=pad)
            m = mask()
            reps = a.reps if sq > 1 else a.decode_reps
            ts = timed(lambda: sdpa_attention_forward(_Module(), q, k, v, m, scaling=scale), reps)
            tf = timed(lambda: fwt.attention(_Module(), q, k, v, m, scaling=scale), reps)
            tm = timed(mask, reps)
            ref = sdpa_attention_forward(_Module(), q, k, v, m, scaling=scale)[0].float()
            got = fwt.attention(_Module(), q, k, v, m, scaling=scale)[0].float()
            keep = torch.zeros(b, sq, dtype=torch.bool)
            for i, (r0, r1, _, _) in enumerate(m._flywheel_runs[0]):
                keep[i, r0:r1] = True
            err = (got - ref)[keep].abs().max().item()
            kind = "prefill" if sq > 1 else "decode "
            print(f"{kind} {str(dt)[6:]:8s} batch {b}, {sk} keys, padding {pads}: "
                  f"sdpa {ts[0] * 1e3:.2f} ms ({ts[1] * 1e3:.2f}-{ts[2] * 1e3:.2f}), "
                  f"flywheel {tf[0] * 1e3:.2f} ms ({tf[1] * 1e3:.2f}-{tf[2] * 1e3:.2f}), "
                  f"{ts[0] / tf[0]:.2f}x; mask {tm[0] * 1e3:.2f} ms; max diff {err:.1e}")
    fwt.disable()


if __name__ == "__main__":
    main()
