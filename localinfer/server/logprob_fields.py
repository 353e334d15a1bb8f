"""The request fields that ask for log-probabilities, and /v1/completions' prompts, checked.

- Chat (and what is said as a chat: the Responses API, Ollama): `logprobs` true or false and
  `top_logprobs` 0 to 20, which needs logprobs true (OpenAI refuses it alone too).
- /v1/completions: `logprobs` a whole number from 0 to 20, the top N per token. OpenAI's own cap
  is 5; vLLM's and ours is 20 (engine/logprobs.py's MAX_TOP), so every client within OpenAI's
  bound is answered and lm-evaluation-harness's `logprobs: 1` with it. `echo` true or false.
- /v1/completions' `prompt`: a string, a list of token ids, a list of such lists, or a list of
  strings; several prompts are several choices. Ids are the model's own (0 to n_vocab - 1) and
  taken as they are: no BOS is added to them.
"""

from __future__ import annotations

from localinfer.engine.logprobs import MAX_TOP
from localinfer.server.errors import BadRequest

MAX_PROMPTS = 64            # prompts one /v1/completions request may hold


def asked(body: dict, *, chat: bool) -> int | None:
    """Limits.logprobs for the request: None (off), 0 (the chosen tokens'), or the top N."""
    if not chat:
        return _count(body, "logprobs", "a whole number from 0 to 20 (the top N per token)")
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest("'logprobs' must be true or false", "logprobs")
    top = _count(body, "top_logprobs", f"a whole number from 0 to {MAX_TOP}")
    if top is not None and top > 0 and not wanted:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _count(body: dict, key: str, words: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP:
        raise BadRequest(f"'{key}' must be {words}", key)
    return value


def echo(body: dict) -> bool:
    value = body.get("echo")
    if value is not None and not isinstance(value, bool):
        raise BadRequest("'echo' must be true or false", "echo")
    return bool(value)


def prompts(body: dict) -> list[str | list[int]]:
    """The prompts of a /v1/completions request, each a string or a list of token ids (their
    range is checked with the model's vocabulary, in `token_ids`)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string, a list of token ids, or a list "
                         "of those or of strings", "prompt")
    if all(_is_id(p) for p in prompt):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise BadRequest(f"{len(prompt):,} prompts; a request may hold {MAX_PROMPTS}", "prompt")
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt
    raise BadRequest("'prompt' mixes kinds: send one string, one list of token ids, or a list "
                     "of strings or of lists of token ids", "prompt")


def token_ids(prompt: list, n_vocab: int) -> list[int]:
    """A prompt of token ids, each one of the model's."""
    if not prompt:
        raise BadRequest("'prompt' holds an empty list of token ids", "prompt")
    for token in prompt:
        if not _is_id(token) or not 0 <= token < n_vocab:
            shown = repr(token)[:40]
            raise BadRequest(f"'prompt' holds {shown}, not a token id of this model (0 to "
                             f"{n_vocab - 1})", "prompt")
    return list(prompt)


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
