"""server/logprob_shapes.py on a vocabulary written here: which scored tokens a stream's text
holds (a character split across tokens goes with the chunk that completes it, a stop string's
tokens nowhere), and the shapes' text, bytes, offsets and figures JSON can carry."""

from __future__ import annotations

from types import SimpleNamespace

from localinfer.engine.logprobs import TokenLogprob
from localinfer.server import logprob_shapes as shapes

PIECES = {1: b"Hi", 2: b" caf", 3: b"\xc3", 4: b"\xa9", 5: b" STOP", 6: b""}


class Vocabulary:
    def piece(self, token: int) -> bytes:
        return PIECES[token]

    def token_text(self, token: int) -> str:
        return "<|end|>"


def _job(tokens: list[int], text: str):
    scored = [TokenLogprob(t, -0.5 * (i + 1), ((t, -0.1),)) for i, t in enumerate(tokens)]
    return SimpleNamespace(tokens=tokens, logprobs=scored, text=text)


def test_a_split_character_goes_with_the_chunk_that_completes_it():
    job = _job([1, 2, 3, 4], "Hi café")
    follow = shapes.Following(Vocabulary(), job)
    assert [s.token for s in follow.upto(len("Hi caf"))] == [1, 2]
    assert follow.upto(len("Hi caf")) == []          # the first half waits for its character
    assert [s.token for s in follow.upto(len("Hi café"))] == [3, 4]
    assert follow.rest() == []


def test_a_stop_strings_tokens_are_listed_nowhere():
    job = _job([1, 2, 5], "Hi caf")                 # " STOP" was the stop string
    follow = shapes.Following(Vocabulary(), job)
    assert [s.token for s in follow.upto(len("Hi"))] == [1]
    assert [s.token for s in follow.rest()] == [2]
    assert [s.token for s in shapes.shown(Vocabulary(), job)] == [1, 2]


def test_shapes_carry_bytes_offsets_and_json_figures():
    vocab = Vocabulary()
    entry = shapes.entry(vocab, TokenLogprob(3, float("-inf"), ((4, float("nan")),)))
    assert entry == {"token": "\ufffd", "logprob": shapes.NEVER, "bytes": [0xc3],
                     "top_logprobs": [{"token": "\ufffd", "logprob": None, "bytes": [0xa9]}]}
    legacy = shapes.legacy(vocab, [1, 2, 3, 4, 6], [None, *_job([2, 3, 4, 6], "").logprobs],
                           offset=10)
    assert legacy["tokens"] == ["Hi", " caf", "\ufffd", "\ufffd", "<|end|>"]
    assert legacy["text_offset"] == [10, 12, 16, 16, 17]     # both halves where "é" starts
    assert legacy["token_logprobs"][0] is None and legacy["top_logprobs"][0] is None
    assert legacy["top_logprobs"][1] == {" caf": -0.1}      # the chosen token among the top
    assert shapes.decoded(vocab, [1, 2, 3, 4]) == "Hi café"
