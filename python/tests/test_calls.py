"""The calls' description (python/flywheel/_calls.py) against the package it generates: every
described call exists where it says, every C function it names is in the library with the
described prototype, the fast paths' dispatch passes the described arguments under the
described conditions and the compiled extension has exactly the described functions, and the
torch ops registered from it have the described schemas. (That each op passes
torch.library.opcheck is test_torch_ops.py's test_opcheck, over flywheel.torch_ops.OPS.)"""

import ctypes
import importlib
import inspect
import os
import re

import numpy as np
import pytest

import flywheel
from flywheel import _calls, _lib

CALLS = _calls.CALLS
PACKAGE = os.path.dirname(os.path.abspath(flywheel.__file__))


def _function(call):
    return getattr(importlib.import_module(f"flywheel.{call.module}"), call.name)


def _ids(calls):
    return [f"{c.module}.{c.name}" for c in calls]


# ---------------------------------------------------------------------------------- the calls

@pytest.mark.parametrize("call", CALLS, ids=_ids(CALLS))
def test_every_call_exists_where_described(call):
    fn = _function(call)
    assert callable(fn)
    for module in call.exported:
        m = importlib.import_module(module)
        assert getattr(m, call.name) is fn, (module, call.name)
        assert call.name in m.__all__, (module, call.name)


def test_every_public_call_is_described():
    """Each function flywheel exports from its call modules has an entry."""
    described = {(c.module, c.name) for c in CALLS}
    for name in flywheel.__all__:
        fn = getattr(flywheel, name)
        module = getattr(fn, "__module__", "").rpartition(".")[2]
        if inspect.isfunction(fn) and module in {"attention", "gated_delta", "kda", "conv",
                                                  "layers", "mla"}:
            assert (module, name) in described, name


@pytest.mark.parametrize("call", [c for c in CALLS if c.op], ids=_ids(c for c in CALLS if c.op))
def test_op_arguments_are_the_calls(call):
    """What the op passes the Python call is one of its parameters, with the same default
    where both have one."""
    params = inspect.signature(_function(call)).parameters
    names = [a.name for a in call.args]
    assert len(set(names)) == len(names)
    for a in call.args:
        target = a.into or a.name
        if call.adapter:
            continue
        assert target in params, (call.name, target)
        p = params[target]
        if a.into is None and a.default is not _calls.REQUIRED and \
                p.default is not inspect.Parameter.empty:
            assert p.default == a.default, (call.name, a.name, p.default, a.default)
    for name in call.mutates:
        assert name in names
    if call.out_after is not None:
        assert call.out_after in names
        assert call.outputs[0].name == "out"
    for o in call.outputs:
        assert (o.like in names) if o.like else (o.dtype == "float32" or o.dtype in names)
        assert o.wanted_by is None or next(a for a in call.args
                                           if a.name == o.wanted_by).type == "bool"
    assert not (call.adapter and call.out_after)
    assert call.result in {"one", "all", "wanted", "second"}
    assert call.result != "wanted" or call.outputs[1].wanted_by


# ---------------------------------------------------------------------------- the C functions

def _named_symbols():
    for c in CALLS:
        yield from c.c
        if c.fast is not None:
            yield from c.fast.c


def test_every_named_c_function_is_declared():
    assert set(_named_symbols()) <= set(_calls.C_FUNCTIONS)


@pytest.mark.parametrize("name", sorted(_calls.C_FUNCTIONS))
def test_every_declared_c_function_is_in_the_library_with_its_prototype(name):
    fn = getattr(_lib.lib, name)  # AttributeError: not in the library
    res, args = _calls.C_FUNCTIONS[name]
    assert fn.restype == _lib.c_type(res)
    assert list(fn.argtypes) == [_lib.c_type(a) for a in args]


def test_the_package_calls_only_declared_c_functions():
    """Every fw_* function the package's Python code calls through ctypes has its prototype
    from the description (ctypes would otherwise pass every argument as an int)."""
    used = set()
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(root, f)) as src:
                    used |= set(re.findall(r"\blib\.(fw_\w+)", src.read()))
    assert used and used <= set(_calls.C_FUNCTIONS), used - set(_calls.C_FUNCTIONS)


def test_a_library_without_a_declared_function_is_refused():
    class Function:  # takes restype and argtypes
        pass

    class Partial:  # has the first declared function only
        fw_abi_version = Function()
    assert next(iter(_calls.C_FUNCTIONS)) == "fw_abi_version"
    with pytest.raises(ImportError, match=r"/old/libflywheel\.so has no fw_version\(\)"):
        _lib.declare(Partial(), "/old/libflywheel.so")


# ------------------------------------------------------------------------------ the fast path

FAST = list(_calls.FAST.values())


class _Recorder:
    """Stands in for _fwext: each function returns (its name, its arguments)."""

    def __getattr__(self, fn):
        return lambda *args: (fn, args)


def _satisfied(fast):
    """Locals under which every condition of `fast` holds, each argument a distinct object."""
    values = {name: object() for name in fast.args if name is not _calls.THREADS}
    for name, how in fast.when:
        values[name] = {"is None": None, "false": False, "is not None": object()}[how]
    return values


@pytest.mark.parametrize("call", FAST, ids=_ids(FAST))
def test_fast_dispatch_passes_the_described_arguments(call, monkeypatch):
    monkeypatch.setattr(_lib, "fast", _Recorder())
    monkeypatch.setattr(_lib.settings, "threads", 3)
    dispatch = _lib.fast_call(call.name)
    values = _satisfied(call.fast)
    fn, args = dispatch(values)
    assert fn == call.fast.fn
    assert list(args) == [3 if a is _calls.THREADS else values[a] for a in call.fast.args]
    for name, how in call.fast.when:  # each condition alone turns the fast path away
        broken = dict(values, **{name: {"is None": 0, "false": True, "is not None": None}[how]})
        assert dispatch(broken) is NotImplemented, name
    monkeypatch.setattr(_lib, "fast", None)
    assert dispatch(values) is NotImplemented


@pytest.mark.parametrize("call", FAST, ids=_ids(FAST))
def test_fast_arguments_are_the_functions_locals(call):
    """The names a fast path reads are the function's parameters or locals (assigned before
    it offers the call: test_fastpath.py runs each)."""
    code = _function(call).__code__
    names = set(code.co_varnames) | set(code.co_cellvars)
    wanted = {a for a in call.fast.args if a is not _calls.THREADS} | \
        {n for n, _ in call.fast.when}
    assert wanted <= names, wanted - names
    assert "locals" in code.co_names


@pytest.mark.skipif(_lib.fast is None, reason="the compiled fast path is not in use")
def test_the_extension_has_the_described_functions():
    ext = _lib.fast
    have = {n for n in dir(ext) if not n.startswith("_") and callable(getattr(ext, n))}
    assert have == {c.fast.fn for c in FAST} | {"init", "stats"}


@pytest.mark.skipif(_lib.fast is None, reason="the compiled fast path is not in use")
def test_the_extension_refuses_an_address_table_without_its_functions():
    table = {n: ctypes.cast(getattr(_lib.lib, n), ctypes.c_void_p).value
             for n in _calls.fast_symbols()}
    missing = dict(table)
    del missing["fw_attn_fwd"]
    with pytest.raises(ImportError, match="fw_attn_fwd"):
        _lib.fast.init(_lib.lib.fw_abi_version(), missing)
    q = np.ones((1, 2, 1, 8), np.float32)
    before = _lib.fast.stats()[0]
    flywheel.flash_attn_func(q, q, q)  # the refused table left the functions as they were
    assert _lib.fast.stats()[0] == before + 1


# ------------------------------------------------------------------------------ the torch ops

def test_torch_ops_are_the_described_ones():
    torch = pytest.importorskip("torch")
    import flywheel.torch_ops as fw_ops
    want = {}
    for c in _calls.OPS.values():
        want[c.name] = (c.args, set(c.mutates), len(c.outputs))
        if c.out_after is not None:
            want[c.name + "_out"] = (None, set(c.mutates) | {o.name for o in c.outputs}, 0)
    assert set(fw_ops.OPS) == set(want)
    for name, (args, written, returns) in want.items():
        schema = getattr(torch.ops.flywheel, name).default._schema
        got = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
        assert got == written, name
        assert len(schema.returns) == returns, name
        if args is not None:
            assert [a.name for a in schema.arguments] == [a.name for a in args], name
