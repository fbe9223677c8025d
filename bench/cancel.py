"""Section 2: from ``CancelToken.cancel()`` to the outcome in the caller's hands.

Three sandbx-pool cases, labelled by how the kill goes:

* ``read`` blocked on a FIFO: a file tool, SIGKILL to the worker's group at once;
* bash ``sleep 1000`` with the default grace: SIGTERM to the group first (SIGKILL after
  ``calls.grace_s`` = 1 s if it were ignored; ``sleep`` dies on SIGTERM);
* bash ``sleep 1000`` with ``calls.grace_s = 0``: SIGKILL at once.

Before each cancel the call is left to settle (``SETTLE_S``) so that the worker has taken it
and is blocked: nothing outside the worker can observe that moment, and the settle time is not
part of what is measured. The outcome returns only once the worker's group is gone.

The peer is pebble's disposable pool with its task blocked on the same FIFO. Its
``future.cancel()`` returns at once, but the worker goes on holding the FIFO until pebble's
manager loop gets round to killing it, so the comparable figure is cancel() to the worker's
exit, observed through a pidfd. ``ProcessPoolExecutor`` cannot cancel a running task at all:
its ``cancel()`` returns False and the task runs on; that is checked once, live.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import multiprocessing
import os
import time
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field

import pebble
from loguru import logger

from bench.latency import CALL_TIMEOUT_S
from bench.peers import wait_for_pid_file, wait_gone
from bench.procs import Leftovers, leftovers
from bench.stats import Budget, Samples
from bench.tasks import read_fifo_task
from bench.workspace import MARKER, BenchWorkspace
from sandbx_pool import CancelToken, Pool

#: How long a call is left to reach its blocking point before it is cancelled.
SETTLE_S = {"read": 0.01, "bash": 0.03}
WARMUP = 5

READ_FIFO = "read-fifo"
BASH_TERM = "bash-term"
BASH_KILL = "bash-kill"
PEBBLE = "pebble"


@dataclass(frozen=True)
class CancelRow:
    key: str
    name: str
    kill: str
    samples: Samples
    statuses: Counter[str] = field(default_factory=Counter)
    #: pebble only: how long cancel() itself took (the future is then done, the worker not).
    returned: Samples | None = None


@dataclass(frozen=True)
class CancelResult:
    rows: list[CancelRow]
    left_pool_open: Leftovers
    left_after_close: Leftovers
    ppe_cancel_returned: bool | None

    def row(self, key: str) -> CancelRow | None:
        return next((row for row in self.rows if row.key == key), None)


async def _cancel_many(
    pool: Pool, tool: str, args: dict[str, str], count: int
) -> tuple[Samples, Counter[str]]:
    samples: Samples = Samples()
    statuses: Counter[str] = Counter()
    for i in range(WARMUP + count):
        token = CancelToken()
        task = asyncio.create_task(pool.call(tool, args, cancel=token))
        await asyncio.sleep(SETTLE_S[tool])
        start = time.perf_counter_ns()
        token.cancel("bench")
        async with asyncio.timeout(CALL_TIMEOUT_S):  # a broken pool fails the section
            outcome = await task
        elapsed = time.perf_counter_ns() - start
        if i < WARMUP:
            continue
        statuses[f"{outcome.status}{'' if outcome.started else ' (not started)'}"] += 1
        if outcome.status == "cancelled" and outcome.started:
            samples.add(elapsed)
    return samples, statuses


async def _sandbx(ws: BenchWorkspace, count: int) -> tuple[list[CancelRow], Leftovers]:
    fifo = {"path": ws.fifo.name}
    sleep = {"command": "sleep 1000"}
    no_grace = ws.config(calls={"grace_s": 0.0})
    async with (
        Pool(ws.workspace, journal=ws.journal("cancel"), config=ws.config()) as pool,
        Pool(ws.workspace, journal=ws.journal("cancel-kill"), config=no_grace) as kill_pool,
    ):
        rows = []
        cases = (
            (READ_FIFO, pool, "read", fifo, "read blocked on a FIFO (file tool)", "SIGKILL"),
            (BASH_TERM, pool, "bash", sleep, "bash `sleep 1000`, default grace 1 s", "SIGTERM"),
            (BASH_KILL, kill_pool, "bash", sleep, "bash `sleep 1000`, grace_s = 0", "SIGKILL"),
        )
        for key, on, tool, args, name, kill in cases:
            logger.info("cancel: {}, {} cancels", name, count)
            samples, statuses = await _cancel_many(on, tool, args, count)
            rows.append(CancelRow(key, f"sandbx-pool: {name}", kill, samples, statuses))
        left = leftovers(MARKER, ws.marker, pool_open=True)
    return rows, left


def _pebble(ws: BenchWorkspace, budget: Budget) -> CancelRow:
    gone, returned = Samples(), Samples()
    statuses: Counter[str] = Counter()
    logger.info("cancel: pebble disposable pool, up to {} cancels", budget.max_count)
    with pebble.ProcessPool(
        max_workers=1, max_tasks=1, context=multiprocessing.get_context("fork")
    ) as pool:
        for attempt in itertools.count():
            if not budget.more(gone.count):
                break
            pid_path = str(ws.root / f"pebble-{attempt}.pid")
            future: Future[str] = pool.schedule(read_fifo_task, args=(str(ws.fifo), pid_path))
            pidfd = os.pidfd_open(wait_for_pid_file(pid_path))
            try:
                time.sleep(SETTLE_S["read"])  # from pid written to blocked in open()
                start = time.perf_counter_ns()
                cancelled = future.cancel()
                returned.add(time.perf_counter_ns() - start)
                if not wait_gone(pidfd, 10.0):
                    statuses["worker still running after 10 s"] += 1
                    continue
                gone.add(time.perf_counter_ns() - start)
                statuses["cancelled" if cancelled else "cancel() returned False"] += 1
            finally:
                os.close(pidfd)
    return CancelRow(
        PEBBLE,
        "pebble ProcessPool(max_tasks=1): read blocked on the FIFO",
        "SIGTERM",
        gone,
        statuses,
        returned,
    )


def _unblock_fifo(path: str, timeout_s: float = 5.0) -> None:
    """Give a reader blocked opening ``path`` a writer that closes at once: it reads EOF."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # ENXIO: no reader yet
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.001)
            continue
        os.close(fd)
        return


def _ppe_cancel(ws: BenchWorkspace) -> bool:
    """What ``ProcessPoolExecutor``'s cancel() of a running task returns (once)."""
    logger.info("cancel: ProcessPoolExecutor, one cancel")
    with ProcessPoolExecutor(1, max_tasks_per_child=1) as pool:
        pid_path = str(ws.root / "ppe.pid")
        future = pool.submit(read_fifo_task, str(ws.fifo), pid_path)
        wait_for_pid_file(pid_path, timeout_s=30.0)
        time.sleep(SETTLE_S["read"])
        cancelled = future.cancel()
        # It runs on regardless: let its read finish (EOF) so that the pool can shut down.
        _unblock_fifo(str(ws.fifo))
        with contextlib.suppress(Exception):
            future.result(timeout=10)
    return cancelled


def run(ws: BenchWorkspace, *, count: int = 100, peer_count: int = 30) -> CancelResult:
    rows, left_open = asyncio.run(_sandbx(ws, count))
    left_closed = leftovers(MARKER, ws.marker)
    rows.append(_pebble(ws, Budget(peer_count, max_s=8, min_count=10)))
    ppe = _ppe_cancel(ws)
    return CancelResult(rows, left_open, left_closed, ppe)
