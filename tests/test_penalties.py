"""frequency_penalty, presence_penalty and logit_bias (issue 44): llama.cpp's arithmetic over the
penalties' window, refusals of values out of range, and on SmolLM2 greedy output with penalties
identical with and without a drafter (the verification penalises the same history)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ERROR, error_line, load_file, prompt_tokens, run_cli

from localinfer.backends import LoadOptions
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.sampling import SamplingParams, make_sampler, penalise
from localinfer.errors import UsageError
from localinfer.server.errors import BadRequest
from localinfer.server.requests import Defaults, prepare

GREEDY = SamplingParams(temperature=0)
# A document to copy: prompt lookup drafts most of the answer, so most tokens are verified.
COPY = ("Write this sentence out again, word for word: the quick brown fox jumps over the lazy "
        "dog while the small red hen watches from the old wooden fence.")


def test_penalties_are_llama_cpps_arithmetic_over_the_window():
    logits = np.array([2.0, -1.0, 3.0, 0.5, 1.0], dtype=np.float32)
    params = SamplingParams(temperature=0, repeat_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25, repeat_last_n=4, logit_bias=((4, 10.0),))
    # The window is the last 4 tokens: token 2 twice, 1 and 0 once; token 3 fell out of it.
    out = penalise(logits, [3, 3, 0, 2, 1, 2], params)
    assert out.tolist() == pytest.approx([2 / 2 - 0.5 - 0.25, -1 * 2 - 0.5 - 0.25,
                                          3 / 2 - 1.0 - 0.25, 0.5, 11.0])
    assert logits.tolist() == [2.0, -1.0, 3.0, 0.5, 1.0]        # the row itself is untouched
    assert make_sampler(params)(logits, [3, 3, 0, 2, 1, 2]) == 4


def test_a_window_of_0_penalises_nothing():
    """Ollama's repeat_last_n 0 turns penalties off; history[-0:] used to be the whole history."""
    logits = np.array([2.0, 1.0], dtype=np.float32)
    params = SamplingParams(temperature=0, repeat_penalty=10.0, frequency_penalty=2.0,
                            repeat_last_n=0)
    assert penalise(logits, [0, 0, 0], params).tolist() == [2.0, 1.0]
    assert make_sampler(params)(logits, [0, 0, 0]) == 0


@pytest.mark.parametrize("fields, words", [
    ({"frequency_penalty": 2.5}, "--frequency-penalty"), ({"presence_penalty": -3}, "--presence"),
    ({"frequency_penalty": float("nan")}, "--frequency-penalty"),
    ({"logit_bias": ((5, 101.0),)}, "--logit-bias"), ({"logit_bias": ((-1, 1.0),)}, "token -1"),
])
def test_values_out_of_range_are_refused(fields, words):
    with pytest.raises(UsageError, match=words):
        SamplingParams(**fields)


def test_a_bias_past_the_vocabulary_is_refused_when_sampling():
    with pytest.raises(UsageError, match="token 9 is not in the vocabulary"):
        make_sampler(SamplingParams(logit_bias=((9, 1.0),)))(np.zeros(4, np.float32), [])


def test_speculative_sampling_draws_from_the_penalised_distribution():
    """Greedy verification goes through the plain sampler; sampled verification through
    SamplingPolicy.distribution, which must see the same bias and penalties."""
    from localinfer.engine.sampling import candidate_probs
    from localinfer.speculate.verify import SamplingPolicy
    logits = np.array([3.0, 2.9, 2.8, 1.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                            frequency_penalty=1.0, presence_penalty=0.5, logit_bias=((3, 2.5),))
    ids, probs = SamplingPolicy(params).distribution(logits, [0, 0, 1])
    want_ids, want = candidate_probs(penalise(logits, [0, 0, 1], params), params)
    assert ids.tolist() == want_ids.tolist() == [3, 2, 1, 0]
    assert probs.tolist() == pytest.approx(want.tolist())


@pytest.fixture(scope="module")
def smollm(smollm_path):
    loaded = load_file(smollm_path, LoadOptions(n_ctx=1024))
    yield loaded
    loaded.session.close()


def _greedy(loaded, prompt, params, drafter=None) -> tuple[list[int], object]:
    from localinfer.speculate import choose
    cache = KVCache(loaded.session)
    if drafter is None:
        gen = Generation(cache, prompt, make_sampler(params), Limits(48))
    else:
        gen = choose.speculative(loaded, cache, prompt, params, Limits(48), drafter, max_draft=6,
                                 adaptive=False)
    "".join(gen)
    return gen.tokens, gen


@pytest.mark.slow
def test_greedy_with_penalties_is_the_same_with_a_drafter(smollm):
    from localinfer.speculate.drafters import PromptLookup
    prompt = prompt_tokens(smollm, COPY)
    plain, _ = _greedy(smollm, prompt, GREEDY)
    for params in (SamplingParams(temperature=0, frequency_penalty=0.8),
                   SamplingParams(temperature=0, frequency_penalty=-0.3, presence_penalty=0.6),
                   SamplingParams(temperature=0, logit_bias=((plain[2], -100.0),))):
        penalised, _ = _greedy(smollm, prompt, params)
        assert penalised != plain                   # the penalty changed the answer
        drafted, gen = _greedy(smollm, prompt, params, PromptLookup())
        assert gen.stats.drafted > 0 and drafted == penalised, params


@pytest.mark.slow
def test_the_openai_fields_are_checked_against_this_vocabulary(smollm):
    body = {"model": "m", "prompt": "Hello", "max_tokens": 4}

    def made(**fields):
        return prepare({**body, **fields}, smollm.session, ("m",), 512, chat=False,
                       defaults=Defaults(GREEDY))
    for fields, words in (({"logit_bias": {"49152": 1}}, "'logit_bias' names '49152'"),
                          ({"logit_bias": {"x": 1}}, "'logit_bias' names 'x'"),
                          ({"logit_bias": {"5": -101}}, "'logit_bias' of token 5"),
                          ({"frequency_penalty": 2.01}, "'frequency_penalty' must be"),
                          ({"presence_penalty": "1"}, "'presence_penalty' must be")):
        with pytest.raises(BadRequest, match=words):
            made(**fields)
    assert made(logit_bias={"49151": -100}, frequency_penalty=-2).job.sampler is not None


@pytest.mark.slow
def test_the_cli_bans_a_token_and_refuses_a_bad_bias(smollm):
    from localinfer.engine.prompt import raw_tokens
    prompt = "The capital of France is"
    first = _greedy(smollm, raw_tokens(smollm.session, prompt), GREEDY)[0][0]
    args = ("run", "smollm2", "--offline", "--raw", prompt, "--temp", "0", "-n", "4")
    plain, banned = run_cli(*args), run_cli(*args, "--logit-bias", f"{first}=-100")
    assert plain.returncode == banned.returncode == 0, banned.stderr
    assert plain.stdout.startswith(smollm.session.piece(first).decode())
    assert not banned.stdout.startswith(smollm.session.piece(first).decode())
    mapped = run_cli("map", "smollm2", "--offline", "--raw", "{}", "--temp", "0", "-n", "4",
                     "--logit-bias", f"{first}=-100", input=prompt + "\n")
    assert mapped.returncode == 0 and mapped.stdout.strip() == banned.stdout.strip()
    bad = run_cli("run", "smollm2", "--offline", "--raw", "Hi", "--logit-bias", "7")
    assert bad.returncode == 2 and error_line(bad).startswith(ERROR + "--logit-bias '7'")
    far = run_cli("run", "smollm2", "--offline", "--raw", "Hi", "--logit-bias", "99999=1")
    assert far.returncode == 2 and "token 99999 is not in the vocabulary" in error_line(far)
