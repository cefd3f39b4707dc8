"""`K3ForCausalLM`: embedding, the KDA/MLA layer schedule over Block AttnRes depth, final norm, LM head.

``forward(input_ids | inputs_embeds, state) -> (logits, state)``: with a `DecoderState` the call
continues from it and returns the advanced state (the passed state is not modified); calling token by
token, in chunks, or on any split of the sequence gives the same logits and final state as one call.
A stacked state (`DecoderState.stack`) continues sequences of unequal lengths in one batch.
Without a state (training) nothing is cached and the returned state is None.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from k3.config import K3Config
from k3.model.depth import BlockAttnRes, Residual
from k3.sizing.memory import check_fits
from k3.model.norm import RMSNorm
from k3.model.pretrained import from_pretrained, save_pretrained
from k3.model.sequence.kda import KDALayer
from k3.model.sequence.mla import GatedMLA
from k3.model.state import DecoderState, Replay
from k3.model.vision import VisionModel
from k3.model.width import build_ffn


def _attn_res_parameters(config: K3Config) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """(pseudo-query, key gain) of one AttnRes retrieval: zeros and ones, or None where the config has none."""
    d, attn_res = config.hidden_size, config.attn_res
    query = nn.Parameter(torch.zeros(d)) if attn_res.enabled else None
    gain = nn.Parameter(torch.ones(d)) if attn_res.enabled and attn_res.key_gain else None
    return query, gain


def _query(query: Tensor | None, gain: Tensor | None) -> Tensor | None:
    """The effective query of a retrieval: ``query · (gain ⊙ rms(v)) = (query ⊙ gain) · rms(v)`` (SPEC §10)."""
    return query if gain is None else query * gain


class DecoderLayer(nn.Module):
    """One backbone layer (SPEC §3): retrieve → RMSNorm → KDA/MLA → retrieve again → RMSNorm → FFN/MoE → commit."""

    def __init__(self, config: K3Config, index: int) -> None:
        super().__init__()
        d = config.hidden_size
        self.kind = config.layer_kinds()[index]
        self.mixer = KDALayer(config) if self.kind == "kda" else GatedMLA(config)
        self.ffn = build_ffn(config, index)
        self.mixer_norm = RMSNorm(d, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, config.rms_norm_eps)
        # AttnRes pseudo-queries, zero-initialised: uniform weights over the depth sources at the start; with
        # `attn_res.key_gain` each retrieval's key RMSNorm also has a learnable gain (the release's *_res_norm).
        self.mixer_query, self.mixer_key_gain = _attn_res_parameters(config)
        self.ffn_query, self.ffn_key_gain = _attn_res_parameters(config)
        self.capture: str | None = None  # "inputs" / "blocks": keep a feature of the last call in `captured`
        self.captured: Tensor | None = None

    def forward(self, depth: BlockAttnRes | Residual, state, padding: Tensor | None = None, context=None):
        """``context`` (training, no state): an object whose ``kda(mixer, x)`` / ``mla(mixer, x)`` run the sequence
        mixer over a sequence split across processes (`k3.dist.context.ContextParallel`)."""
        x = self.mixer_retrieve(depth)
        if context is not None:
            mixer = context.kda if self.kind == "kda" else context.mla
            return self.feed_forward(depth, mixer(self.mixer, x)), None
        a, state = self.mix(x, state, padding)
        return self.feed_forward(depth, a), state

    def mixer_retrieve(self, depth: BlockAttnRes | Residual) -> Tensor:
        """The sequence mixer's normalised input, retrieved over depth. While `capture` is on, the retrieved stream
        (before the norm: the layer's view of the model so far, the feature a speculative draft reads) is kept in
        ``captured``."""
        h = depth.retrieve(_query(self.mixer_query, self.mixer_key_gain))
        if self.capture == "inputs":
            self.captured = h
        return self.mixer_norm(h)

    def mix(self, x: Tensor, state, padding: Tensor | None = None, record: list | None = None):
        """The sequence mixer alone (KDA or MLA) on normalised input ``x``; a KDA mixer appends its `KDAReplay` to
        ``record`` when given."""
        return self.mixer(x, state, record) if self.kind == "kda" else self.mixer(x, state, padding=padding)

    def feed_forward(self, depth: BlockAttnRes | Residual, a: Tensor) -> BlockAttnRes | Residual:
        """Retrieve after the mixer output ``a``, apply the FFN / MoE, commit both outputs. While `capture` is
        "blocks", the output of the AttnRes block this layer ends (`BlockAttnRes.block_output`) is kept in
        ``captured``."""
        f = self.ffn(self.ffn_norm(depth.retrieve_after(a, _query(self.ffn_query, self.ffn_key_gain))))
        depth = depth.commit(a, f)
        if self.capture == "blocks":
            self.captured = depth.block_output()
        return depth


class K3ForCausalLM(nn.Module):
    def __init__(self, config: K3Config) -> None:
        """Build on the default device; a model whose parameters would not fit in its free memory is a
        `ValueError` stating both sizes, raised before anything is allocated (`k3.sizing.memory`)."""
        super().__init__()
        self.config = config.validate()
        check_fits(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.final_query, self.final_key_gain = _attn_res_parameters(config)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(d, config.vocab_size, bias=False)
        nn.init.normal_(self.embed_tokens.weight, std=config.initializer_range)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=config.initializer_range)
        self.vision = VisionModel(config) if config.vision.enabled else None  # MoonViT-V2 + projector (SPEC §6)

    @classmethod
    def from_pretrained(cls, directory: str, dtype: torch.dtype = torch.float32, packed: bool = True) -> K3ForCausalLM:
        """Load a released Kimi K3 directory (config.json + memory-mapped shards; `k3.model.pretrained`). Routed
        experts stay MXFP4-packed unless ``packed=False``; vision tensors are skipped (``model.release.skipped``)."""
        return from_pretrained(cls, directory, dtype, packed)

    def save_pretrained(self, directory: str, max_shard_bytes: int = 5 * 2**30) -> list:
        """Write the release layout (`k3.model.pretrained.save_pretrained`); returns the shard paths."""
        return save_pretrained(self, directory, max_shard_bytes)

    @property
    def device(self) -> torch.device:
        """Where the model's weights are: the device of every tensor made for it (inputs, states, masks)."""
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' floating-point type (the routers' stay fp32 whatever it is)."""
        return self.embed_tokens.weight.dtype

    def new_state(self, batch_size: int, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> DecoderState:
        """An empty state (no tokens consumed) for ``batch_size`` sequences."""
        device = device if device is not None else self.device
        dtype = dtype or self.embed_tokens.weight.dtype
        return DecoderState([layer.mixer.new_state(batch_size, device=device, dtype=dtype) for layer in self.layers])

    def embed(self, input_ids: Tensor | None, inputs_embeds: Tensor | None) -> Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        d, vocab = self.config.hidden_size, self.config.vocab_size
        if inputs_embeds is not None:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != d or not inputs_embeds.is_floating_point():
                raise ValueError(f"inputs_embeds: expected a float tensor [B, T, {d}], got "
                                 f"{inputs_embeds.dtype} {list(inputs_embeds.shape)}")
            return inputs_embeds
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids: expected an integer tensor [B, T], got {input_ids.dtype} "
                             f"{list(input_ids.shape)}")
        if input_ids.numel() and not torch.compiler.is_compiling() and (  # compiled: `k3.model.compiled_step` checks
                int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise ValueError(f"input_ids: token ids must lie in [0, vocab_size={vocab}), got "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        return self.embed_tokens(input_ids)

    def embed_multimodal(self, input_ids: Tensor, pixel_values: Tensor | None = None,
                         grid_thw: Tensor | list | None = None) -> Tensor:
        """``[B, T, d]``: text slots read the embedding table, the ``vision.media_token_id`` slots read the visual
        tokens of ``(pixel_values, grid_thw)`` (`k3.model.vision`), filled in order — batch row, then position
        (SPEC §6). The count of slots must equal the count of visual tokens."""
        x = self.embed(input_ids, None)
        if pixel_values is None:
            return x
        if self.vision is None:
            raise ValueError("pixel_values: this model has no vision encoder (vision.enabled = false)")
        visual = self.vision(pixel_values, grid_thw).to(x.dtype)
        slots = input_ids == self.config.vision.media_token_id
        if int(slots.sum()) != visual.shape[0]:
            raise ValueError(f"input_ids hold {int(slots.sum())} media placeholders (token "
                             f"{self.config.vision.media_token_id}) but the images give {visual.shape[0]} visual "
                             f"tokens")
        return x.masked_scatter(slots.unsqueeze(-1), visual)

    def _start_depth(self, x: Tensor) -> BlockAttnRes | Residual:
        """The depth state after the embedding ``x``: Block AttnRes sources, or a plain residual stream."""
        cfg = self.config
        if cfg.attn_res.enabled:
            return BlockAttnRes.start(x, cfg.attn_res.block_size, cfg.rms_norm_eps)
        return Residual.start(x)

    def _logits(self, depth: BlockAttnRes | Residual, rows: Tensor | None = None) -> Tensor:
        """Final retrieval, norm and LM head (tied or not); ``rows`` picks positions of a flat ``[1, N]`` batch."""
        h = self.norm(depth.retrieve(_query(self.final_query, self.final_key_gain)))
        if rows is not None:
            h = h[0, rows]
        return h @ self.embed_tokens.weight.T if self.lm_head is None else self.lm_head(h)

    @contextlib.contextmanager
    def capture(self, layers: list[int], source: str = "inputs") -> Iterator[list[DecoderLayer]]:
        """Within the block, each of ``layers`` (0-based) keeps a feature of the last call in ``.captured``
        ``[B, T, d]`` (for `forward_groups`, ``[1, N, d]`` over all groups' tokens): its retrieved input
        (``source`` "inputs") or the output of the AttnRes block it ends ("blocks", `k3.model.draft`)."""
        if source not in ("inputs", "blocks"):
            raise ValueError(f"capture: source must be 'inputs' or 'blocks', got {source!r}")
        chosen = [self.layers[i] for i in layers]
        # Plain attributes, set past `nn.Module.__setattr__`'s checks: a serving engine with an EAGLE drafter switches
        # them around every step (12 checked assignments took ~60 µs per 0.8-ms compiled `mini` step under cProfile).
        for layer in chosen:
            object.__setattr__(layer, "capture", source)
            object.__setattr__(layer, "captured", None)
        try:
            yield chosen
        finally:
            for layer in chosen:
                object.__setattr__(layer, "capture", None)
                object.__setattr__(layer, "captured", None)

    def forward(self, input_ids: Tensor | None = None, inputs_embeds: Tensor | None = None,
                state: DecoderState | None = None, pixel_values: Tensor | None = None,
                grid_thw: Tensor | list | None = None, context=None) -> tuple[Tensor, DecoderState | None]:
        """Logits ``[B, T, V]`` and, given ``state``, the advanced state. With ``pixel_values`` and ``grid_thw``
        the visual tokens fill the media placeholders of ``input_ids`` (`embed_multimodal`); to prefill an image
        prompt in chunks, pass slices of `embed_multimodal`'s output as ``inputs_embeds``. With ``context``
        (`k3.dist.context.ContextParallel`; no ``state``) the input is this process's segment of a sequence split
        across processes (SPEC §8)."""
        if pixel_values is not None:
            if input_ids is None:
                raise ValueError("pixel_values: pass input_ids holding the media placeholders")
            inputs_embeds, input_ids = self.embed_multimodal(input_ids, pixel_values, grid_thw), None
        x = self.embed(input_ids, inputs_embeds)
        B, T = x.shape[:2]
        if T == 0 and context is None:  # a context-parallel segment may be empty
            raise ValueError("input_ids: the sequence is empty (T = 0)")
        if state is not None:
            if len(state.layers) != len(self.layers) or state.batch_size != B:
                raise ValueError(f"state: expected {len(self.layers)} layers and batch size {B}, got "
                                 f"{len(state.layers)} layers and batch size {state.batch_size}")
        if context is not None and state is not None:
            raise ValueError("context: context parallelism runs without a DecoderState (training)")
        depth = self._start_depth(x)
        layer_states = []
        for i, layer in enumerate(self.layers):
            depth, layer_state = layer(depth, None, None, context) if state is None else layer(
                depth, state.layers[i], state.padding)
            layer_states.append(layer_state)
        logits = self._logits(depth)
        if state is None:
            return logits, None
        last_sources = depth.stacked()[:, :, -1].transpose(0, 1)  # [B, S, d]
        return logits, DecoderState(layer_states, last_sources, state.position + T, state.padding)

    def forward_groups(self, groups: list[tuple[Tensor, DecoderState]], full: list[bool] | None = None,
                       replay: list[bool] | None = None) -> list[tuple[Tensor, DecoderState]]:
        """Continue several batches in one pass (serving: decode rows and a prefill chunk together).

        ``groups`` are ``(input_ids [B_g, T_g], state_g)`` (or embeddings ``[B_g, T_g, d]``, e.g. a chunk of
        `embed_multimodal`'s output, in place of the ids); returns per group the logits of each row's last
        position ``[B_g, V]`` (with ``full[g]``: of every position, ``[B_g·T_g, V]``, rows first) and the
        advanced state — what `forward` gives per group. With ``replay[g]`` (a speculative verification, SPEC §8)
        the returned state carries a `Replay` of the whole group: for batch 1 ``state.accept(n)`` gives the state
        after only the first n tokens; a batch (a stacked state, each row's draft right-padded to T: causal, so its
        valid positions do not see the padding) is split with `DecoderState.unstack` into rows that each accept on
        their own. Token-wise work (embedding, AttnRes, norms, FFN / MoE, head) runs once over all
        tokens; only the sequence mixers run per group.
        """
        if not groups:
            raise ValueError("groups: expected at least one (input_ids, state) pair")
        for g, (ids, state) in enumerate(groups):
            if ids.dim() != (3 if ids.is_floating_point() else 2) or state is None or \
                    state.batch_size != ids.shape[0] or len(state.layers) != len(self.layers):
                raise ValueError(f"groups[{g}]: expected input_ids [B, T] (or embeddings [B, T, d]) and a "
                                 f"DecoderState of batch size B")
        shapes = [ids.shape[:2] for ids, _ in groups]
        x = torch.cat([(self.embed(None, ids) if ids.is_floating_point() else self.embed(ids, None))
                       .reshape(1, -1, self.config.hidden_size) for ids, _ in groups], 1)
        depth = self._start_depth(x)
        sizes = [B * T for B, T in shapes]
        layer_states: list[list] = [[] for _ in groups]
        replay = replay or [False] * len(groups)
        records: list[list] = [[] for _ in groups]  # per replayed group, a KDAReplay or None per layer
        for i, layer in enumerate(self.layers):
            h = layer.mixer_retrieve(depth)
            outputs = []
            for g, (part, (_, state)) in enumerate(zip(h.split(sizes, dim=1), groups)):
                record = [] if replay[g] and layer.kind == "kda" else None
                a, layer_state = layer.mix(part.reshape(*shapes[g], -1), state.layers[i], state.padding, record)
                outputs.append(a.reshape(1, -1, a.shape[-1]))
                layer_states[g].append(layer_state)
                records[g].append(record[0] if record else None)
            depth = layer.feed_forward(depth, torch.cat(outputs, dim=1))
        full = full or [False] * len(groups)
        starts = [0, *itertools.accumulate(sizes)][:-1]  # flat index of each group's first token
        arange = functools.partial(torch.arange, device=self.device)
        last = [start + T - 1 + T * arange(B) for start, (B, T) in zip(starts, shapes)]  # each row's last token
        wanted = [arange(start, start + B * T) if f else rows for start, (B, T), f, rows in
                  zip(starts, shapes, full, last)]
        logits = self._logits(depth, torch.cat(wanted))
        stacked = depth.stacked()  # [S, 1, N, d]
        sources = stacked[:, 0, torch.cat(last)].transpose(0, 1)  # [rows, S, d]
        out, offset, source = [], 0, 0
        for g, ((B, T), (_, state)) in enumerate(zip(shapes, groups)):
            n = len(wanted[g])
            pending = None
            if replay[g]:
                run = stacked[:, 0, starts[g]:starts[g] + B * T].transpose(0, 1).unflatten(0, (B, T))  # [B, T, S, d]
                pending = Replay(state, records[g], run)
            out.append((logits[offset:offset + n], DecoderState(layer_states[g], sources[source:source + B],
                                                                state.position + T, state.padding, pending)))
            offset, source = offset + n, source + B
        return out
