"""`k3.serve.api.encoding.dumps` (JSON in pieces, issue 35) writes exactly what `json.dumps` writes, for any JSON
value and for the long lists and deep containers of large answers."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.serve.api import encoding
from k3.serve.api.encoding import SMALL, dumps

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=80) | st.tuples(inner, inner)
                      | st.dictionaries(st.text(), inner, max_size=8), max_leaves=400)


def reference(value, allow_nan: bool = True) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=allow_nan, separators=(",", ":"))


@settings(max_examples=300, deadline=None)
@given(VALUES)
def test_any_value_is_encoded_as_json_dumps_does(value):
    assert dumps(value) == reference(value)
    with pytest.MonkeyPatch.context() as patch:  # pieces of a few values: every path of the walk, on small values
        patch.setattr(encoding, "SMALL", 3)
        patch.setattr(encoding, "SLICE", 2)
        assert dumps(value) == reference(value)


def test_large_answers_are_encoded_as_json_dumps_does():
    entry = {"17": {"logprob": -1.5, "rank": 1, "decoded_token": "é\u2028\"x"}, "3": {"logprob": -2.25, "rank": 2,
                                                                                     "decoded_token": "\n"}}
    answer = {"choices": [{"index": i, "prompt_logprobs": [None] + [entry] * (3 * SMALL + 5),
                           "logprobs": {"tokens": ["a"] * (SMALL + 1), "top_logprobs": [{"a": -0.5}] * 70}}
                          for i in range(3)], "usage": {"prompt_tokens": 1}, "ids": list(range(2 * SMALL)),
              "deep": [[[[list(range(SMALL))]]]], "numbered": {1: "a", None: [1] * (SMALL + 1)}, "empty": [[], {}]}
    same = dumps(answer) == reference(answer) == dumps(answer, allow_nan=False)  # (a diff of megabytes is slow)
    assert same


def test_nan_and_infinity_only_when_allowed():
    for bad in (math.nan, math.inf, -math.inf):
        value = {"x": [0.5] * SMALL + [bad]}
        assert dumps(value) == reference(value)
        with pytest.raises(ValueError):
            dumps(value, allow_nan=False)
