"""Default-path prefill against llama-bench's way of asking for it, in one process on one model.

    python scripts/bench_prefill_inprocess.py MODEL.gguf [MODEL.gguf ...] [--tokens 2048] [--rounds 10]

bench_vs_llama_bench.py compares two processes, and on a VM whose speed drifts by 20% from minute
to minute a few percent between them is hard to place. Here both sides share the loaded weights
and the thread pool and alternate call by call: `ours` is `run`'s prefill (KVCache over the
session `run` loads, steered where the backend allows, prompts cut as engine/batching.py cuts
them); `llama-bench` is a context made as llama-bench makes it (f16/f16 cache, flash attention,
n_batch 2048, n_ubatch 512, llama.cpp's defaults otherwise) taking the whole prompt in one
llama_decode. The prompt is N random token ids, as llama-bench's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import common  # scripts/common.py
from bench_vs_llama_bench import cpu_model

from localinfer.errors import LocalinferError


def positive(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


class LlamaBenchContext:
    """A context on `session`'s model with llama-bench's parameters, and one batch of the prompt."""

    def __init__(self, session, prompt: list[int], threads: int) -> None:
        from localinfer.backends.llama.engine import engine
        from localinfer.backends.llama.threads import attach_shared_pool
        lib, n = engine(), len(prompt)
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n + 128, max(n, 2048), 512
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = 1          # GGML_TYPE_F16
        params.flash_attn_type = 1                 # -fa on
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(session._model, params)
        if not self.ctx:
            raise LocalinferError(f"cannot make a context of {n + 128} tokens")
        attach_shared_pool(self.ctx, threads)
        self.batch = lib.llama_batch_init(n, 0, 1)
        for i, token in enumerate(prompt):
            self.batch.token[i], self.batch.pos[i] = token, i
            self.batch.n_seq_id[i], self.batch.seq_id[i][0] = 1, 0
            self.batch.logits[i] = i == n - 1
        self.batch.n_tokens = n
        self.memory, self.lib = lib.llama_get_memory(self.ctx), lib

    def prefill(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)
        if self.lib.llama_decode(self.ctx, self.batch) != 0:
            raise SystemExit("llama_decode failed")
        self.lib.llama_synchronize(self.ctx)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


def rate(prefill, n: int) -> float:
    start = time.perf_counter()
    prefill()
    return n / (time.perf_counter() - start)


def measure(model: Path, n: int, rounds: int, threads: int) -> dict:
    import numpy as np
    from localinfer.backends import LoadOptions
    from localinfer.backends.llama.session import LlamaCppSession
    from localinfer.engine.kv import KVCache
    session = LlamaCppSession(model, LoadOptions(n_ctx=n + 18, n_threads=threads))
    # llama-bench's prompt: token ids drawn from the whole vocabulary (an id past it is an error)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, session.n_vocab, n)]
    cache, raw = KVCache(session), LlamaBenchContext(session, prompt, threads)

    def ours() -> None:
        cache.clear()
        cache.prefill(prompt)
    try:
        ours(), raw.prefill()                      # warm-up, not counted
        a, b = [], []
        for r in range(rounds):                    # the side that goes first swaps every round
            sides = ((ours, a), (raw.prefill, b)) if r % 2 == 0 else ((raw.prefill, b), (ours, a))
            for prefill, out in sides:
                out.append(rate(prefill, n))
        return {"ours": a, "llama_bench": b, "path": session.kv_path}
    finally:
        raw.close()
        session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=common.gguf_file)
    parser.add_argument("--tokens", type=positive, default=2048, help="prompt length (2048)")
    parser.add_argument("--rounds", type=positive, default=10, help="alternating rounds (10)")
    parser.add_argument("-t", "--threads", type=positive, default=2)
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, "
          f"{args.threads} threads, pp{args.tokens}, {args.rounds} alternating rounds in one process")
    print("| model | path | llama-bench's context t/s (median) | ours t/s (median) | ratio "
          "| median of round ratios |")
    print("|---|---|---:|---:|---:|---:|")
    for model in args.models:
        try:
            got = measure(model, args.tokens, args.rounds, args.threads)
        except LocalinferError as exc:          # not a model llama.cpp can load: one line
            sys.exit(f"bench_prefill_inprocess.py: {model.name}: {exc}")
        ours, theirs = statistics.median(got["ours"]), statistics.median(got["llama_bench"])
        per_round = statistics.median(x / y for x, y in zip(got["ours"], got["llama_bench"]))
        print(f"| {model.name} | {got['path']} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.3f} "
              f"| {per_round:.3f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
