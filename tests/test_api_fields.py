"""Every request field of the official clients' request types is listed in docs/apis.md's "Every
request field" tables (their source: localinfer/server/fields.py), so a field a client gains
cannot slip through unlisted (issue 44); the tables in the docs are the module's; and each
refused field is refused where its API reads the body, when it asks for something."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from localinfer.server import fields
from localinfer.server.errors import BadRequest

DOCS = Path(__file__).parent.parent / "docs" / "apis.md"


def _keys(*types) -> set[str]:
    """The fields of TypedDicts (their bases' too) or pydantic models."""
    out: set[str] = set()
    for t in types:
        if hasattr(t, "model_fields"):
            out |= set(t.model_fields)
            continue
        for klass in getattr(t, "__mro__", (t,)):
            out |= set(getattr(klass, "__annotations__", {}))
    return out


def _client_fields() -> dict[str, set[str]]:
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    ollama = pytest.importorskip("ollama")
    from anthropic.types import message_count_tokens_params as count
    from anthropic.types import message_create_params as messages
    from ollama import _types as ot
    from openai.types import completion_create_params as completions
    from openai.types import embedding_create_params as embeddings
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses
    assert openai and anthropic and ollama
    return {
        "chat": _keys(chat.CompletionCreateParamsNonStreaming,
                      chat.CompletionCreateParamsStreaming),
        "completions": _keys(completions.CompletionCreateParamsNonStreaming,
                             completions.CompletionCreateParamsStreaming),
        "embeddings": _keys(embeddings.EmbeddingCreateParams),
        "responses": _keys(responses.ResponseCreateParamsNonStreaming,
                           responses.ResponseCreateParamsStreaming),
        "messages": _keys(messages.MessageCreateParamsNonStreaming,
                          messages.MessageCreateParamsStreaming),
        "count_tokens": _keys(count.MessageCountTokensParams),
        "ollama generate": _keys(ot.GenerateRequest), "ollama chat": _keys(ot.ChatRequest),
        "ollama embed": _keys(ot.EmbedRequest), "ollama show": _keys(ot.ShowRequest),
        "ollama options": _keys(ot.Options),
    }


@pytest.mark.parametrize("api", list(fields.APIS))
def test_every_field_of_the_clients_request_types_is_listed(api):
    listed = set(fields.APIS[api])
    sent = _client_fields()[api]
    assert sent, api                # the walk found the type's fields at all
    assert not sent - listed, f"{api}: fields no table lists: {sorted(sent - listed)}"


def _docs_tables() -> dict[str, dict[str, str]]:
    text = DOCS.read_text()
    section = text[text.index("## Every request field"):]
    section = section[:section.index("\n## ", 1)]
    tables: dict[str, dict[str, str]] = {}
    for block in section.split("\n### ")[1:]:
        title = block.splitlines()[0]
        tables[title] = {m[1]: m[2] for m in re.finditer(r"^\| `([^`]+)` \| ([a-z ]+) \|",
                                                          block, re.M)}
    return tables


def test_the_docs_tables_are_the_modules():
    tables = list(_docs_tables().values())
    assert len(tables) == len(fields.APIS)
    for table, (api, truth) in zip(tables, fields.APIS.items()):
        assert table == {name: verdict for name, (verdict, _) in truth.items()}, api


def _asking(name: str):
    return {"modalities": ["text", "audio"], "best_of": 3, "background": True}.get(name, "yes")


def _refused(api: str) -> list[str]:
    return [n for n, (verdict, _) in fields.APIS[api].items() if verdict == fields.REFUSED]


def test_refused_fields_are_refused_by_name_where_each_api_reads_its_body():
    from localinfer.server import anthropic, ollama, ollama_options, requests, responses
    from localinfer.server.requests import Defaults
    readers = {
        "chat": lambda body: requests.prepare({"model": "m", **body}, None, ("m",), 512,
                                              chat=True),
        "completions": lambda body: requests.prepare({"model": "m", **body}, None, ("m",), 512,
                                                     chat=False),
        "responses": responses._refuse_unsupported,
        "messages": lambda body: anthropic._translate({"model": "m", **body}, Defaults(),
                                                      counting=False),
        "count_tokens": lambda body: anthropic._translate({"model": "m", **body}, Defaults(),
                                                          counting=True),
        "ollama generate": lambda body: ollama._generate_body(body, {}, None),
        "ollama options": lambda body: ollama_options.apply({"options": body}, {}, Defaults()),
    }
    for api, read in readers.items():
        for name in _refused(api):
            with pytest.raises(BadRequest, match=name):
                read({name: _asking(name)})
        for name in _refused(api):      # the neutral values pass this check
            if name not in ("typical_p", "tfs_z", "mirostat"):
                fields.refuse({name: None}, api)


@pytest.mark.parametrize("body", [{"modalities": ["text"]}, {"best_of": 1}, {"audio": None},
                                  {"functions": []}, {"prediction": {}}])
def test_neutral_values_of_refused_fields_are_accepted(body):
    fields.refuse(body, "completions" if "best_of" in body else "chat")


def test_a_field_asking_for_something_is_a_400_naming_it():
    with pytest.raises(BadRequest) as e:
        fields.refuse({"audio": {"voice": "alloy"}}, "chat")
    assert e.value.param == "audio" and "no model here speaks" in str(e.value)
