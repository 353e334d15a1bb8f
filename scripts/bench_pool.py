#!/usr/bin/env python3
"""The model pool inside its budget: `localinfer serve` (no model at start) asked for two models
in turn whose needs do not fit together, its peak RSS against the budget.

    python scripts/bench_pool.py smollm2 gemma-3-270m [--turns 6] [--ctx 2048]

The budget is set with --memory to the runtime's share, the larger model's need and half the
smaller one's (each need is the fit's estimate, as the server computes it), so every turn must
unload the other model first. Each turn sends one completion whose prompt fills a micro-batch (the
widest a decode gets, which the estimate counts). Reported: each model's need, the budget, the
server's peak RSS (VmHWM) and the RSS after each turn, as a share of the budget (target: within
115%), and the load/unload lines the server logged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def needs(models: list[str], ctx: int, parallel: int):
    """Each model's need and the runtime's share, from the pool's own Loader (the fit's estimate)."""
    from localinfer.fit.options import FitOptions
    from localinfer.server.loading import Loader, pooled
    fit, _, overhead = pooled(FitOptions(ctx=ctx, offline=True, memory="64GB"))
    loader = Loader(fit, parallel=parallel, use_cache=False)
    return {m: loader.plan(m).need.ram for m in models}, overhead.ram


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"error: no {field} for process {pid}")


def complete(url: str, model: str) -> None:
    body = {"model": model, "prompt": "Once upon a time " * 100, "max_tokens": 8,
            "temperature": 0}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        json.loads(reply.read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs=2, help="two models on disk (names or .gguf paths)")
    parser.add_argument("--turns", type=int, default=6, help="requests, alternating (6)")
    parser.add_argument("--ctx", type=int, default=2048, help="each model's context (2048)")
    parser.add_argument("--parallel", type=int, default=2, help="serve --parallel (2)")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("error: this script reads /proc (Linux)")
    for model in args.models:
        common.locate(model)
    need, overhead = needs(args.models, args.ctx, args.parallel)
    small, large = sorted(need.values())
    budget = overhead + large + small // 2
    port = common.free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "localinfer", "serve", "--offline", "--port", str(port),
           "--ctx", str(args.ctx), "--parallel", str(args.parallel), "--memory", str(budget),
           "--no-cache", "-v"]
    proc = common.start_server(cmd, port, "localinfer serve", log)
    url = f"http://127.0.0.1:{port}"
    try:
        after = []
        for turn in range(args.turns):
            complete(url, args.models[turn % 2])
            after.append(status_kib(proc.pid, "VmRSS") * 1024)
        peak = status_kib(proc.pid, "VmHWM") * 1024
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    lines = [line.strip() for line in Path(log.name).read_text().splitlines()
             if line.split(" ")[0] in ("loaded", "unloaded")]
    os.unlink(log.name)
    mb = 1e6
    print("needs: " + ", ".join(f"{m} {n / mb:.0f} MB" for m, n in need.items())
          + f"; runtime {overhead / mb:.0f} MB; budget (--memory) {budget / mb:.0f} MB")
    print("RSS after each turn: " + ", ".join(f"{r / mb:.0f} MB" for r in after))
    print(f"peak RSS {peak / mb:.0f} MB = {peak / budget:.2f}x the budget "
          f"(largest after a turn {max(after) / budget:.2f}x; target <= 1.15x)")
    print("server log: " + "; ".join(lines))
    return 0 if peak <= 1.15 * budget else 1


if __name__ == "__main__":
    sys.exit(main())
