"""The cost table of docs/logprobs.md: greedy decode speed with log-probabilities against without,
alternating within each repetition, on both test models.

    LOCALINFER_HOME=... python scripts/bench_logprobs.py [N_GEN] [REPETITIONS] [--top N] > results.jsonl

One JSON line per model: decode tokens/s without and with `--top` alternatives (medians, ranges),
and the median of the repetitions' ratios.
"""

from __future__ import annotations

import argparse
import json
import sys

import common  # scripts/common.py

from localinfer.backends import LoadOptions
from localinfer.engine.load import load_model
from localinfer.measure.bench import logprobs_cost

MODELS = ("smollm2", "gemma-3-270m")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n_gen", type=int, nargs="?", default=128, help="tokens decoded per run")
    parser.add_argument("repetitions", type=int, nargs="?", default=5, help="timed repetitions")
    parser.add_argument("--top", type=int, default=5, help="alternatives per token (0 to 20)")
    args = parser.parse_args()
    for name in MODELS:
        ref, path = common.locate(name, notify=common.to_stderr)
        loaded = load_model(ref, path, backend="auto",
                            options=LoadOptions(n_ctx=args.n_gen + 64))
        result = logprobs_cost(loaded, top=args.top, n_gen=args.n_gen,
                               repetitions=args.repetitions,
                               progress=lambda m: print(m, file=sys.stderr, flush=True))
        print(json.dumps(result), flush=True)
        loaded.session.close()


if __name__ == "__main__":
    main()
