"""A loaded model and a prompt's tokens to the generator that decodes them: plain, constrained to
a grammar, or speculative with the drafter `--draft` names (which falls back to plain)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from localinfer.fit.options import FitOptions, Reporter
from localinfer.thinking.style import Think

if TYPE_CHECKING:
    from localinfer.backends import LoadOptions
    from localinfer.cache.prompt_cache import PromptCache
    from localinfer.engine.decode import Generation, Limits
    from localinfer.engine.load import LoadedModel
    from localinfer.engine.sampling import SamplingParams
    from localinfer.engine.structured import OutputFormat
    from localinfer.fit.request import Request
    from localinfer.models import refs
    from localinfer.pipeline.similar import Similar
    from localinfer.speculate.verify import SpeculativeGeneration


def generation(loaded: LoadedModel, tokens: list[int], params: SamplingParams, limits: Limits, *,
               draft: str = "auto", draft_max: int = 8, offline: bool = False,
               options: LoadOptions, output: OutputFormat | None = None,
               store: PromptCache | None = None, report: Reporter = Reporter(),
               probe_note: bool = False, think: Think = Think(),
               raw: bool = False) -> Generation | SpeculativeGeneration:
    """Plain decoding, or speculative decoding with the drafter `draft` names (`draft_max` 0: none);
    constrained to `output`'s grammar when there is one. `store` is the prompt cache to restore
    from and fill; `probe_note`: the exactness probe, when it must run, says so to `report`.
    A thinking model's generation has its `style` set; `output` then constrains the answer
    after the trace, and `think.budget` ends the trace."""
    from dataclasses import replace

    from localinfer.engine.constrain import sampler_for
    from localinfer.engine.decode import Generation
    from localinfer.engine.kv import KVCache
    from localinfer.engine.structured import answer_limit
    from localinfer.thinking import setup
    session = loaded.session
    cache = KVCache(session, store)
    grammar = session.grammar(output.gbnf) if output else None
    style = setup.style_of(session, tokens, raw)
    setup.check_asked(style, think, loaded.ref.display, raw)
    # A constrained answer asked for with no -n ends within its grammar's bound (or the reply room).
    limits = replace(limits, max_tokens=answer_limit(output, limits.max_tokens,
                                                     thinks=style is not None))
    grammar = setup.gate_for(session, style, think, grammar) or grammar
    shown = setup.shown_markers(session, style)
    limits = replace(limits, shown=shown) if shown else limits

    def styled(made):
        made.style = style
        return made

    def plain() -> Generation:
        return styled(Generation(cache, tokens, sampler_for(params, grammar), limits))
    # A seeded draw must repeat on any machine under any load, but the adaptive controller's
    # draft lengths follow measured times, and each round's length decides which random numbers
    # the speculative rule consumes. So a seeded sampled run does not draft under `auto`, and a
    # named drafter drafts a fixed --draft-max per round.
    seeded = params.temperature > 0 and params.rng_seed is not None
    # With images or audio the drafter sees the text only (speculate/drafters.MediaBlind).
    if draft_max == 0 or draft == "none" or (seeded and draft == "auto"):
        return plain()
    from localinfer.speculate import choose
    drafter = choose.open_drafter(draft, loaded, options=options, offline=offline,
                                  notify=report.notify)
    if drafter is None:
        return plain()
    return styled(choose.speculative(loaded, cache, tokens, params, limits, drafter,
                                     max_draft=draft_max, grammar=grammar, adaptive=not seeded,
                                     notify=report.notify if probe_note else None))


@dataclass(frozen=True)
class Ask:
    """What a request asks of the generation, beyond the model and its fit."""

    params: SamplingParams
    limits: Limits
    draft: str = "auto"
    draft_max: int = 8
    output: OutputFormat | None = None
    use_cache: bool = True          # restore from and fill the prompt cache
    think: Think = Think()          # a thinking model's --think and --think-budget
    reuse: bool = False             # --reuse-answers: answer from / add to the answer store
    similar: Similar | None = None  # --reuse-similarity: by meaning too (pipeline/similar.py)


def prepare(named: refs.Named, request: Request, fit: FitOptions, ask: Ask,
            report: Reporter = Reporter(), *, backend: str = "auto", threads: int = 0,
            engine_log: bool = False, loaded: LoadedModel | None = None,
            probe_note: bool = False) -> tuple[LoadedModel, Generation | SpeculativeGeneration]:
    """`run`'s path for one prompt: the model fitted and loaded for it (`loaded` kept when the fit
    asks for what it already is), and the generator that will decode its answer."""
    from localinfer.cache import prompt_cache
    from localinfer.pipeline import reuse
    from localinfer.pipeline.load import open_for
    if ask.reuse:
        request = reuse.normalised(request)
    loaded, options, tokens = open_for(named, request, fit, report, backend=backend,
                                       threads=threads, engine_log=engine_log, loaded=loaded)

    def build(draft_max: int):
        return generation(loaded, tokens, ask.params, ask.limits, draft=ask.draft,
                          draft_max=draft_max, offline=fit.offline, options=options,
                          output=ask.output, report=report, probe_note=probe_note,
                          store=prompt_cache.open_for(loaded.session, enabled=ask.use_cache),
                          think=ask.think, raw=request.prompt.raw)
    made = reuse.reusing(loaded.session, tokens, ask, build, raw=request.prompt.raw,
                         notify=report.notify, prompt=request.prompt, offline=fit.offline)
    made.stats.load_s = loaded.load_s
    return loaded, made


def incomplete_answer(ask: Ask, text: str, made: Generation | SpeculativeGeneration,
                      loaded: LoadedModel) -> str | None:
    """Why a schema's answer is not a whole document (a limit cut it short), or None: "stop" is
    a stop string only when one is in what the model wrote (the text stops before it), else the
    model's end-of-generation token."""
    from localinfer.engine.structured import incomplete
    if not ask.output:
        return None
    finish, stops = made.stats.finish_reason, ask.limits.stop
    written = loaded.session.detokenize(made.tokens).decode("utf-8", "replace") \
        if finish == "stop" and stops else ""
    return incomplete(ask.output, text, finish, stop_string=any(s and s in written for s in stops))
