"""Ollama's API (/api/*). Being built for issue 28 §3: no routes yet."""

from __future__ import annotations


def routes(served) -> list:
    return []
