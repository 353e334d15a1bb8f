"""A request body, checked before any of it reaches the model, and the job it asks for.

Whatever a client sends is a 400 in OpenAI's error shape unless it is a request we can answer: a
JSON object of bounded size and nesting with no lone UTF-16 surrogate in it (Python's json decodes
`"\\ud800"` into a string no encoder takes), the fields people use with the types and ranges OpenAI
documents (numbers compared exactly: a 400-digit integer is out of range, not an OverflowError),
a bounded number of messages and a prompt that fits what a request may use. `n` choices are n
jobs on the same prompt, each with its own sampler and seed (choice_seeds). The parse and the
job's making (template, tokens, a schema's grammar) run in a worker thread, off the event loop.
What a request leaves out (or sends as null) takes the server's defaults: `serve`'s sampling
options, its --system for a chat that has no system message, and its --think and --think-budget
(a thinking model's own fields are server/reasoning.py's).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field, replace
from typing import Sequence

from starlette.requests import ClientDisconnect, Request

from localinfer.backends import Grammar
from localinfer.engine.constrain import ConstrainedSampler
from localinfer.engine.decode import Limits
from localinfer.engine.prompt import chat_tokens, raw_tokens, uses_chat_template
from localinfer.engine.sampling import (BIAS_RANGE, MAX_BIASED, RANDOM_SEED, SamplingParams,
                                        make_sampler)
from localinfer.engine.scheduler import Job
from localinfer.engine.structured import from_schema
from localinfer.errors import LocalinferError, ModelLoadError
from localinfer.server import fields, logprob_fields, reasoning, reuse, tools
from localinfer.server import media_parts
from localinfer.server.errors import BadRequest
from localinfer.thinking import setup
from localinfer.thinking.style import Style, Think

MAX_BODY = 4 << 20            # bytes of one request body
BODY_SECONDS = 30.0           # to send the whole body once the headers are in
MAX_DEPTH = 64                # arrays and objects inside one another (a schema's nesting too)
MAX_MESSAGES = 4096           # in one chat request: far past any conversation a context holds
MAX_N = 128                   # choices of one request (the API caps them by the server's slots)
ROLES = ("system", "developer", "user", "assistant", "tool")
_SURROGATE = re.compile("[\ud800-\udfff]")
_TEMPLATE_ADVICE = "; use --raw to skip it"    # the CLI's way out; /v1/completions is the API's


@dataclass(frozen=True)
class Defaults:
    """What a request that does not say gets: the server's sampling, system message and
    thinking."""

    params: SamplingParams = field(default_factory=SamplingParams)
    system: str | None = None
    think: Think = Think()        # --think and --think-budget
    remote_media: bool = False    # --allow-remote-media: http(s) image URLs fetched
    normalise: bool = False       # --reuse-answers: a chat's text normalised (server/reuse.py)


@dataclass
class Prepared:
    job: Job
    stream: bool
    constrained: _OwnFailure | None     # the request's grammar: a dead end is its own error
    style: Style | None = None          # a thinking model's trace, told apart in the reply
    tools: tools.Plan | None = None     # the request's tools: calls told apart in the reply
    include_usage: bool = False         # stream_options.include_usage: a last chunk of usage
    others: list[Prepared] = field(default_factory=list)    # choices 1 to n-1 (`n`)
    decides: reuse.Decides | None = None    # what keys its answer in the answer store


class _OwnFailure:
    """A constrained sampler that remembers its own failure (a grammar that allows no token of
    the vocabulary): the reply says the request's schema was at fault, not the engine."""

    def __init__(self, sampler: ConstrainedSampler) -> None:
        self.sampler, self.failed = sampler, None

    def __call__(self, logits, history: Sequence[int]) -> int:
        try:
            return self.sampler(logits, history)
        except LocalinferError as e:
            self.failed = str(e)
            raise


async def read_body(request: Request, *, seconds: float = BODY_SECONDS) -> bytes:
    """The body, refused past MAX_BODY (from Content-Length before reading, when it says) or
    when it does not arrive within `seconds` (408; the connection is closed after it)."""
    size = request.headers.get("content-length")
    too_big = BadRequest(f"the request body is over {MAX_BODY >> 20} MB",
                         headers={"Connection": "close"})
    if size is not None and (not size.isascii() or not size.isdigit() or int(size) > MAX_BODY):
        raise too_big
    chunks, total = [], 0
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.stream():
                total += len(chunk)
                if total > MAX_BODY:
                    raise too_big
                chunks.append(chunk)
    except TimeoutError:
        raise BadRequest(f"the request body did not arrive within {seconds:g} s", status=408,
                         code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:        # nobody is left to read the reply; nothing went wrong here
        raise BadRequest("the client left before its body was whole") from None
    return b"".join(chunks)


def parse(raw: bytes) -> dict:
    """The body as a JSON object, its nesting and text checked (see the module's notes)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"the request body nests arrays and objects deeper than {MAX_DEPTH}") \
            from None
    except json.JSONDecodeError:
        raise BadRequest("the request body is not JSON") from None
    except ValueError:          # UnicodeDecodeError, or an integer past Python's digit limit
        raise BadRequest("the request body is not JSON in UTF-8 with numbers of sane length") \
            from None
    _check_values(body)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _check_values(body) -> None:
    """No nesting past MAX_DEPTH, no lone surrogate in any string or key; without recursion."""
    stack = [(body, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise BadRequest("the request body holds a lone UTF-16 surrogate (\\ud800 to "
                                 "\\udfff without its pair), which is not text")
        elif isinstance(value, (list, dict)):
            if depth >= MAX_DEPTH:
                raise BadRequest(f"the request body nests arrays and objects deeper than "
                                 f"{MAX_DEPTH}")
            if isinstance(value, dict):
                stack.extend((key, depth) for key in value)
                value = value.values()
            stack.extend((item, depth + 1) for item in value)


def prepare(raw: bytes | dict, session, names: tuple[str, ...], request_ctx: int, *,
            chat: bool, defaults: Defaults = Defaults()) -> Prepared:
    """The job a body (raw, or `parse`d already) asks for (run in a thread: template, tokens and
    grammar take time)."""
    body = raw if isinstance(raw, dict) else parse(raw)
    check_model(body, names)
    try:
        return _prepare(body, session, request_ctx, chat=chat, defaults=defaults)
    except media_parts.NoProjector as e:
        raise e.naming(body["model"]) from None
    except ModelLoadError as e:         # the chat template refused or failed on these messages
        raise BadRequest(f"the chat template cannot render these messages: "
                         f"{str(e).removesuffix(_TEMPLATE_ADVICE)}", "messages") from None
    except LocalinferError as e:        # any other check below the API (a UsageError too)
        raise BadRequest(str(e)) from None


def check_model(body: dict, names: tuple[str, ...]) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest("'model' is required and must be a string", "model")
    if model not in names:
        raise BadRequest(f"the model '{model[:200]}' does not exist here; this server has "
                         f"'{names[0]}'", "model", status=404, code="model_not_found")


def _prepare(body: dict, session, request_ctx: int, *, chat: bool,
             defaults: Defaults) -> Prepared:
    fields.refuse(body, "chat" if chat else "completions")     # what no answer here gives
    n = _number(body, "n", int, 1, 1, MAX_N)
    most = body.get("max_completion_tokens", body.get("max_tokens"))
    # 0 on /v1/completions: the prompt alone, scored with echo (server/completions.py)
    limit = -1 if most is None else _number({"max_tokens": most}, "max_tokens", int, 1,
                                            1 if chat else 0, 10**7)
    params = _sampling(body, defaults.params, session.n_vocab)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    include_usage = usage_asked(body)
    stops = _stops(body.get("stop"))
    schema = _response_schema(body.get("response_format"))
    plan = tools.plan(body, session.chat_template or "") if chat else None
    plan = tools.with_answer(plan, schema, "response_format")   # a call, or the typed answer
    tokens = _tokens(body, session, chat=chat, defaults=defaults, plan=plan)
    if len(tokens) >= request_ctx:
        raise BadRequest(f"the prompt is {len(tokens):,} tokens; a request here may use "
                         f"{request_ctx:,}", "messages" if chat else "prompt",
                         code="context_length_exceeded")
    # A chat with a thinking model: its trace told apart, a budget or a schema gating the answer
    style = setup.style_of(session, tokens, raw=False) if chat else None
    budget = _number(body, "thinking_budget", int, defaults.think.budget, 0, 10**7) \
        if chat else None
    limits = Limits(limit, stops, shown=setup.shown_markers(session, style),
                    logprobs=logprob_fields.asked(body, chat=chat))

    def choice(params: SamplingParams) -> Prepared:
        """One of the n choices: a job with a sampler (and a grammar) of its own."""
        grammar = tools.grammar(plan, session)      # None: no tools, or tool_choice none
        if grammar is None and schema is not None:
            grammar = _grammar(schema, session)
        if not tools.covers_trace(plan):     # harmony's tools grammar spans the trace itself
            grammar = setup.gate_for(session, style, Think(budget=budget), grammar) or grammar
        constrained = None if grammar is None else \
            _OwnFailure(ConstrainedSampler(params, grammar))
        sampler = make_sampler(params) if constrained is None else constrained
        job = Job(tokens, sampler, limits, batch=_priority(body.get("priority")) == "batch")
        return Prepared(job, stream, constrained, style, plan, include_usage,
                        decides=reuse.decides(body, params, schema, budget, chat))
    first, *others = [choice(replace(params, seed=seed)) for seed in choice_seeds(params.seed, n)]
    first.others = others
    return first


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """Each choice's seed: the request's for the first, the next numbers for the others (so the
    same request gets the same choices); without a seed, a new draw for each."""
    if seed is None or seed == RANDOM_SEED:
        return [seed] * n
    return [(seed + i) % 2**63 for i in range(n)]


def usage_asked(body: dict) -> bool:
    """OpenAI's stream_options.include_usage: a stream's usage only when asked, in a chunk of
    its own with no choices."""
    options = body.get("stream_options")
    if options is None:
        return False
    usage = options.get("include_usage") if isinstance(options, dict) else None
    if not isinstance(options, dict) or usage not in (None, True, False):
        raise BadRequest("'stream_options' must be an object whose include_usage is true or "
                         "false", "stream_options")
    return bool(usage)


PRIORITIES = ("interactive", "batch")
PRIORITY_HEADER = "x-priority"


def _priority(value) -> str:
    """`priority`: interactive (the default) or batch, which never takes a slot an interactive
    request waits for (engine/scheduler.py)."""
    if value is None:
        return "interactive"
    if value not in PRIORITIES:
        raise BadRequest("'priority' must be \"interactive\" or \"batch\"", "priority")
    return value


def with_priority_header(body: dict, headers) -> dict:
    """The body with the request's X-Priority header as its `priority`, unless it says one."""
    said = headers.get(PRIORITY_HEADER)
    if said is not None and "priority" not in body:
        body["priority"] = said.strip().lower()
    return body


def _tokens(body: dict, session, *, chat: bool, defaults: Defaults = Defaults(),
            plan: tools.Plan | None = None) -> list[int]:
    if chat:
        template = session.chat_template or ""
        reader = media_parts.Reader(defaults.remote_media)
        messages = _messages(body.get("messages"), template, reader)
        messages = reuse.normalised(messages) if defaults.normalise else messages
        if not uses_chat_template(session, False):
            raise BadRequest("this model has no chat template; use /v1/completions", "messages")
        if defaults.system is not None and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": defaults.system}, *messages]
        messages = tools.for_template(plan, messages, template)
        think = reasoning.think_of(body, defaults.think)
        extra = {**reasoning.template_vars(body, template, think), **tools.template_vars(plan)}
        tokens = media_parts.chat_tokens(session, messages, extra, reader.media) \
            if reader.media else chat_tokens(session, messages, extra)
        return tokens + setup.empty_trace_tokens(session, tokens, think.think)
    prompt = body.get("prompt")
    if isinstance(prompt, list):        # token ids, as they are (no BOS added)
        return logprob_fields.token_ids(prompt, session.n_vocab)
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string or a list of token ids", "prompt")
    return raw_tokens(session, reuse.nfc(prompt) if defaults.normalise else prompt)


def _sampling(body: dict, server: SamplingParams, n_vocab: int) -> SamplingParams:
    """OpenAI's temperature, top_p, seed, frequency_penalty, presence_penalty and logit_bias,
    and llama-server's top_k, min_p and repeat_penalty; the server's own for any left out. top_p
    0 keeps only the most likely token, as llama.cpp's top-p sampler does (it always keeps one),
    which is greedy decoding."""
    temperature = _number(body, "temperature", float, server.temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", float, server.top_p, 0.0, 1.0)
    if top_p == 0:
        temperature, top_p = 0.0, 1.0
    min_p = _number(body, "min_p", float, server.min_p, 0.0, 1.0)
    penalty = _number(body, "repeat_penalty", float, server.repeat_penalty, 0.0, 100.0)
    if min_p == 1:              # open ends, which _number's closed ranges cannot say
        raise BadRequest("'min_p' must be a number from 0 to below 1", "min_p")
    if penalty == 0:
        raise BadRequest("'repeat_penalty' must be a number above 0 (1 is off)", "repeat_penalty")
    return SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p,
                          top_k=_number(body, "top_k", int, server.top_k, 0, 2**31 - 1),
                          repeat_penalty=penalty, repeat_last_n=server.repeat_last_n,
                          seed=_number(body, "seed", int, server.seed, -1, 2**63 - 1),
                          frequency_penalty=_number(body, "frequency_penalty", float,
                                                    server.frequency_penalty, -2.0, 2.0),
                          presence_penalty=_number(body, "presence_penalty", float,
                                                   server.presence_penalty, -2.0, 2.0),
                          logit_bias=_logit_bias(body.get("logit_bias"), server.logit_bias,
                                                 n_vocab))


def _logit_bias(value, server: tuple[tuple[int, float], ...], n_vocab: int
                ) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (ids as strings, as JSON keys are; integers from the Python
    API too), each id in the vocabulary and each bias from -100 to 100."""
    if value is None:
        return server
    if not isinstance(value, dict) or len(value) > MAX_BIASED:
        raise BadRequest(f"'logit_bias' must be an object of at most {MAX_BIASED} token ids "
                         "and their biases", "logit_bias")
    pairs = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() \
            and len(key) < 12 else -1
        if not 0 <= token < n_vocab:
            raise BadRequest(f"'logit_bias' names '{str(key)[:40]}', not a token id of this "
                             f"model (0 to {n_vocab - 1})", "logit_bias")
        ok = isinstance(bias, (int, float)) and not isinstance(bias, bool) and \
            -BIAS_RANGE <= bias <= BIAS_RANGE
        if not ok:
            raise BadRequest(f"'logit_bias' of token {token} must be a number from "
                             f"-{BIAS_RANGE:g} to {BIAS_RANGE:g}", "logit_bias")
        pairs.append((token, float(bias)))
    return tuple(pairs)


def _response_schema(response_format) -> dict | None:
    """The JSON schema an answer must match: OpenAI's {"type": "json_schema", "json_schema":
    {"schema": ...}}, or {"type": "json_object"} (any object, or llama-server's "schema")."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return response_format.get("schema") or {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadRequest("response_format.json_schema needs a 'schema'", "response_format")
        return spec["schema"]
    raise BadRequest("response_format.type must be text, json_object or json_schema",
                     "response_format")


def _grammar(schema, session) -> Grammar:
    """The same check and grammar as `run --json-schema` (llama.cpp's own parse of the
    converter's grammar is left to the grammar sampler: the check's stderr capture would take
    the server's own log lines with it)."""
    try:
        return session.grammar(from_schema(schema, "response_format", check_parse=False).gbnf)
    except (LocalinferError, RecursionError) as e:        # a UsageError is one too
        reason = str(e) if isinstance(e, LocalinferError) else "the schema nests too deeply"
        raise BadRequest(reason, "response_format") from None


def _messages(messages, template: str = "",
              reader: media_parts.Reader | None = None) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"{len(messages):,} messages; a request may hold {MAX_MESSAGES:,}",
                         "messages")
    media_parts.count(messages)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] needs a role of {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):     # [{"type": "text", "text": ...}, {"type": "image_url"...
            content = media_parts.joined(content, f"messages[{i}].content", reader)
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            content = ""            # a turn of calls alone
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        # OpenAI's `developer` is the system's role under another name, for every template
        out.append({"role": "system" if m["role"] == "developer" else m["role"],
                    "content": content,
                    **reasoning.earlier_trace(m, i, template), **tools.history(m, i)})
    return out


def _number(body: dict, key: str, kind, default, low, high):
    """body[key] within [low, high] (an int for kind int); compared exactly, never converted
    first: float() of a 400-digit integer overflows."""
    value = body.get(key)
    if value is None:           # left out, or null: OpenAI's fields are nullable
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
    if ok and kind is int and isinstance(value, float):
        ok = value.is_integer()
    if not ok:
        raise BadRequest(f"'{key}' must be {'an integer' if kind is int else 'a number'} "
                         f"from {low} to {high}", key)
    return kind(value)


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise BadRequest("'stop' must be a string or a list of at most 4 strings", "stop")
    return tuple(stops)
