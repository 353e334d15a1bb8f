"""What keeping a constrained answer closable costs decode (engine/closing.py): tokens/s of the
same greedy --json-schema answer, decoded three ways, alternated round by round in one process.

- off:   the grammar alone (the budget never narrows it, as before issue 28);
- far:   the budget watched, -n far beyond the answer (its checks are scheduled, a walk each);
- tight: -n one more than the answer's own length: its last WINDOW tokens and more are each
         checked by a walk, as in every answer that ends near its limit.

The answers are the same tokens in all three (nothing narrows: each ends by itself), so the
difference is the mechanism's own cost. On a busy machine the rates are noisy; the table also
gives the seconds spent in the mechanism itself (its measures and checks, timed around each call)
as a share of the decode time, which is the cost that the rates measure. Run:

    python scripts/bench_closing.py [MODEL] [--rounds 5] [-t THREADS]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
from bench_structured import GREEDY, SCHEMA, prompt_for
from localinfer.engine import closing
from localinfer.engine.constrain import ConstrainedSampler
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.structured import from_schema

FAR = 4096
SPENT = [0.0]               # seconds inside the mechanism's measures and checks


def _timed(method):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            SPENT[0] += time.perf_counter() - start
    return timed


for _name in ("_near", "_fits", "_first"):
    setattr(closing.Closing, _name, _timed(getattr(closing.Closing, _name)))


def _generate(loaded, tokens, gbnf: str, n: int, watched: bool) -> Generation:
    real = closing.fit
    if not watched:
        closing.fit = lambda grammar, *args, **kwargs: grammar
    try:
        made = Generation(KVCache(loaded.session, None), tokens,
                          ConstrainedSampler(GREEDY, loaded.session.grammar(gbnf)), Limits(n))
        for _ in made:
            pass
    finally:
        closing.fit = real
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-t", "--threads", type=int, default=0)
    args = parser.parse_args()
    from localinfer.backends import LoadOptions
    from localinfer.pipeline.load import open_model
    loaded = open_model(str(common.model_file(args.model)),
                        LoadOptions(n_ctx=FAR + 512, n_threads=args.threads),
                        backend="llama.cpp", offline=True)
    tokens, gbnf = prompt_for(loaded.session), from_schema(SCHEMA, "bench").gbnf
    first = _generate(loaded, tokens, gbnf, FAR, False)              # warm-up, and the answer
    length = first.stats.generated_tokens
    modes = {"off": (FAR, False), "far": (FAR, True), "tight": (length + 1, True)}
    figures: dict[str, list[float]] = {mode: [] for mode in modes}
    shares: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode, (n, watched) in modes.items():
            SPENT[0] = 0.0
            made = _generate(loaded, tokens, gbnf, n, watched)
            assert made.tokens == first.tokens and made.stats.closed_at == -1, mode
            figures[mode].append(made.stats.decode_tps)
            shares[mode].append(SPENT[0] / made.stats.decode_s)
    off = statistics.median(figures["off"])
    print(f"# {time.strftime('%Y-%m-%d')} · {args.model} · an answer of {length} tokens · "
          f"{args.rounds} rounds · median decode t/s")
    print("| budget | -n | decode t/s | vs off | in the mechanism |\n|---|---|---|---|---|")
    for mode, (n, _) in modes.items():
        tps = statistics.median(figures[mode])
        print(f"| {mode} | {n} | {tps:.1f} | {tps / off:.3f} | "
              f"{100 * statistics.median(shares[mode]):.1f}% |")
    loaded.session.close()


if __name__ == "__main__":
    main()
