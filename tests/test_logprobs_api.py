"""Log-probabilities on the server's APIs (issue 44): OpenAI's chat `logprobs`/`top_logprobs`
whole and streamed, /v1/completions' legacy object with `echo` over token-id prompts, the
Responses API's `include`, and Ollama's `logprobs`, each checked against the same model run
in-process (its logits, log-softmaxed here) rather than for being present."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from helpers import load_file, log_probs, post_json, prompt_tokens

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct:Q4_1"
CLOSE = 1e-4        # one engine, the same arithmetic: only the batch's shape differs


@pytest.fixture(scope="module")
def server(smollm_server_512):
    return smollm_server_512


@pytest.fixture(scope="module")
def model(smollm_path):
    """The same file in a single-sequence session of this process: the independent figures."""
    from localinfer.backends import LoadOptions
    loaded = load_file(smollm_path, LoadOptions(n_ctx=512))
    yield loaded
    loaded.session.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def greedy(session, prompt: list[int], n: int) -> list[tuple[int, float, int]]:
    """n greedy tokens after `prompt`: (token, its log-probability, the runner-up)."""
    out, tokens = [], list(prompt)
    for _ in range(n):
        row = log_probs(session, tokens)[-1]
        best, second = np.argsort(-row)[:2]
        if session.is_eog(int(best)):
            break
        out.append((int(best), float(row[best]), int(second)))
        tokens.append(int(best))
    return out


def test_chat_logprobs_are_the_models_whole_and_streamed(client, model):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
               temperature=0, max_tokens=8, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**ask)
    entries = whole.choices[0].logprobs.content
    prompt = prompt_tokens(model, "Name three colours.")
    assert whole.usage.prompt_tokens == len(prompt)
    expected = greedy(model.session, prompt, len(entries))
    assert len(entries) == len(expected) == whole.usage.completion_tokens
    session = model.session
    for entry, (token, logprob, second) in zip(entries, expected):
        assert bytes(entry.bytes) == session.piece(token)
        assert abs(entry.logprob - logprob) < CLOSE
        assert [bytes(t.bytes) for t in entry.top_logprobs] == \
            [session.piece(token), session.piece(second)]
        assert entry.top_logprobs[0].logprob == entry.logprob
    assert "".join(e.token for e in entries) == whole.choices[0].message.content

    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs:
            mine = chunk.choices[0].logprobs.content
            # each chunk carries the entries of the tokens whose text it holds
            assert "".join(e.token for e in mine) == (chunk.choices[0].delta.content or "")
            streamed += mine
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_chat_without_logprobs_says_null(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    assert reply.choices[0].logprobs is None


def test_completions_echo_scores_token_id_prompts_as_the_model_does(client, model):
    session = model.session
    texts = ["The capital of France is Paris", "Two plus two makes four. " * 20]    # > 64
    prompts = [session.tokenize(t, special=False) for t in texts]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True,
                                      logprobs=1, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice, tokens, text in zip(reply.choices, prompts, texts):
        lp = choice.logprobs
        assert choice.text == text and len(lp.tokens) == len(tokens)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        rows = log_probs(session, tokens)
        for i in range(1, len(tokens)):
            assert abs(lp.token_logprobs[i] - rows[i - 1][tokens[i]]) < CLOSE
            best = int(rows[i - 1].argmax())
            shown = session.piece(best).decode() or session.token_text(best)    # a control
            assert abs(lp.top_logprobs[i][shown] -
                       rows[i - 1][best]) < CLOSE
        # each token's text where its offset says
        ends = lp.text_offset[1:] + [len(choice.text)]
        assert [choice.text[a:b] for a, b in zip(lp.text_offset, ends)] == lp.tokens


def test_completions_echo_with_a_token_as_lm_eval_asks(client, model):
    """lm-evaluation-harness: echo, logprobs 1, max_tokens 1: the prompt's figures, then the one
    generated token's (the log-probability of the greedy answer after the whole prompt)."""
    session = model.session
    tokens = session.tokenize("One, two, three,", special=False)
    reply = client.completions.create(model=MODEL, prompt=[tokens], max_tokens=1, echo=True,
                                      logprobs=1, temperature=0)
    lp = reply.choices[0].logprobs
    assert len(lp.token_logprobs) == len(tokens) + 1
    [(token, logprob, _)] = greedy(session, tokens, 1)
    assert lp.tokens[-1] == session.piece(token).decode()
    assert abs(lp.token_logprobs[-1] - logprob) < CLOSE
    assert reply.choices[0].text == "One, two, three," + lp.tokens[-1]


def test_streamed_completions_carry_the_same_logprobs(client):
    ask = dict(model=MODEL, prompt=["Once upon a time", "The sea is"], max_tokens=6,
               temperature=0, logprobs=3)
    whole = client.completions.create(**ask)
    parts: dict[int, list] = {0: [], 1: []}
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(**ask, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs:
                parts[c.index] += list(zip(c.logprobs.tokens, c.logprobs.token_logprobs,
                                           c.logprobs.text_offset))
    for choice in whole.choices:
        lp = choice.logprobs
        assert texts[choice.index] == choice.text
        assert parts[choice.index] == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset))
        assert all(len(top) in (3, 4) for top in lp.top_logprobs)


@pytest.mark.parametrize("body, words", [
    ({"prompt": [[1, 2], []]}, "empty list"),
    ({"prompt": [5, 49152]}, "not a token id"),
    ({"prompt": [[1], "text"]}, "mixes kinds"),
    ({"prompt": [True, 1]}, "mixes kinds"),
    ({"prompt": ["x"] * 65}, "65 prompts"),
    ({"prompt": []}, "non-empty"),
    ({"prompt": "x", "logprobs": 21}, "from 0 to 20"),
    ({"prompt": "x", "logprobs": True}, "from 0 to 20"),
    ({"prompt": "x", "echo": "yes"}, "true or false"),
])
def test_bad_prompts_and_logprobs_are_400s_naming_the_field(server, body, words):
    status, reply = post_json(server + "/v1/completions", {"model": MODEL, "max_tokens": 1,
                                                           **body})
    assert status == 400 and words in reply["error"]["message"], reply
    assert reply["error"]["param"] in ("prompt", "logprobs", "echo")


@pytest.mark.parametrize("extra, param", [({"top_logprobs": 2}, "top_logprobs"),
                                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                          ({"logprobs": 1}, "logprobs")])
def test_bad_chat_logprobs_are_400s(server, extra, param):
    status, reply = post_json(server + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **extra})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_the_tokenizer_endpoints_are_the_models(server, model):
    session = model.session
    status, said = post_json(server + "/tokenize", {"prompt": "Hello there<|im_end|>",
                                                    "add_special_tokens": False})
    assert status == 200 and said["tokens"] == session.tokenize("Hello there<|im_end|>",
                                                                special=True)
    status, back = post_json(server + "/detokenize", {"tokens": said["tokens"]})
    assert back == {"prompt": "Hello there<|im_end|>"}
    with urllib.request.urlopen(server + "/tokenizer_info") as r:
        info = json.loads(r.read())
    assert info["eos_token"] == session.token_text(session.eos_token)


def expect_greedy(session, prompt: list[int], got: list[tuple[str, float, list[str]]]) -> None:
    """Entries (text, logprob, the top alternatives' texts) are the model's greedy tokens."""
    expected = greedy(session, prompt, len(got))
    assert got and len(got) == len(expected)
    for (text, logprob, top), (token, want, second) in zip(got, expected):
        assert text == session.piece(token).decode()
        assert abs(logprob - want) < CLOSE
        assert top == [session.piece(token).decode(), session.piece(second).decode()]


def test_responses_include_logprobs_whole_and_streamed(client, model):
    ask = dict(model=MODEL, input="Name three colours.", temperature=0, max_output_tokens=8,
               include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**ask)
    part = whole.output[-1].content[0]
    prompt = prompt_tokens(model, "Name three colours.")
    assert whole.usage.input_tokens == len(prompt) and whole.top_logprobs == 2
    expect_greedy(model.session, prompt, [(e.token, e.logprob, [t.token for t in e.top_logprobs])
                                          for e in part.logprobs])
    assert "".join(e.token for e in part.logprobs) == part.text
    streamed = []
    for event in client.responses.create(**ask, stream=True):
        if event.type == "response.output_text.delta":
            assert "".join(e.token for e in event.logprobs) == event.delta
            streamed += [(e.token, e.logprob) for e in event.logprobs]
        if event.type == "response.output_text.done":
            assert [(e.token, e.logprob) for e in event.logprobs] == streamed
    assert streamed == [(e.token, e.logprob) for e in part.logprobs]


def test_ollama_logprobs_chat_and_raw_generate(server, model):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server)
    options = {"temperature": 0, "num_predict": 6}
    chat = client.chat(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
                       logprobs=True, top_logprobs=2, options=options)
    expect_greedy(model.session, prompt_tokens(model, "Name three colours."),
                  [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.logprobs])
    from localinfer.engine.prompt import raw_tokens
    said = client.generate(model=MODEL, prompt="The sea is", raw=True, logprobs=True,
                           top_logprobs=2, options=options)
    expect_greedy(model.session, raw_tokens(model.session, "The sea is"),
                  [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in said.logprobs])
    parts = list(client.generate(model=MODEL, prompt="The sea is", raw=True, logprobs=True,
                                 top_logprobs=2, options=options, stream=True))
    for part in parts:
        assert "".join(e.token for e in part.logprobs or ()) == part.response
    assert [(e.token, e.logprob) for p in parts for e in p.logprobs or ()] == \
        [(e.token, e.logprob) for e in said.logprobs]
    status, reply = post_json(server + "/api/generate", {"model": MODEL, "prompt": "x",
                                                         "top_logprobs": 2})
    assert status == 400 and "logprobs" in reply["error"]


def test_n_choices_share_the_echoed_prompts_figures_and_list_the_end_token(client, model):
    session = model.session
    prompt = prompt_tokens(model, "Hi")          # answered in 9 tokens, then the end
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, echo=True,
                                      logprobs=1, temperature=0, n=2)
    first, second = reply.choices
    assert first.logprobs.token_logprobs[:len(prompt)] == \
        second.logprobs.token_logprobs[:len(prompt)]
    assert first.finish_reason == "stop"
    # the end of generation is listed last, as OpenAI lists it: its text is not the answer's
    answer = greedy(session, prompt, 30)
    rows = log_probs(session, prompt + [t for t, _, _ in answer])
    end = int(rows[-1].argmax())
    assert session.is_eog(end) and first.logprobs.tokens[-1] == session.token_text(end)
    assert abs(first.logprobs.token_logprobs[-1] - rows[-1][end]) < CLOSE
    assert len(first.logprobs.tokens) == len(prompt) + len(answer) + 1
