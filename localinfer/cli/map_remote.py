"""`map --server URL`: map's lines sent to a running `localinfer serve` as batch requests.

Each line is one request in OpenAI's API (a chat completion, or a completion with --raw) with
`priority: "batch"`, so the server answers its interactive requests first; `--parallel` requests
are under way at once. The answers print as map prints its own: in input order, plain or --jsonl,
a failed line as its own line on stderr. What only a model loaded here uses (--quant, --ctx,
--threads, ...) is refused: the server's own settings apply.

A line's own refusal (a 400: its chat template, its length) fails that line. Anything that would
fail every line the same way (no server, a wrong key, an unknown model, a model that cannot load)
ends the run in one line. A full queue (429, other clients) is waited out.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from localinfer.cli import http_client
from localinfer.cli.server_client import server_url
from localinfer.errors import LocalinferError, UsageError

PLACEHOLDER = "{}"          # map's template: where the line goes
ANSWER_TIMEOUT_S = 3600.0   # a request answers once whole: its generation and its wait in line
BUSY_RETRIES = 600          # 429s waited out for one line (Retry-After, 1 s by default)
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
                      "min_p": p.min_p, "repeat_penalty": p.repeat_penalty}
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

    def answer(self, line: str, index: int):
        """The line's answer as a finished Job (its error set where the server refused it), and
        a thinking model's trace (None: none came)."""
        from localinfer.engine.scheduler import Job
        job = Job([], None, None, index=index)
        path, body = self.request(line, index)
        reply = _post(self.base, path, body)
        if "error" in reply:
            job.error = reply["error"]
            return job, None
        choice = reply["choices"][0]
        said = choice.get("message") or {}
        job.text = (choice.get("text") if self.raw else said.get("content")) or ""
        trace = said.get("reasoning_content")
        job.stats.finish_reason = choice.get("finish_reason") or ""
        job.stats.generated_tokens = (reply.get("usage") or {}).get("completion_tokens", 0)
        if choice.get("closed_early"):
            job.stats.closed_at = job.stats.generated_tokens - choice.get("closed_tokens", 0)
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
    with ThreadPoolExecutor(parallel, thread_name_prefix="map-request") as pool, \
            console.progress_bar("answering") as progress:
        try:
            while True:
                while len(pending) < parallel and created - printer.next < feed.ahead:
                    line = feed.take(block=not pending)
                    if line is None:
                        break
                    printer.read(created, line)
                    pending[pool.submit(remote.answer, line, created)] = created
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
            for future in pending:
                future.cancel()


def _post(base: str, path: str, body: dict) -> dict:
    """The server's JSON reply; {"error": ...} for a refusal of this line alone; anything that
    would fail every line raised as one LocalinferError."""
    for _ in range(BUSY_RETRIES):
        reply = http_client.exchange(base, path, body, timeout=ANSWER_TIMEOUT_S)
        if reply.status == 429:
            time.sleep(_retry_after(reply.headers))
            continue
        if not 200 <= reply.status < 300:
            message, code = reply.error()
            if reply.status in FATAL or code in LOAD_FAILED:
                raise LocalinferError(f"{base}{path}: {reply.status} {message}")
            return {"error": message}
        try:
            answer = reply.json()
            if not isinstance(answer, dict) or not answer.get("choices"):
                raise ValueError
            return answer
        except ValueError:
            raise LocalinferError(f"{base}{path} did not answer as OpenAI's API does: is it a "
                                  "localinfer server?") from None
    raise LocalinferError(f"{base} stayed busy (429) for {BUSY_RETRIES} tries")


def _retry_after(headers) -> float:
    try:
        return min(max(float(headers.get("Retry-After", 1)), 0.1), 30.0)
    except ValueError:
        return 1.0
