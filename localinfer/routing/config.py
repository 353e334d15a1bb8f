"""`[routers.NAME]` tables of the user's config.toml, read and checked as a whole before any model
loads: each problem is one line naming the file and the router (ConfigError, exit 2).

    [routers.fast]
    models = ["smollm2:Q4_1", "smollm2:Q8_0"]   # cheapest first; any model name `run` takes
    policy = "cascade"
    threshold = -0.5                            # the answer stands at or above it
    tokens = 16                                 # decided after this many tokens
    measure = "mean"                            # mean | min | margin

    [routers.by-need]
    models = ["smollm2:Q4_1", "fast"]           # a rule router may name a router
    policy = "rule"
    default = "fast"                            # no rule matched (else the first model)
    [[routers.by-need.rules]]
    min-prompt-tokens = 2000                    # also: max-prompt-tokens, schema, tools,
    model = "smollm2:Q4_1"                      # thinking (true/false), priority ("high")

A router may not take a catalogue model's name (it would hide that model), nor name itself
through other routers; a cascade's models are models, not routers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from localinfer import settings
from localinfer.errors import LocalinferError, UsageError
from localinfer.routing.policy import MAX_TOKENS, MEASURES, Cascade, Router, Rule, Rules
from localinfer.user_config import ConfigError, UserConfig, read, shown_key, toml_value

POLICIES = ("cascade", "rule")
MAX_MODELS = 8          # a cascade of more decides too late to pay; a rule router names few
MAX_RULES = 64
MAX_ROUTERS = 256       # each member is looked up in the catalogue and the store when checked
MAX_PRIORITY = 32       # characters of a priority's name
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
CASCADE_KEYS = {"models", "policy", "threshold", "tokens", "measure"}
RULE_KEYS = {"models", "policy", "rules", "default"}
RULE_FLAGS = ("schema", "tools", "thinking")
RULE_COUNTS = ("min_prompt_tokens", "max_prompt_tokens")


def checked(config: UserConfig) -> dict[str, Router]:
    """Every router the file declares, by name (lowered), checked as a whole."""
    from localinfer.models import catalogue
    found: dict[str, Router] = {}
    if not config.routers:
        return found        # the catalogue is read only for a file that declares routers
    if len(config.routers) > MAX_ROUTERS:
        raise ConfigError(f"{config.path}: {len(config.routers):,} routers; a file declares at "
                          f"most {MAX_ROUTERS}")
    cat = catalogue.load(settings.load().user_catalogue)
    for name, table in config.routers.items():
        where = f"{config.path}: [routers.{shown_key(name)}]"
        key = name.strip().lower()
        if not NAME.fullmatch(key) or key.endswith(".gguf"):
            raise ConfigError(f"{where}: a router's name is letters, digits, '.', '_' or '-' "
                              "(at most 64, no ':' or '/': those name a model's variant or "
                              "file)")
        if cat.get(key) is not None:
            raise ConfigError(f"{where} has the name of the catalogue's model "
                              f"{cat.get(key).name}, which it would hide; name it otherwise")
        if key in found:
            raise ConfigError(f"{where} is declared twice (names differ only in case)")
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table, not {toml_value(table)[:40]}")
        found[key] = _router(key, table, where, config.path)
    _check_members(found, config.path, cat)
    return found


def _router(name: str, table: dict, where: str, path: Path) -> Router:
    table = {k.replace("-", "_"): v for k, v in table.items()}
    policy = table.get("policy", "cascade")
    if policy not in POLICIES:
        raise ConfigError(f"{where}: unknown policy {_shown(policy)}; choose "
                          f"{' or '.join(map(repr, POLICIES))}")
    known = CASCADE_KEYS if policy == "cascade" else RULE_KEYS
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key {shown_key(unknown[0])} for policy "
                          f"'{policy}' (known: {', '.join(sorted(known))})")
    models = _models(table.get("models"), where, least=2 if policy == "cascade" else 1)
    if policy == "cascade":
        return Router(name, models, _cascade(table, where), path)
    return Router(name, models, _rules(table, models, where), path)


def _models(value: object, where: str, *, least: int) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(m, str) and m.strip() for m in value):
        raise ConfigError(f"{where}: models must be a list of model names, cheapest first "
                          f'(models = ["smollm2:Q4_1", "smollm2:Q8_0"])')
    if not least <= len(value) <= MAX_MODELS:
        raise ConfigError(f"{where}: models lists {len(value)}; a router takes {least} to "
                          f"{MAX_MODELS}")
    models = tuple(m.strip() for m in value)
    twice = next((m for i, m in enumerate(models) if m in models[:i]), None)
    if twice:
        raise ConfigError(f"{where}: models lists '{_cut(twice)}' twice")
    return models


def _cascade(table: dict, where: str) -> Cascade:
    measure = table.get("measure", Cascade.measure)
    if measure not in MEASURES:
        raise ConfigError(f"{where}: measure must be one of {', '.join(MEASURES)}, not "
                          f"{_shown(measure)}")
    tokens = table.get("tokens", Cascade.tokens)
    if not _whole(tokens) or not 1 <= tokens <= MAX_TOKENS:
        raise ConfigError(f"{where}: tokens (the decision's) must be a whole number from 1 to "
                          f"{MAX_TOKENS}, not {_shown(tokens)}")
    threshold = table.get("threshold", Cascade.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or math.isnan(threshold):
        raise ConfigError(f"{where}: threshold must be a number, not {_shown(threshold)}")
    threshold = float(threshold)
    if measure == "margin" and threshold < 0 and threshold != -math.inf:
        raise ConfigError(f"{where}: a margin threshold is 0 or more (nats), not {threshold:g}")
    if measure != "margin" and 0 < threshold < math.inf:
        raise ConfigError(f"{where}: a {measure} log-probability threshold is at most 0 (inf: "
                          f"never keep the answer), not {threshold:g}")
    return Cascade(threshold, tokens, measure)


def _rules(table: dict, models: tuple[str, ...], where: str) -> Rules:
    rules = table.get("rules", [])
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise ConfigError(f"{where}: rules must be an array of tables ([[routers.NAME.rules]])")
    if len(rules) > MAX_RULES:
        raise ConfigError(f"{where}: {len(rules)} rules; a router takes at most {MAX_RULES}")
    default = table.get("default", models[0])
    if default not in models:
        raise ConfigError(f"{where}: default {_shown(default)} is not one of its models")
    return Rules(tuple(_rule(r, models, f"{where} rule {i + 1}") for i, r in enumerate(rules)),
                 default)


def _rule(table: dict, models: tuple[str, ...], where: str) -> Rule:
    table = {k.replace("-", "_"): v for k, v in table.items()}
    known = {"model", "priority", *RULE_FLAGS, *RULE_COUNTS}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key {shown_key(unknown[0])} (known: "
                          f"{', '.join(sorted(k.replace('_', '-') for k in known))})")
    model = table.get("model")
    if model not in models:
        raise ConfigError(f"{where}: model {_shown(model)} is not one of the router's models")
    for flag in RULE_FLAGS:
        if flag in table and not isinstance(table[flag], bool):
            raise ConfigError(f"{where}: {flag} must be true or false, not {_shown(table[flag])}")
    for count in RULE_COUNTS:
        if count in table and (not _whole(table[count]) or table[count] < 0):
            raise ConfigError(f"{where}: {count.replace('_', '-')} must be a whole number of "
                              f"tokens, 0 or more, not {_shown(table[count])}")
    priority = table.get("priority")
    if priority is not None and (not isinstance(priority, str) or not priority.strip()
                                 or len(priority) > MAX_PRIORITY):
        raise ConfigError(f"{where}: priority must be a name of 1 to {MAX_PRIORITY} "
                          f"characters, not {_shown(priority)}")
    return Rule(model, **{k: table.get(k) for k in (*RULE_COUNTS, *RULE_FLAGS, "priority")})


def _check_members(found: dict[str, Router], path: Path, cat) -> None:
    """Each member names a model that exists, or (a rule router's) another router; no router
    reaches itself."""
    for router in found.values():
        cycle = _cycle(router.name, found)
        if cycle:
            raise ConfigError(f"{path}: [routers.{router.name}] reaches itself: "
                              f"{' -> '.join(cycle)}; a router cannot hold itself")
    for router in found.values():
        where = f"{path}: [routers.{router.name}]"
        for member in router.models:
            inner = found.get(member.lower())
            if inner is None:
                _check_model(member, where, cat)
            elif router.kind == "cascade" and inner.name != router.name:
                raise ConfigError(f"{where}: '{member}' is a router; a cascade's models are "
                                  "models (a rule router may name a cascade)")


def _cycle(start: str, found: dict[str, Router]) -> list[str] | None:
    """A chain of routers from `start` back to a router on it, or None: a depth-first walk with
    an explicit stack that visits each router once (a chain or a web of routers costs their
    count, never a recursion as deep as the chain, nor a walk of every path)."""
    done: set[str] = set()
    trail: list[str] = [start]
    stack = [iter(found[start].models)]
    while stack:
        member = next(stack[-1], None)
        if member is None:
            stack.pop()
            done.add(trail.pop())
            continue
        name = member.lower()
        if name not in found or name in done:
            continue
        if name in trail:
            return [*trail[trail.index(name):], name]
        trail.append(name)
        stack.append(iter(found[name].models))
    return None


def _check_model(member: str, where: str, cat) -> None:
    """A name `run` would take: a catalogue model (pulled when first used), one made here, a file
    that exists, or an hf: reference (its listing is read when used)."""
    from localinfer.models import hub, refs
    try:
        if hub.is_hub_ref(member):
            hub.parse(member)
        else:
            refs.parse_ref(member, None if refs.looks_like_path(member) else cat, offline=True)
    except LocalinferError as e:
        raise ConfigError(f"{where}: models names '{_cut(member)}', which is no model here "
                          f"({e})") from None


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object) -> str:
    return _cut(toml_value(value)) if value is not None else "nothing"


def _cut(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def load(path: Path | None = None) -> dict[str, Router]:
    """The routers of the user's config.toml (or `path`); {} without one."""
    config = read(path or settings.load().user_config)
    return checked(config) if config is not None else {}


def routers() -> dict[str, Router]:
    """Every router of the user's config.toml, checked as a whole (ConfigError: one line)."""
    return load()


def lookup(name: str) -> Router | None:
    """The router `name` names, or None when it names none (a model, then). Reading it checks
    every router in the file: a broken one is refused whichever name is asked for, before any
    model loads."""
    declared = routers()
    if not isinstance(name, str) or ":" in name or "/" in name:    # a variant or a file
        return None
    return declared.get(name.strip().lower())


def load_router(name: str) -> Router:
    """The router `name`; UsageError when config.toml declares none of that name."""
    found = lookup(name)
    if found is None:
        known = ", ".join(sorted(routers())) or "none"
        raise UsageError(f"no router named '{name}' in config.toml (routers: {known})")
    return found
