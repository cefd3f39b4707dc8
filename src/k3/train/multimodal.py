"""Image–text data made here, nothing downloaded (issue 16, item 3; SPEC §6–7: text and vision from step 0).

Four kinds of `Example`, drawn in proportion `KINDS`:

- ``scene``: one to three coloured shapes on a light background, with a caption or a question and its answer
  (colour, shape, count);
- ``text``: a word rendered with PIL (OCR-like), and the word;
- ``plot``: a matplotlib line or bar chart and the code that drew it;
- ``video``: four frames of a shape moving left, right, up or down, and a question about the motion.

An example is a pure function of ``(seed, index)`` (`example`), so a run resumes exactly without loader state.
`batch_examples` lays an example out as ``<|bos|>``, each visual's ``<|media|>`` slots (one per visual token),
the text, ``<|eos|>``; a target that is a placeholder or padding is never supervised.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

from k3.tokenization.image import VisualInput, batch, image_input, video_inputs
from k3.tokenization.bpe import Tokenizer
from k3.train.data import HOST

COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220), "yellow": (225, 200, 30),
           "purple": (140, 60, 180), "orange": (240, 140, 30)}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
NUMBERS = ("zero", "one", "two", "three")
WORDS = ("cat", "dog", "sun", "tree", "kimi", "moon", "code", "blue", "star", "fish", "bird", "rain", "lamp",
         "book", "door", "ship", "wolf", "gold", "leaf", "road")
KINDS = {"scene": 0.45, "text": 0.2, "plot": 0.1, "video": 0.25}
SCENE = 56  # scenes and video frames are 56 × 56 px: 4 × 4 patches, 4 visual tokens
PATCH_BUDGET = 1024


@dataclass(frozen=True)
class Example:
    """Visual inputs in reading order and the text that follows them; ``answer`` is the text's last words."""

    kind: str
    visuals: list[VisualInput]
    prompt: str
    answer: str

    @property
    def text(self) -> str:
        return f"{self.prompt} {self.answer}"


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: tuple) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)


def _canvas(rng: random.Random, size: int = SCENE) -> Image.Image:
    grey = rng.randint(225, 250)
    return Image.new("RGB", (size, size), (grey, grey, grey))


def scene(rng: random.Random) -> Example:
    """1–3 shapes of distinct colours; a caption, or a question about colour, shape or count."""
    n = rng.choice((1, 1, 2, 3))
    colours, shapes = rng.sample(sorted(COLOURS), n), [rng.choice(SHAPES) for _ in range(n)]
    image = _canvas(rng)
    draw = ImageDraw.Draw(image)
    size = SCENE // 2 if n == 1 else SCENE // 3
    for i, (colour, shape) in enumerate(zip(colours, shapes)):
        x = rng.randint(0, SCENE - size) if n == 1 else i * (SCENE // n) + rng.randint(0, SCENE // n - size)
        y = rng.randint(0, SCENE - size)
        _draw_shape(draw, shape, (x, y, x + size - 1, y + size - 1), COLOURS[colour])
    visual = [image_input(image, PATCH_BUDGET)]
    question = rng.choice(("colour", "shape", "caption") if n == 1 else ("count", "caption"))
    if question == "colour":
        return Example("scene", visual, f"Q: What colour is the {shapes[0]}? A:", f"{colours[0]}.")
    if question == "shape":
        return Example("scene", visual, f"Q: What shape is the {colours[0]} thing? A:", f"a {shapes[0]}.")
    if question == "count":
        return Example("scene", visual, "Q: How many shapes are there? A:", f"{NUMBERS[n]}.")
    caption = " and ".join(f"a {c} {s}" for c, s in zip(colours, shapes))
    return Example("scene", visual, "Caption:", caption[0].upper() + caption[1:] + ".")


def rendered_text(rng: random.Random) -> Example:
    """A word in black on white, at a random offset: the model reads it."""
    word = rng.choice(WORDS)
    image = Image.new("RGB", (84, 28), (255, 255, 255))
    ImageDraw.Draw(image).text((rng.randint(2, 40), rng.randint(2, 12)), word, fill=(0, 0, 0),
                               font=ImageFont.load_default())
    return Example("text", [image_input(image, PATCH_BUDGET)], "The image says:", f"{word}.")


def plot(rng: random.Random) -> Example:
    """A small matplotlib line or bar chart and the one line of code that drew it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [rng.randint(1, 9) for _ in range(rng.randint(3, 5))]
    kind = rng.choice(("plot", "bar"))
    colour = rng.choice(("red", "green", "blue"))
    code = f"plt.{kind}({'range(' + str(len(values)) + '), ' if kind == 'bar' else ''}{values}, color='{colour}')"
    fig = plt.figure(figsize=(1.12, 0.84), dpi=100)
    (plt.bar(range(len(values)), values, color=colour) if kind == "bar" else plt.plot(values, color=colour))
    plt.axis("off")
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return Example("plot", [image_input(out.getvalue(), PATCH_BUDGET)], "Code:", code)


def moving_shape(rng: random.Random, frames: int = 4) -> Example:
    """A shape crossing the frame in one direction over ``frames`` frames (one video chunk)."""
    colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    direction = rng.choice(sorted(DIRECTIONS))
    dx, dy = DIRECTIONS[direction]
    size, step = 16, 10
    start = [rng.randint(0, SCENE - size), rng.randint(0, SCENE - size)]
    for axis, d in ((0, dx), (1, dy)):  # leave room for the whole path
        if d:
            start[axis] = rng.randint(0, SCENE - size - step * (frames - 1))
            start[axis] = start[axis] if d > 0 else SCENE - size - start[axis]
    background = _canvas(rng)
    video = []
    for f in range(frames):
        image = background.copy()
        x, y = start[0] + dx * step * f, start[1] + dy * step * f
        _draw_shape(ImageDraw.Draw(image), shape, (x, y, x + size - 1, y + size - 1), COLOURS[colour])
        video.append(image)
    return Example("video", video_inputs(video, PATCH_BUDGET, max_frames=frames),
                   f"Q: Which way does the {colour} {shape} move? A:", f"{direction}.")


GENERATORS = {"scene": scene, "text": rendered_text, "plot": plot, "video": moving_shape}


def example(seed: int, index: int, kinds: dict[str, float] = KINDS) -> Example:
    """The ``index``-th example of stream ``seed`` (deterministic)."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
    return GENERATORS[kind](rng)


def batch_examples(examples: list[Example], tokenizer: Tokenizer, media_id: int
                   ) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor]]:
    """``(inputs [B, T], targets [B, T], mask [B, T], (pixel_values, grid_thw))``: rows padded to the longest;
    a target is supervised unless it is a placeholder or padding."""
    rows = []
    for ex in examples:
        slots = [media_id] * sum(v.tokens for v in ex.visuals)
        rows.append([tokenizer.bos_id, *slots, *tokenizer.encode(ex.text), tokenizer.eos_id])
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), tokenizer.pad_id, dtype=torch.long, device=HOST)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, device=HOST)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    mask = (targets != media_id) & (targets != tokenizer.pad_id)
    return inputs, targets, mask, batch([v for ex in examples for v in ex.visuals])


@torch.no_grad()
def colour_accuracy(model: torch.nn.Module, tokenizer: Tokenizer, n: int = 60, seed: int = 987_654) -> float:
    """Held-out single-shape scenes (a stream no training run uses): the fraction where the colour the model
    scores highest after ``Q: What colour is the SHAPE? A:`` is the drawn one. Chance is 1/len(COLOURS)."""
    was_training = model.training
    model.eval()
    media_id = model.config.vision.media_token_id
    correct = 0
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        while True:  # the next single-shape colour question of this stream
            ex = scene(rng)
            if ex.prompt.startswith("Q: What colour"):
                break
        candidates = [Example("scene", ex.visuals, ex.prompt, f"{c}.") for c in sorted(COLOURS)]
        inputs, targets, mask, (pixels, grids) = batch_examples(candidates, tokenizer, media_id)
        logits, _ = model(inputs, pixel_values=pixels, grid_thw=grids)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1))[..., 0]
        prompt = len(tokenizer.encode(ex.prompt)) + 1 + sum(v.tokens for v in ex.visuals)  # bos, slots, prompt
        scores = (logp * mask)[:, prompt - 1:].sum(-1)  # the answer's tokens (and <|eos|>)
        correct += sorted(COLOURS)[int(scores.argmax())] == ex.answer.rstrip(".")
    model.train(was_training)
    return correct / n
