"""Routers in `serve` (issue 45 section 1): each `[routers.NAME]` of config.toml
(localinfer/routing, read and checked when serve starts) is one more model name in every API.

- Listed beside the models: /v1/models (the OpenAI and Anthropic clients read it) and Ollama's
  /api/tags (as NAME:latest, format "router").
- A request that names a router is answered by one of its models, leased from serve's pool as
  any model is (loaded when reached; the pool unloads an idle one to make room, so models that
  do not fit together run one at a time). A rule router picks its model by what the request
  holds (routing.Facts: the prompt's length in its first model's tokens, a schema, tools,
  thinking, a priority). A cascade's cheapest model answers first with its chosen tokens scored
  (routing.scoring); its text is held back (`Gate`) until its first `tokens` tokens, or its end,
  decide on the policy's confidence: the answer stands and its held text goes out, or the job is
  cancelled, nothing of it sent, its lease given back, and the next model answers. A greedy
  answer is so the chosen model's own, byte for byte.
- The choice is visible: the header X-Localinfer-Routed-To, `routed_to` in the usage, and
  /metrics' localinfer_routed_total and localinfer_routed_passed_on_total by router and model.

Each API keeps its own request and reply: it hands `answer` an `attempt(seen, gate)` that
prepares the request on a leased model's view and runs it (server/jobs.py takes the gate); a
routed request is not answered from the answer store.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from dataclasses import replace
from datetime import datetime, timezone
from typing import Awaitable, Callable

from localinfer import routing
from localinfer.routing import Cascade, Facts, Router
from localinfer.server import hosting, jobs
from localinfer.server.errors import BadRequest

HEADER = "X-Localinfer-Routed-To"
MAX_DEPTH = 8           # rule routers inside one another (config.toml's check refuses cycles)
_SCHEDULED = ("interactive", "batch")     # the priorities the scheduler itself takes

Attempt = Callable[[object, "Gate | None"], Awaitable[object]]


def find(served, name: object) -> Router | None:
    """The router a request's model names (Ollama's `:latest` allowed), or None."""
    found = getattr(served, "routers", None) or {}
    if not found or not isinstance(name, str):
        return None
    return found.get(name.strip().lower().removesuffix(":latest"))


async def counting_view(served, body: dict, *, tag: str = ""):
    """The server as a token count sees the request (no job): a router's count is its first
    model's, the one a cascade asks first (a rule router's first model, through any router it
    names), as clients such as Claude Code count before they send."""
    router, name = find(served, body.get("model")), None
    while router is not None:               # config.py refused cycles
        name = router.models[0]
        router = find(served, name)
    if name is None:
        return await hosting.open_view(served, body, tag=tag, job=False)
    lease = await served.models.lease(name, body.get("keep_alive"), trusted=True)
    return hosting.view(served, lease, body["model"])


async def answer(served, request, body: dict, attempt: Attempt, refuse, *, tag: str = ""):
    """The reply to `body`: the API's own `attempt` on the model it names, or on the model its
    router chooses. `refuse(BadRequest)` is the API's error reply."""
    router = find(served, body.get("model"))
    if router is None:
        try:
            seen = await hosting.open_view(served, body, tag=tag)
        except BadRequest as e:
            return refuse(e)
        return await attempt(seen, None)
    priority = _unscheduled(body)
    try:
        return await _routed(served, request, body, attempt, router, priority, 0)
    except BadRequest as e:
        return refuse(e)


async def run_on(served, request, body: dict, refuse, prepare, fail, reply_of):
    """`answer` for an API whose job is `prepare(body, seen)` and whose reply is
    `reply_of(seen, prepared)`, run by server/jobs.py (`fail`: its error replies)."""
    async def attempt(seen, gate):
        try:
            prepared = await hosting.prepared(seen, prepare, body, seen)
        except BadRequest as e:
            return refuse(e)
        return await jobs.run(seen, request, prepared, reply_of(seen, prepared), fail, gate)
    return await answer(served, request, body, attempt, refuse)


async def _routed(served, request, body: dict, attempt: Attempt, router: Router,
                  priority: str | None, depth: int):
    if router.kind == "rule":
        member, rule = await _chosen(served, body, router, priority)
        inner = find(served, member)
        if inner is not None and depth < MAX_DEPTH:
            return await _routed(served, request, body, attempt, inner, priority, depth + 1)
        said = {"router": router.name, "rule": "default" if rule is None else f"rule {rule + 1}"}
        return await _tried(served, body, attempt, Gate(router.name, member, None, said))
    threshold = router.policy.threshold
    said = {"router": router.name, "threshold": threshold if math.isfinite(threshold)
            else str(threshold), "route": []}      # JSON has no infinity: "inf", "-inf"
    for i, member in enumerate(router.models):
        last = i == len(router.models) - 1
        gate = Gate(router.name, member, None if last else router.policy, said)
        response = await _tried(served, body, attempt, gate)
        if response is not None:
            return response
        served.metrics.passed_on(router.name, member)
        if gate.gone:
            raise BadRequest("the client left before its answer")
    raise AssertionError("a cascade's last model always answers")


async def _tried(served, body: dict, attempt: Attempt, gate: Gate):
    """The request on `gate.member`; None when its answer was passed on."""
    lease = await served.models.lease(gate.member, body.get("keep_alive"), trusted=True)
    batch = hosting._asks_batch(body)
    seen = hosting.view(served, lease, body["model"], batch=batch, coming=not batch)
    response = await attempt(seen, gate)
    if response is not None:
        response.headers[HEADER] = gate.member
        served.metrics.routed(gate.router, gate.member)
    return response


class Gate:
    """One model's try at a routed request. With a cascade's policy its text is held back until
    its confidence decides (`kept`); without one it goes out as it comes. Either way its job
    says `routed_to` and `routing` (the usage's fields: `said`, the router's name and its rule,
    or its threshold and each model tried with its confidence, filled as the decisions come)."""

    def __init__(self, router: str, member: str, policy: Cascade | None,
                 said: dict | None = None) -> None:
        self.router, self.member, self.policy = router, member, policy
        self.said = said if said is not None else {"router": router}
        self.kept: bool | None = None if policy is not None else True
        self.confidence: float | None = None
        self.gone = False               # the client left while the answer was held
        self._held: list[str] = []
        self._asked: int | None = None  # the client's own top count (None: no logprobs asked)
        self._shown = 0                 # the scored tokens cut to it so far (`_as_asked`)
        self._decision: asyncio.Future | None = None

    def refusal(self, answers: int) -> str | None:
        """Why a request of this many answers cannot go through this gate (None: it can)."""
        if self.policy is not None and answers > 1:
            return (f"'n' above 1 is not routed: the cascade router {self.router} decides on "
                    "one answer")
        return None

    def wrap(self, job, on_text, on_done):
        """(on_text, on_done) for the worker, holding the text back until the decision (on the
        event loop: the decision is awaited there)."""
        job.routed_to, job.routing = self.member, self.said
        if self.policy is None:
            if "route" in self.said:        # a cascade's last model: its answer stands
                self.said["route"].append({"model": self.member, "confidence": None,
                                           "accepted": True})
            return on_text, on_done
        self._asked = job.limits.logprobs
        job.limits = routing.scoring(job.limits, self.policy)
        loop = asyncio.get_running_loop()
        self._decision = loop.create_future()

        def text(piece: str) -> None:           # the scheduler's thread, as `done`
            if self.kept:
                self._as_asked(job)
                on_text(piece)
            elif self.kept is None:
                self._held.append(piece)
                if len(job.logprobs) >= self.policy.tokens:
                    self._decide(job, on_text, loop)

        def done(finished) -> None:
            if self.kept is None:
                self._decide(finished, on_text, loop)
            on_done(finished)
        return text, done

    def _decide(self, job, on_text, loop) -> None:
        if job.cancelled:
            self.kept = False
        elif job.error is not None:     # its failure is the reply's to tell
            self.kept = True
        else:
            self.confidence = self.policy.confidence(job.logprobs)
            self.kept = self.policy.decide(self.confidence)
        finite = self.confidence is not None and math.isfinite(self.confidence)
        self.said["route"].append({"model": self.member, "accepted": self.kept,
                                   "confidence": self.confidence if finite else None})
        if self.kept:
            self._as_asked(job)
            for piece in self._held:
                on_text(piece)
        else:
            job.cancelled = True        # freed before the scheduler's next step
        self._held = []
        loop.call_soon_threadsafe(_settle, self._decision, self.kept)

    def _as_asked(self, job) -> None:
        """The scored tokens' alternatives cut to what the client asked for: the measure may
        have needed more (margin: the runner-up), and they are read only once decided."""
        if self._asked is None or self._asked >= self.policy.top:
            return
        for i in range(self._shown, len(job.logprobs)):
            job.logprobs[i] = replace(job.logprobs[i], top=job.logprobs[i].top[:self._asked])
        self._shown = len(job.logprobs)

    async def decided(self, request, job) -> bool:
        """Whether the answer stands (at once without a policy); a client that leaves meanwhile
        cancels the job (`gone`)."""
        if self._decision is None:
            return True
        watch = asyncio.create_task(self._until_gone(request, job))
        try:
            return await self._decision
        finally:
            watch.cancel()

    async def _until_gone(self, request, job) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.gone = job.cancelled = True


def _settle(future: asyncio.Future, kept: bool) -> None:
    if not future.done():
        future.set_result(kept)


# -- a rule router's facts ------------------------------------------------------------------------
async def _chosen(served, body: dict, router: Router,
                  priority: str | None) -> tuple[str, int | None]:
    """(the model or router the rules name, the rule's index; None: the default)."""
    rules = router.policy
    tokens = await _count(served, body, router) if rules.counts_tokens else None
    facts = Facts(tokens, schema=_schema(body), tools=bool(body.get("tools")),
                  thinking=_thinking(body), priority=priority)
    return rules.choose(facts)


async def _count(served, body: dict, router: Router) -> int:
    """The prompt's text in the tokens of the router's first model (a router's first model's,
    if it names a router)."""
    first = router.models[0]
    for _ in range(MAX_DEPTH):
        inner = find(served, first)
        if inner is None:
            break
        first = inner.models[0]
    lease = await served.models.lease(first, trusted=True)
    try:
        session = lease.model.session
        return len(await asyncio.to_thread(session.tokenize, _text(body), special=False))
    finally:
        lease.release()


def _text(body: dict) -> str:
    """Every text of the request's prompt: system, messages (strings or text blocks), prompt."""
    said = [body.get("system"), body.get("prompt"), body.get("instructions"), body.get("input")]
    said += [m.get("content") for m in _list(body.get("messages")) + _list(body.get("input"))
             if isinstance(m, dict)]
    texts = []
    for value in said:
        if isinstance(value, str):
            texts.append(value)
        for block in _list(value):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                texts.append(block["text"])
    return "\n".join(texts)


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _options(body: dict) -> dict:
    options = body.get("options")
    return options if isinstance(options, dict) else {}


def _schema(body: dict) -> bool:
    fmt = body.get("response_format")
    config = body.get("output_config")
    return (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) \
        or body.get("format") not in (None, "") \
        or (isinstance(config, dict) and config.get("format") is not None)


def _thinking(body: dict) -> bool:
    think, effort, thinking = body.get("think"), body.get("reasoning_effort"), body.get("thinking")
    return think not in (None, False) or effort not in (None, "none") \
        or (isinstance(thinking, dict) and thinking.get("type") == "enabled") \
        or body.get("reasoning") is not None


def _unscheduled(body: dict) -> str | None:
    """The request's priority (its body's, or Ollama's options'); one the scheduler does not
    take ("high") is the router's alone, taken out of the body, which would be refused for it."""
    said = None
    for holder in (body, _options(body)):
        value = holder.get("priority")
        if isinstance(value, str):
            said = said or value
            if value not in _SCHEDULED:
                del holder["priority"]
    return said


# -- the model lists --------------------------------------------------------------------------
def openai_models(served) -> list[dict]:
    """/v1/models' entries of the routers."""
    return [{"id": r.name, "object": "model", "created": 0, "owned_by": "localinfer",
             "router": {"policy": r.kind, "models": list(r.models)}}
            for r in (getattr(served, "routers", None) or {}).values()]


def ollama_tags(served) -> list[dict]:
    """/api/tags' entries of the routers: no file, so no size; the digest is the router's."""
    return [_tag(r) for r in (getattr(served, "routers", None) or {}).values()]


def ollama_show(router: Router) -> dict:
    """/api/show's reply for a router: no file, template or parameters of its own; its policy
    and models in model_info."""
    tag = _tag(router)
    return {"modelfile": "", "parameters": "", "template": "", "details": tag["details"],
            "model_info": {"router.policy": router.kind, "router.models": list(router.models)},
            "capabilities": ["completion"], "modified_at": tag["modified_at"]}


def _tag(r: Router) -> dict:
    digest = hashlib.sha256(json.dumps([r.kind, list(r.models)]).encode()).hexdigest()
    return {"name": f"{r.name}:latest", "model": f"{r.name}:latest",
            "modified_at": _modified(r), "size": 0, "digest": digest,
            "details": {"parent_model": "", "format": "router", "family": "router",
                        "families": None, "parameter_size": "", "quantization_level": ""}}


def _modified(router: Router) -> str:
    try:
        stamp = router.path.stat().st_mtime
    except OSError:
        stamp = 0
    return datetime.fromtimestamp(stamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
