"""MoonViT-V2, its projector and the image processor against mlx-vlm's ``kimi_k3`` (issue 38, item 3; SPEC §6, §10).

mlx-vlm (0.7.10, test-only) is an independent port of the release: its tower and projector are loaded by its own
``load_model`` (its config classes, its ``sanitize``, strict weight loading) from the reduced release checkpoint of
`release_fixture`, cast to fp32 like ours; its image processor is configured by its own ``from_pretrained`` from a
``preprocessor_config.json`` holding the release's ``media_proc_cfg``.

Tolerances: visual tokens (fp32, |values| ≤ 4) agree within ``atol = rtol = 1e-5``; the largest difference
observed is 3.5e-6 (summation order). Pixel values agree within 1e-6 and are in fact equal (observed difference 0);
grids, prompt sizes and placeholder counts are equal.

What this oracle found (fixed in ours): the encoder's RMSNorms use eps 2⁻⁷ (torch's default in the release's bf16;
ours had fp32's 1.2e-7); transparency is composited as ``α·rgb + (1 − α)·board`` in float32 and truncated (ours
rounded, Pillow's ``alpha_composite``: one grey level apart); an image is resized in its own mode, so a bilevel one
by nearest neighbour (ours converted it to RGB first and resized bicubically).
"""

from __future__ import annotations

import io
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from k3.model.lm import K3ForCausalLM
from k3.model.vision import VisionModel
from k3.tokenization.image import SIDE_LIMIT, VisualInput, batch, fitted_size, image_input
from release_fixture import write_release

TOKENS = 1e-5  # atol and rtol of the visual tokens (fp32)
PIXELS = 1e-6  # atol of the pixel values
RELEASE_MEDIA_PROC = {  # the release's preprocessor_config.json "media_proc_cfg"
    "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 65536, "patch_limit_on_one_side": SIDE_LIMIT,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "transparent_bg_fill_stage": "after_resize",
    "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                              "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
                              "chessboard_gray_value": 180}}
MEDIA = ["<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"]


def _mx() -> types.ModuleType:
    return pytest.importorskip("mlx.core", reason="mlx is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("kimi-k3-reduced")
    write_release(directory)
    return directory


@pytest.fixture(scope="module")
def towers(release) -> tuple[VisionModel, object]:
    """(ours, theirs): our `VisionModel` and mlx-vlm's ``Model`` (vision_tower + mm_projector), both fp32."""
    mx = _mx()
    load_model = pytest.importorskip("mlx_vlm.utils", reason="mlx-vlm is not installed (pip install -e '.[test]')"
                                     ).load_model
    theirs = load_model(release)
    theirs.set_dtype(mx.float32)
    return K3ForCausalLM.from_pretrained(str(release)).vision, theirs


def _theirs(model, pixel_values: np.ndarray, grids: list[list[int]]) -> np.ndarray:
    """mlx-vlm's visual tokens: its ``Model`` turns the patches ``[L, 3, 14, 14]`` channel-last for its conv."""
    mx = _mx()
    patches = mx.array(pixel_values).reshape(-1, 3, 14, 14).transpose(0, 2, 3, 1)
    return np.array(model.mm_projector(model.vision_tower(patches, grid_thws=grids)))


@pytest.mark.parametrize("grids", [
    [(1, 4, 6), (1, 8, 8), (1, 4, 4)],  # images of several sizes in one call; (4, 4) is the table's own size
    [(1, 2, 2)],  # one image alone
    [(3, 2, 4), (1, 6, 2)],  # a 3-frame video chunk (time embedding, mean over frames) beside an image
])
def test_visual_tokens_equal_mlx_vlm(towers, grids):
    ours, theirs = towers
    g = torch.Generator().manual_seed(len(grids))
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 14 * 14, generator=g)
    with torch.no_grad():
        got = ours(pixels, grids).numpy()
    expected = _theirs(theirs, pixels.numpy(), [list(g) for g in grids])
    assert got.shape == expected.shape == (sum(h * w // 4 for _, h, w in grids), 64)
    np.testing.assert_allclose(got, expected, rtol=TOKENS, atol=TOKENS)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _images() -> dict[str, bytes]:
    """PNG files of the cases: sizes around the patch grid, the side limit, and each transparency and colour mode."""
    rng = np.random.default_rng(0)
    rgb = lambda w, h: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))  # noqa: E731
    alpha = rng.integers(0, 256, (61, 90), dtype=np.uint8)
    alpha[:, :20], alpha[:, -20:] = 0, 255  # fully transparent, fully opaque and partial columns
    rgba = Image.fromarray(np.dstack([rng.integers(0, 256, (61, 90, 3), dtype=np.uint8), alpha]), "RGBA")
    palette = rgb(45, 33).quantize(16)
    palette.info["transparency"] = 3  # one palette entry transparent (a PNG tRNS chunk)
    grey = Image.fromarray(rng.integers(0, 256, (420, 600), dtype=np.uint8), "L")
    return {  # "resized at 1024": more than 1,024 patches, fewer than the release's 65,536
        "tiny 5x3": _png(rgb(5, 3)),
        "non-square, not a multiple of 14: 100x45": _png(rgb(100, 45)),
        "a multiple of 28: 84x56": _png(rgb(84, 56)),
        "past the 512-patch side limit: 7300x30": _png(rgb(7300, 30)),
        "RGBA 90x61": _png(rgba),
        "RGBA resized at 1024: 640x430": _png(rgba.resize((640, 430))),
        "grey+alpha resized at 1024: 560x420": _png(rgba.resize((560, 420)).convert("LA")),
        "palette with a transparent entry 45x33": _png(palette),
        "greyscale resized at 1024: 600x420": _png(grey),
        "bilevel resized at 1024: 620x380": _png(grey.resize((620, 380)).convert("1")),
    }


def _processor(directory: Path, budget: int) -> tuple[object, str]:
    """mlx-vlm's ``KimiK3Processor`` from a model directory holding the release's media config (patch budget
    ``budget``) and a stand-in tokenizer that knows the media markers."""
    processing = pytest.importorskip("mlx_vlm.models.kimi_k3.processing_kimi_k3",
                                     reason="mlx-vlm is not installed (pip install -e '.[test]')")
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[test]')")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(MEDIA)
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"media_proc_cfg": {**RELEASE_MEDIA_PROC, "in_patch_limit": budget}}
    (directory / "preprocessor_config.json").write_text(json.dumps(config))
    return processing.KimiK3Processor.from_pretrained(str(directory)), processing.IMAGE_PLACEHOLDER


@pytest.mark.parametrize("budget", [65536, 1024])  # the release's patch budget, and a small one so images resize
def test_image_processor_equals_mlx_vlm(tmp_path, budget):
    """Pixel values (in patch order), grids, the image's size in its prompt and its placeholder count, for every
    case at once in one call of each processor."""
    images = _images()
    processor, placeholder = _processor(tmp_path / "processor", budget)
    opened = [Image.open(io.BytesIO(data)) for data in images.values()]
    theirs = processor(images=opened, text=placeholder * len(opened))
    ours: list[VisualInput] = [image_input(data, budget) for data in images.values()]
    pixels, grids = batch(ours)
    sizes = [t * h * w for t, h, w in grids.tolist()]
    their_pixels = np.array(theirs["pixel_values"]).reshape(-1, 3 * 14 * 14).astype(np.float32)
    assert grids.tolist() == np.array(theirs["grid_thws"]).tolist()
    for name, got, expected in zip(images, pixels.split(sizes), np.split(their_pixels, np.cumsum(sizes)[:-1])):
        np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=PIXELS, err_msg=name)
    ids = np.array(theirs["input_ids"])[0].tolist()
    begin, pad = (processor.tokenizer.convert_tokens_to_ids(m) for m in ("<|media_begin|>", "<|media_pad|>"))
    starts = [i for i, t in enumerate(ids) if t == begin] + [len(ids)]
    assert [ids[a:b].count(pad) for a, b in zip(starts, starts[1:])] == [v.tokens for v in ours]
    assert [image.size for image in opened] == [v.size for v in ours]  # the "image WxH" of each prompt


def test_a_resized_palette_image_is_sampled_by_nearest_neighbour(tmp_path):
    """The one place mlx-vlm departs from the release: it converts a palette image to RGBA before the bicubic
    resize, where the release's processor (``media_utils.image_to_np``) resizes the image as it is, which Pillow does
    by nearest neighbour for a palette. Ours follows the release: it equals mlx-vlm fed the image already resized
    that way."""
    rng = np.random.default_rng(1)
    palette = Image.fromarray(rng.integers(0, 256, (420, 600, 3), dtype=np.uint8)).quantize(16)
    palette.info["transparency"] = 3
    ours = image_input(_png(palette), 1024)
    resized = palette.resize(fitted_size(*palette.size, 1024), Image.Resampling.NEAREST)
    processor, _ = _processor(tmp_path / "processor", 65536)  # fits the resized image as it is
    theirs = processor.image_processor([resized])
    assert list(ours.grid) == np.array(theirs["grid_thws"])[0].tolist()
    expected = np.array(theirs["pixel_values"]).reshape(-1, 3 * 14 * 14)
    np.testing.assert_allclose(ours.pixel_values.numpy(), expected, rtol=0, atol=PIXELS)


def test_end_to_end_from_pixels_to_tokens(towers, tmp_path):
    """Two images through each side's own processor and tower: the visual tokens agree."""
    ours_model, theirs_model = towers
    cases = _images()
    images = [cases["non-square, not a multiple of 14: 100x45"], cases["RGBA 90x61"]]
    processor, _ = _processor(tmp_path / "processor", 65536)
    theirs = processor.image_processor([Image.open(io.BytesIO(data)) for data in images])
    pixels, grids = batch([image_input(data, 65536) for data in images])
    with torch.no_grad():
        got = ours_model(pixels, grids).numpy()
    expected = _theirs(theirs_model, np.array(theirs["pixel_values"]), np.array(theirs["grid_thws"]).tolist())
    np.testing.assert_allclose(got, expected, rtol=TOKENS, atol=TOKENS)
