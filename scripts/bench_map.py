#!/usr/bin/env python3
"""`localinfer map` on N lines against N separate `localinfer run`s and against one process that
takes them one at a time (`map --parallel 1`): wall time and greedy agreement.

    python scripts/bench_map.py smollm2 [--lines 64] [--parallel 4] [-n 32] [--json]

The lines are short requests of one shape ("Translate to French: item K."), greedy; the separate
runs are what a shell loop does today (`while read l; do localinfer run ...; done`, default
options). Answers are compared as map prints them (stripped, newlines escaped). Progress on
stderr, a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TEMPLATE = "Translate to French: {}"


def cli(*args: str, stdin: str | None = None) -> tuple[str, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "localinfer", *args], input=stdin,
                          capture_output=True, text=True,
                          stdin=None if stdin is not None else subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"error: localinfer {' '.join(args[:3])}: {done.stderr.strip()[-300:]}")
    return done.stdout, time.perf_counter() - start


def as_map_prints(text: str) -> str:
    return text.strip().replace("\\", "\\\\").replace("\n", "\\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--lines", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("-n", "--gen", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lines = [f"item {k}." for k in range(1, args.lines + 1)]
    common = ["--temp", "0", "-n", str(args.gen), "--offline"]
    stdin = "\n".join(lines) + "\n"
    print("map, parallel", file=sys.stderr)
    batched, t_map = cli("map", args.model, TEMPLATE, "-P", str(args.parallel), *common, stdin=stdin)
    print("map, one at a time", file=sys.stderr)
    serial, t_serial = cli("map", args.model, TEMPLATE, "-P", "1", *common, stdin=stdin)
    print(f"{len(lines)} separate runs", file=sys.stderr)
    start, runs = time.perf_counter(), []
    for line in lines:
        runs.append(as_map_prints(cli("run", args.model, TEMPLATE.format(line), *common)[0]))
    t_runs = time.perf_counter() - start
    batched, serial = batched.splitlines(), serial.splitlines()
    result = {
        "model": args.model, "lines": len(lines), "parallel": args.parallel, "gen": args.gen,
        "loadavg": round(os.getloadavg()[0], 2),
        "map_s": round(t_map, 1), "map_serial_s": round(t_serial, 1), "runs_s": round(t_runs, 1),
        "map_equals_runs": sum(a == b for a, b in zip(batched, runs)),
        "map_equals_serial": sum(a == b for a, b in zip(batched, serial)),
        "serial_equals_runs": sum(a == b for a, b in zip(serial, runs)),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    r = result
    print(f"`python scripts/bench_map.py {args.model} --lines {r['lines']} --parallel "
          f"{r['parallel']} -n {r['gen']}`, {time.strftime('%Y-%m-%d %H:%M')}, load avg "
          f"{r['loadavg']}\n")
    print("| way | wall s | vs map | answers equal to map's |\n|---|---:|---:|---:|")
    print(f"| `map -P {r['parallel']}` | {r['map_s']} | 1.00× | {r['lines']} of {r['lines']} |")
    print(f"| `map -P 1` (one process, one at a time) | {r['map_serial_s']} | "
          f"{r['map_serial_s'] / r['map_s']:.2f}× | {r['map_equals_serial']} of {r['lines']} |")
    print(f"| {r['lines']} separate `run`s | {r['runs_s']} | {r['runs_s'] / r['map_s']:.2f}× | "
          f"{r['map_equals_runs']} of {r['lines']} |")
    print(f"\n`map -P 1` against the separate runs: {r['serial_equals_runs']} of {r['lines']} equal.")


if __name__ == "__main__":
    main()
