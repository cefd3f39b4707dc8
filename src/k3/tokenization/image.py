"""Images and videos → MoonViT-V2 inputs (SPEC §6; the release's processor, SPEC §10).

An image is decoded (PNG, JPEG, WebP or a still GIF; `decode_image`), resized with its aspect ratio kept so that
its 14-px patches fit the patch budget (``scale = min(1, √(budget / (⌊W/14⌋·⌊H/14⌋)), 512·14/W, 512·14/H)``, bicubic
in the image's own mode, so Pillow resizes bilevel and palette images by nearest neighbour, as the release's
processor does), made opaque by compositing any transparency over the release's chessboard (squares of 8 px,
255 / 180 grey; ``α·rgb + (1 − α)·board`` in float32, truncated — transparent pixels are kept, never dropped),
zero-padded right and bottom to a multiple of 28 (two patches, the 2×2 merge), normalised to ``(x/255 − 0.5) / 0.5``
and cut into patches row-major, channel-first inside a patch: ``pixel_values [h·w, 3·14·14]`` with grid
``(1, h, w)``. A video's frames share one size and are cut into chunks of at most ``max_frames`` frames, each chunk
one grid ``(t, h, w)``; a one-frame video is exactly the image.

Decoding is bounded before it starts: Pillow reads an image's size and mode from its header, so an image whose
pixels exceed `MAX_PIXELS`, or whose decoding would take more than the caller's byte budget (`decoded_bytes`), is
refused before a pixel is decompressed; only the named formats' plugins are asked (never EPS, which would run
Ghostscript); animated images are refused (one frame would be used and the rest silently dropped).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageMode, UnidentifiedImageError
from torch import Tensor

from k3.files import read_bytes

PATCH = 14
MERGE = 2
SIDE_LIMIT = 512  # patches per side at most (the release's patch_limit_on_one_side)
MAX_PIXELS = 64 * 2**20  # decoded images larger than this are refused (decompression bombs)
FILE_LIMIT = 256 * 2**20  # bytes of an image file `decode_image` reads at most
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what `decode_image` opens (Pillow's names); no other plugin is asked


@dataclass(frozen=True)
class VisualInput:
    """One image or video chunk: ``pixel_values [t·h·w, 3·p·p]`` float32 and its grid ``(t, h, w)``; ``size`` is
    the original ``(width, height)``."""

    pixel_values: Tensor
    grid: tuple[int, int, int]
    size: tuple[int, int]

    @property
    def tokens(self) -> int:
        """Visual tokens after the 2×2 merge."""
        _, h, w = self.grid
        return (h // MERGE) * (w // MERGE)


def decoded_bytes(image: Image.Image) -> int:
    """The bytes decoding ``image`` holds at its peak, known from its header: its pixels as Pillow stores them (4
    bytes for several bands, else the band's size) plus their RGB(A) copy (4 bytes a pixel)."""
    mode = ImageMode.getmode(image.mode)
    stored = 4 if len(mode.bands) > 1 else int(mode.typestr[-1])
    return image.width * image.height * (stored + 4)


def _identify(raw: bytes, formats: tuple[str, ...]) -> str:
    """Why ``raw`` is no image of ``formats``: the documented format it is instead, if it is one."""
    try:
        found = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS).format
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return f"the bytes are not a {' or '.join(formats)} image"
    return f"the bytes are a {found} image, not {' or '.join(formats)}"


def decode_image(data: bytes | str | Path, formats: tuple[str, ...] = IMAGE_FORMATS,
                 max_bytes: int | None = None) -> Image.Image:
    """Decode image bytes (or a file) of one of ``formats`` (Pillow's names), refusing before decoding one whose
    `decoded_bytes` exceed ``max_bytes``; anything unreadable, empty, animated or too large is a ValueError saying
    why."""
    try:
        # a file: regular (a FIFO or /dev/zero is refused, not read) and at most FILE_LIMIT bytes
        raw = read_bytes(data, FILE_LIMIT) if isinstance(data, (str, Path)) else bytes(data)
    except OSError as err:
        raise ValueError(f"cannot read image {data}: {err.strerror or err}") from err
    if not raw:
        raise ValueError("image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                image = Image.open(io.BytesIO(raw), formats=list(formats))
            except UnidentifiedImageError as err:
                raise ValueError(f"cannot decode image: {_identify(raw, formats)}") from err
            _check_header(image, max_bytes)
            image.load()
    except (OSError, SyntaxError, Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
        raise ValueError(f"cannot decode image ({type(err).__name__}: {err})") from err
    if image.width < 1 or image.height < 1:
        raise ValueError(f"image has no pixels ({image.width}×{image.height})")
    return image


def _check_header(image: Image.Image, max_bytes: int | None) -> None:
    """Refuse, before its pixels are decoded, an image that is too large or animated."""
    if image.width * image.height > MAX_PIXELS:
        raise ValueError(f"image is {image.width}×{image.height} pixels, more than the {MAX_PIXELS:,} accepted")
    if max_bytes is not None and decoded_bytes(image) > max_bytes:
        raise ValueError(f"image is {image.width}×{image.height} {image.mode}: decoding it takes "
                         f"{decoded_bytes(image):,} bytes, more than the {max_bytes:,} bytes left of the budget for "
                         f"decoded images")
    if image.format in ("GIF", "PNG", "WEBP") and getattr(image, "is_animated", False):
        raise ValueError(f"image is an animated {image.format}; only still images are accepted (send one frame)")


def fitted_size(width: int, height: int, patch_budget: int) -> tuple[int, int]:
    """The resized ``(width, height)``: aspect kept, at most ``patch_budget`` patches and 512 per side."""
    scale = min(1.0, math.sqrt(patch_budget / (max(1, width // PATCH) * max(1, height // PATCH))),
                SIDE_LIMIT * PATCH / width, SIDE_LIMIT * PATCH / height)
    return (min(max(1, int(width * scale)), SIDE_LIMIT * PATCH),
            min(max(1, int(height * scale)), SIDE_LIMIT * PATCH))


def _chessboard(width: int, height: int) -> np.ndarray:
    y, x = np.mgrid[:height, :width]
    grey = np.where(((y // 8) + (x // 8)) % 2 == 0, 255, 180).astype(np.uint8)
    return np.stack([grey] * 3, axis=-1)


def _opaque_rgb(image: Image.Image, size: tuple[int, int]) -> np.ndarray:
    """``image`` resized to ``size`` as uint8 RGB ``[H, W, 3]``, as the release's processor does it: resized in its
    own mode, then any transparency composited over the chessboard in float32, ``α·rgb + (1 − α)·board``
    truncated to uint8."""
    if image.size != size:
        image = image.resize(size, Image.Resampling.BICUBIC)
    if image.mode == "RGB" or ("A" not in image.getbands() and "transparency" not in image.info):
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
    rgba, board = np.asarray(image.convert("RGBA")), _chessboard(*size)
    out = np.empty_like(board)
    for top in range(0, size[1], 256):  # in bands of rows, so the float32 temporaries stay small
        rows = slice(top, top + 256)
        alpha = rgba[rows, :, 3:].astype(np.float32) / 255
        out[rows] = (alpha * rgba[rows, :, :3] + (1 - alpha) * board[rows]).astype(np.uint8)
    return out


def _patches(frames: np.ndarray) -> tuple[Tensor, tuple[int, int, int]]:
    """uint8 frames ``[t, H, W, 3]`` → zero-padded to multiples of 28, normalised, cut into patches."""
    t, H, W, _ = frames.shape
    step = PATCH * MERGE
    padded = np.zeros((t, -(-H // step) * step, -(-W // step) * step, 3), dtype=np.uint8)
    padded[:, :H, :W] = frames
    x = (torch.from_numpy(padded).float() / 255 - 0.5) / 0.5
    h, w = padded.shape[1] // PATCH, padded.shape[2] // PATCH
    x = x.view(t, h, PATCH, w, PATCH, 3).permute(0, 1, 3, 5, 2, 4)  # [t, h, w, C, p, p]
    return x.reshape(t * h * w, 3 * PATCH * PATCH).contiguous(), (t, h, w)


def image_input(data: bytes | str | Path | Image.Image, patch_budget: int) -> VisualInput:
    """One image → `VisualInput` (see the module docstring)."""
    image = data if isinstance(data, Image.Image) else decode_image(data)
    size = fitted_size(image.width, image.height, patch_budget)
    pixels, grid = _patches(_opaque_rgb(image, size)[None])
    return VisualInput(pixels, grid, (image.width, image.height))


def video_inputs(frames: list[Image.Image], patch_budget: int, max_frames: int) -> list[VisualInput]:
    """A video (frames of one size) → chunks of at most ``max_frames`` frames; the budget applies per frame."""
    if not frames:
        raise ValueError("video has no frames")
    sizes = {(f.width, f.height) for f in frames}
    if len(sizes) != 1:
        raise ValueError(f"video frames differ in size: {sorted(sizes)}")
    width, height = sizes.pop()
    size = fitted_size(width, height, patch_budget)
    rgb = np.stack([_opaque_rgb(f, size) for f in frames])
    out = []
    for start in range(0, len(frames), max_frames):
        pixels, grid = _patches(rgb[start:start + max_frames])
        out.append(VisualInput(pixels, grid, (width, height)))
    return out


def batch(inputs: list[VisualInput]) -> tuple[Tensor, Tensor]:
    """Pack inputs for `k3.model.vision.VisionModel`: ``(pixel_values [Σ L, 3·p·p], grid_thw [N, 3])``, on the host
    (the model moves them to its device)."""
    if not inputs:
        return torch.zeros(0, 3 * PATCH * PATCH, device="cpu"), torch.zeros(0, 3, dtype=torch.long, device="cpu")
    return torch.cat([i.pixel_values for i in inputs]), torch.tensor([i.grid for i in inputs], dtype=torch.long,
                                                                      device="cpu")
