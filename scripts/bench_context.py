"""What sizing the context to the request costs: the tables in docs/context.md.

    python scripts/bench_context.py count SMOL.gguf GEMMA.gguf [--reps 5]
        Counting a long prompt before the fit: the model's vocabulary loaded alone (no weights),
        then a ~5,000-token document tokenized; against loading the whole model.
    python scripts/bench_context.py ttft --baseline DIR smollm2 gemma-3-270m [--reps 8]
        `localinfer run MODEL "Why is the sky blue?" -n 16 --temp 0` from this tree and from DIR (a
        checkout of an earlier commit, `git archive COMMIT | tar -x -C DIR`, run with PYTHONPATH),
        alternating: wall time to the answer's first byte, and the -v time to first token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common  # scripts/common.py


def count(models: list[Path], reps: int) -> None:
    from localinfer.backends import LoadOptions
    from localinfer.backends.llama.engine import init_engine
    from localinfer.backends.llama.session import LlamaCppSession
    from localinfer.backends.llama.vocab import LlamaVocab
    from localinfer.engine.prompt import PromptText, prompt_tokens
    from localinfer.measure import quality
    init_engine(False)
    text = quality.default_text()[:19_000] + "\n\nSummarize the text above."
    print("| model | vocabulary load | tokenize (tokens) | whole model load (ctx 4096) |")
    print("|---|---:|---:|---:|")
    for path in models:
        vocab_s, tok_s, load_s, n = [], [], [], 0
        for _ in range(reps):
            start = time.perf_counter()
            vocab = LlamaVocab(path)
            loaded = time.perf_counter()
            n = len(prompt_tokens(vocab, PromptText(text)))
            done = time.perf_counter()
            vocab.close()
            session = LlamaCppSession(path, LoadOptions(n_ctx=4096))
            load_s.append(time.perf_counter() - done)
            session.close()
            vocab_s.append(loaded - start)
            tok_s.append(done - loaded)
        ms = lambda xs: f"{statistics.median(xs) * 1000:.0f} ms"   # noqa: E731
        print(f"| {path.name} | {ms(vocab_s)} | {ms(tok_s)} ({n}) | {ms(load_s)} |")


def _run(tree: str | None, model: str) -> tuple[float, float]:
    env = {**os.environ, "NO_COLOR": "1"}
    if tree:
        env["PYTHONPATH"] = tree
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "localinfer", "run", model, "Why is the sky blue?",
                             "-n", "16", "--temp", "0", "-v"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd="/" if tree else None)
    proc.stdout.read(1)
    first = time.perf_counter() - start
    _, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(err.decode()[-2000:])
    line = next(x for x in err.decode().splitlines() if " ttft " in x)
    return first, float(line.split(" ttft ")[1].split(" ms")[0])


def ttft(models: list[str], baseline: str, reps: int) -> None:
    print("| model | tree | first byte (median, min) | -v ttft (median) |")
    print("|---|---|---:|---:|")
    for model in models:
        runs: dict[str, list[tuple[float, float]]] = {"baseline": [], "this tree": []}
        for i in range(reps):
            order = [("baseline", baseline), ("this tree", None)]
            for name, tree in order if i % 2 == 0 else order[::-1]:
                runs[name].append(_run(tree, model))
        for name, rows in runs.items():
            first, ms = zip(*rows)
            print(f"| {model} | {name} | {statistics.median(first):.3f} s, {min(first):.3f} s | "
                  f"{statistics.median(ms):.0f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("count")
    c.add_argument("models", nargs="+", type=common.gguf_file)
    c.add_argument("--reps", type=int, default=5)
    t = sub.add_parser("ttft")
    t.add_argument("models", nargs="+")
    t.add_argument("--baseline", required=True)
    t.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    if args.what == "count":
        count(args.models, args.reps)
    else:
        ttft(args.models, args.baseline, args.reps)


if __name__ == "__main__":
    main()
