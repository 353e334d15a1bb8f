"""How `run` talks to the shell: piped stdin combined with the prompt, the answer streamed to
stdout (or one JSON object), and the figures on stderr."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from localinfer import console
from localinfer.errors import UsageError

if TYPE_CHECKING:
    from localinfer import runner
    from localinfer.decode import Generation


def messages(text: str, system: str | None) -> list[dict[str, str]]:
    from localinfer.templates import messages_for
    return messages_for(text, system)


def read_stdin() -> str | None:
    """Piped input, or None when stdin is a terminal or absent."""
    stream = sys.stdin
    if stream is None or console.interactive(stream):
        return None
    try:
        return stream.read()
    except (OSError, ValueError):
        return None


def combine_input(stdin_text: str | None, prompt: str | None) -> str:
    """`{stdin}\\n\\n{prompt}`, either part optional; prompt '-' means stdin alone."""
    if prompt == "-":
        prompt = None
    parts = [p for p in ((stdin_text or "").rstrip("\n"), prompt or "") if p.strip()]
    if not parts:
        raise UsageError("the prompt is empty; pass PROMPT or pipe text on stdin")
    return "\n\n".join(parts)


def emit(generation: Generation, loaded: runner.LoadedModel, *, as_json: bool, verbose: bool) -> None:
    pieces: list[str] = []
    try:
        for piece in generation:
            pieces.append(piece)
            if not as_json:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        generation.stats.finish_reason = "interrupted"
        _finish(generation, loaded, pieces, as_json=as_json, verbose=verbose)
        raise
    _finish(generation, loaded, pieces, as_json=as_json, verbose=verbose)


def _finish(generation: Generation, loaded: runner.LoadedModel, pieces: list[str], *,
            as_json: bool, verbose: bool) -> None:
    stats = generation.stats
    if as_json:
        record = {"model": loaded.ref.display, "backend": loaded.backend, "text": "".join(pieces),
                  **stats.as_dict()}
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    elif not "".join(pieces[-1:]).endswith("\n"):
        sys.stdout.write("\n")   # end the answer's line, as shell tools do; $(...) drops it
    sys.stdout.flush()
    if verbose:
        from localinfer import prompt_cache
        console.note(format_stats(stats, loaded))
        if generation.cache.store is not None:
            console.note(prompt_cache.describe(generation.cache.last_event))
        if hasattr(stats, "drafted"):
            from localinfer.drafting import describe
            console.note(describe(stats))


def format_stats(stats, loaded: runner.LoadedModel) -> str:
    cached = f" ({stats.cached_tokens} cached)" if stats.cached_tokens else ""
    return (f"{loaded.ref.display} on {loaded.backend} · load {stats.load_s:.2f} s · "
            f"prompt {stats.prompt_tokens} tokens{cached} · ttft {stats.ttft_s * 1000:.0f} ms · "
            f"prefill {stats.prefill_tps:.1f} t/s · decode {stats.decode_tps:.1f} t/s · "
            f"{stats.generated_tokens} tokens ({stats.finish_reason})")
