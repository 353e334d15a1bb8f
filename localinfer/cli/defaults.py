"""The user's config.toml as the commands' defaults: click's `default_map`, built from the options
the commands declare, so that a key means what the option of that name means on every command that
has it, its value is checked by that option's own type and range, and the command line wins.

A key no command has is a warning (a typo, or an option of a later version); a key some commands
lack is simply not theirs. `[defaults.MODEL]` tables apply over `[defaults]` when the command's MODEL
argument names that model, as typed or by its catalogue name or an alias.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator, Sequence
from typing import Any

from localinfer import settings, user_config
from localinfer.cli import console
from localinfer.user_config import ConfigError, Setting, UserConfig, shown_key, toml_value

# typer >= 0.22 parses with its own copy of click (see app.py).
try:
    from typer._click import Context
    from typer._click.core import ParameterSource
    from typer._click.types import BoolParamType, FloatParamType, IntParamType, StringParamType
    from typer._click.exceptions import BadParameter, UsageError as ClickUsageError
except ImportError:
    from click import Context
    from click.core import ParameterSource
    from click.types import BoolParamType, FloatParamType, IntParamType, StringParamType
    from click.exceptions import BadParameter, UsageError as ClickUsageError

Command = Any       # a click command or group (typer's, or click's own)
Param = Any
# What an option's value can be in TOML; a date, a time or a table is no option's value.
_SCALARS = (str, int, float)
# Types whose check is the value alone (a path's looks at the file system): checked up front.
_PURE = (BoolParamType, FloatParamType, IntParamType, StringParamType)

# The setting each default of the running command came from, by parameter name: a value click
# then refuses (a range its callback checks) is blamed on the file, not on the command line.
# Asking for these works whatever the file holds: they are how a user finds out what is wrong.
_HELP = ("-h", "--help", "-V", "--version")
# Unknown keys a warning names (with a suggestion each); the rest it counts: a file of 40,000
# stray keys is one short line, not a megabyte of them.
NAMED_KEYS = 5
_origins: dict[str, tuple[str, Setting]] = {}      # parameter name: (config file, setting)


def default_map(root: Command, args: Sequence[str]) -> dict[str, Any] | None:
    """click's default_map for `args` (the command line after the program name) from the user's
    config.toml; None without one. Warns once about keys no command has; ConfigError for a file
    that cannot be read or a value no option of its name takes."""
    conf = settings.load()
    _warn_catalogue_keys(conf)
    try:
        config = user_config.read(conf.user_config)
        if config is None:
            return None
        every = {path: options(command) for path, command in commands(root)}
        _warn_unknown(config, every)
        _check_values(config, every, dict(commands(root)))
    except ConfigError as e:
        if not any(a in _HELP for a in args):
            raise
        console.warn(f"{e} (ignored for the help)")   # the help must stay reachable
        return None
    path, command, rest = running(root, args)
    if command is None:
        return None
    names = model_names(command, path[-1], rest) if config.models else []
    values = applied(config.for_model(names), command, str(config.path))
    _origins.clear()
    _origins.update({name: (str(config.path), setting) for name, (_, setting) in values.items()})
    nested: dict[str, Any] = {name: value for name, (value, _) in values.items()}
    for part in reversed(path):
        nested = {part: nested}
    return nested


def blame(e: ClickUsageError) -> None:
    """Raise the one line that names config.toml when a value from it is what click refused."""
    if not isinstance(e, BadParameter) or e.ctx is None or e.param is None:
        return
    origin = _origins.get(e.param.name or "")
    if origin is None or e.ctx.get_parameter_source(e.param.name) != ParameterSource.DEFAULT_MAP:
        return
    raise ConfigError(_problem(*origin, e.message)) from None


def in_force(command: Command, names: Sequence[str]) -> list[tuple[str, object, str]]:
    """Each option of `command` with the default it has for a model going by `names`: (long
    option name, value, where it comes from: "built-in" or the config table)."""
    config = user_config.read(settings.load().user_config)
    chosen = applied(config.for_model(names), command, str(config.path)) if config else {}
    out = []
    for name, param in options(command).items():
        if param.name in chosen:
            value, setting = chosen[param.name]
            try:
                value = param.type_cast_value(Context(command), value)  # as the command sees it
            except BadParameter as e:
                raise ConfigError(_problem(str(config.path), setting, e.message)) from None
            out.append((name, list(value) if isinstance(value, tuple) else value,
                        f"{config.path.name} {setting.table}"))
        elif _shown(param):
            default = param.default() if callable(param.default) else param.default
            out.append((name, list(default) if isinstance(default, tuple) else default,
                        "built-in"))
    return out


# -- the commands' options ------------------------------------------------------------------------
def commands(root: Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Command]]:
    """Every command under `root` that runs (not the groups), with its path of names."""
    for name, command in getattr(root, "commands", {}).items():
        if hasattr(command, "commands"):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


def options(command: Command) -> dict[str, Param]:
    """The command's options by config key: the long option name without `--`, `-` read as `_`."""
    out = {}
    for param in command.params:
        if getattr(param, "param_type_name", "") != "option" or not param.expose_value:
            continue
        long = next((o for o in param.opts if o.startswith("--")), None)
        if long:
            out[long[2:].replace("-", "_")] = param
    return out


def running(root: Command, args: Sequence[str]) -> tuple[tuple[str, ...], Command | None, list[str]]:
    """The command `args` run, its path of names and the arguments after its name. The options
    before it are the groups' own flags (--debug, --version): none takes a value."""
    path: tuple[str, ...] = ()
    command = root
    for i, arg in enumerate(args):
        if arg.startswith("-") and arg != "-":
            continue
        sub = getattr(command, "commands", {}).get(arg)
        if sub is None:
            break
        path, command = (*path, arg), sub
        if not hasattr(sub, "commands"):
            return path, sub, list(args[i + 1:])
    return path, None, []


def model_names(command: Command, name: str, rest: Sequence[str]) -> list[str]:
    """The names the model the command's MODEL argument names goes by, least specific first;
    none when it has no such argument. The arguments are parsed without running any callback."""
    if not any(p.name == "model" and getattr(p, "param_type_name", "") == "argument"
               for p in command.params):
        return []
    ctx = Context(command, info_name=name, resilient_parsing=True)
    try:
        opts, _, _ = command.make_parser(ctx).parse_args(args=list(rest))
    except ClickUsageError:
        return []
    model = opts.get("model")
    return names_of(model) if isinstance(model, str) and model.strip() else []


def names_of(model: str) -> list[str]:
    """What a [defaults.NAME] table may call the model `model` names, least specific first: its
    catalogue name and aliases, hf:OWNER/REPO, or a file's stem and name; then the name and
    NAME:QUANT as typed, so that a table for what the user typed wins."""
    from pathlib import Path

    from localinfer.errors import LocalinferError
    from localinfer.models import hub, refs
    typed = model.strip()
    if refs.looks_like_path(typed):
        found = [Path(typed).stem, Path(typed).name]
    elif hub.is_hub_ref(typed):
        try:
            found = [f"{hub.PREFIX}{hub.parse(typed).repo}"]
        except LocalinferError:
            found = []      # the command itself says what is wrong with the name
    else:
        name, _, quant = typed.partition(":")
        canonical = _catalogue_names(name)
        found = [*canonical, name, *([f"{canonical[0]}:{quant}"] if canonical and quant else [])]
    return list(reversed(dict.fromkeys(reversed([*found, typed]))))


def _catalogue_names(name: str) -> list[str]:
    """The catalogue name, then the aliases, of the model `name` names; none for another name."""
    from localinfer.errors import LocalinferError
    from localinfer.models import catalogue
    try:
        spec = catalogue.load(settings.load().user_catalogue).get(name)
    except (LocalinferError, OSError):
        return []       # the command itself says what is wrong with the catalogue
    return [spec.name, *spec.aliases] if spec else []


def applied(chosen: dict[str, Setting], command: Command,
            path: str) -> dict[str, tuple[object, Setting]]:
    """The settings that are options of `command`, by parameter name, with click-ready values."""
    own = options(command)
    return {own[key].name: (_value(s, own[key], path), s)
            for key, s in chosen.items() if key in own}


def _shown(param: Param) -> bool:
    """Whether `show` lists a built-in default: a value, not an unset option or flag."""
    default = param.default
    return default is not None and default is not False and default != () and default != [] \
        and not (getattr(param, "count", False) and default == 0)


# -- checking the file ----------------------------------------------------------------------------
def _value(setting: Setting, param: Param, path: str) -> object:
    """The setting as click takes it for `param`: a list for a repeatable option (one value is a
    list of one). ConfigError where TOML's types say more than click would check (click reads 2.5
    as the integer 2 and true as 1) or where a value is of no type click can take."""
    value = setting.value
    many = getattr(param, "multiple", False)
    if many:
        values = value if isinstance(value, list) else [value]
    elif isinstance(value, list):
        raise ConfigError(_problem(path, setting, "takes one value, not a list"))
    else:
        values = [value]
    out = []
    for v in values:
        problem = _type_problem(v, param)
        if problem:
            raise ConfigError(_problem(path, setting, problem + (" (or a list of them)"
                                                                  if many else "")))
        # A number for a text option (gpu_layers = 12, quant = 8) is its text, as typed.
        text = isinstance(v, (int, float)) and not isinstance(v, bool) and not _numeric(param)
        out.append(str(v) if text else v)
    return out if many else out[0]


def _type_problem(value: object, param: Param) -> str | None:
    """What is wrong with one TOML value for `param`'s type, or None."""
    if getattr(param, "is_flag", False) and not getattr(param, "count", False):
        return None if isinstance(value, bool) else "must be true or false"
    if not isinstance(value, _SCALARS) or isinstance(value, bool):
        return "must be a number" if _numeric(param) else "must be a string"
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if isinstance(param.type, IntParamType) and isinstance(value, float) \
            and not value.is_integer():
        return "must be a whole number"
    return None


def _numeric(param: Param) -> bool:
    return isinstance(param.type, (IntParamType, FloatParamType))


def _check_values(config: UserConfig, every: dict[tuple[str, ...], dict[str, Param]],
                  by_path: dict[tuple[str, ...], Command]) -> None:
    """Every value in the file against the options of its name (`every`: each command's options,
    worked out once): refused when no command's option of that name takes it, whichever command
    runs now (a file is wrong as a whole)."""
    for setting in config.settings():
        problem = None
        for path, own in every.items():
            command = by_path[path]
            param = own.get(setting.name)
            if param is None:
                continue
            value = _value(setting, param, str(config.path))
            if not isinstance(param.type, _PURE):
                break           # a path: checked when used, from where the command runs
            try:
                param.type_cast_value(Context(command, info_name=path[-1]), value)
                break
            except BadParameter as e:
                problem = problem or e.message
        else:
            if problem:
                raise ConfigError(_problem(str(config.path), setting, problem))


def _warn_unknown(config: UserConfig, every: dict[tuple[str, ...], dict[str, Param]]) -> None:
    known = {key for own in every.values() for key in own}
    stray = [(s.name, f"{_named(s.key)} in {s.table}") for s in config.settings()
             if s.name not in known]
    stray += [(None, f"{_named(key)} at the top level") for key in config.unknown]
    if stray:
        named = [said + _suggestion(name, known) for name, said in stray[:NAMED_KEYS]]
        console.warn(f"{config.path}: unknown {_listed(named, len(stray))} (ignored)")


def _suggestion(name: str | None, known: set[str]) -> str:
    """` (did you mean 'top_k'?)` for a key close to an option's name or Ollama's name for one;
    for another name of Ollama's, that nothing here means it; else nothing."""
    if name in user_config.OLLAMA_NAMES:
        return " (Ollama's; no option here does what it does)"
    # difflib's time grows with the name's square; no option's name is near this long.
    close = difflib.get_close_matches(name, {*known, *user_config.OLLAMA_OPTIONS}, n=1) \
        if name and len(name) <= 40 else []
    return f" (did you mean '{close[0]}'?)" if close else ""


def _listed(named: list[str], total: int) -> str:
    """`key 'a'`, or `keys 'a', 'b' and 3 more`: the first few named, the rest counted."""
    more = total - len(named)
    return (f"key{'s' if total > 1 else ''} {', '.join(named)}"
            + (f" and {more:,} more" if more else ""))


def _warn_catalogue_keys(conf: settings.Settings) -> None:
    """The user's models.toml has [models] tables only: say so of anything else (a [defaults]
    there was once silently ignored)."""
    path = conf.user_catalogue
    try:
        if not path.is_file() or path.stat().st_size > user_config.MAX_BYTES:
            return
        stray = [k for k in user_config.toml_document(path.read_bytes(), path)
                 if k != "models"]
    except (OSError, ConfigError):
        return          # the catalogue's own reading says what is wrong with it
    if stray:
        where = f"; option defaults belong in {conf.user_config}" if "defaults" in stray else ""
        named = [_named(k) for k in stray[:NAMED_KEYS]]
        console.warn(f"{path}: unknown {_listed(named, len(stray))} (ignored{where})")


def _problem(path: str, setting: Setting, problem: str) -> str:
    """The line for a value an option refuses; click's own words may quote the whole value."""
    return (f"{path}: {setting.table} {shown_key(setting.key)} = "
            f"{_cut(toml_value(setting.value), 60)}: {_cut(_one_line(problem), 160)}")


def _one_line(text: str) -> str:
    """Click's words with any line break it quoted from the value written as TOML writes it."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[:most - 3] + "..."


def _named(key: str) -> str:
    """A key for a message: 'bare', or "quoted" as TOML escapes it (never a line break)."""
    written = shown_key(key)
    return f"'{key}'" if written == key else written
