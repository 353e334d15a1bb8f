"""Answers not decoded twice (cache/answers.py says what is stored and keyed):

- `run` and the Python API with `--reuse-answers` (`Ask.reuse`): a deterministic request found in
  the answer store is replayed (`Replay`: the same pieces, the figures saying nothing was
  decoded); one not found is decoded and stored as it streamed (`Recorded`).
- `map`: a line whose request repeats one under way or answered earlier in the input is not
  decoded again but given that answer (`MapReuse`), whatever the flag; with it, lines are also
  looked up in and added to the store.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from localinfer.cache import answers
from localinfer.cache.answers import Answer, AnswerStore
from localinfer.engine.decode import Stats
from localinfer.engine.logprobs import TokenLogprob
from localinfer.units import ago

# map keeps the answers of earlier lines, for lines that repeat them later, up to this many bytes
# of text (least recently used dropped first): an input of a million lines is never held whole.
MAP_RECENT_BYTES = 32 << 20


@dataclass(frozen=True)
class Slot:
    """One request's place in the store."""

    store: AnswerStore
    key: str
    settings: dict | None = None        # what the key holds besides the model and tokens


def slot_for(session, tokens, ask, *, raw: bool, via: str = "single",
             notify: Callable[[str], None] = lambda line: None) -> Slot | None:
    """Where `run`'s request (pipeline.Ask) is stored; None when it is not deterministic."""
    settings = answers.settings_of(
        ask.params, ask.limits, via=via, n_ctx=session.n_ctx,
        gbnf=ask.output.gbnf if ask.output else None, think_budget=ask.think.budget, raw=raw,
        draft=ask.draft, draft_max=ask.draft_max)
    if settings is None:
        return None
    store = answers.open_for(session, notify=notify)
    return Slot(store, store.key(tokens, settings), settings)


def reusing(session, tokens, ask, build: Callable[[int], object], *, raw: bool,
            notify: Callable[[str], None] = lambda line: None, prompt=None,
            offline: bool = False):
    """The generation `build(draft_max)` makes, replayed from the store when it holds the answer
    (built with no drafter: none is opened for a replay), or recorded into it; as built when the
    request does not reuse answers or is not deterministic. With `ask.similar` and the request's
    `prompt` (engine.prompt.PromptText), a request not stored is matched by meaning among those
    that differ from it in the user's text alone (pipeline/similar.py)."""
    slot = slot_for(session, tokens, ask, raw=raw, notify=notify) if ask.reuse else None
    stored = slot.store.lookup(slot.key) if slot else None
    probe = match = None
    similar_ = getattr(ask, "similar", None)
    if slot and stored is None and similar_ is not None and prompt is not None:
        from localinfer.pipeline import similar
        probe = similar.probe_for(session, slot, prompt, similar_, offline=offline,
                                  notify=notify)
        if probe is not None:
            match, stored = similar.find(probe, slot.store, similar_.threshold)
    made = build(0 if stored else ask.draft_max)
    if stored:
        return Replay(made, stored, match, similar_.threshold if match else None)
    return Recorded(made, slot, probe) if slot else made


def normalised(request):
    """A fit.Request whose prompt text is normalised (answers.normalise), the piped part that
    --truncate may cut kept where it was."""
    prompt = request.prompt
    head, tail = answers.nfc(prompt.text[:prompt.cuttable]), answers.nfc(prompt.text[prompt.cuttable:])
    joined = head + tail
    text = joined.strip()
    cut = max(0, min(len(head) - (len(joined) - len(joined.lstrip())), len(text)))
    system = answers.normalise(prompt.system) if prompt.system is not None else None
    return replace(request, prompt=replace(prompt, text=text, cuttable=cut, system=system))


class ReusedStats(Stats):
    """A replayed answer's figures: its length and end as decoded, and no decode; for a match by
    meaning, its cosine similarity and the stored prompt it was made for."""

    reused_from: str = ""
    similarity: float | None = None
    reused_prompt: str = ""

    def as_dict(self) -> dict:
        similar = {} if self.similarity is None else {
            "similarity": round(self.similarity, 6), "reused_prompt": self.reused_prompt}
        return super().as_dict() | {"reused": True, "reused_from": self.reused_from} | similar


class Replay:
    """A stored answer in a generation's place: iterate for the pieces it streamed then."""

    reused_from: str

    def __init__(self, made, answer: Answer, match=None, threshold: float | None = None) -> None:
        self.cache, self.prompt, self.limits = made.cache, made.prompt, made.limits
        self.style, self.answer, self.reused_from = made.style, answer, answer.entry
        self.stats = ReusedStats(prompt_tokens=len(made.prompt),
                                 generated_tokens=len(answer.tokens),
                                 finish_reason=answer.finish_reason,
                                 stop_string=answer.stop_string, closed_at=answer.closed_at)
        self.stats.reused_from = answer.entry
        self.match, self.threshold = match, threshold      # a cache.semantic.Match, or None
        if match is not None:
            self.stats.similarity, self.stats.reused_prompt = match.similarity, match.prompt
        self.tokens = list(answer.tokens)
        self.logprobs = [TokenLogprob(t, lp, top) for t, lp, top in answer.logprobs or ()]

    def __iter__(self):
        start = time.perf_counter()
        for n, piece in enumerate(self.answer.pieces):
            if n == 0:
                self.stats.ttft_s = time.perf_counter() - start
            yield piece


class Recorded:
    """A generation whose answer is stored once it ends as a whole answer (an interrupted or
    failed one is not); everything else is the generation's own."""

    def __init__(self, made, slot: Slot, probe=None) -> None:
        self._made, self._slot, self._probe = made, slot, probe
        self.saved = None

    def __getattr__(self, name: str):
        return getattr(self._made, name)

    def __iter__(self):
        pieces = []
        for piece in self._made:
            pieces.append(piece)
            yield piece
        self.saved = self._slot.store.save(self._slot.key, answer_of(self._made, pieces))
        if self.saved is not None and self._probe is not None:     # findable by meaning too
            self._probe.index.add(self._slot.key, self._probe.vector, self._probe.prompt)


def answer_of(made, pieces) -> Answer:
    """What a finished generation (or scheduler job) gave, as the store keeps it."""
    stats = made.stats
    logprobs = None if made.limits.logprobs is None else tuple(
        (int(r.token), float(r.logprob), tuple((int(i), float(lp)) for i, lp in r.top))
        for r in made.logprobs)
    return Answer(tuple(pieces), tuple(int(t) for t in made.tokens), stats.finish_reason,
                  stats.stop_string, stats.closed_at, logprobs)


def describe(generation) -> str | None:
    """The -v line of a replayed answer; None for one decoded."""
    if not isinstance(generation, Replay):
        return None
    saved = generation.answer.saved
    when = f", decoded {ago(saved)}" if saved else ""
    match = generation.match
    how = "" if match is None else (
        f" by similarity {match.similarity:.4f} (at least {generation.threshold:g}) to "
        f"{_quoted(match.prompt)}")
    return (f"answer reused from the answer store{how} (entry {generation.reused_from[:12]}"
            f"{when}): {len(generation.tokens)} tokens replayed, none decoded")


def _quoted(text: str, most: int = 60) -> str:
    """A stored prompt for a one-line note: its first line, cut, quoted."""
    line = text.splitlines()[0] if text else ""
    return repr(line if len(line) <= most and line == text else line[:most - 3] + "...")


class MapReuse:
    """map's jobs that repeat a request (same tokens and settings) decoded once: put between the
    scheduler and map's own `arrivals` and `done` (`wrap`). A repeat of a line under way waits for
    its answer; a repeat of one answered earlier (or, with `stored`, of one in the store) is
    answered at once. Counts lines `decoded`, `shared` (a repeat's) and `from_store`."""

    def __init__(self, session, lines, seq_ctx: int, *, stored: bool = False,
                 notify: Callable[[str], None] = lambda line: None) -> None:
        self.lines, self.seq_ctx, self.stored = lines, seq_ctx, stored
        self.store = answers.open_for(session, notify=notify)
        self.waiting: dict[str, list] = {}      # key of a job under way: the repeats waiting
        self.leading: dict[int, str] = {}       # index of a job under way: its key
        self.recent: OrderedDict[str, Answer] = OrderedDict()
        self._recent_bytes = 0
        self.decoded = self.shared = self.from_store = 0

    def wrap(self, done, arrivals):
        """(on_done, arrivals) for Scheduler.run, around map's own."""
        def came(idle: bool):
            jobs = arrivals(idle)
            return None if jobs is None else [job for job in jobs if not self._absorbed(job, done)]

        def finished(job) -> None:
            self._finished(job, done)
        return finished, came

    def key_of(self, job) -> str | None:
        lines, params = self.lines, self.lines.params
        if params.seed not in (None, -1):       # as map's lines draw: the seed counts up by line
            params = replace(params, seed=params.seed + job.index)
        settings = answers.settings_of(params, job.limits, via="batch", n_ctx=self.seq_ctx,
                                       gbnf=lines.gbnf, think_budget=lines.think.budget,
                                       raw=lines.raw, draft="none", draft_max=0)
        return None if settings is None else self.store.key(job.prompt, settings)

    def _absorbed(self, job, done) -> bool:
        """Whether `job` is answered without the scheduler (at once, or when its twin ends)."""
        key = None if job.error else self.key_of(job)
        if key is None:
            self.decoded += 1
            return False
        if key in self.waiting:
            self.waiting[key].append(job)
            return True
        answer = self.recent.get(key)
        if answer is not None:
            self.recent.move_to_end(key)
            self.shared += 1
        elif self.stored and (answer := self.store.lookup(key)) is not None:
            self.from_store += 1
            self._remember(key, answer)
        if answer is not None:
            fill_job(job, answer)
            done(job)
            return True
        self.waiting[key], self.leading[job.index] = [], key
        self.decoded += 1
        return False

    def _finished(self, job, done) -> None:
        key = self.leading.pop(job.index, None)
        if key is None:
            done(job)
            return
        twins = self.waiting.pop(key)
        whole = job.error is None and job.stats.finish_reason in answers.FINISHES
        answer = answer_of(job, [job.text]) if whole else None
        raw = (job.text, list(job.tokens), list(job.logprobs), copy.copy(job.stats), job.error)
        if answer is not None:
            self._remember(key, answer)
            if self.stored:
                self.store.save(key, answer)
        done(job)                   # may rewrite job.text (a thinking model's answer alone)
        for twin in twins:
            twin.text, twin.tokens, twin.logprobs, twin.stats, twin.error = (
                raw[0], list(raw[1]), list(raw[2]), copy.copy(raw[3]), raw[4])
            twin.reused = True
            self.shared += 1
            done(twin)

    def _remember(self, key: str, answer: Answer) -> None:
        self.recent[key] = answer
        self._recent_bytes += len(answer.text)
        while self._recent_bytes > MAP_RECENT_BYTES and len(self.recent) > 1:
            _, old = self.recent.popitem(last=False)
            self._recent_bytes -= len(old.text)

    def describe(self) -> str:
        total = self.decoded + self.shared + self.from_store
        stored = f"; {self.from_store} answered from the answer store" if self.from_store else ""
        return (f"map: {self.decoded} of {total} lines decoded; {self.shared} given the answer "
                f"of an identical earlier line{stored}")


def fill_job(job, answer: Answer) -> None:
    """A job (map's, serve's) filled from a stored answer as the scheduler fills one it decoded,
    marked `reused`."""
    job.text, job.tokens = answer.text, list(answer.tokens)
    job.logprobs = [TokenLogprob(t, lp, top) for t, lp, top in answer.logprobs or ()]
    job.stats = Stats(prompt_tokens=len(job.prompt), generated_tokens=len(answer.tokens),
                      finish_reason=answer.finish_reason, stop_string=answer.stop_string,
                      closed_at=answer.closed_at)
    job.reused = True
