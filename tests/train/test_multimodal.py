"""Image and video inputs and the splice into the language model (issue 16, items 1–2; SPEC §6, §10)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from k3.config import MEDIA_TOKEN_ID, preset
from k3.tokenization.image import batch, decode_image, fitted_size, image_input, video_inputs
from k3.model.lm import K3ForCausalLM
from k3.tokenization.bpe import SPECIAL_TOKENS


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_presets_fill_the_tokenizers_media_slot():
    assert SPECIAL_TOKENS[MEDIA_TOKEN_ID] == "<|media|>" == SPECIAL_TOKENS[preset("tiny").vision.media_token_id]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9000), st.integers(1, 9000), st.sampled_from([64, 1024, 16384, 65536]))
def test_resizing_keeps_the_aspect_never_upscales_and_respects_the_side_limit(width, height, budget):
    w, h = fitted_size(width, height, budget)
    assert 1 <= w <= width and 1 <= h <= height and w <= 512 * 14 and h <= 512 * 14
    if (w, h) != (width, height) and min(w, h) > 1:
        assert abs(w / h - width / height) <= (width / height) * (1 / min(w, h) + 1 / min(w, h))


def test_an_image_is_patched_row_major_channel_first_and_padded_to_the_merge():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)  # H 20, W 30 → padded to 28 × 56
    got = image_input(Image.fromarray(pixels), patch_budget=1024)
    assert got.grid == (1, 2, 4) and got.size == (30, 20) and got.tokens == 2
    padded = np.zeros((28, 56, 3), dtype=np.uint8)
    padded[:20, :30] = pixels
    for row in range(2):
        for col in range(4):
            patch = padded[row * 14:(row + 1) * 14, col * 14:(col + 1) * 14]  # [14, 14, 3]
            expected = (torch.from_numpy(patch.transpose(2, 0, 1).copy()).float() / 255 - 0.5) / 0.5
            assert torch.equal(got.pixel_values[row * 4 + col], expected.flatten())
    assert got.pixel_values[3].view(3, 14, 14)[:, :, 2:].eq(-1).all()  # columns 30.. are padding: black


def test_transparent_pixels_are_composited_over_the_chessboard_not_dropped():
    clear = Image.new("RGBA", (28, 28), (10, 200, 30, 0))
    got = image_input(decode_image(_png(clear)), patch_budget=1024).pixel_values.view(4, 3, 14, 14)
    board = torch.tensor([[255.0 if ((y // 8) + (x // 8)) % 2 == 0 else 180.0 for x in range(28)] for y in range(28)])
    expected = (board / 255 - 0.5) / 0.5
    assert torch.equal(got[0, 0], expected[:14, :14]) and torch.equal(got[3, 2], expected[14:, 14:])
    half = image_input(Image.new("RGBA", (28, 28), (0, 0, 0, 128)), patch_budget=1024).pixel_values
    assert half.min() > -1 and half.max() < 1  # half-transparent black over the board: grey, not black


def test_a_single_frame_video_is_exactly_the_image():
    frame = Image.fromarray(np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    image, (video,) = image_input(frame, 1024), video_inputs([frame], 1024, max_frames=4)
    assert image.grid == video.grid and torch.equal(image.pixel_values, video.pixel_values)
    chunks = video_inputs([frame] * 6, 1024, max_frames=4)
    assert [c.grid[0] for c in chunks] == [4, 2]


def test_undecodable_and_inconsistent_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="cannot decode image"):
        decode_image(b"not an image at all")
    with pytest.raises(ValueError, match="empty"):
        decode_image(b"")
    with pytest.raises(ValueError, match="cannot decode image"):
        decode_image(_png(Image.new("RGB", (8, 8)))[:40])  # truncated
    with pytest.raises(ValueError, match="frames differ in size"):
        video_inputs([Image.new("RGB", (28, 28)), Image.new("RGB", (56, 28))], 1024, 4)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(preset("tiny")).eval()


def test_visual_tokens_land_exactly_on_the_placeholders(model):
    images = [image_input(Image.new("RGB", (56, 28), (200, 10, 10)), 1024),
              image_input(Image.new("RGB", (28, 56), (10, 10, 200)), 1024)]
    ids = torch.tensor([[1, 4, *[MEDIA_TOKEN_ID] * 2, 40, 41, 42, 43],
                        [1, 4, 50, *[MEDIA_TOKEN_ID] * 2, 51, 52, 53]])
    pixels, grids = batch(images)
    with torch.no_grad():
        spliced = model.embed_multimodal(ids, pixels, grids)
        visual = model.vision(pixels, grids)
        text = model.embed_tokens(ids)
    slots = ids == MEDIA_TOKEN_ID
    assert torch.equal(spliced[slots], visual)  # image 1 fills row 0's slots, image 2 row 1's
    assert torch.equal(spliced[~slots], text[~slots])
    with pytest.raises(ValueError, match="3 media placeholders .* give 4 visual tokens"):
        model.embed_multimodal(torch.tensor([[1, *[MEDIA_TOKEN_ID] * 3]]), pixels, grids)


def test_an_image_prompt_prefills_in_chunks_exactly_as_whole(model):
    image = image_input(Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 90, 3), dtype=np.uint8)),
                        1024)
    ids = torch.tensor([[1, 4, *[MEDIA_TOKEN_ID] * image.tokens, 60, 61, 62, 10]])
    pixels, grids = batch([image])
    with torch.no_grad():
        whole, _ = model(ids, pixel_values=pixels, grid_thw=grids)
        embeds = model.embed_multimodal(ids, pixels, grids)
        state, parts = model.new_state(1), []
        for start in range(0, ids.shape[1], 5):  # chunk edges fall inside the image's slots
            logits, state = model(inputs_embeds=embeds[:, start:start + 5], state=state)
            parts.append(logits)
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------- generated data and joint training
def _centroid(pixels: torch.Tensor, grid: tuple[int, int, int], frame: int, rgb: tuple[int, int, int]) -> tuple:
    """Centre (x, y) in pixels of the points of one colour in a frame of a patched video."""
    t, h, w = grid
    x = pixels.view(t, h, w, 3, 14, 14)[frame].permute(0, 3, 1, 4, 2).reshape(h * 14, w * 14, 3)
    target = (torch.tensor(rgb, dtype=torch.float32) / 255 - 0.5) / 0.5
    ys, xs = torch.nonzero(((x - target).abs() < 0.02).all(-1), as_tuple=True)
    return float(xs.float().mean()), float(ys.float().mean())


def test_generated_examples_are_deterministic_and_their_labels_true():
    from k3.train.multimodal import COLOURS, DIRECTIONS, example, moving_shape, scene

    a, b = example(3, 17), example(3, 17)
    assert a.text == b.text and all(torch.equal(x.pixel_values, y.pixel_values) for x, y in zip(a.visuals, b.visuals))
    import random

    for i in range(20):
        video = moving_shape(random.Random(i))
        colour = video.prompt.split()[5]
        (chunk,) = video.visuals
        first, last = _centroid(chunk.pixel_values, chunk.grid, 0, COLOURS[colour]), \
            _centroid(chunk.pixel_values, chunk.grid, chunk.grid[0] - 1, COLOURS[colour])
        dx, dy = DIRECTIONS[video.answer.rstrip(".")]
        assert (last[0] - first[0]) * dx > 20 or (last[1] - first[1]) * dy > 20, (video.text, first, last)
        picture = scene(random.Random(100 + i))
        if picture.prompt.startswith("Q: What colour"):
            (image,) = picture.visuals
            assert not np.isnan(_centroid(image.pixel_values, image.grid, 0, COLOURS[picture.answer.rstrip(".")])[0])


def test_placeholders_are_never_supervised():
    from k3.train.multimodal import batch_examples, example

    from k3.tokenization.bpe import Tokenizer

    tok = Tokenizer.train(["Q: What colour is the circle? A: red. The image says: cat."] * 3, 300)
    examples = [example(0, i) for i in range(6)]
    inputs, targets, mask, (pixels, grids) = batch_examples(examples, tok, MEDIA_TOKEN_ID)
    for row, ex in enumerate(examples):
        slots = sum(v.tokens for v in ex.visuals)
        assert inputs[row, 0] == tok.bos_id and inputs[row, 1:1 + slots].eq(MEDIA_TOKEN_ID).all()
        assert not mask[row, :slots].any()  # predicting a placeholder is never a target
        assert mask[row, slots]  # the first text token after the image is
    assert not mask[targets == MEDIA_TOKEN_ID].any() and not mask[targets == tok.pad_id].any()
    assert int((inputs == MEDIA_TOKEN_ID).sum()) == sum(v.tokens for ex in examples for v in ex.visuals)
    assert grids.shape[0] == sum(len(ex.visuals) for ex in examples) and pixels.shape[0] == int(grids.prod(1).sum())


def test_multimodal_training_resumes_exactly(tmp_path, corpus):
    from k3.train.pretrain import train
    from k3.train.rundir import read_metrics
    from training import config

    changes = dict(multimodal=True, multimodal_batch=4, steps=4, ckpt_every=2, eval_every=4)
    train(config(tmp_path / "whole", corpus, **changes))
    for _ in range(2):  # a zero time budget stops after one step, with a checkpoint
        train(config(tmp_path / "split", corpus, **changes, max_minutes=0.0), resume=True)
    train(config(tmp_path / "split", corpus, **changes), resume=True)
    whole, split = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("whole", "split"))
    assert [r["loss"] for r in whole] == pytest.approx([r["loss"] for r in split], rel=1e-6)
    assert "colour_accuracy" in whole[-1]


@pytest.mark.slow
def test_a_tiny_multimodal_model_answers_held_out_colour_questions(tmp_path, corpus, capsys):
    """Trained jointly on text and generated images (~2 minutes on 2 cores), the tiny model names the colour of
    shapes in scenes it never saw, far above chance."""
    from k3.train.pretrain import train
    from k3.train.multimodal import COLOURS, colour_accuracy
    from training import config

    run = train(config(tmp_path / "mm", corpus, steps=600, tokens_per_step=256, curriculum=[[0.0, 32]],
                       eval_every=600, ckpt_every=600, multimodal=True, multimodal_batch=16))
    accuracy, chance = colour_accuracy(run.model, run.tokenizer, n=60), 1 / len(COLOURS)
    with capsys.disabled():
        print(f"\nheld-out colour questions: accuracy {accuracy:.2f} vs chance {chance:.2f} (60 scenes)")
    assert accuracy >= 0.7 > 3 * chance
