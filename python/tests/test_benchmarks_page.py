"""tools/benchmarks_page.py (`make benchmarks`): the page is rewritten between its markers only,
and the tables render from the JSON the CLI prints (small shapes here, so that a field renamed
in a bench command fails a test rather than `make benchmarks`). The rendering test needs the CLI
next to FLYWHEEL_LIBRARY, as test_cli.py does."""

import importlib.util
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "benchmarks_page.py")
LIB = os.environ.get("FLYWHEEL_LIBRARY", "")
CLI = os.path.join(os.path.dirname(LIB), "flywheel") if LIB else ""

pytestmark = pytest.mark.skipif(not os.path.exists(SCRIPT), reason="no tools/ (an installed package)")


@pytest.fixture(scope="module")
def page():
    spec = importlib.util.spec_from_file_location("benchmarks_page", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_only_the_region_between_the_markers_changes(page):
    text = f"# T\n\nhand {page.BEGIN}? no\n{page.BEGIN}\nold figures\n{page.END}\nhand-written tail\n"
    with pytest.raises(RuntimeError):  # two begin markers
        page.rewrite(text, f"{page.BEGIN}\nnew\n{page.END}\n")
    text = f"# T\n\nintro\n{page.BEGIN}\nold figures\n{page.END}\nhand-written tail\n"
    new = page.rewrite(text, f"{page.BEGIN}\nnew\n{page.END}\n")
    assert new == f"# T\n\nintro\n{page.BEGIN}\nnew\n{page.END}\nhand-written tail\n"
    assert page.rewrite(new, f"{page.BEGIN}\nnew\n{page.END}\n") == new
    appended = page.rewrite("# T\n", f"{page.BEGIN}\nx\n{page.END}\n")
    assert appended == f"# T\n\n{page.BEGIN}\nx\n{page.END}\n"


@pytest.mark.skipif(not (CLI and os.path.exists(CLI)), reason="no flywheel CLI next to FLYWHEEL_LIBRARY")
def test_the_tables_render_from_the_clis_json(page, tmp_path):
    def cli(*args):
        return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120, check=True).stdout

    small = ["--threads", "1", "--reps", "1", "--json"]
    out = "".join([
        cli("bench", "attn", "--t", "80", "--hq", "2", "--hkv", "1", "--d", "16", "--check", "--baseline-rows", "8", *small),
        cli("bench", "attn", "--bwd", "--t", "40", "--hq", "2", "--hkv", "1", "--d", "16", "--check", "--no-baseline", *small),
        cli("bench", "kvcache", "--decode", "--ctx", "300", "--hq", "2", "--hkv", "1", "--d", "16", "--page", "16", *small),
        cli("bench", "kvcache", "--prefill", "--ctx", "300", "--new", "20", "--hq", "2", "--hkv", "1", "--d", "16", *small),
        cli("bench", "gdn", "--prefill", "--t", "70", "--h", "1", "--hv", "2", "--dk", "16", "--dv", "16", *small),
        cli("bench", "gdn", "--decode", "--seqs", "2", "--h", "1", "--hv", "2", "--dk", "16", "--dv", "16", *small),
        cli("bench", "conv", "--l", "64", "--d", "32", *small),
    ])
    rows = page.rows_of(out)
    compare = tmp_path / "compare.md"
    compare.write_text("# peers\n\nMeasured someday on a CPU.\n\n| op | size | system |\n|---|---|---|\n"
                       "| attn prefill | T=4096 | torch SDPA |\n| attn prefill | T=512 | torch SDPA |\n")
    text = page.section("flywheel", cli("info"), 1, [cli("peak", "1")] * 2, rows, "now",
                        str(compare), str(tmp_path / "benchmarks.md"))
    assert text.startswith(page.BEGIN) and text.rstrip().endswith(page.END)
    ops = {r["op"] for r in rows}
    assert {"attn", "kvcache_decode", "kvcache_prefill", "gdn_prefill", "gdn_prefill_check",
            "gdn_decode", "conv1d_prefill", "conv1d_decode"} <= ops, ops
    for needle in ["| forward | 80 | 2:1 | 16 |", "| backward | 40 |", "| decode | 1 | 300 |",
                   "| prefill | 1 | 300 | 20 |", "| GDN prefill | chunked | T=70 |", "| GDN decode |",
                   "| prefill | 1 x 64 tokens x 32 channels", "--baseline-rows 8", "| attn prefill | T=4096 | torch SDPA |",
                   "Measured someday on a CPU."]:
        assert needle in text, needle
    assert "T=512" not in text
