"""A small reader of Prometheus's text format for the tests, written apart from the server's
writer (server/metrics.py) so that one does not check itself: families with their HELP and TYPE,
samples keyed by their labels (in the order written), values as floats."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse(text: str) -> dict[str, dict]:
    """{name: {"help", "type", "samples": {labels: value}}}: a family under its own name and,
    for a histogram's _bucket/_sum/_count lines, under each of those names too."""
    assert text.endswith("\n"), "the format ends every line with a line feed"
    families: dict[str, dict] = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, what, name, rest = line.split(" ", 3)
            families.setdefault(name, {"samples": {}})[what.lower()] = rest
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, labels, value = match.groups()
        families.setdefault(name, {"samples": {}})["samples"][_labels(labels or "")] = \
            float(value)
    return families


def samples(families: dict[str, dict], name: str) -> dict[tuple, float]:
    return families.get(name, {"samples": {}})["samples"]


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    pairs, at = [], 0
    while at < len(text):
        match = _LABEL.match(text, at)
        assert match, f"bad labels: {text!r}"
        value = re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], match.group(2))
        pairs.append((match.group(1), value))
        at = match.end()
    return tuple(pairs)
