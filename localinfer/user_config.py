"""The user's own defaults: `config.toml` in the config directory, beside the user's `models.toml`.

    [defaults]                  # every command that has the option
    temp = 0
    top-k = 20

    [defaults.smollm2]          # only for this model: a catalogue name or alias, hf:OWNER/REPO,
    system = "Answer briefly."  # a file's name or stem, or NAME:QUANT as typed

Keys are the commands' long option names (`top-k` or `top_k`), or Ollama's name for one of them
(`temperature`, `num_ctx`: OLLAMA_OPTIONS). Which keys exist and what values they take is the
commands' business (cli.defaults checks them against the options themselves);
this module reads the file, refuses what no option could mean, and picks the tables that apply to
a model. The file is the user's but is read as if it were anyone's: a regular file of bounded size,
and each problem one line naming the file and the place.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from localinfer.errors import LocalinferError, UsageError

# A defaults file is a few hundred bytes; anything near this is not one, and parsing it would
# cost memory and time before the command starts.
MAX_BYTES = 1 << 20
TABLE = "defaults"
ROUTERS = "routers"     # [routers.NAME]: one name for several models (checked by localinfer.routing)
# Tables and arrays within a value: an option takes a value or a list of values. A value nested
# deeper is no option's, and would cost a recursion to show in a message.
MAX_DEPTH = 8
# A key or a table's name as a message shows it: a name longer than this is cut.
SHOWN_KEY = 60

# -- Ollama's names: its API's `options`, a Modelfile's PARAMETER lines ------------------------
# serve's Ollama API takes them by these kinds (server/ollama_options.py); this file takes each one
# that means an option here under that option's name (OLLAMA_OPTIONS).
# Sampling settings, under the same name in OpenAI's chat request.
OLLAMA_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty",
                   "frequency_penalty", "presence_penalty")
# Settings Ollama applies when it loads a model.
OLLAMA_AT_LOAD = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv",
                            "logits_all", "vocab_only", "use_mmap", "use_mlock", "embedding_only",
                            "num_thread", "num_keep"})
# Sampling methods not implemented here, with the value that leaves them off (None: any value,
# as it matters only with another one switched on).
OLLAMA_NEUTRAL = {"typical_p": 1, "tfs_z": 1, "mirostat": 0, "mirostat_tau": None, "mirostat_eta": None,
                  "penalize_newline": None}
# Ollama's name: the option (config key) that means the same. Its other names (repeat_last_n,
# the sampling methods above, most load settings) have none: unknown keys here.
OLLAMA_OPTIONS = {**{name: name for name in OLLAMA_SAMPLING}, "temperature": "temp",
                  "num_predict": "max_tokens", "num_ctx": "ctx", "stop": "stop",
                  "num_thread": "threads", "num_gpu": "gpu_layers"}
OLLAMA_NAMES = frozenset({*OLLAMA_SAMPLING, *OLLAMA_AT_LOAD, *OLLAMA_NEUTRAL, "num_predict",
                          "num_ctx", "stop", "repeat_last_n"})


class ConfigError(UsageError):
    """config.toml cannot be used: exit 2, as a bad option value on the command line would be (the
    file holds the user's option values)."""


@dataclass(frozen=True)
class Setting:
    """One key of the file: the option it names (`-` read as `_`), its value, and where it was."""

    key: str                # as written, for messages
    name: str               # normalised: top_k
    value: object
    table: str              # "[defaults]" or "[defaults.smollm2]", for messages and `show`


@dataclass(frozen=True)
class UserConfig:
    path: Path
    defaults: dict[str, Setting] = field(default_factory=dict)            # by normalised name
    models: dict[str, dict[str, Setting]] = field(default_factory=dict)  # by model name, lowered
    unknown: tuple[str, ...] = ()       # top-level keys other than [defaults]: ignored
    routers: dict[str, object] = field(default_factory=dict)    # [routers], as written

    def settings(self) -> list[Setting]:
        """Every key the file sets, [defaults] first, then each model's table."""
        return [*self.defaults.values(), *(s for t in self.models.values() for s in t.values())]

    def for_model(self, names: Sequence[str]) -> dict[str, Setting]:
        """[defaults] with the tables of a model over it. `names` are the names the model goes
        by, least specific first (catalogue name, aliases, then as the user typed it): a table
        for a later name wins over one for an earlier name."""
        merged = dict(self.defaults)
        for name in dict.fromkeys(n.strip().lower() for n in names):
            merged.update(self.models.get(name, {}))
        return merged


def read(path: Path) -> UserConfig | None:
    """The file at `path`, parsed and checked; None when there is none."""
    data = read_bounded(path)
    return None if data is None else parse(data, path)


def parse(data: bytes, path: Path) -> UserConfig:
    """The settings in `data` (the content of `path`); ConfigError for a file that is not TOML
    or whose [defaults] is not a table of values and model tables."""
    doc = toml_document(data, path)
    table = doc.get(TABLE, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: {TABLE} must be a table ([{TABLE}]), not {_kind(table)}")
    defaults = _settings({k: v for k, v in table.items() if not isinstance(v, dict)},
                         f"[{TABLE}]", path)
    models = {name.strip().lower(): _settings(t, f"[{TABLE}.{shown_key(name)}]", path)
              for name, t in table.items() if isinstance(t, dict)}
    routers = doc.get(ROUTERS, {})
    if not isinstance(routers, dict):
        raise ConfigError(f"{path}: {ROUTERS} must be a table ([{ROUTERS}.NAME]), not "
                          f"{_kind(routers)}")
    return UserConfig(path, defaults, models, tuple(k for k in doc if k not in (TABLE, ROUTERS)),
                      routers)


def toml_document(data: bytes, path: Path,
                  error: type[LocalinferError] = ConfigError) -> dict[str, object]:
    """`data`, the content of the settings file `path` (this one, or the user's models.toml),
    as a TOML document; `error` for bytes that are not UTF-8 or not TOML, or for tables and
    arrays nested deeper than the parser's recursion reaches (each level is a call in tomllib)."""
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start + 1})") from None
    except tomllib.TOMLDecodeError as e:    # its message names the line and column
        raise error(f"{path}: not valid TOML: {e}") from None
    except RecursionError:
        raise error(f"{path}: tables or arrays nested hundreds deep; a settings file needs "
                    "a few plain lines") from None


def _settings(table: dict, where: str, path: Path) -> dict[str, Setting]:
    out: dict[str, Setting] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        name = OLLAMA_OPTIONS.get(name, name)     # a Modelfile's name for one of the options
        if name in out:
            raise ConfigError(f"{path}: {where} sets {name} twice (as "
                              f"{shown_key(out[name].key)} and {shown_key(key)}); keep one")
        if _too_deep(value):
            raise ConfigError(f"{path}: {where} {shown_key(key)} nests tables or arrays more "
                              f"than {MAX_DEPTH} deep; an option takes a value or a list of "
                              "values")
        out[name] = Setting(key, name, value, where)
    return out


def _too_deep(value: object) -> bool:
    """Whether `value` holds tables or arrays more than MAX_DEPTH within one another (looked at
    level by level, without recursion)."""
    level = [value]
    for _ in range(MAX_DEPTH):
        level = [inner for v in level
                 for inner in (v.values() if isinstance(v, dict) else v if isinstance(v, list)
                               else ())]
        if not level:
            return False
    return True


def read_bounded(path: Path, error: type[LocalinferError] = ConfigError) -> bytes | None:
    """The file's bytes, if it is a regular file of at most MAX_BYTES (a link to one is followed:
    config files are often linked from a dotfiles folder); None when there is none, else `error`
    for one that cannot be read. Never blocks on a pipe."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ENOTDIR:        # a file where the config folder should be
            return None
        raise error(f"{path}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):      # a folder, a pipe, a device
        os.close(fd)
        raise error(f"{path} is not a regular file; make it one, or remove it")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise error(f"{path} is over {MAX_BYTES // 1024} KB; a settings file needs a few lines")
    return data


def toml_value(value: object) -> str:
    """`value` as TOML writes it, for messages and for `show --parameters` (which prints lines a
    user can paste into this file)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value != value:
            return "nan"
        return repr(value) if abs(value) != float("inf") else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return _basic_string(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return str(value)           # an integer, or a date or time (TOML writes them as Python does)


def _basic_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    out = "".join(escapes.get(c, c if c.isprintable() or c == " " else f"\\u{ord(c):04x}"
                              if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}") for c in text)
    return f'"{out}"'


def toml_key(name: str) -> str:
    """A key as TOML writes it: bare when it can be, quoted otherwise."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else _basic_string(name)


def shown_key(name: str) -> str:
    """A key as a message shows it: as TOML writes it, cut after SHOWN_KEY characters (a file
    may hold a key of a megabyte)."""
    return toml_key(name) if len(name) <= SHOWN_KEY else toml_key(name[:SHOWN_KEY]) + "..."


def _kind(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array"}.get(type(value), type(value).__name__)
