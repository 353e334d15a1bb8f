"""The MLX backend (its CPU build here) on the two real models, against the llama.cpp backend:
the same next-token distributions, the same greedy output, and everything above the Session
boundary (prompt cache, speculation, the CLI) working on it unchanged."""

from __future__ import annotations

import json
import os
import shutil
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
from helpers import GEMMA, load_file, run_cli
from onnx_reference import PARTING_TOLERANCE, Float64Model, exact_gap
from parity import first_difference
from test_run import QUESTION
from test_speculative import CODE, G_COPY, G_LIST, G_OPEN, OPEN, TYPOS

from localinfer.backends import LoadOptions
from localinfer.cache.prompt_cache import PromptCache
from localinfer.engine.batching import GRAIN, LAYOUT
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.prompt import chat_tokens, raw_tokens, with_bos
from localinfer.engine.sampling import SamplingParams, make_sampler
from localinfer.errors import LocalinferError
from localinfer.measure import quality
from localinfer.gguf.header import read_header
from localinfer.speculate.drafters import PromptLookup

pytestmark = [
    pytest.mark.usefixtures("in_models_home"),   # caches in the test home
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("mlx") is None or find_spec("mlx_lm") is None,
                       reason="MLX is not installed (pip install -e '.[mlx]')"),
]

GREEDY = SamplingParams(temperature=0)
OPTIONS = LoadOptions(n_ctx=1024)
N_FORCED = 512


@pytest.fixture(scope="module", params=["smollm", "gemma"])
def pair(request, smollm_path, gemma_path):
    """(MLX model, llama.cpp model) of one real model file."""
    path = smollm_path if request.param == "smollm" else gemma_path
    mlx, ref = load_file(path, OPTIONS, "mlx"), load_file(path, OPTIONS, "llama.cpp")
    assert mlx.backend == "mlx" and ref.backend == "llama.cpp"
    yield mlx, ref
    mlx.session.close()
    ref.session.close()


def _forced_tokens(session) -> list[int]:
    tokens = session.tokenize(quality.default_text(), special=False)
    return with_bos(session, tokens)[:N_FORCED]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


# -- the same model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def forced(pair):
    """Teacher-forced logits over 512 tokens of the shipped text: (MLX, llama.cpp), computed once."""
    mlx, ref = pair
    tokens = _forced_tokens(ref.session)
    assert len(tokens) == N_FORCED
    for s in (mlx.session, ref.session):
        s.reset()
    ours = mlx.session.eval(tokens, logits="all")
    theirs = ref.session.eval(tokens, logits="all").copy()
    assert ours.shape == theirs.shape == (N_FORCED, ref.session.n_vocab)
    return ours, theirs


def _kl(reference: np.ndarray, model: np.ndarray) -> np.ndarray:
    p, q = _log_softmax(reference), _log_softmax(model)
    return (np.exp(p) * (p - q)).sum(axis=-1)                 # KL(reference || model) per position


# The teacher-forced comparison takes two to three minutes of MLX's CPU build (its quantized matmul
# runs on one thread for 512-row batches); MLX's exactness is checked by default against a float64
# forward and by greedy parity, so this one is opt-in.
@pytest.mark.exhaustive
def test_teacher_forced_kl_against_llama_cpp(forced):
    ours, theirs = forced
    kl = _kl(theirs, ours)
    print(f"mean KL {kl.mean():.5f}, top-1 agreement {(ours.argmax(-1) == theirs.argmax(-1)).mean():.4f}")
    assert kl.mean() < 0.02                                   # measured: 0.0031 SmolLM2, 0.0057 Gemma


@pytest.mark.exhaustive
@pytest.mark.xfail(strict=True, reason=(
    "llama.cpp's CPU arithmetic (int8-rounded activations, f16 KV cache) itself agrees with an exact "
    "float64 forward of these files only 97.1% (SmolLM2) / 96.1% (Gemma) top-1; MLX agrees with that "
    "reference 100% / 99.8% (see test_exact_against_a_float64_forward), so no exact implementation "
    "reaches 98% against llama.cpp here. Measured: 97.07% and 95.90%."))
def test_teacher_forced_top1_agreement_with_llama_cpp(forced):
    ours, theirs = forced
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.98


@pytest.fixture(scope="module")
def exact_smollm(smollm_path):
    return Float64Llama(smollm_path)


def test_exact_against_a_float64_forward(smollm_path, exact_smollm):
    """An independent float64 numpy forward of the SmolLM2 file, written from llama.cpp's
    definition (interleaved rope straight on the GGUF rows): MLX computes the same model."""
    mlx = load_file(smollm_path, OPTIONS, "mlx").session
    tokens = _forced_tokens(mlx)[:64]      # rope, attention and every weight: all at each row
    exact = exact_smollm.logits(tokens)
    ours = mlx.eval(tokens, logits="all")
    mlx.close()
    assert (ours.argmax(-1) == exact.argmax(-1)).all()
    assert _kl(exact, ours).mean() < 1e-4                    # measured: < 1e-6


@pytest.mark.exhaustive          # ~50 s of MLX on a CPU (test_exact_against_... stays)
def test_greedy_on_the_chat_prompts_is_the_exact_models(smollm_path, exact_smollm):
    """SmolLM2's greedy output parts from llama.cpp's on every chat prompt of the tests, at a
    near-tie or where llama.cpp's logit is off by up to 1.0 (measured: tokens 1, 4, 29 and 4).
    MLX's first 32 tokens are the exact model's: each is the float64 forward's argmax there."""
    mlx = load_file(smollm_path, OPTIONS, "mlx")
    for prompt in _prompts(mlx):
        ours = _greedy(mlx, prompt)
        exact = exact_smollm.logits(prompt + ours)[len(prompt) - 1:-1].argmax(-1)
        assert ours == exact.tolist()
    mlx.session.close()


class Float64Llama:
    """A llama-architecture GGUF run in float64 numpy: the reference for exactness."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader
        from gguf.quants import dequantize
        reader = GGUFReader(str(path))
        self.w = {t.name: dequantize(t.data, t.tensor_type)
                  .reshape(tuple(reversed(t.shape.tolist()))).astype(np.float64)
                  for t in reader.tensors}
        meta = read_header(path).metadata
        self.n_head, self.n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
        self.eps, self.base = meta["llama.attention.layer_norm_rms_epsilon"], meta["llama.rope.freq_base"]
        self.n_layer = meta["llama.block_count"]
        self.d = self.w["blk.0.attn_q.weight"].shape[0] // self.n_head

    def _rms(self, x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * weight

    def logits(self, tokens: list[int], *, last_only: bool = False) -> np.ndarray:
        w, n, d, n_head, n_kv = self.w, len(tokens), self.d, self.n_head, self.n_kv
        angle = np.arange(n)[:, None, None] * self.base ** (-np.arange(0, d, 2) / d)
        cos, sin = np.cos(angle), np.sin(angle)

        def rope(x):                            # llama.cpp's mode 0: pairs (2i, 2i+1)
            out = np.empty_like(x)
            out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
            out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
            return out

        causal = np.triu(np.full((n, n), -np.inf), 1)
        h = w["token_embd.weight"][tokens]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            x = self._rms(h, w[p + "attn_norm.weight"])
            q = rope((x @ w[p + "attn_q.weight"].T).reshape(n, n_head, d))
            k = rope((x @ w[p + "attn_k.weight"].T).reshape(n, n_kv, d))
            v = (x @ w[p + "attn_v.weight"].T).reshape(n, n_kv, d)
            k, v = (np.repeat(a, n_head // n_kv, axis=1) for a in (k, v))
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + causal
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            h = h + np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1) @ w[p + "attn_output.weight"].T
            x = self._rms(h, w[p + "ffn_norm.weight"])
            gate, up = x @ w[p + "ffn_gate.weight"].T, x @ w[p + "ffn_up.weight"].T
            h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        head = w.get("output.weight", w["token_embd.weight"])
        return self._rms(h[-1:] if last_only else h, w["output_norm.weight"]) @ head.T


def test_tokens_are_llama_cpps(pair):
    mlx, ref = pair
    text = "Hello <|im_start|> wörld <start_of_turn>  42\n\tdone"
    for special in (False, True):
        assert mlx.session.tokenize(text, special=special) == ref.session.tokenize(text, special=special)
    for attr in ("n_vocab", "bos_token", "eos_token", "add_bos", "chat_template"):
        assert getattr(mlx.session, attr) == getattr(ref.session, attr), attr
    ids = ref.session.tokenize(text, special=True)
    assert mlx.session.detokenize(ids) == ref.session.detokenize(ids)
    assert [mlx.session.is_eog(t) for t in range(8)] == [ref.session.is_eog(t) for t in range(8)]


def _prompts(loaded) -> list[list[int]]:
    if loaded.session.chat_template:     # SmolLM2: the chat prompts of the tests, templated
        return [chat_tokens(loaded.session, [{"role": "user", "content": text}])
                for text in (QUESTION, TYPOS, CODE, OPEN)]
    return [raw_tokens(loaded.session, text) for text in (G_COPY, G_LIST, G_OPEN)]


def _greedy(loaded, prompt, n=32, cache=None) -> list[int]:
    gen = Generation(cache or KVCache(loaded.session), prompt, make_sampler(GREEDY), Limits(n))
    list(gen)
    return gen.tokens


@pytest.mark.exhaustive          # ~40 s of MLX on one CPU; test_exact_against_a_float64_forward stays
@pytest.mark.parametrize("pair", ["gemma"], indirect=True)    # SmolLM2's: on the chat prompts
def test_greedy_first_32_tokens_match_llama_cpp(pair, gemma_path):
    """Equal, or parted where the exact model's two candidates are closer than llama.cpp's
    rounding error (PARTING_TOLERANCE, tests/onnx_reference.py; MLX rounds nothing), as the float64
    forward judges: llama.cpp's own logits carry the error being judged, and which prompt reaches
    such a near-tie first changes with its kernels (plain or repacked), hence with the CPU."""
    mlx, ref = pair
    exact = None
    for prompt in _prompts(ref):       # Gemma 3 270M: a base model, its prompts raw
        ours, theirs = _greedy(mlx, prompt), _greedy(ref, prompt)
        same = first_difference(ours, theirs)
        if same is None:
            continue
        exact = exact or Float64Model(gemma_path)
        gap = exact_gap(exact, prompt + theirs[:same], ours[same], theirs[same])
        print(f"first difference {same}, exact gap there {gap:.3f}")
        assert gap < PARTING_TOLERANCE, (same, gap)


# -- the KV cache -----------------------------------------------------------------------------------
# exhaustive: [gemma] shows this by default, where it is likeliest to break (its sliding-window
# layers, masked in full-length caches); SmolLM2's caches are the same arrays without a window.
@pytest.mark.parametrize("pair", [pytest.param("smollm", marks=pytest.mark.exhaustive), "gemma"],
                         indirect=True)
def test_trim_and_state_round_trips(pair):
    session = pair[0].session
    # A short prompt: MLX's CPU build is slow per token, and trim, state and restore cut and copy
    # the same full-length per-layer arrays whatever the count (sliding layers included).
    tokens = _forced_tokens(session)[:44]
    session.reset()
    session.eval(tokens[:40])
    blob = session.state()
    expected = session.eval(tokens[40:44]).copy()
    assert session.n_past == 44
    # Trim back and evaluate the same tokens again: the same logits.
    assert session.trim(40) and session.n_past == 40
    np.testing.assert_allclose(session.eval(tokens[40:44]), expected, rtol=1e-5, atol=1e-5)
    # Restore the saved state into a fresh cache, then continue, then trim below it.
    session.reset()
    session.restore(blob, 40)
    assert session.n_past == 40
    np.testing.assert_allclose(session.eval(tokens[40:44]), expected, rtol=1e-5, atol=1e-5)
    assert session.trim(30)
    np.testing.assert_allclose(session.eval(tokens[30:44]), expected, rtol=1e-4, atol=1e-4)


def test_a_bad_state_is_refused(pair):
    session = pair[0].session
    session.reset()
    session.eval(_forced_tokens(session)[:8])        # any state: what is refused is its bytes
    blob = session.state()
    for bad, n_past in ((b"not a state", 8), (blob[:len(blob) // 2], 8), (blob, 9)):
        with pytest.raises(LocalinferError):
            session.restore(bad, n_past)
        assert session.n_past == 0
    identity = session.state_identity()
    assert identity["backend"] == "mlx" and identity["dtype"] and identity["weights"]


@pytest.mark.exhaustive          # ~27 s of MLX on a CPU; cold == warm: test_prompt_cache's
@pytest.mark.parametrize("pair", ["smollm", "gemma"], indirect=True)
def test_prompt_cache_gives_identical_greedy_output(pair, tmp_path):
    loaded = pair[0]
    session = loaded.session
    doc = session.tokenize(quality.default_text()[:3000], special=False)
    a = with_bos(session, doc[:140] + session.tokenize("\n\nIn one line:", special=False))
    identity = {**session.state_identity(), "batching": LAYOUT}
    store = PromptCache(tmp_path, identity, label="test", cap_bytes=10 ** 9)
    cold = KVCache(session, store)
    expected = _greedy(loaded, a, 8, cold)
    cold.persist()
    session.reset()
    warm = KVCache(session, store)
    assert _greedy(loaded, a, 8, warm) == expected
    assert warm.last_event.hit and warm.last_event.restored >= GRAIN


@pytest.mark.exhaustive          # 100-150 s per model of MLX on a CPU
def test_prompt_lookup_speculation_is_identical_to_plain(pair):
    from localinfer.speculate import choose
    loaded = pair[0]
    prompt = _prompts(loaded)[1]          # the copying prompt of each model: drafts get accepted
    limits = Limits(24)
    plain = Generation(KVCache(loaded.session), prompt, make_sampler(GREEDY), limits)
    plain_text = "".join(plain)
    gen = choose.speculative(loaded, KVCache(loaded.session), prompt, GREEDY, limits,
                               PromptLookup(), max_draft=4, adaptive=False)
    assert "".join(gen) == plain_text and gen.tokens == plain.tokens
    assert gen.stats.drafted > 0 and gen.stats.accepted > 0


# -- the K-quant conversion cache ---------------------------------------------------------------------
def test_conversion_is_cached_and_rebuilt_when_stale_or_corrupt(gemma_path, tmp_path):
    from localinfer.backends.mlx import weights as mlx_weights
    model = tmp_path / "gemma.gguf"
    shutil.copyfile(gemma_path, model)
    header, cache_dir = read_header(model), tmp_path / "converted"

    arrays, key = mlx_weights.load(model, header, cache_dir)
    cached = mlx_weights.cache_path(model, cache_dir)
    probe = np.array(arrays["blk.0.attn_output.scales"])
    first = cached.stat()
    assert key != "native" and cached.is_file()

    start = time.perf_counter()
    again, key2 = mlx_weights.load(model, header, cache_dir)       # reused, not converted again
    assert key2 == key and time.perf_counter() - start < 5
    assert (cached.stat().st_ino, cached.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    np.testing.assert_array_equal(np.array(again["blk.0.attn_output.scales"]), probe)

    os.utime(model, ns=(first.st_mtime_ns, first.st_mtime_ns + 10 ** 9))   # the source changed
    rebuilt, key3 = mlx_weights.load(model, header, cache_dir)
    assert key3 != key and cached.stat().st_ino != first.st_ino
    np.testing.assert_array_equal(np.array(rebuilt["blk.0.attn_output.scales"]), probe)

    with open(cached, "r+b") as f:                                     # cut short
        f.truncate(cached.stat().st_size // 2)
    rebuilt, _ = mlx_weights.load(model, header, cache_dir)
    np.testing.assert_array_equal(np.array(rebuilt["blk.0.attn_output.scales"]), probe)
    assert [p.name for p in cache_dir.iterdir()] == [cached.name]      # no temporaries left


# -- selection and the CLI ---------------------------------------------------------------------------
def test_run_with_backend_mlx_through_the_cli(models_home):
    # Gemma 3 270M is a base model: --raw. Its greedy output is llama.cpp's (SmolLM2's parts from
    # llama.cpp's at its rounding, see test_greedy_on_the_chat_prompts_is_the_exact_models).
    args = ("run", GEMMA, G_OPEN, "--raw", "--temp", "0", "--offline", "-n", "16", "--json")
    mlx = run_cli(*args, "--backend", "mlx")
    ref = run_cli(*args, "--backend", "llama.cpp")
    assert mlx.returncode == ref.returncode == 0, mlx.stderr
    ours, theirs = json.loads(mlx.stdout), json.loads(ref.stdout)
    assert ours["backend"] == "mlx" and theirs["backend"] == "llama.cpp"
    assert ours["text"] == theirs["text"] and ours["generated_tokens"] == 16


def test_auto_keeps_llama_cpp_off_apple_silicon(models_home):
    result = run_cli("devices", "--json")
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["backends"]["mlx"]["available"]
    if not facts["apple_silicon"]:
        assert facts["run_would_use"]["backend"] == "llama.cpp"
        assert "mlx" in facts["run_would_use"]["reason"]


def test_unsupported_architecture_is_one_clear_line(models_home, tmp_path):
    from gguf import GGUFWriter
    path = tmp_path / "tiny-phi3.gguf"
    writer = GGUFWriter(str(path), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_cli("run", str(path), "hi", "--backend", "mlx")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "phi3" in line and "llama.cpp" in line


def test_an_interrupt_after_the_model_call_leaves_no_stale_cache_entries(smollm_path):
    """Ctrl-C lands after the layers' caches moved and before n_past counted them: the next eval
    and trim see the caches brought back to n_past, and give the cold logits."""
    model = load_file(smollm_path, OPTIONS, "mlx")
    s = model.session
    try:
        tokens = raw_tokens(s, "The quick brown fox jumps over the lazy dog because")
        s.eval(tokens[:6])
        real = s.model.model

        def interrupted(*args, **kwargs):
            out = real(*args, **kwargs)
            raise KeyboardInterrupt
        s.model.model = interrupted
        with pytest.raises(KeyboardInterrupt):
            s.eval(tokens[6:9])
        s.model.model = real
        assert s.n_past == 6
        warm = s.eval(tokens[6:]).copy()
        s.trim(4)
        assert {c.offset for c in s._cache} == {4} and s.n_past == 4
        s.reset()
        cold = s.eval(tokens).copy()
        assert int(warm.argmax()) == int(cold.argmax())
        np.testing.assert_allclose(warm, cold, rtol=0, atol=1e-3)
    finally:
        s.close()
