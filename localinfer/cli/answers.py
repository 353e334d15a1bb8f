"""`--reuse-answers` (run, map): answers from the answer store (cache/answers.py,
pipeline/reuse.py)."""

from __future__ import annotations

import typer

from localinfer.cli.options import SAMPLING


def reuse_answers_option():
    return typer.Option(False, "--reuse-answers", rich_help_panel=SAMPLING,
                        help="Answer a --temp 0 or --seed request asked "
                        "before from the answer store.")
