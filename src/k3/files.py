"""The one crash-safe file writer, `atomic_write`, and the one bounded reader, `read_bytes` / `read_text` /
`read_json`: every file kimi-k3 writes goes through the first, every config, tokenizer, manifest and pointer it reads
through the second; `jsonl_records` parses the JSON Lines files it reads.

A reader (or a run resumed after a crash) sees the old file or the new one, never a part: the new bytes go to a
temporary file in the same directory, which is fsynced and renamed over the target, and the directory entry is
fsynced too (so the rename itself survives a power loss). On any error the temporary file is removed, the target is
left as it was, and the error is an OSError naming the target.

A read opens the file without blocking (a FIFO with no writer does not hang it), checks on the open descriptor that
it is a regular file (symbolic links are followed — Hugging Face caches link to their blobs — but a link to
``/dev/zero``, a device, a FIFO or a directory is refused) and reads at most ``limit`` bytes; a larger file is a
ValueError naming the file and the limit, read no further. A missing file stays a FileNotFoundError.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from safetensors import SafetensorError

__all__ = ["CONFIG_LIMIT", "DATA_LIMIT", "POINTER_LIMIT", "atomic_write", "descriptor_path", "jsonl_records",
           "open_regular", "read_bytes", "read_json", "read_text", "user_cache", "write_bytes", "write_text"]

#: Read limits, far above any real file of the kind. Configs, manifests, ``train.json``, ``state.json``:
CONFIG_LIMIT = 64 * 2**20
#: Tokenizers (``tokenizer.json``, ``tiktoken.model``) and safetensors indexes (the release's: ~50 MB):
DATA_LIMIT = 1024 * 2**20
#: A run directory's ``latest`` (one checkpoint name):
POINTER_LIMIT = 4096

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


@contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write (``open``, ``safetensors.save_file``, ``savefig``…); when the
    block completes it is fsynced and renamed to ``path``. Any exception removes it and leaves ``path`` untouched;
    an OSError (or a writer's own error type) is re-raised as an OSError naming ``path``. A ``path`` that exists and
    is not a regular file (links followed: a device, a FIFO, a directory) is refused, never replaced."""
    path = Path(path)
    _check_replaceable(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask applies, as to open()
    except OSError as err:
        raise OSError(f"cannot write {path}: {err}") from err
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sync_directory(path.parent)
    except (OSError, SafetensorError) as err:  # safetensors reports a full disk as its own error type
        tmp.unlink(missing_ok=True)
        raise OSError(f"cannot write {path}: {err}") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _kind(mode: int) -> str:
    """What a file of ``mode`` that is not a regular file is, for an error message."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _check_replaceable(path: Path) -> None:
    """An OSError naming ``path`` if it exists and is not a regular file (`atomic_write` would replace it)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as err:
        raise OSError(f"cannot write {path}: {err}") from err
    if not stat.S_ISREG(mode):
        raise OSError(f"cannot write {path}: it is {_kind(mode)}, not a regular file: refused")


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """``path`` holds exactly ``data`` afterwards, or is unchanged (`atomic_write`)."""
    with atomic_write(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """``path`` holds exactly ``text`` (UTF-8) afterwards, or is unchanged (`atomic_write`)."""
    write_bytes(path, text.encode("utf-8"))


def open_regular(path: str | os.PathLike, limit: int | None = None, links: bool = True) -> BinaryIO:
    """``path`` opened for binary reading once it is known, on the open descriptor, to be a regular file (links
    followed; with ``links=False`` a link is an OSError) of at most ``limit`` bytes; else a ValueError naming it.
    Opening never blocks (``O_NONBLOCK``)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if links else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{os.fspath(path)}: {_kind(info.st_mode)}, not a regular file: refused")
        if limit is not None and info.st_size > limit:
            raise ValueError(_too_large(path, limit, f"{info.st_size:,} bytes"))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def descriptor_path(fd: int) -> str | None:
    """A path naming the open file ``fd`` itself (Linux's ``/proc/self/fd``, macOS's and the BSDs' ``/dev/fd``), for a
    library that opens only paths: it then reads the file checked on ``fd`` (`open_regular`), even if the name has
    been replaced since. None where the system has neither."""
    return next((f"{d}/{fd}" for d in ("/proc/self/fd", "/dev/fd") if os.path.isdir(d)), None)


def read_bytes(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (`open_regular`), at most ``limit`` of them: a longer file (or one
    that grows while read) is a ValueError naming it and the limit."""
    with open_regular(path, limit) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(_too_large(path, limit, "it grew while read"))
    return data


def read_text(path: str | os.PathLike, limit: int) -> str:
    """`read_bytes` decoded as UTF-8; invalid UTF-8 is a ValueError naming the file."""
    try:
        return read_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{os.fspath(path)}: not UTF-8 text ({err})") from err


def read_json(path: str | os.PathLike, limit: int) -> Any:
    """The JSON value of `read_text`; invalid JSON is a ValueError naming the file."""
    try:
        return json.loads(read_text(path, limit))
    except json.JSONDecodeError as err:
        raise ValueError(f"{os.fspath(path)}: not valid JSON ({err})") from err


def jsonl_records(raw: bytes, source: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank line of the JSON Lines bytes ``raw`` (lines end at ``\\n`` only, so
    a string holding U+2028 stays one line; a UTF-8 BOM may open the first). A line that is not UTF-8 or not JSON —
    nested past the parser's depth included — is a ValueError naming ``source`` and the line."""
    for number, line in enumerate(raw.split(b"\n"), 1):
        where = f"{os.fspath(source)}, line {number}"
        try:
            text = line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{where}: not valid UTF-8 ({err})") from err
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: invalid JSON ({err.msg})") from err
        except RecursionError as err:
            raise ValueError(f"{where}: invalid JSON (nested too deeply)") from err
        yield number, value


def user_cache(name: str) -> Path:
    """The directory ``name`` of kimi-k3's per-user cache (``$XDG_CACHE_HOME/k3/name``, default ``~/.cache/k3/name``);
    not created. RuntimeError when there is no home directory."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k3" / name


def _too_large(path: str | os.PathLike, limit: int, size: str) -> str:
    return f"{os.fspath(path)}: larger than the {limit:,}-byte limit for this file ({size}): refused"


def _sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
