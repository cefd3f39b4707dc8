"""Quantization-aware training and packed inference (issue 15, items 2–3; SPEC §7, §10): the MX forward of the
routed experts against an explicit reference, the straight-through gradients, ``k3 train --qat mx``, ``k3
quantize`` and its checkpoints (layout, exact logits, errors naming the tensor), and the ``k3 info`` size line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.cli import main
from k3.config import MXConfig, SiTUConfig, preset
from k3.sizing.params import parameter_breakdown
from k3.config.hf import from_release_dict, mx_from_quantization, quantization_config
from k3.model.checkpoint import WEIGHTS, load_model, write_manifest
from k3.model.width import Experts
from k3.ops import mx
from k3.train import checkpoint as ckpt
from k3.train.pretrain import train
from k3.train.rundir import read_metrics
from training import config

QAT = MXConfig(enabled=True, weight_format="mxfp4", activation_format="mxfp8_e4m3")
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _experts(mx_config: MXConfig | None, seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    return Experts(4, 64, 32, "situ", SiTUConfig(4.0, 25.0), std=0.3, mx_config=mx_config)


def _reference_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Decode of encode (`k3.ops.mx`, bit-exact against torchao in test_mx), in fp64."""
    return mx.decode(*mx.encode(x, fmt), fmt).double()


def test_mx_forward_matches_an_explicit_reference():
    """Every pair (token, chosen expert): SiTU-GLU on MXFP4 weights and MXFP8 inputs, weighted and summed."""
    experts = _experts(QAT)
    x = torch.randn(5, 64)
    indices = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 3]])
    weights = torch.rand(5, 2)
    got = experts(x, weights, indices)
    expected = torch.zeros(5, 64, dtype=torch.float64)
    for n in range(5):
        for j in range(2):
            e = int(indices[n, j])
            w_gate, w_up = _reference_quantize(experts.gate_up[e].detach(), "mxfp4").split(32)
            w_down = _reference_quantize(experts.down[e].detach(), "mxfp4")
            xq = _reference_quantize(x[n:n + 1], "mxfp8_e4m3")
            gate, up = xq @ w_gate.T, xq @ w_up.T
            h = 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * 25 * torch.tanh(up / 25)
            expected[n] += weights[n, j].double() * (_reference_quantize(h.float(), "mxfp8_e4m3") @ w_down.T)[0]
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_ste_gradients_equal_those_of_the_dequantised_weights():
    qat = _experts(QAT)
    plain = _experts(MXConfig(enabled=True, activation_format="mxfp8_e4m3"), seed=1)
    plain.weight_format = None  # inputs quantized, weights taken as they are: the dequantised ones
    with torch.no_grad():
        plain.gate_up.copy_(_reference_quantize(qat.gate_up, "mxfp4"))
        plain.down.copy_(_reference_quantize(qat.down, "mxfp4"))
    x = torch.randn(9, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    indices, weights = torch.randint(0, 4, (9, 2)), torch.rand(9, 2)
    grad_out = torch.randn(9, 64)
    a, b = qat(x1, weights, indices), plain(x2, weights, indices)
    assert torch.equal(a, b)
    a.backward(grad_out)
    b.backward(grad_out)
    assert torch.equal(qat.gate_up.grad, plain.gate_up.grad) and torch.equal(qat.down.grad, plain.down.grad)
    assert torch.equal(x1.grad, x2.grad)
    assert qat.gate_up.grad.abs().sum() > 0


def test_qat_training_lowers_the_loss_and_is_recorded(tmp_path, corpus):
    out = tmp_path / "qat"
    run = train(config(out, corpus, steps=12, ckpt_every=12, eval_every=12, qat="mx"))
    assert run.model.layers[1].ffn.experts.weight_format == "mxfp4"
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5
    latest = ckpt.latest_checkpoint(out)
    saved = json.loads((latest / "config.json").read_text())["mx"]
    assert saved == {"enabled": True, "weight_format": "mxfp4", "activation_format": "mxfp8_e4m3", "block_size": 32}
    assert ckpt.read_train(latest)["qat"] == "mx"


def test_qat_continues_a_full_precision_run_and_cannot_be_dropped(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    train(config(out, corpus, steps=3))
    assert not json.loads((ckpt.latest_checkpoint(out) / "config.json").read_text())["mx"]["enabled"]
    train(config(out, corpus, steps=6, qat="mx"), resume=True)
    assert "continuing full-precision checkpoint step-0000003 with quantization-aware training" in \
        capsys.readouterr().err
    latest = ckpt.latest_checkpoint(out)
    assert latest.name == "step-0000006" and json.loads((latest / "config.json").read_text())["mx"]["enabled"]
    with pytest.raises(ValueError, match="pass --qat mx"):
        train(config(out, corpus, steps=9), resume=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, Path]:
    """A full-precision run and a QAT run of the tiny preset (a few steps each)."""
    root = tmp_path_factory.mktemp("mx-runs")
    train(config(root / "fp", corpus, steps=3))
    train(config(root / "qat", corpus, steps=3, qat="mx"))
    return {"fp": root / "fp", "qat": root / "qat"}


def _logits(model, ids: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """The logits of ``ids``; packed experts through decoded weights and matmuls, bit for bit as the fake-quantized
    float model sums, unless ``kernel`` (`k3.ops.mxfp4_kernel`: the same products, summed in another order)."""
    from k3.model.packed import PackedExperts

    rows = PackedExperts.KERNEL_ROWS
    PackedExperts.KERNEL_ROWS = rows if kernel else 0
    try:
        with torch.no_grad():
            return model(ids)[0]
    finally:
        PackedExperts.KERNEL_ROWS = rows


def test_packed_qat_checkpoint_gives_exactly_the_fake_quant_logits(runs, tmp_path, capsys):
    out = tmp_path / "packed"
    assert main(["quantize", "--ckpt", str(runs["qat"]), "--out", str(out)]) == 0
    assert "exact (QAT weights)" in capsys.readouterr().out
    fake, tokenizer = load_model(runs["qat"])
    packed, _ = load_model(out)
    assert type(packed.layers[1].ffn.experts).__name__ == "PackedExperts"
    assert packed.config == fake.config
    ids = torch.randint(0, tokenizer.vocab_size, (2, 37))
    assert torch.equal(_logits(packed, ids), _logits(fake, ids))
    for length in (1, 3):  # short inputs: the float path must not take the (differently summed) dense path
        assert torch.equal(_logits(packed, ids[:, :length]), _logits(fake, ids[:, :length]))
        torch.testing.assert_close(_logits(packed, ids[:, :length], kernel=True), _logits(fake, ids[:, :length]),
                                   rtol=1e-4, atol=1e-5)
    generated = []
    for ckpt_dir in (runs["qat"], out):
        assert main(["generate", "--ckpt", str(ckpt_dir), "--prompt", "def ", "--max-tokens", "12",
                     "--temperature", "0"]) == 0
        generated.append(capsys.readouterr().out)
    assert generated[0] == generated[1] and generated[0].strip()


def _independent_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' MXFP4 by hand: low nibble first, sign bit 3, E2M1 magnitudes, scale 2^(s − 127)."""
    nibbles = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()
    values = torch.tensor(E2M1, dtype=torch.float64)[nibbles & 7] * torch.where(nibbles >= 8, -1.0, 1.0)
    return values * torch.pow(2.0, scale.double() - 127).repeat_interleave(32, -1)


def test_post_training_quantization_writes_the_release_layout(runs, tmp_path):
    out = tmp_path / "ptq"
    main(["quantize", "--ckpt", str(runs["fp"]), "--out", str(out)])
    fp, tokenizer = load_model(runs["fp"])
    tensors = load_file(str(out / WEIGHTS))
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "mxfp4-pack-quantized" and "input_activations" not in quant["config_groups"]["group_0"]
    experts = fp.layers[1].ffn.experts
    for e in range(experts.num_experts):
        gate, up = experts.gate_up[e].detach().double().split(experts.hidden)
        for name, weight in (("w1", gate), ("w3", up), ("w2", experts.down[e].detach().double())):
            prefix = f"layers.1.ffn.experts.packed.{e}.{name}."
            packed, scale = tensors[prefix + "weight_packed"], tensors[prefix + "weight_scale"]
            rows, cols = weight.shape
            assert (packed.dtype, list(packed.shape), scale.dtype, list(scale.shape)) == (
                torch.uint8, [rows, cols // 2], torch.uint8, [rows, cols // 32])
            step = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, -1)
            inside = weight.abs() <= 6 * step  # beyond, FLOOR scaling saturates at ±6·scale
            assert ((_independent_dequantize(packed, scale) - weight).abs() <= step)[inside].all()
            assert (_independent_dequantize(packed, scale).abs() <= 6 * step).all() and inside.float().mean() > 0.9
    # weights only (as the release): the packed model equals the float model with MXFP4 weights fake-quantized
    for layer in fp.layers:
        if hasattr(layer.ffn, "experts"):
            layer.ffn.experts.weight_format = "mxfp4"
    packed, _ = load_model(out)
    ids = torch.randint(0, tokenizer.vocab_size, (1, 50))
    assert torch.equal(_logits(packed, ids), _logits(fp, ids))
    assert (out / WEIGHTS).stat().st_size < (ckpt.latest_checkpoint(runs["fp"]) / WEIGHTS).stat().st_size


def _rewrite(directory: Path, change) -> None:
    """Edit the tensors of a checkpoint and re-sign it, so only the content checks can object."""
    tensors = load_file(str(directory / WEIGHTS))
    change(tensors)
    save_file(tensors, str(directory / WEIGHTS))
    write_manifest(directory)


NAME = "layers.2.ffn.experts.packed.1.w3."


@pytest.mark.parametrize("change, message", [
    (lambda t: t.__setitem__(NAME + "weight_packed", t[NAME + "weight_packed"][:, :-1].contiguous()), "shape"),
    (lambda t: t.__setitem__(NAME + "weight_scale", t[NAME + "weight_scale"].float()), "float32"),
    (lambda t: t[NAME + "weight_scale"].__setitem__((0, 0), 255), "NaN scale byte"),
    (lambda t: t.pop(NAME + "weight_packed"), "missing tensor"),
])
def test_mismatched_packed_files_name_the_tensor(runs, tmp_path, change, message):
    out = tmp_path / "packed"
    main(["quantize", "--ckpt", str(runs["qat"]), "--out", str(out)])
    _rewrite(out, change)
    with pytest.raises(ValueError, match=message) as err:
        load_model(out)
    assert NAME in str(err.value)


def test_corrupt_or_inconsistent_quantized_checkpoints_are_clean_errors(runs, tmp_path, capsys):
    out = tmp_path / "packed"
    main(["quantize", "--ckpt", str(runs["qat"]), "--out", str(out)])
    before = (out / WEIGHTS).read_bytes()
    assert main(["quantize", "--ckpt", str(runs["qat"]), "--out", str(out)]) == 2  # an existing --out
    assert "already exists" in capsys.readouterr().err and (out / WEIGHTS).read_bytes() == before
    data = bytearray(before)
    data[-100:-96] = bytes(b ^ 0xFF for b in data[-100:-96])
    (out / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors: checksum mismatch"):
        load_model(out)
    (out / WEIGHTS).write_bytes(before)
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    path.write_text(json.dumps(cfg))
    write_manifest(out)
    with pytest.raises(ValueError, match="config.json: quantization_config describes"):
        load_model(out)


def test_quantization_config_round_trips_and_refuses_what_it_cannot_describe():
    assert mx_from_quantization(quantization_config(QAT)) == QAT
    weights_only = MXConfig(enabled=True)
    assert mx_from_quantization(quantization_config(weights_only)) == weights_only
    with pytest.raises(ValueError, match="E4M3 inputs only"):
        quantization_config(MXConfig(enabled=True, activation_format="mxfp8_e5m2"))
    with pytest.raises(ValueError, match="only MXFP4 weights"):
        quantization_config(MXConfig(enabled=True, weight_format="mxfp8_e4m3"))
    bad = quantization_config(QAT)
    bad["config_groups"]["group_0"]["input_activations"]["num_bits"] = 4
    with pytest.raises(ValueError, match="input_activations"):
        mx_from_quantization(bad)
    import release_fixture

    release = release_fixture.release_config(512)
    assert preset("paper").mx == weights_only == from_release_dict(release).mx  # the release: weights only
    release["text_config"]["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "dynamic": True}
    assert from_release_dict(release).mx == QAT


def test_info_reports_the_checkpoint_size_with_bf16_and_mxfp4_experts(capsys):
    assert main(["info", "--preset", "paper"]) == 0
    text = capsys.readouterr().out
    c = preset("paper")
    routed = (c.num_layers - c.moe.first_k_dense) * c.moe.num_experts * 3 * c.moe.latent_dim * c.moe.expert_hidden
    total = parameter_breakdown(c)["total"][0]
    assert f"{'all weights bf16':<26} {2 * total:>18,}" in text
    assert f"{'routed experts MXFP4':<26} {2 * (total - routed) + routed * 17 // 32:>18,}" in text
    assert "1.42 TiB" in text and "5.06 TiB" in text


def test_release_packed_tensors_must_be_uint8(tmp_path):
    import release_fixture

    from k3.model.lm import K3ForCausalLM

    directory = tmp_path / "release"
    release_fixture.write_release(directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in index if n.endswith("experts.2.w1.weight_scale"))
    shard = directory / index[name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].float()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="expected uint8") as err:
        K3ForCausalLM.from_pretrained(directory)
    assert name in str(err.value)


def test_a_packed_checkpoint_never_materialises_float_experts(runs, tmp_path, capsys, monkeypatch):
    """The model is built on the meta device and the file's tensors assigned: the float experts a `K3ForCausalLM`
    builds before its experts are replaced by packed ones never get memory (issue 37: peak memory at load)."""
    out = tmp_path / "packed"
    assert main(["quantize", "--ckpt", str(runs["qat"]), "--out", str(out)]) == 0
    devices, initialise = [], Experts.reset_parameters
    monkeypatch.setattr(Experts, "reset_parameters",
                        lambda self: devices.append(self.gate_up.device) or initialise(self))
    packed, _ = load_model(out)
    assert devices and {d.type for d in devices} == {"meta"}
    assert {t.device.type for t in packed.state_dict().values()} == {"cpu"} and not packed.training
    fake, _ = load_model(runs["qat"])
    ids = torch.randint(0, fake.config.vocab_size, (1, 20))
    assert torch.equal(_logits(packed, ids), _logits(fake, ids))
