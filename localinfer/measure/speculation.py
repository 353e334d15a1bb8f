"""`localinfer bench --draft D`: decode speed with and without speculation, side by side.

Plain and speculative runs alternate on the same loaded model (A B A B …), so a machine whose load
changes during the benchmark slows both alike; we report medians and check that the greedy outputs
are identical. Three tasks grounded in their input, where the output copies from the prompt and
drafting pays (a rewrite, an extraction, a code edit), and one open-ended, where guesses are mostly
rejected and adaptivity must hold the line.
"""

from __future__ import annotations

import statistics
from typing import Callable

from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.load import LoadedModel
from localinfer.engine.prompt import chat_tokens, raw_tokens, uses_chat_template
from localinfer.engine.sampling import SamplingParams, make_sampler
from localinfer.speculate import choose
from localinfer.speculate.drafters import Drafter

PARAGRAPH = ("The quick brwon fox jumpd over the lazzy dog. It was a sunny day and the birds wer "
             "singing in the trees. Evry morning the fox went to the river to drink watter, and "
             "evry evening it came back to its den under the old oak tree.")
MESSAGE = ("Hi all, the review moved to Thursday. Please confirm with Maria Lopez "
           "(maria.lopez@example.org) or Tom Becker (tom.becker@example.org). Anna Smith "
           "(anna.smith@example.org) brings the slides, and Omar Haddad (omar.haddad@example.org) "
           "books the room. Questions go to Lena Park (lena.park@example.org).")
CODE = ("def summarize(orders):\n"
        "    total = 0\n"
        "    for order in orders:\n"
        "        if order.paid:\n"
        "            total += order.amount\n"
        "    average = total / len(orders) if orders else 0\n"
        "    return {\"total\": total, \"average\": average, \"count\": len(orders)}\n")
CHAT_TASKS = {
    "rewrite": f"Fix the typos in this paragraph and write it out again:\n\n{PARAGRAPH}",
    "extract": ("List every person in this message with their email address, one per line as "
                f"Name <email>:\n\n{MESSAGE}"),
    "code edit": ("Rename the variable total to paid_total in this Python function and write the "
                  f"whole function out again:\n\n```python\n{CODE}```"),
    "open": "Write a short story about a robot who learns to paint.",
}
# Base models continue text: the same tasks written as completions, and a story opening.
BASE_TASKS = {
    "rewrite": (f"Original: {PARAGRAPH}\nCopy without changes: The quick brwon fox jumpd over"),
    "extract": f"Message: {MESSAGE}\n\nEvery person and email address in the message:\n- Maria",
    "code edit": (f"Before:\n```python\n{CODE}```\n\nAfter renaming total to paid_total:\n"
                  "```python\ndef summarize(orders):\n"),
    "open": "Once upon a time, in a small village by the mountains,",
}
GREEDY = SamplingParams(temperature=0)


def tasks_for(loaded: LoadedModel) -> dict[str, list[int]]:
    session = loaded.session
    if uses_chat_template(session, raw=False):
        return {name: chat_tokens(session, [{"role": "user", "content": text}])
                for name, text in CHAT_TASKS.items()}
    return {name: raw_tokens(session, text) for name, text in BASE_TASKS.items()}


def long_task(loaded: LoadedModel, document: str) -> list[int]:
    """A long grounded prompt: a document (2,000 tokens and more) and its last paragraph to
    copy, as a chat request or, for a base model, as a completion."""
    session = loaded.session
    last = document.rstrip().rsplit("\n\n", 1)[-1]
    if uses_chat_template(session, raw=False):
        request = f"{document}\n\nWrite out the last paragraph of the text above word for word."
        return chat_tokens(session, [{"role": "user", "content": request}])
    return raw_tokens(session, f"{document}\n\nThe last paragraph again:\n{last[:40]}")


def measure(loaded: LoadedModel, drafter: Drafter, *, n_gen: int, repetitions: int,
            max_draft: int = 8, adaptive: bool = True,
            progress: Callable[[str], None] | None = None,
            tasks: dict[str, list[int]] | None = None,
            notify: Callable[[str], None] | None = None) -> dict:
    """`tasks`: prompts (tokens) by name; tasks_for's by default. `notify` hears one line before
    the exactness probe, when it must run first."""
    cache = KVCache(loaded.session)
    chunk = choose.exact_chunk(loaded, notify=notify)
    results = {}
    for name, prompt in (tasks or tasks_for(loaded)).items():
        plain, spec, identical, last = [], [], True, None
        for rep in range(repetitions + 1):          # rep 0 warms up and is not counted
            a = _run(loaded, cache, prompt, None, n_gen, max_draft, chunk, adaptive)
            b = _run(loaded, cache, prompt, drafter, n_gen, max_draft, chunk, adaptive)
            identical &= a.tokens == b.tokens
            if rep == 0:
                continue
            plain.append(a.stats.decode_tps)
            spec.append(b.stats.decode_tps)
            last = b.stats
            if progress:
                progress(f"{name} {rep}/{repetitions}: plain {a.stats.decode_tps:.1f} t/s, "
                         f"speculative {b.stats.decode_tps:.1f} t/s")
        assert last is not None
        results[name] = {
            "plain_tps": round(statistics.median(plain), 2),
            "speculative_tps": round(statistics.median(spec), 2),
            "ratio": round(statistics.median(s / p for s, p in zip(spec, plain)), 3),
            "identical_greedy_output": identical, "tokens": last.generated_tokens,
            "drafted": last.drafted, "accepted": last.accepted,
            "acceptance": round(last.acceptance, 3)}
    return {"model": loaded.ref.display, "drafter": drafter.name, "adaptive": adaptive,
            "verify_chunk": chunk,
            "n_gen": n_gen, "repetitions": repetitions, "tasks": results}


def _run(loaded, cache, prompt, drafter, n_gen, max_draft, chunk, adaptive=True):
    cache.clear()            # each run starts cold, so neither side profits from the other's cache
    limits = Limits(max_tokens=n_gen)
    if drafter is None:
        gen = Generation(cache, prompt, make_sampler(GREEDY), limits)
    else:
        gen = choose.speculative(loaded, cache, prompt, GREEDY, limits, drafter,
                                 max_draft=max_draft, chunk=chunk, adaptive=adaptive)
    for _ in gen:
        pass
    return gen
