"""`localinfer show MODEL`: what a model runs with — its chat template, the defaults `run` uses for
it (built-in, or from config.toml) and its special tokens — as `ollama show --modelfile` tells.

Read from the GGUF header, never loading the model: instant even for a large one. `--template`
prints the template alone, byte for byte, for a pipe; `--parameters` prints TOML lines a user can
paste into config.toml under [defaults.MODEL].
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from localinfer.cli import console
from localinfer.cli.options import json_option
from localinfer.errors import LocalinferError, UsageError
from localinfer.models.refs import ModelRef

TEMPLATE_KEY = "tokenizer.chat_template"
# Control tokens shown as text before "... and N more"; --json lists up to gguf/tokens.py's bound.
SHOWN_CONTROL = 24
LAYOUT = "\n\t"     # what of a template a terminal shows as it is: its lines and indents


def register(app: typer.Typer) -> None:
    app.command()(show)


def show(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Catalogue name or alias[:QUANT], hf:OWNER/REPO[:QUANT] "
                                "or a path to a .gguf file (on disk: `show` never downloads)."),
    template: bool = typer.Option(False, "--template", help="Only the chat template, verbatim."),
    parameters: bool = typer.Option(False, "--parameters", help="Only the defaults `run` uses "
                                    "for this model, as config.toml lines."),
    as_json: bool = json_option("Print one JSON object."),
) -> None:
    """The chat template, the defaults in force and the special tokens of a model.

    \b
    localinfer show smollm2
    localinfer show smollm2 --template > chatml.jinja
    localinfer show smollm2 --parameters
    """
    from localinfer.routing import lookup
    if (router := lookup(model)) is not None:
        if template or parameters:
            raise UsageError(f"{model} is a router: --template and --parameters describe one "
                             f"model; name one of its models ({', '.join(router.models)})")
        from localinfer.cli import info
        return info.show(info.router_facts(router), as_json=as_json)
    sections = [name for name, chosen in (("template", template), ("parameters", parameters))
                if chosen] or ["template", "parameters", "special_tokens"]
    run = ctx.find_root().command.commands["run"]
    from localinfer.cli import defaults
    params = defaults.in_force(run, defaults.names_of(model))
    ref = _ref(model)
    if sections == ["parameters"] and not as_json:
        _write_parameters(params)   # needs no file: a model not pulled yet has defaults too
        return
    display, path = _model_file(ref, model)
    facts = _facts(display, path, params, sections)
    if as_json:
        sys.stdout.write(console.json_text(facts, indent=2) + "\n")
    elif sections == ["template"]:
        _write_template(facts["template"])
    else:
        _write_all(facts)


def _ref(model: str) -> ModelRef:
    """What `model` names (an unknown name is refused here, close names suggested)."""
    from localinfer.errors import FetchError
    from localinfer.models import refs
    _, cat, _ = refs.context()
    try:
        return refs.parse_ref(model, cat, offline=True, notify=console.note)
    except FetchError:      # a Hub repository never pulled: its listing is not here either
        raise LocalinferError(_not_on_disk(model.strip(), model)) from None


def _model_file(ref: ModelRef, model: str) -> tuple[str, Path]:
    """The name to show and the file of the model `ref` names; never downloaded."""
    from localinfer.models import refs
    path = ref.path or refs.model_store().find(ref.spec.name, ref.quant)
    if path is None:
        raise LocalinferError(_not_on_disk(ref.display, model))
    return ref.display, path


def _not_on_disk(display: str, model: str) -> str:
    return f"{display} is not on disk; `localinfer pull {model.strip()}` fetches it"


def _facts(display: str, path: Path, params: list[tuple[str, object, str]],
           sections: list[str]) -> dict:
    from localinfer.gguf.checks import check_model
    header = check_model(path)      # a damaged file is refused in one line, not described
    facts: dict = {"model": display, "path": str(path)}
    if "template" in sections:
        value = header.metadata.get(TEMPLATE_KEY)
        facts["template"] = value if isinstance(value, str) else None
    if "parameters" in sections:
        facts["parameters"] = {name: {"value": value, "source": source}
                               for name, value, source in params}
    if "special_tokens" in sections:
        facts.update(_tokens(path, header))
        from localinfer.cli.info import projector_here
        facts.update(projector_here(path))     # what `run --image` loads beside it, if any
    return facts


def _tokens(path: Path, header) -> dict:
    from localinfer.gguf.tokens import special_tokens
    found = special_tokens(path, header)
    return {"special_tokens": {role: {"id": t.id, "text": t.text}
                               for role, t in found.roles.items()},
            "add_bos": found.add_bos,
            "control_tokens": [{"id": t.id, "text": t.text} for t in found.control],
            "placeholder_tokens": found.placeholders}


# -- text -----------------------------------------------------------------------------------------
def _write_template(template: str | None) -> None:
    if template is None:
        raise LocalinferError("this model has no chat template (`run --raw` sends text as is)")
    if not console.interactive(sys.stdout):
        sys.stdout.write(template)  # a pipe gets the bytes of the file
        return
    # A terminal gets its lines, and whatever else in it a terminal would act on escaped.
    sys.stdout.write(console.clean(template, keep=LAYOUT))
    if not template.endswith("\n"):
        sys.stdout.write("\n")


def _write_parameters(params: list[tuple[str, object, str]]) -> None:
    from localinfer.user_config import toml_value
    lines = [(f"{name} = {toml_value(value)}", source) for name, value, source in params]
    width = max((len(line) for line, _ in lines), default=0)
    for line, source in lines:
        sys.stdout.write(f"{line.ljust(width)}  # {console.clean(source)}\n")


def _write_all(facts: dict) -> None:
    from localinfer.gguf.header import printable
    out = sys.stdout
    out.write(f"model  {console.clean(facts['model'])}\nfile   {console.clean(facts['path'])}\n")
    if facts.get("projector"):
        from localinfer.units import human_size
        size, compute = human_size(facts["projector_size"]), facts["projector_compute"]
        extra = f"; encoder compute {human_size(compute)} an image or clip" if compute else ""
        out.write(f"mmproj {console.clean(facts['projector'])} ({size}{extra})\n")
    out.write("\n# parameters: `run`'s defaults for this model (options on the command line win)\n")
    out.flush()
    _write_parameters(list((n, p["value"], p["source"]) for n, p in facts["parameters"].items()))
    out.write("\n# special tokens\n")
    rows = [[role, str(t["id"]), printable(t["text"])]
            for role, t in facts["special_tokens"].items()]
    if facts["add_bos"] is not None:
        rows.append(["add bos", "", "yes" if facts["add_bos"] else "no"])
    console.print_table(["ROLE", "ID", "TEXT"], rows)
    control = facts["control_tokens"]
    if control:
        shown = ", ".join(f"{printable(t['text'])} {t['id']}" for t in control[:SHOWN_CONTROL])
        more = len(control) - SHOWN_CONTROL
        out.write(f"control tokens: {shown}{f' ... and {more} more' if more > 0 else ''}")
        out.write(f" ({facts['placeholder_tokens']:,} unused placeholders)\n"
                  if facts["placeholder_tokens"] else "\n")
    out.write("\n# template\n")
    template = facts["template"]
    out.write("(none: `run --raw` sends text as is)\n" if template is None else
              console.clean(template, keep=LAYOUT) + ("" if template.endswith("\n") else "\n"))
