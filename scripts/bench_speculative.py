"""The speculation table of docs/speculative-decoding.md: plain vs speculative decoding,
alternating, medians of ratios.

    LOCALINFER_HOME=... python scripts/bench_speculative.py [N_GEN] [REPETITIONS] [--long] > results.jsonl

Runs both test models with prompt lookup (adaptive, and fixed-length to show what adaptivity saves)
and the same-model draft (made once with the quantizer); one JSON line per (model, drafter).
`--long` measures adaptive lookup (`auto`) on one long grounded prompt instead: the bundled text's
first 8,000 characters (about 2,000 tokens) and its last paragraph to copy.
"""

from __future__ import annotations

import argparse
import json
import sys

import common  # scripts/common.py

from localinfer.backends import LoadOptions
from localinfer.engine.load import load_model
from localinfer.measure import speculation
from localinfer.speculate import choose

MODELS = ("smollm2", "gemma-3-270m")
# `auto` is adaptive lookup for these two (the catalogue names no draft model for them).
DRAFTERS = (("lookup", True), ("lookup", False), ("self", True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n_gen", type=int, nargs="?", default=96, help="most tokens generated")
    parser.add_argument("repetitions", type=int, nargs="?", default=5, help="timed repetitions")
    parser.add_argument("--long", action="store_true", help="one long grounded prompt")
    args = parser.parse_args()
    n_gen, reps = args.n_gen, args.repetitions
    options = LoadOptions(n_ctx=4096 if args.long else 1024)
    for name in MODELS:
        ref, path = common.locate(name, notify=common.to_stderr)
        loaded = load_model(ref, path, backend="auto", options=options)
        tasks = {"long copy": speculation.long_task(loaded, _document())} if args.long else None
        for choice, adaptive in DRAFTERS[:1] if args.long else DRAFTERS:
            drafter = choose.open_drafter(choice, loaded, options=options, offline=True,
                                            notify=lambda m: print(m, file=sys.stderr))
            result = speculation.measure(loaded, drafter, n_gen=n_gen, repetitions=reps,
                                        adaptive=adaptive, tasks=tasks,
                                        progress=lambda m: print(m, file=sys.stderr, flush=True))
            result["choice"] = choice
            print(json.dumps(result), flush=True)
            drafter.close()
        loaded.session.close()


def _document() -> str:
    from importlib import resources
    text = resources.files("localinfer").joinpath("data", "alice_ch1-3.txt").read_text("utf-8")
    return text[:8000].rsplit("\n\n", 1)[0]


if __name__ == "__main__":
    main()
