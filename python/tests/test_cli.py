"""The `flywheel` CLI's argument handling: strict numbers, missing values, help, unknown
commands and options (next to the library `make test` builds; skipped where the package is
tested from an installed wheel, which has no CLI)."""

import os
import subprocess

import pytest

LIB = os.environ.get("FLYWHEEL_LIBRARY", "")
CLI = os.path.join(os.path.dirname(LIB), "flywheel") if LIB else ""

pytestmark = pytest.mark.skipif(not (CLI and os.path.exists(CLI)),
                                reason="no flywheel CLI next to FLYWHEEL_LIBRARY")


def run(*args):
    p = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("args, needle", [
    (["bench", "attn", "--t", "abc"], "--t abc: expected an integer"),
    (["bench", "attn", "--t", "12x"], "--t 12x: expected an integer"),
    (["bench", "attn", "--t"], "--t needs a value"),
    (["bench", "attn", "--window", "3"], "--window 3: expected L,R"),
    (["bench", "attn", "--softcap", "-1"], "--softcap -1: expected a number"),
    (["bench", "kvcache", "--page", "abc"], "--page abc: expected an integer"),
    (["bench", "gdn", "--dk", "0"], "--dk 0: expected an integer from 1 to 1024"),
    (["bench", "gdn", "--frob"], "unknown option --frob"),
    (["bench", "conv", "--w", "0"], "--w 0: expected an integer from 1 to 64"),
    (["bench", "conv", "--dtype", "f64"], "--dtype f64: expected f32, bf16 or f16"),
    (["bench", "conv", "--frob"], "unknown option --frob"),
    (["bench", "frob"], "bench needs attn, kvcache, gdn, conv or threads; got frob"),
    (["frob"], "unknown command frob"),
    (["peak", "x"], "peak x: expected an integer"),
    (["run", "extra"], "run takes no arguments"),
])
def test_bad_arguments_exit_2_with_a_message(args, needle):
    rc, out = run(*args)
    assert rc == 2 and needle in out


@pytest.mark.parametrize("args", [["-h"], ["--help"], ["run", "--help"], ["peak", "--help"],
                                  ["bench", "attn", "-h"], ["bench", "kvcache", "--help"],
                                  ["bench", "gdn", "-h"], ["bench", "conv", "-h"]])
def test_help_exits_0_with_usage(args):
    rc, out = run(*args)
    assert rc == 0 and "usage: flywheel" in out
