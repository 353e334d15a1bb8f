"""Prometheus's text exposition format (version 0.0.4), written here rather than taken from a
client library: counters, gauges and histograms, each a family of series told apart by label
values, rendered with their `# HELP` and `# TYPE` lines. Safe to update from any thread (the
scheduler's, the event loop's): every change and every rendering holds the registry's one lock.

What serve measures with them is server/served_metrics.py.
"""

from __future__ import annotations

import math
import threading
from typing import Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Registry:
    """The families one endpoint shows, in the order they were made."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._families: list[_Family] = []

    def counter(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:
        return self._add(Counter(self, name, help, labels))

    def gauge(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Gauge:
        return self._add(Gauge(self, name, help, labels))

    def histogram(self, name: str, help: str, buckets: Iterable[float],
                  labels: tuple[str, ...] = ()) -> Histogram:
        return self._add(Histogram(self, name, help, labels, buckets))

    def _add(self, family):
        if any(f.name == family.name for f in self._families):
            raise ValueError(f"metric {family.name} is already registered")
        self._families.append(family)
        return family

    def render(self) -> str:
        """Every family as the text format: HELP, TYPE, then one line per sample."""
        with self.lock:
            return "".join(f.render() for f in self._families)


class _Family:
    kind = ""

    def __init__(self, registry: Registry, name: str, help: str, labels: tuple[str, ...]) -> None:
        self.registry, self.name, self.help, self.labels = registry, name, help, labels
        self._series: dict[tuple[str, ...], object] = {}

    def _key(self, values: tuple) -> tuple[str, ...]:
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {values}")
        return tuple(str(v) for v in values)

    def clear(self) -> None:
        """Forget every series (a gauge refilled at each scrape: a model unloaded leaves none)."""
        with self.registry.lock:
            self._series.clear()

    def render(self) -> str:
        head = f"# HELP {self.name} {_escape_help(self.help)}\n# TYPE {self.name} {self.kind}\n"
        return head + "".join(self._samples(key, value)
                              for key, value in sorted(self._series.items()))

    def _samples(self, key: tuple[str, ...], value) -> str:
        return _line(self.name, self.labels, key, value)


class Counter(_Family):
    """A total that only grows (requests, tokens); Prometheus takes rates of it."""

    kind = "counter"

    def inc(self, *labels, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot go down ({amount})")
        key = self._key(labels)
        with self.registry.lock:
            self._series[key] = self._series.get(key, 0) + amount


class Gauge(_Family):
    """A value now (queue depth, cells in use), set whenever it is known."""

    kind = "gauge"

    def set(self, *labels, value: float) -> None:
        key = self._key(labels)
        with self.registry.lock:
            self._series[key] = value


class Histogram(_Family):
    """Observations counted in cumulative buckets (`le`: at most that), with their sum and count,
    so that Prometheus can estimate quantiles across servers and time."""

    kind = "histogram"

    def __init__(self, registry: Registry, name: str, help: str, labels: tuple[str, ...],
                 buckets: Iterable[float]) -> None:
        super().__init__(registry, name, help, labels)
        self.bounds = tuple(sorted(float(b) for b in buckets if b != math.inf))
        if "le" in labels or not self.bounds:
            raise ValueError(f"{self.name}: buckets needed, and 'le' is the histogram's own label")

    def observe(self, *labels, value: float, times: int = 1) -> None:
        """`times` observations of `value` (a request's tokens at their mean latency)."""
        if times <= 0:
            return
        key = self._key(labels)
        with self.registry.lock:
            series = self._series.setdefault(key, _Buckets(len(self.bounds)))
            # Only the first bucket that holds it (none: +Inf's alone); rendering adds them up.
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    series.counts[i] += times
                    break
            series.sum += value * times
            series.count += times

    def _samples(self, key: tuple[str, ...], series: _Buckets) -> str:
        out, below, le = [], 0, (*self.labels, "le")
        for bound, n in zip(self.bounds, series.counts):
            below += n
            out.append(_line(self.name + "_bucket", le, (*key, _number(bound)), below))
        out.append(_line(self.name + "_bucket", le, (*key, "+Inf"), series.count))
        out.append(_line(self.name + "_sum", self.labels, key, series.sum))
        out.append(_line(self.name + "_count", self.labels, key, series.count))
        return "".join(out)


class _Buckets:
    """One histogram series: observations per bucket (not cumulative), their sum and count."""

    def __init__(self, n: int) -> None:
        self.counts, self.sum, self.count = [0] * n, 0.0, 0


def _line(name: str, labels: tuple[str, ...], values: tuple[str, ...], value: float) -> str:
    if not labels:
        return f"{name} {_number(value)}\n"
    pairs = ",".join(f'{k}="{escape_label(v)}"' for k, v in zip(labels, values))
    return f"{name}{{{pairs}}} {_number(value)}\n"


def escape_label(value: str) -> str:
    """A label value as the format quotes it: backslash, double quote and line feed escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    """Integers without a fraction (counts stay exact), floats in their shortest form, the
    infinities and NaN spelled as Prometheus reads them."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()
                                  and abs(value) < 2**53):
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
