"""The embeddings endpoints: OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and its older
POST /api/embeddings, over the served model opened for embeddings on the first request
(server/embedder.py): one L2-normalised float32 vector per input, the model's own pooling (mean
for a generative model), the same vectors `localinfer embed` writes for the same lines.

Every refusal is one error in the API's own shape (OpenAI's, or Ollama's {"error": ...}) before
any work: an input that is not text, an empty one (a lone "" to Ollama loads the model and gets
no vectors, as Ollama answers it), token ids (ids another tokenizer made, tiktoken's for OpenAI's
models, would name other tokens of this vocabulary: the text is asked for instead), more than
MAX_INPUTS inputs, an input longer than the embedding context (OpenAI: 400; Ollama cuts it
unless `truncate` is false, then 400), more than MAX_TOKENS tokens in all (413), and a
`dimensions` other than the model's (no model here is trained to be cut shorter).

The work runs in threads, a group of inputs at a time (the CLI's groups: the same batches, so
the same vectors), and the event loop stays free: between groups a client that left or a server
stopping ends the request. Calls to the embedder take turns (pipeline/embed.py); the generation
worker decodes in its own context meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from localinfer.errors import UsageError
from localinfer.server import access, hosting
from localinfer.server.embedder import Unavailable
from localinfer.server.errors import BadRequest, ollama_error
from localinfer.server.requests import check_model, parse, read_body

MAX_INPUTS = 2048          # inputs in one request: OpenAI's own limit
MAX_TOKENS = 300_000       # tokens of one request's inputs together: OpenAI's own limit
GROUP = 4                  # embedder batches per thread call: `localinfer embed`'s groups
LATEST = ":latest"         # Ollama's default tag, which its clients may add to a name
_IDS = ("token ids are not taken here: send the text (ids another tokenizer made, such as "
        "tiktoken's for OpenAI's models, name other tokens in this model's vocabulary; "
        "LangChain's OpenAIEmbeddings sends text with check_embedding_ctx_length=False)")


@dataclass(frozen=True)
class _Asked:
    texts: list[str]
    truncate: bool | None         # None: no truncation in this API (OpenAI's)
    dimensions: int | None


def routes(served) -> list:
    async def openai(request: Request):
        return await _leased(served, request, _openai, lambda e: e.response())

    async def embed(request: Request):
        return await _leased(served, request, _ollama, lambda e: e.response(ollama_error),
                             tag=LATEST)

    async def legacy(request: Request):
        return await _leased(served, request, _ollama_legacy,
                             lambda e: e.response(ollama_error), tag=LATEST)

    return [Route("/v1/embeddings", openai, methods=["POST"]),
            Route("/api/embed", embed, methods=["POST"]),
            Route("/api/embeddings", legacy, methods=["POST"])]


async def _leased(served, request: Request, handle, refuse, tag: str = ""):
    """`handle(the server as the request sees it, request, body)` with the request's model
    leased until it returns; `refuse` gives the error reply when the model cannot be had."""
    started = time.perf_counter()
    try:
        raw = await read_body(request, seconds=served.body_seconds)
        body = await asyncio.to_thread(parse, raw)
        seen = await hosting.open_view(served, body, tag=tag, job=False)
    except BadRequest as e:
        return refuse(e)
    if (entry := access.record(request.scope)) is not None:
        entry.model = seen.names[0]
    try:
        return await handle(seen, request, body, started)
    finally:
        seen.release()


async def _openai(served, request: Request, body: dict, started: float):
    try:
        check_model(body, served.names)
        texts = _openai_input(body.get("input"))
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise BadRequest("'encoding_format' must be float or base64", "encoding_format")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise BadRequest("'user' must be a string", "user")
        vectors, tokens, _ = await _embed(served, request,
                                          _Asked(texts, None, _dimensions(body, zero=False)))
    except BadRequest as e:
        return e.response()
    return _json(await asyncio.to_thread(_openai_reply, served.names[0], vectors, tokens,
                                         encoding))


async def _ollama(served, request: Request, body: dict, started: float):
    try:
        model = _ollama_model(body, served.names)
        texts = _ollama_input(body.get("input"))
        truncate = True if body.get("truncate") is None else body["truncate"]
        if not isinstance(truncate, bool):
            raise BadRequest("truncate must be true or false")
        _check_options(body)
        asked = _Asked(texts, truncate, _dimensions(body, zero=True))
        if texts:
            vectors, tokens, loading = await _embed(served, request, asked)
        else:                   # Ollama's way to load a model: no input, no vectors
            vectors, tokens, loading = None, 0, (await _opened(served))[1]
    except BadRequest as e:
        return e.response(ollama_error)
    seconds = time.perf_counter() - started
    return _json(await asyncio.to_thread(lambda: json.dumps({
        "model": model, "embeddings": [] if vectors is None else vectors.tolist(),
        "total_duration": int(seconds * 1e9), "load_duration": int(loading * 1e9),
        "prompt_eval_count": tokens}).encode()))


async def _ollama_legacy(served, request: Request, body: dict, started: float):
    """{model, prompt} -> {embedding}; an empty prompt loads the model and gets [], as Ollama
    answers it. A prompt longer than the context is cut to it (the request cannot say)."""
    try:
        _ollama_model(body, served.names)
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise BadRequest("prompt must be a string")
        _check_options(body)
        if prompt:
            vectors, _, _ = await _embed(served, request, _Asked([prompt], True, None))
        else:
            await _opened(served)
    except BadRequest as e:
        return e.response(ollama_error)
    return _json(json.dumps({"embedding": vectors[0].tolist() if prompt else []}).encode())


def _openai_input(value) -> list[str]:
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        texts = value
    elif isinstance(value, list) and value and all(_ids(v) or isinstance(v, list) and v and
                                                   all(_ids(i) for i in v) for v in value):
        raise BadRequest(_IDS, "input")
    elif isinstance(value, list) and not value:
        raise BadRequest("'input' is an empty list: there is nothing to embed", "input")
    else:
        raise BadRequest("'input' must be a string or a list of strings", "input")
    _check_texts(texts, "input")
    return texts


def _ids(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ollama_input(value) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest("input must be a string or a list of strings")
    _check_texts(value, None)
    return value


def _check_texts(texts: list[str], param: str | None) -> None:
    if len(texts) > MAX_INPUTS:
        raise BadRequest(f"the input holds {len(texts)} texts; one request may hold at most "
                         f"{MAX_INPUTS}", param, status=413, code="too_many_inputs")
    for i, text in enumerate(texts):
        if not text:
            raise BadRequest(f"{_label(len(texts), i)} is empty: there is nothing to embed",
                             param)


def _label(count: int, i: int) -> str:
    return "the input" if count == 1 else f"input {i}"


def _dimensions(body: dict, *, zero: bool) -> int | None:
    """`dimensions` as asked (None: not asked; Ollama's 0 is not asked either)."""
    value = body.get("dimensions")
    if value is None or (zero and value == 0 and _ids(value)):
        return None
    if not _ids(value) or value < 1:
        raise BadRequest("'dimensions' must be a whole number of 1 or more", "dimensions")
    return value


def _check_options(body: dict) -> None:
    """Ollama's `options` (the sampler's and the context's: nothing an embedding here uses)
    and `keep_alive` (the model stays loaded while the server runs) are accepted as Ollama
    accepts them; only their shape is checked."""
    if body.get("options") is not None and not isinstance(body["options"], dict):
        raise BadRequest("options must be an object")
    keep_alive = body.get("keep_alive")
    if keep_alive is not None and not isinstance(keep_alive, (str, int, float)):
        raise BadRequest("keep_alive must be a duration (\"5m\") or a number of seconds")


def _ollama_model(body: dict, names: tuple[str, ...]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required")
    if model not in names and model.removesuffix(LATEST) not in names:
        raise BadRequest(f"model '{model[:200]}' not found; this server has '{names[0]}'",
                         status=404)
    return model


async def _opened(served):
    """(the embedder, seconds this request spent loading it)."""
    try:
        return await served.embeddings.get()
    except Unavailable as e:
        raise BadRequest(str(e), status=e.status) from None


async def _embed(served, request: Request, asked: _Asked):
    """(vectors, the tokens embedded, seconds spent loading the embedder)."""
    from localinfer.pipeline import embed
    embedder, loading = await _opened(served)
    try:
        embed.check_dimensions(asked.dimensions, embedder)
    except UsageError as e:
        raise BadRequest(str(e), "dimensions") from None
    tokens = await asyncio.to_thread(_tokens, embedder, asked)
    return await _vectors(served, request, embedder, tokens), sum(map(len, tokens)), loading


def _tokens(embedder, asked: _Asked) -> list[list[int]]:
    """Each input's tokens, checked against the context and the request's bound (a thread)."""
    out, total, count = [], 0, len(asked.texts)
    param = "input" if asked.truncate is None else None
    for i, text in enumerate(asked.texts):
        tokens = embedder.engine.tokenize(text)
        if len(tokens) > embedder.ctx:
            if not asked.truncate:
                advice = "send it shorter" + ("" if asked.truncate is None else
                                              " or leave truncate on")
                raise BadRequest(f"{_label(count, i)} holds {len(tokens)} tokens, more than the "
                                 f"{embedder.ctx} one input may hold here; {advice}", param)
            tokens = tokens[:embedder.ctx]
        total += len(tokens)
        if total > MAX_TOKENS:
            raise BadRequest(f"the inputs hold more than {MAX_TOKENS:,} tokens together, the "
                             "most one request may hold; send them in several requests", param,
                             status=413, code="too_many_tokens")
        out.append(tokens)
    return out


async def _vectors(served, request: Request, embedder, tokens: list[list[int]]):
    """The vectors, a group of inputs per thread call; a stop asked for (Served.close puts an
    item in every queue of under_way) or a client gone ends the request between groups."""
    import numpy as np

    from localinfer.pipeline import embed
    stopping, parts, step = asyncio.Queue(), [], GROUP * embedder.engine.n_seq
    served.under_way.add(stopping)
    try:
        for start in range(0, len(tokens), step):
            if not stopping.empty():
                raise BadRequest("the server is shutting down; the embeddings were not "
                                 "finished", status=503, code="server_shutting_down")
            if start and await request.is_disconnected():
                raise BadRequest("the client left before its embeddings were finished")
            parts.append(await asyncio.to_thread(embed.vectors_of, embedder,
                                                 tokens[start:start + step]))
    finally:
        served.under_way.discard(stopping)
    return np.concatenate(parts)


def _openai_reply(model: str, vectors, tokens: int, encoding: str) -> bytes:
    from localinfer.pipeline.embed import to_base64
    rows = [to_base64(row) for row in vectors] if encoding == "base64" else vectors.tolist()
    return json.dumps({"object": "list", "model": model,
                       "data": [{"object": "embedding", "index": i, "embedding": row}
                                for i, row in enumerate(rows)],
                       "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}).encode()


def _json(data: bytes) -> Response:
    return Response(data, media_type="application/json")
