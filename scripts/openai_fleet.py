#!/usr/bin/env python3
"""One OpenAI client in front of several servers: what a team's app sees when one desktop's
`localinfer serve` becomes several, or is handed over to llama-server (or vLLM).

    python scripts/openai_fleet.py URL [URL...] --model NAME [--requests 24] [--concurrency 4]
    python scripts/openai_fleet.py --here smollm2 [--serves 2]      (this machine, see below)

Given URLs (each an OpenAI-compatible base, ending in /v1 or not), the requests go round-robin
over them, as a load balancer without affinity sends them, from `--concurrency` threads of the
official `openai` client. Every server must pass the same checks: /v1/models names the model; a
greedy chat completion, its streamed twin (same text, usage in the last chunk), a text completion
and one request per server with a system message. Reported: each server's answer to the same
greedy question (identical across servers running the same model file and engine), requests
per second, median and p95 latency, and completion tokens per second over the whole run.

`--here MODEL` starts the fleet on this machine: `--serves` `localinfer serve`s of MODEL, then
llama-server (built by scripts/llama_tools.py from the llama.cpp localinfer vendors) on the same
file, and runs the same client against the localinfer fleet and against llama-server, printing
both. Exit 1 when a check fails or the greedy answers differ (within a fleet, or between them).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

QUESTION = "Name three primary colours."
TOPICS = ["the sea", "a forest", "bread", "rain", "a library", "mountains", "a river", "cats"]


def client_for(url: str, key: str):
    import openai
    base = url.rstrip("/")
    return openai.OpenAI(base_url=base if base.endswith("/v1") else base + "/v1", api_key=key,
                         max_retries=0, timeout=600)


def check_server(client, model: str) -> str:
    """The checks every server passes; returns its greedy answer to QUESTION."""
    listed = [m.id for m in client.models.list().data]
    assert listed, "/v1/models lists no model"
    ask = dict(model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
               max_tokens=24)
    whole = client.chat.completions.create(**ask)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0, "an empty chat completion"
    pieces, usage = [], None
    for chunk in client.chat.completions.create(**ask, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == text, "the stream's text is not the completion's"
    assert usage and usage.completion_tokens == whole.usage.completion_tokens
    done = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=8, temperature=0)
    assert done.choices[0].text, "an empty text completion"
    system = client.chat.completions.create(
        model=model, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "What colour is grass?"}])
    assert system.choices[0].message.content is not None
    return text


def load(clients: list, model: str, requests: int, concurrency: int) -> dict:
    """`requests` chat completions, round-robin over the servers, `concurrency` at a time."""
    turn = itertools.cycle(range(len(clients)))
    lock = threading.Lock()

    def one(i: int) -> tuple[float, int]:
        with lock:
            client = clients[next(turn)]
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, max_tokens=48, temperature=0.7, seed=i,
            messages=[{"role": "user", "content": f"[{i}] Write two sentences about "
                                                  f"{TOPICS[i % len(TOPICS)]}."}])
        return time.perf_counter() - start, reply.usage.completion_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - start
    latencies = sorted(d[0] for d in done)
    return {"rps": requests / wall, "median_s": statistics.median(latencies),
            "p95_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
            "tps": sum(d[1] for d in done) / wall}


def run_fleet(name: str, urls: list[str], args) -> str | None:
    """The checks on every server of a fleet, then the load; its greedy answer (None: a check
    failed, or its servers answered differently)."""
    clients = [client_for(u, args.api_key) for u in urls]
    answers = {}
    for url, client in zip(urls, clients):
        try:
            answers[url] = check_server(client, args.model)
        except Exception as e:      # one line per server that fails a check
            print(f"| {name} | {url} | FAILED: {type(e).__name__}: {e} |")
            return None
    figures = load(clients, args.model, args.requests, args.concurrency)
    same = len(set(answers.values())) == 1
    print(f"| {name} | {len(urls)} | {figures['rps']:.2f} | {figures['median_s']:.2f} / "
          f"{figures['p95_s']:.2f} | {figures['tps']:.1f} | {'yes' if same else 'NO'} | "
          f"{next(iter(answers.values()))!r} |", flush=True)
    return next(iter(answers.values())) if same else None


def start_here(args) -> tuple[list[subprocess.Popen], dict[str, list[str]]]:
    import llama_tools
    path = common.model_file(args.here)
    procs, urls = [], []
    for _ in range(args.serves):
        port = common.free_port()
        procs.append(common.start_server(
            [sys.executable, "-m", "localinfer", "serve", args.here, "--offline", "--port",
             str(port), "--parallel", "2", "--ctx", "1024", "-t", "1"], port, "localinfer serve"))
        urls.append(f"http://127.0.0.1:{port}")
    port = common.free_port()
    server = llama_tools.ensure_tool("llama-server")
    procs.append(common.start_server(
        [str(server), "-m", str(path), "--port", str(port), "--parallel", "2", "-c", "2048",
         "-t", "2", "--no-webui", "--jinja", "--alias", args.here], port, "llama-server"))
    return procs, {f"localinfer serve x{args.serves}": urls,
                   "llama-server": [f"http://127.0.0.1:{port}"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("urls", nargs="*", help="OpenAI-compatible base URLs")
    parser.add_argument("--model", help="the model name requests carry")
    parser.add_argument("--here", metavar="MODEL", help="start the fleet on this machine")
    parser.add_argument("--serves", type=int, default=2, help="localinfer serves --here (2)")
    parser.add_argument("--requests", type=int, default=24, help="requests in the load (24)")
    parser.add_argument("--concurrency", type=int, default=4, help="at a time (4)")
    parser.add_argument("--api-key", default="none", help="bearer token the servers require")
    args = parser.parse_args()
    if bool(args.urls) == bool(args.here):
        parser.error("give server URLs, or --here MODEL")
    args.model = args.model or args.here
    if not args.model:
        parser.error("--model names the model the requests carry")
    procs, fleets = start_here(args) if args.here else ([], {"given": args.urls})
    print("| fleet | servers | requests/s | latency median / p95 s | completion t/s "
          "| same greedy answer | greedy answer |\n|---|---|---|---|---|---|---|", flush=True)
    try:
        answers = [run_fleet(name, urls, args) for name, urls in fleets.items()]
        ok = None not in answers and len(set(answers)) == 1
        if len(answers) > 1:
            print(f"\nthe fleets' greedy answers are {'the same' if ok else 'NOT the same'}")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
