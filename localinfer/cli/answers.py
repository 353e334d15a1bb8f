"""`--reuse-answers` (run, map): answers from the answer store (cache/answers.py,
pipeline/reuse.py); `--reuse-similarity` and `--reuse-embedder` (run): by meaning too
(cache/semantic.py)."""

from __future__ import annotations

import typer

from localinfer.cli.options import SAMPLING


def reuse_answers_option():
    return typer.Option(False, "--reuse-answers", rich_help_panel=SAMPLING,
                        help="Answer a --temp 0 or --seed request "
                        "asked before from the answer store.")


# No default threshold: none measured on the models here reuses paraphrases without near misses
# (docs/answer-reuse.md), so matching by meaning is asked for with a number or not at all.
def reuse_similarity_option():
    return typer.Option(None, "--reuse-similarity", min=0.0, max=1.0, metavar="COSINE",
                        rich_help_panel=SAMPLING, show_default=False,
                        help="Reuse answers of prompts this similar.")


def reuse_embedder_option():
    return typer.Option(None, "--reuse-embedder", metavar="MODEL", rich_help_panel=SAMPLING,
                        show_default=False, help="Embeddings for --reuse-similarity.")


def similar(threshold: float | None, embedder: str | None):
    """--reuse-similarity and --reuse-embedder as the request carries them (pipeline/similar.py
    `asked`: None without a threshold; a missing embedder file refused before anything loads)."""
    from localinfer.pipeline.similar import asked
    return asked(threshold, embedder)
