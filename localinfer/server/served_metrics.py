"""serve's `/metrics`: what llama-server's --metrics shows, in Prometheus's text format
(server/metrics.py), with a `model` label wherever a figure belongs to one model, so the same
series hold when one server serves several.

Counted as things happen: requests by endpoint and status (server/access.py's middleware, when a
response is over, so a refused key or an unknown path counts too), and per generation, when the
scheduler is done with it (server/jobs.py): its prompt and generated tokens, how it finished, its
time to first token and the time each later token took. Read at each scrape: each loaded model's
queue, running sequences and KV cells (its worker), and its memory.

The endpoint answers GET (and HEAD, as Starlette adds) behind the same Host and API-key checks as
every other path.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from localinfer.server.metrics import CONTENT_TYPE, Registry

PREFIX = "localinfer_"
# Seconds. A first token comes after the queue and the prompt: tens of ms to a minute.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
# Seconds per token once decoding: a few ms on a GPU, a few hundred for a large model on a CPU.
TPOT_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
OTHER = "other"         # the endpoint label of any path the server does not have


@dataclass(frozen=True)
class Loaded:
    """One model loaded now, as /metrics shows it."""

    name: str
    worker: object          # server.worker.Worker: its queue, sequences and cells
    ram: int = 0            # bytes the model holds, by the fit's estimate
    vram: int = 0           # of them, in (discrete) GPU memory


def loaded(served) -> list[Loaded]:
    """The models loaded now (the pool's: a model still loading has no worker to read yet)."""
    shown = []
    for status in served.models.status():
        model = served.models.loaded(status.name)
        if model is not None:
            shown.append(Loaded(model.names[0], model.worker, status.need.ram, status.need.vram))
    return shown


class ServedMetrics:
    """Every series /metrics shows, and the updates the server makes to them."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.counter(PREFIX + "requests_total", "HTTP requests answered, by "
                                  "endpoint (its path; 'other' for an unknown one) and status.",
                                  ("endpoint", "status"))
        self.prompt = r.counter(PREFIX + "prompt_tokens_total", "Prompt tokens of generations.",
                                ("model",))
        self.cached = r.counter(PREFIX + "prompt_tokens_cached_total", "Of the prompt tokens, "
                                "those not evaluated again (shared prefix, a slot's kept cells, "
                                "the prompt cache).", ("model",))
        self.generated = r.counter(PREFIX + "generated_tokens_total", "Tokens generated.",
                                   ("model",))
        self.generations = r.counter(PREFIX + "generations_total", "Generations ended, by how: "
                                     "stop, length, context, cancelled or error.",
                                     ("model", "finish"))
        self.reused = r.counter(PREFIX + "answers_reused_total", "Requests' answers replayed "
                                "from the answer store (serve --reuse-answers), not decoded; "
                                "not counted as generations.", ("model",))
        self.stored = r.counter(PREFIX + "answers_stored_total", "Answers added to the answer "
                                "store (serve --reuse-answers).", ("model",))
        self.routes = r.counter(PREFIX + "routed_total", "Requests a router gave to each of its "
                                "models: the model whose answer was sent.", ("router", "model"))
        self.passes = r.counter(PREFIX + "routed_passed_on_total", "Answers a cascade router's "
                                "model began and passed on to the next (its confidence under "
                                "the threshold); nothing of them was sent.", ("router", "model"))
        self.ttft = r.histogram(PREFIX + "time_to_first_token_seconds", "From a request's "
                                "arrival at the scheduler (its wait for a slot included) to its "
                                "first generated token.", TTFT_BUCKETS, ("model",))
        self.tpot = r.histogram(PREFIX + "time_per_output_token_seconds", "Seconds per token "
                                "after the first: each of a generation's later tokens observed "
                                "at that generation's mean.", TPOT_BUCKETS, ("model",))
        self.queue = r.gauge(PREFIX + "queue_depth", "Requests waiting for a free sequence.",
                             ("model",))
        self.running = r.gauge(PREFIX + "running_sequences", "Requests being decoded.",
                               ("model",))
        self.cells = r.gauge(PREFIX + "kv_cells_used", "KV cache cells holding tokens: running "
                             "requests', the shared prefix's, and free slots' kept cells (reused "
                             "by a request that starts the same way, dropped first).", ("model",))
        self.cells_total = r.gauge(PREFIX + "kv_cells", "KV cache cells of the model's context, "
                                   "shared by its requests.", ("model",))
        self.models = r.gauge(PREFIX + "models_loaded", "Models loaded.")
        self.memory = r.gauge(PREFIX + "model_memory_bytes", "Memory a loaded model holds by the "
                              "fit's estimate (weights, KV cache, buffers), in RAM and in GPU "
                              "memory.", ("model", "memory"))

    def request(self, path: str, status: int, endpoints: frozenset[str]) -> None:
        """One HTTP response over; unknown paths share one label (no series per typo)."""
        self.requests.inc(path if path in endpoints else OTHER, str(status) if status else "none")

    def generation(self, model: str, job, seconds: float) -> None:
        """A job the scheduler is done with, `seconds` after it was submitted (from its thread).
        Its first token came `decode_s` before its last, which is when it ended."""
        stats = job.stats
        self.prompt.inc(model, amount=stats.prompt_tokens)
        self.cached.inc(model, amount=stats.cached_tokens)
        self.generated.inc(model, amount=stats.generated_tokens)
        self.generations.inc(model, "error" if job.error else stats.finish_reason or "cancelled")
        if stats.generated_tokens > 0:
            self.ttft.observe(model, value=max(seconds - stats.decode_s, 0.0))
        if stats.generated_tokens > 1 and stats.decode_s > 0:
            later = stats.generated_tokens - 1
            self.tpot.observe(model, value=stats.decode_s / later, times=later)

    def reused_answer(self, model: str) -> None:
        self.reused.inc(model)

    def stored_answer(self, model: str) -> None:
        """From the answer store's thread."""
        self.stored.inc(model)

    def routed(self, router: str, model: str) -> None:
        self.routes.inc(router, model)

    def passed_on(self, router: str, model: str) -> None:
        self.passes.inc(router, model)

    def render(self, models: list[Loaded]) -> str:
        """The text of one scrape: the gauges read from `models` now, then every family."""
        for gauge in (self.queue, self.running, self.cells, self.cells_total, self.memory):
            gauge.clear()       # a model unloaded since the last scrape leaves no series
        for m in models:
            load = m.worker.load()
            self.queue.set(m.name, value=load.waiting)
            self.running.set(m.name, value=load.running)
            self.cells.set(m.name, value=load.cells_used)
            self.cells_total.set(m.name, value=load.cells)
            self.memory.set(m.name, "ram", value=m.ram)
            self.memory.set(m.name, "gpu", value=m.vram)
        self.models.set(value=len(models))
        return self.registry.render()


def routes(served) -> list[Route]:
    async def metrics(request: Request):
        return Response(served.metrics.render(loaded(served)), media_type=CONTENT_TYPE)

    return [Route("/metrics", metrics, methods=["GET"])]
