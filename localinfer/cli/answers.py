"""`--reuse-answers` (run, map): answers from the answer store (cache/answers.py,
pipeline/reuse.py)."""

from __future__ import annotations

import typer

from localinfer.cli.options import CONTEXT


def reuse_answers_option():
    return typer.Option(False, "--reuse-answers", rich_help_panel=CONTEXT,
                        help="A deterministic request (--temp 0, or a --seed) asked before is "
                        "answered from the answer store, as it streamed then; its prompt's text "
                        "is NFC-normalised and trimmed. `cache ls` lists the store.")
