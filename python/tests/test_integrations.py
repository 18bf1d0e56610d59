"""flywheel.integrations.transformers: a tiny Qwen3-Next (one Gated DeltaNet layer, one
attention layer, MoE) gives transformers' logits through flywheel's kernels, prefill and
decode, float32 and bfloat16, with flywheel's calls really taken; disable() restores
transformers' functions."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mq = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

import flywheel  # noqa: E402
import flywheel.integrations.transformers as fwt  # noqa: E402

GDN_FUNCS = ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
             "torch_recurrent_gated_delta_rule")


@pytest.fixture
def torch_paths(monkeypatch):
    """transformers' own torch functions for the baseline: with fla installed it would take
    fla's Triton kernels, which do not run on a CPU."""
    for fn in GDN_FUNCS:
        f = getattr(mq, fn)
        monkeypatch.setattr(mq, fn, getattr(f, "__wrapped__", f))
    yield
    fwt.disable()


def tiny_model(dtype):
    cfg = transformers.Qwen3NextConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=4, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, partial_rotary_factor=0.25,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.Qwen3NextForCausalLM(cfg).to(dtype).eval()


def counting(monkeypatch, names):
    """Wrap flywheel's calls the integration makes with counters."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        orig = getattr(flywheel, name)

        def wrapper(*a, _orig=orig, _name=name, **k):
            counts[_name] += 1
            return _orig(*a, **k)
        monkeypatch.setattr(fwt.flywheel, name, wrapper)
    return counts


def fallbacks(monkeypatch):
    """Count the attention calls the integration hands back to transformers (sdpa, or the
    model's eager attention): a list that grows by one a call."""
    calls, orig = [], fwt._fallback
    monkeypatch.setattr(fwt, "_fallback", lambda *a, **k: calls.append(1) or orig(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_qwen3_next_logits_match(torch_paths, monkeypatch, dtype):
    dt = getattr(torch, dtype)
    model = tiny_model(dt)
    ids = torch.randint(0, 1000, (2, 90), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=4, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    with torch.no_grad():
        ref = model(ids).logits.float()
        ref_gen = model.generate(ids, **gen)
        fwt.enable(model)
        counts = counting(monkeypatch, ["flash_attn_func", "chunk_gated_delta_rule",
                                        "gated_delta_rule_decode", "causal_conv1d_fn",
                                        "causal_conv1d_update"])
        got = model(ids).logits.float()
        got_gen = model.generate(ids, **gen)
    assert all(counts.values()), counts  # every kernel of the integration ran
    big = ref.abs().max().item()
    if dtype == "float32":
        assert (got - ref).abs().max().item() <= 1e-4 * (1 + big)
        assert torch.equal(got_gen.sequences, ref_gen.sequences)
        for a, b in zip(got_gen.logits, ref_gen.logits):
            assert (a - b).abs().max().item() <= 1e-4 * (1 + big)
    else:  # bf16 products and roundings differ from torch's: close, and the same top-1 mostly
        assert (got - ref).abs().max().item() <= 0.05 * (1 + big)
        top = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert top >= 0.95, top


def test_decode_step_updates_a_bf16_state_in_place(torch_paths):
    """The decode replacement on a bf16 cache state: updated in place (the tensor returned is
    the cache's), the bits of the same step on its float32 copy rounded once."""
    g_ = torch.Generator().manual_seed(4)
    B, H, HV, K, V = 2, 2, 4, 16, 16
    q, k = (torch.randn(B, 1, H, K, generator=g_, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, 1, HV, V, generator=g_, dtype=torch.bfloat16)
    g = -torch.rand(B, 1, HV, generator=g_)
    beta = torch.rand(B, 1, HV, generator=g_)
    s16 = (torch.randn(B, HV, K, V, generator=g_) * 0.3).to(torch.bfloat16)
    s32 = s16.float()
    fwt.enable()
    try:
        step = mq.torch_recurrent_gated_delta_rule
        o32, f32 = step(q, k, v, g, beta, initial_state=s32, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        o16, f16 = step(q, k, v, g, beta, initial_state=s16, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
    finally:
        fwt.disable()
    assert f16 is s16 and f32 is s32
    assert torch.equal(o16, o32)
    assert torch.equal(s16.view(torch.int16), s32.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_take_flywheel_and_agree(torch_paths, monkeypatch, side):
    """A padded batch (3 sequences, one unpadded): every attention call goes to flywheel, one
    call a sequence on its real tokens, none to sdpa; the logits of the real tokens agree with
    transformers' sdpa, and (left padding) so do greedy generations, whose decode steps
    carry the padding too (one KV-cache call a step, with cache_leftpad)."""
    model = tiny_model(torch.float32)
    ids = torch.randint(0, 1000, (3, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    if side == "left":
        mask[1, :7] = 0
        mask[2, :30] = 0
    else:
        mask[1, 33:] = 0
        mask[2, 10:] = 0
    gen = dict(max_new_tokens=3, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        ref_gen = model.generate(ids, attention_mask=mask, **gen) if side == "left" else None
        fwt.enable(model)
        counts = counting(monkeypatch, ["flash_attn_func", "flash_attn_with_kvcache"])
        fell = fallbacks(monkeypatch)
        got = model(ids, attention_mask=mask).logits
        assert counts["flash_attn_func"] == 3 and not fell, (counts, len(fell))
        got_gen = model.generate(ids, attention_mask=mask, **gen) if side == "left" else None
    assert not fell
    keep = mask.bool()
    big = ref.abs().max().item()
    assert (got[keep] - ref[keep]).abs().max().item() <= 1e-4 * (1 + big)
    if side == "left":
        # the prefill, a call a sequence; then 2 decode steps, a call each
        assert counts == {"flash_attn_func": 3 + 3, "flash_attn_with_kvcache": 2}, counts
        assert torch.equal(got_gen.sequences, ref_gen.sequences)
        for a, b in zip(got_gen.logits, ref_gen.logits):
            assert (a - b).abs().max().item() <= 1e-4 * (1 + big)


def test_padding_with_holes_takes_sdpa(torch_paths, monkeypatch):
    """A mask flywheel's calls cannot express (padding inside a sequence) goes to sdpa."""
    model = tiny_model(torch.float32)
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 5:9] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        fwt.enable(model)
        counts = counting(monkeypatch, ["flash_attn_func"])
        fell = fallbacks(monkeypatch)
        got = model(ids, attention_mask=mask).logits
    assert counts["flash_attn_func"] == 0 and fell
    keep = mask.bool()
    assert (got[keep] - ref[keep]).abs().max().item() <= 1e-4 * (1 + ref.abs().max().item())


def test_mask_runs_of_each_layout():
    """_runs: per sequence the real query rows and the keys they see, or None."""
    t = torch.tensor
    assert fwt._runs(None, 2, 10, 0, 10) == ((0, 10, 0, 10),) * 2
    assert fwt._runs(None, 1, 10, 6, 4) == ((0, 4, 0, 10),)      # a chunk after a cache
    left = t([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert fwt._runs(left, 2, 5, 0, 5) == ((2, 5, 2, 5), (0, 5, 0, 5))
    assert fwt._runs(left, 2, 5, 4, 1) == ((0, 1, 2, 5), (0, 1, 0, 5))  # decode
    right = t([[1, 1, 1, 0, 0]], dtype=torch.bool)
    assert fwt._runs(right, 1, 5, 0, 5) == ((0, 3, 0, 3),)
    assert fwt._runs(right, 1, 5, 1, 2) == ((0, 2, 0, 3),)       # a static cache's free rows
    assert fwt._runs(t([[0, 0, 0]], dtype=torch.bool), 1, 3, 0, 3) == ((0, 0, 0, 0),)
    assert fwt._runs(t([[1, 0, 1]], dtype=torch.bool), 1, 3, 0, 3) is None  # a hole
    assert fwt._runs(None, 1, 4, 2, 3) is None                   # queries past the keys
    assert fwt._runs(left, 3, 5, 0, 5) is None                   # the wrong batch


class _Attn:
    is_causal = True
    num_key_value_groups = 2
    training = False


@pytest.mark.parametrize("case", ["uneven left", "right", "same left, decode",
                                  "same left, chunk after a cache", "static cache",
                                  "uneven left, decode", "uneven left, chunk after a cache"])
def test_attention_on_each_padding_layout_matches_sdpa(case, monkeypatch):
    """attention() on _mask's mask against sdpa on the same mask, real rows: per-sequence
    calls, the one-call path when every sequence has the same keys (the same left padding
    before a cache's new rows: the keys start past the padding), and one KV-cache call with
    cache_leftpad for a few query rows after uneven left padding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import causal_mask_function
    b, sk = 3, 24
    pad = torch.ones(b, sk, dtype=torch.bool)
    sq, q0 = sk, 0
    if case.startswith("uneven left"):
        pad[1, :5], pad[2, :17] = False, False
        if case != "uneven left":
            sq = 1 if case.endswith("decode") else 5
            q0 = sk - sq
    elif case == "right":
        pad[0, 20:], pad[2, 9:] = False, False
    elif case.startswith("same left"):
        pad[:, :6] = False
        sq = 1 if case.endswith("decode") else 5
        q0 = sk - sq
    else:  # a static cache: 16 tokens held, 4 new, the rest free
        pad[:, 20:] = False
        pad[1, :3] = False
        sq, q0 = 4, 16
    g = torch.Generator().manual_seed(6)
    q = torch.randn(b, 4, sq, 16, generator=g)
    k, v = (torch.randn(b, 2, sk, 16, generator=g) for _ in range(2))
    m = fwt._mask(batch_size=b, q_length=sq, kv_length=sk, q_offset=q0,
                  mask_function=causal_mask_function, attention_mask=pad)
    runs, window = m._flywheel_runs
    assert window is None
    counts = counting(monkeypatch, ["flash_attn_func", "flash_attn_with_kvcache"])
    got = fwt.attention(_Attn(), q, k, v, m, scaling=0.25)[0]
    if case.startswith("same left"):
        assert counts == {"flash_attn_func": 1, "flash_attn_with_kvcache": 0}
    elif case.startswith("uneven left,") or case == "static cache":  # 1 or 4 rows, at the end
        assert counts == {"flash_attn_func": 0, "flash_attn_with_kvcache": 1}
    else:
        assert counts == {"flash_attn_func": b, "flash_attn_with_kvcache": 0}
    ref = sdpa_attention_forward(_Attn(), q, k, v, m, scaling=0.25)[0]
    for i, (r0, r1, _, _) in enumerate(runs):
        assert r1 > r0
        assert (got[i, r0:r1] - ref[i, r0:r1]).abs().max().item() <= 1e-5
        assert not got[i, :r0].any() and not got[i, r1:].any()  # padding rows: zero


def tiny_gemma2():
    cfg = transformers.Gemma2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"], attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("padded", [False, True])
def test_gemma2_softcap_and_sliding_window_on_flywheel(monkeypatch, padded):
    """Gemma 2 (a softcap in every layer, a sliding window of 8 in one of two; prompts of 20
    tokens, longer than the window): every attention call is flywheel's, none goes to the
    fallback, and logits and greedy generations agree with transformers' eager attention
    (sdpa cannot take a softcap); padded, for the real tokens of a left-padded batch."""
    model = tiny_gemma2()
    ids = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0
    gen = dict(max_new_tokens=3, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        ref_gen = model.generate(ids, attention_mask=mask, **gen)
        fwt.enable(model)
        try:
            counts = counting(monkeypatch, ["flash_attn_func"])
            fell = fallbacks(monkeypatch)
            got = model(ids, attention_mask=mask).logits
            got_gen = model.generate(ids, attention_mask=mask, **gen)
        finally:
            fwt.disable(model, "eager")
    assert counts["flash_attn_func"] > 0 and not fell, (counts, len(fell))
    keep = mask.bool()
    big = ref.abs().max().item()
    assert (got[keep] - ref[keep]).abs().max().item() <= 1e-4 * (1 + big)
    assert torch.equal(got_gen.sequences, ref_gen.sequences)
    for a, b in zip(got_gen.logits, ref_gen.logits):
        assert (a - b).abs().max().item() <= 1e-4 * (1 + big)


def test_chunked_local_mask_is_not_taken_for_a_window():
    """A local mask that is not a sliding window (chunked attention's) gets no runs: the
    check against causality + window refuses it, and attention would fall back."""
    from transformers.masking_utils import (chunked_causal_mask_function,
                                            sliding_window_causal_mask_function)
    kw = dict(batch_size=1, q_length=12, kv_length=12, local_size=4, allow_is_causal_skip=True)
    chunked = chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    m = fwt._mask(mask_function=chunked, **kw)
    assert m is not None and not hasattr(m, "_flywheel_runs")
    m = fwt._mask(mask_function=sliding_window_causal_mask_function(4), **kw)
    assert m._flywheel_runs == (((0, 12, 0, 12),), 4)


def test_disable_restores_transformers_functions(torch_paths):
    before = {fn: getattr(mq, fn) for fn in GDN_FUNCS}
    fwt.enable()
    assert all(getattr(mq, fn) is not before[fn] for fn in GDN_FUNCS)
    fwt.disable()
    assert all(getattr(mq, fn) is before[fn] for fn in GDN_FUNCS)


def test_enable_shares_torchs_threads(torch_paths):
    """enable(): flywheel's loops on torch's OpenMP threads (where the package has its OpenMP
    loop), disable() back to its own; share_threads=False leaves them alone."""
    fwt.disable()
    assert flywheel.threading_mode() == ("own", 0)
    try:
        fwt.enable()
        mode = flywheel.threading_mode()
        if mode[0] == "own":
            pytest.skip("no OpenMP loop in this build: enable() keeps the library's threads")
        assert mode == ("openmp", torch.get_num_threads())
        fwt.disable()
        assert flywheel.threading_mode() == ("own", 0)
        fwt.enable(share_threads=False)
        assert flywheel.threading_mode() == ("own", 0)
    finally:
        fwt.disable()


def loss_and_grads(model, ids):
    """A language-model training step's loss on ids and every parameter's gradient."""
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.grad is not None}


def test_training_takes_flywheels_backward(torch_paths, monkeypatch):
    """With gradients: attention runs flywheel's forward and backward, the Gated DeltaNet layer
    transformers' own functions; the loss and the parameters' gradients agree with sdpa's."""
    model = tiny_model(torch.float32).train()
    ids = torch.randint(0, 1000, (2, 50), generator=torch.Generator().manual_seed(3))

    ref_loss, ref = loss_and_grads(model, ids)
    fwt.enable(model)
    counts = counting(monkeypatch, ["flash_attn_func", "chunk_gated_delta_rule"])
    backward = flywheel.attention.flash_attn_backward  # what the autograd.Function calls
    calls = []
    monkeypatch.setattr(flywheel.attention, "flash_attn_backward",
                        lambda *a, **k: calls.append(1) or backward(*a, **k))
    loss, got = loss_and_grads(model, ids)
    assert counts["flash_attn_func"] and calls, (counts, calls)
    assert counts["chunk_gated_delta_rule"] == 0  # torch's, with gradients
    assert abs(loss - ref_loss) <= 1e-5 * (1 + abs(ref_loss))
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        assert (got[name] - g).abs().max().item() <= 1e-4 * (1 + g.abs().max().item()), name


def test_outputs_reused_only_when_unreferenced(torch_paths):
    """The kept output comes back only once nothing refers to it; reuse can be turned off;
    threads never share one; disable() drops them; a model run twice gives the same logits
    with outputs reused as without."""
    import threading
    fwt.enable()
    a = fwt._output("t", (4, 8), torch.float32)
    a_ptr = a.data_ptr()
    view = a[1:]
    b = fwt._output("t", (4, 8), torch.float32)  # a's view is alive: a new array
    assert b.data_ptr() != a_ptr
    del a, view
    c = fwt._output("t", (4, 8), torch.float32)  # b is kept and unreferenced (but by c)
    assert c.data_ptr() == b.data_ptr()
    del b
    like = torch.empty(2, 6, 3).transpose(1, 2)  # the layout of `like` is kept
    d = fwt._output("conv", like.shape, like.dtype, like=like)
    assert d.stride() == like.stride()
    other = []
    t = threading.Thread(target=lambda: other.append(fwt._output("t", (4, 8), torch.float32)))
    t.start()
    t.join()
    ptr_c = c.data_ptr()
    del c
    assert other[0].data_ptr() != ptr_c  # another thread has its own
    assert fwt._output("t", (4, 8), torch.float32).data_ptr() == ptr_c
    fwt.disable()
    assert fwt._kept_all and not any(box.arrays for box in fwt._kept_all)
    fwt.enable(reuse_outputs=False)
    assert fwt._output("t", (4, 8), torch.float32) is None
    model = tiny_model(torch.float32)
    ids = torch.randint(0, 1000, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fwt.enable(model, reuse_outputs=False)
        ref = model(ids).logits
        fwt.enable(model)
        first, second = model(ids).logits, model(ids).logits
    assert torch.equal(first, ref) and torch.equal(second, ref)


def tiny_gpt_oss():
    """gpt-oss at toy size: sinks in every layer, a sliding window of 8 in one of two, MoE.
    The sinks are drawn with std 2 (the initialiser gives about 0) so that they matter."""
    cfg = transformers.GptOssConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def sinks_passed(monkeypatch):
    """Wrap flywheel's attention calls the integration makes: a list of the sinks each got."""
    got = []
    for name in ("flash_attn_func", "flash_attn_with_kvcache"):
        orig = getattr(flywheel, name)

        def wrapper(*a, _orig=orig, **k):
            got.append(k.get("sinks"))
            return _orig(*a, **k)
        monkeypatch.setattr(fwt.flywheel, name, wrapper)
    return got


@pytest.mark.parametrize("padded", [False, True])
def test_gpt_oss_sinks_and_sliding_window_on_flywheel(monkeypatch, padded):
    """gpt-oss (attention sinks in every layer, passed as s_aux; a sliding window of 8 in one
    layer of two; prompts of 20 tokens): every attention call is flywheel's with the layer's
    sinks, none falls back, and logits and greedy generations agree with transformers' eager
    attention within 1e-4 (1 + max|logit|); padded, for the real tokens of a left-padded
    batch. Without the sinks the logits differ by far more than that."""
    model = tiny_gpt_oss()
    ids = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0
    gen = dict(max_new_tokens=4, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=0)
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    func, kvcache = flywheel.flash_attn_func, flywheel.flash_attn_with_kvcache
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        ref_gen = model.generate(ids, attention_mask=mask, **gen)
        fwt.enable(model)
        try:
            passed = sinks_passed(monkeypatch)
            fell = fallbacks(monkeypatch)
            got = model(ids, attention_mask=mask).logits
            got_gen = model.generate(ids, attention_mask=mask, **gen)
            monkeypatch.setattr(fwt.flywheel, "flash_attn_func",
                                lambda *a, **k: func(*a, **{**k, "sinks": None}))
            monkeypatch.setattr(fwt.flywheel, "flash_attn_with_kvcache",
                                lambda *a, **k: kvcache(*a, **{**k, "sinks": None}))
            no_sinks = model(ids, attention_mask=mask).logits
        finally:
            fwt.disable(model, "eager")
    assert passed and not fell, (len(passed), len(fell))
    assert all(any(s is t for t in sinks) for s in passed)
    keep = mask.bool()
    big = ref.abs().max().item()
    assert (got[keep] - ref[keep]).abs().max().item() <= 1e-4 * (1 + big)
    assert (no_sinks[keep] - ref[keep]).abs().max().item() > 1e-2 * (1 + big)
    assert torch.equal(got_gen.sequences, ref_gen.sequences)
    for a, b in zip(got_gen.logits, ref_gen.logits):
        assert (a - b).abs().max().item() <= 1e-4 * (1 + big)


def test_gpt_oss_training_takes_flywheels_backward_with_sinks(monkeypatch):
    """A gpt-oss training step on 7 tokens (fewer than the sliding window of 8, so no layer
    gets a mask): every attention call is flywheel's forward and backward, none falls back, and the
    loss and every parameter's gradient, the sinks' included, agree with eager attention's
    within 1e-4 (1 + max|gradient|)."""
    model = tiny_gpt_oss().train()
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(3))

    ref_loss, ref = loss_and_grads(model, ids)
    fwt.enable(model)
    try:
        passed = sinks_passed(monkeypatch)
        fell = fallbacks(monkeypatch)
        backward = flywheel.attention.flash_attn_backward
        calls = []
        monkeypatch.setattr(flywheel.attention, "flash_attn_backward",
                            lambda *a, **k: calls.append(k.get("sinks")) or backward(*a, **k))
        loss, got = loss_and_grads(model, ids)
    finally:
        fwt.disable(model, "eager")
    assert len(passed) == 2 and len(calls) == 2 and not fell, (len(passed), len(calls), len(fell))
    assert all(s is not None for s in passed + calls)
    assert abs(loss - ref_loss) <= 1e-5 * (1 + abs(ref_loss))
    assert got.keys() == ref.keys()
    assert any(name.endswith("sinks") for name in ref)
    for name, g in ref.items():
        assert (got[name] - g).abs().max().item() <= 1e-4 * (1 + g.abs().max().item()), name
