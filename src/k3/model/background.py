"""Compilation beside the steps (issue 37): a thread that builds graphs while the steps it will serve run eagerly.

Dynamo's tracing and inductor's lowering are Python. A thread doing them holds the interpreter lock for up to the
switch interval (5 ms) at a time, and each of an eager step's ~2,000 operators must take the lock back when it
returns: measured on 2 cores, an eager decode step of ``small`` went from 12 ms to 0.2–0.75 s while a graph
compiled on a thread beside it. Letting it run only between steps is not enough either: each hand-over of the lock
costs the next step up to a switch interval, and steps in a row left so little time that a 45-s compilation made no
progress in 48 s of decoding, which ran 1.6× slower. `Gate` keeps the compiling thread out of the way: a trace
function (`sys.settrace`, on that thread only) parks it at its next Python call unless no step (`Gate.busy`) has run
for `QUIET` seconds, so it compiles while the server is idle (between a chat's turns, say) and a busy server keeps
its eager speed. Imports are never parked (an import holds a module lock a step may need), and `Gate.close` parks
the thread for good (a process exits without waiting for it).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["Gate"]

SWITCH_INTERVAL = 2e-4  # seconds: how soon a step takes the interpreter back from the compiling thread
QUIET = 0.05  # seconds without a step before the compiling thread runs


class Gate:
    """Runs one function on a background thread whose Python waits while a step is `busy`."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self._busy = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._last = 0.0  # time.monotonic() when the last step ended
        self._previous: float | None = None  # the switch interval to restore while the thread has it shortened
        self.closed = False

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Within (on any thread, nested or not), and `QUIET` seconds after: the background thread does not run
        Python."""
        with self._lock:
            self._busy += 1
            self._idle.clear()
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._last = time.monotonic()
                if not self._busy and not self.closed:
                    self._idle.set()

    def start(self, target: Callable[[], None], name: str) -> threading.Thread:
        """``target()`` on a daemon thread under the gate; the switch interval is shortened while it runs (a step
        waits that long for the interpreter at most) and restored when it ends or the gate is closed."""
        def run() -> None:
            with self._lock:
                if not self.closed:
                    self._previous = sys.getswitchinterval()
                    sys.setswitchinterval(min(self._previous, SWITCH_INTERVAL))
            self._local.on, self._local.imports = True, 0
            sys.settrace(self._call)
            try:
                target()
            finally:
                sys.settrace(None)
                self._restore()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    def on_thread(self) -> bool:
        """Whether the caller is the gated background thread."""
        return getattr(self._local, "on", False)

    def close(self) -> None:
        """Park the background thread for good at its next Python call (it is a daemon: the process can exit)."""
        with self._lock:
            self.closed = True
            self._idle.clear()
        self._restore()

    def _restore(self) -> None:
        """Give the process its switch interval back (once), the background thread parked or done."""
        with self._lock:
            if self._previous is not None:
                sys.setswitchinterval(self._previous)
                self._previous = None

    def _call(self, frame: FrameType, event: str, arg: object) -> Callable | None:
        """The thread's trace function, at every Python call: wait for the steps, unless inside an import."""
        code = frame.f_code
        if code.co_name == "_find_and_load" and code.co_filename.startswith("<frozen importlib"):
            self._local.imports += 1
            return self._in_import
        while not self._local.imports:
            self._idle.wait()
            wait = self._last + QUIET - time.monotonic()
            if wait <= 0 and self._idle.is_set():
                break
            time.sleep(max(wait, 0.0))
        return None

    def _in_import(self, frame: FrameType, event: str, arg: object) -> Callable | None:
        """The local trace of an import's ``_find_and_load``: its return (an exception's too) ends the import."""
        if event == "return":
            self._local.imports -= 1
        return self._in_import
