"""JSON text of answers of any size, encoded piece by piece (issue 35).

The C encoder behind `json.dumps` holds the GIL for the whole of one call, so an answer of many megabytes encoded
in a worker thread would still stall the event loop (and every other thread) until it is done. `dumps` encodes at
most about `SMALL` values per C call — a small answer in one call, a long list in slices — and walks the containers
around them in Python, so other threads run between pieces. The text is exactly `json.dumps`' with
``ensure_ascii=False`` and compact separators.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["SMALL", "dumps"]

SMALL = 8192  # values (containers and scalars) encoded in one C call at most: about a millisecond
SLICE = 64  # items of a long list tried in one C call
_ENCODERS = {allow_nan: json.JSONEncoder(ensure_ascii=False, allow_nan=allow_nan, separators=(",", ":")).encode
             for allow_nan in (False, True)}


def dumps(value: Any, allow_nan: bool = True) -> str:
    """``value`` as compact JSON text; NaN and infinities are refused (ValueError) unless ``allow_nan``."""
    return "".join(_pieces(value, _ENCODERS[allow_nan]))


def _small(value: Any) -> bool:
    """Whether ``value`` holds at most `SMALL` values (found without visiting more than that)."""
    stack, seen = [value], 0
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            seen += len(item)
            if seen > SMALL:
                return False
            stack.extend(item.values() if isinstance(item, dict) else item)
    return True


def _pieces(value: Any, encode: Callable[[Any], str]) -> Iterator[str]:
    if _small(value):
        yield encode(value)
    elif isinstance(value, (list, tuple)):
        yield "["
        for start in range(0, len(value), SLICE):
            part = value[start:start + SLICE]
            if start:
                yield ","
            if _small(part):
                yield encode(part)[1:-1]
                continue
            for i, item in enumerate(part):
                yield from ((",",) if i else ())
                yield from _pieces(item, encode)
        yield "]"
    elif isinstance(value, dict) and all(isinstance(key, str) for key in value):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + encode(key) + ":"
            yield from _pieces(item, encode)
        yield "}"
    else:  # a dict with keys json.dumps converts (numbers, booleans, None): whole
        yield encode(value)
