"""Embeddings (issue 28 §4): `localinfer embed`, `Model.embed` and pipeline/embed.py on both real
models — unit vectors, the same bits every run, a batch equal to its inputs one by one, a
paraphrase nearer than an unrelated sentence, JSON lines in input order, and one-line refusals;
OpenAI's base64 encoding and `dimensions` rule without a model."""

from __future__ import annotations

import base64
import json
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import ERROR, GEMMA, SMOLLM, run_cli

TEXTS = ["The cat sat on the mat.", "A cat was sitting on the mat.",
         "Interest rates rose sharply after the central bank's meeting.",
         "Photosynthesis turns light into chemical energy.", "Hello!",
         "The quick brown fox jumps over the lazy dog near the river bank at dawn."]
MODELS = [SMOLLM, GEMMA]


@pytest.fixture(scope="module", params=MODELS)
def embedders(request, models_home, in_models_home):
    """(batch of 4, batch of 1) embedders of one real model."""
    from localinfer.pipeline import embed
    four = embed.load(request.param, batch=4, offline=True, threads=2)
    one = embed.load(request.param, batch=1, offline=True, threads=2)
    yield four, one
    four.close()
    one.close()


def test_vectors_are_unit_length_and_the_same_bits_every_run(embedders):
    from localinfer.pipeline import embed
    four, _ = embedders
    first = embed.vectors(four, TEXTS)
    assert first.dtype == np.float32 and first.shape == (len(TEXTS), four.dimensions)
    np.testing.assert_allclose(np.linalg.norm(first, axis=1), 1.0, atol=1e-6)
    assert np.array_equal(first, embed.vectors(four, TEXTS))
    # A string is a list of one, and embed() is vectors() as lists: the same bits. (Between
    # batches of another make-up a vector moves a little: test_a_batch_equals_its_inputs...)
    assert np.array_equal(embed.vectors(four, TEXTS[2]), embed.vectors(four, [TEXTS[2]]))
    assert np.array_equal(np.array(embed.embed(four, TEXTS)), first)


def test_a_batch_equals_its_inputs_one_by_one(embedders):
    from localinfer.pipeline import embed
    four, one = embedders
    batched = embed.vectors(four, TEXTS * 3)           # decodes of 4 inputs, mixed lengths
    alone = np.stack([embed.vectors(one, text)[0] for text in TEXTS])
    moved = np.abs(batched - np.tile(alone, (3, 1))).max(axis=1)
    # Gemma 3's inputs of 3 tokens or so ("Hello!") move by up to 1.5e-2 (docs/embeddings.md);
    # longer ones by 1e-7 on an Intel Xeon, up to 1.1e-3 on an AMD EPYC (other kernels run).
    short = np.tile([len(four.engine.tokenize(t)) < 6 for t in TEXTS], 3)
    assert moved[~short].max() < 2e-3
    assert (batched * np.tile(alone, (3, 1))).sum(axis=1).min() > 0.998
    assert np.array_equal(embed.vectors(one, TEXTS), alone)     # batch 1: one decode each
    assert four.pooling == "mean"                                # generative: none declared


def test_a_paraphrase_is_nearer_than_an_unrelated_sentence(embedders):
    from localinfer.pipeline import embed
    v = embed.vectors(embedders[0], TEXTS[:3])
    assert v[0] @ v[1] > v[0] @ v[2] + 0.05


@pytest.mark.parametrize("embedders", [SMOLLM, pytest.param(GEMMA, marks=pytest.mark.exhaustive)],
                         indirect=True)      # the refusals are the model's size limit, not its kind
def test_refusals_name_the_input(embedders):
    from localinfer.errors import UsageError
    from localinfer.pipeline import embed
    four, _ = embedders
    with pytest.raises(UsageError, match=r"input 1 holds \d+ tokens, more than the context "
                                         r"\(512\)"):
        embed.vectors(four, ["fine", "word " * 600])
    with pytest.raises(UsageError, match="input 1 is empty"):
        embed.vectors(four, ["fine", ""])
    cut = embed.vectors(four, "word " * 600, truncate=True)
    assert np.array_equal(cut, embed.vectors(four, "word " * 600, truncate=True))


@pytest.mark.parametrize("model", MODELS)
def test_cli_writes_one_json_line_per_line_in_order(model, models_home, in_models_home):
    from localinfer.pipeline import embed
    lines = TEXTS * 2                      # four batches of 3: order kept across them
    result = run_cli("embed", model, "--offline", "--batch", "3", "-t", "1",
                     input="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["index"] for r in records] == list(range(len(lines)))
    with embed.load(model, offline=True, threads=2) as e:
        expected = embed.vectors(e, lines)
    got = np.array([r["embedding"] for r in records], dtype=np.float32)
    # Decodes of 3 inputs here, of all 12 there: past a few dozen tokens in one decode ggml's
    # matrix kernels sum in another order, which moves a vector by up to 1e-3 (docs/embeddings.md).
    assert np.abs(got - expected).max() < 2e-3
    assert (got * expected).sum(axis=1).min() > 0.9999
    assert result.stderr == ""


def test_cli_refusals(models_home):
    empty = run_cli("embed", "", "--offline", input="hi\n")
    assert empty.returncode == 2 and empty.stderr == f"{ERROR}the model name is empty\n"
    long = run_cli("embed", SMOLLM, "--offline", "--ctx", "64", input="one\n" + "word " * 100)
    assert long.returncode == 2 and long.stdout.count("\n") == 1     # line 1 is written first
    assert long.stderr.startswith(f"{ERROR}line 2 holds 10") and "--truncate" in long.stderr
    cut = run_cli("embed", SMOLLM, "--offline", "--ctx", "64", "--truncate",
                  input="word " * 100 + "\n")
    assert cut.returncode == 0 and len(json.loads(cut.stdout)["embedding"]) == 576
    mlx = run_cli("embed", SMOLLM, "--offline", "--backend", "mlx", input="hi\n")
    assert mlx.returncode == 2 and mlx.stderr.startswith(f"{ERROR}the mlx backend computes no "
                                                         "embeddings")


def test_cli_refuses_bytes_that_are_not_utf8_after_the_lines_before(models_home):
    import os
    import subprocess
    import sys
    env = {**os.environ, "LOCALINFER_HOME": str(models_home), "NO_COLOR": "1"}
    result = subprocess.run([sys.executable, "-m", "localinfer", "embed", SMOLLM, "--offline"],
                            input=b"fine\n\xff\xfe\n", capture_output=True, env=env, timeout=300)
    assert result.returncode == 2
    assert len(result.stdout.splitlines()) == 1
    assert result.stderr.decode().startswith(f"{ERROR}stdin is not UTF-8 text")
    nothing = run_cli("embed", SMOLLM, "--offline", input="")
    assert (nothing.returncode, nothing.stdout, nothing.stderr) == (0, "", "")


def test_model_embed_matches_the_pipeline(models_home, in_models_home):
    import localinfer
    from localinfer.pipeline import embed
    with localinfer.load(SMOLLM, offline=True, threads=2) as model:
        vectors = model.embed(TEXTS[:3])
        assert np.abs(np.array(model.embed(TEXTS[0])) - vectors[:1]).max() < 1e-5
    with embed.load(SMOLLM, offline=True, threads=2) as e:
        assert vectors == embed.embed(e, TEXTS[:3])


# -- OpenAI's shape, without a model ---------------------------------------------------------------
def test_base64_is_little_endian_float32():
    from localinfer.pipeline.embed import to_base64
    vector = [0.5, -1.25, 3.0e-8, 1.0]
    raw = base64.b64decode(to_base64(np.array(vector, dtype=np.float32)))
    assert raw == struct.pack("<4f", *vector)
    assert list(np.frombuffer(raw, dtype="<f4")) == pytest.approx(vector)
    assert to_base64(vector) == to_base64(np.array(vector, dtype=">f4"))


def test_dimensions_other_than_the_models_are_refused():
    from localinfer.errors import UsageError
    from localinfer.pipeline.embed import check_dimensions
    model = SimpleNamespace(dimensions=576, name="smollm2-135m-instruct:Q4_1")
    check_dimensions(None, model)
    check_dimensions(576, model)
    with pytest.raises(UsageError, match="dimensions must be 576, the length of "
                                         "smollm2-135m-instruct:Q4_1's vectors, not 256"):
        check_dimensions(256, model)
