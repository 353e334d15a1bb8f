"""Numeric bounds (`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`) as grammar.

The vendored converter writes every integer and number alike, bounds or not. Here a bounded
integer is spelled digit by digit, as regex range generators do: `[0, 9007199254740991]` (zod's
default for `.int().nonnegative()`) is a few dozen alternatives, never an enumeration. A bounded
number is an integer in range, or an integer part with a fraction where every fraction keeps the
value in range (n.f lies in [n, n+1)): a few numbers that the schema allows are left out (0.5
under `maximum: 0.7`), none that it forbids are let through, and no exponent is written.

The converter knows none of this, so each bounded node is handed to it as a unique constant and
the constant's literal in its grammar replaced by the range's expression (`Ranges.fill`).
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field

DIGITS = 16                 # digits of a part, as the converter writes its numbers
MAX_BOUND_DIGITS = 40       # a bound past this is no integer a model writes
_FRACTION = ' "." [0-9]{1,16}'
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class RangeError(ValueError):
    """Bounds that no value meets, or none the grammar can spell."""


def integer_bounds(node: dict) -> tuple[int | None, int | None]:
    """The least and the greatest whole number the node's bounds allow (None: no bound)."""
    low, high = None, None
    if "minimum" in node:
        low = math.ceil(node["minimum"])
    if "exclusiveMinimum" in node:
        low = _most(low, math.floor(node["exclusiveMinimum"]) + 1)
    if "maximum" in node:
        high = math.floor(node["maximum"])
    if "exclusiveMaximum" in node:
        high = _least(high, math.ceil(node["exclusiveMaximum"]) - 1)
    return low, high


def expression(node: dict) -> str:
    """GBNF for the JSON numbers `node` (an integer or number schema with bounds) allows."""
    low, high = integer_bounds(node)
    for bound in (low, high):
        if bound is not None and len(str(abs(bound))) > MAX_BOUND_DIGITS:
            raise RangeError(f"a bound of over {MAX_BOUND_DIGITS} digits")
    options = [integers(low, high)] if _some(low, high) else []
    if node.get("type") == "number":
        options += _fractions(node, low, high)
    options = [o for o in options if o]
    if not options:
        raise RangeError("no number the grammar can write lies between these bounds")
    return " | ".join(f"( {o} )" for o in options)


def integers(low: int | None, high: int | None) -> str:
    """GBNF for the JSON integers in [low, high] (None: unbounded on that side)."""
    options = []
    if low is None or low < 0:          # the negatives, as "-" and their absolute values
        top = None if low is None else -low
        bottom = 1 if high is None or high >= 0 else -high
        if top is None or bottom <= top:
            options.append('"-" ( ' + _naturals(bottom, top) + " )")
    if high is None or high >= 0:
        bottom = 0 if low is None else max(low, 0)
        if high is None or bottom <= high:
            options.append(_naturals(bottom, high))
    return " | ".join(f"( {o} )" for o in options)


def _fractions(node: dict, low: int | None, high: int | None) -> list[str]:
    """Numbers with a fraction: n.f for n >= 0 lies in [n, n+1), -k.f in (-(k+1), -k]; each
    kind is written for the n (or k) that keep all of that interval in range."""
    uppers = [node[k] for k in ("maximum", "exclusiveMaximum") if k in node]
    lowers = [node[k] for k in ("minimum", "exclusiveMinimum") if k in node]
    out = []
    n_low = 0 if low is None else max(low, 0)               # n meets the lower bound
    n_high = math.floor(min(uppers)) - 1 if uppers else None    # n + 1 <= the upper one
    if n_high is None or n_low <= n_high:
        out.append(f"( {_naturals(n_low, n_high)} ){_FRACTION}")
    k_low = 0 if high is None else max(0, -high)            # -k meets the upper bound
    k_high = math.floor(-max(lowers)) - 1 if lowers else None   # -(k+1) >= the lower one
    if k_high is None or k_low <= k_high:
        out.append(f'"-" ( {_naturals(k_low, k_high)} ){_FRACTION}')
    return out


def _naturals(low: int, high: int | None) -> str:
    """GBNF for the whole numbers in [low, high] without leading zeros (high None: up to
    DIGITS digits, or the low bound's own length)."""
    lo_text = str(low)
    top = max(DIGITS, len(lo_text))
    hi_text = str(high) if high is not None else None
    last = len(hi_text) if hi_text is not None else top
    options = []
    for width in range(len(lo_text), last + 1):
        start = low if width == len(lo_text) else 10 ** (width - 1)
        end = high if hi_text is not None and width == len(hi_text) else 10 ** width - 1
        if start <= end:
            options += _same_width(str(start), str(end))
    return " | ".join(options)


def _same_width(low: str, high: str) -> list[str]:
    """Sequences for the digit strings of one width from `low` to `high`: after their common
    prefix, `low`'s digit then anything at least its rest, the digits between then anything,
    `high`'s digit then anything at most its rest."""
    if low == high:
        return [json.dumps(low)]
    i = next(k for k in range(len(low)) if low[k] != high[k])
    prefix = f"{json.dumps(low[:i])} " if i else ""
    rest = len(low) - i - 1
    zeros, nines = "0" * rest, "9" * rest
    any_rest = f" [0-9]{{{rest}}}" if rest else ""
    first, last = int(low[i]), int(high[i])
    out = []
    if low[i + 1:] != zeros:            # low's digit, then the rest from low's up
        out.append(_then(prefix + json.dumps(low[i]), _same_width(low[i + 1:], nines)))
        first += 1
    full_end = last if high[i + 1:] == nines else last - 1
    if first <= full_end:
        out.append(f"{prefix}{_digits(str(first), str(full_end))}{any_rest}")
    if high[i + 1:] != nines:           # high's digit, then the rest up to high's
        out.append(_then(prefix + json.dumps(high[i]), _same_width(zeros, high[i + 1:])))
    return out


def _then(head: str, tails: list[str]) -> str:
    return f"{head} ( {' | '.join(tails)} )"


def _digits(low: str, high: str) -> str:
    return json.dumps(low) if low == high else f"[{low}-{high}]"


def _some(low: int | None, high: int | None) -> bool:
    return low is None or high is None or low <= high


def _most(a: int | None, b: int) -> int:
    return b if a is None else max(a, b)


def _least(a: int | None, b: int | None) -> int | None:
    if a is None or b is None:
        return b if a is None else a
    return min(a, b)


@dataclass
class Ranges:
    """Bounded numeric nodes swapped for unique constants before conversion, and their
    constants' literals in the converter's grammar swapped back for range expressions."""

    nonce: str = field(default_factory=lambda: "lirange" + secrets.token_hex(8))
    expressions: dict[str, str] = field(default_factory=dict)

    def take(self, node: dict) -> None:
        """Replace a bounded integer or number node, in place, by its constant."""
        if node.get("type") not in ("integer", "number") or not BOUNDS & node.keys():
            return
        mark = f"{self.nonce}x{len(self.expressions)}"
        self.expressions[mark] = expression(node)
        kept = {k: v for k, v in node.items() if k in ("title", "description")}
        node.clear()
        node.update(kept, const=mark)

    def fill(self, gbnf: str) -> str:
        for mark, expr in self.expressions.items():
            gbnf = gbnf.replace('"\\"' + mark + '\\""', f"( {expr} ) space")
        return gbnf
