#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of the flywheel Python binding's argument handling.

Each input decodes (atheris.FuzzedDataProvider) into one call of the package: which function,
the shapes (0, 1, mismatched, huge ones that cost nothing: zero strides over a small buffer),
dtypes, layouts (transposed, sliced, negative, zero and odd byte strides, unaligned data,
read-only), keyword arguments (scales, windows, softcaps, precision and isa strings, out=,
cu_seqlens, cache_seqlens, block tables, states and their slots, ...) and values (NaN, inf,
huge). The binding's contract, checked on every input:
  (a) the process does not crash (libFuzzer reports signals itself);
  (b) an exception is one of the error rules (docs/python.md): TypeError, ValueError (FlywheelError
      included), NotImplementedError; MemoryError only for problems with a huge dimension.
      Anything else (IndexError, OverflowError, AttributeError, ctypes errors, ...) is a
      finding;
  (c) a call that raises leaves every array byte for byte as it was, and a call that succeeds
      changes only the arrays it writes (out=, the caches it appends to, the states it
      updates), and only inside them;
  (d) a model of the documented rules says which problems are valid: a valid problem must
      not be refused and an invalid one must not be accepted; a small valid problem with
      moderate finite inputs must give finite results that match a float64 numpy
      reference (attention, the cache appends, Gated DeltaNet outputs and states) within a
      loose tolerance, in the documented shapes and dtypes.
Findings raise AssertionError, which atheris reports with the input (crash-* file).

Run (from anywhere; libFuzzer flags pass through; needs requirements.txt):
    python fuzz/python/fuzz_binding.py fuzz/python/corpus -max_total_time=60
    python fuzz/python/fuzz_binding.py CRASH_FILE             # replay one input
    python fuzz/python/fuzz_binding.py --make-corpus DIR      # write the seed corpus
Crash files go to $TMPDIR/flywheel-fuzz-binding/ unless -artifact_prefix= says where, and
when the first corpus folder is the committed one new units go to a fresh temporary folder
placed before it: the tree stays as it was. Allocations are capped at about 3 GiB over the
start (RLIMIT_AS), so a huge output fails with MemoryError instead of being computed.
The package is the one Python imports (PYTHONPATH, an installed flywheel), else python/ of
this tree; the library is FLYWHEEL_LIBRARY, else the package's own, else build/ of this tree.
"""

import importlib.util
import math
import os
import resource
import sys
import tempfile
import warnings

sys.dont_write_bytecode = True  # nothing written into the tree
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(HERE, "corpus")  # the committed seeds


def _locate_package():
    if importlib.util.find_spec("flywheel") is None:
        sys.path.insert(0, os.path.join(ROOT, "python"))
    spec = importlib.util.find_spec("flywheel")
    if spec is not None and spec.origin and not os.environ.get("FLYWHEEL_LIBRARY"):
        own = os.path.join(os.path.dirname(spec.origin), "libflywheel.so")
        built = os.path.join(ROOT, "build", "libflywheel.so")
        if not os.path.exists(own) and os.path.exists(built):
            os.environ["FLYWHEEL_LIBRARY"] = built


_locate_package()

import atheris  # noqa: E402
import numpy as np  # noqa: E402

LOG2E = 1.4426950408889634
FLT_MAX = 3.4028234663852886e38

with atheris.instrument_imports(include=["flywheel"]):
    import flywheel  # noqa: E402

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
    F8S = [np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)]  # fp8 caches
except ImportError:  # then bfloat16 and fp8 numpy arrays are simply not generated
    BF16 = None
    F8S = []

F32, F16, F64 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)
FLOATS = [F32, F16] + ([BF16] if BF16 is not None else [])
# dtypes the library does not take for q, k, v, out and caches
BAD_DTYPES = [F64, np.dtype(np.int32), np.dtype(np.int64), np.dtype(bool), np.dtype(object),
              np.dtype(np.complex64), np.dtype(np.uint8), np.dtype(np.longdouble)]
HUGE = [2**31 - 1, 2**31, 2**32 + 1, 2**40, 2**55]
NAN, INF = float("nan"), float("inf")
SUPPORTED_ISA = flywheel.isa_tables()
ISAS = [None, "", "portable", "avx2", "avx512", "avx512bf16", "amx", "sve", "Portable", 7, b"avx2",
        "\udc80"]
PRECISIONS = [None, "auto", "f32", "bf16", "F32", "", 1, b"f32"]
SCALE_SPECIALS = [0.0, -0.0, NAN, INF, -INF, 1e-50, -1e-50, 1e39, 2**2000, 1e-40, "0.5",
                  "half", 1j, True, np.float64(0.25), np.array([0.5, 0.5]), np.array(0.5),
                  None, -3.0]
SOFTCAPS = [0.0, 5.0, 1.0, 30.0, -1.0, NAN, INF, 1e-50, -1e-50, 1e39, 2**2000, None, "2",
            np.array([1.0, 2.0]), 1e-40]
WINDOW_SIDES = [-1, 0, 1, 2, 3, 5, None, -5, 2**31, 2**40, 2**62, 2**63 - 1, 2**63, 2**64,
                2**64 + 3, INF, -INF, NAN, 2.5, "3", np.int64(2), np.int64(2**63 - 1),
                np.uint64(2**64 - 1), True, np.array([1, 2])]
CAUSALS = [False, True, 0, 1, 2, np.bool_(True), None, "", np.array([1, 0]), 0.5]
ALLOWED = (TypeError, ValueError, NotImplementedError)
ALLOC_CAP_MB = 3072  # allocations over the start past this fail (_limit_memory)
RSS_LIMIT_MB = ALLOC_CAP_MB + 1024  # libFuzzer's limit: the cap plus the start's resident set
REF_BLOCK = 1 << 22  # scores per array in attention_ref (32 MiB of float64)
REF_SCORES = 1 << 24  # past this many scores a sequence is not compared (~1 s of numpy)


class Finding(AssertionError):
    pass


def _unbounded_or_int(side):
    """A window side as the documented rule reads it: None or negative: unbounded (-1);
    otherwise its integer value (inf and anything past any sequence: unbounded)."""
    if side is None:
        return -1
    if bool(side < 0):
        return -1
    if isinstance(side, float) and math.isinf(side):
        return -1
    n = int(side)
    return -1 if n >= 2**62 else n


def _f32(x):
    with np.errstate(all="ignore"):
        return float(np.float32(x))


def _no_alias(a):
    """True when no two elements of a share an address (the rule outputs follow)."""
    if a.size == 0:
        return True
    dims = sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1)
    reach = 0
    for s, n in dims:
        if s <= reach:
            return False
        reach += (n - 1) * s
    return True


def round_bf16(x):
    """float64 values rounded to bfloat16 through float32 (nearest even), as float64."""
    with np.errstate(all="ignore"):
        u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def attention_ref(q, k, v, scale, causal, left, right, softcap, bf16, sinks=None, kv_exact=False):
    """float64 softmax attention of one sequence, masks aligned bottom-right: q [sq, hq, d],
    k [sk, hkv, d], v [sk, hkv, dv] -> out [sq, hq, dv], lse [hq, sq] (rows that see no key:
    0 and -inf). bf16: the kernels' bf16 products (q, k, v and the probabilities rounded).
    sinks [hq] (finite) or None: attention sinks, one more term exp(sinks[h]) in each row's
    denominator and in lse (a row that sees no key: 0 and the sink).
    Query rows go in blocks of at most REF_BLOCK scores per array. Returns None, None past
    REF_SCORES scores (65537 rows over a 2K cache): the model is for small problems, and the
    call has been checked for refusals and writes by then."""
    sq, hq, _ = q.shape
    sk, hkv, dv = v.shape
    if sq * hq * sk > REF_SCORES:
        return None, None
    if bf16:  # (an fp8 cache's rows, kv_exact: their bytes are exact in bf16 and the kernels
        # apply the descales in f32, so the dequantised values are not rounded)
        q = round_bf16(q)
        k, v = (k, v) if kv_exact else (round_bf16(k), round_bf16(v))
    kk, vv = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
    if causal:
        right = 0
    out, lse = np.zeros((sq, hq, dv)), np.zeros((hq, sq))
    step = max(1, REF_BLOCK // max(1, hq * sk))
    for a in range(0, sq, step):
        e = min(sq, a + step)
        s = np.einsum("qhd,khd->hqk", q[a:e], kk) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        i = np.arange(a, e)[:, None] + (sk - sq)
        j = np.arange(sk)[None, :]
        seen = np.ones((e - a, sk), dtype=bool)
        if left >= 0:
            seen &= j >= i - left
        if right >= 0:
            seen &= j <= i + right
        s = np.where(seen[None], s, -np.inf)
        m = s.max(axis=-1, keepdims=True) if sk else np.full((hq, e - a, 1), -np.inf)
        if sinks is not None:
            m = np.maximum(m, sinks[:, None, None])
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        den = p.sum(axis=-1, keepdims=True)
        if sinks is not None:
            den = den + np.exp(sinks[:, None, None] - m)
        pv = round_bf16(p) if bf16 else p
        out[a:e] = np.einsum("hqk,khd->qhd", pv / np.where(den > 0, den, 1.0), vv)
        d0 = den[..., 0]
        lse[:, a:e] = np.where(d0 > 0, np.log(np.where(d0 > 0, d0, 1.0)) + m[..., 0], -np.inf)
    return out, lse


def gdn_ref(q, k, v, g, beta, scale, h0, l2norm):
    """float64 Gated DeltaNet recurrence of one sequence (fla's state layout [HV, K, V]):
    q, k [T, H, K], v [T, HV, V], g, beta [T, HV], h0 [HV, K, V] or None."""
    Tn, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    r = HV // H
    if l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    h = np.zeros((HV, K, V)) if h0 is None else np.array(h0, dtype=np.float64)
    o = np.zeros((Tn, HV, V))
    for t in range(Tn):
        for j in range(HV):
            kt = k[t, j // r]
            h[j] *= np.exp(g[t, j])
            h[j] += np.outer(kt, beta[t, j] * (v[t, j] - h[j].T @ kt))
            o[t, j] = h[j].T @ (q[t, j // r] * scale)
    return o, h


def gdn_stable(k, beta, l2norm):
    """The recurrence stays bounded (|1 - beta |k|^2| <= 1) for every token and value head,
    so a float64 comparison means something."""
    if l2norm:
        kn = np.ones(k.shape[:-1])
    else:
        kn = (k * k).sum(-1)
    if k.shape[0] == 0 or beta.size == 0:
        return True
    r = beta.shape[-1] // max(k.shape[-2], 1)
    kn = np.repeat(kn, r, axis=-1)
    return bool(np.all(beta * kn <= 2.0) and np.all(beta >= 0))


def _strided(b, shape, strides, writeable=True):
    """A view of the contiguous array b with `shape` and byte `strides`, of b's dtype
    (numpy's as_strided goes through the array interface, which does not know ml_dtypes'
    fp8 types; an array of objects has no bytes to view, and takes as_strided)."""
    if b.dtype.hasobject:
        view = np.lib.stride_tricks.as_strided(b, shape, strides)
    else:
        view = np.ndarray(shape, b.dtype, buffer=b.reshape(-1).view(np.uint8), strides=strides)
    if not writeable:
        view.setflags(write=False)
    return view


class Case:
    """One decoded problem: the data provider, the arrays made for it (with the buffers they
    live in, for the snapshots), and what the model finds wrong with it."""

    def __init__(self, data):
        self.fdp = atheris.FuzzedDataProvider(data)
        self.rng = np.random.default_rng(self.n(0, 2**16))
        self.buffers = []      # (name, buffer, rebuild(buffer) -> view, written)
        self.huge = False
        self.allow_huge = self.flag(5)
        self.mag = self.pick([1.0, 0.5, 2.0, 1e-3, 30.0, 1e4, 1e30])
        self.why = []          # reasons the model refuses the problem
        self.unsure = []       # reasons the model cannot tell
        self.exotic = False    # some array holds non-finite or huge values

    # ---------------------------------------------------------------- decoding
    def n(self, lo, hi):
        return self.fdp.ConsumeIntInRange(lo, hi)

    def pick(self, seq):
        return seq[self.n(0, len(seq) - 1)]

    def flag(self, k):
        """True about once in k (False once the input is used up: the plain path)."""
        return self.n(0, k - 1) == k - 1

    def dim(self, choices=(1, 2, 3, 4)):
        return self.pick(list(choices))

    # ---------------------------------------------------------------- arrays
    def values(self, shape, fill):
        rng = self.rng
        if fill == "gate":
            return -np.abs(rng.standard_normal(shape)) * 0.3
        if fill == "beta":
            return rng.random(shape)
        if fill == "sentinel":
            return np.full(shape, 777.0)
        if fill == "state":
            return rng.standard_normal(shape) * 0.25
        if fill == "descale":
            return 2.0 ** rng.uniform(-3, 3, shape)
        if fill == "sinks":  # logits near the scores', or now and then far from them
            return rng.standard_normal(shape) * self.mag * (8.0 if rng.random() < 0.3 else 1.0)
        return rng.standard_normal(shape) * self.mag

    def tensor(self, name, shape, dtype, written=False, fill="normal", bad_dtypes=BAD_DTYPES,
               layouts=True, forms=True):
        """An array of `shape` named `name` (or, rarely, a non-array), in `dtype` unless the
        input picks another, in a layout the input picks. `written`: the call may write it."""
        if forms and self.flag(40):
            form = self.pick(["list", "none", "scalar", "tuple"])
            x = self.values(shape, fill)
            return {"list": x.tolist(), "none": None, "scalar": 1.5, "tuple": (1.0, 2.0)}[form]
        if self.flag(14):
            dtype = np.dtype(self.pick(list(bad_dtypes) + FLOATS))
        if math.prod(shape) > 1 << 18:  # made from one slice, broadcast (zero stride)
            ax = int(np.argmax(shape))
            one = list(shape)
            one[ax] = 1
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                buf = np.ascontiguousarray(self.values(one, fill).astype(dtype))
            strides = list(buf.strides)
            strides[ax] = 0

            def rebuild(b):
                return _strided(b, shape, strides)
            self.buffers.append((name, buf, rebuild, written))
            return rebuild(buf)
        vals = self.values(shape, fill)
        if self.flag(12) and vals.size:
            vals.flat[self.n(0, vals.size - 1)] = self.pick(
                [NAN, INF, -INF, 6.5e4, 1e38, -0.0, 1e-45, 3e5])
            self.exotic = True
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a0 = np.ascontiguousarray(vals.astype(dtype))
        kind = "c"
        if layouts and self.flag(3):
            kind = self.pick(["T", "slice", "neg", "zero", "unaligned", "bytes", "huge",
                              "zero_ro"])
        if a0.dtype == object and kind not in ("c", "T", "neg"):
            kind = "c"
        if kind == "huge" and (not self.allow_huge or self.huge or a0.ndim == 0):
            kind = "zero"
        view, buf, rebuild = self._layout(a0, kind)
        if self.flag(16):
            view.setflags(write=False)
        self.buffers.append((name, buf, rebuild, written))
        return view

    def _layout(self, a0, kind):
        nd, shape = a0.ndim, a0.shape
        ident = (lambda b: b)
        if nd == 0 or kind == "c":
            return a0, a0, ident
        if kind == "T":
            perm = list(self.rng.permutation(nd))
            inv = list(np.argsort(perm))
            buf = np.ascontiguousarray(a0.transpose(perm))
            return buf.transpose(inv), buf, (lambda b: b.transpose(inv))
        if kind == "slice":
            steps = [self.pick([1, 2, 3]) for _ in range(nd)]
            offs = [self.n(0, 1) for _ in range(nd)]
            if math.prod(n * s + o for n, s, o in zip(shape, steps, offs)) > 1 << 20:
                steps, offs = [1] * nd, [0] * nd  # the buffers stay small
            buf = np.full([n * s + o for n, s, o in zip(shape, steps, offs)], 7, a0.dtype) \
                if a0.dtype != object else None
            if buf is None:
                return a0, a0, ident
            sl = tuple(slice(o, o + n * s, s) for n, s, o in zip(shape, steps, offs))
            view = buf[sl]
            view[...] = a0
            return view, buf, (lambda b: b[sl])
        if kind == "neg":
            ax = self.n(0, nd - 1)
            buf = np.ascontiguousarray(np.flip(a0, ax))
            return np.flip(buf, ax), buf, (lambda b: np.flip(b, ax))
        if kind in ("zero", "zero_ro", "huge"):
            ax = self.n(0, nd - 1)
            one = list(shape)
            one[ax] = 1
            buf = np.ascontiguousarray(a0[tuple(slice(0, 1) if i == ax else slice(None)
                                                  for i in range(nd))])
            if buf.shape[ax] == 0:
                buf = np.full(one, 0.5).astype(a0.dtype)
            full = list(shape)
            if kind == "huge":
                full[ax] = self.pick(HUGE)
            strides = list(buf.strides)
            strides[ax] = 0
            try:
                view = _strided(buf, full, strides, writeable=kind != "zero_ro")
            except ValueError:  # numpy: too big for one array
                return a0, a0, ident
            if kind == "huge":
                self.huge = True
            return view, buf, (lambda b: _strided(b, full, strides))
        isz = a0.itemsize
        if kind == "unaligned" and isz > 1:
            off = self.n(1, isz - 1)
            buf = np.zeros(a0.nbytes + isz, np.uint8)
            dt = a0.dtype

            def rebuild(b):
                return b[off:off + a0.nbytes].view(dt).reshape(shape)
            view = rebuild(buf)
            view[...] = a0
            return view, buf, rebuild
        if kind == "bytes":
            strides = [0] * nd
            s = isz + (self.n(1, isz - 1) if isz > 1 else 1)
            for i in range(nd - 1, -1, -1):
                strides[i] = s
                s = s * max(shape[i], 1) + self.n(0, 3)
            span = sum((n - 1) * st for n, st in zip(shape, strides)) + isz \
                if all(shape) else 0
            buf = np.zeros(max(span, 1), np.uint8)
            dt = a0.dtype

            def rebuild(b):
                return np.ndarray(shape, dt, buffer=b, strides=strides)
            view = rebuild(buf)
            view[...] = a0
            return view, buf, rebuild
        return a0, a0, ident

    def index(self, name, vals, fits=True):
        """An integer index operand (cu_seqlens, lengths, block tables, slots) holding vals, in a
        form the input picks (int32 array mostly; lists, other integer and non-integer dtypes,
        views). Returns the object passed."""
        vals = np.asarray(vals, dtype=np.int64)
        form = self.pick(["i32", "i32", "list", "i64", "u32", "i16", "u64", "f32", "bool",
                          "obj", "scalar0d", "2d", "view", "ro", "neg"]) \
            if self.flag(4) else "i32"
        if form == "list":
            return vals.tolist()
        if form in ("i64", "u32", "i16", "u64", "f32", "bool", "obj"):
            dt = {"i64": np.int64, "u32": np.uint32, "i16": np.int16, "u64": np.uint64,
                  "f32": np.float32, "bool": bool, "obj": object}[form]
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                a = vals.astype(dt) if form not in ("u32", "u64", "i16") else \
                    np.asarray(vals).astype(dt)
        elif form == "scalar0d":
            a = np.asarray(vals.ravel()[0] if vals.size else 0, dtype=np.int32)
        elif form == "2d":
            a = vals.astype(np.int32).reshape(1, -1) if vals.ndim == 1 else \
                vals.astype(np.int32).reshape(-1)
        elif form == "view":
            buf = np.zeros(vals.shape + (2,), np.int32)
            buf[..., 0] = vals
            a = buf[..., 0]
        elif form == "ro":
            a = vals.astype(np.int32)
            a.setflags(write=False)
        elif form == "neg" and vals.ndim >= 1:
            buf = np.ascontiguousarray(vals[::-1].astype(np.int32))
            a = buf[::-1]
            self.buffers.append((name, buf, lambda b: b[::-1], False))
            return a
        else:
            small = not vals.size or (vals.max() < 2**31 and vals.min() >= -2**31)
            a = vals.astype(np.int32) if fits or small else vals
        if isinstance(a, np.ndarray) and a.dtype != object:
            self.buffers.append((name, a, lambda b: b, False))
        return a

    def int_values(self, vals, bad):
        """vals (a list of ints), with one entry replaced by a value from `bad` at times."""
        vals = list(vals)
        if vals and self.flag(6):
            vals[self.n(0, len(vals) - 1)] = self.pick(bad)
        return vals

    # ---------------------------------------------------------------- checks
    def snapshot(self):
        return [b.tobytes() for _, b, _, _ in self.buffers]

    def check_untouched(self, before, what, written_too=True):
        for (name, buf, _, written), old in zip(self.buffers, before):
            if (written_too or not written) and buf.tobytes() != old:
                raise Finding(f"{what}: the call changed {name} (written={written})")

    def check_written_inside(self, before, view_of):
        """On success: a written array changed only inside the view the call was given
        (view_of maps a buffer name to the array passed)."""
        for (name, buf, rebuild, written), old in zip(self.buffers, before):
            if not written or name not in view_of:
                continue
            exp = np.frombuffer(bytearray(old), dtype=buf.dtype).reshape(buf.shape)
            rebuild(exp)[...] = view_of[name]
            if exp.tobytes() != buf.tobytes():
                raise Finding(f"{name} changed outside the array the call was given")


# -------------------------------------------------------------------- model helpers
def is_float_array(x, name, why, inplace=False, written=False, f8=False):
    """f8: an fp8 dtype is taken too (a KV cache)."""
    if not isinstance(x, np.ndarray):
        why.append(f"{name} is not an array")
        return False
    if x.dtype not in FLOATS and not (f8 and x.dtype in F8S):
        why.append(f"{name} dtype {x.dtype}")
        return False
    if inplace and x.size and any((s < 0 or s % x.itemsize) and n > 1
                                  for s, n in zip(x.strides, x.shape)):
        why.append(f"{name} written in place with strides {x.strides}")
        return False
    if written and not x.flags.writeable:
        why.append(f"{name} is read-only")
        return False
    return True


def model_scale(c, value, default_dim, name="scale"):
    """The scale the call means (float32, as the library gets it), or None (c.why says why)."""
    if value is None:
        return 1.0 / math.sqrt(default_dim) if default_dim > 0 else None
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        c.why.append(f"{name} {value!r} is not a number")
        return None
    if x == 0.0:
        c.why.append(f"{name} 0")
        return None
    f = _f32(x)
    if not math.isfinite(f) or f == 0.0:
        c.why.append(f"{name} {x!r} is not a finite non-zero float32")
        return None
    return f


def model_softcap(c, value):
    try:
        x = float(value or 0.0)
    except (TypeError, ValueError, OverflowError):
        c.why.append(f"softcap {value!r}")
        return None
    f = _f32(x)
    if (x != 0.0 and f == 0.0) or not math.isfinite(f) or f < 0:
        c.why.append(f"softcap {x!r}")
        return None
    return f


def model_truth(c, value, name):
    try:
        return bool(value)
    except (TypeError, ValueError):
        c.why.append(f"{name} has no truth value")
        return False


def model_window(c, w):
    try:
        left, right = w
    except (TypeError, ValueError):
        c.why.append(f"window_size {w!r}")
        return -1, -1
    try:
        return _unbounded_or_int(left), _unbounded_or_int(right)
    except (TypeError, ValueError, OverflowError):
        c.why.append(f"window_size {w!r}")
        return -1, -1


def model_precision(c, value):
    if value is None or (isinstance(value, str) and value in ("auto", "f32", "bf16")):
        return value or "auto"
    c.why.append(f"precision {value!r}")
    return "auto"


def model_isa(c, value):
    if value is None or value == "":
        return
    if not isinstance(value, str):
        c.why.append(f"isa {value!r}")
        return
    if value not in SUPPORTED_ISA:
        c.why.append(f"isa {value!r} is not a table of this CPU")


def model_index(c, x, name, scalar=False):
    """x as the binding reads an index operand: an int64 array, or None (c.why says why).
    A 0-d array is a 1-element one (np.ascontiguousarray's rule, which the binding keeps)
    unless `scalar` (cache_seqlens, where one number is every sequence's)."""
    try:
        a = np.asarray(x)
    except (TypeError, ValueError):
        c.why.append(f"{name} is not an array")
        return None
    if a.size > 2**24:
        c.why.append(f"{name} is huge")
        return None
    if a.dtype.kind not in "iu":
        c.why.append(f"{name} dtype {a.dtype}")
        return None
    if a.size and (int(a.max()) > 2**31 - 1 or int(a.min()) < -2**31):
        c.why.append(f"{name} does not fit in int32")
        return None
    return a.astype(np.int64) if scalar else np.atleast_1d(a).astype(np.int64)


def small_copy(x):
    """A float64 copy of a small float array (before a call writes it), else None."""
    if isinstance(x, np.ndarray) and x.dtype in FLOATS + F8S + [F64] and x.size <= 2**20:
        try:
            return as64(x).copy()
        except (ValueError, MemoryError):  # zero-size but with a dimension numpy refuses
            return None
    return None


def gdn_offsets_model(c, kw, Bq, Tq, why):
    """The sequence offsets a GDN call over q [Bq, Tq, ...] means: cu_seqlens (batch 1 only,
    1-D, valid) or Bq sequences of Tq tokens; None (why or c.unsure says why) if neither."""
    if "cu_seqlens" in kw:
        cu = model_index(c, kw["cu_seqlens"], "cu_seqlens")
        if Bq != 1:
            why.append("cu_seqlens with batch > 1")
        elif cu is not None and (cu.ndim != 1 or not cu_ok(c, cu, Tq, "cu_seqlens")):
            if cu.ndim != 1:
                why.append("cu_seqlens not 1-D")
        return cu
    if Bq > 2**31 - 1 or Bq * Tq > 2**31 - 1:
        why.append("too many tokens")
        return None
    if Bq > 1 << 24:
        c.unsure.append("a batch too large to model")
        return None
    return np.arange(Bq + 1, dtype=np.int64) * Tq


def cu_ok(c, cu, total, name):
    if cu is None:
        return False
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != total:
        c.why.append(f"{name} {cu.tolist() if cu.size < 20 else '...'} (rows {total})")
        return False
    return True


def finite(*xs):
    return all(np.all(np.isfinite(x)) for x in xs)


def as64(x):
    with np.errstate(all="ignore"):
        return np.asarray(x).astype(np.float64)


def out_tol(dtype):
    return {F16: 2e-3}.get(dtype, 1.6e-2 if dtype == BF16 else 1e-5)


def compare(name, got, want, tol, scale=1.0):
    got = as64(got)
    if got.shape != want.shape:
        raise Finding(f"{name}: shape {got.shape}, expected {want.shape}")
    if got.size == 0:
        return
    if not np.all(np.isfinite(got)):
        raise Finding(f"{name}: non-finite result from finite moderate inputs")
    err = float(np.abs(got - want).max())
    if err > tol * scale:
        raise Finding(f"{name}: max error {err:.3g} over {tol * scale:.3g} against float64")


# -------------------------------------------------------------------- attention
def attn_kwargs(c, kw):
    if c.flag(2):
        kw["softmax_scale"] = c.pick([0.25, 0.5, 1.0, 0.125, 2.0, -0.5] + SCALE_SPECIALS) \
            if c.flag(3) else c.pick([0.25, 0.5, 1.0, 0.125])
    if c.flag(2):
        kw["causal"] = c.pick(CAUSALS) if c.flag(4) else True
    if c.flag(3):
        if c.flag(4):
            kw["window_size"] = c.pick([None, 3, (1, 2, 3), "ab", np.array([3, -1]), [2, 1]])
        else:
            kw["window_size"] = (c.pick(WINDOW_SIDES), c.pick(WINDOW_SIDES))
    if c.flag(4):
        kw["softcap"] = c.pick(SOFTCAPS)
    if c.flag(5):
        kw["precision"] = c.pick(PRECISIONS)
    if c.flag(6):
        kw["isa"] = c.pick(ISAS)


def attn_params_model(c, kw, d):
    scale = model_scale(c, kw.get("softmax_scale"), d, "softmax_scale")
    causal = model_truth(c, kw.get("causal", False), "causal")
    left, right = model_window(c, kw.get("window_size", (-1, -1)))
    softcap = model_softcap(c, kw.get("softcap", 0.0))
    precision = model_precision(c, kw.get("precision"))
    model_isa(c, kw.get("isa"))
    # the kernels' score multiplier, scale / softcap (or scale x log2 e), and softcap x log2 e
    # must be finite floats (attn/setup.c refuses the call otherwise)
    if softcap and softcap * LOG2E > FLT_MAX:
        c.why.append(f"softcap {softcap!r} x log2(e) overflows a float")
    elif scale and abs(scale) * (1 / softcap if softcap else LOG2E) > FLT_MAX:
        c.why.append(f"scale {scale!r} (softcap {softcap!r}) overflows the score multiplier")
    return dict(scale=scale, causal=causal, left=left, right=right, softcap=softcap or 0.0,
                precision=precision)


def sinks_kwargs(c, kw, hq):
    """Now and then sinks= or s_aux= (rarely both, refused): [hq] in any float dtype, a list
    or another form, dtypes and layouts as tensor() draws them (NaN / inf now and then), or
    one head more or fewer."""
    if not c.flag(3):
        return
    n = hq if not c.flag(10) else c.pick([hq + 1, max(hq - 1, 0), 0])
    shape = [n] if not c.flag(20) else c.pick([[], [n, 1], [1, n]])
    name = c.pick(["sinks", "s_aux"])
    kw[name] = c.tensor(name, shape, c.pick(FLOATS + [F64]), fill="sinks")
    if c.flag(16):
        other = "s_aux" if name == "sinks" else "sinks"
        kw[other] = c.tensor(other, [hq], F32, fill="sinks")


def model_sinks(c, kw, hq):
    """The call's sinks as the rules read them (sinks= or s_aux=, not both; any floating
    dtype, a list or tuple of numbers; [hq]; a number or a 0-d array of any dtype is
    refused): float64 [hq] for the reference, or None (no sinks, or a problem the model
    refuses)."""
    x, y = kw.get("sinks"), kw.get("s_aux")
    if x is not None and y is not None:
        c.why.append("sinks and s_aux both given")
        return None
    x = y if x is None else x
    if x is None:
        return None
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype not in FLOATS and a.dtype.kind != "f":
        c.why.append(f"sinks dtype {a.dtype}")
        return None
    if a.shape != (hq,):
        c.why.append(f"sinks shape {a.shape} for {hq} heads")
        return None
    return as64(a)


def bf16_products(params, qdtype, plain=False):
    return not plain and (params["precision"] == "bf16" or
                          (params["precision"] == "auto" and qdtype == BF16))


def heads(c):
    hkv = c.dim((1, 2, 1))
    return hkv * c.dim((1, 2, 1, 4)) if hkv == 1 else hkv * c.dim((1, 2)), hkv


def mutate_shapes(c, shapes):
    """Now and then one dimension of one array changes (0, off by one, large, huge for the
    ones that do not cost memory) or an array loses or gains a dimension."""
    if c.flag(4):
        name = c.pick(sorted(shapes))
        shp = shapes[name]
        if shp:
            ax = c.n(0, len(shp) - 1)
            old = shp[ax]
            shp[ax] = c.pick([0, old + 1, max(old - 1, 0), 1, 2, 5, 17, 65, 1025, 65537])
            if math.prod(shp) > 1 << 20:  # the arrays stay small (fast to make and check)
                shp[ax] = old + 1
    if c.flag(16):
        name = c.pick(sorted(shapes))
        if c.flag(2):
            shapes[name] = shapes[name][:-1]
        else:
            shapes[name] = shapes[name] + [1]


def run_call(c, fn, args, kw):
    """Call fn; enforce (b) and (c)'s failure half. Returns (result, exception)."""
    before = c.snapshot()
    c.outcome = "raised"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = fn(*args, **kw)
    except MemoryError as e:
        if not c.huge:
            raise Finding(f"MemoryError on a problem without huge dimensions: {e}") from e
        c.check_untouched(before, f"raised {type(e).__name__}")
        return None, e, before
    except ALLOWED as e:
        c.check_untouched(before, f"raised {type(e).__name__}: {e}")
        return None, e, before
    except Exception as e:
        raise Finding(f"{fn.__name__} raised {type(e).__name__} (not a documented error "
                      f"type): {e}") from e
    c.check_untouched(before, "inputs of a successful call", written_too=False)
    c.outcome = "ok"
    return res, None, before


def verdict(c, exc, what):
    """(d)'s validity half. True when the numeric checks should run."""
    if exc is not None:
        if not c.why and not c.unsure and not c.huge:
            raise Finding(f"{what}: a valid problem was refused: {type(exc).__name__}: {exc}") \
                from exc
        return False
    if c.why:
        raise Finding(f"{what}: an invalid problem was accepted ({'; '.join(c.why)})")
    return not c.unsure and not c.huge


def moderate(c, *xs):
    return not c.exotic and c.mag <= 2.0 and \
        finite(*[as64(x) for x in xs])


def fuzz_dense(c):
    b, sq, sk = c.dim((1, 2, 0, 3)), c.dim((3, 1, 4, 8, 0)), c.dim((4, 1, 5, 8, 0))
    hq, hkv = heads(c)
    d, dv = c.dim((8, 4, 16, 1, 3)), c.dim((8, 4, 16, 1, 5))
    dt = c.pick(FLOATS)
    shapes = {"q": [b, sq, hq, d], "k": [b, sk, hkv, d], "v": [b, sk, hkv, dv],
              "out": [b, sq, hq, dv]}
    mutate_shapes(c, shapes)
    q = c.tensor("q", shapes["q"], dt)
    k = c.tensor("k", shapes["k"], dt if not c.flag(20) else c.pick(FLOATS))
    v = c.tensor("v", shapes["v"], dt)
    kw = {}
    if c.flag(5):
        kw["out"] = c.tensor("out", shapes["out"], dt if not c.flag(8) else c.pick(FLOATS),
                             written=True, fill="sentinel")
    attn_kwargs(c, kw)
    if c.flag(4):
        kw["return_softmax_lse"] = True
    if c.flag(8):
        kw["return_attn_probs"] = c.pick([True, 1, np.array([1, 1])])
    if c.flag(10):
        kw["plain"] = True
    if c.flag(20):
        kw["dropout_p"] = c.pick([0.1, NAN, 0, None])
    if c.flag(25):
        kw["alibi_slopes"] = np.zeros(hq, np.float32)
    if c.flag(25):
        kw["deterministic"] = True
    sinks_kwargs(c, kw, hq)
    res, exc, before = run_call(c, flywheel.flash_attn_func, (q, k, v), kw)

    # the model
    why = c.why
    sinks = None
    ok = all(is_float_array(x, n, why) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    out = kw.get("out")
    if out is not None:
        ok = is_float_array(out, "out", why, inplace=True, written=True) and ok
    d_ = q.shape[-1] if isinstance(q, np.ndarray) and q.ndim else 0
    params = attn_params_model(c, kw, d_)
    plain = model_truth(c, kw.get("plain", False), "plain")
    lse_wanted = model_truth(c, kw.get("return_softmax_lse"), "lse")
    lse_wanted = model_truth(c, kw.get("return_attn_probs"), "return_attn_probs") or lse_wanted
    if model_truth(c, kw.get("dropout_p", 0.0), "dropout_p") or \
            kw.get("alibi_slopes") is not None:
        why.append("unsupported option")
    if ok:
        o_ = out if out is not None else None
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or (o_ is not None and o_.ndim != 4):
            why.append("ranks")
        else:
            B, SQ, HQ, D = q.shape
            SK, HKV, DV = k.shape[1], k.shape[2], v.shape[3]
            ob = o_.shape if o_ is not None else (B, SQ, HQ, DV)
            if k.dtype != q.dtype or v.dtype != q.dtype:
                why.append("dtypes differ")
            if (k.shape[0], v.shape[0], ob[0]) != (B, B, B) or v.shape[1] != SK or \
                    ob[1] != SQ or v.shape[2] != HKV or ob[2] != HQ or HQ < 1 or HKV < 1 or \
                    HQ % HKV or k.shape[3] != D or ob[3] != DV or not 1 <= D <= 1024 or \
                    not 1 <= DV <= 1024 or HQ > 65536:
                why.append(f"shapes {q.shape} {k.shape} {v.shape} {ob}")
            if o_ is not None and not _no_alias(o_):
                why.append("out aliases")
            sinks = model_sinks(c, kw, HQ)
    if not verdict(c, exc, "flash_attn_func"):
        return
    ret = res
    out_arr = ret[0] if isinstance(ret, tuple) else ret
    if out is not None:
        if out_arr is not out:
            raise Finding("out= given, but another array was returned")
        c.check_written_inside(before, {"out": out})
    if lse_wanted != isinstance(ret, tuple):
        raise Finding(f"return_softmax_lse/return_attn_probs: got {type(ret).__name__}")
    lse = ret[1] if isinstance(ret, tuple) else None
    B, SQ, HQ, _ = q.shape
    DV = v.shape[3]
    if out_arr.shape != (B, SQ, HQ, DV) or (out is None and out_arr.dtype != q.dtype):
        raise Finding(f"out {out_arr.shape} {out_arr.dtype}")
    if lse is not None and (lse.shape != (B, HQ, SQ) or lse.dtype != F32):
        raise Finding(f"lse {lse.shape} {lse.dtype}")
    if isinstance(ret, tuple) and len(ret) == 3 and ret[2] is not None:
        raise Finding("return_attn_probs: the third result is not None")
    if not moderate(c, q, k, v, *([] if sinks is None else [sinks])) or abs(params["scale"]) > 4:
        return
    bf = bf16_products(params, q.dtype, plain)
    q64, k64, v64 = as64(q), as64(k), as64(v)
    vmax = float(np.abs(v64).max(initial=0.0)) + 1e-30
    tol = out_tol(out_arr.dtype) + (2e-2 if bf else 1e-4)
    for i in range(B):
        ro, rl = attention_ref(q64[i], k64[i], v64[i], params["scale"], params["causal"],
                               params["left"], params["right"], params["softcap"], bf, sinks)
        if ro is None:
            continue
        compare(f"flash_attn_func out[{i}] {params}", out_arr[i], ro, tol, vmax)
        if lse is not None:
            check_lse(f"lse[{i}]", as64(lse[i]), rl)


def check_lse(name, got, want):
    if not np.array_equal(np.isneginf(got), np.isneginf(want)):
        raise Finding(f"{name}: -inf where the reference has {want}, got {got}")
    fin = np.isfinite(want)
    if fin.any() and np.abs(got[fin] - want[fin]).max() > 1e-3 * (1 + np.abs(want[fin]).max()):
        raise Finding(f"{name}: {got} against {want}")


def lengths_to_cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def fuzz_varlen(c):
    nseq = c.dim((2, 1, 0, 3))
    lq = [c.dim((3, 1, 0, 5)) for _ in range(nseq)]
    lk = [c.dim((4, 1, 0, 6)) for _ in range(nseq)]
    hq, hkv = heads(c)
    d, dv = c.dim((8, 4, 16, 1)), c.dim((8, 4, 16, 2))
    dt = c.pick(FLOATS)
    tq, tk = sum(lq), sum(lk)
    shapes = {"q": [tq, hq, d], "k": [tk, hkv, d], "v": [tk, hkv, dv], "out": [tq, hq, dv]}
    mutate_shapes(c, shapes)
    q = c.tensor("q", shapes["q"], dt)
    k = c.tensor("k", shapes["k"], dt)
    v = c.tensor("v", shapes["v"], dt)
    bad = [-1, 1, 2**31 - 1, 2**31, 2**40, -2**31 - 1, 2**63 - 1, 9]
    cuq_v = c.int_values(lengths_to_cu(lq), bad)
    cuk_v = c.int_values(lengths_to_cu(lk), bad)
    if c.flag(10):
        cuk_v = cuk_v[:-1] if c.flag(2) else cuk_v + [tk]
    cuq = c.index("cu_seqlens_q", cuq_v, fits=False)
    cuk = c.index("cu_seqlens_k", cuk_v, fits=False)
    mq, mk = max(lq, default=0), max(lk, default=0)
    if c.flag(4):
        mq = c.pick([mq - 1, 0, -1, 2**70, NAN, None, "8", np.array([9, 9]), mq + 3])
    if c.flag(6):
        mk = c.pick([mk - 1, 0, 2**70, None])
    kw = {}
    if c.flag(5):
        kw["out"] = c.tensor("out", shapes["out"], dt, written=True, fill="sentinel")
    attn_kwargs(c, kw)
    if c.flag(4):
        kw["return_softmax_lse"] = True
    if c.flag(25):
        kw["block_table"] = np.zeros((nseq, 1), np.int32)
    sinks_kwargs(c, kw, hq)
    res, exc, before = run_call(c, flywheel.flash_attn_varlen_func, (q, k, v, cuq, cuk, mq, mk),
                                kw)

    why = c.why
    sinks = None
    ok = all(is_float_array(x, n, why) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    out = kw.get("out")
    if out is not None:
        ok = is_float_array(out, "out", why, inplace=True, written=True) and ok
    params = attn_params_model(c, kw, q.shape[-1] if ok and q.ndim else 0)
    lse_wanted = model_truth(c, kw.get("return_softmax_lse"), "lse")
    if kw.get("block_table") is not None:
        why.append("block_table")
    cq, ck = model_index(c, cuq, "cu_seqlens_q"), model_index(c, cuk, "cu_seqlens_k")
    if ok:
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or (out is not None and out.ndim != 3):
            why.append("ranks")
        elif cq is not None and ck is not None:
            if cq.ndim != 1 or ck.ndim != 1 or cq.size != ck.size or cq.size < 1:
                why.append("cu sizes")
            elif cu_ok(c, cq, q.shape[0], "cu_seqlens_q") and \
                    cu_ok(c, ck, k.shape[0], "cu_seqlens_k"):
                try:
                    if bool(mq < int(np.diff(cq).max(initial=0))) or \
                            bool(mk < int(np.diff(ck).max(initial=0))):
                        why.append("max_seqlen below the longest")
                except (TypeError, ValueError):
                    why.append("max_seqlen not comparable")
            TQ, HQ, D = q.shape
            HKV, DV = k.shape[1], v.shape[2]
            ob = out.shape if out is not None else (TQ, HQ, DV)
            if k.dtype != q.dtype or v.dtype != q.dtype:
                why.append("dtypes differ")
            if v.shape[0] != k.shape[0] or ob[0] != TQ or v.shape[1] != HKV or ob[1] != HQ or \
                    HQ < 1 or HKV < 1 or HQ % HKV or k.shape[2] != D or ob[2] != DV or \
                    not 1 <= D <= 1024 or not 1 <= DV <= 1024 or HQ > 65536:
                why.append("shapes")
            if out is not None and not _no_alias(out):
                why.append("out aliases")
            sinks = model_sinks(c, kw, HQ)
    if not verdict(c, exc, "flash_attn_varlen_func"):
        return
    out_arr = res[0] if isinstance(res, tuple) else res
    if out is not None:
        if out_arr is not out:
            raise Finding("out= given, but another array was returned")
        c.check_written_inside(before, {"out": out})
    if lse_wanted != isinstance(res, tuple):
        raise Finding("return_softmax_lse ignored")
    TQ, HQ, _ = q.shape
    if out_arr.shape != (TQ, HQ, v.shape[2]):
        raise Finding(f"out shape {out_arr.shape}")
    lse = res[1] if isinstance(res, tuple) else None
    if lse is not None and (lse.shape != (HQ, TQ) or lse.dtype != F32):
        raise Finding(f"lse {lse.shape}")
    if not moderate(c, q, k, v, *([] if sinks is None else [sinks])) or abs(params["scale"]) > 4:
        return
    bf = bf16_products(params, q.dtype)
    q64, k64, v64 = as64(q), as64(k), as64(v)
    vmax = float(np.abs(v64).max(initial=0.0)) + 1e-30
    tol = out_tol(out_arr.dtype) + (2e-2 if bf else 1e-4)
    for i in range(cq.size - 1):
        a, e = cq[i], cq[i + 1]
        ro, rl = attention_ref(q64[a:e], k64[ck[i]:ck[i + 1]], v64[ck[i]:ck[i + 1]],
                               params["scale"], params["causal"], params["left"],
                               params["right"], params["softcap"], bf, sinks)
        if ro is None:
            continue
        compare(f"varlen seq {i} {params}", out_arr[a:e], ro, tol, vmax)
        if lse is not None:
            check_lse(f"varlen lse seq {i}", as64(lse[:, a:e]), rl)


def fuzz_kvcache(c):
    packed = c.flag(4)
    b = c.dim((2, 1, 3, 0))
    if packed:
        nq = [c.dim((1, 2, 0, 3)) for _ in range(b)]
    else:
        sq = c.dim((1, 2, 4, 0))
        nq = [sq] * b
    hq, hkv = heads(c)
    d, dv = c.dim((8, 4, 16, 1)), c.dim((8, 4, 16, 3))
    dt = c.pick(FLOATS)
    cdt = dt if not c.flag(10) else c.pick(FLOATS)
    f8 = bool(F8S) and c.flag(5)  # an fp8 cache; k and v then in f32, bf16 or f16
    ndt = cdt
    if f8:
        cdt, ndt = c.pick(F8S), dt if not c.flag(6) else c.pick(FLOATS)
    paged = c.flag(2)
    append = not c.flag(3)
    if paged:
        page = c.pick([8, 16, 8, 4, 12, 2048])
        pages = c.dim((2, 3, 1))
        nblocks = c.dim((6, 4, 8, 1))
        cap = pages * page
    else:
        page = cap = c.dim((16, 8, 4, 0, 12))
        nblocks = b + c.dim((0, 1))
        pages = 0
    total = sum(nq)
    grow = nq if append else [0] * b
    seq = [c.n(0, max(cap - g, 0)) for g in grow]
    shapes = {"kc": [nblocks, page, hkv, d], "vc": [nblocks, page, hkv, dv]}
    if packed:
        shapes.update(q=[total, hq, d], k=[total, hkv, d], v=[total, hkv, dv],
                      out=[total, hq, dv])
    else:
        sq = nq[0] if b else c.dim((1, 2))
        shapes.update(q=[b, sq, hq, d], k=[b, sq, hkv, d], v=[b, sq, hkv, dv],
                      out=[b, sq, hq, dv])
    mutate_shapes(c, shapes)
    q = c.tensor("q", shapes["q"], dt)
    kc = c.tensor("k_cache", shapes["kc"], cdt, written=append, fill="normal")
    vc = c.tensor("v_cache", shapes["vc"], cdt, written=append, fill="normal")
    args = [q, kc, vc]
    kw = {}
    if append:
        kw["k"] = c.tensor("k", shapes["k"], ndt)
        kw["v"] = c.tensor("v", shapes["v"], ndt)
        if c.flag(30):
            del kw[c.pick(["k", "v"])]
    bad_len = [-1, cap + 1, 2**31 - 1, 2**31, 2**40, -2**31, 2**63 - 1]
    seq = c.int_values(seq, bad_len)
    if c.flag(6) and b:
        kw["cache_seqlens"] = c.pick([seq[0], np.int64(seq[0]), np.int64(seq[0] % 2**31), 2**40,
                                      -1, 2**70, None, 1.5, [seq[0]] * (b + 1)])
    else:
        kw["cache_seqlens"] = c.index("cache_seqlens", seq, fits=False)
    if paged:
        nb = max(nblocks, 1)
        perm = c.rng.permutation(nb)  # distinct pages per sequence while there are enough
        tv = [[int(perm[(i * pages + p) % nb]) for p in range(pages)] for i in range(b)]
        if c.flag(4):  # pages shared at random (a prefix cache; a conflict when appending)
            tv = [[int(x) for x in c.rng.integers(0, nb, pages)] for _ in range(b)]
        if c.flag(5) and b:
            i, j = c.n(0, b - 1), c.n(0, pages - 1)
            tv[i][j] = c.pick([nblocks, -1, 2**31 - 1, 2**31, 2**40, tv[0][0]])
        if c.flag(12):
            tv = c.pick([[], [row[:0] for row in tv], tv[:-1], [r + r for r in tv]])
        kw["block_table"] = c.index("block_table", tv if tv else np.zeros((0, pages), int),
                                    fits=False)
    if packed:
        cu_v = c.int_values(lengths_to_cu(nq), [-1, 2**31, 2**40, total + 1])
        kw["cu_seqlens_q"] = c.index("cu_seqlens_q", cu_v, fits=False)
    if c.flag(6):  # cache_leftpad: rows 0 .. cache_seqlens[i] (contiguous caches only)
        lp = [c.n(0, max(int(x), 0)) if isinstance(x, (int, np.integer)) and 0 <= x < 2**31
              else 0 for x in seq]
        lp = c.int_values(lp, [-1, cap + 2, 2**31])
        kw["cache_leftpad"] = c.index("cache_leftpad", lp if b else np.zeros(0, int), fits=False)
    if c.flag(6):  # cache_batch_idx: distinct entries of a contiguous cache
        ent = [int(x) for x in c.rng.permutation(max(nblocks, b))[:b]]
        if c.flag(8) and b > 1:
            ent[c.n(1, b - 1)] = ent[0]  # shared: refused when both append
        ent = c.int_values(ent, [-1, nblocks, 2**31 - 1])
        kw["cache_batch_idx"] = c.index("cache_batch_idx", ent if b else np.zeros(0, int),
                                        fits=False)
    if c.flag(5):
        kw["out"] = c.tensor("out", shapes["out"], dt, written=True, fill="sentinel")
    attn_kwargs(c, kw)
    if c.flag(4):
        kw["return_softmax_lse"] = True
    if c.flag(20):
        kw[c.pick(["rotary_cos", "alibi_slopes"])] = np.zeros(2, np.float32)
    if c.flag(10):
        kw["num_splits"] = c.pick([1, 4, -1, 2**40])
    sinks_kwargs(c, kw, hq)
    if f8 or c.flag(12):  # descales: an fp8 cache's (now and then one missing), or refused
        for name in ("k_descale", "v_descale"):
            if not f8 or not c.flag(12):
                kw[name] = descale_arg(c, name, b, hkv)
    kc_old, vc_old = small_copy(kc), small_copy(vc)
    res, exc, before = run_call(c, flywheel.flash_attn_with_kvcache, args, kw)

    why = c.why
    kn, vn = kw.get("k"), kw.get("v")
    has_new = kn is not None or vn is not None
    if (kn is None) != (vn is None):
        why.append("k without v")
    if any(kw.get(n) is not None for n in ("rotary_cos", "alibi_slopes")):
        why.append("unsupported option")
    lp = model_index(c, kw["cache_leftpad"], "cache_leftpad") if "cache_leftpad" in kw else None
    ent = model_index(c, kw["cache_batch_idx"], "cache_batch_idx") \
        if "cache_batch_idx" in kw else None
    ok = is_float_array(q, "q", why)
    ok = is_float_array(kc, "k_cache", why, inplace=True, written=has_new, f8=True) and ok
    ok = is_float_array(vc, "v_cache", why, inplace=True, written=has_new, f8=True) and ok
    for x, n in ((kn, "k"), (vn, "v")):
        if x is not None:
            ok = is_float_array(x, n, why) and ok
    out = kw.get("out")
    if out is not None:
        ok = is_float_array(out, "out", why, inplace=True, written=True) and ok
    params = attn_params_model(c, kw, q.shape[-1] if isinstance(q, np.ndarray) and q.ndim
                               else 0)
    lse_wanted = model_truth(c, kw.get("return_softmax_lse"), "lse")
    lens = model_index(c, kw["cache_seqlens"], "cache_seqlens", scalar=True) \
        if kw["cache_seqlens"] is not None else None
    if kw["cache_seqlens"] is None:
        why.append("no cache_seqlens")
    is_packed = "cu_seqlens_q" in kw
    cu = model_index(c, kw["cu_seqlens_q"], "cu_seqlens_q") if is_packed else None
    bt = model_index(c, kw["block_table"], "block_table") if "block_table" in kw else None
    plan = None
    sinks = model_sinks(c, kw, q.shape[-2]) if ok and q.ndim >= 2 else None
    if ok and not why:
        plan = kv_model(c, q, kc, vc, kn, vn, out, lens, cu, is_packed, bt,
                        "block_table" in kw, kc_old, vc_old, lp, ent,
                        kw.get("k_descale"), kw.get("v_descale"))
    if not verdict(c, exc, "flash_attn_with_kvcache"):
        return
    out_arr = res[0] if isinstance(res, tuple) else res
    if lse_wanted != isinstance(res, tuple):
        raise Finding("return_softmax_lse ignored")
    if out is not None:
        if out_arr is not out:
            raise Finding("out= given, but another array was returned")
    written = {"k_cache": kc, "v_cache": vc} if has_new else {}
    if out is not None:
        written["out"] = out
    c.check_written_inside(before, written)
    rows, HQ, DV, batch, ctx, conflict = plan
    want_shape = out.shape if out is not None else \
        (rows, HQ, DV) if is_packed else (q.shape[0], q.shape[1], HQ, DV)
    if out_arr.shape != want_shape:
        raise Finding(f"out shape {out_arr.shape}, expected {want_shape}")
    lse = res[1] if isinstance(res, tuple) else None
    lse_shape = (HQ, rows) if is_packed else (q.shape[0], HQ, q.shape[1])
    if lse is not None and (lse.shape != lse_shape or lse.dtype != F32):
        raise Finding(f"lse {lse.shape}, expected {lse_shape}")
    # the caches: exactly the old contents with the new rows written at their positions
    exp_k, exp_v = ctx["exp_k"], ctx["exp_v"]
    if not (np.array_equal(as64(kc), exp_k, equal_nan=True) and
            np.array_equal(as64(vc), exp_v, equal_nan=True)):
        raise Finding("the caches do not hold exactly the old rows plus the appended ones")
    if conflict or not moderate(c, q, exp_k, exp_v, *([] if sinks is None else [sinks])) or \
            abs(params["scale"]) > 4:
        return
    if kn is not None and not moderate(c, kn, vn):
        return
    bf = bf16_products(params, q.dtype)
    q3 = as64(q).reshape(rows, HQ, q.shape[-1])
    o3 = as64(out_arr).reshape(rows, HQ, DV)
    l3 = None
    if lse is not None:
        l3 = as64(lse) if is_packed else as64(lse).transpose(1, 0, 2).reshape(HQ, rows)
    tol = out_tol(out_arr.dtype) + (2e-2 if bf else 1e-4)
    for i in range(batch):
        a, e, kk, vv = ctx["seqs"][i]
        vmax = float(np.abs(vv).max(initial=0.0)) + 1e-30
        ro, rl = attention_ref(q3[a:e], kk, vv, params["scale"], params["causal"],
                               params["left"], params["right"], params["softcap"], bf, sinks,
                               kv_exact=kc.dtype in F8S)
        if ro is None:
            continue
        compare(f"kvcache seq {i} {params}", o3[a:e], ro, tol, vmax)
        if l3 is not None:
            check_lse(f"kvcache lse seq {i}", l3[:, a:e], rl)


def descale_arg(c, name, b, hkv):
    """A descale: a Python number, a 0-d or [1] array, or [b, hkv] in any float dtype and
    layout (values 2^-3 .. 2^3); now and then one the rules refuse: 0, negative, NaN, inf,
    the wrong shape, integers, a string, None."""
    if c.flag(8):
        return c.pick([0.0, -1.0, NAN, INF, -INF, 1e-50, np.ones((b + 1, hkv), F32),
                       np.ones((b, hkv + 1), F32), np.ones(2, F32), np.ones((b, hkv), np.int32),
                       np.full((b, hkv), c.pick([0.0, -2.0, NAN, INF]), F32), "1", None])
    form = c.n(0, 3)
    if form == 0:
        return c.pick([0.5, 1.0, 2.0, 0.125, 3, 6.0])
    if form == 1:
        return np.array(c.pick([0.5, 1.0, 2.0, 4.0]), dtype=c.pick(FLOATS + [F64]))
    if form == 2:
        return np.array([c.pick([0.5, 1.0, 2.0, 4.0])], dtype=c.pick(FLOATS + [F64]))
    return c.tensor(name, [b, hkv], c.pick(FLOATS + [F64]), fill="descale")


def model_descale(c, x, name, batch, hkv):
    """A descale as the rules read it (a number, a 0-d or [1] array, or [batch, hkv]; any
    floating dtype, used as float32; finite and > 0): float64 [batch, hkv], or None (refused,
    the reason in c.why)."""
    if x is None:
        c.why.append(f"{name} is None")
        return None
    a = np.array(x, dtype=np.float32) if isinstance(x, (int, float)) else np.asarray(x)
    if a.dtype.kind != "f" and a.dtype != BF16:
        c.why.append(f"{name} dtype {a.dtype}")
        return None
    with np.errstate(all="ignore"):
        a = a.astype(np.float32)
    if a.shape not in ((), (1,), (batch, hkv)):
        c.why.append(f"{name} shape {a.shape}, not a scalar or {(batch, hkv)}")
        return None
    if not np.all(np.isfinite(a)) or not np.all(a > 0):
        c.why.append(f"{name} holds a value that is not finite and > 0")
        return None
    return np.broadcast_to(as64(a).reshape(-1)[:1], (batch, hkv)) if a.shape != (batch, hkv) \
        else as64(a)


def quantise(x, ds, dt):
    """An fp8 cache's append: float64 rows x [hkv, d] (k or v, exact in float32) over their
    heads' descales ds [hkv], divided in float32, saturated and rounded to dt, as float64."""
    with np.errstate(all="ignore"):
        f = x.astype(np.float32) / ds.astype(np.float32)[:, None]
        top = np.float32(ml_dtypes.finfo(dt).max)
        return as64(np.clip(f, -top, top).astype(dt))


def kv_model(c, q, kc, vc, kn, vn, out, lens, cu, packed, bt, has_bt, kc_old, vc_old,
             lp=None, ent=None, kds=None, vds=None):
    """flash_attn_with_kvcache's rules; returns what the checks of a success need. lp, ent:
    cache_leftpad and cache_batch_idx as int64 arrays, or None; kds, vds: k_descale and
    v_descale as given (None: not given)."""
    why = c.why
    if kc.ndim != 4 or vc.ndim != 4:
        why.append("cache ranks")
        return None
    if packed:
        if cu is None:
            return None
        if q.ndim != 3:
            why.append("packed q rank")
            return None
        if not cu_ok(c, cu, q.shape[0], "cu_seqlens_q"):
            return None
        batch = cu.size - 1
        q3shape = q.shape
    else:
        if q.ndim != 4:
            why.append("q rank")
            return None
        batch, sq = q.shape[0], q.shape[1]
        if batch > 2**31 - 1 or batch * sq > 2**31 - 1:
            why.append("more than 2^31-1 query rows")
            return None
        if batch > 1 << 24:
            c.unsure.append("a batch too large to model")
            return None
        cu = np.arange(batch + 1, dtype=np.int64) * sq
        q3shape = (batch * sq,) + q.shape[2:]
    if lens is None:
        return None
    if lens.ndim == 0:
        lens = np.full(batch, int(lens), dtype=np.int64)
    elif lens.shape != (batch,):
        why.append("cache_seqlens entries")
        return None
    for x, n in ((lp, "cache_leftpad"), (ent, "cache_batch_idx")):
        if x is not None and x.shape != (batch,):
            why.append(f"{n} entries")
            return None
    if kn is not None and vn is not None:
        if not packed:
            if kn.ndim != 4 or vn.ndim != 4 or kn.shape[1] != q.shape[1] or \
                    vn.shape[1] != q.shape[1]:
                why.append("k/v shape")
                return None
            kn3 = (kn.shape[0] * kn.shape[1],) + kn.shape[2:]
            vn3 = (vn.shape[0] * vn.shape[1],) + vn.shape[2:]
        else:
            kn3, vn3 = kn.shape, vn.shape
    paged = has_bt
    if paged:
        if bt is None:
            return None
        if bt.ndim != 2 or bt.shape[0] != batch or bt.shape[1] < 1:
            why.append(f"block_table shape {bt.shape}")
            return None
    rows, HQ, D = q3shape
    HKV, DV = kc.shape[2], vc.shape[3]
    if out is not None:
        o3 = out.shape if packed else (out.shape[0] * out.shape[1],) + out.shape[2:] \
            if out.ndim >= 2 else out.shape
        if not packed:
            if out.ndim < 2:
                why.append("out rank")
                return None
            (ob, on), (osb, osn) = out.shape[:2], out.strides[:2]
            if not (ob == 1 or on == 1 or osb == on * osn):
                why.append("out [b, sq] not mergeable")
        if len(o3) != 3:
            why.append("out rank")
            return None
    else:
        o3 = (rows, HQ, DV)
    if vc.dtype != kc.dtype:
        why.append("cache dtypes")
    if kc.shape[3] != D or vc.shape[:3] != kc.shape[:3] or HQ < 1 or HKV < 1 or HQ % HKV or \
            not 1 <= D <= 1024 or not 1 <= DV <= 1024 or HQ > 65536 or o3 != (rows, HQ, DV):
        why.append("shapes")
    f8 = kc.dtype in F8S
    if kn is not None and vn is not None:
        if f8 and kn.dtype != vn.dtype:
            why.append("k and v dtypes differ (an fp8 cache)")
        if not f8 and (kn.dtype != kc.dtype or vn.dtype != kc.dtype):
            why.append("k/v dtype is not the cache's")
        if kn3 != (rows, HKV, D) or vn3 != (rows, HKV, DV):
            why.append("k/v shapes")
        if not _no_alias(kc) or not _no_alias(vc):
            why.append("cache aliases")
    if out is not None and not _no_alias(out):
        why.append("out aliases")
    if not f8 and (kds is not None or vds is not None):
        why.append("descales on a cache that is not fp8")
    if why:
        return None
    if f8:
        kd = model_descale(c, kds, "k_descale", batch, HKV)
        vd = model_descale(c, vds, "v_descale", batch, HKV)
        if kd is None or vd is None:
            return None
    nblocks, page = kc.shape[0], kc.shape[1]
    append = kn is not None
    if paged:
        if page < 1 or page > 65536:
            why.append(f"page size {page}")
            return None
    elif ent is None and nblocks < batch:
        why.append("fewer cache rows than sequences")
        return None
    if paged and (lp is not None or ent is not None):
        why.append("cache_leftpad or cache_batch_idx with a block table")
        return None
    written_pages = set()
    locs = []
    for i in range(batch):
        old, n = int(lens[i]), int(cu[i + 1] - cu[i])
        ln = old + (n if append else 0)
        if old < 0:
            why.append("negative cache_seqlens")
            return None
        if lp is not None and not 0 <= lp[i] <= old:
            why.append("cache_leftpad out of range")
            return None
        if not paged:
            e = i if ent is None else int(ent[i])
            if not 0 <= e < nblocks:
                why.append("cache_batch_idx out of range")
                return None
            if append and n > 0 and ent is not None:
                if e in written_pages:
                    why.append("cache entry written twice")
                    return None
                written_pages.add(e)
            if ln > page:
                why.append("context longer than the cache")
                return None
            locs.append([(e, p) for p in range(ln)])
            continue
        need = -(-ln // page)
        if need > bt.shape[1]:
            why.append("context longer than its pages")
            return None
        for pg in range(need):
            e = int(bt[i, pg])
            if e < 0 or e >= nblocks:
                why.append("page out of range")
                return None
            if append and n > 0 and pg >= old // page:
                if e in written_pages:  # by another sequence, or twice by this one
                    why.append("page written twice")
                    return None
                written_pages.add(e)
        locs.append([(int(bt[i, p // page]), p % page) for p in range(ln)])
    # the expected caches after the append, and each sequence's context
    if kc_old is None or vc_old is None:
        c.unsure.append("caches too large to copy")
        return None
    exp_k, exp_v = kc_old.copy(), vc_old.copy()
    knv = as64(kn).reshape(rows, HKV, D) if append else None
    vnv = as64(vn).reshape(rows, HKV, DV) if append else None
    writes = set()
    for i in range(batch):
        if not append:
            break
        old = int(lens[i])
        for r in range(int(cu[i + 1] - cu[i])):
            blk, off = locs[i][old + r]
            if f8:
                exp_k[blk, off] = quantise(knv[cu[i] + r], kd[i], kc.dtype)
                exp_v[blk, off] = quantise(vnv[cu[i] + r], vd[i], vc.dtype)
            else:
                exp_k[blk, off] = knv[cu[i] + r]
                exp_v[blk, off] = vnv[cu[i] + r]
            writes.add((blk, off, i))
    conflict = False
    seqs = []
    for i in range(batch):
        where = locs[i][int(lp[i]) if lp is not None else 0:]
        if any((blk, off, j) in writes for blk, off in where for j in range(batch) if j != i):
            conflict = True
        ki = np.array([exp_k[blk, off] for blk, off in where]).reshape(len(where), HKV, D)
        vi = np.array([exp_v[blk, off] for blk, off in where]).reshape(len(where), HKV, DV)
        if f8:  # a stored element stands for itself times its head's descale
            ki, vi = ki * kd[i][None, :, None], vi * vd[i][None, :, None]
        seqs.append((int(cu[i]), int(cu[i + 1]), ki, vi))
    return rows, HQ, DV, batch, {"exp_k": exp_k, "exp_v": exp_v, "seqs": seqs}, conflict


# -------------------------------------------------------------------- Gated DeltaNet
def gdn_dims(c):
    H = c.dim((1, 2, 1))
    HV = H * c.dim((1, 2))
    return H, HV, c.dim((4, 8, 16, 1, 2)), c.dim((4, 8, 16, 1, 3))


def gdn_gate_kwargs(c, kw, HV):
    if c.flag(6):
        kw["use_beta_sigmoid_in_kernel"] = True
        if c.flag(2):
            kw["allow_neg_eigval"] = True
    if c.flag(8):
        kw["use_gate_in_kernel"] = True
        if not c.flag(10):
            kw["A_log"] = c.tensor("A_log", [HV] if not c.flag(8) else [HV + 1], F32,
                                   fill="state", layouts=False)
        if c.flag(2):
            kw["dt_bias"] = c.tensor("dt_bias", [HV], F32, fill="state", layouts=False)


def gdn_model_gates(c, g, beta, kw):
    """g and beta (float64) as the call uses them, or (None, None) with c.why set."""
    arrs = []
    for x, n in ((g, "g"), (beta, "beta")):
        if x is None:
            c.why.append(f"{n} is None")
            return None, None
        try:
            a = np.asarray(x)
        except (TypeError, ValueError):
            c.why.append(f"{n} not an array")
            return None, None
        if a.dtype.kind != "f" and a.dtype != BF16:
            c.why.append(f"{n} dtype {a.dtype}")
            return None, None
        if a.size > 2**24:
            c.why.append(f"{n} is huge")
            return None, None
        arrs.append(as64(a.astype(np.float32)))
    g64, b64 = arrs
    with np.errstate(all="ignore"):
        if model_truth(c, kw.get("use_gate_in_kernel", False), "use_gate_in_kernel"):
            if kw.get("A_log") is None:
                c.why.append("use_gate_in_kernel without A_log")
                return None, None
            dtb = kw.get("dt_bias")
            try:
                x = g64 + (0.0 if dtb is None else as64(np.asarray(dtb, np.float32)))
                a_log = as64(np.asarray(kw["A_log"], np.float32))
                sp = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
                g64 = -np.exp(a_log) * sp
            except ValueError:
                c.why.append("gate shapes do not broadcast")
                return None, None
            c.unsure.append("gates computed in float32 by the binding")
            g64 = as64(g64.astype(np.float32))
        if model_truth(c, kw.get("use_beta_sigmoid_in_kernel", False), "sigmoid"):
            b64 = as64((1.0 / (1.0 + np.exp(-b64))).astype(np.float32))
            if model_truth(c, kw.get("allow_neg_eigval", False), "allow_neg_eigval"):
                b64 = b64 * 2.0
    return g64, b64


def gdn_check_gate_values(c, g64, b64):
    if g64.size and not (np.all(g64 <= 0) and np.all(np.isfinite(g64))):
        c.why.append("g not finite <= 0")
    if b64.size and not np.all(np.isfinite(b64)):
        c.why.append("beta not finite")


def merged(x):
    return (x.shape[0] * x.shape[1],) + tuple(x.shape[2:])


def gdn_shapes_model(c, q, k, v):
    """The library's rules on the [B*T, ...] views of q, k, v (4-D each)."""
    rows, H, K = merged(q)
    vr, HV, V = merged(v)
    if merged(k) != (rows, H, K) or vr != rows or H < 1 or HV < 1 or HV % H or \
            not 1 <= K <= 1024 or not 1 <= V <= 1024 or HV > 65536 or k.dtype != q.dtype or \
            v.dtype != q.dtype:
        c.why.append(f"shapes or dtypes {q.shape} {k.shape} {v.shape}")


def fuzz_prefill(c):
    chunk = not c.flag(3)
    fn = flywheel.chunk_gated_delta_rule if chunk else flywheel.fused_recurrent_gated_delta_rule
    varlen = c.flag(3)
    H, HV, K, V = gdn_dims(c)
    if varlen:
        nseq = c.dim((2, 1, 3, 0))
        lens = [c.dim((3, 1, 0, 5)) for _ in range(nseq)]
        B, Tn = 1, sum(lens)
    else:
        B, Tn = c.dim((1, 2, 0)), c.dim((4, 1, 8, 0, 3))
        nseq = B
    dt = c.pick(FLOATS)
    shapes = {"q": [B, Tn, H, K], "k": [B, Tn, H, K], "v": [B, Tn, HV, V], "g": [B, Tn, HV],
              "beta": [B, Tn, HV], "h0": [nseq, HV, K, V], "out": [B, Tn, HV, V]}
    mutate_shapes(c, shapes)
    q = c.tensor("q", shapes["q"], dt)
    k = c.tensor("k", shapes["k"], dt)
    v = c.tensor("v", shapes["v"], dt)
    gate_bad = [np.int32, bool, object, np.complex64]
    g = c.tensor("g", shapes["g"], F32 if not c.flag(4) else c.pick(FLOATS + [F64]),
                 fill="gate" if not c.flag(10) else "normal", bad_dtypes=gate_bad)
    beta = c.tensor("beta", shapes["beta"], F32 if not c.flag(4) else c.pick(FLOATS + [F64]),
                    fill="beta", bad_dtypes=gate_bad)
    kw = {}
    if varlen:
        cu_v = c.int_values(lengths_to_cu(lens), [-1, 2**31, 2**40, Tn + 1, 1])
        kw["cu_seqlens"] = c.index("cu_seqlens", cu_v, fits=False)
    if c.flag(2):
        kw["initial_state"] = c.tensor("initial_state", shapes["h0"],
                                       F32 if not c.flag(6) else c.pick(FLOATS + [F64]),
                                       fill="state", bad_dtypes=gate_bad)
    if c.flag(2):
        kw["output_final_state"] = True
    if c.flag(2):
        kw["use_qk_l2norm_in_kernel"] = True
    if c.flag(4):
        kw["scale"] = c.pick([0.5, 0.25, 1.0] + SCALE_SPECIALS)
    gdn_gate_kwargs(c, kw, HV)
    if c.flag(5):
        kw["out"] = c.tensor("out", shapes["out"], dt, written=True, fill="sentinel")
    if c.flag(6):
        kw["isa"] = c.pick(ISAS)
    if chunk:
        if c.flag(5):
            kw["inverse"] = c.pick(["fwd_subst", "blocked", "lu", None])
        if c.flag(5):
            kw["precision"] = c.pick(PRECISIONS)
        if c.flag(20):
            kw[c.pick(["cu_seqlens_cpu", "chunk_indices"])] = np.zeros(3, np.int64)
    else:
        if c.flag(20):
            kw[c.pick(["gk", "gv"])] = g
    if c.flag(25):
        kw[c.pick(["state_v_first", "cp_context", "head_first"])] = True
    args = (q, k, v)
    if chunk:
        args = (q, k, v, g, beta)
    else:
        kw["g"] = g
        if not c.flag(25):
            kw["beta"] = beta
    res, exc, before = run_call(c, fn, args, kw)

    why = c.why
    for n in ("state_v_first", "cp_context", "head_first", "gv"):
        if n in kw:
            why.append(f"{n} given")
    if "gk" in kw:  # KDA's per-key-channel gates: the C fuzzer's (fuzz_gdn.c), not modeled here
        c.unsure.append("gk given")
    if not chunk and kw.get("beta") is None:
        why.append("beta missing")
    ok = all(is_float_array(x, n, why) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    out = kw.get("out")
    if out is not None:
        ok = is_float_array(out, "out", why, inplace=True, written=True) and ok
    if chunk:
        inv = kw.get("inverse", "blocked")
        if not (isinstance(inv, str) and inv in ("blocked", "fwd_subst")):
            why.append(f"inverse {inv!r}")
        model_precision(c, kw.get("precision"))
    model_isa(c, kw.get("isa"))
    l2 = model_truth(c, kw.get("use_qk_l2norm_in_kernel", False), "l2norm")
    model_truth(c, kw.get("output_final_state", False), "output_final_state")
    g64, b64 = gdn_model_gates(c, g, kw.get("beta") if not chunk else beta, kw)
    scale = None
    h0 = None
    plan = None
    if ok and g64 is not None:
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            why.append("ranks")
        elif g64.shape == v.shape[:3] + q.shape[3:] and b64.shape == v.shape[:3]:
            c.unsure.append("KDA's g [B, T, HV, K]: fuzz_gdn.c's")
        elif g64.shape != v.shape[:3] or b64.shape != v.shape[:3]:
            why.append("g/beta shapes")
        else:
            Bq, Tq, Hq, Kq = q.shape
            Vv = v.shape[3]
            cu = gdn_offsets_model(c, kw, Bq, Tq, why)
            if cu is not None and not why:
                nn = cu.size - 1
                HVv = v.shape[2]
                if "initial_state" in kw and kw["initial_state"] is not None:
                    h0x = kw["initial_state"]
                    try:
                        h0a = np.asarray(h0x)
                    except (TypeError, ValueError):
                        h0a = None
                    if h0a is None or (h0a.dtype.kind != "f" and h0a.dtype != BF16):
                        why.append("initial_state dtype")
                    elif h0a.shape != (nn, HVv, Kq, Vv):
                        why.append("initial_state shape")
                    else:
                        h0 = as64(h0a.astype(np.float32))
                gdn_shapes_model(c, q, k, v)
                if out is not None:
                    if out.ndim != 4 or merged(out) != (Bq * Tq, HVv, Vv):
                        why.append("out shape")
                    elif not (out.shape[0] == 1 or out.shape[1] == 1 or
                              out.strides[0] == out.shape[1] * out.strides[1]):
                        why.append("out [B, T] not mergeable")
                    elif not _no_alias(out):
                        why.append("out aliases")
                scale = model_scale(c, kw.get("scale"), Kq)
                gdn_check_gate_values(c, g64, b64)
                plan = (cu, nn)
    if "gk" in kw:  # with gk the call reads gates this model does not: any outcome
        c.why.clear()
    if not verdict(c, exc, fn.__name__):
        return
    o, ht = res
    if out is not None:
        if o is not out:
            raise Finding("out= given, but another array was returned")
        c.check_written_inside(before, {"out": out})
    cu, nn = plan
    Bq, Tq, Hq, Kq = q.shape
    HVv, Vv = v.shape[2], v.shape[3]
    if o.shape != (v.shape if out is None else out.shape) or \
            (out is None and o.dtype != v.dtype):
        raise Finding(f"o {o.shape} {o.dtype}")
    want_ht = model_truth(c, kw.get("output_final_state", False), "x")
    if want_ht != (ht is not None):
        raise Finding("output_final_state not honoured")
    if ht is not None and (ht.shape != (nn, HVv, Kq, Vv) or ht.dtype != F32):
        raise Finding(f"final state {ht.shape} {ht.dtype}")
    q64 = as64(q).reshape(Bq * Tq, Hq, Kq)
    k64 = as64(k).reshape(Bq * Tq, Hq, Kq)
    v64 = as64(v).reshape(Bq * Tq, HVv, Vv)
    g2, b2 = g64.reshape(Bq * Tq, HVv), b64.reshape(Bq * Tq, HVv)
    if not moderate(c, q, k, v) or (h0 is not None and not finite(h0)) or \
            not gdn_stable(k64, b2, l2) or abs(scale) > 4:
        return
    bf = chunk and (kw.get("precision") == "bf16" or
                    (kw.get("precision") in (None, "auto") and q.dtype == BF16))
    bf = bf or q.dtype == BF16
    tol = 3e-2 if bf else 2e-3
    tol += out_tol(o.dtype)
    o2 = as64(o).reshape(Bq * Tq, HVv, Vv)
    for i in range(nn):
        a, e = int(cu[i]), int(cu[i + 1])
        ro, rh = gdn_ref(q64[a:e], k64[a:e], v64[a:e], g2[a:e], b2[a:e], scale,
                         None if h0 is None else h0[i], l2)
        sc = 1.0 + float(np.abs(ro).max(initial=0.0))
        compare(f"{fn.__name__} o seq {i}", o2[a:e], ro, tol, sc)
        if ht is not None:
            compare(f"{fn.__name__} state seq {i}", ht[i], rh, tol,
                    1.0 + float(np.abs(rh).max(initial=0.0)))


def state_model(c, state, HV, K, V, written, bf16_ok=False):
    """A slot array the call may use (bf16_ok: bf16 states too, gated_delta_rule_decode's)."""
    if not isinstance(state, np.ndarray):
        c.why.append("state not an array")
        return None
    if state.dtype != F32 and not (bf16_ok and BF16 is not None and state.dtype == BF16):
        c.why.append("state dtype")
        return None
    if not state.flags.c_contiguous or state.ndim != 4 or state.shape[1:] != (HV, K, V):
        c.why.append("state layout/shape")
        return None
    if written and not state.flags.writeable:
        c.why.append("state read-only")
        return None
    return state.shape[0]


def slots_model(c, idx_arg, n, slots):
    if idx_arg is None:
        idx = np.arange(n)
    else:
        idx = model_index(c, idx_arg, "state_indices")
        if idx is None:
            return None
        if idx.shape != (n,):
            c.why.append("state_indices shape")
            return None
    if n > 0 and slots == 0:
        c.why.append("no slots")
    if idx.size and (idx.min() < 0 or idx.max() >= slots or len(set(idx.tolist())) != n):
        c.why.append(f"state_indices {idx.tolist()} for {slots} slots")
        return None
    if n == 0 and slots == 0:
        c.unsure.append("an empty state is a NULL pointer")
    return idx


def make_state_and_slots(c, n, HV, K, V, written, name="state"):
    slots = n + c.dim((0, 1, 2))
    shp = [slots, HV, K, V]
    if c.flag(8):
        shp[c.n(0, 3)] += c.pick([1, -1 if shp[0] else 1])
    state = c.tensor(name, shp, F32, written=written, fill="state",
                     bad_dtypes=[F64, F16, np.dtype(np.int32)], layouts=c.flag(4))
    idx = None
    if c.flag(2):
        perm = [int(x) for x in c.rng.permutation(slots)[:n]]
        perm = c.int_values(perm, [-1, slots, 2**31, 2**40, perm[0] if perm else 0])
        if c.flag(10):
            perm = perm[:-1] if c.flag(2) else perm + [0]
        idx = c.index("state_indices", perm, fits=False)
    return state, idx


def fuzz_decode(c):
    N = c.dim((2, 1, 3, 0))
    H, HV, K, V = gdn_dims(c)
    dt = c.pick(FLOATS)
    four = c.flag(3)
    if four:
        shapes = {"q": [N, 1, H, K], "k": [N, 1, H, K], "v": [N, 1, HV, V], "g": [N, 1, HV],
                  "beta": [N, 1, HV]}
    else:
        shapes = {"q": [N, H, K], "k": [N, H, K], "v": [N, HV, V], "g": [N, HV],
                  "beta": [N, HV]}
    if c.flag(12):
        shapes["g"] = [HV, N] if c.flag(2) else [N * HV]
    mutate_shapes(c, shapes)
    q = c.tensor("q", shapes["q"], dt)
    k = c.tensor("k", shapes["k"], dt)
    v = c.tensor("v", shapes["v"], dt)
    gate_bad = [np.int32, bool, object]
    # gates in float32 mostly, else f16 or bf16 (a bf16 model's beta), which both paths
    # convert; drawn from the input's generator, so the corpus keeps its shapes and flags
    gdt = [F32, F32] + FLOATS[1:]
    gdt = gdt[int(c.rng.integers(len(gdt)))]
    g = c.tensor("g", shapes["g"], gdt, fill="gate" if not c.flag(12) else "normal",
                 bad_dtypes=gate_bad)
    beta = c.tensor("beta", shapes["beta"], gdt, fill="beta", bad_dtypes=gate_bad)
    state, idx = make_state_and_slots(c, N, HV, K, V, written=True)
    kw = {}
    if idx is not None:
        kw["state_indices"] = idx
    if c.flag(4):
        kw["scale"] = c.pick([0.5, 0.25] + SCALE_SPECIALS)
    if c.flag(2):
        kw["use_qk_l2norm_in_kernel"] = True
    if c.flag(6):
        kw["isa"] = c.pick(ISAS)
    old = small_copy(state)
    res, exc, before = run_call(c, flywheel.gated_delta_rule_decode,
                                (q, k, v, g, beta, state), kw)

    why = c.why
    ok = all(is_float_array(x, n, why) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    model_isa(c, kw.get("isa"))
    l2 = model_truth(c, kw.get("use_qk_l2norm_in_kernel", False), "l2")
    g64, b64 = gdn_model_gates(c, g, beta, {})
    plan = None
    if ok and g64 is not None:
        qq, kk, vv = q, k, v
        if v.ndim == 4:
            if q.ndim != 4 or k.ndim != 4 or q.shape[1] != 1 or k.shape[1] != 1 or \
                    v.shape[1] != 1:
                why.append("4-D decode shapes")
                qq = None
            else:
                qq, kk, vv = q[:, 0], k[:, 0], v[:, 0]
        if qq is not None:
            if qq.ndim != 3 or kk.ndim != 3 or vv.ndim != 3:
                why.append("ranks")
            else:
                Nn, HVv, Vv = vv.shape
                if g64.shape in ((Nn, HVv, qq.shape[-1]), (Nn, 1, HVv, qq.shape[-1])) and \
                        b64.shape in ((Nn, HVv), (Nn, 1, HVv)):
                    c.unsure.append("KDA's g [N, HV, K]: fuzz_gdn.c's")
                elif g64.shape not in ((Nn, HVv), (Nn, 1, HVv)) or \
                        b64.shape not in ((Nn, HVv), (Nn, 1, HVv)):
                    why.append(f"g/beta shapes {g64.shape} {b64.shape}")
                else:
                    Kq = qq.shape[-1]
                    slots = state_model(c, state, HVv, Kq, Vv, True, bf16_ok=True)
                    if slots is not None:
                        ix = slots_model(c, kw.get("state_indices"), Nn, slots)
                        Hq = qq.shape[1]
                        if kk.shape != qq.shape or qq.shape[0] != Nn or Hq < 1 or HVv < 1 or \
                                HVv % Hq or not 1 <= Kq <= 1024 or not 1 <= Vv <= 1024 or \
                                HVv > 65536 or kk.dtype != qq.dtype or vv.dtype != qq.dtype:
                            why.append("shapes or dtypes")
                        scale = model_scale(c, kw.get("scale"), Kq)
                        gdn_check_gate_values(c, g64, b64)
                        plan = (qq, kk, vv, ix, scale)
    if not verdict(c, exc, "gated_delta_rule_decode"):
        return
    qq, kk, vv, ix, scale = plan
    if res.shape != v.shape or res.dtype != v.dtype:
        raise Finding(f"decode o {res.shape} {res.dtype}, v is {v.shape} {v.dtype}")
    c.check_written_inside(before, {"state": state})
    Nn, HVv, Vv = vv.shape
    new = as64(state)
    untouched = np.setdiff1d(np.arange(state.shape[0]), ix)
    if not np.array_equal(new[untouched], old[untouched], equal_nan=True):
        raise Finding("decode changed a state slot no sequence uses")
    if not moderate(c, qq, kk, vv) or not gdn_stable(as64(kk), b64.reshape(Nn, HVv), l2) or \
            abs(scale) > 4:
        return
    tol = (3e-2 if qq.dtype == BF16 or state.dtype == BF16 else 2e-3) + out_tol(res.dtype)
    o = as64(res).reshape(Nn, HVv, Vv)
    q64, k64, v64 = as64(qq), as64(kk), as64(vv)
    gg, bb = g64.reshape(Nn, HVv), b64.reshape(Nn, HVv)
    for i in range(Nn):
        ro, rh = gdn_ref(q64[i:i + 1], k64[i:i + 1], v64[i:i + 1], gg[i:i + 1], bb[i:i + 1],
                         scale, old[ix[i]], l2)
        compare(f"decode o seq {i}", o[i], ro[0], tol, 1 + float(np.abs(ro).max()))
        compare(f"decode state seq {i}", new[ix[i]], rh, tol, 1 + float(np.abs(rh).max()))


def fuzz_verify_commit(c):
    varlen = c.flag(2)
    H, HV, K, V = gdn_dims(c)
    if varlen:
        nseq = c.dim((2, 1, 3, 0))
        lens = [c.dim((3, 1, 0, 4)) for _ in range(nseq)]
        B, Tn = 1, sum(lens)
    else:
        B, Tn = c.dim((1, 2, 0)), c.dim((3, 1, 4, 0))
        nseq, lens = B, [Tn] * B
    dt = c.pick(FLOATS)
    shapes = {"q": [B, Tn, H, K], "k": [B, Tn, H, K], "v": [B, Tn, HV, V], "g": [B, Tn, HV],
              "beta": [B, Tn, HV]}
    mutate_shapes(c, shapes)
    q = c.tensor("q", shapes["q"], dt)
    k = c.tensor("k", shapes["k"], dt)
    v = c.tensor("v", shapes["v"], dt)
    g = c.tensor("g", shapes["g"], F32, fill="gate", bad_dtypes=[np.int32])
    beta = c.tensor("beta", shapes["beta"], F32, fill="beta", bad_dtypes=[np.int32])
    state, idx = make_state_and_slots(c, nseq, HV, K, V, written=False)
    kw = {}
    if idx is not None:
        kw["state_indices"] = idx
    if varlen:
        cu_v = c.int_values(lengths_to_cu(lens), [-1, 2**31, 2**40, Tn + 1])
        kw["cu_seqlens"] = c.index("cu_seqlens", cu_v, fits=False)
    if c.flag(2):
        kw["use_qk_l2norm_in_kernel"] = True
    if c.flag(4):
        kw["scale"] = c.pick([0.5, 0.25] + SCALE_SPECIALS)
    if c.flag(5):
        kw["precision"] = c.pick(PRECISIONS)
    if c.flag(6):
        kw["isa"] = c.pick(ISAS)
    res, exc, _ = run_call(c, flywheel.gated_delta_rule_verify,
                                (q, k, v, g, beta, state), kw)
    why = c.why
    ok = all(is_float_array(x, n, why) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    model_isa(c, kw.get("isa"))
    model_precision(c, kw.get("precision"))
    l2 = model_truth(c, kw.get("use_qk_l2norm_in_kernel", False), "l2")
    g64, b64 = gdn_model_gates(c, g, beta, {})
    plan = None
    if ok and g64 is not None:
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            why.append("ranks")
        elif g64.shape == v.shape[:3] + q.shape[3:] and b64.shape == v.shape[:3]:
            c.unsure.append("KDA's g [B, T, HV, K]: fuzz_gdn.c's")
        elif g64.shape != v.shape[:3] or b64.shape != v.shape[:3]:
            why.append("g/beta shapes")
        else:
            Bq, Tq, Hq, Kq = q.shape
            HVv, Vv = v.shape[2], v.shape[3]
            cu = gdn_offsets_model(c, kw, Bq, Tq, why)
            if cu is not None and not why:
                nn = cu.size - 1
                if np.any(np.diff(cu) > 64):
                    why.append("more than 64 tokens to verify")
                slots = state_model(c, state, HVv, Kq, Vv, False)
                ix = slots_model(c, kw.get("state_indices"), nn, slots) \
                    if slots is not None else None
                gdn_shapes_model(c, q, k, v)
                scale = model_scale(c, kw.get("scale"), Kq)
                gdn_check_gate_values(c, g64, b64)
                plan = (cu, nn, ix, scale)
    if not verdict(c, exc, "gated_delta_rule_verify"):
        return
    o, replay = res
    cu, nn, ix, scale = plan
    Bq, Tq, Hq, Kq = q.shape
    HVv, Vv = v.shape[2], v.shape[3]
    if o.shape != v.shape or o.dtype != v.dtype:
        raise Finding(f"verify o {o.shape} {o.dtype}")
    q64 = as64(q).reshape(Bq * Tq, Hq, Kq)
    k64 = as64(k).reshape(Bq * Tq, Hq, Kq)
    v64 = as64(v).reshape(Bq * Tq, HVv, Vv)
    g2, b2 = g64.reshape(Bq * Tq, HVv), b64.reshape(Bq * Tq, HVv)
    st0 = as64(state)
    check = moderate(c, q, k, v) and gdn_stable(k64, b2, l2) and abs(scale) <= 4
    bf = kw.get("precision") == "bf16" or q.dtype == BF16
    tol = (3e-2 if bf else 2e-3) + out_tol(o.dtype)
    o2 = as64(o).reshape(Bq * Tq, HVv, Vv)
    refs = []
    for i in range(nn):
        a, e = int(cu[i]), int(cu[i + 1])
        ro, _ = gdn_ref(q64[a:e], k64[a:e], v64[a:e], g2[a:e], b2[a:e], scale, st0[ix[i]], l2) \
            if check else (None, None)
        if check:
            compare(f"verify o seq {i}", o2[a:e], ro, tol, 1 + float(np.abs(ro).max(initial=0)))
        refs.append((a, e))

    # commit: accepted tokens per sequence, into this state or another
    c.why, c.unsure = [], []
    acc_v = [c.n(0, e - a) for a, e in refs]
    acc_v = c.int_values(acc_v, [-1, 65, 2**31, 2**40,
                                 (refs[0][1] - refs[0][0] + 1) if refs else 1])
    if c.flag(10):
        acc_v = acc_v[:-1] if c.flag(2) else acc_v + [0]
    acc = c.index("accepted", acc_v, fits=False)
    names = [n for n, *_ in c.buffers]
    if c.flag(5):
        target, _ = make_state_and_slots(c, nseq, HV, K, V, written=True, name="state2")
        tname = "state2"
    elif c.flag(8):
        target, tname = state.copy(), "state_ro"
        target.setflags(write=False)
        c.buffers.append((tname, target, lambda b: b, False))
    else:  # the state verify read: commit writes it
        target, tname = state, "state"
        i = names.index("state")
        c.buffers[i] = c.buffers[i][:3] + (True,)
    rep = replay
    if c.flag(12):
        rep = c.pick([None, "replay", {"buffer": 1}, replay.buffer,
                      flywheel.GDNReplay([0, 1], [0], [0], 1, 1, 1, 1)])
    old_t = small_copy(target)
    res2, exc2, before2 = run_call(c, flywheel.gated_delta_rule_commit, (rep, acc, target), {})
    acc_m = model_index(c, acc, "accepted")
    if rep is not replay:
        c.why.append("not a replay from gated_delta_rule_verify")
    elif acc_m is not None:
        if acc_m.shape != (nn,):
            c.why.append("accepted shape")
        else:
            slots2 = state_model(c, target, HVv, Kq, Vv, True)
            if slots2 is not None:
                if nn and slots2 == 0:
                    c.why.append("empty state")
                elif nn and ix.max() >= slots2:
                    c.why.append("state has fewer slots than the replay's indices")
                if nn == 0 and slots2 == 0:
                    c.unsure.append("an empty state is a NULL pointer")
                for i, (a, e) in enumerate(refs):
                    if acc_m[i] < 0 or acc_m[i] > e - a:
                        c.why.append("accepted out of range")
    if not verdict(c, exc2, "gated_delta_rule_commit"):
        return
    if res2 is not None:
        raise Finding("gated_delta_rule_commit returned something")
    c.check_written_inside(before2, {tname: target})
    if not check or old_t is None or target is not state:
        return  # another state: the replayed updates are relative to the verified one
    new = as64(target)
    used = set()
    for i, (a, e) in enumerate(refs):
        n_acc = int(acc_m[i])
        _, rh = gdn_ref(q64[a:a + n_acc], k64[a:a + n_acc], v64[a:a + n_acc], g2[a:a + n_acc],
                        b2[a:a + n_acc], scale, st0[ix[i]], l2)
        compare(f"commit state seq {i} ({n_acc} of {e - a} accepted)", new[ix[i]], rh, tol,
                1 + float(np.abs(rh).max(initial=0)))
        used.add(int(ix[i]))
    rest = [s for s in range(target.shape[0]) if s not in used]
    if not np.array_equal(new[rest], old_t[rest], equal_nan=True):
        raise Finding("commit changed a state slot no sequence uses")


# -------------------------------------------------------------------- the rest
def fuzz_threads(c):
    value = c.pick([1, 2, 0, -1, 3, 256, 257, 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**64 + 1,
                    "2", 1.5, None, NAN, INF, np.int64(2), [1]])
    try:
        try:
            flywheel.set_num_threads(value)
        except (TypeError, ValueError) as e:
            if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and \
                    0 <= int(value) <= 2:
                raise Finding(f"set_num_threads({value!r}) refused: {e}") from e
            return
        except Exception as e:
            raise Finding(f"set_num_threads({value!r}) raised {type(e).__name__}: {e}") from e
        n = flywheel.get_num_threads()
        if n != int(value):
            raise Finding(f"set_num_threads({value!r}) then get_num_threads() = {n!r}")
        if 0 <= n <= 2:
            return
        if n <= 256:  # valid, but not run here: it would start that many threads
            return
        q = np.ones((1, 2, 1, 4), np.float32)
        try:
            flywheel.flash_attn_func(q, q, q)
        except ValueError:
            return
        except Exception as e:
            raise Finding(f"a call after set_num_threads({value!r}) raised "
                          f"{type(e).__name__}: {e}") from e
        raise Finding(f"set_num_threads({value!r}) was accepted and a call ran with it, "
                      "though the library takes 0..256 threads")
    finally:
        flywheel.set_num_threads(1)


def fuzz_conv_update(c):
    """causal_conv1d_update (transformers' decode step of the conv; the compiled fast path
    takes most valid calls): (a)-(c) on every input; a call that succeeds on plain operands
    (the shapes asked for, float arrays, moderate values, no cache_seqlens or slot indices)
    is checked against float64. Which problems must be refused is not modeled here
    (fuzz_conv.c does that for the C API)."""
    B, D, L = c.dim((2, 1, 3, 0)), c.dim((8, 3, 16, 1, 0)), c.dim((1, 1, 2, 3))
    W = c.dim((4, 2, 3, 1))
    S = W - 1 + c.dim((0, 1, 0, 2))
    slots = B + c.dim((0, 1, 2))
    dt = c.pick(FLOATS)
    two = L == 1 and c.flag(3)
    xs = [B, D] if two else [B, D, L]
    shapes = {"x": list(xs), "conv_state": [slots, D, S], "weight": [D, W], "bias": [D],
              "out": list(xs)}
    mutate_shapes(c, shapes)
    x = c.tensor("x", shapes["x"], dt)
    st = c.tensor("conv_state", shapes["conv_state"], dt if not c.flag(4) else c.pick(FLOATS),
                  written=True, fill="state")
    w = c.tensor("weight", shapes["weight"], c.pick(FLOATS), fill="state")
    kw = {}
    if c.flag(2):
        kw["bias"] = c.tensor("bias", shapes["bias"], c.pick(FLOATS), fill="state")
    if c.flag(2):
        kw["activation"] = c.pick(["silu", "swish", None, "gelu", 3])
    if c.flag(4):
        kw["cache_seqlens"] = c.index("cache_seqlens", [c.n(0, 9) for _ in range(B)])
    if c.flag(4):
        kw["conv_state_indices"] = c.index(
            "conv_state_indices", [int(i) for i in c.rng.permutation(slots)[:B]])
    if c.flag(4):
        kw["out"] = c.tensor("out", shapes["out"], dt, written=True)
    if c.flag(8):
        kw["isa"] = c.pick(ISAS)
    old = small_copy(st)
    res, exc, _ = run_call(c, flywheel.causal_conv1d_update, (x, st, w), kw)
    if exc is not None:
        return
    plain = {"x": (x, xs), "conv_state": (st, [slots, D, S]), "weight": (w, [D, W])}
    for n in ("bias", "out"):
        if kw.get(n) is not None:
            plain[n] = (kw[n], [D] if n == "bias" else xs)
    if "cache_seqlens" in kw or "conv_state_indices" in kw or old is None or \
            not all(isinstance(a, np.ndarray) and a.dtype in FLOATS and list(a.shape) == want
                    and all(st_ != 0 or m <= 1 for st_, m in zip(a.strides, a.shape))
                    for a, want in plain.values()) or \
            not moderate(c, *[a for a, _ in plain.values()]):
        return
    # out may be any float dtype (the library converts as it writes); without it, x's dtype
    want_dt = kw["out"].dtype if kw.get("out") is not None else x.dtype
    if res.shape != x.shape or res.dtype != want_dt:
        raise Finding(f"conv update out {res.shape} {res.dtype}, want {x.shape} {want_dt}")
    x3 = as64(x).reshape(B, D, L)
    win = np.concatenate([old[:B], x3], axis=2)          # [B, D, S + L]
    y = np.zeros((B, D, L))
    for t in range(L):
        y[:, :, t] = np.einsum("bdk,dk->bd", win[:, :, S + t - (W - 1):S + t + 1], as64(w))
    if kw.get("bias") is not None:
        y += as64(kw["bias"])[None, :, None]
    if kw.get("activation") in ("silu", "swish"):
        y = y / (1.0 + np.exp(-y))
    tol = max({F32: 1e-4, F16: 4e-3}.get(dt_, 3e-2) for dt_ in (x.dtype, res.dtype))
    big = (lambda a: float(np.abs(a).max()) if a.size else 0.0)
    compare("conv update out", res.reshape(B, D, L), y, tol, 1.0 + big(y))
    stol = {F32: 1e-6, F16: 1e-3}.get(st.dtype, 8e-3)
    compare("conv update state", as64(st)[:B], win[:, :, L:], stol, 1.0 + big(win))


def fuzz_misc(c):
    tables = flywheel.isa_tables()
    if tables != SUPPORTED_ISA or (flywheel.default_isa() not in tables + [None]):
        raise Finding("isa_tables()/default_isa() changed")


CALLS = [fuzz_dense, fuzz_varlen, fuzz_kvcache, fuzz_prefill, fuzz_decode, fuzz_verify_commit,
         fuzz_conv_update, fuzz_threads, fuzz_misc]


def TestOneInput(data):
    c = Case(data)
    call = c.pick(CALLS[:7]) if not c.flag(30) else c.pick(CALLS[7:])
    try:
        call(c)
    except (ValueError, MemoryError):
        # the model's own numpy work on a view with a huge dimension (numpy: "array is too
        # big"); the call itself has been checked by then (run_call)
        if not c.huge:
            raise
    return c, call


# -------------------------------------------------------------------- setup
def _limit_memory():
    """Allocations past ~3 GiB fail (MemoryError) instead of succeeding lazily: a huge output
    would otherwise be allocated on a large machine and computed for hours."""
    try:
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    except (OSError, StopIteration, ValueError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = vm + (ALLOC_CAP_MB << 20)
    if hard == resource.RLIM_INFINITY or want < hard:
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))


def make_corpus(path):
    """The seed corpus: for each call, random inputs that reach it, some the call accepts and
    some it refuses (the fuzzer mutates from there). Deterministic."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(2024)
    want = {f.__name__: [2, 2] for f in CALLS[:7]}  # [accepted, refused] still wanted
    want.update({f.__name__: [1, 0] for f in CALLS[7:]})
    tries = 0
    while any(a or r for a, r in want.values()) and tries < 200000:
        tries += 1
        data = rng.integers(0, 256, int(rng.integers(16, 400)), dtype=np.uint8).tobytes()
        try:
            c, call = TestOneInput(data)
        except Finding:
            continue
        slot = want[call.__name__]
        i = 0 if getattr(c, "outcome", "ok") == "ok" else 1
        if slot[i]:
            slot[i] -= 1
            name = f"{call.__name__[5:]}-{'ok' if i == 0 else 'refused'}-{slot[i]}"
            with open(os.path.join(path, name), "wb") as f:
                f.write(data)


def libfuzzer_args(argv):
    """argv for libFuzzer: an RSS limit above the allocation cap; the tree kept clean: crash files go to a temporary folder
    unless -artifact_prefix says where, and when the first corpus folder is the committed
    one, new units go to a temporary folder placed before it (libFuzzer writes into the
    first and reads them all)."""
    args = list(argv)
    if not any(a.startswith("-rss_limit_mb=") for a in args[1:]):
        # above the ~3 GiB allocation cap (_limit_memory): an allocation the cap lets
        # through is not reported as out-of-memory by libFuzzer's own 2 GiB limit
        args.append(f"-rss_limit_mb={RSS_LIMIT_MB}")
    if not any(a.startswith("-artifact_prefix=") for a in args[1:]):
        out = os.path.join(tempfile.gettempdir(), "flywheel-fuzz-binding")
        os.makedirs(out, exist_ok=True)
        args.append(f"-artifact_prefix={out}{os.sep}")
    dirs = [i for i, a in enumerate(args) if i and not a.startswith("-") and os.path.isdir(a)]
    if dirs and os.path.samefile(args[dirs[0]], CORPUS):
        args.insert(dirs[0], tempfile.mkdtemp(prefix="flywheel-fuzz-corpus-"))
    return args


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--make-corpus":
        make_corpus(sys.argv[2])
        return
    warnings.simplefilter("ignore")  # numpy's warnings about the values the model computes
    flywheel.set_num_threads(1)
    flywheel.flash_attn_func(*(np.ones((1, 2, 1, 4), np.float32),) * 3)  # warm the library
    _limit_memory()
    atheris.Setup(libfuzzer_args(sys.argv), TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
