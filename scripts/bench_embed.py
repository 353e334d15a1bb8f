#!/usr/bin/env python3
"""`localinfer embed` against `llama-server --embeddings` from the same vendored llama.cpp.

    python scripts/bench_embed.py smollm2 gemma-3-270m [--lines 256] [--rounds 3] [--batch 32]

Both get the same GGUF file, threads, inputs (lines of about 30 tokens cut from the bundled Alice
text), mean pooling and a 512-token micro-batch. Rounds alternate which goes first. localinfer is
timed in-process on its library path (pipeline/embed.py, what `embed` and the server call), after
one warm-up pass; llama-server on one /v1/embeddings request holding every line (its slots
batch them), after one warm-up request. Reported: inputs/s (median of the rounds), the ratio,
and how far the vectors agree (the lowest cosine between the two sides' unit vectors).

llama-server is built once by scripts/llama_tools.py (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import llama_tools  # noqa: E402

UBATCH = 512


def lines_of_text(n: int, words: int = 22) -> list[str]:
    text = (common.ROOT / "localinfer" / "data" / "alice_ch1-3.txt").read_text()
    tokens = text.split()
    return [" ".join(tokens[i * words:(i + 1) * words]) for i in range(n)]


def start_server(path: Path, threads: int, batch: int) -> tuple[subprocess.Popen, str]:
    port = common.free_port()
    cmd = [str(llama_tools.ensure_tool("llama-server")), "-m", str(path), "--port", str(port),
           "--embeddings", "--pooling", "mean", "-t", str(threads), "-tb", str(threads),
           "-np", str(batch), "-kvu", "-c", str(8 * UBATCH), "-b", str(UBATCH),
           "-ub", str(UBATCH), "--no-webui"]
    return common.start_server(cmd, port, "llama-server"), f"http://127.0.0.1:{port}"


def server_embed(url: str, lines: list[str]):
    import numpy as np
    body = json.dumps({"input": lines, "model": "m"}).encode()
    request = urllib.request.Request(url + "/v1/embeddings", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as r:
        data = json.load(r)["data"]
    return np.array([d["embedding"] for d in sorted(data, key=lambda d: d["index"])],
                    dtype=np.float32)


def bench(model: str, args) -> dict:
    from localinfer.pipeline import embed
    path = common.model_file(model)
    lines = lines_of_text(args.lines)
    embedder = embed.load(str(path), batch=args.batch, threads=args.threads, offline=True)
    tokens = sum(len(embedder.engine.tokenize(line)) for line in lines)
    proc, url = start_server(path, args.threads, args.batch)
    ours, theirs = [], []
    try:
        mine = embed.vectors(embedder, lines)             # warm-ups, and the vectors compared
        other = server_embed(url, lines)
        for r in range(args.rounds):
            for side in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
                t = time.perf_counter()
                embed.vectors(embedder, lines) if side == "ours" else server_embed(url, lines)
                (ours if side == "ours" else theirs).append(len(lines) / (time.perf_counter() - t))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:      # it can hang in its shutdown: the figures are in
            proc.kill()
            proc.wait()
        embedder.close()
    norms = (other ** 2).sum(axis=1) ** 0.5
    cosine = float(((mine * other).sum(axis=1) / norms).min())
    a, b = statistics.median(ours), statistics.median(theirs)
    return {"model": model, "lines": len(lines), "tokens_per_line": round(tokens / len(lines), 1),
            "localinfer": round(a, 1), "llama_server": round(b, 1), "ratio": round(a / b, 3),
            "rounds_localinfer": [round(x, 1) for x in ours],
            "rounds_llama_server": [round(x, 1) for x in theirs], "min_cosine": round(cosine, 6)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--lines", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="inputs per decode (slots)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        rows = [bench(model, args) for model in args.models]
    except llama_tools.BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| model | tokens/line | localinfer inputs/s | llama-server inputs/s | ratio | "
          "min cosine |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens_per_line']} | {r['localinfer']} | "
              f"{r['llama_server']} | {r['ratio']} | {r['min_cosine']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
