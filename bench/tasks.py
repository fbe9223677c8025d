"""What the peers' workers run. Imports nothing but ``os``, on purpose.

A ``spawn`` or ``forkserver`` worker of ProcessPoolExecutor imports the module of the function
it runs (and the main module, ``bench.__main__``, which keeps its own imports inside
``main()``). Keeping both light measures the peer's own cost, not the import of sandbx-pool.
"""

from __future__ import annotations

import os


def read_task(path: str) -> str:
    """The peers' task: read the file and return its content."""
    with open(path) as f:
        return f.read()


def read_fifo_task(path: str, pid_path: str) -> str:
    """Say who we are (atomically), then block reading a FIFO that never gets a writer."""
    temp = f"{pid_path}.tmp"
    with open(temp, "w") as f:
        f.write(str(os.getpid()))
    os.rename(temp, pid_path)
    with open(path) as f:
        return f.read()
