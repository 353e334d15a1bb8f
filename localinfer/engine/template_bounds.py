"""What one chat-template render may cost, and the checks that hold it there.

A GGUF's chat template is a program from a downloaded file. Jinja2's sandbox stops it reaching
Python internals, but not from looping, recursing or building huge values. The rule kept here:
every operation that can grow a value by more than a small constant factor (repetition, padding,
replace, join, format, indentation, turning a container into text, powers and products of integers)
is sized *before* it runs, and every value a call or filter returns is checked after. Everything a
template does beyond that grows values by a constant factor at most, so memory stays bounded; loop
items, calls and operators are counted and the thread's CPU time is checked as they go.

The bounds sit far above what chat templates do (they format a few messages in one pass, in about a
millisecond) and far below what would hurt the machine.
"""

from __future__ import annotations

import gc
import math
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from string import Formatter

from jinja2.exceptions import SecurityError
from jinja2.utils import Namespace

# Output allowed on top of the conversation itself: system prompts, tool descriptions, markup.
BASE_CHARS = 1 << 20
# Templates may repeat what they are given (some render the history twice); four times is ample.
INPUT_FACTOR = 4
MAX_ITEMS = 100_000          # any list, tuple or dict a template makes (Jinja's own range cap)
MAX_ITERATIONS = 1_000_000   # loop items over the whole render; a real template does ~ messages²
MAX_INT_BITS = 4096          # integers a template computes; chat templates count messages
MAX_INT_ARG = 1_000_000      # widths and counts passed to string methods and filters
MAX_DEPTH = 64               # nested calls (macros, recursive loops); each costs ~5 Python frames
CPU_SECONDS = 0.25           # of this thread's CPU; a real template takes about a millisecond
_CLOCK_EVERY = 32            # ticks between reads of the CPU clock (a read costs ~2 µs)
HEAVY = _CLOCK_EVERY         # the weight of a call or filter: it may walk a whole list


class _CollectorTime(threading.local):
    """CPU seconds this thread has spent in Python's garbage collector. A full collection in a
    large process can take longer than a whole render may, and it is the process's cost, not
    the template's: the CPU bound leaves it out."""

    seconds = 0.0
    started: float | None = None

    def __call__(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self.started = time.thread_time()
        elif self.started is not None:
            self.seconds += time.thread_time() - self.started
            self.started = None


_collector = _CollectorTime()
gc.callbacks.append(_collector)


def _template_cpu() -> float:
    """This thread's CPU clock, less its time in the garbage collector."""
    return time.thread_time() - _collector.seconds


class TemplateBoundExceeded(SecurityError):
    """The template went past one of its bounds; the message says which."""


@dataclass(frozen=True)
class Limits:
    max_chars: int                      # the output, and any one string a template makes
    max_items: int = MAX_ITEMS
    max_iterations: int = MAX_ITERATIONS
    max_int_bits: int = MAX_INT_BITS
    max_int_arg: int = MAX_INT_ARG
    max_depth: int = MAX_DEPTH
    cpu_seconds: float = CPU_SECONDS


def limits_for(messages: Iterable[Mapping[str, object]]) -> Limits:
    """Bounds for rendering `messages`: the output may be a few times the conversation's size."""
    chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    return Limits(max_chars=BASE_CHARS + INPUT_FACTOR * chars)


class Budget:
    """The running cost of one render, checked against its Limits."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.iterations = 0
        self.depth = 0
        self._ticks = 0
        self._deadline = _template_cpu() + limits.cpu_seconds

    def tick(self, weight: int = 1) -> None:
        """Template work: a loop item or operator weighs 1, a call or filter HEAVY. The CPU clock
        is read once per _CLOCK_EVERY units, so after every call or filter."""
        self._ticks += weight
        if self._ticks >= _CLOCK_EVERY:
            self._ticks = 0
            if _template_cpu() > self._deadline:
                raise TemplateBoundExceeded(
                    f"it ran for more than {self.limits.cpu_seconds:g} s of CPU")

    def iterate(self) -> None:
        self.iterations += 1
        if self.iterations > self.limits.max_iterations:
            raise TemplateBoundExceeded(
                f"its loops ran more than {self.limits.max_iterations:,} times")
        self.tick()

    def enter(self) -> None:
        self.depth += 1
        if self.depth > self.limits.max_depth:
            raise TemplateBoundExceeded(
                f"it nested calls more than {self.limits.max_depth} deep (a macro that calls itself?)")

    def leave(self) -> None:
        self.depth -= 1

    def chars(self, n: int, what: str = "a string") -> None:
        if n > self.limits.max_chars:
            raise TemplateBoundExceeded(
                f"{what} would hold {n:,} characters, more than its bound of {self.limits.max_chars:,}")

    def items(self, n: int) -> None:
        if n > self.limits.max_items:
            raise TemplateBoundExceeded(
                f"a list would hold {n:,} items, more than its bound of {self.limits.max_items:,}")

    def int_bits(self, bits: float) -> None:
        if bits > self.limits.max_int_bits:
            raise TemplateBoundExceeded(
                f"a number would need {bits:,.0f} bits, more than its bound of "
                f"{self.limits.max_int_bits:,}")

    def int_args(self, values: Iterable[object]) -> None:
        """Widths and counts handed to a string method or filter."""
        for value in values:
            if is_int(value) and abs(value) > self.limits.max_int_arg:
                raise TemplateBoundExceeded(
                    f"a width or count of {value:,} is more than its bound of "
                    f"{self.limits.max_int_arg:,}")

    def made(self, value: object) -> object:
        """Check a value an operation returned, and pass it on."""
        if isinstance(value, (str, bytes)):
            self.chars(len(value))
        elif isinstance(value, (list, tuple, dict, set, frozenset)):
            self.items(len(value))
        elif is_int(value):
            self.int_bits(value.bit_length())
        return value

    def text(self, value: object, what: str = "a string") -> int:
        """Check what str(value) would hold before anything makes it; returns that size."""
        size = text_size(value, self.limits.max_chars)
        self.chars(size, what)
        return size

    def counted(self, iterable: Iterable[object]) -> Iterator[object]:
        """The items of a loop, each one counted."""
        for item in iterable:
            self.iterate()
            yield item


# -- the render in progress -----------------------------------------------------------------------
_active: ContextVar[Budget | None] = ContextVar("localinfer_template_budget", default=None)


def active() -> Budget:
    """The budget of the render in progress. Outside one (Jinja folds constant expressions while
    compiling), a fresh budget with the smallest limits: constants come from the template's text."""
    return _active.get() or Budget(Limits(max_chars=BASE_CHARS))


def begin(budget: Budget) -> object:
    return _active.set(budget)


def end(token: object) -> None:
    _active.reset(token)  # type: ignore[arg-type]


# -- sizes ----------------------------------------------------------------------------------------
def is_int(value: object) -> bool:
    """An integer, not a bool (True * 'x' is harmless)."""
    return isinstance(value, int) and not isinstance(value, bool)


def text_size(value: object, limit: int) -> int:
    """About how many characters str(value) holds, counted only until it passes `limit`.

    Containers are walked, not converted: a list of one long string repeated is cheap to hold and
    huge as text. Every element adds at least a separator, so the walk visits at most `limit`
    elements. Escapes that repr adds inside containers are not counted (a constant factor).
    """
    if isinstance(value, str):
        return len(value)
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, (bytes, bytearray)):
            total += len(item) + 3
        elif isinstance(item, Namespace):
            stack.append(item._Namespace__attrs)    # shown as <Namespace {...}>
            total += 12
        elif isinstance(item, Mapping):
            total += 2 + 4 * len(item)
            if total <= limit:
                stack.extend(item.keys())
                stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset, type({}.items()), type({}.keys()),
                               type({}.values()))):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend(item)
        elif is_int(item):
            total += 1 + int(item.bit_length() * 0.302) + 1   # digits and sign
        else:
            total += 64                                 # numbers, None, reprs of small objects
    return total


# -- estimates for operations that can grow a value past a constant factor -----------------------
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d*)(?:\.(\*|\d*))?")
_DIGITS = re.compile(r"\d+")


def spec_width(budget: Budget, spec: str) -> int:
    """The largest width or precision written in a format spec ('%999999999d', '{:>9999}'),
    refused past the bound; 0 when there is none."""
    numbers = _DIGITS.findall(spec)
    if any(len(n) > 12 for n in numbers):       # no need to read a thousand digits to refuse
        budget.int_args([10 ** 12])
    widths = [int(n) for n in numbers]
    budget.int_args(widths)
    return max(widths, default=0)


def percent_size(budget: Budget, fmt: str, args: object) -> int:
    """'fmt % args': each conversion at most the largest argument plus the largest width."""
    conversions = _PERCENT_SPEC.findall(fmt)
    values = list(args.values()) if isinstance(args, Mapping) else \
        list(args) if isinstance(args, tuple) else [args]
    specs = set(conversions)                # a long format repeats a few specs many times
    width = max((spec_width(budget, f"{w} {p}") for w, p in specs), default=0)
    if any("*" in w + p for w, p in specs):
        budget.int_args(values)            # '*' takes the width from the arguments
        width = max([width, *(abs(v) for v in values if is_int(v))])
    return len(fmt) + len(conversions) * (_largest_text(budget, values, len(conversions)) + width)


def format_size(budget: Budget, fmt: str, args: Iterable[object],
                kwargs: Mapping[str, object]) -> int:
    """'fmt.format(...)': each field at most the largest argument plus the largest width."""
    specs = [spec or "" for _, name, spec, _ in Formatter().parse(fmt) if name is not None]
    width = max((spec_width(budget, spec) for spec in set(specs)), default=0)
    values = [*args, *kwargs.values()]
    if any("{" in spec for spec in specs):  # '{:{}}' takes the width from the arguments
        budget.int_args(values)
        width = max([width, *(abs(v) for v in values if is_int(v))])
    return len(fmt) + len(specs) * (_largest_text(budget, values, len(specs)) + width)


def _largest_text(budget: Budget, values: list[object], uses: int) -> int:
    """The longest of the values as text, checked as it goes: each may be used `uses` times."""
    largest = 0
    for value in values:
        largest = max(largest, budget.text(value))
        budget.chars(uses * largest)
    return largest


def join_size(budget: Budget, separator: str, items: list[object]) -> int:
    """Characters of separator.join(items), counted only until it passes the bound."""
    budget.items(len(items))
    total = len(separator) * max(len(items) - 1, 0)
    for item in items:
        if total > budget.limits.max_chars:
            break
        total += text_size(item, budget.limits.max_chars)
    return total


def replace_size(text: str, old: str, new: str, count: object = -1) -> int:
    hits = text.count(old) if old else len(text) + 1
    if is_int(count) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def bounded_list(budget: Budget, iterable: Iterable[object]) -> list[object]:
    """An iterable as a list, refusing more items than the bound before holding them all."""
    items: list[object] = []
    for item in iterable:
        items.append(item)
        if len(items) > budget.limits.max_items:
            budget.items(len(items))
    return items


def power_bits(left: object, right: object) -> float:
    """Bits of left ** right for integers (0 when the result cannot grow)."""
    if not (is_int(left) and is_int(right)) or right <= 0 or abs(left) <= 1:
        return 0.0
    return math.log2(abs(left)) * right


def product_bits(left: object, right: object) -> float:
    if is_int(left) and is_int(right):
        return float(left.bit_length() + right.bit_length())
    return 0.0
