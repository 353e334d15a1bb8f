"""Continuous batching: many requests decoded together, one token each per `llama_decode`.

Every step advances each running request by one token and, with what is left of the batch, a
chunk of a new request's prompt, so a long prompt does not freeze the others; a request that
finishes frees its sequence at once and the next waiting one takes it between two steps. Each
request has its own sampler, stop strings and limits (the `Emitter` of plain decoding, so it ends,
streams and counts the same way). Prompts that start with the shared prefix (a template's fixed
beginning) get its cells from the prefix's own sequence instead of evaluating it again.

A free slot keeps its cells (engine/slots.py) for a request that starts the same way, which
continues from them only up to a point that changes no bit of its logits (engine/batching.py): a
prompt is cut into the batches a cold evaluation of it is cut into, and its batch goes first in
its llama_decode, so a greedy answer does not hang on what the slot served before.

The pool of cells is shared (llama.cpp's unified KV cache); admission is engine/admission.py's.
By default each request may fill its share of it (`map`: --ctx is each prompt's); a server passes
`request_ctx` so that one request may fill the whole pool, and then no request can hold it
against the others: a request is promised its share at most, and gives back what it holds beyond
that when another needs it (it pauses, and continues from the cells it kept once there is room).

A request whose own sampling fails (a grammar that allows no token, any error while choosing or
emitting its token) ends alone with `error` set; the others go on. A failed llama_decode ends the
requests of that step and empties the pool; only when the engine fails ENGINE_FAILURES steps in a
row does `run` raise (the model can no longer run).

Requests with the same prompt admitted while the first of them is still reading it (a request's
`n` choices) do not read it again: each waits for that leader's last prompt batch, then takes
its cells (shared in the pool, as the prefix's are) and draws its first token from the same
logits. Their cells are counted as each one's own, which errs on the side of room.

A prompt with images or audio reads each medium as a step of its own (engine/scheduler_media.py).

Speculation is off here: with several sequences in one batch the verify step would pay a draft
batch for each of them, and the batch is already what keeps the hardware busy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from localinfer.backends import BatchSession, Piece
from localinfer.engine.admission import Admission
from localinfer.engine import batching
from localinfer.engine.batching import GRAIN, Exact
from localinfer.engine.decode import Emitter, Limits, Stats
from localinfer.engine.logprobs import TokenLogprob
from localinfer.engine.sampling import Sampler
from localinfer.engine.scheduler_media import MEDIA, MediaSteps
from localinfer.engine.seq_view import SeqView
from localinfer.engine.slots import Held, Kept, common_prefix
from localinfer.errors import LocalinferError

PREFILL_CHUNK = 256          # prompt tokens one request may add to a step
ENGINE_FAILURES = 3          # llama_decode failures in a row that mean the engine cannot go on


@dataclass
class Job:
    """One prompt to answer; `text`, `stats` and `error` are filled in as it runs."""

    prompt: list[int]
    sampler: Sampler
    limits: Limits
    on_text: Callable[[str], None] | None = None
    index: int = 0                # the caller's number for it (map: its input line)
    cancelled: bool = False       # set from another thread (a client gone): freed before a step
    batch: bool = False           # a batch job: never ahead of an interactive one (see _admit)
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    # One per token in `tokens` when limits.logprobs is set (engine/logprobs.py)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    error: str | None = None


@dataclass(frozen=True)
class Occupancy:
    """What the scheduler holds, published from its thread whole for readers in others (/metrics):
    one attribute replaced, never a structure read while the scheduler changes it."""

    running: int = 0          # requests being decoded
    cells_used: int = 0       # KV cells holding tokens: the prefix's, running and kept slots'
    interactive: int = 0      # of the running requests, those not marked batch


@dataclass
class _Running:
    job: Job
    seq: int
    pos: int                  # next position to fill
    pending: list[int]        # prompt tokens not evaluated yet (a paused job's: its own too)
    emit: Emitter
    shared: int               # prompt tokens it did not evaluate (prefix, kept cells, cache)
    reserved: int = 0         # positions promised at admission (see _promise)
    from_prefix: int = 0      # of its positions, cells that are the prefix sequence's own
    exact: Exact = Exact(False, 0, 0)   # how far its cells are a cold evaluation's
    ends: list[int] = field(default_factory=list)   # where the batches of `pending` end
    leader: _Running | None = None      # the request reading the same prompt, waited for

    def claim(self) -> int:
        """Cells of the pool it holds or was promised, not counting the prefix's shared ones."""
        return max(self.pos + len(self.pending), self.reserved) - self.from_prefix


class Scheduler(Admission):
    """Runs jobs on a BatchSession of `parallel` request sequences (plus one for the prefix)."""

    def __init__(self, batch: BatchSession, *, prefix: Sequence[int] = (),
                 prefill_chunk: int = PREFILL_CHUNK, store=None,
                 request_ctx: int | None = None) -> None:
        # store: the persistent prompt cache (cache.prompt_cache.PromptCache), read-only here
        self.batch, self.store = batch, store
        self.prefill_chunk = min(prefill_chunk, batch.n_batch)
        self.parallel = batch.n_seq - 1
        self.prefix: list[int] = []
        self._prefix_seq = self.parallel
        self._kept = Kept(batch)                # free slots' cells
        self._media = MediaSteps(batch, self.prefill_chunk)     # images and audio
        self._paused: dict[int, Emitter] = {}   # id(job) -> its emitter, while it waits again
        self._running: dict[int, _Running] = {}  # run's: seq -> the request it runs
        self._window = int(getattr(batch.session, "sliding_window", 0) or 0)
        # The positions one request may fill: its share of the pool, or what the caller allows
        self.seq_ctx = min(request_ctx or batch.n_ctx // self.parallel, batch.n_ctx)
        # What each request is promised whatever the others ask (see the module's doc)
        self.share = max(batch.n_ctx // self.parallel, 1)
        self._failures = 0              # llama_decode failures in a row
        self.occupancy = Occupancy()
        batch.clear()                   # it starts from an empty pool: nothing it cannot account for
        if len(prefix) > 1:             # no longer than a request may be: it is part of each
            self._eval_prefix(list(prefix)[:self.seq_ctx - 1])

    def _eval_prefix(self, prefix: list[int]) -> None:
        for start in range(0, len(prefix), self.batch.n_batch):
            chunk = prefix[start:start + self.batch.n_batch]
            self.batch.decode([Piece(self._prefix_seq, chunk, start, logits=False)])
        self.prefix = prefix

    def run(self, jobs: Iterable[Job], on_done: Callable[[Job], None] = lambda job: None,
            arrivals: Callable[[bool], list[Job] | None] | None = None) -> None:
        """Answer every job, up to `parallel` at a time; on_done(job) as each one ends.

        `arrivals(idle)`, asked between steps, hands over jobs that came in meanwhile (a server's
        requests); idle says nothing is left to run, so it should block until one comes. None: no
        more will come, and the run ends once the jobs it has are done."""
        waiting, running = deque(jobs), {}
        self._running = running         # who reads a prompt another request may share
        self._waiting = waiting
        free = list(range(self.parallel))[::-1]
        while waiting or running or arrivals:
            self._publish(running)
            if arrivals:
                came = arrivals(not (waiting or running))
                if came is None:
                    arrivals = None
                elif came:
                    # interactive jobs ahead of batch ones, each in the order they came
                    waiting = deque(sorted([*waiting, *came], key=lambda job: job.batch))
                    self._waiting = waiting
            for seq in [s for s, r in running.items() if r.job.cancelled]:
                self._finish(running, free, seq, "cancelled", on_done)
            self._admit(waiting, running, free, on_done)
            if not running:
                continue
            while (seq := self._out_of_room(running)) is not None:
                self._give_back(running, free, seq, waiting, on_done)
            for seq, reason in self._step_or_fail(list(running.values())):
                self._finish(running, free, seq, reason, on_done)

    def _end_early(self, r: _Running) -> None:
        tail = r.emit.tail()
        if tail:
            r.job.text += tail
            if r.job.on_text:
                r.job.on_text(tail)

    def _step_or_fail(self, running: list[_Running]) -> list[tuple[int, str | None]]:
        """One step; a failed llama_decode ends this step's requests with the engine's error and
        empties the pool (its cells are not known after a failure), the prefix evaluated again."""
        try:
            finished = self._step(running)
        except LocalinferError as e:
            self._failures += 1
            if self._failures >= ENGINE_FAILURES:
                raise
            for r in running:
                r.job.error = f"the model failed: {e}"
            self.batch.clear()
            self._kept.clear()
            if self.prefix:
                self._eval_prefix(self.prefix)
            return [(r.seq, "error") for r in running]
        self._failures = 0
        return finished

    def _finish(self, running: dict, free: list[int], seq: int, reason: str | None,
                on_done: Callable[[Job], None]) -> None:
        """A request is over: its sequence's cells go back to the pool before the next step."""
        done = running.pop(seq)
        # Its cells stay until the slot is taken again: a request that starts the same way (a
        # system prompt, a conversation's next turn) continues from them, as llama-server's slots do.
        self._kept.put(seq, Held((done.job.prompt + done.job.tokens)[:done.pos],
                                 done.from_prefix, done.exact))
        free.append(seq)
        if reason == "error":       # its cells may hold what it failed on: not kept
            self._kept.forget(seq)
        if reason:
            done.job.stats.finish_reason = reason
        self._media.forget([*(r.job.prompt for r in running.values()),
                            *(j.prompt for j in self._waiting), *self._kept.tokens()])
        self._publish(running)          # before its reply goes: a scrape after it sees it gone
        on_done(done.job)

    def _publish(self, running: dict) -> None:
        own = sum(r.pos - r.from_prefix for r in running.values())
        self.occupancy = Occupancy(len(running), len(self.prefix) + own + self._kept.cells(),
                                   sum(not r.job.batch for r in running.values()))

    def _refused(self, job: Job) -> bool:
        if not job.prompt:
            job.error = "the prompt is empty"
        elif said := self._media.refusal(job.prompt):
            job.error = said
        elif len(job.prompt) >= self._room(job.prompt):
            job.error = (f"the prompt is {len(job.prompt):,} tokens, more than the "
                         f"{self._room(job.prompt):,} each request has (raise --ctx"
                         + (" or lower --parallel)" if self.seq_ctx < self.batch.n_ctx else ")"))
        return job.error is not None

    def _room(self, prompt: list[int]) -> int:
        """Cells a request may fill. The prefix's own cells count in each request that starts
        with it; one that does not leaves them to it, so admission never overfills the pool."""
        return self.seq_ctx - (len(self.prefix) - _common(prompt, self.prefix, len(self.prefix)))

    # -- starting --------------------------------------------------------------------------
    def _slot_for(self, job: Job, free: list[int]) -> int:
        """The free slot with the most cells the job may continue from, else the one freed
        longest ago: the most recently freed slots hold what is likeliest asked again (a
        conversation's next turn), which a request sharing nothing with them should not evict."""
        return max(free, key=lambda s: self._reusable(job, s))

    def _reusable(self, job: Job, seq: int) -> int:
        full = job.prompt + job.tokens
        base = _common(job.prompt, self.prefix, len(full) - 1)
        held = self._kept.get(seq)
        if held is not None and self._media.holds(full):        # never inside a medium
            return self._media.reusable(held, full, len(job.prompt), base=base,
                                        own=held.owner is job)
        return self._kept.reusable(seq, full, len(job.prompt), base=base, window=self._window,
                                   owner=job)

    def _start(self, job: Job, seq: int) -> _Running:
        emit = self._paused.pop(id(job), None)          # a paused job continues where it was
        full = job.prompt + job.tokens
        base = _common(job.prompt, self.prefix, len(full) - 1)
        kept = self._reusable(job, seq)
        media = self._media.holds(full)
        restored = 0 if emit or media else self._restore(job.prompt, seq,
                                                         better_than=max(kept, base))
        held = self._kept.pop(seq)
        self._kept.disown(job)
        kind = MEDIA if media else batching.tiled(len(job.prompt), base)
        exact = Exact(kind, base, base)
        if restored > 0:
            shared, from_prefix, exact = restored, 0, Exact(True, 0, restored)
        elif held and kept > base and restored == 0:
            self.batch.trim(seq, kept)
            shared, from_prefix = kept, min(kept, held.from_prefix)
            if (held.exact.tiled, held.exact.base) == (kind, base):
                exact = Exact(kind, base, min(held.exact.end, kept))
        else:
            self.batch.forget(seq)
            if base:
                self.batch.share(self._prefix_seq, seq, base)
            shared = from_prefix = base
        if emit is None:
            job.stats = Stats(prompt_tokens=len(job.prompt))
            emit = Emitter(SeqView(self.batch.session, self._room(job.prompt)), job.prompt,
                           job.limits, job.stats)
            job.tokens, job.logprobs = emit.tokens, emit.logprobs
        ends = self._media.ends(full, exact.base, shared) if media else batching.prefill_ends(
            exact.base, shared, len(full), self.prefill_chunk, self._window)
        leader = None if job.tokens else next(
            (r for r in self._running.values() if r.leader is None and r.pending
             and not r.job.tokens and r.job.prompt == job.prompt), None)
        return _Running(job, seq, shared, full[shared:], emit, shared, self._promise(job),
                        from_prefix, exact, ends, leader)

    def _follow(self, leader: _Running, logits, finished: list) -> None:
        """The requests waiting for `leader`'s prompt take its cells and its first logits."""
        for f in [r for r in self._running.values() if r.leader is leader]:
            self.batch.forget(f.seq)
            self.batch.share(leader.seq, f.seq, leader.pos)
            f.pos = f.shared = leader.pos
            f.pending, f.ends, f.leader = [], [], None
            f.exact, f.from_prefix = leader.exact, leader.from_prefix
            f.emit.prefilled(f.shared)
            self._sample(f, logits.copy(), finished)

    def _restore(self, prompt: list[int], seq: int, *, better_than: int) -> int:
        """The prompt's longest prefix in the persistent prompt cache, loaded into `seq` as `run`
        would load it (whole batching grains, at least one batching grain left to evaluate); 0
        for none, -1 when an entry was tried and refused (the slot is empty then)."""
        if self.store is None:
            return 0
        found = self.store.longest_prefix(prompt, limit=batching.restore_limit(
            len(prompt), self._window), rigid_over=self._window or None, longest=self.seq_ctx)
        usable = found[1] // GRAIN * GRAIN if found else 0
        if usable <= better_than:
            return 0
        state = self.store.load(found[0])
        if state is None:
            return 0
        self.batch.forget(seq)
        if not self.batch.restore(seq, state, usable):
            self.store.drop(found[0])          # the engine refused it: never trusted again
            return -1
        return usable

    # -- stepping --------------------------------------------------------------------------
    def _step(self, running: list[_Running]) -> list[tuple[int, str | None]]:
        """One llama_decode for every running request; the sequences that finished (with the
        reason to record: None when the emitter set it, "error" when the job failed alone)."""
        for r in running:           # a leader gone before its prompt was read: read it alone
            if r.leader is not None and self._running.get(r.leader.seq) is not r.leader:
                r.leader = None
        running = [r for r in running if r.leader is None]
        if any(r.pending and not r.job.batch for r in running):
            # An interactive prompt is being read: batch jobs sit this step out, so that its
            # first token comes about as soon as on an idle server.
            running = [r for r in running if not r.job.batch]
        finished = self._media.steps(running)       # its media, in decodes of their own
        running = [r for r in running if (r.seq, "error") not in finished]
        decoding = [r for r in running if not r.pending]
        order = self._prompt_pieces([r for r in running if r.pending],
                                    self.batch.n_batch - len(decoding))
        order += [(r, Piece(r.seq, [r.emit.tokens[-1]], r.pos)) for r in decoding]
        if not order:
            return finished
        for (r, piece), logits in zip(order, self.batch.decode([p for _, p in order])):
            r.pos += len(piece.tokens)
            if logits is None:
                continue
            if not r.emit.tokens:
                r.emit.prefilled(r.shared)
                self._follow(r, logits, finished)
            self._sample(r, logits, finished)
        return finished

    def _sample(self, r: _Running, logits, finished: list) -> None:
        try:
            token = r.job.sampler(logits, r.emit.history)
            if self._take(r, token, r.emit.score(logits, token)):
                finished.append((r.seq, None))
        except Exception as e:      # its own sampler, grammar or text: it alone fails
            r.job.error = str(e) if isinstance(e, LocalinferError) else \
                f"internal error: {type(e).__name__}: {e}"
            finished.append((r.seq, "error"))

    def _prompt_pieces(self, reading: list[_Running], room: int) -> list[tuple[_Running, Piece]]:
        """The next batch of each prompt being read that fits the step, as a cold evaluation cuts
        it, first in the llama_decode (a batch's kernels group its rows from its start); each
        that is a cold evaluation's batch extends how far its cells are exact. A prompt whose
        batch cannot fit while others decode takes what room there is, exact no further."""
        order: list[tuple[_Running, Piece]] = []
        whole_batches: list[bool] = []
        for r in reading:
            whole = r.ends[0] - r.pos
            take = whole if whole <= room else (room if not order else 0)
            if take <= 0:
                continue
            chunk, r.pending = r.pending[:take], r.pending[take:]
            order.append((r, Piece(r.seq, chunk, r.pos, logits=not r.pending)))
            whole_batches.append(take == whole)
            room -= take
            if take == whole:
                r.ends.pop(0)
        tall = max((len(p.tokens) for _, p in order), default=0) >= GRAIN
        offset = 0
        for (r, piece), whole in zip(order, whole_batches):
            n, e = len(piece.tokens), r.exact
            if e.tiled is MEDIA:
                r.exact = MediaSteps.extended(e, piece.pos, n, whole, tall, offset)
            elif whole and piece.pos == e.end and e.tiled == tall and \
                    offset % (GRAIN if tall else batching.ROWS) == 0:
                cap = batching.exact_end(len(r.job.prompt), e.base, self._window)
                r.exact = Exact(e.tiled, e.base, max(e.end, min(piece.pos + n, cap)))
            offset += n
        return order

    def _take(self, r: _Running, token: int, scored: TokenLogprob | None = None) -> bool:
        text, done = r.emit.take(token, scored)
        if done:
            text += r.emit.tail()
        if text:
            r.job.text += text
            if r.job.on_text:
                r.job.on_text(text)
        return done


def _common(a: Sequence[int], b: Sequence[int], most: int) -> int:
    return common_prefix(a, b, most)
