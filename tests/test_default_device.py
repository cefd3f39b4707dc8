"""Device-agnostic inference (issue 39): every tensor the engine and generation make follow the model's device.

With ``torch.set_default_device("meta")`` in effect and the model on the CPU, a tensor made without an explicit
device lands on ``meta`` and fails the step (reading a value, or mixing devices). Each feature below must give the
same tokens as the same engine run without the meta default — the CPU proof that a model on CUDA works.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch

from k3.generation import stream
from k3.model.compiled import CompiledModel
from k3.model.draft import DraftConfig, EagleDraft
from k3.model.packed import PackedExperts, replace_experts
from k3.serve.engine.cache import PrefixCache
from k3.serve.engine.core import Engine
from k3.serve.engine.drafting import EagleDrafter, ModelDrafter
from k3.serve.engine.ngram import NGramDrafter
from k3.serve.engine.sampling import SamplingParams
from tests import serving

PARAMS = [SamplingParams(max_tokens=10, temperature=0.0),
          SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=7, logprobs=3,
                         prompt_logprobs=2, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                         logit_bias=((3, 2.0),), min_tokens=2)]


@pytest.fixture(scope="module")
def model():
    return serving.model()


@pytest.fixture
def meta_default() -> Iterator[None]:
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def run(engine: Engine) -> list[tuple[list[int], str | None]]:
    """Each prompt (repeated, so n-gram drafts find matches; two of them share a head for the cache) under both
    sampling settings: the generated ids and the finish reason, with any error's text; then the drafted tokens and
    cache hits."""
    shared = serving.prompts()[5]
    prompts = [p + p for p in serving.prompts()[1:4]] + [shared + [7, 8], shared + [9]]
    out = []
    try:
        for prompt in prompts:
            for params in PARAMS:
                ids, finish = [], None
                for o in engine.generate(prompt, params):
                    ids += o.token_ids
                    finish = o.finish_reason if o.error is None else f"{o.finish_reason}: {o.error}"
                out.append((ids, finish))
    finally:
        engine.stop()
    cache = engine.prefix_cache
    return out + [(engine.speculator.counts["drafted"], None), (0 if cache is None else cache.stats.hits, None)]


ENGINES: dict[str, Callable[[object], dict]] = {
    "plain": lambda m: {},
    "prefix cache": lambda m: {"prefix_cache": PrefixCache(m.config.layer_kinds(), 2**26, 16, checkpoint_every=1)},
    "n-gram drafts": lambda m: {"drafter": NGramDrafter(min_n=1),
                                "adaptive_draft": False},
    "model drafts": lambda m: {"drafter": ModelDrafter(serving.model(seed=1)), "adaptive_draft": False},
    "compiled": lambda m: {"compile": CompiledModel(m, batches=(1, 2), sizes=(1, 16), tuned=False),
                           "prefill_chunk": 16},
    "eagle drafts": lambda m: {"drafter": EagleDrafter(EagleDraft(m, DraftConfig(layer_kind="mla"))),
                               "adaptive_draft": False},
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "compiled" else n for n in ENGINES])
def test_the_engine_makes_no_tensor_off_the_models_device(model, name, request) -> None:
    tok = serving.tokenizer()
    torch.manual_seed(0)
    expected = run(Engine(model, tok, **ENGINES[name](model)))
    assert all(finish in ("stop", "length") for _, finish in expected[:-2]), expected
    drafted, hits = expected[-2][0], expected[-1][0]
    assert drafted > 0 if "drafts" in name else drafted == 0
    assert hits > 0 if name == "prefix cache" else hits == 0
    torch.manual_seed(0)
    kwargs = ENGINES[name](model)
    request.getfixturevalue("meta_default")
    assert torch.empty(1).is_meta  # the trap is set
    engine = Engine(model, tok, **kwargs)  # compiled: its own graphs (the default-device mode is a guarded global)
    assert run(engine) == expected
    assert engine.compiled is None or engine.compiled.graph_calls > 0  # the graphs ran under the trap


def packed(model):
    """``model`` with its routed experts MXFP4-packed (a copy)."""
    out = copy.deepcopy(model)
    replace_experts(out, PackedExperts.pack)
    return out.eval()


@pytest.mark.parametrize("kind", ["float", "packed"])
def test_generate_makes_no_tensor_off_the_models_device(model, kind, request) -> None:
    """`k3.generation.stream` (what ``k3 generate`` runs), greedy and seeded sampling."""
    m = model if kind == "float" else packed(model)
    prompt = serving.prompts()[4]
    def both() -> list[list[int]]:
        return [list(stream(m, prompt, 12, temperature=0.0)), list(stream(m, prompt, 12, temperature=0.8, seed=3))]
    expected = both()
    request.getfixturevalue("meta_default")
    assert both() == expected


def test_the_engine_serves_packed_experts_off_no_other_device(model, request) -> None:
    m = packed(model)
    expected = run(Engine(m, serving.tokenizer()))
    request.getfixturevalue("meta_default")
    assert run(Engine(m, serving.tokenizer())) == expected


def test_structured_output_makes_no_tensor_off_the_models_device(model, request) -> None:
    """A JSON-schema grammar (`k3.serve.engine.structured`) masks every step's logits: greedy and sampled rows."""
    from k3.serve.engine.structured import Grammars

    tok = serving.tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammars = Grammars(tok)
    try:
        factory = grammars.constraint(schema, (tok.eos_id,))
        params = [SamplingParams(max_tokens=12, temperature=0.0, constraint=factory),
                  SamplingParams(max_tokens=12, temperature=0.9, seed=5, constraint=factory)]

        def both() -> list[list[int]]:
            engine = Engine(model, tok)
            try:
                return [[t for o in engine.generate(serving.prompts()[3], p) for t in o.token_ids] for p in params]
            finally:
                engine.stop()
        expected = both()
        assert all(expected)
        request.getfixturevalue("meta_default")
        assert both() == expected
    finally:
        grammars.close()


def test_images_through_the_engine_make_no_tensor_off_the_models_device(model, request) -> None:
    """An image request: the image processor's host tensors reach the vision tower on the model's device."""
    from PIL import Image

    from k3.tokenization.image import image_input

    tok = serving.tokenizer()
    picture = Image.new("RGB", (60, 40), (200, 30, 40))
    visual = image_input(picture, model.config.vision.patch_budget)
    prompt = [tok.bos_id] + [tok.special_id("media")] * visual.tokens + tok.encode("colour:")

    def generate() -> list[int]:
        engine = Engine(model, tok)
        try:
            return [t for o in engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0), images=[visual])
                    for t in o.token_ids]
        finally:
            engine.stop()
    expected = generate()
    request.getfixturevalue("meta_default")
    assert generate() == expected
