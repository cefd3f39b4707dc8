"""`finishes`: run a call that must not hang, in a daemon thread, so that a hang fails the test instead of blocking
the run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def finishes(fn: Callable[[], Any], seconds: float = 30.0) -> Any:
    """``fn()``'s result (or its exception, raised here); a test failure if it has not returned within ``seconds``
    (the thread, a daemon, is left behind)."""
    outcome: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            outcome.append(("value", fn()))
        except BaseException as err:  # noqa: BLE001 - handed back to the caller
            outcome.append(("error", err))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still running after {seconds} s: a hang"
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value
