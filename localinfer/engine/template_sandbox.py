"""Jinja2's immutable sandbox with every hook that can grow a value or run a loop bounded.

Nothing here is a template engine of its own: it overrides the sandbox's documented hooks (operators,
calls, attribute formatting, `concat`, `finalize`), wraps the filters, and has the code generator
count the items of every `for` loop. The bounds and their reasons are in template_bounds.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localinfer.engine import template_bounds as bounds

# Filters that turn their value into text: a container is sized as text before they run.
_STRINGIFYING = frozenset({
    "capitalize", "center", "e", "escape", "forceescape", "format", "indent", "join", "lower",
    "pprint", "replace", "safe", "string", "striptags", "title", "tojson", "trim", "truncate",
    "upper", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr",
})
# str and bytes methods whose result can be much larger than the string and its arguments.
_GROWING_METHODS = frozenset({"center", "expandtabs", "join", "ljust", "replace", "rjust",
                              "translate", "zfill"})
# tojson indents every line once per nesting level; chat templates indent by 2 or 4.
_MAX_JSON_INDENT = 64


class _CountingCodeGenerator(CodeGenerator):
    """Compiles `for` loops so each item is counted, and `~` so its operands are sized first."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        # Wrapping the iterable (not the body) also counts items a loop's `if` filters out.
        if not _is_counted(node.iter):
            node.iter = nodes.Call(nodes.EnvironmentAttribute("counted"), [node.iter], [], None,
                                   None, lineno=node.lineno)
        super().visit_For(node, frame)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        # As Jinja writes it, with the operands handed to concat_operands before they are joined.
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write("environment.concat_operands((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {join})")


def _is_counted(expr: nodes.Expr) -> bool:
    return (isinstance(expr, nodes.Call) and isinstance(expr.node, nodes.EnvironmentAttribute)
            and expr.node.name == "counted")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with rendering bounded by the active template_bounds.Budget."""

    code_generator_class = _CountingCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *, filters: dict[str, Callable[..., Any]] | None = None,
                 **options: Any) -> None:
        super().__init__(finalize=_finalize, **options)
        # Jinja's filler-text generator: no chat template uses it, and lipsum(n=10**6) is gigabytes.
        self.globals.pop("lipsum", None)
        self.filters.update(filters or {})
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    # -- hooks the compiled template calls ----------------------------------------------------------
    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = bounds.active()
        budget.tick()
        _check_binop(budget, operator, left, right)
        return budget.made(super().call_binop(context, operator, left, right))

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = bounds.active()
        budget.tick(bounds.HEAVY)
        if isinstance(__obj, LoopContext) and args:      # `loop(children)` in a recursive loop
            args = (__self.counted(args[0]), *args[1:])
        _check_method(budget, __obj, args, kwargs)
        budget.enter()
        try:
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            budget.leave()
        return budget.made(result)

    def counted(self, iterable: Iterable[Any]) -> Iterator[Any]:
        return bounds.active().counted(iterable)

    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override]
        """Joins the output buffers of macros, `{% set %}` blocks and `{% filter %}` blocks."""
        budget = bounds.active()
        parts = parts if isinstance(parts, list) else bounds.bounded_list(budget, parts)
        budget.chars(sum(len(p) for p in parts), "a block's output")
        return "".join(parts)

    def concat_operands(self, operands: tuple[Any, ...], join: Callable[[Any], str]) -> str:
        """The `~` operator: the operands' sizes as text are checked before they are joined."""
        budget = bounds.active()
        budget.tick()
        budget.chars(sum(bounds.text_size(o, budget.limits.max_chars) for o in operands))
        return join(operands)


def _finalize(value: Any) -> Any:
    """Every `{{ expression }}` passes here before str(): a container is sized as text first."""
    if not isinstance(value, str):
        bounds.active().text(value, "an expression's text")
    return value


def _check_binop(budget: bounds.Budget, operator: str, left: Any, right: Any) -> None:
    if operator == "**":
        budget.int_bits(bounds.power_bits(left, right))
    elif operator == "*":
        budget.int_bits(bounds.product_bits(left, right))
        _check_repeat(budget, left, right)
        _check_repeat(budget, right, left)
    elif operator == "+" and isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
        budget.chars(len(left) + len(right))
    elif operator == "+" and isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        budget.items(len(left) + len(right))
    elif operator == "%" and isinstance(left, str):
        budget.chars(bounds.percent_size(budget, left, right))


def _check_repeat(budget: bounds.Budget, sequence: Any, times: Any) -> None:
    if not bounds.is_int(times) or times <= 0:
        return
    if isinstance(sequence, (str, bytes)):
        budget.chars(len(sequence) * times)
    elif isinstance(sequence, (list, tuple)):
        budget.items(len(sequence) * times)


def _check_method(budget: bounds.Budget, obj: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> None:
    """Size a str or bytes method that can grow its string before it runs."""
    wrapped = getattr(obj, "__wrapped__", None)     # the sandbox's own str.format wrapper
    target = wrapped if wrapped is not None else obj
    owner = getattr(target, "__self__", None)
    name = getattr(target, "__name__", "")
    if not isinstance(owner, (str, bytes)):
        return
    if name in ("format", "format_map") and isinstance(owner, str):
        mapping = args[0] if name == "format_map" and args and isinstance(args[0], Mapping) else {}
        budget.chars(bounds.format_size(budget, owner, args if name == "format" else (),
                                        kwargs if name == "format" else mapping))
        return
    if name not in _GROWING_METHODS:
        return
    budget.int_args([*args, *kwargs.values()])
    if name == "replace" and len(args) >= 2:
        budget.chars(bounds.replace_size(owner, *args[:3]))
    elif name == "join" and args:
        budget.chars(bounds.join_size(budget, owner, bounds.bounded_list(budget, args[0])))
    elif name == "expandtabs":
        tab = (args[0] if args else kwargs.get("tabsize", 8))
        budget.chars(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t")
                     * max(tab if bounds.is_int(tab) else 8, 0))
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
        budget.chars(len(owner) * max(longest, 1))


# -- filters --------------------------------------------------------------------------------------
def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` with its value sized as text (when it makes text), its growth estimated, its width
    and count arguments bounded and its result checked. Jinja's pass-context marker is kept."""
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = bounds.active()
        budget.tick(bounds.HEAVY)
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        budget.int_args([*rest, *kwargs.values()])
        if name in _STRINGIFYING and not isinstance(value, str):
            budget.text(value)
        grown = _FILTER_GROWTH.get(name)
        if grown is not None:
            value = grown(budget, value, rest, kwargs)
            args = (*args[:skip], value, *rest)
        return budget.made(func(*args, **kwargs))

    return bounded


def _arg(rest: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    return rest[index] if len(rest) > index else kwargs.get(name, default)


def _replace_filter(budget: bounds.Budget, value: Any, rest: tuple, kwargs: dict) -> Any:
    old, new = _arg(rest, kwargs, 0, "old", ""), _arg(rest, kwargs, 1, "new", "")
    if isinstance(value, str) and isinstance(old, str) and isinstance(new, str):
        budget.chars(bounds.replace_size(value, old, new, _arg(rest, kwargs, 2, "count", -1)))
    return value


def _join_filter(budget: bounds.Budget, value: Any, rest: tuple, kwargs: dict) -> Any:
    # A generator is read here, within the item bound, so that its size is known before joining.
    items = bounds.bounded_list(budget, value) if not isinstance(value, str) else list(value)
    separator = _arg(rest, kwargs, 0, "d", "")
    budget.chars(bounds.join_size(budget, separator if isinstance(separator, str) else "", items))
    return items


def _indent_filter(budget: bounds.Budget, value: Any, rest: tuple, kwargs: dict) -> Any:
    width = _arg(rest, kwargs, 0, "width", 4)
    prefix = len(width) if isinstance(width, str) else width if bounds.is_int(width) else 0
    text = value if isinstance(value, str) else ""
    budget.chars(len(text) + (text.count("\n") + 1) * max(prefix, 0))
    return value


def _wordwrap_filter(budget: bounds.Budget, value: Any, rest: tuple, kwargs: dict) -> Any:
    wrap = _arg(rest, kwargs, 2, "wrapstring", None)
    if isinstance(value, str) and isinstance(wrap, str):
        budget.chars(len(value) * (1 + len(wrap)))      # at most one break per character
    return value


def _format_filter(budget: bounds.Budget, value: Any, rest: tuple, kwargs: dict) -> Any:
    if isinstance(value, str):
        budget.chars(bounds.percent_size(budget, value, kwargs or tuple(rest)))
    return value


def _urlize_filter(budget: bounds.Budget, value: Any, rest: tuple, kwargs: dict) -> Any:
    # Each link (three characters at least) gains an <a href> tag with the target and rel given.
    extra = sum(len(v) for v in [*rest, *kwargs.values()] if isinstance(v, str)) + 64
    if isinstance(value, str):
        budget.chars(len(value) + (len(value) // 3 + 1) * extra)
    return value


def _tojson_filter(budget: bounds.Budget, value: Any, rest: tuple, kwargs: dict) -> Any:
    indent = _arg(rest, kwargs, 0, "indent", None)
    width = len(indent) if isinstance(indent, str) else indent if bounds.is_int(indent) else 0
    if width > _MAX_JSON_INDENT:
        raise bounds.TemplateBoundExceeded(
            f"it indents JSON by {width:,}, more than its bound of {_MAX_JSON_INDENT}")
    return value


def _count_filter(budget: bounds.Budget, value: Any, rest: tuple, kwargs: dict) -> Any:
    # slice(n) makes n lists and batch(n, fill) pads to n items: n is a list's length.
    count = _arg(rest, kwargs, 0, "slices", None) if rest else \
        kwargs.get("slices", kwargs.get("linecount"))
    if bounds.is_int(count):
        budget.items(count)
    return value


def _sum_filter(budget: bounds.Budget, value: Any, rest: tuple, kwargs: dict) -> Any:
    start = _arg(rest, kwargs, 1, "start", 0)
    if not isinstance(start, (int, float)):         # summing lists copies them: quadratic time
        raise bounds.TemplateBoundExceeded("it sums sequences, which takes quadratic time")
    return value


_FILTER_GROWTH: dict[str, Callable[[bounds.Budget, Any, tuple, dict], Any]] = {
    "replace": _replace_filter, "join": _join_filter, "indent": _indent_filter,
    "wordwrap": _wordwrap_filter, "format": _format_filter, "urlize": _urlize_filter,
    "sum": _sum_filter, "tojson": _tojson_filter, "slice": _count_filter, "batch": _count_filter,
}
