#!/usr/bin/env python3
"""A model over RPC workers against the same model local: prefill, decode and perplexity.

    python scripts/bench_rpc.py smollm2 gemma-3-270m [--workers 0 1 2] [--rounds 3]
                                [-p 512] [-n 128] [--chunks 4] [--memory SIZE]
    python scripts/bench_rpc.py BIGMODEL --rpc 10.0.0.2:50052,10.0.0.3:50052   (real machines)

Without --rpc, the workers are `localinfer worker`s started here on loopback (each offering
--memory, default: what the machine has), so what shows is the protocol's own cost: every
micro-batch's activations cross a socket at each device boundary, and the logits come back from
the worker holding the output layer. With --rpc, the workers given are used as they are, and
`--workers` counts how many of them (from the front of the list) each configuration takes.

Each round runs every configuration once, in turn (`localinfer bench --json -r 1`), so a noisy
machine slows them alike; the medians are compared with the local figures of the same rounds.
Perplexity (`localinfer eval --json`) is computed once per configuration. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def start_workers(count: int, memory: str | None) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addresses = [], []
    for _ in range(count):
        port = common.free_port()
        cmd = [sys.executable, "-m", "localinfer", "worker", "--port", str(port)]
        proc = subprocess.Popen(cmd + (["--memory", memory] if memory else []),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        ready = proc.stderr.readline()
        if not ready.startswith("worker ready"):
            raise SystemExit(f"error: the worker did not start: {ready}{proc.stderr.read()}")
        common.to_stderr(ready.strip())
        procs.append(proc)
        addresses.append(f"127.0.0.1:{port}")
    return procs, addresses


def localinfer_json(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "localinfer", *args, "--json", "--offline"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: localinfer {' '.join(args)}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def rpc_args(addresses: list[str], n: int) -> list[str]:
    return ["--rpc", ",".join(addresses[:n])] if n else []


def measure(model: str, counts: list[int], addresses: list[str], args) -> list[dict]:
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    for round_ in range(args.rounds):
        order = counts if round_ % 2 == 0 else counts[::-1]
        for n in order:
            runs[n].append(localinfer_json("bench", model, "-p", str(args.p), "-n", str(args.n),
                                           "-r", "1", *rpc_args(addresses, n)))
            common.to_stderr(f"{model} round {round_ + 1}, {n} workers: "
                             f"{runs[n][-1]['prefill_tps']['median']:.1f} / "
                             f"{runs[n][-1]['decode_tps']['median']:.1f} t/s")
    rows = []
    for n in counts:
        quality = localinfer_json("eval", model, "--chunks", str(args.chunks),
                                  *rpc_args(addresses, n))
        rows.append({
            "workers": n,
            "layers": runs[n][0]["offload"]["device_layers"],
            "prefill": statistics.median(r["prefill_tps"]["median"] for r in runs[n]),
            "decode": statistics.median(r["decode_tps"]["median"] for r in runs[n]),
            "perplexity": quality["perplexity"],
        })
    return rows


def table(model: str, rows: list[dict]) -> str:
    local = rows[0]
    lines = [f"| {model} | workers | layers on workers | prefill pp t/s | decode tg t/s "
             "| perplexity |", "|---|---|---|---|---|---|"]
    for row in rows:
        on_workers = sum(row["layers"].values())
        delta = row["perplexity"] / local["perplexity"] - 1
        lines.append(
            f"| | {row['workers']} | {on_workers} | {row['prefill']:.1f} "
            f"({row['prefill'] / local['prefill']:.2f}x) | {row['decode']:.1f} "
            f"({row['decode'] / local['decode']:.2f}x) | {row['perplexity']:.4f} "
            f"({delta:+.3%}) |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="models on disk (names or .gguf paths)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2],
                        help="worker counts to compare; 0 is the local run (0 1 2)")
    parser.add_argument("--rpc", help="use these workers instead of starting them here")
    parser.add_argument("--memory", help="--memory of the workers started here")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument("-p", type=int, default=512, help="prefill tokens (512)")
    parser.add_argument("-n", type=int, default=128, help="decoded tokens (128)")
    parser.add_argument("--chunks", type=int, default=4, help="perplexity chunks of 512 (4)")
    args = parser.parse_args()
    counts = sorted(set(args.workers))
    if counts[0] != 0:
        counts.insert(0, 0)       # the local figures every ratio is taken against
    procs, addresses = [], []
    try:
        if args.rpc:
            addresses = args.rpc.split(",")
        else:
            procs, addresses = start_workers(max(counts), args.memory)
        if max(counts) > len(addresses):
            raise SystemExit(f"error: {max(counts)} workers asked for, {len(addresses)} given")
        for model in args.models:
            print(table(model, measure(model, counts, addresses, args)) + "\n", flush=True)
    finally:
        for proc in procs:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
