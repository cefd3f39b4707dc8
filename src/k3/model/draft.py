"""The EAGLE-3 draft model for speculative decoding (SPEC §8).

The draft reads the target's features at a low, a middle and a high depth (`K3ForCausalLM.capture`). Where the K3
report takes them (issue 36), they are the **outputs of AttnRes blocks 1, 4 and the last** (``feature_source``
"blocks": each block's sum, the depth source later layers retrieve; a target of 3–4 blocks takes blocks 1, the
middle and the last). EAGLE-3's own rule, for targets without three AttnRes blocks, is the *retrieved input* of
layers ``(2, L//2, L−3)`` ("inputs": the stream a layer reads before its mixer norm). Per position::

    F   = W_fuse [f_low ; f_mid ; f_high]                      # W_fuse initialised [0 0 I]: F = f_high at init
    z   = W_in [RMSNorm(embed(token)) ; RMSNorm(h)]            # h = F, or the draft's own previous output
    h'  = h + Mixer(RMSNorm(z))                                # one KDA or Gated MLA layer, explicit causal state
    h'' = h' + GLU(RMSNorm(h'))                                # SiTU / SwiGLU, as the target's dense FFN
    logits = RMSNorm(h'') W_headᵀ                              # the target's LM head (rows d2t when reduced)

Draft position i pairs the feature of token i with token i + 1 and predicts token i + 2; its output ``h''`` stands
in for the next position's feature when the draft continues on its own (`propose`). The embedding and LM head
are the frozen target's own modules, referenced and never copied or saved; with a reduced draft vocabulary the
head uses only the rows ``d2t`` (draft id → target id).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from k3.config import K3Config
from k3.files import atomic_write, write_text
from k3.model import checkpoint as model_checkpoint
from k3.model.checkpoint import atomic_directory, non_finite, read_verified_json, verified
from k3.model.lm import K3ForCausalLM
from k3.model.norm import RMSNorm
from k3.model.sequence.kda import KDALayer, KDAState
from k3.model.sequence.mla import GatedMLA, MLACache
from k3.model.width import GLU

__all__ = ["DraftConfig", "DraftState", "EagleDraft", "block_ends", "default_feature_blocks",
           "default_feature_layers"]

DRAFT_WEIGHTS, DRAFT_CONFIG = "draft.safetensors", "draft.json"
DRAFT_FORMAT, DRAFT_VERSION = "k3-eagle3-draft", 2
LAYER_KINDS = ("mla", "kda")
FEATURE_SOURCES = ("blocks", "inputs")
#: The target's config fields the draft is built from; a draft loads only onto a target that agrees on them.
TARGET_FIELDS = ("vocab_size", "hidden_size", "num_layers", "rms_norm_eps", "kda", "mla", "situ", "moe.dense_hidden",
                 "moe.activation", "attn_res")

DraftState = KDAState | MLACache


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers ``(2, L//2, L−3)`` (0-based). Below 7 layers those are not increasing
    inside ``[0, L)``; tiny models take ``(L//4, L//2, L−1)`` instead."""
    if num_layers >= 7:
        return 2, num_layers // 2, num_layers - 3
    return num_layers // 4, num_layers // 2, num_layers - 1


def block_ends(config: K3Config) -> list[int]:
    """The last layer (0-based) of each AttnRes block of ``config``'s target, the last block maybe partial; [] without
    AttnRes."""
    if not config.attn_res.enabled:
        return []
    size = config.attn_res.block_size
    return [min(end, config.num_layers) - 1 for end in range(size, config.num_layers + size, size)]


def default_feature_blocks(num_blocks: int) -> tuple[int, int, int] | None:
    """The K3 report's AttnRes blocks ``(1, 4, last)`` (1-based); ``(1, middle, last)`` for 3–4 blocks; None below."""
    if num_blocks >= 5:
        return 1, 4, num_blocks
    return (1, (num_blocks + 1) // 2, num_blocks) if num_blocks >= 3 else None


@dataclass
class DraftConfig:
    """``feature_layers``: the target layers (0-based) where the three features are captured, low to high;
    ``feature_source``: what is captured there — "blocks", the output of the AttnRes block each layer ends, or
    "inputs", each layer's retrieved input (None for both: the module docstring's defaults); ``layer_kind``: the
    draft's mixer, "mla" or "kda"; ``draft_vocab_size``: the size of a reduced draft vocabulary (None: the
    target's)."""

    feature_layers: tuple[int, int, int] | None = None
    layer_kind: str = "mla"
    draft_vocab_size: int | None = None
    feature_source: str | None = None

    def resolved(self, target: K3Config) -> DraftConfig:
        """This config with explicit feature layers and source, checked against the ``target``'s config."""
        ends, num_layers = block_ends(target), target.num_layers
        source = self.feature_source or ("blocks" if default_feature_blocks(len(ends)) else "inputs")
        if source not in FEATURE_SOURCES:
            raise ValueError(f"draft.feature_source = {source!r} is invalid: must be one of {FEATURE_SOURCES}")
        layers = self.feature_layers
        if layers is None and source == "blocks":
            blocks = default_feature_blocks(len(ends))
            if blocks is None:
                raise ValueError(f"draft.feature_source = 'blocks' needs a target of at least three AttnRes blocks; "
                                 f"this one has {len(ends)}")
            layers = tuple(ends[b - 1] for b in blocks)
        layers = default_feature_layers(num_layers) if layers is None else tuple(layers)
        if len(layers) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in layers):
            raise ValueError(f"draft.feature_layers = {self.feature_layers!r} is invalid: must be three layer "
                             f"indices in [0, {num_layers})")
        if source == "blocks" and ends and not set(layers) <= set(ends):
            raise ValueError(f"draft.feature_layers = {layers!r} is invalid for feature_source 'blocks': each must "
                             f"end an AttnRes block (layers {ends})")
        if self.layer_kind not in LAYER_KINDS:
            raise ValueError(f"draft.layer_kind = {self.layer_kind!r} is invalid: must be one of {LAYER_KINDS}")
        if self.draft_vocab_size is not None and not (isinstance(self.draft_vocab_size, int)
                                                      and self.draft_vocab_size > 0):
            raise ValueError(f"draft.draft_vocab_size = {self.draft_vocab_size!r} is invalid: a positive integer "
                             f"or None")
        return DraftConfig(layers, self.layer_kind, self.draft_vocab_size, source)


def _target_fields(target: K3ForCausalLM) -> dict[str, Any]:
    config = target.config.to_dict()
    out = {}
    for name in TARGET_FIELDS:
        value = config
        for part in name.split("."):
            value = value[part]
        out[name] = value
    return out


class EagleDraft(nn.Module):
    """EAGLE-3 draft over a frozen ``target`` (SPEC §8); see the module docstring for the arithmetic.

    ``d2t`` ``[draft_vocab_size]`` (int64, distinct target ids) is required exactly when the config reduces the
    vocabulary. The draft is placed on the target's device and dtype.
    """

    d2t: Tensor | None
    target: K3ForCausalLM

    def __init__(self, target: K3ForCausalLM, config: DraftConfig | None = None, d2t: Tensor | None = None) -> None:
        super().__init__()
        cfg = target.config
        self.config = (config or DraftConfig()).resolved(cfg)
        # A reference, not a submodule: the target's weights are not the draft's parameters nor in its state dict.
        object.__setattr__(self, "target", target)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fuse_proj = nn.Linear(3 * d, d, bias=False)
        self.embed_norm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.in_proj = nn.Linear(2 * d, d, bias=False)
        self.mixer_norm = RMSNorm(d, eps)
        self.mixer = GatedMLA(cfg) if self.config.layer_kind == "mla" else KDALayer(cfg)
        self.ffn_norm = RMSNorm(d, eps)
        self.ffn = GLU(d, cfg.moe.dense_hidden, cfg.moe.activation, cfg.situ, cfg.initializer_range)
        self.norm = RMSNorm(d, eps)
        nn.init.normal_(self.in_proj.weight, std=cfg.initializer_range)
        with torch.no_grad():
            self.fuse_proj.weight.zero_()
            self.fuse_proj.weight[:, 2 * d:] = torch.eye(d)
        self.register_buffer("d2t", self._check_d2t(d2t, cfg.vocab_size))
        weight = target.embed_tokens.weight
        self.to(device=weight.device, dtype=weight.dtype)

    def _check_d2t(self, d2t: Tensor | None, vocab: int) -> Tensor | None:
        n = self.config.draft_vocab_size
        if n is None:
            if d2t is not None:
                raise ValueError("d2t: given, but draft_vocab_size is None (the draft uses the target's vocabulary)")
            return None
        if (not isinstance(d2t, Tensor) or d2t.shape != (n,) or d2t.dtype != torch.int64 or int(d2t.min()) < 0
                or int(d2t.max()) >= vocab or len(d2t.unique()) != n):
            got = f"{d2t.dtype} {list(d2t.shape)}" if isinstance(d2t, Tensor) else repr(d2t)
            raise ValueError(f"d2t: expected {n} distinct int64 target ids in [0, {vocab}), got {got}")
        return d2t.clone()

    # ------------------------------------------------------------------ arithmetic
    def fuse(self, features: list[Tensor]) -> Tensor:
        """``W_fuse [low ; mid ; high]``: the three captured target features ``[..., d]`` → ``[..., d]``."""
        if len(features) != 3 or any(f.shape != features[0].shape for f in features):
            raise ValueError(f"features: expected three tensors of one shape [..., d] (low, mid, high), got "
                             f"{[list(f.shape) for f in features]}")
        return self.fuse_proj(torch.cat(features, dim=-1))

    def head_weight(self) -> Tensor:
        """The target's LM head rows the draft scores: ``[V_draft, d]``."""
        target = self.target
        weight = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
        return weight if self.d2t is None else weight[self.d2t]

    def new_state(self, batch_size: int) -> DraftState:
        """An empty causal state (no positions consumed) of the draft layer, on the draft's device and dtype."""
        weight = self.in_proj.weight
        return self.mixer.new_state(batch_size, device=weight.device, dtype=weight.dtype)

    def forward(self, tokens: Tensor, hidden: Tensor,
                state: DraftState | None = None) -> tuple[Tensor, Tensor, DraftState | None]:
        """``tokens`` ``[B, T]`` (target ids), ``hidden`` ``[B, T, d]`` (fused target features or the draft's own
        outputs) → ``(logits [B, T, V_draft], hidden_out [B, T, d], state)``. With a state the call continues it
        and returns the advanced state (the given one is not modified); token by token equals one call. Without
        one (training) the call is causal within ``tokens`` and returns None."""
        a, state = self.mixer(self._mixer_input(tokens, hidden), state)
        return *self._outputs(hidden, a), state

    def entries(self, tokens: Tensor, hidden: Tensor) -> MLACache:
        """An MLA draft's cache entries for ``tokens`` ``[B, T]`` with ``hidden`` ``[B, T, d]``: what reading those
        positions appends (training's prefix for `chain_step`)."""
        return self._mla().cache_entries(self._mixer_input(tokens, hidden))

    def chain_step(self, tokens: Tensor, hidden: Tensor, prefix: MLACache, chain: list[MLACache]
                   ) -> tuple[Tensor, Tensor, MLACache]:
        """`forward` with EAGLE-3's training-time attention (`GatedMLA.chain_step`): position i drafts the next token
        of the chain after prefix position i, seeing ``prefix`` ≤ i and its ``chain``'s entries at i, as a draft
        decoding after position i does. Returns ``(logits, hidden_out, this step's entries)``."""
        a, entry = self._mla().chain_step(self._mixer_input(tokens, hidden), prefix, chain)
        return *self._outputs(hidden, a), entry

    def _outputs(self, hidden: Tensor, mixed: Tensor) -> tuple[Tensor, Tensor]:
        """The logits and hidden output after the mixer's output ``mixed``: residual, FFN, norm, the LM head."""
        h = hidden + mixed
        h = h + self.ffn(self.ffn_norm(h))
        return self.norm(h) @ self.head_weight().T, h

    def _mla(self) -> GatedMLA:
        if not isinstance(self.mixer, GatedMLA):
            raise ValueError("EAGLE-3's training-time attention needs an MLA draft (layer_kind 'mla'); a KDA draft's "
                             "state is recurrent")
        return self.mixer

    def read(self, tokens: Tensor, hidden: Tensor, state: DraftState) -> DraftState:
        """The state after ``forward(tokens, hidden, state)``, without what only the outputs need (the FFN and the
        LM head): how the draft catches up on positions the target consumed."""
        return self.mixer(self._mixer_input(tokens, hidden), state)[1]

    def _mixer_input(self, tokens: Tensor, hidden: Tensor) -> Tensor:
        """The draft layer's mixer input: the normed token embeddings and features, projected and normed."""
        d = self.in_proj.out_features
        if tokens.dim() != 2 or hidden.shape != (*tokens.shape, d):
            raise ValueError(f"tokens [B, T] and hidden [B, T, {d}] expected, got {list(tokens.shape)} and "
                             f"{list(hidden.shape)}")
        e = self.embed_norm(self.target.embed(tokens, None))
        return self.mixer_norm(self.in_proj(torch.cat([e, self.hidden_norm(hidden)], dim=-1)))

    def to_target(self, logits: Tensor) -> Tensor:
        """Draft-vocabulary logits ``[..., V_draft]`` as target-vocabulary logits (−inf where no draft id maps)."""
        if self.d2t is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.target.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.d2t, logits)

    @torch.no_grad()
    def propose(self, feature: Tensor, token: int, state: DraftState, gamma: int, params: Any,
                probabilities: Callable[[Tensor, Any], Tensor], generator: torch.Generator | None = None,
                step: Callable | None = None) -> tuple[list[int], Tensor, DraftState]:
        """Draft ``gamma`` tokens for one sequence (SPEC §8).

        ``feature`` ``[d]``: the fused target feature at the last accepted position; ``token``: the token after it
        (the one the target just chose); ``state``: the draft's batch-1 state before that position. Each step
        turns the draft's logits into target-vocabulary probabilities with ``probabilities(row [V], params)``
        (temperature / top-k / top-p as the target's sampler applies them) and takes the argmax when
        ``params.temperature == 0``, else a sample. Returns ``(tokens, q [gamma, V], state)``: the drafted target
        ids, the distribution each was drawn from and the state after the ``gamma`` positions consumed. ``step``
        runs a position in place of this module's forward (a compiled forward).
        """
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma: expected a positive integer, got {gamma!r}")
        hidden = feature.reshape(1, 1, -1).to(self.in_proj.weight.dtype)
        current = torch.tensor([[token]], device=hidden.device)
        drafted, qs = [], []
        for _ in range(gamma):
            logits, hidden, state = (step or self)(current, hidden, state)
            row = self.to_target(logits[0, -1].to(torch.promote_types(logits.dtype, torch.float32)))
            q = probabilities(row, params)
            pick = row.argmax() if params.temperature == 0 else torch.multinomial(q, 1, generator=generator)[0]
            drafted.append(int(pick))
            qs.append(q)
            current = pick.reshape(1, 1)
        return drafted, torch.stack(qs), state

    def greedy(self, token: Tensor, feature: Tensor, state: DraftState, gamma: int) -> Tensor:
        """`propose` at temperature 0 as one call: ``token`` ``[1, 1]`` (the token after the last accepted
        position), ``feature`` ``[1, 1, d]`` (its fused target feature) → the ``gamma`` drafted target ids ``[gamma]``.
        Each step's pick stays a tensor that feeds the next, so a compiled chain runs without a host round trip
        between drafts; the state is read, not returned."""
        hidden, picks = feature.to(self.in_proj.weight.dtype), []
        for _ in range(gamma):
            logits, hidden, state = self(token, hidden, state)
            token = logits[:, -1:].argmax(-1)  # the draft vocabulary's argmax is the mapped row's (`to_target`)
            if self.d2t is not None:
                token = self.d2t[token]
            picks.append(token)
        return torch.cat(picks, dim=-1)[0]

    # ------------------------------------------------------------------ checkpoints
    def write(self, directory: Path) -> None:
        """``draft.safetensors`` (the draft's own tensors, finite; never the target's) and ``draft.json``."""
        tensors = {name: t.detach().contiguous() for name, t in self.state_dict().items()}
        bad = non_finite(tensors)
        if bad is not None:
            raise ValueError(f"{directory / DRAFT_WEIGHTS}: not saved: tensor {bad!r} has non-finite values")
        with atomic_write(directory / DRAFT_WEIGHTS) as path:
            save_file(tensors, str(path))
        write_text(directory / DRAFT_CONFIG, json.dumps({"format": DRAFT_FORMAT, "version": DRAFT_VERSION,
                                                         "draft": asdict(self.config),
                                                         "target": _target_fields(self.target)}, indent=2))

    def save(self, directory: str | Path) -> Path:
        """Write `write`'s files and a checksum manifest into ``directory`` atomically."""
        directory = Path(directory)
        with atomic_directory(directory) as tmp:
            self.write(tmp)
        return directory

    @classmethod
    def load(cls, directory: str | Path, target: K3ForCausalLM) -> EagleDraft:
        """The draft saved in ``directory`` (or the newest checkpoint of a ``k3 train-draft`` run directory) over
        ``target``; checksums are verified and a mismatch with the target names the file and field."""
        ckpt = _resolve(Path(directory))
        path = ckpt / DRAFT_CONFIG
        data = read_verified_json(ckpt, DRAFT_CONFIG)
        try:
            if data.get("format") != DRAFT_FORMAT or data.get("version") != DRAFT_VERSION:
                raise ValueError(f"expected format {DRAFT_FORMAT!r} version {DRAFT_VERSION}")
            saved = data["draft"]
            config = DraftConfig(tuple(saved["feature_layers"]), saved["layer_kind"], saved["draft_vocab_size"],
                                 saved["feature_source"])
            recorded = data["target"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{path}: cannot read the draft config ({type(err).__name__}: {err})") from err
        mine = _target_fields(target)
        for name in TARGET_FIELDS:
            if recorded.get(name) != mine[name]:
                raise ValueError(f"{path}: the draft was trained for a target with {name} = {recorded.get(name)!r}, "
                                 f"this target has {mine[name]!r}")
        weights = verified(ckpt, DRAFT_WEIGHTS)
        try:
            tensors = load_file(str(weights))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{weights}: cannot read the draft's tensors ({err})") from err
        try:
            draft = cls(target, config, tensors.get("d2t"))
        except ValueError as err:
            raise ValueError(f"{weights}: {err}") from err
        expected = draft.state_dict()
        for name in sorted(expected.keys() | tensors.keys()):
            if name not in tensors or name not in expected or tensors[name].shape != expected[name].shape:
                raise ValueError(f"{weights}: tensor {name!r} does not match the draft (missing, unexpected or of "
                                 f"another shape)")
        bad = non_finite(tensors)
        if bad is not None:
            raise ValueError(f"{weights}: tensor {bad!r} has non-finite values (NaN or infinity)")
        draft.load_state_dict(tensors, strict=True)
        return draft.to(device=target.device, dtype=target.dtype)


def _resolve(path: Path) -> Path:
    """A draft directory, or the newest checkpoint of a run directory holding draft checkpoints."""
    if (path / DRAFT_CONFIG).exists():
        return path
    found = model_checkpoint.latest_checkpoint(path, lambda p: verified(p, DRAFT_WEIGHTS)) if path.is_dir() else None
    if found is None:
        raise ValueError(f"{path}: no draft here (expected {DRAFT_CONFIG} and {DRAFT_WEIGHTS}, or a run directory "
                         f"with draft checkpoints)")
    return found
