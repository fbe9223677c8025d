"""The fork floor measured in a fresh interpreter, small or loaded like the worker template.

``python -m bench.forkfloor COUNT PATH [--preload] [--bare-fork]`` times COUNT rounds of
``os.fork()``, a read of the file in the child, ``os._exit`` and ``waitpid``, and prints the
durations (ns) as JSON. ``--bare-fork`` forks as the template does (``workers.bare_fork``:
libc's fork, without the after-fork hooks ``os.fork()`` runs in the child).
A fork copies the page tables of the whole process, and the child's exit tears them down, so
the floor grows with the forking process: measured from a bare interpreter it is the design
card's "small process" figure; with ``--preload`` (what workers.template imports before it
forks) it is the least a worker of this template can cost.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable


def _round(path: str, fork: Callable[[], int]) -> int:
    start = time.perf_counter_ns()
    pid = fork()
    if pid == 0:  # the child must never return into the caller's code
        code = 1
        try:
            with open(path, "rb") as f:
                code = 0 if f.read() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("the forked child could not read the file")
    return time.perf_counter_ns() - start


def main(argv: list[str]) -> int:
    count, path = int(argv[0]), argv[1]
    if "--preload" in argv:
        import sandbx_pool.workers.template  # noqa: F401 (loaded for its weight: the template's imports)
    fork = os.fork
    if "--bare-fork" in argv:
        from sandbx_pool.workers import bare_fork

        fork = bare_fork.fork
    for _ in range(max(5, count // 10)):
        _round(path, fork)
    json.dump([_round(path, fork) for _ in range(count)], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
