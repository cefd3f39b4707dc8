"""K3ForCausalLM and DecoderState: one function whether run whole, chunked or token by token (SPEC §1–4)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.overrides import TorchFunctionMode

from k3 import K3ForCausalLM
from k3.config import PUBLISHED_TOTAL, AttnResConfig, K3Config, preset
from k3.sizing.params import parameter_breakdown
from k3.sizing import memory
from k3.model.state import DecoderState


def every_path() -> K3Config:
    """Dense + MoE, KDA (both gates appear across configs) + MLA, several AttnRes blocks and a partial one."""
    c = preset("tiny")
    c.num_layers = 7  # MLA at layers 4 and 7
    c.attn_res = AttnResConfig(block_size=3)  # 2 complete blocks + a partial of 1
    c.moe = dataclasses.replace(c.moe, first_k_dense=2, num_shared_experts=2)
    c.mla = dataclasses.replace(c.mla, q_lora_rank=None)
    c.kda = dataclasses.replace(c.kda, output_gate_rank=8)
    return c.validate()


def plain_residual() -> K3Config:
    c = preset("tiny")
    c.attn_res = AttnResConfig(enabled=False)
    c.kda = dataclasses.replace(c.kda, gate="softplus")
    c.moe = dataclasses.replace(c.moe, activation="swiglu", latent_dim=None, routed_scaling_factor=2.0)
    c.mla = dataclasses.replace(c.mla, output_gate=False)
    return c.validate()


CONFIGS = {"tiny": lambda: preset("tiny"), "every-path": every_path, "plain-residual": plain_residual}


def model(name: str, dtype=torch.float32, seed=0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    m = K3ForCausalLM(CONFIGS[name]()).to(dtype)
    with torch.no_grad():  # non-zero pseudo-queries so the depth softmax is not uniform
        for n, p in m.named_parameters():
            if n.endswith("_query"):
                p.normal_(0, 0.5)
    return m.eval()


def assert_same_state(a: DecoderState, b: DecoderState, **tol):
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys() and a.position == b.position
    for name in ta:
        torch.testing.assert_close(ta[name], tb[name], **tol, msg=name)


# fp32: the order of float sums differs between one call and token by token (GEMM against GEMV), and with the CPU's
# kernels; 7 layers deep an MLA latent of magnitude ~3 drifts by up to 1.1e-4 on some CPUs. fp64 holds the exactness.
TOL = {torch.float32: dict(atol=2e-4, rtol=1e-4), torch.float64: dict(atol=1e-9, rtol=1e-9)}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_by_token_and_chunked_prefill_equal_one_call(name, dtype):
    m = model(name, dtype)
    ids = torch.randint(0, 256, (2, 23))
    with torch.no_grad():
        logits, state = m(ids, state=m.new_state(2))
        stateless, none = m(ids)
        assert none is None
        torch.testing.assert_close(stateless, logits, **TOL[dtype])
        steps, s = [], m.new_state(2)
        for t in range(ids.shape[1]):
            out, s = m(ids[:, t : t + 1], state=s)
            steps.append(out)
        torch.testing.assert_close(torch.cat(steps, 1), logits, **TOL[dtype])
        assert_same_state(s, state, **TOL[dtype])
        chunks, s = [], m.new_state(2)
        for part in ids.split(5, dim=1):
            out, s = m(part, state=s)
            chunks.append(out)
        torch.testing.assert_close(torch.cat(chunks, 1), logits, **TOL[dtype])
        assert_same_state(s, state, **TOL[dtype])


@settings(max_examples=10, deadline=None)
@given(name=st.sampled_from(list(CONFIGS)), T=st.integers(2, 30), data=st.data())
def test_any_split_carries_the_state(name, T, data):
    m = model(name, torch.float64)
    split = data.draw(st.integers(1, T - 1), label="split")
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        logits, state = m(ids, state=m.new_state(1))
        a, s = m(ids[:, :split], state=m.new_state(1))
        b, s = m(ids[:, split:], state=s)
    torch.testing.assert_close(torch.cat([a, b], 1), logits, **TOL[torch.float64])
    assert_same_state(s, state, **TOL[torch.float64])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_causality(name):
    m = model(name, torch.float64)
    ids = torch.randint(0, 256, (2, 30))
    changed = ids.clone()
    changed[:, 17:] = torch.randint(0, 256, (2, 13))
    with torch.no_grad():
        a, _ = m(ids)
        b, _ = m(changed)
    torch.testing.assert_close(a[:, :17], b[:, :17], atol=1e-12, rtol=1e-12)
    assert not torch.allclose(a[:, 17:], b[:, 17:])


def test_gradcheck_tiny_fp64_model():
    c = preset("tiny")
    c.hidden_size, c.vision.out_dim, c.vocab_size = 32, 32, 16
    torch.manual_seed(0)
    m = K3ForCausalLM(c.validate()).double()
    x = torch.randn(1, 5, 32, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda e: m(inputs_embeds=e)[0], (x,), eps=1e-6, atol=1e-5)


def test_a_training_step_reduces_the_loss():
    torch.manual_seed(0)
    m = K3ForCausalLM(preset("tiny"))
    ids = torch.randint(0, 256, (4, 32))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        logits, _ = m(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    # every text parameter learns; a text-only step leaves the vision encoder and projector untouched
    assert all((p.grad is None) == name.startswith("vision.") for name, p in m.named_parameters())


def test_narrow_93_layer_model_ends_with_nine_depth_sources():
    c = K3Config(vocab_size=32, hidden_size=16, num_layers=93, context_length=64)
    c.kda = dataclasses.replace(c.kda, num_heads=1, head_dim=16, value_head_dim=16, decay_rank=4, chunk_size=16)
    c.mla = dataclasses.replace(c.mla, num_heads=1, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                                qk_shared_head_dim=4, v_head_dim=4)
    c.moe = dataclasses.replace(c.moe, num_experts=2, num_experts_per_token=1, num_shared_experts=1,
                                expert_hidden=32, shared_hidden=32, latent_dim=None, dense_hidden=32)
    c.vision = dataclasses.replace(c.vision, enabled=False, out_dim=16)
    c.mx = dataclasses.replace(c.mx, enabled=False)
    m = K3ForCausalLM(c.validate())
    with torch.no_grad():
        _, state = m(torch.randint(0, 32, (1, 3)), state=m.new_state(1))
    assert c.depth_sources() == 9 and state.depth.shape == (1, 9, 16)  # 7 complete + 1 partial + embedding


def test_paper_preset_on_meta_matches_the_analytic_count():
    c = preset("paper")
    with torch.device("meta"):
        m = K3ForCausalLM(c)
    parts = parameter_breakdown(c)
    assert sum(p.numel() for p in m.parameters()) == parts["total"][0]
    vision = sum(p.numel() for p in m.vision.vision_tower.parameters())
    assert vision == parts["vision encoder"][0] == 401_214_464  # SPEC §6: ≈401M
    assert sum(p.numel() for p in m.vision.mm_projector.parameters()) == parts["vision projector"][0]
    for name in ("tiny", "small"):
        c = preset(name)
        assert sum(p.numel() for p in K3ForCausalLM(c).parameters()) == parameter_breakdown(c)["total"][0]


# ---------------------------------------------------------------------- memory
@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="free CPU memory is read from /proc/meminfo")
def test_a_model_too_big_for_memory_is_refused_before_anything_is_allocated():
    class NoTensors(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.device:  # naming a device allocates nothing
                return func(*args, **(kwargs or {}))
            raise AssertionError(f"allocated before the memory check: {func}")

    with NoTensors(), pytest.raises(ValueError) as err:
        K3ForCausalLM(preset("paper"))
    found = re.fullmatch(r"model needs ([\d.]+) GiB for its parameters, only [\d.]+ (GiB|MiB) available on cpu",
                         str(err.value))
    assert found, str(err.value)
    assert float(found.group(1)) == pytest.approx(PUBLISHED_TOTAL * 4 / 2**30, rel=0.02)  # float32 weights


def test_training_must_also_fit_gradients_and_optimizer_state(monkeypatch, tmp_path):
    from k3.train.pretrain import Run, TrainConfig

    weights = sum(p.numel() * p.element_size() for p in K3ForCausalLM(preset("tiny")).parameters())
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2 * weights)
    K3ForCausalLM(preset("tiny"))  # the weights alone fit
    with pytest.raises(ValueError, match=re.escape(
            f"model needs {4 * weights / 2**20:.1f} MiB for training (4 × its parameters: weights, gradients, "
            f"two optimizer moments), only {2 * weights / 2**20:.1f} MiB available on cpu")):
        Run(TrainConfig(out=str(tmp_path), preset="tiny"))


def test_cuda_memory_is_read_from_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 2**31))
    memory.check_fits(preset("small"), "cuda")
    with pytest.raises(ValueError, match=r"GiB for its parameters, only 1\.0 GiB available on cuda$"):
        memory.check_fits(preset("paper"), "cuda")


def test_a_model_beyond_the_parameter_bound_is_refused_on_any_device():
    huge = preset("paper")
    huge.num_layers, huge.moe.num_experts, huge.moe.expert_hidden = 1024, 2**16, 2**18  # each size within its limit
    with pytest.raises(ValueError, match=r"model has [\d,]+ parameters, more than the 70,368,744,177,664 "
                                         r"\(k3\.sizing\.memory\.MAX_PARAMETERS\)"):
        with torch.device("meta"):  # where the memory check is skipped: nothing would be allocated, but built
            K3ForCausalLM(huge.validate())
    memory.check_fits(preset("paper"), "meta")  # 2.78T: inside


# ---------------------------------------------------------------------- DecoderState
def test_state_clone_select_save_load(tmp_path):
    m = model("every-path")
    ids = torch.randint(0, 256, (3, 9))
    with torch.no_grad():
        _, state = m(ids, state=m.new_state(3))
        copy = state.clone()
        next_ids = torch.randint(0, 256, (3, 4))
        out, advanced = m(next_ids, state=state)
        assert_same_state(state, copy, atol=0, rtol=0)  # forward never modifies its input state
        # Selecting rows of the state is the same as having run only those rows.
        rows = [2, 0]
        out_rows, _ = m(next_ids[rows], state=state.select(rows))
        torch.testing.assert_close(out_rows, out[rows], atol=1e-5, rtol=1e-5)
    path = tmp_path / "state.safetensors"
    state.save(path)
    loaded = DecoderState.load(path)
    assert_same_state(loaded, state, atol=0, rtol=0)
    assert not (tmp_path / "state.safetensors.tmp").exists()


def test_corrupt_state_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "state.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="state.safetensors"):
        DecoderState.load(path)


@pytest.mark.parametrize("kwargs, message", [
    ({"input_ids": torch.tensor([[0, 512]])}, "input_ids: token ids must lie in"),
    ({"input_ids": torch.tensor([1, 2])}, "input_ids: expected an integer tensor"),
    ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, "empty"),
    ({"inputs_embeds": torch.zeros(1, 2, 3)}, "inputs_embeds: expected a float tensor"),
    ({}, "exactly one of input_ids or inputs_embeds"),
])
def test_bad_input_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        model("tiny")(**kwargs)


def test_state_batch_mismatch_is_an_error():
    m = model("tiny")
    with pytest.raises(ValueError, match="state: expected 4 layers and batch size 2"):
        m(torch.zeros(2, 3, dtype=torch.long), state=m.new_state(1))


@pytest.mark.parametrize("name", ["every-path", "plain-residual"])
@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4), steps=st.integers(1, 3),
       chunk=st.integers(1, 3))
def test_stacked_states_of_unequal_lengths_continue_like_each_alone(name, lengths, steps, chunk):
    """Left-padded batching (`stack`/`unstack`) = running each sequence alone, for decode and for chunks."""
    m = model(name, torch.float64)
    gen = torch.Generator().manual_seed(sum(lengths))
    with torch.no_grad():
        alone = [m(torch.randint(0, 256, (1, n), generator=gen), state=m.new_state(1))[1] for n in lengths]
        batched = alone
        for _ in range(steps):
            ids = torch.randint(0, 256, (len(lengths), chunk), generator=gen)
            logits, stacked = m(ids, state=DecoderState.stack(batched))
            assert stacked.position == max(s.position for s in batched) + chunk
            batched = stacked.unstack()
            for b, state in enumerate(alone):
                ref, alone[b] = m(ids[b:b + 1], state=state)
                torch.testing.assert_close(logits[b:b + 1], ref, **TOL[torch.float64])
    for a, b in zip(alone, batched):
        assert_same_state(a, b, **TOL[torch.float64])


def test_stacked_state_saves_its_padding(tmp_path):
    m = model("every-path")
    with torch.no_grad():
        states = [m(torch.randint(0, 256, (1, n)), state=m.new_state(1))[1] for n in (2, 5)]
    stacked = DecoderState.stack(states)
    assert stacked.padding.tolist() == [3, 0]
    stacked.save(tmp_path / "s.safetensors")
    assert_same_state(DecoderState.load(tmp_path / "s.safetensors"), stacked, atol=0, rtol=0)
    with pytest.raises(ValueError, match="padding: expected int64"):
        m.layers[3].mixer(torch.zeros(1, 1, 64), states[0].layers[3], padding=torch.tensor([9]))


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=6, deadline=None)
@given(groups=st.lists(st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.integers(1, 5)),
                       min_size=1, max_size=3))
def test_forward_groups_equals_forward_per_group(name, groups):
    """Decode rows and prefill chunks in one pass = each group through `forward` (logits of last positions)."""
    m = model(name, torch.float64)
    gen = torch.Generator().manual_seed(len(groups))
    with torch.no_grad():
        inputs = []
        for lengths, T in groups:
            state = DecoderState.stack([m(torch.randint(0, 256, (1, n), generator=gen), state=m.new_state(1))[1]
                                        for n in lengths])
            inputs.append((torch.randint(0, 256, (len(lengths), T), generator=gen), state))
        for (ids, state), (logits, new_state) in zip(inputs, m.forward_groups(inputs), strict=True):
            ref_logits, ref_state = m(ids, state=state)
            torch.testing.assert_close(logits, ref_logits[:, -1], **TOL[torch.float64])
            assert_same_state(new_state, ref_state, **TOL[torch.float64])


def decode(m: K3ForCausalLM, state: DecoderState, tokens: list[int]) -> tuple[Tensor, list[DecoderState]]:
    """Sequential decoding: ``tokens`` one `forward` call each; the logits ``[len(tokens), V]`` and the state after
    each token."""
    logits, states = [], []
    for token in tokens:
        out, state = m(torch.tensor([[token]]), state=state)
        logits.append(out[0, -1])
        states.append(state)
    return torch.stack(logits), states


@pytest.mark.parametrize("name", ["every-path", "plain-residual"])
@settings(max_examples=4, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 4)), min_size=2, max_size=3))
def test_stacked_verification_accepts_each_row_like_a_batch_1_verification(name, rows):
    """Rows of unequal context and run lengths verified as one replay group (SPEC §8; runs right-padded with
    random tokens), split by `unstack`: each row's logits and ``accept(n)`` states, for every n, equal the row
    verified alone in a batch-1 group and sequential decoding of its first n tokens; an accepted state continues
    like the sequentially decoded one."""
    m = model(name, torch.float64)
    gen = torch.Generator().manual_seed(sum(c * 7 + r for c, r in rows))
    width = max(r for _, r in rows)
    with torch.no_grad():
        states = [m(torch.randint(0, 256, (1, c), generator=gen), state=m.new_state(1))[1] for c, _ in rows]
        runs = [torch.randint(0, 256, (r,), generator=gen).tolist() for _, r in rows]
        ids = torch.randint(0, 256, (len(rows), width), generator=gen)  # the padding: random tokens
        for b, run in enumerate(runs):
            ids[b, :len(run)] = torch.tensor(run)
        other = (torch.randint(0, 256, (1, 3), generator=gen), states[0])  # a group before, to offset the run's tokens
        (_, _), (logits, stacked) = m.forward_groups([other, (ids, DecoderState.stack(states))], full=[False, True],
                                                     replay=[False, True])
        assert logits.shape == (len(rows) * width, m.config.vocab_size)
        for b, (state, run, row) in enumerate(zip(states, runs, stacked.unstack(), strict=True)):
            [(alone_logits, alone)] = m.forward_groups([(torch.tensor([run]), state)], full=[True], replay=[True])
            want_logits, wanted = decode(m, state, run)
            got = logits[b * width:b * width + len(run)]
            torch.testing.assert_close(got, want_logits, **TOL[torch.float64])
            torch.testing.assert_close(got, alone_logits, **TOL[torch.float64])
            token = torch.tensor([[run[0]]])
            for n, want in enumerate(wanted, 1):
                accepted = row.accept(n)
                assert accepted.replay is None and accepted.padding is None
                assert_same_state(accepted, want, **TOL[torch.float64])
                assert_same_state(accepted, alone.accept(n), **TOL[torch.float64])
                torch.testing.assert_close(m(token, state=accepted)[0], m(token, state=want)[0], **TOL[torch.float64])
