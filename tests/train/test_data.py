"""Corpora, document split, packing with a loss mask, resumable loader, masked loss (issue 4, deliverable 2)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deadline import finishes
from k3.cli import main
from k3.train.data import (
    STDLIB_EXCLUDED_DIRS,
    Document,
    PackedLoader,
    eval_batches,
    load_corpus,
    load_documents,
    masked_loss_sum,
    masked_mean_loss,
    split_documents,
    stdlib_documents,
    tokenize_documents,
)
from k3.tokenization.bpe import NUM_SPECIAL_TOKENS, Tokenizer

EOS = 2

# ------------------------------------------------------------------------------------------------
# corpora


def test_stdlib_corpus_present_and_deterministic() -> None:
    docs = stdlib_documents()
    assert len(docs) > 100
    assert sum(len(d.text) for d in docs) > 1_000_000
    names = [d.name for d in docs]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert all(n.endswith(".py") and not n.startswith("/") for n in names)
    for n in names:
        assert not set(n.split("/")[:-1]) & STDLIB_EXCLUDED_DIRS, n
        assert not n.split("/")[-1].startswith("_sysconfigdata")
    assert "json/decoder.py" in names and "argparse.py" in names
    assert all(d.text for d in docs)
    assert stdlib_documents() == docs


def test_stdlib_limit_bytes() -> None:
    small = stdlib_documents(limit_bytes=100_000)
    assert 1 <= len(small) and sum(len(d.text.encode()) for d in small) <= 100_000
    assert small == stdlib_documents()[: len(small)]
    assert len(stdlib_documents(limit_bytes=1)) == 1  # at least one file
    with pytest.raises(ValueError, match="limit_bytes"):
        stdlib_documents(limit_bytes=0)


def test_load_folder_of_text(tmp_path) -> None:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("bee")
    (root / "sub" / "a.md").write_text("# a\n")
    (root / "c.rst").write_text("see")
    (root / "empty.txt").write_text("")
    (root / ".hidden.txt").write_text("hidden")
    (root / "image.png").write_bytes(b"\x89PNG")
    (root / ".git").mkdir()
    (root / ".git" / "x.txt").write_text("git")
    docs = load_documents([root])
    assert docs == [
        Document("corpus/b.txt", "bee"),
        Document("corpus/c.rst", "see"),
        Document("corpus/sub/a.md", "# a\n"),
    ]
    assert load_documents(root) == docs  # a single path is accepted too
    # a file named explicitly is read whatever its extension, named by its base name
    (tmp_path / "notes.log").write_text("log line")
    assert load_documents([tmp_path / "notes.log", root / "b.txt"]) == [
        Document("notes.log", "log line"),
        Document("b.txt", "bee"),
    ]


def test_load_undecodable_bytes_replaced_with_warning(tmp_path) -> None:
    p = tmp_path / "bad.txt"
    p.write_bytes(b"ok \xff\xfe end")
    with pytest.warns(UserWarning, match="bad.txt"):
        docs = load_documents([p])
    assert docs == [Document("bad.txt", "ok \ufffd\ufffd end")]


def test_load_jsonl(tmp_path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(
        json.dumps({"text": "first", "id": 1}) + "\n\n" + json.dumps({"text": "snd \U0001f600"}) + "\n"
        + json.dumps({"text": ""}) + "\n"
    )  # fmt: skip
    assert load_documents([p]) == [Document("d.jsonl:1", "first"), Document("d.jsonl:3", "snd \U0001f600")]
    # found inside a folder too
    assert [d.name for d in load_documents([tmp_path])][0] == f"{tmp_path.name}/d.jsonl:1"


@pytest.mark.parametrize(
    "line, why",
    [('{"txt": "x"}', "no 'text' field"), ("[1, 2]", "no 'text' field"), ("{oops", "invalid JSON"),
     ('{"text": 3}', "'text' is int")],
)  # fmt: skip
def test_load_jsonl_bad_line(tmp_path, line, why) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl, line 2: {why}"):
        load_documents([p])


def test_load_parquet(tmp_path) -> None:
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["alpha", None, "", "gamma"], "n": [1, 2, 3, 4]}), p)
    assert load_documents([p]) == [Document("d.parquet:0", "alpha"), Document("d.parquet:3", "gamma")]
    q = tmp_path / "nope.parquet"
    pq.write_table(pa.table({"body": ["x"]}), q)
    with pytest.raises(ValueError, match=r"nope\.parquet.*no 'text' column"):
        load_documents([q])
    r = tmp_path / "corrupt.parquet"
    r.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"corrupt\.parquet"):
        load_documents([r])


def test_missing_or_empty_data(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_documents([tmp_path / "does-not-exist"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no documents found in .*empty"):
        load_documents([tmp_path / "empty"])
    (tmp_path / "empty" / "blank.txt").write_text("")
    (tmp_path / "empty" / "other.bin").write_text("text but not a text extension")
    with pytest.raises(ValueError, match="no documents found"):
        load_documents([tmp_path / "empty"])
    with pytest.raises(ValueError, match="no data paths"):
        load_documents([])


def test_binary_file_named_explicitly_is_an_error(tmp_path) -> None:
    nul = tmp_path / "data.bin"
    nul.write_bytes(b"abc\x00def" * 100)
    with pytest.raises(ValueError, match=r"data\.bin: looks like a binary file \(a NUL byte at offset 3\), not text"):
        load_documents([nul])
    # random bytes without any NUL: caught by the share of bytes that are not valid UTF-8
    noise = tmp_path / "noise.txt"
    noise.write_bytes(bytes(b or 1 for b in random.Random(0).randbytes(20_000)))
    with pytest.raises(ValueError, match=r"noise\.txt: looks like a binary file \(\d+\.\d% of its bytes are not valid"):
        load_documents([noise])


def test_binary_file_in_a_folder_is_an_error(tmp_path) -> None:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("fine text\n")
    (root / "sub" / "logo.md").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    with pytest.raises(ValueError, match=r"sub/logo\.md: looks like a binary file"):
        load_documents([root])


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
def test_a_fifo_or_device_in_a_folder_is_refused_not_read(tmp_path, kind) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("fine text\n")
    if kind == "fifo":
        os.mkfifo(root / "b.txt")  # no writer: reading it would block forever
    else:
        (root / "b.txt").symlink_to("/dev/zero")  # reading it would never end
    with pytest.raises(ValueError, match=r"b\.txt: (a FIFO|a character device), not a regular file"):
        finishes(lambda: load_documents([root]))


def test_the_data_limit_keeps_the_first_whole_files(tmp_path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    for name, size in (("a.txt", 400), ("b.txt", 400), ("c.txt", 100)):
        (root / name).write_text("x" * size)
    assert [d.name for d in load_documents([root], limit_bytes=900)] == ["corpus/a.txt", "corpus/b.txt", "corpus/c.txt"]
    assert [d.name for d in load_documents([root], limit_bytes=899)] == ["corpus/a.txt", "corpus/b.txt"]
    assert [d.name for d in load_documents([root], limit_bytes=400)] == ["corpus/a.txt"]
    with pytest.raises(ValueError, match=r"a\.txt: 400 bytes of text or more, past the data limit \(399 bytes\)"):
        load_documents([root], limit_bytes=399)  # a first file past the limit is refused, not cut or skipped
    assert load_corpus([root], 400) == load_documents([root], 400)
    assert load_corpus(None, 10_000) == stdlib_documents(10_000)


def test_a_parquet_file_counts_its_text_decompressed(tmp_path) -> None:
    p = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"text": ["a" * 2_000_000] * 4}), p, compression="zstd")
    assert p.stat().st_size < 100_000  # the file alone would pass the limit below
    with pytest.raises(ValueError, match=r"bomb\.parquet: [\d,]+ bytes of text or more, past the data limit "
                                         r"\(1,000,000"):
        load_documents([p], limit_bytes=1_000_000)
    assert len(load_documents([p], limit_bytes=9_000_000)) == 4
    # one value repeated through a dictionary: its metadata states ~10 KB, decoded it is 20 MB
    q = tmp_path / "repeated.parquet"
    pq.write_table(pa.table({"n": list(range(2000)), "text": ["b" * 10_000] * 2000}), q, use_dictionary=True)
    meta = pq.ParquetFile(q).metadata
    assert sum(meta.row_group(g).column(1).total_uncompressed_size for g in range(meta.num_row_groups)) < 1_000_000
    with pytest.raises(ValueError, match=r"repeated\.parquet: [\d,]+ bytes of text or more, past the data limit"):
        load_documents([q], limit_bytes=1_000_000)
    assert len(load_documents([q], limit_bytes=20_000_000)) == 2000


def test_data_that_would_not_fit_in_memory_is_refused_before_it_is_read(tmp_path, monkeypatch) -> None:
    import k3.train.corpus as corpus

    (tmp_path / "a.txt").write_text("x" * 1000)
    (tmp_path / "b.txt").write_text("y" * 1000)
    available = 1500 * corpus.TOKENIZE_BYTES_PER_BYTE
    monkeypatch.setattr(corpus, "available_bytes", lambda device: available)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # one process
    assert corpus.tokenizable_bytes() == 1500
    with pytest.raises(ValueError, match=r"up to .*b\.txt holds 2,000 bytes of text or more.*--data-limit-mb"):
        load_documents([tmp_path])
    assert [d.name for d in load_documents([tmp_path], limit_bytes=1200)] == [f"{tmp_path.name}/a.txt"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # three ranks on this machine, each loading the whole corpus
    assert corpus.tokenizable_bytes() == 500
    monkeypatch.setattr(corpus, "available_bytes", lambda device: None)  # unknown: not bounded by memory
    assert len(load_documents([tmp_path])) == 2


def test_a_jsonl_line_nested_too_deeply_names_its_line(tmp_path) -> None:
    p = tmp_path / "deep.jsonl"
    p.write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"deep\.jsonl, line 2: invalid JSON \(nested too deeply\)"):
        load_documents([p])


def test_text_with_occasional_bad_bytes_is_still_text(tmp_path) -> None:
    p = tmp_path / "latin1.txt"
    p.write_bytes((b"x" * 99 + b"\xe9") * 50)  # 1 % of the bytes are not UTF-8: text, with a warning
    with pytest.warns(UserWarning, match=r"latin1\.txt: not valid UTF-8 \(first bad byte at offset 99\)"):
        (doc,) = load_documents([p])
    assert doc.text == ("x" * 99 + "\ufffd") * 50


# ------------------------------------------------------------------------------------------------
# split


def _docs(n: int) -> list[Document]:
    return [Document(f"doc{i:04d}.txt", f"text {i}") for i in range(n)]


def test_split_by_document_deterministic_disjoint_order_independent() -> None:
    docs = _docs(1000)
    train, val = split_documents(docs, val_fraction=0.1, seed=3)
    assert (train, val) == split_documents(docs, val_fraction=0.1, seed=3)
    names_t, names_v = {d.name for d in train}, {d.name for d in val}
    assert not names_t & names_v and names_t | names_v == {d.name for d in docs}
    assert 60 <= len(val) <= 140
    assert train == [d for d in docs if d.name in names_t]  # input order kept
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    t2, v2 = split_documents(shuffled, val_fraction=0.1, seed=3)
    assert {d.name for d in v2} == names_v
    # the assignment of a document depends only on (seed, name): a subset splits consistently
    t3, v3 = split_documents(docs[:500], val_fraction=0.1, seed=3)
    assert {d.name for d in v3} == names_v & {d.name for d in docs[:500]}
    # another seed gives another split
    assert {d.name for d in split_documents(docs, val_fraction=0.1, seed=4)[1]} != names_v


def test_split_stable_across_processes() -> None:
    # pinned values: sha256-based, so independent of PYTHONHASHSEED and of the platform
    train, val = split_documents(_docs(40), val_fraction=0.25, seed=0)
    pinned = ["doc0005.txt", "doc0008.txt", "doc0011.txt", "doc0016.txt", "doc0027.txt", "doc0031.txt", "doc0036.txt"]
    assert [d.name for d in val] == pinned
    # the documented rule: first 8 bytes of sha256(seed, NUL, name) as a fraction of 2**64
    rule = [
        d.name
        for d in _docs(40)
        if int.from_bytes(hashlib.sha256(f"0\x00{d.name}".encode()).digest()[:8], "big") / 2**64 < 0.25
    ]
    assert rule == pinned


def _rule_is_val(seed: int, name: str, val_fraction: float) -> bool:
    """The documented by-document rule, computed independently of the code under test."""
    return int.from_bytes(hashlib.sha256(f"{seed}\x00{name}".encode()).digest()[:8], "big") / 2**64 < val_fraction


def _pieces(name: str, train: list[Document], val: list[Document]) -> str:
    """The text of ``name`` in a split: whole, or its ``[train]`` window followed by its ``[val]`` window."""
    by_name = {d.name: d.text for d in train + val}
    if name in by_name:
        return by_name[name]
    assert f"{name}[train]" in {d.name for d in train} and f"{name}[val]" in {d.name for d in val}
    return by_name[f"{name}[train]"] + by_name[f"{name}[val]"]


def test_split_small_sets() -> None:
    for n in (2, 3, 5):
        for seed in range(10):
            for fraction in (0.05, 0.95):
                docs = _docs(n)
                train, val = split_documents(docs, val_fraction=fraction, seed=seed)
                assert train and val and len(train) + len(val) in (n, n + 1)  # n + 1: one document was cut
                assert all(_pieces(d.name, train, val) == d.text for d in docs)
    with pytest.raises(ValueError, match="no documents"):
        split_documents([])
    with pytest.raises(ValueError, match="all 2 documents are empty"):
        split_documents([Document("a", ""), Document("b", "")])
    for bad in (0.0, 1.0, -0.1, 2):
        with pytest.raises(ValueError, match="val_fraction"):
            split_documents(_docs(3), val_fraction=bad)


LINES = "".join(f"line {i:04d}\n" for i in range(100))  # 100 lines of 10 characters
LAST_FIVE = "line 0095\nline 0096\nline 0097\nline 0098\nline 0099\n"


@pytest.mark.parametrize("seed", range(4))
def test_split_one_document_into_train_and_val_windows(seed) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train, val = split_documents([Document("one.txt", LINES)], val_fraction=0.05, seed=seed)
    assert train == [Document("one.txt[train]", LINES[:950])]
    assert val == [Document("one.txt[val]", LAST_FIVE)]
    # 5.3 % is 53 characters: the cut moves to the nearest line start (3 characters away)
    assert split_documents([Document("one.txt", LINES)], val_fraction=0.053, seed=seed)[1][0].text == LAST_FIVE


def test_split_one_document_character_cut_without_near_line_start() -> None:
    no_newline = "ab" * 500
    train, val = split_documents([Document("flat", no_newline)], val_fraction=0.1)
    assert train[0].text == "ab" * 450 and val[0].text == "ab" * 50
    # the only line start (after "head") is far from the cut at 900 characters: cut there anyway
    text = "head\n" + "x" * 995
    train, val = split_documents([Document("far", text)], val_fraction=0.1)
    assert train[0].text == "head\n" + "x" * 895 and val[0].text == "x" * 100


def test_split_large_document_val_fraction() -> None:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "return", "value", "for", "in", "the", "é", "数据"]
    text = "".join(" ".join(rng.choice(words) for _ in range(rng.randrange(1, 12))) + "\n" for _ in range(60_000))
    assert len(text) > 400_000
    train, val = split_documents([Document("big.txt", text)], val_fraction=0.02, seed=0)
    (head,), (tail,) = train, val
    assert head.text + tail.text == text and text.endswith(tail.text)
    assert head.text.endswith("\n")  # cut at a line boundary
    assert abs(len(tail.text) / len(text) - 0.02) < 0.0005


def test_split_all_documents_on_one_side_cuts_the_longest() -> None:
    big = ("x" * 99 + "\n") * 100  # 10 000 characters, 100 lines
    docs = [Document("README", "hi\n"), Document("big.txt", big)]
    assert not any(_rule_is_val(0, d.name, 0.01) for d in docs)  # by document, validation would be empty
    train, val = split_documents(docs, val_fraction=0.01, seed=0)
    # 1 % of 10 003 characters ≈ 100: the last line of the longest document
    assert train == [Document("README", "hi\n"), Document("big.txt[train]", big[:9900])]
    assert val == [Document("big.txt[val]", "x" * 99 + "\n")]
    assert all(_rule_is_val(0, d.name, 0.999) for d in docs)  # by document, training would be empty
    train, val = split_documents(docs, val_fraction=0.999, seed=0)
    # 0.1 % ≈ 10 characters; the nearest line start (100) is too far: a character cut
    assert train == [Document("big.txt[train]", "x" * 10)]
    assert val == [Document("README", "hi\n"), Document("big.txt[val]", big[10:])]


def test_split_document_too_short_to_cut() -> None:
    with pytest.raises(ValueError, match=r"tiny\.txt \(the only document\) has 1 char.*needs at least 2 characters"):
        split_documents([Document("tiny.txt", "x")])
    assert split_documents([Document("two", "ab")]) == ([Document("two[train]", "a")], [Document("two[val]", "b")])


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=2), fraction=st.floats(0.001, 0.999), seed=st.integers(0, 2**32))
def test_split_one_document_round_trips(text, fraction, seed) -> None:
    train, val = split_documents([Document("d", text)], val_fraction=fraction, seed=seed)
    assert [d.name for d in train] == ["d[train]"] and [d.name for d in val] == ["d[val]"]
    head, tail = train[0].text, val[0].text
    assert head and tail and head + tail == text
    assert (train, val) == split_documents([Document("d", text)], val_fraction=fraction, seed=seed + 1)
    # the documented cut: ``round(fraction * len)`` characters of tail (kept inside the text), or a
    # line start that leaves each part at least half its intended size
    want = min(max(round(fraction * len(text)), 1), len(text) - 1)
    assert len(tail) == want or (head.endswith("\n") and 2 * len(tail) >= want and 2 * len(head) >= len(text) - want)


def test_cli_trains_on_a_single_text_file(tmp_path, capsys) -> None:
    """One ~400 KB file: its tail becomes the validation window, and training reports a finite val loss."""
    rng = random.Random(1)
    words = ["def", "return", "value", "self", "import", "for", "in", "if", "else", "None", "(", ")", ":"]
    text = "".join(" ".join(rng.choice(words) for _ in range(rng.randrange(1, 14))) + "\n" for _ in range(14_500))
    assert 400_000 < len(text.encode()) < 450_000
    data = tmp_path / "one.py"
    data.write_text(text)
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(data), "--out", str(out), "--steps", "2",
                 "--tokens-per-step", "256", "--curriculum", "0:32", "--optimizer", "adamw", "--no-progress"]) == 0
    assert "validation loss" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2 and math.isfinite(records[-1]["val_loss"]) and records[-1]["val_loss"] > 0


def test_cli_reports_a_tiny_or_binary_single_file(tmp_path, capsys) -> None:
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x")
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" * 64)
    for path, messages in [
        (tiny, ["tiny.txt (the only document) has 1 character(s): too short", "needs at least 2 characters"]),
        (binary, ["blob.txt: looks like a binary file (a NUL byte at offset 7), not text"]),
    ]:
        assert main(["train", "--preset", "tiny", "--data", str(path), "--out", str(tmp_path / "run"),
                     "--steps", "1", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert all(m in err for m in messages) and "every document is empty" not in err


# ------------------------------------------------------------------------------------------------
# packing


def _rows(batch):
    return [t.tolist() for t in batch]


def test_packing_by_hand_one_row() -> None:
    docs = [[10, 11, 12], [20, 21], [30, 31, 32, 33]]
    # stream: 10 11 12 E 20 21 E 30 31 32 33 E  (12 tokens, E = eos = 2)
    loader = PackedLoader(docs, seq_len=4, batch_size=1, eos_id=EOS, shuffle=False)
    assert loader.num_tokens == 12 and loader.num_documents == 3 and loader.batches_per_epoch() == 2
    x, y, m = next(loader)
    assert x.dtype == y.dtype == torch.int64 and m.dtype == torch.bool and x.shape == (1, 4)
    assert _rows((x, y, m)) == [[[10, 11, 12, 2]], [[11, 12, 2, 20]], [[True, True, True, False]]]
    x, y, m = next(loader)
    assert _rows((x, y, m)) == [[[20, 21, 2, 30]], [[21, 2, 30, 31]], [[True, True, False, True]]]
    assert loader.epoch == 0
    x, y, m = next(loader)  # tail "32 33 E" (< seq_len + 1) dropped, new epoch, same order (no shuffle)
    assert loader.epoch == 1
    assert _rows((x, y, m)) == [[[10, 11, 12, 2]], [[11, 12, 2, 20]], [[True, True, True, False]]]


def test_packing_by_hand_two_rows() -> None:
    docs = [[10, 11, 12], [20, 21], [30, 31, 32, 33]]
    loader = PackedLoader(docs, seq_len=2, batch_size=2, eos_id=EOS, shuffle=False)
    # shards of 6: [10 11 12 E 20 21] [E 30 31 32 33 E]
    x, y, m = next(loader)
    assert _rows((x, y, m)) == [[[10, 11], [2, 30]], [[11, 12], [30, 31]], [[True, True], [False, True]]]
    x, y, m = next(loader)
    assert _rows((x, y, m)) == [[[12, 2], [31, 32]], [[2, 20], [32, 33]], [[True, False], [True, True]]]
    assert loader.epoch == 0
    next(loader)
    assert loader.epoch == 1 and loader.position == 2


def test_mask_special_targets() -> None:
    # 4 and 5 are protocol ids (< NUM_SPECIAL_TOKENS); 100+ are ordinary tokens
    docs = [[100, 4, 101, 100, 5, 102, 101], [200, 201, 101]]
    plain = PackedLoader(docs, seq_len=10, batch_size=1, eos_id=EOS, shuffle=False)
    x, y, m = next(plain)
    assert y.tolist() == [[4, 101, 100, 5, 102, 101, 2, 200, 201, 101]]
    assert m.tolist() == [[True] * 7 + [False, True, True]]
    masked = PackedLoader(docs, seq_len=10, batch_size=1, eos_id=EOS, shuffle=False, mask_special=True)
    x2, y2, m2 = next(masked)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert m2.tolist() == [[False, True, True, False, True, True, False, False, True, True]]
    only4 = PackedLoader(docs, seq_len=10, batch_size=1, eos_id=EOS, shuffle=False, mask_special=True, special_ids=[4])
    assert next(only4)[2].tolist() == [[False, True, True, True, True, True, True, False, True, True]]


def _random_docs(n: int, seed: int, lo: int = 1, hi: int = 60) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(NUM_SPECIAL_TOKENS, 500) for _ in range(g.randrange(lo, hi))] for _ in range(n)]


def test_packing_invariants_random_docs() -> None:
    docs = _random_docs(80, seed=1)
    loader = PackedLoader(docs, seq_len=16, batch_size=3, eos_id=EOS, seed=5)
    for _ in range(3 * loader.batches_per_epoch() + 2):
        x, y, m = next(loader)
        assert x.shape == y.shape == m.shape == (3, 16)
        # every target is the next input token
        assert torch.equal(y[:, :-1], x[:, 1:])
        # eos only occurs as a separator here, so boundary crossings are exactly the eos inputs
        assert torch.equal(m, x != EOS)


def test_each_token_targeted_once_per_epoch() -> None:
    docs = _random_docs(30, seed=2)
    loader = PackedLoader(docs, seq_len=7, batch_size=1, eos_id=EOS, shuffle=False)
    stream = [t for d in docs for t in (*d, EOS)]
    got: list[int] = []
    for _ in range(loader.batches_per_epoch()):
        x, y, _m = next(loader)
        if not got:
            got.append(int(x[0, 0]))
        got.extend(y[0].tolist())
    assert got == stream[: len(got)] and len(stream) - len(got) < 8
    assert loader.epoch == 0


def test_shuffle_deterministic_per_seed_and_epoch() -> None:
    docs = _random_docs(50, seed=3)

    def run(seed: int, n: int) -> list[list[int]]:
        ld = PackedLoader(docs, seq_len=8, batch_size=2, eos_id=EOS, seed=seed)
        return [next(ld)[0].flatten().tolist() for _ in range(n)]

    per_epoch = PackedLoader(docs, seq_len=8, batch_size=2, eos_id=EOS).batches_per_epoch()
    a = run(0, 2 * per_epoch)
    assert a == run(0, 2 * per_epoch)
    assert a != run(1, 2 * per_epoch)
    assert a[:per_epoch] != a[per_epoch:]  # documents reshuffled each epoch


def test_set_seq_len_recuts_from_current_position() -> None:
    docs = _random_docs(40, seed=4)
    loader = PackedLoader(docs, seq_len=4, batch_size=1, eos_id=EOS, shuffle=False)
    stream = [t for d in docs for t in (*d, EOS)]
    x1, y1, _ = next(loader)
    x2, y2, _ = next(loader)
    loader.set_seq_len(9)
    x3, y3, m3 = next(loader)
    assert x3.shape == (1, 9)
    assert x3[0].tolist() == stream[8:17] and y3[0].tolist() == stream[9:18]
    loader.set_seq_len(3)
    assert next(loader)[0][0].tolist() == stream[17:20]
    with pytest.raises(ValueError, match="seq_len"):
        loader.set_seq_len(10_000)
    with pytest.raises(ValueError, match="seq_len"):
        loader.set_seq_len(0)


def test_not_enough_data() -> None:
    with pytest.raises(ValueError, match="not enough data"):
        PackedLoader([[5, 6, 7]], seq_len=8, batch_size=1, eos_id=EOS)
    with pytest.raises(ValueError, match="the training data has no tokens: all 2 of its documents are empty"):
        PackedLoader([[], []], seq_len=1, batch_size=1, eos_id=EOS)
    with pytest.raises(ValueError, match="the training data has no tokens: it has no documents"):
        PackedLoader([], seq_len=1, batch_size=1, eos_id=EOS)
    with pytest.raises(ValueError, match="the validation data has no tokens: it has no documents"):
        eval_batches([], seq_len=1, batch_size=1, eos_id=EOS)
    with pytest.raises(ValueError, match="batch_size"):
        PackedLoader([[5, 6, 7]], seq_len=1, batch_size=0, eos_id=EOS)


def _take(loader: PackedLoader, n: int) -> list[tuple[torch.Tensor, ...]]:
    return [next(loader) for _ in range(n)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(all(torch.equal(p, q) for p, q in zip(u, v)) for u, v in zip(a, b))


def test_state_round_trip_exact_across_epochs_and_seq_len_change() -> None:
    docs = _random_docs(60, seed=5)

    def make() -> PackedLoader:
        return PackedLoader(docs, seq_len=8, batch_size=4, eos_id=EOS, seed=11)

    orig = make()
    per_epoch = orig.batches_per_epoch()
    assert per_epoch >= 3
    _take(orig, per_epoch - 2)
    state = json.loads(json.dumps(orig.state_dict()))  # plain, JSON-serialisable
    more = _take(orig, 4)  # crosses the epoch boundary
    orig.set_seq_len(5)
    more += _take(orig, per_epoch + 3)  # and a seq_len change, then another epoch
    state2 = orig.state_dict()
    tail = _take(orig, 5)

    fresh = make()
    fresh.load_state_dict(state)
    again = _take(fresh, 4)
    fresh.set_seq_len(5)
    again += _take(fresh, per_epoch + 3)
    assert _same(more, again)
    assert fresh.state_dict() == state2

    resumed = make()  # constructed with the old seq_len; the state's seq_len wins
    resumed.load_state_dict(state2)
    assert resumed.seq_len == 5 and _same(_take(resumed, 5), tail)


def test_load_state_rejects_mismatch() -> None:
    docs = _random_docs(20, seed=6)
    state = PackedLoader(docs, seq_len=4, batch_size=2, eos_id=EOS, seed=1).state_dict()
    with pytest.raises(ValueError, match="'batch_size'"):
        PackedLoader(docs, seq_len=4, batch_size=3, eos_id=EOS, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="'seed'"):
        PackedLoader(docs, seq_len=4, batch_size=2, eos_id=EOS, seed=2).load_state_dict(state)
    other = [d[:] for d in docs]
    other[0][0] += 1
    with pytest.raises(ValueError, match="'fingerprint'"):
        PackedLoader(other, seq_len=4, batch_size=2, eos_id=EOS, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="'num_documents'"):
        PackedLoader(docs[:-1], seq_len=4, batch_size=2, eos_id=EOS, seed=1).load_state_dict(state)
    broken = dict(state)
    del broken["position"]
    with pytest.raises(ValueError, match="'position'"):
        PackedLoader(docs, seq_len=4, batch_size=2, eos_id=EOS, seed=1).load_state_dict(broken)


def test_eval_batches_pad_and_mask() -> None:
    docs = [[10, 11, 12], [20, 21]]  # stream 10 11 12 E 20 21 E (7 tokens)
    batches = eval_batches(docs, seq_len=4, batch_size=1, eos_id=EOS, pad_id=0)
    assert len(batches) == 2
    (x1, y1, m1), (x2, y2, m2) = batches
    assert _rows((x1, y1, m1)) == [[[10, 11, 12, 2]], [[11, 12, 2, 20]], [[True, True, True, False]]]
    assert _rows((x2, y2, m2)) == [[[20, 21, 2, 0]], [[21, 2, 0, 0]], [[True, True, False, False]]]
    both = eval_batches(docs, seq_len=4, batch_size=8, eos_id=EOS)
    assert len(both) == 1 and both[0][0].shape == (2, 4)
    assert len(eval_batches(_random_docs(50, 7), seq_len=4, batch_size=2, eos_id=EOS, max_batches=3)) == 3


def test_tokenize_documents_and_pack_stdlib_sample() -> None:
    docs = stdlib_documents(limit_bytes=60_000)
    tok = Tokenizer.train([d.text for d in docs], 400)
    ids = tokenize_documents(tok, docs)
    assert [tok.decode(i) for i in ids] == [d.text for d in docs]
    loader = PackedLoader(ids, seq_len=32, batch_size=2, eos_id=tok.eos_id)
    x, y, m = next(loader)
    assert x.shape == (2, 32) and int(x.max()) < tok.vocab_size


# ------------------------------------------------------------------------------------------------
# loss


def test_masked_mean_loss_hand_computation() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    targets = torch.tensor([[1, 4, 0], [2, 2, 3]])
    mask = torch.tensor([[True, False, True], [False, True, True]])
    expected = 0.0
    for b, t in [(0, 0), (0, 2), (1, 1), (1, 2)]:
        row = logits[b, t]
        expected += -(row[targets[b, t]] - math.log(sum(math.exp(v) for v in row.tolist())))
    expected /= 4
    loss = masked_mean_loss(logits, targets, mask)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert abs(loss.item() - expected) < 1e-5
    total, count = masked_loss_sum(logits, targets, mask)
    assert count == 4 and abs(total.item() / 4 - expected) < 1e-5


def test_masked_positions_ignored() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 7, requires_grad=True)
    targets = torch.randint(0, 7, (2, 4))
    mask = torch.tensor([[True, True, False, False], [False, True, True, False]])
    base = masked_mean_loss(logits, targets, mask)
    base.backward()
    assert torch.all(logits.grad[~mask] == 0) and torch.any(logits.grad[mask] != 0)
    poisoned = logits.detach().clone()
    poisoned[~mask] = float("nan")  # whatever sits at masked positions cannot leak in
    other_targets = torch.where(mask, targets, torch.full_like(targets, 6))
    assert torch.equal(masked_mean_loss(poisoned, other_targets, mask), base.detach())
    full = torch.nn.functional.cross_entropy(logits.detach()[mask], targets[mask])
    assert torch.allclose(base.detach(), full)


def test_masked_mean_loss_errors() -> None:
    logits = torch.zeros(1, 2, 3)
    targets = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="no supervised positions"):
        masked_mean_loss(logits, targets, torch.zeros(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        masked_mean_loss(logits, targets, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        masked_mean_loss(logits, targets, torch.ones(1, 2))
    assert masked_loss_sum(logits, targets, torch.zeros(1, 2, dtype=torch.bool))[1] == 0
