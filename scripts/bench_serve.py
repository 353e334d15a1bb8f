#!/usr/bin/env python3
"""`localinfer serve` against `llama-server` from the same vendored llama.cpp: concurrent streams.

    python scripts/bench_serve.py smollm2 [--streams 1 4 8] [--rounds 2] [-n 64] [--json]

Both servers get the same model file, `--parallel` (the largest stream count), threads, context
per request and KV-cache types (bf16 K / f16 V, what `serve` uses for short prompts), and are
started one at a time, alternating which goes first each round. For each stream count, that many
greedy streamed chat requests (different questions) start together; reported: aggregate generated
tokens/s (all completion tokens / wall time), median and p95 time to first token. Then a new
request's time to first token while the others stream, against its time on an idle server.

llama-server is built once by scripts/llama_tools.py (the llama-bench build's source and folder,
in ~/.cache/localinfer-bench or $LOCALINFER_BENCH_CACHE), which takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (scripts/common.py)
import llama_tools  # noqa: E402  (scripts/llama_tools.py: llama-server's build)

QUESTIONS = ["Tell me about the ocean.", "Describe a forest in autumn.", "What do cats like?",
             "Explain how rain forms.", "Write about a city at night.", "Describe a mountain.",
             "What is a library for?", "Tell me about bread.", "Describe a river.",
             "What makes a good friend?"]
THREADS = 2
_REQUEST = itertools.count(1)
MODEL_NAME = ["?"]            # the name requests carry: the catalogue name both servers accept


def llama_server() -> Path:
    """llama-server, built on first use; a build that cannot happen here is one error line."""
    try:
        return llama_tools.ensure_tool("llama-server", jobs=os.cpu_count() or 2)
    except llama_tools.BenchError as e:
        raise SystemExit(f"error: {e}") from None


def start(kind: str, model: str, path: Path, parallel: int, ctx: int) -> tuple[subprocess.Popen, str]:
    port = common.free_port()
    if kind == "localinfer":
        cmd = [sys.executable, "-m", "localinfer", "serve", model, "--offline", "--port", str(port),
               "--parallel", str(parallel), "--ctx", str(ctx), "-t", str(THREADS)]
    else:
        cmd = [str(llama_server()), "-m", str(path), "--port", str(port), "--parallel",
               str(parallel), "-c", str(ctx * parallel), "-t", str(THREADS), "-tb", str(THREADS),
               "-fa", "on", "-ctk", "bf16", "-ctv", "f16", "--no-repack", "-kvu", "--no-webui"]
    return common.start_server(cmd, port, kind), f"http://127.0.0.1:{port}"


def stream_one(client, question: str, n: int, out: list) -> None:
    # Each request is new to both servers: llama-server would otherwise reuse a slot's cached
    # copy of the same question asked before (its warm-up, an earlier stream count).
    question = f"[{next(_REQUEST)}] {question}"
    start = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(
        model=MODEL_NAME[0], messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=n, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    out.append({"ttft": first or 0.0, "tokens": tokens})


def streams(url: str, count: int, n: int) -> dict:
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    results: list = []
    threads = [threading.Thread(target=stream_one, args=(client, QUESTIONS[i % len(QUESTIONS)],
                                                         n, results)) for i in range(count)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    return {"tps": sum(r["tokens"] for r in results) / wall,
            "ttft_median": statistics.median(ttfts),
            "ttft_p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))]}


def late_ttft(url: str, others: int, n: int) -> dict:
    """A new request's time to first token on an idle server and while `others` stream."""
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    idle: list = []
    stream_one(client, QUESTIONS[-1], 8, idle)
    busy: list = []
    background = [threading.Thread(target=stream_one, args=(client, QUESTIONS[i], n * 2, []))
                  for i in range(others)]
    for t in background:
        t.start()
    time.sleep(1.0)                      # they are decoding now
    stream_one(client, QUESTIONS[-1], 8, busy)
    for t in background:
        t.join()
    return {"idle_ttft": idle[0]["ttft"], "busy_ttft": busy[0]["ttft"]}


def measure(kind: str, args, path: Path) -> dict:
    parallel = max(args.streams)
    proc, url = start(kind, args.model, path, parallel, args.ctx)
    try:
        streams(url, 1, 8)                               # warm-up
        figures = {s: streams(url, s, args.gen) for s in args.streams}
        figures["late"] = late_ttft(url, parallel - 1, args.gen)
        return figures
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", "--gen", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024, help="context per request")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    MODEL_NAME[0] = args.model
    path = common.model_file(args.model)
    rounds = []
    for i in range(args.rounds):
        order = ("localinfer", "llama-server") if i % 2 == 0 else ("llama-server", "localinfer")
        rounds.append({kind: measure(kind, args, path) for kind in order})
        print(f"round {i + 1}: {json.dumps(rounds[-1])}", file=sys.stderr)
    print(json.dumps(rounds, indent=2) if args.json else table(rounds, args))


def table(rounds: list[dict], args) -> str:
    med = lambda kind, s, key: statistics.median(r[kind][s][key] for r in rounds)   # noqa: E731
    lines = [f"`python scripts/bench_serve.py {args.model} --streams {' '.join(map(str, args.streams))}"
             f" --rounds {args.rounds} -n {args.gen}`, {time.strftime('%Y-%m-%d %H:%M')}, "
             f"load avg {os.getloadavg()[0]:.2f}, medians of the rounds\n",
             "| streams | localinfer t/s | llama-server t/s | ratio | localinfer TTFT median / p95 s "
             "| llama-server TTFT median / p95 s |", "|---:|---:|---:|---:|---|---|"]
    for s in args.streams:
        ours, theirs = med("localinfer", s, "tps"), med("llama-server", s, "tps")
        lines.append(f"| {s} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} | "
                     f"{med('localinfer', s, 'ttft_median'):.3f} / {med('localinfer', s, 'ttft_p95'):.3f} | "
                     f"{med('llama-server', s, 'ttft_median'):.3f} / {med('llama-server', s, 'ttft_p95'):.3f} |")
    top, one = max(args.streams), min(args.streams)
    lines.append(f"\nlocalinfer at {top} streams: {med('localinfer', top, 'tps') / med('localinfer', one, 'tps'):.2f}× "
                 f"its {one}-stream aggregate.")
    for kind in ("localinfer", "llama-server"):
        idle = statistics.median(r[kind]["late"]["idle_ttft"] for r in rounds)
        busy = statistics.median(r[kind]["late"]["busy_ttft"] for r in rounds)
        lines.append(f"{kind}: a new request's TTFT {idle:.3f} s idle, {busy:.3f} s while "
                     f"{top - 1} stream ({busy / idle:.2f}×).")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
