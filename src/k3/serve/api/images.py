"""Images in requests (issue 16, item 4; SPEC §6): OpenAI ``image_url`` content parts with ``data:`` URLs -> model
inputs.

`ImageParts` is what a chat renderer calls for each ``image_url`` part: it decodes the data URL (PNG, JPEG,
WebP, GIF; transparency composited, `k3.tokenization.image`), keeps and returns its `VisualInput` (the placeholder
slots the image takes, and its size). Anything wrong — a URL that is not ``data:image/…;base64``, bytes that do
not decode, more images than the server allows — is a ValueError naming the part (a 400). This server never
fetches a remote URL.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from k3.tokenization.image import VisualInput, image_input

_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp|gif);base64,(.*)", re.DOTALL | re.IGNORECASE)
MAX_IMAGE_BYTES = 20 * 2**20


def decode_data_url(url: Any, where: str) -> bytes:
    """The bytes of a ``data:image/{png,jpeg,webp,gif};base64,…`` URL."""
    if not isinstance(url, str):
        raise ValueError(f"{where}: expected a string URL")
    found = _DATA_URL.fullmatch(url.strip())
    if found is None:
        what = "a remote URL (this server does not fetch)" if url.startswith(("http://", "https://")) else \
            "not a data:image/png|jpeg|webp|gif;base64 URL"
        raise ValueError(f"{where}: {what}; send the image inline as a base64 data URL")
    if len(found.group(2)) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"{where}: the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB")
    try:
        return base64.b64decode(found.group(2), validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{where}: invalid base64 ({err})") from err


class ImageParts:
    """Collects a request's images in order; called once per ``image_url`` part with the part and its location."""

    def __init__(self, patch_budget: int, max_images: int) -> None:
        self.patch_budget, self.max_images = patch_budget, max_images
        self.inputs: list[VisualInput] = []

    def __call__(self, part: dict, where: str) -> VisualInput:
        if len(self.inputs) >= self.max_images:
            raise ValueError(f"{where}: more than {self.max_images} images in one request")
        image_url = part.get("image_url")
        if isinstance(image_url, dict):
            unknown = sorted(set(image_url) - {"url", "detail"})
            if unknown:
                raise ValueError(f"{where}.image_url.{unknown[0]}: not supported by this server")
            if image_url.get("detail", "auto") != "auto":
                raise ValueError(f"{where}.image_url.detail: only 'auto' is supported (images are seen at up to "
                                 f"{self.patch_budget} patches), got {image_url.get('detail')!r}")
        extra = sorted(set(part) - {"type", "image_url"})
        if extra:
            raise ValueError(f"{where}.{extra[0]}: not supported in an image_url part")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        data = decode_data_url(url, f"{where}.image_url.url")
        try:
            visual = image_input(data, self.patch_budget)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        self.inputs.append(visual)
        return visual
