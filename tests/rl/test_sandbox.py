"""Sandboxes (SPEC §8 AgentENV): runs, limits, escapes tried and contained, snapshot / fork / checkpoint."""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import subprocess
import sys
import tarfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deadline import finishes
from k3.rl import sandbox
from k3.rl.sandbox import Entry, Limits, Sandbox, Snapshot, isolation

ROOT = os.geteuid() == 0
SMALL = Limits(wall_seconds=3.0, cpu_seconds=3, memory_bytes=512 << 20, processes=16)


def processes_with(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != b"Z" and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def processes_of_uid(uid: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.fixture
def box():
    with Sandbox(SMALL) as b:
        yield b


def test_python_stdin_stdout_and_returncodes(box):
    r = box.run_python("import sys\nline = input()\nprint(line.upper())\nsys.exit(7)", stdin="hello\n")
    assert (r.returncode, r.stdout, r.timed_out, r.truncated) == (7, "HELLO\n", False, False)
    r = box.run_python("raise RuntimeError('boom')")
    assert r.returncode == 1 and "RuntimeError: boom" in r.stderr
    r = box.run_python("import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert r.returncode == -15


def test_large_stdin_is_fed_whether_or_not_it_is_read(box):
    data = "0123456789" * 100_000  # far beyond a pipe's buffer
    r = box.run_python("import sys; print(len(sys.stdin.read()))", stdin=data)
    assert (r.returncode, r.stdout) == (0, "1000000\n")
    r = box.run_python("print('ignored stdin')", stdin=data)
    assert (r.returncode, r.stdout, r.timed_out) == (0, "ignored stdin\n", False)


@pytest.mark.skipif(not ROOT and "pid" not in isolation(), reason="kill -1 would reach this user's processes")
def test_kill_everything_inside_reaches_nothing_outside(box):
    r = box.run(["sh", "-c", "kill -9 -1; echo survived"])
    assert (r.returncode, r.stdout) == (0, "survived\n")


def test_argv_runs_in_the_root_with_a_minimal_environment(box, monkeypatch):
    monkeypatch.setenv("K3_SANDBOX_SECRET", "do-not-leak")
    r = box.run(["sh", "-c", 'echo "$HOME|$TMPDIR|$(pwd)"; cat; env; exit 3'], stdin="from stdin\n")
    root = str(box.root)
    assert r.returncode == 3
    assert r.stdout.startswith(f"{root}|{root}|{root}\nfrom stdin\n")
    assert "K3_SANDBOX_SECRET" not in r.stdout
    r = box.run(["no-such-program-k3"])
    assert r.returncode == 127 and "no-such-program-k3" in r.stderr
    with pytest.raises(ValueError, match="argv"):
        box.run([])


def test_files_written_by_a_run_are_visible_and_vice_versa(box):
    box.write("in/put.txt", "41")
    r = box.run_python("n = int(open('in/put.txt').read())\nopen('out.txt', 'w').write(str(n + 1))")
    assert r.returncode == 0, r.stderr
    assert box.read("out.txt") == b"42"
    assert box.listdir() == ["in", "out.txt"]


@pytest.mark.skipif(not ROOT, reason="privileges are only dropped when the sandbox is started as root")
def test_runs_unprivileged_when_started_as_root(box):
    r = box.run(["sh", "-c", "id -u; grep CapEff /proc/self/status"])
    uid, caps = r.stdout.split("\n")[:2]
    assert uid != "0" and caps.split()[1] == "0000000000000000"
    assert os.stat(box.root).st_uid == int(uid)


def test_timeout_kills_an_infinite_loop_and_its_children(box):
    marker = f"k3mark{uuid.uuid4().hex}"
    child = f"import time; time.sleep(600)  # {marker}"
    src = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\nwhile True: pass"
    start = time.monotonic()
    r = box.run_python(src, timeout=1.0)
    assert r.timed_out and r.returncode is None
    assert time.monotonic() - start < 3.0
    assert processes_with(marker) == []


def test_no_process_survives_the_return_of_run(box):
    marker = "97.5" + str(os.getpid())  # sleep accepts fractional seconds: a unique command line
    script = f"sleep {marker} & (setsid sleep {marker} &) ; nohup sleep {marker} >/dev/null 2>&1 & echo started"
    r = box.run(["sh", "-c", script])
    assert (r.returncode, r.stdout) == (0, "started\n")
    assert processes_with(f"sleep {marker}") == []
    if ROOT:
        assert processes_of_uid(os.stat(box.root).st_uid) == []


def test_python_fork_bomb_is_contained(box):
    marker = f"k3mark{uuid.uuid4().hex}"
    src = (f"# {marker}\nimport os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
           "        break\n    if pid == 0:\n        time.sleep(600)\n        os._exit(0)\n    n += 1\nprint(n)")
    r = box.run_python(src)
    assert r.returncode == 0, r.stderr
    assert 1 <= int(r.stdout) < SMALL.processes
    assert processes_with(marker) == []


def test_shell_fork_bomb_is_contained():
    marker = f"k3mark{uuid.uuid4().hex}"
    with Sandbox(Limits(wall_seconds=1.5, processes=16)) as b:
        start = time.monotonic()
        r = b.run(["sh", "-c", f": {marker}; bomb() {{ bomb | bomb & }}; bomb; sleep 30"])
        assert (r.timed_out or r.returncode != 0) and time.monotonic() - start < 8.0
        assert "fork" in r.stderr.lower()  # the process limit was reached
    assert processes_with(marker) == []


def test_huge_output_is_truncated():
    with Sandbox(Limits(output_bytes=1000)) as b:
        r = b.run_python("import sys\nsys.stdout.write('x' * 5_000_000)\nsys.stderr.write('e' * 10)")
    assert (r.returncode, r.stdout, r.stderr, r.truncated) == (0, "x" * 1000, "e" * 10, True)


def test_memory_hog_fails():
    with Sandbox(Limits(memory_bytes=256 << 20)) as b:
        r = b.run_python("x = bytearray(1 << 30)\nprint('allocated')")
    assert r.returncode != 0 and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_file_and_disk_limits():
    with Sandbox(Limits(file_bytes=1 << 20, disk_bytes=3 << 20)) as b:
        r = b.run_python("open('big', 'wb').write(b'x' * (2 << 20))")
        assert r.returncode != 0 and "File too large" in r.stderr
        assert b.root.joinpath("big").stat().st_size <= 1 << 20
        r = b.run_python("for i in range(4):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))")
        assert r.returncode != 0 and "over disk_bytes" in r.stderr


def test_writing_outside_the_root_fails(box, tmp_path):
    tmp_path.chmod(0o777)  # would not stop a sandbox; only its own containment may
    targets = [box.root.parent / "escape", tmp_path / "escape", Path("/tmp") / f"k3-escape-{uuid.uuid4().hex}"]
    if "readonly" not in isolation():
        if not ROOT:
            pytest.skip("without a mount namespace a non-root sandbox writes wherever its user may")
        targets = targets[:1]  # a dropped uid still writes to world-writable /tmp without a read-only mount
    src = "import sys\nfor p in sys.stdin.read().split():\n    try:\n        open(p, 'w').write('x')\n" \
          "        print('wrote', p)\n    except OSError as e:\n        print('refused', p, e.errno)"
    r = box.run_python(src, stdin="\n".join(map(str, targets)))
    assert r.returncode == 0, r.stderr
    assert "wrote" not in r.stdout and r.stdout.count("refused") == len(targets)
    assert not any(p.exists() for p in targets)


def test_network_is_unreachable(box):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        r = box.run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')")
        assert r.returncode != 0 and "in" not in r.stdout
        assert "Network is unreachable" in r.stderr or "network access is disabled" in r.stderr
        with pytest.raises(BlockingIOError):
            server.accept()


def run_guarded(source: str) -> subprocess.CompletedProcess:
    """``source`` run here, unsandboxed, the way `run_python` starts it without a network namespace."""
    with sandbox._memory_file(source.encode()) as f:
        return subprocess.run(sandbox._python_argv(f.fileno(), guard=True), capture_output=True, text=True,
                              timeout=30, pass_fds=(f.fileno(),))


def test_the_fallback_network_guard_blocks_python_sockets():
    """Without a network namespace, Python code is guarded by an audit hook (run here unsandboxed)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        done = run_guarded(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')")
        assert done.returncode == 1 and "network access is disabled" in done.stderr
        with pytest.raises(BlockingIOError):
            server.accept()
    ok = run_guarded("import sys\nprint(sys.argv, __name__, sorted(k for k in globals() if k.startswith('_k3')))")
    assert ok.stdout == "['-c'] __main__ []\n"


def test_fallback_without_namespaces_still_contains_processes(monkeypatch):
    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", False)
    assert not {"pid", "net", "readonly"} & isolation()
    marker = "96.5" + str(os.getpid())
    with Sandbox(Limits(wall_seconds=1.5, processes=16)) as b:
        r = b.run(["sh", "-c", f"(setsid sleep {marker} &); sleep {marker} & echo ok"])
        assert r.stdout == "ok\n"
        assert processes_with(f"sleep {marker}") == []
        start = time.monotonic()
        r = b.run(["sh", "-c", f": {marker}; bomb() {{ bomb | bomb & }}; bomb; sleep 30"])
        assert (r.timed_out or r.returncode != 0) and time.monotonic() - start < 8.0
        assert "fork" in r.stderr.lower()  # the process limit was reached
    assert processes_with(marker) == []


# ---------------------------------------------------------------------- escapes through /proc and the temp dir
#: Reads, for the secret given on stdin, every command line, environment, open regular file and working directory
#: listed in /proc, and every file in other sandboxes' roots; prints ``LEAK <where>`` for each place it shows.
SNOOP = r"""import glob, os, stat, sys
secret = sys.stdin.read().strip().encode()

def read(path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        return os.read(fd, 1 << 20) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return b""
    finally:
        os.close(fd)

def listing(path):
    try:
        return [os.path.join(path, name) for name in os.listdir(path)]
    except OSError:
        return []

pids = [p for p in os.listdir("/proc") if p.isdigit()]
places = [f"/proc/{pid}/{name}" for pid in pids for name in ("cmdline", "environ")]
places += [p for pid in pids for p in listing(f"/proc/{pid}/fd") + listing(f"/proc/{pid}/cwd")]
places += glob.glob(os.path.join(os.path.dirname(os.path.dirname(os.getcwd())), "*", "root", "*"))
places += ["/proc/1/environ", f"/proc/{os.getppid()}/environ"]
for path in places:
    if secret in read(path):
        print("LEAK", path)
if secret in repr(dict(os.environ)).encode():
    print("LEAK os.environ")
print("looked at", len(places), "places")
"""
#: A sandboxed program holding a secret in its source until a ``stop`` file appears in its root.
HOLDER = """import os, time
SECRET = {secret!r}
open("ready", "w").close()
while not os.path.exists("stop"):
    time.sleep(0.02)
"""


def contained(namespaces: bool, monkeypatch) -> None:
    """Run a test with namespaces or with the fallback containment (which keeps secrets only as root)."""
    if not namespaces:
        monkeypatch.setattr(sandbox, "_USE_NAMESPACES", False)
        if not ROOT:
            pytest.skip("without namespaces a non-root sandbox runs as the calling user and reads what it may")
        interpreter = Path(os.path.realpath(sys.executable))
        if any(not d.stat().st_mode & stat.S_IXOTH for d in interpreter.parents):
            pytest.skip(f"without a mount namespace a dropped uid cannot reach {interpreter}")
    elif "pid" not in isolation():
        pytest.skip("this host grants no PID namespace")


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "fallback"])
def test_a_sandbox_cannot_read_a_concurrent_sandboxs_source(namespaces, monkeypatch):
    contained(namespaces, monkeypatch)
    secret = f"k3secret{uuid.uuid4().hex}"
    with Sandbox(Limits(wall_seconds=60)) as holder, Sandbox(SMALL) as snoop, ThreadPoolExecutor(1) as pool:
        holder.write("notes.py", f"# {secret}\n")  # a file of its root too
        held = pool.submit(holder.run_python, HOLDER.format(secret=secret))
        deadline = time.monotonic() + 30
        while not (holder.root / "ready").exists():
            assert not held.done() and time.monotonic() < deadline, held.result() if held.done() else "not ready"
            time.sleep(0.01)
        try:
            r = snoop.run_python(SNOOP, stdin=secret)
        finally:
            holder.write("stop", "")
        assert held.result().returncode == 0, held.result().stderr
    assert r.returncode == 0 and "looked at" in r.stdout, r.stderr
    assert "LEAK" not in r.stdout, r.stdout


#: The PIDs in /proc, the program's own, and whether a command line there holds the marker given on stdin.
LIST_PROCESSES = """import json, os, sys
marker = sys.stdin.read().encode()
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
seen = [open(f"/proc/{p}/cmdline", "rb").read() for p in pids]
print(json.dumps({"pids": pids, "me": os.getpid(), "marker": any(marker in c for c in seen)}))
"""


@pytest.mark.skipif("pid" not in isolation(), reason="without a PID namespace /proc lists the host's processes")
def test_a_sandbox_lists_only_its_own_processes(box):
    marker = f"k3mark{uuid.uuid4().hex}"
    host = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(60)  # {marker}"])
    try:
        r = box.run_python(LIST_PROCESSES, stdin=marker)
    finally:
        host.kill()
        host.wait()
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert not seen["marker"], seen
    assert set(seen["pids"]) <= {1, seen["me"]}, seen  # the sandbox's init and the program, or nothing at all


#: Starts a sandbox from a host process holding the secret in its environment and, where a PID namespace hides the
#: host's command lines, on its command line too (as an ``--api-key`` flag puts it), as a trainer's would.
PARENT = """import json, os, sys
from k3.rl import sandbox
sandbox._USE_NAMESPACES = sys.argv[1] == "namespaces"
with sandbox.Sandbox() as box:
    r = box.run_python(sys.argv[2], stdin=os.environ["K3_SANDBOX_SECRET"])
print(json.dumps([r.returncode, r.stdout, r.stderr]))
"""


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "fallback"])
def test_the_host_environment_and_command_lines_do_not_leak(namespaces, monkeypatch):
    contained(namespaces, monkeypatch)
    secret = f"k3secret{uuid.uuid4().hex}"
    env = {**os.environ, "K3_SANDBOX_SECRET": secret, "PYTHONPATH": os.pathsep.join(sys.path)}
    flags = [f"--api-key={secret}"] if namespaces else []  # without one, /proc shows command lines (docstring)
    done = subprocess.run([sys.executable, "-c", PARENT, "namespaces" if namespaces else "fallback", SNOOP, *flags],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    code, out, err = json.loads(done.stdout)
    assert code == 0 and "looked at" in out, err
    assert "LEAK" not in out, out


def test_snapshot_restore_gives_back_exactly_the_old_files(box):
    box.write("a.txt", "alpha")
    box.write("dir/sub/b.bin", bytes(range(256)))
    (box.root / "dir" / "sub" / "b.bin").chmod(0o640)
    os.symlink("dir/sub/b.bin", box.root / "link")
    snap = box.snapshot()
    r = box.run(["sh", "-c", "echo changed > a.txt; rm -r dir; mkdir new; echo n > new/f; rm link; ln -s /etc x"])
    assert r.returncode == 0, r.stderr
    assert box.listdir() == ["a.txt", "new", "x"]
    box.restore(snap)
    assert box.listdir() == ["a.txt", "dir", "link"]
    assert box.read("a.txt") == b"alpha" and box.read("link") == bytes(range(256))
    assert (box.root / "dir" / "sub" / "b.bin").stat().st_mode & 0o777 == 0o640
    assert os.readlink(box.root / "link") == "dir/sub/b.bin"
    assert box.snapshot() == snap
    assert [(e.path, e.kind) for e in snap.entries] == [
        ("a.txt", "file"), ("dir", "dir"), ("dir/sub", "dir"), ("dir/sub/b.bin", "file"), ("link", "link")]


def test_snapshot_keeps_a_symlink_out_of_the_root_as_a_link(box):
    r = box.run(["ln", "-s", "/etc/passwd", "leak"])
    assert r.returncode == 0, r.stderr
    (entry,) = box.snapshot().entries
    assert (entry.kind, entry.target, entry.data) == ("link", "/etc/passwd", b"")


def test_fork_is_independent_both_ways(box):
    box.write("shared.txt", "v1")
    with box.fork() as child:
        assert child.root != box.root and child.read("shared.txt") == b"v1"
        r = child.run_python("open('shared.txt', 'w').write('child'); open('only_child', 'w').write('c')")
        assert r.returncode == 0, r.stderr
        box.write("only_parent", "p")
        assert box.read("shared.txt") == b"v1" and box.listdir() == ["only_parent", "shared.txt"]
        assert child.read("shared.txt") == b"child" and child.listdir() == ["only_child", "shared.txt"]


def test_checkpoint_resume_round_trip(box, tmp_path):
    box.write("d/x.py", "print(6 * 7)\n")
    os.symlink("d/x.py", box.root / "main.py")
    path = box.checkpoint(tmp_path / "ckpt.tar")
    assert path == tmp_path / "ckpt.tar" and os.listdir(tmp_path) == ["ckpt.tar"]
    with Sandbox.resume(path) as back:
        assert back.limits == SMALL and back.snapshot() == box.snapshot()
        assert back.run([sys.executable, "-I", "main.py"]).stdout == "42\n"
    with Sandbox.resume(path, Limits(wall_seconds=1.0)) as other:
        assert other.limits == Limits(wall_seconds=1.0)


def test_resume_reads_only_a_regular_file(tmp_path):
    """``Sandbox.resume`` of a FIFO blocked for ever and of ``/dev/zero`` read until memory ran out."""
    fifo = tmp_path / "fifo.tar"
    os.mkfifo(fifo)
    (tmp_path / "zero.tar").symlink_to("/dev/zero")
    for path, kind in ((fifo, "a FIFO"), (tmp_path / "zero.tar", "a character device")):
        with pytest.raises(ValueError, match=f"{kind}, not a regular file"):
            finishes(lambda path=path: Sandbox.resume(path), seconds=10)


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory) -> bytes:
    with Sandbox() as b:
        b.write("f.txt", "some content")
        b.write("d/g.bin", b"\x00\x01\x02")
        return b.checkpoint(tmp_path_factory.mktemp("ckpt") / "c.tar").read_bytes()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_flipped_byte_is_rejected(checkpoint_bytes, tmp_path_factory, data):
    i = data.draw(st.integers(0, len(checkpoint_bytes) - 1))
    bad = bytearray(checkpoint_bytes)
    bad[i] ^= data.draw(st.integers(1, 255))
    path = tmp_path_factory.mktemp("bad") / "c.tar"
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="corrupt or tampered"):
        Sandbox.resume(path)


def test_truncated_and_tampered_checkpoints_are_rejected(checkpoint_bytes, tmp_path):
    path = tmp_path / "c.tar"
    for cut in (0, 100, 512, len(checkpoint_bytes) // 2, len(checkpoint_bytes) - 1):
        path.write_bytes(checkpoint_bytes[:cut])
        with pytest.raises(ValueError, match="corrupt or tampered"):
            Sandbox.resume(path)
    members = {}
    with tarfile.open(fileobj=io.BytesIO(checkpoint_bytes)) as tf:
        for m in tf.getmembers():
            members[m.name] = tf.extractfile(m).read()
    manifest = json.loads(members["MANIFEST.json"])
    manifest["entries"][0]["mode"] = 0o777  # a "harmless" edit of the manifest only
    for edit in ({"root/f.txt": b"other content"}, {"MANIFEST.json": json.dumps(manifest).encode()}):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for name, blob in {**members, **edit}.items():
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tf.addfile(info, io.BytesIO(blob))
        path.write_bytes(buf.getvalue())
        with pytest.raises(ValueError, match="corrupt or tampered"):
            Sandbox.resume(path)


def test_paths_that_leave_the_root_are_refused(box):
    box.run(["sh", "-c", "ln -s /etc out; ln -s .. up; mkdir d; ln -s ../d/f d/in"])
    box.write("d/in", "via an inner link")
    assert box.read("d/f") == b"via an inner link" and box.read("d/../d/in") == b"via an inner link"
    for path in ("../x", "d/../../x", "/etc/passwd", str(box.root / "d" / "f"), "out/passwd", "up/x", "up"):
        with pytest.raises(ValueError):
            box.read(path)
        with pytest.raises(ValueError):
            box.write(path, "x")
    with pytest.raises(ValueError):
        box.listdir("out")
    assert not (box.root.parent / "x").exists()


def test_closed_sandbox_is_gone(tmp_path):
    b = Sandbox()
    root = b.root
    b.write("f", "x")
    b.close()
    assert not root.parent.exists()
    for call in (lambda: b.read("f"), lambda: b.run(["true"]), b.snapshot, lambda: b.checkpoint(tmp_path / "c")):
        with pytest.raises(ValueError, match="closed"):
            call()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="processes"):
        Limits(processes=0)
    with pytest.raises(ValueError, match="cpu_seconds"):
        Limits(cpu_seconds=1.5)
    with pytest.raises(ValueError, match="normalised"):
        Entry("a/../b", "file")
    with pytest.raises(ValueError, match="symlink"):
        Entry("a", "link")
    with pytest.raises(ValueError, match="directory"):
        Snapshot((Entry("a/b", "file"),))
    with pytest.raises(ValueError, match="duplicate"):
        Snapshot((Entry("a", "file"), Entry("a", "file")))
    with Sandbox() as b:
        with pytest.raises(ValueError, match="timeout"):
            b.run(["true"], timeout=0)
        with pytest.raises(TypeError, match="source"):
            b.run_python(b"print(1)")


def test_a_source_longer_than_a_command_line_argument_runs(box):
    r = box.run_python("x = 0\n" + "x += 1\n" * 40_000 + "print(x)")  # 280 KB: more than one argv string holds
    assert (r.returncode, r.stdout) == (0, "40000\n"), r.stderr
