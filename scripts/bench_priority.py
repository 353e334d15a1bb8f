#!/usr/bin/env python3
"""An interactive request's time to first token while a batch of requests runs, against idle.

    python scripts/bench_priority.py smollm2 [--batch 32] [--tries 5] [--parallel 4] [--same]

`localinfer serve MODEL --parallel P` is sent `--batch` completions with `priority: "batch"`
(64 tokens each, all at once, from threads); while they run, `--tries` interactive streamed chat
requests one after another, each timed from sending to its first content chunk. Interactive
requests like them (a new short question each, as a chat's next turn) are timed on the idle
server first. With --same every try asks the same question: its whole prompt is then in a slot's
kept cells, so its first token is one decode step, and one batch step under way is all it waits. Reported: the median TTFT idle and under
the batch, and their ratio (target: within 2x), and how many batch requests were still running
when the last interactive one was answered (it must be under way, or it proves nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def post(url: str, body: dict):
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=900)


QUESTIONS = ["Name a colour.", "Name a fruit.", "Name a river.", "Name a tree.",
             "Name a planet.", "Name a metal.", "Name a bird.", "Name a city.", "Name a game.",
             "Name a flower.", "Name a tool.", "Name a sport.", "Name a fish.", "Name a stone.",
             "Name a dance.", "Name a cloud.", "Name a spice.", "Name a shape."]


def first_token_s(base: str, model: str, question: str) -> float:
    """Seconds from sending a streamed chat request to its first content chunk."""
    body = {"model": model, "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": question}]}
    start = time.perf_counter()
    with post(base + "/v1/chat/completions", body) as reply:
        for line in reply:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"] and \
                    json.loads(line[6:])["choices"][0]["delta"].get("content"):
                seconds = time.perf_counter() - start
                reply.read()
                return seconds
    raise SystemExit("error: the interactive request got no content")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model on disk (name or .gguf path)")
    parser.add_argument("--batch", type=int, default=32, help="batch requests (32)")
    parser.add_argument("--tries", type=int, default=5, help="interactive requests timed (5)")
    parser.add_argument("--parallel", type=int, default=4, help="serve --parallel (4)")
    parser.add_argument("--same", dest="new", action="store_false",
                        help="ask every try the same question (its prompt is then in the "
                             "slot's kept cells: one token to evaluate)")
    args = parser.parse_args()
    if 1 + 2 * args.tries > len(QUESTIONS):
        parser.error(f"--tries is at most {(len(QUESTIONS) - 1) // 2}")
    common.locate(args.model)
    port = common.free_port()
    base = f"http://127.0.0.1:{port}"
    proc = common.start_server([sys.executable, "-m", "localinfer", "serve", args.model,
                                "--offline", "--port", str(port), "--parallel",
                                str(args.parallel), "--queue", str(args.batch + args.tries),
                                "--no-cache"], port, "localinfer serve")
    try:
        model = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
        asked = iter(QUESTIONS if args.new else ["Name a colour."] * len(QUESTIONS))
        first_token_s(base, model, next(asked))                     # warm-up
        idle = [first_token_s(base, model, next(asked)) for _ in range(args.tries)]
        done = []

        def batch_request(i: int) -> None:
            body = {"model": model, "prompt": f"Story {i}: Once upon a time", "max_tokens": 64,
                    "temperature": 0, "priority": "batch"}
            with post(base + "/v1/completions", body) as reply:
                json.loads(reply.read())
            done.append(i)
        threads = [threading.Thread(target=batch_request, args=(i,)) for i in range(args.batch)]
        for t in threads:
            t.start()
        time.sleep(1.0)                     # the batch is admitted and decoding
        busy = [first_token_s(base, model, next(asked)) for _ in range(args.tries)]
        left = args.batch - len(done)
        for t in threads:
            t.join()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    idle_s, busy_s = statistics.median(idle), statistics.median(busy)
    print(f"TTFT idle: median {idle_s * 1000:.0f} ms ({', '.join(f'{s * 1000:.0f}' for s in idle)})")
    print(f"TTFT with {args.batch} batch requests: median {busy_s * 1000:.0f} ms "
          f"({', '.join(f'{s * 1000:.0f}' for s in busy)}); {left} batch requests still "
          f"running after the last")
    print(f"ratio {busy_s / idle_s:.2f}x (target <= 2x)")
    return 0 if busy_s <= 2 * idle_s and left > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
