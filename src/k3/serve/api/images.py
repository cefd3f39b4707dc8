"""Images in requests (issue 16, item 4; SPEC §6): OpenAI ``image_url`` content parts with ``data:`` URLs -> model
inputs.

`ImageParts` is what a chat renderer calls for each ``image_url`` part: it decodes the data URL (PNG, JPEG,
WebP, still GIF; transparency composited, `k3.tokenization.image`), keeps and returns its `VisualInput` (the
placeholder slots the image takes, and its size). Anything wrong — a URL that is not ``data:image/…;base64``, bytes
that are not the format the URL names, bytes that do not decode, more images than the server allows, images whose
decoded pixels would exceed what is left of the request's budget (read from each image's header, before decoding)
— is a ValueError naming the part (a 400). This server never fetches a remote URL.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from k3.tokenization.image import VisualInput, decode_image, decoded_bytes, image_input

_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp|gif);base64,(.*)", re.DOTALL | re.IGNORECASE)
FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP", "gif": "GIF"}  # media subtype -> Pillow's
MAX_IMAGE_BYTES = 20 * 2**20


def decode_data_url(url: Any, where: str) -> tuple[bytes, str]:
    """The bytes of a ``data:image/{png,jpeg,webp,gif};base64,…`` URL and the format it names (Pillow's name)."""
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
        return base64.b64decode(found.group(2), validate=True), FORMATS[found.group(1).lower()]
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{where}: invalid base64 ({err})") from err


class ImageParts:
    """Collects a request's images in order; called once per ``image_url`` part with the part and its location.
    Their `decoded_bytes` together stay within ``max_bytes``."""

    def __init__(self, patch_budget: int, max_images: int, max_bytes: int) -> None:
        self.patch_budget, self.max_images = patch_budget, max_images
        self.inputs: list[VisualInput] = []
        self.left = max_bytes  # decoded bytes the request's next images may take

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
        data, format_ = decode_data_url(url, f"{where}.image_url.url")
        try:
            image = decode_image(data, (format_,), self.left)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        self.left -= decoded_bytes(image)
        visual = image_input(image, self.patch_budget)
        self.inputs.append(visual)
        return visual


def has_images(messages: Any) -> bool:
    """Whether any message of a conversation has an ``image_url`` content part (rendering it decodes images)."""
    return isinstance(messages, list) and any(
        isinstance(part, dict) and part.get("type") == "image_url"
        for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list) for part in m["content"])
