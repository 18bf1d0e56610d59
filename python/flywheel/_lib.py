"""ctypes declarations of include/flywheel.h (its structs here; its functions' prototypes from
_calls.C_FUNCTIONS), the compiled fast path's loading and dispatch, and the status -> exception
mapping.

The shared library is the libflywheel.so installed next to this file by `pip install .`;
the environment variable FLYWHEEL_LIBRARY names another one (an in-tree build, say). It must
have the ABI this module declares (ABI_VERSION, include/flywheel.h's FW_ABI_VERSION): a library
whose fw_abi_version() differs, or an older one without it, is refused at import.
ctypes releases the GIL for the length of every call, so calls from several Python threads
run at once (the C library is thread-safe).
"""

import ctypes
import os

from . import _calls

# FW_ABI_VERSION of the include/flywheel.h these declarations follow. Bump it together with
# the header's whenever a struct, enum or signature below changes.
ABI_VERSION = 8

_MAX_DIMS = 4

F32, BF16, F16, F64, F8E4M3, F8E5M2 = 0, 1, 2, 3, 4, 5

ERR_DTYPE = 2
ERR_NOMEM = 8
ERR_UNSUPPORTED = 10

ATTN_PLAIN = 1 << 3
PREC_AUTO = 0  # fw_precision: bf16 products when q is bf16, else f32
PREC_F32 = 1
PREC_BF16 = 2
_PRECISIONS = {"auto": PREC_AUTO, "f32": PREC_F32, "bf16": PREC_BF16}


def precision(value):
    """The fw_precision of a `precision=` argument: None or "auto", "f32", "bf16"."""
    if value is None:
        return PREC_AUTO
    if isinstance(value, str) and value in _PRECISIONS:
        return _PRECISIONS[value]
    raise ValueError(f"precision must be None, 'auto', 'f32' or 'bf16', got {value!r}")


def float32_param(value, name, zero_means):
    """A float parameter (a scale, a softcap) as a Python float the library's float32 holds:
    ValueError for a value too large for a float (int 2**2000), or one that is not 0 but
    rounds to 0 in float32 (1e-50), where the library would read 0 as `zero_means`. Values
    that round to inf are left to the library, which refuses them."""
    try:
        x = float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float (an int of "
                         f"{value.bit_length() if isinstance(value, int) else '?'} bits)") \
            from None
    if x != 0.0 and ctypes.c_float(x).value == 0.0:
        raise ValueError(f"{name}={x!r} rounds to 0 in float32 (the library's type), where 0 "
                         f"means {zero_means}")
    return x

def isa_name(isa):
    """The kernel table name of an `isa=` argument as bytes (None or "" for the default)."""
    if isa is None or isa == "":
        return None
    if not isinstance(isa, str):
        raise TypeError(f"isa must be a kernel table name (str) or None, got "
                        f"{type(isa).__name__}")
    return isa.encode()


GDN_FWD_SUBST = 1 << 0
GDN_RECURRENT = 1 << 1
GDN_FUSED_RECURRENT = 1 << 2


class _Settings:
    threads = 0  # worker threads of every call; 0 = all online CPUs


settings = _Settings()


def set_num_threads(n):
    """Worker threads for every later call (0 = all online CPUs, the default)."""
    try:
        n = int(n)
    except OverflowError:  # int(inf)
        raise ValueError(f"threads must be an integer >= 0, got {n!r}") from None
    if n < 0 or n > 2**31 - 1:
        # the library takes an int32 (and refuses more than it supports when called): a
        # larger value would wrap around in ctypes (2^32 would become 0, all CPUs)
        raise ValueError(f"threads must be 0 .. 2^31 - 1, got {n}")
    settings.threads = n


def set_spin_us(us):
    """How long (microseconds, 0 .. 10^6) the library's idle worker threads keep spinning for
    the next call before they sleep: 0 gives the cores back to the host (torch's threads) as
    soon as a call returns; the default is 200 (or FLYWHEEL_SPIN_US). Process-wide."""
    try:
        us = int(us)
    except OverflowError:
        raise ValueError(f"spin window must be an integer 0 .. 1000000, got {us!r}") from None
    if us < 0 or us > 1000000:
        raise ValueError(f"spin window must be 0 .. 1000000 us, got {us}")
    check(lib.fw_set_spin_us(us))


def get_spin_us():
    """The spin window in microseconds (set_spin_us)."""
    return lib.fw_get_spin_us()


def get_num_threads():
    """The thread count set by set_num_threads (0 = all online CPUs)."""
    return settings.threads


class FlywheelError(ValueError):
    """A call the C library refused. `status` is the fw_status name ("FW_ERR_SHAPE"), the
    message is the library's own (fw_last_error)."""

    def __init__(self, status, message):
        super().__init__(f"{status}: {message}")
        self.status = status


class FlywheelDtypeError(FlywheelError, TypeError):
    """FW_ERR_DTYPE: a dtype the library does not take (q and k of different dtypes, an `out`
    of another dtype). A TypeError, like the dtypes the binding refuses before the call, and a
    FlywheelError (so a ValueError too) with the library's status and message."""


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * _MAX_DIMS),
        ("stride", ctypes.c_int64 * _MAX_DIMS),
    ]


class AttnParams(ctypes.Structure):
    _fields_ = [
        ("scale", ctypes.c_float),
        ("causal", ctypes.c_int32),
        ("window_left", ctypes.c_int64),
        ("window_right", ctypes.c_int64),
        ("softcap", ctypes.c_float),
        ("threads", ctypes.c_int32),
        ("isa", ctypes.c_char_p),
        ("flags", ctypes.c_uint32),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("precision", ctypes.c_int32),
        ("rotary_cos", ctypes.POINTER(Tensor)),
        ("rotary_sin", ctypes.POINTER(Tensor)),
        ("rotary_interleaved", ctypes.c_int32),
        ("rotary_q_only", ctypes.c_int32),
        ("sinks", ctypes.POINTER(Tensor)),
        ("dsinks", ctypes.POINTER(Tensor)),
    ]


class KVCache(ctypes.Structure):
    _fields_ = [
        ("k", Tensor),
        ("v", Tensor),
        ("block_table", ctypes.c_void_p),
        ("max_pages", ctypes.c_int64),
        ("block_table_stride", ctypes.c_int64),
        ("seqlens", ctypes.c_void_p),
        ("leftpad", ctypes.c_void_p),
        ("batch_idx", ctypes.c_void_p),
        ("layout", ctypes.c_int32),
        ("k_descale", ctypes.POINTER(Tensor)),
        ("v_descale", ctypes.POINTER(Tensor)),
    ]


class GdnParams(ctypes.Structure):
    _fields_ = [
        ("scale", ctypes.c_float),
        ("l2norm_qk", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("isa", ctypes.c_char_p),
        ("flags", ctypes.c_uint32),
        ("precision", ctypes.c_int32),
        ("l2norm_eps", ctypes.c_float),
        ("a_log", ctypes.POINTER(Tensor)),
        ("dt_bias", ctypes.POINTER(Tensor)),
        ("beta_sigmoid", ctypes.c_int32),
        ("lower_bound", ctypes.c_float),
    ]


class GdnPool(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("slots", ctypes.c_int64),
        ("slot_stride", ctypes.c_int64),
        ("read", ctypes.c_void_p),
        ("write", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
    ]


class GdnBatch(ctypes.Structure):
    _fields_ = [
        ("n_seqs", ctypes.c_int64),
        ("query_start_loc", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("state_indices", ctypes.c_void_p),
        ("read_state_indices", ctypes.c_void_p),
        ("decode_end", ctypes.c_int32),
        ("prefill_end", ctypes.c_int32),
        ("mixed_end", ctypes.c_int32),
        ("num_spec_tokens", ctypes.c_int32),
        ("read_offsets", ctypes.c_void_p),
    ]


class GdnCaches(ctypes.Structure):
    _fields_ = [
        ("conv", Tensor),
        ("recurrent", ctypes.c_void_p),
        ("recurrent_stride", ctypes.c_int64),
        ("recurrent_dtype", ctypes.c_int),
    ]


class GdnReplay(ctypes.Structure):
    _fields_ = [
        ("shadow", Tensor),
        ("records", Tensor),
        ("replay_lens", ctypes.c_void_p),
    ]


class GdnLayerParams(ctypes.Structure):
    _fields_ = [
        ("n_kq", ctypes.c_int32),
        ("n_v", ctypes.c_int32),
        ("d_k", ctypes.c_int32),
        ("d_v", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("l2norm_eps", ctypes.c_float),
        ("zero_tail", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("isa", ctypes.c_char_p),
        ("precision", ctypes.c_int32),
        ("lower_bound", ctypes.c_float),
        ("beta_activated", ctypes.c_int32),
    ]


class Conv1dParams(ctypes.Structure):
    _fields_ = [
        ("activation", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("isa", ctypes.c_char_p),
    ]


class Conv1dState(ctypes.Structure):
    _fields_ = [
        ("cache", Tensor),
        ("idx", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
    ]


# the C types of _calls.C_FUNCTIONS' declarations
_C_TYPES = {
    "status": ctypes.c_int, "int": ctypes.c_int, "int32": ctypes.c_int32,
    "int64": ctypes.c_int64, "size": ctypes.c_size_t, "double": ctypes.c_double,
    "str": ctypes.c_char_p, "ptr": ctypes.c_void_p, "tensor": Tensor,
    "attn_params": AttnParams, "kv_cache": KVCache, "gdn_params": GdnParams,
    "gdn_pool": GdnPool, "gdn_batch": GdnBatch, "gdn_caches": GdnCaches,
    "gdn_replay": GdnReplay, "gdn_layer_params": GdnLayerParams,
    "conv1d_params": Conv1dParams, "conv1d_state": Conv1dState,
}


def c_type(name):
    """The ctypes type of a type name of _calls.C_FUNCTIONS ("void" is None)."""
    if name == "void":
        return None
    if name.endswith("*"):
        return ctypes.POINTER(c_type(name[:-1]))
    return _C_TYPES[name]


def _find_library():
    path = os.environ.get("FLYWHEEL_LIBRARY")
    if path:
        return path
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "libflywheel.so")
    if not os.path.exists(path):
        raise ImportError(
            f"libflywheel.so is not next to {__file__}: install the package with "
            "`pip install .` from the repository root, or point FLYWHEEL_LIBRARY at a build "
            "(build/libflywheel.so after `make`)")
    return path


def check_abi(library, path):
    """Raise ImportError unless library (a ctypes.CDLL loaded from path) reports
    fw_abi_version() == ABI_VERSION."""
    try:
        fn = library.fw_abi_version
    except AttributeError:
        raise ImportError(
            f"{path} has no fw_abi_version(): it is older than this flywheel package, which "
            f"needs a library of ABI version {ABI_VERSION}; rebuild it from the same source "
            "tree (`make build`, or `pip install .`)") from None
    res, args = _calls.C_FUNCTIONS["fw_abi_version"]
    fn.restype = c_type(res)
    fn.argtypes = [c_type(a) for a in args]
    found = fn()
    if found != ABI_VERSION:
        raise ImportError(
            f"{path} has ABI version {found}, but this flywheel package was written for ABI "
            f"version {ABI_VERSION}: use a libflywheel.so built from the same source tree "
            "(`make build`, or `pip install .`)")


def declare(library, path):
    """Set the restype and argtypes of every function of _calls.C_FUNCTIONS on library;
    ImportError naming the first one it lacks."""
    for name, (res, args) in _calls.C_FUNCTIONS.items():
        try:
            fn = getattr(library, name)
        except AttributeError:
            raise ImportError(f"{path} has no {name}(): it is older than this flywheel "
                              "package; rebuild it from the same source tree") from None
        fn.restype = c_type(res)
        fn.argtypes = [c_type(a) for a in args]


_path = _find_library()
lib = ctypes.CDLL(_path)
check_abi(lib, _path)
declare(lib, _path)


def _load_fast_path():
    """The compiled fast path (_fwext.c) bound to `lib`, or None, with the reason it is not
    used. It is the package's own flywheel/_fwext.abi3.so, or with FLYWHEEL_LIBRARY the
    _fwext.abi3.so built next to that library (`make build` puts one in build/).
    FLYWHEEL_BINDING=ctypes turns it off: every call then takes the ctypes path."""
    import importlib.machinery
    import importlib.util

    if os.environ.get("FLYWHEEL_BINDING", "") == "ctypes":
        return None, "FLYWHEEL_BINDING=ctypes"
    here = os.path.dirname(_path) if os.environ.get("FLYWHEEL_LIBRARY") \
        else os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "_fwext.abi3.so")
    if not os.path.exists(path):
        return None, f"no {path}"
    spec = importlib.util.spec_from_file_location(
        "flywheel._fwext", path, loader=importlib.machinery.ExtensionFileLoader(
            "flywheel._fwext", path))
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    ext.init(lib.fw_abi_version(), {n: ctypes.cast(getattr(lib, n), ctypes.c_void_p).value
                                    for n in _calls.fast_symbols()})
    return ext, path


fast, fast_path_origin = _load_fast_path()


# how each kind of Fast condition reads the Python function's local `name`
_CONDITIONS = {"is None": "L[{!r}] is None", "false": "not L[{!r}]",
               "is not None": "L[{!r}] is not None"}


def fast_call(name):
    """The compiled fast path's dispatch of the call `name`, made from its _calls.Fast: a
    function of the Python function's locals() at the point where it offers the call, which
    returns _fwext.<fn>(<the described arguments>) where the fast path is in use and every
    described condition holds, else NotImplemented (the Python path then runs the call). It
    reads `fast` and the thread setting at every call, so setting `fast` to None turns it
    off (the tests do)."""
    f = _calls.FAST[name].fast
    conditions = ["fast is not None"] + [_CONDITIONS[how].format(n) for n, how in f.when]
    args = ["settings.threads" if a is _calls.THREADS else f"L[{a!r}]" for a in f.args]
    source = (f"def {name}(L):\n"
              f"    if {' and '.join(conditions)}:\n"
              f"        return fast.{f.fn}({', '.join(args)})\n"
              f"    return NotImplemented\n")
    scope = {}
    exec(source, globals(), scope)  # globals: `fast` and `settings` are this module's
    return scope[name]


_omp = {}


def _omp_loop():
    """The OpenMP host loop (_omp_loop.c, built as _fwomp.so next to _fwext.abi3.so: the
    package's, or with FLYWHEEL_LIBRARY the one next to that library), loaded once."""
    if "lib" not in _omp:
        here = os.path.dirname(_path) if os.environ.get("FLYWHEEL_LIBRARY") \
            else os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(here, "_fwomp.so")
        if not os.path.exists(path):
            raise NotImplementedError(f"no {path}: this build of flywheel has no OpenMP loop")
        m = ctypes.CDLL(path)
        m.fw_omp_max_threads.restype = ctypes.c_int
        m.fw_omp_max_threads.argtypes = []
        if m.fw_omp_max_threads() < 1:
            raise NotImplementedError(f"{path} was built without OpenMP (CMake found no OpenMP "
                                      "runtime)")
        _omp["lib"] = m
    return _omp["lib"]


def use_openmp_threads(threads=None):
    """Run every later call's parallel loops on OpenMP's threads: in a torch process, the
    threads torch keeps for its own operations (one libgomp for both), instead of the
    library's pool, whose workers would compete with torch's for the cores. threads: what a
    call with threads 0 (set_num_threads' default) runs on, 1 .. 256; None: OpenMP's team size
    now (torch.get_num_threads() in torch). Process-wide, until use_own_threads().
    NotImplementedError where the package was built without an OpenMP runtime. Measured inside
    vLLM's CPU engine (`make bench-vllm`, 1K prompt): GDN decode steps 1.3-1.7x and
    attention decode steps 1.2-1.4x faster than on the pool."""
    m = _omp_loop()
    n = m.fw_omp_max_threads() if threads is None else threads
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 256:
        raise ValueError(f"threads must be an int 1 .. 256 or None, got {n!r}")
    check(lib.fw_set_parallel(ctypes.cast(m.fw_omp_loop, ctypes.c_void_p), None, n))


def use_own_threads():
    """Back to the library's own threads (its pool, or OpenMP in an FW_OPENMP build) and its
    default thread count (all online CPUs)."""
    check(lib.fw_set_parallel(None, None, 0))


def threading_mode():
    """("openmp", threads) after use_openmp_threads, ("own", threads) otherwise (threads: the
    default count set with it, 0 for all online CPUs), ("host", threads) for a host loop set
    from C (fw_set_parallel)."""
    fn, host, n = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int32()
    check(lib.fw_get_parallel(ctypes.byref(fn), ctypes.byref(host), ctypes.byref(n)))
    if not fn.value:
        return "own", n.value
    omp = _omp.get("lib")
    if omp is not None and fn.value == ctypes.cast(omp.fw_omp_loop, ctypes.c_void_p).value:
        return "openmp", n.value
    return "host", n.value


def binding():
    """("compiled", path of the extension) when calls take the compiled fast path first, or
    ("ctypes", why not)."""
    return ("compiled" if fast is not None else "ctypes"), fast_path_origin


def check(status):
    """Raise the exception for a non-zero fw_status, with the C library's message."""
    if status == 0:
        return
    name = lib.fw_status_string(status).decode().split(":")[0]
    message = lib.fw_last_error().decode()
    if status == ERR_NOMEM:
        raise MemoryError(f"{name}: {message}")
    if status == ERR_UNSUPPORTED:
        raise NotImplementedError(f"{name}: {message}")
    if status == ERR_DTYPE:
        raise FlywheelDtypeError(name, message)
    raise FlywheelError(name, message)
