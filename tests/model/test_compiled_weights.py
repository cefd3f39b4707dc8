"""Compiled steps whose weights are not plain floats or stay fixed (`k3.model.compiled`, issues 18 and 37): frozen
(tuned) weights that change in place or are replaced must rebuild their graph, and packed MXFP4 experts run in
compiled, tuned and precompiled steps with eager's tokens and logits (`compiled_steps.LOGIT_TOLERANCE`). Apart from
`test_compiled.py` so the two halves of the compiled tests run on different test workers."""

from __future__ import annotations

import pytest
import torch

import serving
from compiled_steps import LOGIT_TOLERANCE, generate_both
from k3 import K3ForCausalLM
from k3.config import preset
from k3.model import onednn
from k3.model.compiled import CompiledModel


def test_tuned_decode_equals_eager_and_recompiles_when_the_frozen_weights_change():
    """Freezing makes the weights constants of the graph: an in-place update must not leave a stale graph."""
    model = serving.model()
    compiled = CompiledModel(model, sizes=(4, 1))
    prompt = torch.tensor([serving.prompts()[2][:8]])
    eager, fast, worst = generate_both(model, compiled, prompt, steps=5)
    assert fast == eager and worst < LOGIT_TOLERANCE
    assert compiled.decode_step.compilations == 1
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # every greedy choice changes
    eager_after, fast_after, worst = generate_both(model, compiled, prompt, steps=5)
    assert fast_after == eager_after != eager and worst < LOGIT_TOLERANCE
    assert compiled.decode_step.compilations == 2  # the frozen graph, built again once
    model.lm_head.weight = torch.nn.Parameter(-model.lm_head.weight.detach())  # a new tensor assigned, as it was
    eager_new, fast_new, worst = generate_both(model, compiled, prompt, steps=5)
    assert fast_new == eager_new == eager and worst < LOGIT_TOLERANCE
    assert compiled.decode_step.compilations == 3


@pytest.mark.slow
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_compiled_steps_of_a_packed_model_equal_eager_and_compile_nothing_after_warm_up(mode):
    """Packed MXFP4 experts (the release's layout) in a compiled step: each layer of them is one operator of the
    graph (`k3::mxfp4_experts`), so a step is one graph (before: the dispatch ran eagerly between graph pieces, one
    more piece per MoE layer), and steps whose routings differ reuse the warm graphs (before that: each new routing
    needed a graph, and "Recompilation triggered with skip_guard_eval_unsafe stance" ended the loop), under no_grad
    and inference_mode alike, the `CompiledModel` made inside the mode too (issue 37; before, stacking the experts'
    bytes there made inference tensors, whose versions its weight check cannot read)."""
    from torch._dynamo.utils import counters

    from k3.model.packed import PackedExperts, replace_experts

    counters.clear()
    torch.manual_seed(0)
    model = replace_experts(K3ForCausalLM(preset("tiny")).eval(), PackedExperts.pack)
    compiled, built = None, []
    for prompt in ([5, 9, 3, 7, 11, 2, 8, 4], [40, 1, 77, 30, 6, 6, 19, 23]):  # the second: other routings
        with mode():
            compiled = compiled or CompiledModel(model, sizes=(4, 1), tuned=False)
            logits, state = compiled(torch.tensor([prompt]), model.new_state(1))
            eager_logits, eager = model(torch.tensor([prompt]), state=model.new_state(1))
            for _ in range(12):
                assert float((logits - eager_logits[:, -1:]).abs().max()) < LOGIT_TOLERANCE
                token = logits[:, -1].argmax(-1, keepdim=True)
                assert token.equal(eager_logits[:, -1].argmax(-1, keepdim=True))
                logits, state = compiled(token, state)
                eager_logits, eager = model(token, state=eager)
        built.append(compiled.compilations)
    assert built[1] == built[0] > 0
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.slow
def test_a_tuned_packed_step_follows_expert_bytes_written_in_place_and_weights_loaded():
    """Tuned graphs freeze the packed experts' stacked bytes. A write through one expert's own tensor (a view of the
    stack) must rebuild them, and so must a state dict loaded with ``assign``, which the experts stack anew (before:
    the graph kept the stack made at compile time and gave the old model's logits)."""
    from k3.model.packed import PackedExperts, replace_experts

    torch.manual_seed(0)
    model, other = (replace_experts(K3ForCausalLM(preset("tiny")).eval(), PackedExperts.pack) for _ in range(2))
    compiled = CompiledModel(model, sizes=(4, 1))
    prompt = torch.tensor([[5, 9, 3, 7, 11, 2, 8, 4]])
    before, fast, worst = generate_both(model, compiled, prompt, steps=4)
    assert fast == before and worst < LOGIT_TOLERANCE
    built = compiled.decode_step.compilations
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, PackedExperts):
                for expert in module.packed:
                    expert.w2.weight_scale.add_(2)  # every down projection × 4, in place
    eager, fast, worst = generate_both(model, compiled, prompt, steps=4)
    assert fast == eager and worst < LOGIT_TOLERANCE
    assert compiled.decode_step.compilations == built + 1
    with torch.no_grad():
        model.load_state_dict(other.state_dict(), assign=True)
        assert torch.equal(model(prompt)[0], other(prompt)[0])
    eager, fast, worst = generate_both(model, compiled, prompt, steps=4)
    assert fast == eager and worst < LOGIT_TOLERANCE


@pytest.mark.slow
def test_a_packed_model_is_precompiled_and_a_second_model_loads_its_graphs(tmp_path, monkeypatch):
    """Precompiled steps of a packed MXFP4 model (before: refused, its dispatch broke the graph): compiled and saved
    once, loaded by a second `CompiledModel` without compiling; both give eager's logits and tokens, and the loaded
    graphs take their products by weights through oneDNN (``k3::linear``) and their experts through the kernel."""
    from k3.model.packed import PackedExperts, replace_experts

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(onednn, "MIN_ELEMENTS", 0)  # every product by a weight through oneDNN: none is 2^20 here
    torch.manual_seed(0)
    model = replace_experts(K3ForCausalLM(preset("tiny")).eval(), PackedExperts.pack)
    prompt = torch.tensor([[5, 9, 3, 7, 11, 2, 8, 4, 40, 1, 77]])
    for loads in (0, 3):
        compiled = CompiledModel(model, batches=(1,), sizes=(4, 1))
        compiled.precompile(compiled.families(1, prefill=True))
        assert (compiled.compilations, compiled.cache_hits) == (3, loads)  # the decode step, the 4-piece on 2 sides
        with torch.inference_mode():
            eager, fast, worst = generate_both(model, compiled, prompt, steps=4)
        assert fast == eager and worst < LOGIT_TOLERANCE
        assert compiled.eager_calls == 0 and compiled.graph_calls > 0
    assert len(list((tmp_path / "k3" / "graphs").rglob("*.pt2"))) == 3
    with torch.inference_mode(), torch.profiler.profile() as profile:  # the loaded graphs' products: oneDNN's
        compiled.step(prompt[:, -1:], model(prompt[:, :-1], state=model.new_state(1))[1])
    assert {"k3::linear", "k3::mxfp4_experts"} <= {event.key for event in profile.key_averages()}


