"""The decode roofline's byte and FLOP counts (`k3.sizing.roofline`, issue 18) against the real tensors of the model:
parameters built on ``meta``, states from `new_state` and a real decode call, and routing by simulation."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3 import K3ForCausalLM
from k3.config import preset
from k3.sizing.roofline import decode_cost, experts_touched
from k3.model.width import Experts


def _meta(name: str) -> K3ForCausalLM:
    with torch.device("meta"):
        return K3ForCausalLM(preset(name))


@pytest.mark.parametrize("name", ["tiny", "small", "paper"])
def test_weight_bytes_are_the_models_tensors(name):
    model, config = _meta(name), preset(name)
    experts = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
    vision = {id(p) for p in (model.vision.parameters() if model.vision is not None else [])}
    table = {id(model.embed_tokens.weight)}
    read = sum(p.numel() for p in model.parameters() if id(p) not in experts | vision | table)
    head = 0 if model.lm_head is not None else model.embed_tokens.weight.numel()  # a tied table is read as the head
    for batch in (1, 3):
        lookup = batch * config.hidden_size
        assert decode_cost(config, batch, 0, weight_bytes=2).weights == 2 * (read + head + lookup)
    routed = sum(p.numel() for p in model.parameters() if id(p) in experts)
    one = decode_cost(config, 1, 0, weight_bytes=1).experts  # one token: K of the E experts of every MoE layer
    assert one == pytest.approx(routed / config.moe.num_experts * config.moe.num_experts_per_token)
    assert decode_cost(config, 10**6, 0, weight_bytes=1).experts == pytest.approx(routed)  # many tokens: all


def test_state_and_cache_bytes_are_the_decoder_states_tensors():
    config = preset("tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(config).eval()
    batch, context = 2, 37
    with torch.no_grad():
        _, state = model(torch.randint(0, config.vocab_size, (batch, context)), state=model.new_state(batch))
    kda = sum(t.numel() * t.element_size() for s in state.layers if hasattr(s, "recurrent")
              for t in (s.recurrent, s.conv))
    mla = sum(t.numel() * t.element_size() for s in state.layers if hasattr(s, "latent")
              for t in (s.latent, s.shared_key))
    cost = decode_cost(config, batch, context, cache_bytes=4)
    assert cost.kda_state == 2 * kda  # read and written back
    assert cost.mla_cache == mla * (context + 1) / context  # the context read, the new entry written


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 64), st.integers(1, 8), st.integers(0, 40))
def test_experts_touched_bounds(e, k, tokens):
    k = min(k, e)
    touched = experts_touched(e, k, tokens)
    assert (0 if tokens == 0 else k) - 1e-9 <= touched <= min(e, k * tokens) + 1e-9
    assert experts_touched(e, k, tokens + 1) >= touched - 1e-12


def test_experts_touched_matches_uniform_routing_by_simulation():
    rng = random.Random(0)
    for e, k, tokens in ((8, 2, 3), (16, 2, 8), (64, 8, 5)):
        trials = [len({x for _ in range(tokens) for x in rng.sample(range(e), k)}) for _ in range(4000)]
        assert sum(trials) / len(trials) == pytest.approx(experts_touched(e, k, tokens), rel=0.02)


def test_flops_of_a_token_and_of_attention():
    config = preset("small")
    model = _meta("small")
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("vision.", "embed_tokens."))
                and not any(p is q for m in experts for q in m.parameters()))
    routed_active = sum(m.gate_up[0].numel() + m.down[0].numel() for m in experts) * config.moe.num_experts_per_token
    head = model.embed_tokens.weight.numel() if model.lm_head is None else 0
    k, m = config.kda, config.mla
    kinds = config.layer_kinds()
    recurrence = kinds.count("kda") * 7 * k.num_heads * k.head_dim * k.value_head_dim
    for context in (0, 100):
        attention = kinds.count("mla") * 2 * context * m.num_heads * (2 * m.kv_lora_rank + m.qk_shared_head_dim)
        assert decode_cost(config, 1, context).flops == 2 * (dense + routed_active + head) + attention + recurrence


def test_roofline_takes_the_larger_roof_and_refuses_bad_input():
    cost = decode_cost(preset("tiny"), 1, 10)
    assert cost.seconds(1e9, 1e18) == pytest.approx(cost.bytes / 1e9) and cost.bound(1e9, 1e18) == "memory"
    assert cost.seconds(1e18, 1e6) == pytest.approx(cost.flops / 1e6) and cost.bound(1e18, 1e6) == "compute"
    with pytest.raises(ValueError, match="batch"):
        decode_cost(preset("tiny"), 0, 10)
    with pytest.raises(ValueError, match="num_experts"):
        experts_touched(4, 5, 1)
