"""k3.files: the one crash-safe writer — a file is replaced whole or not at all, a failure leaves no temporary file,
errors name the target, permissions follow the umask as ``open()``'s do, and writers that take a filename work — and
the one bounded reader: regular files (links to them too) of at most a limit, anything else refused at once."""

from __future__ import annotations

import functools
import os
import re
import stat
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deadline import finishes
from k3.files import (atomic_write, descriptor_path, jsonl_records, open_regular, read_bytes, read_json, read_text,
                      write_bytes, write_text)


def test_content_is_replaced_whole(tmp_path):
    path = tmp_path / "f.txt"
    write_text(path, "a much longer old content\n" * 100)
    write_text(path, "new")
    assert path.read_text() == "new"
    write_bytes(path, b"\x00\xff")
    assert path.read_bytes() == b"\x00\xff"
    assert os.listdir(tmp_path) == ["f.txt"]  # no temporary file left beside it


def test_a_failure_inside_the_block_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_write(path) as tmp:
            assert tmp.parent == tmp_path and tmp != path
            tmp.write_text("half of the new")
            raise RuntimeError("boom")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]
    with pytest.raises(OSError, match=re.escape(f"cannot write {path}: disk on fire")):  # names the target
        with atomic_write(path) as tmp:
            tmp.write_text("half")
            raise OSError("disk on fire")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]


@pytest.mark.parametrize("where", ["missing directory", "parent is a file", "target is a directory"])
def test_an_unwritable_path_is_an_oserror_naming_it(tmp_path, where):
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    path = {"missing directory": tmp_path / "missing" / "f.txt", "parent is a file": tmp_path / "file" / "f.txt",
            "target is a directory": tmp_path / "dir"}[where]
    with pytest.raises(OSError, match=re.escape(f"cannot write {path}: ")):
        write_text(path, "x")
    assert sorted(os.listdir(tmp_path)) == ["dir", "file"] and os.listdir(tmp_path / "dir") == []


@pytest.mark.parametrize("link", [False, True])
def test_a_target_that_is_not_a_regular_file_is_refused_not_replaced(tmp_path, link):
    """``k3 chats --out /dev/full`` (as root) replaced the device node with a regular file: a FIFO here, reached
    directly or through a link, stays a FIFO and nothing is left beside it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    path = fifo
    if link:
        path = tmp_path / "link"
        path.symlink_to(fifo)
    with pytest.raises(OSError, match=re.escape(f"cannot write {path}: it is a FIFO, not a regular file: refused")):
        write_text(path, "x")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and path.exists()
    assert sorted(os.listdir(tmp_path)) == sorted({"fifo", path.name})


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_permissions_follow_the_umask_as_open_does(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_text(tmp_path / "atomic", "x")
        with open(tmp_path / "plain", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    mode = (tmp_path / "atomic").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_writer_taking_a_filename(tmp_path):
    path = tmp_path / "t.safetensors"
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}
    with atomic_write(path) as tmp:
        save_file(tensors, str(tmp))
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert os.listdir(tmp_path) == ["t.safetensors"]


def test_paths_may_be_strings(tmp_path):
    write_text(str(tmp_path / "s.txt"), "ok")
    assert Path(tmp_path / "s.txt").read_text() == "ok"


# ---------------------------------------------------------------------- the bounded reader
def test_reads_regular_files_and_links_to_them(tmp_path):
    (tmp_path / "blob").write_bytes(b'{"a": [1, 2]}')
    (tmp_path / "config.json").symlink_to(tmp_path / "blob")  # a Hugging Face cache links to its blobs
    assert read_bytes(tmp_path / "config.json", 13) == b'{"a": [1, 2]}'
    assert read_text(str(tmp_path / "blob"), 100) == '{"a": [1, 2]}'
    assert read_json(tmp_path / "config.json", 100) == {"a": [1, 2]}


@pytest.mark.parametrize("kind", ["link to /dev/zero", "fifo", "directory", "huge", "link to a huge file"])
def test_what_is_not_a_small_regular_file_is_refused_at_once(tmp_path, kind):
    path = tmp_path / "config.json"
    if kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)  # no writer: a plain open() would block forever
    elif kind == "directory":
        path.mkdir()
    else:
        huge = tmp_path / "blob" if kind == "link to a huge file" else path
        with open(huge, "wb") as f:
            f.truncate(64 * 2**30)  # sparse: 64 GiB that take no disk
        if huge != path:
            path.symlink_to(huge)
    expected = "larger than the 1,000-byte limit" if "huge" in kind else "not a regular file: refused"
    started = time.monotonic()
    for read in (read_bytes, read_text, read_json):
        with pytest.raises(ValueError, match=re.escape(f"{path}: ") + ".*" + expected):
            finishes(functools.partial(read, path, 1000))
    assert time.monotonic() - started < 1


def test_a_file_over_the_limit_or_not_json_names_the_file(tmp_path):
    path = tmp_path / "latest"
    path.write_bytes(b"x" * 11)
    assert read_bytes(path, 11) == b"x" * 11
    with pytest.raises(ValueError, match=re.escape(f"{path}: larger than the 10-byte limit for this file (11 bytes)")):
        read_bytes(path, 10)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not valid JSON")):
        read_json(path, 100)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=re.escape(f"{path}: not UTF-8 text")):
        read_text(path, 100)
    with pytest.raises(FileNotFoundError):
        read_bytes(tmp_path / "missing", 10)


def test_links_refused_where_asked_and_a_descriptor_path_names_the_file_checked(tmp_path):
    """``links=False`` refuses a link to a regular file (a cache whose entries are ours alone); `descriptor_path` of an
    open file reads that file, not what its name holds after it is replaced (a library that opens only paths then
    loads what was checked)."""
    path, link = tmp_path / "package.pt2", tmp_path / "link.pt2"
    path.write_bytes(b"checked")
    link.symlink_to(path)
    with pytest.raises(OSError):
        open_regular(link, 100, links=False)
    with open_regular(path, 100, links=False) as f:
        (tmp_path / "swapped").write_bytes(b"swapped")
        os.replace(tmp_path / "swapped", path)
        named = descriptor_path(f.fileno())
        assert named is not None  # Linux and macOS have one
        with open(named, "rb") as g:
            assert g.read() == b"checked"
    assert path.read_bytes() == b"swapped"


def test_jsonl_records_number_lines_and_name_each_bad_one():
    raw = '\ufeff{"a": 1}\n\n  \n{"text": "one\u2028line\u2029still"}\r\n[2]'.encode()
    assert list(jsonl_records(raw, "d.jsonl")) == [(1, {"a": 1}), (4, {"text": "one\u2028line\u2029still"}), (5, [2])]
    for bad, why in ((b'{"a": 1}\n{oops\n', r"invalid JSON \(Expecting property name"),
                     (b'{"a": 1}\n"\xff"\n', r"not valid UTF-8"),
                     (b'{"a": 1}\n' + b"[" * 100_000 + b"]" * 100_000, r"invalid JSON \(nested too deeply\)")):
        with pytest.raises(ValueError, match=rf"d\.jsonl, line 2: {why}"):
            list(jsonl_records(bad, "d.jsonl"))
