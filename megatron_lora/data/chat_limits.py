"""Bounds on one rendering of a chat template: its time, its output and the values it builds.

A chat template comes with a tokenizer folder, that is from whoever published the folder. The
sandbox keeps it away from Python's internals but not from looping or allocating without end:
`{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}` would run for
hours and `{{ 'x' * 10**9 }}` would build a gigabyte. So every rendering runs under a
`RenderBudget`, and the environment (`BoundedSandbox`, compiled by `compile_bounded`) checks it
from inside the rendering, in plain Python calls (no signals, no threads: it works in any thread
and in preprocess's worker processes):

- `MAX_RENDER_SECONDS` (5 s): the wall-clock time of one rendering, checked at each piece of
  output, each loop iteration, each call, filter, operator, attribute and item lookup.
- `MAX_RENDER_CHARS` (4 Mi characters): the output of one rendering, counted as it is produced,
  and the largest string, list, tuple or dict one operation may build (`*`, `+`, `~`, `%`,
  filters, method calls, `{% set %}` blocks); an integer argument above it (a width, a repeat
  count: `'x'.ljust(10**9)`, `'x' | center(10**9)`) is refused before the call, and so is a
  format string asking for such a width or precision.
- `MAX_RANGE_ITEMS` (100000, the sandbox's own limit): the size of one `range()`.
- `MAX_INT_BITS` (65536 bits, about 20000 digits): the largest integer `*` or `**` may build.

Reaching one raises `RenderLimitExceeded`, which chat.py reports as a ChatTemplateLimitError
naming the template: the template, not one conversation, is at fault, so preprocess stops there
instead of skipping line after line at several seconds each.
"""

from __future__ import annotations

import functools
import math
import re
import time
from typing import Optional

import jinja2
import jinja2.nodes as nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

MAX_RENDER_SECONDS = 5.0
MAX_RENDER_CHARS = 4 * 2**20
MAX_RANGE_ITEMS = 100_000
MAX_INT_BITS = 2**16

_LOOP_GUARD = "chat_template_loop_guard"  # filters the transformed template calls
_SIZE_GUARD = "chat_template_size_guard"
_LOADS = {nodes.Include: "include", nodes.Import: "import", nodes.FromImport: "from",
          nodes.Extends: "extends"}
_DIGITS = re.compile(r"\d+")


class RenderLimitExceeded(Exception):
    """A rendering reached one of this module's limits; the message says which."""


class RenderBudget:
    """The limits of one rendering: its deadline and the characters written so far."""

    def __init__(self, seconds: float = MAX_RENDER_SECONDS, chars: int = MAX_RENDER_CHARS):
        self.seconds, self.chars = seconds, chars
        self.deadline = time.monotonic() + seconds
        self.written = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimitExceeded(f"rendering took longer than {self.seconds:g} s "
                                      f"(MAX_RENDER_SECONDS)")

    def wrote(self, piece: str) -> None:
        self.written += len(piece)
        if self.written > self.chars:
            raise RenderLimitExceeded(f"the rendering is longer than {self.chars} characters "
                                      f"(MAX_RENDER_CHARS)")
        self.tick()


def _size(value) -> int:
    """Characters or items a value holds, one level deep (a list's strings count in full)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(v) for v in value if isinstance(v, str))
    if isinstance(value, (dict, set, frozenset)):
        return len(value)
    return 0


def _check_built(value, what: str):
    """`value` itself, unless it is larger than MAX_RENDER_CHARS or MAX_INT_BITS allow."""
    if _size(value) > MAX_RENDER_CHARS:
        raise RenderLimitExceeded(f"{what} built a value of {_size(value)} characters or items, "
                                  f"more than {MAX_RENDER_CHARS} (MAX_RENDER_CHARS)")
    if isinstance(value, int) and not isinstance(value, bool) and \
            value.bit_length() > MAX_INT_BITS:
        raise RenderLimitExceeded(f"{what} built an integer of more than {MAX_INT_BITS} bits "
                                  f"(MAX_INT_BITS)")
    return value


def _check_arguments(values, what: str) -> None:
    """Refuse an integer argument above MAX_RENDER_CHARS (a width or a count) before the call."""
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and \
                abs(value) > MAX_RENDER_CHARS:
            raise RenderLimitExceeded(f"{what} was given {value}, more than {MAX_RENDER_CHARS} "
                                      f"(MAX_RENDER_CHARS)")


def _check_format(fmt, what: str) -> None:
    """Refuse a format string whose width or precision is above MAX_RENDER_CHARS."""
    if isinstance(fmt, str):
        _check_arguments((int(d) for d in _DIGITS.findall(fmt) if len(d) <= 20), what)


def _check_join(items, what: str) -> None:
    if isinstance(items, (list, tuple)) and _size(items) > MAX_RENDER_CHARS:
        raise RenderLimitExceeded(f"{what} would join {_size(items)} characters, more than "
                                  f"{MAX_RENDER_CHARS} (MAX_RENDER_CHARS)")


def _power_bits(base, exponent) -> float:
    """About how many bits base ** exponent has (0 when it cannot grow)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (base, exponent)):
        return 0.0
    if exponent <= 0 or abs(base) <= 1:
        return 0.0
    return exponent * math.log2(abs(base))


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox with this module's limits. `render_budget` is the RenderBudget of
    the rendering in progress, None between renderings (compile-time constant folding then
    still checks sizes, not time)."""

    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])
    render_budget: Optional[RenderBudget] = None

    def __init__(self, **options):
        super().__init__(**options)
        self.globals["range"] = self._range
        for name, function in list(self.filters.items()):
            self.filters[name] = self.guarded_filter(name, function)
        self.filters[_LOOP_GUARD] = self._loop_guard
        self.filters[_SIZE_GUARD] = self._size_guard

    def tick(self) -> None:
        if self.render_budget is not None:
            self.render_budget.tick()

    def _range(self, *args):
        self.tick()
        span = range(*args)
        if len(span) > MAX_RANGE_ITEMS:
            raise RenderLimitExceeded(f"range() of {len(span)} items, more than "
                                      f"{MAX_RANGE_ITEMS} (MAX_RANGE_ITEMS)")
        return span

    def guarded_filter(self, name: str, function):
        """`function` as a filter named `name`: clock, argument and result sizes checked."""
        what = f"the filter {name!r}"

        @functools.wraps(function)  # keeps jinja's pass_context/pass_environment marks
        def guarded(*args, **kwargs):
            self.tick()
            skip = 2 if getattr(function, "jinja_pass_arg", None) is not None else 1
            _check_arguments(list(args[skip:]) + list(kwargs.values()), what)
            if name == "format" and len(args) >= skip:
                _check_format(args[skip - 1], what)
            if name == "join" and len(args) >= skip:
                _check_join(args[skip - 1], what)
            return _check_built(function(*args, **kwargs), what)

        return guarded

    def _loop_guard(self, iterable):
        """What a `{% for %}` loop iterates: `iterable`, with the clock checked at each item."""
        for item in iterable:
            self.tick()
            yield item

    def _size_guard(self, value):
        """`~` and `{% set %}...{% endset %}` results, size-checked."""
        self.tick()
        return _check_built(value, "a concatenation")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        __self.tick()
        what = f"the call {getattr(__obj, '__name__', type(__obj).__name__)}()"
        _check_arguments(list(args) + list(kwargs.values()), what)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            if getattr(method, "__name__", "") in ("format", "format_map"):
                _check_format(owner, what)
            if getattr(method, "__name__", "") == "join" and args:
                _check_join(args[0], what)
        return _check_built(super().call(__context, __obj, *args, **kwargs), what)

    def call_binop(self, context, operator, left, right):
        self.tick()
        what = f"the operator {operator!r}"
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(count, int) and _size(seq) and _size(seq) * count > MAX_RENDER_CHARS:
                    raise RenderLimitExceeded(f"{what} would build {_size(seq) * count} "
                                              f"characters or items, more than "
                                              f"{MAX_RENDER_CHARS} (MAX_RENDER_CHARS)")
        elif operator == "**" and _power_bits(left, right) > MAX_INT_BITS:
            raise RenderLimitExceeded(f"{what} would build an integer of more than "
                                      f"{MAX_INT_BITS} bits (MAX_INT_BITS)")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, what)
            _check_arguments(right if isinstance(right, tuple) else (right,), what)
        return _check_built(super().call_binop(context, operator, left, right), what)

    def getattr(self, obj, attribute):
        self.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.tick()
        return super().getitem(obj, argument)


class _Guards(NodeTransformer):
    """Route every loop's iterable, `~` concatenation and `{% set %}` block through the
    environment's guard filters."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _LOOP_GUARD, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return nodes.Filter(node, _SIZE_GUARD, [], [], None, None, lineno=node.lineno)

    def visit_AssignBlock(self, node):
        self.generic_visit(node)
        node.filter = nodes.Filter(node.filter, _SIZE_GUARD, [], [], None, None,
                                   lineno=node.lineno)
        return node


def compile_bounded(env: BoundedSandbox, source: str) -> jinja2.Template:
    """`source` compiled for `env` with the guards in place. Raises jinja2's TemplateSyntaxError
    for a template that loads other templates (`{% include %}`, `{% import %}`, `{% from %}`,
    `{% extends %}`): a chat template is one text, and there are no others to load."""
    ast = env.parse(source)
    for kind, tag in _LOADS.items():
        for node in ast.find_all(kind):
            raise jinja2.exceptions.TemplateSyntaxError(
                f"{{% {tag} %}} loads another template, which a chat template cannot do",
                node.lineno)
    return env.from_string(_Guards().visit(ast))


__all__ = ["BoundedSandbox", "MAX_INT_BITS", "MAX_RANGE_ITEMS", "MAX_RENDER_CHARS",
           "MAX_RENDER_SECONDS", "RenderBudget", "RenderLimitExceeded", "compile_bounded"]
