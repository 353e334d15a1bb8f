"""`map --server URL`: map's lines sent to a running `localinfer serve` as batch requests.

Each line is one request in OpenAI's API (a chat completion, or a completion with --raw) with
`priority: "batch"`, so the server answers its interactive requests first; `--parallel` requests
are under way at once. The answers print as map prints its own: in input order, plain or --jsonl,
a failed line as its own line on stderr. What only a model loaded here uses (--quant, --ctx,
--threads, ...) is refused: the server's own settings apply.

A line's own refusal (a 400: its chat template, its length) fails that line. Anything that would
fail every line the same way (no server, a wrong key, an unknown model, a model that cannot load)
ends the run in one line, and so does a reply that is not OpenAI's shape. A full queue (429,
other clients) is waited out, for a bounded time; Ctrl-C (or a line that ends the run) ends the
requests under way at once.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from localinfer.cli import http_client
from localinfer.cli.server_client import server_url
from localinfer.errors import LocalinferError, UsageError

PLACEHOLDER = "{}"          # map's template: where the line goes
# A request answers once whole, so its reply's first byte comes after its generation and its
# wait in line; the rest of the reply then comes at once. Its size: the answer, a trace, JSON.
LIMITS = http_client.Limits(wait_s=3600.0, reply_s=60.0, max_bytes=16 << 20)
BUSY_WAIT_S = 300.0         # a full queue (429) waited out this long at most for one line,
BUSY_TRIES = 300            # in at most this many tries (Retry-After, 1 s by default)
# map's options that only a model loaded here uses (their parameter names)
LOCAL_ONLY = ("quant", "memory_", "kv_type", "ctx", "no_cache", "backend", "threads",
              "gpu_layers", "cpu_moe", "offline", "grammar", "rpc")
FATAL = (401, 403, 404, 405)    # every line would get the same
LOAD_FAILED = ("model_load_failed", "model_too_large", "model_not_found")   # and these codes


def remote(command, server: str | None, model: str, template: str, params, max_tokens: int,
           stop: list[str], *, system: str | None, raw: bool, json_schema: str | None,
           think) -> Remote | None:
    """map's request to a server (--server), its options checked; None without --server.
    `command`: map's context, to tell the options given from their defaults."""
    if server is None:
        return None
    from localinfer.engine.structured import read_schema
    refuse_local_options(command)
    if raw and system is not None:
        raise UsageError("--system has no place in a --raw prompt sent to a server")
    return Remote(server_url(server, "--server"), model, template, system, raw, params, max_tokens,
                  tuple(stop), read_schema(json_schema)[0] if json_schema else None, think)


def refuse_local_options(ctx) -> None:
    """One line naming the options given (on the command line, not by config.toml) that
    --server cannot honour. `ctx`: the command's context (Typer's own click, so its sources
    are compared by name)."""
    given = [p.opts[0] for p in ctx.command.params if p.name in LOCAL_ONLY and
             getattr(ctx.get_parameter_source(p.name), "name", "") in ("COMMANDLINE",
                                                                       "ENVIRONMENT")]
    if given:
        raise UsageError(f"{', '.join(given)} set how a model is loaded here; with --server "
                         f"the server's own settings apply (--grammar: use --json-schema)")


@dataclass(frozen=True)
class Remote:
    """How a line becomes its request, and its reply the line's answer."""

    base: str
    model: str
    template: str
    system: str | None
    raw: bool
    params: object              # SamplingParams, checked already
    max_tokens: int
    stop: tuple[str, ...]
    schema: dict | None         # --json-schema's, as response_format takes it
    think: object               # thinking.style.Think

    def request(self, line: str, index: int) -> tuple[str, dict]:
        """The path and body a line is sent as."""
        p = self.params
        text = self.template.replace(PLACEHOLDER, line)
        body: dict = {"model": self.model, "max_tokens": self.max_tokens, "priority": "batch",
                      "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                      "min_p": p.min_p, "repeat_penalty": p.repeat_penalty,
                      "frequency_penalty": p.frequency_penalty,
                      "presence_penalty": p.presence_penalty,
                      "logit_bias": {str(token): bias for token, bias in p.logit_bias}}
        if p.seed not in (None, -1):
            body["seed"] = p.seed + index           # as map's own lines count up from it
        if self.stop:
            body["stop"] = list(self.stop)
        if self.schema is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": self.schema}}
        if self.raw:
            return "/v1/completions", body | {"prompt": text}
        said = [{"role": "system", "content": self.system}] if self.system is not None else []
        body["messages"] = said + [{"role": "user", "content": text}]
        think, budget = self.think.think, self.think.budget
        if think in ("on", "off"):
            body["chat_template_kwargs"] = {"enable_thinking": think == "on"}
        elif think is not None:
            body["reasoning_effort"] = think
        if budget is not None:
            body["thinking_budget"] = budget
        return "/v1/chat/completions", body

    def answer(self, line: str, index: int, halt: threading.Event | None = None):
        """The line's answer as a finished Job (its error set where the server refused it), and
        a thinking model's trace (None: none came). `halt` set ends the request."""
        from localinfer.engine.scheduler import Job
        job = Job([], None, None, index=index)
        path, body = self.request(line, index)
        reply = _post(self.base, path, body, halt or threading.Event())
        if isinstance(reply, str):          # the server refused this line
            job.error = reply
            return job, None
        choice = reply["choices"][0]
        said = choice.get("message") or {}
        job.text = (choice.get("text") if self.raw else said.get("content")) or ""
        trace = said.get("reasoning_content")
        job.stats.finish_reason = choice.get("finish_reason") or ""
        job.stats.generated_tokens = (reply.get("usage") or {}).get("completion_tokens") or 0
        if choice.get("closed_early"):
            job.stats.closed_at = job.stats.generated_tokens - (choice.get("closed_tokens") or 0)
        if trace and not job.text:
            from localinfer.thinking.setup import no_answer
            job.error = no_answer(True, job.stats.finish_reason, self.max_tokens, 0)
        return job, trace


def answer_lines(remote: Remote, feed, parallel: int, printer) -> None:
    """The lines through the server, `parallel` at a time, each printed once those before it
    are; at most `feed.ahead` read and not printed yet."""
    from localinfer.cli import console
    created = 0
    pending: dict[Future, int] = {}
    halt = threading.Event()        # set: the requests under way end (Ctrl-C, a fatal line)
    with ThreadPoolExecutor(parallel, thread_name_prefix="map-request") as pool, \
            console.progress_bar("answering") as progress:
        try:
            while True:
                while len(pending) < parallel and created - printer.next < feed.ahead:
                    line = feed.take(block=not pending)
                    if line is None:
                        break
                    printer.read(created, line)
                    pending[pool.submit(remote.answer, line, created, halt)] = created
                    created += 1
                if not pending:
                    return
                done, _ = wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
                for future in done:
                    del pending[future]
                    job, trace = future.result()    # a fatal failure is raised here
                    printer.trace(job.index, trace)
                    printer.finished(job)
                    if progress:
                        progress(printer.count, created, "")
        finally:
            halt.set()
            for future in pending:
                future.cancel()


def _post(base: str, path: str, body: dict, halt: threading.Event) -> dict | str:
    """The server's JSON reply, checked to be OpenAI's shape; the server's message for a refusal
    of this line alone; anything that would fail every line raised as one LocalinferError."""
    started = time.monotonic()
    for tries in range(1, BUSY_TRIES + 1):
        reply = http_client.exchange(base, path, body, limits=LIMITS, halt=halt)
        waited = time.monotonic() - started
        if reply.status == 429 and tries < BUSY_TRIES and waited < BUSY_WAIT_S:
            if halt.wait(min(_retry_after(reply.headers), BUSY_WAIT_S - waited)):
                raise LocalinferError("stopped")        # the run is ending: nobody reads this
            continue
        if reply.status == 429:
            raise LocalinferError(f"{base} stayed busy (429) for {waited:.0f} s over {tries} "
                                  "tries; try again later")
        if not 200 <= reply.status < 300:
            message, code = reply.error()
            if reply.status in FATAL or code in LOAD_FAILED:
                raise LocalinferError(f"{base}{path}: {reply.status} {message}")
            return message
        try:
            answer = reply.json()
        except ValueError:
            answer = None
        if (wrong := _not_openai(answer)) is not None:
            raise LocalinferError(f"{base}{path} did not answer as OpenAI's API does ({wrong}): "
                                  "is it a localinfer server?")
        return answer
    raise AssertionError("the last try returns or raises")


def _not_openai(answer: object) -> str | None:
    """What of a reply `answer` reads is not what OpenAI's API sends (None: all is)."""
    if not isinstance(answer, dict):
        return "not a JSON object"
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "no choices"
    choice = choices[0]
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
    fields = {"message": (choice.get("message"), dict), "text": (choice.get("text"), str),
              "content": (message.get("content"), str),
              "reasoning_content": (message.get("reasoning_content"), str),
              "finish_reason": (choice.get("finish_reason"), str),
              "usage": (answer.get("usage"), dict),
              "completion_tokens": (usage.get("completion_tokens"), int),
              "closed_early": (choice.get("closed_early"), bool),
              "closed_tokens": (choice.get("closed_tokens"), int)}
    for name, (value, kind) in fields.items():
        if value is None:
            continue
        if kind is int:     # a count: not a bool, not beyond any machine's
            ok = type(value) is int and 0 <= value < 1 << 62
        else:
            ok = isinstance(value, kind)
        if not ok:
            return f"its {name} is not {'a count' if kind is int else kind.__name__}"
    return None


def _retry_after(headers) -> float:
    """Retry-After's seconds, within 0.1 s and 30 s (1 s when it says none or a date)."""
    try:
        seconds = float(headers.get("Retry-After", 1))
    except ValueError:
        return 1.0
    return 1.0 if math.isnan(seconds) else min(max(seconds, 0.1), 30.0)
