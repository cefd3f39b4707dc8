"""How many threads or local processes this machine takes at most (no torch: the CLI's flag types use it).

``--threads`` on every command, ``k3 serve --replicas`` and ``k3 train --nproc`` (without accelerators) take at most
`PER_CORE` per CPU core: each process holds its own Python and torch, and ``--nproc 1000`` exhausted a 24-GiB,
2-core machine; ``--threads 100000`` crashed torch.
"""

from __future__ import annotations

import os

__all__ = ["MOST_PER_MACHINE", "PER_CORE"]

PER_CORE = 4
MOST_PER_MACHINE = PER_CORE * (os.cpu_count() or 1)
