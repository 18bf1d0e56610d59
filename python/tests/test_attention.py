"""flash_attn_func / flash_attn_varlen_func / flash_attn_with_kvcache against a float64 numpy
reference, torch's scaled_dot_product_attention, and each class of bad input."""

import threading

import numpy as np
import pytest

import flywheel
from flywheel import FlywheelError
from conftest import DTYPES, FAMILIES, TOL, as64, make, read_only, ref_attention, round_to, torch

SHAPES = [  # (b, sq, sk, hq, hkv, d, dv)
    (1, 1, 1, 4, 4, 64, 64),
    (2, 17, 33, 8, 2, 64, 64),
    (1, 100, 37, 6, 1, 128, 128),
    (1, 130, 130, 4, 2, 32, 48),
    (2, 65, 200, 2, 2, 256, 256),
]
MASKS = [  # (causal, window, softcap)
    (False, (-1, -1), 0.0),
    (True, (-1, -1), 0.0),
    (True, (20, -1), 0.0),
    (False, (7, 3), 30.0),
]


def check(out, lse, q, k, v, scale, causal, window, softcap, dtype):
    b = q.shape[0]
    for i in range(b):
        ro, rl = ref_attention(q[i], k[i], v[i], scale, causal, window, softcap)
        err = np.abs(as64(out)[i] - ro).max() if ro.size else 0.0
        assert err <= TOL[dtype], f"batch {i}: max error {err} over {TOL[dtype]}"
        if lse is not None:
            got = as64(lse)[i]
            assert np.array_equal(np.isinf(got), np.isinf(rl))
            fin = np.isfinite(rl)
            assert np.abs(got[fin] - rl[fin]).max(initial=0) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask", MASKS)
def test_dense_matches_reference(family, dtype, shape, mask):
    b, sq, sk, hq, hkv, d, dv = shape
    causal, window, softcap = mask
    rng = np.random.default_rng(sum(shape))
    q, q64 = make(rng, (b, sq, hq, d), dtype, family)
    k, k64 = make(rng, (b, sk, hkv, d), dtype, family)
    v, v64 = make(rng, (b, sk, hkv, dv), dtype, family)
    out, lse = flywheel.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                        softcap=softcap, return_softmax_lse=True)
    assert type(out) is type(q) and out.dtype == q.dtype and tuple(out.shape) == (b, sq, hq, dv)
    assert tuple(lse.shape) == (b, hq, sq)
    check(out, lse, q64, k64, v64, d ** -0.5, causal, window, softcap, dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_strided_views_are_read_in_place(family):
    """q as a permuted [b, h, s, d] buffer, k/v as every other row of a larger buffer."""
    rng = np.random.default_rng(1)
    qb, qb64 = make(rng, (2, 4, 50, 64), "float32", family)
    kb, kb64 = make(rng, (2, 80, 2, 64), "float32", family)
    vb, vb64 = make(rng, (2, 80, 2, 64), "float32", family)
    if family == "torch":
        q = qb.permute(0, 2, 1, 3)
    else:
        q = qb.transpose(0, 2, 1, 3)
    k, v = kb[:, ::2], vb[:, ::2]
    out = flywheel.flash_attn_func(q, k, v, causal=True, softmax_scale=0.1)
    check(out, None, qb64.transpose(0, 2, 1, 3), kb64[:, ::2], vb64[:, ::2], 0.1, True,
          (-1, -1), 0.0, "float32")


def test_negative_numpy_strides_are_copied():
    rng = np.random.default_rng(2)
    q, q64 = make(rng, (1, 20, 2, 32), "float32", "numpy")
    k, k64 = make(rng, (1, 20, 2, 32), "float32", "numpy")
    v, v64 = make(rng, (1, 20, 2, 32), "float32", "numpy")
    out = flywheel.flash_attn_func(q[:, ::-1], k, v, causal=True)
    check(out, None, q64[:, ::-1], k64, v64, 32 ** -0.5, True, (-1, -1), 0.0, "float32")


def test_return_attn_probs_like_flash_attn():
    rng = np.random.default_rng(3)
    q, _ = make(rng, (1, 9, 2, 16), "float32", "numpy")
    out, lse, probs = flywheel.flash_attn_func(q, q, q, return_attn_probs=True)
    assert probs is None and lse.shape == (1, 2, 9) and out.shape == (1, 9, 2, 16)


def test_every_kernel_table_and_the_plain_kernel_agree():
    rng = np.random.default_rng(4)
    q, q64 = make(rng, (1, 70, 4, 64), "float32", "numpy")
    k, k64 = make(rng, (1, 90, 2, 64), "float32", "numpy")
    v, v64 = make(rng, (1, 90, 2, 64), "float32", "numpy")
    for isa in flywheel.isa_tables():
        for plain in (False, True):
            out = flywheel.flash_attn_func(q, k, v, causal=True, isa=isa, plain=plain)
            check(out, None, q64, k64, v64, 64 ** -0.5, True, (-1, -1), 0.0, "float32")


def test_thread_counts_give_the_same_bits():
    rng = np.random.default_rng(5)
    q, _ = make(rng, (2, 300, 8, 64), "bfloat16", "numpy")
    k, _ = make(rng, (2, 300, 2, 64), "bfloat16", "numpy")
    outs = []
    for n in (1, 3):
        flywheel.set_num_threads(n)
        outs.append(flywheel.flash_attn_func(q, k, k, causal=True))
    assert np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))


def test_python_threads_call_at_once():
    rng = np.random.default_rng(6)
    q, _ = make(rng, (1, 200, 4, 64), "float32", "numpy")
    want = flywheel.flash_attn_func(q, q, q, causal=True)
    got, errors = [], []

    def work():
        try:
            for _ in range(5):
                got.append(flywheel.flash_attn_func(q, q, q, causal=True))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 20
    assert all(np.array_equal(g, want) for g in got)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_varlen_matches_reference(family, dtype):
    rng = np.random.default_rng(7)
    lq, lk = [5, 0, 64, 33, 1], [9, 4, 64, 120, 1]
    cq, ck = np.cumsum([0] + lq), np.cumsum([0] + lk)
    q, q64 = make(rng, (cq[-1], 6, 64), dtype, family)
    k, k64 = make(rng, (ck[-1], 2, 64), dtype, family)
    v, v64 = make(rng, (ck[-1], 2, 64), dtype, family)
    cu_q = torch.tensor(cq, dtype=torch.int32) if family == "torch" else cq.astype(np.int32)
    out, lse = flywheel.flash_attn_varlen_func(q, k, v, cu_q, ck, max(lq), max(lk), causal=True,
                                               return_softmax_lse=True)
    assert tuple(lse.shape) == (6, cq[-1])
    for i in range(len(lq)):
        sl, kl = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        ro, rl = ref_attention(q64[sl], k64[kl], v64[kl], 0.125, causal=True)
        if ro.size:
            assert np.abs(as64(out)[sl] - ro).max() <= TOL[dtype]
            fin = np.isfinite(rl)
            assert np.abs(as64(lse)[:, sl][fin] - rl[fin]).max(initial=0) <= 1e-4


def test_varlen_checks_max_seqlen_and_block_table():
    q = np.zeros((10, 2, 16), np.float32)
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(ValueError, match="max_seqlen"):
        flywheel.flash_attn_varlen_func(q, q, q, cu, cu, 5, 6)
    with pytest.raises(NotImplementedError, match="block_table"):
        flywheel.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, block_table=np.zeros((2, 1)))


def _paged(cache, page, order):
    """A contiguous cache [b, S, h, d] as pages placed by the permutation `order`, plus the
    block table."""
    b, per = cache.shape[0], cache.shape[1] // page
    pages = np.zeros((b * per, page) + cache.shape[2:], dtype=cache.dtype)
    table = order.reshape(b, per).astype(np.int32)
    for i in range(b):
        for p in range(per):
            pages[table[i, p]] = cache[i, p * page:(p + 1) * page]
    return pages, table


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sq", [1, 4, 40])
def test_kvcache_appends_in_place_and_attends(family, paged, sq):
    rng = np.random.default_rng(8 + sq)
    b, S, hq, hkv, d = 3, 256, 8, 2, 64
    lens = np.array([0, 100, 256 - sq], np.int32)
    kc, kc64 = make(rng, (b, S, hkv, d), "float32", "numpy")
    vc, vc64 = make(rng, (b, S, hkv, d), "float32", "numpy")
    q, q64 = make(rng, (b, sq, hq, d), "float32", family)
    kn, kn64 = make(rng, (b, sq, hkv, d), "float32", family)
    vn, vn64 = make(rng, (b, sq, hkv, d), "float32", family)
    table = None
    if paged:
        order = rng.permutation(b * S // 16)
        kc, table = _paged(kc, 16, order)
        vc, _ = _paged(vc, 16, order)
    if family == "torch":
        kc, vc = torch.from_numpy(kc), torch.from_numpy(vc)
    out, lse = flywheel.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                                block_table=table, causal=True,
                                                return_softmax_lse=True)
    assert tuple(out.shape) == (b, sq, hq, d) and tuple(lse.shape) == (b, hq, sq)
    for i in range(b):
        L = lens[i] + sq
        kctx = np.concatenate([kc64[i, :lens[i]], kn64[i]])
        vctx = np.concatenate([vc64[i, :lens[i]], vn64[i]])
        ro, rl = ref_attention(q64[i], kctx, vctx, d ** -0.5, causal=True)
        assert np.abs(as64(out)[i] - ro).max() <= TOL["float32"]
        assert np.abs(as64(lse)[i] - rl).max() <= 1e-4
        # the new rows are in the cache, in place
        kcache = as64(kc)
        if paged:
            rows = [kcache[table[i, t // 16], t % 16] for t in range(lens[i], L)]
        else:
            rows = [kcache[i, t] for t in range(lens[i], L)]
        assert np.array_equal(np.stack(rows), kn64[i])


def _tiles(pages):
    """Paged rows [nb, page, h, d] (bf16) as a cache_layout="tiles" cache: storage
    [nb, h, page * d] with each (page, head) block in AMX's tile order (FW_KV_TILES), and the
    [nb, page, h, d] view of it the call takes."""
    nb, page, h, d = pages.shape
    t, c = np.meshgrid(np.arange(page), np.arange(d), indexing="ij")
    kpos = (t // 16) * 16 * d + (c // 2) * 32 + (t % 16) * 2 + c % 2
    vpos = (c // 16) * 16 * page + (t // 2) * 32 + (c % 16) * 2 + t % 2
    views = []
    for pos in (kpos, vpos):
        store = np.zeros((nb, h, page * d), dtype=pages.dtype)
        store[:, :, pos.reshape(-1)] = pages.transpose(0, 2, 1, 3).reshape(nb, h, page * d)
        strides = tuple(x * store.itemsize for x in (h * page * d, d, page * d, 1))
        views.append((store, np.lib.stride_tricks.as_strided(store, (nb, page, h, d), strides),
                      pos))
    return views


@pytest.mark.parametrize("sq", [1, 4, 40])
@pytest.mark.parametrize("precision", ["f32", None])
def test_kvcache_tiles_layout_reads_and_appends(sq, precision):
    """cache_layout="tiles" (vLLM's AMX layout): the same values give the row layout's bits
    with f32 products (the same rows reach the same kernels) and its result within bf16's bar
    with bf16 products; new rows land in their tiles."""
    rng = np.random.default_rng(30 + sq)
    b, S, hq, hkv, d, page = 3, 256, 8, 2, 64, 32
    lens = np.array([0, 100, 256 - sq], np.int32)
    kc, _ = make(rng, (b, S, hkv, d), "bfloat16", "numpy")
    vc, _ = make(rng, (b, S, hkv, d), "bfloat16", "numpy")
    q, _ = make(rng, (b, sq, hq, d), "bfloat16", "numpy")
    kn, kn64 = make(rng, (b, sq, hkv, d), "bfloat16", "numpy")
    vn, _ = make(rng, (b, sq, hkv, d), "bfloat16", "numpy")
    order = rng.permutation(b * S // page)
    kp, table = _paged(kc, page, order)
    vp, _ = _paged(vc, page, order)
    (ks, kt, kpos), _ = _tiles(kp)
    _, (vs, vt, _) = _tiles(vp)
    want = flywheel.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=lens,
                                            block_table=table, causal=True, precision=precision)
    got = flywheel.flash_attn_with_kvcache(q, kt, vt, kn, vn, cache_seqlens=lens,
                                           block_table=table, causal=True, precision=precision,
                                           cache_layout="tiles")
    diff = np.abs(as64(got) - as64(want)).max()
    assert diff == 0 if precision == "f32" else diff <= TOL["bfloat16"]
    for i in range(b):  # the appended keys, read back from their tiles
        for r in range(sq):
            t = lens[i] + r
            blk = ks[table[i, t // page]]
            row = blk[:, kpos[t % page]].astype(np.float64)  # [hkv, d]
            assert np.array_equal(row, kn64[i, r])
    with pytest.raises(ValueError, match="cache_layout"):
        flywheel.flash_attn_with_kvcache(q, kt, vt, cache_seqlens=lens, block_table=table,
                                         cache_layout="amx")
    with pytest.raises(FlywheelError, match="FW_KV_TILES"):  # rows: not dense per (page, head)
        flywheel.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                         cache_layout="tiles")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sq", [1, 3])
def test_kvcache_leftpad_and_batch_idx(family, sq):
    """cache_leftpad and cache_batch_idx (flash-attn's): sequence i uses cache entry
    idx[i] and attends to its rows [leftpad, seqlens + sq) only, aligned bottom-right; the new
    rows go to cache_seqlens as without them; the entry no sequence names is untouched."""
    rng = np.random.default_rng(30 + sq)
    b, S, hq, hkv, d = 3, 64, 4, 2, 32
    lens, pads = np.array([40, 9, 50], np.int32), np.array([7, 0, 50], np.int32)
    idx = np.array([3, 0, 1], np.int32)
    kc, kc64 = make(rng, (b + 1, S, hkv, d), "float32", "numpy")
    vc, vc64 = make(rng, (b + 1, S, hkv, d), "float32", "numpy")
    q, q64 = make(rng, (b, sq, hq, d), "float32", family)
    kn, kn64 = make(rng, (b, sq, hkv, d), "float32", family)
    vn, vn64 = make(rng, (b, sq, hkv, d), "float32", family)
    if family == "torch":
        kc, vc = torch.from_numpy(kc), torch.from_numpy(vc)
    pad_arg = torch.from_numpy(pads) if family == "torch" else pads
    out = flywheel.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                           cache_leftpad=pad_arg, cache_batch_idx=idx,
                                           causal=True)
    for i in range(b):
        e = idx[i]
        kctx = np.concatenate([kc64[e, pads[i]:lens[i]], kn64[i]])
        vctx = np.concatenate([vc64[e, pads[i]:lens[i]], vn64[i]])
        ro, _ = ref_attention(q64[i], kctx, vctx, d ** -0.5, causal=True)
        assert np.abs(as64(out)[i] - ro).max() <= TOL["float32"]
        assert np.array_equal(as64(kc)[e, lens[i]:lens[i] + sq], kn64[i])
    assert np.array_equal(as64(kc)[2], kc64[2])
    before = as64(kc).copy()
    for bad in ([3, 0, 3], [4, 0, 1]):  # an entry written twice; one past the cache
        with pytest.raises(FlywheelError, match="batch_idx") as e:
            flywheel.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                             cache_batch_idx=bad, causal=True)
        assert e.value.status == "FW_ERR_INDEX" and np.array_equal(as64(kc), before)
    with pytest.raises(FlywheelError, match="leftpad") as e:  # past the cached rows
        flywheel.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                         cache_leftpad=[7, 10, 0], causal=True)
    assert e.value.status == "FW_ERR_SEQLENS" and np.array_equal(as64(kc), before)
    with pytest.raises(ValueError, match="cache_leftpad must have 3"):
        flywheel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=[0, 0])
    pages, table = _paged(np.zeros((b, S, hkv, d), np.float32), 16, np.arange(b * S // 16))
    with pytest.raises(FlywheelError, match="contiguous cache") as e:
        flywheel.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table,
                                         cache_leftpad=pads)
    assert e.value.status == "FW_ERR_ARG"


def test_kvcache_packed_queries_and_scalar_seqlens():
    rng = np.random.default_rng(9)
    kc, kc64 = make(rng, (2, 64, 1, 32), "float32", "numpy")
    q, q64 = make(rng, (3, 4, 32), "float32", "numpy")
    out = flywheel.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=50,
                                           cu_seqlens_q=[0, 1, 3])
    for i, (a, z) in enumerate([(0, 1), (1, 3)]):
        ro, _ = ref_attention(q64[a:z], kc64[i, :50], kc64[i, :50], 32 ** -0.5)
        assert np.abs(out[a:z] - ro).max() <= TOL["float32"]


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_against_torch_sdpa(dtype):
    """sq == sk, so torch's top-left causal mask equals flash-attn's bottom-right one."""
    rng = np.random.default_rng(10)
    q, _ = make(rng, (2, 150, 8, 64), dtype, "torch")
    k, _ = make(rng, (2, 150, 2, 64), dtype, "torch")
    v, _ = make(rng, (2, 150, 2, 64), dtype, "torch")
    ours = flywheel.flash_attn_func(q, k, v, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
        is_causal=True, enable_gqa=True).transpose(1, 2)
    assert (ours.float() - want).abs().max().item() <= TOL[dtype]


def test_bad_inputs_raise_with_the_c_message():
    q = np.zeros((1, 8, 6, 32), np.float32)
    k = np.zeros((1, 8, 4, 32), np.float32)  # 4 does not divide 6
    with pytest.raises(FlywheelError) as e:
        flywheel.flash_attn_func(q, k, k)
    assert e.value.status == "FW_ERR_SHAPE" and "does not divide" in str(e.value)
    with pytest.raises(FlywheelError) as e:
        flywheel.flash_attn_func(q, q.astype(np.float16), q)
    assert e.value.status == "FW_ERR_DTYPE"
    with pytest.raises(FlywheelError, match="FW_ERR_ARG"):
        flywheel.flash_attn_func(q, q, q, softcap=-1.0)
    with pytest.raises(FlywheelError, match="FW_ERR_SEQLENS"):
        flywheel.flash_attn_varlen_func(q[0], q[0], q[0], [0, 9], [0, 8], 9, 8)
    with pytest.raises(TypeError, match="dtype int64"):
        flywheel.flash_attn_func(np.zeros((1, 2, 2, 4), np.int64), q, q)
    with pytest.raises(TypeError, match="numpy array or a torch"):
        flywheel.flash_attn_func([[1.0]], q, q)
    with pytest.raises(NotImplementedError, match="unknown kernel table"):
        flywheel.flash_attn_func(q, q, q, isa="sve")


def test_kvcache_bad_page_index_leaves_the_cache_untouched():
    kc = np.zeros((4, 16, 1, 32), np.float32)
    before = kc.copy()
    q = np.ones((1, 1, 1, 32), np.float32)
    with pytest.raises(FlywheelError) as e:
        flywheel.flash_attn_with_kvcache(q, kc, kc, q, q, cache_seqlens=[3],
                                         block_table=[[7]])
    assert e.value.status == "FW_ERR_INDEX"
    assert np.array_equal(kc, before)
    with pytest.raises(ValueError, match="cache_seqlens is required"):
        flywheel.flash_attn_with_kvcache(q, kc, kc)
    with pytest.raises(ValueError, match="block_table must be"):  # fewer rows than sequences
        flywheel.flash_attn_with_kvcache(np.ones((2, 1, 1, 32), np.float32), kc, kc,
                                         cache_seqlens=[1, 1], block_table=[[0]])


def test_unsupported_options_raise_not_implemented():
    q = np.zeros((1, 4, 2, 16), np.float32)
    for kw in ({"dropout_p": 0.1}, {"alibi_slopes": np.zeros(2, np.float32)}):
        with pytest.raises(NotImplementedError):
            flywheel.flash_attn_func(q, q, q, **kw)
    kc = np.zeros((1, 16, 2, 16), np.float32)
    with pytest.raises(NotImplementedError, match="alibi"):
        flywheel.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=1,
                                         alibi_slopes=np.zeros(2, np.float32))


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_torch_grad_flows_and_device_is_refused():
    """Inputs that require grad make the call differentiable (test_attention_bwd.py checks
    the gradients); under no_grad it is the plain forward. Other devices are refused."""
    q = torch.zeros(1, 4, 2, 16, requires_grad=True)
    out = flywheel.flash_attn_func(q, q, q)
    assert out.requires_grad
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    with torch.no_grad():
        assert not flywheel.flash_attn_func(q, q, q).requires_grad
    with pytest.raises(NotImplementedError, match="meta"):
        flywheel.flash_attn_func(q.detach().to("meta"), q, q)


@pytest.mark.parametrize("family", FAMILIES)
def test_out_buffers_are_written_in_place(family):
    rng = np.random.default_rng(11)
    q, _ = make(rng, (2, 30, 4, 32), "float32", family)
    k, _ = make(rng, (2, 30, 2, 32), "float32", family)
    want = flywheel.flash_attn_func(q, k, k, causal=True)
    buf = flywheel.flash_attn_func(q, k, k)  # any array of the right shape and dtype
    got = flywheel.flash_attn_func(q, k, k, causal=True, out=buf)
    assert got is buf and np.array_equal(as64(buf), as64(want))
    kc = np.zeros((2, 64, 2, 32), np.float32)
    want = flywheel.flash_attn_with_kvcache(q, kc.copy(), kc.copy(), k, k, cache_seqlens=3)
    got = flywheel.flash_attn_with_kvcache(q, kc, kc.copy(), k, k, cache_seqlens=3, out=buf)
    assert got is buf and np.array_equal(as64(buf), as64(want))
    with pytest.raises(FlywheelError, match="FW_ERR_SHAPE"):
        flywheel.flash_attn_func(q, k, k, out=buf[:, :5])
    swapped = flywheel.flash_attn_func(q.swapaxes(0, 1), k.swapaxes(0, 1),
                                       k.swapaxes(0, 1)).swapaxes(0, 1)  # [b, s] strides swapped
    with pytest.raises(ValueError, match="cannot be merged"):
        flywheel.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=3, out=swapped)


# Product precision (precision=): bf16 products round q, k, v and the probabilities P to bf16
# and accumulate in f32. Bar against the exact float64 reference: at most twice the error of
# the float64 reference that makes the same roundings (then rounds to the output dtype), plus
# 1e-5. The default is bf16 products for bfloat16 inputs on a table with a native bf16 dot
# product (flywheel.auto_precision) and f32 products otherwise.

PRODUCT_CASES = [  # (b, sq, sk, hq, hkv, d, dv), causal, window
    ((2, 17, 33, 8, 2, 64, 64), True, (-1, -1)),
    ((1, 37, 101, 6, 2, 128, 128), False, (24, 3)),
    ((1, 45, 45, 4, 1, 32, 48), True, (13, -1)),
]


def bf16_products(dtype, precision):
    return precision == "bf16" or (precision is None and flywheel.auto_precision(dtype) == "bf16")


def refs(q, k, v, scale, causal, window, dtype, precision):
    """The exact reference of one sequence and the same-roundings one, rounded to dtype."""
    exact, _ = ref_attention(q, k, v, scale, causal, window)
    same, _ = ref_attention(q, k, v, scale, causal, window,
                            bf16_products=bf16_products(dtype, precision))
    return exact, round_to(same, dtype)


def check_products(out, exact, same, what):
    err = np.abs(as64(out) - exact).max(initial=0.0)
    bar = 2 * np.abs(same - exact).max(initial=0.0) + 1e-5
    assert err <= bar, f"{what}: max error {err} over {bar}"


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", PRODUCT_CASES)
def test_dense_products_every_table(case, dtype, precision):
    (b, sq, sk, hq, hkv, d, dv), causal, window = case
    rng = np.random.default_rng(sum(case[0]))
    q, q64 = make(rng, (b, sq, hq, d), dtype, "numpy")
    k, k64 = make(rng, (b, sk, hkv, d), dtype, "numpy")
    v, v64 = make(rng, (b, sk, hkv, dv), dtype, "numpy")
    both = [refs(q64[i], k64[i], v64[i], d ** -0.5, causal, window, dtype, precision)
            for i in range(b)]
    exact, same = np.stack([r[0] for r in both]), np.stack([r[1] for r in both])
    for isa in flywheel.isa_tables():
        out = flywheel.flash_attn_func(q, k, v, causal=causal, window_size=window, isa=isa,
                                       precision=precision)
        assert out.dtype == q.dtype
        check_products(out, exact, same, isa)


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_varlen_products_every_table(dtype, precision):
    rng = np.random.default_rng(12)
    lq, lk = [5, 0, 33, 1, 21], [9, 4, 71, 1, 21]
    cq, ck = np.cumsum([0] + lq), np.cumsum([0] + lk)
    q, q64 = make(rng, (cq[-1], 6, 64), dtype, "numpy")
    k, k64 = make(rng, (ck[-1], 2, 64), dtype, "numpy")
    v, v64 = make(rng, (ck[-1], 2, 64), dtype, "numpy")
    exact, same = np.zeros((cq[-1], 6, 64)), np.zeros((cq[-1], 6, 64))
    for i in range(len(lq)):
        sl, kl = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        exact[sl], same[sl] = refs(q64[sl], k64[kl], v64[kl], 0.125, True, (30, -1), dtype,
                                   precision)
    for isa in flywheel.isa_tables():
        out = flywheel.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True,
                                              window_size=(30, -1), isa=isa,
                                              precision=precision)
        check_products(out, exact, same, isa)


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sq", [1, 19])
def test_kvcache_products_every_table(sq, dtype, precision):
    """Decode (sq = 1) over contexts longer than one FW_KV_SPLIT range, with a window; and a
    causal chunked prefill (sq = 19) over a paged cache."""
    rng = np.random.default_rng(13 + sq)
    b, hq, hkv, d = 3, 8, 2, 64
    S, lens, window = (640, [0, 37, 600], (300, -1)) if sq == 1 else (128, [0, 50, 109],
                                                                     (-1, -1))
    lens = np.array(lens, np.int32)
    kc, kc64 = make(rng, (b, S, hkv, d), dtype, "numpy")
    vc, vc64 = make(rng, (b, S, hkv, d), dtype, "numpy")
    q, q64 = make(rng, (b, sq, hq, d), dtype, "numpy")
    kn, kn64 = make(rng, (b, sq, hkv, d), dtype, "numpy")
    vn, vn64 = make(rng, (b, sq, hkv, d), dtype, "numpy")
    table = None
    if sq > 1:
        order = rng.permutation(b * S // 16)
        kc, table = _paged(kc, 16, order)
        vc, _ = _paged(vc, 16, order)
    both = []
    for i in range(b):
        kctx = np.concatenate([kc64[i, :lens[i]], kn64[i]])
        vctx = np.concatenate([vc64[i, :lens[i]], vn64[i]])
        both.append(refs(q64[i], kctx, vctx, d ** -0.5, True, window, dtype, precision))
    exact, same = np.stack([r[0] for r in both]), np.stack([r[1] for r in both])
    for isa in flywheel.isa_tables():  # rewrites the same new rows into the cache each time
        out = flywheel.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                               block_table=table, causal=True,
                                               window_size=window, isa=isa,
                                               precision=precision)
        check_products(out, exact, same, isa)


def test_f32_products_of_bf16_inputs_meet_the_f32_bar():
    """precision="f32" on bfloat16 inputs, written to float32 outputs: the exact result of the
    bf16 values, to the f32 tolerance."""
    rng = np.random.default_rng(14)
    q, q64 = make(rng, (2, 17, 8, 64), "bfloat16", "numpy")
    k, k64 = make(rng, (2, 33, 2, 64), "bfloat16", "numpy")
    v, v64 = make(rng, (2, 33, 2, 64), "bfloat16", "numpy")
    want = np.stack([ref_attention(q64[i], k64[i], v64[i], 0.125, causal=True)[0]
                     for i in range(2)])
    kc = np.concatenate([k, k], axis=1)  # a 66-row cache of which 33 are used
    vc = np.concatenate([v, v], axis=1)
    for isa in flywheel.isa_tables():
        out = np.empty((2, 17, 8, 64), np.float32)
        flywheel.flash_attn_func(q, k, v, causal=True, isa=isa, precision="f32", out=out)
        assert np.abs(as64(out) - want).max() <= TOL["float32"], isa
        out[:] = np.nan
        flywheel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=33, causal=True, isa=isa,
                                         precision="f32", out=out)
        assert np.abs(as64(out) - want).max() <= TOL["float32"], isa


def test_bad_precision_raises_value_error():
    q = np.zeros((1, 4, 2, 16), np.float32)
    kc = np.zeros((1, 16, 2, 16), np.float32)
    cu = np.array([0, 4], np.int32)
    for bad in ("fp32", "BF16", "f16", 2):
        with pytest.raises(ValueError, match="precision must be"):
            flywheel.flash_attn_func(q, q, q, precision=bad)
        with pytest.raises(ValueError, match="precision must be"):
            flywheel.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, precision=bad)
        with pytest.raises(ValueError, match="precision must be"):
            flywheel.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=4, precision=bad)
    rng = np.random.default_rng(15)
    x, _ = make(rng, (1, 9, 2, 16), "float32", "numpy")
    assert np.array_equal(flywheel.flash_attn_func(x, x, x, precision="auto"),
                          flywheel.flash_attn_func(x, x, x))


# Windows: flash-attn's rule, any negative side is unbounded.

def test_negative_window_sides_are_unbounded():
    rng = np.random.default_rng(20)
    q, q64 = make(rng, (2, 24, 4, 16), "float32", "numpy")
    k, k64 = make(rng, (2, 24, 2, 16), "float32", "numpy")
    v, v64 = make(rng, (2, 24, 2, 16), "float32", "numpy")
    f = flywheel.flash_attn_func
    right3 = f(q, k, v, window_size=(-1, 3))
    assert np.array_equal(f(q, k, v, window_size=(-5, 3)), right3)
    assert np.array_equal(f(q, k, v, window_size=(2, -7)), f(q, k, v, window_size=(2, -1)))
    assert np.array_equal(f(q, k, v, causal=True, window_size=(-9, -9)),
                          f(q, k, v, causal=True))
    full = f(q, k, v, window_size=(-1, -1))
    assert np.array_equal(full, f(q, k, v))
    assert not np.array_equal(full, right3)  # the window of (-1, 3) does cut keys
    for i in range(2):
        ro, _ = ref_attention(q64[i], k64[i], v64[i], 16 ** -0.5)  # no mask at all
        assert np.abs(full[i] - ro).max() <= TOL["float32"]
        ro, _ = ref_attention(q64[i], k64[i], v64[i], 16 ** -0.5, window=(-1, 3))
        assert np.abs(right3[i] - ro).max() <= TOL["float32"]
    # the same rule in the varlen and KV-cache calls
    cu = np.array([0, 24, 48], np.int32)
    flat = [x.reshape(48, *x.shape[2:]) for x in (q, k, v)]
    assert np.array_equal(
        flywheel.flash_attn_varlen_func(*flat, cu, cu, 24, 24, window_size=(-5, 3)),
        flywheel.flash_attn_varlen_func(*flat, cu, cu, 24, 24, window_size=(-1, 3)))
    assert np.array_equal(flywheel.flash_attn_with_kvcache(q, k, v, cache_seqlens=24,
                                                           window_size=(-5, 3)),
                          flywheel.flash_attn_with_kvcache(q, k, v, cache_seqlens=24,
                                                           window_size=(-1, 3)))
    with pytest.raises(ValueError, match="window_size must be a pair"):
        f(q, k, v, window_size=None)


def test_varlen_checks_cu_seqlens_before_max_seqlen():
    """Offsets that go down would give lengths above max_seqlen: the error names the offsets."""
    q = np.zeros((8, 2, 16), np.float32)
    good = np.array([0, 4, 8], np.int32)
    with pytest.raises(FlywheelError, match=r"cu_seqlens_q\[2\] = 4 is less than") as e:
        flywheel.flash_attn_varlen_func(q, q, q, [0, 8, 4, 8], [0, 4, 4, 8], 4, 4)
    assert e.value.status == "FW_ERR_SEQLENS" and "max_seqlen" not in str(e.value)
    with pytest.raises(FlywheelError, match=r"cu_seqlens_k\[2\] = 6 is less than"):
        flywheel.flash_attn_varlen_func(q, q, q, [0, 4, 4, 8], [0, 7, 6, 8], 4, 4)
    with pytest.raises(FlywheelError, match=r"cu_seqlens_q\[0\] = 1, expected 0"):
        flywheel.flash_attn_varlen_func(q, q, q, [1, 4, 8], good, 8, 8)
    with pytest.raises(FlywheelError, match=r"cu_seqlens_k\[-1\] = 6, but k has 8 rows"):
        flywheel.flash_attn_varlen_func(q, q, q, good, [0, 4, 6], 1, 1)
    with pytest.raises(FlywheelError, match=r"cu_seqlens_q\[-1\] = 6, but q has 3 rows"):
        flywheel.flash_attn_with_kvcache(q[:3], np.zeros((2, 16, 2, 16), np.float32),
                                         np.zeros((2, 16, 2, 16), np.float32),
                                         cache_seqlens=4, cu_seqlens_q=[0, 2, 6])
    with pytest.raises(ValueError, match="max_seqlen"):  # valid offsets: max_seqlen is checked
        flywheel.flash_attn_varlen_func(q, q, q, good, good, 3, 4)


def test_head_dim_zero_is_a_shape_error():
    """The default scale 1/sqrt(d) is left to the library, which refuses d = 0 as a shape."""
    z = np.zeros((1, 4, 2, 0), np.float32)
    v = np.zeros((1, 4, 2, 8), np.float32)
    calls = [lambda: flywheel.flash_attn_func(z, z, v),
             lambda: flywheel.flash_attn_func(z, z, v, softmax_scale=0.5),
             lambda: flywheel.flash_attn_varlen_func(z[0], z[0], v[0], [0, 4], [0, 4], 4, 4),
             lambda: flywheel.flash_attn_with_kvcache(z, np.zeros((1, 16, 2, 0), np.float32),
                                                      np.zeros((1, 16, 2, 8), np.float32),
                                                      cache_seqlens=3)]
    for call in calls:
        with pytest.raises(FlywheelError) as e:
            call()
        assert e.value.status == "FW_ERR_SHAPE" and "head dim" in str(e.value)


def test_read_only_arrays_the_call_writes_are_refused():
    rng = np.random.default_rng(21)
    q, _ = make(rng, (2, 3, 4, 16), "float32", "numpy")
    k, _ = make(rng, (2, 3, 2, 16), "float32", "numpy")
    out = read_only(np.full((2, 3, 4, 16), 7.0, np.float32))
    with pytest.raises(ValueError, match="out is a read-only numpy array"):
        flywheel.flash_attn_func(q, k, k, out=out)
    cu = np.array([0, 3, 6], np.int32)
    with pytest.raises(ValueError, match="out is a read-only numpy array"):
        flywheel.flash_attn_varlen_func(q.reshape(6, 4, 16), k.reshape(6, 2, 16),
                                        k.reshape(6, 2, 16), cu, cu, 3, 3,
                                        out=out.reshape(6, 4, 16))
    cache = rng.standard_normal((2, 32, 2, 16)).astype(np.float32)
    for name, kc, vc, buf in (("k_cache", read_only(cache), cache.copy(), None),
                              ("v_cache", cache.copy(), read_only(cache), None),
                              ("out", cache.copy(), cache.copy(), out)):
        with pytest.raises(ValueError, match=f"{name} is a read-only numpy array"):
            flywheel.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=5, out=buf)
        assert np.array_equal(kc, cache) and np.array_equal(vc, cache)  # nothing appended
    assert (out == 7.0).all()
    # without k and v the caches are only read: read-only ones are fine
    ro = read_only(cache)
    assert np.array_equal(flywheel.flash_attn_with_kvcache(q, ro, ro, cache_seqlens=20),
                          flywheel.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=20))


def test_unsupported_dtypes_raise_type_error():
    """Every dtype the library does not take is a TypeError, whether the binding or the
    library finds it; shapes stay ValueError."""
    q = np.zeros((1, 4, 2, 16), np.float32)
    kc = np.zeros((1, 16, 2, 16), np.float32)
    for bad in (np.float64, np.int32, np.int64, np.complex64, bool):
        x = q.astype(bad)
        for args in ((x, q, q), (q, x, q), (q, q, x)):
            with pytest.raises(TypeError, match=f"dtype {np.dtype(bad)} is not supported"):
                flywheel.flash_attn_func(*args)
        with pytest.raises(TypeError, match="out: dtype"):
            flywheel.flash_attn_func(q, q, q, out=x)
        with pytest.raises(TypeError, match="k_cache: dtype"):
            flywheel.flash_attn_with_kvcache(q, kc.astype(bad), kc, cache_seqlens=1)
        with pytest.raises(TypeError, match="q: dtype"):
            flywheel.flash_attn_varlen_func(x[0], q[0], q[0], [0, 4], [0, 4], 4, 4)
    # accepted dtypes the library refuses together: a TypeError and a FlywheelError
    with pytest.raises(TypeError) as e:
        flywheel.flash_attn_func(q, q.astype(np.float16), q)
    assert isinstance(e.value, FlywheelError) and e.value.status == "FW_ERR_DTYPE"
    if torch is not None:
        with pytest.raises(TypeError, match="torch.float64 is not supported"):
            flywheel.flash_attn_func(torch.zeros(1, 4, 2, 16, dtype=torch.float64), q, q)
    with pytest.raises(TypeError, match="isa must be a kernel table name"):
        flywheel.flash_attn_func(q, q, q, isa=1)
    with pytest.raises(ValueError) as e:  # a shape is still a ValueError, not a TypeError
        flywheel.flash_attn_func(q, q[:, :, :1, :8], q)
    assert not isinstance(e.value, TypeError)


# --------------------------------------------------------------------------- attention sinks

def check_sinks(out, lse, ro, rl, dtype, what=""):
    """out and lse of one sequence against the float64 reference with sinks: lse includes
    the sink, so every row's is finite; rows that see no key give exactly 0 and the sink."""
    err = np.abs(as64(out) - ro).max(initial=0.0)
    assert err <= TOL[dtype], f"{what}: max error {err} over {TOL[dtype]}"
    got = as64(lse)
    assert np.isfinite(got).all(), what
    assert np.abs(got - rl).max(initial=0.0) <= 1e-4, what


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[1:4])
@pytest.mark.parametrize("mask", MASKS)
def test_dense_sinks_match_reference(family, dtype, shape, mask):
    """GQA, masks, softcap, and rows that see no key (causal with sq > sk: out 0, lse the
    sink); the sinks in another dtype than q's."""
    b, sq, sk, hq, hkv, d, dv = shape
    causal, window, softcap = mask
    rng = np.random.default_rng(sum(shape) + 1)
    q, q64 = make(rng, (b, sq, hq, d), dtype, family)
    k, k64 = make(rng, (b, sk, hkv, d), dtype, family)
    v, v64 = make(rng, (b, sk, hkv, dv), dtype, family)
    sinks, s64 = make(rng, (hq,), DTYPES[(DTYPES.index(dtype) + 1) % 3], family, scale=1.5)
    out, lse = flywheel.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                        softcap=softcap, return_softmax_lse=True, sinks=sinks)
    assert out.dtype == q.dtype and tuple(lse.shape) == (b, hq, sq)
    for i in range(b):
        ro, rl = ref_attention(q64[i], k64[i], v64[i], d ** -0.5, causal, window, softcap,
                               sinks=s64)
        check_sinks(out[i], lse[i], ro, rl, dtype, f"batch {i}")
        _, plain = ref_attention(q64[i], k64[i], v64[i], d ** -0.5, causal, window, softcap)
        empty = np.isneginf(plain)  # [hq, sq]: rows that see no key
        if causal and sq > sk:
            assert empty.any()
        assert (as64(out)[i].transpose(1, 0, 2)[empty] == 0).all()
        assert np.array_equal(as64(lse)[i][empty],
                              np.broadcast_to(s64.astype(np.float32)[:, None], empty.shape)[empty])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_varlen_sinks_match_reference(family, dtype):
    """Per sequence, with one sequence that has queries but no keys (its rows: 0 and the
    sink) and one with keys but no queries."""
    rng = np.random.default_rng(40)
    lq, lk = [5, 3, 64, 0, 33], [9, 0, 64, 7, 120]
    cq, ck = np.cumsum([0] + lq), np.cumsum([0] + lk)
    q, q64 = make(rng, (cq[-1], 6, 64), dtype, family)
    k, k64 = make(rng, (ck[-1], 2, 64), dtype, family)
    v, v64 = make(rng, (ck[-1], 2, 32), dtype, family)
    sinks, s64 = make(rng, (6,), "float32", family, scale=2.0)
    cu_q = torch.tensor(cq, dtype=torch.int32) if family == "torch" else cq.astype(np.int32)
    for causal, window, softcap in ((True, (-1, -1), 0.0), (False, (10, 4), 20.0)):
        out, lse = flywheel.flash_attn_varlen_func(
            q, k, v, cu_q, ck, max(lq), max(lk), causal=causal, window_size=window,
            softcap=softcap, return_softmax_lse=True, sinks=sinks)
        assert tuple(lse.shape) == (6, cq[-1])
        for i in range(len(lq)):
            sl, kl = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            ro, rl = ref_attention(q64[sl], k64[kl], v64[kl], 0.125, causal, window, softcap,
                                   sinks=s64)
            check_sinks(out[sl], lse[:, sl], ro, rl, dtype, f"sequence {i}")
        no_keys = slice(cq[1], cq[2])
        assert (as64(out)[no_keys] == 0).all()
        assert np.array_equal(as64(lse)[:, no_keys], np.repeat(s64[:, None], 3, axis=1))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sq", [1, 4])
def test_kvcache_sinks_long_contexts(family, dtype, paged, sq):
    """Decode and multi-token decode over 1500-5000 keys (split into 512-key ranges and
    merged before the sink is added), paged and contiguous, with new tokens appended; with
    and without lse (the second call goes the compiled fast path where there is one, and
    must give the same out); a window and softcap on the second pass."""
    rng = np.random.default_rng(41 + sq)
    b, S, hq, hkv, d, page = 3, 5120, 8, 2, 64, 256
    lens = np.array([1500, 5000 - sq, 3100], np.int32)
    kc, kc64 = make(rng, (b, S, hkv, d), dtype, "numpy")
    vc, vc64 = make(rng, (b, S, hkv, d), dtype, "numpy")
    q, q64 = make(rng, (b, sq, hq, d), dtype, family)
    kn, kn64 = make(rng, (b, sq, hkv, d), dtype, family)
    vn, vn64 = make(rng, (b, sq, hkv, d), dtype, family)
    sinks, s64 = make(rng, (hq,), "bfloat16", family, scale=3.0)
    table = None
    if paged:
        order = rng.permutation(b * S // page)
        kc, table = _paged(kc, page, order)
        vc, _ = _paged(vc, page, order)
    if family == "torch":  # the same bits as torch tensors
        kc, vc = (torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
                  if dtype == "bfloat16" else torch.from_numpy(x) for x in (kc, vc))
    for causal, window, softcap in ((True, (-1, -1), 0.0), (True, (700, 0), 25.0)):
        out, lse = flywheel.flash_attn_with_kvcache(
            q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table, causal=causal,
            window_size=window, softcap=softcap, return_softmax_lse=True, sinks=sinks)
        again = flywheel.flash_attn_with_kvcache(
            q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table, causal=causal,
            window_size=window, softcap=softcap, sinks=sinks)
        assert np.array_equal(as64(again), as64(out))
        for i in range(b):
            kctx = np.concatenate([kc64[i, :lens[i]], kn64[i]])
            vctx = np.concatenate([vc64[i, :lens[i]], vn64[i]])
            ro, rl = ref_attention(q64[i], kctx, vctx, d ** -0.5, causal, window, softcap,
                                   sinks=s64)
            check_sinks(out[i], lse[i], ro, rl, dtype, f"sequence {i}, window {window}")


def test_kvcache_sinks_packed_queries_and_leftpad():
    """The Python path's options (packed cu_seqlens_q, cache_leftpad) with sinks."""
    rng = np.random.default_rng(42)
    kc, kc64 = make(rng, (2, 700, 1, 32), "float32", "numpy")
    q, q64 = make(rng, (3, 4, 32), "float32", "numpy")
    sinks, s64 = make(rng, (4,), "float16", "numpy")
    out, lse = flywheel.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=[650, 600],
                                                cu_seqlens_q=[0, 1, 3], sinks=sinks,
                                                cache_leftpad=[10, 0], return_softmax_lse=True)
    for i, (a, z, lo, hi) in enumerate([(0, 1, 10, 650), (1, 3, 0, 600)]):
        ro, rl = ref_attention(q64[a:z], kc64[i, lo:hi], kc64[i, lo:hi], 32 ** -0.5, sinks=s64)
        check_sinks(out[a:z], lse[:, a:z], ro, rl, "float32", f"sequence {i}")


def test_sinks_alias_dtypes_strides_and_errors():
    """s_aux is sinks under vLLM's name; both is an error. Any floating dtype (float64 and
    lists as float32), any stride; a wrong length is the library's FW_ERR_SHAPE, a cache
    appended to is then left as it was."""
    rng = np.random.default_rng(43)
    q, _ = make(rng, (2, 6, 4, 32), "float32", "numpy")
    k, _ = make(rng, (2, 9, 2, 32), "float32", "numpy")
    s64 = np.array([0.5, -1.0, 2.0, 0.25])
    s = s64.astype(np.float32)
    cu = np.array([0, 6, 12], np.int32)
    cuk = np.array([0, 9, 18], np.int32)
    kc = rng.standard_normal((2, 32, 2, 32)).astype(np.float32)
    calls = {
        "dense": lambda **kw: flywheel.flash_attn_func(q, k, k, causal=True, **kw),
        "varlen": lambda **kw: flywheel.flash_attn_varlen_func(
            q.reshape(12, 4, 32), k.reshape(18, 2, 32), k.reshape(18, 2, 32), cu, cuk, 6, 9,
            **kw),
        "kvcache": lambda **kw: flywheel.flash_attn_with_kvcache(
            q, kc.copy(), kc.copy(), k[:, :6], k[:, :6], cache_seqlens=[3, 20], causal=True,
            **kw),
    }
    strided = np.zeros(8, np.float32)
    strided[::2] = s
    for name, call in calls.items():
        want = call(sinks=s)
        assert not np.array_equal(want, call()), name  # the sinks were used
        for same in (dict(s_aux=s), dict(sinks=s64), dict(sinks=s64.tolist()),
                     dict(sinks=strided[::2]), dict(s_aux=s.astype(np.float16))):
            assert np.array_equal(call(**same), want), (name, same)
        with pytest.raises(ValueError, match="s_aux"):
            call(sinks=s, s_aux=s)
        with pytest.raises(FlywheelError, match="sinks has 3 values") as e:
            call(sinks=s[:3])
        assert e.value.status == "FW_ERR_SHAPE"
        with pytest.raises(FlywheelError, match="sinks has 2 dimensions"):
            call(sinks=s.reshape(2, 2))
        with pytest.raises(TypeError, match="sinks: dtype int64"):
            call(sinks=np.arange(4))
    before = kc.copy()
    with pytest.raises(FlywheelError, match="FW_ERR_SHAPE"):
        flywheel.flash_attn_with_kvcache(q, kc, kc, k[:, :6], k[:, :6], cache_seqlens=[3, 20],
                                         sinks=np.zeros(5, np.float32))
    assert np.array_equal(kc, before)
    if torch is not None:  # torch sinks with numpy q, and torch float64
        assert np.array_equal(calls["dense"](sinks=torch.from_numpy(s64)), calls["dense"](sinks=s))
    # one head: a number or a 0-d array is not [1], in any dtype (float64's float32 copy too)
    q1, kc1 = np.ones((1, 1, 1, 8), np.float32), np.ones((1, 4, 1, 8), np.float32)
    assert np.isfinite(flywheel.flash_attn_func(q1, kc1, kc1, sinks=[1.5])).all()
    for scalar in (1.5, np.array(1.5), np.array(1.5, np.float32)):
        with pytest.raises(FlywheelError, match="sinks has 0 dimensions"):
            flywheel.flash_attn_func(q1, kc1, kc1, sinks=scalar)


def test_sinks_far_from_the_scores():
    """A sink far above the scores takes the whole row (out ~0, lse the sink, no overflow);
    far below, or -inf, it changes nothing."""
    rng = np.random.default_rng(44)
    q, _ = make(rng, (1, 20, 2, 16), "float32", "numpy")
    k, _ = make(rng, (1, 20, 2, 16), "float32", "numpy")
    plain, plse = flywheel.flash_attn_func(q, k, k, causal=True, return_softmax_lse=True)
    out, lse = flywheel.flash_attn_func(q, k, k, causal=True, return_softmax_lse=True,
                                        sinks=np.array([80.0, 80.0], np.float32))
    assert np.abs(out).max() < 1e-20 and np.allclose(lse, 80.0)
    for low in (-80.0, -np.inf):
        out, lse = flywheel.flash_attn_func(q, k, k, causal=True, return_softmax_lse=True,
                                            sinks=np.full(2, low, np.float32))
        assert np.allclose(out, plain, atol=1e-6) and np.allclose(lse, plse, atol=1e-6)
