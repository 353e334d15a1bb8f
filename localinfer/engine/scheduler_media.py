"""Images and audio in the batched scheduler (engine/scheduler.py): serve's requests with media.

A prompt with media holds each medium as a run of placeholder ids past the vocabulary
(backends/llama/mtmd.py), keyed by the medium's content. The scheduler reads such a prompt as
`run` reads it (engine/media.py), chunk by chunk: its text in pieces that never cross a medium,
co-batched with the other requests' pieces as any text is, and each medium whole, as a step of
its own: its embeddings (encoded once, then kept by the projector) decoded into the request's
sequence at its positions in llama_decodes that hold nothing else, with causal attention off
where the projector says so (Gemma 3). The other requests go on at the next step.

A free slot's cells are continued by a later prompt with media (the same picture: the same
placeholders) only where both prompts' cold evaluations cut (`cuts`: each medium's start and
end, the text between cut every prefill chunk from its start), never inside a medium, and only
as far as those cells were computed as a cold evaluation computes them (`Exact` with `tiled`
MEDIA, extended by `extended`), so a repeated request answers as it did the first time. Such
cells are never continued by a text-only prompt past the shared prefix, nor the reverse.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from localinfer.engine import batching
from localinfer.engine.batching import GRAIN, Exact
from localinfer.errors import LocalinferError

MEDIA = None        # Exact.tiled of cells read as a prompt with media is read (neither kind)
GRACE_S = 300.0     # media a request tokenized this recently are kept for it (not yet queued)


class MediaSteps:
    """The media step and the cut rules for one BatchSession whose model has a projector (all
    a no-op without one)."""

    def __init__(self, batch, chunk: int) -> None:
        self.batch, self.chunk = batch, chunk
        self.projector = getattr(batch.session, "media", None)

    def holds(self, tokens: Sequence[int]) -> bool:
        p = self.projector
        return p is not None and len(tokens) > 0 and max(tokens) >= p.n_vocab

    def refusal(self, prompt: Sequence[int]) -> str | None:
        """Why a prompt cannot be read here (None: it can)."""
        if self.projector is None:      # serve refuses media for such a model (media_parts)
            return None
        n_vocab = self.projector.n_vocab
        if prompt and max(prompt) >= n_vocab:
            if prompt[-1] >= n_vocab:
                return "a prompt cannot end with an image or audio clip: put text after it"
            try:                    # each medium whole and known (the projector has its chunks)
                i = 0
                while i < len(prompt):
                    i += self.projector.item_at(prompt, i).n if prompt[i] >= n_vocab else 1
            except LocalinferError as e:
                return str(e)
        return None

    # -- where a cold evaluation cuts ------------------------------------------------------
    def _spans(self, tokens: Sequence[int], start: int) -> list[tuple[int, int]]:
        """(start, end) of each medium in tokens[start:]; the last one's end may lie past the
        tokens (a slot's cells cut from their end)."""
        out, i, n, n_vocab = [], start, len(tokens), self.projector.n_vocab
        while i < n:
            if tokens[i] >= n_vocab:
                item = self.projector.item(tokens[i])
                if item is None:
                    raise LocalinferError("the prompt holds a medium that is no longer known")
                out.append((i, i + item.n))
                i += item.n
            else:
                i += 1
        return out

    def cuts(self, tokens: Sequence[int], base: int) -> list[int]:
        """Where a cold evaluation of tokens[base:] ends its decodes: the text between media
        every `chunk` tokens from its start and at each medium's start, each medium at its
        end."""
        out, seg = [], base
        for start, end in self._spans(tokens, base):
            out += [*range(seg + self.chunk, start, self.chunk), *([start] if start > seg else [])]
            out.append(end)
            seg = end
        n = len(tokens)
        if n > seg:
            out += [*range(seg + self.chunk, n, self.chunk), n]
        return [c for c in out if c <= n]

    def ends(self, tokens: Sequence[int], base: int, start: int) -> list[int]:
        """The ends of the pieces that read tokens[start:] (the scheduler's `ends`)."""
        return [c for c in self.cuts(tokens, base) if c > start]

    def outside(self, tokens: Sequence[int], at: int) -> int:
        """`at` moved back to the start of the medium it would fall inside."""
        for start, end in self._spans(tokens, 0):
            if start < at < end:
                return start
        return at

    def reusable(self, held, tokens: Sequence[int], n_prompt: int, *, base: int,
                 own: bool) -> int:
        """How many of a slot's cells (`held`, engine/slots.Held) a prompt with media may
        continue from: a paused request's own cells all they share outside a medium; another's
        only to a cut of both prompts' cold evaluations within their exact cells."""
        from localinfer.engine.slots import common_prefix
        common = common_prefix(tokens, held.tokens, len(tokens) - 1)
        if own:
            return self.outside(tokens, common)
        e = held.exact
        if e.tiled is not MEDIA or e.base != base:
            return base
        limit = min(common, e.end, n_prompt - 1)
        try:
            mine, theirs = set(self.cuts(tokens, base)), self.cuts(held.tokens, base)
        except LocalinferError:         # a medium no longer known: nothing to continue
            return base
        return max([c for c in theirs if c <= limit and c in mine], default=base)

    @staticmethod
    def extended(e: Exact, pos: int, n: int, whole: bool, tall: bool, offset: int) -> Exact:
        """A media prompt's exact cells after a text piece of n tokens at `pos`: extended when
        the piece is a cold evaluation's whole piece computed as alone (its decode's kernels
        its own, its rows grouped from a multiple of the groups' size)."""
        if whole and pos == e.end and (n >= GRAIN) == tall and \
                offset % (GRAIN if tall else batching.ROWS) == 0:
            return replace(e, end=pos + n)
        return e

    # -- the step ----------------------------------------------------------------------------
    def steps(self, reading: list) -> list[tuple[int, str]]:
        """For each request whose unread prompt starts with a medium, that medium decoded
        (see the module's notes); the (sequence, "error") of those whose medium failed alone
        (an encoding libmtmd refused). A failed decode raises: the pool's cells are unknown."""
        if self.projector is None:
            return []
        failed = []
        for r in reading:
            try:
                while r.pending and r.pending[0] >= self.projector.n_vocab:
                    self._step(r)
            except _Refused as e:
                r.job.error = str(e.args[0])
                failed.append((r.seq, "error"))
        return failed

    def _step(self, r) -> None:
        """The medium (and those right after it: encoded together) r.pending starts with."""
        try:
            item = self.projector.item_at(r.pending, 0)
            embd = self.projector.embeddings(item, self._after(r.pending, item.n))
            causal = self.projector.causal(item)
        except LocalinferError as e:
            raise _Refused(e) from None
        self.batch.decode_embd(r.seq, r.pos, embd, causal=causal)
        if r.exact.tiled is MEDIA and r.exact.end == r.pos:
            r.exact = replace(r.exact, end=r.pos + item.n)
        r.pos += item.n
        r.pending = r.pending[item.n:]
        while r.ends and r.ends[0] <= r.pos:
            r.ends.pop(0)

    def _after(self, pending: Sequence[int], at: int) -> list:
        """The media right after the first with no text between (encoded in one batch with it,
        as `run` and llama-mtmd-cli encode them)."""
        later = []
        while at < len(pending) and pending[at] >= self.projector.n_vocab:
            item = self.projector.item_at(pending, at)
            later.append(item)
            at += item.n
        return later

    def forget(self, token_lists) -> None:
        """Free the media no request or slot holds any more (nor one tokenized lately)."""
        if self.projector is not None:
            n_vocab = self.projector.n_vocab
            keep = {t for tokens in token_lists if tokens and max(tokens) >= n_vocab
                    for t in tokens if t >= n_vocab}
            self.projector.forget(keep, grace=GRACE_S)


class _Refused(Exception):
    """A medium that one request cannot have (its error, not the engine's)."""
