"""The decode loop's bookkeeping: UTF-8 across tokens, stop strings, limits, KV prefix reuse."""

from fakes import ScriptedSession

from localinfer.engine.decode import Generation, Limits, StopMatcher
from localinfer.engine.kv import KVCache, common_prefix
from localinfer.engine.sampling import SamplingParams, make_sampler

GREEDY = make_sampler(SamplingParams(temperature=0))
# "é" is b"\xc3\xa9" and "€" is b"\xe2\x82\xac": split across tokens 3/4 and 5/6.
PIECES = [b"", b"a", b"b", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"S", b"T", b"P", b" "]


def generate(script, prompt=(1, 2), **limits):
    session = ScriptedSession(PIECES, script, prompt_len=len(prompt))
    gen = Generation(KVCache(session), list(prompt), GREEDY, Limits(**limits))
    return list(gen), gen


def test_multibyte_character_split_across_tokens_is_never_printed_broken():
    pieces, gen = generate([1, 3, 4, 5, 6, 2, 0])
    assert "".join(pieces) == "aé€b"
    for piece in pieces:
        assert "\ufffd" not in piece
    assert gen.stats.finish_reason == "stop"
    assert gen.stats.generated_tokens == 6


def test_stop_string_is_cut_and_never_leaks_even_across_tokens():
    pieces, gen = generate([1, 7, 8, 9, 2, 0], stop=("STP",))
    assert "".join(pieces) == "a"
    assert gen.stats.finish_reason == "stop"


def test_partial_stop_match_is_released_when_it_does_not_complete():
    pieces, _ = generate([7, 8, 1, 0], stop=("STP",))
    assert "".join(pieces) == "STa"


def test_max_tokens_ends_with_length():
    pieces, gen = generate([1, 1, 1, 1, 1, 0], max_tokens=3)
    assert "".join(pieces) == "aaa"
    assert gen.stats.finish_reason == "length"


def test_ignore_eos_keeps_decoding():
    pieces, gen = generate([1, 0, 2, 0], max_tokens=3, ignore_eos=True)
    assert gen.stats.generated_tokens == 3


def test_context_full_ends_with_context():
    session = ScriptedSession(PIECES, [1] * 100, prompt_len=2, n_ctx=6)
    gen = Generation(KVCache(session), [1, 2], GREEDY, Limits())
    assert "".join(gen) == "aaaaa"  # the last token needs no KV slot
    assert gen.stats.finish_reason == "context"


def test_stop_matcher_earliest_of_several_stops():
    m = StopMatcher(["xyz", "b"])
    assert m.feed("aaxy") == ("aa", False)
    assert m.feed("zb") == ("", True)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_second_prompt_evaluates_only_what_differs():
    session = ScriptedSession(PIECES, [0], prompt_len=5)
    cache = KVCache(session)
    list(Generation(cache, [1, 2, 1, 2, 1], GREEDY, Limits()))
    session.evaluated.clear()
    gen = Generation(cache, [1, 2, 1, 9, 9], GREEDY, Limits())
    list(gen)
    assert session.evaluated == [9, 9]
    assert gen.stats.cached_tokens == 3


def test_identical_prompt_re_evaluates_only_the_last_token():
    session = ScriptedSession(PIECES, [0], prompt_len=3)
    cache = KVCache(session)
    list(Generation(cache, [1, 2, 1], GREEDY, Limits()))
    session.evaluated.clear()
    list(Generation(cache, [1, 2, 1], GREEDY, Limits()))
    assert session.evaluated == [1]
