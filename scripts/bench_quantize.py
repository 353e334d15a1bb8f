#!/usr/bin/env python3
"""Compare ``localinfer quantize`` with llama.cpp's own ``llama-quantize``: same bytes? how fast?

Builds ``llama-quantize`` from the vendored llama.cpp of the installed llama-cpp-python (cached
beside llama-bench, see llama_tools.py), then for every model and type runs both tools on
the same input, alternating them for several rounds so machine noise hits both (after one untimed
run of each, which warms the page cache and Python's bytecode cache alike), and prints a markdown
table: median and best wall time of each, their ratios, the median extra CPU seconds (user + sys) of
localinfer, which a loaded machine disturbs far less than wall time, and whether the outputs are
byte-identical. Run it without PYTHONDONTWRITEBYTECODE, or every run recompiles what changed.

    python scripts/bench_quantize.py MODEL.gguf [...] --types Q8_0 Q4_K_M Q4_0 --rounds 3
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # scripts/common.py

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("bench_vs_llama_bench", _HERE / "bench_vs_llama_bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def ensure_tool(target: str, jobs: int = 2) -> Path:
    """One llama.cpp tool, built by scripts/llama_tools.py if need be; return its path (or exit
    with one error line when it cannot be built here)."""
    import llama_tools
    try:
        return llama_tools.ensure_tool(target, jobs=jobs)
    except llama_tools.BenchError as e:
        raise SystemExit(f"error: {e}") from None


def timed(cmd: list[str], env: dict | None = None, output: Path | None = None) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + sys) of one run.

    The previous output is deleted and the disk synced first (untimed), so that every run writes a
    new file on a clean page cache: otherwise the write-back of the last run's 250 MB, and the
    freeing of the file it replaces, land on whichever tool runs next.
    """
    if output is not None:
        output.unlink(missing_ok=True)
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise bench.BenchError(f"{cmd[0]} failed: {result.stderr.strip().splitlines()[-1:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def compare(model: Path, qtype: str, tool: Path, rounds: int, threads: int, work: Path) -> dict:
    ref, ours = work / f"ref-{qtype}.gguf", work / f"ours-{qtype}.gguf"
    theirs_cmd = [str(tool), "--allow-requantize", str(model), str(ref), qtype, str(threads)]
    ours_cmd = [sys.executable, "-m", "localinfer", "quantize", str(model), "--type", qtype,
                "-o", str(ours), "--force", "--allow-requantize", "--threads", str(threads)]
    env = bench.wheel_lib_env()     # both run the very same libllama of the installed wheel
    timed(theirs_cmd, env, ref)     # warm-up, untimed
    timed(ours_cmd, None, ours)
    times: dict[str, list[tuple[float, float]]] = {"llama-quantize": [], "localinfer": []}
    for _ in range(rounds):
        times["llama-quantize"].append(timed(theirs_cmd, env, ref))
        times["localinfer"].append(timed(ours_cmd, None, ours))
    tools = ("llama-quantize", "localinfer")
    theirs_s, ours_s = (statistics.median(wall for wall, _ in times[k]) for k in tools)
    theirs_best, ours_best = (min(wall for wall, _ in times[k]) for k in tools)
    theirs_cpu, ours_cpu = (statistics.median(cpu for _, cpu in times[k]) for k in tools)
    return {"model": model.name, "type": qtype, "llama_quantize_s": round(theirs_s, 3),
            "localinfer_s": round(ours_s, 3), "ratio": round(ours_s / theirs_s, 3),
            "llama_quantize_best_s": round(theirs_best, 3), "localinfer_best_s": round(ours_best, 3),
            "ratio_of_bests": round(ours_best / theirs_best, 3),
            "extra_cpu_s": round(ours_cpu - theirs_cpu, 3),
            "identical": filecmp.cmp(ref, ours, shallow=False), "size": ours.stat().st_size,
            "samples": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=common.gguf_file)
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K_M", "Q4_0"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    tool = ensure_tool("llama-quantize")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for qtype in args.types:
                bench.log(f"{model.name} -> {qtype}")
                rows.append(compare(model, qtype, tool, args.rounds, args.threads, Path(tmp)))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| source | type | llama-quantize s (median / best) | localinfer s (median / best) "
          "| ratio of medians / of bests | extra CPU s | identical | size |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['type']} "
              f"| {r['llama_quantize_s']:.2f} / {r['llama_quantize_best_s']:.2f} "
              f"| {r['localinfer_s']:.2f} / {r['localinfer_best_s']:.2f} "
              f"| {r['ratio']:.2f}x / {r['ratio_of_bests']:.2f}x | {r['extra_cpu_s']:+.2f} "
              f"| {'yes' if r['identical'] else 'NO'} | {r['size']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
