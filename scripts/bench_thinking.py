"""What keeping a thinking model's trace apart costs decode: tokens/s of the same greedy
generation consumed three ways, alternated round by round in one process.

- plain:  the pieces as they come (a model without a trace);
- split:  every piece through the trace splitter (thinking/split.py), as `run` does for a
          thinking model; the model is treated as writing a trace that the prompt opened, so
          every piece goes through the trace's marker search, the splitter's slowest path;
- gate:   the split, and the trace gate (thinking/gate.py) asked about every token, as with
          --think-budget or --json-schema (its budget is beyond the reply, so nothing is forced).

The weights and the tokens are the same in all three (end-of-generation ignored, a fixed number
of tokens), so the difference is the split's own cost. Run:

    python scripts/bench_thinking.py [MODEL] [-n 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
from localinfer.engine.constrain import sampler_for
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.sampling import SamplingParams
from localinfer.thinking import setup
from localinfer.thinking.split import splitter
from localinfer.thinking.style import Style, Think


# Every piece is taken for trace text: the splitter's slowest path, a marker search per piece.
STYLE_OPENED = Style("tags", starts_inside=True)


def _generate(loaded, tokens, n: int, mode: str) -> float:
    """Decode tokens/s of one greedy generation of `n` tokens consumed as `mode` says."""
    session = loaded.session
    gate = setup.gate_for(session, STYLE_OPENED, Think(budget=n * 10), None) \
        if mode == "gate" else None
    made = Generation(KVCache(session, None), tokens,
                      sampler_for(SamplingParams(temperature=0), gate), Limits(n, ignore_eos=True))
    cut = splitter(STYLE_OPENED) if mode != "plain" else None
    for piece in made:
        if cut is not None:
            cut.feed(piece)
    if cut is not None:
        cut.flush()
    return made.stats.decode_tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("-n", type=int, default=256, help="tokens per generation")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-t", "--threads", type=int, default=0)
    args = parser.parse_args()
    from localinfer.backends import LoadOptions
    from localinfer.engine.prompt import raw_tokens
    from localinfer.pipeline.load import open_model
    loaded = open_model(str(common.model_file(args.model)),
                        LoadOptions(n_ctx=1024, n_threads=args.threads), backend="llama.cpp",
                        offline=True)
    tokens = raw_tokens(loaded.session, "Once upon a time, in a quiet village by the sea,")
    modes = ("plain", "split", "gate")
    figures: dict[str, list[float]] = {mode: [] for mode in modes}
    _generate(loaded, tokens, 16, "plain")                       # warm-up
    for _ in range(args.rounds):
        for mode in modes:
            figures[mode].append(_generate(loaded, tokens, args.n, mode))
    plain = statistics.median(figures["plain"])
    print(f"# {time.strftime('%Y-%m-%d')} · {args.model} · {args.n} tokens · "
          f"{args.rounds} rounds · median decode t/s")
    print("| consumer | decode t/s | vs plain |\n|---|---|---|")
    for mode in modes:
        tps = statistics.median(figures[mode])
        print(f"| {mode} | {tps:.1f} | {tps / plain:.3f} |")
    loaded.session.close()


if __name__ == "__main__":
    main()
