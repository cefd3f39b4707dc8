"""Bounded image decoding (issue 35, item 2; `k3.tokenization.image.decode_image`): the byte cost of an image known
from its header matches what Pillow allocates, images over the caller's budget are refused before a pixel is
decompressed, only the named formats are opened, and animated images are refused."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import zlib

import pytest
from PIL import Image

from pictures import encoded, png
from k3.tokenization import image
from k3.tokenization.image import IMAGE_FORMATS, decode_image, decoded_bytes

MODES = {"1": 1, "L": 1, "P": 1, "I;16": 1, "I": 1, "F": 1.0, "LA": (1, 1), "PA": (1, 1), "RGB": (1, 1, 1),
         "RGBA": (1, 1, 1, 1), "CMYK": (1, 1, 1, 1), "YCbCr": (1, 1, 1)}

# Measures, in a fresh interpreter (no freed memory to reuse), what Pillow allocates for a 2048×2048 image of each
# mode and for its RGB(A) copy; prints one "mode allocated predicted" line per mode.
MEASURE = """
import sys
from pathlib import Path
from PIL import Image
from k3.tokenization.image import decoded_bytes

def rss():
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) * 1024

kept = []
for mode, colour in eval(sys.argv[1]).items():
    before = rss()
    image = Image.new(mode, (2048, 2048), colour)
    kept.append(image)
    kept.append(image.convert("RGBA" if "A" in mode else "RGB"))  # what `image_input` resizes
    print(mode, rss() - before, decoded_bytes(image))
"""


def test_decoded_bytes_are_what_pillow_allocates():
    """The header's width × height × (bytes a pixel is stored in + the 4 of its RGB(A) copy) is the memory the
    decoder holds at its peak, within 2 % for every mode."""
    done = subprocess.run([sys.executable, "-c", MEASURE, repr(MODES)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        mode, allocated, predicted = line.split()
        assert abs(int(allocated) - int(predicted)) < 0.02 * int(predicted), line
    assert len(done.stdout.splitlines()) == len(MODES)


def test_an_image_over_the_budget_is_refused_from_its_header():
    """A 6,000 × 6,000 grey PNG claims 180 MB decoded; with no pixel data at all, only the header can have been
    read when it is refused (decoding would fail on the missing data instead)."""
    bomb = png(6000, 6000)
    with pytest.raises(ValueError, match="6000×6000 L: decoding it takes 180,000,000 bytes, more than the 104,857,600"):
        decode_image(bomb, max_bytes=100 * 2**20)
    with pytest.raises(ValueError, match="cannot decode image"):  # past the budget check, decoding fails
        decode_image(bomb, max_bytes=200 * 2**20)


def test_the_budget_is_exact():
    picture = png(30, 20, zlib.compress(b"".join(b"\x00" + bytes(range(90)) for _ in range(20))), colour_type=2)
    assert decoded_bytes(Image.open(io.BytesIO(picture))) == 30 * 20 * 8
    assert decode_image(picture, max_bytes=30 * 20 * 8).size == (30, 20)
    with pytest.raises(ValueError, match="more than"):
        decode_image(picture, max_bytes=30 * 20 * 8 - 1)


def test_only_the_named_formats_are_opened():
    picture = Image.new("RGB", (24, 16), (200, 30, 30))
    jpeg = encoded(picture, "JPEG")
    with pytest.raises(ValueError, match="the bytes are a JPEG image, not PNG"):
        decode_image(jpeg, ("PNG",))
    assert decode_image(jpeg, ("JPEG",)).size == (24, 16)
    for fmt in ("BMP", "TIFF", "EPS", "PPM", "ICO"):  # decodable by Pillow, not documented: never opened
        with pytest.raises(ValueError, match="the bytes are not a PNG or JPEG or WEBP or GIF image"):
            decode_image(encoded(picture, fmt))
        with pytest.raises(ValueError, match="not a GIF image"):
            decode_image(encoded(picture, fmt), ("GIF",))
    for fmt in IMAGE_FORMATS:
        assert decode_image(encoded(picture, fmt)).size == (24, 16)


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_images_are_refused(fmt):
    frames = [Image.new("RGB", (20, 10), colour) for colour in ("red", "blue", "green")]
    animated = encoded(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100)
    with pytest.raises(ValueError, match=f"image is an animated {fmt}"):
        decode_image(animated)
    assert decode_image(encoded(frames[0], fmt)).size == (20, 10)  # one frame is a still image


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "too large", "missing"])
def test_an_image_file_is_read_only_if_regular_and_bounded(tmp_path, monkeypatch, kind):
    """``k3 chat --image /dev/zero`` read until the kernel killed it for memory: a FIFO, a device and a file past
    `FILE_LIMIT` are refused by name before anything is read; a missing file is a ValueError too."""
    path = tmp_path / "picture.png"
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes: reading it would block forever
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "too large":
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
        monkeypatch.setattr(image, "FILE_LIMIT", 16)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        decode_image(path)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        decode_image(str(path))
