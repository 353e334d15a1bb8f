"""`serve --reuse-answers`: a deterministic request answered before is answered from the answer
store (cache/answers.py says what is stored and how it is keyed), in every API the server speaks.

The store sits below the APIs, at the job: each API prepares its job as before
(server/requests.py), then server/jobs.py (and server/completions.py for /v1/completions) asks
`slots` where each job's answer is stored. A job found there is not submitted: `replayed` fills it
as the scheduler would have (text, tokens, log-probabilities, figures) and gives the text pieces it
streamed then, which go to the reply in their order and sizes, so every API's chunks carry the
same pieces as the original's did. A job not found is decoded with its pieces recorded
(`recording`) and stored once it ends whole (not cancelled, not failed).

The key is run's and map's (the model's identity, the prompt's tokens after the template, the
sampling, stop strings, max tokens, logprobs asked for, the thinking budget) with what decides the
grammar here, the request's schema and tools as sent (`Decides`), and the decode path (`serve`
with its --parallel: another batch shape can part at a near tie). Only deterministic requests:
greedy, or sampled with a fixed seed.

A save goes to a thread of its own (the scheduler's thread does no disk work), and a lookup of a
key still being saved waits for that save: an answer whose reply has ended is found by the next
request, however soon it comes.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from localinfer.cache import answers
from localinfer.cache.answers import Answer, AnswerStore
from localinfer.engine.sampling import SamplingParams
from localinfer.pipeline.reuse import fill_job

HEADER = "X-Localinfer-Reused"          # "1" on a reply every answer of which was replayed
SAVE_WAIT_SECONDS = 10.0                # the longest a lookup waits for its key's save
_SAVES = ThreadPoolExecutor(1, thread_name_prefix="localinfer-answer-store")
_saving: dict[str, Future] = {}         # key: its save not yet done
_saving_lock = threading.Lock()


@dataclass(frozen=True)
class Decides:
    """What decides a prepared job's answer besides its tokens and limits: the sampling, what
    its grammar is made from (the schema and tools as the request sent them, in their order,
    which the grammar keeps), the thinking budget, and chat (a template, a thinking trace told
    apart) or not."""

    params: SamplingParams
    grammar: str | None
    think_budget: int | None
    chat: bool


def decides(body: dict, params: SamplingParams, schema, budget: int | None,
            chat: bool) -> Decides | None:
    """None for a request with media (an image, a sound): its tokens do not say which, so it
    has no key and is always decoded."""
    if _has_media(body.get("messages")):
        return None
    made_of = {k: body[k] for k in ("tools", "tool_choice", "parallel_tool_calls")
               if body.get(k) is not None}
    if schema is not None:
        made_of["schema"] = schema
    return Decides(params, json.dumps(made_of) if made_of else None, budget, chat)


def _has_media(messages) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in m["content"])
        for m in messages)


def normalised(messages: list[dict]) -> list[dict]:
    """A chat's turns as `--reuse-answers` sends them (cache/answers.py's normalise): every text
    in Unicode NFC, a system or user turn without whitespace at its ends."""
    out = []
    for m in messages:
        content = m["content"]
        content = answers.normalise(content) if m["role"] in ("system", "user") \
            else answers.nfc(content)
        out.append({**m, "content": content})
    return out


def nfc(prompt: str) -> str:
    """A raw prompt as `--reuse-answers` sends it: Unicode NFC, its ends kept (a completion
    continues the text exactly where it ends: a space there is meaning)."""
    return answers.nfc(prompt)


@dataclass(frozen=True)
class Slot:
    """One job's place in the store, and the answer found there (None: to be decoded)."""

    store: AnswerStore
    key: str
    answer: Answer | None


def slots(seen, prepared: list) -> list[Slot | None]:
    """Each prepared job's slot; None for one not reused (the server does not reuse answers, the
    request is not deterministic or not keyed). Blocking: reads the store."""
    if not getattr(seen, "reuse_answers", False):
        return [None] * len(prepared)
    store = answers.open_for(seen.session, notify=seen.log)
    return [_slot(seen, store, p) for p in prepared]


def _slot(seen, store: AnswerStore, prepared) -> Slot | None:
    said: Decides | None = getattr(prepared, "decides", None)
    if said is None:
        return None
    job = prepared.job
    settings = answers.settings_of(
        said.params, job.limits, via=f"serve/{seen.worker.batch.n_seq - 1}",
        n_ctx=seen.request_ctx, gbnf=said.grammar, think_budget=said.think_budget,
        raw=not said.chat, draft="none", draft_max=0)
    if settings is None:
        return None
    key = store.key(job.prompt, settings)
    with _saving_lock:
        pending = _saving.get(key)
    if pending is not None:
        try:
            pending.result(timeout=SAVE_WAIT_SECONDS)
        except Exception:           # a save that failed stored nothing: decoded again
            pass
    return Slot(store, key, store.lookup(key))


def replayed(job, answer: Answer) -> tuple[str, ...]:
    """`job` filled from the stored answer as the scheduler fills a job it decoded (marked
    `reused`); the text pieces, in the order and sizes they streamed when it was decoded."""
    fill_job(job, answer)
    return answer.pieces


def recording(job, slot: Slot, on_text: Callable[[str], None],
              on_done: Callable, stored: Callable[[], None] = lambda: None):
    """(on_text, on_done) for the worker: `job`'s pieces kept as they stream, and its answer
    stored when it ends whole (`stored` told then), before `on_done` hears of it."""
    pieces: list[str] = []

    def text(piece: str) -> None:
        pieces.append(piece)
        on_text(piece)

    def done(finished) -> None:
        whole = finished.error is None and not finished.cancelled and \
            finished.stats.finish_reason in answers.FINISHES
        if whole:
            _save(slot, _answer_of(finished, pieces), stored)
        on_done(finished)
    return text, done


def _answer_of(job, pieces: list[str]) -> Answer:
    logprobs = None if job.limits.logprobs is None else tuple(
        (int(r.token), float(r.logprob), tuple((int(i), float(lp)) for i, lp in r.top))
        for r in job.logprobs)
    stats = job.stats
    return Answer(tuple(pieces), tuple(int(t) for t in job.tokens), stats.finish_reason,
                  stats.stop_string, stats.closed_at, logprobs)


def _save(slot: Slot, answer: Answer, stored: Callable[[], None]) -> None:
    def save() -> None:
        try:
            if slot.store.save(slot.key, answer) is not None:
                stored()
        finally:
            with _saving_lock:
                if _saving.get(slot.key) is future:
                    del _saving[slot.key]
    with _saving_lock:
        future = _SAVES.submit(save)
        _saving[slot.key] = future


def reused(jobs) -> bool:
    """Whether every one of a reply's jobs was answered from the store."""
    jobs = list(jobs)
    return bool(jobs) and all(getattr(job, "reused", False) for job in jobs)


def usage(*jobs) -> dict:
    """The usage block's extra fields: `reused` when every answer of the reply was replayed,
    `routed_to` and `routing` when a router chose its model (server/routers.py)."""
    routed = next((job for job in jobs if getattr(job, "routed_to", None)), None)
    return ({"reused": True} if reused(jobs) else {}) | \
        ({"routed_to": routed.routed_to, "routing": routed.routing} if routed else {})


def headers(jobs) -> dict[str, str]:
    return {HEADER: "1"} if reused(jobs) else {}
