"""``k3 quantize`` (SPEC §7, §10): a checkpoint with its routed experts MXFP4-packed, 4.25 bits per weight.

Each routed expert's ``w1`` (gate), ``w3`` (up) and ``w2`` (down) becomes compressed-tensors'
``mxfp4-pack-quantized`` — ``weight_packed`` uint8 ``[out, in/2]`` + ``weight_scale`` E8M0 ``[out, in/32]``, the
released Kimi K3's layout — and ``config.json`` gains the matching ``quantization_config``; everything else is
kept as it was. `k3.model.checkpoint.load_model` loads it into `PackedExperts`, the module the release loads into.

Quantizing a QAT-trained checkpoint (``mx`` on, MXFP4 weights) is exact: the packed weights are the values its
forward pass fake-quantized to, so the packed model's logits equal the QAT model's. A full-precision checkpoint
is quantized after training (PTQ, round to nearest).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from k3.config import PACKED_ACTIVATIONS, MXConfig
from k3.model.checkpoint import WEIGHTS, load_model, save_model
from k3.model.lm import K3ForCausalLM
from k3.model.packed import PackedExperts, replace_experts
from k3.model.width import Experts

KEEP = PACKED_ACTIVATIONS[0]


def packed_config(mx: MXConfig, activations: str = KEEP) -> MXConfig:
    """The ``mx`` of the packed model: MXFP4 weights; inputs as ``activations`` says (``keep``: the model's own
    MX inputs if MX is on, else none, as the release)."""
    if activations not in PACKED_ACTIVATIONS:
        raise ValueError(f"activations = {activations!r}: expected one of {PACKED_ACTIVATIONS}")
    inputs = (mx.activation_format if mx.enabled else None) if activations == KEEP else (
        None if activations == "none" else activations)
    return MXConfig(enabled=True, weight_format="mxfp4", activation_format=inputs, block_size=32)


def pack_model(model: K3ForCausalLM, activations: str = KEEP) -> K3ForCausalLM:
    """``model`` with every routed `Experts` replaced by `PackedExperts` (in place) and its config's ``mx`` set
    to `packed_config`; experts already packed keep their codes."""
    mx = packed_config(model.config.mx, activations)

    def pack(experts: Experts) -> PackedExperts:  # weights in a format other than MXFP4 are refused by `pack`
        packed = experts if isinstance(experts, PackedExperts) else PackedExperts.pack(experts)
        packed.input_format = mx.activation_format
        return packed

    replace_experts(model, pack)
    model.config = dataclasses.replace(model.config, mx=mx)
    return model


def quantize_checkpoint(source: str | Path, out: str | Path, activations: str = KEEP) -> dict[str, object]:
    """Write ``source`` (a checkpoint or run directory) with packed routed experts to the new directory ``out``
    (atomically; an existing ``out`` is refused and left as it was). Returns what was done."""
    out = Path(out)
    if out.exists():
        raise ValueError(f"{out}: already exists; choose another --out (nothing was written)")
    model, tokenizer = load_model(Path(source))
    qat = model.config.mx.enabled
    pack_model(model, activations)
    save_model(out, model, tokenizer)
    return {"out": str(out), "mode": "exact (QAT weights)" if qat else "post-training (round to nearest)",
            "weights": "mxfp4", "inputs": model.config.mx.activation_format or "high precision",
            "bytes": (out / WEIGHTS).stat().st_size}
