"""Reading processes from /proc: a leaf module, shared by the worker side and the coordinator.

It imports nothing of sandbx-pool, so the coordinator (which finds a quarantined worker's stuck
descendant with it) loads no worker machinery through it.
"""

from __future__ import annotations

import contextlib
import os


def children(pid: int | None = None) -> list[int]:
    """Pids of the children (every thread's) of process ``pid`` (None: this one), from /proc."""
    proc = f"/proc/{'self' if pid is None else pid}"
    pids: list[int] = []
    # Either may vanish as we read: a process or a thread that has exited has no children.
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for tid in os.listdir(f"{proc}/task"):
            with (
                contextlib.suppress(FileNotFoundError, ProcessLookupError),
                open(f"{proc}/task/{tid}/children") as f,
            ):
                pids.extend(int(p) for p in f.read().split())
    return pids
