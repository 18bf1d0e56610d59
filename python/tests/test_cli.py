"""The `flywheel` CLI's argument handling: strict numbers, missing values, help, unknown
commands and options (next to the library `make test` builds; skipped where the package is
tested from an installed wheel, which has no CLI)."""

import os
import re
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
    (["bench", "kvcache", "--decode", "--tiles", "--cols"], "--tiles and --cols are two cache layouts"),
    (["bench", "kvcache", "--cache", "f9"], "--cache f9: expected f32, bf16, f16, f8e4m3 or f8e5m2"),
    (["bench", "kvcache", "--mla", "--tiles"], "--mla reads V from K's rows"),
    (["bench", "kvcache", "--dv", "64", "--rotary"], "--tiles, --cols and --rotary take dv = d"),
    (["bench", "gdn", "--dk", "0"], "--dk 0: expected an integer from 1 to 1024"),
    (["bench", "gdn", "--frob"], "unknown option --frob"),
    (["bench", "conv", "--w", "0"], "--w 0: expected an integer from 1 to 64"),
    (["bench", "conv", "--dtype", "f64"], "--dtype f64: expected f32, bf16 or f16"),
    (["bench", "conv", "--frob"], "unknown option --frob"),
    (["bench", "frob"], "bench needs attn, kvcache, gdn, conv or threads; got frob"),
    (["frob"], "unknown command frob"),
    (["peak", "x"], "peak x: expected an integer"),
    (["run", "extra"], "run takes no arguments"),
    (["run", "--json", "extra"], "run takes no arguments but --json and --small (got extra)"),
    (["bench", "attn", "--baseline-rows", "0"], "--baseline-rows 0: expected an integer from 1"),
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


@pytest.mark.parametrize("extra, cache, kv_channels", [
    ([], "bf16", 2 * 64),
    (["--cache", "f8e4m3"], "f8e4m3", 2 * 64),
    (["--cache", "f8e5m2"], "f8e5m2", 2 * 64),
    (["--mla", "--hq", "24", "--d", "96", "--dv", "64"], "bf16", 96),
])
def test_kvcache_decode_reports_the_bytes_it_reads(extra, cache, kv_channels):
    """The decode line's K/V rate is the bytes of the cache's dtype it reads (an MLA cache's V
    is part of K's rows: d channels a token, not d + dv) over the median time it measured."""
    import json
    base = ["bench", "kvcache", "--decode", "--ctx", "300", "--page", "32", "--hq", "8", "--hkv", "2",
            "--d", "64", "--reps", "2", "--threads", "1", "--json"]
    code, out = run(*base, *extra)
    assert code == 0, out
    row = json.loads(out.strip().splitlines()[-1])
    assert row["cache_dtype"] == cache and row["mla"] == (1 if "--mla" in extra else 0)
    hkv = row["hkv"]
    size = 1 if cache.startswith("f8") else 2
    nbytes = 300 * hkv * kv_channels * size
    assert row["kv_gbps"] == pytest.approx(nbytes / row["seconds_median"] * 1e-9, rel=0.01, abs=0.006)
    flops = 2 * row["hq"] * 300 * (row["d"] + row["dv"])
    assert row["gflops"] == pytest.approx(flops / row["seconds_median"] * 1e-9, rel=0.01, abs=0.006)
    assert 0 < row["pct_peak"] and 0 < row["pct_bw"]


def test_info_names_the_cpu():
    rc, out = run("info")
    assert rc == 0 and re.search(r"^cpu: .+, \d+ online CPUs$", out, re.M), out


@pytest.fixture
def two_builds(tmp_path):
    """The library and a copy of it in another file: two builds to `flywheel ab`."""
    import shutil
    copy = tmp_path / "libflywheel-copy.so"
    shutil.copy(LIB, copy)
    return LIB, str(copy)


@pytest.mark.parametrize("op", [
    ["decode", "--ctx", "100", "--hq", "4", "--hkv", "2", "--d", "16", "--page", "16", "--caches", "3",
     "--dtype", "bf16"],
    ["decode", "--batch", "3", "--ctx", "37", "--hq", "6", "--hkv", "2", "--d", "24", "--page", "8"],
    ["gdn", "--t", "70", "--h", "2", "--hv", "4", "--d", "16", "--kda"],
    ["gdn", "--t", "65", "--h", "1", "--hv", "2", "--d", "32", "--dtype", "f32"],
    ["decode", "--ctx", "200", "--hq", "4", "--hkv", "2", "--d", "32", "--page", "64", "--cols"],
    ["gdn-decode", "--n", "3", "--h", "2", "--hv", "4", "--d", "32", "--caches", "2"],
    ["gdn-decode", "--n", "1", "--h", "1", "--hv", "3", "--d", "16", "--dtype", "f32"],
    ["attn", "--batch", "2", "--t", "77", "--hq", "6", "--hkv", "2", "--d", "40"],
    ["attn", "--t", "65", "--hq", "4", "--hkv", "4", "--d", "32", "--dtype", "f32", "--bwd"],
])
def test_ab_times_both_builds_and_compares_their_outputs(two_builds, op):
    a, b = two_builds
    rc, out = run("ab", a, b, *op, "--rounds", "2", "--calls", "2", "--threads", "1")
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[1].startswith(f"A {a}: median ") and lines[2].startswith(f"B {b}: median ")
    assert "B / A time: " in lines[3] and lines[3].endswith("outputs: the same bits")


@pytest.mark.parametrize("args, needle", [
    (["ab", "/nonexistent/libx.so", "LIB", "decode"], "ab: cannot load /nonexistent/libx.so"),
    (["ab", "libm.so.6", "LIB", "decode"], "ab: libm.so.6 is not a libflywheel"),
    (["ab", "LIB", "LIB", "frob"], "ab needs attn, decode, gdn or gdn-decode; got frob"),
    (["ab", "LIB", "LIB"], "ab needs two libraries and attn, decode, gdn or gdn-decode"),
    (["ab", "LIB", "LIB", "attn", "--ctx", "5"], "ab attn: unknown option --ctx"),
    (["ab", "LIB", "LIB", "attn", "--caches", "2"], "ab attn: unknown option --caches"),
    (["ab", "LIB", "LIB", "decode", "--bwd"], "ab decode: unknown option --bwd"),
    (["ab", "LIB", "LIB", "gdn-decode", "--ctx", "5"], "ab gdn-decode: unknown option --ctx"),
    (["ab", "LIB", "LIB", "gdn", "--n", "5"], "ab gdn: unknown option --n"),
    (["ab", "LIB", "LIB", "decode", "--tiles", "--cols"], "--tiles and --cols are two cache layouts"),
    (["ab", "LIB", "LIB", "decode", "--kda"], "ab decode: unknown option --kda"),
    (["ab", "LIB", "LIB", "gdn", "--ctx", "5"], "ab gdn: unknown option --ctx"),
    (["ab", "LIB", "LIB", "decode", "--calls", "0"], "--calls 0: expected an integer from 1"),
])
def test_ab_bad_arguments_exit_2_with_a_message(args, needle):
    rc, out = run(*[LIB if x == "LIB" else x for x in args])
    assert rc == 2 and needle in out


def test_ab_help():
    rc, out = run("ab", "--help")
    assert rc == 0 and "usage: flywheel ab A.so B.so attn|decode|gdn|gdn-decode" in out


def test_ab_reports_what_the_library_refuses():
    rc, out = run("ab", LIB, LIB, "decode", "--hq", "5", "--hkv", "2", "--ctx", "10", "--rounds", "1",
                  "--calls", "1")
    assert rc == 1 and f"ab: {LIB}: the cache has 2 heads, which does not divide q's 5 heads" in out
