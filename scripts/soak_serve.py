#!/usr/bin/env python3
"""Many mixed requests to one `localinfer serve` of two models: nothing leaks.

    python scripts/soak_serve.py smollm2 gemma-3-270m [--requests 200]

A server started with the first model is sent `--requests` requests, cycling through: an OpenAI
chat, an Ollama chat, embeddings, a streamed completion of the second model, a stream the client
drops after its first chunk, a bad request (400), an unknown model (404), and a load of the
second model with keep_alive 0 (so it is unloaded and loaded again). Reported: the server's RSS
after the first round of each kind and at the end, the replies by status, and /metrics' running
sequences and queue depth at the end (both must be 0 within 10 s); the exit status says whether RSS grew by
more than --grow MB after the warm-up and whether anything was left running.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def send(base: str, path: str, body: dict, *, drop: bool = False) -> int:
    request = urllib.request.Request(base + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            if drop:
                reply.readline()        # the first chunk, then the client goes
                return reply.status
            reply.read()
            return reply.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def kinds(first: str, second: str):
    chat = [{"role": "user", "content": "Name a colour."}]
    return [
        ("/v1/chat/completions", {"model": first, "messages": chat, "max_tokens": 8}, False),
        ("/api/chat", {"model": first, "messages": chat, "stream": False,
                       "options": {"num_predict": 8}}, False),
        ("/v1/embeddings", {"model": first, "input": ["a line", "another line"]}, False),
        ("/v1/completions", {"model": second, "prompt": "Once upon a time", "max_tokens": 8,
                             "stream": True}, False),
        ("/v1/completions", {"model": first, "prompt": "Once upon a time", "max_tokens": 64,
                             "stream": True}, True),
        ("/v1/chat/completions", {"model": first, "messages": chat, "temperature": 9}, False),
        ("/v1/chat/completions", {"model": "no-such-model", "messages": chat}, False),
        ("/api/generate", {"model": second, "keep_alive": 0}, False),
    ]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def gauges(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=60).read().decode()
    found = collections.defaultdict(float)
    for line in text.splitlines():
        for name in ("localinfer_running_sequences", "localinfer_queue_depth"):
            if line.startswith(name + "{"):
                found[name] += float(line.rsplit(" ", 1)[1])
    return dict(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs=2, help="two models on disk")
    parser.add_argument("--requests", type=int, default=200, help="requests in all (200)")
    parser.add_argument("--grow", type=float, default=32.0,
                        help="MB of RSS growth after the warm-up that counts as a leak (32)")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("error: this script reads /proc (Linux)")
    first, second = args.models
    for model in args.models:
        common.locate(model)
    port = common.free_port()
    base = f"http://127.0.0.1:{port}"
    proc = common.start_server([sys.executable, "-m", "localinfer", "serve", first, "--offline",
                                "--port", str(port), "--ctx", "2048", "--no-cache"], port,
                               "localinfer serve")
    statuses: collections.Counter = collections.Counter()
    try:
        plan = kinds(first, second)
        warm = None
        for i in range(args.requests):
            path, body, drop = plan[i % len(plan)]
            statuses[send(base, path, body, drop=drop)] += 1
            if i == 2 * len(plan) - 1:
                warm = rss_mb(proc.pid)
        end = rss_mb(proc.pid)
        for _ in range(100):        # the last requests' sequences end within a step or two
            left = gauges(base)
            if not any(left.values()):
                break
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"{args.requests} requests: " + ", ".join(f"{n} x {s}" for s, n in sorted(statuses.items())))
    print(f"RSS after two rounds of every kind {warm:.0f} MB, at the end {end:.0f} MB "
          f"(+{end - warm:.0f} MB; a leak past +{args.grow:.0f} MB)")
    print(f"at the end: running sequences {left.get('localinfer_running_sequences', 0):.0f}, "
          f"queue depth {left.get('localinfer_queue_depth', 0):.0f}")
    leaked = end - warm > args.grow or any(left.values())
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
