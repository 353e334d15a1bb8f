#!/usr/bin/env python3
"""Compare `localinfer bench --backend onnx` with `--backend llama.cpp` on the same GGUF file,
and measure the ONNX export itself (time and peak memory).

Each round runs both benches as separate processes, as a user runs them, one after the other and
in alternating order, so load from anything else on the machine hits both sides alike; the table
has each round's figures, the ratio onnx / llama.cpp per round and the median ratio. The targets
of issue 15: decode >= 0.9x llama.cpp, prefill >= 1x.

Usage:

    python scripts/bench_onnx.py smollm2 gemma-3-270m --rounds 5
    python scripts/bench_onnx.py smollm2 --export          # export time and peak RSS, fresh store

Progress goes to stderr; the markdown table (or JSON with --json) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # scripts/common.py

TARGETS = {"prefill_tps": 1.0, "decode_tps": 0.9}


def bench(model: str, backend: str, args) -> dict:
    """Medians of one `localinfer bench` process."""
    cmd = [sys.executable, "-m", "localinfer", "bench", model, "--backend", backend, "--offline",
           "-p", str(args.prompt), "-n", str(args.gen), "-r", str(args.repetitions), "--json"]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[2:])}: {done.stderr.strip().splitlines()[-1]}")
    result = json.loads(done.stdout)
    return {k: result[k]["median"] for k in TARGETS} | {"load_s": result["load_s"]}


def compare(model: str, args) -> list[dict]:
    rounds = []
    for i in range(args.rounds):
        order = ("llama.cpp", "onnx") if i % 2 == 0 else ("onnx", "llama.cpp")
        load = os.getloadavg()[0]
        figures = {backend: bench(model, backend, args) for backend in order}
        row = {"model": model, "round": i + 1, "loadavg": round(load, 2), **{
            f"{b}_{k}": v for b, f in figures.items() for k, v in f.items()}}
        for k in TARGETS:
            row[f"ratio_{k}"] = round(figures["onnx"][k] / figures["llama.cpp"][k], 3)
        print(f"{model} round {i + 1}: " + ", ".join(f"{k} {v}" for k, v in row.items()
                                                     if k.startswith("ratio")), file=sys.stderr)
        rounds.append(row)
    return rounds


def export_cost(model: str) -> dict:
    """Export into an empty store (the GGUF linked in) in a child process: seconds and peak RSS."""
    path = common.model_file(model)
    code = ("import sys, time; from pathlib import Path\n"
            "from localinfer.gguf.header import read_header\n"
            "from localinfer.backends.onnx import arch as onnx_arch, export as onnx_export\n"
            "p = Path(sys.argv[1]); t = time.perf_counter(); h = read_header(p)\n"
            "s = onnx_arch.read_spec(p, h)\n"
            "f, i = onnx_export.ensure_weights(p, h, s, Path(sys.argv[2]))\n"
            "onnx_export.ensure_graph(f, i, s, onnx_export.Form('dynamic', 4))\n"
            "print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-c", code, str(path), tmp],
                                 stdout=subprocess.PIPE, text=True)
        out = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)     # this child's own peak, not all children's
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"error: the export of {model} failed")
        size = sum(f.stat().st_size for f in Path(tmp).rglob("*"))
    return {"model": model, "export_s": round(float(out), 2), "process_s": round(wall, 2),
            "peak_rss_mb": round(usage.ru_maxrss / 1024), "export_mb": round(size / 2**20),
            "gguf_mb": round(path.stat().st_size / 2**20)}


def table(rounds: list[dict]) -> str:
    head = ("| model | round | load avg | llama.cpp pp t/s | onnx pp t/s | ratio | "
            "llama.cpp tg t/s | onnx tg t/s | ratio |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rounds:
        lines.append(f"| {r['model']} | {r['round']} | {r['loadavg']} | "
                     f"{r['llama.cpp_prefill_tps']} | {r['onnx_prefill_tps']} | "
                     f"{r['ratio_prefill_tps']} | {r['llama.cpp_decode_tps']} | "
                     f"{r['onnx_decode_tps']} | {r['ratio_decode_tps']} |")
    for model in dict.fromkeys(r["model"] for r in rounds):
        mine = [r for r in rounds if r["model"] == model]
        pp = statistics.median(r["ratio_prefill_tps"] for r in mine)
        tg = statistics.median(r["ratio_decode_tps"] for r in mine)
        lines.append(f"| **{model}** | median | | | | **{pp:.3f}** | | | **{tg:.3f}** |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--export", action="store_true", help="measure the export instead")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.export:
        results = [export_cost(m) for m in args.models]
        print(json.dumps(results, indent=2) if args.json else "\n".join(map(str, results)))
        return
    rounds = [r for m in args.models for r in compare(m, args)]
    print(json.dumps(rounds, indent=2) if args.json else table(rounds))


if __name__ == "__main__":
    main()
