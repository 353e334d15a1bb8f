"""The memory estimate against the peak resident memory of real `localinfer run`s: a model's first
run (the exactness probe for speculation runs), a later run of a short prompt, and a ~1,000-token
piped prompt. The table in docs/quantization.md.

    python scripts/bench_memory.py SMOL.gguf GEMMA.gguf [--ctx 512 4096] [--backend llama.cpp]
        [--types Q8_0 Q4_K_M Q4_0]

Each run is a fresh `python -m localinfer run` whose peak RSS (ru_maxrss) a small launcher reads;
the first run gets an empty LOCALINFER_HOME, so nothing is cached for it yet. `--types` measures
each model in those types too, made from the given files with llama.cpp's quantizer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import common  # scripts/common.py

from localinfer.fit import memory
from localinfer.measure import quality

MIB = 1 << 20
_LAUNCHER = """
import os, subprocess, sys
stdin = open(os.environ.get("PEAK_STDIN", os.devnull), "rb")
proc = subprocess.Popen(sys.argv[1:], stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)
"""
SHORT = ("Once upon a time", "-n", "8", "--temp", "0", "--raw")


def peak(model: Path, ctx: int, args: tuple[str, ...], home: Path, stdin: Path | None = None) -> int:
    env = {**os.environ, "LOCALINFER_HOME": str(home), **({"PEAK_STDIN": str(stdin)} if stdin else {})}
    out = subprocess.run([sys.executable, "-c", _LAUNCHER, sys.executable, "-m", "localinfer", "run",
                          str(model), *args, "--ctx", str(ctx)], capture_output=True, text=True,
                         env=env, check=True).stdout
    code, rss = map(int, out.split())
    if code != 0:
        raise SystemExit(f"localinfer run {model.name} --ctx {ctx} exited {code}")
    return rss


def measure(model: Path, ctx: int, backend: list[str], work: Path) -> dict:
    facts = memory.facts_from_file(model)
    estimate = memory.estimate(facts, memory.Request(ctx, repack=memory.cpu_repacks())).total
    home = Path(tempfile.mkdtemp(dir=work))
    doc = work / "doc.txt"
    doc.write_text(quality.default_text()[:4000], encoding="utf-8")     # ~1,000 tokens
    runs = {
        "first": peak(model, ctx, (*SHORT, *backend), home),
        "later": peak(model, ctx, (*SHORT, "--draft", "none", *backend), home),
    }
    if ctx >= 2048:        # the long prompt needs a context that holds it
        runs["long"] = peak(model, ctx, ("-", "-n", "8", "--temp", "0", "--raw", "--draft", "none",
                                         "--no-cache", *backend), home, stdin=doc)
    row = {"model": model.name, "ctx": ctx, "estimate_mib": round(estimate / MIB, 1)}
    for name, rss in runs.items():
        row[f"{name}_mib"] = round(rss / MIB, 1)
        row[f"{name}_error"] = round(estimate / rss - 1, 4)
    return row


def _variants(models: list[Path], types: list[str], work: Path) -> list[Path]:
    from localinfer.quant import quantize
    out = []
    for model in models:
        for qtype in types:
            dst = work / f"{model.stem}-{qtype}.gguf"
            quantize.quantize_file(model, dst, qtype, allow_requantize=True)
            out.append(dst)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", type=common.gguf_file)
    parser.add_argument("--ctx", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--backend", default=None, help="pass --backend to every run")
    parser.add_argument("--types", nargs="*", default=[], help="also these types of each model")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    backend = ["--backend", args.backend] if args.backend else []
    with tempfile.TemporaryDirectory() as work:
        models = [*args.models, *_variants(args.models, args.types, Path(work))]
        rows = [measure(m, ctx, backend, Path(work)) for m in models for ctx in args.ctx]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| model | ctx | estimate | first run | error | later run | error | 1k-token prompt | error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [f"{r[k + '_mib']} | {r[k + '_error']:+.1%}" if k + "_mib" in r else "— | —"
                 for k in ("first", "later", "long")]
        print(f"| {r['model']} | {r['ctx']} | {r['estimate_mib']} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
