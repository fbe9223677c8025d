"""The peers sandbx-pool is measured against, each doing the same read of the same file.

Each peer is a context manager with a blocking ``call()`` that reads the 1 KiB file in a
worker and checks what came back. They are measured from plain synchronous code (no event
loop around them), which is how they are normally used.

Start methods, stated because they decide the figures:

* pebble gets the ``fork`` context explicitly (Linux's default before Python 3.14 anyway).
* ``ProcessPoolExecutor(max_tasks_per_child=1)`` refuses ``fork`` (ValueError: "max_
  tasks_per_child is incompatible with the 'fork' multiprocessing start method") and picks
  ``spawn`` when given no context; that default is the main row. ``forkserver`` is its fastest
  legal option and gets a row of its own. Their workers import only ``bench.tasks`` and a
  ``bench.__main__`` that defers its imports, so the figures are the peer's own cost; an
  application whose main module imports more pays for that in every worker.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import subprocess
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from types import TracebackType
from typing import Any, Protocol

import pebble

from bench.tasks import read_task
from bench.workspace import DATA_BYTES


def wait_for_pid_file(pid_path: str, timeout_s: float = 10.0) -> int:
    """The pid a ``read_fifo_task`` wrote. Polls: the writer is another process, not an event."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(pid_path) as f:
                return int(f.read())
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no pid in {pid_path} after {timeout_s} s") from None
            time.sleep(0.0005)


def wait_gone(pidfd: int, timeout_s: float) -> bool:
    """Block until the process behind ``pidfd`` has exited (the pidfd turns readable)."""
    return bool(select.select([pidfd], [], [], timeout_s)[0])


def _check(content: str) -> None:
    if len(content) != DATA_BYTES:
        raise RuntimeError(f"read returned {len(content)} characters, not {DATA_BYTES}")


class Peer(Protocol):
    name: str
    workers: int | None

    def call(self) -> None: ...

    def __enter__(self) -> Peer: ...

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class _Executor:
    """A pool of either flavour: ``submit`` returns a concurrent.futures-style future."""

    name = "?"
    workers: int | None = None

    def __init__(self, path: str) -> None:
        self.path = path

    def submit(self) -> Future[Any]:
        raise NotImplementedError

    def call(self) -> None:
        _check(self.submit().result())

    def __enter__(self) -> _Executor:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        raise NotImplementedError


class PebblePool(_Executor):
    """``pebble.ProcessPool``: disposable with ``max_tasks=1``, warm with ``max_tasks=0``."""

    def __init__(self, path: str, *, workers: int, disposable: bool) -> None:
        super().__init__(path)
        self.workers = self.size = workers
        self.disposable = disposable
        kind = "disposable, max_tasks=1" if disposable else "warm, non-disposable reference"
        self.name = f"pebble ProcessPool ({kind})"
        self.pool: Any = None

    def __enter__(self) -> PebblePool:
        self.pool = pebble.ProcessPool(
            max_workers=self.size,
            max_tasks=1 if self.disposable else 0,
            context=multiprocessing.get_context("fork"),
        )
        return self

    def submit(self) -> Future[Any]:
        future: Future[Any] = self.pool.schedule(read_task, args=(self.path,))
        return future

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.pool.close()
        self.pool.join()


class ProcessPoolDisposable(_Executor):
    """``ProcessPoolExecutor(max_tasks_per_child=1)``; ``method=None`` is the default (spawn)."""

    def __init__(self, path: str, *, workers: int, method: str | None = None) -> None:
        super().__init__(path)
        self.workers = self.size = workers
        self.method = method
        self.name = f"ProcessPoolExecutor (max_tasks_per_child=1, {method or 'spawn, default'})"
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> ProcessPoolDisposable:
        context = multiprocessing.get_context(self.method) if self.method else None
        self.pool = ProcessPoolExecutor(self.size, mp_context=context, max_tasks_per_child=1)
        return self

    def submit(self) -> Future[Any]:
        assert self.pool is not None
        return self.pool.submit(read_task, self.path)

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self.pool is not None
        self.pool.shutdown(wait=True, cancel_futures=True)


class BareFork:
    """The floor: ``os.fork()``, the child reads the file and ``os._exit``s, ``waitpid``."""

    name = "bare os.fork() + read + os._exit + waitpid, from the bench process"
    workers: int | None = None

    def __init__(self, path: str) -> None:
        self.path = path

    def call(self) -> None:
        pid = os.fork()
        if pid == 0:  # the child must never return into the caller's code
            code = 1
            try:
                with open(self.path, "rb") as f:
                    code = 0 if len(f.read()) == DATA_BYTES else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError("the forked child could not read the file")

    def __enter__(self) -> BareFork:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


def fork_floor_elsewhere(
    path: str, count: int, *, preload: bool, bare_fork: bool = False
) -> list[int]:
    """Durations (ns) of the same floor, measured in a fresh interpreter (see bench.forkfloor)."""
    command = [sys.executable, "-m", "bench.forkfloor", str(count), path]
    command += ["--preload"] * preload + ["--bare-fork"] * bare_fork
    done = subprocess.run(
        command,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # where bench/ lives
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    values: list[int] = json.loads(done.stdout)
    return values
