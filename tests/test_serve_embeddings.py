"""serve's embeddings endpoints (issue 28 §4) on both real models, through the official clients
against a live server: OpenAI's /v1/embeddings (`openai`, float and base64) and Ollama's /api/embed
and /api/embeddings (`ollama`). The vectors are the library's and `localinfer embed`'s for the same
texts (to 1e-5), of unit length, in input order; every refusal is one error in the API's shape;
and the generating context still answers (greedy: the same text) after, and while, the embedding
context works."""

from __future__ import annotations

import base64
import json
import threading

import numpy as np
import pytest

from helpers import run_cli, start_server

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
pytestmark = pytest.mark.slow

TEXTS = ["The cat sat on the mat.", "A cat was sitting on the mat.",
         "Interest rates rose sharply after the central bank's meeting.",
         "Photosynthesis turns light into chemical energy.", "Hello!",
         "The quick brown fox jumps over the lazy dog near the river bank at dawn."]
EXHAUSTIVE = pytest.mark.exhaustive
LONG = "hello " * 600               # more tokens than the 512 an input may hold


@pytest.fixture(scope="module", params=["smollm_path", "gemma_path"])
def served(request, in_models_home):
    """(the server's URL, the model's name there, the model's path, an in-process embedder opened
    as `localinfer embed` opens it: the reference)."""
    from localinfer.pipeline import embed
    path = request.getfixturevalue(request.param)
    proc, url = start_server(str(path), "--parallel", "2")
    reference = embed.load(str(path), offline=True)
    try:
        name = _openai(url).models.list().data[0].id
        yield url, name, path, reference
    finally:
        reference.close()
        proc.terminate()
        proc.wait(timeout=60)
        log = proc.stderr.read()
        assert "Traceback" not in log, log


def _openai(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _expected(reference, texts, **options) -> np.ndarray:
    from localinfer.pipeline import embed
    return embed.vectors(reference, texts, **options)


def test_openai_floats_are_the_librarys_vectors_in_order(served):
    url, name, _, reference = served
    reply = _openai(url).embeddings.create(model=name, input=TEXTS, encoding_format="float")
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    got = np.array([d.embedding for d in reply.data], dtype=np.float32)
    assert np.abs(got - _expected(reference, TEXTS)).max() < 1e-5
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    tokens = sum(len(reference.engine.tokenize(t)) for t in TEXTS)
    assert (reply.usage.prompt_tokens, reply.usage.total_tokens) == (tokens, tokens)
    assert reply.model == name and reply.object == "list"
    # the same texts reversed: the reversed vectors, each where its text was
    back = _openai(url).embeddings.create(model=name, input=TEXTS[::-1], encoding_format="float")
    back = np.array([d.embedding for d in back.data], dtype=np.float32)
    assert np.abs(back - _expected(reference, TEXTS[::-1])).max() < 1e-5
    assert (back[::-1] * got).sum(axis=1).min() > 0.998     # Gemma's "Hello!" moves in a batch


def test_base64_decodes_to_the_same_floats(served):
    url, name, _, reference = served
    client = _openai(url)
    floats = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    floats = np.array([d.embedding for d in floats.data], dtype=np.float32)
    raw = client.embeddings.create(model=name, input=TEXTS, encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                        for d in raw.data])
    assert np.array_equal(decoded, floats)
    # the client's default: it asks for base64 and decodes it itself
    default = client.embeddings.create(model=name, input=TEXTS)
    assert np.array_equal(np.array([d.embedding for d in default.data], dtype=np.float32), floats)
    one = client.embeddings.create(model=name, input=TEXTS[4])
    assert len(one.data) == 1
    assert np.abs(np.array(one.data[0].embedding) - _expected(reference, TEXTS[4])[0]).max() < 1e-5


def test_the_server_gives_what_localinfer_embed_writes(served):
    url, name, path, _ = served
    result = run_cli("embed", str(path), "--offline", input="\n".join(TEXTS) + "\n")
    assert result.returncode == 0, result.stderr
    written = np.array([json.loads(line)["embedding"] for line in result.stdout.splitlines()])
    reply = _openai(url).embeddings.create(model=name, input=TEXTS, encoding_format="float")
    assert np.abs(np.array([d.embedding for d in reply.data]) - written).max() < 1e-5


@pytest.mark.parametrize("served", ["smollm_path", pytest.param("gemma_path", marks=EXHAUSTIVE)],
                         indirect=True)      # repetitions: Gemma's are checked by the tests above
def test_ollama_embed_and_the_older_embeddings(served):
    url, name, _, reference = served
    client = ollama.Client(host=url)
    reply = client.embed(model=name, input=TEXTS)
    assert reply.model == name and len(reply.embeddings) == len(TEXTS)
    assert np.abs(np.array(reply.embeddings) - _expected(reference, TEXTS)).max() < 1e-5
    assert reply.prompt_eval_count == sum(len(reference.engine.tokenize(t)) for t in TEXTS)
    assert reply.total_duration > 0 and reply.load_duration >= 0
    latest = client.embed(model=name + ":latest", input=TEXTS[0])
    assert np.abs(np.array(latest.embeddings) - _expected(reference, TEXTS[0])).max() < 1e-5
    assert client.embed(model=name, input="").embeddings == []      # Ollama's way to load it
    # truncate (Ollama's default): cut to the 512 tokens an input holds
    cut = client.embed(model=name, input=LONG).embeddings
    assert np.abs(np.array(cut) - _expected(reference, LONG, truncate=True)).max() < 1e-5
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=name, input=[TEXTS[0], LONG], truncate=False)
    assert e.value.status_code == 400 and "input 1" in e.value.error and "512" in e.value.error
    old = client.embeddings(model=name, prompt=TEXTS[2])
    assert np.abs(np.array(old.embedding) - _expected(reference, TEXTS[2])[0]).max() < 1e-5
    assert client.embeddings(model=name, prompt="").embedding == []


def test_ollama_refusals_are_in_its_shape(served):
    url, name, _, reference = served
    client = ollama.Client(host=url)
    for call, status, words in [
            (lambda: client.embed(model="no-such-model", input="a"), 404, "not found"),
            (lambda: client.embed(model=name, input="a", dimensions=7), 400,
             str(reference.dimensions)),
            (lambda: client.embeddings(model="no-such-model", prompt="a"), 404, "not found")]:
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == status and words in e.value.error, e.value.error
    raw = _post(url + "/api/embed", {"model": name, "input": ["a", 3]})
    assert raw == (400, {"error": "input must be a string or a list of strings"})
    assert _post(url + "/api/embed", {"model": name, "input": ["a", ""]})[0] == 400


def test_openai_refusals_are_one_clear_error(served):
    url, name, _, reference = served
    client = _openai(url)
    dimension = reference.dimensions
    cases = [(dict(input="a", dimensions=dimension + 1), openai.BadRequestError,
              f"dimensions must be {dimension}"),
             (dict(input=["a"] * 2049), openai.APIStatusError, "at most 2048"),
             (dict(input=["a", LONG]), openai.BadRequestError, "input 1 holds"),
             (dict(input=[LONG[:3000]] * 600), openai.APIStatusError, "300,000 tokens"),
             (dict(input=""), openai.BadRequestError, "empty"),
             (dict(input=["a", ""]), openai.BadRequestError, "input 1 is empty"),
             (dict(input=[]), openai.BadRequestError, "empty list"),
             (dict(input=[1, 2, 3]), openai.BadRequestError, "token ids"),
             (dict(input=[[1, 2], [3]]), openai.BadRequestError, "token ids"),
             (dict(input="a", encoding_format="int8"), openai.BadRequestError,
              "encoding_format")]
    for fields, kind, words in cases:
        with pytest.raises(kind) as e:
            client.embeddings.create(model=name, **{"encoding_format": "float", **fields})
        assert words in e.value.message, e.value.message
        assert e.value.status_code in (400, 413)
    assert client.embeddings.create(model=name, input="a", dimensions=dimension).data
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="no-such-model", input="a")
    assert "no-such-model" in e.value.message


@pytest.mark.parametrize("served", ["smollm_path", pytest.param("gemma_path", marks=EXHAUSTIVE)],
                         indirect=True)      # repetitions: Gemma's are checked by the tests above
def test_generation_still_answers_after_and_while_embeddings_are_served(served):
    url, name, _, reference = served
    client = _openai(url)
    # a completion: Gemma 3 270M is a base model, without a chat template
    ask = dict(model=name, prompt="The colours of the rainbow are", temperature=0, max_tokens=16)
    first = client.completions.create(**ask).choices[0].text
    client.embeddings.create(model=name, input=TEXTS)
    # Both contexts decoding at once: while they shared ggml's thread pool (backends/llama/
    # threads.py), this greedy answer came back as garbage.
    answers, vectors = [], []
    chat = threading.Thread(target=lambda: answers.append(
        client.completions.create(**ask).choices[0].text))
    chat.start()
    for _ in range(3):
        reply = client.embeddings.create(model=name, input=TEXTS * 4, encoding_format="float")
        vectors.append(np.array([d.embedding for d in reply.data], dtype=np.float32))
    chat.join(timeout=300)
    assert answers == [first] and first
    expected = _expected(reference, TEXTS * 4)           # the library's, computed once
    for got in vectors:
        assert np.abs(got - expected).max() < 1e-5


def _post(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
