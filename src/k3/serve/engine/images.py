"""What the engine needs of an image prompt (SPEC §6): a cheap check when it is queued, a digest for the prefix cache,
and its embeddings, computed on the engine's thread at its first prefill. Images reach the engine as
`VisualInput`s (`k3.tokenization.image`); the HTTP layer makes them from ``image_url`` parts (`k3.serve.api.images`).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from k3.model.lm import K3ForCausalLM
from k3.tokenization.image import VisualInput, batch


def check_prompt(model: K3ForCausalLM, prompt: list[int], images: list[VisualInput]) -> None:
    """The model has a vision encoder and ``prompt`` holds exactly the images' placeholder slots (a ValueError
    naming the mismatch otherwise; cheap: nothing is encoded)."""
    if model.vision is None:
        raise ValueError("images: this model has no vision encoder")
    slots, wanted = prompt.count(model.config.vision.media_token_id), sum(image.tokens for image in images)
    if slots != wanted:
        raise ValueError(f"prompt: {slots} media placeholders for images of {wanted} visual tokens")


def image_digest(images: list[VisualInput]) -> str:
    """A digest of the images' grids and pixels: the prefix cache shares states only between equal images."""
    digest = hashlib.sha256()
    for image in images:
        digest.update(repr(image.grid).encode())
        digest.update(image.pixel_values.numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def prompt_embeddings(model: K3ForCausalLM, prompt: list[int], images: list[VisualInput]) -> Tensor:
    """``[T, d]`` embeddings of ``prompt`` with ``images`` encoded into its placeholders (`embed_multimodal`)."""
    pixels, grids = batch(images)
    return model.embed_multimodal(torch.tensor([prompt], device=model.device), pixels, grids)[0]
