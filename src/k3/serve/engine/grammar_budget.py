"""Compiling a JSON schema's grammar under a time and memory budget (issue 35): a child process tries it first.

llguidance's own limits do not bound every compile (a schema with thousands of optional properties compiles in
quadratic time: 8,000 took 6.7 s; a 4,000-branch ``anyOf`` holds 35 MB), a compile in a thread cannot be
stopped, and a grammar whose lexer explodes (nested counted repetition in a ``pattern``) only fails at a later
token mask. So `CompileBudget.check` first hands the schema to a child process that holds nothing else. It
compiles with the server's options and limits, computes the first token mask, and takes a short walk through the
grammar (random allowed tokens, staying inside strings while it can, where patterns explode); it reports the
bytes the compiled grammar holds (glibc's ``mallinfo2``: nothing else allocates there) or the error. Past
``seconds`` the child is killed and a fresh one started for the next schema; it runs under an address-space
limit, so a schema that needs more memory than the budget kills only it. The server compiles a schema that
passed again itself, where it costs what it cost here.

The child is this file run as a script (``python -P``): it imports llguidance, numpy and the standard library only.
Messages are length-prefixed JSON over its stdin and stdout.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import IO, Any

import numpy as np

__all__ = ["CompileBudget"]

_HEADER = struct.Struct(">I")
#: Steps of the probing walk after the first mask (each bounded by llguidance's ``step_lexer_fuel``).
WALK_STEPS = 32
#: Address space the child may use beyond its size once ready, on top of the grammar budget (masks, Python).
_SLACK = 256 * 2**20
#: Seconds a child may take to start and read the vocabulary.
_START_SECONDS = 120.0
#: How an error reads, by where the child met it.
_STAGES = {"compile": "invalid or unsupported JSON schema: {error}",
           "mask": "no JSON value can be generated for this schema ({error})",
           "walk": "too complex: its grammar exceeded the grammar engine's limits within {steps} tokens of a trial "
                   "generation ({error})"}


class CompileBudget:
    """Checks schemas in a child process over one vocabulary (``tokens[i]``: the bytes of id ``i``, ``b""`` for
    special ids) with llguidance ``options`` (compile overrides) and ``limits`` (`LLParserLimits` fields)."""

    def __init__(self, tokens: list[bytes], eos: int, options: dict, limits: dict, seconds: float,
                 max_bytes: int) -> None:
        self.seconds, self.max_bytes = seconds, max_bytes
        self._init = json.dumps({"tokens": [t.hex() for t in tokens], "eos": eos, "options": options,
                                 "limits": limits, "max_bytes": max_bytes, "walk": WALK_STEPS}).encode()
        self._lock = threading.Lock()
        self._child: list[subprocess.Popen] = []  # the running child, if any (a list: the finalizer's view)
        self._finalizer = weakref.finalize(self, _stop, self._child)

    def check(self, schema: str) -> int:
        """The bytes ``schema``'s compiled grammar holds. ``ValueError`` naming the problem if it is invalid, fails
        its first masks, or exceeds the budget; ``RuntimeError`` if no child process can be started."""
        with self._lock:
            if self._child and self._child[0].poll() is not None:  # died since (the system's OOM killer, say)
                _stop(self._child)
            child = self._child[0] if self._child else self._start()
            try:
                _write(child.stdin, json.dumps({"schema": schema}).encode())
                reply = _read(child.stdout, time.monotonic() + self.seconds)
            except TimeoutError:
                _stop(self._child)
                raise ValueError(f"too complex: its grammar did not compile within the budget of "
                                 f"{self.seconds:g} s") from None
            except (EOFError, OSError):
                _stop(self._child)
                raise ValueError(f"too complex: compiling its grammar took more than the budget of "
                                 f"{self.max_bytes / 2**20:g} MiB of memory") from None
        if reply["error"]:
            raise ValueError(_STAGES[reply["stage"]].format(error=reply["error"], steps=WALK_STEPS))
        if reply["bytes"] > self.max_bytes:
            raise ValueError(f"too complex: its compiled grammar needs {reply['bytes'] / 2**20:.0f} MiB, more than "
                             f"the budget of {self.max_bytes / 2**20:g} MiB")
        return int(reply["bytes"])

    def close(self) -> None:
        """Stop the child process (a later `check` starts another)."""
        with self._lock:
            _stop(self._child)

    def _start(self) -> subprocess.Popen:
        child = subprocess.Popen([sys.executable, "-P", __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, env={**os.environ, "OPENBLAS_NUM_THREADS": "1",
                                                                 "OMP_NUM_THREADS": "1"})
        self._child.append(child)
        try:
            _write(child.stdin, self._init)
            _read(child.stdout, time.monotonic() + _START_SECONDS)
        except (TimeoutError, EOFError, OSError) as exc:
            _stop(self._child)
            raise RuntimeError(f"structured output: the grammar compiler process did not start ({exc!r})") from exc
        return child


def _stop(children: list[subprocess.Popen]) -> None:
    while children:
        child = children.pop()
        child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout):
            stream.close()


def _write(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def _read(stream: IO[bytes], deadline: float | None = None) -> Any:
    """The next message; ``EOFError`` when the stream ends, ``TimeoutError`` past ``deadline``."""
    size = _HEADER.unpack(_exactly(stream, _HEADER.size, deadline))[0]
    return json.loads(_exactly(stream, size, deadline))


def _exactly(stream: IO[bytes], n: int, deadline: float | None) -> bytes:
    fd, out = stream.fileno(), bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


# ---------------------------------------------------------------------------------------------- the child
class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _allocated() -> int:
    """Bytes allocated by malloc now (glibc's ``mallinfo2``), else the resident set size."""
    try:
        info = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return _statm(1)
    info.restype = _Mallinfo2
    m = info()
    return m.uordblks + m.hblkhd


def _statm(field: int) -> int:
    """Field ``field`` of ``/proc/self/statm`` (0: size, 1: resident) in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[field]) * os.sysconf("SC_PAGE_SIZE")


class _Greedy:
    """The tokenizer callback llguidance wants: greedy tokenization over the vocabulary (text only)."""

    def __init__(self, tokens: list[bytes], eos: int) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids: list[int] = []
        self.engine: Any = None

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        return self.engine.greedy_tokenize(text)


def _walk(matcher: Any, tokens: list[bytes], eos: int, steps: int) -> None:
    """Random allowed tokens (seeded), preferring ones with neither ``"`` nor only whitespace, then any but
    whitespace: into strings (where patterns explode) and on through the structure, never idling in its gaps."""
    rng = np.random.default_rng(0)
    quote = np.array([b'"' in t for t in tokens])
    blank = np.array([not t.strip() for t in tokens])
    for _ in range(steps):
        mask = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        if matcher.is_error() or matcher.is_stopped():
            return
        allowed = np.unpackbits(mask, count=len(tokens), bitorder="little").astype(bool)
        allowed[eos] = False
        choices = next((np.flatnonzero(c) for c in (allowed & ~quote & ~blank, allowed & ~blank, allowed) if c.any()),
                       None)
        if choices is None:
            return
        matcher.consume_token(int(rng.choice(choices)))


def _try(llguidance: Any, greedy: _Greedy, limits: Any, init: dict, schema: str) -> dict:
    """Compile, first mask, walk: the first error and the stage it came in, and the compiled grammar's bytes."""
    before, stage = _allocated(), "compile"
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=init["options"])
        matcher = llguidance.LLMatcher(greedy.engine, grammar, log_level=0, limits=limits)
        if not matcher.is_error():
            stage = "mask"
            matcher.compute_bitmask()
        used = _allocated() - before
        if not matcher.is_error():
            stage = "walk"
            _walk(matcher, greedy.tokens, init["eos"], init["walk"])
        error = matcher.get_error()
    except ValueError as exc:
        return {"error": str(exc), "stage": stage, "bytes": 0}
    except MemoryError:
        return {"error": "", "stage": stage, "bytes": init["max_bytes"] + 1}
    return {"error": error.removesuffix("\n<non-verbose/>"), "stage": stage, "bytes": used}


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    import resource

    import llguidance

    init = _read(stdin)
    greedy = _Greedy([bytes.fromhex(t) for t in init["tokens"]], init["eos"])
    greedy.engine = llguidance.LLTokenizer(llguidance.TokenizerWrapper(greedy), n_vocab=len(greedy.tokens))
    limits = llguidance.LLParserLimits(**init["limits"])
    resource.setrlimit(resource.RLIMIT_AS, (_statm(0) + init["max_bytes"] + _SLACK, resource.RLIM_INFINITY))
    _write(stdout, b'{"ready": true}')
    while True:
        try:
            schema = _read(stdin)["schema"]
        except EOFError:
            return
        _write(stdout, json.dumps(_try(llguidance, greedy, limits, init, schema)).encode())


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
