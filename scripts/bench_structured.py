"""Decode speed with and without a JSON schema, side by side in one run (docs/structured-output.md).

    python scripts/bench_structured.py MODEL.gguf [MODEL.gguf ...] [--rounds 5] [--tokens 200]
                                       [--llama-server]

Each round decodes the same prompt greedily twice on one loaded model: plain (a fixed number of
tokens, end of generation ignored) and constrained by a schema of several fields (until the
document is complete, at most the same number of tokens). Rounds alternate the two so that a
noisy machine slows both alike; the table gives median decode tokens/s, their ratio, and how
many constrained tokens needed a mask (the sampled token was rejected). `--llama-server` adds
the same two decodes through llama.cpp's own server (its grammar sampler, same prompt tokens,
same schema; built as scripts/bench_serve.py builds it), for llama.cpp's own ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import urllib.request
from pathlib import Path

import common  # scripts/common.py

from localinfer.backends import LoadOptions, get
from localinfer.engine.constrain import ConstrainedSampler
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.prompt import chat_tokens, raw_tokens
from localinfer.engine.sampling import SamplingParams, make_sampler
from localinfer.engine.structured import from_schema

PERSON = {"type": "object", "required": ["name", "age", "city", "occupation", "employed",
                                         "languages"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 30},
                         "occupation": {"type": "string", "maxLength": 40},
                         "employed": {"type": "boolean"},
                         "languages": {"type": "array", "minItems": 1, "maxItems": 3,
                                       "items": {"type": "string",
                                                 "enum": ["en", "fr", "de", "es"]}}}}
SCHEMA = {"type": "object", "required": ["people"],
          "properties": {"people": {"type": "array", "items": PERSON,
                                    "minItems": 5, "maxItems": 5}}}
QUESTION = "List five fictional people as JSON."
GREEDY = SamplingParams(temperature=0)


def prompt_for(session) -> list[int]:
    if session.chat_template:
        return chat_tokens(session, [{"role": "user", "content": QUESTION}])
    return raw_tokens(session, f"{QUESTION}\n")


def decode(session, tokens: list[int], n: int, gbnf: str | None) -> tuple[float, int, int]:
    """(decode tokens/s, tokens generated, tokens that needed a mask)."""
    if gbnf is None:
        sampler, limits = make_sampler(GREEDY), Limits(n, (), ignore_eos=True)
    else:
        sampler, limits = ConstrainedSampler(GREEDY, session.grammar(gbnf)), Limits(n)
    generation = Generation(KVCache(session, None), tokens, sampler, limits)
    for _ in generation:
        pass
    masked = sampler.constraint.masked if gbnf is not None else 0
    return generation.stats.decode_tps, generation.stats.generated_tokens, masked


def server_decode(url: str, tokens: list[int], n: int, schema: dict | None) -> float:
    """llama-server's own decode tokens/s for one /completion of these prompt tokens."""
    body = {"prompt": tokens, "n_predict": n, "temperature": 0, "cache_prompt": False}
    body.update({"json_schema": schema} if schema else {"ignore_eos": True})
    request = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())["timings"]["predicted_per_second"]


def bench(path: Path, rounds: int, n: int, with_server: bool) -> dict:
    session = get("llama.cpp").load(path, LoadOptions(n_ctx=2048))
    gbnf = from_schema(SCHEMA, "bench").gbnf
    tokens = prompt_for(session)
    runs: dict[str, list[float]] = {k: [] for k in ("plain", "schema", "server", "server_schema")}
    facts = (0, 0)
    server = None
    if with_server:
        from bench_serve import start
        server = start("llama-server", "", path, 1, 2048)
    try:
        for _ in range(rounds):
            runs["plain"].append(decode(session, tokens, n, None)[0])
            tps, *facts = decode(session, tokens, n, gbnf)
            runs["schema"].append(tps)
            if server:
                runs["server"].append(server_decode(server[1], tokens, n, None))
                runs["server_schema"].append(server_decode(server[1], tokens, n, SCHEMA))
    finally:
        session.close()
        if server:
            server[0].terminate()
    med = {k: statistics.median(v) if v else 0.0 for k, v in runs.items()}
    return {"model": path.name, **med, "tokens": facts[0], "masked": facts[1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=common.gguf_file)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--llama-server", action="store_true", help="llama.cpp's own server too")
    args = ap.parse_args()
    print("| model | plain decode | with the schema | ratio | tokens (masked) "
          "| llama-server plain | with the schema | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for path in args.models:
        r = bench(path, args.rounds, args.tokens, args.llama_server)
        theirs = (f"{r['server']:.1f} t/s | {r['server_schema']:.1f} t/s | "
                  f"{r['server_schema'] / r['server']:.2f}x" if r["server"] else "– | – | –")
        print(f"| {r['model']} | {r['plain']:.1f} t/s | {r['schema']:.1f} t/s | "
              f"{r['schema'] / r['plain']:.2f}x | {r['tokens']} ({r['masked']}) | {theirs} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
