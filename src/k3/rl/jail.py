"""The sandbox supervisor (`k3.rl.sandbox`; SPEC §8): run as a script, ``python -I -S jail.py CONFIG ARGV...``.

Trusted code, standard library only (it runs without site-packages): it isolates itself (mount, PID and network
namespaces, a user namespace when not root, read-only mounts outside the sandbox root, other sandboxes' roots
covered), starts a trusted init that mounts the PID namespace's own /proc, drops privileges and resource-limits the
program, relays the program's exit status, and kills and reaps every process the program left. `k3.rl.sandbox`
documents what each feature enforces.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import resource
import signal
import stat
import sys
import time
from pathlib import Path


_libc = ctypes.CDLL(None, use_errno=True)
_NEWNS, _NEWUSER, _NEWPID, _NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
_ATTR_RDONLY, _ATTR_NOSUID, _ATTR_NODEV = 1, 2, 4
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE = 442, -100, 0x8000
_PDEATHSIG, _SUBREAPER, _NO_NEW_PRIVS = 1, 36, 38


def process_uids() -> list[int]:
    """The (effective) uid of every live process."""
    uids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            uids.append(os.stat(f"/proc/{pid}").st_uid)
    return uids


def _c(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()
    _c(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _set_mount_attr(path: str, set_: int, clear: int, recursive: bool) -> None:
    attr = (ctypes.c_uint64 * 4)(set_, clear, 0, 0)
    flags = _AT_RECURSIVE if recursive else 0
    _c(_libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path.encode(), flags, attr, 32), f"mount_setattr {path}")


def _hidden_ancestor(path: str) -> str | None:
    """The topmost proper ancestor of ``path`` that others may not search, if any."""
    parts = Path(path).parts
    for i in range(1, len(parts)):
        a = os.path.join(*parts[:i])
        if not os.stat(a).st_mode & stat.S_IXOTH:
            return a
    return None


def _cover(top: str, keep: list[str]) -> None:
    """Mount an empty tmpfs on ``top`` holding bind mounts of the paths in ``keep`` (below ``top``) only."""
    keep = [p for p in keep if not any(p != q and p.startswith(q + "/") for q in keep)]
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in keep}
    _mount("tmpfs", top, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
    for p in keep:
        os.makedirs(p, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fds[p]}", p, None, _MS_BIND | _MS_REC)
        os.close(fds[p])


def _expose(paths: list[str]) -> None:
    """Cover hidden ancestors with a tmpfs holding bind mounts of ``paths`` only (root, new mount ns)."""
    todo = [(a, p) for p in paths if (a := _hidden_ancestor(p))]
    for a in dict.fromkeys(a for a, _ in todo):
        _cover(a, [p for b, p in todo if b == a])


def _hide_siblings(root: str, expose: list[str]) -> None:
    """Bind the root in place under an empty tmpfs covering the directory that holds every sandbox (the host's
    temporary directory), so other sandboxes' files cannot be seen; the interpreter stays if it lives there."""
    top = os.path.dirname(os.path.dirname(root))
    _cover(top, [root, *(p for p in expose if p.startswith(top.rstrip("/") + "/"))])


def _fresh_proc() -> None:
    """A /proc of the sandbox's PID namespace, which lists only the sandbox's processes, or an empty one where
    the host refuses that mount; in a mount namespace of the init's own, as the supervisor reads the host's."""
    _c(_libc.unshare(_NEWNS), "unshare")
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY
    try:
        _mount("proc", "/proc", "proc", flags)
    except OSError:
        _mount("tmpfs", "/proc", "tmpfs", flags, "mode=0555,size=4k")


def _isolate(cfg: dict) -> set[str]:
    """Unshare namespaces and make everything but the root read-only, as far as the host allows."""
    features = {"uid"} if cfg["uid"] is not None else set()
    if not cfg["namespaces"]:
        return features
    uid, gid = os.getuid(), os.getgid()
    flags = _NEWNS | _NEWPID | _NEWNET | (0 if cfg["uid"] is not None else _NEWUSER)
    try:
        _c(_libc.unshare(flags), "unshare")
    except OSError:
        return features
    features |= {"pid", "net"} | ({"user"} if flags & _NEWUSER else set())
    if flags & _NEWUSER:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    try:
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        if cfg["uid"] is not None:
            _expose(cfg["expose"])
        _hide_siblings(cfg["root"], cfg["expose"])
        _set_mount_attr("/", _ATTR_RDONLY, 0, recursive=True)
        _set_mount_attr(cfg["root"], _ATTR_NOSUID | _ATTR_NODEV, _ATTR_RDONLY, recursive=False)
        features.add("readonly")
    except OSError:
        pass
    return features


def _exec_program(cfg: dict, features: set[str], argv: list[str]) -> None:
    """The sandboxed program's process: drop privileges, set limits, exec. Never returns."""
    try:
        lim, uid = cfg["limits"], cfg["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            nproc = lim["processes"]
        elif "user" in features:
            nproc = lim["processes"] + 2  # the supervisor and the init share the namespace's count
        else:
            nproc = process_uids().count(os.getuid()) + lim["processes"] - 1
        _c(_libc.prctl(_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        _c(_libc.prctl(_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
        for res, soft, hard in ((resource.RLIMIT_CPU, lim["cpu_seconds"], lim["cpu_seconds"] + 1),
                                (resource.RLIMIT_AS, lim["memory_bytes"], lim["memory_bytes"]),
                                (resource.RLIMIT_FSIZE, lim["file_bytes"], lim["file_bytes"]),
                                (resource.RLIMIT_NPROC, nproc, nproc)):
            now = resource.getrlimit(res)[1]  # a limit can only be lowered
            if now != resource.RLIM_INFINITY:
                soft, hard = min(soft, now), min(hard, now)
            resource.setrlimit(res, (soft, hard))
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.chdir(cfg["root"])
        os.execvpe(argv[0], argv, cfg["env"])
    except OSError as e:
        os.write(2, f"sandbox: cannot execute {argv[0]!r}: {e}\n".encode())
        os._exit(127 if e.errno == errno.ENOENT else 126)


def _init(cfg: dict, features: set[str], argv: list[str], status_fd: int) -> None:
    """PID 1 of the sandbox (with a PID namespace): start the program, reap orphans, report its status. The
    program never sees the host's processes: it does not run when /proc cannot be replaced (status 126)."""
    if "pid" in features:
        try:
            _fresh_proc()
        except OSError as e:
            os.write(2, f"sandbox: cannot hide the host's processes: {e}\n".encode())
            os.write(status_fd, str(126 << 8).encode())
            os._exit(0)
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        _exec_program(cfg, features, argv)
    while True:
        done, status = os.waitpid(-1, 0)
        if done == pid:
            os.write(status_fd, str(status).encode())
            os._exit(0)


def _children(parent: int) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                line = f.read()
        except OSError:
            continue
        if int(line[line.rindex(b")") + 2:].split()[1]) == parent:
            out.append(int(pid))
    return out


def _reap_all() -> None:
    """Kill and reap every child; orphans of the sandbox come to us (a subreaper) until none is left."""
    me = os.getpid()
    while True:
        kids = _children(me)
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            if os.waitpid(-1, 0 if kids else os.WNOHANG) == (0, 0):
                time.sleep(0.001)
        except ChildProcessError:
            return


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``, atomically, from a helper running as that uid."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _supervise(cfg: dict, argv: list[str]) -> None:
    """Isolate, start the init, relay its program's status; SIGTERM kills the whole sandbox."""
    _c(_libc.prctl(_SUBREAPER, 1, 0, 0, 0), "prctl")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    features = _isolate(cfg)
    if cfg["probe"]:
        print(json.dumps(sorted(features)))
        return
    read_fd, write_fd = os.pipe()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    init = os.fork()
    if init == 0:
        os.close(read_fd)
        _init(cfg, features, argv, write_fd)
    os.close(write_fd)
    alive = [True]
    signal.signal(signal.SIGTERM, lambda *_: alive[0] and os.kill(init, signal.SIGKILL))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.waitpid(init, 0)
    alive[0] = False
    status = os.read(read_fd, 64)
    _reap_all()
    if cfg["uid"] is not None and "pid" not in features:
        _kill_uid(cfg["uid"])
    code = os.waitstatus_to_exitcode(int(status)) if status else -signal.SIGKILL
    if code < 0:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    _supervise(json.loads(sys.argv[1]), sys.argv[2:])
