"""The one crash-safe file writer: every file kimi-k3 writes goes through `atomic_write`.

A reader (or a run resumed after a crash) sees the old file or the new one, never a part: the new bytes go to a
temporary file in the same directory, which is fsynced and renamed over the target, and the directory entry is
fsynced too (so the rename itself survives a power loss). On any error the temporary file is removed, the target is
left as it was, and the error is an OSError naming the target.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

__all__ = ["atomic_write", "write_bytes", "write_text"]


@contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write (``open``, ``safetensors.save_file``, ``savefig``…); when the
    block completes it is fsynced and renamed to ``path``. Any exception removes it and leaves ``path`` untouched;
    an OSError (or a writer's own error type) is re-raised as an OSError naming ``path``."""
    path = Path(path)
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


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """``path`` holds exactly ``data`` afterwards, or is unchanged (`atomic_write`)."""
    with atomic_write(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """``path`` holds exactly ``text`` (UTF-8) afterwards, or is unchanged (`atomic_write`)."""
    write_bytes(path, text.encode("utf-8"))


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
