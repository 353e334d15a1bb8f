"""`localinfer bench`: prefill and decode speed through the same decode loop `run` uses.

The tests mirror llama-bench so the two can be compared: pp = one prompt of n_prompt tokens into an
empty cache; tg = n_gen single-token steps from an almost empty cache; one warm-up run of each first.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.load import LoadedModel
from localinfer.engine.prompt import with_bos
from localinfer.engine.sampling import SamplingParams, make_sampler

_FILLER = ("The quick brown fox jumps over the lazy dog while the river runs to the sea. "
           "Numbers like 42, 1.5 and 1024 appear; so do names, places and punctuation! ")


def measure(loaded: LoadedModel, *, n_prompt: int, n_gen: int, repetitions: int,
            progress: Callable[[str], None] | None = None) -> dict:
    session = loaded.session
    cache = KVCache(session)
    prompt = _prompt_tokens(session, n_prompt)
    start = [prompt[0]]
    greedy = make_sampler(SamplingParams(temperature=0))
    prefill, ttft, decode = [], [], []
    for rep in range(repetitions + 1):          # rep 0 warms caches and is not counted
        cache.clear()
        pp = _run(cache, prompt, greedy, 1)
        cache.clear()
        tg = _run(cache, start, greedy, n_gen + 1)   # n_gen decode steps after the first token
        if rep == 0:
            continue
        prefill.append(pp.prefill_tps)
        ttft.append(pp.ttft_s)
        decode.append(tg.decode_tps)
        if progress:
            progress(f"run {rep}/{repetitions}: pp {pp.prefill_tps:.1f} t/s, "
                     f"tg {tg.decode_tps:.1f} t/s")
    return {
        "model": loaded.ref.display, "path": str(loaded.path), "backend": loaded.backend,
        "threads": _threads(loaded), "n_prompt": n_prompt, "n_gen": n_gen,
        "repetitions": repetitions, "load_s": round(loaded.load_s, 4),
        "kv_path": getattr(session, "kv_path", None),
        "prefill_tps": _summary(prefill), "decode_tps": _summary(decode), "ttft_s": _summary(ttft),
    }


def logprobs_cost(loaded: LoadedModel, *, top: int, n_gen: int, repetitions: int,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Decode speed with log-probabilities (`top` alternatives each) against without: the two
    alternate within each repetition (after one warm-up pair), so a machine's drift between
    them cancels; the ratio is the median of the repetitions' ratios."""
    cache = KVCache(loaded.session)
    start = [_prompt_tokens(loaded.session, 1)[0]]
    greedy = make_sampler(SamplingParams(temperature=0))
    plain, scored, ratios = [], [], []
    for rep in range(repetitions + 1):
        pair = []
        for logprobs in (None, top) if rep % 2 else (top, None):
            cache.clear()
            pair.append(_run(cache, start, greedy, n_gen + 1, logprobs).decode_tps)
        without, with_ = pair if rep % 2 else pair[::-1]
        if rep == 0:
            continue
        plain.append(without)
        scored.append(with_)
        ratios.append(with_ / without)
        if progress:
            progress(f"run {rep}/{repetitions}: tg {without:.1f} t/s, with logprobs "
                     f"{with_:.1f} t/s ({with_ / without:.3f}x)")
    steps = _interleaved(cache, start, top, n_gen, repetitions)
    return {"model": loaded.ref.display, "backend": loaded.backend, "threads": _threads(loaded),
            "n_vocab": loaded.session.n_vocab, "top_logprobs": top, "n_gen": n_gen,
            "repetitions": repetitions, "decode_tps": _summary(plain),
            "decode_tps_logprobs": _summary(scored), "ratio": _summary(ratios),
            "interleaved": steps}


def _interleaved(cache: KVCache, start: list[int], top: int, n_gen: int,
                 repetitions: int) -> dict:
    """Decode steps scored and not, alternating token by token (the Emitter's score after the
    greedy choice): a busy machine slows both kinds alike, which whole runs cannot promise.
    The ratio is the median plain step's time over the median scored step's."""
    from localinfer.engine.logprobs import token_logprob
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repetitions):
        cache.clear()
        logits, _ = cache.prefill(start)
        token = int(logits.argmax())
        for i in range(n_gen):
            begin = time.perf_counter()
            logits = cache.step(token)
            token = int(logits.argmax())
            if i % 2:
                token_logprob(logits, token, top)
            times[i % 2].append(time.perf_counter() - begin)
    plain, scored = (statistics.median(t) for t in times)
    return {"steps": n_gen * repetitions, "plain_step_ms": round(plain * 1000, 3),
            "scored_step_ms": round(scored * 1000, 3), "ratio": round(plain / scored, 4)}


def _run(cache: KVCache, prompt: list[int], sampler, n_tokens: int,
         logprobs: int | None = None):
    generation = Generation(cache, prompt, sampler, Limits(max_tokens=n_tokens, ignore_eos=True,
                                                           logprobs=logprobs))
    for _ in generation:
        pass
    return generation.stats


def _prompt_tokens(session, n: int) -> list[int]:
    text_tokens = session.tokenize(_FILLER, special=False)
    tokens = with_bos(session, [])
    while len(tokens) < n:
        tokens.extend(text_tokens)
    return tokens[:n]


def _threads(loaded: LoadedModel) -> int:
    return getattr(loaded.session, "n_threads", 0)


def _summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "values": [round(v, 3) for v in values]}
