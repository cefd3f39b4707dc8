"""Kimi K3 in transformers without remote code (issue 39, item 6): ``AutoConfig`` / ``AutoModelForCausalLM`` classes.

``import k3.interop.auto`` (`register`) adds ``model_type: kimi_k3`` to transformers' Auto classes. ``import k3``
alone does not: k3 never imports transformers (seconds of start-up, torchao and the compiler with it, that serving
does not need), and the package root may not import this floor (DESIGN's import rules). Then
``AutoModelForCausalLM.from_pretrained(DIR)`` loads a released checkpoint (reduced or whole) or a ``k3 export``
directory into `KimiK3ForCausalLM`: a ``PreTrainedModel`` around `K3ForCausalLM` (its weights loaded by
`K3ForCausalLM.from_pretrained`, which knows the release's layout and packed experts). ``dtype="auto"`` (lm-eval's
default) is the release's bf16; ``device_map`` may name one device.

Generation runs through ``GenerationMixin`` with our `DecoderState` as its cache (``outputs.cache``): the prompt is
prefilled once, then one token per step. Left-padded batches (``attention_mask`` with leading zeros, as
``generate`` and lm-eval send them) prefill each row without its padding and stack the states
(`DecoderState.stack`), so padding never enters a state; a mask with zeros anywhere but a row's start is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from k3.config.hf import from_release_dict
from k3.model.lm import K3ForCausalLM
from k3.model.state import DecoderState

__all__ = ["KimiK3Config", "KimiK3ForCausalLM", "register"]


class KimiK3Config(PretrainedConfig):
    """The release's ``config.json`` (``model_type: kimi_k3``), kept as transformers reads it; `k3_config` is ours."""

    model_type = "kimi_k3"

    def get_text_config(self, *args, **kwargs) -> KimiK3Config:
        """This config itself: its ``text_config`` is the release's nested dict, read by `k3_config`."""
        return self

    def k3_config(self):  # noqa: ANN201
        """Our `K3Config` of this release config (`k3.config.hf.from_release_dict`)."""
        return from_release_dict(self.to_dict())


@dataclass
class KimiK3Output(ModelOutput):
    """``logits [B, T, V]`` (fp32 where the model computes them so), the loss given ``labels``, and the cache."""

    loss: Tensor | None = None
    logits: Tensor | None = None
    cache: DecoderState | None = None


class KimiK3ForCausalLM(PreTrainedModel, GenerationMixin):
    """`K3ForCausalLM` behind transformers' model interface (``model``: ours)."""

    config_class = KimiK3Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # a recurrent state: no DynamicCache, no assisted decoding

    def __init__(self, config: KimiK3Config, model: K3ForCausalLM | None = None) -> None:
        super().__init__(config)
        self.model = model if model is not None else K3ForCausalLM(config.k3_config())
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is our DecoderState, made by `forward`

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args, config=None,  # noqa: ANN001
                        dtype: torch.dtype | str | None = None, **kwargs) -> KimiK3ForCausalLM:
        """A local release-layout directory (released checkpoint or ``k3 export``); ``dtype`` (or ``torch_dtype``)
        as transformers' (default fp32; ``"auto"``: the release's bf16). An option we do not implement (a hub
        revision, ``device_map``, quantization, an attention implementation) is refused, not ignored."""
        dtype = dtype if dtype is not None else kwargs.pop("torch_dtype", None)
        kwargs.pop("torch_dtype", None)
        device = _one_device(kwargs.pop("device_map", None))
        refused = sorted(k for k, v in kwargs.items()
                         if not (k in _HARMLESS or v in (None, False, "") or k == "revision" and v == "main"))
        if args or refused:
            raise ValueError(f"KimiK3ForCausalLM.from_pretrained: unsupported options {refused or list(args)}")
        path = str(pretrained_model_name_or_path)
        if not os.path.isdir(path):
            raise ValueError(f"{path}: expected a local directory in the release layout (no hub downloads here)")
        dtype = torch.bfloat16 if dtype == "auto" else getattr(torch, dtype) if isinstance(dtype, str) else dtype
        config = config if isinstance(config, KimiK3Config) else KimiK3Config.from_pretrained(path)
        model = K3ForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
        return cls(config, model if device is None else model.to(device)).eval()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: `K3ForCausalLM` initialises its own weights (SPEC's schemes), or they are loaded."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def prepare_inputs_for_generation(self, input_ids: Tensor, cache: DecoderState | None = None,
                                      attention_mask: Tensor | None = None, **kwargs) -> dict:
        """The tokens the cache has not consumed (the whole prompt first, then the newest token)."""
        new = input_ids if cache is None else input_ids[:, cache.position:]
        return {"input_ids": new, "cache": cache, "attention_mask": attention_mask}

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, cache: DecoderState | None = None,
                labels: Tensor | None = None, use_cache: bool | None = None, **kwargs) -> KimiK3Output:
        """Logits of every position of ``input_ids`` ``[B, T]`` (after ``cache``), the loss of ``labels`` (shifted
        inside, -100 ignored), and the state after them when ``use_cache`` is not False. Positions need no ids (no
        rotary embedding: NoPE MLA and KDA); embeddings in, attentions or hidden states out are refused."""
        unsupported = [k for k in ("inputs_embeds", "output_attentions", "output_hidden_states") if kwargs.get(k)]
        if unsupported:
            raise ValueError(f"KimiK3ForCausalLM.forward: {', '.join(unsupported)} not supported")
        if cache is None and attention_mask is not None and not bool(attention_mask.all()):
            logits, cache = self._prefill_left_padded(input_ids, attention_mask)
        else:
            state = cache if cache is not None else (None if use_cache is False else self.model.new_state(
                input_ids.shape[0]))
            logits, cache = self.model(input_ids, state=state)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                                     ignore_index=-100)
        return KimiK3Output(loss=loss, logits=logits, cache=cache)

    def _prefill_left_padded(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, DecoderState]:
        """Each row without its leading padding, then the states stacked; padded positions get zero logits."""
        lengths = attention_mask.sum(1).tolist()
        T = input_ids.shape[1]
        for row, n in zip(attention_mask.tolist(), lengths):
            if any(row[:T - n]) or not all(row[T - n:]):
                raise ValueError("attention_mask: only left padding (leading zeros in a row) is supported")
        logits = []
        states = []
        for ids, n in zip(input_ids, lengths):
            if n == 0:
                raise ValueError("attention_mask: a row with no tokens")
            row_logits, state = self.model(ids[None, T - n:], state=self.model.new_state(1))
            logits.append(torch.nn.functional.pad(row_logits, (0, 0, T - n, 0)))
            states.append(state)
        return torch.cat(logits), DecoderState.stack(states)


def _one_device(device_map: object) -> torch.device | None:
    """The device of a ``device_map`` that names one (``"cpu"``, ``"cuda:0"``, ``{"": device}``; ``"auto"``: CUDA
    when there is one); a map that splits the model is refused."""
    if device_map is None:
        return None
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device_map, str | int | torch.device):
        return torch.device(device_map) if not isinstance(device_map, int) else torch.device("cuda", device_map)
    raise ValueError(f"device_map: one device only (the model is not split across devices), got {device_map!r}")


_HARMLESS = {"trust_remote_code", "low_cpu_mem_usage", "local_files_only", "cache_dir", "token"}  # no effect here


def register() -> None:
    """Add ``kimi_k3`` to ``AutoConfig`` and ``AutoModelForCausalLM`` (again: nothing happens)."""
    try:
        AutoConfig.register("kimi_k3", KimiK3Config)
        AutoModelForCausalLM.register(KimiK3Config, KimiK3ForCausalLM)
    except ValueError:  # registered before
        pass


register()
