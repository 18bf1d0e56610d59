#!/usr/bin/env python3
"""mca_aarch64.py: llvm-mca's predicted FMA / BFDOT pipe use in the AArch64 tables' products.

Compiles src/kern/neon.c and src/kern/neon_bf16.c to assembly with aarch64-linux-gnu-gcc and
the library's flags (CMakeLists.txt, Release), finds in each kernel function below (or its
.isra / .constprop clones; one inlined into its caller is reported as not found) its hot loop,
and runs that loop's body through llvm-mca on each CPU. The hot loop: of the innermost loops (a
backward branch whose span, from its target label, holds no other backward branch), the one
with the most vector FMA-class instructions (FMLA / FMLS / BFDOT / BFMMLA / BFMLAL); of equals
(a function's copies for other dtypes or tile sizes), the shortest: the specialised path (f32
values, a constant dtype). The GDN chunk products are the mm entries' (src/gdn/chunk.c).

Reading the table, per loop iteration (one pass through the body):
  ins / FMA / vFP / ld / sp  instructions; FMA-class ones; other vector FP ones (fmul, fadd);
           loads; stack loads and stores (register spills);
  cyc      llvm-mca's steady-state cycles (Total Cycles / iterations);
  util     FMA / (cyc x FMA pipes): the share of the FMA pipes' issue slots the loop fills.
           The pipe counts are llvm-mca's own: the throughput of 24 independent FMLA (and
           BFDOT, BFMMLA) on that CPU, printed first;
  peak     the loop's products per cycle over the peak's of its precision: FMLA's 4 a
           cycle and pipe for f32 loops; for loops with bf16 instructions, BFMMLA's 16
           (BFDOT does 8, at the same rate in llvm-mca's models: a BFDOT loop at 100% of
           the pipes is at 50% of the bf16 peak);
  util-ord util with loads ordered after earlier stores (llvm-mca -noalias=false), for loops
           that store: llvm-mca otherwise lets a spilled accumulator's reload pass its store,
           so a chain through the stack is not in cyc ("-": the loop stores nothing);
  limit    the busiest pipe's share of the cycles, and llvm-mca's bottleneck analysis: the
           share of cycles with backend pressure from resources (res) and from register
           dependencies (dep). Low util with dep high: too few independent FMA chains for the
           latency; with a load pipe busiest: load bound; with a V pipe busiest: other vector
           instructions (broadcasts, conversions, moves) take FMA slots.
Forward branches inside a body (prefetch guards, early exits) are simulated as if not taken,
and llvm-mca's models differ from silicon (its Neoverse V1 and N2 models have no accumulator
forwarding for FMLA chains, V2's has): these are predictions of the steady-state loop, not
measurements.

Usage: python3 tools/mca_aarch64.py [--cpu neoverse-v1,neoverse-v2,neoverse-n2] [--markdown]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GCC = "aarch64-linux-gnu-gcc"
COMMON = ["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-DNDEBUG", "-Iinclude", "-Isrc", "-fPIC",
          "-fvisibility=hidden", "-O3", "-S"]
TABLES = {"neon": [], "neon_bf16": ["-march=armv8.2-a+bf16"]}
# (table entry, static function): the mm sub-table's products, the decode's from cached rows,
# and GDN's own (the decode's state columns, the replay's steps, the blocked inverse, KDA's diagonal)
KERNELS = [("mm.qk", "qk"), ("mm.pv", "pv"), ("mm.qk_bf16", "qk_bf16"), ("mm.pv_bf16", "pv_bf16"),
           ("dec.qk_rows", "dec_qk_rows"), ("dec.qk_rows_bf16", "dec_qk_rows_bf16"),
           ("dec.pv", "dec_pv"), ("dec.pv_bf16", "dec_pv_bf16"),
           ("gdn.dec_cols", "gdn_dec_cols"), ("gdn.step4", "gdn_step4"),
           ("gdn.tri_inv_blocked", "tri_inv_blocked"), ("gdn.kda_diag", "kda_diag")]
CPUS = ["neoverse-v1", "neoverse-v2", "neoverse-n2"]
# FMA-class mnemonics, each with the probe whose pipes it issues to
FMA_PROBE = {"fmla": "fmla", "fmls": "fmla", "bfdot": "bfdot", "bfmmla": "bfmmla",
             "bfmlalb": "bfdot", "bfmlalt": "bfdot"}
PROBES = {"fmla": "fmla v{i}.4s, v30.4s, v31.4s", "bfdot": "bfdot v{i}.4s, v30.8h, v31.8h",
          "bfmmla": "bfmmla v{i}.4s, v30.8h, v31.8h"}
# products (multiply-adds) per instruction on 128-bit vectors, and the peak of each precision:
# f32 FMLA's, bf16 BFMMLA's
MACS = {"fmla": 4, "fmls": 4, "bfdot": 8, "bfmmla": 16, "bfmlalb": 4, "bfmlalt": 4}
BRANCH = re.compile(r"^(b\.?(eq|ne|cs|hs|cc|lo|mi|pl|vs|vc|hi|ls|ge|lt|gt|le)?|cbn?z|tbn?z)$")
VREG = re.compile(r"\bv\d+\.\d*[bhsd]\b")


def find_mca():
    """llvm-mca-19, else llvm-mca of version 16 or later; None if neither."""
    if shutil.which("llvm-mca-19"):
        return "llvm-mca-19"
    if shutil.which("llvm-mca"):
        out = subprocess.run(["llvm-mca", "--version"], capture_output=True, text=True).stdout
        m = re.search(r"LLVM version (\d+)", out)
        if m and int(m.group(1)) >= 16:
            return "llvm-mca"
    return None


def functions(asm):
    """{symbol: [instruction or local label line]} for each function of a gcc assembly file."""
    funcs, name = {}, None
    for line in asm.splitlines():
        s = line.split("//")[0].strip()
        m = re.match(r"^\.type\s+([\w.]+),\s*%function", s)
        if m:
            name, funcs[m.group(1)] = m.group(1), []
        elif name and s.startswith(".size"):
            name = None
        elif name and (re.match(r"^\.L\w+:$", s) or s and not s.startswith(".")):
            funcs[name].append(s)
    return funcs


def split(ins):
    """(mnemonic, operands) of an instruction line."""
    mnem, _, ops = ins.replace("\t", " ").partition(" ")
    return mnem, ops.strip()


def loops(body):
    """The instructions of each innermost loop in a function's lines."""
    labels, ins = {}, []
    for line in body:
        if line.endswith(":"):
            labels[line[:-1]] = len(ins)
        else:
            ins.append(line)
    back = []  # (target position, branch position) of each backward branch
    for i, x in enumerate(ins):
        mnem, ops = split(x)
        target = ops.split(",")[-1].strip()
        if BRANCH.match(mnem) and labels.get(target, i + 1) <= i:
            back.append((labels[target], i))
    return [ins[p:i + 1] for p, i in back if not any(p <= j < i for _, j in back)]


def counts(loop):
    """FMA-class instructions per probe kind, other vector FP instructions, loads."""
    fma, vfp, ld = {}, 0, 0
    for x in loop:
        mnem, ops = split(x)
        if mnem in FMA_PROBE and VREG.search(ops):
            fma[mnem] = fma.get(mnem, 0) + 1
        elif mnem.startswith("f") and VREG.search(ops):
            vfp += 1
        elif mnem.startswith("ld"):
            ld += 1
    return fma, vfp, ld


def hot_loop(funcs, fn):
    """(symbol, loop instructions) of fn's hot loop, or (None, why not)."""
    syms = [s for s in funcs if s == fn or s.startswith(fn + ".")]
    cands = [(sum(counts(lp)[0].values()), -len(lp), s, lp) for s in syms for lp in loops(funcs[s])]
    if not cands or max(cands)[0] == 0:
        return None, "not found (inlined?)" if not syms else "no loop with FMA-class ops"
    _, _, sym, loop = max(cands, key=lambda c: c[:2])
    return sym, loop


def mca(tool, cpu, block, tmp, *extra):
    """llvm-mca on a block: cycles per iteration, (pressure per iteration, name) of the busiest
    resource, the resources used, and the bottleneck shares in percent."""
    path = os.path.join(tmp, "block.s")  # branches keep their targets: llvm-mca takes undefined labels
    with open(path, "w") as f:
        f.write("\n".join(block) + "\n")
    r = subprocess.run([tool, "-mtriple=aarch64", "-mcpu=" + cpu, "-mattr=+bf16", "-iterations=200",
                        "-bottleneck-analysis", *extra, path], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"llvm-mca failed on {cpu}:\n{r.stderr}")
    out = r.stdout
    cyc = (int(re.search(r"Total Cycles:\s+(\d+)", out).group(1))
           / int(re.search(r"Iterations:\s+(\d+)", out).group(1)))
    # "[3.1] - N2UnitL01": unit 1 of resource 3, named N2UnitL01.1 here
    names = [n + i[len(i.split(".")[0]):] for i, n in re.findall(r"^\[([\d.]+)\]\s+- (\w+)", out, re.M)]
    row = out.split("Resource pressure per iteration:")[1].splitlines()[2].split()
    press = [(0.0 if v == "-" else float(v), n) for n, v in zip(names, row)]
    share = {k: float(m.group(1)) if (m := re.search(k + r"[^\[\n]*\[\s*([\d.]+)%", out)) else 0.0
             for k in ("Resource Pressure", "Data Dependencies")}
    return cyc, max(press), [n for p, n in press if p > 0], share


def rows_for(tool, cpus, pipes, entry, table, funcs, tmp):
    """The table's rows of one kernel of one table, a row per CPU."""
    sym, loop = hot_loop(funcs, entry[1])
    if sym is None:
        return [[entry[0], table, "-", entry[1]] + ["-"] * 9 + [loop]]
    fma, vfp, ld = counts(loop)
    stores = any(split(x)[0].startswith("st") for x in loop)
    stack = sum("[sp" in x for x in loop)
    rows = []
    bf16 = any(k.startswith("bf") for k in fma)
    macs = sum(n * MACS[k] for k, n in fma.items())
    for cpu in cpus:
        slots = sum(n / pipes[cpu, FMA_PROBE[k]] for k, n in fma.items())
        peak = pipes[cpu, "bfmmla"] * MACS["bfmmla"] if bf16 else pipes[cpu, "fmla"] * MACS["fmla"]
        cyc, (bp, bn), _, share = mca(tool, cpu, loop, tmp)
        ordered = f"{100 * slots / mca(tool, cpu, loop, tmp, '-noalias=false')[0]:.0f}%" if stores else "-"
        limit = (f"{bn} {100 * bp / cyc:.0f}%, res {share['Resource Pressure']:.0f}%"
                 f" dep {share['Data Dependencies']:.0f}%")
        sizes = [str(v) for v in (len(loop), sum(fma.values()), vfp, ld, stack)]
        rows.append([entry[0], table, cpu, sym] + sizes
                    + [f"{cyc:.2f}", f"{100 * slots / cyc:.0f}%", f"{100 * macs / cyc / peak:.0f}%", ordered, limit])
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", default=",".join(CPUS), help="comma-separated llvm-mca -mcpu names")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (default: aligned text)")
    args = ap.parse_args()
    tool = find_mca()
    if not shutil.which(GCC) or not tool:
        sys.exit(f"mca_aarch64.py needs {GCC} and llvm-mca-19 (or llvm-mca >= 16) on PATH")
    cpus = args.cpu.split(",")
    head = ["kernel", "table", "cpu", "symbol", "ins", "FMA", "vFP", "ld", "sp", "cyc", "util", "peak",
            "util-ord", "limit"]
    rows, pipes = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        funcs = {}
        for table, flags in TABLES.items():
            out = os.path.join(tmp, table + ".s")
            subprocess.run([GCC] + COMMON + flags + [f"src/kern/{table}.c", "-o", out], cwd=ROOT, check=True)
            with open(out) as f:
                funcs[table] = functions(f.read())
        print("FMA pipes (llvm-mca: 24 independent ops, their throughput per cycle and the pipes they use):")
        for cpu in cpus:
            for kind, probe in PROBES.items():
                cyc, _, used, _ = mca(tool, cpu, [probe.format(i=i) for i in range(24)], tmp)
                pipes[cpu, kind] = round(24 / cyc)
                print(f"  {cpu:12} {kind:6} {24 / cyc:.2f}/cycle on {', '.join(used)}")
        for entry in KERNELS:
            for table in TABLES:
                rows += rows_for(tool, cpus, pipes, entry, table, funcs[table], tmp)
    print()
    if args.markdown:
        for r in [head, ["---"] * len(head)] + rows:
            print("| " + " | ".join(r) + " |")
    else:
        w = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
        for r in [head] + rows:
            print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())
    print("\nThese are llvm-mca predictions of each hot loop's steady state, not measurements.")


if __name__ == "__main__":
    main()
