"""Speculative decoding with images (issue 46): drafters see the text only, the target verifies as
before, and the answer is the plain one byte for byte. On SmolLM2 with SmolVLM's image tokens and
a tiny random-weight idefics3 projector (mmproj_writer): the mechanics, never quality."""

from __future__ import annotations

import pytest
from media_files import png
from mmproj_writer import smolvlm_text_model, write_idefics3

from localinfer import media
from localinfer.backends import LoadOptions
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.media import text_only
from localinfer.engine.prompt import chat_media_tokens
from localinfer.engine.sampling import SamplingParams, make_sampler
from localinfer.speculate import choose
from localinfer.speculate.drafters import DraftModel, MediaBlind, PromptLookup

pytestmark = pytest.mark.usefixtures("in_models_home")   # probe verdict and self-draft kept
GREEDY = SamplingParams(temperature=0)
M = media.MARKER
# Text after the image, and a list to copy, so that lookup finds runs to guess.
AFTER = f"{M}Repeat exactly, twice: red, green, blue, yellow, red, green, blue."
TWO = f"Left: {M} right: {M} Repeat exactly: one, two, three, one, two, three."


@pytest.fixture(scope="module")
def vision(tmp_path_factory, smollm_path):
    """The target with its projector loaded, the images, and its exact verification chunk."""
    from helpers import load_file
    root = tmp_path_factory.mktemp("specmedia")
    # A name of its own: the self-draft is kept in the test store under the file's stem.
    model = smolvlm_text_model(smollm_path, root / "smolvlm-specmedia.gguf")
    projector = write_idefics3(root / "mmproj-specmedia.gguf")
    for name, (w, h) in {"wide": (100, 30), "big": (200, 200)}.items():
        (root / f"{name}.png").write_bytes(png(w, h, seed=w))
    loaded = load_file(model, LoadOptions(n_ctx=1024, mmproj=str(projector)))
    pictures = {n: media.read_path(root / f"{n}.png", "image") for n in ("wide", "big")}
    yield loaded, pictures, choose.exact_chunk(loaded), root
    loaded.session.close()


@pytest.fixture(scope="module")
def self_draft(vision):
    drafter = choose.open_drafter("self", vision[0], options=LoadOptions(n_ctx=1024),
                                  offline=True, notify=print)
    yield drafter
    drafter.close()


class Watched:
    """A drafter that records every id it is shown, around the real one."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.seen = inner, inner.name, set()

    def prepare(self, prompt):
        self.seen.update(prompt)
        self.inner.prepare(prompt)

    def propose(self, context, n, policy):
        self.seen.update(context)
        draft = self.inner.propose(context, n, policy)
        self.seen.update(draft.tokens)
        return draft

    def close(self) -> None:
        self.inner.close()


def _tokens(session, text: str, pictures: list) -> list[int]:
    return chat_media_tokens(session, [{"role": "user", "content": text}], None, pictures)


def _plain(loaded, prompt, limits, cache=None):
    gen = Generation(cache or KVCache(loaded.session), prompt, make_sampler(GREEDY), limits)
    return gen, "".join(gen)


def _spec(loaded, prompt, limits, drafter, chunk, cache=None, max_draft=6):
    gen = choose.speculative(loaded, cache or KVCache(loaded.session), prompt, GREEDY, limits,
                             drafter, max_draft=max_draft, chunk=chunk, adaptive=False)
    return gen, "".join(gen)


def _check(vision, drafter, cases, limits=Limits(32), max_draft=6):
    loaded, pictures, chunk, _ = vision
    session = loaded.session
    for text, names in cases:
        prompt = _tokens(session, text, [pictures[n] for n in names])
        assert max(prompt) >= session.n_vocab                # it does hold an image
        plain, plain_text = _plain(loaded, prompt, limits)
        watched = Watched(drafter)
        spec, spec_text = _spec(loaded, prompt, limits, watched, chunk, max_draft=max_draft)
        assert spec.tokens == plain.tokens and spec_text == plain_text, text
        assert spec.stats.drafted > 0 and spec.stats.finish_reason == plain.stats.finish_reason
        assert max(watched.seen) < session.n_vocab, "the drafter was shown a placeholder"
        if isinstance(drafter, DraftModel):
            assert drafter.cache.tokens == text_only(session, prompt + spec.tokens)[
                :len(drafter.cache.tokens)]
            assert len(drafter.cache.tokens) == drafter.session.n_past


CASES = [(AFTER, ["big"]), (TWO, ["wide", "big"])]


def test_lookup_is_exact_with_images(vision):
    _check(vision, PromptLookup(), CASES)


def test_a_self_draft_is_exact_with_images(vision, self_draft):
    assert isinstance(self_draft, DraftModel)
    _check(vision, self_draft, CASES)


def test_lookup_never_matches_into_or_proposes_a_placeholder():
    """What followed the n-gram earlier was an image: blind to it, lookup proposes the text
    after it instead of its placeholders."""
    class Greedy:
        greedy = True
    context = [5, 6, 7, 100, 101, 102, 8, 9, 5, 6, 7]
    assert PromptLookup().propose(context, 3, Greedy()).tokens == [100, 101, 102]
    blind = MediaBlind(PromptLookup(), n_vocab=100)
    blind.prepare(context)
    assert blind.propose(context, 3, Greedy()).tokens == [8, 9, 5]
    assert blind.propose(context + [8], 3, Greedy()).tokens == [9, 5, 6]   # the view grows


def test_a_chat_turn_reusing_its_image_drafts_from_the_cells_it_holds(vision, self_draft):
    """Turn two repeats turn one's image: the target reuses its cells, the draft model its own
    (by prefix of the text), and both turns equal plain decoding from a cold cache."""
    loaded, pictures, chunk, _ = vision
    session = loaded.session
    turns = [{"role": "user", "content": AFTER}]
    cache, evals = KVCache(session), []
    first = _tokens(session, AFTER, [pictures["big"]])
    spec, text = _spec(loaded, first, Limits(16), self_draft, chunk, cache)
    assert spec.tokens == _plain(loaded, first, Limits(16))[0].tokens
    turns += [{"role": "assistant", "content": text},
              {"role": "user", "content": "Once more, backwards."}]
    second = chat_media_tokens(session, turns, None, [pictures["big"]])
    real_eval = self_draft.session.eval
    self_draft.session.eval = lambda tokens, **kw: evals.append(len(tokens)) or real_eval(
        tokens, **kw)
    try:
        spec2, _ = _spec(loaded, second, Limits(16), self_draft, chunk, cache)
    finally:
        del self_draft.session.eval
    assert spec2.stats.cached_tokens >= len(first)              # the image's cells kept
    assert evals[0] <= len(text_only(session, second)) - len(text_only(session, first))
    assert spec2.tokens == _plain(loaded, second, Limits(16))[0].tokens


class _Clock:
    """time.perf_counter with seeded intervals: another machine's timings."""

    def __init__(self, seed: int) -> None:
        import random
        self._rng, self._now = random.Random(seed), 0.0

    def perf_counter(self) -> float:
        self._now += self._rng.choice((0.001, 0.01, 0.2))
        return self._now


def test_a_seeded_sampled_run_with_an_image_repeats_whatever_the_timings(vision, monkeypatch):
    from localinfer.pipeline.generate import generation
    from localinfer.speculate import verify
    loaded, pictures, _, _ = vision
    prompt = _tokens(loaded.session, AFTER, [pictures["big"]])
    texts = set()
    for clock in (1, 2):
        monkeypatch.setattr(verify, "time", _Clock(clock))
        made = generation(loaded, prompt, SamplingParams(temperature=1.0, seed=7), Limits(32),
                          draft="lookup", options=loaded.options, offline=True)
        texts.add("".join(made))
        assert made.stats.drafted > 0
    assert len(texts) == 1 and "" not in texts


def test_python_generate_with_an_image_drafts_under_auto_and_answers_as_plain(vision):
    import localinfer
    _, _, _, root = vision
    with localinfer.load(str(root / "smolvlm-specmedia.gguf"),
                         mmproj=str(root / "mmproj-specmedia.gguf")) as model:
        ask = dict(images=[root / "big.png"], temperature=0, max_tokens=24, cache=False)
        plain = model.generate(AFTER.replace(M, ""), draft="none", **ask)
        drafted = model.generate(AFTER.replace(M, ""), **ask)      # --draft auto: lookup here
        assert drafted == plain and plain
        spec = model.stats.as_dict()["speculation"]
        assert spec["drafter"] == "lookup" and spec["drafted"] > 0


# -- exhaustive: more draft lengths, the target's own file as its draft, a long context ---------
@pytest.mark.exhaustive
@pytest.mark.parametrize("max_draft", [1, 3, 8])
def test_every_draft_length_is_exact_with_images(vision, self_draft, max_draft):
    for drafter in (PromptLookup(), self_draft):
        _check(vision, drafter, CASES, max_draft=max_draft)


@pytest.mark.exhaustive
def test_the_targets_own_file_as_draft_is_exact_with_images(vision):
    loaded, _, _, root = vision
    drafter = choose.open_drafter(str(root / "smolvlm-specmedia.gguf"), loaded,
                                  options=LoadOptions(n_ctx=1024), offline=True, notify=print)
    try:
        _check(vision, drafter, CASES)
    finally:
        drafter.close()


@pytest.mark.exhaustive
def test_past_512_cells_with_an_image_speculation_stays_exact(vision, self_draft):
    """Past 512 cells a single decode step would take another attention kernel than a
    verification row unless steered (backends/llama/steer.py): the image's cells included."""
    words = ", ".join(f"item {i}" for i in range(120))
    loaded, pictures, _, _ = vision
    assert len(_tokens(loaded.session, f"{M}{words}.", [pictures["big"]])) > 512
    _check(vision, self_draft, [(f"{M}{words}. Repeat the list exactly.", ["big"])],
           limits=Limits(64))
    _check(vision, PromptLookup(), [(f"{M}{words}. Repeat the list exactly.", ["big"])],
           limits=Limits(64))


@pytest.mark.exhaustive
def test_a_seeded_sampled_run_with_a_draft_model_repeats(vision, self_draft, monkeypatch):
    """The sampled rule with a draft model's q (MediaBlind cuts q with the tokens)."""
    from localinfer.speculate import verify
    loaded, pictures, chunk, _ = vision
    prompt = _tokens(loaded.session, TWO, [pictures["wide"], pictures["big"]])
    texts = set()
    for clock in (1, 2):
        monkeypatch.setattr(verify, "time", _Clock(clock))
        self_draft.cache.clear()            # fresh, as `run` opens it: q follows its batches
        gen = choose.speculative(loaded, KVCache(loaded.session), prompt,
                                 SamplingParams(temperature=1.0, seed=11), Limits(32),
                                 self_draft, max_draft=4, chunk=chunk, adaptive=False)
        texts.add("".join(gen))
        assert gen.stats.drafted > 0
    assert len(texts) == 1 and "" not in texts


@pytest.mark.exhaustive
def test_audio_with_speculation_is_exact(tmp_path, smollm_path):
    from helpers import load_file
    from media_files import wav
    from mmproj_writer import write_ultravox
    model = smolvlm_text_model(smollm_path, tmp_path / "smolvlm-specaudio.gguf")
    projector = write_ultravox(tmp_path / "mmproj-audio.gguf")
    (tmp_path / "clip.wav").write_bytes(wav(1.0))
    loaded = load_file(model, LoadOptions(n_ctx=1024, mmproj=str(projector)))
    try:
        clip = media.read_path(tmp_path / "clip.wav", "audio")
        vision = (loaded, {"clip": clip}, choose.exact_chunk(loaded), tmp_path)
        _check(vision, PromptLookup(), [(AFTER, ["clip"])])
    finally:
        loaded.session.close()
