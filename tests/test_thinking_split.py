"""The trace cut from the answer as text streams: every cut of the stream, inside a marker or
not, gives the same trace and answer as the whole text; no marker leaks into either."""

import pytest

from localinfer.thinking.split import (ANSWER, REASONING, HarmonySplitter, TagSplitter, split_text,
                                       splitter)
from localinfer.thinking.style import Style, detect, empty_trace, template_vars

TAGS, INSIDE, HARMONY = Style("tags"), Style("tags", starts_inside=True), Style("harmony", header="assistant")

# (style, generated text, expected trace, expected answer)
CASES = [
    (TAGS, "<think>\nLet me add 2 and 2.\n</think>\n\n4", "Let me add 2 and 2.", "4"),
    (TAGS, "<think></think>The answer.", "", "The answer."),
    (TAGS, "No trace at all, <think> later is text.", "", "No trace at all, <think> later is text."),
    (TAGS, "\n<think>a < b and </thin is not the end</think>ok", "a < b and </thin is not the end", "ok"),
    (TAGS, "<think>\nstill thinking when the tokens ran out", "still thinking when the tokens ran out", ""),
    (TAGS, "<thin", "", "<thin"),
    (INSIDE, "Hmm, 3 times 3.\n</think>\n\n9", "Hmm, 3 times 3.", "9"),
    (INSIDE, "</think>\n\nAt once.", "", "At once."),
    (HARMONY, "<|channel|>analysis<|message|>User wants 2+2.<|end|><|start|>assistant<|channel|>final"
              "<|message|>4", "User wants 2+2.", "4"),
    (HARMONY, "<|channel|>final<|message|>Straight answer.", "", "Straight answer."),
    (HARMONY, "<|channel|>analysis<|message|>thinking on and on", "thinking on and on", ""),
    (HARMONY, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final"
              "<|message|>Done.", "", "Checking.Done."),
    (Style("harmony"), "plain text from a model that ignores harmony " * 10, "",
     "plain text from a model that ignores harmony " * 10),
]


def _stream(style: Style, pieces: list[str]) -> tuple[str, str]:
    cut = splitter(style)
    parts = [p for piece in pieces for p in cut.feed(piece)] + cut.flush()
    assert all(p.kind in (REASONING, ANSWER) and p.text for p in parts)
    return ("".join(p.text for p in parts if p.kind == REASONING),
            "".join(p.text for p in parts if p.kind == ANSWER))


@pytest.mark.parametrize("style,text,trace,answer", CASES)
def test_whole_text_splits(style, text, trace, answer):
    assert split_text(style, text) == (trace, answer)


@pytest.mark.parametrize("style,text,trace,answer", CASES)
def test_every_cut_of_the_stream_gives_the_same_split(style, text, trace, answer):
    assert _stream(style, list(text)) == (trace, answer)       # one character at a time
    for at in range(len(text) + 1):                            # one cut anywhere
        assert _stream(style, [text[:at], text[at:]]) == (trace, answer), at


def test_marker_never_emitted_before_it_is_settled():
    cut = TagSplitter(starts_inside=True)
    assert [p.text for p in cut.feed("step one </th")] == ["step one"]
    assert cut.in_trace
    assert cut.feed("ink>\n\nDone") == [("answer", "Done")]
    assert not cut.in_trace and cut.answered and cut.thought


def test_harmony_trace_state():
    cut = HarmonySplitter("assistant")
    cut.feed("<|channel|>analysis<|message|>thinking")
    assert cut.in_trace and not cut.answered


def test_no_style_leaves_text_alone():
    assert split_text(None, "<think>x</think>y") == ("", "<think>x</think>y")


QWEN3_LIKE = "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and " \
             "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
HARMONY_LIKE = "<|start|>assistant<|channel|>final<|message|>{{ reasoning_effort }}"


def test_detect_styles_from_template_and_vocabulary():
    no_tokens = lambda text: False
    assert detect(QWEN3_LIKE, "<|im_start|>assistant\n", no_tokens) == Style("tags", switch="enable_thinking")
    assert detect("{{ '<think>\\n' }}</think>", "x<think>\n", no_tokens).starts_inside
    harmony = detect(HARMONY_LIKE, "<|start|>user<|message|>hi<|end|><|start|>assistant", no_tokens)
    assert harmony == Style("harmony", header="assistant", switch="reasoning_effort")
    assert detect("{{ messages[0].content }}", "hi", no_tokens) is None
    assert detect(None, "hi", lambda text: text in ("<think>", "</think>")) == Style("tags")


def test_think_values_map_to_the_template_switch():
    qwen, oss = Style("tags", switch="enable_thinking"), Style("harmony", switch="reasoning_effort")
    assert template_vars("off", qwen) == {"enable_thinking": False}
    assert template_vars("on", qwen) == {"enable_thinking": True}
    assert template_vars("high", oss) == {"reasoning_effort": "high"}
    assert template_vars(None, qwen) == {}
    # A tags model without a switch gets an empty trace written after the prompt instead.
    assert empty_trace("off", Style("tags")) == "<think>\n\n</think>\n\n"
    assert empty_trace("off", Style("tags", starts_inside=True)) == "\n</think>\n\n"
    assert empty_trace("off", qwen) == "" and empty_trace("on", Style("tags")) == ""
