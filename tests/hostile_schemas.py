"""A corpus of hostile JSON schemas for structured output (issue 35): each costs a grammar engine time or memory out
of proportion to its size, or has no value at all. `REFUSED` must be 400s naming the field that carried them;
`BOUNDED` may compile (within the server's budget, and then the answer validates) or be refused, depending on the
machine's speed."""

from __future__ import annotations


def any_of_objects(branches: int, tag: str = "k") -> dict:
    """``anyOf`` over ``branches`` one-property objects (compile time and memory grow with the branches)."""
    return {"anyOf": [{"type": "object", "properties": {f"{tag}{i}": {"type": "integer"}}, "required": [f"{tag}{i}"],
                       "additionalProperties": False} for i in range(branches)]}


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


REFUSED = {
    # nested counted repetition: the lexer's derivatives explode at the first characters of the string
    "nested counted pattern": {"type": "string", "pattern": "^((a{1,100}){1,100}){1,100}$"},
    "nested counted pattern in a property": {
        "type": "object", "properties": {"id": {"type": "string", "pattern": "^(.{1,100}){1,100}$"}},
        "required": ["id"], "additionalProperties": False},
    "ambiguous repetition": {"type": "string", "pattern": "^((\\w+\\s?){1,50}){1,50}$"},
    # huge counts
    "minLength in the millions": {"type": "string", "minLength": 10_000_000},
    "maxItems at 2^31": {"type": "array", "items": {"type": "integer"}, "maxItems": 2**31},
    "minItems in the millions": {"type": "array", "items": {"type": "integer"}, "minItems": 1_000_000},
    "minProperties in the millions": {"type": "object", "minProperties": 5_000_000},
    "counted pattern in the millions": {"type": "string", "pattern": "^a{2000000}$"},
    # thousands of optional properties compile in quadratic time (8,000: about 7 s on 2 cores)
    "8,000 optional properties": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(8000)}},
    # more anyOf branches than the grammar compiler takes, or than a parser row holds
    "anyOf of 3,000 objects": any_of_objects(3000),
    "anyOf of 20,000 branches": {"anyOf": [{"type": "string", "pattern": f"^x{i}[a-z]+$"} for i in range(20_000)]},
    # references with no value behind them
    "self reference": {"$ref": "#"},
    "reference cycle": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "dangling reference": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}},
    "remote reference": {"$ref": "https://example.com/schema.json"},
    "90 levels of nesting": nested(90),
}

BOUNDED = {
    "anyOf of 1,500 objects": any_of_objects(1500),
    "maxLength in the tens of thousands": {"type": "string", "maxLength": 50_000},
    "wide enum": {"enum": [f"value-{i}" for i in range(8000)]},
}
