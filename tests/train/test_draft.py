"""The EAGLE-3 draft (SPEC §8): fusion init, stateful forward, propose, save/load, the training-time-test loss
against drafting as the server does, training and exact resume (issue 14, items 1–2; issue 38, item 5)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import serving
from k3.cli import main
from k3.config import preset
from k3.model.checkpoint import save_model
from k3.model.draft import DraftConfig, EagleDraft, default_feature_layers
from k3.model.lm import K3ForCausalLM
from k3.train.draft import DraftTrainConfig, target_outputs, top_tokens, train_draft, unroll, unroll_loss

D2T = torch.arange(0, 512, 3)  # a reduced vocabulary of 171 target ids


def perturbed(draft: EagleDraft, seed: int = 1) -> EagleDraft:
    """Move every weight off its init (the fusion's [0 0 I] included) so each piece of the draft matters."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return draft


def probabilities(row: torch.Tensor, params) -> torch.Tensor:
    """A minimal sampler: one-hot argmax at temperature 0, else softmax(row / temperature)."""
    if params.temperature == 0:
        return torch.nn.functional.one_hot(row.argmax(), row.shape[-1]).to(row.dtype)
    return (row / params.temperature).softmax(-1)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("target") / "ckpt", serving.model(), serving.tokenizer())


def test_default_feature_layers():
    tiny = preset("tiny")
    assert default_feature_layers(93) == (2, 46, 90)
    assert default_feature_layers(8) == (2, 4, 5)
    assert default_feature_layers(4) == (1, 2, 3)  # tiny: clamped inside [0, L)
    with pytest.raises(ValueError, match="feature_layers"):
        DraftConfig(feature_layers=(0, 1, 4)).resolved(tiny)
    with pytest.raises(ValueError, match="layer_kind"):
        DraftConfig(layer_kind="rnn").resolved(tiny)


def test_default_features_are_the_outputs_of_attnres_blocks_1_4_and_the_last():
    """The K3 report's feature points (issue 36): the paper's 93 layers in blocks of 12 end blocks 1, 4 and 8 at
    layers 11, 47 and 92; ``small`` (3 blocks of 3, 3, 2 layers) takes blocks 1, 2, 3; a target of two blocks
    falls back to EAGLE-3's layer inputs."""
    assert DraftConfig().resolved(preset("paper")) == DraftConfig((11, 47, 92), "mla", None, "blocks")
    small = preset("small")
    assert DraftConfig().resolved(small) == DraftConfig((2, 5, 7), "mla", None, "blocks")
    assert DraftConfig(feature_source="inputs").resolved(small).feature_layers == (2, 4, 5)
    tiny = preset("tiny")
    assert DraftConfig().resolved(tiny) == DraftConfig((1, 2, 3), "mla", None, "inputs")
    with pytest.raises(ValueError, match="feature_source = 'blocks' needs"):
        DraftConfig(feature_source="blocks").resolved(tiny)
    with pytest.raises(ValueError, match="end an AttnRes block"):
        DraftConfig((2, 4, 7), feature_source="blocks").resolved(small)
    with pytest.raises(ValueError, match="feature_source"):
        DraftConfig(feature_source="outputs").resolved(small)


def test_a_block_feature_is_the_sum_of_its_layers_outputs():
    """What "blocks" captures at a block's last layer is that block's output: the sum of its layers' sequence-mixer
    and FFN outputs (read here with forward hooks), the model's last, partial block included."""
    tiny = preset("tiny")
    config = replace(tiny, num_layers=7, attn_res=replace(tiny.attn_res, block_size=3))
    torch.manual_seed(0)
    target = K3ForCausalLM(config).eval()
    outputs: dict[int, torch.Tensor] = {}

    def keep(i):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            outputs[i] = outputs.get(i, 0) + out
        return hook

    hooks = [m.register_forward_hook(keep(i)) for i, layer in enumerate(target.layers) for m in (layer.mixer,
                                                                                               layer.ffn)]
    draft = EagleDraft(target)
    assert draft.config.feature_layers == (2, 5, 6) and draft.config.feature_source == "blocks"
    with torch.no_grad():
        features, _ = target_outputs(target, draft.config.feature_layers, torch.randint(0, 512, (2, 9)), "blocks")
    for hook in hooks:
        hook.remove()
    for feature, block in zip(features, [range(0, 3), range(3, 6), range(6, 7)], strict=True):
        torch.testing.assert_close(feature, sum(outputs[i] for i in block), rtol=1e-5, atol=1e-5)


def test_fusion_starts_as_the_high_feature(model):
    draft = EagleDraft(model)
    low, mid, high = (torch.randn(2, 5, 64) for _ in range(3))
    assert torch.equal(draft.fuse([low, mid, high]), high)
    with model.capture(list(draft.config.feature_layers)) as chosen:
        model(torch.randint(0, 512, (2, 7)))
        features = [layer.captured for layer in chosen]
    assert torch.equal(draft.fuse(features), features[2])
    # the shared modules are the target's own, not parameters of the draft
    assert not any(p is model.embed_tokens.weight or p is model.lm_head.weight for p in draft.parameters())


@pytest.mark.parametrize("kind", ["mla", "kda"])
def test_stateful_forward_equals_full_sequence(model, kind):
    draft = perturbed(EagleDraft(model, DraftConfig(layer_kind=kind, draft_vocab_size=len(D2T)), D2T))
    tokens, hidden = torch.randint(0, 512, (2, 21)), torch.randn(2, 21, 64)
    logits, out, none = draft(tokens, hidden)
    assert none is None and logits.shape == (2, 21, len(D2T))
    state, pieces = draft.new_state(2), []
    for a, b in ((0, 1), (1, 2), (2, 13), (13, 21)):  # token by token, then chunks
        lg, h, state = draft(tokens[:, a:b], hidden[:, a:b], state)
        pieces.append((lg, h))
    torch.testing.assert_close(torch.cat([p[0] for p in pieces], 1), logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([p[1] for p in pieces], 1), out, rtol=1e-4, atol=1e-5)
    full = draft.to_target(logits)
    assert full.shape == (2, 21, 512) and torch.equal(full[..., D2T], logits)
    assert bool(torch.isinf(full[..., 1]).all())  # id 1 is not in the draft vocabulary


def _state_tensors(state) -> list[torch.Tensor]:
    return [getattr(state, name) for name in state.__dataclass_fields__]


@pytest.mark.parametrize("kind", ["mla", "kda"])
def test_propose(model, kind):
    draft = perturbed(EagleDraft(model, DraftConfig(layer_kind=kind, draft_vocab_size=len(D2T)), D2T))
    prefix = torch.randint(0, 512, (1, 6))
    _, _, start = draft(prefix, torch.randn(1, 6, 64), draft.new_state(1))
    feature, token = torch.randn(64), 7
    greedy = SimpleNamespace(temperature=0.0)
    tokens, q, state = draft.propose(feature, token, start, 4, greedy, probabilities)
    # the same by hand: each step reads the previous step's token and output hidden state
    inputs, hiddens, h, current, expected = [token], [feature], feature.view(1, 1, 64), token, []
    s = start
    for _ in range(4):
        logits, h, s = draft(torch.tensor([[current]]), h, s)
        current = int(D2T[logits[0, -1].argmax()])
        expected.append(current)
        inputs.append(current)
        hiddens.append(h[0, 0])
    assert tokens == expected and q.shape == (4, 512)
    assert torch.equal(q.argmax(-1), torch.tensor(tokens)) and torch.equal(q.sum(-1), torch.ones(4))
    _, _, replayed = draft(torch.tensor([inputs[:4]]), torch.stack(hiddens[:4])[None], start)
    for a, b in zip(_state_tensors(state), _state_tensors(replayed)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    sampled = SimpleNamespace(temperature=1.0)
    runs = [draft.propose(feature, token, start, 5, sampled, probabilities, torch.Generator().manual_seed(3))
            for _ in range(2)]
    (tokens, q, _), (again, _, _) = runs
    assert tokens == again and all(t in set(D2T.tolist()) for t in tokens)
    torch.testing.assert_close(q.sum(-1), torch.ones(5))
    outside = torch.ones(512, dtype=torch.bool)
    outside[D2T] = False
    assert bool((q[:, outside] == 0).all())


@pytest.mark.parametrize("kind", ["mla", "kda"])
@pytest.mark.parametrize("d2t", [None, D2T])
def test_the_greedy_chain_drafts_what_greedy_proposals_draft(model, kind, d2t):
    """`EagleDraft.greedy` (γ steps in one call, each pick fed on as a tensor) drafts `propose`'s greedy tokens, from
    an empty state and after a prefix, with and without a reduced vocabulary, and leaves the state as it was."""
    draft = perturbed(EagleDraft(model, DraftConfig(layer_kind=kind, draft_vocab_size=None if d2t is None
                                                    else len(d2t)), d2t))
    greedy = SimpleNamespace(temperature=0.0)
    for length in (0, 6):
        start = draft.new_state(1)
        if length:
            _, _, start = draft(torch.randint(0, 512, (1, length)), torch.randn(1, length, 64), start)
        before = [t.clone() for t in _state_tensors(start)]
        feature, token = torch.randn(64), 11
        expected, _, _ = draft.propose(feature, token, start, 5, greedy, probabilities)
        chained = draft.greedy(torch.tensor([[token]]), feature.view(1, 1, 64), start, 5)
        assert chained.dtype == torch.int64 and chained.tolist() == expected
        assert all(torch.equal(a, b) for a, b in zip(_state_tensors(start), before, strict=True))


def test_save_load_round_trip(model, tmp_path):
    draft = perturbed(EagleDraft(model, DraftConfig(layer_kind="kda", draft_vocab_size=len(D2T)), D2T))
    path = draft.save(tmp_path / "draft")
    assert sorted(p.name for p in path.iterdir()) == ["checksums.json", "draft.json", "draft.safetensors"]
    saved = load_file(str(path / "draft.safetensors"))
    assert saved.keys() == draft.state_dict().keys() and "d2t" in saved
    assert not any(t.shape[0] == 512 for t in saved.values())  # neither the embedding nor the LM head
    loaded = EagleDraft.load(path, model)
    assert loaded.target is model and loaded.config == draft.config
    for name, t in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    tokens, hidden = torch.randint(0, 512, (1, 5)), torch.randn(1, 5, 64)
    assert torch.equal(loaded(tokens, hidden)[0], draft(tokens, hidden)[0])

    other = K3ForCausalLM(replace(preset("tiny"), vocab_size=600))
    with pytest.raises(ValueError, match=r"draft\.json.*vocab_size"):
        EagleDraft.load(path, other)
    blob = bytearray((path / "draft.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (path / "draft.safetensors").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=r"draft\.safetensors.*checksum"):
        EagleDraft.load(path, model)


@pytest.mark.parametrize("d2t", [None, D2T])
def test_the_eagle3_unroll_drafts_each_chain_as_the_server_does(d2t):
    """EAGLE-3's training-time test: every chain (the one drafted after prefix position i) drafted as serving drafts —
    the draft reads the prefix's fused features into its state, then decodes token by token from its own outputs
    (`EagleDraft.forward` with a state: the absorbed MLA path), the true next token fed back — gives the unroll's
    log-overlap ``log Σ min(p, q)`` at every step and position (fp64)."""
    target = serving.model().double()
    draft = perturbed(EagleDraft(target, DraftConfig(layer_kind="mla", draft_vocab_size=None if d2t is None
                                                     else len(d2t)), d2t))
    tokens = torch.randint(0, 512, (2, 10))
    features, logits = target_outputs(target, draft.config.feature_layers, tokens)
    fused = draft.fuse(features)
    overlaps = unroll(draft, tokens, fused, logits, 7, "eagle3")
    p = logits.softmax(-1)
    B, T = tokens.shape
    for b in range(B):
        for i in range(T - 1):
            state = draft.new_state(1)
            if i:
                state = draft.read(tokens[b:b + 1, 1:i + 1], fused[b:b + 1, :i], state)
            hidden = fused[b:b + 1, i:i + 1]
            for k in range(min(7, T - 1 - i)):
                draft_logits, hidden, state = draft(tokens[b:b + 1, i + 1 + k:i + 2 + k], hidden, state)
                q = torch.zeros(512, dtype=torch.float64)
                q[draft.d2t if d2t is not None else slice(None)] = draft_logits[0, 0].softmax(-1)
                expected = torch.log(torch.minimum(p[b, i + 1 + k], q).sum())
                torch.testing.assert_close(overlaps[k][b, i], expected, rtol=1e-10, atol=1e-12)


def test_the_causal_unroll_differs_from_eagle3_after_the_first_step():
    """``mask="causal"`` (a KDA draft's): the same first step; later steps see other chains' drafts, not the prefix."""
    target = serving.model().double()
    draft = perturbed(EagleDraft(target, DraftConfig(layer_kind="mla")))
    tokens = torch.randint(0, 512, (2, 10))
    features, logits = target_outputs(target, draft.config.feature_layers, tokens)
    eagle3, causal = (unroll(draft, tokens, draft.fuse(features), logits, 3, mask) for mask in ("eagle3", "causal"))
    torch.testing.assert_close(causal[0], eagle3[0], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(causal[1], eagle3[1]) and not torch.allclose(causal[2], eagle3[2])
    with pytest.raises(ValueError, match="mask"):
        DraftTrainConfig(layer_kind="kda", mask="eagle3").validate()
    assert DraftTrainConfig(layer_kind="kda").validate().mask == "causal"
    assert DraftTrainConfig().validate().mask == "eagle3"


def test_the_loss_weighs_step_k_by_step_weight_to_the_k():
    overlaps = [torch.tensor([-1.0, -3.0]), torch.tensor([-4.0]), torch.tensor([-0.5, -0.5, -0.5])]
    expected = (1 * 2.0 + 0.8 * 4.0 + 0.64 * 0.5) / (1 + 0.8 + 0.64)
    assert unroll_loss(overlaps, 0.8).item() == pytest.approx(expected)


def test_top_tokens():
    docs = [[5, 5, 5, 2, 2, 9], [9, 9, 9, 1, 2]]
    assert top_tokens(docs, 10, 3).tolist() == [2, 5, 9]
    assert top_tokens(docs, 10, 4).tolist() == [1, 2, 5, 9]  # ties go to the lower id (0, 1, 3, ... once)


def test_training_lowers_the_loss(target_dir, corpus, tmp_path):
    config = DraftTrainConfig(ckpt=str(target_dir), out=str(tmp_path / "run"), steps=16, seq_len=24, batch_size=8,
                              lr=1e-2, data=[str(corpus)], progress=False, threads=1, draft_vocab=256)
    run = train_draft(config)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 17)) and len(rows[0]["acceptance"]) == 7
    first, last = (torch.tensor([[r["loss"], *r["acceptance"]] for r in part]).mean(0)
                   for part in (rows[:3], rows[-3:]))
    assert last[0] < first[0] - 0.1  # the loss
    assert bool((last[1:] > first[1:] + 0.03).all())  # the acceptance estimate of every draft step
    draft = EagleDraft.load(run.out, run.target)  # a run directory: its newest checkpoint
    assert draft.config.draft_vocab_size == 256 and (run.out / "step-0000016").is_dir()


def test_resume_continues_exactly(target_dir, corpus, tmp_path, capsys):
    """Interrupt a run three times (a zero time budget stops after one step, with a checkpoint), then resume it:
    the losses and acceptances equal the uninterrupted run's."""
    flags = ["train-draft", "--ckpt", str(target_dir), "--seq-len", "16", "--batch-size", "4", "--data", str(corpus),
             "--threads", "1", "--no-progress", "--ckpt-every", "2", "--lr", "0.01", "--steps", "6", "--layer-kind",
             "kda"]
    assert main([*flags, "--out", str(tmp_path / "whole")]) == 0
    assert "expected acceptance per draft step" in capsys.readouterr().out
    part = [*flags, "--out", str(tmp_path / "part")]
    for _ in range(3):
        assert main([*part, "--max-minutes", "0", "--resume"]) == 0
    assert main(part) == 2  # an existing run is continued only with --resume
    with open(tmp_path / "part" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1')  # an attempt cut short after the last checkpoint
    assert main([*part, "--resume"]) == 0
    whole, split = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                    for run in ("whole", "part"))
    assert [r["step"] for r in split] == list(range(1, 7))
    assert [(r["loss"], r["acceptance"]) for r in split] == [(r["loss"], r["acceptance"]) for r in whole]
    capsys.readouterr()
    assert main([*flags[:-1], "mla", "--out", str(tmp_path / "part"), "--steps", "8", "--resume"]) == 2
    assert "layer_kind" in capsys.readouterr().err


def test_a_run_from_before_the_mask_resumes_with_the_causal_mask_it_trained_with(target_dir, corpus, tmp_path, capsys):
    """An MLA draft run whose train.json predates ``mask`` trained causally: resumed with the default (eagle3) it is
    refused naming the field, with ``--mask causal`` it continues."""
    import hashlib

    out = tmp_path / "old"
    flags = ["train-draft", "--ckpt", str(target_dir), "--seq-len", "16", "--batch-size", "2", "--data", str(corpus),
             "--threads", "1", "--no-progress", "--ckpt-every", "1", "--out", str(out)]
    assert main([*flags, "--steps", "1", "--mask", "causal"]) == 0
    ckpt = out / "step-0000001"
    train = json.loads((ckpt / "train.json").read_text())
    del train["mask"]
    (ckpt / "train.json").write_text(json.dumps(train))
    manifest = json.loads((ckpt / "checksums.json").read_text())
    manifest["files"]["train.json"] = hashlib.sha256((ckpt / "train.json").read_bytes()).hexdigest()
    (ckpt / "checksums.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main([*flags, "--steps", "2", "--resume"]) == 2
    assert "field 'mask' is 'causal' in the checkpoint but 'eagle3' was requested" in capsys.readouterr().err
    assert main([*flags, "--steps", "2", "--resume", "--mask", "causal"]) == 0
