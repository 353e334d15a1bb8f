"""What the test modules share, written once: the two real models and their home, the CLI in a
subprocess, the shape of a one-line error, loading a GGUF file in-process, and small utilities.
Fixtures live in conftest.py; this module holds plain names a test imports (`from helpers import`)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

SMOLLM = "smollm2"            # SmolLM2-135M-Instruct Q4_1, instruct with a chat template
GEMMA = "gemma-3-270m"        # Gemma 3 270M Q4_K_M, base model, 262k vocabulary

# Survives between runs so the models are fetched once per machine; CI may point it elsewhere.
SHARED_HOME = Path(os.environ.get("LOCALINFER_TEST_HOME",
                                  Path.home() / ".cache" / "localinfer-tests" / "home"))
# Under pytest-xdist each worker has a home of its own (its caches, config, prompt cache) whose
# `data` is the shared store, so one worker's cache tests never see another's entries.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
MODELS_HOME = SHARED_HOME.with_name(f"{SHARED_HOME.name}-{WORKER}") if WORKER else SHARED_HOME

ERROR = "localinfer: error: "


def run_cli(*args: str, home: Path = MODELS_HOME, input: str | None = None,
            env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m localinfer ARGS` as a user would, stdin piped (or closed when input is None).
    The process is forked from a zygote that has the CLI imported (cli_zygote.py) where the
    environment allows; LOCALINFER_TEST_SPAWN=1 starts every command afresh instead."""
    full_env = {**os.environ, "LOCALINFER_HOME": str(home), "NO_COLOR": "1", **(env or {})}
    if not os.environ.get("LOCALINFER_TEST_SPAWN"):
        from cli_zygote import zygote_for
        zygote = zygote_for(full_env)
        if zygote is not None:
            return zygote.run(list(args), full_env, input, timeout)
    return subprocess.run([sys.executable, "-m", "localinfer", *args], input=input,
                          stdin=None if input is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, env=full_env, timeout=timeout)


def error_line(result: subprocess.CompletedProcess, *, notes: bool = False) -> str:
    """The error line of a failed command, after checking the shape of the failure: no traceback,
    nothing on stdout, one `localinfer: error: ` line and it is the last line on stderr — the only
    line, or with `notes` (a pull's progress, a note on the way) after the command's notes."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == "", result.stdout
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith(ERROR)]
    assert errors == lines[-1:], result.stderr
    assert notes or len(lines) == 1, result.stderr
    return lines[-1]


def sha256_of(path: Path) -> str:
    """A file's sha256, computed here rather than by the code under test."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def home_with(tmp_path: Path, config: str | None = None, *, models: bool = False) -> Path:
    """A LOCALINFER_HOME under tmp_path whose config/config.toml holds `config` (no file when None);
    with `models`, the test models' store linked in (read only: the caches are this home's own)."""
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    if config is not None:
        (home / "config" / "config.toml").write_text(config)
    if models:
        (home / "data").symlink_to(MODELS_HOME / "data", target_is_directory=True)
    return home


def load_file(path: Path, options, backend: str = "auto"):
    """A GGUF file loaded in-process as `localinfer run PATH` loads it (a file reference, no fit):
    a LoadedModel whose session the caller closes."""
    from localinfer.pipeline.load import open_model
    return open_model(str(path), options, backend=backend, offline=True)


def prompt_tokens(loaded, text: str) -> list[int]:
    """`text` as one user turn in the model's chat template, or raw text for a model without one."""
    from localinfer.engine.prompt import chat_tokens, raw_tokens
    if loaded.session.chat_template:
        return chat_tokens(loaded.session, [{"role": "user", "content": text}])
    return raw_tokens(loaded.session, text)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smollm_wearing(template: str, directory: Path, name: str) -> Path:
    """A copy of SmolLM2's GGUF whose chat template is `template` (a published one, from
    chat_templates.py): its ChatML vocabulary runs Qwen3's, DeepSeek's or SmolLM3's template, so
    the product's handling of a family's template is tested on real weights."""
    from gguf_patch import set_value
    source = MODELS_HOME / "data" / "models" / "smollm2-135m-instruct" / "smollm2-135m-instruct-Q4_1.gguf"
    return set_value(source, directory / f"{name}.gguf", "tokenizer.chat_template", template)


def start_server(model: str, *args: str, env: dict | None = None,
                 offline: bool = True) -> tuple[subprocess.Popen, str]:
    """`localinfer serve MODEL --offline ARGS` (offline=False: without --offline) on a free port,
    once /health answers: the process (stdout and stderr piped, for the test to read) and its
    base URL."""
    import time
    import urllib.error
    import urllib.request
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "localinfer", "serve", model,
                             *(["--offline"] if offline else []), "--port", str(port), *args],
                            env={**os.environ, "LOCALINFER_HOME": str(MODELS_HOME), **(env or {})},
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read())
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not start")


def post_json(url: str, body: dict, *, timeout: float = 300) -> tuple[int, dict]:
    """POST a JSON body with the standard library; the status and the decoded reply, errors too."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def log_probs(session, tokens: list[int]):
    """Each position's log-softmax (float64) over a session's logits for `tokens`, evaluated
    from an empty cache with every position's logits, in pieces shorter than a tile: a graph of
    64 rows or more runs llama.cpp's tiled kernels (backends/llama/steer.py), whose figures
    differ from a decode step's by up to 0.25 nats on SmolLM2, and the server scores a prompt as
    decode steps would (docs/logprobs.md)."""
    import numpy as np
    from localinfer.backends.llama.steer import TILE_ROWS
    from localinfer.measure.quality import log_softmax
    session.reset()
    step = TILE_ROWS // 2
    rows = [session.eval(tokens[i:i + step], logits="all").copy()
            for i in range(0, len(tokens), step)]
    return log_softmax(np.concatenate(rows)).astype(np.float64)
