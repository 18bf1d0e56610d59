"""The ABI check at import: the package refuses a libflywheel.so of another ABI version, or
one without fw_abi_version() (older than the check), with a message naming both numbers and
the library's path."""

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys

import pytest

import flywheel
from flywheel import _lib

ABI = _lib.ABI_VERSION


def test_loaded_library_has_this_abi():
    assert _lib.lib.fw_abi_version() == ABI
    assert _lib.lib.fw_version().decode() == flywheel.__version__


class _FakeLibrary:
    """Stands in for a ctypes.CDLL: fw_abi_version returns `abi`, or is missing (None)."""

    def __init__(self, abi):
        if abi is not None:
            def fw_abi_version():
                return abi
            self.fw_abi_version = fw_abi_version  # check_abi sets restype/argtypes on it


def test_check_abi_accepts_the_same_number():
    _lib.check_abi(_FakeLibrary(ABI), "/some/libflywheel.so")


@pytest.mark.parametrize("other", [ABI - 1, ABI + 1, 1000])
def test_check_abi_refuses_another_number(other):
    with pytest.raises(ImportError) as e:
        _lib.check_abi(_FakeLibrary(other), "/some/libflywheel.so")
    msg = str(e.value)
    assert f"/some/libflywheel.so has ABI version {other}," in msg
    assert f"written for ABI version {ABI}" in msg


def test_check_abi_refuses_a_library_without_the_symbol():
    with pytest.raises(ImportError, match=r"/old/libflywheel\.so has no fw_abi_version\(\).*"
                                          rf"ABI version {ABI}\b"):
        _lib.check_abi(_FakeLibrary(None), "/old/libflywheel.so")


def _import_with(library):
    """`import flywheel` in a fresh interpreter on FLYWHEEL_LIBRARY=library: (rc, stderr)."""
    env = dict(os.environ, FLYWHEEL_LIBRARY=library,
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(flywheel.__file__))))
    r = subprocess.run([sys.executable, "-c", "import flywheel"], env=env,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stderr


def test_import_refuses_a_real_library_of_another_abi(tmp_path):
    """A real shared library whose fw_abi_version() returns another number, through the
    package's own loading path."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in library")
    src = tmp_path / "fake.c"
    src.write_text(f"int fw_abi_version(void) {{ return {ABI + 1}; }}\n")
    so = tmp_path / "libflywheel.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    rc, err = _import_with(str(so))
    assert rc != 0
    assert (f"ImportError: {so} has ABI version {ABI + 1}, but this flywheel package was "
            f"written for ABI version {ABI}") in err


def test_import_refuses_a_library_without_fw_abi_version():
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to load")
    rc, err = _import_with(libm)
    assert rc != 0
    assert f"ImportError: {libm} has no fw_abi_version()" in err
