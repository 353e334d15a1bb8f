"""Hostile GGUF files and option values end in one line on stderr and exit 1 (or 2): never in an
engine abort (134), a crash (139), a Python traceback or text on stdout.

Every file is a copy of the real SmolLM2 or Gemma 3 file with one value changed (gguf_patch), driven
through the real CLI; the fuzz cases flip and cut bytes of the real header, in-process for speed
(read_header and the checks) and a handful through the CLI.
"""

from __future__ import annotations

import math
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import gguf_patch as gp
import pytest
from helpers import MODELS_HOME, run_cli

from localinfer.cli import options as limits
from localinfer.errors import EXIT_RUNTIME, EXIT_USAGE, ModelLoadError
from localinfer.gguf.checks import check_model
from localinfer.gguf.header import TextInfo, read_header

pytestmark = pytest.mark.slow

RUN = ("hi", "--raw", "--temp", "0", "-n", "1", "--no-cache", "--draft", "none")
_U32, _F32, _STRING = 4, 6, 8


def refusal(result: subprocess.CompletedProcess, code: int = EXIT_RUNTIME) -> str:
    """The one error line of a command that had to refuse, after checking it said nothing else."""
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    assert result.stdout == "", result.stdout[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("localinfer: error: "), lines[0]
    assert "internal error" not in lines[0], lines[0]
    return lines[0]


def patched(src: Path, tmp_path: Path, key: str, value, vtype: int | None = None) -> Path:
    return gp.set_value(src, tmp_path / f"patched-{src.name}", key, value, vtype)


def added(src: Path, tmp_path: Path, key: str, value, vtype: int) -> Path:
    return gp.add_value(src, tmp_path / f"added-{src.name}", key, value, vtype)


# -- hyper-parameters llama.cpp asserts on ----------------------------------------------------------
COMMANDS = {
    "run": lambda path: ("run", str(path), *RUN),
    "eval": lambda path: ("eval", str(path), "--chunks", "1"),
    "quantize --dry-run": lambda path: ("quantize", str(path), "--type", "Q8_0", "--dry-run"),
    "info": lambda path: ("info", str(path)),
}


@pytest.mark.parametrize("layers, command", [
    (513, "run"), (0, "run"), (2**31, "run"), (2**31, "eval"), (2**31, "quantize --dry-run"),
    (2**31, "info")])
def test_block_count_outside_llamas_range(smollm_path, models_home, tmp_path, layers, command):
    # 513 and 0 made llama.cpp abort (GGML_ASSERT, 12 KB of backtrace on stdout); 2**31 made our
    # memory estimate build a list of 2**31 layers (MemoryError).
    bad = patched(smollm_path, tmp_path, "llama.block_count", layers)
    line = refusal(run_cli(*COMMANDS[command](bad)))
    assert f"llama.block_count is {layers}" in line and "1 to 512" in line


def test_zero_heads_end_in_llamas_own_refusal(smollm_path, models_home, tmp_path):
    # Was "internal error: ZeroDivisionError" from the memory estimate; llama.cpp itself compares
    # the tensor shapes with the head count and refuses cleanly.
    bad = patched(smollm_path, tmp_path, "llama.attention.head_count", 0)
    assert "blk.0.attn_q.weight" in refusal(run_cli("run", str(bad), *RUN))


@pytest.mark.parametrize("key, value, vtype, expected", [
    ("llama.rope.scaling.type", "sideways", _STRING, "rope.scaling.type"),
    ("llama.expert_count", 2000, _U32, "expert_count is 2000"),
    ("llama.expert_used_count", 2, _U32, "expert_used_count is 2"),
    ("llama.nextn_predict_layers", 31, _U32, "nextn_predict_layers is 31"),
])
def test_values_llama_asserts_on_are_refused_first(smollm_path, models_home, tmp_path, key, value,
                                                   vtype, expected):
    bad = added(smollm_path, tmp_path, key, value, vtype)
    assert expected in refusal(run_cli("run", str(bad), *RUN))
    assert expected in refusal(run_cli("quantize", str(bad), "--type", "Q8_0", "--dry-run"))


def test_a_count_of_the_wrong_type_is_refused(smollm_path, models_home, tmp_path):
    bad = patched(smollm_path, tmp_path, "llama.embedding_length", "wide", _STRING)
    assert "llama.embedding_length is 'wide'" in refusal(run_cli("run", str(bad), *RUN))


# (key, value, value type for a key the file lacks or a changed type, model, words in the line):
# a negative or NaN norm epsilon made llama.cpp abort (GGML_ASSERT(eps >= 0.0f), exit 134); the
# rest ran and printed nonsense (exit 0) on llama.cpp and MLX, where the ONNX exporter refused some.
REALS = [
    ("llama.attention.layer_norm_rms_epsilon", -1.0, None, "smollm", "is -1.0, not a norm epsilon"),
    ("llama.attention.layer_norm_rms_epsilon", math.nan, None, "smollm", "is nan, not a norm"),
    ("llama.attention.layer_norm_rms_epsilon", math.inf, None, "smollm", "is inf, not a norm"),
    ("llama.attention.layer_norm_rms_epsilon", "1e-5", _STRING, "smollm", "is '1e-5', not a real"),
    ("llama.rope.freq_base", 0.0, None, "smollm", "is 0.0, not a rope base above 1"),
    ("llama.rope.freq_base", -10000.0, None, "smollm", "is -10000.0, not a rope base above 1"),
    ("llama.rope.freq_base", math.nan, None, "smollm", "is nan, not a rope base"),
    ("llama.rope.scaling.factor", -2.0, _F32, "smollm", "is -2.0, not a finite number, 0 or more"),
    ("llama.rope.scaling.yarn_beta_fast", -32.0, _F32, "smollm", "is -32.0, not a finite number "
     "above 0"),
    ("llama.attn_logit_softcapping", 0.0, _F32, "smollm", "is 0.0, not a finite number above 0"),
    ("llama.embedding_scale", math.inf, _F32, "smollm", "is inf, not a finite number"),
    ("gemma3.attention.layer_norm_rms_epsilon", -0.5, None, "gemma", "is -0.5, not a norm"),
    ("gemma3.final_logit_softcapping", math.nan, _F32, "gemma", "is nan, not a finite number"),
]


@pytest.fixture(scope="module", params=REALS, ids=lambda case: f"{case[0]}={case[1]!r}")
def bad_real(request, tmp_path_factory, models_home):
    """A copy of a real model with one real-valued hyper-parameter out of its range, and the words
    its refusal must hold; removed after its tests (13 copies would take 1.6 GB)."""
    key, value, vtype, model, words = request.param
    src = request.getfixturevalue(f"{model}_path")
    folder = tmp_path_factory.mktemp("reals")
    if key in read_header(src).metadata:
        path = patched(src, folder, key, value, vtype)
    else:
        path = added(src, folder, key, value, vtype)
    yield path, f"{key} {words}"
    path.unlink()


# exhaustive: the CLI refuses from the header before it picks a backend, so --backend mlx and
# onnx run the same check as llama.cpp's case here; each backend's own check is
# test_every_loader_checks_real_hyperparameters[mlx] and [onnx], by default.
@pytest.mark.parametrize("backend", ["llama.cpp", pytest.param("mlx", marks=pytest.mark.exhaustive),
                                     pytest.param("onnx", marks=pytest.mark.exhaustive)])
def test_real_hyperparameters_out_of_range_are_refused(bad_real, backend):
    path, words = bad_real
    line = refusal(run_cli("run", str(path), *RUN, "--backend", backend))
    assert words in line and "GGML" not in line


@pytest.mark.parametrize("backend", ["llama.cpp", "mlx", "onnx"])
def test_every_loader_checks_real_hyperparameters(bad_real, backend):
    # The CLI refuses before it picks a backend (the memory estimate reads the header); a backend
    # loaded through the library must refuse alone, with the same line.
    from localinfer.backends import LoadOptions, get
    path, words = bad_real
    if not get(backend).is_available():
        pytest.skip(f"{backend} is not installed")
    with pytest.raises(ModelLoadError) as refused:
        get(backend).load(path, LoadOptions(n_ctx=256)).close()
    assert words in str(refused.value) and "\n" not in str(refused.value)


# -- the vocabulary ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model, token, copy_of", [("smollm", 6, 5), ("gemma", 200_000, 100_000)])
def test_repeated_token_text_is_refused(request, models_home, tmp_path, model, token, copy_of):
    # llama.cpp maps token texts to ids and asserts the map is as long as the vocabulary: abort.
    src = request.getfixturevalue(f"{model}_path")
    bad = gp.set_token(src, tmp_path / f"dup-{src.name}", token, gp.token_bytes(src, copy_of))
    assert f"token {token} repeats" in refusal(run_cli("run", str(bad), *RUN))
    assert f"token {token} repeats" in refusal(run_cli("info", str(bad)))


def test_an_empty_token_counts_under_llamas_name_for_it(smollm_path, tmp_path):
    # llama.cpp renames an empty token text to "[EMPTY_<id>]": a token with that text repeats it.
    emptied = gp.set_token(smollm_path, tmp_path / "empty.gguf", 7, b"")
    check_model(emptied)                             # an empty token alone is fine
    bad = gp.set_token(emptied, tmp_path / "clash.gguf", 8, b"[EMPTY_7]")
    with pytest.raises(ModelLoadError, match="token 8 repeats"):
        check_model(bad)


def test_vocabulary_only_load_is_checked_too(smollm_path, tmp_path):
    # The MLX backend tokenizes through llama.cpp's vocabulary-only load, which asserts the same.
    from localinfer.backends.llama.vocab import LlamaVocab
    bad = gp.set_token(smollm_path, tmp_path / "dup.gguf", 6, gp.token_bytes(smollm_path, 5))
    with pytest.raises(ModelLoadError, match="token 6 repeats"):
        LlamaVocab(bad)


@pytest.mark.parametrize("key", ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id",
                                 "tokenizer.ggml.padding_token_id"])
def test_special_token_outside_the_vocabulary(smollm_path, models_home, tmp_path, key):
    bad = patched(smollm_path, tmp_path, key, 49152)
    line = refusal(run_cli("run", str(bad), *RUN))
    assert f"{key} is 49152, not a token of its 49,152-token vocabulary" in line


# -- the header reader ---------------------------------------------------------------------------------
def test_a_tensor_with_2_31_dimensions_costs_nothing(smollm_path, models_home, tmp_path):
    # The reader read 2**31 dimensions one by one: 770 MB of memory for a 98 MB file.
    bad = tmp_path / "dims.gguf"
    shutil.copyfile(smollm_path, bad)
    with open(bad, "r+b") as f:
        f.seek(_first_tensor_n_dims(smollm_path))
        f.write(struct.pack("<I", 2**31))
    tracemalloc.start()
    with pytest.raises(ModelLoadError, match="2147483648 dimensions"):
        read_header(bad)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20
    assert "2147483648 dimensions" in refusal(run_cli("run", str(bad), *RUN))


def _first_tensor_n_dims(path: Path) -> int:
    start = gp._metadata_end(path)
    with open(path, "rb") as f:
        f.seek(start)
        return start + 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.mark.parametrize("offset, value, expected", [
    (8, 2**40, "tensors, more than its size can hold"),          # tensor count
    (16, 2**62, "metadata entries, more than its size can hold"),  # metadata count
    (4, 1, "GGUF version 1"),
])
def test_header_counts_are_bounded_by_the_file(smollm_path, tmp_path, offset, value, expected):
    bad = tmp_path / "counts.gguf"
    data = bytearray(smollm_path.read_bytes()[:1 << 20])
    struct.pack_into("<Q" if offset != 4 else "<I", data, offset, value)
    bad.write_bytes(data)
    with pytest.raises(ModelLoadError, match=expected):
        read_header(bad)


def test_a_long_text_value_is_left_in_the_file(smollm_path, tmp_path):
    # Decoding it could take six times its size (the "replace" path of the UTF-8 decoder).
    long = added(smollm_path, tmp_path, "general.description", "\U0001F600" * (1 << 20), _STRING)
    tracemalloc.start()
    header = check_model(long)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert header.metadata["general.description"] == TextInfo(4 << 20)
    assert peak < 8 << 20


# -- option values that reach llama.cpp ------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ("run", "smollm2", "hi", "--threads", "100000"),
    ("run", "smollm2", "hi", "-t", "-1"),
    ("eval", "smollm2", "--threads", "100000"),
    ("bench", "smollm2", "--threads", "100000"),
    ("quantize", "smollm2", "--type", "Q8_0", "--threads", "100000"),
])
def test_threads_beyond_the_machine_are_a_usage_error(models_home, args):
    # 100,000 made llama.cpp abort (std::bad_alloc); past the CPUs ggml's threads crawl.
    line = refusal(run_cli(*args), EXIT_USAGE)
    assert "--threads" in line and f"0 (automatic) to {limits.max_threads()}" in line


@pytest.mark.parametrize("args", [
    ("run", "smollm2", "hi", "--ctx", str(2**32)),
    ("eval", "smollm2", "--ctx", str(2**25)),
    ("bench", "smollm2", "-p", str(2**24)),
])
def test_context_and_batch_sizes_are_bounded(models_home, args):
    line = refusal(run_cli(*args), EXIT_USAGE)
    assert "is not in the range" in line


# -- engine failures -----------------------------------------------------------------------------------
def test_a_context_that_cannot_be_made_is_one_line_not_a_segfault(smollm_path, tmp_path):
    # The model was freed on this path and freed again when the session was collected: exit 139.
    # (A copy that declares a long trained context: one beyond it is refused before loading.)
    long = patched(smollm_path, tmp_path, "llama.context_length", 262144)

    def three_gb_of_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    env = {**os.environ, "LOCALINFER_HOME": str(MODELS_HOME), "NO_COLOR": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "localinfer", "run", str(long), *RUN, "--ctx", "200000",
         "--memory", "100GB"], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
        preexec_fn=three_gb_of_address_space, timeout=300)
    assert "cannot create a context of 200000 tokens" in refusal(result)


ABORT_IN_ENGINE = """
import sys
from localinfer.backends.llama.engine import engine, init_engine
lib = engine()
init_engine(False)
lib.llama_model_load_from_file(sys.argv[1].encode(), lib.llama_model_default_params())
"""


def test_an_engine_abort_writes_nothing_to_stdout(smollm_path, tmp_path):
    # Past our checks (the file goes straight to llama.cpp), the abort still happens, but ggml's
    # debugger backtrace no longer lands on stdout.
    bad = patched(smollm_path, tmp_path, "llama.block_count", 513)
    result = subprocess.run([sys.executable, "-c", ABORT_IN_ENGINE, str(bad)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == -signal.SIGABRT
    assert result.stdout == ""
    assert "GGML_ASSERT" in result.stderr


# -- fuzzing -------------------------------------------------------------------------------------------
class HeaderFuzzer:
    """Damaged copies of a real model file: bytes of its header flipped, overwritten with large
    counts, or the file cut short. The tensor data is left as a hole (a sparse file of the original
    length), so a case costs the header's bytes, not the model's."""

    BIG = (0xFF, 2**31, 2**32 - 1, 2**63, 2**64 - 1, 513, 0)

    def __init__(self, path: Path) -> None:
        self.source = path
        self.size = path.stat().st_size
        header = read_header(path)
        with open(path, "rb") as f:
            self.header = f.read(header.header_size)
        # Counts, keys, hyper-parameters and tensor records: where the structure is.
        self.structural = [(0, 4096), (gp._metadata_end(path), header.header_size)]

    def case(self, seed: int, folder: Path) -> Path:
        rng = random.Random(seed)
        data, size = bytearray(self.header), self.size
        kind = rng.choice(("flip", "flip", "big", "cut"))
        if kind == "cut":
            size = rng.randrange(0, len(data))
            del data[size:]
        for _ in range(rng.randint(1, 8) if kind != "cut" else 0):
            at = self._position(rng)
            if kind == "flip":
                data[at] ^= rng.randrange(1, 256)
            else:
                value = rng.choice(self.BIG)
                data[at:at + 8] = value.to_bytes(8, "little")[:len(data[at:at + 8])]
        path = folder / f"case-{seed}.gguf"
        with open(path, "wb") as f:
            f.write(data)
            f.truncate(size)
        return path

    def _position(self, rng: random.Random) -> int:
        if rng.random() < 0.6:
            start, end = rng.choice(self.structural)
            return rng.randrange(start, end)
        return rng.randrange(0, len(self.header))


def fuzz_in_process(fuzzer: HeaderFuzzer, seeds: range, folder: Path, *, trace_every: int = 1) -> None:
    """Each case parses and passes the checks, or is refused with one line; never anything else,
    and never more than 64 MB of memory (Gemma 3's vocabulary check takes 20 MB). tracemalloc makes
    a case seven times slower, so the default run measures the memory of every fifth case only."""
    for seed in seeds:
        path = fuzzer.case(seed, folder)
        traced = seed % trace_every == 0
        if traced:
            tracemalloc.start()
        try:
            check_model(path)
        except ModelLoadError as e:
            assert "\n" not in str(e), (seed, str(e))
        except Exception as e:                       # anything else is a bug in the reader
            raise AssertionError(f"fuzz seed {seed}: {e!r}") from e
        finally:
            peak = tracemalloc.get_traced_memory()[1] if traced else 0
            tracemalloc.stop()
        assert peak < 64 << 20, (seed, peak)
        path.unlink()


def fuzz_through_cli(fuzzer: HeaderFuzzer, seeds: range, folder: Path) -> None:
    """Whole copies with their header damaged, run for one token: the answer, or one line."""
    for seed in seeds:
        damaged = fuzzer.case(seed, folder)
        path = folder / "whole.gguf"
        shutil.copyfile(fuzzer.source, path)
        with open(damaged, "rb") as src, open(path, "r+b") as dst:
            head = src.read(len(fuzzer.header))
            dst.write(head)
            dst.truncate(damaged.stat().st_size)
        result = run_cli("run", str(path), *RUN)
        assert result.returncode in (0, EXIT_RUNTIME), (seed, result.returncode, result.stderr[-2000:])
        if result.returncode:
            refusal(result)


@pytest.fixture(scope="module")
def smollm_fuzzer(smollm_path) -> HeaderFuzzer:
    return HeaderFuzzer(smollm_path)


def test_fuzzed_headers_parse_or_are_refused(smollm_fuzzer, tmp_path):
    fuzz_in_process(smollm_fuzzer, range(300), tmp_path, trace_every=5)


def test_fuzzed_headers_through_the_cli(smollm_fuzzer, models_home, tmp_path):
    fuzz_through_cli(smollm_fuzzer, range(10_000, 10_004), tmp_path)


@pytest.mark.fuzz
def test_fuzz_many_headers(smollm_fuzzer, gemma_path, tmp_path):
    fuzz_in_process(smollm_fuzzer, range(300, 5_300), tmp_path)
    fuzz_in_process(HeaderFuzzer(gemma_path), range(1_000), tmp_path)


@pytest.mark.fuzz
def test_fuzz_many_headers_through_the_cli(smollm_fuzzer, models_home, tmp_path):
    fuzz_through_cli(smollm_fuzzer, range(10_004, 10_064), tmp_path)
