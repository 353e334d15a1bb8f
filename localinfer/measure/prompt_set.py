"""The labelled prompts the routing frontier is measured on, and how an answer is scored.

`data/routing_prompts.jsonl` holds short prompts in four kinds (question answering, extraction,
short reasoning, code), one JSON object a line: `id`, `kind`, `prompt` and, where the task has
one, `reference` (the exact value an extraction puts in its text, the computed result of an
arithmetic question, a fact). Every prompt asks for a short answer, so a small token budget
(48) decodes whole answers and a run over all of them stays within minutes on a laptop.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

from localinfer.errors import UsageError

KINDS = ("qa", "extraction", "reasoning", "code")
DEFAULT_FILE = "routing_prompts.jsonl"
MAX_BYTES = 4 << 20          # a prompt file is read whole: bound what a wrong path can cost
MAX_PROMPT_CHARS = 2000


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    prompt: str
    reference: str | None = None


def load(path: Path | None = None) -> list[Prompt]:
    """The shipped prompt set, or a file of the same shape; one clear UsageError if it is not."""
    if path is None:
        text = resources.files("localinfer").joinpath("data", DEFAULT_FILE).read_text("utf-8")
        return parse(text, DEFAULT_FILE)
    try:
        if path.stat().st_size > MAX_BYTES:
            raise UsageError(f"{path} is larger than {MAX_BYTES >> 20} MB; not a prompt set")
        return parse(path.read_text("utf-8"), str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {path}: {e}") from e


def parse(text: str, where: str) -> list[Prompt]:
    prompts, seen = [], set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        prompt = _row(line, f"{where}:{number}")
        if prompt.id in seen:
            raise UsageError(f"{where}:{number}: id {prompt.id!r} appears twice")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise UsageError(f"{where} holds no prompts")
    return prompts


def _row(line: str, where: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: not a JSON object: {e.msg}") from e
    if not isinstance(row, dict):
        raise UsageError(f"{where}: not a JSON object")
    fields = {k: row.get(k) for k in ("id", "kind", "prompt")}
    if not all(isinstance(v, str) and v.strip() for v in fields.values()):
        raise UsageError(f"{where}: needs id, kind and prompt as non-empty strings")
    if fields["kind"] not in KINDS:
        raise UsageError(f"{where}: kind {fields['kind']!r} is not one of {', '.join(KINDS)}")
    if len(fields["prompt"]) > MAX_PROMPT_CHARS:
        raise UsageError(f"{where}: prompt longer than {MAX_PROMPT_CHARS} characters")
    reference = row.get("reference")
    if reference is not None and not (isinstance(reference, str) and reference.strip()):
        raise UsageError(f"{where}: reference must be a non-empty string when given")
    return Prompt(fields["id"], fields["kind"], fields["prompt"], reference)


def select(prompts: Sequence[Prompt], count: int | None) -> list[Prompt]:
    """The first `count` prompts taken kind by kind in turn, so a short run covers every kind;
    None or a count past the set: all of them, in that interleaved order."""
    by_kind = [[p for p in prompts if p.kind == kind] for kind in KINDS]
    order = [p for row in _zip_longest(by_kind) for p in row]
    return order if count is None else order[:count]


def _zip_longest(groups: list[list[Prompt]]) -> list[list[Prompt]]:
    longest = max(len(g) for g in groups)
    return [[g[i] for g in groups if i < len(g)] for i in range(longest)]


# -- scoring --------------------------------------------------------------------------------------
def normalise(text: str) -> str:
    """NFC, case-folded, whitespace collapsed: the form two answers and a reference compare in."""
    return " ".join(unicodedata.normalize("NFC", text).casefold().split())


def same_answer(answer: str, oracle: str) -> bool:
    """Exact agreement with the oracle's answer; only surrounding whitespace is forgiven."""
    return answer.strip() == oracle.strip()


def matches_reference(answer: str, reference: str) -> bool:
    """The reference appears in the answer as a whole word (case and spacing aside): "29" in
    "Ingrid has 29 coins." but not in "290" or "2.29"."""
    ref = re.escape(normalise(reference))
    return re.search(rf"(?<![\w@.]){ref}(?![\w@]|\.\w)", normalise(answer)) is not None


def prefix_agreement(answer: Sequence[int], oracle: Sequence[int]) -> float:
    """Tokens the two answers share before they first differ, over the longer one's length: 1.0
    only for the same tokens. Greedy answers that differ once continue from different text, so
    tokens after the first difference are not compared."""
    longer = max(len(answer), len(oracle))
    if longer == 0:
        return 1.0
    same = 0
    for a, b in zip(answer, oracle):
        if a != b:
            break
        same += 1
    return same / longer
