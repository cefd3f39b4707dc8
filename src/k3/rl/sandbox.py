"""Sandboxes for untrusted generated code and tool calls (SPEC §8 AgentENV; issue 19).

A `Sandbox` owns a private temporary root. `run` executes one program in it through a trusted supervisor
(this file run as a script): cwd = HOME = TMPDIR = the root, a minimal environment, a new session, and
resource limits (`Limits`: CPU, address space, file size, process count, output, wall clock, root size).
No process of the sandbox survives the return of `run`, so a paused sandbox holds no CPU or memory;
`snapshot`/`restore`, `fork` (an independent copy for side-effect-free judging) and `checkpoint`/`resume`
copy the root's directories, regular files and symlinks (kept as links, never followed; FIFOs, sockets and
device files are not copied).

What is enforced (`isolation()` reports which of these features this host grants):

* ``pid`` — the program runs in a new PID namespace under a trusted init; when the program exits or is
  killed, the kernel kills everything left in the namespace. Its /proc is the namespace's own (or, where
  the host refuses that mount, empty): it lists only the sandbox's processes, so no host process, command
  line or environment can be read. Without it, the supervisor is a child subreaper that kills and reaps
  every descendant (a non-root program can still kill the supervisor itself and orphan its children then),
  and /proc lists the host's processes and their command lines (environments only of processes of the
  program's own uid: none but its own as root).
* ``net`` — a new network namespace with no interfaces up: no IPv4/IPv6, no abstract Unix sockets.
  Without it only Python code (`run_python`) is guarded, by an audit hook refusing IP sockets, which
  ctypes or a spawned program can bypass; `run` with argv has network access then.
* ``readonly`` — a new mount namespace in which every mount except the root is read-only, so nothing
  outside the root can be written (/dev/null and other device nodes stay usable), and the host's temporary
  directory, which holds every sandbox's root, is covered by an empty one holding only this root.
* ``uid`` (when started as root) — the program runs as a fresh unprivileged uid/gid owning the root, with
  no capabilities and no supplementary groups, so RLIMIT_NPROC binds and file permissions apply; without
  ``pid`` the supervisor also kills every process of that uid after the run. Directories on the interpreter's path
  that the uid cannot search (e.g. /root) are covered by a tmpfs holding only the interpreter's prefix
  (this needs the mount namespace). Without ``readonly``, world-writable directories such as /tmp stay
  writable.
* ``user`` (when started as non-root) — a user namespace makes the PID/network/mount namespaces possible
  and makes RLIMIT_NPROC count only the sandbox's processes. Without it the program runs as the calling
  user, may signal the user's other processes and write wherever the user may, and the process limit is
  set relative to the user's current process count.

Always: no-new-privileges (setuid binaries do not elevate), RLIMIT_CORE = 0, output beyond ``output_bytes``
read and discarded, and `run_python`'s source handed over in an inherited memory file, never on a command line
(which every process of the host may read). Memory is bounded per process (RLIMIT_AS), not per sandbox.
Checkpoints carry SHA-256 digests: they detect corruption and naive edits, not a forger who rewrites them.
A `Sandbox` is not thread-safe; run one program at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pwd
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import weakref
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Literal

from k3.files import DATA_LIMIT, read_bytes, write_bytes
from k3.rl.jail import process_uids

__all__ = ["Limits", "Result", "Entry", "Snapshot", "Sandbox", "isolation"]

_ROOT = os.geteuid() == 0
_USE_NAMESPACES = True  # False forces the fallback containment (tests exercise it)
_UIDS = range(40000, 60000)  # fresh uids for sandboxes started as root (inside a rootless 64 Ki id map)
_GRACE = 5.0  # seconds the supervisor gets to clean up after being told to stop
_DISK_POLL = 0.25
_FORMAT = "k3-sandbox-checkpoint/1"
_PATH = "/usr/local/bin:/usr/bin:/bin"
_JAIL = str(Path(__file__).with_name("jail.py"))  # the supervisor, run as a script
_NET_GUARD = """import socket as _s, sys as _y
def _k3_no_net(e, a):
    if e in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg") and a[0].family in (
            _s.AF_INET, _s.AF_INET6):
        raise PermissionError("sandbox: network access is disabled")
    if e.startswith("socket.get") and e != "socket.gethostname":
        raise PermissionError("sandbox: network access is disabled")
_y.addaudithook(_k3_no_net)
del _s, _y, _k3_no_net
"""
#: ``python -I -c _BOOT FD``: read the program from the inherited file descriptor FD (never from argv, which
#: every process on the host can read in /proc/PID/cmdline), close it, then run it as ``__main__``.
_BOOT = """def _k3_source():
    import sys
    with open(int(sys.argv.pop(1)), "rb") as f:
        return f.read()
_k3_source = _k3_source()
{guard}exec(compile(globals().pop("_k3_source"), "<string>", "exec"), globals())
"""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. Exceeding ``disk_bytes`` kills the run, notes it on stderr and makes it fail."""

    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    output_bytes: int = 64 << 10
    processes: int = 64
    disk_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"Limits.{f.name} must be a positive number, got {value!r}")
            if f.name != "wall_seconds" and not isinstance(value, int):
                raise ValueError(f"Limits.{f.name} must be an int, got {value!r}")


@dataclass(frozen=True)
class Result:
    """One run: ``returncode`` is None when killed for time, negative for a signal (subprocess style)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    seconds: float


@dataclass(frozen=True)
class Entry:
    """One node of a root: a directory, a regular file (``data``) or a symlink (``target``)."""

    path: str
    kind: Literal["dir", "file", "link"]
    mode: int = 0o755
    data: bytes = b""
    target: str = ""

    def __post_init__(self) -> None:
        parts = self.path.split("/")
        if not self.path or "\0" in self.path or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"entry path must be relative and normalised, got {self.path!r}")
        if self.kind not in ("dir", "file", "link"):
            raise ValueError(f"entry kind must be dir, file or link, got {self.kind!r}")
        if not isinstance(self.mode, int) or not 0 <= self.mode <= 0o777:
            raise ValueError(f"entry mode must be in [0, 0o777], got {self.mode!r}")
        if (self.kind == "link") != bool(self.target) or "\0" in self.target:
            raise ValueError(f"entry {self.path!r}: a symlink needs a target and only a symlink has one")
        if self.kind != "file" and self.data:
            raise ValueError(f"entry {self.path!r}: only a regular file has data")


@dataclass(frozen=True)
class Snapshot:
    """An immutable copy of a root: entries in walk order (every parent directory before its children)."""

    entries: tuple[Entry, ...]

    def __post_init__(self) -> None:
        dirs: set[str] = set()
        for e in self.entries:
            parent = e.path.rpartition("/")[0]
            if parent and parent not in dirs:
                raise ValueError(f"snapshot entry {e.path!r} does not follow its directory {parent!r}")
            if e.kind == "dir":
                dirs.add(e.path)
        if len({e.path for e in self.entries}) != len(self.entries):
            raise ValueError("snapshot entries have duplicate paths")


class Sandbox:
    """A private temporary root plus isolated runs in it (see the module docstring); a context manager."""

    def __init__(self, limits: Limits = Limits()) -> None:
        if not isinstance(limits, Limits):
            raise TypeError(f"limits must be a Limits, got {type(limits).__name__}")
        self._limits = limits
        self._uid = _free_uid() if _ROOT else None
        base = Path(tempfile.mkdtemp(prefix="k3-sandbox-")).resolve()
        self._finalizer = weakref.finalize(self, _remove, base)
        os.chmod(base, 0o711 if _ROOT else 0o700)  # the uid may enter but not rename its root
        self._root = base / "root"
        self._root.mkdir(mode=0o700)
        self._own(self._root)

    @property
    def root(self) -> Path:
        return self._root

    @property
    def limits(self) -> Limits:
        return self._limits

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete the root; the sandbox cannot be used afterwards."""
        self._finalizer()

    def run(self, argv: list[str], stdin: str = "", timeout: float | None = None) -> Result:
        """Run ``argv`` (looked up on a minimal PATH) in the root; every process it made is gone on return.
        A command line is visible to every process of the host (/proc/PID/cmdline): pass untrusted content in
        ``stdin`` or a file of the root, as `run_python` does."""
        return self._run(argv, stdin, timeout)

    def run_python(self, source: str, stdin: str = "", timeout: float | None = None) -> Result:
        """Run Python ``source`` with this interpreter in isolated mode (-I); the source reaches the program
        through an inherited memory file, never its command line."""
        if not isinstance(source, str):
            raise TypeError(f"source must be str, got {type(source).__name__}")
        with _memory_file(source.encode()) as f:
            return self._run(_python_argv(f.fileno(), guard="net" not in isolation()), stdin, timeout, (f.fileno(),))

    def _run(self, argv: list[str], stdin: str, timeout: float | None, pass_fds: tuple[int, ...] = ()) -> Result:
        if not isinstance(argv, list | tuple) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"argv must be a non-empty list of str, got {argv!r}")
        if not isinstance(stdin, str):
            raise TypeError(f"stdin must be str, got {type(stdin).__name__}")
        timeout = self._limits.wall_seconds if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self._check_open()
        os.chmod(self._root, 0o700)
        cfg = _config(self._root, self._uid, self._limits)
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _JAIL, json.dumps(cfg), *argv], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, cwd="/", env=cfg["env"],
            pass_fds=pass_fds)
        try:
            out, err, truncated, timed_out, over_disk = self._communicate(proc, stdin.encode(), timeout)
        finally:
            _kill_group(proc)
        code = None if timed_out else proc.returncode
        size = _tree_bytes(self._root, unlock=True)
        if size > self._limits.disk_bytes or over_disk:
            err += f"\nsandbox: the root holds {size} bytes, over disk_bytes={self._limits.disk_bytes}\n".encode()
            code = 1 if code == 0 else code
        text = lambda b: b.decode("utf-8", errors="replace")
        return Result(code, text(out), text(err), timed_out, truncated, time.monotonic() - start)

    def write(self, path: str, data: str | bytes) -> None:
        """Write a file under the root, making its directories; ValueError if ``path`` leaves the root."""
        if not isinstance(data, str | bytes):
            raise TypeError(f"data must be str or bytes, got {type(data).__name__}")
        target = self._resolve(path)
        parts = target.relative_to(self._root).parts
        for i in range(1, len(parts)):
            if not (d := self._root.joinpath(*parts[:i])).exists():
                d.mkdir()
                self._own(d)
        target.write_bytes(data.encode() if isinstance(data, str) else data)
        self._own(target)

    def read(self, path: str) -> bytes:
        """The bytes of a file under the root; ValueError if ``path`` (or a symlink on it) leaves the root."""
        return self._resolve(path).read_bytes()

    def listdir(self, path: str = ".") -> list[str]:
        """Sorted names in a directory under the root."""
        return sorted(os.listdir(self._resolve(path)))

    def snapshot(self) -> Snapshot:
        """An immutable in-memory copy of the whole root."""
        self._check_open()
        return Snapshot(tuple(_walk_entries(self._root)))

    def restore(self, snapshot: Snapshot) -> None:
        """Make the root exactly ``snapshot``."""
        if not isinstance(snapshot, Snapshot):
            raise TypeError(f"snapshot must be a Snapshot, got {type(snapshot).__name__}")
        self._check_open()
        _clear(self._root)
        for e in snapshot.entries:
            p = self._root / e.path
            if e.kind == "dir":
                p.mkdir(mode=0o700)
            elif e.kind == "link":
                os.symlink(e.target, p)
            else:
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with open(fd, "wb") as f:
                    f.write(e.data)
                os.chmod(p, e.mode)
            self._own(p)
        for e in reversed(snapshot.entries):  # directories last, deepest first, so their modes cannot block us
            if e.kind == "dir":
                os.chmod(self._root / e.path, e.mode)

    def fork(self) -> Sandbox:
        """An independent copy with the same limits: nothing done in one is seen by the other."""
        child = Sandbox(self._limits)
        child.restore(self.snapshot())
        return child

    def checkpoint(self, path: Path) -> Path:
        """Write the root and limits to ``path`` (a tar with a manifest), atomically; return ``path``."""
        path = Path(path)
        write_bytes(path, _pack(self.snapshot(), self._limits))
        return path

    @classmethod
    def resume(cls, path: Path, limits: Limits | None = None) -> Sandbox:
        """A new sandbox holding a checkpoint's root (and its limits unless given); ValueError if corrupt."""
        snapshot, saved = _unpack(read_bytes(path, DATA_LIMIT))  # a regular file: a FIFO or a device is refused
        box = cls(saved if limits is None else limits)
        box.restore(snapshot)
        return box

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ValueError("sandbox is closed")

    def _own(self, path: Path) -> None:
        if self._uid is not None:
            os.lchown(path, self._uid, self._uid)

    def _resolve(self, path: str) -> Path:
        self._check_open()
        if not isinstance(path, str) or "\0" in path:
            raise ValueError(f"path must be a str without NUL, got {path!r}")
        if PurePosixPath(path).is_absolute():
            raise ValueError(f"path must be relative to the sandbox root, got {path!r}")
        full = (self._root / path).resolve()
        if full != self._root and self._root not in full.parents:
            raise ValueError(f"path {path!r} leaves the sandbox root")
        return full

    def _communicate(self, proc: subprocess.Popen, data: bytes, timeout: float):
        """Feed stdin, read both streams up to the cap, enforce wall time and disk size; until all closed."""
        cap, limits = self._limits.output_bytes, self._limits
        bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        sel = selectors.DefaultSelector()
        for f in bufs:
            sel.register(f, selectors.EVENT_READ)
        if data:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        view, start, truncated, timed_out, over_disk = memoryview(data), time.monotonic(), False, False, False
        stopped, next_disk = None, start + _DISK_POLL
        while sel.get_map() or proc.poll() is None:
            now = time.monotonic()
            if stopped is None and now >= next_disk:
                next_disk = now + _DISK_POLL
                over_disk = _tree_bytes(self._root, unlock=False) > limits.disk_bytes
            if stopped is None and (now - start >= timeout or over_disk):
                timed_out, stopped = not over_disk, now
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
            if stopped is not None and now - stopped > _GRACE:
                _kill_group(proc)
                if now - stopped > 2 * _GRACE:
                    break
            if not sel.get_map():
                try:
                    proc.wait(0.05)
                except subprocess.TimeoutExpired:
                    pass
                continue
            for key, _ in sel.select(0.05):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        view = view[os.write(f.fileno(), view[:65536]):]
                    except (BrokenPipeError, BlockingIOError) as e:
                        view = view if isinstance(e, BlockingIOError) else view[:0]
                    if not view:
                        sel.unregister(f)
                        f.close()
                    continue
                if not (chunk := os.read(f.fileno(), 65536)):
                    sel.unregister(f)
                    continue
                buf = bufs[f]
                room = cap - len(buf)
                buf += chunk[:room]
                truncated |= len(chunk) > room
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), truncated, timed_out, over_disk


@cache
def _probe(namespaces: bool) -> frozenset[str]:
    """The features the supervisor obtains for a root laid out as a sandbox's (the same mounts are tried)."""
    with tempfile.TemporaryDirectory(prefix="k3-sandbox-") as base:
        root = Path(base).resolve() / "root"
        root.mkdir()
        cfg = {**_config(root, 0 if _ROOT else None, Limits()), "probe": True, "namespaces": namespaces}
        done = subprocess.run([sys.executable, "-I", "-S", _JAIL, json.dumps(cfg)], capture_output=True, text=True,
                              timeout=60, env=cfg["env"], cwd="/")
    if done.returncode != 0:
        raise RuntimeError(f"sandbox supervisor failed to start: {done.stderr.strip()}")
    return frozenset(json.loads(done.stdout))


def isolation() -> frozenset[str]:
    """The isolation features this host grants sandboxes: a subset of {pid, net, readonly, uid, user}."""
    return _probe(_USE_NAMESPACES)


def _memory_file(data: bytes) -> io.BufferedRandom:
    """An anonymous in-memory file holding ``data``, positioned at its start."""
    f = open(os.memfd_create("k3-sandbox-source", os.MFD_CLOEXEC), "w+b")
    f.write(data)
    f.seek(0)
    return f


def _python_argv(source_fd: int, guard: bool) -> list[str]:
    """The command running the Python program readable at ``source_fd`` (see `_BOOT`)."""
    return [sys.executable, "-I", "-c", _BOOT.format(guard=_NET_GUARD if guard else ""), str(source_fd)]


def _config(root: Path, uid: int | None, limits: Limits) -> dict:
    """What the supervisor needs; the interpreter's directories are exposed to a dropped uid."""
    env = {"PATH": _PATH, "HOME": str(root), "TMPDIR": str(root), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    expose = sorted({os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable)),
                     sys.prefix, sys.base_prefix})
    return {"root": str(root), "uid": uid, "limits": dataclasses.asdict(limits), "env": env,
            "expose": expose, "namespaces": _USE_NAMESPACES, "probe": False}


def _free_uid() -> int:
    """A uid with no account and no process, for one sandbox started as root."""
    busy = set(process_uids())
    for uid in random.sample(_UIDS, 64):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            if uid not in busy:
                return uid
    raise RuntimeError("no free uid for a sandbox")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the supervisor's process group (its session leader is the supervisor)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _walk(root: Path, unlock: bool, rel: str = ""):
    """(relative path, lstat) of every node under ``root``, parents first, never following symlinks.

    With ``unlock`` (non-root parents), directories the owner cannot list are opened up while visited.
    """
    here = root / rel if rel else root
    try:
        mode = stat.S_IMODE(os.lstat(here).st_mode)
    except FileNotFoundError:  # removed while a run is going on
        return
    locked = not _ROOT and mode & 0o500 != 0o500
    if locked and not unlock:
        return
    if locked:
        os.chmod(here, mode | 0o700)
    try:
        for name in sorted(os.listdir(here)):
            r = f"{rel}/{name}" if rel else name
            try:
                st = os.lstat(root / r)
            except FileNotFoundError:
                continue
            yield r, st
            if stat.S_ISDIR(st.st_mode):
                yield from _walk(root, unlock, r)
    except (FileNotFoundError, NotADirectoryError):
        return
    finally:
        if locked:
            os.chmod(here, mode)


def _walk_entries(root: Path):
    for rel, st in _walk(root, unlock=True):
        mode, p = stat.S_IMODE(st.st_mode) & 0o777, root / rel
        if stat.S_ISDIR(st.st_mode):
            yield Entry(rel, "dir", mode)
        elif stat.S_ISLNK(st.st_mode):
            yield Entry(rel, "link", 0, target=os.readlink(p))
        elif stat.S_ISREG(st.st_mode):
            locked = not _ROOT and not st.st_mode & stat.S_IRUSR
            if locked:
                os.chmod(p, mode | stat.S_IRUSR)
            try:
                with open(os.open(p, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                    yield Entry(rel, "file", mode, f.read())
            finally:
                if locked:
                    os.chmod(p, stat.S_IMODE(st.st_mode))


def _tree_bytes(root: Path, unlock: bool) -> int:
    return sum(st.st_size for _, st in _walk(root, unlock) if stat.S_ISREG(st.st_mode))


def _clear(root: Path) -> None:
    """Empty ``root`` without following symlinks, whatever modes the sandbox left."""
    for rel, st in list(_walk(root, unlock=True)):
        if stat.S_ISDIR(st.st_mode):
            os.chmod(root / rel, 0o700)
    for name in os.listdir(root):
        p = root / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _remove(base: Path) -> None:
    if base.exists():
        _clear(base)
        base.rmdir()


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o600, 0
    return info


def _tar_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    tf.addfile(_tar_info(name, len(data)), io.BytesIO(data))


def _pack(snapshot: Snapshot, limits: Limits) -> bytes:
    """MANIFEST.json, then ``root/<path>`` per file, then SHA256: the digest of every byte before it."""
    entries = [{"path": e.path, "kind": e.kind, "mode": e.mode, "target": e.target, "size": len(e.data),
                "sha256": hashlib.sha256(e.data).hexdigest()} for e in snapshot.entries]
    manifest = {"format": _FORMAT, "limits": dataclasses.asdict(limits), "entries": entries}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        _tar_member(tf, "MANIFEST.json", json.dumps(manifest, indent=1).encode())
        for e in snapshot.entries:
            if e.kind == "file":
                _tar_member(tf, f"root/{e.path}", e.data)
        _tar_member(tf, "SHA256", hashlib.sha256(buf.getvalue()).hexdigest().encode())
    return buf.getvalue()


def _unpack(data: bytes) -> tuple[Snapshot, Limits]:
    """Verify a checkpoint (every byte is covered by the digest, a tar checksum or the zero tail)."""
    try:
        tf = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
        members = tf.getmembers()
        if len(members) < 2 or members[0].name != "MANIFEST.json" or members[-1].name != "SHA256":
            raise ValueError("missing MANIFEST.json or SHA256 member")
        if not all(m.isfile() for m in members):
            raise ValueError("a member is not a regular file")
        blobs = [tf.extractfile(m).read() for m in members]
        last = members[-1]
        if blobs[-1] != hashlib.sha256(data[: last.offset]).hexdigest().encode():
            raise ValueError("digest mismatch")
        if data[last.offset:last.offset_data] != _tar_info("SHA256", 64).tobuf(tarfile.PAX_FORMAT, "utf-8",
                                                                             "surrogateescape"):
            raise ValueError("the digest's header was altered")
        if any(data[last.offset_data + last.size:]) or len(data) % tarfile.RECORDSIZE or (
                len(data) < last.offset_data + 3 * tarfile.BLOCKSIZE):
            raise ValueError("the archive's end was altered or cut")
        manifest = json.loads(blobs[0])
        if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or set(manifest) != {
                "format", "limits", "entries"}:
            raise ValueError("unknown manifest format")
        limits = Limits(**manifest["limits"])
        files, entries = iter(zip(members[1:-1], blobs[1:-1])), []
        for item in manifest["entries"]:
            if set(item) != {"path", "kind", "mode", "target", "size", "sha256"}:
                raise ValueError(f"malformed manifest entry {item!r}")
            data_ = b""
            if item["kind"] == "file":
                member, data_ = next(files, (None, b""))
                if member is None or member.name != f"root/{item['path']}" or len(data_) != item["size"]:
                    raise ValueError(f"file {item['path']!r} does not match its member")
                if hashlib.sha256(data_).hexdigest() != item["sha256"]:
                    raise ValueError(f"file {item['path']!r} does not match its digest")
            entries.append(Entry(item["path"], item["kind"], item["mode"], data_, item["target"]))
        if next(files, None) is not None:
            raise ValueError("members not listed in the manifest")
        return Snapshot(tuple(entries)), limits
    except (tarfile.TarError, EOFError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"corrupt or tampered sandbox checkpoint: {e}") from None
