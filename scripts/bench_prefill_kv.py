"""Prefill speed of llama.cpp's 16-bit KV cache with bf16 K (the exact cache) against f16 K (the one
a long prompt gets), at several prompt lengths. The table in docs/speculative-decoding.md.

    python scripts/bench_prefill_kv.py MODEL.gguf [MODEL.gguf ...] [--lengths 512 2048 4096 8000]

One process per model and cache; each length is one `eval` of the first N tokens of the bundled
text after a reset, in a context of 8,192 tokens.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import common  # scripts/common.py

_ONE = """
import sys, time
from pathlib import Path
from localinfer.backends import LoadOptions
from localinfer.backends.llama import session as llama_cpp, steer
from localinfer.measure import quality
steer.available = lambda: False     # the two caches of a backend that cannot be steered (kv.py)
model, f16_k, lengths = Path(sys.argv[1]), sys.argv[2] == "f16", [int(n) for n in sys.argv[3:]]
session = llama_cpp.LlamaCppSession(model, LoadOptions(n_ctx=8192, long_prompt=f16_k))
tokens = session.tokenize(quality.default_text() * 3, special=False)
for n in lengths:
    session.reset()
    start = time.perf_counter()
    session.eval(tokens[:n])
    print(n, n / (time.perf_counter() - start), flush=True)
"""


def rates(model: Path, k: str, lengths: list[int]) -> dict[int, float]:
    out = subprocess.run([sys.executable, "-c", _ONE, str(model), k, *map(str, lengths)],
                         capture_output=True, text=True, check=True).stdout
    return {int(n): float(r) for n, r in (line.split() for line in out.splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=common.gguf_file)
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048, 4096, 8000])
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, t/s of one prefill")
    print("| model | N | bf16 K / f16 V, t/s | f16 K / f16 V, t/s | bf16 / f16 |")
    print("|---|---:|---:|---:|---:|")
    for model in args.models:
        bf16, f16 = rates(model, "bf16", args.lengths), rates(model, "f16", args.lengths)
        for n in args.lengths:
            print(f"| {model.name} | {n:,} | {bf16[n]:.0f} | {f16[n]:.0f} | {bf16[n] / f16[n]:.2f} |")


if __name__ == "__main__":
    main()
