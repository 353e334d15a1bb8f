"""The embeddings endpoints (/v1/embeddings, /api/embed). Being built for issue 28 §4: no routes yet."""

from __future__ import annotations


def routes(served) -> list:
    return []
