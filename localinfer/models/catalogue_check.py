"""Check a catalogue file's tables before any value in it is used.

The built-in `models.toml` and the user's are both checked, each on its own before they are merged,
so that a problem is named in the file that has it. A wrong type would otherwise surface far away
(a size compared as a string, a number iterated as a table) or act: model names and quant tags
become path components in the store, so they must pass the store's safe-name rule. Each problem
is one line naming the file, the key and what was expected.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from localinfer.errors import LocalinferError
from localinfer.models.store import SAFE_NAME_RULE, is_safe_name


class CatalogueError(LocalinferError):
    """A catalogue file with a value of the wrong type or form: exit 1, like a file that is not
    TOML at all. It is not a usage error: no argument of the command is at fault, and the same
    command works once the file is corrected."""


Check = Callable[[object], bool]

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def _is_str(v: object) -> bool:
    return isinstance(v, str)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_list(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _member_path(v: object) -> bool:
    """A relative path inside a repository or wheel: never absolute, never '..'."""
    return isinstance(v, str) and bool(v) and not v.startswith(("/", "\\")) and \
        ".." not in re.split(r"[/\\]", v) and "\0" not in v and ":" not in v


def _requirement(v: object) -> bool:
    """A pinned package for `pip download`, never an option ('--index-url ...')."""
    return isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+", v) \
        is not None


# The optional reasoning keys (see the head of models.toml): how a model shows its thinking, and
# what its chat template reads to turn the thinking off or set its depth.
THINKING = ("", "tags", "harmony")
THINKING_SWITCHES = ("", "enable_thinking", "/no_think", "reasoning_effort")

# key: (check, what the key must be)
MODEL_KEYS: dict[str, tuple[Check, str]] = {
    "aliases": (_str_list, "a list of strings"),
    "drop_aliases": (_str_list, "a list of strings"),     # the user's file: built-in ones to drop
    "family": (_is_str, "a string"),
    "architecture": (_is_str, "a string"),
    "parameters": (lambda v: isinstance(v, (str, int, float)) and not isinstance(v, bool),
                   "a string such as \"135M\""),
    "context_length": (lambda v: _is_int(v) and 0 <= v <= 1 << 24, "a whole number of tokens"),
    "kind": (lambda v: v in ("instruct", "base"), "\"instruct\" or \"base\""),
    "license": (_is_str, "a string"),
    "default_quant": (is_safe_name, f"a quant tag ({SAFE_NAME_RULE})"),
    "draft": (_is_str, "a string"),
    "description": (_is_str, "a string"),
    "thinking": (lambda v: v in THINKING, " or ".join(f'"{t}"' for t in THINKING)),
    "thinking_switch": (lambda v: v in THINKING_SWITCHES,
                        " or ".join(f'"{t}"' for t in THINKING_SWITCHES)),
    "quants": (lambda v: isinstance(v, dict), "a table of quant tables"),
    "projector": (lambda v: isinstance(v, dict), "a table (size, sha256, sources)"),
}
VARIANT_KEYS: dict[str, tuple[Check, str]] = {
    "size": (lambda v: _is_int(v) and v > 0, "a whole number of bytes"),
    "sha256": (lambda v: isinstance(v, str) and _HEX64.fullmatch(v) is not None,
               "64 hexadecimal digits"),
    "sources": (lambda v: isinstance(v, list) and all(isinstance(s, dict) for s in v),
                "a list of source tables"),
}
HUB_KEYS: dict[str, tuple[Check, str]] = {
    "hub": (lambda v: isinstance(v, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", v) is not None
            and ".." not in v, "\"owner/repository\""),
    "file": (_member_path, "a relative path inside the repository"),
}
PIP_KEYS: dict[str, tuple[Check, str]] = {
    "pip": (lambda v: _requirement(v) or (isinstance(v, list) and bool(v)
                                          and all(_requirement(r) for r in v)),
            "\"package==version\" or a list of them"),
    "files": (lambda v: isinstance(v, list) and bool(v) and all(_member_path(f) for f in v),
              "a list of relative paths inside the wheels"),
}


def check(data: dict, file: str) -> None:
    """Raise CatalogueError for the first value in `data` (a parsed catalogue) of the wrong type."""
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise CatalogueError(f"{file}: models must be a table of model tables")
    for name, table in models.items():
        where = f"models.{_key(name)}"
        _check_name(name, where, file, "model name")
        _check_table(table, MODEL_KEYS, where, file)
        for quant, variant in table.get("quants", {}).items():
            _check_variant(quant, variant, f"{where}.quants.{_key(quant)}", file)
        if "projector" in table:
            _check_variant("MMPROJ", table["projector"], f"{where}.projector", file)


def _check_variant(quant: str, table: object, where: str, file: str) -> None:
    _check_name(quant, where, file, "quant tag")
    _check_table(table, VARIANT_KEYS, where, file)
    for i, source in enumerate(table.get("sources", [])):
        keys = HUB_KEYS if "hub" in source else PIP_KEYS if "pip" in source else None
        at = f"{where}.sources[{i}]"
        if keys is None:
            raise CatalogueError(f"{file}: {at} must have a hub or a pip key")
        missing = [k for k in keys if k not in source]
        if missing:
            raise CatalogueError(f"{file}: {at} lacks {missing[0]}")
        _check_table(source, keys, at, file)


def _check_name(name: str, where: str, file: str, what: str) -> None:
    if not is_safe_name(name):
        raise CatalogueError(f"{file}: {where}: {name!r} is not a valid {what}; "
                             f"use {SAFE_NAME_RULE}")


def _check_table(table: object, keys: dict[str, tuple[Check, str]], where: str, file: str) -> None:
    if not isinstance(table, dict):
        raise CatalogueError(f"{file}: {where} must be a table, not {_kind(table)}")
    for key, (ok, expected) in keys.items():
        if key in table and not ok(table[key]):
            raise CatalogueError(f"{file}: {where}.{key} must be {expected}, "
                                 f"not {_kind(table[key])}")


def _key(name: str) -> str:
    """A key as TOML writes it: bare when it can be, quoted otherwise."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def _kind(value: object) -> str:
    """How TOML would call the type of `value`, with the value when it is short."""
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)
    shown = repr(value) if not isinstance(value, (list, dict)) else ""
    return f"{kind} {shown}" if shown and len(shown) <= 40 else kind
