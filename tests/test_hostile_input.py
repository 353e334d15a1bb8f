"""Input a hostile or careless user can give ends in one clear line and the documented exit code,
never an "internal error", a traceback, a hang or a machine run out of memory (issue 13).

Drives the real CLI on the real SmolLM2 model; hostile chat templates are written into a copy of
the model file, so they run through the real `run` path.
"""

from __future__ import annotations

import io
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli
from gguf_patch import set_value

from localinfer.cli import shell
from localinfer.engine.sampling import SamplingParams, make_sampler
from localinfer.errors import UsageError

EXIT_RUNTIME, EXIT_USAGE = 1, 2
# No speculation: a model file new to the machine would first be probed for exact drafting.
OFFLINE = ("--offline", "--temp", "0", "-n", "4", "--draft", "none")


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single `localinfer: error:` line of a failed command, nothing on stdout, no traceback."""
    stderr = result.stderr.decode() if isinstance(result.stderr, bytes) else result.stderr
    stdout = result.stdout.decode() if isinstance(result.stdout, bytes) else result.stdout
    assert stdout == "", stdout
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("localinfer: error: "), stderr
    assert "internal error" not in lines[0], stderr
    return lines[0]


def cli(*args: str | bytes) -> list[str | bytes]:
    return [sys.executable, "-m", "localinfer", *args]


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "LOCALINFER_HOME": str(home), "NO_COLOR": "1", **extra}


def child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- chat templates that would exhaust the machine ------------------------------------------------
HOSTILE_TEMPLATES = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                          "{% endfor %}",
    # Jinja reads ** left to right, so 10 ** 10 ** 10 is a harmless 10^100; this is the hang.
    "a power of ten billion": "{{ 10 ** (10 ** 10) }}",
    "ten gigabytes of 'a'": "{{ 'a' * 10**10 }}",
    "1.2 MB per iteration": "{% for i in range(100000) %}{{ 'x' * 1200000 }}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "an empty prompt": "{% for m in messages %}{% endfor %}",
}


@pytest.fixture
def model_with_template(tmp_path, smollm_path):
    """Copies of the real SmolLM2 file with another chat template, removed after the test."""
    made: list[Path] = []

    def make(template: str) -> Path:
        path = set_value(smollm_path, tmp_path / f"t{len(made)}.gguf", "tokenizer.chat_template",
                         template)
        made.append(path)
        return path

    yield make
    for path in made:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def failing_template_cpu(models_home, smollm_path, tmp_path_factory) -> float:
    """Child CPU seconds of a `run` whose template fails at once: start-up and model load."""
    path = set_value(smollm_path, tmp_path_factory.mktemp("base") / "base.gguf",
                     "tokenizer.chat_template", "{{ raise_exception('not this one') }}")
    before = child_cpu_seconds()
    result = run_cli("run", str(path), "hi", *OFFLINE, home=models_home)
    spent = child_cpu_seconds() - before
    path.unlink()
    assert result.returncode == EXIT_RUNTIME and "not this one" in one_error_line(result)
    return spent


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_hostile_template_ends_in_one_line_within_a_second(name, model_with_template, models_home,
                                                          failing_template_cpu):
    path = model_with_template(HOSTILE_TEMPLATES[name])
    before = child_cpu_seconds()
    result = run_cli("run", str(path), "hi", *OFFLINE, home=models_home, timeout=60)
    spent = child_cpu_seconds() - before
    assert result.returncode == EXIT_RUNTIME
    line = one_error_line(result)
    assert "chat template" in line and "--raw" in line
    # What the template cost beyond a run whose template fails at once.
    assert spent - failing_template_cpu < 1.0, f"{spent:.2f} s against {failing_template_cpu:.2f} s"


def test_raw_skips_a_hostile_template(model_with_template, models_home):
    path = model_with_template(HOSTILE_TEMPLATES["nested range loops"])
    result = run_cli("run", str(path), "The sky is", "--raw", *OFFLINE, home=models_home)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


# -- stdin that is not text, or never ends --------------------------------------------------------
def test_stdin_from_dev_urandom_is_refused_at_once(models_home):
    with open("/dev/urandom", "rb") as endless:
        result = subprocess.run(cli("run", "smollm2", "hi", *OFFLINE), stdin=endless,
                                capture_output=True, env=cli_env(models_home), timeout=60)
    assert result.returncode == EXIT_USAGE
    assert "stdin is not UTF-8 text" in one_error_line(result)


def test_chat_from_dev_urandom_is_refused(models_home):
    with open("/dev/urandom", "rb") as endless:
        result = subprocess.run(cli("chat", "smollm2", "--offline", "-n", "4"), stdin=endless,
                                capture_output=True, env=cli_env(models_home), timeout=60)
    assert result.returncode == EXIT_USAGE
    # chat greets on stderr first; then the one error line.
    stderr = result.stderr.decode().strip().splitlines()
    assert len(stderr) == 2 and "ready" in stderr[0]
    assert stderr[1].startswith("localinfer: error: stdin is not UTF-8 text"), stderr


def test_stdin_with_nul_bytes_is_refused(models_home):
    result = subprocess.run(cli("run", "smollm2", *OFFLINE), input="H\0e\0l\0l\0o\0".encode(),
                            capture_output=True, env=cli_env(models_home), timeout=60)
    assert result.returncode == EXIT_USAGE
    assert "NUL" in one_error_line(result)


def test_argument_that_is_not_utf8_is_refused(models_home):
    result = subprocess.run(cli("run", "smollm2", b"caf\xe9", *OFFLINE), stdin=subprocess.DEVNULL,
                            capture_output=True, env=cli_env(models_home), timeout=60)
    assert result.returncode == EXIT_USAGE
    assert "caf\\xe9' is not UTF-8 text" in one_error_line(result)


def test_endless_stdin_stops_at_the_bound_and_says_how_to_raise_it(models_home):
    command = 'yes | "$0" -m localinfer run smollm2 hi --offline --temp 0 -n 4'
    result = subprocess.run(["sh", "-c", command, sys.executable], capture_output=True,
                            env=cli_env(models_home), timeout=60)
    assert result.returncode == EXIT_USAGE
    line = one_error_line(result)
    assert "more than 16.0 MB" in line and "LOCALINFER_STDIN_BYTES" in line


@pytest.mark.parametrize("cap, message", [("1K", "more than 1.0 KB"),
                                          ("nan", "LOCALINFER_STDIN_BYTES='nan' is not a size")])
def test_stdin_bound_comes_from_the_environment(models_home, cap, message):
    result = run_cli("run", "smollm2", *OFFLINE, input="x" * 2000, home=models_home,
                     env={"LOCALINFER_STDIN_BYTES": cap})
    assert result.returncode == EXIT_USAGE
    assert message in one_error_line(result)


class _Piped(io.BytesIO):
    def isatty(self) -> bool:
        return False


def test_read_stdin_reads_up_to_the_bound_with_text_mode_newlines(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(_Piped(b"one\r\ntwo\rthree\n")))
    assert shell.read_stdin(limit=15) == "one\ntwo\nthree\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(_Piped(b"one\r\ntwo\rthree\n")))
    with pytest.raises(UsageError, match="more than 14 B"):
        shell.read_stdin(limit=14)


def test_invalid_utf8_offset_is_counted_across_chunks(monkeypatch):
    data = "é".encode() * 70_000 + b"\xff"      # past the first 64 KiB chunk
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(_Piped(data)))
    with pytest.raises(UsageError, match="invalid byte at offset 140000"):
        shell.read_stdin(limit=1 << 20)


# -- options and environment variables ------------------------------------------------------------
def test_seed_minus_one_draws_a_random_seed(models_home):
    result = run_cli("run", "smollm2", "Say something.", "--offline", "--seed", "-1", "-n", "4",
                     "--draft", "none", home=models_home)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and result.stderr == ""


def test_seed_below_minus_one_is_a_usage_error(models_home):
    result = run_cli("run", "smollm2", "hi", "--offline", "--seed", "-2", home=models_home)
    assert result.returncode == EXIT_USAGE
    assert "--seed must be -1 (random)" in one_error_line(result)


@pytest.mark.parametrize("option", [("--temp", "nan"), ("--repeat-penalty", "nan"),
                                    ("--repeat-penalty", "inf")])
def test_sampling_value_that_is_not_a_number_is_a_usage_error(models_home, option):
    result = run_cli("run", "smollm2", "hi", "--offline", *option, home=models_home)
    assert result.returncode == EXIT_USAGE
    assert f"{option[0]} must be" in one_error_line(result)


def test_seed_minus_one_differs_between_samplers_and_a_fixed_seed_repeats():
    logits = np.zeros(50_000, dtype=np.float32)     # every token equally likely
    params = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)

    def draws(seed: int) -> list[int]:
        sample = make_sampler(SamplingParams(seed=seed, **params))
        return [sample(logits, []) for _ in range(8)]

    assert draws(-1) != draws(-1)
    assert draws(7) == draws(7)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e400"])
def test_prompt_cache_cap_that_is_not_a_size_is_a_usage_error(home, value):
    result = run_cli("cache", "stats", home=home, env={"LOCALINFER_PROMPT_CACHE_BYTES": value})
    assert result.returncode == EXIT_USAGE
    assert f"LOCALINFER_PROMPT_CACHE_BYTES='{value}' is not a size" in one_error_line(result)


def test_prompt_cache_cap_nan_on_the_run_path(models_home):
    result = run_cli("run", "smollm2", "hi", *OFFLINE, home=models_home,
                     env={"LOCALINFER_PROMPT_CACHE_BYTES": "nan"})
    assert result.returncode == EXIT_USAGE
    assert "LOCALINFER_PROMPT_CACHE_BYTES='nan'" in one_error_line(result)


@pytest.mark.parametrize("below", ["", "sub/dir"])
@pytest.mark.parametrize("command", [("list",), ("run", "smollm2", "hi", "--offline")])
def test_localinfer_home_at_a_file_is_a_usage_error(tmp_path, below, command):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    home = a_file / below if below else a_file
    result = run_cli(*command, home=home)
    assert result.returncode == EXIT_USAGE
    assert f"LOCALINFER_HOME={home} is not a directory" in one_error_line(result)
    assert a_file.read_text() == "x"


# -- stdout closed, or its reader gone ------------------------------------------------------------
def closed_stdout(home: Path, *args: str) -> subprocess.CompletedProcess:
    command = '"$0" -m localinfer "$@" >&-'
    return subprocess.run(["sh", "-c", command, sys.executable, *args], capture_output=True,
                          text=True, env=cli_env(home), stdin=subprocess.DEVNULL, timeout=60)


def test_list_with_stdout_closed_says_so(models_home):
    result = closed_stdout(models_home, "list")
    assert result.returncode == EXIT_RUNTIME
    assert "stdout is closed" in one_error_line(result)


def test_command_with_nothing_to_print_succeeds_with_stdout_closed(home):
    result = closed_stdout(home, "list")         # an empty store: only a note, on stderr
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("no models on disk yet") and result.stderr.count("\n") == 1


def test_reader_leaving_the_pipe_is_a_normal_end(models_home):
    """`localinfer run ... | head -c 5`: head exits after five bytes; localinfer ends quietly, 0."""
    producer = subprocess.Popen(
        cli("run", "smollm2", "Count from one to one hundred in words.", "--offline", "--temp", "0",
            "-n", "200"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        env=cli_env(models_home))
    head = subprocess.run(["head", "-c", "5"], stdin=producer.stdout, capture_output=True,
                          timeout=120)
    producer.stdout.close()
    stderr = producer.stderr.read().decode()
    assert producer.wait(timeout=120) == 0, stderr
    assert stderr == ""
    assert len(head.stdout) == 5
