"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small, fixed text corpus (a slice of the standard library) so every run sees the same data."""
    from k3.train.data import stdlib_documents

    root = tmp_path_factory.mktemp("corpus")
    for i, doc in enumerate(stdlib_documents(limit_bytes=300_000)):
        (root / f"doc{i:04d}.txt").write_text(doc.text)
    return root




@pytest.fixture(scope="module")
def model():
    """The tiny serving model (`serving.model`), shared by a module's engine tests."""
    import serving

    return serving.model()


@pytest.fixture(scope="module")
def tok():
    """The serving tests' byte-level BPE tokenizer (`serving.tokenizer`)."""
    import serving

    return serving.tokenizer()
