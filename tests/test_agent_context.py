"""Context sized for coding agents (issue 43, item 6): a context beyond the model's trained one is
refused in one line unless a RoPE scaling is asked for; serve's default context is the longest
the budget holds up to the trained one (not half of it); and an agent's second turn continues
from the cells of its first (its long system prompt and tools are not evaluated again), as the
server's own count of cached prompt tokens shows."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from gguf_patch import set_value
from helpers import SMOLLM, error_line, free_port, run_cli, start_server

from localinfer.errors import UsageError
from localinfer.fit import auto, memory, rules
from localinfer.fit.options import FitOptions
from localinfer.models import refs
from localinfer.pipeline import load

TRAINED = 8192          # SmolLM2-135M's context_length


def test_serve_refuses_a_context_beyond_the_trained_one(models_home):
    result = run_cli("serve", SMOLLM, "--offline", "--ctx", "32768", "--port", str(free_port()),
                     home=models_home)
    line = error_line(result)
    assert result.returncode == 2
    assert "--ctx 32768 is beyond smollm2-135m-instruct:Q4_1's trained context of 8,192" in line
    assert "--rope-scaling yarn" in line


def test_run_refuses_it_too(smollm_path: Path):
    result = run_cli("run", str(smollm_path), "hi", "--ctx", "9000", "-n", "1")
    assert result.returncode == 2 and "trained context of 8,192 tokens" in error_line(result)


@pytest.mark.parametrize("ctx, rope, words", [
    (8192, "yarn", "--rope-scaling stretches"),         # nothing to stretch
    (8 * TRAINED + 256, "yarn", "more than 8 times"),
    (16384, "cubic", "unknown --rope-scaling 'cubic'"),
])
def test_rope_scaling_is_checked(ctx, rope, words):
    with pytest.raises(UsageError, match=re.escape(words)):
        auto.check_trained(ctx, TRAINED, "m", rope)


def test_each_of_maps_sequences_is_held_to_the_trained_context(models_home, in_models_home):
    # map's --ctx is each line's: four of 4,096 make a context of 16,384 cells, none beyond.
    named = load.name(SMOLLM, FitOptions(offline=True))
    fitted = load.fit_batch(named, FitOptions(ctx=4096, offline=True), parallel=4)
    assert fitted.options.n_ctx == 4 * 4096
    with pytest.raises(UsageError, match="beyond"):
        load.fit_batch(named, FitOptions(ctx=9000, offline=True), parallel=4)


@pytest.fixture(scope="module")
def long_trained(smollm_path: Path, tmp_path_factory) -> Path:
    """SmolLM2 declaring a trained context of 32,768 tokens: a model agents can use."""
    directory = tmp_path_factory.mktemp("long")
    return set_value(smollm_path, directory / "long.gguf", "llama.context_length", 32768)


def _serve_default(path: Path, fit: FitOptions) -> int:
    named = load.name(str(path), fit)
    return load.fit_batch(named, fit, parallel=4, shared=True).options.n_ctx


def test_serve_defaults_to_the_trained_context_when_it_fits(long_trained: Path):
    assert _serve_default(long_trained, FitOptions(memory="20GB")) == 32768


def test_serve_takes_the_longest_context_the_budget_holds(long_trained: Path):
    # A budget that holds 24,576 cells but not 32,768: before, the fit halved to 16,384, too few
    # for an agent's first request of about 19,000 tokens.
    facts = memory.facts_from_file(long_trained)
    machine = rules.detect_machine()

    def need(n_ctx: int) -> int:
        return memory.estimate(facts, memory.Request(n_ctx, kv_type="f16",
                                                     repack=machine.repacks)).required
    budget = need(24576)
    assert need(24576 + memory.KV_PAD) > budget
    fit = FitOptions(memory=str(budget), kv_type="f16")
    assert _serve_default(long_trained, fit) == 24576


# -- the agent's stable prefix, reused on its second turn -----------------------------------------
SYSTEM = "You are a coding agent working in a repository. " + " ".join(
    f"Rule {i}: keep each change small, tested and explained in one line." for i in range(90))
TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Tool {i} reads files and runs commands. " * 4,
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "description": "a path in the repository"},
        "limit": {"type": "integer", "description": "lines to read"}},
        "required": ["path"]}}} for i in range(6)]


@pytest.fixture(scope="module")
def agent_server(models_home):
    # A context stretched past the trained one, as agents' tests run SmolLM2 (the option works).
    proc, url = start_server(SMOLLM, "--ctx", "12288", "--rope-scaling", "yarn")
    yield url
    proc.terminate()
    proc.communicate(timeout=60)


def _cached_and_prompt(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))
    return total("localinfer_prompt_tokens_cached_total"), total("localinfer_prompt_tokens_total")


def _turn(url: str, messages: list[dict]) -> tuple[dict, int, int]:
    """One chat request (greedy, a few tokens); its reply and the prompt tokens it had and
    found cached, by the server's counters."""
    cached0, prompt0 = _cached_and_prompt(url)
    body = {"model": SMOLLM, "messages": messages, "tools": TOOLS, "max_tokens": 8,
            "temperature": 0}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=300).read())
    cached1, prompt1 = _cached_and_prompt(url)
    return reply, int(prompt1 - prompt0), int(cached1 - cached0)


def test_the_second_turn_continues_from_the_first(agent_server):
    loaded = json.loads(urllib.request.urlopen(agent_server + "/api/ps", timeout=30).read())
    assert loaded["models"][0]["context_length"] == 12288        # stretched by --rope-scaling
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "List the files in the repository."}]
    reply, prompt1, cached1 = _turn(agent_server, first)
    assert prompt1 > 1000
    answer = reply["choices"][0]["message"]
    second = [*first, {k: v for k, v in answer.items() if v is not None},
              {"role": "user", "content": "Now read README.md."}]
    if answer.get("tool_calls"):
        second[-1:] = [{"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"],
                        "content": "README.md\nsrc/\n"}]
    _, prompt2, cached2 = _turn(agent_server, second)
    # All of the first turn's prompt but its last few tokens (a whole kernel group at most)
    assert prompt2 > prompt1 and cached2 >= prompt1 - 64, (prompt1, prompt2, cached2)


def _claude_turn(url: str, nonce: str, messages: list[dict]) -> int:
    """One /v1/messages request as Claude Code sends it (its system prompt led by the billing
    block whose hash changes with every request); the prompt tokens found cached."""
    cached0, _ = _cached_and_prompt(url)
    system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.90.abc; "
                                       f"cc_entrypoint=cli; cch={nonce};"},
              {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    body = {"model": SMOLLM, "system": system, "messages": messages, "max_tokens": 4,
            "temperature": 0}
    request = urllib.request.Request(url + "/v1/messages", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=300).read()
    return int(_cached_and_prompt(url)[0] - cached0)


def test_claude_codes_changing_billing_block_does_not_defeat_reuse(agent_server):
    first = [{"role": "user", "content": "List the files in the repository."}]
    _claude_turn(agent_server, "1a2b3", first)
    second = [*first, {"role": "assistant", "content": "README.md and src/."},
              {"role": "user", "content": "Now read README.md."}]
    assert _claude_turn(agent_server, "9f8e7", second) > 1000


def _ttft(url: str, messages: list[dict]) -> float:
    """Seconds to the first streamed piece of an answer (text or a call)."""
    import time
    body = {"model": SMOLLM, "messages": messages, "tools": TOOLS, "max_tokens": 8,
            "temperature": 0, "stream": True}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as reply:
        for line in reply:
            delta = json.loads(line[6:])["choices"][0]["delta"] if line.startswith(b"data: {") \
                else {}
            if delta.get("content") or delta.get("tool_calls"):
                return time.monotonic() - start
    raise AssertionError("no answer")


@pytest.mark.exhaustive
def test_ttft_of_the_second_turn(agent_server):
    # docs/agents.md's figures: `pytest -m exhaustive tests/test_agent_context.py -k ttft -s`.
    # A longer system prompt than above, as an agent's (about 4,000 tokens on SmolLM2).
    system = SYSTEM * 4
    first = [{"role": "system", "content": system}, {"role": "user", "content": "List the files."}]
    cold = _ttft(agent_server, first)
    second = [*first, {"role": "assistant", "content": "README.md and src/."},
              {"role": "user", "content": "Now read README.md."}]
    warm = _ttft(agent_server, second)
    print(f"\nagent-shaped request on {SMOLLM}: turn 1 TTFT {cold:.2f} s, turn 2 {warm:.2f} s, "
          f"{cold / warm:.1f}x")
    assert cold / warm >= 5
