"""Image bytes for the tests: any Pillow-encoded picture, hand-built PNGs (decompression bombs whose pixel data is a
few hundred KB of zlib, or none at all), and data URLs."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from functools import cache

from PIL import Image


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    """``image`` saved as ``fmt`` (Pillow's format name) with Pillow's ``options``."""
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def data_url(data: bytes, subtype: str) -> str:
    return f"data:image/{subtype};base64," + base64.b64encode(data).decode()


@cache
def black(width: int, height: int) -> bytes:
    """The zlib stream of a black grey image's scanlines: a few hundred KB for hundreds of MB of pixels."""
    squeeze = zlib.compressobj(9)
    row = bytes(width + 1)  # a filter byte, then the samples
    return b"".join(squeeze.compress(row) for _ in range(height)) + squeeze.flush()


def png(width: int, height: int, pixels: bytes | None = None, colour_type: int = 0,
        comment: str | None = None) -> bytes:
    """A PNG of 8-bit samples (``colour_type`` 0: grey, 2: RGB) with ``pixels`` as its zlib-compressed image data
    (None: no image data at all) and an optional ``comment`` (a tEXt chunk, to make otherwise equal files differ)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    body = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0))
    if comment is not None:
        body += chunk(b"tEXt", b"Comment\x00" + comment.encode())
    if pixels is not None:
        body += chunk(b"IDAT", pixels)
    return b"\x89PNG\r\n\x1a\n" + body + chunk(b"IEND", b"")
