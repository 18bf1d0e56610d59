"""numpy arrays and torch CPU tensors as fw_tensor descriptors, without copies.

A descriptor points into the caller's memory with the caller's strides. Copies happen only
where the C API cannot express the layout: numpy views with negative strides or strides that
are not whole elements (np.ascontiguousarray), and the small int32 index arrays and float32
gate arrays when they come in another dtype. Each public function says which of its
arguments may be copied.

Errors, the same rule everywhere: a dtype the library does not take raises TypeError (q, k, v,
out, caches: float32, bfloat16, float16, so float64 and integers are refused here; g, beta and
the other small float32 operands: any floating dtype, converted; states updated in place:
float32; index arrays: integers); a bad shape or value raises ValueError. An array the call
writes into (out, a cache it appends to, a state it updates) must be writable: a numpy array
with flags.writeable False raises ValueError naming it, before the library is called.
"""

import sys

import numpy as np

from . import _lib

try:
    import ml_dtypes

    _NP_BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bf16 numpy arrays need ml_dtypes; torch.bfloat16 does not
    _NP_BF16 = None

# the dtypes of q, k, v, outputs and caches (float64 is only for the C reference functions'
# outputs, which the binding does not call)
_NP_CODES = {np.dtype(np.float32): _lib.F32, np.dtype(np.float16): _lib.F16}
if _NP_BF16 is not None:
    _NP_CODES[_NP_BF16] = _lib.BF16
# the 8-bit floats KV caches may hold (fp8_array): ml_dtypes' and torch's
_NP_F8 = {}
if _NP_BF16 is not None:
    _NP_F8 = {np.dtype(ml_dtypes.float8_e4m3fn): _lib.F8E4M3,
              np.dtype(ml_dtypes.float8_e5m2): _lib.F8E5M2}


def _torch():
    return sys.modules.get("torch")


def is_torch(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _torch_code(t):
    torch = _torch()
    return {torch.float32: _lib.F32, torch.bfloat16: _lib.BF16,
            torch.float16: _lib.F16}.get(t.dtype)


def _torch_f8_code(t):
    torch = _torch()
    return {getattr(torch, "float8_e4m3fn", None): _lib.F8E4M3,
            getattr(torch, "float8_e5m2", None): _lib.F8E5M2}.get(t.dtype)


def is_fp8(x):
    """Whether x is a torch tensor or numpy array of an 8-bit float dtype (float8_e4m3fn,
    float8_e5m2: the fp8 KV caches' types)."""
    if is_torch(x):
        return _torch_f8_code(x) is not None
    return isinstance(x, np.ndarray) and x.dtype in _NP_F8


def fp8_cache(x, name):
    """An fp8 KV cache (torch CPU tensor or numpy array of float8_e4m3fn / float8_e5m2), as is:
    it is written in place, so numpy strides that fw_tensor cannot express raise."""
    if is_torch(x) and x.device.type != "cpu":
        raise NotImplementedError(f"{name} is on {x.device}: the CPU library takes CPU tensors only")
    if isinstance(x, np.ndarray) and _odd_strides(x):
        raise ValueError(f"{name} is written in place, but its strides {x.strides} are negative "
                         "or not whole elements")
    return x


def _check_grad(t, name):
    torch = _torch()
    if t.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            f"{name} requires grad: this flywheel call has no backward (flash_attn_func and "
            "flash_attn_varlen_func have one); call under torch.no_grad() or "
            "torch.inference_mode(), or pass .detach()")


def wants_grad(*xs):
    """True when autograd would record a call on these inputs: a torch tensor among them
    requires grad and grad mode is on."""
    torch = _torch()
    return (torch is not None and torch.is_grad_enabled() and
            any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs))


def detach(x):
    """x without its autograd history (torch), or x itself."""
    return x.detach() if is_torch(x) else x


def check_writable(x, name):
    """ValueError when x is a numpy array the call would write into but may not: one with
    flags.writeable False (np.asarray of a JAX array, a.setflags(write=False), a broadcast
    view). Torch tensors are left to torch."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name} is a read-only numpy array (flags.writeable is False), and "
                         "this call writes into it in place: pass a writable array (a copy, "
                         f"np.array({name}), if it has to be)")
    return x


def float_array(x, name, inplace=False):
    """Accept a float tensor/array as is (torch CPU tensor or numpy array); a numpy view whose
    strides fw_tensor cannot express is copied, unless `inplace` (no copy may be made: the
    library writes into it, or it is a cache), which raises instead. Lists and scalars are not
    accepted. Writability is checked by check_writable, where the call writes."""
    if is_torch(x):
        if x.device.type != "cpu":
            raise NotImplementedError(f"{name} is on {x.device}: the CPU library takes CPU "
                                      "tensors only")
        if _torch_code(x) is None:
            raise TypeError(f"{name}: dtype {x.dtype} is not supported "
                            "(torch.float32, torch.bfloat16, torch.float16)")
        _check_grad(x, name)
        return x
    if not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"):
        # another DLPack producer (a JAX array, ...): a numpy view of its memory, read-only
        # where the producer says so (DLPack 1.0), so it cannot be an output
        # (numpy has no DLPack code for bfloat16: such arrays go through __array__, which
        # may copy)
        try:
            x = np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError, ValueError) as e:
            if not hasattr(x, "__array__"):
                raise TypeError(f"{name}: {type(x).__name__} could not be read through DLPack "
                                f"({e}); pass a numpy array or a torch CPU tensor") from None
            x = np.asarray(x)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array or a torch CPU tensor (or another "
                        f"DLPack CPU array), got {type(x).__name__}")
    if x.dtype not in _NP_CODES:
        hint = " (bfloat16 numpy arrays need the ml_dtypes package)" if _NP_BF16 is None else ""
        raise TypeError(f"{name}: dtype {x.dtype} is not supported "
                        f"(float32, bfloat16, float16){hint}")
    if _odd_strides(x):
        if inplace:
            raise ValueError(f"{name} is written in place, but its strides {x.strides} are "
                             "negative or not whole elements")
        x = np.ascontiguousarray(x)
    return x


def _odd_strides(x):
    """A numpy array with a negative stride, or one that is not whole elements, in a dimension
    of more than one element, unless the array is empty (strides that are never used to reach
    an element do not count)."""
    return x.size > 0 and any((s < 0 or s % x.itemsize) and n > 1
                              for s, n in zip(x.strides, x.shape))


def describe(x):
    """An fw_tensor over x (a result of float_array, or an output array): pointer, dtype,
    shape and element strides. The caller keeps x alive for the length of the call."""
    t = _lib.Tensor()
    if is_torch(x):
        t.data = x.data_ptr() or None
        t.dtype = _torch_code(x) if _torch_code(x) is not None else _torch_f8_code(x)
        shape, strides = tuple(x.shape), tuple(x.stride())
    else:
        t.data = x.ctypes.data or None
        t.dtype = _NP_CODES[x.dtype] if x.dtype in _NP_CODES else _NP_F8[x.dtype]
        # (strides never used to reach an element, a one-element dimension's or any of an
        # empty array's: 0 when they are negative or not whole elements)
        shape = x.shape
        strides = tuple(0 if (n == 1 or x.size == 0) and (s < 0 or s % x.itemsize)
                        else s // x.itemsize for s, n in zip(x.strides, x.shape))
    if len(shape) > 4:
        raise ValueError(f"tensor of rank {len(shape)}: at most 4 dimensions")
    t.ndim = len(shape)
    for i, (n, s) in enumerate(zip(shape, strides)):
        t.shape[i] = n
        t.stride[i] = s
    return t


# Outputs from this size on are numpy allocations (torch tensors share them): numpy asks the
# kernel for transparent huge pages on large arrays, torch's CPU allocator does not, and the
# first touch of 4 KiB pages is a fault each. Measured, chunk_gated_delta_rule with a 32 MiB
# bf16 output (T = 4K, 32 heads, 2 threads, `make compare-cpu`): 105 ms into torch.empty,
# 89 ms into an existing output; into this, the same as into an existing output.
_LARGE = 4 << 20


def empty_like_family(ref, shape, dtype=None):
    """An uninitialised contiguous output of the same family (numpy or torch) as ref, with
    ref's dtype unless `dtype` ("float32") is given."""
    if is_torch(ref):
        torch = _torch()
        dt = ref.dtype if dtype is None else getattr(torch, dtype)
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * torch.empty((), dtype=dt).element_size()
        if nbytes < _LARGE:
            return torch.empty(shape, dtype=dt)
        return torch.from_numpy(np.empty(nbytes, np.uint8)).view(dt).reshape(shape)
    dt = ref.dtype if dtype is None else np.dtype(dtype)
    return np.empty(shape, dtype=dt)


def output(out, ref, shape, dtype=None, name="out"):
    """The array a call writes: a new contiguous one of ref's family (and dtype, unless given),
    or the caller's `out`, written in place; the library checks its shape and dtype."""
    if out is None:
        return empty_like_family(ref, shape, dtype)
    return check_writable(float_array(out, name, inplace=True), name)


def merged_view(x, name):
    """x [b, s, ...] as a [b*s, ...] view of the same memory (for arrays the library writes);
    ValueError if the strides do not allow one."""
    if x.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions, got shape {tuple(x.shape)}")
    shape = (x.shape[0] * x.shape[1],) + tuple(x.shape[2:])
    if is_torch(x):
        try:
            return x.view(shape)
        except RuntimeError:
            pass
    else:
        (b, n), (sb, sn) = x.shape[:2], x.strides[:2]
        if b == 1 or n == 1 or sb == n * sn:
            lead = sn if n > 1 else sb
            return np.lib.stride_tricks.as_strided(x, shape, (lead,) + x.strides[2:])
    raise ValueError(f"{name}: its first two dimensions cannot be merged into one stride "
                     f"(strides {tuple(x.stride()) if is_torch(x) else x.strides})")


def to_numpy_f32(x, name):
    """A small float32 operand (gates, beta, states) as a contiguous float32 numpy array,
    sharing memory when it already is one (torch tensors included). Any floating dtype is
    converted; others (integers, bool, complex, strings) raise TypeError."""
    if x is None:
        raise TypeError(f"{name} is required (an array, got None)")
    if is_torch(x):
        if x.device.type != "cpu":
            raise NotImplementedError(f"{name} is on {x.device}: CPU tensors only")
        if not x.is_floating_point():
            raise TypeError(f"{name}: dtype {x.dtype} is not supported (a floating dtype, "
                            "used as float32)")
        _check_grad(x, name)
        torch = _torch()
        x = x.detach().to(torch.float32).contiguous().numpy()
    a = np.asarray(x)
    if a.dtype.kind != "f" and (_NP_BF16 is None or a.dtype != _NP_BF16):
        raise TypeError(f"{name}: dtype {a.dtype} is not supported (a floating dtype, used as "
                        "float32)")
    # (reshaped: ascontiguousarray makes a 0-d array 1-d, which would pass a scalar where
    # the library asks for [n] when n is 1)
    return np.ascontiguousarray(a, dtype=np.float32).reshape(a.shape)


def descale_array(x, name):
    """An fp8 cache's descale as a float32 numpy array: a Python number or a 0-d / [1] array
    (a scalar for the whole cache), or [b, hkv]; the library checks the shape and values."""
    if isinstance(x, (int, float)):
        return np.array(x, dtype=np.float32)
    return to_numpy_f32(x, name)


def small_float_array(x, name):
    """A small float operand the library reads in any of its dtypes (attention sinks):
    float32, bfloat16 or float16 as float_array takes it (in place, any stride); another
    floating dtype (float64) or a list as a contiguous float32 copy (to_numpy_f32, which
    raises TypeError for the rest)."""
    if (is_torch(x) and _torch_code(x) is not None) or \
            (isinstance(x, np.ndarray) and x.dtype in _NP_CODES):
        return float_array(x, name)
    return to_numpy_f32(x, name)


def index_array(x, name):
    """An int32 index operand (cu_seqlens, block tables, lengths, slots) as a contiguous int32
    numpy array; a copy unless it already is one. Accepts lists, numpy and torch."""
    if is_torch(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {a.dtype}")
    if a.size and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
        raise ValueError(f"{name}: values do not fit in int32")
    return np.ascontiguousarray(a, dtype=np.int32)


def int32_offsets(count, step, what):
    """The int32 offsets 0, step, 2 step, ..., count * step (cu_seqlens of `count` sequences
    of `step` rows each); ValueError when the sequences or the rows do not fit in int32."""
    top = np.iinfo(np.int32).max
    if count > top or count * step > top:
        raise ValueError(f"{what}: {count} sequences of {step} rows; the library's int32 "
                         f"offsets hold at most {top} of each")
    return (np.arange(count + 1, dtype=np.int64) * step).astype(np.int32)


def ptr(x):
    """The data pointer of a numpy array or torch tensor (None for None or an empty one)."""
    if x is None:
        return None
    if is_torch(x):
        return x.data_ptr() if x.numel() else None
    return x.ctypes.data if x.size else None


def merge_leading(x):
    """x [b, s, ...] as [b*s, ...]: a view when the strides allow, else a copy (torch
    .reshape or numpy reshape semantics)."""
    return x.reshape((x.shape[0] * x.shape[1],) + tuple(x.shape[2:]))


def swap01_contiguous(x):
    """x [a, b, ...] as a contiguous [b, a, ...] copy."""
    if is_torch(x):
        return x.transpose(0, 1).contiguous()
    return np.ascontiguousarray(x.swapaxes(0, 1))
