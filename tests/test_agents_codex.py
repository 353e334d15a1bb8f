"""Codex CLI (`@openai/codex` from npm) run as a user runs it, non-interactively (`codex exec`),
against `localinfer serve` on SmolLM2 with its context raised for Codex's prompt: a two-turn
session (the second turn `exec resume`) in which the model calls Codex's default shell tool and
gets its result back, through /v1/responses; and Codex's Ollama mode (`--oss`), which asks the
Ollama API's version first. What is judged is the protocol, not SmolLM2's answers. Skipped, with
the reason, where npm cannot install Codex."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import MODELS_HOME, start_server

pytestmark = [pytest.mark.agents, pytest.mark.slow]
# Seen failing once (Codex exited 1 after 347 s and 499 s, its JSON events not kept then):
# not yet known whether the server or SmolLM2's answer (a cut one is response.incomplete,
# which Codex takes as an error) is at fault; the events are in the assertion now.
UNPROVEN = pytest.mark.xfail(strict=False, reason="not yet seen passing; see the note above")

CODEX = "@openai/codex@0.171.0"
NPM_DIR = MODELS_HOME.parent / "agents-npm" / "codex"
MODEL = "smollm2-135m-instruct:Q4_1"
ASK = ("Use the shell tool to run the command `echo localinfer-was-here`, then tell me what it "
       "printed.")


@pytest.fixture(scope="module")
def codex() -> Path:
    """The codex binary, installed once into the test cache (not globally)."""
    binary = NPM_DIR / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed, so Codex CLI cannot be")
        NPM_DIR.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--prefix", str(NPM_DIR), "--no-audit",
                               "--no-fund", CODEX], capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not binary.exists():
            reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"npm could not install {CODEX}: {reason}")
    return binary


@pytest.fixture(scope="module")
def server(models_home):
    proc, url = start_server("smollm2", "--ctx", "16384", "--rope-scaling", "yarn", "-v")
    yield url, proc
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr


def _run(codex: Path, home: Path, *args: str, env: dict | None = None,
         timeout: float = 900) -> tuple[list[dict], subprocess.CompletedProcess]:
    """`codex exec --json ARGS` in a scratch directory with its own CODEX_HOME (nothing written
    to the user's): the JSON events it printed, and the process."""
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    full_env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / "codex"),
                "NO_COLOR": "1", **(env or {})}
    (home / "codex").mkdir(exist_ok=True)
    done = subprocess.run([str(codex), "exec", "--json", "--skip-git-repo-check",
                           "--dangerously-bypass-approvals-and-sandbox", *args],
                          cwd=work, env=full_env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    events = []
    for line in done.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return events, done


def _provider(url: str) -> list[str]:
    """Codex's config for a provider that speaks the Responses API at the server."""
    return ["-c", "model_provider=localinfer",
            "-c", f'model_providers.localinfer={{name="localinfer",base_url="{url}/v1",'
                  f'wire_api="responses",request_max_retries=0,stream_max_retries=0}}',
            "-m", MODEL]


@UNPROVEN
def test_a_two_turn_codex_session_with_a_shell_call(codex, server, tmp_path):
    url, _ = server
    first, done = _run(codex, tmp_path, *_provider(url), ASK)
    assert done.returncode == 0, (first, done.stderr[-3000:])
    kinds = [e.get("type") for e in first]
    assert "thread.started" in kinds and "turn.completed" in kinds, kinds
    commands = [e["item"] for e in first if e.get("type") == "item.completed"
                and e["item"].get("type") == "command_execution"]
    assert commands, first
    second, done = _run(codex, tmp_path, *_provider(url), "resume", "--last",
                        "What did the command print?")
    assert done.returncode == 0, (second, done.stderr[-3000:])
    assert "turn.completed" in [e.get("type") for e in second], second


@UNPROVEN
def test_codex_s_ollama_mode_accepts_the_server(codex, server, tmp_path):
    url, _ = server
    events, done = _run(codex, tmp_path, "--oss", "--local-provider", "ollama", "-m", MODEL,
                        "Say hello.", env={"CODEX_OSS_BASE_URL": url + "/v1"})
    assert done.returncode == 0, (events, done.stderr[-3000:])
    assert "too old" not in done.stderr
    assert "turn.completed" in [e.get("type") for e in events], events
