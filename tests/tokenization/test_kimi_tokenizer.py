"""The released Kimi tokenizer (tiktoken files): layout, round trips, pre-token splits, long inputs, persistence."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.tokenization.kimi import CONFIG_FILE, MODEL_FILE, NUM_RESERVED, KimiTokenizer
from kimi_fixtures import SPECIALS, TEXTS, build_kimi_tokenizer_files, kimi_config

PIECES = ["<|open|>", "<|sep|>", "<|end_of_msg|>", "[BOS]", "<|reserved_token_1|>", "中文", "北京市", "🙂🚀", "   ",
          "\n\n", "\r\n", "\t", "naïve", "I'll", "12345", "\u200b", "\x00"]
texts = st.lists(st.one_of(st.text(max_size=20), st.sampled_from(PIECES)), max_size=12).map("".join)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> KimiTokenizer:
    return build_kimi_tokenizer_files(tmp_path_factory.mktemp("kimi"), [f"{t} {i}" for i in range(5) for t in TEXTS])


def test_specials_at_release_offsets(tok):
    base = tok.vocab_size - NUM_RESERVED
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (base, base + 2, base + 255)
    assert tok.special_id("media_pad") == tok.special_id("<|media_pad|>") == base + 21
    assert tok.special_id("[EOS]") == base + 2 and tok.special_id("open") == base + 3
    assert len(tok) == tok.vocab_size and len(tok.special_ids) == NUM_RESERVED
    assert sorted(tok.special_ids.values()) == list(range(base, base + NUM_RESERVED))
    assert tok.decode([base + 1]) == f"<|reserved_token_{base + 1}|>" == tok.id_to_token(base + 1)
    assert tok.decode([tok.bos_id, tok.special_id("sep")]) == "[BOS]<|sep|>"
    assert tok.chat_format == "xtml"
    with pytest.raises(KeyError, match="nope"):
        tok.special_id("nope")


@settings(max_examples=150, deadline=None)
@given(texts)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size - NUM_RESERVED for i in ids)  # special literals stay text
    assert tok.decode(tok.encode(text, allow_special=True)) == text
    assert tok.encode_batch([text, text[:3]]) == [ids, tok.encode(text[:3])]


def test_special_literals_only_with_allow_special(tok):
    base = tok.vocab_size - NUM_RESERVED
    assert tok.encode("a<|open|>b", allow_special=True) == [*tok.encode("a"), tok.special_id("open"), *tok.encode("b")]
    assert tok.encode(f"<|reserved_token_{base + 9}|>", allow_special=True) == [base + 9]
    assert tok.encode("<|open|>[EOS]") == tok.encode("<|open|>") + tok.encode("[EOS]")
    assert not set(tok.encode("<|open|>[EOS]")) & set(tok.special_ids.values())


def test_kimi_pre_token_splits():
    """Whole-string tokens exist, so a missing split would show up as one id."""
    words = ["中文", "English", "混合", "北京市", " Pascal", "中文English混合", "北京市 Pascal", "English混合",
             "北京市 "]
    ranks = {bytes([b]): b for b in range(256)} | {w.encode(): 256 + k for k, w in enumerate(words)}
    tok = KimiTokenizer(ranks, kimi_config(len(ranks)))
    pieces = lambda text: [tok.decode([i]) for i in tok.encode(text)]
    assert pieces("中文English混合") == ["中文", "English", "混合"]
    assert pieces("北京市 Pascal") == ["北京市", " Pascal"]


@pytest.mark.parametrize("text", [" " * 60_000 + "x", "x" * 60_000 + "\n" * 30_001 + "中" * 26_000,
                                  "ab cd\n" * 70_000])
def test_long_inputs(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_decode_errors_and_partial_utf8(tok):
    with pytest.raises(ValueError, match=str(tok.vocab_size)):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(ValueError, match="-1"):
        tok.id_to_token(-1)
    assert tok.decode([0xF0, ord("a")]) == "\ufffda"  # single-byte tokens have rank == byte


def test_vocab_views(tok):
    vocab = tok.get_vocab()
    assert len(vocab) == tok.vocab_size
    assert all(vocab[tok.id_to_token(i)] == i for i in range(0, tok.vocab_size, 7))
    assert tok.id_to_token(ord(" ")) == "Ġ" and tok.id_to_token(ord("a")) == "a"
    longest = max(len(tok.decode([i]).encode()) for i in range(tok.vocab_size - NUM_RESERVED))
    assert tok.max_token_bytes == max(longest, *map(len, tok.special_ids))
    with pytest.raises(TypeError, match="#1"):
        tok.encode_batch(["a", b"b"])


def test_save_load_round_trip(tok, tmp_path):
    tok.save(tmp_path / "a")
    again = KimiTokenizer.load(tmp_path / "a")
    again.save(tmp_path / "b")
    for name in (MODEL_FILE, CONFIG_FILE):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    sample = " ".join(TEXTS) + "<|open|>x<|sep|>"
    assert again.encode(sample) == tok.encode(sample)
    assert again.encode(sample, allow_special=True) == tok.encode(sample, allow_special=True)
    assert again.special_ids == tok.special_ids and again.get_vocab() == tok.get_vocab()


def test_token_names_as_dicts(tok, tmp_path):
    tok.save(tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    config.update(bos_token={"content": "[BOS]", "special": True}, eos_token={"content": "<|end_of_msg|>"})
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    loaded = KimiTokenizer.load(tmp_path)
    assert (loaded.bos_id, loaded.eos_id) == (tok.bos_id, tok.special_id("end_of_msg"))


def _corrupt_model(d):
    (d / MODEL_FILE).write_bytes((d / MODEL_FILE).read_bytes() + b"not-base64!! 7\n")


def _gap_in_ranks(d):
    lines = (d / MODEL_FILE).read_bytes().splitlines()
    (d / MODEL_FILE).write_bytes(b"\n".join(lines[:300] + lines[301:]))


def _edit_config(**changes):
    def edit(d):
        config = json.loads((d / CONFIG_FILE).read_text())
        (d / CONFIG_FILE).write_text(json.dumps(config | changes))
    return edit


@pytest.mark.parametrize("damage, bad_file", [
    (lambda d: (d / MODEL_FILE).unlink(), MODEL_FILE),
    (lambda d: (d / CONFIG_FILE).unlink(), CONFIG_FILE),
    (_corrupt_model, MODEL_FILE),
    (_gap_in_ranks, MODEL_FILE),
    (lambda d: (d / CONFIG_FILE).write_text("{not json"), CONFIG_FILE),
    (_edit_config(bos_token="[NOPE]"), CONFIG_FILE),
    (_edit_config(added_tokens_decoder={"12": {"content": "x"}}), CONFIG_FILE),
    (_edit_config(added_tokens_decoder=[]), CONFIG_FILE),
])
def test_bad_files_name_the_path(tok, tmp_path, damage, bad_file):
    tok.save(tmp_path)
    damage(tmp_path)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / bad_file))):
        KimiTokenizer.load(tmp_path)


def test_fixture_layout(tok):
    base = tok.vocab_size - NUM_RESERVED
    assert {tok.special_id(v): v for v in SPECIALS.values()} == {base + k: v for k, v in SPECIALS.items()}
