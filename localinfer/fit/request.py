"""The context a request needs, sized before anything is loaded.

With `--ctx 0` (the default) the context holds the prompt's tokens plus room for the reply
(--max-tokens, or engine.prompt.REPLY_TOKENS), never less than the default context (4,096, or the
trained context when that is shorter), at most the trained context, and within the memory budget:
`auto.resolve` tries a q8_0 KV cache, then shorter contexts, but never shorter than the prompt.

A prompt that does not fit is refused in one line that says how many tokens it has, what fits and
the way out: `--truncate` drops the start of the piped input, keeping the question and the end of
the input, and stderr says how many tokens went. Nothing is cut silently.

A short prompt is not tokenized here: the bytes of its rendered text bound its tokens, and when
the default context holds that bound and the reply's room, the fit is the one a fixed context gets.
A long prompt is counted with the model's vocabulary alone (no weights), so the fit (variant, KV
type, GPU layers) is made once, for the context the prompt really needs. In between, a prompt that
most likely fits the default context (at LIKELY_BYTES_PER_TOKEN) is fitted as a short one and
counted by the loaded model (`holds`); in the rare case it needs more, it is fitted again with that
count and the model loaded again. Loading a vocabulary alone costs nearly a whole load on Gemma 3
(262k tokens): docs/context.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localinfer.backends import context_length
from localinfer.engine.prompt import (PromptText, most_tokens, prompt_tokens, reply_reserve,
                                      reply_room, truncated)
from localinfer.errors import ContextOverflow, LocalinferError
from localinfer.fit import auto, memory, rules
from localinfer.fit.options import FitOptions, Reporter
from localinfer.models import refs
from localinfer.gguf.checks import checked_header

# Bytes of text a token stands for in nearly any prompt (English about 4, code about 3): one whose
# bytes over this leave the reply its room in the default context is fitted without counting.
LIKELY_BYTES_PER_TOKEN = 3


@dataclass(frozen=True)
class Request:
    """What `run` asks of the context besides the model."""

    prompt: PromptText
    max_tokens: int = -1          # --max-tokens; -1: engine.prompt.REPLY_TOKENS of room
    truncate: bool = False        # --truncate: shorten the piped input rather than refuse

    @property
    def reply(self) -> int:
        return reply_room(self.max_tokens)


@dataclass(frozen=True)
class Sized:
    resolved: auto.Resolved
    prompt: PromptText            # as asked, or shortened by --truncate
    notes: tuple[str, ...] = ()   # what --truncate dropped
    trained: int = 0              # the model's trained context (0: the file does not say)
    counted: bool = True          # False: fitted on a likely bound; `holds` checks after loading


def sized_context(n_prompt: int, reply: int, trained: int) -> int:
    """`--ctx 0`: the prompt and the reply's room in whole KV pages, at least the default context,
    at most the trained one (0: unknown, no cap)."""
    wanted = -(-(n_prompt + reply) // memory.KV_PAD) * memory.KV_PAD
    return max(context_length(0, trained), min(wanted, trained) if trained else wanted)


def resolve(request: Request, named: refs.Named, fit: FitOptions, report: Reporter = Reporter(),
            *, vocab=None) -> Sized:
    """`auto.resolve` for a context that holds the request's prompt; `vocab`, a model already
    loaded, counts the prompt (see `holds`)."""
    ctx = fit.ctx
    path, name = _vocabulary_file(named, fit, report)
    header = checked_header(path)
    trained = memory.facts_from_header(header, 0).context_length
    if vocab is not None:
        return _counted(request, named, name, vocab, trained, fit, report)
    template = header.metadata.get("tokenizer.chat_template")
    bound = most_tokens(request.prompt, template if isinstance(template, str) else None)
    # A fixed context need only hold the prompt; the default one the reply's room as well.
    room, default = (0 if ctx else request.reply), ctx or context_length(0, trained)
    if bound is not None and bound // LIKELY_BYTES_PER_TOKEN + room <= default:
        return Sized(auto.resolve(named, fit, report), request.prompt, trained=trained,
                     counted=bound + room <= default)
    from localinfer.backends.llama.vocab import LlamaVocab
    vocab = LlamaVocab(path)
    try:
        return _counted(request, named, name, vocab, trained, fit, report)
    finally:
        vocab.close()


def _counted(request: Request, named: refs.Named, name: str, vocab, trained: int,
             fit: FitOptions, report: Reporter) -> Sized:
    ctx = fit.ctx
    prompt, truncate = request.prompt, request.truncate and request.prompt.cuttable > 0
    n = asked = len(prompt_tokens(vocab, prompt))
    limit = ctx or trained
    if limit and n > limit:
        if not truncate:
            raise LocalinferError(_too_long(n, limit, name, ctx=ctx, trained=trained,
                                            cuttable=request.prompt.cuttable > 0))
        prompt, n = _cut(vocab, prompt, limit, request.max_tokens)
    n_ctx = ctx or sized_context(n, request.reply, trained)
    try:
        resolved = auto.resolve(named, fit, report, n_ctx=n_ctx, min_ctx=min(n, n_ctx))
    except LocalinferError:
        # Not within the memory budget at the prompt's length: the longest context that fits (or
        # why nothing does), then refuse, or cut the prompt to that.
        resolved = auto.resolve(named, fit, report, n_ctx=n_ctx)
        if resolved.n_ctx >= n:
            raise
        most = _most_context(resolved, n, fit)
        if most > resolved.n_ctx:
            resolved = auto.resolve(named, fit, report, n_ctx=most, min_ctx=most)
        if not truncate:
            raise LocalinferError(_over_budget(n, resolved, cuttable=request.prompt.cuttable > 0)) \
                from None
        prompt, n = _cut(vocab, prompt, resolved.n_ctx, request.max_tokens)
    dropped = (f"--truncate: dropped the first {asked - n:,} tokens of the piped input to fit the "
               f"context (the prompt is now {n:,} of {asked:,} tokens)",) if n < asked else ()
    return Sized(resolved, prompt, dropped, trained)


def holds(sized: Sized, n_prompt: int, *, ctx: int, reply: int) -> bool:
    """Whether a fit made without counting (`Sized.counted` False) is the one the prompt's count
    of `n_prompt` tokens asks for; if not, `resolve` again with the loaded model as `vocab`."""
    if sized.counted:
        return True
    n_ctx = sized.resolved.n_ctx or context_length(ctx, sized.trained)
    if ctx:
        return n_prompt <= n_ctx
    return sized_context(n_prompt, reply, sized.trained) <= n_ctx


def grown(path: Path, *, n_ctx: int, need: int, kv_type: str | None,
          memory_budget: str | None, gpu_layers: int | None,
          cpu_moe: int | None = None) -> rules.Placement | None:
    """A larger context for a conversation that needs `need` tokens (its reply's room included),
    on the model file `path`: at least double the current `n_ctx`, so that a growing chat reloads
    seldom, up to the trained context, within the budget; None when it cannot grow."""
    trained = memory.facts_from_file(path).context_length
    target = sized_context(max(need, 2 * n_ctx), 0, trained)
    if target <= n_ctx:
        return None
    placement = auto.place_file(path, n_ctx=target, kv_type=kv_type, gpu_layers=gpu_layers,
                                memory_budget=memory_budget, cpu_moe=cpu_moe,
                                min_ctx=min(target, n_ctx + memory.KV_PAD))
    return placement if placement.fits and placement.n_ctx > n_ctx else None


def _most_context(resolved: auto.Resolved, below: int, fit: FitOptions) -> int:
    """The longest context, in whole KV pages and shorter than `below`, that the budget holds for
    the variant `resolved` names (the fit halves contexts; this finds the pages in between)."""
    ref = resolved.ref
    path = ref.path or refs.model_store().find(ref.spec.name, ref.quant)
    if path is None:
        return resolved.n_ctx
    lo, hi = resolved.n_ctx // memory.KV_PAD, (below - 1) // memory.KV_PAD     # lo pages fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        placed = auto.place_file(path, n_ctx=mid * memory.KV_PAD, min_ctx=mid * memory.KV_PAD,
                                 kv_type=fit.kv_type, gpu_layers=fit.gpu_layers,
                                 memory_budget=fit.memory, cpu_moe=fit.cpu_moe)
        lo, hi = (mid, hi) if placed.fits else (lo, mid - 1)
    return max(resolved.n_ctx, lo * memory.KV_PAD)


def _cut(vocab, prompt: PromptText, n_ctx: int, max_tokens: int) -> tuple[PromptText, int]:
    """The prompt shortened to leave a context of `n_ctx` its reply's room."""
    try:
        prompt, tokens = truncated(vocab, prompt, n_ctx - reply_reserve(n_ctx, max_tokens))
    except ContextOverflow as e:
        raise LocalinferError(f"{e}; shorten the question or raise --ctx") from None
    return prompt, len(tokens)


def _way_out(cuttable: bool) -> str:
    if cuttable:
        return "pass --truncate to keep the question and the end of the piped input, or shorten it"
    return "shorten it (--truncate shortens piped input only)"


def _too_long(n: int, limit: int, name: str, *, ctx: int, trained: int, cuttable: bool) -> str:
    if ctx and (not trained or ctx < trained):
        most = f" (the model was trained for {trained:,})" if trained else ""
        return (f"the prompt is {n:,} tokens but --ctx {ctx} holds {limit:,}; raise --ctx{most}, "
                f"or {_way_out(cuttable)}")
    return (f"the prompt is {n:,} tokens but {name} holds at most {limit:,} (its trained "
            f"context); {_way_out(cuttable)}")


def _over_budget(n: int, resolved: auto.Resolved, *, cuttable: bool) -> str:
    return (f"the prompt is {n:,} tokens but the memory budget holds a context of at most "
            f"{resolved.n_ctx:,} ({resolved.ref.display}, {resolved.kv_type} KV cache); raise "
            f"--memory, or {_way_out(cuttable)}")


def _vocabulary_file(named: refs.Named, fit: FitOptions, report: Reporter) -> tuple[Path, str]:
    """A file with the model's vocabulary (every variant of a model has the same one), pulled
    first if none is on disk, as `auto.resolve` would; and the model's name for messages."""
    ref = named.ref
    if ref.path is not None:
        return ref.path, ref.display
    store = refs.model_store()
    found = store.find(ref.spec.name, ref.quant) if named.chosen else next(
        (m.path for m in store.installed() if m.name == ref.spec.name), None)
    if found is None:
        if not fit.offline and not named.chosen:   # a Hub model: the quant that fits, judged
            # by a header read remotely
            ref = auto.first_pull(ref, store, kv_type=fit.kv_type, memory_budget=fit.memory,
                                  gpu_layers=fit.gpu_layers, cpu_moe=fit.cpu_moe)
        found = refs.locate(ref, store, offline=fit.offline, progress=report.progress,
                            notify=report.notify, download_bar=report.download_bar)
    return found, ref.spec.display_name
