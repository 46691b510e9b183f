"""JSON as RFC 8259 has it, for what kvbridge reads from outside: request bodies (openai_wire.py)
and trace files (tracing/waterfall.py). No NaN or Infinity, no number that overflows a float, and
no nesting deeper than MAX_JSON_DEPTH: no later walk of the value (pydantic, json.dumps, a tree
walk) comes near Python's recursion limit, which a document nested ~1000 deep would otherwise hit."""

from __future__ import annotations

import json
import math
from typing import Any

MAX_JSON_DEPTH = 100
_MAX_NUMBER_CHARS = 40  # a number quoted in an error message, at most


class TooDeep(ValueError):
    """The document nests deeper than MAX_JSON_DEPTH."""


def loads(text: str) -> Any:
    """The value of `text`; ValueError saying why it is not strict JSON (TooDeep: too deep)."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise TooDeep(f"nests deeper than {MAX_JSON_DEPTH} levels") from None
    # The walk costs a pass over the value; a text without that many brackets cannot fail it.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and depth(value) > MAX_JSON_DEPTH:
        raise TooDeep(f"nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def depth(value: Any) -> int:
    """How deep lists and objects nest in `value` (1: a flat one), walked without recursion;
    stops once past MAX_JSON_DEPTH."""
    deepest = 0
    stack = [(value, 1)]
    while stack and deepest <= MAX_JSON_DEPTH:
        item, level = stack.pop()
        deepest = max(deepest, level)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        shown = text if len(text) <= _MAX_NUMBER_CHARS else text[:_MAX_NUMBER_CHARS - 3] + "..."
        raise ValueError(f"the number {shown} is out of range")
    return value
