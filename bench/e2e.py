"""`make e2e`: a Qwen3-Next-style hybrid model inside transformers, its default CPU kernels
against flywheel's (flywheel.integrations.transformers), in one process.

The model is built from a config with seeded random weights (no download): 8 layers, 6 Gated
DeltaNet and 2 attention ([GDN, GDN, GDN, attention] x 2), hidden 2048, GDN 16 q/k heads and
32 value heads of 128 with a width-4 conv, attention GQA 16:2 of head dim 256 with partial
rotary (0.25), a small MoE (8 experts of 512, 2 per token, a shared expert of 512), vocab
32000: 0.6 B parameters.

Per dtype (bf16, f32) and prompt length (2K, 8K): the prefill of one prompt (cache on), then
--decode steps of one token each; default = transformers' torch functions (sdpa attention and
its torch delta rule and conv: with fla installed transformers would pick fla's Triton kernels,
which do not run on a CPU) vs flywheel. Reported: median of --reps prefills and of the decode
steps, tokens/s, the time inside each kind of kernel (attention function, GDN kernel, conv;
"rest" is projections, MoE, norms), and the logits' agreement: max |flywheel - default| over
the prefill logits and top-1 agreement, measured with dense expert routing (every expert on
every token) so that a bf16 routing flip cannot hide or fake a kernel difference; in bf16 also
both against default f32, which shows how far bf16 alone moves the logits of this random
model.

Inside the engine step (flywheel's kernels, prompts of --step-len tokens): each kind of kernel
per call inside the model (its time in the timed prefill or decode steps over its calls)
against the same call alone: the first call of each kind in one more prefill and one more
decode step is recorded (its tensors copied with their strides, outside any timing) and
replayed --step-reps times back to back after that step; the median is "alone". The rest of
the step (torch's own ops) is compared with the default run's rest. After a model is built,
gc.freeze() takes its objects out of Python's cyclic collector, as engines do after loading.

Usage: python bench/e2e.py [--threads N] [--lengths 2048,8192] [--decode 32] [--reps 2]
                            [--dtypes bfloat16,float32] [--step-len 2048] [--step-reps 5]
                            [--build TEXT] [--out docs/e2e]
"""

import argparse
import contextlib
import datetime
import gc
import os
import platform
import statistics
import sys
import time

import torch
import transformers
import transformers.models.qwen3_next.modeling_qwen3_next as mq
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import flywheel
import flywheel.integrations.transformers as fwt

GDN_FUNCS = {"torch_chunk_gated_delta_rule": "GDN kernel",
             "torch_recurrent_gated_delta_rule": "GDN kernel",
             "causal_conv1d_fn": "conv", "causal_conv1d_update": "conv"}


def config(dense_routing=False):
    return transformers.Qwen3NextConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=1024, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 +
        ["full_attention"],
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=8 if dense_routing else 2, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, decoder_sparse_step=1, max_position_embeddings=16384,
        attn_implementation="sdpa")


def _copy(x):
    """x with its own memory, strides kept (a view into a larger array keeps its layout)."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype).copy_(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(v) for v in x)
    return x


class Timers:
    """Seconds spent inside the wrapped kernel functions, by kind, and their call counts
    (n); while recording, the first call of each kind (its function and copied arguments)."""

    def __init__(self):
        self.t, self.n, self.calls = {}, {}, {}
        self.on = self.recording = False

    def wrap(self, fn, kind):
        def timed(*a, **k):
            if self.recording and kind not in self.calls:
                self.calls[kind] = (fn, _copy(a), {n: _copy(v) for n, v in k.items()})
            if not self.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[kind] = self.t.get(kind, 0.0) + time.perf_counter() - t0
                self.n[kind] = self.n.get(kind, 0) + 1
        return timed

    @contextlib.contextmanager
    def measure(self):
        self.t, self.n, self.on = {}, {}, True
        try:
            yield self.t
        finally:
            self.on = False

    @contextlib.contextmanager
    def record(self):
        self.calls, self.recording = {}, True
        try:
            yield self.calls
        finally:
            self.recording = False

    def alone(self, reps):
        """Median seconds of each recorded call replayed `reps` times: back to back (hot), and
        each after writing 64 MiB elsewhere (cold: its data out of this machine's caches, as
        an engine step's other layers leave it): {kind: (hot, cold)}."""
        evict = torch.zeros(16 << 20)
        out = {}
        for kind, (fn, a, k) in self.calls.items():
            ts = {True: [], False: []}
            for cold in (False, True):
                for _ in range(reps):
                    if cold:
                        evict.add_(1.0)
                    t0 = time.perf_counter()
                    fn(*a, **k)
                    ts[cold].append(time.perf_counter() - t0)
            out[kind] = (statistics.median(ts[False]), statistics.median(ts[True]))
        self.calls = {}
        return out


_ORIG = {}


def install(mode, timers, model):
    """The default kernels (transformers' torch functions, sdpa) or flywheel's, timed."""
    fwt.disable()
    if not _ORIG:  # transformers' own, once: the torch functions under its fla dispatch
        for name in GDN_FUNCS:
            f = getattr(mq, name)
            _ORIG[name] = getattr(f, "__wrapped__", f)
        _ORIG["sdpa"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
    for name in GDN_FUNCS:
        setattr(mq, name, _ORIG[name])
    fwt.enable()
    _ORIG.setdefault("flywheel", ALL_ATTENTION_FUNCTIONS["flywheel"])
    if mode != "flywheel":
        fwt.disable()
    for name, kind in GDN_FUNCS.items():
        setattr(mq, name, timers.wrap(getattr(mq, name), kind))
    attn = "flywheel" if mode == "flywheel" else "sdpa"
    ALL_ATTENTION_FUNCTIONS[attn] = timers.wrap(_ORIG[attn], "attention")
    model.set_attn_implementation(attn)


def _cache(out):
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


def run(model, ids, decode, timers):
    """One prefill with the cache on, then `decode` greedy steps: (prefill s, its kernel
    times, [decode s], decode kernel times summed, per-call kernel times of the prefill and
    of the decode steps)."""
    with timers.measure() as tp:
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        pre = time.perf_counter() - t0
    tp, pcall = dict(tp), {k: v / timers.n[k] for k, v in tp.items()}
    cache, nxt = _cache(out), out.logits[:, -1:].argmax(-1)
    steps, td, tn = [], {}, {}
    for _ in range(decode):
        with timers.measure() as t:
            t0 = time.perf_counter()
            o = model(nxt, cache=cache, use_cache=True)
            steps.append(time.perf_counter() - t0)
        for k, v in t.items():
            td[k] = td.get(k, 0.0) + v
            tn[k] = tn.get(k, 0) + timers.n[k]
        cache, nxt = _cache(o), o.logits[:, -1:].argmax(-1)
    return pre, tp, steps, td, (pcall, {k: v / tn[k] for k, v in td.items()})


def engine_step(model, ids, timers, reps):
    """Each kind's first call in one more prefill and in one more decode step, replayed alone
    (Timers.alone): ({kind: prefill call s}, {kind: decode call s})."""
    with timers.record():
        out = model(ids, use_cache=True)
    pre = timers.alone(reps)
    nxt = out.logits[:, -1:].argmax(-1)
    with timers.record():
        model(nxt, cache=_cache(out), use_cache=True)
    return pre, timers.alone(reps)


def agreement(dtype, T, timers):
    """Prefill logits with dense expert routing: flywheel against default in the same dtype
    (max |difference|, largest logit, top-1 agreement), and for a dtype other than f32 both
    against default f32 (the same two figures each): how far the dtype itself moves them."""
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config(dense_routing=True)).eval()
    ids = torch.randint(0, 32000, (1, T), generator=torch.Generator().manual_seed(1))
    logits = {}
    with torch.no_grad():
        if dtype != torch.float32:
            install("default", timers, model)
            logits["f32"] = model(ids).logits.float()
        model = model.to(dtype)
        for mode in ("default", "flywheel"):
            install(mode, timers, model)
            logits[mode] = model(ids).logits.float()

    def cmp(a, b):
        return (a - b).abs().max().item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    d, f = logits["default"], logits["flywheel"]
    res = dict(same=cmp(f, d), big=d.abs().max().item())
    if "f32" in logits:
        res["default_vs_f32"] = cmp(d, logits["f32"])
        res["flywheel_vs_f32"] = cmp(f, logits["f32"])
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--agree-len", type=int, default=512)
    ap.add_argument("--build", default="the default build (its own thread pool)",
                    help="which flywheel build runs, for the report")
    ap.add_argument("--step-len", type=int, default=2048)
    ap.add_argument("--step-reps", type=int, default=5)
    ap.add_argument("--out", default="docs/e2e")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flywheel.set_num_threads(args.threads)
    timers = Timers()
    rows, agree = [], {}
    for dtn in args.dtypes.split(","):
        dtype = getattr(torch, dtn)
        torch.manual_seed(0)
        model = transformers.Qwen3NextForCausalLM(config()).to(dtype).eval()
        # as serving engines do after loading a model (vLLM's workers): the model's objects out
        # of the cyclic collector's sweeps, which otherwise land, milliseconds each, inside
        # whatever call allocates next
        gc.collect()
        gc.freeze()
        nparams = sum(p.numel() for p in model.parameters())
        for T in (int(x) for x in args.lengths.split(",")):
            ids = torch.randint(0, 32000, (1, T), generator=torch.Generator().manual_seed(T))
            for mode in ("default", "flywheel"):
                install(mode, timers, model)
                pres, steps, kern, dkern, step = [], [], {}, {}, None
                with torch.no_grad():
                    run(model, ids[:, :64], 1, timers)  # warm-up: first touches, lazy setup
                    for r in range(args.reps):
                        pre, tp, st, td, percall = run(model, ids, args.decode if r == 0 else 0,
                                                       timers)
                        pres.append(pre)
                        steps += st
                        if r == 0:
                            kern, dkern, incall = tp, td, percall
                        # per call inside the model: prefill from the last prefill (the first
                        # one's kernels fault in the outputs they keep: a 32 MiB conv output
                        # took 10.6 ms against 2.7), decode from the first (the only one with
                        # decode steps)
                        incall = (percall[0], incall[1])
                    if mode == "flywheel" and T == args.step_len:
                        step = (incall, engine_step(model, ids, timers, args.step_reps))
                pre = statistics.median(pres)
                row = dict(dtype=dtn, T=T, mode=mode, prefill=pre, prefill_range=(min(pres), max(pres)),
                           decode=statistics.median(steps) if steps else float("nan"), kern=kern,
                           dkern={k: v / max(1, len(steps)) for k, v in dkern.items()}, step=step)
                rows.append(row)
                print(f"{dtn:8s} T={T:5d} {mode:8s} prefill {pre:7.3f} s ({T / pre:7.1f} tok/s)  decode "
                      f"{row['decode'] * 1e3:7.1f} ms/step   prefill kernels: " +
                      ", ".join(f"{k} {v:.3f} s" for k, v in sorted(kern.items())), flush=True)
        del model
        agree[dtn] = agreement(dtype, args.agree_len, timers)
        print(f"{dtn}: {agreement_text(agree[dtn], args.agree_len)}", flush=True)
    report(args, rows, agree, nparams)


def agreement_text(a, T):
    t = (f"prefill logits max |flywheel - default| = {a['same'][0]:.3g} (largest logit "
         f"{a['big']:.3g}), top-1 agreement {100 * a['same'][1]:.2f}%")
    if "default_vs_f32" in a:
        t += (f"; against default f32: default {a['default_vs_f32'][0]:.3g} / "
              f"{100 * a['default_vs_f32'][1]:.2f}% top-1, flywheel {a['flywheel_vs_f32'][0]:.3g} / "
              f"{100 * a['flywheel_vs_f32'][1]:.2f}%")
    return t + f" (dense expert routing, {T} tokens)"


def step_lines(rows, by):
    """The engine-step table: flywheel's kernels per call inside the model against alone, and
    the rest of the step (torch's ops) against the default run's."""
    out = []
    for r in rows:
        if not r.get("step"):
            continue
        (pin, din), (palone, dalone) = r["step"]
        base = by[(r["dtype"], r["T"], "default")]
        out += [f"Inside the engine step, {r['dtype']}, prompt {r['T']} (flywheel's kernels per "
                f"call: inside the model / the same call alone, hot and cold, median of "
                f"replays):\n",
                "| kernel | prefill: in model | alone hot / cold | ratio to hot / cold | "
                "decode: in model | alone hot / cold | ratio to hot / cold |",
                "|---|---|---|---|---|---|---|"]
        for kind in ("attention", "GDN kernel", "conv"):
            cells = []
            for inm, alone in ((pin, palone), (din, dalone)):
                if kind in inm and kind in alone:
                    hot, cold = alone[kind]
                    cells += [f"{inm[kind] * 1e3:.3f} ms", f"{hot * 1e3:.3f} / {cold * 1e3:.3f} ms",
                              f"{inm[kind] / hot:.2f}x / {inm[kind] / cold:.2f}x"]
                else:
                    cells += ["-"] * 3
            out.append(f"| {kind} | " + " | ".join(cells) + " |")
        rest = r["prefill"] - sum(r["kern"].values())
        brest = base["prefill"] - sum(base["kern"].values())
        drest = r["decode"] - sum(r["dkern"].values())
        bdrest = base["decode"] - sum(base["dkern"].values())
        out += ["", f"The rest of the step (torch's ops), flywheel's run / default's: prefill "
                f"{rest:.2f} / {brest:.2f} s ({rest / brest:.2f}x), decode {drest * 1e3:.1f} / "
                f"{bdrest * 1e3:.1f} ms ({drest / bdrest:.2f}x).", ""]
    return out


def report(args, rows, agree, nparams):
    os.makedirs(args.out, exist_ok=True)
    by = {(r["dtype"], r["T"], r["mode"]): r for r in rows}
    lines = [f"# A Qwen3-Next-style hybrid model in transformers, default kernels vs flywheel\n",
             f"Measured {datetime.date.today().isoformat()}, {platform.machine()}, {args.threads} "
             f"threads, transformers {transformers.__version__}, torch {torch.__version__}; "
             f"{nparams / 1e9:.2f} B parameters (bench/e2e.py's docstring: the model); medians of "
             f"{args.reps} prefills and of {args.decode} decode steps; flywheel: {args.build}. "
             f"Command: `make e2e`.\n",
             "| dtype | prompt | kernels | prefill | tokens/s | speedup | decode / step | speedup | "
             "prefill: attention / GDN kernel / conv / rest |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = by[(r["dtype"], r["T"], "default")]
        k = r["kern"]
        rest = r["prefill"] - sum(k.values())
        parts = " / ".join(f"{k.get(n, 0.0):.2f}" for n in ("attention", "GDN kernel", "conv"))
        lines.append(f"| {r['dtype']} | {r['T']} | {r['mode']} | {r['prefill']:.2f} s "
                     f"({r['prefill_range'][0]:.2f}-{r['prefill_range'][1]:.2f}) | "
                     f"{r['T'] / r['prefill']:.0f} | {base['prefill'] / r['prefill']:.2f}x | "
                     f"{r['decode'] * 1e3:.1f} ms | {base['decode'] / r['decode']:.2f}x | "
                     f"{parts} / {rest:.2f} s |")
    lines += [""] + step_lines(rows, by)
    lines.append("")
    for dtn, a in agree.items():
        lines.append(f"- {dtn}: {agreement_text(a, args.agree_len)}.")
    with open(os.path.join(args.out, "e2e.md"), "w") as f:
        f.write("\n".join(lines) + "\n\n![e2e](e2e.png)\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart", file=sys.stderr)
        return
    keys = sorted({(r["dtype"], r["T"]) for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    kinds = ("attention", "GDN kernel", "conv", "rest")
    colors = dict(zip(kinds, ("#4c72b0", "#dd8452", "#55a868", "#bbbbbb")))
    labels = []
    for i, key in enumerate(keys):
        for j, mode in enumerate(("default", "flywheel")):
            r = by[key + (mode,)]
            k = dict(r["kern"])
            k["rest"] = r["prefill"] - sum(r["kern"].values())
            bottom = 0.0
            for kind in kinds:
                ax.bar(len(labels), k.get(kind, 0.0), bottom=bottom, color=colors[kind],
                       label=kind if not labels else None)
                bottom += k.get(kind, 0.0)
            short = {"bfloat16": "bf16", "float32": "f32"}.get(key[0], key[0])
            labels.append(f"{short} {key[1]}\n{mode}")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("prefill seconds")
    ax.set_title(f"Qwen3-Next-style 0.6B in transformers: prefill time by kernel kind, "
                 f"{args.threads} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "e2e.png"), dpi=110)
    print(f"wrote {os.path.join(args.out, 'e2e.md')} and e2e.png")


if __name__ == "__main__":
    main()
