#!/usr/bin/env python3
"""Compare `localinfer bench --backend mlx` with mlx-lm's own generation loop on the same model.

Run it on an Apple Silicon Mac (`pip install "localinfer[mlx]"`); elsewhere it says so in one line
and exits 2, unless `--cpu` asks for MLX's CPU build (Linux), which says little about Metal. It answers: does localinfer's decode loop, which samples
in numpy above the backend boundary, keep up with mlx-lm's `generate_step` (sampling on the device,
the next step queued asynchronously)? The bar is a ratio of at least 0.95.

Both sides run the same network on the same weights: the mlx-lm model localinfer builds from the
GGUF file. mlx-lm cannot read GGUF K-quants itself, so handing it any other checkpoint would compare
different weights. Each round runs localinfer's bench (a separate process, as a user runs it) and
then mlx-lm's loop in this process, alternating so machine noise hits both sides.

Usage:

    python scripts/bench_mlx.py smollm2 gemma-3-270m
    python scripts/bench_mlx.py path/to/model.gguf -n 128 -r 5 --json
    python scripts/bench_mlx.py smollm2 --cpu --rounds 1 -n 32 -r 2      # Linux, MLX's CPU build

Progress goes to stderr; the markdown table (or JSON) to stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time

import common  # scripts/common.py

BAR = 0.95
EXIT_CANNOT_RUN = 2           # as scripts/gpu_check.py: this machine cannot run the comparison


def cannot_run(cpu: bool) -> str | None:
    """Why this machine cannot run the comparison (one line), or None."""
    if not (sys.platform == "darwin" and platform.machine() == "arm64") and not cpu:
        return ("not an Apple Silicon Mac: MLX's Metal backend is what this compares; pass --cpu "
                "to run it on MLX's CPU build instead (slow, and it says little about Metal)")
    if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_lm") is None:
        return "MLX is not installed: pip install \"localinfer[mlx]\""
    return None


def localinfer_decode(model: str, n_gen: int, repetitions: int) -> float:
    """Median decode tokens/s of `localinfer bench --backend mlx` (its tg test)."""
    cmd = [sys.executable, "-m", "localinfer", "bench", model, "--backend", "mlx", "-p", "32",
           "-n", str(n_gen), "-r", str(repetitions), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: localinfer bench failed: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout)["decode_tps"]["median"]


def model_path(model: str) -> str:
    """The GGUF file `localinfer` resolves the name to (pulling it if needed)."""
    return str(common.model_file(model, offline=False))


def mlx_lm_decode(path: str, n_gen: int, repetitions: int) -> float:
    """Median decode tokens/s of mlx-lm's generate_step on localinfer's MLX model of `path`."""
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from localinfer.backends import LoadOptions
    from localinfer.backends.mlx.session import MlxSession

    session = MlxSession(Path(path), LoadOptions(n_ctx=n_gen + 64))
    start_token = session.bos_token if session.bos_token is not None else 0
    greedy = make_sampler(temp=0.0)
    rates = []
    for rep in range(repetitions + 1):              # rep 0 warms up, as localinfer bench does
        steps = generate_step(mx.array([start_token]), session.model, max_tokens=n_gen + 1,
                              sampler=greedy)
        next(steps)                                   # the first token: prefill, not decode
        start = time.perf_counter()
        count = sum(1 for _ in steps)
        if rep:
            rates.append(count / (time.perf_counter() - start))
    session.close()
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="catalogue names or GGUF paths")
    parser.add_argument("-n", "--gen-tokens", type=int, default=128)
    parser.add_argument("-r", "--repetitions", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two sides")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cpu", action="store_true",
                        help="off Apple Silicon: compare on MLX's CPU build (Linux)")
    args = parser.parse_args()
    if why := cannot_run(args.cpu):
        print(f"error: {why}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    rows = []
    for model in args.models:
        path = model_path(model)
        ours, theirs = [], []
        for round_no in range(args.rounds):
            print(f"{model}: round {round_no + 1}/{args.rounds}", file=sys.stderr)
            ours.append(localinfer_decode(model, args.gen_tokens, args.repetitions))
            theirs.append(mlx_lm_decode(path, args.gen_tokens, args.repetitions))
        a, b = statistics.median(ours), statistics.median(theirs)
        rows.append({"model": model, "localinfer_tps": round(a, 2), "mlx_lm_tps": round(b, 2),
                     "ratio": round(a / b, 3), "meets_bar": a / b >= BAR})
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"| model | localinfer mlx tg{args.gen_tokens} | mlx-lm generate_step | ratio |")
        print("|---|---|---|---|")
        for r in rows:
            mark = "" if r["meets_bar"] else f" (below {BAR})"
            print(f"| {r['model']} | {r['localinfer_tps']} t/s | {r['mlx_lm_tps']} t/s | "
                  f"{r['ratio']}{mark} |")
    return 0 if all(r["meets_bar"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
