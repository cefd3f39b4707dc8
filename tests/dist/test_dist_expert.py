"""Expert parallelism, plain EP and MoonEP (SPEC §8; `k3.dist.expert`), on real gloo process groups of 2 and 4
processes spawned by the tests (one spawn per group size, shared by the tests through a module fixture).

Everything distributed runs in fp64 and is compared with single-process `Experts` / `LatentMoE` on the concatenated
tokens at rtol = atol = 1e-12 (equal up to summation order). `plan_placement` is checked on hand-made loads and, with
hypothesis, on random ones.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.config import MXConfig, SiTUConfig, preset
from k3.dist.expert import (ExpertParallelExperts, full_state_dict, gather_experts, plan_placement,
                            shard_experts)
from k3.model.width import Experts, LatentMoE

E, W, F, K = 8, 16, 12, 2
TOL = {"rtol": 1e-12, "atol": 1e-12}
#: (name, redundant_slots, tokens per rank, skewed routing) for each group size
CASES = {2: [("plain", 0, [10, 6], False), ("plain-skew", 0, [12, 12], True), ("moon-1", 1, [12, 12], True),
             ("moon-2", 2, [12, 12], True), ("moon-4", 4, [12, 12], True)],
         4: [("plain", 0, [7, 0, 12, 5], False), ("plain-skew", 0, [8] * 4, True), ("moon-2", 2, [8] * 4, True)]}


def _experts(n: int = E) -> Experts:
    torch.manual_seed(0)
    return Experts(n, W, F, "situ", SiTUConfig(), std=0.3).double()


def _batch(lengths: list[int], skew: bool) -> dict[str, torch.Tensor]:
    """Tokens, routing weights, top-k expert ids and an output weight; skewed: 85% of the tokens pick experts 0 and
    1 (both owned by rank 0)."""
    total = sum(lengths)
    g = torch.Generator().manual_seed(5 + total)
    scores = torch.rand(total, E, generator=g, dtype=torch.float64)
    if skew:
        scores[torch.rand(total, generator=g) < 0.85, :2] += 1
    return {"x": torch.randn(total, W, generator=g, dtype=torch.float64),
            "w": torch.rand(total, K, generator=g, dtype=torch.float64) + 0.1,
            "idx": scores.topk(K).indices, "out": torch.randn(total, W, generator=g, dtype=torch.float64)}


def _latent(mx_on: bool) -> tuple[LatentMoE, torch.Tensor, torch.Tensor]:
    """A LatentMoE of 8 experts whose router prefers expert 0 (bias +0.3), its input (8 tokens per rank for up to
    4 ranks, taken in order) and an output weight."""
    cfg = preset("tiny")
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=E),
                              mx=MXConfig(enabled=mx_on, activation_format="mxfp8_e4m3" if mx_on else None))
    torch.manual_seed(1)
    moe = LatentMoE(cfg).double()
    with torch.no_grad():
        moe.router.balance_bias[0] = 0.3
    g = torch.Generator().manual_seed(2)
    return (moe, torch.randn(32, cfg.hidden_size, generator=g, dtype=torch.float64),
            torch.randn(32, cfg.hidden_size, generator=g, dtype=torch.float64))


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def _errors(world: int, rank: int, base: Experts) -> dict[str, str | None]:
    """The ValueError message (None: no error) of each bad call, made on every rank, bad on one rank or all."""
    found: dict[str, str | None] = {}

    def catch(key: str, call) -> None:  # noqa: ANN001
        try:
            call()
            found[key] = None
        except ValueError as e:
            found[key] = str(e)

    plain, moon = ExpertParallelExperts.from_experts(base), ExpertParallelExperts.from_experts(base, None, 1)
    b = _batch([4], False)
    x, w, idx = b["x"], b["w"], b["idx"]
    n = 4 if rank else 3
    catch("unequal N", lambda: moon(x[:n], w[:n], idx[:n]))
    catch("width", lambda: plain(x if rank else x[:, :-1], w, idx))
    catch("k", lambda: plain(x, w if rank else w[:, :1], idx))
    catch("expert id", lambda: plain(x, w, idx if rank else idx + E))
    catch("ep", lambda: ExpertParallelExperts.from_experts(_experts(2 * world + 1)))
    catch("slots", lambda: ExpertParallelExperts.from_experts(base, None, E // world + 1))
    catch("after", lambda: plain(x, w, idx))  # the group is still in step after those errors
    return found


def _worker(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # a stuck collective fails the test, never hangs it
    try:
        base, results = _experts(), {}
        for name, slots, lengths, skew in CASES[world]:
            b = _batch(lengths, skew)
            sl = slice(sum(lengths[:rank]), sum(lengths[:rank + 1]))
            ep = ExpertParallelExperts.from_experts(base, None, slots)
            x, w = b["x"][sl].clone().requires_grad_(), b["w"][sl].clone().requires_grad_()
            y = ep(x, w, b["idx"][sl])
            forward = dataclasses.asdict(ep.comm)
            (y * b["out"][sl]).sum().backward()
            results[name] = {"y": y.detach(), "grad_x": x.grad, "grad_w": w.grad, "grad_gate_up": ep.gate_up.grad,
                             "grad_down": ep.down.grad, "forward": forward, "comm": dataclasses.asdict(ep.comm),
                             "amounts": ep.placement.amounts, "copies": ep.placement.copies(rank)}
        results["gathered"] = gather_experts(ep)
        for mx_on in (False, True):
            moe, x_all, out_all = _latent(mx_on)
            shard_experts(moe, None, redundant_slots=E // world)
            state = full_state_dict(moe)
            sl = slice(rank * 8, rank * 8 + 8)
            x = x_all[sl].clone().requires_grad_()
            y = moe(x)
            (y * out_all[sl]).sum().backward()
            results[f"latent-mx={mx_on}"] = {"y": y.detach(), "grad_x": x.grad, "params": _grads(moe), "state": state,
                                             "copies": moe.experts.placement.copies(rank)}
        results["errors"] = _errors(world, rank, base)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def run(request) -> tuple[int, list[dict]]:
    world = request.param
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, f"file://{os.path.join(out, 'rendezvous')}", out), nprocs=world, join=True)
        return world, [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _reference(lengths: list[int], skew: bool) -> dict[str, torch.Tensor]:
    b, experts = _batch(lengths, skew), _experts()
    x, w = b["x"].clone().requires_grad_(), b["w"].clone().requires_grad_()
    y = experts(x, w, b["idx"])
    (y * b["out"]).sum().backward()
    return {"y": y.detach(), "grad_x": x.grad, "grad_w": w.grad, "grad_gate_up": experts.gate_up.grad,
            "grad_down": experts.down.grad}


def test_output_and_gradients_equal_one_process(run):
    world, ranks = run
    for name, _, lengths, skew in CASES[world]:
        ref = _reference(lengths, skew)
        for key, want in ref.items():  # rows of x, w: per rank; expert slices: per owner — concatenated in rank order
            got = torch.cat([r[name][key] for r in ranks])
            torch.testing.assert_close(got, want, **TOL, msg=f"{name}: {key}")


def test_moonep_balances_exactly_plain_does_not(run):
    world, ranks = run
    S = CASES[world][-1][2][0]
    for name, slots, lengths, skew in CASES[world]:
        rows = [r[name]["comm"]["recv_rows"] for r in ranks]
        if slots:
            assert rows == [S * K] * world, name  # every rank processes exactly S·K assignments
            assert ranks[0][name]["amounts"].sum(1).tolist() == [S * K] * world
            assert all(len(r[name]["copies"]) <= slots for r in ranks)
        elif skew:
            assert max(rows) > 1.5 * S * K > min(rows), rows  # rank 0 (experts 0 and 1) gets far more than S·K
        assert sum(rows) == K * sum(lengths)


def test_receive_buffer_does_not_grow_with_redundancy(run):
    world, ranks = run
    moon = [(name, slots) for name, slots, _, _ in CASES[world] if slots]
    S = CASES[world][-1][2][0]
    for r in ranks:
        assert {r[name]["comm"]["recv_rows"] for name, _ in moon} == {S * K}
    if world == 2:
        assert [slots for _, slots in moon] == [1, 2, 4]
        assert any(r["moon-1"]["copies"] for r in ranks)  # redundancy was actually used with one slot


def test_redundant_copy_gradients_land_on_the_owner(run):
    world, ranks = run
    name, per = CASES[world][-1][0], E // world
    copied = {(r, e) for r in range(world) for e in ranks[r][name]["copies"]}
    assert copied and all(ranks[0][name]["amounts"][r, e] > 0 for r, e in copied)  # the copies computed something
    ref = _reference(CASES[world][-1][2], True)
    for key in ("grad_gate_up", "grad_down"):  # the owner's grad holds its copies' shares: it equals the whole grad
        assert all(r[name][key].shape[0] == per for r in ranks)
        for _, e in copied:
            torch.testing.assert_close(ranks[e // per][name][key][e % per], ref[key][e], **TOL)


def test_traffic_is_counted_and_mirrored(run):
    world, ranks = run
    for name, *_ in CASES[world]:
        fwd, both = [r[name]["forward"] for r in ranks], [r[name]["comm"] for r in ranks]
        assert sum(c["sent_bytes"] for c in fwd) == sum(c["received_bytes"] for c in fwd) > 0
        for c, f in zip(both, fwd):  # backward mirrors forward: it sends what the forward received, and back
            assert c["sent_bytes"] == c["received_bytes"] == f["sent_bytes"] + f["received_bytes"]
    lengths = CASES[world][0][2]  # plain: rows dispatched to other ranks and returned, W fp64 values each
    b, first = _batch(lengths, False), 0
    owner = b["idx"] // (E // world)
    for r, n in enumerate(lengths):
        mine = owner[first:first + n]
        own = int((mine == r).sum())
        recv = int((owner == r).sum())
        assert ranks[r]["plain"]["forward"]["sent_bytes"] == ((n * K - own) + (recv - own)) * W * 8
        first += n


@pytest.mark.parametrize("mx_on", [False, True], ids=["float", "MX (mxfp4 weights, mxfp8 inputs)"])
def test_latent_moe_equals_one_process(run, mx_on):
    world, ranks = run
    key = f"latent-mx={mx_on}"
    moe, x, out = _latent(mx_on)
    reference_state = {n: t.clone() for n, t in moe.state_dict().items()}
    x = x[:8 * world].clone().requires_grad_()
    y = moe(x)
    (y * out[:8 * world]).sum().backward()
    torch.testing.assert_close(torch.cat([r[key]["y"] for r in ranks]), y.detach(), **TOL)
    torch.testing.assert_close(torch.cat([r[key]["grad_x"] for r in ranks]), x.grad, **TOL)
    for name, p in moe.named_parameters():
        if name.startswith("experts."):  # owner slices
            got = torch.cat([r[key]["params"][name] for r in ranks])
        else:  # every rank holds its tokens' share
            got = sum(r[key]["params"][name] for r in ranks)
        torch.testing.assert_close(got, p.grad, **TOL, msg=name)
    assert any(r[key]["copies"] for r in ranks)
    for r in ranks:  # full_state_dict: the unsharded model's state on every rank
        assert r[key]["state"].keys() == reference_state.keys()
        for name, t in reference_state.items():
            assert torch.equal(r[key]["state"][name], t), name


def test_gather_experts_gives_the_full_weights(run):
    _, ranks = run
    base = _experts()
    for r in ranks:
        assert torch.equal(r["gathered"][0], base.gate_up.detach())
        assert torch.equal(r["gathered"][1], base.down.detach())


def test_bad_inputs_raise_value_errors_on_every_rank(run):
    world, ranks = run
    want = {"unequal N": "same number of tokens", "ep": f"ep = {world} ranks do not divide the {2 * world + 1}",
            "slots": "redundant_slots"}
    for r, result in enumerate(ranks):
        errors = result["errors"]
        for key, text in want.items():
            assert errors[key] is not None and text in errors[key], (key, errors[key])
        for key, text in (("width", "x must be [N, width"), ("k", "weights and indices"), ("expert id", "expert ids")):
            assert text in errors[key] if r == 0 else "rank(s) [0]" in errors[key], (key, errors[key])
        assert errors["after"] is None


def test_plan_placement_hand_made():
    p = plan_placement(torch.tensor([10, 0, 1, 1]), ep=2, tokens_per_rank=3, k=2, redundant_slots=1)
    assert p.amounts.tolist() == [[6, 0, 0, 0], [4, 0, 1, 1]]  # rank 1 takes the overflow of expert 0
    assert p.copies(0) == [] and p.copies(1) == [0]
    # one expert per rank: filling rank 2 from rank 0 alone, then rank 0 from rank 1, needs one slot each
    # (splitting rank 2's deficit between the two overloaded ranks would need two)
    p = plan_placement(torch.tensor([9, 9, 0]), ep=3, tokens_per_rank=3, k=2, redundant_slots=1)
    assert p.amounts.tolist() == [[3, 3, 0], [0, 6, 0], [6, 0, 0]]
    assert p.work == [6, 6, 6]
    # all load on one expert: every other rank holds a copy
    p = plan_placement(torch.tensor([16, 0, 0, 0, 0, 0, 0, 0]), ep=4, tokens_per_rank=2, k=2, redundant_slots=1)
    assert p.amounts[:, 0].tolist() == [4] * 4 and [p.copies(r) for r in range(4)] == [[], [0], [0], [0]]
    # plain EP: everything at home
    assert plan_placement(torch.tensor([5, 1, 0, 2]), 2, 2, 2, 0).amounts.tolist() == [[5, 1, 0, 0], [0, 0, 0, 2]]
    assert plan_placement(torch.tensor([2, 2, 2, 2]), 2, 4, 1, 2).copies(1) == []  # balanced: no copies


@pytest.mark.parametrize("args, match", [
    ((torch.tensor([1, 2, 3]), 2, 3, 1, 1), "ep = 2 ranks do not divide the 3"),
    ((torch.tensor([1, 2, 3, 4]), 2, 3, 1, 1), "sums to 10"),
    ((torch.tensor([4, 2, 0, 0]), 2, 3, 1, 3), r"redundant_slots = 3 is invalid"),
    ((torch.tensor([[3, 3]]), 1, 3, 2, 0), r"integer tensor \[E\]"),
    ((torch.tensor([3.0, 3.0]), 1, 3, 2, 0), r"integer tensor \[E\]"),
    ((torch.tensor([7, -1]), 1, 3, 2, 0), "non-negative"),
    ((torch.tensor([6, 0, 0, 0, 0, 0]), 3, 1, 2, 0), None),
    ((torch.tensor([3, 3, 3, 3, 0, 0]), 3, 2, 2, 1), "needs 2 redundant slots on rank 2"),
])
def test_plan_placement_rejects(args, match):
    if match is None:  # plain EP plans any load
        assert plan_placement(*args).work == [6, 0, 0]
        return
    with pytest.raises(ValueError, match=match):
        plan_placement(*args)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(1, 4), st.integers(0, 8), st.integers(1, 3))
def test_plan_placement_properties(data, ep, per, tokens, k):
    n = ep * per
    picks = data.draw(st.lists(st.integers(0, n - 1), min_size=ep * tokens * k, max_size=ep * tokens * k))
    load = torch.bincount(torch.tensor(picks, dtype=torch.long), minlength=n)
    slots = data.draw(st.integers(1, per))
    try:
        p = plan_placement(load, ep, tokens, k, slots)
    except ValueError as e:  # only fewer than E/ep slots may be too few
        assert slots < per and "redundant slots" in str(e)
        return
    assert (p.amounts >= 0).all()
    assert p.work == [tokens * k] * ep  # every rank exactly S·K
    assert p.amounts.sum(0).tolist() == load.tolist()  # every expert's split sums to its load
    assert all(len(p.copies(r)) <= slots for r in range(ep))
    assert torch.equal(plan_placement(load, ep, tokens, k, slots).amounts, p.amounts)  # deterministic
