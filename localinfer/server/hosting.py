"""What `serve` serves: every model it can find by name, each loaded on demand into the pool
(server/pool.py) and leased by a request for as long as its answer runs.

A request's `model` is resolved as `run` resolves a MODEL (catalogue name or alias[:QUANT],
hf:OWNER/REPO[:QUANT]) to the pool's key (server/loading.py's Loader.key), so an alias, another
case or the variant's own name reach the same loaded model. A name that arrives over the network
reaches only the store, the catalogue and the models `serve` was started with (by any name they
have, their files' too): anything that reads as a path is a 404 whose words are the same whether
or not such a file exists, and nothing on the disk is looked at for it. Without --pull a model
must be on disk already: a name the store and catalogue do not know, or a catalogue model not
pulled, is a 404. The models named on the command line are loaded at start and, unless a request
says otherwise, stay loaded.

Each request works on a view of the server (`open_view`) whose model fields are its leased
model's; the view's `release` gives the lease back, once, when the answer is done. An interactive
request's view tells the model's worker it is coming (`arrived` once submitted); a batch request's
view prepares it in a thread of its own (`off_loop`), so that a flood of batch requests never
queues ahead of an interactive one in the loop's default threads.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import math
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from localinfer.errors import LocalinferError, ModelNotFound
from localinfer.models import refs
from localinfer.server.errors import BadRequest
from localinfer.server.file_facts import FileFacts
from localinfer.server.loading import Loader, ServedModel, names_of
from localinfer.server.pool import Lease, Pool
from localinfer.server.pool_state import Busy, Status, TooLarge

KNOWN_NAMES = 1024      # names resolved to keys that are remembered (a client may send any)
# A request's name that reads as a path: the same words for a file that exists and one that does not
NOT_A_PATH = ("a request names a model of the store or the catalogue, or one serve was started "
              "with, never a file")
_BATCH_THREAD = ThreadPoolExecutor(1, thread_name_prefix="localinfer-batch-prepare")


class Models:
    """The pool, and the names that reach its models."""

    def __init__(self, loader: Loader, pool: Pool[ServedModel], *, pull: bool = False,
                 log: Callable[[str], None] = lambda line: None) -> None:
        self.loader, self.pool, self.pull = loader, pool, pull
        self.facts = FileFacts(log)     # what the lists say of each file, read once
        self._keys: OrderedDict[str, str] = OrderedDict()     # a request's name -> pool key
        self._pinned: dict[str, str] = {}    # the command line's models: every name -> key
        self._kept: set[str] = set()          # their keys: kept loaded unless a request says
        self._lock = threading.Lock()

    # -- names ------------------------------------------------------------------------------
    def key(self, name: str, trusted: bool = False) -> str:
        """The pool's key for a request's model name (blocking: reads the catalogue and the
        store); a LocalinferError for a name that cannot be served. `trusted`: the name is the
        operator's (a router's model in config.toml), and may be a file as `run` takes one."""
        if name in self._pinned:
            return self._pinned[name]
        if refs.looks_like_path(name) and not trusted:  # on the text alone: the disk is not asked
            raise ModelNotFound(NOT_A_PATH)
        with self._lock:            # requests resolve their names in threads of their own
            key = self._keys.get(name)
            if key is not None:
                self._keys.move_to_end(name)
        if key is None:
            key = self.loader.key(name)
            if not self.pull:
                self.loader.on_disk(name)
            with self._lock:
                self._keys[name] = key
                if len(self._keys) > KNOWN_NAMES:
                    self._keys.popitem(last=False)
        # A model loaded under another of its names (the variant's own, an alias) answers this
        # one too, rather than a second copy of it.
        for model in self._models():
            if key == model.name or name in model.names or key in model.names:
                return model.name
        return key

    def preload(self, name: str) -> ServedModel:
        """A command-line model: loaded now (pulled first if need be), kept loaded, and reached
        by every name it has."""
        key = self.loader.key(name)
        with self.pool.acquire(key, math.inf) as lease:
            model = lease.model
        for known in (name, key, *model.names):
            self._pinned.setdefault(known, key)
        self._kept.add(key)
        return model

    def listed(self) -> list[tuple[str, int, list[str]]]:
        """What /v1/models lists, with the context one request may use where it is known (0:
        not loaded, so not fitted yet). Blocking: reads the store."""
        from localinfer.server.media_parts import capabilities
        loaded = {m.names[0]: (m.n_ctx, capabilities(m.session)) for m in self._models()}
        return [(name, *loaded.get(name, (0, []))) for name, _ in self.files()]

    def files(self) -> list[tuple[str, Path]]:
        """(name, file) of every model that can be served without a download: the models loaded,
        by the name each answers with, then every model on disk as NAME:QUANT (/api/tags), but
        a file whose header cannot be read (logged once). Blocking: reads the store and, once
        per file, its header."""
        from localinfer.models import hub, refs
        shown = {m.names[0]: m.path for m in self._models()}
        loaded = {path.resolve() for path in shown.values() if path is not None}
        store = refs.model_store()
        for stored in store.installed():
            if stored.path.resolve() not in loaded and self.facts.readable(stored.path):
                name = f"{hub.stored_name(store, stored.name)}:{stored.quant}"
                shown.setdefault(name, stored.path)
        return list(shown.items())

    def _models(self) -> list[ServedModel]:
        return [m for m in map(self.loaded, (s.name for s in self.pool.status())) if m]

    def broken(self) -> str | None:
        """A loaded model whose worker has failed (its engine error), for /health."""
        for status in self.pool.status():
            model = self.loaded(status.name)
            if model is not None and model.worker.error is not None:
                return f"{model.names[0]}: {model.worker.error}"
        return None

    def loaded(self, key: str) -> ServedModel | None:
        return self.pool.peek(key)

    def status(self) -> list[Status]:
        return self.pool.status()

    # -- leases -----------------------------------------------------------------------------
    async def lease(self, name: object, keep_alive: object = None, *,
                    trusted: bool = False, media: str | None = None) -> Lease[ServedModel]:
        """The model a request names, loaded if need be, kept loaded as the request's
        `keep_alive` says (its field as sent: checked here); the errors each as the client's
        reply: a bad keep_alive a 400, an unknown name a 404, a full wait a 429, too large a 400,
        a failed load a 500. `media` ("images", "audio"): what the request sends, refused
        before a load when the model's file has no projector beside it."""
        key, keep_alive = await self._resolved(name, keep_alive, trusted)
        if keep_alive is None and key in self._kept:
            keep_alive = math.inf
        try:
            if media is not None and self.loaded(key) is None:
                await asyncio.to_thread(self._sees, key, str(name), media)
            return await self.pool.acquire_async(key, keep_alive)
        except Busy as e:
            raise BadRequest(str(e), status=429, code="too_many_requests") from None
        except TooLarge as e:
            raise BadRequest(str(e), "model", code="model_too_large") from None
        except ModelNotFound as e:          # its file went away since the name was resolved
            raise BadRequest(str(e), "model", status=404, code="model_not_found") from None
        except LocalinferError as e:
            raise BadRequest(str(e), status=500, code="model_load_failed") from None

    async def unload(self, name: object) -> bool:
        """Unload the model a request names, once the requests holding it are done, without
        loading anything (Ollama's keep_alive 0 with no prompt; `localinfer stop`): every name a
        request may use reaches it. False when no model is loaded under that name; an unknown
        name is a 404, as for any request."""
        key = await self._key_or_404(name)
        return self.pool.stop(key)

    async def about(self, name: object) -> About:
        """What a model is, loaded or not: a loaded one as it runs, another as it would be
        fitted (its file and context), never loaded, pulled or quantized to say it (Ollama's
        /api/show): a model not on disk is a 404 (even with --pull), one that does not fit the
        budget the 400 a request for it gets."""
        key = await self._key_or_404(name)
        model = self.loaded(key)
        if model is not None:
            return About(model.names, model.path, model.n_ctx, model.session)
        try:
            plan = await asyncio.to_thread(self._describe, key)
        except TooLarge as e:
            raise BadRequest(str(e), "model", code="model_too_large") from None
        except LocalinferError as e:        # its file went away
            raise BadRequest(str(e), "model", status=404, code="model_not_found") from None
        _, fitted = plan.detail
        return About(names_of(key, fitted.ref), fitted.path, plan.n_ctx, None)

    def _sees(self, key: str, name: str, media: str) -> None:
        from localinfer.models import projector
        from localinfer.server.media_parts import NoProjector
        _, fitted = self._describe(key).detail
        if fitted.path is not None and projector.beside(fitted.path) is None:
            raise NoProjector(media, name)

    def _describe(self, key: str):
        loader = self.loader.describing()
        loader.on_disk(key)
        plan = loader.plan(key)
        self.pool.check_fits(key, plan.need)    # the words a request's load would get
        return plan

    async def _key_or_404(self, name: object) -> str:
        return (await self._resolved(name, None))[0]

    async def _resolved(self, name: object, keep_alive: object,
                        trusted: bool = False) -> tuple[str, float | None]:
        """(the pool's key for a request's name, its keep_alive in seconds or None), both read
        in a thread: neither is the event loop's work. A bad keep_alive is a 400 before the
        name's 404."""
        from localinfer.server.ollama_options import check_keep_alive
        if not isinstance(name, str) or not name:
            raise BadRequest("'model' is required and must be a string", "model")

        def read() -> tuple[str, float | None]:
            seconds = check_keep_alive(keep_alive)
            return self._key_or_raise(name, trusted), seconds
        return await asyncio.to_thread(read)

    def _key_or_raise(self, name: str, trusted: bool = False) -> str:
        try:
            return self.key(name, trusted)
        except LocalinferError as e:
            loaded = ", ".join(m.names[0] for m in self._models()) or "none"
            raise BadRequest(f"model '{name[:200]}' not found: {e}; loaded now: "
                             f"{loaded}", "model", status=404, code="model_not_found") from None


@dataclass(frozen=True)
class About:
    """A model as /api/show describes it; `session` is None when it is not loaded (its chat
    template is then read from its file)."""

    names: tuple[str, ...]
    path: Path | None
    n_ctx: int
    session: object | None


async def open_view(served, body: dict, *, name_key: str = "model", tag: str = "",
                    job: bool = True):
    """The server as the request in `body` sees it, its model leased (errors as BadRequest).
    `tag`: a suffix a name may carry that names nothing (Ollama's `:latest`). The request's
    `keep_alive` (Ollama's field; an extra one in the OpenAI and Anthropic APIs) is the model's
    from now on. `job`: the request is answered by the model's worker (not an embedding or a
    description)."""
    name = body.get(name_key)
    bare = name.removesuffix(tag) if tag and isinstance(name, str) else name
    from localinfer.server.media_parts import asked
    media = asked(body)
    lease = await served.models.lease(bare or name, body.get("keep_alive"),
                                      **({"media": media} if media else {}))
    batch = _asks_batch(body)
    return view(served, lease, name, batch=batch, coming=job and not batch)


def view(served, lease: Lease[ServedModel], asked: str, *, batch: bool = False,
         coming: bool = False):
    """The server as one request sees it: the leased model's fields, the server's own shared
    (its metrics, its answers under way); `release()` gives the lease back. The name the
    request used is among `names` (names[0] stays the one the model answers with). A job
    `coming` is expected by the worker until `arrived()`."""
    model = lease.model
    seen = copy.copy(served)
    seen.worker, seen.session = model.worker, model.session
    seen.names = tuple(dict.fromkeys([model.names[0], asked, *model.names[1:]]))
    seen.request_ctx, seen.model_path, seen.need = model.n_ctx, model.path, model.need
    seen.arrived = model.worker.expect() if coming else (lambda: None)
    seen.executor = _BATCH_THREAD if batch else None

    def release() -> None:
        seen.arrived()
        lease.release()
    seen.embeddings, seen.release = model.embeddings, release
    return seen


async def off_loop(seen, fn, *args, **kwargs):
    """fn(*args, **kwargs) in a thread: the view's own for a batch request, else the loop's."""
    call = functools.partial(fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(seen.executor, call)


async def prepared(seen, fn, *args, **kwargs):
    """A request's preparation off the loop (off_loop); if it fails for any reason (a BadRequest
    or a failure no check foresaw) the view's lease goes back before the error propagates."""
    try:
        return await off_loop(seen, fn, *args, **kwargs)
    except BaseException:
        seen.release()
        raise


def _asks_batch(body: dict) -> bool:
    """The request says priority "batch" (in the body, or Ollama's options); its value is
    checked where the job is made (requests.prepare)."""
    options = body.get("options")
    said = body.get("priority", options.get("priority") if isinstance(options, dict) else None)
    return said == "batch"
