"""How `--help` looks: two of Typer's rendering habits undone, for help that reads as a man page.

Typer writes a number option's range after its metavar (`FLOAT [0.0<=x<=1.0]`) where the help
text already says what the values mean, and a required argument as `{MODEL}` in the usage line
where every other tool writes `MODEL`. Both are module-level details of the Typer versions the
project allows (pyproject pins below 0.29); each change is skipped where a version lacks it.
"""

from __future__ import annotations


def apply() -> None:
    try:
        from typer import core, rich_utils
    except ImportError:
        return
    if hasattr(rich_utils, "RANGE_STRING"):
        rich_utils.RANGE_STRING = ""
    argument = getattr(core, "TyperArgument", None)
    if argument is not None and hasattr(argument, "make_metavar"):
        _unbrace(argument)


def _unbrace(argument: type) -> None:
    original = argument.make_metavar

    def make_metavar(self, *args, **kwargs) -> str:
        text = original(self, *args, **kwargs)
        return text[1:-1] if text.startswith("{") and text.endswith("}") else text
    argument.make_metavar = make_metavar
