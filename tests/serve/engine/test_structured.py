"""Structured output (`k3.serve.engine.structured`): random logits driven through JSON-schema constraints always yield a
valid, complete value within a bounded number of tokens, for both tokenizers; plus errors, caching and threads."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kimi_fixtures import TEXTS, build_kimi_tokenizer_files
from serving import tokenizer as bpe_tokenizer

from k3.serve.engine.structured import MAX_WHITESPACE, Grammars

MAX_STEPS = 10_000  # a random walk's strings and arrays end geometrically: 800 drawn cases took at most 2,565
EXTRA = 7  # model vocabulary beyond the tokenizer's
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


_GRAMMARS: dict[int, tuple[object, Grammars]] = {}


def json_constraint(tok, schema, stop_ids):
    """``schema``'s constraint factory from one `Grammars` per tokenizer (each holds a compile child process)."""
    if id(tok) not in _GRAMMARS:
        _GRAMMARS[id(tok)] = tok, Grammars(tok)
    return _GRAMMARS[id(tok)][1].constraint(schema, stop_ids)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return build_kimi_tokenizer_files(tmp_path_factory.mktemp("kimi"), [f"{t} {i}" for i in range(5) for t in TEXTS])


@pytest.fixture(scope="module", params=["bpe", "kimi"])
def tok(request, kimi):
    return bpe_tokenizer() if request.param == "bpe" else kimi


def generate(tok, factory, seed: int, bias: torch.Tensor | None = None) -> tuple[str, int]:
    """Drive one fresh constraint with seeded random logits (argmax after masking) until ``done()``; check each mask
    (no special token, nothing past the tokenizer, only stop tokens once done) and return the text and step count."""
    gen = torch.Generator().manual_seed(seed)
    token_bytes = tok.token_bytes()
    special = torch.tensor([b == b"" for b in token_bytes])
    c, out = factory(), []
    for step in range(MAX_STEPS):
        logits = torch.randn(len(tok) + EXTRA, generator=gen)
        if bias is not None:
            logits[:len(tok)] += bias
        c.mask_(logits)
        allowed = logits.isfinite()
        assert not allowed[len(tok):].any()
        if c.done():
            assert allowed.nonzero().flatten().tolist() == [tok.eos_id]
            c.accept(tok.eos_id)
            return b"".join(token_bytes[i] for i in out).decode("utf-8"), step
        assert set((allowed[:len(tok)] & special).nonzero().flatten().tolist()) <= {tok.eos_id}
        token = int(logits.argmax())
        assert allowed[token]
        c.accept(token)
        if token == tok.eos_id:
            return b"".join(token_bytes[i] for i in out).decode("utf-8"), step
        out.append(token)
    raise AssertionError(f"no complete value after {MAX_STEPS} tokens")


# ------------------------------------------------------------------------------------------------
# token_bytes
def test_token_bytes_bpe():
    tok = bpe_tokenizer()
    table = tok.token_bytes()
    assert len(table) == tok.vocab_size
    assert table[:12] == [b""] * 12 and all(table[12:])
    text = 'naïve {"k": [1, 2.5e-3]} 中文 🙂\n\t' + "<|user|>"
    assert b"".join(table[i] for i in tok.encode(text)) == text.encode()


def test_token_bytes_kimi(kimi):
    table = kimi.token_bytes()
    assert len(table) == kimi.vocab_size
    base = kimi.vocab_size - 256
    assert table[base:] == [b""] * 256 and all(table[:base])
    text = 'naïve {"k": [1, 2.5e-3]} 中文 🙂\n\t[EOS]'
    assert b"".join(table[i] for i in kimi.encode(text)) == text.encode()


# ------------------------------------------------------------------------------------------------
# schemas
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
scalars = st.one_of(
    st.just({"type": "string"}),
    st.integers(0, 12).map(lambda n: {"type": "string", "maxLength": n}),
    st.just({"type": "integer"}),
    st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.lists(st.text(alphabet='ab é"\\/\n中', max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda v: {"enum": v}),
    st.lists(st.integers(-9, 99), min_size=1, max_size=3, unique=True).map(lambda v: {"type": "integer", "enum": v}),
)


@st.composite
def objects(draw, values) -> dict:
    props = draw(st.dictionaries(names, values, min_size=1, max_size=4))
    required = [k for k in props if draw(st.booleans())]
    schema = {"type": "object", "properties": props, "required": required}
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


def containers(children):
    arrays = st.tuples(children, st.none() | st.integers(1, 3)).map(
        lambda t: {"type": "array", "items": t[0]} | ({"maxItems": t[1]} if t[1] else {}))
    return arrays | objects(children)


schemas = objects(st.recursive(scalars, containers, max_leaves=6))


@SETTINGS
@given(schema=schemas, seed=st.integers(0, 2**16))
def test_random_logits_always_give_valid_json(tok, schema, seed):
    text, steps = generate(tok, json_constraint(tok, schema, [tok.eos_id]), seed)
    jsonschema.validate(json.loads(text), schema)
    assert steps < MAX_STEPS


@pytest.mark.parametrize("seed", range(8))
def test_json_object_mode(tok, seed):
    text, _ = generate(tok, json_constraint(tok, None, [tok.eos_id]), seed)
    assert isinstance(json.loads(text), dict)


def test_whitespace_loving_model_terminates_with_bounded_gaps(tok):
    """Whitespace tokens get +30: every gap still holds at most MAX_WHITESPACE characters and the value completes."""
    blank = torch.tensor([b != b"" and not b.strip(b" \t\r\n") for b in tok.token_bytes()])
    assert blank.any()
    inner = {"type": "object", "properties": {"b": {"type": "boolean"}, "e": {"enum": ["x", "y"]}},
             "required": ["b", "e"], "additionalProperties": False}  # no free string: spaces there are content
    schema = {"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
                                               "o": inner}, "required": ["n", "o"], "additionalProperties": False}
    factory = json_constraint(tok, schema, [tok.eos_id])
    for seed in range(4):
        text, steps = generate(tok, factory, seed, bias=30.0 * blank)
        jsonschema.validate(json.loads(text), schema)
        gaps = re.findall(r"[ \t\r\n]+", text)  # no string here can hold whitespace, so these are all gaps
        assert gaps and max(map(len, gaps)) <= MAX_WHITESPACE
        assert steps < 40 * MAX_WHITESPACE


# ------------------------------------------------------------------------------------------------
# stop tokens and rejections
def test_stop_tokens_and_rejections():
    tok = bpe_tokenizer()
    end = tok.special_id("end")
    c = json_constraint(tok, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                              "additionalProperties": False}, [end])()
    with pytest.raises(ValueError, match="stop token"):
        c.accept(end)
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(tok.encode("[")[0])
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(len(tok) + 3)
    for token in tok.encode('{"a": 12 }'):
        assert not c.done()
        logits = torch.zeros(len(tok))
        c.mask_(logits)
        assert logits[token] == 0  # the canonical tokenisation is allowed, after a rejected token too
        c.accept(token)
    assert c.done()
    logits = torch.zeros(len(tok) + EXTRA)
    c.mask_(logits)
    assert logits.isfinite().nonzero().flatten().tolist() == [end]  # not the tokenizer's own EOS
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(tok.eos_id)
    c.accept(end)
    assert c.done()
    with pytest.raises(ValueError, match="after a stop token"):
        c.accept(end)


def test_mask_rows_and_dtypes():
    """A row of a batch is masked in place, others untouched; bf16 logits (the torch path) get the same mask."""
    tok = bpe_tokenizer()
    factory = json_constraint(tok, {"type": "object", "properties": {"s": {"type": "string"}}}, [tok.eos_id])
    c = factory()
    for token in tok.encode('{"s": "ab'):
        c.accept(token)
    batch = torch.randn(3, len(tok) + EXTRA)
    before = batch.clone()
    c.mask_(batch[1])
    assert torch.equal(batch[0], before[0]) and torch.equal(batch[2], before[2])
    allowed = batch[1].isfinite()
    assert 0 < int(allowed.sum()) < len(tok) and not allowed[len(tok):].any()
    half = before[1].to(torch.bfloat16)
    c.mask_(half)
    assert torch.equal(half.isfinite(), allowed)


def test_extendable_value_stops_on_stop_token():
    """A top-level integer is complete after a digit but may grow: stop tokens and digits are both allowed."""
    tok = bpe_tokenizer()
    c = json_constraint(tok, {"type": "integer"}, [tok.eos_id])()
    c.accept(tok.encode("7")[0])
    logits = torch.zeros(len(tok))
    c.mask_(logits)
    assert logits[tok.eos_id] == 0 and logits[tok.encode("3")[0]] == 0 and not c.done()
    c.accept(tok.eos_id)
    assert c.done()


@pytest.mark.parametrize("schema, message", [
    ({"type": "foo"}, "foo"),
    ({"type": "object", "properties": 3}, "properties"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "pattern": "(("}, "regex"),
    ({"type": "integer", "minimum": "a"}, "minimum"),
    ({"type": "object", "if": {"type": "object"}}, "if"),
    ({"allOf": [{"type": "integer"}, {"type": "string"}]}, "Unsatisfiable"),
    ([{"type": "object"}], "must be an object"),
    ({"type": "number", "maximum": float("nan")}, "not serialisable"),
])
def test_invalid_schema_raises_value_error(schema, message):
    with pytest.raises(ValueError, match=message):
        json_constraint(bpe_tokenizer(), schema, [2])


@pytest.mark.parametrize("stop_ids", [[], [10**6], [-1]])
def test_bad_stop_ids(stop_ids):
    with pytest.raises(ValueError, match="stop_ids"):
        json_constraint(bpe_tokenizer(), None, stop_ids)


def test_x_guidance_cannot_lift_whitespace_bound():
    tok = bpe_tokenizer()
    schema = {"type": "object", "x-guidance": {"whitespace_pattern": "[ ]*", "lenient": True}}
    c = json_constraint(tok, schema, [tok.eos_id])()
    for token in tok.encode("{" + " " * MAX_WHITESPACE):
        c.accept(token)
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(tok.encode(" ")[0])


# ------------------------------------------------------------------------------------------------
# caching and threads
def test_compile_cache():
    tok = bpe_tokenizer()
    grammars = Grammars(tok, max_entries=4)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}
    assert grammars.cached(schema, [tok.eos_id]) is None
    grammars.constraint(schema, [tok.eos_id])
    held = grammars.bytes
    assert held > 0
    assert grammars.cached(json.loads(json.dumps(schema)), [tok.eos_id, 10]) is not None  # equal schema, other stops
    reordered = {"type": "object", "properties": {"y": {"type": "string"}, "x": {"type": "integer"}}}
    assert grammars.cached(reordered, [tok.eos_id]) is None  # property order is generation order: its own entry
    for n in range(5):  # the count bound: least recently used first out
        grammars.constraint({"type": "array", "maxItems": n}, [tok.eos_id])
    assert grammars.cached(schema, [tok.eos_id]) is None
    assert [grammars.cached({"type": "array", "maxItems": n}, [tok.eos_id]) is not None for n in range(5)] == \
        [False, True, True, True, True]
    grammars.close()


def test_cache_is_bounded_by_bytes():
    """Entries are charged the bytes their compiled grammar holds (measured in the compile child); past the budget
    the least recently used go, and a grammar larger than the whole budget serves its request without being kept."""
    tok = bpe_tokenizer()
    probe = Grammars(tok)
    wide = [{"anyOf": [{"type": "object", "properties": {f"k{i}_{v}": {"type": "integer"}}, "required": [f"k{i}_{v}"]}
                       for i in range(40)]} for v in range(4)]
    probe.constraint(wide[0], [tok.eos_id])
    size = probe.bytes
    probe.close()
    grammars = Grammars(tok, cache_bytes=int(2.5 * size))
    for schema in wide:
        grammars.constraint(schema, [tok.eos_id])
        assert grammars.bytes <= grammars.cache_bytes
    assert [grammars.cached(s, [tok.eos_id]) is not None for s in wide] == [False, False, True, True]
    tiny = Grammars(tok, cache_bytes=size // 2)
    text, _ = generate(tok, tiny.constraint(wide[0], [tok.eos_id]), seed=0)
    jsonschema.validate(json.loads(text), wide[0])
    assert tiny.cached(wide[0], [tok.eos_id]) is None and tiny.bytes == 0
    grammars.close()
    tiny.close()


def test_matchers_are_independent():
    tok = bpe_tokenizer()
    factory = json_constraint(tok, None, [tok.eos_id])
    first, second = factory(), factory()
    for token in tok.encode('{"a": 1}'):
        first.accept(token)
    assert first.done() and not second.done()
    logits = torch.zeros(len(tok))
    second.mask_(logits)
    assert logits.isfinite().nonzero().flatten().tolist() == tok.encode("{")


def test_threads_compile_and_generate(tok):
    schemas_ = [{"type": "object", "properties": {"k": {"type": "integer", "minimum": i}}, "required": ["k"]}
                for i in range(3)]
    barrier, results, errors = threading.Barrier(2), {}, []

    def work(worker: int) -> None:
        try:
            barrier.wait()
            for round_ in range(6):
                schema = schemas_[(worker + round_) % len(schemas_)]
                text, _ = generate(tok, json_constraint(tok, schema, [tok.eos_id]), seed=10 * worker + round_)
                jsonschema.validate(json.loads(text), schema)
                results[worker, round_] = text
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 12
