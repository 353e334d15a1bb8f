"""Where prefill cuts a prompt into engine batches, so that a state restored from the prompt cache
continues exactly as a cold run of the same prompt would.

llama.cpp's CPU results for a position depend on the batch it was computed in, but only through
two things (measured on both real models; the reasons are in its kernels): flash attention takes a
tiled path for batches of 64 rows or more when K and V are both f16 (the 16-bit cache; smaller
graphs run on ggml's reference kernels, backends/llama/steer.py), and the matrix kernels treat rows
in groups counted from the batch start (4 for repacked weights, tiles from 8 rows for K-quants). So a row comes out the same
whatever batch it is in, as long as that batch starts on a multiple of GRAIN and holds at least
GRAIN rows. A cold prompt is therefore evaluated in full batches (n_batch tokens, the last one
never shorter than GRAIN), and a cached state is only resumed at a multiple of GRAIN at least GRAIN
tokens before the prompt's end.

A sliding-window model (Gemma 3) is the exception once a prompt outgrows the window: its saved
state leaves out cells already outside the window, so it cannot be trimmed back, and entries must
end exactly where a batch ended. Such "rigid" prompts are cut every CHECKPOINT tokens and at the
last multiple of GRAIN before the final token, and an entry is kept at each of those cuts.

The batched scheduler (engine/scheduler.py) keeps a finished request's cells for the next request
that starts the same way, and follows the same rules so that continuing them changes no bit
(`Exact`, `reuse_point`). There a short prompt (under GRAIN tokens) is evaluated on the reference
kernels, whose rows do not depend on their batch except through the repacked weights' kernels,
which take a batch's rows in groups of ROWS from its start (the rows left over one by one, in
another order). So a short prompt continues another's cells at a multiple of ROWS, and only cells
that were computed in such a group of another short prompt's rows: never a generated token's
(one row alone), never a long prompt's (tiled kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

GRAIN = 64          # restore points and batch starts are multiples of this; batches at least this long
# Rigid prompts: a batch ends (and an entry is kept) every this many tokens. As long as the default
# n_batch: 256 cost a long Gemma 3 prompt 7% of its prefill (540 against 579 t/s at 2,048 tokens).
CHECKPOINT = 512
LAYOUT = "v3"       # changes whenever the rules above do: part of the prompt-cache key
ROWS = 4            # repacked weights' kernels take a batch's rows in groups of this many


def is_rigid(n_prompt: int, window: int) -> bool:
    """Whether a state of this prompt cannot be trimmed back (it outgrows a sliding window)."""
    return bool(window) and n_prompt > window


def restore_limit(n_prompt: int, window: int) -> int:
    """The furthest position a restored state may end at before evaluating the rest."""
    if is_rigid(n_prompt, window):
        return (n_prompt - 1) // GRAIN * GRAIN
    return max(n_prompt - GRAIN, 0) // GRAIN * GRAIN


def batch_ends(start: int, n_prompt: int, n_batch: int, window: int) -> list[int]:
    """End positions of the batches that evaluate prompt[start:n_prompt]."""
    if is_rigid(n_prompt, window):
        return _rigid_ends(start, n_prompt, min(n_batch, CHECKPOINT))
    ends, pos = [], start
    while n_prompt - pos > n_batch:
        end = pos + n_batch
        if n_prompt - end < GRAIN:        # keep the last batch on the tiled path
            end = max((n_prompt - GRAIN) // GRAIN * GRAIN, pos + GRAIN)
        ends.append(end)
        pos = end
    ends.append(n_prompt)
    return ends


def snapshot_ends(start: int, n_prompt: int, n_batch: int, window: int) -> list[int]:
    """The batch ends after which a state is worth keeping in the prompt cache."""
    if is_rigid(n_prompt, window):
        tail = restore_limit(n_prompt, window)
        return [end for end in batch_ends(start, n_prompt, n_batch, window) if end <= tail]
    return [n_prompt] if n_prompt >= GRAIN else []


def canonical_end(n_prompt: int, window: int) -> int:
    """After a canonical prefill, how many leading positions any longer prompt would compute alike."""
    if is_rigid(n_prompt, window):
        return restore_limit(n_prompt, window)
    return n_prompt if n_prompt >= GRAIN else 0


def _rigid_ends(start: int, n_prompt: int, step: int) -> list[int]:
    tail = (n_prompt - 1) // GRAIN * GRAIN
    ends = list(range((start // step + 1) * step, tail, step))
    if tail > start:
        ends.append(tail)
    ends.append(n_prompt)
    return ends


@dataclass(frozen=True)
class Exact:
    """How far a sequence's leading cells hold what a cold evaluation computes there: cells
    [0, base) are a shared prefix's (the same for every prompt that starts with it), cells
    [base, end) rows of `tiled` batches (else reference-kernel ones) cut as `prefill_ends` cuts
    from base, each batch alone in its llama_decode."""

    tiled: bool
    base: int
    end: int


def tiled(n_prompt: int, base: int) -> bool:
    """Whether a cold evaluation of prompt[base:] runs on the tiled kernels (64 rows or more)."""
    return n_prompt - base >= GRAIN


def prefill_ends(base: int, start: int, n_prompt: int, n_batch: int, window: int) -> list[int]:
    """End positions of the batches that evaluate prompt[start:], cut as a cold evaluation of
    prompt[base:] is cut (the same cuts from any start a reuse_point allows)."""
    if is_rigid(n_prompt, window):
        return batch_ends(start, n_prompt, n_batch, window)
    return [base + end for end in batch_ends(start - base, n_prompt - base, n_batch, 0)]


def exact_end(n_prompt: int, base: int, window: int) -> int:
    """After a cold evaluation of prompt[base:], how far its rows are computed as those of any
    prompt of the same kind that shares them (whole groups: the ragged end of a batch is not)."""
    if is_rigid(n_prompt, window):
        return restore_limit(n_prompt, window) if base == 0 else base
    step = GRAIN if tiled(n_prompt, base) else ROWS
    return base + (n_prompt - base) // step * step


def reuse_point(n_prompt: int, common: int, held: Exact, window: int, *, base: int = 0) -> int:
    """Of the `common` leading tokens a prompt shares with cells computed as `held` says, how many
    it may continue from so that its remaining batches, and so its logits, are a cold run's."""
    if held.base != base or held.tiled != tiled(n_prompt, base):
        return base
    if held.tiled:
        limit = restore_limit(n_prompt, window) if is_rigid(n_prompt, window) \
            else base + max(n_prompt - base - GRAIN, 0) // GRAIN * GRAIN
        step = GRAIN
    else:
        limit, step = n_prompt - 1, ROWS
    k = min(common, held.end, limit)
    return base + max(k - base, 0) // step * step
