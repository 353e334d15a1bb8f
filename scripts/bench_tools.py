"""Decode speed of an answer constrained to a tool call against a plain chat answer, side by side
through serve's own path (docs/tool-calls.md).

    python scripts/bench_tools.py [MODEL ...] [--rounds 5] [--tokens 256] [--no-hermes]

What is measured is what `serve` runs for /v1/chat/completions, minus HTTP: the request body
checked and made into a job by server/requests.py (template, tools, grammar), the job run by
server/worker.py's Worker on a BatchSession loaded as `serve` loads it, its text split into
calls by server/tools.py. All greedy. A tool call is asked for with tool_choice "required" (two
tools: the grammar allows a call of either) and with tool_choice naming one tool, whose
arguments are a few string and number fields (the call takes 60 to 100 tokens);
parallel_tool_calls is false, so that the answer is one call. Each is paired with its plain
decode: the same job, the same prompt (the tools described in it), without the grammar, for as
many tokens. A plain answer to a prompt without tools would compare context lengths too (a
chat's tools add some 270 tokens to the prompt, and each decode step attends to them). Each
round runs the two pairs, the first of each pair the call in even rounds and the plain decode in
odd ones, so a noisy machine slows both alike; the ratio is the median of the pairs' ratios.
Each round also decodes a story (a prompt with no tools, --tokens tokens) for reference. The
table gives median decode tokens/s, the ratios, the calls' tokens, and how many calls were
whole and valid against their tool's schema (and how many the budget closed early).

The models are catalogue names or paths (default: the two test models, found offline in the
store LOCALINFER_HOME names). A model whose file has no chat template (a base model: Gemma 3
270M's has none) wears its family's instruct template from tests/chat_templates.py. Neither
SmolLM2's nor Gemma 3's template has tools, so both get llama.cpp's generic JSON format; unless
--no-hermes, a last row has SmolLM2 wearing Qwen 2.5's published template, whose tools use the
Hermes <tool_call> format.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import common

STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
TICKET = {"type": "object", "required": ["title", "description", "component", "priority",
                                         "estimate_hours", "reporter"],
          "properties": {"title": {"type": "string", "maxLength": 60},
                         "description": {"type": "string", "maxLength": 240},
                         "component": {"type": "string", "maxLength": 30},
                         "priority": {"type": "integer"}, "estimate_hours": {"type": "number"},
                         "reporter": {"type": "string", "maxLength": 30}}}
SEARCH = {"type": "object", "required": ["query"],
          "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "create_ticket", "parameters": TICKET,
                                           "description": "File a bug ticket in the tracker"}},
         {"type": "function", "function": {"name": "search_tickets", "parameters": SEARCH,
                                           "description": "Search the tracker's tickets"}}]
BUG = [{"role": "user", "content": "File a ticket: the login page of the billing app crashes "
        "when the password has an emoji. Describe the steps to reproduce it in detail."}]
KINDS = {"story": {"messages": STORY},
         "required": {"messages": BUG, "tools": TOOLS, "tool_choice": "required",
                      "parallel_tool_calls": False},
         "named": {"messages": BUG, "tools": TOOLS, "parallel_tool_calls": False,
                   "tool_choice": {"type": "function", "function": {"name": "create_ticket"}}}}
SCHEMAS = {"create_ticket": TICKET, "search_tickets": SEARCH}
CHOICES = ("required", "named")


class Model:
    """One model loaded as `serve` loads it, with its Worker."""

    def __init__(self, model: str, threads: int, ctx: int) -> None:
        from localinfer.fit.options import FitOptions
        from localinfer.pipeline import load
        from localinfer.server.worker import Worker
        fit = FitOptions(ctx=ctx, offline=True)
        ref, self.batch = load.open_batch(load.name(model, fit), fit, parallel=1, shared=True,
                                          threads=threads, backend="llama.cpp")
        self.name = ref.display
        self.worker = Worker(self.batch, 2, None, self.batch.n_ctx)

    def answer(self, kind: str, tokens: int, *, free: bool = False) -> dict:
        """One request of `kind` through the worker: its decode rate, tokens and calls. `free`:
        the same job (the same prompt, tools and all) without its grammar, decoding exactly
        `tokens` tokens: the plain decode the constrained one is compared with."""
        from dataclasses import replace

        from localinfer.engine.sampling import SamplingParams, make_sampler
        from localinfer.server import requests, tools
        body = {"model": self.name, "temperature": 0, "max_tokens": tokens, **KINDS[kind]}
        prepared = requests.prepare(json.dumps(body).encode(), self.batch.session,
                                    (self.name,), self.batch.n_ctx, chat=True)
        job = prepared.job
        if free:
            job.sampler = make_sampler(SamplingParams(temperature=0))
            job.limits = replace(job.limits, ignore_eos=True)
        done = threading.Event()
        assert self.worker.submit(job, lambda _: done.set())
        done.wait()
        if job.error:
            raise RuntimeError(f"{self.name} {kind}: {job.error}")
        _, calls = tools.split(prepared.tools, job.text)
        return {"tps": job.stats.decode_tps, "tokens": job.stats.generated_tokens,
                "valid": not free and _valid(calls), "closed": job.stats.closed_at >= 0}

    def close(self) -> None:
        self.worker.stop()
        self.batch.close()


def _valid(calls: list[dict]) -> bool:
    """One call, whole, its arguments valid against its tool's schema."""
    import jsonschema
    if len(calls) != 1:
        return False
    fn = calls[0]["function"]
    try:
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
    except jsonschema.ValidationError:
        return False
    return True


def bench(model: str, label: str, rounds: int, tokens: int, threads: int) -> dict:
    """Rounds of: the story, and for each tool_choice its call and the same prompt decoded
    freely for as many tokens (greedy: the warm-up run says how many), the pair's order turned
    around each round."""
    loaded = Model(model, threads, ctx=2048)
    runs: dict[str, list[dict]] = {k: [] for k in ("story", *CHOICES,
                                                   *(f"{c}_free" for c in CHOICES))}
    ratios: dict[str, list[float]] = {k: [] for k in CHOICES}
    try:
        loaded.answer("story", 16)                                  # warm-up, uncounted
        length = {k: loaded.answer(k, tokens)["tokens"] for k in CHOICES}
        for r in range(rounds):
            runs["story"].append(loaded.answer("story", tokens))
            for kind in CHOICES:
                if r % 2:
                    free = loaded.answer(kind, length[kind], free=True)
                    called = loaded.answer(kind, tokens)
                else:
                    called = loaded.answer(kind, tokens)
                    free = loaded.answer(kind, length[kind], free=True)
                runs[kind].append(called)
                runs[f"{kind}_free"].append(free)
                ratios[kind].append(called["tps"] / free["tps"])
            said = ", ".join(f"{k} {ratios[k][-1]:.2f}x" for k in CHOICES)
            print(f"{label}: round {r + 1} of {rounds}: {said}", file=sys.stderr, flush=True)
    finally:
        loaded.close()
    row = {"model": label, "format": _format(loaded.batch.session), "rounds": rounds}
    for kind, results in runs.items():
        row[kind] = statistics.median(x["tps"] for x in results)
        row[f"{kind}_tokens"] = statistics.median(x["tokens"] for x in results)
        row[f"{kind}_valid"] = sum(x["valid"] for x in results)
        row[f"{kind}_closed"] = sum(x["closed"] for x in results)
    for kind in CHOICES:
        row[f"{kind}_ratio"] = statistics.median(ratios[kind])
    return row


def _format(session) -> str:
    from localinfer.engine import toolcalls
    found = toolcalls.format_of(session.chat_template or "")
    return getattr(found, "name", found)        # a format object, or (before) its name


def rows(models: list[str], hermes: bool, directory: Path) -> list[tuple[str, str]]:
    """(GGUF path, label) of each row: each model as itself, or, where its file has no chat
    template (a base model, as Gemma 3 270M is), wearing its family's instruct template from
    tests/chat_templates.py; with `hermes`, SmolLM2 wearing Qwen 2.5's template too."""
    common.use_tests()
    from chat_templates import QWEN25, REAL
    from gguf_patch import add_value, set_value

    from localinfer.gguf.header import read_header
    key, out = "tokenizer.chat_template", []
    for model in models:
        path = common.model_file(model)
        metadata = read_header(path).metadata
        family = str(metadata.get("general.architecture", ""))
        if key in metadata or family not in REAL:
            out.append((str(path), model))
            continue
        dressed = add_value(path, directory / f"{family}-it.gguf", key, REAL[family], 8)
        out.append((str(dressed), f"{model} ({family} template)"))     # 8: a GGUF string
    if hermes:
        smollm = common.model_file("smollm2")
        out.append((str(set_value(smollm, directory / "smollm2-qwen25.gguf", key, QWEN25)),
                    "smollm2 (Qwen 2.5 template)"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("models", nargs="*", default=["smollm2", "gemma-3-270m"],
                    help="catalogue names or GGUF paths (default: the two test models)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each a story and two pairs (default 5)")
    ap.add_argument("--tokens", type=int, default=256,
                    help="max_tokens of each answer (default 256: room for a call to end by "
                    "itself; fewer, and the closing's cost near the limit is measured too)")
    ap.add_argument("--threads", type=int, default=0,
                    help="0: localinfer's default; on a machine busy with other jobs, 1 keeps "
                    "llama.cpp's threads from waiting on each other (docs/tool-calls.md used 1)")
    ap.add_argument("--no-hermes", action="store_true",
                    help="without the row of SmolLM2 wearing Qwen 2.5's template")
    args = ap.parse_args()
    from localinfer.errors import LocalinferError
    from localinfer.server.errors import BadRequest
    with tempfile.TemporaryDirectory() as work:
        measured = rows(args.models, not args.no_hermes, Path(work))   # a missing one: one line
        print("| model | tool format | required: plain / constrained | ratio | named: plain / "
              "constrained | ratio | tokens required / named | calls valid (closed early) "
              "| story, no tools in the prompt |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
        for model, label in measured:
            try:
                r = bench(model, label, args.rounds, args.tokens, args.threads)
            except (LocalinferError, BadRequest) as e:  # no chat template, say: one line
                raise SystemExit(f"error: {label}: {e}") from None
            valid = " / ".join(f"{r[f'{k}_valid']} ({r[f'{k}_closed']})" for k in CHOICES)
            pairs = " | ".join(f"{r[f'{k}_free']:.1f} / {r[k]:.1f} t/s | {r[f'{k}_ratio']:.2f}x"
                               for k in CHOICES)
            print(f"| {r['model']} | {r['format']} | {pairs} "
                  f"| {r['required_tokens']:.0f} / {r['named_tokens']:.0f} "
                  f"| {valid} of {r['rounds']} | {r['story']:.1f} t/s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
