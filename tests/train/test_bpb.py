"""Bits per byte of validation text and its compression anchors (k3.train.bpb; issue 38, item 1)."""

from __future__ import annotations

import lzma
import math
import os
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from k3.train.bpb import ByteTally, anchors, deflate_size, xz_size
from k3.train.data import eval_batches

DOCS = ["def f(x):\n    return x + 1\n", "naïve café — ∑ 数据\n", "<|eos|> is plain text here\n" * 3,
        "class A:\n    pass\n"]


def tally_of(tok, docs: list[str], logits_of) -> ByteTally:
    """A validation pass over ``docs`` in 8-token windows, with logits from ``logits_of(targets)``."""
    tally = ByteTally(tok.token_bytes(), torch.device("cpu"))
    ids = [tok.encode(d) for d in docs]
    for _, targets, mask in eval_batches(ids, 8, 3, tok.eos_id, tok.pad_id):
        tally.add(logits_of(targets), targets, mask)
    return tally


def uniform(tok):
    return lambda targets: torch.zeros(*targets.shape, tok.vocab_size)


def test_the_counted_bytes_are_the_validation_text_exactly(tok):
    """Every supervised target's bytes, window after window, are the documents' UTF-8 bytes without each document's
    first token (never a target: no document is predicted from the one before it)."""
    tally = tally_of(tok, DOCS, uniform(tok))
    first = [len(tok.decode(tok.encode(d)[:1]).encode()) for d in DOCS]
    expected = b"".join(d.encode()[k:] for d, k in zip(DOCS, first))
    assert b"".join(tally.windows) == expected
    assert tally.result().bytes == len(expected)


def test_bits_per_byte_of_a_uniform_model(tok):
    """A model that gives every id probability 1/V spends log2 V bits on each text token: bits per byte =
    (text tokens × log2 V) / bytes, counted from the documents; its loss is ln V per supervised token."""
    result = tally_of(tok, DOCS, uniform(tok)).result()
    text_tokens = sum(len(tok.encode(d)) - 1 for d in DOCS)
    text_bytes = sum(len(d.encode()) - len(tok.decode(tok.encode(d)[:1]).encode()) for d in DOCS)
    assert result.loss == pytest.approx(math.log(tok.vocab_size), rel=1e-6)
    assert result.tokens == text_tokens + len(DOCS)  # each document's end-of-document target is supervised
    assert result.bits_per_byte == pytest.approx(text_tokens * math.log2(tok.vocab_size) / text_bytes, rel=1e-6)


def test_end_of_document_targets_count_in_the_loss_but_not_in_the_bits(tok):
    """Special ids stand for no bytes: a model that is certainly wrong about every end of document has a larger loss
    per token and the same bits per byte as the uniform model."""
    def eos_unlikely(targets):
        logits = torch.zeros(*targets.shape, tok.vocab_size)
        logits[..., tok.eos_id] = -1e4
        return logits

    base, skewed = tally_of(tok, DOCS, uniform(tok)).result(), tally_of(tok, DOCS, eos_unlikely).result()
    assert skewed.loss > base.loss + 100
    text_tokens = sum(len(tok.encode(d)) - 1 for d in DOCS)
    assert skewed.bits_per_byte == pytest.approx(
        text_tokens * math.log2(tok.vocab_size - 1) / skewed.bytes, rel=1e-6)  # text ids: 1 / (V - 1) each


def test_a_pass_with_no_text_is_refused(tok):
    tally = ByteTally(tok.token_bytes(), torch.device("cpu"))
    with pytest.raises(ValueError, match="no supervised positions"):
        tally.result()
    targets = torch.tensor([[tok.eos_id]])
    tally.add(torch.zeros(1, 1, tok.vocab_size), targets, torch.tensor([[True]]))
    with pytest.raises(ValueError, match="no text bytes"):
        tally.result()
    with pytest.raises(ValueError, match="outside the tokenizer"):
        tally.add(torch.zeros(1, 1, tok.vocab_size + 1), torch.tensor([[tok.vocab_size]]), torch.tensor([[True]]))


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=6000))
def test_the_compressed_sizes_are_zlib_9_and_xz_9e_without_their_containers(data):
    """zlib's format is a 2-byte header, the deflate stream and a 4-byte Adler-32; the xz file of the same bytes is
    the raw LZMA2 stream at preset 9e with its container (stream header and footer, block header, index, CRC)."""
    assert deflate_size(data) == len(zlib.compress(data, 9)) - 6
    xz = lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    raw = lzma.compress(data, format=lzma.FORMAT_RAW,
                        filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}])
    assert xz_size(data) == len(raw) and 30 <= len(xz) - len(raw) <= 80
    assert lzma.decompress(xz) == data


def test_anchors_of_repeated_and_of_random_bytes():
    text = b"def f(x):\n    return x + 1\n" * 200
    windows = tuple(text[i:i + 700] for i in range(0, len(text), 700))
    repeated = anchors(windows)
    assert max(repeated["xz_bpb"], repeated["zlib_bpb"]) < 0.2  # one file: the repeats cost almost nothing
    assert repeated["zlib_bpb"] < repeated["zlib_window_bpb"] < 1.5  # each window pays for its own first copy
    noise = anchors((os.urandom(4000), os.urandom(4000)))
    assert all(8.0 <= v < 8.2 for v in noise.values())  # random bytes do not compress
    with pytest.raises(ValueError, match="no validation bytes"):
        anchors((b"",))
