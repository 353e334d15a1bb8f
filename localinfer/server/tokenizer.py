"""The model's own tokenizer over HTTP, in vLLM's shapes: GET /tokenizer_info, POST /tokenize and
POST /detokenize. lm-evaluation-harness's `local-completions` finds them and then sends token-id
prompts made by this server's tokenizer (its "remote" tokenizer), with no tokenizer of its own
to download.

A request may name its model (`model`, in the body or as ?model= on GET); without one it is the
only model loaded (vLLM serves one; a client of it names none). /tokenize takes `prompt` (control tokens'
text is read as those tokens, as /v1/completions reads a prompt) and `add_special_tokens` (BOS
where the model wants one); /detokenize takes `tokens`, ids of the model's vocabulary.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from localinfer.engine.prompt import with_bos
from localinfer.server import hosting, logprob_fields, logprob_shapes
from localinfer.server.errors import BadRequest
from localinfer.server.requests import parse, read_body

MAX_TEXT = 1 << 22          # characters /tokenize takes


def routes(served) -> list[Route]:
    async def info(request: Request):
        return await _answer(served, {"model": request.query_params.get("model")}, _info)

    async def tokenize(request: Request):
        return await _posted(served, request, _tokenize)

    async def detokenize(request: Request):
        return await _posted(served, request, _detokenize)

    return [Route("/tokenizer_info", info, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"])]


async def _posted(served, request: Request, answer):
    try:
        body = await asyncio.to_thread(parse, await read_body(
            request, seconds=served.body_seconds))
    except BadRequest as e:
        return e.response()
    return await _answer(served, body, answer)


async def _answer(served, body: dict, answer):
    try:
        if body.get("model") is None:
            body = {**body, "model": _default(served)}
        seen = await hosting.open_view(served, body, job=False)
    except BadRequest as e:
        return e.response()
    try:
        return JSONResponse(await asyncio.to_thread(answer, body, seen))
    except BadRequest as e:
        return e.response()
    finally:
        seen.release()


def _default(served) -> str:
    loaded = [s.name for s in served.models.status()]
    model = served.models.loaded(loaded[0]) if len(loaded) == 1 else None
    if model is None:
        raise BadRequest("'model' is required unless exactly one model is loaded", "model")
    return model.names[0]


def _info(body: dict, seen) -> dict:
    session = seen.session

    def text(token: int | None) -> str | None:
        return None if token is None else session.token_text(token)
    return {"model": seen.names[0], "tokenizer_class": "llama.cpp",
            "bos_token": text(session.bos_token), "eos_token": text(session.eos_token),
            "pad_token": None, "add_bos_token": bool(session.add_bos),
            "chat_template": session.chat_template, "model_max_length": seen.request_ctx,
            "vocab_size": session.n_vocab}


def _tokenize(body: dict, seen) -> dict:
    prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
    if not isinstance(prompt, str) or len(prompt) > MAX_TEXT:
        raise BadRequest(f"'prompt' must be a string of at most {MAX_TEXT:,} characters",
                         "prompt")
    if not isinstance(special, bool):
        raise BadRequest("'add_special_tokens' must be true or false", "add_special_tokens")
    tokens = seen.session.tokenize(prompt, special=True) if prompt else []
    if special:
        tokens = with_bos(seen.session, tokens)
    return {"count": len(tokens), "max_model_len": seen.request_ctx, "tokens": tokens}


def _detokenize(body: dict, seen) -> dict:
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise BadRequest("'tokens' must be a list of token ids", "tokens")
    ids = logprob_fields.token_ids(tokens, seen.session.n_vocab) if tokens else []
    return {"prompt": logprob_shapes.decoded(seen.session, ids)}
