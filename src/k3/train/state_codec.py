"""The training state as data, never pickle: its tensors for safetensors, the rest as JSON.

`encode(tree)` splits a tree of dicts, lists, tuples, None, booleans, numbers, strings and tensors into a
JSON value and a ``{name: tensor}`` map; `decode` rebuilds the tree exactly (integer dict keys such as
optimiser parameter ids, tuples such as AdamW's betas, int vs float). The JSON forms:

* ``{"__tensor__": NAME}`` — the tensor stored as NAME, its path in the tree (``optimizers/1/state/0/exp_avg``);
* ``{"__tuple__": [...]}`` — a tuple;
* ``{"__dict__": [[key, value], ...]}`` — a dict with a key that is not a string, or that starts with ``__``;
* any other dict is a JSON object; lists, strings, numbers, booleans and None are themselves.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

TENSOR, TUPLE, DICT = "__tensor__", "__tuple__", "__dict__"


def encode(tree: Any) -> tuple[Any, dict[str, Tensor]]:
    """``(json_value, tensors)`` for ``tree``; a value of another type is a TypeError naming its path."""
    tensors: dict[str, Tensor] = {}
    return _encode(tree, "", tensors), tensors


def _encode(x: Any, path: str, tensors: dict[str, Tensor]) -> Any:
    if isinstance(x, Tensor):
        name = path.lstrip("/")
        if name in tensors:
            raise ValueError(f"training state: two tensors at {name!r}")
        tensors[name] = x.detach().contiguous()
        return {TENSOR: name}
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in x):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in x.items()}
        return {DICT: [[_encode(k, f"{path}/{k}", tensors), _encode(v, f"{path}/{k}", tensors)]
                       for k, v in x.items()]}
    if isinstance(x, tuple):
        return {TUPLE: [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(x)]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"training state at {path or '/'}: cannot store a {type(x).__name__} as data")


def decode(value: Any, tensors: dict[str, Tensor]) -> Any:
    """Inverse of `encode`; a reference to a tensor not in ``tensors`` is a ValueError naming it."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {TENSOR}:
        if value[TENSOR] not in tensors:
            raise ValueError(f"tensor {value[TENSOR]!r} is missing")
        return tensors[value[TENSOR]]
    if value.keys() == {TUPLE}:
        return tuple(decode(v, tensors) for v in value[TUPLE])
    if value.keys() == {DICT}:
        return {decode(k, tensors): decode(v, tensors) for k, v in value[DICT]}
    return {k: decode(v, tensors) for k, v in value.items()}
