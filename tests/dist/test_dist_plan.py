"""The training plan (`k3.dist.plan`, SPEC §7, §8): byte formulas against the real tensors of models built on the
``meta`` device, shards per rank, communication formulas on hand-computed cases, refusals, and ``k3 plan --gpus``."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from k3.cli import main
from k3.config import K3Config, preset
from k3.dist.layout import ParallelLayout
from k3.dist.plan import activation_bytes, all_layouts, all_to_all_bytes, build_layout, communication_bytes, \
    cp_bytes_per_layer, fsdp_bytes, fsdp_units, muon_bytes, parameter_split, propose_layouts, shard_elements, \
    state_bytes, training_plan
from k3.model.lm import K3ForCausalLM
from k3.model.width import Experts
from k3.train.optim import OptimConfig, build_optimizers

FITS = ["plan", "--preset", "paper", "--gpus", "2048", "--gpu-memory-gb", "80", "--dp-shard", "8", "--ep", "32",
        "--cp", "8", "--seq", "65536"]


def _config(name: str) -> K3Config:
    """A preset; ``NAME:head`` with one KDA decay per head (the Gated DeltaNet-style ablation)."""
    name, _, decay = name.partition(":")
    config = preset(name)
    config.kda = dataclasses.replace(config.kda, decay=decay or "channel")
    return config


def _meta(name: str) -> tuple[K3ForCausalLM, dict[str, list[torch.Tensor]]]:
    """The model on ``meta`` and its parameters by class, as `build_optimizers` groups them."""
    config = _config(name)
    with torch.device("meta"):  # allocates nothing; `check_fits` skips the meta device
        model = K3ForCausalLM(config)
    experts = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
    groups: dict[str, list[torch.Tensor]] = {"experts": [], "muon": [], "adamw": []}
    for opt in build_optimizers(model, config, OptimConfig()):
        for group in opt.param_groups:
            for p in group["params"]:
                kind = "experts" if id(p) in experts else "muon" if group["name"].startswith("muon") else "adamw"
                groups[kind].append(p)
    return model, groups


@pytest.mark.parametrize("name", ["tiny", "small", "paper", "tiny:head"])
def test_parameter_grad_and_optimizer_bytes_match_the_real_tensors(name):
    model, groups = _meta(name)
    numel = {kind: sum(p.numel() for p in ps) for kind, ps in groups.items()}
    assert parameter_split(_config(name)) == numel
    assert sum(numel.values()) == sum(p.numel() for p in model.parameters())
    one = state_bytes(_config(name), ParallelLayout())
    assert one["parameters"] == one["gradients"] == sum(4 * p.numel() for p in model.parameters())  # fp32 master, grad
    assert one["optimizer"] == sum(4 * p.numel() for p in groups["experts"] + groups["muon"]) \
        + sum(2 * 4 * p.numel() for p in groups["adamw"])  # Muon 1 fp32 moment, AdamW 2


@pytest.mark.parametrize(("name", "shape"), [("tiny", (2, 2, 2, 2)), ("small", (1, 3, 4, 2)), ("paper", (1, 8, 32, 8))])
def test_shards_sum_to_the_model_and_experts_stay_in_their_ep_group(name, shape):
    config, layout = preset(name), ParallelLayout(*shape)
    split = parameter_split(config)
    shards = [shard_elements(config, layout, rank) for rank in range(layout.world)]
    for kind in split:
        assert sum(s[kind] for s in shards) == layout.dp_replicate * split[kind]
    per_group: dict[tuple[int, int], int] = {}
    for rank, s in enumerate(shards):  # rank = ((r·dp_shard + s)·ep + e)·cp + c
        replica, ep_index = rank // (layout.world // layout.dp_replicate), rank // layout.cp % layout.ep
        per_group[replica, ep_index] = per_group.get((replica, ep_index), 0) + s["experts"]
    assert set(per_group.values()) == {split["experts"] // layout.ep}
    assert max(sum(s.values()) for s in shards) - min(sum(s.values()) for s in shards) <= 3
    assert state_bytes(config, layout)["parameters"] == 4 * sum(shards[0].values())


def test_fsdp_units_are_the_layers_with_their_local_experts():
    config, layout = preset("small"), ParallelLayout(dp_shard=2, ep=4)
    model, _ = _meta("small")
    units = fsdp_units(config, layout)
    for i, layer in enumerate(model.layers):
        routed = sum(p.numel() for m in layer.modules() if isinstance(m, Experts) for p in m.parameters())
        whole = sum(p.numel() for p in layer.parameters())
        assert units[f"layer {i + 1} ({layer.kind}+{config.ffn_kinds()[i]})"] == whole - routed + routed // 4
    assert units["embedding"] == model.embed_tokens.weight.numel()
    assert units["lm head"] == sum(p.numel() for p in (model.lm_head.weight, model.norm.weight, model.final_query,
                                                        model.final_key_gain))
    assert units["vision"] == sum(p.numel() for p in model.vision.parameters())
    split = parameter_split(config)
    assert sum(units.values()) == split["muon"] + split["adamw"] + split["experts"] // 4


def test_fsdp_bytes_on_a_hand_computed_case():
    config = preset("tiny")
    split = parameter_split(config)
    total = sum(split.values())
    model, _ = _meta("tiny")  # the root unit (gathered once: FSDP2 keeps it from forward to backward)
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("layers.", "vision.")))
    b = fsdp_bytes(config, ParallelLayout(dp_shard=4))  # one group of 4: a rank receives 3/4 of every unit
    assert b == {"all_gather": 2 * (total * 2 * 3 // 4) - root * 2 * 3 // 4, "reduce_scatter": total * 4 * 3 // 4,
                 "replicate_all_reduce": 0}
    hsdp = fsdp_bytes(config, ParallelLayout(dp_replicate=2, dp_shard=2))
    assert hsdp["replicate_all_reduce"] == 2 * (4 * sum(shard_elements(config, ParallelLayout(2, 2)).values())) // 2
    ep = fsdp_bytes(config, ParallelLayout(dp_shard=2, ep=2))  # experts gather over dp_shard only
    dense = split["muon"] + split["adamw"]
    assert ep["reduce_scatter"] == dense * 4 * 3 // 4 + split["experts"] // 2 * 4 // 2


def test_muon_bytes_match_a_per_matrix_simulation_of_the_owner_strategy():
    config, layout = preset("small"), ParallelLayout(dp_shard=2, ep=2, cp=2)
    _, groups = _meta("small")
    received = 0.0  # per matrix: the owner receives (n − 1)/n of the fp32 gradient, each other rank 1/n of the update
    matrices = [(p.numel() * 4, 8) for p in groups["muon"]]  # non-expert shard group: dp_shard × ep × cp = 8 ranks
    matrices += [(p.numel() // layout.ep * 4, 4) for p in groups["experts"]]  # E/ep experts over dp_shard × cp = 4
    for size, n in matrices:
        owner, others = size * (n - 1) / n, (n - 1) * size / n
        received += (owner + others) / n  # owners taken in turn: one rank's share of the group's traffic
    b = muon_bytes(config, layout)
    assert b["gather"] == b["scatter"]
    assert b["gather"] + b["scatter"] == pytest.approx(received, abs=4)


def test_all_to_all_on_a_hand_computed_case():
    config = preset("tiny")  # 4 layers, the first dense: 3 MoE layers; K = 2, latent width 32
    # 10 tokens × K 2 × 32 scalars × 2 bytes = 1,280 per exchange; half goes to the other ep rank → 640 received;
    # dispatch + combine in forward and backward = 4 exchanges per MoE layer
    assert all_to_all_bytes(config, ParallelLayout(dp_shard=2, ep=2), 10, 2) == 3 * 4 * 640
    assert all_to_all_bytes(config, ParallelLayout(dp_shard=2, ep=2), 10, 2, recompute=True) == 3 * 6 * 640
    assert all_to_all_bytes(config, ParallelLayout(ep=4), 10, 4) == 3 * 4 * (10 * 2 * 32 * 4 * 3 // 4)
    assert all_to_all_bytes(config, ParallelLayout(dp_shard=2), 10, 2) == 0
    config.moe.latent_dim = None  # plain MoE: tokens travel at d = 64
    assert all_to_all_bytes(config, ParallelLayout(ep=2), 10, 2) == 3 * 4 * 1280


def test_context_parallel_bytes_kda_independent_of_length_mla_linear():
    config, layout = preset("tiny"), ParallelLayout(dp_shard=2, cp=2)
    # tiny: H 2, K = V = 16, conv 4; MLA cache 32 + 8 = 40 scalars per token; 2 sequences of 64 tokens, bf16
    state, halo = 2 * 2 * 16 * 32 * 4, 2 * 3 * 2 * (16 + 16 + 16) * 2
    assert cp_bytes_per_layer(config, layout, 64, 2, 2) == {"kda": state + halo + 8, "mla": 2 * 32 * 40 * 2 + 8}
    assert cp_bytes_per_layer(config, layout, 64, 2, 2, backward=True) == {"kda": 2 * (state + halo),
                                                                          "mla": 2 * 2 * 32 * 40 * 2}
    paper = preset("paper")
    for cp in (2, 8, 32):
        lay = ParallelLayout(cp=cp)
        short, long = (cp_bytes_per_layer(paper, lay, n, 1) for n in (65536, 4 * 65536))
        assert short["kda"] == long["kda"] == (cp - 1) * (96 * 128 * 256 * 4 + 3 * 96 * 384 * 2 + 8)
        assert long["mla"] - 8 * (cp - 1) == 4 * (short["mla"] - 8 * (cp - 1))
        assert short["mla"] == (cp - 1) * (65536 // cp * 576 * 2 + 8)  # SPEC §0: 576 cached scalars per token
    assert cp_bytes_per_layer(paper, ParallelLayout(), 65536) == {"kda": 0, "mla": 0}


def test_activations_scale_with_tokens_and_recompute_keeps_only_checkpoints():
    config = preset("small")
    with_, without = activation_bytes(config, 100), activation_bytes(config, 100, recompute=False)
    assert with_["stored"] < without["stored"] and without["recompute_layer"] == 0 < with_["recompute_layer"]
    assert activation_bytes(config, 300)["stored"] == 3 * with_["stored"]
    plan = training_plan(config, ParallelLayout(dp_shard=2, cp=2), 1001, 3)
    assert plan["tokens_per_rank"] == 3 * 501 and plan["transient"]["mla_scores"] == 0
    no_flash = training_plan(config, ParallelLayout(dp_shard=2, cp=2), 1001, 3, flash=False)
    assert no_flash["transient"]["mla_scores"] == 3 * 501 * config.mla.num_heads * 1001 * 4


def test_refusals_name_the_flag():
    paper = preset("paper")
    with pytest.raises(ValueError, match=r"--cp 4 = 4096, but --gpus is 2048"):
        build_layout(paper, 2048, 65536, dp_shard=16, ep=64, cp=4)
    with pytest.raises(ValueError, match=r"--ep 256 does not divide the 896 routed experts"):
        build_layout(paper, 2048, 65536, ep=256)
    with pytest.raises(ValueError, match=r"--cp 8: sequences of 4 tokens"):
        build_layout(paper, 2048, 4, ep=32, cp=8)
    with pytest.raises(ValueError, match=r"--ep 2: this model has no routed experts"):
        build_layout(dataclasses.replace(preset("tiny"), num_layers=1), 2, 64, ep=2)  # one dense layer
    layout = build_layout(paper, 2048, 65536, dp_shard=64, ep=32, cp=1)
    with pytest.raises(ValueError, match=r"exceeds --gpu-memory-gb 80 by .* GiB; the largest term is stored "
                                         r"activations .*raise --cp"):
        training_plan(paper, layout, 65536, 1, gpu_memory_gb=80)
    with pytest.raises(ValueError, match=r"largest term is model state .*raise --dp-shard or --ep"):
        training_plan(paper, build_layout(paper, 2048, 256, dp_replicate=256, ep=8), 256, 1, gpu_memory_gb=80)


def test_cli_training_plan_that_fits(capsys):
    assert main(FITS) == 0
    out = capsys.readouterr().out
    assert "Training plan — preset 'paper': 2,048 GPUs = dp_replicate 1 × ep 32 × dp_shard 8 × cp 8" in out
    assert "fits" in out and "CP per layer at 262,144 tokens" in out
    assert main([*FITS, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["total"] == p["total_recompute"] <= p["budget"] == 80 * 2**30 < p["total_no_recompute"]
    assert p["tokens_per_rank"] == 8192 and p["tokens_per_step"] == 256 * 65536
    cp = p["cp_per_layer"]
    assert cp["65536"]["forward"]["kda"] == cp["262144"]["forward"]["kda"]
    assert cp["262144"]["forward"]["mla"] - 56 == 4 * (cp["65536"]["forward"]["mla"] - 56)
    assert math.isclose(sum(p["shard"].values()) * 2048, sum(p["parameter_split"].values()), rel_tol=1e-6)


def test_cli_training_plan_that_does_not_fit_and_the_serving_plan_unchanged(capsys):
    assert main([*FITS[:7], "--dp-shard", "64", "--ep", "32", "--cp", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3 plan: error: per-rank memory") and "--gpu-memory-gb 80" in err and "--cp" in err
    assert main(["plan", "--ep", "4"]) == 2 and "give --gpus" in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--context", "64"]) == 0
    assert capsys.readouterr().out.startswith("Serving memory plan — preset 'tiny'")


def test_all_layouts_are_every_factorisation():
    assert sorted(layout.shape for layout in all_layouts(4)) == sorted(
        (r, ep, shard, cp) for r in (1, 2, 4) for ep in (1, 2, 4) for shard in (1, 2, 4) for cp in (1, 2, 4)
        if r * ep * shard * cp == 4)
    assert len(list(all_layouts(2048))) == math.comb(11 + 3, 3)  # 2^11 over four factors
    assert [layout.shape for layout in all_layouts(1)] == [(1, 1, 1, 1)]


def test_without_a_layout_plan_proposes_the_fitting_layouts_least_communication_first(capsys):
    paper = preset("paper")
    plans = propose_layouts(paper, 2048, 65536, gpu_memory_gb=80)
    assert plans and all(p["total"] <= p["budget"] == 80 * 2**30 for p in plans)
    per_token = [p["communication"] / p["tokens_per_rank"] for p in plans]
    assert per_token == sorted(per_token)
    for p in plans[:3]:  # each is the plan of its layout, as `k3 plan` with that layout prints it
        layout = build_layout(paper, 2048, 65536, **{k: v for k, v in p["layout"].items()})
        assert p["communication"] == communication_bytes(training_plan(paper, layout, 65536))
    assert {p["layout"]["ep"] for p in plans} <= {1, 2, 4, 8, 16, 32, 64, 128}  # 896 experts: ep 256 does not divide
    shapes = {tuple(p["layout"].values()) for p in plans}
    assert (1, 32, 8, 8) in shapes and (1, 32, 64, 1) not in shapes  # FITS fits; the activations of cp 1 do not
    assert main(["plan", "--gpus", "2048"]) == 0  # the paper preset, no layout flag: proposed instead of refused
    out = capsys.readouterr().out
    first = plans[0]["layout"]
    assert out.startswith(f"Training layouts — preset 'paper': the {len(plans)} layouts of 2,048 GPUs that fit 80 GiB")
    assert f"--dp-replicate {first['dp_replicate']} --dp-shard {first['dp_shard']} --ep {first['ep']} " \
           f"--cp {first['cp']}" in out
    assert main(["plan", "--gpus", "2048", "--json"]) == 0
    assert [p["layout"] for p in json.loads(capsys.readouterr().out)] == [p["layout"] for p in plans]
    assert main(["plan", "--gpus", "8"]) == 2  # nothing fits: the closest layout and what to change
    err = capsys.readouterr().err
    assert err.startswith("k3 plan: error: no layout of --gpus 8 fits --gpu-memory-gb 80 (more GPUs might); the "
                          "closest, ") and "the largest term is model state" in err
