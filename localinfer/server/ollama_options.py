"""Ollama's request fields that steer generation, said in the terms of the chat request
server/requests.py prepares: `options` (the runner's settings), `format`, `think` and
`keep_alive`.

- options: temperature, top_k, top_p, min_p, seed, repeat_penalty, frequency_penalty and
  presence_penalty become the request's own fields (checked there, with the same ranges as the
  OpenAI endpoint); num_predict its max_tokens (-1 and -2: until the end of generation or of the
  context); stop its stop strings; repeat_last_n the penalties' window (0: no penalty); priority
  ("batch" or "interactive") the request's; num_ctx a smaller context for this request (a larger
  one means the server's: the model was loaded with serve's --ctx). The settings Ollama applies
  when it loads a model (num_gpu, num_thread, ...) are accepted and change nothing: this server
  loaded its model once, with serve's options. Sampling methods it does not have (mirostat,
  typical_p, tfs_z) are refused unless they are set to their neutral value; any other name is
  refused, since a typo would otherwise pass unseen.
- format: "json" (any JSON object) or a JSON schema, through the same grammar as response_format.
- think: true, false, or "low", "medium", "high" (gpt-oss's effort): serve's --think for this
  request.
- keep_alive: a number of seconds or a duration ("5m", "1h30m", -1), checked: how long the model
  stays loaded after this request (server/hosting.py reads it, for every API).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from localinfer.engine.sampling import HISTORY_TAIL
from localinfer.errors import UsageError
from localinfer.server.errors import BadRequest
from localinfer.server.requests import Defaults
from localinfer.thinking.style import EFFORTS, Think
from localinfer.units import parse_duration
from localinfer.user_config import OLLAMA_AT_LOAD, OLLAMA_NEUTRAL, OLLAMA_SAMPLING

MAX_STOPS = 16
# Ollama's names, kept with config.toml's, which takes them too (user_config.OLLAMA_OPTIONS).
# SAMPLING: passed to the chat request under the same name, checked there. AT_LOAD: the model was
# loaded once, with serve's options. NEUTRAL: methods not implemented, with the value leaving
# them off.
SAMPLING, AT_LOAD, NEUTRAL = OLLAMA_SAMPLING, OLLAMA_AT_LOAD, OLLAMA_NEUTRAL


@dataclass(frozen=True)
class Steering:
    """What the fields ask beyond the chat request's own: stop strings (Ollama's bound, not
    OpenAI's 4), the request's context, and whether thinking was asked for."""

    stops: tuple[str, ...] = ()
    num_ctx: int | None = None
    think: bool | str | None = None


def apply(body: dict, chat: dict, defaults: Defaults) -> tuple[Defaults, Steering]:
    """Fill `chat` (the OpenAI-shaped request) from Ollama's `body`; the request's Defaults
    (serve's, with repeat_last_n and think replaced) and what the reply's job needs besides."""
    options = body.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise BadRequest("'options' must be an object")
    for name, value in options.items():
        _check_name(name, value)
    for name in (*SAMPLING, "priority"):
        if options.get(name) is not None:
            chat[name] = options[name]
    most = _num_predict(options.get("num_predict"))
    if most is not None:
        chat["max_tokens"] = most
    _format(body.get("format"), chat)
    check_keep_alive(body.get("keep_alive"))
    think = _think(body.get("think"))
    params = defaults.params
    if options.get("repeat_last_n") is not None:
        params = dataclasses.replace(params, repeat_last_n=_window(options["repeat_last_n"]))
    if think is not None:
        level = think if isinstance(think, str) else ("on" if think else "off")
        defaults = dataclasses.replace(defaults, think=Think(level, defaults.think.budget))
    defaults = dataclasses.replace(defaults, params=params)
    return defaults, Steering(_stops(options.get("stop")), _num_ctx(options.get("num_ctx")),
                              think)


def _check_name(name: str, value) -> None:
    if name in SAMPLING or name in AT_LOAD or name in ("num_predict", "num_ctx", "stop",
                                                        "repeat_last_n", "priority"):
        return
    if name not in NEUTRAL:
        raise BadRequest(f"'options.{name[:64]}' is not an option this server knows; it takes "
                         f"{', '.join(SAMPLING)}, num_predict, num_ctx, stop, repeat_last_n "
                         "and priority")
    neutral = NEUTRAL[name]
    if neutral is not None and value is not None and value != neutral:
        raise BadRequest(f"'options.{name}' is not supported here (only {neutral}, which "
                         f"leaves it off)")


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _num_predict(value) -> int | None:
    """max_tokens, or None for until the end (Ollama's -1, and -2: until the context is full)."""
    if value is None or value in (-1, -2) and _integer(value):
        return None
    if not _integer(value) or not 1 <= value <= 10**7:
        raise BadRequest("'options.num_predict' must be -1 (no limit), -2 (fill the context) "
                         "or a number of tokens from 1 to 10000000")
    return value


def _num_ctx(value) -> int | None:
    if value is None:
        return None
    if not _integer(value) or not 1 <= value <= 2**31 - 1:
        raise BadRequest("'options.num_ctx' must be a positive integer")
    return value


def _window(value) -> int:
    if not _integer(value) or not 0 <= value <= HISTORY_TAIL:
        raise BadRequest(f"'options.repeat_last_n' must be an integer from 0 to {HISTORY_TAIL} "
                         f"(the tokens the repeat penalty looks back over here)")
    return value


def _stops(stops) -> tuple[str, ...]:
    if stops is None:
        return ()
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or len(stops) > MAX_STOPS \
            or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"'options.stop' must be a list of at most {MAX_STOPS} strings")
    return tuple(s for s in stops if s)


def _format(value, chat: dict) -> None:
    """`format` as the chat request's response_format: "json" any object, an object a schema."""
    if value is None or value == "":
        return
    if value == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(value, dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": value}}
    else:
        raise BadRequest("'format' must be \"json\" or a JSON schema (an object)")


def _think(value) -> bool | str | None:
    if value is None or isinstance(value, bool) or value in EFFORTS:
        return value
    raise BadRequest(f"'think' must be true, false or one of {', '.join(EFFORTS)}")


def check_keep_alive(value) -> float | None:
    """The keep-alive in seconds (math.inf: for ever; None: not said), read as Ollama reads it
    (units.parse_duration: seconds, or a Go duration such as "5m" or "1h30m")."""
    if value is None:
        return None
    try:
        return parse_duration(value, "keep_alive")
    except UsageError as e:
        raise BadRequest(str(e)) from None


def check_num_ctx(steering: Steering, request_ctx: int) -> int:
    """The context this request may use: its num_ctx, at most the server's. A larger num_ctx is
    read as the server's: Ollama clients (Open WebUI, editor plugins) send one with every request
    as a load setting, and this server loaded its model once with serve's --ctx; a prompt that
    does not fit is refused as on every other endpoint."""
    if steering.num_ctx is None:
        return request_ctx
    return min(steering.num_ctx, request_ctx)
