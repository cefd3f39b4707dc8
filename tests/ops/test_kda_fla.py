"""fla's Triton KDA kernels as the optional CUDA backend (`k3.ops.kda_fla`, issue 39 item 2).

On the CPU: the backend is never chosen and its setting is validated. On CUDA with fla (a lent GPU machine): fla's
prefill and decode kernels equal `k3.ops.kda`'s (itself held to the loop oracle) within `kda_fla.TOLERANCE`, in fp32
and bf16, from a zero and a given state; a whole model gives the same logits on either backend; a step that needs
gradients keeps our kernels; and the kernels trace whole into a compiled graph."""

from __future__ import annotations

import pytest
import torch

from k3.config import preset
from k3.model.lm import K3ForCausalLM
from k3.ops import kda, kda_fla

CUDA = torch.cuda.is_available()
needs_fla = pytest.mark.skipif(not (CUDA and kda_fla._available()), reason="needs CUDA and fla (a lent GPU machine)")


def inputs(T: int, dtype: torch.dtype, device: str = "cuda", B: int = 2, H: int = 3, K: int = 64, V: int = 32,
           seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Normalised q, k; log-decay g in the bounded gate's range (−5, 0); β in (0, 1); a state of unit scale."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    q, k = (kda.l2norm(rand(B, T, H, K)).to(dtype) for _ in range(2))
    v = rand(B, T, H, V).to(dtype)
    g = -5.0 * torch.sigmoid(rand(B, T, H, K))
    beta = torch.sigmoid(rand(B, T, H))
    return q, k, v, g, beta, rand(B, H, K, V)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def test_cpu_tensors_never_take_the_fla_path():
    q, k, v, *_ = inputs(4, torch.float32, "cpu")
    assert not kda_fla.enabled(q, v)


def test_the_backend_setting_is_validated(monkeypatch):
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    with pytest.raises(ValueError, match="K3_KDA_BACKEND"):
        kda_fla._available()
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    assert not kda_fla._available()


def test_an_fla_that_does_not_import_is_reported_only_when_asked_for(monkeypatch):
    monkeypatch.setattr(kda_fla, "_MODULE", {"kda": None, "error": "ModuleNotFoundError: No module named 'triton'"})
    monkeypatch.setenv("K3_KDA_BACKEND", "auto")
    assert not kda_fla._available()
    monkeypatch.setenv("K3_KDA_BACKEND", "fla")
    with pytest.raises(RuntimeError, match="triton"):
        kda_fla._available()


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 50, 300])
@pytest.mark.parametrize("with_state", [False, True])
def test_fla_prefill_equals_the_chunked_form(dtype, T, with_state):
    q, k, v, g, beta, state = inputs(T, dtype)
    initial = state if with_state else None
    o, final = kda_fla.chunked(q, k, v, g, beta, initial)
    o_ref, final_ref = kda.chunked(q, k, v, g, beta, initial_state=initial)
    assert o.dtype == v.dtype and final.dtype == torch.float32
    assert relative(o, o_ref) < kda_fla.TOLERANCE[dtype]
    assert relative(final, final_ref) < kda_fla.TOLERANCE[dtype]


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_decode_steps_equal_the_step_form(dtype):
    q, k, v, g, beta, state = inputs(8, dtype)
    given = state.clone()
    ours = theirs = state
    for t in range(8):
        o_ref, ours = kda.step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], ours)
        o, theirs = kda_fla.step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], theirs)
        assert relative(o, o_ref) < kda_fla.TOLERANCE[dtype]
    assert relative(theirs, ours) < kda_fla.TOLERANCE[dtype]
    assert torch.equal(state, given)  # the caller's state is not written in place (fla's kernel would)


@needs_fla
def test_a_step_that_needs_gradients_keeps_our_kernels():
    """Training stays on `k3.ops.kda` (fla's backward is not yet checked against ours): fla only for inference."""
    q, k, v, *_ = inputs(20, torch.float32)
    assert kda_fla.enabled(q, v)
    assert not kda_fla.enabled(q.requires_grad_(), v)
    with torch.no_grad():
        assert kda_fla.enabled(q, v)


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_gives_the_same_logits_on_either_backend(dtype, monkeypatch):
    torch.manual_seed(0)
    model = K3ForCausalLM(preset("tiny")).to("cuda", dtype).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 70), device="cuda")
    results = {}
    for backend in ("torch", "fla"):
        monkeypatch.setenv("K3_KDA_BACKEND", backend)
        with torch.no_grad():
            logits, state = model(ids[:, :64], state=model.new_state(2))
            steps = [model(ids[:, t:t + 1], state=state) for t in range(64, 70)]
        results[backend] = torch.cat([logits, *[s[0] for s in steps]], 1)
    assert relative(results["fla"], results["torch"]) < kda_fla.TOLERANCE[dtype]


@needs_fla
def test_the_fla_kernels_trace_whole_into_a_compiled_graph():
    from torch._dynamo.utils import counters

    counters.clear()
    q, k, v, g, beta, state = inputs(40, torch.bfloat16)

    def both(q, k, v, g, beta, state):
        o, final = kda_fla.chunked(q, k, v, g, beta, state)
        o1, final = kda_fla.step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], final)
        return o, o1, final

    with torch.no_grad():
        compiled = torch.compile(both, fullgraph=True)(q, k, v, g, beta, state)
        eager = both(q, k, v, g, beta, state)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    assert not counters["graph_break"]



def test_availability_traces_as_the_last_eager_answer_without_importing(monkeypatch):
    """Inside a compiled graph `_available` imports nothing and reads no environment: it is the last eager answer."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    assert not kda_fla._available()
    counters.clear()
    traced = torch.compile(lambda x: x + 1 if kda_fla._available() else x - 1, fullgraph=True, backend="eager")
    assert torch.equal(traced(torch.zeros(2)), -torch.ones(2)) and not counters["graph_break"]
